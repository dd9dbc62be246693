"""Model shapes and presets for the cost model (SPIRe paper §"evaluation"; see spec SPIRE.md §2).

A :class:`ModelShape` holds only what the cost model needs: the body of a GQA SwiGLU transformer.
Parameter and KV counts are in *values*; at the paper's 1 byte per value they are also bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from spire.errors import ConfigError

DRAFTS = ("vanilla", "magicdec", "spire")
"""Draft kinds, in the order every table and plot uses."""


@dataclass(frozen=True)
class ModelShape:
    """Body shape of a GQA SwiGLU transformer (paper notation).

    n_layers: transformer blocks; d_model: residual width; q_per_kv: query heads per KV head;
    n_kv: KV heads; d_head: width of one head; d_ff: SwiGLU hidden width.
    """

    n_layers: int
    d_model: int
    q_per_kv: int
    n_kv: int
    d_head: int
    d_ff: int

    def body_params_per_layer(self) -> int:
        """Values in one block: 2 norm scales + q, k, v + o + SwiGLU gate, up, down (paper convention)."""
        d, n_kv, d_head = self.d_model, self.n_kv, self.d_head
        norms = 2 * d
        qkv = (self.q_per_kv + 2) * n_kv * d * d_head
        o = self.q_per_kv * n_kv * d_head * d
        mlp = 3 * d * self.d_ff
        return norms + qkv + o + mlp

    def body_params(self) -> int:
        """N: body parameters (values), embedding and unembedding excluded, as in the paper."""
        return self.n_layers * self.body_params_per_layer()

    def kv_values_per_token(self) -> int:
        """x: KV-cache values one token occupies over all layers = 2 · n_layers · n_kv · d_head."""
        return 2 * self.n_layers * self.n_kv * self.d_head

    def with_layers(self, n_layers: int) -> ModelShape:
        """The same width with ``n_layers`` blocks (a pruned or shallow draft)."""
        return replace(self, n_layers=n_layers)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Shape from a Llama-style Hugging Face ``config.json`` dict.

        ``head_dim`` defaults to hidden_size // num_attention_heads and ``num_key_value_heads`` to
        num_attention_heads (multi-head attention), as in transformers' LlamaConfig.
        """
        try:
            n_heads = int(config["num_attention_heads"])
            n_kv = int(config.get("num_key_value_heads") or n_heads)
            d_model = int(config["hidden_size"])
            shape = cls(
                n_layers=int(config["num_hidden_layers"]),
                d_model=d_model,
                q_per_kv=n_heads // n_kv,
                n_kv=n_kv,
                d_head=int(config.get("head_dim") or d_model // n_heads),
                d_ff=int(config["intermediate_size"]),
            )
        except KeyError as e:
            raise ConfigError(f"model config lacks the key {e.args[0]!r}") from None
        if n_heads % n_kv:
            raise ConfigError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
        return shape


# Shapes from the paper (SPIRE.md §2): (layers, d_model, q_per_kv, n_kv, d_head, d_ff).
TARGET_67M = ModelShape(8, 512, 1, 8, 128, 4096)  # 67,117,056 body params
VANILLA_67M = ModelShape(4, 256, 1, 8, 64, 2048)  # 8,390,656
SPIRE_67M = TARGET_67M.with_layers(2)  # 16,779,264 = N_t / 4 (target layers 7, 8)
LLAMA3_70B = ModelShape(80, 8192, 8, 8, 128, 28672)
LLAMA3_8B = ModelShape(32, 4096, 4, 8, 128, 14336)  # the vanilla draft for Llama 3 70B
SPIRE_70B = LLAMA3_70B.with_layers(20)

# HuggingFaceTB/SmolLM2-135M: 30 layers, 9 query / 3 KV heads of 64, 3,540,096 body params per layer.
SMOLLM2_135M = ModelShape(30, 576, 3, 3, 64, 1536)
SPIRE_SMOLLM2 = SMOLLM2_135M.with_layers(8)  # its last 8 of 30 layers
VANILLA_SMOLLM2 = SMOLLM2_135M.with_layers(4)  # ~1/8 of the target body (4/30)

PAPER_TAUS = {"vanilla": 2.647, "magicdec": 3.891, "spire": 3.401}
"""τ the paper measured at L = 512, k = 4 with its 67M target (SPIRE.md §2)."""


@dataclass(frozen=True)
class Preset:
    """A target, its vanilla and SPIRe drafts, and default τ per draft kind.

    MagicDec has no shape of its own: its draft is the target over a StreamingLLM cache.
    """

    name: str
    target: ModelShape
    drafts: Mapping[str, ModelShape]
    taus: Mapping[str, float]
    tau_source: str
    description: str = ""

    def draft_shape(self, draft_kind: str) -> ModelShape:
        """Shape of the model that drafts for ``draft_kind`` (the target itself for MagicDec)."""
        check_draft_kind(draft_kind)
        return self.target if draft_kind == "magicdec" else self.drafts[draft_kind]


def check_draft_kind(draft_kind: str) -> None:
    if draft_kind not in DRAFTS:
        raise ConfigError(f"unknown draft {draft_kind!r}; known: {', '.join(DRAFTS)}")


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="paper-67m",
            target=TARGET_67M,
            drafts={"vanilla": VANILLA_67M, "spire": SPIRE_67M},
            taus=PAPER_TAUS,
            tau_source="paper (L=512, k=4)",
            description="the paper's 67M target, 8.4M vanilla draft and 2-layer SPIRe draft",
        ),
        Preset(
            name="paper-70b",
            target=LLAMA3_70B,
            drafts={"vanilla": LLAMA3_8B, "spire": SPIRE_70B},
            taus=PAPER_TAUS,
            tau_source="paper, 67M target (L=512, k=4)",
            description="Llama 3 70B target, Llama 3 8B vanilla draft, 20-layer SPIRe draft",
        ),
        Preset(
            name="smollm2-135m",
            target=SMOLLM2_135M,
            drafts={"vanilla": VANILLA_SMOLLM2, "spire": SPIRE_SMOLLM2},
            taus=PAPER_TAUS,
            tau_source="paper (override with --tau)",
            description="SmolLM2-135M target, 4-layer vanilla draft, SPIRe draft from its last 8 layers",
        ),
    )
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; :class:`ConfigError` naming the known presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
