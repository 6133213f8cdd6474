/* The server's constants, and the pieces of the texts it writes: ranks and keys (an ERROR's JSON
 * body: bps_error_json, core/transport/bps_wire.h). */
#ifndef BPS_SERVER_TEXTS_H
#define BPS_SERVER_TEXTS_H

#include <stdint.h>
#include <time.h>

#include <string>
#include <vector>

#include "core/transport/bps_zmq.h"


enum {
    BPS_SERVER_CMD_PROBE = 27,
    BPS_SERVER_CMD_LINK = 28,            /* core/wire.py Cmd.LINK: a direct link's token, and its answer */
    BPS_SERVER_NO_DTYPE = 255,
};
static const uint64_t BPS_MAX_BODY = 1ull << 33;          /* core/wire.py MAX_BODY */
static const uint64_t BPS_MAX_CONTROL_BODY = 16ull << 20; /* core/wire.py MAX_CONTROL_BODY */
static const size_t BPS_COPY_BELOW = 65536;               /* core/transport.py COPY_BELOW */
static const double BPS_STALL_WARNING_S = 60.0;           /* log a round that waited this long for its last pushes */
static const uint64_t BPS_ARENA_BYTES = 64ull << 20;      /* core/shm.py ARENA_BYTES */
static const uint64_t BPS_HUGEPAGE_BYTES = 2ull << 20;
static const size_t BPS_MAX_PARKED = 1 << 16;             /* messages held per identity awaiting Python's AUTH verdict */

static inline double bps_server_now() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* Python's time.monotonic() */
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A frame handed to Python (summation/_server_core.pyx wraps it without a copy). */
static inline void *bps_frame_data(bps_zmq_msg *m) { return bps_zmq.msg_data(m); }
static inline size_t bps_frame_size(bps_zmq_msg *m) { return bps_zmq.msg_size(m); }
static inline void bps_frame_close(bps_zmq_msg *m) { bps_zmq.msg_close(m); }


/* A rank as the server's texts name it: the rank from the address book, or "node <id>" for a
 * sender the book does not know (encoded as -(id + 1)). */
static inline std::string bps_rank_str(int64_t rank) {
    return rank >= 0 ? std::to_string(rank) : "node " + std::to_string(-(rank + 1));
}

/* repr() of a list of such ranks, as in the stall warning: [0, 'node 5'] */
static inline std::string bps_rank_list(const std::vector<int64_t> &ranks) {
    std::string s = "[";
    for (size_t i = 0; i < ranks.size(); ++i) {
        if (i) s += ", ";
        s += ranks[i] >= 0 ? bps_rank_str(ranks[i]) : "'" + bps_rank_str(ranks[i]) + "'";
    }
    return s + "]";
}

/* f"key {wire.split_key(key)}" */
static inline std::string bps_key_name(uint64_t key) {
    return "key (" + std::to_string(key >> 32) + ", " + std::to_string(key & 0xFFFFFFFFull) + ")";
}

#endif
