"""Ollama's ``options`` (``/api/chat``, ``/api/generate``, ``/api/embed``; issue 23 item 2;
SPEC P1, L4) and what each one means here.

Ollama does not range-check its sampling options as OpenAI does: its sampler (and llama.cpp's,
which current Ollama runs) reads each out-of-range value as a setting. Coda reads them the same
way where that reading is a sampler setting, so a request that works on Ollama works here:

- ``temperature``: any value up to Coda's sampler limit (100; OpenAI's 2 is not Ollama's);
  below 0 is greedy, as Ollama clamps it to 0. Above 100 → 400 (the distribution is already
  uniform to float precision; no sane request asks for more).
- ``top_k``: 0 or below switches it off (Ollama's and llama.cpp's rule).
- ``top_p``: clamped to [0, 1] as Ollama clamps it (0 keeps the best token alone, 1 is off).
- ``min_p``: clamped to [0, 1] likewise.
- ``seed``: ``-1`` is Ollama's "no seed" (its default): a fresh random draw each request, not
  the fixed seed -1. Any other signed 64-bit value is a fixed seed.
- ``num_predict``: unset or any negative value is Ollama's default, no limit: the output ends
  at EOS or a stop, else at the context (``done_reason: "length"``). A positive value is the
  limit. ``0`` → 400 (Ollama reads 0 as no limit, an accident of its JSON encoding; a client
  that sends 0 most likely means "nothing", and Coda will not guess).
- ``repeat_penalty`` (Coda's repetition penalty, over the whole sequence): above 0 (0 would
  divide the logits by zero) else 400. ``presence_penalty`` / ``frequency_penalty``: Coda's
  sampler range [-2, 2], else 400 (Ollama has no range; Coda's sampler does).

Load-time and resource options (``num_ctx``, ``num_gpu``, ``num_thread``, ...) change no
output and are accepted without effect: the server's own settings size the model. Samplers
Coda does not have (``mirostat``, ``typical_p``, ``tfs_z``) are a 400 unless set to their
neutral value; the repeat penalty's ``repeat_last_n`` and ``penalize_newline`` are accepted
where they change nothing (no ``repeat_penalty``) or state Coda's own rule (``-1``: the whole
sequence; ``true``), else a 400. An unknown option is a 400 naming it (SPEC P1: a parameter is
never silently ignored; Ollama logs and ignores it).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from coda.engine.plan import NO_LIMIT
from coda.errors import InvalidRequestError
from coda.sampling import MAX_TEMPERATURE
from coda.server.schemas import SEED_MAX, SEED_MIN, STRICT

# NOTE: option name -> its neutral value (the one setting that asks for no such sampler)
_NEUTRAL: dict[str, Any] = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}
OLLAMA_NO_SEED = -1  # NOTE: Ollama's default seed: the sampler draws its own


def _clamped(value: float | None) -> float | None:
    return None if value is None else min(max(value, 0.0), 1.0)


def _not_below_zero(value: float | None) -> float | None:
    return None if value is None else max(value, 0)


def _seed(value: int | None) -> int | None:
    return None if value == OLLAMA_NO_SEED else value


class OllamaOptions(BaseModel):
    """``options``: see the module docstring for what each one does here."""

    model_config = STRICT
    # sampling, mapped
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # NOTE: Ollama's is an int64 too
    num_predict: int | None = None
    temperature: float | None = Field(None, le=MAX_TEMPERATURE)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # load-time and resources: accepted, no effect on the output
    numa: bool | None = None
    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    # samplers Coda does not have: only their neutral value
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    repeat_last_n: int | None = None
    penalize_newline: bool | None = None

    # NOTE: Ollama's readings of its out-of-range values (module docstring), made once here
    _zero_floor = field_validator("temperature", "top_k")(_not_below_zero)
    _unit = field_validator("top_p", "min_p")(_clamped)
    _no_seed = field_validator("seed")(_seed)

    @model_validator(mode="after")
    def _no_foreign_samplers(self) -> OllamaOptions:
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise ValueError(f"{name}={value!r} is not supported (Coda has no such "
                                 "sampler; leave it unset)")
        # NOTE: the repeat penalty's window and newline rule change nothing without a penalty;
        # with one, Coda's rule is the whole sequence (-1) and newlines included (true)
        penalty = self.repeat_penalty is not None and self.repeat_penalty != 1.0
        if penalty and self.repeat_last_n is not None and self.repeat_last_n != -1:
            raise ValueError(f"repeat_last_n={self.repeat_last_n!r} is not supported with "
                             "repeat_penalty: Coda's penalty covers the whole sequence "
                             "(repeat_last_n -1, or leave it unset)")
        if penalty and self.penalize_newline is False:
            raise ValueError("penalize_newline=False is not supported with repeat_penalty: "
                             "Coda's penalty covers every token (leave it unset)")
        return self


def max_tokens(options: OllamaOptions | None) -> int:
    """``num_predict`` as Coda's budget: positive is the limit; unset or negative no limit but
    the context's (the plan's :data:`~coda.engine.plan.NO_LIMIT`: Ollama's default, not the
    engine's ``default_max_tokens``, which would end the output long before; reaching the
    context ends ``context_limit``); 0 a 400."""
    n = options.num_predict if options is not None else None
    if n == 0:
        raise InvalidRequestError("options.num_predict: must be positive, or -1 (the default) "
                                  "for no limit", field="options.num_predict")
    return n if n is not None and n > 0 else NO_LIMIT
