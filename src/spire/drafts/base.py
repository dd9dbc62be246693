"""The protocol every draft implements for the round loop of the engine (:mod:`spire.engine.runner`).

A round (SPIRe paper §2): the draft proposes k tokens one forward at a time, the target verifies k+1
positions in one forward, a prefix is accepted per row, and the draft is told what was committed.
Positions are absolute text positions, starting at 0 at each row's first token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import torch

from spire.errors import ConfigError
from spire.kv_cache import KVCache, Span
from spire.model import ForwardOutput, Transformer
from spire.throughput.shapes import default_draft_shape


class Draft(ABC):
    """A draft model bound to one generation (``start``) at a time.

    ``hidden_layers`` names the target layers whose *input* residual streams the draft needs; the round
    loop asks the target for them in prefill and verify and passes them to :meth:`observe`.
    """

    name: str = "draft"
    source: str | None = None
    """What its weights were loaded from (a file or folder; None: no weights, or built in memory): named by
    `spire serve`'s start-up line."""
    hidden_layers: tuple[int, ...] = ()
    defer_observe: int = 0
    """> 0: the observes of AD rounds (one position per row) may reach this draft late, up to this many at once,
    as one :meth:`observe` of those positions with ``valid`` marking the rows that ran (the engine replays them
    before the draft drafts or observes anything else). Its observe must then give the same state for T positions
    at once as for T calls of one, and never read ``target_out.logits``. 0: every observe as it happens."""
    observe_keeps: tuple[int, int] | None = None
    """(sink, tail), set by :meth:`start`, when an observe of many positions changes only what the row's positions
    < sink and its last ``tail`` valid positions write (a sink + window cache that every position enters by its
    own projection, as SPIRe's with target activations): the engine then passes a prefill to :meth:`observe` as
    those positions alone (O(sink + tail) per row, whatever the prompt's length; the draft's state is the same),
    and of a run of AD rounds keeps only the last ``tail`` for it (with ``defer_observe``: a catch-up of O(tail)
    positions when it is next used, whatever the gap; :mod:`spire.engine.deferred`), and a position that a later
    position of the same prompt overwrites (p <= the prompt's last prefilled position - tail) need not reach it at
    all. None: every position."""
    observe_rows: bool = False
    """True: :meth:`observe` takes ``rows`` (B,) int64, the batch rows that the B rows it is given are, and leaves
    every other row as it was (a prefill of a few slots of a wide batch then costs those rows alone). False: the
    engine gives it every row of the batch, the others marked invalid."""

    @abstractmethod
    def start(self, target: Transformer, target_cache: KVCache, batch_size: int, max_len: int, k: int) -> None:
        """Allocate per-generation state for ``batch_size`` rows, positions < max_len, k tokens per round."""

    @abstractmethod
    def step(self, tokens: torch.Tensor, pos: torch.Tensor, span: Span | None = None) -> torch.Tensor:
        """One draft forward. tokens, pos: (B, 1) -> float32 logits (B, V) for position pos + 1. ``span``: pos on
        the host (:class:`spire.kv_cache.Span`), when the caller knows it: a draft then reads nothing back from
        the device (no host sync in the step)."""

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Forget rows ``rows`` ((R,) int64 indices into the batch bound by :meth:`start`): a new request takes
        those slots (continuous batching, :mod:`spire.engine`), and nothing of the previous request
        (KV, memory, n-gram context) may be read for it. The draft's :meth:`observe` must then honour ``valid``
        (False rows and positions are not written), since the engine observes a joining request's prefill with
        the other rows masked out. Raises ConfigError for a draft that cannot restart single rows (yet)."""
        raise ConfigError(f"the {self.name} draft cannot restart single rows of its batch yet, so it cannot run "
                          "with continuous batching (spire serve); see docs/serving.md")

    def use_rows(self, n: int) -> bool:
        """Run the next steps and observes on rows [0, n) of the batch bound by :meth:`start` only (continuous
        batching: the slots past n are free), the state of every row kept. Called between rounds (after an
        observe), n from 1 to the batch size. Returns False when the draft cannot: the engine then runs every
        round on the whole batch."""
        return False

    def proposes(self, tokens: torch.Tensor, pos: torch.Tensor, span: Span | None = None,
                 contexts: Sequence[Sequence[int] | None] | None = None) -> torch.Tensor | list[bool] | None:
        """Whether the next :meth:`step` at ``tokens``, ``pos`` (B, 1) has a real proposal for each row: (B,) bool, or
        None when it always has one (a model's draft). A draft that proposes only where it finds something (the
        n-gram lookup) says where it does, so that a round policy gives the other rows to another draft or none.
        Reads the draft's state without changing it. ``span``: pos on the host, as for :meth:`step`. ``contexts``:
        each row's tokens at positions 0..pos (the pending token last) as the host knows them (None for a row
        without a request): a draft that can decide from them returns a host list of B bools and reads nothing
        back from the device."""
        return None

    def cost_shape(self, target):
        """The cost model's :class:`~spire.throughput.shapes.ModelShape` of this draft, given the target's: by
        default what its kind's pricing implies (:func:`spire.throughput.shapes.default_draft_shape`)."""
        return default_draft_shape(target, self.name)

    def observe(self, tokens: torch.Tensor, pos: torch.Tensor, target_out: ForwardOutput,
                valid: torch.Tensor | None = None, span: Span | None = None) -> None:
        """The target has just run on ``tokens`` at ``pos`` (B, T) (prefill or verify); ``target_out``
        holds its logits and the requested hidden states; ``valid`` (B, T) marks real tokens (False for
        right-padding in a batched prefill); ``span``: pos on the host, as for :meth:`step`. Entries past each row's committed length may be stale; the
        next round overwrites them before any query reads them."""


@runtime_checkable
class TrainableDraft(Protocol):
    """What the trainer (:mod:`spire.training.trainer`) asks of a draft model, so that it never asks which class
    it has. Implemented by :class:`spire.drafts.spire.SpireDraftModel` and
    :class:`spire.drafts.vanilla.VanillaDraftModel`; the trainer finds the class by ``TrainConfig.draft``
    (its kind's ``KIND.model`` in :mod:`spire.registry`).

    kind: the name in ``TrainConfig.draft``. default_loss: "mixed" or "hard" (the method's loss when the
    config names none). export_name: what :meth:`export` writes inside a run folder (the kind's registry line
    declares it too, as :attr:`spire.registry.Kind.run_weights`, for the light parts). vocab: the draft
    vocabulary's target ids (N,), or None when the draft's logits cover the target's whole vocabulary.
    """

    kind: str
    default_loss: str
    export_name: str
    vocab: torch.Tensor | None

    @classmethod
    def for_training(cls, target: Transformer, cfg, data=None) -> "TrainableDraft":
        """A fresh draft for the TrainConfig ``cfg`` (float32, on the target's device, trainable); ``data``: the
        training text (a draft vocabulary is chosen from its counts). Raises ConfigError."""

    def target_layers(self) -> tuple[int, ...]:
        """Target layers whose input residual streams the teacher-forced pass reads (() for none)."""

    def train_logits(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], k: int) -> torch.Tensor:
        """Teacher-forced logits (B, T, N) for tokens (B, T), as inference computes them; position t predicts
        token t + 1. hidden: target layer j -> (B, T, d) for every layer of :meth:`target_layers`."""

    def to_draft_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target token ids (...) -> columns of the draft's logits (...), -100 outside a draft vocabulary."""

    def save_checkpoint(self, path: Path, target: Transformer, meta: dict) -> None:
        """Write the trainable weights to the file ``path`` (atomically), with ``meta`` in its metadata."""

    def load_checkpoint(self, path: Path, target: Transformer) -> None:
        """Load weights written by :meth:`save_checkpoint`. Raises CheckpointError / TokenizerMismatchError."""

    def export(self, out_dir: Path, target: Transformer, meta: dict, target_folder: Path | None = None) -> Path:
        """Write the user-facing draft into the run folder ``out_dir`` (``out_dir / export_name``), readable by
        ``spire generate --draft <kind> --draft-path``. Returns its path."""

    def as_draft(self) -> Draft:
        """The inference :class:`Draft` over this model (for the engine's rounds, :mod:`spire.engine.runner`)."""
