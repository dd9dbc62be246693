"""``spire serve``: continuous batching with lossless speculative decoding behind an OpenAI-compatible API.

The command's options are declared here and registered by :mod:`spire.cli`; the library (torch, FastAPI) is
imported inside the function, so that ``spire --help`` stays light. What it serves: :mod:`spire.serving.api`;
the engine: :mod:`spire.engine`; docs/serving.md, section "spire serve".
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

import spire.registry as registry
from spire import defaults
from spire.commands.options import draft_options_for, kinds, with_draft_options
from spire.errors import ConfigError


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _check(port: int, max_running: int, max_waiting: int, k: int, max_len: int, log_level: str,
           shutdown_grace: float, prefill_chunk: int = 0, max_request_bytes: int = 1 << 22) -> None:
    if not 1 <= port <= 65535:  # 0 (any free port) would serve on a port no line names
        raise ConfigError(f"--port must be in [1, 65535], got {port}")
    for flag, v, lo in (("--max-running", max_running, 1), ("--max-waiting", max_waiting, 0), ("-k", k, 1),
                        ("--max-len", max_len, k + 2), ("--prefill-chunk", prefill_chunk, 0),
                        ("--max-request-bytes", max_request_bytes, 1024)):
        if v < lo:
            why = " (a prompt token, a new token and k drafted ones)" if flag == "--max-len" else ""
            raise ConfigError(f"{flag} must be >= {lo}{why}, got {v}")
    if not shutdown_grace >= 0 or shutdown_grace == float("inf"):
        raise ConfigError(f"--shutdown-grace must be a finite number of seconds >= 0, got {shutdown_grace}")
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")


def check_bind(host: str, port: int) -> None:
    """Refuse, before the model loads, an address this process cannot listen on (a port in use, a host that is
    not one of this machine's). Raises ConfigError naming it."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None


WEIGHTS = ("fp32", "float32", "bf16")
WEIGHT_BYTES = {"fp32": 4.0, "float32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 64}
"""Bytes streamed per weight value (int8: the value and its share of a float32 scale per 64 inputs)."""


def cost_model_policy(model, draft, k: int, weights: str, draft_weights: Optional[str]):
    """The --k-policy cost-model policy: the round model of the served target and draft at their weight bytes, with
    the operational intensity of this device's fp32 calibration (measured and saved at the first use)."""
    from spire.commands.bench import get_calibration
    from spire.serving.policy import CostModelPolicy, round_model

    cal = get_calibration(None, model.device, "fp32", False, lambda m: typer.echo(f"spire serve: {m}", err=True))
    own = WEIGHT_BYTES[draft_weights or weights]
    rm = round_model(model, draft, cal.hoi("fp32"), WEIGHT_BYTES[weights], own)
    typer.echo(f"spire serve: k per round by the cost model (HOI {rm.hoi:.1f} FLOP/byte, α prior 0.6, measured "
               "as rounds run)", err=True)
    return CostModelPolicy(rm, k)


def check_memory(target: str, device: str, stated: Optional[str], max_running: int, max_len: int, k: int,
                 prefill_chunk: int, draft: Optional[str], draft_path: Optional[str]) -> None:
    """Refuse, before loading, settings whose memory plan (spire.memory_plan: weights, KV caches of --max-running x
    --max-len, a step's activations) exceeds the device's memory; the error names the largest --max-running that
    fits. No check on a CPU unless --device-memory / $SPIRE_DEVICE_MEMORY states one."""
    if device != "cpu" and not device.startswith("cuda"):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    import torch

    if device != "cpu" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}, but this torch ({torch.__version__}) sees no CUDA device")
    from spire.memory_plan import check_fits, device_memory, serve_planner
    from spire.loading import read_model_config, resolve_checkpoint

    memory = device_memory(device, stated)
    if memory is None:
        return
    cfg = read_model_config(resolve_checkpoint(target, progress=False))
    planner = serve_planner(cfg, min(max_len, cfg.max_positions), k, prefill_chunk, draft or registry.BASELINE,
                            draft_path)
    check_fits(planner, max_running, memory, device)


def pick_draft(draft: Optional[str], draft_path: Optional[str], model) -> tuple[str, Optional[str], str]:
    """(kind, path, why) of the draft to serve: the one named, else the newest trained SPIRe draft in the cache,
    else MagicDec."""
    if draft is not None:
        return draft, draft_path, "as asked"
    from spire.drafts.spire import find_trained_spire

    found = find_trained_spire(model)
    if found is not None:
        return "spire", str(found), f"the newest trained SPIRe draft in the cache, {found}"
    return registry.BASELINE, None, "no trained SPIRe draft in the cache"


@with_draft_options
def serve(
    target: Annotated[str, typer.Option(help="Target: smollm2-135m, a .gguf file or an HF folder.")] = "smollm2-135m",
    draft: Annotated[Optional[str], typer.Option(**kinds(registry.names()), help=(
        "Draft model [the newest trained SPIRe draft in the cache, else magicdec]."))] = None,
    draft_path: Annotated[Optional[str], typer.Option(help="SPIRe or EAGLE-3 draft: .safetensors, run folder or "
                                                           "exported folder; or vanilla draft model.")] = None,
    k: Annotated[int, typer.Option("--k", "-k", help="Draft tokens per round.")] = defaults.K,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(help="Require `Authorization: Bearer KEY` on /v1 requests.")]
    = None,
    max_running: Annotated[int, typer.Option(help="Slots: requests decoded together in every round.")] = 8,
    max_waiting: Annotated[int, typer.Option(help="Requests queued for a slot at most; past it a 503.")] = 64,
    max_len: Annotated[int, typer.Option(help=(
        "Positions per slot: a request needs prompt + max_tokens <= max-len, with any draft (rounds near the end of "
        "a slot draft fewer tokens); at most the target's positions."))] = 2048,
    k_policy: Annotated[str, typer.Option(help=(
        "fixed: every round drafts k. cost-model: each round drafts the k in 0..k (0 = AD) that the cost model "
        "rates best for the running requests, with this device's calibration and the draft's measured acceptance "
        "(docs/serving.md)."))] = "fixed",
    weights: Annotated[str, typer.Option(help="fp32, or bf16: weight-only bf16 on the CPU (as spire generate).")]
    = "fp32",
    draft_weights: Annotated[Optional[str], typer.Option(help=(
        "A trained draft's own weights: fp32, bf16 or int8 (default: as --weights); the output stays the target's."))]
    = None,
    log_level: Annotated[str, typer.Option(help=f"uvicorn's log level: {', '.join(LOG_LEVELS)}.")] = "warning",
    shutdown_grace: Annotated[float, typer.Option(help=(
        "Seconds in-flight requests get to finish after SIGTERM; those still running are then answered with "
        "finish_reason abort."))] = 30.0,
    prefill_chunk: Annotated[int, typer.Option(help=(
        "Prompt tokens prefilled per engine step at most (chunked prefill): a long prompt is prefilled over several "
        "steps while the running requests keep decoding. 0: each prompt whole when it joins."))] = 512,
    max_request_bytes: Annotated[int, typer.Option(help=(
        "Request bodies larger than this (bytes) are refused with a 413 before they are read whole."))] = 4 << 20,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    device_memory: Annotated[Optional[str], typer.Option(help=(
        "Memory the server may use on the device, e.g. 24GiB: settings whose memory plan exceeds it are refused "
        "before loading [cuda: the free memory; cpu: no check; env SPIRE_DEVICE_MEMORY]."))] = None,
    draft_options: dict | None = None,
) -> None:
    """Serve the target with continuous batching and lossless speculative decoding (OpenAI-compatible API)."""
    _check(port, max_running, max_waiting, k, max_len, log_level, shutdown_grace, prefill_chunk,
           max_request_bytes)
    for flag, value, allowed in (("--k-policy", k_policy, ("fixed", "cost-model")), ("--weights", weights, WEIGHTS),
                                 ("--draft-weights", draft_weights or "fp32", (*WEIGHTS, "int8"))):
        if value not in allowed:
            raise ConfigError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
    draft_options = draft_options or {}
    # checked before the model loads; without --draft the kind is picked after it, and the note comes then
    draft_options_for(draft, draft_options, [draft] if draft else list(registry.names()))
    check_bind(host, port)
    check_memory(target, device, device_memory, max_running, max_len, k, prefill_chunk, draft, draft_path)
    from spire.commands.generate import round_weights
    from spire.drafts import make_draft
    from spire.loading import load_target
    from spire.serving.api import Server, create_app, run, torch_thread
    from spire.engine.engine import Engine

    def build():
        model, tokenizer, _ = load_target(target, device=device, progress=False)
        if max_len > model.cfg.max_positions:
            typer.echo(f"warning: --max-len {max_len} is more than the target's {model.cfg.max_positions} positions; "
                       f"using {model.cfg.max_positions}", err=True)
        kind, path, why = pick_draft(draft, draft_path, model)
        # the options noted above when --draft was given; a picked draft's get their note here
        options = (registry.check_options(kind, draft_options.get(kind, {})) if draft
                   else draft_options_for(kind, draft_options))
        d = make_draft(kind, model, tokenizer, path, **options)
        round_weights(model, d, kind, weights, draft_weights)
        policy = None
        if k_policy == "cost-model" and d is not None:
            policy = cost_model_policy(model, d, k, weights, draft_weights)
        eos = set(model.cfg.eos_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        engine = Engine(model, d, k=k, max_running=max_running, max_len=min(max_len, model.cfg.max_positions),
                        eos_ids=sorted(eos), decode=tokenizer.decode, k_policy=policy,
                        prefill_chunk=prefill_chunk or None)
        return engine, tokenizer, kind, why, policy

    runner = torch_thread()  # every torch call of the server on one thread (api.torch_thread says why)
    engine, tokenizer, kind, why, policy = runner.submit(build).result()
    server = Server(engine, tokenizer, target, kind, max_waiting=max_waiting, api_key=api_key, runner=runner,
                    max_request_bytes=max_request_bytes)
    typer.echo(f"spire serve: target {target}, draft {kind} ({why}), k {engine.k}"
               f"{' chosen per round by the cost model' if policy else ''}, {max_running} slots x "
               f"{engine.max_len} positions, at most {max_waiting} waiting, prefill "
               f"{f'in chunks of {prefill_chunk} tokens' if prefill_chunk else 'whole'}; http://{host}:{port}/v1",
               err=True)
    run(create_app(server), host, port, graceful_s=shutdown_grace, log_level=log_level,
        abort_all=server.loop.abort_all)
