"""The sampling fields vLLM clients send, on the engine (issue 42): logit_bias, min_tokens, stop_token_ids,
repetition / presence / frequency penalties and min_p act per emitted token on the target's and the draft's
distribution alike, so speculative sampling stays lossless with respect to the transformed target (chi-square up to
the bonus position, MagicDec and SPIRe); greedy output with the transforms equals a plain reference loop; logprobs
and prompt logprobs equal a full forward's; near the end of a slot the engine drafts fewer tokens, so
prompt + max_tokens = max_len is served with any draft.

The references here are written out independently of :mod:`spire.sampling` (a plain loop over the rules)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spire.engine.engine import Engine
from spire.params import RequestParams
from tests.oracle import generate
from tests.conftest import make_tiny
from tests.test_engine import _draft, _prompts, _run
from tests.test_lossless import _chi2

PROMPT = [5, 17, 42, 8, 60, 5, 17, 42]


def _ref_process(logits: torch.Tensor, prompt: list[int], gen: list[int], p: RequestParams, eos: set[int]
                 ) -> torch.Tensor:
    """The transforms of one position written out (float64): logit_bias, min_tokens, repetition, frequency and
    presence penalties."""
    lg = logits.double().clone()
    for t, b in p.logit_bias:
        lg[t] += b
    if len(gen) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            lg[t] = -float("inf")
    r = p.repetition_penalty
    for t in set(prompt) | set(gen):
        lg[t] = lg[t] / r if lg[t] > 0 else lg[t] * r
    for t in set(gen):
        lg[t] -= p.frequency_penalty * gen.count(t) + p.presence_penalty
    return lg


def _ref_probs(lg: torch.Tensor, p: RequestParams) -> torch.Tensor:
    """Temperature then min_p (no top-k / top-p in these cases), float64."""
    if p.temperature == 0:
        return torch.nn.functional.one_hot(lg.argmax(), lg.shape[0]).double()
    q = torch.softmax(lg / p.temperature, -1)
    q = torch.where(q < p.min_p * q.max(), torch.zeros_like(q), q)
    return q / q.sum()


def _exact_marginals(target, prompt, p: RequestParams, eos: set[int], depth: int = 3) -> list[np.ndarray]:
    """The transformed target's exact distributions, by enumerating every context: the marginals of generated
    tokens 1..depth, then of the repeat statistics [t2 == t1, t2 != t1] and [t3 == t2, t3 == t1 != t2, other]
    (penalties act on exactly these: marginals alone barely move when the tokens' distributions are alike)."""
    V = target.cfg.vocab_size
    ctxs, weights, out, reps = [[]], [1.0], [], []
    for d in range(depth):
        batch = torch.tensor([prompt + g for g in ctxs])
        with torch.no_grad():
            logits = target(batch, torch.arange(batch.shape[1])[None].expand_as(batch)).logits[:, -1]
        probs = torch.stack([_ref_probs(_ref_process(logits[i], prompt, g, p, eos), p) for i, g in enumerate(ctxs)])
        w = torch.tensor(weights, dtype=torch.float64)[:, None] * probs  # (R, V) joint of context and next token
        out.append(w.sum(0).numpy())
        rows = torch.arange(len(ctxs))
        if d == 1:
            same = float(w[rows, torch.tensor([g[0] for g in ctxs])].sum())
            reps.append(np.array([same, float(w.sum()) - same]))
        if d == 2:
            last, first = torch.tensor([g[1] for g in ctxs]), torch.tensor([g[0] for g in ctxs])
            r2 = float(w[rows, last].sum())
            r1 = float((w[rows, first] * (first != last)).sum())
            reps.append(np.array([r2, r1, float(w.sum()) - r1 - r2]))
        keep = (w > 1e-7).nonzero().tolist()  # contexts of negligible mass are dropped (< 1e-7 each)
        ctxs = [ctxs[i] + [t] for i, t in keep]
        weights = [float(w[i, t]) for i, t in keep]
    return out + reps


def _repeats(toks: np.ndarray) -> list[np.ndarray]:
    """The samples' repeat categories (as in :func:`_exact_marginals`)."""
    t1, t2, t3 = toks[:, 0], toks[:, 1], toks[:, 2]
    return [np.where(t2 == t1, 0, 1), np.where(t3 == t2, 0, np.where(t3 == t1, 1, 2))]


def _soft_target():
    target = make_tiny(seed=11)
    with torch.no_grad():  # soften the tiny model so that many tokens have mass
        target.lm_head.weight.mul_(0.35)
    return target


EOS = 3
CASES = {
    # negative presence / frequency penalties make repeating the tokens so far far likelier: a transform that
    # missed the drafted tokens before a position would show at positions 2 and 3
    "penalties": dict(repetition_penalty=0.7, presence_penalty=-2.0, frequency_penalty=-1.5),
    "logit_bias+min_p": dict(logit_bias=((7, 2.5), (8, 2.0), (60, -100.0)), min_p=0.2),
    "min_tokens+stop_token_ids": dict(min_tokens=2, stop_token_ids=(11, 12)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["magicdec", "spire"])
def test_each_transform_is_lossless_up_to_the_bonus_position(kind, case):
    """T = 1, k = 2, each transform: tokens 1, 2 and 3 (3 is the bonus token when both drafts are accepted) of 1200
    requests of one prompt, joining 4 per step beside greedy fillers, follow the transformed target's exact
    marginals, and so do the repeat statistics (token 2 equal to token 1, token 3 equal to token 2 or 1), where a
    penalty that missed the drafted tokens before a position would show; the transformed distributions are far from
    the untransformed ones (total variation > 0.1), so the test can fail."""
    target = _soft_target()
    extra = dict(CASES[case])
    if case.startswith("min_tokens"):  # EOS is the likeliest first token: min_tokens must hold it back
        with torch.no_grad():
            first = target(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None]).logits[0, -1]
        eos = {int(first.argmax())}
        extra["stop_token_ids"] = tuple(int(t) for t in first.topk(3).indices[1:])
    else:  # no EOS: the requests run 3 tokens
        eos = set()
    params = RequestParams(max_tokens=3, temperature=1.0, **extra)
    exact = _exact_marginals(target, PROMPT, params, eos)
    plain = _exact_marginals(target, PROMPT, RequestParams(max_tokens=3, temperature=1.0), set())
    assert max(0.5 * np.abs(a / a.sum() - b / b.sum()).sum() for a, b in zip(exact, plain)) > 0.1
    N = 1200
    jobs = [(i // 4, PROMPT, RequestParams(**{**params.__dict__, "seed": 3000 + i})) for i in range(N)]
    jobs += [(3 * i, p, RequestParams(max_tokens=7)) for i, p in enumerate(_prompts(10, seed=5) * 8)]
    engine = Engine(target, _draft(kind, target), k=2, max_running=24, max_len=64, eos_ids=sorted(eos))
    res = _run(engine, jobs)
    if case.startswith("min_tokens"):  # the request ends at an EOS / stop token from token 3 on, never before
        assert all(len(res[j]["tokens"]) == 3 or res[j]["reason"] == "stop" for j in range(N))
        assert sum(res[j]["tokens"][2] in eos | set(extra["stop_token_ids"]) for j in range(N)) > 50
    toks = np.array([res[j]["tokens"][:3] for j in range(N)])
    for i, samples in enumerate([toks[:, 0], toks[:, 1], toks[:, 2]] + _repeats(toks)):
        assert _chi2(samples, exact[i]) > 1e-3, (kind, case, i)
    assert engine.stats.accepted[2] > 50  # the bonus position was reached often


def _ref_greedy(target, prompt: list[int], p: RequestParams, eos: set[int]) -> list[int]:
    """Greedy decoding with the transforms, one full forward per token (no cache)."""
    gen: list[int] = []
    stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else eos)
    while len(gen) < p.max_tokens:
        ids = torch.tensor([prompt + gen])
        with torch.no_grad():
            lg = target(ids, torch.arange(ids.shape[1])[None]).logits[0, -1]
        t = int(_ref_process(lg, prompt, gen, p, eos).argmax())
        gen.append(t)
        if t in stop_ids:
            break
    return gen


@pytest.mark.parametrize("kind", ["none", "magicdec", "spire", "ngram"])
def test_greedy_with_transforms_equals_the_reference_loop(tiny, kind):
    """Greedy requests with penalties, logit_bias, min_tokens and stop token ids, joining mid-stream: each equals the
    reference loop's tokens (the transforms applied at each position to the tokens before it)."""
    settings = [dict(repetition_penalty=1.8), dict(presence_penalty=1.5, frequency_penalty=0.7),
                dict(logit_bias=((4, 3.0), (9, -50.0))), dict(min_tokens=6, stop_token_ids=(1, 2, 5)),
                dict(frequency_penalty=-1.2, repetition_penalty=0.8), dict()]
    prompts = _prompts(6)
    jobs = [(i, p, RequestParams(max_tokens=18, **s)) for i, (p, s) in enumerate(zip(prompts, settings))]
    engine = Engine(tiny, _draft(kind, tiny), k=3, max_running=3, max_len=80, eos_ids=[EOS])
    res = _run(engine, jobs)
    for j, (_, p, params) in enumerate(jobs):
        assert res[j]["tokens"] == _ref_greedy(tiny, p, params, {EOS}), (kind, j, settings[j])
    assert res[5]["tokens"] == generate(tiny, [prompts[5]], 18, eos_ids=[EOS]).tokens[0]


def _ref_logprobs(target, prompt: list[int], gen: list[int]) -> torch.Tensor:
    """log-softmax of the target's logits at every position of prompt + gen (one full forward)."""
    ids = torch.tensor([prompt + gen])
    with torch.no_grad():
        return torch.log_softmax(target(ids, torch.arange(ids.shape[1])[None]).logits[0].double(), -1)


@pytest.mark.parametrize("kind", ["none", "magicdec", "spire", "ngram", "vanilla", "eagle3"])
def test_logprobs_and_prompt_logprobs_equal_a_full_forward(tiny, kind):
    """Greedy and seeded T = 1 requests with logprobs (top 3) and prompt logprobs, prompts prefilled in chunks of 7
    tokens: every emitted token's logprob and the top 3 equal a full forward's over prompt + output to 1e-4 (at
    T = 1 the logprobs are the target's); the prompt's tokens 2..P likewise, given once with the first output."""
    prompts = _prompts(8)
    jobs = [(i, p, RequestParams(max_tokens=12, temperature=float(i % 2), seed=i, logprobs=3, prompt_logprobs=2))
            for i, p in enumerate(prompts)]
    engine = Engine(tiny, _draft(kind, tiny), k=3, max_running=4, max_len=80, prefill_chunk=7)
    ids, outs = {}, {j: [] for j in range(len(jobs))}
    todo = list(enumerate(jobs))
    step = 0
    while todo or engine.has_work():
        while todo and todo[0][1][0] <= step:
            j, (_, p, params) = todo.pop(0)
            ids[engine.add_request(p, params)] = j
        for o in engine.step():
            outs[ids[o.request_id]].append(o)
        step += 1
    for j, (_, p, params) in enumerate(jobs):
        gen = [t for o in outs[j] for t in o.new_tokens]
        assert len(gen) == 12
        if params.temperature == 0:
            assert gen == generate(tiny, [p], 12).tokens[0]
        ref = _ref_logprobs(tiny, p, gen)  # row i predicts token i + 1
        got = [e for o in outs[j] for e in o.logprobs]
        for i, (t, (lp, top)) in enumerate(zip(gen, got)):
            row = ref[len(p) - 1 + i]
            assert abs(lp - float(row[t])) < 1e-4, (kind, j, i)
            assert [a for a, _ in top] == row.topk(3).indices.tolist()
            assert np.allclose([b for _, b in top], row.topk(3).values.numpy(), atol=1e-4)
        firsts = [o.prompt_logprobs for o in outs[j] if o.prompt_logprobs is not None]
        assert len(firsts) == 1 and outs[j][0].prompt_logprobs is not None
        plp = firsts[0]
        assert len(plp) == len(p) - 1
        for i, (lp, top) in enumerate(plp):
            assert abs(lp - float(ref[i, p[i + 1]])) < 1e-4, (kind, j, i)
            assert [a for a, _ in top] == ref[i].topk(2).indices.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["none", "magicdec", "spire", "ngram", "vanilla", "eagle3", "magicdec-all-rows"])
def test_prompt_plus_max_tokens_up_to_max_len_with_any_draft(tiny, kind):
    """With k = 4 and max_len 48: requests with prompt + max_tokens = 48 exactly (the last rounds draft fewer
    tokens), some prefilled in chunks while others run near the end, finish with their AD output; the engine never
    writes past its slots (it would raise)."""
    prompts = _prompts(8)
    jobs = [(i, p, RequestParams(max_tokens=48 - len(p), ignore_eos=True)) for i, p in enumerate(prompts)]
    engine = Engine(tiny, _draft(kind, tiny), k=4, max_running=3, max_len=48, prefill_chunk=9)
    res = _run(engine, jobs)
    for j, (_, p, params) in enumerate(jobs):
        assert res[j]["tokens"] == generate(tiny, [p], params.max_tokens).tokens[0], (kind, j)
        assert res[j]["reason"] == "length"
    assert engine.max_prompt(1) == 47
    if kind != "none":  # rounds near the end drafted fewer than 4 tokens
        assert sum(engine.stats.rounds_by_k[:4]) > 0


@pytest.mark.slow
def test_min_tokens_holds_back_stop_strings_and_ignore_eos_keeps_going(smollm2):
    """On SmolLM2: a stop string is not checked before min_tokens tokens (the request ends at the first stop string
    completed by token min_tokens or later); ignore_eos with stop_token_ids [EOS] ends where EOS ends it."""
    model, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer with a number only."}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    eos = [tok.eos_token_id]
    engine = Engine(model, _draft("magicdec", model), k=3, max_running=2, max_len=256, eos_ids=eos, decode=tok.decode)
    free = _run(engine, [(0, ids, RequestParams(max_tokens=24))])[0]
    assert free["reason"] == "stop" and free["tokens"][-1] == eos[0] and len(free["tokens"]) < 24
    n = len(free["tokens"])
    same = _run(engine, [(0, ids, RequestParams(max_tokens=24, ignore_eos=True, stop_token_ids=tuple(eos)))])[0]
    assert same["tokens"] == free["tokens"] and same["reason"] == "stop"
    longer = _run(engine, [(0, ids, RequestParams(max_tokens=24, min_tokens=24))])[0]
    assert len(longer["tokens"]) == 24 and eos[0] not in longer["tokens"] and longer["tokens"][: n - 1] == \
        free["tokens"][: n - 1]
    text = tok.decode(longer["tokens"])
    stop = text[:3]  # a stop string that the first tokens already complete
    mid = _run(engine, [(0, ids, RequestParams(max_tokens=24, min_tokens=6))])[0]
    cut = _run(engine, [(0, ids, RequestParams(max_tokens=24, min_tokens=6, stop=(stop,)))])[0]
    assert len(cut["tokens"]) >= 6 and cut["tokens"] == mid["tokens"][: len(cut["tokens"])]
    early = _run(engine, [(0, ids, RequestParams(max_tokens=24, stop=(stop,)))])[0]
    assert len(early["tokens"]) < 6


@pytest.mark.parametrize("kind", ["none", "magicdec", "spire", "eagle3"])
def test_choices_of_one_prompt_share_its_prefill(tiny, kind, monkeypatch):
    """Four requests of one 30-token prompt joining together (an API request's n = 4) are prefilled as one row, its
    keys / values copied into the four slots, in one chunk or in chunks of 12 (the target runs 29 prefill positions
    in all, not 4 x 29): the greedy ones give the AD output, the seeded sampled ones the tokens each gives alone,
    and the prompt logprobs equal a full forward's."""
    positions = []  # B x T of every target forward over more than k + 1 = 4 positions: the prefill pieces
    real = type(tiny).forward

    def counting(self, tokens, *a, **kw):
        if tokens.shape[1] > 4:
            positions.append(tokens.shape[0] * tokens.shape[1])
        return real(self, tokens, *a, **kw)

    monkeypatch.setattr(type(tiny), "forward", counting)
    prompt = _prompts(5)[4][:30]
    for chunk in (None, 12):
        positions.clear()
        params = [RequestParams(max_tokens=10), RequestParams(max_tokens=10, prompt_logprobs=0),
                  RequestParams(max_tokens=10, temperature=1.0, seed=7),
                  RequestParams(max_tokens=10, temperature=1.0, seed=8)]
        engine = Engine(tiny, _draft(kind, tiny), k=3, max_running=4, max_len=64, prefill_chunk=chunk)
        res = _run(engine, [(0, prompt, p) for p in params])
        assert sum(positions) == 29, (kind, chunk, positions)  # the prompt but its last token, once for the four
        assert len(positions) == (1 if chunk is None else 3)
        ad = generate(tiny, [prompt], 10).tokens[0]
        assert res[0]["tokens"] == ad and res[1]["tokens"] == ad
        for j in (2, 3):
            alone = _run(Engine(tiny, _draft(kind, tiny), k=3, max_running=1, max_len=64), [(0, prompt, params[j])])
            assert res[j]["tokens"] == alone[0]["tokens"], (kind, chunk, j)
        ids = {}
        engine = Engine(tiny, _draft(kind, tiny), k=3, max_running=4, max_len=64, prefill_chunk=chunk)
        for p in params:
            ids[engine.add_request(prompt, RequestParams(**{**p.__dict__, "prompt_logprobs": 1}))] = p
        got = {}
        while engine.has_work():
            for o in engine.step():
                if o.prompt_logprobs is not None:
                    got[o.request_id] = o.prompt_logprobs
        ref = _ref_logprobs(tiny, prompt, [])
        assert len(got) == 4
        for plp in got.values():
            assert len(plp) == 29
            assert all(abs(lp - float(ref[i, prompt[i + 1]])) < 1e-4 for i, (lp, _) in enumerate(plp))


def test_min_tokens_stop_strings_count_only_past_the_first_tokens_text():
    """A stop string counts only when it ends past the text of the first min_tokens tokens, in the engine's cut and in
    the API's text alike (a fresh user's report: the text was cut at a stop string inside the min_tokens window while
    the tokens went on, so streamed and non-streamed texts differed). Character tokens: "a\\nbc\\nde", stop "\\n",
    min_tokens 3: the first "\\n" is inside the window, the second ends the request."""
    from spire.serving.api import TextStream
    from spire.engine.output import StopStrings, first_stop

    def dec(toks):
        return "".join(chr(t) for t in toks)

    toks = [ord(c) for c in "a\nbc\nde"]
    stop = StopStrings(["\n"], dec)
    assert stop.cut(toks[:3], toks[3:], checked=False) == 2  # ends with the second "\n"
    kept = toks[:5]
    streamed = TextStream(dec, ("\n",), min_tokens=3)
    pieces = [streamed.push([t], False) for t in kept[:-1]] + [streamed.push(kept[-1:], True)]  # as the engine emits
    whole = TextStream(dec, ("\n",), min_tokens=3)
    whole.tokens = list(kept)
    assert "".join(pieces) == whole.text() == "a\nbc"
    with_stop = TextStream(dec, ("\n",), include_stop=True, min_tokens=3)
    with_stop.tokens = list(kept)
    assert with_stop.text() == "a\nbc\n"
    assert first_stop("ab\ncd", ["\n"], 2) == (2, "\n") and first_stop("ab\ncd", ["\n"], 3) is None
