"""Structured-output validity rate on the default model (issue 5): prints figures.

    python benchmarks/bench_structured.py [--seeds 100]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig

# NOTE: test support (not shipped in the package) is imported from the repository's tests/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.structured_eval import PERSON_SCHEMA, structured_validity  # noqa: E402

SCHEMAS = {
    "person": PERSON_SCHEMA,
    "enum+int": {"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 1,
                                                    "maximum": 10}},
        "required": ["answer", "score"], "additionalProperties": False},
    "list": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1,
             "maxItems": 4},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=100)
    args = ap.parse_args()
    with AsyncEngine.from_model_dir(None, EngineConfig(max_num_seqs=64)) as engine:
        print(f"{'schema':10} {'valid':>12} {'grammar_complete':>17} {'seconds':>8}")
        for name, schema in SCHEMAS.items():
            t0 = time.perf_counter()
            r = structured_validity(engine, schema, range(args.seeds))
            print(f"{name:10} {r.valid:>5}/{r.total:<5} ({r.rate:.1%}) {r.grammar_complete:>10} "
                  f"{time.perf_counter() - t0:>8.1f}")
            print(f"           e.g. {r.samples[0][:100]!r}")


if __name__ == "__main__":
    main()
