"""The answers of ``spire serve``: :class:`Server` queues a parsed request's choices on the engine thread and
answers with one JSON body or a Server-Sent Events stream (aborting what its client leaves), and reports the
model (/v1/models) and the metrics (/metrics)."""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from spire.engine.engine import Engine
from spire.engine.scheduler import RequestOutput
from spire.errors import ConfigError
from spire.params import RequestParams
from spire.serving import protocol
from spire.serving.engine_loop import EngineLoop
from spire.serving.metrics import metrics_registry, metrics_text
from spire.engine.output import TextStream
from spire.serving.output import PROMPT_CONTEXT, Choice, openai_logprobs, with_prompt_ids
from spire.serving.parse import DEFAULT_MAX_REQUEST_BYTES, RequestParser, read_body
from spire.serving.protocol import ApiError, Parsed, bad


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
        self.parser = RequestParser(engine, tokenizer, model_id)
        self.created = int(time.time())
        # JSON parsing, validation, tokenizing and templating run here, never on the event loop
        self.parse_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="spire-parse")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, tid: int) -> str:
        """One token's own text (special tokens included)."""
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def submit(self, ids: list[int], params: list[RequestParams], texts=None) -> tuple[list[int], asyncio.Queue]:
        """Queue one engine request per choice (``texts``: their output processors, shared with the engine's
        stop-string check); their outputs arrive on the returned asyncio queue as (choice index, output). Raises ApiError 503 past max_waiting, 400 for what the engine refuses. A request counts as
        waiting only beyond the free slots (a new request waits for the engine's next step even when a slot is
        free: that is not a queue)."""
        status = self.engine.status()
        free = status.max_running - status.running
        if status.waiting + len(params) - 1 - free >= self.max_waiting:
            raise ApiError(503, f"the server is busy: {status.waiting} requests are waiting "
                                f"(--max-waiting {self.max_waiting}); retry later", None, "server_overloaded",
                           "server_error", {"Retry-After": "1"})
        queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        try:
            rids = self.loop.submit_many(ids, params, [
                lambda out, i=i: aloop.call_soon_threadsafe(queue.put_nowait, (i, out)) for i in range(len(params))],
                texts)
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
        raw = await read_body(request, self.max_request_bytes)
        ids, parsed = await asyncio.get_running_loop().run_in_executor(self.parse_pool, self.parser.parse_raw, raw,
                                                                       chat)
        del raw
        decode = functools.partial(self.decode, skip_special_tokens=parsed.skip_special_tokens)
        params = parsed.choice_params()
        # each choice's one output processor: the engine checks its stop strings on the text the client is sent
        texts = [TextStream(decode, parsed.params.stop, parsed.include_stop_str, ids[-PROMPT_CONTEXT:],
                            parsed.params.min_tokens) for _ in params]
        rids, queue = self.submit(ids, params, texts)
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.model_id}
        choices = [Choice(i, rid, text) for i, (rid, text) in enumerate(zip(rids, texts))]
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
            lps = (openai_logprobs(with_prompt_ids(c.logprobs, parsed.token_ids), chat, self.token_text, 0,
                                   parsed.token_ids_as_names)
                   if parsed.logprobs is not None else None)
            if chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                            "finish_reason": c.finish})
            else:
                out.append({"index": c.index, "text": prompt_text + text, "logprobs": lps, "finish_reason": c.finish})
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": out,
                "usage": protocol.usage(len(ids), sum(c.n_tokens for c in choices))}

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

    async def _collect(self, request: Request, queue: asyncio.Queue, choices: list[Choice], parsed: Parsed) -> None:
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

    async def _events(self, request: Request, queue: asyncio.Queue, choices: list[Choice], parsed: Parsed,
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
                    entries = with_prompt_ids(entries, parsed.token_ids)
                    lps = openai_logprobs(entries, chat, self.token_text, offset, parsed.token_ids_as_names)
                if delta or out.finished or lps:
                    yield chunk(i, delta, out.finish_reason if out.finished else None, lps)
            if parsed.include_usage:
                yield f"data: {json.dumps({**meta, 'object': kind, 'choices': [], 'usage': usage()})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if left:
                for rid in rids:
                    self.loop.abort(rid)

    def models(self) -> dict:
        """/v1/models: the served model; max_model_len is what a request may use: prompt + max_tokens <= it, with
        any draft (rounds near the end of a slot draft fewer tokens)."""
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                            "owned_by": "spire", "max_model_len": self.engine.max_len}]}

    def metrics(self) -> str:
        """Prometheus text exposition of the engine's counters (see docs/serving.md), by ``prometheus_client``."""
        return metrics_text(self._registry)

    @functools.cached_property
    def _registry(self):
        return metrics_registry(self.engine, self.draft)
