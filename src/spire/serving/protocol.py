"""The OpenAI API's request fields and error body, as ``spire serve`` reads and writes them.

Requests are pydantic models (:class:`CompletionRequest`, :class:`ChatCompletionRequest`: one schema, shown at
``/docs``), validated strictly (no "5" for 5, no 2.5 for an integer, no NaN) and with ``extra="forbid"``: a field
that is not declared is a 400 naming it. A declared field is either honoured, or accepted only at the value that
changes nothing (:data:`ACCEPTED_AS_DEFAULT`), or accepted and without effect by nature (:data:`NO_EFFECT`:
``user``, ``metadata``...); docs/serving.md lists every field and what it does.

Every bad request is an :class:`ApiError`: an HTTP 4xx with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field. Nothing here touches the
engine; :mod:`spire.serving.api` turns a parsed request into :meth:`spire.engine.engine.Engine.add_request`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spire.errors import ConfigError
from spire.params import RequestParams, greedy_top_p

MAX_STOP = 4
"""Stop strings per request at most (OpenAI's limit)."""
MAX_LOGPROBS = 20
"""Top logprobs per token at most (completions' ``logprobs``, chat's ``top_logprobs``; vLLM's default limit)."""
MAX_N = 16
"""Choices per request at most (``n``)."""


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
    except RecursionError:
        raise bad(None, "the request body is nested too deeply", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object", "invalid_json")
    return body


# ---- the request models ------------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: Optional[bool] = Field(None, description="A last chunk with the usage and no choices.")
    continuous_usage_stats: Optional[bool] = Field(None, description="vLLM's: every chunk carries the usage so "
                                                                    "far (guidellm sends it).")


class _Request(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: Optional[str] = Field(None, description="The served model's id (/v1/models); another is a 404.")
    max_tokens: Optional[int] = Field(None, ge=1, description="New tokens at most; missing: the rest of the "
                                                              "context (max_model_len - prompt tokens).")
    temperature: Optional[float] = Field(None, ge=0, le=2, description="0: greedy. Default 1.")
    top_p: Optional[float] = Field(None, ge=0, le=1, description="Nucleus sampling; 0 means greedy.")
    n: Optional[int] = Field(None, ge=1, le=MAX_N, description="Choices, each sampled with its own generator "
                                                               "(seed + i when a seed is given).")
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = Field(None, description=f"Up to {MAX_STOP} stop strings.")
    seed: Optional[int] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = Field(None, description="Token id (as a string) -> bias in "
                                                                     "[-100, 100], added to the logits.")
    user: Optional[str] = Field(None, description="No effect (an end-user id).")
    # vLLM's sampling extensions
    top_k: Optional[int] = Field(None, ge=-1, description="-1 or 0: off.")
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0, description="1: off.")
    min_tokens: Optional[int] = Field(None, ge=0, description="EOS, stop token ids and stop strings act only "
                                                              "after this many tokens.")
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: Optional[bool] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = Field(None, description="Default true.")
    return_tokens_as_token_ids: Optional[bool] = Field(None, description="Logprobs name tokens 'token_id:<id>'.")
    spaces_between_special_tokens: Optional[Literal[True]] = Field(None, description="Only true.")
    # refused unless at the value that changes nothing (ACCEPTED_AS_DEFAULT) or absent
    response_format: Optional[Any] = None
    best_of: Optional[int] = Field(None, ge=1, description="Only equal to n (nothing is ranked).")
    use_beam_search: Optional[Literal[False]] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_choice: Optional[Any] = None
    guided_grammar: Optional[Any] = None
    structured_outputs: Optional[Any] = None
    allowed_token_ids: Optional[Any] = None
    bad_words: Optional[Any] = None
    truncate_prompt_tokens: Optional[Any] = None
    prompt_logprobs: Optional[Any] = None
    priority: Optional[Any] = None


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(
        ..., description="A string, a list of token ids, or a list holding one of them (one prompt per request).")
    echo: Optional[bool] = Field(None, description="The prompt before the completion (with its logprobs).")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="Each token's logprob and the top n.")
    suffix: Optional[str] = Field(None, description="Refused unless empty.")
    add_special_tokens: Optional[bool] = Field(None, description="Tokenize the prompt with the tokenizer's "
                                                                 "special tokens (default true).")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="As max_tokens.")


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[Any] = Field(..., description="[{role: system|developer|user|assistant, content: string or "
                                                 "text parts}]")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="As max_tokens (wins over it).")
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="Needs logprobs: true.")
    metadata: Optional[dict[str, str]] = Field(None, description="No effect.")
    store: Optional[Literal[False]] = Field(None, description="Only false (nothing is stored).")
    service_tier: Optional[str] = Field(None, description="No effect.")
    prompt_cache_key: Optional[str] = Field(None, description="No effect (the prefill is not cached).")
    safety_identifier: Optional[str] = Field(None, description="No effect.")
    add_generation_prompt: Optional[bool] = Field(None, description="Default true.")
    continue_final_message: Optional[bool] = Field(None, description="Continue the last (assistant) message.")
    echo: Optional[Literal[False]] = None
    add_special_tokens: Optional[Literal[False]] = None
    chat_template: Optional[Any] = None
    chat_template_kwargs: Optional[Any] = None
    documents: Optional[Any] = None
    tool_choice: Optional[Any] = None
    tools: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    parallel_tool_calls: Optional[Any] = None
    modalities: Optional[Any] = None
    audio: Optional[Any] = None
    prediction: Optional[Any] = None
    reasoning_effort: Optional[Any] = None
    verbosity: Optional[Any] = None
    web_search_options: Optional[Any] = None


ACCEPTED_AS_DEFAULT: dict[str, tuple] = {
    "response_format": (None, {"type": "text"}),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False),
    "modalities": (None, ["text"]),
    "tools": (None, []),
    "functions": (None, []),
    "suffix": (None, ""),
    "chat_template_kwargs": (None, {}),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,),
    "priority": (None, 0),
    "chat_template": (None,),
    "documents": (None,),
}
"""Fields spire serve takes only at the value that changes nothing; any other value is a 400 naming the field (it
would otherwise be silently ignored)."""

NO_EFFECT = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
             "spaces_between_special_tokens", "use_beam_search")
"""Fields accepted that change nothing by nature (an id, a tag, a hint) or are allowed only at the value that is
spire serve's behaviour (``store: false``, ``spaces_between_special_tokens: true``, ``use_beam_search: false``)."""


UNION_MEMBERS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
                 "list[str]": "a list of strings", "list[int]": "a list of token ids",
                 "list[list[int]]": "a list of lists of token ids"}
"""How a 400 names each member of a field typed as a union (pydantic tags each member's error with its type)."""


def _validation_error(e: ValidationError) -> ApiError:
    """The first pydantic error as a 400 naming its top-level field. A value that matches no member of a union
    field (``"stop": [1]``) is named by the field and what it may be ("stop: must be a string or a list of
    strings, got [1]"), not by pydantic's error per member."""
    errors = e.errors(include_url=False)
    err = errors[0]
    loc = [str(x) for x in err["loc"]]
    param = loc[0] if loc else None
    members = list(dict.fromkeys(str(x["loc"][1]) for x in errors if len(x["loc"]) > 1 and str(x["loc"][0]) == param))
    if len(members) > 1 and all(m in UNION_MEMBERS for m in members):
        got = json.dumps(err.get("input"), default=str)
        got = got if len(got) <= 60 else got[:57] + "..."
        names = [UNION_MEMBERS[m] for m in members]
        return bad(param, f"{param}: must be {', '.join(names[:-1])} or {names[-1]}, got {got}")
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {'.'.join(loc)} (spire serve does not "
                             "implement it; docs/serving.md lists the fields)", param, "unknown_parameter")
    if err["type"] == "missing":
        return bad(param, f"{param} is required", "missing_required_parameter")
    got = json.dumps(err.get("input"), default=str)
    got = got if len(got) <= 60 else got[:57] + "..."
    return bad(param, f"{'.'.join(loc)}: {err['msg']}, got {got}")


def validate(body: dict, chat: bool) -> CompletionRequest | ChatCompletionRequest:
    """The request model of a body (a JSON object). Raises ApiError 400 naming the field: an unknown field, a value
    of the wrong type or range, or a field refused at that value (:data:`ACCEPTED_AS_DEFAULT`)."""
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    for name, allowed in ACCEPTED_AS_DEFAULT.items():
        if name in body and body[name] not in allowed:
            what = " or ".join(json.dumps(a) for a in allowed if a is not None)
            raise bad(name, f"{name} is not supported by spire serve (only {what or 'null'})", "unsupported")
    return req


@dataclass
class Parsed:
    """A parsed generation request: the prompt (text, or token ids), the engine's settings (one per choice: n of
    them), whether to stream, and what the answer shows (echo, logprobs)."""

    text: str | None
    token_ids: list[int] | None
    params: RequestParams
    stream: bool
    include_usage: bool = False
    n: int = 1
    continuous_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top n per token (completions' logprobs, chat's top_logprobs) or None
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    token_ids_as_names: bool = False

    def choice_params(self) -> list[RequestParams]:
        """The engine settings of choice i: seed + i where a seed is given (else each a fresh random one)."""
        p = self.params
        if self.n == 1:
            return [p]
        return [RequestParams(**{**p.__dict__, "seed": None if p.seed is None else (p.seed + i) % (1 << 63)})
                for i in range(self.n)]


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not all(stops) or len(stops) > MAX_STOP:
        raise bad("stop", f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings")
    return tuple(stops)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise bad("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
        if not -100 <= value <= 100:
            raise bad("logit_bias", f"logit_bias values must be in [-100, 100], got {value} for token {key}")
        out.append((tid, float(value)))
    return tuple(out)


def sampling_fields(req: CompletionRequest | ChatCompletionRequest, chat: bool) -> tuple[Parsed, int | None]:
    """The engine settings of a validated request (max_tokens still to be settled against the prompt) and the
    requested max_tokens (or None). Raises ApiError naming the field."""
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise bad("best_of", f"best_of {req.best_of} > n {n} is not supported by spire serve (nothing is ranked): "
                             "only best_of = n", "unsupported")
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    temperature = 1.0 if req.temperature is None else req.temperature
    temperature, top_p = greedy_top_p(temperature, 1.0 if req.top_p is None else req.top_p)  # 0: greedy
    if chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        echo = False
        if req.add_generation_prompt and req.continue_final_message:
            raise bad("continue_final_message", "continue_final_message and add_generation_prompt cannot both be "
                                                "true")
    else:
        logprobs, echo = req.logprobs, bool(req.echo)
    min_tokens = req.min_tokens or 0
    if asked is not None and min_tokens > asked:
        raise bad("min_tokens", f"min_tokens {min_tokens} is more than max_tokens {asked}")
    opts = req.stream_options
    if opts is not None and not req.stream:
        raise bad("stream_options", "stream_options needs stream: true")
    try:
        params = RequestParams(
            max_tokens=asked or 1, temperature=temperature, top_k=max(0, req.top_k or 0), top_p=top_p,
            seed=None if req.seed is None else req.seed % (1 << 63), stop=_stop(req.stop),
            ignore_eos=bool(req.ignore_eos), min_p=req.min_p or 0.0,
            stop_token_ids=tuple(req.stop_token_ids or ()), min_tokens=min_tokens,
            logit_bias=_logit_bias(req.logit_bias),
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            logprobs=logprobs, prompt_logprobs=logprobs if echo and logprobs is not None else None)
    except ConfigError as e:
        msg = str(e)
        raise bad(next((f for f in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p",
                                    "logit_bias", "min_tokens") if f.replace("_", "-") in msg or f in msg), None),
                  msg) from None
    parsed = Parsed(None, None, params, bool(req.stream), bool(opts and opts.include_usage), n,
                    bool(opts and opts.continuous_usage_stats), echo, logprobs,
                    bool(req.include_stop_str_in_output),
                    True if req.skip_special_tokens is None else req.skip_special_tokens,
                    bool(req.return_tokens_as_token_ids))
    return parsed, asked


def completion_prompt(req: CompletionRequest) -> tuple[str | None, list[int] | None]:
    """The prompt of /v1/completions: a string, a list of token ids, or a list holding one of them. Raises
    ApiError (empty, several prompts) naming ``prompt``."""
    p = req.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad("prompt", "prompt is empty")
        return p, None
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        return None, list(p)
    if isinstance(p, list) and len(p) > 1:
        raise bad("prompt", "only one prompt per request is supported (send one request per prompt)", "unsupported")
    raise bad("prompt", "prompt must be a non-empty string or a non-empty list of token ids")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages of /v1/chat/completions as [{"role", "content"}] with string content (a list of text parts is
    joined). Raises ApiError naming ``messages``."""
    msgs = req.messages
    if not msgs:
        raise bad("messages", "messages must be a non-empty list", "missing_required_parameter")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise bad("messages", f"messages[{i}] must be an object with role system, user, assistant or developer")
        for name in ("tool_calls", "function_call", "audio"):
            if m.get(name) not in (None, []):
                raise bad("messages", f"messages[{i}].{name}: not supported by spire serve (no tool calling)",
                          "unsupported")
        if m.get("refusal") is not None:
            raise bad("messages", f"messages[{i}].refusal: not supported by spire serve", "unsupported")
        extra = set(m) - {"role", "content", "tool_calls", "function_call", "audio", "refusal"}
        if extra:  # "name" among them: the chat template has no place for it, so it would be dropped silently
            raise bad("messages", f"messages[{i}]: field(s) {', '.join(sorted(extra))} not supported by spire serve",
                      "unknown_parameter")
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


def check_model(model: str | None, served: str) -> None:
    """A request naming another model than the one served gets a 404 (OpenAI's model_not_found); none is fine."""
    if model is not None and model != served:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served!r}", "model",
                       "model_not_found")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
