"""EAGLE-3's settings, one job: :class:`Eagle3Config` (the draft's options, checked against a target),
speculators' default target layer ids (:func:`default_layer_ids`), the decoder layer's shape for a target
(:func:`draft_layer_config`) and the layer types speculators' Eagle3 knows (:data:`LAYER_TYPES`). The architecture
they configure is described in :mod:`spire.drafts.eagle3`."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, fields

from spire import defaults
from spire.errors import ConfigError
from spire.model import ModelConfig

LAYER_TYPES = ("llama", "qwen3")
"""``transformer_layer_config.model_type`` values of speculators' Eagle3 (``model_definitions.model_classes``)."""


def default_layer_ids(n_target_layers: int) -> tuple[int, ...]:
    """speculators' default target layers for an n-layer target: (2, n // 2, n - 3)."""
    n = n_target_layers
    return (2, n // 2, n - 3)


@dataclass
class Eagle3Config:
    """Settings of an EAGLE-3 draft.

    layers: target layer ids whose input residual streams the draft fuses (:mod:`spire.drafts.eagle3`); None:
        speculators' default (2, n // 2, n - 3). Ids in [0, n], distinct; n = the final residual stream before the final norm.
    draft_vocab: N columns of the head (the N most frequent training tokens); 0, or N >= V: the whole vocabulary.
    norm_before_residual, norm_before_fc, fc_norm, norm_output: speculators' Eagle3SpeculatorConfig flags, all
        implemented (the residual of the layer is hidden_norm(f) instead of f; one RMSNorm over the concatenated
        target states before fc; one RMSNorm per target state before fc; the fed-back feature is norm(z)).
    embed_requires_grad: speculators' flag; True (a trained embedding) is refused: the draft reads the target's.
    num_layers: speculators' ``transformer_layer_config.num_hidden_layers``; only 1 is implemented.
    train_head: whether the head is trained (EAGLE-3's reference code and SpecForge; speculators 0.9 freezes it at
        the target's rows: False). Not part of the exported format.
    sink, window: beyond EAGLE-3: a StreamingLLM view (sink + window, tokens) of the draft's KV cache; window
        None (the default) is EAGLE-3's full cache.
    """

    layers: tuple[int, ...] | None = None
    draft_vocab: int = 16384
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    embed_requires_grad: bool = False
    num_layers: int = 1
    train_head: bool = True
    sink: int = defaults.SINK
    window: int | None = None

    def __post_init__(self) -> None:
        if self.layers is not None:
            self.layers = tuple(int(j) for j in self.layers)

    def layer_ids(self, n_target_layers: int) -> tuple[int, ...]:
        """The target layer ids (the default for an n-layer target when ``layers`` is None)."""
        return self.layers if self.layers is not None else default_layer_ids(n_target_layers)

    def vocab_columns(self, vocab_size: int) -> int | None:
        """N, or None for the whole vocabulary (draft_vocab 0 or >= vocab_size)."""
        return None if self.draft_vocab == 0 or self.draft_vocab >= vocab_size else int(self.draft_vocab)

    def validate(self, n_target_layers: int, vocab_size: int | None = None) -> None:
        """Raise ConfigError for settings that cannot be built for a target of ``n_target_layers`` layers: layer ids
        outside [0, n] or repeated (speculators' default for a target of fewer than 6 layers included), a negative
        draft vocabulary, an unimplemented speculators flag (embed_requires_grad, num_layers != 1), norm_before_fc
        with fc_norm (speculators refuses both), a bad view."""
        n = n_target_layers
        ids = self.layer_ids(n)
        if not ids or len(set(ids)) != len(ids) or any(not 0 <= j <= n for j in ids):
            which = "the default layer ids" if self.layers is None else "layer ids"
            raise ConfigError(f"EAGLE-3 {which} must be distinct target layers in [0, {n}] (id {n}: the final "
                              f"residual stream), got {list(ids)}" + ("; give Eagle3Config.layers" if
                                                                      self.layers is None else ""))
        if len(ids) != 3:
            raise ConfigError(f"EAGLE-3 fuses exactly three target layers (a low, a middle and a high one: the fc is "
                              f"3d -> d, as speculators and SpecForge build it), got {len(ids)}: {list(ids)}")
        if self.draft_vocab < 0:
            raise ConfigError(f"the draft vocabulary must be >= 0 tokens (0: the whole vocabulary), got "
                              f"{self.draft_vocab}")
        if self.embed_requires_grad:
            raise ConfigError("embed_requires_grad=True (a trained draft embedding) is not implemented: spire's "
                              "EAGLE-3 draft reads the target's frozen embedding")
        if self.num_layers != 1:
            raise ConfigError(f"spire's EAGLE-3 draft has one decoder layer; num_layers={self.num_layers} "
                              "(speculators' num_hidden_layers > 1) is not implemented")
        if self.norm_before_fc and self.fc_norm:
            raise ConfigError("norm_before_fc and fc_norm are mutually exclusive (as in speculators)")
        if self.sink < 0 or (self.window is not None and self.window < 1):
            raise ConfigError(f"sink must be >= 0 and window >= 1 (or None), got {self.sink}, {self.window}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = None if self.layers is None else list(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        """Raises ConfigError for a key this spire does not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown EAGLE-3 settings {unknown} (written by a newer spire?)")
        return cls(**d)


def draft_layer_config(target_cfg: ModelConfig) -> ModelConfig:
    """The decoder layer's shape for a target: its d_model, heads, head dim, d_ff, norm eps and positions, a plain
    Llama block (a Qwen3 block, with q/k norms, for a Qwen3 target, as speculators builds its layer from the
    verifier's config), and the target's most common RoPE among its layers (layers without RoPE skipped)."""
    specs = [target_cfg.rope_of(i) for i in range(target_cfg.n_layers)]
    specs = [s for s in specs if s.get("rope_type") != "none"] or [{"rope_type": "default",
                                                                    "rope_theta": float(target_cfg.rope_theta)}]
    counts = Counter(json.dumps(s, sort_keys=True) for s in specs)
    most = max(counts.values())
    spec = next(s for s in specs if counts[json.dumps(s, sort_keys=True)] == most)  # ties: the first layer's
    family = "qwen3" if target_cfg.family == "qwen3" else "llama"
    default = spec == {"rope_type": "default", "rope_theta": spec.get("rope_theta")}
    return ModelConfig(vocab_size=target_cfg.vocab_size, d_model=target_cfg.d_model, n_layers=1,
                       n_heads=target_cfg.n_heads, n_kv_heads=target_cfg.n_kv_heads, d_head=target_cfg.d_head,
                       d_ff=target_cfg.d_ff, rope_theta=float(spec.get("rope_theta", target_cfg.rope_theta)),
                       rms_eps=target_cfg.rms_eps, max_positions=target_cfg.max_positions, tie_embeddings=False,
                       bos_id=target_cfg.bos_id, eos_ids=list(target_cfg.eos_ids), family=family,
                       qk_norm=family == "qwen3", layer_ropes=None if default else [spec])
