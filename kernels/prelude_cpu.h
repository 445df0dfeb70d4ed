// mtplx kernel prelude: CPU emulation (tests only; compiled with g++).
//
// Runs each threadgroup's threads as real std::threads so that the kernel
// body's barriers are real synchronisation points and ThreadSanitizer can see
// every cross-thread access. Threadgroups run one after another (the kernels
// use one threadgroup per sequence and never communicate across groups), which
// is what lets threadgroup memory be a function-local `static`.
//
// SIMD-group operations are emulated exactly: lanes publish their value into
// a per-SIMD-group slot, meet at a 32-lane barrier, and read their partner's
// slot. Slots are double-buffered so one barrier per shuffle is enough: a
// lane can only overwrite a buffer after the next shuffle's barrier, which no
// lane passes before it has read that buffer.
//
// A barrier that cannot complete (some thread of the group already left the
// kernel, or threads wait at different barrier sites) does not hang: every
// waiter unwinds with an error that the launcher returns to the caller.
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

typedef unsigned int uint;
using std::min;
typedef uint64_t mtplx_u64;

namespace mtplx_cpu {

constexpr unsigned kSimd = 32;
// Backstop only: a correct kernel never waits this long at one barrier.
constexpr int kTimeoutMs = 60000;

struct Unwind {};  // thrown to take a thread out of a broken barrier

struct Group;

struct Barrier {
  std::mutex mu;
  std::condition_variable cv;
  unsigned members = 0;
  unsigned arrived = 0;
  unsigned exited = 0;  // members that returned from the kernel body
  unsigned long gen = 0;
  int site = -1;        // source line of the barrier the current phase waits at
  void wait(int where, Group& g, const char* what);
  void leave() {
    std::lock_guard<std::mutex> lk(mu);
    exited += 1;
    cv.notify_all();
  }
};

struct Simd {
  Barrier bar;
  uint64_t slot[2][kSimd];
};

struct Group {
  unsigned size;
  Barrier tg;
  std::unique_ptr<Simd[]> simd;
  std::mutex err_mu;
  bool failed = false;  // guarded by err_mu
  std::string message;
  explicit Group(unsigned n) : size(n), simd(new Simd[(n + kSimd - 1) / kSimd]) {
    tg.members = n;
    for (unsigned s = 0; s * kSimd < n; ++s) {
      unsigned left = n - s * kSimd;
      simd[s].bar.members = left < kSimd ? left : kSimd;
    }
  }
  void fail(const std::string& m) {
    std::lock_guard<std::mutex> lk(err_mu);
    if (!failed) {
      failed = true;
      message = m;
    }
  }
  bool has_failed() {
    std::lock_guard<std::mutex> lk(err_mu);
    return failed;
  }
};

inline void Barrier::wait(int where, Group& g, const char* what) {
  std::unique_lock<std::mutex> lk(mu);
  if (arrived == 0) {
    site = where;
  } else if (site != where) {
    lk.unlock();
    g.fail(std::string(what) + " divergence: threads wait at lines " +
           std::to_string(site) + " and " + std::to_string(where));
    throw Unwind{};
  }
  arrived += 1;
  if (arrived == members) {
    arrived = 0;
    gen += 1;
    lk.unlock();  // the woken waiters need the mutex: notifying while holding it makes each wait again
    cv.notify_all();
    return;
  }
  const unsigned long mine = gen;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kTimeoutMs);
  while (gen == mine) {
    if (exited > 0) {
      lk.unlock();
      g.fail(std::string(what) + " at line " + std::to_string(where) +
             " reached by only some threads (others already returned)");
      throw Unwind{};
    }
    // Short timed waits so that a failure raised elsewhere in the group
    // (which does not hold this mutex) is noticed promptly.
    cv.wait_for(lk, std::chrono::milliseconds(20));
    if (gen != mine) break;
    lk.unlock();
    bool other_failed = g.has_failed();
    lk.lock();
    if (gen != mine) break;
    if (other_failed) throw Unwind{};
    if (std::chrono::steady_clock::now() > deadline) {
      lk.unlock();
      g.fail(std::string(what) + " at line " + std::to_string(where) + " timed out");
      throw Unwind{};
    }
  }
}

struct Ctx {
  unsigned lid;
  Group* group;
  unsigned parity;  // which slot buffer this lane's next shuffle uses
};

inline thread_local Ctx* tls = nullptr;

inline void barrier(int where) { tls->group->tg.wait(where, *tls->group, "threadgroup barrier"); }

template <class T>
inline T shuffle(T v, unsigned src_mode, unsigned arg, int where) {
  static_assert(sizeof(T) <= 8, "shuffle of wide type");
  Ctx& c = *tls;
  Simd& s = c.group->simd[c.lid / kSimd];
  const unsigned lane = c.lid % kSimd;
  const unsigned p = c.parity;
  c.parity ^= 1u;
  uint64_t raw = 0;
  std::memcpy(&raw, &v, sizeof(T));
  s.slot[p][lane] = raw;
  s.bar.wait(where, *c.group, "simd shuffle");
  unsigned src;
  if (src_mode == 0) {
    src = lane ^ arg;  // xor
  } else {
    src = lane >= arg ? lane - arg : lane;  // up: low lanes keep their own value
  }
  if (src >= s.bar.members) src = lane;
  T r;
  std::memcpy(&r, &s.slot[p][src], sizeof(T));
  return r;
}

inline std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

// Runs `groups` threadgroups of `size` threads each, one group at a time.
// Returns 0, or 1 with a message in err when a barrier could not complete.
template <class F>
int launch(unsigned groups, unsigned size, F body, char* err, int errlen) {
  std::lock_guard<std::mutex> guard(launch_mutex());  // threadgroup memory is static
  for (unsigned g = 0; g < groups; ++g) {
    Group grp(size);
    std::vector<std::thread> threads;
    threads.reserve(size);
    for (unsigned lid = 0; lid < size; ++lid) {
      threads.emplace_back([&grp, &body, lid, g]() {
        Ctx c{lid, &grp, 0u};
        tls = &c;
        try {
          body(lid, g);
        } catch (const Unwind&) {
        }
        tls = nullptr;
        grp.simd[lid / kSimd].bar.leave();
        grp.tg.leave();
      });
    }
    for (auto& t : threads) t.join();
    if (grp.failed) {
      if (err && errlen > 0) std::snprintf(err, errlen, "group %u: %s", g, grp.message.c_str());
      return 1;
    }
  }
  return 0;
}

inline uint as_uint(float x) {
  uint u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

}  // namespace mtplx_cpu

#define MTPLX_FN static inline
#define MTPLX_TG static
#define MTPLX_TGP(T) T*
#define MTPLX_THP(T) T*
#define MTPLX_BARRIER() mtplx_cpu::barrier(__LINE__)
#define MTPLX_SHFL_XOR(x, m) mtplx_cpu::shuffle((x), 0u, (unsigned)(m), __LINE__)
#define MTPLX_SHFL_UP(x, d) mtplx_cpu::shuffle((x), 1u, (unsigned)(d), __LINE__)
#define MTPLX_EXP(x) std::exp((float)(x))
#define MTPLX_LOG(x) std::log((float)(x))
#define MTPLX_AS_UINT(x) mtplx_cpu::as_uint(x)
#define MTPLX_NEG_INF (-std::numeric_limits<float>::infinity())
