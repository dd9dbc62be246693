"""Counting host syncs on CPU tensors: what would stall a GPU if the same code ran there.

A host sync is a point where the host waits for a device value: ``.item()``, ``int()`` / ``float()`` / ``bool()`` of a
tensor (``aten._local_scalar_dense``), ``.tolist()``, ``.numpy()``, ``.cpu()`` / ``.to("cpu")``, and the ops whose
output shape depends on values (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
``repeat_interleave`` without ``output_size``). On a CPU build they cost nothing, so nothing shows them; this module
counts them with a :class:`torch.overrides.TorchFunctionMode` (the Python-level calls) and a
:class:`torch.utils._python_dispatch.TorchDispatchMode` (the aten ops, including those reached inside C++, e.g. the
``nonzero`` of a boolean index). Each sync is recorded once, with the spire source line that caused it.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
            aten.is_nonzero.default, aten.equal.default, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default, aten.repeat_interleave.Tensor}
"""aten ops that read a device value back or size their output by one (repeat_interleave.Tensor counts only
without an ``output_size``)."""

SCALAR_METHODS = {"__bool__", "__int__", "__float__", "__index__", "item"}
"""Python calls that end in ``aten._local_scalar_dense`` (counted there, at the aten level, once)."""

COPY_METHODS = {"tolist", "numpy", "cpu"}
"""Python calls that copy a tensor to the host without an aten op the dispatch mode sees on a CPU tensor."""


def _where() -> str:
    """The innermost spire (or test) source line of the current stack: ``file:line``."""
    for frame in reversed(traceback.extract_stack()):
        f = frame.filename
        if ("/spire/" in f or "/tests/" in f) and not f.endswith("tests/syncs.py"):
            return f"{f.split('/src/')[-1].split('/tests/')[-1]}:{frame.lineno}"
    return "?"


@dataclass
class Syncs:
    """The host syncs seen: (what, file:line) in order."""

    events: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.events)

    def __str__(self) -> str:
        return "; ".join(f"{what} at {where}" for what, where in self.events) or "none"


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, out: Syncs) -> None:
        super().__init__()
        self.out = out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in COPY_METHODS:
            self.out.events.append((f"Tensor.{name}", _where()))
        elif name == "to" and _to_host(args, kwargs):
            self.out.events.append(("Tensor.to(cpu)", _where()))
        return func(*args, **kwargs)


def _to_host(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names the CPU by the string "cpu" (``x.to(y.device)`` on CPU tensors cannot be
    told from a copy to the host, and is not counted)."""
    dev = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, str):
            dev = a
    return isinstance(dev, str) and dev.startswith("cpu")


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, out: Syncs) -> None:
        super().__init__()
        self.out = out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None):
            self.out.events.append((str(func.overloadpacket.__name__), _where()))
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.out.events.append(("boolean index", _where()))
        elif func in (aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default) and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            self.out.events.append(("boolean index_put", _where()))
        return func(*args, **kwargs)


@contextmanager
def count_syncs() -> Iterator[Syncs]:
    """``with count_syncs() as s: ...``: every host sync of the block in ``s`` (``len(s)``, ``str(s)`` names where)."""
    out = Syncs()
    with _FunctionCounter(out), _DispatchCounter(out):
        yield out
