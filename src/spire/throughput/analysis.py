"""Everything else the paper derives from its cost model (arXiv 2504.06419, §"evaluation", Figures 1–6, the
alternative metric and the cost analysis), plus mixed batches (SPIRE.md §7, beyond the paper).

All times are in FLOP-equivalents (see :mod:`spire.throughput.cost_model`); all ratios are dimensionless.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

import spire.registry as registry
from spire.errors import ConfigError
from spire.throughput.cost_model import (
    HOI,
    PAPER_OPTIONS,
    CostOptions,
    RowOptions,
    _check_positive,
    _check_positive_int,
    _delta_t,
    critical_batch_size,
    forward_time,
    round_costs,
    saving_units,
    throughput_rows,
    verify_operational_intensity,
)
from spire.throughput.shapes import ABLATION_TAUS, DRAFTS, ModelShape, Preset, check_draft_kind

# --- Figure 3: operational intensity of verification ---------------------------------------------------


def critical_context(shape: ModelShape, k: int = 4, hoi: float = HOI) -> int | None:
    """The longest context L at which verification can be compute-bound at some batch size (paper
    Figure 3): OI(B) → 2·N·k / (L·x) as B → ∞, so a B_crit exists iff L < 2·N·k / (HOI·x).
    None if not even L = 1 qualifies."""
    _check_positive_int("k", k)
    bound = Fraction(2 * shape.body_params() * k) / (Fraction(_check_positive("hoi", hoi)) * shape.kv_values_per_token())
    L = math.ceil(bound) - 1
    return L if L >= 1 else None


def operational_intensity_data(
    shape: ModelShape, Ls: Sequence[int], Bs: Sequence[int], k: int = 4, hoi: float = HOI
) -> dict[str, Any]:
    """Figure 3's data: OI(B) = 2·N·(B·k) / (N + B·L·x) in FLOPs per byte for each L, against HOI, with
    B_crit per L (None where verification is never compute-bound) and the critical context."""
    curves = []
    for L in Ls:
        curves.append({
            "L": L,
            "B_crit": critical_batch_size(shape, L, k, hoi),
            "oi": [verify_operational_intensity(shape, B, L, k) for B in Bs],
            "oi_limit": 2 * shape.body_params() * k / (L * shape.kv_values_per_token()),
        })  # fmt: skip
    return {"hoi": hoi, "k": k, "B": list(Bs), "L_crit": critical_context(shape, k, hoi), "curves": curves}


# --- Figure 5: ablations ---------------------------------------------------------------------------------

NO_SPARSE_KV = "without sparse KV cache"


def ablation_rows(
    preset: Preset,
    Ls: Iterable[int],
    B: int = 64,
    k: int = 4,
    hoi: float = HOI,
    combine: str = "max",
    taus: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Figure 5: the throughput multiplier of each ablated SPIRe draft (its τ, SPIRe's costs) over L, and
    "without sparse KV cache" computed analytically: SPIRe's τ with a full draft KV cache (sink 0,
    window L). Rows: {"variant", "B", "L", "tau", "delta_t", "multiplier"}."""
    taus = dict(ABLATION_TAUS if taus is None else taus)
    dense = CostOptions(sink=0, window_divisor=1)  # draft window = L: the full cache
    variants = [(name, tau, PAPER_OPTIONS) for name, tau in taus.items()]
    variants.append((NO_SPARSE_KV, taus.get("SPIRe", ABLATION_TAUS["SPIRe"]), dense))
    rows = []
    for L in Ls:
        for name, tau, options in variants:
            costs = round_costs(preset.target, preset.draft_shape("spire"), "spire", B, L, k, options=options)
            dt = _delta_t(costs, k, hoi, combine)
            rows.append({"variant": name, "B": B, "L": L, "tau": tau, "delta_t": dt, "multiplier": tau / dt})
    return rows


# --- the alternative metric: context growing over G generated tokens ------------------------------------


def growing_context_multiplier(
    preset: Preset,
    draft_kind: str,
    B: int,
    L: int,
    G: int,
    tau: float,
    k: int = 4,
    hoi: float = HOI,
    combine: str = "max",
    options: CostOptions = PAPER_OPTIONS,
) -> float:
    """The paper's alternative metric: throughput over AD while the context grows from L during the
    generation of G tokens per request. AD time = Σ_{g<G} t_target(L+g). SD runs G/τ rounds; round r
    starts at length ℓ_r = L + ⌊r·τ⌋ and costs k·t_draft(ℓ_r) + t_verify(ℓ_r) (draft window at ℓ:
    min(ℓ, 1 + ℓ//8)); the last, partial round is weighted by the fraction G/τ − ⌊G/τ⌋.
    Result = AD time / SD time (dimensionless); for G → 1 it tends to τ/Δt at L.
    """
    check_draft_kind(draft_kind)
    for name, value in (("B", B), ("L", L), ("G", G), ("k", k)):
        _check_positive_int(name, value)
    if not 1 <= tau <= k + 1:
        raise ConfigError(f"tau must be in [1, k+1] = [1, {k + 1}], got {tau!r}")
    target, draft = preset.target, preset.draft_shape(draft_kind)

    def t(c):
        return forward_time(c.C, c.N, c.KV, hoi, combine)

    ad = sum(t(round_costs(target, draft, draft_kind, B, L + g, k, options=options).target) for g in range(G))
    rounds = G / tau
    sd, r = 0.0, 0
    while r < rounds:
        weight = min(1.0, rounds - r)
        costs = round_costs(target, draft, draft_kind, B, L + math.floor(r * tau), k, options=options)
        sd += weight * (k * t(costs.draft) + t(costs.verify))
        r += 1
    return ad / sd


def growing_rows(
    preset: Preset, Bs: Iterable[int], Ls: Iterable[int], G: int = 64, k: int = 4, hoi: float = HOI,
    combine: str = "max", taus: dict[str, float] | None = None, options: CostOptions = PAPER_OPTIONS,
) -> list[dict[str, Any]]:
    """:func:`growing_context_multiplier` for each draft over a (B, L) grid; rows also carry the
    fixed-context multiplier at L ("multiplier_fixed_L") for comparison."""
    fixed = throughput_rows(preset, Bs, Ls, RowOptions(k=k, hoi=hoi, combine=combine, taus=taus, cost=options))
    rows = []
    for r in fixed:
        g = growing_context_multiplier(preset, r["draft"], r["B"], r["L"], G, r["tau"], k, hoi, combine, options)
        rows.append({"draft": r["draft"], "B": r["B"], "L": r["L"], "G": G, "tau": r["tau"],
                     "multiplier": g, "multiplier_fixed_L": r["multiplier"]})
    return rows


# --- headline and cost analysis ---------------------------------------------------------------------------


def headline(preset: Preset, B: int = 64, L: int = 512, training_cost: float = 0.25,
             options: RowOptions = RowOptions()) -> dict[str, Any]:
    """The paper's headline at (B, L) = (64, 512): each draft's multiplier, SPIRe's gain over vanilla SD and
    MagicDec in percent, and the cost analysis saving 10·(1 − 1/m) − training cost for SPIRe."""
    rows = {r["draft"]: r for r in throughput_rows(preset, [B], [L], options)}
    m = {d: row["multiplier"] for d, row in rows.items()}
    return {
        "B": B,
        "L": L,
        "multiplier": m,
        "spire_gain_vs_vanilla_pct": 100 * (m["spire"] / m["vanilla"] - 1),
        "spire_gain_vs_magicdec_pct": 100 * (m["spire"] / m[registry.BASELINE] - 1),
        "spire_saving_units": saving_units(m["spire"], training_cost),
    }


# --- mixed batches: where do the per-request context lengths come from ----------------------------------

_DIST = re.compile(r"^(?P<kind>[a-z]+)(?::(?P<params>.*))?$")


def sample_contexts(spec: str, B: int, seed: int = 0) -> list[int]:
    """B context lengths from a distribution spec (beyond the paper):

    - ``lognormal:median=512,sigma=1[,max=32768]``: exp(N(ln median, sigma²)), rounded, ≥ 1;
    - ``uniform:low=64,high=4096``: integers uniform in [low, high];
    - ``fixed:L=512``: all equal.
    Seeded (numpy default_rng(seed)), so the same spec gives the same batch.
    """
    _check_positive_int("B", B)
    match = _DIST.match(spec.strip())
    if not match:
        raise ConfigError(f"context distribution {spec!r}: expected NAME:key=value,... (e.g. lognormal:median=512,sigma=1)")
    kind, params = match["kind"], {}
    for item in filter(None, (match["params"] or "").split(",")):
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            params[key.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"context distribution {spec!r}: {item!r} is not key=number") from None
    needed = {"lognormal": {"median", "sigma"}, "uniform": {"low", "high"}, "fixed": {"L"}}
    if kind not in needed:
        raise ConfigError(f"unknown context distribution {kind!r}; known: {', '.join(needed)}")
    allowed = needed[kind] | ({"max"} if kind == "lognormal" else set())
    if not needed[kind] <= params.keys() or not params.keys() <= allowed:
        raise ConfigError(f"context distribution {kind} takes {', '.join(sorted(allowed))}; got {spec!r}")
    if any(v < 0 for v in params.values()) or any(params[p] <= 0 for p in ("median", "L", "low", "max") if p in params):
        raise ConfigError(f"context distribution {spec!r}: sizes must be positive")
    rng = np.random.default_rng(seed)
    if kind == "lognormal":
        values = np.exp(rng.normal(math.log(params["median"]), params["sigma"], B))
        if "max" in params:
            values = np.minimum(values, params["max"])
    elif kind == "uniform":
        if params["high"] < params["low"]:
            raise ConfigError(f"context distribution {spec!r}: high < low")
        values = rng.integers(int(params["low"]), int(params["high"]) + 1, B)
    else:
        values = np.full(B, params["L"])
    return [max(1, int(round(v))) for v in values]


def read_contexts(path: str | Path) -> list[int]:
    """Per-request context lengths from a file: integers separated by whitespace or commas, or a JSON list."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read contexts from {path}: {e.strerror}") from None
    items = [t for t in re.split(r"[\s,\[\]]+", text) if t]
    if not items:
        raise ConfigError(f"{path} holds no context lengths")
    out = []
    for item in items:
        try:
            out.append(int(item))
        except ValueError:
            raise ConfigError(f"{path}: {item!r} is not an integer context length") from None
    for L in out:
        if L <= 0:
            raise ConfigError(f"{path}: context lengths must be positive, got {L}")
    return out
