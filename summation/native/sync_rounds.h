/* The synchronous round policy: a plain push of a partition, followed in one place.
 *
 *     on_push()    a push's checks (round_checks.h), then into the round
 *     -> accept()  the body: ZeroMQ's buffer (TCP) or a colocated worker's shared region (FLAG_SHM);
 *                  a compressed one (FLAG_COMPRESSED) is decoded into the store (compressed_rounds.h)
 *     -> add()     first push held as it arrived, second: store = first + second (bps_sum_many),
 *                  later ones: store += push (bps_sum_into); inline, or on a sum thread (key % N)
 *     abandon()    a rank refused the round's call (FLAG_ABANDON): it fails with the reason
 *     -> complete() every pusher of the round is in and its sums are done: REPLY to each waiter,
 *                  zero-copy from the store, a descriptor of the store (colocated), the pusher's
 *                  own region (one pushing machine), an empty body (broadcast root), the sum
 *                  re-encoded once (waiters that pushed compressed); or the round's ERROR to every waiter
 *
 * With BYTEPS_ELASTIC, rounds of keys taken over from a lost server go through BpsElasticRounds. */
#ifndef BPS_SERVER_SYNC_ROUNDS_H
#define BPS_SERVER_SYNC_ROUNDS_H

#include <stdio.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "core/kernels/bps_reduce.h"
#include "core/pipeline/bps_trace.h"
#include "summation/native/compressed_rounds.h"
#include "summation/native/elastic_rounds.h"
#include "summation/native/replies.h"
#include "summation/native/round.h"
#include "summation/native/round_checks.h"

class BpsSyncRounds {
  public:
    BpsSyncRounds(BpsRounds &rounds, const BpsBook &book, BpsServerReplies &replies, BpsServerLog log)
        : rounds_(rounds), book_(book), replies_(replies), log_(std::move(log)) {}

    /* BYTEPS_ELASTIC: keys taken over from a lost server (NULL: none). */
    void set_elastic(BpsElasticRounds *elastic) { elastic_ = elastic; }

    uint64_t pushes() const { return pushes_.load(); }
    uint64_t completed() const { return completed_.load(); }

    void on_push(const std::string &ident, const BpsHeader &h, BpsMessage *m) {
        pushes_.fetch_add(1);
        serve(ident, h, m);
    }

    void take_sums() {
        if (!rounds_.pool()) return;
        std::vector<uint64_t> done;
        rounds_.pool()->done(&done);
        for (uint64_t key : done) {
            BpsRound *found = rounds_.find(key);
            if (found == nullptr) continue;
            BpsRound &st = *found;
            st.pending--;
            if (st.pending == 0 && st.has_ready) {
                st.has_ready = false;
                BpsHeader h = st.ready;
                complete(st, h);
            }
        }
    }

    /* The book's ranks in join() and machines still pushing changed (set_join(), not done). */
    void on_join() {
        for (auto &kv : rounds_.keys()) { /* rounds that were waiting only for a rank that just joined */
            BpsRound &st = *kv.second;
            if (!st.has_header || st.senders.empty()) continue;
            BpsHeader h = st.header;
            if (book_.set_members(h.key) >= 0) continue; /* join() is the whole job's, not a set's */
            if (h.cmd == BPS_CMD_BROADCAST) { /* pushed before this JOIN: the joined rank never sends its part */
                if (st.error.empty()) st.error = joined_broadcast_error();
                maybe_complete(st, h);
            } else if (h.cmd == BPS_CMD_PUSHPULL && (int64_t)st.senders.size() >= book_.active_pushers) {
                maybe_complete(st, h);
            }
        }
    }

    void warn_stalls(double now) {
        char secs[32];
        for (auto &kv : rounds_.keys()) {
            BpsRound &st = *kv.second;
            if (!st.senders.empty() && !st.warned && now - st.since > BPS_STALL_WARNING_S) {
                snprintf(secs, sizeof secs, "%.0f", now - st.since);
                log_(bps_key_name(kv.first) + " round " + std::to_string(st.round) +
                     " has waited " + secs + " s: pushes from ranks " + bps_rank_list(st.senders) + " are in, " +
                     std::to_string(st.has_header ? book_.expected(st.header) : book_.pushers) + " expected");
                st.warned = true;
            }
        }
    }

  private:
    /* A push, from its checks into its round (on_push, or complete() for one held: hold_early). */
    void serve(const std::string &ident, const BpsHeader &h, BpsMessage *m) {
        uint64_t t_recv = bps_span_start();
        int64_t rank = book_.rank_of(h.sender);
        if (h.flags & BPS_FLAG_ABANDON) {
            abandon(ident, h, m, rank);
            return;
        }
        std::string bad = bps_elements_problem(h, rank);
        if (!bad.empty()) {
            replies_.reply_error(ident, h, bad);
            return;
        }
        if (!book_.joined.empty() && h.cmd == BPS_CMD_BROADCAST && book_.set_members(h.key) < 0) { /* as in Horovod: not while ranks have joined */
            replies_.reply_error(ident, h, joined_broadcast_error());
            return;
        }
        BpsRound *found = rounds_.find(h.key);
        /* elastic servers: a key this server takes over from a lost one starts at the round it is in */
        BpsRound &st = found != nullptr ? *found
                                        : rounds_.create(h.key, elastic_ != nullptr ? h.round : 0,
                                                         h.cmd != BPS_CMD_BROADCAST ? (int64_t)h.length : -1, h.dtype);
        if (st.nbytes < 0 && h.cmd == BPS_CMD_PUSHPULL) { /* a key an abandoned round created (abandon()) */
            st.nbytes = (int64_t)h.length;
            st.dtype = h.dtype;
        }
        if (elastic_ != nullptr && elastic_->is_late(st, h)) {
            elastic_->answer_late(st, h, ident); /* a round this server completed, pushed again */
            return;
        }
        if (hold_early(st, ident, h, rank, m)) return;
        if (st.senders.empty()) st.since = bps_server_now();
        std::string problem = st.error.empty() ? bps_round_problem(st, h, rank) : st.error;
        if (problem.empty()) problem = accept(st, h, rank, ident, m);
        if (!problem.empty() && st.error.empty()) st.error = problem;
        st.senders.push_back(rank);
        st.waiters.push_back(BpsRound::Waiter{ident, (h.flags & BPS_FLAG_SHM) != 0});
        st.has_header = true;
        st.header = h;
        bps_span(BPS_STAGE_RECV, t_recv, h.key, h.round, h.length, -1, 0, (int32_t)rank);
        if ((int64_t)st.senders.size() >= book_.expected(h)) maybe_complete(st, h);
    }

    /* A push of round r + 1 from a rank already in round r (which it abandoned, and went on): held until
     * round r completes (complete() serves it then). True if held. */
    bool hold_early(BpsRound &st, const std::string &ident, const BpsHeader &h, int64_t rank, BpsMessage *m) {
        if (h.round != st.round + 1 || std::find(st.senders.begin(), st.senders.end(), rank) == st.senders.end())
            return false;
        st.early.push_back(std::make_pair(ident, m->moved()));
        return true;
    }

    /* A rank refused the call of this round (FLAG_ABANDON, its reason in the body): it counts as that
     * rank's push, and the round fails with the reason, so every pusher of it gets the ERROR as soon as
     * the round's pushes are in, and the key's next round is a normal one. */
    void abandon(const std::string &ident, const BpsHeader &h, BpsMessage *m, int64_t rank) {
        BpsRound *found = rounds_.find(h.key);
        BpsRound &st = found != nullptr ? *found
                                        : rounds_.create(h.key, elastic_ != nullptr ? h.round : 0, -1, h.dtype);
        if (hold_early(st, ident, h, rank, m)) return;
        std::string name = bps_key_name(h.key), who = bps_rank_str(rank);
        if (h.round != st.round || std::find(st.senders.begin(), st.senders.end(), rank) != st.senders.end()) {
            replies_.reply_error(ident, h, name + ": rank " + who + " abandoned round " + std::to_string(h.round) +
                                               " while the server is at round " + std::to_string(st.round));
            return;
        }
        if (st.senders.empty()) st.since = bps_server_now();
        if (st.error.empty()) st.error = name + " round " + std::to_string(h.round) + ": " +
                                         std::string((const char *)m->data(2), m->size(2));
        st.senders.push_back(rank);
        st.waiters.push_back(BpsRound::Waiter{ident, false});
        if (!st.has_header) { /* the round's completion reads its command (a data push's, if any) */
            st.has_header = true;
            st.header = h;
        }
        if ((int64_t)st.senders.size() >= book_.expected(h)) maybe_complete(st, h);
    }

    /* Take the body into the round; "" or why it cannot be. */
    std::string accept(BpsRound &st, const BpsHeader &h, int64_t rank, const std::string &ident, BpsMessage *m) {
        if (!st.has_first) {
            st.has_first = true;
            st.first_rank = rank;
            st.first_nbytes = h.length;
            st.first_dtype = h.dtype;
        }
        if (h.cmd == BPS_CMD_BROADCAST) {
            st.has_root = true;
            st.root = h.arg;
            if (!bps_is_rank(rank, h.arg)) return ""; /* a non-root rank's (empty) body is not needed */
            st.has_root_ident = true;
            st.root_ident = ident;
            if (st.nbytes != (int64_t)h.length || st.dtype != h.dtype) { /* new stores at first use */
                st.nbytes = (int64_t)h.length;
                st.dtype = h.dtype;
                st.allocated = false;
            }
        }
        if ((h.flags & BPS_FLAG_COMPRESSED) || (h.cmd == BPS_CMD_PUSHPULL && !(h.flags & BPS_FLAG_SHM))) {
            std::string problem = accept_network(st, h, rank, ident, m);
            if (!problem.empty() || (h.flags & BPS_FLAG_COMPRESSED)) return problem;
        }
        uint64_t got;
        if (h.flags & BPS_FLAG_SHM) {
            unsigned char *src;
            uint64_t len;
            std::string err;
            if (rounds_.maps().view(m->data(2), m->size(2), &src, &len, &err) != 0) {
                return bps_key_name(h.key) + ": rank " + bps_rank_str(rank) + "'s shared memory: " + err;
            }
            got = len;
            if (got == h.length && h.cmd == BPS_CMD_PUSHPULL && book_.expected(h) == 1) {
                st.has_echo = true; /* one machine: answer with its own region, no copy */
                st.echo.assign((const char *)m->data(2), m->size(2));
            } else if (got == h.length && h.cmd == BPS_CMD_BROADCAST) {
                if (rounds_.ensure_stores(st)) bps_copy(st.store().data, src, got, rounds_.kernel_threads());
            } else if (got == h.length) {
                add(st, src, nullptr, h.dtype);
            }
        } else {
            got = m->size(2);
            if (got == h.length && h.cmd == BPS_CMD_BROADCAST) { /* stores only for a body of the announced size */
                if (rounds_.ensure_stores(st)) bps_copy(st.store().data, m->data(2), got, rounds_.kernel_threads());
            } else if (got == h.length) {
                add(st, m->data(2), m, h.dtype);
            }
        }
        if (got != h.length) {
            return bps_key_name(h.key) + ": rank " + bps_rank_str(rank) + "'s header says " + std::to_string(h.length) +
                   " bytes but " + std::to_string(got) + " arrived";
        }
        return "";
    }

    /* A push that crossed the network: compressed alike with the round's others, and a compressed
     * body decoded into the store (BpsCompressedRounds); "" or why it cannot join the round. */
    std::string accept_network(BpsRound &st, const BpsHeader &h, int64_t rank, const std::string &ident,
                               BpsMessage *m) {
        BpsCodecInfo info;
        bool compressed = (h.flags & BPS_FLAG_COMPRESSED) != 0;
        if (compressed) {
            std::string problem = BpsCompressedRounds::parse(h, rank, m->data(2), m->size(2), &info);
            if (!problem.empty()) return problem;
        }
        std::string problem = BpsCompressedRounds::check(st, h, rank, compressed ? &info : nullptr);
        if (!problem.empty() || !compressed) return problem;
        if (rounds_.pool() && st.pending) { /* rare (shared-memory pushes mixed in): their sums first */
            rounds_.pool()->wait_idle();
            take_sums();
        }
        if (!rounds_.ensure_stores(st)) return "";
        bool first = st.senders.empty() && !st.has_held;
        if (st.has_held) { /* a plain first push held as it arrived: the decoded one adds to it */
            bps_copy(st.store().data, st.held_data(), (size_t)st.nbytes, rounds_.kernel_threads());
            st.drop_held();
        }
        char err[BPS_CZ_ERRLEN];
        if (bps_cz_decode(&info, st.store().data, !first, err) != 0) {
            return bps_key_name(h.key) + ": rank " + bps_rank_str(rank) + "'s compressed push: " + err;
        }
        st.compressed.push_back(ident);
        return "";
    }

    /* Fold one push into the round. The first is only held (its shared region or ZeroMQ buffer stays
     * valid until the round's replies); the second makes store = first + second in one pass (3 buffers
     * of memory traffic instead of a copy then a sum, 5); later ones add in place. ``m``: the message
     * whose body frame (2) is ``data`` (TCP), or NULL for a shared region. */
    void add(BpsRound &st, const unsigned char *data, BpsMessage *m, uint8_t dtype) {
        if (st.senders.empty() && !st.has_held) {
            st.has_held = true;
            st.held_is_msg = m != nullptr;
            if (m != nullptr) {
                m->take(2, &st.held_msg);
            } else {
                st.held_ptr = data;
            }
            return;
        }
        if (!rounds_.ensure_stores(st)) return;
        BpsSumTask *t = new BpsSumTask();
        t->key = st.key;
        t->round = st.round;
        t->dst = st.store().data;
        t->count = (size_t)st.nbytes / (size_t)bps_itemsize(dtype);
        t->dtype = dtype;
        /* A buffer the task keeps is read where it now lives: ZeroMQ keeps bodies of up to 33 bytes
         * inside the message struct itself, so moving a message moves its data. */
        if (st.has_held) {
            t->nsrc = 2;
            if (st.held_is_msg) { /* the task closes the held buffer once summed */
                bps_zmq.msg_init(&t->keep[0]);
                bps_zmq.msg_move(&t->keep[0], &st.held_msg);
                t->srcs[0] = bps_zmq.msg_data(&t->keep[0]);
                t->nkeep = 1;
            } else {
                t->srcs[0] = st.held_ptr;
            }
            st.has_held = st.held_is_msg = false;
            st.held_ptr = nullptr;
        } else {
            t->nsrc = 1;
        }
        const void **src = &t->srcs[t->nsrc - 1];
        *src = data;
        if (!rounds_.pool()) {
            t->run(rounds_.kernel_threads());
            delete t; /* ``m`` still owns its body: closed with the message */
            return;
        }
        if (m != nullptr) { /* the body lives as long as its sum */
            m->take(2, &t->keep[t->nkeep]);
            *src = bps_zmq.msg_data(&t->keep[t->nkeep++]);
        }
        st.pending++;
        rounds_.pool()->submit(t);
    }

    void maybe_complete(BpsRound &st, const BpsHeader &h) {
        if (st.pending) {
            st.has_ready = true; /* take_sums() completes it */
            st.ready = h;
            return;
        }
        complete(st, h);
    }

    /* Every pusher of the round is in and summed: answer them all (summation/server.py's _complete). */
    void complete(BpsRound &st, const BpsHeader &h) {
        uint64_t t_reply = bps_span_start();
        bps_span(BPS_STAGE_ROUND, (uint64_t)(st.since * 1e9), h.key, st.round, h.length, -1);
        if (st.error.empty() && h.cmd == BPS_CMD_BROADCAST && !st.has_root_ident) {
            st.error = bps_key_name(h.key) + ": broadcast root rank " + std::to_string(st.root) + " never sent its data";
        }
        if (st.error.empty() && st.has_held) { /* a lone push: the sum is that push */
            if (rounds_.ensure_stores(st)) bps_copy(st.store().data, st.held_data(), (size_t)st.nbytes, rounds_.kernel_threads());
        }
        st.drop_held();
        if (st.error.empty() && !st.has_echo) rounds_.ensure_stores(st); /* a reply reads the store */
        if (!st.error.empty()) {
            log_(st.error);
            for (auto &w : st.waiters) replies_.reply_error(w.ident, h, st.error);
        } else {
            BpsStore &store = st.store();
            uint64_t nbytes = (uint64_t)std::max<int64_t>(st.nbytes, 0);
            std::string packed;
            bool compressed = !st.compressed.empty() &&
                              BpsCompressedRounds::reply(st, store.data, nbytes, book_.node_id, &packed);
            for (auto &w : st.waiters) {
                if (h.cmd == BPS_CMD_BROADCAST && st.has_root_ident && w.ident == st.root_ident) {
                    replies_.send_reply(w.ident, h.key, st.round, 0, st.dtype, 0, nullptr, 0, nullptr); /* the root has the data */
                } else if (compressed && std::find(st.compressed.begin(), st.compressed.end(), w.ident) != st.compressed.end()) {
                    replies_.send_reply(w.ident, h.key, st.round, nbytes, st.dtype, BPS_FLAG_COMPRESSED, packed.data(),
                                        packed.size(), nullptr); /* the frame's length stays the dense size */
                } else if (st.has_echo) {
                    replies_.send_reply(w.ident, h.key, st.round, nbytes, st.dtype, BPS_FLAG_SHM, st.echo.data(),
                                        st.echo.size(), nullptr);
                } else if (w.shared && rounds_.alloc().shared() && st.allocated) {
                    /* the worker copies from our store */
                    replies_.send_descriptor(w.ident, h.key, st.round, st.dtype, store, nbytes);
                } else {
                    replies_.send_reply(w.ident, h.key, st.round, nbytes, st.dtype, 0, store.data, nbytes, store.arena);
                }
            }
        }
        bps_span(BPS_STAGE_REPLY, t_reply, h.key, st.round, h.length, -1, 0, (int32_t)st.waiters.size());
        completed_.fetch_add(1);
        st.has_done = st.error.empty();
        st.done_round = st.round;
        st.round++;
        st.reset();
        std::vector<std::pair<std::string, BpsMessage *>> early;
        early.swap(st.early);
        for (auto &e : early) { /* the next round's pushes that came before this one completed */
            BpsHeader next;
            bps_parse_header(e.second->data(1), e.second->size(1), &next);
            serve(e.first, next, e.second);
            delete e.second;
        }
    }

    std::string joined_broadcast_error() const { /* summation/server.py's _joined_broadcast_error */
        std::string list = "[";
        for (size_t i = 0; i < book_.joined.size(); ++i) list += (i ? ", " : "") + std::to_string(book_.joined[i]);
        return "broadcast is not supported while ranks " + list +
               "] have joined (join()); it works again once every rank has joined";
    }

    BpsRounds &rounds_;
    const BpsBook &book_;
    BpsServerReplies &replies_;
    BpsServerLog log_;
    BpsElasticRounds *elastic_ = nullptr;
    std::atomic<uint64_t> pushes_{0}, completed_{0};
};

#endif
