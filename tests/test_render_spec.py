"""The typed render spec's plain-data form (issue 22 step 2; SPEC P3): what the durable log
stores rebuilds the same spec on any ingress, through JSON as through msgpack, and a
descriptor written before the spec existed (the same keys) still loads."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from coda.server.render_spec import (
    AnthropicRender,
    OllamaRender,
    OpenAIRender,
    RenderSpec,
    ResponsesRender,
    spec_data,
    spec_from_data,
)
from tests.conftest import examples

_KIND = {OpenAIRender: "chat", AnthropicRender: "anthropic", ResponsesRender: "response",
         OllamaRender: "ollama"}
_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4),
                     lambda inner: st.dictionaries(st.text(max_size=3), inner, max_size=3),
                     max_leaves=6)
specs = st.one_of(
    st.builds(OpenAIRender, n=st.integers(1, 4),
              prompt_tokens=st.lists(st.integers(1, 99), max_size=3).map(tuple),
              echo=st.lists(st.text(max_size=4), max_size=2).map(tuple),
              echo_logprobs=st.lists(st.dictionaries(st.text(max_size=3), _json, max_size=2),
                                     max_size=2).map(tuple)),
    st.builds(AnthropicRender, input_tokens=st.integers(1, 99)),
    st.builds(OllamaRender, chat=st.booleans(), model=st.text(max_size=8)),
    st.builds(ResponsesRender, format=st.dictionaries(st.text(max_size=3), _json, max_size=2),
              metadata=st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
              tools_echo=st.lists(st.dictionaries(st.text(max_size=3), _json, max_size=2),
                                  max_size=2).map(tuple),
              tool_choice=st.just("auto") | st.dictionaries(st.text(max_size=3), _json,
                                                            max_size=2)),
)


@settings(deadline=None, max_examples=examples(100))
@given(spec=specs)
def test_p3_spec_survives_the_log(spec: RenderSpec) -> None:
    """P3: for every spec, its stored form (through JSON, as the log's descriptor) rebuilds
    an equal spec, so a replay on another ingress renders with the same options."""
    kind = _KIND[type(spec)]
    assert spec_from_data(kind, json.loads(json.dumps(spec_data(spec)))) == spec
    assert spec_from_data(kind, spec_data(spec)) == spec


def test_p3_descriptor_of_the_old_extra_dict_still_loads() -> None:
    """P3: a record stored by the previous server (Record.extra, same keys) rebuilds."""
    old = {"n": 2, "tools": True, "prompt_tokens": [5, 7], "skip_special": False,
           "verify": True, "include_usage": True, "logprobs": False, "continuous_usage": False}
    assert spec_from_data("completion", old) == OpenAIRender(
        n=2, prompt_tokens=(5, 7), tools=True, skip_special=False, verify=True,
        include_usage=True)
    assert spec_from_data("anthropic", {"input_tokens": 3, "tools": False,
                                        "verify": False}) == AnthropicRender(3)
