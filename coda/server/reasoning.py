"""A request's reasoning settings from the model's markers (issue 23 item 3; SPEC K2, S1).

The markers are the tokenizer's ``<think>`` / ``</think>`` tokens (Qwen3, DeepSeek-R1 distills
declare both as added tokens). Whether the output starts inside the reasoning is read from the
prompt's token ids — the rendered generation prompt ends inside a block when its last opener
comes after its last closer (DeepSeek-R1's template ends with ``<think>\\n``) — so every
protocol decides it the same way, from the ids it already has. The split itself is
:mod:`coda.reasoning`; renderers read it from the stream (``StreamEvent.reasoning``,
``Terminal.reasoning``).
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

from coda.errors import InvalidRequestError
from coda.reasoning import CLOSE_MARKER, OPEN_MARKER, ReasoningSpec


def marker_ids(tokenizer: tokenizers.Tokenizer) -> tuple[int, int] | None:
    """The (opener, closer) ids when the vocabulary has both as decodable, non-special
    tokens; None otherwise (no split: a special marker would be skipped by the detokenizer)."""
    ids = tokenizer.token_to_id(OPEN_MARKER), tokenizer.token_to_id(CLOSE_MARKER)
    if ids[0] is None or ids[1] is None:
        return None
    added = tokenizer.get_added_tokens_decoder()
    if any(i in added and added[i].special for i in ids):
        return None
    return ids[0], ids[1]


def reasoning_spec(tokenizer: tokenizers.Tokenizer, prompt_ids: Sequence[int], *,
                   budget: int | None, budget_field: str, grammar: bool = False
                   ) -> ReasoningSpec | None:
    """The request's :class:`ReasoningSpec`, or None when the model has no markers. A budget
    for a model without markers is a 400 naming ``budget_field``. With a grammar (structured
    output, tools) there is no split: the grammar constrains the output from its first token."""
    ids = marker_ids(tokenizer)
    if ids is None or grammar:
        if budget is not None:
            raise InvalidRequestError(
                f"{budget_field}: this model has no reasoning markers ({OPEN_MARKER}, "
                f"{CLOSE_MARKER})" if ids is None else
                f"{budget_field}: a reasoning budget cannot be combined with structured output",
                field=budget_field)
        return None
    open_id, close_id = ids
    last_open = _last(prompt_ids, open_id)
    return ReasoningSpec(inside=last_open > _last(prompt_ids, close_id), close_ids=(close_id,),
                         max_tokens=budget, open_ids=(open_id,))


def _last(ids: Sequence[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1
