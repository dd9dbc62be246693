"""The SPIRe draft: Sparse KV cache, Pruned Initialization, Recurrent (feedback) memory.

SPIRe paper §3 (Neelam et al. 2025, arXiv 2504.06419):

1. Sparse attention: a StreamingLLM sink + window mask in training and inference; RoPE uses positions in
   the original text.
2. Pruned initialization: the draft is the target's embedding, a copy of its LAST n_d blocks and its
   unembedding. Draft layer i is initialized from target layer j = n_layers - n_d + i.
3. Feedback memory (Fan et al. 2020) per layer: draft layer i attends, with its own k/v projections (of its
   input norm), over memory vectors m_t^i = sum_l softmax_l(w_il) x_t^l, where x_t^l is the draft's
   activation of token t after draft layer l (l = 0 is the embedding) and w is (n_d, n_d + 1).
4. For the verified past, memory vectors are replaced by the target's activations: layer i uses the
   residual stream entering target layer j. Only drafted positions use the draft's own memory.

By default the current token also attends to its own key/value (computed from its layer input, as in a
normal block); every earlier position is read as a memory key/value. The embedding and unembedding are
shared with the target and frozen; the blocks, final norm and mixing logits are trained.

Ablation switches (paper Figure 5; :class:`SpireConfig`): ``feedback_memory=False`` (a drafted position's
memory is its own layer input, i.e. an ordinary KV cache), ``target_activations=False`` (with no feedback
memory: an ordinary pruned transformer that runs over the verified tokens itself), ``window=None`` (full KV
cache instead of sink + window), ``init="random"``, and ``self_attend=False`` (a drafted position reads
only earlier positions). The loss ablations (omega = 1, HardTargetLoss) live in the trainer.

The package, one module per job: :mod:`~spire.drafts.spire.config` (settings), :mod:`~spire.drafts.spire.model`
(the trainable model and its training forward), :mod:`~spire.drafts.spire.draft` (the inference draft),
:mod:`~spire.drafts.spire.load` (finding and loading a draft, and the export's writer). Every name is re-exported
here, and the registry's ``KIND`` is declared here.
"""

from __future__ import annotations

from spire.drafts.spire.config import BRIDGE_FIT_ROWS, INIT_KINDS, VOCAB_MASS_ROWS, SpireConfig
from spire.drafts.spire.draft import SpireDraft
from spire.drafts.spire.model import SpireDraftModel
from spire.drafts.spire.load import _export, find_trained_spire, load_draft, load_exported_spire
from spire.integrations.vllm_export import SPIRE_FORM
from spire.registry import DraftImpl

__all__ = ["BRIDGE_FIT_ROWS", "INIT_KINDS", "KIND", "VOCAB_MASS_ROWS", "SpireConfig", "SpireDraft",
           "SpireDraftModel", "find_trained_spire", "load_draft", "load_exported_spire"]

KIND = DraftImpl(load=load_draft, model=SpireDraftModel, export=_export, vllm=SPIRE_FORM)
