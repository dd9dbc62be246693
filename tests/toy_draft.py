"""A seventh draft kind as a newcomer would write it (tests/test_seventh_kind.py): "repeat", which proposes the
last token again k times (q one-hot). It exists to show that a kind needs its module, its tests and one line of
the registry, nothing else."""

from __future__ import annotations

import torch

from spire.drafts.base import Draft
from spire.registry import DraftImpl
from spire.errors import ConfigError


class RepeatDraft(Draft):
    name = "repeat"

    def start(self, target, target_cache, batch_size, max_len, k):
        self.vocab_size = target.cfg.vocab_size

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Nothing is kept per row: a new request in a slot sees nothing of the previous one."""

    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        logits = torch.full((tokens.shape[0], self.vocab_size), float("-inf"), device=tokens.device)
        return logits.scatter_(1, tokens[:, :1].long(), 0.0)


def load_draft(target, tokenizer=None, path=None, **_):
    if path:
        raise ConfigError("--draft repeat takes no --draft-path")
    return RepeatDraft()


KIND = DraftImpl(load=load_draft)
