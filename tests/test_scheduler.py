"""The engine's scheduler alone (spire.engine.scheduler), without torch: it imports none, and its plans (aborts,
lowest free slots, the prefill budget, shared pieces of one prompt, the round's k near the end of a slot and under a
k policy) are what the engine runs. The engine's exactness against the oracle is tests/test_engine.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spire.engine.scheduler import Scheduler
from spire.errors import ConfigError
from spire.params import RequestParams

ROOT = Path(__file__).resolve().parents[1]


def test_the_scheduler_and_the_http_protocol_import_no_torch():
    code = ("import sys; import spire.engine.scheduler, spire.params, spire.engine.output, spire.serving.protocol; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def _sched(max_running=3, max_len=64, k=4, **kw) -> Scheduler:
    return Scheduler(max_running, max_len, k, **kw)


def _add(s: Scheduler, prompt, **params):
    req = s.new_request(prompt, RequestParams(**{"max_tokens": 8, **params}), vocab=100)
    s.add([req])
    return req


def _commit(s: Scheduler, req, n: int, finished: str | None = None) -> None:
    """What the engine does after a round: the request emitted n tokens; finished ones release their slot."""
    req.emitted.extend([1] * n)
    if finished:
        s.release(req, finished)


def test_requests_take_the_lowest_free_slots_and_the_width_follows_the_highest():
    s = _sched(max_running=3)
    a, b, c, d = (_add(s, [1, 2, 3]) for _ in range(4))
    plan = s.schedule()
    assert [r.slot for r in plan.joiners] == [0, 1, 2] and list(s.waiting) == [d] and plan.width == 3
    assert plan.running == [a, b, c] and plan.starts and not plan.continues  # prompts prefilled whole this step
    _commit(s, b, 1, "stop")
    plan = s.schedule()
    assert plan.joiners == [d] and d.slot == 1 and plan.width == 3
    _commit(s, c, 1, "length")
    _commit(s, d, 1, "length")
    assert s.schedule().width == 1  # rows past the highest occupied slot are not computed
    assert s.stats.finished == {"stop": 1, "length": 2} and s.stats.prompt_tokens == 12


def test_aborts_free_waiting_and_running_requests():
    s = _sched(max_running=1)
    run, wait = _add(s, [1, 2]), _add(s, [3, 4])
    s.schedule()
    s.abort(run.id)
    s.abort(wait.id)
    s.abort(12345)  # unknown: ignored
    plan = s.schedule()
    assert plan.aborted == [wait, run] and plan.freed == [0] and run.slot is None and not s.has_work()
    assert s.stats.finished == {"abort": 2}


def test_the_prefill_budget_splits_prompts_oldest_first_and_shares_one_prompts_pieces():
    s = _sched(max_running=4, max_len=128, prefill_chunk=10)
    long_ = _add(s, list(range(1, 26)))  # 24 tokens to prefill (all but the last)
    twins = [_add(s, [7] * 9) for _ in range(2)]  # one prompt, two choices: one piece of 8 tokens, charged once
    plan = s.schedule()
    assert [[(r.id, s0, n) for r, s0, n in g] for g in plan.starts] == [[(long_.id, 0, 10)]]
    assert plan.running == [] and long_.prefilled == 10 and all(t.prefilled == 0 for t in twins)
    plan = s.schedule()
    assert [([r.id for r in reqs], s0, n) for reqs, s0, n in plan.continues] == [([long_.id], 10, 10)]
    assert plan.starts == []  # the budget is spent on the oldest request
    plan = s.schedule()
    assert [(s0, n) for _, s0, n in plan.continues] == [(20, 4)]
    assert [[(r.id, n) for r, _, n in g] for g in plan.starts] == [[(twins[0].id, 6), (twins[1].id, 6)]]
    plan = s.schedule()
    assert [(len(reqs), s0, n) for reqs, s0, n in plan.continues] == [(2, 6, 2)]  # shared, charged once
    assert set(plan.running) == {long_, *twins}


def test_k_is_cut_near_the_end_of_a_slot_and_follows_the_policy():
    s = _sched(max_running=2, max_len=20, k=4)
    a = _add(s, [1] * 10, max_tokens=10)
    assert s.schedule().k == 4  # committed 10: positions up to 13 < 20
    _commit(s, a, 7)  # committed 17: a round may write positions 16..16 + k, so k <= 3
    assert s.schedule().k == 3
    _commit(s, a, 2)
    assert s.schedule().k == 1

    class Policy:
        def __init__(self):
            self.seen = []

        def k_for(self, batch, context):
            self.seen.append((batch, context))
            return 2

    p = Policy()
    s = _sched(max_running=2, max_len=64, k=4, k_policy=p)
    _add(s, [1] * 10)
    _add(s, [1] * 20)
    plan = s.schedule()
    assert plan.k == 4 and s.choose_round(plan).k == 2 and p.seen == [(2, 15.0)]  # their mean committed length
    assert plan.choice.ks == [2, 2] and plan.choice.drafts == [0, 0]


def test_requests_are_validated_by_field():
    s = _sched(max_len=16)
    for prompt, params, msg in (([], {}, "prompt: empty"), ([100], {}, r"prompt: token ids must be in \[0, 100\)"),
                                ([1] * 10, {"max_tokens": 7}, "exceeds the context of 16"),
                                ([1], {"stop_token_ids": (100,)}, "stop_token_ids"),
                                ([1], {"logit_bias": ((-1, 1.0),)}, "logit_bias"),
                                ([1], {"stop": ("x",)}, "stop strings need")):
        with pytest.raises(ConfigError, match=msg):
            s.new_request(prompt, RequestParams(**{"max_tokens": 4, **params}), vocab=100)
    with pytest.raises(ConfigError, match="2 rows, 1 free slots"):
        Scheduler(1, 16, 4).admit([s.new_request([1], RequestParams(max_tokens=4), 100) for _ in range(2)])


def test_update_from_output_is_the_one_commit_of_a_round():
    """Scheduler.update_from_output(plan, RoundOutput): each running request's tokens cut at its budget and
    emitted, the round counted (by depth, by draft, by accepted count and drafted position), the round policy fed
    once (the accepted counts and the wall time), a finished request's slot released, its prompt logprobs passed
    on, its logprobs cut with its tokens."""
    from spire.engine.scheduler import RoundChoice, RoundOutput

    class Policy:
        def __init__(self):
            self.seen = []

        def choose(self, plan, width, proposes):
            return RoundChoice(3, [0, 0], [3, 1])

        def update(self, plan, accepted, seconds):
            self.seen.append((list(accepted), seconds))

    policy = Policy()
    s = Scheduler(2, 64, 4, k_policy=policy, draft_names=["ngram"])
    a, b = _add(s, [1, 2, 3], max_tokens=8), _add(s, [4, 5], max_tokens=2)
    plan = s.schedule()
    s.choose_round(plan)
    lps = [(-0.5, []), (-1.5, [])]
    outs = s.update_from_output(plan, RoundOutput([2, 1], [[7, 8, 9], [6, 5, 4]], [None, lps + [(-2.0, [])]],
                                                  [[], None], 0.25))
    assert [(o.new_tokens, o.finished, o.finish_reason, o.accepted) for o in outs] == [
        ([7, 8, 9], False, None, 2), ([6, 5], True, "length", 1)]
    assert outs[0].prompt_logprobs == [] and outs[1].logprobs == lps and outs[0].logprobs is None
    assert a.emitted == [7, 8, 9] and b.emitted == [6, 5] and b.slot is None and s.slots == [a, None]
    st = s.stats
    assert (st.rounds, st.rounds_by_k, st.row_rounds, st.generated_tokens) == (1, [0, 0, 0, 1, 0], 2, 5)
    assert st.accepted == [0, 1, 1, 0, 0] and st.drafted == [2, 1, 1, 0]
    assert st.row_rounds_by_draft == {"ngram": [0, 1, 0, 1, 0]} and st.accepted_by_draft == {"ngram": [0, 1, 1, 0, 0]}
    assert st.finished == {"length": 1} and st.prompt_tokens == 5 and policy.seen == [([2, 1], 0.25)]
