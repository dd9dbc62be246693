"""Model shapes and presets for the cost model (SPIRe paper §"evaluation"; see spec SPIRE.md §2).

A :class:`ModelShape` holds only what the cost model needs: the body of a GQA SwiGLU transformer.
Parameter and KV counts are in *values*; at the paper's 1 byte per value they are also bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import spire.registry as registry
from spire.errors import ConfigError
from spire.paper import PAPER_ABLATION_TAU, PAPER_TAU_TABLE  # noqa: F401 (PAPER_TAU_TABLE re-exported here)

DRAFTS = registry.names(priced=True)
"""Draft kinds the cost model prices, in the registry's order (the order of every table and plot)."""

PAPER_DRAFTS = tuple(name for name in DRAFTS if registry.kind(name).paper_tau is not None)
"""The drafts the paper measured (vanilla, MagicDec, SPIRe): the rows of its tables."""


@dataclass(frozen=True)
class ModelShape:
    """Body shape of a GQA SwiGLU transformer (paper notation).

    n_layers: transformer blocks; d_model: residual width; q_per_kv: query heads per KV head;
    n_kv: KV heads; d_head: width of one head; d_ff: SwiGLU hidden width. vocab_size (0 = unknown) and
    tie_embeddings matter only when the cost model counts embedding / unembedding (off in the paper).
    extra_per_layer: values per block beyond the paper's GQA SwiGLU count (a family's biases and extra norm
    scales, :func:`family_extra_params`); 0 for the paper's shapes.
    """

    n_layers: int
    d_model: int
    q_per_kv: int
    n_kv: int
    d_head: int
    d_ff: int
    vocab_size: int = 0
    tie_embeddings: bool = True
    extra_per_layer: int = 0

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "q_per_kv", "n_kv", "d_head", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model shape: {name} must be a positive integer, got {value!r}")
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 0:
            raise ConfigError(f"model shape: vocab_size must be a non-negative integer, got {self.vocab_size!r}")

    @property
    def n_heads(self) -> int:
        """Query heads = q_per_kv · n_kv."""
        return self.q_per_kv * self.n_kv

    def body_params_per_layer(self) -> int:
        """Values in one block: 2 norm scales + q, k, v + o + SwiGLU gate, up, down (paper convention), plus
        ``extra_per_layer`` (biases, extra norm scales: counted like the paper's norm scales, 1 value each)."""
        d, n_kv, d_head = self.d_model, self.n_kv, self.d_head
        norms = 2 * d
        qkv = (self.q_per_kv + 2) * n_kv * d * d_head
        o = self.q_per_kv * n_kv * d_head * d
        mlp = 3 * d * self.d_ff
        return norms + qkv + o + mlp + self.extra_per_layer

    def body_params(self) -> int:
        """N: body parameters (values), embedding and unembedding excluded, as in the paper."""
        return self.n_layers * self.body_params_per_layer()

    def kv_values_per_token(self) -> int:
        """x: KV-cache values one token occupies over all layers = 2 · n_layers · n_kv · d_head."""
        return 2 * self.n_layers * self.n_kv * self.d_head

    def embedding_params(self) -> int:
        """Embedding plus unembedding values: vocab·d_model, twice when they are not tied (not in the paper)."""
        return self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)

    def unembedding_params(self) -> int:
        """Values of the unembedding matrix, read in full by every forward pass: vocab·d_model."""
        return self.vocab_size * self.d_model

    def attention_flops_per_token(self, L: int) -> int:
        """Attention-score FLOPs of one new token over a context of L tokens, all layers (not in the paper):
        q·Kᵀ and p·V each cost 2·n_heads·d_head·L multiply-adds per layer → 4·n_layers·n_heads·d_head·L."""
        return 4 * self.n_layers * self.n_heads * self.d_head * L

    def with_layers(self, n_layers: int) -> ModelShape:
        """The same width with ``n_layers`` blocks (a pruned or shallow draft)."""
        return replace(self, n_layers=n_layers)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Shape from a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2/Qwen3, Gemma 1/2/3, SmolLM).

        Multimodal configs with a ``text_config`` use it. ``head_dim`` defaults to
        hidden_size // num_attention_heads (Gemma and Qwen3 set it explicitly, and it need not equal
        that), ``num_key_value_heads`` to num_attention_heads (multi-head attention, as in transformers),
        ``tie_word_embeddings`` to true for Gemma and false otherwise (transformers' defaults).
        Gemma's GeGLU MLP has the same three matrices as SwiGLU and Phi-3's fused q/k/v and gate/up weights
        the same values as separate ones. A family's biases (Qwen2's q/k/v, Llama's ``attention_bias`` and
        ``mlp_bias``), q/k norm scales (Qwen3, Gemma 3) and Gemma 2/3's two extra norms per block are body
        parameters too: they are counted in ``extra_per_layer`` (:func:`family_extra_params`), 1 value each like
        the paper's norm scales (they change N by well under 0.1 %).
        """
        if not isinstance(config, Mapping):
            raise ConfigError("model config must be a JSON object")
        if isinstance(config.get("text_config"), Mapping):
            config = {"model_type": config.get("model_type", ""), **config["text_config"]}
        try:
            n_heads = _config_int(config, "num_attention_heads")
            n_kv = _config_int(config, "num_key_value_heads", n_heads)
            d_model = _config_int(config, "hidden_size")
            n_layers = _config_int(config, "num_hidden_layers")
            d_ff = _config_int(config, "intermediate_size")
            d_head = _config_int(config, "head_dim", d_model // n_heads)
            vocab = _config_int(config, "vocab_size", 0, positive=False)
        except KeyError as e:
            raise ConfigError(f"model config lacks the key {e.args[0]!r}") from None
        if n_heads % n_kv:
            raise ConfigError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
        tied = config.get("tie_word_embeddings")
        if tied is None:
            tied = str(config.get("model_type", "")).startswith("gemma")
        return cls(n_layers, d_model, n_heads // n_kv, n_kv, d_head, d_ff, vocab, bool(tied),
                   family_extra_params(config, d_model, n_heads, n_kv, d_head, d_ff))

    @classmethod
    def from_hf_config_file(cls, path: str | Path) -> ModelShape:
        """:meth:`from_hf_config` on a ``config.json`` file, or a folder that holds one."""
        return cls.from_hf_config(read_json(path, "config.json"))


def family_extra_params(config: Mapping[str, Any], d_model: int, n_heads: int, n_kv: int, d_head: int,
                        d_ff: int) -> int:
    """Values per block an HF config's family adds to the GQA SwiGLU block (as spire.model builds it): q/k/v
    biases (n_heads + 2 n_kv)·d_head (Qwen2 always; Llama, Qwen3, SmolLM3, Gemma 3 with ``attention_bias``,
    which adds the o bias d_model too), MLP biases 2·d_ff + d_model (``mlp_bias``), q/k norm scales 2·d_head
    (Qwen3, Gemma 3), Gemma 2/3's norms after attention and MLP 2·d_model."""
    family = str(config.get("model_type", ""))
    extra = 0
    if family == "qwen2" or (config.get("attention_bias") and family != "qwen2"):
        extra += (n_heads + 2 * n_kv) * d_head
    if config.get("attention_bias") and family != "qwen2":
        extra += d_model
    if config.get("mlp_bias"):
        extra += 2 * d_ff + d_model
    if family.startswith("qwen3") or family.startswith("gemma3"):
        extra += 2 * d_head
    if family.startswith("gemma2") or family.startswith("gemma3"):
        extra += 2 * d_model
    return extra


def _config_int(config: Mapping[str, Any], key: str, default: int | None = None, positive: bool = True) -> int:
    value = config.get(key)
    if value is None:
        if default is None:
            raise KeyError(key)
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
        raise ConfigError(f"model config: {key} must be a {'positive' if positive else 'non-negative'} "
                          f"integer, got {value!r}")
    return value


def read_json(path: str | Path, default_name: str = "config.json") -> Any:
    """Parse a JSON file (``path/default_name`` for a folder); :class:`ConfigError` if missing or invalid."""
    path = Path(path)
    if path.is_dir():
        path = path / default_name
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def spire_draft_from_config(target: ModelShape, config: Mapping[str, Any] | str | Path) -> tuple[ModelShape, int, int]:
    """(draft shape, sink, window) of a SPIRe draft described by spire's own :class:`SpireConfig`.

    ``config`` is a dict with ``n_draft_layers`` (and optionally ``sink``, ``window``), a JSON file of one,
    or a draft ``.safetensors`` saved by spire (its ``spire`` metadata holds ``spire_config``). The draft is
    the target's last n_draft_layers blocks at the target's width (paper, pruned initialization).
    """
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.suffix == ".safetensors":
            try:
                from safetensors import safe_open

                with safe_open(str(path), "np") as f:
                    config = json.loads((f.metadata() or {})["spire"])
            except (OSError, KeyError, ValueError, Exception) as e:  # safetensors raises its own error types
                raise ConfigError(f"cannot read a spire draft config from {path}: {str(e).splitlines()[0]}") from None
        else:
            config = read_json(path)
    if not isinstance(config, Mapping):
        raise ConfigError("spire draft config must be a JSON object")
    config = config.get("spire_config", config)
    try:
        n = _config_int(config, "n_draft_layers")
        sink = _config_int(config, "sink", 1, positive=False)
        window = _config_int(config, "window", 64)
    except KeyError as e:
        raise ConfigError(f"spire draft config lacks the key {e.args[0]!r}") from None
    if n > target.n_layers:
        raise ConfigError(f"spire draft config: n_draft_layers {n} exceeds the target's {target.n_layers} layers")
    return target.with_layers(n), sink, window


# Shapes from the paper (SPIRE.md §2): (layers, d_model, q_per_kv, n_kv, d_head, d_ff).
TARGET_67M = ModelShape(8, 512, 1, 8, 128, 4096)  # 67,117,056 body params
VANILLA_67M = ModelShape(4, 256, 1, 8, 64, 2048)  # 8,390,656
SPIRE_67M = TARGET_67M.with_layers(2)  # 16,779,264 = N_t / 4 (target layers 7, 8)
LLAMA3_70B = ModelShape(80, 8192, 8, 8, 128, 28672, vocab_size=128_256, tie_embeddings=False)
LLAMA3_8B = ModelShape(32, 4096, 4, 8, 128, 14336, vocab_size=128_256, tie_embeddings=False)  # vanilla draft
SPIRE_70B = LLAMA3_70B.with_layers(20)

# HuggingFaceTB/SmolLM2-135M: 30 layers, 9 query / 3 KV heads of 64, 3,540,096 body params per layer.
SMOLLM2_135M = ModelShape(30, 576, 3, 3, 64, 1536, vocab_size=49_152, tie_embeddings=True)
SPIRE_SMOLLM2 = SMOLLM2_135M.with_layers(8)  # 8 of its 30 layers (the cost depends on the count only)
VANILLA_SMOLLM2 = SMOLLM2_135M.with_layers(4)  # ~1/8 of the target body (4/30)

PAPER_TAUS = {name: registry.kind(name).paper_tau for name in PAPER_DRAFTS}  # vanilla 2.647, magicdec 3.891, spire 3.401
"""τ the paper measured at L = 512, k = 4 with its 67M target (SPIRE.md §2)."""

ABLATION_TAUS = {label: PAPER_ABLATION_TAU[name] for name, label in (
    ("none", "SPIRe"),
    ("no-feedback", "no feedback memory"),
    ("no-feedback-no-target", "no feedback, no target activations"),
    ("omega1", "MixedLoss ω=1 (distillation)"),
    ("hard-loss", "HardTargetLoss"),
    ("random-init", "random initialization"),
)}
"""τ of the paper's ablated SPIRe drafts (Figure 5, L = 512, k = 4). All keep the sparse KV cache;
"without sparse KV cache" is computed analytically (SPIRe's τ, full draft KV): see analysis.ablation_rows."""


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
    max_positions: int | None = None  # the target's context limit (tokens) when it is a real model, else None

    def draft_shape(self, draft_kind: str) -> ModelShape:
        """Shape of the model that drafts for ``draft_kind``: the preset's own when it has one, else the one its
        pricing implies (:func:`default_draft_shape`; the target itself for MagicDec)."""
        check_draft_kind(draft_kind)
        pricing = registry.kind(draft_kind).pricing
        if pricing.weights == "target":
            return self.target
        return self.drafts.get(draft_kind) or default_draft_shape(self.target, draft_kind)


def check_draft_kind(draft_kind: str) -> None:
    """ConfigError unless the cost model prices ``draft_kind`` (:data:`DRAFTS`)."""
    if draft_kind not in DRAFTS:
        raise ConfigError(f"unknown draft {draft_kind!r}; known: {', '.join(DRAFTS)}")


def default_draft_shape(target: ModelShape, draft_kind: str) -> ModelShape:
    """The draft shape a kind's pricing (:class:`spire.registry.Pricing`) implies for ``target``: its
    ``layers`` blocks at the target's width (a float: that fraction of the target's blocks, rounded up); with
    ``fused_inputs`` (EAGLE-3, arXiv 2503.01840) each block also holds the fc map fused_inputs·d → d, the q, k, v
    columns of its second attention input (the fused hidden state beside the token embedding) and that input's
    norm. A kind without weights (n-gram) has a zero-cost shape: its forwards are priced at nothing."""
    pricing = registry.kind(draft_kind).pricing
    if pricing.weights == "target":
        return target
    layers = pricing.layers
    n = max(1, math.ceil(target.n_layers * layers) if isinstance(layers, float) else int(layers))
    shape = target.with_layers(n)
    if pricing.fused_inputs:
        d = target.d_model
        extra = pricing.fused_inputs * d * d + (target.q_per_kv + 2) * target.n_kv * d * target.d_head + d
        shape = replace(shape, extra_per_layer=target.extra_per_layer + extra)
    return shape


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
            name="llama3-70b",
            target=LLAMA3_70B,
            drafts={"vanilla": LLAMA3_8B, "spire": SPIRE_70B},
            taus=PAPER_TAUS,
            tau_source="paper, 67M target (L=512, k=4); the paper's Figure 6 extrapolation",
            description="Llama 3 70B target, Llama 3 8B vanilla draft, 20-layer SPIRe draft",
        ),
        Preset(
            name="smollm2-135m",
            target=SMOLLM2_135M,
            drafts={"vanilla": VANILLA_SMOLLM2, "spire": SPIRE_SMOLLM2},
            taus=PAPER_TAUS,
            tau_source="the paper's 67M-target values (L=512, k=4); pass --tau or --tau-from for this target's "
                       "own τ",
            description="SmolLM2-135M target, 4-layer vanilla draft, 8-layer SPIRe draft (any 8 of its layers: the "
                        "main job prunes its first 2 and last 6)",
            max_positions=8192,
        ),
    )
}


ALIASES = {"paper-70b": "llama3-70b"}
"""Other names of presets (the skeleton's ``paper-70b``)."""


def get_preset(name: str) -> Preset:
    """The preset called ``name`` (or an alias); :class:`ConfigError` naming the known presets otherwise."""
    try:
        return PRESETS[ALIASES.get(name, name)]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join([*PRESETS, *ALIASES])}") from None


def preset_from_configs(
    target: ModelShape,
    vanilla: ModelShape | None = None,
    spire: ModelShape | None = None,
    taus: Mapping[str, float] | None = None,
    name: str = "custom",
) -> Preset:
    """A preset for any target. Defaults: the vanilla draft is the target with ceil(n_layers/8) layers
    (about 1/8 of its body, as the paper's vanilla draft), the SPIRe draft its last ceil(n_layers/4)
    layers (the paper's 2 of 8), and τ the paper's L = 512 values (override them with measured ones)."""
    vanilla = vanilla or target.with_layers(math.ceil(target.n_layers / 8))
    spire = spire or target.with_layers(math.ceil(target.n_layers / 4))
    for label, shape in (("vanilla", vanilla), ("spire", spire)):
        if shape.vocab_size and target.vocab_size and shape.vocab_size != target.vocab_size:
            raise ConfigError(f"{label} draft vocab_size {shape.vocab_size} differs from the target's "
                              f"{target.vocab_size}")
    return Preset(
        name=name,
        target=target,
        drafts={"vanilla": vanilla, "spire": spire},
        taus=dict(taus or PAPER_TAUS),
        tau_source="given" if taus else "paper (L=512, k=4); pass measured τ",
        description=f"target {target.body_params() / 1e6:.1f}M body params, vanilla "
        f"{vanilla.body_params() / 1e6:.1f}M, SPIRe {spire.n_layers} layers",
    )
