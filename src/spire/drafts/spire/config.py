"""SPIRe's settings, one job: :class:`SpireConfig` (the draft's architecture and ablation switches, checked against a
target: which target layers it copies, the sink + window view, the draft vocabulary, the feature input and the
bridge), the kinds of initialization (:data:`INIT_KINDS`) and the number of training windows the trainable model
samples to choose a draft vocabulary by mass (:data:`VOCAB_MASS_ROWS`) and to fit the bridge
(:data:`BRIDGE_FIT_ROWS`). The architecture they configure is described in :mod:`spire.drafts.spire`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from spire import defaults
from spire.drafts.vocab import VOCAB_FROM
from spire.errors import ConfigError


INIT_KINDS = ("pruned", "random")
VOCAB_MASS_ROWS = 64
"""Training windows over which a vocab_from="mass" draft vocabulary sums the target's probabilities (16,384
positions at 256 tokens)."""

BRIDGE_FIT_ROWS = 32
"""Training windows the bridge is fitted on (:meth:`SpireDraftModel.fit_bridge`): 32 x 256 tokens through the
target (its forward only), for d² + d = 332 K numbers on SmolLM2 (a ridge fit)."""


@dataclass
class SpireConfig:
    """Architecture of a SPIRe draft.

    n_draft_layers: blocks pruned from the target (paper: 2 of 8; default here 8 of 30 ≈ 1/4 of the body
        parameters). layers: which target layers (default: the last n_draft_layers), in draft order.
    sink, window: the StreamingLLM view (tokens); window None = full KV cache (ablation).
    mix_init: initial softmax logit given to each layer's own input in w, so that at initialization a
        drafted token's memory is close to what the target layer would have read.
    init: "pruned" (copy the target's layers) or "random" (normal(0, 0.02), norms 1; ablation).
    feedback_memory / target_activations / self_attend: see :mod:`spire.drafts.spire`.
    vocab_size: draft vocabulary N (beyond the paper; EAGLE-3's d2t map): the draft's head covers N target
        token ids (the N most frequent in the training text, :func:`frequent_tokens`) and gives q = 0 to every
        other token; None = the target's whole vocabulary. Verification stays lossless (q is exactly the
        distribution drafts are drawn from); the head costs N/V of the full one in training and drafting.
    vocab_from: how those N ids are chosen: "frequency" (the N most frequent in the training text) or "mass" (the
        N with the largest target probability summed over VOCAB_MASS_ROWS training windows,
        :func:`probable_tokens`).
    feature_input: beyond the paper (EAGLE's feature input, Li et al. 2024): a drafted position's residual
        stream gets a learned projection of the previous position's feature, the residual stream
        entering the last draft layer: the target's (entering target layer ``source_layers[-1]``) when the
        previous position is verified, the draft's own when it was drafted. The projection starts at zero, so
        an untrained draft is the paper's. Needs target activations. The projection is added to the residual
        stream entering draft layer ``feature_layer`` (None: the first draft layer not copied from the same
        target depth, i.e. where a drafted position's shallow residual meets a deep target layer: 2 for
        target layers 0, 1, 24..29; 0 for the last layers). feature_from: the draft layer whose input residual
        is the feature (None: the last draft layer).
    bridge: beyond the paper: a learned affine map (d x d weights and a bias) on the residual stream entering
        the junction layer (:meth:`junction_layer`: the first draft layer not copied from the same target depth;
        2 for target layers 0, 1, 24..29, 0 for the last layers), applied before it at every position the draft
        computes. It starts as the identity (an untrained draft is the paper's); :meth:`SpireDraftModel.fit_bridge`
        sets it by ridge least squares from the target's residual stream at the junction's depth to the one
        entering the junction layer's source layer, on training text (the trainer does so for a pruned draft).
    """

    n_draft_layers: int = defaults.N_DRAFT_LAYERS
    sink: int = defaults.SINK
    window: int | None = defaults.WINDOW
    mix_init: float = 4.0
    layers: tuple[int, ...] | None = None
    init: str = "pruned"
    feedback_memory: bool = True
    target_activations: bool = True
    self_attend: bool = True
    vocab_size: int | None = None
    vocab_from: str = "frequency"
    feature_input: bool = False
    feature_layer: int | None = None
    feature_from: int | None = None
    bridge: bool = False

    def __post_init__(self) -> None:
        if self.layers is not None:
            self.layers = tuple(int(j) for j in self.layers)
            self.n_draft_layers = len(self.layers)

    def validate(self, n_target_layers: int, target_vocab_size: int | None = None) -> None:
        """Raise ConfigError for settings that cannot be built for a target of n_target_layers layers (and, when
        given, a vocabulary of target_vocab_size tokens)."""
        n_t = n_target_layers
        if not 1 <= self.n_draft_layers <= n_t:
            raise ConfigError(f"n_draft_layers must be in [1, {n_t}], got {self.n_draft_layers}")
        if self.layers is not None and (len(set(self.layers)) != len(self.layers)
                                        or any(not 0 <= j < n_t for j in self.layers)):
            raise ConfigError(f"draft layers must be distinct target layers in [0, {n_t - 1}], got {list(self.layers)}")
        if self.init not in INIT_KINDS:
            raise ConfigError(f"init must be one of {', '.join(INIT_KINDS)}, got {self.init!r}")
        if self.vocab_from not in VOCAB_FROM:
            raise ConfigError(f"the draft vocabulary is chosen by {' or '.join(VOCAB_FROM)} (--draft-vocab-from), "
                              f"got {self.vocab_from!r}")
        if self.vocab_from != "frequency" and self.vocab_size is None:
            raise ConfigError(f"--draft-vocab-from {self.vocab_from} chooses a draft vocabulary: give its size "
                              "(--draft-vocab N)")
        if self.window is not None and self.window < 1 or self.sink < 0:
            raise ConfigError(f"sink must be >= 0 and window >= 1 (or None), got {self.sink}, {self.window}")
        if not self.target_activations and self.feedback_memory:
            raise ConfigError("target_activations=False needs feedback_memory=False (the paper's ablation "
                              "'no feedback memory and no target activations'): feedback memory over the "
                              "draft's own past would make training sequential")
        if not self.target_activations and not self.self_attend:
            raise ConfigError("self_attend=False applies to the memory of target activations only")
        if self.feature_input and not self.target_activations:
            raise ConfigError("feature_input needs target activations (the previous position's feature is the "
                              "target's residual stream)")
        if self.feature_layer is not None and not 0 <= self.feature_layer < self.n_draft_layers:
            raise ConfigError(f"feature_layer must be a draft layer in [0, {self.n_draft_layers - 1}], got "
                              f"{self.feature_layer}")
        if self.feature_from is not None and not 0 <= self.feature_from < self.n_draft_layers:
            raise ConfigError(f"feature_from must be a draft layer in [0, {self.n_draft_layers - 1}], got "
                              f"{self.feature_from}")
        if self.bridge and self.source_layers(n_t)[self.junction_layer(n_t)] == self.junction_layer(n_t):
            raise ConfigError(f"a bridge needs a junction (a draft layer not copied from the same target depth): "
                              f"draft layers {list(self.source_layers(n_t))} have none")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ConfigError(f"the draft vocabulary must hold at least 1 token, got {self.vocab_size}")
        if self.vocab_size is not None and target_vocab_size is not None and self.vocab_size > target_vocab_size:
            raise ConfigError(f"the draft vocabulary ({self.vocab_size}) is larger than the target's "
                              f"({target_vocab_size})")

    def source_layers(self, n_target_layers: int) -> tuple[int, ...]:
        """Target layer j of each draft layer i."""
        if self.layers is not None:
            return self.layers
        return tuple(range(n_target_layers - self.n_draft_layers, n_target_layers))

    def junction_layer(self, n_target_layers: int) -> int:
        """The first draft layer i whose source layer is not target layer i: where the draft's residual stream
        (the target's own below it, at initialization) meets a target layer of another depth (0 if none)."""
        src = self.source_layers(n_target_layers)
        return next((i for i, j in enumerate(src) if j != i), 0)

    def resolved_feature_layer(self, n_target_layers: int) -> int:
        """The draft layer whose input receives the feature (see feature_layer)."""
        return self.junction_layer(n_target_layers) if self.feature_layer is None else self.feature_layer

    def to_dict(self) -> dict:
        """The JSON form; ``vocab_from`` only when it is not the default "frequency", so that the saved settings
        of runs from before the field existed read and write back unchanged."""
        d = asdict(self)
        d["layers"] = None if self.layers is None else list(self.layers)
        if d["vocab_from"] == "frequency":
            del d["vocab_from"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SpireConfig":
        """The settings of :meth:`to_dict`'s form (``layers`` as a list or a tuple). Raises TypeError for a key
        this spire does not know."""
        return cls(**d)
