"""The llguidance grammar of a tool plan (:class:`coda.server.tools.ToolPlan`; issue 13 item
1, SPEC S1): the output is Hermes-style calls (``<tool_call>\\n{"name": ..., "arguments":
...}\\n</tool_call>``), each call's ``arguments`` constrained by its tool's JSON schema
(llguidance ``%json``, compact as for ``response_format``); ``auto`` is free text that never
holds the opening tag but as the start of calls (lazy: constrained from the trigger on); and
the grammar closes within the budget (an open call is forced closed)."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from coda.engine.types import GrammarSpec
from coda.server.tool_parser import CLOSE_TAG, OPEN_TAG

if TYPE_CHECKING:
    from coda.server.tools import ToolPlan

__all__ = ["grammar_for"]


def _lark_str(text: str) -> str:
    return json.dumps(text)  # NOTE: a JSON string literal is a valid lark string literal


def grammar_for(plan: ToolPlan) -> GrammarSpec | None:
    """The llguidance grammar that constrains this plan's output (None for ``none``)."""
    if not plan.active:
        return None
    rules = []
    alts = []
    for k, t in enumerate(plan.allowed()):
        head = '{"name": ' + json.dumps(t.name) + ', "arguments": '
        # NOTE: compact JSON, as for response_format (coda.engine.grammar); a schema may opt out
        schema = {"x-guidance": {"whitespace_flexible": False}, **t.parameters}
        rules.append(f"c{k}: {_lark_str(head)} %json {json.dumps(schema)} "
                     f"{_lark_str('}' + chr(10) + CLOSE_TAG)}")
        alts.append(f"c{k}")
    again = f'{_lark_str(chr(10) + OPEN_TAG)} body'
    more = "" if not plan.parallel else f" ({again})*" if plan.max_calls is None else "".join(
        f" ({again}" for _ in range(plan.max_calls - 1)) + ")?" * (plan.max_calls - 1)
    lines = [f"calls: body{more}", f"body: {_lark_str(chr(10))} ({' | '.join(alts)})", *rules]
    tag = re.escape(OPEN_TAG)
    if plan.mode == "auto":
        # NOTE: free text that never contains the tag, or such text ending in the tag + calls
        lines = ["start: TEXT | TEXT_OPEN calls",
                 rf"TEXT: /(.|\n)*/ & ~/(.|\n)*{tag}(.|\n)*/",
                 rf"TEXT_OPEN: /(.|\n)*{tag}/ & ~/(.|\n)*{tag}(.|\n)*{tag}/", *lines]
    else:
        lines = [f"start: {_lark_str(OPEN_TAG)} calls", *lines]
    # NOTE: under auto the call is optional: the closer admits its tag only where it fits
    return GrammarSpec(lark="\n".join(lines) + "\n", close_within_budget=True,
                       trigger=OPEN_TAG if plan.mode == "auto" else None)
