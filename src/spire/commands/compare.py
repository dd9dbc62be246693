"""``spire compare``: greedy speculative decoding against greedy autoregressive decoding, prompt by prompt.

The command's options are declared here and registered by :mod:`spire.cli`; the library is imported inside the
function.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Optional

import typer

import spire.registry as registry
from spire import defaults
from spire.commands.options import draft_options_for, draft_path_help, kinds, with_draft_options
from spire.errors import ConfigError


@with_draft_options
def compare(
    prompts: Annotated[list[str], typer.Argument(help="Prompts.")],
    target: Annotated[str, typer.Option(help="Target: smollm2-135m, a .gguf file or an HF folder.")] = "smollm2-135m",
    draft: Annotated[str, typer.Option(**kinds(registry.names(drafts_only=True)),
                                       help="Draft model.")] = registry.DEFAULT,
    draft_path: Annotated[Optional[str], typer.Option(help=draft_path_help())]
    = None,
    dtype: Annotated[Literal["float32", "bfloat16"], typer.Option(help="Weights and activations.")] = "bfloat16",
    k: Annotated[int, typer.Option("--k", "-k", help="Draft tokens per round.")] = defaults.K,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per prompt.")] = 64,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    fmt: Annotated[Literal["text", "json"], typer.Option("--format", help="Plain text or one JSON object.")]
    = "text",
    draft_options: dict | None = None,
) -> None:
    """Greedy SD vs greedy AD: identical, or the first divergence, the target's top-2 logit gap there, and whether
    the gap is within the target's rounding (a near-tie) or not (a real divergence; spire.evaluation.compare)."""
    import torch

    from spire.drafts import make_draft
    from spire.evaluation.compare import compare_greedy
    from spire.loading import load_target

    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    options = draft_options_for(draft, draft_options or {})
    if device != "cpu" and not device.startswith("cuda"):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}, but this torch ({torch.__version__}) sees no CUDA device")
    # an exactness check: float32 matmuls in full float32 (no TF32 on a GPU)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    model, tokenizer, _ = load_target(target, dtype=getattr(torch, dtype), device=device, progress=False)
    d = make_draft(draft, model, tokenizer, draft_path, **options)
    ids = [tokenizer(p).input_ids for p in prompts]
    if any(not x for x in ids):
        raise ConfigError("empty prompt")
    rows = compare_greedy(model, d, ids, max_new_tokens, k)
    if fmt == "json":
        typer.echo(json.dumps({"dtype": dtype, "draft": draft, "k": k, "rows": [r.to_dict() for r in rows]}))
        return
    for r in rows:
        if r.identical:
            typer.echo(f"prompt {r.row}: identical to AD ({dtype})")
            continue
        line = (f"prompt {r.row}: first divergence at generated token {r.index}; "
                f"target top-2 logit gap there {r.top2_gap:.4f} ({dtype})")
        if r.near_tie is not None:
            line += (f"; AD {r.ad_token} vs SD {r.sd_token}: gap {r.gap:.4f} "
                     + (f"<= {dtype} rounding bound {r.bound:.4f}: a near-tie" if r.near_tie else
                        f"> {dtype} rounding bound {r.bound:.4f}: a REAL divergence, not rounding"))
        typer.echo(line)
