"""Sampling parameters of one request (pure Python, no torch).

:class:`SamplingParams` is the validated, immutable description of *how* a request chooses each
token; :mod:`coda.engine.sampler` applies it to logits. Validation happens once, at construction,
and raises :class:`~coda.errors.InvalidRequestError` naming the offending ``field`` (SPEC D1 style:
a bad request is rejected before any work, never silently clamped).

Neutral values switch a processor off: ``top_p=1``, ``top_k`` 0 or -1, ``min_p=0``,
``repetition_penalty=1``, presence/frequency penalty 0, no ``logit_bias``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from coda.errors import InvalidRequestError

LogitBias = tuple[tuple[int, float], ...]

MAX_TEMPERATURE = 100.0  # NOTE: OpenAI's range ends at 2; we accept more but nothing absurd.
MAX_LOGPROBS = 20
MAX_ABS_BIAS = 100.0
MAX_ABS_PRESENCE_FREQUENCY = 2.0
# NOTE: dividing logits by a temperature this small overflows float32; such rows are greedy.
GREEDY_TEMPERATURE = 1e-5


def _number(value: object, field: str) -> float:
    """``value`` as a finite float; bools are rejected although Python treats them as ints."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{field} must be a number, got {value!r}", field=field)
    if not math.isfinite(value):
        raise InvalidRequestError(f"{field} must be finite, got {value!r}", field=field)
    return float(value)


def _integer(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{field} must be an integer, got {value!r}", field=field)
    return value


def _in_range(value: float, low: float, high: float, field: str) -> None:
    if not low <= value <= high:
        raise InvalidRequestError(f"{field} must be in [{low}, {high}], got {value}", field=field)


def normalise_logit_bias(raw: object) -> LogitBias:
    """A mapping (JSON gives string keys) or pairs → sorted tuple of ``(token_id, bias)``."""
    items: Iterable[Any]
    if isinstance(raw, Mapping):
        items = raw.items()
    elif isinstance(raw, Iterable) and not isinstance(raw, str | bytes):
        items = raw
    else:
        raise InvalidRequestError("logit_bias must map token ids to biases", field="logit_bias")
    pairs: dict[int, float] = {}
    for item in items:
        try:
            key, bias = item
        except (TypeError, ValueError):
            raise InvalidRequestError(
                f"logit_bias entries must be (token_id, bias) pairs, got {item!r}",
                field="logit_bias",
            ) from None
        # NOTE: OpenAI clients send {"50256": -100}; accept decimal-string keys, nothing fuzzier.
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        token_id = _integer(key, "logit_bias")
        if token_id < 0:
            raise InvalidRequestError(
                f"logit_bias token id must be >= 0, got {token_id}", field="logit_bias"
            )
        if token_id in pairs:
            raise InvalidRequestError(
                f"logit_bias repeats token id {token_id}", field="logit_bias"
            )
        value = _number(bias, "logit_bias")
        _in_range(value, -MAX_ABS_BIAS, MAX_ABS_BIAS, "logit_bias")
        pairs[token_id] = value
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. Immutable and hashable; validated on construction.

    Attributes:
        temperature: 0 (anything below ``GREEDY_TEMPERATURE``) means greedy (argmax);
            otherwise logits are divided by it. [0, 100].
        top_p: nucleus sampling, keep the smallest set of tokens whose mass reaches it. (0, 1].
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 switch it off; else >= 1.
        min_p: drop tokens whose probability is below ``min_p`` times the best one's. [0, 1].
        repetition_penalty: > 0; multiplicative (CTRL-style) on every token already seen in the
            prompt or the output: a positive logit is divided by it, a negative one multiplied.
        presence_penalty: [-2, 2], subtracted once from each token that occurs in the output.
        frequency_penalty: [-2, 2], subtracted per occurrence of the token in the output.
        logit_bias: added to the raw logits; accepts a mapping ``{token_id: bias}`` (keys may be
            decimal strings) or pairs, stored as a sorted tuple of pairs. Bias in [-100, 100];
            token ids are checked against the model by :meth:`validate_for_vocab`.
        seed: makes sampling reproducible (per request, see ``coda.engine.sampler``); None =
            the engine draws one at submit.
        min_tokens: EOS ids are banned until this many output tokens exist. >= 0.
        ignore_eos: EOS is not a stop (the decode loop's concern, not the sampler's).
        logprobs: None = no logprobs; 0..20 = return the chosen token's logprob and that many
            top alternatives.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: LogitBias = ()
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # NOTE: the frozen dataclass's own way to normalise fields.
        temperature = _number(self.temperature, "temperature")
        _in_range(temperature, 0.0, MAX_TEMPERATURE, "temperature")
        set_(self, "temperature", temperature)

        top_p = _number(self.top_p, "top_p")
        if not 0.0 < top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p}", field="top_p")
        set_(self, "top_p", top_p)

        top_k = _integer(self.top_k, "top_k")
        if top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1 or 0 (off) or >= 1, got {top_k}", field="top_k"
            )
        set_(self, "top_k", 0 if top_k == -1 else top_k)  # NOTE: one spelling of "off".

        min_p = _number(self.min_p, "min_p")
        _in_range(min_p, 0.0, 1.0, "min_p")
        set_(self, "min_p", min_p)

        repetition = _number(self.repetition_penalty, "repetition_penalty")
        if repetition <= 0.0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {repetition}", field="repetition_penalty"
            )
        set_(self, "repetition_penalty", repetition)

        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(getattr(self, name), name)
            _in_range(value, -MAX_ABS_PRESENCE_FREQUENCY, MAX_ABS_PRESENCE_FREQUENCY, name)
            set_(self, name, value)

        set_(self, "logit_bias", normalise_logit_bias(self.logit_bias))

        if self.seed is not None:
            _integer(self.seed, "seed")
        if _integer(self.min_tokens, "min_tokens") < 0:
            raise InvalidRequestError(
                f"min_tokens must be >= 0, got {self.min_tokens}", field="min_tokens"
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos must be a boolean", field="ignore_eos")
        if self.logprobs is not None:
            _in_range(_integer(self.logprobs, "logprobs"), 0, MAX_LOGPROBS, "logprobs")

    @property
    def is_greedy(self) -> bool:
        """True when the choice is a deterministic argmax: temperature ~0 or top_k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Reject ``logit_bias`` ids outside ``[0, vocab_size)``; called once the model is known."""
        for token_id, _ in self.logit_bias:
            if token_id >= vocab_size:
                raise InvalidRequestError(
                    f"logit_bias token id {token_id} is outside the vocabulary "
                    f"(size {vocab_size})",
                    field="logit_bias",
                )
