"""No draft: autoregressive decoding (AD), the baseline every multiplier is measured against.

The round loop (:mod:`spire.speculative`) runs one target step per round when its draft is None.
"""

from __future__ import annotations

from spire.registry import DraftImpl


def load_draft(target, **_) -> None:
    """None: the round loop decodes autoregressively."""
    return None


KIND = DraftImpl(load=load_draft)
