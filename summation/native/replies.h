/* What every round policy answers with: the address book as the serve thread knows it, and the
 * REPLY and ERROR messages, sent through the links (BpsServerLinks::send_to). */
#ifndef BPS_SERVER_REPLIES_H
#define BPS_SERVER_REPLIES_H

#include <unistd.h>

#include <string>
#include <unordered_map>
#include <vector>

#include "core/transport/bps_link.h"
#include "core/transport/bps_wire.h"
#include "summation/native/round.h"
#include "summation/native/server_links.h"
#include "summation/native/server_texts.h"

/* set_book() and set_join(): who pushes, and the ranks error messages name. */
struct BpsBook {
    bool have = false; /* false: no book (before the first, after LEAVE): data goes to Python */
    int64_t num_workers = 0, pushers = 0, active_pushers = 0;
    uint32_t node_id = 0xFFFFFFFFu;
    std::unordered_map<uint32_t, int64_t> ranks;
    std::vector<int64_t> joined; /* ranks in join() */
    std::unordered_map<uint32_t, int64_t> set_pushers; /* a process set's tensor key -> its members */

    /* How many members push ``key``, if it is a process set's (set_pushers()); else -1. */
    int64_t set_members(uint64_t key) const {
        if (set_pushers.empty()) return -1;
        auto it = set_pushers.find((uint32_t)(key >> 32));
        return it != set_pushers.end() ? it->second : -1;
    }

    int64_t rank_of(uint32_t sender) const {
        auto it = ranks.find(sender);
        return it != ranks.end() ? it->second : -(int64_t)sender - 1;
    }

    /* Messages that complete a round: a process set's members; one push_pull per machine still pushing;
     * every rank for a broadcast. A set's rounds never wait for or fail on ranks in join() (the job's). */
    int64_t expected(const BpsHeader &h) const {
        int64_t members = set_members(h.key);
        if (members >= 0) return members;
        if (h.cmd != BPS_CMD_PUSHPULL) return num_workers;
        return joined.empty() ? pushers : active_pushers;
    }
};

static inline bool bps_is_rank(int64_t rank, uint32_t arg) { return rank >= 0 && (uint64_t)rank == arg; }

class BpsServerReplies {
  public:
    BpsServerReplies(BpsServerLinks &links, const BpsBook &book, BpsStoreAllocator &alloc)
        : links_(links), book_(book), alloc_(alloc), pid_(getpid()) {}

    static void store_released(void *, void *hint) { ((BpsArena *)hint)->replies.fetch_sub(1); }

    /* REPLY [header, body]; a body of COPY_BELOW bytes or more is sent zero-copy from ``arena`` (counted
     * until the transport releases it). */
    void send_reply(const std::string &ident, uint64_t key, uint64_t round, uint64_t length, uint8_t dtype,
                    uint8_t flags, const void *body, size_t n, BpsArena *arena) {
        BpsHeader hdr = bps_header(BPS_CMD_REPLY, book_.node_id, key, round, length, dtype, 0, flags);
        BpsFrames f;
        f.copy(&hdr, sizeof hdr);
        if (arena == nullptr || n < BPS_COPY_BELOW) {
            f.copy(body, n);
        } else {
            arena->replies.fetch_add(1);
            f.zero_copy((void *)body, n, &BpsServerReplies::store_released, arena);
        }
        links_.send_to(ident, f);
    }

    /* A reply that a colocated worker copies from the store itself: a descriptor of it. */
    void send_descriptor(const std::string &ident, uint64_t key, uint64_t round, uint8_t dtype, BpsStore &store,
                         uint64_t nbytes) {
        BpsDescriptor d = bps_descriptor(pid_, store.arena->fd, store.arena->inode, store.offset, nbytes);
        send_reply(ident, key, round, nbytes, dtype, BPS_FLAG_SHM, &d, sizeof d, nullptr);
    }

    void reply_error(const std::string &ident, const BpsHeader &h, const std::string &text) {
        std::string body = bps_error_json(text);
        BpsHeader hdr = bps_header(BPS_CMD_ERROR, book_.node_id, h.key, h.round, body.size(), BPS_SERVER_NO_DTYPE, 0, 0);
        BpsFrames f;
        f.copy(&hdr, sizeof hdr);
        f.copy(body.data(), body.size());
        links_.send_to(ident, f);
    }

    /* One reply of a completed round from ``store`` (the round's own by default). */
    void answer(BpsRound &st, const BpsHeader &h, const std::string &ident, bool shared, bool root,
                BpsStore *use = nullptr) {
        BpsStore &store = use != nullptr ? *use : st.store();
        uint64_t nbytes = (uint64_t)st.nbytes;
        if (root) {
            send_reply(ident, h.key, h.round, 0, st.dtype, 0, nullptr, 0, nullptr); /* the root has the data */
        } else if (shared && alloc_.shared()) {
            send_descriptor(ident, h.key, h.round, st.dtype, store, nbytes);
        } else {
            send_reply(ident, h.key, h.round, nbytes, st.dtype, 0, store.data, nbytes, store.arena);
        }
    }

  private:
    BpsServerLinks &links_;
    const BpsBook &book_;
    BpsStoreAllocator &alloc_;
    pid_t pid_;
};

#endif
