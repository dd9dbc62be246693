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
    export_draft(draft, draft_path, model, str(Path(folder).resolve()), out, k, vllm=not no_vllm)
    typer.echo(str(out))
