/* BpsWorkerCore, the local reduce: LOCAL_READY / LOCAL_DONE, its groups, the stage thread (the local
 * ROUTER, DEALERs and links are BpsLocalPeers: local_peers.h).
 *
 * One partition, in the order it happens (core/local.py); every step runs on byteps-net except the sums
 * and big copies, which run on the stage thread and come back through take_stage_done(). */
#ifndef BPS_WORKER_LOCAL_REDUCE_H
#define BPS_WORKER_LOCAL_REDUCE_H

#include "core/pipeline/bps_worker.h"

/* A local link's message [identity, header, body] with a readable header (into ``h``). */
inline bool BpsWorkerCore::local_header(BpsMessage &msg, BpsHeader *h) {
    return msg.count == 3 && !msg.truncated && bps_parse_header(msg.data(1), msg.size(1), h);
}

/* A local message a direct caller read for someone else: byteps-net handles it, in arrival order. */
inline void BpsWorkerCore::stray_local(BpsMessage &msg, bool *strays) {
    BpsMessage *keep = msg.moved();
    std::lock_guard<std::mutex> lock(mu_);
    local_strays_in_.push_back(keep);
    *strays = true;
}

/* The machine's local reduce (before start()): our ROUTER and the machine's ``local_size`` ranks. */
inline void BpsWorkerCore::add_local(void *router, int local_rank, int local_size) {
    local_rank_ = local_rank;
    local_size_ = local_size;
    nccl_.set_machine(local_rank_, local_size_);
    local_.setup(router, (size_t)local_size);
    stage_ = new BpsStageThread(nthreads_, wake_fd_);
}

/* join(): local ranks (bit n: local rank n) that joined; owners stop waiting for their copies. */
inline void BpsWorkerCore::set_local_joined(uint64_t mask) {
    joined_mask_.store(mask);
    recheck_.store(true);
    wake();
}

/* join(): this process is in join() (``on``) or its join ended. A joined process adds nothing but
 * owns partitions of its peers' ops; each whose first copy of the join's epoch arrives (or was held
 * already) is asked of Python (owed()), which answers with submit_owed(). */
inline void BpsWorkerCore::set_self_joined(bool on) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        self_joined_ = on;
    }
    wake();
}

inline void BpsWorkerCore::owed(std::vector<BpsOwed> *out) {
    std::lock_guard<std::mutex> lock(mu_);
    out->swap(owed_out_);
}

/* The reduce of a partition this joined process owns (``table``: its one row, from Python), in the
 * round its peers' copies name: their sum, pushed and pulled, handed back as for any owner. ``buf``
 * (zeros, ``nbytes``) stands for our own copy only when no peer's copy is usable. */
inline void BpsWorkerCore::submit_owed(int64_t id, int64_t table, uint64_t rnd, uint8_t dtype, unsigned char *buf,
                                       uint64_t nbytes) {
    BpsOp *op = new_op(id, BPS_CMD_PUSHPULL, dtype, 0, 0, false, buf, nbytes, 1);
    op->adds_nothing = true;
    owed_submitted_++;
    {
        std::lock_guard<std::mutex> lock(mu_);
        BpsTable &t = tables_.at((size_t)table);
        op->name = t.name;
        op->local = t.local;
        op->codec = t.codec.get(); /* the tensor table's (codec_of): its state goes on through our pushes */
        op->table = table;
        op->seq = t.count++;
        op->parts = t.parts_for(op->seq);
        for (BpsPart &p : op->parts) {
            p.rnd = rnd;
            p.has_rnd = true;
        }
        submit_locked(op);
    }
    wake();
}

/* A copy of ``id`` came while this process is in join() and nothing here waits for it: ask Python once
 * (a copy a peer sent after it heard the join end is for our next op: rounds restart at 0). The end
 * clears self_joined_ before it flips our epoch (Engine._on_join), and this thread may see the new
 * epoch before its turn takes self_joined_: so self_joined_ is read here too. */
inline void BpsWorkerCore::ask_owed(const Ident &id, const BpsHeader &h) {
    if ((h.flags & BPS_FLAG_JOIN_EPOCH) != join_epoch_flag() || owed_asked_.count(id)) return;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (!self_joined_) return;
        owed_out_.push_back(BpsOwed{h.key, h.round, h.dtype, h.length});
    }
    owed_asked_.insert(id);
    notify_python();
}

/* byteps-net takes set_self_joined(): entering join(), the copies held for our ops are our peers' */
inline void BpsWorkerCore::self_joined_turn(bool on) {
    if (on == self_joined_net_) return;
    self_joined_net_ = on;
    owed_asked_.clear();
    if (!on) return;
    for (auto &h : early_.first_headers()) ask_owed(Ident(h.key, h.round), h);
}

/* Local messages this thread does not own: [identity, header, body] each. */
inline void BpsWorkerCore::forwarded_local(std::vector<std::vector<std::string>> *out) {
    std::lock_guard<std::mutex> lock(mu_);
    out->swap(forward_local_);
}

/* LOCAL_REDUCE (the owner): the copies that came before the op are taken now; the sum starts once
 * every local rank's copy is in (maybe_reduce). */
inline void BpsWorkerCore::local_reduce(BpsOp *op, int i) {
    BpsPart &p = op->parts[i];
    Ident id(p.key, p.rnd);
    Group &g = groups_[id];
    g.op = op;
    g.part = i;
    take_early(g, id);
    maybe_reduce(id);
}

/* COORDINATE (not the owner): our copy into our shared region, then LOCAL_READY to the owner
 * (after_task); the owner's LOCAL_DONE ends it (on_local). */
inline void BpsWorkerCore::coordinate(BpsOp *op, int i) {
    BpsPart &p = op->parts[i];
    op->owed_local[p.owner]++;
    awaiting_[Ident(p.key, p.rnd)] = Await{op, i, p.owner};
    if (!p.abandon.empty()) { /* a call we refused: no copy, our reason (the owner's round fails with it) */
        send_ready(op, p, BPS_FLAG_ABANDON, p.abandon.data(), p.abandon.size());
        return;
    }
    stage_or_inline(BPS_TASK_COPY_IN, op, i, p.staging, {bps_host_bytes(op, p)});
}

/* The copies of partition ``id`` that came before its op (early_), into its group. */
inline void BpsWorkerCore::take_early(Group &g, const Ident &id) {
    for (auto &frames : early_.take(id)) add_copy(g, frames[1], frames[2]);
}

/* Run a copy or sum inline (small) or on the stage thread (>= 256 KB); then after_task(). */
inline void BpsWorkerCore::stage_or_inline(int kind, BpsOp *op, int i, void *dst, std::vector<const void *> srcs) {
    BpsStageTask t{op->priority, 0, kind, op, i, dst, std::move(srcs), op->parts[i].length, op->dtype, 0};
    if (t.nbytes >= BPS_STAGE_THREAD_MIN_BYTES) {
        op->tasks++;
        if (kind == BPS_TASK_SUM) local_threaded_++;
        stage_->submit(std::move(t));
        return;
    }
    t.rc = bps_run_task(t, 1);
    after_task(t);
}

inline void BpsWorkerCore::take_stage_done() {
    if (stage_ == nullptr) return;
    std::vector<BpsStageTask> done;
    stage_->done(&done);
    for (BpsStageTask &t : done) {
        t.op->tasks--;
        after_task(t);
    }
}

inline void BpsWorkerCore::after_task(BpsStageTask &t) {
    BpsOp *op = t.op;
    if (op->done.load()) return; /* failed meanwhile (time-out, abort) */
    BpsPart &p = op->parts[t.part];
    if (t.kind == BPS_TASK_COPY_IN) {
        send_ready(op, p, BPS_FLAG_SHM, &p.desc, sizeof p.desc);
    } else if (t.kind == BPS_TASK_SUM) {
        if (t.rc != 0) {
            groups_.erase(Ident(p.key, p.rnd));
            local_failed(op, t.part, BPS_ERR_PROTOCOL,
                         "tensor '" + op->name + "': local reduce failed: unknown dtype code " +
                             std::to_string(op->dtype));
            return;
        }
        local_reduced_++;
        /* the sum is in our shared region: the machine's result if nothing follows but LOCAL_BROADCAST
         * (one worker machine), else what PUSH sends (queued within the credit like any partition) */
        if (lone_machine_) groups_.erase(Ident(p.key, p.rnd));
        p.result = p.staging;
        p.result_desc = &p.desc;
        advance(op, t.part);
    } else { /* COPY_OUT: the result is in the tensor */
        advance(op, t.part);
    }
}

/* LOCAL_READY to the partition's owner: our copy's descriptor (FLAG_SHM), or our reason (FLAG_ABANDON). */
inline void BpsWorkerCore::send_ready(BpsOp *op, const BpsPart &p, uint8_t flags, const void *body, size_t n) {
    BpsHeader h = bps_header(BPS_CMD_LOCAL_READY, node_id_, p.key, p.rnd, p.length, op->dtype, (uint32_t)local_rank_,
                             flags | join_epoch_flag());
    if (local_.send(p.owner, &h, body, n) != 0) {
        fail(op, BPS_ERR_PROTOCOL, "tensor '" + op->name + "': sending to local rank " + std::to_string(p.owner) +
                                       " failed: " + strerror(errno));
        return;
    }
    local_coordinated_++;
}

/* A LOCAL_READY's copy: a view of the sender's shared region (its descriptor is checked). */
inline void BpsWorkerCore::add_copy(Group &g, const std::string &header, const std::string &body) {
    BpsHeader h;
    memcpy(&h, header.data(), sizeof h);
    BpsPart &p = g.op->parts[g.part];
    unsigned char *src;
    uint64_t len;
    std::string err;
    g.count++;
    if (h.arg < 64) g.ranks |= 1ull << h.arg;
    if (h.flags & BPS_FLAG_ABANDON) { /* that rank refused the call: its reason, no copy */
        if (g.abandon.empty()) g.abandon = body;
    } else if (view_shared(body.data(), body.size(), &src, &len, &err) != 0) {
        if (g.error.empty()) g.error = err;
    } else if (len != p.length) {
        if (g.error.empty())
            g.error = "local rank " + std::to_string(h.arg) + " sent " + std::to_string(len) +
                      " bytes for a partition of " + std::to_string(p.length);
    } else {
        g.copies.push_back(src);
    }
}

inline int BpsWorkerCore::expected_copies() const {
    uint64_t joined = joined_mask_.load() & ~(1ull << local_rank_);
    return local_size_ - 1 - __builtin_popcountll(joined);
}

inline std::vector<int> BpsWorkerCore::missing(const Group &g) const {
    std::vector<int> out;
    uint64_t joined = joined_mask_.load();
    for (int r = 0; r < local_size_; ++r)
        if (r != local_rank_ && !(joined >> r & 1) && !(g.ranks >> r & 1)) out.push_back(r);
    return out;
}

/* LOCAL_REDUCE once every local rank's copy is in (those in join() send none). */
inline void BpsWorkerCore::maybe_reduce(const Ident &id) {
    auto it = groups_.find(id);
    if (it == groups_.end()) return;
    Group &g = it->second;
    if (g.reducing || g.count < expected_copies()) return;
    g.reducing = true;
    BpsOp *op = g.op;
    BpsPart &p = op->parts[g.part];
    if (p.abandon.empty()) p.abandon = g.abandon;
    if (!p.abandon.empty()) { /* a local rank refused the call: no sum; the round fails with its reason */
        int part = g.part;
        groups_.erase(it);
        abandon_local(op, part);
        return;
    }
    if (!g.error.empty()) {
        int part = g.part;
        std::string text = "tensor '" + op->name + "': a local rank's shared copy: " + g.error;
        groups_.erase(it);
        local_failed(op, part, BPS_ERR_PROTOCOL, text);
        return;
    }
    std::vector<const void *> srcs;
    if (!op->adds_nothing || g.copies.empty()) srcs.push_back(bps_host_bytes(op, p));
    srcs.insert(srcs.end(), g.copies.begin(), g.copies.end());
    stage_or_inline(BPS_TASK_SUM, op, g.part, p.staging, std::move(srcs));
}

/* An owner's partition whose call a local rank (maybe this one) refused: the machine's push carries the
 * reason to the server, which fails the round for every machine; on a machine that is the whole job,
 * the round fails here, and the others are told (ERROR). */
inline void BpsWorkerCore::abandon_local(BpsOp *op, int i) {
    BpsPart &p = op->parts[i];
    if (!lone_machine_) {
        p.result = p.staging; /* never read: the server answers an abandoned round with ERROR */
        advance(op, i);
        return;
    }
    std::string body = bps_error_json(p.abandon);
    set_error(op, BPS_ERR_SERVER, body);
    local_broadcast(op, i, nullptr, body);
    part_done(op);
}

/* PULL of an owner's partition: the machine's result, for LOCAL_BROADCAST (or its error, to the others). */
inline void BpsWorkerCore::owner_pulled(BpsOp *op, int i, int server, const BpsHeader &h, BpsMessage *m) {
    BpsPart &p = op->parts[i];
    groups_.erase(Ident(p.key, p.rnd));
    std::string who = "tensor '" + op->name + "': server " + std::to_string(server);
    if (h.cmd == BPS_CMD_ERROR) {
        std::string body = m->count > 1 ? std::string((const char *)m->data(1), m->size(1)) : "{}";
        std::string msg = bps_json_error_field(body);
        set_error(op, BPS_ERR_SERVER, body);
        /* the others get what Python's owner sends: str(TensorMismatchError(...)) */
        local_broadcast(op, i, nullptr, "{\"error\":\"push_pull of tensor '" + bps_json_escape(op->name) +
                                            "' failed: " + (msg.empty() ? "unknown error" : msg) + "\"}");
        part_done(op);
        return;
    }
    std::string err;
    const unsigned char *src = nullptr;
    const void *desc = &p.desc;
    if (h.cmd != BPS_CMD_REPLY) {
        err = "unexpected command " + std::to_string(h.cmd) + " from server " + std::to_string(server);
    } else if (m->count < 2) {
        err = who + " replied without a body";
    } else if (h.flags & BPS_FLAG_COMPRESSED) { /* decoded into our shared region, which the others read */
        std::string bad = bps_codec_decode_reply(h, m->data(1), m->size(1), op->dtype, p.length, p.staging);
        if (bad.empty())
            src = p.staging;
        else
            err = who + "'s compressed reply: " + bad;
    } else if (h.flags & BPS_FLAG_SHM) { /* the others copy from the server's store directly */
        unsigned char *view;
        uint64_t len;
        if (view_shared(m->data(1), m->size(1), &view, &len, &err) == 0 && len != p.length)
            err = who + " replied " + std::to_string(len) + " bytes for a partition of " + std::to_string(p.length);
        src = view;
        desc = m->data(1);
    } else if (m->size(1) != p.length) {
        err = who + " replied " + std::to_string(m->size(1)) + " bytes for a partition of " +
              std::to_string(p.length);
    } else { /* over TCP: into our shared region, which the others read */
        memcpy(p.staging, m->data(1), p.length);
        src = p.staging;
    }
    if (!err.empty()) {
        local_failed(op, i, BPS_ERR_PROTOCOL, err);
        return;
    }
    elastic_.retain(p, h.round, op->dtype, src, p.length);
    p.result = src;
    p.result_desc = desc; /* read by LOCAL_BROADCAST within this call */
    advance(op, i);
}

/* A partition of an owner failed: the op fails, and the others are told (ERROR), as in Python. */
inline void BpsWorkerCore::local_failed(BpsOp *op, int i, int kind, const std::string &text) {
    set_error(op, kind, text);
    local_broadcast(op, i, nullptr, bps_error_json(text));
    part_done(op);
}

/* LOCAL_BROADCAST: LOCAL_DONE with the result's descriptor, or ERROR with ``error_body``, to every
 * other local rank (those in join() too, as Python does: they drop it). */
inline void BpsWorkerCore::local_broadcast(BpsOp *op, int i, const void *desc, const std::string &error_body) {
    BpsPart &p = op->parts[i];
    BpsHeader h = desc ? bps_header(BPS_CMD_LOCAL_DONE, node_id_, p.key, p.rnd, p.length, BPS_NO_DTYPE,
                                    (uint32_t)local_rank_, BPS_FLAG_SHM)
                       : bps_header(BPS_CMD_ERROR, node_id_, p.key, p.rnd, error_body.size(), BPS_NO_DTYPE,
                                    (uint32_t)local_rank_, 0);
    for (int r = 0; r < local_size_; ++r) {
        if (r == local_rank_) continue;
        if (desc)
            local_.send(r, &h, desc, BPS_DESCRIPTOR_SIZE);
        else
            local_.send(r, &h, error_body.data(), error_body.size());
    }
}

/* A message on a local link (authenticated by its token; the identity frame put there by us):
 * [identity, header, body]. */
inline void BpsWorkerCore::on_local(BpsMessage *m) {
    BpsHeader h;
    if (m->count != 3 || m->truncated || !bps_parse_header(m->data(1), m->size(1), &h)) {
        forward_local(m); /* malformed: Python logs it */
        return;
    }
    std::string ident((const char *)m->data(0), m->size(0));
    if (h.cmd >= BPS_CMD_NCCL_ID && h.cmd <= BPS_CMD_NCCL_ABORT) {
        on_nccl(h, m->data(2), m->size(2));
        return;
    }
    Ident id(h.key, h.round);
    if (h.cmd == BPS_CMD_LOCAL_READY) {
        std::string header((const char *)m->data(1), m->size(1)), body((const char *)m->data(2), m->size(2));
        auto g = groups_.find(id);
        if (g != groups_.end()) {
            add_copy(g->second, header, body);
            maybe_reduce(id);
            return;
        }
        early_.hold(id, {ident, header, body}); /* before our op: held until it starts (or its direct owner takes it) */
        if (self_joined_net_) ask_owed(id, h); /* no op of ours will start: we reduce it for our peers */
        return;
    }
    auto a = awaiting_.find(id);
    if ((h.cmd == BPS_CMD_LOCAL_DONE || h.cmd == BPS_CMD_ERROR) && a == awaiting_.end() && held_direct(id)) {
        delete early_done_[id]; /* (none: one reply per partition) */
        early_done_[id] = m->moved(); /* a direct caller's, read by byteps-net */
        take_direct();
        return;
    }
    if ((h.cmd != BPS_CMD_LOCAL_DONE && h.cmd != BPS_CMD_ERROR) || a == awaiting_.end()) {
        forward_local(m); /* an op that failed already: Python drops it */
        return;
    }
    Await w = a->second;
    awaiting_.erase(a);
    BpsOp *op = w.op;
    BpsPart &p = op->parts[w.part];
    op->owed_local[w.owner]--;
    if (h.cmd == BPS_CMD_ERROR) {
        set_error(op, BPS_ERR_SERVER, std::string((const char *)m->data(2), m->size(2)));
        part_done(op);
        return;
    }
    unsigned char *src;
    uint64_t len;
    std::string err;
    if (view_shared(m->data(2), m->size(2), &src, &len, &err) != 0 || len != p.length) {
        if (err.empty())
            err = "copy_into: dst has " + std::to_string(p.length) + " bytes and src has " + std::to_string(len) +
                  " bytes";
        set_error(op, BPS_ERR_PROTOCOL, "tensor '" + op->name + "': local result unreadable: " + err);
        part_done(op);
        return;
    }
    p.result = src; /* the owner's region or the server's store */
    advance(op, w.part); /* COORDINATE ends: LOCAL_BROADCAST */
}

/* A peer's shared memory named by a descriptor (BpsPeerMaps::view), from any thread. */
inline int BpsWorkerCore::view_shared(const void *body, size_t n, unsigned char **ptr, uint64_t *len,
                                      std::string *err) {
    std::lock_guard<std::mutex> lock(maps_mu_);
    return maps_.view(body, n, ptr, len, err);
}

inline void BpsWorkerCore::forward_local(BpsMessage *m) {
    std::vector<std::string> frames;
    for (int i = 0; i < m->count; ++i) frames.emplace_back((const char *)m->data(i), m->size(i));
    forward_local(frames);
}

inline void BpsWorkerCore::forward_local(const std::vector<std::string> &frames) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        forward_local_.push_back(frames);
    }
    notify_python();
}

#endif
