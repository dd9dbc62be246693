"""A seventh draft kind as a newcomer would write it (tests/test_seventh_kind.py): "repeat", which proposes the
last token again k times (q one-hot). It exists to show that a kind needs its module, its tests and one line of
the registry, nothing else."""

from __future__ import annotations

import torch

from spire.drafts.base import Draft
from spire.registry import DraftImpl
from spire.errors import ConfigError


class RepeatDraft(Draft):
    """Proposes its input token again once it has seen it ``min_run`` times in a row within the round (the
    pending token counts once); before that it proposes token 0. min_run 1: always the last token."""

    name = "repeat"

    def __init__(self, min_run: int = 1) -> None:
        self.min_run = min_run

    def start(self, target, target_cache, batch_size, max_len, k):
        self.vocab_size = target.cfg.vocab_size
        self.prev = self.run = None

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Nothing is kept per row across rounds: a new request in a slot sees nothing of the previous one."""

    def observe(self, tokens, pos, target_out, valid=None, span=None) -> None:
        self.prev = self.run = None  # a round starts over

    def step(self, tokens: torch.Tensor, pos: torch.Tensor, span=None) -> torch.Tensor:
        tok = tokens[:, 0].long()
        if self.prev is None or self.prev.shape != tok.shape:
            self.run = torch.ones_like(tok)
        else:
            self.run = torch.where(tok == self.prev, self.run + 1, torch.ones_like(tok))
        self.prev = tok
        proposal = torch.where(self.run >= self.min_run, tok, torch.zeros_like(tok))
        logits = torch.full((tokens.shape[0], self.vocab_size), float("-inf"), device=tokens.device)
        return logits.scatter_(1, proposal[:, None], 0.0)


def load_draft(target, tokenizer=None, path=None, min_run: int = 1, **_):
    if path:
        raise ConfigError("--draft repeat takes no --draft-path")
    return RepeatDraft(min_run)


KIND = DraftImpl(load=load_draft)
