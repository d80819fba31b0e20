// A decode step's threads as one team: decode_forward starts them once per step (one OpenMP region)
// and they run every layer together, meeting at a spin barrier between dependent phases, instead of
// one OpenMP fork and join per op (~180 a token: each projection, attention, the K/V prefetch).
//
// Kernels that split work call agentrt::parallel_for: inside a team every thread calls it (SPMD), takes
// its static share (at::parallel_for's rule: ceil(n / threads) contiguous items each, all on the first
// thread up to `grain`) and waits at the barrier; outside a team it is at::parallel_for. Work of one
// thread (norms, RoPE) goes through agentrt::single: the first thread runs it, the others wait. Code
// that runs inside a team must not throw past the team (the others would wait for it forever): a
// thrown exception is kept, the barriers stop waiting, and run_team rethrows it after the region.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace agentrt {
// internal linkage: several builds of these kernels (CPU kinds, or A/B variants) load into one process,
// and a thread_local in an inline function would be one object for all of them
namespace {

class Team {
 public:
  int size() const { return size_; }

  // Every thread arrives before any leaves. Spins, then yields (a thread may have lost its core).
  void barrier() {
    const int phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == size_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
      if (failed_.load(std::memory_order_relaxed)) return;
#if defined(__x86_64__)
      if (spins < (1 << 14)) {
        _mm_pause();
        continue;
      }
#endif
      std::this_thread::yield();
    }
  }

  // Work ranges of `stealing_for` (one per thread): epoch (16 bits) | front (24) | back (24).
  std::atomic<uint64_t>* ranges() { return ranges_; }
  static constexpr int kMaxThreads = 64;

  // Bytes every thread of the team sees: the first thread sizes them, the barrier publishes them.
  char* shared_bytes(size_t n, int id) {
    if (id == 0 && scratch_.size() < n) scratch_.resize(n);
    barrier();
    return scratch_.data();
  }

 private:
  template <typename F>
  friend void run_team(const F& body);
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> phase_{0};
  std::atomic<bool> failed_{false};
  int size_ = 1;
  std::atomic<uint64_t> ranges_[kMaxThreads] = {};
  std::vector<char> scratch_;
  std::exception_ptr error_;
};

struct TeamSeat {
  Team* team = nullptr;
  int id = 0;
  uint64_t epoch = 0;  // stealing_for calls made in this team
};

inline TeamSeat& seat() {
  static thread_local TeamSeat s;
  return s;
}

// Threads that share the work: the team's, else torch's intra-op threads.
inline int64_t num_threads() { return seat().team ? seat().team->size() : at::get_num_threads(); }

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const TeamSeat& s = seat();
  if (!s.team) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t n = end - begin;
  if (n > 0) {
    const int64_t workers = n > grain && n > 1 ? std::min<int64_t>(s.team->size(), (n + grain - 1) / std::max<int64_t>(grain, 1)) : 1;
    const int64_t chunk = (n + workers - 1) / workers, b = begin + s.id * chunk, e = std::min(end, b + chunk);
    if (b < e) f(b, e);
  }
  s.team->barrier();
}

// fn(i, i + 1) for every i in [0, n), for streaming work (the projections' panels): inside a team each
// thread walks its static share from the front, and a thread done with its own takes the others'
// remaining items from their back, so a thread that started late (lost its core for a while on a
// shared machine) delays the step by half as much; each share stays one contiguous stream. Claims
// are compare-and-swaps on (epoch, front, back) words; the epoch (this thread's count of calls: every
// thread makes the same calls) lets whichever thread comes first open a share. Then the barrier.
template <typename F>
inline void stealing_for(int64_t n, const F& f) {
  TeamSeat& s = seat();
  if (!s.team || s.team->size() == 1 || s.team->size() > Team::kMaxThreads || n >= (int64_t(1) << 24)) {
    agentrt::parallel_for(0, n, 1, f);
    return;
  }
  const int64_t size = s.team->size(), chunk = (n + size - 1) / size;
  const uint64_t epoch = ++s.epoch % 0xffff + 1;  // never 0: a word never written reads as epoch 0
  std::atomic<uint64_t>* ranges = s.team->ranges();
  auto pack = [&](uint64_t front, uint64_t back) { return epoch << 48 | front << 24 | back; };
  // the word of thread t's share for this call, opened (set to its whole range) if nobody has yet
  auto current = [&](int64_t t) {
    uint64_t w = ranges[t].load(std::memory_order_acquire);
    while (w >> 48 != epoch) {
      const uint64_t b = std::min<int64_t>(n, t * chunk), e = std::min<int64_t>(n, (t + 1) * chunk);
      if (ranges[t].compare_exchange_weak(w, pack(b, e), std::memory_order_acq_rel)) return pack(b, e);
    }
    return w;
  };
  auto claim = [&](int64_t t, bool from_front) -> int64_t {  // an item of share t, or -1 when none is left
    uint64_t w = current(t);
    while (true) {
      const int64_t front = (w >> 24) & 0xffffff, back = w & 0xffffff;
      if (front >= back) return -1;
      const uint64_t next = from_front ? pack(front + 1, back) : pack(front, back - 1);
      if (ranges[t].compare_exchange_weak(w, next, std::memory_order_acq_rel)) return from_front ? front : back - 1;
    }
  };
  for (int64_t i; (i = claim(s.id, true)) >= 0;) f(i, i + 1);
  for (int64_t k = 1; k < size; ++k) {
    const int64_t t = (s.id + k) % size;
    for (int64_t i; (i = claim(t, false)) >= 0;) f(i, i + 1);
  }
  s.team->barrier();
}

template <typename F>
inline void single(const F& f) {
  const TeamSeat s = seat();
  if (!s.team) {
    f();
    return;
  }
  if (s.id == 0) f();
  s.team->barrier();
}

// A buffer of n bytes all threads of the team share (outside a team, `local`).
inline char* shared_buffer(std::vector<char>& local, size_t n) {
  const TeamSeat s = seat();
  if (!s.team) {
    local.resize(n);
    return local.data();
  }
  return s.team->shared_bytes(n, s.id);
}

// body() on every intra-op thread as one team (body() alone on one thread, or without OpenMP).
template <typename F>
void run_team(const F& body) {
#if defined(_OPENMP)
  if (at::get_num_threads() > 1 && !at::in_parallel_region()) {
    Team team;
#pragma omp parallel
    {
#pragma omp single
      team.size_ = omp_get_num_threads();
      c10::ParallelGuard guard(true);  // at::parallel_for inside runs on the calling thread
      seat() = {&team, omp_get_thread_num(), 0};
      try {
        body();
      } catch (...) {
#pragma omp critical(agentrt_team_error)
        if (!team.error_) team.error_ = std::current_exception();
        team.failed_.store(true);
      }
      seat() = {};
    }
    if (team.error_) std::rethrow_exception(team.error_);
    return;
  }
#endif
  body();
}

}  // namespace
}  // namespace agentrt
