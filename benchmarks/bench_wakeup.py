"""What waking observers costs the producer (issue 22 step 4): CPU of the appending thread (the
engine's) per append, with no reader, one reader per stream, and 32 streams with one reader
each, the readers following on an event loop on another thread (the server's shape); and the
wall time until every reader has read the terminal. Prints figures only.

Run: ``python benchmarks/bench_wakeup.py [label]``. Measured on the 2-core shared machine
(load average ~14), medians of 5, two interleaved runs each (main 42498f8 vs the one wake-up
channel): producer CPU 2.5-2.7 vs 2.2-2.3 us/append without a reader, 6.4-6.7 vs 3.4-3.5 with
one, 7.5-8.6 vs 3.5-3.7 over 32 streams: the engine thread no longer runs a callback (and a
self-pipe write) per append per reader; the channel schedules one dispatch per burst.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import threading
import time

from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.reader import follow
from coda.stream import RequestStream
from coda.stream_backpressure import BackpressureConfig

BIG = BackpressureConfig(pause_bytes=1 << 40, max_bytes=1 << 41)
DONE = Terminal(State.FINISHED, FinishReason.EOS, Usage())

def once(n: int, readers: int, streams: int) -> tuple[float, float]:
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    ss = [RequestStream(f"r{i}", BIG) for i in range(streams)]
    for s in ss:
        s.start("m")
    async def read(s: RequestStream) -> int:
        k = 0
        async for _ in follow(s):
            k += 1
        return k
    futs = [asyncio.run_coroutine_threadsafe(read(s), loop) for s in ss for _ in range(readers)]
    time.sleep(0.05)
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n // streams):
        for s in ss:
            s.delta(b"x")
    cpu = time.thread_time() - c0
    for s in ss:
        s.close(DONE)
    for f in futs:
        f.result(60)
    wall = time.perf_counter() - t0
    loop.call_soon_threadsafe(loop.stop)
    t.join()
    loop.close()
    return cpu / n * 1e6, wall / n * 1e6


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "this tree"
    for readers, streams in ((0, 1), (1, 1), (1, 32)):
        rows = [once(20000, readers, streams) for _ in range(5)]
        print(f"{label}: readers/stream={readers} streams={streams}: producer CPU "
              f"{statistics.median(r[0] for r in rows):.2f} us/append, wall until read "
              f"{statistics.median(r[1] for r in rows):.2f} us/append")


if __name__ == "__main__":
    main()
