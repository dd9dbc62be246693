"""The main job, ``spire reproduce``: data -> SPIRe draft training -> τ for MagicDec and SPIRe -> cost model
-> report. Every step caches what it derives, so a second run reuses the converted target, the token data
and a finished draft (see :func:`spire.paths.spire_cache_dir`).
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from spire.errors import ConfigError
from spire.paths import spire_cache_dir

PRESETS = {"smollm2-135m": "smollm2-135m"}  # reproduce preset -> target checkpoint spec


@dataclass
class ReproduceConfig:
    """Settings of the main job. budget_s: SPIRe training seconds. n_contexts: held-out contexts per τ."""

    preset: str = "smollm2-135m"
    target: str | None = None  # a .gguf file or HF Llama-family folder instead of the preset's checkpoint
    out: Path = Path("spire-out")
    budget_s: float = 1200.0
    L: int = 512
    G: int = 64
    k: int = 4
    n_contexts: int = 32
    temperatures: tuple[float, ...] = (0.0, 1.0)
    batch_size: int = 8
    n_draft_layers: int = 8
    sink: int = 1
    window: int = 64
    seed: int = 0
    grid_B: tuple[int, ...] = (1, 4, 16, 64, 256)
    grid_L: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    alpha_windows: int = 16
    quick: bool = False

    @classmethod
    def quick_config(cls, **kw) -> "ReproduceConfig":
        """Smoke-test settings: finishes in a few minutes on 2 CPU cores."""
        base = dict(budget_s=60.0, n_contexts=8, L=256, G=32, alpha_windows=4, quick=True)
        base.update(kw)
        return cls(**base)

    def validate(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        for name in ("L", "G", "k", "n_contexts", "batch_size", "n_draft_layers", "window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if not self.budget_s > 0:
            raise ConfigError(f"training budget must be positive, got {self.budget_s} s")
        if any(not t >= 0 for t in self.temperatures):
            raise ConfigError("temperatures must be >= 0")
        if any(b < 1 for b in self.grid_B) or any(x < 1 for x in self.grid_L):
            raise ConfigError("the B and L grids take positive integers")


def document_separator_id(tokenizer) -> int | None:
    """The id that separates documents in pretraining (``<|endoftext|>`` for SmolLM2), else EOS."""
    for token in ("<|endoftext|>", "</s>", "<eos>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            return tid
    return tokenizer.eos_token_id


def _draft_dir(cfg: ReproduceConfig, train_cfg, folder: Path) -> Path:
    name = cfg.preset if cfg.target is None else Path(folder).name
    key = hashlib.sha1(json.dumps({"target": str(Path(folder).resolve()), "train": asdict(train_cfg)},
                                  sort_keys=True, default=str).encode()).hexdigest()[:10]
    return spire_cache_dir() / "drafts" / f"{name}-spire-{key}"


def reproduce(cfg: ReproduceConfig, progress: bool = True, log=print) -> dict:
    """Run the whole job and write REPORT.md, results.json and PNG figures to ``cfg.out``.

    Returns the results dict (also written as results.json). Raises SpireError subclasses on bad input,
    before anything is written to the output folder.
    """
    from spire.data import prepare_data
    from spire.drafts.magicdec import MagicDecDraft
    from spire.drafts.spire import SpireConfig, SpireDraft
    from spire.evaluation.report import write_report
    from spire.evaluation.tau import measure_tau
    from spire.loading import load_target
    from spire.sampling import SamplingParams
    from spire.training.distill import TrainConfig, evaluate_alpha, train_spire

    cfg.validate()
    t_start = time.time()
    timings: dict[str, float] = {}
    torch.manual_seed(cfg.seed)

    log(f"[1/5] target: {cfg.target or cfg.preset}")
    t = time.time()
    target, tokenizer, folder = load_target(cfg.target or PRESETS[cfg.preset], progress=progress)
    if cfg.L + cfg.G + cfg.k + 1 > target.cfg.max_positions:
        raise ConfigError(f"context L={cfg.L} + G={cfg.G} + k+1 exceeds the target's "
                          f"{target.cfg.max_positions} positions")
    timings["load_target_s"] = time.time() - t

    log("[2/5] data: registry texts, held-out split by document")
    t = time.time()
    data = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), progress=progress)
    contexts = data.heldout_contexts(cfg.L, cfg.G, cfg.n_contexts, seed=cfg.seed)[:, : cfg.L]
    timings["data_s"] = time.time() - t

    train_cfg = TrainConfig(budget_s=cfg.budget_s, k=cfg.k, seed=cfg.seed,
                            spire=SpireConfig(n_draft_layers=cfg.n_draft_layers, sink=cfg.sink, window=cfg.window))
    run_dir = _draft_dir(cfg, train_cfg, folder)
    log(f"[3/5] SPIRe draft: {cfg.n_draft_layers} of {target.cfg.n_layers} target layers, "
        f"{cfg.budget_s:.0f} s budget, run folder {run_dir}")
    t = time.time()
    spire_model, state = train_spire(target, data, run_dir, train_cfg, progress=progress)
    timings["train_s"] = time.time() - t
    windows = data.heldout_contexts(192, 64, cfg.alpha_windows, seed=cfg.seed + 1)  # 256-token windows
    alpha = evaluate_alpha(spire_model, target, windows, cfg.k)
    log(f"      held-out alpha per drafted position: {', '.join(f'{a:.3f}' for a in alpha)}")

    log(f"[4/5] tau: {cfg.n_contexts} held-out contexts, L={cfg.L}, G={cfg.G}, k={cfg.k}")
    t = time.time()
    drafts = [MagicDecDraft(cfg.sink, cfg.window), SpireDraft(spire_model)]
    taus = []
    for temperature in cfg.temperatures:
        for draft in drafts:
            r = measure_tau(target, draft, contexts, G=cfg.G, k=cfg.k, params=SamplingParams(temperature),
                            batch_size=cfg.batch_size, seed=cfg.seed, progress=progress)
            log(f"      {r.draft:8s} T={temperature:g}: tau {r.tau:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] "
                f"({r.wall_s:.0f} s)")
            taus.append(r)
    timings["tau_s"] = time.time() - t

    log("[5/5] throughput model and report")
    results = {
        "preset": cfg.preset,
        "config": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                   for k, v in asdict(cfg).items()},
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                        "threads": torch.get_num_threads(), "device": str(target.device)},
        "target": {"name": cfg.target or cfg.preset, "checkpoint": str(folder), "config": target.cfg.to_dict(),
                   "layers": target.cfg.n_layers, "d_model": target.cfg.d_model,
                   "body_params": target.num_body_params()},
        "data": data.summary(),
        "training": {"run_dir": str(run_dir), "steps": state["step"], "tokens": state["tokens"],
                     "elapsed_s": state["elapsed_s"], "bf16": train_cfg.bf16, "lr": train_cfg.lr,
                     "omega": train_cfg.omega, "batch_size": train_cfg.batch_size, "seq_len": train_cfg.seq_len,
                     "draft_body_params": sum(p.numel() for p in spire_model.layers.parameters()),
                     "heldout_alpha_per_position": alpha, "history": state["history"]},
        "tau": [r.to_dict() for r in taus],
        "timings": timings,
    }
    write_report(results, cfg, t_start)
    return results
