"""The OpenAI-compatible HTTP API of ``spire serve`` (FastAPI): the engine runs in one thread, handlers queue
requests into it and await or stream their tokens.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the target's chat template, as
``spire generate --chat``), both streamed (Server-Sent Events, ``data: {...}`` chunks then ``data: [DONE]``) or
not, with n choices, logprobs and (completions) echo; ``GET /v1/models``; ``GET /health`` (200: the model is loaded
and the engine thread alive); ``GET /metrics`` (Prometheus text); ``GET /docs`` (the request schemas). A body larger
than ``max_request_bytes`` is a 413 before it is read whole; parsing, validation, tokenizing and templating run on
two parse threads, never on the event loop. Bad requests get OpenAI's error body with a 4xx naming the field (:mod:`spire.serving.protocol`);
past ``max_waiting`` queued requests a 503 with Retry-After; with an API key, a /v1 request without
``Authorization: Bearer KEY`` a 401. A client that disconnects has its request aborted (its slot is free at the
engine's next step).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from spire.errors import ConfigError
from spire.serving import protocol
from spire.engine.engine import Engine
from spire.engine.scheduler import RequestOutput
from spire.params import RequestParams
from spire.serving.protocol import ApiError, Parsed, bad
from spire.engine.output import first_stop

log = logging.getLogger("spire.serve")

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
"""``spire serve --max-request-bytes``'s default: 4 MiB, hundreds of times a 2,048-token prompt as text or ids."""
DRAIN_LIMIT = 256 << 20
"""Bytes of a refused (too large) body read and dropped at most, so that its client gets the 413."""


def torch_thread() -> ThreadPoolExecutor:
    """The one thread that runs a server's torch work, in order: loading, calibration, then the engine loop.

    Every OS thread that runs an OpenMP parallel region gets a team of its own; with two teams (a model loaded on
    the main thread, then stepped on an engine thread) libgomp counts more threads than cores and stops spinning
    between regions, and a decode step, hundreds of short regions, pays a wake-up for each: SmolLM2 AD on 2
    cores took 27 ms a step on a second thread against 21 ms on the thread that loaded it."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="spire-engine")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim(0)``; nothing where libc is not
    glibc). Returns whether it ran. The engine loop calls it once the engine has been idle for half a second (so
    never under sustained load, where the pages would be faulted back in at once): freed prefill
    activations and oneDNN's scratch leave free holes in glibc's heap that it keeps resident (a load of 150 requests
    of 128-1,710 tokens at concurrency 16 left ~330 MB of them, which this returned; a call costs milliseconds)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class EngineLoop:
    """The engine thread: :meth:`Engine.step` while there is work, each output handed to the callback its request
    was submitted with (called on the engine thread). Thread-safe :meth:`submit` / :meth:`abort`. runner: the
    thread to step on (:func:`torch_thread`; the one that built the engine, so torch runs on one thread), else a
    new one."""

    def __init__(self, engine: Engine, runner: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self._subs: dict[int, Callable[[RequestOutput], None]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.runner = runner if runner is not None else torch_thread()
        self._running: Future | None = None

    def start(self) -> None:
        self._running = self.runner.submit(self._run)

    def alive(self) -> bool:
        return self._running is not None and not self._running.done()

    def submit(self, prompt: list[int], params: RequestParams, callback: Callable[[RequestOutput], None]) -> int:
        """Queue a request (Engine.add_request; its ConfigError passes through). Returns its id."""
        with self._lock:
            rid = self.engine.add_request(prompt, params)
            self._subs[rid] = callback
        self._wake.set()
        return rid

    def submit_many(self, prompt: list[int], params: list[RequestParams],
                    callbacks: list[Callable[[RequestOutput], None]]) -> list[int]:
        """Queue one request per settings, all of one prompt, at once (Engine.add_requests: they join together and
        share the prefill; its ConfigError passes through, nothing queued). Returns their ids."""
        with self._lock:
            rids = self.engine.add_requests(prompt, params)
            self._subs.update(zip(rids, callbacks))
        self._wake.set()
        return rids

    def abort(self, rid: int) -> None:
        self.engine.abort(rid)
        self._wake.set()

    def abort_all(self) -> None:
        """Abort every submitted request; each finishes at the next step with finish_reason "abort"."""
        with self._lock:
            for rid in list(self._subs):
                self.engine.abort(rid)
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every request, end the thread (within ``timeout`` seconds)."""
        self.abort_all()
        self._stop = True
        self._wake.set()
        if self.alive():
            try:
                self._running.result(timeout)
            except Exception:  # a timeout, or the loop's own failure (already logged): the server is stopping
                pass

    def _run(self) -> None:
        trimmed = True
        while True:
            if self._stop and not self.engine.has_work():
                return
            if not self.engine.has_work():
                woke = self._wake.wait(0.5)
                self._wake.clear()
                if not woke and not trimmed:  # idle for half a second: no request waits on this
                    trim_heap()
                    trimmed = True
                continue
            trimmed = False
            try:
                outputs = self.engine.step()
            except Exception:  # a bug must not hang every client: fail the requests, keep serving
                log.exception("engine step failed; aborting every running request")
                outputs = self._fail_all()
            with self._lock:
                for out in outputs:
                    cb = self._subs.pop(out.request_id, None) if out.finished else self._subs.get(out.request_id)
                    if cb is not None:
                        cb(out)

    def _fail_all(self) -> list[RequestOutput]:
        eng = self.engine
        for r in [r for r in eng.slots if r is not None] + list(eng.waiting):
            eng.abort(r.id)
        return [RequestOutput(o.request_id, [], True, "error") for o in eng.step() if o.finished]


class TextStream:
    """Detokenizes a request's tokens as they come: :meth:`push` returns the text to send now. Held back until
    they settle: a trailing incomplete UTF-8 character (decoded as U+FFFD) and a tail that could begin a stop
    string; at the end the text is cut before the first stop string (after it with ``include_stop``). So the
    streamed pieces add up to the non-streamed text.

    prompt: the prompt's last tokens (a few suffice): the text is what ``decode`` gives for them + the completion
    minus what it gives for them alone, so a character split across the boundary (a token-id prompt cut inside
    it) comes out whole, and a tokenizer whose pieces depend on their left neighbour (a leading space) is read in
    context. The prompt's own trailing U+FFFD is not part of the prompt's text when the completion completes it."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...], include_stop: bool = False,
                 prompt: list[int] = (), min_tokens: int = 0) -> None:
        self.decode, self.stop, self.include_stop, self.min_tokens = decode, stop, include_stop, min_tokens
        self.prompt = list(prompt)
        self.prompt_text = decode(self.prompt) if self.prompt else ""
        self.tokens: list[int] = []
        self.sent = ""

    def _decode(self, tokens: list[int]) -> str:
        """The completion's text: decode(prompt + tokens) minus decode(prompt)."""
        if not self.prompt or not tokens:
            return self.decode(tokens)
        full = self.decode(self.prompt + tokens)
        if full.startswith(self.prompt_text):
            return full[len(self.prompt_text):]
        base = self.prompt_text.rstrip("\ufffd")  # the prompt ended inside a character the completion completes
        return full[len(base):] if full.startswith(base) else self.decode(tokens)

    def text(self) -> str:
        """The final text: decoded, cut before (``include_stop``: after) the first stop string that ends past the
        text of the first ``min_tokens`` tokens (the engine's rule: :func:`spire.engine.output.first_stop`)."""
        text = self._decode(self.tokens)
        floor = len(self._decode(self.tokens[: self.min_tokens])) if self.min_tokens else 0
        hit = first_stop(text, self.stop, floor)
        if hit is None:
            return text
        at, s = hit
        return text[: at + len(s)] if self.include_stop else text[:at]

    def push(self, tokens: list[int], finished: bool) -> str:
        self.tokens += tokens
        if finished:
            safe = self.text()
        else:
            safe = self._decode(self.tokens).rstrip("\ufffd")
            hold = max((n for s in self.stop for n in range(1, len(s)) if safe.endswith(s[:n])), default=0)
            safe = safe[: len(safe) - hold]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta


PROMPT_CONTEXT = 8
"""Prompt tokens a completion's text is decoded after (:class:`TextStream`)."""
LOGPROB_FLOOR = -9999.0
"""A logprob of -inf (a token the request's transforms banned) is reported as this (JSON has no -inf; vLLM's)."""


class _Choice:
    """One choice of a request being answered: its text stream, tokens, logprobs and finish reason."""

    def __init__(self, index: int, rid: int, text: TextStream) -> None:
        self.index, self.rid, self.text = index, rid, text
        self.n_tokens, self.finish = 0, None
        self.logprobs: list[tuple[int, float | None, list | None]] = []  # (token, logprob, top) per token
        self.started = False

    def take(self, out: RequestOutput, include_stop: bool) -> tuple[str, list]:
        """Fold one engine output in. Returns the text to send now and the logprob entries it brought."""
        toks = out.new_tokens
        self.n_tokens += len(toks)
        if out.stop_token is not None and not include_stop:  # the EOS / stop token id's own text is not shown
            toks = toks[:-1]
        entries = []
        if out.prompt_logprobs is not None:
            entries += [(None, None, None)] + [(None, lp, top) for lp, top in out.prompt_logprobs]
        if out.logprobs is not None:
            entries += [(t, lp, top) for t, (lp, top) in zip(out.new_tokens, out.logprobs)]
        self.logprobs += entries
        if out.finished:
            self.finish = out.finish_reason
        return self.text.push(toks, out.finished), entries


class Server:
    """What the app serves: the engine loop, the tokenizer, the model id and the limits.

    Args:
        engine: the :class:`Engine` (not yet stepping).
        tokenizer: the target's HF tokenizer (text <-> ids, chat template).
        model_id: the name /v1/models reports and requests may name.
        draft: the draft's kind (for the metrics' labels).
        max_waiting: queued (not yet running) requests at most; past it a 503.
        api_key: when given, /v1 requests need ``Authorization: Bearer <api_key>``.
        runner: the thread the engine steps on (:func:`torch_thread`: pass the one that built the engine).
        max_request_bytes: request bodies larger than this are refused (413) before they are read whole.
    """

    def __init__(self, engine: Engine, tokenizer: Any, model_id: str, draft: str, max_waiting: int = 64,
                 api_key: str | None = None, runner: ThreadPoolExecutor | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.engine, self.tokenizer, self.model_id, self.draft = engine, tokenizer, model_id, draft
        self.max_waiting, self.api_key, self.max_request_bytes = max_waiting, api_key, max_request_bytes
        self.loop = EngineLoop(engine, runner)
        self.created = int(time.time())
        # JSON parsing, validation, tokenizing and templating run here, never on the event loop
        self.parse_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="spire-parse")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, tid: int) -> str:
        """One token's own text (special tokens included)."""
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token's text can have (a bound from the vocabulary's strings), so a text of B
        bytes has at least B / this many tokens."""
        try:
            vocab = self.tokenizer.get_vocab()
            return max(8, max(len(t.encode("utf-8")) for t in vocab))
        except Exception:  # a tokenizer without a vocabulary listing: no early measure
            return 1 << 30

    # ---- requests ----------------------------------------------------------------------------------------

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused (413) when it is larger than ``max_request_bytes``: by its Content-Length
        before anything is read, else as soon as the bytes read pass the cap. The rest of a refused body is read
        and dropped (not kept), so the client gets its answer rather than a reset connection."""
        cap = self.max_request_bytes
        length = request.headers.get("content-length", "")
        stream = request.stream()
        too_big = length.isdigit() and int(length) > cap
        if not too_big:
            chunks, size = [], 0
            async for chunk in stream:
                size += len(chunk)
                if size > cap:
                    too_big, chunks = True, []
                    break
                chunks.append(chunk)
            if not too_big:
                return b"".join(chunks)
        drained = 0
        try:
            async for chunk in stream:
                drained += len(chunk)
                if drained > DRAIN_LIMIT:
                    break
        except Exception:  # the client went away: nothing to answer
            pass
        raise ApiError(413, f"the request body is larger than {cap} bytes (spire serve --max-request-bytes)", None,
                       "request_too_large")

    def parse_raw(self, raw: bytes, chat: bool) -> tuple[list[int], Parsed]:
        """:meth:`parse` of a raw body (run on the parse threads); a large body's heap pages are given back after."""
        try:
            return self.parse(protocol.parse_body(raw), chat)
        finally:
            if len(raw) > (1 << 20):
                del raw
                trim_heap()

    def _measure(self, nbytes: int, field: str) -> None:
        """Refuse a text that cannot fit the context, before tokenizing it: B bytes are at least B / the longest
        token's bytes tokens."""
        least = -(-nbytes // self.max_token_bytes)
        if least > self.engine.max_len - 1:
            raise bad(field, f"{field} has at least {least} tokens ({nbytes} bytes); the context holds "
                             f"{self.engine.max_len} positions per slot", "context_length_exceeded")

    def parse(self, body: dict, chat: bool) -> tuple[list[int], Parsed]:
        """Token ids and settings of a request body (a JSON object); a missing max_tokens is the rest of the
        context (max_len - prompt tokens). Raises ApiError naming the field."""
        req = protocol.validate(body, chat)
        protocol.check_model(req.model, self.model_id)
        parsed, asked = protocol.sampling_fields(req, chat)
        if chat:
            msgs = protocol.chat_messages(req)
            self._measure(sum(len(m["content"].encode("utf-8")) for m in msgs), "messages")
            cont = bool(req.continue_final_message)
            agp = req.add_generation_prompt if req.add_generation_prompt is not None else not cont
            text, ids = None, self._chat_ids(msgs, agp, cont)
            field = "messages"
        else:
            text, ids = protocol.completion_prompt(req)
            if ids is None:
                self._measure(len(text.encode("utf-8")), "prompt")
                special = True if req.add_special_tokens is None else req.add_special_tokens
                ids = self.tokenizer(text, add_special_tokens=special).input_ids
            field = "prompt"
        ids = [int(t) for t in ids]
        vocab = self.engine.target.cfg.vocab_size
        if not ids:
            raise bad(field, f"{field} has no tokens")
        if any(not 0 <= t < vocab for t in ids):
            raise bad(field, f"{field}: token ids must be in [0, {vocab}) (the model's vocabulary)")
        for name, tids in (("stop_token_ids", parsed.params.stop_token_ids),
                           ("logit_bias", [t for t, _ in parsed.params.logit_bias])):
            if any(not 0 <= t < vocab for t in tids):
                raise bad(name, f"{name}: token ids must be in [0, {vocab}) (the model's vocabulary)")
        room = self.engine.max_prompt(0) - len(ids)  # new tokens the slot still holds
        if room < 1:
            raise bad(field, f"{field} of {len(ids)} tokens is longer than the context: at most "
                             f"{self.engine.max_prompt(1)} tokens ({self.engine.max_len} positions per slot)",
                      "context_length_exceeded")
        if asked is not None and asked > room:
            raise bad("max_tokens", f"max_tokens {asked} + the prompt's {len(ids)} tokens exceed the context: at "
                                    f"most {room} new tokens for this prompt", "context_length_exceeded")
        if parsed.params.min_tokens > (asked or room):
            raise bad("min_tokens", f"min_tokens {parsed.params.min_tokens} is more than the {room} new tokens the "
                                    "context holds for this prompt", "context_length_exceeded")
        parsed.params = RequestParams(**{**parsed.params.__dict__, "max_tokens": asked if asked is not None else room})
        parsed.text, parsed.token_ids = text, ids
        return ids, parsed

    def _chat_ids(self, messages: list[dict[str, str]], generation_prompt: bool = True,
                  continue_final: bool = False) -> list[int]:
        try:
            kw = {"continue_final_message": True} if continue_final else {}
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                     return_dict=False, **kw)
        except Exception as e:  # a template that refuses the conversation (e.g. roles out of order)
            raise bad("messages", f"the chat template refuses these messages: {e}".splitlines()[0]) from None
        return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)

    def submit(self, ids: list[int], params: list[RequestParams]) -> tuple[list[int], asyncio.Queue]:
        """Queue one engine request per choice; their outputs arrive on the returned asyncio queue as (choice
        index, output). Raises ApiError 503 past max_waiting, 400 for what the engine refuses. A request counts as
        waiting only beyond the free slots (a new request waits for the engine's next step even when a slot is
        free: that is not a queue)."""
        free = self.engine.max_running - self.engine.num_running
        if self.engine.num_waiting + len(params) - 1 - free >= self.max_waiting:
            raise ApiError(503, f"the server is busy: {self.engine.num_waiting} requests are waiting "
                                f"(--max-waiting {self.max_waiting}); retry later", None, "server_overloaded",
                           "server_error", {"Retry-After": "1"})
        queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        try:
            rids = self.loop.submit_many(ids, params, [
                lambda out, i=i: aloop.call_soon_threadsafe(queue.put_nowait, (i, out)) for i in range(len(params))])
        except ConfigError as e:
            msg = str(e)
            raise bad(next((f for f in ("prompt", "stop_token_ids", "logit_bias", "stop", "max_tokens")
                            if msg.startswith(f)), None), msg) from None
        return rids, queue

    # ---- answers -----------------------------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        """ApiError 401 unless the request carries ``Authorization: Bearer <api_key>`` (when a key is set)."""
        if self.api_key is None:
            return
        import hmac

        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer <key>)", None,
                           "invalid_api_key")

    async def generate(self, request: Request, chat: bool) -> Any:
        """One /v1/completions or /v1/chat/completions request: read (capped), parse off the event loop, queue
        its n choices, then a JSON answer or an SSE stream. Raises ApiError."""
        self.check_auth(request)
        raw = await self.read_body(request)
        ids, parsed = await asyncio.get_running_loop().run_in_executor(self.parse_pool, self.parse_raw, raw, chat)
        del raw
        rids, queue = self.submit(ids, parsed.choice_params())
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.model_id}
        decode = functools.partial(self.decode, skip_special_tokens=parsed.skip_special_tokens)
        choices = [_Choice(i, rid, TextStream(decode, parsed.params.stop, parsed.include_stop_str,
                                              ids[-PROMPT_CONTEXT:], parsed.params.min_tokens))
                   for i, rid in enumerate(rids)]
        prompt_text = ""
        if parsed.echo:
            prompt_text = parsed.text if parsed.text is not None else decode(ids)
        if parsed.stream:
            usage = ((lambda: protocol.usage(len(ids), sum(c.n_tokens for c in choices)))
                     if parsed.include_usage or parsed.continuous_usage else None)
            return StreamingResponse(self._events(request, queue, choices, parsed, meta, chat, usage, prompt_text),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        await self._collect(request, queue, choices, parsed)
        out = []
        for c in choices:
            text = c.text.text()
            lps = (self._logprobs(self._named(c.logprobs, parsed.token_ids), chat, 0, parsed.token_ids_as_names)
                   if parsed.logprobs is not None else None)
            if chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                            "finish_reason": c.finish})
            else:
                out.append({"index": c.index, "text": prompt_text + text, "logprobs": lps, "finish_reason": c.finish})
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": out,
                "usage": protocol.usage(len(ids), sum(c.n_tokens for c in choices))}

    def _logprobs(self, entries: list, chat: bool, offset: int = 0, as_ids: bool = False) -> dict:
        """OpenAI's logprobs object from (token, logprob, top) entries. Completions: tokens, token_logprobs,
        top_logprobs, text_offset (from ``offset``); chat: content [{token, logprob, bytes, top_logprobs}]. as_ids:
        tokens named ``token_id:<id>`` (vLLM's return_tokens_as_token_ids)."""
        def lp(v: float | None) -> float | None:
            return None if v is None else max(float(v), LOGPROB_FLOOR)

        name = (lambda t: f"token_id:{t}") if as_ids else self.token_text

        if chat:
            content = []
            for tid, v, top in entries:
                s = name(tid)
                content.append({"token": s, "logprob": lp(v), "bytes": list(s.encode("utf-8")),
                                "top_logprobs": [{"token": name(t), "logprob": lp(x),
                                                  "bytes": list(name(t).encode("utf-8"))} for t, x in (top or [])]})
            return {"content": content}
        tokens, values, tops, offsets = [], [], [], []
        for tid, v, top in entries:
            s = name(tid)
            tokens.append(s)
            values.append(lp(v))
            tops.append(None if top is None else {name(t): lp(x) for t, x in top})
            offsets.append(offset)
            offset += len(self.token_text(tid)) if as_ids else len(s)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    async def _next(self, request: Request, rids: list[int], queue: asyncio.Queue) -> tuple[int, RequestOutput] | None:
        """The next (choice index, output), or None when the client has gone (its requests are then aborted)."""
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), 0.25)
            except asyncio.TimeoutError:
                item = None
            if await request.is_disconnected():  # does not wait: whether uvicorn has seen the connection close
                for rid in rids:
                    self.loop.abort(rid)
                return None
            if item is not None:
                return item

    async def _collect(self, request: Request, queue: asyncio.Queue, choices: list[_Choice], parsed: Parsed) -> None:
        """Wait for every choice of a non-streamed request to finish."""
        rids = [c.rid for c in choices]
        try:
            left = len(choices)
            while left:
                item = await self._next(request, rids, queue)
                if item is None:
                    raise ApiError(499, "the client closed the request", None, "client_closed")
                i, out = item
                if out.finish_reason == "error":
                    for rid in rids:
                        self.loop.abort(rid)
                    raise ApiError(500, "the engine failed on this request", None, "engine_error", "server_error")
                choices[i].take(out, parsed.include_stop_str)
                left -= out.finished
        except asyncio.CancelledError:
            for rid in rids:
                self.loop.abort(rid)
            raise

    async def _events(self, request: Request, queue: asyncio.Queue, choices: list[_Choice], parsed: Parsed,
                      meta: dict, chat: bool, usage: Callable[[], dict] | None = None, prompt_text: str = ""):
        """The SSE stream: a chunk per engine step and choice that brings text or logprobs (and one with the finish
        reason), with ``usage`` (include_usage) a last chunk of no choices and the usage, then ``data: [DONE]``;
        with continuous_usage_stats every chunk carries the usage so far. The requests are aborted when the client
        goes away."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        rids = [c.rid for c in choices]

        def chunk(i: int, delta: str | None, reason: str | None, lps: dict | None = None, role: bool = False) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
                choice = {"index": i, "delta": d, "logprobs": lps, "finish_reason": reason}
            else:
                choice = {"index": i, "text": delta or "", "logprobs": lps, "finish_reason": reason}
            extra = {"usage": usage()} if parsed.continuous_usage else {}
            return f"data: {json.dumps({**meta, 'object': kind, 'choices': [choice], **extra})}\n\n"

        left = len(choices)
        try:
            if chat:
                for c in choices:
                    yield chunk(c.index, None, None, role=True)
            while left:
                item = await self._next(request, rids, queue)
                if item is None:
                    return
                i, out = item
                if out.finish_reason == "error":
                    err = ApiError(500, "the engine failed on this request", None, "engine_error", "server_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                    left = 0
                    break
                c = choices[i]
                offset = (len(prompt_text) if c.started else 0) + len(c.text.sent)
                delta, entries = c.take(out, parsed.include_stop_str)
                if parsed.echo and not c.started:
                    delta = prompt_text + delta
                c.started = True
                left -= out.finished
                lps = None
                if parsed.logprobs is not None and entries:
                    entries = self._named(entries, parsed.token_ids)
                    lps = self._logprobs(entries, chat, offset, parsed.token_ids_as_names)
                if delta or out.finished or lps:
                    yield chunk(i, delta, out.finish_reason if out.finished else None, lps)
            if parsed.include_usage:
                yield f"data: {json.dumps({**meta, 'object': kind, 'choices': [], 'usage': usage()})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if left:
                for rid in rids:
                    self.loop.abort(rid)

    @staticmethod
    def _named(entries: list, prompt_ids: list[int] | None) -> list:
        """Entries with the prompt's token ids in place of None (echo: the prompt's entries come first)."""
        if not entries or entries[0][0] is not None or prompt_ids is None:
            return entries
        n = sum(1 for e in entries if e[0] is None)
        return [(prompt_ids[j], lp, top) for j, (_, lp, top) in enumerate(entries[:n])] + entries[n:]

    def models(self) -> dict:
        """/v1/models: the served model; max_model_len is what a request may use: prompt + max_tokens <= it, with
        any draft (rounds near the end of a slot draft fewer tokens)."""
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                            "owned_by": "spire", "max_model_len": self.engine.max_len}]}

    def metrics(self) -> str:
        """Prometheus text exposition of the engine's counters (see docs/serving.md), by ``prometheus_client``."""
        from prometheus_client import generate_latest

        return generate_latest(self._registry).decode()

    @functools.cached_property
    def _registry(self):
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_EngineCollector(self))
        return registry


class _EngineCollector:
    """The engine's counters as Prometheus metric families, read at each scrape (prometheus_client's custom
    collector: the engine keeps its own counters, so nothing is counted twice). Counter names end in ``_total``."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        eng, st, draft = self.server.engine, self.server.engine.stats, self.server.draft

        def gauge(name: str, help_: str, value: float | None = None, labels: tuple = (), samples=()):
            m = GaugeMetricFamily(name, help_, value=value, labels=list(labels) or None)
            for lv, v in samples:
                m.add_metric(list(lv), v)
            return m

        def counter(name: str, help_: str, value: float | None = None, labels: tuple = (), samples=()):
            m = CounterMetricFamily(name, help_, value=value, labels=list(labels) or None)
            for lv, v in samples:
                m.add_metric(list(lv), v)
            return m

        yield gauge("spire_requests_running", "Requests holding a slot.", eng.num_running)
        yield gauge("spire_requests_waiting", "Requests queued for a slot.", eng.num_waiting)
        yield gauge("spire_requests_prefilling", "Requests holding a slot whose prompt is still being prefilled "
                    "(chunked prefill; counted in running too).", eng.num_prefilling)
        yield gauge("spire_slots", "Slots (max running requests).", eng.max_running)
        yield counter("spire_prompt_tokens_total", "Prompt tokens prefilled.", st.prompt_tokens)
        yield counter("spire_generation_tokens_total", "Tokens generated.", st.generated_tokens)
        yield counter("spire_rounds_total", "Engine rounds (draft, verify, accept, commit).", st.rounds)
        yield counter("spire_request_rounds_total", "Rounds summed over the requests in them.", labels=("draft",),
                      samples=[((draft,), st.row_rounds)])
        yield counter("spire_accepted_tokens_total", "Draft tokens accepted by verification.", labels=("draft",),
                      samples=[((draft,), sum(i * c for i, c in enumerate(st.accepted)))])
        yield gauge("spire_tau", "Tokens per round per request, bonus included (tau).", labels=("draft",),
                    samples=[((draft,), round(st.tau, 6))])
        yield gauge("spire_acceptance_rate", "Share of request-rounds that accepted draft token j (by position).",
                    labels=("draft", "position"),
                    samples=[((draft, str(j + 1)), round(a, 6)) for j, a in enumerate(st.acceptance())] if eng.k else [])
        if eng.k:
            yield counter("spire_rounds_by_k_total", "Rounds by draft tokens per row (k = 0: AD rounds).",
                          labels=("draft", "k"), samples=[((draft, str(k)), c) for k, c in enumerate(st.rounds_by_k)])
        if eng.k:
            yield counter("spire_request_rounds_by_draft_total", "Request-rounds by the draft the request drafted with "
                          "and its k (draft none, k 0: it drafted nothing in the round).", labels=("draft", "k"),
                          samples=[((name, str(k)), c) for name, counts in sorted(st.row_rounds_by_draft.items())
                                   for k, c in enumerate(counts) if c])
            yield gauge("spire_draft_acceptance_rate", "Per draft of the portfolio: the share of request-rounds that "
                        "drafted token j with it that accepted it (by position).", labels=("draft", "position"),
                        samples=[((name, str(j + 1)), round(a, 6)) for name in sorted(st.accepted_by_draft)
                                 for j, a in enumerate(st.draft_acceptance(name))])
        acceptance = getattr(eng.k_policy, "acceptance", None)
        if acceptance is not None:
            names = getattr(eng.k_policy, "names", [])
            yield gauge("spire_policy_acceptance_rate", "The round policy's measured conditional acceptance of "
                        "draft token j given j - 1 accepted, over its recent window (mode greedy or sampled).",
                        labels=("draft", "mode", "position"),
                        samples=[((name, mode, str(j + 1)), round(c, 6)) for d, name in enumerate(names)
                                 for m, mode in enumerate(("greedy", "sampled"))
                                 for j, c in enumerate(acceptance.rates(d, m))])
        if eng.k_policy is not None and hasattr(eng.k_policy, "alpha"):
            yield gauge("spire_k_policy_alpha", "The k policy's estimate of the acceptance rate alpha.",
                        labels=("draft",), samples=[((draft,), round(eng.k_policy.alpha, 6))])
        yield counter("spire_requests_finished_total", "Requests ended, by reason.", labels=("reason",),
                      samples=[((r,), c) for r, c in sorted(st.finished.items())])


def create_app(server: Server) -> FastAPI:
    """The FastAPI app over ``server``; its lifespan starts and stops the engine thread."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        yield
        server.loop.stop()

    app = FastAPI(title="spire serve", lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")

    def openapi() -> dict:
        """FastAPI's schema, with the request models of the two generation endpoints (their bodies are read by
        hand: capped, then validated off the event loop)."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in (("/v1/completions", protocol.CompletionRequest),
                                ("/v1/chat/completions", protocol.ChatCompletionRequest)):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[model.__name__] = js
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        err = ApiError(e.status_code, str(e.detail), None, "not_found" if e.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        err = ApiError(500, f"internal error: {type(e).__name__}", None, "internal_error", "server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.generate(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return server.models()

    @app.get("/health")
    async def health():
        if not server.loop.alive():
            raise ApiError(503, "the engine thread is not running", None, "engine_down", "server_error")
        return {"status": "ok", "model": server.model_id, "draft": server.draft}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(server.metrics(), media_type=CONTENT_TYPE_LATEST)

    return app


ABORT_MARGIN_S = 2.0
"""Seconds of the shutdown grace kept for aborted requests to send their last response."""


def run(app: FastAPI, host: str, port: int, graceful_s: float = 30.0, log_level: str = "info",
        abort_all: Callable[[], None] | None = None) -> None:
    """Serve ``app`` with uvicorn until SIGINT / SIGTERM. On SIGTERM in-flight requests get ``graceful_s`` seconds
    to finish; those still running ``ABORT_MARGIN_S`` before the end are aborted through ``abort_all`` (each client
    gets its answer so far, finish_reason "abort", not a cut connection); then the engine stops and the process
    exits with status 0 (uvicorn itself would re-raise the signal)."""
    import signal

    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)
            if first and abort_all is not None:
                timer = threading.Timer(max(graceful_s - ABORT_MARGIN_S, 0.0), abort_all)
                timer.daemon = True
                timer.start()

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_s)
    _Server(config).run()
