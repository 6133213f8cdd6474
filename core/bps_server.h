/* The Summation Service server's native data plane: receive, check, sum and reply without the GIL.
 *
 * summation/server.py (Python) keeps what is per job or rare: the control plane, the authentication
 * handshake (core/auth.py), PROBE echoes, compressed and asynchronous keys, and malformed messages.
 * After the first address book it hands the data ROUTER socket to BpsServerCore, whose thread
 * "byteps-serve" owns it from then on. A plain push of a partition is followed in one place:
 *
 *     on_message()    whole message [identity, header, body] from the ROUTER; who handles it?
 *       -> on_push()  the checks of the Python server's _on_data/_check (same error texts)
 *       -> accept()   the body: ZeroMQ's buffer (TCP) or a colocated worker's shared region (FLAG_SHM)
 *       -> add()      first push held as it arrived, second: store = first + second (bps_sum_many),
 *                     later ones: store += push (bps_sum_into); inline, or on a sum thread (key % N)
 *       -> complete() every pusher of the round is in and its sums are done: REPLY to each waiter,
 *                     zero-copy from the store, a descriptor of the store (colocated), the pusher's
 *                     own region (one pushing machine), an empty body (broadcast root); or the
 *                     round's ERROR to every waiter
 *
 * Everything else goes to Python unchanged, in arrival order, through forwarded() and a notify
 * eventfd: handshakes, messages of identities not admitted yet (after an AUTH, an identity's later
 * messages wait here until Python says whether it passed: admit()), PROBE, ASYNC_PUSHPULL, pushes
 * marked FLAG_PYTHON or FLAG_COMPRESSED, and anything malformed. A key is handled by one side only:
 * the first message Python must handle for a key makes it Python's; if this thread already had
 * state for it, that state goes along (a BpsHandover: round, arrivals so far, the partial sum), so a
 * round that mixes compressed and plain pushes still fails with Python's "compression differs".
 * Python's own replies go out through send() on this thread (it alone touches the socket).
 *
 * Stores come from BpsStoreAllocator: memfd arenas named "byteps-server" (colocated workers read
 * them through descriptors), page-aligned and pre-faulted, two per key (alternate rounds), allocated
 * only once a body of the announced length has arrived; without shared memory (BYTEPS_ENABLE_IPC=0),
 * private mappings with transparent huge pages. A store's arena is reused or unmapped only
 * when ZeroMQ has released every zero-copy reply read from it.
 *
 * Transport seam (core/bps_link.h): messages come in whole from the ROUTER or from a worker's direct
 * TCP link (accepted here once the worker presents the one-time token Python gave it: expect_link),
 * and every message out goes through send_to(identity, frames), which picks that worker's link or
 * the ROUTER; zero-copy bodies say when they are released. A link is a BpsConn: a TCP socket
 * (BpsLink) or a UCX endpoint (BpsUcxLink, core/bps_ucx.h), admitted by the same token check.
 */
#ifndef BPS_SERVER_H
#define BPS_SERVER_H

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <netinet/in.h>
#include <netinet/tcp.h>

#include "bps_link.h"
#include "bps_ucx.h"
#include "bps_reduce.h"
#include "bps_trace.h"
#include "bps_wire.h"
#include "bps_zmq.h"

enum {
    BPS_SERVER_FLAG_PYTHON = 4,          /* core/wire.py FLAG_PYTHON: the whole op is Python's */
    BPS_SERVER_CMD_PROBE = 27,
    BPS_SERVER_CMD_LINK = 28,            /* core/wire.py Cmd.LINK: a direct link's token, and its answer */
    BPS_SERVER_NO_DTYPE = 255,
};
static const uint64_t BPS_MAX_BODY = 1ull << 33;          /* core/wire.py MAX_BODY */
static const uint64_t BPS_MAX_CONTROL_BODY = 16ull << 20; /* core/wire.py MAX_CONTROL_BODY */
static const size_t BPS_COPY_BELOW = 65536;               /* core/transport.py COPY_BELOW */
static const double BPS_STALL_WARNING_S = 60.0;           /* summation/server.py STALL_WARNING_S */
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

/* ------------------------------------------------------------------------------ Python's texts */

/* A rank as the Python server names it: the rank from the address book, or "node <id>" for a
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

/* json.dumps({"error": text}, separators=(",", ":")) (ensure_ascii; invalid UTF-8 as surrogateescape) */
static inline std::string bps_error_json(const std::string &text) {
    std::string out = "{\"error\":\"";
    char buf[16];
    auto esc = [&](unsigned cp) {
        snprintf(buf, sizeof buf, "\\u%04x", cp);
        out += buf;
    };
    const unsigned char *p = (const unsigned char *)text.data();
    size_t n = text.size();
    for (size_t i = 0; i < n;) {
        unsigned c = p[i];
        if (c == '"') { out += "\\\""; ++i; continue; }
        if (c == '\\') { out += "\\\\"; ++i; continue; }
        if (c == '\n') { out += "\\n"; ++i; continue; }
        if (c == '\r') { out += "\\r"; ++i; continue; }
        if (c == '\t') { out += "\\t"; ++i; continue; }
        if (c == '\b') { out += "\\b"; ++i; continue; }
        if (c == '\f') { out += "\\f"; ++i; continue; }
        if (c >= 0x20 && c < 0x7f) { out += (char)c; ++i; continue; }
        if (c < 0x80) { esc(c); ++i; continue; }
        int extra = c >= 0xf0 && c < 0xf5 ? 3 : c >= 0xe0 ? 2 : c >= 0xc2 && c < 0xe0 ? 1 : -1;
        unsigned cp = extra == 3 ? c & 7 : extra == 2 ? c & 15 : c & 31;
        bool ok = extra > 0 && i + (size_t)extra < n;
        for (int k = 1; ok && k <= extra; ++k) {
            if ((p[i + k] & 0xc0) != 0x80) ok = false;
            else cp = (cp << 6) | (p[i + k] & 0x3f);
        }
        if (ok && ((extra == 2 && (cp < 0x800 || (cp >= 0xd800 && cp < 0xe000))) ||
                   (extra == 3 && (cp < 0x10000 || cp > 0x10ffff))))
            ok = false;
        if (!ok) { esc(0xdc00 + c); ++i; continue; } /* os.fsdecode's surrogateescape */
        if (cp >= 0x10000) {
            cp -= 0x10000;
            esc(0xd800 + (cp >> 10));
            esc(0xdc00 + (cp & 0x3ff));
        } else {
            esc(cp);
        }
        i += extra + 1;
    }
    return out + "\"}";
}

/* ------------------------------------------------------------------------------ stores */

/* One mapping stores are cut from: a shared memfd arena (bump-allocated, reused after a reset), or
 * a private anonymous mapping holding one store. ``replies`` counts zero-copy replies ZeroMQ still
 * reads from it: it is reused or unmapped only at zero. */
struct BpsArena {
    unsigned char *base = nullptr;
    uint64_t size = 0, used = 0;
    int fd = -1;
    uint64_t inode = 0;
    std::atomic<int64_t> replies{0};
};

struct BpsStore {
    unsigned char *data = nullptr;
    BpsArena *arena = nullptr;
    uint64_t offset = 0;
};

class BpsStoreAllocator {
  public:
    explicit BpsStoreAllocator(bool shared) : shared_(shared) {}

    ~BpsStoreAllocator() {
        for (BpsArena *a : arenas_) release(a);
        for (BpsArena *a : retired_) release(a);
    }

    bool shared() const { return shared_; }

    /* Told of every arena made and of every arena about to be unmapped, on the thread that allocates
     * (byteps-serve): UCX registers the stores replies are sent from (BpsUcxWorker::register_region).
     * Arenas made before the hooks are told at once; empty functions stop the telling. */
    void set_hooks(std::function<void(void *, size_t)> made, std::function<void(void *)> gone) {
        made_ = std::move(made);
        gone_ = std::move(gone);
        if (made_)
            for (BpsArena *a : arenas_) made_(a->base, a->size);
    }

    /* A fresh page-aligned, pre-faulted store of ``nbytes``; false and *err if memory ran out. */
    bool alloc(uint64_t nbytes, BpsStore *out, std::string *err) {
        uint64_t want = std::max<uint64_t>(page(), (nbytes + page() - 1) / page() * page());
        BpsArena *arena = nullptr;
        if (shared_) {
            for (BpsArena *a : arenas_) {
                if (a->used + want <= a->size) {
                    arena = a;
                    break;
                }
            }
        }
        if (arena == nullptr) {
            arena = create(shared_ ? std::max(want, BPS_ARENA_BYTES) : want, err);
            if (arena == nullptr) return false;
            arenas_.push_back(arena);
        }
        out->arena = arena;
        out->offset = arena->used;
        out->data = arena->base + arena->used;
        arena->used += want;
        /* Shared: fault the pages in now, once per key, not in the first round's sum (core/shm.py's
         * prefault). Private: huge pages fault cheaply, and a store a key never uses (the second one of a
         * tensor pushed once, a 2 GB partition's) must not take memory (aligned_empty's behaviour). */
        if (shared_) madvise(out->data, want, 23 /* MADV_POPULATE_WRITE, Linux 5.14; best effort */);
        return true;
    }

    /* Every store is dropped (LEAVE, join done): arenas no reply reads are reused or unmapped now,
     * the others once ZeroMQ has released their last reply (collect()). */
    void reset() {
        std::vector<BpsArena *> keep;
        for (BpsArena *a : arenas_) {
            if (shared_ && a->replies.load() == 0) {
                a->used = 0;
                keep.push_back(a);
            } else {
                retired_.push_back(a);
            }
        }
        arenas_.swap(keep);
        collect();
    }

    void collect() {
        for (auto it = retired_.begin(); it != retired_.end();) {
            if ((*it)->replies.load() == 0) {
                release(*it);
                it = retired_.erase(it);
            } else {
                ++it;
            }
        }
    }

    static uint64_t page() {
        static const uint64_t p = (uint64_t)sysconf(_SC_PAGESIZE);
        return p;
    }

  private:
    BpsArena *create(uint64_t size, std::string *err) {
        BpsArena *a = new BpsArena();
        a->size = size;
        void *base = MAP_FAILED;
        if (shared_) {
            a->fd = memfd_create("byteps-server", MFD_CLOEXEC); /* peers map only /memfd:byteps* */
            struct stat st;
            if (a->fd >= 0 && ftruncate(a->fd, size) == 0 && fstat(a->fd, &st) == 0) {
                a->inode = st.st_ino;
                base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
            }
        } else {
            base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            /* transparent huge pages where the kernel allows them: one fault per 2 MB (aligned_empty) */
            if (base != MAP_FAILED && size >= BPS_HUGEPAGE_BYTES) madvise(base, size, MADV_HUGEPAGE);
        }
        if (base == MAP_FAILED) {
            *err = std::string("cannot allocate ") + std::to_string(size) + " bytes for the stores: " + strerror(errno);
            if (a->fd >= 0) ::close(a->fd);
            delete a;
            return nullptr;
        }
        a->base = (unsigned char *)base;
        if (made_) made_(a->base, a->size);
        return a;
    }

    void release(BpsArena *a) {
        if (a->replies.load() != 0) return; /* ZeroMQ still reads it (shutdown): the kernel frees it at exit */
        if (gone_) gone_(a->base);
        munmap(a->base, a->size);
        if (a->fd >= 0) ::close(a->fd);
        delete a;
    }

    bool shared_;
    std::vector<BpsArena *> arenas_;
    std::vector<BpsArena *> retired_;
    std::function<void(void *, size_t)> made_;
    std::function<void(void *)> gone_;
};

/* ------------------------------------------------------------------------------ sum threads */

/* One summation into a round's store, with the ZeroMQ buffers it reads (closed once it has run). */
struct BpsSumTask {
    uint64_t key = 0;
    uint64_t round = 0; /* for the timeline */
    void *dst = nullptr;
    const void *srcs[2] = {nullptr, nullptr};
    int nsrc = 0;     /* 2: dst = srcs[0] + srcs[1]; 1: dst += srcs[0] */
    size_t count = 0; /* elements */
    int dtype = 0;
    bps_zmq_msg keep[2];
    int nkeep = 0;

    void run(int kernel_threads) {
        uint64_t t0 = bps_span_start();
        if (nsrc == 2) {
            bps_sum_many(dst, srcs, 2, count, dtype, kernel_threads);
        } else {
            bps_sum_into(dst, srcs[0], count, dtype, kernel_threads);
        }
        bps_span(BPS_STAGE_SUM, t0, key, round, count * (uint64_t)bps_itemsize(dtype), -1);
        for (int i = 0; i < nkeep; ++i) bps_zmq.msg_close(&keep[i]);
        nkeep = 0;
    }
};

/* BYTEPS_SERVER_ENGINE_THREAD=N > 0: N threads "byteps-sum-<i>"; a key's sums always run on thread
 * key % N in arrival order (summation/sum_pool.py's rule). A finished sum's key goes to done() and
 * the serve thread is woken through ``wake_fd``. */
class BpsSumPool {
  public:
    BpsSumPool(int threads, int kernel_threads, int wake_fd) : kernel_threads_(kernel_threads), wake_fd_(wake_fd) {
        for (int i = 0; i < threads; ++i) lanes_.emplace_back(new Lane());
        for (int i = 0; i < threads; ++i) {
            lanes_[i]->thread = std::thread([this, i] { run(i); });
        }
    }

    ~BpsSumPool() {
        for (auto &l : lanes_) {
            {
                std::lock_guard<std::mutex> lock(l->mu);
                l->stop = true;
            }
            l->cv.notify_all();
        }
        for (auto &l : lanes_) l->thread.join();
    }

    int threads() const { return (int)lanes_.size(); }

    void submit(BpsSumTask *t) {
        Lane &l = *lanes_[t->key % lanes_.size()];
        {
            std::lock_guard<std::mutex> lock(l.mu);
            l.queue.push_back(t);
        }
        outstanding_.fetch_add(1);
        l.cv.notify_one();
    }

    void done(std::vector<uint64_t> *out) {
        std::lock_guard<std::mutex> lock(done_mu_);
        out->swap(done_);
    }

    /* Wait until no sum is queued or running (reset, hand-over); sums are finite, the wait is bounded
     * by their length. */
    void wait_idle() {
        std::unique_lock<std::mutex> lock(done_mu_);
        while (outstanding_.load() > 0) idle_cv_.wait_for(lock, std::chrono::milliseconds(100));
    }

  private:
    struct Lane {
        std::mutex mu;
        std::condition_variable cv;
        std::deque<BpsSumTask *> queue;
        bool stop = false;
        std::thread thread;
    };

    void run(int i) {
        char name[16];
        snprintf(name, sizeof name, "byteps-sum-%d", i);
        prctl(PR_SET_NAME, name, 0, 0, 0);
        Lane &l = *lanes_[i];
        for (;;) {
            BpsSumTask *t;
            {
                std::unique_lock<std::mutex> lock(l.mu);
                while (l.queue.empty() && !l.stop) l.cv.wait_for(lock, std::chrono::milliseconds(500));
                if (l.queue.empty()) return;
                t = l.queue.front();
                l.queue.pop_front();
            }
            t->run(kernel_threads_);
            {
                std::lock_guard<std::mutex> lock(done_mu_);
                done_.push_back(t->key);
                outstanding_.fetch_sub(1);
            }
            idle_cv_.notify_all();
            delete t;
            uint64_t one = 1;
            ssize_t rc = write(wake_fd_, &one, sizeof one);
            (void)rc;
        }
    }

    int kernel_threads_;
    int wake_fd_;
    std::vector<std::unique_ptr<Lane>> lanes_;
    std::mutex done_mu_;
    std::condition_variable idle_cv_;
    std::vector<uint64_t> done_;
    std::atomic<int64_t> outstanding_{0};
};

/* ------------------------------------------------------------------------------ key state */

/* One key: the current round's arrivals and its two stores (summation/server.py's _Round). */
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
    bool has_codec = false;  /* rank of the first network push (all plain here; for a hand-over) */
    int64_t codec_rank = 0;
    int pending = 0;         /* sums still running on a sum thread */
    bool has_ready = false;  /* all messages in, waiting for its sums: complete with this header */
    BpsHeader ready;
    bool has_done = false;   /* elastic: round done_round completed here; its store holds the result */
    uint64_t done_round = 0;

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
        has_codec = false;
        has_ready = false;
    }

    ~BpsRound() { drop_held(); }

    BpsStore &store() { return stores[round & 1]; }
};

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
    bool has_codec = false;
    int64_t codec_rank = 0;
    bool has_partial = false; /* the store so far (the held first push folded in) */
    std::string partial;
};

/* A message for Python: its frames (moved, no copy), whether Python must answer admit() for its
 * identity afterwards, and the key's state when this message hands the key over. */
struct BpsServerForward {
    BpsMessage *msg = nullptr;
    bool auth = false;
    BpsHandover *handover = nullptr;

    ~BpsServerForward() {
        delete msg;
        delete handover;
    }
};

/* A message Python sends through this thread: copied frames, the last one zero-copy with a token
 * Python keeps its buffer alive for until released() returns it. */
struct BpsServerSend {
    std::vector<std::string> frames;
    void *zc_data = nullptr;
    size_t zc_len = 0;
    int64_t token = -1;
};

class BpsServerCore;

struct BpsServerZcHint {
    BpsServerCore *core;
    int64_t token;
};

/* ------------------------------------------------------------------------------ the core */

class BpsServerCore {
  public:
    BpsServerCore(void *sock, bool auth_on, bool shared_stores, int sum_threads, int kernel_threads)
        : sock_(sock), auth_on_(auth_on), alloc_(shared_stores), kernel_threads_(kernel_threads),
          sum_threads_(sum_threads), pid_(getpid()) {
        wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        notify_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    }

    /* BYTEPS_ELASTIC (docs/elastic.md): a key's first push sets its round (before start()). */
    void set_adopt_rounds(bool on) { adopt_rounds_ = on; }

    ~BpsServerCore() {
        stop();
        by_ident_.clear();
        conns_.clear(); /* before the stores: a queued zero-copy reply releases its arena */
        alloc_.set_hooks(nullptr, nullptr); /* the stores outlive the UCP worker that registered them */
        ucx_.reset();
        if (listen_fd_ >= 0) ::close(listen_fd_);
        pool_.reset();
        keys_.clear();
        for (auto &kv : parked_) {
            for (BpsMessage *m : kv.second) delete m;
        }
        parked_.clear();
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (BpsServerForward *f : forward_) delete f;
            forward_.clear();
        }
        ::close(wake_fd_);
        ::close(notify_fd_);
    }

    /* Python's side (any thread, short locks) ------------------------------------------------ */

    void start() {
        std::lock_guard<std::mutex> lock(mu_); /* the full barrier that hands the socket over */
        if (sum_threads_ > 0) pool_.reset(new BpsSumPool(sum_threads_, kernel_threads_, wake_fd_));
        thread_ = std::thread([this] { run(); });
    }

    void stop() {
        if (!thread_.joinable()) return;
        stopping_ = true;
        wake();
        thread_.join();
    }

    /* A listening TCP socket for workers' direct links (before start()); this thread owns and closes it. */
    void set_listener(int fd) { listen_fd_ = fd; }

    /* Listen for workers' UCX endpoints on ``host`` (before start()): the port, or -1 with ``why``. */
    int ucx_listen(const std::string &host, std::string *why) {
        if (!ucx_) {
            ucx_.reset(BpsUcxWorker::create(why));
            if (ucx_) /* the stores replies are sent from: registered once, for as long as they live */
                alloc_.set_hooks([this](void *base, size_t len) { ucx_->register_region(base, len); },
                                 [this](void *base) { ucx_->unregister_region(base); });
        }
        return ucx_ ? ucx_->listen(host, why) : -1;
    }

    /* Python gave ``ident`` (authenticated) this one-time token for a direct link. */
    void expect_link(const std::string &ident, const std::string &token) {
        Command c(Command::LINK);
        c.ident = ident;
        c.token = token;
        post(std::move(c));
    }

    uint64_t links_accepted() const { return links_accepted_.load(); }

    /* An eventfd that is readable while forwarded messages, log lines or released tokens wait. */
    int notify_fd() const { return notify_fd_; }

    /* The address book: who pushes, and the ranks error messages name. num_workers < 0: no book
     * (after LEAVE): data goes to Python, which says "data arrived before the address book". */
    void set_book(int64_t num_workers, int64_t pushers, uint32_t node_id, const std::vector<uint32_t> &nodes,
                  const std::vector<int64_t> &ranks) {
        Command c(Command::BOOK);
        c.a = num_workers;
        c.b = pushers;
        c.node = node_id;
        c.nodes = nodes;
        c.ranks = ranks;
        post(std::move(c));
    }

    /* join(): ``done`` restarts every key (a sync point); else ranks in join() and machines still pushing. */
    void set_join(bool done, const std::vector<int64_t> &joined, int64_t active_pushers) {
        Command c(Command::JOIN);
        c.a = done;
        c.b = active_pushers;
        c.ranks = joined;
        post(std::move(c));
    }

    /* LEAVE: every key restarts at round 0; stores and peers' mappings are dropped. */
    void reset() { post(Command(Command::RESET)); }

    /* Python's verdict on an identity after a forwarded message marked ``auth``. */
    void admit(const std::string &ident, bool ok) {
        Command c(Command::ADMIT);
        c.ident = ident;
        c.a = ok;
        post(std::move(c));
    }

    void send(BpsServerSend *m) {
        Command c(Command::SEND);
        c.send = m;
        post(std::move(c));
    }

    void forwarded(std::vector<BpsServerForward *> *out) {
        std::lock_guard<std::mutex> lock(mu_);
        out->swap(forward_);
    }

    void logs(std::vector<std::string> *out) {
        std::lock_guard<std::mutex> lock(mu_);
        out->swap(logs_);
    }

    void released(std::vector<int64_t> *out) {
        std::lock_guard<std::mutex> lock(zc_mu_);
        out->swap(released_);
    }

    /* counters (tests and logs prove the native path ran) */
    uint64_t pushes() const { return pushes_.load(); }
    uint64_t rounds() const { return rounds_.load(); }
    uint64_t forwards() const { return forwards_.load(); }

    static void store_released(void *, void *hint) { ((BpsArena *)hint)->replies.fetch_sub(1); }

    static void raw_released(void *, void *hint) {
        BpsServerZcHint *h = (BpsServerZcHint *)hint;
        {
            std::lock_guard<std::mutex> lock(h->core->zc_mu_);
            h->core->released_.push_back(h->token);
        }
        h->core->notify();
        delete h;
    }

  private:
    struct Command {
        enum Kind { BOOK, JOIN, RESET, ADMIT, SEND, LINK } kind;
        int64_t a = 0, b = 0;
        uint32_t node = 0;
        std::vector<uint32_t> nodes;
        std::vector<int64_t> ranks;
        std::string ident, token;
        BpsServerSend *send = nullptr;
        explicit Command(Kind k) : kind(k) {}
    };

    void post(Command &&c) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            inbox_.push_back(std::move(c));
            inbox_ready_.store(true, std::memory_order_release);
        }
        wake();
    }

    void wake() {
        uint64_t one = 1;
        ssize_t rc = write(wake_fd_, &one, sizeof one);
        (void)rc;
    }

    void notify() {
        uint64_t one = 1;
        ssize_t rc = write(notify_fd_, &one, sizeof one);
        (void)rc;
    }

    void log(const std::string &line) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            logs_.push_back(line);
        }
        notify_pending_ = true;
    }

    /* ---------------------------------------------------------------- the thread */

    void run() {
        prctl(PR_SET_NAME, "byteps-serve", 0, 0, 0);
        std::vector<bps_zmq_pollitem> items;
        BpsMessage msg;
        double next_check = 0;
        while (!stopping_) {
            /* ROUTER, wake-up, listener, UCX wake-up, then one item per link (rebuilt: links come and go) */
            const size_t conns_at = 4;
            items.assign(conns_at, bps_zmq_pollitem{nullptr, -1, 0, 0});
            items[0] = bps_zmq_pollitem{sock_, 0, BPS_ZMQ_POLLIN, 0};
            items[1] = bps_zmq_pollitem{nullptr, wake_fd_, BPS_ZMQ_POLLIN, 0};
            items[2] = bps_zmq_pollitem{nullptr, listen_fd_, (short)(listen_fd_ >= 0 ? BPS_ZMQ_POLLIN : 0), 0};
            items[3] = bps_zmq_pollitem{nullptr, ucx_ ? ucx_->efd() : -1, (short)(ucx_ ? BPS_ZMQ_POLLIN : 0), 0};
            for (auto &c : conns_)
                items.push_back(bps_zmq_pollitem{nullptr, c->fd(),
                                                 (short)(BPS_ZMQ_POLLIN | (c->wants_write() ? BPS_ZMQ_POLLOUT : 0)), 0});
            bool buffered = false; /* a link that stopped mid-burst has whole messages in hand: no sleep */
            for (auto &c : conns_) buffered |= c->pending_input();
            if (ucx_) buffered |= ucx_->prepare_sleep(); /* arms UCX's wake-up fd (new endpoints too) */
            int rc = bps_zmq.poll(items.data(), (int)items.size(), buffered ? 0 : 100);
            if (rc < 0 && bps_zmq.errno_() != EINTR) break; /* the context was terminated */
            if (items[1].revents) {
                uint64_t n;
                ssize_t got = read(wake_fd_, &n, sizeof n);
                (void)got;
            }
            take_inbox();
            for (auto &c : conns_) c->cork(true); /* this turn's replies leave in as few writes as possible */
            take_sums();
            if (items[0].revents) {
                for (int k = 0; k < 256 && !stopping_; ++k) { /* a burst, then the inbox and sums again */
                    /* a command Python posted before this message arrived is applied first: Python acknowledges
                     * a join()'s end to the scheduler right after posting it, and workers then push at once */
                    if (inbox_ready_.load(std::memory_order_acquire)) take_inbox();
                    int got = recv_message(&msg);
                    if (got <= 0) break;
                    on_message(&msg);
                    msg.clear();
                    if (k % 32 == 31) take_sums();
                }
            }
            size_t nconns = items.size() - conns_at; /* links accepted below wait for the next turn */
            for (size_t i = 0; i < nconns && !stopping_; ++i) {
                if (items[conns_at + i].revents || conns_[i]->pending_input())
                    serve_link(conns_[i].get(), items[conns_at + i].revents, &msg);
            }
            for (auto &c : conns_) c->cork(false);
            if (items[2].revents) accept_links();
            if (ucx_) { /* endpoints the UCX listener accepted: unadmitted links, like accepted sockets */
                ucx_->progress();
                for (BpsUcxLink *l : ucx_->take_accepted()) conns_.emplace_back(l);
            }
            drop_dead_links();
            if (notify_pending_) {
                notify_pending_ = false;
                notify();
            }
            double now = bps_server_now();
            if (now >= next_check) { /* walks every key: not once per message */
                warn_stalls(now);
                alloc_.collect();
                next_check = now + 1.0;
            }
        }
    }

    /* Transport seam: one whole message from the ROUTER, without blocking (1: got one, 0: none). */
    int recv_message(BpsMessage *m) { return bps_recv_message(sock_, m); }

    /* Transport seam: one message to a worker, over its direct link if it has one, else the ROUTER. A
     * worker that is gone is skipped (ROUTER_MANDATORY says EHOSTUNREACH; the scheduler reports the
     * loss to everyone); its zero-copy frames are released either way. */
    void send_to(const std::string &ident, BpsFrames &f) {
        auto it = by_ident_.find(ident);
        if (it != by_ident_.end() && !it->second->dead()) {
            it->second->send(f);
            return;
        }
        bps_zmq_send_frames(sock_, f, &ident);
    }

    /* ---------------------------------------------------------------- direct links */

    void accept_links() {
        for (;;) {
            int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0) return; /* EAGAIN, or a connection that failed before we took it */
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            conns_.emplace_back(new BpsLink(fd));
        }
    }

    void serve_link(BpsConn *c, short revents, BpsMessage *msg) {
        if (revents & BPS_ZMQ_POLLOUT) c->flush();
        for (int k = 0; k < 256 && !c->dead() && !stopping_; ++k) {
            if (c->ident.empty()) { /* the first message must present a token */
                if (c->recv(msg) <= 0) return;
                link_hello(c, msg);
                if (c->ident.empty()) return; /* refused: it goes after this turn */
            } else {
                if (inbox_ready_.load(std::memory_order_acquire)) take_inbox(); /* as for the ROUTER's messages */
                if (c->recv(msg, &c->ident) <= 0) return;
                on_message(msg);
            }
            msg->clear();
            if (k % 32 == 31) take_sums();
        }
    }

    /* [header LINK, token (16 bytes) + identity]: admit the link if Python gave that identity the token. */
    void link_hello(BpsConn *c, BpsMessage *m) {
        BpsHeader h;
        bool ok = m->count == 2 && bps_parse_header(m->data(0), m->size(0), &h) && h.cmd == BPS_SERVER_CMD_LINK &&
                  m->size(1) > 16;
        std::string ident, token;
        if (ok) {
            token.assign((const char *)m->data(1), 16);
            ident.assign((const char *)m->data(1) + 16, m->size(1) - 16);
            auto it = expected_.find(ident);
            ok = it != expected_.end() && it->second == token;
            if (ok) expected_.erase(it); /* one use */
        }
        BpsHeader answer = bps_header(BPS_SERVER_CMD_LINK, node_id_, 0, 0, 0, BPS_SERVER_NO_DTYPE, ok ? 1 : 0, 0);
        BpsFrames f;
        f.copy(&answer, sizeof answer);
        c->send(f);
        if (!ok) {
            log(std::string("refused a direct link (") + c->kind() + "): its token does not match one this server handed out");
            c->ident.clear();
            close_link_later(c);
            return;
        }
        c->ident = ident;
        auto old = by_ident_.find(ident);
        if (old != by_ident_.end()) close_link_later(old->second); /* a worker that reconnected */
        by_ident_[ident] = c;
        links_accepted_.fetch_add(1);
    }

    void close_link_later(BpsConn *c) { closing_.insert(c); }

    /* Links that broke, or were refused, go; their identities fall back to the ROUTER. */
    void drop_dead_links() {
        for (size_t i = 0; i < conns_.size();) {
            BpsConn *c = conns_[i].get();
            bool refused = closing_.count(c) > 0;
            if (!c->dead() && !refused) {
                ++i;
                continue;
            }
            if (refused && c->wants_write()) c->flush(); /* best effort: the refusal's answer */
            auto it = by_ident_.find(c->ident);
            if (it != by_ident_.end() && it->second == c) by_ident_.erase(it);
            closing_.erase(c);
            conns_.erase(conns_.begin() + (long)i);
        }
    }

    void take_inbox() {
        std::vector<Command> in;
        {
            std::lock_guard<std::mutex> lock(mu_);
            in.swap(inbox_);
            inbox_ready_.store(false, std::memory_order_relaxed);
        }
        for (Command &c : in) {
            switch (c.kind) {
                case Command::BOOK:
                    have_book_ = c.a >= 0;
                    num_workers_ = c.a;
                    pushers_ = c.b;
                    node_id_ = c.node;
                    ranks_.clear();
                    for (size_t i = 0; i < c.nodes.size() && i < c.ranks.size(); ++i) ranks_[c.nodes[i]] = c.ranks[i];
                    break;
                case Command::JOIN:
                    on_join(c.a != 0, c.ranks, c.b);
                    break;
                case Command::RESET:
                    reset_keys();
                    break;
                case Command::ADMIT:
                    on_admit(c.ident, c.a != 0);
                    break;
                case Command::SEND:
                    send_frames(c.send);
                    delete c.send;
                    break;
                case Command::LINK:
                    expected_[c.ident] = c.token;
                    break;
            }
        }
    }

    /* ---------------------------------------------------------------- who handles a message */

    void on_message(BpsMessage *m) {
        if (m->count < 1) return;
        std::string ident((const char *)m->data(0), m->size(0));
        if (auth_on_) {
            auto parked = parked_.find(ident);
            if (parked != parked_.end()) { /* Python has not decided on this identity's AUTH yet */
                park(parked->second, m);
                return;
            }
        }
        BpsHeader h;
        bool parsed = m->count >= 2 && bps_parse_header(m->data(1), m->size(1), &h);
        if (parsed && h.cmd == BPS_CMD_AUTH && h.length <= BPS_MAX_CONTROL_BODY && auth_on_) {
            parked_[ident]; /* hold what follows until admit() */
            forward(m, true);
            return;
        }
        if (!parsed || h.cmd == BPS_CMD_HELLO || h.cmd == BPS_CMD_AUTH ||
            (auth_on_ && admitted_.find(ident) == admitted_.end())) {
            forward(m); /* handshakes, malformed, strangers: Python answers, ignores or logs */
            return;
        }
        if (h.cmd == BPS_CMD_RESULT && adopt_rounds_ && have_book_ && m->count >= 3 && h.length <= BPS_MAX_BODY &&
            python_keys_.find(h.key) == python_keys_.end()) {
            on_result(h, m);
            return;
        }
        bool data = h.cmd == BPS_CMD_PUSHPULL || h.cmd == BPS_CMD_BROADCAST || h.cmd == BPS_CMD_ASYNC_PUSHPULL;
        bool valid = data && have_book_ && m->count >= 3 && h.length <= BPS_MAX_BODY;
        bool native = valid && h.cmd != BPS_CMD_ASYNC_PUSHPULL &&
                      !(h.flags & (BPS_SERVER_FLAG_PYTHON | BPS_FLAG_COMPRESSED)) &&
                      python_keys_.find(h.key) == python_keys_.end();
        if (!native) {
            BpsHandover *handover = nullptr;
            if (valid && python_keys_.insert(h.key).second) handover = hand_over(h.key);
            forward(m, false, handover);
            return;
        }
        on_push(ident, h, m);
    }

    void forward(BpsMessage *m, bool auth = false, BpsHandover *handover = nullptr) {
        BpsServerForward *f = new BpsServerForward();
        f->msg = new BpsMessage();
        for (int i = 0; i < m->count; ++i) m->take(i, &f->msg->frames[i]);
        f->msg->count = m->count;
        m->count = 0; /* moved out: nothing left to close */
        f->auth = auth;
        f->handover = handover;
        {
            std::lock_guard<std::mutex> lock(mu_);
            forward_.push_back(f);
        }
        forwards_.fetch_add(1);
        notify_pending_ = true;
    }

    void park(std::deque<BpsMessage *> &queue, BpsMessage *m) {
        if (queue.size() >= BPS_MAX_PARKED) {
            if (queue.size() == BPS_MAX_PARKED) log("dropped messages from a peer whose authentication is still open");
            return;
        }
        BpsMessage *held = new BpsMessage();
        for (int i = 0; i < m->count; ++i) m->take(i, &held->frames[i]);
        held->count = m->count;
        m->count = 0;
        queue.push_back(held);
    }

    /* Python checked an AUTH of ``ident``: admit it or not, then handle what it sent meanwhile, in order. */
    void on_admit(const std::string &ident, bool ok) {
        if (ok) admitted_.insert(ident);
        auto it = parked_.find(ident);
        if (it == parked_.end()) return;
        std::deque<BpsMessage *> queue;
        queue.swap(it->second);
        parked_.erase(it);
        while (!queue.empty()) {
            BpsMessage *m = queue.front();
            queue.pop_front();
            on_message(m); /* another AUTH parks the rest again */
            delete m;
            auto again = parked_.find(ident);
            if (again != parked_.end()) {
                for (BpsMessage *rest : queue) again->second.push_back(rest);
                return;
            }
        }
    }

    /* ---------------------------------------------------------------- a push, in one place */

    int64_t rank_of(uint32_t sender) const {
        auto it = ranks_.find(sender);
        return it != ranks_.end() ? it->second : -(int64_t)sender - 1;
    }

    void on_push(const std::string &ident, const BpsHeader &h, BpsMessage *m) {
        uint64_t t_recv = bps_span_start();
        pushes_.fetch_add(1);
        int64_t rank = rank_of(h.sender);
        int isz = bps_itemsize(h.dtype);
        /* before any state exists for the key: an unknown dtype code must not become the key's dtype,
         * and a length that is not whole elements must not reach the sum kernels */
        if (isz < 0 || h.length % (uint64_t)isz) {
            reply_error(ident, h, bps_key_name(h.key) + ": rank " + bps_rank_str(rank) + " sent " +
                                      std::to_string(h.length) + " bytes of dtype code " + std::to_string(h.dtype) +
                                      ": not whole elements of a known dtype");
            return;
        }
        if (!joined_.empty() && h.cmd == BPS_CMD_BROADCAST) { /* as in Horovod: not while ranks have joined */
            reply_error(ident, h, joined_broadcast_error());
            return;
        }
        auto found = keys_.find(h.key);
        if (found == keys_.end()) {
            std::unique_ptr<BpsRound> fresh(new BpsRound());
            fresh->key = h.key;
            /* elastic servers: a key this server takes over from a lost one starts at the round it is in */
            if (adopt_rounds_) fresh->round = h.round;
            fresh->nbytes = h.cmd != BPS_CMD_BROADCAST ? (int64_t)h.length : -1;
            fresh->dtype = h.dtype;
            found = keys_.emplace(h.key, std::move(fresh)).first;
        }
        BpsRound &st = *found->second;
        if (adopt_rounds_ && st.has_done && h.round == st.done_round && h.round + 1 == st.round) {
            answer_late(st, h, ident); /* elastic: a round this server completed, pushed again */
            return;
        }
        if (st.senders.empty()) st.since = bps_server_now();
        std::string problem = st.error.empty() ? check(st, h, rank) : st.error;
        if (problem.empty()) problem = accept(st, h, rank, ident, m);
        if (!problem.empty() && st.error.empty()) st.error = problem;
        st.senders.push_back(rank);
        st.waiters.push_back(BpsRound::Waiter{ident, (h.flags & BPS_FLAG_SHM) != 0});
        st.has_header = true;
        st.header = h;
        bps_span(BPS_STAGE_RECV, t_recv, h.key, h.round, h.length, -1, 0, (int32_t)rank);
        if ((int64_t)st.senders.size() >= expected(h.cmd)) maybe_complete(st, h);
    }

    /* Messages that complete a round: one push_pull per machine still pushing; every rank for a broadcast. */
    int64_t expected(uint8_t cmd) const {
        if (cmd != BPS_CMD_PUSHPULL) return num_workers_;
        return joined_.empty() ? pushers_ : active_pushers_;
    }

    /* Why this push cannot join the round, or "" (texts as summation/server.py's _check). */
    std::string check(BpsRound &st, const BpsHeader &h, int64_t rank) {
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
            if (!is_rank(rank, h.arg) && h.length != 0) {
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

    static bool is_rank(int64_t rank, uint32_t arg) { return rank >= 0 && (uint64_t)rank == arg; }

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

    /* Take the body into the round (summation/server.py's _accept); "" or why it cannot be. */
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
            if (!is_rank(rank, h.arg)) return ""; /* a non-root rank's (empty) body is not needed */
            st.has_root_ident = true;
            st.root_ident = ident;
            if (st.nbytes != (int64_t)h.length || st.dtype != h.dtype) { /* new stores at first use */
                st.nbytes = (int64_t)h.length;
                st.dtype = h.dtype;
                st.allocated = false;
            }
        } else if (!(h.flags & BPS_FLAG_SHM) && !st.has_codec) {
            st.has_codec = true; /* every network push is plain here (compressed ones are Python's) */
            st.codec_rank = rank;
        }
        uint64_t got;
        if (h.flags & BPS_FLAG_SHM) {
            unsigned char *src;
            uint64_t len;
            std::string err;
            if (maps_.view(m->data(2), m->size(2), &src, &len, &err) != 0) {
                return bps_key_name(h.key) + ": rank " + bps_rank_str(rank) + "'s shared memory: " + err;
            }
            got = len;
            if (got == h.length && h.cmd == BPS_CMD_PUSHPULL && pushers_ == 1) {
                st.has_echo = true; /* one machine: answer with its own region, no copy */
                st.echo.assign((const char *)m->data(2), m->size(2));
            } else if (got == h.length && h.cmd == BPS_CMD_BROADCAST) {
                if (ensure_stores(st)) bps_copy(st.store().data, src, got, kernel_threads_);
            } else if (got == h.length) {
                add(st, src, nullptr, h.dtype);
            }
        } else {
            got = m->size(2);
            if (got == h.length && h.cmd == BPS_CMD_BROADCAST) { /* stores only for a body of the announced size */
                if (ensure_stores(st)) bps_copy(st.store().data, m->data(2), got, kernel_threads_);
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
        if (!ensure_stores(st)) return;
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
        if (!pool_) {
            t->run(kernel_threads_);
            delete t; /* ``m`` still owns its body: closed with the message */
            return;
        }
        if (m != nullptr) { /* the body lives as long as its sum */
            m->take(2, &t->keep[t->nkeep]);
            *src = bps_zmq.msg_data(&t->keep[t->nkeep++]);
        }
        st.pending++;
        pool_->submit(t);
    }

    void take_sums() {
        if (!pool_) return;
        std::vector<uint64_t> done;
        pool_->done(&done);
        for (uint64_t key : done) {
            auto it = keys_.find(key);
            if (it == keys_.end()) continue;
            BpsRound &st = *it->second;
            st.pending--;
            if (st.pending == 0 && st.has_ready) {
                st.has_ready = false;
                BpsHeader h = st.ready;
                complete(st, h);
            }
        }
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
            if (ensure_stores(st)) bps_copy(st.store().data, st.held_data(), (size_t)st.nbytes, kernel_threads_);
        }
        st.drop_held();
        if (st.error.empty() && !st.has_echo) ensure_stores(st); /* a reply reads the store */
        if (!st.error.empty()) {
            log(st.error);
            for (auto &w : st.waiters) reply_error(w.ident, h, st.error);
        } else {
            BpsStore &store = st.store();
            uint64_t nbytes = (uint64_t)std::max<int64_t>(st.nbytes, 0);
            for (auto &w : st.waiters) {
                if (h.cmd == BPS_CMD_BROADCAST && st.has_root_ident && w.ident == st.root_ident) {
                    send_reply(w.ident, h.key, st.round, 0, st.dtype, 0, nullptr, 0, nullptr); /* the root has the data */
                } else if (st.has_echo) {
                    send_reply(w.ident, h.key, st.round, nbytes, st.dtype, BPS_FLAG_SHM, st.echo.data(), st.echo.size(),
                               nullptr);
                } else if (w.shared && alloc_.shared() && st.allocated) {
                    /* the worker copies from our store */
                    BpsDescriptor d = bps_descriptor(pid_, store.arena->fd, store.arena->inode, store.offset, nbytes);
                    send_reply(w.ident, h.key, st.round, nbytes, st.dtype, BPS_FLAG_SHM, &d, sizeof d, nullptr);
                } else {
                    send_reply(w.ident, h.key, st.round, nbytes, st.dtype, 0, store.data, nbytes, store.arena);
                }
            }
        }
        bps_span(BPS_STAGE_REPLY, t_reply, h.key, st.round, h.length, -1, 0, (int32_t)st.waiters.size());
        rounds_.fetch_add(1);
        st.has_done = st.error.empty();
        st.done_round = st.round;
        st.round++;
        st.reset();
    }

    /* ---------------------------------------------------------------- elastic servers (docs/elastic.md)
     *
     * This server took key ``h.key`` over from a lost server. A worker that got round ``h.round``'s
     * result from the lost server before it went sends it here (RESULT) before anything else for the
     * key, because other workers may not have got it: they push that round again, and no worker that
     * has the result will push it again. So: a RESULT for the round in progress (or a fresh key)
     * completes it with that result; a push of a round completed here is answered from its store
     * (answer_late); older RESULTs, and duplicates, are dropped. */
    void on_result(const BpsHeader &h, BpsMessage *m) {
        const void *body = m->data(2);
        size_t n = m->size(2);
        auto found = keys_.find(h.key);
        if (found == keys_.end()) {
            std::unique_ptr<BpsRound> fresh(new BpsRound());
            fresh->key = h.key;
            fresh->round = h.round;
            fresh->nbytes = (int64_t)n;
            fresh->dtype = h.dtype;
            found = keys_.emplace(h.key, std::move(fresh)).first;
        }
        BpsRound &st = *found->second;
        if (h.round != st.round || st.pending || st.has_ready) return; /* older, a duplicate, or summing */
        if (st.nbytes < 0) st.nbytes = (int64_t)n; /* a broadcast's size */
        if ((uint64_t)st.nbytes != n || !ensure_stores(st)) {
            log(bps_key_name(h.key) + ": a worker's RESULT of round " + std::to_string(h.round) + " has " +
                std::to_string(n) + " bytes, the key " + std::to_string(st.nbytes) + ": dropped");
            return;
        }
        memcpy(st.store().data, body, n);
        st.drop_held();
        st.error.clear();
        st.has_echo = false;
        if (!st.waiters.empty()) /* the case it exists for: they never got the lost server's reply */
            log(bps_key_name(h.key) + ": round " + std::to_string(h.round) + " completed with a worker's copy of the "
                "lost server's result for " + std::to_string(st.waiters.size()) + " waiting workers");
        results_used_.fetch_add(1);
        BpsHeader round_h = st.has_header ? st.header : h; /* the pushes' command (a broadcast's root gets no data) */
        round_h.round = h.round;
        for (auto &w : st.waiters)
            answer(st, round_h, w.ident, w.shared, round_h.cmd == BPS_CMD_BROADCAST && st.has_root_ident &&
                                                       w.ident == st.root_ident);
        st.has_done = true;
        st.done_round = st.round;
        st.round++;
        st.reset();
    }

    void answer_late(BpsRound &st, const BpsHeader &h, const std::string &ident) {
        if (!st.allocated || st.nbytes < 0 || (h.cmd != BPS_CMD_BROADCAST && h.length != (uint64_t)st.nbytes)) {
            reply_error(ident, h, bps_key_name(h.key) + ": round " + std::to_string(h.round) + " pushed again with " +
                                      std::to_string(h.length) + " bytes after it completed");
            return;
        }
        log(bps_key_name(h.key) + ": rank " + bps_rank_str(rank_of(h.sender)) + " pushed round " +
            std::to_string(h.round) + " again after it completed here: answered with its result");
        bool shared = (h.flags & BPS_FLAG_SHM) != 0;
        answer(st, h, ident, shared, h.cmd == BPS_CMD_BROADCAST && is_rank(rank_of(h.sender), h.arg),
               &st.stores[h.round & 1]);
    }

    /* One reply of a completed round from ``store`` (the round's own by default). */
    void answer(BpsRound &st, const BpsHeader &h, const std::string &ident, bool shared, bool root,
                BpsStore *use = nullptr) {
        BpsStore &store = use != nullptr ? *use : st.store();
        uint64_t nbytes = (uint64_t)st.nbytes;
        if (root) {
            send_reply(ident, h.key, h.round, 0, st.dtype, 0, nullptr, 0, nullptr); /* the root has the data */
        } else if (shared && alloc_.shared()) {
            BpsDescriptor d = bps_descriptor(pid_, store.arena->fd, store.arena->inode, store.offset, nbytes);
            send_reply(ident, h.key, h.round, nbytes, st.dtype, BPS_FLAG_SHM, &d, sizeof d, nullptr);
        } else {
            send_reply(ident, h.key, h.round, nbytes, st.dtype, 0, store.data, nbytes, store.arena);
        }
    }

    /* REPLY [header, body]; a body of COPY_BELOW bytes or more is sent zero-copy from ``arena`` (counted
     * until the transport releases it). */
    void send_reply(const std::string &ident, uint64_t key, uint64_t round, uint64_t length, uint8_t dtype,
                    uint8_t flags, const void *body, size_t n, BpsArena *arena) {
        BpsHeader hdr = bps_header(BPS_CMD_REPLY, node_id_, key, round, length, dtype, 0, flags);
        BpsFrames f;
        f.copy(&hdr, sizeof hdr);
        if (arena == nullptr || n < BPS_COPY_BELOW) {
            f.copy(body, n);
        } else {
            arena->replies.fetch_add(1);
            f.zero_copy((void *)body, n, &BpsServerCore::store_released, arena);
        }
        send_to(ident, f);
    }

    void reply_error(const std::string &ident, const BpsHeader &h, const std::string &text) {
        std::string body = bps_error_json(text);
        BpsHeader hdr = bps_header(BPS_CMD_ERROR, node_id_, h.key, h.round, body.size(), BPS_SERVER_NO_DTYPE, 0, 0);
        BpsFrames f;
        f.copy(&hdr, sizeof hdr);
        f.copy(body.data(), body.size());
        send_to(ident, f);
    }

    /* Python's message [identity, frames...]: every frame copied but a zero-copy last one. */
    void send_frames(BpsServerSend *m) {
        size_t n = m->frames.size();
        bool zc = m->zc_data != nullptr;
        BpsFrames f;
        for (size_t i = 1; i < n && f.n < BPS_LINK_MAX_FRAMES - 1; ++i) f.copy(m->frames[i].data(), m->frames[i].size());
        if (zc) f.zero_copy(m->zc_data, m->zc_len, &BpsServerCore::raw_released, new BpsServerZcHint{this, m->token});
        if (n == 0) { /* nobody to send to: Python may drop its buffer now */
            f.release_from(0);
            return;
        }
        send_to(m->frames[0], f);
    }

    /* ---------------------------------------------------------------- events from Python */

    void on_join(bool done, const std::vector<int64_t> &joined, int64_t active_pushers) {
        if (done) { /* everyone joined: a sync point, every key restarts at round 0 */
            joined_.clear();
            reset_keys();
            return;
        }
        joined_ = joined;
        active_pushers_ = active_pushers;
        for (auto &kv : keys_) { /* rounds that were waiting only for a rank that just joined */
            BpsRound &st = *kv.second;
            if (!st.has_header || st.senders.empty()) continue;
            BpsHeader h = st.header;
            if (h.cmd == BPS_CMD_BROADCAST) { /* pushed before this JOIN: the joined rank never sends its part */
                if (st.error.empty()) st.error = joined_broadcast_error();
                maybe_complete(st, h);
            } else if (h.cmd == BPS_CMD_PUSHPULL && (int64_t)st.senders.size() >= active_pushers_) {
                maybe_complete(st, h);
            }
        }
    }

    std::string joined_broadcast_error() const { /* summation/server.py's _joined_broadcast_error */
        std::string list = "[";
        for (size_t i = 0; i < joined_.size(); ++i) list += (i ? ", " : "") + std::to_string(joined_[i]);
        return "broadcast is not supported while ranks " + list +
               "] have joined (join()); it works again once every rank has joined";
    }

    void reset_keys() {
        if (pool_) {
            pool_->wait_idle(); /* nothing reads a peer's region or writes a store any more */
            std::vector<uint64_t> done;
            pool_->done(&done);
        }
        keys_.clear();
        python_keys_.clear();
        maps_.close();
        alloc_.reset();
    }

    /* Python must handle a message of ``key`` from now on: the key's state, for Python to go on from. */
    BpsHandover *hand_over(uint64_t key) {
        auto it = keys_.find(key);
        if (it == keys_.end()) return nullptr;
        if (pool_ && it->second->pending) {
            pool_->wait_idle(); /* rare (a round mixing compressed and plain pushes): let its sums finish */
            take_sums();
        }
        BpsRound &st = *it->second;
        BpsHandover *o = new BpsHandover();
        o->key = key;
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
        o->has_codec = st.has_codec;
        o->codec_rank = st.codec_rank;
        uint64_t nbytes = (uint64_t)std::max<int64_t>(st.nbytes, 0);
        if (st.has_held) {
            o->has_partial = true;
            o->partial.assign((const char *)st.held_data(), nbytes);
        } else if (!st.senders.empty() && st.allocated && st.error.empty()) {
            o->has_partial = true;
            o->partial.assign((const char *)st.store().data, nbytes);
        }
        keys_.erase(it); /* its stores stay in the arena until a reset: replies may still read them */
        return o;
    }

    void warn_stalls(double now) {
        char secs[32];
        for (auto &kv : keys_) {
            BpsRound &st = *kv.second;
            if (!st.senders.empty() && !st.warned && now - st.since > BPS_STALL_WARNING_S) {
                snprintf(secs, sizeof secs, "%.0f", now - st.since);
                log(bps_key_name(kv.first) + " round " + std::to_string(st.round) +
                    " has waited " + secs + " s: pushes from ranks " + bps_rank_list(st.senders) + " are in, " +
                    std::to_string(pushers_) + " expected");
                st.warned = true;
            }
        }
    }

    void *sock_;
    bool auth_on_;
    BpsStoreAllocator alloc_;
    int kernel_threads_;
    int sum_threads_;
    pid_t pid_;
    int wake_fd_, notify_fd_;
    std::thread thread_;
    std::atomic<bool> stopping_{false};

    std::mutex mu_; /* guards what Python touches: the inbox and the queues below */
    std::vector<Command> inbox_;
    std::atomic<bool> inbox_ready_{false}; /* inbox_ is not empty (read without the lock per message) */
    std::vector<BpsServerForward *> forward_;
    std::vector<std::string> logs_;

    std::mutex zc_mu_;
    std::vector<int64_t> released_;

    std::atomic<uint64_t> pushes_{0}, rounds_{0}, forwards_{0};
    bool adopt_rounds_ = false;
    std::atomic<uint64_t> results_used_{0};

    /* serve-thread state */
    bool notify_pending_ = false;
    bool have_book_ = false;
    int64_t num_workers_ = 0, pushers_ = 0, active_pushers_ = 0;
    uint32_t node_id_ = 0xFFFFFFFFu;
    std::unordered_map<uint32_t, int64_t> ranks_;
    std::vector<int64_t> joined_;
    std::set<std::string> admitted_;
    std::map<std::string, std::deque<BpsMessage *>> parked_;
    std::unordered_map<uint64_t, std::unique_ptr<BpsRound>> keys_;
    std::set<uint64_t> python_keys_;
    BpsPeerMaps maps_;
    std::unique_ptr<BpsSumPool> pool_;
    /* direct links (core/bps_link.h) */
    int listen_fd_ = -1;
    std::unique_ptr<BpsUcxWorker> ucx_; /* this thread's UCP worker and listener (BYTEPS_TRANSPORT=ucx) */
    std::vector<std::unique_ptr<BpsConn>> conns_;
    std::unordered_map<std::string, BpsConn *> by_ident_;
    std::map<std::string, std::string> expected_; /* identity -> its one-time token */
    std::set<BpsConn *> closing_;
    std::atomic<uint64_t> links_accepted_{0};
};

#endif
