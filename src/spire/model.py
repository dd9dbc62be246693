"""spire's own Llama-family transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings.

References: Touvron et al. 2023 (Llama), Su et al. 2021 (RoPE), Ainslie et al. 2023 (GQA), Shazeer 2020
(SwiGLU); the layout follows gpt-fast's model.py. Parameter names follow Hugging Face's ``LlamaForCausalLM``
so that any HF Llama-family safetensors checkpoint loads without renaming (see :mod:`spire.loading`). Logits
match HF transformers to 1e-4 in float32 (tests/test_model.py).

Families (:data:`FAMILIES`, each checked against HF in tests/test_families.py): Llama 2/3.x, Mistral, Qwen2/2.5,
Qwen3, Phi-3, SmolLM3, Gemma 3 text. What a family changes is a :class:`ModelConfig` field read by a small
piece (``Attention.q_norm``, ``Block.sandwich``, ``ScaledEmbedding``, :func:`spire.rope.rope_inv_freq`,
``Transformer._layer_masks``); reading a config.json and refusing, by name, a feature spire lacks is
:mod:`spire.families`' job.

RoPE (the tables each block reads, the scaled variants) is :mod:`spire.rope`.

Shapes: B batch, T new tokens, S key positions, H query heads, KV key/value heads, D head dim, V vocab.

The classes below hold the reference arithmetic (what autograd sees in training). Inference takes
:mod:`spire.fastpath` (same arithmetic; fused weight copies, native CPU kernels, weight-only bf16) through
each block's attention and MLP, and through :func:`spire.fastpath.decode_step`, which runs every block of a
short forward over a cache as one native call. Logits are lazy (:class:`ForwardOutput`): a prefill whose
logits nobody reads skips the unembedding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from spire import fastpath
from spire.backend import of as backend_of
from spire.errors import ConfigError
from spire.families import ACTIVATION_NAMES, FAMILIES, hf_fields  # noqa: F401 (FAMILIES: part of this API)
from spire.fastpath import KVSource, needs_autograd
from spire.kv_cache import KVCache, SinkWindow, Span, attention_mask, causal_mask, prefix_mask
from spire.rope import apply_rope, rope_tables


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder (read from an HF ``config.json`` by :meth:`from_hf`).

    The fields after ``eos_ids`` describe how a family departs from Llama (their defaults are Llama's):
    biases on the q/k/v, o and MLP projections (Qwen2: q/k/v; Llama ``attention_bias``: q/k/v/o), RMSNorm
    over each query and key head before RoPE (``qk_norm``: Qwen3, Gemma 3), norms after attention and MLP as
    well as before (``sandwich_norm``: Gemma 3), norm weights stored as an offset from 1 (``norm_offset`` 1:
    Gemma), a scaled embedding (``embed_scale``: Gemma's sqrt(d_model)), the MLP activation (``act``), the
    attention scale (``attn_scale``, default d_head^-1/2; Gemma 3: query_pre_attn_scalar^-1/2), and per layer
    the RoPE variant (``layer_ropes``: Llama 3.x / linear / YaRN scaling, Gemma 3's local and global bases,
    SmolLM3's layers without RoPE) and the sliding window (``layer_windows``: Mistral, Phi-3, Gemma 3's local
    layers). None means every layer is the same (default RoPE with ``rope_theta``; full attention).
    """

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
    family: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sandwich_norm: bool = False
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    act: str = "silu"
    attn_scale: float | None = None
    layer_ropes: list[dict] | None = None
    layer_windows: list[int | None] | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from an HF config.json dict (best: as transformers normalizes it, ``AutoConfig.to_dict()``,
        which :func:`spire.loading.load_target` passes; :func:`spire.families.hf_fields` reads it). Raises
        CheckpointError for an unsupported architecture or a configuration feature spire does not implement,
        naming it."""
        return cls(**hf_fields(cfg))

    def to_dict(self) -> dict:
        return asdict(self)

    def rope_of(self, layer: int) -> dict:
        """The RoPE spec of ``layer`` (see :func:`spire.rope.rope_inv_freq`)."""
        if self.layer_ropes is None:
            return {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        return self.layer_ropes[layer]

    def without_layers(self, n_layers: int) -> "ModelConfig":
        """The same architecture with ``n_layers`` layers (a shallower model, e.g. a vanilla draft): per-layer
        RoPE and windows follow the source's pattern from its first layer on (repeated when deeper)."""
        def cut(xs: list | None) -> list | None:
            return None if xs is None else [xs[i % len(xs)] for i in range(n_layers)]

        return replace(self, n_layers=n_layers, layer_ropes=cut(self.layer_ropes),
                       layer_windows=cut(self.layer_windows))

    @property
    def plain_blocks(self) -> bool:
        """Whether every block is a plain Llama block (what :class:`spire.kernels.DecodeBlock` computes): no
        biases, no q/k norms, pre-norms only with weights used as stored, SiLU, the default attention scale."""
        return not (self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm or self.sandwich_norm
                    or self.norm_offset or self.act != "silu" or self.attn_scale is not None)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (weight + offset), computed in float32 (as HF Llama does; Gemma stores
    its norm weights as an offset from 1: ``offset`` 1)."""

    def __init__(self, d: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps
        self.offset = float(offset)

    def scale(self) -> torch.Tensor:
        """The (d,) factor applied after normalizing: weight + offset."""
        return self.weight + self.offset if self.offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.scale()
        y = fastpath.rms_norm(x, w, self.eps, self.weight, backend_of(self))
        if y is not None:
            return y
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * x.to(dtype)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}
"""HF ``hidden_act`` names -> the gated MLP's activation: SwiGLU (Llama, Qwen, Mistral, Phi-3, SmolLM3) and
GeGLU with the tanh approximation (Gemma 3)."""
assert set(ACTIVATIONS) == set(ACTIVATION_NAMES)


class ScaledEmbedding(nn.Embedding):
    """Token embedding times ``scale`` (Gemma multiplies by sqrt(d_model); 1 elsewhere). (B, T) -> (B, T, d)."""

    def __init__(self, vocab_size: int, d_model: int, scale: float = 1.0) -> None:
        super().__init__(vocab_size, d_model)
        self.scale = float(scale)
        self.rounded = {dt: float(torch.tensor(self.scale, dtype=torch.float32, device="cpu").to(dt))  # in each dtype
                        for dt in (torch.float32, torch.bfloat16, torch.float16)}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = super().forward(tokens)
        if self.scale != 1.0:  # as HF: the scale rounded to the weights' dtype, then one multiply
            x = x * self.rounded.get(x.dtype, self.scale)  # a Python float: no tensor made on the CPU
        return x


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
                      ) -> torch.Tensor:
    """Masked attention with the H / KV query heads of each KV head folded into its query rows: two batched
    matmuls (B·KV of them) and a float32 softmax, no copy of the keys per query head. q: (B, H, T, D); k, v:
    (B, KV, S, D), same dtype; mask: (B|1, 1, T, S) bool (True: attend) -> (B, H, T, D). Same result as
    ``F.scaled_dot_product_attention(..., enable_gqa=True)`` up to rounding, a fully masked row included (0, and
    no gradient through it, as SDPA gives)."""
    B, H, T, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    s = torch.matmul(q.reshape(B, KV, (H // KV) * T, D), k.transpose(-1, -2)).view(B, KV, H // KV, T, S)
    masked = ~mask[:, :, None]
    s = s.float().mul_(scale).masked_fill_(masked, float("-inf"))
    p = torch.softmax(s, -1).masked_fill(masked, 0.0)  # a row with no key: NaN -> 0 (its gradient is cut above)
    p = p.to(q.dtype).view(B, KV, (H // KV) * T, S)
    return torch.matmul(p, v).view(B, H, T, D)


class Attention(nn.Module):
    """Grouped-query attention with RoPE: H query heads share KV key/value heads (head h reads KV head
    h // (H / KV)). Family options (:class:`ModelConfig`): q/k/v and o biases, per-head q/k RMSNorm before RoPE,
    the attention scale."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.d_head = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.d_head, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.d_head, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.d_head, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.d_head, cfg.d_model, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each query / key head (D), before RoPE
            self.q_norm = RMSNorm(cfg.d_head, cfg.rms_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.d_head, cfg.rms_eps, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.d_head ** -0.5 if cfg.attn_scale is None else float(cfg.attn_scale)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_source: KVSource,
                mask: torch.Tensor | None) -> torch.Tensor:
        """h: (B, T, d_model) normed input -> (B, T, d_model); the new keys/values go through ``kv_source``;
        mask: (B|1, 1, T, S) bool, or None when no key is masked."""
        if not needs_autograd((self.q_proj, self.k_proj, self.v_proj, self.o_proj), h):
            return fastpath.attention(self, h, cos, sin, kv_source, mask)
        q = self.project_q(h, cos, sin)
        k, v = kv_source(*self.project_kv(h, cos, sin))
        if mask is None:
            mask = torch.ones(1, 1, q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        return self.attend(q, k, v, mask)

    def _heads(self, y: torch.Tensor, n: int, norm: RMSNorm | None = None) -> torch.Tensor:
        B, T, _ = y.shape
        y = y.view(B, T, n, self.d_head)
        if norm is not None:
            y = norm(y)
        return y.transpose(1, 2)  # (B, n, T, D)

    def project_q(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h: (B, T, d_model) normed input -> rotated queries (B, H, T, D)."""
        return apply_rope(self._heads(self.q_proj(h), self.n_heads, self.q_norm if self.qk_norm else None), cos, sin)

    def project_kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: (B, T, d_model) normed input -> rotated keys, values (B, KV, T, D)."""
        if needs_autograd((self.k_proj, self.v_proj), h):
            k, v = self.k_proj(h), self.v_proj(h)
        else:  # inference (SPIRe's memory keys/values): one fused matmul on the fast path
            k, v = fastpath.linear(h, (self.k_proj, self.v_proj), self, "kv").split(self.n_kv * self.d_head, -1)
        k = self._heads(k, self.n_kv, self.k_norm if self.qk_norm else None)
        return apply_rope(k, cos, sin), self._heads(v, self.n_kv)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q: (B, H, T, D); k, v: (B, KV, S, D); mask: (B|1, 1, T, S) bool -> (B, T, d_model) (a query that sees
        no key reads 0)."""
        k, v = k.to(q.dtype), v.to(q.dtype)
        # training on the CPU: grouped attention (Backend.grouped_attention) instead of SDPA, whose flash backward
        # took ~14 ms a call inside the SPIRe k-pass step, ~0.2 s of a ~1.8 s step on one core
        if (backend_of(self).grouped_attention and q.device.type == "cpu" and torch.is_grad_enabled()
                and q.requires_grad):
            y = grouped_attention(q, k, v, mask, self.scale)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv,
                                               scale=self.scale)
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.d_head))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act SiLU (SwiGLU, Shazeer 2020) or tanh-GELU (GeGLU, Gemma)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)
        self.act_name = cfg.act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = ACTIVATIONS[self.act_name]
        if not needs_autograd((self.gate_proj, self.up_proj, self.down_proj), x):
            return fastpath.mlp(self, x, act)
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)). With ``sandwich_norm`` (Gemma 3) the
    attention and MLP outputs are normed too: x + norm(attn(norm(x))), then x + norm(mlp(norm(x))); the norm
    before the MLP is then ``pre_feedforward_layernorm`` and ``post_attention_layernorm`` norms the attention
    output (HF's names). ``rope_id`` picks this block's RoPE tables (:func:`spire.rope.rope_tables`)."""

    def __init__(self, cfg: ModelConfig, rope_id: int = 0) -> None:
        super().__init__()
        off = cfg.norm_offset
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_eps, off)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_eps, off)
        self.sandwich = cfg.sandwich_norm
        if cfg.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(cfg.d_model, cfg.rms_eps, off)
            self.post_feedforward_layernorm = RMSNorm(cfg.d_model, cfg.rms_eps, off)
        self.mlp = MLP(cfg)
        self.rope_id = rope_id

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_source: KVSource,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x: (B, T, d_model) residual stream entering the block -> leaving it. cos, sin: (R, B, 1, T, D) RoPE
        tables (:func:`spire.rope.rope_tables`), or this block's own (B, 1, T, D) ones. kv_source: what the attention
        reads (:data:`spire.fastpath.KVSource`). mask: (B|1, 1, T, S) bool, or None when no key is masked."""
        a = self.self_attn(self.input_layernorm(x), *self._tables(cos, sin), kv_source, mask)
        if self.sandwich:
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))

    def memory_kv(self, m: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values (B, KV, T, D) this block derives from residual-stream vectors m: (B, T, d_model);
        cos, sin as for :meth:`forward`."""
        return self.self_attn.project_kv(self.input_layernorm(m), *self._tables(cos, sin))

    def _tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This block's (B, 1, T, D) RoPE tables out of a model's stacked (R, B, 1, T, D) ones."""
        return (cos[self.rope_id], sin[self.rope_id]) if cos.dim() == 5 else (cos, sin)


class ForwardOutput:
    """logits: (B, T, V) float32; hidden: target layer index -> (B, T, d_model) residual stream entering it.

    ``ForwardOutput(logits, hidden)`` holds given logits. :meth:`Transformer.forward` instead passes
    ``compute_logits`` and the logits are computed on first access of ``.logits`` (then kept), so a forward
    whose logits nobody reads (a prefill) skips the unembedding (V·d_model multiply-adds per position).
    """

    __slots__ = ("_logits", "_compute", "hidden")

    def __init__(self, logits: torch.Tensor | None = None, hidden: dict[int, torch.Tensor] | None = None,
                 compute_logits: Callable[[], torch.Tensor] | None = None) -> None:
        if logits is None and compute_logits is None:
            raise ValueError("ForwardOutput needs logits or compute_logits")
        self._logits, self._compute = logits, compute_logits
        self.hidden = {} if hidden is None else hidden

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits, self._compute = self._compute(), None
        return self._logits

    @logits.setter
    def logits(self, value: torch.Tensor) -> None:
        self._logits, self._compute = value, None

    def __repr__(self) -> str:
        state = tuple(self._logits.shape) if self._logits is not None else "lazy"
        return f"ForwardOutput(logits={state}, hidden={sorted(self.hidden)})"


class Transformer(nn.Module):
    """A Llama-family causal LM with an optional KV cache.

    ``forward(tokens, pos, cache, view, hidden_layers)``:
        tokens, pos: (B, T) token ids and absolute positions (positions start at 0 per row).
        cache: a :class:`KVCache` to write the new keys/values into and read the past from; None attends
            among the T tokens only (training, reference computations).
        view: None (full history) or a :class:`SinkWindow` (StreamingLLM view, used by MagicDec). A
            sliding-window layer (:attr:`ModelConfig.layer_windows`) reads the intersection of the view and its
            window.
        hidden_layers: layer indices whose *input* residual stream to return (SPIRe's memory source);
            index n_layers is the final residual stream (before the final norm).
    Each layer reads its own RoPE tables (:attr:`ropes`, ``Block.rope_id``).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.d_model, cfg.embed_scale)
        specs = [cfg.rope_of(i) for i in range(cfg.n_layers)]
        self.ropes: list[dict] = []  # the distinct RoPE specs of the layers; Block.rope_id indexes it
        for spec in specs:
            if spec not in self.ropes:
                self.ropes.append(spec)
        self.model.layers = nn.ModuleList(Block(cfg, self.ropes.index(spec)) for spec in specs)
        self.model.norm = RMSNorm(cfg.d_model, cfg.rms_eps, cfg.norm_offset)
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

    def rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables of every distinct RoPE of the layers: pos (B, T) -> cos, sin (R, B, 1, T, D)."""
        return rope_tables(pos, self.ropes, self.cfg.d_head, dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + unembedding: (B, T, d_model) -> float32 logits (B, T, V)."""
        return self.unembed(self.model.norm(x))

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """Normed (B, T, d_model) -> float32 logits (B, T, V) through lm_head (a SPIRe draft shares it)."""
        return fastpath.unembed(h, self.lm_head, self)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None,
                view: SinkWindow | None = None, hidden_layers: Iterable[int] = (), span: Span | None = None
                ) -> ForwardOutput:
        """See the class docstring. ``span``: the host's copy of pos (:class:`spire.kv_cache.Span`: each row's
        first position and T), when the caller knows it (a scheduler does): the cache access is then planned from
        it and nothing is read back from the device (:class:`spire.fastpath.CacheAccess`). Raises ConfigError
        when a position is outside the cache. Logits are computed lazily (:class:`ForwardOutput`)."""
        want = set(hidden_layers)
        x = self.model.embed_tokens(tokens)  # (B, T, d_model)
        cos, sin = self.rope(pos, x.dtype)

        def plan():  # per op: each layer's mask and cache reads, planned once
            windows = self.cfg.layer_windows or [None] * len(self.layers)
            if cache is None:  # keys are the T tokens themselves
                if span is not None:  # from 0 in every row: the shared causal mask (decided on the host)
                    causal = view is None and pos.shape[1] > 1 and span.hi == pos.shape[1] - 1
                    mask = causal_mask(pos.shape[1], pos.device) if causal else attention_mask(pos, pos, view)
                elif pos.device.type != "cpu":
                    mask = attention_mask(pos, pos, view)
                else:
                    mask = prefix_mask(pos, pos, view)
                return [lambda k, v: (k, v)] * len(self.layers), self._layer_masks(mask, pos, windows), None
            masks, sources = fastpath.CacheAccess(cache, pos, view, span).plan(windows)
            return sources, masks, None

        step = fastpath.decode_step(self, self.layers, self.cfg, x, pos, cos, sin, cache, plan, view=view, span=span)
        hidden: dict[int, torch.Tensor] = {}
        for i in range(len(self.layers)):
            if i in want:
                hidden[i] = x
            x = step.block(i, x)
        if len(self.layers) in want:  # the final residual stream, before the final norm
            hidden[len(self.layers)] = x
        grad = torch.is_grad_enabled()  # the lazy logits see the autograd mode of this call

        def compute_logits(x: torch.Tensor = x) -> torch.Tensor:
            with torch.set_grad_enabled(grad):
                return self.logits(x)

        return ForwardOutput(hidden=hidden, compute_logits=compute_logits)

    @staticmethod
    def _layer_masks(mask: torch.Tensor, pos: torch.Tensor, windows: Sequence[int | None]) -> list[torch.Tensor]:
        """Each layer's mask over the T tokens themselves (no cache): ``mask`` (B|1, 1, T, T), narrowed for a
        sliding-window layer (window W: keys j > p - W for a query at p, HF's sliding_window)."""
        narrowed = {w: mask & (pos[:, None, None, :] > pos[:, None, :, None] - w) for w in set(windows) - {None}}
        return [mask if w is None else narrowed[w] for w in windows]

    def num_body_params(self) -> int:
        """Parameters of the transformer blocks (no embedding/unembedding), the paper's N convention."""
        return sum(p.numel() for p in self.layers.parameters())
