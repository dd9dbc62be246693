"""The AD rounds' commits that drafts take late: one job, keeping them and replaying them.

A draft whose observe is per-position work into a cache it reads later (SPIRe with target activations:
projections of the target's hidden states into its memory keys and values) may take the commits of AD rounds in
batches (:attr:`spire.drafts.base.Draft.defer_observe`): a run of AD rounds, where the round policy drafts nothing,
then costs it one observe call per ``defer_observe`` rounds instead of one per round, and a draft that takes over
after them finds the state per-round observes would have left (tests/test_portfolio.py checks it to 1e-5). The
runner keeps the commits here and replays them before the draft drafts, observes anything else, or its rows change.
"""

from __future__ import annotations

from typing import Sequence

import torch

from spire.drafts.base import Draft
from spire.model import ForwardOutput


def _no_logits() -> torch.Tensor:
    raise RuntimeError("a deferred observe has no logits (a draft with defer_observe must not read them)")


class DeferredObserves:
    """Per draft that defers (``defer_observe`` > 0), the AD rounds' (tokens, pos, valid, hidden) it has not yet
    observed: tokens, pos (S, 1), valid (S, 1) bool (the running requests' rows), hidden {layer: (S, 1, d)}."""

    def __init__(self, drafts: Sequence[Draft]) -> None:
        self.drafts = list(drafts)
        self.logs: dict[int, list[tuple]] = {d: [] for d, draft in enumerate(self.drafts)
                                             if getattr(draft, "defer_observe", 0)}

    def __contains__(self, d: int) -> bool:
        return d in self.logs

    def keep(self, d: int, slots: Sequence[int], pending: torch.Tensor, pos0: torch.Tensor,
             out: ForwardOutput) -> None:
        """An AD round's commit for draft d (pending, pos0 (S,); ``slots``: the running requests' rows, the others
        dummies or still prefilling); replayed once ``defer_observe`` rounds are kept."""
        valid = torch.zeros(len(pending), 1, dtype=torch.bool)
        valid[list(slots)] = True
        hidden = {j: out.hidden[j].clone() for j in self.drafts[d].hidden_layers}
        self.logs[d].append((pending[:, None], pos0[:, None], valid.to(pending.device), hidden))
        if len(self.logs[d]) >= self.drafts[d].defer_observe:
            self.replay(d)

    def forget_rows(self, slots: torch.Tensor) -> None:
        """New requests take ``slots``: what their previous requests committed is never replayed."""
        for log in self.logs.values():
            for entry in log:
                entry[2][slots] = False

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
            tokens, pos, valid = (torch.cat([e[i] for e in log], 1) for i in range(3))
            hidden = {j: torch.cat([e[3][j] for e in log], 1) for j in log[0][3]}
            log.clear()
            self.drafts[d].observe(tokens, pos, ForwardOutput(hidden=hidden, compute_logits=_no_logits), valid=valid)
