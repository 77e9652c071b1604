"""Admission: one request and the model's limits become one frozen :class:`RequestPlan`
(issue 22 step 1; SPEC L4, L5, S1, G3, K3, E). Pure Python: no torch, no tokenizer.

This is the only place a request's fields are checked against the model: the prompt's ids and
length, the token budget, stops, the vocabulary, the sampling's logit bias, the K3 tail
policy and the deadline. The engine consumes the plan as it is; nothing downstream checks or
derives the budget again.

The token budget has one name, ``max_tokens``, and one check and derivation
(:func:`plan_request`): the limit the client asked for; else the engine's configured default
(``ModelLimits.default_max_tokens``) where it ends before the context; else the room the
context leaves (then the request ends ``context_limit``, never ``max_output_tokens``, L4).
A protocol's "no limit" (Ollama's unset ``num_predict``) is :data:`NO_LIMIT`: the room the
context leaves whatever the default, ending ``context_limit`` likewise.
Each protocol adapter maps its own wire field (``max_completion_tokens``,
``max_output_tokens``, ``options.num_predict``, ...) onto ``max_tokens`` once, at parse; below
the adapters no other name for it exists (tests/test_one_budget_name.py).

The served context never exceeds the KV cache (:class:`~coda.engine.async_engine.AsyncEngine`
lowers it to what the cache holds), so a plan that fits the context fits the whole cache: this
is the one "can this request ever fit" check (T3/D1), a 4xx before anything is acquired; the
scheduler only asks whether a planned sequence fits *now* (tests/test_kv_budget.py).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real

from coda.early_stop import EarlyStopPolicy
from coda.engine.types import GenerationRequest, GrammarSpec
from coda.errors import ContextLengthExceededError, InvalidRequestError
from coda.finish import FinishReason
from coda.output import UTF8_TAIL_POLICIES, OutputSpec
from coda.sampling import MAX_LOGPROBS, SamplingParams
from coda.stops import stop_bytes
from coda.stream_backpressure import BackpressureConfig

# NOTE: ``max_tokens`` for "no limit but the context" (a protocol's own no-limit, Ollama's unset
# or negative num_predict): read here alone, as the room the prompt leaves (L4)
NO_LIMIT = -1


@dataclass(frozen=True)
class ModelLimits:
    """What a plan is checked against, fixed when the engine starts. ``default_max_tokens``:
    the budget of a request that names none (``EngineConfig.default_max_tokens``; None: the
    context)."""

    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    default_max_tokens: int | None = None


@dataclass(frozen=True, kw_only=True)
class RequestPlan(OutputSpec):
    """Everything the engine runs one request by, checked once (see the module doc): one
    frozen object per request.

    It *is* the request's per-token rules (:class:`~coda.output.OutputSpec`, its base: G1
    order: budget, context, EOS, stops, K3 tail, reasoning split) plus what the engine alone
    reads, so the output processor is handed the plan itself, typed by the part it reads (the
    core never imports the engine, so the core declares that part and the plan extends it; no
    second object holds a copy). ``max_tokens``: the most output tokens the request may
    select (the token budget, its one name); its ``budget_end`` is ``context_limit`` when no
    limit applies before the context (L4). ``seed``: the request's RNG seed, drawn here when
    none was asked (E). ``deadline_s`` is relative to arrival (G3)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    limits: ModelLimits
    grammar: GrammarSpec | None = None
    early_stop: EarlyStopPolicy | None = None
    deadline_s: float | None = None
    backpressure: BackpressureConfig | None = None
    speculative: bool = True  # issue 21: may this request speculate (if the server does)
    prompt_logprobs: int | None = None  # score each prompt token, k alternatives (echo)
    prediction: tuple[int, ...] | None = None  # a chat prediction's ids (coda.engine.prediction)
    start_at_admission: bool = False  # P1: the start event once admitted (GenerationRequest)
    # NOTE: prompt plus budget, the sequence's bound in the KV cache: derived once here (a
    # value, not a property the engine calls back into the plan for, issue 22)
    max_total_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_total_tokens",
                           len(self.prompt_token_ids) + self.max_tokens)

    @property
    def logprobs(self) -> bool:
        return self.sampling.logprobs is not None

    @property
    def closes_within_budget(self) -> bool:
        """Issue 13: steer a grammar to close within the budget (coda.engine.closure)."""
        return self.grammar is not None and self.grammar.closes_within_budget

    def require_budget(self, tokens: int, what: str) -> None:
        """The budget's one check for what is known only after planning (a compiled
        grammar's shortest completion, issue 13): InvalidRequestError naming max_tokens when
        ``tokens`` exceed it, or the prompt where no limit came before the context."""
        if tokens <= self.max_tokens:
            return
        if self.budget_end is FinishReason.CONTEXT_LIMIT:  # NOTE: no max_tokens was sent
            raise ContextLengthExceededError(
                f"the prompt has {len(self.prompt_token_ids)} tokens; this model's context is "
                f"{self.limits.context_length} tokens: {self.max_tokens} left, too few for "
                f"{what} {tokens} tokens", field="prompt")
        raise InvalidRequestError(
            f"max_tokens ({self.max_tokens}) is too small for {what} {tokens} tokens",
            field="max_tokens")



def check_stop_strings(stop: Sequence[str], max_strings: int = ModelLimits.max_stop_strings,
                       max_bytes: int = ModelLimits.max_stop_string_bytes) -> None:
    """The stop strings' own rules (S1), which need no model: a sequence (not one string) of
    at most ``max_strings`` strings of 1..``max_bytes`` UTF-8 bytes each (a model's
    :class:`ModelLimits`); ``coda generate`` checks ``--stop`` by it before the model loads."""
    if isinstance(stop, str):  # NOTE: a bare string would be read as one stop per character
        raise InvalidRequestError("stop must be a sequence of strings, not one string",
                                  field="stop")
    if len(stop) > max_strings:
        raise InvalidRequestError(f"at most {max_strings} stop strings", field="stop")
    for s in stop:
        if len(stop_bytes(s)) > max_bytes:  # NOTE: typed error on bad text
            raise InvalidRequestError(f"each stop string must be 1..{max_bytes} bytes",
                                      field="stop")


def plan_request(req: GenerationRequest, limits: ModelLimits) -> RequestPlan:
    """Check ``req`` against ``limits`` and fix its plan; raises InvalidRequestError /
    ContextLengthExceededError (naming the engine's field) on the first bad field."""
    if not isinstance(req.sampling, SamplingParams):
        raise InvalidRequestError("sampling must be a SamplingParams", field="sampling")
    vocab = limits.vocab_size
    prompt = _prompt_ids(req.prompt_token_ids, vocab)
    max_tokens, context_bound = _budget(req, limits, len(prompt))
    check_stop_strings(req.stop, limits.max_stop_strings, limits.max_stop_string_bytes)
    stop_ids = tuple(tuple(s) for s in req.stop_token_ids)
    for ids in stop_ids:
        if not ids or any(not _is_int(t) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError("stop_token_ids must be non-empty sequences of valid ids",
                                      field="stop_token_ids")
    if req.sampling.logit_bias:  # NOTE: issue 22: no bias, nothing to check against the vocab
        req.sampling.validate_for_vocab(vocab)
    if req.prompt_logprobs is not None and (
            isinstance(req.prompt_logprobs, bool)
            or not 0 <= req.prompt_logprobs <= MAX_LOGPROBS):
        raise InvalidRequestError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}]",
                                  field="prompt_logprobs")
    if req.utf8_tail not in UTF8_TAIL_POLICIES:
        raise InvalidRequestError(f"utf8_tail must be one of {list(UTF8_TAIL_POLICIES)}",
                                  field="utf8_tail")
    if req.deadline_s is not None and (isinstance(req.deadline_s, bool)
                                       or not isinstance(req.deadline_s, Real)
                                       or not req.deadline_s > 0):
        raise InvalidRequestError("deadline must be > 0 seconds", field="deadline")
    _check_reasoning(req, limits)
    if req.prediction is not None and not all(
            _is_int(t) and 0 <= t < limits.vocab_size for t in req.prediction):
        raise InvalidRequestError(f"prediction: token ids must be integers in [0, "
                                  f"{limits.vocab_size})", field="prediction")
    seed = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(63)
    # NOTE: L4: with the context as the limit, reaching it is context_limit, not
    # max_output_tokens; the budget never passes the context, so the per-token checks need
    # the one number and the reason it ends with (G1's context check is reached no earlier)
    return RequestPlan(
        max_tokens=max_tokens,
        budget_end=FinishReason.CONTEXT_LIMIT if context_bound else FinishReason.MAX_OUTPUT_TOKENS,
        eos_token_ids=limits.eos_token_ids,
        ignore_eos=req.sampling.ignore_eos, stop_strings=tuple(req.stop),
        stop_token_ids=stop_ids, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, utf8_tail=req.utf8_tail,
        stops_end_at=(req.stops_end_at or "").encode(), min_tokens=req.sampling.min_tokens,
        reasoning=req.reasoning,
        request_id=req.request_id or f"req-{uuid.uuid4().hex[:16]}",
        prompt_token_ids=prompt, sampling=req.sampling, seed=seed,
        limits=limits, grammar=req.grammar, early_stop=req.early_stop,
        deadline_s=req.deadline_s, backpressure=req.backpressure,
        speculative=req.speculative, prompt_logprobs=req.prompt_logprobs,
        prediction=None if req.prediction is None else tuple(req.prediction),
        start_at_admission=req.start_at_admission)


def _is_int(x: object) -> bool:
    """An integer count or id: Python's or numpy's ints, never a bool, a float or a string."""
    # NOTE: the exact-type test first: a long prompt runs this once per id
    return type(x) is int or (isinstance(x, Integral) and not isinstance(x, bool))


def _prompt_ids(ids: object, vocab: int) -> tuple[int, ...]:
    """The prompt as a tuple of ids in the vocabulary (L5); text, a non-sequence, an empty
    prompt or a non-integer id is refused naming ``prompt`` (the Python API takes token ids:
    ``engine.tokenizer.encode(text).ids``), never a TypeError."""
    if isinstance(ids, (str, bytes)):
        raise InvalidRequestError("the prompt must be token ids, not text (encode it with "
                                  "engine.tokenizer)", field="prompt")
    try:
        prompt: tuple[int, ...] = tuple(ids)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRequestError("the prompt must be a sequence of token ids",
                                  field="prompt") from None
    if not prompt:
        raise InvalidRequestError("the prompt is empty", field="prompt")
    if any(not _is_int(t) or not 0 <= t < vocab for t in prompt):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})",
                                  field="prompt")
    return prompt


def _check_reasoning(req: GenerationRequest, limits: ModelLimits) -> None:
    """Issue 23: a reasoning budget is a count >= 0 and its closer ids are in the vocabulary."""
    r = req.reasoning
    if r is None:
        return
    if r.budget_tokens is not None and (isinstance(r.budget_tokens, bool)
                                        or r.budget_tokens < 0):
        raise InvalidRequestError("max_reasoning_tokens must be an integer >= 0",
                                  field="max_reasoning_tokens")
    if r.budget_tokens is not None and not r.close_ids:
        raise InvalidRequestError("this model has no reasoning closer to force",
                                  field="max_reasoning_tokens")
    if any(not 0 <= t < limits.vocab_size for t in r.close_ids):
        raise InvalidRequestError("reasoning closer ids are outside the vocabulary",
                                  field="max_reasoning_tokens")


def _budget(req: GenerationRequest, limits: ModelLimits, prompt_len: int) -> tuple[int, bool]:
    """The one check and derivation of the token budget: ``(max_tokens, context_bound)``."""
    room = limits.context_length - prompt_len
    asked = req.max_tokens
    check_prompt_room(prompt_len, limits.context_length, asked)
    if _is_int(asked) and asked == NO_LIMIT:
        return room, True  # NOTE: no limit but the context: it ends context_limit (L4)
    if asked is None:
        default = limits.default_max_tokens
        # NOTE: an omitted limit is the default; where the context comes first there is no
        # limit but the context, so the request ends context_limit (L4)
        return (default, False) if default is not None and 1 <= default < room else (room, True)
    if not _is_int(asked) or asked < 0:
        # NOTE: 0 prefills only (prompt scoring): the request ends max_output_tokens, no token
        raise InvalidRequestError("max_tokens must be an integer >= 0", field="max_tokens")
    if not fits_context(prompt_len, asked, limits.context_length):
        raise ContextLengthExceededError(
            f"prompt ({prompt_len}) + max_tokens ({asked}) exceeds the context "
            f"({limits.context_length})", field="max_tokens")
    if req.sampling.min_tokens > asked:
        # NOTE: as vLLM: an asked budget below the asked minimum can honour neither
        raise InvalidRequestError(f"min_tokens ({req.sampling.min_tokens}) must not exceed "
                                  f"max_tokens ({asked})", field="min_tokens")
    return asked, False


def check_prompt_room(prompt_len: int, context_length: int, asked: object = None) -> None:
    """The prompt alone leaves room for an output token (all the context for a scoring request,
    ``max_tokens: 0``), else ContextLengthExceededError naming ``prompt``: the plan's check,
    and the token-count routes' (a count of a prompt no create would take is that 400)."""
    if prompt_len > context_length or (prompt_len == context_length and not _scores_only(asked)):
        raise ContextLengthExceededError(
            f"the prompt has {prompt_len} tokens; this model's context is "
            f"{context_length} tokens", field="prompt")


def _scores_only(asked: object) -> bool:
    """``max_tokens: 0``: the request prefills and scores its prompt, no token is generated, so
    a prompt may fill the whole context (as vLLM admits one of ``max_model_len`` tokens)."""
    # NOTE: lm-eval's loglikelihood requests fill the context exactly with echo + max_tokens 0
    return _is_int(asked) and asked == 0


def fits_context(prompt_len: int, asked: int | None, context_length: int) -> bool:
    """Whether :func:`_budget` admits a prompt of ``prompt_len`` tokens with the ``asked``
    budget (None: omitted) against ``context_length``: room left after the prompt, and an asked
    budget within it. :func:`_budget` refuses by it, and Responses ``truncation: "auto"`` cuts
    the input by it (coda.server.responses_fit), so a cut prompt is one the plan admits."""
    room = context_length - prompt_len
    if _scores_only(asked):
        return room >= 0
    # NOTE: a budget that is no integer is refused by _budget for itself; it needs no cut
    return room > 0 and (asked is None or not _is_int(asked) or asked <= room)


def claimed_tokens(req: GenerationRequest, default_max_tokens: int) -> int:
    """What an unplanned request may cost in output tokens, for a router's load estimate
    (coda.scaleout.remote): the asked budget, else the default (the replica plans it; no
    limit, :data:`NO_LIMIT`, is claimed as the default too: the room is the replica's to know)."""
    asked = req.max_tokens
    return default_max_tokens if asked is None or asked == NO_LIMIT else asked


def check_embedding_input(token_ids: list[int], context_length: int,
                          vocab_size: int | None = None) -> None:
    """An embedding's input (``/api/embed``, ``/v1/embeddings``): at least one token, no more
    than the context (else ContextLengthExceededError), every id in the vocabulary (when
    known here). InvalidRequestError, field ``input``, otherwise."""
    if not token_ids:
        raise InvalidRequestError("input: must not be empty", field="input")
    if len(token_ids) > context_length:  # NOTE: P1: the code a chat prompt's overflow has
        raise ContextLengthExceededError(f"input: {len(token_ids)} tokens exceed the model's "
                                         f"context of {context_length} tokens", field="input")
    if vocab_size is not None and not all(0 <= t < vocab_size for t in token_ids):
        raise InvalidRequestError("input: token id out of the vocabulary", field="input")

