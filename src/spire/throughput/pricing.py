"""The cost model's view of spire's model instances: a :class:`~spire.model.Transformer`'s
:class:`~spire.throughput.shapes.ModelShape`, a draft's cost-model kind, shape, sink and window, and the bytes per
weight value its forward streams. Shared by ``spire bench`` (:mod:`spire.bench.run`) and the serving k policy
(:mod:`spire.serving.policy`). It imports no torch and nothing above the cost model: the instances it reads
(a :class:`~spire.model.Transformer`, a :class:`~spire.drafts.base.Draft`) are duck-typed."""

from __future__ import annotations

from spire import defaults
import spire.registry as registry
from spire.errors import ConfigError
from spire.throughput.shapes import ModelShape


def shape_of(model: Transformer) -> ModelShape:
    """The cost model's :class:`ModelShape` of a spire :class:`Transformer`."""
    c = model.cfg
    return ModelShape(c.n_layers, c.d_model, c.n_heads // c.n_kv_heads, c.n_kv_heads, c.d_head, c.d_ff,
                      c.vocab_size, c.tie_embeddings)


def draft_kind_and_shape(draft: Draft, target: Transformer) -> tuple[str, ModelShape, int, int]:
    """(cost-model kind, draft shape, sink, window) of a draft instance: its registered kind (``draft.name``) and
    :meth:`Draft.cost_shape`. Raises ConfigError for a draft the cost model has no formula for."""
    entry = registry.kind(getattr(draft, "name", None))
    if entry.pricing is None:
        raise ConfigError(f"no cost-model formula for draft {type(draft).__name__}")
    view = getattr(draft, "view", None) or getattr(getattr(draft, "model", None), "view", None)
    sink, window = (view.sink, view.window) if view is not None else (defaults.SINK, defaults.WINDOW)
    return entry.name, draft.cost_shape(shape_of(target)), sink, window


def draft_bytes(draft: Draft, kind: str, shape: ModelShape, own_bytes: float, target_bytes: float) -> float:
    """Bytes per weight value a draft's forward streams: the target's for MagicDec (its weights), ``own_bytes``
    for a draft with weights of its own, and for a full-vocabulary SPIRe draft whose own bytes differ from the
    target's the mean over its body (own bytes) and its head (the target's unembedding, at the target's bytes)."""
    if registry.kind(kind).pricing.weights == "target":
        return target_bytes
    if kind == "spire" and own_bytes != target_bytes and draft.model.vocab is None:
        body, head = shape.body_params(), shape.unembedding_params()
        return (body * own_bytes + head * target_bytes) / (body + head)
    return own_bytes
