// The persistent thread pool of pool.h. Protocol: a job is [0, n) cut into `count` units of
// `grain`; one 64-bit ticket holds (job id, lo, hi): the units [lo, hi) nobody has claimed yet.
// The caller claims from the front (lo up), the workers from the back (hi down), each claim a
// compare-and-swap on the ticket that succeeds only while it still names their job and takes
// a guided share of what is left (ceil(left / (2 threads)) units, at least one), so a job is a
// few claims, not one per unit, and each thread streams long contiguous runs of its matrix (the
// tiles' software prefetch and the hardware prefetcher follow one thread's run; a unit at a time
// the threads alternated tiles, and each prefetched a tile the other one computed). Finished
// units are counted in `done`; the caller returns once done == count: it waits only for units
// someone claimed, never for a thread that took none (a worker that wakes late, or is
// descheduled before claiming, finds the job gone and touches nothing). A claim proves the job
// is not finished, so the parameters a worker reads after its claim are that job's.
// Workers spin briefly before sleeping (a decode step makes ~150 calls microseconds apart); the
// caller spins briefly for the last units, then sleeps until the worker finishing them wakes it.
#include "pool.h"

#include <pthread.h>
#include <sched.h>
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
    // NOTE: lets a thread of this pool that shares the core run (the scheduler may put the
    // caller and a woken worker on one core of a busy machine: spinning there only delays the
    // work waited for); alone on its core this returns at once
    sched_yield();
    if (std::chrono::steady_clock::now() >= end) return done();
  }
}

// The ticket: job id (24 bits, wrapping) | lo (20 bits) | hi (20 bits), in units.
constexpr int kIdxBits = 20;
constexpr uint64_t kIdxMask = (uint64_t{1} << kIdxBits) - 1;
constexpr int64_t kMaxChunks = int64_t{1} << kIdxBits;

inline uint64_t job_of(uint64_t t) { return t >> (2 * kIdxBits); }
inline int64_t lo_of(uint64_t t) { return static_cast<int64_t>((t >> kIdxBits) & kIdxMask); }
inline int64_t hi_of(uint64_t t) { return static_cast<int64_t>(t & kIdxMask); }
inline uint64_t ticket_of(uint64_t job, int64_t lo, int64_t hi) {
  return job << (2 * kIdxBits) | static_cast<uint64_t>(lo) << kIdxBits | static_cast<uint64_t>(hi);
}

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
  int64_t n = 0, grain = 1, count = 0, most = 1;
  int64_t share = 2;  // NOTE: a claim takes 1 / share of the units left: 2 per thread
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;

  // Claims a guided share of job `job`'s units left (ticket seen as t): from the front for the
  // caller, from the back for a worker; [u0, u1) the units taken. False once none are left.
  bool claim(uint64_t job, uint64_t& t, bool front, int64_t& u0, int64_t& u1) {
    for (;;) {
      const int64_t lo = lo_of(t), hi = hi_of(t);
      if (job_of(t) != job || lo >= hi) return false;
      const int64_t take = std::min((hi - lo + share - 1) / share, most);
      u0 = front ? lo : hi - take;
      u1 = front ? lo + take : hi;
      const uint64_t next = front ? ticket_of(job, u1, hi) : ticket_of(job, lo, u0);
      if (ticket.compare_exchange_weak(t, next, std::memory_order_acq_rel,
                                       std::memory_order_acquire))
        return true;
    }
  }

  void units(int64_t u0, int64_t u1) { fn(ctx, u0 * grain, std::min(u1 * grain, n)); }

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
      int64_t u0, u1;
      while (claim(seen, t, false, u0, u1)) {
        const int64_t total = count;  // NOTE: read after the claim: this job's
        units(u0, u1);
        if (done.fetch_add(u1 - u0, std::memory_order_acq_rel) + (u1 - u0) == total &&
            caller_sleeps.load()) {
          std::lock_guard<std::mutex> lk(m);
          done_cv.notify_one();
        }
      }
    }
  }

  void start(int nworkers) {
    share = 2 * (nworkers + 1);
    for (int i = 0; i < nworkers; ++i) workers.emplace_back([this] { worker_loop(); });
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
    fn = f, ctx = c, n = count_n, grain = g, count = chunks;
    most = (chunks + 2 * share - 1) / (2 * share);
    done.store(0, std::memory_order_relaxed);
    const uint64_t job = (job_of(ticket.load()) + 1) & ((uint64_t{1} << 24) - 1);
    uint64_t t = ticket_of(job, 0, chunks);
    ticket.store(t);  // NOTE: seq_cst, paired with the sleepers count below (no lost wake-up)
    if (sleepers.load() > 0) {
      { std::lock_guard<std::mutex> lk(m); }
      work_cv.notify_all();
    }
    int64_t u0, u1, mine = 0;
    while (claim(job, t, true, u0, u1)) {
      units(u0, u1);
      mine += u1 - u0;
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
