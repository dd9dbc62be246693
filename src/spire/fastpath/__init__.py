"""The inference fast path of :mod:`spire.model`: the same arithmetic with fewer, better-shaped kernels.

It applies when autograd need not see the computation (``torch.no_grad()`` or frozen weights and inputs);
with autograd active on trainable weights the model runs its plain reference ops. docs/bench.md has the
measurements behind each choice.

One decode-step interface (:func:`decode_step`, :class:`DecodeStep`): on CPU in float32, a forward of at most
:data:`KERNEL_MAX_M` new tokens over a dense :class:`KVCache` (a target decode step, a verify pass, a MagicDec
draft step) or over a :class:`RingKVCache` (the SPIRe draft's step and its memory writes) runs each decoder
block as one native call (:class:`spire.kernels.DecodeBlock`: norms, fused matmuls, RoPE, cache write,
attention over the cache in place, MLP, residuals). :func:`decode_step` decides whether the native block
applies; when it returns None the caller runs its blocks per op, which still takes the tricks below:

- q/k/v and gate/up projections run as one matmul each over weights concatenated along the output dimension
  (:func:`linear`); on CPU in float32 the matmul follows the number of rows M = B·T: M = 1 multiplies by a
  transposed (in, out) copy of the weights (a GEMV MKL streams faster than ``F.linear``'s), 2 ≤ M ≤ 32 uses
  :func:`spire.kernels.skinny_linear` (one pass over each weight for all rows), larger M ``F.linear``;
- RoPE on q and k in one op set; decode attention through :func:`spire.kernels.decode_attention`; RMSNorm
  through :func:`spire.kernels.rms_norm`;
- the dense cache is written by slice when every row writes the same contiguous positions, the mask is
  dropped when nothing is masked, and a sink + window view (MagicDec) gathers only its entries
  (:class:`CacheAccess`), so its cost does not grow with the context;
- weight-only bf16 (:func:`use_bf16_weights`) and, for drafts, weight-only int8 (:func:`use_int8_weights`).

The weight copies (fused, transposed, bf16, packed) and the native blocks are kept per module by this module
(:func:`weight_copies`, :func:`native_blocks`), built on first use and rebuilt whenever a source parameter
changes (data pointer, version counter, dtype, device), so training in place stays correct. They are not
buffers (never saved) and a deepcopy starts without them. Decoding with the panel matmul keeps one packed copy
of every weight; a prefill (F.linear over the fused q/k/v and gate/up weights) adds those fused copies, so up to
two extra copies of the weights in all.

The package, one module per job: :mod:`~spire.fastpath.weights` (the kept weight copies, native blocks and derived
tensors, and the weight-only bf16 / int8 rounding), :mod:`~spire.fastpath.matmul` (matmul layout by row count:
:func:`linear`, :func:`unembed`), :mod:`~spire.fastpath.cache_access` (planning a dense cache's writes and reads:
:class:`CacheAccess`), :mod:`~spire.fastpath.ops` (the per-op pieces: :func:`rms_norm`, :func:`attention`,
:func:`mlp`) and :mod:`~spire.fastpath.step` (the decode-step interface: :func:`decode_step`, :class:`DecodeStep`,
:class:`PerOpStep`). Every former module-level name is re-exported here, private ones included; a test that replaces
a name the fast path itself calls sets it in the module that calls it.
"""

from __future__ import annotations

from spire.fastpath.weights import (WeightCache, autocast_weight, bf16_weights, forget, int8_weights, kept,
                                    native_blocks, rounded_like, use_bf16_weights, use_int8_weights, weight_copies,
                                    _PANEL_LAYOUT, _State, _copies, _round_weights, _state)
from spire.fastpath.matmul import (KERNEL_MAX_M, ONEDNN_ROWS, linear, needs_autograd, onednn, onednn_linear,
                                   unembed)
from spire.fastpath.cache_access import CacheAccess, KVSource, check_positions
from spire.fastpath.ops import ATTENTION_KERNEL_ROWS, attention, mlp, rms_norm, _rope_qk
from spire.fastpath.step import (DecodeStep, PerOpStep, Plan, decode_step, native_block, _layer_views,
                                 _native_applies)
