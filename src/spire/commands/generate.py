"""``spire generate``: prompts in (arguments, a file or stdin), speculative decoding, text or one JSON object out.

The command's options are declared here and registered by :mod:`spire.cli`; the library (torch) is imported
inside the functions, so that ``spire --help`` stays light.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import typer

import spire.registry as registry
from spire import defaults
from spire.commands.options import check_k, draft_options_for, draft_path_help, k_help, kinds, with_draft_options
from spire.errors import ConfigError


def _stdin_lines() -> list[str]:
    """The non-empty lines of standard input: one prompt each."""
    return [line for line in sys.stdin.read().splitlines() if line.strip()]


def read_prompts(args: list[str], file: Path | None) -> list[str]:
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


def warn_unused_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """One warning line on stderr when --top-k / --top-p are set but do nothing (greedy decoding at T = 0)."""
    unused = [flag for flag, on in (("--top-k", top_k != 0), ("--top-p", top_p != 1.0)) if on]
    if temperature == 0 and unused:
        typer.echo(f"warning: {' and '.join(unused)} {'does' if len(unused) == 1 else 'do'} nothing at "
                   "--temperature 0 (greedy decoding)", err=True)


def tokenize(tokenizer: Any, texts: list[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt; with ``chat``, the prompt as one user turn of the tokenizer's chat template,
    generation prompt appended."""
    if chat:
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for t in texts]
    else:
        ids = [tokenizer(t).input_ids for t in texts]
    return [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]


def round_weights(model: Any, d: Any, draft: str, weights: str, draft_weights: str | None) -> None:
    """Apply --weights / --draft-weights in place: the target's weights to bf16 (``weights`` "bf16"), and a
    draft's own weights (``d.model``: SPIRe, vanilla, EAGLE-3) to bf16 or group-wise int8 (``draft_weights``,
    default as ``weights``). A draft without weights of its own gets a note on stderr when --draft-weights is
    given."""
    own_model = getattr(d, "model", None)  # a draft with weights of its own (SPIRe, vanilla)
    if draft_weights is not None and own_model is None:
        typer.echo(f"note: --draft-weights ignored: the {draft} draft has no weights of its own", err=True)
    own_fmt = (draft_weights or weights) if own_model is not None else None
    own = [own_model] if own_fmt == "bf16" else []
    if weights == "bf16" or own:
        from spire.fastpath import use_bf16_weights

        use_bf16_weights(*([model] if weights == "bf16" else []), *own)
    if own_fmt == "int8":
        from spire.fastpath import use_int8_weights

        use_int8_weights(own_model)


def print_outputs(res: Any, tokenizer: Any, stopper: Any, draft: str, k: int, fmt: str) -> None:
    """Write the result of :func:`spire.engine.engine.generate_batch`: ``fmt`` "json" one object ``{"outputs": [{"text",
    "token_ids", "finish_reason", "tau"}, ...], "tau", "draft", "k"}`` on stdout; "text" each output's text
    (a blank line between outputs) on stdout and the τ line on stderr."""
    outputs = []
    for b in range(len(res.tokens)):
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
        rounds = "no draft, one token per round" if draft == "none" else f"k={k}"  # -k means nothing without one
        typer.echo(f"[draft {draft}, {rounds}: tau {res.tau:.2f}]", err=True)


@with_draft_options
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompts; - reads prompts from standard input (one "
                                                               "per line); or use --file, or pipe them on stdin.")]
    = None,
    file: Annotated[Optional[Path], typer.Option(help="A text file with one prompt per line.")] = None,
    target: Annotated[str, typer.Option(help="Target: smollm2-135m, a .gguf file or an HF folder.")] = "smollm2-135m",
    draft: Annotated[str, typer.Option(**kinds(registry.names()), help="Draft model.")] = registry.DEFAULT,
    draft_path: Annotated[Optional[str], typer.Option(help=draft_path_help())]
    = None,
    k: Annotated[int, typer.Option("--k", "-k", help=k_help())] = defaults.K,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass in [0, 1]; 0 = greedy (as spire serve's "
                                              "top_p).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt at most.")] = 128,
    stop: Annotated[list[str], typer.Option(help="Stop string; repeatable.")] = [],
    seed: Annotated[int, typer.Option(help="Seed for sampling: prompt i samples with seed + i.")] = 0,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt in the model's chat template.")] = False,
    fmt: Annotated[Literal["text", "json"], typer.Option("--format", help="Plain text or one JSON object.")]
    = "text",
    weights: Annotated[Literal["fp32", "float32", "bf16"], typer.Option(
        help="bf16: weight-only bf16 on the CPU (target and draft weights rounded to bf16 and streamed at half the "
             "bytes; float32 arithmetic; the draft's: see --draft-weights). A slightly different model: compare "
             "with --weights bf16 --draft none.")]
    = "fp32",
    draft_weights: Annotated[Optional[Literal["fp32", "float32", "bf16", "int8"]], typer.Option(
        help="A trained draft's own weights (SPIRe, vanilla, EAGLE-3) (default: as --weights). bf16 (int8) beside a "
             "float32 target: the draft streams half (about a quarter of) the bytes and the output stays the float32 "
             "target's (SD is lossless whatever the draft computes).")] = None,
    draft_options: dict | None = None,
) -> None:
    """Generate with speculative decoding (lossless: greedy output equals --draft none)."""

    from spire.drafts import make_draft
    from spire.loading import load_target, read_model_config, resolve_checkpoint
    from spire.params import greedy_top_p
    from spire.sampling import SamplingParams
    from spire.engine.engine import generate_batch
    from spire.engine.output import StopStrings

    greedy_t, nucleus = greedy_top_p(temperature, top_p, "--top-p")  # 0 is greedy, as spire serve's top_p
    params = SamplingParams(greedy_t, top_k, nucleus)
    check_k(k)
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    warn_unused_sampling(temperature, top_k, top_p)
    texts = read_prompts(prompts or [], file)
    options = draft_options_for(draft, draft_options or {})
    positions = read_model_config(resolve_checkpoint(target, progress=False)).max_positions  # before the weights
    check_k(k, positions, f"the target's {positions} positions")
    model, tokenizer, _ = load_target(target, progress=False)
    ids = tokenize(tokenizer, texts, chat)
    d = make_draft(draft, model, tokenizer, draft_path, **options)
    round_weights(model, d, draft, weights, draft_weights)
    eos = set(model.cfg.eos_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    stopper = StopStrings(stop, tokenizer.decode) if stop else None
    res = generate_batch(model, ids, max_new_tokens, draft=d, k=k, params=params, seed=seed, eos_ids=sorted(eos),
                         stop=stop, decode=tokenizer.decode)
    print_outputs(res, tokenizer, stopper, draft, k, fmt)
