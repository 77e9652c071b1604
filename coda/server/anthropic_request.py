"""Anthropic Messages request fields read as the real API reads them (SPEC P1):

- Consecutive messages of one role are one turn: Anthropic combines them (two user messages
  in a row are one user turn holding both contents, in order), so the prompt is what that
  single combined turn renders (:func:`merge_turns`).
- ``output_config``: ``format`` ``{"type": "json_schema", "schema": {...}}`` constrains the
  output to the schema through the same plan field as OpenAI's ``response_format``
  (:func:`output_grammar`); ``effort`` is accepted (no effect on a model without reasoning).
  The older top-level ``output_format`` (the structured-outputs beta; today's SDK sends it as
  ``output_config.format``) is read the same way. Another key is a 400 naming its path.
- A server tool (``web_search_20250305``, ``code_execution_*``, …: a tool with a ``type``
  other than ``custom``) is run by Anthropic's own servers; this server offers none, and says
  so (:func:`check_server_tools`) rather than asking for the custom tool's ``input_schema``.
- ``tool_choice`` takes the keys of its type (``auto`` / ``any``: ``disable_parallel_tool_use``,
  a boolean; ``tool``: ``name`` too; ``none``: none): another key, or a non-boolean
  ``disable_parallel_tool_use``, is a 400 naming it (:func:`check_tool_choice`; both were
  accepted, "yes" read as true).
- ``container``, ``context_management`` and ``mcp_servers`` ask for what only Anthropic's
  servers do (a code-execution container, server-side context editing, the MCP connector):
  set (not null, not an empty list), each is a 400 naming it and saying what to do instead
  (:func:`check_unserved`).
- ``thread`` (a message thread: Anthropic holds the conversation under a reply's id) is the
  same 400, with ``error.details`` ``{"error_code": "thread_unsupported_request",
  "unsupported": ["thread"]}``: what the SDK reads as "this server cannot thread", so its tool
  runner (which opens a thread on its first turn) sends every turn unthreaded, with the full
  history. Before, "thread: Extra inputs are not permitted" stopped the runner at once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coda.engine.types import GrammarSpec
from coda.errors import InvalidRequestError
from coda.server.http_errors import ApiError
from coda.server.params import grammar_from_format
from coda.server.schemas import ResponseFormat
from coda.server.tool_results import check_anthropic_results

# NOTE: Anthropic's effort levels (the SDK's OutputConfigParam)
EFFORTS = frozenset({"low", "medium", "high", "xhigh", "max"})
_CONFIG_KEYS = frozenset({"format", "effort"})
_FORMAT_KEYS = frozenset({"type", "schema"})


def _bad(field: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {what}", field=field)


@dataclass(frozen=True)
class Turn:
    """One turn after merging: its role, its content (a string when it is one message of
    string content, else the blocks of every message in order), the index of its first
    message in the request, and where each block came from (message index, block index)."""

    role: str
    content: str | list[dict[str, Any]]
    first: int
    merged: bool = False
    origins: tuple[tuple[int, int], ...] = ()


def _blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _origins(i: int, content: str | list[dict[str, Any]]) -> tuple[tuple[int, int], ...]:
    return ((i, 0),) if isinstance(content, str) else tuple((i, j) for j in range(len(content)))


def merge_turns(messages: Sequence[Any]) -> list[Turn]:
    """Consecutive messages of the same role as one turn, their blocks in order (a string
    content is one text block)."""
    turns: list[Turn] = []
    for i, m in enumerate(messages):
        if turns and turns[-1].role == m.role:
            last = turns[-1]
            turns[-1] = Turn(last.role, _blocks(last.content) + _blocks(m.content), last.first,
                             True, last.origins + _origins(i, m.content))
        else:
            turns.append(Turn(m.role, m.content, i, origins=_origins(i, m.content)))
    return turns


_TURN_PATH = re.compile(r"messages\.(\d+)(\.content\.(\d+))?")


def request_path(turns: Sequence[Turn], text: str) -> str:
    """``text`` (an error's field or message) with each path into the merged turns
    (``messages.K.content.J``) as the request's own (the message and block sent)."""
    def one(m: re.Match[str]) -> str:
        turn = turns[int(m.group(1))]
        if m.group(3) is None:
            return f"messages.{turn.first}"
        i, j = turn.origins[int(m.group(3))]
        return f"messages.{i}.content.{j}"
    return _TURN_PATH.sub(one, text)


def check_pairs(messages: Sequence[Any], turns: Sequence[Turn] | None) -> None:
    """Every ``tool_result`` answers a ``tool_use`` of the turn before it: of the merged
    turns where some were merged (as Anthropic pairs them), named by the request's paths."""
    if turns is None:
        check_anthropic_results(messages)
        return
    try:
        check_anthropic_results(turns)
    except InvalidRequestError as exc:
        raise InvalidRequestError(request_path(turns, exc.message),
                                  field=request_path(turns, exc.field or "")) from None


def check_server_tools(tools: Sequence[Any] | None) -> None:
    """A tool with a ``type`` other than ``custom`` is one of Anthropic's server tools: a 400
    naming ``tools.N.type`` and saying this server does not offer it."""
    for i, t in enumerate(tools or ()):
        kind = t.get("type") if isinstance(t, Mapping) else None
        if kind is None or kind == "custom":
            continue
        raise InvalidRequestError(
            f"tools.{i}.type: the server tool {kind!r} is not offered by this server (Coda "
            "runs no server tools: web search, web fetch, code execution, bash, text editor "
            "and computer use are not available); declare a custom tool with name, "
            "description and input_schema instead", field=f"tools.{i}.type")


_CHOICE_KEYS = {"auto": {"type", "disable_parallel_tool_use"},
                "any": {"type", "disable_parallel_tool_use"},
                "tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}


def check_tool_choice(choice: Mapping[str, Any] | None) -> None:
    """``tool_choice``'s keys and ``disable_parallel_tool_use``, as Anthropic checks them
    (module doc); its ``type`` and ``name`` are :func:`coda.server.tools.anthropic_plan`'s."""
    if choice is None or choice.get("type") not in _CHOICE_KEYS:
        return
    extra = sorted(set(choice) - _CHOICE_KEYS[choice["type"]])
    if extra:
        raise _bad(f"tool_choice.{extra[0]}", "Extra inputs are not permitted (tool_choice "
                                              f"{choice['type']!r} takes "
                                              f"{', '.join(sorted(_CHOICE_KEYS[choice['type']]))})")
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise _bad("tool_choice.disable_parallel_tool_use", "Input should be a valid boolean")


_UNSERVED = {
    "container": "this server runs no containers (they hold the code execution and skills of "
                 "Anthropic's server tools, which Coda does not offer); leave it out",
    "context_management": "this server does not edit the conversation (no clearing of old "
                          "tool results or thinking blocks): trim the messages you send",
    "mcp_servers": "this server connects to no MCP server (Anthropic's MCP connector): call "
                   "the MCP server's tools from the client and declare them as custom tools",
}


# NOTE: the code the SDK's message threads recover from (anthropic.lib.threads: the turn is
# sent again, and every later one, with the full history and no thread)
_UNTHREADABLE = {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}


def check_unserved(body: Any) -> None:
    """A 400 naming the first of ``container``, ``context_management``, ``mcp_servers``,
    ``thread`` that is set (module doc); null or an empty list asks for nothing and passes."""
    for name, why in _UNSERVED.items():
        if getattr(body, name, None):
            raise _bad(name, why)
    if getattr(body, "thread", None):
        raise ApiError(400, "thread: this server holds no conversation state (Anthropic's "
                            "message threads): send the whole conversation in messages",
                       param="thread", details=dict(_UNTHREADABLE))


def _format(fmt: Any, field: str) -> GrammarSpec:
    if not isinstance(fmt, Mapping):
        raise _bad(field, "must be an object")
    unknown = sorted(set(fmt) - _FORMAT_KEYS)
    if unknown:
        raise _bad(f"{field}.{unknown[0]}", "Extra inputs are not permitted")
    if fmt.get("type") != "json_schema":
        raise _bad(f"{field}.type", f"Input should be 'json_schema' (got {fmt.get('type')!r})")
    schema = fmt.get("schema")
    if not isinstance(schema, Mapping):
        raise _bad(f"{field}.schema", "Field required" if schema is None
                   else "must be a JSON schema object")
    grammar = grammar_from_format(ResponseFormat(type="json_schema",
                                                 json_schema={"schema": dict(schema)}), field)
    assert grammar is not None
    return grammar


def output_grammar(config: Any, legacy: Any) -> tuple[GrammarSpec | None, str]:
    """``output_config`` (and the older ``output_format``) → (the grammar, the field it came
    from), checked as Anthropic checks them (module doc)."""
    field = "output_config.format"
    fmt = None
    if config is not None:
        if not isinstance(config, Mapping):
            raise _bad("output_config", "must be an object")
        unknown = sorted(set(config) - _CONFIG_KEYS)
        if unknown:
            raise _bad(f"output_config.{unknown[0]}", "Extra inputs are not permitted")
        effort = config.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise _bad("output_config.effort", "Input should be one of "
                       f"{', '.join(repr(e) for e in sorted(EFFORTS))} (got {effort!r})")
        fmt = config.get("format")
    if legacy is not None:
        if fmt is not None:
            raise _bad("output_format", "cannot be combined with output_config.format "
                                        "(output_format is its older spelling)")
        fmt, field = legacy, "output_format"
    return (None if fmt is None else _format(fmt, field)), field


def check_output(config: Any, legacy: Any, tools_active: bool) -> None:
    """``POST /v1/messages/count_tokens``: raise the 400 ``POST /v1/messages`` would for
    ``output_config`` / ``output_format`` (P1) — their keys (:func:`output_grammar`), a
    format beside active tools, a schema the grammar engine refuses (found at submit on
    create) — named as create names it. A count never queues, so nothing else is done."""
    grammar, field = output_grammar(config, legacy)
    if grammar is None:
        return
    if tools_active:  # NOTE: the words of coda.server.tools.knob_fields, create's check
        raise _bad(field, "cannot be combined with tools unless tool_choice is none")
    from coda.engine.grammar import check_grammar  # NOTE: lazily, as the engine does

    try:
        check_grammar(grammar)
    except InvalidRequestError as exc:
        raise InvalidRequestError(exc.message.replace("response_format", field, 1),
                                  field=field) from None
