"""On the embedded default model, json_schema outputs validate with jsonschema across seeds
and end grammar_complete (issue 5 item 4; G1, L4)."""

from __future__ import annotations

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig
from tests.structured_eval import PERSON_SCHEMA, structured_validity


def test_g1_default_model_json_schema_outputs_validate_across_seeds() -> None:
    with AsyncEngine.from_model_dir(None, EngineConfig(max_num_seqs=16)) as engine:
        result = structured_validity(engine, PERSON_SCHEMA, range(12))
    assert result.total == 12
    assert result.valid == 12, result.samples
    assert result.grammar_complete == 12
