"""Run one training of a draft (SPIRe, or the vanilla baseline) against its target (SPIRe paper §3.5-3.6, §4).

Each step: a global batch of training windows is drawn from a generator seeded by (seed, step); the frozen
target runs on it when the draft needs its activations or the loss needs its distribution (under bf16
autocast when asked); the draft computes teacher-forced logits (SPIRe: the k-pass procedure of
:meth:`SpireDraftModel.forward_train`; vanilla: one causal pass) and is trained by AdamW with linear warmup
and cosine decay to 10 %, gradient clipping, and MixedLoss(omega) or HardTargetLoss.

The trainer never asks which class of draft it has: ``TrainConfig.draft`` names a class in
:mod:`spire.registry` (its kind's ``KIND.model``), and every draft model implements the training interface
:class:`spire.drafts.base.TrainableDraft` (target layers it reads, teacher-forced logits, draft vocabulary,
checkpoint, export). The run is a :class:`Trainer` in pieces (setup, step, checkpoint, evaluate, finish) that
:func:`train_draft` drives.

Runs are resumable and exact: the batch of step s depends only on (seed, s), the learning rate on s (when
``max_steps`` is set; with only a time budget it follows the saved elapsed time), and the checkpoint holds
the draft, the AdamW state and the JSON state. A checkpoint is a folder replaced atomically
(:func:`spire.paths.replace_dir`), so a run killed at any instant resumes from the last complete one; a
non-finite loss stops the run with :class:`TrainingError` and keeps that checkpoint.

Data parallel: under ``torchrun`` (``torch.distributed`` initialized, gloo on CPU, NCCL on GPU) every
process draws the same global batch, takes its own equal share of the rows, and gradients are averaged
across processes before each update, so N processes follow the same trajectory as one process with the
same global batch (tests/test_trainer.py). Only rank 0 writes files.

Run folder layout: ``checkpoint/`` (draft.safetensors, optimizer.pt, train_state.json), ``train_log.jsonl``
(one JSON object per logged step and per held-out evaluation) and the exported draft:
``draft.safetensors`` (SPIRe; ``spire generate --draft spire --draft-path``) or ``draft/`` (vanilla, an HF
Llama folder; ``--draft vanilla --draft-path``).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from spire.backend import of as backend_of
from spire.drafts.base import TrainableDraft
from spire.errors import CheckpointError, ConfigError, TrainingError
from spire.model import Transformer
from spire.paths import atomic_write, existing_dir, replace_dir
from spire.training.checkpoint import _check_saved_config, load_state, read_log, refuse_existing_run
from spire.training.config import (CHECKPOINT_DIR, DRAFT_FILE, LOG_FILE, OPTIM_FILE, STATE_FILE, TrainConfig,
                                   init_draft_settings, init_weights_file)
from spire.training.evaluate import evaluate_heldout, make_source
from spire.training.ranks import _distributed, wait_for_rank0
from spire.training.runfolder import RunLock, check_fresh_folder, remove_stale_temporaries
from spire.training.sources import TeacherBatch
from spire.training.step import (_build_model, _inductor_cache, _lr_at, compile_draft, fast_bf16, make_optimizer,
                                 step_loss, uncompile_draft)


def limits_reached(cfg: TrainConfig, state: dict) -> bool:
    """Whether a run at ``state`` (its "step" and "elapsed_s") has reached ``cfg``'s time budget or step count:
    nothing more to train."""
    return state["elapsed_s"] >= cfg.budget_s or (cfg.max_steps is not None and state["step"] >= cfg.max_steps)


class Trainer:
    """One training run in a run folder, in pieces: :meth:`__init__` (setup: settings, the saved run, the
    draft, the optimizer), :meth:`step` (one optimizer step and its log line), :meth:`checkpoint`,
    :meth:`evaluate` and :meth:`finish`; :func:`train_draft` drives them. Arguments as for :func:`train_draft`.
    """

    def __init__(self, target: Transformer, data, out_dir: Path, cfg: TrainConfig, heldout: torch.Tensor | None,
                 resume: bool | None, target_folder: Path | None, log) -> None:
        cfg.validate()
        if cfg.bf16 is None:
            cfg.bf16 = fast_bf16(target.device)
        self.dist, self.rank, self.world = _distributed()
        if cfg.batch_size % self.world:
            raise ConfigError(f"the global batch {cfg.batch_size} must be divisible by the {self.world} processes")
        if heldout is not None and heldout.shape[1] % cfg.k:
            raise ConfigError(f"held-out windows of {heldout.shape[1]} tokens are not a multiple of k={cfg.k}")
        self.target, self.data, self.out_dir, self.cfg, self.heldout = target, data, Path(out_dir), cfg, heldout
        self.target_folder, self.log = target_folder, log
        self.bar = self.source = None
        self.ema_loss = self.ema_alpha = None
        self.hidden_mismatch: float | None = None  # the last step's hidden-state mismatch (hidden_weight > 0)
        self.started: dict | None = None  # what the draft did before a fresh run's first step (its log event)
        if self.rank == 0:  # the lock is held: what a killed writer left half-written is removed
            remove_stale_temporaries(self.out_dir)
        self.model = self._setup_model(resume)
        self.meta = {"ablation": cfg.ablation, "loss": cfg.resolved_loss(), "omega": cfg.omega, "k": cfg.k}
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = make_optimizer(self.params, cfg, backend_of(self.model))
        ckpt = existing_dir(self.out_dir / CHECKPOINT_DIR)
        if ckpt is not None and self.state["step"] > 0:
            if not (ckpt / OPTIM_FILE).is_file():
                raise CheckpointError(f"{ckpt} holds no {OPTIM_FILE}: the checkpoint is incomplete and cannot be "
                                      "resumed exactly")
            # onto this run's device, whichever device wrote it (a GPU run resumed on a CPU, or the reverse)
            self.opt.load_state_dict(torch.load(ckpt / OPTIM_FILE, map_location=target.device, weights_only=True))
            for group in self.opt.param_groups:  # a saved group names its implementation: keep this trainer's
                group.update(fused=self.opt.defaults.get("fused"), foreach=self.opt.defaults.get("foreach"))
        if self.rank == 0 and (self.out_dir / LOG_FILE).is_file():  # drop log lines written after the checkpoint
            rows, torn = read_log(self.out_dir / LOG_FILE)
            if torn and log is not None:
                log(f"      dropped {torn} torn line(s) at the end of {self.out_dir / LOG_FILE} (a crash or a full disk "
                    "while it was written)")
            atomic_write(self.out_dir / LOG_FILE, None,
                         "".join(json.dumps(r) + "\n" for r in rows if r.get("step", 0) <= self.state["step"]))

    def _setup_model(self, resume: bool | None) -> TrainableDraft:
        """The draft, and ``self.state``: from the saved run (checked against the settings), or fresh."""
        out_dir, cfg = self.out_dir, self.cfg
        state = load_state(out_dir)
        cfg_dict = json.loads(json.dumps(cfg.to_dict()))
        if resume is True and state is None:
            raise CheckpointError(f"nothing to resume: {out_dir} holds no checkpoint")
        if resume is False:
            refuse_existing_run(out_dir, state)
        model = _build_model(self.target, cfg, self.data)
        if state is not None:
            _check_saved_config(out_dir, state, cfg_dict)
            model.load_checkpoint(existing_dir(out_dir / CHECKPOINT_DIR) / DRAFT_FILE, self.target)
        else:
            source = None if cfg.init_from is None else self._init_from(model)  # before anything is written
            state = {"step": 0, "tokens": 0, "elapsed_s": 0.0, "finished": False, "history": [], "heldout": None}
            if self.rank == 0:
                out_dir.mkdir(parents=True, exist_ok=True)
                atomic_write(out_dir / LOG_FILE, None, "")
            if source is not None:  # a trained draft's weights (its bridge, if any, came fitted with them)
                event = {"event": "init", "from": str(source), "message": f"starting from the draft {source}"}
            else:
                start = getattr(model, "start_training", None)  # e.g. SPIRe's bridge, fitted to the target
                event = start(self.data, cfg) if start is not None else None
            if event is not None:  # logged as an event; its "message" is shown after the banner
                self.write_log({**{k: v for k, v in event.items() if k != "message"}, "step": 0})
                self.started = event
        state["config"] = cfg_dict
        state["heldout_windows"] = 0 if self.heldout is None else int(self.heldout.shape[0])  # for a resume
        self.state = state
        # which path runs: at the start, and at a resume that runs another way (the same results to rounding)
        backend = backend_of(model).describe()
        if state["step"] == 0 or backend != self._logged_backend():
            self.write_log({"event": "backend", "step": state["step"], **backend})
        return model.train()

    def _init_from(self, model: TrainableDraft) -> Path:
        """Load ``cfg.init_from``'s weights into ``model``; returns the draft file read. Raises ConfigError (no
        draft there) or CheckpointError (another kind, other settings or another target)."""
        source = init_weights_file(self.cfg.init_from)
        init_draft_settings(source, self.cfg.draft)  # a draft of this kind (each kind's loader checks its settings)
        model.load_checkpoint(source, self.target)
        return source

    def _logged_backend(self) -> dict | None:
        """The last backend the run's log records (without its event and step), or None."""
        path = self.out_dir / LOG_FILE
        rows = read_log(path)[0] if path.is_file() else []
        last = next((r for r in reversed(rows) if r.get("event") == "backend"), None)
        return None if last is None else {k: v for k, v in last.items() if k not in ("event", "step")}

    def done(self) -> bool:
        return limits_reached(self.cfg, self.state)

    def start(self, progress: bool) -> None:
        """The data source (a target cache may be built first, with its own bar) and the training bar."""
        cfg, state, rank = self.cfg, self.state, self.rank
        if self.done() and state["finished"]:
            if self.log is not None and rank == 0:
                self.log(f"      {self.out_dir.name}: finished run found ({state['step']} steps), not trained again")
            progress = False  # nothing to train: no bar
        elif not self.done():
            self.source = make_source(self.target, self.data, self.model, cfg, self.target_folder,
                                      progress and rank == 0, self.log if rank == 0 else None)
        if progress and rank == 0:
            total, initial, unit = ((cfg.max_steps, state["step"], "step") if cfg.max_steps is not None
                                    else (round(cfg.budget_s), round(state["elapsed_s"]), "s"))
            self.bar = tqdm(total=total, initial=initial, unit=unit, dynamic_ncols=True,
                            desc=f"train {cfg.draft} draft")

    def rows(self) -> slice:
        """This process's rows of the global batch."""
        return slice(self.rank * self.cfg.batch_size // self.world, (self.rank + 1) * self.cfg.batch_size // self.world)

    def warm_up(self) -> None:
        """With cfg.compile: compile the draft's training step (:func:`compile_draft`) on this process's rows of the
        next batch, two forwards and backwards whose gradients are dropped, before the training clock starts; its
        seconds go to the log (a "compile" event; "compiled" false when any process trains eagerly). Where
        torch.compile fails (no C++ compiler, a backend it lacks, an interpreter it refuses) training goes on
        eagerly, with a log line: the same computation, slower. Under data parallelism the processes wait for each
        other here, so no compile falls into the first step's time."""
        if not self.cfg.compile or self.done():
            return
        show = self.log if self.rank == 0 else None
        if show is not None:
            (self.bar.write if self.bar is not None else show)(
                "      compiling the draft's training step (torch.compile: minutes the first time on this machine)")
        t0, ok = time.time(), True
        tb = self.source.batch(self.state["step"], self.rows())
        try:
            compile_draft(self.model)  # torch.compile itself refuses some interpreters
            # twice: the second pass recompiles the pieces whose guards the first one's side effects changed (the
            # bf16 weight copies it kept); cold, that recompile took ~2 minutes of the first training step
            for _ in range(2):
                loss, _ = step_loss(self.model, self.target, tb, self.cfg)
                loss.backward()
        except Exception as e:  # torch._dynamo / inductor errors: train eagerly instead
            uncompile_draft(self.model)
            ok = False
            if show is not None:
                first = (str(e).strip().splitlines() or [""])[0][:200]
                show(f"      torch.compile failed here ({type(e).__name__}: {first}); training without it (after an "
                     f"interrupted compile, delete inductor's cache folder: {_inductor_cache()})")
        finally:
            for p in self.params:
                p.grad = None
        if self.dist is not None:  # every process compiled (or not) before the clock starts; the log says if all did
            flag = torch.tensor([float(ok)], device=self.target.device)
            self.dist.all_reduce(flag, op=self.dist.ReduceOp.MIN)
            ok = bool(flag.item())
        self.write_log({"event": "compile", "step": self.state["step"], "seconds": round(time.time() - t0, 1),
                        "compiled": ok})

    def write_log(self, entry: dict) -> None:
        if self.rank == 0:
            with open(self.out_dir / LOG_FILE, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def evaluate(self) -> None:
        """The held-out loss and alpha (when there are held-out windows), logged and kept in the state."""
        if self.heldout is None:
            return
        state = self.state
        if self.dist is not None:  # rank 0 evaluates with every process's threads while the others wait
            ev = None
            if self.rank == 0:
                threads = torch.get_num_threads()
                torch.set_num_threads(threads * self.world)
                ev = evaluate_heldout(self.model, self.target, self.heldout, self.cfg)
                torch.set_num_threads(threads)
            wait_for_rank0(self.dist)
            if ev is None:
                return
        else:
            ev = evaluate_heldout(self.model, self.target, self.heldout, self.cfg)
        self.model.train()
        if not all(math.isfinite(v) for v in (ev["loss"], ev["alpha"])):  # a draft that cannot be used: no write
            self.stop(f"non-finite held-out loss ({ev['loss']}) or alpha ({ev['alpha']}) at step {state['step']}",
                      "lower --lr or check the data")
        state["heldout"] = {"step": state["step"], **ev}
        self.write_log({"event": "eval", "step": state["step"], "tokens": state["tokens"], **ev})
        if self.bar is not None:
            self.bar.write(f"step {state['step']}: held-out loss {ev['loss']:.4f}, alpha "
                           + " ".join(f"{a:.3f}" for a in ev["alpha_per_position"]))

    def stop(self, what: str, advice: str) -> None:
        """Raise TrainingError for ``what`` (a non-finite value): the run stops, its last good checkpoint kept."""
        if self.bar is not None:
            self.bar.close()
        last = load_state(self.out_dir)
        raise TrainingError(f"{what}; the last good checkpoint (step {last['step'] if last else 0}) in "
                            f"{self.out_dir} is kept: {advice}")

    def checkpoint(self) -> None:
        """Replace the checkpoint folder (weights, AdamW state, JSON state) and the exported draft (rank 0). Weights
        with a NaN or infinite value are never written: TrainingError, the last good checkpoint kept."""
        model, target, state, meta = self.model, self.target, self.state, self.meta
        bad = next((n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())), None)
        if bad is not None:
            self.stop(f"the draft's weight {bad!r} holds NaN or infinite values at step {state['step']}",
                      "lower --lr or check the data")
        if self.rank == 0:
            def write(tmp: Path) -> None:
                model.save_checkpoint(tmp / DRAFT_FILE, target, {"train": {"step": state["step"]}, **meta})
                torch.save(self.opt.state_dict(), tmp / OPTIM_FILE)
                (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            replace_dir(self.out_dir / CHECKPOINT_DIR, write)
            model.export(self.out_dir, target, {"train": {"step": state["step"], "tokens": state["tokens"],
                                                          "finished": state["finished"]}, **meta}, self.target_folder)
        if self.dist is not None:
            wait_for_rank0(self.dist)

    def finish(self) -> tuple[TrainableDraft, dict]:
        """Mark the run finished (a last evaluation and checkpoint when it was not); the draft in eval mode."""
        if not self.state["finished"]:
            self.state["finished"] = True
            self.evaluate()
            self.checkpoint()
        if self.bar is not None:
            self.bar.close()
        uncompile_draft(self.model)
        return self.model.eval().requires_grad_(False), self.state

    def _update(self, lr: float, tb: TeacherBatch) -> tuple[float, float, float]:
        """Loss, backward, gradients averaged over the processes, clip, AdamW: (loss, alpha, grad norm).
        Raises TrainingError on a non-finite loss (before the update)."""
        cfg, state, dist, world = self.cfg, self.state, self.dist, self.world
        for g in self.opt.param_groups:
            g["lr"] = lr
        parts: dict = {}
        ce_scale = 1.0
        if dist is not None and cfg.resolved_loss() == "hard" and self.model.vocab is not None:
            # a draft vocabulary leaves each process its own count of valid targets: weigh its mean by its share
            # of the global count, so the averaged gradient is that of the mean over every valid target (as one
            # process computes it); a process without any contributes zero
            mine = float((self.model.to_draft_ids(tb.tokens[:, 1:]) >= 0).sum())
            total = torch.tensor([mine], dtype=torch.float64, device=self.target.device)
            dist.all_reduce(total)
            ce_scale = world * mine / max(float(total), 1.0)
        loss, alpha = step_loss(self.model, self.target, tb, cfg, parts, ce_scale)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        # the logged values in one tensor (NCCL: on the device), read back once below
        stats = torch.stack([loss.detach().float(), alpha.float(),
                             parts["hidden"].float() if "hidden" in parts else torch.zeros_like(alpha.float())])
        if dist is not None:  # average gradients (and the logged values) over the processes
            grads = [p.grad for p in self.params if p.grad is not None]
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat)
            flat /= world
            for g, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(new)
            dist.all_reduce(stats)
            stats /= world
        norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)  # a non-finite loss stops before the update
        # the step's one host sync: the values its log line writes
        loss_value, alpha, hidden, grad_norm = torch.cat([stats, norm.detach().float().reshape(1)]).tolist()
        self.hidden_mismatch = hidden if "hidden" in parts else None
        if not math.isfinite(loss_value):
            self.stop(f"non-finite loss ({loss_value}) at step {state['step'] + 1} (lr {lr:.2e})",
                      "lower --lr or check the data")
        if not math.isfinite(grad_norm):  # the update would write inf / NaN into the weights: stop before it
            self.stop(f"non-finite gradient norm ({grad_norm}) at step {state['step'] + 1} (loss {loss_value:.4g}, "
                      f"lr {lr:.2e})", "lower --lr or --grad-clip, or train without --bf16")
        self.opt.step()
        return loss_value, alpha, grad_norm

    def step(self) -> None:
        """One optimizer step on the batch of step ``state["step"]`` (this process's rows), its log line, the
        smoothed history and the bar."""
        cfg, state = self.cfg, self.state
        t0 = time.time()
        tb = self.source.batch(state["step"], self.rows())
        frac = state["step"] / cfg.max_steps if cfg.max_steps is not None else state["elapsed_s"] / cfg.budget_s
        lr = _lr_at(cfg, state["step"], frac)
        loss_value, alpha, grad_norm = self._update(lr, tb)
        dt = time.time() - t0
        if self.dist is not None:  # every process stops at the same step: rank 0's clock decides
            t = torch.tensor([dt], dtype=torch.float64, device=self.target.device)
            self.dist.broadcast(t, 0)
            dt = float(t)
        state["step"] += 1
        state["tokens"] += cfg.batch_size * cfg.seq_len
        state["elapsed_s"] += dt
        self.ema_loss = loss_value if self.ema_loss is None else 0.95 * self.ema_loss + 0.05 * loss_value
        if math.isfinite(alpha):
            self.ema_alpha = alpha if self.ema_alpha is None else 0.95 * self.ema_alpha + 0.05 * alpha
        entry = {"event": "train", "step": state["step"], "tokens": state["tokens"],
                 "elapsed_s": round(state["elapsed_s"], 3), "lr": lr, "loss": loss_value,
                 "alpha": alpha if math.isfinite(alpha) else None, "grad_norm": grad_norm,
                 "tokens_per_s": cfg.batch_size * cfg.seq_len / dt}
        if self.hidden_mismatch is not None:  # the matching term before its weight (loss includes weight × it)
            entry["hidden_mismatch"] = self.hidden_mismatch
        self.write_log(entry)
        if state["step"] % 10 == 0 or self.done():
            state["history"].append({"step": state["step"], "tokens": state["tokens"],
                                     "elapsed_s": round(state["elapsed_s"], 2), "loss": round(self.ema_loss, 4),
                                     "alpha": None if self.ema_alpha is None else round(self.ema_alpha, 4)})
        if self.bar is not None:
            bar = self.bar
            bar.update((state["step"] if cfg.max_steps is not None else round(state["elapsed_s"])) - bar.n)
            bar.set_postfix(loss=f"{self.ema_loss:.3f}", alpha="-" if self.ema_alpha is None else
                            f"{self.ema_alpha:.3f}", tok_s=f"{entry['tokens_per_s']:.0f}")


def train_draft(target: Transformer, data, out_dir: Path, cfg: TrainConfig | None = None,
                heldout: torch.Tensor | None = None, resume: bool | None = None, target_folder: Path | None = None,
                progress: bool = True, log=print, banner: str | None = None) -> tuple[TrainableDraft, dict]:
    """Train (or resume, or just load when finished) a draft in ``out_dir``.

    Args:
        target: frozen target model (float32 weights; bf16 autocast is used when cfg.bf16).
        data: an object with ``sample_train_batch(batch_size, seq_len, generator) -> (B, T) LongTensor``.
        out_dir: run folder (created); see the module docstring for its layout.
        cfg: :class:`TrainConfig`.
        heldout: optional (N, T) held-out windows (T a multiple of k) for the logged held-out loss and alpha.
        resume: True: continue the run in out_dir (CheckpointError if there is none); False: start a new run
            (ConfigError if out_dir already holds one); None: continue if there is one, else start.
        target_folder: the target's HF folder (its tokenizer files go into an exported vanilla draft).
        banner: a line for ``log`` (rank 0) once the settings, the saved run and its checkpoint have been checked
            and loaded, before any long work (a target cache, the steps): an error above comes before it.
    Returns:
        (draft model in eval mode, state dict with "step", "tokens", "elapsed_s", "finished", "history",
        "heldout" (the last evaluation), "config").
    Raises:
        ConfigError: invalid settings, a batch not divisible by the number of processes, or a saved run in
            out_dir with different settings. TrainingError: a non-finite loss (the last checkpoint is kept).
        CheckpointError / TokenizerMismatchError: unreadable checkpoint, or one for another target.
        DataError: the data cannot give windows of seq_len tokens.
    """
    cfg = TrainConfig() if cfg is None else cfg
    cfg.validate()  # impossible settings are refused before the folder is touched
    _, rank, _ = _distributed()
    if resume is not True and load_state(Path(out_dir)) is None:
        check_fresh_folder(out_dir)  # before the lock file or anything else is written
    with RunLock(out_dir, log) if rank == 0 else contextlib.nullcontext():
        return _train_locked(target, data, out_dir, cfg, heldout, resume, target_folder, progress, log, banner)


def _train_locked(target, data, out_dir, cfg, heldout, resume, target_folder, progress, log, banner):
    """:func:`train_draft` while rank 0 holds the run folder's lock."""
    run = Trainer(target, data, out_dir, cfg, heldout, resume, target_folder, log)
    if banner is not None and log is not None and run.rank == 0:
        log(banner)
    if run.started is not None and run.started.get("message") and log is not None and run.rank == 0:
        log(f"      {run.started['message']}")
    run.start(progress)
    if run.done():
        return run.finish()
    run.state["finished"] = False  # a finished run given a larger budget goes on
    # checkpoints every checkpoint_every seconds of training time: state["elapsed_s"] sums rank 0's step times,
    # broadcast, so every process decides alike (a clock of each process's own let one enter the checkpoint's
    # barrier while another entered the next step's all-reduce: a hang)
    last_ckpt = run.state["elapsed_s"]
    try:
        run.warm_up()
        while not run.done():
            run.step()
            if cfg.eval_every and run.state["step"] % cfg.eval_every == 0 and not run.done():
                run.evaluate()
            if run.state["elapsed_s"] - last_ckpt > cfg.checkpoint_every and not run.done():
                run.checkpoint()
                last_ckpt = run.state["elapsed_s"]
    except KeyboardInterrupt:  # close the bar first: what the caller prints next is not overdrawn
        if run.bar is not None:
            run.bar.close()
        raise
    return run.finish()
