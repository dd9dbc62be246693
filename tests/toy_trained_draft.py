"""A trained draft kind's module as a newcomer would start it (tests/test_trained_toy_kind.py): "toy", whose
settings are :class:`ToyConfig`. It declares what the registry's tables ask of a trained kind (its model class
with a ``config_class``), not a draft that trains or decodes: it exists to show that a trained kind's settings are
saved, read and named from its registry line alone."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from spire.errors import ConfigError
from spire.registry import DraftImpl


@dataclass
class ToyConfig:
    """The toy kind's settings: width (draft columns), depth (blocks)."""

    width: int = 2
    depth: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ToyConfig":
        """Raises ConfigError for a key this toy does not know."""
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown toy settings {unknown}")
        return cls(**d)


class ToyDraftModel:
    """The toy kind's trainable class, as far as its settings go (:class:`spire.drafts.base.TrainableDraft`'s
    ``kind``, ``default_loss``, ``export_name`` and the ``config_class`` the trainer builds its settings from)."""

    kind, default_loss, export_name = "toy", "hard", "toy"
    config_class = ToyConfig


def load_draft(target, tokenizer=None, path=None, **_):
    raise ConfigError("--draft toy decodes nothing (a test kind)")


KIND = DraftImpl(load=load_draft, model=ToyDraftModel)
