"""Where hostile input stops, before it costs the server anything (issue 11 item 1; SPEC L5).

Three guards, cheapest first:

1. **Body size** — :class:`BodyLimitMiddleware` refuses a request body over
   ``ServerSettings.max_body_bytes`` with 413 (protocol error shape) *before parsing it*: a
   ``Content-Length`` over the bound is refused without reading, and the bytes of every body
   (a chunked one has no ``Content-Length``) are counted as they arrive. The body in hand, a
   value anywhere in it that no answer can carry (a string holding a lone surrogate, JSON's
   ``"\\ud800"``; a number that is not finite, ``NaN`` / ``Infinity`` / ``1e400``) is a 400
   naming its path (:func:`unencodable`): such a value, echoed (``metadata``, ``user``,
   ``text.format``) or quoted by an error, was a 500 when the answer was encoded, after the
   request had run, and a stored one broke every later listing.
2. **Prompt bytes** — :class:`PromptBound` rejects, before tokenizing, a prompt whose byte
   length alone proves it cannot fit the context: each token's text is at most
   ``max_token_bytes`` long, so a prompt of ``b`` bytes has at least ``ceil(b / max_token_bytes)``
   tokens. The bound is only *certain* for tokenizers that drop nothing of the text: no
   normalizer, a ByteLevel or Metaspace pre-tokenizer, and no fused unknown tokens
   (byte-fallback tokens are longer than the byte they stand for, so they only strengthen it),
   or a GGUF SentencePiece tokenizer (:func:`coda.models.gguf_spm.exact_spm`: whole tokens or
   single characters, a normalizer that only lengthens). Otherwise only the exact check after
   tokenizing applies.
3. **Never block the event loop** — chat templates are rendered and prompts tokenized on a
   worker thread (``asyncio.to_thread``, in each adapter's parse), so one huge prompt never
   freezes other streams or ``/health``.

Overload (a bounded waiting queue → 429 with ``Retry-After``) is checked before every engine
request a route submits by :meth:`coda.server.state.ServerState.admit`: in ``submit_all``, and
before a prompt is scored (legacy completions ``echo`` + ``logprobs``, :mod:`coda.server.echo`),
and before an embedding's inputs are tokenized (:mod:`coda.server.embeddings`, one per input).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coda.errors import ContextLengthExceededError
from coda.models.gguf_spm import is_exact_spm
from coda.server.http_errors import error_response, protocol_of

_CERTAIN_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace"})
_PARSE_ON_LOOP_BYTES = 1 << 16


class BodyLimitMiddleware:
    """413 for a request body over ``max_bytes``, counted as it arrives (see module doc)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:  # NOTE: nothing is parsed; the buffer is dropped
                chunks.clear()
                await self._refuse(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = b"".join(chunks)
        # NOTE: a large body is parsed on a worker thread (guard 3: the loop is never blocked)
        bad = (unencodable(whole) if len(whole) < _PARSE_ON_LOOP_BYTES
               else await asyncio.to_thread(unencodable, whole))
        if bad is not None:
            where, fault = bad
            resp = error_response(protocol_of(scope["path"]), 400, f"{where}: {fault}",
                                  param=re.split(r"[.\[]", where, maxsplit=1)[0] or None,
                                  code="invalid_request")
            await resp(scope, replay_nothing, send)
            return
        pending: list[Message] = [{"type": "http.request", "body": whole, "more_body": False}]

        async def replay() -> Message:
            # NOTE: the body once, then the real channel (routes watch it for disconnects)
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp = error_response(protocol_of(scope["path"]), 413,
                              f"request body exceeds {self.max_bytes} bytes",
                              code="request_too_large", headers={"connection": "close"})
        await resp(scope, receive, send)


async def replay_nothing() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


# NOTE: a JSON escape of a surrogate code point, paired or not (a pair is one ordinary
# character, as a client that escapes all non-ASCII sends it): only a body holding one is walked
# for a lone one. A literal prefix, so the search runs at memchr speed.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class _NonFinite(Exception):
    """A NaN / Infinity literal, or a number past a float's range, in :func:`unencodable`'s
    parse (raised out of it where no path is sought; the value where one is)."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite
    return value


def _refuse_constant(text: str) -> float:
    raise _NonFinite


def unencodable(body: bytes) -> tuple[str, str] | None:
    """The path (``messages[0].content``) and the fault of the first value of a JSON body (a
    key or a string, a number) that no answer can carry: a string holding a lone surrogate
    (JSON ``"\\ud800"``, which no UTF-8 encodes) or a number that is not finite (``NaN``,
    ``Infinity``, ``1e400``: not JSON, though Python's parser reads them). None for every other
    body (one that is no JSON too: the route answers that). Either value, echoed
    (``metadata``, ``user``, ``text.format``) or quoted by an error, was a 500 when the answer
    was encoded, after the request had run. One parse (a JSON parser's speed, a regex scan of
    the bytes was slower); the tree is walked only when one of the two is in it."""
    if not _SURROGATE_ESCAPE.search(body):
        try:
            json.loads(body, parse_float=_finite, parse_constant=_refuse_constant)
        except _NonFinite:
            pass
        except (ValueError, RecursionError):  # NOTE: the route answers it (a 400)
            return None
        else:
            return None
    try:
        data = json.loads(body, parse_constant=_NonFinite)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str) and not _encodable(value):
            return path or "body", _NOT_TEXT
        if isinstance(value, _NonFinite) or (isinstance(value, float)
                                             and not math.isfinite(value)):
            return path or "body", "must be a finite number (NaN and Infinity are not JSON)"
        if isinstance(value, dict):
            for key, item in reversed(value.items()):
                name = f"{path}.{key}" if path else str(key)
                if not _encodable(key):
                    return name.encode("utf-8", "backslashreplace").decode(), _NOT_TEXT
                stack.append((name, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


_NOT_TEXT = "must be valid Unicode text (no lone surrogates)"


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _only_lengthens(normalizer: Any) -> bool:
    """Whether ``normalizer`` (None, or Prepend / plain-string Replace steps whose
    replacement is at least as long as what it replaces) can never shorten a text's bytes."""
    if normalizer is None:
        return True
    spec = json.loads(normalizer.__getstate__())
    steps = spec.get("normalizers", []) if spec.get("type") == "Sequence" else [spec]

    def lengthens(step: dict[str, Any]) -> bool:
        if step.get("type") == "Prepend":
            return True
        pattern = (step.get("pattern") or {}).get("String")
        return (step.get("type") == "Replace" and isinstance(pattern, str) and pattern != ""
                and len(str(step.get("content", "")).encode()) >= len(pattern.encode()))

    return all(lengthens(s) for s in steps)


@dataclass(frozen=True)
class PromptBound:
    """A lower bound on a text's token count from its byte length (see the module doc)."""

    max_token_bytes: int
    certain: bool

    @classmethod
    def of(cls, tokenizer: Any) -> PromptBound:
        # NOTE: the parts' own JSON, not the whole tokenizer's: that holds the vocabulary and
        # merges (0.15-0.5 s of every start to parse, issue 19 item 2)
        pre_tok = tokenizer.pre_tokenizer
        pre = json.loads(pre_tok.__getstate__()) if pre_tok is not None else {}
        kinds = ({p.get("type") for p in pre.get("pretokenizers", [])}
                 if pre.get("type") == "Sequence" else {pre.get("type")})
        # NOTE: fused unknowns let one token stand for any run of unknown characters
        fused = bool(getattr(tokenizer.model, "fuse_unk", False))
        certain = (tokenizer.normalizer is None and bool(kinds)
                   and kinds <= _CERTAIN_PRE_TOKENIZERS and not fused)
        # NOTE: a GGUF SentencePiece tokenizer (exact segmentation) cuts the text into whole
        # tokens and single characters (bytes or one unknown), and its normalizer only ever
        # lengthens the text: the bound holds, and a huge prompt is refused untokenized
        certain = certain or (is_exact_spm(tokenizer) and pre_tok is None
                              and _only_lengthens(tokenizer.normalizer))
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        longest = max((len((tokenizer.id_to_token(i) or "").encode()) for i in range(n)),
                      default=1)
        # NOTE: 4: an unknown character (up to 4 UTF-8 bytes) is one token of any text
        return cls(max(longest, 4 if certain else 1), certain)

    def min_tokens(self, text: str) -> int:
        return math.ceil(len(text.encode("utf-8", "surrogatepass")) / self.max_token_bytes)

    def check(self, text: str, context_length: int, field: str) -> None:
        """Raise ContextLengthExceededError if ``text`` cannot fit, without tokenizing."""
        if self.certain and self.min_tokens(text) >= context_length:
            raise ContextLengthExceededError(
                f"the prompt has at least {self.min_tokens(text)} tokens (by its byte length); "
                f"this model's context is {context_length} tokens", field=field)
