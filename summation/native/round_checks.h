/* The checks every round policy makes of a push before it takes the body (users and tests read
 * their texts: each names the key, the ranks and what differs). */
#ifndef BPS_SERVER_ROUND_CHECKS_H
#define BPS_SERVER_ROUND_CHECKS_H

#include <algorithm>
#include <string>

#include "core/kernels/bps_reduce.h"
#include "core/transport/bps_wire.h"
#include "summation/native/replies.h"
#include "summation/native/round.h"
#include "summation/native/server_texts.h"

/* Before any state exists for the key: an unknown dtype code must not become the key's dtype, and a
 * length that is not whole elements must not reach the sum kernels. "" or the error text. */
static inline std::string bps_elements_problem(const BpsHeader &h, int64_t rank) {
    int isz = bps_itemsize(h.dtype);
    if (isz >= 0 && h.length % (uint64_t)isz == 0) return "";
    return bps_key_name(h.key) + ": rank " + bps_rank_str(rank) + " sent " + std::to_string(h.length) +
           " bytes of dtype code " + std::to_string(h.dtype) + ": not whole elements of a known dtype";
}

/* Why this push cannot join the round, or "". */
static inline std::string bps_round_problem(const BpsRound &st, const BpsHeader &h, int64_t rank) {
    std::string name = bps_key_name(h.key), who = bps_rank_str(rank);
    if (h.round != st.round) {
        return name + ": rank " + who + " sent round " + std::to_string(h.round) + " while the server is at round " +
               std::to_string(st.round);
    }
    if (std::find(st.senders.begin(), st.senders.end(), rank) != st.senders.end()) {
        return name + ": rank " + who + " sent round " + std::to_string(h.round) + " twice";
    }
    if (h.cmd == BPS_CMD_BROADCAST) {
        if (st.has_root && h.arg != st.root) {
            return name + ": broadcast root differs across workers: rank " + bps_rank_str(st.first_rank) +
                   " names root " + std::to_string(st.root) + ", rank " + who + " names root " +
                   std::to_string(h.arg);
        }
        if (!bps_is_rank(rank, h.arg) && h.length != 0) {
            return name + ": non-root rank " + who + " sent " + std::to_string(h.length) + " bytes with a broadcast";
        }
        return "";
    }
    std::string first_who;
    std::string first_len;
    uint8_t first_dtype;
    bool same;
    if (st.has_first) {
        first_who = bps_rank_str(st.first_rank);
        first_len = std::to_string(st.first_nbytes);
        first_dtype = st.first_dtype;
        same = h.length == st.first_nbytes && h.dtype == st.first_dtype;
    } else {
        first_who = "in round " + std::to_string((int64_t)st.round - 1) + ", every rank";
        first_len = st.nbytes < 0 ? "None" : std::to_string(st.nbytes);
        first_dtype = st.dtype;
        same = st.nbytes >= 0 && h.length == (uint64_t)st.nbytes && h.dtype == st.dtype;
    }
    if (!same) {
        return name + ": rank " + who + " pushed " + std::to_string(h.length) + " bytes of " +
               bps_dtype_name(h.dtype) + " but rank " + first_who + " pushed " + first_len + " bytes of " +
               bps_dtype_name(first_dtype);
    }
    return "";
}

#endif
