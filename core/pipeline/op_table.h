/* The worker core's op table: every op from its submission until Python forgets it, and the delivery
 * of its completion (to a caller blocked in wait(), or to Python's completion thread, at once or
 * lazily: BPS_LAZY_DELIVERY_S).
 *
 * Threads: submitters and direct callers add ops; byteps-net completes them and reads them for
 * time-outs and aborts; Python's completion thread takes completions; callers wait, find and forget
 * ops. Its mutex guards the map, the completion queues, the count of ops byteps-net runs and each
 * op's ``waiters`` and ``lazy``. Lock order: BpsWorkerCore::mu_ (the inbox) before this one, never
 * the other way: a direct caller checks that byteps-net is idle (running() == 0, the inbox empty)
 * and registers its op under mu_, so that no submission comes in between.
 */
#ifndef BPS_OP_TABLE_H
#define BPS_OP_TABLE_H

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/pipeline/worker_types.h"

class BpsOpTable {
  public:
    ~BpsOpTable() {
        for (auto &kv : ops_) delete kv.second;
    }

    /* Take ``op`` (ownership passes here); ``net``: byteps-net runs it (not a direct caller). */
    void add(BpsOp *op, bool net) {
        std::lock_guard<std::mutex> lock(mu_);
        ops_[op->id] = op;
        if (net) running_++;
    }

    /* Ops byteps-net runs that are not done: a direct call needs none. */
    int64_t running() {
        std::lock_guard<std::mutex> lock(mu_);
        return running_;
    }

    /* A direct call's end: its caller delivers it (``replied``), or byteps-net runs it from now on. */
    void end_direct(BpsOp *op, bool replied) {
        std::lock_guard<std::mutex> lock(mu_);
        op->direct.store(false);
        if (replied) {
            op->parts_left = 0;
            op->done.store(true); /* delivered by its caller: not a completion for byteps-net */
        } else {
            running_++;
        }
    }

    /* byteps-net: ``op`` is done; its completion goes to a caller in wait(), or the completion queues. */
    void complete(BpsOp *op) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!op->done.load()) running_--;
        op->done.store(true);
        /* A caller blocked in wait() sees the op done under this same mutex and delivers it itself, so
         * the completion thread is not told about it: the two would only contend for the GIL over one
         * op. A waiter that timed out first has left (waiters == 0). */
        if (op->waiters == 0) {
            if (op->lazy) deferred_.emplace_back(bps_now(), op->id);
            else completed_.push_back(op->id);
        }
    }

    /* Wake the waiters after completions (byteps-net, once per turn). */
    void notify() { done_cv_.notify_all(); }

    /* The core stops: every wait returns now. */
    void stop() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stopping_ = true;
        }
        done_cv_.notify_all();
    }

    bool is_done(int64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = ops_.find(id);
        return it == ops_.end() || it->second->done.load();
    }

    /* Wait up to timeout_ms for op ``id`` to complete; true once it has (its caller then delivers it). */
    bool wait(int64_t id, int timeout_ms) {
        std::unique_lock<std::mutex> lock(mu_);
        auto finished = [this, id] {
            auto it = ops_.find(id);
            return it == ops_.end() || it->second->done.load() || stopping_;
        };
        auto it = ops_.find(id);
        if (it != ops_.end()) it->second->waiters++;
        done_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), finished);
        it = ops_.find(id);
        if (it == ops_.end()) return true;
        it->second->waiters--;
        if (!it->second->done.load()) return false;
        it->second->lazy = false; /* its caller takes it: not one for the completion thread */
        return true;
    }

    /* Wait up to timeout_ms for completed ops; move their ids into ``out``. */
    void completions(std::vector<int64_t> *out, int timeout_ms) {
        std::unique_lock<std::mutex> lock(mu_);
        auto due = [this] { return !deferred_.empty() && bps_now() >= deferred_.front().first + BPS_LAZY_DELIVERY_S; };
        double deadline = bps_now() + timeout_ms / 1000.0;
        while (completed_.empty() && !due() && !stopping_) { /* woken by every completion, lazy ones too */
            double left = deadline - bps_now();
            if (!deferred_.empty()) left = std::min(left, deferred_.front().first + BPS_LAZY_DELIVERY_S - bps_now());
            if (left <= 0) break;
            done_cv_.wait_for(lock, std::chrono::microseconds((int64_t)(left * 1e6) + 1));
        }
        out->assign(completed_.begin(), completed_.end());
        completed_.clear();
        /* lazy ops their callers have not taken: the caller that delivers one first wins (Engine._deliver) */
        while (due() || (stopping_ && !deferred_.empty())) {
            int64_t id = deferred_.front().second;
            deferred_.pop_front();
            auto it = ops_.find(id);
            if (it == ops_.end() || !it->second->lazy) continue; /* its caller took it meanwhile */
            out->push_back(id);
            lazy_late_++;
        }
    }

    /* Lazy ops the completion thread delivered because their caller had not taken them in time. */
    uint64_t lazy_late() {
        std::lock_guard<std::mutex> lock(mu_);
        return lazy_late_;
    }

    /* Op ``id`` has a listener now (a done callback): its completion goes to the completion thread at
     * once, including one that already waits in deferred_. */
    void prompt(int64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = ops_.find(id);
        if (it == ops_.end() || !it->second->lazy) return;
        it->second->lazy = false;
        for (auto d = deferred_.begin(); d != deferred_.end(); ++d) {
            if (d->second != id) continue;
            deferred_.erase(d);
            completed_.push_back(id);
            done_cv_.notify_all();
            break;
        }
    }

    BpsOp *find(int64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = ops_.find(id);
        return it == ops_.end() ? nullptr : it->second;
    }

    /* Take op ``id`` out to delete it: false (and it stays) while it runs or its memory is still read
     * (zero-copy bodies a link still holds, stage-thread tasks); *gone: the op, NULL if there is none. */
    bool forget(int64_t id, BpsOp **gone) {
        std::lock_guard<std::mutex> lock(mu_);
        *gone = nullptr;
        auto it = ops_.find(id);
        if (it == ops_.end()) return true;
        BpsOp *op = it->second;
        if (!op->done.load() || op->zero_copy.load() > 0 || op->tasks.load() > 0) return false;
        ops_.erase(it);
        *gone = op;
        return true;
    }

    /* Every op, or (``late_after`` > 0) those byteps-net runs that are not done and started before it. */
    std::vector<BpsOp *> snapshot(double late_after = 0) {
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<BpsOp *> out;
        for (auto &kv : ops_) {
            BpsOp *op = kv.second;
            if (late_after <= 0 || (!op->done.load() && !op->direct.load() && op->started < late_after))
                out.push_back(op);
        }
        return out;
    }

  private:
    std::mutex mu_;
    std::condition_variable done_cv_;
    std::unordered_map<int64_t, BpsOp *> ops_;
    int64_t running_ = 0;
    std::vector<int64_t> completed_;
    std::deque<std::pair<double, int64_t>> deferred_; /* (completed at, id) of lazy ops, oldest first */
    uint64_t lazy_late_ = 0;
    bool stopping_ = false;
};

#endif
