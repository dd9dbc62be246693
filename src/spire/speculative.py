"""Batched speculative decoding in one call: :func:`generate`, a thin wrapper over the engine
(:func:`spire.engine.engine.generate_batch`), for library users who decode a list of prompts and want the tokens.

The round loop itself (draft k tokens, verify k + 1 positions, accept a prefix, commit and roll back; SPIRe paper
§2) lives in :mod:`spire.engine.runner`; a prefill shared by several decoders in :mod:`spire.engine.prefill`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from spire.drafts.base import Draft
from spire.engine.engine import generate_batch
from spire.engine.output import GenerationResult
from spire.engine.prefill import as_rows
from spire.model import Transformer
from spire.sampling import SamplingParams


def generate(target: Transformer, prompts: torch.Tensor | Sequence[Sequence[int]], max_new_tokens: int,
             draft: Draft | None = None, k: int = 4, params: SamplingParams = SamplingParams(), seed: int = 0,
             eos_ids: Sequence[int] = (), stop: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None,
             progress: Callable[[int], object] | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per prompt, with speculative rounds when a draft is given.

    Args:
        target: the target model.
        prompts: (B, L) token ids or B lists of ids (lengths may differ).
        max_new_tokens: budget per prompt (tokens); never overshot.
        draft: an unstarted :class:`Draft` (``spire.drafts.make_draft``), or None for AD.
        k: draft tokens per round (>= 1).
        params: the sampling transform, applied to the target's and the draft's distributions alike; ``seed``:
            prompt i samples with its own generator seeded ``seed + i``.
        eos_ids: token ids that end a row (the EOS token is emitted, then the row stops).
        stop: stop strings (``decode``: token ids -> text needed); a row ends at the token that completes one.
        progress: called with the number of tokens each step emitted (e.g. tqdm.update).
    Returns:
        a :class:`~spire.engine.output.GenerationResult` (tokens, finish reasons, rounds, τ).
    Raises:
        ConfigError: k < 1, max_new_tokens < 1, no or an empty prompt, or a context beyond the target's positions.
    """
    return generate_batch(target, as_rows(prompts), max_new_tokens, draft, k, params, seed, eos_ids, stop, decode,
                          progress)
