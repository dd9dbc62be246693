"""N-gram draft: prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding), as vLLM's
``ngram`` speculative method (``vllm/v1/spec_decode/ngram_proposer.py``; ``speculative_config={"method": "ngram",
"prompt_lookup_min": ..., "prompt_lookup_max": ...}``).

No weights and no training: the draft looks up the longest suffix of a row's own context (its prompt and the
tokens committed so far) that occurred earlier in that same context and proposes the tokens that followed it.

The match (:func:`ngram_source`), as vLLM's ``_find_longest_matched_ngram_and_propose_tokens``:

- the suffix length n runs from ``n_max`` down to ``n_min`` and the longest n with an earlier occurrence wins
  (the occurrence must end before the context's last token; it may overlap the suffix itself);
- among the occurrences of that n, the **earliest** one (smallest start) wins, as in vLLM (its LPS scan keeps
  "the earliest position in the original tokens");
- the proposal is the token right after that occurrence, then the tokens after it, one per draft step.

Where vLLM stops at the end of the context (it proposes fewer than k tokens), this draft must give one token per
step (the round loop drafts k): it goes on copying from the same source, which now reads the draft's own
proposals, i.e. it repeats the matched continuation periodically (``a b c a b`` -> ``c a b c ...``).

No match (no n in [n_min, n_max] occurs earlier, or the context is shorter than n_min + 1): the draft proposes
the row's last token again (cheap and deterministic; vLLM proposes nothing there, a plain decoding step) and
looks up again at the next step, over the context extended by that proposal.

The draft's q is one-hot: :meth:`NgramDraft.step` returns logits 0 at the proposed token and -inf elsewhere, so
``spire.sampling.probs_from_logits`` gives exactly the one-hot q under any temperature, top-k and top-p, and
rejection sampling (:func:`spire.verification.verify`) accepts x with probability p(x) and otherwise draws from
p without x, renormalized: the output is distributed as the target's p (lossless).

State is per generation and per row: :meth:`NgramDraft.start` allocates a fresh (B, max_len) token buffer, so a
row never sees another request's tokens (a previous generation on the same slot) nor another row's; a lookup at
position ``pos`` reads only that row's positions <= pos (entries past it may be stale drafts or right-padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from spire.drafts.base import Draft
from spire.registry import DraftImpl
from spire.errors import ConfigError
from spire.kv_cache import KVCache, Span
from spire.model import ForwardOutput, Transformer

N_MIN = 5
"""vLLM's default ``prompt_lookup_min`` when neither bound is given ("arbitrarily chosen" there)."""
N_MAX = 5
"""vLLM's default ``prompt_lookup_max`` when neither bound is given."""


@dataclass
class NgramConfig:
    """The n-gram lengths the lookup tries, in tokens: ``n_min`` <= n <= ``n_max``.

    As vLLM's ``prompt_lookup_min`` / ``prompt_lookup_max``: when neither is given both are 5; when one is given
    the other takes its value. Raises ConfigError (:meth:`validate`, also run on construction).
    """

    n_min: int | None = None
    n_max: int | None = None

    def __post_init__(self) -> None:
        if self.n_min is None and self.n_max is None:
            self.n_min, self.n_max = N_MIN, N_MAX
        elif self.n_min is None:
            self.n_min = self.n_max
        elif self.n_max is None:
            self.n_max = self.n_min
        self.validate()

    def validate(self) -> None:
        """ConfigError unless 1 <= n_min <= n_max (both integers)."""
        for name, v in (("n_min", self.n_min), ("n_max", self.n_max)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"ngram {name} must be an integer, got {v!r}")
        if self.n_min < 1:
            raise ConfigError(f"ngram n_min must be >= 1, got {self.n_min}")
        if self.n_max < self.n_min:
            raise ConfigError(f"ngram n_max must be >= n_min, got n_min = {self.n_min}, n_max = {self.n_max}")


def ngram_source(context: Sequence[int], n_min: int, n_max: int) -> int | None:
    """Reference lookup (pure Python, for tests and documentation). The index in ``context`` of the first
    token to propose: the token after the earliest occurrence of the longest suffix of length n_min..n_max that
    also occurs ending before the last token; None when there is none."""
    L = len(context)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = list(context[L - n:])
        for e in range(n - 1, L - 1):  # e: the occurrence's last index, < L - 1
            if list(context[e - n + 1: e + 1]) == suffix:
                return e + 1
    return None


def ngram_propose(context: Sequence[int], k: int, cfg: NgramConfig | None = None) -> list[int]:
    """Reference proposal (pure Python): the k tokens :class:`NgramDraft` proposes in one round after
    ``context`` (the row's committed tokens, pending one included). The first tokens are vLLM's proposal;
    past the context's end the matched continuation repeats; without a match the last token is repeated and
    the lookup retried on the extended context."""
    cfg = cfg or NgramConfig()
    ext, out, src = list(context), [], None
    for _ in range(k):
        src = ngram_source(ext, cfg.n_min, cfg.n_max) if src is None else src + 1
        tok = ext[src] if src is not None else ext[-1]
        out.append(tok)
        ext.append(tok)
    return out


def host_source(context: Sequence[int] | np.ndarray, n_min: int, n_max: int) -> int:
    """The lookup of :func:`ngram_source` on the host, with numpy (vLLM's n-gram proposer also runs on the CPU over
    the token ids the scheduler holds): the index in ``context`` (a row's tokens, the pending one last) of the
    first token to propose, or -1. The candidates are the earlier positions e < L - 1 holding the last token; each
    one's run of equal tokens going back (buf[e - j] == buf[L - 1 - j]) is counted up to min(n_max, L - 1); the
    longest run of at least n_min wins, the earliest e among equals. O(L) to find the candidates, O(n_max) per
    candidate."""
    ctx = np.asarray(context, dtype=np.int64)
    L = len(ctx)
    n_top = min(n_max, L - 1)
    if n_top < n_min:
        return -1
    ends = np.flatnonzero(ctx[: L - 1] == ctx[L - 1])
    ends = ends[ends >= n_min - 1]  # a shorter prefix cannot hold a run of n_min
    run = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, n_top):
        alive &= ends >= j
        alive[alive] = ctx[ends[alive] - j] == ctx[L - 1 - j]
        if not alive.any():
            break
        run += alive
    best = int(run.max()) if len(run) else 0
    return int(ends[np.argmax(run == best)]) + 1 if best >= n_min else -1


def match_sources(buf: torch.Tensor, pos: torch.Tensor, n_min: int, n_max: int, stop_early: bool = True
                  ) -> torch.Tensor:
    """Vectorized lookup over rows. buf: (R, W) int64 tokens by absolute position; pos: (R,) int64, the last
    context position of each row (< W). Only positions <= pos[r] of row r are read. Returns (R,) int64: the
    position of the first token to propose (<= pos[r]), or -1 where no n in [n_min, n_max] matches.

    For every candidate end position e < pos, count[e] = length (capped at n_max) of the common run of
    buf[e - j] == buf[pos - j], j = 0, 1, ...: n_max shifted (R, W) comparisons, O(n_max · R · W). ``stop_early``
    stops once no candidate is left (a host sync per comparison: off for a device computation)."""
    R, W = buf.shape
    cols = torch.arange(W, device=buf.device)
    suffix = buf.gather(1, (pos[:, None] - torch.arange(n_max, device=buf.device)).clamp_min(0))  # (R, n_max)
    alive = cols[None] < pos[:, None]  # (R, W) candidate ends e < pos (so e - j >= 0 implies pos - j >= 1)
    count = torch.zeros(R, W, dtype=torch.int64, device=buf.device)
    for j in range(n_max):
        eq = torch.zeros_like(alive)
        eq[:, j:] = buf[:, : W - j] == suffix[:, j: j + 1]  # eq[e] = buf[e - j] == buf[pos - j]
        alive &= eq
        if stop_early and not bool(alive.any()):
            break
        count += alive
    # longest count wins; among equal counts the smallest e (the earliest occurrence)
    best = (count * W + (W - 1 - cols)[None]).argmax(1)  # (R,)
    n = count.gather(1, best[:, None])[:, 0]
    return torch.where(n >= n_min, best + 1, torch.full_like(best, -1))


class NgramDraft(Draft):
    """Prompt lookup (vLLM's ``ngram`` method) behind the :class:`Draft` protocol; see the module docstring.

    Args:
        cfg: the n-gram bounds (default vLLM's: n_min = n_max = 5).
    State after :meth:`start` (all on the target's device): ``buf`` (B, max_len) int64, row b's token at each
    absolute position (-1 where never written); ``src`` (B,) the position the row's last proposal was copied
    from (-1: none, look up again); ``last_pos`` / ``last_tok`` (B,) the previous step's position and proposal.
    """

    name = "ngram"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, cfg: NgramConfig | None = None) -> None:
        self.cfg = cfg or NgramConfig()
        self.cfg.validate()
        self.vocab_size = 0
        self.max_len = 0
        self.buf: torch.Tensor | None = None
        self.src: torch.Tensor | None = None
        self.last_pos: torch.Tensor | None = None
        self.last_tok: torch.Tensor | None = None
        self._probe: tuple | None = None  # (pos, token, source) of the lookup :meth:`proposes` made

    def start(self, target: Transformer, target_cache: KVCache, batch_size: int, max_len: int, k: int) -> None:
        """Fresh state for ``batch_size`` rows and positions < max_len: nothing of a previous generation stays."""
        dev = target.device
        self.vocab_size, self.max_len = target.cfg.vocab_size, max_len
        self._buf = torch.full((batch_size, max_len), -1, dtype=torch.int64, device=dev)
        self.use_rows(batch_size)

    def use_rows(self, n: int) -> bool:
        """Rows [0, n): a view of the token buffers; the lookup state (reset by every observe) restarts."""
        dev = self._buf.device
        self.buf = self._buf[:n]
        self.src = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.last_pos = torch.full((n,), -2, dtype=torch.int64, device=dev)
        self.last_tok = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self._probe = None
        return True

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Forget rows ``rows`` (R,): their token buffers and lookup state are reset as :meth:`start` leaves them, so
        a new request in the slot never sees the previous one's tokens (CASES.md 16)."""
        assert self.buf is not None, "call start() first"
        rows = rows.to(self.buf.device)
        self.buf[rows] = -1
        self.src[rows], self.last_pos[rows], self.last_tok[rows] = -1, -2, -1
        self._probe = None

    def proposes(self, tokens: torch.Tensor, pos: torch.Tensor, span: Span | None = None,
                 contexts: Sequence[Sequence[int] | None] | None = None) -> torch.Tensor | list[bool]:
        """(B,) bool: whether the lookup at the next :meth:`step` (``tokens``, ``pos`` (B, 1), a round's first) finds
        an n-gram match in each row's context, i.e. proposes a token of the context rather than nothing. The lookup
        is kept for that step (it is not made twice); the state is not changed. With ``span`` (pos on the host)
        nothing is read back. With ``span`` and ``contexts`` (each row's tokens at 0..pos, the pending one last,
        as the host holds them; None: a row without a request) the lookup runs on the host (:func:`host_source`)
        and the answer is a host list: the engine's round then reads the device once."""
        assert self.buf is not None, "call start() first"
        tok = tokens[:, 0].to(self.buf.device, torch.int64)
        p = pos[:, 0].to(self.buf.device, torch.int64)
        if contexts is not None and span is not None:
            found = [-1 if c is None else host_source(c, self.cfg.n_min, self.cfg.n_max) for c in contexts]
            src = torch.tensor(found, dtype=torch.int64).to(self.buf.device, non_blocking=True)
            self._probe = (p, tok, src, span.starts)
            return [s >= 0 for s in found]
        width = min((span.hi if span is not None else int(p.max())) + 1, self.max_len)
        rows = torch.arange(len(p), device=p.device)
        buf = self.buf[:, :width].clone()
        buf[rows, p.clamp_max(width - 1)] = tok
        src = match_sources(buf, p, self.cfg.n_min, self.cfg.n_max, stop_early=span is None)
        self._probe = (p, tok, src, None if span is None else span.starts)
        return src >= 0

    def observe(self, tokens: torch.Tensor, pos: torch.Tensor, target_out: ForwardOutput,
                valid: torch.Tensor | None = None, span: Span | None = None) -> None:
        """Write the tokens (B, T) the target ran on at positions (B, T) (right-padding, ``valid`` False, is not
        written); the next step looks up afresh (a new round)."""
        assert self.buf is not None, "call start() first"
        self._probe = None
        tokens, pos = tokens.to(self.buf.device, torch.int64), pos.to(self.buf.device, torch.int64)
        if valid is not None:
            tokens = torch.where(valid.to(self.buf.device), tokens, self.buf.gather(1, pos))
        self.buf.scatter_(1, pos, tokens)
        self.src.fill_(-1)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor, span: Span | None = None) -> torch.Tensor:
        """tokens, pos: (B, 1) -> float32 logits (B, V) for position pos + 1: 0 at the proposed token, -inf
        elsewhere. Writes the input token at pos first; reads only positions <= pos of each row. Raises
        ConfigError when pos + 1 is beyond the context the draft was started for (max_len).

        With ``span`` (pos on the host) or off the CPU nothing is read back: every row is looked up over the
        positions the span bounds (all of them without one) and a continuing row keeps its source; on the CPU
        without a span only the rows that need a lookup are looked up, over the positions they read."""
        assert self.buf is not None, "call start() first"
        tok = tokens[:, 0].to(self.buf.device, torch.int64)
        p = pos[:, 0].to(self.buf.device, torch.int64)
        # positions read back (free on the CPU; not while torch.compile traces)
        host = span is None and p.device.type == "cpu" and not torch.compiler.is_compiling()
        lo, hi = (span.lo, span.hi) if span is not None else (int(p.min()), int(p.max())) if host else (0, -1)
        if hi + 1 >= self.max_len or lo < 0:
            raise ConfigError(f"n-gram draft asked for position {hi + 1}, its context holds {self.max_len} positions")
        rows = torch.arange(len(p), device=p.device)
        self.buf[rows, p] = tok
        cont = (self.src >= 0) & (p == self.last_pos + 1) & (tok == self.last_tok)
        src = torch.where(cont, self.src + 1, torch.full_like(self.src, -1))
        probe, self._probe = self._probe, None
        if probe is not None and span is not None and probe[3] == span.starts:  # known on the host: no read
            # the lookup :meth:`proposes` just made at these positions (for the tokens it was given)
            src = torch.where(cont, src, torch.where(probe[1] == tok, probe[2], torch.full_like(src, -1)))
        elif probe is not None and span is None and torch.equal(probe[0], p) and torch.equal(probe[1], tok):
            src = torch.where(cont, src, probe[2])  # the lookup :meth:`proposes` just made at these positions
        elif not host:
            width = hi + 1 if span is not None else self.buf.shape[1]
            found = match_sources(self.buf[:, :width], p, self.cfg.n_min, self.cfg.n_max, stop_early=False)
            src = torch.where(cont, src, found)
        elif len(look := (~cont).nonzero()[:, 0]):
            lp = p[look]
            width = int(lp.max()) + 1
            src[look] = match_sources(self.buf[look, :width], lp, self.cfg.n_min, self.cfg.n_max)
        proposal = torch.where(src >= 0, self.buf[rows, src.clamp_min(0)], tok)
        self.src, self.last_pos, self.last_tok = src, p, proposal
        logits = torch.full((len(p), self.vocab_size), float("-inf"), dtype=torch.float32, device=tokens.device)
        return logits.scatter_(1, proposal.to(tokens.device)[:, None], 0.0)


def load_draft(target: Transformer, tokenizer=None, path=None, *, n_min: int | None = None,
               n_max: int | None = None, **_) -> NgramDraft:
    """The n-gram draft for ``target`` (``spire generate --draft ngram``). n_min / n_max: the lookup bounds
    (vLLM's rule when one or both are None). Raises ConfigError for a draft path or bad bounds."""
    if path:
        raise ConfigError("--draft ngram takes no --draft-path (it has no weights)")
    try:
        config = NgramConfig(n_min, n_max)
    except ConfigError as e:  # the rule, named by the flags that set it
        raise ConfigError(f"--ngram-min / --ngram-max: {e}") from None
    return NgramDraft(config)


KIND = DraftImpl(load=load_draft)
