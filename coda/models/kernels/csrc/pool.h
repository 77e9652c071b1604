// The kernels' persistent thread pool (issue 18): std::thread workers sized by set_threads(n)
// (`--threads`), not OpenMP and not torch's pool. parallel_for(n, grain, f) calls f(lo, hi) over
// disjoint chunks of [0, n) that together cover it once; the calling thread works too.
//
// T4: which thread runs a chunk is decided at run time (workers take the next chunk when free), so
// a kernel must make every unit of work (an output tile, a row, a (row, KV head)) a function of
// its inputs alone, computed by one thread with one fixed instruction sequence; then the thread
// count and the scheduling never change a bit. Every kernel in this directory does.
//
// A call made while another thread's call holds the pool runs on the calling thread alone (same
// bits); a forked child starts a fresh pool on its first call.
#pragma once

#include <cstdint>

namespace coda_native {
namespace pool {

using Task = void (*)(void* ctx, int64_t lo, int64_t hi);

void run(int64_t n, int64_t grain, Task fn, void* ctx);
void set_threads(int n);  // n >= 1: the caller plus n - 1 workers
int threads();

template <class F>
void parallel_for(int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
  run(n, grain < 1 ? 1 : grain,
      [](void* c, int64_t lo, int64_t hi) { (*static_cast<const F*>(c))(lo, hi); },
      const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace pool
}  // namespace coda_native
