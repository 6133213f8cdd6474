/* The local reduce's stage thread "byteps-reduce": sums of a machine's copies and big copies in and
 * out of shared memory, off the network thread, by priority. */
#ifndef BPS_STAGE_THREAD_H
#define BPS_STAGE_THREAD_H

#include <sys/prctl.h>
#include <unistd.h>

#include <condition_variable>
#include <mutex>
#include <queue>
#include <thread>
#include <vector>

#include "core/kernels/bps_reduce.h"
#include "core/pipeline/bps_queue.h"
#include "core/pipeline/bps_trace.h"
#include "core/pipeline/worker_types.h"

/* Work for the stage thread: a sum of a machine's copies (LOCAL_REDUCE) or a big copy in or out of
 * shared memory; run by priority (then arrival), like the network queue. */
enum BpsTaskKind { BPS_TASK_SUM = 0, BPS_TASK_COPY_IN = 1, BPS_TASK_COPY_OUT = 2 };

struct BpsStageTask {
    int64_t priority;
    uint64_t seq;
    int kind;
    BpsOp *op;
    int part;
    void *dst;
    std::vector<const void *> srcs;
    uint64_t nbytes;
    int dtype;
    int rc;
};


static inline int bps_run_task(BpsStageTask &t, int nthreads) {
    uint64_t t0 = bps_span_start();
    const BpsPart &p = t.op->parts[t.part];
    if (t.kind == BPS_TASK_SUM) {
        int isz = bps_itemsize(t.dtype);
        if (isz <= 0 || t.nbytes % (uint64_t)isz) return -1;
        int rc = bps_sum_many(t.dst, t.srcs.data(), (int)t.srcs.size(), t.nbytes / isz, t.dtype, nthreads);
        bps_span(BPS_STAGE_LOCAL_REDUCE, t0, p.key, p.rnd, t.nbytes, p.server, t.priority);
        return rc;
    }
    if (t.kind == BPS_TASK_COPY_OUT)
        bps_result_into(t.op, t.dst, t.srcs[0], t.nbytes, true, nthreads);
    else
        bps_copy_streamed(t.dst, t.srcs[0], t.nbytes, nthreads);
    bps_span(t.kind == BPS_TASK_COPY_IN ? BPS_STAGE_STAGE : BPS_STAGE_LOCAL_BROADCAST, t0, p.key, p.rnd, t.nbytes,
             p.server, t.priority);
    return 0;
}

/* The stage thread ("byteps-reduce"): one priority queue, sleeping on a condition variable between
 * tasks; results go back to the network thread through ``done`` and its wake eventfd. */
class BpsStageThread {
  public:
    BpsStageThread(int nthreads, int wake_fd) : nthreads_(nthreads), wake_fd_(wake_fd) {}
    ~BpsStageThread() { stop(); }

    void start() { thread_ = std::thread([this] { run(); }); }

    void stop() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (!thread_.joinable()) return;
            stopping_ = true;
        }
        cv_.notify_all();
        thread_.join();
    }

    void submit(BpsStageTask t) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            t.seq = seq_++;
            queue_.push(std::move(t));
        }
        cv_.notify_one();
    }

    void done(std::vector<BpsStageTask> *out) {
        std::lock_guard<std::mutex> lock(mu_);
        out->swap(done_);
    }

  private:
    void run() {
        prctl(PR_SET_NAME, "byteps-reduce", 0, 0, 0);
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
            if (stopping_) return;
            BpsStageTask t = queue_.top();
            queue_.pop();
            lock.unlock();
            t.rc = bps_run_task(t, nthreads_);
            lock.lock();
            done_.push_back(std::move(t));
            bps_signal(wake_fd_);
        }
    }

    int nthreads_;
    int wake_fd_;
    std::thread thread_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool stopping_ = false;
    uint64_t seq_ = 0;
    std::priority_queue<BpsStageTask, std::vector<BpsStageTask>, BpsByPriority<BpsStageTask>> queue_;
    std::vector<BpsStageTask> done_;
};

#endif
