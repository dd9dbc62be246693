"""Option parsing that several ``spire`` commands share: grid values, ``KEY=VALUE`` lists, the options a user set,
draft options restricted to the registry's kinds, and the kinds' own options as flags (:func:`with_draft_options`).

Light on purpose (typer and spire.errors only): :mod:`spire.cli` imports it at startup.
"""

from __future__ import annotations

import functools
import inspect
from typing import Annotated, Any, Callable, Iterable, Optional

import typer

import spire.registry as registry
from spire.errors import ConfigError

GRID_HELP = "Repeat the option or comma-separate values: -B 1 -B 8,64."


def draft_path_help() -> str:
    """The --draft-path help of the commands that decode, from the registry: the kinds that train."""
    return (f"A trained draft ({', '.join(registry.names(trains=True))}): its `spire train` run folder, weights file "
            "or `spire export` folder [spire: the newest trained in the cache]; vanilla also takes an HF folder or a "
            ".gguf with the target's tokenizer.")


def ints(name: str, values: Iterable[str]) -> list[int]:
    """Integers from repeated and/or comma-separated option values: ``-B 1 -B 8,64`` -> [1, 8, 64]. Raises
    ConfigError naming the option ``name`` and the item that is not an integer."""
    out = []
    for value in values:
        for item in value.split(","):
            try:
                out.append(int(item.strip()))
            except ValueError:
                raise ConfigError(f"{name}: {item.strip()!r} is not an integer") from None
    return out


def k_help(bound: str = "the target's positions", holder: str = "a sequence", first: str = "Draft tokens per round"
           ) -> str:
    """The -k help of the commands that decode (generate, serve, tau): its range, as :func:`check_k` checks it."""
    return f"{first}, 1 to {bound} - 2 ({holder} holds a prompt token, a new token and the k drafted ones)."


def check_k(k: int, positions: int | None = None, where: str = "") -> None:
    """Refuse a -k outside [1, positions - 2]: a sequence of ``positions`` (the target's, or a `spire serve` slot's
    --max-len) holds at least a prompt token, a new token and the k drafted ones, the engine's own bound
    (:class:`spire.engine.engine.Engine`: k + 2 <= max_len). ``where`` names the positions ("the target's 8192
    positions"). Without ``positions`` (not known yet) only k >= 1. Raises ConfigError giving the range."""
    if positions is None:
        if k < 1:
            raise ConfigError(f"-k must be >= 1 (and at most the positions of a sequence - 2), got {k}")
    elif not 1 <= k <= positions - 2:
        raise ConfigError(f"-k must be in [1, {positions - 2}] (a prompt token, a new token and k drafted tokens "
                          f"fit {where}), got {k}")


def floats(values: Iterable[str], option: str) -> dict[str, float]:
    """``DRAFT=VALUE`` strings -> {draft: value}, for --tau and --alpha. Raises ConfigError naming ``option``."""
    out = {}
    for value in values:
        draft, sep, number = value.partition("=")
        try:
            if not sep:
                raise ValueError
            out[draft.strip()] = float(number)
        except ValueError:
            raise ConfigError(f"{option} expects DRAFT=VALUE (e.g. spire=3.4), got {value!r}") from None
    return out


def names(values: Iterable[str]) -> dict[str, str]:
    """``KIND=NAME`` strings -> {kind: name}, for --tau-draft. Raises ConfigError on a malformed one."""
    out = {}
    for value in values:
        kind, sep, name = value.partition("=")
        if not sep or not kind.strip() or not name.strip():
            raise ConfigError(f"--tau-draft expects KIND=NAME (e.g. spire=nofeedback), got {value!r}")
        out[kind.strip()] = name.strip()
    return out


def given(ctx: typer.Context, params: Iterable[str] | None = None) -> dict:
    """The options among ``params`` (default: all of the command's) that the user set, by parameter name; a
    default is left to the library."""
    # by name: typer's context may report a ParameterSource of another module than click's (an `is` test fails)
    return {name: ctx.params[name] for name in (ctx.params if params is None else params)
            if getattr(ctx.get_parameter_source(name), "name", None) not in ("DEFAULT", "DEFAULT_MAP")}


def kinds(allowed: tuple[str, ...]) -> dict:
    """typer.Option arguments that restrict a draft option to the registry's kinds ``allowed`` (a usage error,
    exit 2, names them otherwise)."""
    def check(value: str | None) -> str | None:
        if value is not None and value not in allowed:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(allowed)}")
        return value
    return {"callback": check, "metavar": "[" + "|".join(allowed) + "]"}


def set_process_backend(spec: str | None) -> None:
    """``spire --backend SPEC``: check SPEC (:meth:`spire.backend.Backend.parse`; ConfigError naming an unknown or
    contradictory choice) and make it this process's backend, and its children's (training workers), through
    :data:`spire.backend.ENV`. Without the option, a SPIRE_BACKEND already set is checked the same way."""
    import os

    from spire.backend import ENV, Backend

    if spec is None:
        try:
            Backend.parse(os.environ.get(ENV, ""))
        except ConfigError as e:
            raise ConfigError(f"{ENV}={os.environ[ENV]!r}: {e}") from None
        return
    os.environ[ENV] = Backend.parse(spec).spec()



def _param(kind: registry.Kind, opt: registry.DraftOption) -> str:
    return f"{kind.name}__{opt.name}"


def with_draft_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command every kind's declared options (:attr:`spire.registry.Kind.options`) as flags: ``--sink`` and
    ``--window`` (MagicDec), ``--ngram-min`` / ``--ngram-max``, and a new kind's ``--KIND-NAME``. The command
    receives them as the keyword ``draft_options``: {kind: {option: value}} of the flags the user gave (a kind's
    default is its own), checked by :func:`spire.registry.check_options` when a draft is built
    (:func:`draft_options_for`). The one mechanism that turns kinds' options into flags for generate, serve, tau,
    bench and compare: a kind's option reaches them all with no change to a command."""
    signature = inspect.signature(command, eval_str=True)
    declared = [(k, o) for k in registry.KINDS for o in k.options]
    extra = [inspect.Parameter(_param(k, o), inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation=Annotated[Optional[o.type], typer.Option(
                                   o.flag_for(k.name), help=f"--draft {k.name}: {o.help}"
                                   + ("" if o.default is None else f" [default: {o.default}]"))])
             for k, o in declared]
    kept = [p for p in signature.parameters.values() if p.name != "draft_options"]

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        options: dict[str, dict[str, Any]] = {}
        for k, o in declared:
            value = kwargs.pop(_param(k, o), None)
            if value is not None:
                options.setdefault(k.name, {})[o.name] = value
        return command(*args, draft_options=options, **kwargs)

    run.__signature__ = signature.replace(parameters=kept + extra)
    run.__annotations__ = {p.name: p.annotation for p in kept + extra}
    return run


def draft_options_for(kind: str | None, draft_options: dict[str, dict[str, Any]],
                      used: Iterable[str] | None = None) -> dict[str, Any]:
    """The options the user gave for ``kind`` (to pass to :func:`spire.drafts.make_draft`), checked
    (:func:`spire.registry.check_options`: ConfigError naming the flag of an impossible value, even for a kind this
    run does not use). An option given for a kind not among ``used`` (default: ``kind``) does nothing: one note on
    stderr says so."""
    used = {kind} if used is None else set(used)
    for other, values in draft_options.items():
        registry.check_options(other, values)
        if other not in used and values:
            flags = " / ".join(o.flag_for(other) for o in registry.kind(other).options if o.name in values)
            typer.echo(f"note: {flags} {'sets' if len(values) == 1 else 'set'} --draft {other}'s options; ignored "
                       f"for --draft {', '.join(sorted(str(x) for x in used))}", err=True)
    return registry.check_options(kind, draft_options.get(kind, {})) if kind else {}


def train_options() -> list[tuple[registry.Kind, registry.TrainOption]]:
    """(kind, option) of every trained kind's `spire train` options (:attr:`spire.registry.Kind.train_options`), in
    the registry's order and each kind's own."""
    return [(k, o) for k in registry.KINDS if k.trains for o in k.train_options]


def with_train_options(before: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give the train command every trained kind's declared options (:func:`train_options`) as flags, placed before
    its parameter ``before``: a value option as ``Optional[type]`` (None unless given), a switch as a bool flag
    (False unless given); a deprecated name (:attr:`spire.registry.TrainOption.old`) as a hidden option. The
    command reads them from its context's parameters (:func:`spire.commands.train.args_from_options`), so they are
    not passed to it. Raises ValueError, when the command is defined, for a parameter name two options share."""
    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        extra = []
        for k, o in train_options():
            meta = {"help": o.help, "hidden": o.hidden}
            if o.metavar:
                meta["metavar"] = o.metavar
            if o.switch:
                extra.append(inspect.Parameter(o.param, inspect.Parameter.KEYWORD_ONLY, default=False,
                                               annotation=Annotated[bool, typer.Option(o.flag_name, **meta)]))
            else:
                extra.append(inspect.Parameter(o.param, inspect.Parameter.KEYWORD_ONLY, default=None,
                                               annotation=Annotated[Optional[o.type], typer.Option(o.flag_name,
                                                                                                   **meta)]))
            extra += [inspect.Parameter(old, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[Optional[o.type], typer.Option(
                                            "--" + old.replace("_", "-"), hidden=True,
                                            help=f"Deprecated name of {o.flag_name}.")]) for old in o.old]
        own = list(signature.parameters.values())
        names = [p.name for p in own] + [p.name for p in extra]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"train options declared twice: {', '.join(twice)}")
        at = next(i for i, p in enumerate(own) if p.name == before)
        added = {p.name for p in extra}

        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            return command(*args, **{key: v for key, v in kwargs.items() if key not in added})

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if i >= at else p for i, p in enumerate(own)]
        params = params[:at] + extra + params[at:]
        run.__signature__ = signature.replace(parameters=params)
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run
    return decorate
