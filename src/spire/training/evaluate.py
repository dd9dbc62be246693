"""What a run reads from the target and how a draft is scored on held-out text: the run's data source (the live
target or a target cache, :func:`make_source`), whether a step needs the teacher, and the held-out loss and α per
drafted position (:func:`evaluate_heldout`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from spire.drafts.base import TrainableDraft
from spire.model import Transformer
from spire.training.config import TrainConfig
from spire.training.losses import (acceptance_alpha_logp, hard_target_loss, kl_loss_logp, log_acceptance_loss_logp,
                                   mixed_loss_logp)
from spire.training.ranks import _distributed, wait_for_rank0
from spire.training.sources import CachedTarget, LiveTarget, TargetCache, autocast, run_target
from spire.training.step import loss_kernel



def needs_teacher(model: TrainableDraft, cfg: TrainConfig) -> bool:
    """Whether a step needs the teacher distribution: for MixedLoss, and for the logged alpha whenever the
    target runs anyway (a SPIRe draft reading its activations)."""
    return cfg.resolved_loss() in ("mixed", "kl", "lk") or bool(model.target_layers())


def make_source(target: Transformer, data, model: TrainableDraft, cfg: TrainConfig,
                target_folder: Path | None = None, progress: bool = True, log=print):
    """The run's data source: :class:`LiveTarget`, or a :class:`CachedTarget` over the target cache of
    cfg.data_steps batches (built here when missing; under torchrun rank 0 builds while the others wait).
    Raises ConfigError / DataError (see :meth:`TargetCache.build`)."""
    layers, teacher = model.target_layers(), needs_teacher(model, cfg)
    if cfg.target_cache is not None and not (layers or teacher) and log is not None:
        log(f"      target cache not used: this {cfg.draft} draft with {cfg.resolved_loss()} loss reads nothing from "
            "the target (it trains on the text alone)")
    if cfg.target_cache is None or not (layers or teacher):
        return LiveTarget(target, data, layers, teacher, cfg.batch_size, cfg.seq_len, cfg.seed, cfg.data_steps,
                          bool(cfg.bf16))
    dist, rank, _ = _distributed()

    def build(show: bool) -> TargetCache:
        return TargetCache.build(target, data, layers, teacher, cfg.batch_size, cfg.seq_len, cfg.seed,
                                 cfg.data_steps, cfg.target_cache, folder=target_folder, bf16=bool(cfg.bf16),
                                 progress=show, log=log if show else None)
    if dist is not None and rank != 0:
        wait_for_rank0(dist)  # rank 0 builds first (no deadline: a build may take hours)
        return CachedTarget(build(False), layers, teacher, target.device)
    cache = build(progress)
    if dist is not None:
        wait_for_rank0(dist)
    return CachedTarget(cache, layers, teacher, target.device)


@torch.no_grad()
def evaluate_heldout(model: TrainableDraft, target: Transformer, windows: torch.Tensor, cfg: TrainConfig,
                     batch_size: int = 4) -> dict:
    """Held-out loss (the training loss), cross-entropy against the data, and alpha per drafted position.

    windows: (N, T) token ids, T a multiple of cfg.k. Returns {"loss", "ce", "alpha", "alpha_per_position"}.
    """
    model.eval()
    k = cfg.k
    sums, loss_sum, ce_sum, n_batches, count = torch.zeros(k), 0.0, 0.0, 0, 0
    vocab = model.vocab
    for i in range(0, windows.shape[0], batch_size):
        tokens = windows[i: i + batch_size].to(target.device)
        tb = run_target(target, tokens, model.target_layers(), True, bool(cfg.bf16))
        with autocast(bool(cfg.bf16), target.device):
            q_logits = model.train_logits(tokens, tb.hidden, k)
            logp = tb.target_logp(target, vocab)  # the teacher's head as training computes it
        kernel = loss_kernel(model)
        ce = float(hard_target_loss(q_logits[:, :-1], model.to_draft_ids(tokens[:, 1:]), kernel))
        kind = cfg.resolved_loss()
        loss = (ce if kind == "hard" else float(kl_loss_logp(q_logits, logp, kernel).loss) if kind == "kl"
                else float(log_acceptance_loss_logp(q_logits, logp).loss) if kind == "lk"
                else float(mixed_loss_logp(q_logits, logp, cfg.omega, kernel).loss))
        a = acceptance_alpha_logp(q_logits, logp)  # (B, T)
        sums += a.view(a.shape[0], -1, k).sum((0, 1)).cpu()
        count += a.shape[0] * (a.shape[1] // k)
        loss_sum, ce_sum, n_batches = loss_sum + loss, ce_sum + ce, n_batches + 1
    per_pos = (sums / count).tolist()
    return {"loss": loss_sum / n_batches, "ce": ce_sum / n_batches, "alpha": sum(per_pos) / k,
            "alpha_per_position": per_pos}
