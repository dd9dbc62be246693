"""The engine's output processing, torch-free: a request's share of a round cut at its budget, EOS, stop token ids
and stop strings (:func:`cut_output`, :func:`cut_request`; the rule of which stop string ends a text,
:func:`first_stop`), a request's text as its tokens come (:class:`TextStream`: one per request, which both the
engine's stop-string check and ``spire serve``'s answers read, so the text is decoded once, in the prompt's context,
and the stop that ends generation is the stop the client sees), and a batch's result (:class:`GenerationResult`).
:class:`StopStrings` is the same check without a stream (``spire generate``'s final text)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from spire.errors import ConfigError


@dataclass
class GenerationResult:
    """tokens: per row, the emitted tokens (prompt excluded); finish_reasons: "stop" (EOS) or "length";
    rounds / emitted: per-row counts of rounds run while the row was active and tokens emitted;
    prefill_s / decode_s: wall-clock seconds of the prefill and of the round loop (device-synchronized);
    decode_cpu_s: CPU seconds the process spent in the round loop (all its threads; on a shared machine a
    single-threaded run's CPU time is what the loop would take on an idle core)."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    rounds: list[int]
    emitted: list[int]
    accepted_per_round: list[list[int]] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_cpu_s: float = 0.0

    @property
    def tau(self) -> float:
        """Average tokens emitted per round (bonus included): total emitted / total rounds."""
        return sum(self.emitted) / max(1, sum(self.rounds))

    def row_tau(self, b: int) -> float:
        return self.emitted[b] / max(1, self.rounds[b])


def cut_output(emitted: list[int], toks: list[int], max_new_tokens: int, eos_set: set[int],
               stop: StopStrings | None) -> tuple[list[int], bool]:
    """One row's share of a round's output tokens ``toks`` (its accepted tokens and the recovered / bonus one),
    given the tokens it ``emitted`` before: cut at its budget (``max_new_tokens`` in all), after an EOS token
    (kept) or after the token that completes a stop string. Returns (the tokens to emit, whether an EOS or a
    stop string ended the row). An EOS or stop string inside the budget wins over the budget (finish "stop")."""
    toks = toks[: max_new_tokens - len(emitted)]
    cut = next((i + 1 for i, t in enumerate(toks) if t in eos_set), None)
    if stop is not None:
        cut_s = stop.cut(emitted, toks[:cut])
        cut = cut_s if cut_s is not None else cut
    return (toks, False) if cut is None else (toks[:cut], True)


def first_stop(text: str, strings: Sequence[str], floor: int = 0) -> tuple[int, str] | None:
    """(start, string) of the stop string occurrence in ``text`` that ends first among those ending past character
    ``floor`` (the text of the tokens before which stop strings are not checked: min_tokens), or None."""
    hits = []
    for st in strings:
        at = text.find(st, max(0, floor - len(st) + 1))
        if at >= 0:
            hits.append((at + len(st), at, st))
    if not hits:
        return None
    _, at, st = min(hits)
    return at, st


class StopStrings:
    """Stop strings checked on decoded text. ``cut(previous, new)`` returns how many of the ``new`` tokens to
    keep so that the row ends with the token that completes the first stop string, or None.

    Args:
        strings: the stop strings (non-empty).
        decode: token ids -> text (e.g. ``tokenizer.decode``).
    """

    def __init__(self, strings: Sequence[str], decode) -> None:
        if any(not st for st in strings):
            raise ConfigError("stop strings must be non-empty")
        self.strings, self.decode = list(strings), decode
        self.span = max(len(st) for st in strings) if strings else 0

    def cut(self, previous: list[int], new: list[int], checked: bool = True) -> int | None:
        """checked: the text of ``previous`` holds no stop string (it was cut before); False (min_tokens): only an
        occurrence that ends past ``previous``'s text counts."""
        if not self.strings or not new:
            return None
        floor = len(self.decode(previous))
        start = max(0, floor - self.span)
        for i in range(len(new)):
            text = self.decode(previous + new[: i + 1])
            if checked and any(st in text[start:] for st in self.strings):
                return i + 1
            if not checked and first_stop(text, self.strings, floor) is not None:
                return i + 1
        return None

    def trim(self, text: str) -> str:
        """The text before the first stop string (the text a user is shown)."""
        hits = [text.find(st) for st in self.strings if st in text]
        return text[: min(hits)] if hits else text


def cut_request(emitted: list[int], toks: list[int], max_tokens: int, eos: set[int], stop: StopStrings | None,
                min_tokens: int = 0) -> tuple[list[int], bool]:
    """:func:`cut_output` with min_tokens: stop strings are checked only from the token that reaches min_tokens on
    (EOS and stop token ids cannot come earlier: the logits processing bans them), so only an occurrence that ends
    past the text of the first min_tokens tokens counts (:func:`first_stop`). Returns as :func:`cut_output`."""
    start = max(0, min_tokens - len(emitted))
    if start == 0 or stop is None:
        return cut_output(emitted, toks, max_tokens, eos, stop)
    toks = toks[: max_tokens - len(emitted)]
    cut = next((i + 1 for i, t in enumerate(toks) if t in eos), None)
    if start < len(toks[:cut]):
        cs = stop.cut(emitted + toks[:start], toks[start:cut], checked=False)
        cut = start + cs if cs is not None else cut
    return (toks, False) if cut is None else (toks[:cut], True)


PROMPT_CONTEXT = 8
"""Prompt tokens a completion's text is decoded after (:class:`TextStream`)."""


class TextStream:
    """A request's output processor: detokenizes its tokens as they come. :meth:`cut` is the engine's stop-string
    check (:func:`cut_request`), :meth:`push` the text to send now; both read one cache of decoded texts, so the
    engine's thread and the server's decode each prefix once between them. Held back until
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
        self.span = max((len(st) for st in stop), default=0)
        self.tokens: list[int] = []
        self.sent = ""
        self._texts: dict[tuple[int, ...], str] = {}  # recent decodes, by their tokens (the engine's and push's)

    def _text_of(self, tokens: list[int]) -> str:
        """:meth:`_decode` of ``tokens``, kept for the next reader (a few entries; safe across the two threads)."""
        key = tuple(tokens)
        text = self._texts.get(key)
        if text is None:
            text = self._decode(tokens)
            if len(self._texts) >= 8:
                self._texts.clear()
            self._texts[key] = text
        return text

    def cut(self, previous: list[int], new: list[int], checked: bool = True) -> int | None:
        """The engine's stop-string check (:class:`StopStrings`' contract, on this stream's text): how many of the
        ``new`` tokens to keep so that the output ends with the token that completes the first stop string, or
        None. checked: the text of ``previous`` holds no stop string (it was cut before); False (min_tokens): only
        an occurrence that ends past ``previous``'s text counts. One decode of the whole round when no stop string
        is in it; a decode per token only to find where one ends."""
        if not self.stop or not new:
            return None
        floor = len(self._text_of(previous))
        start = max(0, floor - self.span)

        def hit(text: str) -> bool:
            return (any(st in text[start:] for st in self.stop) if checked
                    else first_stop(text, self.stop, floor) is not None)

        if not hit(self._text_of(previous + new)):
            return None
        return next((i + 1 for i in range(len(new) - 1) if hit(self._text_of(previous + new[: i + 1]))), len(new))

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
        text = self._text_of(self.tokens)
        floor = len(self._text_of(self.tokens[: self.min_tokens])) if self.min_tokens else 0
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
            safe = self._text_of(self.tokens).rstrip("\ufffd")
            hold = max((n for s in self.stop for n in range(1, len(s)) if safe.endswith(s[:n])), default=0)
            safe = safe[: len(safe) - hold]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta
