"""Chat ``prediction`` (OpenAI's predicted outputs) at the HTTP edge (SPEC P1, O1).

OpenAI documents the parameters a prediction cannot be combined with (its Predicted Outputs
guide, "Limitations"): ``n`` above 1, ``logprobs``, ``presence_penalty`` or
``frequency_penalty`` above 0, audio (``modalities`` with ``audio``), the budget's newer wire
name (refused by the chat adapter's parse, the one place that reads it: L4), and tools /
function calling. Each is a 400 in OpenAI's error shape naming the parameter, before anything
is tokenized. The prediction itself becomes token ids
(:func:`prediction_ids`): the engine drafts from them where it verifies exactly and counts them
against the output (:mod:`coda.engine.prediction`; docs/api.md, docs/speculative.md).
"""

from __future__ import annotations

import tokenizers

from coda.errors import InvalidRequestError
from coda.server.chat import content_text
from coda.server.schemas import ChatCompletionRequest, Prediction


def _refuse(param: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {what} is not supported with prediction (OpenAI's "
                               f"predicted outputs)", field=param)


def check_prediction(body: ChatCompletionRequest) -> None:
    """Raise :class:`InvalidRequestError` naming the first parameter OpenAI does not allow
    beside a ``prediction`` (module docstring; called only where one was sent)."""
    if body.n > 1:
        raise _refuse("n", "n greater than 1")
    if body.logprobs:
        raise _refuse("logprobs", "logprobs")
    if body.top_logprobs is not None:
        raise _refuse("top_logprobs", "logprobs")
    if body.presence_penalty is not None and body.presence_penalty > 0:
        raise _refuse("presence_penalty", "presence_penalty greater than 0")
    if body.frequency_penalty is not None and body.frequency_penalty > 0:
        raise _refuse("frequency_penalty", "frequency_penalty greater than 0")
    if body.modalities is not None and "audio" in body.modalities:
        raise _refuse("modalities", "audio output")
    if body.tools:
        raise _refuse("tools", "function calling (tools)")
    if body.functions:
        raise _refuse("functions", "function calling (functions)")


def prediction_ids(tokenizer: tokenizers.Tokenizer, prediction: Prediction | None
                   ) -> tuple[int, ...] | None:
    """The prediction's token ids as the model would write the text (no special tokens);
    None where no prediction was sent."""
    if prediction is None:
        return None
    text = content_text(prediction.content, "prediction")  # NOTE: a message's own rule
    if not text:
        return ()
    return tuple(tokenizer.encode(text, add_special_tokens=False).ids)
