"""The non-streamed answer of a chat completion or a legacy completion (SPEC P1, L6): a
finished record's ``chat.completion`` / ``text_completion`` object, each choice with the
closest OpenAI ``finish_reason`` and the exact outcome in ``coda``; a stored chat completion's
retrieved object is this one (:mod:`coda.server.chat_store_routes`). The stream's chunks are
:mod:`coda.server.openai_stream`, the request's parse :mod:`coda.server.openai_routes`."""

from __future__ import annotations

from typing import Any

from coda.finish import Terminal
from coda.server import logprobs as lp
from coda.server import tools as tl
from coda.server.common import collect
from coda.server.http_errors import is_failed
from coda.server.mapping import coda_extension, openai_finish_reason, system_fingerprint
from coda.server.openai_stream import reported_usage
from coda.server.records import Record
from coda.server.render_spec import OpenAIRender


def final_object(record: Record, terminals: list[Terminal],
                 spec: OpenAIRender) -> dict[str, Any]:
    """The non-streamed answer (chat or legacy) of a finished record; a stored chat
    completion's retrieved object is this one (coda.server.chat_store_routes)."""
    chat = record.kind == "chat"
    with_logprobs = spec.logprobs
    choices = []
    for i, h in enumerate(record.handles):
        c = collect(h.stream)
        # NOTE: L4, K3: a FAILED choice (the 500's body) did not end in any way OpenAI names:
        # null, as its stream sends no finish; ``coda`` keeps the loop's reason (docs/api.md
        # "A FAILED request": the finish-reason table is for FINISHED and CANCELLED ones)
        reason = (None if is_failed(c.terminal)
                  else openai_finish_reason(c.terminal.finish_reason))
        ext = coda_extension(c.terminal)
        if chat:
            logprobs = ({"content": lp.chat_entries([t for _, ts in c.deltas for t in ts],
                                             skip_special=spec.skip_special),
                         "refusal": None} if with_logprobs else None)
            # NOTE: as OpenAI's message: no refusal, no annotations (no web search)
            message: dict[str, Any] = {"role": "assistant", "content": c.text,
                                       "refusal": None, "annotations": []}
            if c.terminal.reasoning is not None and spec.reasoning:
                # NOTE: issue 23: vLLM's name and DeepSeek's / SGLang's, the same text
                message["reasoning"] = message["reasoning_content"] = c.reasoning
            if spec.tools:
                text, calls, removed = tl.split(c.text)
                ext["tool_calls"] = {"count": len(calls), "removed_bytes": removed}
                message["content"] = text if text or not calls else None
                if calls and spec.legacy_functions:  # NOTE: the deprecated shape, one call
                    message["function_call"] = tl.openai_call(calls[0], record.id)["function"]
                    reason = "function_call" if reason == "stop" else reason
                elif calls:
                    message["tool_calls"] = [tl.openai_call(k, record.id, choice=i)
                                             for k in calls]
                    reason = "tool_calls" if reason == "stop" else reason
            choices.append({"index": i, "message": message,
                            "logprobs": logprobs, "finish_reason": reason, "coda": ext})
        else:
            echo = spec.echo[i // spec.n] if spec.echo else ""
            legacy = None
            if with_logprobs:
                parts = [spec.echo_logprobs[i // spec.n]] if spec.echo_logprobs else []
                pos = len(echo)
                for text, toks in c.deltas:
                    parts.append(lp.legacy_logprobs(
                        toks, pos, pos + len(text),
                        skip_special=spec.skip_special))
                    pos += len(text)
                legacy = lp.merge_legacy(parts)
            choices.append({"index": i, "text": echo + c.text, "logprobs": legacy,
                            "finish_reason": reason, "coda": ext})
    tier = {"service_tier": spec.service_tier} if spec.service_tier else {}
    return {"id": record.id, "object": "chat.completion" if chat else "text_completion",
            "created": record.created, "model": record.model, **tier,
            "system_fingerprint": system_fingerprint(terminals[0].model_snapshot),
            "choices": choices, "usage": reported_usage(terminals, spec)}
