/* Per-partition spans of the native threads for the job timeline (BYTEPS_TIMELINE; docs/timeline.md).
 *
 * One buffer per process (bps_trace()), filled by the native threads at each stage boundary and
 * emptied by Python through core/_trace.pyx. Off costs one relaxed atomic load per boundary; on, a
 * span is 64 bytes appended under a mutex. The buffer is bounded: when full, new spans are dropped and
 * counted. Times are CLOCK_MONOTONIC nanoseconds, the clock of Python's time.monotonic_ns().
 */
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <vector>

#include "core/pipeline/bps_stages.h"

struct BpsSpan {      /* 64 bytes; byteps_py/timeline/spans.py SPAN_DTYPE mirrors it */
    uint64_t t0, t1;  /* CLOCK_MONOTONIC ns */
    uint64_t key;     /* wire key: tensor key << 32 | partition */
    uint64_t round;
    uint64_t bytes;
    int64_t priority;
    int32_t server;   /* worker: the partition's server index; server: -1 */
    int32_t peer;     /* server: the pushing rank; worker: -1 */
    int32_t tid;      /* the recording thread (Linux tid: its name is in /proc) */
    int32_t stage;    /* BpsStage (bps_stages.h) */
};

static inline uint64_t bps_trace_now() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline int32_t bps_trace_tid() {
    static thread_local int32_t tid = (int32_t)syscall(SYS_gettid);
    return tid;
}

class BpsTrace {
  public:
    bool on() const { return on_.load(std::memory_order_relaxed); }

    /* Start recording into a buffer of ``capacity`` spans (0: stop recording; what is held stays).
     * The memory is reserved once: a push_back never reallocates (and copies) under a recording thread. */
    void enable(size_t capacity) {
        std::lock_guard<std::mutex> lock(mu_);
        capacity_ = capacity;
        spans_.reserve(capacity);
        on_.store(capacity > 0, std::memory_order_relaxed);
    }

    void record(const BpsSpan &s) {
        std::lock_guard<std::mutex> lock(mu_);
        if (spans_.size() >= capacity_) {
            dropped_++;
            return;
        }
        spans_.push_back(s);
    }

    /* Copy every held span to ``out`` and return (and reset) the count of spans dropped meanwhile.
     * A copy, not a swap: the reserved buffer stays (its pages are already mapped). */
    uint64_t drain(std::vector<BpsSpan> *out) {
        std::lock_guard<std::mutex> lock(mu_);
        out->assign(spans_.begin(), spans_.end());
        spans_.clear();
        uint64_t d = dropped_;
        dropped_ = 0;
        return d;
    }

  private:
    std::atomic<bool> on_{false};
    std::mutex mu_;
    std::vector<BpsSpan> spans_;
    size_t capacity_ = 0;
    uint64_t dropped_ = 0;
};

/* This process's buffer (one per extension module, which is one per process role). */
static inline BpsTrace &bps_trace() {
    static BpsTrace trace;
    return trace;
}

/* Record [t0, now] of ``stage``; the one call at a stage boundary. Costs a load when tracing is off. */
static inline void bps_span(int stage, uint64_t t0, uint64_t key, uint64_t round, uint64_t bytes, int32_t server,
                            int64_t priority = 0, int32_t peer = -1) {
    BpsTrace &tr = bps_trace();
    if (!tr.on()) return;
    tr.record(BpsSpan{t0, bps_trace_now(), key, round, bytes, priority, server, peer, bps_trace_tid(), stage});
}

/* A span that ended at ``t1`` (read before the next span's start, so the two cannot overlap however
 * long this thread is preempted in between). */
static inline void bps_span_to(int stage, uint64_t t0, uint64_t t1, uint64_t key, uint64_t round, uint64_t bytes,
                               int32_t server, int64_t priority = 0, int32_t peer = -1) {
    BpsTrace &tr = bps_trace();
    if (!tr.on()) return;
    tr.record(BpsSpan{t0, t1, key, round, bytes, priority, server, peer, bps_trace_tid(), stage});
}

/* Start time for a span: 0 (never read) while tracing is off, so off costs no clock read either. */
static inline uint64_t bps_span_start() { return bps_trace().on() ? bps_trace_now() : 0; }

/* The buffer's address, for core/_trace.pyx (a separate extension module: it must empty this
 * module's buffer, not its own copy). */
static inline uintptr_t bps_trace_address() { return (uintptr_t)&bps_trace(); }
