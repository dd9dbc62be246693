"""The draft kinds: one line per kind, the only list of them in spire.

A kind is a module under ``spire/drafts/`` that declares itself once, as ``KIND = DraftImpl(...)``
(:class:`DraftImpl`: its inference :class:`~spire.drafts.base.Draft`, its trainable model if it has one, its
options). Its line here (:class:`Kind`) holds what the light parts of spire need without importing torch: the
name, a one-line summary, whether it takes a ``--draft-path``, whether ``spire train`` trains it, how the cost
model prices it (:class:`Pricing`), and what a trained kind's files say of it: the draft file's metadata key of its
settings (:attr:`Kind.config_key`, also their key in a run's ``train_state.json``), how a message names a draft of
it (:attr:`Kind.display_name`), the vLLM speculative method of its export (:attr:`Kind.vllm_method`), its run
folder's layout (:attr:`Kind.run_weights`) and its `spire train` options (:attr:`Kind.train_options`). The CLI,
``spire train``, ``spire tau``, ``spire bench``, ``spire throughput``, the main job and export read the kinds from
here (:func:`names`, :func:`kind`, :func:`impl`).

Adding a seventh kind: write ``spire/drafts/<name>.py`` with its ``KIND``, its tests, and one line in
:data:`KINDS` (a trained kind's line also names its ``config_key``, its ``display_name``, its ``run_weights``, its
``train_options`` and, when vLLM runs its export, its ``vllm_method``; its ``KIND`` then names its vLLM form,
:attr:`DraftImpl.vllm`, where the plain one does not fit). The tables other modules keep of the kinds
are views of these lines (:class:`KindTable`).

This module imports nothing heavy; :func:`impl` imports the kind's module (and torch) on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
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


@dataclass(frozen=True)
class TrainOption:
    """One `spire train` option a trained kind declares on its line (:attr:`Kind.train_options`): the train command
    gets it as a flag (:func:`spire.commands.options.with_train_options`) and
    :func:`spire.commands.train.args_from_options` sets the field ``field`` of the kind's config class from it (an
    option given for another kind than the one trained is refused, naming the flag).

    param: the parameter name (its flag ``--param`` with underscores as dashes, unless ``flag`` names one); type: int,
    float or str, or bool for a switch (a flag without a value, False unless given); help: the help line as shown;
    field: the config field it sets; value: a switch's value of ``field`` when given; metavar: the value's name in
    the help; convert: value -> the field's value (a J,J,... list -> a tuple of ints: :func:`layer_ids`; a 0 that
    means None), raising ConfigError for a malformed value; hidden: left out of the help; old: deprecated parameter
    names that still set it (with a warning)."""

    param: str
    type: type
    help: str
    field: str
    value: Any = None
    metavar: str | None = None
    convert: Callable[[Any], Any] | None = None
    flag: str | None = None
    hidden: bool = False
    old: tuple[str, ...] = ()

    @property
    def switch(self) -> bool:
        """Whether it is a flag without a value (``--full-kv``)."""
        return self.type is bool

    @property
    def flag_name(self) -> str:
        """Its command-line flag: ``flag``, else ``--param`` with underscores as dashes."""
        return self.flag or "--" + self.param.replace("_", "-")


def layer_ids(flag: str) -> Callable[[Any], tuple[int, ...]]:
    """A :attr:`TrainOption.convert` of a J,J,... list of layer ids (str) -> tuple of ints; ConfigError naming
    ``flag`` and the item that is not an integer."""
    def convert(value: Any) -> tuple[int, ...]:
        out = []
        for item in str(value).split(","):
            try:
                out.append(int(item.strip()))
            except ValueError:
                raise ConfigError(f"{flag}: {item.strip()!r} is not an integer") from None
        return tuple(out)
    return convert


def _none_at_zero(value: Any) -> Any:
    """0 -> None (the target's whole vocabulary, as `spire reproduce` says it), else the value."""
    return None if value == 0 else value


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
    "An int8 draft").

    config_key: a trained kind's settings (its config class's ``to_dict()``) in its draft file's metadata
    (:func:`spire.formats.draft_file.draft_file_kind` recognizes the kind by it), and in the "config" of a run's
    ``train_state.json`` (:meth:`spire.training.config.TrainConfig.to_dict`), there only in the kind's own runs.
    state_key: the three kinds of the layout from before the draft config classes (SPIRe, EAGLE-3, vanilla) keep
    their settings under this key of every run's ``train_state.json`` config instead (the kind's defaults in other
    kinds' runs), so that saved runs read and write back unchanged; None for a kind added since.
    display_name: how a message names a draft of the kind, with its article ("a SPIRe" draft); None: "a NAME".
    vllm_method: the vLLM speculative method that runs the kind's export (:mod:`spire.integrations.vllm_export`);
    None: vLLM cannot run it.

    The run-folder layout (read by :func:`spire.formats.draft_file.resolve_draft_path` for every command that takes
    a ``--draft-path``): run_weights: the name of a trained kind's draft inside its `spire train` run folder, a file
    ("draft.safetensors", SPIRe) or a folder ("draft", vanilla's HF folder; "eagle3"); it is the kind's model's
    ``export_name``, declared here so that the light parts read it without importing the kind; None for a kind
    without runs. takes_run_folder: the kind's load takes the run folder itself and finds its draft there (EAGLE-3,
    which falls back to the run's last checkpoint while ``run_weights`` is not yet written); False: the path
    resolves to ``run_weights`` inside it. takes_folders: the kind's load also reads a folder of another form as it
    is (an HF folder, a speculators folder); False: a folder is one of its run folders or a `spire export` folder
    (SPIRe), anything else is refused.

    train_options: the `spire train` options of a trained kind (:class:`TrainOption`), flags of the train command
    that set its config's fields."""

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
    config_key: str | None = None
    state_key: str | None = None
    display_name: str | None = None
    vllm_method: str | None = None
    run_weights: str | None = None
    takes_run_folder: bool = False
    takes_folders: bool = True
    train_options: tuple[TrainOption, ...] = ()

    @property
    def article_name(self) -> str:
        """The kind as a message names a draft of it: "a SPIRe", "an EAGLE-3" (:attr:`display_name`, else "a
        NAME")."""
        return self.display_name or f"a {self.name}"

    @property
    def plain_name(self) -> str:
        """:attr:`article_name` without its article: "SPIRe", "EAGLE-3", "vanilla"."""
        return self.article_name.split(" ", 1)[-1]

    @property
    def diagnosable(self) -> bool:
        """Whether the T = 1 diagnosis (:mod:`spire.evaluation.diagnose`) has something to measure: a draft with a
        forward of its own; a weightless lookup (n-gram: ``Pricing.weights`` "none") proposes with a one-hot q, and
        "none" has no draft."""
        return self.pricing is not None and self.pricing.weights != "none"


_SPIRE_TRAIN = (
    TrainOption("n_draft_layers", int, f"SPIRe: target layers pruned into the draft [{defaults.N_DRAFT_LAYERS}].",
                "n_draft_layers"),
    TrainOption("layers", str, "SPIRe: which target layers [the last N].", "layers", metavar="J,J,...",
                convert=layer_ids("--layers")),
    TrainOption("init", str, "SPIRe: pruned or random.", "init"),
    TrainOption("sink", int, f"SPIRe: sink tokens [{defaults.SINK}].", "sink"),
    TrainOption("window", int, f"SPIRe: window tokens [{defaults.WINDOW}].", "window"),
    TrainOption("full_kv", bool, "SPIRe: full KV cache instead of sink + window.", "window", None, flag="--full-kv"),
    TrainOption("no_feedback_memory", bool, "SPIRe: no feedback memory.", "feedback_memory", False,
                flag="--no-feedback-memory"),
    TrainOption("no_target_activations", bool, "SPIRe: the draft reads its own activations (needs "
                "--no-feedback-memory).", "target_activations", False, flag="--no-target-activations"),
    TrainOption("no_self_attend", bool, "SPIRe: a drafted token does not read its own layer input.", "self_attend",
                False, flag="--no-self-attend"),
    TrainOption("feature_input", bool, "SPIRe, beyond the paper: a drafted token's input adds a learned projection "
                "of the previous position's feature (EAGLE-style).", "feature_input", True, flag="--feature-input"),
    TrainOption("bridge", bool, "SPIRe, beyond the paper: an affine map, fitted to the target before training, "
                "where the draft's shallow layers meet its deep ones.", "bridge", True, flag="--bridge"),
    TrainOption("draft_vocab", int, "SPIRe: draft vocabulary of N tokens, chosen by --draft-vocab-from (q = 0 "
                "elsewhere; lossless); 0: the target's whole vocabulary [the target's].", "vocab_size",
                convert=_none_at_zero, old=("vocab_size",)),
    TrainOption("draft_vocab_from", str, "SPIRe: choose the draft vocabulary's N tokens by their count in the "
                "training text or by the target's probability mass on it [frequency].", "vocab_from",
                metavar="frequency|mass"),
)
"""SPIRe's `spire train` options (on its line below)."""

KINDS: tuple[Kind, ...] = (
    Kind("none", "spire.drafts.none", "autoregressive decoding, no draft", "none", False, None),
    Kind("vanilla", "spire.drafts.vanilla", "a small model with the target's tokenizer (HF folder, .gguf or a "
         "`spire train --draft vanilla` run)", "required", True,
         Pricing(kv="full", layers=1 / 8, own_embeddings=True), 2.647, served_int8=True, config_key="vanilla_config",
         state_key="vanilla_layers", display_name="a vanilla", vllm_method="draft_model", run_weights="draft",
         train_options=(TrainOption("vanilla_layers", int, "Vanilla: blocks [target layers / 8].", "n_layers"),)),
    Kind("magicdec", "spire.drafts.magicdec", "the target over a sink + window view of its own cache (MagicDec)",
         "none", False, Pricing(weights="target", kv="window", training_cost=0.0), 3.891,
         (DraftOption("sink", int, "attention-sink tokens kept", defaults.SINK, _at_least(0), "--sink"),
          DraftOption("window", int, "window tokens", defaults.WINDOW, _at_least(1), "--window"))),
    Kind("spire", "spire.drafts.spire", "SPIRe: pruned, sliding-window, feedback memory over the target's "
         "activations (default: the newest trained in the cache)", "optional", True,
         Pricing(kv="window", layers=1 / 4, memory_projection=True, training_cost=0.25), 3.401, served_int8=True,
         config_key="spire_config", state_key="spire", display_name="a SPIRe", vllm_method="eagle3",
         run_weights="draft.safetensors", takes_folders=False, train_options=_SPIRE_TRAIN),
    Kind("eagle3", "spire.drafts.eagle3", "EAGLE-3: one layer over three fused target hidden states (a `spire "
         "train --draft eagle3` run or a speculators folder)", "required", True,
         Pricing(kv="full", layers=1, fused_inputs=3), config_key="eagle3_config", state_key="eagle3",
         display_name="an EAGLE-3", vllm_method="eagle3", run_weights="eagle3", takes_run_folder=True,
         train_options=(TrainOption("eagle3_layers", str, "EAGLE-3: the three target layers whose entering residual "
                                    "streams it fuses [2, n/2, n-3].", "layers", metavar="J,J,J",
                                    convert=layer_ids("--eagle3-layers")),
                        TrainOption("eagle3_vocab", int, "EAGLE-3: draft vocabulary size (d2t); 0: the target's "
                                    "[16384].", "draft_vocab"))),
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


class KindTable(Mapping):
    """A read-only table kind name -> ``value(line)`` of the kinds whose value is not None, in the registry's order,
    read from :data:`KINDS` at each access (a line added at run time is in it): the per-kind tables other modules
    keep (``formats.draft_file.DRAFT_KIND_KEYS``, ``integrations.vllm_export.METHODS``) are such views. A name
    without a value raises KeyError, as a dict's missing key does."""

    def __init__(self, value: Callable[[Kind], Any]) -> None:
        self._value = value

    def _items(self) -> list[tuple[str, Any]]:
        return [(k.name, v) for k in KINDS if (v := self._value(k)) is not None]

    def __getitem__(self, name: str) -> Any:
        for key, v in self._items():
            if key == name:
                return v
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter([key for key, _ in self._items()])

    def __len__(self) -> int:
        return len(self._items())

    def __repr__(self) -> str:
        return repr(dict(self._items()))


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
    vllm: its vLLM form, what `spire export` adds to that folder so that vLLM runs it with the method on the kind's
    line (:attr:`Kind.vllm_method`): a :class:`spire.integrations.vllm_export.VllmForm` (the subfolder vLLM reads,
    a target check, config.json's rewrite, a step after it); None: that module's ``INDEPENDENT_FORM`` (the export
    itself as vLLM's draft model) where the line names a method; a kind without a method has no vLLM form.
    The kind's options are declared on its registry line (:attr:`Kind.options`), where the CLI reads them without
    importing the kind.
    """

    load: Callable[..., Any]
    model: type | None = None
    export: Callable[..., Callable[[Any], None]] | None = None
    vllm: Any = None


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
