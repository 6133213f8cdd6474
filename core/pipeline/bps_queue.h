/* A thread-safe priority queue with a byte credit, for the pipeline's stages.
 *
 * Order: larger priority first; among equal priorities, the smaller tie first, then earlier
 * arrival (a strict weak ordering on (priority, tie, seq)). A task is handed out while the bytes in
 * flight of tasks at least as urgent as it, plus its size, fit the credit, or when none are in
 * flight (so one task larger than the credit still runs). Less urgent bytes never count: other
 * workers may have deferred them for this task, so they may be stuck behind it.
 *
 * Urgency must be one order on every worker, so the send queues' tie is the wire key, not arrival
 * (docs/architecture.md, "Scheduling"); where workers still disagree, the queue's owner sends its
 * head past the credit after a stall (pop's stall_ms). Tasks are plain integers: no C thread ever
 * touches a Python object.
 */
#ifndef BPS_QUEUE_H
#define BPS_QUEUE_H

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <queue>
#include <vector>

/* The order of the stage queues (the native cores' copy and sum threads): std::priority_queue pops
 * the "largest", so larger priority first, then smaller seq (earlier). */
template <typename T>
struct BpsByPriority {
    bool operator()(const T &a, const T &b) const {
        if (a.priority != b.priority) return a.priority < b.priority;
        return a.seq > b.seq;
    }
};

/* How urgent a queued send is (see above): larger priority, then smaller tie. */
struct BpsUrgency {
    int64_t priority;
    uint64_t tie;
    bool operator<(const BpsUrgency &o) const { return priority != o.priority ? priority < o.priority : tie > o.tie; }
};

/* The order of the send queues (this one, and the native worker core's): most urgent first, then
 * earlier arrival. */
template <typename T>
struct BpsByUrgency {
    bool operator()(const T &a, const T &b) const {
        if (a.priority != b.priority) return a.priority < b.priority;
        if (a.tie != b.tie) return a.tie > b.tie;
        return a.seq > b.seq;
    }
};

/* A credit's head waits this long without progress (no task taken or released) before it goes past
 * the credit: only where workers disagree on urgency (see above) is that ever needed. */
static const int64_t BPS_CREDIT_STALL_MS = 1000;

/* The byte credit's rule (see above), without a lock: the owner serialises its calls, but for set(),
 * which any thread may call (the job's partition size changes once a model is known). */
class BpsCredit {
  public:
    explicit BpsCredit(int64_t credit) : credit_(credit) {}

    bool fits(BpsUrgency u, int64_t nbytes) const {
        int64_t credit = credit_.load(std::memory_order_relaxed);
        if (credit <= 0) return true;
        int64_t ahead = 0;  // bytes in flight at least as urgent
        for (auto it = urgencies_.lower_bound(u); it != urgencies_.end(); ++it) ahead += it->second;
        return ahead == 0 || ahead + nbytes <= credit;
    }

    void take(BpsUrgency u, int64_t nbytes) {
        in_flight_ += nbytes;
        if (credit_.load(std::memory_order_relaxed) > 0) urgencies_[u] += nbytes;
        last_change_ = std::chrono::steady_clock::now();
    }

    void release(BpsUrgency u, int64_t nbytes) {
        in_flight_ -= nbytes;
        if (in_flight_ < 0) in_flight_ = 0;
        auto it = urgencies_.find(u);
        if (it != urgencies_.end() && (it->second -= nbytes) <= 0) urgencies_.erase(it);
        last_change_ = std::chrono::steady_clock::now();
    }

    /* Nothing taken or released for stall_ms (with bytes in flight): the head may go past the credit. */
    bool stalled(int64_t stall_ms) const {
        return stall_ms > 0 && in_flight_ > 0 &&
               std::chrono::steady_clock::now() - last_change_ >= std::chrono::milliseconds(stall_ms);
    }

    void clear() {
        in_flight_ = 0;
        urgencies_.clear();
    }

    int64_t in_flight() const { return in_flight_; }
    int64_t credit() const { return credit_.load(std::memory_order_relaxed); }
    void set(int64_t credit) { credit_.store(credit, std::memory_order_relaxed); }

  private:
    std::atomic<int64_t> credit_;
    int64_t in_flight_ = 0;
    std::map<BpsUrgency, int64_t> urgencies_;  // bytes in flight by urgency (only with a credit)
    std::chrono::steady_clock::time_point last_change_ = std::chrono::steady_clock::now();
};

struct BpsTask {
    int64_t priority;
    uint64_t tie;
    uint64_t seq;
    int64_t id;
    int64_t nbytes;
};

class BpsQueue {
  public:
    explicit BpsQueue(int64_t credit) : credit_(credit) {}

    void push(int64_t priority, uint64_t tie, int64_t id, int64_t nbytes) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            heap_.push(BpsTask{priority, tie, next_seq_++, id, nbytes});
        }
        cv_.notify_one();
    }

    /* Pop the best task if the credit allows; wait up to timeout_ms (0: don't wait, <0: forever).
     * With stall_ms > 0 the head also goes when the credit made no progress for that long.
     * Returns 1 and sets *id on success (2: it went past the credit), 0 on timeout or when closed
     * and empty. */
    int pop(int64_t *id, int64_t timeout_ms, int64_t stall_ms = 0) {
        std::unique_lock<std::mutex> lock(mu_);
        auto ready = [this] { return closed_ || (!heap_.empty() && fits(heap_.top())); };
        if (timeout_ms < 0) {
            cv_.wait(lock, ready);
        } else if (timeout_ms > 0) {
            cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), ready);
        }
        if (heap_.empty()) return 0;
        int got = fits(heap_.top()) ? 1 : credit_.stalled(stall_ms) ? 2 : 0;
        if (!got) return 0;
        const BpsTask t = heap_.top();
        heap_.pop();
        credit_.take(BpsUrgency{t.priority, t.tie}, t.nbytes);
        *id = t.id;
        return got;
    }

    /* Return credit when a task's bytes are no longer in flight (priority, tie: the task's). */
    void release(int64_t nbytes, int64_t priority, uint64_t tie = 0) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            credit_.release(BpsUrgency{priority, tie}, nbytes);
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
    bool fits(const BpsTask &t) const { return credit_.fits(BpsUrgency{t.priority, t.tie}, t.nbytes); }

    std::mutex mu_;
    std::condition_variable cv_;
    std::priority_queue<BpsTask, std::vector<BpsTask>, BpsByUrgency<BpsTask>> heap_;
    uint64_t next_seq_ = 0;
    BpsCredit credit_;  // <= 0: unlimited
    bool closed_ = false;
};

#endif
