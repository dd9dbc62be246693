"""``spire export``: a trained draft as a folder serving engines read (docs/serving.md).

The command's options are declared here and registered by :mod:`spire.cli`; the library is imported inside the
function.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import spire.registry as registry
from spire import defaults
from spire.commands.options import kinds
from spire.errors import ConfigError
from spire.paths import check_output_path


def export(
    out: Annotated[Path, typer.Option(help="Folder to write: config.json + model.safetensors, and vLLM's "
                                                 "vllm_speculative_config.json (docs/serving.md). An earlier export "
                                                 "there is replaced; any other non-empty folder is refused.")],
    draft_path: Annotated[str, typer.Option(help="The trained draft: a `spire train` run folder (any kind), a "
                                                 "SPIRe .safetensors, or a vanilla draft folder.")],
    draft: Annotated[str, typer.Option(**kinds(registry.names(trains=True)), help="Draft kind.")]
    = "spire",
    target: Annotated[str, typer.Option(help="The draft's target (verifier): smollm2-135m, a .gguf file or an HF "
                                             "folder.")] = "smollm2-135m",
    k: Annotated[int, typer.Option("--k", "-k", help="Speculative tokens per round recorded for serving.")]
    = defaults.K,
    no_vllm: Annotated[bool, typer.Option("--no-vllm", help="Write spire's form alone (no vllm/ or "
                                          "vllm_speculative_config.json): the draft exactly as trained, also one "
                                          "vLLM cannot run.")] = False,
    k_table: Annotated[int, typer.Option(help=(
        "Add vLLM's per-batch-size k (num_speculative_tokens_per_batch_size) for batch sizes 1..N: the k in 0..k the "
        "cost model rates best on this machine (its fp32 calibration) with the run's held-out acceptance per "
        "position (docs/serving.md). 0: none."))] = 0,
    k_table_context: Annotated[int, typer.Option(help="Context length (tokens) the --k-table is priced at.")]
    = 1024,
) -> None:
    """Write a trained draft as a folder serving engines can read (speculators-style config.json with
    speculators_config, and model.safetensors; docs/serving.md). spire reads it back with --draft-path FOLDER."""
    from spire.export import export_draft
    from spire.loading import load_model, resolve_checkpoint

    check_output_path(out, "--out", folder=True)
    if k_table < 0 or k_table_context < 1 or (k_table and no_vllm):
        raise ConfigError("--k-table must be >= 0 (and needs vLLM's form: not with --no-vllm), --k-table-context "
                          f">= 1; got {k_table}, {k_table_context}")

    folder = resolve_checkpoint(target, progress=False)
    model = load_model(folder)
    # the verifier as engines load it: the checkpoint folder a preset resolves to (HF hub ids are not
    # reachable offline), else the folder or .gguf file given, as an absolute path
    table = batch_size_table(model, draft, draft_path, k, k_table, k_table_context) if k_table else None
    export_draft(draft, draft_path, model, str(Path(folder).resolve()), out, k, vllm=not no_vllm, k_table=table)
    typer.echo(str(out))


def batch_size_table(model, kind: str, draft_path: str, k: int, max_batch: int, context: int) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` for the run at ``draft_path``: per batch size the k the cost
    model rates best (:func:`spire.serving.policy.batch_size_ks`) with this machine's fp32 calibration and the run's
    held-out α per drafted position. Raises ConfigError when the path is not a `spire train` run with a held-out
    evaluation."""
    from spire.commands.bench import get_calibration
    from spire.drafts import make_draft
    from spire.formats.draft_file import run_state
    from spire.integrations.vllm_export import batch_size_table as ranges
    from spire.serving.policy import batch_size_ks, round_model

    state = run_state(Path(draft_path)) if Path(draft_path).is_dir() else None
    alphas = ((state or {}).get("heldout") or {}).get("alpha_per_position")
    if not alphas:
        raise ConfigError(f"--k-table needs the held-out acceptance of a `spire train` run: {draft_path} is not a run "
                          "folder with a held-out evaluation")
    cal = get_calibration(None, model.device, "fp32", False, lambda m: typer.echo(f"spire export: {m}", err=True))
    rm = round_model(model, make_draft(kind, model, path=draft_path), cal.hoi("fp32"))
    ks = batch_size_ks(rm, [float(a) for a in alphas], k, context, max_batch)
    table = ranges(ks)
    typer.echo(f"spire export: vLLM's k by batch size at L = {context} (HOI {rm.hoi:.1f} FLOP/byte, held-out α "
               f"{', '.join(f'{a:.2f}' for a in alphas)}): " + ", ".join(f"{a}-{b}: {x}" for a, b, x in table),
               err=True)
    return table
