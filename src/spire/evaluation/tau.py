"""Measuring τ, the average generation length (SPIRe paper §5 protocol; spec SPIRE.md §6).

Contexts of L tokens from held-out documents, G generated tokens each, k draft tokens per round. τ is
total emitted tokens / total rounds (bonus token included; tokens past the budget are not emitted and not
counted). The 95 % confidence interval is a percentile bootstrap over contexts of that ratio estimator.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from spire.drafts.base import Draft
from spire.errors import ConfigError
from spire.model import Transformer
from spire.sampling import SamplingParams
from spire.engine.engine import decode_prefilled
from spire.engine.prefill import cache_length, prefill
from spire.timing import Stopwatch


@dataclass
class TauResult:
    """τ with its 95 % CI. rounds/emitted: per context. wall_s: seconds spent generating (incl. prefill)."""

    draft: str
    temperature: float
    L: int
    G: int
    k: int
    n_contexts: int
    tau: float
    ci_low: float
    ci_high: float
    wall_s: float
    rounds: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)

    def to_dict(self, per_context: bool = False) -> dict:
        d = asdict(self)
        if not per_context:
            d.pop("rounds")
            d.pop("emitted")
        return d


def bootstrap_ratio_ci(emitted: np.ndarray, rounds: np.ndarray, n_boot: int = 4000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of sum(emitted) / sum(rounds), resampling contexts with replacement."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(emitted), size=(n_boot, len(emitted)))
    ratios = emitted[idx].sum(1) / rounds[idx].sum(1)
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def paired_ratio_ci(emitted_a: np.ndarray, rounds_a: np.ndarray, emitted_b: np.ndarray, rounds_b: np.ndarray,
                    n_boot: int = 4000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of τ_a / τ_b = (Σ emitted_a / Σ rounds_a) / (Σ emitted_b / Σ rounds_b) for two
    drafts measured on the same contexts (arrays of one entry per context, in the same order): each resample
    draws contexts once for both drafts, so what is common to a context (an easy or a hard text) cancels.
    Raises ConfigError when the arrays differ in length or are empty."""
    n = len(emitted_a)
    if n == 0 or not len(rounds_a) == len(emitted_b) == len(rounds_b) == n:
        raise ConfigError("a paired ratio needs both drafts measured on the same, non-empty list of contexts")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    ratios = (emitted_a[idx].sum(1) / rounds_a[idx].sum(1)) / (emitted_b[idx].sum(1) / rounds_b[idx].sum(1))
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def measure_tau(target: Transformer, draft: Draft, contexts: torch.Tensor, G: int = 64, k: int = 4,
                params: SamplingParams = SamplingParams(), batch_size: int = 8, seed: int = 0,
                progress: bool = True) -> TauResult:
    """Run speculative decoding from every context and measure τ.

    Args:
        contexts: (n, L) prompt token ids (all of length L).
        G: tokens generated per context; k: draft tokens per round; params: sampling (T = 0 greedy).
    Raises:
        ConfigError: G, k or batch_size < 1, or no contexts.
    """
    return measure_tau_shared(target, {draft.name: draft}, contexts, G, k, params, batch_size, seed,
                              progress)[draft.name]


def measure_tau_shared(target: Transformer, drafts: dict[str, Draft], contexts: torch.Tensor, G: int = 64,
                       k: int = 4, params: SamplingParams = SamplingParams(), batch_size: int = 8, seed: int = 0,
                       progress: bool = True) -> dict[str, TauResult]:
    """:func:`measure_tau` for several drafts on the same contexts, prefilling each batch once: every draft
    decodes from its own copy of the target's prefilled cache (at long L the prefill is most of the cost, so
    n drafts cost about one prefill instead of n). The rows decode on the serving engine
    (:func:`spire.engine.engine.decode_prefilled`), each finished row freed at once; context i samples with its
    own generator seeded ``seed + i``, so its tokens do not depend on the batch it ran in. Each draft's tokens,
    rounds and τ equal those of :func:`spire.engine.engine.generate_batch` (``spire generate``) run batch by
    batch with that draft alone; wall_s counts the shared prefill once per draft, as a separate run would.

    Args:
        drafts: result name -> draft.
        contexts: (n, L) prompt token ids (all of length L).
        G: tokens generated per context; k: draft tokens per round; params: sampling (T = 0 greedy).
    Raises:
        ConfigError: G, k or batch_size < 1, no contexts or no drafts.
    Returns:
        result name -> :class:`TauResult`.
    """
    if G < 1 or k < 1 or batch_size < 1:
        raise ConfigError("G, k and batch size must be >= 1")
    if contexts.dim() != 2 or contexts.shape[0] == 0:
        raise ConfigError("contexts must be a non-empty (n, L) tensor")
    if not drafts:
        raise ConfigError("no drafts to measure")
    n, L = contexts.shape
    rounds = {name: [] for name in drafts}
    emitted = {name: [] for name in drafts}
    wall = dict.fromkeys(drafts, 0.0)
    hidden = tuple(sorted({j for d in drafts.values() for j in d.hidden_layers}))
    bar = None
    if progress:
        bar = tqdm(total=n * G * len(drafts), unit="tok", dynamic_ncols=True,
                   desc=f"tau {'+'.join(drafts)} T={params.temperature:g} L={L}")
    for i in range(0, n, batch_size):
        rows = contexts[i: i + batch_size].to(target.device).tolist()
        watch = Stopwatch(target.device)
        state = prefill(target, rows, cache_length(target, rows, G, k), hidden)
        t_prefill = watch.seconds()
        for name, draft in drafts.items():
            watch = Stopwatch(target.device)
            res = decode_prefilled(target, state, G, draft, k, params, seed + i,
                                   progress=bar.update if bar is not None else None)
            wall[name] += t_prefill + watch.seconds()
            rounds[name] += res.rounds
            emitted[name] += res.emitted
        state = None  # free the prefilled cache before the next batch
    if bar is not None:
        bar.close()
    out = {}
    for name, draft in drafts.items():
        e, r = np.array(emitted[name], dtype=float), np.array(rounds[name], dtype=float)
        lo, hi = bootstrap_ratio_ci(e, r, seed=seed)
        out[name] = TauResult(draft.name, params.temperature, L, G, k, n, float(e.sum() / r.sum()), lo, hi,
                              wall[name], rounds[name], emitted[name])
    return out

