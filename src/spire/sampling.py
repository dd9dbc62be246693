"""Logits to the distribution that is sampled: the logits processing of :class:`LogitsProcessing` (logit bias,
min_tokens, repetition / presence / frequency penalties, which depend on the tokens so far), then greedy or
temperature, min-p, top-k, top-p (:class:`SamplingParams`).

The same transforms are applied to the target's p and the draft's q before verification (Leviathan et al. 2023
require it: otherwise the output is not the sampled-from target distribution); a transform that depends on the
tokens so far sees, at a drafted position, the drafted tokens before it. All probability arithmetic is float32 or
wider.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spire.errors import ConfigError
from spire.params import LogitsProcessing, SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after the transform (rows sum to 1)."""
    logits = raw = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # subtract the row maximum first: logits / T overflows to inf for a tiny T (1e-38), and inf - inf is NaN;
    # shifted logits are <= 0, so / T gives finite values or -inf; the maxima stay 0 even where T underflows
    # float32 to 0 (1e-320: 0 / 0 would be NaN), so a tiny T is greedy with ties shared
    shifted = logits - logits.amax(-1, keepdim=True)
    logits = torch.where(shifted == 0, torch.zeros_like(shifted), shifted / params.temperature)
    if params.min_p > 0:  # p < min_p * p_max  <=>  logit < log(min_p) (the shifted maximum is 0)
        logits = logits.masked_fill(logits < math.log(params.min_p), float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    return _valid_rows(logits.softmax(-1), raw)


def _valid_rows(probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``probs`` with each row that is not a distribution (logits with a NaN or +inf: a diverged draft) replaced by
    the one-hot of the row's largest finite logit. Any distribution is lossless to verify against as long as the
    token is drawn from it (Leviathan et al. 2023): the target accepts that token with probability p(x) and
    otherwise draws from the residual, so decoding goes on with the target's distribution, never a traceback."""
    bad = ~torch.isfinite(probs).all(-1, keepdim=True)  # selected, not branched on: nothing is read back
    best = torch.nan_to_num(logits, nan=float("-inf"), posinf=float("-inf")).argmax(-1)
    return torch.where(bad, torch.zeros_like(probs).scatter_(-1, best[..., None], 1.0), probs)  # (one_hot reads back)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of (..., V) probabilities -> (...) int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


class TokenHistory:
    """What the penalties of one sequence need of its tokens so far: ``seen`` (V,) bool, the tokens of the prompt
    or the output; ``counts`` (V,) float32, occurrences in the output. :meth:`add` appends output tokens."""

    def __init__(self, prompt: list[int], vocab: int, device: torch.device | str = "cpu") -> None:
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.generated = 0

    def add(self, tokens: list[int]) -> None:
        if tokens:
            t = torch.tensor(tokens, dtype=torch.long, device=self.counts.device)
            self.seen[t] = True
            self.counts.index_add_(0, t, torch.ones(len(tokens), device=self.counts.device))
            self.generated += len(tokens)


def process_logits(logits: torch.Tensor, proc: LogitsProcessing, history: TokenHistory | None, generated: int,
                   drafted: list[int] = (), first: int = 0) -> torch.Tensor:
    """Apply ``proc`` to one sequence's logits at T consecutive positions.

    Args:
        logits: (T, V) the logits at T positions; position t follows the tokens so far (``history``, of which
            ``generated`` were generated) and then ``drafted[: first + t]`` (drafted tokens not yet committed).
        proc: the transforms. history: needed when ``proc.penalized``.
    Returns:
        (T, V) float32 logits (a new tensor; ``logits`` is not changed).
    """
    out = logits.float().clone()
    T, V = out.shape
    if proc.logit_bias:
        ids = torch.tensor([t for t, _ in proc.logit_bias], dtype=torch.long, device=out.device)
        out[:, ids] += torch.tensor([b for _, b in proc.logit_bias], dtype=torch.float32, device=out.device)
    if proc.min_tokens > 0 and proc.banned:
        n_gen = generated + first + torch.arange(T, device=out.device)  # tokens generated before each position
        early = (n_gen < proc.min_tokens)[:, None]
        ban = torch.zeros(V, dtype=torch.bool, device=out.device)
        ban[torch.tensor(proc.banned, dtype=torch.long, device=out.device)] = True
        out = out.masked_fill(early & ban[None], float("-inf"))
    if proc.penalized:
        counts = history.counts[None].repeat(T, 1)  # (T, V) occurrences in the output before each position
        for i, tok in enumerate(drafted[: first + T - 1]):
            counts[max(0, i - first + 1):, tok] += 1
        seen = history.seen[None] | (counts > 0)
        if proc.repetition_penalty != 1.0:
            r = proc.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        if proc.frequency_penalty:
            out = out - proc.frequency_penalty * counts
        if proc.presence_penalty:
            out = out - proc.presence_penalty * (counts > 0).float()
    return out


def logprobs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) processed logits -> (..., V) float32 log-probabilities: log-softmax of the logits divided by the
    temperature (1 for greedy), before min-p / top-k / top-p truncation (so every token has a finite value)."""
    logits = logits.float()
    t = params.temperature if params.temperature > 0 else 1.0
    return torch.log_softmax(logits / t, -1)
