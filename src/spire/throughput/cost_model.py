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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

from spire.errors import ConfigError
from spire.throughput.shapes import DRAFTS, ModelShape, Preset, check_draft_kind

HOI = 600
"""Paper's hardware operational intensity, FLOPs per byte (H100 SXM dense FP8 / HBM bandwidth)."""

COMBINES = ("max", "sum")


@dataclass(frozen=True)
class Cost:
    """One forward pass: ``C`` FLOPs, ``N`` weight bytes and ``KV`` KV-cache bytes read."""

    C: int
    N: int
    KV: int


class RoundCosts(NamedTuple):
    """Costs of one speculative round's parts: one draft step, the verify pass, one AD target step."""

    draft: Cost
    verify: Cost
    target: Cost


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


def forward_time(C: float, N: float, KV: float, hoi: float = HOI, combine: str = "max") -> float:
    """Time of one forward pass in FLOP-equivalents (paper §"evaluation").

    C: FLOPs; N, KV: weight and KV-cache bytes read; hoi: FLOPs per byte. ``combine="max"`` assumes
    compute and memory traffic overlap fully (the paper); ``"sum"`` assumes they do not overlap at all.
    """
    _check_combine(combine)
    memory = (N + KV) * hoi
    return max(C, memory) if combine == "max" else C + memory


def _draft_window(L: int, sink: int, window_divisor: int) -> int:
    """Tokens a StreamingLLM draft cache holds at context L: sink + L // window_divisor (at most L)."""
    return min(L, sink + L // window_divisor)


def round_costs(
    target: ModelShape,
    draft: ModelShape,
    draft_kind: str,
    B: int,
    L: int,
    k: int = 4,
    sink: int = 1,
    window_divisor: int = 8,
) -> RoundCosts:
    """FLOPs and bytes of each forward in a round at batch B, context L (paper conventions, SPIRE.md §2).

    - target step: C = 2·N_t·B, KV_t = B·L·x_t, with x = 2·n_layers·n_kv·d_head values per token;
    - verify: the same bytes, C = (k+1)·2·N_t·B;
    - vanilla draft: its own full KV cache, C_d = 2·N_d·B;
    - MagicDec: the target over a StreamingLLM cache, N_d = N_t, KV_d = B·(sink + L//8)·x_t;
    - SPIRe: KV_d = B·(sink + L//8)·x_d, and C_d adds 2·(2·n_layers_d·n_kv_d·d_model_d·d_head_d)·B for
      projecting each new memory vector to a key and a value.
    For MagicDec pass ``draft=target``.
    """
    check_draft_kind(draft_kind)
    for name, value in (("B", B), ("L", L), ("k", k), ("window_divisor", window_divisor)):
        _check_positive_int(name, value)
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
        raise ConfigError(f"sink must be a non-negative integer, got {sink!r}")

    N_t = target.body_params()
    KV_t = B * L * target.kv_values_per_token()
    target_step = Cost(C=2 * N_t * B, N=N_t, KV=KV_t)
    verify = Cost(C=(k + 1) * target_step.C, N=N_t, KV=KV_t)

    N_d = draft.body_params()
    C_d = 2 * N_d * B
    if draft_kind == "vanilla":
        KV_d = B * L * draft.kv_values_per_token()
    else:
        KV_d = B * _draft_window(L, sink, window_divisor) * draft.kv_values_per_token()
    if draft_kind == "spire":
        C_d += 2 * (2 * draft.n_layers * draft.n_kv * draft.d_model * draft.d_head) * B
    return RoundCosts(draft=Cost(C=C_d, N=N_d, KV=KV_d), verify=verify, target=target_step)


def _shapes(model: Preset | tuple[ModelShape, ModelShape], draft_kind: str) -> tuple[ModelShape, ModelShape]:
    """(target, draft) shapes for ``draft_kind`` from a preset or a (target, draft) pair."""
    if isinstance(model, Preset):
        return model.target, model.draft_shape(draft_kind)
    target, draft = model
    check_draft_kind(draft_kind)
    return target, (target if draft_kind == "magicdec" else draft)


def delta_t(
    model: Preset | tuple[ModelShape, ModelShape],
    draft_kind: str,
    B: int,
    L: int,
    k: int = 4,
    hoi: float = HOI,
    combine: str = "max",
    sink: int = 1,
    window_divisor: int = 8,
) -> float:
    """Δt: time of one speculative round relative to one AD target step (dimensionless; paper §"evaluation").

        Δt = [k·t(C_d, N_d, KV_d) + t((k+1)·C_t, N_t, KV_t)] / t(C_t, N_t, KV_t)

    ``model`` is a :class:`Preset` or a (target, draft) shape pair (the draft is ignored for MagicDec).
    """
    _check_positive("hoi", hoi)
    costs = round_costs(*_shapes(model, draft_kind), draft_kind, B, L, k, sink, window_divisor)
    return _delta_t(costs, k, hoi, combine)


def _delta_t(costs: RoundCosts, k: int, hoi: float, combine: str) -> float:
    def t(c: Cost) -> float:
        return forward_time(c.C, c.N, c.KV, hoi, combine)

    return (k * t(costs.draft) + t(costs.verify)) / t(costs.target)


def multiplier(tau: float, delta_t: float) -> float:
    """Throughput multiplier (the paper's "speedup") = τ / Δt: SD tokens per unit time over AD's."""
    return tau / delta_t


def memory_values(costs: RoundCosts, draft_kind: str) -> int:
    """Values resident in device memory for a round: target weights + target KV + draft weights + draft KV.

    MagicDec's draft is the target reading a view of the target's own cache, so it adds nothing.
    Multiply by bytes per value for bytes.
    """
    resident = costs.target.N + costs.target.KV
    if draft_kind != "magicdec":
        resident += costs.draft.N + costs.draft.KV
    return resident


def verify_operational_intensity(shape: ModelShape, B: int, L: int, k: int = 4) -> float:
    """OI of verification in FLOPs per byte: OI(B) = 2·N·(B·k) / (N + B·L·x) (paper Figure 3).

    Verification is compute-bound where OI ≥ HOI.
    """
    for name, value in (("B", B), ("L", L), ("k", k)):
        _check_positive_int(name, value)
    N = shape.body_params()
    return 2 * N * (B * k) / (N + B * L * shape.kv_values_per_token())


def critical_batch_size(
    shape: ModelShape, L: int, k: int = 4, hoi: float = HOI, B_max: int | None = None
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


def throughput_rows(
    preset: Preset,
    Bs: Iterable[int],
    Ls: Iterable[int],
    k: int = 4,
    hoi: float = HOI,
    combine: str = "max",
    taus: Mapping[str, float] | None = None,
    memory_bytes: float | None = None,
    bytes_per_value: int = 1,
    sink: int = 1,
    window_divisor: int = 8,
) -> list[dict[str, Any]]:
    """The cost model over a grid: one row per draft (vanilla, magicdec, spire) per (B, L), B outermost.

    Each row holds "draft", "B", "L", "tau", "delta_t", "multiplier" (the public contract) and also
    "k", "hoi", "combine", "tau_source", "memory_bytes_needed" and "fits".

    taus: overrides of the preset's τ per draft kind (1 ≤ τ ≤ k+1). memory_bytes: device memory in bytes;
    a point whose resident set (:func:`memory_values` · bytes_per_value) exceeds it gets "fits": false and
    null "delta_t" and "multiplier". Without memory_bytes, "fits" is None (not checked).
    """
    Bs, Ls = list(Bs), list(Ls)
    for name, values in (("B", Bs), ("L", Ls)):
        if not values:
            raise ConfigError(f"give at least one {name}")
        for value in values:
            _check_positive_int(name, value)
    _check_positive_int("k", k)
    _check_positive_int("bytes_per_value", bytes_per_value)
    _check_positive("hoi", hoi)
    _check_combine(combine)
    if memory_bytes is not None:
        _check_positive("memory_bytes", memory_bytes)
    resolved = _resolve_taus(preset, k, taus or {})

    rows = []
    for B in Bs:
        for L in Ls:
            for draft in DRAFTS:
                tau, tau_source = resolved[draft]
                costs = round_costs(preset.target, preset.draft_shape(draft), draft, B, L, k, sink, window_divisor)
                needed = memory_values(costs, draft) * bytes_per_value
                fits = None if memory_bytes is None else needed <= memory_bytes
                dt = m = None
                if fits is not False:
                    dt = _delta_t(costs, k, hoi, combine)
                    m = multiplier(tau, dt)
                rows.append(
                    {
                        "draft": draft,
                        "B": B,
                        "L": L,
                        "tau": tau,
                        "delta_t": dt,
                        "multiplier": m,
                        "k": k,
                        "hoi": hoi,
                        "combine": combine,
                        "tau_source": tau_source,
                        "memory_bytes_needed": needed,
                        "fits": fits,
                    }
                )
    return rows


def _resolve_taus(preset: Preset, k: int, overrides: Mapping[str, float]) -> dict[str, tuple[float, str]]:
    """(τ, source) per draft kind; τ must lie in [1, k+1] (the bonus token is always emitted)."""
    for draft in overrides:
        check_draft_kind(draft)
    resolved = {}
    for draft in DRAFTS:
        if draft in overrides:
            tau, source = overrides[draft], "override"
        else:
            tau, source = preset.taus[draft], preset.tau_source
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 1 <= tau <= k + 1:
            raise ConfigError(f"tau for {draft} must be a number in [1, k+1] = [1, {k + 1}], got {tau!r} ({source})")
        resolved[draft] = (float(tau), source)
    return resolved
