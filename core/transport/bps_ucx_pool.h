/* Reused receive buffers for large frames, and the counts of their explicit registrations.
 * A part of the UCX transport (core/transport/bps_ucx.h), which includes it when BPS_HAVE_UCX is set.
 */
#ifndef BPS_UCX_POOL_H
#define BPS_UCX_POOL_H

#include "core/transport/bps_ucx_api.h"

/* Buffers that large received frames (>= 64 KB) land in, reused across steps so that a UCP worker
 * registers each once (BpsUcxWorker::pool_memh; docs/ucx.md). Process-wide, any thread may give a
 * buffer back (the frame's free function); at most 1 GiB is kept idle. A buffer's generation changes
 * when it is freed, so that a registration of a freed buffer is never used for a new one that malloc
 * put at the same address. */
class BpsUcxRecvPool {
  public:
    static const size_t MIN_BYTES = 64 << 10;

    static BpsUcxRecvPool &get() {
        static BpsUcxRecvPool *pool = new BpsUcxRecvPool(); /* never destroyed: frames may outlive anything */
        return *pool;
    }

    /* A ZeroMQ frame of ``n`` bytes backed by a pooled buffer, its capacity and generation in *cap and
     * *gen; 0, or -1 (out of memory). */
    int frame(bps_zmq_msg *m, size_t n, size_t *cap_out = nullptr, uint64_t *gen_out = nullptr) {
        size_t cap = (n + 4095) & ~(size_t)4095;
        void *p = nullptr;
        uint64_t gen = 0;
        {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = free_.find(cap);
            if (it != free_.end() && !it->second.empty()) {
                p = it->second.back();
                it->second.pop_back();
                idle_ -= cap;
                reused_++;
                gen = gens_[p];
            }
        }
        if (p == nullptr) {
            if (posix_memalign(&p, 4096, cap) != 0) return -1;
            std::lock_guard<std::mutex> lock(mu_);
            gen = gens_[p] = ++next_gen_;
        }
        if (cap_out != nullptr) *cap_out = cap;
        if (gen_out != nullptr) *gen_out = gen;
        return bps_zmq.msg_init_data(m, p, n, give_back, (void *)cap);
    }

    /* The generation of pooled buffer ``p`` now (0: not a pooled buffer, or freed since). */
    uint64_t generation(const void *p) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = gens_.find(const_cast<void *>(p));
        return it == gens_.end() ? 0 : it->second;
    }

    uint64_t reused() {
        std::lock_guard<std::mutex> lock(mu_);
        return reused_;
    }

  private:
    static void give_back(void *data, void *hint) {
        BpsUcxRecvPool &pool = get();
        size_t cap = (size_t)hint;
        {
            std::lock_guard<std::mutex> lock(pool.mu_);
            if (pool.idle_ + cap <= (1ull << 30)) {
                pool.free_[cap].push_back(data);
                pool.idle_ += cap;
                return;
            }
            pool.gens_.erase(data);
        }
        free(data);
    }

    std::mutex mu_;
    std::unordered_map<size_t, std::vector<void *>> free_; /* by capacity (page multiple) */
    std::unordered_map<void *, uint64_t> gens_;            /* every live buffer's generation */
    uint64_t next_gen_ = 0;
    size_t idle_ = 0;
    uint64_t reused_ = 0;
};

/* Explicit registrations (ucp_mem_map) of pooled receive buffers, per UCP worker, process-wide counts:
 * tests and the log check that a buffer is registered once and its handle used on every later step. */
static std::atomic<uint64_t> bps_ucx_mem_mapped{0}, bps_ucx_memh_used{0};

/* This process's explicit registrations: pooled buffers mapped (ucp_mem_map), and transfers that passed
 * a registration instead of leaving it to UCX's cache (tests check that a buffer is mapped once). */
static inline uint64_t bps_ucx_buffers_mapped() { return bps_ucx_mem_mapped.load(); }
static inline uint64_t bps_ucx_registered_transfers() { return bps_ucx_memh_used.load(); }

#endif /* BPS_UCX_POOL_H */
