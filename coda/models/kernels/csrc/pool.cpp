// The persistent thread pool of pool.h. Protocol: a job is [0, n) cut into `count` chunks of
// `grain`; one 64-bit ticket holds (job id, next chunk, count). The caller writes the job's
// parameters, then publishes the ticket; the caller and the workers claim chunks by a
// compare-and-swap on the ticket that succeeds only while it still names their job, and count
// each finished chunk in `done`. The caller returns once done == count: it waits only for chunks
// someone claimed, never for a thread that took none (a worker that wakes late, or is
// descheduled before claiming, finds the job gone and touches nothing). A claim proves the job
// is not finished, so the parameters a worker reads after its claim are that job's.
// Workers spin briefly before sleeping (a decode step makes ~150 calls microseconds apart); the
// caller spins briefly for the last chunks, then sleeps until the worker finishing them wakes it.
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
// last chunks before it sleeps: a decode step's ~150 calls come microseconds apart, but a longer
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

// The ticket: job id (24 bits, wrapping) | next chunk (20 bits) | chunk count (20 bits).
constexpr int kIdxBits = 20;
constexpr uint64_t kIdxMask = (uint64_t{1} << kIdxBits) - 1;
constexpr int64_t kMaxChunks = int64_t{1} << kIdxBits;

inline uint64_t job_of(uint64_t t) { return t >> (2 * kIdxBits); }
inline int64_t next_of(uint64_t t) { return static_cast<int64_t>((t >> kIdxBits) & kIdxMask); }
inline int64_t count_of(uint64_t t) { return static_cast<int64_t>(t & kIdxMask); }

struct Pool {
  std::mutex submit;  // NOTE: one job at a time; a second caller runs its job inline
  std::mutex m;
  std::condition_variable work_cv, done_cv;
  // NOTE: its own cache line: every claim writes it, every waiting worker polls it
  alignas(64) std::atomic<uint64_t> ticket{0};
  alignas(64) std::atomic<int64_t> done{0};
  std::atomic<int> sleepers{0};
  std::atomic<bool> caller_sleeps{false};
  Task fn = nullptr;
  void* ctx = nullptr;
  int64_t n = 0, grain = 1;
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;

  // Claims the next chunk of job `job` (ticket seen as t); false once the job has none left.
  bool claim(uint64_t job, uint64_t& t, int64_t& i) {
    for (;;) {
      if (job_of(t) != job || next_of(t) >= count_of(t)) return false;
      if (ticket.compare_exchange_weak(t, t + (uint64_t{1} << kIdxBits),
                                       std::memory_order_acq_rel, std::memory_order_acquire)) {
        i = next_of(t);
        return true;
      }
    }
  }

  void chunk(int64_t i) {
    const int64_t lo = i * grain;
    fn(ctx, lo, std::min(lo + grain, n));
  }

  void worker_loop() {
    uint64_t seen = job_of(ticket.load());
    for (;;) {
      auto fresh = [&] { return job_of(ticket.load(std::memory_order_acquire)) != seen; };
      if (!spin_until(fresh)) {
        std::unique_lock<std::mutex> lk(m);
        sleepers.fetch_add(1);
        work_cv.wait(lk, [&] { return stop.load() || fresh(); });
        sleepers.fetch_sub(1);
      }
      if (stop.load()) return;
      uint64_t t = ticket.load(std::memory_order_acquire);
      seen = job_of(t);
      int64_t i;
      while (claim(seen, t, i)) {
        const int64_t count = count_of(t);
        chunk(i);
        if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == count && caller_sleeps.load()) {
          std::lock_guard<std::mutex> lk(m);
          done_cv.notify_one();
        }
      }
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
    work_cv.notify_all();
    for (auto& t : workers) t.join();
    workers.clear();
  }

  void run(int64_t count_n, int64_t g, Task f, void* c) {
    int64_t chunks = (count_n + g - 1) / g;
    if (chunks >= kMaxChunks) {  // NOTE: coarser chunks (a multiple of the grain: any split is
      // allowed, and each chunk still starts at a multiple of the caller's grain)
      g *= (chunks + kMaxChunks - 2) / (kMaxChunks - 1);
      chunks = (count_n + g - 1) / g;
    }
    fn = f, ctx = c, n = count_n, grain = g;
    done.store(0, std::memory_order_relaxed);
    const uint64_t job = (job_of(ticket.load()) + 1) & ((uint64_t{1} << 24) - 1);
    uint64_t t = job << (2 * kIdxBits) | static_cast<uint64_t>(chunks);
    ticket.store(t);  // NOTE: seq_cst, paired with the sleepers count below (no lost wake-up)
    if (sleepers.load() > 0) {
      { std::lock_guard<std::mutex> lk(m); }
      work_cv.notify_all();
    }
    int64_t i, mine = 0;
    while (claim(job, t, i)) {
      chunk(i);
      ++mine;
    }
    if (mine == chunks) return;
    done.fetch_add(mine, std::memory_order_acq_rel);
    auto finished = [&] { return done.load(std::memory_order_acquire) == chunks; };
    if (spin_until(finished)) return;
    std::unique_lock<std::mutex> lk(m);
    caller_sleeps.store(true);
    done_cv.wait(lk, finished);
    caller_sleeps.store(false);
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
