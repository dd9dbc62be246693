"""spire's vLLM plugin: the ``vllm.general_plugins`` entry point (pyproject.toml) that registers spire's draft
architectures with vLLM's model registry, in every vLLM process, before any model config is read: SPIRe's, and
vLLM's EAGLE-3 classes with spire's start-up checks; and it applies spire's run-time fixes of vLLM
(:mod:`spire.integrations.vllm_fixes`). Light: vLLM imports a model class
(:mod:`spire.integrations.vllm_spire`, :mod:`spire.integrations.vllm_eagle3`) only when an export names it."""

ARCHITECTURE = "Eagle3SpireDraftForCausalLM"
"""The architecture name a SPIRe export's vLLM config.json gives (vLLM keeps an EAGLE-3 draft's architecture
name only when it starts or ends with ``Eagle3``)."""

PLUGIN_FORMAT = 1
"""The layout of the ``spire_vllm`` section and of the weights the plugin's model reads (written by
:func:`spire.integrations.vllm_export.spire_vllm_folder`); an export of another format is refused at start-up."""
PROBE_ROWS = 64
"""Target embedding rows a SPIRe or EAGLE-3 export for vLLM keeps, to recognize its target at start-up."""


EAGLE3_ARCHITECTURES = {"llama": "Eagle3SpireLlamaForCausalLM", "qwen3": "Eagle3SpireQwen3ForCausalLM"}
"""EAGLE-3 draft layer type → the architecture an EAGLE-3 export's ``vllm/`` config.json gives: vLLM's own class
with spire's start-up checks (:mod:`spire.integrations.vllm_eagle3`)."""

EAGLE3_PROBE = "spire.target_probe"
"""The tensor (in ``spire_probe.safetensors`` of an EAGLE-3 export's ``vllm/``) holding the target's first
:data:`PROBE_ROWS` embedding rows; not a model weight."""

_CLASSES = {ARCHITECTURE: "spire.integrations.vllm_spire:SpireDraftForVllm",
            EAGLE3_ARCHITECTURES["llama"]: "spire.integrations.vllm_eagle3:CheckedEagle3Llama",
            EAGLE3_ARCHITECTURES["qwen3"]: "spire.integrations.vllm_eagle3:CheckedEagle3Qwen3"}


def register() -> None:
    """Register spire's architectures and apply spire's run-time fixes of vLLM
    (:mod:`spire.integrations.vllm_fixes`); idempotent: vLLM calls every general plugin once per process."""
    from vllm import ModelRegistry

    from spire.integrations import vllm_fixes

    vllm_fixes.apply()

    for name, cls in _CLASSES.items():
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, cls)
