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
from spire.commands.options import check_k, draft_options_for, draft_path_help, k_help, with_draft_options
from spire.errors import ConfigError


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _check(port: int, max_running: int, max_waiting: int, k: int, max_len: int, log_level: str,
           shutdown_grace: float, prefill_chunk: int = 0, max_request_bytes: int = 1 << 22) -> None:
    if not 1 <= port <= 65535:  # 0 (any free port) would serve on a port no line names
        raise ConfigError(f"--port must be in [1, 65535], got {port}")
    for flag, v, lo in (("--max-running", max_running, 1), ("--max-waiting", max_waiting, 0),
                        ("--max-len", max_len, 3), ("--prefill-chunk", prefill_chunk, 0),
                        ("--max-request-bytes", max_request_bytes, 1024)):
        if v < lo:
            why = " (a prompt token, a new token and a drafted one)" if flag == "--max-len" else ""
            raise ConfigError(f"{flag} must be >= {lo}{why}, got {v}")
    check_k(k, max_len, f"a slot of --max-len {max_len} positions")
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


def parse_drafts(draft: Optional[str], draft_path: Optional[str]) -> list[tuple[str, Optional[str]]]:
    """``--draft`` (one kind, or a comma-separated portfolio such as ``ngram,spire``) and ``--draft-path`` -> the
    (kind, path) of each draft, in the order given. The path goes to the one kind of the list that takes a path.
    Raises ConfigError naming an unknown or repeated kind, ``none`` in a portfolio, or a path that two kinds of
    the list could take."""
    kinds_ = [k.strip() for k in draft.split(",")] if draft else []
    known = registry.names()
    for kd in kinds_:
        if kd not in known:
            raise ConfigError(f"--draft: {kd!r} is not one of {', '.join(known)}")
    if len(set(kinds_)) != len(kinds_):
        raise ConfigError(f"--draft {draft}: a kind may appear once in a portfolio")
    if len(kinds_) > 1 and "none" in kinds_:
        raise ConfigError(f"--draft {draft}: 'none' cannot be part of a portfolio (the policy drafts nothing where "
                          "no draft pays)")
    if len(kinds_) <= 1:
        return [(kinds_[0], draft_path)] if kinds_ else []
    takers = [kd for kd in kinds_ if registry.kind(kd).path != "none"]
    if draft_path and len(takers) != 1:
        raise ConfigError(f"--draft-path: the portfolio {draft} has {len(takers)} kinds that take a path "
                          f"({', '.join(takers) or 'none'}); it needs exactly one")
    return [(kd, draft_path if kd in takers else None) for kd in kinds_]


def load_drafts(model, tokenizer, portfolio: list[tuple[str, Optional[str]]], draft_path: Optional[str],
                draft_options: dict, weights: str, draft_weights: Optional[str]) -> tuple[list, str, str, list]:
    """The drafts to serve (:func:`parse_drafts`' portfolio; empty: the newest trained SPIRe draft in the cache,
    else MagicDec), each with its options and weight format (:func:`served_draft_weights`). Returns (drafts, their
    kinds joined by commas, why, each draft's weight format: "fp32", "bf16", "int8" or None for a draft without
    weights of its own)."""
    from spire.commands.generate import round_weights
    from spire.drafts import make_draft

    picked = None if portfolio else pick_draft(None, draft_path, model)
    chosen = portfolio or [picked[:2]]
    drafts, formats = [], []
    for kind, path in chosen:
        # the options noted before loading when --draft was given; a picked draft's get their note here
        options = (registry.check_options(kind, draft_options.get(kind, {})) if portfolio
                   else draft_options_for(kind, draft_options))
        d = make_draft(kind, model, tokenizer, path, **options)
        fmt = served_draft_weights(kind, d, model, weights, draft_weights) if d is not None else None
        # --draft-weights as given (a draft without weights of its own gets round_weights' note), else the default
        round_weights(model, d, kind, weights, draft_weights if draft_weights is not None
                      else fmt if fmt == "int8" else None)
        if d is not None:
            drafts.append(d)
            formats.append(fmt)
    return drafts, ",".join(kind for kind, _ in chosen), "as asked" if portfolio else picked[2], formats


def weights_note(drafts: list, formats: list) -> str:
    """The start-up line's part on the drafts' own weights: "spire: int8 weights from RUN/draft.safetensors" per
    draft with weights of its own (``formats``: :func:`load_drafts`' per draft, None for a draft without)."""
    return ", ".join(f"{d.name}: {f} weights" + (f" from {d.source}" if d.source else "")
                     for d, f in zip(drafts, formats) if f)


def served_draft_weights(kind: str, d, model, weights: str, draft_weights: Optional[str]) -> Optional[str]:
    """The weight format a served draft runs in: ``draft_weights`` when given; otherwise group-wise int8 for a kind
    whose registry line says so (``served_int8``: SPIRe, vanilla) when its own weights are float32 on the CPU, the
    target's are float32 and spire's kernels are built (its decode matmuls then stream a quarter of float32's
    bytes, which makes a draft step of a few rows about 2x cheaper: docs/bench.md, "An int8 draft"); else
    ``weights``. None for a draft without weights of its own (n-gram, MagicDec). The output stays the target's
    whatever the draft's format; only τ can move (by less than 0.02 there)."""
    import torch

    from spire import kernels

    own = getattr(d, "model", None)
    if own is None:
        return None
    if draft_weights is not None:
        return draft_weights
    p = next(own.parameters(), None)
    if (registry.kind(kind).served_int8 and weights in ("fp32", "float32") and p is not None
            and p.device.type == "cpu" and p.dtype == torch.float32 and kernels.available()):
        return "int8"
    return weights


def profile_identity(engine, target: str, weights: str, draft_weights) -> dict:
    """What a round-cost profile depends on: this machine (CPU model, threads, torch), the target's shape and dtype,
    each draft's kind and cost shape, the weight formats and the engine's slots, positions and k."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    from spire.throughput.pricing import shape_of

    cfg = engine.target.cfg
    drafts = []
    for d in engine.drafts:
        try:
            shape = repr(d.cost_shape(shape_of(engine.target)))
        except Exception:  # a draft without a cost shape: its class and settings
            shape = repr(sorted((k, v) for k, v in vars(d).items() if isinstance(v, (int, float, str, bool))))
        drafts.append([d.name, type(d).__name__, shape])
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": str(engine.target.device), "target": [target, cfg.n_layers, cfg.d_model, cfg.vocab_size,
                                                            str(engine.target.dtype)],
            "weights": [weights, draft_weights], "drafts": drafts, "max_running": engine.max_running,
            "max_len": engine.max_len, "k": engine.k, "version": 2}


def measured_policy(engine, target: str, weights: str, draft_weights, alpha_prior: float = 0.6):
    """The --k-policy measured policy of ``engine``: round costs from a profile of this machine, target and drafts
    (timed once, then read from the cache: ``$SPIRE_CACHE/profiles/``), acceptance measured as rounds run from a
    prior of ``alpha_prior`` per position."""
    import hashlib
    import json

    from spire.engine.profile import StepCosts, profile_rounds
    from spire.paths import spire_cache_dir
    from spire.serving.policy import Acceptance, MeasuredPolicy

    ident = profile_identity(engine, target, weights, draft_weights)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    path = spire_cache_dir() / "profiles" / f"{key}.json"
    costs = None
    if path.is_file():
        try:
            costs = StepCosts.from_dict(json.loads(path.read_text())["costs"])
        except (ConfigError, ValueError, KeyError, OSError) as e:
            typer.echo(f"spire serve: the round-cost profile {path} is unreadable ({e}); timing it again", err=True)
    if costs is None:
        typer.echo("spire serve: timing rounds for the round policy (once for this machine, target and drafts)",
                   err=True)
        costs = profile_rounds(engine, progress=lambda m: typer.echo(f"spire serve: profile: {m}", err=True))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"identity": ident, "costs": costs.to_dict()}, indent=1))
        tmp.replace(path)
    acceptance = Acceptance(len(engine.drafts), engine.k, [alpha_prior] * len(engine.drafts))
    return MeasuredPolicy([d.name for d in engine.drafts], costs, acceptance)


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
    from spire.memory_plan import check_fits, device_memory, memory_source, serve_planner
    from spire.loading import read_model_config, resolve_checkpoint

    memory = device_memory(device, stated)
    if memory is None:
        return
    cfg = read_model_config(resolve_checkpoint(target, progress=False))
    planner = serve_planner(cfg, min(max_len, cfg.max_positions), k, prefill_chunk, draft or registry.BASELINE,
                            draft_path)
    check_fits(planner, max_running, memory, device, memory_source(stated))


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
    draft: Annotated[Optional[str], typer.Option(help=(
        f"Draft: one of {', '.join(registry.names())}, or several comma-separated (a portfolio, e.g. ngram,spire: "
        "each round, each request drafts with the one the policy picks) [the newest trained SPIRe draft in the "
        "cache, else magicdec]."))] = None,
    draft_path: Annotated[Optional[str], typer.Option(help=draft_path_help())] = None,
    k: Annotated[int, typer.Option("--k", "-k", help=k_help("--max-len", "a slot", "Draft tokens per round (with a "
                                                                                   "policy: at most)"))]
    = defaults.K,
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
        "measured: per request the draft and k in 0..k (0 = none) that give the most tokens per second, from "
        "round costs timed on this machine and acceptance measured per draft and position (docs/serving.md). "
        "fixed: every round drafts k (a portfolio: the first draft that proposes). cost-model: one k per round "
        "from the paper's cost model and one alpha."))] = "measured",
    weights: Annotated[str, typer.Option(help="fp32, or bf16: weight-only bf16 on the CPU (as spire generate).")]
    = "fp32",
    draft_weights: Annotated[Optional[str], typer.Option(help=(
        "A trained draft's own weights: fp32, bf16 or int8; the output stays the target's [SPIRe, vanilla on a CPU "
        "with fp32 --weights: int8 (a draft step about 2x cheaper, docs/bench.md); else as --weights]."))]
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
    for flag, value, allowed in (("--k-policy", k_policy, ("measured", "fixed", "cost-model")),
                                 ("--weights", weights, WEIGHTS),
                                 ("--draft-weights", draft_weights or "fp32", (*WEIGHTS, "int8"))):
        if value not in allowed:
            raise ConfigError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
    draft_options = draft_options or {}
    portfolio = parse_drafts(draft, draft_path)
    if k_policy == "cost-model" and len(portfolio) > 1:
        raise ConfigError("--k-policy cost-model prices one draft; a portfolio needs --k-policy measured or fixed")
    # checked before the model loads; without --draft the kind is picked after it, and the note comes then
    for kd, _ in portfolio or [(None, None)]:
        draft_options_for(kd, draft_options, [kd for kd, _ in portfolio] if portfolio else list(registry.names()))
    check_bind(host, port)
    trained = next((kd for kd, p in portfolio if p), portfolio[-1][0] if portfolio else None)
    check_memory(target, device, device_memory, max_running, max_len, k, prefill_chunk, trained, draft_path)
    from spire.loading import load_target
    from spire.serving.api import Server, create_app, run, torch_thread
    from spire.engine.engine import Engine

    def build():
        model, tokenizer, _ = load_target(target, device=device, progress=False)
        if max_len > model.cfg.max_positions:
            typer.echo(f"warning: --max-len {max_len} is more than the target's {model.cfg.max_positions} positions; "
                       f"using {model.cfg.max_positions}", err=True)
        drafts, kind, why, formats = load_drafts(model, tokenizer, portfolio, draft_path, draft_options, weights,
                                                 draft_weights)
        policy = None
        if k_policy == "cost-model" and drafts:
            policy = cost_model_policy(model, drafts[0], k, weights, formats[0])
        eos = set(model.cfg.eos_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        engine = Engine(model, drafts or None, k=k, max_running=max_running,
                        max_len=min(max_len, model.cfg.max_positions), eos_ids=sorted(eos),
                        decode=tokenizer.decode, k_policy=policy, prefill_chunk=prefill_chunk or None)
        if k_policy == "measured" and drafts:
            engine.scheduler.k_policy = policy = measured_policy(engine, target, weights, formats)
        return engine, tokenizer, kind, why, policy, formats

    runner = torch_thread()  # every torch call of the server on one thread (api.torch_thread says why)
    engine, tokenizer, kind, why, policy, formats = runner.submit(build).result()
    server = Server(engine, tokenizer, target, kind, max_waiting=max_waiting, api_key=api_key, runner=runner,
                    max_request_bytes=max_request_bytes)
    how = {"measured": " at most, per request by measured costs and acceptance",
           "cost-model": " chosen per round by the cost model"}.get(k_policy, "") if policy else ""
    own = weights_note(engine.drafts, formats)
    why = f"{why}; {own}" if own else why
    typer.echo(f"spire serve: target {target}, draft {kind} ({why}), k {engine.k}{how}, {max_running} slots x "
               f"{engine.max_len} positions, at most {max_waiting} waiting, prefill "
               f"{f'in chunks of {prefill_chunk} tokens' if prefill_chunk else 'whole'}; http://{host}:{port}/v1",
               err=True)
    run(create_app(server), host, port, graceful_s=shutdown_grace, log_level=log_level,
        abort_all=server.loop.abort_all)
