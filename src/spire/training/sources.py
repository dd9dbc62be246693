"""Where a training step gets the frozen target's outputs: run the target live, or read them from an offline cache.

Both sources hand the trainer the same :class:`TeacherBatch` for a step: the batch's tokens, the residual
streams entering the draft's source layers (SPIRe's memory of target activations, paper §3.4) and the
teacher's distribution in a compact, exact form, its final normed hidden state h and log Z = logsumexp of its
logits. The frozen head gives log p = W h − log Z for any subset of the vocabulary (a draft vocabulary needs
N of the V columns, never the full softmax).

:class:`TargetCache` is the way the field's draft trainers scale (vllm-project/speculators, sgl-project/SpecForge
generate the target's hidden states once and train from disk): the target runs once over the ``data_steps``
batches of a run, and every later epoch, run and ablation with the same target, text, batch shape, seed and
source layers reads them back. It is a folder of numpy memory maps under ``<spire cache>/target-cache/``:

    tokens.npy (S·B, T) int32 · hidden_<j>.npy (S·B, T, d) · final.npy (S·B, T, d) and logz.npy (S·B, T) float32
    meta.json (written last; a folder without it is not a cache)

with hidden states stored in float32 (exact: training from it equals training live, bit for bit) or bfloat16
(half the bytes; stored as uint16); the teacher (final hidden state, log Z) is always float32, so p is exact. A build runs in ``<key>.partial/``, records the steps it has finished in
``progress.json`` after flushing them, resumes from there when interrupted, and is renamed to ``<key>/`` only
when complete, so an interrupted build never reads as a cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from spire import fastpath
from spire.errors import ConfigError, DataError
from spire.formats.draft_file import weights_digest
from spire.kv_cache import Span
from spire.model import Transformer
from spire.paths import atomic_write, spire_cache_dir

CACHE_VERSION = 1
STORAGE_DTYPES = ("float32", "bfloat16")


def step_generator(seed: int, step: int) -> torch.Generator:
    """The RNG that draws step ``step``'s batch: a function of (seed, step) only, so resumed runs are exact."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def autocast(enabled: bool, device: torch.device):
    """bf16 autocast on ``device`` when enabled, else a no-op context."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@dataclass
class TeacherBatch:
    """The frozen target's outputs on one step's batch.

    tokens: (B, T) int64. hidden: target layer j -> (B, T, d) float32 residual stream entering it. final:
    (B, T, d) float32 final hidden state after the target's final norm, or None when the loss needs no teacher.
    logz: (B, T) float32 logsumexp of the target's logits over its whole vocabulary. logits: (B, T, V) the
    full logits when the source has them anyway (the live target), else None.
    """

    tokens: torch.Tensor
    hidden: dict[int, torch.Tensor]
    final: torch.Tensor | None = None
    logz: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def target_logp(self, target: Transformer, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """The target's log-probabilities (B, T, N) of the N tokens ``vocab`` (None: all V), normalized over its
        whole vocabulary (so with a draft vocabulary they sum to at most 1)."""
        if self.final is None:
            raise ConfigError("this batch carries no teacher distribution (the loss did not ask for one)")
        if vocab is None and self.logits is not None:
            return self.logits - self.logz[..., None]
        if vocab is None:
            return head_logits(self.final, target.lm_head.weight, target, "head").sub_(self.logz[..., None])
        return head_logits(self.final, vocab_rows(target, vocab), target, "vocab_rows").sub_(self.logz[..., None])


def vocab_rows(target: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """``target.lm_head.weight[ids]`` (N, d) for a draft vocabulary's ids (N,), kept on the target from one call to
    the next while the head and the ids live unchanged (the same rows were gathered anew on every training
    step)."""
    weight = target.lm_head.weight
    return fastpath.kept(target, "vocab_rows", (weight, ids), lambda: weight[ids].detach())


def head_logits(final: torch.Tensor, weight: torch.Tensor, owner: nn.Module, role: str) -> torch.Tensor:
    """(B, T, d) normed hidden states x (N, d) head rows -> (B, T, N) float32 logits, one matmul over B·T rows
    (the same call on both sources, so a float32 cache reproduces the live logits bit for bit; under CPU bf16
    autocast a bf16 matmul, with the rows' bf16 copy kept from step to step)."""
    B, T, d = final.shape
    w = fastpath.autocast_weight(weight, owner, role)
    return F.linear(final.reshape(B * T, d).to(weight.dtype), w).float().view(B, T, -1)


@torch.no_grad()
def run_target(target: Transformer, tokens: torch.Tensor, layers: tuple[int, ...], teacher: bool,
               bf16: bool = False) -> TeacherBatch:
    """The frozen target on (B, T) windows (positions 0..T-1): the residual streams entering ``layers`` and,
    when ``teacher``, the final normed hidden state, the full logits and log Z."""
    pos = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
    n = target.cfg.n_layers
    want = tuple(layers) + ((n,) if teacher else ())
    with autocast(bf16, tokens.device):
        out = target(tokens, pos, hidden_layers=want, span=Span((0,) * tokens.shape[0], tokens.shape[1]))
        hidden = {j: out.hidden[j].float() for j in layers}
        if not teacher:
            return TeacherBatch(tokens, hidden)
        final = target.model.norm(out.hidden[n]).float()
        logits = head_logits(final, target.lm_head.weight, target, "head")
    return TeacherBatch(tokens, hidden, final, torch.logsumexp(logits, -1), logits)


class LiveTarget:
    """Run the frozen target on each step's batch (the trainer's default data source).

    ``data`` gives ``sample_train_batch(batch_size, seq_len, generator)``; step s draws with the generator of
    (seed, s mod data_steps) (:func:`step_generator`), or of (seed, s) when data_steps
    is None.
    """

    def __init__(self, target: Transformer, data, layers: tuple[int, ...], teacher: bool, batch_size: int,
                 seq_len: int, seed: int, data_steps: int | None = None, bf16: bool = False) -> None:
        self.target, self.data, self.layers, self.teacher = target, data, tuple(layers), teacher
        self.batch_size, self.seq_len, self.seed, self.data_steps, self.bf16 = batch_size, seq_len, seed, data_steps, bf16

    def tokens(self, step: int) -> torch.Tensor:
        s = step if self.data_steps is None else step % self.data_steps
        return self.data.sample_train_batch(self.batch_size, self.seq_len, step_generator(self.seed, s))

    def batch(self, step: int, rows: slice = slice(None)) -> TeacherBatch:
        tokens = self.tokens(step)[rows].to(self.target.device)
        if not self.layers and not self.teacher:
            return TeacherBatch(tokens, {})
        return run_target(self.target, tokens, self.layers, self.teacher, self.bf16)


def target_identity(target: Transformer, folder: Path | str | None) -> dict:
    """What a cache of ``target``'s outputs depends on: its checkpoint, its configuration and the SHA-256 of every
    weight tensor's content (:func:`spire.formats.draft_file.weights_digest`, computed once per target), so a
    target changed in any value is another cache."""
    return {"checkpoint": None if folder is None else str(Path(folder).resolve()), "config": target.cfg.to_dict(),
            "weights_sha256": weights_digest(target)}


class TargetCache:
    """The target's outputs on the first ``data_steps`` batches of a run, on disk (module docstring).

    Build or open with :meth:`build`; read a step with :meth:`batch` (step s reads stored batch s mod S).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        meta_file = self.path / "meta.json"
        if not meta_file.is_file():
            raise DataError(f"{self.path} is not a complete target cache (no meta.json)")
        self.meta = json.loads(meta_file.read_text())
        self.steps, self.batch_size = self.meta["steps"], self.meta["batch_size"]
        self.layers = tuple(self.meta["layers"])
        self.teacher = self.meta["teacher"]
        self.dtype = self.meta["dtype"]
        self._arrays = {name: np.load(self.path / f"{name}.npy", mmap_mode="r") for name in self._names(
            self.layers, self.teacher)}

    @staticmethod
    def _names(layers: tuple[int, ...], teacher: bool) -> list[str]:
        return ["tokens", *(f"hidden_{j}" for j in layers), *(("final", "logz") if teacher else ())]

    @staticmethod
    def key(identity: dict, data_key: str | None, layers: tuple[int, ...], teacher: bool, batch_size: int,
            seq_len: int, seed: int, steps: int, dtype: str, bf16: bool = False) -> str:
        fields = {"v": CACHE_VERSION, "target": identity, "data": data_key, "layers": list(layers), "teacher": teacher,
                  "batch_size": batch_size, "seq_len": seq_len, "seed": seed, "steps": steps, "dtype": dtype}
        if bf16:  # only when set: the keys of caches built in float32 stay what they were
            fields["bf16"] = True
        blob = json.dumps(fields, sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:16]

    @staticmethod
    def size_bytes(steps: int, batch_size: int, seq_len: int, d_model: int, n_layers: int, teacher: bool,
                   dtype: str) -> int:
        """Bytes on disk of a cache: per token 4 (id) + n_layers x d x itemsize (hidden states) + with the teacher
        d x 4 + 4 (the final hidden state and log Z, always float32: the teacher's p stays exact)."""
        item = 4 if dtype == "float32" else 2
        return steps * batch_size * seq_len * (4 + n_layers * d_model * item + ((d_model + 1) * 4 if teacher else 0))

    @classmethod
    def build(cls, target: Transformer, data, layers: tuple[int, ...], teacher: bool, batch_size: int,
              seq_len: int, seed: int, steps: int, dtype: str = "bfloat16", root: Path | None = None,
              folder: Path | str | None = None, bf16: bool = False, progress: bool = True, log=print
              ) -> "TargetCache":
        """Open the cache of these settings, building (or finishing) it first when needed.

        Args:
            target: the frozen target. data: the training text (``sample_train_batch``, ``manifest["key"]``).
            layers: target layers whose input residual streams are stored. teacher: store the teacher
                distribution (final normed hidden state and log Z). batch_size, seq_len, seed: the run's batch
                shape and seed (batch s is drawn as the live trainer draws step s). steps: batches stored.
            dtype: "float32" (exact) or "bfloat16" (hidden states rounded to bf16; the teacher stays float32).
            root: parent folder (default ``<spire cache>/target-cache``). folder: the target's checkpoint folder
                (part of the key). bf16: run the target under bf16 autocast (as a live bf16 run does; part of
                the key when set).
        Raises:
            ConfigError: unknown dtype, non-positive sizes. DataError: not enough free disk for the cache.
        """
        if dtype not in STORAGE_DTYPES:
            raise ConfigError(f"target cache dtype must be one of {', '.join(STORAGE_DTYPES)}, got {dtype!r}")
        if min(batch_size, seq_len, steps) < 1:
            raise ConfigError("target cache: batch size, sequence length and steps must be >= 1")
        layers = tuple(sorted(set(int(j) for j in layers)))
        root = Path(root) if root is not None else spire_cache_dir() / "target-cache"
        identity, data_key = target_identity(target, folder), getattr(data, "manifest", {}).get("key")
        key = cls.key(identity, data_key, layers, teacher, batch_size, seq_len, seed, steps, dtype, bf16)
        base = cls.key(identity, data_key, (), False, batch_size, seq_len, seed, steps, dtype, bf16)
        final_dir, part = root / key, root / f"{key}.partial"
        if (final_dir / "meta.json").is_file():
            if log is not None:
                log(f"      target cache: reusing {final_dir} (built earlier for these settings)")
            return cls(final_dir)
        for meta_file in sorted(root.glob("*/meta.json")) if root.is_dir() else []:  # a cache that holds more
            meta = json.loads(meta_file.read_text())
            if meta.get("base") == base and set(layers) <= set(meta["layers"]) and (meta["teacher"] or not teacher):
                if log is not None:
                    log(f"      target cache: reusing {meta_file.parent} (layers {meta['layers']})")
                return cls(meta_file.parent)
        d, rows = target.cfg.d_model, steps * batch_size
        need = cls.size_bytes(steps, batch_size, seq_len, d, len(layers), teacher, dtype)
        part.mkdir(parents=True, exist_ok=True)
        prog_file = part / "progress.json"
        done = json.loads(prog_file.read_text())["steps_done"] if prog_file.is_file() else 0
        if done == 0:
            free = shutil.disk_usage(part).free
            if free < need * 1.05:
                shutil.rmtree(part, ignore_errors=True)
                raise DataError(f"the target cache needs {need / 2**30:.2f} GiB but {root} has {free / 2**30:.2f} GiB "
                                "free: free some space, set SPIRE_CACHE to a larger disk, or lower --cache-steps")
        store = np.uint16 if dtype == "bfloat16" else np.float32
        shapes = {"tokens": ((rows, seq_len), np.int32), "final": ((rows, seq_len, d), np.float32),
                  "logz": ((rows, seq_len), np.float32), **{f"hidden_{j}": ((rows, seq_len, d), store) for j in layers}}
        arrays = {}
        for name in cls._names(layers, teacher):
            f = part / f"{name}.npy"
            shape, dt = shapes[name]
            arrays[name] = (np.load(f, mmap_mode="r+") if done and f.is_file()
                            else np.lib.format.open_memmap(f, mode="w+", dtype=dt, shape=shape))
        if log is not None:
            log(f"      target cache: {steps} batches x {batch_size} x {seq_len} tokens, {len(layers)} layers"
                f"{' + teacher' if teacher else ''}, {dtype}: {need / 2**30:.2f} GiB in {final_dir}"
                + (f" (resuming at batch {done})" if done else ""))
            others = [p for p in root.glob("*.partial") if p != part]
            if others:  # interrupted builds of other settings: resumed only by a run with their settings
                log(f"      target cache: {len(others)} unfinished build(s) of other settings hold "
                    f"{sum(f.stat().st_size for p in others for f in p.glob('*')) / 2**30:.2f} GiB "
                    f"({', '.join(p.name for p in others)}): delete them to free the disk")
        live = LiveTarget(target, data, layers, teacher, batch_size, seq_len, seed, bf16=bf16)
        bar = None
        if progress:
            bar = tqdm(total=steps, initial=done, unit="batch", dynamic_ncols=True, desc="target cache")
        for s in range(done, steps):
            tb = live.batch(s)
            sl = slice(s * batch_size, (s + 1) * batch_size)
            arrays["tokens"][sl] = tb.tokens.cpu().numpy().astype(np.int32)
            for j in layers:
                arrays[f"hidden_{j}"][sl] = _to_store(tb.hidden[j], dtype)
            if teacher:
                arrays["final"][sl] = _to_store(tb.final, "float32")
                arrays["logz"][sl] = tb.logz.cpu().numpy()
            if (s + 1) % 16 == 0 or s + 1 == steps:  # flush, then record: progress never runs ahead of the data
                for a in arrays.values():
                    a.flush()
                atomic_write(prog_file, None, json.dumps({"steps_done": s + 1}))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        del arrays
        meta = {"version": CACHE_VERSION, "steps": steps, "batch_size": batch_size, "seq_len": seq_len,
                "seed": seed, "layers": list(layers), "teacher": teacher, "dtype": dtype, "d_model": d,
                "data": data_key, "bytes": need, "base": base}
        atomic_write(part / "meta.json", None, json.dumps(meta, indent=1))
        prog_file.unlink(missing_ok=True)
        os.replace(part, final_dir)
        return cls(final_dir)

    def covers(self, layers: tuple[int, ...], teacher: bool) -> bool:
        """Whether this cache holds what a run needs."""
        return set(layers) <= set(self.layers) and (self.teacher or not teacher)

    def batch(self, step: int, rows: slice = slice(None), device: torch.device | str = "cpu",
              layers: tuple[int, ...] | None = None) -> TeacherBatch:
        """Stored batch ``step mod steps`` (its ``rows``) as float32 tensors on ``device``."""
        s = step % self.steps
        base = slice(s * self.batch_size, (s + 1) * self.batch_size)
        idx = range(self.batch_size)[rows]
        sl = slice(base.start + idx.start, base.start + idx.stop, idx.step)
        def get(name: str, dtype: str) -> torch.Tensor:
            return _from_store(self._arrays[name][sl], dtype).to(device)
        tokens = torch.from_numpy(np.asarray(self._arrays["tokens"][sl]).astype(np.int64)).to(device)
        hidden = {j: get(f"hidden_{j}", self.dtype) for j in (self.layers if layers is None else layers)}
        if not self.teacher:
            return TeacherBatch(tokens, hidden)
        return TeacherBatch(tokens, hidden, get("final", "float32"), get("logz", "float32"))


class CachedTarget:
    """A :class:`TargetCache` as the trainer's data source (the layers and teacher one run needs)."""

    def __init__(self, cache: TargetCache, layers: tuple[int, ...], teacher: bool, device: torch.device) -> None:
        if not cache.covers(layers, teacher):
            raise ConfigError(f"the target cache at {cache.path} holds layers {list(cache.layers)}"
                              f"{' and the teacher' if cache.teacher else ''}, not what this run needs")
        self.cache, self.layers, self.teacher, self.device = cache, tuple(layers), teacher, device

    def batch(self, step: int, rows: slice = slice(None)) -> TeacherBatch:
        tb = self.cache.batch(step, rows, self.device, self.layers)
        return tb if self.teacher else TeacherBatch(tb.tokens, tb.hidden)


def _to_store(x: torch.Tensor, dtype: str) -> np.ndarray:
    x = x.detach().cpu()
    if dtype == "bfloat16":
        return x.to(torch.bfloat16).view(torch.uint16).numpy()
    return x.float().numpy()


def _from_store(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.array(a))
    return t.view(torch.bfloat16).float() if dtype == "bfloat16" else t
