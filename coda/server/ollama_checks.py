"""The checks of an Ollama ``/api/chat`` / ``/api/generate`` body before its prompt is
rendered (issue 23 item 2; SPEC P1): the fields Coda refuses with what to send instead, and
``think`` against the model's reasoning markers (:mod:`coda.server.ollama_routes` runs them).
"""

from __future__ import annotations

from coda.errors import InvalidRequestError
from coda.reasoning import ReasoningSpec
from coda.server.ollama_schemas import OllamaChatRequest, OllamaGenerateRequest
from coda.server.state import ServerState

OllamaBody = OllamaChatRequest | OllamaGenerateRequest


def thinking_spec(st: ServerState, body: OllamaBody, ids: list[int], grammar: bool
              ) -> ReasoningSpec | None:
    """The reasoning split of a model with ``<think>`` markers (issue 23 item 3): always made
    (stops apply to the answer only), shown as ``thinking`` unless ``think`` is false; asking
    for ``think`` on a model without markers (or with a grammar) is a 400."""
    spec = st.reasoning(ids, budget=None, budget_field="think", grammar=grammar)
    if spec is None and body.think not in (None, False, "none"):
        raise InvalidRequestError(f"think: {body.model!r} does not support thinking"
                                  + (" with format or tools" if grammar else ""), field="think")
    return spec


def check_common(body: OllamaBody) -> None:
    if body.stream_verify:
        raise InvalidRequestError("stream_verify: not offered on the Ollama API (NDJSON has "
                                  "no place for the stamps)", field="stream_verify")


# NOTE: what each refused generate field would need, and what to send instead (a bare "not
# supported" left the client guessing)
_NOT_SUPPORTED = {
    "suffix": "fill-in-the-middle is not offered; send the text before the gap as prompt",
    "template": "Coda renders the model's own chat template (Jinja, not Go templates); send "
                "a prompt you rendered with raw: true instead",
    "images": "no vision model is served",
}


def generate_checks(body: OllamaGenerateRequest) -> None:
    for name, value in (("suffix", body.suffix), ("template", body.template),
                        ("images", body.images)):
        if value:
            raise InvalidRequestError(f"{name}: not supported: {_NOT_SUPPORTED[name]}",
                                      field=name)
    if body.raw and body.system:
        # NOTE: Ollama drops the system text of a raw prompt without a word (P1: never here)
        raise InvalidRequestError("system: not used with raw: true (the prompt is sent as is, "
                                  "no template); write the system text into the prompt",
                                  field="system")
