"""Request and sampling settings, torch-free, so the HTTP protocol (:mod:`spire.serving.protocol`), the scheduler
(:mod:`spire.engine.scheduler`) and the CLI read them without importing torch: :class:`SamplingParams` (the
transform of the distribution that is sampled), :class:`LogitsProcessing` (the transforms before it) and
:class:`RequestParams` (one request's settings, which give both). The tensors they act on are in
:mod:`spire.sampling`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from spire.errors import ConfigError


def greedy_top_p(temperature: float, top_p: float, name: str = "top_p") -> tuple[float, float]:
    """(temperature, top_p) with top_p read as OpenAI's API reads it, in [0, 1] where 0 means greedy decoding
    (temperature 0, top_p off): spire serve's ``top_p`` field (the shared serve-api-clients check sends ``top_p: 0``
    and expects the greedy text) and spire generate's ``--top-p`` alike. vLLM refuses 0 (its range is (0, 1]).
    Raises ConfigError naming ``name`` for a value outside [0, 1]."""
    if not 0 <= top_p <= 1:
        raise ConfigError(f"{name} must be in [0, 1] (0: greedy), got {top_p}")
    return (0.0, 1.0) if top_p == 0 else (temperature, top_p)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax, a one-hot distribution); top_k 0, top_p 1 and min_p 0 mean off. min_p:
    after the temperature, tokens of probability below min_p x the top token's are dropped (vLLM's min_p)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min-p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class LogitsProcessing:
    """The logits transforms that come before :class:`SamplingParams` (vLLM's order): logit_bias, then min_tokens,
    then the penalties. All off by default.

    logit_bias: (token id, bias) pairs added to the logits. min_tokens / banned: the tokens ``banned`` (EOS and
    stop token ids) get -inf while fewer than ``min_tokens`` tokens were generated. repetition_penalty (> 0; 1 off):
    a token of the prompt or of the output so far has its logit divided by it when positive, multiplied when
    negative (CTRL, as HF and vLLM). presence_penalty, frequency_penalty ([-2, 2]; 0 off): subtracted once per
    token that occurs in the output so far, and once per occurrence (OpenAI's definition; the prompt not
    counted). Raises ConfigError for values outside those ranges."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    banned: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.repetition_penalty < math.inf):
            raise ConfigError(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                raise ConfigError(f"{name} must be in [-2, 2], got {v}")
        if self.min_tokens < 0:
            raise ConfigError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if any(not math.isfinite(b) for _, b in self.logit_bias):
            raise ConfigError("logit_bias: biases must be finite")

    @property
    def penalized(self) -> bool:
        """Whether a penalty (which depends on the tokens so far) is on."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or (self.min_tokens > 0 and bool(self.banned)) or self.penalized


@dataclass(frozen=True)
class RequestParams:
    """One request's settings. max_tokens: new tokens at most (>= 1); temperature 0 = greedy; top_k 0, top_p 1 and
    min_p 0 = off (:class:`~spire.sampling.SamplingParams`); seed: its own generator's seed (None: a fresh random
    one); stop: stop strings (the request ends with the token that completes one); ignore_eos: do not stop at EOS.

    The logits processing of :class:`~spire.sampling.LogitsProcessing`, applied to the target's and the draft's
    logits alike (greedy requests take the argmax of the processed logits): stop_token_ids end the request like
    EOS (also with ignore_eos); min_tokens: EOS and stop_token_ids are banned, and stop strings not checked, until
    that many tokens were generated; logit_bias ((token id, bias) pairs), repetition_penalty, presence_penalty,
    frequency_penalty.

    logprobs: None, or n >= 0: each emitted token's log-probability under the target's processed distribution
    (:func:`~spire.sampling.logprobs_from_logits`) and the n most likely tokens there
    (:attr:`RequestOutput.logprobs`). prompt_logprobs: the same for every prompt token after the first (from the
    prefill), given once, with the request's first output. Raises ConfigError for impossible values."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ConfigError(f"{name} must be None or an integer >= 0, got {v!r}")
        self.sampling()  # validates temperature, top_k, top_p, min_p
        self.processing(())  # validates the penalties, min_tokens, logit_bias

    def sampling(self) -> SamplingParams:
        return SamplingParams(float(self.temperature), int(self.top_k), float(self.top_p), float(self.min_p))

    def processing(self, eos_ids) -> LogitsProcessing:
        """The logits processing, min_tokens banning ``eos_ids`` (unless ignore_eos) and the stop token ids."""
        banned = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))
        return LogitsProcessing(tuple(self.logit_bias), int(self.min_tokens), tuple(sorted(banned)),
                                float(self.repetition_penalty), float(self.presence_penalty),
                                float(self.frequency_penalty))
