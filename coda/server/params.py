"""Protocol parameters → one call's record, :class:`~coda.server.records.Record` (issue 4 item 3,
issue 22).

One place turns every endpoint's knobs (and the Coda extensions) into engine requests, so a
parameter means the same thing everywhere. An adapter's parse calls here once, at its end:
:func:`plan_call` takes the protocol's resolved values as keywords (no intermediate object)
and hands on the call's one :class:`~coda.server.records.Record`, not yet submitted (the
engine requests, the error renames, the render spec: no second holder of the call); the
create handler (:mod:`coda.server.common`) only submits it and
never calls back. Errors are raised as :class:`~coda.errors.InvalidRequestError` naming the
protocol's field; ``Record.rename`` tells the create handler how to rename the engine's own
field names in errors raised later by ``submit``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from coda.early_stop import EarlyStopPolicy, sent_keys
from coda.engine.types import GenerationRequest, GrammarSpec
from coda.errors import InvalidRequestError
from coda.reasoning import ReasoningSpec
from coda.sampling import SamplingParams, normalise_logit_bias
from coda.server.http_errors import wire_words
from coda.server.records import DisconnectPolicy, Record
from coda.server.render_spec import RecordKind, RenderSpec
from coda.server.schemas import CodaExtensions, ResponseFormat
from coda.server.strict_schema import check_strict_format
from coda.stops import stop_bytes
from coda.stream_backpressure import BackpressureConfig, BackpressurePolicy


def grammar_from_format(fmt: ResponseFormat | None, field: str = "response_format"
                        ) -> GrammarSpec | None:
    """OpenAI ``response_format`` (plus Coda's regex / lark) → :class:`GrammarSpec`."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec(json_object=True)
    if fmt.type == "json_schema":
        spec = fmt.json_schema or {}
        schema = spec.get("schema", spec if "type" in spec or "properties" in spec else None)
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{field}.json_schema.schema must be a JSON schema object",
                                      field=f"{field}.json_schema")
        return GrammarSpec(json_schema=schema)
    if fmt.type == "regex":
        if not fmt.regex:
            raise InvalidRequestError(f"{field}.regex is required", field=f"{field}.regex")
        return GrammarSpec(regex=fmt.regex)
    if not fmt.lark:
        raise InvalidRequestError(f"{field}.lark is required", field=f"{field}.lark")
    return GrammarSpec(lark=fmt.lark)


# NOTE: OpenAI's top_p is in [0, 1]; 0 keeps the best token alone (the nucleus of the least
# mass: the sampler always keeps the best). The sampler takes (0, 1], so 0 is sent as a mass
# no single token's probability reaches (every vocabulary's best token has more than 1e-9)
NUCLEUS_OF_ONE = 1e-9


def sampled_top_p(top_p: float | None) -> float | None:
    """The wire's ``top_p`` as the sampler takes it (P1: OpenAI accepts 0)."""
    return NUCLEUS_OF_ONE if top_p == 0 else top_p


_FORMAT_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


_FORMAT_KEYS = frozenset({"name", "schema", "strict", "description"})


def check_json_schema_format(spec: Mapping[str, object], field: str,
                             also: frozenset[str] = frozenset()) -> None:
    """OpenAI's ``json_schema`` format object (chat ``response_format.json_schema``, Responses
    ``text.format`` — ``also`` its own ``type``), checked as OpenAI checks it (P1): ``name``
    required, 1 to 64 letters, digits, ``_`` or ``-``; ``strict`` a boolean and
    ``description`` a string when sent; no other key (where ``schema`` is sent). Else a 400
    naming ``field.<key>``. Coda's ``response_format`` extension on the other protocols does
    not ask for a name."""
    name = spec.get("name")
    if name is None:
        raise InvalidRequestError(f"Missing required parameter: '{field}.name'.",
                                  field=f"{field}.name")
    if not isinstance(name, str) or not _FORMAT_NAME.match(name):
        raise InvalidRequestError(
            f"Invalid '{field}.name': expected a string of 1 to 64 characters matching the "
            f"pattern '^[a-zA-Z0-9_-]+$', got {name!r}.", field=f"{field}.name")
    for key, kind, said in (("strict", bool, "a boolean"), ("description", str, "a string")):
        value = spec.get(key)
        if value is not None and not isinstance(value, kind):
            raise InvalidRequestError(f"Invalid type for '{field}.{key}': expected {said}, "
                                      f"got {type(value).__name__}.", field=f"{field}.{key}")
    # NOTE: without ``schema`` the object is read as the schema itself (grammar_from_format)
    unknown = sorted(set(spec) - _FORMAT_KEYS - also) if "schema" in spec else []
    if unknown:
        raise InvalidRequestError(f"Unrecognized request argument supplied: {field}.{unknown[0]}",
                                  field=f"{field}.{unknown[0]}")
    # NOTE: ``strict: true``: OpenAI's Structured Outputs rules, a 400 where they are broken
    schema = spec.get("schema", spec if "type" in spec or "properties" in spec else None)
    check_strict_format(spec, schema, "response_format" if field.startswith("response_format")
                        else f"{field}.schema")


def _stops(stop: str | Sequence[str] | None, field: str) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in items:
        if not s:
            raise InvalidRequestError(f"{field}: a stop string must not be empty", field=field)
        stop_bytes(s, field)  # NOTE: a lone surrogate is a 400 naming the field (S1)
    return items


def _stop_ids(raw: Sequence[int | Sequence[int]] | None) -> tuple[tuple[int, ...], ...]:
    if not raw:
        return ()
    return tuple((s,) if isinstance(s, int) else tuple(s) for s in raw)


def _backpressure(ext: CodaExtensions, default: BackpressureConfig | None
                  ) -> BackpressureConfig | None:
    if ext.backpressure is None:
        return default
    b = ext.backpressure
    try:
        return BackpressureConfig(BackpressurePolicy(b.policy), b.pause_bytes, b.max_bytes)
    except ValueError as exc:
        raise InvalidRequestError(f"backpressure: {exc}", field="backpressure") from None


def _early_stop(raw: dict[str, Any] | None) -> EarlyStopPolicy | None:
    if raw is None:
        return None
    try:
        return EarlyStopPolicy.from_dict(raw)
    except InvalidRequestError as exc:
        # NOTE: every policy key the message names as the client sent it, under early_stop
        # (``early_stop.minTokens must not exceed early_stop.maxTokens``): the errors' one
        # engine-to-wire renaming
        rename = {k: f"early_stop.{sent}" for k, sent in sent_keys(raw).items()}
        field = exc.field or "early_stop"
        name = "early_stop" if field == "early_stop" else rename.get(field, f"early_stop.{field}")
        raise InvalidRequestError(wire_words(exc.message.removeprefix("early_stop: "), rename),
                                  field=name) from None


def plan_call(ext: CodaExtensions, prompts: Sequence[Sequence[int]], spec: RenderSpec, *,
              call_id: str, kind: RecordKind, model: str, backpressure: BackpressureConfig | None, stream: bool,
              max_tokens: int | None | Sequence[int | None], max_tokens_field: str,
              prompt_field: str,
              stop: str | Sequence[str] | None = None, stop_field: str = "stop", n: int = 1,
              seed: int | None = None, temperature: float | None = None,
              top_p: float | None = None, presence_penalty: float | None = None,
              frequency_penalty: float | None = None,
              logit_bias: dict[str, float] | None = None, logprobs: int | None = None,
              logprobs_field: str = "logprobs", grammar: GrammarSpec | None = None,
              stops_end_at: str | None = None, reasoning: ReasoningSpec | None = None,
              on_disconnect: DisconnectPolicy | None = None, background: bool = False,
              keep: bool = True, grammar_field: str = "response_format",
              prediction: tuple[int, ...] | None = None) -> Record:
    """The last step of every adapter's parse, its one call here: n engine requests per prompt
    (ids ``call_id``, ``call_id-p<k>`` for several prompts, then ``-<i>`` per choice) and the
    renames, in the call's record (its handles empty until submitted). Raises InvalidRequestError naming the protocol's
    field; nothing is submitted.

    The keywords are the protocol's values once its own spelling is resolved (what no
    :class:`CodaExtensions` field holds): ``max_tokens`` is the token budget under its one
    internal name, whatever the wire called it, and ``max_tokens_field`` that wire name
    (errors about the budget name it; a sequence: one budget per prompt, as legacy
    completions resolve an omitted one); likewise ``prompt_field``, ``stop_field`` and
    ``logprobs_field``. ``grammar`` and ``stops_end_at`` come from a tool plan
    (:func:`coda.server.tools.knob_fields`), ``reasoning`` from
    :func:`coda.reasoning.reasoning_spec` (issue 23); ``grammar_field`` is the wire field the
    grammar came from (Ollama ``format``), named by a grammar the engine cannot compile;
    ``prediction``: a chat prediction's token ids (:mod:`coda.server.prediction`)."""
    stops = _stops(stop, stop_field)
    early = _early_stop(ext.early_stop)
    backpressure_cfg = _backpressure(ext, backpressure)
    if grammar is None:
        grammar = grammar_from_format(ext.response_format)
    if grammar is not None and ext.close_within_budget is not None:
        grammar = replace(grammar, close_within_budget=ext.close_within_budget)
    samplings = []
    for i in range(n):  # NOTE: choice i gets seed ``seed + i`` (issue 4)
        try:
            samplings.append(SamplingParams(
                temperature=1.0 if temperature is None else temperature,
                top_p=1.0 if top_p is None else top_p,
                top_k=0 if ext.top_k is None else ext.top_k,
                min_p=0.0 if ext.min_p is None else ext.min_p,
                repetition_penalty=(1.0 if ext.repetition_penalty is None
                                    else ext.repetition_penalty),
                presence_penalty=presence_penalty or 0.0,
                frequency_penalty=frequency_penalty or 0.0,
                logit_bias=normalise_logit_bias(logit_bias or ()), seed=None if seed is None else seed + i,
                min_tokens=ext.min_tokens, ignore_eos=ext.ignore_eos, logprobs=logprobs))
        except InvalidRequestError as exc:
            field = logprobs_field if exc.field == "logprobs" else exc.field
            raise InvalidRequestError(exc.message, field=field) from None
    requests: list[GenerationRequest] = []
    for k, ids in enumerate(prompts):
        rid = call_id if len(prompts) == 1 else f"{call_id}-p{k}"
        # NOTE: the budget travels as max_tokens (None when omitted): the plan checks it
        requests += [GenerationRequest(
            prompt_token_ids=tuple(ids), sampling=sampling,
            max_tokens=max_tokens[k] if isinstance(max_tokens, Sequence) else max_tokens,
            stop=stops, stop_token_ids=_stop_ids(ext.stop_token_ids),
            include_stop_str_in_output=ext.include_stop_str_in_output,
            skip_special_tokens=ext.skip_special_tokens, deadline_s=ext.deadline,
            early_stop=early, grammar=grammar, backpressure=backpressure_cfg,
            utf8_tail=ext.utf8_tail, request_id=rid if n == 1 else f"{rid}-{i}",
            stops_end_at=stops_end_at, reasoning=reasoning, speculative=ext.speculative,
            prediction=prediction,
            # NOTE: P1: a background response's log says when it leaves the queue
            start_at_admission=background)
            for i, sampling in enumerate(samplings)]
    # NOTE: engine field names → this protocol's, for errors raised later by ``submit``
    rename = {"prompt": prompt_field, "max_tokens": max_tokens_field, "deadline_s": "deadline",
              "stop": stop_field, "logprobs": logprobs_field,
              "response_format": grammar_field}
    return Record(call_id, kind, [], int(time.time()), model, spec, background,
                  requests=tuple(requests), rename=rename, stream=stream,
                  prompt_of=tuple(k for k in range(len(prompts)) for _ in range(n))
                  if len(prompts) > 1 else (),
                  on_disconnect=on_disconnect, keep=keep)
