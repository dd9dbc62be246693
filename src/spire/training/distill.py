"""Train a draft (SPIRe, or the vanilla baseline) against its target (SPIRe paper §3.5-3.6, §4).

Each step: a global batch of training windows is drawn from a generator seeded by (seed, step); the frozen
target runs on it when the draft needs its activations or the loss needs its distribution (under bf16
autocast when asked); the draft computes teacher-forced logits (SPIRe: the k-pass procedure of
:meth:`SpireDraftModel.forward_train`; vanilla: one causal pass) and is trained by AdamW with linear warmup
and cosine decay to 10 %, gradient clipping, and MixedLoss(omega) or HardTargetLoss.

The trainer never asks which class of draft it has: ``TrainConfig.draft`` names a class in
:mod:`spire.registry` (its kind's ``KIND.model``), and every draft model implements the training interface
:class:`spire.drafts.base.TrainableDraft` (target layers it reads, teacher-forced logits, draft vocabulary,
checkpoint, export). The run is a :class:`Trainer` in pieces (setup, step, checkpoint, evaluate, finish) that
:func:`train_draft` drives.

Runs are resumable and exact: the batch of step s depends only on (seed, s), the learning rate on s (when
``max_steps`` is set; with only a time budget it follows the saved elapsed time), and the checkpoint holds
the draft, the AdamW state and the JSON state. A checkpoint is a folder replaced atomically
(:func:`spire.paths.replace_dir`), so a run killed at any instant resumes from the last complete one; a
non-finite loss stops the run with :class:`TrainingError` and keeps that checkpoint.

Data parallel: under ``torchrun`` (``torch.distributed`` initialized, gloo on CPU, NCCL on GPU) every
process draws the same global batch, takes its own equal share of the rows, and gradients are averaged
across processes before each update, so N processes follow the same trajectory as one process with the
same global batch (tests/test_trainer.py). Only rank 0 writes files.

Run folder layout: ``checkpoint/`` (draft.safetensors, optimizer.pt, train_state.json), ``train_log.jsonl``
(one JSON object per logged step and per held-out evaluation) and the exported draft:
``draft.safetensors`` (SPIRe; ``spire generate --draft spire --draft-path``) or ``draft/`` (vanilla, an HF
Llama folder; ``--draft vanilla --draft-path``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from spire import defaults
from spire.backend import DEFAULT as DEFAULT_BACKEND
from spire.backend import Backend
from spire.backend import of as backend_of
from spire.backend import use as use_backend
from spire.drafts.base import TrainableDraft
import spire.registry as registry
from spire.drafts.eagle3 import Eagle3Config
from spire.drafts.spire import SpireConfig
from spire.drafts.vanilla import VanillaConfig
from spire.errors import CheckpointError, ConfigError, TrainingError
from spire.model import Transformer
from spire.formats.draft_file import DRAFT_KIND_KEYS, DRAFT_KIND_NAMES, draft_file_kind, read_draft_meta
from spire.paths import atomic_write, existing_dir, replace_dir
from spire.training.runfolder import RunLock, check_fresh_folder, remove_stale_temporaries
from spire.training.losses import (acceptance_alpha_logp, hard_target_loss, kl_loss_logp, log_acceptance_loss_logp,
                                   mixed_loss_logp)
from spire.training.sources import (STORAGE_DTYPES, CachedTarget, LiveTarget, TargetCache, TeacherBatch, autocast,
                                    run_target)

CHECKPOINT_DIR = "checkpoint"
DRAFT_FILE = "draft.safetensors"
STATE_FILE = "train_state.json"
OPTIM_FILE = "optimizer.pt"
LOG_FILE = "train_log.jsonl"
"""TrainConfig.draft -> the draft class trained for it (each implements :class:`spire.drafts.base.TrainableDraft`)."""
DRAFT_KINDS = registry.names(trains=True)
"""The kinds `spire train` trains (their ``KIND.model`` classes: :func:`spire.registry.trainable_class`)."""
LOSSES = ("mixed", "hard", "kl", "lk")

# The paper's Figure 5 ablations: name -> (SpireConfig overrides, TrainConfig overrides), and the paper's
# tau for each (SPIRE.md §3.7; full-kv changes the cost, not tau, in the paper's figure).
ABLATIONS: dict[str, tuple[dict, dict]] = {
    "none": ({}, {}),
    "no-feedback": ({"feedback_memory": False}, {}),
    "no-feedback-no-target": ({"feedback_memory": False, "target_activations": False}, {}),
    "omega1": ({}, {"omega": 1.0}),
    "hard-loss": ({}, {"loss": "hard"}),
    "random-init": ({"init": "random"}, {}),
    "full-kv": ({"window": None}, {}),
}


@dataclass
class TrainConfig:
    """Settings of one training run.

    draft: a trainable kind ("spire", "eagle3" or "vanilla"). draft_config: that kind's own settings, an instance
    of its ``config_class`` (:class:`spire.drafts.spire.SpireConfig`, :class:`spire.drafts.eagle3.Eagle3Config`,
    :class:`spire.drafts.vanilla.VanillaConfig`); None: the kind's defaults. budget_s: training wall-clock seconds (evaluation and checkpoints
    excluded); max_steps: also stop after this many optimizer steps (and then the cosine schedule runs
    over steps, which makes resumed runs exact). batch_size: global batch (rows) per step; seq_len: tokens
    per row (a multiple of k). lr: AdamW peak learning rate. loss: "mixed" (MixedLoss(omega); omega = 1 is
    pure distillation), "hard" (HardTargetLoss) or "kl" (speculators' EAGLE-3 loss: the forward KL to the target
    renormalized over the draft vocabulary, :func:`spire.training.losses.kl_loss_logp`) or "lk" (the negative
    log-acceptance loss, arXiv 2602.23881, :func:`spire.training.losses.log_acceptance_loss_logp`); None picks the method's
    default (SPIRe: mixed, vanilla: hard, EAGLE-3: kl). bf16: autocast (None: on where bf16 is fast). eval_every: steps between held-out
    evaluations (0: at the end only). ablation: a name of :data:`ABLATIONS`, recorded in the checkpoint.
    data_steps: distinct batches in the run (step s trains on batch s mod data_steps, so a run longer than
    data_steps makes epochs over them); None: a fresh batch every step. target_cache: None runs the frozen
    target on every step; "float32" (exact) or "bfloat16" (compact) runs it once over the data_steps batches
    and trains from the stored outputs (:class:`spire.training.sources.TargetCache`; needs data_steps).
    data: the training text's
    identity (set by `spire train`; a resume on other text is refused). hidden_weight: beyond the paper, the
    weight of SPIRe's hidden-state matching term (:meth:`spire.drafts.spire.SpireDraftModel.hidden_mismatch`)
    added to the loss; 0 (the default) is the paper's loss. compile: the draft's teacher-forced forward and its
    backward through ``torch.compile`` (:func:`compile_draft`): the same computation with fused kernels, equal
    to float32 rounding; not part of a run's identity (a run resumes with or without it). init_from: beyond the
    paper, a trained draft of the same kind and settings (a run folder, whose last checkpoint is read, or a draft
    file written by a run; `spire train` takes the settings from it, :func:`init_draft_settings`) whose weights and
    draft vocabulary a fresh run starts from instead of the target's layers, e.g. to fine-tune a draft on other
    text; the optimizer and the schedule start anew; None: the kind's own initialization (SPIRe: pruned from the
    target).

    On disk (the "config" of a run folder's ``checkpoint/train_state.json``, which other tools read) the layout
    stays the one of before the draft config classes: ``spire`` and ``eagle3`` objects and ``vanilla_layers``, each
    kind's defaults for the kinds not trained (:meth:`to_dict`, :meth:`from_dict`).
    """

    draft: str = "spire"
    budget_s: float = defaults.TRAIN_BUDGET_S
    max_steps: int | None = None
    batch_size: int = defaults.BATCH_SIZE
    seq_len: int = defaults.SEQ_LEN
    k: int = defaults.K
    lr: float = defaults.LR
    warmup_steps: int = defaults.WARMUP_STEPS
    weight_decay: float = defaults.WEIGHT_DECAY
    loss: str | None = None
    omega: float = defaults.OMEGA
    grad_clip: float = defaults.GRAD_CLIP
    bf16: bool | None = None
    seed: int = defaults.SEED
    checkpoint_every: float = defaults.CHECKPOINT_EVERY_S
    eval_every: int = 0
    ablation: str = "none"
    draft_config: SpireConfig | Eagle3Config | VanillaConfig | None = None
    data_steps: int | None = None
    target_cache: str | None = None
    data: str | None = None  # identity of the training text (its cache key), recorded so a resume can check it
    hidden_weight: float = 0.0
    compile: bool = False
    init_from: str | None = None

    def __post_init__(self) -> None:
        if self.draft_config is None and self.draft in DRAFT_KINDS:
            self.draft_config = registry.trainable_class(self.draft).config_class()

    def resolved_loss(self) -> str:
        """The loss given, else the draft method's default (SPIRe: mixed, vanilla: hard)."""
        if self.loss:
            return self.loss
        return getattr(registry.trainable_class(self.draft), "default_loss", "mixed") if self.draft in DRAFT_KINDS else "mixed"

    def validate(self) -> None:
        """Raise ConfigError for impossible settings."""
        if self.draft not in DRAFT_KINDS:
            raise ConfigError(f"draft must be one of {', '.join(DRAFT_KINDS)}, got {self.draft!r}")
        config_class = registry.trainable_class(self.draft).config_class
        if not isinstance(self.draft_config, config_class):
            raise ConfigError(f"a {self.draft} draft's settings are a {config_class.__name__}, got "
                              f"{type(self.draft_config).__name__}")
        if not self.budget_s > 0:
            raise ConfigError(f"training budget must be positive, got {self.budget_s} s")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.k < 1 or self.batch_size < 1 or self.seq_len < 2:
            raise ConfigError(f"k and batch size must be >= 1 and seq_len >= 2, got k={self.k}, batch size "
                              f"{self.batch_size}, seq_len {self.seq_len}")
        if self.seq_len % self.k:
            raise ConfigError(f"seq_len {self.seq_len} must be a multiple of k={self.k}")
        if not 0 <= self.omega <= 1:
            raise ConfigError(f"omega must be in [0, 1], got {self.omega}")
        if self.resolved_loss() not in LOSSES:
            raise ConfigError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if not 0 <= self.seed < 2 ** 40:  # step_generator seeds torch with seed * 1,000,003 + step (< 2^63)
            raise ConfigError(f"--seed must be in [0, 2^40), got {self.seed}")
        if not (math.isfinite(self.lr) and self.lr > 0) or not self.grad_clip > 0:
            raise ConfigError(f"--lr and --grad-clip must be positive, got {self.lr} and {self.grad_clip}")
        if self.warmup_steps < 0 or self.eval_every < 0 or not self.checkpoint_every >= 0:
            raise ConfigError(f"--warmup-steps, --eval-every and --checkpoint-every must be >= 0, got "
                              f"{self.warmup_steps}, {self.eval_every} and {self.checkpoint_every}")
        if self.data_steps is not None and self.data_steps < 1:
            raise ConfigError(f"--cache-steps (data_steps) must be >= 1, got {self.data_steps}")
        if self.target_cache is not None and self.target_cache not in STORAGE_DTYPES:
            raise ConfigError(f"--target-cache must be one of {', '.join(STORAGE_DTYPES)} (or none: the live "
                              f"target), got {self.target_cache!r}")
        if self.target_cache is not None and self.data_steps is None:
            raise ConfigError("a target cache holds --cache-steps batches: give --cache-steps with --target-cache")
        if not (math.isfinite(self.hidden_weight) and self.hidden_weight >= 0):
            raise ConfigError(f"--hidden-loss must be a finite number >= 0, got {self.hidden_weight}")
        if self.hidden_weight and self.draft != "spire":
            raise ConfigError("--hidden-loss applies to the SPIRe draft only")
        if self.hidden_weight and (self.draft_config.n_draft_layers < 2 or not self.draft_config.target_activations):
            raise ConfigError("--hidden-loss needs target activations and at least 2 draft layers (it matches the "
                              "residual stream entering draft layers 1..n-1)")
        if self.ablation not in ABLATIONS:
            raise ConfigError(f"unknown ablation {self.ablation!r}; choose one of {', '.join(ABLATIONS)}")

    def to_dict(self) -> dict:
        """The settings as JSON holds them, in the on-disk layout (``spire``, ``eagle3``, ``vanilla_layers``; see
        the class docstring): a run's identity and cache key are computed from it. ``init_from`` only when given,
        so that the settings of runs from before the field existed read and write back unchanged."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "draft_config"}
        if d["init_from"] is None:
            del d["init_from"]
        own = self.draft_config
        d["spire"] = (own if self.draft == "spire" else SpireConfig()).to_dict()
        d["eagle3"] = (own if self.draft == "eagle3" else Eagle3Config()).to_dict()
        d["vanilla_layers"] = own.n_layers if self.draft == "vanilla" else None
        d["loss"] = self.resolved_loss()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """The TrainConfig of :meth:`to_dict`'s layout (a saved run's); fields it does not know raise
        ConfigError."""
        d = dict(d)
        draft = d.get("draft", "spire")
        spire, eagle3, vanilla_layers = d.pop("spire", None), d.pop("eagle3", None), d.pop("vanilla_layers", None)
        known = {f.name for f in fields(cls)} - {"draft_config"}
        if set(d) - known:
            raise ConfigError(f"unknown training settings {', '.join(sorted(set(d) - known))}")
        own = {"spire": lambda: SpireConfig(**(spire or {})),
               "eagle3": lambda: Eagle3Config.from_dict(eagle3) if eagle3 else Eagle3Config(),
               "vanilla": lambda: VanillaConfig(vanilla_layers)}.get(draft, lambda: None)()
        return cls(**d, draft_config=own)


def init_weights_file(path: str | Path) -> Path:
    """The draft file a run starts from for ``TrainConfig.init_from``: ``path`` itself when it is a file, else the
    last checkpoint's draft file of the run folder ``path`` (``checkpoint/draft.safetensors``), else its
    ``draft.safetensors`` (a SPIRe run's export, the same format). Raises ConfigError when there is none."""
    path = Path(path)
    if path.is_file():
        return path
    ckpt = existing_dir(path / CHECKPOINT_DIR)
    for cand in ([ckpt / DRAFT_FILE] if ckpt is not None else []) + [path / DRAFT_FILE]:
        if cand.is_file():
            return cand
    if (path / "config.json").is_file():
        raise ConfigError(f"--init-from {path}: an exported draft folder; give the run folder that holds its "
                          "checkpoint/ (training reads the checkpoint's draft file)")
    what = "folder holds no trained draft (checkpoint/draft.safetensors)" if path.is_dir() else "path does not exist"
    raise ConfigError(f"--init-from {path}: the {what}")


def init_draft_settings(path: str | Path, kind: str):
    """The settings (an instance of ``kind``'s config class) of the trained draft that ``init_weights_file(path)``
    names, for a run that starts from it. Raises ConfigError (no draft there; a file spire's trainer did not write)
    or CheckpointError (a draft of another kind, naming it)."""
    source = init_weights_file(path)
    meta = read_draft_meta(source)
    found = None if meta is None else draft_file_kind(meta)
    if found is None:
        raise ConfigError(f"--init-from {source}: not a draft file of spire's trainer (an export's weights?); give "
                          "the run folder that holds its checkpoint/")
    if found != kind:
        raise CheckpointError(f"--init-from {source}: {DRAFT_KIND_NAMES[found]} draft, not {kind} (--draft {found})")
    saved = meta[DRAFT_KIND_KEYS[kind]]
    if kind == "spire":
        return SpireConfig(**{**saved, "layers": None if saved.get("layers") is None else tuple(saved["layers"])})
    if kind == "eagle3":
        return Eagle3Config.from_dict(saved)
    return VanillaConfig(saved["n_layers"])


def ablation_config(name: str, **train_kw) -> TrainConfig:
    """A SPIRe TrainConfig with the paper's Figure 5 ablation ``name`` applied (see :data:`ABLATIONS`);
    settings given in ``train_kw`` win over the ablation's. Raises ConfigError for an unknown name."""
    if name not in ABLATIONS:
        raise ConfigError(f"unknown ablation {name!r}; choose one of {', '.join(ABLATIONS)}")
    spire_kw, cfg_kw = ABLATIONS[name]
    spire = train_kw.pop("draft_config", None) or SpireConfig()
    spire = SpireConfig(**{**spire.to_dict(), **spire_kw})
    return TrainConfig(**{**cfg_kw, **train_kw, "draft": "spire", "ablation": name, "draft_config": spire})


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


def load_state(out_dir: Path) -> dict | None:
    """The JSON training state of a run folder's last complete checkpoint, or None when there is none."""
    ckpt = existing_dir(Path(out_dir) / CHECKPOINT_DIR)
    if ckpt is None or not (ckpt / STATE_FILE).is_file():
        return None
    try:
        return json.loads((ckpt / STATE_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {ckpt / STATE_FILE} (damaged: {e}); resume from a copy of the run or "
                              "train into another --out") from e


def read_log(path: Path) -> tuple[list[dict], int]:
    """The entries of an append-only JSON-lines log and how many lines were dropped: a line that is not a whole
    JSON object (torn by a crash or a full disk while it was appended) is dropped, with everything after it."""
    rows: list[dict] = []
    lines = Path(path).read_text(errors="replace").splitlines()
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            row = json.loads(ln)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            return rows, sum(1 for x in lines[i:] if x.strip())
        rows.append(row)
    return rows, 0


def refuse_existing_run(out_dir: Path, state: dict | None) -> None:
    """Raise ConfigError when ``state`` (:func:`load_state` of ``out_dir``) is a saved run: a new run may not
    overwrite it."""
    if state is not None:
        raise ConfigError(f"{out_dir} already holds a run (step {state['step']}); pass --resume to continue it "
                          "or choose another --out")


def _distributed():
    """(torch.distributed or None, rank, world size)."""
    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_rank(), dist.get_world_size()
    return None, 0, 1


WAIT_DEADLINE = datetime.timedelta(days=7)
"""How long a process waits for work that rank 0 does alone (a target cache build, an evaluation, a checkpoint
write): far beyond any of them, where the process group's own default (30 minutes) is shorter than a cache
build of a large target (Lightning #19266)."""
_WAIT_GROUPS: dict = {}


def wait_for_rank0(dist_module) -> None:
    """A barrier over every process in a gloo group whose deadline is :data:`WAIT_DEADLINE` (created by the first
    call, which every process makes at the same point), for waits on rank-0-only work."""
    key = id(dist_module.distributed_c10d._get_default_group())
    if key not in _WAIT_GROUPS:
        _WAIT_GROUPS.clear()  # a group of an earlier process group is gone with it
        _WAIT_GROUPS[key] = dist_module.new_group(backend="gloo", timeout=WAIT_DEADLINE)
    dist_module.barrier(group=_WAIT_GROUPS[key])


def init_distributed() -> tuple[int, int]:
    """Initialize torch.distributed from torchrun's environment (WORLD_SIZE > 1): gloo on CPU, NCCL on CUDA.
    Returns (rank, world size); (0, 1) outside torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    _, rank, world = _distributed()
    return rank, world


RESUME_SETTINGS = ("budget_s", "max_steps", "checkpoint_every", "eval_every", "compile")
"""TrainConfig fields a resumed run may take anew: its limits, and how a step runs (compile), not what it computes.
Every other field must equal the saved run's."""


def _check_saved_config(out_dir: Path, state: dict, cfg_dict: dict) -> None:
    """Raise ConfigError when the run saved in out_dir has other settings than ``cfg_dict`` (those of
    :data:`RESUME_SETTINGS` may change; a field added since the run was saved reads as its default)."""
    defaults = json.loads(json.dumps(TrainConfig().to_dict()))
    merged = {k: {**defaults[k], **v} if isinstance(v, dict) and isinstance(defaults.get(k), dict) else v
              for k, v in state["config"].items()}  # a field added to a draft's config since reads as its default
    saved = {k: v for k, v in {**defaults, **merged}.items() if k not in RESUME_SETTINGS}
    now = {k: v for k, v in cfg_dict.items() if k not in RESUME_SETTINGS}
    if saved != now:
        diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        raise ConfigError(f"{out_dir} holds a run with other settings ({', '.join(diff)}); use another --out "
                          "or delete it")


class Trainer:
    """One training run in a run folder, in pieces: :meth:`__init__` (setup: settings, the saved run, the
    draft, the optimizer), :meth:`step` (one optimizer step and its log line), :meth:`checkpoint`,
    :meth:`evaluate` and :meth:`finish`; :func:`train_draft` drives them. Arguments as for :func:`train_draft`.
    """

    def __init__(self, target: Transformer, data, out_dir: Path, cfg: TrainConfig, heldout: torch.Tensor | None,
                 resume: bool | None, target_folder: Path | None, log) -> None:
        cfg.validate()
        if cfg.bf16 is None:
            cfg.bf16 = fast_bf16(target.device)
        self.dist, self.rank, self.world = _distributed()
        if cfg.batch_size % self.world:
            raise ConfigError(f"the global batch {cfg.batch_size} must be divisible by the {self.world} processes")
        if heldout is not None and heldout.shape[1] % cfg.k:
            raise ConfigError(f"held-out windows of {heldout.shape[1]} tokens are not a multiple of k={cfg.k}")
        self.target, self.data, self.out_dir, self.cfg, self.heldout = target, data, Path(out_dir), cfg, heldout
        self.target_folder, self.log = target_folder, log
        self.bar = self.source = None
        self.ema_loss = self.ema_alpha = None
        self.hidden_mismatch: float | None = None  # the last step's hidden-state mismatch (hidden_weight > 0)
        self.started: dict | None = None  # what the draft did before a fresh run's first step (its log event)
        if self.rank == 0:  # the lock is held: what a killed writer left half-written is removed
            remove_stale_temporaries(self.out_dir)
        self.model = self._setup_model(resume)
        self.meta = {"ablation": cfg.ablation, "loss": cfg.resolved_loss(), "omega": cfg.omega, "k": cfg.k}
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = make_optimizer(self.params, cfg, backend_of(self.model))
        ckpt = existing_dir(self.out_dir / CHECKPOINT_DIR)
        if ckpt is not None and self.state["step"] > 0:
            if not (ckpt / OPTIM_FILE).is_file():
                raise CheckpointError(f"{ckpt} holds no {OPTIM_FILE}: the checkpoint is incomplete and cannot be "
                                      "resumed exactly")
            # onto this run's device, whichever device wrote it (a GPU run resumed on a CPU, or the reverse)
            self.opt.load_state_dict(torch.load(ckpt / OPTIM_FILE, map_location=target.device, weights_only=True))
            for group in self.opt.param_groups:  # a saved group names its implementation: keep this trainer's
                group.update(fused=self.opt.defaults.get("fused"), foreach=self.opt.defaults.get("foreach"))
        if self.rank == 0 and (self.out_dir / LOG_FILE).is_file():  # drop log lines written after the checkpoint
            rows, torn = read_log(self.out_dir / LOG_FILE)
            if torn and log is not None:
                log(f"      dropped {torn} torn line(s) at the end of {self.out_dir / LOG_FILE} (a crash or a full disk "
                    "while it was written)")
            atomic_write(self.out_dir / LOG_FILE, None,
                         "".join(json.dumps(r) + "\n" for r in rows if r.get("step", 0) <= self.state["step"]))

    def _setup_model(self, resume: bool | None) -> TrainableDraft:
        """The draft, and ``self.state``: from the saved run (checked against the settings), or fresh."""
        out_dir, cfg = self.out_dir, self.cfg
        state = load_state(out_dir)
        cfg_dict = json.loads(json.dumps(cfg.to_dict()))
        if resume is True and state is None:
            raise CheckpointError(f"nothing to resume: {out_dir} holds no checkpoint")
        if resume is False:
            refuse_existing_run(out_dir, state)
        model = _build_model(self.target, cfg, self.data)
        if state is not None:
            _check_saved_config(out_dir, state, cfg_dict)
            model.load_checkpoint(existing_dir(out_dir / CHECKPOINT_DIR) / DRAFT_FILE, self.target)
        else:
            source = None if cfg.init_from is None else self._init_from(model)  # before anything is written
            state = {"step": 0, "tokens": 0, "elapsed_s": 0.0, "finished": False, "history": [], "heldout": None}
            if self.rank == 0:
                out_dir.mkdir(parents=True, exist_ok=True)
                atomic_write(out_dir / LOG_FILE, None, "")
            if source is not None:  # a trained draft's weights (its bridge, if any, came fitted with them)
                event = {"event": "init", "from": str(source), "message": f"starting from the draft {source}"}
            else:
                start = getattr(model, "start_training", None)  # e.g. SPIRe's bridge, fitted to the target
                event = start(self.data, cfg) if start is not None else None
            if event is not None:  # logged as an event; its "message" is shown after the banner
                self.write_log({**{k: v for k, v in event.items() if k != "message"}, "step": 0})
                self.started = event
        state["config"] = cfg_dict
        state["heldout_windows"] = 0 if self.heldout is None else int(self.heldout.shape[0])  # for a resume
        self.state = state
        # which path runs: at the start, and at a resume that runs another way (the same results to rounding)
        backend = backend_of(model).describe()
        if state["step"] == 0 or backend != self._logged_backend():
            self.write_log({"event": "backend", "step": state["step"], **backend})
        return model.train()

    def _init_from(self, model: TrainableDraft) -> Path:
        """Load ``cfg.init_from``'s weights into ``model``; returns the draft file read. Raises ConfigError (no
        draft there) or CheckpointError (another kind, other settings or another target)."""
        source = init_weights_file(self.cfg.init_from)
        init_draft_settings(source, self.cfg.draft)  # a draft of this kind (each kind's loader checks its settings)
        model.load_checkpoint(source, self.target)
        return source

    def _logged_backend(self) -> dict | None:
        """The last backend the run's log records (without its event and step), or None."""
        path = self.out_dir / LOG_FILE
        rows = read_log(path)[0] if path.is_file() else []
        last = next((r for r in reversed(rows) if r.get("event") == "backend"), None)
        return None if last is None else {k: v for k, v in last.items() if k not in ("event", "step")}

    def done(self) -> bool:
        cfg, state = self.cfg, self.state
        return state["elapsed_s"] >= cfg.budget_s or (cfg.max_steps is not None and state["step"] >= cfg.max_steps)

    def start(self, progress: bool) -> None:
        """The data source (a target cache may be built first, with its own bar) and the training bar."""
        cfg, state, rank = self.cfg, self.state, self.rank
        if self.done() and state["finished"]:
            if self.log is not None and rank == 0:
                self.log(f"      {self.out_dir.name}: finished run found ({state['step']} steps), not trained again")
            progress = False  # nothing to train: no bar
        elif not self.done():
            self.source = make_source(self.target, self.data, self.model, cfg, self.target_folder,
                                      progress and rank == 0, self.log if rank == 0 else None)
        if progress and rank == 0:
            total, initial, unit = ((cfg.max_steps, state["step"], "step") if cfg.max_steps is not None
                                    else (round(cfg.budget_s), round(state["elapsed_s"]), "s"))
            self.bar = tqdm(total=total, initial=initial, unit=unit, dynamic_ncols=True,
                            desc=f"train {cfg.draft} draft")

    def rows(self) -> slice:
        """This process's rows of the global batch."""
        return slice(self.rank * self.cfg.batch_size // self.world, (self.rank + 1) * self.cfg.batch_size // self.world)

    def warm_up(self) -> None:
        """With cfg.compile: compile the draft's training step (:func:`compile_draft`) on this process's rows of the
        next batch, two forwards and backwards whose gradients are dropped, before the training clock starts; its
        seconds go to the log (a "compile" event; "compiled" false when any process trains eagerly). Where
        torch.compile fails (no C++ compiler, a backend it lacks, an interpreter it refuses) training goes on
        eagerly, with a log line: the same computation, slower. Under data parallelism the processes wait for each
        other here, so no compile falls into the first step's time."""
        if not self.cfg.compile or self.done():
            return
        show = self.log if self.rank == 0 else None
        if show is not None:
            (self.bar.write if self.bar is not None else show)(
                "      compiling the draft's training step (torch.compile: minutes the first time on this machine)")
        t0, ok = time.time(), True
        tb = self.source.batch(self.state["step"], self.rows())
        try:
            compile_draft(self.model)  # torch.compile itself refuses some interpreters
            # twice: the second pass recompiles the pieces whose guards the first one's side effects changed (the
            # bf16 weight copies it kept); cold, that recompile took ~2 minutes of the first training step
            for _ in range(2):
                loss, _ = step_loss(self.model, self.target, tb, self.cfg)
                loss.backward()
        except Exception as e:  # torch._dynamo / inductor errors: train eagerly instead
            uncompile_draft(self.model)
            ok = False
            if show is not None:
                first = (str(e).strip().splitlines() or [""])[0][:200]
                show(f"      torch.compile failed here ({type(e).__name__}: {first}); training without it (after an "
                     f"interrupted compile, delete inductor's cache folder: {_inductor_cache()})")
        finally:
            for p in self.params:
                p.grad = None
        if self.dist is not None:  # every process compiled (or not) before the clock starts; the log says if all did
            flag = torch.tensor([float(ok)], device=self.target.device)
            self.dist.all_reduce(flag, op=self.dist.ReduceOp.MIN)
            ok = bool(flag.item())
        self.write_log({"event": "compile", "step": self.state["step"], "seconds": round(time.time() - t0, 1),
                        "compiled": ok})

    def write_log(self, entry: dict) -> None:
        if self.rank == 0:
            with open(self.out_dir / LOG_FILE, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def evaluate(self) -> None:
        """The held-out loss and alpha (when there are held-out windows), logged and kept in the state."""
        if self.heldout is None:
            return
        state = self.state
        if self.dist is not None:  # rank 0 evaluates with every process's threads while the others wait
            ev = None
            if self.rank == 0:
                threads = torch.get_num_threads()
                torch.set_num_threads(threads * self.world)
                ev = evaluate_heldout(self.model, self.target, self.heldout, self.cfg)
                torch.set_num_threads(threads)
            wait_for_rank0(self.dist)
            if ev is None:
                return
        else:
            ev = evaluate_heldout(self.model, self.target, self.heldout, self.cfg)
        self.model.train()
        if not all(math.isfinite(v) for v in (ev["loss"], ev["alpha"])):  # a draft that cannot be used: no write
            self.stop(f"non-finite held-out loss ({ev['loss']}) or alpha ({ev['alpha']}) at step {state['step']}",
                      "lower --lr or check the data")
        state["heldout"] = {"step": state["step"], **ev}
        self.write_log({"event": "eval", "step": state["step"], "tokens": state["tokens"], **ev})
        if self.bar is not None:
            self.bar.write(f"step {state['step']}: held-out loss {ev['loss']:.4f}, alpha "
                           + " ".join(f"{a:.3f}" for a in ev["alpha_per_position"]))

    def stop(self, what: str, advice: str) -> None:
        """Raise TrainingError for ``what`` (a non-finite value): the run stops, its last good checkpoint kept."""
        if self.bar is not None:
            self.bar.close()
        last = load_state(self.out_dir)
        raise TrainingError(f"{what}; the last good checkpoint (step {last['step'] if last else 0}) in "
                            f"{self.out_dir} is kept: {advice}")

    def checkpoint(self) -> None:
        """Replace the checkpoint folder (weights, AdamW state, JSON state) and the exported draft (rank 0). Weights
        with a NaN or infinite value are never written: TrainingError, the last good checkpoint kept."""
        model, target, state, meta = self.model, self.target, self.state, self.meta
        bad = next((n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())), None)
        if bad is not None:
            self.stop(f"the draft's weight {bad!r} holds NaN or infinite values at step {state['step']}",
                      "lower --lr or check the data")
        if self.rank == 0:
            def write(tmp: Path) -> None:
                model.save_checkpoint(tmp / DRAFT_FILE, target, {"train": {"step": state["step"]}, **meta})
                torch.save(self.opt.state_dict(), tmp / OPTIM_FILE)
                (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            replace_dir(self.out_dir / CHECKPOINT_DIR, write)
            model.export(self.out_dir, target, {"train": {"step": state["step"], "tokens": state["tokens"],
                                                          "finished": state["finished"]}, **meta}, self.target_folder)
        if self.dist is not None:
            wait_for_rank0(self.dist)

    def finish(self) -> tuple[TrainableDraft, dict]:
        """Mark the run finished (a last evaluation and checkpoint when it was not); the draft in eval mode."""
        if not self.state["finished"]:
            self.state["finished"] = True
            self.evaluate()
            self.checkpoint()
        if self.bar is not None:
            self.bar.close()
        uncompile_draft(self.model)
        return self.model.eval().requires_grad_(False), self.state

    def _update(self, lr: float, tb: TeacherBatch) -> tuple[float, float, float]:
        """Loss, backward, gradients averaged over the processes, clip, AdamW: (loss, alpha, grad norm).
        Raises TrainingError on a non-finite loss (before the update)."""
        cfg, state, dist, world = self.cfg, self.state, self.dist, self.world
        for g in self.opt.param_groups:
            g["lr"] = lr
        parts: dict = {}
        ce_scale = 1.0
        if dist is not None and cfg.resolved_loss() == "hard" and self.model.vocab is not None:
            # a draft vocabulary leaves each process its own count of valid targets: weigh its mean by its share
            # of the global count, so the averaged gradient is that of the mean over every valid target (as one
            # process computes it); a process without any contributes zero
            mine = float((self.model.to_draft_ids(tb.tokens[:, 1:]) >= 0).sum())
            total = torch.tensor([mine], dtype=torch.float64, device=self.target.device)
            dist.all_reduce(total)
            ce_scale = world * mine / max(float(total), 1.0)
        loss, alpha = step_loss(self.model, self.target, tb, cfg, parts, ce_scale)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        # the logged values in one tensor (NCCL: on the device), read back once below
        stats = torch.stack([loss.detach().float(), alpha.float(),
                             parts["hidden"].float() if "hidden" in parts else torch.zeros_like(alpha.float())])
        if dist is not None:  # average gradients (and the logged values) over the processes
            grads = [p.grad for p in self.params if p.grad is not None]
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat)
            flat /= world
            for g, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(new)
            dist.all_reduce(stats)
            stats /= world
        norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)  # a non-finite loss stops before the update
        # the step's one host sync: the values its log line writes
        loss_value, alpha, hidden, grad_norm = torch.cat([stats, norm.detach().float().reshape(1)]).tolist()
        self.hidden_mismatch = hidden if "hidden" in parts else None
        if not math.isfinite(loss_value):
            self.stop(f"non-finite loss ({loss_value}) at step {state['step'] + 1} (lr {lr:.2e})",
                      "lower --lr or check the data")
        if not math.isfinite(grad_norm):  # the update would write inf / NaN into the weights: stop before it
            self.stop(f"non-finite gradient norm ({grad_norm}) at step {state['step'] + 1} (loss {loss_value:.4g}, "
                      f"lr {lr:.2e})", "lower --lr or --grad-clip, or train without --bf16")
        self.opt.step()
        return loss_value, alpha, grad_norm

    def step(self) -> None:
        """One optimizer step on the batch of step ``state["step"]`` (this process's rows), its log line, the
        smoothed history and the bar."""
        cfg, state = self.cfg, self.state
        t0 = time.time()
        tb = self.source.batch(state["step"], self.rows())
        frac = state["step"] / cfg.max_steps if cfg.max_steps is not None else state["elapsed_s"] / cfg.budget_s
        lr = _lr_at(cfg, state["step"], frac)
        loss_value, alpha, grad_norm = self._update(lr, tb)
        dt = time.time() - t0
        if self.dist is not None:  # every process stops at the same step: rank 0's clock decides
            t = torch.tensor([dt], dtype=torch.float64, device=self.target.device)
            self.dist.broadcast(t, 0)
            dt = float(t)
        state["step"] += 1
        state["tokens"] += cfg.batch_size * cfg.seq_len
        state["elapsed_s"] += dt
        self.ema_loss = loss_value if self.ema_loss is None else 0.95 * self.ema_loss + 0.05 * loss_value
        if math.isfinite(alpha):
            self.ema_alpha = alpha if self.ema_alpha is None else 0.95 * self.ema_alpha + 0.05 * alpha
        entry = {"event": "train", "step": state["step"], "tokens": state["tokens"],
                 "elapsed_s": round(state["elapsed_s"], 3), "lr": lr, "loss": loss_value,
                 "alpha": alpha if math.isfinite(alpha) else None, "grad_norm": grad_norm,
                 "tokens_per_s": cfg.batch_size * cfg.seq_len / dt}
        if self.hidden_mismatch is not None:  # the matching term before its weight (loss includes weight × it)
            entry["hidden_mismatch"] = self.hidden_mismatch
        self.write_log(entry)
        if state["step"] % 10 == 0 or self.done():
            state["history"].append({"step": state["step"], "tokens": state["tokens"],
                                     "elapsed_s": round(state["elapsed_s"], 2), "loss": round(self.ema_loss, 4),
                                     "alpha": None if self.ema_alpha is None else round(self.ema_alpha, 4)})
        if self.bar is not None:
            bar = self.bar
            bar.update((state["step"] if cfg.max_steps is not None else round(state["elapsed_s"])) - bar.n)
            bar.set_postfix(loss=f"{self.ema_loss:.3f}", alpha="-" if self.ema_alpha is None else
                            f"{self.ema_alpha:.3f}", tok_s=f"{entry['tokens_per_s']:.0f}")


def train_draft(target: Transformer, data, out_dir: Path, cfg: TrainConfig | None = None,
                heldout: torch.Tensor | None = None, resume: bool | None = None, target_folder: Path | None = None,
                progress: bool = True, log=print, banner: str | None = None) -> tuple[TrainableDraft, dict]:
    """Train (or resume, or just load when finished) a draft in ``out_dir``.

    Args:
        target: frozen target model (float32 weights; bf16 autocast is used when cfg.bf16).
        data: an object with ``sample_train_batch(batch_size, seq_len, generator) -> (B, T) LongTensor``.
        out_dir: run folder (created); see the module docstring for its layout.
        cfg: :class:`TrainConfig`.
        heldout: optional (N, T) held-out windows (T a multiple of k) for the logged held-out loss and alpha.
        resume: True: continue the run in out_dir (CheckpointError if there is none); False: start a new run
            (ConfigError if out_dir already holds one); None: continue if there is one, else start.
        target_folder: the target's HF folder (its tokenizer files go into an exported vanilla draft).
        banner: a line for ``log`` (rank 0) once the settings, the saved run and its checkpoint have been checked
            and loaded, before any long work (a target cache, the steps): an error above comes before it.
    Returns:
        (draft model in eval mode, state dict with "step", "tokens", "elapsed_s", "finished", "history",
        "heldout" (the last evaluation), "config").
    Raises:
        ConfigError: invalid settings, a batch not divisible by the number of processes, or a saved run in
            out_dir with different settings. TrainingError: a non-finite loss (the last checkpoint is kept).
        CheckpointError / TokenizerMismatchError: unreadable checkpoint, or one for another target.
        DataError: the data cannot give windows of seq_len tokens.
    """
    cfg = TrainConfig() if cfg is None else cfg
    cfg.validate()  # impossible settings are refused before the folder is touched
    _, rank, _ = _distributed()
    if resume is not True and load_state(Path(out_dir)) is None:
        check_fresh_folder(out_dir)  # before the lock file or anything else is written
    with RunLock(out_dir, log) if rank == 0 else contextlib.nullcontext():
        return _train_locked(target, data, out_dir, cfg, heldout, resume, target_folder, progress, log, banner)


def _train_locked(target, data, out_dir, cfg, heldout, resume, target_folder, progress, log, banner):
    """:func:`train_draft` while rank 0 holds the run folder's lock."""
    run = Trainer(target, data, out_dir, cfg, heldout, resume, target_folder, log)
    if banner is not None and log is not None and run.rank == 0:
        log(banner)
    if run.started is not None and run.started.get("message") and log is not None and run.rank == 0:
        log(f"      {run.started['message']}")
    run.start(progress)
    if run.done():
        return run.finish()
    run.state["finished"] = False  # a finished run given a larger budget goes on
    # checkpoints every checkpoint_every seconds of training time: state["elapsed_s"] sums rank 0's step times,
    # broadcast, so every process decides alike (a clock of each process's own let one enter the checkpoint's
    # barrier while another entered the next step's all-reduce: a hang)
    last_ckpt = run.state["elapsed_s"]
    try:
        run.warm_up()
        while not run.done():
            run.step()
            if cfg.eval_every and run.state["step"] % cfg.eval_every == 0 and not run.done():
                run.evaluate()
            if run.state["elapsed_s"] - last_ckpt > cfg.checkpoint_every and not run.done():
                run.checkpoint()
                last_ckpt = run.state["elapsed_s"]
    except KeyboardInterrupt:  # close the bar first: what the caller prints next is not overdrawn
        if run.bar is not None:
            run.bar.close()
        raise
    return run.finish()


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
