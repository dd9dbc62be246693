"""Defaults that the library and the command line share, each written once.

No torch here: :mod:`spire.cli` reads these at startup (for its options and their help) without importing the
library. Dataclasses of the library (:class:`spire.kv_cache.SinkWindow`, :class:`spire.drafts.spire.SpireConfig`,
:class:`spire.training.config.TrainConfig`, ...) take their defaults from here.
"""

SINK = 1
"""StreamingLLM sink tokens of a draft's sparse view (MagicDec, SPIRe; SPIRe paper §3.1; the cost model's)."""
WINDOW = 64
"""StreamingLLM window of the draft's view in tokens (MagicDec's and SPIRe's own drafts)."""
K = 4
"""Speculation depth: draft tokens per round (SPIRe paper §4)."""
N_DRAFT_LAYERS = 8
"""Blocks of a SPIRe draft pruned from the target (8 of SmolLM2's 30, about 1/4 of its body)."""

# One training run (spire.training.config.TrainConfig).
TRAIN_BUDGET_S = 1200.0
BATCH_SIZE = 4
SEQ_LEN = 256
LR = 1e-3
WARMUP_STEPS = 20
WEIGHT_DECAY = 0.0
OMEGA = 0.5
GRAD_CLIP = 1.0
SEED = 0
CHECKPOINT_EVERY_S = 60.0
EVAL_EVERY = 100
"""Steps between held-out evaluations in `spire train` and `spire reproduce` (their learning curve). The
library's TrainConfig evaluates at the end only (eval_every 0) unless told."""
