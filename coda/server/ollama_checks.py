"""The checks of an Ollama ``/api/chat`` / ``/api/generate`` body before its prompt is
rendered (issue 23 item 2; SPEC P1): the fields Coda refuses, each with what to send instead
(:mod:`coda.server.ollama_routes` runs them).
"""

from __future__ import annotations

from coda.errors import InvalidRequestError
from coda.server.ollama_schemas import OllamaChatRequest, OllamaGenerateRequest

OllamaBody = OllamaChatRequest | OllamaGenerateRequest


def _check_common(body: OllamaBody) -> None:
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


def _generate_checks(body: OllamaGenerateRequest) -> None:
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


def check_body(body: OllamaBody) -> None:
    """Every check of the body before its prompt is rendered (one call from the route)."""
    _check_common(body)
    if isinstance(body, OllamaGenerateRequest):
        _generate_checks(body)
