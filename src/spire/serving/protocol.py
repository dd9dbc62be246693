"""The OpenAI API's request fields and error body, as ``spire serve`` reads and writes them.

Every bad request is an :class:`ApiError`: an HTTP 4xx with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field. Nothing here touches the
engine; :mod:`spire.serving.api` turns a parsed request into :meth:`spire.serving.engine.Engine.add_request`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from spire.errors import ConfigError
from spire.serving.engine import RequestParams

MAX_STOP = 4
"""Stop strings per request at most (OpenAI's limit)."""


class ApiError(Exception):
    """An error answered with OpenAI's error body. status: HTTP status; param: the offending field (or None);
    code: a short machine-readable code; kind: the body's ``type``; headers: extra response headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 naming ``param``."""
    return ApiError(400, message, param, code)


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body. Raises ApiError 400 for non-UTF-8 bytes, broken JSON or a non-object."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad(None, "the request body is not valid UTF-8", "invalid_encoding") from None
    except json.JSONDecodeError as e:
        raise bad(None, f"the request body is not valid JSON: {e.msg} at position {e.pos}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object", "invalid_json")
    return body


@dataclass
class Parsed:
    """A parsed generation request: the prompt (text, or token ids), the engine's settings, whether to stream."""

    text: str | None
    token_ids: list[int] | None
    params: RequestParams
    stream: bool
    include_usage: bool = False


def include_usage(body: dict) -> bool:
    """``stream_options.include_usage``: a last chunk with the usage and no choices. Raises ApiError."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise bad("stream_options", "stream_options must be an object with a boolean include_usage")
    return bool(opts.get("include_usage", False))


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"{name} must be a finite number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(name, f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")
    return float(v)


def _integer(body: dict, name: str, default: int | None, lo: int) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"{name} must be an integer, got {v!r}")
    if v < lo:
        raise bad(name, f"{name} must be >= {lo}, got {v}")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise bad("stop", f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings")
    return tuple(stops)


ACCEPTED_AS_DEFAULT: dict[str, tuple] = {
    "response_format": (None, {"type": "text"}),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
}
"""Fields of OpenAI's request that spire serve takes only at the value that changes nothing; any other value is a
400 naming the field (it would otherwise be silently ignored)."""


def _unsupported(body: dict) -> None:
    """Refuse, by name, what the engine does not do yet (rather than silently ignore it)."""
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n != 1):
        raise bad("n", f"only n = 1 is supported, got {n!r}", "unsupported")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise bad("best_of", f"only best_of = 1 is supported, got {best_of!r}", "unsupported")
    if isinstance(body.get("logprobs"), int) and not isinstance(body.get("logprobs"), bool):  # 0 asks for one
        raise bad("logprobs", "logprobs is not supported by spire serve", "unsupported")
    for name in ("echo", "logprobs", "top_logprobs", "tools", "functions", "logit_bias", "suffix"):
        if body.get(name) not in (None, False, 0, [], {}, ""):
            raise bad(name, f"{name} is not supported by spire serve", "unsupported")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad(name, f"{name} is not supported by spire serve (only 0)", "unsupported")
    for name, allowed in ACCEPTED_AS_DEFAULT.items():
        if name in body and body[name] not in allowed:
            what = " or ".join(json.dumps(a) for a in allowed if a is not None)
            raise bad(name, f"{name} is not supported by spire serve (only {what or 'null'})", "unsupported")


def sampling_fields(body: dict, max_tokens_default: int | None) -> tuple[RequestParams, bool, int | None]:
    """(RequestParams with max_tokens still to be settled, stream, the requested max_tokens or None).
    Fields: max_tokens (or max_completion_tokens), temperature [0, 2], top_p (0, 1], top_k >= 0, seed, stop, stream,
    ignore_eos. Raises ApiError naming the field."""
    _unsupported(body)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, max_tokens_default, 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _integer(body, "top_k", 0, -1)
    seed = _integer(body, "seed", None, -(1 << 63))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"stream must be a boolean, got {stream!r}")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos", f"ignore_eos must be a boolean, got {ignore_eos!r}")
    try:
        params = RequestParams(max_tokens=max_tokens or 1, temperature=temperature, top_k=max(0, top_k),
                               top_p=top_p, seed=None if seed is None else seed % (1 << 63), stop=_stop(body),
                               ignore_eos=ignore_eos)
    except ConfigError as e:
        raise bad(None, str(e)) from None
    return params, stream, max_tokens


def completion_prompt(body: dict) -> tuple[str | None, list[int] | None]:
    """The prompt of /v1/completions: a string, a list of token ids, or a list holding one of them. Raises
    ApiError (missing, empty, several prompts, wrong type) naming ``prompt``."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "prompt is required", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad("prompt", "prompt is empty")
        return p, None
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return None, list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad("prompt", "only one prompt per request is supported (send one request per prompt)", "unsupported")
    raise bad("prompt", "prompt must be a non-empty string or a non-empty list of token ids")


def chat_messages(body: dict) -> list[dict[str, str]]:
    """The messages of /v1/chat/completions as [{"role", "content"}] with string content (a list of text parts is
    joined). Raises ApiError naming ``messages``."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages must be a non-empty list", "missing_required_parameter")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise bad("messages", f"messages[{i}] must be an object with role system, user, assistant or developer")
        for name in ("tool_calls", "function_call", "audio"):
            if m.get(name) not in (None, []):
                raise bad("messages", f"messages[{i}].{name}: not supported by spire serve (no tool calling)",
                          "unsupported")
        content = m.get("content")
        if isinstance(content, list):
            parts = [c.get("text") for c in content if isinstance(c, dict) and c.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(t, str) for t in parts):
                raise bad("messages", f"messages[{i}].content: only text parts are supported")
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad("messages", f"messages[{i}].content must be a string or a list of text parts")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


def check_model(body: dict, served: str) -> None:
    """A request naming another model than the one served gets a 404 (OpenAI's model_not_found); none is fine."""
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served!r}", "model",
                       "model_not_found")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
