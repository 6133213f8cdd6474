/* A thread-safe priority queue with a byte credit, for the pipeline's stages.
 *
 * Order: larger priority first; among equal priorities, earlier arrival first (a strict weak
 * ordering on (priority, seq), unlike ps-lite's threadsafe_pqueue). The credit counts the bytes
 * in flight of the task's priority or a more urgent one: a task is handed out while those plus its
 * size fit the credit, or when none are in flight (so one task larger than the credit still runs).
 * With one priority for everything that is simply the bytes in flight.
 *
 * Less urgent bytes never count, because they may be stuck: worker A may fill its credit with
 * tensor X before the more urgent Y was queued, while worker B, which saw Y first, sends Y and
 * defers X; A's X then waits for B's, which waits for Y. Counting X against Y, Y went out one
 * piece per round trip on A (the rule was "above every priority in flight"), and a training step
 * on the emulated cluster (bench_users.py --cluster, 2 MB partitions, credit 4) ran at 0.68x
 * DDP's speed. The most urgent unfinished tensor always gets a full credit on every worker, so the
 * job progresses (every worker sends a partition's pieces in the same order, byteps/placement.py).
 * Tasks are plain integers: the Python side keeps the objects, so no C thread ever touches a
 * Python object.
 */
#ifndef BPS_QUEUE_H
#define BPS_QUEUE_H

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <queue>
#include <vector>

/* The order of every byteps priority queue (this one, and the native cores' send and stage queues):
 * std::priority_queue pops the "largest", so larger priority first, then smaller seq (earlier). */
template <typename T>
struct BpsByPriority {
    bool operator()(const T &a, const T &b) const {
        if (a.priority != b.priority) return a.priority < b.priority;
        return a.seq > b.seq;
    }
};

/* The byte credit's rule (see above), without a lock: the owner serialises its calls. */
class BpsCredit {
  public:
    explicit BpsCredit(int64_t credit) : credit_(credit) {}

    bool fits(int64_t priority, int64_t nbytes) const {
        if (credit_ <= 0) return true;
        int64_t ahead = 0;  // bytes in flight of this priority or a more urgent one
        for (auto it = priorities_.lower_bound(priority); it != priorities_.end(); ++it) ahead += it->second;
        return ahead == 0 || ahead + nbytes <= credit_;
    }

    void take(int64_t priority, int64_t nbytes) {
        in_flight_ += nbytes;
        if (credit_ > 0) priorities_[priority] += nbytes;
    }

    void release(int64_t priority, int64_t nbytes) {
        in_flight_ -= nbytes;
        if (in_flight_ < 0) in_flight_ = 0;
        auto it = priorities_.find(priority);
        if (it != priorities_.end() && (it->second -= nbytes) <= 0) priorities_.erase(it);
    }

    void clear() {
        in_flight_ = 0;
        priorities_.clear();
    }

    int64_t in_flight() const { return in_flight_; }
    int64_t credit() const { return credit_; }

  private:
    int64_t credit_;
    int64_t in_flight_ = 0;
    std::map<int64_t, int64_t> priorities_;  // priority -> bytes in flight (only with a credit)
};

struct BpsTask {
    int64_t priority;
    uint64_t seq;
    int64_t id;
    int64_t nbytes;
};

class BpsQueue {
  public:
    explicit BpsQueue(int64_t credit) : credit_(credit) {}

    void push(int64_t priority, int64_t id, int64_t nbytes) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            heap_.push(BpsTask{priority, next_seq_++, id, nbytes});
        }
        cv_.notify_one();
    }

    /* Pop the best task if the credit allows; wait up to timeout_ms (0: don't wait, <0: forever).
     * Returns 1 and sets *id on success, 0 on timeout or when closed and empty. */
    int pop(int64_t *id, int64_t timeout_ms) {
        std::unique_lock<std::mutex> lock(mu_);
        auto ready = [this] { return closed_ || (!heap_.empty() && fits(heap_.top())); };
        if (timeout_ms < 0) {
            cv_.wait(lock, ready);
        } else if (timeout_ms > 0) {
            cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), ready);
        }
        if (heap_.empty() || !fits(heap_.top())) return 0;
        const BpsTask t = heap_.top();
        heap_.pop();
        credit_.take(t.priority, t.nbytes);
        *id = t.id;
        return 1;
    }

    /* Return credit when a task's bytes are no longer in flight (priority: the task's). */
    void release(int64_t nbytes, int64_t priority) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            credit_.release(priority, nbytes);
        }
        cv_.notify_all();
    }

    void close() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            closed_ = true;
        }
        cv_.notify_all();
    }

    int64_t size() {
        std::lock_guard<std::mutex> lock(mu_);
        return (int64_t)heap_.size();
    }

    int64_t in_flight() {
        std::lock_guard<std::mutex> lock(mu_);
        return credit_.in_flight();
    }

    int64_t credit() const { return credit_.credit(); }

  private:
    bool fits(const BpsTask &t) const { return credit_.fits(t.priority, t.nbytes); }

    std::mutex mu_;
    std::condition_variable cv_;
    std::priority_queue<BpsTask, std::vector<BpsTask>, BpsByPriority<BpsTask>> heap_;
    uint64_t next_seq_ = 0;
    BpsCredit credit_;  // <= 0: unlimited
    bool closed_ = false;
};

#endif
