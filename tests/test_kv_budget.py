"""KV sizing a person expects (issue 19 item 3; SPEC T3, L7, D1): one memory budget (weights +
KV), a cache reserved but committed only as written, reserved and committed bytes reported, and
nothing accepted that the cache could never hold."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coda.engine.async_engine import AsyncEngine
from coda.engine.kv_budget import MemoryBudget, MemoryBudgetError, kv_cache_budget, rss_bytes
from coda.engine.kv_cache import BlockManager
from coda.engine.sequence import Sequence
from coda.engine.types import EngineConfig, GenerationRequest
from coda.errors import ContextLengthExceededError
from coda.sampling import SamplingParams
from tests.conftest import LiveServer


def test_t3_paged_cache_is_reserved_not_committed() -> None:
    """T3: a 1 GiB cache adds (almost) nothing to RSS when made; writing the first k blocks of
    every plane commits about k blocks' bytes, not the reservation (torch.zeros committed all)."""
    import torch

    from coda.models.attention import PagedKVCache

    before = rss_bytes()
    kv = PagedKVCache(num_layers=16, num_blocks=4096, block_size=16, num_kv_heads=2,
                      head_dim=64, dtype=torch.float32)
    assert kv.nbytes == 2**30
    assert rss_bytes() - before < 32 * 2**20
    assert float(kv.layers[5].abs().sum()) == 0.0  # NOTE: zeros, as the attention requires
    before = rss_bytes()
    for layer in kv.layers:
        layer[:, :, :64].fill_(1.0)  # the first 64 blocks of each K/V plane
    grown = rss_bytes() - before
    written = 16 * 2 * 2 * 64 * 16 * 64 * 4  # layers x K/V x heads x blocks x slots x d x 4 B
    assert written <= grown < written + 32 * 2**20


@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 9)), max_size=60),
       caching=st.booleans())
def test_t3_blocks_are_taken_lowest_first_so_committed_is_a_high_water_mark(
        ops: list[tuple[bool, int]], caching: bool) -> None:
    """T3/L7: for every history of allocations and frees, the blocks ever handed out are exactly
    [0, num_touched_blocks); without prefix caching that is the peak number held at once (the
    brute-force oracle: the block tables seen). A FIFO free list would touch every block."""
    bm = BlockManager(num_blocks=24, block_size=2, enable_prefix_caching=caching)
    live: list[Sequence] = []
    seen: set[int] = set()
    peak = 0
    rng = random.Random(len(ops))
    for i, (alloc, n) in enumerate(ops):
        if alloc or not live:
            seq = Sequence(i, [rng.randrange(3) for _ in range(n)], n + 4)
            if not bm.can_allocate(seq):
                continue
            bm.allocate(seq)
            live.append(seq)
            seen.update(seq.block_table)
        else:
            bm.free(live.pop(rng.randrange(len(live))))
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
        bm.check_integrity()
    assert seen == set(range(bm.num_touched_blocks))
    if not caching:
        assert bm.num_touched_blocks == peak


@given(bpt=st.integers(1, 10_000), bs=st.sampled_from([1, 16]), ctx=st.integers(1, 9000),
       seqs=st.integers(1, 64), budget=st.integers(1, 2**36), weights=st.integers(0, 2**35))
def test_t3_kv_reserve_is_full_contexts_capped_by_the_budget_less_the_weights(
        bpt: int, bs: int, ctx: int, seqs: int, budget: int, weights: int) -> None:
    """The reserve is min(max_num_seqs full contexts, budget - weights); a budget leaving less
    than one block after the weights is refused (at start, never a request that waits)."""
    block = bpt * bs
    need = seqs * -(-ctx // bs) * block
    args: dict[str, Any] = dict(bytes_per_token=bpt, block_size=bs, context=ctx,
                                max_num_seqs=seqs, kv_cache_bytes=None, memory_fraction=None,
                                memory_budget=MemoryBudget(budget, "test"),
                                weights_bytes=weights)
    if budget - weights < block:
        with pytest.raises(MemoryBudgetError, match="not one KV block"):
            kv_cache_budget(**args)
        return
    assert kv_cache_budget(**args).num_bytes == min(need, budget - weights)


@pytest.mark.parametrize("text,expected", [("8GiB", 8 * 2**30), ("8G", 8 * 10**9),
                                           ("512 MiB", 512 * 2**20), ("1000000", 10**6),
                                           ("1.5gb", 15 * 10**8), ("25%", 250)])
def test_memory_budget_parses_sizes_and_percentages(text: str, expected: int) -> None:
    assert MemoryBudget.parse(text, available=1000).num_bytes == expected


@pytest.mark.parametrize("text", ["", "lots", "8XB", "0", "-1G", "0%", "150%", "%"])
def test_memory_budget_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(MemoryBudgetError):
        MemoryBudget.parse(text, available=1000)


@pytest.fixture(scope="module")
def sizes(server_checkpoint: Path) -> tuple[int, int]:
    """(weights bytes, bytes of one KV block) of the tiny server checkpoint."""
    engine = AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(num_blocks=4))
    return engine.loaded.weights_bytes, engine.runner.kv_bytes_per_token * engine.runner.block_size


def test_t3_budget_sizes_the_cache_and_committed_grows_as_written(
        server_checkpoint: Path, sizes: tuple[int, int]) -> None:
    """T3: with --memory-budget the cache reserves max_num_seqs full contexts when the budget
    holds them; the load summary and stats() say reserved and committed bytes (0 committed at
    load, then the blocks a request wrote), and how long the load took and the RSS at load."""
    weights, block = sizes
    engine = AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(
        max_num_seqs=2, memory_budget=str(weights + 100 * 2**20)))
    reserved = 2 * engine.context_length * block // engine.runner.block_size
    summary = engine.load_summary()
    assert summary["kv_cache_reserved_bytes"] == reserved == engine.stats().kv_cache_reserved_bytes
    assert summary["kv_cache_committed_bytes"] == 0
    assert "2 full contexts" in str(summary["kv_cache_reason"])
    assert float(summary["load_s"]) > 0 and int(summary["rss_bytes_at_load"]) > 0
    with engine:
        req = GenerationRequest(tuple(range(1, 40)), SamplingParams(temperature=0.0),
                                max_tokens=8)
        assert engine.submit(req).wait(120).state.value == "FINISHED"
    committed = engine.stats().kv_cache_committed_bytes
    assert committed == 3 * block  # NOTE: 47 positions written = 3 blocks of 16
    assert engine.load_summary()["kv_cache_committed_bytes"] == committed


def test_t3_budget_below_the_weights_is_refused_at_start(server_checkpoint: Path,
                                                          sizes: tuple[int, int]) -> None:
    weights, _ = sizes
    with pytest.raises(MemoryBudgetError, match="after the weights"):
        AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(memory_budget=str(weights)))


@pytest.fixture(scope="module")
def small_live(server_checkpoint: Path, sizes: tuple[int, int]) -> Iterator[tuple[str, int]]:
    """A server whose budget leaves 3.5 KV blocks after the weights: the context is lowered."""
    from coda.server.app import create_app

    weights, block = sizes
    engine = AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(
        memory_budget=str(weights + block * 7 // 2)))
    assert engine.context_lowered_from == 512 and engine.context_length == 48
    assert any("context lowered from 512 to 48" in line for line in engine.describe())
    engine.start()
    live = LiveServer(create_app(engine, manage_engine=False)).start()
    yield live.url, engine.context_length
    live.stop()
    engine.shutdown()


def test_d1_budget_below_one_context_serves_what_fits_and_refuses_the_rest_with_a_4xx(
        small_live: tuple[str, int]) -> None:
    """T3/D1 through both SDKs: a budget below one full context lowers the served context;
    a request that fits is served, one the cache could never hold is a 400 naming the field
    (context_length_exceeded), never a request that waits forever."""
    url, context = small_live
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    ok = oai.completions.create(model="tiny-chat", prompt="hello", max_tokens=8,
                                temperature=0.0)
    assert ok.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model="tiny-chat", prompt="hello", max_tokens=context,
                               temperature=0.0)
    assert bad.value.code == "context_length_exceeded"
    ant = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(model="tiny-chat", max_tokens=context, messages=[
            {"role": "user", "content": "hello"}])
    served = ant.messages.create(model="tiny-chat", max_tokens=4, messages=[
        {"role": "user", "content": "hi"}])
    assert served.stop_reason in ("max_tokens", "end_turn")
    metrics = {line.split()[0]: float(line.split()[1]) for line in
               httpx.get(f"{url}/metrics").text.splitlines() if line.startswith("coda:kv_cache_")}
    assert metrics["coda:kv_cache_reserved_bytes"] > 0
    assert 0 < metrics["coda:kv_cache_committed_bytes"] <= metrics["coda:kv_cache_reserved_bytes"]


def test_d1_a_request_the_cache_could_never_hold_is_refused_once_by_the_plan(
        server_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """T3/D1 (issue 22): "can this request ever fit the cache" has one home, the plan. The
    engine lowers the context to the cache, so the plan's budget check refuses a request one
    token past the whole cache with the typed 4xx naming ``max_tokens``, before the scheduler
    sees it; one that fills the cache exactly is not refused a second way: the scheduler admits
    it and it runs to its budget. No other engine or core module raises the refusal."""
    import ast

    engine = AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(num_blocks=3))
    capacity = 3 * engine.runner.block_size
    assert engine.context_length == capacity
    added: list[int] = []
    add = engine.core.scheduler.add
    monkeypatch.setattr(engine.core.scheduler, "add",
                        lambda seq: (added.append(seq.max_total_tokens), add(seq))[1])
    prompt = tuple(range(1, 9))
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    with engine:
        with pytest.raises(ContextLengthExceededError) as exc:
            engine.submit(GenerationRequest(prompt, greedy, max_tokens=capacity - 7))
        assert exc.value.field == "max_tokens"
        assert str(exc.traceback[-1].path).endswith("coda/engine/plan.py")
        assert added == [] and engine.num_waiting() == 0
        full = GenerationRequest(prompt, greedy, max_tokens=capacity - 8)
        term = engine.submit(full).wait(120)
        assert term.state.value == "FINISHED" and term.usage.selected_tokens == capacity - 8
        assert added == [capacity]
    coda = Path(__file__).resolve().parent.parent / "coda"
    raisers = {str(f.relative_to(coda)) for f in [*coda.glob("*.py"), *coda.glob("engine/*.py")]
               if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                      and n.func.id == "ContextLengthExceededError"
                      for n in ast.walk(ast.parse(f.read_text(encoding="utf-8"))))}
    assert raisers == {"engine/plan.py"}


def test_cli_refuses_a_bad_memory_budget_before_loading() -> None:
    """`coda generate --memory-budget lots`: exit 2 with the reason, before any weight is read
    (the budget is parsed first, so a typo costs no load)."""
    from typer.testing import CliRunner

    from coda.cli import app

    res = CliRunner().invoke(app, ["generate", "hi", "--memory-budget", "lots"])
    assert res.exit_code == 2
    assert "memory budget 'lots'" in res.output
    assert "KV cache" not in res.output  # NOTE: the load summary was never printed
