"""``coda bench``'s workload and its timed run (SPEC P5): the mixed-length prompts, drawn
deterministically from a seed, and one pass of them through the engine, timed from the
arrival of stream events in the reader's event loop (what a client sees). The options and the
command are :mod:`coda.bench`'s; the figures and the table :mod:`coda.bench_report`'s.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.progress import Progress

from coda.early_stop import EarlyStopPolicy
from coda.engine.types import GenerationRequest
from coda.sampling import SamplingParams

if TYPE_CHECKING:
    from coda.bench import BenchOptions
    from coda.engine.async_engine import AsyncEngine

# NOTE: public-domain style sentences written for this file; mixed scripts so that byte-level
# tokens split characters (CJK, accents, emoji) exactly as in real multilingual traffic.
TEXTS: tuple[str, ...] = (
    "The old lighthouse keeper climbed the stairs each evening to light the lamp.",
    "Rain fell softly on the village, and the river rose slowly through the night.",
    "She opened the letter, read the first line twice, and smiled at the window.",
    "Le petit café au coin de la rue ouvre très tôt, même le dimanche matin.",
    "Über den Bergen zieht ein Gewitter auf, und die Wanderer suchen Schutz.",
    "El tren llegó tarde a la estación, pero nadie parecía tener prisa.",
    "春の朝、公園の桜がゆっくりと咲き始めました。",
    "我们明天早上一起去图书馆看书吧。",
    "오늘은 날씨가 좋아서 산책을 하기로 했다.",
    "Η θάλασσα ήταν ήρεμη και ο ουρανός καθαρός.",
    "Мы долго шли по лесу, пока не увидели озеро.",
    "Weekend plans: hiking 🥾, a picnic 🧺 and a long nap 😴.",
    "Once upon a time, in a kingdom by the sea, there lived a curious fox.",
    "Naïve questions are welcome; déjà vu is not an answer, señor.",
)
PROMPT_LENGTHS: tuple[tuple[int, int], ...] = ((4, 16), (16, 48), (48, 128), (128, 256))


@dataclass(frozen=True)
class RunResult:
    """One pass of the workload through the engine (seconds; texts for prefix comparison)."""

    wall_s: float
    output_tokens: int
    ttft_s: tuple[float, ...]
    itl_s: tuple[float, ...]
    e2e_s: tuple[float, ...]
    texts: tuple[str, ...]
    reasons: tuple[str, ...]
    tokens: tuple[int, ...]
    utf8_tail_affected: int = 0  # requests whose tail policy acted (FAILED, or bytes dropped)
    interrupted: bool = False  # a SIGINT ended the run: the figures are the finished requests'
    done: tuple[int, ...] = ()  # the finished requests' indices in the workload


def make_workload(tokenizer: Any, num_requests: int, seed: int, max_prompt: int
                  ) -> list[tuple[int, ...]]:
    """Deterministic mixed-length prompts: each takes a length band, then sentences in turn."""
    rng = random.Random(seed)
    prompts: list[tuple[int, ...]] = []
    for _ in range(num_requests):
        lo, hi = rng.choice(PROMPT_LENGTHS)
        want = max(1, min(rng.randint(lo, hi), max_prompt))
        ids: list[int] = []
        while len(ids) < want:
            ids.extend(tokenizer.encode(rng.choice(TEXTS) + " ", add_special_tokens=False).ids)
        prompts.append(tuple(ids[:want]))
    return prompts


async def drive_workload(engine: AsyncEngine, prompts: Sequence[tuple[int, ...]],
                         opts: BenchOptions, policy: EarlyStopPolicy | None,
                         progress: Progress | None) -> RunResult:
    """Submit every prompt (at most ``opts.concurrency`` in flight) and time its events."""
    sem = asyncio.Semaphore(opts.concurrency)
    # NOTE: per request, so that an interrupted run reports the finished requests only
    ttft: list[float | None] = [None] * len(prompts)
    itl: list[list[float]] = [[] for _ in prompts]
    e2e: list[float | None] = [None] * len(prompts)
    texts = [""] * len(prompts)
    reasons = [""] * len(prompts)
    tokens = [0] * len(prompts)
    affected = [False] * len(prompts)
    task = progress.add_task("requests", total=len(prompts)) if progress is not None else None
    sampling = SamplingParams(temperature=0.0, ignore_eos=True, seed=opts.seed)

    async def one(i: int) -> None:
        async with sem:
            req = GenerationRequest(prompts[i], sampling=sampling, max_tokens=opts.max_tokens,
                                    early_stop=policy, request_id=f"bench-{i}",
                                    utf8_tail=opts.utf8_tail)
            t0 = time.perf_counter()
            handle = engine.submit(req)
            last: float | None = None
            chunks: list[bytes] = []
            async for ev in handle.events():
                now = time.perf_counter()
                if ev.terminal is not None:
                    e2e[i] = now - t0
                    tokens[i] = ev.terminal.usage.selected_tokens
                    term = ev.terminal
                    # NOTE: max_tokens may end mid-character: per the K3 policy, a decoding
                    # error or a removed tail (auto, drop)
                    code = f":{term.error_code.value}" if term.error_code is not None else ""
                    reasons[i] = term.finish_reason.value + code
                    affected[i] = bool(term.dropped_tail) or code == ":decoding_error"
                elif ev.data:
                    if last is None:
                        ttft[i] = now - t0
                    else:
                        itl[i].append(now - last)
                    last = now
                    chunks.append(ev.data)
            texts[i] = b"".join(chunks).decode("utf-8", "replace")
        if progress is not None and task is not None:
            progress.advance(task)

    start = time.perf_counter()
    interrupted = False
    try:
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    except asyncio.CancelledError:
        # NOTE: asyncio.run's answer to a SIGINT: the requests still running are cancelled
        # with the gather; returning (not raising) hands back what finished, and a second
        # SIGINT is asyncio.run's KeyboardInterrupt at once
        interrupted = True
    wall = time.perf_counter() - start
    done = [i for i, r in enumerate(reasons) if r]
    return RunResult(wall, sum(tokens[i] for i in done),
                     tuple(t for i in done if (t := ttft[i]) is not None),
                     tuple(g for i in done for g in itl[i]),
                     tuple(t for i in done if (t := e2e[i]) is not None),
                     tuple(texts[i] for i in done), tuple(reasons[i] for i in done),
                     tuple(tokens[i] for i in done), sum(affected[i] for i in done), interrupted,
                     tuple(done))
