"""Paired SPIRe recipe runs: the main job's recipe against variants, same batches, same token budget.

Every variant trains from the main job's shared target cache (SPIRe's and EAGLE-3's layers, 500 bfloat16 batches,
seed 0: the same batches in the same order) for the same number of optimizer steps, in the main job's training
processes; then τ of MagicDec, the base recipe and every variant is measured on the main job's held-out contexts
(48 at L = 512, G = 64, k = 4) at T = 0 and T = 1, decoding every draft from one prefill per batch, with each
variant's τ ratio to the base and to MagicDec as paired 95 % bootstrap CIs over contexts.

    python benchmarks/t1_recipes.py --steps 600 --variant omega1:omega=1 --variant fullvocab:vocab=0 --out t1/
    python benchmarks/t1_recipes.py --steps 600 --train-only ...   # train (resumable), measure later

A variant is NAME:KEY=VALUE[,KEY=VALUE]: keys omega, loss, lr, vocab (0 = the whole vocabulary; a draft vocabulary
other than the base's changes only the draft's head), vocab_from (frequency / mass: how the draft vocabulary is
chosen, SpireConfig.vocab_from), target_cache (float32 / bfloat16 / none: the live target on the same batches), eagle3 (1: train the main
job's EAGLE-3 draft at the same steps), sink (attention-sink tokens), self_attend (0: a drafted position does not read
its own layer input; sink=0,self_attend=0 is the variant vLLM's EAGLE-3 path runs, docs/serving.md), onpolicy
(a file of `benchmarks/onpolicy_tails.py`: the same batches with the tail of every window replaced by the target's own
continuation, the variant's own target cache), mix (FILE.npz[:ROWS]: the last ROWS rows of every batch from another
text, :class:`MixedText`; its own target cache), init (a trained SPIRe run folder or draft file the variant starts
from with its own draft settings, ``TrainConfig.init_from``: fine-tuning; with --reference, variants fine-tuned from one draft are paired against
each other). Trained runs are cached as the main job caches its drafts, and each draft's
per-context τ is kept in OUT (a rerun with one more variant measures only that one). Writes OUT/recipes.json and
prints one line per (draft, T).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from spire.drafts import make_draft
from spire.evaluation.tau import TauResult, measure_tau_shared, paired_ratio_ci
from spire.paths import atomic_write
from spire.pipeline import (ReproduceConfig, _draft_dir, _load, shared_target_cache, spire_architecture,
                            training_processes, training_runs)
from spire.sampling import SamplingParams
from spire.training.parallel import train_in_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import portable, write_provenance  # benchmarks/_provenance.py


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition(":")
    kw = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        kw[key.strip()] = value.strip()
    unknown = set(kw) - {"omega", "loss", "lr", "vocab", "target_cache", "eagle3", "sink", "self_attend", "onpolicy",
                          "vocab_from", "mix", "init"}
    if not name or unknown:
        raise SystemExit(f"error: bad --variant {text!r} (NAME:KEY=VALUE,...; keys omega, loss, lr, vocab, "
                         "target_cache, eagle3, sink, self_attend, onpolicy, vocab_from, mix, init)")
    return name, kw


def variant_config(base, kw: dict, eagle3_cfg):
    if kw.get("eagle3") == "1":
        return replace(eagle3_cfg, max_steps=base.max_steps, budget_s=base.budget_s)
    cfg = replace(base, draft_config=replace(base.draft_config))
    if "omega" in kw:
        cfg.omega = float(kw["omega"])
    if "loss" in kw:
        cfg.loss = kw["loss"]
    if "lr" in kw:
        cfg.lr = float(kw["lr"])
    if "vocab" in kw:
        cfg.draft_config.vocab_size = int(kw["vocab"]) or None
    if "vocab_from" in kw:
        cfg.draft_config.vocab_from = kw["vocab_from"]
    if "target_cache" in kw:  # none: the live target on the same batches
        cfg.target_cache = None if kw["target_cache"] == "none" else kw["target_cache"]
    if "sink" in kw:
        cfg.draft_config.sink = int(kw["sink"])
    if "self_attend" in kw:
        cfg.draft_config.self_attend = kw["self_attend"] not in ("0", "false", "False")
    if "onpolicy" in kw:  # another text: keyed (run folder, target cache) apart from the base's
        cfg.data = f"onpolicy:{Path(kw['onpolicy']).stem}"
    if "init" in kw:  # the trained draft's own settings (its layers may not be the main job's)
        from spire.training.distill import init_draft_settings

        cfg.init_from = str(Path(kw["init"]).resolve())
        cfg.draft_config = init_draft_settings(cfg.init_from, "spire")
    if "mix" in kw:
        path, _, rows = kw["mix"].partition(":")
        cfg.data = f"mix:{Path(path).stem}:{rows or 2}"
    return cfg


class OnPolicyTails:
    """The training text of ``data`` with each window that ``benchmarks/onpolicy_tails.py`` generated for (the first
    STEPS batches `spire train` draws) replaced by its version whose last G tokens the target wrote; its cache key
    (``manifest["key"]``) gets the file's name. A window it has no version for raises KeyError."""

    def __init__(self, data, path: str) -> None:
        import torch

        blob = torch.load(path)
        self._data, self._table = data, {r.numpy().astype("int64").tobytes(): g
                                         for r, g in zip(blob["natural"], blob["generated"])}
        self.manifest = {**data.manifest, "key": f"{data.manifest['key']}-{Path(path).stem}"}

    def __getattr__(self, name: str):
        if name.startswith("_"):  # unpickling looks up dunders before _data exists
            raise AttributeError(name)
        return getattr(self._data, name)

    def sample_train_batch(self, batch_size: int, seq_len: int, generator=None):
        import torch

        natural = self._data.sample_train_batch(batch_size, seq_len, generator)
        return torch.stack([self._table[r.numpy().astype("int64").tobytes()] for r in natural])


class MixedText:
    """The training text of ``data`` with the last ``rows`` rows of every batch replaced by windows of another text
    (``spec`` = FILE.npz[:ROWS], FILE with "tokens" and "offsets" as written by
    `measurements/t1-recipes/broad-text/brown_tokens.py`; ROWS default 2), drawn uniformly over the valid starts of
    its documents with the batch's own generator after the natural rows (which stay the base's first rows)."""

    def __init__(self, data, spec: str) -> None:
        path, _, rows = spec.partition(":")
        blob = np.load(path)
        self._data, self._rows = data, int(rows or 2)
        self._tokens, self._offsets = blob["tokens"].astype(np.int64), blob["offsets"].astype(np.int64)
        self.manifest = {**data.manifest, "key": f"{data.manifest['key']}-mix-{Path(path).stem}-{self._rows}"}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._data, name)

    def sample_train_batch(self, batch_size: int, seq_len: int, generator=None):
        import torch

        batch = self._data.sample_train_batch(batch_size, seq_len, generator)
        ends = np.append(self._offsets[1:], len(self._tokens))
        ok = np.nonzero(ends - self._offsets >= seq_len)[0]
        cum = np.cumsum(ends[ok] - self._offsets[ok] - seq_len + 1)
        for r in range(batch_size - self._rows, batch_size):
            u = int(torch.randint(0, int(cum[-1]), (1,), generator=generator))
            j = int(np.searchsorted(cum, u, side="right"))
            start = self._offsets[ok[j]] + u - (cum[j - 1] if j else 0)
            batch[r] = torch.from_numpy(self._tokens[start:start + seq_len])
        return batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600, help="optimizer steps of every run (1,024 tokens each)")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:KEY=VALUE[,KEY=VALUE]; keys omega, loss, lr, vocab, vocab_from, target_cache, eagle3, "
                         "sink, self_attend, onpolicy, mix, init (the module docstring says what each does)")
    ap.add_argument("--reference", default="base",
                    help="the recipe every other one is paired against (base, or a variant's NAME)")
    ap.add_argument("--n-contexts", type=int, default=48, help="held-out contexts of L = 512 for tau")
    ap.add_argument("--temperatures", default="0,1", help="sampling temperatures of the tau runs, comma-separated")
    ap.add_argument("--train-only", action="store_true", help="train (or find trained) and stop before tau")
    ap.add_argument("--out", type=Path, default=Path("t1-recipes"),
                    help="folder for recipes.json and each draft's per-context tau")
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    if args.reference not in {"base"} | {name for name, _ in variants}:
        raise SystemExit(f"error: --reference {args.reference!r} is neither base nor a --variant's NAME")

    cfg = ReproduceConfig(steps=args.steps, n_contexts=args.n_contexts, tau_Ls=(512,))
    target, folder, data, contexts, _, windows = _load(cfg, True, print, {})
    arch = spire_architecture(cfg, target.cfg.n_layers, target.cfg.vocab_size)
    runs = dict(training_runs(cfg, arch))
    base, eagle3_cfg = runs["spire"], runs["eagle3"]
    configs = {"base": base} | {name: variant_config(base, kw, eagle3_cfg) for name, kw in variants}
    shared_target_cache([("spire", base), ("eagle3", eagle3_cfg)], target, data, folder, True, print)
    n_procs, threads = training_processes(cfg, target.device)
    models, training = {}, {}
    texts = {name: OnPolicyTails(data, kw["onpolicy"]) for name, kw in variants if "onpolicy" in kw}
    texts |= {name: MixedText(data, kw["mix"]) for name, kw in variants if "mix" in kw}
    for name, tc in configs.items():
        label = "eagle3" if tc.draft == "eagle3" else "spire"
        run_dir = _draft_dir(cfg, tc, folder, label)
        t = time.time()
        model, state = train_in_processes(target, texts.get(name, data), run_dir, tc, n_procs, threads, heldout=windows,
                                          target_folder=folder, progress=True, log=print)
        models[name] = model
        training[name] = {"run_dir": str(run_dir), "steps": state["step"], "tokens": state["tokens"],
                          "elapsed_s": state["elapsed_s"], "wall_s": time.time() - t,
                          "heldout_alpha": state["heldout"]["alpha_per_position"],
                          "config": tc.to_dict()}
        print(f"{name}: {state['step']} steps, {state['tokens']:,} tokens, held-out alpha "
              f"{', '.join(f'{a:.3f}' for a in state['heldout']['alpha_per_position'])}", flush=True)
    if args.train_only:
        return

    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    for T in (float(t) for t in args.temperatures.split(",")):
        drafts = {"magicdec": make_draft("magicdec", target, sink=cfg.sink, window=cfg.window)}
        drafts |= {name: m.as_draft() for name, m in models.items()}
        res = {}
        for name in list(drafts):  # measured before (same contexts, seed, G, k): per-context rounds kept in OUT
            kept = args.out / f"tau-{name}-T{T:g}.json"
            if kept.is_file() and json.loads(kept.read_text())["run"] == training.get(name, {}).get("run_dir"):
                res[name] = TauResult(**json.loads(kept.read_text())["result"])
                del drafts[name]
        if drafts:
            measured = measure_tau_shared(target, drafts, contexts, G=cfg.G, k=cfg.k, params=SamplingParams(T),
                                          batch_size=cfg.batch_size, seed=cfg.seed)
            for name, r in measured.items():
                atomic_write(args.out / f"tau-{name}-T{T:g}.json", None, text=json.dumps(
                    {"run": training.get(name, {}).get("run_dir"), "result": r.to_dict(per_context=True)}))
            res |= measured
        ref, mdc = res[args.reference], res["magicdec"]
        for name, r in res.items():
            e, n = np.array(r.emitted, float), np.array(r.rounds, float)
            row = {"recipe": name, "T": T, "tau": r.tau, "ci": [r.ci_low, r.ci_high],
                   "emitted": r.emitted, "rounds": r.rounds}
            for other, o in ((args.reference, ref), ("magicdec", mdc)):
                if other != name:
                    lo, hi = paired_ratio_ci(e, n, np.array(o.emitted, float), np.array(o.rounds, float))
                    row[f"ratio_to_{other}"] = [r.tau / o.tau, lo, hi]
            rows.append(row)
            extra = "".join(f"  /{o} {row[f'ratio_to_{o}'][0]:.3f} [{row[f'ratio_to_{o}'][1]:.3f}, "
                            f"{row[f'ratio_to_{o}'][2]:.3f}]" for o in (args.reference, "magicdec") if f"ratio_to_{o}" in row)
            print(f"T={T:g} {name:24s} tau {r.tau:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]{extra}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out / "recipes.json", None, text=json.dumps(
        {"command": portable(" ".join(sys.argv)), "steps": args.steps, "n_contexts": args.n_contexts, "L": cfg.L, "G": cfg.G,
         "k": cfg.k, "training": training, "tau": rows}, indent=1))
    write_provenance(args.out)


if __name__ == "__main__":
    main()
