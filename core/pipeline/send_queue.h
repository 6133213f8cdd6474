/* byteps-net's send queue: partitions wait by (priority, wire key) and leave while the byte credit
 * takes them (bps_queue.h says why the credit counts only bytes at least as urgent, and why the tie is
 * the wire key). Network-thread state, but for the stall counter, which Python reads. */
#ifndef BPS_SEND_QUEUE_H
#define BPS_SEND_QUEUE_H

#include <atomic>
#include <queue>
#include <vector>

#include "core/pipeline/bps_queue.h"
#include "core/pipeline/worker_types.h"

class BpsSendQueue {
  public:
    explicit BpsSendQueue(int64_t credit) : credit_(credit) {}

    void add(const BpsQueued &q) { queue_.push(q); }
    bool empty() const { return queue_.empty(); }
    size_t size() const { return queue_.size(); }
    const BpsQueued &top() const { return queue_.top(); }

    BpsQueued pop() {
        BpsQueued q = queue_.top();
        queue_.pop();
        return q;
    }

    /* The engine failed: nothing queued goes out any more. */
    void drop_all() {
        while (!queue_.empty()) queue_.pop();
    }

    /* the credit counts bytes in flight at least as urgent: (priority, wire key), one order on every
     * worker */
    static BpsUrgency urgency(const BpsOp *op, int part) {
        return BpsUrgency{op->priority, op->parts[(size_t)part].key};
    }

    bool fits(const BpsQueued &q) const {
        return credit_.fits(BpsUrgency{q.priority, q.tie}, (int64_t)q.op->parts[q.part].length);
    }

    /* Partition ``part`` of ``op`` is on the wire / its reply is in. */
    void take(const BpsOp *op, int part) {
        credit_.take(urgency(op, part), (int64_t)op->parts[(size_t)part].length);
    }
    void release(const BpsOp *op, int part) {
        credit_.release(urgency(op, part), (int64_t)op->parts[(size_t)part].length);
    }

    /* A credit with no progress for a second: workers disagree on urgency, the head may go past it. */
    bool stalled() const { return credit_.stalled(BPS_CREDIT_STALL_MS); }
    /* Count a stall; true for the first (Python logs it). */
    bool count_stall() { return stalls_.fetch_add(1) == 0; }
    uint64_t stalls() const { return stalls_.load(); }

    void clear_credit() { credit_.clear(); }
    int64_t in_flight() const { return credit_.in_flight(); }
    int64_t credit() const { return credit_.credit(); }
    void set_credit(int64_t credit) { credit_.set(credit); } /* any thread */

  private:
    BpsCredit credit_;
    std::priority_queue<BpsQueued, std::vector<BpsQueued>, BpsByUrgency<BpsQueued>> queue_;
    std::atomic<uint64_t> stalls_{0};
};

#endif
