/* The hand-over policy: the first message Python must handle for a key (asynchronous, FLAG_PYTHON) makes the key Python's; the state this thread had for it goes along, so Python goes on
 * from the same round, arrivals and partial sum. */
#ifndef BPS_SERVER_HANDOVER_H
#define BPS_SERVER_HANDOVER_H

#include <algorithm>
#include <string>
#include <vector>

#include "summation/native/round.h"

/* A key's state handed to Python with the first message Python must handle for it. */
struct BpsHandover {
    uint64_t key = 0, round = 0;
    int64_t nbytes = -1;
    uint8_t dtype = 0;
    std::vector<int64_t> senders;
    std::vector<std::string> waiter_idents;
    std::vector<int> waiter_shared;
    bool has_first = false;
    int64_t first_rank = 0;
    uint64_t first_nbytes = 0;
    uint8_t first_dtype = 0;
    double since = 0;
    std::string error;
    bool has_root = false;
    uint32_t root = 0;
    bool has_root_ident = false;
    std::string root_ident;
    bool warned = false;
    bool has_header = false;
    std::string header;  /* 40 raw bytes */
    bool has_partial = false; /* the store so far (the held first push folded in) */
    std::string partial;
};
/* The round of ``st`` as a BpsHandover (its sums must be done: pending == 0). */
static inline BpsHandover *bps_handover_of(BpsRound &st) {
    BpsHandover *o = new BpsHandover();
    o->key = st.key;
    o->round = st.round;
    o->nbytes = st.nbytes;
    o->dtype = st.dtype;
    o->senders = st.senders;
    for (auto &w : st.waiters) {
        o->waiter_idents.push_back(w.ident);
        o->waiter_shared.push_back(w.shared);
    }
    o->has_first = st.has_first;
    o->first_rank = st.first_rank;
    o->first_nbytes = st.first_nbytes;
    o->first_dtype = st.first_dtype;
    o->since = st.since;
    o->error = st.error;
    o->has_root = st.has_root;
    o->root = st.root;
    o->has_root_ident = st.has_root_ident;
    o->root_ident = st.root_ident;
    o->warned = st.warned;
    o->has_header = st.has_header;
    if (st.has_header) o->header.assign((const char *)&st.header, sizeof st.header);
    uint64_t nbytes = (uint64_t)std::max<int64_t>(st.nbytes, 0);
    if (st.has_held) {
        o->has_partial = true;
        o->partial.assign((const char *)st.held_data(), nbytes);
    } else if (!st.senders.empty() && st.allocated && st.error.empty()) {
        o->has_partial = true;
        o->partial.assign((const char *)st.store().data, nbytes);
    }
    return o;
}

#endif
