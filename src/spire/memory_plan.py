"""The device memory `spire train` and `spire serve` need, computed before anything loads (issue 53, item 5).

A plan is a sum of named parts, in bytes:

- weights: the target's (and a draft's) and the fast path's fused copies of the frozen target's (q/k/v and
  gate/up concatenated, kept on any device: :func:`fused_copy_bytes`), counted on a model built on the ``meta`` device from the target's
  config (no weights read; parameters and buffers, tied tensors once) at the dtype they run in;
- KV caches: the target's ``KVCache`` of ``slots x max_len`` positions (2 x n_layers x slots x n_kv_heads x
  max_len x d_head values) and the draft's own (a SPIRe ring of sink + window + k + 1 positions per draft layer,
  EAGLE-3's one layer and its features over max_len, a vanilla draft's full cache, nothing for MagicDec, whose
  view reads the target's, and the n-gram draft's token buffer);
- training: the trainable draft's weights, gradients and AdamW's two moments (4 float32 values per parameter:
  weight, grad, exp_avg, exp_avg_sq), the teacher's batch (residual streams of the source layers, the final
  hidden state, log Z; with the live target also its (B, T, V) logits), and the activations autograd keeps
  (:func:`train_activation_bytes`);
- serving: one engine step's transients, the verify logits (slots x (k + 1) x V float32, and the probabilities
  made from them) and a prefill chunk's (:func:`serve_activation_bytes`).

Weights and caches are exact byte counts. A training step's draft activations are counted, not estimated: the
draft's teacher-forced forward runs on the meta device under saved-tensor hooks (:func:`saved_activation_bytes`);
the loss's and the serving step's transients are estimates from the tensors they keep, stated per token in the
functions below. ``benchmarks/memory_plan.py``
compares the plan with the peak measured on CPU (measurements/memory-plan-cpu/).

The device's memory: ``--device-memory`` (or ``SPIRE_DEVICE_MEMORY``) when stated, e.g. ``24GiB`` or a byte
count, else the free memory ``torch.cuda.mem_get_info`` reports on a CUDA device, else none (no check).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from spire import defaults, registry
from spire.errors import ConfigError
from spire.loading import read_model_config
from spire.model import ModelConfig, Transformer

ENV = "SPIRE_DEVICE_MEMORY"
UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
         "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
F32 = 4


def parse_bytes(text: str, flag: str = "--device-memory") -> int:
    """'24GiB', '24 GB', '512MiB', '8e9' -> bytes (decimal k/M/G/T, binary KiB/MiB/GiB/TiB). Raises ConfigError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{flag}: expected a size such as 24GiB, 16GB or a byte count, got {text!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def device_memory(device: str | torch.device, stated: str | None = None) -> int | None:
    """Bytes the run may use on ``device``: ``stated`` (or $SPIRE_DEVICE_MEMORY) when given; else on CUDA the
    free memory of that GPU (torch.cuda.mem_get_info); else None (a CPU: no plan is checked)."""
    stated = stated if stated is not None else os.environ.get(ENV) or None
    if stated is not None:
        return parse_bytes(stated, "--device-memory" if stated is not os.environ.get(ENV) else ENV)
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(dev)[0])
    return None


@dataclass
class MemoryPlan:
    """What a command needs on its device: ``parts`` name -> bytes; ``batch``: the batch the plan is for (training
    rows per step, or serving slots); ``batch_flag``: the option that sets it."""

    command: str
    batch: int
    batch_flag: str
    parts: dict[str, int] = field(default_factory=dict)
    other_flag: str = ""
    """Another option that shrinks the plan (a refusal names it beside ``batch_flag``)."""

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{k} {gib(v)}" for k, v in self.parts.items() if v)

    def to_dict(self) -> dict:
        return {"command": self.command, "batch": self.batch, "total_bytes": self.total, "parts": dict(self.parts)}


def module_bytes(module: torch.nn.Module, dtype: torch.dtype | None = None, trainable: bool | None = None) -> int:
    """Bytes of a module's parameters and buffers (each storage once: tied weights count once), at ``dtype``
    (None: their own) for floating tensors. trainable True / False: only the parameters that do / do not require
    grad (no buffers)."""
    seen, total = set(), 0
    tensors = [p for p in module.parameters() if trainable is None or p.requires_grad == trainable]
    if trainable is None:
        tensors += list(module.buffers())
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        size = (torch.empty((), dtype=dtype).element_size() if dtype is not None and t.is_floating_point()
                else t.element_size())
        total += t.numel() * size
    return total


def meta_target(cfg: ModelConfig) -> Transformer:
    """The target's module tree on the meta device: shapes only, nothing allocated, nothing read."""
    with torch.device("meta"):
        return Transformer(cfg).eval().requires_grad_(False)


def fused_copy_bytes(cfg: ModelConfig, elem: int = F32) -> int:
    """The fast path's kept copies of a frozen target's weights (:class:`spire.fastpath.WeightCache`, layout "N"):
    per layer q, k and v concatenated ((d + 2 n_kv d_head) x d) and gate and up concatenated (2 d_ff x d)."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.d_head
    return cfg.n_layers * ((d + 2 * kv) * d + 2 * cfg.d_ff * d) * elem


def kv_bytes(n_layers: int, slots: int, n_kv: int, positions: int, d_head: int, elem: int = F32) -> int:
    """A KVCache's bytes: keys and values of n_layers x slots x n_kv x positions x d_head values (+ its position
    index of ``positions`` int64)."""
    return 2 * n_layers * slots * n_kv * positions * d_head * elem + 8 * positions


def block_activation_values(cfg: ModelConfig, T_keys: int) -> int:
    """Values one Llama block keeps for the backward per token (eager attention over T_keys keys): its input and
    the two normed inputs (3 d), q (d) and the new keys and values (2 n_kv d_head), the attention scores and
    their softmax (2 n_heads T_keys), the attention output and o_proj's (2 d), gate, up, silu(gate) and their
    product (4 d_ff)."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.d_head
    return 6 * d + 2 * kv + 2 * cfg.n_heads * T_keys + 4 * cfg.d_ff


def saved_activation_bytes(draft, cfg: ModelConfig, batch: int, seq_len: int, k: int) -> int | None:
    """Bytes autograd keeps for the backward of the draft's teacher-forced forward (``train_logits``) at ``batch``
    rows of ``seq_len`` tokens, counted by running it on the meta device (nothing allocated) under
    ``torch.autograd.graph.saved_tensors_hooks``: every saved tensor that is not a parameter or an input (the
    teacher's hidden states: the teacher batch), each storage once; the logits it returns are the loss's. None when
    the forward does not run on meta (a CPU-only path)."""
    seen: dict[int, int] = {}

    def storage(t: torch.Tensor):
        st = t.untyped_storage()
        return st._cdata, st.nbytes()  # the StorageImpl: one for a tensor and all its views, on meta too

    def pack(t: torch.Tensor) -> torch.Tensor:
        key, nbytes = storage(t)
        if key not in params:
            seen[key] = nbytes
        return t

    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    hidden = {j: torch.zeros(batch, seq_len, cfg.d_model, device="meta") for j in draft.target_layers()}
    params = {storage(t)[0] for t in (*draft.parameters(), *hidden.values())}
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            draft.train_logits(tokens, hidden, k)
    except (RuntimeError, NotImplementedError):
        return None
    return sum(seen.values())


def train_activation_bytes(cfg: ModelConfig, n_draft_layers: int, draft_vocab: int, batch: int, seq_len: int,
                           source_layers: int, live: bool, bf16: bool, draft_saved: int | None = None
                           ) -> dict[str, int]:
    """The transient bytes of one training step at ``batch`` rows of ``seq_len`` tokens (n = batch x seq_len):

    - teacher: per token the residual streams of the ``source_layers`` layers the draft reads, the final normed
      hidden state (d each) and log Z, float32; with the live target also its V logits;
    - draft activations: ``draft_saved`` (:func:`saved_activation_bytes`, counted on the meta device) when given,
      else ``n_draft_layers`` x :func:`block_activation_values` (seq_len keys) float32 per token (bf16 autocast:
      2 bytes). The meta count is of float32 tensors also under bf16 autocast (an upper bound);
    - loss: 6 float32 (n, N) arrays over the draft vocabulary N: the draft's logits, log-softmax, q, the teacher's
      log p and p, and the gradient of the logits.
    """
    n = batch * seq_len
    d = cfg.d_model
    teacher = n * ((source_layers + 1) * d + 1) * F32 + (n * cfg.vocab_size * F32 if live else 0)
    act = (draft_saved if draft_saved is not None else
           n * n_draft_layers * block_activation_values(cfg, seq_len) * (2 if bf16 else F32))
    loss = 6 * n * draft_vocab * F32
    return {"teacher batch": teacher, "activations": act, "loss": loss}


def serve_activation_bytes(cfg: ModelConfig, slots: int, k: int, max_len: int, prefill_chunk: int,
                           elem: int = F32) -> int:
    """One engine step's transients, the larger of a verify round and a prefill chunk: a round's target logits
    over slots x (k + 1) positions (V float32 each) and the probabilities made from them (2 x); a chunk of
    ``prefill_chunk`` tokens (its one block's values, :func:`block_activation_values` over max_len keys) and its
    last position's logits."""
    verify = 2 * slots * (k + 1) * (cfg.vocab_size * F32 + block_activation_values(cfg, max_len) * elem)
    chunk = prefill_chunk * block_activation_values(cfg, max_len) * elem + cfg.vocab_size * F32
    return max(verify, chunk)


def _trainable_draft_on_meta(target: Transformer, train_cfg):
    """The draft a run would train, built over the meta target (parameter shapes only)."""
    import numpy as np
    import types

    dc = train_cfg.draft_config
    if getattr(dc, "vocab_from", None) == "mass":  # its ids need the target's values; their count does not
        dc = replace(dc, vocab_from="frequency")
    fake = types.SimpleNamespace(train=types.SimpleNamespace(tokens=np.arange(target.cfg.vocab_size)))
    cfg = replace(train_cfg, draft_config=dc, init_from=None)
    return registry.trainable_class(cfg.draft).for_training(target, cfg, fake)


def train_planner(cfg: ModelConfig, train_cfg) -> Callable[[int], MemoryPlan]:
    """The plan of `spire train` for ``train_cfg`` (a :class:`spire.training.config.TrainConfig`) as a function of
    the batch (rows per step) on a target of config ``cfg`` (float32 weights, frozen). The draft is built once,
    over the target on the meta device, to count its parameters (trainable ones get a gradient and AdamW's two
    moments)."""
    target = meta_target(cfg)
    draft = _trainable_draft_on_meta(target, train_cfg)
    ids = {id(p) for p in target.parameters()}
    n_train = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    frozen_own = sum(p.numel() for p in draft.parameters() if not p.requires_grad and id(p) not in ids)
    n_layers = len(getattr(draft, "layers", []))
    vocab = getattr(draft, "vocab", None)
    draft_vocab = int(vocab.numel()) if isinstance(vocab, torch.Tensor) else cfg.vocab_size
    sources = len(draft.target_layers())
    # the draft's saved activations, counted on meta at 1 and 2 rows: a constant part (e.g. gathered head rows)
    # and a part per row
    one, two = (saved_activation_bytes(draft, cfg, b, train_cfg.seq_len, train_cfg.k) for b in (1, 2))
    per_row = None if one is None or two is None else two - one
    fixed = {"target weights": module_bytes(target, torch.float32), "fused weight copies": fused_copy_bytes(cfg),
             "draft weights": (n_train + frozen_own) * F32,
             "gradients": n_train * F32, "AdamW state": 2 * n_train * F32}

    def plan(batch: int) -> MemoryPlan:
        parts = dict(fixed)
        saved = None if per_row is None else one + per_row * (batch - 1)
        parts.update(train_activation_bytes(cfg, n_layers, draft_vocab, batch, train_cfg.seq_len, sources,
                                            train_cfg.target_cache is None, bool(train_cfg.bf16), saved))
        return MemoryPlan("spire train", batch, "--batch-size", parts, "--seq-len")

    return plan


def draft_cache_bytes(kind: str, cfg: ModelConfig, slots: int, max_len: int, k: int, draft_cfg: dict | None = None,
                      elem: int = F32) -> int:
    """The draft's own per-slot state (module docstring). draft_cfg: for "spire" {"n_layers", "sink", "window"}
    (window None: a full cache), for "vanilla" the draft's ModelConfig fields {"n_layers", "n_kv_heads",
    "d_head"}; others need none. Another kind with weights of its own and a KV cache (a kind added to the registry)
    is planned as the cost model prices it (its line's :class:`~spire.registry.Pricing`: ``layers`` blocks of the
    target's KV shape over the whole context, or over sink + window + k + 1 positions for kv "window")."""
    draft_cfg = draft_cfg or {}
    if kind == "spire":
        window = draft_cfg.get("window")
        positions = max_len if window is None else draft_cfg.get("sink", 1) + window + k + 1
        ring = kv_bytes(draft_cfg.get("n_layers", 8), slots, cfg.n_kv_heads, positions, cfg.d_head, elem)
        return ring + slots * (k + 2) * cfg.d_model * elem
    if kind == "eagle3":
        return kv_bytes(1, slots, cfg.n_kv_heads, max_len, cfg.d_head, elem) + slots * (max_len + 1) * cfg.d_model * elem
    if kind == "vanilla":
        return kv_bytes(draft_cfg["n_layers"], slots, draft_cfg["n_kv_heads"], max_len, draft_cfg["d_head"], elem)
    if kind == "ngram":
        return slots * max_len * 8
    pricing = registry.kind(kind).pricing if kind in registry.names() else None
    if pricing is not None and pricing.weights == "own" and pricing.kv != "none":
        layers = max(1, math.ceil(cfg.n_layers * pricing.layers) if isinstance(pricing.layers, float)
                     else int(pricing.layers))  # as throughput.shapes reads a Pricing
        positions = max_len if pricing.kv == "full" else defaults.SINK + defaults.WINDOW + k + 1
        return kv_bytes(layers, slots, cfg.n_kv_heads, positions, cfg.d_head, elem)
    return 0  # magicdec: a view of the target's cache


def serve_plan(cfg: ModelConfig, slots: int, max_len: int, k: int, prefill_chunk: int, draft_kind: str | None,
               draft_weight_bytes: int = 0, draft_cfg: dict | None = None, dtype: torch.dtype = torch.float32
               ) -> MemoryPlan:
    """The plan of `spire serve` with ``slots`` (--max-running) of ``max_len`` positions, k, --prefill-chunk
    (0: a whole prompt of max_len tokens), the draft's kind and its weights' bytes (0 for MagicDec / n-gram)."""
    elem = torch.empty((), dtype=dtype).element_size()
    target = meta_target(cfg)
    parts = {"target weights": module_bytes(target, dtype), "fused weight copies": fused_copy_bytes(cfg, elem),
             "target KV cache": kv_bytes(cfg.n_layers, slots, cfg.n_kv_heads, max_len, cfg.d_head, elem),
             "draft weights": draft_weight_bytes,
             "draft state": draft_cache_bytes(draft_kind or "magicdec", cfg, slots, max_len, k, draft_cfg, elem),
             "activations": serve_activation_bytes(cfg, slots, k if draft_kind else 0, max_len,
                                                   prefill_chunk or max_len, elem)}
    return MemoryPlan("spire serve", slots, "--max-running", parts, "--max-len")


def largest_batch(plan: Callable[[int], MemoryPlan], memory: int, upto: int) -> int:
    """The largest batch b in 1..upto whose plan fits ``memory`` bytes (plans grow with b), or 0 if none."""
    lo, hi = 0, upto
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan(mid).total <= memory:
            lo = mid
        else:
            hi = mid - 1
    return lo


def memory_source(stated: str | None) -> str:
    """Where :func:`device_memory`'s limit comes from, as a refusal names it: the option, the environment variable
    (which a user may have forgotten they set) or the device's free memory."""
    if stated is not None:
        return "--device-memory"
    return f"${ENV}" if os.environ.get(ENV) else "the device's free memory"


def check_fits(plan: Callable[[int], MemoryPlan], batch: int, memory: int | None, device: str,
               source: str | None = None) -> MemoryPlan:
    """Compute the plan at ``batch``; raise ConfigError in one line when it exceeds ``memory`` (naming the parts,
    the memory and where its limit comes from (``source``, :func:`memory_source`), the largest batch that fits and
    the plan's other option). None memory: no check. Returns the plan."""
    p = plan(batch)
    if memory is None or p.total <= memory:
        return p
    best = largest_batch(plan, memory, batch - 1)
    fit = (f"the largest {p.batch_flag} that fits is {best}" if best else
           f"nothing fits, not even {p.batch_flag} 1 ({gib(plan(1).total)})")
    fit += f" (a smaller {p.other_flag} also shrinks it)" if p.other_flag else ""
    raise ConfigError(f"{p.command} needs {gib(p.total)} on {device} at {p.batch_flag} {batch} ({p.describe()}), "
                      f"more than its {gib(memory)}{f' ({source})' if source else ''}: {fit}")


def safetensors_bytes(path: str | Path, dtype: torch.dtype | None = None) -> int:
    """Bytes of the tensors of a .safetensors file (or a folder's *.safetensors) read from their headers only, at
    ``dtype`` for floating tensors (None: as stored)."""
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    total = 0
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for name in fh.keys():
                sl = fh.get_slice(name)
                n = 1
                for s in sl.get_shape():
                    n *= s
                stored = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1,
                          "F64": 8, "I16": 2, "U16": 2}.get(sl.get_dtype(), 4)
                floating = sl.get_dtype() in ("F32", "F16", "BF16", "F64")
                total += n * (torch.empty((), dtype=dtype).element_size() if dtype is not None and floating
                              else stored)
    return total


def serve_planner(cfg: ModelConfig, max_len: int, k: int, prefill_chunk: int, kind: str | None,
                  draft_path: str | None = None) -> Callable[[int], MemoryPlan]:
    """:func:`serve_plan` as a function of the slots (--max-running), for `spire serve`'s settings: the draft's
    weights from its safetensors headers (``draft_path`` of any kind that trains, nothing read but the headers; a
    vanilla draft's cache from its config.json); a SPIRe draft's ring at the default 8 layers and sink 1 + window
    64; another kind's state as :func:`draft_cache_bytes` prices it."""
    weights, dcfg = 0, None
    if draft_path is not None and kind is not None and kind in registry.names() and registry.kind(kind).trains:
        path = Path(draft_path)
        try:
            weights = safetensors_bytes(path if path.suffix == ".safetensors" or path.is_dir() else path)
        except Exception:  # an unreadable file is reported by the draft's own loader, after this
            weights = 0
        if kind == "vanilla" and path.is_dir():
            v = read_model_config(path)
            dcfg = {"n_layers": v.n_layers, "n_kv_heads": v.n_kv_heads, "d_head": v.d_head}
    if kind == "vanilla" and dcfg is None:
        dcfg = {"n_layers": max(1, cfg.n_layers // 8), "n_kv_heads": cfg.n_kv_heads, "d_head": cfg.d_head}
    if kind == "spire":
        dcfg = {"n_layers": defaults.N_DRAFT_LAYERS, "sink": defaults.SINK, "window": defaults.WINDOW}
    return lambda slots: serve_plan(cfg, slots, max_len, k, prefill_chunk, kind, weights, dcfg)
