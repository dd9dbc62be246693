"""The execution choices: which of spire's equivalent paths runs (native kernels, fused blocks, weight layouts,
the training levers), as one explicit object.

Every choice here changes speed and memory only, never what is computed beyond float32 rounding: each fast path
has its per-op twin, and tests hold the two to each other (tests/test_fused_block.py, tests/test_panel_kernel.py,
tests/test_loss_kernel.py, tests/test_training.py, ...). A :class:`Backend` is built once per process from the
machine and the user's flags (:meth:`Backend.from_env`: ``spire --backend no-fused-block,no-panel-kernel ...``
exports ``SPIRE_BACKEND``, so training workers and subprocesses see the same choice), given to the target at load
(:func:`spire.loading.load_target`), handed on to the drafts built over it, and recorded in run logs,
results.json and REPORT.md (:meth:`Backend.describe`).

Where it is read: a model or draft module carries it as ``module.backend`` (set on every submodule by
:func:`use`; the class default is :data:`DEFAULT`), and :mod:`spire.fastpath`, :mod:`spire.model`, the SPIRe draft
and the trainer read it from the module they run. Tests and benchmarks set it with :func:`use` / :func:`using`.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from spire.errors import ConfigError

if TYPE_CHECKING:  # light on purpose: the CLI parses --backend before torch is imported
    import torch.nn as nn

ENV = "SPIRE_BACKEND"
"""Environment variable holding the user's backend flags (``no-<field>`` or ``<field>``, comma-separated)."""


@dataclass(frozen=True)
class Backend:
    """Which path runs. Each field True = the fast path where it applies (CPU float32 inference for the kernels);
    False = its per-op or torch twin, for A/B timing and as a fallback.

    kernels: spire's native CPU kernels at all (:mod:`spire.kernels`; they also need AVX2 and a C compiler, and
        ``SPIRE_KERNELS=0`` keeps them unbuilt). Off turns every kernel path below off.
    transposed_gemv: M = 1 matmuls by a transposed (in, out) weight copy (MKL's GEMV, ~1.2-1.4x F.linear's).
    panel_kernel: decode matmuls (M <= 32) by weights packed once in panels (:func:`spire.kernels.panel_linear`).
    fused_block: a decode step runs each plain Llama block as one native call (:class:`spire.kernels.DecodeBlock`).
    attention_kernel: decode attention (<= 4 query rows per KV head) by :func:`spire.kernels.decode_attention`.
    rmsnorm_kernel: RMSNorm in inference by one native call.
    grouped_attention: training attention shares each KV head across its query group (no repeat_interleave).
    chunked_kpass: SPIRe k-pass training reads only the target keys a window can reach
        (:meth:`spire.drafts.spire.SpireDraftModel._chunks`).
    autocast_copies: frozen weights' bf16 casts are kept from call to call under CPU bf16 autocast.
    fused_adamw: torch's fused AdamW where it has the kernel.
    loss_kernel: the distillation and hard-label losses by the native row kernel (float32 CPU rows).
    causal_attention: a forward over positions 0..T-1 (a prefill from the start, a teacher forward) attends with
        SDPA's ``is_causal``, which skips the masked half, instead of an explicit (T, T) mask.
    onednn_linear: inference float32 CPU matmuls the native kernels do not take (more than 32 rows: prefill, the
        verify of a large batch, target caches) by oneDNN instead of torch's BLAS (MKL), which runs its AVX2 code
        on AMD CPUs: its matmuls 2.2x, SmolLM2's prefill 1.8-2.1x on a 2-core AMD EPYC with AVX-512
        (benchmarks/prefill.py, with causal_attention).
    """

    kernels: bool = True
    transposed_gemv: bool = True
    panel_kernel: bool = True
    fused_block: bool = True
    attention_kernel: bool = True
    rmsnorm_kernel: bool = True
    grouped_attention: bool = True
    chunked_kpass: bool = True
    autocast_copies: bool = True
    fused_adamw: bool = True
    loss_kernel: bool = True
    causal_attention: bool = True
    onednn_linear: bool = True

    def native(self) -> bool:
        """Whether native kernels run: :attr:`kernels` on and the library built on this machine."""
        from spire import kernels  # deferred: kernels imports torch; this module is read by the CLI's parser

        return self.kernels and kernels.available()

    def replace(self, **changes: bool) -> "Backend":
        return dataclasses.replace(self, **changes)

    @classmethod
    def parse(cls, spec: str) -> "Backend":
        """``"no-fused-block,panel-kernel"`` -> a Backend (fields spelled with - or _, ``no-`` = off; empty =
        every fast path). Raises ConfigError naming an unknown field."""
        names = {f.name for f in dataclasses.fields(cls)}
        changes: dict[str, bool] = {}
        for item in (s.strip() for s in spec.split(",")):
            if not item:
                continue
            name = item.replace("-", "_")
            on = not name.startswith("no_")
            name = name if on else name[3:]
            if name not in names:
                raise ConfigError(f"backend: unknown choice {item!r}; the choices are "
                                  f"{', '.join(sorted(n.replace('_', '-') for n in names))} (each with no- to turn "
                                  "it off)")
            if changes.get(name, on) != on:
                raise ConfigError(f"backend: {name.replace('_', '-')} is both on and off in {spec!r}")
            changes[name] = on
        return cls(**changes)

    @classmethod
    def from_env(cls) -> "Backend":
        """The process's backend: :data:`ENV` (``spire --backend`` sets it), else every fast path."""
        return cls.parse(os.environ.get(ENV, ""))

    def spec(self) -> str:
        """The flags that give this backend back through :meth:`parse` ("" for the default)."""
        return ",".join(f"no-{f.name.replace('_', '-')}" for f in dataclasses.fields(self)
                        if not getattr(self, f.name))

    def describe(self) -> dict:
        """What ran, for logs and results.json: every field, and whether the native kernels were built here (with
        the reason when not)."""
        from spire import kernels  # deferred: kernels imports torch; this module is read by the CLI's parser

        out: dict = dataclasses.asdict(self)
        out["native_kernels_built"] = kernels.available()
        if not kernels.available():
            out["native_kernels_missing_because"] = kernels.unavailable_reason()
        return out

    def summary(self) -> str:
        """One line for REPORT.md and the console: the default, or what was turned off, and the kernels' state."""
        return summary_of(self.describe())


def summary_of(described: dict | None) -> str:
    """:meth:`Backend.summary` of a recorded :meth:`Backend.describe` (None: a results.json from before spire
    recorded it)."""
    if described is None:
        return "not recorded"
    off = [f"no-{f.name.replace('_', '-')}" for f in dataclasses.fields(Backend) if described.get(f.name) is False]
    built = ("native kernels built" if described.get("native_kernels_built")
             else f"native kernels unavailable ({described.get('native_kernels_missing_because')})")
    return f"{'every fast path on' if not off else 'off: ' + ','.join(off)}; {built}"


DEFAULT = Backend()
"""Every fast path: the class default of the modules that read a backend."""


def of(module: nn.Module) -> Backend:
    """The backend ``module`` runs with (:data:`DEFAULT` unless :func:`use` set one)."""
    return module.__dict__.get("backend", DEFAULT)  # a dict lookup: read per matmul on the decode path


def use(module: nn.Module, backend: Backend) -> nn.Module:
    """Set ``backend`` on ``module`` and every submodule (the target's blocks, a draft's layers). Returns module."""
    for m in module.modules():
        m.backend = backend
    return module


@contextmanager
def using(module: nn.Module, backend: Backend) -> Iterator[nn.Module]:
    """:func:`use` for the duration of a ``with`` block, then each submodule's backend as it was."""
    before = [(m, m.__dict__.get("backend")) for m in module.modules()]
    use(module, backend)
    try:
        yield module
    finally:
        for m, b in before:
            if b is None:
                m.__dict__.pop("backend", None)
            else:
                m.backend = b
