"""spire's vLLM plugin: the ``vllm.general_plugins`` entry point (pyproject.toml) that registers the SPIRe draft
architecture with vLLM's model registry, in every vLLM process, before any model config is read. Light: vLLM
imports the model class (:mod:`spire.integrations.vllm_spire`) only when a SPIRe export is served."""

ARCHITECTURE = "Eagle3SpireDraftForCausalLM"
"""The architecture name a SPIRe export's vLLM config.json gives (vLLM keeps an EAGLE-3 draft's architecture
name only when it starts or ends with ``Eagle3``)."""

PLUGIN_FORMAT = 1
"""The layout of the ``spire_vllm`` section and of the weights the plugin's model reads (written by
:func:`spire.integrations.vllm_export.spire_vllm_folder`); an export of another format is refused at start-up."""
PROBE_ROWS = 64
"""Target embedding rows a SPIRe export keeps, to recognize its target at start-up."""


def register() -> None:
    """Register :data:`ARCHITECTURE` (idempotent: vLLM calls every general plugin once per process)."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "spire.integrations.vllm_spire:SpireDraftForVllm")
