"""T4 through the engine's public API: a seeded request gets the same tokens — and the same
logprobs, bit for bit — alone and however it is batched (issue 10 item 3).

:func:`check_invariance` runs seeded requests (greedy and sampled with temperature, top-p and a
seed) one at a time on a reference engine (one-chunk prefill, prefix cache off, a cache large
enough never to preempt), then under each scenario on engines sharing the same loaded model:

* ``crowd``: all requests submitted at once (continuous batching);
* ``chunked``: in a crowd, prompts prefilled in several small chunks
  (``max_num_batched_tokens`` / ``long_prefill_chunk``);
* ``preempted``: in a crowd, a KV cache too small for all, so sequences are preempted and
  recomputed (the report says how many preemptions happened);
* ``prefix-miss`` / ``prefix-hit``: prefix caching on, every request run twice: the second
  run's prompt comes from the cache (the report counts the cached prompt tokens);
* ``streamed``: in a crowd, every stream read live by an asyncio reader.

Comparing logprobs makes the check see a logit that moved even when the token did not. Used
by ``tests/test_engine_invariance.py`` (CI, 16 requests) and ``scripts/invariance_check.py``
(200 requests).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from coda.engine.async_engine import AsyncEngine
from coda.engine.runner import ModelRunner
from coda.engine.types import EngineConfig, GenerationRequest
from coda.models.source import LoadedModel
from coda.sampling import SamplingParams
from coda.stream import RequestStream, StreamEvent

CHUNK = 7  # prefill chunk of the ``chunked`` scenario
SCENARIOS = ("crowd", "chunked", "preempted", "prefix-miss", "prefix-hit", "streamed")
# (token ids, each token's logprob, each token's top logprobs)
Signature = tuple[tuple[int, ...], tuple[float | None, ...], tuple[tuple[tuple[int, float], ...], ...]]


def make_requests(n: int, vocab_size: int, *, seed: int = 0, max_tokens: int = 8,
                  prompt_lengths: tuple[int, int] = (4, 80),
                  lengths: Sequence[int] = ()) -> list[GenerationRequest]:
    """``n`` seeded requests over random prompt ids: even ones greedy, odd ones sampled
    (temperature 0.8, top-p 0.9, their own seed); fixed lengths (EOS ignored); 2 logprobs.
    Prompt lengths are drawn from ``prompt_lengths``, or cycle through ``lengths`` if given."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        size = lengths[i % len(lengths)] if lengths else rng.randint(*prompt_lengths)
        # NOTE: ids from 100 up: clear of the control tokens at the start of most vocabularies
        prompt = tuple(rng.randrange(100, vocab_size) for _ in range(size))
        sampling = (SamplingParams(temperature=0.0, ignore_eos=True, logprobs=2) if i % 2 == 0
                    else SamplingParams(temperature=0.8, top_p=0.9, seed=rng.randrange(2**31),
                                        ignore_eos=True, logprobs=2))
        out.append(GenerationRequest(prompt, sampling, max_tokens=max_tokens, utf8_tail="drop"))
    return out


def signature(events: Sequence[StreamEvent]) -> Signature:
    infos = [t for e in events for t in e.tokens]
    term = events[-1].terminal if events else None
    if term is not None:
        infos += list(term.trailing_tokens)
    return (tuple(t.token_id for t in infos), tuple(t.logprob for t in infos),
            tuple(t.top_logprobs for t in infos))


def _of(stream: RequestStream) -> Signature:
    return signature(stream.events_after(-1))


@dataclass
class InvarianceReport:
    """Per scenario: indices of requests whose signature (tokens and logprobs) differs from the
    alone run, and of those whose tokens differ."""

    requests: int
    differing: dict[str, list[int]] = field(default_factory=dict)
    tokens_differing: dict[str, list[int]] = field(default_factory=dict)
    preemptions: int = 0
    cached_prompt_tokens: int = 0

    def identical(self, scenario: str) -> int:
        return self.requests - len(self.differing[scenario])

    def all_identical(self) -> bool:
        return not any(self.differing.values())

    def record(self, scenario: str, alone: Sequence[Signature], got: Sequence[Signature]) -> None:
        pairs = list(enumerate(zip(alone, got, strict=True)))
        self.differing[scenario] = [i for i, (a, b) in pairs if a != b]
        self.tokens_differing[scenario] = [i for i, (a, b) in pairs if a[0] != b[0]]

    def lines(self) -> list[str]:
        n = self.requests
        out = [f"{s}: {self.identical(s)}/{n} bit-identical tokens and logprobs "
               f"({100 * self.identical(s) / n:.1f}%), {n - len(self.tokens_differing[s])}/{n} "
               f"identical tokens" for s in self.differing]
        out.append(f"preemptions {self.preemptions}; prompt tokens from the prefix cache "
                   f"{self.cached_prompt_tokens}")
        return out


@contextmanager
def engine_on(loaded: LoadedModel, num_blocks: int, **config: object) -> Iterator[AsyncEngine]:
    """An engine (not started) over an already loaded model (its serving mode), with
    ``num_blocks`` KV blocks and the given :class:`EngineConfig` fields; shut down on exit."""
    cfg = replace(EngineConfig(quant=loaded.mode.name, num_blocks=num_blocks), **config)  # type: ignore[arg-type]
    runner = ModelRunner(loaded.model, dtype=loaded.dtype, block_size=cfg.block_size,
                         num_blocks=num_blocks, num_threads=cfg.num_threads)
    engine = AsyncEngine(loaded, runner, cfg)
    try:
        yield engine
    finally:
        engine.shutdown()


def _crowd(engine: AsyncEngine, reqs: Sequence[GenerationRequest],
           timeout: float) -> list[Signature]:
    # NOTE: queued at once (submit_all): the first step sees the whole crowd, so the
    # schedule, hence each scenario's outcome, is reproducible
    engine.start()
    handles = engine.submit_all(list(reqs))
    for h in handles:
        h.wait(timeout)
    return [_of(h.stream) for h in handles]


def _streamed(engine: AsyncEngine, reqs: Sequence[GenerationRequest],
              timeout: float) -> list[Signature]:
    async def read_all() -> list[Signature]:
        engine.start()
        handles = engine.submit_all(list(reqs))

        async def read(h: object) -> Signature:
            seen = [e async for e in h.events()]  # type: ignore[attr-defined]
            return signature(seen)

        return list(await asyncio.wait_for(asyncio.gather(*(read(h) for h in handles)), timeout))

    return asyncio.run(read_all())


def check_invariance(loaded: LoadedModel, reqs: Sequence[GenerationRequest], *,
                     crowd: int | None = None, block_size: int = 16, timeout: float = 3600.0,
                     scenarios: Sequence[str] = SCENARIOS,
                     progress: Callable[[str], None] | None = None) -> InvarianceReport:
    """Run ``reqs`` alone, then under each of ``scenarios`` with ``crowd`` sequences running
    together (default: all of them); see the module docstring."""
    crowd = crowd or len(reqs)
    longest = max(len(r.prompt_token_ids) + (r.max_tokens or 0) for r in reqs)
    per_seq = -(-longest // block_size) + 1
    say = progress or (lambda _text: None)
    report = InvarianceReport(len(reqs))
    # NOTE: one-chunk prefill: the step budget holds the longest prompt
    solo = dict(block_size=block_size, max_num_batched_tokens=max(2048, longest),
                long_prefill_chunk=max(2048, longest), enable_prefix_caching=False)
    with engine_on(loaded, per_seq + 1, **solo) as ref_engine:
        alone = [_crowd(ref_engine, [r], timeout)[0] for r in reqs]
    say(f"alone: {len(reqs)} requests done")
    crowd_blocks = per_seq * crowd + 1
    runs: dict[str, tuple[int, dict[str, object]]] = {
        "crowd": (crowd_blocks, dict(enable_prefix_caching=False)),
        "chunked": (crowd_blocks, dict(enable_prefix_caching=False, max_num_batched_tokens=24,
                                       long_prefill_chunk=CHUNK)),
        # NOTE: room for about a quarter of the crowd at full length: decode must preempt
        "preempted": (max(per_seq + 1, crowd_blocks // 4), dict(enable_prefix_caching=False)),
        "streamed": (crowd_blocks, dict(enable_prefix_caching=False)),
    }
    for name, (blocks, extra) in runs.items():
        if name not in scenarios:
            continue
        with engine_on(loaded, blocks, block_size=block_size, max_num_seqs=crowd,
                       **extra) as engine:
            got = (_streamed if name == "streamed" else _crowd)(engine, reqs, timeout)
            if name == "preempted":
                report.preemptions = engine.stats().num_preemptions_total
        report.record(name, alone, got)
        say(f"{name}: {report.identical(name)}/{len(reqs)}")
    if "prefix-hit" in scenarios or "prefix-miss" in scenarios:
        # NOTE: each crowd runs twice in a row; the cache keeps a crowd's prompts in between
        first: list[Signature] = []
        second: list[Signature] = []
        with engine_on(loaded, 2 * crowd_blocks, block_size=block_size, max_num_seqs=crowd,
                       enable_prefix_caching=True) as engine:
            for at in range(0, len(reqs), crowd):
                part = reqs[at:at + crowd]
                first += _crowd(engine, part, timeout)
                handles = [engine.submit(r) for r in part]
                for h in handles:
                    report.cached_prompt_tokens += h.wait(timeout).usage.cached_prompt_tokens
                    second.append(_of(h.stream))
        for name, got in (("prefix-miss", first), ("prefix-hit", second)):
            report.record(name, alone, got)
            say(f"{name}: {report.identical(name)}/{len(reqs)}")
    return report
