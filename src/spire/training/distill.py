"""The trainer's former single module, kept so that old imports keep working: it re-exports the names other code
imported from it (``from spire.training.distill import TrainConfig, train_draft``). It holds no code of its own;
each name lives in the module of its one job:

* :mod:`spire.training.config`: :class:`TrainConfig`, the run folder's file names, ``ABLATIONS``, ``init_from``;
* :mod:`spire.training.step`: one step's loss, the optimizer, the learning-rate schedule, ``torch.compile``;
* :mod:`spire.training.checkpoint`: a run folder read back for a resume, and its checks;
* :mod:`spire.training.ranks`: the processes of data-parallel training;
* :mod:`spire.training.evaluate`: the data source and the held-out evaluation;
* :mod:`spire.training.trainer`: the :class:`Trainer` and :func:`train_draft`, which drives it.

Setting a name on this module (``monkeypatch.setattr(distill, "step_loss", f)``, ``distill.time = clock``) sets it
in every one of those modules that binds the same object under that name, so that a patch reaches the code that
uses it, as it did when that code lived here. New code imports from the modules above.
"""

from __future__ import annotations

import sys
import time
import types

from spire.paths import replace_dir
from spire.training import checkpoint as _checkpoint
from spire.training import config as _config
from spire.training import evaluate as _evaluate
from spire.training import ranks as _ranks
from spire.training import step as _step
from spire.training import trainer as _trainer
from spire.training.checkpoint import (RESUME_SETTINGS, _check_saved_config, load_state, read_log,
                                       refuse_existing_run)
from spire.training.config import (ABLATIONS, CHECKPOINT_DIR, DRAFT_FILE, DRAFT_KINDS, LOG_FILE, LOSSES, OPTIM_FILE,
                                   STATE_FILE, TrainConfig, ablation_config, init_draft_settings, init_weights_file)
from spire.training.evaluate import evaluate_heldout, make_source, needs_teacher
from spire.training.losses import mixed_loss_logp
from spire.training.ranks import WAIT_DEADLINE, _distributed, init_distributed, wait_for_rank0
from spire.training.step import (_build_model, _inductor_cache, _lr_at, compile_draft, fast_bf16, loss_kernel,
                                 make_optimizer, step_loss, uncompile_draft)
from spire.training.trainer import Trainer, _train_locked, train_draft

__all__ = ["ABLATIONS", "CHECKPOINT_DIR", "DRAFT_FILE", "DRAFT_KINDS", "LOG_FILE", "LOSSES", "OPTIM_FILE",
           "RESUME_SETTINGS", "STATE_FILE", "TrainConfig", "Trainer", "WAIT_DEADLINE", "ablation_config",
           "compile_draft", "evaluate_heldout", "fast_bf16", "init_distributed", "init_draft_settings",
           "init_weights_file", "load_state", "loss_kernel", "make_optimizer", "make_source", "mixed_loss_logp",
           "needs_teacher", "read_log", "refuse_existing_run", "replace_dir", "step_loss", "time", "train_draft",
           "uncompile_draft", "wait_for_rank0"]

_PARTS = (_config, _step, _ranks, _checkpoint, _evaluate, _trainer)


class _Reexports(types.ModuleType):
    """This module's type: a name set here is also set where it is used (see the module docstring)."""

    def __setattr__(self, name: str, value) -> None:
        old = self.__dict__.get(name)
        for part in _PARTS:
            if name in vars(part) and vars(part)[name] is old:
                setattr(part, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Reexports
