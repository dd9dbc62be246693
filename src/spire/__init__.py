"""spire: throughput-oriented speculative decoding (SPIRe, Neelam et al. 2025, arXiv 2504.06419)."""

__version__ = "0.1.0"

from spire.errors import SpireError  # noqa: F401
