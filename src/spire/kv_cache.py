"""KV caches and the attention masks that read them.

A :class:`KVCache` stores keys and values for every layer at their *absolute* text position, one row per
sequence (like gpt-fast's static cache). Each row has its own length, so speculative rounds that accept
different numbers of tokens per row need no copying: rolling a row back is moving its length pointer,
and stale entries past the pointer are never read because (1) every query attends only to keys at
positions <= its own and (2) a round writes a position before any query at or after it reads it.

The same storage serves a dense (full-history) view and a StreamingLLM view (Xiao et al. 2023,
"Efficient Streaming Language Models with Attention Sinks"): the view is a mask, see :func:`attention_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SinkWindow:
    """A StreamingLLM view: a query at position p sees the first ``sink`` positions and the last ``window``
    positions up to and including p, i.e. keys j with ``j < sink`` or ``p - window < j <= p``.

    SPIRe and MagicDec use sink 1, window 64 (SPIRe paper §3; MagicDec, Chen et al. 2024).
    """

    sink: int = 1
    window: int = 64

    def __post_init__(self) -> None:
        if self.sink < 0 or self.window < 1:
            from spire.errors import ConfigError

            raise ConfigError(f"sink must be >= 0 and window >= 1, got sink={self.sink}, window={self.window}")

    @property
    def size(self) -> int:
        """Number of cache entries one query reads at most (tokens)."""
        return self.sink + self.window


def attention_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    view: SinkWindow | None = None,
    k_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean attention mask, True where the query may attend.

    Args:
        q_pos: (B, T) absolute positions of the queries.
        k_pos: (S,) or (B, S) absolute positions of the keys.
        view: None for full causal attention, or a :class:`SinkWindow`.
        k_start: optional (B,) first valid key position per row (keys before it are padding).

    Returns:
        (B, 1, T, S) bool mask (broadcasts over heads).
    """
    qp = q_pos[:, :, None]  # (B, T, 1)
    kp = k_pos[None, None, :] if k_pos.dim() == 1 else k_pos[:, None, :]  # (B|1, 1, S)
    mask = kp <= qp
    if view is not None:
        mask = mask & ((kp < view.sink) | (kp > qp - view.window))
    if k_start is not None:
        mask = mask & (kp >= k_start[:, None, None])
    return mask[:, None]


class KVCache:
    """Dense per-row KV cache addressed by absolute position.

    Shapes: keys and values of layer ``l`` are ``k[l], v[l]``: (B, n_kv, max_len, d_head).

    Args:
        n_layers: number of layers stored.
        batch_size: B rows.
        n_kv: key/value heads.
        max_len: positions 0 .. max_len-1 can be written (tokens).
        d_head: head dimension.
    """

    def __init__(self, n_layers: int, batch_size: int, n_kv: int, max_len: int, d_head: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (batch_size, n_kv, max_len, d_head)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len
        self.positions = torch.arange(max_len, device=device)  # (S,)

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values of new tokens. pos: (B, T) absolute positions; k, v: (B, n_kv, T, d_head)."""
        if int(pos.max()) >= self.max_len:
            from spire.errors import ConfigError

            raise ConfigError(f"position {int(pos.max())} is beyond the cache length {self.max_len}")
        B, T = pos.shape
        rows = torch.arange(B, device=pos.device)[:, None].expand(B, T)
        # advanced indexing: cache[b, :, pos[b, t], :] = k[b, :, t, :]
        self.k[layer][rows, :, pos] = k.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][rows, :, pos] = v.transpose(1, 2).to(self.v[layer].dtype)

    def read(self, layer: int, upto: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, n_kv, S, d_head) for positions 0..upto-1 (all when None)."""
        if upto is None:
            return self.k[layer], self.v[layer]
        return self.k[layer][:, :, :upto], self.v[layer][:, :, :upto]
