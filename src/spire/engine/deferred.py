"""The AD rounds' commits that drafts take late: one job, keeping them and replaying them.

A draft whose observe is per-position work into a cache it reads later (SPIRe with target activations:
projections of the target's hidden states into its memory keys and values) may take the commits of AD rounds in
batches (:attr:`spire.drafts.base.Draft.defer_observe`): a run of AD rounds, where the round policy drafts nothing,
then costs it one observe call per ``defer_observe`` rounds instead of one per round, and a draft that takes over
after them finds the state per-round observes would have left (tests/test_portfolio.py checks it to 1e-5). The
runner keeps the commits here and replays them before the draft drafts, observes anything else, or its rows change.

A draft whose observe keeps only a sink and a tail (:attr:`~spire.drafts.base.Draft.observe_keeps`: a sink +
window cache) catches up lazily: only its last ``tail`` AD rounds are kept (an older one, whose positions the tail's
overwrite in its ring, is dropped once every running row is past the sink) and nothing is replayed until it is next
used, so an AD phase of any length costs it the copies of the rounds' hidden states, and its catch-up one observe of
at most ``tail`` positions per row: O(window), whatever the gap.
"""

from __future__ import annotations

from typing import Sequence

import torch

from spire.drafts.base import Draft
from spire.kv_cache import Span
from spire.model import ForwardOutput


def _no_logits() -> torch.Tensor:
    raise RuntimeError("a deferred observe has no logits (a draft with defer_observe must not read them)")


class DeferredObserves:
    """Per draft that defers (``defer_observe`` > 0), the AD rounds' (tokens, pos, valid, hidden, first, span) it has
    not yet observed: tokens, pos (S, 1), valid (S, 1) bool (the running requests' rows; None: every row), hidden
    {layer: (S, 1, d)}, first: the least position of a running row (a host int, or None), span: pos on the host (a
    :class:`~spire.kv_cache.Span`, or None). A replay of rounds whose rows all ran, one position after another,
    goes down with its span and no mask, so it reads nothing back."""

    def __init__(self, drafts: Sequence[Draft]) -> None:
        self.drafts = list(drafts)
        self.logs: dict[int, list[tuple]] = {d: [] for d, draft in enumerate(self.drafts)
                                             if getattr(draft, "defer_observe", 0)}

    def __contains__(self, d: int) -> bool:
        return d in self.logs

    def keep(self, d: int, slots: Sequence[int], pending: torch.Tensor, pos0: torch.Tensor,
             out: ForwardOutput, first: int | None = None, span: Span | None = None) -> None:
        """An AD round's commit for draft d (pending, pos0 (S,); ``slots``: the running requests' rows, the others
        dummies or still prefilling; ``first``: the least of their positions, on the host, when the caller knows
        it). Replayed once ``defer_observe`` rounds are kept; for a draft with ``observe_keeps`` (sink, tail) only
        the last ``tail`` are kept (an older round is dropped when ``first`` was past the sink, else all are
        replayed) and replayed when the draft is next used."""
        valid = None
        if len(set(slots)) < len(pending):
            valid = torch.zeros(len(pending), 1, dtype=torch.bool)
            valid[list(slots)] = True
            valid = valid.to(pending.device)
        draft, log = self.drafts[d], self.logs[d]
        hidden = {j: out.hidden[j].clone() for j in draft.hidden_layers}
        log.append((pending[:, None], pos0[:, None], valid, hidden, first, span))
        if draft.observe_keeps is None:
            if len(log) >= draft.defer_observe:
                self.replay(d)
            return
        sink, tail = draft.observe_keeps
        while len(log) > tail and log[0][4] is not None and log[0][4] >= sink:
            log.pop(0)  # each of its rows' positions is one the last tail rounds overwrite in the ring
        if len(log) > tail:  # a round with a row in the sink (or positions unknown): keep nothing back
            self.replay(d)

    def forget_rows(self, slots: torch.Tensor) -> None:
        """New requests take ``slots``: what their previous requests committed is never replayed."""
        for log in self.logs.values():
            for i, entry in enumerate(log):
                valid = entry[2]
                if valid is None:
                    valid = torch.ones(len(entry[0]), 1, dtype=torch.bool, device=entry[0].device)
                    log[i] = (entry[0], entry[1], valid, *entry[3:])
                valid[slots] = False

    def drop(self) -> None:
        """Forget everything kept (every row is about to restart)."""
        for log in self.logs.values():
            log.clear()

    def replay(self, draft: int | None = None) -> None:
        """Observe what one draft (default every draft that defers) has kept, as one observe over those positions."""
        for d in [draft] if draft is not None else list(self.logs):
            log = self.logs[d]
            if not log:
                continue
            tokens, pos = (torch.cat([e[i] for e in log], 1) for i in range(2))
            valid = None
            if any(e[2] is not None for e in log):
                valid = torch.cat([e[2] if e[2] is not None else torch.ones_like(e[0], dtype=torch.bool)
                                   for e in log], 1)
            spans = [e[5] for e in log]
            span = None
            if valid is None and all(s is not None and s.T == 1 for s in spans) and all(
                    b.starts == tuple(x + 1 for x in a.starts) for a, b in zip(spans, spans[1:])):
                span = Span(spans[0].starts, len(log))  # every row's positions one after another
            hidden = {j: torch.cat([e[3][j] for e in log], 1) for j in log[0][3]}
            log.clear()
            self.drafts[d].observe(tokens, pos, ForwardOutput(hidden=hidden, compute_logits=_no_logits), valid=valid,
                                   span=span)
