"""One training step's pieces: the draft built for a run, its loss on one batch (:func:`step_loss`), the optimizer
(fused AdamW per the backend), the learning-rate schedule, ``torch.compile`` of the draft's training forward, and
whether bf16 autocast and the native loss kernels are used.
"""

from __future__ import annotations

import math

import torch

from spire.backend import DEFAULT as DEFAULT_BACKEND
from spire.backend import Backend
from spire.backend import of as backend_of
from spire.backend import use as use_backend
from spire.drafts.base import TrainableDraft
import spire.registry as registry
from spire.model import Transformer
from spire.training.config import TrainConfig
from spire.training.losses import (acceptance_alpha_logp, hard_target_loss, kl_loss_logp, log_acceptance_loss_logp,
                                   mixed_loss_logp)
from spire.training.sources import TeacherBatch, autocast


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 autocast speeds up training here (without AMX or AVX512-BF16 it is several times slower)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def _build_model(target: Transformer, cfg: TrainConfig, data=None) -> TrainableDraft:
    """A fresh draft of the class registered for ``cfg.draft`` (:mod:`spire.registry`). Raises ConfigError."""
    return use_backend(registry.trainable_class(cfg.draft).for_training(target, cfg, data), backend_of(target))


def loss_kernel(model: TrainableDraft) -> bool:
    """Whether the losses run through the native row kernels: the draft's backend has them on."""
    bk = backend_of(model)
    return bk.loss_kernel and bk.kernels


def make_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, backend: Backend = DEFAULT_BACKEND
                   ) -> torch.optim.Optimizer:
    """AdamW(β = 0.9, 0.95) at cfg.lr and cfg.weight_decay; with ``backend.fused_adamw`` torch's fused kernel where
    it has one (one pass over each parameter instead of a dozen elementwise ops; 0.02 s against 0.09-0.11 s a step
    for SPIRe's 28 M parameters on one CPU thread), else the for-loop implementation. The optimizer state has the
    same form either way, so a checkpoint of one resumes in the other."""
    kw = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    if backend.fused_adamw and all(p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params):
        try:
            opt = torch.optim.AdamW(params, fused=True, **kw)
        except (RuntimeError, ValueError):  # a device without the fused kernel
            pass
        else:
            return opt
    return torch.optim.AdamW(params, **kw)


def compile_draft(model: TrainableDraft) -> None:
    """Route ``model.train_logits`` through ``torch.compile`` (inductor, static shapes) while autograd is on (the
    training steps); with autograd off (the held-out evaluation) it stays eager, so one graph is built. The first
    training call compiles: minutes on 2 CPU cores with a cold cache, seconds once inductor's on-disk cache holds
    the graph. :func:`uncompile_draft` undoes it."""
    eager = type(model).train_logits.__get__(model)
    compiled = torch.compile(eager, dynamic=False)

    def train_logits(*args, **kw):
        return compiled(*args, **kw) if torch.is_grad_enabled() else eager(*args, **kw)
    model.train_logits = train_logits


def _inductor_cache() -> str:
    """Where torch.compile's inductor keeps compiled code (TORCHINDUCTOR_CACHE_DIR, else /tmp/torchinductor_<user>)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return cache_dir()
    except Exception:  # a torch without it: the documented default
        return "$TORCHINDUCTOR_CACHE_DIR or /tmp/torchinductor_<user>"


def uncompile_draft(model: TrainableDraft) -> None:
    """Undo :func:`compile_draft` (nothing when the model was not compiled)."""
    model.__dict__.pop("train_logits", None)


def step_loss(model: TrainableDraft, target: Transformer, tb: TeacherBatch, cfg: TrainConfig,
              parts: dict | None = None, ce_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The training loss of one batch and its alpha (nan when there is no teacher; a 0-dim tensor: nothing is read
    back here): teacher-forced draft logits (under bf16 autocast when cfg.bf16), then MixedLoss(omega) against the
    teacher or HardTargetLoss (times ``ce_scale``: :meth:`Trainer._update` makes a process's mean over its own valid
    targets a share of the mean over every process's), plus cfg.hidden_weight × the hidden-state mismatch when that
    is on (its unweighted value, a 0-dim tensor, goes to ``parts["hidden"]`` when a dict is given)."""
    extra = 0.0
    with autocast(bool(cfg.bf16), tb.tokens.device):
        if cfg.hidden_weight:
            q_logits, mismatch = model.train_logits(tb.tokens, tb.hidden, cfg.k, match_hidden=True)
            extra = cfg.hidden_weight * mismatch
            if parts is not None:
                parts["hidden"] = mismatch.detach()
        else:
            q_logits = model.train_logits(tb.tokens, tb.hidden, cfg.k)
    kind = cfg.resolved_loss()
    if kind in ("mixed", "kl", "lk") or tb.final is not None:
        with autocast(bool(cfg.bf16), tb.tokens.device):  # the teacher's head as the live target computes it
            logp = tb.target_logp(target, model.vocab)
    kernel = loss_kernel(model)
    if kind in ("mixed", "kl", "lk"):
        terms = (mixed_loss_logp(q_logits, logp, cfg.omega, kernel) if kind == "mixed"
                 else log_acceptance_loss_logp(q_logits, logp) if kind == "lk"
                 else kl_loss_logp(q_logits, logp, kernel))
        return terms.loss + extra, terms.alpha_t
    loss = hard_target_loss(q_logits[:, :-1], model.to_draft_ids(tb.tokens[:, 1:]), kernel) * ce_scale + extra
    if tb.final is None:
        return loss, torch.full((), float("nan"), device=loss.device)
    return loss, acceptance_alpha_logp(q_logits, logp).mean()


def _lr_at(cfg: TrainConfig, step: int, frac: float) -> float:
    """Linear warmup over warmup_steps, then cosine decay from lr to 0.1 lr over the run (frac in [0, 1])."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    return cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
