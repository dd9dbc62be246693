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

import numpy as np

import spire.registry as registry
from spire.engine.scheduler import RoundChoice, draft_sets  # torch-free, as this module
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



# ---- the measured round policy (spire serve's default) ------------------------------------------------------------


class Acceptance:
    """Acceptance measured per draft and per drafted position, over a recent window, not as one i.i.d. α.

    For draft d and position j = 1..k_max it keeps exponentially decayed counts of the row-rounds that *reached* j
    (drafted at least j tokens and had the j - 1 before accepted) and of those that accepted j, separately for
    greedy and sampled requests; their ratio is the conditional acceptance c_j (what vLLM's dynamic manager
    measures per position). Each request also keeps its own counts, since a request's text decides much of its
    acceptance (prose vs code); its rate at j is its own counts with the window's c_j as ``request_weight``
    pseudo-counts. The expected tokens a request commits in a round of k tokens from d is then
    1 + sum_{j=1..k} prod_{m<=j} c_m (the bonus or recovered token included), capped at what it may still emit.

    Args:
        n_drafts, k_max: the drafts and the most tokens a round drafts.
        prior: c_j before any round, per draft (one value for every position); prior_weight: its weight in
            row-rounds; half_life: row-rounds after which a count weighs half.
    """

    def __init__(self, n_drafts: int, k_max: int, prior: Sequence[float], prior_weight: float = 8.0,
                 half_life: float = 256.0, request_weight: float = 4.0) -> None:
        if len(prior) != n_drafts or any(not 0.0 < p < 1.0 for p in prior):
            raise ConfigError(f"acceptance priors must be one per draft in (0, 1), got {list(prior)}")
        self.k_max, self.request_weight = k_max, request_weight
        self.decay = 0.5 ** (1.0 / half_life)
        # [draft][mode] -> (reached (k,), accepted (k,)) as lists of floats; mode 0 greedy, 1 sampled
        self.window = [[([prior_weight] * k_max, [prior_weight * p] * k_max) for _ in (0, 1)] for p in prior]
        self.own: dict[int, dict[int, tuple[list[float], list[float]]]] = {}  # request id -> draft -> counts

    def rates(self, d: int, mode: int, request: int | None = None) -> list[float]:
        """c_1..c_k_max of draft d for a request (its own counts blended in) or for the window alone."""
        reached, acc = self.window[d][mode]
        c = [a / r if r > 0 else 0.5 for a, r in zip(acc, reached)]
        own = self.own.get(request, {}).get(d) if request is not None else None
        if own is None:
            return c
        w = self.request_weight
        return [(a + w * cj) / (r + w) for (r, a, cj) in zip(own[0], own[1], c)]

    def expected(self, d: int, mode: int, request: int | None, k: int, cap: float) -> float:
        """Expected tokens committed in a round of k tokens from d (at most ``cap``)."""
        e, run = 1.0, 1.0
        for cj in self.rates(d, mode, request)[:k]:
            run *= cj
            e += run
        return min(e, max(1.0, cap))

    def table(self, modes: Sequence[int], requests: Sequence[int], k: int, caps: Sequence[float]) -> np.ndarray:
        """(D, n, k) float64: [d, i, j] = :meth:`expected` (d, modes[i], requests[i], j + 1, caps[i]) for every draft
        d and row i at once (one round policy choice reads them all; the same arithmetic, in the same order)."""
        n, w = len(requests), self.request_weight
        out = np.empty((len(self.window), n, self.k_max))
        mode_of = np.asarray(modes, dtype=np.int64)
        for d in range(len(self.window)):
            rows = np.array([self.rates(d, 0), self.rates(d, 1)])[mode_of]  # (n, k_max) the window's rates
            own = [i for i, rid in enumerate(requests) if d in self.own.get(rid, ())]
            if own:
                reached = np.array([self.own[requests[i]][d][0] for i in own])
                acc = np.array([self.own[requests[i]][d][1] for i in own])
                rows[own] = (acc + w * rows[own]) / (reached + w)
            out[d] = rows
        e = 1.0 + np.cumsum(np.cumprod(out[:, :, :k], axis=2), axis=2)
        return np.minimum(e, np.maximum(1.0, np.asarray(caps, dtype=np.float64))[None, :, None])

    def update(self, d: int, mode: int, request: int, k: int, accepted: int) -> None:
        """A request drafted k tokens from d and ``accepted`` (0..k) of them were accepted."""
        reached, acc = self.window[d][mode]
        g = self.decay
        for j in range(self.k_max):
            reached[j] *= g
            acc[j] *= g
        own = self.own.setdefault(request, {}).setdefault(d, ([0.0] * self.k_max, [0.0] * self.k_max))
        for j in range(min(k, accepted + 1)):
            reached[j] += 1
            own[0][j] += 1
            if j < accepted:
                acc[j] += 1
                own[1][j] += 1

    def forget(self, keep: set[int]) -> None:
        """Drop the counts of requests not in ``keep`` (those that ended)."""
        for rid in [r for r in self.own if r not in keep]:
            del self.own[rid]


def longest(running) -> int:
    """The context a round is priced at: its longest running request's committed length (tokens). A round reads
    every row's keys up to the highest position of the batch (:class:`spire.fastpath.CacheAccess`), so over rows of
    mixed lengths its cost follows the longest, not the mean: priced at the mean context, SD rounds of 32 streams
    of 128-1,751 tokens ran 1.4-1.5x their profile on a 2-core CPU (the profile's rows all have one length)."""
    return max((r.committed for r in running), default=1)


class MeasuredPolicy:
    """The round policy of ``spire serve`` (its default whenever a draft is served): per running request, which
    draft proposes (or none) and the round's depth k, chosen to maximise the expected committed tokens per second of
    the whole round, from measured costs and measured acceptance.

    For each depth k in 0..cap and each set S of drafts (:func:`~spire.engine.profile.draft_sets`), every request
    takes the draft of S that proposes for it (:meth:`~spire.drafts.base.Draft.proposes`: the n-gram lookup
    matches) with the most expected tokens (:class:`Acceptance`), or none; the round's rate is the sum of the
    requests' expected tokens over the seconds :class:`~spire.engine.profile.StepCosts` predicts for (width, longest
    context (:func:`longest`), k, S), each request still prefilling counted as one token of every round (its prefill
    advances one piece per step, so a longer round delays its first token as much as a running request's next one:
    at 32 streams on a 2-core CPU, SD rounds chosen without it while half the slots prefilled raised the mean time
    to first token from 15 s to 20 s). k = 0 (AD, one token per request) is always a candidate, so where no draft pays the policy
    drafts nothing and the round costs what an AD round costs. A request that samples with a seed drafts nothing: its
    tokens are then its AD tokens for that seed, whatever the policy chose for the others (a draft's proposals, which
    the policy's history decides, would change which of its generator's draws make its tokens). A draft unused for ``explore_every`` rounds in a row
    is tried for one round at k = 1 where it proposes, so that its acceptance keeps being measured; each try that
    the policy would not have chosen doubles that interval (up to 64x), and the interval resets once the draft is
    chosen again.

    Args:
        names: the engine's drafts' names, in order (for reports).
        costs: the measured round costs.
        acceptance: the measured acceptance.
        explore_every: rounds without a draft before it is tried (0: never).
    """

    def __init__(self, names: Sequence[str], costs, acceptance: Acceptance, explore_every: int = 32) -> None:
        if explore_every < 0:
            raise ConfigError(f"explore_every must be >= 0, got {explore_every}")
        self.names, self.costs, self.acceptance = list(names), costs, acceptance
        self.sets = draft_sets(len(self.names))
        self.explore_every = explore_every
        self.idle = [0] * len(self.names)  # rounds since each draft last proposed
        self.backoff = [1] * len(self.names)
        self.explored: int | None = None  # the draft the last round tried without being chosen
        self.last: dict | None = None  # what the last choice expected (for reports and tests)

    @staticmethod
    def _mode(req) -> int:
        return 0 if req.sampling.greedy else 1

    def choose(self, plan, width: int, proposes: Sequence[Sequence[bool] | None]):
        running, cap = plan.running, plan.k
        n = len(running)
        context = longest(running)
        left = [r.params.max_tokens - len(r.emitted) for r in running]
        # a request still prefilling advances one piece per step whatever the round: a longer round delays it as
        # much as it delays a running request's AD token, so it counts as one token of every candidate round
        waiting = getattr(plan, "prefilling", 0)
        ad_rate = float(n + waiting) / self.costs.predict(width, context, 0, ())  # AD: one token per request
        best = (ad_rate, RoundChoice.uniform(n, 0), 0.0)
        # a seeded sampled request drafts nothing: its draws are then its AD draws, one per token, whatever the
        # other requests' acceptance made the policy choose (docs/serving.md: a seeded request repeats)
        free = [r.params.seed is None or r.sampling.greedy for r in running]
        can = [[free[i] and (p is None or bool(p[i])) for i in range(n)] for p in proposes]
        if cap and n and any(map(any, can)):
            # gains[d, i, k - 1]: the tokens request i expects from draft d at depth k (0 where d may not propose)
            gains = np.where(np.array(can, dtype=bool)[:, :, None],
                             self.acceptance.table([self._mode(r) for r in running], [r.id for r in running], cap,
                                                   left), 0.0)
            options = []  # per draft set: each row's draft (index into the set) and expected tokens, per k
            for s in self.sets:
                g = gains[list(s)]  # (|s|, n, cap)
                pick = g.argmax(0)  # (n, cap): the set's first draft of the most expected tokens
                top = np.take_along_axis(g, pick[None], 0)[0]
                drafted = top > 0.0
                total = np.where(drafted, top, 1.0).sum(0)  # (cap,) tokens of the round, AD rows one each
                # a draft of the set that proposes for nobody: a smaller set is the same round, cheaper
                whole = np.all([(drafted & (pick == j)).any(0) for j in range(len(s))], axis=0)
                options.append((s, pick, drafted, total, whole))
            for k in range(1, cap + 1):
                for s, pick, drafted, total, whole in options:
                    if not whole[k - 1]:
                        continue
                    rate = float(total[k - 1] + waiting) / self.costs.predict(width, context, k, s)
                    if rate > best[0]:
                        used = drafted[:, k - 1]
                        choice = RoundChoice(k, [s[j] if u else None for j, u in zip(pick[:, k - 1].tolist(),
                                                                                        used.tolist())],
                                             [k if u else 0 for u in used.tolist()])
                        best = (rate, choice, float(total[k - 1]))
        rate, choice, total = best
        self.explored = None
        if cap and self.explore_every:
            for d in range(len(self.names)):
                self.idle[d] = 0 if d in choice.used else self.idle[d] + 1
                if (self.explored is None and self.idle[d] > self.explore_every * self.backoff[d]
                        and any(can[d])):
                    choice = RoundChoice(1, [d if can[d][i] else None for i in range(n)],
                                         [1 if can[d][i] else 0 for i in range(n)])
                    self.explored, self.idle[d] = d, 0
                    self.backoff[d] = min(64, self.backoff[d] * 2)
            for d in choice.used:
                if d != self.explored:
                    self.backoff[d] = 1
        self.last = {"rate": rate, "ad_rate": ad_rate, "k": choice.k, "context": context, "width": width,
                     "prefilling": waiting}
        return choice

    def update(self, plan, accepted: Sequence[int], seconds: float) -> None:
        choice = plan.choice
        for i, r in enumerate(plan.running):
            if choice.drafts[i] is not None and choice.ks[i]:
                self.acceptance.update(choice.drafts[i], self._mode(r), r.id, choice.ks[i], accepted[i])
        context = longest(plan.running)
        self.costs.observe(plan.width, context, choice.k, choice.used, seconds)
        if len(self.acceptance.own) > 64:
            self.acceptance.forget({r.id for r in plan.running})


def batch_size_ks(model: RoundModel, alphas: Sequence[float], k_max: int, context: int, max_batch: int) -> list[int]:
    """The k in 0..k_max that the cost model rates best at each batch size B = 1..max_batch and context ``context``
    (``spire export --k-table``, vLLM's ``num_speculative_tokens_per_batch_size``): the argmax of τ(k) / Δt(B, L, k)
    (k = 0: AD, multiplier 1; ties: the smaller k), with τ(k) = 1 + Σ_{j ≤ k} Π_{m ≤ j} α_m from the draft's held-out
    acceptance per drafted position α_1..α_K (positions past K take α_K). Raises ConfigError for k_max < 1,
    max_batch < 1, no α or one outside [0, 1]."""
    if k_max < 1 or max_batch < 1 or not alphas or any(not 0.0 <= a <= 1.0 for a in alphas):
        raise ConfigError(f"batch_size_ks needs k_max >= 1, max_batch >= 1 and alphas in [0, 1], got {k_max}, "
                          f"{max_batch}, {list(alphas)}")
    taus, run = [1.0], 1.0
    for j in range(k_max):
        run *= alphas[min(j, len(alphas) - 1)]
        taus.append(taus[-1] + run)
    out = []
    for B in range(1, max_batch + 1):
        m = [1.0] + [taus[k] / model.delta_t(B, context, k) for k in range(1, k_max + 1)]
        out.append(max(range(k_max + 1), key=lambda k: (m[k], -k)))
    return out
