"""The EAGLE-3 draft (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv 2503.01840), as vllm-project/speculators 0.9 defines it
(``src/speculators/models/eagle3/{config,core,model_definitions,attention,metrics}.py``, ``model.py``'s
``DraftVocabMixin``, ``train/vocab_mapping.py``) and sgl-project/SpecForge trains it.

Architecture (one decoder layer, d = the target's hidden size, N = draft vocabulary)::

    g_t   = fc(cat(h_t^{j1}, h_t^{j2}, h_t^{j3}))                  fc: Linear(3d -> d, no bias)    "fused feature"
    u_t   = cat(input_layernorm(embed(x_t)), hidden_norm(f_{t-1}))  (2d,)  -> q, k, v (Linear(2d -> .))
    y_t   = f_{t-1} + o_proj(attention(u_t))                        (hidden_norm(f_{t-1}) with norm_before_residual)
    z_t   = y_t + mlp(post_attention_layernorm(y_t))                 the layer's (pre-norm) output
    logits= lm_head(norm(z_t))                                       lm_head: (N, d), N columns of the target's vocab

``embed`` is the target's (frozen) embedding; ``f_{t-1}`` is the feature of the previous position: the fused
target feature ``g_{t-1}`` when position t - 1 was verified by the target, the draft's own ``z_{t-1}`` when it was
drafted in the same round (``norm(z_{t-1})`` with ``norm_output``, speculators' "EAGLE 3.1" flag). Position 0 has
no previous position: its feature is 0. RoPE is the target's (the most common RoPE of its layers), at the
positions of the text.

Alignment: the draft's input at position t is (x_t, f_{t-1}) and its output predicts x_{t+1}; in speculators'
training data (``shift_batch``) index i holds (x_{i+1}, g_i) at position id i + 1, which is the same draft
(attention depends on relative positions only). The key of position 0 (no feature) is read by the query at
position 0 only, so the draft attends over exactly the keys speculators and vLLM hold (their draft sequence starts
at x_1).

Target layer ids. Layer id j means the residual stream ENTERING target layer j, i.e. HF transformers'
``output_hidden_states[j]`` for 0 <= j < n (``hidden_states[0]`` is the embedding output), which is what
:meth:`spire.model.Transformer.forward` returns for ``hidden_layers=(j,)`` and what vLLM's and speculators'
``eagle_aux_hidden_state_layer_ids`` capture ("input to layer j": vLLM's ``EagleModelMixin._maybe_add_hidden_state``
records id 0 before the first layer and id i + 1 after layer i; SGLang PR #25454 fixed a +1 offset applied to such
ids, and vLLM #38111 reportedly mixed up the same convention). Id n (the number of target layers) is the
final residual stream BEFORE the final norm, as vLLM captures it; HF's ``hidden_states[n]`` is after the final norm.
tests/test_eagle3.py checks both against transformers. The default ids are speculators' ``[2, n // 2, n - 3]``
(``speculators.models.utils.resolve_target_layer_ids``).

The KV cache: at inference the draft's cache holds, for every verified position t, the keys/values of
(x_t, g_{t-1}) (written by :meth:`Eagle3Draft.observe` after each prefill and verify: EAGLE's "catch-up"), and
for a drafted position those of (x_t, f_{t-1}) (written by :meth:`Eagle3Draft.step`). A drafted query at p reads
every key <= p. Training reproduces it (speculators' test-time training, TTT): :meth:`Eagle3DraftModel.train_logits`
splits the sequence into chunks of k positions; the j-th position of a chunk starting at s is the j-th drafted
step of a chain that began at s with the target's feature g_{s-1}, attending to the keys of positions <= s computed
from target features and to its own chain's keys at s + 1 .. s + j. (speculators' TTT computes every position at
every depth; the chunked layout computes each position once, at depth t mod k, as inference meets it. Its
``ttt_step_loss_decay`` weighting is not applied.)

Draft vocabulary: N target ids (:func:`spire.drafts.vocab.frequent_tokens`, the most frequent training tokens,
sorted ascending as speculators' ``build_vocab_mappings_from_distribution`` sorts them); speculators stores them
as ``d2t`` (N,) int64 offsets, target_id = i + d2t[i], and ``t2d`` (V,) bool. The head's rows start as the
target's lm_head rows of those ids; :meth:`Eagle3Draft.step` scatters the N logits into the target's V with -inf
elsewhere (q = 0 there), so verification stays lossless. N >= V (or 0) means the whole vocabulary.

Loss: speculators' ``kl_div_loss``, the forward KL from the target's distribution renormalized over the draft
vocabulary to the draft's: (:func:`spire.training.losses.kl_loss_logp`, default_loss "kl").

Beyond EAGLE-3 (off by default): a sink + window view of the draft's KV cache (``Eagle3Config.window``), in
training and inference. Out of scope: tree drafting (EAGLE's dynamic draft tree; spire's round loop drafts a
chain of k tokens), several decoder layers (speculators' ``num_hidden_layers`` > 1), a trained embedding
(``embed_requires_grad``), and sliding-window draft layers read from a speculators config: refused by name.

speculators format (:func:`export_speculators`, :func:`load_speculators`): config.json with
``speculators_model_type`` "eagle3", ``speculators_version``, ``speculators_config`` (algorithm, greedy proposal
method, verifier), ``transformer_layer_config`` (an HF Llama or Qwen3 config of the one layer),
``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` and the norm flags; weights in
``model.safetensors`` under speculators' names (``fc.weight``, ``layers.0.self_attn.q_proj.weight``,
``layers.0.hidden_norm.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, ``embed_tokens.weight``).

The package, one module per job: :mod:`~spire.drafts.eagle3.config` (settings), :mod:`~spire.drafts.eagle3.layer` (the
decoder layer and its mask), :mod:`~spire.drafts.eagle3.model` (the trainable model and its training forward),
:mod:`~spire.drafts.eagle3.draft` (the inference draft), :mod:`~spire.drafts.eagle3.speculators_format` (the speculators
folder), :mod:`~spire.drafts.eagle3.load` (finding and loading a draft). Every name is re-exported here, and the
registry's ``KIND`` is declared here.
"""

from __future__ import annotations

from spire.drafts.eagle3.config import LAYER_TYPES, Eagle3Config, default_layer_ids, draft_layer_config
from spire.drafts.eagle3.layer import Eagle3Layer, eagle3_mask
from spire.drafts.eagle3.draft import _NONE, Eagle3Draft
from spire.drafts.eagle3.speculators_format import (SPECULATORS_READS, SPECULATORS_VERSION, _KNOWN_KEYS,
                                                    DraftTargetMismatchError, _base_config_keys,
                                                    _check_version, _embedding_rows, _layer_config,
                                                    _layer_hf_config, _same_embedding, _speculators_config,
                                                    export_speculators, speculators_state,
                                                    speculators_writer)
from spire.drafts.eagle3.model import Eagle3DraftModel
from spire.drafts.eagle3.load import _export, load_draft, load_eagle3, load_speculators, resolve_path
from spire.integrations.vllm_export import EAGLE3_FORM
from spire.registry import DraftImpl

__all__ = ["KIND", "LAYER_TYPES", "SPECULATORS_READS", "SPECULATORS_VERSION", "DraftTargetMismatchError",
           "Eagle3Config", "Eagle3Draft", "Eagle3DraftModel", "Eagle3Layer", "default_layer_ids",
           "draft_layer_config", "eagle3_mask", "export_speculators", "load_draft", "load_eagle3",
           "load_speculators", "resolve_path", "speculators_state", "speculators_writer"]

KIND = DraftImpl(load=load_draft, model=Eagle3DraftModel, export=_export, vllm=EAGLE3_FORM)
