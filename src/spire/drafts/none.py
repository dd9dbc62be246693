"""No draft: autoregressive decoding (AD), the baseline every multiplier is measured against.

The engine's round (:mod:`spire.engine.runner`) runs one target step per round when its draft is None.
"""

from __future__ import annotations

from spire.registry import DraftImpl


def load_draft(target, **_) -> None:
    """None: the round loop decodes autoregressively."""
    return None


KIND = DraftImpl(load=load_draft)
