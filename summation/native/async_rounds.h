/* The asynchronous round policy (BYTEPS_ENABLE_ASYNC, docs/async.md): a key's store holds the
 * parameters, not a round's sum.
 *
 *     round 0      every worker sends its parameters; the store takes rank 0's (never zeros: the
 *                  defect of BytePS's async mode), the others' are only checked; once all are in,
 *                  each gets the parameters back
 *     round >= 1   each push is a delta, added to the store and answered at once with a snapshot,
 *                  with no barrier between workers
 *
 * Replies are copies: the store changes with the next delta, so a zero-copy or shared-memory reply
 * could be read half-updated. */
#ifndef BPS_SERVER_ASYNC_ROUNDS_H
#define BPS_SERVER_ASYNC_ROUNDS_H

#include <algorithm>
#include <atomic>
#include <string>

#include "core/kernels/bps_reduce.h"
#include "core/pipeline/bps_trace.h"
#include "summation/native/replies.h"
#include "summation/native/round.h"
#include "summation/native/round_checks.h"

class BpsAsyncRounds {
  public:
    BpsAsyncRounds(BpsRounds &rounds, const BpsBook &book, BpsServerReplies &replies, BpsServerLog log)
        : rounds_(rounds), book_(book), replies_(replies), log_(std::move(log)) {}

    uint64_t pushes() const { return pushes_.load(); }

    void on_push(const std::string &ident, const BpsHeader &h, BpsMessage *m) {
        uint64_t t_recv = bps_span_start();
        pushes_.fetch_add(1);
        int64_t rank = book_.rank_of(h.sender);
        std::string bad = bps_elements_problem(h, rank);
        if (!bad.empty()) {
            replies_.reply_error(ident, h, bad);
            return;
        }
        BpsRound *found = rounds_.find(h.key);
        BpsRound &st = found != nullptr ? *found : rounds_.create(h.key, 0, (int64_t)h.length, h.dtype);
        if (st.round == 0) {
            initial(st, h, rank, ident, m);
        } else {
            delta(st, h, rank, ident, m);
        }
        bps_span(BPS_STAGE_RECV, t_recv, h.key, h.round, h.length, -1, 0, (int32_t)rank);
    }

  private:
    void initial(BpsRound &st, const BpsHeader &h, int64_t rank, const std::string &ident, BpsMessage *m) {
        if (st.senders.empty()) st.since = bps_server_now();
        std::string problem = st.error.empty() ? bps_round_problem(st, h, rank) : st.error;
        if (problem.empty()) problem = take(st, h, rank, m, true);
        if (!problem.empty() && st.error.empty()) st.error = problem;
        st.senders.push_back(rank);
        st.waiters.push_back(BpsRound::Waiter{ident, false});
        if ((int64_t)st.senders.size() < book_.num_workers) return;
        if (st.error.empty() && std::find(st.senders.begin(), st.senders.end(), 0) == st.senders.end())
            st.error = bps_key_name(h.key) + ": rank 0 never sent the initial parameters";
        if (!st.error.empty()) {
            log_(st.error);
            for (const BpsRound::Waiter &w : st.waiters) replies_.reply_error(w.ident, h, st.error);
            st.reset(); /* a failed initialisation may be retried */
            return;
        }
        for (const BpsRound::Waiter &w : st.waiters) reply(w.ident, h, st);
        st.round = 1;
        st.reset();
    }

    void delta(BpsRound &st, const BpsHeader &h, int64_t rank, const std::string &ident, BpsMessage *m) {
        std::string problem;
        if (h.round == 0) {
            problem = bps_key_name(h.key) + ": rank " + bps_rank_str(rank) + " sent its initial parameters twice";
        } else if ((int64_t)h.length != st.nbytes || h.dtype != st.dtype) {
            problem = bps_key_name(h.key) + ": rank " + bps_rank_str(rank) + " pushed a delta of " +
                      std::to_string(h.length) + " bytes of " + bps_dtype_name(h.dtype) + " but the parameters are " +
                      std::to_string(st.nbytes) + " bytes of " + bps_dtype_name(st.dtype);
        } else {
            problem = take(st, h, rank, m, false);
        }
        if (!problem.empty()) {
            log_(problem);
            replies_.reply_error(ident, h, problem);
            return;
        }
        reply(ident, h, st);
    }

    /* One message's body: rank 0's initial parameters are copied into the store, other ranks' only
     * checked; a delta is added to the store. "" or the error text. */
    std::string take(BpsRound &st, const BpsHeader &h, int64_t rank, BpsMessage *m, bool initial) {
        if (initial && !st.has_first) {
            st.has_first = true;
            st.first_rank = rank;
            st.first_nbytes = h.length;
            st.first_dtype = h.dtype;
        }
        const unsigned char *src = m->data(2);
        uint64_t got = m->size(2);
        if (h.flags & BPS_FLAG_SHM) {
            unsigned char *view;
            std::string err;
            if (rounds_.maps().view(m->data(2), m->size(2), &view, &got, &err) != 0)
                return bps_key_name(h.key) + ": rank " + bps_rank_str(rank) + "'s shared memory: " + err;
            src = view;
        }
        if (got != h.length) {
            return bps_key_name(h.key) + ": rank " + bps_rank_str(rank) + "'s header says " +
                   std::to_string(h.length) + " bytes but " + std::to_string(got) + " arrived";
        }
        if (!rounds_.ensure_stores(st)) return st.error; /* allocated only once a body of that size arrived */
        BpsStore &store = st.stores[0];
        if (initial) {
            if (rank == 0) bps_copy(store.data, src, got, rounds_.kernel_threads());
        } else {
            bps_sum_into(store.data, src, got / (uint64_t)bps_itemsize(h.dtype), h.dtype, rounds_.kernel_threads());
        }
        return "";
    }

    void reply(const std::string &ident, const BpsHeader &h, BpsRound &st) {
        uint64_t n = (uint64_t)st.nbytes;
        replies_.send_reply(ident, h.key, h.round, n, st.dtype, 0, st.stores[0].data, n, nullptr); /* a copy */
    }

    BpsRounds &rounds_;
    const BpsBook &book_;
    BpsServerReplies &replies_;
    BpsServerLog log_;
    std::atomic<uint64_t> pushes_{0};
};

#endif
