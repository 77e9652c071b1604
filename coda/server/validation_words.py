"""How a request body that fails validation is said (SPEC P1): the field it names as the
wire spells it, the message, and OpenAI's own words and codes for a number out of its range;
the error's shape is :mod:`coda.server.http_errors`' (which answers with these)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, get_args

from fastapi import Request
from fastapi.exceptions import RequestValidationError

from coda.server.fields import UNOFFERED

if TYPE_CHECKING:
    from coda.server.http_errors import Protocol


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


_SOURCES = frozenset({"body", "query", "path", "header", "cookie"})


def _loc_name(loc: tuple[Any, ...]) -> str:
    """The field a validation error names, as the wire spells it: ``starting_after``, not
    FastAPI's ``query.starting_after`` (OpenAI's ``param`` is the bare name, whether the field
    came from the body or the query)."""
    # NOTE: only the leading source tag is dropped: a body field may be called ``query``
    parts = [str(p) for p in (loc[1:] if loc and loc[0] in _SOURCES else loc)]
    # NOTE: pydantic puts union-member tags (``str``, ``list[int]``) in the loc; drop them.
    parts = [p for p in parts if not any(c in p for c in "[]") and p not in _TYPE_TAGS]
    return ".".join(parts)


def _is_json(content_type: str | None) -> bool:
    """A JSON media type (``application/json``, ``application/vnd.x+json``), parameters aside;
    no header at all is read as JSON too (FastAPI parses such a body)."""
    if not content_type:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and
                                           kind.endswith("+json"))


def describe_validation(exc: RequestValidationError, content_type: str | None = None,
                        protocol: Protocol = "openai") -> tuple[str, str | None]:
    """The message and field of a validation error; ``content_type`` is the request's header:
    a body sent as another media type (a form post) is never parsed as JSON, and is said so,
    not as malformed JSON."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if protocol == "openai" and (unoffered := _unoffered(errors)) is not None:
        return unoffered
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', 'parse error')}", None
    name = _loc_name(tuple(first.get("loc", ())))
    if not name and not _is_json(content_type):
        return (f"request body must be JSON sent with Content-Type: application/json (got "
                f"Content-Type: {content_type!r})"), None
    if not name:
        return "request body must be a JSON object (malformed JSON or wrong type)", None
    if first.get("type") == "extra_forbidden":
        # NOTE: each API's own words: Anthropic says "metadata.foo: Extra inputs are not
        # permitted", OpenAI "Unrecognized request argument supplied: foo"
        if protocol == "anthropic":
            return f"{name}: Extra inputs are not permitted", name
        return f"Unrecognized request argument supplied: {name}", name
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "value_error":
        # NOTE: a validator's own words ("time: invalid duration ..."), without pydantic's
        # "Value error, " before them
        msg = msg.removeprefix("Value error, ")
    return f"{name}: {msg}", name


def _unoffered(errors: Any) -> tuple[str, str] | None:
    """An OpenAI field for what only OpenAI's servers do (``coda.server.fields.UNOFFERED``),
    before any other error of the body (``prompt`` sent without ``input``), or None."""
    for error in errors:
        name = _loc_name(tuple(error.get("loc", ())))
        if error.get("type") == "extra_forbidden" and name in UNOFFERED:
            return f"{name}: {UNOFFERED[name]}", name
    return None


# NOTE: pydantic's bound errors in OpenAI's words and codes (``integer_below_min_value``,
# ``decimal_above_max_value``, ...): its 400 for a number out of its field's range
_BOUNDS = {"greater_than_equal": ("ge", "below", "min", ">="),
           "less_than_equal": ("le", "above", "max", "<=")}


def _number_kind(request: Request, loc: tuple[Any, ...], value: float) -> str:
    """OpenAI's word for a number: "decimal" for a float, or any value of a top-level body
    field declared a float (``temperature: 3``), else "integer"."""
    body = getattr(getattr(request.scope.get("route"), "body_field", None), "field_info", None)
    field = getattr(getattr(body, "annotation", None), "model_fields", {}).get(loc[-1])
    declared = (field.annotation, *get_args(field.annotation)) if field and len(loc) == 2 else ()
    return "decimal" if isinstance(value, float) or float in declared else "integer"


def out_of_range(exc: RequestValidationError, request: Request) -> tuple[str, str] | None:
    """A number outside its field's bounds as OpenAI says it (message, code), or None."""
    first = (exc.errors() or [{}])[0]
    bound, value, loc = _BOUNDS.get(first.get("type", "")), first.get("input"), first.get("loc")
    if bound is None or isinstance(value, bool) or not isinstance(value, int | float) or not loc:
        return None
    key, side, end, op = bound
    kind = _number_kind(request, tuple(loc), value)
    limit = first["ctx"][key]  # NOTE: pydantic says a float field's bound 2 as 2.0
    limit = int(limit) if isinstance(limit, float) and limit.is_integer() else limit
    # NOTE: named first as every Coda 400 is (``field: ...``), then OpenAI's own words
    return (f"{_loc_name(tuple(loc))}: {kind} {side} {end}imum value. Expected a value {op} "
            f"{limit}, but got {value} instead."), f"{kind}_{side}_{end}_value"
