"""The SPIRe paper's implementation-agnostic throughput model (Neelam et al. 2025, arXiv 2504.06419,
§"evaluation"; spec SPIRE.md §2).

One forward pass costs C FLOPs and reads N weight bytes plus KV cache bytes. On hardware that does HOI
FLOPs per byte of memory bandwidth (paper: 600, H100 SXM dense FP8 over HBM), with compute and memory
overlapping fully, its time in FLOP-equivalents is

    t = max(C, (N + KV) · HOI)

A speculative round drafts k tokens and verifies them in one target forward over k + 1 positions:

    Δt = [k · t_draft + t_verify] / t_target          (relative time of a round vs one AD step)
    throughput multiplier = τ / Δt                    (SD throughput over AD throughput)

Conventions (the paper's, so that its numbers come out exactly): every value is 1 byte; N counts body
parameters only; C = 2 · N · B per token; attention-score FLOPs are ignored; the k + 1 new tokens are not
counted in the target KV; τ does not depend on L.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

from spire import defaults
from spire.errors import ConfigError
import spire.registry as registry
from spire.throughput.shapes import DRAFTS, ModelShape, Preset, check_draft_kind

HOI = 600
"""Paper's hardware operational intensity, FLOPs per byte (H100 SXM dense FP8 / HBM bandwidth)."""

COMBINES = ("max", "sum")


@dataclass(frozen=True)
class Cost:
    """One forward pass: ``C`` FLOPs, ``N`` weight bytes and ``KV`` KV-cache bytes read.

    At the paper's 1 byte per value, N and KV are also counts of values."""

    C: float
    N: float
    KV: float


class RoundCosts(NamedTuple):
    """Costs of one speculative round's parts: one draft step, the verify pass, one AD target step."""

    draft: Cost
    verify: Cost
    target: Cost


@dataclass(frozen=True)
class CostOptions:
    """Choices beyond the paper, each off / at the paper's value by default (SPIRE.md §2 conventions).

    weight_bytes, kv_bytes: bytes per weight value and per KV-cache value (paper: 1 and 1).
    attention_flops: add attention-score FLOPs, 4·n_layers·n_heads·d_head per token per context token.
    embeddings: add the unembedding (2·vocab·d_model FLOPs per token, vocab·d_model values read per pass)
    and keep embedding / unembedding weights resident in memory (twice when untied).
    sink, window_divisor: the StreamingLLM draft cache holds sink + L // window_divisor tokens (paper: 1, 8);
    window: a fixed window in tokens instead (spire's own drafts: 64), so the draft cache stops growing.
    """

    weight_bytes: float = 1
    kv_bytes: float = 1
    attention_flops: bool = False
    embeddings: bool = False
    sink: int = defaults.SINK
    window_divisor: int = 8
    window: int | None = None

    def __post_init__(self) -> None:
        _check_positive("weight_bytes", self.weight_bytes)
        _check_positive("kv_bytes", self.kv_bytes)
        _check_positive_int("window_divisor", self.window_divisor)
        if isinstance(self.sink, bool) or not isinstance(self.sink, int) or self.sink < 0:
            raise ConfigError(f"sink must be a non-negative integer, got {self.sink!r}")
        if self.window is not None:
            _check_positive_int("window", self.window)

    def draft_window(self, L: int) -> int:
        """Tokens the StreamingLLM draft cache holds at context L: sink + window (or L // divisor), ≤ L."""
        if self.window is not None:
            return min(L, self.sink + self.window)
        return min(L, self.sink + L // self.window_divisor)



def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ConfigError(f"{name} must be a positive number, got {value!r}")
    return value


def _check_combine(combine: str) -> None:
    if combine not in COMBINES:
        raise ConfigError(f"combine must be one of {', '.join(COMBINES)}, got {combine!r}")


PAPER_OPTIONS = CostOptions()
"""The paper's conventions: 1 byte per value, no attention-score or embedding FLOPs, window 1 + L // 8."""


def forward_time(C: float, N: float, KV: float, hoi: float = HOI, combine: str = "max") -> float:
    """Time of one forward pass in FLOP-equivalents (paper §"evaluation").

    C: FLOPs; N, KV: weight and KV-cache bytes read; hoi: FLOPs per byte. ``combine="max"`` assumes
    compute and memory traffic overlap fully (the paper); ``"sum"`` assumes they do not overlap at all.
    Divide by the chip's FLOP/s for seconds.
    """
    _check_combine(combine)
    memory = (N + KV) * hoi
    return max(C, memory) if combine == "max" else C + memory


def _draft_window(L: int, sink: int, window_divisor: int) -> int:
    """Tokens a StreamingLLM draft cache holds at context L: sink + L // window_divisor (at most L)."""
    return min(L, sink + L // window_divisor)


def _check_contexts(contexts: Sequence[int]) -> list[int]:
    contexts = list(contexts)
    if not contexts:
        raise ConfigError("a mixed batch needs at least one context length")
    for L in contexts:
        _check_positive_int("context length", L)
    return contexts


def batch_costs(
    target: ModelShape,
    draft: ModelShape,
    draft_kind: str,
    contexts: Sequence[int],
    k: int = defaults.K,
    options: CostOptions = PAPER_OPTIONS,
) -> RoundCosts:
    """Costs of a round for a batch whose requests have context lengths ``contexts`` (B = len(contexts)).

    Weights are read once per pass for the whole batch; KV bytes and attention FLOPs add up over requests:
    KV_t = x_t·ΣL_i, KV_d = x_d·Σ window(L_i) (SPIRe, MagicDec) or x_d·ΣL_i (vanilla). With a uniform
    batch this is :func:`round_costs`. (The paper models uniform batches only; SPIRE.md §7.)
    """
    contexts = _check_contexts(contexts)
    windows = [options.draft_window(L) for L in contexts]
    return _costs(target, draft, draft_kind, len(contexts), sum(contexts), sum(windows), k, options)


def _costs(
    target: ModelShape, draft: ModelShape, draft_kind: str, B: int, sum_L: int, sum_window: int, k: int,
    o: CostOptions,
) -> RoundCosts:
    """Round costs from the batch's totals: B requests, ΣL context tokens, Σ draft-window tokens."""
    check_draft_kind(draft_kind)
    _check_positive_int("k", k)
    N_t = target.body_params()
    C_t = 2 * N_t * B
    read_t = N_t
    if o.embeddings:
        _check_vocab(target, "target")
        C_t += 2 * target.unembedding_params() * B
        read_t += target.unembedding_params()
    C_attn_t = target.attention_flops_per_token(sum_L) if o.attention_flops else 0
    KV_t = sum_L * target.kv_values_per_token() * o.kv_bytes
    target_step = Cost(C=C_t + C_attn_t, N=read_t * o.weight_bytes, KV=KV_t)
    verify = Cost(C=(k + 1) * target_step.C, N=target_step.N, KV=KV_t)

    pricing = registry.kind(draft_kind).pricing
    if pricing.weights == "none":  # no forward (n-gram lookup): priced at nothing; `spire bench` measures it
        return RoundCosts(draft=Cost(C=0, N=0, KV=0), verify=verify, target=target_step)
    N_d = draft.body_params()
    C_d = 2 * N_d * B
    read_d = N_d
    if o.embeddings:
        _check_vocab(draft, f"{draft_kind} draft")
        C_d += 2 * draft.unembedding_params() * B
        read_d += draft.unembedding_params()
    draft_tokens = {"full": sum_L, "window": sum_window, "none": 0}[pricing.kv]
    KV_d = draft_tokens * draft.kv_values_per_token() * o.kv_bytes
    if o.attention_flops:
        C_d += draft.attention_flops_per_token(draft_tokens)
    if pricing.memory_projection:
        C_d += 2 * (2 * draft.n_layers * draft.n_kv * draft.d_model * draft.d_head) * B
    return RoundCosts(draft=Cost(C=C_d, N=read_d * o.weight_bytes, KV=KV_d), verify=verify, target=target_step)


def _check_vocab(shape: ModelShape, label: str) -> None:
    if not shape.vocab_size:
        raise ConfigError(f"counting embeddings needs the {label}'s vocab_size, which this model shape lacks")


def round_costs(
    target: ModelShape,
    draft: ModelShape,
    draft_kind: str,
    B: int,
    L: int,
    k: int = defaults.K,
    options: CostOptions = PAPER_OPTIONS,
) -> RoundCosts:
    """FLOPs and bytes of each forward in a round at batch B, context L (paper conventions, SPIRE.md §2).

    - target step: C = 2·N_t·B, KV_t = B·L·x_t, with x = 2·n_layers·n_kv·d_head values per token;
    - verify: the same bytes, C = (k+1)·2·N_t·B;
    - vanilla draft: its own full KV cache, C_d = 2·N_d·B;
    - MagicDec: the target over a StreamingLLM cache, N_d = N_t, KV_d = B·(sink + L//8)·x_t;
    - SPIRe: KV_d = B·(sink + L//8)·x_d, and C_d adds 2·(2·n_layers_d·n_kv_d·d_model_d·d_head_d)·B for
      projecting each new memory vector to a key and a value.
    For MagicDec pass ``draft=target``. ``options``: :class:`CostOptions` (default: the paper's).
    """
    for name, value in (("B", B), ("L", L), ("k", k)):
        _check_positive_int(name, value)
    return _costs(target, draft, draft_kind, B, B * L, B * options.draft_window(L), k, options)


def _shapes(model: Preset | tuple[ModelShape, ModelShape], draft_kind: str) -> tuple[ModelShape, ModelShape]:
    """(target, draft) shapes for ``draft_kind`` from a preset or a (target, draft) pair."""
    if isinstance(model, Preset):
        return model.target, model.draft_shape(draft_kind)
    target, draft = model
    check_draft_kind(draft_kind)
    return target, (target if registry.kind(draft_kind).pricing.weights == "target" else draft)


def delta_t(
    model: Preset | tuple[ModelShape, ModelShape],
    draft_kind: str,
    B: int,
    L: int,
    k: int = defaults.K,
    hoi: float = HOI,
    combine: str = "max",
    options: CostOptions = PAPER_OPTIONS,
) -> float:
    """Δt: time of one speculative round relative to one AD target step (dimensionless; paper §"evaluation").

        Δt = [k·t(C_d, N_d, KV_d) + t((k+1)·C_t, N_t, KV_t)] / t(C_t, N_t, KV_t)

    ``model`` is a :class:`Preset` or a (target, draft) shape pair (the draft is ignored for MagicDec).
    """
    _check_positive("hoi", hoi)
    costs = round_costs(*_shapes(model, draft_kind), draft_kind, B, L, k, options)
    return _delta_t(costs, k, hoi, combine)


def _delta_t(costs: RoundCosts, k: int, hoi: float, combine: str) -> float:
    def t(c: Cost) -> float:
        return forward_time(c.C, c.N, c.KV, hoi, combine)

    return (k * t(costs.draft) + t(costs.verify)) / t(costs.target)


def multiplier(tau: float, delta_t: float) -> float:
    """Throughput multiplier (the paper's "speedup") = τ / Δt: SD tokens per unit time over AD's."""
    return tau / delta_t


def verify_operational_intensity(shape: ModelShape, B: int, L: int, k: int = defaults.K) -> float:
    """OI of verification in FLOPs per byte: OI(B) = 2·N·(B·k) / (N + B·L·x) (paper Figure 3).

    Verification is compute-bound where OI ≥ HOI.
    """
    for name, value in (("B", B), ("L", L), ("k", k)):
        _check_positive_int(name, value)
    N = shape.body_params()
    return 2 * N * (B * k) / (N + B * L * shape.kv_values_per_token())


def critical_batch_size(
    shape: ModelShape, L: int, k: int = defaults.K, hoi: float = HOI, B_max: int | None = None
) -> int | None:
    """B_crit: the smallest B with OI(B) ≥ HOI (paper Figure 3), or None if there is none (≤ B_max).

    OI(B) rises towards 2·N·k / (L·x) as B grows, so for long enough L verification is never
    compute-bound. Solved exactly: B ≥ HOI·N / (2·N·k − HOI·L·x).
    """
    _check_positive_int("L", L)
    _check_positive_int("k", k)
    hoi = Fraction(_check_positive("hoi", hoi))
    N = shape.body_params()
    slope = 2 * N * k - hoi * L * shape.kv_values_per_token()
    if slope <= 0:
        return None
    B = max(1, math.ceil(hoi * N / slope))
    return None if B_max is not None and B > B_max else B


def tau_from_alpha(alpha: float, k: int) -> float:
    """τ(k) = (1 − α^{k+1}) / (1 − α): expected tokens per round when each draft token is accepted
    independently with probability α (Leviathan et al. 2023, eq. 1); k + 1 when α = 1."""
    _check_positive_int("k", k)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ConfigError(f"alpha must be a number in [0, 1], got {alpha!r}")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def saving_units(multiplier: float, training_cost: float = 0.25, serving_cost: float = 10.0) -> float:
    """The paper's cost-to-benefit analysis, in units of the target's training cost: serving with AD
    costs ``serving_cost`` (10), SD at throughput multiplier m costs serving_cost/m, and training the
    draft costs ``training_cost`` (SPIRe ≈ 0.25), so saving = 10·(1 − 1/m) − 0.25."""
    _check_positive("multiplier", multiplier)
    return serving_cost * (1 - 1 / multiplier) - training_cost


def draft_training_cost(preset: Preset, draft_kind: str, spire_cost: float = 0.25) -> float:
    """Training cost of a draft in units of the target's training cost: MagicDec 0 (no training), SPIRe
    ``spire_cost`` (paper: 0.25), vanilla N_d / N_t (its share of the body, trained on as many tokens;
    an assumption: the paper gives no figure for it)."""
    check_draft_kind(draft_kind)
    declared = registry.kind(draft_kind).pricing.training_cost
    if draft_kind == "spire":
        return spire_cost
    if declared is not None:
        return declared
    return preset.draft_shape(draft_kind).body_params() / preset.target.body_params()


def resident_bytes(target: ModelShape, draft: ModelShape, draft_kind: str, costs: RoundCosts,
                   options: CostOptions = PAPER_OPTIONS) -> float:
    """Bytes resident in device memory for a round (CASES.md 10): target weights + target KV + draft
    weights + draft KV. MagicDec's draft is the target over its own cache and adds nothing; with
    ``options.embeddings`` the embedding tables count too (a SPIRe draft shares the target's)."""
    wb = options.weight_bytes
    resident = target.body_params() * wb + costs.target.KV
    if options.embeddings:
        resident += target.embedding_params() * wb
    pricing = registry.kind(draft_kind).pricing
    if pricing.weights == "own":
        resident += draft.body_params() * wb + costs.draft.KV
        if options.embeddings and pricing.own_embeddings:
            resident += draft.embedding_params() * wb
    return resident


@dataclass(frozen=True)
class RowOptions:
    """Settings of :func:`throughput_rows` beyond the (B, L) grid; each default is the paper's (SPIRE.md §2).

    k: draft tokens per round. hoi: FLOPs per byte. combine: "max" (compute and memory overlap) or "sum".
    taus: overrides of the preset's τ per draft kind (1 ≤ τ ≤ k+1). memory_bytes: device memory in bytes; a
    point whose resident set (:func:`resident_bytes`) exceeds it gets "fits": false and null "delta_t" and
    "multiplier" (CASES.md 10); None: "fits" is None (not checked). cost: :class:`CostOptions` (bytes per
    weight / KV value, attention FLOPs, embeddings, the draft's window).

    Beyond the paper (all off by default):
    - contexts: per-request context lengths of ONE mixed batch (replaces Bs and Ls); rows get B = len,
      L = the rounded mean, "contexts" (min / mean / max) and "uniform_multiplier" at B × mean L;
    - alphas: acceptance rate α per draft; τ becomes τ(k) = (1 − α^{k+1})/(1 − α) ("tau_source" alpha);
      with best_k_max, rows add "best_k", "best_k_tau", "best_k_multiplier" over k = 1..best_k_max;
    - flops_per_s: the chip's FLOP/s, for "ad_tokens_per_s" and "sd_tokens_per_s";
    - cost_analysis: adds "saving_units" = 10·(1 − 1/m) − training_cost (paper's cost analysis).
    """

    k: int = defaults.K
    hoi: float = HOI
    combine: str = "max"
    taus: Mapping[str, float] | None = None
    memory_bytes: float | None = None
    cost: CostOptions = PAPER_OPTIONS
    contexts: Sequence[int] | None = None
    alphas: Mapping[str, float] | None = None
    best_k_max: int | None = None
    flops_per_s: float | None = None
    cost_analysis: bool = False
    training_cost: float = 0.25

    def check(self) -> None:
        """Raise ConfigError for impossible settings."""
        _check_positive_int("k", self.k)
        _check_positive("hoi", self.hoi)
        _check_combine(self.combine)
        for name in ("memory_bytes", "flops_per_s"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.best_k_max is not None:
            _check_positive_int("best_k_max", self.best_k_max)
        both = sorted(set(self.alphas or {}) & set(self.taus or {}))
        if both:
            raise ConfigError(f"give tau or alpha for {both[0]}, not both")
        for draft in self.alphas or {}:
            check_draft_kind(draft)


def throughput_rows(preset: Preset, Bs: Iterable[int] = (64,), Ls: Iterable[int] = (512,),
                    options: RowOptions = RowOptions()) -> list[dict[str, Any]]:
    """The cost model over a grid: one row per draft with a τ (the paper's vanilla, magicdec, spire; eagle3 and ngram
    when their τ is given) per (B, L), B outermost.

    Each row holds "draft", "B", "L", "tau", "delta_t", "multiplier" (the public contract) and also
    "k", "hoi", "combine", "tau_source", "memory_bytes_needed" and "fits", plus the columns that
    :class:`RowOptions` asks for. Raises ConfigError for impossible settings.
    """
    o = options
    o.check()
    alphas = dict(o.alphas or {})
    resolved = _resolve_taus(preset, o.k, {**(o.taus or {}), **{d: tau_from_alpha(a, o.k) for d, a in alphas.items()}})
    for draft, a in alphas.items():
        resolved[draft] = (resolved[draft][0], f"alpha={a:g}")
    return [_row(preset, draft, B, L, batch, *resolved[draft], o) for B, L, batch in _grid_points(Bs, Ls, o.contexts)
            for draft in resolved]


def _point_costs(preset: Preset, draft: str, B: int, L: int, batch: list[int] | None, k: int, cost: CostOptions
                 ) -> RoundCosts:
    shapes = (preset.target, preset.draft_shape(draft))
    if batch is None:
        return round_costs(*shapes, draft, B, L, k, cost)
    return batch_costs(*shapes, draft, batch, k, cost)


def _row(preset: Preset, draft: str, B: int, L: int, batch: list[int] | None, tau: float, tau_source: str,
         o: RowOptions) -> dict[str, Any]:
    """One row of :func:`throughput_rows`."""
    k, hoi, combine = o.k, o.hoi, o.combine
    costs = _point_costs(preset, draft, B, L, batch, k, o.cost)
    needed = resident_bytes(preset.target, preset.draft_shape(draft), draft, costs, o.cost)
    fits = None if o.memory_bytes is None else needed <= o.memory_bytes
    dt = m = None
    if fits is not False:
        dt = _delta_t(costs, k, hoi, combine)
        m = multiplier(tau, dt)
    row = {
        "draft": draft, "B": B, "L": L, "tau": tau, "delta_t": dt, "multiplier": m, "k": k, "hoi": hoi,
        "combine": combine, "tau_source": tau_source, "memory_bytes_needed": needed, "fits": fits,
    }  # fmt: skip
    if batch is not None:
        row["contexts"] = {"n": B, "min": min(batch), "mean": sum(batch) / B, "max": max(batch)}
        uniform = round_costs(preset.target, preset.draft_shape(draft), draft, B, L, k, o.cost)
        row["uniform_multiplier"] = None if m is None else multiplier(tau, _delta_t(uniform, k, hoi, combine))
    if o.flops_per_s is not None and m is not None:
        t_ad = forward_time(costs.target.C, costs.target.N, costs.target.KV, hoi, combine) / o.flops_per_s
        row["ad_tokens_per_s"] = B / t_ad
        row["sd_tokens_per_s"] = B / t_ad * m
    if o.cost_analysis and m is not None:
        row["saving_units"] = saving_units(m, draft_training_cost(preset, draft, o.training_cost))
    if o.best_k_max is not None and draft in (o.alphas or {}) and m is not None:
        alpha = o.alphas[draft]

        def multiplier_at(k_: int) -> float:
            return tau_from_alpha(alpha, k_) / _delta_t(_point_costs(preset, draft, B, L, batch, k_, o.cost), k_,
                                                        hoi, combine)
        best = max(range(1, o.best_k_max + 1), key=multiplier_at)
        row["best_k"], row["best_k_tau"] = best, tau_from_alpha(alpha, best)
        row["best_k_multiplier"] = multiplier_at(best)
    return row


def _grid_points(Bs: Iterable[int], Ls: Iterable[int], contexts: Sequence[int] | None
                 ) -> list[tuple[int, int, list[int] | None]]:
    """(B, L, batch) of every grid point: one mixed batch of ``contexts`` (B = its size, L = its rounded mean),
    else B × L uniform points (batch None). Raises ConfigError on an empty or non-positive B or L."""
    if contexts is not None:
        contexts = _check_contexts(contexts)
        n = len(contexts)
        return [(n, round(sum(contexts) / n), contexts)]
    Bs, Ls = list(Bs), list(Ls)
    for name, values in (("B", Bs), ("L", Ls)):
        if not values:
            raise ConfigError(f"give at least one {name}")
        for value in values:
            _check_positive_int(name, value)
    return [(B, L, None) for B in Bs for L in Ls]


def _resolve_taus(preset: Preset, k: int, overrides: Mapping[str, float]) -> dict[str, tuple[float, str]]:
    """(τ, source) per draft kind that has one (the preset's or an override: a kind the paper did not measure, such
    as EAGLE-3 or n-gram, gets rows only when its τ is given), in :data:`DRAFTS` order; τ must lie in [1, k+1]
    (the bonus token is always emitted)."""
    for draft in overrides:
        check_draft_kind(draft)
    resolved = {}
    for draft in DRAFTS:
        if draft in overrides:
            tau, source = overrides[draft], "override"
        elif draft not in preset.taus:
            continue
        else:
            tau, source = preset.taus[draft], preset.tau_source
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 1 <= tau <= k + 1:
            raise ConfigError(f"tau for {draft} must be a number in [1, k+1] = [1, {k + 1}], got {tau!r} ({source})")
        resolved[draft] = (float(tau), source)
    return resolved
