"""Engine benchmarks (issue 3 item 8; SPEC T3): efficiency, throughput against
``transformers.generate``, peak memory and KV bytes per token.

Prints figures only (no asserts on time). Run: ``python benchmarks/bench_engine.py``
(the default model, or a random ``tiny`` checkpoint while it is absent; about a minute) and
``python benchmarks/bench_engine.py --smollm`` to add the SmolLM2-135M-shaped random checkpoint
(slow on CPU: several minutes).

* **efficiency** = bare forward time (``ModelRunner.forward_time_s``: the model call and the
  logits) ÷ whole ``EngineCore.step()`` time (safe point, scheduling, metadata, forward,
  sampling, per-token checks, stream), over pure decode steps with exactly B sequences running,
  at B = 1, 8, 32. The step is timed by wrapping ``engine.core.step`` on the engine thread.
* **throughput**: 64 mixed-length prompts (:func:`coda.bench_workload.make_workload`), all in flight,
  greedy, ignore_eos, against ``transformers.generate`` in static left-padded batches of
  ``--hf-batch`` on the same folder, in the same process. Two workloads (``--workload``):
  ``mixed`` (default, with ``equal``): output lengths drawn from ``--min-tokens..--max-tokens``
  per request, which is what continuous batching is for: a static batch runs until its longest
  member, and only each request's own tokens count as useful for HF; ``equal`` (also
  ``--equal-lengths``): exactly ``--max-tokens`` each, the old workload.
* **memory**: RSS sampled every 10 ms during the 64-request run (peak − before), and KV bytes per
  token: the cache tensor's bytes ÷ its token slots, and blocks in use ÷ tokens resident at the
  fullest step, against the formula 2·L·H_kv·d_h·dtype bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from coda.bench import BenchOptions, run_hf
from coda.bench_report import percentile
from coda.bench_workload import RunResult, drive_workload, make_workload
from coda.engine.async_engine import DEFAULT_MODEL_DIR, AsyncEngine
from coda.engine.types import EngineConfig, GenerationRequest
from coda.sampling import SamplingParams

# NOTE: test support (not shipped in the package) is imported from the repository's tests/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.random_checkpoint import make_random_checkpoint  # noqa: E402

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class StepProbe:
    """Wraps ``engine.core.step`` (called on the engine thread) and records each step."""

    engine: AsyncEngine
    steps: list[tuple[float, float, int, int]] = field(default_factory=list)  # wall, fwd, tok, run
    peak_blocks: int = 0
    peak_resident: int = 0

    def install(self) -> None:
        core, runner = self.engine.core, self.engine.runner
        inner = core.step
        bm = core.scheduler.block_manager

        def step() -> int:
            runner.forward_time_s = 0.0
            t0 = time.perf_counter()
            n = inner()
            wall = time.perf_counter() - t0
            self.steps.append((wall, runner.forward_time_s, n, core.scheduler.num_running))
            used = bm.num_blocks - bm.num_free_blocks
            if used > self.peak_blocks:
                self.peak_blocks = used
                self.peak_resident = sum(r.num_computed_tokens for r in core.requests.values())
            return n

        core.step = step  # type: ignore[method-assign]  # NOTE: instance attribute shadows it


class RssSampler(threading.Thread):
    """Samples this process's resident set size (``/proc/self/statm``) every 10 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = rss_bytes()
        self._done = threading.Event()  # NOTE: Thread has its own _stop

    def run(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def efficiency(engine: AsyncEngine, probe: StepProbe, batch: int, steps: int,
               quiet: bool = False) -> None:
    sampling = SamplingParams(temperature=0.0, ignore_eos=True)
    prompt = tuple(range(10, 42))  # NOTE: 32 tokens; the same prompt shares cached blocks
    probe.steps.clear()
    handles = [engine.submit(GenerationRequest(prompt, sampling=sampling, max_tokens=steps))
               for _ in range(batch)]
    for h in handles:
        h.wait(600)
    decode = [s for s in probe.steps if s[2] == batch and s[3] == batch]
    if quiet:
        return
    if not decode:
        print(f"  batch {batch:>2}: no pure decode step observed")
        return
    wall = sum(s[0] for s in decode)
    fwd = sum(s[1] for s in decode)
    per = [s[0] * 1e3 for s in decode]
    print(f"  batch {batch:>2}: efficiency {fwd / wall:.3f}  step p50 {percentile(per, 50):7.2f} ms"
          f"  forward {fwd / len(decode) * 1e3:7.2f} ms  overhead "
          f"{(wall - fwd) / len(decode) * 1e3:6.2f} ms/step "
          f"({(wall - fwd) / len(decode) / batch * 1e6:6.0f} µs/seq)  "
          f"{batch * len(decode) / wall:7.1f} tok/s over {len(decode)} steps")


def output_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """Per-request output lengths, uniform in ``[lo, hi]``, deterministic from ``seed``."""
    rng = random.Random(seed + 1)
    return [rng.randint(lo, hi) for _ in range(n)]


def drive_mixed(engine: AsyncEngine, prompts: list[tuple[int, ...]], lengths: list[int]
                ) -> tuple[float, int]:
    """All requests in flight at once, request i producing exactly ``lengths[i]`` tokens.
    Returns (seconds, output tokens)."""
    sampling = SamplingParams(temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    handles = [engine.submit(GenerationRequest(p, sampling=sampling, max_tokens=n))
               for p, n in zip(prompts, lengths, strict=True)]
    tokens = sum(h.wait(600).usage.selected_tokens for h in handles)
    return time.perf_counter() - start, tokens


def run_hf_mixed(model_dir: Path, prompts: list[tuple[int, ...]], lengths: list[int], batch: int,
                 dtype: str, pad_id: int) -> tuple[float, int, int]:
    """``transformers.generate`` in static left-padded batches of ``batch`` (arrival order); each
    batch runs until its longest member. Returns (seconds, useful tokens, generated tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    useful = generated = 0
    start = time.perf_counter()
    for b in range(0, len(prompts), batch):
        group, wants = prompts[b:b + batch], lengths[b:b + batch]
        width, steps = max(map(len, group)), max(wants)
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps,
                                 min_new_tokens=steps, do_sample=False, pad_token_id=pad_id)
        generated += int(out.shape[0]) * (int(out.shape[1]) - width)
        useful += sum(wants)  # NOTE: a row's tokens past its own max_tokens are waste
    return time.perf_counter() - start, useful, generated


def report_mixed(engine: AsyncEngine, model_dir: Path, prompts: list[tuple[int, ...]],
                 args: argparse.Namespace, lengths: list[int], coda: tuple[float, int]) -> None:
    wall, tokens = coda
    tok_s = tokens / wall
    print(f"throughput, {len(prompts)} requests, mixed prompt lengths "
          f"({min(map(len, prompts))}..{max(map(len, prompts))}) AND mixed output lengths "
          f"({min(lengths)}..{max(lengths)}, {sum(lengths)} total), all in flight:")
    print(f"  coda: {tokens} tokens in {wall:.2f} s = {tok_s:.1f} tok/s")
    if args.no_hf:
        return
    pad = min(engine.eos_token_ids) if engine.eos_token_ids else 0
    hf_s, useful, generated = run_hf_mixed(model_dir, prompts, lengths, args.hf_batch,
                                           args.dtype, pad)
    print(f"  transformers.generate (static batches of {args.hf_batch}, left-padded, each to its "
          f"longest member): {useful} useful tokens ({generated} generated) in {hf_s:.2f} s = "
          f"{useful / hf_s:.1f} tok/s -> coda is {tok_s / (useful / hf_s):.2f}×")


def report_equal(engine: AsyncEngine, model_dir: Path, prompts: list[tuple[int, ...]],
                 args: argparse.Namespace, max_tokens: int, res: RunResult) -> None:
    tok_s = res.output_tokens / res.wall_s
    print(f"throughput, {len(prompts)} mixed-length requests (prompt "
          f"{min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
          f"{sum(map(len, prompts))} total) × {max_tokens} tokens each, all in flight:")
    print(f"  coda: {res.output_tokens} tokens in {res.wall_s:.2f} s = {tok_s:.1f} tok/s; "
          f"TTFT p50 {percentile(res.ttft_s, 50) * 1e3:.0f} ms, ITL p50 "
          f"{percentile(res.itl_s, 50) * 1e3:.1f} ms")
    if not args.no_hf:
        pad = min(engine.eos_token_ids) if engine.eos_token_ids else 0
        hf_s, hf_tok = run_hf(model_dir, prompts, args.hf_batch, max_tokens, args.dtype, pad)
        print(f"  transformers.generate (static batches of {args.hf_batch}, left-padded): "
              f"{hf_tok} tokens in {hf_s:.2f} s = {hf_tok / hf_s:.1f} tok/s -> coda is "
              f"{tok_s / (hf_tok / hf_s):.2f}×")


def bench_model(name: str, model_dir: Path, args: argparse.Namespace, max_tokens: int,
                mixed_hi: int) -> None:
    print(f"\n=== {name}: {model_dir} ({args.dtype}) ===")
    engine = AsyncEngine.from_model_dir(model_dir, EngineConfig(dtype=args.dtype, max_num_seqs=64))
    mc, runner = engine.runner.config, engine.runner
    probe = StepProbe(engine)
    probe.install()
    print(f"layers {mc.num_layers}, kv heads {mc.num_kv_heads}, head dim {mc.head_dim}, "
          f"vocab {mc.vocab_size}; KV cache {runner.num_blocks} blocks × {runner.block_size} "
          f"tokens = {runner.kv.nbytes / 2**20:.1f} MiB")
    prompts = make_workload(engine.tokenizer, args.num_requests, args.seed, 256)
    with engine:
        efficiency(engine, probe, 1, 4, quiet=True)  # NOTE: warm-up
        print(f"engine efficiency (bare forward ÷ whole step), {args.eff_steps} decode steps:")
        for batch in (1, 8, 32):
            efficiency(engine, probe, batch, args.eff_steps)
        probe.peak_blocks = 0
        before = rss_bytes()
        sampler = RssSampler()
        sampler.start()
        lengths = output_lengths(len(prompts), min(args.min_tokens, mixed_hi), mixed_hi, args.seed)
        mixed = drive_mixed(engine, prompts, lengths) if args.workload != "equal" else None
        opts = BenchOptions(num_requests=len(prompts), concurrency=len(prompts),
                            max_tokens=max_tokens, show_progress=False)
        equal = (asyncio.run(drive_workload(engine, prompts, opts, None, None))
                 if args.workload != "mixed" else None)
        peak = sampler.stop()  # NOTE: before transformers loads its own copy of the model
    if mixed is not None:
        report_mixed(engine, model_dir, prompts, args, lengths, mixed)
    if equal is not None:
        report_equal(engine, model_dir, prompts, args, max_tokens, equal)
    formula = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * DTYPE_BYTES[args.dtype]
    slot = runner.kv.nbytes / (runner.num_blocks * runner.block_size)
    block_bytes = slot * runner.block_size
    print(f"memory with {len(prompts)} requests in flight: RSS {before / 2**20:.0f} MiB before, "
          f"peak {peak / 2**20:.0f} MiB (+{(peak - before) / 2**20:.1f} MiB)")
    print(f"  KV bytes/token: formula 2·L·H_kv·d_h·{DTYPE_BYTES[args.dtype]} = {formula}; "
          f"cache tensor {slot:.0f}/slot; runner.kv_bytes_per_token {runner.kv_bytes_per_token}")
    if probe.peak_resident:
        used = probe.peak_blocks * block_bytes
        print(f"  fullest step: {probe.peak_blocks} blocks ({used / 2**20:.2f} MiB) for "
              f"{probe.peak_resident} resident tokens = {used / probe.peak_resident:.0f} B/token "
              f"({used / probe.peak_resident / formula:.3f}× formula; the excess is the partial "
              f"last block of each sequence, ≤ {runner.block_size - 1} slots)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="default: the embedded model")
    ap.add_argument("--smollm", action="store_true", help="also the SmolLM2-135M shape (slow)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64, help="equal: tokens per request")
    ap.add_argument("--min-tokens", type=int, default=8, help="mixed: the shortest output")
    ap.add_argument("--mixed-max-tokens", type=int, default=128, help="mixed: the longest output")
    ap.add_argument("--smollm-max-tokens", type=int, default=16)
    ap.add_argument("--workload", choices=("mixed", "equal", "both"), default="both")
    ap.add_argument("--equal-lengths", action="store_const", const="equal", dest="workload",
                    help="only the old workload: every request --max-tokens tokens")
    ap.add_argument("--eff-steps", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"load average {Path('/proc/loadavg').read_text().split()[:3]} on "
          f"{len(os.sched_getaffinity(0))} CPUs (shared with other work)")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            if (DEFAULT_MODEL_DIR / "config.json").is_file():
                model = DEFAULT_MODEL_DIR
            else:
                print("(the embedded default model is absent: using a random 'tiny' checkpoint)")
                model = make_random_checkpoint(Path(tmp) / "tiny", preset="tiny")
        bench_model("default model", model, args, args.max_tokens, args.mixed_max_tokens)
        if args.smollm:
            smol = make_random_checkpoint(Path(tmp) / "smollm2-135m", arch="smollm",
                                          preset="smollm2-135m")
            bench_model("SmolLM2-135M shape (random weights)", smol, args, args.smollm_max_tokens,
                        2 * args.smollm_max_tokens)


if __name__ == "__main__":
    main()
