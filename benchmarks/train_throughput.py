"""Training throughput and what a fixed budget buys: SPIRe vs the vanilla baseline on this machine.

For each draft, in one run: training tokens/s (median over timed steps after warm-up, same batch shape), then
a run of ``--budget`` seconds from scratch, the held-out alpha per drafted position and τ (greedy and T = 1)
on held-out contexts. Prints one table and writes JSON.

    python benchmarks/train_throughput.py                       # 300 s per draft, about 15 minutes on 2 cores
    python benchmarks/train_throughput.py --budget 60 --n-contexts 4 --out bench.json
    python benchmarks/train_throughput.py --levers --steps 5     # old path vs draft vocabulary / target cache
    python benchmarks/train_throughput.py --levers --steps 5 --bf16   # the same under bf16 autocast
    python benchmarks/train_throughput.py --levers --steps 5 --bf16 --compile   # and the new path compiled
    python benchmarks/train_throughput.py --whole-machine --steps 12   # the trainer as the main job runs it
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from spire import backend
from spire.data import document_separator_id, prepare_data
from spire.drafts.spire import SpireConfig, SpireDraft
from spire.drafts.vanilla import VanillaDraft
from spire.evaluation.tau import measure_tau
from spire.loading import load_target
from spire.sampling import SamplingParams
from spire.training import distill
from spire.training import step as train_step  # the training step (its loss: mixed_loss_logp)
from spire.timing import Stopwatch
from spire.training.distill import TrainConfig, train_draft
from spire.training.losses import mixed_loss_logp_reference
from spire.training.sources import CachedTarget, LiveTarget, TargetCache

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import write_provenance  # benchmarks/_provenance.py


OLD_PATH = backend.DEFAULT.replace(chunked_kpass=False, grouped_attention=False, autocast_copies=False)
"""The trainer's execution choices before the levers (the fused AdamW and loss kernel are set apart: the old
optimizer and loss are the for-loop AdamW and the autograd MixedLoss)."""


def old_mixed_loss(draft_logits, target_logp, omega=0.5, kernel=True):
    """The trainer's MixedLoss before the levers: the autograd reference (no row kernel, whatever ``kernel``)."""
    return mixed_loss_logp_reference(draft_logits, target_logp, omega)


def step_rate(target, data, cfg: TrainConfig, steps: int) -> float:
    """Median training tokens/s over ``steps`` timed steps (after one warm-up step), the trainer's own step."""
    model = distill._build_model(target, cfg, data)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    src = LiveTarget(target, data, model.target_layers(), distill.needs_teacher(model, cfg),
                     cfg.batch_size, cfg.seq_len, cfg.seed, cfg.data_steps, bool(cfg.bf16))
    times = []
    for s in range(steps + 1):
        watch = Stopwatch(target.device)
        loss, _ = distill.step_loss(model, target, src.batch(s), cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if s:
            times.append(watch.seconds())
    return cfg.batch_size * cfg.seq_len / statistics.median(times)


def lever_rates(target, data, folder, steps: int, vocab_size: int, cache_dtype: str, layers,
                bf16: bool = False, compiled: bool = False) -> list[dict]:
    """Training tokens per second (wall and CPU) of one SPIRe step on the same batches, for the old path (live
    target, full vocabulary, the autograd MixedLoss, the for-loop AdamW and the dense k-pass layout: the trainer
    before these levers) and each lever alone and together (the MixedLoss row kernel with the fused AdamW and the
    chunked k-pass attention, draft vocabulary, target cache), steps timed in turn (old, new, old, new, ...) so that load on the machine hits every path
    alike. bf16: every path under bf16 autocast (the trainer's default where bf16 is fast); the old path then also
    runs attention through SDPA and casts frozen weights anew on every call (OLD_PATH: Backend.grouped_attention,
    .autocast_copies and .chunked_kpass off). The old path shares the draft's forward otherwise (one head matmul over the k
    passes), so it is a little faster than the trainer of the issue's time was. compiled: one more path, the new
    one with the draft's training forward and backward through torch.compile (``spire train --compile``; the
    compile happens in its untimed first step, so its row is the compiled step's rate, compile time excluded)."""
    spire_cfg = dict(layers=tuple(layers)) if layers else {}
    paths = {"live, full vocabulary (old)": (None, None, False),
             "live, full vocabulary, new loss + chunks": (None, None, True),
             f"live, vocabulary {vocab_size}": (vocab_size, None, True),
             "cache, full vocabulary": (None, cache_dtype, True),
             f"cache, vocabulary {vocab_size} (new)": (vocab_size, cache_dtype, True)}
    if compiled:
        paths[f"cache, vocabulary {vocab_size}, torch.compile"] = (vocab_size, cache_dtype, True)
    runs, build_s = {}, None
    for name, (n, dtype, fused) in paths.items():
        cfg = TrainConfig(bf16=bf16, data_steps=steps + 1, draft_config=SpireConfig(vocab_size=n, **spire_cfg))
        model = distill._build_model(target, cfg, data)
        layers_needed, teacher = model.target_layers(), distill.needs_teacher(model, cfg)
        if dtype is None:
            src = LiveTarget(target, data, layers_needed, teacher, cfg.batch_size, cfg.seq_len, cfg.seed,
                             cfg.data_steps)
        else:
            built: list[str] = []
            watch = Stopwatch(target.device)
            cache = TargetCache.build(target, data, layers_needed, teacher, cfg.batch_size, cfg.seq_len, cfg.seed,
                                      cfg.data_steps, dtype, folder=folder, bf16=bf16, progress=False,
                                      log=built.append)
            seconds = watch.seconds()
            if build_s is None and not any("reusing" in m for m in built) and "(resuming" not in "".join(built):
                if seconds > 1.0:  # built here, not opened from an earlier run
                    build_s = seconds / cfg.data_steps
            src = CachedTarget(cache, layers_needed, teacher, target.device)
        if name.endswith("torch.compile"):  # compiled in its first (untimed) step
            distill.compile_draft(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = distill.make_optimizer(params, cfg) if fused else torch.optim.AdamW(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        runs[name] = (cfg, model, src, opt, fused, [], [])
    fused_loss, before = train_step.mixed_loss_logp, backend.of(target)
    try:
        _time_steps(runs, target, steps, fused_loss)
    finally:  # the trainer's loss and the target's backend back as they were, whatever happened
        train_step.mixed_loss_logp = fused_loss
        backend.use(target, before)
    rows = []
    for name, (cfg, _, _, _, _, wall, cpu) in runs.items():
        tok = cfg.batch_size * cfg.seq_len
        rows.append({"path": name, "tokens_per_s": tok / statistics.median(wall),
                     "tokens_per_cpu_s": tok / statistics.median(cpu), "step_s": statistics.median(wall)})
    base = rows[0]["tokens_per_cpu_s"]
    for r in rows:
        r["speedup_cpu"] = r["tokens_per_cpu_s"] / base
    new_row = next(r for r in rows if r["path"].endswith("(new)"))
    new_row["cache_build_s_per_batch"] = build_s
    return rows


def _time_steps(runs: dict, target, steps: int, fused_loss) -> None:
    """Steps 0..steps of every path in turn (old, new, old, ...), each with its implementations in place; the
    times of steps 1.. appended to the path's wall and CPU lists."""
    new = backend.of(target)
    for s in range(steps + 1):
        for name, (cfg, model, src, opt, fused, wall, cpu) in runs.items():
            train_step.mixed_loss_logp = fused_loss if fused else old_mixed_loss
            for m in (target, model):  # the old path: dense k-pass layout, SDPA, frozen weights cast anew
                backend.use(m, new if fused else OLD_PATH)
            watch = Stopwatch(target.device)
            loss, _ = distill.step_loss(model, target, src.batch(s), cfg)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if s:  # the first step warms up
                w, c = watch.stop()
                wall.append(w)
                cpu.append(c)


def whole_machine_rates(target, data, folder, steps: int, vocab_size: int, cache_dtype: str, layers,
                        repeats: int) -> list[dict]:
    """SPIRe training tokens/s of the real trainer using every core of this machine, on the same batches: the old
    path (one process with all torch threads, live target, full vocabulary) against the new one (one
    single-thread process per thread, data parallel; target cache; draft vocabulary). Runs alternate (old, new,
    old, ...); each rate is the median over steps 3.. of the rank-0 training log (the cache build, spawning and
    evaluation excluded). Both use the trainer's default numerics (bf16 autocast where it is fast); the old path
    runs with the autograd MixedLoss and the for-loop AdamW it had before (in this process), the new one with
    the trainer's hand-written MixedLoss gradient and fused AdamW."""
    from spire.drafts.spire import SpireConfig
    from spire.pipeline import ReproduceConfig, training_processes
    from spire.training.parallel import train_in_processes

    n_procs, _ = training_processes(ReproduceConfig(), target.device)
    spire_cfg = dict(layers=tuple(layers)) if layers else {}
    paths = {f"1 process x {torch.get_num_threads()} threads, live, full vocabulary (old)": (None, None, 1),
             f"{n_procs} processes x 1 thread, cache, vocabulary {vocab_size} (new)": (vocab_size, cache_dtype,
                                                                                       n_procs)}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    with tempfile.TemporaryDirectory(prefix="spire-bench-") as tmp:
        for rep in range(repeats):
            for name, (n, dtype, procs) in paths.items():
                cfg = TrainConfig(budget_s=1e9, max_steps=steps, checkpoint_every=1e9, data_steps=steps,
                                  target_cache=dtype, draft_config=SpireConfig(vocab_size=n, **spire_cfg))
                old = dtype is None
                out = Path(tmp) / f"{rep}-{'old' if old else 'new'}"  # one folder per run (procs may be 1 for both)
                fused_loss, before = train_step.mixed_loss_logp, backend.of(target)
                if old:  # one process: it runs here, so the old implementations can be put in place
                    train_step.mixed_loss_logp = old_mixed_loss
                    backend.use(target, before.replace(fused_adamw=False))
                try:
                    train_in_processes(target, data, out, cfg, procs, 1 if procs > 1 else torch.get_num_threads(),
                                       target_folder=folder, progress=False, log=None)
                finally:
                    train_step.mixed_loss_logp = fused_loss
                    backend.use(target, before)
                log = [json.loads(ln) for ln in (out / distill.LOG_FILE).read_text().splitlines() if ln.strip()]
                rates[name].append(statistics.median(r["tokens_per_s"] for r in log
                                                     if r.get("event") == "train" and r["step"] > 2))
    rows = [{"path": name, "tokens_per_s": statistics.median(v), "runs": v} for name, v in rates.items()]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=300.0, help="training seconds per draft")
    ap.add_argument("--steps", type=int, default=3, help="timed steps for tokens/s")
    ap.add_argument("--n-contexts", type=int, default=8)
    ap.add_argument("-L", type=int, default=512)
    ap.add_argument("-G", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--runs", type=Path, default=None, help="keep the run folders here (default: temporary)")
    ap.add_argument("--rate-only", action="store_true", help="only the tokens/s of both drafts (about a minute)")
    ap.add_argument("--levers", action="store_true", help="SPIRe training tokens per CPU-second: the old path "
                    "(live target, full vocabulary) against the draft vocabulary and the target cache, alone and "
                    "together, on the same batches")
    ap.add_argument("--whole-machine", action="store_true", help="the trainer on every core, as the main job runs "
                    "it: old path (one multi-thread process, live, full vocabulary) against the new one (data-parallel "
                    "single-thread processes, target cache, draft vocabulary), alternating --repeats times")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each path for --whole-machine")
    ap.add_argument("--vocab-size", type=int, default=8192, help="draft vocabulary of --levers")
    ap.add_argument("--cache-dtype", default="bfloat16", help="target cache storage of --levers")
    ap.add_argument("--compile", action="store_true", help="--levers: one more path, the new one through "
                    "torch.compile (spire train --compile)")
    ap.add_argument("--layers", default=None, help="SPIRe source layers J,J,... of --levers [the default]")
    ap.add_argument("--bf16", action="store_true", help="train under bf16 autocast (the trainer's default where bf16 "
                    "is fast: AMX or AVX512-BF16) instead of float32 (--whole-machine always uses the trainer's "
                    "default)")
    a = ap.parse_args()

    target, tokenizer, folder = load_target()
    data = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer))
    if a.whole_machine:
        layers = [int(x) for x in a.layers.split(",")] if a.layers else None
        rows = whole_machine_rates(target, data, folder, a.steps, a.vocab_size, a.cache_dtype, layers, a.repeats)
        print(f"SPIRe training tokens/s on this machine ({torch.get_num_threads()} threads), batch 4 x 256, median "
              f"over steps 3..{a.steps} of each run, median of {a.repeats} runs per path (alternating)")
        for r in rows:
            print(f"{r['path']:60s} {r['tokens_per_s']:7.0f} tokens/s  {r['speedup']:.2f}x   runs: "
                  + ", ".join(f"{x:.0f}" for x in r["runs"]))
        if a.out:
            a.out.write_text(json.dumps({"whole_machine": rows, "args": {k: str(v) for k, v in vars(a).items()}},
                                        indent=1))
            write_provenance(a.out)
        return
    if a.levers:
        layers = [int(x) for x in a.layers.split(",")] if a.layers else None
        rows = lever_rates(target, data, folder, a.steps, a.vocab_size, a.cache_dtype, layers, a.bf16, a.compile)
        print(f"SPIRe training on {torch.get_num_threads()} threads, {'bf16 autocast' if a.bf16 else 'float32'}, "
              f"batch 4 x 256, {a.steps} timed steps each (median), interleaved")
        print(f"{'path':44s} {'tokens/s':>9s} {'tokens/CPU-s':>13s} {'x old (CPU)':>12s}")
        for r in rows:
            print(f"{r['path']:44s} {r['tokens_per_s']:9.0f} {r['tokens_per_cpu_s']:13.0f} {r['speedup_cpu']:11.2f}x")
        b = next(r for r in rows if r["path"].endswith("(new)"))["cache_build_s_per_batch"]
        print("target cache: opened from an earlier run (not built here)" if b is None else
              f"target cache build: {b:.2f} s per batch of 1,024 tokens ({1024 / b:.0f} tokens/s, paid once per "
              "batch and reused by every epoch, run and ablation)")
        if a.out:
            a.out.write_text(json.dumps({"levers": rows, "args": {k: str(v) for k, v in vars(a).items()}}, indent=1))
            write_provenance(a.out)
        return
    if a.rate_only:
        rates = {kind: step_rate(target, data, TrainConfig(draft=kind, bf16=a.bf16), a.steps)
                 for kind in ("spire", "vanilla")}
        print(f"training tokens/s on {torch.get_num_threads()} threads, {'bf16 autocast' if a.bf16 else 'float32'}, "
              "batch 4 x 256: "
              + ", ".join(f"{k} {v:.0f}" for k, v in rates.items())
              + f"; ratio spire/vanilla {rates['spire'] / rates['vanilla']:.2f}")
        return
    heldout = data.heldout_contexts(192, 64, 8, seed=1)
    contexts = data.heldout_contexts(a.L, a.G, a.n_contexts, seed=0)[:, : a.L]
    runs = a.runs or Path(tempfile.mkdtemp(prefix="spire-bench-"))
    rows = []
    for kind in ("spire", "vanilla"):
        cfg = TrainConfig(draft=kind, budget_s=a.budget, checkpoint_every=1e9, bf16=a.bf16)
        rate = step_rate(target, data, cfg, a.steps)
        model, state = train_draft(target, data, runs / kind, cfg, heldout=heldout, resume=None,
                                   target_folder=folder)
        draft = SpireDraft(model) if kind == "spire" else VanillaDraft(model)
        taus = {T: measure_tau(target, draft, contexts, G=a.G, k=4, params=SamplingParams(T), batch_size=8)
                for T in (0.0, 1.0)}
        rows.append({"draft": kind, "body_params": sum(p.numel() for p in model.layers.parameters()),
                     "tokens_per_s": rate, "budget_s": a.budget, "steps": state["step"], "tokens": state["tokens"],
                     "heldout_alpha": state["heldout"]["alpha_per_position"],
                     "tau_T0": [taus[0.0].tau, taus[0.0].ci_low, taus[0.0].ci_high],
                     "tau_T1": [taus[1.0].tau, taus[1.0].ci_low, taus[1.0].ci_high]})
    numerics = "bf16 autocast" if a.bf16 else "float32"
    print(f"\ntraining on {torch.get_num_threads()} threads, {numerics}, batch 4 x 256, L={a.L}, G={a.G}, k=4, "
          f"{a.n_contexts} contexts")
    print(f"{'draft':8s} {'body params':>12s} {'tokens/s':>9s} {'steps':>6s} {'tokens':>8s}  "
          f"{'held-out alpha (pos 1..4)':28s} {'tau T=0':>22s} {'tau T=1':>22s}")
    for r in rows:
        print(f"{r['draft']:8s} {r['body_params']:12,d} {r['tokens_per_s']:9.0f} {r['steps']:6d} {r['tokens']:8,d}  "
              f"{' '.join(f'{x:.3f}' for x in r['heldout_alpha']):28s} "
              f"{r['tau_T0'][0]:6.3f} [{r['tau_T0'][1]:.2f}, {r['tau_T0'][2]:.2f}]  "
              f"{r['tau_T1'][0]:6.3f} [{r['tau_T1'][1]:.2f}, {r['tau_T1'][2]:.2f}]")
    s, v = rows
    print(f"ratio spire/vanilla: tokens/s {s['tokens_per_s'] / v['tokens_per_s']:.2f}, tau T=0 "
          f"{s['tau_T0'][0] / v['tau_T0'][0]:.2f}, tau T=1 {s['tau_T1'][0] / v['tau_T1'][0]:.2f}")
    if a.out:
        a.out.write_text(json.dumps({"rows": rows, "args": {k: str(v) for k, v in vars(a).items()}}, indent=1))
        write_provenance(a.out)


if __name__ == "__main__":
    main()
