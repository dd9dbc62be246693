"""`spire train`: load the target and the text, build the run's :class:`TrainConfig`, train, summarise.

Works the same in one process and under ``torchrun --nproc_per_node N`` (data parallel; see
:mod:`spire.training.distill`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spire.errors import ConfigError


@dataclass
class TrainRunArgs:
    """What `spire train` was asked for. ``data``: "registry" (the registry texts of `spire data`) or paths of
    text files / folders. ``spire_overrides``: SpireConfig fields given explicitly (they win over --ablation).
    ``train_overrides``: TrainConfig fields given explicitly."""

    draft: str = "spire"
    target: str = "smollm2-135m"
    data: list[str] = field(default_factory=lambda: ["registry"])
    out: Path | None = None
    ablation: str = "none"
    resume: bool = False
    device: str = "auto"
    eval_windows: int = 16
    spire_overrides: dict = field(default_factory=dict)
    train_overrides: dict = field(default_factory=dict)
    resume_limits: dict = field(default_factory=dict)  # with resume: the new budget / step limit / intervals


def default_out(args: TrainRunArgs) -> Path:
    """``spire-runs/<draft>[-<ablation>]`` in the working folder."""
    name = args.draft if args.ablation == "none" else f"{args.draft}-{args.ablation}"
    return Path("spire-runs") / name


def build_config(args: TrainRunArgs):
    """The run's TrainConfig: the ablation's settings, then the explicit options. Raises ConfigError."""
    from spire.drafts.spire import SpireConfig
    from spire.training.distill import ABLATIONS, TrainConfig, ablation_config

    if args.ablation not in ABLATIONS:
        raise ConfigError(f"unknown ablation {args.ablation!r}; choose one of {', '.join(ABLATIONS)}")
    if args.draft == "vanilla" and (args.ablation != "none" or args.spire_overrides):
        raise ConfigError("ablation and SPIRe options apply to --draft spire only")
    if args.draft == "spire":
        cfg = ablation_config(args.ablation, **args.train_overrides)
        cfg.spire = SpireConfig(**{**cfg.spire.to_dict(), **args.spire_overrides})
    else:
        cfg = TrainConfig(draft=args.draft, **args.train_overrides)
    cfg.validate()
    return cfg


def saved_config(out: Path, limits: dict):
    """The TrainConfig of the run saved in ``out``, with new limits (budget_s, max_steps, checkpoint_every,
    eval_every) applied. Raises CheckpointError when there is nothing to resume."""
    from spire.drafts.spire import SpireConfig
    from spire.errors import CheckpointError
    from spire.training.distill import TrainConfig, load_state

    state = load_state(out)
    if state is None:
        raise CheckpointError(f"nothing to resume: {out} holds no checkpoint")
    saved = dict(state["config"])
    saved["spire"] = SpireConfig(**saved["spire"])
    saved.update(limits)
    return TrainConfig(**saved)


def load_data(spec: list[str], tokenizer, progress: bool):
    """Registry texts (``["registry"]``) or the user's files. Raises DataError."""
    from spire.data import prepare_data, prepare_text_files
    from spire.pipeline import document_separator_id

    eos = document_separator_id(tokenizer)
    if spec == ["registry"]:
        return prepare_data(tokenizer, eos_id=eos, progress=progress)
    return prepare_text_files(tokenizer, spec, eos_id=eos, progress=progress)


def heldout_windows(data, seq_len: int, n: int, seed: int = 1) -> torch.Tensor | None:
    """n held-out windows of seq_len tokens for the logged held-out loss and alpha (None if n == 0)."""
    if n <= 0:
        return None
    G = min(64, seq_len // 2)
    return data.heldout_contexts(seq_len - G, G, n, seed=seed)


def run(args: TrainRunArgs, log=print) -> dict:
    """Train as asked and return a summary dict (also printed by the CLI). Raises SpireError subclasses."""
    from spire.loading import load_target
    from spire.training.distill import init_distributed, train_draft

    out = args.out or default_out(args)
    cfg = saved_config(out, args.resume_limits) if args.resume else build_config(args)
    rank, world = init_distributed()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and world > 1:
        device = f"cuda:{torch.cuda.current_device()}"
    target, tokenizer, folder = load_target(args.target, device=device, progress=rank == 0)
    data = load_data(args.data, tokenizer, progress=rank == 0)
    cfg.data = data.manifest.get("key")
    heldout = heldout_windows(data, cfg.seq_len, args.eval_windows)
    if rank == 0:
        log(f"training a {cfg.draft} draft{'' if cfg.ablation == 'none' else f' (ablation {cfg.ablation})'} for "
            f"{args.target} on {device} x {world} process(es): {cfg.budget_s:g} s budget"
            + (f", at most {cfg.max_steps} steps" if cfg.max_steps else "") + f"; run folder {out}")
    model, state = train_draft(target, data, out, cfg, heldout=heldout, resume=args.resume, target_folder=folder,
                               progress=rank == 0, log=log)
    summary = {
        "run_dir": str(out), "draft": cfg.draft, "ablation": cfg.ablation, "loss": cfg.resolved_loss(),
        "steps": state["step"], "tokens": state["tokens"], "elapsed_s": round(state["elapsed_s"], 1),
        "tokens_per_s": round(state["tokens"] / max(state["elapsed_s"], 1e-9), 1), "processes": world,
        "draft_body_params": sum(p.numel() for p in model.layers.parameters()),
        "heldout": state.get("heldout"), "rank": rank,
        "draft_path": str(out / ("draft.safetensors" if cfg.draft == "spire" else "draft")),
    }
    if rank == 0:
        (Path(out) / "summary.json").write_text(json.dumps(summary, indent=1))
    if world > 1:  # leave the process group cleanly (gloo aborts a peer that exits while others still talk)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return summary
