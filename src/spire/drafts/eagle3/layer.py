"""EAGLE-3's one decoder layer and its attention rule, one job: :class:`Eagle3Layer` (speculators'
``LlamaDecoderEagle3FirstLayer``: q/k/v over cat(embedding, feature), the feature as its residual stream) and
:func:`eagle3_mask` (causal, the key of position 0 read by position 0 only), shared by training
(:mod:`spire.drafts.eagle3.model`) and inference (:mod:`spire.drafts.eagle3.draft`)."""

from __future__ import annotations

import torch
import torch.nn as nn

from spire.kv_cache import SinkWindow, attention_mask
from spire.model import MLP, Attention, ModelConfig, RMSNorm


class Eagle3Layer(nn.Module):
    """speculators' ``LlamaDecoderEagle3FirstLayer`` (``Qwen3DecoderEagle3FirstLayer`` with q/k norms): a decoder
    layer whose q/k/v projections read 2d inputs, cat(input_layernorm(embedding), hidden_norm(feature)), and whose
    residual stream is the feature. Parameter names are speculators' (``layers.0.<name>``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, H, KV, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        self.input_layernorm = RMSNorm(d, cfg.rms_eps)
        self.hidden_norm = RMSNorm(d, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.self_attn.q_proj = nn.Linear(2 * d, H * D, bias=cfg.qkv_bias)
        self.self_attn.k_proj = nn.Linear(2 * d, KV * D, bias=cfg.qkv_bias)
        self.self_attn.v_proj = nn.Linear(2 * d, KV * D, bias=cfg.qkv_bias)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def inputs(self, emb: torch.Tensor, feature: torch.Tensor, norm_before_residual: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """emb, feature: (B, T, d) token embeddings and previous-position features -> the attention input u
        (B, T, 2d) and the residual stream (B, T, d)."""
        e = self.input_layernorm(emb)
        h = self.hidden_norm(feature)
        u = torch.cat([e, h.to(e.dtype)], -1)
        return u, (h if norm_before_residual else feature)

    def forward(self, u: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_source,
                mask: torch.Tensor) -> torch.Tensor:
        """u: (B, T, 2d), residual: (B, T, d) -> the layer output z (B, T, d). cos, sin: (B|1, 1, T, D);
        kv_source: gets the T new keys/values (B, KV, T, D) and returns everything they attend over (B, KV, S, D);
        mask: (B|1, 1, T, S) bool."""
        x = residual + self.self_attn(u, cos, sin, kv_source, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def kv(self, u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values (B, KV, T, D) of attention inputs u (B, T, 2d)."""
        return self.self_attn.project_kv(u, cos, sin)


def eagle3_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, view: SinkWindow | None) -> torch.Tensor:
    """The draft's attention rule: q_pos (B|1, T), k_pos (S,) or (B, S) -> (B|1, 1, T, S) bool: causal (under the
    view), and the key of position 0 (which has no previous-position feature, so speculators and vLLM hold no key
    for it) read only by the query at position 0."""
    mask = attention_mask(q_pos, k_pos, view)
    kp = k_pos[None, None, None, :] if k_pos.dim() == 1 else k_pos[:, None, None, :]
    return mask & ((kp > 0) | (q_pos[:, None, :, None] == 0))
