// The kernels' pool hand-off cost (issue 18): an empty parallel_for (64 indices in 4 chunks of
// 16, nothing to do) timed call by call at 1 and 2 threads, with the caller busy 0, 5 or 20 us
// between calls (a decode step's Python work between kernel calls); per-call wall median / p90 /
// mean and the calling thread's CPU time. Build and run from the repository root:
//
//   g++ -O2 -std=c++17 -pthread -Icoda/models/kernels/csrc benchmarks/bench_pool.cpp \
//       coda/models/kernels/csrc/pool.cpp -o /tmp/bench_pool && /tmp/bench_pool
#include "pool.h"
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <initializer_list>
#include <vector>
using namespace coda_native;
static double cpu_now(){ timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec+t.tv_nsec*1e-9; }
static double wall_now(){ return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
std::atomic<long> sink{0};
int main(int argc, char** argv){
  const int calls = 20000;
  for (int th : {1, 2}) {
    pool::set_threads(th);
    for (long gap_us : {0L, 5L, 20L}) {
      std::vector<double> w(calls);
      double csum = 0;
      for (int i = 0; i < calls; ++i) {
        if (gap_us) { auto e = wall_now() + gap_us * 1e-6; while (wall_now() < e) {} }
        double w0 = wall_now(), c0 = cpu_now();
        pool::parallel_for(64, 16, [](int64_t lo, int64_t hi) { sink.fetch_add(hi - lo, std::memory_order_relaxed); });
        w[i] = wall_now() - w0; csum += cpu_now() - c0;
      }
      std::sort(w.begin(), w.end());
      double mean = 0; for (double v : w) mean += v; mean /= calls;
      printf("%s threads %d gap %2ldus: wall median %.2f us p90 %.2f us mean %.2f us; caller cpu mean %.2f us\n",
             argv[0], th, gap_us, w[calls / 2] * 1e6, w[calls * 9 / 10] * 1e6, mean * 1e6, csum / calls * 1e6);
    }
  }
}
