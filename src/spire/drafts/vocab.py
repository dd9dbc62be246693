"""The draft vocabulary: one component for the drafts whose head scores N of the target's V tokens (SPIRe with
``vocab_size``, EAGLE-3's d2t / t2d maps). The N target token ids are chosen by frequency in the training text
(:func:`frequent_tokens`), or by the target's probability mass on it (:func:`probable_tokens`);
:class:`DraftVocabulary` holds them as the model's ``vocab`` buffer (draft column -> target token id) and maps logits
and token ids between the two vocabularies. Verification stays lossless: a token
outside the draft vocabulary has q = 0 (:meth:`DraftVocabulary.to_target_vocab`)."""

from __future__ import annotations

import numpy as np
import torch

from spire import kernels
from spire.errors import ConfigError


def frequent_tokens(tokens, n: int, vocab_size: int) -> torch.Tensor:
    """The ``n`` most frequent token ids of ``tokens`` (any 1-D integer array: numpy memmap, tensor), ties to
    the lower id, sorted ascending: a draft vocabulary (EAGLE-3's d2t map). Ids never seen fill the rest in id
    order. Raises ConfigError when n is not in [1, vocab_size]."""
    if not 1 <= n <= vocab_size:
        raise ConfigError(f"the draft vocabulary must hold 1..{vocab_size} tokens, got {n}")
    counts = np.bincount(np.asarray(tokens).reshape(-1).astype(np.int64), minlength=vocab_size)[:vocab_size]
    return _largest(counts, n)


def _largest(scores: np.ndarray, n: int) -> torch.Tensor:
    """The ids of the ``n`` largest of ``scores`` (V,), ties to the lower id, sorted ascending."""
    order = np.lexsort((np.arange(len(scores)), -scores))  # by score descending, then id
    return torch.from_numpy(np.sort(order[:n]).astype(np.int64))


VOCAB_FROM = ("frequency", "mass")
"""How a draft vocabulary is chosen: the training text's token counts, or the target's probability mass on it."""


@torch.no_grad()
def probable_tokens(target, windows: torch.Tensor, n: int, rows: int = 8, bf16: bool = False) -> torch.Tensor:
    """The ``n`` token ids with the largest total target probability Σ_t p(v | x_<t) over every position of
    ``windows`` (B, T) int64 (``target``: a :class:`spire.model.Transformer`, run ``rows`` windows at a time with
    full attention, under bfloat16 autocast when ``bf16``), ties to the lower id, sorted ascending. Unlike
    :func:`frequent_tokens` it covers what the target would write, not only what the text holds: on SmolLM2, from
    64 windows of the main job's training text, 16,384 such tokens hold 96.6 % of the target's mass on its own
    T = 1 continuations of held-out text against 95.2 % for the 16,384 most frequent
    (``measurements/t1-diagnosis/by-text/``). Raises ConfigError when n is not in [1, V]."""
    V = target.cfg.vocab_size
    if not 1 <= n <= V:
        raise ConfigError(f"the draft vocabulary must hold 1..{V} tokens, got {n}")
    mass = torch.zeros(V, dtype=torch.float64)
    for i in range(0, windows.shape[0], rows):
        x = windows[i:i + rows].to(target.device)
        pos = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = target(x, pos).logits.float()
        mass += torch.softmax(logits, -1).reshape(-1, V).sum(0).double().cpu()
    return _largest(mass.numpy(), n)


class DraftVocabulary:
    """Mixed into a draft model (an ``nn.Module`` with a ``target`` attribute): its ``vocab`` buffer (N,) of target
    token ids, or None when the head covers the target's whole vocabulary."""

    vocab: torch.Tensor | None

    def set_vocab(self, n: int | None, vocab, target) -> None:
        """A draft vocabulary of ``n`` target ids (``vocab``: the ids; a placeholder 0..n-1 when None, for a model
        whose state is loaded next), or none when n is None. Raises ConfigError for ids that are not n distinct ids
        in [0, V)."""
        if n is None:
            self.vocab = None
            return
        V = target.cfg.vocab_size
        ids = torch.arange(n) if vocab is None else torch.as_tensor(vocab).to(torch.int64).cpu()
        if ids.shape != (n,) or len(ids.unique()) != n or bool((ids < 0).any() | (ids >= V).any()):
            raise ConfigError(f"a draft vocabulary must be {n} distinct token ids in [0, {V}), got shape "
                              f"{tuple(ids.shape)}")
        self.register_buffer("vocab", ids.to(target.device))  # (N,) draft column -> target token id

    @property
    def n_vocab(self) -> int:
        """Columns of the draft's head: N with a draft vocabulary, else the target's V."""
        return self.target.cfg.vocab_size if self.vocab is None else len(self.vocab)

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (..., N) -> (..., V) with -inf (q = 0) at every token outside it."""
        if self.vocab is None:
            return logits
        V = self.target.cfg.vocab_size
        if not (torch.is_grad_enabled() and logits.requires_grad):  # inference: one native pass on the CPU
            out = kernels.scatter_columns(logits, self.vocab, V)
            if out is not None:
                return out
        return logits.new_full((*logits.shape[:-1], V), float("-inf")).index_copy_(-1, self.vocab, logits)

    def to_draft_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target token ids (...) -> draft-vocabulary columns (...), -100 (ignored by cross-entropy) outside it."""
        if self.vocab is None:
            return tokens
        table = torch.full((self.target.cfg.vocab_size,), -100, dtype=torch.int64, device=tokens.device)
        table[self.vocab] = torch.arange(len(self.vocab), device=tokens.device)
        return table[tokens]
