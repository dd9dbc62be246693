"""Start-up checks shared by spire's vLLM draft classes (:mod:`spire.integrations.vllm_spire`,
:mod:`spire.integrations.vllm_eagle3`): the served target against the one an export was made for. Each raises
ValueError with one line naming the mismatch, which stops vLLM at start-up. Imported inside vLLM's processes only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spire.integrations.vllm_plugin import PLUGIN_FORMAT, PROBE_ROWS

def check_format(section, what: str) -> dict:
    """The export's ``spire_vllm`` config section, if its plugin format is :data:`PLUGIN_FORMAT`; raises ValueError
    otherwise (``what``: "SPIRe" or "EAGLE-3", for the message)."""
    if not isinstance(section, dict) or section.get("plugin_format") != PLUGIN_FORMAT:
        got = section.get("plugin_format") if isinstance(section, dict) else None
        kind = "spire" if what == "SPIRe" else "eagle3"
        raise ValueError(f"spire's vLLM plugin reads plugin format {PLUGIN_FORMAT}; this {what} export has {got!r}: "
                         f"export the draft again with this spire (`spire export --draft {kind}`)")
    return section


def check_target_shape(want: dict, target_config, what: str) -> None:
    """Refuse a served target (its HF config) whose keys in ``want`` (the export's record, e.g.
    :func:`spire.integrations.vllm_export.target_record`) hold other values."""
    have = {k: getattr(target_config, k, None) for k in want}
    if have != want:
        diff = ", ".join(f"{k} {have[k]} (export made for {v})" for k, v in want.items() if have[k] != v)
        raise ValueError(f"this {what} export was made for another target: the served target has {diff}")


def target_rows(model: str) -> torch.Tensor | None:
    """The first :data:`PROBE_ROWS` embedding rows in the target checkpoint's safetensors files (float32), or None
    when ``model`` is not a local folder holding them."""
    from safetensors import safe_open

    folder = Path(model)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # the files the index names, as transformers reads them (never a stale shard beside them)
        import json

        files = [folder / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    for f in files:
        with safe_open(str(f), "pt") as h:
            for key in ("model.embed_tokens.weight", "embed_tokens.weight"):
                if key in h.keys():
                    return h.get_slice(key)[:PROBE_ROWS].float()
    return None


def same_rows(live: torch.Tensor, kept: torch.Tensor) -> bool:
    """Equal as they are, or after rounding both to bfloat16 (one side loaded in another dtype)."""
    return torch.equal(live.float(), kept.float()) or torch.equal(live.bfloat16(), kept.bfloat16())


def check_target_rows(rows: torch.Tensor, kept: torch.Tensor, what: str) -> None:
    """Refuse a target whose first embedding rows ``rows`` are not the export's ``kept``."""
    if not same_rows(rows, kept):
        raise ValueError(f"this {what} export was made for another target: the served target's embedding differs "
                         "from the one the draft was trained against (same shape, other weights)")
