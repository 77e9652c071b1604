"""Issue 22: the token budget has one name and one check (SPEC L4).

Each protocol spells the output budget its own way on the wire (OpenAI ``max_tokens`` /
``max_completion_tokens``, Responses ``max_output_tokens``, Anthropic ``max_tokens``, Ollama
``options.num_predict``). The wire spellings live only in the protocol schemas and in each
adapter's one mapping, which maps them once onto ``max_tokens`` at parse; below the adapters no
other name for the budget exists, the request carries no second budget field, and only the
plan (coda.engine.plan) checks and derives it, the engine's per-token stop alone comparing the
count with it. An error about the budget still names the field the client sent.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import httpx
import pytest

CODA = Path(__file__).resolve().parent.parent / "coda"
# the budget's wire spellings (and transformers' own, which bench.py calls)
WIRE_NAMES = frozenset({"max_completion_tokens", "max_output_tokens", "num_predict",
                        "max_new_tokens"})
SCHEMAS = frozenset({"server/schemas.py", "server/protocol_schemas.py",
                     "server/ollama_schemas.py", "server/ollama_options.py"})
# NOTE: each adapter's one mapping of its wire field onto ``max_tokens`` (Ollama's is
# ``ollama_options.max_tokens``, a schema module; Anthropic's wire already says ``max_tokens``)
MAPPINGS = frozenset({("server/openai_routes.py", "_budget_field"),
                      ("server/responses_routes.py", "parse")})
# NOTE: the functions that compare with the budget: the plan's check of what is known only
# after planning (``require_budget``: a compiled grammar's shortest completion; the request's
# own range and room are ``_budget``'s, on the asked value); the engine's one per-token stop
# (G1: the processor's ``budget_spent``, which the core also asks before choosing; the draft
# horizon reads its ``tokens_left`` and compares no budget); the early-stop policy's own hard
# budget (D1, a field of the client's policy: its construction and its controller)
COMPARES_BUDGET = frozenset({("engine/plan.py", "require_budget"),
                             ("output.py", "budget_spent"),
                             ("early_stop.py", "__post_init__"), ("early_stop.py", "_advance")})
# NOTE: not the budget's range: what ``max_tokens: 0`` means on the completions wire (score the
# echoed prompt only), so it is refused there without ``echo`` and accepted by the plan with it
# The same for Anthropic's own rule relating two wire fields (thinking.budget_tokens <
# max_tokens, refused as Anthropic refuses it): a wire check, not the budget's admission
# Likewise what an omitted ``max_tokens`` means on the completions wire (OpenAI's default, 16;
# the room for it is the plan's own ``fits_context``), and what ``max_tokens: 0`` means on
# Anthropic's (cache pre-warming: an answer without content; the plan admits the 0 itself)
WIRE_MEANING = frozenset({("server/openai_routes.py", "_reject_unsupported"),
                          ("server/openai_routes.py", "_completion_budget"),
                          ("server/anthropic_checks.py", "thinking_budget"),
                          ("server/anthropic_routes.py", "_prewarm")})
PRODUCT_ONLY = frozenset({"bench.py"})  # NOTE: test support calling transformers.generate


def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(CODA)), ast.parse(p.read_text(encoding="utf-8")))
            for p in sorted(CODA.rglob("*.py")) if p.name not in PRODUCT_ONLY]


def _source_name(name: str) -> str:
    """A function's name as written: mutmut (scripts/mutation.sh) renames each function of the
    file it mutates (``x_f__mutmut_orig``, ``xǁClassǁmethod__mutmut_3``) and adds a trampoline
    under the old name; the function-by-function rules read through that."""
    if "__mutmut_" not in name:
        return name
    base = name.split("__mutmut_")[0]
    return base.rsplit("ǁ", 1)[-1] if "ǁ" in base else base.removeprefix("x_")


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.keyword | ast.arg):
        return node.arg
    return None


def _wire_uses(rel: str, tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, name, enclosing function) of each identifier spelled like a wire budget."""
    out: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = _source_name(child.name) if isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) else func
            if _name(child) in WIRE_NAMES:
                out.append((getattr(child, "lineno", 0), str(_name(child)), func))
            visit(child, inner)

    visit(tree, "<module>")
    return out


def test_l4_wire_budget_names_stop_at_the_adapters() -> None:
    """L4: a wire spelling of the budget appears only in a protocol schema or in the one
    function of an adapter that maps it onto ``max_tokens`` (:data:`MAPPINGS`), never below
    nor elsewhere in the adapter."""
    bad = []
    for rel, tree in _modules():
        for line, name, func in _wire_uses(rel, tree):
            if rel in SCHEMAS or (rel, func) in MAPPINGS:
                continue
            bad.append(f"coda/{rel}:{line} {name} (in {func})")
    assert bad == []


def test_l4_the_request_path_carries_one_budget_field() -> None:
    """L4: every per-request value from the parsed knobs to the per-token checks names the
    budget ``max_tokens`` and carries no second budget field (no per-request default: that is
    the engine's, ``ModelLimits.default_max_tokens``)."""
    from coda.engine.plan import ModelLimits, RequestPlan
    from coda.engine.types import GenerationRequest
    from coda.output import OutputSpec
    from coda.server.params import plan_call
    from coda.server.render_spec import ResponsesRender

    # NOTE: the adapters hand their resolved values to plan_call's keywords (no Knobs object)
    keywords = [p for p in inspect.signature(plan_call).parameters
                if "max" in p and "tokens" in p]
    assert keywords == ["max_tokens", "max_tokens_field"]
    for cls in (GenerationRequest, OutputSpec, ResponsesRender):
        budget = [f.name for f in dataclasses.fields(cls)
                  if "max" in f.name and "tokens" in f.name]
        assert budget in (["max_tokens"], ["max_tokens", "max_tokens_field"]), (cls, budget)
    # NOTE: the plan holds the resolved budget once: it is its per-token rules (it extends
    # OutputSpec), so its one budget field is theirs and it declares no second one
    assert issubclass(RequestPlan, OutputSpec)
    assert [f.name for f in dataclasses.fields(RequestPlan) if "max_tokens" in f.name] == [
        "max_tokens"]
    assert "max_tokens" not in RequestPlan.__dict__.get("__annotations__", {})
    assert "default_max_tokens" in {f.name for f in dataclasses.fields(ModelLimits)}


# NOTE: every class field spelled ``*max_tokens`` below the wire schemas, and why: each holds
# THE output budget (or the engine's default for it); D1's early-stop policy is the client's
# own wire object (SPEC D1 ``maxTokens``) and bench.py is test support
BUDGET_HOLDERS = frozenset({
    ("engine/types.py", "GenerationRequest", "max_tokens"),
    ("engine/types.py", "EngineConfig", "default_max_tokens"),
    ("engine/plan.py", "ModelLimits", "default_max_tokens"),
    ("output_spec.py", "OutputSpec", "max_tokens"),
    ("server/render_spec.py", "ResponsesRender", "max_tokens"),
    ("early_stop.py", "EarlyStopPolicy", "max_tokens"),
    # NOTE: `coda generate --max-tokens`, passed on as the request's max_tokens (the CLI split)
    ("commands/generate.py", "GenerateArgs", "max_tokens"),
    # NOTE: `coda bench --max-tokens`, every request's budget, as the report prints it
    ("bench_report.py", "BenchReport", "max_tokens"),
})


def test_l4_no_second_budget_is_named_max_tokens() -> None:
    """L4: ``max_tokens`` names the output budget and nothing else: a class field spelled
    ``*max_tokens`` exists only on the holders of that one budget (:data:`BUDGET_HOLDERS`);
    another budget has its own name (the reasoning budget is ``ReasoningSpec.budget_tokens``,
    as Anthropic's ``thinking.budget_tokens``)."""
    found = set()
    for rel, tree in _modules():
        if rel in SCHEMAS:
            continue
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef):
                found |= {(rel, cls.name, n.target.id) for n in cls.body
                          if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                          and n.target.id.endswith("max_tokens")}
    assert found == BUDGET_HOLDERS
    from coda.reasoning import ReasoningSpec

    assert "budget_tokens" in {f.name for f in dataclasses.fields(ReasoningSpec)}


def test_l4_only_the_plan_checks_the_budget() -> None:
    """L4: a comparison involving ``max_tokens`` sits only in the plan (the admission check),
    in the engine's one per-token stop (``OutputProcessor.budget_spent``), in D1's policy and
    in a wire's own meaning of its field (:data:`WIRE_MEANING`): function by function, so a
    second comparison in the processor or the plan fails too."""
    allowed = COMPARES_BUDGET | WIRE_MEANING
    bad = []
    for rel, tree in _modules():
        exempt = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                  and (rel, _source_name(f.name)) in allowed for n in ast.walk(f)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Compare) and id(node) not in exempt and any(
                    (_name(n) or "").endswith("max_tokens") for n in ast.walk(node))):
                bad.append(f"coda/{rel}:{node.lineno}")
    assert bad == []
    plan = {_source_name(node.name) for rel, tree in _modules() if rel == "engine/plan.py"
            for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert {"plan_request", "_budget", "require_budget"} <= plan


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 100_000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 100_000}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, "max_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 100_000}, "max_output_tokens"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 100_000}, "max_tokens"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False,
                   "options": {"num_predict": 100_000}}, "options.num_predict"),
])
def test_l4_a_budget_past_the_context_names_the_wire_field(
        server_live: Any, path: str, body: dict[str, Any], field: str) -> None:
    """L4: the plan's one check refuses a budget past the context with a 4xx in the
    protocol's shape that names the field the client sent."""
    resp = httpx.post(server_live.url + path, json={"model": "tiny-chat", **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    text = err if isinstance(err, str) else err.get("param") or err["message"]
    assert field in text
    if isinstance(err, dict) and "param" in err:
        assert err["param"] == field


def test_l4_min_tokens_above_the_asked_max_tokens_is_a_400_naming_min_tokens(
        server_live: Any) -> None:
    """L4 (as vLLM): an asked ``max_tokens`` below the asked ``min_tokens`` can honour
    neither: the budget's one check refuses it with a 400 in OpenAI's shape naming
    ``min_tokens``; equal is served, and makes exactly that many tokens."""
    import openai

    oai = openai.OpenAI(base_url=server_live.url + "/v1", api_key="unused", max_retries=0)
    msgs: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=3,
                                    extra_body={"min_tokens": 4})
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "min_tokens", err
    ok = oai.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=3,
                                     extra_body={"min_tokens": 3})
    assert ok.usage is not None and ok.usage.completion_tokens == 3
