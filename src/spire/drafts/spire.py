"""The SPIRe draft: Sparse KV cache, Pruned Initialization, Recurrent (feedback) memory.

SPIRe paper §3 (Neelam et al. 2025, arXiv 2504.06419):

1. Sparse attention: a StreamingLLM sink + window mask in training and inference; RoPE uses positions in
   the original text.
2. Pruned initialization: the draft is the target's embedding, a copy of its LAST n_d blocks and its
   unembedding. Draft layer i is initialized from target layer j = n_layers - n_d + i.
3. Feedback memory (Fan et al. 2020) per layer: draft layer i attends, with its own k/v projections (of its
   input norm), over memory vectors m_t^i = sum_l softmax_l(w_il) x_t^l, where x_t^l is the draft's
   activation of token t after draft layer l (l = 0 is the embedding) and w is (n_d, n_d + 1).
4. For the verified past, memory vectors are replaced by the target's activations: layer i uses the
   residual stream entering target layer j. Only drafted positions use the draft's own memory.

By default the current token also attends to its own key/value (computed from its layer input, as in a
normal block); every earlier position is read as a memory key/value. The embedding and unembedding are
shared with the target and frozen; the blocks, final norm and mixing logits are trained.

Ablation switches (paper Figure 5; :class:`SpireConfig`): ``feedback_memory=False`` (a drafted position's
memory is its own layer input, i.e. an ordinary KV cache), ``target_activations=False`` (with no feedback
memory: an ordinary pruned transformer that runs over the verified tokens itself), ``window=None`` (full KV
cache instead of sink + window), ``init="random"``, and ``self_attend=False`` (a drafted position reads
only earlier positions). The loss ablations (omega = 1, HardTargetLoss) live in the trainer.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

from spire import defaults, fastpath
from spire.backend import of as backend_of
from spire.drafts.base import Draft
from spire.drafts.vocab import VOCAB_FROM, DraftVocabulary, frequent_tokens, probable_tokens
from spire.formats.draft_file import (check_export, fingerprint, fingerprint_matches, read_draft_file, resolve_draft_path,
                                     run_finished, settings_diff, warn_if_unfinished, write_draft_file)
from spire.formats.speculators import spire_export_config
from spire.registry import DraftImpl
from spire.errors import CheckpointError, ConfigError
from spire.kv_cache import BaseKVCache, KVCache, RingKVCache, SinkWindow, Span, attention_mask, self_mask
from spire.model import ForwardOutput, RMSNorm, Transformer
from spire.paths import spire_cache_dir


INIT_KINDS = ("pruned", "random")
VOCAB_MASS_ROWS = 64
"""Training windows over which a vocab_from="mass" draft vocabulary sums the target's probabilities (16,384
positions at 256 tokens)."""

BRIDGE_FIT_ROWS = 32
"""Training windows the bridge is fitted on (:meth:`SpireDraftModel.fit_bridge`): 32 x 256 tokens through the
target (its forward only), for d² + d = 332 K numbers on SmolLM2 (a ridge fit)."""


@dataclass
class SpireConfig:
    """Architecture of a SPIRe draft.

    n_draft_layers: blocks pruned from the target (paper: 2 of 8; default here 8 of 30 ≈ 1/4 of the body
        parameters). layers: which target layers (default: the last n_draft_layers), in draft order.
    sink, window: the StreamingLLM view (tokens); window None = full KV cache (ablation).
    mix_init: initial softmax logit given to each layer's own input in w, so that at initialization a
        drafted token's memory is close to what the target layer would have read.
    init: "pruned" (copy the target's layers) or "random" (normal(0, 0.02), norms 1; ablation).
    feedback_memory / target_activations / self_attend: see the module docstring.
    vocab_size: draft vocabulary N (beyond the paper; EAGLE-3's d2t map): the draft's head covers N target
        token ids (the N most frequent in the training text, :func:`frequent_tokens`) and gives q = 0 to every
        other token; None = the target's whole vocabulary. Verification stays lossless (q is exactly the
        distribution drafts are drawn from); the head costs N/V of the full one in training and drafting.
    vocab_from: how those N ids are chosen: "frequency" (the N most frequent in the training text) or "mass" (the
        N with the largest target probability summed over VOCAB_MASS_ROWS training windows,
        :func:`probable_tokens`).
    feature_input: beyond the paper (EAGLE's feature input, Li et al. 2024): a drafted position's residual
        stream gets a learned projection of the previous position's feature, the residual stream
        entering the last draft layer: the target's (entering target layer ``source_layers[-1]``) when the
        previous position is verified, the draft's own when it was drafted. The projection starts at zero, so
        an untrained draft is the paper's. Needs target activations. The projection is added to the residual
        stream entering draft layer ``feature_layer`` (None: the first draft layer not copied from the same
        target depth, i.e. where a drafted position's shallow residual meets a deep target layer: 2 for
        target layers 0, 1, 24..29; 0 for the last layers). feature_from: the draft layer whose input residual
        is the feature (None: the last draft layer).
    bridge: beyond the paper: a learned affine map (d x d weights and a bias) on the residual stream entering
        the junction layer (:meth:`junction_layer`: the first draft layer not copied from the same target depth;
        2 for target layers 0, 1, 24..29, 0 for the last layers), applied before it at every position the draft
        computes. It starts as the identity (an untrained draft is the paper's); :meth:`SpireDraftModel.fit_bridge`
        sets it by ridge least squares from the target's residual stream at the junction's depth to the one
        entering the junction layer's source layer, on training text (the trainer does so for a pruned draft).
    """

    n_draft_layers: int = defaults.N_DRAFT_LAYERS
    sink: int = defaults.SINK
    window: int | None = defaults.WINDOW
    mix_init: float = 4.0
    layers: tuple[int, ...] | None = None
    init: str = "pruned"
    feedback_memory: bool = True
    target_activations: bool = True
    self_attend: bool = True
    vocab_size: int | None = None
    vocab_from: str = "frequency"
    feature_input: bool = False
    feature_layer: int | None = None
    feature_from: int | None = None
    bridge: bool = False

    def __post_init__(self) -> None:
        if self.layers is not None:
            self.layers = tuple(int(j) for j in self.layers)
            self.n_draft_layers = len(self.layers)

    def validate(self, n_target_layers: int, target_vocab_size: int | None = None) -> None:
        """Raise ConfigError for settings that cannot be built for a target of n_target_layers layers (and, when
        given, a vocabulary of target_vocab_size tokens)."""
        n_t = n_target_layers
        if not 1 <= self.n_draft_layers <= n_t:
            raise ConfigError(f"n_draft_layers must be in [1, {n_t}], got {self.n_draft_layers}")
        if self.layers is not None and (len(set(self.layers)) != len(self.layers)
                                        or any(not 0 <= j < n_t for j in self.layers)):
            raise ConfigError(f"draft layers must be distinct target layers in [0, {n_t - 1}], got {list(self.layers)}")
        if self.init not in INIT_KINDS:
            raise ConfigError(f"init must be one of {', '.join(INIT_KINDS)}, got {self.init!r}")
        if self.vocab_from not in VOCAB_FROM:
            raise ConfigError(f"the draft vocabulary is chosen by {' or '.join(VOCAB_FROM)} (--draft-vocab-from), "
                              f"got {self.vocab_from!r}")
        if self.vocab_from != "frequency" and self.vocab_size is None:
            raise ConfigError(f"--draft-vocab-from {self.vocab_from} chooses a draft vocabulary: give its size "
                              "(--draft-vocab N)")
        if self.window is not None and self.window < 1 or self.sink < 0:
            raise ConfigError(f"sink must be >= 0 and window >= 1 (or None), got {self.sink}, {self.window}")
        if not self.target_activations and self.feedback_memory:
            raise ConfigError("target_activations=False needs feedback_memory=False (the paper's ablation "
                              "'no feedback memory and no target activations'): feedback memory over the "
                              "draft's own past would make training sequential")
        if not self.target_activations and not self.self_attend:
            raise ConfigError("self_attend=False applies to the memory of target activations only")
        if self.feature_input and not self.target_activations:
            raise ConfigError("feature_input needs target activations (the previous position's feature is the "
                              "target's residual stream)")
        if self.feature_layer is not None and not 0 <= self.feature_layer < self.n_draft_layers:
            raise ConfigError(f"feature_layer must be a draft layer in [0, {self.n_draft_layers - 1}], got "
                              f"{self.feature_layer}")
        if self.feature_from is not None and not 0 <= self.feature_from < self.n_draft_layers:
            raise ConfigError(f"feature_from must be a draft layer in [0, {self.n_draft_layers - 1}], got "
                              f"{self.feature_from}")
        if self.bridge and self.source_layers(n_t)[self.junction_layer(n_t)] == self.junction_layer(n_t):
            raise ConfigError(f"a bridge needs a junction (a draft layer not copied from the same target depth): "
                              f"draft layers {list(self.source_layers(n_t))} have none")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ConfigError(f"the draft vocabulary must hold at least 1 token, got {self.vocab_size}")
        if self.vocab_size is not None and target_vocab_size is not None and self.vocab_size > target_vocab_size:
            raise ConfigError(f"the draft vocabulary ({self.vocab_size}) is larger than the target's "
                              f"({target_vocab_size})")

    def source_layers(self, n_target_layers: int) -> tuple[int, ...]:
        """Target layer j of each draft layer i."""
        if self.layers is not None:
            return self.layers
        return tuple(range(n_target_layers - self.n_draft_layers, n_target_layers))

    def junction_layer(self, n_target_layers: int) -> int:
        """The first draft layer i whose source layer is not target layer i: where the draft's residual stream
        (the target's own below it, at initialization) meets a target layer of another depth (0 if none)."""
        src = self.source_layers(n_target_layers)
        return next((i for i, j in enumerate(src) if j != i), 0)

    def resolved_feature_layer(self, n_target_layers: int) -> int:
        """The draft layer whose input receives the feature (see feature_layer)."""
        return self.junction_layer(n_target_layers) if self.feature_layer is None else self.feature_layer

    def to_dict(self) -> dict:
        """The JSON form; ``vocab_from`` only when it is not the default "frequency", so that the saved settings
        of runs from before the field existed read and write back unchanged."""
        d = asdict(self)
        d["layers"] = None if self.layers is None else list(self.layers)
        if d["vocab_from"] == "frequency":
            del d["vocab_from"]
        return d


class SpireDraftModel(DraftVocabulary, nn.Module):
    """Trainable SPIRe draft weights, bound to a (frozen) target for its embedding and unembedding.

    Raises ConfigError when n_draft_layers is not in [1, target layers].
    """

    def __init__(self, target: Transformer, cfg: SpireConfig | None = None, vocab: torch.Tensor | None = None
                 ) -> None:
        """``vocab``: the draft vocabulary's N target token ids when ``cfg.vocab_size`` is set (see
        :func:`frequent_tokens`; a placeholder is used when None, for a model whose state is loaded next).
        Raises ConfigError for settings that cannot be built for ``target`` or a malformed ``vocab``."""
        super().__init__()
        cfg = SpireConfig() if cfg is None else cfg
        V = target.cfg.vocab_size
        cfg.validate(target.cfg.n_layers, V)
        self.set_vocab(cfg.vocab_size, vocab, target)
        self._vocab_head: tuple[tuple, nn.Linear] | None = None
        self._mix: tuple[tuple, torch.Tensor] | None = None  # inference: softmax of mix_logits (memory)
        self.cfg = cfg
        self.source_layers = cfg.source_layers(target.cfg.n_layers)  # target layer j of draft layer i
        self.layers = nn.ModuleList(copy.deepcopy(target.layers[j]) for j in self.source_layers)
        self.norm = copy.deepcopy(target.model.norm)
        if cfg.init == "random":
            with torch.no_grad():
                for name, p in list(self.layers.named_parameters()) + list(self.norm.named_parameters()):
                    p.normal_(0.0, 0.02) if p.dim() == 2 else p.zero_() if name.endswith("bias") else p.fill_(1.0)
                for m in [*self.layers.modules(), self.norm]:  # unit norms where weights are offsets from 1 (Gemma)
                    if getattr(m, "offset", 0.0):
                        m.weight.fill_(1.0 - m.offset)
        n = cfg.n_draft_layers
        mix = torch.zeros(n, n + 1)
        mix[torch.arange(n), torch.arange(n)] = cfg.mix_init  # layer i's memory starts near its own input
        self.mix_logits = nn.Parameter(mix)
        if cfg.feature_input:  # zero projection: an untrained draft is the paper's
            d = target.cfg.d_model
            self.feature_norm = RMSNorm(d, target.cfg.rms_eps)
            self.feature_proj = nn.Linear(d, d, bias=False)
            nn.init.zeros_(self.feature_proj.weight)
            self.feature_layer = cfg.resolved_feature_layer(target.cfg.n_layers)
            self.feature_from = len(self.layers) - 1 if cfg.feature_from is None else cfg.feature_from
        else:
            self.feature_norm = self.feature_proj = self.feature_layer = self.feature_from = None
        if cfg.bridge:  # the identity: an untrained draft is the paper's (fit_bridge sets it from the target)
            d = target.cfg.d_model
            self.bridge = nn.Linear(d, d, bias=True)
            with torch.no_grad():
                self.bridge.weight.copy_(torch.eye(d))
                self.bridge.bias.zero_()
            self.bridge_layer = cfg.junction_layer(target.cfg.n_layers)
        else:
            self.bridge = self.bridge_layer = None
        self.bridge_r2: float | None = None  # the fit's R² (fit_bridge), when fitted here
        self.layers.requires_grad_(True)
        self.norm.requires_grad_(True)
        object.__setattr__(self, "target", target)  # not a submodule: shared, frozen, never saved
        self.view = None if cfg.window is None else SinkWindow(cfg.sink, cfg.window)

    # -- pieces shared by inference and training ---------------------------------------------------
    def rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.target.rope(pos, dtype)  # (R, B, 1, T, D): each draft layer reads its source layer's RoPE

    def head(self) -> nn.Linear:
        """The draft vocabulary's frozen head (N, d_model): rows ``vocab`` of the target's unembedding (rounded as
        the draft's own weights are: :func:`spire.fastpath.rounded_like`), rebuilt when either changes (a load,
        weight-only bf16 or int8). Not a submodule: never saved, derived from the target."""
        w, ids = self.target.lm_head.weight, self.vocab
        fmt = fastpath.bf16_weights(self), fastpath.int8_weights(self)  # every path the same rows
        key = (w.data_ptr(), w._version, w.dtype, ids.data_ptr(), ids._version, fmt)
        if self._vocab_head is None or self._vocab_head[0] != key:
            head = nn.Linear(w.shape[1], len(ids), bias=False, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                head.weight.copy_(fastpath.rounded_like(self, w[ids]))
            head.requires_grad_(False)
            self._vocab_head = (key, head)
            fastpath.forget(self)  # the new head may reuse the old one's address: no stale copy
        return self._vocab_head[1]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d_model) -> float32 logits (B, T, N) through the draft norm and the target's unembedding
        (restricted to the draft vocabulary when there is one: :meth:`to_target_vocab` maps them back)."""
        h = self.norm(x)
        if self.vocab is None:
            return self.target.unembed(h)
        return fastpath.unembed(h, self.head(), self)

    def enters(self, i: int) -> bool:
        """Whether draft layer i's input is changed before the layer (:meth:`layer_input`)."""
        return i == self.feature_layer or i == self.bridge_layer

    def layer_input(self, i: int, x: torch.Tensor, feature: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream (B, T, d) entering draft layer i: through the bridge at :attr:`bridge_layer`, then
        plus the projected feature (B, T, d) at :attr:`feature_layer` (:meth:`add_feature`)."""
        if i == self.bridge_layer:
            x = torch.nn.functional.linear(x, self.bridge.weight.to(x.dtype), self.bridge.bias.to(x.dtype))
        if i == self.feature_layer:
            x = self.add_feature(x, feature)
        return x

    @torch.no_grad()
    def fit_bridge(self, tokens: torch.Tensor, ridge: float = 1e-2, batch_size: int = 8) -> float:
        """Set the bridge by ridge least squares: over the (B, T) training windows ``tokens``, map the target's
        residual stream entering target layer J (J = :attr:`bridge_layer`, the depth the draft's own stream has
        there when its first J layers are target layers 0..J-1) to the one entering source layer
        ``source_layers[J]`` (W = (X'X + λ n I)^-1 X'Y over [x, 1], λ = ridge × mean(x²), in float64).
        Returns R² of the fit on those windows (1 - residual / total sum of squares). Raises ConfigError
        without a bridge."""
        if self.bridge is None:
            raise ConfigError("this draft has no bridge (SpireConfig.bridge)")
        J = self.bridge_layer
        src_in, dst = J, self.source_layers[J]
        d = self.target.cfg.d_model
        A = torch.zeros(d + 1, d + 1, dtype=torch.float64)
        XtY = torch.zeros(d + 1, d, dtype=torch.float64)
        Y_sum, Y_sq, n = torch.zeros(d, dtype=torch.float64), 0.0, 0
        for rows in tokens.split(batch_size):
            pos = torch.arange(rows.shape[1], device=rows.device)[None].expand_as(rows)
            h = self.target(rows, pos, hidden_layers=(src_in, dst)).hidden
            x, y = (h[j].double().reshape(-1, d).cpu() for j in (src_in, dst))
            x1 = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
            A += x1.T @ x1
            XtY += x1.T @ y
            Y_sum += y.sum(0)
            Y_sq += float(y.pow(2).sum())
            n += len(x)
        lam = ridge * float(A.diagonal()[:d].sum()) / (n * d)
        W = torch.linalg.solve(A + lam * n * torch.eye(d + 1, dtype=A.dtype), XtY)  # (d + 1, d)
        # residual sum of squares from the normal equations: Σ y² - 2 tr(W'X'Y) + tr(W'AW)
        rss = Y_sq - 2 * float((W * XtY).sum()) + float((W * (A @ W)).sum())
        tss = Y_sq - float(Y_sum.pow(2).sum()) / n
        self.bridge.weight.copy_(W[:d].T.to(self.bridge.weight.dtype))
        self.bridge.bias.copy_(W[d].to(self.bridge.bias.dtype))
        return 1.0 - rss / tss

    def add_feature(self, x: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """feature_input: the residual stream (B, T, d) entering draft layer :attr:`feature_layer`, plus the
        projected feature (B, T, d) of each position's previous position (zeros where there is none)."""
        return x + self.feature_proj(self.feature_norm(feature).to(x.dtype))

    def memory(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """Feedback memory. xs: n_d + 1 activations (B, T, d) -> (n_d, B, T, d), m^i = sum_l softmax(w_i)_l x^l.
        Without feedback memory, m^i = x^i (layer i's own input: an ordinary KV cache)."""
        if not self.cfg.feedback_memory:
            return torch.stack(xs[:-1])
        x = torch.stack(xs)  # (n_d + 1, B, T, d)
        # in training (its held-out evaluation too), and traced (nothing kept: its key reads a data pointer): the
        # logits as they are now
        if self.mix_logits.requires_grad or torch.compiler.is_compiling():
            w = self.mix_logits.softmax(-1).to(x.dtype)  # (n_d, n_d + 1), rows sum to 1
            return torch.einsum("il,lbtd->ibtd", w, x)
        # frozen (a draft step): the softmax kept while the logits are unchanged, one small matmul
        p = self.mix_logits
        key = (p.data_ptr(), p._version, x.dtype)
        if self._mix is None or self._mix[0] != key:
            with torch.no_grad():
                self._mix = (key, p.detach().softmax(-1).to(x.dtype))
        return (self._mix[1] @ x.reshape(x.shape[0], -1)).view(-1, *x.shape[1:])

    def memory_kv(self, i: int, m: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer i's keys/values (B, KV, T, D) of memory vectors m: (B, T, d)."""
        return self.layers[i].memory_kv(m, cos, sin)

    # -- training: the k-pass procedure of the paper's Figure 2 -------------------------------------
    def forward_train(self, tokens: torch.Tensor, target_hidden: dict[int, torch.Tensor], k: int,
                      match_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced draft logits for every position, as inference would produce them.

        The sequence is cut into blocks of k positions. For the block starting at position s (verified
        prefix = positions < s), pass j = 0..k-1 runs the queries at s + j of every block at once; each
        attends to target memory at positions < s (sink + window), to the draft memory made in passes
        < j of its own block, and to itself.

        Args:
            tokens: (B, T) token ids, T a multiple of k.
            target_hidden: target layer j -> (B, T, d) residual stream entering it, for every source layer.
            k: speculation depth.
            match_hidden: also return the hidden-state matching term (beyond the paper, see
                :meth:`hidden_mismatch`), averaged over every drafted position and draft layers 1..n_d - 1.
        Returns:
            (B, T, N) float32 logits (N: :attr:`n_vocab`); position t predicts token t + 1. With match_hidden,
            (logits, scalar float32 tensor).
        """
        B, T = tokens.shape
        if T % k:
            raise ConfigError(f"training sequence length {T} must be a multiple of k={k}")
        dev, dtype = tokens.device, self.target.dtype
        pos = torch.arange(T, device=dev)
        cos_all, sin_all = self.rope(pos[None], dtype)
        if match_hidden and (not self.cfg.target_activations or len(self.layers) < 2):
            raise ConfigError("hidden-state matching needs target activations and at least 2 draft layers")
        if not self.cfg.target_activations:  # an ordinary transformer: one causal pass is exact
            x = self.target.model.embed_tokens(tokens)
            mask = attention_mask(pos[None], pos, self.view)
            for i, layer in enumerate(self.layers):
                if self.enters(i):
                    x = self.layer_input(i, x)
                x = layer(x, cos_all, sin_all, lambda kk, vv: (kk, vv), mask)
            return self.logits(x)
        # target memory keys/values of every position, per draft layer: (B, KV, T, D); with chunks of G blocks
        # (a sliding window), each chunk's queries read only the keys its window can reach: (B·C, KV, Kt, D)
        G, C, key_pos, key_ok = self._chunks(T, k, dev)
        kt, vt = zip(*(self._chunk_keys(self.memory_kv(i, target_hidden[j], cos_all, sin_all), key_pos, C)
                       for i, j in enumerate(self.source_layers)))

        def group(t: torch.Tensor) -> torch.Tensor:  # (B, T/k, ...) -> (B·C, G, ...): chunks in the batch dim
            return t.reshape(B * C, G, *t.shape[2:])
        kd: list[list[torch.Tensor]] = [[] for _ in self.layers]  # draft memory of earlier passes
        vd: list[list[torch.Tensor]] = [[] for _ in self.layers]
        starts = torch.arange(0, T, k, device=dev)  # (T/k,) first position of each block
        outs: list[torch.Tensor] = []  # pass j's last hidden states (B, T/k, d), positions starts + j
        feature = None  # (B·C, G, d) the previous position's feature (feature_input)
        mismatch = torch.zeros((), device=dev)
        if self.feature_proj is not None:  # pass 0: the target's, entering draft layer feature_from, at s - 1
            h_last = target_hidden[self.source_layers[self.feature_from]]
            feature = group(torch.cat([torch.zeros_like(h_last[:, :1]), h_last[:, starts[1:] - 1]], 1))
        for j in range(k):
            q_pos = starts + j  # (T/k,)
            mask = self._pass_mask(j, starts.view(C, G), key_pos, key_ok)  # (C, 1, G, Kt + (j+1) G)
            cos, sin = self.rope(q_pos.view(C, G), dtype)  # (R, C, 1, G, D)
            if C > 1:  # rows b·C + c, each chunk its own mask and positions: tiled, not broadcast
                mask, cos, sin = mask.repeat(B, 1, 1, 1), cos.repeat(1, B, 1, 1, 1), sin.repeat(1, B, 1, 1, 1)
            x = group(self.target.model.embed_tokens(tokens[:, q_pos]))  # (B·C, G, d)
            xs = [x]
            for i, layer in enumerate(self.layers):
                if self.enters(i):
                    x = xs[i] = self.layer_input(i, x, feature)
                def kv_source(k_self, v_self, i=i):
                    return (torch.cat([kt[i], *kd[i], k_self], 2), torch.cat([vt[i], *vd[i], v_self], 2))
                x = layer(x, cos, sin, kv_source, mask)
                xs.append(x)
            if match_hidden:
                mismatch = mismatch + sum(
                    self.hidden_mismatch(xs[i], group(target_hidden[self.source_layers[i]][:, q_pos]))
                    for i in range(1, len(self.layers)))
            outs.append(x.view(B, T // k, -1))
            if self.feature_proj is not None:  # the next pass reads this position's feature: the draft's own
                feature = xs[self.feature_from]
            if j < k - 1:
                mem = self.memory(xs)  # (n_d, B·C, G, d)
                for i in range(len(self.layers)):
                    kk, vv = self.memory_kv(i, mem[i], cos, sin)
                    kd[i].append(kk)
                    vd[i].append(vv)
        # (B, T/k, k, d): block b's pass j is position b·k + j; one head matmul over every position
        out = self.logits(torch.stack(outs, 2).view(B, T, -1))
        if match_hidden:
            return out, mismatch / (k * (len(self.layers) - 1))
        return out

    def _chunks(self, T: int, k: int, dev: torch.device
                ) -> tuple[int, int, torch.Tensor, torch.Tensor | None]:
        """How the k-pass procedure groups its T/k blocks: (G blocks per chunk, C chunks, the target key positions
        each chunk reads (C, Kt), which of them are real (C, Kt) bool or None), Kt = sink + n_win. With a sliding
        window a chunk of G ≈ window / k blocks can reach only the sink and the n_win = k (G − 1) + window − 1
        positions from its first query's window start up to its last block's start (positions < 0 or inside the
        sink are marked unreal), so attention reads ~2·window target keys per query instead of T (and its own
        chunk's draft keys instead of every block's). Without a window, when one chunk would hold every block, or
        when a chunk would read as many keys as there are positions, C = 1 and every position is read. Masked
        keys weigh exactly 0, so the logits are the same either way (to float32 rounding; tests/test_spire_draft.py)."""
        nb = T // k
        G = nb
        if self.view is not None and backend_of(self).chunked_kpass:  # off: the dense layout (A/B timing)
            g = max(1, self.view.window // k)
            G = max(d for d in range(1, min(g, nb) + 1) if nb % d == 0)
        C = nb // G
        dense = nb, 1, torch.arange(T, device=dev)[None], None
        if C == 1:
            return dense
        w, sink = self.view.window, min(self.view.sink, T)  # a sink longer than T holds every position
        n_win = k * (G - 1) + w - 1  # window positions a chunk reads: its first query's window .. last start
        if sink + n_win >= T:  # chunks would read as many keys as the dense layout
            return dense
        raw = (torch.arange(C, device=dev) * G * k - w + 1)[:, None] + torch.arange(n_win, device=dev)
        sinks = torch.arange(sink, device=dev).expand(C, sink)
        key_pos = torch.cat([sinks, raw.clamp_min(0)], 1)  # raw < T always: the last chunk ends below T - k
        return G, C, key_pos, torch.cat([torch.ones_like(sinks, dtype=torch.bool), raw >= sink], 1)

    @staticmethod
    def _chunk_keys(kv: tuple[torch.Tensor, torch.Tensor], key_pos: torch.Tensor, C: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, KV, T, D) of every position -> each chunk's (B·C, KV, Kt, D) at ``key_pos``."""
        if C == 1:
            return kv
        B, KV, _, D = kv[0].shape
        flat = key_pos.reshape(-1)
        return tuple(t[:, :, flat].view(B, KV, C, -1, D).transpose(1, 2).reshape(B * C, KV, -1, D) for t in kv)

    def _pass_mask(self, j: int, starts: torch.Tensor, key_pos: torch.Tensor, key_ok: torch.Tensor | None
                   ) -> torch.Tensor:
        """Pass j's attention mask (C, 1, G, Kt + (j+1) G) for blocks starting at ``starts`` (C, G): target keys
        at ``key_pos`` (C, Kt) before the block start, inside the query's sink + window; then the draft memory of
        passes 0..j-1 and the pass's own key (self), of its own block only, inside the window."""
        q_pos = starts + j
        m_target = attention_mask(q_pos, key_pos, self.view)[:, 0] & (key_pos[:, None, :] < starts[:, :, None])
        if key_ok is not None:
            m_target = m_target & key_ok[:, None, :]
        d_pos = torch.cat([starts + jj for jj in range(j + 1)], 1)  # (C, (j+1) G)
        blocks = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
        m_draft = (blocks.repeat(1, j + 1)[:, None, :] == blocks[:, :, None]) & attention_mask(q_pos, d_pos,
                                                                                              self.view)[:, 0]
        if not self.cfg.self_attend:
            m_draft = m_draft & self_mask(q_pos, d_pos)
        return torch.cat([m_target, m_draft], -1)[:, None]

    @staticmethod
    def hidden_mismatch(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Beyond the paper: how far a drafted position's residual stream x (B, T, d) entering a draft layer is
        from the target's t (B, T, d) entering that layer's source layer at the same positions: the mean over
        positions of ||x - t||^2 / ||t||^2 (float32 scalar; 0 when they agree, 1 for x = 0). The deep blocks of a
        draft pruned from the target's first and last layers expect the target's deep residual stream; this term
        trains the shallow blocks and the memory attention to supply it (layer-skipping distillation of
        hidden states, as in Kangaroo, Liu et al. 2024, and EAGLE's feature regression, Li et al. 2024)."""
        x, t = x.float(), t.float()
        return ((x - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp_min(1e-6)).mean()

    # -- persistence ----------------------------------------------------------------------------------
    def save(self, path: Path, extra: dict | None = None) -> None:
        """Write weights (safetensors) and a JSON sidecar atomically to ``path`` (a .safetensors file)."""
        meta = {"spire_config": self.cfg.to_dict(), "target": fingerprint(self.target), **(extra or {})}
        write_draft_file(path, self.state_dict(), meta)

    @classmethod
    def load(cls, path: Path, target: Transformer) -> "SpireDraftModel":
        """Load a draft saved by :meth:`save` for ``target``.

        Raises CheckpointError (missing/unreadable, NaN or infinite weights, or a draft vocabulary with repeated or
        out-of-range ids) or TokenizerMismatchError (trained for another target).
        """
        meta, state = read_draft_file(path, target)
        try:
            cfg = SpireConfig(**meta["spire_config"])
        except TypeError as e:
            raise CheckpointError(f"draft {path} has an unknown configuration ({e}); was it written by a newer "
                                  "spire?") from None
        model = cls(target, cfg)
        vocab = state.get("vocab")
        if vocab is not None and (vocab.dtype != torch.int64 or vocab.dim() != 1):
            raise CheckpointError(f"draft {path}: its draft vocabulary must be a 1-D int64 tensor, got "
                                  f"{vocab.dtype} {tuple(vocab.shape)}")
        try:
            model.load_state_dict(state)
        except RuntimeError as e:  # missing / unexpected / mis-shaped tensors: a broken or foreign file
            raise CheckpointError(f"draft {path} does not fit its own configuration: "
                                  f"{' '.join(str(e).split())[:400]}") from None
        ids, V = model.vocab, target.cfg.vocab_size
        if ids is not None and (len(ids.unique()) != len(ids) or bool((ids < 0).any() | (ids >= V).any())):
            raise CheckpointError(f"draft {path}: its draft vocabulary must be distinct token ids in [0, {V})")
        return model.to(target.dtype)

    # -- the training interface (spire.drafts.base.TrainableDraft) ------------------------------------
    kind, default_loss, export_name = "spire", "mixed", "draft.safetensors"
    config_class = SpireConfig

    @classmethod
    def for_training(cls, target: Transformer, cfg, data=None) -> "SpireDraftModel":
        """A fresh draft of ``cfg.draft_config`` (a TrainConfig's :class:`SpireConfig`); with a draft vocabulary, the most frequent tokens of
        the training text (``data.train.tokens``), or with ``vocab_from="mass"`` those of largest target probability
        over VOCAB_MASS_ROWS training windows (``data.sample_train_batch``). Raises ConfigError."""
        torch.manual_seed(cfg.seed)  # the random-init ablation draws its weights here
        vocab = None
        sc = cfg.draft_config
        if sc.vocab_size is not None:
            tokens = getattr(getattr(data, "train", None), "tokens", None)
            if sc.vocab_from == "frequency" and tokens is None:
                raise ConfigError("a draft vocabulary is chosen from the training text's token counts: this data "
                                  "source has none (data.train.tokens)")
            if sc.vocab_from == "mass":
                windows = data.sample_train_batch(VOCAB_MASS_ROWS, cfg.seq_len, torch.Generator().manual_seed(cfg.seed))
                vocab = probable_tokens(target, windows, sc.vocab_size, bf16=bool(cfg.bf16))
            else:
                vocab = frequent_tokens(tokens, sc.vocab_size, target.cfg.vocab_size)
        return cls(target, sc, vocab)

    def start_training(self, data, cfg) -> dict | None:
        """Before a fresh run's first step (not on a resume, whose checkpoint holds the trained bridge): fit the
        bridge of a pruned draft to the target on BRIDGE_FIT_ROWS training windows of cfg.seq_len tokens (seeded by
        cfg.seed). Returns {"event": "bridge", "layer", "r2"} for the run's log (R² in-sample, on those windows) with
        "message", the line to show, or None when there is nothing to fit (no bridge, or a random draft, whose
        stream is not the target's).
        Raises ConfigError when ``data`` cannot sample training windows."""
        if self.bridge is None or self.cfg.init != "pruned":
            return None
        sample = getattr(data, "sample_train_batch", None)
        if sample is None:
            raise ConfigError("the bridge is fitted on training text (data.sample_train_batch): this data source "
                              "has none")
        rows = sample(BRIDGE_FIT_ROWS, cfg.seq_len, torch.Generator().manual_seed(cfg.seed))
        self.bridge_r2 = self.fit_bridge(rows.to(self.target.device))
        return {"event": "bridge", "layer": self.bridge_layer, "r2": self.bridge_r2,
                "message": f"bridge into draft layer {self.bridge_layer} fitted to the target (in-sample R² "
                           f"{self.bridge_r2:.3f})"}

    def target_layers(self) -> tuple[int, ...]:
        """The source layers when the draft reads target activations, else () (the target need not run)."""
        return self.source_layers if self.cfg.target_activations else ()

    def train_logits(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], k: int,
                     match_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The k-pass procedure (:meth:`forward_train`)."""
        return self.forward_train(tokens, hidden, k, match_hidden)

    def save_checkpoint(self, path: Path, target: Transformer, meta: dict) -> None:
        self.save(path, meta)

    def load_checkpoint(self, path: Path, target: Transformer) -> None:
        """The weights and draft vocabulary of the draft file ``path`` (:meth:`save`'s). Raises CheckpointError
        when its settings are not this draft's (or as :meth:`load`)."""
        loaded = type(self).load(path, target)
        n = target.cfg.n_layers  # layers compared as resolved: unset is the last n_draft_layers
        saved, own = ({**asdict(c), "layers": list(c.source_layers(n))} for c in (loaded.cfg, self.cfg))
        if saved != own:
            raise CheckpointError(f"draft {path} has other SPIRe settings than the run: {settings_diff(saved, own)}")
        self.load_state_dict(loaded.state_dict())

    def export(self, out_dir: Path, target: Transformer, meta: dict, target_folder: Path | None = None) -> Path:
        """``draft.safetensors`` (the same file as :meth:`save`)."""
        self.save(Path(out_dir) / self.export_name, meta)
        return Path(out_dir) / self.export_name

    def as_draft(self) -> "SpireDraft":
        return SpireDraft(self)


class SpireDraft(Draft):
    """Inference wrapper: a :class:`SpireDraftModel` with its own KV cache: constant-size sink + window
    (:class:`RingKVCache`, sink + window + k + 1 slots per layer, whatever the context length), or a dense
    :class:`KVCache` when the draft has no window (full-KV ablation).

    The draft cache holds, per draft layer and absolute position, the keys/values of the memory vectors:
    projected from target activations for verified positions (:meth:`observe`), from the draft's own
    feedback memory for drafted positions (:meth:`step`). Without target activations (ablation) the draft
    is an ordinary transformer: :meth:`observe` runs it over the verified tokens, like a vanilla draft.
    """

    name = "spire"

    def __init__(self, model: SpireDraftModel) -> None:
        self.model = model
        self.hidden_layers = model.source_layers if model.cfg.target_activations else ()
        # AD rounds' commits reach it in batches (Draft.defer_observe): with target activations an observe is
        # per-position projections into its cache, the same for T positions at once; a windowed cache holds them
        if model.cfg.target_activations and model.view is not None:
            self.defer_observe = max(1, model.view.window)
        self._cache: BaseKVCache | None = None
        self._feature: torch.Tensor | None = None  # (B, R, d) recent positions' features (feature_input)
        self._feature_pos: torch.Tensor | None = None  # (B, R) the position each slot holds

    def cost_shape(self, target):
        """Its layers at the target's width; the head it streams: its draft vocabulary's N rows, or the target's V."""
        from dataclasses import replace

        return replace(target.with_layers(len(self.model.layers)), vocab_size=self.model.n_vocab)

    def start(self, target: Transformer, target_cache: KVCache, batch_size: int, max_len: int, k: int) -> None:
        t, view = target.cfg, self.model.view
        if view is None:
            self._cache = KVCache(len(self.model.layers), batch_size, t.n_kv_heads, max_len, t.d_head,
                                  dtype=target.dtype, device=target.device)
        else:
            self._cache = RingKVCache(len(self.model.layers), batch_size, t.n_kv_heads, view, k + 1, t.d_head,
                                      dtype=target.dtype, device=target.device)
        if self.model.feature_proj is not None:  # a ring of k + 2 slots: a verify writes k + 1 positions
            self._feature = torch.zeros(batch_size, k + 2, t.d_model, dtype=target.dtype, device=target.device)
            self._feature_pos = torch.full((batch_size, k + 2), -1 << 40, dtype=torch.int64, device=target.device)
        self._full = (self._cache, self._feature, self._feature_pos)
        if isinstance(self._cache, RingKVCache) and self.model.cfg.target_activations:
            # per position projections into the ring: only the sink and the last ring's positions stay (its write)
            self.observe_keeps = (view.sink, self._cache.ring)
        else:
            self.observe_keeps = None

    def use_rows(self, n: int) -> bool:
        """Rows [0, n) of its cache and kept features (views)."""
        cache, feature, feature_pos = self._full
        self._cache = cache.narrow(n)
        if feature is not None:
            self._feature, self._feature_pos = feature[:n], feature_pos[:n]
        return True

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Forget rows ``rows`` (R,): their ring slots are tagged empty (never visible again) and their kept features
        dropped. A dense draft cache (the no-window ablation) needs nothing: a new request writes every position of
        its row before any query reads it."""
        self._cache.restart_rows(rows)
        if self._feature_pos is not None:
            self._feature_pos[rows.to(self._feature_pos.device)] = -1 << 40

    def _keep_features(self, pos: torch.Tensor, feature: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Store the features (B, T, d) at positions (B, T) (the latest R valid ones of each row)."""
        R = self._feature.shape[1]
        B, T = pos.shape
        if T <= R:  # contiguous positions, at most R of them: distinct slots, each written (nothing read back)
            rows = torch.arange(B, device=pos.device)[:, None].expand(B, T)
            slot = pos % R
            feature = feature.to(self._feature.dtype)
            if valid is not None:  # an invalid entry writes back what its slot held
                feature = torch.where(valid[..., None], feature, self._feature[rows, slot])
                pos = torch.where(valid, pos, self._feature_pos[rows, slot])
            self._feature[rows, slot] = feature
            self._feature_pos[rows, slot] = pos
            return
        valid = torch.ones_like(pos, dtype=torch.bool) if valid is None else valid
        keep = valid & (valid.flip(1).cumsum(1).flip(1) <= R)  # contiguous positions: distinct slots
        b, t = keep.nonzero(as_tuple=True)
        slot = pos[b, t] % R
        self._feature[b, slot] = feature[b, t].to(self._feature.dtype)
        self._feature_pos[b, slot] = pos[b, t]

    def _previous_feature(self, pos: torch.Tensor) -> torch.Tensor:
        """(B, 1) positions -> (B, 1, d) the feature kept for each row's previous position (zeros if none)."""
        prev = pos[:, 0] - 1
        rows = torch.arange(len(prev), device=prev.device)
        slot = prev % self._feature.shape[1]
        ok = self._feature_pos[rows, slot] == prev
        return (self._feature[rows, slot] * ok[:, None].to(self._feature.dtype))[:, None]

    def _key_positions(self, batch_size: int) -> torch.Tensor:
        kp = self._cache.key_positions()
        return kp if kp.dim() == 2 else kp[None].expand(batch_size, -1)

    @torch.no_grad()
    def observe(self, tokens: torch.Tensor, pos: torch.Tensor, target_out: ForwardOutput,
                valid: torch.Tensor | None = None, span: Span | None = None) -> None:
        if not self.model.cfg.target_activations:
            self._run(tokens, pos, valid, span)
            return
        cos, sin = self.model.rope(pos, self.model.target.dtype)
        hidden = [target_out.hidden[j] for j in self.model.source_layers]
        if self._feature is not None:
            self._keep_features(pos, hidden[self.model.feature_from], valid)
        m, cache = self.model, self._cache

        def plan():  # per op: each layer's memory keys/values written with the rows' validity
            return [], [], lambda i, h: cache.write(i, pos, *m.memory_kv(i, h, cos, sin), valid=valid, span=span)

        run = fastpath.decode_step(m, m.layers, m.target.cfg, hidden[0], pos, cos, sin, cache, plan,
                                   allow_native=valid is None or bool(valid.all()), span=span)
        if run.native:
            cache.claim(pos)  # the slot tags the per-op path's layer-0 write sets
        for i, h in enumerate(hidden):
            run.write_kv(i, h)

    def _run(self, tokens: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor | None = None,
             span: Span | None = None) -> torch.Tensor:
        """Ordinary transformer forward over (B, T) tokens at contiguous positions per row, reading the cache
        for earlier positions and then storing the new keys/values. Works for a ring cache of any T: the new
        keys are attended from the call's own tensors, not from the ring. Returns the last position's (B, d)."""
        m, cache = self.model, self._cache
        x = m.target.model.embed_tokens(tokens)
        cos, sin = m.rope(pos, x.dtype)
        B = tokens.shape[0]
        old = self._key_positions(B)  # entries at or past a row's first new position are stale: hide them
        old = torch.where(old < pos[:, :1], old, torch.full_like(old, 1 << 40))
        mask = attention_mask(pos, torch.cat([old, pos], 1), m.view)
        for i, layer in enumerate(m.layers):
            if m.enters(i):
                x = m.layer_input(i, x)
            new: list[torch.Tensor] = []

            def kv_source(k_new, v_new, i=i, new=new):  # the cache's past, then the call's own keys
                new += [k_new, v_new]
                k_old, v_old = cache.read(i)
                return torch.cat([k_old.to(k_new.dtype), k_new], 2), torch.cat([v_old.to(v_new.dtype), v_new], 2)
            x = layer(x, cos, sin, kv_source, mask)
            cache.write(i, pos, *new, valid=valid, span=span)
        return x

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor, span: Span | None = None) -> torch.Tensor:
        m, cache = self.model, self._cache
        if not m.cfg.target_activations:
            return m.to_target_vocab(m.logits(self._run(tokens, pos, span=span))[:, -1])
        x = m.target.model.embed_tokens(tokens)  # (B, 1, d)
        feature = None if self._feature is None else self._previous_feature(pos)  # (B, 1, d)
        cos, sin = m.rope(pos, x.dtype)
        # the new position's entries claimed (its keys/values follow, per layer) and the mask over every entry
        slots, mask = cache.claim_mask(pos, m.view, m.cfg.self_attend)  # (B, 1), (B, 1, 1, S)
        xs = [x]

        def plan():  # per op: the token's own key/value into the cache, then attention over everything up to it
            def kv_source(i, k_self, v_self):
                cache.write(i, pos, k_self, v_self, span=span)
                return cache.read(i)
            return ([partial(kv_source, i) for i in range(len(m.layers))], [mask] * len(m.layers),
                    lambda i, mem: cache.write(i, pos, *m.memory_kv(i, mem, cos, sin), span=span))

        # natively, each layer is one call: the token's key/value into its slot, attention over the slots
        run = fastpath.decode_step(m, m.layers, m.target.cfg, x, pos, cos, sin, cache, plan, mask=mask, slots=slots,
                                   span=span)
        for i in range(len(m.layers)):
            if m.enters(i):
                x = xs[i] = m.layer_input(i, x, feature)
            x = run.block(i, x)
            xs.append(x)
        if self._feature is not None:
            self._keep_features(pos, xs[m.feature_from], None)
        if m.cfg.feedback_memory:  # later tokens read this token as memory, not as its self key/value
            mem = m.memory(xs)
            for i in range(len(m.layers)):
                run.write_kv(i, mem[i])
        return m.to_target_vocab(m.logits(x)[:, -1])


def find_trained_spire(target: Transformer) -> Path | None:
    """The most recently written finished full-method (not ablated) SPIRe draft in the cache that fits
    ``target``, or None."""
    found = []
    for f in (spire_cache_dir() / "drafts").glob("*/draft.safetensors"):
        try:
            meta, _ = read_draft_file(f)
            finished = run_finished(f.parent)
        except Exception:  # an unreadable or foreign file is not a candidate
            continue
        if (fingerprint_matches(meta.get("target", {}), target) and finished
                and meta.get("ablation", "none") == "none"):
            found.append(f)
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def load_exported_spire(folder: str | Path, target: Transformer) -> SpireDraftModel:
    """The :class:`SpireDraftModel` of an exported SPIRe folder (:mod:`spire.export`), checked against ``target``.
    Raises CheckpointError or TokenizerMismatchError."""
    config = check_export(folder, target)
    algorithm = config["speculators_config"].get("algorithm")
    if algorithm != "spire":
        raise CheckpointError(f"{folder} holds a draft of algorithm {algorithm!r}, not a SPIRe one: use --draft "
                              f"{'eagle3' if algorithm == 'eagle3' else 'vanilla'}")
    return SpireDraftModel.load(Path(folder) / "model.safetensors", target)


def load_draft(target: Transformer, path: str | Path | None = None, **_) -> SpireDraft:
    """The SPIRe draft at ``path`` (a draft .safetensors, a `spire train` run folder or a `spire export` folder),
    default the newest finished one in the cache for ``target``. Raises CheckpointError (none trained, missing,
    unreadable) or TokenizerMismatchError (trained for another target)."""
    file = resolve_draft_path("spire", path) if path else find_trained_spire(target)
    if file is None:
        raise CheckpointError("no trained SPIRe draft for this target in the cache: run `spire reproduce` "
                              "(or pass --draft-path)")
    if file.is_dir():
        return SpireDraft(load_exported_spire(file, target).requires_grad_(False))
    if path:
        warn_if_unfinished(file.parent)
    return SpireDraft(SpireDraftModel.load(file, target).requires_grad_(False))  # frozen: decodes with kept copies


def _export(src: Path, target: Transformer, name_or_path: str, k: int):
    """(config.json, writer) of an exported SPIRe folder (:func:`spire.export.export_draft`)."""
    if src.is_dir():  # an exported folder, exported again
        check_export(src, target)
        src = src / "model.safetensors"
    meta, state = read_draft_file(src, target)
    config = spire_export_config(meta, state, target, name_or_path, k)

    def write(tmp: Path) -> None:
        write_draft_file(tmp / "model.safetensors", state, meta)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return write


KIND = DraftImpl(load=load_draft, model=SpireDraftModel, export=_export)
