"""A draft model inside the memory budget (issue 21 item 2, issue 19 item 3; SPEC T3, E1).

The draft (``--draft-model``) was loaded after the target's KV cache was sized, so its weights
and its own cache came on top of ``--memory-budget`` (or the default budget). Now they come out
of it first (``kv_cache_budget``'s one split): the reported shares sum within the budget, and a
budget that cannot hold both models is refused at start naming both shares."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coda.engine.async_engine import AsyncEngine
from coda.engine.kv_budget import (
    DRAFT_SPARE_BLOCKS,
    DraftShare,
    MemoryBudget,
    MemoryBudgetError,
    kv_cache_budget,
)
from coda.engine.types import EngineConfig
from coda.server.listen import bind_listener

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


@given(bpt=st.integers(1, 4096), dbpt=st.integers(1, 4096), bs=st.sampled_from([1, 16]),
       weights=st.integers(0, 10**7), dweights=st.integers(0, 10**7),
       budget=st.integers(1, 4 * 10**7), context=st.integers(1, 600), seqs=st.integers(1, 8))
def test_t3_a_draft_is_inside_the_budget_split(bpt: int, dbpt: int, bs: int, weights: int,
                                               dweights: int, budget: int, context: int,
                                               seqs: int) -> None:
    """T3: the target's cache is the most whole blocks ``n`` (at most ``seqs`` full contexts)
    such that both models' weights, ``n`` target blocks and ``n + DRAFT_SPARE_BLOCKS`` draft
    blocks fit the budget (brute force over ``n``); no ``n >= 1`` fits: refused, naming both."""
    block, dblock = bpt * bs, dbpt * bs
    need = seqs * -(-context // bs)
    fits = [n for n in range(1, need + 1)
            if weights + dweights + n * block + (n + DRAFT_SPARE_BLOCKS) * dblock <= budget]
    args = dict(bytes_per_token=bpt, block_size=bs, context=context, max_num_seqs=seqs,
                kv_cache_bytes=None, memory_fraction=None, weights_bytes=weights,
                memory_budget=MemoryBudget(budget, "test"), draft=DraftShare(dweights, dbpt))
    if not fits:
        with pytest.raises(MemoryBudgetError, match="the model and its draft") as err:
            kv_cache_budget(**args)  # type: ignore[arg-type]
        assert "the model needs" in str(err.value) and "the draft" in str(err.value)
        return
    got = kv_cache_budget(**args)  # type: ignore[arg-type]
    n = max(fits)
    assert (got.num_bytes, got.draft_bytes) == (n * block, (n + DRAFT_SPARE_BLOCKS) * dblock)
    assert got.budget is not None and got.budget.num_bytes == budget


@given(bpt=st.integers(1, 512), dbpt=st.integers(1, 512), kv=st.integers(16 * 512, 10**7),
       frac=st.floats(0.01, 1.0), free=st.integers(10**5, 10**8))
def test_t3_exact_size_and_fraction_with_a_draft(bpt: int, dbpt: int, kv: int, frac: float,
                                                 free: int) -> None:
    """``--kv-cache-bytes`` is the target's cache exactly, the draft's holding as many tokens
    (plus its spare blocks) beside it; ``--kv-cache-fraction`` holds both caches (one block
    of the target's at least)."""
    block, dblock = bpt * 16, dbpt * 16
    common = dict(bytes_per_token=bpt, block_size=16, context=512, max_num_seqs=4,
                  draft=DraftShare(10**6, dbpt))
    exact = kv_cache_budget(kv_cache_bytes=kv, memory_fraction=None, **common)  # type: ignore[arg-type]
    assert exact.num_bytes == kv
    assert exact.draft_bytes == (kv // block + DRAFT_SPARE_BLOCKS) * dblock
    share = int(frac * free)
    got = kv_cache_budget(kv_cache_bytes=None, memory_fraction=frac, available=free,
                          **common)  # type: ignore[arg-type]
    n = got.num_bytes // block
    assert got.num_bytes == n * block and 1 <= n <= 4 * 32
    assert got.draft_bytes == (n + DRAFT_SPARE_BLOCKS) * dblock
    assert n == 1 or got.num_bytes + got.draft_bytes <= share


def _split(summary: dict[str, object]) -> tuple[int, int]:
    """(the reported shares' sum, the budget) of a load summary."""
    parts = ("weights_bytes", "kv_cache_reserved_bytes", "draft_weights_bytes",
             "draft_kv_cache_bytes")
    return (sum(int(summary[k]) for k in parts),  # type: ignore[call-overload]
            int(summary["memory_budget_bytes"]))  # type: ignore[call-overload]


@pytest.mark.parametrize("budget", [None, "60MiB", "27MiB"], ids=["default", "roomy", "tight"])
def test_t3_engine_reports_a_split_within_the_budget(server_checkpoint: Path,
                                                     budget: str | None) -> None:
    """T3: target and draft (the tiny model drafting for itself) loaded under the default
    budget, a roomy one (full contexts) and a tight one (fewer blocks): the load summary's
    weights, KV cache, draft weights and draft KV cache sum within ``memory_budget_bytes``; the
    draft's cache holds the target's blocks plus its spare ones. Before the fix the draft came
    on top (a 27 MiB budget held 30 MiB)."""
    engine = AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(
        max_num_seqs=4, memory_budget=budget, draft_model=str(server_checkpoint)))
    summary = engine.load_summary()
    total, limit = _split(summary)
    assert total <= limit, (total, limit, summary)
    assert engine.drafter is not None
    assert engine.drafter.runner.num_blocks == engine.runner.num_blocks + DRAFT_SPARE_BLOCKS
    if budget == "tight":
        assert engine.context_lowered_from is not None  # NOTE: the draft's share was taken
        assert limit - total < 2 * 65536  # NOTE: one target + one draft block: as full as fits
    assert any(line.startswith("memory budget") and "draft KV cache" in line
               for line in engine.describe())


@pytest.fixture
def port() -> Iterator[int]:
    with bind_listener("127.0.0.1", 0) as s:
        p = s.getsockname()[1]
    yield p


def _serve(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "coda", "serve", *argv], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_e1_serve_refuses_a_budget_too_small_for_target_and_draft(server_checkpoint: Path,
                                                                  port: int) -> None:
    """E1, T3: 20 MiB holds the tiny model alone (12.7 MiB of weights) but not with itself as
    the draft: exit 2 at start, one line naming the budget and both models' shares, no
    traceback (it was either served over budget, or refused as a several-models flag)."""
    ck = str(server_checkpoint)
    proc = _serve("--port", str(port), "--model", ck, "--draft-model", ck,
                  "--memory-budget", "20MiB")
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # NOTE: served instead of refused (the budget overrun)
        proc.kill()
        proc.communicate()
        pytest.fail("a budget too small for target + draft was served")
    assert proc.returncode == 2, err[-2000:]
    assert "memory budget 20.0 MiB (--memory-budget 20MiB) is too small for the model and " \
           "its draft (--draft-model): the model needs 12.7 MiB" in err, err[-2000:]
    assert "Traceback" not in err


def test_t3_serve_with_a_draft_reports_its_share_of_the_budget(server_checkpoint: Path,
                                                               port: int) -> None:
    """T3, O1: ``coda serve --model M --draft-model M --memory-budget 40MiB`` serves one model
    (the budget is that engine's, not the several-models router's, which refuses a draft); the
    ``model loaded`` JSON line's shares, the draft's included, sum within the budget."""
    ck = str(server_checkpoint)
    proc = _serve("--port", str(port), "--model", ck, "--draft-model", ck,
                  "--memory-budget", "40MiB")
    try:
        assert proc.stderr is not None
        loaded = None
        for line in proc.stderr:
            if line.startswith("{") and json.loads(line).get("msg") == "model loaded":
                loaded = json.loads(line)
                break
        assert loaded is not None, "no 'model loaded' line"
        total, limit = _split(loaded)
        assert limit == 40 * MiB and total <= limit, loaded
        assert loaded["draft_kv_cache_bytes"] > 0 and loaded["speculative"] == "draft"
        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            pytest.fail("never healthy")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize(("extra", "said"), [
    (["--kv-cache-bytes", "1000000"], "--kv-cache-bytes and --memory-budget both size"),
    (["--kv-cache-fraction", "0.5"], "--kv-cache-fraction and --memory-budget both size"),
    (["--replicas", "2"], "not supported with --replicas")], ids=["bytes", "fraction", "replicas"])
def test_e1_serve_draft_budget_contradictions_exit_2_before_the_load(
        server_checkpoint: Path, port: int, extra: list[str], said: str) -> None:
    """E1: with ``--draft-model`` the budget is the one engine's, so an exact KV size beside it
    is the usage error ``coda generate`` gives (one of them would be ignored), and replicas
    keep refusing ``--memory-budget``: one line, exit 2, no model loaded."""
    ck = str(server_checkpoint)
    proc = _serve("--port", str(port), "--model", ck, "--draft-model", ck,
                  "--memory-budget", "1GiB", *extra)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and said in err, err[-2000:]
    assert "loading model" not in err and "Traceback" not in err
