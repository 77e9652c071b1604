"""Smoke tests of ``benchmarks/bench_vs_llamacpp.py`` and ``benchmarks/profile_engine_step.py``
(issue 18 item 3) without llama.cpp: argument parsing, the roofline's byte count and
arithmetic, the step split's bookkeeping. No timing is asserted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.gguf_cache import gguf_reader, parsed_once

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _load("bench_vs_llamacpp")


def test_parser_defaults_and_overrides(bench: ModuleType) -> None:
    args = bench.build_parser().parse_args([])
    assert args.modes == "auto,packed-q8" and args.batches == "1,8,32" and args.threads == 1
    args = bench.build_parser().parse_args(["--gguf", "x.gguf", "--batches", "1,8",
                                            "--threads", "2", "--no-llamacpp"])
    assert args.gguf == Path("x.gguf") and args.batches == "1,8" and args.no_llamacpp


def test_weight_bytes_counts_the_head_once_and_skips_gathered_embeddings(bench: ModuleType
                                                                         ) -> None:
    """Untied: the embeddings are gathered (one row a token), the head is read whole; tied:
    the embeddings are the head."""
    layer = [("blk.0.attn_q.weight", 2, 100), ("blk.0.attn_norm.weight", 1, 4)]
    untied = [("token_embd.weight", 2, 1000), ("output.weight", 2, 700), *layer]
    tied = [("token_embd.weight", 2, 1000), *layer]
    assert bench.weight_bytes(untied) == 804
    assert bench.weight_bytes(tied) == 1104


def test_gguf_facts_of_smollm2_match_its_tensor_table(bench: ModuleType) -> None:
    """SmolLM2-135M is tied, so a step reads every tensor of the file once."""
    path = bench.default_gguf()
    with parsed_once():  # NOTE: the session's parse of the file for both (tests/gguf_cache.py)
        facts = bench.gguf_facts(path)
    reader = gguf_reader(path)  # NOTE: gguf.GGUFReader, parsed once a session
    assert facts["weight_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert facts["vocab"] == 49152
    assert facts["kv_elems_per_token"] == 2 * 30 * 3 * 64


def test_roofline_scales_with_batch_and_bandwidth(bench: ModuleType) -> None:
    assert bench.roofline_tok_s(1, 10**9, 20e9) == pytest.approx(20.0)
    assert bench.roofline_tok_s(8, 10**9, 20e9) == pytest.approx(160.0)
    assert bench.copy_bandwidth(1, mib=8, repeats=2) > 0


def test_step_split_parts_sum_to_the_step() -> None:
    prof = _load("profile_engine_step")
    acc = {"kernels": 6.0, "attention": 1.0, "execute": 8.5, "scheduler": 0.5,
           "sampler": 0.25, "stream": 0.75}
    parts = prof.split(12.0, acc)
    assert set(parts) == set(prof.PARTS)
    assert parts["forward rest"] == pytest.approx(1.5)
    assert parts["step rest"] == pytest.approx(2.0)
    assert sum(parts.values()) == pytest.approx(12.0)
