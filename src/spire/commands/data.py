"""``spire data``: token windows from the registry texts, held out by document (cached).

The command's options are declared here and registered by :mod:`spire.cli`; the library is imported inside the
function.
"""

from __future__ import annotations

from typing import Annotated

import typer

from spire.errors import ConfigError


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
