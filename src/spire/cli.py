"""The ``spire`` command line. One function per command; each is a thin call into the library.

Any :class:`spire.errors.SpireError` is printed as one line ``error: <message>`` on stderr, exit code 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from spire.errors import ConfigError, SpireError

app = typer.Typer(
    name="spire",
    help="Throughput-oriented speculative decoding (SPIRe, Neelam et al. 2025, arXiv 2504.06419).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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


_OPT = typer.Option


@app.command()
def throughput(
    preset: Annotated[str, _OPT(help="Model preset: paper-67m, llama3-70b (alias paper-70b) or smollm2-135m.")]
    = "paper-67m",
    B: Annotated[list[str], _OPT("-B", "--batch", metavar="INT[,INT...]", help=GRID_HELP)] = ["64"],
    L: Annotated[list[str], _OPT("-L", "--context", metavar="INT[,INT...]", help=GRID_HELP)] = [GOLDEN_LS],
    k: Annotated[int, _OPT("--k", "-k", help="Speculation depth: draft tokens per round.")] = 4,
    hoi: Annotated[Optional[float], _OPT(help="Hardware operational intensity, FLOPs per byte "
                                              "[default: 600, or the --hardware's].")] = None,
    combine: Annotated[Literal["max", "sum"], _OPT(help="Overlap compute and memory fully (max) or not at all (sum).")]
    = "max",
    tau: Annotated[list[str], _OPT(metavar="DRAFT=VALUE", help="Override τ of vanilla, magicdec or spire; repeatable.")]
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
    fmt: Annotated[Literal["table", "json", "csv"], _OPT("--format", help="Rich table, one JSON object, or CSV.")]
    = "table",
    plot: Annotated[Optional[Path], _OPT(help="Also write a PNG heatmap of the multiplier here.")] = None,
) -> None:
    """Throughput multiplier τ/Δt of vanilla SD, MagicDec and SPIRe from the paper's cost model."""
    from spire.throughput.cli_support import ThroughputArgs, build, print_table, to_csv, to_json

    args = ThroughputArgs(
        preset=preset, Bs=_ints("-B", B), Ls=_ints("-L", L), k=k, hoi=hoi, combine=combine, taus=_taus(tau),
        alphas=_floats(alpha, "--alpha"), best_k=best_k, memory_gb=memory_gb, bytes_per_value=bytes_per_value,
        dtype=dtype, kv_dtype=kv_dtype, hardware=hardware, flops=flops, bandwidth=bandwidth,
        attention_flops=attention_flops, embeddings=embeddings, draft_window=draft_window, config=config,
        vanilla_config=vanilla_config, spire_config=spire_config, spire_layers=spire_layers,
        contexts=None if contexts is None else _ints("--contexts", [contexts]), contexts_file=contexts_file,
        context_dist=context_dist, seed=seed, grow=grow, cost_analysis=cost_analysis,
    )  # fmt: skip
    summary, rows, chosen = build(args)
    if plot is not None:
        from spire.throughput.plots import plot_multiplier_heatmaps

        title = f"{chosen.name}: throughput multiplier (k={k}, HOI={summary['hoi']:g}, {combine})"
        typer.echo(f"wrote {plot_multiplier_heatmaps(rows, plot, title)}", err=True)
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
    k: Annotated[int, _OPT("--k", "-k", help="Speculation depth.")] = 4,
    hoi: Annotated[float, _OPT(help="Hardware operational intensity, FLOPs per byte.")] = 600.0,
    G: Annotated[int, _OPT("-G", help="Generated tokens for the growing-context metric.")] = 64,
) -> None:
    """Every figure of the paper's throughput analysis (Figures 1, 3, 4, 5, 6, growing context) + JSON."""
    from spire.throughput import get_preset
    from spire.throughput.figures import write_figures

    data = write_figures(out, get_preset(preset), get_preset(extrapolation), k=k, hoi=hoi, G=G)
    h = data["headline"]
    typer.echo(f"wrote {len(data['files'])} figures and figures.json to {out}")
    typer.echo(f"(B, L) = ({h['B']}, {h['L']}): SPIRe {h['multiplier']['spire']:.2f}x, "
               f"+{h['spire_gain_vs_vanilla_pct']:.1f} % vs vanilla, +{h['spire_gain_vs_magicdec_pct']:.1f} % vs "
               f"MagicDec; saving {h['spire_saving_units']:.2f} training units")


@app.command()
def reproduce(
    preset: Annotated[str, typer.Option(help="Target preset (the embedded default: smollm2-135m).")] = "smollm2-135m",
    target: Annotated[Optional[str], typer.Option(help="A .gguf file or HF Llama-family folder to use instead "
                                                      "of the preset's checkpoint.")] = None,
    out: Annotated[Path, typer.Option(help="Output folder for REPORT.md, results.json and PNGs.")] = Path("spire-out"),
    quick: Annotated[bool, typer.Option("--quick", help="Smoke-test settings: about 5 minutes on 2 cores.")] = False,
    budget: Annotated[Optional[float], typer.Option(help="SPIRe training budget in seconds.")] = None,
    n_contexts: Annotated[Optional[int], typer.Option(help="Held-out contexts per τ measurement.")] = None,
    L: Annotated[Optional[int], typer.Option("-L", "--context", help="Context length for τ (tokens).")] = None,
    G: Annotated[Optional[int], typer.Option("-G", "--generate", help="Tokens generated per context.")] = None,
    k: Annotated[int, typer.Option("--k", "-k", help="Draft tokens per round.")] = 4,
    n_draft_layers: Annotated[int, typer.Option(help="Target layers pruned into the SPIRe draft.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed for data windows, training and sampling.")] = 0,
) -> None:
    """The main job: data, SPIRe training, τ for MagicDec and SPIRe, cost model, REPORT.md."""
    from spire.pipeline import ReproduceConfig, reproduce as run

    overrides = {name: value for name, value in (("budget_s", budget), ("n_contexts", n_contexts), ("L", L),
                                                  ("G", G)) if value is not None}
    overrides.update(preset=preset, target=target, out=out, k=k, n_draft_layers=n_draft_layers, seed=seed)
    cfg = ReproduceConfig.quick_config(**overrides) if quick else ReproduceConfig(**overrides)
    run(cfg, log=lambda msg: typer.echo(msg, err=True))
    typer.echo(f"wrote {out / 'REPORT.md'}, {out / 'results.json'} and figures")


@app.command()
def data(
    target: Annotated[str, typer.Option(help="Checkpoint whose tokenizer is used (preset, .gguf or HF folder).")]
    = "smollm2-135m",
    heldout_fraction: Annotated[float, typer.Option(help="Fraction of documents held out per source.")] = 0.1,
    seed: Annotated[int, typer.Option(help="Seed of the document split.")] = 0,
) -> None:
    """Prepare token windows from registry texts, held out by document (cached)."""
    from spire.data import data_summary_table, prepare_data
    from spire.loading import load_target
    from spire.pipeline import document_separator_id

    if not 0 < heldout_fraction < 1:
        raise ConfigError(f"--heldout-fraction must be in (0, 1), got {heldout_fraction}")
    _, tokenizer, _ = load_target(target)
    td = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), heldout_fraction=heldout_fraction,
                      seed=seed)
    typer.echo(data_summary_table(td))


@app.command()
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompts; or use --file, or pipe them on stdin "
                                                               "(one per line).")] = None,
    file: Annotated[Optional[Path], typer.Option(help="A text file with one prompt per line.")] = None,
    target: Annotated[str, typer.Option(help="Target: smollm2-135m, a .gguf file or an HF folder.")] = "smollm2-135m",
    draft: Annotated[Literal["none", "vanilla", "magicdec", "spire"], typer.Option(help="Draft model.")] = "magicdec",
    draft_path: Annotated[Optional[str], typer.Option(help="SPIRe draft .safetensors, or vanilla draft model.")]
    = None,
    k: Annotated[int, typer.Option("--k", "-k", help="Draft tokens per round.")] = 4,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt at most.")] = 128,
    stop: Annotated[list[str], typer.Option(help="Stop string; repeatable.")] = [],
    seed: Annotated[int, typer.Option(help="Seed for sampling.")] = 0,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt in the model's chat template.")] = False,
    window: Annotated[int, typer.Option(help="MagicDec window (tokens).")] = 64,
    fmt: Annotated[Literal["text", "json"], typer.Option("--format", help="Plain text or one JSON object.")]
    = "text",
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
    texts = list(prompts or [])
    if file is not None:
        try:
            texts += [line for line in file.read_text().splitlines() if line.strip()]
        except OSError as e:
            raise ConfigError(f"cannot read prompts from {file}: {e.strerror}") from None
    if not texts and not sys.stdin.isatty():
        texts = [line for line in sys.stdin.read().splitlines() if line.strip()]
    if not texts:
        raise ConfigError("no prompt given (pass prompts as arguments, --file, or on stdin)")
    if any(not t.strip() for t in texts):
        raise ConfigError("empty prompt")
    model, tokenizer, _ = load_target(target, progress=False)
    if chat:
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for t in texts]
    else:
        ids = [tokenizer(t).input_ids for t in texts]
    ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    d = make_draft(draft, model, tokenizer, draft_path, window=window)
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
        for o in outputs:
            typer.echo(o["text"])
        typer.echo(f"[draft {draft}, k={k}: tau {res.tau:.2f}]", err=True)


@app.command()
def compare(
    prompts: Annotated[list[str], typer.Argument(help="Prompts.")],
    target: Annotated[str, typer.Option(help="Target: smollm2-135m, a .gguf file or an HF folder.")] = "smollm2-135m",
    draft: Annotated[Literal["vanilla", "magicdec", "spire"], typer.Option(help="Draft model.")] = "magicdec",
    draft_path: Annotated[Optional[str], typer.Option(help="SPIRe draft .safetensors, or vanilla draft model.")]
    = None,
    dtype: Annotated[Literal["float32", "bfloat16"], typer.Option(help="Weights and activations.")] = "bfloat16",
    k: Annotated[int, typer.Option("--k", "-k", help="Draft tokens per round.")] = 4,
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


def _print_table(name: str, description: str, rows: list[dict]) -> None:
    from spire.throughput.cli_support import print_table

    print_table(name, description, rows)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app; a SpireError becomes one ``error:`` line on stderr, exit 2."""
    try:
        app(args=argv, prog_name="spire")
    except SpireError as e:
        message = " ".join(str(e).splitlines())
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
