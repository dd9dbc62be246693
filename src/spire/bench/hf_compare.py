"""spire's own decoding loops against HF transformers ``generate`` on the same model, dtype, prompts and batch.

Both sides decode greedily from the same B prompts of equal length (real held-out contexts, so no padding is
involved) for exactly G new tokens (HF's EOS is switched off, spire gets no EOS ids), in one process, the
methods interleaved over ``repeats`` rounds so that background load hits them alike; the best (minimum)
time per method is reported. Times are wall-clock, or (``clock="cpu"``) the process's CPU time: on a shared
machine a single-threaded run's CPU time leaves out the time slices other jobs took.

- end-to-end tokens/s = B·G / wall time of one ``generate`` call (prefill included);
- decode tokens/s = steady-state rate without the prefill: for spire B·G / ``GenerationResult.decode_s``;
  for HF B·(G − 1) / (t(G) − t(1)), t(1) being a ``generate`` call for one token (the prefill and the first
  token);
- identical: the greedy token ids equal HF's AD output, row by row.

Rows: HF AD, spire AD, spire SD with MagicDec; at B = 1 with a vanilla draft also HF assisted generation
(``assistant_model``) and spire SD with that draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from spire import defaults
from spire.drafts.magicdec import MagicDecDraft
from spire.drafts.vanilla import VanillaDraft
from spire.errors import ConfigError
from spire.engine.engine import generate_batch
from spire.timing import Stopwatch


@dataclass
class HFCompareConfig:
    """Bs: batch sizes; L: prompt tokens; G: new tokens; k, sink, window: SD settings; repeats: timed rounds."""

    Bs: list[int] = field(default_factory=lambda: [1, 8])
    L: int = 128
    G: int = 64
    k: int = defaults.K
    sink: int = defaults.SINK
    window: int = defaults.WINDOW
    repeats: int = 3
    seed: int = 0
    clock: str = "wall"  # "cpu": process CPU time (single-threaded CPU runs on a shared machine)


def hf_generate(hf, ids: torch.Tensor, G: int, assistant=None) -> list[list[int]]:
    """Greedy HF generate of exactly G tokens (EOS off); returns the new token ids per row."""
    gen_cfg = hf.generation_config
    kw = dict(max_new_tokens=G, do_sample=False, eos_token_id=None, pad_token_id=gen_cfg.pad_token_id or 0,
              attention_mask=torch.ones_like(ids))
    if assistant is not None:
        kw["assistant_model"] = assistant
    with torch.no_grad():
        out = hf.generate(ids, **kw)
    return out[:, ids.shape[1]:].tolist()


def compare(target, hf, contexts: torch.Tensor, cfg: HFCompareConfig, vanilla=None, hf_vanilla=None,
            log: Callable[[str], None] = lambda m: None) -> list[dict[str, Any]]:
    """Run every method at every B; one result row per (B, method).

    Args:
        target: spire Transformer; hf: the HF model with the same weights (same dtype and device).
        contexts: (≥ max B, ≥ L) int64 prompts.
        vanilla / hf_vanilla: optional draft model as spire Transformer / HF model (B = 1 rows only).
    Returns rows {"B", "method", "tokens_per_s", "decode_tokens_per_s", "seconds", "identical", "tau", ...}.
    Raises ConfigError when contexts are too few or too short.
    """
    if contexts.shape[0] < max(cfg.Bs) or contexts.shape[1] < cfg.L:
        raise ConfigError(f"need {max(cfg.Bs)} contexts of {cfg.L} tokens, got {tuple(contexts.shape)}")
    need = cfg.L + cfg.G + cfg.k + 1  # prompt, new tokens, and the k + 1 positions a last verify may write
    if need > target.cfg.max_positions:
        raise ConfigError(f"L = {cfg.L} plus G = {cfg.G} new tokens (and k + 1 = {cfg.k + 1} for speculative rounds) "
                          f"need {need} positions; the target has {target.cfg.max_positions}")
    dev = target.device
    if cfg.clock == "cpu" and dev.type != "cpu":
        raise ConfigError("clock cpu measures CPU time: only for runs on the CPU")
    rows: list[dict[str, Any]] = []
    for B in cfg.Bs:
        ids = contexts[:B, : cfg.L].to(dev)
        lists = ids.tolist()
        methods: dict[str, Callable[[], Any]] = {
            "HF generate (AD)": lambda: hf_generate(hf, ids, cfg.G),
            "HF generate, 1 token": lambda: hf_generate(hf, ids, 1),
            "spire AD": lambda: generate_batch(target, lists, cfg.G),
            "spire SD MagicDec": lambda: generate_batch(target, lists, cfg.G, draft=MagicDecDraft(cfg.sink, cfg.window),
                                                  k=cfg.k),
        }
        if B == 1 and vanilla is not None and hf_vanilla is not None:
            methods["HF assisted (vanilla)"] = lambda: hf_generate(hf, ids, cfg.G, assistant=hf_vanilla)
            methods["spire SD vanilla"] = lambda: generate_batch(target, lists, cfg.G, draft=VanillaDraft(vanilla), k=cfg.k)
        best: dict[str, tuple[float, Any]] = {}
        log(f"B={B}: warm-up (spire builds its fused / transposed weight copies on first use)")
        hf_generate(hf, ids, 2)
        generate_batch(target, lists, 2)
        generate_batch(target, lists, 2 * cfg.k, draft=MagicDecDraft(cfg.sink, cfg.window), k=cfg.k)
        if "spire SD vanilla" in methods:
            generate_batch(target, lists, 2 * cfg.k, draft=VanillaDraft(vanilla), k=cfg.k)
            hf_generate(hf, ids, 2, assistant=hf_vanilla)
        for rep in range(cfg.repeats):
            for name, fn in methods.items():
                log(f"B={B}: round {rep + 1}/{cfg.repeats}: {name}")
                watch = Stopwatch(dev)
                out = fn()
                t = watch.seconds(cfg.clock)
                if name not in best or t < best[name][0]:
                    best[name] = (t, out)
        ref = best["HF generate (AD)"][1]
        t_hf1 = best["HF generate, 1 token"][0]
        for name, (t, out) in best.items():
            if name == "HF generate, 1 token":
                continue
            spire_res = not isinstance(out, list)
            tokens = out.tokens if spire_res else out
            row = {"B": B, "L": cfg.L, "G": cfg.G, "method": name, "seconds": t,
                   "tokens_per_s": B * cfg.G / t, "identical": tokens == ref,
                   "tau": out.tau if spire_res else None}
            row["clock"] = cfg.clock
            if spire_res:
                row["decode_tokens_per_s"] = B * cfg.G / (out.decode_cpu_s if cfg.clock == "cpu" else out.decode_s)
                row["prefill_s"] = out.prefill_s
            elif "assisted" not in name:
                row["decode_tokens_per_s"] = B * (cfg.G - 1) / max(1e-9, t - t_hf1)
                row["prefill_s"] = t_hf1
            else:
                row["decode_tokens_per_s"] = None
            rows.append(row)
        hf_row = next(r for r in rows if r["B"] == B and r["method"] == "HF generate (AD)")
        for r in rows:
            if r["B"] == B:
                r["ratio_vs_hf"] = r["tokens_per_s"] / hf_row["tokens_per_s"]
                r["decode_ratio_vs_hf"] = (r["decode_tokens_per_s"] / hf_row["decode_tokens_per_s"]
                                           if r.get("decode_tokens_per_s") else None)
    return rows

