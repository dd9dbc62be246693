"""spire's EAGLE-3 exports in vLLM with start-up checks (issue 41, goal 4): vLLM's own EAGLE-3 classes, which load a
draft without asking which target it was made for (docs/serving.md, "What vLLM does not check"), subclassed to
refuse at start-up, with one ValueError line, a target whose shape (layers, width, vocabulary, heads) or first
embedding rows differ from the export's. Nothing else changes: the parent builds, loads and runs the draft.

Registered by :func:`spire.integrations.vllm_plugin.register` under the names of
:data:`spire.integrations.vllm_plugin.EAGLE3_ARCHITECTURES`, which the ``vllm/`` subfolder of an EAGLE-3 export
names (:func:`spire.integrations.vllm_export.eagle3_vllm_folder`). Imported only inside vLLM's processes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.qwen3_eagle3 import Eagle3Qwen3ForCausalLM

from spire.integrations.vllm_checks import check_format, check_target_rows, check_target_shape, target_rows
from spire.integrations.vllm_plugin import EAGLE3_PROBE as PROBE


class _Checked:
    """The checks, before the parent's ``__init__`` and around its ``load_weights``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        draft = vllm_config.speculative_config.draft_model_config.hf_config
        s = check_format(getattr(draft, "spire_vllm", None), "EAGLE-3")
        check_target_shape(s["target"], vllm_config.model_config.hf_config, "EAGLE-3")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._spire_target = str(vllm_config.model_config.model)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """The parent's, streamed past :data:`PROBE` (not a model weight), which is then compared with the target
        checkpoint's first embedding rows when the target is a local folder (else only its shape was checked).
        Raises ValueError on a mismatch or an export without the probe."""
        probe: list[torch.Tensor] = []

        def model_weights():
            for name, w in weights:
                if name == PROBE:
                    probe.append(w)
                else:
                    yield name, w
        loaded = super().load_weights(model_weights())
        if not probe:
            raise ValueError(f"this EAGLE-3 export has no {PROBE}: export the draft again with this spire")
        rows = target_rows(self._spire_target)
        if rows is not None:
            check_target_rows(rows, probe[0], "EAGLE-3")
        return loaded


class CheckedEagle3Llama(_Checked, Eagle3LlamaForCausalLM):
    """vLLM's Llama-layer EAGLE-3 draft, checked against its target at start-up."""


class CheckedEagle3Qwen3(_Checked, Eagle3Qwen3ForCausalLM):
    """vLLM's Qwen3-layer EAGLE-3 draft, checked against its target at start-up."""
