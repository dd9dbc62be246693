"""SPIRe's trainable model, one job: :class:`SpireDraftModel`, the draft's weights bound to a frozen target (the
pruned blocks, the final norm, the feedback-memory mixing logits, the optional feature projection and bridge), the
pieces inference shares with training (``logits``, ``memory``, ``memory_kv``, ``layer_input``), its training
forward (the k-pass procedure of the paper's Figure 2, :meth:`~SpireDraftModel.forward_train`), the bridge's ridge
fit, spire's draft file (save / load) and the training interface of :class:`spire.drafts.base.TrainableDraft`
(its inference form is :class:`spire.drafts.spire.draft.SpireDraft`)."""

from __future__ import annotations

import copy
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn

from spire import fastpath
from spire.backend import of as backend_of
from spire.drafts.spire.config import BRIDGE_FIT_ROWS, VOCAB_MASS_ROWS, SpireConfig
from spire.drafts.spire.draft import SpireDraft
from spire.drafts.vocab import DraftVocabulary, frequent_tokens, probable_tokens
from spire.formats.draft_file import check_draft_kind, fingerprint, read_draft_file, settings_diff, write_draft_file
from spire.errors import CheckpointError, ConfigError
from spire.kv_cache import SinkWindow, attention_mask, self_mask
from spire.model import RMSNorm, Transformer


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
        check_draft_kind(path, meta, "spire")
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
