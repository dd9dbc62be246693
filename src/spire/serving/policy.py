"""k per round from the cost model: how many draft tokens the engine's next round proposes, given the requests
that run in it (``spire serve --k-policy cost-model``).

vLLM exposes the same idea as a table (``num_speculative_tokens_per_batch_size``); here the table is the cost model
of :mod:`spire.throughput.cost_model` (SPIRE.md §2) evaluated at the round's batch size B (running requests) and
context L (their mean committed length), with the hardware operational intensity of this device
(:mod:`spire.bench.calibrate`) and the draft's acceptance rate α as the engine measures it:

    multiplier(k) = τ(k) / Δt(B, L, k),   τ(k) = (1 − α^{k+1}) / (1 − α)   (i.i.d. acceptance, paper §2)

The policy picks the k in 1..k_max with the highest multiplier, or 0 (an AD round) when none beats 1: the model
predicts that SD loses there. An AD round still shows the draft what the target committed
(:meth:`~spire.drafts.base.Draft.observe`), so SD can resume at any later round; that observe is not free for a
draft that runs its own layers over the committed tokens (vanilla, EAGLE-3: one draft step), which the model's AD
round does not price. After ``explore_every`` AD rounds in a row, one round drafts the best k >= 1 anyway, so that
α keeps being measured where the prior was too pessimistic.

α starts at a prior and follows the engine's rounds: a row-round that drafted k tokens and accepted n of them is n
successes and, when n < k, one failure of a Bernoulli(α) chain, so α̂ = successes / (successes + failures) is the
maximum-likelihood estimate under the paper's i.i.d. acceptance (the prior counts as ``prior_rounds`` such
row-rounds at α_prior).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import spire.registry as registry
from spire.errors import ConfigError
from spire.throughput.cost_model import CostOptions, forward_time, round_costs, tau_from_alpha
from spire.throughput.pricing import draft_bytes, draft_kind_and_shape, shape_of
from spire.throughput.shapes import ModelShape


class KPolicy(Protocol):
    """What :class:`~spire.engine.engine.Engine` asks of a k policy."""

    def k_for(self, batch: int, context: float) -> int:
        """Draft tokens for the next round (0 = an AD round) for ``batch`` running requests of mean committed
        length ``context`` (tokens)."""

    def observe(self, accepted: Sequence[int], k: int) -> None:
        """The round just run drafted ``k`` tokens per row (k >= 1) and accepted ``accepted[i]`` in row i."""


@dataclass(frozen=True)
class RoundModel:
    """The cost model of one engine's rounds: the target and draft shapes, the draft's cost-model kind, the
    operational intensity ``hoi`` (FLOP/byte) and the bytes per value of the target's and the draft's weights and
    of the KV cache (``target_options``, ``draft_options``: :class:`CostOptions`; the draft's forward is priced
    with its own)."""

    target: ModelShape
    draft: ModelShape
    kind: str
    hoi: float
    target_options: CostOptions
    draft_options: CostOptions
    combine: str = "max"

    def delta_t(self, B: int, L: int, k: int) -> float:
        """Δt = (k·t_d + t_v) / t_t of a round of k draft tokens at batch B and context L (SPIRE.md §2)."""
        def t(c) -> float:
            return forward_time(c.C, c.N, c.KV, self.hoi, self.combine)

        draft = self.target if registry.kind(self.kind).pricing.weights == "target" else self.draft  # MagicDec
        c = round_costs(self.target, draft, self.kind, B, L, k, options=self.target_options)
        d = c.draft if self.draft_options == self.target_options else round_costs(
            self.target, draft, self.kind, B, L, k, options=self.draft_options).draft
        return (k * t(d) + t(c.verify)) / t(c.target)


class CostModelPolicy:
    """k per round = argmax over k in 0..k_max of τ(k)/Δt(B, L, k) (k = 0: AD, multiplier 1); see the module
    docstring.

    Args:
        model: the :class:`RoundModel` of the served target and draft.
        k_max: the engine's k (the most a round drafts).
        alpha_prior: α before any round (in (0, 1)); the draft's held-out α where known.
        prior_rounds: weight of the prior, in row-rounds (>= 0).
        context_step: L is rounded up to a multiple of it (the choice changes slowly with L).
        explore_every: after this many AD rounds in a row, one SD round (0: never).
    Raises:
        ConfigError: k_max < 1, alpha_prior outside (0, 1), prior_rounds < 0, context_step < 1 or
            explore_every < 0.
    """

    def __init__(self, model: RoundModel, k_max: int, alpha_prior: float = 0.6, prior_rounds: float = 16.0,
                 context_step: int = 64, explore_every: int = 32) -> None:
        if k_max < 1:
            raise ConfigError(f"k_max must be >= 1, got {k_max}")
        if not 0.0 < alpha_prior < 1.0:
            raise ConfigError(f"alpha_prior must be in (0, 1), got {alpha_prior}")
        if prior_rounds < 0 or context_step < 1 or explore_every < 0:
            raise ConfigError(f"prior_rounds, explore_every must be >= 0 and context_step >= 1, got {prior_rounds}, "
                              f"{explore_every}, {context_step}")
        self.model, self.k_max, self.context_step = model, k_max, context_step
        self.explore_every, self._ad_run = explore_every, 0
        # the prior as pseudo-counts: a row-round accepts α/(1-α) tokens per failure on average (long chains)
        self.successes = prior_rounds * alpha_prior / (1.0 - alpha_prior)
        self.failures = float(prior_rounds)

    @property
    def alpha(self) -> float:
        """The current estimate of α (clamped to [0.001, 0.999])."""
        total = self.successes + self.failures
        a = self.successes / total if total > 0 else 0.5
        return min(max(a, 1e-3), 1.0 - 1e-3)

    def multipliers(self, batch: int, context: float) -> list[float]:
        """The modeled multiplier τ(k)/Δt for k = 0..k_max at the current α (element 0 is AD's 1.0)."""
        L = max(1, -(-int(context) // self.context_step) * self.context_step)
        a = self.alpha
        return [1.0] + [tau_from_alpha(a, k) / self.model.delta_t(batch, L, k) for k in range(1, self.k_max + 1)]

    def best_k(self, batch: int, context: float) -> int:
        """The k in 0..k_max of the highest modeled multiplier (ties: the smaller k)."""
        m = self.multipliers(batch, context)
        return max(range(len(m)), key=lambda k: (m[k], -k))

    def k_for(self, batch: int, context: float) -> int:
        k = self.best_k(batch, context)
        self._ad_run = self._ad_run + 1 if k == 0 else 0
        if k == 0 and self.explore_every and self._ad_run > self.explore_every:
            self._ad_run = 0
            m = self.multipliers(batch, context)
            k = max(range(1, len(m)), key=lambda j: (m[j], -j))
        return k

    def observe(self, accepted: Sequence[int], k: int) -> None:
        for n in accepted:
            self.successes += n
            self.failures += n < k


def round_model(target, draft, hoi: float, weight_bytes: float = 4.0, draft_weight_bytes: float | None = None
                ) -> RoundModel:
    """The :class:`RoundModel` of a served target (:class:`~spire.model.Transformer`) and an inference draft, as
    ``spire bench`` prices them (:mod:`spire.bench.run`, :mod:`spire.throughput.pricing`: attention FLOPs and embeddings counted, the draft's sink and
    window, KV at the target's bytes per value). weight_bytes: bytes per target weight value (4 float32, 2 bf16);
    draft_weight_bytes: the draft's own (default weight_bytes; MagicDec's draft is the target). Raises ConfigError
    for a draft the cost model has no formula for."""
    from dataclasses import replace

    kind, d_shape, sink, window = draft_kind_and_shape(draft, target)
    kv_bytes = float(target.dtype.itemsize)  # activations and KV cache at the target's dtype
    options = CostOptions(weight_bytes=weight_bytes, kv_bytes=kv_bytes, attention_flops=True, embeddings=True,
                          sink=sink, window=window)
    own = weight_bytes if draft_weight_bytes is None else draft_weight_bytes
    d_bytes = draft_bytes(draft, kind, d_shape, own, weight_bytes)
    return RoundModel(shape_of(target), d_shape, kind, hoi, options, replace(options, weight_bytes=d_bytes))

