"""SPIRe as a vLLM drafter: the draft model class vLLM's EAGLE-3 path runs (issue 41, item 3).

Imported only inside vLLM's processes (registered by :func:`spire.integrations.vllm_plugin.register`, the
``vllm.general_plugins`` entry point); it needs vLLM (``make vllm``). vLLM 0.32's EAGLE-3 proposer
(``vllm/v1/spec_decode/llm_base_proposer.py``) drives the draft as follows, and SPIRe maps onto it exactly in the
variant vLLM can express (docs/serving.md, "SPIRe in vLLM"):

- first pass, over the tokens the target just verified: slot ``i`` gets token ``x[i + 1]`` (the ids shifted by
  one) and the target's hidden states at position ``i`` from the layers named by
  ``eagle_aux_hidden_state_layer_ids``, id ``j`` being the residual stream entering target layer ``j`` (spire's
  ``hidden[j]``), concatenated in ascending order. Here those ids are the draft's source layers, so slot ``i``
  carries SPIRe's memory of verified position ``i`` for every draft layer (n_d × d wide);
- drafting loop: slot ``i + 1`` gets the drafted token and, as hidden states, what the previous call returned
  second: here the feedback memory of position ``i + 1`` (:meth:`SpireDraftForVllm.forward`).

So in every call slot ``i`` is the query of SPIRe position ``i + 1`` (its token's embedding through the draft's
layers, RoPE at ``i + 1``) and the key/value of memory position ``i`` (each layer's input norm and k/v projections
of that layer's memory vector, RoPE at ``i``), written once to vLLM's cache. A query reads memory slots up to its
own, i.e. positions before its own: SPIRe without self-attention (``self_attend=False``), and without an attention
sink, since vLLM's sliding window has none: spire's window of W positions is vLLM's window of W - 1 slots (vLLM's
CPU kernel: a query at slot p sees slots p - W' + 1 .. p). These two switches are the variant a SPIRe export for
vLLM runs (:mod:`spire.integrations.vllm_export` rewrites a draft trained otherwise to it, with a note).

Start-up refusals (one ValueError line each; vLLM stops): a plugin format this module does not know, a target
whose shape differs from the one the export was made for, and a target whose first 64 embedding rows differ from
the export's (read from the target's safetensors files when the draft loads; for a target that is not a local
folder, at the first forward, once vLLM has shared the target's embedding into the draft).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

from spire.integrations.vllm_checks import check_format, check_target_rows, check_target_shape, target_rows
from spire.integrations.vllm_plugin import PLUGIN_FORMAT, PROBE_ROWS


class _RMSNorm(nn.Module):
    """HF Llama's RMSNorm (float32 statistics, the weight applied in the input's dtype)."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rope(x: torch.Tensor, pos: torch.Tensor, heads: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: (T, heads * D) rotated by positions pos: (T,) (Llama's rotate-half RoPE, tables in float32)."""
    T = x.shape[0]
    freqs = pos.float()[:, None] * inv_freq[None]  # (T, D / 2)
    emb = torch.cat([freqs, freqs], -1)[:, None]  # (T, 1, D)
    cos, sin = emb.cos(), emb.sin()
    h = x.view(T, heads, -1).float()
    h1, h2 = h.chunk(2, -1)
    return (h * cos + torch.cat([-h2, h1], -1) * sin).to(x.dtype).reshape(T, -1)


class _SpireLayer(nn.Module):
    """One SPIRe draft layer (a plain Llama block): the query of its own residual stream, keys and values of the
    memory vectors vLLM hands over, attention through vLLM's paged cache and sliding window."""

    def __init__(self, c: dict, window: int | None, cache_config, prefix: str) -> None:
        super().__init__()
        d, H, KV, D, ff = c["d_model"], c["n_heads"], c["n_kv_heads"], c["d_head"], c["d_ff"]
        self.H, self.KV = H, KV
        self.input_layernorm = _RMSNorm(d, c["rms_eps"])
        self.post_attention_layernorm = _RMSNorm(d, c["rms_eps"])
        self.q_proj, self.o_proj = nn.Linear(d, H * D, bias=False), nn.Linear(H * D, d, bias=False)
        self.k_proj, self.v_proj = nn.Linear(d, KV * D, bias=False), nn.Linear(d, KV * D, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)
        # spire's window W over positions before the query = W - 1 slots up to the query's own (memory) slot
        self.attn = Attention(H, D, D ** -0.5, num_kv_heads=KV, cache_config=cache_config,
                              per_layer_sliding_window=None if window is None else window - 1,
                              prefix=f"{prefix}.attn")

    def forward(self, x: torch.Tensor, m: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
                ) -> torch.Tensor:
        h, hm = self.input_layernorm(x), self.input_layernorm(m)
        q = _rope(self.q_proj(h), positions + 1, self.H, inv_freq)
        k = _rope(self.k_proj(hm), positions, self.KV, inv_freq)
        x = x + self.o_proj(self.attn(q, k, self.v_proj(hm)))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class _Body(nn.Module):
    def __init__(self, c: dict, window: int | None, cache_config, n_target_layers: int, prefix: str) -> None:
        super().__init__()
        # a placeholder of the target's width: vLLM shares the target's embedding into it (has_own_embed_tokens)
        self.embed_tokens = nn.Embedding(1, c["d_model"])
        self.layers = nn.ModuleList(_SpireLayer(c, window, cache_config, f"{prefix}.layers.{n_target_layers + i}")
                                    for i in range(len(c["source_layers"])))
        self.norm = _RMSNorm(c["d_model"], c["rms_eps"])


class SpireDraftForVllm(Eagle3LlamaForCausalLM):
    """A SPIRe draft as vLLM's EAGLE-3 proposer runs it (the module docstring). A subclass of vLLM's
    ``Eagle3LlamaForCausalLM`` because the proposer accepts only its EAGLE-3 classes; nothing of the parent's
    model is built. Hidden states in and out: (T, n_d · d), one memory vector per draft layer."""

    has_own_embed_tokens = False  # the target's embedding, shared by the proposer
    has_own_lm_head = True  # the draft vocabulary's rows of the target's unembedding

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        self.config = vllm_config.speculative_config.draft_model_config.hf_config
        s = check_format(getattr(self.config, "spire_vllm", None), "SPIRe")
        c = s["shape"]
        check_target_shape({"num_hidden_layers": c["n_target_layers"], "hidden_size": c["d_model"],
                            "vocab_size": c["vocab_size"], "num_attention_heads": c["n_heads"],
                            "num_key_value_heads": c["n_kv_heads"]}, vllm_config.model_config.hf_config, "SPIRe")
        self.spire, self.target_model = s, str(vllm_config.model_config.model)
        self.n_d, self.d, self.V = len(c["source_layers"]), c["d_model"], c["vocab_size"]
        self.model = _Body(c, s["window"], vllm_config.cache_config, c["n_target_layers"], f"{prefix}model")
        N = s["draft_vocab_size"]
        self.lm_head = nn.Linear(self.d, N, bias=False)
        self.register_buffer("vocab", torch.arange(N, dtype=torch.long))
        self.register_buffer("mix", torch.zeros(self.n_d, self.n_d + 1))
        self.register_buffer("inv_freq", 1.0 / c["rope_theta"] ** (torch.arange(0, c["d_head"], 2).float()
                                                                     / c["d_head"]), persistent=False)
        self.register_buffer("target_probe", torch.zeros(PROBE_ROWS, self.d))
        self.draft_id_to_target_id = None
        self.use_parallel_drafting = False
        self._probed = False

    def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's states at the source layers are the memory as they are (no fc)."""
        return hidden_states

    def _check_target(self) -> None:
        """Refuse a target whose first embedding rows are not the export's (first call, after sharing)."""
        w = self.model.embed_tokens.weight
        if w.shape[0] < PROBE_ROWS:
            raise ValueError("vLLM did not share the target's embedding with the SPIRe draft")
        check_target_rows(w[:PROBE_ROWS].detach(), self.target_probe, "SPIRe")
        self._probed = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: (T,); hidden_states: (T, n_d · d) memory of each slot's position. Returns the
        last layer's output through the draft norm (T, d), for :meth:`compute_logits`, and the feedback memory of
        each slot's token (T, n_d · d): m^i = Σ_l softmax(w_i)_l x^l over the draft's n_d + 1 activations."""
        if not self._probed:
            self._check_target()
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        T = x.shape[0]
        mem_in = hidden_states.view(T, self.n_d, self.d).to(x.dtype)
        xs = [x]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, mem_in[:, i], positions, self.inv_freq)
            xs.append(x)
        mem = torch.einsum("il,ltd->tid", self.mix.to(x.dtype), torch.stack(xs))
        return self.model.norm(x), mem.reshape(T, self.n_d * self.d)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(T, d) -> (T, V) float32 logits: the draft vocabulary's columns at their target ids, -inf elsewhere
        (q = 0 there, as in spire). The head's weight is read directly: with the whole vocabulary, vLLM finds it
        equal to the target's and puts the target's head module in its place, which cannot be called."""
        weight = self.lm_head.weight
        logits = F.linear(hidden_states, weight[: self.vocab.shape[0]]).float()
        out = logits.new_full((logits.shape[0], self.V), float("-inf"))
        out[:, self.vocab] = logits
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The export's tensors by name (:func:`spire.integrations.vllm_export.spire_vllm_folder`); the embedding
        placeholder counts as loaded (the proposer replaces it with the target's). Raises ValueError for a tensor
        the model does not have or one of another shape."""
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        weights = list(weights)
        loaded = {"model.embed_tokens.weight"}
        for name, w in weights:
            if name not in params or params[name].shape != w.shape:
                raise ValueError(f"the SPIRe export's tensor {name} {tuple(w.shape)} does not fit spire's vLLM "
                                 f"plugin (format {PLUGIN_FORMAT})")
            with torch.no_grad():
                params[name].copy_(w.to(params[name].dtype))
            loaded.add(name)
        missing = {n for n in dict(self.named_parameters())} - loaded
        if missing:
            raise ValueError(f"the SPIRe export lacks tensors {sorted(missing)[:4]}")
        rows = target_rows(self.target_model)  # at start-up, from the target's files; else at the first forward
        if rows is not None:
            check_target_rows(rows, self.target_probe, "SPIRe")
            self._probed = True
        return loaded
