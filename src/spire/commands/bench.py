"""The logic behind ``spire bench`` and ``spire bench calibrate`` (kept out of spire.cli)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import typer

import spire.bench.run as bench_run
from spire import defaults, kernels
from spire.bench.calibrate import (TORCH_DTYPES, Calibration, cached_calibration, calibrate, load_calibration,
                                   resolve_device)
from spire.bench.run import BenchConfig, run_bench, summarize
from spire.commands.options import ints
from spire.data import document_separator_id, prepare_data
from spire.drafts import make_draft
from spire.drafts.spire import find_trained_spire
import spire.registry as registry
from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel
from spire.errors import ConfigError
from spire.fastpath import use_bf16_weights, use_int8_weights
from spire.loading import load_target
from spire.paths import check_output_path

QUICK = dict(Bs=[1, 2], Ls=[64, 128], G=8, reps=2)
"""``--quick``: a smoke-test grid (about a minute on 2 CPU cores with SmolLM2)."""


@dataclass
class BenchArgs:
    """Every option of ``spire bench`` (None = not given)."""

    Bs: list[int] | None = None
    Ls: list[int] | None = None
    k: int = defaults.K
    G: int | None = None
    reps: int | None = None
    contexts: int = 1
    target: str = "smollm2-135m"
    dtype: str = "fp32"
    weights: str = "fp32"  # "bf16": weight-only bf16 (CPU, fp32 dtype)
    draft_weights: str | None = None  # SPIRe / vanilla weights: "fp32", "bf16" or "int8"; None: as ``weights``
    device: str = "auto"
    threads: int | None = None
    draft_path: list[str] = field(default_factory=list)  # KIND=PATH of the trained drafts
    spire_draft: str | None = None  # the old per-kind flags: aliases of --draft-path KIND=PATH for one release
    no_spire: bool = False
    vanilla_draft: str | None = None
    eagle3_draft: str | None = None
    no_ngram: bool = False
    draft_options: dict = field(default_factory=dict)  # kind -> {option: value}: the kinds' own flags (--window)
    calibration: Path | None = None
    out: Path | None = Path("spire-bench")
    quick: bool = False
    random_weights: bool = False
    seed: int = 0
    combine: str = "max"
    clock: str = "wall"
    extra: dict[str, Any] = field(default_factory=dict)

    def config(self) -> BenchConfig:
        base = BenchConfig(**QUICK) if self.quick else BenchConfig()
        for name, value in (("Bs", self.Bs), ("Ls", self.Ls), ("G", self.G), ("reps", self.reps)):
            if value is not None:
                setattr(base, name, value)
        for kind, values in self.draft_options.items():  # every kind's flags checked before anything loads
            registry.check_options(kind, values)
        view = registry.check_options(registry.BASELINE, self.draft_options.get(registry.BASELINE, {}))
        base.sink, base.window = view.get("sink", defaults.SINK), view.get("window", defaults.WINDOW)
        base.k, base.seed, base.combine = self.k, self.seed, self.combine
        base.clock, base.contexts = self.clock, self.contexts
        base.validate()
        return base


def set_threads(threads: int | None) -> None:
    """torch intra-op threads (None: leave torch's default). Raises ConfigError when < 1."""
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def get_calibration(path: Path | None, device: torch.device, dtype: str, quick: bool,
                    log: Callable[[str], None]) -> Calibration:
    """The calibration to predict with: ``path``; else the cached one of this device (if it has ``dtype``);
    else a fresh one for ``dtype`` (quick when ``quick``), saved to the cache unless quick (with the other dtypes
    of the saved one kept, where it was a full calibration; ``notes["kept_from"]`` says when those were measured)."""
    if path is not None:
        cal = load_calibration(path)
        cal.hardware(dtype)  # ConfigError when the dtype is missing
        return cal
    cal = cached_calibration(device)
    if cal is not None and dtype in cal.dtypes and (quick or not cal.quick):
        log(f"calibration: cached {cal.device_name} ({cal.created})")
        return cal
    log(f"calibration: measuring {dtype} on {device} (`spire bench calibrate` saves one to reuse)")
    old = cal
    cal = calibrate([dtype], device, quick=quick, log=log)
    if not quick:
        if old is not None and not old.quick:  # keep the other dtypes of the saved calibration
            kept = {k: v for k, v in old.dtypes.items() if k != dtype}
            if kept:
                cal.dtypes = {**kept, **cal.dtypes}
                cal.notes = {**cal.notes, "kept_from": {k: old.created for k in kept}}
        log(f"calibration saved to {cal.save()}")
    return cal


def untrained_drafts(args: BenchArgs, target) -> tuple[dict, dict, list[str]]:
    """(name -> draft, name -> where it came from, skipped) for the kinds that need no training (MagicDec over
    --sink / --window; n-gram, whose draft step is its lookup, unless --no-ngram)."""
    drafts: dict[str, Any] = {}
    sources: dict[str, str] = {}
    skipped: list[str] = []
    for name in registry.names(drafts_only=True, trains=False):
        if name == "ngram" and args.no_ngram:
            skipped.append("ngram: --no-ngram")
            continue
        drafts[name] = make_draft(name, target, **registry.check_options(name, args.draft_options.get(name, {})))
        view = getattr(drafts[name], "view", None)
        sources[name] = registry.kind(name).summary + (f": sink {view.sink} + window {view.window}" if view else "")
    return drafts, sources, skipped


def draft_paths(args: BenchArgs, log: Callable[[str], None]) -> dict[str, str]:
    """kind -> path of the trained drafts to measure: ``--draft-path KIND=PATH`` (repeatable), and the old
    ``--spire-draft`` / ``--vanilla-draft`` / ``--eagle3-draft`` as its aliases for one release (a deprecation line
    each). Raises ConfigError for a kind that takes no path, or a kind given twice."""
    paths: dict[str, str] = {}
    for value in args.draft_path:
        kind, sep, path = value.partition("=")
        if not sep or not path.strip():
            raise ConfigError(f"--draft-path expects KIND=PATH (e.g. eagle3=runs/eagle3), got {value!r}")
        kind = kind.strip()
        if kind not in registry.names(trains=True):
            raise ConfigError(f"--draft-path {value!r}: KIND is one of the trained kinds, "
                              f"{', '.join(registry.names(trains=True))}")
        if kind in paths:
            raise ConfigError(f"--draft-path {kind}=... given twice")
        paths[kind] = path.strip()
    for kind, old in (("spire", args.spire_draft), ("vanilla", args.vanilla_draft), ("eagle3", args.eagle3_draft)):
        if old:
            log(f"warning: --{kind}-draft is deprecated; use --draft-path {kind}=PATH")
            if kind in paths:
                raise ConfigError(f"--{kind}-draft and --draft-path {kind}=... both given")
            paths[kind] = old
    for kind in paths:
        if not registry.kind(kind).trains:
            raise ConfigError(f"--draft-path {kind}=...: --draft {kind} takes no path (trained kinds: "
                              f"{', '.join(registry.names(trains=True))})")
    return paths


def load_drafts(args: BenchArgs, target, tokenizer, log: Callable[[str], None],
                paths: dict[str, str] | None = None) -> tuple[dict, list[str], dict]:
    """name -> draft for the run, messages for the drafts skipped, name -> where each draft came from."""
    drafts, sources, skipped = untrained_drafts(args, target)
    paths = draft_paths(args, log) if paths is None else paths
    for name in registry.names(trains=True):
        path = paths.get(name)
        if name == "spire" and args.no_spire:
            skipped.append("spire: --no-spire")
        elif path:
            drafts[name], sources[name] = make_draft(name, target, tokenizer, path), str(path)
        elif name == "spire":  # the kind with a default: the newest trained in the cache
            found = find_trained_spire(target)
            if found is None:
                skipped.append("spire: no trained SPIRe draft for this target in the cache and no --draft-path "
                               "spire=PATH")
            else:
                log(f"SPIRe draft: {found}")
                drafts["spire"] = make_draft("spire", target, tokenizer, str(found))
                sources["spire"] = f"{found} (newest trained in the cache)"
        else:
            skipped.append(f"{name}: no --draft-path {name}=PATH given ({registry.kind(name).summary})")
    for msg in skipped:
        log(f"skipped {msg}")
    return drafts, skipped, sources


DRAFT_WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 64}
"""Bytes streamed per draft weight value by --draft-weights (int8: the value and its share of a float32 scale
per 64 inputs), for the cost model's draft step."""


def check_positions(cfg, target) -> None:
    """ConfigError when the longest cell (L + G + k + 1) does not fit the target's positions."""
    longest = max(cfg.Ls) + cfg.G + cfg.k + 1
    if longest > target.cfg.max_positions:
        raise ConfigError(f"L={max(cfg.Ls)} + G={cfg.G} + k+1={cfg.k + 1} exceeds the target's "
                          f"{target.cfg.max_positions} positions")


def run(args: BenchArgs, log: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load everything, run the grid, return (result, summary). Raises SpireError subclasses."""
    cfg = args.config()
    paths = draft_paths(args, log)  # checked (and the old flags' deprecation said) before anything loads
    if args.dtype not in TORCH_DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(TORCH_DTYPES)}, got {args.dtype!r}")
    set_threads(args.threads)
    device = resolve_device(args.device)
    if args.weights not in ("fp32", "bf16"):
        raise ConfigError(f"--weights must be fp32 or bf16, got {args.weights!r}")
    draft_weights = args.weights if args.draft_weights is None else args.draft_weights
    if draft_weights not in ("fp32", "bf16", "int8"):
        raise ConfigError(f"--draft-weights must be fp32, bf16 or int8, got {draft_weights!r}")
    if args.draft_weights is not None and args.dtype != "fp32":
        if args.draft_weights != args.dtype:
            raise ConfigError(f"--draft-weights applies to --dtype fp32 (with --dtype {args.dtype} every draft is "
                              f"{args.dtype})")
        draft_weights = args.weights  # --dtype bf16 --draft-weights bf16: the draft is bf16 already
    if "bf16" in (args.weights, draft_weights) and (args.dtype != "fp32" or device.type != "cpu"):
        raise ConfigError("--weights / --draft-weights bf16 is weight-only bf16 for --dtype fp32 on the CPU "
                          "(on a GPU use --dtype bf16)")
    if draft_weights == "int8" and (args.dtype != "fp32" or device.type != "cpu"):
        raise ConfigError("--draft-weights int8 is weight-only int8 for --dtype fp32 on the CPU")
    if args.random_weights:
        target, folder = bench_run.random_target(TORCH_DTYPES[args.dtype], device, args.seed), None
        check_positions(cfg, target)
        n_draft = max(1, round(target.cfg.n_layers * 8 / 30))  # SmolLM2: its last 8 of 30 layers
        drafts, sources, skipped = untrained_drafts(args, target)
        model = SpireDraftModel(target, SpireConfig(n_draft_layers=n_draft)).requires_grad_(False)  # decodes frozen
        drafts["spire"] = SpireDraft(model)
        sources["spire"] = f"untrained pruned copy of the last {n_draft} layers"
        skipped += ["random weights: τ and tokens/s of SD are meaningless (timings and Δt are real); the SPIRe "
                    "draft is an untrained pruned copy", "vanilla: not with --random-weights"]
        if args.no_spire:  # honoured here too (it was ignored with --random-weights)
            drafts.pop("spire")
            sources.pop("spire")
            skipped[-2] = "spire: --no-spire"
        log(f"random-weights {args.target}-shaped target: timings only"
            + ("; --draft-path ignored (a draft trained for the real target does not fit)"
               if args.draft_path or args.spire_draft or args.vanilla_draft or args.eagle3_draft else ""))
        gen = torch.Generator().manual_seed(cfg.seed)

        def contexts_for(L: int, n: int) -> torch.Tensor:
            return torch.randint(0, target.cfg.vocab_size, (n, L), generator=gen)
    else:
        target, tokenizer, folder = load_target(args.target, dtype=TORCH_DTYPES[args.dtype], device=str(device),
                                                progress=False)
        check_positions(cfg, target)  # before the drafts load and the hardware is calibrated
        drafts, skipped, sources = load_drafts(args, target, tokenizer, log, paths)
        data = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), progress=False)

        def contexts_for(L: int, n: int) -> torch.Tensor:
            return data.heldout_contexts(L, cfg.G, n, seed=cfg.seed)[:, :L]
    weight_bytes = draft_weight_bytes = None
    own = [d.model for d in drafts.values() if getattr(d, "model", None) is not None]  # drafts with own weights
    if args.weights == "bf16":
        use_bf16_weights(target, *(own if draft_weights == "bf16" else []))
        weight_bytes = 2.0
        log("weight-only bf16: target" + (" and draft" if draft_weights == "bf16" else "") + " weights rounded to "
            "bf16, streamed at 2 bytes per value" + ("; draft weights float32" if draft_weights == "fp32" else ""))
    elif draft_weights == "bf16" and own:
        use_bf16_weights(*own)
        log("draft weights bf16: the SPIRe / vanilla draft weights rounded to bf16 and streamed at 2 bytes per "
            "value; the target stays float32 (SD stays lossless: q is what the draft samples from)")
    if draft_weights == "int8" and own:
        use_int8_weights(*own)
        log("draft weights int8: the SPIRe / vanilla draft's linear weights rounded to group-wise int8 (a scale "
            "per 64 inputs) and streamed at 1.06 bytes per value; the target stays "
            f"{'bf16-rounded' if args.weights == 'bf16' else 'float32'} (SD stays lossless: q is what the draft "
            "samples from)")
    if draft_weights != args.weights and not own:
        log("--draft-weights: no SPIRe or vanilla draft in this run (MagicDec's draft is the target): ignored")
    elif draft_weights != args.weights:
        draft_weight_bytes = DRAFT_WEIGHT_BYTES[draft_weights]
    if (weight_bytes or draft_weight_bytes) and not kernels.available():  # the rounded weights stream as float32
        log(f"spire kernels unavailable ({kernels.unavailable_reason()}): the rounded weights run through torch "
            "from their float32 storage, and are priced at 4 bytes per value")
        weight_bytes = 4.0 if weight_bytes else None
        draft_weight_bytes = 4.0 if draft_weight_bytes else None
    cal = get_calibration(args.calibration, device, args.dtype, args.quick, log)
    hw = cal.hardware(args.dtype)
    result = run_bench(target, contexts_for, drafts, cfg, hoi=hw.hoi(args.dtype), flops_per_s=hw.flops_for(args.dtype),
                       dtype_name=args.dtype, progress=log, weight_bytes=weight_bytes,
                       draft_weight_bytes=draft_weight_bytes)
    result.update(draft_weights=args.dtype if args.dtype != "fp32" else draft_weights if own else args.weights,
                  target=str(args.target) + (" (random weights)" if args.random_weights else ""),
                  folder=None if folder is None else str(folder), calibration=cal.to_dict(), skipped=skipped,
                  drafts=sources,
                  threads=torch.get_num_threads(), torch_version=torch.__version__)
    return result, summarize(result)


def command(p: dict[str, Any], log: Callable[[str], None]) -> None:
    """`spire bench` from its options ``p`` (by parameter name, as typer parsed them): run the grid, write
    bench.json and BENCH.md into ``p["out"]``, print the table (``p["fmt"]`` "table") or the JSON object with its
    summary ("json") on stdout; progress and the written paths go through ``log``. Raises SpireError
    subclasses."""
    from spire.bench.report import print_table, write_outputs

    check_output_path(p["out"], "--out", folder=True)
    args = BenchArgs(Bs=ints("-B", p["B"]) or None, Ls=ints("-L", p["L"]) or None,
                     **{name: value for name, value in p.items() if name not in ("B", "L", "fmt")})
    result, summary = run(args, log=log)
    j, m = write_outputs(result, summary, p["out"])
    if p["fmt"] == "json":
        typer.echo(json.dumps({**result, "summary": summary}))
    else:
        weights, dw = p["weights"], result.get("draft_weights", p["weights"])
        draft_note = "" if dw == weights else f" ({dw} draft weights)"
        print_table(result, title=f"spire bench: {p['target']}, {p['dtype']}"
                                  + (" (bf16 weights)" if weights == "bf16" else "") + draft_note
                                  + f", {result['device']}")
    log(f"wrote {j} and {m}")


def calibrate_command(dtypes: list[str], device: str, threads: int | None, quick: bool, buffer_mb: float | None,
                      out: Path | None, no_save: bool, clock: str, fmt: str, log: Callable[[str], None]) -> None:
    """`spire bench calibrate`: measure the roofline of ``dtypes`` (repeated and/or comma-separated; none:
    fp32,bf16) on ``device``; save it to the spire cache (unless ``no_save`` or ``quick``) and to ``out``; print
    one HOI line per dtype ("table") or the JSON object ("json") on stdout. Raises ConfigError for a
    non-positive ``buffer_mb`` (MiB) or ``threads``."""
    names = [d.strip() for v in dtypes for d in v.split(",") if d.strip()] or ["fp32", "bf16"]
    if buffer_mb is not None and not buffer_mb > 0:
        raise ConfigError(f"--buffer-mb must be positive, got {buffer_mb}")
    set_threads(threads)
    cal = calibrate(names, device, quick=quick, buffer_bytes=None if buffer_mb is None else int(buffer_mb * 2**20),
                    log=None if fmt == "json" else log, clock=clock)
    written = []
    if not no_save and not quick:
        written.append(cal.save())
    if out is not None:
        written.append(cal.save(out))
    if fmt == "json":
        typer.echo(json.dumps(cal.to_dict()))
    else:
        for name in cal.dtypes:
            typer.echo(f"{cal.device_name} {name}: HOI {cal.hoi(name):.2f} FLOP/byte")
    for path in written:
        log(f"wrote {path}")
