"""The engine's outputs as OpenAI's answer pieces: a choice's text as it streams (its
:class:`~spire.engine.output.TextStream`, the engine's output module's), its tokens, logprobs and finish reason
(:class:`Choice`), and the logprobs object of either endpoint (:func:`openai_logprobs`)."""

from __future__ import annotations

from typing import Callable

from spire.engine.output import PROMPT_CONTEXT, TextStream
from spire.engine.scheduler import RequestOutput

__all__ = ["PROMPT_CONTEXT", "Choice", "openai_logprobs", "with_prompt_ids"]
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
