"""The prepared GPU run (issue 53, item 7) in one process, one JSON: environment, two SPIRe arms, τ, bench cells.

1. environment: torch, CUDA, the device and its memory, bf16 support, python, gguf, and the memory plan of the
   training setting (spire.memory_plan) against the device's free memory;
2. the target (``--target``: the embedded SmolLM2, or the GGUF joined from the carried parts) and the text
   (``--data``: a prepared token-data folder carried as arrays, spire.data.load_token_data; default: the local
   prepared registry text);
3. the main job's SPIRe draft (the target's first 2 + last 6 blocks, a 16,384-token draft vocabulary, sink 1 +
   window 64) trained for ``--budget`` seconds per arm at a large batch under bf16 autocast, from a target cache of
   ``--cache-steps`` batches (built once, shared by both arms): arm "spire" with the main recipe's loss
   (MixedLoss(0.5)), arm "spire_lk" with the negative log-acceptance loss (LK^α, arXiv 2602.23881; `--loss lk`);
4. τ of MagicDec and both arms on the same held-out contexts at T = 0 and T = 1, with the paired 95 % CI of each
   ratio (spire.evaluation.tau.paired_ratio_ci);
5. `spire bench`'s measured-vs-predicted cells (spire.bench.run.run_bench) at (B, L) = (64, 512), (64, 4096) and
   (16, 8000) in bf16, with MagicDec and both arms (the cost model on the paper's HOI 600 unless a calibration is
   given: none is measured here, to keep the run under 9 minutes).

Writes ``OUT/gpu_spire.json`` (every number) and ``OUT/GPU_SPIRE.md`` (the τ table); each arm's draft is
``OUT/run[-lk]/draft.safetensors``.

    python benchmarks/gpu_spire.py --out gpu-out                                   # H100: about 7 minutes
    python benchmarks/gpu_spire.py --device cpu --tiny --out /tmp/dry              # CPU dry run (tests/): tiny
                                                                                   # settings, a 10-layer random
                                                                                   # target with SmolLM2's vocabulary
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from spire.data import document_separator_id, load_token_data, prepare_data
from spire.drafts.magicdec import MagicDecDraft
from spire.drafts.spire import SpireDraft, SpireDraftModel
from spire.evaluation.tau import measure_tau_shared, paired_ratio_ci
from spire.loading import load_target, read_model_config
from spire.paths import atomic_write
from spire.pipeline import ReproduceConfig, spire_architecture
from spire.sampling import SamplingParams
from spire.training.distill import TrainConfig, train_draft

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import write_provenance  # noqa: E402  (benchmarks/_provenance.py)

ARMS = {"spire": "mixed", "spire_lk": "lk"}
"""Result name -> TrainConfig.loss of each SPIRe arm."""
CELLS = "64x512,64x4096,16x8000"


def tiny_target(folder: Path) -> Path:
    """A random 10-layer Llama folder (d 64, 4 query heads over 2 KV heads) with SmolLM2's tokenizer and
    vocabulary: the --tiny dry run's target, so that it runs every step of the GPU run in seconds on a CPU."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from spire.loading import resolve_checkpoint

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=10,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                          tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
        LlamaForCausalLM(cfg).save_pretrained(folder)
        AutoTokenizer.from_pretrained(resolve_checkpoint(progress=False)).save_pretrained(folder)
    return folder


def environment(device: str, cfg: TrainConfig, model_cfg) -> dict:
    """What the run found: versions, the device, its memory, and the training setting's memory plan."""
    from spire.memory_plan import device_memory, train_planner

    env = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
           "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    try:
        import gguf  # noqa: F401  (the carried wheel; the target's conversion needs it)

        env["gguf"] = "importable"
    except ImportError as e:
        env["gguf"] = f"missing: {e}"
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        env.update(gpu=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                   bf16_supported=torch.cuda.is_bf16_supported(), memory_free=free, memory_total=total)
    plan = train_planner(model_cfg, cfg)(cfg.batch_size)
    mem = device_memory(device)
    env["train_memory_plan"] = {**plan.to_dict(), "device_memory": mem,
                                "fits": None if mem is None else plan.total <= mem}
    return env


def main() -> None:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        """The module docstring as written, and every option's default in its help."""

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--device", default="cuda", help="torch device")
    ap.add_argument("--target", default="smollm2-135m", help="target: preset, .gguf file or HF folder")
    ap.add_argument("--data", type=Path, help="a prepared token-data folder (default: the local registry text)")
    ap.add_argument("--budget", type=float, default=120.0, help="training seconds per arm")
    ap.add_argument("--max-steps", type=int, help="also stop each arm after this many steps")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"arms to train, of {', '.join(ARMS)}")
    ap.add_argument("--batch-size", type=int, default=64, help="training rows per step")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per training row")
    ap.add_argument("--cache-steps", type=int, default=64, help="batches in the target cache (epochs over them)")
    ap.add_argument("--lr", type=float, default=2e-3, help="AdamW peak learning rate")
    ap.add_argument("--n-contexts", type=int, default=64, help="held-out contexts for tau")
    ap.add_argument("-L", type=int, default=512, help="context length for tau (tokens)")
    ap.add_argument("-G", type=int, default=64, help="tokens generated per context")
    ap.add_argument("--cells", default=CELLS, help="bench cells BxL,BxL,... ('' skips the bench)")
    ap.add_argument("--bench-G", type=int, default=32, help="tokens per row in each bench cell's AD and SD runs")
    ap.add_argument("--bench-reps", type=int, default=5, help="timed calls per t_* in the bench cells")
    ap.add_argument("--bench-dtype", default="bf16", choices=("bf16", "fp32"), help="the bench cells' dtype")
    ap.add_argument("--compile", action="store_true", help="the training step through torch.compile")
    ap.add_argument("--tiny", action="store_true", help="dry-run settings: a few seconds of everything")
    ap.add_argument("--out", type=Path, default=Path("gpu-spire-out"), help="output folder")
    a = ap.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device (use --device cpu for a dry run)")
    arms = [x for x in a.arms.split(",") if x]
    if not arms or any(x not in ARMS for x in arms):
        raise SystemExit(f"error: --arms takes names of {', '.join(ARMS)}, got {a.arms!r}")
    if a.tiny:
        a.budget, a.max_steps, a.batch_size, a.seq_len, a.cache_steps = 60.0, 1, 2, 64, 1
        a.n_contexts, a.L, a.G, a.bench_G, a.bench_reps = 2, 64, 4, 4, 1
        a.cells = "2x64" if a.cells == CELLS else a.cells
        if a.target == "smollm2-135m":  # (the GPU run's target: the dry run of gpu_bench.sh joins its GGUF)
            a.target = str(tiny_target(a.out / "tiny-target"))
    if a.device.startswith("cuda"):  # exactness where it is asked for; bf16 autocast where it is not
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    t_start = time.time()
    timings = {}
    target, tokenizer, folder = load_target(a.target, device=a.device, progress=False)
    data = (load_token_data(a.data) if a.data is not None else
            prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), progress=False))
    timings["load_s"] = time.time() - t_start
    arch = spire_architecture(ReproduceConfig(), target.cfg.n_layers, target.cfg.vocab_size)
    base = TrainConfig(budget_s=a.budget, max_steps=a.max_steps, batch_size=a.batch_size, seq_len=a.seq_len,
                       lr=a.lr, bf16=None, draft_config=arch, data_steps=a.cache_steps, target_cache="bfloat16",
                       eval_every=0, checkpoint_every=1e9, compile=a.compile)
    out = {"env": environment(str(target.device), base, read_model_config(folder)), "args": {
        k: str(v) for k, v in vars(a).items()}, "device": str(target.device),
        "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else None, "torch": torch.__version__,
        "spire_layers": list(arch.source_layers(target.cfg.n_layers)), "draft_vocab": arch.vocab_size}
    print(json.dumps(out["env"], indent=1), flush=True)
    heldout = data.heldout_contexts(max(a.seq_len - 64, a.seq_len // 2), min(64, a.seq_len // 2),
                                    2 if a.tiny else 16, seed=1)
    models = {}
    for name in arms:
        t0 = time.time()
        cfg = replace(base, loss=ARMS[name])
        model, state = train_draft(target, data, a.out / ("run" if name == "spire" else "run-lk"), cfg,
                                   heldout=heldout, target_folder=folder, progress=True)
        models[name] = model
        out["train" if name == "spire" else f"train_{name[6:]}"] = {
            "loss": ARMS[name], "steps": state["step"], "tokens": state["tokens"], "train_s": time.time() - t0,
            "tokens_per_s": state["tokens"] / max(state["elapsed_s"], 1e-9),
            "heldout_alpha_per_position": state["heldout"]["alpha_per_position"]}
        timings[f"train_{name}_s"] = time.time() - t0
    t0 = time.time()
    contexts = data.heldout_contexts(a.L, a.G, a.n_contexts, seed=0)[:, : a.L]
    drafts = {"magicdec": MagicDecDraft(1, 64), **{n: SpireDraft(m) for n, m in models.items()}}
    taus = {}
    for T in (0.0, 1.0):
        res = measure_tau_shared(target, drafts, contexts, G=a.G, k=4, params=SamplingParams(T),
                                 batch_size=min(a.n_contexts, 64), progress=False)
        t = taus[f"T={T:g}"] = {name: r.to_dict() for name, r in res.items()}
        pairs = [(n, "magicdec") for n in models] + ([("spire_lk", "spire")] if len(models) == 2 else [])
        for x, y in pairs:
            arrays = [np.asarray(v, dtype=float) for v in (res[x].emitted, res[x].rounds, res[y].emitted,
                                                           res[y].rounds)]
            t[f"{x}_over_{y}"] = [res[x].tau / res[y].tau, *paired_ratio_ci(*arrays)]
    out["tau"] = taus
    timings["tau_s"] = time.time() - t0
    out["bench"] = bench_cells(a, target, models, data) if a.cells else []
    timings["bench_s"] = time.time() - t0 - timings["tau_s"]
    out["timings"] = timings
    out["total_s"] = time.time() - t_start
    atomic_write(a.out / "gpu_spire.json", None, json.dumps(out, indent=1))
    write_provenance(a.out)
    write_markdown(a, out, arch)
    print(f"wrote {a.out / 'gpu_spire.json'} ({out['total_s']:.0f} s in all)")


SCORE_BYTES = 8 << 30
"""Bytes a prefill's attention scores may take (float32 scores and their softmax of one layer: 2 x 4 x rows x
heads x L²): the bench cells' prefill runs in groups of rows under it (:func:`grouped_prefill`)."""


def grouped_prefill(group: int):
    """:func:`spire.engine.prefill.prefill` over groups of at most ``group`` rows, into one cache: the same cache,
    tokens and hidden states as one call (the rows are independent), with the attention scores of ``group`` rows
    at a time instead of all (64 rows x 9 heads x 4096² float32 scores and softmax are 77 GB: more than an H100).
    Prompts of unequal lengths fall back to one call."""
    from spire.engine import prefill as P
    from spire.model import ForwardOutput

    def run(target, prompts, max_len, hidden_layers=(), cache=None):
        rows = P.as_rows(prompts)
        B = len(rows)
        if B <= group or len({len(r) for r in rows}) != 1 or len(rows[0]) < 2:
            return P.prefill(target, rows, max_len, hidden_layers, cache)
        cache = target.new_cache(B, max_len) if cache is None else cache
        parts = []
        for i in range(0, B, group):
            part = P.prefill(target, rows[i: i + group], max_len, hidden_layers)
            for store, src in ((cache.k, part.cache.k), (cache.v, part.cache.v)):
                for layer in range(len(store)):
                    store[layer][i: i + len(part.rows)].copy_(src[layer])
            part.cache = None
            parts.append(part)
        outs = [p.out for p in parts]
        out = ForwardOutput(hidden={j: torch.cat([o.hidden[j] for o in outs]) for j in outs[0].hidden},
                            compute_logits=lambda: torch.cat([o.logits for o in outs]))
        cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        return P.Prefilled(rows, cache, max_len, cat("tokens"), cat("pos"), cat("valid"), out,
                           sum(p.prefill_s for p in parts))

    return run


def bench_cells(a, target, models: dict, data) -> list[dict]:
    """run_bench on each (B, L) cell of ``a.cells`` in ``a.bench_dtype``, with MagicDec and each trained arm (loaded
    for the cast target from its saved file, as `spire bench --draft-path` does); each cell's prefill in groups of
    rows (:func:`grouped_prefill`; of one row in a --tiny run, to run that path)."""
    import spire.bench.run as bench_run
    from spire.bench.run import BenchConfig, run_bench

    dtype = torch.bfloat16 if a.bench_dtype == "bf16" else torch.float32
    bt = copy.deepcopy(target).to(dtype)
    drafts = {"magicdec": MagicDecDraft(1, 64)}
    for name in models:
        path = a.out / ("run" if name == "spire" else "run-lk") / "draft.safetensors"
        drafts[name] = SpireDraft(SpireDraftModel.load(path, bt))

    def contexts_for(L: int, n: int) -> torch.Tensor:
        return data.heldout_contexts(L, a.bench_G, n, seed=0)

    rows, original = [], bench_run.prefill
    try:
        for cell in a.cells.split(","):
            B, L = (int(x) for x in cell.lower().split("x"))
            group = 1 if a.tiny else max(1, SCORE_BYTES // (8 * target.cfg.n_heads * L * L))
            bench_run.prefill = grouped_prefill(group)
            t0 = time.time()
            res = run_bench(bt, contexts_for, drafts, BenchConfig(Bs=[B], Ls=[L], G=a.bench_G, reps=a.bench_reps),
                            dtype_name=a.bench_dtype, progress=lambda m: print(m, flush=True))
            rows.append({"B": B, "L": L, "prefill_group_rows": group, "seconds": time.time() - t0, **res})
    finally:
        bench_run.prefill = original
    return rows


def write_markdown(a, out: dict, arch) -> None:
    lines = [f"# SPIRe on {out['gpu'] or out['device']}", ""]
    for key in ("train", "train_lk"):
        if key in out:
            t = out[key]
            lines.append(f"- arm {key} (loss {t['loss']}): {t['steps']} steps x {a.batch_size} x {a.seq_len} = "
                         f"{t['tokens']:,} tokens in {t['train_s']:.0f} s ({t['tokens_per_s']:,.0f} tokens/s); held-out "
                         "α by drafted position " + ", ".join(f"{x:.3f}" for x in t["heldout_alpha_per_position"]))
    lines += ["", f"Draft: target layers {out['spire_layers']}, draft vocabulary {arch.vocab_size}. τ on "
              f"{a.n_contexts} held-out contexts, L = {a.L}, G = {a.G}, k = 4 (95 % CI):", ""]
    names = [n for n in ("spire", "spire_lk") if n in out["tau"]["T=0"]]
    lines += ["| T | MagicDec | " + " | ".join(names) + " | " + " | ".join(f"{n} / MagicDec (paired CI)"
                                                                       for n in names) + " |",
              "|---|---|" + "---|" * (2 * len(names))]
    for key, t in out["tau"].items():
        cells = [f"{t[n]['tau']:.3f} [{t[n]['ci_low']:.2f}, {t[n]['ci_high']:.2f}]" for n in ("magicdec", *names)]
        ratios = [f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]" for r in (t[f"{n}_over_magicdec"] for n in names)]
        lines.append(f"| {key[2:]} | " + " | ".join(cells + ratios) + " |")
    if "spire_lk_over_spire" in out["tau"]["T=0"]:
        lines += ["", "spire_lk / spire (paired CI): " + "; ".join(
            f"{k}: {t['spire_lk_over_spire'][0]:.3f} [{t['spire_lk_over_spire'][1]:.3f}, "
            f"{t['spire_lk_over_spire'][2]:.3f}]" for k, t in out["tau"].items())]
    if out["bench"]:
        lines += ["", f"Bench cells ({a.bench_dtype}, G = {a.bench_G}, k = 4): measured vs predicted Δt, τ, SD / AD "
                  "tokens/s; greedy SD against AD (near-ties are rounding; a real divergence is a bug):", "",
                  "| B | L | draft | Δt measured | Δt predicted | τ | SD/AD measured | SD = AD | real divergences |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for cell in out["bench"]:
            for r in cell["rows"]:
                mult = r["multiplier_measured"]
                lines.append(f"| {r['B']} | {r['L']} | {r['draft']} | {r['delta_t_measured']:.3f} | "
                             f"{r['delta_t_predicted']:.3f} | {r['tau']:.3f} | "
                             f"{'-' if mult is None else f'{mult:.3f}'} | {'yes' if r['identical_to_ad'] else 'no'} | "
                             f"{r['real_divergences']} |")
    atomic_write(a.out / "GPU_SPIRE.md", None, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
