/* BpsWorkerCore, the network thread byteps-net: start, submit, its loop and inbox, PULL. */
#ifndef BPS_WORKER_LOOP_H
#define BPS_WORKER_LOOP_H

#include "core/pipeline/bps_worker.h"

inline BpsWorkerCore::BpsWorkerCore(uint32_t node_id, int64_t credit, double timeout, int nthreads, int notify_fd)
    : node_id_(node_id), sendq_(credit), timeout_(timeout), nthreads_(nthreads), notify_fd_(notify_fd),
      servers_(node_id), elastic_(servers_, node_id) {
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
}

inline BpsWorkerCore::~BpsWorkerCore() {
    stop();
    if (stage_ != nullptr) delete stage_;
    if (gpu_->stop()) delete gpu_;
    nccl_.stop(); /* an NCCL init thread still waiting must not write to the wake fd once it is closed */
    ::close(wake_fd_);
}

inline void BpsWorkerCore::start() {
    std::lock_guard<std::mutex> lock(mu_); /* the full barrier that hands the sockets over */
    if (stage_ != nullptr) stage_->start();
    thread_ = std::thread([this] { run(); });
}

inline void BpsWorkerCore::stop() {
    if (!thread_.joinable()) return;
    stopping_ = true;
    wake();
    thread_.join();
    ops_.stop();
    if (stage_ != nullptr) stage_->stop();
    gpu_->stop();
}

/* Register a tensor's partition table once (per tensor, not per call); returns its id. Its wire codec:
 * ``codec``'s options, or (``codec_of`` >= 0) table ``codec_of``'s codec, its state included. */
inline int64_t BpsWorkerCore::add_table(const std::string &name, std::vector<BpsPart> parts,
                                        const BpsTableCodec *codec, int64_t codec_of) {
    std::lock_guard<std::mutex> lock(mu_);
    bool local = !parts.empty() && parts[0].owner >= 0;
    bool nccl = !parts.empty() && parts[0].nccl_root >= 0;
    std::shared_ptr<BpsTableCodec> wire_codec;
    if (codec_of >= 0) wire_codec = tables_.at((size_t)codec_of).codec;
    else if (codec != nullptr && codec->method != 0) wire_codec = std::make_shared<BpsTableCodec>(*codec);
    elastic_.replay(parts); /* a tensor first used after servers were lost: as if it had been there */
    tables_.push_back(BpsTable{name, std::move(parts), local, nccl, std::move(wire_codec)});
    return (int64_t)tables_.size() - 1;
}

/* Start a push_pull/broadcast of ``buf`` over a registered table: the per-call path. */
inline void BpsWorkerCore::submit_table(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root,
                                        int64_t priority, bool root_self, unsigned char *buf, uint64_t nbytes,
                                        bool lazy, uint32_t divisor) {
    BpsOp *op = new_op(id, cmd, dtype, root, priority, root_self, buf, nbytes, divisor);
    op->lazy = lazy;
    submit_new(op, table);
}

/* A call this rank refused on table ``table``: an op of its own (``buf``, zeros, is never sent) whose
 * partitions take the rounds the call would have had and push ``reason`` instead of data (FLAG_ABANDON;
 * worker_send_queue.h, worker_local_reduce.h). First in the send queue: a later op of the tensor must not
 * take its rounds. */
inline void BpsWorkerCore::submit_abandon(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root,
                                          bool root_self, unsigned char *buf, uint64_t nbytes,
                                          const std::string &reason) {
    BpsOp *op = new_op(id, cmd, dtype, root, INT64_MAX, root_self, buf, nbytes, 1);
    op->abandons = reason;
    submit_new(op, table);
}

/* A CUDA tensor's op: ``nbytes`` of device memory at ``dev_ptr`` on device ``device``; its first copy
 * waits for the producer's ``ready_event``, its completion records ``done_event`` (0: none). */
inline void BpsWorkerCore::submit_gpu(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root,
                                      int64_t priority, bool root_self, uint64_t dev_ptr, int device, uint64_t nbytes,
                                      uint64_t ready_event, uint64_t done_event, bool lazy, uint32_t divisor) {
    BpsOp *op = new_op(id, cmd, dtype, root, priority, root_self, nullptr, nbytes, divisor);
    op->lazy = lazy;
    op->gpu = true;
    op->dev_ptr = dev_ptr;
    op->device = device;
    op->ready_event = ready_event;
    op->done_event = done_event;
    submit_new(op, table);
}

/* A new op on table ``table``: its partitions (the membership's), then byteps-net starts it. */
inline void BpsWorkerCore::submit_new(BpsOp *op, int64_t table) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        BpsTable &t = tables_.at((size_t)table); /* a deque: entries never move */
        op->name = t.name;
        op->local = t.local;
        op->nccl = t.nccl && op->gpu;
        op->codec = t.codec.get();
        op->table = table;
        op->seq = t.count++;
        if (elastic_.holding()) { /* the servers are changing: which partitions it uses is known at commit() */
            op->started = bps_now();
            ops_.add(op, true);
            elastic_.hold_op(op);
            return;
        }
        op->parts = t.parts_for(op->seq);
        submit_locked(op);
    }
    wake();
}

/* Take an op (ownership passes here); it completes through completions(). */
inline void BpsWorkerCore::submit(BpsOp *op) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        submit_locked(op);
    }
    wake();
}

inline void BpsWorkerCore::submit_locked(BpsOp *op) {
    op->started = bps_now();
    op->parts_left = (int)op->parts.size();
    ops_.add(op, true);
    for (size_t i = 0; i < op->parts.size(); ++i) {
        inbox_.push_back(BpsQueued{op->priority, 0, op, (int)i});
    }
}

/* Round of the next push of a wire key (Python's own partitions count here too). */
inline uint64_t BpsWorkerCore::next_round(uint64_t key) {
    std::lock_guard<std::mutex> lock(rounds_mu_);
    return rounds_[key]++;
}

inline void BpsWorkerCore::reset_rounds() {
    std::lock_guard<std::mutex> lock(rounds_mu_);
    rounds_.clear();
}

inline void BpsWorkerCore::wake() { bps_signal(wake_fd_); }

inline void BpsWorkerCore::run() {
    prctl(PR_SET_NAME, "byteps-net", 0, 0, 0);
    /* poll items: the wake-up, the local ROUTER (late peers' handshakes, for Python), one per server's
     * link, one per local peer's link */
    const size_t wake_at = 0, router_at = 1, links_at = 2;
    size_t nservers = 0, local_at = 0;
    std::vector<bps_zmq_pollitem> items;
    BpsMessage msg;
    double next_check = 0;
    while (!stopping_) {
        /* UCX links: their UCP worker is this thread's except while it sleeps in poll, when a direct
         * caller may take it (submit_direct) */
        std::unique_lock<std::mutex> ucx_lock = servers_.lock_ucx();
        if (items.empty() || nservers != servers_.size()) { /* at start, and when a server joined (elastic) */
            nservers = servers_.size();
            placed_.resize(nservers);
            local_at = links_at + nservers;
            items.assign(local_at + local_.size(), bps_zmq_pollitem{nullptr, -1, 0, 0});
            items[wake_at] = bps_zmq_pollitem{nullptr, wake_fd_, BPS_ZMQ_POLLIN, 0};
            /* the local ROUTER, if any (a NULL socket with fd -1 is never ready) */
            void *router = local_.router();
            items[router_at] = bps_zmq_pollitem{router, -1, (short)(router ? BPS_ZMQ_POLLIN : 0), 0};
        }
        bool buffered = false;
        for (size_t i = 0; i < nservers; ++i) { /* a dead link, or one a direct caller holds: not polled */
            BpsConn *l = servers_.direct_owned((int)i) ? nullptr : servers_.live((int)i);
            short ev = l == nullptr ? 0 : (short)(BPS_ZMQ_POLLIN | (l->poll_for_write() ? BPS_ZMQ_POLLOUT : 0));
            items[links_at + i] = bps_zmq_pollitem{nullptr, l == nullptr ? -1 : l->fd(), ev, 0};
            buffered |= l != nullptr && l->pending_input(); /* whole messages in hand: no sleep */
        }
        for (size_t r = 0; r < local_.size(); ++r) {
            BpsConn *l = local_.direct_owned((int)r) ? nullptr : local_.live((int)r);
            short ev = l == nullptr ? 0 : (short)(BPS_ZMQ_POLLIN | (l->poll_for_write() ? BPS_ZMQ_POLLOUT : 0));
            items[local_at + r] = bps_zmq_pollitem{nullptr, l == nullptr ? -1 : l->fd(), ev, 0};
            buffered |= l != nullptr && l->pending_input();
        }
        if (ucx_lock.owns_lock()) ucx_lock.unlock();
        int rc = bps_zmq.poll(items.data(), (int)items.size(), buffered ? 0 : 100);
        if (servers_.has_ucx()) ucx_lock.lock();
        if (rc < 0 && bps_zmq.errno_() != EINTR) break; /* the context was terminated */
        if (items[wake_at].revents) bps_drain(wake_fd_);
        take_inbox();
        take_direct();
        take_stage_done();
        take_gpu_done();
        nccl_issue(); /* the communicator may be ready now */
        if (nservers != servers_.size()) continue; /* a server joined: poll it too before reading */
        if (local_.router() != nullptr && items[router_at].revents) {
            for (int k = 0; k < 256; ++k) {
                int got = bps_recv_message(local_.router(), &msg);
                if (got <= 0) break;
                forward_local(&msg); /* the control plane: every partition comes on a link */
            }
        }
        for (size_t r = 0; r < local_.size(); ++r) {
            short ev = items[local_at + r].revents;
            BpsConn *l = local_.live((int)r);
            if (l == nullptr || (!ev && !l->pending_input())) continue;
            std::unique_lock<std::recursive_mutex> link_lock(local_.link_mu((int)r), std::try_to_lock);
            if (!link_lock) continue; /* a direct caller reads it now */
            take_direct();            /* what it handed over comes before what we read next */
            if (ev & BPS_ZMQ_POLLOUT) l->flush();
            for (int k = 0; k < 256 && !l->dead(); ++k) {
                if (local_.recv((int)r, &msg) <= 0) break; /* [identity, header, body], as on the ROUTER */
                on_local(&msg);
            }
        }
        for (size_t i = 0; i < nservers; ++i) {
            short ev = items[links_at + i].revents;
            BpsConn *l = servers_.live((int)i);
            if (l == nullptr || (!ev && !l->pending_input())) continue;
            std::unique_lock<std::mutex> link_lock(servers_.link_mu((int)i), std::try_to_lock);
            if (!link_lock) continue; /* a direct caller reads it now */
            take_direct();            /* what it handed over comes before what we read next */
            if (ev & BPS_ZMQ_POLLOUT) l->flush();
            check_placed((int)i, l);
            ReplySink sink(this, (int)i);
            for (int k = 0; k < 256 && !l->dead(); ++k) {
                if (l->recv_into(&msg, &sink) <= 0) break;
                placed_[i] = Placed{}; /* the frame it read into, if any, was this message's */
                on_message((int)i, &msg);
            }
        }
        if (servers_.report_broken()) notify_python(); /* links that broke here or under a direct caller */
        send_ready();
        double now = bps_now();
        if (now >= next_check) {
            if (gpu_->unstall(now)) grant_slots();
            check_timeouts(now);
            next_check = now + 0.1;
        }
        flush_completions();
    }
}

inline void BpsWorkerCore::take_inbox() {
    std::vector<BpsQueued> in;
    std::vector<std::unique_ptr<BpsRawSend>> raw;
    bool abort, self_joined, dead_now, commit_now;
    {
        std::lock_guard<std::mutex> lock(mu_);
        in.swap(inbox_);
        raw.swap(raw_);
        abort = abort_;
        self_joined = self_joined_;
        elastic_.take_turn(&dead_now, &commit_now);
    }
    servers_.adopt_joined(); /* elastic: servers that joined (after the above: a commit() naming them) */
    if (dead_now) strand_dead();
    if (commit_now) { /* results first, then stranded partitions go to their replacements, in their rounds */
        elastic_.send_results();
        std::vector<BpsQueued> back = elastic_.take_stranded();
        /* Sent at once, past the credit, in their first order: each had been let through the credit
         * before, so what each worker has in flight becomes again what it had before the loss (a
         * prefix of the order every worker sends in). Queued behind partitions sent after them, they
         * could wait for those while other workers' copies of those wait for them. */
        std::sort(back.begin(), back.end(), [](const BpsQueued &a, const BpsQueued &b) {
            return a.priority != b.priority ? a.priority > b.priority : a.seq < b.seq;
        });
        for (auto &q : back)
            if (!q.op->done.load()) push(q.op, q.part); /* to the replacement, in its round */
    }
    for (auto &m : raw) send_raw_now(m.get());
    for (auto &q : in) start(q.op, q.part); /* before any message of this turn: it may be for this op */
    self_joined_turn(self_joined);
    if (recheck_.exchange(false)) {
        std::vector<std::pair<uint64_t, uint64_t>> ids;
        for (auto &kv : groups_) ids.push_back(kv.first);
        for (auto &id : ids) maybe_reduce(id);
    }
    if (abort) {
        sendq_.drop_all();
        for (BpsOp *op : ops_.snapshot()) { /* a direct caller's op fails when it is handed over (take_direct) */
            if (!op->done.load() && !op->direct.load()) fail(op, BPS_ERR_ABORT, "");
        }
        pending_.clear();
        elastic_.take_stranded(); /* dropped: their ops failed above */
        sendq_.clear_credit();
        groups_.clear();
        awaiting_.clear();
        early_.clear();
    }
}

inline void BpsWorkerCore::forward(int server, BpsMessage *m) {
    BpsForward f;
    f.server = server;
    for (int i = 0; i < m->count; ++i) f.frames.emplace_back((const char *)m->data(i), m->size(i));
    {
        std::lock_guard<std::mutex> lock(mu_);
        forward_.push_back(std::move(f));
    }
    notify_python();
}

/* PULL: a message from server ``server``. */
inline void BpsWorkerCore::on_message(int server, BpsMessage *m) {
    BpsHeader h;
    if (m->count < 1 || !bps_parse_header(m->data(0), m->size(0), &h)) {
        forward(server, m); /* Python logs malformed replies */
        return;
    }
    auto it = pending_.find(std::make_pair(h.key, h.round));
    if (it == pending_.end()) {
        take_direct(); /* a partition a direct caller handed over just now? */
        it = pending_.find(std::make_pair(h.key, h.round));
    }
    if (it == pending_.end() || it->second.first->parts[(size_t)it->second.second].server != server) {
        forward(server, m); /* Python's partition, an op that failed already, or a lost server's late reply */
        return;
    }
    BpsOp *op = it->second.first;
    int index = it->second.second;
    pending_.erase(it);
    release(op, index);
    BpsPart &p = op->parts[index];
    uint64_t t_reply = bps_span_start(); /* PUSH ends where PULL starts */
    bps_span_to(BPS_STAGE_PUSH, p.trace_t, t_reply, p.key, h.round, p.length, server, op->priority);
    op->owed[server]--;
    servers_.count_received(server, m->size(0) + (m->count > 1 ? m->size(1) : 0));
    if (op->done.load()) return;
    reply_ = BpsReply{server, &h, m}; /* PULL's input, for this call */
    advance(op, index);               /* PUSH ends: PULL */
    reply_ = BpsReply{};
}

inline void BpsWorkerCore::receive(BpsOp *op, BpsPart &p, int server, const BpsHeader &h, BpsMessage *m) {
    uint64_t expect = op->root_self ? 0 : p.length;
    unsigned char *dst = bps_host_bytes(op, p);
    std::string who = "tensor '" + op->name + "': server " + std::to_string(server);
    if (m->count < 2) {
        set_error(op, BPS_ERR_PROTOCOL, who + " replied without a body");
        return;
    }
    if (h.flags & BPS_FLAG_COMPRESSED) { /* the sum, encoded (worker_codec.h): decoded into the tensor */
        std::string bad = bps_codec_decode_reply(h, m->data(1), m->size(1), op->dtype, expect, dst);
        if (!bad.empty()) {
            set_error(op, BPS_ERR_PROTOCOL, who + "'s compressed reply: " + bad);
            return;
        }
        if (op->divisor > 1)
            bps_divide_copy(dst, dst, expect / (size_t)bps_itemsize(op->dtype), op->dtype, op->divisor);
        return;
    }
    if (h.flags & BPS_FLAG_SHM) {
        unsigned char *src;
        uint64_t len;
        std::string err;
        if (view_shared(m->data(1), m->size(1), &src, &len, &err) != 0) {
            set_error(op, BPS_ERR_PROTOCOL, err);
            return;
        }
        if (len != expect) {
            set_error(op, BPS_ERR_PROTOCOL, who + " replied " + std::to_string(len) + " bytes for a partition of " +
                                                std::to_string(expect));
            return;
        }
        elastic_.retain(p, h.round, op->dtype, src, p.length); /* the sum, not an average */
        /* a lone pushing machine gets its own region back: the sum is what the tensor holds */
        if (op->divisor > 1 || !(p.staging != nullptr && src == p.staging)) bps_result_into(op, dst, src, len, true);
        return;
    }
    size_t got = m->size(1);
    if (got != expect) {
        set_error(op, BPS_ERR_PROTOCOL, who + " replied " + std::to_string(got) + " bytes for a partition of " +
                                            std::to_string(expect));
        return;
    }
    /* the sum, not an average; a broadcast's root: its own data, the result */
    elastic_.retain(p, h.round, op->dtype, got ? m->data(1) : dst, p.length);
    if (got == 0) return;
    if (m->data(1) == dst) replies_in_place_.fetch_add(1, std::memory_order_relaxed); /* place_reply */
    bps_result_into(op, dst, m->data(1), got, false);
}

#endif
