"""KV caches and the attention masks that read them.

A :class:`KVCache` stores keys and values for every layer at their *absolute* text position, one row per
sequence (like gpt-fast's static cache). Each row has its own length, so speculative rounds that accept
different numbers of tokens per row need no copying: rolling a row back is moving its length pointer,
and stale entries past the pointer are never read because (1) every query attends only to keys at
positions <= its own and (2) a round writes a position before any query at or after it reads it.

The same storage serves a dense (full-history) view and a StreamingLLM view (Xiao et al. 2023,
"Efficient Streaming Language Models with Attention Sinks"): the view is a mask, see :func:`attention_mask`.
A :class:`RingKVCache` keeps only a sink + window of slots (the SPIRe draft's cache). Both are
:class:`BaseKVCache`: the operations the round loop, the drafts and the serving engine use.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from spire import defaults, kernels
from spire.errors import ConfigError


@dataclass(frozen=True)
class SinkWindow:
    """A StreamingLLM view: a query at position p sees the first ``sink`` positions and the last ``window``
    positions up to and including p, i.e. keys j with ``j < sink`` or ``p - window < j <= p``.

    SPIRe and MagicDec use sink 1, window 64 (SPIRe paper §3; MagicDec, Chen et al. 2024).
    """

    sink: int = defaults.SINK
    window: int = defaults.WINDOW

    def __post_init__(self) -> None:
        if self.sink < 0 or self.window < 1:
            raise ConfigError(f"sink must be >= 0 and window >= 1, got sink={self.sink}, window={self.window}")

    @property
    def size(self) -> int:
        """Number of cache entries one query reads at most (tokens)."""
        return self.sink + self.window


@dataclass(frozen=True)
class Span:
    """The host's copy of a forward's positions: row b's T new tokens sit at ``starts[b] .. starts[b] + T - 1``.

    The scheduler knows every row's committed length without reading the device, so it can say where a forward's
    tokens sit; a forward given its Span plans its cache access (what to read, whether a slice write does, whether
    anything is masked) from these ints and reads no position back from the device (a host sync on a GPU). The
    device tensor of the same positions is still passed alongside (the device computation reads that one).

    starts: (B,) python ints, each row's first position; T: new tokens per row. Raises ConfigError for a negative
    position or T < 1.
    """

    starts: tuple[int, ...]
    T: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "starts", tuple(int(s) for s in self.starts))
        if self.T < 1 or not self.starts or min(self.starts) < 0:
            raise ConfigError(f"a span needs T >= 1 and positions >= 0, got starts {list(self.starts)}, T {self.T}")

    @property
    def lo(self) -> int:
        """The smallest position."""
        return min(self.starts)

    @property
    def hi(self) -> int:
        """The largest position."""
        return max(self.starts) + self.T - 1

    @property
    def same(self) -> bool:
        """Whether every row's tokens sit at the same positions."""
        return all(s == self.starts[0] for s in self.starts)

    def shifted(self, j: int, T: int | None = None) -> "Span":
        """Every row's positions moved on by j (a draft's next step), with T new tokens (default the same)."""
        return Span(tuple(s + j for s in self.starts), self.T if T is None else T)


def attention_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    view: SinkWindow | None = None,
) -> torch.Tensor:
    """Boolean attention mask, True where the query may attend.

    Args:
        q_pos: (B, T) absolute positions of the queries.
        k_pos: (S,) or (B, S) absolute positions of the keys.
        view: None for full causal attention, or a :class:`SinkWindow`.

    Returns:
        (B, 1, T, S) bool mask (broadcasts over heads).
    """
    qp = q_pos[:, :, None]  # (B, T, 1)
    kp = k_pos[None, None, :] if k_pos.dim() == 1 else k_pos[:, None, :]  # (B|1, 1, S)
    mask = kp <= qp
    if view is not None:
        mask = mask & ((kp < view.sink) | (kp > qp - view.window))
    return mask[:, None]


_CAUSAL: dict[tuple[int, torch.device], torch.Tensor] = {}


def causal_mask(T: int, device: torch.device) -> torch.Tensor:
    """The (1, 1, T, T) bool mask of T queries at positions 0..T-1 over keys at 0..T-1 (key j visible to query i
    when j <= i), one tensor per (T, device) while it stays among the last 4 built: attention recognises it by
    identity (:func:`is_causal`) and runs SDPA's ``is_causal``, which skips the masked half."""
    key = (T, torch.device(device))
    if key not in _CAUSAL:
        if len(_CAUSAL) >= 4:
            _CAUSAL.pop(next(iter(_CAUSAL)))
        pos = torch.arange(T, device=device)
        _CAUSAL[key] = (pos[None, :] <= pos[:, None])[None, None]
    return _CAUSAL[key]


def is_causal(mask: torch.Tensor | None) -> bool:
    """Whether ``mask`` is a kept :func:`causal_mask` tensor (a mask equal to it but built otherwise answers False:
    it is then applied as a mask, with the same result). Builds nothing."""
    if mask is None or mask.dim() != 4 or torch.compiler.is_compiling():  # traced: never built, so never met
        return False
    return _CAUSAL.get((mask.shape[-1], mask.device)) is mask


def prefix_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, view: SinkWindow | None = None) -> torch.Tensor:
    """:func:`attention_mask`, as the shared :func:`causal_mask` when it is one: no view, and every row's queries
    and keys at 0..T-1 (a prefill from the start, padded rows included). k_pos: (S,) or (B, S)."""
    T = q_pos.shape[-1]
    if view is None and T > 1 and k_pos.shape[-1] == T and not torch.compiler.is_compiling():  # no graph break
        ar = torch.arange(T, device=q_pos.device)
        if bool((k_pos == ar).all()) and bool((q_pos == ar).all()):
            return causal_mask(T, q_pos.device)
    return attention_mask(q_pos, k_pos, view)


def self_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """q_pos (..., T), k_pos (..., S) -> (..., T, S) bool: False where a query at p > 0 meets its own key at p (a SPIRe
    draft without self-attention; a query at position 0 has nothing else to read)."""
    qp, kp = q_pos[..., :, None], k_pos[..., None, :]
    return (kp != qp) | (qp == 0)


class BaseKVCache(ABC):
    """What every KV cache gives the round loop, the drafts and the serving engine: per-layer key/value tensors
    ``k[l], v[l]`` of shape (B, n_kv, S, d_head) over S entries (positions or slots), and the operations below.

    ``positional`` says how entries are addressed: True (:class:`KVCache`) entry p holds position p, and a
    forward reads through a (sink, window) view of positions; False (:class:`RingKVCache`) entries are slots
    that carry the position they hold, and a forward reads every slot under a mask built from the tags.
    """

    positional: bool
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @abstractmethod
    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              valid: torch.Tensor | None = None, span: Span | None = None) -> None:
        """Store keys/values k, v: (B, n_kv, T, d_head) of positions pos: (B, T); ``valid`` (B, T) bool: False
        entries are not written; ``span``: pos on the host (:class:`Span`), when known. Raises ConfigError for a
        position the cache cannot hold."""

    @abstractmethod
    def read(self, layer: int, upto: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, n_kv, S, d_head) of layer ``layer`` (a dense cache: positions 0..upto-1)."""

    @abstractmethod
    def key_positions(self, upto: int | None = None) -> torch.Tensor:
        """The absolute position of each entry :meth:`read` returns: (S,) or (B, S)."""

    @abstractmethod
    def claim(self, pos: torch.Tensor) -> None:
        """Make the entries of positions pos: (B, T) hold them before their keys/values are written layer by
        layer, so that a mask built now sees them."""

    @abstractmethod
    def narrow(self, n: int) -> "BaseKVCache":
        """A view of rows [0, n) (the same storage: writes through it land here); ``self`` when n is every row."""

    @abstractmethod
    def restart_rows(self, rows: torch.Tensor) -> None:
        """Forget rows ``rows`` (R,) int64 (a continuous batch gives their slots to new requests): nothing they
        held may be read by a later query of those rows."""

    def slot(self, pos: torch.Tensor) -> torch.Tensor:
        """The entry index of absolute positions (any shape): the position itself in a positional cache."""
        return pos

    def claim_mask(self, pos: torch.Tensor, view: SinkWindow | None = None, self_attend: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`claim` the entries of positions pos (B, T), then the mask of those queries over every entry:
        (entries (B, T) int64, mask (B, 1, T, S) bool) = (:meth:`slot`, :func:`attention_mask` of the entries'
        positions under ``view``; without ``self_attend`` no query reads its own key except at position 0)."""
        self.claim(pos)
        kp = self.key_positions()
        kp = kp if kp.dim() == 2 else kp[None].expand(pos.shape[0], -1)
        mask = attention_mask(pos, kp, view)
        if not self_attend:
            mask = mask & self_mask(pos, kp)[:, None]
        return self.slot(pos), mask


class KVCache(BaseKVCache):
    """Dense per-row KV cache addressed by absolute position.

    Shapes: keys and values of layer ``l`` are ``k[l], v[l]``: (B, n_kv, max_len, d_head).

    Args:
        n_layers: number of layers stored.
        batch_size: B rows.
        n_kv: key/value heads.
        max_len: positions 0 .. max_len-1 can be written (tokens).
        d_head: head dimension.
    """

    positional = True

    def __init__(self, n_layers: int, batch_size: int, n_kv: int, max_len: int, d_head: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (batch_size, n_kv, max_len, d_head)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len
        self.positions = torch.arange(max_len, device=device)  # (S,)

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              valid: torch.Tensor | None = None, span: Span | None = None) -> None:
        """Store keys/values of new tokens. pos: (B, T) absolute positions (distinct within a row); k, v: (B, n_kv,
        T, d_head). ``valid``: optional (B, T) bool, False entries are not written (the rows of other requests while
        one joins a continuous batch); without it padding entries are written (they lie past the committed length
        and are overwritten before being read). ``span``: pos on the host; the bounds check reads it instead of
        pos (off the CPU without one the device's index check stands). Raises ConfigError for a position beyond
        the cache."""
        hi = span.hi if span is not None else int(pos.max()) if pos.device.type == "cpu" else None
        if hi is not None and hi >= self.max_len:  # off the CPU without a span: the device's index check
            raise ConfigError(f"position {hi} is beyond the cache length {self.max_len}")
        B, T = pos.shape
        rows = torch.arange(B, device=pos.device)[:, None].expand(B, T)
        # advanced indexing: cache[b, :, pos[b, t], :] = k[b, :, t, :]; a row's positions are distinct, so an entry
        # not ``valid`` is written back with what it held (no selection: nothing read back)
        for store, new in ((self.k[layer], k), (self.v[layer], v)):
            new = new.transpose(1, 2).to(store.dtype)
            if valid is not None:
                new = torch.where(valid.to(pos.device)[:, :, None, None], new, store[rows, :, pos])
            store[rows, :, pos] = new

    def read(self, layer: int, upto: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, n_kv, S, d_head) for positions 0..upto-1 (all when None)."""
        if upto is None:
            return self.k[layer], self.v[layer]
        return self.k[layer][:, :, :upto], self.v[layer][:, :, :upto]

    def claim(self, pos: torch.Tensor) -> None:
        """Nothing to do: a dense cache's entry of position p is p."""

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Nothing to do: a new request writes every position of its row before any of its queries reads it."""

    def key_positions(self, upto: int | None = None) -> torch.Tensor:
        """(S,) absolute positions of the entries :meth:`read` returns."""
        return self.positions if upto is None else self.positions[:upto]

    def narrow(self, n: int) -> "KVCache":
        """A view of rows [0, n) (the same storage: writes through it land here); ``self`` when n is every row."""
        if n == self.batch_size:
            return self
        new = KVCache.__new__(KVCache)
        new.k, new.v = [t[:n] for t in self.k], [t[:n] for t in self.v]
        new.max_len, new.positions = self.max_len, self.positions
        return new

    def row(self, b: int) -> "KVCache":
        """A view of row ``b`` alone, as a batch of one (the same storage: a forward through it writes row b here;
        the serving engine prefills a prompt chunk on it)."""
        if not 0 <= b < self.batch_size:
            raise ConfigError(f"row {b} is outside the cache's {self.batch_size} rows")
        new = KVCache.__new__(KVCache)
        new.k, new.v = [t[b: b + 1] for t in self.k], [t[b: b + 1] for t in self.v]
        new.max_len, new.positions = self.max_len, self.positions
        return new

    def take_rows(self, rows: torch.Tensor) -> "KVCache":
        """A copy holding only rows ``rows`` ((R,) int64), in that order: a sub-batch to run on, written back with
        :meth:`put_rows`."""
        new = KVCache.__new__(KVCache)
        new.k, new.v = [t[rows] for t in self.k], [t[rows] for t in self.v]
        new.max_len, new.positions = self.max_len, self.positions
        return new

    def put_rows(self, rows: torch.Tensor, sub: "KVCache") -> None:
        """Write the rows of ``sub`` (from :meth:`take_rows` with the same ``rows``) back into this cache."""
        for mine, theirs in zip(self.k + self.v, sub.k + sub.v):
            mine[rows] = theirs

    def clone(self) -> "KVCache":
        """An independent copy (same shape, dtype, device, contents)."""
        new = KVCache.__new__(KVCache)
        new.k, new.v = [t.clone() for t in self.k], [t.clone() for t in self.v]
        new.max_len, new.positions = self.max_len, self.positions
        return new


EMPTY = 1 << 40  # position tag of a never-written ring slot: larger than any query position, so never visible


class RingKVCache(BaseKVCache):
    """Constant-size sink + window KV cache (StreamingLLM layout; the SPIRe draft's sparse KV cache).

    Slots: ``sink`` fixed slots for positions < sink, then a ring of ``window + slack`` slots; position p
    (>= sink) lives in slot ``sink + (p - sink) % (window + slack)``. Each slot carries the absolute position
    it holds (``tags``), and the attention mask is computed from the tags, so a slot whose content is stale
    (a rejected token, or a position the ring has moved past) is never read as something else.

    Why a slack of k + 1 makes rollback free: a round writes positions up to n + k - 1 (n = committed
    length); a write at x evicts x - (window + slack), and the next round's first query (at >= n) only
    reads positions > n - window, so any slack >= k - 1 keeps every position a later query can see (the
    hypothesis test in tests/test_kv_cache.py fails at k - 2). Entries of rejected tokens sit past the
    committed length and are overwritten before any query at or after their position runs.

    Shapes: keys/values of layer l: (B, n_kv, sink + window + slack, d_head); tags: (B, slots) int64.
    """

    positional = False

    def __init__(self, n_layers: int, batch_size: int, n_kv: int, view: SinkWindow, slack: int, d_head: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if slack < 1:
            raise ConfigError(f"ring slack must be >= 1 (use k + 1), got {slack}")
        self.view, self.ring = view, view.window + slack
        n_slots = view.sink + self.ring
        shape = (batch_size, n_kv, n_slots, d_head)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.tags = torch.full((batch_size, n_slots), EMPTY, dtype=torch.long, device=device)

    def narrow(self, n: int) -> "RingKVCache":
        """A view of rows [0, n) (the same storage and tags); ``self`` when n is every row."""
        if n == self.batch_size:
            return self
        new = RingKVCache.__new__(RingKVCache)
        new.view, new.ring = self.view, self.ring
        new.k, new.v, new.tags = [t[:n] for t in self.k], [t[:n] for t in self.v], self.tags[:n]
        return new

    def slot(self, pos: torch.Tensor) -> torch.Tensor:
        """Slot index of absolute positions (any shape)."""
        sink = self.view.sink
        return torch.where(pos < sink, pos, sink + (pos - sink) % self.ring)

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              valid: torch.Tensor | None = None, span: Span | None = None, rows: torch.Tensor | None = None) -> None:
        """Store keys/values. pos: (B, T), each row's positions contiguous; k, v: (B, n_kv, T, d_head); valid:
        optional (B, T) bool (padding is not written); ``span`` is not needed (nothing is checked); ``rows``: (B,)
        int64, the cache rows that the B rows are (None: rows 0..B-1; a prefill of a few slots of a wide batch). Of
        a row's positions only those the ring can hold (the last window + slack, and the sink) are written, so one
        call never writes two positions into the same slot. T <= the ring (a draft step, a verify's observe) writes
        every entry, an invalid one with what its slot held: nothing is selected, so nothing is read back."""
        B, T = pos.shape
        at = torch.arange(B, device=pos.device) if rows is None else rows.to(pos.device)
        if T <= self.ring:  # contiguous positions, at most a ring of them: distinct slots, every one kept
            rows = at[:, None].expand(B, T)
            slots = self.slot(pos)
            for store, new in ((self.k[layer], k), (self.v[layer], v)):
                new = new.transpose(1, 2).to(store.dtype)
                if valid is not None:
                    new = torch.where(valid[:, :, None, None], new, store[rows, :, slots])
                store[rows, :, slots] = new
            if layer == 0:
                self.tags[rows, slots] = pos if valid is None else torch.where(valid, pos, self.tags[rows, slots])
            return
        keep = torch.ones_like(pos, dtype=torch.bool) if valid is None else valid.clone()
        last = torch.where(keep, pos, torch.full_like(pos, -1)).max(1, keepdim=True).values  # (B, 1)
        keep &= (pos < self.view.sink) | (pos > last - self.ring)
        rows = at[:, None].expand(B, T)[keep]
        slots = self.slot(pos)[keep]
        self.k[layer][rows, :, slots] = k.transpose(1, 2)[keep].to(self.k[layer].dtype)
        self.v[layer][rows, :, slots] = v.transpose(1, 2)[keep].to(self.v[layer].dtype)
        if layer == 0:  # every layer writes the same positions in one forward; layer 0 writes first
            self.tags[rows, slots] = pos[keep]

    def claim(self, pos: torch.Tensor) -> None:
        """Tag the slots of positions pos: (B, T) (<= window + slack per row) before their keys/values are
        written layer by layer, so that a mask built now already sees them."""
        rows = torch.arange(pos.shape[0], device=pos.device)[:, None].expand_as(pos)
        self.tags[rows, self.slot(pos)] = pos

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Tag the rows' slots empty: never visible again."""
        self.tags[rows.to(self.tags.device)] = EMPTY

    def claim_mask(self, pos: torch.Tensor, view: SinkWindow | None = None, self_attend: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`BaseKVCache.claim_mask` under the ring's own view (``view``, when given, must be it): one native
        call on the CPU (spire.kernels.ring_claim_mask), else the torch ops."""
        if view is not None and view != self.view:
            raise ConfigError(f"a ring cache of {self.view} masks under its own view, not {view}")
        if pos.device.type == "cpu" and kernels.available():
            done = kernels.ring_claim_mask(self.tags, pos.to(torch.int64), self.view.sink, self.ring,
                                           self.view.window, self_attend)
            if done is not None:
                return done
        return super().claim_mask(pos, self.view, self_attend)

    def read(self, layer: int, upto: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """All slots of a layer: (B, n_kv, slots, d_head) each (``upto`` is ignored)."""
        return self.k[layer], self.v[layer]

    def key_positions(self, upto: int | None = None) -> torch.Tensor:
        """(B, slots) absolute position held by each slot (EMPTY when never written)."""
        return self.tags
