"""The kill-and-resume suite (issue 52, item 7): `spire train` killed with SIGKILL at random points, 20 times across
SPIRe, EAGLE-3 and vanilla runs -- during a checkpoint write, during the export's write, during the target cache's
build and at random instants -- each run resumed with `spire train --resume` until it ends. Then:

- the final weights (checkpoint draft file, AdamW state, exported draft) are bit-identical in float32 (one process,
  one thread) to those of an uninterrupted run of the same seed, trained with its own target cache;
- nothing outside the run folder changed (the target's folder, the text, any file beside them);
- the run's log holds each step once.

Tiny settings (a 3-layer random Llama with SmolLM2's tokenizer, 16 steps of 2 x 16 tokens): 2 min 24 s of CPU time
(measured; most of it the ~45 process starts, each importing torch), so about 3 minutes on 2 idle cores (9 min 41 s
on a 2-core machine shared by five jobs). ``pytest -m kill_resume`` runs it alone, ``-m "not kill_resume"`` skips
it."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import spire

ROOT = Path(__file__).resolve().parents[1]
SPIRE_PATH = str(Path(spire.__file__).resolve().parents[1])  # the processes run the spire this test imported
STEPS = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "vocab.json", "merges.txt")
KINDS = {  # kind -> (its options, the kill points of its interrupted run, in order)
    "spire": (["--n-draft-layers", "1", "--window", "8", "--target-cache", "float32", "--cache-steps", "4"],
              ["cache", "checkpoint", "random", "export", "checkpoint", "random", "checkpoint"]),
    "eagle3": (["--eagle3-layers", "0,1,2", "--eagle3-vocab", "512", "--target-cache", "float32", "--cache-steps", "4"],
               ["cache", "random", "checkpoint", "export", "random", "checkpoint", "checkpoint"]),
    "vanilla": (["--vanilla-layers", "1"],
                ["random", "checkpoint", "export", "random", "checkpoint", "random"]),
}
pytestmark = [pytest.mark.kill_resume, pytest.mark.slow]


@pytest.fixture(scope="module")
def workspace(smollm2, tmp_path_factory):
    """A folder with the user's things: a tiny HF target (SmolLM2's tokenizer) and a folder of text."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from spire.loading import resolve_checkpoint

    root = tmp_path_factory.mktemp("kill-resume")
    src, target = resolve_checkpoint(progress=False), root / "target"
    target.mkdir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, target / name)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                                 tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1,
                                 eos_token_id=2)).save_pretrained(target)
    text = root / "text"
    text.mkdir()
    words = "river stone light garden window morning letter quiet market winter bridge paper orange".split()
    for n in range(6):
        (text / f"notes{n}.txt").write_text("\n\n".join(
            " ".join(words[(i * 5 + j * 3 + n) % len(words)] for j in range(50)) + "." for i in range(10)))
    (root / "runs").mkdir()
    (root / "runs" / "keep.txt").write_text("a file beside the run folders")
    return root


def _snapshot(root: Path, skip: set[Path]) -> dict[str, tuple[bytes, int]]:
    """Every file under root outside ``skip`` (folders): its bytes and modification time."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not any(s == p or s in p.parents for s in skip):
            out[str(p.relative_to(root))] = (p.read_bytes(), p.stat().st_mtime_ns)
    return out


def _command(workspace: Path, kind: str, out: Path, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "spire.cli", "train", "--out", str(out), "--target", str(workspace / "target"),
           "--data", str(workspace / "text"), "--device", "cpu"]
    if resume:
        return cmd + ["--resume"]
    return cmd + ["--draft", kind, "--max-steps", str(STEPS), "--batch-size", "2", "--seq-len", "16", "-k", "4",
                  "--eval-windows", "2", "--eval-every", "0", "--no-bf16", "--warmup-steps", "2",
                  "--checkpoint-every", "0", "--lr", "3e-3", "--seed", "7", *KINDS[kind][0]]


def _env(cache: Path) -> dict:
    return {**os.environ, "SPIRE_CACHE": str(cache), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([SPIRE_PATH, os.environ.get("PYTHONPATH", "")]),
            "TOKENIZERS_PARALLELISM": "false"}


def _trained(out: Path) -> int:
    """The number of train lines in the run's log (0 when it has none)."""
    log = out / "train_log.jsonl"
    return log.read_text().count('"event": "train"') if log.is_file() else 0


def _seen(point: str, out: Path, cache: Path, base: int) -> bool:
    """Whether the run is now at ``point``: a checkpoint folder or an exported draft being written (their temporary
    names), the target cache being built (its ``.partial`` folder), or (random) training, a step past ``base``."""
    names = os.listdir(out) if out.is_dir() else []
    if point == "checkpoint":
        return any(n.startswith(".checkpoint.") for n in names)
    if point == "export":
        return any(n.startswith((".draft.", ".eagle3.")) for n in names)
    if point == "cache":
        tc = cache / "target-cache"
        return tc.is_dir() and any(n.endswith(".partial") for n in os.listdir(tc))
    return _trained(out) > base


def _kill_at(cmd, env, point: str, out: Path, cache: Path, rng: random.Random) -> bool:
    """Start the command and SIGKILL it at ``point`` (random: a random instant within 0.15 s after its first step);
    True when it was killed there, False when it ended first."""
    base = _trained(out)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while proc.poll() is None:
            if _seen(point, out, cache, base):
                time.sleep(rng.uniform(0.0, 0.004 if point != "random" else 0.15))
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return True
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read().decode()[-2000:]
    return False


def _final(out: Path) -> tuple[dict, dict, dict]:
    """(checkpoint draft tensors, AdamW state, exported draft's tensors) of a finished run folder."""
    from safetensors.torch import load_file

    export = next(p for p in (out / "draft.safetensors", out / "draft" / "model.safetensors",
                              out / "eagle3" / "model.safetensors") if p.is_file())
    return (load_file(out / "checkpoint" / "draft.safetensors"),
            torch.load(out / "checkpoint" / "optimizer.pt", weights_only=True)["state"], load_file(export))


def _equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(_equal(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a)


def test_sigkill_at_random_points_then_resume_is_bit_identical(workspace, tmp_path):
    rng = random.Random(52)
    runs, caches = workspace / "runs", tmp_path
    before = _snapshot(workspace, {runs / "killed-spire", runs / "killed-eagle3", runs / "killed-vanilla",
                                   runs / "whole-spire", runs / "whole-eagle3", runs / "whole-vanilla"})
    kills: list[tuple[str, str]] = []
    for kind in KINDS:
        out, cache = runs / f"killed-{kind}", caches / f"cache-killed-{kind}"
        env = _env(cache)
        for i, point in enumerate(KINDS[kind][1]):
            resume = (out / "checkpoint").is_dir() or (out / "checkpoint.old").is_dir()
            if _kill_at(_command(workspace, kind, out, resume), env, point, out, cache, rng):
                kills.append((kind, point))
        while True:  # resume to the end
            r = subprocess.run(_command(workspace, kind, out, (out / "checkpoint").is_dir()
                                        or (out / "checkpoint.old").is_dir()), env=env, cwd=ROOT,
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stderr[-2000:]
            if json.loads((out / "checkpoint" / "train_state.json").read_text())["finished"]:
                break
        whole = runs / f"whole-{kind}"
        r = subprocess.run(_command(workspace, kind, whole, False), env=_env(caches / f"cache-whole-{kind}"), cwd=ROOT,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        got, want = _final(out), _final(whole)
        for name, a, b in zip(("checkpoint draft", "AdamW state", "exported draft"), got, want):
            assert _equal(a, b), f"{kind}: the {name} differs from the uninterrupted run's"
        rows = [json.loads(ln) for ln in (out / "train_log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if r["event"] == "train"] == list(range(1, STEPS + 1)), kind
        assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [], kind  # no temporary left
    assert _snapshot(workspace, {runs / n for n in os.listdir(runs) if n != "keep.txt"}) == before
    points = [p for _, p in kills]
    assert len(kills) >= 20 and {"cache", "checkpoint", "export", "random"} <= set(points), kills
