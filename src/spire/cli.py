"""The ``spire`` command line. One function per command; each is a thin call into the library.

Any :class:`spire.errors.SpireError` is printed as one line ``error: <message>`` on stderr, exit code 2.

What a command does beyond parsing its options lives in :mod:`spire.commands`. Each command imports the
library inside its function, on purpose: ``spire --help`` and every command load only what they use (importing
torch alone takes seconds). Defaults shared with the library come from :mod:`spire.defaults`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from spire import defaults
import spire.drafts.registry as registry
from spire.errors import ConfigError, SpireError
from spire.paths import check_output_path

app = typer.Typer(
    name="spire",
    help="Throughput-oriented speculative decoding (SPIRe, Neelam et al. 2025, arXiv 2504.06419).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts are plain: "[bfloat16]" is a default, not a rich style tag
)

GOLDEN_LS = "8,16,32,64,128,256,512,1024,2048,4096,8192"  # the L of the paper's B = 64 table
GRID_HELP = "Repeat the option or comma-separate values: -B 1 -B 8,64."


@app.callback()
def _root() -> None:
    """Throughput-oriented speculative decoding (SPIRe, arXiv 2504.06419)."""


def _ints(name: str, values: list[str]) -> list[int]:
    """Integers from repeated and/or comma-separated option values: ``-B 1 -B 8,64`` -> [1, 8, 64]."""
    out = []
    for value in values:
        for item in value.split(","):
            try:
                out.append(int(item.strip()))
            except ValueError:
                raise ConfigError(f"{name}: {item.strip()!r} is not an integer") from None
    return out


def _floats(values: list[str], option: str) -> dict[str, float]:
    """``DRAFT=VALUE`` strings -> {draft: value}, for --tau and --alpha."""
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


def _taus(values: list[str]) -> dict[str, float]:
    """τ overrides from ``DRAFT=VALUE`` strings."""
    return _floats(values, "--tau")


def _names(values: list[str]) -> dict[str, str]:
    """``KIND=NAME`` strings -> {kind: name}, for --tau-draft."""
    out = {}
    for value in values:
        kind, sep, name = value.partition("=")
        if not sep or not kind.strip() or not name.strip():
            raise ConfigError(f"--tau-draft expects KIND=NAME (e.g. spire=nofeedback), got {value!r}")
        out[kind.strip()] = name.strip()
    return out


_OPT = typer.Option


@app.command()
def throughput(
    ctx: typer.Context,
    preset: Annotated[str, _OPT(help="Model preset: paper-67m, llama3-70b (alias paper-70b) or smollm2-135m.")]
    = "paper-67m",
    B: Annotated[list[str], _OPT("-B", "--batch", metavar="INT[,INT...]", help=GRID_HELP)] = ["64"],
    L: Annotated[list[str], _OPT("-L", "--context", metavar="INT[,INT...]",
                                 help="Repeat the option or comma-separate values: -L 512 -L 1024,2048.")]
    = [GOLDEN_LS],
    k: Annotated[int, _OPT("--k", "-k", help="Speculation depth: draft tokens per round.")] = defaults.K,
    hoi: Annotated[Optional[float], _OPT(help="Hardware operational intensity, FLOPs per byte "
                                              "[default: 600, or the --hardware's].")] = None,
    combine: Annotated[Literal["max", "sum"], _OPT(help="Overlap compute and memory fully (max) or not at all (sum).")]
    = "max",
    tau: Annotated[list[str], _OPT(metavar="DRAFT=VALUE", help="τ of a draft kind (vanilla, magicdec, spire, eagle3, ngram); repeatable.")]
    = [],
    tau_from: Annotated[Optional[Path], _OPT(metavar="FILE", help="Measured τ from `spire tau --out FILE`, per draft "
                                                                  "and L (interpolated in log L); --tau wins.")]
    = None,
    tau_temperature: Annotated[float, _OPT(help="With --tau-from: the temperature whose τ is used.")] = 0.0,
    tau_draft: Annotated[list[str], _OPT(metavar="KIND=NAME", help="With --tau-from: which measured draft gives "
                                                                   "the τ of a kind (e.g. spire=nofeedback).")]
    = [],
    alpha: Annotated[list[str], _OPT(metavar="DRAFT=VALUE", help="Acceptance rate α of a draft: τ = (1−α^(k+1))/(1−α).")]
    = [],
    best_k: Annotated[Optional[int], _OPT(metavar="KMAX", help="With --alpha: the best k in 1..KMAX per (B, L).")]
    = None,
    memory_gb: Annotated[Optional[float], _OPT(help="Device memory in GB (1e9 bytes); marks points that do not fit.")]
    = None,
    bytes_per_value: Annotated[Optional[float], _OPT(help="Bytes per weight and KV value [default: 1].")] = None,
    dtype: Annotated[Optional[str], _OPT(help="Weight/compute dtype: fp32, bf16, fp16, fp8, int8, int4.")] = None,
    kv_dtype: Annotated[Optional[str], _OPT(help="KV-cache dtype [default: --dtype].")] = None,
    hardware: Annotated[Optional[str], _OPT(help="h100-sxm, h200, b200, a100, tpu-v5e or mi300x: sets HOI, memory "
                                                  "and tokens/s.")] = None,
    flops: Annotated[Optional[float], _OPT(help="Custom hardware: peak FLOP/s (with --bandwidth).")] = None,
    bandwidth: Annotated[Optional[float], _OPT(help="Custom hardware: memory bytes/s (with --flops).")] = None,
    attention_flops: Annotated[bool, _OPT("--attention-flops", help="Count attention-score FLOPs.")] = False,
    embeddings: Annotated[bool, _OPT("--embeddings", help="Count embedding / unembedding weights and FLOPs.")]
    = False,
    draft_window: Annotated[Optional[int], _OPT(help="Fixed StreamingLLM window in tokens [default: L // 8].")]
    = None,
    config: Annotated[Optional[Path], _OPT(help="Target shape from an HF config.json (or its folder).")] = None,
    vanilla_config: Annotated[Optional[Path], _OPT(help="Vanilla draft shape from an HF config.json.")] = None,
    spire_config: Annotated[Optional[Path], _OPT(help="SPIRe draft from spire's draft config (.json or "
                                                       ".safetensors).")] = None,
    spire_layers: Annotated[Optional[int], _OPT(help="SPIRe draft = the target's last N layers.")] = None,
    contexts: Annotated[Optional[str], _OPT(metavar="INT,INT,...", help="One mixed batch: a context length per "
                                                                        "request.")] = None,
    contexts_file: Annotated[Optional[Path], _OPT(help="Mixed batch: context lengths from a file.")] = None,
    context_dist: Annotated[Optional[str], _OPT(metavar="SPEC", help="Mixed batch of -B requests drawn from e.g. "
                                                                     "lognormal:median=512,sigma=1.")] = None,
    seed: Annotated[int, _OPT(help="Seed for --context-dist.")] = 0,
    grow: Annotated[Optional[int], _OPT(metavar="G", help="Also the multiplier while the context grows over G "
                                                          "generated tokens.")] = None,
    cost_analysis: Annotated[bool, _OPT("--cost-analysis", help="Add saving = 10·(1 − 1/m) − training cost.")]
    = False,
    calibration: Annotated[Optional[Path], _OPT(help="Measured hardware from `spire bench calibrate` (JSON): its "
                                                     "FLOP/s and bandwidth, and --dtype's bytes per value "
                                                     "(default fp32).")] = None,
    fmt: Annotated[Literal["table", "json", "csv"], _OPT("--format", help="Rich table, one JSON object, or CSV.")]
    = "table",
    plot: Annotated[Optional[Path], _OPT(help="Also write a PNG heatmap of the multiplier here.")] = None,
) -> None:
    """Throughput multiplier τ/Δt of every draft kind with a τ (the paper's three, EAGLE-3, n-gram) from the paper's
    cost model."""
    from spire.commands.throughput import ThroughputArgs, build, print_table, to_csv, to_json, write_plot

    if plot is not None:
        check_output_path(plot, "--plot")
    given = {name: value for name, value in ctx.params.items() if name not in ("fmt", "plot")}
    for name in ("B", "L", "tau", "alpha", "contexts", "tau_draft"):  # parsed here, in this order
        given.pop(name)
    parsed = {"Bs": _ints("-B", B), "Ls": _ints("-L", L), "taus": _taus(tau), "alphas": _floats(alpha, "--alpha"),
              "contexts": None if contexts is None else _ints("--contexts", [contexts]), "tau_drafts": _names(tau_draft)}
    summary, rows, chosen = build(ThroughputArgs(**given, **parsed))
    if plot is not None:
        typer.echo(f"wrote {write_plot(summary, rows, chosen, plot)}", err=True)
    if fmt == "json":
        typer.echo(to_json(summary, rows))
    elif fmt == "csv":
        typer.echo(to_csv(rows), nl=False)
    else:
        print_table(chosen.name, chosen.description, rows)


@app.command("throughput-figures")
def throughput_figures(
    out: Annotated[Path, _OPT(help="Folder for the PNGs and figures.json.")] = Path("spire-figures"),
    preset: Annotated[str, _OPT(help="Model preset of Figures 1, 3, 4, 5.")] = "paper-67m",
    extrapolation: Annotated[str, _OPT(help="Preset of Figure 6.")] = "llama3-70b",
    k: Annotated[int, _OPT("--k", "-k", help="Speculation depth.")] = defaults.K,
    hoi: Annotated[float, _OPT(help="Hardware operational intensity, FLOPs per byte.")] = 600.0,
    G: Annotated[int, _OPT("-G", help="Generated tokens for the growing-context metric.")] = 64,
) -> None:
    """Every figure of the paper's throughput analysis (Figures 1, 3, 4, 5, 6, growing context) + JSON."""
    from spire.throughput import get_preset
    from spire.throughput.figures import write_figures

    check_output_path(out, "--out", folder=True)
    data = write_figures(out, get_preset(preset), get_preset(extrapolation), k=k, hoi=hoi, G=G)
    h = data["headline"]
    typer.echo(f"wrote {len(data['files'])} figures and figures.json to {out}")
    typer.echo(f"(B, L) = ({h['B']}, {h['L']}): SPIRe {h['multiplier']['spire']:.2f}x, "
               f"+{h['spire_gain_vs_vanilla_pct']:.1f} % vs vanilla, +{h['spire_gain_vs_magicdec_pct']:.1f} % vs "
               f"MagicDec; saving {h['spire_saving_units']:.2f} training units")


@app.command()
def tau(
    draft: Annotated[list[str], _OPT(metavar="KIND[,KIND...]", help=f"{', '.join(registry.names(drafts_only=True))}; "
                                                                    f"repeatable (default: {registry.DEFAULT}).")] = [],
    draft_path: Annotated[Optional[str], _OPT(help="The trained draft of the one --draft that trains: spire "
                                                   "(.safetensors or run folder; default the newest trained), vanilla "
                                                   "(.gguf / HF folder), eagle3 (run or speculators folder).")] = None,
    spire_draft: Annotated[list[str], _OPT(metavar="NAME=PATH", help="A named SPIRe draft; repeatable.")] = [],
    vanilla_draft: Annotated[list[str], _OPT(metavar="NAME=PATH", help="A named vanilla draft; repeatable.")]
    = [],
    L: Annotated[list[str], _OPT("-L", "--context", metavar="INT[,INT...]", help="Context lengths; repeat or "
                                                                               "comma-separate: -L 256,512.")]
    = ["512"],
    G: Annotated[int, _OPT("-G", "--generate", help="Tokens generated per context.")] = 64,
    k: Annotated[int, _OPT("--k", "-k", help="Draft tokens per round.")] = defaults.K,
    temperature: Annotated[list[str], _OPT(metavar="T[,T...]", help="Sampling temperatures (0 = greedy); "
                                                                    "repeatable (default: 0,1).")] = [],
    n_contexts: Annotated[int, _OPT(help="Held-out contexts per measurement.")] = 16,
    batch_size: Annotated[int, _OPT(help="Contexts decoded together (fewer at long L, see --max-batch-tokens).")]
    = 8,
    max_batch_tokens: Annotated[int, _OPT(help="Cap on batch × L per batch (prefill logits memory).")] = 8192,
    seed: Annotated[int, _OPT(help="Seed of the held-out windows and of sampling.")] = 0,
    target: Annotated[str, _OPT(help="Target: smollm2-135m, a .gguf file or an HF folder.")] = "smollm2-135m",
    sink: Annotated[int, _OPT(help="MagicDec sink tokens.")] = defaults.SINK,
    window: Annotated[int, _OPT(help="MagicDec window (tokens).")] = defaults.WINDOW,
    nested: Annotated[bool, _OPT("--nested", help="Same windows for every L: a shorter context is the end of the "
                                                  "longest one (paired comparison across L).")] = False,
    nested_length: Annotated[Optional[int], _OPT(help="With --nested: cut the windows for this L [default: the "
                                                      "largest -L], to reuse another run's contexts.")] = None,
    out: Annotated[Optional[Path], _OPT(help="Write the JSON object here (atomically).")] = None,
    fmt: Annotated[Literal["table", "json", "markdown"], _OPT("--format", help="Rich table, the JSON object or a "
                                                                             "Markdown table on stdout.")]
    = "table",
    show: Annotated[list[Path], _OPT(metavar="FILE", help="Measure nothing: print (and with --out merge) the rows "
                                                          "of earlier --out files; repeatable.")] = [],
    threads: Annotated[Optional[int], _OPT(help="CPU threads for torch (1 is fastest on a busy machine).")]
    = None,
    no_progress: Annotated[bool, _OPT("--no-progress", help="No progress bars or log lines.")] = False,
) -> None:
    """τ (tokens per round) with a 95 % CI on held-out text: several drafts, L and temperatures in one run."""
    from spire.commands.tau import merge_files, print_table, table_markdown, unlike_settings, write_json

    if out is not None:
        check_output_path(out, "--out")
    if show:
        result = merge_files(show)
        unlike = unlike_settings(result["rows"])
        if unlike:
            typer.echo(f"warning: the rows were measured with different settings ({unlike}): compare τ only "
                       "between rows measured alike (the JSON's merged_from keeps each file's settings)", err=True)
        if out is not None:
            typer.echo(f"wrote {write_json(out, result)}", err=True)
    else:
        result = _measure_tau(draft, draft_path, spire_draft, vanilla_draft, L, G, k, temperature, n_contexts,
                              batch_size, max_batch_tokens, seed, target, sink, window, nested, nested_length,
                              threads, no_progress, out)
    if fmt == "json":
        typer.echo(json.dumps(result))
    elif fmt == "markdown":
        typer.echo(table_markdown(result["rows"]))
    else:
        print_table(result)


def _measure_tau(draft, draft_path, spire_draft, vanilla_draft, L, G, k, temperature, n_contexts, batch_size,
                 max_batch_tokens, seed, target, sink, window, nested, nested_length, threads, no_progress,
                 out) -> dict:
    from spire.commands.tau import TauArgs, parse_drafts, run_tau, validate

    temps: list[float] = []
    for value in temperature or ["0,1"]:
        for item in value.split(","):
            try:
                temps.append(float(item))
            except ValueError:
                raise ConfigError(f"--temperature: {item.strip()!r} is not a number") from None
    args = TauArgs(drafts=parse_drafts(draft, draft_path, spire_draft, vanilla_draft), Ls=_ints("-L", L), G=G,
                   k=k, temperatures=temps, n_contexts=n_contexts, batch_size=batch_size,
                   max_batch_tokens=max_batch_tokens, seed=seed, target=target, sink=sink, window=window,
                   nested=nested, nested_length=nested_length, threads=threads)
    validate(args)
    result = run_tau(args, progress=not no_progress, log=None if no_progress else lambda m: typer.echo(m, err=True),
                     out=out)
    if out is not None:
        typer.echo(f"wrote {out}", err=True)
    return result


TRAIN_FIELDS = {"budget": "budget_s", "max_steps": "max_steps", "batch_size": "batch_size", "seq_len": "seq_len",
                "k": "k", "lr": "lr", "warmup_steps": "warmup_steps", "weight_decay": "weight_decay", "loss": "loss",
                "omega": "omega", "grad_clip": "grad_clip", "bf16": "bf16", "seed": "seed",
                "checkpoint_every": "checkpoint_every", "eval_every": "eval_every", "vanilla_layers": "vanilla_layers",
                "cache_steps": "data_steps", "target_cache": "target_cache", "hidden_loss": "hidden_weight",
                "compile_step": "compile"}
"""`spire train` option -> TrainConfig field."""
SPIRE_FIELDS = ("n_draft_layers", "init", "sink", "window", "vocab_size")
"""`spire train` options that are SpireConfig fields of the same name."""


def _given(ctx: typer.Context, names) -> dict:
    """The options among ``names`` that the user set, by name (a default is left to the library)."""
    # by name: typer's context may report a ParameterSource of another module than click's (an `is` test fails)
    return {name: ctx.params[name] for name in names
            if getattr(ctx.get_parameter_source(name), "name", None) not in ("DEFAULT", "DEFAULT_MAP")}


def _kinds(allowed: tuple[str, ...]) -> dict:
    """typer.Option arguments that restrict a draft option to the registry's kinds ``allowed`` (a usage error,
    exit 2, names them otherwise)."""
    def check(value: str | None) -> str | None:
        if value is not None and value not in allowed:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(allowed)}")
        return value
    return {"callback": check, "metavar": "[" + "|".join(allowed) + "]"}


SPIRE_SWITCHES = {"full_kv": ("window", None), "no_feedback_memory": ("feedback_memory", False),
                  "no_target_activations": ("target_activations", False), "no_self_attend": ("self_attend", False),
                  "feature_input": ("feature_input", True), "bridge": ("bridge", True)}
"""`spire train` flags that set a SpireConfig field: flag parameter -> (field, value when the flag is given)."""


@app.command()
def train(
    ctx: typer.Context,
    draft: Annotated[str, _OPT(**_kinds(registry.names(trains=True)),
                               help="SPIRe (pruned from the target), EAGLE-3 (one layer over three target layers) "
                                    "or the vanilla baseline (small, random init, full KV).")] = "spire",
    target: Annotated[str, _OPT(help="Target: smollm2-135m, a .gguf file or an HF Llama-family folder.")]
    = "smollm2-135m",
    data: Annotated[list[str], _OPT(metavar="registry|PATH", help="Text: 'registry' (the registry texts of "
                                                                   "`spire data`) or text files / folders; "
                                                                   "repeatable.")] = ["registry"],
    out: Annotated[Optional[Path], _OPT(help="Run folder [default: spire-runs/<draft>[-<ablation>]].")] = None,
    resume: Annotated[bool, _OPT("--resume", help="Continue the run in --out exactly where it stopped, with its "
                                                  "saved settings (only --budget, --max-steps, --checkpoint-every, "
                                                  "--eval-every, --eval-windows and --compile apply).")] = False,
    ablation: Annotated[str, _OPT(help="Paper Figure 5 ablation: none, no-feedback, no-feedback-no-target, omega1, "
                                       "hard-loss, random-init, full-kv.")] = "none",
    budget: Annotated[Optional[float], _OPT(help=f"Training seconds (evaluation excluded) "
                                                 f"[{defaults.TRAIN_BUDGET_S:g}].")] = None,
    max_steps: Annotated[Optional[int], _OPT(help="Stop after this many steps (the cosine schedule then runs over "
                                                  "steps: resumed runs are exact).")] = None,
    batch_size: Annotated[int, _OPT(help="Global batch: rows per step (split over torchrun processes).")]
    = defaults.BATCH_SIZE,
    seq_len: Annotated[int, _OPT(help="Tokens per row (a multiple of k).")] = defaults.SEQ_LEN,
    k: Annotated[int, _OPT("--k", "-k", help="Speculation depth the draft is trained for.")] = defaults.K,
    lr: Annotated[float, _OPT(help="AdamW peak learning rate (warmup, then cosine to 10 %).")] = defaults.LR,
    warmup_steps: Annotated[int, _OPT(help="Linear warmup steps.")] = defaults.WARMUP_STEPS,
    weight_decay: Annotated[float, _OPT(help="AdamW weight decay.")] = defaults.WEIGHT_DECAY,
    loss: Annotated[Optional[str], _OPT(help="mixed (MixedLoss(omega)), hard (HardTargetLoss) or kl (speculators' "
                                             "KL over the draft vocabulary) [default: mixed for spire, hard for "
                                             "vanilla, kl for eagle3].")] = None,
    omega: Annotated[Optional[float], _OPT(help=f"MixedLoss weight of distillation (1 = pure distillation) "
                                                f"[default: {defaults.OMEGA}].")] = None,
    grad_clip: Annotated[float, _OPT(help="Gradient-norm clip.")] = defaults.GRAD_CLIP,
    bf16: Annotated[Optional[bool], _OPT("--bf16/--no-bf16", help="bf16 autocast [default: where it is fast].")]
    = None,
    compile_step: Annotated[Optional[bool], _OPT("--compile/--no-compile", help="The draft's training forward and "
                                                 "backward through torch.compile: the same computation, fused "
                                                 "(compiling takes minutes the first time on a machine) [off; a "
                                                 "resumed run: its own].")]
    = None,
    seed: Annotated[int, _OPT(help="Seed of batches and initialization.")] = defaults.SEED,
    checkpoint_every: Annotated[float, _OPT(help="Seconds between checkpoints.")] = defaults.CHECKPOINT_EVERY_S,
    eval_every: Annotated[int, _OPT(help="Steps between held-out evaluations (0: at the end).")]
    = defaults.EVAL_EVERY,
    eval_windows: Annotated[Optional[int], _OPT(help="Held-out windows per evaluation [16; a resumed run: its "
                                                    "own].")] = None,
    n_draft_layers: Annotated[Optional[int], _OPT(help=f"SPIRe: target layers pruned into the draft "
                                                       f"[{defaults.N_DRAFT_LAYERS}].")] = None,
    layers: Annotated[Optional[str], _OPT(metavar="J,J,...", help="SPIRe: which target layers [the last N].")]
    = None,
    init: Annotated[Optional[str], _OPT(help="SPIRe: pruned or random.")] = None,
    sink: Annotated[Optional[int], _OPT(help=f"SPIRe: sink tokens [{defaults.SINK}].")] = None,
    window: Annotated[Optional[int], _OPT(help=f"SPIRe: window tokens [{defaults.WINDOW}].")] = None,
    full_kv: Annotated[bool, _OPT("--full-kv", help="SPIRe: full KV cache instead of sink + window.")] = False,
    no_feedback_memory: Annotated[bool, _OPT("--no-feedback-memory", help="SPIRe: no feedback memory.")] = False,
    no_target_activations: Annotated[bool, _OPT("--no-target-activations", help="SPIRe: the draft reads its own "
                                                "activations (needs --no-feedback-memory).")] = False,
    no_self_attend: Annotated[bool, _OPT("--no-self-attend", help="SPIRe: a drafted token does not read its "
                                                                  "own layer input.")] = False,
    feature_input: Annotated[bool, _OPT("--feature-input", help="SPIRe, beyond the paper: a drafted token's "
                                        "input adds a learned projection of the previous position's feature "
                                        "(EAGLE-style).")] = False,
    bridge: Annotated[bool, _OPT("--bridge", help="SPIRe, beyond the paper: an affine map, fitted to the target "
                                 "before training, where the draft's shallow layers meet its deep ones.")] = False,
    hidden_loss: Annotated[Optional[float], _OPT(metavar="W", help="SPIRe, beyond the paper: add W x the "
                                                 "mismatch between the draft's residual stream entering each draft "
                                                 "layer and the target's entering its source layer, at drafted "
                                                 "positions [0: the paper's loss].")] = None,
    vocab_size: Annotated[Optional[int], _OPT(help="SPIRe: draft vocabulary, the N most frequent tokens of the "
                                                   "training text (q = 0 elsewhere; lossless) [the target's].")]
    = None,
    cache_steps: Annotated[Optional[int], _OPT(help="Distinct batches: step s trains on batch s mod N (epochs "
                                                    "over N batches) [a fresh batch every step].")] = None,
    target_cache: Annotated[Optional[str], _OPT(metavar="float32|bfloat16|none", help="Run the target once over the "
                                                "--cache-steps batches, store its outputs on disk and train from "
                                                "them (float32: exact; bfloat16: half the bytes) [live].")] = None,
    vanilla_layers: Annotated[Optional[int], _OPT(help="Vanilla: blocks [target layers / 8].")] = None,
    eagle3_layers: Annotated[Optional[str], _OPT(metavar="J,J,J", help="EAGLE-3: the three target layers whose "
                                                 "entering residual streams it fuses [2, n/2, n-3].")] = None,
    eagle3_vocab: Annotated[Optional[int], _OPT(help="EAGLE-3: draft vocabulary size (d2t); 0: the target's [16384].")] = None,
    device: Annotated[str, _OPT(help="auto, cpu or cuda.")] = "auto",
) -> None:
    """Train a draft (SPIRe, EAGLE-3 or vanilla) against the target; resumable; data parallel under torchrun."""
    from spire.commands.train import TrainRunArgs, run, summary_line

    spire_kw = {name: value for name, value in _given(ctx, SPIRE_FIELDS).items() if value is not None}
    if layers is not None:
        spire_kw["layers"] = tuple(_ints("--layers", [layers]))
    spire_kw.update(setting for flag, setting in SPIRE_SWITCHES.items() if ctx.params.get(flag))
    train_kw = {TRAIN_FIELDS[name]: value for name, value in _given(ctx, TRAIN_FIELDS).items() if value is not None}
    if train_kw.get("target_cache") == "none":  # as in `spire reproduce`: the live target (the default)
        train_kw["target_cache"] = None
    eagle3_kw = {} if eagle3_layers is None else {"layers": tuple(_ints("--eagle3-layers", [eagle3_layers]))}
    eagle3_kw.update({} if eagle3_vocab is None else {"draft_vocab": eagle3_vocab})
    args = TrainRunArgs(draft=draft, target=target, data=data, out=out, ablation=ablation, resume=resume,
                        device=device, eval_windows=eval_windows, spire_overrides=spire_kw, train_overrides=train_kw,
                        eagle3_overrides=eagle3_kw,
                        given=tuple(_given(ctx, ("draft", "ablation"))))
    summary = run(args, log=lambda m: typer.echo(m, err=True))
    if summary.get("rank", 0) == 0:
        typer.echo(summary_line(summary))


REPRODUCE_OPTIONS = ("budget", "n_contexts", "L", "G", "vanilla_budget", "ablation_budget", "tau_L_contexts", "steps",
                     "vanilla_steps", "ablation_steps", "first_layers", "cache_steps", "preset", "target", "out", "k",
                     "n_draft_layers", "seed", "train_processes", "hidden_loss", "compile_step", "bridge", "eagle3",
                     "eagle3_budget", "eagle3_steps", "tau_k_contexts")
"""`spire reproduce` options passed to ReproduceConfig as given (budget -> budget_s, and the other budgets alike)."""


@app.command()
def reproduce(
    ctx: typer.Context,
    preset: Annotated[str, typer.Option(help="Target preset (the embedded default: smollm2-135m).")] = "smollm2-135m",
    target: Annotated[Optional[str], typer.Option(help="A .gguf file or HF Llama-family folder to use instead "
                                                      "of the preset's checkpoint.")] = None,
    out: Annotated[Path, typer.Option(help="Output folder for REPORT.md, results.json and PNGs.")] = Path("spire-out"),
    quick: Annotated[bool, typer.Option("--quick", help="Smoke-test settings: about 5 minutes on 2 cores.")] = False,
    budget: Annotated[Optional[float], typer.Option(help="SPIRe training budget in seconds [600].")] = None,
    vanilla_budget: Annotated[Optional[float], typer.Option(help="Vanilla draft training seconds, at most [1100].")] = None,
    ablations: Annotated[Optional[str], typer.Option(metavar="NAME[,NAME...]|all", help="Figure 5 ablations to "
                                                     "train and measure: none (full SPIRe at the ablation budget), "
                                                     "no-feedback, no-feedback-no-target, omega1, hard-loss, "
                                                     "random-init, full-kv, or all.")] = None,
    ablation_budget: Annotated[Optional[float], typer.Option(help="Training seconds per ablation [300].")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Train SPIRe for this many steps instead of --budget.")] = None,
    vanilla_steps: Annotated[Optional[int], typer.Option(help="Vanilla: steps instead of seconds.")] = None,
    ablation_steps: Annotated[Optional[int], typer.Option(help="Ablations: steps instead of seconds (equal "
                                                                "training for every variant).")] = None,
    tau_L: Annotated[Optional[str], typer.Option("--tau-L", metavar="L[,L...]", help="Context lengths of the τ-vs-L "
                                                 "sweep [256,512,1024,4096].")] = None,
    tau_L_contexts: Annotated[Optional[int], typer.Option(help="Contexts per L in the sweep [8].")] = None,
    tau_k: Annotated[Optional[str], typer.Option("--tau-k", metavar="K[,K...]", help="k of the τ-vs-k sweep (greedy, "
                                                 "at -L; 0 skips it) [1,2,4,8].")] = None,
    tau_k_contexts: Annotated[Optional[int], typer.Option(help="Contexts per k in the sweep [8].")] = None,
    eagle3: Annotated[Optional[bool], typer.Option("--eagle3/--no-eagle3", help="Train and measure an EAGLE-3 "
                                                   "draft beside SPIRe [on].")] = None,
    eagle3_budget: Annotated[Optional[float], typer.Option(help="EAGLE-3 training seconds [SPIRe's --budget].")]
    = None,
    eagle3_steps: Annotated[Optional[int], typer.Option(help="EAGLE-3: steps instead of seconds [SPIRe's --steps]."
                                                        )] = None,
    n_contexts: Annotated[Optional[int], typer.Option(help="Held-out contexts per τ measurement [48].")] = None,
    L: Annotated[Optional[int], typer.Option("-L", "--context", help="Context length for τ (tokens) [512].")] = None,
    G: Annotated[Optional[int], typer.Option("-G", "--generate", help="Tokens generated per context [64].")] = None,
    k: Annotated[int, typer.Option("--k", "-k", help="Draft tokens per round.")] = defaults.K,
    n_draft_layers: Annotated[int, typer.Option(help="Target layers pruned into the SPIRe draft.")]
    = defaults.N_DRAFT_LAYERS,
    first_layers: Annotated[Optional[int], typer.Option(help="Of those, how many come from the bottom of the target "
                                                        "(beyond the paper; 0 = the paper's last layers) [2].")] = None,
    draft_vocab: Annotated[Optional[int], typer.Option(help="SPIRe head over the N most frequent training tokens "
                                                       "(beyond the paper; lossless; 0 = the whole vocabulary) "
                                                       "[16384].")] = None,
    cache_steps: Annotated[Optional[int], typer.Option(help="Batches of the target cache that SPIRe and EAGLE-3 "
                                                       "train epochs over [500].")] = None,
    target_cache: Annotated[Optional[str], typer.Option(metavar="bfloat16|float32|none", help="Storage of the "
                                                        "target cache; none runs the target live on fresh batches "
                                                        "[bfloat16].")] = None,
    train_processes: Annotated[Optional[int], typer.Option(help="SPIRe's data-parallel training processes (each "
                                                           "1 thread on a CPU) [one per torch thread on a CPU].")]
    = None,
    hidden_loss: Annotated[Optional[float], typer.Option(metavar="W", help="SPIRe's loss adds W x the mismatch "
                                                         "of drafted positions' residual streams with the "
                                                         "target's (beyond the paper; 0 = the paper's loss) "
                                                         "[0].")] = None,
    bridge: Annotated[Optional[bool], typer.Option("--bridge/--no-bridge", help="SPIRe's residual stream passes "
                                                   "an affine map, fitted to the target's by least squares, where "
                                                   "its shallow layers meet its deep ones (beyond the paper; "
                                                   "--no-bridge: the paper's draft) [off].")] = None,
    compile_step: Annotated[Optional[bool], typer.Option("--compile/--no-compile", help="Every draft's training "
                                                         "step through torch.compile (the same computation, "
                                                         "fused; minutes of compiling the first time on a "
                                                         "machine, outside the training budgets) [on; off with "
                                                         "--quick].")] = None,
    seed: Annotated[int, typer.Option(help="Seed for data windows, training and sampling.")] = 0,
) -> None:
    """The main job: data, SPIRe + EAGLE-3 + vanilla (+ ablation) training, τ of every draft kind, cost model,
    REPORT.md."""
    from spire.pipeline import ReproduceConfig, reproduce as run

    from spire.training.distill import ABLATIONS

    fields = {"budget": "budget_s", "vanilla_budget": "vanilla_budget_s", "ablation_budget": "ablation_budget_s",
              "hidden_loss": "hidden_weight", "compile_step": "compile", "eagle3_budget": "eagle3_budget_s"}
    overrides = {fields.get(name, name): value for name, value in _given(ctx, REPRODUCE_OPTIONS).items()
                 if value is not None}
    if ablations is not None:
        names = [a.strip() for a in ablations.split(",") if a.strip()]
        overrides["ablations"] = tuple(ABLATIONS) if names == ["all"] else tuple(names)
    if tau_L is not None:
        overrides["tau_Ls"] = tuple(_ints("--tau-L", [tau_L]))
    if tau_k is not None:
        overrides["tau_ks"] = () if tau_k.strip() == "0" else tuple(_ints("--tau-k", [tau_k]))
    if draft_vocab is not None:
        overrides["draft_vocab"] = draft_vocab or None
    if target_cache is not None:
        if target_cache not in ("bfloat16", "float32", "none"):
            raise ConfigError(f"--target-cache must be bfloat16, float32 or none, got {target_cache!r}")
        overrides["target_cache"] = None if target_cache == "none" else target_cache
    cfg = ReproduceConfig.quick_config(**overrides) if quick else ReproduceConfig(**overrides)
    check_output_path(cfg.out, "--out", folder=True)
    try:
        run(cfg, log=lambda msg: typer.echo(msg, err=True))
    except KeyboardInterrupt:
        typer.echo("interrupted: the same command goes on where this one stopped (finished drafts and τ "
                   "measurements are reused from the cache; an unfinished training resumes from its last checkpoint)",
                   err=True)
        raise
    typer.echo(f"wrote {out / 'REPORT.md'}, {out / 'results.json'} and figures")


@app.command()
def data(
    target: Annotated[str, typer.Option(help="Checkpoint whose tokenizer is used (preset, .gguf or HF folder).")]
    = "smollm2-135m",
    heldout_fraction: Annotated[float, typer.Option(help="Fraction of documents held out per source.")] = 0.1,
    seed: Annotated[int, typer.Option(help="Seed of the document split.")] = 0,
) -> None:
    """Prepare token windows from registry texts, held out by document (cached)."""
    from spire.data import data_summary_table, document_separator_id, prepare_data
    from spire.loading import load_target

    if not 0 < heldout_fraction < 1:
        raise ConfigError(f"--heldout-fraction must be in (0, 1), got {heldout_fraction}")
    _, tokenizer, _ = load_target(target)
    td = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), heldout_fraction=heldout_fraction,
                      seed=seed)
    typer.echo(data_summary_table(td))


def _stdin_lines() -> list[str]:
    """The non-empty lines of standard input: one prompt each."""
    return [line for line in sys.stdin.read().splitlines() if line.strip()]


def _prompts(args: list[str], file: Path | None) -> list[str]:
    """The prompts of `spire generate`: the arguments (``-`` stands for the lines of standard input), then the
    lines of ``file``; with neither, piped standard input. Raises ConfigError (none, an empty one, an unreadable
    file)."""
    texts = [t for arg in args for t in (_stdin_lines() if arg == "-" else [arg])]
    if file is not None:
        try:
            texts += [line for line in file.read_text().splitlines() if line.strip()]
        except OSError as e:
            raise ConfigError(f"cannot read prompts from {file}: {e.strerror}") from None
    if not args and not texts and not sys.stdin.isatty():
        texts = _stdin_lines()
    if not texts:
        raise ConfigError("no prompt given (pass prompts as arguments, --file, or on stdin)")
    if any(not t.strip() for t in texts):
        raise ConfigError("empty prompt")
    return texts


def _warn_unused_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """One warning line on stderr when --top-k / --top-p are set but do nothing (greedy decoding at T = 0)."""
    unused = [flag for flag, on in (("--top-k", top_k != 0), ("--top-p", top_p != 1.0)) if on]
    if temperature == 0 and unused:
        typer.echo(f"warning: {' and '.join(unused)} {'does' if len(unused) == 1 else 'do'} nothing at "
                   "--temperature 0 (greedy decoding)", err=True)


@app.command()
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompts; - reads prompts from standard input (one "
                                                               "per line); or use --file, or pipe them on stdin.")]
    = None,
    file: Annotated[Optional[Path], typer.Option(help="A text file with one prompt per line.")] = None,
    target: Annotated[str, typer.Option(help="Target: smollm2-135m, a .gguf file or an HF folder.")] = "smollm2-135m",
    draft: Annotated[str, typer.Option(**_kinds(registry.names()), help="Draft model.")] = registry.DEFAULT,
    draft_path: Annotated[Optional[str], typer.Option(help="SPIRe or EAGLE-3 draft: .safetensors, run folder or "
                                                           "exported folder; or vanilla draft model.")]
    = None,
    k: Annotated[int, typer.Option("--k", "-k", help="Draft tokens per round.")] = defaults.K,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt at most.")] = 128,
    stop: Annotated[list[str], typer.Option(help="Stop string; repeatable.")] = [],
    seed: Annotated[int, typer.Option(help="Seed for sampling.")] = 0,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt in the model's chat template.")] = False,
    window: Annotated[int, typer.Option(help="MagicDec window (tokens).")] = defaults.WINDOW,
    ngram_min: Annotated[Optional[int], typer.Option(help="n-gram draft: shortest suffix matched [vLLM's 5, or "
                                                          "--ngram-max].")] = None,
    ngram_max: Annotated[Optional[int], typer.Option(help="n-gram draft: longest suffix matched [vLLM's 5, or "
                                                          "--ngram-min].")] = None,
    fmt: Annotated[Literal["text", "json"], typer.Option("--format", help="Plain text or one JSON object.")]
    = "text",
    weights: Annotated[Literal["fp32", "float32", "bf16"], typer.Option(
        help="bf16: weight-only bf16 on the CPU (target and draft weights rounded to bf16 and streamed at half the "
             "bytes; float32 arithmetic; the draft's: see --draft-weights). A slightly different model: compare "
             "with --weights bf16 --draft none.")]
    = "fp32",
    draft_weights: Annotated[Optional[Literal["fp32", "float32", "bf16", "int8"]], typer.Option(
        help="A trained draft's own weights (SPIRe, vanilla, EAGLE-3) (default: as --weights). bf16 (int8) beside a float32 "
             "target: the draft streams half (about a quarter of) the bytes and the output stays the float32 "
             "target's (SD is lossless whatever the draft computes).")] = None,
) -> None:
    """Generate with speculative decoding (lossless: greedy output equals --draft none)."""
    import torch

    from spire.drafts import make_draft
    from spire.loading import load_target
    from spire.sampling import SamplingParams
    from spire.speculative import StopStrings, generate as run

    params = SamplingParams(temperature, top_k, top_p)
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    _warn_unused_sampling(temperature, top_k, top_p)
    texts = _prompts(prompts or [], file)
    if window < 1:
        raise ConfigError(f"--window must be >= 1, got {window}")
    options = {}
    if ngram_min is not None or ngram_max is not None:
        if draft != "ngram":
            raise ConfigError(f"--ngram-min / --ngram-max are for --draft ngram, not {draft}")
        from spire.drafts.ngram import NgramConfig

        try:
            NgramConfig(ngram_min, ngram_max)
        except ConfigError as e:  # the same rule, named by the flags that set it
            raise ConfigError(f"--ngram-min / --ngram-max: {e}") from None
        options = {"n_min": ngram_min, "n_max": ngram_max}
    if window != defaults.WINDOW and draft != "magicdec":
        typer.echo(f"note: --window sets MagicDec's window; ignored for --draft {draft}", err=True)
    model, tokenizer, _ = load_target(target, progress=False)
    if chat:
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for t in texts]
    else:
        ids = [tokenizer(t).input_ids for t in texts]
    ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    d = make_draft(draft, model, tokenizer, draft_path, window=window, **options)
    own_model = getattr(d, "model", None)  # a draft with weights of its own (SPIRe, vanilla)
    if draft_weights is not None and own_model is None:
        typer.echo(f"note: --draft-weights ignored: the {draft} draft has no weights of its own", err=True)
    own_fmt = (draft_weights or weights) if own_model is not None else None
    own = [own_model] if own_fmt == "bf16" else []
    if weights == "bf16" or own:
        from spire.model import use_bf16_weights

        use_bf16_weights(*([model] if weights == "bf16" else []), *own)
    if own_fmt == "int8":
        from spire.model import use_int8_weights

        use_int8_weights(own_model)
    eos = set(model.cfg.eos_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    stopper = StopStrings(stop, tokenizer.decode) if stop else None
    res = run(model, ids, max_new_tokens, draft=d, k=k, params=params,
              generator=torch.Generator().manual_seed(seed), eos_ids=sorted(eos), stop=stopper)
    outputs = []
    for b in range(len(ids)):
        text = tokenizer.decode(res.tokens[b], skip_special_tokens=True)
        outputs.append({"text": stopper.trim(text) if stopper else text, "token_ids": res.tokens[b],
                        "finish_reason": res.finish_reasons[b], "tau": res.row_tau(b)})
    if fmt == "json":
        typer.echo(json.dumps({"outputs": outputs, "tau": res.tau, "draft": draft, "k": k}))
    else:
        for i, o in enumerate(outputs):
            if i:  # several prompts: a blank line between outputs (use --format json to parse them)
                typer.echo("")
            typer.echo(o["text"])
        typer.echo(f"[draft {draft}, k={k}: tau {res.tau:.2f}]", err=True)


@app.command()
def export(
    out: Annotated[Path, typer.Option(help="Folder to write (replaced): config.json + model.safetensors.")],
    draft_path: Annotated[str, typer.Option(help="The trained draft: a `spire train` run folder (any kind), a "
                                                 "SPIRe .safetensors, or a vanilla draft folder.")],
    draft: Annotated[str, typer.Option(**_kinds(registry.names(trains=True)), help="Draft kind.")]
    = "spire",
    target: Annotated[str, typer.Option(help="The draft's target (verifier): smollm2-135m, a .gguf file or an HF "
                                             "folder.")] = "smollm2-135m",
    k: Annotated[int, typer.Option("--k", "-k", help="Speculative tokens per round recorded for serving.")]
    = defaults.K,
) -> None:
    """Write a trained draft as a folder serving engines can read (speculators-style config.json with
    speculators_config, and model.safetensors; docs/serving.md). spire reads it back with --draft-path FOLDER."""
    from spire.export import export_draft
    from spire.loading import load_model, resolve_checkpoint

    check_output_path(out, "--out", folder=True)

    folder = resolve_checkpoint(target, progress=False)
    model = load_model(folder)
    # the verifier as engines load it: the checkpoint folder a preset resolves to (HF hub ids are not
    # reachable offline), else the folder or .gguf file given, as an absolute path
    export_draft(draft, draft_path, model, str(Path(folder).resolve()), out, k)
    typer.echo(str(out))


@app.command()
def compare(
    prompts: Annotated[list[str], typer.Argument(help="Prompts.")],
    target: Annotated[str, typer.Option(help="Target: smollm2-135m, a .gguf file or an HF folder.")] = "smollm2-135m",
    draft: Annotated[str, typer.Option(**_kinds(registry.names(drafts_only=True)),
                                       help="Draft model.")] = registry.DEFAULT,
    draft_path: Annotated[Optional[str], typer.Option(help="SPIRe or EAGLE-3 draft: .safetensors, run folder or "
                                                           "exported folder; or vanilla draft model.")]
    = None,
    dtype: Annotated[Literal["float32", "bfloat16"], typer.Option(help="Weights and activations.")] = "bfloat16",
    k: Annotated[int, typer.Option("--k", "-k", help="Draft tokens per round.")] = defaults.K,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per prompt.")] = 64,
) -> None:
    """Greedy SD vs greedy AD: identical, or the first divergence and the target's top-2 logit gap there."""
    import torch

    from spire.drafts import make_draft
    from spire.evaluation.compare import compare_greedy
    from spire.loading import load_target

    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    model, tokenizer, _ = load_target(target, dtype=getattr(torch, dtype), progress=False)
    d = make_draft(draft, model, tokenizer, draft_path)
    ids = [tokenizer(p).input_ids for p in prompts]
    if any(not x for x in ids):
        raise ConfigError("empty prompt")
    for r in compare_greedy(model, d, ids, max_new_tokens, k):
        if r.identical:
            typer.echo(f"prompt {r.row}: identical to AD ({dtype})")
        else:
            typer.echo(f"prompt {r.row}: first divergence at generated token {r.index}; "
                       f"target top-2 logit gap there {r.top2_gap:.4f} ({dtype})")


# ------------------------------------------------------------------------------------------- spire bench
bench_app = typer.Typer(
    help="Measured SD vs AD throughput on this machine against the cost model; `spire bench calibrate` "
         "measures the roofline.",
    invoke_without_command=True,
    no_args_is_help=False,
    rich_markup_mode=None,
)
app.add_typer(bench_app, name="bench")


@bench_app.callback()
def bench(
    ctx: typer.Context,
    B: Annotated[list[str], _OPT("-B", "--batch", metavar="INT[,INT...]", help="Batch sizes (default: 1,4,16). "
                                 + GRID_HELP)] = [],
    L: Annotated[list[str], _OPT("-L", "--context", metavar="INT[,INT...]", help="Context lengths (default: "
                                 "512,2048,4096).")] = [],
    k: Annotated[int, _OPT("--k", "-k", help="Draft tokens per round.")] = defaults.K,
    G: Annotated[Optional[int], _OPT("-G", "--generate", help="Tokens generated per row in the τ / tokens/s runs "
                                                             "(default: 32).")] = None,
    reps: Annotated[Optional[int], _OPT(help="Timed forwards per t_* (median) (default: 5).")] = None,
    contexts: Annotated[int, _OPT(help="Groups of B held-out contexts the AD and SD runs go over; τ and tokens/s "
                                       "are totals over them (at B = 1 one context's τ says little).")] = 1,
    target: Annotated[str, _OPT(help="Target: smollm2-135m, a .gguf file or an HF folder.")] = "smollm2-135m",
    dtype: Annotated[Literal["fp32", "bf16", "fp16"], _OPT(help="Weights, activations and KV cache.")] = "fp32",
    weights: Annotated[Literal["fp32", "bf16"], _OPT(help="bf16: weight-only bf16 on the CPU (fp32 dtype): weights "
                                                     "rounded and streamed at 2 bytes, predicted with 2 bytes per "
                                                     "weight value.")] = "fp32",
    draft_weights: Annotated[Optional[Literal["fp32", "bf16", "int8"]], _OPT(
        help="A trained draft's own weights (SPIRe, vanilla, EAGLE-3) (default: as --weights). bf16 beside a float32 target: the "
             "draft streams half the bytes, the target stays exact (q is whatever the draft computes, so SD stays "
             "lossless); int8: group-wise int8 (a scale per 64 inputs), 1.06 bytes per value; MagicDec's draft is "
             "the target's weights.")] = None,
    device: Annotated[str, _OPT(help="auto (cuda when present), cpu, cuda, cuda:N.")] = "auto",
    threads: Annotated[Optional[int], _OPT(help="torch intra-op threads (default: torch's).")] = None,
    spire_draft: Annotated[Optional[str], _OPT(help="SPIRe draft .safetensors (default: the newest trained one in "
                                                    "the cache, skipped if none).")] = None,
    no_spire: Annotated[bool, _OPT("--no-spire", help="Skip the SPIRe draft.")] = False,
    vanilla_draft: Annotated[Optional[str], _OPT(help="Vanilla draft: HF folder (config.json, model.safetensors, "
                                                      "tokenizer) [skipped when not given].")] = None,
    eagle3_draft: Annotated[Optional[str], _OPT(help="EAGLE-3 draft: a `spire train --draft eagle3` run or a "
                                                     "speculators folder [skipped when not given].")] = None,
    no_ngram: Annotated[bool, _OPT("--no-ngram", help="Skip the n-gram draft (measured by default: no weights, "
                                                      "its draft step is the lookup).")] = False,
    sink: Annotated[int, _OPT(help="MagicDec sink tokens.")] = defaults.SINK,
    window: Annotated[int, _OPT(help="MagicDec window (tokens).")] = defaults.WINDOW,
    calibration: Annotated[Optional[Path], _OPT(help="Calibration JSON (default: this device's cached one, else "
                                                     "measured now).")] = None,
    out: Annotated[Path, _OPT(help="Folder for bench.json and BENCH.md.")] = Path("spire-bench"),
    quick: Annotated[bool, _OPT("--quick", help="Smoke-test grid: B 1,2; L 64,128; G 8; 2 reps.")] = False,
    random_weights: Annotated[bool, _OPT("--random-weights", help="A random SmolLM2-shaped target and random "
                                                                  "contexts: timings only, where the weights are "
                                                                  "absent (e.g. a GPU box).")] = False,
    seed: Annotated[int, _OPT(help="Seed of the held-out windows.")] = 0,
    combine: Annotated[Literal["max", "sum"], _OPT(help="Cost model: overlap compute and memory (max) or not.")]
    = "max",
    clock: Annotated[Literal["wall", "cpu"], _OPT(help="Time forwards by wall clock, or by process CPU time "
                                                       "(single-threaded CPU runs on a shared machine).")]
    = "wall",
    fmt: Annotated[Literal["table", "json"], _OPT("--format", help="Rich table or the JSON object on stdout.")]
    = "table",
) -> None:
    """Measure t_AD, t_verify, t_draft, Δt, τ and SD/AD tokens/s over a (B, L) grid on held-out contexts, beside
    the cost model's prediction; writes bench.json and BENCH.md."""
    if ctx.invoked_subcommand is not None:
        return
    from spire.commands.bench import BenchArgs, run
    from spire.bench.report import print_table, write_outputs

    check_output_path(out, "--out", folder=True)
    args = BenchArgs(Bs=_ints("-B", B) or None, Ls=_ints("-L", L) or None, k=k, G=G, reps=reps, contexts=contexts,
                     target=target,
                     dtype=dtype, weights=weights, draft_weights=draft_weights, device=device, threads=threads,
                     spire_draft=spire_draft, no_spire=no_spire,
                     vanilla_draft=vanilla_draft, eagle3_draft=eagle3_draft, no_ngram=no_ngram, sink=sink, window=window,
                     calibration=calibration, out=out,
                     quick=quick, random_weights=random_weights, seed=seed, combine=combine, clock=clock)
    result, summary = run(args, log=lambda msg: typer.echo(msg, err=True))
    j, m = write_outputs(result, summary, out)
    if fmt == "json":
        typer.echo(json.dumps({**result, "summary": summary}))
    else:
        dw = result.get("draft_weights", weights)
        draft_note = "" if dw == weights else f" ({dw} draft weights)"
        print_table(result, title=f"spire bench: {target}, {dtype}"
                                  + (" (bf16 weights)" if weights == "bf16" else "") + draft_note
                                  + f", {result['device']}")
    typer.echo(f"wrote {j} and {m}", err=True)


@bench_app.command("calibrate")
def bench_calibrate(
    dtype: Annotated[list[str], _OPT(metavar="DTYPE[,DTYPE...]", help="fp32, bf16, fp16 (default: fp32,bf16).")]
    = [],
    device: Annotated[str, _OPT(help="auto (cuda when present), cpu, cuda, cuda:N.")] = "auto",
    threads: Annotated[Optional[int], _OPT(help="torch intra-op threads (default: torch's).")] = None,
    quick: Annotated[bool, _OPT("--quick", help="Tiny sizes (seconds; cache-resident numbers, for tests).")] = False,
    buffer_mb: Annotated[Optional[float], _OPT(help="Bandwidth buffer in MiB (default: 256 CPU, 1024 GPU).")]
    = None,
    out: Annotated[Optional[Path], _OPT(help="Also write the JSON here.")] = None,
    no_save: Annotated[bool, _OPT("--no-save", help="Do not write it to the spire cache.")] = False,
    clock: Annotated[Literal["wall", "cpu"], _OPT(help="Wall clock, or process CPU time (single-threaded runs on "
                                                       "a shared machine).")] = "wall",
    fmt: Annotated[Literal["table", "json"], _OPT("--format", help="Summary lines or the JSON object.")]
    = "table",
) -> None:
    """Measure this machine's sustained matmul FLOP/s and memory bandwidth per dtype; saved for `spire bench`
    and `spire throughput --calibration FILE`."""
    from spire.bench.calibrate import calibrate
    from spire.commands.bench import set_threads

    names = [d.strip() for v in dtype for d in v.split(",") if d.strip()] or ["fp32", "bf16"]
    if buffer_mb is not None and not buffer_mb > 0:
        raise ConfigError(f"--buffer-mb must be positive, got {buffer_mb}")
    set_threads(threads)
    cal = calibrate(names, device, quick=quick, buffer_bytes=None if buffer_mb is None else int(buffer_mb * 2**20),
                    log=None if fmt == "json" else lambda msg: typer.echo(msg, err=True), clock=clock)
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
        typer.echo(f"wrote {path}", err=True)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app; a SpireError becomes one ``error:`` line on stderr, exit 2."""
    try:
        app(args=argv, prog_name="spire")
    except (SpireError, OSError) as e:  # OSError: a path the checks up front could not foresee (permissions, disk)
        message = " ".join(str(e).splitlines())
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
