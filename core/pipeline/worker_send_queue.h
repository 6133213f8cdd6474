/* BpsWorkerCore, the send queue's user: partitions leave BpsSendQueue (send_queue.h) within the byte
 * credit and are pushed (STAGE, PUSH); Python's raw sends. */
#ifndef BPS_WORKER_SEND_QUEUE_H
#define BPS_WORKER_SEND_QUEUE_H

#include "core/pipeline/bps_worker.h"

/* times the send queue's head went past a stalled credit, and the first such tensor's name */
inline uint64_t BpsWorkerCore::credit_stalls(std::string *first) {
    std::lock_guard<std::mutex> lock(mu_);
    *first = first_stall_;
    return sendq_.stalls();
}

inline void BpsWorkerCore::send_raw(BpsRawSend *m) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        raw_.emplace_back(m);
    }
    wake();
}

inline void BpsWorkerCore::send_raw_now(BpsRawSend *m) {
    BpsFrames f;
    f.copy(m->header.data(), m->header.size());
    f.copy(m->body.data(), m->body.size());
    local_.send_router(f, m->ident);
}

inline void BpsWorkerCore::send_ready() {
    if (sendq_.empty()) return;
    bool stalled = false;
    if (!sendq_.fits(sendq_.top())) { /* a credit with no progress for a second: workers disagree on urgency */
        if (!sendq_.stalled()) return;
        stalled = true;
        if (sendq_.count_stall()) { /* Python logs the first (Engine._note_stall) */
            std::lock_guard<std::mutex> lock(mu_);
            first_stall_ = sendq_.top().op->name;
        }
    }
    servers_.cork(true); /* a burst of pushes leaves in as few writes as the sockets take */
    while (!sendq_.empty() && (stalled || sendq_.fits(sendq_.top()))) {
        BpsQueued q = sendq_.pop();
        BpsOp *op = q.op;
        if (op->done.load()) continue;
        push(op, q.part);
        stalled = false; /* one past the credit per stall */
    }
    servers_.cork(false);
}

/* A partition the credit lets go (or one whose server was lost, again): its round, then STAGE if it
 * is in that stage (the copy, and advance() into PUSH), else PUSH. */
inline void BpsWorkerCore::push(BpsOp *op, int index) {
    BpsPart &p = op->parts[index];
    if (servers_.dead(p.server)) { /* elastic: its server is gone */
        if (elastic_.awaiting_commit()) { /* its replacement is known at commit() */
            elastic_.strand(BpsQueued{op->priority, p.qseq, op, index});
            return;
        }
        elastic_.move_part(p, elastic_.replacement(p.key));
        if (p.server < 0) { /* cannot happen: the scheduler never removes the last server */
            fail(op, BPS_ERR_PROTOCOL, "tensor '" + op->name + "': no server left to take over a lost one");
            return;
        }
    }
    /* a local owner pushes the machine's sum from its shared region, in the round it took at start; a
     * partition pushed again (its server was lost) keeps its round */
    uint64_t rnd = op->local || p.has_rnd ? p.rnd : next_round(p.key);
    p.rnd = rnd;
    p.has_rnd = true;
    bps_span(BPS_STAGE_QUEUE, p.trace_t ? p.trace_t : (uint64_t)(op->started * 1e9), p.key, rnd, p.length,
             p.server, op->priority);
    if (p.stage() != BPS_STAGE_STAGE) {
        send_push(op, index);
        return;
    }
    /* no copy where the tensor is in shared memory already (a topology executor's range), or where a
     * lost server's replacement elsewhere takes the bytes from the tensor */
    if (p.staging != nullptr && p.staging != bps_host_bytes(op, p) && p.abandon.empty()) {
        uint64_t t_stage = bps_span_start();
        bps_copy_stream(p.staging, bps_host_bytes(op, p), p.length); /* the server reads it on another core */
        bps_span(BPS_STAGE_STAGE, t_stage, p.key, rnd, p.length, p.server, op->priority);
    }
    advance(op, index);
}

/* PUSH: the partition to its server (a descriptor of our shared region for a colocated one; encoded by
 * its table's codec for a compressed one, the header's length still the dense bytes), then wait for the
 * reply (on_message). */
inline void BpsWorkerCore::send_push(BpsOp *op, int index) {
    BpsPart &p = op->parts[index];
    uint64_t rnd = p.rnd;
    bool empty = op->cmd == BPS_CMD_BROADCAST && !op->root_self;
    uint8_t flags = 0;
    const unsigned char *data = op->local ? p.staging : bps_host_bytes(op, p);
    if (op->local ? p.colocated : p.staging != nullptr && !empty) flags = BPS_FLAG_SHM;
    p.trace_t = bps_span_start(); /* PUSH: until the reply arrives (on_message) */
    uint64_t body_len = empty ? 0 : (flags ? BPS_DESCRIPTOR_SIZE : p.length);
    bool encoded = !flags && !empty && p.abandon.empty() && p.compress && op->codec != nullptr && op->cmd == BPS_CMD_PUSHPULL;
    if (encoded) { /* the blob is copied by the transport: its buffer is the partition's again next round */
        const std::vector<uint8_t> &blob = bps_codec_encode(*op->codec, p.key, rnd, op->dtype, data, p.length);
        data = blob.data();
        body_len = blob.size();
        flags = BPS_FLAG_COMPRESSED;
        compressed_pushes_.fetch_add(1, std::memory_order_relaxed);
    }
    if (!p.abandon.empty()) { /* a call refused here or by a local rank: the reason, no data (or codec state) */
        data = (const unsigned char *)p.abandon.data();
        body_len = p.abandon.size();
        flags = BPS_FLAG_ABANDON;
    }
    BpsHeader h = bps_header(op->cmd, node_id_, p.key, rnd, flags & ~BPS_FLAG_ABANDON ? p.length : body_len,
                             op->dtype, op->root, flags);
    BpsFrames f;
    f.copy(&h, sizeof h);
    if (flags & BPS_FLAG_ABANDON) {
        f.copy(data, body_len);
    } else if (flags & BPS_FLAG_SHM) {
        f.copy(&p.desc, sizeof p.desc);
    } else if (encoded || body_len < 65536) {
        f.copy(data, body_len);
    } else { /* zero-copy from the tensor: the transport reads it while it is on the wire */
        op->zero_copy.fetch_add(1);
        f.zero_copy((void *)data, body_len, &BpsWorkerCore::zc_free, op);
    }
    int rc = servers_.send(p.server, f);
    if (rc != 0) {
        fail(op, BPS_ERR_PROTOCOL, std::string("tensor '") + op->name + "': sending to server " +
                                       std::to_string(p.server) + " failed: " + strerror(errno));
        return;
    }
    servers_.count_sent(p.server, sizeof h + body_len);
    pending_[std::make_pair(p.key, rnd)] = std::make_pair(op, index);
    op->owed[p.server]++;
    sendq_.take(op, index);
}

inline void BpsWorkerCore::release(BpsOp *op, int index) {
    sendq_.release(op, index);
}

#endif
