"""The settings of a training run and its on-disk layout: :class:`TrainConfig` (validated, written to and read
from a run folder's ``checkpoint/train_state.json``), the file names of a run folder, the paper's Figure 5
ablations, and the settings of a trained draft a run starts from (``--init-from``).

Run folder layout: ``checkpoint/`` (draft.safetensors, optimizer.pt, train_state.json), ``train_log.jsonl``
(one JSON object per logged step and per held-out evaluation) and the exported draft:
``draft.safetensors`` (SPIRe; ``spire generate --draft spire --draft-path``) or ``draft/`` (vanilla, an HF
Llama folder; ``--draft vanilla --draft-path``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from spire import defaults
import spire.registry as registry
from spire.drafts.eagle3 import Eagle3Config
from spire.drafts.spire import SpireConfig
from spire.drafts.vanilla import VanillaConfig
from spire.errors import CheckpointError, ConfigError
from spire.formats.draft_file import DRAFT_KIND_KEYS, DRAFT_KIND_NAMES, draft_file_kind, read_draft_meta
from spire.paths import existing_dir
from spire.training.sources import STORAGE_DTYPES

CHECKPOINT_DIR = "checkpoint"
DRAFT_FILE = "draft.safetensors"
STATE_FILE = "train_state.json"
OPTIM_FILE = "optimizer.pt"
LOG_FILE = "train_log.jsonl"
"""TrainConfig.draft -> the draft class trained for it (each implements :class:`spire.drafts.base.TrainableDraft`)."""
DRAFT_KINDS = registry.names(trains=True)
"""The kinds `spire train` trains (their ``KIND.model`` classes: :func:`spire.registry.trainable_class`)."""
LOSSES = ("mixed", "hard", "kl", "lk")
STATE_KEY_ORDER = ("spire", "eagle3", "vanilla_layers")
"""The order in which a run's ``train_state.json`` has held the settings under the registry's state keys
(:attr:`spire.registry.Kind.state_key`) since before the draft config classes: :meth:`TrainConfig.to_dict` writes
them in it (then any other state key, in the registry's order), so that a checkpoint's file keeps its bytes."""

# The paper's Figure 5 ablations: name -> (SpireConfig overrides, TrainConfig overrides); the paper's tau for each
# is spire.paper.PAPER_ABLATION_TAU (SPIRE.md §3.7; full-kv changes the cost, not tau, in the paper's figure).
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
    kind's defaults for the kinds not trained (:meth:`to_dict`, :meth:`from_dict`); the keys are the registry
    lines' (:attr:`spire.registry.Kind.state_key`, and :attr:`~spire.registry.Kind.config_key` for a kind added
    since, saved in its own runs only). A kind's config class gives ``to_dict()`` and a ``from_dict(d)``
    classmethod (and may give ``to_state()`` / ``from_state(value)`` for another form in ``train_state.json``).
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
        if self.draft_config is None and self.draft in registry.names(trains=True):
            self.draft_config = registry.trainable_class(self.draft).config_class()

    def resolved_loss(self) -> str:
        """The loss given, else the draft method's default (SPIRe: mixed, vanilla: hard)."""
        if self.loss:
            return self.loss
        trained = registry.names(trains=True)
        return getattr(registry.trainable_class(self.draft), "default_loss", "mixed") if self.draft in trained else "mixed"

    def validate(self) -> None:
        """Raise ConfigError for impossible settings."""
        if self.draft not in registry.names(trains=True):
            raise ConfigError(f"--draft must be one of {', '.join(registry.names(trains=True))}, got {self.draft!r}")
        config_class = registry.trainable_class(self.draft).config_class
        if not isinstance(self.draft_config, config_class):
            raise ConfigError(f"a {self.draft} draft's settings are a {config_class.__name__}, got "
                              f"{type(self.draft_config).__name__}")
        if not self.budget_s > 0:
            raise ConfigError(f"--budget must be positive, got {self.budget_s:g} s")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"--max-steps must be >= 1, got {self.max_steps}")
        for flag, value, least in (("-k", self.k, 1), ("--batch-size", self.batch_size, 1),
                                   ("--seq-len", self.seq_len, 2)):
            if value < least:
                raise ConfigError(f"{flag} must be >= {least}, got {value}")
        if self.seq_len % self.k:
            raise ConfigError(f"--seq-len {self.seq_len} must be a multiple of -k {self.k}")
        if not 0 <= self.omega <= 1:
            raise ConfigError(f"--omega must be in [0, 1], got {self.omega}")
        if self.resolved_loss() not in LOSSES:
            raise ConfigError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
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
            raise ConfigError(f"--cache-steps must be >= 1, got {self.data_steps}")
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
        """The settings as JSON holds them, in the on-disk layout (see the class docstring): a run's identity and
        cache key are computed from it. Each trained kind's settings (:func:`state_value`) under its registry line's
        ``state_key`` in every run (``spire``, ``eagle3``, ``vanilla_layers``: the kind's defaults when another kind
        is trained), or, for a kind without one, under its ``config_key`` in its own runs only (so that adding a
        kind leaves the settings of other runs as they were). ``init_from`` only when given, so that the settings of
        runs from before the field existed read and write back unchanged. Raises ConfigError for a trained kind
        whose line names no key."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "draft_config"}
        if d["init_from"] is None:
            del d["init_from"]

        def order(name: str) -> int:  # STATE_KEY_ORDER's, then the registry's (a stable sort)
            key = registry.kind(name).state_key
            return STATE_KEY_ORDER.index(key) if key in STATE_KEY_ORDER else len(STATE_KEY_ORDER)

        for name in sorted(registry.names(trains=True), key=order):
            line = registry.kind(name)
            if line.state_key is not None:
                own = self.draft_config if self.draft == name else registry.trainable_class(name).config_class()
                d[line.state_key] = state_value(own)
            elif self.draft == name:
                if line.config_key is None:
                    raise ConfigError(f"draft {name!r} is trained but its registry line names no config_key: "
                                      "its settings could not be saved")
                d[line.config_key] = state_value(self.draft_config)
        d["loss"] = self.resolved_loss()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """The TrainConfig of :meth:`to_dict`'s layout (a saved run's); fields it does not know raise
        ConfigError."""
        d = dict(d)
        draft = d.get("draft", "spire")
        saved = {}
        for name in registry.names(trains=True):
            line = registry.kind(name)
            key = line.state_key or line.config_key
            if key is not None:
                saved[name] = d.pop(key, None)
        known = {f.name for f in fields(cls)} - {"draft_config"}
        if set(d) - known:
            raise ConfigError(f"unknown training settings {', '.join(sorted(set(d) - known))}")
        own = from_state_value(draft, saved[draft]) if draft in saved else None
        return cls(**d, draft_config=own)


def state_value(config):
    """A draft config (an instance of a trained kind's config class) as a run's ``train_state.json`` holds it: its
    ``to_state()`` when its class defines one (vanilla's ``n_layers``, the layout of before the config classes),
    else its ``to_dict()``."""
    to_state = getattr(config, "to_state", None)
    return to_state() if to_state is not None else config.to_dict()


def from_state_value(kind: str, value):
    """The settings of trained kind ``kind`` from :func:`state_value`'s form (None or empty: its defaults): its
    config class's ``from_state`` when it defines one, else its ``from_dict``. Raises ConfigError for a kind
    `spire train` does not train."""
    config_class = registry.trainable_class(kind).config_class
    from_state = getattr(config_class, "from_state", None)
    if from_state is not None:
        return from_state(value)
    return config_class.from_dict(value) if value else config_class()


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
    return registry.trainable_class(kind).config_class.from_dict(meta[DRAFT_KIND_KEYS[kind]])


def ablation_config(name: str, **train_kw) -> TrainConfig:
    """A SPIRe TrainConfig with the paper's Figure 5 ablation ``name`` applied (see :data:`ABLATIONS`);
    settings given in ``train_kw`` win over the ablation's. Raises ConfigError for an unknown name."""
    if name not in ABLATIONS:
        raise ConfigError(f"unknown ablation {name!r}; choose one of {', '.join(ABLATIONS)}")
    spire_kw, cfg_kw = ABLATIONS[name]
    spire = train_kw.pop("draft_config", None) or SpireConfig()
    spire = SpireConfig(**{**spire.to_dict(), **spire_kw})
    return TrainConfig(**{**cfg_kw, **train_kw, "draft": "spire", "ablation": name, "draft_config": spire})
