"""The named oracle: the static-batch round loop spire had before the engine (SPIRe paper §2; Leviathan et al.
2023), kept in the tests as an independent reference for the engine (:mod:`spire.engine`).

Every row starts together and the batch runs until the last row ends; one generator samples every row. A round:
draft k tokens per row (:func:`_draft`), verify k + 1 positions in one target forward (:func:`_sd_round`), keep a
prefix per row (:func:`accept`, :mod:`spire.verification`), commit each active row's tokens and roll back the
rejected ones by not advancing (:class:`_Rows`). ``draft=None`` is AD. It shares with the engine only the prefill
(:mod:`spire.engine.prefill`), the output cut (:mod:`spire.engine.output`) and verification itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from spire.drafts.base import Draft
from spire.engine.output import GenerationResult, StopStrings, cut_output
from spire.engine.prefill import Prefilled, as_rows, cache_length, prefill, start_draft
from spire.errors import ConfigError
from spire.kv_cache import KVCache
from spire.model import Transformer
from spire.sampling import SamplingParams, probs_from_logits, sample
from spire.timing import Stopwatch
from spire.verification import output_tokens, verify, verify_greedy

__all__ = ["generate", "decode", "prefill", "cache_length", "start_draft", "Prefilled"]


@torch.no_grad()
def generate(target: Transformer, prompts: torch.Tensor | Sequence[Sequence[int]], max_new_tokens: int,
             draft: Draft | None = None, k: int = 4, params: SamplingParams = SamplingParams(),
             generator: torch.Generator | None = None, eos_ids: Sequence[int] = (),
             stop: StopStrings | None = None, progress=None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per row, with speculative rounds when a draft is given.

    Args:
        target: the target model.
        prompts: (B, L) token ids or B lists of ids (lengths may differ).
        max_new_tokens: budget per row (tokens); never overshot.
        draft: a :class:`Draft`, or None for AD.
        k: draft tokens per round (>= 1).
        params: sampling transform applied identically to p and q.
        generator: torch RNG for reproducible sampling.
        eos_ids: token ids that end a row (the EOS token is emitted, then the row stops).
        stop: optional :class:`StopStrings`; a row ends at the token that completes a stop string.
        progress: optional callable(n_new_tokens) called as tokens are emitted (e.g. tqdm.update).
    Raises:
        ConfigError: k < 1, max_new_tokens < 1, empty prompt, or a context beyond the target's positions.
    """
    _check(k, max_new_tokens)
    rows = as_rows(prompts)
    max_len = cache_length(target, rows, max_new_tokens, k if draft is not None else 0)
    state = prefill(target, rows, max_len, draft.hidden_layers if draft is not None else ())
    if draft is not None:
        start_draft(draft, target, k, state.cache, state)
    return decode(target, state, max_new_tokens, draft, k, params, generator, eos_ids, stop, progress)


def _check(k: int, max_new_tokens: int) -> None:
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


@torch.no_grad()
def decode(target: Transformer, state: Prefilled, max_new_tokens: int, draft: Draft | None = None, k: int = 4,
           params: SamplingParams = SamplingParams(), generator: torch.Generator | None = None,
           eos_ids: Sequence[int] = (), stop: StopStrings | None = None, progress=None,
           cache: KVCache | None = None) -> GenerationResult:
    """The round loop after :func:`prefill` (arguments as :func:`generate`). ``cache`` (default
    ``state.cache``) is the target cache to continue from; a draft must already be started on it and have
    observed the prefill (:func:`start_draft`). Greedy decoding (temperature 0) takes argmaxes directly
    (:func:`spire.verification.verify_greedy`).

    Raises ConfigError for k < 1 or max_new_tokens < 1, or a cache too short for max_new_tokens.
    """
    _check(k, max_new_tokens)
    cache = state.cache if cache is None else cache
    need = cache_length(target, state.rows, max_new_tokens, k if draft is not None else 0)
    if need > cache.max_len:
        raise ConfigError(f"the cache holds {cache.max_len} positions, {need} are needed")
    eos_set = set(int(t) for t in eos_ids)
    watch = Stopwatch(target.device)
    rows = _Rows.start(state.rows, target.device)
    accepted_log: list[list[int]] = []
    while any(rows.active):
        pos0 = rows.n - 1  # (B,) position of the pending token
        if draft is None:
            n_acc, next_tok, block = _ad_round(target, cache, rows.pending, pos0, params, generator)
        else:
            n_acc, next_tok, block = _sd_round(target, cache, draft, rows.pending, pos0, k, params, generator)
        accepted = n_acc.tolist()
        accepted_log.append(accepted)
        new_tokens = rows.emit(block.tolist(), accepted, max_new_tokens, eos_set, stop)
        if progress is not None:
            progress(new_tokens)
        rows.advance(n_acc, next_tok)
    decode_s, decode_cpu_s = watch.stop()
    return GenerationResult(rows.emitted, rows.finish, rows.rounds, [len(e) for e in rows.emitted], accepted_log,
                            prefill_s=state.prefill_s, decode_s=decode_s, decode_cpu_s=decode_cpu_s)


def _ad_round(target: Transformer, cache: KVCache, pending: torch.Tensor, pos0: torch.Tensor,
              params: SamplingParams, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AD step: the target's token after the pending one. Returns n_accepted (B,) zeros, next_token (B,)
    and the output tokens (B, 1)."""
    logits = target(pending[:, None], pos0[:, None], cache).logits[:, -1]  # (B, V)
    if params.greedy:
        next_tok = logits.argmax(-1)
    else:
        next_tok = sample(probs_from_logits(logits, params), generator)
    return torch.zeros_like(next_tok), next_tok, next_tok[:, None]


def _sd_round(target: Transformer, cache: KVCache, draft: Draft, pending: torch.Tensor, pos0: torch.Tensor, k: int,
              params: SamplingParams, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One speculative round: draft k tokens, verify them in one target forward over k+1 positions, accept a
    prefix; the draft then observes the target's pass. Returns n_accepted (B,), next_token (B,) (recovered or
    bonus) and the output tokens as a (B, k+1) block (:func:`spire.verification.output_tokens`)."""
    d_tokens, q = _draft(draft, pending, pos0, k, params, generator)  # (B, k), (B, k, V) or None (greedy)
    verify_in = torch.cat([pending[:, None], d_tokens], 1)  # (B, k+1)
    vpos = pos0[:, None] + torch.arange(k + 1, device=pos0.device)  # (B, k+1)
    out = target(verify_in, vpos, cache, hidden_layers=draft.hidden_layers)
    n_acc, next_tok = accept(d_tokens, q, out.logits, params, generator)
    draft.observe(verify_in, vpos, out)
    return n_acc, next_tok, output_tokens(d_tokens, n_acc, next_tok)


def _draft(draft: Draft, pending: torch.Tensor, pos0: torch.Tensor, k: int, params: SamplingParams,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """k draft forwards from the pending token. Returns the draft tokens (B, k) and the exact distributions
    they were drawn from (B, k, V); greedy: each step's argmax, and None (no distributions are built)."""
    tok, tokens, qs = pending, [], []
    for j in range(k):
        logits = draft.step(tok[:, None], (pos0 + j)[:, None])  # (B, V)
        if params.greedy:
            tok = logits.argmax(-1)
        else:
            q = probs_from_logits(logits, params)  # (B, V)
            tok = sample(q, generator)
            qs.append(q)
        tokens.append(tok)
    return torch.stack(tokens, 1), torch.stack(qs, 1) if qs else None


def accept(d_tokens: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, params: SamplingParams,
            generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification of draft tokens (B, k) against the target's logits (B, k+1, V): greedy, or by rejection
    sampling with p transformed exactly as q was. Returns n_accepted (B,), next_token (B,)."""
    if params.greedy:
        return verify_greedy(d_tokens, logits)
    return verify(d_tokens, q, probs_from_logits(logits, params), generator)  # p: (B, k+1, V)


@dataclass
class _Rows:
    """The round loop's per-row state. n: (B,) committed length; pending: (B,) the last committed token, not
    yet in the target cache; emitted, finish, rounds, active: per row, the emitted tokens, the finish reason,
    the rounds run while active, and whether the row still decodes."""

    n: torch.Tensor
    pending: torch.Tensor
    emitted: list[list[int]]
    finish: list[str]
    rounds: list[int]
    active: list[bool]

    @classmethod
    def start(cls, prompts: list[list[int]], device: torch.device) -> _Rows:
        B = len(prompts)
        return cls(torch.tensor([len(r) for r in prompts], device=device),
                   torch.tensor([r[-1] for r in prompts], device=device),
                   [[] for _ in range(B)], ["length"] * B, [0] * B, [True] * B)

    def emit(self, block: list[list[int]], accepted: list[int], max_new_tokens: int, eos_set: set[int],
             stop: StopStrings | None) -> int:
        """Commit each active row's output tokens ``block[b][: accepted[b] + 1]``, cut at its budget, at an EOS
        token (emitted) or at the token that completes a stop string; a cut row finishes. Returns the number of
        tokens emitted."""
        new_total = 0
        for b, toks in enumerate(block):
            if not self.active[b]:
                continue
            self.rounds[b] += 1
            toks, stopped = cut_output(self.emitted[b], toks[: accepted[b] + 1], max_new_tokens, eos_set, stop)
            if stopped:
                self.finish[b] = "stop"
                self.active[b] = False
            self.emitted[b].extend(toks)
            new_total += len(toks)
            if len(self.emitted[b]) >= max_new_tokens:
                self.active[b] = False
        return new_total

    def advance(self, n_acc: torch.Tensor, next_tok: torch.Tensor) -> None:
        """Commit / rollback: an active row's committed length grows by n_acc + 1 and its next token becomes
        pending; its rejected tokens are rolled back by not counting them (the cache invariant). Finished
        rows stay put (their compute this round is wasted, their state untouched)."""
        act = torch.tensor(self.active, device=self.n.device)
        self.n = torch.where(act, self.n + n_acc + 1, self.n)
        self.pending = torch.where(act, next_tok, self.pending)
