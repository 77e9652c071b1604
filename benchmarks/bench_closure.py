"""Validity of structured output under tight budgets, with vs without closing within the budget
(issue 13 item 2; SPEC L4).

For each of five schemas (unbounded strings, numbers, arrays, nesting) and each seed, one
request at temperature 0.8 with a tight ``max_tokens``; the output is validated with
``jsonschema``. The same requests run with ``close_within_budget`` off (the old behaviour) and
on (the default). A request whose budget is below the shortest completion is refused at
admission (400 on the wire); it is counted as "refused", never as valid.

    python benchmarks/bench_closure.py --seeds 100            # default model
    python benchmarks/bench_closure.py --seeds 100 --model DIR --prompt-template chatml
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

SCHEMAS: dict[str, tuple[dict[str, Any], int]] = {
    # name: (schema, max_tokens) — budgets chosen so that free generation often runs out
    "free_string": ({"type": "object", "required": ["text"], "additionalProperties": False,
                     "properties": {"text": {"type": "string"}}}, 16),
    "big_number": ({"type": "object", "required": ["n", "x"], "additionalProperties": False,
                    "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}}, 18),
    "string_array": ({"type": "array", "items": {"type": "string"}, "minItems": 1}, 14),
    "record": ({"type": "object", "additionalProperties": False,
                "required": ["name", "age", "tags", "note"],
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                               "tags": {"type": "array", "items": {"type": "string"}},
                               "note": {"type": "string"}}}, 40),
    "nested": ({"type": "object", "required": ["items"], "additionalProperties": False,
                "properties": {"items": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["k", "v"], "additionalProperties": False,
                    "properties": {"k": {"type": "string"}, "v": {"type": "number"}}}}}}, 32),
}


def run(model: str | None, seeds: int, prompt: str) -> dict[str, Any]:
    import jsonschema

    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig, GenerationRequest, GrammarSpec
    from coda.errors import InvalidRequestError
    from coda.sampling import SamplingParams

    out: dict[str, Any] = {}
    with AsyncEngine.from_model_dir(Path(model) if model else None,
                                    EngineConfig(max_num_seqs=64)) as engine:
        ids = tuple(engine.tokenizer.encode(prompt, add_special_tokens=False).ids)
        for name, (schema, budget) in SCHEMAS.items():
            for closure in (False, True):
                t0 = time.perf_counter()
                counts: Counter[str] = Counter()
                handles = []
                for seed in range(seeds):
                    req = GenerationRequest(
                        ids, SamplingParams(temperature=0.8, seed=seed), max_tokens=budget,
                        grammar=GrammarSpec(json_schema=schema, close_within_budget=closure))
                    try:
                        handles.append(engine.submit(req))
                    except InvalidRequestError:
                        counts["refused"] += 1
                for h in handles:
                    terminal = h.wait(600)
                    counts[f"reason:{terminal.finish_reason.value}"] += 1
                    try:
                        jsonschema.validate(json.loads(h.stream.text()), schema)
                        counts["valid"] += 1
                    except (ValueError, jsonschema.ValidationError):
                        counts["invalid"] += 1
                admitted = len(handles)
                key = f"{name}/{'closure' if closure else 'off'}"
                out[key] = {"max_tokens": budget, "admitted": admitted,
                            "valid": counts["valid"],
                            "valid_rate": counts["valid"] / admitted if admitted else None,
                            "counts": dict(counts), "wall_s": time.perf_counter() - t0}
                print(f"{key:28s} max_tokens={budget:3d} admitted={admitted:3d} "
                      f"valid={counts['valid']:3d} "
                      f"({100 * counts['valid'] / max(admitted, 1):5.1f}%)  "
                      + " ".join(f"{k}={v}" for k, v in sorted(counts.items())
                                 if k.startswith("reason:")), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--prompt", default="Answer as JSON:")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    result = run(args.model, args.seeds, args.prompt)
    on = [v for k, v in result.items() if k.endswith("/closure") and v["admitted"]]
    off = [v for k, v in result.items() if k.endswith("/off")]
    print(f"overall: off {sum(v['valid'] for v in off)}/{sum(v['admitted'] for v in off)} valid, "
          f"closure {sum(v['valid'] for v in on)}/{sum(v['admitted'] for v in on)} valid")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
