"""The ``spire`` command line: the command table. One function per command, its options, and one call into
:mod:`spire.commands`, where what a command does beyond parsing its options lives.

Any :class:`spire.errors.SpireError` is printed as one line ``error: <message>`` on stderr, exit code 2.

The options of ``throughput``, ``tau``, ``train`` and ``bench`` are declared here (their modules under
:mod:`spire.commands` import torch at load); the other commands are declared, options and all, in their own
light module under :mod:`spire.commands` and registered here. Every command imports the library inside its
function, on purpose: ``spire --help`` and every command load only what they use (importing torch alone takes
seconds). Defaults shared with the library come from :mod:`spire.defaults`.
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

import spire.registry as registry
from spire import defaults
from spire.backend import Backend
from spire.commands.compare import compare
from spire.commands.data import data
from spire.commands.export import export
from spire.commands.generate import generate
from spire.commands.options import (GRID_HELP, draft_path_help, given, k_help, kinds, with_draft_options,
                                    with_train_options)
from spire.commands.reproduce import reproduce
from spire.commands.serve import serve
from spire.commands.throughput_figures import throughput_figures
from spire.commands.options import set_process_backend
from spire.errors import SpireError

app = typer.Typer(
    name="spire",
    help="Throughput-oriented speculative decoding (SPIRe, Neelam et al. 2025, arXiv 2504.06419).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts are plain: "[bfloat16]" is a default, not a rich style tag
)

GOLDEN_LS = "8,16,32,64,128,256,512,1024,2048,4096,8192"  # the L of the paper's B = 64 table
_OPT = typer.Option


@app.callback()
def _root(backend: Annotated[Optional[str], _OPT(help=(
        f"Execution choices, comma-separated: {', '.join('no-' + f.name.replace('_', '-') for f in fields(Backend))} "
        "(every fast path by default; the same results to float32 rounding). Recorded in run logs, results.json "
        "and REPORT.md."))] = None) -> None:
    """Throughput-oriented speculative decoding (SPIRe, arXiv 2504.06419)."""
    set_process_backend(backend)


def _err(message: str) -> None:
    """The commands' log: one line on stderr."""
    typer.echo(message, err=True)


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
    from spire.commands.throughput import command

    command(ctx.params, log=_err)


app.command("throughput-figures")(throughput_figures)


def _with_options(ctx: typer.Context, draft_options: dict | None) -> dict:
    """A command's options by parameter name, the kinds' own flags gathered as ``draft_options``
    (:func:`spire.commands.options.with_draft_options`)."""
    return {**{k: v for k, v in ctx.params.items() if "__" not in k}, "draft_options": draft_options or {}}


@app.command()
@with_draft_options
def tau(
    ctx: typer.Context,
    draft: Annotated[list[str], _OPT(metavar="KIND[,KIND...]", help=f"{', '.join(registry.names(drafts_only=True))}; "
                                                                    f"repeatable (default: {registry.DEFAULT}).")] = [],
    draft_path: Annotated[Optional[str], _OPT(help="The trained draft of the one --draft that trains. "
                                                   + draft_path_help())] = None,
    spire_draft: Annotated[list[str], _OPT(metavar="NAME=PATH", help="A named SPIRe draft; repeatable.")] = [],
    vanilla_draft: Annotated[list[str], _OPT(metavar="NAME=PATH", help="A named vanilla draft; repeatable.")]
    = [],
    L: Annotated[list[str], _OPT("-L", "--context", metavar="INT[,INT...]", help="Context lengths; repeat or "
                                                                               "comma-separate: -L 256,512.")]
    = ["512"],
    G: Annotated[int, _OPT("-G", "--generate", help="Tokens generated per context.")] = 64,
    k: Annotated[int, _OPT("--k", "-k", help=k_help())] = defaults.K,
    temperature: Annotated[list[str], _OPT(metavar="T[,T...]", help="Sampling temperatures (0 = greedy); "
                                                                    "repeatable (default: 0,1).")] = [],
    n_contexts: Annotated[int, _OPT(help="Held-out contexts per measurement.")] = 16,
    batch_size: Annotated[int, _OPT(help="Contexts decoded together (fewer at long L, see --max-batch-tokens).")]
    = 8,
    max_batch_tokens: Annotated[int, _OPT(help="Cap on batch × L per batch (prefill logits memory).")] = 8192,
    seed: Annotated[int, _OPT(help="Seed of the held-out windows and of sampling.")] = 0,
    target: Annotated[str, _OPT(help="Target: smollm2-135m, a .gguf file or an HF folder.")] = "smollm2-135m",
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
    diagnose: Annotated[bool, _OPT("--diagnose", help="Per drafted position: acceptance, TV to the target with "
                                                      "earlier tokens drafted / verified, mass outside the draft "
                                                      "vocabulary, entropies (docs/tau.md).")] = False,
    figure: Annotated[Optional[Path], _OPT(help="With --diagnose: the figure's PNG [--out with .png].")] = None,
    threads: Annotated[Optional[int], _OPT(help="CPU threads for torch (1 is fastest on a busy machine).")]
    = None,
    no_progress: Annotated[bool, _OPT("--no-progress", help="No progress bars or log lines.")] = False,
    draft_options: dict | None = None,
) -> None:
    """τ (tokens per round) with a 95 % CI on held-out text: several drafts, L and temperatures in one run."""
    from spire.commands.tau import command

    command(_with_options(ctx, draft_options), log=_err)


@app.command(help=f"Train a draft ({', '.join(registry.names(trains=True))}) against the target; resumable; data "
                  "parallel under torchrun.")
@with_train_options(before="device")
def train(
    ctx: typer.Context,
    draft: Annotated[str, _OPT(**kinds(registry.names(trains=True)),
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
                                             "KL over the draft vocabulary) or lk (−log acceptance, arXiv 2602.23881) [default: mixed for spire, hard for "
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
    init_from: Annotated[Optional[Path], _OPT(metavar="RUN|FILE", help="Start from a trained draft (a run folder, or "
                                              "its checkpoint's draft file) with its own settings, instead of the "
                                              "target's layers: fine-tuning on other text.")] = None,
    checkpoint_every: Annotated[float, _OPT(help="Seconds between checkpoints.")] = defaults.CHECKPOINT_EVERY_S,
    eval_every: Annotated[int, _OPT(help="Steps between held-out evaluations (0: at the end).")]
    = defaults.EVAL_EVERY,
    eval_windows: Annotated[Optional[int], _OPT(help="Held-out windows per evaluation [16; a resumed run: its "
                                                    "own].")] = None,
    hidden_loss: Annotated[Optional[float], _OPT(metavar="W", help="SPIRe, beyond the paper: add W x the "
                                                 "mismatch between the draft's residual stream entering each draft "
                                                 "layer and the target's entering its source layer, at drafted "
                                                 "positions [0: the paper's loss].")] = None,
    cache_steps: Annotated[Optional[int], _OPT(help="Distinct batches: step s trains on batch s mod N (epochs "
                                                    "over N batches) [a fresh batch every step].")] = None,
    target_cache: Annotated[Optional[str], _OPT(metavar="float32|bfloat16|none", help="Run the target once over the "
                                                "--cache-steps batches, store its outputs on disk and train from "
                                                "them (float32: exact; bfloat16: half the bytes) [live].")] = None,
    device: Annotated[str, _OPT(help="auto, cpu or cuda.")] = "auto",
    device_memory: Annotated[Optional[str], _OPT(help="Memory the run may use on the device, e.g. 24GiB: a run whose "
                                                 "memory plan exceeds it is refused before loading [cuda: the free "
                                                 "memory; cpu: no check; env SPIRE_DEVICE_MEMORY].")] = None,
) -> None:
    """Train a draft of a kind that `spire train` trains (the help names them, from the registry)."""
    from spire.commands.train import args_from_options, run, summary_line

    summary = run(args_from_options(ctx.params, given(ctx), log=_err), log=_err)
    if summary.get("rank", 0) == 0:
        typer.echo(summary_line(summary))


app.command()(reproduce)
app.command()(data)
app.command()(generate)
app.command()(export)
app.command()(compare)
app.command()(serve)


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
@with_draft_options
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
    draft_path: Annotated[list[str], _OPT(metavar="KIND=PATH", help=(
        "A trained draft to measure, repeatable: spire=PATH (default: the newest trained one in the cache, skipped "
        "if none), vanilla=HF folder, eagle3=run or speculators folder [skipped when not given]."))] = [],
    spire_draft: Annotated[Optional[str], _OPT(help="Deprecated: --draft-path spire=PATH.")] = None,
    no_spire: Annotated[bool, _OPT("--no-spire", help="Skip the SPIRe draft.")] = False,
    vanilla_draft: Annotated[Optional[str], _OPT(help="Deprecated: --draft-path vanilla=PATH.")] = None,
    eagle3_draft: Annotated[Optional[str], _OPT(help="Deprecated: --draft-path eagle3=PATH.")] = None,
    no_ngram: Annotated[bool, _OPT("--no-ngram", help="Skip the n-gram draft (measured by default: no weights, "
                                                      "its draft step is the lookup).")] = False,
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
    draft_options: dict | None = None,
) -> None:
    """Measure t_AD, t_verify, t_draft, Δt, τ and SD/AD tokens/s over a (B, L) grid on held-out contexts, beside
    the cost model's prediction; writes bench.json and BENCH.md."""
    if ctx.invoked_subcommand is not None:
        return
    from spire.commands.bench import command

    command(_with_options(ctx, draft_options), log=_err)


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
    from spire.commands.bench import calibrate_command

    calibrate_command(dtype, device, threads, quick, buffer_mb, out, no_save, clock, fmt, log=_err)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app. A SpireError, or an option value the parser refuses (not an integer, an
    unknown option), becomes one ``error:`` line on stderr, exit 2; success exits 0."""
    from typer._click.exceptions import ClickException, NoArgsIsHelpError  # typer's own click (0.29)

    try:
        rv = app(args=argv, prog_name="spire", standalone_mode=False)
    except NoArgsIsHelpError as e:  # `spire` or a group without a command: the help, as before
        e.show()
        sys.exit(e.exit_code)
    except ClickException as e:
        where = f" (see {e.ctx.command_path} --help)" if getattr(e, "ctx", None) is not None else ""
        print(f"error: {' '.join(e.format_message().splitlines())}{where}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        sys.exit(1)
    except (SpireError, OSError) as e:  # OSError: a path the checks up front could not foresee (permissions, disk)
        message = " ".join(str(e).splitlines())
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
