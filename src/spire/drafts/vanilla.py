"""Vanilla speculative decoding (Leviathan et al. 2023; SPIRe paper §4): an independent small model that
shares the target's tokenizer, with its own full KV cache."""

from __future__ import annotations

import torch

from spire.drafts.base import Draft
from spire.errors import TokenizerMismatchError
from spire.kv_cache import KVCache
from spire.model import ForwardOutput, Transformer


def check_same_vocabulary(target_tok, draft_tok, target_name: str = "target", draft_name: str = "draft") -> None:
    """Raise TokenizerMismatchError (naming both sides) unless the two tokenizers map tokens to the same ids."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        raise TokenizerMismatchError(
            f"tokenizers differ: {target_name} has {len(tv)} tokens, {draft_name} has {len(dv)} "
            f"({only_t} token/id pairs of the target are missing or different in the draft)")


class VanillaDraft(Draft):
    """An independent draft model. After each verify it re-reads the k+1 verified positions, so its cache
    holds its own keys/values for every committed token (including a fully accepted block's last token)."""

    name = "vanilla"

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self._cache: KVCache | None = None

    def start(self, target: Transformer, target_cache: KVCache, batch_size: int, max_len: int, k: int) -> None:
        if self.model.cfg.vocab_size != target.cfg.vocab_size:
            raise TokenizerMismatchError(f"draft vocabulary has {self.model.cfg.vocab_size} entries, the "
                                         f"target's has {target.cfg.vocab_size}")
        self._cache = self.model.new_cache(batch_size, max_len)

    @torch.no_grad()
    def observe(self, tokens: torch.Tensor, pos: torch.Tensor, target_out: ForwardOutput,
                valid: torch.Tensor | None = None) -> None:
        self.model(tokens, pos, self._cache)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, pos, self._cache).logits[:, -1]
