"""Why a draft accepts what it accepts: per drafted position, in real rounds (``spire tau --diagnose``).

τ alone says how many tokens a round gives, not why. This module measures, for each drafted position j = 1..k of
the rounds that reached it (the j - 1 tokens before it accepted), on the same held-out contexts and decoding as
:func:`spire.evaluation.tau.measure_tau_shared` (the rounds are the same; a hook only reads them):

- ``acceptance``: the share of reached positions whose token verification accepted (real rounds);
- ``expected_acceptance``: Σ_x min(p(x), q(x)) under the request's sampling transform, the acceptance probability
  of the position given its prefix (Leviathan et al. 2023, Lemma 3.3; greedy: 1 when the argmaxes agree): its mean
  estimates ``acceptance`` without the coin flips' noise;
- ``tv``: the total variation distance ½ Σ |p − q| between the target's and the draft's untransformed (temperature 1)
  distributions, and ``tv_verified``: the same at the same text positions with every earlier token verified (the
  draft re-run over the finished sequence one token at a time, each position drafted first in its round: for SPIRe
  its memory holds the target's activations of every earlier token; for EAGLE-3 it starts from the target's
  features). Their gap at j > 1 is what drafting over the draft's own earlier tokens costs (exposure);
- ``outside_mass``: the target's probability of tokens the draft gives q = 0 (outside a draft vocabulary);
- ``entropy_draft`` / ``entropy_target``: H(q) and H(p) in nats (temperature 1): a draft flatter than the target
  (H(q) > H(p)) loses acceptance to sampling that a greedy draft would not.

Per (draft, T), given the held-out text that follows each context, also ``overlap_by_text``: the mean 1 − TV
(temperature 1) with every earlier token verified over every position after the context, on the rounds' own output
(the target's text at T) and on the document's own continuation, with the target's mean mass outside the draft
vocabulary on each (``outside_mass``: a draft vocabulary chosen on natural text covers less of the target's sampled
text). A draft distilled on natural text that overlaps the target less on the target's sampled text than on natural
text pays that gap at T > 0 (distribution shift).

At T > 0 it also gives, per draft-side temperature factor c, the mean Σ min(p_T, q_c) at the reached positions with
q_c = the draft's distribution at temperature c·T (c = 0: the draft's argmax, q one-hot), and the τ those per-position
acceptances predict for independent positions, τ = 1 + Σ_j Π_{i ≤ j} α_i. Drafting from q_c instead of q stays
lossless (verification uses the q the tokens were drawn from); the prediction is approximate beyond position 1,
where a different draft token changes which prefixes are reached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from spire.drafts.base import Draft
from spire.errors import ConfigError
from spire.evaluation.tau import bootstrap_ratio_ci
from spire.model import Transformer
from spire.sampling import SamplingParams, probs_from_logits
from spire.engine.engine import decode_prefilled
from spire.engine.runner import RoundTrace
from spire.engine.prefill import cache_length, prefill, start_draft

FACTORS = (0.0, 0.5, 0.7, 0.85, 1.0)  # draft-side temperature factors of the counterfactual acceptance
METRICS = ("acceptance", "expected_acceptance", "tv", "tv_verified", "outside_mass", "entropy_draft",
           "entropy_target")


def tau_from_alpha(alphas) -> float:
    """τ of a round whose drafted positions accept independently with probabilities α_1..α_k:
    1 + Σ_j Π_{i ≤ j} α_i (Leviathan et al. 2023, eq. 1, with per-position rates)."""
    tau, run = 1.0, 1.0
    for a in alphas:
        if run == 0:  # nothing reaches further: later positions (even unmeasured ones) add nothing
            break
        run *= a
        tau += run
    return tau


def _known(alphas) -> bool:
    """Whether τ follows from per-position rates with gaps: every unmeasured one comes after a rate of 0."""
    for a in alphas:
        if a is None:
            return False
        if a == 0:
            return True
    return True


def _entropy(probs: torch.Tensor) -> torch.Tensor:
    return -torch.special.xlogy(probs, probs).sum(-1)


@dataclass
class Diagnosis:
    """Sums over the reached drafted positions of one (draft, temperature), per position j = 1..k.

    reached[j-1]: rounds whose position j was reached (the tokens before it accepted); sums[m][j-1]: the sum of
    metric m over them (``tv_verified`` over ``verified[j-1]`` of them: positions past the last emitted token have
    no verified counterpart); factor_sums[c][j-1]: Σ min(p_T, q_c) at sampled rows. tau: the rounds' τ with its 95 %
    CI, as :class:`~spire.evaluation.tau.TauResult` gives it."""

    draft: str
    temperature: float
    k: int
    reached: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    sums: dict[str, list[float]] = field(default_factory=dict)
    factor_sums: dict[str, list[float]] = field(default_factory=dict)
    tau: float = float("nan")
    ci: tuple[float, float] = (float("nan"), float("nan"))
    rounds: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    text_sums: dict[str, list[float]] = field(default_factory=dict)  # "generated"/"natural": [Σ TV, positions,
    # Σ outside mass]

    def __post_init__(self) -> None:
        for name in ("reached", "verified", "sampled"):
            if not getattr(self, name):
                setattr(self, name, [0] * self.k)
        for m in METRICS:
            self.sums.setdefault(m, [0.0] * self.k)
        for c in FACTORS:
            self.factor_sums.setdefault(f"{c:g}", [0.0] * self.k)

    def mean(self, metric: str) -> list[float | None]:
        n = self.verified if metric == "tv_verified" else self.reached
        return [s / c if c else None for s, c in zip(self.sums[metric], n)]

    def factor_means(self) -> dict[str, dict]:
        out = {}
        for c, sums in self.factor_sums.items():
            alphas = [s / n if n else None for s, n in zip(sums, self.sampled)]
            out[c] = {"alpha": alphas, "tau_predicted": tau_from_alpha([1.0 if a is None else a for a in alphas])
                      if _known(alphas) else None}
        return out

    def to_dict(self) -> dict:
        """The JSON form: per position j, n reached and the mean of every metric; the draft-temperature table at
        T > 0; the rounds' τ and the τ the measured acceptances predict for independent positions."""
        positions = [{"j": j + 1, "reached": self.reached[j], "verified": self.verified[j],
                      **{m: self.mean(m)[j] for m in METRICS}} for j in range(self.k)]
        acc = [p["acceptance"] for p in positions]
        predicted = tau_from_alpha([1.0 if a is None else a for a in acc]) if _known(acc) else None
        return {"draft": self.draft, "temperature": self.temperature, "k": self.k, "tau": self.tau,
                "ci_low": self.ci[0], "ci_high": self.ci[1],
                "tau_from_acceptance": predicted,
                "positions": positions,
                "draft_temperature": self.factor_means() if any(self.sampled) else None,
                "overlap_by_text": {name: {"overlap": 1 - tv / n, "positions": int(n), "outside_mass": out / n}
                                    for name, (tv, n, out) in self.text_sums.items() if n} or None}

    def add_text(self, name: str, tvs, outside=()) -> None:
        """Add the verified-prefix TVs of every position of one kind of text ("generated" or "natural") and the
        target's mass outside the draft vocabulary there (``outside``, the same positions; none: 0)."""
        tv, n, out = self.text_sums.setdefault(name, [0.0, 0, 0.0])
        tvs = list(tvs)
        self.text_sums[name] = [tv + sum(tvs), n + len(tvs), out + sum(outside)]

    def add_round(self, trace: RoundTrace, context_of_slot: list[int], record: dict) -> None:
        """Accumulate one round (see :class:`~spire.engine.runner.RoundTrace`); ``record[(context, position, j)]``
        gets each reached position's TV, for :meth:`add_verified`."""
        k = trace.draft_tokens.shape[1]
        slots = [s for s, _, _ in trace.rows]
        z = trace.draft_logits[slots].float()  # (R, k, V)
        zt = trace.target_logits[slots, :k].float()  # (R, k, V) the target at the drafted positions
        q, p = F.softmax(z, -1), F.softmax(zt, -1)
        n_acc = trace.n_accepted[slots]  # (R,)
        j = torch.arange(k, device=n_acc.device)
        budget = torch.tensor([b for _, _, b in trace.rows], device=n_acc.device)
        # (R, k): position j + 1 reached, and within the tokens the request may still emit (a token past its budget is
        # thrown away, accepted or not)
        reached = (j[None] <= n_acc[:, None]) & (j[None] < budget[:, None])
        accepted = j[None] < n_acc[:, None]
        tv = 0.5 * (p - q).abs().sum(-1)
        outside = (p * torch.isneginf(z)).sum(-1)
        per = {"acceptance": accepted.float(), "tv": tv, "outside_mass": outside, "entropy_draft": _entropy(q),
               "entropy_target": _entropy(p)}
        expected = torch.zeros_like(tv)
        for r, (_, params, _) in enumerate(trace.rows):
            pT, qT = probs_from_logits(zt[r], params), probs_from_logits(z[r], params)
            expected[r] = torch.minimum(pT, qT).sum(-1)
            if params.greedy:
                continue
            for c in FACTORS:
                if c == 0:
                    alpha = pT.gather(-1, z[r].argmax(-1, keepdim=True)).squeeze(-1)
                else:
                    qc = probs_from_logits(z[r], SamplingParams(params.temperature * c, params.top_k, params.top_p))
                    alpha = torch.minimum(pT, qc).sum(-1)
                sums = self.factor_sums[f"{c:g}"]
                for jj in range(k):
                    if reached[r, jj]:
                        sums[jj] += float(alpha[jj])
            for jj in range(k):
                self.sampled[jj] += int(reached[r, jj])
        per["expected_acceptance"] = expected
        mask = reached.float()
        for m, values in per.items():
            col = (values * mask).sum(0).tolist()
            self.sums[m] = [a + b for a, b in zip(self.sums[m], col)]
        self.reached = [a + b for a, b in zip(self.reached, reached.sum(0).tolist())]
        pos0 = trace.pos0[slots].tolist()
        for r, slot in enumerate(slots):
            for jj in range(int(reached[r].sum())):
                record[(context_of_slot[slot], pos0[r] + jj + 1, jj + 1)] = float(tv[r, jj])

    def add_verified(self, record: dict, verified_tv: dict) -> None:
        """Add the verified-prefix TV of every recorded (context, position, j) that has one."""
        for (ctx, position, j), _ in record.items():
            v = verified_tv.get((ctx, position))
            if v is not None:
                self.sums["tv_verified"][j - 1] += v
                self.verified[j - 1] += 1


@torch.no_grad()
def verified_tv(target: Transformer, draft: Draft, rows: list[list[int]], generated: list[list[int]],
                hidden: tuple[int, ...], outside: dict | None = None) -> dict[tuple[int, int], float]:
    """TV(p, q) (temperature 1) at every generated position with every earlier token verified: the draft is run over
    the sequence prompt + generated one token at a time (a one-token draft step at the pending position, then the
    target's forward there, which the draft observes: a k = 1 round whose drafted token is not fed back).

    Args:
        rows: the prompts (all the same length); generated: the tokens each row emitted.
        hidden: the target layers the prefill keeps (at least the draft's ``hidden_layers``).
        outside: when given, filled with {(row index, position): the target's mass on tokens where q = 0}.
    Returns:
        {(row index, position): TV} for the positions of the generated tokens.
    """
    B, L = len(rows), len(rows[0])
    if any(len(r) != L for r in rows):
        raise ConfigError("verified_tv needs prompts of one length")
    n = min(len(g) for g in generated)
    seq = torch.tensor([r + g[:n] for r, g in zip(rows, generated)], device=target.device)
    state = prefill(target, rows, cache_length(target, [r + g[:n] for r, g in zip(rows, generated)], 1, 1), hidden)
    start_draft(draft, target, 1, state.cache, state)
    cache = state.cache
    out: dict[tuple[int, int], float] = {}
    for t in range(n):
        pos = L - 1 + t
        tok = seq[:, pos: pos + 1]
        posv = torch.full((B, 1), pos, device=target.device)
        z = draft.step(tok, posv).float()  # (B, V): the draft at position pos + 1
        res = target(tok, posv, cache, hidden_layers=draft.hidden_layers)
        p = F.softmax(res.logits[:, -1].float(), -1)
        q = F.softmax(z, -1)
        tv = 0.5 * (p - q).abs().sum(-1)
        mass = (p * (q == 0)).sum(-1)
        draft.observe(tok, posv, res)
        for b in range(B):
            out[(b, pos + 1)] = float(tv[b])
            if outside is not None:
                outside[(b, pos + 1)] = float(mass[b])
    return out


def diagnose_shared(target: Transformer, drafts: dict[str, Draft], contexts: torch.Tensor, G: int = 64, k: int = 4,
                    params: SamplingParams = SamplingParams(), batch_size: int = 8, seed: int = 0,
                    progress: bool = True, natural: torch.Tensor | None = None) -> dict[str, Diagnosis]:
    """:func:`~spire.evaluation.tau.measure_tau_shared` with a diagnosis of every round (the same rounds, tokens and
    τ), then the verified-prefix pass over each finished sequence (and over each context's natural continuation).

    Args:
        drafts: result name -> draft (re-started for the verified pass: a draft binds one generation at a time).
        contexts: (n, L) prompt ids; G, k, params, batch_size, seed: as measure_tau_shared.
        natural: (n, >= 1) the held-out text that follows each context, or None: the diagnosis's
            ``overlap_by_text`` compares the draft on it with the draft on the rounds' output.
    Raises:
        ConfigError: G, k or batch_size < 1, no contexts or no drafts, or ``natural`` with another number of rows.
    """
    if G < 1 or k < 1 or batch_size < 1:
        raise ConfigError("G, k and batch size must be >= 1")
    if contexts.dim() != 2 or contexts.shape[0] == 0 or not drafts:
        raise ConfigError("diagnose needs a non-empty (n, L) tensor of contexts and at least one draft")
    if natural is not None and (natural.dim() != 2 or natural.shape[0] != contexts.shape[0] or natural.shape[1] < 1):
        raise ConfigError(f"natural continuations {tuple(natural.shape)} do not match contexts "
                          f"{tuple(contexts.shape)}: one row of at least one token per context")
    n = contexts.shape[0]
    hidden = tuple(sorted({j for d in drafts.values() for j in d.hidden_layers}))
    out = {name: Diagnosis(d.name, params.temperature, k) for name, d in drafts.items()}
    rounds = {name: [] for name in drafts}
    emitted = {name: [] for name in drafts}
    bar = tqdm(total=n * len(drafts), unit="ctx", dynamic_ncols=True, disable=not progress,
               desc=f"diagnose {'+'.join(drafts)} T={params.temperature:g}")
    for i in range(0, n, batch_size):
        rows = contexts[i: i + batch_size].to(target.device).tolist()
        state = prefill(target, rows, cache_length(target, rows, G, k), hidden)
        slot_ctx = list(range(len(rows)))
        for name, draft in drafts.items():
            record: dict = {}
            diag = out[name]
            res = decode_prefilled(target, state, G, draft, k, params, seed + i,
                                   round_hook=lambda tr, d=diag, rec=record: d.add_round(tr, slot_ctx, rec))
            rounds[name] += res.rounds
            emitted[name] += res.emitted
            gen_out, nat_out = {}, {}
            generated_tv = verified_tv(target, draft, rows, res.tokens, hidden, gen_out)
            diag.add_verified(record, generated_tv)
            if natural is not None:  # the same draft over both texts, every position after the context
                diag.add_text("generated", generated_tv.values(), gen_out.values())
                cont = natural[i: i + batch_size, :G].tolist()
                diag.add_text("natural", verified_tv(target, draft, rows, cont, hidden, nat_out).values(),
                              nat_out.values())
            bar.update(len(rows))
        state = None
    bar.close()
    for name, diag in out.items():
        e, r = np.array(emitted[name], float), np.array(rounds[name], float)
        diag.tau, diag.ci = float(e.sum() / r.sum()), bootstrap_ratio_ci(e, r, seed=seed)
        diag.rounds, diag.emitted = rounds[name], emitted[name]
    return out


def plot_diagnosis(rows: list[dict], path) -> None:
    """One figure: per temperature (a row of panels), acceptance in rounds (solid) and 1 − TV with earlier tokens
    drafted (dashed) and verified (dotted) against the drafted position, and H(q) − H(p); one colour per draft.
    rows: dicts with "name" and "diagnosis" (:meth:`Diagnosis.to_dict`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    temps = sorted({r["diagnosis"]["temperature"] for r in rows})
    fig, axes = plt.subplots(len(temps), 2, figsize=(11, 3.6 * len(temps)), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(r["name"] for r in rows))
    for ti, T in enumerate(temps):
        ax, ax2 = axes[ti]
        for r in rows:
            d = r["diagnosis"]
            if d["temperature"] != T:
                continue
            c = colours[names.index(r["name"]) % len(colours)]
            js = [p["j"] for p in d["positions"]]

            def series(key, transform=lambda v: v):
                return [None if p[key] is None else transform(p[key]) for p in d["positions"]]

            ax.plot(js, series("acceptance"), "-o", color=c, label=f"{r['name']} (τ {d['tau']:.2f})")
            ax.plot(js, series("tv", lambda v: 1 - v), "--", color=c, alpha=0.8)
            ax.plot(js, series("tv_verified", lambda v: 1 - v), ":", color=c, alpha=0.8)
            ax2.plot(js, [None if p["entropy_draft"] is None else p["entropy_draft"] - p["entropy_target"]
                          for p in d["positions"]], "-o", color=c, label=r["name"])
        for a in (ax, ax2):
            a.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set(title=f"T = {T:g}: acceptance (solid), 1 − TV drafted (dashed) / verified (dotted)",
               xlabel="drafted position j", ylabel="rate", ylim=(0, 1))
        ax.legend(fontsize=8)
        ax2.axhline(0, color="grey", lw=0.8)
        ax2.set(title=f"T = {T:g}: H(draft) − H(target), nats", xlabel="drafted position j")
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def diagnosis_markdown(rows: list[dict]) -> str:
    """A Markdown table: one line per (draft, T, j)."""
    lines = ["| draft | T | j | reached | acceptance | Σmin(p,q) | 1 − TV drafted | 1 − TV verified | outside mass "
             "| H(q) | H(p) |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt=".3f"):
        return "–" if v is None else format(v, fmt)

    for r in rows:
        d = r["diagnosis"]
        for p in d["positions"]:
            lines.append(f"| {r['name']} | {d['temperature']:g} | {p['j']} | {p['reached']} | {f(p['acceptance'])} | "
                         f"{f(p['expected_acceptance'])} | {f(None if p['tv'] is None else 1 - p['tv'])} | "
                         f"{f(None if p['tv_verified'] is None else 1 - p['tv_verified'])} | "
                         f"{f(p['outside_mass'], '.4f')} | {f(p['entropy_draft'], '.2f')} | "
                         f"{f(p['entropy_target'], '.2f')} |")
    texts = [r for r in rows if r["diagnosis"].get("overlap_by_text")]
    if texts:  # the draft on the target's own text against the draft on natural text
        lines += ["", "| draft | T | 1 − TV on the rounds' text | 1 − TV on the natural text | outside mass, "
                  "rounds' / natural | positions |", "|---|---|---|---|---|---|"]
        for r in texts:
            o = r["diagnosis"]["overlap_by_text"]
            gen, nat = o.get("generated", {}), o.get("natural", {})
            lines.append(f"| {r['name']} | {r['diagnosis']['temperature']:g} | {f(gen.get('overlap'))} | "
                         f"{f(nat.get('overlap'))} | {f(gen.get('outside_mass'), '.4f')} / "
                         f"{f(nat.get('outside_mass'), '.4f')} | {gen.get('positions', 0)} / "
                         f"{nat.get('positions', 0)} |")
    return "\n".join(lines)

