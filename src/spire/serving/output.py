"""The engine's outputs as OpenAI's answer pieces: a choice's text as it streams (:class:`TextStream`: detokenized
in the prompt's context, held back where a stop string may begin, cut at the first one), its tokens, logprobs and
finish reason (:class:`Choice`), and the logprobs object of either endpoint (:func:`openai_logprobs`)."""

from __future__ import annotations

from typing import Callable

from spire.engine.output import first_stop
from spire.engine.scheduler import RequestOutput


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


class Choice:
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


def openai_logprobs(entries: list, chat: bool, token_text: Callable[[int], str], offset: int = 0,
                    as_ids: bool = False) -> dict:
    """OpenAI's logprobs object from (token, logprob, top) entries. Completions: tokens, token_logprobs,
    top_logprobs, text_offset (from ``offset``); chat: content [{token, logprob, bytes, top_logprobs}]. token_text:
    a token's own text; as_ids: tokens named ``token_id:<id>`` (vLLM's return_tokens_as_token_ids)."""
    def lp(v: float | None) -> float | None:
        return None if v is None else max(float(v), LOGPROB_FLOOR)

    name = (lambda t: f"token_id:{t}") if as_ids else token_text

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
        offset += len(token_text(tid)) if as_ids else len(s)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def with_prompt_ids(entries: list, prompt_ids: list[int] | None) -> list:
    """Entries with the prompt's token ids in place of None (echo: the prompt's entries come first)."""
    if not entries or entries[0][0] is not None or prompt_ids is None:
        return entries
    n = sum(1 for e in entries if e[0] is None)
    return [(prompt_ids[j], lp, top) for j, (_, lp, top) in enumerate(entries[:n])] + entries[n:]
