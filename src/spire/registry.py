"""The draft kinds: one line per kind, the only list of them in spire.

A kind is a module under ``spire/drafts/`` that declares itself once, as ``KIND = DraftImpl(...)``
(:class:`DraftImpl`: its inference :class:`~spire.drafts.base.Draft`, its trainable model if it has one, its
options). Its line here (:class:`Kind`) holds what the light parts of spire need without importing torch: the
name, a one-line summary, whether it takes a ``--draft-path``, whether ``spire train`` trains it, and how the cost
model prices it (:class:`Pricing`). The CLI, ``spire tau``, ``spire bench``, ``spire throughput``, the main job
and export read the kinds from here (:func:`names`, :func:`kind`, :func:`impl`).

Adding a seventh kind: write ``spire/drafts/<name>.py`` with its ``KIND``, its tests, and one line in
:data:`KINDS`.

This module imports nothing heavy; :func:`impl` imports the kind's module (and torch) on first use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from spire import defaults
from spire.errors import ConfigError


@dataclass(frozen=True)
class Pricing:
    """How the paper's cost model (SPIRE.md §2) prices one draft forward.

    weights: "own" (the draft's own body is read: vanilla, SPIRe, EAGLE-3), "target" (the target's body over a
    view of its cache: MagicDec) or "none" (no forward: n-gram lookup, priced at zero; ``spire bench`` measures
    its lookup time). kv: "full" (the draft's KV over the whole context), "window" (sink + window) or "none".
    layers: the draft's blocks when no shape is given: an int, or a float fraction of the target's (ceil).
    memory_projection: SPIRe's feedback memory, each new memory vector projected to a key and a value in every
    draft layer (2·(2·n_layers·n_kv·d_model·d_head)·B FLOPs per forward). fused_inputs: EAGLE-3's fused target
    hidden states (a fused_inputs·d → d map per forward, and an attention input of 2d: extra q, k, v columns
    and a norm; arXiv 2503.01840). own_embeddings: the draft has embedding tables of its own (vanilla; counted
    only when the cost model counts embeddings). training_cost: in units of the target's training cost
    (None: the draft's share of the target's body, N_d / N_t, trained on as many tokens).
    """

    weights: str = "own"
    kv: str = "full"
    layers: int | float = 1
    memory_projection: bool = False
    fused_inputs: int = 0
    own_embeddings: bool = False
    training_cost: float | None = None


@dataclass(frozen=True)
class DraftOption:
    """One typed option a kind declares on its line (:attr:`Kind.options`): every command that builds drafts
    (generate, serve, tau, bench, compare) gets it as a flag (:func:`spire.commands.options.with_draft_options`) and
    :func:`spire.drafts.make_draft` passes it to the kind's ``load`` as the keyword ``name``.

    name: the keyword; type: int, float or str; help: one line; default: the value the kind's load uses when the
    flag is not given (shown in the help; None: the kind decides); check: value -> an error message when the value
    is impossible, else None; flag: the command-line flag (default ``--KIND-NAME``, underscores as dashes)."""

    name: str
    type: type
    help: str
    default: Any = None
    check: Callable[[Any], str | None] | None = None
    flag: str | None = None

    def flag_for(self, kind: str) -> str:
        return self.flag or f"--{kind}-{self.name.replace('_', '-')}"


def _at_least(n: int) -> Callable[[Any], str | None]:
    return lambda v: None if v >= n else f"must be >= {n}, got {v}"


def _ordered(low: str, high: str, low_flag: str, high_flag: str) -> Callable[[dict], str | None]:
    """A check of two options given together: ``low`` <= ``high``."""
    def check(values: dict) -> str | None:
        lo, hi = values.get(low), values.get(high)
        return None if lo is None or hi is None or lo <= hi else f"{low_flag} {lo} exceeds {high_flag} {hi}"
    return check


@dataclass(frozen=True)
class Kind:
    """One draft kind's line: see the module docstring. path: "none" (takes no --draft-path), "optional" (a
    default is found, e.g. the newest trained SPIRe draft) or "required". trains: `spire train --draft NAME`
    trains it. paper_tau: τ the paper measured (L = 512, k = 4), None for kinds the paper did not measure. options:
    the kind's typed options (:class:`DraftOption`), flags of every command that builds drafts. check: a check of
    the options given together (their values by name -> a problem, or None), run after each option's own.
    served_int8: `spire serve` rounds the draft's own weights to group-wise int8 by default on a CPU with spire's
    kernels (its decode matmuls then stream a quarter of float32's bytes; lossless, τ within 0.02: docs/bench.md,
    "An int8 draft")."""

    name: str
    module: str
    summary: str
    path: str
    trains: bool
    pricing: Pricing | None
    paper_tau: float | None = None
    options: tuple[DraftOption, ...] = ()
    check: Callable[[dict], str | None] | None = None
    served_int8: bool = False


KINDS: tuple[Kind, ...] = (
    Kind("none", "spire.drafts.none", "autoregressive decoding, no draft", "none", False, None),
    Kind("vanilla", "spire.drafts.vanilla", "a small model with the target's tokenizer (HF folder, .gguf or a "
         "`spire train --draft vanilla` run)", "required", True,
         Pricing(kv="full", layers=1 / 8, own_embeddings=True), 2.647, served_int8=True),
    Kind("magicdec", "spire.drafts.magicdec", "the target over a sink + window view of its own cache (MagicDec)",
         "none", False, Pricing(weights="target", kv="window", training_cost=0.0), 3.891,
         (DraftOption("sink", int, "attention-sink tokens kept", defaults.SINK, _at_least(0), "--sink"),
          DraftOption("window", int, "window tokens", defaults.WINDOW, _at_least(1), "--window"))),
    Kind("spire", "spire.drafts.spire", "SPIRe: pruned, sliding-window, feedback memory over the target's "
         "activations (default: the newest trained in the cache)", "optional", True,
         Pricing(kv="window", layers=1 / 4, memory_projection=True, training_cost=0.25), 3.401, served_int8=True),
    Kind("eagle3", "spire.drafts.eagle3", "EAGLE-3: one layer over three fused target hidden states (a `spire "
         "train --draft eagle3` run or a speculators folder)", "required", True,
         Pricing(kv="full", layers=1, fused_inputs=3)),
    Kind("ngram", "spire.drafts.ngram", "n-gram prompt lookup in the row's own context (no weights, no training)",
         "none", False, Pricing(weights="none", kv="none", layers=0, training_cost=0.0), None,
         (DraftOption("n_min", int, "shortest suffix matched [vLLM's 5, or --ngram-max]", None, _at_least(1),
                      "--ngram-min"),
          DraftOption("n_max", int, "longest suffix matched [vLLM's 5, or --ngram-min]", None, _at_least(1),
                      "--ngram-max")), _ordered("n_min", "n_max", "--ngram-min", "--ngram-max")),
)

_BY_NAME = {k.name: k for k in KINDS}

DEFAULT = "magicdec"
"""The draft used where none is named (`spire generate`, `spire compare`, `spire tau`): it needs no training."""

BASELINE = "magicdec"
"""The paper's strongest baseline, which its headline measures SPIRe against (≥ 1.35× MagicDec's multiplier at
(B, L) = (64, 512))."""


def names(*, drafts_only: bool = False, trains: bool | None = None, priced: bool | None = None) -> tuple[str, ...]:
    """Kind names in the registry's order (the order of every table). drafts_only: without "none"; trains /
    priced: only kinds that `spire train` trains / the cost model prices (True) or the others (False)."""
    out = []
    for k in KINDS:
        if drafts_only and k.name == "none":
            continue
        if trains is not None and k.trains != trains:
            continue
        if priced is not None and (k.pricing is not None) != priced:
            continue
        out.append(k.name)
    return tuple(out)


def kind(name: str, what: str = "draft") -> Kind:
    """The line of kind ``name``; ConfigError naming the known kinds otherwise."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown {what} {name!r}; choose one of {', '.join(names())}") from None


def options_of(name: str, **values: Any) -> dict[str, Any]:
    """The ``values`` that kind ``name`` declares as options (the others dropped): for callers that hold settings of
    several kinds (the main job's sink and window, MagicDec's) and build drafts of every kind."""
    own = {o.name for o in kind(name).options}
    return {key: v for key, v in values.items() if key in own}


def check_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` (keyword -> value, None: not given) checked against kind ``name``'s declared options: the given
    ones, typed. Raises ConfigError naming the flag for an option the kind does not declare, a value of the wrong
    type, or one its check refuses."""
    entry = kind(name)
    declared = {o.name: o for o in entry.options}
    out = {}
    for key, value in options.items():
        if value is None:
            continue
        opt = declared.get(key)
        if opt is None:
            owner, other = next(((k, o) for k in KINDS for o in k.options if o.name == key), (None, None))
            flag = other.flag_for(owner.name) if owner else key
            raise ConfigError(f"{flag} is an option of --draft {owner.name if owner else '?'}, not --draft {name} "
                              f"(its options: {', '.join(o.flag_for(name) for o in entry.options) or 'none'})")
        try:
            value = opt.type(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{opt.flag_for(name)} takes {opt.type.__name__}, got {value!r}") from None
        problem = opt.check(value) if opt.check is not None else None
        if problem:
            raise ConfigError(f"{opt.flag_for(name)} {problem}")
        out[key] = value
    problem = entry.check(out) if entry.check is not None else None
    if problem:
        raise ConfigError(problem)
    return out


def check(name: str, allowed: tuple[str, ...] | None = None, what: str = "draft") -> str:
    """``name`` when it is a kind (and in ``allowed`` when given); ConfigError otherwise."""
    kind(name, what)
    if allowed is not None and name not in allowed:
        raise ConfigError(f"{what} {name!r} is not available here; choose one of {', '.join(allowed)}")
    return name


@dataclass(frozen=True)
class DraftImpl:
    """What a kind's module declares as ``KIND``.

    load(target, tokenizer, path, **options) -> Draft | None: the inference draft bound to ``target`` (path:
    the --draft-path, None when not given; options: the kind's own settings, e.g. sink / window, n_min / n_max).
    Raises ConfigError / CheckpointError / TokenizerMismatchError.
    model: the trainable class (:class:`~spire.drafts.base.TrainableDraft`) when ``spire train`` trains it.
    export(src, target, name_or_path, k) -> write(folder): how `spire export` writes a trained draft (``src``: the
    resolved draft path) as a folder a serving engine reads; None when the kind has nothing to export.
    The kind's options are declared on its registry line (:attr:`Kind.options`), where the CLI reads them without
    importing the kind.
    """

    load: Callable[..., Any]
    model: type | None = None
    export: Callable[..., Callable[[Any], None]] | None = None


def impl(name: str) -> DraftImpl:
    """The ``KIND`` its module declares (imports the module, and torch, on first use)."""
    entry = kind(name)
    module = importlib.import_module(entry.module)
    declared = getattr(module, "KIND", None)
    if not isinstance(declared, DraftImpl):
        raise ConfigError(f"draft module {entry.module} declares no KIND (a DraftImpl)")
    return declared


def trainable_class(name: str) -> type:
    """The trainable draft class of kind ``name``; ConfigError for a kind that `spire train` does not train."""
    if not kind(name).trains:
        raise ConfigError(f"draft must be one of {', '.join(names(trains=True))}, got {name!r}")
    model = impl(name).model
    assert model is not None, f"{name} is declared trainable but its module gives no model"
    return model
