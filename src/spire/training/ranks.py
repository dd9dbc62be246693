"""The processes of data-parallel training: this process's rank and the world size, ``torch.distributed`` set up
from torchrun's environment, and the wait on work that rank 0 does alone (with a deadline of days, not the
process group's 30 minutes). Spawning the processes without torchrun is :mod:`spire.training.parallel`'s job.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def _distributed():
    """(torch.distributed or None, rank, world size)."""
    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_rank(), dist.get_world_size()
    return None, 0, 1


WAIT_DEADLINE = datetime.timedelta(days=7)
"""How long a process waits for work that rank 0 does alone (a target cache build, an evaluation, a checkpoint
write): far beyond any of them, where the process group's own default (30 minutes) is shorter than a cache
build of a large target (Lightning #19266)."""
_WAIT_GROUPS: dict = {}


def wait_for_rank0(dist_module) -> None:
    """A barrier over every process in a gloo group whose deadline is :data:`WAIT_DEADLINE` (created by the first
    call, which every process makes at the same point), for waits on rank-0-only work."""
    key = id(dist_module.distributed_c10d._get_default_group())
    if key not in _WAIT_GROUPS:
        _WAIT_GROUPS.clear()  # a group of an earlier process group is gone with it
        _WAIT_GROUPS[key] = dist_module.new_group(backend="gloo", timeout=WAIT_DEADLINE)
    dist_module.barrier(group=_WAIT_GROUPS[key])


def init_distributed() -> tuple[int, int]:
    """Initialize torch.distributed from torchrun's environment (WORLD_SIZE > 1): gloo on CPU, NCCL on CUDA.
    Returns (rank, world size); (0, 1) outside torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    _, rank, world = _distributed()
    return rank, world
