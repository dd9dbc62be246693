"""``spire compare``: greedy speculative decoding against greedy autoregressive decoding, prompt by prompt.

The command's options are declared here and registered by :mod:`spire.cli`; the library is imported inside the
function.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

import typer

import spire.registry as registry
from spire import defaults
from spire.commands.options import draft_options_for, kinds, with_draft_options
from spire.errors import ConfigError


@with_draft_options
def compare(
    prompts: Annotated[list[str], typer.Argument(help="Prompts.")],
    target: Annotated[str, typer.Option(help="Target: smollm2-135m, a .gguf file or an HF folder.")] = "smollm2-135m",
    draft: Annotated[str, typer.Option(**kinds(registry.names(drafts_only=True)),
                                       help="Draft model.")] = registry.DEFAULT,
    draft_path: Annotated[Optional[str], typer.Option(help="SPIRe or EAGLE-3 draft: .safetensors, run folder or "
                                                           "exported folder; or vanilla draft model.")]
    = None,
    dtype: Annotated[Literal["float32", "bfloat16"], typer.Option(help="Weights and activations.")] = "bfloat16",
    k: Annotated[int, typer.Option("--k", "-k", help="Draft tokens per round.")] = defaults.K,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per prompt.")] = 64,
    draft_options: dict | None = None,
) -> None:
    """Greedy SD vs greedy AD: identical, or the first divergence and the target's top-2 logit gap there."""
    import torch

    from spire.drafts import make_draft
    from spire.evaluation.compare import compare_greedy
    from spire.loading import load_target

    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    options = draft_options_for(draft, draft_options or {})
    model, tokenizer, _ = load_target(target, dtype=getattr(torch, dtype), progress=False)
    d = make_draft(draft, model, tokenizer, draft_path, **options)
    ids = [tokenizer(p).input_ids for p in prompts]
    if any(not x for x in ids):
        raise ConfigError("empty prompt")
    for r in compare_greedy(model, d, ids, max_new_tokens, k):
        if r.identical:
            typer.echo(f"prompt {r.row}: identical to AD ({dtype})")
        else:
            typer.echo(f"prompt {r.row}: first divergence at generated token {r.index}; "
                       f"target top-2 logit gap there {r.top2_gap:.4f} ({dtype})")
