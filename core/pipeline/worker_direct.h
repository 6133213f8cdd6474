/* BpsWorkerCore, direct calls: a synchronous call's round trip on the caller's thread. Each plans its
 * one partition's stage list as byteps-net would (plan()) and moves through it with step(), doing each
 * stage's work on its own thread; byteps-net takes over a partition whose window passed in the stage
 * it is in (take_direct), and advance() moves it on from there. */
#ifndef BPS_WORKER_DIRECT_H
#define BPS_WORKER_DIRECT_H

#include "core/pipeline/bps_worker.h"

/* A synchronous call's fast path (docs/architecture.md, "Direct synchronous calls"): the caller's
 * thread sends its op's one partition on the server's link and reads the reply itself, when
 * byteps-net is idle. A reply later than BPS_DIRECT_WINDOW_S hands the partition to byteps-net
 * (adopted); messages for others go to byteps-net in order. False: the fast path does not apply. */
inline bool BpsWorkerCore::submit_direct(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root,
                                         int64_t priority, bool root_self, unsigned char *buf, uint64_t nbytes,
                                         uint32_t divisor) {
    int server;
    BpsPart part;
    std::string name;
    uint64_t seq;
    bool local;
    {
        std::lock_guard<std::mutex> lock(mu_);
        const BpsTable &t = tables_.at((size_t)table);
        seq = t.count;
        const std::vector<BpsPart> &parts = t.parts_for(seq);
        /* a compressed table's partitions are encoded and decoded by byteps-net alone, which keeps their
         * codec state (worker_codec.h): never on a caller's thread */
        if (parts.size() != 1 || elastic_.changing() || t.codec) return false;
        local = t.local;
        part = parts[0];
        name = t.name;
    }
    if (local && part.owner == local_rank_)
        return submit_owner_direct(id, table, seq, part, name, cmd, dtype, root, priority, buf, nbytes, divisor);
    if (local)
        return submit_local_direct(id, table, seq, part, name, cmd, dtype, root, priority, buf, nbytes, divisor);
    server = part.server;
    if (part.length > BPS_DIRECT_MAX_BYTES || server < 0 || server >= servers_.count() ||
        servers_.link(server) == nullptr || servers_.dead(server))
        return false;
    /* A UCX endpoint is driven by its thread's UCP worker, which every endpoint shares: the caller
     * takes the whole worker (lock_ucx(), which byteps-net holds except while it sleeps in poll), then
     * the link, in the order byteps-net takes them. A TCP link needs only its own lock. */
    std::unique_lock<std::mutex> ucx_lock = servers_.lock_ucx();
    std::unique_lock<std::mutex> link_lock(servers_.link_mu(server));
    BpsConn *l = servers_.link(server);
    if (l == nullptr || (strcmp(l->kind(), "tcp") != 0 && !ucx_lock.owns_lock())) return false;
    /* placing: byteps-net is reading a reply into a partition on it (check_placed ends that) */
    if (l->dead() || l->wants_write() || l->pending_input() || l->placing()) return false;
    BpsOp *op = begin_direct(id, table, seq, part, name, cmd, dtype, root, priority, root_self, buf, nbytes, divisor,
                             false, false);
    if (op == nullptr) return false;
    servers_.set_direct_owned(server, true);
    BpsPart &p = op->parts[0];
    uint64_t rnd = p.rnd;
    bool empty = cmd == BPS_CMD_BROADCAST && !root_self;
    uint64_t body_len = empty ? 0 : p.length;
    /* STAGE (a colocated server) copies nothing: for so few bytes a descriptor saves nothing, the bytes
     * go inline */
    if (step(op, 0) == BPS_STAGE_STAGE) step(op, 0); /* PUSH */
    BpsHeader h = bps_header(cmd, node_id_, p.key, rnd, body_len, dtype, root, 0);
    BpsFrames f;
    f.copy(&h, sizeof h);
    f.copy(buf + p.offset, body_len);
    bool replied = false, strays = false;
    p.trace_t = bps_span_start(); /* PUSH: until the reply (direct_wait, or byteps-net if it adopts it) */
    if (l->send(f) == 0) {
        servers_.count_sent(server, sizeof h + body_len);
        replied = direct_wait(op, server, l, rnd, &strays);
    } else {
        set_error(op, BPS_ERR_PROTOCOL, "tensor '" + name + "': sending to server " + std::to_string(server) +
                                            " failed: " + l->error());
        replied = true;
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        end_direct(op, replied, rnd, &adopt_in_); /* adopted: as if byteps-net had sent it */
    }
    servers_.set_direct_owned(server, false);
    bool more = l->pending_input() || l->dead(); /* UCX: other endpoints' messages came meanwhile */
    link_lock.unlock();
    if (ucx_lock.owns_lock()) ucx_lock.unlock();
    count_direct(replied, strays || more);
    return true;
}

/* A direct call's end (mu_ held): its caller delivers it (``replied``), or byteps-net takes it over
 * through ``adopt``. */
inline void BpsWorkerCore::end_direct(BpsOp *op, bool replied, uint64_t rnd, std::vector<BpsQueued> *adopt) {
    ops_.end_direct(op, replied);
    if (!replied) adopt->push_back(BpsQueued{op->priority, rnd, op, 0});
}

/* After a direct call let go of its link: byteps-net has work (``more``, or an adopted partition). */
inline void BpsWorkerCore::count_direct(bool replied, bool more) {
    if (!replied || more) wake();
    if (replied) direct_calls_.fetch_add(1);
    else direct_adopted_.fetch_add(1);
}

/* A direct caller's sleep on its link until input (or room to write) or ``deadline``; false once
 * the deadline has passed. Before ``spin_until`` it only yields its core and returns, so that the
 * caller polls the link again. */
inline bool BpsWorkerCore::wait_link(BpsConn *l, double deadline, double spin_until) {
    if (l->wants_write()) l->flush();
    double now = bps_now(), left = deadline - now;
    if (left <= 0) return false;
    if (now < spin_until) {
        sched_yield();
        return true;
    }
    if (l->arm_to_sleep()) return true; /* input came while arming (UCX's wake-up fd, a ring's bell) */
    struct pollfd pfd = {l->fd(), (short)(POLLIN | (l->poll_for_write() ? POLLOUT : 0)), 0};
    struct timespec ts = {0, (long)(left * 1e9)};
    ppoll(&pfd, 1, &ts, nullptr);
    return true;
}

/* A direct call's op, registered with its round taken and its stages planned, or NULL (the normal
 * path) when byteps-net is busy, the servers are changing, another thread submitted on the table
 * meanwhile or (``local``: either side of the local reduce) join() handed the local reduce to Python.
 * ``awaits_done``: a non-owner, whose LOCAL_DONE byteps-net keeps if it reaches the ROUTER
 * (local_direct_ids_). */
inline BpsOp *BpsWorkerCore::begin_direct(int64_t id, int64_t table, uint64_t seq, const BpsPart &part,
                                          const std::string &name, uint8_t cmd, uint8_t dtype, uint32_t root,
                                          int64_t priority, bool root_self, unsigned char *buf, uint64_t nbytes,
                                          uint32_t divisor, bool local, bool awaits_done) {
    BpsOp *op = new_op(id, cmd, dtype, root, priority, root_self, buf, nbytes, divisor);
    op->name = name;
    op->local = local;
    op->parts.push_back(part);
    op->parts_left = 1;
    op->started = bps_now();
    op->direct.store(true);
    BpsPart &p = op->parts[0];
    std::lock_guard<std::mutex> lock(mu_);
    BpsTable &t = tables_.at((size_t)table);
    if (ops_.running() != 0 || !inbox_.empty() || !raw_.empty() || abort_ || stopping_ || elastic_.changing() ||
        (local && self_joined_) || t.count != seq) {
        delete op;
        return nullptr;
    }
    op->table = table;
    op->seq = t.count++;
    ops_.add(op, false);
    p.rnd = next_round(p.key);
    p.has_rnd = true;
    if (awaits_done) local_direct_ids_.insert(Ident(p.key, p.rnd));
    plan(op, 0);
    return op;
}

/* submit_direct for a partition of the machine's local reduce that another local rank owns: the
 * caller copies it into its shared region, sends LOCAL_READY on the link to the owner and reads the
 * owner's LOCAL_DONE itself. Adopted as for a server; byteps-net keeps a LOCAL_DONE that reaches it
 * meanwhile (early_done_). False: the fast path does not apply. */
inline bool BpsWorkerCore::submit_local_direct(int64_t id, int64_t table, uint64_t seq, const BpsPart &part,
                                               const std::string &name, uint8_t cmd, uint8_t dtype, uint32_t root,
                                               int64_t priority, unsigned char *buf, uint64_t nbytes,
                                               uint32_t divisor) {
    int owner = part.owner;
    if (cmd != BPS_CMD_PUSHPULL || owner < 0 || owner == local_rank_ || (size_t)owner >= local_.size() ||
        part.staging == nullptr || part.length > BPS_DIRECT_MAX_BYTES || part.offset + part.length > nbytes)
        return false;
    std::unique_lock<std::recursive_mutex> link_lock(local_.link_mu(owner));
    BpsConn *l = local_.live(owner);
    if (l == nullptr || strcmp(l->kind(), "ucx") == 0 || l->wants_write() || l->pending_input()) return false;
    BpsOp *op = begin_direct(id, table, seq, part, name, cmd, dtype, root, priority, false, buf, nbytes, divisor, true,
                             true);
    if (op == nullptr) return false;
    BpsPart &p = op->parts[0];
    local_.set_direct_owned(owner, true);
    step(op, 0); /* COORDINATE: our copy into our shared region, LOCAL_READY to the owner */
    memcpy(p.staging, buf + p.offset, p.length);
    BpsHeader h = bps_header(BPS_CMD_LOCAL_READY, node_id_, p.key, p.rnd, p.length, dtype, (uint32_t)local_rank_,
                             BPS_FLAG_SHM | join_epoch_flag());
    BpsFrames f;
    f.copy(&h, sizeof h);
    f.copy(&p.desc, sizeof p.desc);
    bool replied = false, strays = false;
    BpsPollingLinks polling({l}, direct_spin_s_ > 0); /* a ring: its bell waits until we stop polling */
    if (l->send(f) == 0) {
        local_.count_sent();
        local_coordinated_++;
        replied = local_direct_wait(op, owner, l, &strays);
    } else {
        set_error(op, BPS_ERR_PROTOCOL, "tensor '" + name + "': sending to local rank " + std::to_string(owner) +
                                            " failed: " + l->error());
        replied = true;
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        local_direct_ids_.erase(Ident(p.key, p.rnd));
        end_direct(op, replied, p.rnd, &local_adopt_in_); /* adopted: byteps-net waits for its LOCAL_DONE */
    }
    local_.set_direct_owned(owner, false);
    polling.stop(); /* first: what comes after this rings a bell, what came before is pending_input */
    bool more = l->pending_input() || l->dead();
    link_lock.unlock();
    count_direct(replied, strays || more);
    return true;
}

/* submit_direct for a partition of the machine's local reduce that this process owns, on a machine
 * that is the whole job: the caller takes the other local ranks' copies (from early_, then their
 * links), sums them into its shared region, sends each LOCAL_DONE and copies the sum into the tensor.
 * A copy still missing after BPS_DIRECT_WINDOW_S, a broken link or an unreadable copy hands the
 * partition to byteps-net with the copies taken so far. False: the fast path does not apply. */
inline bool BpsWorkerCore::submit_owner_direct(int64_t id, int64_t table, uint64_t seq, const BpsPart &part,
                                               const std::string &name, uint8_t cmd, uint8_t dtype, uint32_t root,
                                               int64_t priority, unsigned char *buf, uint64_t nbytes,
                                               uint32_t divisor) {
    if (cmd != BPS_CMD_PUSHPULL || !lone_machine_ || local_size_ < 2 || local_size_ > 64 ||
        (size_t)local_size_ != local_.size() || part.staging == nullptr ||
        part.length > BPS_DIRECT_MAX_BYTES || part.offset + part.length > nbytes || joined_mask_.load() != 0)
        return false;
    /* every other local rank's link, or nothing: a direct caller of this process may hold one */
    std::vector<std::unique_lock<std::recursive_mutex>> link_locks;
    std::vector<int> peers;
    for (int r = 0; r < local_size_; ++r) {
        if (r == local_rank_) continue;
        std::unique_lock<std::recursive_mutex> lk(local_.link_mu(r), std::try_to_lock);
        BpsConn *l = lk ? local_.live(r) : nullptr;
        if (l == nullptr || strcmp(l->kind(), "ucx") == 0 || l->wants_write()) return false;
        link_locks.push_back(std::move(lk));
        peers.push_back(r);
    }
    BpsOp *op = begin_direct(id, table, seq, part, name, cmd, dtype, root, priority, false, buf, nbytes, divisor, true,
                             false);
    if (op == nullptr) return false;
    BpsPart &p = op->parts[0];
    Ident me(p.key, p.rnd);
    for (int r : peers) local_.set_direct_owned(r, true);
    step(op, 0); /* LOCAL_REDUCE */
    /* [identity, header, body] of each LOCAL_READY: those that reached byteps-net first */
    std::vector<std::vector<std::string>> copies = early_.take(me);
    bool strays = false;
    bool all_in = owner_direct_wait(p, peers, &copies, &strays);
    bool replied = false;
    if (all_in) {
        Group g;
        g.op = op;
        g.part = 0;
        for (auto &frames : copies) add_copy(g, frames[1], frames[2]);
        std::vector<const void *> srcs{buf + p.offset};
        srcs.insert(srcs.end(), g.copies.begin(), g.copies.end());
        BpsStageTask sum{priority, 0, BPS_TASK_SUM, op, 0, p.staging, std::move(srcs), p.length, dtype, 0};
        /* an unreadable copy, a refused call or a failed sum: byteps-net reports it as usual */
        if (g.error.empty() && g.abandon.empty() && g.count == (int)peers.size() && bps_run_task(sum, 1) == 0) {
            local_reduced_++;
            step(op, 0); /* LOCAL_BROADCAST */
            BpsHeader h = bps_header(BPS_CMD_LOCAL_DONE, node_id_, p.key, p.rnd, p.length, BPS_NO_DTYPE,
                                     (uint32_t)local_rank_, BPS_FLAG_SHM);
            for (int r : peers) local_.send(r, &h, &p.desc, BPS_DESCRIPTOR_SIZE); /* LOCAL_BROADCAST */
            BpsStageTask out{priority, 0, BPS_TASK_COPY_OUT, op, 0, buf + p.offset, {p.staging}, p.length, dtype, 0};
            bps_run_task(out, 1);
            step(op, 0); /* done */
            owner_direct_++;
            replied = true;
        }
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        ops_.end_direct(op, replied);
        if (!replied) owner_adopt_in_.push_back(std::make_pair(op, std::move(copies)));
    }
    bool more = false;
    for (int r : peers) {
        local_.set_direct_owned(r, false);
        BpsConn *l = local_.link(r);
        more |= l->pending_input() || l->dead();
    }
    link_locks.clear();
    count_direct(replied, strays || more);
    return true;
}

/* The direct owner's wait for the other local ranks' LOCAL_READYs of partition ``p`` on their links
 * (their locks held), added to ``copies``: true once every one is in, false when the window passed or
 * a link broke. Messages for others go to byteps-net in order, as in local_direct_wait. */
inline bool BpsWorkerCore::owner_direct_wait(const BpsPart &p, const std::vector<int> &peers,
                                             std::vector<std::vector<std::string>> *copies, bool *strays) {
    double deadline = bps_now() + BPS_DIRECT_WINDOW_S, spin_until = bps_now() + direct_spin_s_;
    std::vector<struct pollfd> pfds(peers.size());
    std::vector<BpsConn *> links;
    for (int r : peers) links.push_back(local_.link(r));
    BpsPollingLinks polling(links, direct_spin_s_ > 0); /* until we sleep or return */
    BpsMessage msg;
    for (;;) {
        for (size_t k = 0; k < peers.size(); ++k) {
            int r = peers[k];
            BpsConn *l = local_.link(r);
            while (copies->size() < peers.size() && local_.recv(r, &msg) > 0) {
                BpsHeader h;
                if (!local_header(msg, &h) || h.cmd != BPS_CMD_LOCAL_READY || h.key != p.key || h.round != p.rnd) {
                    stray_local(msg, strays);
                    continue;
                }
                std::vector<std::string> frames;
                for (int i = 0; i < 3; ++i) frames.emplace_back((const char *)msg.data(i), msg.size(i));
                copies->push_back(std::move(frames));
            }
            if (l->dead()) return false;
        }
        if (copies->size() >= peers.size()) return true;
        double now = bps_now(), left = deadline - now;
        if (left <= 0) return false;
        if (now < spin_until) {
            sched_yield();
            continue;
        }
        bool came = false;
        for (size_t k = 0; k < peers.size(); ++k) {
            BpsConn *l = local_.link(peers[k]);
            if (l->wants_write()) l->flush();
            came |= l->arm_to_sleep(); /* a ring's bytes that came without a bell */
            pfds[k] = pollfd{l->fd(), (short)(POLLIN | (l->poll_for_write() ? POLLOUT : 0)), 0};
        }
        if (came) continue;
        struct timespec ts = {0, (long)(left * 1e9)};
        ppoll(pfds.data(), pfds.size(), &ts, nullptr);
    }
}

/* The direct local caller's wait for the owner's LOCAL_DONE (or ERROR) of its partition on link ``l``
 * (its lock held): true once the result is in the tensor (or the op failed), false when the window
 * passed or the link broke. */
inline bool BpsWorkerCore::local_direct_wait(BpsOp *op, int owner, BpsConn *l, bool *strays) {
    BpsPart &p = op->parts[0];
    double deadline = bps_now() + BPS_DIRECT_WINDOW_S, spin_until = bps_now() + direct_spin_s_;
    BpsMessage msg;
    for (;;) {
        while (local_.recv(owner, &msg) > 0) { /* [identity, header, body]: ``l`` */
            BpsHeader h;
            if (!local_header(msg, &h) || h.key != p.key || h.round != p.rnd ||
                (h.cmd != BPS_CMD_LOCAL_DONE && h.cmd != BPS_CMD_ERROR)) {
                stray_local(msg, strays);
                continue;
            }
            if (h.cmd == BPS_CMD_ERROR) {
                set_error(op, BPS_ERR_SERVER, std::string((const char *)msg.data(2), msg.size(2)));
                return true;
            }
            step(op, 0); /* LOCAL_BROADCAST: the owner's result into the tensor */
            unsigned char *src;
            uint64_t len;
            std::string err;
            int rc = view_shared(msg.data(2), msg.size(2), &src, &len, &err);
            if (rc != 0 || len != p.length) {
                if (err.empty())
                    err = "copy_into: dst has " + std::to_string(p.length) + " bytes and src has " +
                          std::to_string(len) + " bytes";
                set_error(op, BPS_ERR_PROTOCOL, "tensor '" + op->name + "': local result unreadable: " + err);
                return true;
            }
            bps_result_into(op, op->buf + p.offset, src, p.length, false); /* COPY_OUT */
            step(op, 0); /* done */
            return true;
        }
        if (l->dead()) return false; /* byteps-net adopts it; its DEALER carries what follows */
        if (!wait_link(l, deadline, spin_until)) return false;
    }
}

/* The direct caller's wait for the reply of (its key, ``rnd``) on link ``l`` (its lock held):
 * true once the reply was taken into the op, false when the window passed. */
inline bool BpsWorkerCore::direct_wait(BpsOp *op, int server, BpsConn *l, uint64_t rnd, bool *strays) {
    BpsPart &p = op->parts[0];
    double deadline = bps_now() + BPS_DIRECT_WINDOW_S, spin_until = bps_now() + direct_spin_s_;
    BpsMessage msg;
    for (;;) {
        while (l->recv(&msg) > 0) {
            BpsHeader h;
            bool mine = msg.count >= 1 && bps_parse_header(msg.data(0), msg.size(0), &h) && h.key == p.key &&
                        h.round == rnd;
            if (!mine) { /* someone else's: byteps-net handles it, in arrival order */
                BpsMessage *keep = msg.moved();
                std::lock_guard<std::mutex> lock(mu_);
                strays_in_.push_back(std::make_pair(server, keep));
                *strays = true;
                continue;
            }
            servers_.count_received(server, msg.size(0) + (msg.count > 1 ? msg.size(1) : 0));
            uint64_t t_reply = bps_span_start(); /* PUSH ends where PULL starts */
            bps_span_to(BPS_STAGE_PUSH, p.trace_t, t_reply, p.key, rnd, p.length, server, op->priority);
            step(op, 0); /* PULL */
            take_reply(op, p, server, h, &msg);
            bps_span(BPS_STAGE_PULL, t_reply, p.key, rnd, p.length, server, op->priority);
            step(op, 0); /* done */
            return true;
        }
        if (l->dead()) return false; /* byteps-net adopts it; the scheduler reports the lost server */
        if (!wait_link(l, deadline, spin_until)) return false;
    }
}

/* Partitions direct callers handed over (their replies may be next on the link), and messages
 * they read for others. Called before any link is read, and again for a reply nobody expects. */
inline void BpsWorkerCore::take_direct() {
    std::vector<BpsQueued> adopt, local_adopt;
    std::vector<std::pair<int, BpsMessage *>> strays;
    std::vector<BpsMessage *> local_strays;
    std::vector<std::pair<BpsOp *, std::vector<std::vector<std::string>>>> owner_adopt;
    bool abort;
    {
        std::lock_guard<std::mutex> lock(mu_);
        adopt.swap(adopt_in_);
        strays.swap(strays_in_);
        local_adopt.swap(local_adopt_in_);
        local_strays.swap(local_strays_in_);
        owner_adopt.swap(owner_adopt_in_);
        abort = abort_;
    }
    for (auto &a : owner_adopt) { /* LOCAL_REDUCE here, with the copies its caller took */
        BpsOp *op = a.first;
        if (abort) {
            fail(op, BPS_ERR_ABORT, "");
            continue;
        }
        Ident id(op->parts[0].key, op->parts[0].rnd);
        Group &g = groups_[id];
        g.op = op;
        g.part = 0;
        for (auto &frames : a.second) add_copy(g, frames[1], frames[2]);
        take_early(g, id);
        maybe_reduce(id);
    }
    for (auto &a : local_adopt) { /* its LOCAL_READY is out: wait for the owner's LOCAL_DONE here */
        BpsPart &p = a.op->parts[(size_t)a.part];
        Ident id(p.key, a.seq);
        awaiting_[id] = Await{a.op, a.part, p.owner};
        a.op->owed_local[p.owner]++;
        if (abort) {
            fail(a.op, BPS_ERR_ABORT, "");
            continue;
        }
        auto e = early_done_.find(id);
        if (e != early_done_.end()) { /* byteps-net read it while the caller held it */
            BpsMessage *m = e->second;
            early_done_.erase(e);
            on_local(m);
            delete m;
        }
    }
    for (BpsMessage *m : local_strays) {
        on_local(m);
        delete m;
    }
    for (auto &a : adopt) { /* its PUSH is out: wait for the reply here */
        BpsPart &p = a.op->parts[(size_t)a.part];
        if (servers_.dead(p.server) && !abort) { /* elastic: its server went while the caller waited */
            a.seq = p.qseq = seq_++;
            if (elastic_.awaiting_commit()) elastic_.strand(a);
            else push(a.op, a.part); /* to the replacement, in its round, past the credit (see commit) */
            continue;
        }
        pending_[std::make_pair(p.key, a.seq)] = std::make_pair(a.op, a.part);
        a.op->owed[p.server]++;
        sendq_.take(a.op, a.part);
        if (abort) fail(a.op, BPS_ERR_ABORT, "");
    }
    for (auto &m : strays) {
        on_message(m.first, m.second);
        delete m.second;
    }
}

/* A direct local caller holds partition ``id`` (waits for it, or has handed it over unseen). */
inline bool BpsWorkerCore::held_direct(const Ident &id) {
    std::lock_guard<std::mutex> lock(mu_);
    if (local_direct_ids_.count(id)) return true;
    for (auto &a : local_adopt_in_)
        if (Ident(a.op->parts[(size_t)a.part].key, a.seq) == id) return true;
    return false;
}

#endif
