"""Ollama ``/api/generate``'s ``context`` (SPEC P1, P3): the token ids of what the model saw
and produced, so a client continues a conversation by sending them back.

The done object carries ``context``: the prompt's ids (a request's own ``context`` first),
then every selected output token's id — the stop's too (EOS, a stop string's tokens), which
the model produced and a continuation must see, so the next turn follows a closed one. A
request's ``context`` (a list of ints, each an id of the model's vocabulary) goes before the
new prompt's ids: the prompt templated (or ``raw``) and appended, as Ollama does; after a
context a raw prompt is encoded without the special tokens the tokenizer adds, and a templated
one without the BOS its template writes (Gemma's ``<bos>``): a BOS opens a sequence, not a turn.
A context that with the prompt does not fit the model's context is the over-long prompt's
400 (the one budget check in :mod:`coda.engine.plan`).
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

from coda.errors import InvalidRequestError
from coda.reader import replay
from coda.server.records import Record
from coda.server.render_spec import OllamaRender
from coda.stream import EventType, RequestStream


def check_context(tokenizer: tokenizers.Tokenizer, context: Sequence[int] | None) -> None:
    """A 400 naming ``context`` for an id outside the vocabulary (the schema refused a
    non-list and a non-int already)."""
    if not context:
        return
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    bad = next((t for t in context if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"context: token id {bad} is not in this model's vocabulary "
                                  f"[0, {vocab}); send back the context a response gave",
                                  field="context")


def joined(context: Sequence[int] | None, ids: list[int]) -> list[int]:
    """``context`` then the new prompt's ``ids``."""
    return [*context, *ids] if context else ids


def output_ids(stream: RequestStream) -> list[int]:
    """Every selected output token's id, in order: the deltas' tokens, then the terminal's
    trailing ones (held back, EOS, a stop's): together every selected token (coda.stream)."""
    ids = [t.token_id for e in replay(stream) if e.type is EventType.DELTA for t in e.tokens]
    terminal = stream.terminal
    return ids + [t.token_id for t in terminal.trailing_tokens] if terminal else ids


def done_context(record: Record) -> dict[str, list[int]]:
    """A generate's done object's ``context`` field: the prompt's ids, then the output's (a
    chat's done object has none, as Ollama's: its callers never ask)."""
    spec = record.spec
    assert isinstance(spec, OllamaRender) and not spec.chat
    return {"context": [*spec.prompt_ids, *output_ids(record.handles[0].stream)]}
