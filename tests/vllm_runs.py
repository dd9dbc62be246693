"""Runs of vLLM's engine in one process, for tests/test_vllm.py: run by .venv-vllm's Python, not by pytest.

    python tests/vllm_runs.py SPEC.json OUT.json

SPEC is {"model": folder, "runs": [run, ...]}; each run is {"name", "speculative_config" (the dict an export's
``vllm_speculative_config.json`` holds, or null), "greedy" (token-id prompts, or null), "sampled" (token-id prompts
at T = 1 with seed 0, or null), "new" (tokens a prompt)}. The runs go one after another through
``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine and worker here, vLLM imported once),
with the settings of a served target (float32, eager, no prefix caching, 2 GiB of KV cache); spire's vLLM plugin
loads as it does in ``vllm serve``. OUT is {name: {"tokens", "metrics", "tokens_t1", "metrics_t1"}} for runs that
started, with "error" (the exception's text, beside what was collected before it) where a request failed, and
{name: {"error": the start-up exception's text}} for runs whose engine did not: the speculative-decoding
counters are vLLM's (drafts, draft tokens, accepted tokens, accepted per drafted position), those of the greedy
requests and those of the sampled ones apart. OUT is written after every run.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
"""Set by :func:`main` before vLLM is imported (not at import: tests/test_vllm.py imports :func:`minus`)."""


def spec_metrics(llm, k: int) -> dict:
    """vLLM's speculative-decoding counters so far: drafts, draft_tokens, accepted_tokens, per_pos (k values)."""
    m = {"per_pos": [0.0] * k}
    for metric in llm.get_metrics():
        if not metric.name.startswith("vllm:spec_decode_num_"):
            continue
        name = metric.name.removeprefix("vllm:spec_decode_num_")
        if name == "accepted_tokens_per_pos":
            m["per_pos"] = [a + b for a, b in zip(m["per_pos"], metric.values)]
        else:
            m[name] = m.get(name, 0.0) + metric.value
    return m


def minus(after: dict, before: dict) -> dict:
    """Counters of :func:`spec_metrics` accrued between two readings."""
    return {k: ([a - b for a, b in zip(v, before[k])] if k == "per_pos" else v - before.get(k, 0.0))
            for k, v in after.items()}


def one_run(model: str, run: dict) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    spec = run.get("speculative_config")
    k = spec["num_speculative_tokens"] if spec else 1
    try:
        llm = LLM(model=model, dtype="float32", max_model_len=2048, enforce_eager=True, enable_prefix_caching=False,
                  seed=0, speculative_config=spec, disable_log_stats=False)
    except Exception as e:  # noqa: BLE001 - the start-up failure is the result the test reads
        _cleanup()
        return {"error": "".join(traceback.format_exception(e))}
    out: dict = {}
    try:  # a request-time failure is the run's result too, with what it collected before
        if run.get("greedy"):
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in run["greedy"]],
                               SamplingParams(temperature=0.0, max_tokens=run["new"]), use_tqdm=False)
            out["tokens"] = [list(r.outputs[0].token_ids) for r in res]
        before = spec_metrics(llm, k) if spec else None
        out["metrics"] = before
        if run.get("sampled"):
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in run["sampled"]],
                               SamplingParams(temperature=1.0, max_tokens=run["new"], ignore_eos=True, seed=0),
                               use_tqdm=False)
            out["tokens_t1"] = [list(r.outputs[0].token_ids) for r in res]
            if spec:
                out["metrics_t1"] = minus(spec_metrics(llm, k), before)
    except Exception as e:  # noqa: BLE001
        out["error"] = "".join(traceback.format_exception(e))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        _cleanup()
    return out


def _cleanup() -> None:
    """Free what an engine left (its process group, its memory), so that the next one starts as in a fresh process."""
    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def main(spec_path: str, out_path: str) -> None:
    os.environ.update(ENV)
    spec = json.loads(open(spec_path).read())
    results: dict = {}
    for run in spec["runs"]:
        print(f"vllm_runs: {run['name']}", file=sys.stderr, flush=True)
        results[run["name"]] = one_run(spec["model"], run)
        with open(out_path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
