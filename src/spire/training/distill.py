"""The trainer's former single module, kept so that old imports keep working: it re-exports the names other code
imported from it (``from spire.training.distill import TrainConfig, train_draft``). It holds no code of its own;
each name lives in the module of its one job:

* :mod:`spire.training.config`: :class:`TrainConfig`, the run folder's file names, ``ABLATIONS``, ``init_from``;
* :mod:`spire.training.step`: one step's loss, the optimizer, the learning-rate schedule, ``torch.compile``;
* :mod:`spire.training.checkpoint`: a run folder read back for a resume, and its checks;
* :mod:`spire.training.ranks`: the processes of data-parallel training;
* :mod:`spire.training.evaluate`: the data source and the held-out evaluation;
* :mod:`spire.training.trainer`: the :class:`Trainer` and :func:`train_draft`, which drives it.

New code imports from the modules above; a stand-in for a name the trainer uses (a clock, a loss) is set in the
module that uses it (the tests' ``set_in_training`` sets it in each).
"""

from __future__ import annotations

import time

from spire.paths import replace_dir
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
