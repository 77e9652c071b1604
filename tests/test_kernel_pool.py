"""The kernels' thread pool (issue 18; SPEC T4): ``parallel_for(n, grain, f)`` calls ``f`` on
disjoint chunks that cover ``[0, n)`` exactly once, each starting at a multiple of the grain
(kernels cut their work units at those starts, so any split gives the same bits), with one or
more workers, two callers at once (the second runs its call on its own thread) and the pool
resized between calls. ``csrc/pool.cpp`` is compiled here with a small C++ driver (skipped
where no C++ compiler is installed; the module itself is built at install)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "coda" / "models" / "kernels" / "csrc"

DRIVER = r"""
#include "pool.h"
#include <atomic>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>
using namespace coda_native;
std::atomic<long> bad{0};

// Every index of [0, n) hit once; every chunk start a multiple of g.
void check(int64_t n, int64_t g, std::vector<std::atomic<unsigned char>>& hits) {
  for (int64_t i = 0; i < n; ++i) hits[i].store(0);
  pool::parallel_for(n, g, [&](int64_t lo, int64_t hi) {
    if (lo % g != 0 || lo >= hi || hi > n) bad++;
    for (int64_t i = lo; i < hi; ++i) hits[i].fetch_add(1);
  });
  for (int64_t i = 0; i < n; ++i)
    if (hits[i].load() != 1) { bad++; break; }
}

void caller(unsigned seed, int iters) {
  std::mt19937 r(seed);
  std::vector<std::atomic<unsigned char>> hits(4096);
  for (int it = 0; it < iters; ++it) check(r() % 4000 + 1, r() % 40 + 1, hits);
}

int main() {
  pool::set_threads(3);
  std::vector<std::atomic<unsigned char>> big(3000000);
  check(3000000, 1, big);  // NOTE: more chunks than the ticket counts: coarser chunks
  std::thread a(caller, 1u, 3000), b(caller, 2u, 3000);
  for (int k = 0; k < 12; ++k) {
    pool::set_threads(1 + k % 3);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  a.join();
  b.join();
  std::printf("bad %ld\n", bad.load());
  return bad.load() != 0;
}
"""


def test_t4_pool_chunks_cover_every_index_once_at_grain_multiples(tmp_path: Path) -> None:
    """T4: random sizes and grains, two concurrent callers, resizes in between, and a job of
    more chunks than the pool's ticket holds: every index once, every chunk at a grain
    multiple."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler here")
    src = tmp_path / "driver.cpp"
    src.write_text(DRIVER)
    exe = tmp_path / "driver"
    subprocess.run([cxx, "-O1", "-std=c++17", "-pthread", f"-I{CSRC}", str(src),
                    str(CSRC / "pool.cpp"), "-o", str(exe)], check=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "bad 0" in run.stdout, run.stdout + run.stderr
