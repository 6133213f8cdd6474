/* The server's sum threads (BYTEPS_SERVER_ENGINE_THREAD): a round's summations off the serve thread. */
#ifndef BPS_SUM_POOL_H
#define BPS_SUM_POOL_H

#include <stdio.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/kernels/bps_reduce.h"
#include "core/pipeline/bps_trace.h"
#include "core/transport/bps_wire.h"
#include "core/transport/bps_zmq.h"


/* One summation into a round's store, with the ZeroMQ buffers it reads (closed once it has run). */
struct BpsSumTask {
    uint64_t key = 0;
    uint64_t round = 0; /* for the timeline */
    void *dst = nullptr;
    const void *srcs[2] = {nullptr, nullptr};
    int nsrc = 0;     /* 2: dst = srcs[0] + srcs[1]; 1: dst += srcs[0] */
    size_t count = 0; /* elements */
    int dtype = 0;
    bps_zmq_msg keep[2];
    int nkeep = 0;

    void run(int kernel_threads) {
        uint64_t t0 = bps_span_start();
        if (nsrc == 2) {
            bps_sum_many(dst, srcs, 2, count, dtype, kernel_threads);
        } else {
            bps_sum_into(dst, srcs[0], count, dtype, kernel_threads);
        }
        bps_span(BPS_STAGE_SUM, t0, key, round, count * (uint64_t)bps_itemsize(dtype), -1);
        for (int i = 0; i < nkeep; ++i) bps_zmq.msg_close(&keep[i]);
        nkeep = 0;
    }
};

/* BYTEPS_SERVER_ENGINE_THREAD=N > 0: N threads "byteps-sum-<i>"; a key's sums always run on thread
 * key % N in arrival order (summation/sum_pool.py's rule). A finished sum's key goes to done() and
 * the serve thread is woken through ``wake_fd``. */
class BpsSumPool {
  public:
    BpsSumPool(int threads, int kernel_threads, int wake_fd) : kernel_threads_(kernel_threads), wake_fd_(wake_fd) {
        for (int i = 0; i < threads; ++i) lanes_.emplace_back(new Lane());
        for (int i = 0; i < threads; ++i) {
            lanes_[i]->thread = std::thread([this, i] { run(i); });
        }
    }

    ~BpsSumPool() {
        for (auto &l : lanes_) {
            {
                std::lock_guard<std::mutex> lock(l->mu);
                l->stop = true;
            }
            l->cv.notify_all();
        }
        for (auto &l : lanes_) l->thread.join();
    }

    int threads() const { return (int)lanes_.size(); }

    void submit(BpsSumTask *t) {
        Lane &l = *lanes_[t->key % lanes_.size()];
        {
            std::lock_guard<std::mutex> lock(l.mu);
            l.queue.push_back(t);
        }
        outstanding_.fetch_add(1);
        l.cv.notify_one();
    }

    void done(std::vector<uint64_t> *out) {
        std::lock_guard<std::mutex> lock(done_mu_);
        out->swap(done_);
    }

    /* Wait until no sum is queued or running (reset, hand-over); sums are finite, the wait is bounded
     * by their length. */
    void wait_idle() {
        std::unique_lock<std::mutex> lock(done_mu_);
        while (outstanding_.load() > 0) idle_cv_.wait_for(lock, std::chrono::milliseconds(100));
    }

  private:
    struct Lane {
        std::mutex mu;
        std::condition_variable cv;
        std::deque<BpsSumTask *> queue;
        bool stop = false;
        std::thread thread;
    };

    void run(int i) {
        char name[16];
        snprintf(name, sizeof name, "byteps-sum-%d", i);
        prctl(PR_SET_NAME, name, 0, 0, 0);
        Lane &l = *lanes_[i];
        for (;;) {
            BpsSumTask *t;
            {
                std::unique_lock<std::mutex> lock(l.mu);
                while (l.queue.empty() && !l.stop) l.cv.wait_for(lock, std::chrono::milliseconds(500));
                if (l.queue.empty()) return;
                t = l.queue.front();
                l.queue.pop_front();
            }
            t->run(kernel_threads_);
            {
                std::lock_guard<std::mutex> lock(done_mu_);
                done_.push_back(t->key);
                outstanding_.fetch_sub(1);
            }
            idle_cv_.notify_all();
            delete t;
            bps_signal(wake_fd_);
        }
    }

    int kernel_threads_;
    int wake_fd_;
    std::vector<std::unique_ptr<Lane>> lanes_;
    std::mutex done_mu_;
    std::condition_variable idle_cv_;
    std::vector<uint64_t> done_;
    std::atomic<int64_t> outstanding_{0};
};
#endif
