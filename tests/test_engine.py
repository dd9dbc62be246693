"""The continuous-batching engine (spire.serving.engine, issue 31): greedy output of every request equals its own
single-request AD output with requests joining mid-stream, slots are reused without leaking state, abort frees a
slot, per-request sampling settings and seeds, EOS / stop strings inside an accepted block, and T = 1 sampling
distributed as the target's (chi-square) with rows joining mid-stream, bonus position included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spire.drafts import make_draft
from spire.drafts.base import Draft
from spire.drafts.eagle3 import Eagle3Config, Eagle3Draft
from spire.drafts.magicdec import MagicDecDraft
from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel
from spire.drafts.vanilla import VanillaDraft
from spire.errors import ConfigError
from spire.sampling import SamplingParams, probs_from_logits
from spire.engine.engine import Engine
from spire.params import RequestParams
from tests.oracle import generate
from tests.conftest import make_tiny
from tests.test_lossless import _chi2

DRAFTS = ["none", "magicdec", "ngram", "spire", "spire-dense", "vanilla", "eagle3", "magicdec-all-rows"]


class AllRowsMagicDec(MagicDecDraft):
    """A draft that cannot narrow to the occupied rows: the engine runs every round on all slots."""

    def use_rows(self, n: int) -> bool:
        return False


def _draft(kind: str, target):
    if kind == "magicdec-all-rows":
        return AllRowsMagicDec(window=4)
    if kind in ("spire", "spire-dense"):
        torch.manual_seed(3)
        window = 4 if kind == "spire" else None
        return SpireDraft(SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=window)))
    if kind == "vanilla":
        return VanillaDraft(make_tiny(seed=4, n_layers=1))
    if kind in ("eagle3", "eagle3-full-vocab"):
        from tests.test_eagle3 import _draft as eagle3_model

        vocab = 60 if kind == "eagle3" else target.cfg.vocab_size
        torch.manual_seed(3)  # the model's own initialization, before the helper's seeded noise
        return Eagle3Draft(eagle3_model(target, Eagle3Config(layers=(1, 2, 4), draft_vocab=vocab)))
    if kind == "magicdec":
        return make_draft("magicdec", target, window=4)
    if kind == "ngram":
        return make_draft("ngram", target, n_min=1, n_max=3)
    return make_draft(kind, target)


def _prompts(n: int, seed: int = 0, vocab: int = 97) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 5, 17, 3, 40, 9, 2, 30, 11, 6][:n]
    out = [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lengths]
    out[3] = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]  # repetitive: the n-gram draft proposes from it
    return out


def _run(engine: Engine, jobs: list[tuple[int, list[int], RequestParams]]) -> dict[int, dict]:
    """Drive the engine: job j = (the step it is added at, prompt, params). Returns per job its tokens, finish
    reason and accepted counts."""
    results, ids, step = {}, {}, 0
    todo = sorted(enumerate(jobs), key=lambda x: x[1][0])
    while todo or engine.has_work():
        while todo and todo[0][1][0] <= step:
            j, (_, prompt, params) = todo.pop(0)
            ids[engine.add_request(prompt, params)] = j
            results[j] = {"tokens": [], "reason": None, "accepted": []}
        for o in engine.step():
            r = results[ids[o.request_id]]
            r["tokens"] += o.new_tokens
            if o.accepted is not None:
                r["accepted"].append(o.accepted)
            if o.finished:
                r["reason"] = o.finish_reason
        assert engine.num_running <= engine.max_running
        step += 1
    return results


@pytest.mark.parametrize("kind", DRAFTS)
def test_greedy_equals_per_request_ad_with_staggered_joins(tiny, kind):
    """10 requests of prompt lengths 1..40 and budgets 6..33 join every other step into 3 slots (so slots are
    reused); each one's tokens are its own single-request AD output."""
    prompts = _prompts(10)
    jobs = [(2 * i, p, RequestParams(max_tokens=6 + 3 * i)) for i, p in enumerate(prompts)]
    engine = Engine(tiny, _draft(kind, tiny), k=3, max_running=3, max_len=96)
    widths = []
    step = engine.step
    engine.step = lambda: step() + [widths.append(engine.width)][:0]
    res = _run(engine, jobs)
    for j, (_, p, params) in enumerate(jobs):
        assert res[j]["tokens"] == generate(tiny, [p], params.max_tokens).tokens[0], (kind, j)
        assert res[j]["reason"] == "length"
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert set(widths) == ({3} if kind == "magicdec-all-rows" else {1, 2, 3})  # rounds run on the occupied rows
    if kind not in ("none", "eagle3"):  # the random EAGLE-3 draft (60-token vocabulary) never hits
        assert engine.stats.tau > 1.0


@pytest.mark.slow
@pytest.mark.parametrize("kind", DRAFTS)
def test_chunked_prefill_is_exact_and_leaves_the_draft_as_a_whole_prefill(tiny, kind):
    """With prefill_chunk 5 (and 1), prompts of up to 40 tokens are prefilled over several steps while the other
    requests keep running rounds (in which a prefilling row runs as a dummy): every request's tokens are its own
    single-request AD output, and it accepts round by round exactly as with its prompt prefilled whole, so the
    draft's state after a chunked prefill is the whole prefill's. No step prefills more than the chunk."""
    prompts = _prompts(10)
    jobs = [(2 * i, p, RequestParams(max_tokens=6 + 3 * i)) for i, p in enumerate(prompts)]
    whole = _run(Engine(tiny, _draft(kind, tiny), k=3, max_running=3, max_len=96), jobs)
    for chunk in (5, 1):
        engine = Engine(tiny, _draft(kind, tiny), k=3, max_running=3, max_len=96, prefill_chunk=chunk)
        per_step, overlapped = [], []
        start, cont, step = engine.runner.prefill_start, engine.runner.prefill_continue, engine.step

        def counted_start(pieces):
            per_step[-1] += sum(n for _, _, n in pieces)
            return start(pieces)

        def counted_continue(reqs, s0, n):
            per_step[-1] += n
            return cont(reqs, s0, n)

        def counted_step():
            per_step.append(0)
            rounds = engine.stats.rounds
            out = step()
            overlapped.append(engine.stats.rounds > rounds and any(r is not None and r.prefilling
                                                                   for r in engine.slots))
            return out

        engine.runner.prefill_start, engine.runner.prefill_continue, engine.step = counted_start, counted_continue, counted_step
        res = _run(engine, jobs)
        for j, (_, p, params) in enumerate(jobs):
            assert res[j]["tokens"] == generate(tiny, [p], params.max_tokens).tokens[0], (kind, chunk, j)
            assert res[j]["accepted"] == whole[j]["accepted"], (kind, chunk, j)
        assert max(per_step) == chunk and sum(per_step) == sum(len(p) - 1 for p in prompts)
        assert sum(overlapped) >= 5  # rounds ran while a prompt was still being prefilled
    with pytest.raises(ConfigError, match="prefill_chunk"):
        Engine(tiny, _draft(kind, tiny), k=3, max_running=3, max_len=96, prefill_chunk=0)


@pytest.mark.parametrize("kind", DRAFTS)
def test_prefilled_rows_join_a_running_batch_as_requests_would(tiny, kind):
    """Engine.add_prefilled (spire tau and bench: several drafts from one prefill): two rows prefilled outside the
    engine join slots 1 and 3 of a batch whose other requests are mid-stream (slot 1 left by a finished request);
    every request's tokens are its own single-request AD output, and the prefilled rows accept round by round
    exactly as when the same prompts join through add_request at that step (so the slots' KV and the draft's state
    are a normal join's)."""
    from spire.engine.prefill import prefill

    prompts = _prompts(10)
    early = [(prompts[4], 20), (prompts[1], 3), (prompts[7], 25)]  # slots 0, 1, 2; the second ends first
    late = [prompts[2], prompts[9]]

    def run(prefilled: bool) -> dict:
        engine = Engine(tiny, _draft(kind, tiny), k=3, max_running=4, max_len=96)
        ids = {engine.add_request(p, RequestParams(max_tokens=n)): j for j, (p, n) in enumerate(early)}
        res = {j: {"tokens": [], "accepted": []} for j in range(5)}

        def collect(outs):
            for o in outs:
                r = res[ids[o.request_id]]
                r["tokens"] += o.new_tokens
                if o.accepted is not None:
                    r["accepted"].append(o.accepted)

        for _ in range(4):  # 3 tokens take at most 3 rounds, 20 at least 5
            collect(engine.step())
        assert [r is not None for r in engine.slots] == [True, False, True, False]
        params = [RequestParams(max_tokens=12), RequestParams(max_tokens=9)]
        if prefilled:
            hidden = engine.draft.hidden_layers if engine.draft is not None else ()
            state = prefill(tiny, late, 96, hidden)
            for j, rid in zip((3, 4), engine.add_prefilled(state, params)):
                ids[rid] = j
            assert [r.slot for r in engine.slots if r is not None] == [0, 1, 2, 3]
        else:
            for j, p, rp in zip((3, 4), late, params):
                ids[engine.add_request(p, rp)] = j
        while engine.has_work():
            collect(engine.step())
        return res

    got, ref = run(True), run(False)
    rows, budgets = [p for p, _ in early] + late, [20, 3, 25, 12, 9]
    for j in range(5):
        assert got[j]["tokens"] == generate(tiny, [rows[j]], budgets[j]).tokens[0], (kind, j)
        assert got[j]["accepted"] == ref[j]["accepted"], (kind, j)


def test_add_prefilled_refuses_what_does_not_fit(tiny):
    from spire.engine.prefill import prefill

    engine = Engine(tiny, None, k=3, max_running=2, max_len=40)
    state = prefill(tiny, _prompts(10)[1:3], 40)
    with pytest.raises(ConfigError, match="2 prefilled rows"):
        engine.add_prefilled(state, [RequestParams(max_tokens=4)])
    engine.add_request([1, 2, 3], RequestParams(max_tokens=4))
    engine.step()
    with pytest.raises(ConfigError, match="2 rows, 1 free slots"):
        engine.add_prefilled(state, [RequestParams(max_tokens=4)] * 2)
    with pytest.raises(ConfigError, match="exceeds the context"):
        engine.add_prefilled(prefill(tiny, [_prompts(10)[4]], 40), [RequestParams(max_tokens=4)])
    other = make_tiny(seed=1, n_kv_heads=1)
    with pytest.raises(ConfigError, match=r"dtype\) \(4, 1, 12, 'float32'\), this engine's target \(4, 2, 12, "):
        engine.add_prefilled(prefill(other, [[1, 2, 3]], 40), [RequestParams(max_tokens=4)])
    spire = Engine(tiny, _draft("spire", tiny), k=3, max_running=2, max_len=40)
    with pytest.raises(ConfigError, match="the spire draft reads"):
        spire.add_prefilled(prefill(tiny, [[1, 2, 3]], 40), [RequestParams(max_tokens=4)])


@pytest.mark.parametrize("kind", DRAFTS)
def test_reused_slot_sees_nothing_of_the_previous_request(tiny, kind):
    """Request B in the slot request A just left accepts exactly as B alone in a fresh engine, round by round
    (its KV, draft state and n-gram context are its own; CASES.md 16)."""
    a = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]  # a context whose n-grams would match B's
    b = [7, 8, 9, 1, 2]
    reused = Engine(tiny, _draft(kind, tiny), k=3, max_running=1, max_len=64)
    both = _run(reused, [(0, a, RequestParams(max_tokens=30)), (0, b, RequestParams(max_tokens=20))])
    fresh = _run(Engine(tiny, _draft(kind, tiny), k=3, max_running=1, max_len=64),
                 [(0, b, RequestParams(max_tokens=20))])
    assert both[1]["tokens"] == fresh[0]["tokens"] == generate(tiny, [b], 20).tokens[0]
    assert both[1]["accepted"] == fresh[0]["accepted"]


def test_ngram_restart_clears_the_row(tiny):
    d = _draft("ngram", tiny)
    engine = Engine(tiny, d, k=3, max_running=2, max_len=64)
    _run(engine, [(0, list(range(1, 30)), RequestParams(max_tokens=8))])
    d.restart_rows(torch.tensor([0]))
    assert bool((d.buf[0] == -1).all()) and int(d.src[0]) == -1


def test_abort_frees_the_slot_at_the_next_step(tiny):
    engine = Engine(tiny, _draft("magicdec", tiny), k=3, max_running=1, max_len=96)
    first = engine.add_request([1, 2, 3], RequestParams(max_tokens=50))
    second = engine.add_request([4, 5], RequestParams(max_tokens=5))
    third = engine.add_request([6], RequestParams(max_tokens=5))
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 2
    engine.abort(first)
    engine.abort(third)  # still waiting
    out = engine.step()
    reasons = {o.request_id: o.finish_reason for o in out if o.finished}
    assert reasons == {first: "abort", third: "abort"}
    assert engine.slots[0] is not None and engine.slots[0].id == second  # joined in the same step
    while engine.has_work():
        engine.step()
    assert engine.num_running == 0
    assert engine.stats.finished == {"abort": 2, "length": 1}
    engine.abort(12345)  # unknown: ignored
    assert engine.step() == []


def test_per_request_sampling_settings_and_seeds(tiny):
    """A seeded request gives the same tokens whatever runs beside it and whenever it joins; greedy requests in
    the same batch as sampled ones still equal AD; another seed gives other tokens."""
    prompts = _prompts(6, seed=1)
    hot = RequestParams(max_tokens=20, temperature=1.0, seed=7)
    solo = _run(Engine(tiny, _draft("magicdec", tiny), k=3, max_running=4, max_len=96), [(0, prompts[0], hot)])
    jobs = [(0, prompts[1], RequestParams(max_tokens=12)),
            (1, prompts[2], RequestParams(max_tokens=15, temperature=0.7, top_k=10, seed=1)),
            (3, prompts[0], hot),
            (3, prompts[4], RequestParams(max_tokens=9, temperature=1.3, top_p=0.8, seed=2)),
            (4, prompts[0], RequestParams(max_tokens=20, temperature=1.0, seed=8)),
            (5, prompts[5], RequestParams(max_tokens=14))]
    mixed = _run(Engine(tiny, _draft("magicdec", tiny), k=3, max_running=4, max_len=96), jobs)
    assert mixed[2]["tokens"] == solo[0]["tokens"]
    assert mixed[4]["tokens"] != solo[0]["tokens"]
    for j in (0, 5):
        assert mixed[j]["tokens"] == generate(tiny, [jobs[j][1]], jobs[j][2].max_tokens).tokens[0]


def test_eos_and_stop_inside_an_accepted_block_end_the_request_there(tiny):
    """An EOS (or a stop string's last token) inside an accepted block, in a block that also crosses max_tokens,
    ends the request with finish "stop" and nothing past it (CASES.md 15)."""
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    ref = generate(tiny, [prompt], 12).tokens[0]
    eos = ref[5]
    first = ref.index(eos)
    engine = Engine(tiny, _draft("ngram", tiny), k=4, max_running=2, max_len=64, eos_ids=[eos],
                    decode=lambda ids: " ".join(f"t{i}" for i in ids))
    res = _run(engine, [(0, prompt, RequestParams(max_tokens=first + 2)),
                        (0, prompt, RequestParams(max_tokens=12, ignore_eos=True, stop=(f"t{ref[3]} t{ref[4]}",))),
                        (0, prompt, RequestParams(max_tokens=first + 1))])
    assert res[0] == {**res[0], "tokens": ref[: first + 1], "reason": "stop"}
    assert res[1]["tokens"] == ref[: ref.index(ref[4], 4) + 1] and res[1]["reason"] == "stop"
    assert res[2]["tokens"] == ref[: first + 1] and res[2]["reason"] == "stop"


def test_a_stop_string_is_checked_on_the_text_in_the_prompt_s_context_as_the_client_sees_it(tiny):
    """The engine checks stop strings on the request's output processor's text, decoded after the prompt's last
    tokens, as ``spire serve`` answers it: with a tokenizer whose pieces take a leading space in context (here a
    space-joined decode), a stop string " tN" of the first generated token N ends the request at that token
    (decoded alone, "tN" has no space: the check would miss it and run to max_tokens while the client's text is
    cut). A caller's own TextStream is the one checked, and its pushed text reuses what the check decoded."""
    from spire.engine.output import TextStream

    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    ref = generate(tiny, [prompt], 8).tokens[0]
    calls = []

    def decode(ids):
        calls.append(tuple(ids))
        return " ".join(f"t{i}" for i in ids)

    stop = (f" t{ref[0]}",)
    engine = Engine(tiny, _draft("ngram", tiny), k=4, max_running=1, max_len=64, decode=decode)
    res = _run(engine, [(0, prompt, RequestParams(max_tokens=8, stop=stop))])
    assert res[0]["tokens"] == ref[:1] and res[0]["reason"] == "stop"
    text = TextStream(decode, stop, prompt=prompt[-8:])
    engine = Engine(tiny, None, max_running=1, max_len=64)  # no decode of its own: the stream's is used
    rid = engine.add_requests(prompt, [RequestParams(max_tokens=8, stop=stop)], [text])[0]
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert [t for o in outs for t in o.new_tokens] == ref[:1] and outs[-1].finish_reason == "stop"
    calls.clear()
    assert text.push(outs[-1].new_tokens, True) == ""  # the text before the stop string: nothing
    assert calls == []  # the engine's check decoded it already


def test_bad_requests_and_drafts_are_refused(tiny):
    engine = Engine(tiny, None, max_running=1, max_len=32)
    for prompt, params, field in [([], RequestParams(), "prompt"), ([97], RequestParams(), "prompt"),
                                  ([1] * 21, RequestParams(max_tokens=12), "prompt"),
                                  ([1], RequestParams(stop=("x",)), "stop")]:
        with pytest.raises(ConfigError, match=field):
            engine.add_request(prompt, params)
    for bad in [dict(max_tokens=0), dict(max_tokens="many"), dict(temperature=float("nan")), dict(top_p=0.0),
                dict(temperature=-1.0)]:
        with pytest.raises(ConfigError):
            RequestParams(**bad)

    class Static(Draft):
        name = "static-only"

        def start(self, *a):
            pass

        def step(self, tokens, pos, span=None):
            raise AssertionError

    with pytest.raises(ConfigError, match="static-only"):
        Engine(tiny, Static(), max_running=2, max_len=32)


def _exact_marginals(target, prompt, params, depth: int) -> list[np.ndarray]:
    """The target's exact marginal distributions of generated tokens 1..depth (depth <= 3, tiny vocabulary)."""
    V = target.cfg.vocab_size
    ctx, weight, out = torch.tensor([prompt]), torch.ones(1), []
    for _ in range(depth):
        p = probs_from_logits(target(ctx, torch.arange(ctx.shape[1])[None].expand_as(ctx)).logits[:, -1], params)
        out.append((weight[:, None] * p).sum(0).double().numpy())
        weight = (weight[:, None] * p).reshape(-1)  # (R·V,) joint probability of each extended context
        ctx = torch.cat([ctx.repeat_interleave(V, 0), torch.arange(V).repeat(ctx.shape[0])[:, None]], 1)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["magicdec", "ngram", "spire", "vanilla", "eagle3-full-vocab"])
def test_sampling_is_lossless_with_rows_joining_mid_stream(kind):
    """T = 1, k = 2: tokens 1, 2 and 3 (3 is the bonus token when both drafts are accepted) of 1200 requests of one
    prompt, 4 joining per step beside greedy fillers of other lengths, follow the target's exact marginals."""
    target = make_tiny(seed=11)
    with torch.no_grad():  # soften the tiny model so that many tokens have mass
        target.lm_head.weight.mul_(0.35)
    prompt = [5, 17, 42, 8, 60, 5, 17, 42]
    params = RequestParams(max_tokens=3, temperature=1.0)
    with torch.no_grad():
        exact = _exact_marginals(target, prompt, params.sampling(), 3)
    N = 1200
    jobs = [(i // 4, prompt, RequestParams(max_tokens=3, temperature=1.0, seed=1000 + i)) for i in range(N)]
    jobs += [(3 * i, p, RequestParams(max_tokens=7)) for i, p in enumerate(_prompts(10, seed=5) * 8)]
    engine = Engine(target, _draft(kind, target), k=2, max_running=24, max_len=64)
    res = _run(engine, jobs)
    toks = np.array([res[j]["tokens"] for j in range(N)])
    for i in range(3):
        assert _chi2(toks[:, i], exact[i]) > 1e-3, (kind, i)
    assert engine.stats.accepted[2] > 50  # the bonus position was reached often


class RandomK:
    """A k policy that drafts a seeded random k in 0..k_max per round (0: an AD round), and records what it saw."""

    def __init__(self, k_max: int, seed: int = 0) -> None:
        self.k_max, self.rng, self.chosen, self.observed = k_max, np.random.default_rng(seed), [], []

    def k_for(self, batch: int, context: float) -> int:
        k = int(self.rng.integers(0, self.k_max + 1))
        self.chosen.append(k)
        return k

    def observe(self, accepted, k: int) -> None:
        self.observed.append((list(accepted), k))


@pytest.mark.parametrize("kind", DRAFTS)
def test_greedy_equals_ad_with_k_chosen_per_round(tiny, kind):
    """Each round drafts a random k in 0..3 (0: AD, the draft only observes): every request still gets its own AD
    output, the policy is told each SD round's acceptances, and the stats count rounds by k."""
    prompts = _prompts(10)
    jobs = [(2 * i, p, RequestParams(max_tokens=6 + 3 * i)) for i, p in enumerate(prompts)]
    policy = RandomK(3, seed=1)
    engine = Engine(tiny, _draft(kind, tiny), k=3, max_running=3, max_len=96, k_policy=policy)
    res = _run(engine, jobs)
    for j, (_, p, params) in enumerate(jobs):
        assert res[j]["tokens"] == generate(tiny, [p], params.max_tokens).tokens[0], (kind, j)
    if kind == "none":
        assert engine.stats.rounds_by_k[0] == engine.stats.rounds and not policy.chosen  # no draft: no policy
        return
    assert engine.stats.rounds_by_k == [policy.chosen.count(k) for k in range(4)]
    assert all(c > 0 for c in engine.stats.rounds_by_k)
    assert [k for _, k in policy.observed] == [k for k in policy.chosen if k]
    assert all(0 <= a <= k for acc, k in policy.observed for a in acc)


@pytest.mark.parametrize("kind", ["magicdec-full", "vanilla-clone"])
def test_a_draft_equal_to_the_target_accepts_everything_after_ad_rounds(tiny, kind):
    """A draft that computes the target's own distribution (MagicDec with a window past the context; a vanilla
    draft that is a copy of the target) accepts every drafted token in every SD round, also right after AD rounds:
    the AD rounds showed it every committed token."""
    draft = (make_draft("magicdec", tiny, window=200) if kind == "magicdec-full"
             else VanillaDraft(make_tiny()))
    policy = RandomK(3, seed=2)
    engine = Engine(tiny, draft, k=3, max_running=3, max_len=96, k_policy=policy)
    jobs = [(i, p, RequestParams(max_tokens=20)) for i, p in enumerate(_prompts(6))]
    res = _run(engine, jobs)
    for j, (_, p, params) in enumerate(jobs):
        assert res[j]["tokens"] == generate(tiny, [p], 20).tokens[0]
    assert engine.stats.rounds_by_k[0] > 3
    assert all(a == k for acc, k in policy.observed for a in acc), policy.observed
    assert engine.stats.acceptance() == [1.0, 1.0, 1.0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["magicdec", "spire"])
def test_sampling_is_lossless_with_k_chosen_per_round(kind):
    """T = 1 with a random k in 0..2 per round and rows joining mid-stream, their prompts prefilled in chunks of at
    most 40 tokens a step (so some are split across steps): tokens 1-3 follow the target's exact marginals (the
    bonus position reached too)."""
    target = make_tiny(seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.35)
    prompt = [5, 17, 42, 8, 60, 5, 17, 42]
    exact = _exact_marginals(target, prompt, RequestParams(temperature=1.0).sampling(), 3)
    N = 1200
    jobs = [(i // 4, prompt, RequestParams(max_tokens=3, temperature=1.0, seed=2000 + i)) for i in range(N)]
    jobs += [(3 * i, p, RequestParams(max_tokens=7)) for i, p in enumerate(_prompts(10, seed=5) * 8)]
    engine = Engine(target, _draft(kind, target), k=2, max_running=24, max_len=64, k_policy=RandomK(2, seed=3),
                    prefill_chunk=40)
    res = _run(engine, jobs)
    toks = np.array([res[j]["tokens"] for j in range(N)])
    for i in range(3):
        assert _chi2(toks[:, i], exact[i]) > 1e-3, (kind, i)
    assert engine.stats.accepted[2] > 50 and engine.stats.rounds_by_k[0] > 50


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["none", "magicdec", "ngram", "spire"])
def test_generate_batch_is_the_static_loop_on_the_engine(tiny, kind):
    """spire generate's decode path: greedy output, finish reasons and EOS cuts equal the static loop's
    (spire.speculative.generate) for mixed prompt lengths, with the static loop's context limit
    (prompt + new + k = the target's positions decodes); a sampled prompt's output is its own (seed + i), whatever
    else is in the batch."""
    from spire.engine.engine import generate_batch

    prompts = _prompts(6)
    ref = generate(tiny, prompts, 14, draft=_draft(kind, tiny), k=3, eos_ids=[5])
    got = generate_batch(tiny, prompts, 14, draft=_draft(kind, tiny), k=3, eos_ids=[5])
    assert got.tokens == ref.tokens and got.finish_reasons == ref.finish_reasons
    assert got.tokens == generate(tiny, prompts, 14, eos_ids=[5]).tokens
    if kind != "none":
        assert got.tau > 1.0 and all(r >= 1 for r in got.rounds)
    edge = [list(range(1, 97)) * 10 + [3] * 14]  # 974 tokens + n new + k (0 for AD) = 1024 positions
    n = 1024 - 974 - (3 if kind != "none" else 0)
    assert generate_batch(tiny, edge, n, draft=_draft(kind, tiny), k=3).tokens == generate(tiny, edge, n).tokens
    with pytest.raises(ConfigError):
        generate_batch(tiny, edge, n + 1, draft=_draft(kind, tiny), k=3)
    params = SamplingParams(temperature=1.0)
    both = generate_batch(tiny, prompts[:2], 10, draft=_draft(kind, tiny), k=3, params=params, seed=5)
    alone = generate_batch(tiny, prompts[1:2], 10, draft=_draft(kind, tiny), k=3, params=params, seed=6)
    assert both.tokens[1] == alone.tokens[0]


@pytest.fixture(scope="module")
def sixty_four(tiny):
    """64 requests of mixed lengths (1-60 tokens, budgets 4-24) arriving at random steps, with their own AD."""
    g = np.random.default_rng(64)
    jobs = []
    for i in range(64):
        prompt = g.integers(0, 97, int(g.integers(1, 61))).tolist()
        jobs.append((int(g.integers(0, 120)), prompt, RequestParams(max_tokens=int(g.integers(4, 25)))))
    ad = [generate(tiny, [p], params.max_tokens).tokens[0] for _, p, params in jobs]
    return jobs, ad


@pytest.mark.slow
@pytest.mark.parametrize("kind", DRAFTS)
def test_sixty_four_requests_at_random_times_at_concurrency_16(tiny, kind, sixty_four):
    """Issue 31's goal 1 at the engine: 64 requests of mixed lengths arrive at random steps into 16 slots; each
    greedy output is its own single-request AD output, with every draft."""
    jobs, ad = sixty_four
    engine = Engine(tiny, _draft(kind, tiny), k=3, max_running=16, max_len=96)
    res = _run(engine, jobs)
    assert [res[j]["tokens"] for j in range(64)] == ad
    assert engine.stats.finished == {"length": 64} and engine.num_running == 0


def test_prefill_groups_bound_the_padding():
    from spire.engine.scheduler import prefill_groups

    assert prefill_groups([2000, 130, 140, 1900, 150]) == [[0, 3], [4, 2, 1]]
    assert prefill_groups([5, 5, 5]) == [[0, 1, 2]]
    assert prefill_groups([0, 0, 7]) == [[2], [0, 1]]
    for spans in ([2000, 130, 140, 1900, 150], [1, 2, 3, 4, 5, 6, 7, 8], [1000, 10]):
        groups = prefill_groups(spans)
        assert sorted(i for g in groups for i in g) == list(range(len(spans)))
        for g in groups:
            assert len(g) * max(spans[i] for i in g) <= 1.25 * sum(spans[i] for i in g) + 1


def test_rounds_run_at_the_given_widths_only_and_the_output_stays_ad_s(tiny):
    """With widths (the GPU's CUDA-graph sizes) a round over 3 occupied slots runs 4 rows, one over 5 runs 8, the
    extra rows as free slots; every request's greedy output equals AD's. capture_widths is vLLM's set below
    max_running; bad widths are refused."""
    from spire.engine.engine import capture_widths

    assert capture_widths(1) == [1] and capture_widths(8) == [1, 2, 4, 8] and capture_widths(20) == [1, 2, 4, 8, 16, 20]
    prompts = [[5 + i, 6, 7, 5, 6, 7 + i] for i in range(5)]
    ref = generate(tiny, prompts, 10).tokens
    engine = Engine(tiny, _draft("magicdec", tiny), k=3, max_running=8, max_len=64, widths=capture_widths(8))
    seen = []
    step = engine.runner.run_round

    def run_round(running, choice):
        seen.append((len(running), engine.runner.width))
        return step(running, choice)

    engine.runner.run_round = run_round
    for n in (3, 5):
        res = _run(engine, [(0, p, RequestParams(max_tokens=10)) for p in prompts[:n]])
        assert [res[j]["tokens"] for j in range(n)] == ref[:n]
    assert (3, 4) in seen and (5, 8) in seen and all(w in (1, 2, 4, 8) for _, w in seen)
    for bad in ([0, 8], [1, 4], [1, 4, 2, 8], [1, 1, 8]):
        with pytest.raises(ConfigError, match="widths"):
            Engine(tiny, None, max_running=8, max_len=64, widths=bad)
