/* A key's round and BpsRounds, the store every key's rounds live in:
 * the keys, the arenas their sums go to, the sum threads and the views of colocated workers' regions. */
#ifndef BPS_SERVER_ROUND_H
#define BPS_SERVER_ROUND_H

#include <algorithm>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/kernels/bps_codecs.h"
#include "core/transport/bps_wire.h"
#include "core/transport/bps_zmq.h"
#include "summation/native/server_texts.h"
#include "summation/native/store.h"
#include "summation/native/sum_pool.h"

/* One key: the current round's arrivals and its two stores. */
struct BpsRound {
    uint64_t key = 0;
    uint64_t round = 0;
    int64_t nbytes = -1; /* -1: not known yet (a broadcast's size comes from its root) */
    uint8_t dtype = 0;
    BpsStore stores[2];
    bool allocated = false;

    /* this round */
    std::vector<int64_t> senders; /* ranks in arrival order */
    struct Waiter {
        std::string ident;
        bool shared;
    };
    std::vector<Waiter> waiters;
    bool has_first = false; /* (rank, nbytes, dtype) of the round's first accepted push */
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
    bool has_echo = false; /* one pushing machine: the reply is its own region */
    std::string echo;
    /* the first push, held as it arrived: a ZeroMQ buffer or a colocated worker's region */
    bool has_held = false;
    bool held_is_msg = false;
    bps_zmq_msg held_msg;
    const unsigned char *held_ptr = nullptr;
    bool has_header = false; /* the round's last header (completes it when a rank joins) */
    BpsHeader header;
    bool has_codec = false;  /* the first network push: its rank and compression (compressed_rounds.h) */
    int64_t codec_rank = 0;
    bool codec_compressed = false;
    BpsCodecInfo codec_info = {};
    std::vector<std::string> compressed; /* waiters that pushed compressed: answered compressed */
    std::vector<unsigned char> residual; /* error feedback of the compressed replies, across rounds */
    bool has_residual = false;
    int pending = 0;         /* sums still running on a sum thread */
    bool has_ready = false;  /* all messages in, waiting for its sums: complete with this header */
    BpsHeader ready;
    bool has_done = false;   /* elastic: round done_round completed here; its store holds the result */
    uint64_t done_round = 0;
    /* pushes of the next round from ranks already in this one (a rank that abandoned this round moves on
     * at once): held, with their identities, until this round completes */
    std::vector<std::pair<std::string, BpsMessage *>> early;

    const void *held_data() { return held_is_msg ? bps_zmq.msg_data(&held_msg) : held_ptr; }

    void drop_held() {
        if (has_held && held_is_msg) bps_zmq.msg_close(&held_msg);
        has_held = held_is_msg = false;
        held_ptr = nullptr;
    }

    void reset() {
        senders.clear();
        waiters.clear();
        has_first = false;
        since = 0;
        error.clear();
        has_root = has_root_ident = false;
        root_ident.clear();
        warned = false;
        has_echo = false;
        echo.clear();
        drop_held();
        has_header = false;
        has_codec = codec_compressed = false;
        compressed.clear();
        has_ready = false;
    }

    ~BpsRound() {
        drop_held();
        for (auto &e : early) delete e.second;
    }

    BpsStore &store() { return stores[round & 1]; }
};
/* The store of rounds. Serve-thread state only; the sum threads touch a round's store through the
 * BpsSumTasks they were given, never the map. */
class BpsRounds {
  public:
    BpsRounds(bool shared_stores, int sum_threads, int kernel_threads)
        : alloc_(shared_stores), sum_threads_(sum_threads), kernel_threads_(kernel_threads) {}

    /* start(): sum threads that wake the serve thread through ``wake_fd`` when a sum is done */
    void start_sums(int wake_fd) {
        if (sum_threads_ > 0) pool_.reset(new BpsSumPool(sum_threads_, kernel_threads_, wake_fd));
    }

    /* The sums first (they read peers' regions and write stores), then the keys; the arenas last. */
    void clear() {
        pool_.reset();
        keys_.clear();
    }

    BpsStoreAllocator &alloc() { return alloc_; }
    BpsSumPool *pool() { return pool_.get(); }
    BpsPeerMaps &maps() { return maps_; }
    int kernel_threads() const { return kernel_threads_; }
    std::unordered_map<uint64_t, std::unique_ptr<BpsRound>> &keys() { return keys_; }

    BpsRound *find(uint64_t key) {
        auto it = keys_.find(key);
        return it != keys_.end() ? it->second.get() : nullptr;
    }

    /* A key's first round: ``nbytes`` -1 until known (a broadcast's size comes from its root). */
    BpsRound &create(uint64_t key, uint64_t round, int64_t nbytes, uint8_t dtype) {
        std::unique_ptr<BpsRound> fresh(new BpsRound());
        fresh->key = key;
        fresh->round = round;
        fresh->nbytes = nbytes;
        fresh->dtype = dtype;
        return *keys_.emplace(key, std::move(fresh)).first->second;
    }

    bool ensure_stores(BpsRound &st) {
        if (st.allocated) return true;
        std::string err;
        for (int i = 0; i < 2; ++i) {
            if (!alloc_.alloc((uint64_t)std::max<int64_t>(st.nbytes, 0), &st.stores[i], &err)) {
                if (st.error.empty()) st.error = bps_key_name(st.key) + ": " + err;
                return false;
            }
        }
        st.allocated = true;
        return true;
    }

    /* LEAVE, or everyone joined: every key restarts at round 0; stores and peers' mappings are dropped. */
    void reset() {
        if (pool_) {
            pool_->wait_idle(); /* nothing reads a peer's region or writes a store any more */
            std::vector<uint64_t> done;
            pool_->done(&done);
        }
        keys_.clear();
        maps_.close();
        alloc_.reset();
    }

  private:
    BpsStoreAllocator alloc_;
    int sum_threads_;
    int kernel_threads_;
    std::unordered_map<uint64_t, std::unique_ptr<BpsRound>> keys_;
    BpsPeerMaps maps_;
    std::unique_ptr<BpsSumPool> pool_;
};

#endif
