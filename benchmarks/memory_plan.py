"""The memory plan (spire.memory_plan) against the peak measured on CPU, for `spire train` and `spire serve` settings.

Each setting runs in a fresh process: after importing torch and spire it reads its resident set (VmRSS), then
builds a SmolLM2-135M-shaped target (float32, random weights: memory does not depend on the values; no checkpoint
read, whose file buffers would count), and

- train: builds the SPIRe draft of the main recipe (or as set), its AdamW, and runs ``--steps`` training steps
  (the live target's teacher batch, the loss, backward, clip, AdamW) at the setting's batch and length, its
  attention as ``--attention`` says (default: SDPA's math backend, the attention the plan counts);
- serve: an engine of the setting's slots and positions with a MagicDec draft, every slot given a prompt of
  ``prompt`` tokens and decoded for ``G`` tokens;

then reads the process's peak resident set (VmHWM). measured = VmHWM − VmRSS before the target was built. The
plan is computed from the same settings before anything is built. SPIRE_KERNELS=0 (set here) keeps the CPU's
native kernels and their packed weight copies out, so the CPU runs the torch path a GPU runs, and
MALLOC_MMAP_THRESHOLD_=65536 (set here) has glibc map every allocation of 64 KiB or more on its own and unmap it
when freed, so the resident set follows the bytes torch holds (as torch.cuda.max_memory_allocated does on a GPU)
instead of the heap's fragments.

    python benchmarks/memory_plan.py --out measurements/memory-plan-cpu/memory_plan.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py
from _provenance import write_provenance  # noqa: E402

TRAIN = [dict(batch=2, seq_len=64), dict(batch=8, seq_len=128), dict(batch=16, seq_len=256)]
SERVE = [dict(slots=2, max_len=512, prompt=64, G=8), dict(slots=8, max_len=2048, prompt=256, G=8),
         dict(slots=16, max_len=4096, prompt=512, G=8)]


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def one(kind: str, s: dict, steps: int, attention: str = "math") -> dict:
    import torch

    from spire.bench.run import SMOLLM2_CONFIG
    from spire.memory_plan import serve_plan, train_planner
    from spire.model import ModelConfig, Transformer

    cfg = ModelConfig(**SMOLLM2_CONFIG)
    torch.manual_seed(0)
    if kind == "train":
        import numpy as np
        import types

        from spire.pipeline import ReproduceConfig, spire_architecture
        from spire.training.distill import TrainConfig, _build_model, make_optimizer, step_loss
        from spire.training.sources import run_target

        arch = spire_architecture(ReproduceConfig(), cfg.n_layers, cfg.vocab_size)
        tc = TrainConfig(batch_size=s["batch"], seq_len=s["seq_len"], draft_config=arch, bf16=False)
        plan = train_planner(cfg, tc)(s["batch"])
        base = rss("VmRSS")
        target = Transformer(cfg).eval().requires_grad_(False)
        data = types.SimpleNamespace(train=types.SimpleNamespace(tokens=np.arange(cfg.vocab_size)))
        model = _build_model(target, tc, data)
        if attention == "math":  # the attention the plan counts (a GPU's SDPA; meta decomposes it to math)
            from spire import backend

            backend.use(model, backend.of(model).replace(grouped_attention=False))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(params, tc)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def ctx():
            return sdpa_kernel(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()

        for step in range(steps):
            tokens = torch.randint(0, cfg.vocab_size, (s["batch"], s["seq_len"]),
                                   generator=torch.Generator().manual_seed(step))
            tb = run_target(target, tokens, model.target_layers(), True, False)
            with ctx():
                loss, _ = step_loss(model, target, tb, tc)
                opt.zero_grad(set_to_none=True)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
            opt.step()
            del tb, loss
    else:
        from spire.drafts.magicdec import MagicDecDraft
        from spire.engine.engine import Engine, drain
        from spire.params import RequestParams

        plan = serve_plan(cfg, s["slots"], s["max_len"], 4, 512, "magicdec")
        base = rss("VmRSS")
        target = Transformer(cfg).eval().requires_grad_(False)
        engine = Engine(target, MagicDecDraft(1, 64), k=4, max_running=s["slots"], max_len=s["max_len"],
                        prefill_chunk=512)
        g = torch.Generator().manual_seed(0)
        ids = [engine.add_request(torch.randint(0, cfg.vocab_size, (s["prompt"],), generator=g).tolist(),
                                  RequestParams(max_tokens=s["G"])) for _ in range(s["slots"])]
        drain(engine, ids)
    measured = rss("VmHWM") - base
    return {"command": kind, "settings": s, "attention": attention if kind == "train" else None, "plan_bytes": plan.total, "plan_parts": plan.parts,
            "measured_peak_bytes": measured, "plan_over_measured": plan.total / measured}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the rows here as JSON")
    ap.add_argument("--steps", type=int, default=2, help="training steps per train setting")
    ap.add_argument("--quick", action="store_true", help="the smallest setting of each command only")
    ap.add_argument("--attention", choices=("math", "grouped"), default="math", help=(
        "the draft's training attention on the CPU: math (SDPA's math backend, what a GPU's SDPA computes and what "
        "the plan counts on the meta device) or grouped (the CPU's own, spire.model.grouped_attention, which keeps "
        "fewer bytes)"))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        kind, s = json.loads(a.one)
        print(json.dumps(one(kind, s, a.steps, a.attention)))
        return
    env = {**os.environ, "SPIRE_KERNELS": "0", "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    rows = []
    settings = [("train", s) for s in TRAIN] + [("serve", s) for s in SERVE]
    if a.quick:
        settings = [("train", TRAIN[0]), ("serve", SERVE[0])]
    for kind, s in settings:
        proc = subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--attention", a.attention,
                               "--one", json.dumps([kind, s])],
                              env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{kind} {s}: failed\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(f"{kind:5s} {json.dumps(s):60s} plan {r['plan_bytes'] / 2**20:8.1f} MiB  measured "
              f"{r['measured_peak_bytes'] / 2**20:8.1f} MiB  plan/measured {r['plan_over_measured']:.3f}", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"rows": rows, "command": " ".join(sys.argv)}, indent=1))
        write_provenance(a.out.parent)


if __name__ == "__main__":
    main()
