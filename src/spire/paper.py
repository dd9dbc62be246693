"""The SPIRe paper's published numbers (arXiv 2504.06419), each written once; torch-free, imports nothing.

What spire measures is compared against these: the report of ``spire reproduce`` (``evaluation/report.py``), the
cost model's presets (``throughput/shapes.py``) and the ablation figure (``throughput/analysis.py``). The τ of
each draft kind at L = 512 is also on its registry line (``registry.Kind.paper_tau``), equal to
``PAPER_TAU_TABLE[512]`` (tests/test_throughput_paper.py checks it).
"""

from __future__ import annotations

PAPER_TAU_TABLE = {
    256: {"vanilla": 2.637, "magicdec": 4.005, "spire": 3.427},
    512: {"vanilla": 2.647, "magicdec": 3.891, "spire": 3.401},
    960: {"vanilla": 2.644, "magicdec": 3.793, "spire": 3.382},
}
"""τ per context length L the paper measured (k = 4, 64 generated tokens, LongCrawl64 validation, 67M target)."""

PAPER_ABLATION_TAU = {"none": 3.401, "no-feedback": 3.352, "no-feedback-no-target": 2.959, "omega1": 3.375,
                      "hard-loss": 3.069, "random-init": 3.105}
"""τ of the paper's ablated SPIRe drafts (Figure 5, L = 512, k = 4), keyed by the trainer's ablation names
(``training.config.ABLATIONS``; "none" is the full SPIRe draft). All keep the sparse KV cache; the paper gives no
τ for "full-kv" (its cost is computed analytically, ``throughput.analysis.ablation_rows``)."""
