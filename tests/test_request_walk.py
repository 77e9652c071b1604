"""Issue 22: the walk script's counting rules (scripts/request_walk.py), on made-up paths.

The two re-entry counts of the body path: the issue's (every stop at a module left before, a
return to a caller included) and the call count (only a *call* into a module entered and left
before: the data going back to a module). And the budget sites' layers (SPEC L4; the
early-stop policy's own ``maxTokens`` is D1's quantity, not the output budget).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "request_walk.py"


def _walk() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_request_walk", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # NOTE: dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_issue22_a_return_to_the_caller_is_no_call_reentry() -> None:
    """route → params → (return) route → render → (return) route: the issue's count has two
    re-entries (both returns), the call count none; a second call into params is one."""
    walk = _walk()
    path = ["route", "params", "route", "render", "route"]
    calls = [True, True, False, True, False]
    assert walk.reentries(path) == 2
    assert walk.call_reentries(path, calls) == []
    path2, calls2 = [*path, "params"], [*calls, True]
    assert walk.reentries(path2) == 3
    assert walk.call_reentries(path2, calls2) == ["route -> params"]


def test_issue22_a_call_back_into_a_module_left_deeper_down_counts() -> None:
    """plan → sampling (return) plan → output, then later request → output: output was
    entered and left before, so the second call into it is a call re-entry; the module the
    path is in when it calls (its own stop) never counts as left."""
    walk = _walk()
    path = ["plan", "sampling", "plan", "output", "plan", "request", "output"]
    calls = [True, True, False, True, False, True, True]
    assert walk.call_reentries(path, calls) == ["request -> output"]


def test_l4_d1_budget_sites_are_split_by_layer() -> None:
    """L4, D1: schemas are the wire, routes the adapters, the early-stop policy its own
    quantity, the rest internal; the internal checks name their modules."""
    walk = _walk()
    sites = ["check coda/early_stop.py:278 ['max_tokens']",
             "check coda/engine/plan.py:105 ['max_tokens']",
             "check coda/output.py:252 ['max_tokens']",
             "derive coda/server/schemas.py:94 ['max_tokens']",
             "derive coda/server/openai_routes.py:293 ['max_tokens']",
             "check coda/server/anthropic_checks.py:47 ['max_tokens']"]
    assert [walk.layer(s) for s in sites] == ["d1_policy", "internal", "internal", "wire",
                                              "adapter", "adapter"]
    split = walk.by_layer(sites)
    assert split["internal_check_modules"] == ["coda/engine/plan.py", "coda/output.py"]
    assert split["internal_names"] == {"max_tokens": 2}


# NOTE: the figures of the last measured walk (docs/architecture.md, "The walk, measured"); a
# change that raises one fails here: lower the bound with the figure when a step lowers it
# max_tokens_sites 20: + Anthropic's own thinking.budget_tokens < max_tokens (a wire rule of
# its adapter, coda/server/anthropic_checks.py, refused as Anthropic refuses it); 21: + legacy
# completions' omitted max_tokens, read as the wire's default 16 (openai_routes'
# _completion_budget: a wire meaning of its adapter, the room for it the plan's fits_context)
# files and classes_made_once + 1 each: coda.token_ends' TokenEnds, the processor's K2 record of
# where each token's last byte lands (a token's entry rode a delta early after a U+FFFD)
# body_path_call_reentries 4 -> 2 and classes_made_once 23 -> 22 (branch walk22): the phase
# times are the Terminal's own fields (no Timings), and the metrics listen once per app for
# every end (no when_closed subscription per request calling back into the stream)
# files + 1: coda.output_delta, the processor's base (what a delta carries: K2 entries, L6
# counts), split from coda/output.py by size; the processor's off-path parts (id stops, the
# reasoning split, the tool-call tag) moved to modules a plain request never runs
# body_path_call_reentries 2 -> 0 (branch objects22): the lifecycle's birth rows are written
# ahead of its first row on the driver's thread, not at construction (no lifecycle -> trace);
# classes_made_once 22 -> 19: the parse's frozen Parsed is the call's Record (one holder from
# parse to replay), the streamed response is its own Connection, a wake-up subscription is a
# pair in the channel's list, not an object
# max_tokens_sites 21 -> 20 (branch budget-one): the OpenAI adapter maps its wire field
# (chat's two spellings, completions' one) in one function, _budget_field, which also holds the
# wire's rules on which field carries it (both sent, max_completion_tokens with a prediction)
BOUNDS = {"files": 46, "body_path_call_reentries": 0, "classes_made_once": 19,
          "max_tokens_sites": 20}
# NOTE: the budget sites per layer (scripts/request_walk.py ``by_layer``), measured: the
# protocols' five field declarations; the adapters' mappings and wire rules (chat/completions
# and Responses one mapping each; completions' 0-only-with-echo and omitted-is-16; Anthropic's
# 0-is-pre-warming and thinking budget < max_tokens); D1's own policy budget (its check and
# its controller); below the adapters the request's field and the engine's default (declared
# on EngineConfig and on the ModelLimits the plan reads), the Responses echo, the plan's
# derivation and its post-compile check, and the engine's one per-token stop
BUDGET_LAYERS = {"wire": 5, "adapter": 6, "d1_policy": 2, "internal": 7}
# NOTE: each route's own files (its adapter, and Ollama's NDJSON wire and schemas); the chat
# route's stream and the Responses object and stream are modules of their own (split by size,
# the same code), the engine's handle lives in engine/protocol.py (docs/architecture.md, "The
# walk, measured"): chat as before, Responses one file more; each + 1 for coda.token_ends,
# + 1 for coda.output_delta; Messages + 1 for its stream (anthropic_stream, split off
# anthropic_routes by size); Ollama + 2 for its options and its body checks (ollama_options,
# ollama_checks, split off ollama_schemas and ollama_routes by size)
# (branch objects22) every route but Responses - 1: the Record and its stores split off
# server/state.py (+ coda.server.records), the create handler merged into server/common.py
# and the FAILED shapes (server/failures.py) into server/http_errors.py, the one home of
# error shapes (a plain Responses call never ran failures.py: it stays at 48)
# (branch api-life) every route + 2: the engine's live request (engine/engine_request.py) and
# the step's token choice (engine/core_choose.py), split off engine/core.py by size (the same
# code; no call re-entry: the choice runs on the engine thread, the request is built once)
# (branch split1) every route + 1: the engine thread's loop (engine/engine_thread.py, with
# its start, shutdown and queued calls) split off engine/async_engine.py by size (the same
# code; the loop runs on the engine thread, so no body-path call re-entry)
ROUTE_FILES = {"openai": 50, "anthropic": 49, "responses": 51, "ollama-chat": 53,
               "ollama-generate": 54}
# NOTE: work no request asked for that may overlap the measured one (the engine's idle
# integrity check, the server's timed release of the grammar tokenizer build: a file more run
# to run under load) is counted apart by the script (BACKGROUND_CALLS, ``background_files``),
# so the bound is the measured figure, with no allowance
# NOTE: what a plain request (no tools, functions, tool turns, modalities, effort, tier,
# truncation, logprobs, speculation) has nothing to do in: guarded at the call site, never
# entered, on every protocol
NOTHING_TO_DO = ("coda.server.legacy_functions", "coda.server.tool_results",
                 "coda.server.tools", "coda.server.tool_messages", "coda.server.fields",
                 "coda.server.logprobs", "coda.reasoning", "coda.engine.speculative",
                 # NOTE: speculation's parts and the core's speculative and scoring halves
                 "coda.engine.speculative_state", "coda.engine.speculative_verify",
                 "coda.engine.speculative_costs", "coda.engine.core_spec",
                 "coda.engine.core_scoring", "coda.engine.core_failures",
                 # NOTE: the processor's parts for stop ids, a reasoning split, a tool-call tag
                 "coda.output_ids", "coda.output_reasoning", "coda.output_tag")


@pytest.mark.parametrize("route", sorted(ROUTE_FILES))
def test_issue22_a_plain_streaming_request_stays_within_the_measured_walk(
        tmp_path: Path, route: str) -> None:
    """Issue 22 (L4: one budget home; P1 stream order unchanged): one plain streaming call of
    each protocol (chat completions, Messages, Responses, Ollama chat and generate) through
    the real app with its official client, measured by the script: no more files, body-path
    call re-entries, per-request classes or budget sites than the last measured figures, none
    of the modules a plain request has nothing to do in, and the engine's one constructor (no
    call back from the core into ``request``, nor into the plan, nor from ``submit`` into the
    stream to start it, nor from the run into ``output`` after the plan built its rules there)."""
    walk = _walk()
    out = tmp_path / "walk.json"
    assert walk.main(["--route", route, "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["text"]  # NOTE: the request answered
    bounds = {**BOUNDS, "files": ROUTE_FILES[route]}
    assert {k: got[k] for k in bounds} == {k: min(got[k], v) for k, v in bounds.items()}
    assert not set(NOTHING_TO_DO) & set(got["files_list"])
    calls = walk.call_reentries(got["body_path"], got["body_calls"])
    assert "engine.core -> request" not in calls and "engine.core -> engine.plan" not in calls
    assert not {c for c in calls if c.startswith("engine.engine_request -> ")}
    # NOTE: the stream opens with its start event as it is built: no call back into it
    assert "engine.async_engine -> stream" not in calls
    # NOTE: the plan is its per-token rules (RequestPlan extends OutputSpec): the plan never
    # calls into output to build a second object, so the run's processor is output's first
    # visit
    assert "request -> output" not in calls
    # NOTE: the metrics listen once per app (WakeChannel.on_end): admission subscribes nothing
    # per request, so it never calls back into the stream it built
    assert "reader -> stream" not in calls and "server.metrics -> reader" not in calls
    # NOTE: building the request writes no trace row: the lifecycle never calls back into trace
    assert "lifecycle -> trace" not in calls


def test_issue22_background_work_is_counted_apart() -> None:
    """Work no request asked for (the server's timed release of the grammar build, here a
    stand-in of that name calling into ``coda.token_ends``) lands in ``background_files`` and
    not in the request's files; the same call made by the request itself is the request's."""
    walk = _walk()

    class GrammarWarmupMiddleware:
        def _release(self) -> None:
            from coda.token_ends import _spans
            _spans(b"ab")

    from coda.token_ends import _spans
    w = walk.Walk(active=True)
    sys.setprofile(w.profile)
    try:
        GrammarWarmupMiddleware()._release()
    finally:
        sys.setprofile(None)
    assert "coda.token_ends" in w.background_files and "coda.token_ends" not in w.files
    sys.setprofile(w.profile)
    try:
        _spans(b"ab")
    finally:
        sys.setprofile(None)
    assert "coda.token_ends" in w.files


def test_l4_budget_sites_stay_within_their_measured_layers() -> None:
    """L4 (issue 22, one name and one check): no layer of the budget's sites grows past its
    measured figure, and below the adapters only the plan and the output processor (the
    engine's per-token stop) compare with the budget, under the one name (and the engine's
    default for it)."""
    walk = _walk()
    sites, _ = walk.budget_sites(SCRIPT.parent.parent)
    split = walk.by_layer(sites)
    layers = {k: split["layers"].get(k, 0) for k in BUDGET_LAYERS}
    assert layers == {k: min(layers[k], v) for k, v in BUDGET_LAYERS.items()}
    assert split["internal_check_modules"] == ["coda/engine/plan.py", "coda/output.py"]
    assert set(split["internal_names"]) <= {"max_tokens", "default_max_tokens"}
