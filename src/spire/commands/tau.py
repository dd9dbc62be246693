"""``spire tau``: τ with a 95 % CI for several drafts, context lengths and temperatures in one run.

The paper's protocol (SPIRE.md §6): contexts of L tokens cut from held-out documents that are really that
long, G generated tokens each, k draft tokens per round, τ = emitted tokens / rounds with a percentile
bootstrap CI over contexts (:func:`spire.evaluation.tau.measure_tau`). The result is one JSON object
(:mod:`spire.evaluation.tau_file` describes it) that ``spire throughput --tau-from FILE`` reads.

Contexts: by default each L gets its own windows (``TokenData.heldout_contexts(L, G, n)``). With
``nested=True`` every L uses the same n windows, cut for the largest L (or ``nested_length``), and a shorter
context is the last L tokens of the longest one: the text that follows (and the documents) are the same for
every L, so a change of τ with L is a paired comparison, not a change of text. Two runs with the same seed,
n_contexts, G and nested length use the same windows (e.g. one draft per run, merged with ``--show``).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import typer
from rich.console import Console
from rich.table import Table

from spire import defaults
from spire.backend import of as backend_of
from spire.commands.options import check_k, draft_options_for, ints
from spire.data import document_separator_id, prepare_data
import spire.registry as registry
from spire.drafts import make_draft
from spire.drafts.spire import find_trained_spire
from spire.formats.draft_file import resolve_draft_path
from spire.errors import CheckpointError, ConfigError, DataError
from spire.evaluation.diagnose import diagnose_shared, diagnosis_markdown, plot_diagnosis
from spire.evaluation.tau import TauResult, measure_tau
from spire.evaluation.tau_file import FORMAT, VERSION, read_tau_file
from spire.loading import load_target, read_model_config, resolve_checkpoint
from spire.paths import atomic_write, check_output_path
from spire.sampling import SamplingParams



@dataclass
class DraftSpec:
    """A draft to measure: kind (magicdec, spire, vanilla), the name shown and written, and a checkpoint
    (spire: a .safetensors, default the newest trained one in the cache; vanilla: a .gguf or HF folder)."""

    kind: str
    name: str
    path: str | None = None


@dataclass
class TauArgs:
    """Every option of ``spire tau``. max_batch_tokens caps batch × L per generate call (the prefill keeps
    float32 logits of every prompt position: batch × L × vocab × 4 bytes)."""

    drafts: list[DraftSpec] = field(default_factory=lambda: [DraftSpec(registry.DEFAULT, registry.DEFAULT)])
    Ls: list[int] = field(default_factory=lambda: [512])
    G: int = 64
    k: int = defaults.K
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    n_contexts: int = 16
    batch_size: int = 8
    max_batch_tokens: int = 8192
    seed: int = 0
    target: str = "smollm2-135m"
    draft_options: dict = field(default_factory=dict)  # kind -> {option: value}: the kinds' own flags (--window)
    nested: bool = False
    nested_length: int | None = None  # with nested: cut the windows for this L (default the largest -L)
    threads: int | None = None  # torch CPU threads (None: torch's default)
    diagnose: bool = False  # each row also gets "diagnosis" (spire.evaluation.diagnose): per drafted position


def _named(values: list[str], kind: str, option: str) -> list[DraftSpec]:
    out = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"{option} expects NAME=PATH (e.g. {option} nofeedback=run/draft.safetensors), "
                              f"got {value!r}")
        out.append(DraftSpec(kind, name.strip(), path.strip()))
    return out


def _path_takers() -> tuple[str, ...]:
    return tuple(k for k in registry.names(drafts_only=True) if registry.kind(k).path != "none")


def parse_drafts(kinds: list[str], draft_path: str | None = None, spire_named: list[str] = (),
                 vanilla_named: list[str] = ()) -> list[DraftSpec]:
    """Drafts from ``--draft`` (repeatable, comma lists), ``--draft-path`` (for the one spire or vanilla among
    them) and ``--spire-draft`` / ``--vanilla-draft NAME=PATH``. With none of these: MagicDec alone."""
    specs: list[DraftSpec] = []
    plain = [item.strip() for value in kinds for item in value.split(",") if item.strip()]
    for kind in plain:
        if kind not in registry.names(drafts_only=True):
            raise ConfigError(f"unknown draft {kind!r}; choose among {', '.join(registry.names(drafts_only=True))}")
    if draft_path is not None:
        takers = [kind for kind in plain if registry.kind(kind).path != "none"]
        if len(takers) != 1:
            raise ConfigError(f"--draft-path belongs to exactly one --draft of {', '.join(_path_takers())} "
                              "(use --spire-draft / --vanilla-draft NAME=PATH for several)")
    for kind in dict.fromkeys(plain):
        specs.append(DraftSpec(kind, kind, draft_path if registry.kind(kind).path != "none" else None))
    specs += _named(list(spire_named), "spire", "--spire-draft")
    specs += _named(list(vanilla_named), "vanilla", "--vanilla-draft")
    if not specs:
        specs = [DraftSpec(registry.DEFAULT, registry.DEFAULT)]
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ConfigError(f"two drafts are named {s.name!r}: give each a distinct NAME")
        seen.add(s.name)
    for s in specs:
        if registry.kind(s.kind).path == "required" and not s.path:
            raise ConfigError(f"--draft {s.kind} needs --draft-path ({registry.kind(s.kind).summary})"
                              + (", or use --vanilla-draft NAME=PATH" if s.kind == "vanilla" else ""))
    return specs


def max_context(max_positions: int, G: int, k: int) -> int:
    """The longest L with L + G + k + 1 ≤ the target's positions."""
    return max_positions - G - k - 1


def validate(a: TauArgs, max_positions: int | None = None) -> None:
    """ConfigError for impossible settings; with max_positions, also an L that does not fit the target."""
    if a.threads is not None and a.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {a.threads}")
    for name, flag in (("G", "-G"), ("n_contexts", "--n-contexts"), ("batch_size", "--batch-size"),
                       ("max_batch_tokens", "--max-batch-tokens")):
        if int(getattr(a, name)) < 1:
            raise ConfigError(f"{flag} must be >= 1, got {getattr(a, name)}")
    check_k(a.k, max_positions, f"the target's {max_positions} positions")
    for kind, values in a.draft_options.items():
        registry.check_options(kind, values)
    if not a.Ls:
        raise ConfigError("give at least one -L")
    if any(L < 2 for L in a.Ls):
        raise ConfigError(f"context lengths must be >= 2 tokens, got {min(a.Ls)}")
    if not a.temperatures or any(not t >= 0 for t in a.temperatures):
        raise ConfigError("--temperature must be >= 0 (0 = greedy)")
    if a.nested_length is not None and (not a.nested or a.nested_length < max(a.Ls)):
        raise ConfigError(f"--nested-length needs --nested and must be >= every -L (got {a.nested_length})")
    if max_positions is not None:
        too_long = [L for L in [*a.Ls, a.nested_length or 0] if L + a.G + a.k + 1 > max_positions]
        if too_long and max_context(max_positions, a.G, a.k) < 1:
            raise ConfigError(f"G={a.G} + k+1={a.k + 1} alone exceed the target's {max_positions} positions: "
                              "lower -G or -k")
        if too_long:
            L = max(too_long)
            raise ConfigError(
                f"L={L} + G={a.G} + k+1={a.k + 1} = {L + a.G + a.k + 1} exceeds the target's {max_positions} "
                f"positions (SmolLM2 has 8192); the longest L that fits is {max_context(max_positions, a.G, a.k)}")


def build_contexts(data, a: TauArgs) -> dict[int, Any]:
    """{L: (n_contexts, L) int64 tensor} of held-out contexts (see the module docstring for ``nested``).
    DataError (naming L) when there are not enough held-out documents that long."""
    Ls = sorted(set(a.Ls))
    out = {}
    try:
        if a.nested:
            top = a.nested_length or Ls[-1]
            win = data.heldout_contexts(top, a.G, a.n_contexts, seed=a.seed)
            for L in Ls:
                out[L] = win[:, top - L: top].contiguous()
        else:
            for L in Ls:
                top = L
                out[L] = data.heldout_contexts(L, a.G, a.n_contexts, seed=a.seed)[:, :L].contiguous()
    except DataError as e:
        raise DataError(f"not enough long held-out documents for L={top}: {e}") from None
    return out


def build_continuations(data, a: TauArgs) -> dict[int, Any]:
    """{L: (n_contexts, G) int64 tensor}: the held-out text that follows each context of :func:`build_contexts`
    (nested contexts all end where the longest does, so they share its continuation)."""
    if a.nested:
        top = a.nested_length or max(a.Ls)
        cont = data.heldout_contexts(top, a.G, a.n_contexts, seed=a.seed)[:, top:].contiguous()
        return {L: cont for L in set(a.Ls)}
    return {L: data.heldout_contexts(L, a.G, a.n_contexts, seed=a.seed)[:, L:].contiguous() for L in set(a.Ls)}


def _draft_window(draft) -> tuple[int | None, int | None]:
    view = getattr(draft, "view", None) or getattr(getattr(draft, "model", None), "view", None)
    return (getattr(view, "sink", None), getattr(view, "window", None)) if view is not None else (None, None)


def build_drafts(target, tokenizer, a: TauArgs) -> list[tuple[DraftSpec, Any]]:
    """(spec, draft) per spec; a spire spec without a path gets the newest trained draft in the cache."""
    out = []
    for spec in a.drafts:
        if spec.kind == "spire" and not spec.path:
            found = find_trained_spire(target)
            if found is None:
                raise CheckpointError("--draft spire: no trained SPIRe draft for this target in the cache: run "
                                      "`spire reproduce` or `spire train`, pass --draft-path, or name drafts with "
                                      "--spire-draft NAME=PATH and leave spire out of --draft")
            spec = DraftSpec(spec.kind, spec.name, str(found))
        if spec.path:
            spec = DraftSpec(spec.kind, spec.name, str(resolve_draft_path(spec.kind, spec.path)))
        out.append((spec, make_draft(spec.kind, target, tokenizer, spec.path,
                                             **registry.check_options(spec.kind, a.draft_options.get(spec.kind, {})))))
    return out


def measure(target, data, drafts: list[tuple[DraftSpec, Any]], a: TauArgs, progress: bool = True,
            log: Callable[[str], None] | None = None, contexts: dict[int, Any] | None = None,
            on_row: Callable[[list[dict]], None] | None = None,
            natural: dict[int, Any] | None = None) -> list[dict]:
    """Every (draft, L, temperature) measurement, in that nesting order (a run cut short has whole drafts
    first); one row dict each. ``on_row(rows so far)`` is called after each measurement. ``natural``: {L: (n, G)}
    the held-out text after each context (:func:`build_continuations`) for a diagnosis's ``overlap_by_text``."""
    validate(a, target.cfg.max_positions)
    if contexts is None:  # the held-out contexts, and for a diagnosis the text that follows each
        contexts = build_contexts(data, a)
        natural = build_continuations(data, a) if a.diagnose and natural is None else natural
    jobs = [(L, t, spec, d) for spec, d in drafts for L in dict.fromkeys(a.Ls)
            for t in dict.fromkeys(a.temperatures)]
    rows = []
    for i, (L, temperature, spec, draft) in enumerate(jobs):
        bs = max(1, min(a.batch_size, a.max_batch_tokens // L))
        t0 = time.time()
        diagnosis = None
        if a.diagnose:  # the same rounds as measure_tau, read by a hook, then the verified-prefix pass
            d = diagnose_shared(target, {spec.name: draft}, contexts[L], G=a.G, k=a.k,
                                params=SamplingParams(temperature), batch_size=bs, seed=a.seed,
                                progress=progress, natural=None if natural is None else natural[L])[spec.name]
            r = TauResult(draft.name, temperature, L, a.G, a.k, len(contexts[L]), d.tau, *d.ci, time.time() - t0,
                          d.rounds, d.emitted)
            diagnosis = d.to_dict()
        else:
            r = measure_tau(target, draft, contexts[L], G=a.G, k=a.k, params=SamplingParams(temperature),
                            batch_size=bs, seed=a.seed, progress=progress)
        sink, window = _draft_window(draft)
        row = {"draft": spec.kind, "name": spec.name, **r.to_dict(per_context=True), "batch_size": bs,
               "seed": a.seed, "path": spec.path, "sink": sink, "window": window, "nested": a.nested}
        if diagnosis is not None:
            row["diagnosis"] = diagnosis
        row["draft"] = spec.kind  # TauResult's draft is the class name: keep the kind
        rows.append(row)
        if on_row is not None:
            on_row(rows)
        if log is not None:
            log(f"[{i + 1}/{len(jobs)}] {spec.name:12s} T={temperature:g} L={L}: tau {r.tau:.3f} "
                f"[{r.ci_low:.3f}, {r.ci_high:.3f}] ({r.wall_s:.0f} s)")
    return rows


def run_tau(a: TauArgs, progress: bool = True, log: Callable[[str], None] | None = None,
            out: str | Path | None = None) -> dict[str, Any]:
    """Load the target and the token data, build the drafts and contexts (every check before measuring),
    measure, and return the result object (the ``--out`` JSON). With ``out``, the file is (re)written
    atomically after every measurement with ``"complete": false``, and at the end with ``"complete": true``."""
    validate(a)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    t0 = time.time()
    validate(a, read_model_config(resolve_checkpoint(a.target, progress=progress)).max_positions)  # before the weights
    target, tokenizer, folder = load_target(a.target, progress=progress)
    data = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), progress=progress)
    contexts = build_contexts(data, a)
    drafts = build_drafts(target, tokenizer, a)
    data_info = {"key": data.summary().get("key"), "heldout_documents": len(data.heldout)}

    def result(rows: list[dict], complete: bool) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "complete": complete,
            "rows": rows,
            "target": {"spec": a.target, "checkpoint": str(folder), "n_layers": target.cfg.n_layers,
                       "max_positions": target.cfg.max_positions, "dtype": str(target.dtype).replace("torch.", "")},
            "settings": {**{key: value for key, value in asdict(a).items() if key != "drafts"},
                         "drafts": [asdict(s) for s in a.drafts],
                         "protocol": "held-out contexts, tau = emitted / rounds (bonus included), 95 % percentile "
                                     "bootstrap CI over contexts"},
            "data": data_info,
            "environment": {"torch": torch.__version__, "python": platform.python_version(),
                            "threads": torch.get_num_threads(), "device": str(target.device),
                            "backend": backend_of(target).describe()},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "wall_s": time.time() - t0,
        }  # fmt: skip

    on_row = None if out is None else (lambda rows: write_json(out, result(rows, False)))
    natural = build_continuations(data, a) if a.diagnose else None
    final = result(measure(target, data, drafts, a, progress=progress, log=log, contexts=contexts,
                           on_row=on_row, natural=natural), True)
    if out is not None:
        write_json(out, final)
    return final


def write_json(path: str | Path, result: dict[str, Any]) -> Path:
    """Write the result object atomically (readers see the old file or the whole new one)."""
    return atomic_write(path, None, json.dumps(result, indent=1) + "\n")


def merge_files(paths: list[str | Path]) -> dict[str, Any]:
    """The rows of several ``spire tau`` JSON files in one object (the first file's other keys; "merged_from"
    lists the files). ConfigError for a missing or malformed file."""
    objs = [read_tau_file(p, "--show") for p in paths]
    merged = dict(objs[0])
    merged["rows"] = [r for o in objs for r in o["rows"]]
    merged["complete"] = all(o.get("complete", True) for o in objs)
    if len(objs) > 1:
        merged["merged_from"] = [{"file": str(p), "settings": o.get("settings"), "created": o.get("created")}
                                 for p, o in zip(paths, objs)]
    return merged


def unlike_settings(rows: list[dict]) -> str | None:
    """Which measurement settings (G, k, n_contexts, seed) differ between rows, e.g. "G 16, 64", or None."""
    def ordered(values: set) -> list:
        try:
            return sorted(values)
        except TypeError:  # a missing field (None) beside numbers
            return sorted(values, key=str)

    spread = {name: ordered({r.get(name) for r in rows}) for name in ("G", "k", "n_contexts", "seed")}
    parts = [f"{name} {', '.join(map(str, values))}" for name, values in spread.items() if len(values) > 1]
    return "; ".join(parts) or None


def table_markdown(rows: list[dict]) -> str:
    """τ [95 % CI] per (draft name, T) against L, as a Markdown table."""
    Ls = sorted({r["L"] for r in rows})
    keys = list(dict.fromkeys((r["name"], r["temperature"]) for r in rows))
    cell = {(r["name"], r["temperature"], r["L"]): r for r in rows}
    lines = ["| draft | T | " + " | ".join(f"L = {L}" for L in Ls) + " |", "|---|---|" + "---|" * len(Ls)]
    for name, t in keys:
        cells = [f"{c['tau']:.3f} [{c['ci_low']:.3f}, {c['ci_high']:.3f}]" if c else "–"
                 for c in (cell.get((name, t, L)) for L in Ls)]
        lines.append(f"| {name} | {t:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_table(result: dict[str, Any]) -> None:
    """A rich table: one line per (draft, T), one column per L, τ with its 95 % CI."""
    rows = result["rows"]
    Ls = sorted({r["L"] for r in rows})
    keys = list(dict.fromkeys((r["name"], r["draft"], r["temperature"]) for r in rows))
    cell = {(r["name"], r["temperature"], r["L"]): r for r in rows}
    G = ",".join(sorted({str(r.get("G")) for r in rows}))
    k = ",".join(sorted({str(r.get("k")) for r in rows}))
    n = ",".join(sorted({str(r.get("n_contexts")) for r in rows}))
    nested = any(r.get("nested") for r in rows)
    target = (result.get("target") or {}).get("spec", "?")
    table = Table(title=f"τ on {target}: G={G}, k={k}, {n} held-out contexts{' (nested)' if nested else ''}",
                  caption="τ = tokens per round (bonus included) [95 % bootstrap CI]")
    for column in ("draft", "kind", "T", *(f"L={L}" for L in Ls)):
        table.add_column(column, justify="left" if column in ("draft", "kind") else "right")
    for name, kind, t in keys:
        cells = [f"{c['tau']:.3f} [{c['ci_low']:.2f}, {c['ci_high']:.2f}]" if c else "-"
                 for c in (cell.get((name, t, L)) for L in Ls)]
        table.add_row(name, kind, f"{t:g}", *cells)
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def temperatures(values: list[str]) -> list[float]:
    """--temperature values, repeated and/or comma-separated (none given: 0,1), as floats. Raises ConfigError."""
    temps: list[float] = []
    for value in values or ["0,1"]:
        for item in value.split(","):
            try:
                temps.append(float(item))
            except ValueError:
                raise ConfigError(f"--temperature: {item.strip()!r} is not a number") from None
    return temps


def args_from_options(p: dict[str, Any]) -> TauArgs:
    """The :class:`TauArgs` of `spire tau`'s options ``p`` (by parameter name, as typer parsed them), validated
    (:func:`validate`). Raises ConfigError."""
    args = TauArgs(drafts=parse_drafts(p["draft"], p["draft_path"], p["spire_draft"], p["vanilla_draft"]),
                   Ls=ints("-L", p["L"]), G=p["G"], k=p["k"], temperatures=temperatures(p["temperature"]),
                   n_contexts=p["n_contexts"], batch_size=p["batch_size"], max_batch_tokens=p["max_batch_tokens"],
                   seed=p["seed"], target=p["target"], draft_options=p.get("draft_options") or {}, nested=p["nested"],
                   nested_length=p["nested_length"], threads=p["threads"], diagnose=p["diagnose"])
    validate(args)
    draft_options_for(None, args.draft_options, {d.kind for d in args.drafts})  # a note for options that do nothing
    return args


def command(p: dict[str, Any], log: Callable[[str], None]) -> None:
    """`spire tau` from its options ``p`` (by parameter name): merge the --show files or measure (writing --out as
    it goes), then print the result as ``p["fmt"]`` (table, json, markdown) on stdout; notes go through ``log``.
    Raises SpireError subclasses (ConfigError for an option, before any loading)."""
    out = p["out"]
    if out is not None:
        check_output_path(out, "--out")
    if p["figure"] is not None:
        if Path(p["figure"]).suffix.lower() not in (".png", ".pdf", ".svg"):
            raise ConfigError(f"--figure {p['figure']}: name a .png, .pdf or .svg file")
        check_output_path(p["figure"], "--figure")
    if p["show"] and p["diagnose"]:
        log("warning: --diagnose measures; with --show nothing is measured (the files' diagnoses are shown)")
    if p["show"]:
        result = merge_files(p["show"])
        unlike = unlike_settings(result["rows"])
        if unlike:
            log(f"warning: the rows were measured with different settings ({unlike}): compare τ only between rows "
                "measured alike (the JSON's merged_from keeps each file's settings)")
        cells = Counter((r["name"], r["temperature"], r["L"]) for r in result["rows"])
        twice = sorted(f"{n} T={t:g} L={L}" for (n, t, L), c in cells.items() if c > 1)
        if twice:
            log(f"warning: several files measure {', '.join(twice)}: the table shows the last file's row, the JSON "
                "keeps every row")
        if not result["complete"]:
            log("warning: a --show file is incomplete (its run was cut short: \"complete\": false)")
        if out is not None:
            log(f"wrote {write_json(out, result)}")
    else:
        args = args_from_options(p)
        result = run_tau(args, progress=not p["no_progress"], log=None if p["no_progress"] else log, out=out)
        if out is not None:
            log(f"wrote {out}")
    diagnosed = [r for r in result["rows"] if r.get("diagnosis")]
    figure = p["figure"] if p["figure"] is not None else (Path(out).with_suffix(".png") if out and diagnosed else None)
    if diagnosed and figure is not None:
        Path(figure).parent.mkdir(parents=True, exist_ok=True)
        plot_diagnosis(diagnosed, figure)
        log(f"wrote {figure}")
    elif p["figure"] is not None:
        log("warning: --figure: no row has a diagnosis (measure with --diagnose), no figure written")
    if p["fmt"] == "json":
        typer.echo(json.dumps(result))
    elif p["fmt"] == "markdown":
        typer.echo(table_markdown(result["rows"]))
    else:
        print_table(result)
    if diagnosed and p["fmt"] != "json":
        typer.echo("\n" + diagnosis_markdown(diagnosed))  # a blank line: Markdown would join the two tables
