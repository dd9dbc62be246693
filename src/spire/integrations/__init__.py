"""spire's drafts in other serving engines (docs/serving.md). ``vllm_export``: the form `spire export` writes for
vLLM; it imports nothing of vLLM, so that spire's own venv needs none of it."""
