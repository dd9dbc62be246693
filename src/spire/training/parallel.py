"""Data-parallel training on one machine without torchrun: N spawned processes over gloo.

On a CPU, two single-thread processes that each take half of every global batch train faster than one process
with two threads (SmolLM2-135M, SPIRe draft, batch 4 x 256, bf16 autocast, 2 cores: about 310 tokens/s per
single-thread process against 450 tokens/s for one two-thread process). :func:`train_in_processes` runs
:func:`spire.training.trainer.train_draft` in ``n_processes`` processes (the same code path as under torchrun:
each rank takes its rows of the same global batch and the gradients are averaged, so the run trains on the same
batches as a single process), then loads the finished run in the calling process. The target cache, when the
run uses one, is built first in the calling process with all its threads, so the workers only open it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spire.errors import ConfigError, TrainingError
from spire.training.checkpoint import load_state
from spire.training.config import TrainConfig
from spire.training.evaluate import make_source
from spire.training.step import _build_model, fast_bf16
from spire.training.trainer import train_draft


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, threads: int, target, data, out_dir: Path, cfg, heldout,
            target_folder, progress: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train_draft(target, data, out_dir, cfg, heldout=heldout, target_folder=target_folder,
                    progress=progress and rank == 0, log=print if rank == 0 else None)
    finally:
        dist.destroy_process_group()


def train_in_processes(target, data, out_dir: Path, cfg: TrainConfig, n_processes: int, threads: int = 1,
                       heldout: torch.Tensor | None = None, target_folder: Path | None = None,
                       progress: bool = True, log=print) -> tuple[torch.nn.Module, dict]:
    """:func:`~spire.training.trainer.train_draft` in ``n_processes`` spawned processes of ``threads`` torch
    threads each; returns (model, final state) as train_draft does, loaded from the finished run folder.

    A run folder that already holds a finished run is loaded without spawning anything; an interrupted one is
    resumed by the workers exactly as train_draft resumes it. Raises what train_draft raises (ConfigError for a
    global batch not divisible by ``n_processes``), or TrainingError when a worker fails.
    """
    cfg = TrainConfig() if cfg is None else cfg
    if n_processes < 2:
        return train_draft(target, data, out_dir, cfg, heldout=heldout, target_folder=target_folder,
                           progress=progress, log=log)
    if cfg.batch_size % n_processes:
        raise ConfigError(f"the global batch {cfg.batch_size} must be divisible by the {n_processes} processes")
    if cfg.bf16 is None:
        cfg.bf16 = fast_bf16(target.device)
    state = load_state(Path(out_dir))
    if state is None or not state.get("finished"):
        if cfg.target_cache is not None and cfg.data_steps:  # built here, with every thread
            make_source(target, data, _build_model(target, cfg, data), cfg, target_folder, progress, log)
        if log is not None:
            log(f"      training in {n_processes} processes x {threads} thread(s) (data parallel, gloo)")
        try:
            mp.start_processes(_worker, args=(n_processes, _free_port(), threads, target, data, Path(out_dir), cfg,
                                              heldout, target_folder, progress),
                               nprocs=n_processes, join=True, start_method="spawn")
        except mp.ProcessRaisedException as e:
            raise TrainingError(f"a training process failed: {str(e).strip().splitlines()[-1]}") from None
    return train_draft(target, data, out_dir, cfg, heldout=heldout, target_folder=target_folder,
                       progress=False, log=log)
