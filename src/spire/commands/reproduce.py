"""``spire reproduce``: the main job (data, SPIRe + EAGLE-3 + vanilla (+ ablation) training, τ of every draft
kind, cost model, REPORT.md) from its options.

The command's options are declared here and registered by :mod:`spire.cli`; the library (:mod:`spire.pipeline`,
torch) is imported inside the functions. A default in brackets in a help text is the one of
:class:`spire.pipeline.ReproduceConfig` (tests/test_reproduce.py checks them against it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from spire import defaults
from spire.commands.options import given, ints
from spire.errors import ConfigError
from spire.paths import check_output_path

REPRODUCE_OPTIONS = ("budget", "n_contexts", "L", "G", "vanilla_budget", "ablation_budget", "tau_L_contexts", "steps",
                     "vanilla_steps", "ablation_steps", "first_layers", "cache_steps", "preset", "target", "out", "k",
                     "n_draft_layers", "seed", "train_processes", "hidden_loss", "compile_step", "bridge", "eagle3",
                     "eagle3_budget", "eagle3_steps", "tau_k_contexts", "diagnose_contexts")
"""`spire reproduce` options passed to ReproduceConfig as given (budget -> budget_s, and the other budgets alike)."""

FIELDS = {"budget": "budget_s", "vanilla_budget": "vanilla_budget_s", "ablation_budget": "ablation_budget_s",
          "hidden_loss": "hidden_weight", "compile_step": "compile", "eagle3_budget": "eagle3_budget_s"}
"""`spire reproduce` options whose ReproduceConfig field has another name."""


def overrides(options: dict, ablations: str | None, tau_L: str | None, tau_k: str | None,
              draft_vocab: int | None, target_cache: str | None) -> dict:
    """The ReproduceConfig fields the options set: ``options`` (the :data:`REPRODUCE_OPTIONS` the user gave, by
    parameter name) under their field names (--budget without --steps trains SPIRe and EAGLE-3 by time instead of
    the default step counts; --eagle3-budget without --eagle3-steps EAGLE-3 alone), then the options parsed here
    (--ablations NAME,...|all, --tau-L,
    --tau-k with 0 for none, --draft-vocab with 0 for the whole vocabulary, --target-cache with none for the
    live target). Raises ConfigError for a malformed value."""
    from spire.training.config import ABLATIONS

    out = {FIELDS.get(name, name): value for name, value in options.items() if value is not None}
    if "budget_s" in out and "steps" not in out:  # --budget alone: SPIRe, and EAGLE-3, train by time
        out["steps"] = None
    if ("budget_s" in out or "eagle3_budget_s" in out) and "eagle3_steps" not in out:
        out["eagle3_steps"] = None
    if ablations is not None:
        names = [a.strip() for a in ablations.split(",") if a.strip()]
        out["ablations"] = tuple(ABLATIONS) if names == ["all"] else tuple(names)
    if tau_L is not None:
        out["tau_Ls"] = tuple(ints("--tau-L", [tau_L]))
    if tau_k is not None:
        out["tau_ks"] = () if tau_k.strip() == "0" else tuple(ints("--tau-k", [tau_k]))
    if draft_vocab is not None:
        out["draft_vocab"] = draft_vocab or None
    if target_cache is not None:
        if target_cache not in ("bfloat16", "float32", "none"):
            raise ConfigError(f"--target-cache must be bfloat16, float32 or none, got {target_cache!r}")
        out["target_cache"] = None if target_cache == "none" else target_cache
    return out


def reproduce(
    ctx: typer.Context,
    preset: Annotated[str, typer.Option(help="Target preset (the embedded default: smollm2-135m).")] = "smollm2-135m",
    target: Annotated[Optional[str], typer.Option(help="A .gguf file or HF Llama-family folder to use instead "
                                                      "of the preset's checkpoint.")] = None,
    out: Annotated[Path, typer.Option(help="Output folder for REPORT.md, results.json and PNGs.")] = Path("spire-out"),
    quick: Annotated[bool, typer.Option("--quick", help="Smoke-test settings: about 5 minutes on 2 cores.")] = False,
    budget: Annotated[Optional[float], typer.Option(help="Train SPIRe (and EAGLE-3) for this many seconds instead of "
                                                    "the default step counts (then what is trained depends on "
                                                    "the machine's speed) [none: --steps; 60 with --quick].")] = None,
    vanilla_budget: Annotated[Optional[float], typer.Option(help="Vanilla draft training seconds, at most [none; "
                                                            "1100 with --budget].")] = None,
    ablations: Annotated[Optional[str], typer.Option(metavar="NAME[,NAME...]|all", help="Figure 5 ablations to "
                                                     "train and measure: none (full SPIRe at the ablation budget), "
                                                     "no-feedback, no-feedback-no-target, omega1, hard-loss, "
                                                     "random-init, full-kv, or all.")] = None,
    ablation_budget: Annotated[Optional[float], typer.Option(help="Training seconds per ablation [300].")] = None,
    steps: Annotated[Optional[int], typer.Option(help="SPIRe's optimizer steps of 4 x 256 tokens, what the "
                                                  "committed results trained; the vanilla draft trains half its "
                                                  "tokens [671].")] = None,
    vanilla_steps: Annotated[Optional[int], typer.Option(help="Vanilla: steps instead of seconds.")] = None,
    ablation_steps: Annotated[Optional[int], typer.Option(help="Ablations: steps instead of seconds (equal "
                                                                "training for every variant).")] = None,
    tau_L: Annotated[Optional[str], typer.Option("--tau-L", metavar="L[,L...]", help="Context lengths of the τ-vs-L "
                                                 "sweep [256,512,1024,4096].")] = None,
    tau_L_contexts: Annotated[Optional[int], typer.Option(help="Contexts per L in the sweep [8].")] = None,
    tau_k: Annotated[Optional[str], typer.Option("--tau-k", metavar="K[,K...]", help="k of the τ-vs-k sweep (greedy, "
                                                 "at -L; 0 skips it) [1,2,4,8].")] = None,
    tau_k_contexts: Annotated[Optional[int], typer.Option(help="Contexts per k in the sweep [8].")] = None,
    diagnose_contexts: Annotated[Optional[int], typer.Option(help="Contexts of the T = 1 diagnosis of each draft "
                                                             "(spire tau --diagnose; 0 skips it) [8].")] = None,
    eagle3: Annotated[Optional[bool], typer.Option("--eagle3/--no-eagle3", help="Train and measure an EAGLE-3 "
                                                   "draft beside SPIRe [on].")] = None,
    eagle3_budget: Annotated[Optional[float], typer.Option(help="EAGLE-3 training seconds [SPIRe's --budget].")]
    = None,
    eagle3_steps: Annotated[Optional[int], typer.Option(help="EAGLE-3's optimizer steps, what the committed "
                                                        "results trained (with --budget alone: SPIRe's seconds) "
                                                        "[969].")] = None,
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

    fields = overrides(given(ctx, REPRODUCE_OPTIONS), ablations, tau_L, tau_k, draft_vocab, target_cache)
    cfg = ReproduceConfig.quick_config(**fields) if quick else ReproduceConfig(**fields)
    check_output_path(cfg.out, "--out", folder=True)
    try:
        run(cfg, log=lambda msg: typer.echo(msg, err=True))
    except KeyboardInterrupt:
        typer.echo("interrupted: the same command goes on where this one stopped (finished drafts and τ "
                   "measurements are reused from the cache; an unfinished training resumes from its last checkpoint)",
                   err=True)
        raise
    typer.echo(f"wrote {out / 'REPORT.md'}, {out / 'results.json'} and figures")
