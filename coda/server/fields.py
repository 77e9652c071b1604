"""Protocol fields whose upstream meaning has no effect on a local server, or only part of one
(issue 14 item 5, the API-gaps issue item 1). One home for what each does here:

- refused with a 400 naming the field where the value asks for something Coda does not do
  (``modalities`` with ``"audio"``), or breaks OpenAI's
  bounds on an informational field (``metadata``: 16 pairs, keys <= 64, values <= 512);
- refused with a 400 naming the field and saying what to do instead where the field itself
  asks for what only OpenAI's servers do (:data:`UNOFFERED`: chat ``audio`` output and
  ``web_search_options``, Responses ``conversation`` and stored ``prompt`` templates), not as
  an unknown argument;
- accepted with no effect where nothing local corresponds: ``prompt_cache_key``,
  ``safety_identifier`` (prefix caching is automatic; there is no abuse monitoring),
  ``stream_options.include_obfuscation`` (chat, completions, Responses: OpenAI pads its
  deltas with a random ``obfuscation`` field against network side channels that infer
  tokens from frame sizes; Coda's frames carry no padding either way, so a replay stays
  byte-identical, P3), and
  ``service_tier``, answered ``"default"`` in the response as OpenAI answers the tier it
  actually used (one local tier);
- ``reasoning_effort`` (chat) / ``reasoning.effort`` (Responses) mapped onto the reasoning
  budget (``max_reasoning_tokens``, SPEC-side :mod:`coda.reasoning`) on a model with reasoning
  markers, accepted and ignored on any other model (it has no reasoning to bound).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coda.errors import InvalidRequestError
from coda.reasoning import marker_ids
from coda.server.protocol_schemas import ResponsesRequest

# NOTE: effort -> reasoning tokens before the closer is forced (None: no budget but max_tokens).
# Monotone; "none" asks for no reasoning, so the closer is forced at once.
EFFORT_BUDGET: dict[str, int | None] = {"none": 0, "minimal": 128, "low": 512,
                                        "medium": 2048, "high": 8192, "xhigh": 32768,
                                        "max": None}
SERVED_TIER = "default"  # NOTE: the tier every request is served in (one local tier)
# NOTE: OpenAI request fields (chat, Responses) for what only OpenAI's servers do: a 400
# naming the field in these words (coda.server.http_errors), not "Unrecognized request
# argument", which reads as a typo or an old server
UNOFFERED: dict[str, str] = {
    "audio": "audio output is not supported (the served model writes text only); omit "
             "audio and modalities, or use modalities [\"text\"]",
    "web_search_options": "web search is not offered by this server; omit it (run a search "
                          "from the client and declare it as a function tool)",
    "conversation": "the Conversations API is not offered by this server; continue a "
                    "conversation with previous_response_id, or send the whole input",
    "prompt": "stored prompt templates are not offered by this server; send the prompt as "
              "input (and instructions)",
}


def reject_unhonoured(body: ResponsesRequest) -> None:
    """Responses: ``stream_options`` without ``stream`` and ``background`` without ``store`` (a
    background response is only reachable by fetching it, as OpenAI requires). ``truncation``
    is honoured either way (``"auto"``: coda.server.responses_fit)."""
    if body.stream_options is not None and not body.stream:
        # NOTE: as OpenAI (and chat's stream_options): options for a stream need a stream
        raise InvalidRequestError("stream_options: only allowed when stream is true",
                                  field="stream_options")
    if body.background and not body.store:
        raise InvalidRequestError("background: background responses require store=true",
                                  field="background")


# NOTE: OpenAI's bounds on ``metadata`` (chat and Responses): 16 pairs, keys up to 64
# characters, values up to 512
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def check_metadata(metadata: Mapping[str, str] | None) -> None:
    """``metadata`` within OpenAI's bounds (P1: a 400 naming the field, as OpenAI's; it was
    stored and echoed whatever its size)."""
    if not metadata:
        return
    if len(metadata) > METADATA_PAIRS:
        raise InvalidRequestError(
            f"metadata: too many properties: at most {METADATA_PAIRS} key-value pairs, got "
            f"{len(metadata)}", field="metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise InvalidRequestError(
                f"metadata: key {key[:METADATA_KEY_CHARS]!r}... too long: at most "
                f"{METADATA_KEY_CHARS} characters, got {len(key)}", field="metadata")
        if len(value) > METADATA_VALUE_CHARS:
            raise InvalidRequestError(
                f"metadata.{key}: string too long: at most {METADATA_VALUE_CHARS} characters, "
                f"got {len(value)}", field=f"metadata.{key}")


def check_modalities(modalities: Sequence[str] | None) -> None:
    """Chat ``modalities``: text is what every Coda model writes; audio output is a 400."""
    if modalities is not None and "audio" in modalities:
        raise InvalidRequestError(
            "modalities: audio output is not supported (the served model writes text only); "
            "use [\"text\"] or omit modalities", field="modalities")


def served_tier(asked: str | None) -> str | None:
    """The ``service_tier`` the response reports: ``"default"`` when the request named one
    (whatever it named), nothing otherwise (OpenAI reports it when the parameter is set)."""
    return SERVED_TIER if asked is not None else None


def effort_budget(tokenizer: Any, effort: str | None, explicit: int | None) -> int | None:
    """The reasoning budget of a request: ``explicit`` (``max_reasoning_tokens``) when given,
    else ``effort`` mapped by :data:`EFFORT_BUDGET` on a model with reasoning markers (a
    grammar too: it constrains the answer only), else None (effort ignored)."""
    if explicit is not None or effort is None:
        return explicit
    if marker_ids(tokenizer) is None:
        return None  # NOTE: accepted and ignored: nothing to bound (docs/api.md)
    return EFFORT_BUDGET[effort]


def responses_effort(reasoning: dict[str, Any] | None) -> str | None:
    """Responses ``reasoning.effort`` (checked against OpenAI's values), or None."""
    effort = (reasoning or {}).get("effort")
    if effort is None:
        return None
    if not isinstance(effort, str) or effort not in EFFORT_BUDGET:
        raise InvalidRequestError(
            f"reasoning.effort: must be one of {sorted(EFFORT_BUDGET)}, got {effort!r}",
            field="reasoning.effort")
    return effort
