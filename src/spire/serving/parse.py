"""Reading an OpenAI request of ``spire serve``: its body, capped (:func:`read_body`), and its token ids and
settings, checked against the model and the engine's context (:class:`RequestParser`, run on the parse threads,
never on the event loop). Errors are :class:`~spire.serving.protocol.ApiError` naming the field."""

from __future__ import annotations

import functools
from typing import Any

from fastapi import Request

from spire.engine.engine import Engine
from spire.params import RequestParams
from spire.serving import protocol
from spire.serving.engine_loop import trim_heap
from spire.serving.protocol import ApiError, Parsed, bad

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
"""``spire serve --max-request-bytes``'s default: 4 MiB, hundreds of times a 2,048-token prompt as text or ids."""
DRAIN_LIMIT = 256 << 20
"""Bytes of a refused (too large) body read and dropped at most, so that its client gets the 413."""


async def read_body(request: Request, cap: int) -> bytes:
    """The request body, refused (413) when it is larger than ``cap`` bytes: by its Content-Length
    before anything is read, else as soon as the bytes read pass the cap. The rest of a refused body is read
    and dropped (not kept), so the client gets its answer rather than a reset connection."""
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


class RequestParser:
    """A request body -> (token ids, :class:`~spire.serving.protocol.Parsed`), for ``engine`` serving ``model_id``
    with ``tokenizer`` (the target's HF tokenizer: text -> ids, chat template)."""

    def __init__(self, engine: Engine, tokenizer: Any, model_id: str) -> None:
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token's text can have (a bound from the vocabulary's strings), so a text of B
        bytes has at least B / this many tokens."""
        try:
            vocab = self.tokenizer.get_vocab()
            return max(8, max(len(t.encode("utf-8")) for t in vocab))
        except Exception:  # a tokenizer without a vocabulary listing: no early measure
            return 1 << 30

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
