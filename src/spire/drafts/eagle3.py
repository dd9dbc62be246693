"""The EAGLE-3 draft (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv 2503.01840), as vllm-project/speculators 0.9 defines it
(``src/speculators/models/eagle3/{config,core,model_definitions,attention,metrics}.py``, ``model.py``'s
``DraftVocabMixin``, ``train/vocab_mapping.py``) and sgl-project/SpecForge trains it.

Architecture (one decoder layer, d = the target's hidden size, N = draft vocabulary)::

    g_t   = fc(cat(h_t^{j1}, h_t^{j2}, h_t^{j3}))                  fc: Linear(3d -> d, no bias)    "fused feature"
    u_t   = cat(input_layernorm(embed(x_t)), hidden_norm(f_{t-1}))  (2d,)  -> q, k, v (Linear(2d -> .))
    y_t   = f_{t-1} + o_proj(attention(u_t))                        (hidden_norm(f_{t-1}) with norm_before_residual)
    z_t   = y_t + mlp(post_attention_layernorm(y_t))                 the layer's (pre-norm) output
    logits= lm_head(norm(z_t))                                       lm_head: (N, d), N columns of the target's vocab

``embed`` is the target's (frozen) embedding; ``f_{t-1}`` is the feature of the previous position: the fused
target feature ``g_{t-1}`` when position t - 1 was verified by the target, the draft's own ``z_{t-1}`` when it was
drafted in the same round (``norm(z_{t-1})`` with ``norm_output``, speculators' "EAGLE 3.1" flag). Position 0 has
no previous position: its feature is 0. RoPE is the target's (the most common RoPE of its layers), at the
positions of the text.

Alignment: the draft's input at position t is (x_t, f_{t-1}) and its output predicts x_{t+1}; in speculators'
training data (``shift_batch``) index i holds (x_{i+1}, g_i) at position id i + 1, which is the same draft
(attention depends on relative positions only). The key of position 0 (no feature) is read by the query at
position 0 only, so the draft attends over exactly the keys speculators and vLLM hold (their draft sequence starts
at x_1).

Target layer ids. Layer id j means the residual stream ENTERING target layer j, i.e. HF transformers'
``output_hidden_states[j]`` for 0 <= j < n (``hidden_states[0]`` is the embedding output), which is what
:meth:`spire.model.Transformer.forward` returns for ``hidden_layers=(j,)`` and what vLLM's and speculators'
``eagle_aux_hidden_state_layer_ids`` capture ("input to layer j": vLLM's ``EagleModelMixin._maybe_add_hidden_state``
records id 0 before the first layer and id i + 1 after layer i; SGLang PR #25454 fixed a +1 offset applied to such
ids, and vLLM #38111 reportedly mixed up the same convention). Id n (the number of target layers) is the
final residual stream BEFORE the final norm, as vLLM captures it; HF's ``hidden_states[n]`` is after the final norm.
tests/test_eagle3.py checks both against transformers. The default ids are speculators' ``[2, n // 2, n - 3]``
(``speculators.models.utils.resolve_target_layer_ids``).

The KV cache: at inference the draft's cache holds, for every verified position t, the keys/values of
(x_t, g_{t-1}) (written by :meth:`Eagle3Draft.observe` after each prefill and verify: EAGLE's "catch-up"), and
for a drafted position those of (x_t, f_{t-1}) (written by :meth:`Eagle3Draft.step`). A drafted query at p reads
every key <= p. Training reproduces it (speculators' test-time training, TTT): :meth:`Eagle3DraftModel.train_logits`
splits the sequence into chunks of k positions; the j-th position of a chunk starting at s is the j-th drafted
step of a chain that began at s with the target's feature g_{s-1}, attending to the keys of positions <= s computed
from target features and to its own chain's keys at s + 1 .. s + j. (speculators' TTT computes every position at
every depth; the chunked layout computes each position once, at depth t mod k, as inference meets it. Its
``ttt_step_loss_decay`` weighting is not applied.)

Draft vocabulary: N target ids (:func:`spire.drafts.vocab.frequent_tokens`, the most frequent training tokens,
sorted ascending as speculators' ``build_vocab_mappings_from_distribution`` sorts them); speculators stores them
as ``d2t`` (N,) int64 offsets, target_id = i + d2t[i], and ``t2d`` (V,) bool. The head's rows start as the
target's lm_head rows of those ids; :meth:`Eagle3Draft.step` scatters the N logits into the target's V with -inf
elsewhere (q = 0 there), so verification stays lossless. N >= V (or 0) means the whole vocabulary.

Loss: speculators' ``kl_div_loss``, the forward KL from the target's distribution renormalized over the draft
vocabulary to the draft's: (:func:`spire.training.losses.kl_loss_logp`, default_loss "kl").

Beyond EAGLE-3 (off by default): a sink + window view of the draft's KV cache (``Eagle3Config.window``), in
training and inference. Out of scope: tree drafting (EAGLE's dynamic draft tree; spire's round loop drafts a
chain of k tokens), several decoder layers (speculators' ``num_hidden_layers`` > 1), a trained embedding
(``embed_requires_grad``), and sliding-window draft layers read from a speculators config: refused by name.

speculators format (:func:`export_speculators`, :func:`load_speculators`): config.json with
``speculators_model_type`` "eagle3", ``speculators_version``, ``speculators_config`` (algorithm, greedy proposal
method, verifier), ``transformer_layer_config`` (an HF Llama or Qwen3 config of the one layer),
``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` and the norm flags; weights in
``model.safetensors`` under speculators' names (``fc.weight``, ``layers.0.self_attn.q_proj.weight``,
``layers.0.hidden_norm.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, ``embed_tokens.weight``).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
from safetensors.torch import save_file

from spire import __version__, defaults, fastpath
from spire.drafts.base import Draft
from spire.formats.draft_file import (DRAFT_KIND_NAMES, FORMAT_VERSION, draft_file_kind, read_draft_file, settings_diff,
                                     warn_if_unfinished, write_draft_file)
from spire.formats.draft_file import fingerprint as _fingerprint
from spire.formats.draft_file import fingerprint_matches as _fingerprint_matches
from spire.formats.speculators import verifier_config
from spire.registry import DraftImpl
from spire.drafts.vocab import DraftVocabulary, frequent_tokens
from spire.errors import CheckpointError, ConfigError, TokenizerMismatchError
from spire.kv_cache import KVCache, SinkWindow, Span, attention_mask
from spire.loading import check_finite, load_state_dict
from spire.model import MLP, Attention, ForwardOutput, ModelConfig, RMSNorm, Transformer
from spire.paths import replace_dir
from spire.rope import rope_cos_sin

SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose Eagle3 format :func:`export_speculators` writes (and tests/test_eagle3.py checks
against)."""

SPECULATORS_READS = ((0, 1), (0, 9))
"""speculators_version range (major, minor), both ends included, whose Eagle3 folders :func:`load_speculators`
reads; another version is refused (its format has not been checked)."""

LAYER_TYPES = ("llama", "qwen3")
"""``transformer_layer_config.model_type`` values of speculators' Eagle3 (``model_definitions.model_classes``)."""

_NONE = -(1 << 40)  # a position no step was taken at


class DraftTargetMismatchError(TokenizerMismatchError, CheckpointError):
    """An EAGLE-3 draft made for another target (hidden size, vocabulary, embedding or fingerprint): both a
    :class:`TokenizerMismatchError` (as spire reports a draft of another target) and a :class:`CheckpointError`."""


# ---------------------------------------------------------------------------------------------- config

def default_layer_ids(n_target_layers: int) -> tuple[int, ...]:
    """speculators' default target layers for an n-layer target: (2, n // 2, n - 3)."""
    n = n_target_layers
    return (2, n // 2, n - 3)


@dataclass
class Eagle3Config:
    """Settings of an EAGLE-3 draft.

    layers: target layer ids whose input residual streams the draft fuses (module docstring); None: speculators'
        default (2, n // 2, n - 3). Ids in [0, n], distinct; n = the final residual stream before the final norm.
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


# ---------------------------------------------------------------------------------------------- the model

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


class Eagle3DraftModel(DraftVocabulary, nn.Module):
    """Trainable EAGLE-3 draft weights bound to a frozen target (its embedding; the fingerprint its files record).
    Implements :class:`spire.drafts.base.TrainableDraft` (kind "eagle3").

    Submodules (speculators' names): ``fc``, ``layers[0]`` (:class:`Eagle3Layer`), ``norm``, ``lm_head`` (N, d),
    ``input_norm`` (norm_before_fc) or ``fc_norm`` (fc_norm); buffer ``vocab`` (N,) int64 target ids of the head's
    columns (absent for the whole vocabulary).
    """

    kind, default_loss, export_name = "eagle3", "kl", "eagle3"
    config_class = Eagle3Config

    def __init__(self, target: Transformer, cfg: Eagle3Config | None = None, vocab: torch.Tensor | None = None,
                 layer_cfg: ModelConfig | None = None) -> None:
        """``vocab``: the N target ids of a draft vocabulary (a placeholder 0..N-1 when None, for a model whose
        state is loaded next). ``layer_cfg``: the decoder layer's shape (default :func:`draft_layer_config`).
        Fresh weights: Linear normal(0, 0.02) (HF's initializer_range), norms 1, the final norm the target's, the
        head the target's unembedding rows. Raises ConfigError for settings that cannot be built for ``target``
        or a malformed ``vocab``."""
        super().__init__()
        cfg = Eagle3Config() if cfg is None else cfg
        tc = target.cfg
        V, d = tc.vocab_size, tc.d_model
        cfg.validate(tc.n_layers, V)
        layer_cfg = draft_layer_config(tc) if layer_cfg is None else layer_cfg
        if layer_cfg.d_model != d or layer_cfg.vocab_size != V:
            raise ConfigError(f"the draft layer is shaped for hidden size {layer_cfg.d_model} and vocabulary "
                              f"{layer_cfg.vocab_size}, the target has {d} and {V}")
        self.cfg, self.layer_cfg = cfg, layer_cfg
        self.layer_ids = cfg.layer_ids(tc.n_layers)
        N = cfg.vocab_columns(V)
        self.set_vocab(N, vocab, target)
        n_aux = len(self.layer_ids)
        self.fc = nn.Linear(n_aux * d, d, bias=False)
        self.input_norm = RMSNorm(n_aux * d, layer_cfg.rms_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(d, layer_cfg.rms_eps) for _ in range(n_aux)) if cfg.fc_norm else None
        self.layers = nn.ModuleList([Eagle3Layer(layer_cfg)])
        self.norm = RMSNorm(d, layer_cfg.rms_eps)
        self.lm_head = nn.Linear(d, V if N is None else N, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
            self.norm.weight.copy_(target.model.norm.scale().detach().float())
            w = target.lm_head.weight.detach().float()
            self.lm_head.weight.copy_(w if N is None else w[self.vocab.to(w.device)])
        self.to(device=target.device)
        self.requires_grad_(True)
        self.lm_head.requires_grad_(cfg.train_head)
        object.__setattr__(self, "target", target)  # not a submodule: shared, frozen, never saved
        self.view = None if cfg.window is None else SinkWindow(cfg.sink, cfg.window)
        self.rope_spec = layer_cfg.rope_of(0)

    # -- pieces shared by training and inference --------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) target token ids -> (B, T, d) through the target's frozen embedding."""
        return self.target.model.embed_tokens(tokens)

    def rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """pos (B, T) -> cos, sin (B, 1, T, D) of the draft layer's RoPE."""
        return rope_cos_sin(pos, self.layer_cfg.d_head, self.rope_spec, dtype)

    def _linear(self, x: torch.Tensor, lin: nn.Linear, role: str) -> torch.Tensor:
        if fastpath.needs_autograd((lin,), x):
            return lin(x)
        return fastpath.linear(x, (lin,), self, role)

    def fuse(self, hidden: Sequence[torch.Tensor]) -> torch.Tensor:
        """The target's residual streams (B, T, d) at :attr:`layer_ids`, in that order -> the fused feature g
        (B, T, d) = fc(cat(...)) (after input_norm / fc_norm when set)."""
        h = torch.cat(list(hidden), -1)  # (B, T, n_aux·d)
        if self.input_norm is not None:
            h = self.input_norm(h)
        if self.fc_norm is not None:
            h = torch.cat([norm(c) for norm, c in zip(self.fc_norm, h.chunk(len(self.fc_norm), -1))], -1)
        return self._linear(h, self.fc, "fc")

    def feed_back(self, z: torch.Tensor) -> torch.Tensor:
        """The feature a drafted position hands the next one: its layer output z (B, T, d), normed with
        norm_output."""
        return self.norm(z) if self.cfg.norm_output else z

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """Layer outputs (B, T, d) -> float32 logits (B, T, N) through the final norm and the head."""
        return fastpath.unembed(self.norm(z), self.lm_head, self)

    def d2t_t2d(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """speculators' vocabulary maps: d2t (N,) int64 with target_id = i + d2t[i], t2d (V,) bool; None for the
        whole vocabulary."""
        if self.vocab is None:
            return None
        ids = self.vocab.cpu()
        t2d = torch.zeros(self.target.cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        return ids - torch.arange(len(ids)), t2d

    # -- training: test-time training over chunks of k ---------------------------------------------------
    def train_logits(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], k: int) -> torch.Tensor:
        """Teacher-forced logits as inference computes them (module docstring).

        Args:
            tokens: (B, T) token ids, T a multiple of k.
            hidden: target layer j -> (B, T, d) residual stream entering it, for every id of :attr:`layer_ids`.
            k: speculation depth (draft tokens per round).
        Returns:
            (B, T, N) float32 logits; position t predicts token t + 1, computed as the (t mod k)-th drafted step
            of the chain that starts at t - (t mod k).
        Raises:
            ConfigError: T not a multiple of k.
        Static shapes only (torch.compile), bf16 autocast safe.
        """
        B, T = tokens.shape
        if T % k:
            raise ConfigError(f"training sequence length {T} must be a multiple of k={k}")
        nb, dev, dtype = T // k, tokens.device, self.target.dtype
        layer, nbr = self.layers[0], self.cfg.norm_before_residual
        pos = torch.arange(T, device=dev)  # (T,)
        emb = self.embed(tokens)  # (B, T, d)
        g = self.fuse([hidden[j] for j in self.layer_ids])  # (B, T, d) fused target features
        prev = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], 1)  # (B, T, d): position t reads g_{t-1}
        u0, r0 = layer.inputs(emb, prev, nbr)  # (B, T, 2d), (B, T, d): every position from target features
        cos_all, sin_all = self.rope(pos[None], dtype)  # (1, 1, T, D)
        k0, v0 = layer.kv(u0, cos_all, sin_all)  # (B, KV, T, D): what the cache holds for verified positions
        starts = pos[::k]  # (nb,) chain starts
        emb_b = emb.view(B, nb, k, -1)
        kd: list[torch.Tensor] = []  # keys/values of drafted passes 1.. (B, KV, nb, D) each
        vd: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []  # pass j's layer outputs (B, nb, d) at positions starts + j
        feature = None  # (B, nb, d) the previous pass's fed-back feature
        for j in range(k):
            if j == 0:
                u, res = u0.view(B, nb, k, -1)[:, :, 0], r0.view(B, nb, k, -1)[:, :, 0]  # (B, nb, 2d), (B, nb, d)
            else:
                u, res = layer.inputs(emb_b[:, :, j], feature, nbr)
            q_pos = starts + j  # (nb,)
            cos, sin = self.rope(q_pos[None], dtype)  # (1, 1, nb, D)
            mask = self._pass_mask(j, starts, pos)  # (1, 1, nb, T + j·nb)

            def kv_source(k_self, v_self, j=j):  # target-feature keys, then this chain's drafted keys
                if j == 0:
                    return k0, v0
                kd.append(k_self)
                vd.append(v_self)
                return torch.cat([k0.to(k_self.dtype), *kd], 2), torch.cat([v0.to(v_self.dtype), *vd], 2)
            z = layer(u, res, cos, sin, kv_source, mask)  # (B, nb, d)
            outs.append(z)
            feature = self.feed_back(z)
        z_all = torch.stack(outs, 2).reshape(B, T, -1)  # (B, nb, k, d) -> (B, T, d): position b·k + j
        return self.logits(z_all)

    def _pass_mask(self, j: int, starts: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Pass j's mask (1, 1, nb, T + j·nb) for chains starting at ``starts`` (nb,): the target-feature keys of
        positions <= the chain start (under the draft's rule, :func:`eagle3_mask`), then the drafted keys of passes
        1..j of the query's own chain."""
        q_pos = (starts + j)[None]  # (1, nb)
        m_target = eagle3_mask(q_pos, pos, self.view) & (pos[None, None, None, :] <= starts[None, None, :, None])
        if j == 0:
            return m_target
        nb = starts.shape[0]
        d_pos = torch.cat([starts + i for i in range(1, j + 1)])  # (j·nb,)
        chain = torch.arange(nb, device=starts.device)
        same = chain.repeat(j)[None, :] == chain[:, None]  # (nb, j·nb)
        m_draft = same[None, None] & eagle3_mask(q_pos, d_pos, self.view)
        return torch.cat([m_target, m_draft], -1)

    # -- persistence ------------------------------------------------------------------------------------
    def save(self, path: Path, extra: dict | None = None) -> None:
        """Write the weights and spire's metadata (configuration, target fingerprint, ``extra``) atomically to the
        .safetensors file ``path`` (:func:`spire.drafts.spire.write_draft_file`)."""
        meta = {"eagle3_config": self.cfg.to_dict(), "layer_config": self.layer_cfg.to_dict(),
                "target": _fingerprint(self.target), **(extra or {})}
        write_draft_file(path, self.state_dict(), meta)

    @classmethod
    def load(cls, path: Path, target: Transformer) -> "Eagle3DraftModel":
        """A draft written by :meth:`save` for ``target``. Raises CheckpointError (missing, unreadable, not an
        EAGLE-3 draft, unknown settings, tensors that do not fit) or TokenizerMismatchError (another target)."""
        meta, state = read_draft_file(path, target)
        if "eagle3_config" not in meta:
            kind = draft_file_kind(meta)
            hint = f": it is {DRAFT_KIND_NAMES[kind]} draft, give it with --draft {kind}" if kind else ""
            raise CheckpointError(f"{path} is not an EAGLE-3 draft checkpoint (no eagle3_config in its metadata)"
                                  f"{hint}")
        try:
            cfg = Eagle3Config.from_dict(meta["eagle3_config"])
            layer_cfg = ModelConfig(**meta["layer_config"])
            model = cls(target, cfg, state.get("vocab"), layer_cfg)
        except (ConfigError, TypeError, KeyError) as e:
            raise CheckpointError(f"draft {path} has an unusable configuration: {e}") from None
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise CheckpointError(f"draft {path} does not fit its own configuration: "
                                  f"{' '.join(str(e).split())[:400]}") from None
        return model.to(target.dtype)

    # -- the training interface (spire.drafts.base.TrainableDraft) ----------------------------------------
    @classmethod
    def for_training(cls, target: Transformer, cfg, data=None) -> "Eagle3DraftModel":
        """A fresh draft for the TrainConfig ``cfg``: its ``draft_config`` (:class:`Eagle3Config`; the defaults
        when it has none), weights drawn after ``torch.manual_seed(cfg.seed)``, the draft vocabulary from the
        training text's counts (``data.train.tokens``). Raises ConfigError."""
        e3 = getattr(cfg, "draft_config", None) or Eagle3Config()
        torch.manual_seed(getattr(cfg, "seed", 0))
        e3.validate(target.cfg.n_layers, target.cfg.vocab_size)
        vocab = None
        N = e3.vocab_columns(target.cfg.vocab_size)
        if N is not None:
            tokens = getattr(getattr(data, "train", None), "tokens", None)
            if tokens is None:
                raise ConfigError("a draft vocabulary is chosen from the training text's token counts: this data "
                                  "source has none (data.train.tokens); set Eagle3Config.draft_vocab = 0")
            vocab = frequent_tokens(tokens, N, target.cfg.vocab_size)
        return cls(target, e3, vocab)

    def target_layers(self) -> tuple[int, ...]:
        return tuple(self.layer_ids)

    def save_checkpoint(self, path: Path, target: Transformer, meta: dict) -> None:
        self.save(path, meta)

    def load_checkpoint(self, path: Path, target: Transformer) -> None:
        loaded = type(self).load(path, target)
        if loaded.cfg.to_dict() != self.cfg.to_dict():
            raise CheckpointError(f"draft {path} has other EAGLE-3 settings than the run: "
                                  f"{settings_diff(loaded.cfg.to_dict(), self.cfg.to_dict())}")
        if (self.vocab is None) != (loaded.vocab is None):
            raise CheckpointError(f"draft {path} has another draft vocabulary size than the run")
        self.load_state_dict(loaded.state_dict())

    def export(self, out_dir: Path, target: Transformer, meta: dict, target_folder: Path | None = None) -> Path:
        """``eagle3/`` in the run folder: a speculators folder (:func:`export_speculators`; the verifier's
        name_or_path is ``target_folder`` when given; k from ``meta["k"]``, else spire's default; the embedding is
        left to the verifier's unless the target scales it; a sink + window draft is written with its view in the
        ``spire`` section)."""
        folder = Path(out_dir) / self.export_name
        return export_speculators(self, folder, target, k=int(meta.get("k", defaults.K)),
                                  verifier_name_or_path=None if target_folder is None else str(target_folder),
                                  meta=meta, embed_tokens=target.cfg.embed_scale != 1.0, allow_extensions=True)

    def as_draft(self) -> "Eagle3Draft":
        return Eagle3Draft(self)


# ---------------------------------------------------------------------------------------------- inference

class Eagle3Draft(Draft):
    """The round loop's EAGLE-3 draft (:mod:`spire.engine.runner`): a chain of k tokens per round.

    State per generation (:meth:`start`): a dense :class:`KVCache` of the one layer (B, KV, max_len, D), the fused
    target feature of every position (B, max_len, d), the previous step's fed-back feature (B, 1, d) and the
    position it was drafted at per row. The cache invariant of :mod:`spire.engine.prefill` holds: :meth:`observe`
    (prefill and verify) writes the keys/values and features of the positions the target ran, :meth:`step`
    writes its position's keys/values before its query reads, and a query reads positions <= its own, so the
    entries of rejected tokens and padding are overwritten before anything reads them.
    """

    name = "eagle3"

    def __init__(self, model: Eagle3DraftModel) -> None:
        self.model = model
        self.hidden_layers = tuple(model.layer_ids)
        self._cache: KVCache | None = None
        self._feat: torch.Tensor | None = None  # (B, max_len, d) fused target feature g_t per position
        self._own: torch.Tensor | None = None  # (B, 1, d) the last step's fed-back feature
        self._chain: torch.Tensor | None = None  # (B,) position of the last step since the last observe

    def start(self, target: Transformer, target_cache: KVCache, batch_size: int, max_len: int, k: int) -> None:
        m = self.model
        t = target.cfg
        if t.vocab_size != m.target.cfg.vocab_size or t.d_model != m.target.cfg.d_model:
            raise TokenizerMismatchError(f"the EAGLE-3 draft was made for a target of vocabulary "
                                         f"{m.target.cfg.vocab_size} and hidden size {m.target.cfg.d_model}; this "
                                         f"target has {t.vocab_size} and {t.d_model}")
        lc, dev, dtype = m.layer_cfg, target.device, target.dtype
        self._cache = KVCache(1, batch_size, lc.n_kv_heads, max_len, lc.d_head, dtype=dtype, device=dev)
        self._feat = torch.zeros(batch_size, max_len, t.d_model, dtype=dtype, device=dev)
        self._own = torch.zeros(batch_size, 1, t.d_model, dtype=dtype, device=dev)
        self._chain = torch.full((batch_size,), _NONE, dtype=torch.int64, device=dev)
        self._full = (self._cache, self._feat)

    def use_rows(self, n: int) -> bool:
        """Rows [0, n) of its cache and features (views); the chains (reset by every observe) restart."""
        cache, feat = self._full
        self._cache, self._feat = cache.narrow(n), feat[:n]
        self._own = torch.zeros(n, 1, feat.shape[-1], dtype=feat.dtype, device=feat.device)
        self._chain = torch.full((n,), _NONE, dtype=torch.int64, device=feat.device)
        return True

    def _target_feature(self, pos: torch.Tensor) -> torch.Tensor:
        """(B,) positions p -> (B, d) the fused target feature kept for p - 1 (zeros at p = 0)."""
        rows = torch.arange(len(pos), device=pos.device)
        f = self._feat[rows, (pos - 1).clamp_min(0)]
        return f * (pos > 0)[:, None].to(f.dtype)

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Forget rows ``rows`` (R,): their chains end; their cache entries and features are rewritten by the new
        request's prefill and rounds before any step reads them (positions <= its own, written first)."""
        self._chain[rows.to(self._chain.device)] = _NONE

    def _observe_rows(self, rows: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
                      target_out: ForwardOutput) -> None:
        """:meth:`observe` of rows ``rows`` only: on a sub-batch of the cache and features, written back."""
        cache, feat = self._cache, self._feat
        self._cache, self._feat = cache.take_rows(rows), feat[rows]
        try:
            hidden = {j: h[rows] for j, h in target_out.hidden.items()}
            self.observe(tokens[rows], pos[rows], ForwardOutput(hidden=hidden, compute_logits=lambda: None))
        finally:
            cache.put_rows(rows, self._cache)
            feat[rows] = self._feat
            self._cache, self._feat = cache, feat

    @torch.no_grad()
    def observe(self, tokens: torch.Tensor, pos: torch.Tensor, target_out: ForwardOutput,
                valid: torch.Tensor | None = None, span: Span | None = None) -> None:
        """Catch-up after a prefill or verify: tokens, pos (B, T) (each row's positions contiguous); keys/values of
        (x_t, g_{t-1}) into the cache and the fused features g_t kept, for every position (padding included: it
        lies past the committed length). The next step starts a new chain from the target's features. With
        ``valid`` (B, T), rows without a valid token are left untouched (other requests while one joins)."""
        if valid is not None and not bool(valid.any(1).all()):
            self._observe_rows(valid.any(1).nonzero()[:, 0], tokens, pos, target_out)
            return
        m = self.model
        layer = m.layers[0]
        B, T = tokens.shape
        dtype = self._feat.dtype
        g = m.fuse([target_out.hidden[j].to(dtype) for j in m.layer_ids])  # (B, T, d)
        before = self._target_feature(pos[:, 0])[:, None]  # (B, 1, d): g of the position before the first
        prev = torch.cat([before, g[:, :-1]], 1)  # (B, T, d)
        u, _ = layer.inputs(m.embed(tokens), prev, m.cfg.norm_before_residual)  # (B, T, 2d)
        cos, sin = m.rope(pos, u.dtype)  # (B, 1, T, D)
        k, v = layer.kv(u, cos, sin)  # (B, KV, T, D)
        self._cache.write(0, pos, k, v, span=span)
        rows = torch.arange(B, device=pos.device)[:, None].expand(B, T)
        self._feat[rows, pos] = g.to(dtype)
        self._chain.fill_(_NONE)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor, span: Span | None = None) -> torch.Tensor:
        """tokens, pos (B, 1) -> float32 logits (B, V) over the target's vocabulary (-inf outside a draft vocabulary)
        for position pos + 1. The feature read is the draft's own from the previous step when that step was at
        pos - 1 since the last observe, else the target's fused feature of pos - 1."""
        m = self.model
        layer = m.layers[0]
        p = pos[:, 0]  # (B,)
        own = (self._chain == p - 1)[:, None, None]  # (B, 1, 1)
        feature = torch.where(own, self._own, self._target_feature(p)[:, None])  # (B, 1, d)
        u, res = layer.inputs(m.embed(tokens), feature, m.cfg.norm_before_residual)  # (B, 1, 2d), (B, 1, d)
        cos, sin = m.rope(pos, u.dtype)
        access = fastpath.CacheAccess(self._cache, pos, m.view, span)
        mask = eagle3_mask(pos, access.key_pos, m.view)  # (B, 1, 1, S)
        if access.mask is not None:
            mask = mask & access.mask

        def kv_source(k, v):  # this position's key/value into the cache, then everything up to it
            access.write(0, k, v)
            return access.read(0)
        z = layer(u, res, cos, sin, kv_source, mask)  # (B, 1, d)
        self._own = m.feed_back(z)
        self._chain = p.clone()
        return m.to_target_vocab(m.logits(z)[:, -1])


# ---------------------------------------------------------------------------------------------- speculators format

def _layer_hf_config(layer_cfg: ModelConfig) -> dict:
    """``transformer_layer_config`` of the draft layer: an HF LlamaConfig (Qwen3Config with q/k norms) as
    speculators serializes it (``to_diff_dict``)."""
    import transformers as tf

    c = layer_cfg
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff, num_hidden_layers=1,
              num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.d_head,
              rms_norm_eps=c.rms_eps, max_position_embeddings=c.max_positions, tie_word_embeddings=False,
              bos_token_id=c.bos_id, eos_token_id=(c.eos_ids[0] if len(c.eos_ids) == 1 else (c.eos_ids or None)),
              rope_parameters=dict(c.rope_of(0)), hidden_act="silu")
    if c.family == "qwen3":
        if c.qkv_bias or c.mlp_bias:
            raise ConfigError("a Qwen3 draft layer with biases has no speculators equivalent")
        return tf.Qwen3Config(**kw, attention_bias=False).to_diff_dict()
    return tf.LlamaConfig(**kw, attention_bias=bool(c.qkv_bias), mlp_bias=bool(c.mlp_bias)).to_diff_dict()


def speculators_state(model: Eagle3DraftModel, target: Transformer | None = None, embed_tokens: bool = True
                      ) -> dict[str, torch.Tensor]:
    """The draft's tensors under speculators' names (float32, contiguous): its state without ``vocab``, plus
    ``d2t`` / ``t2d`` for a draft vocabulary and, when ``embed_tokens``, ``embed_tokens.weight``: the target's
    embedding rows as the draft reads them (times the target's embedding scale, Gemma's sqrt(d), so that a reader's
    plain nn.Embedding gives the same vectors)."""
    target = model.target if target is None else target
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items() if k != "vocab"}
    maps = model.d2t_t2d()
    if maps is not None:
        sd["d2t"], sd["t2d"] = maps
    if embed_tokens:
        sd["embed_tokens.weight"] = _embedding_rows(target).contiguous()
    return sd


def _embedding_rows(target: Transformer) -> torch.Tensor:
    """(V, d) float32: the target's embedding of every token, scale included."""
    emb = target.model.embed_tokens
    with torch.no_grad():
        return emb(torch.arange(emb.num_embeddings, device=emb.weight.device)).detach().float().cpu()


def speculators_writer(model: Eagle3DraftModel, target: Transformer | None = None, *, k: int = defaults.K,
                       verifier_name_or_path: str | None = None, meta: dict | None = None, embed_tokens: bool = True,
                       allow_extensions: bool = False):
    """The writer ``write(folder)`` of :func:`export_speculators` (config.json and model.safetensors into an empty
    folder), the form :func:`spire.export.export_draft` takes from a kind. Arguments and errors as
    :func:`export_speculators` (but for ``out_dir``)."""
    target = model.target if target is None else target
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    if model.view is not None and not allow_extensions:
        raise ConfigError("this EAGLE-3 draft reads a sink + window view of its cache (beyond EAGLE-3): "
                          "speculators has no such draft (allow_extensions=True writes it anyway)")
    if target.cfg.embed_scale != 1.0 and not embed_tokens:
        raise ConfigError(f"the target scales its embedding (x {target.cfg.embed_scale:g}, {target.cfg.family}) and "
                          "speculators' Eagle3 embedding has no scale: export the scaled rows (embed_tokens=True)")
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        tf_version = None
    c, lc = model.cfg, model.layer_cfg
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier_config(target, verifier_name_or_path)},
        "transformer_layer_config": _layer_hf_config(lc),
        "draft_vocab_size": model.n_vocab,
        "target_hidden_size": target.cfg.d_model,
        "eagle_aux_hidden_state_layer_ids": list(model.layer_ids),
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "transformers_version": tf_version,
        "spire_format_version": FORMAT_VERSION,
        "spire": {"spire_version": __version__, "k": k, "eagle3_config": c.to_dict(), "layer_config": lc.to_dict(),
                  "training": meta or {}},
    }
    tensors = speculators_state(model, target, embed_tokens)

    def write(tmp: Path) -> None:
        save_file(tensors, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    return write


def export_speculators(model: Eagle3DraftModel, out_dir: str | Path, target: Transformer | None = None, *,
                       k: int = defaults.K, verifier_name_or_path: str | None = None, meta: dict | None = None,
                       embed_tokens: bool = True, allow_extensions: bool = False) -> Path:
    """Write ``model`` as a speculators Eagle3 folder (module docstring) at ``out_dir``, replaced atomically
    (:func:`spire.paths.replace_dir`): config.json and model.safetensors (float32), loadable by speculators'
    ``Eagle3DraftModel.from_pretrained``, vLLM and :func:`load_speculators`. config.json also holds
    ``spire_format_version`` (so spire's tools see a spire export), the verifier's spire fingerprint
    (``speculators_config.verifier.spire_fingerprint``) and a ``spire`` section (the Eagle3Config, the layer's
    ModelConfig, k, ``meta``).

    Args:
        model: the draft; target: its target (default ``model.target``).
        k: speculative_tokens of the greedy proposal method (speculators knows no other proposal type).
        verifier_name_or_path: the verifier's HF id or folder (speculators loads it when set), else null.
        embed_tokens: also store the target's embedding rows, scale included (speculators' own saves do; optional
            for readers that load the verifier's, required for a target that scales its embedding).
        allow_extensions: write a draft with spire's sink + window view too (speculators and vLLM would run it with
            a full cache; spire reads the view back); otherwise such a draft is refused.
    Returns: ``out_dir``.
    Raises:
        ConfigError: k < 1; a draft beyond the format (a view without allow_extensions; a target whose embedding
            is scaled, Gemma, without embed_tokens); ``out_dir`` is a file or a non-empty folder that is not a
            speculators folder.
    """
    out = Path(out_dir)
    if out.is_file():
        raise ConfigError(f"{out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()):
        try:
            ours = "speculators_model_type" in json.loads((out / "config.json").read_text())
        except (OSError, ValueError):
            ours = False
        if not ours:
            raise ConfigError(f"{out} is a non-empty folder that is not a speculators folder; it would be replaced: "
                              "choose an empty or new folder")
    write = speculators_writer(model, target, k=k, verifier_name_or_path=verifier_name_or_path, meta=meta,
                               embed_tokens=embed_tokens, allow_extensions=allow_extensions)
    replace_dir(out, write)
    return out


_KNOWN_KEYS = {"architectures", "auto_map", "speculators_model_type", "speculators_version", "speculators_config",
               "transformer_layer_config", "draft_vocab_size", "target_hidden_size",
               "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
               "embed_requires_grad", "tie_word_embeddings", "dtype", "torch_dtype", "transformers_version",
               "spire_format_version", "spire", "model_type", "has_no_defaults_at_init"}
"""Top-level config.json keys of a speculators Eagle3 folder that :func:`load_speculators` reads or may ignore
(with PretrainedConfig's own keys); any other key that is set (not false, null, 0 or empty) is refused."""


_BASE_KEYS: set[str] | None = None


def _base_config_keys() -> set[str]:
    """The keys of transformers' PretrainedConfig.to_dict() (speculators' config is one)."""
    global _BASE_KEYS
    if _BASE_KEYS is None:
        from transformers import PretrainedConfig

        _BASE_KEYS = set(PretrainedConfig().to_dict())
    return _BASE_KEYS


def _check_version(folder: Path, version) -> None:
    m = re.match(r"^(\d+)\.(\d+)", str(version or ""))
    if m is None:
        raise CheckpointError(f"{folder}: config.json has no speculators_version (not written by speculators?)")
    have = (int(m.group(1)), int(m.group(2)))
    lo, hi = SPECULATORS_READS
    if not lo <= have <= hi:
        raise CheckpointError(f"{folder} was written by speculators {version}; spire reads Eagle3 folders of "
                              f"speculators {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}.x")


def _layer_config(folder: Path, tl: dict) -> ModelConfig:
    """The ModelConfig of a ``transformer_layer_config``, normalized by transformers' AutoConfig as spire reads
    a target's config.json. Raises CheckpointError for what spire's EAGLE-3 layer does not implement."""
    from transformers import AutoConfig

    if not isinstance(tl, dict):
        raise CheckpointError(f"{folder}: transformer_layer_config must be an object")
    family = tl.get("model_type") or "llama"
    if family not in LAYER_TYPES:
        raise CheckpointError(f"{folder}: a {family!r} draft layer is not implemented (spire reads "
                              f"{', '.join(LAYER_TYPES)}, as speculators' Eagle3)")
    if tl.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"{folder}: {tl.get('num_hidden_layers')} draft decoder layers (num_hidden_layers); "
                              "spire's EAGLE-3 draft has one")
    try:
        raw = {**AutoConfig.for_model(family, **{k: v for k, v in tl.items() if k != "model_type"}).to_dict(),
               "model_type": family}
        cfg = ModelConfig.from_hf(raw)
    except CheckpointError as e:
        raise CheckpointError(f"{folder}: its draft layer: {e}") from None
    except Exception as e:  # transformers validates the values
        raise CheckpointError(f"{folder}: transformers cannot read its transformer_layer_config: "
                              f"{type(e).__name__}: {e}".splitlines()[0]) from None
    if cfg.layer_windows is not None:
        raise CheckpointError(f"{folder}: a sliding-window draft layer (sliding_window {tl.get('sliding_window')}) "
                              "is not implemented")
    return cfg


def _same_embedding(stored: torch.Tensor, target: Transformer) -> bool:
    """Whether an embedding stored with a draft is the target's (rows times its scale), to bf16 rounding of either
    side."""
    w = _embedding_rows(target)
    s = stored.detach().float().cpu()
    if s.shape != w.shape:
        return False
    return bool(((s - w).abs() <= 2.0 ** -7 * w.abs().maximum(s.abs()) + 1e-6).all())


def _speculators_config(folder: Path, target: Transformer) -> tuple[Eagle3Config, ModelConfig]:
    """(draft settings, decoder layer config) of the speculators Eagle3 folder ``folder`` for ``target``, every
    config check of :func:`load_speculators` done (same errors)."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} holds no config.json (not a speculators folder)")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict) or "speculators_model_type" not in config:
        raise CheckpointError(f"{folder} is not a speculators folder (config.json has no speculators_model_type)")
    kind = config["speculators_model_type"]
    algorithm = (config.get("speculators_config") or {}).get("algorithm", kind)
    if kind != "eagle3" or algorithm != "eagle3":
        raise CheckpointError(f"{folder} holds a draft of algorithm {algorithm!r} (speculators_model_type "
                              f"{kind!r}), not an EAGLE-3 one")
    _check_version(folder, config.get("speculators_version"))
    base_keys = _base_config_keys()
    unknown = sorted(key for key, v in config.items()
                     if key not in _KNOWN_KEYS and key not in base_keys and not key.startswith("_")
                     and v not in (None, False, 0, "", [], {}))
    if unknown:
        raise CheckpointError(f"{folder}: config.json sets {', '.join(unknown)}, which spire's EAGLE-3 draft does not "
                              "implement")
    if config.get("embed_requires_grad"):
        raise CheckpointError(f"{folder}: embed_requires_grad (a trained draft embedding) is not implemented: spire's "
                              "EAGLE-3 draft reads the target's embedding")
    tc = target.cfg
    lc = _layer_config(folder, config.get("transformer_layer_config"))
    th = config.get("target_hidden_size")
    if lc.d_model != tc.d_model or th not in (None, tc.d_model):
        raise DraftTargetMismatchError(f"{folder} is a draft for a target of hidden size "
                                       f"{th if th not in (None, lc.d_model) else lc.d_model}; the target has "
                                       f"{tc.d_model}")
    if lc.vocab_size != tc.vocab_size:
        raise DraftTargetMismatchError(f"{folder} is a draft for a target vocabulary of {lc.vocab_size} tokens; the "
                                       f"target has {tc.vocab_size}")
    fp = ((config.get("speculators_config") or {}).get("verifier") or {}).get("spire_fingerprint")
    if isinstance(fp, dict) and not _fingerprint_matches(fp, target):
        raise DraftTargetMismatchError(f"{folder} was exported for target {fp}, but the target is "
                                       f"{_fingerprint(target)}")
    spire_section = config.get("spire") if isinstance(config.get("spire"), dict) else {}
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    try:
        base = Eagle3Config.from_dict(spire_section["eagle3_config"]) if "eagle3_config" in spire_section else None
        flags = {f: bool(config.get(f, False)) for f in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                           "norm_output")}
        e3 = Eagle3Config(**{**(base.to_dict() if base is not None else {}), **flags,
                             "layers": None if ids is None else tuple(int(j) for j in ids),
                             "draft_vocab": int(config.get("draft_vocab_size", tc.vocab_size))})
        e3.validate(tc.n_layers, tc.vocab_size)
    except ConfigError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    return e3, lc


def load_speculators(folder: str | Path, target: Transformer) -> Eagle3DraftModel:
    """The :class:`Eagle3DraftModel` of a speculators Eagle3 folder (written by speculators or by
    :func:`export_speculators`) for ``target``, in the target's dtype.

    Raises:
        CheckpointError: no or unreadable config.json / weights; another algorithm (speculators_model_type or
            speculators_config.algorithm not "eagle3"); a speculators_version outside :data:`SPECULATORS_READS`;
            a flag or layer spire does not implement (embed_requires_grad, several or sliding-window layers, a
            set key it does not know); inconsistent vocabulary maps; tensors that do not fit; NaN weights.
        DraftTargetMismatchError (a CheckpointError and a TokenizerMismatchError): a draft for another target
            (hidden size, vocabulary size, spire fingerprint, stored embedding).
    """
    folder = Path(folder)
    e3, lc = _speculators_config(folder, target)
    tc = target.cfg
    state = load_state_dict(folder)
    check_finite({k: v for k, v in state.items() if not k.startswith("verifier_")}, f"draft {folder}")
    emb = state.pop("embed_tokens.weight", None)
    if emb is None and tc.embed_scale != 1.0:
        raise CheckpointError(f"{folder} stores no embedding and the target scales its own ({tc.family}): which "
                              "rows the draft was trained on is unknown")
    if emb is not None and not _same_embedding(emb, target):
        raise DraftTargetMismatchError(f"{folder} stores an embedding that is not the target's: a draft for another "
                                       "target (or a trained embedding, which spire does not implement)")
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    for key in [key for key in state if key.startswith("verifier_")]:  # speculators' teacher copies (not saved)
        del state[key]
    N = e3.vocab_columns(tc.vocab_size)
    vocab = None
    if N is not None:
        if d2t is None or t2d is None:
            raise CheckpointError(f"{folder}: a draft vocabulary of {N} tokens needs the d2t and t2d tensors")
        if d2t.dim() != 1 or len(d2t) != N or t2d.dim() != 1 or len(t2d) != tc.vocab_size:
            raise CheckpointError(f"{folder}: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not fit "
                                  f"{N} draft and {tc.vocab_size} target tokens")
        vocab = torch.arange(N) + d2t.to(torch.int64)
        if (len(vocab.unique()) != N or bool((vocab < 0).any() | (vocab >= tc.vocab_size).any())
                or not torch.equal(t2d.to(torch.bool).nonzero().flatten(), vocab.sort().values)):
            raise CheckpointError(f"{folder}: d2t and t2d do not describe the same {N} distinct target tokens")
    try:
        model = Eagle3DraftModel(target, e3, vocab, lc)
    except ConfigError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    if vocab is not None:
        state["vocab"] = vocab
    try:
        model.load_state_dict({k: v.to(model.fc.weight.dtype) if v.is_floating_point() else v
                               for k, v in state.items()})
    except RuntimeError as e:
        raise CheckpointError(f"{folder}: its tensors do not fit an EAGLE-3 draft of its config: "
                              f"{' '.join(str(e).split())[:400]}") from None
    return model.to(target.dtype)


# ---------------------------------------------------------------------------------------------- the registry's entry

def resolve_path(path: str | Path) -> Path:
    """What ``--draft eagle3 --draft-path`` names: a speculators folder (config.json with speculators_model_type),
    a `spire train --draft eagle3` run folder (its ``eagle3/`` export; the run's checkpoint file when the export
    is missing), or a draft .safetensors checkpoint. Raises CheckpointError when nothing is there."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"draft not found: {p}")
    if p.is_file():
        if p.suffix != ".safetensors":
            raise CheckpointError(f"{p} is not an EAGLE-3 draft (a speculators folder, a `spire train --draft eagle3` "
                                  "run folder or a draft .safetensors)")
        return p
    if (p / "config.json").is_file():
        return p
    for inner in (p / Eagle3DraftModel.export_name, p / "checkpoint" / "draft.safetensors"):
        if inner.exists():
            return inner
    raise CheckpointError(f"{p} holds no EAGLE-3 draft (no config.json, {Eagle3DraftModel.export_name}/ or "
                          "checkpoint/draft.safetensors)")


def load_eagle3(path: str | Path, target: Transformer) -> Eagle3DraftModel:
    """The :class:`Eagle3DraftModel` at ``path`` (:func:`resolve_path`) for ``target``. Raises CheckpointError or
    TokenizerMismatchError."""
    src = resolve_path(path)
    return Eagle3DraftModel.load(src, target) if src.is_file() else load_speculators(src, target)


def load_draft(target: Transformer, path: str | Path | None = None, **_) -> Eagle3Draft:
    """``spire generate --draft eagle3 --draft-path PATH``: the inference draft (:func:`load_eagle3`); a run folder
    that has not finished gets a warning line. Raises ConfigError (no path), CheckpointError or
    TokenizerMismatchError."""
    if not path:
        raise ConfigError("--draft eagle3 needs --draft-path (a speculators folder, a `spire train --draft eagle3` "
                          "run folder or a draft .safetensors)")
    run = Path(path).expanduser()
    if run.is_dir() and (run / "checkpoint").exists():  # a `spire train` run folder
        warn_if_unfinished(run)
    return Eagle3Draft(load_eagle3(run, target).requires_grad_(False))  # frozen: decodes with kept copies


def _export(src: Path, target: Transformer, name_or_path: str, k: int):
    """The writer of ``spire export --draft eagle3``: the draft at ``src`` (:func:`resolve_path`) as a speculators
    folder (:func:`speculators_writer`, the verifier named ``name_or_path``)."""
    model = load_eagle3(src, target)
    return speculators_writer(model, target, k=k, verifier_name_or_path=name_or_path, allow_extensions=True)


KIND = DraftImpl(load=load_draft, model=Eagle3DraftModel, export=_export)
