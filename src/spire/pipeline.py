"""The main job, ``spire reproduce``: data -> draft training (SPIRe, EAGLE-3, vanilla) -> τ for every draft kind
(MagicDec and n-gram need no training) -> cost model -> report. Every step caches what it derives, so a second run reuses the converted target, the token data
and a finished draft (see :func:`spire.paths.spire_cache_dir`).
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from spire import defaults
from spire.backend import of as backend_of
from spire.data import document_separator_id, prepare_data
import spire.registry as registry
from spire.drafts import make_draft
from spire.drafts.spire import SpireConfig
from spire.errors import ConfigError
from spire.evaluation.diagnose import diagnose_shared
from spire.evaluation.report import write_report
from spire.evaluation.tau import measure_tau_shared
from spire.loading import load_target
from spire.paths import atomic_write, spire_cache_dir
from spire.provenance import provenance
from spire.sampling import SamplingParams
from spire.training.checkpoint import read_log
from spire.training.config import ABLATIONS, LOG_FILE, TrainConfig, ablation_config
from spire.training.evaluate import needs_teacher
from spire.training.step import fast_bf16
from spire.training.sources import TargetCache
from spire.training.parallel import train_in_processes

PRESETS = {"smollm2-135m": "smollm2-135m"}  # reproduce preset -> target checkpoint spec


DEFAULT_STEPS = 671
"""SPIRe's optimizer steps in the main job by default (671 × 4 × 256 = 687,104 tokens): what the committed results
(measurements/reproduce-cpu-five-drafts-clean) trained in their 600 s budget on 2 CPU cores, now a fixed amount,
so the drafts and their τ are the recipe's, not the machine's speed's. The vanilla baseline trains half of
SPIRe's tokens (vanilla_token_share: 336 steps)."""
DEFAULT_EAGLE3_STEPS = 969
"""EAGLE-3's optimizer steps by default (992,256 tokens): what the same committed run trained in the same 600 s."""
VANILLA_BUDGET_S = 1100.0
"""The vanilla baseline's seconds when the job trains by time (``--budget``) and no --vanilla-budget is given."""


@dataclass
class ReproduceConfig:
    """Settings of the main job (sized for 2 CPU cores by default; raise them by flag).

    steps: SPIRe's optimizer steps (default :data:`DEFAULT_STEPS`, a fixed amount of training: the same drafts on
    a fast or a busy machine); None: train for budget_s seconds instead (``spire reproduce --budget`` alone).
    vanilla_budget_s: the vanilla baseline's seconds (None: :data:`VANILLA_BUDGET_S` when SPIRe trains by time, no
    limit when it trains by steps); ablations: names of
    :data:`spire.training.config.ABLATIONS` to train (each for ablation_budget_s) and measure ("none" is the full
    method at the ablation budget: the fair reference). vanilla_steps / ablation_steps: train for that
    many optimizer steps instead of seconds. n_contexts:
    held-out contexts per τ at L; tau_Ls / tau_L_contexts: the τ-vs-L sweep (greedy, every draft).

    Beyond the paper (each has a setting that gives the paper's method back): first_layers of the
    n_draft_layers pruned blocks come from the bottom of the target, the rest from its top (0: the paper's last
    layers); draft_vocab: the SPIRe head covers the most frequent tokens only (None: the whole vocabulary);
    cache_steps / target_cache: the target runs once over cache_steps batches, stored on disk, and SPIRe (and
    its ablations) train epochs over them (target_cache None: the target runs live on fresh batches).
    vanilla_token_share: the vanilla baseline trains on at least this share of SPIRe's tokens (its steps follow
    from SPIRe's; vanilla_budget_s caps its seconds); None: vanilla_budget_s / vanilla_steps alone.
    hidden_weight: SPIRe's (and its ablations') hidden-state matching term (TrainConfig.hidden_weight; 0: the
    paper's loss). bridge: SPIRe's draft (and its ablations') maps its residual stream where the shallow layers
    meet the deep ones by an affine map fitted to the target's (SpireConfig.bridge; False: the paper's draft).
    compile: every draft's training step through torch.compile (TrainConfig.compile; the compile
    runs before each training clock starts; not part of a draft's cache key).

    The drafts the field uses beside the paper's: eagle3 trains an EAGLE-3 draft for eagle3_steps (default
    :data:`DEFAULT_EAGLE3_STEPS`, what it trained in SPIRe's 600 s in the committed results: equal training compute
    by the clock there), or when that is None for eagle3_budget_s (None: SPIRe's budget_s, and SPIRe's steps when
    steps is set) on the same text and target
    cache settings; the n-gram draft needs no training. tau_ks / tau_k_contexts: the τ-vs-k sweep (greedy, every
    draft, at L) from which the cost model picks the best k per (B, L) and draft; () skips it."""

    preset: str = "smollm2-135m"
    target: str | None = None  # a .gguf file or HF Llama-family folder instead of the preset's checkpoint
    out: Path = Path("spire-out")
    budget_s: float = 600.0  # SPIRe's seconds when trained by time (steps None), and EAGLE-3's
    vanilla_budget_s: float | None = None  # None: 1100 s when trained by time, no limit when by steps
    ablations: tuple[str, ...] = ()
    ablation_budget_s: float = 300.0
    steps: int | None = DEFAULT_STEPS  # optimizer steps (the default: a fixed amount, whatever the machine's speed
    vanilla_steps: int | None = None  # and load); None: budget_s seconds. ablation_steps likewise
    eagle3: bool = True
    eagle3_budget_s: float | None = None
    eagle3_steps: int | None = DEFAULT_EAGLE3_STEPS
    ablation_steps: int | None = None
    L: int = 512
    G: int = 64
    k: int = defaults.K
    n_contexts: int = 48
    temperatures: tuple[float, ...] = (0.0, 1.0)
    tau_Ls: tuple[int, ...] = (256, 512, 1024, 4096)
    tau_L_contexts: int = 8
    tau_ks: tuple[int, ...] = (1, 2, 4, 8)
    tau_k_contexts: int = 8
    diagnose_contexts: int = 8  # contexts of the T = 1 diagnosis of every draft but n-gram (0 skips it)
    batch_size: int = 8
    n_draft_layers: int = defaults.N_DRAFT_LAYERS
    first_layers: int = 2
    draft_vocab: int | None = 16384
    cache_steps: int = 500
    target_cache: str | None = "bfloat16"
    vanilla_token_share: float | None = 0.5
    hidden_weight: float = 0.0
    bridge: bool = False
    compile: bool = True
    sink: int = defaults.SINK
    window: int = defaults.WINDOW
    seed: int = 0
    grid_B: tuple[int, ...] = (1, 4, 16, 64, 256)
    grid_L: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    alpha_windows: int = 16
    eval_every: int = defaults.EVAL_EVERY  # SPIRe steps between held-out evaluations (the report's learning curve)
    train_processes: int | None = None  # SPIRe's data-parallel training processes; None: one per thread on a CPU
    quick: bool = False

    @classmethod
    def quick_config(cls, **kw) -> "ReproduceConfig":
        """Smoke-test settings: finishes in a few minutes on 2 CPU cores."""
        base = dict(budget_s=60.0, vanilla_budget_s=30.0, ablation_budget_s=20.0, steps=None, eagle3_steps=None,
                    n_contexts=8, L=256, G=32,
                    tau_Ls=(128, 256), tau_L_contexts=4, alpha_windows=4, cache_steps=8, quick=True, tau_ks=(1, 4),
                    tau_k_contexts=4, diagnose_contexts=2,
                    compile=False)
        base.update(kw)
        return cls(**base)

    def validate(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        # `spire reproduce`'s flags name the fields they set; batch_size and window have none (API fields)
        for name, flag in (("L", "-L"), ("G", "-G"), ("k", "-k"), ("n_contexts", "--n-contexts"),
                           ("batch_size", "batch_size"), ("n_draft_layers", "--n-draft-layers"), ("window", "window"),
                           ("tau_L_contexts", "--tau-L-contexts"), ("cache_steps", "--cache-steps")):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag} must be a positive integer, got {getattr(self, name)}")
        if not self.budget_s > 0:
            raise ConfigError(f"--budget must be positive, got {self.budget_s:g} s")
        if not ((self.vanilla_budget_s is None or self.vanilla_budget_s > 0) and self.ablation_budget_s > 0):
            raise ConfigError("--vanilla-budget and --ablation-budget must be positive")
        self.ablations = tuple(dict.fromkeys(self.ablations))  # each once, in the order given
        unknown = [a for a in self.ablations if a not in ABLATIONS]
        if unknown:
            raise ConfigError(f"unknown ablation {unknown[0]!r}; choose from "
                              f"{', '.join(ABLATIONS)} (or all)")
        if not 0 <= self.first_layers <= self.n_draft_layers:
            raise ConfigError(f"--first-layers must be in [0, --n-draft-layers {self.n_draft_layers}], got "
                              f"{self.first_layers}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ConfigError(f"the draft vocabulary must be a positive number of tokens, got {self.draft_vocab}")
        if self.train_processes is not None and (self.train_processes < 1 or 4 % self.train_processes):
            raise ConfigError(f"--train-processes must divide the training batch of 4 rows, got "
                              f"{self.train_processes}")
        if self.vanilla_token_share is not None and not self.vanilla_token_share > 0:
            raise ConfigError(f"vanilla_token_share must be positive, got {self.vanilla_token_share}")
        if not (math.isfinite(self.hidden_weight) and self.hidden_weight >= 0):
            raise ConfigError(f"--hidden-loss must be a finite number >= 0, got {self.hidden_weight}")
        if any(x is not None and x < 1 for x in (self.steps, self.vanilla_steps, self.ablation_steps,
                                                 self.eagle3_steps)):
            raise ConfigError("--steps, --vanilla-steps, --ablation-steps and --eagle3-steps must be >= 1")
        if any(not t >= 0 for t in self.temperatures):
            raise ConfigError("temperatures must be >= 0")
        if self.diagnose_contexts < 0:
            raise ConfigError(f"--diagnose-contexts must be >= 0, got {self.diagnose_contexts}")
        if any(x < 1 for x in self.tau_ks):
            raise ConfigError(f"--tau-k takes positive k, got {list(self.tau_ks)}")
        if self.tau_k_contexts < 1:
            raise ConfigError(f"--tau-k-contexts must be >= 1, got {self.tau_k_contexts}")
        if self.eagle3_budget_s is not None and not self.eagle3_budget_s > 0:
            raise ConfigError(f"--eagle3-budget must be positive, got {self.eagle3_budget_s:g} s")
        if any(x < 1 for x in self.tau_Ls):
            raise ConfigError(f"--tau-L takes positive context lengths, got {list(self.tau_Ls)}")
        if any(b < 1 for b in self.grid_B) or any(x < 1 for x in self.grid_L):
            raise ConfigError("the B and L grids take positive integers")


def training_processes(cfg: ReproduceConfig, device: torch.device, batch_size: int = 4) -> tuple[int, int]:
    """(processes, torch threads each) for the main job's SPIRe training: on a CPU by default one single-thread
    process per torch thread (the largest count dividing the batch), which trains faster than one multi-thread
    process (:mod:`spire.training.parallel`); one process elsewhere."""
    threads = torch.get_num_threads()
    if cfg.train_processes is not None:
        n = cfg.train_processes
    elif device.type != "cpu":
        n = 1
    else:
        n = max(d for d in range(1, batch_size + 1) if batch_size % d == 0 and d <= threads)
    return n, max(1, threads // n) if n > 1 else threads


def _log_rows(run_dir: Path) -> list[dict]:
    """The rows of a run's train_log.jsonl ([] when it has none)."""
    path = Path(run_dir) / LOG_FILE
    return read_log(path)[0] if path.is_file() else []  # a torn last line (a crash) is dropped


def heldout_curve(run_dir: Path) -> list[dict]:
    """The held-out evaluations of a run, in order: [{"step", "tokens", "alpha_per_position"}] (its learning
    curve; the log of a resumed run holds each step once)."""
    return [{"step": r["step"], "tokens": r["tokens"], "alpha_per_position": r["alpha_per_position"]}
            for r in _log_rows(run_dir) if r.get("event") == "eval"]


def bridge_fit(run_dir: Path) -> dict | None:
    """The bridge fitted before a run trained (its log's "bridge" event: {"layer", "r2"}), or None."""
    return next(({"layer": r["layer"], "r2": r["r2"]} for r in _log_rows(run_dir) if r.get("event") == "bridge"),
                None)


def compile_seconds(run_dir: Path) -> float | None:
    """Seconds spent compiling a run's training step (its log's "compile" events that succeeded; a resumed run
    compiles again), or None when it never ran compiled."""
    done = [r["seconds"] for r in _log_rows(run_dir) if r.get("event") == "compile" and r.get("compiled")]
    return sum(done) if done else None


def spire_architecture(cfg: ReproduceConfig, n_target_layers: int, vocab_size: int):
    """The SPIRe draft of the main job: n_draft_layers target blocks, the first ``first_layers`` of them from the
    bottom of the target and the rest from its top, sink + window, and a draft vocabulary of
    min(draft_vocab, vocab_size) tokens (None: the whole vocabulary). Raises ConfigError when n_draft_layers
    exceeds the target's layers."""
    if cfg.n_draft_layers > n_target_layers:
        raise ConfigError(f"--n-draft-layers {cfg.n_draft_layers} exceeds the target's {n_target_layers} layers")
    n, first = cfg.n_draft_layers, min(cfg.first_layers, cfg.n_draft_layers)
    layers = None if first == 0 else tuple(range(first)) + tuple(range(n_target_layers - (n - first),
                                                                      n_target_layers))
    vocab = None if cfg.draft_vocab is None or cfg.draft_vocab >= vocab_size else cfg.draft_vocab
    return SpireConfig(n_draft_layers=n, sink=cfg.sink, window=cfg.window, layers=layers, vocab_size=vocab,
                       bridge=cfg.bridge)


def _draft_dir(cfg: ReproduceConfig, train_cfg, folder: Path, label: str = "spire") -> Path:
    name = cfg.preset if cfg.target is None else Path(folder).name
    train = train_cfg.to_dict()
    for field_name in ("data", "data_steps", "target_cache"):  # unset: keyed as before the field existed, so
        if train.get(field_name) is None:                     # older runs are found
            train.pop(field_name, None)
    if not train.get("hidden_weight"):  # off (the paper's loss): keyed as before the field existed
        train.pop("hidden_weight", None)
    train.pop("compile", None)  # how a step runs, not what it computes
    if train.get("draft") != "eagle3":  # another kind's settings: keyed as before the field existed
        train.pop("eagle3", None)
    for field_name, off in (("vocab_size", None), ("bridge", False)):  # off: keyed as before the field existed
        if train["spire"].get(field_name, off) == off:
            train["spire"].pop(field_name, None)
    key = hashlib.sha1(json.dumps({"target": str(Path(folder).resolve()), "train": train},
                                  sort_keys=True, default=str).encode()).hexdigest()[:10]
    return spire_cache_dir() / "drafts" / f"{name}-{label}-{key}"


def _tau_batch(cfg: ReproduceConfig, L: int) -> int:
    """Contexts decoded together: fewer at long L (the prefill's logits take B x L x V floats)."""
    return max(1, min(cfg.batch_size, 8192 // L))


TAU_CACHE_VERSION = 2  # bump when a change to decoding or sampling changes what a τ measurement returns (2: on the
# engine, context i sampling with its own generator)


def _tau_key(target_folder: Path, draft: dict, contexts: torch.Tensor, cfg: ReproduceConfig, temperature: float,
             batch_size: int, k: int | None = None) -> str:
    """Content key of one τ measurement: target, draft (settings or run folder and step), the exact context
    tokens, G, k, temperature, batch and seed."""
    h = hashlib.sha1(contexts.to(torch.int64).cpu().numpy().tobytes())
    h.update(json.dumps({"v": TAU_CACHE_VERSION, "target": str(Path(target_folder).resolve()), "draft": draft,
                         "G": cfg.G, "k": cfg.k if k is None else k, "T": temperature, "batch": batch_size, "seed": cfg.seed},
                        sort_keys=True).encode())
    return h.hexdigest()[:20]


def _tau_cache_get(key: str) -> dict | None:
    path = spire_cache_dir() / "tau" / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tau_cache_put(key: str, row: dict) -> None:
    """Keep a finished τ measurement, so that an interrupted or extended `spire reproduce` (another L, more
    ablations) measures only what is new."""
    folder = spire_cache_dir() / "tau"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / f"{key}.json", None, text=json.dumps(row))


def _load(cfg: ReproduceConfig, progress: bool, log, timings: dict) -> tuple:
    """Steps 1-2: the target and the text. Returns (target, folder, data, contexts (N, L), the τ-vs-L
    contexts {L: (n, L)}, the held-out windows for alpha (n, 256)). Raises ConfigError when the longest
    context does not fit the target."""
    log(f"[1/6] target: {cfg.target or cfg.preset}")
    t = time.time()
    target, tokenizer, folder = load_target(cfg.target or PRESETS[cfg.preset], progress=progress)
    longest = max(cfg.L, *cfg.tau_Ls)
    if longest + cfg.G + cfg.k + 1 > target.cfg.max_positions:
        raise ConfigError(f"context L={longest} + G={cfg.G} + k+1 exceeds the target's "
                          f"{target.cfg.max_positions} positions")
    timings["load_target_s"] = time.time() - t

    log("[2/6] data: registry texts, held-out split by document")
    t = time.time()
    data = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), progress=progress)
    contexts = data.heldout_contexts(cfg.L, cfg.G, cfg.n_contexts, seed=cfg.seed)[:, : cfg.L]
    sweep = {L: data.heldout_contexts(L, cfg.G, cfg.tau_L_contexts, seed=cfg.seed)[:, :L] for L in cfg.tau_Ls}
    windows = data.heldout_contexts(192, 64, cfg.alpha_windows, seed=cfg.seed + 1)  # 256-token windows
    timings["data_s"] = time.time() - t
    return target, folder, data, contexts, sweep, windows


def vanilla_seconds(cfg: ReproduceConfig) -> float:
    """The vanilla baseline's time limit: --vanilla-budget, else :data:`VANILLA_BUDGET_S` when SPIRe trains by time,
    else none (1e9 s: its steps, half of SPIRe's tokens, decide alone, whatever the machine's speed)."""
    if cfg.vanilla_budget_s is not None:
        return cfg.vanilla_budget_s
    return VANILLA_BUDGET_S if cfg.steps is None else 1e9


def _limits(budget: float, steps: int | None) -> dict:
    return {"budget_s": budget} if steps is None else {"budget_s": 1e9, "max_steps": steps}


def _amount(budget: float, steps: int | None) -> str:
    return f"{budget:.0f} s" if steps is None else f"{steps} steps"


RECIPE_KINDS = ("spire", "vanilla", "eagle3")
"""The trained kinds the main job's recipe trains with settings of their own (SPIRe's architecture and budget, the
vanilla baseline's share of SPIRe's tokens, EAGLE-3's steps and its --no-eagle3); every other trained kind of the
registry trains at its defaults for SPIRe's budget (:func:`training_runs`)."""


def training_runs(cfg: ReproduceConfig, spire_arch: SpireConfig) -> list[tuple[str, TrainConfig]]:
    """(label, TrainConfig) of every draft the job trains: "spire", "vanilla", "eagle3" (when on), each other
    trained kind of the registry (:data:`RECIPE_KINDS` aside: its default settings, SPIRe's seconds or steps, the
    live target), then "spire-<ablation>"."""
    cache = {} if cfg.target_cache is None else {"data_steps": cfg.cache_steps, "target_cache": cfg.target_cache}
    if cfg.hidden_weight:
        cache["hidden_weight"] = cfg.hidden_weight
    runs = [("spire", TrainConfig(k=cfg.k, seed=cfg.seed, draft_config=spire_arch, **cache, eval_every=cfg.eval_every,
                                  compile=cfg.compile, **_limits(cfg.budget_s, cfg.steps))),
            ("vanilla", TrainConfig(draft="vanilla", k=cfg.k, seed=cfg.seed, compile=cfg.compile,
                                    **_limits(vanilla_seconds(cfg), cfg.vanilla_steps)))]
    if cfg.eagle3:  # the same budget as SPIRe (seconds, or steps when SPIRe trains by steps): equal training compute
        budget = cfg.budget_s if cfg.eagle3_budget_s is None else cfg.eagle3_budget_s
        steps = cfg.eagle3_steps if cfg.eagle3_steps is not None else (cfg.steps if cfg.eagle3_budget_s is None
                                                                       else None)
        shared = {k: v for k, v in cache.items() if k != "hidden_weight"}  # SPIRe's term: its layers only
        runs.append(("eagle3", TrainConfig(draft="eagle3", k=cfg.k, seed=cfg.seed, **shared, eval_every=cfg.eval_every,
                                           compile=cfg.compile, **_limits(budget, steps))))
    for name in registry.names(trains=True):  # a kind added to the registry: its own defaults, SPIRe's amount
        if name not in RECIPE_KINDS:
            runs.append((name, TrainConfig(draft=name, k=cfg.k, seed=cfg.seed, eval_every=cfg.eval_every,
                                           compile=cfg.compile, **_limits(cfg.budget_s, cfg.steps))))
    for a in cfg.ablations:
        run = ablation_config(a, k=cfg.k, seed=cfg.seed, draft_config=spire_arch, **cache, eval_every=cfg.eval_every,
                              compile=cfg.compile,
                              **_limits(cfg.ablation_budget_s, cfg.ablation_steps))
        if not run.draft_config.target_activations:  # the matching term reads target activations: this ablation has none
            run.hidden_weight = 0.0
        runs.append((f"spire-{a}", run))
    for _, run in runs:  # every run's settings checked before the first one trains (one error line, nothing lost)
        run.validate()
    return runs


def _training_summary(run_dir: Path, train_cfg: TrainConfig, model, state: dict) -> dict:
    """What results.json records of one training run."""
    return {
        "run_dir": str(run_dir), "draft": train_cfg.draft, "ablation": train_cfg.ablation,
        "steps": state["step"], "tokens": state["tokens"], "elapsed_s": state["elapsed_s"],
        "tokens_per_s": state["tokens"] / max(state["elapsed_s"], 1e-9), "bf16": train_cfg.bf16,
        "lr": train_cfg.lr, "loss": train_cfg.resolved_loss(), "omega": train_cfg.omega,
        "batch_size": train_cfg.batch_size, "seq_len": train_cfg.seq_len, "hidden_weight": train_cfg.hidden_weight,
        "draft_body_params": sum(p.numel() for p in model.layers.parameters())
        + sum(p.numel() for p in getattr(model, "fc", torch.nn.Identity()).parameters()),
        "source_layers": list(getattr(model, "source_layers", None) or getattr(model, "layer_ids", ())) or None,
        "draft_vocab": None if model.vocab is None else len(model.vocab),
        "target_cache": None if train_cfg.target_cache is None or train_cfg.draft == "vanilla" else {
            "batches": train_cfg.data_steps, "dtype": train_cfg.target_cache,
            "tokens": train_cfg.data_steps * train_cfg.batch_size * train_cfg.seq_len},
        "heldout_alpha_per_position": state["heldout"]["alpha_per_position"], "heldout_loss": state["heldout"]["loss"],
        "heldout_curve": heldout_curve(run_dir), "compile_s": compile_seconds(run_dir),
        "bridge": bridge_fit(run_dir) if getattr(model, "bridge", None) is not None else None,
        "history": state["history"]}


def shared_target_cache(runs: list, target, data, folder: Path, progress: bool, log) -> TargetCache | None:
    """One target cache for every run that trains from one (SPIRe, EAGLE-3, the ablations): built once over the
    union of the target layers they read, so each run finds it (a cache holding more layers serves a run that
    reads fewer: :meth:`TargetCache.build`) and the target runs over the cached batches once, not once per draft.
    None when fewer than two runs share cache settings (each builds its own as before)."""
    cached = [c for _, c in runs if c.target_cache is not None]
    if len({c.draft for c in cached}) < 2:
        return None
    first = cached[0]
    shape = ("batch_size", "seq_len", "seed", "data_steps", "target_cache", "bf16")
    if any(any(getattr(c, f) != getattr(first, f) for f in shape) for c in cached):
        return None
    layers, teacher = set(), False
    for c in cached:
        model = registry.trainable_class(c.draft).for_training(target, c, data)
        layers |= set(model.target_layers())
        teacher = teacher or needs_teacher(model, c)
        del model
    bf16 = first.bf16 if first.bf16 is not None else fast_bf16(target.device)
    log(f"      one target cache for {', '.join(dict.fromkeys(c.draft for c in cached))}: layers {sorted(layers)}")
    return TargetCache.build(target, data, tuple(sorted(layers)), teacher, first.batch_size, first.seq_len, first.seed,
                             first.data_steps, first.target_cache, folder=folder, bf16=bf16, progress=progress,
                             log=log)


def _train(cfg: ReproduceConfig, runs: list, target, data, windows, folder: Path, progress: bool, log
           ) -> tuple[dict, dict, dict]:
    """Step 3: train (or find trained) every run once. Returns (models, training summaries, states) by label."""
    trained, training, states, by_config = {}, {}, {}, {}
    if not all(_draft_dir(cfg, c, folder, label).joinpath("draft.safetensors").is_file() for label, c in runs
               if c.target_cache is not None):
        shared_target_cache(runs, target, data, folder, progress, log)
    n_procs, threads = training_processes(cfg, target.device)
    for label, train_cfg in runs:
        if label == "vanilla" and cfg.vanilla_token_share is not None and cfg.vanilla_steps is None:
            # a fair baseline: at least this share of SPIRe's training tokens (capped by vanilla_budget_s)
            per_step = train_cfg.batch_size * train_cfg.seq_len
            train_cfg.max_steps = max(1, math.ceil(cfg.vanilla_token_share * states["spire"]["tokens"] / per_step))
        settings = json.dumps(train_cfg.to_dict(), sort_keys=True, default=str)
        same = by_config.setdefault(settings, label)
        if same != label:  # e.g. ablation "none" at the main draft's budget: the same run, trained once
            log(f"      {label}: the same settings as {same}, not trained again")
            trained[label], training[label], states[label] = trained[same], training[same], states[same]
            continue
        run_dir = _draft_dir(cfg, train_cfg, folder, label)
        # the vanilla draft trains in one process: its step is light and its gradient (a full-vocabulary
        # embedding) heavy, so averaging gradients across processes costs more than it saves (measured: 490 against
        # 615 tokens/s on 2 cores)
        procs, n_threads = (n_procs, threads) if train_cfg.draft != "vanilla" else (1, torch.get_num_threads())
        model, state = train_in_processes(target, data, run_dir, train_cfg, procs, n_threads, heldout=windows,
                                          target_folder=folder, progress=progress, log=log)
        states[label], trained[label] = state, model
        log(f"      {label}: {state['step']} steps, {state['tokens']:,} tokens, held-out alpha per drafted position "
            f"{', '.join(f'{a:.3f}' for a in state['heldout']['alpha_per_position'])}")
        training[label] = {**_training_summary(run_dir, train_cfg, model, state), "processes": procs,
                           "threads_per_process": n_threads}
    return trained, training, states


class _TauMeter:
    """Steps 4-5: τ rows of the job's drafts, from the measurement cache when there (:func:`_tau_key`), the
    rest measured together from one prefill per batch (:func:`measure_tau_shared`)."""

    def __init__(self, cfg: ReproduceConfig, target, folder: Path, trained: dict, training: dict, states: dict,
                 progress: bool) -> None:
        self.cfg, self.target, self.folder, self.progress = cfg, target, folder, progress
        self.trained, self.training, self.states = trained, training, states

    def draft(self, name: str):
        if name in self.trained:
            return self.trained[name].as_draft()
        return make_draft(name, self.target, **registry.options_of(name, sink=self.cfg.sink, window=self.cfg.window))

    def identity(self, name: str) -> dict:
        if name in self.trained:
            return {"run_dir": self.training[name]["run_dir"], "step": self.states[name]["step"]}
        return {name: [self.cfg.sink, self.cfg.window]}  # an untrained kind: its settings

    def measure(self, names: list[str], ctx: torch.Tensor, temperature: float, k: int | None = None) -> list[dict]:
        """One row per name, in order, on contexts ``ctx`` (N, L) at ``temperature`` (k: draft tokens per round,
        default the job's)."""
        cfg = self.cfg
        k = cfg.k if k is None else k
        batch = _tau_batch(cfg, ctx.shape[1])
        rows, todo = {}, {}
        for name in names:
            key = _tau_key(self.folder, self.identity(name), ctx, cfg, temperature, batch, k)
            cached = _tau_cache_get(key)
            if cached is not None:
                rows[name] = {**cached, "draft": name, "cached": True}
            else:
                todo[name] = key
        first = {}  # key -> the first name with it (e.g. "spire-none" is "spire" at the same budget)
        for name, key in todo.items():
            first.setdefault(key, name)
        if first:
            measured = measure_tau_shared(self.target, {name: self.draft(name) for name in first.values()}, ctx,
                                          G=cfg.G, k=k, params=SamplingParams(temperature), batch_size=batch,
                                          seed=cfg.seed, progress=self.progress)
            for key, name in first.items():
                _tau_cache_put(key, measured[name].to_dict(per_context=True))
            for name, key in todo.items():
                rows[name] = {**measured[first[key]].to_dict(per_context=True), "draft": name}
        return [rows[name] for name in names]


def _measure_taus(cfg: ReproduceConfig, meter: _TauMeter, names: list[str], contexts, sweep: dict, log,
                  timings: dict) -> tuple[list[dict], list[dict]]:
    """Steps 4-5: τ of every draft at L and each temperature, then τ vs L and τ vs k (greedy, every draft kind;
    ablations only at L)."""
    log(f"[4/6] tau: {cfg.n_contexts} held-out contexts, L={cfg.L}, G={cfg.G}, k={cfg.k}")
    t = time.time()
    taus = []
    for temperature in cfg.temperatures:
        for r in meter.measure(names, contexts, temperature):
            log(f"      {r['draft']:28s} T={temperature:g}: tau {r['tau']:.3f} [{r['ci_low']:.3f}, "
                f"{r['ci_high']:.3f}] " + ("(cached)" if r.get("cached") else f"({r['wall_s']:.0f} s)"))
            taus.append(r)
    timings["tau_s"] = time.time() - t

    kinds = [n for n in names if n in registry.names()]  # every draft kind, no ablation
    log(f"[5/6] tau vs L: L in {list(cfg.tau_Ls)}, {cfg.tau_L_contexts} contexts each, greedy")
    t = time.time()
    tau_vs_L = []
    for L, ctx in sweep.items():
        for r in meter.measure(kinds, ctx, 0.0):
            log(f"      L={L:5d} {r['draft']:9s}: tau {r['tau']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
                + (" (cached)" if r.get("cached") else ""))
            tau_vs_L.append(r)
    timings["tau_vs_L_s"] = time.time() - t

    tau_vs_k = []
    if cfg.tau_ks:
        log(f"      tau vs k: k in {list(cfg.tau_ks)}, {cfg.tau_k_contexts} contexts of L={cfg.L}, greedy")
        t = time.time()
        for k in cfg.tau_ks:
            for r in meter.measure(kinds, contexts[: cfg.tau_k_contexts], 0.0, k=k):
                log(f"      k={k} {r['draft']:9s}: tau {r['tau']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
                    + (" (cached)" if r.get("cached") else ""))
                tau_vs_k.append({**r, "k": k})
        timings["tau_vs_k_s"] = time.time() - t
    return taus, tau_vs_L, tau_vs_k


def _diagnose(cfg: ReproduceConfig, meter: _TauMeter, names: list[str], contexts, log, timings: dict,
              natural=None) -> list[dict]:
    """Step 5b: the T = 1 diagnosis (:mod:`spire.evaluation.diagnose`) of every draft whose kind is
    :attr:`~spire.registry.Kind.diagnosable` (not n-gram: its q is one-hot, nothing to diagnose) on the first
    ``diagnose_contexts`` contexts at L, with their held-out continuations ``natural`` (n, G) for the overlap on
    natural text against the rounds' text; cached as τ rows are."""
    if not cfg.diagnose_contexts:
        return []
    ctx = contexts[: cfg.diagnose_contexts]
    natural = None if natural is None else natural[: cfg.diagnose_contexts]
    names = [n for n in names if "-" not in n and registry.kind(n).diagnosable]  # the kinds' drafts, no ablation
    log(f"      diagnosis at T = 1: {', '.join(names)} on {len(ctx)} contexts of L={cfg.L}")
    t = time.time()
    rows, todo = [], {}
    for name in names:
        key = "diagnosis-" + ("" if natural is None else "texts2-") + _tau_key(  # texts2: outside_mass by text
            meter.folder, meter.identity(name), ctx, cfg, 1.0, _tau_batch(cfg, cfg.L))
        cached = _tau_cache_get(key)
        if cached is not None:
            rows.append({"name": name, "diagnosis": cached})
        else:
            todo[name] = key
    if todo:
        found = diagnose_shared(meter.target, {n: meter.draft(n) for n in todo}, ctx, G=cfg.G, k=cfg.k,
                                params=SamplingParams(1.0), batch_size=_tau_batch(cfg, cfg.L), seed=cfg.seed,
                                progress=meter.progress, natural=natural)
        for name, key in todo.items():
            d = found[name].to_dict()
            _tau_cache_put(key, d)
            rows.append({"name": name, "diagnosis": d})
    rows.sort(key=lambda r: names.index(r["name"]))
    timings["diagnosis_s"] = time.time() - t
    return rows


def _results(cfg: ReproduceConfig, target, folder: Path, data, training: dict, taus: list, tau_vs_L: list,
             tau_vs_k: list, timings: dict) -> dict:
    """The results dict (results.json)."""
    return {
        "preset": cfg.preset,
        "config": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                   for k, v in asdict(cfg).items()},
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                        "threads": torch.get_num_threads(), "device": str(target.device),
                        "backend": backend_of(target).describe()},
        "target": {"name": cfg.target or cfg.preset, "checkpoint": str(folder), "config": target.cfg.to_dict(),
                   "layers": target.cfg.n_layers, "d_model": target.cfg.d_model,
                   "body_params": target.num_body_params()},
        "data": data.summary(),
        "training": training["spire"],  # kept for readers of earlier results.json
        "trainings": training,
        "tau": taus,
        "tau_vs_L": tau_vs_L,
        "tau_vs_k": tau_vs_k,
        "timings": timings,
        "provenance": provenance(),  # the command, the commit, the machine and the date (spire.provenance)
    }


def reproduce(cfg: ReproduceConfig, progress: bool = True, log=print) -> dict:
    """Run the whole job and write REPORT.md, results.json and PNG figures to ``cfg.out``.

    Returns the results dict (also written as results.json). Raises SpireError subclasses on bad input,
    before anything is written to the output folder.
    """
    cfg.validate()
    t_start = time.time()
    timings: dict[str, float] = {}
    torch.manual_seed(cfg.seed)
    target, folder, data, contexts, sweep, windows = _load(cfg, progress, log, timings)

    spire_arch = spire_architecture(cfg, target.cfg.n_layers, target.cfg.vocab_size)
    if cfg.draft_vocab is not None and spire_arch.vocab_size is None:
        log(f"      a draft vocabulary of {cfg.draft_vocab} covers the target's whole vocabulary "
            f"({target.cfg.vocab_size}): SPIRe's head is the full one")
    runs = training_runs(cfg, spire_arch)
    log(f"[3/6] drafts: SPIRe ({cfg.n_draft_layers} of {target.cfg.n_layers} target layers "
        f"{list(spire_arch.source_layers(target.cfg.n_layers))}"
        + (f", draft vocabulary {spire_arch.vocab_size}" if spire_arch.vocab_size else "")
        + (f", target cache of {cfg.cache_steps} batches ({cfg.target_cache})" if cfg.target_cache else "") + ", "
        f"{_amount(cfg.budget_s, cfg.steps)}), vanilla ({_amount(vanilla_seconds(cfg), cfg.vanilla_steps)})"
        + "".join(f", {label} ({_amount(r.budget_s, r.max_steps)})" for label, r in runs
                  if label in registry.names(trains=True) and label not in ("spire", "vanilla"))
        + (f", {len(cfg.ablations)} ablations ({_amount(cfg.ablation_budget_s, cfg.ablation_steps)} each)"
           if cfg.ablations else ""))
    t = time.time()
    trained, training, states = _train(cfg, runs, target, data, windows, folder, progress, log)
    timings["train_s"] = time.time() - t

    meter = _TauMeter(cfg, target, folder, trained, training, states, progress)
    names = [n for n in registry.names(drafts_only=True) if n in trained or not registry.kind(n).trains]
    names += [label for label, _ in runs if label not in names]
    taus, tau_vs_L, tau_vs_k = _measure_taus(cfg, meter, names, contexts, sweep, log, timings)
    natural = data.heldout_contexts(cfg.L, cfg.G, cfg.n_contexts, seed=cfg.seed)[:, cfg.L:]  # what follows each
    diagnosis = _diagnose(cfg, meter, names, contexts, log, timings, natural)

    log("[6/6] throughput model and report")
    results = _results(cfg, target, folder, data, training, taus, tau_vs_L, tau_vs_k, timings)
    results["diagnosis"] = diagnosis
    write_report(results, cfg, t_start)
    return results
