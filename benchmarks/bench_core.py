"""Per-token cost of Coda's output path — detokenizer + stop matcher + stream — against the two
common naive approaches, in the same run (issue 2 item 9; SPEC K1, S1, S2, P1).

Prints figures only (no asserts on time). Run: ``python benchmarks/bench_core.py``
(``--tokens 100000 --short 10000 --naive-a-tokens 4000``).

Every approach turns one selected token id into stream deltas, through a real byte-level BPE
(GPT-2 / Llama-3 / Qwen style) trained here on multilingual text, so CJK and emoji characters
are split across tokens:

* ``coda``      — :class:`~coda.detokenizer.IncrementalDetokenizer` → :class:`~coda.stops.
  StopStringMatcher` (automaton, minimal holdback) → :class:`~coda.stream.RequestStream`.
* ``coda-step`` — the engine's whole per-token step, :class:`~coda.output.OutputProcessor`
  (the three above plus EOS / budget checks and usage spans).
* ``naive-a``   — re-decode the whole growing id list with ``tokenizer.decode`` every token,
  search every stop in the new tail, hold back max_len−1 chars (quadratic in output length, so
  it runs on ``--naive-a-tokens`` only).
* ``naive-b``   — windowed incremental decode with a trailing-U+FFFD check (prefix/read offsets),
  a fixed max_len−1 character holdback and ``str.find`` of every stop over held + new text.

The stop strings come from :func:`bench_stops.make_stops` (``benchmarks/bench_stops.py``
measures the matcher alone): each contains a ``Q`` the text never has, so nothing hits, but
stop prefixes occur and the matchers really hold back and release bytes.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))  # NOTE: reuse bench_stops' stop sets
from bench_stops import NaiveWindow as StopWindow  # noqa: E402
from bench_stops import make_stops  # noqa: E402

from coda.bench_workload import TEXTS  # noqa: E402
from coda.detokenizer import IncrementalDetokenizer  # noqa: E402
from coda.output import OutputProcessor, OutputSpec  # noqa: E402
from coda.stops import StopStringMatcher  # noqa: E402
from coda.stream import RequestStream, TokenInfo  # noqa: E402
from coda.stream_backpressure import BackpressureConfig
from coda.trace import NullTraceSink  # noqa: E402

BIG = BackpressureConfig(pause_bytes=1 << 40, max_bytes=1 << 40)  # NOTE: no reader acks here


def train_tokenizer(rng: random.Random) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(rng.choice(TEXTS) for _ in range(8)) for _ in range(400)]
    trainer = trainers.BpeTrainer(vocab_size=1500, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def _rare_word(rng: random.Random) -> str:
    """A word of characters the tokenizer has no whole token for: its bytes split across ids."""
    lo, hi = rng.choice(((0x4E00, 0x9FFF), (0x1F300, 0x1F64F), (0xC0, 0x17F), (0xAC00, 0xD7A3)))
    return "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 4)))


def make_ids(tok: tokenizers.Tokenizer, n: int, rng: random.Random) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        parts = [rng.choice(TEXTS) if rng.random() < 0.7 else _rare_word(rng) for _ in range(20)]
        ids.extend(tok.encode(" ".join(parts) + "\n").ids)
    return ids[:n]


def run_coda(tok: tokenizers.Tokenizer, ids: Sequence[int], stops: Sequence[str]) -> bytes:
    detok = IncrementalDetokenizer(tok)
    matcher = StopStringMatcher(stops)
    stream = RequestStream("bench", BIG)
    for t in ids:
        new = detok.push(t)
        if new:
            safe, hit = matcher.push(new)
            if safe:
                stream.delta(safe)
            if hit is not None:
                break
    tail, _ = matcher.push(detok.finish()) if not matcher.closed else (b"", None)
    rest = tail + (matcher.flush() if not matcher.closed else b"")
    if rest:
        stream.delta(rest)
    return b"".join(e.data for e in stream.events_after(-1))


def run_step(tok: tokenizers.Tokenizer, ids: Sequence[int], stops: Sequence[str]) -> bytes:
    stream = RequestStream("bench", BIG)
    spec = OutputSpec(max_tokens=len(ids) + 1, stop_strings=tuple(stops))
    proc = OutputProcessor("bench", tok, spec, stream, NullTraceSink())
    for t in ids:
        if proc.on_token(t, TokenInfo(t)) is not None:
            break
    return b""  # NOTE: output equality is checked on run_coda; this row measures cost only


class NaiveRedecode:
    """(a) Decode all ids so far every token; emit the new text minus a max_len−1 holdback."""

    def __init__(self, tok: tokenizers.Tokenizer, stops: Sequence[str]) -> None:
        self.tok, self.stops = tok, list(stops)
        self.hold = max(map(len, stops)) - 1
        self.ids: list[int] = []
        self.sent = 0

    def push(self, t: int) -> tuple[str, bool]:
        self.ids.append(t)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return "", False  # NOTE: the naive partial-character test (confuses real U+FFFD)
        lo = max(0, self.sent - self.hold)
        for s in self.stops:
            at = text.find(s, lo)
            if at >= 0:
                out, self.sent = text[self.sent:at], at
                return out, True
        cut = max(self.sent, len(text) - self.hold)
        out, self.sent = text[self.sent:cut], cut
        return out, False

    def flush(self) -> str:
        return self.tok.decode(self.ids)[self.sent:]


class NaiveWindow:
    """(b) Offsets-based incremental decode, then bench_stops' fixed max_len−1 holdback +
    ``str.find`` matcher on the new text."""

    def __init__(self, tok: tokenizers.Tokenizer, stops: Sequence[str]) -> None:
        self.tok = tok
        self.matcher = StopWindow(stops)
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, t: int) -> tuple[str, bool]:
        self.ids.append(t)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        full = self.tok.decode(self.ids[self.prefix:])
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return "", False
        self.prefix, self.read = self.read, len(self.ids)
        return self.matcher.push(full[len(prefix_text):])

    def flush(self) -> str:
        tail = self.tok.decode(self.ids[self.prefix:])[len(self.tok.decode(
            self.ids[self.prefix:self.read])):]
        return self.matcher.window + tail


def run_naive(cls: type[NaiveRedecode] | type[NaiveWindow], tok: tokenizers.Tokenizer,
              ids: Sequence[int], stops: Sequence[str]) -> bytes:
    m = cls(tok, stops)
    stream = RequestStream("bench", BIG)
    for t in ids:
        out, hit = m.push(t)
        if out:
            stream.delta(out.encode())
        if hit:
            break
    else:
        if rest := m.flush().encode():
            stream.delta(rest)
    return b"".join(e.data for e in stream.events_after(-1))


def per_token_us(fn: Callable[[], object], n: int, repeat: int) -> float:
    """Best of ``repeat`` in process CPU time (the 2 cores are shared), µs per token."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--short", type=int, default=10_000)
    ap.add_argument("--naive-a-tokens", type=int, default=4_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    tok = train_tokenizer(rng)
    ids = make_ids(tok, args.tokens, rng)
    text = tok.decode(ids).encode()
    assert b"Q" not in text
    split = sum(1 for t in ids if "\ufffd" in tok.decode([t]))
    print(f"byte-level BPE, vocab {tok.get_vocab_size()}; {len(ids)} tokens, "
          f"{len(text) / len(ids):.2f} bytes/token, {split} tokens carry part of a character")
    print(f"load: {Path('/proc/loadavg').read_text().split()[:3]} (2 shared cores); "
          f"CPU time, best of {args.repeat}")
    stop_sets = {n: make_stops(n, random.Random(n)) for n in (1, 16, 256)}
    for n, stops in stop_sets.items():  # correctness first: every approach streams the same text
        sample = ids[:3000]
        want = tok.decode(sample).encode()
        got = {run_coda(tok, sample, stops), run_naive(NaiveWindow, tok, sample, stops),
               run_naive(NaiveRedecode, tok, sample, stops)}
        assert got == {want}, f"outputs differ with {n} stops"
    print(f"{'stops':>5} {'tokens':>7} | {'coda':>6} {'coda-step':>9} | {'naive-a':>8} "
          f"{'(tokens)':>8} | {'naive-b':>7} | {'b/coda':>6}   (µs/token)")
    for n, stops in stop_sets.items():
        for length in (args.short, args.tokens):
            part = ids[:length]
            a_part = ids[:min(length, args.naive_a_tokens * (1 if length == args.short else 2))]
            c = per_token_us(lambda p=part, s=stops: run_coda(tok, p, s), length, args.repeat)
            st = per_token_us(lambda p=part, s=stops: run_step(tok, p, s), length, args.repeat)
            b = per_token_us(lambda p=part, s=stops: run_naive(NaiveWindow, tok, p, s), length,
                             args.repeat)
            a = per_token_us(lambda p=a_part, s=stops: run_naive(NaiveRedecode, tok, p, s),
                             len(a_part), 1)
            print(f"{n:>5} {length:>7} | {c:>6.2f} {st:>9.2f} | {a:>8.1f} {len(a_part):>8} | "
                  f"{b:>7.2f} | {b / c:>6.2f}")
    stops = stop_sets[16]
    gc.disable()  # NOTE: isolates the cyclic GC's share of the growth with output length
    try:
        for length in (args.short, args.tokens):
            part = ids[:length]
            c = per_token_us(lambda p=part: run_coda(tok, p, stops), length, args.repeat)
            st = per_token_us(lambda p=part: run_step(tok, p, stops), length, args.repeat)
            print(f"gc disabled, 16 stops, {length:>7} tokens: coda {c:.2f}, coda-step {st:.2f} "
                  "µs/token")
    finally:
        gc.enable()
    print("(growth from the short to the long run above that is absent with gc disabled is the "
          "cyclic GC walking the retained per-token objects: stream events, token infos)")
    print("naive-a is quadratic: its µs/token grows with the prefix it re-decodes "
          f"(measured on {args.naive_a_tokens} and {2 * args.naive_a_tokens} tokens).")


if __name__ == "__main__":
    main()
