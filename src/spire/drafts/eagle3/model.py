"""EAGLE-3's trainable model, one job: :class:`Eagle3DraftModel`, the draft's weights bound to a frozen target (fc,
the one layer, the final norm, the d2t head), its training forward (test-time training over chunks of k,
:meth:`~Eagle3DraftModel.train_logits`), spire's own checkpoint file (save / load) and the training interface of
:class:`spire.drafts.base.TrainableDraft` (its export writes a speculators folder,
:mod:`spire.drafts.eagle3.speculators_format`; its inference form is :class:`spire.drafts.eagle3.draft.Eagle3Draft`).
The training forward stays a method here: it is the model's own pieces (``fuse``, ``layers[0]``, ``logits``) run
as inference runs them."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn

from spire import defaults, fastpath
from spire.drafts.eagle3.config import Eagle3Config, draft_layer_config
from spire.drafts.eagle3.draft import Eagle3Draft
from spire.drafts.eagle3.layer import Eagle3Layer, eagle3_mask
from spire.drafts.eagle3.speculators_format import export_speculators
from spire.formats.draft_file import check_draft_kind, read_draft_file, settings_diff, write_draft_file
from spire.formats.draft_file import fingerprint as _fingerprint
from spire.drafts.vocab import DraftVocabulary, frequent_tokens
from spire.errors import CheckpointError, ConfigError
from spire.kv_cache import SinkWindow
from spire.model import ModelConfig, RMSNorm, Transformer
from spire.rope import rope_cos_sin


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
        """Teacher-forced logits as inference computes them (:mod:`spire.drafts.eagle3`).

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
        .safetensors file ``path`` (:func:`spire.formats.draft_file.write_draft_file`)."""
        meta = {"eagle3_config": self.cfg.to_dict(), "layer_config": self.layer_cfg.to_dict(),
                "target": _fingerprint(self.target), **(extra or {})}
        write_draft_file(path, self.state_dict(), meta)

    @classmethod
    def load(cls, path: Path, target: Transformer) -> "Eagle3DraftModel":
        """A draft written by :meth:`save` for ``target``. Raises CheckpointError (missing, unreadable, not an
        EAGLE-3 draft, unknown settings, tensors that do not fit) or TokenizerMismatchError (another target)."""
        meta, state = read_draft_file(path, target)
        check_draft_kind(path, meta, "eagle3")
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
