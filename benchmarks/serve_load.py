"""Load on an OpenAI-compatible server: `spire serve` with each draft, and llama.cpp's `llama-server` as the CPU
anchor, on the same prompts (held-out text, mixed lengths), at several concurrencies.

    python benchmarks/serve_load.py --out OUT [--concurrency 1,2,4,8,16] [--requests 16] [--max-tokens 64]
        [--servers "ad=spire serve --draft none" "magicdec=spire serve --draft magicdec" ...]
        [--llama-server PATH --gguf FILE]   # built by benchmarks/llama_server.sh
        [--threads 2] [--faults SECONDS]

Each server is started by this script (one at a time, on a free port, with OMP_NUM_THREADS / -t set to
--threads), warmed up, then at each concurrency c it runs requests from c closed-loop clients
(each sends its next request when the previous one ends); ``max(--requests, c)`` requests per level. Prompts are token ids (the SmolLM2 tokenizer, which both
servers share), log-uniform 128-2048 tokens, cut from held-out documents of spire's text (never trained on); every
request is greedy with ``ignore_eos`` and streams, so it generates exactly --max-tokens tokens.

Per server and concurrency it reports: output tokens/s (completion tokens / wall time of the level), time to first
token (median, p90), inter-token latency ((last - first token time) / (tokens - 1), median), and for spire τ (from
/metrics: tokens per request-round over the level). results.json holds every number, results.md a table, and the
ratios the issue asks for (server AD against `spire generate`'s static batch of --static prompts, timed here).

--faults S: after the levels, S seconds of concurrency-16 load on one spire server mixed with malformed
requests, clients that disconnect mid-stream and floods past --max-waiting; it reports the server's RSS after
warm-up and after the load, requests that never finished, and the status codes seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import portable, portable_log, write_provenance  # benchmarks/_provenance.py


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def heldout_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n prompts of token ids, lengths log-uniform in [lo, hi], each the start of a held-out window."""
    from transformers import AutoTokenizer

    from spire.data import document_separator_id, prepare_data
    from spire.loading import resolve_checkpoint

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint(progress=False))
    data = prepare_data(tok, eos_id=document_separator_id(tok), progress=False)
    wins = data.heldout_contexts(hi, 0, n, seed=seed)
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(math.log(lo), math.log(hi), n)).astype(int)
    return [wins[i, : int(lengths[i])].tolist() for i in range(n)]


class Launched:
    """A server process started from a command line; ``kind`` "spire" or "llama"."""

    def __init__(self, name: str, cmd: list[str], port: int, threads: int, log: Path) -> None:
        self.name, self.port, self.base = name, port, f"http://127.0.0.1:{port}"
        self.kind = "llama" if "llama-server" in cmd[0] else "spire"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        t0 = time.time()
        while time.time() - t0 < 600:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{name} did not become healthy in 600 s; see {log}")

    def rss_mb(self, field: str = "VmRSS") -> float:
        """The server's resident set (VmRSS), or with field="VmHWM" its peak so far, MB; read two seconds after the
        last response, when the server is idle (spire's engine gives its heap's free pages back after half a
        second idle)."""
        if field == "VmRSS":
            time.sleep(2)
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def metrics(self) -> dict[str, float]:
        if self.kind != "spire":
            return {}
        out: dict[str, float] = {}
        for line in httpx.get(self.base + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                key = name if "reason" in name or "k=" in name else name.split("{")[0]
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        portable_log(Path(self.log.name))


async def one_request(client: httpx.AsyncClient, server: Launched, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    if server.kind == "llama":
        body.update({"n_predict": max_tokens, "cache_prompt": False})
    t0 = time.perf_counter()
    times, chunks = [], 0
    # a fresh connection per request: llama-server closes a kept-alive connection after a few requests, and a
    # POST sent on it as it closes fails; the same for every server
    async with client.stream("POST", server.base + "/v1/completions", json=body,
                             headers={"Connection": "close"}) as r:
        if r.status_code != 200:
            await r.aread()
            return {"ok": False, "status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
                chunks += 1
    if not times:
        return {"ok": False, "status": 200}
    return {"ok": True, "ttft": times[0] - t0, "itl": (times[-1] - times[0]) / max(1, max_tokens - 1),
            "tokens": max_tokens, "end": times[-1]}


async def level(server: Launched, prompts: list[list[int]], concurrency: int, n: int, max_tokens: int) -> dict:
    queue = list(range(n))
    results: list[dict] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop(0)
            results.append(await one_request(client, server, prompts[i % len(prompts)], max_tokens))

    before = server.metrics()
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    after = server.metrics()
    ok = [r for r in results if r["ok"]]
    row = {"concurrency": concurrency, "requests": n, "ok": len(ok), "wall_s": wall,
           "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
           "ttft_median_s": statistics.median(r["ttft"] for r in ok) if ok else None,
           "ttft_p90_s": float(np.percentile([r["ttft"] for r in ok], 90)) if ok else None,
           "itl_median_s": statistics.median(r["itl"] for r in ok) if ok else None}
    if after:
        rounds = after.get("spire_request_rounds_total", 0) - before.get("spire_request_rounds_total", 0)
        gen = after.get("spire_generation_tokens_total", 0) - before.get("spire_generation_tokens_total", 0)
        row["tau"] = gen / rounds if rounds else None
        row["rounds"] = after.get("spire_rounds_total", 0) - before.get("spire_rounds_total", 0)
        by_k = {key.split('k="')[1].rstrip('"}'): v - before.get(key, 0) for key, v in after.items()
                if key.startswith("spire_rounds_by_k_total")}
        if by_k:
            row["rounds_by_k"] = by_k
    return row


async def faults(server: Launched, prompts: list[list[int]], seconds: float, max_tokens: int) -> dict:
    """Concurrency-16 load for ``seconds`` mixed with malformed requests, mid-stream disconnects and floods."""
    codes: dict[str, int] = {}
    stuck = 0
    rng = np.random.default_rng(5)
    deadline = time.perf_counter() + seconds
    bad_bodies = [b'{"model": "smollm2-135m", "prompt": ', b"\xff\xfe", b'{"prompt": "x", "max_tokens": -1}',
                  b'{"prompt": "x", "temperature": NaN}', b'{"prompt": [99999999]}', b'{"prompt": "x", "n": 3}']

    def count(key: str) -> None:
        codes[key] = codes.get(key, 0) + 1

    async def worker(client: httpx.AsyncClient, wid: int) -> None:
        nonlocal stuck
        while time.perf_counter() < deadline:
            r = rng.random()
            try:
                if r < 0.15:
                    resp = await client.post(server.base + "/v1/completions",
                                             content=bad_bodies[int(rng.integers(len(bad_bodies)))],
                                             headers={"content-type": "application/json"})
                    count(str(resp.status_code))
                elif r < 0.30:  # disconnect mid-stream
                    body = {"prompt": prompts[int(rng.integers(len(prompts)))], "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True}
                    async with client.stream("POST", server.base + "/v1/completions", json=body) as resp:
                        async for _ in resp.aiter_lines():
                            break
                    count("disconnect")
                elif r < 0.35:  # a flood of 100 small requests at once
                    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
                    rs = await asyncio.gather(*(client.post(server.base + "/v1/completions", json=body)
                                                for _ in range(100)), return_exceptions=True)
                    for x in rs:
                        count(type(x).__name__ if isinstance(x, Exception) else str(x.status_code))
                else:
                    res = await asyncio.wait_for(
                        one_request(client, server, prompts[int(rng.integers(len(prompts)))], max_tokens), 300)
                    count("ok" if res["ok"] else str(res["status"]))
            except asyncio.TimeoutError:
                stuck += 1
            except httpx.HTTPError as e:
                count(type(e).__name__)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_connections=400)) as client:
        await asyncio.gather(*(worker(client, w) for w in range(16)))
    await asyncio.sleep(2)
    m = server.metrics()
    return {"seconds": seconds, "codes": codes, "stuck_requests": stuck,
            "running_after": m.get("spire_requests_running"), "waiting_after": m.get("spire_requests_waiting")}


def static_batches(prompts: list[list[int]], batch: int, n: int, max_tokens: int, threads: int) -> dict:
    """spire.speculative.generate (the engine, every prompt of a batch joining at once; AD) over the first n prompts in batches of
    ``batch``, in this process with ``threads`` torch threads: output tokens/s including prefill."""
    import torch

    from spire.loading import load_target
    from spire.speculative import generate

    torch.set_num_threads(threads)
    model, _, _ = load_target("smollm2-135m", progress=False)
    generate(model, [prompts[0][:16]], 4)  # warm-up
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, n, batch):
        res = generate(model, prompts[i:i + batch], max_tokens)
        tokens += sum(len(t) for t in res.tokens)
    wall = time.perf_counter() - t0
    return {"batch": batch, "requests": n, "wall_s": wall, "output_tokens_per_s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=16, help="requests per level at least (the concurrency at least)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--servers", nargs="*", default=["ad=spire serve --draft none",
                                                     "magicdec=spire serve --draft magicdec"],
                    help="NAME=COMMAND; --port and --max-running are added to spire commands")
    ap.add_argument("--llama-server", help="llama-server binary (benchmarks/llama_server.sh)")
    ap.add_argument("--gguf", help="the F32 GGUF for llama-server")
    ap.add_argument("--faults", type=float, default=0.0, help="seconds of fault load on --faults-server")
    ap.add_argument("--faults-server", help="the spire server NAME of --servers that gets the fault load [the first]")
    ap.add_argument("--static", type=int, default=8,
                    help="also time spire generate's static AD batches of this size on the level's prompts (0: no)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="keep the servers already in OUT/results.json")
    a = ap.parse_args()
    try:
        levels = [int(c) for c in a.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency must be a comma-separated list of integers, got {a.concurrency!r}")
    for flag, v in (("--concurrency", min(levels)), ("--requests", a.requests), ("--max-tokens", a.max_tokens),
                    ("--min-prompt", a.min_prompt), ("--threads", a.threads)):
        if v < 1:
            ap.error(f"{flag} must be >= 1, got {v}")
    if a.max_prompt < a.min_prompt:
        ap.error(f"--max-prompt ({a.max_prompt}) must be >= --min-prompt ({a.min_prompt})")
    if a.faults < 0 or a.static < 0:
        ap.error("--faults and --static must be >= 0")
    if any("=" not in spec for spec in a.servers):
        ap.error("each of --servers must be NAME=COMMAND")
    if a.faults_server and a.faults_server not in [spec.split("=", 1)[0] for spec in a.servers]:
        ap.error(f"--faults-server {a.faults_server!r} is not a NAME of --servers")
    a.out.mkdir(parents=True, exist_ok=True)
    n_prompts = max(max(a.requests, c) for c in levels)
    prompts = heldout_prompts(n_prompts, a.min_prompt, a.max_prompt, a.seed)
    slots = max(levels)
    max_len = a.max_prompt + a.max_tokens + 16
    servers = []
    for spec in a.servers:
        name, cmd = spec.split("=", 1)
        servers.append((name, shlex.split(cmd) + ["--max-running", str(slots), "--max-len", str(max_len)]))
    if a.llama_server:
        if not a.gguf:
            sys.exit("error: --llama-server needs --gguf")
        servers.append(("llama-server", [a.llama_server, "-m", a.gguf, "-t", str(a.threads), "-tb", str(a.threads),
                                         "-np", str(slots), "-c", str(slots * max_len), "-ngl", "0",
                                         "--no-warmup"]))
    results = json.loads((a.out / "results.json").read_text()) if a.resume and (a.out / "results.json").is_file() \
        else None
    results = results or {"config": {**{k: str(v) for k, v in vars(a).items()}, "prompt_lengths": [len(p) for p in prompts],
                          "host": os.uname().nodename, "cpus": os.cpu_count()}, "servers": {}}
    for name, cmd in servers:
        port = free_port()
        cmd = cmd + ["--port", str(port)]
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        srv = Launched(name, cmd, port, a.threads, a.out / f"{name}.log")
        try:
            asyncio.run(level(srv, prompts, 1, 2, 8))  # warm-up
            rss_warm = srv.rss_mb()
            rows = []
            for c in levels:
                row = asyncio.run(level(srv, prompts, c, max(a.requests, c), a.max_tokens))
                rows.append(row)
                print(f"{name} c={c}: {row['output_tokens_per_s']:.1f} tok/s, TTFT {row['ttft_median_s']:.2f} s, "
                      f"ITL {1000 * row['itl_median_s']:.1f} ms" + (f", tau {row['tau']:.2f}" if row.get("tau") else ""),
                      flush=True)
            entry = {"command": [portable(str(x)) for x in cmd], "levels": rows, "rss_mb_after_warmup": rss_warm,
                     "rss_mb_after_levels": srv.rss_mb(),
                     "rss_peak_mb_after_levels": srv.rss_mb("VmHWM")}
            if a.faults and srv.kind == "spire" and (name == a.faults_server or a.faults_server is None
                                                     and "faults" not in json.dumps(results["servers"])):
                entry["faults"] = asyncio.run(faults(srv, prompts, a.faults, a.max_tokens))
                entry["faults"]["rss_mb_after"] = srv.rss_mb()
                entry["faults"]["rss_peak_mb"] = srv.rss_mb("VmHWM")
                print(f"{name} faults: {entry['faults']}", flush=True)
            results["servers"][name] = entry
        finally:
            srv.stop()
        (a.out / "results.json").write_text(json.dumps(results, indent=1))
    if a.static and a.static in levels:
        n = max(a.requests, a.static)
        results["static"] = static_batches(prompts, a.static, n, a.max_tokens, a.threads)
        print(f"spire generate, static AD batches of {a.static}: {results['static']['output_tokens_per_s']:.1f} tok/s",
              flush=True)
        (a.out / "results.json").write_text(json.dumps(results, indent=1))
    table = ["| server | c | tok/s | TTFT median (s) | TTFT p90 (s) | ITL median (ms) | τ |", "|---|---|---|---|---|---|---|"]
    for name, e in results["servers"].items():
        for r in e["levels"]:
            table.append(f"| {name} | {r['concurrency']} | {r['output_tokens_per_s']:.1f} | {r['ttft_median_s']:.2f} | "
                         f"{r['ttft_p90_s']:.2f} | {1000 * r['itl_median_s']:.1f} | "
                         f"{r['tau']:.2f} |" if r.get("tau") else f"| {name} | {r['concurrency']} | "
                         f"{r['output_tokens_per_s']:.1f} | {r['ttft_median_s']:.2f} | {r['ttft_p90_s']:.2f} | "
                         f"{1000 * r['itl_median_s']:.1f} | |")
    (a.out / "results.md").write_text("\n".join(table) + "\n")
    write_provenance(a.out)
    print("\n".join(table))


if __name__ == "__main__":
    main()
