"""Option parsing that several ``spire`` commands share: grid values, ``KEY=VALUE`` lists, the options a user set,
and draft options restricted to the registry's kinds.

Light on purpose (typer and spire.errors only): :mod:`spire.cli` imports it at startup.
"""

from __future__ import annotations

from typing import Iterable

import typer

from spire.errors import ConfigError

GRID_HELP = "Repeat the option or comma-separate values: -B 1 -B 8,64."


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

