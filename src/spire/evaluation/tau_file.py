"""The JSON file of ``spire tau --out FILE`` and how ``spire throughput --tau-from FILE`` reads it.

File format (one object)::

    {"format": "spire-tau", "version": 1,
     "rows": [{"draft": a kind of spire.registry, "name": str, "temperature": float, "L": int, "G": int,
               "k": int, "n_contexts": int, "tau": float, "ci_low": float, "ci_high": float, "wall_s": float,
               ...}],
     "target": {...}, "settings": {...}, ...}

Only ``rows`` and, per row, ``draft``, ``temperature``, ``L``, ``k`` and ``tau`` are needed by
:func:`select_taus`; ``name`` defaults to ``draft`` and the CI to the τ itself. No torch import here (the
throughput command stays fast).

τ at a context length L that was not measured: linear interpolation in log L between the two nearest
measured L around it; outside the measured range the τ of the nearest measured L (no extrapolation).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import spire.registry as registry
from spire.errors import ConfigError

FORMAT = "spire-tau"
VERSION = 1
DRAFT_KINDS = registry.names(drafts_only=True)
L_RULE = "linear in log L between the nearest measured L; the nearest end's τ outside the measured range"


def read_tau_file(path: str | Path, option: str = "--tau-from") -> dict[str, Any]:
    """The parsed object of a ``spire tau`` JSON file; ConfigError (naming ``option``) when missing,
    unreadable or malformed."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{option}: no such file {path}") from None
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{option}: {path} is not JSON ({e})") from None
    rows = obj.get("rows") if isinstance(obj, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{option}: {path} has no \"rows\" list (write it with `spire tau --out FILE`)")
    for i, r in enumerate(rows):
        ok = isinstance(r, dict) and r.get("draft") in DRAFT_KINDS and all(
            isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
            for key in ("temperature", "L", "k", "tau"))
        if not ok:
            raise ConfigError(f"{option}: row {i} of {path} lacks draft ({', '.join(DRAFT_KINDS)}), "
                              "temperature, L, k or tau")
    return obj


@dataclass(frozen=True)
class TauCurve:
    """Measured τ of one draft against L at one temperature and k (points sorted by L)."""

    kind: str
    name: str
    temperature: float
    k: int
    points: tuple[tuple[int, float, float, float], ...]  # (L, tau, ci_low, ci_high)

    def at(self, L: float) -> tuple[float, float, float, str]:
        """(τ, ci_low, ci_high, how) at context length L: see the module docstring for the rule."""
        pts = self.points
        if L <= pts[0][0] or len(pts) == 1:
            p = pts[0] if L <= pts[0][0] else pts[-1]
            return p[1], p[2], p[3], f"L={p[0]}"
        if L >= pts[-1][0]:
            p = pts[-1]
            return p[1], p[2], p[3], f"L={p[0]}"
        for lo, hi in zip(pts, pts[1:]):
            if L == hi[0]:
                return hi[1], hi[2], hi[3], f"L={hi[0]}"
            if lo[0] < L < hi[0]:
                w = (math.log(L) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
                vals = [a + w * (b - a) for a, b in zip(lo[1:], hi[1:])]
                return vals[0], vals[1], vals[2], f"interpolated between L={lo[0]} and L={hi[0]}"
        p = pts[0]  # L == pts[0][0] handled above; unreachable
        return p[1], p[2], p[3], f"L={p[0]}"


def _same_float(a: float, b: float) -> bool:
    return abs(float(a) - float(b)) <= 1e-9


def select_taus(obj: dict[str, Any], temperature: float, k: int, names: dict[str, str] | None = None,
                path: str | Path = "--tau-from") -> dict[str, TauCurve]:
    """One :class:`TauCurve` per draft kind found in the file at ``temperature`` and ``k``.

    ``names``: kind -> the measured draft's name to use (needed when the file holds several drafts of a kind,
    e.g. SPIRe ablations; otherwise the one whose name is the kind, or the only one). Rows measured twice at
    one L are averaged. Raises ConfigError when nothing matches or the choice is ambiguous."""
    names = dict(names or {})
    for kind in names:
        if kind not in DRAFT_KINDS:
            raise ConfigError(f"--tau-draft: unknown draft kind {kind!r}; choose one of {', '.join(DRAFT_KINDS)}")
    rows = obj["rows"]
    temps = sorted({float(r["temperature"]) for r in rows})
    if not any(_same_float(t, temperature) for t in temps):
        raise ConfigError(f"{path} has no τ at temperature {temperature:g} (it has T = "
                          f"{', '.join(f'{t:g}' for t in temps)}): pass --tau-temperature")
    rows = [r for r in rows if _same_float(r["temperature"], temperature)]
    ks = sorted({int(r["k"]) for r in rows})
    if k not in ks:
        raise ConfigError(f"{path} measured τ at k = {', '.join(map(str, ks))}, not k = {k}; τ depends on k: "
                          f"pass -k {ks[0]} (or measure again with `spire tau -k {k}`)")
    rows = [r for r in rows if int(r["k"]) == k]
    curves = {}
    for kind in DRAFT_KINDS:
        mine = [r for r in rows if r["draft"] == kind]
        if not mine:
            if kind in names:
                raise ConfigError(f"{path} has no {kind} draft at T={temperature:g}, k={k}")
            continue
        available = sorted({str(r.get("name") or kind) for r in mine})
        if kind in names:
            name = names[kind]
            if name not in available:
                raise ConfigError(f"{path} has no {kind} draft named {name!r} (it has {', '.join(available)})")
        elif len(available) == 1:
            name = available[0]
        elif kind in available:
            name = kind
        else:
            raise ConfigError(f"{path} holds several {kind} drafts ({', '.join(available)}): choose one with "
                              f"--tau-draft {kind}=NAME")
        by_L: dict[int, list[dict]] = {}
        for r in mine:
            if str(r.get("name") or kind) == name:
                by_L.setdefault(int(r["L"]), []).append(r)
        points = []
        for L in sorted(by_L):
            rs = by_L[L]
            tau = sum(float(r["tau"]) for r in rs) / len(rs)
            lo = sum(float(r.get("ci_low", r["tau"])) for r in rs) / len(rs)
            hi = sum(float(r.get("ci_high", r["tau"])) for r in rs) / len(rs)
            points.append((L, tau, lo, hi))
        curves[kind] = TauCurve(kind, name, float(temperature), k, tuple(points))
    if not curves:
        raise ConfigError(f"{path} has no τ of {', '.join(DRAFT_KINDS)} at T={temperature:g}, k={k}")
    return curves
