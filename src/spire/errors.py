"""User-facing errors. The CLI prints any :class:`SpireError` as one line and exits non-zero."""


class SpireError(Exception):
    """Base class of every error a user can cause (bad input, missing files, impossible settings)."""


class ConfigError(SpireError):
    """An impossible or unknown setting (non-positive k/B/L, unknown preset, context too long)."""


class CheckpointError(SpireError):
    """A missing, unreadable or unsupported checkpoint."""


class DataError(SpireError):
    """Missing or unusable text data."""


class TokenizerMismatchError(SpireError):
    """Draft and target do not share a tokenizer / vocabulary."""


class TrainingError(SpireError):
    """Training cannot go on (a non-finite loss); the last good checkpoint is kept."""
