"""`spire train`: load the target and the text, build the run's :class:`TrainConfig`, train, summarise.

Works the same in one process and under ``torchrun --nproc_per_node N`` (data parallel; see
:mod:`spire.training.trainer`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from spire import defaults, registry
from spire.commands.options import train_options
from spire.data import document_separator_id, prepare_data, prepare_text_files
from spire.errors import CheckpointError, ConfigError
from spire.loading import load_target
from spire.paths import atomic_write, check_output_path
from spire.training.checkpoint import RESUME_SETTINGS, load_state, refuse_existing_run
from spire.training.config import ABLATIONS, TrainConfig, ablation_config, init_draft_settings, init_weights_file
from spire.training.ranks import init_distributed
from spire.training.trainer import limits_reached, train_draft
from spire.training.runfolder import RunLock, check_fresh_folder

COMMAND_DEFAULTS = {"eval_every": defaults.EVAL_EVERY}
"""Where `spire train` differs from TrainConfig's defaults: it logs a held-out learning curve."""
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainRunArgs:
    """What `spire train` was asked for. ``data``: "registry" (the registry texts of `spire data`) or paths of
    text files / folders. ``draft_overrides``: the draft config fields given explicitly, by kind
    ({"spire": {"window": 32}}; they win over --ablation; those of another kind than ``draft`` are refused).
    ``train_overrides``: TrainConfig fields given explicitly (:data:`COMMAND_DEFAULTS` fill the others first).
    With ``resume`` only the :data:`spire.training.checkpoint.RESUME_SETTINGS` of ``train_overrides`` apply."""

    draft: str = "spire"
    target: str = "smollm2-135m"
    data: list[str] = field(default_factory=lambda: ["registry"])
    out: Path | None = None
    ablation: str = "none"
    resume: bool = False
    device: str = "auto"
    device_memory: str | None = None  # --device-memory (spire.memory_plan.device_memory)
    eval_windows: int | None = None  # None: 16, or a resumed run's own
    draft_overrides: dict[str, dict] = field(default_factory=dict)
    train_overrides: dict = field(default_factory=dict)
    given: tuple[str, ...] = ()  # of "draft", "ablation": those the user set (a resume checks them)

    def settings(self) -> dict:
        """The TrainConfig fields of this command: its defaults, then what was given."""
        return {**COMMAND_DEFAULTS, **self.train_overrides}

    def resume_limits(self) -> dict:
        """The new limits of a resumed run: those given (the others stay the run's own)."""
        return {k: v for k, v in self.train_overrides.items() if k in RESUME_SETTINGS}


def default_out(args: TrainRunArgs) -> Path:
    """``spire-runs/<draft>[-<ablation>]`` in the working folder."""
    name = args.draft if args.ablation == "none" else f"{args.draft}-{args.ablation}"
    return Path("spire-runs") / name


TRAIN_FIELDS = {"budget": "budget_s", "max_steps": "max_steps", "batch_size": "batch_size", "seq_len": "seq_len",
                "k": "k", "lr": "lr", "warmup_steps": "warmup_steps", "weight_decay": "weight_decay", "loss": "loss",
                "omega": "omega", "grad_clip": "grad_clip", "bf16": "bf16", "seed": "seed",
                "checkpoint_every": "checkpoint_every", "eval_every": "eval_every",
                "cache_steps": "data_steps", "target_cache": "target_cache", "hidden_loss": "hidden_weight",
                "compile_step": "compile", "init_from": "init_from"}
"""`spire train` option (parameter name) -> TrainConfig field."""
DRAFT_FIELDS = registry.KindTable(lambda k: {o.param: o.field for o in k.train_options if not o.switch} or None)
"""`spire train` options of one trainable kind: kind -> {option (parameter name) -> field of its config class}: a
view of the kinds' declared options (:attr:`spire.registry.Kind.train_options`)."""
DRAFT_SWITCHES = registry.KindTable(lambda k: {o.param: (o.field, o.value) for o in k.train_options if o.switch}
                                    or None)
"""`spire train` flags that set a field of a kind's config: kind -> {flag parameter -> (field, value when given)}:
a view of the kinds' declared options."""


def deprecated() -> dict[str, str]:
    """`spire train` options that still work under an old name: old parameter -> new one (the name `spire
    reproduce` gives the same setting), from the kinds' declared options (:attr:`spire.registry.TrainOption.old`).
    Using the old one prints a warning."""
    return {old: o.param for _, o in train_options() for old in o.old}


DEPRECATED = deprecated()
""":func:`deprecated` of the registry's lines at import."""


def _flag(param: str) -> str:
    """The command-line flag of a parameter name: draft_vocab -> --draft-vocab."""
    return "--" + param.replace("_", "-")


def draft_option(kind: str, field_name: str, value) -> str:
    """The `spire train` option that set field ``field_name`` of a ``kind`` draft's config to ``value`` (for error
    messages): a switch that sets it to that value, else the value option of the field, else the field's name."""
    declared = registry.kind(kind).train_options
    for o in declared:
        if o.switch and o.field == field_name and o.value == value:
            return o.flag_name
    return next((o.flag_name for o in declared if not o.switch and o.field == field_name), field_name)


def args_from_options(params: dict, given: dict, log: Callable[[str], None] = print) -> TrainRunArgs:
    """The :class:`TrainRunArgs` of `spire train`'s options. ``params``: every option by parameter name (as typer
    parsed them); ``given``: those the user set (the library's defaults stand for the others). An old option name
    (:data:`DEPRECATED`) is read as its new one, with one warning line through ``log`` (the new one wins when
    both are given). Raises ConfigError for a malformed --layers or --eagle3-layers."""
    given = dict(given)
    for old, new in deprecated().items():
        if old in given:
            log(f"warning: {_flag(old)} is deprecated; use {_flag(new)}")
            given.setdefault(new, given.pop(old))
    values = {**params, **given}
    draft_kw = {}
    for kind in registry.names(trains=True):  # each kind's declared options: values, then switches
        declared = registry.kind(kind).train_options
        kw = {o.field: o.convert(values[o.param]) if o.convert else values[o.param] for o in declared
              if not o.switch and values.get(o.param) is not None}
        kw.update((o.field, o.value) for o in declared if o.switch and params.get(o.param))
        if kw:
            draft_kw[kind] = kw
    train_kw = {field: given[name] for name, field in TRAIN_FIELDS.items() if given.get(name) is not None}
    if train_kw.get("init_from") is not None:  # the run's settings hold it: a folder-independent path
        if not params["resume"]:  # (a resume reads its own checkpoint only)
            init_weights_file(train_kw["init_from"])
        train_kw["init_from"] = str(Path(train_kw["init_from"]).resolve())
    if train_kw.get("target_cache") == "none":  # as in `spire reproduce`: the live target (the default)
        train_kw["target_cache"] = None
    return TrainRunArgs(draft=params["draft"], target=params["target"], data=params["data"], out=params["out"],
                        ablation=params["ablation"], resume=params["resume"], device=params["device"],
                        device_memory=params.get("device_memory"),
                        eval_windows=params["eval_windows"], draft_overrides=draft_kw, train_overrides=train_kw,
                        given=tuple(name for name in ("draft", "ablation") if name in given))


def _refuse_foreign(args: TrainRunArgs, draft: str | None = None) -> None:
    """ConfigError naming the options given for another kind than ``draft`` (default ``args.draft``; a resumed
    run's own kind on --resume)."""
    draft = draft or args.draft
    for kind, kw in args.draft_overrides.items():
        if kind != draft and kw:
            names = ", ".join(draft_option(kind, k, v) for k, v in kw.items())
            one = "an option" if len(kw) == 1 else "options"
            raise ConfigError(f"{names}: {one} of --draft {kind}, not of --draft {draft}")


def build_config(args: TrainRunArgs) -> TrainConfig:
    """The run's TrainConfig: the ablation's settings, then the explicit options. Raises ConfigError."""
    if args.ablation not in ABLATIONS:
        raise ConfigError(f"unknown ablation {args.ablation!r}; choose one of {', '.join(ABLATIONS)}")
    if args.draft != "spire" and args.ablation != "none":
        raise ConfigError(f"--ablation {args.ablation} applies to --draft spire only")
    _refuse_foreign(args)
    if args.draft == "spire":
        cfg = ablation_config(args.ablation, **args.settings())
    else:
        cfg = TrainConfig(draft=args.draft, **args.settings())
    own = args.draft_overrides.get(args.draft)
    if cfg.init_from is not None:  # the trained draft's own settings, then what the ablation and options set
        ablation = ABLATIONS[args.ablation][0] if args.draft == "spire" else {}
        cfg.draft_config = replace(init_draft_settings(cfg.init_from, args.draft), **{**ablation, **(own or {})})
    elif own and cfg.draft_config is not None:
        cfg.draft_config = replace(cfg.draft_config, **own)
    cfg.validate()
    return cfg


def _plain(v):
    """A setting as JSON holds it (tuples as lists), for comparing with a saved run's."""
    return list(v) if isinstance(v, (tuple, list)) else v


def saved_config(out: Path, limits: dict, args: TrainRunArgs | None = None, log=print) -> TrainConfig:
    """The TrainConfig of the run saved in ``out`` (:meth:`TrainConfig.from_dict`: run folders of every spire
    version), with new limits (:data:`spire.training.checkpoint.RESUME_SETTINGS`) applied. Raises CheckpointError when
    there is nothing to resume, ConfigError when ``args`` give settings other than the limits that differ from the
    saved run's (a resume keeps its settings). How new limits change the run goes to ``log``, a line each
    (:func:`resume_notes`), unless they leave it nothing to train; a run that ended at its time budget and is
    given more steps (--max-steps without --budget) trains them: its budget is lifted."""
    state = load_state(out)
    if state is None:
        raise CheckpointError(f"nothing to resume: {out} holds no checkpoint")
    saved = TrainConfig.from_dict(state["config"])
    if args is not None:
        changed = sorted(k for k, v in args.train_overrides.items()
                         if k not in RESUME_SETTINGS and _plain(getattr(saved, k)) != _plain(v))
        changed += [name for name in ("draft", "ablation") if name in args.given and getattr(args, name) != getattr(saved, name)]
        _refuse_foreign(args, saved.draft)
        own = saved.draft_config
        changed += sorted(draft_option(saved.draft, k, v) for k, v in args.draft_overrides.get(saved.draft, {}).items()
                          if _plain(getattr(own, k)) != _plain(v))
        if changed:
            raise ConfigError(f"--resume continues {out} with its saved settings; these options differ from them: "
                              f"{', '.join(changed)} (drop them, or train into another --out)")
    notes = resume_notes(saved, limits, state)
    for k, v in limits.items():
        setattr(saved, k, v)
    if ("max_steps" in limits and "budget_s" not in limits and state["elapsed_s"] >= saved.budget_s
            and (limits["max_steps"] or 0) > state["step"]):
        saved.budget_s = float("inf")  # the run ended at its time budget: the steps given now decide alone
    if not limits_reached(saved, state):  # a run that trains no more steps has no schedule to note
        for note in notes:
            log(note)
    return saved


def resume_notes(saved: TrainConfig, limits: dict, state: dict) -> list[str]:
    """One line for each way new limits on a resume change the run (:func:`saved_config`): the learning-rate
    schedule's horizon (cosine decay over ``max_steps`` steps, or over the time budget when no step count is set),
    and a run that ended at its time budget given more steps."""
    notes, step = [], state["step"]
    old_steps, new_steps = saved.max_steps, limits.get("max_steps", saved.max_steps)
    if new_steps != old_steps and new_steps is not None:
        was = (f"{old_steps} steps" if old_steps is not None else f"the {saved.budget_s:g} s time budget")
        notes.append(f"note: --max-steps {new_steps} on resume: the learning-rate schedule's horizon changes from "
                     f"{was} to {new_steps} steps; from step {step} on the cosine decay follows the new horizon (a run "
                     f"given --max-steps {new_steps} from the start would have decayed differently)")
    elif old_steps is None and "budget_s" in limits and limits["budget_s"] != saved.budget_s:
        notes.append(f"note: --budget {limits['budget_s']:g} on resume: the learning-rate schedule follows the time "
                     f"budget, so its horizon changes from {saved.budget_s:g} s to {limits['budget_s']:g} s from "
                     f"{state['elapsed_s']:.0f} s of training on")
    if ("max_steps" in limits and "budget_s" not in limits and state["elapsed_s"] >= saved.budget_s
            and (new_steps or 0) > step):
        notes.append(f"note: the run ended at its {saved.budget_s:g} s time budget at step {step}: it now trains to "
                     f"step {new_steps} without a time limit (give --budget too to keep one)")
    return notes


def load_data(spec: list[str], tokenizer, progress: bool):
    """Registry texts (``["registry"]``) or the user's files. Raises DataError."""
    eos = document_separator_id(tokenizer)
    if spec == ["registry"]:
        return prepare_data(tokenizer, eos_id=eos, progress=progress)
    return prepare_text_files(tokenizer, spec, eos_id=eos, progress=progress)


def heldout_windows(data, seq_len: int, n: int, seed: int = 1) -> torch.Tensor | None:
    """n held-out windows of seq_len tokens for the logged held-out loss and alpha (None if n == 0)."""
    if n <= 0:
        return None
    G = min(64, seq_len // 2)
    return data.heldout_contexts(seq_len - G, G, n, seed=seed)


def resolve_device(device: str, world: int) -> str:
    """auto -> cuda when present, else cpu; under torchrun on CUDA, this process's GPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device cuda, but this torch ({torch.__version__}) sees no CUDA device: use --device cpu")
    if device == "cuda" and world > 1:
        device = f"cuda:{torch.cuda.current_device()}"
    return device


def check_memory(args: TrainRunArgs, cfg: TrainConfig, device: str, world: int) -> None:
    """Refuse, before anything loads, a run whose memory plan (:mod:`spire.memory_plan`: target and draft weights,
    gradients, AdamW, activations at this process's rows per step) exceeds the device's memory (--device-memory,
    $SPIRE_DEVICE_MEMORY, else a CUDA device's free memory; none on a CPU unless stated). Raises ConfigError naming
    the largest --batch-size that fits."""
    from spire.loading import read_model_config, resolve_checkpoint
    from spire.memory_plan import check_fits, device_memory, memory_source, train_planner

    memory = device_memory(device, args.device_memory)
    if memory is None:
        return
    model_cfg = read_model_config(resolve_checkpoint(args.target, progress=False))
    rows = max(1, cfg.batch_size // world)
    planner = train_planner(model_cfg, cfg)
    try:
        check_fits(planner, rows, memory, device, memory_source(args.device_memory))
    except ConfigError as e:
        if world > 1:  # the plan is per process; the option is the global batch
            raise ConfigError(f"{e} rows per process ({world} processes)") from None
        raise


def interrupted_note(out: Path) -> str:
    """What an interrupted run left: its last checkpoint's step and how to go on from it."""
    try:
        step = (load_state(out) or {}).get("step", 0)
    except CheckpointError:
        step = 0
    if not step:
        return f"interrupted before the first checkpoint: nothing was saved in {out}"
    return (f"interrupted: {out} holds its last checkpoint (step {step}; one is written every --checkpoint-every "
            f"seconds); `spire train --resume --out {out}` goes on from there exactly")


def run(args: TrainRunArgs, log=print) -> dict:
    """Train as asked and return a summary dict (also printed by the CLI). Raises SpireError subclasses."""
    if args.device not in DEVICES:
        raise ConfigError(f"--device must be auto, cpu or cuda, got {args.device!r}")
    out = check_output_path(args.out or default_out(args), "--out", folder=True)
    if args.eval_windows is not None and args.eval_windows < 0:
        raise ConfigError(f"--eval-windows must be >= 0, got {args.eval_windows}")
    notes = log if os.environ.get("RANK", "0") == "0" else (lambda _: None)  # under torchrun: rank 0 says it
    cfg = saved_config(out, args.resume_limits(), args, notes) if args.resume else build_config(args)
    saved = load_state(out)
    if not args.resume:  # the Trainer checks it too; here it comes before the banner and any loading
        refuse_existing_run(out, saved)
        check_fresh_folder(out)  # a folder of the user's files is refused before anything is written
    if args.eval_windows is None:
        args.eval_windows = saved.get("heldout_windows", 16) if args.resume else 16
    rank, world = init_distributed()
    with sigterm_as_interrupt(), RunLock(out, log) if rank == 0 else contextlib.nullcontext():
        return _run_locked(args, out, cfg, saved, rank, world, log)  # (a second writer is refused by the lock)


class Terminated(KeyboardInterrupt):
    """SIGTERM received during `spire train`: handled as Ctrl-C is (the same note, the lock given back)."""


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While it is open, SIGTERM (a job scheduler's, a container's or `kill`'s stop) raises :class:`Terminated`
    in the main thread, so the run ends as on Ctrl-C: the last checkpoint stays, the note says how to resume, the
    run folder's lock is given back and the CLI exits 130. Left alone when not in the main thread or when a handler
    other than the default one is installed (e.g. by an embedding program)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def handler(signum, frame):
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_locked(args: TrainRunArgs, out: Path, cfg: TrainConfig, saved: dict | None, rank: int, world: int,
                log) -> dict:
    """:func:`run` once rank 0 holds the run folder's lock."""
    device = resolve_device(args.device, world)
    check_memory(args, cfg, device, world)
    target, tokenizer, folder = load_target(args.target, device=device, progress=rank == 0)
    if cfg.seq_len > target.cfg.max_positions:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the target's {target.cfg.max_positions} positions")
    cfg.draft_config.validate(target.cfg.n_layers, target.cfg.vocab_size)  # what the target decides, refused
    # before the banner and the data
    data = load_data(args.data, tokenizer, progress=rank == 0)
    # a run saved by a spire that keyed text by modification times resumes on the same files, unchanged since
    legacy = args.resume and cfg.data is not None and cfg.data == data.manifest.get("previous_key")
    if args.resume and cfg.data is not None and cfg.data != data.manifest.get("key") and not legacy:
        raise ConfigError(f"--resume: {out} was trained on other text than --data {' '.join(args.data)} (its "
                          "content differs): give it the run's own --data again")
    if not (args.resume and (cfg.data is None or legacy)):  # a run saved without its text's identity (`spire
        cfg.data = data.manifest.get("key")                 # reproduce`'s) resumes as it was saved
    heldout = heldout_windows(data, cfg.seq_len, args.eval_windows)
    article = "an" if cfg.draft[0] in "aeiou" else "a"
    banner = (f"training {article} {cfg.draft} draft{'' if cfg.ablation == 'none' else f' (ablation {cfg.ablation})'} for "
              f"{args.target} on {device} x {world} process(es): {cfg.budget_s:g} s budget"
              + (f", at most {cfg.max_steps} steps" if cfg.max_steps else "") + f"; run folder {out}")
    try:
        model, state = train_draft(target, data, out, cfg, heldout=heldout, resume=args.resume,
                                   target_folder=folder, progress=rank == 0, log=log, banner=banner)
    except KeyboardInterrupt:
        if rank == 0:
            log(interrupted_note(out))
        raise
    summary = {
        "run_dir": str(out), "draft": cfg.draft, "ablation": cfg.ablation, "loss": cfg.resolved_loss(),
        "steps": state["step"], "tokens": state["tokens"], "elapsed_s": round(state["elapsed_s"], 1),
        "tokens_per_s": round(state["tokens"] / max(state["elapsed_s"], 1e-9), 1), "processes": world,
        "draft_body_params": sum(p.numel() for p in model.layers.parameters()),
        "heldout": state.get("heldout"), "rank": rank, "draft_path": str(out / model.export_name),
    }
    if rank == 0:
        atomic_write(Path(out) / "summary.json", None, json.dumps(summary, indent=1))
    if world > 1:  # leave the process group cleanly (gloo aborts a peer that exits while others still talk)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return summary


def summary_line(summary: dict) -> str:
    """The line `spire train` prints on stdout when a run ends (rank 0)."""
    h = summary["heldout"] or {}
    alpha = " ".join(f"{a:.3f}" for a in h.get("alpha_per_position", []))
    return (f"{summary['draft']} draft: {summary['steps']} steps, {summary['tokens']:,} tokens, "
            f"{summary['tokens_per_s']:.0f} tokens/s; held-out alpha per position {alpha or '-'}; "
            f"draft at {summary['draft_path']}")
