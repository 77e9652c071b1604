"""Benchmark of coda.stops (SPEC S2): µs per token of stop matching, against two naive matchers.

Prints figures only (no asserts). Run: ``python benchmarks/bench_stops.py [--tokens N]``.

* coda   — :class:`coda.stops.StopStringMatcher` (Aho–Corasick, minimal holdback), bytes pieces.
All three are driven through the same ``push(piece)`` interface, one call per token.

* naive-a — re-scan the whole growing text with ``str.find`` for every stop, every token.
  Quadratic in output length, so it runs on a shorter prefix (``--naive-a-tokens``).
* naive-b — fixed holdback of ``max_len - 1`` characters; ``str.find`` for every stop over the
  tail window (held + new piece) each token.

The text never contains a stop (each stop has a ``Q`` in it; the text has none), but stop
prefixes do occur, so the matchers hold back and release bytes as they would in real use.
"""

from __future__ import annotations

import argparse
import random
import string
import time
from collections.abc import Callable, Sequence
from functools import partial

from coda.stops import StopStringMatcher

LETTERS = string.ascii_lowercase


def make_pieces(n: int, rng: random.Random) -> list[str]:
    """~4-character token pieces: mostly letters, some leading spaces, rare newlines."""
    out = []
    for _ in range(n):
        k = rng.choice((3, 4, 4, 5))
        body = "".join(rng.choice(LETTERS) for _ in range(k - 1))
        out.append(rng.choice((" ", " ", "\n", "e")) + body if rng.random() < 0.9 else body + "\n")
    return out


def make_stops(n: int, rng: random.Random) -> list[str]:
    stops = ["\nUserQ:"]
    while len(stops) < n:
        a = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 4)))
        b = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 5)))
        stops.append(a + "Q" + b)
    return stops[:n]


def run_coda(pieces: Sequence[bytes], stops: Sequence[str]) -> int:
    m = StopStringMatcher(stops)
    push = m.push
    total = 0
    for p in pieces:
        safe, _ = push(p)
        total += len(safe)
    return total + len(m.flush())


class NaiveRescan:
    """(a) Append each piece, then ``str.find`` every stop over the whole text so far."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.hold = max(len(s) for s in stops) - 1
        self.text = ""
        self.sent = 0

    def push(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        for s in self.stops:
            at = self.text.find(s)
            if at >= 0:
                out, self.sent = self.text[self.sent:at], at
                return out, True
        cut = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:cut], cut
        return out, False


class NaiveWindow:
    """(b) Fixed holdback of max_len-1 chars; ``str.find`` every stop over held + piece only."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.hold = max(len(s) for s in stops) - 1
        self.window = ""

    def push(self, piece: str) -> tuple[str, bool]:
        w = self.window + piece
        for s in self.stops:
            at = w.find(s)
            if at >= 0:
                self.window = ""
                return w[:at], True
        cut = len(w) - self.hold
        if cut <= 0:
            self.window = w
            return "", False
        self.window = w[cut:]
        return w[:cut], False


def run_naive(cls: type[NaiveRescan] | type[NaiveWindow], pieces: Sequence[str],
              stops: Sequence[str]) -> int:
    m = cls(stops)
    push = m.push
    total = 0
    for p in pieces:
        safe, hit = push(p)
        total += len(safe)
        if hit:
            break
    return total


def _collect(cls: type[NaiveRescan] | type[NaiveWindow], pieces: Sequence[str],
             stops: Sequence[str]) -> str:
    m, out = cls(stops), ""
    for p in pieces:
        safe, hit = m.push(p)
        out += safe
        if hit:
            break
    return out


def timed(fn: Callable[[], int], repeat: int = 3) -> float:
    """Best of ``repeat`` runs in process CPU time (the machine may be shared)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--naive-a-tokens", type=int, default=5_000)
    args = ap.parse_args()
    rng = random.Random(0)
    pieces = make_pieces(args.tokens, rng)
    bpieces = [p.encode() for p in pieces]
    nbytes = sum(map(len, bpieces))
    short = pieces[: args.naive_a_tokens]
    print(f"{args.tokens} tokens, {nbytes / args.tokens:.2f} bytes/token; "
          f"naive-a on the first {len(short)} tokens (it is quadratic)")
    probe, probe_stops = ["ab", "c\nUs", "erQ:", "tail"], make_stops(16, random.Random(2))
    results = {_collect(c, probe, probe_stops) for c in (NaiveRescan, NaiveWindow)}
    m = StopStringMatcher(probe_stops)
    coda_out = b"".join(m.push(p.encode())[0] for p in probe[:3]).decode()
    print(f"cross-check on a planted stop: coda {coda_out!r}, naive {sorted(results)}")
    print(f"{'stops':>6} | {'coda µs/tok':>11} {'ns/byte':>8} | {'naive-a µs/tok':>14} | "
          f"{'naive-b µs/tok':>14} | {'b/coda':>6}")
    for n in (1, 16, 256):
        stops = make_stops(n, rng)
        assert run_coda(bpieces, stops) == nbytes  # NOTE: sanity only: no stop may hit
        t_coda = timed(partial(run_coda, bpieces, stops)) / len(bpieces) * 1e6
        t_a = timed(partial(run_naive, NaiveRescan, short, stops), repeat=1) / len(short) * 1e6
        t_b = timed(partial(run_naive, NaiveWindow, pieces, stops)) / len(pieces) * 1e6
        print(f"{n:>6} | {t_coda:>11.3f} {t_coda * 1e3 * len(bpieces) / nbytes:>8.1f} | "
              f"{t_a:>14.2f} | {t_b:>14.3f} | {t_b / t_coda:>6.1f}")
    # Worst case for the hot loop: the automaton never returns to the root (no fast path).
    adv = [b"aaaa"] * args.tokens
    t_adv = timed(partial(run_coda, adv, ["a" * 64 + "Q"])) / args.tokens * 1e6
    print(f"adversarial (always off-root, stop 'a'*64+'Q', text 'aaaa'...): "
          f"{t_adv:.3f} µs/token, {t_adv * 1e3 / 4:.1f} ns/byte")
    big = b"".join(bpieces)
    stops = make_stops(256, rng)
    t_big = timed(partial(run_coda, [big], stops))
    print(f"one {len(big)}-byte push, 256 stops: {t_big / len(big) * 1e9:.1f} ns/byte")
    t0 = time.perf_counter()
    StopStringMatcher(make_stops(256, random.Random(1)))
    print(f"compile 256 stops (uncached): {(time.perf_counter() - t0) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
