/* BpsWorkerCore, completions: errors, failing and completing ops (into BpsOpTable, op_table.h), time-outs. */
#ifndef BPS_WORKER_COMPLETIONS_H
#define BPS_WORKER_COMPLETIONS_H

#include "core/pipeline/bps_worker.h"

/* Fail every op in flight (the engine failed): they complete with BPS_ERR_ABORT. */
inline void BpsWorkerCore::fail_all() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        abort_ = true;
    }
    wake();
}

/* Drop a completed op (BpsOpTable::forget). Returns false (and keeps it) while a link still reads its
 * tensor: the caller keeps the tensor alive and asks again later. */
inline bool BpsWorkerCore::forget(int64_t id) {
    BpsOp *gone;
    if (!ops_.forget(id, &gone)) return false;
    if (gone == nullptr) return true;
    bool waiting = false; /* a failed CUDA tensor's slots: free now that nothing reads them */
    for (BpsPart &p : gone->parts) waiting |= gpu_->release(p);
    if (waiting) wake();
    delete gone;
    return true;
}

inline void BpsWorkerCore::forwarded(std::vector<BpsForward> *out) {
    std::lock_guard<std::mutex> lock(mu_);
    out->assign(std::make_move_iterator(forward_.begin()), std::make_move_iterator(forward_.end()));
    forward_.clear();
}

/* A link wrote (or dropped) a zero-copy body of op ``hint``. */
inline void BpsWorkerCore::zc_free(void *, void *hint) { ((BpsOp *)hint)->zero_copy.fetch_sub(1); }

inline BpsOp *BpsWorkerCore::new_op(int64_t id, uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority,
                                    bool root_self, unsigned char *buf, uint64_t nbytes, uint32_t divisor) {
    BpsOp *op = new BpsOp();
    op->divisor = cmd == BPS_CMD_PUSHPULL && bps_divides(dtype) ? divisor : 1;
    op->id = id;
    op->cmd = cmd;
    op->dtype = dtype;
    op->root = root;
    op->priority = priority;
    op->root_self = root_self;
    op->buf = buf;
    op->nbytes = nbytes;
    return op;
}

inline void BpsWorkerCore::notify_python() {
    unsigned char x = 'x';
    ssize_t rc = write(notify_fd_, &x, 1); /* a full pipe means Python is awake anyway */
    (void)rc;
}

inline void BpsWorkerCore::set_error(BpsOp *op, int kind, const std::string &text) {
    if (op->error_kind == BPS_OK) {
        op->error_kind = kind;
        op->error = text;
    }
}

/* Fail an op now: its partitions still queued are dropped, replies still owed are ignored. */
inline void BpsWorkerCore::fail(BpsOp *op, int kind, const std::string &text) {
    set_error(op, kind, text);
    for (auto it = pending_.begin(); it != pending_.end();) {
        if (it->second.first == op) {
            release(op, it->second.second);
            it = pending_.erase(it);
        } else {
            ++it;
        }
    }
    if (op->local) { /* late LOCAL_READYs are then held as early ones; late LOCAL_DONEs go to Python, which drops them */
        for (auto it = groups_.begin(); it != groups_.end();) it = it->second.op == op ? groups_.erase(it) : std::next(it);
        for (auto it = awaiting_.begin(); it != awaiting_.end();)
            it = it->second.op == op ? awaiting_.erase(it) : std::next(it);
    }
    if (op->gpu) gpu_->drop_waiters(op); /* its slots come back when Python forgets it (forget) */
    complete(op);
    /* the machine's order of collectives cannot go on without this op's: every process's NCCL ops fail */
    if (op->nccl) {
        size_t bar = text.find('|'); /* a time-out's "<seconds>|<whom it waited for>" */
        nccl_break(kind == BPS_ERR_TIMEOUT && bar != std::string::npos
                       ? "tensor '" + op->name + "' waited " + text.substr(0, bar) + " s (BYTEPS_TIMEOUT) for " +
                             text.substr(bar + 1)
                       : text);
    }
}

inline void BpsWorkerCore::complete(BpsOp *op) {
    op->parts_left = 0;
    ops_.complete(op);
    have_done_ = true;
}

inline void BpsWorkerCore::flush_completions() {
    if (!have_done_) return;
    have_done_ = false;
    ops_.notify();
}

inline void BpsWorkerCore::check_timeouts(double now) {
    for (BpsOp *op : ops_.snapshot(now - timeout_)) {
        /* on the NCCL stages the coordinator knows whom the machine waits for: the others give it time to
         * say so (its failure reaches them as NCCL_ABORT) before their own, vaguer, time-out */
        if (op->nccl && !nccl_.coordinator() && now - op->started < timeout_ + BPS_NCCL_GRACE_S) continue;
        std::set<std::string> names; /* sorted, as core/engine.py's time-out names them */
        for (auto &kv : op->owed)
            if (kv.second > 0) names.insert("server " + std::to_string(kv.first));
        for (auto &kv : op->owed_local)
            if (kv.second > 0) names.insert("local rank " + std::to_string(kv.first));
        if (op->local) { /* an owner names the local ranks whose copies it still waits for */
            for (auto &kv : groups_) {
                if (kv.second.op != op || kv.second.reducing) continue;
                for (int r : missing(kv.second)) names.insert("local rank " + std::to_string(r));
            }
        }
        std::string who;
        for (auto &n : names) {
            if (!who.empty()) who += ", ";
            who += n;
        }
        if (who.empty() && op->nccl) who = nccl_waits(op);
        if (who.empty() && op->gpu) { /* a CUDA tensor: its copies, or a staging slot */
            for (const BpsPart &p : op->parts) {
                int32_t st = p.stage();
                if (st == BPS_STAGE_COPYD2H || st == BPS_STAGE_COPYH2D)
                    who = "its copies between the GPU and host memory (the producer's ready event, or the GPU, "
                          "never got there)";
                else if (p.at < 0 && p.slot < 0 && who.empty())
                    who = "a GPU staging slot (BYTEPS_GPU_STAGING_BYTES: every slot held by other partitions)";
            }
        }
        if (who.empty()) { /* never sent: say what it is queued behind */
            bool held = false, stranded = false;
            {
                std::lock_guard<std::mutex> lock(mu_);
                held = elastic_.is_held(op);
            }
            stranded = elastic_.is_stranded(op);
            if (held) who = "a change of the servers (it was submitted during one, which never completed)";
            else if (stranded) who = "a lost server's replacement (the change of the servers never completed)";
            else {
                std::map<int, std::pair<int, uint64_t>> by_server; /* what holds the credit */
                std::string first;
                for (auto &kv : pending_) {
                    const BpsPart &q = kv.second.first->parts[(size_t)kv.second.second];
                    by_server[q.server].first++;
                    by_server[q.server].second += q.length;
                    if (first.size() < 200)
                        first += " '" + kv.second.first->name + "' (" + std::to_string(kv.first.first >> 32) + ", " +
                                 std::to_string(kv.first.first & 0xFFFFFFFF) + ") round " +
                                 std::to_string(kv.first.second) + " to server " + std::to_string(q.server) + ";";
                }
                if (!sendq_.empty()) {
                    const BpsQueued &t = sendq_.top();
                    const BpsPart &q = t.op->parts[(size_t)t.part];
                    first += " next: '" + t.op->name + "' (" + std::to_string(q.key >> 32) + ", " +
                             std::to_string(q.key & 0xFFFFFFFF) + ") to server " + std::to_string(q.server);
                }
                std::string held_by;
                for (auto &kv : by_server)
                    held_by += (held_by.empty() ? "" : ", ") + std::string("server ") + std::to_string(kv.first) +
                               ": " + std::to_string(kv.second.first) + " partitions, " +
                               std::to_string(kv.second.second) + " bytes";
                who = "its turn to be sent (" + std::to_string(sendq_.in_flight()) + " bytes in flight, credit " +
                      std::to_string(sendq_.credit()) + ", " + std::to_string(sendq_.size()) + " queued; " +
                      (held_by.empty() ? "no replies owed" : "replies owed by " + held_by) + ";" + first + ")";
            }
        }
        char secs[32];
        snprintf(secs, sizeof secs, "%.0f", now - op->started);
        fail(op, BPS_ERR_TIMEOUT, std::string(secs) + "|" + who);
    }
}

inline void BpsWorkerCore::part_done(BpsOp *op) {
    if (op->done.load()) return;
    if (--op->parts_left > 0) return;
    if (op->gpu) { /* the caller's stream waits for this event: after the op's last copy */
        std::string err = gpu_->record_done(op);
        if (!err.empty()) set_error(op, BPS_ERR_CUDA, "tensor '" + op->name + "': " + err);
    }
    complete(op);
}

#endif
