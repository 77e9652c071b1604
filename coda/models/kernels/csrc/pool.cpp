// The persistent thread pool of pool.h. Protocol: the caller publishes a job (fn, ctx, n, grain,
// next = 0), opens it and bumps the generation; workers that wake count themselves in `active`,
// then work only if the job is still open, taking chunks from `next`. The caller works too, then
// closes the job and waits for the workers counted in `active`: a worker that wakes late sees the
// job closed and touches nothing, so the caller never waits for a thread that took no part.
// Workers spin briefly before sleeping: a decode step makes ~150 calls microseconds apart.
#include "pool.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace coda_native {
namespace pool {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// NOTE: how long a worker spins for the next job before it sleeps, and the caller for the
// workers before it yields: a decode step's ~150 calls come microseconds apart, but a longer
// spin takes a core from the other processes of a busy machine.
constexpr auto kSpin = std::chrono::microseconds(50);

// Spins (pause) until done() or kSpin has passed; true if done() became true.
template <class F>
bool spin_until(const F& done) {
  const auto end = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= end) return done();
  }
}

struct Pool {
  std::mutex submit;  // NOTE: one job at a time; a second caller runs its job inline
  std::mutex m;
  std::condition_variable cv;
  std::atomic<uint64_t> gen{0};
  std::atomic<bool> open{false};
  std::atomic<int> active{0};
  std::atomic<int64_t> next{0};
  Task fn = nullptr;
  void* ctx = nullptr;
  int64_t n = 0, grain = 1;
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;

  void work() {
    for (;;) {
      const int64_t lo = next.fetch_add(grain);
      if (lo >= n) return;
      fn(ctx, lo, std::min(lo + grain, n));
    }
  }

  void worker_loop() {
    uint64_t seen = gen.load();
    for (;;) {
      if (!spin_until([&] { return gen.load(std::memory_order_acquire) != seen; })) {
        std::unique_lock<std::mutex> lk(m);
        cv.wait(lk, [&] { return stop || gen.load() != seen; });
      }
      if (stop) return;
      seen = gen.load();
      active.fetch_add(1);
      if (open.load()) work();
      active.fetch_sub(1);
    }
  }

  void start(int count) {
    for (int i = 0; i < count; ++i) workers.emplace_back([this] { worker_loop(); });
  }

  void shutdown() {
    {
      std::lock_guard<std::mutex> lk(m);
      stop = true;
    }
    cv.notify_all();
    for (auto& t : workers) t.join();
    workers.clear();
  }

  void run(int64_t count, int64_t g, Task f, void* c) {
    fn = f, ctx = c, n = count, grain = g;
    next.store(0);
    open.store(true);
    {
      std::lock_guard<std::mutex> lk(m);
      gen.fetch_add(1);
    }
    cv.notify_all();
    work();
    open.store(false);
    if (!spin_until([&] { return active.load() == 0; }))
      while (active.load() != 0) std::this_thread::yield();
  }
};

std::mutex g_config;  // NOTE: guards set_threads against itself
// NOTE: a replaced pool is stopped but never freed: a call that read the old pointer still runs
// safely on it (on the calling thread alone, as it has no workers left).
std::atomic<Pool*> g_pool{nullptr};
int g_threads = 1;
std::atomic<bool> g_forked{false};

void on_fork_child() { g_forked.store(true); }

Pool* current() {
  if (g_forked.load()) {  // NOTE: the parent's workers do not exist here: leak, then restart
    g_forked.store(false);
    new (&g_config) std::mutex();
    g_pool.store(nullptr);
    if (g_threads > 1) {
      Pool* p = new Pool();
      p->start(g_threads - 1);
      g_pool.store(p);
    }
  }
  return g_pool.load();
}

struct AtFork {
  AtFork() { pthread_atfork(nullptr, nullptr, on_fork_child); }
} g_at_fork;

}  // namespace

void run(int64_t n, int64_t grain, Task fn, void* ctx) {
  Pool* p = current();
  if (p == nullptr || n <= grain || !p->submit.try_lock()) {
    fn(ctx, 0, n);
    return;
  }
  p->run(n, grain, fn, ctx);
  p->submit.unlock();
}

void set_threads(int n) {
  if (n < 1) n = 1;
  std::lock_guard<std::mutex> lk(g_config);
  current();
  if (n == g_threads) return;
  Pool* old = g_pool.exchange(nullptr);
  if (old != nullptr) {
    std::lock_guard<std::mutex> busy(old->submit);  // NOTE: let a running job finish
    old->shutdown();
  }
  g_threads = n;
  if (n > 1) {
    Pool* p = new Pool();
    p->start(n - 1);
    g_pool.store(p);
  }
}

int threads() { return g_threads; }

}  // namespace pool
}  // namespace coda_native
