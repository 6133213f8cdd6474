/* The elastic round policy (BYTEPS_ELASTIC, docs/elastic.md): keys this server takes over from a lost one.
 *
 * A worker that got round ``h.round``'s result from the lost server before it went sends it here
 * (RESULT) before anything else for the key, because other workers may not have got it: they push
 * that round again, and no worker that has the result will push it again. So: a RESULT for the round
 * in progress (or a fresh key) completes it with that result; a push of a round completed here is
 * answered from its store (answer_late); older RESULTs, and duplicates, are dropped. A key's first
 * push sets its round (BpsSyncRounds::on_push). */
#ifndef BPS_SERVER_ELASTIC_ROUNDS_H
#define BPS_SERVER_ELASTIC_ROUNDS_H

#include <string.h>

#include <atomic>
#include <string>

#include "summation/native/replies.h"
#include "summation/native/round.h"

class BpsElasticRounds {
  public:
    BpsElasticRounds(BpsRounds &rounds, const BpsBook &book, BpsServerReplies &replies, BpsServerLog log)
        : rounds_(rounds), book_(book), replies_(replies), log_(std::move(log)) {}

    /* A worker's copy of the lost server's result of round ``h.round`` (body: frame 2). */
    void on_result(const BpsHeader &h, BpsMessage *m) {
        const void *body = m->data(2);
        size_t n = m->size(2);
        BpsRound *found = rounds_.find(h.key);
        BpsRound &st = found != nullptr ? *found : rounds_.create(h.key, h.round, (int64_t)n, h.dtype);
        if (h.round != st.round || st.pending || st.has_ready) return; /* older, a duplicate, or summing */
        if (st.nbytes < 0) st.nbytes = (int64_t)n; /* a broadcast's size */
        if ((uint64_t)st.nbytes != n || !rounds_.ensure_stores(st)) {
            log_(bps_key_name(h.key) + ": a worker's RESULT of round " + std::to_string(h.round) + " has " +
                 std::to_string(n) + " bytes, the key " + std::to_string(st.nbytes) + ": dropped");
            return;
        }
        memcpy(st.store().data, body, n);
        st.drop_held();
        st.error.clear();
        st.has_echo = false;
        if (!st.waiters.empty()) /* the case it exists for: they never got the lost server's reply */
            log_(bps_key_name(h.key) + ": round " + std::to_string(h.round) + " completed with a worker's copy of the "
                 "lost server's result for " + std::to_string(st.waiters.size()) + " waiting workers");
        results_used_.fetch_add(1);
        BpsHeader round_h = st.has_header ? st.header : h; /* the pushes' command (a broadcast's root gets no data) */
        round_h.round = h.round;
        for (auto &w : st.waiters)
            replies_.answer(st, round_h, w.ident, w.shared,
                            round_h.cmd == BPS_CMD_BROADCAST && st.has_root_ident && w.ident == st.root_ident);
        st.has_done = true;
        st.done_round = st.round;
        st.round++;
        st.reset();
    }

    /* A push of the round this server completed last: answered with its result, not summed again. */
    bool is_late(const BpsRound &st, const BpsHeader &h) const {
        return st.has_done && h.round == st.done_round && h.round + 1 == st.round;
    }

    void answer_late(BpsRound &st, const BpsHeader &h, const std::string &ident) {
        if (!st.allocated || st.nbytes < 0 || (h.cmd != BPS_CMD_BROADCAST && h.length != (uint64_t)st.nbytes)) {
            replies_.reply_error(ident, h, bps_key_name(h.key) + ": round " + std::to_string(h.round) +
                                               " pushed again with " + std::to_string(h.length) + " bytes after it completed");
            return;
        }
        log_(bps_key_name(h.key) + ": rank " + bps_rank_str(book_.rank_of(h.sender)) + " pushed round " +
             std::to_string(h.round) + " again after it completed here: answered with its result");
        bool shared = (h.flags & BPS_FLAG_SHM) != 0;
        replies_.answer(st, h, ident, shared, h.cmd == BPS_CMD_BROADCAST && bps_is_rank(book_.rank_of(h.sender), h.arg),
                        &st.stores[h.round & 1]);
    }

  private:
    BpsRounds &rounds_;
    const BpsBook &book_;
    BpsServerReplies &replies_;
    BpsServerLog log_;
    std::atomic<uint64_t> results_used_{0};
};

#endif
