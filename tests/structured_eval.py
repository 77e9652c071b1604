"""Structured-output validity on a model: generate with a JSON schema across seeds and
validate each output with ``jsonschema`` (issue 5 item 4). Used by the test on the default
model and by ``benchmarks/bench_structured.py``; kept apart from the engine (it imports the
engine, never the other way round)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import GenerationRequest, GrammarSpec
from coda.sampling import SamplingParams

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "curious"]},
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 12},
                    "maxItems": 3},
    },
    "required": ["name", "age", "mood", "friends"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class ValidityResult:
    total: int
    valid: int
    grammar_complete: int
    samples: tuple[str, ...]

    @property
    def rate(self) -> float:
        return self.valid / self.total if self.total else 0.0


def structured_validity(engine: AsyncEngine, schema: dict[str, Any], seeds: range,
                        prompt: str = "Describe a person as JSON:", max_tokens: int = 160,
                        temperature: float = 0.8) -> ValidityResult:
    """Submit one request per seed (all at once, batched) and validate each output."""
    import jsonschema

    ids = tuple(engine.tokenizer.encode(prompt, add_special_tokens=False).ids)
    handles = [engine.submit(GenerationRequest(
        ids, SamplingParams(temperature=temperature, seed=seed), max_tokens=max_tokens,
        grammar=GrammarSpec(json_schema=schema))) for seed in seeds]
    valid = complete = 0
    samples: list[str] = []
    for h in handles:
        terminal = h.wait(300)
        text = h.stream.text()
        samples.append(text)
        complete += terminal.finish_reason.value == "grammar_complete"
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            continue
        valid += 1
    return ValidityResult(len(handles), valid, complete, tuple(samples))
