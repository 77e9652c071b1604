"""Tool calling: one format, one grammar, one parser for every protocol (issue 13 item 1;
SPEC S1, K2, L4).

The call syntax is Hermes-style, the format Qwen-like chat templates teach their models::

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

It is also Coda's documented default for models whose template knows no tools (the tool list
is then described in a system message, see :mod:`coda.server.tool_messages`).

- ``tool_choice`` ``required`` / a named tool: the whole output is one call (or several when
  ``parallel_tool_calls``; an OpenAI named tool: exactly one) and every call's ``arguments``
  are constrained by the tool's JSON schema (llguidance ``%json``), so they always parse and
  validate.
- ``auto``: the output is free text that may open a call; the grammar forbids the opening tag
  anywhere except as the start of a call, and from the tag on the call is constrained exactly as
  above (the "lazy" part of the grammar: free until the trigger, constrained after it).
- ``none``: no grammar and no parsing; the text is returned as text.

The grammar of a plan is :func:`coda.server.tool_grammar.grammar_for`.

:class:`ToolCallParser` (:mod:`coda.server.tool_parser`) turns the engine's text deltas into
text and complete calls, ending each call where its JSON object ends (never at a close tag found
in an argument string); the bytes of a call are reported as removed from the text stream
(``removed_bytes``, K2: the engine's own stream still carries them, the protocol moves them into
``tool_calls``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from coda.errors import InvalidRequestError
from coda.server.strict_schema import check_strict_tool
from coda.server.tool_grammar import grammar_for
from coda.server.tool_parser import (
    CLOSE_TAG,
    OPEN_TAG,
    Item,
    ToolCall,
    ToolCallParser,
    primed,
    split,
    texts,
)

__all__ = ["CLOSE_TAG", "OPEN_TAG", "Item", "Tool", "ToolCall", "ToolCallParser", "ToolPlan",
           "anthropic_plan", "check_chat_fields", "knob_fields", "openai_call", "openai_plan",
           "primed", "split", "texts"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

Mode = Literal["none", "auto", "required", "named"]
# NOTE: the usual slip between the two OpenAI APIs, said where a tool has the other's shape
_SHAPES = ('a Responses function tool is flat: {"type": "function", "name", "parameters"}; '
           'Chat Completions nests it: {"type": "function", "function": {"name", '
           '"parameters"}}')


@dataclass(frozen=True)
class Tool:
    """One function tool: name, description and its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object"})

    def openai_dict(self) -> dict[str, Any]:
        """The shape ``transformers`` passes to chat templates (OpenAI function tool)."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class ToolPlan:
    """Tools and choice of one request, normalised once."""

    tools: tuple[Tool, ...]
    mode: Mode = "auto"
    name: str | None = None  # the forced tool when mode == "named"
    parallel: bool = True
    # OpenAI's ``allowed_tools`` choice: the names that may be called (every tool is still
    # described to the model); None: all of them
    allow: tuple[str, ...] | None = None
    max_calls: int | None = None  # Responses ``max_tool_calls``: the most calls (None: any)

    @property
    def active(self) -> bool:
        """Whether the output may carry calls (parse it and constrain it)."""
        return bool(self.tools) and self.mode != "none"

    def allowed(self) -> tuple[Tool, ...]:
        if self.mode == "named":
            return tuple(t for t in self.tools if t.name == self.name)
        if self.allow is not None:
            return tuple(t for t in self.tools if t.name in self.allow)
        return self.tools


# -- parsing the protocols' tool fields ------------------------------------------------------
def _tool(name: Any, description: Any, params: Any, field_name: str) -> Tool:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidRequestError(
            f"{field_name}.name must match {_NAME_RE.pattern}, got {name!r}", field=field_name)
    if params is None:  # NOTE: OpenAI: "omitting parameters defines a function with an empty
        # parameter list": its call's arguments are {} (any object let a model invent keys)
        params = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, Mapping):
        raise InvalidRequestError(f"{field_name}: the parameters schema must be an object",
                                  field=field_name)
    if "type" in params and params["type"] != "object":  # NOTE: a call's arguments are an object
        raise InvalidRequestError(
            f'{field_name}: the arguments schema (parameters / input_schema) must be of type '
            f'"object", got {params["type"]!r}', field=field_name)
    # NOTE: untyped (`{}`, only `properties`) is an object's schema, else any JSON value passed
    params = {"type": "object", **params}
    import llguidance as llg

    from coda.engine.grammar_schema import schema_problem

    # NOTE: checked here so a bad schema is a 400 naming the tool, not `response_format`
    error = schema_problem(params) or llg.LLMatcher.validate_grammar(
        llg.LLMatcher.grammar_from_json_schema(json.dumps(dict(params), default=str)))
    if error:
        raise InvalidRequestError(f"{field_name}: invalid parameters schema: {error}",
                                  field=field_name)
    return Tool(name, description if isinstance(description, str) else "", dict(params))


def _unique(tools: list[Tool], field_name: str) -> tuple[Tool, ...]:
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"{field_name}: tool names must be unique", field=field_name)
    return tuple(tools)


def _named(plan_tools: tuple[Tool, ...], name: Any, field_name: str) -> str:
    if not isinstance(name, str):  # NOTE: else "no tool named None": say what is missing
        raise InvalidRequestError(f"{field_name}: a tool choice needs the tool's name (a string)",
                                  field=field_name)
    if not any(t.name == name for t in plan_tools):
        raise InvalidRequestError(f"{field_name}: no tool named {name!r} in tools",
                                  field=field_name)
    return str(name)


def check_chat_fields(tools: list[dict[str, Any]] | None, choice: Any,
                      parallel: bool | None) -> None:
    """Chat Completions, as OpenAI answers it: ``tools`` is not empty, and ``tool_choice`` /
    ``parallel_tool_calls`` come only with tools (any value, ``"none"`` / ``"auto"`` too), a
    400 naming the field (Responses accepts both without tools and echoes them)."""
    if tools is not None and not tools:
        raise InvalidRequestError("Invalid 'tools': empty array. Expected an array with "
                                  "minimum length 1, but got an empty array instead.",
                                  field="tools")
    for name, value in (("tool_choice", choice), ("parallel_tool_calls", parallel)):
        if tools is None and value is not None:
            raise InvalidRequestError(f"Invalid value for '{name}': '{name}' is only allowed "
                                      "when 'tools' are specified.", field=name)


def openai_plan(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool | None,
                *, flat: bool = False) -> ToolPlan | None:
    """Chat Completions (``flat=False``: ``{"type": "function", "function": {...}}``) or
    Responses (``flat=True``: ``{"type": "function", "name", "parameters"}``) tools."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice: needs tools", field="tool_choice")
        return None
    parsed: list[Tool] = []
    for i, t in enumerate(tools):
        f = f"tools.{i}"
        if t.get("type") != "function":
            raise InvalidRequestError(f"{f}.type: only function tools are supported", field=f)
        spec = t if flat else t.get("function")
        if flat and "name" not in t and isinstance(t.get("function"), Mapping):
            raise InvalidRequestError(f"{f}.name: required ({_SHAPES})", field=f)
        if not isinstance(spec, Mapping):
            raise InvalidRequestError(f"{f}.function: required" + (
                f" ({_SHAPES})" if "name" in t else ""), field=f)
        parsed.append(_tool(spec.get("name"), spec.get("description"), spec.get("parameters"), f))
        check_strict_tool(spec, f if flat else f"{f}.function")  # NOTE: strict: OpenAI's rules
    all_tools = _unique(parsed, "tools")
    par = True if parallel is None else bool(parallel)
    if choice is None or choice in ("auto", "none", "required"):
        return ToolPlan(all_tools, choice or "auto", None, par)
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        name = choice.get("name") if flat else (choice.get("function") or {}).get("name")
        # NOTE: as OpenAI's forced function: exactly one call of it, whatever
        # parallel_tool_calls says (Anthropic's ``tool`` choice keeps its parallel calls)
        return ToolPlan(all_tools, "named", _named(all_tools, name, "tool_choice"), False)
    if isinstance(choice, Mapping) and choice.get("type") == "allowed_tools":
        return _allowed(all_tools, choice, par, flat)
    raise InvalidRequestError("tool_choice: must be none, auto, required, a function or "
                              "allowed_tools", field="tool_choice")


def _allowed(all_tools: tuple[Tool, ...], choice: Mapping[str, Any], parallel: bool,
             flat: bool) -> ToolPlan:
    """OpenAI's ``allowed_tools`` choice (chat: ``{"type": "allowed_tools", "allowed_tools":
    {"mode", "tools"}}``; Responses: ``mode`` and ``tools`` beside ``type``): ``auto`` or
    ``required`` over the listed function tools only (each named in ``tools``)."""
    base = "tool_choice" if flat else "tool_choice.allowed_tools"
    spec = choice if flat else choice.get("allowed_tools")
    if not isinstance(spec, Mapping):
        raise InvalidRequestError(f"{base}: required (an object with mode and tools)",
                                  field=base)
    mode = spec.get("mode")
    if mode not in ("auto", "required"):
        raise InvalidRequestError(f"{base}.mode: must be auto or required, got {mode!r}",
                                  field=f"{base}.mode")
    listed = spec.get("tools")
    if not isinstance(listed, list) or not listed:
        raise InvalidRequestError(f"{base}.tools: a non-empty list of the tools allowed",
                                  field=f"{base}.tools")
    names = []
    for j, t in enumerate(listed):
        f = f"{base}.tools.{j}"
        if not isinstance(t, Mapping) or t.get("type") != "function":
            raise InvalidRequestError(f"{f}: only function tools are supported", field=f)
        fn = t if flat else t.get("function")
        names.append(_named(all_tools, fn.get("name") if isinstance(fn, Mapping) else None, f))
    return ToolPlan(all_tools, mode, None, parallel, allow=tuple(names))


def anthropic_plan(tools: list[dict[str, Any]] | None,
                   choice: Mapping[str, Any] | None) -> ToolPlan | None:
    """Anthropic ``tools`` (``name``, ``description``, ``input_schema``) and ``tool_choice``
    (``auto`` | ``any`` | ``tool`` | ``none``; ``disable_parallel_tool_use``)."""
    if not tools:
        if choice and choice.get("type") not in ("auto", "none"):
            raise InvalidRequestError("tool_choice: needs tools", field="tool_choice")
        return None
    for i, t in enumerate(tools):
        # NOTE: as Anthropic: a custom tool's input_schema is required (OpenAI's parameters
        # are optional, so _tool accepts none); without it the call was unconstrained
        if not isinstance(t, Mapping) or "input_schema" not in t:
            raise InvalidRequestError(f"tools.{i}.input_schema: Field required",
                                      field=f"tools.{i}.input_schema")
    parsed = [_tool(t.get("name"), t.get("description"), t.get("input_schema"), f"tools.{i}")
              for i, t in enumerate(tools)]
    all_tools = _unique(parsed, "tools")
    kind = (choice or {}).get("type", "auto")
    par = not bool((choice or {}).get("disable_parallel_tool_use", False))
    if kind in ("auto", "none"):
        return ToolPlan(all_tools, kind, None, par)
    if kind == "any":
        return ToolPlan(all_tools, "required", None, par)
    if kind == "tool":
        name = _named(all_tools, (choice or {}).get("name"), "tool_choice")
        return ToolPlan(all_tools, "named", name, par)
    raise InvalidRequestError("tool_choice.type: must be auto, any, tool or none",
                              field="tool_choice")


# -- wiring helpers shared by the routes ----------------------------------------------------
def knob_fields(plan: ToolPlan | None, other_grammar: object | None,
                format_field: str = "response_format") -> dict[str, Any]:
    """The :func:`~coda.server.params.plan_call` keywords of a tool plan: its grammar, and
    the rule that stop strings end at the opening tag (a call is never cut by a stop)."""
    if plan is None or not plan.active:
        return {}
    if other_grammar is not None:
        raise InvalidRequestError(
            f"{format_field}: cannot be combined with tools unless tool_choice is none",
            field=format_field)
    return {"grammar": grammar_for(plan), "stops_end_at": OPEN_TAG}


def openai_call(call: ToolCall, request_id: str, *, delta: bool = False,
                choice: int = 0) -> dict[str, Any]:
    """A call as Chat Completions writes it (``delta``: in a streamed chunk, with ``index``;
    ``choice``: the choice it belongs to, so ids are unique across ``n`` choices)."""
    out: dict[str, Any] = {"id": call.call_id(request_id, choice), "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, **out} if delta else out
