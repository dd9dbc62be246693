"""Random-weight HF checkpoints of every family spire reads, built with transformers (nothing downloaded), for
tests/test_families.py and the lossless tests of those families."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128

# (n_layers, n_heads, n_kv_heads, head_dim): GQA, MHA, MQA
LAYOUTS = {"gqa": (2, 4, 2, 16), "mha": (3, 4, 4, 8), "mqa": (4, 8, 1, 16)}


def _common(layout: str) -> dict:
    n_layers, heads, kv, d_head = LAYOUTS[layout]
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=n_layers,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=d_head, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _alternating(n: int, first: str = "sliding_attention", other: str = "full_attention") -> list[str]:
    return [first if i % 2 == 0 else other for i in range(n)]


def family_config(name: str, layout: str = "gqa"):
    """An HF config object of family ``name`` (see :data:`FAMILIES`) with small shapes; windows of 8 positions
    and RoPE scalings whose original context is 32 positions, so that 40-token tests cross them."""
    import transformers as tf

    c = _common(layout)
    n = c["num_hidden_layers"]
    if name == "llama":
        return tf.LlamaConfig(**c, rope_theta=10000.0)
    if name == "llama-bias":
        return tf.LlamaConfig(**c, attention_bias=True, mlp_bias=True)
    if name == "llama3":
        return tf.LlamaConfig(**c, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 32})
    if name == "llama-linear":
        return tf.LlamaConfig(**c, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    if name == "llama-yarn":
        return tf.LlamaConfig(**c, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                    "original_max_position_embeddings": 32})
    if name == "qwen2":
        return tf.Qwen2Config(**{**c, "tie_word_embeddings": True}, rope_theta=1e6)
    if name == "qwen2-sliding":  # layers >= max_window_layers slide
        return tf.Qwen2Config(**{**c, "tie_word_embeddings": True}, use_sliding_window=True, sliding_window=8,
                              max_window_layers=1)
    if name == "qwen3":
        return tf.Qwen3Config(**c, rope_theta=1e6)
    if name == "mistral":
        return tf.MistralConfig(**c, sliding_window=8)
    if name == "mistral-full":
        return tf.MistralConfig(**c, sliding_window=None)
    if name == "phi3":
        return tf.Phi3Config(**{k: v for k, v in c.items() if k != "head_dim"}, sliding_window=8)
    if name == "gemma3":
        return tf.Gemma3TextConfig(**{**c, "tie_word_embeddings": True}, sliding_window=8, query_pre_attn_scalar=24,
                                   layer_types=_alternating(n), rope_local_base_freq=100.0,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                    "full_attention": {"rope_type": "linear", "rope_theta": 10000.0,
                                                                       "factor": 2.0}})
    if name == "smollm3":
        return tf.SmolLM3Config(**c, rope_theta=10000.0, no_rope_layers=[int(i % 2 == 0) for i in range(n)])
    raise KeyError(name)


FAMILIES = ["llama", "llama-bias", "llama3", "llama-linear", "llama-yarn", "qwen2", "qwen2-sliding", "qwen3",
            "mistral", "mistral-full", "phi3", "gemma3", "smollm3"]
"""Families (and Llama's RoPE scalings, biases, Mistral with and without its sliding window) tested exactly."""

PLAIN = {"llama", "llama3", "llama-linear", "llama-yarn", "mistral", "mistral-full", "phi3", "smollm3"}
"""Families whose blocks the fused native block computes (the others run per op)."""


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough for well separated logits; norm weights and biases non-trivial (HF initializes
    norms to 1 (Gemma: 0) and biases to 0, which would hide a norm or bias applied wrongly)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 1.0 / p.shape[1] ** 0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:  # biases
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def build_checkpoint(name: str, folder: Path, layout: str = "gqa", seed: int = 0):
    """Save a random-weight HF model of family ``name`` to ``folder``; returns the HF model (float32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(family_config(name, layout), dtype=torch.float32)
    randomize_(hf, seed)
    hf.save_pretrained(folder)
    return hf.eval()
