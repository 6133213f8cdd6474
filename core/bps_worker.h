/* The worker's native data plane: one thread that sends partitions and takes replies without the GIL.
 *
 * core/engine.py (Python) keeps what is per tensor or rare: declarations, the control plane,
 * authentication, local reduce between a machine's processes, compression, the topology executor.
 * Once a tensor's key is known, a plain push_pull or broadcast is handed over whole with
 * BpsWorkerCore::submit() (on the caller's thread, under a mutex; no Python object crosses). From then
 * on, the network thread ("byteps-net") follows each partition through its stages in one place:
 *
 *     queued (priority, credit)  ->  [STAGE: copy into shared memory, colocated server]
 *       ->  PUSH (header + body zero-copy from the tensor, or a 32-byte descriptor)
 *       ->  PULL (REPLY: copy into the tensor from ZeroMQ's buffer or the server's shared store)
 *       ->  op complete (completion queue + eventfd; Python's completion thread sets the event)
 *
 * Python's own partitions (the slow paths above) still go through this thread's sockets: it sends
 * what Python queues with send_raw() and forwards every message it does not own (an unknown
 * (key, round), a compressed reply, ...) to Python's queue, waking the engine through its pipe.
 * Rounds of every wire key are counted here, for both paths.
 *
 * Transport seam: a server link is a ZeroMQ DEALER socket (core/bps_zmq.h) and, for a colocated
 * server, shared memory (core/bps_wire.h descriptors). A new transport (UCX, issue 16) implements
 * the same three things: send a header with a body or a descriptor, poll for whole messages, and
 * say when a zero-copy body is released.
 */
#ifndef BPS_WORKER_H
#define BPS_WORKER_H

#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bps_wire.h"
#include "bps_zmq.h"

enum BpsErrorKind {
    BPS_OK = 0,
    BPS_ERR_SERVER = 1,    /* the server answered ERROR: detail is its JSON body */
    BPS_ERR_PROTOCOL = 2,  /* a reply that does not fit the partition */
    BPS_ERR_TIMEOUT = 3,   /* BYTEPS_TIMEOUT */
    BPS_ERR_ABORT = 4,     /* the engine failed (peer lost, ...): Python's failure stands */
};

static inline double bps_now() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* One partition of an op: where its bytes are, where they go, and (colocated) its staging region. */
struct BpsPart {
    uint64_t key;          /* wire key: tensor key << 32 | index */
    uint64_t offset, length;
    int32_t server;
    unsigned char *staging; /* shared region for a colocated server, or NULL */
    BpsDescriptor desc;     /* its descriptor (length filled in) */
};

struct BpsOp {
    int64_t id;
    std::string name;
    uint8_t cmd, dtype;
    uint32_t root;
    int64_t priority;
    bool root_self;         /* a broadcast whose root is this rank: nothing comes back */
    unsigned char *buf;
    uint64_t nbytes;
    std::vector<BpsPart> parts;
    int parts_left = 0;
    double started = 0;
    int error_kind = BPS_OK;
    std::string error;
    std::map<int, int> owed; /* server -> replies still owed */
    std::atomic<int> zero_copy{0}; /* bodies ZeroMQ still reads from the tensor */
    std::atomic<bool> done{false};
    int waiters = 0;        /* callers blocked in wait_op(): the first to wake delivers the op */
};

/* A tensor's partitions, registered once (BpsWorkerCore::add_table) and copied into each op. */
struct BpsTable {
    std::string name;
    std::vector<BpsPart> parts;
};

struct BpsQueued {
    int64_t priority;
    uint64_t seq;
    BpsOp *op;
    int part;
};

struct BpsQueuedOrder {
    bool operator()(const BpsQueued &a, const BpsQueued &b) const {
        if (a.priority != b.priority) return a.priority < b.priority;
        return a.seq > b.seq;
    }
};

/* A message Python queued for a server (slow paths): copied header and body, or a zero-copy body
 * that Python keeps alive until its token shows up in released(). */
struct BpsRawSend {
    int server;
    std::string header;
    std::string body;
    void *zc_data = nullptr;
    size_t zc_len = 0;
    int64_t token = -1;
};

/* A message this thread does not own, for Python: the server it came from and its frames. */
struct BpsForward {
    int server;
    std::vector<std::string> frames;
};

class BpsWorkerCore;

struct BpsZcHint {
    BpsWorkerCore *core;
    BpsOp *op;        /* a native op's body, or NULL */
    int64_t token;    /* a raw send's token, or -1 */
};

class BpsWorkerCore {
  public:
    BpsWorkerCore(uint32_t node_id, int64_t credit, double timeout, int nthreads, int notify_fd)
        : node_id_(node_id), credit_(credit), timeout_(timeout), nthreads_(nthreads), notify_fd_(notify_fd) {
        wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        done_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    }

    ~BpsWorkerCore() {
        stop();
        for (auto &kv : ops_) delete kv.second;
        ::close(wake_fd_);
        ::close(done_fd_);
    }

    /* Python's side ------------------------------------------------------------------------ */

    void add_server(void *sock) {
        socks_.push_back(sock);
        sent_.emplace_back(0);
        received_.emplace_back(0);
    }

    void start() {
        std::lock_guard<std::mutex> lock(mu_); /* the full barrier that hands the sockets over */
        thread_ = std::thread([this] { run(); });
    }

    void stop() {
        if (!thread_.joinable()) return;
        stopping_ = true;
        wake();
        thread_.join();
    }

    int done_fd() const { return done_fd_; }

    /* Register a tensor's partition table once (per tensor, not per call); returns its id. */
    int64_t add_table(const std::string &name, std::vector<BpsPart> parts) {
        std::lock_guard<std::mutex> lock(mu_);
        tables_.push_back(BpsTable{name, std::move(parts)});
        return (int64_t)tables_.size() - 1;
    }

    /* Start a push_pull/broadcast of ``buf`` over a registered table: the per-call path. */
    void submit_table(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority,
                      bool root_self, unsigned char *buf, uint64_t nbytes) {
        BpsOp *op = new BpsOp();
        op->id = id;
        op->cmd = cmd;
        op->dtype = dtype;
        op->root = root;
        op->priority = priority;
        op->root_self = root_self;
        op->buf = buf;
        op->nbytes = nbytes;
        {
            std::lock_guard<std::mutex> lock(mu_);
            const BpsTable &t = tables_.at((size_t)table); /* a deque: entries never move */
            op->name = t.name;
            op->parts = t.parts;
        }
        submit(op);
    }

    /* Take an op (ownership passes here); it completes through completions(). */
    void submit(BpsOp *op) {
        op->started = bps_now();
        op->parts_left = (int)op->parts.size();
        {
            std::lock_guard<std::mutex> lock(mu_);
            ops_[op->id] = op;
            for (size_t i = 0; i < op->parts.size(); ++i) {
                inbox_.push_back(BpsQueued{op->priority, 0, op, (int)i});
            }
        }
        wake();
    }

    void send_raw(BpsRawSend *m) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            raw_.emplace_back(m);
        }
        wake();
    }

    /* Round of the next push of a wire key (Python's own partitions count here too). */
    uint64_t next_round(uint64_t key) {
        std::lock_guard<std::mutex> lock(rounds_mu_);
        return rounds_[key]++;
    }

    void reset_rounds() {
        std::lock_guard<std::mutex> lock(rounds_mu_);
        rounds_.clear();
    }

    /* Fail every op in flight (the engine failed): they complete with BPS_ERR_ABORT. */
    void fail_all() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            abort_ = true;
        }
        wake();
    }

    bool is_done(int64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = ops_.find(id);
        return it == ops_.end() || it->second->done.load();
    }

    /* Wait (without the GIL) up to timeout_ms for op ``id`` to complete; true once it has. */
    bool wait_op(int64_t id, int timeout_ms) {
        std::unique_lock<std::mutex> lock(mu_);
        auto finished = [this, id] {
            auto it = ops_.find(id);
            return it == ops_.end() || it->second->done.load() || stopping_;
        };
        auto it = ops_.find(id);
        if (it != ops_.end()) it->second->waiters++;
        done_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), finished);
        it = ops_.find(id);
        if (it == ops_.end()) return true;
        it->second->waiters--;
        return it->second->done.load();
    }

    /* Wait (without the GIL) up to timeout_ms for completed ops; move their ids into ``out``. */
    void completions(std::vector<int64_t> *out, int timeout_ms) {
        std::unique_lock<std::mutex> lock(mu_);
        if (completed_.empty() && timeout_ms > 0 && !stopping_) {
            done_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                              [this] { return !completed_.empty() || stopping_; });
        }
        out->assign(completed_.begin(), completed_.end());
        completed_.clear();
    }

    /* A completed op's result; the op stays until forget(). */
    BpsOp *op(int64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = ops_.find(id);
        return it == ops_.end() ? nullptr : it->second;
    }

    /* Drop a completed op. Returns false (and keeps it) while ZeroMQ still reads its tensor: the
     * caller keeps the tensor alive and asks again later. */
    bool forget(int64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = ops_.find(id);
        if (it == ops_.end()) return true;
        if (!it->second->done.load() || it->second->zero_copy.load() > 0) return false;
        delete it->second;
        ops_.erase(it);
        return true;
    }

    void forwarded(std::vector<BpsForward> *out) {
        std::lock_guard<std::mutex> lock(mu_);
        out->assign(std::make_move_iterator(forward_.begin()), std::make_move_iterator(forward_.end()));
        forward_.clear();
    }

    void released(std::vector<int64_t> *out) {
        std::lock_guard<std::mutex> lock(zc_mu_);
        out->swap(released_);
    }

    uint64_t bytes_sent(int server) { return server < (int)sent_.size() ? sent_[server].load() : 0; }
    uint64_t bytes_received(int server) { return server < (int)received_.size() ? received_[server].load() : 0; }
    int64_t in_flight_bytes() { return in_flight_; }

    /* ZeroMQ's I/O thread is done with a zero-copy body. */
    static void zc_free(void *, void *hint) {
        BpsZcHint *h = (BpsZcHint *)hint;
        if (h->op != nullptr) {
            h->op->zero_copy.fetch_sub(1);
        } else {
            std::lock_guard<std::mutex> lock(h->core->zc_mu_);
            h->core->released_.push_back(h->token);
        }
        delete h;
    }

  private:
    void wake() {
        uint64_t one = 1;
        ssize_t rc = write(wake_fd_, &one, sizeof one);
        (void)rc;
    }

    void notify_python() {
        unsigned char x = 'x';
        ssize_t rc = write(notify_fd_, &x, 1); /* a full pipe means Python is awake anyway */
        (void)rc;
    }

    void run() {
        prctl(PR_SET_NAME, "byteps-net", 0, 0, 0);
        std::vector<bps_zmq_pollitem> items(socks_.size() + 1);
        for (size_t i = 0; i < socks_.size(); ++i) items[i] = bps_zmq_pollitem{socks_[i], 0, BPS_ZMQ_POLLIN, 0};
        items[socks_.size()] = bps_zmq_pollitem{nullptr, wake_fd_, BPS_ZMQ_POLLIN, 0};
        BpsMessage msg;
        double next_check = 0;
        while (!stopping_) {
            int rc = bps_zmq.poll(items.data(), (int)items.size(), 100);
            if (rc < 0 && bps_zmq.errno_() != EINTR) break; /* the context was terminated */
            if (items[socks_.size()].revents) {
                uint64_t n;
                ssize_t got = read(wake_fd_, &n, sizeof n);
                (void)got;
            }
            take_inbox();
            for (size_t i = 0; i < socks_.size(); ++i) {
                if (!items[i].revents) continue;
                for (int k = 0; k < 256; ++k) { /* drain, bounded so the others get a turn */
                    int got = bps_recv_message(socks_[i], &msg);
                    if (got <= 0) break;
                    on_message((int)i, &msg);
                }
            }
            send_ready();
            double now = bps_now();
            if (now >= next_check) {
                check_timeouts(now);
                next_check = now + 0.1;
            }
            flush_completions();
        }
    }

    void take_inbox() {
        std::vector<BpsQueued> in;
        std::vector<std::unique_ptr<BpsRawSend>> raw;
        bool abort;
        {
            std::lock_guard<std::mutex> lock(mu_);
            in.swap(inbox_);
            raw.swap(raw_);
            abort = abort_;
        }
        for (auto &q : in) {
            q.seq = seq_++;
            queue_.push(q);
        }
        for (auto &m : raw) send_raw_now(m.get());
        if (abort) {
            while (!queue_.empty()) queue_.pop();
            std::vector<BpsOp *> all;
            {
                std::lock_guard<std::mutex> lock(mu_);
                for (auto &kv : ops_) all.push_back(kv.second);
            }
            for (BpsOp *op : all) {
                if (!op->done.load()) fail(op, BPS_ERR_ABORT, "");
            }
            pending_.clear();
            in_flight_ = 0;
            priorities_.clear();
        }
    }

    void send_raw_now(BpsRawSend *m) {
        void *sock = socks_[m->server];
        int rc = bps_send_copy(sock, m->header.data(), m->header.size(), true);
        size_t n = m->body.size();
        if (rc == 0 && m->zc_data != nullptr) {
            n = m->zc_len;
            BpsZcHint *h = new BpsZcHint{this, nullptr, m->token};
            rc = bps_send_zero_copy(sock, m->zc_data, m->zc_len, false, &BpsWorkerCore::zc_free, h);
        } else if (rc == 0) {
            rc = bps_send_copy(sock, m->body.data(), m->body.size(), false);
        } else if (m->zc_data != nullptr) {
            std::lock_guard<std::mutex> lock(zc_mu_);
            released_.push_back(m->token);
        }
        (void)n; /* Python counts its own messages (Engine.bytes_sent) */
    }

    bool fits(const BpsQueued &q) const {
        int64_t nbytes = (int64_t)q.op->parts[q.part].length;
        if (credit_ <= 0) return true;
        // the credit counts bytes of this priority or a more urgent one: bytes of less urgent
        // tensors, which other workers may have deferred for this one, never hold it back (see
        // core/bps_queue.h)
        int64_t ahead = 0;
        for (auto it = priorities_.lower_bound(q.priority); it != priorities_.end(); ++it) ahead += it->second;
        return ahead == 0 || ahead + nbytes <= credit_;
    }

    void send_ready() {
        while (!queue_.empty() && fits(queue_.top())) {
            BpsQueued q = queue_.top();
            queue_.pop();
            BpsOp *op = q.op;
            if (op->done.load()) continue;
            push(op, q.part);
        }
    }

    /* STAGE (colocated) and PUSH of one partition. */
    void push(BpsOp *op, int index) {
        BpsPart &p = op->parts[index];
        uint64_t rnd = next_round(p.key);
        bool empty = op->cmd == BPS_CMD_BROADCAST && !op->root_self;
        uint8_t flags = 0;
        const unsigned char *data = op->buf + p.offset;
        if (p.staging != nullptr && !empty) {
            memcpy(p.staging, data, p.length);
            flags = BPS_FLAG_SHM;
        }
        uint64_t body_len = empty ? 0 : (flags ? BPS_DESCRIPTOR_SIZE : p.length);
        BpsHeader h = bps_header(op->cmd, node_id_, p.key, rnd, flags ? p.length : body_len, op->dtype,
                                 op->root, flags);
        void *sock = socks_[p.server];
        int rc = bps_send_copy(sock, &h, sizeof h, true);
        if (rc == 0) {
            if (flags) {
                rc = bps_send_copy(sock, &p.desc, sizeof p.desc, false);
            } else if (body_len < 65536) {
                rc = bps_send_copy(sock, data, body_len, false);
            } else { /* zero-copy from the tensor: ZeroMQ reads it while it is on the wire */
                op->zero_copy.fetch_add(1);
                BpsZcHint *hint = new BpsZcHint{this, op, -1};
                rc = bps_send_zero_copy(sock, (void *)data, body_len, false, &BpsWorkerCore::zc_free, hint);
            }
        }
        if (rc != 0) {
            fail(op, BPS_ERR_PROTOCOL, std::string("tensor '") + op->name + "': sending to server " +
                                           std::to_string(p.server) + " failed: " + strerror(errno));
            return;
        }
        sent_[p.server] += sizeof h + body_len;
        pending_[std::make_pair(p.key, rnd)] = std::make_pair(op, index);
        op->owed[p.server]++;
        in_flight_ += p.length;
        if (credit_ > 0) priorities_[op->priority] += p.length;
    }

    void release(BpsOp *op, int index) {
        in_flight_ -= op->parts[index].length;
        if (in_flight_ < 0) in_flight_ = 0;
        auto it = priorities_.find(op->priority);
        if (it != priorities_.end() && (it->second -= op->parts[index].length) <= 0) priorities_.erase(it);
    }

    void forward(int server, BpsMessage *m) {
        BpsForward f;
        f.server = server;
        for (int i = 0; i < m->count; ++i) f.frames.emplace_back((const char *)m->data(i), m->size(i));
        {
            std::lock_guard<std::mutex> lock(mu_);
            forward_.push_back(std::move(f));
        }
        notify_python();
    }

    /* PULL: a message from server ``server``. */
    void on_message(int server, BpsMessage *m) {
        BpsHeader h;
        if (m->count < 1 || !bps_parse_header(m->data(0), m->size(0), &h)) {
            forward(server, m); /* Python logs malformed replies */
            return;
        }
        auto it = pending_.find(std::make_pair(h.key, h.round));
        if (it == pending_.end()) {
            forward(server, m); /* Python's partition, or an op that failed already */
            return;
        }
        BpsOp *op = it->second.first;
        int index = it->second.second;
        pending_.erase(it);
        release(op, index);
        BpsPart &p = op->parts[index];
        op->owed[server]--;
        received_[server] += m->size(0) + (m->count > 1 ? m->size(1) : 0);
        if (op->done.load()) return;
        if (h.cmd == BPS_CMD_REPLY) {
            receive(op, p, server, h, m);
        } else if (h.cmd == BPS_CMD_ERROR) {
            std::string body = m->count > 1 ? std::string((const char *)m->data(1), m->size(1)) : "{}";
            set_error(op, BPS_ERR_SERVER, body);
        } else {
            set_error(op, BPS_ERR_PROTOCOL, "unexpected command " + std::to_string(h.cmd) + " from server " +
                                                std::to_string(server));
        }
        if (--op->parts_left == 0) complete(op);
    }

    void receive(BpsOp *op, BpsPart &p, int server, const BpsHeader &h, BpsMessage *m) {
        uint64_t expect = op->root_self ? 0 : p.length;
        unsigned char *dst = op->buf + p.offset;
        std::string who = "tensor '" + op->name + "': server " + std::to_string(server);
        if (m->count < 2) {
            set_error(op, BPS_ERR_PROTOCOL, who + " replied without a body");
            return;
        }
        if (h.flags & BPS_FLAG_COMPRESSED) {
            set_error(op, BPS_ERR_PROTOCOL, who + " replied compressed to an uncompressed push");
            return;
        }
        if (h.flags & BPS_FLAG_SHM) {
            unsigned char *src;
            uint64_t len;
            std::string err;
            if (maps_.view(m->data(1), m->size(1), &src, &len, &err) != 0) {
                set_error(op, BPS_ERR_PROTOCOL, err);
                return;
            }
            if (len != expect) {
                set_error(op, BPS_ERR_PROTOCOL, who + " replied " + std::to_string(len) + " bytes for a partition of " +
                                                    std::to_string(expect));
                return;
            }
            /* a lone pushing machine gets its own region back: the sum is what the tensor holds */
            if (p.staging != nullptr && src == p.staging) return;
            memcpy(dst, src, len);
            return;
        }
        size_t got = m->size(1);
        if (got != expect) {
            set_error(op, BPS_ERR_PROTOCOL, who + " replied " + std::to_string(got) + " bytes for a partition of " +
                                                std::to_string(expect));
            return;
        }
        if (got) memcpy(dst, m->data(1), got);
    }

    void set_error(BpsOp *op, int kind, const std::string &text) {
        if (op->error_kind == BPS_OK) {
            op->error_kind = kind;
            op->error = text;
        }
    }

    /* Fail an op now: its partitions still queued are dropped, replies still owed are ignored. */
    void fail(BpsOp *op, int kind, const std::string &text) {
        set_error(op, kind, text);
        for (auto it = pending_.begin(); it != pending_.end();) {
            if (it->second.first == op) {
                release(op, it->second.second);
                it = pending_.erase(it);
            } else {
                ++it;
            }
        }
        complete(op);
    }

    void complete(BpsOp *op) {
        op->parts_left = 0;
        {
            std::lock_guard<std::mutex> lock(mu_);
            op->done.store(true);
            /* A caller blocked in wait_op() sees the op done under this same mutex and delivers it
             * itself, so the completion thread is not told about it: the two would only contend for
             * the GIL over one op. A waiter that timed out first has left (waiters == 0). */
            if (op->waiters == 0) completed_.push_back(op->id);
        }
        have_done_ = true;
    }

    void flush_completions() {
        if (!have_done_) return;
        have_done_ = false;
        done_cv_.notify_all();
        uint64_t one = 1;
        ssize_t rc = write(done_fd_, &one, sizeof one);
        (void)rc;
    }

    void check_timeouts(double now) {
        std::vector<BpsOp *> late;
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (auto &kv : ops_) {
                BpsOp *op = kv.second;
                if (!op->done.load() && now - op->started > timeout_) late.push_back(op);
            }
        }
        for (BpsOp *op : late) {
            std::string who;
            for (auto &kv : op->owed) {
                if (kv.second <= 0) continue;
                if (!who.empty()) who += ", ";
                who += "server " + std::to_string(kv.first);
            }
            if (who.empty()) who = "its turn to be sent";
            char secs[32];
            snprintf(secs, sizeof secs, "%.0f", now - op->started);
            fail(op, BPS_ERR_TIMEOUT, std::string(secs) + "|" + who);
        }
    }

    uint32_t node_id_;
    int64_t credit_;
    double timeout_;
    int nthreads_;
    int notify_fd_;
    int wake_fd_, done_fd_;
    std::vector<void *> socks_;
    std::deque<std::atomic<uint64_t>> sent_, received_;
    std::thread thread_;
    std::atomic<bool> stopping_{false};

    std::mutex mu_; /* guards everything Python touches below */
    std::condition_variable done_cv_;
    std::unordered_map<int64_t, BpsOp *> ops_;
    std::deque<BpsTable> tables_;
    std::vector<BpsQueued> inbox_;
    std::vector<std::unique_ptr<BpsRawSend>> raw_;
    std::vector<int64_t> completed_;
    std::vector<BpsForward> forward_;
    bool abort_ = false;

    std::mutex rounds_mu_;
    std::unordered_map<uint64_t, uint64_t> rounds_;

    std::mutex zc_mu_;
    std::vector<int64_t> released_;

    /* network-thread state */
    std::priority_queue<BpsQueued, std::vector<BpsQueued>, BpsQueuedOrder> queue_;
    uint64_t seq_ = 0;
    std::map<std::pair<uint64_t, uint64_t>, std::pair<BpsOp *, int>> pending_;
    std::atomic<int64_t> in_flight_{0};
    std::map<int64_t, int64_t> priorities_;  // priority -> bytes in flight (only with a credit)
    BpsPeerMaps maps_;
    bool have_done_ = false;
};

#endif
