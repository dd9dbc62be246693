"""Measured round costs: what one engine round costs on this machine, by its width, its rows' context, its depth k
and the drafts that propose in it (``spire serve``'s round policy, :mod:`spire.serving.policy`).

vLLM's dynamic speculation prices a step with a *profiled* step time per (batch size, k)
(``vllm/v1/spec_decode/dynamic/manager.py``); spire does the same, per draft set too, and keeps learning from the
rounds it serves. :func:`profile_rounds` times real rounds of an idle engine on dummy tokens: the target's forward
over k + 1 positions, the proposing drafts' k steps and every draft's observe, Python included, at a few widths and
contexts. :class:`StepCosts` interpolates that table (linear in the width, the mean context and k, extrapolated
past its edges; a set of drafts as AD plus each one's excess) and corrects it with the rounds the engine then runs:
the median of the recent ratios measured / profiled seconds of the round's own configuration (k, drafts), or, until
it has run 3 rounds, of the rounds of the same k, of every SD round, of every round (the first group with 3). A
median, not a moving average: a configuration's first round is often a cold one (buffers allocated, kernels
planned: seconds of them under the first requests), and a mean that starts from it can price the configuration at
several times its cost for hundreds of rounds; under load the profile also misses what a round's verify costs over
rows of mixed lengths (SD rounds of 32 streams ran 1.4x their profile on a 2-core CPU, AD rounds 1.0x), which the
groups learn from whichever SD rounds run.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from spire.engine.scheduler import Request, RoundChoice, draft_sets  # noqa: F401  (draft_sets: part of this API)
from spire.errors import ConfigError
from spire.params import RequestParams


def config_key(k: int, used: Sequence[int]) -> str:
    """The table key of a round of depth k whose proposing drafts are ``used`` (indices): "0" for AD, else
    "k:d1+d2"."""
    return "0" if not k else f"{k}:" + "+".join(str(d) for d in sorted(used))


def _bracket(xs: Sequence[float], x: float) -> tuple[int, float]:
    """(i, t) with y(x) = y[i - 1] + (y[i] - y[i - 1]) * t the piecewise-linear interpolation through xs (increasing)
    at x, extrapolated linearly past the ends; one point: (0, 0.0), the constant."""
    if len(xs) == 1:
        return 0, 0.0
    i = max(1, min(len(xs) - 1, next((j for j, v in enumerate(xs) if v >= x), len(xs) - 1)))
    return i, (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through (xs, ys) (xs increasing), extrapolated linearly past the ends; one point:
    constant."""
    i, t = _bracket(xs, x)
    return ys[0] if len(xs) == 1 else ys[i - 1] + (ys[i] - ys[i - 1]) * t


@dataclass
class StepCosts:
    """Seconds of one round, measured (see the module docstring).

    widths: the profiled widths (rows a round computes), increasing; contexts: the profiled mean committed lengths
    (tokens), increasing; table: config key (:func:`config_key`) -> seconds[width index][context index];
    recent: per group (a configuration key, "k=N", "sd", "all") the last ``window`` ratios measured / profiled.
    """

    widths: list[int]
    contexts: list[int]
    table: dict[str, list[list[float]]]
    window: int = 15
    recent: dict[str, list[float]] = field(default_factory=dict)
    _median: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    _point: tuple | None = field(default=None, repr=False, compare=False)

    def _at(self, key: str, width: float, context: float) -> float:
        """The table's seconds of ``key`` at (width, context): linear in the context along the two profiled widths
        around ``width``, then linear in the width (the brackets kept for the last (width, context) asked: a round
        policy asks a dozen configurations at one point)."""
        if self._point is None or self._point[0] != (width, context):
            self._point = ((width, context), _bracket(self.widths, width), _bracket(self.contexts, context))
        _, (i, t), (j, u) = self._point
        rows = self.table[key]

        def along(row: list[float]) -> float:
            return row[0] if len(row) == 1 else row[j - 1] + (row[j] - row[j - 1]) * u

        y = along(rows[0]) if len(rows) == 1 else along(rows[i - 1]) + (along(rows[i]) - along(rows[i - 1])) * t
        return max(1e-6, y)

    def base(self, width: float, context: float, k: int, used: Sequence[int]) -> float:
        """Profiled seconds of a round, interpolated in width and context: the table's configuration; for a k not
        profiled with one draft, linear in k between the profiled ones; for several drafts not profiled together,
        AD plus each draft's own excess over AD. Raises ConfigError for a draft the profile never ran."""
        key = config_key(k, used)
        if key in self.table:
            return self._at(key, width, context)
        if not k:
            raise ConfigError("the round-cost profile has no AD round")
        if len(used) == 1:
            ks = sorted(int(x.split(":")[0]) for x in self.table if x != "0" and x.split(":")[1] == str(used[0]))
            if not ks:
                raise ConfigError(f"the round-cost profile never ran draft {used[0]}")
            return max(1e-6, _interp(ks, [self._at(config_key(x, used), width, context) for x in ks], k))
        ad = self._at("0", width, context)
        return ad + sum(self.base(width, context, k, (d,)) - ad for d in used)

    @staticmethod
    def _groups(k: int, used: Sequence[int]) -> tuple[str, ...]:
        """The groups a round's ratio counts in, most specific first."""
        return (config_key(k, used), f"k={k}", "sd", "all") if k else ("0", "all")

    def ratio(self, k: int, used: Sequence[int]) -> float:
        """Measured / profiled seconds for a round of this configuration: the median of the most specific group
        with 3 rounds (1.0 before any)."""
        for g in self._groups(k, used):
            if len(self.recent.get(g, ())) >= 3:
                return self._median[g]
        return 1.0

    def predict(self, width: float, context: float, k: int, used: Sequence[int]) -> float:
        """Expected seconds of a round: the profile, corrected by the rounds served (:meth:`ratio`)."""
        return self.base(width, context, k, used) * self.ratio(k, used)

    def observe(self, width: float, context: float, k: int, used: Sequence[int], seconds: float) -> None:
        """A round of this configuration took ``seconds``: its ratio to the profile joins its groups' recent ones."""
        if not seconds > 0 or not math.isfinite(seconds):
            return
        r = seconds / self.base(width, context, k, used)
        for g in self._groups(k, used):
            recent = self.recent.setdefault(g, [])
            recent.append(r)
            del recent[: -self.window]
            self._median[g] = statistics.median(recent)

    def to_dict(self) -> dict:
        return {"widths": self.widths, "contexts": self.contexts, "table": self.table}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCosts":
        """Raises ConfigError for a table that is not one :meth:`to_dict` wrote."""
        try:
            widths, contexts = [int(w) for w in d["widths"]], [int(c) for c in d["contexts"]]
            table = {str(k): [[float(x) for x in row] for row in v] for k, v in d["table"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"not a round-cost profile ({e})") from None
        if "0" not in table or any(len(v) != len(widths) or any(len(r) != len(contexts) for r in v)
                                   for v in table.values()):
            raise ConfigError("not a round-cost profile (its table does not match its widths and contexts)")
        return cls(widths, contexts, table)


def monotone(table: dict[str, list[list[float]]], ks: Sequence[int], n_drafts: int) -> None:
    """Make a timed table obey what is true of rounds, against timing noise (in place): seconds do not fall as the
    width or the context grows, and a round that drafts costs at least an AD round and no less than a shallower one
    of the same draft (each entry raised to the running maximum along each axis)."""
    for rows in table.values():
        for i, row in enumerate(rows):
            for j in range(len(row)):
                row[j] = max(row[j], row[j - 1] if j else 0.0, rows[i - 1][j] if i else 0.0)
    for d in range(n_drafts):
        below = table["0"]
        for k in sorted(set(ks) - {0}):
            key = config_key(k, (d,))
            if key in table:
                table[key] = [[max(x, y) for x, y in zip(r, b)] for r, b in zip(table[key], below)]
                below = table[key]


def profile_widths(max_running: int) -> list[int]:
    """Widths a profile times: powers of two below ``max_running``, and it."""
    out, w = [], 1
    while w < max_running:
        out.append(w)
        w *= 2
    return out + [max_running]


def profile_contexts(max_len: int, k: int) -> list[int]:
    """Mean contexts a profile times: 128 and 1,024 tokens, within what a slot of max_len positions holds with
    k drafted tokens (for a short slot, half of it and all of it)."""
    top = max(1, max_len - k - 2)
    return sorted({min(128, max(1, top // 2)), min(1024, top)})


@torch.no_grad()
def profile_rounds(engine, widths: Sequence[int] | None = None, contexts: Sequence[int] | None = None,
                   reps: int = 2, progress: Callable[[str], object] | None = None) -> StepCosts:
    """Time real rounds of an idle ``engine`` (:class:`~spire.engine.engine.Engine`) on dummy tokens: AD, and each
    draft alone at k = 1 and k = engine.k, at each width and mean context; the fastest of ``reps`` after one
    warm-up round. The engine is left as new (every slot free, every draft's rows restarted).

    Raises ConfigError when the engine has requests or no draft."""
    if engine.has_work():
        raise ConfigError("profile_rounds needs an idle engine (no requests)")
    if not engine.drafts:
        raise ConfigError("profile_rounds: an engine without a draft has only AD rounds")
    runner = engine.runner
    widths = list(widths or profile_widths(engine.max_running))
    contexts = list(contexts or profile_contexts(engine.max_len, engine.k))
    params = RequestParams(max_tokens=1)
    # AD, and each draft alone at k = 1 and the engine's k: other k and sets of drafts are interpolated
    # (StepCosts.base), which keeps the profile to seconds
    configs = [(0, ())] + [(k, (d,)) for d in range(len(engine.drafts)) for k in sorted({1, engine.k})]
    table: dict[str, list[list[float]]] = {config_key(k, s): [[0.0] * len(contexts) for _ in widths]
                                           for k, s in configs}
    try:
        for wi, width in enumerate(widths):
            runner.narrow(width)
            rows = [Request(-1 - b, [0] * max(contexts), params, None, params.sampling(), params.processing(()),
                            slot=b) for b in range(width)]
            for ci, context in enumerate(contexts):
                for r in rows:  # each row's committed length is the context (a round never advances without a commit)
                    runner.prefilled(r, context - 1)
                for k, used in configs:
                    # each row drafts k with one draft of the set, in turn, so every draft of it proposes
                    choice = RoundChoice(k, [used[b % len(used)] if k else None for b in range(width)],
                                         [k] * width)
                    best = math.inf
                    for _ in range(reps + 1):
                        t = time.perf_counter()
                        runner.round(rows, choice)  # read back, as a step's round
                        best = min(best, time.perf_counter() - t)
                    table[config_key(k, used)][wi][ci] = best
            if progress is not None:
                progress(f"width {width} timed")
        monotone(table, [k for k, _ in configs], len(engine.drafts))
    finally:
        runner.narrow(engine.max_running)
        runner.advance((), range(engine.max_running))  # every slot free again: length 1, pending token 0
        every = torch.arange(engine.max_running, device=runner.n.device)
        runner.deferred.drop()
        for draft in engine.drafts:
            draft.restart_rows(every)
    return StepCosts(widths, contexts, table)
