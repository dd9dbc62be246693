"""The n-gram (prompt lookup) draft, vLLM's ``ngram`` method (:mod:`spire.drafts.ngram`): its proposals on
hand-made sequences and against a pure-Python reference (itself checked against vLLM's documented example),
greedy identity with AD, lossless sampling at every emitted position, per-generation and per-row state (a
previous request on the same slot, other rows, right-padding and stale drafts are never read), the context
limit and the token budget, and the n_min / n_max refusals."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from spire.drafts.ngram import (NgramConfig, NgramDraft, host_source, load_draft, match_sources, ngram_propose,
                                ngram_source)
from spire.errors import ConfigError
from spire.sampling import SamplingParams, probs_from_logits, sample
import tests.oracle as spec
from tests.oracle import generate
from spire.verification import verify
from tests.conftest import make_tiny
from tests.test_sampling_positions import _uniform_pvalue
from tests.test_verification import _mutant_verify


def _random_prompts(lengths, seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _round(draft: NgramDraft, target, rows: list[list[int]], k: int, max_len: int | None = None) -> list[list[int]]:
    """One drafting round by hand: start, observe the right-padded prefill (all but each row's last token),
    then k steps from each row's last token at its own position. Checks that every step's logits are a
    one-hot q (float32, 0 at one token, -inf elsewhere). Returns the proposals per row."""
    B, lens = len(rows), torch.tensor([len(r) for r in rows])
    max_len = max_len or int(lens.max()) + k + 1
    draft.start(target, None, B, max_len, k)
    width = int(lens.max()) - 1
    if width > 0:
        padded = torch.zeros(B, width, dtype=torch.long)  # pad id 0, also a real token of some rows
        for b, r in enumerate(rows):
            padded[b, : len(r) - 1] = torch.tensor(r[:-1])
        pos = torch.arange(width)[None].expand(B, width)
        draft.observe(padded, pos, None, valid=pos < (lens - 1)[:, None])
    tok, out = torch.tensor([r[-1] for r in rows]), []
    for j in range(k):
        logits = draft.step(tok[:, None], (lens - 1 + j)[:, None])
        assert logits.dtype == torch.float32 and logits.shape == (B, target.cfg.vocab_size)
        assert ((logits == 0).sum(-1) == 1).all() and (torch.isinf(logits) | (logits == 0)).all()
        tok = logits.argmax(-1)
        out.append(tok)
    return torch.stack(out, 1).tolist()


# --- configuration ---------------------------------------------------------------------------------------------

def test_config_follows_vllm_defaults_and_refuses_bad_bounds():
    assert (NgramConfig().n_min, NgramConfig().n_max) == (5, 5)  # vLLM: both 5 when neither is given
    assert (NgramConfig(n_max=3).n_min, NgramConfig(n_max=3).n_max) == (3, 3)  # one given: the other follows
    assert (NgramConfig(n_min=2).n_min, NgramConfig(n_min=2).n_max) == (2, 2)
    assert (NgramConfig(1, 4).n_min, NgramConfig(1, 4).n_max) == (1, 4)
    for bad, msg in [((0, 3), "n_min must be >= 1"), ((-2, None), "n_min must be >= 1"),
                     ((3, 2), "n_max must be >= n_min"), ((2.5, 3), "integer"), ((True, 3), "integer")]:
        with pytest.raises(ConfigError, match=msg):
            NgramConfig(*bad)
    cfg = NgramConfig(2, 3)
    cfg.n_max = 1  # mutated after construction: refused again where it is used
    with pytest.raises(ConfigError, match="n_max must be >= n_min"):
        NgramDraft(cfg)
    with pytest.raises(ConfigError, match="no --draft-path"):
        load_draft(None, path="some/file")
    d = load_draft(None, n_max=3)
    assert d.name == "ngram" and d.hidden_layers == () and (d.cfg.n_min, d.cfg.n_max) == (3, 3)
    from spire.drafts import make_draft

    assert make_draft("ngram", None, n_min=2, n_max=None).cfg.n_max == 2  # None: not given
    with pytest.raises(ConfigError, match="--ngram-min is an option of --draft ngram, not --draft magicdec"):
        make_draft("magicdec", None, n_min=2)
    from spire import registry  # min > max refused with the options, before any model loads

    with pytest.raises(ConfigError, match="^--ngram-min 4 exceeds --ngram-max 2$"):
        registry.check_options("ngram", {"n_min": 4, "n_max": 2})
    assert registry.check_options("ngram", {"n_min": 4, "n_max": None}) == {"n_min": 4}


# --- proposals on hand-made sequences ------------------------------------------------------------------------

def test_reference_follows_vllm_example():
    """vLLM's NgramProposer docstring: [1,2,3,4,2,3], min 2, max 3, k 4 -> [4,2,3] (all that follows the
    match); this draft then keeps copying from the same source (a periodic continuation)."""
    assert ngram_propose([1, 2, 3, 4, 2, 3], 4, NgramConfig(2, 3)) == [4, 2, 3, 4]
    assert ngram_propose([1, 2, 3, 4, 2, 3], 3, NgramConfig(2, 3)) == [4, 2, 3]


@pytest.mark.parametrize("context,cfg,k,expected", [
    # the 3-gram [1,2,3] (-> 50) beats the earlier 2-gram [2,3] (-> 60)
    ([2, 3, 60, 1, 2, 3, 50, 8, 1, 2, 3], (1, 3), 2, [50, 8]),
    # n_max = 2 caps it: the earliest [2,3] wins
    ([2, 3, 60, 1, 2, 3, 50, 8, 1, 2, 3], (1, 2), 2, [60, 1]),
    ([2, 3, 60, 1, 2, 3, 50, 8, 1, 2, 3], (3, 3), 1, [50]),
    # n_min = 4: no 4-gram occurs earlier -> the last token, repeated (the lookup is retried after each)
    ([2, 3, 60, 1, 2, 3, 50, 8, 1, 2, 3], (4, 5), 3, [3, 3, 3]),
    # equal n: the earliest occurrence wins (vLLM), not the most recent
    ([5, 6, 1, 5, 6, 2, 5, 6], (2, 2), 1, [1]),
    ([5, 6, 1, 5, 6, 2, 5, 6], (1, 3), 1, [1]),
    # no earlier occurrence at all, and contexts shorter than n_min + 1
    ([1, 2, 3, 4], (1, 3), 3, [4, 4, 4]),
    ([7], (1, 1), 2, [7, 7]),
    ([7, 7], (2, 2), 1, [7]),
    # a match overlapping the suffix (a period-1 run), and copying past the context's end (period 3)
    ([9, 4, 4, 4, 4], (1, 3), 3, [4, 4, 4]),
    ([1, 2, 3, 1, 2], (2, 2), 5, [3, 1, 2, 3, 1]),
])
def test_proposals_on_hand_made_sequences(tiny, context, cfg, k, expected):
    cfg = NgramConfig(*cfg)
    assert ngram_propose(context, k, cfg) == expected
    assert _round(NgramDraft(cfg), tiny, [context], k) == [expected]


def test_vectorized_lookup_matches_the_reference():
    """match_sources on random rows (small vocabularies: many matches and ties), with garbage past each row's
    position (stale drafts, padding) that must not be read."""
    rng = random.Random(0)
    for _ in range(150):
        R, W, V = 8, rng.randint(2, 48), rng.choice([2, 3, 7])
        buf = torch.randint(0, V, (R, W), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        pos = torch.tensor([rng.randrange(W) for _ in range(R)])
        n_min = rng.randint(1, 4)
        n_max = rng.randint(n_min, 6)
        got = match_sources(buf, pos, n_min, n_max).tolist()
        for r in range(R):
            ref = ngram_source(buf[r, : pos[r] + 1].tolist(), n_min, n_max)
            assert got[r] == (-1 if ref is None else ref)


def test_host_lookup_matches_the_reference():
    """host_source (the engine's lookup over the host's token ids) on random contexts with many matches and ties,
    contexts of one token and bounds longer than the context included."""
    rng = random.Random(1)
    for _ in range(400):
        ctx = [rng.randrange(rng.choice([2, 3, 7])) for _ in range(rng.randint(1, 48))]
        n_min = rng.randint(1, 4)
        n_max = rng.randint(n_min, 6)
        ref = ngram_source(ctx, n_min, n_max)
        assert host_source(ctx, n_min, n_max) == (-1 if ref is None else ref)


def test_the_engine_s_host_lookup_is_the_device_s(tiny):
    """In the engine, the n-gram draft answers the round policy from the host's token ids (no read of the device):
    at every round its answer and its first proposals equal those of the lookup on the device, for rows of
    different lengths joining and leaving."""
    from spire.engine.engine import Engine
    from spire.params import RequestParams

    draft = NgramDraft(NgramConfig(1, 3))
    engine = Engine(tiny, [draft], k=3, max_running=3, max_len=96)
    seen, real = [], NgramDraft.proposes

    def both(self, tokens, pos, span=None, contexts=None):
        on_device = real(self, tokens, pos, span=None).tolist()
        got = real(self, tokens, pos, span=span, contexts=contexts)
        assert isinstance(got, list)
        rows = [i for i, c in enumerate(contexts) if c is not None]
        assert [got[i] for i in rows] == [on_device[i] for i in rows]
        assert all(len(contexts[i]) == int(pos[i, 0]) + 1 for i in rows)
        seen.append(sum(got[i] for i in rows))
        return got

    for i, prompt in enumerate(_random_prompts([9, 14, 5, 20], seed=3, vocab=4)):
        engine.add_request(prompt, RequestParams(max_tokens=12 + 3 * i, ignore_eos=True))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NgramDraft, "proposes", both)
        outs = {}
        while engine.has_work():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.new_tokens)
    assert len(seen) > 5 and sum(seen) > 0
    ad = Engine(tiny, None, max_running=3, max_len=96)
    for i, prompt in enumerate(_random_prompts([9, 14, 5, 20], seed=3, vocab=4)):
        ad.add_request(prompt, RequestParams(max_tokens=12 + 3 * i, ignore_eos=True))
    ad_outs = {}
    while ad.has_work():
        for o in ad.step():
            ad_outs.setdefault(o.request_id, []).extend(o.new_tokens)
    assert outs == ad_outs


def test_rows_read_only_their_own_tokens(tiny):
    """Mixed lengths in one batch: row 1's suffix occurs in row 0 (followed by 6) and in the right-padding
    region of the prefill (pad id 0); row 1 has no earlier occurrence of its own and must not propose 6."""
    rows = [[1, 2, 3, 4, 5, 6, 10, 11, 12, 13, 14, 15, 1, 2, 3, 4, 5],
            [40, 41, 3, 4, 5],
            [0, 0, 9, 0, 7, 0],  # ends in the pad id: only its own 0s count (the earliest is followed by 0)
            [8]]
    props = _round(NgramDraft(NgramConfig(1, 3)), tiny, rows, 3)
    assert props[0] == [6, 10, 11]
    assert props[1] == [5, 5, 5]
    assert props[2] == ngram_propose(rows[2], 3, NgramConfig(1, 3)) == [0, 9, 0]
    assert props[3] == [8, 8, 8]
    # the same rows one at a time give the same proposals
    for b, r in enumerate(rows):
        assert _round(NgramDraft(NgramConfig(1, 3)), tiny, [r], 3) == [props[b]]


def test_start_resets_every_row_between_generations(tiny):
    """A previous request on the same slot is never seen (llama.cpp #27852, vLLM #42533, transformers #47195):
    after a generation whose row 0 held 5 6 7 8, a new one with row 0 = 9 5 6 proposes 6 (nothing follows
    5 6 in its own context), not 7; a smaller batch and a shorter context reallocate the state."""
    draft = NgramDraft(NgramConfig(1, 3))
    first = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 1, 2, 1, 2, 1, 2, 1, 5, 6]]
    assert _round(draft, tiny, first, 4, max_len=64) == [[7, 8, 5, 6], [6, 6, 6, 6]]
    assert _round(draft, tiny, [[9, 5, 6]], 4) == [[6, 6, 6, 6]]
    assert draft.buf.shape == (1, 3 + 4 + 1)
    assert _round(draft, tiny, [[5, 6], [2, 1, 5]], 2) == [[6, 6], [5, 5]]


# --- the round loop: greedy identity, τ, budget and context limit -------------------------------------------------

def _logging(draft: NgramDraft):
    """Wrap step / observe to record each round's proposals: a list of rounds, each {"pos0": (B,), "props": [(B,)]}"""
    rounds, step, observe = [], draft.step, draft.observe
    fresh = [True]

    def logged_step(tokens, pos):
        logits = step(tokens, pos)
        if fresh[0]:
            rounds.append({"pos0": pos[:, 0].tolist(), "props": []})
            fresh[0] = False
        rounds[-1]["props"].append(logits.argmax(-1).tolist())
        return logits

    def logged_observe(*a, **kw):
        fresh[0] = True
        return observe(*a, **kw)

    draft.step, draft.observe = logged_step, logged_observe
    return rounds


def _check_against_reference(rounds, prompts, tokens, k, cfg):
    """Every round's k proposals of every row equal the reference on that row's own committed context."""
    for rnd in rounds:
        for b, p0 in enumerate(rnd["pos0"]):
            context = (prompts[b] + tokens[b])[: p0 + 1]
            assert [step[b] for step in rnd["props"]] == ngram_propose(context, k, cfg)


def _repetitive(pattern_len=9, repeats=9, seed=5):
    pattern = _random_prompts([pattern_len], seed)[0]
    return pattern * repeats + pattern[:4]


@pytest.mark.parametrize("cfg,k", [((5, 5), 4), ((1, 3), 4), ((2, 4), 8)])
def test_greedy_identity_with_ad_and_tau(tiny, cfg, k):
    """Mixed lengths (1, 17, 300 and a repeated 9-token pattern): token-identical to AD; the proposals follow
    the reference on each row's own context; τ > 1.5 on the repetitive prompt."""
    cfg = NgramConfig(*cfg)
    prompts = _random_prompts([1, 17, 300]) + [_repetitive()]
    ad = generate(tiny, prompts, 48)
    draft = NgramDraft(cfg)
    rounds = _logging(draft)
    sd = generate(tiny, prompts, 48, draft=draft, k=k)
    assert sd.tokens == ad.tokens
    assert sd.emitted == [48] * len(prompts)
    _check_against_reference(rounds, prompts, sd.tokens, k, cfg)
    assert sd.row_tau(3) > 1.5, [sd.row_tau(b) for b in range(len(prompts))]
    seen = {a for r in sd.accepted_per_round for a in r}
    assert 0 in seen and k in seen  # rejections at 0 and full accepts both happen


def test_budget_and_context_limit(tiny):
    """The last positions the target has (max_positions 1024): prompt 1000 + 20 new tokens + k = 4 fill its
    1024 positions exactly; a budget below k is never overshot; a step past the draft's context is refused."""
    prompt = (_repetitive() * 20)[:1000]
    ad = generate(tiny, [prompt, prompt[:7]], 20)
    draft = NgramDraft(NgramConfig(1, 4))
    sd = generate(tiny, [prompt, prompt[:7]], 20, draft=draft, k=4)
    assert draft.max_len == 1024 and sd.tokens == ad.tokens and sd.emitted == [20, 20]
    with pytest.raises(ConfigError, match="exceeds"):  # one more token would pass the target's positions
        generate(tiny, [prompt], 21, draft=NgramDraft(), k=4)
    small = generate(tiny, [_repetitive()], 3, draft=NgramDraft(NgramConfig(1, 3)), k=8)
    assert small.emitted == [3] and small.tokens == generate(tiny, [_repetitive()], 3).tokens
    draft = NgramDraft(NgramConfig(1, 2))
    draft.start(tiny, None, 2, 10, 4)
    draft.step(torch.tensor([[3], [4]]), torch.tensor([[8], [2]]))  # proposes position 9: the last one
    with pytest.raises(ConfigError, match="position 10"):
        draft.step(torch.tensor([[3], [4]]), torch.tensor([[9], [2]]))


@pytest.mark.slow
def test_smollm2_repetitive_text(smollm2):
    """The real target on text that repeats: identical to AD, τ well above 1."""
    model, tok = smollm2
    text = "apple, banana, cherry, grape, lemon, mango, orange, peach, " * 4 + "apple,"
    prompts = [tok(text).input_ids, tok("The capital of France is").input_ids]
    ad = generate(model, prompts, 24)
    sd = generate(model, prompts, 24, draft=NgramDraft(NgramConfig(1, 3)), k=4)
    assert sd.tokens == ad.tokens
    assert sd.row_tau(0) > 2.5


# --- sampling: q is one-hot, verification stays exact ------------------------------------------------------------

PARAMS = [SamplingParams(1.0), SamplingParams(0.8, top_k=20, top_p=0.9), SamplingParams(0.7, top_p=0.95),
          SamplingParams(1.3, top_k=1), SamplingParams(1e-30)]


def test_q_is_one_hot_under_every_sampling_transform(tiny):
    draft = NgramDraft(NgramConfig(1, 2))
    draft.start(tiny, None, 3, 16, 2)
    draft.observe(torch.tensor([[4, 5, 6], [4, 4, 4], [1, 2, 3]]), torch.arange(3)[None].expand(3, 3), None)
    logits = draft.step(torch.tensor([[4], [4], [9]]), torch.tensor([[3], [3], [3]]))
    expected = torch.tensor([5, 4, 9])
    for params in PARAMS:
        q = probs_from_logits(logits, params)
        assert torch.equal(q, torch.nn.functional.one_hot(expected, tiny.cfg.vocab_size).float()), params
        assert torch.equal(sample(q, torch.Generator().manual_seed(0)), expected)


def test_verification_with_a_one_hot_q_accepts_with_p_and_resamples_without_x():
    """With q one-hot at x: accepted with probability p(x); a rejection draws from p without x, renormalized;
    so the first emitted token is distributed as p."""
    from scipy.stats import binomtest, chisquare

    N, x = 40_000, 1
    p = torch.tensor([0.2, 0.35, 0.3, 0.15])
    q = torch.nn.functional.one_hot(torch.tensor(x), 4).float()
    g = torch.Generator().manual_seed(7)
    n_acc, nxt = verify(torch.full((N, 1), x), q.expand(N, 1, 4), p.expand(N, 2, 4), g)
    assert binomtest(int(n_acc.sum()), N, 0.35).pvalue > 1e-3
    rejected = np.bincount(nxt[n_acc == 0].numpy(), minlength=4)
    assert rejected[x] == 0
    without = np.array([0.2, 0.0, 0.3, 0.15]) / 0.65
    keep = without > 0
    assert chisquare(rejected[keep], without[keep] * rejected.sum()).pvalue > 1e-3
    first = torch.where(n_acc == 1, torch.tensor(x), nxt).numpy()
    assert chisquare(np.bincount(first, minlength=4), p.numpy().astype(float) * N).pvalue > 1e-3


K = 3
NEW = 8
ROWS = 240  # per prompt


@pytest.fixture(scope="module")
def peaked():
    """A tiny target whose greedy text falls into loops, and prompts that end inside them: at T ~ 1 its
    samples often continue the loop, so n-gram proposals are often accepted (many full accepts, many bonus
    tokens) while rejections still happen."""
    target = make_tiny(seed=0)
    seeds = _random_prompts([1, 9, 23], seed=2)
    prompts = [s + t for s, t in zip(seeds, generate(target, seeds, 24).tokens)]
    return target, prompts


def _pit_groups(target, prompts, draft, params, seed):
    """Randomized PIT u of every emitted token under the target's exact p (an uncached forward of the whole
    sequence), grouped: all, block position j, bonus (after a full accept), round2-first, per prompt; as in
    tests/test_sampling_positions.py. Uniform on (0, 1) iff every token is drawn from p."""
    rows = [prompts[i % len(prompts)] for i in range(ROWS * len(prompts))]
    res = generate(target, rows, NEW, draft=draft, k=K, params=params, generator=torch.Generator().manual_seed(seed))
    g = np.random.default_rng(seed)
    groups: dict[str, list[float]] = {}
    for i, prompt in enumerate(prompts):
        idx = [b for b in range(len(rows)) if b % len(prompts) == i]
        seqs = torch.tensor([prompt + res.tokens[b] for b in idx])
        with torch.no_grad():
            logits = target(seqs, torch.arange(seqs.shape[1])[None].expand_as(seqs)).logits[:, len(prompt) - 1: -1]
        p = probs_from_logits(logits, params).double().numpy()
        for r, b in enumerate(idx):
            assert len(res.tokens[b]) == NEW
            t = rnd = 0
            while t < NEW:
                for j in range(res.accepted_per_round[rnd][b] + 1):
                    if t == NEW:
                        break
                    dist, y = p[r, t], res.tokens[b][t]
                    assert dist[y] > 0, f"token {y} has no mass under the transformed target ({params})"
                    before = dist[dist > dist[y]].sum() + dist[(dist == dist[y]) & (np.arange(len(dist)) < y)].sum()
                    u = before + g.random() * dist[y]
                    keys = ["all", f"position{j}", f"prompt{i}"] + (["bonus"] if j == K else [])
                    keys += ["round2-first"] if rnd == 1 and j == 0 else []
                    for key in keys:
                        groups.setdefault(key, []).append(u)
                    t += 1
                rnd += 1
    return {key: np.array(v) for key, v in groups.items()}, res


@pytest.mark.slow
@pytest.mark.parametrize("params", PARAMS[:3])
def test_sampling_is_lossless_at_every_position(peaked, params):
    target, prompts = peaked
    groups, res = _pit_groups(target, prompts, NgramDraft(NgramConfig(1, 3)), params, seed=31)
    assert len(groups["bonus"]) > 250, len(groups["bonus"])  # 350 to 750 full accepts
    assert res.tau > 1.3
    pvalues = {key: _uniform_pvalue(u) for key, u in groups.items()}
    assert min(pvalues.values()) > 1e-3, pvalues


@pytest.mark.slow
def test_a_wrong_correction_is_caught(peaked, monkeypatch):
    """Power: drawing the correction from p instead of p without x (a one-hot q makes them differ at x) is
    rejected by the same statistic."""
    target, prompts = peaked
    monkeypatch.setattr(spec, "verify", _mutant_verify("correction-from-p"))
    groups, _ = _pit_groups(target, prompts, NgramDraft(NgramConfig(1, 3)), SamplingParams(1.0), seed=31)
    assert _uniform_pvalue(groups["all"]) < 1e-3
