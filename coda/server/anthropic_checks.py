"""Anthropic's own checks on ``thinking`` (SPEC P1: refused as the real API refuses them, a 400
``invalid_request_error`` naming the field), on ``/v1/messages`` and its ``count_tokens``.

- The request's ``thinking``: ``type`` is ``enabled``, ``adaptive`` (no budget: the model
  decides), ``disabled`` or ``between_tools`` (thinking off; the progress notes a model writes
  between tool calls would come back as thinking blocks: Coda's models write none, so it is
  ``disabled`` here); ``enabled`` needs
  ``budget_tokens`` (unless Coda's ``max_reasoning_tokens`` gives the budget), an integer
  ``>= 1024`` and, on a create, ``< max_tokens`` (Anthropic's two bounds).
- ``thinking.display`` (``enabled`` / ``adaptive``): ``summarized`` (the default: the
  reasoning is shown) or ``omitted`` (each thinking block is still sent, with its signature,
  but its ``thinking`` text is empty); another value, or a key the type does not take, is a 400
  naming it (``thinking.display``, ``thinking.KEY``) as Anthropic's validation does.
- A ``system`` list holds text blocks, each with its ``text`` string, not empty.
- A ``thinking`` block sent back in the history carries its ``thinking`` and ``signature``
  strings, a ``redacted_thinking`` block its ``data`` string: a malformed one was dropped
  without a word (the model's reasoning is never prompt text, so nothing showed it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coda.errors import InvalidRequestError

# NOTE: Anthropic's floor for thinking.budget_tokens (its extended-thinking docs)
MIN_THINKING_BUDGET = 1024
_DISPLAYS = ("summarized", "omitted")
# NOTE: the keys each thinking type takes (the SDK's ThinkingConfig*Param)
_THINKING_KEYS = {"enabled": {"type", "budget_tokens", "display"},
                  "adaptive": {"type", "display"}, "disabled": {"type"},
                  "between_tools": {"type"}}
# NOTE: the types that turn thinking off (the reasoning is dropped, not shown)
THINKING_OFF = frozenset({"disabled", "between_tools"})
_BLOCK_FIELDS = {"thinking": ("thinking", "signature"), "redacted_thinking": ("data",)}


def _bad(field: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {what}", field=field)


def thinking_budget(thinking: dict[str, Any] | None, fallback: int | None,
                    max_tokens: int | None = None) -> tuple[str | None, int | None]:
    """``thinking``'s (type, budget), checked as Anthropic checks it (module doc). ``fallback``
    is Coda's ``max_reasoning_tokens`` (its own bound, ``>= 0``); ``max_tokens`` None (token
    counting) skips the bound that needs it."""
    t = thinking or {}
    kind = t.get("type")
    # NOTE: "adaptive" (the SDK's ThinkingConfigAdaptiveParam: the model decides when and how
    # much to think) is what a reasoning model does here without a budget: shown, no budget
    # NOTE: a type that is no string (an object, a list) is refused too: hashing one for the
    # lookup was a TypeError, a 500
    if kind is not None and (not isinstance(kind, str) or kind not in _THINKING_KEYS):
        raise _bad("thinking.type", "must be 'enabled', 'adaptive', 'disabled' or "
                                    "'between_tools'")
    extra = sorted(set(t) - _THINKING_KEYS.get(str(kind), _THINKING_KEYS["enabled"]))
    if extra:
        raise _bad(f"thinking.{extra[0]}", "Extra inputs are not permitted"
                   + (f" (thinking.type {kind!r} takes none)" if kind in THINKING_OFF
                      else ""))
    if t.get("display") not in (None, *_DISPLAYS):
        raise _bad("thinking.display", f"Input should be 'summarized' or 'omitted' (got "
                                       f"{t.get('display')!r})")
    budget = t.get("budget_tokens") if kind == "enabled" else None
    if kind == "enabled" and budget is None and fallback is None:
        raise _bad("thinking.budget_tokens", "Field required when thinking.type is 'enabled'")
    if budget is None:
        return kind, fallback
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise _bad("thinking.budget_tokens", "must be an integer")
    if budget < MIN_THINKING_BUDGET:
        raise _bad("thinking.budget_tokens",
                   f"Input should be greater than or equal to {MIN_THINKING_BUDGET}, got {budget}")
    if max_tokens is not None and budget >= max_tokens:
        raise _bad("thinking.budget_tokens", f"must be less than max_tokens ({budget} >= "
                                             f"{max_tokens}): max_tokens must be greater than "
                                             "thinking.budget_tokens")
    return kind, budget


def thinking_omitted(thinking: dict[str, Any] | None) -> bool:
    """``thinking.display`` is ``omitted``: thinking blocks keep their place and signature, with
    empty text (checked by :func:`thinking_budget`)."""
    return thinking is not None and thinking.get("display") == "omitted"


def check_system_blocks(system: list[Any]) -> None:
    """A ``system`` list holds text blocks only, each with its ``text`` string (a 400 naming
    ``system.{j}.type`` / ``system.{j}.text``, Anthropic's paths; it named
    ``system.content.{j}``, a path the request does not have, and said "got 'text'" of a
    text block without its text)."""
    for j, block in enumerate(system):
        if not isinstance(block, Mapping):
            raise _bad(f"system.{j}", "a system block must be an object")
        if block.get("type") != "text":
            raise _bad(f"system.{j}.type",
                       f"Input should be 'text' (got {block.get('type')!r}): the system "
                       "prompt takes text blocks only")
        text = block.get("text")
        if not isinstance(text, str):
            raise _bad(f"system.{j}.text", "Field required" if text is None
                       else "Input should be a valid string")
        if not text:  # NOTE: Anthropic's 400 (it was an empty system turn, or none at all)
            raise _bad(f"system.{j}.text", "text content blocks must be non-empty")


def check_thinking_blocks(content: Any, field: str) -> None:
    """Every ``thinking`` / ``redacted_thinking`` block of a message's ``content`` has its
    string fields (module doc); ``field`` is the message's path (``messages.1``)."""
    if isinstance(content, str):
        return
    for j, block in enumerate(content):
        if not isinstance(block, Mapping):
            continue  # NOTE: refused with its own 400 by the block checks that follow
        for name in _BLOCK_FIELDS.get(str(block.get("type")), ()):
            value, where = block.get(name), f"{field}.content.{j}.{name}"
            if value is None:
                raise _bad(where, f"Field required in a {block['type']} block")
            if not isinstance(value, str):
                raise _bad(where, "Input should be a valid string")
