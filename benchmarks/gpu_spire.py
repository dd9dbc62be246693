"""SPIRe at scale on one accelerator, in one short run: target cache, training, τ (MagicDec vs SPIRe).

The main job's draft (the target's first 2 + last 6 blocks, a 16,384-token draft vocabulary, sink 1 + window 64)
trained for ``--budget`` seconds at a large batch under bf16 autocast, from a target cache of ``--cache-steps``
batches built first; then τ of MagicDec and of the trained draft on the same held-out contexts at T = 0 and 1,
with the paired 95 % CI of their ratio. Writes ``OUT/gpu_spire.json`` and ``OUT/GPU_SPIRE.md``; the trained draft
is ``OUT/run/draft.safetensors`` (``benchmarks/gpu_bench.sh`` passes it to ``spire bench``).

    python benchmarks/gpu_spire.py --out gpu-out                        # H200: about 7 minutes
    python benchmarks/gpu_spire.py --device cpu --tiny --out /tmp/dry  # CPU dry run of the same path (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from spire.data import document_separator_id, prepare_data
from spire.drafts.magicdec import MagicDecDraft
from spire.drafts.spire import SpireDraft
from spire.evaluation.tau import measure_tau_shared, paired_ratio_ci
from spire.loading import load_target
from spire.paths import atomic_write
from spire.pipeline import ReproduceConfig, spire_architecture
from spire.sampling import SamplingParams
from spire.training.distill import TrainConfig, train_draft

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import write_provenance  # benchmarks/_provenance.py


def main() -> None:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        """The module docstring as written, and every option's default in its help."""

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--device", default="cuda", help="torch device")
    ap.add_argument("--budget", type=float, default=300.0, help="training seconds")
    ap.add_argument("--batch-size", type=int, default=64, help="training rows per step")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per training row")
    ap.add_argument("--cache-steps", type=int, default=64, help="batches in the target cache (epochs over them)")
    ap.add_argument("--lr", type=float, default=2e-3, help="AdamW peak learning rate")
    ap.add_argument("--n-contexts", type=int, default=64, help="held-out contexts for tau")
    ap.add_argument("-L", type=int, default=512, help="context length for tau (tokens)")
    ap.add_argument("-G", type=int, default=64, help="tokens generated per context")
    ap.add_argument("--compile", action="store_true", help="the training step through torch.compile (spire train "
                    "--compile; its compile time is outside --budget)")
    ap.add_argument("--tiny", action="store_true", help="dry-run settings: a few seconds of everything")
    ap.add_argument("--out", type=Path, default=Path("gpu-spire-out"), help="output folder")
    a = ap.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device (use --device cpu for a dry run)")
    if a.tiny:
        a.budget, a.batch_size, a.seq_len, a.cache_steps, a.n_contexts, a.L, a.G = 5.0, 2, 64, 2, 2, 64, 8
    t_start = time.time()
    target, tokenizer, folder = load_target(device=a.device, progress=False)
    data = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), progress=False)
    arch = spire_architecture(ReproduceConfig(), target.cfg.n_layers, target.cfg.vocab_size)
    cfg = TrainConfig(budget_s=a.budget, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, bf16=None,
                      draft_config=arch, data_steps=a.cache_steps, target_cache="bfloat16", eval_every=0,
                      checkpoint_every=1e9, compile=a.compile)
    heldout = data.heldout_contexts(max(a.seq_len - 64, a.seq_len // 2), min(64, a.seq_len // 2), 16, seed=1)
    t0 = time.time()
    model, state = train_draft(target, data, a.out / "run", cfg, heldout=heldout, target_folder=folder,
                               progress=True)
    train_s = time.time() - t0
    contexts = data.heldout_contexts(a.L, a.G, a.n_contexts, seed=0)[:, : a.L]
    drafts = {"magicdec": MagicDecDraft(1, 64), "spire": SpireDraft(model)}
    taus = {}
    for T in (0.0, 1.0):
        res = measure_tau_shared(target, drafts, contexts, G=a.G, k=4, params=SamplingParams(T),
                                 batch_size=min(a.n_contexts, 32), progress=False)
        arrays = [np.asarray(x, dtype=float) for x in (res["spire"].emitted, res["spire"].rounds,
                                                       res["magicdec"].emitted, res["magicdec"].rounds)]
        taus[f"T={T:g}"] = {name: r.to_dict() for name, r in res.items()}
        taus[f"T={T:g}"]["spire_over_magicdec"] = [res["spire"].tau / res["magicdec"].tau,
                                                   *paired_ratio_ci(*arrays)]
    out = {"device": str(target.device), "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else None,
           "torch": torch.__version__, "args": {k: str(v) for k, v in vars(a).items()},
           "spire_layers": list(arch.source_layers(target.cfg.n_layers)), "draft_vocab": arch.vocab_size,
           "train": {"steps": state["step"], "tokens": state["tokens"], "train_s": train_s,
                     "tokens_per_s": state["tokens"] / max(state["elapsed_s"], 1e-9),
                     "heldout_alpha_per_position": state["heldout"]["alpha_per_position"]},
           "tau": taus, "total_s": time.time() - t_start}
    atomic_write(a.out / "gpu_spire.json", None, json.dumps(out, indent=1))
    write_provenance(a.out)
    lines = [f"# SPIRe on {out['gpu'] or out['device']}", "",
             f"Draft: target layers {out['spire_layers']}, draft vocabulary {arch.vocab_size}; trained "
             f"{state['step']} steps x {a.batch_size} x {a.seq_len} = {state['tokens']:,} tokens in {train_s:.0f} s "
             f"(target cache of {a.cache_steps} batches built first, bf16 autocast: "
             f"{out['train']['tokens_per_s']:,.0f} training tokens/s); held-out α by drafted position "
             + ", ".join(f"{x:.3f}" for x in out["train"]["heldout_alpha_per_position"]) + ".", "",
             f"τ on {a.n_contexts} held-out contexts, L = {a.L}, G = {a.G}, k = 4 (95 % CI):", "",
             "| T | MagicDec | SPIRe | SPIRe / MagicDec (paired CI) |", "|---|---|---|---|"]
    for key, t in taus.items():
        r = t["spire_over_magicdec"]
        lines.append(f"| {key[2:]} | {t['magicdec']['tau']:.3f} [{t['magicdec']['ci_low']:.2f}, "
                     f"{t['magicdec']['ci_high']:.2f}] | {t['spire']['tau']:.3f} [{t['spire']['ci_low']:.2f}, "
                     f"{t['spire']['ci_high']:.2f}] | {r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}] |")
    atomic_write(a.out / "GPU_SPIRE.md", None, "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {a.out / 'gpu_spire.json'} ({out['total_s']:.0f} s in all)")


if __name__ == "__main__":
    main()
