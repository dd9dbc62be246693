"""spire's own Llama-family transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings.

References: Touvron et al. 2023 (Llama), Su et al. 2021 (RoPE), Ainslie et al. 2023 (GQA), Shazeer 2020
(SwiGLU). Parameter names follow Hugging Face's ``LlamaForCausalLM`` so that any HF Llama-family
safetensors checkpoint loads without renaming (see :mod:`spire.loading`). Logits match HF transformers
to 1e-4 in float32 (tests/test_model.py).

Shapes: B batch, T new tokens, S key positions, H query heads, KV key/value heads, D head dim, V vocab.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from spire.errors import CheckpointError, ConfigError
from spire.kv_cache import KVCache, SinkWindow, attention_mask


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder (read from an HF ``config.json``)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_ff: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_positions: int = 2048
    tie_embeddings: bool = True
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from an HF config.json dict. Raises CheckpointError for unsupported architectures."""
        if cfg.get("model_type") not in (None, "llama", "mistral", "qwen2", "smollm3"):
            raise CheckpointError(f"unsupported model_type {cfg.get('model_type')!r}: spire reads Llama-family checkpoints")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise CheckpointError(f"unsupported RoPE scaling {rope_type!r}")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        try:
            n_heads = cfg["num_attention_heads"]
            d_model = cfg["hidden_size"]
            eos = cfg.get("eos_token_id")
            return cls(
                vocab_size=cfg["vocab_size"], d_model=d_model, n_layers=cfg["num_hidden_layers"],
                n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads", n_heads),
                d_head=cfg.get("head_dim") or d_model // n_heads, d_ff=cfg["intermediate_size"],
                rope_theta=float(theta), rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                max_positions=cfg.get("max_position_embeddings", 2048),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), bos_id=cfg.get("bos_token_id"),
                eos_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json lacks the key {e.args[0]!r}") from None

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 (as HF Llama does)."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(pos: torch.Tensor, d_head: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for absolute positions. pos: (B, T) -> cos, sin: (B, 1, T, D) (half-split layout, as HF)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d_head, 2, device=pos.device, dtype=torch.float32) / d_head))
    freqs = pos.float()[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, D) rotated by position."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.d_head = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.d_head, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.d_head, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.d_head, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.d_head, cfg.d_model, bias=False)

    def _heads(self, y: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = y.shape
        return y.view(B, T, n, self.d_head).transpose(1, 2)  # (B, n, T, D)

    def project_q(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h: (B, T, d_model) normed input -> rotated queries (B, H, T, D)."""
        return apply_rope(self._heads(self.q_proj(h), self.n_heads), cos, sin)

    def project_kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: (B, T, d_model) normed input -> rotated keys, values (B, KV, T, D)."""
        k = apply_rope(self._heads(self.k_proj(h), self.n_kv), cos, sin)
        return k, self._heads(self.v_proj(h), self.n_kv)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q: (B, H, T, D); k, v: (B, KV, S, D); mask: (B|1, 1, T, S) bool -> (B, T, d_model)."""
        y = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           enable_gqa=self.n_heads != self.n_kv)
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.d_head))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# A KV source: given this block's new keys/values (B, KV, T, D), return the keys/values to attend over
# (B, KV, S, D). The dense cache writes then reads; the SPIRe draft prepends its memory.
KVSource = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_source: KVSource,
                mask: torch.Tensor) -> torch.Tensor:
        """x: (B, T, d_model) residual stream entering the block -> leaving it."""
        h = self.input_layernorm(x)
        q = self.self_attn.project_q(h, cos, sin)
        k, v = kv_source(*self.self_attn.project_kv(h, cos, sin))
        x = x + self.self_attn.attend(q, k, v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def memory_kv(self, m: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values (B, KV, T, D) this block derives from residual-stream vectors m: (B, T, d_model)."""
        return self.self_attn.project_kv(self.input_layernorm(m), cos, sin)


@dataclass
class ForwardOutput:
    """logits: (B, T, V) float32; hidden: target layer index -> (B, T, d_model) residual stream entering it."""

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor]


class Transformer(nn.Module):
    """A Llama-family causal LM with an optional KV cache.

    ``forward(tokens, pos, cache, view, hidden_layers)``:
        tokens, pos: (B, T) token ids and absolute positions (positions start at 0 per row).
        cache: a :class:`KVCache` to write the new keys/values into and read the past from; None attends
            among the T tokens only (training, reference computations).
        view: None (full history) or a :class:`SinkWindow` (StreamingLLM view, used by MagicDec).
        hidden_layers: layer indices whose *input* residual stream to return (SPIRe's memory source).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.model.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.model.norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty dense cache for every layer. Raises ConfigError past the model's positions."""
        if max_len > self.cfg.max_positions:
            raise ConfigError(f"context of {max_len} tokens exceeds the target's {self.cfg.max_positions} positions")
        return KVCache(self.cfg.n_layers, batch_size, self.cfg.n_kv_heads, max_len, self.cfg.d_head,
                       dtype=self.dtype, device=self.device)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + unembedding: (B, T, d_model) -> float32 logits (B, T, V)."""
        return self.lm_head(self.model.norm(x)).float()

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None,
                view: SinkWindow | None = None, hidden_layers: Iterable[int] = (),
                k_start: torch.Tensor | None = None) -> ForwardOutput:
        want = set(hidden_layers)
        x = self.model.embed_tokens(tokens)  # (B, T, d_model)
        cos, sin = rope_cos_sin(pos, self.cfg.d_head, self.cfg.rope_theta, x.dtype)
        if cache is None:
            mask = attention_mask(pos, pos, view, k_start)  # keys are the T tokens themselves
        else:
            upto = int(pos.max()) + 1  # keys past the newest query are masked anyway: don't read them
            mask = attention_mask(pos, cache.positions[:upto], view, k_start)
        hidden: dict[int, torch.Tensor] = {}
        for i, block in enumerate(self.layers):
            if i in want:
                hidden[i] = x
            x = block(x, cos, sin, self._kv_source(cache, i, pos), mask)
        return ForwardOutput(self.logits(x), hidden)

    @staticmethod
    def _kv_source(cache: KVCache | None, layer: int, pos: torch.Tensor) -> KVSource:
        if cache is None:
            return lambda k, v: (k, v)

        def write_then_read(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            cache.write(layer, pos, k, v)
            return cache.read(layer, int(pos.max()) + 1)

        return write_then_read

    def num_body_params(self) -> int:
        """Parameters of the transformer blocks (no embedding/unembedding), the paper's N convention."""
        return sum(p.numel() for p in self.layers.parameters())
