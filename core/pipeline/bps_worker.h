/* The worker's native data plane: one thread that sends partitions and takes replies without the GIL.
 *
 * core/engine.py (Python) keeps what is per tensor or rare: declarations, the control plane,
 * authentication, join(), compression, the topology executor.
 * Once a tensor's key is known, a plain push_pull or broadcast is handed over whole with
 * BpsWorkerCore::submit() (on the caller's thread, under a mutex; no Python object crosses). From then
 * on, the network thread ("byteps-net") follows each partition through its stages in one place:
 *
 *     queued (priority, credit)  ->  [STAGE: copy into shared memory, colocated server]
 *       ->  PUSH (header + body zero-copy from the tensor, or a 32-byte descriptor)
 *       ->  PULL (REPLY: copy into the tensor from ZeroMQ's buffer or the server's shared store)
 *       ->  op complete (completion queue + eventfd; Python's completion thread sets the event)
 *
 * On a machine with L > 1 worker processes a push_pull partition instead goes through the local
 * reduce of core/local.py (same protocol and wire messages; see "Local reduce" below):
 *
 *   owner (LocalPlan: local rank (t + i) % L, or 0):
 *     LOCAL_REDUCE: wait for the L-1 LOCAL_READYs, sum the L copies into our shared region (on the
 *       stage thread "byteps-reduce" by priority when >= 256 KB, else inline)
 *       ->  PUSH of the region (queued by priority within the credit, like any partition) -> PULL
 *       ->  LOCAL_BROADCAST: LOCAL_DONE (descriptor of our region or the server's store) or ERROR
 *           to every other local rank; copy the result into our tensor
 *   other local ranks:
 *     COORDINATE: copy into our shared region, LOCAL_READY (its descriptor) to the owner
 *       ->  LOCAL_DONE from the owner: copy the result into the tensor  (ERROR: the op fails)
 *
 * The local ROUTER (LOCAL_READY / LOCAL_DONE from the others) and DEALERs (to them) are handed over
 * after Python authenticated them; the handshakes of late peers still reach Python (forwarded).
 * Local links (BYTEPS_LOCAL_LINKS=1): a direct TCP link (BpsLink on 127.0.0.1) per other local rank,
 * opened by Python after that handshake (core/engine.py _open_local_links: a one-time token offered over
 * the authenticated ZeroMQ plane) and handed over with add_local_link. send_local() uses it while it
 * works, else the DEALER; what comes in on it is taken as if it came on the ROUTER from that peer's
 * DEALER identity, so the messages Python gets (forwarded) look the same either way.
 *
 * Python's own partitions (the slow paths above) still go through this thread's sockets: it sends
 * what Python queues with send_raw() and forwards every message it does not own (an unknown
 * (key, round), a compressed reply, ...) to Python's queue, waking the engine through its pipe.
 * Rounds of every wire key are counted here, for both paths.
 *
 * Transport seam (core/transport/bps_link.h): a message to a server is a BpsFrames, sent by send_server()
 * over the server's direct TCP link (BpsLink, once Python set one up: add_link) or its ZeroMQ DEALER;
 * for a colocated server the body is a shared-memory descriptor (core/transport/bps_wire.h). Replies come back
 * on either, whole, as a BpsMessage. A link is a BpsConn: a TCP socket (BpsLink) or a UCX endpoint
 * (BpsUcxLink, core/transport/bps_ucx.h: BYTEPS_TRANSPORT=ucx), both polled in run() like the sockets.
 */
#ifndef BPS_WORKER_H
#define BPS_WORKER_H

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
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

#include "core/pipeline/bps_queue.h"
#include "core/pipeline/bps_trace.h"
#include "core/kernels/bps_reduce.h"
#include "core/transport/bps_link.h"
#include "core/transport/bps_ucx.h"
#include "core/transport/bps_wire.h"
#include "core/transport/bps_zmq.h"

#include <set>

enum BpsErrorKind {
    BPS_OK = 0,
    BPS_ERR_SERVER = 1,    /* the server answered ERROR: detail is its JSON body */
    BPS_ERR_PROTOCOL = 2,  /* a reply that does not fit the partition */
    BPS_ERR_TIMEOUT = 3,   /* BYTEPS_TIMEOUT */
    BPS_ERR_ABORT = 4,     /* the engine failed (peer lost, ...): Python's failure stands */
};

/* Partitions at least this large are summed / copied on the stage thread, smaller ones inline (the
 * hand-off costs more than the work): core/engine.py STAGE_THREAD_MIN_BYTES. */
static const uint64_t BPS_STAGE_THREAD_MIN_BYTES = 256 << 10;

/* A synchronous call of one partition up to this size may run its round trip on the caller's thread
 * (submit_direct); the hand-offs it saves matter only while the bytes take less time than they. */
static const uint64_t BPS_DIRECT_MAX_BYTES = 64 << 10;
/* How long a direct caller waits for its reply before byteps-net takes the partition over: short, so
 * that other threads' messages to that server are never held back for long. */
static const double BPS_DIRECT_WINDOW_S = 0.005;

/* A lazy op's completion (submit_table) waits this long for its caller to take it (synchronize() on
 * the caller's thread; poll() only reads the flag) before the completion thread delivers it: a
 * completion thread that takes the GIL for ops nobody listens to yet takes it from a training thread
 * that runs Python (bench/bench_gil.py). An op gets a listener (a done callback) through prompt(). */
static const double BPS_LAZY_DELIVERY_S = 0.05;

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
    unsigned char *staging; /* shared region for a colocated server (local reduce: always), or NULL */
    BpsDescriptor desc;     /* its descriptor (length filled in) */
    int32_t owner = -1;     /* local reduce: the local rank that sums and pushes it; -1: none */
    bool colocated = false; /* local reduce: the owner pushes a descriptor of ``staging`` */
    uint64_t rnd = 0;       /* its round: taken when the op starts (local reduce) or at its first push */
    bool has_rnd = false;   /* rnd is set: a push to a lost server's replacement keeps it (elastic servers) */
    uint64_t trace_t = 0;   /* timeline: when its current stage began (0: not traced) */
    uint64_t qseq = 0;      /* its place in the send queue: a lost server's partitions go back in it */
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
    std::map<int, int> owed_local; /* local rank -> LOCAL_DONEs still owed by that owner */
    bool local = false;     /* a push_pull through the machine's local reduce */
    std::atomic<int> tasks{0}; /* stage-thread tasks still reading or writing its memory */
    std::atomic<int> zero_copy{0}; /* bodies ZeroMQ still reads from the tensor */
    std::atomic<bool> done{false};
    std::atomic<bool> direct{false}; /* its caller runs it (submit_direct): byteps-net leaves it alone */
    int waiters = 0;        /* callers blocked in wait_op(): the first to wake delivers the op */
    bool lazy = false;      /* (under mu_) its completion waits in deferred_ for its caller (BPS_LAZY_DELIVERY_S) */
    int64_t table = -1;     /* the table it was submitted on, and its sequence number there: which */
    uint64_t seq = 0;       /* membership's partitions it uses (elastic servers, BpsTable::parts_for) */
    uint32_t divisor = 1;   /* an averaged float push_pull: each partition's sum is divided by this on its
                             * way into the tensor (bps_result_into), so the average costs no pass of its own */
};

/* A partition's sum into the tensor at ``dst``: copied, or divided by the op's divisor on the way (an
 * average). ``stream``: a copy of 1 MB or more uses non-temporal stores (bps_copy_streamed). */
static inline void bps_result_into(const BpsOp *op, void *dst, const void *src, size_t nbytes, bool stream,
                                   int nthreads = 1) {
    if (op->divisor > 1)
        bps_divide_copy(dst, src, nbytes / (size_t)bps_itemsize(op->dtype), op->dtype, op->divisor);
    else if (stream)
        bps_copy_streamed(dst, src, nbytes, nthreads);
    else
        memcpy(dst, src, nbytes);
}

/* A tensor's partitions, registered once (BpsWorkerCore::add_table) and copied into each op.
 *
 * Elastic servers (docs/elastic.md): each change of the server set appends the partitions of the new
 * membership, to be used from op number ``from`` on; every worker gets the same cut from the
 * scheduler, so the n-th op of a tensor uses the same partitions (and servers) on every worker. */
struct BpsTable {
    std::string name;
    std::vector<BpsPart> parts;
    bool local = false;     /* partitions have owners: the local reduce */
    uint64_t count = 0;     /* ops submitted on it so far */
    std::vector<std::pair<uint64_t, std::vector<BpsPart>>> later; /* (from op number, partitions) */

    const std::vector<BpsPart> &parts_for(uint64_t seq) const {
        const std::vector<BpsPart> *use = &parts;
        for (auto &seg : later)
            if (seq >= seg.first) use = &seg.second;
        return *use;
    }
};

/* Elastic servers: the server that takes over a lost server's partition, the same on every worker
 * (``alive``: the servers of the new membership, in the scheduler's order). */
static inline int bps_replacement(const std::vector<int> &alive, uint64_t key) {
    uint64_t x = key + 0x9E3779B97F4A7C15ull; /* splitmix64 */
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return alive.empty() ? -1 : alive[(size_t)(x % alive.size())];
}

/* Elastic servers: a key's latest result and the server it came from (BpsWorkerCore::retain). */
struct BpsRetained {
    uint64_t round = 0;
    int server = -1;
    uint8_t dtype = 0;
    std::string data;
};

/* Servers a worker can have over a job's life (elastic servers join and leave). */
static const int BPS_MAX_SERVERS = 256;

/* Work for the stage thread: a sum of a machine's copies (LOCAL_REDUCE) or a big copy in or out of
 * shared memory; run by priority (then arrival), like the network queue. */
enum BpsTaskKind { BPS_TASK_SUM = 0, BPS_TASK_COPY_IN = 1, BPS_TASK_COPY_OUT = 2 };

struct BpsStageTask {
    int64_t priority;
    uint64_t seq;
    int kind;
    BpsOp *op;
    int part;
    void *dst;
    std::vector<const void *> srcs;
    uint64_t nbytes;
    int dtype;
    int rc;
};


static inline int bps_run_task(BpsStageTask &t, int nthreads) {
    uint64_t t0 = bps_span_start();
    const BpsPart &p = t.op->parts[t.part];
    if (t.kind == BPS_TASK_SUM) {
        int isz = bps_itemsize(t.dtype);
        if (isz <= 0 || t.nbytes % (uint64_t)isz) return -1;
        int rc = bps_sum_many(t.dst, t.srcs.data(), (int)t.srcs.size(), t.nbytes / isz, t.dtype, nthreads);
        bps_span(BPS_TRACE_LOCAL_REDUCE, t0, p.key, p.rnd, t.nbytes, p.server, t.priority);
        return rc;
    }
    if (t.kind == BPS_TASK_COPY_OUT)
        bps_result_into(t.op, t.dst, t.srcs[0], t.nbytes, true, nthreads);
    else
        bps_copy_streamed(t.dst, t.srcs[0], t.nbytes, nthreads);
    bps_span(t.kind == BPS_TASK_COPY_IN ? BPS_TRACE_STAGE : BPS_TRACE_LOCAL_BROADCAST, t0, p.key, p.rnd, t.nbytes,
             p.server, t.priority);
    return 0;
}

/* The stage thread ("byteps-reduce"): one priority queue, sleeping on a condition variable between
 * tasks; results go back to the network thread through ``done`` and its wake eventfd. */
class BpsStageThread {
  public:
    BpsStageThread(int nthreads, int wake_fd) : nthreads_(nthreads), wake_fd_(wake_fd) {}
    ~BpsStageThread() { stop(); }

    void start() { thread_ = std::thread([this] { run(); }); }

    void stop() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (!thread_.joinable()) return;
            stopping_ = true;
        }
        cv_.notify_all();
        thread_.join();
    }

    void submit(BpsStageTask t) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            t.seq = seq_++;
            queue_.push(std::move(t));
        }
        cv_.notify_one();
    }

    void done(std::vector<BpsStageTask> *out) {
        std::lock_guard<std::mutex> lock(mu_);
        out->swap(done_);
    }

  private:
    void run() {
        prctl(PR_SET_NAME, "byteps-reduce", 0, 0, 0);
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
            if (stopping_) return;
            BpsStageTask t = queue_.top();
            queue_.pop();
            lock.unlock();
            t.rc = bps_run_task(t, nthreads_);
            lock.lock();
            done_.push_back(std::move(t));
            uint64_t one = 1;
            ssize_t rc = write(wake_fd_, &one, sizeof one);
            (void)rc;
        }
    }

    int nthreads_;
    int wake_fd_;
    std::thread thread_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool stopping_ = false;
    uint64_t seq_ = 0;
    std::priority_queue<BpsStageTask, std::vector<BpsStageTask>, BpsByPriority<BpsStageTask>> queue_;
    std::vector<BpsStageTask> done_;
};

/* The JSON body of an ERROR for the other local ranks: {"error": text} (core/wire.py encode). */
static inline std::string bps_json_escape(const std::string &text) {
    std::string out;
    for (unsigned char c : text) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += (char)c;
        } else if (c < 0x20) {
            char buf[8];
            snprintf(buf, sizeof buf, "\\u%04x", c);
            out += buf;
        } else {
            out += (char)c;
        }
    }
    return out;
}

static inline std::string bps_json_error(const std::string &text) {
    return "{\"error\":\"" + bps_json_escape(text) + "\"}";
}

/* The "error" string of a server's JSON ERROR body, still JSON-escaped ("" if there is none). */
static inline std::string bps_json_error_field(const std::string &body) {
    size_t at = body.find("\"error\"");
    if (at == std::string::npos) return "";
    at = body.find('"', body.find(':', at) + 1);
    if (at == std::string::npos) return "";
    size_t end = at + 1;
    while (end < body.size() && body[end] != '"') end += body[end] == '\\' ? 2 : 1;
    return end < body.size() ? body.substr(at + 1, end - at - 1) : "";
}

struct BpsQueued {
    int64_t priority;
    uint64_t seq;
    BpsOp *op;
    int part;
    uint64_t tie = 0; /* in the send queue: the partition's wire key (core/pipeline/bps_queue.h says why) */
};


/* A message Python queued for a server (slow paths): copied header and body, or a zero-copy body
 * that Python keeps alive until its token shows up in released(). */
struct BpsRawSend {
    int server;             /* >= 0: a server; BPS_TO_ROUTER: our local ROUTER (to ``ident``); <= -2: local rank -2-n */
    std::string ident;
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

static const int BPS_TO_ROUTER = -1;

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
        /* Per-server state is sized once: a server that joins mid-job (elastic) never moves what other
         * threads (direct callers, stats) are reading. */
        socks_.reserve(BPS_MAX_SERVERS);
        links_.resize(BPS_MAX_SERVERS);
        for (int i = 0; i < BPS_MAX_SERVERS; ++i) link_mu_.emplace_back(new std::mutex());
        direct_owned_.resize(BPS_MAX_SERVERS);
        sent_.resize(BPS_MAX_SERVERS);
        received_.resize(BPS_MAX_SERVERS);
        dead_.resize(BPS_MAX_SERVERS);
        colocated_.resize(BPS_MAX_SERVERS);
        reported_.resize(BPS_MAX_SERVERS, false);
    }

    ~BpsWorkerCore() {
        stop();
        if (stage_ != nullptr) delete stage_;
        for (auto &kv : ops_) delete kv.second;
        ::close(wake_fd_);
        ::close(done_fd_);
    }

    /* Python's side ------------------------------------------------------------------------ */

    /* Server number nservers()'s DEALER (before start(); add_server_live() after). False: too many. */
    bool add_server(void *sock) {
        if (socks_.size() >= (size_t)BPS_MAX_SERVERS) return false;
        socks_.push_back(sock);
        nservers_.store((int)socks_.size());
        return true;
    }

    /* A server that joined the running job (elastic): its authenticated DEALER and, if it has one, its
     * direct TCP link (fd, else -1). byteps-net adopts both at its next turn, as server nservers(). */
    bool add_server_live(void *sock, int fd) {
        std::lock_guard<std::mutex> lock(mu_);
        if (nservers_.load() + (int)new_servers_.size() >= BPS_MAX_SERVERS) return false;
        new_servers_.push_back(std::make_pair(sock, fd));
        wake();
        return true;
    }

    int nservers() const { return nservers_.load(); }

    /* Whether server ``server`` is on this machine (its partitions may go through shared memory). */
    void set_colocated(int server, bool on) {
        if (server >= 0 && server < BPS_MAX_SERVERS) colocated_[(size_t)server].store(on);
    }

    /* BYTEPS_ELASTIC=1 (before start()): keep each key's latest result for a lost server's replacement. */
    void set_elastic(bool on) { retain_ = on; }

    /* The job has one worker machine (before start()): its local reduce is the whole sum, so an owner
     * broadcasts it at once instead of a round trip through a server (core/stages.py, "one machine"). */
    void set_lone_machine(bool on) { lone_machine_ = on; }

    /* RESULTs sent to lost servers' replacements (tests check the path ran). */
    uint64_t results_sent() const { return results_sent_.load(); }

    /* Elastic servers, step 1 (the scheduler's PREPARE): servers ``dead`` are gone. Ops submitted from
     * now on are held, not started; partitions owed by a dead server wait (stranded). Returns, per
     * table, how many ops were submitted on it: the scheduler makes the largest count of each tensor
     * over all workers the cut from which the new membership's partitions are used. */
    std::vector<uint64_t> hold(const std::vector<int> &dead) {
        std::vector<uint64_t> counts;
        {
            std::lock_guard<std::mutex> lock(mu_);
            holding_ = true;
            holds_.fetch_add(1); /* before any server reads as dead: see awaiting_commit() */
            for (int d : dead)
                if (d >= 0 && d < BPS_MAX_SERVERS) dead_[(size_t)d].store(true);
            dead_in_ = true;
            for (auto &t : tables_) counts.push_back(t.count);
        }
        wake();
        return counts;
    }

    /* Elastic servers, step 2 (COMMIT): table ``tables[i]`` uses ``segs[i]`` from op number ``from[i]``
     * on; a dead server's partitions (stranded, queued, or in later ops of an older membership) go to
     * bps_replacement(alive, key) with their round kept; held ops start. */
    void commit(const std::vector<int> &alive, const std::vector<int64_t> &tables, const std::vector<uint64_t> &from,
                std::vector<std::vector<BpsPart>> segs) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            alive_ = alive;
            std::set<int> dead;
            for (int i = 0; i < BPS_MAX_SERVERS; ++i)
                if (dead_[(size_t)i].load()) dead.insert(i);
            reroutes_.push_back(std::make_pair(dead, alive));
            for (auto &t : tables_) {
                reroute(t.parts, dead, alive);
                for (auto &seg : t.later) reroute(seg.second, dead, alive);
            }
            for (size_t i = 0; i < tables.size(); ++i)
                tables_.at((size_t)tables[i]).later.push_back(std::make_pair(from[i], std::move(segs[i])));
            holding_ = false;
            commit_in_ = true;
            commits_++;
            for (BpsOp *op : held_) {
                if (op->done.load()) continue; /* failed meanwhile (the engine failed) */
                op->parts = tables_.at((size_t)op->table).parts_for(op->seq);
                op->parts_left = (int)op->parts.size();
                for (size_t i = 0; i < op->parts.size(); ++i) inbox_.push_back(BpsQueued{op->priority, 0, op, (int)i});
            }
            held_.clear();
        }
        wake();
    }

    /* A table registered after servers changed (mu_ held): the partitions of membership ``members``
     * used from op number ``from`` on (core/engine.py replays the job's memberships for it). */
    void add_segment(int64_t table, uint64_t from, std::vector<BpsPart> parts) {
        std::lock_guard<std::mutex> lock(mu_);
        replay_reroutes(parts);
        tables_.at((size_t)table).later.push_back(std::make_pair(from, std::move(parts)));
    }

    /* commit()'s rerouting: partitions of servers dead by then go to their replacements in that
     * membership. Every change is kept and replayed on tables registered later, so that every worker's
     * n-th op of a tensor uses the same servers however late it first used the tensor (mu_ held). */
    void reroute(std::vector<BpsPart> &parts, const std::set<int> &dead, const std::vector<int> &alive) {
        for (auto &p : parts)
            if (dead.count(p.server)) move_part(p, bps_replacement(alive, p.key));
    }

    /* A partition goes to server ``to`` instead: through shared memory only if ``to`` is on this machine. */
    void move_part(BpsPart &p, int to) {
        p.server = to;
        bool shared = to >= 0 && colocated_[(size_t)to].load();
        if (p.owner >= 0) p.colocated = shared; /* local reduce: the owner's region, as a descriptor or bytes */
        else if (!shared) p.staging = nullptr;  /* the bytes go from the tensor */
    }

    void replay_reroutes(std::vector<BpsPart> &parts) {
        for (auto &r : reroutes_) reroute(parts, r.first, r.second);
    }

    /* Servers whose direct link broke since the last call (Python tells the scheduler: elastic servers). */
    void lost_links(std::vector<int> *out) {
        std::lock_guard<std::mutex> lock(mu_);
        out->swap(lost_);
        lost_.clear();
    }

    /* A direct TCP link to server ``server`` (before start()): a connected socket whose token the server
     * accepted (core/engine.py _open_links). This thread owns and closes it; ZeroMQ stays the fallback. */
    void add_link(int server, int fd) { links_.at((size_t)server).reset(new BpsLink(fd)); }

    /* A UCX endpoint to server ``server``'s listener at host:port (before start()), admitted by the
     * one-time ``token`` Python got for ``ident``: "" once it is up, else why not (ZeroMQ stays). */
    std::string add_ucx_link(int server, const std::string &host, int port, const std::string &token,
                             const std::string &ident, double timeout) {
        std::string why;
        if (!ucx_) ucx_.reset(BpsUcxWorker::create(&why));
        if (!ucx_) return why;
        BpsHeader h = bps_header(BPS_CMD_LINK, node_id_, 0, 0, token.size() + ident.size(), BPS_NO_DTYPE, 0, 0);
        BpsUcxLink *l = ucx_->connect(host, port, std::string((const char *)&h, sizeof h), token + ident, timeout, &why);
        if (l != nullptr) links_.at((size_t)server).reset(l);
        return why;
    }

    /* Which transports server ``server``'s link uses: "tcp", "ucx: tcp/lo, ..." ("" without a link). */
    std::string link_transport(int server) {
        std::unique_lock<std::mutex> ucx_lock(ucx_mu_, std::defer_lock); /* ucp_ep_query: the worker's user */
        if (ucx_) ucx_lock.lock();
        BpsConn *l = links_.at((size_t)server).get();
        if (l == nullptr) return "";
        if (std::string(l->kind()) != "ucx") return l->kind();
        return std::string("ucx: ") + ((BpsUcxLink *)l)->transports();
    }

    /* A synchronous call's fast path: the caller's thread sends its op's one partition on the server's
     * link and reads the reply itself, without the two thread hand-offs of the normal path (wake
     * byteps-net; byteps-net wakes the caller), when byteps-net has nothing in flight or queued and the
     * link is idle. Runs without the GIL. If the reply has not come within BPS_DIRECT_WINDOW_S, the
     * partition is handed to byteps-net as if it had sent it (adopted) and the caller waits as usual.
     * Messages for others that arrive meanwhile go to byteps-net in order. Returns false (nothing
     * done) when the fast path does not apply: the caller then submits as usual. */
    bool submit_direct(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority,
                       bool root_self, unsigned char *buf, uint64_t nbytes, uint32_t divisor = 1) {
        int server;
        BpsPart part;
        std::string name;
        uint64_t seq;
        bool local;
        {
            std::lock_guard<std::mutex> lock(mu_);
            const BpsTable &t = tables_.at((size_t)table);
            seq = t.count;
            const std::vector<BpsPart> &parts = t.parts_for(seq);
            if (parts.size() != 1 || holding_ || commit_in_) return false;
            local = t.local;
            part = parts[0];
            name = t.name;
        }
        if (local && part.owner == local_rank_)
            return submit_owner_direct(id, table, seq, part, name, cmd, dtype, root, priority, buf, nbytes, divisor);
        if (local)
            return submit_local_direct(id, table, seq, part, name, cmd, dtype, root, priority, buf, nbytes, divisor);
        server = part.server;
        if (part.length > BPS_DIRECT_MAX_BYTES || server < 0 || server >= nservers_.load() || !links_[(size_t)server] ||
            dead_[(size_t)server].load())
            return false;
        /* A UCX endpoint is driven by its thread's UCP worker, which every endpoint shares: the caller
         * takes the whole worker (ucx_mu_, which byteps-net holds except while it sleeps in poll), then
         * the link, in the order byteps-net takes them. A TCP link needs only its own lock. */
        std::unique_lock<std::mutex> ucx_lock(ucx_mu_, std::defer_lock);
        if (ucx_) ucx_lock.lock();
        std::unique_lock<std::mutex> link_lock(*link_mu_[(size_t)server]);
        BpsConn *l = links_[(size_t)server].get();
        if (l == nullptr || (strcmp(l->kind(), "tcp") != 0 && !ucx_lock.owns_lock())) return false;
        if (l->dead() || l->wants_write() || l->pending_input()) return false;
        BpsOp *op = new_op(id, cmd, dtype, root, priority, root_self, buf, nbytes, divisor);
        op->name = name;
        op->parts.push_back(part);
        op->parts_left = 1;
        op->started = bps_now();
        op->direct.store(true);
        {
            std::lock_guard<std::mutex> lock(mu_);
            BpsTable &t = tables_.at((size_t)table);
            /* another thread submitted on this table meanwhile, or the servers are changing: the normal path */
            if (net_ops_ != 0 || !inbox_.empty() || !raw_.empty() || abort_ || stopping_ || holding_ || commit_in_ ||
                t.count != seq) {
                delete op;
                return false;
            }
            op->table = table;
            op->seq = t.count++;
            ops_[id] = op;
        }
        direct_owned_[(size_t)server].store(true);
        BpsPart &p = op->parts[0];
        uint64_t rnd = next_round(p.key);
        p.rnd = rnd;
        p.has_rnd = true;
        bool empty = cmd == BPS_CMD_BROADCAST && !root_self;
        uint64_t body_len = empty ? 0 : p.length;
        /* the bytes go inline even to a colocated server: for so few, a descriptor saves nothing */
        BpsHeader h = bps_header(cmd, node_id_, p.key, rnd, body_len, dtype, root, 0);
        BpsFrames f;
        f.copy(&h, sizeof h);
        f.copy(buf + p.offset, body_len);
        bool replied = false, strays = false;
        p.trace_t = bps_span_start(); /* PUSH: until the reply (direct_wait, or byteps-net if it adopts it) */
        if (l->send(f) == 0) {
            sent_[(size_t)server] += sizeof h + body_len;
            replied = direct_wait(op, server, l, rnd, &strays);
        } else {
            set_error(op, BPS_ERR_PROTOCOL, "tensor '" + name + "': sending to server " + std::to_string(server) +
                                                " failed: " + l->error());
            replied = true;
        }
        {
            std::lock_guard<std::mutex> lock(mu_);
            end_direct(op, replied, rnd, &adopt_in_); /* adopted: as if byteps-net had sent it */
        }
        direct_owned_[(size_t)server].store(false);
        bool more = l->pending_input() || l->dead(); /* UCX: other endpoints' messages came meanwhile */
        link_lock.unlock();
        if (ucx_lock.owns_lock()) ucx_lock.unlock();
        count_direct(replied, strays || more);
        return true;
    }

    /* A direct call's end (mu_ held): its caller delivers it (``replied``), or byteps-net takes it over
     * through ``adopt``. */
    void end_direct(BpsOp *op, bool replied, uint64_t rnd, std::vector<BpsQueued> *adopt) {
        op->direct.store(false);
        if (replied) {
            op->parts_left = 0;
            op->done.store(true); /* delivered by this caller: not a completion for byteps-net */
        } else {
            adopt->push_back(BpsQueued{op->priority, rnd, op, 0});
            net_ops_++;
        }
    }

    /* After a direct call let go of its link: byteps-net has work (``more``, or an adopted partition). */
    void count_direct(bool replied, bool more) {
        if (!replied || more) wake();
        if (replied) direct_calls_.fetch_add(1);
        else direct_adopted_.fetch_add(1);
    }

    /* A local link's message [identity, header, body] with a readable header (into ``h``). */
    static bool local_header(BpsMessage &msg, BpsHeader *h) {
        return msg.count == 3 && !msg.truncated && bps_parse_header(msg.data(1), msg.size(1), h);
    }

    /* A local message a direct caller read for someone else: byteps-net handles it, in arrival order. */
    void stray_local(BpsMessage &msg, bool *strays) {
        BpsMessage *keep = keep_message(msg);
        std::lock_guard<std::mutex> lock(mu_);
        local_strays_in_.push_back(keep);
        *strays = true;
    }

    /* A message a direct caller read for someone else, moved out of ``msg`` for byteps-net. */
    static BpsMessage *keep_message(BpsMessage &msg) {
        BpsMessage *keep = new BpsMessage();
        for (int i = 0; i < msg.count; ++i) msg.take(i, &keep->frames[i]);
        keep->count = msg.count;
        keep->truncated = msg.truncated;
        msg.count = 0;
        return keep;
    }

    /* How long a direct caller polls for its reply (yielding its core between polls) before it sleeps
     * (BYTEPS_SPIN_US). Waking a thread that sleeps in poll costs 25-30 us per hop on a VM, more than a
     * small round trip takes when both ends are awake (9 us for 4 KB over loopback on the 2-core VM,
     * against 57-58 us asleep: bench/raw_exchange.py --poll); sched_yield lets any thread that is ready
     * to run on this core go first. */
    void set_direct_spin(double seconds) { direct_spin_s_ = seconds > 0 ? seconds : 0; }

    /* A direct caller's sleep on its link until input (or room to write) or ``deadline``; false once
     * the deadline has passed. Before ``spin_until`` it only yields its core and returns, so that the
     * caller polls the link again. */
    static bool wait_link(BpsConn *l, double deadline, double spin_until) {
        if (l->wants_write()) l->flush();
        double now = bps_now(), left = deadline - now;
        if (left <= 0) return false;
        if (now < spin_until) {
            sched_yield();
            return true;
        }
        if (l->arm_to_sleep()) return true; /* input came while arming (UCX's wake-up fd, a ring's bell) */
        struct pollfd pfd = {l->fd(), (short)(POLLIN | (l->poll_for_write() ? POLLOUT : 0)), 0};
        struct timespec ts = {0, (long)(left * 1e9)};
        ppoll(&pfd, 1, &ts, nullptr);
        return true;
    }

    /* A direct local call's op (either side of the local reduce), registered with its round taken, or
     * NULL when byteps-net is busy, join() handed the local reduce to Python, the servers are changing or
     * another thread submitted on the table meanwhile. ``awaits_done``: a non-owner, whose LOCAL_DONE
     * byteps-net keeps if it reaches the ROUTER (local_direct_ids_). */
    BpsOp *begin_local_direct(int64_t id, int64_t table, uint64_t seq, const BpsPart &part, const std::string &name,
                              uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority, unsigned char *buf,
                              uint64_t nbytes, uint32_t divisor, bool awaits_done) {
        BpsOp *op = new_op(id, cmd, dtype, root, priority, false, buf, nbytes, divisor);
        op->name = name;
        op->local = true;
        op->parts.push_back(part);
        op->parts_left = 1;
        op->started = bps_now();
        op->direct.store(true);
        BpsPart &p = op->parts[0];
        std::lock_guard<std::mutex> lock(mu_);
        BpsTable &t = tables_.at((size_t)table);
        if (net_ops_ != 0 || !inbox_.empty() || !raw_.empty() || abort_ || stopping_ || holding_ || commit_in_ ||
            python_local_ || t.count != seq) {
            delete op;
            return nullptr;
        }
        op->table = table;
        op->seq = t.count++;
        ops_[id] = op;
        p.rnd = next_round(p.key);
        p.has_rnd = true;
        if (awaits_done) local_direct_ids_.insert(Ident(p.key, p.rnd));
        return op;
    }

    /* submit_direct for a partition of the machine's local reduce that another local rank owns (a
     * synchronous push_pull of one partition): the caller copies it into its shared region, sends
     * LOCAL_READY on the link to the owner and reads the owner's LOCAL_DONE itself, sparing the two
     * hand-offs between the caller and byteps-net. The owner's side is unchanged. Handed to byteps-net
     * (adopted) after BPS_DIRECT_WINDOW_S, as for a server; byteps-net keeps a LOCAL_DONE that reaches
     * it meanwhile (early_done_). False: the fast path does not apply. */
    bool submit_local_direct(int64_t id, int64_t table, uint64_t seq, const BpsPart &part, const std::string &name,
                             uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority, unsigned char *buf,
                             uint64_t nbytes, uint32_t divisor) {
        int owner = part.owner;
        if (cmd != BPS_CMD_PUSHPULL || owner < 0 || owner == local_rank_ || (size_t)owner >= local_links_.size() ||
            part.staging == nullptr || part.length > BPS_DIRECT_MAX_BYTES || part.offset + part.length > nbytes)
            return false;
        std::unique_lock<std::recursive_mutex> link_lock(*local_link_mu_[(size_t)owner]);
        BpsConn *l = live_local_link(owner);
        if (l == nullptr || strcmp(l->kind(), "ucx") == 0 || l->wants_write() || l->pending_input()) return false;
        BpsOp *op = begin_local_direct(id, table, seq, part, name, cmd, dtype, root, priority, buf, nbytes, divisor,
                                       true);
        if (op == nullptr) return false;
        BpsPart &p = op->parts[0];
        local_direct_owned_[(size_t)owner].store(true);
        memcpy(p.staging, buf + p.offset, p.length); /* COORDINATE: our copy into our shared region */
        BpsHeader h = bps_header(BPS_CMD_LOCAL_READY, node_id_, p.key, p.rnd, p.length, dtype, (uint32_t)local_rank_,
                                 BPS_FLAG_SHM);
        BpsFrames f;
        f.copy(&h, sizeof h);
        f.copy(&p.desc, sizeof p.desc);
        bool replied = false, strays = false;
        BpsPollingLinks polling({l}, direct_spin_s_ > 0); /* a ring: its bell waits until we stop polling */
        if (l->send(f) == 0) {
            local_link_sent_.fetch_add(1);
            local_coordinated_++;
            replied = local_direct_wait(op, owner, l, &strays);
        } else {
            set_error(op, BPS_ERR_PROTOCOL, "tensor '" + name + "': sending to local rank " + std::to_string(owner) +
                                                " failed: " + l->error());
            replied = true;
        }
        {
            std::lock_guard<std::mutex> lock(mu_);
            local_direct_ids_.erase(Ident(p.key, p.rnd));
            end_direct(op, replied, p.rnd, &local_adopt_in_); /* adopted: byteps-net waits for its LOCAL_DONE */
        }
        local_direct_owned_[(size_t)owner].store(false);
        polling.stop(); /* first: what comes after this rings a bell, what came before is pending_input */
        bool more = l->pending_input() || l->dead();
        link_lock.unlock();
        count_direct(replied, strays || more);
        return true;
    }

    /* submit_direct for a partition of the machine's local reduce that this process owns, on a machine
     * that is the whole job (its sum is the result: no server round trip). The caller takes the other
     * local ranks' copies itself (those that came first from byteps-net, which holds them in early_,
     * the rest from their links), sums them with its own into its shared region, sends each LOCAL_DONE
     * and copies the sum into the tensor: the whole LOCAL_REDUCE / LOCAL_BROADCAST / COPY_OUT of the
     * partition on its thread, without the two hand-offs to byteps-net and back. A copy still missing
     * after BPS_DIRECT_WINDOW_S (a late rank, one in join()), a broken link, or a copy that is not
     * readable hands the partition to byteps-net with the copies taken so far (take_direct), whose
     * checks, time-outs and error reports then apply. False: the fast path does not apply. */
    bool submit_owner_direct(int64_t id, int64_t table, uint64_t seq, const BpsPart &part, const std::string &name,
                             uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority, unsigned char *buf,
                             uint64_t nbytes, uint32_t divisor) {
        if (cmd != BPS_CMD_PUSHPULL || !lone_machine_ || local_size_ < 2 || local_size_ > 64 ||
            (size_t)local_size_ != local_links_.size() || part.staging == nullptr ||
            part.length > BPS_DIRECT_MAX_BYTES || part.offset + part.length > nbytes || joined_mask_.load() != 0)
            return false;
        /* every other local rank's link, or nothing: a direct caller of this process may hold one */
        std::vector<std::unique_lock<std::recursive_mutex>> link_locks;
        std::vector<int> peers;
        for (int r = 0; r < local_size_; ++r) {
            if (r == local_rank_) continue;
            std::unique_lock<std::recursive_mutex> lk(*local_link_mu_[(size_t)r], std::try_to_lock);
            BpsConn *l = lk ? live_local_link(r) : nullptr;
            if (l == nullptr || strcmp(l->kind(), "ucx") == 0 || l->wants_write()) return false;
            link_locks.push_back(std::move(lk));
            peers.push_back(r);
        }
        BpsOp *op = begin_local_direct(id, table, seq, part, name, cmd, dtype, root, priority, buf, nbytes, divisor,
                                       false);
        if (op == nullptr) return false;
        BpsPart &p = op->parts[0];
        Ident me(p.key, p.rnd);
        for (int r : peers) local_direct_owned_[(size_t)r].store(true);
        std::vector<std::vector<std::string>> copies; /* [identity, header, body] of each LOCAL_READY */
        {
            std::lock_guard<std::mutex> lock(early_mu_); /* the copies that reached byteps-net first */
            auto e = early_.find(me);
            if (e != early_.end()) {
                copies = std::move(e->second);
                early_.erase(e);
            }
        }
        bool strays = false;
        bool all_in = owner_direct_wait(p, peers, &copies, &strays);
        bool replied = false;
        if (all_in) {
            Group g;
            g.op = op;
            g.part = 0;
            for (auto &frames : copies) add_copy(g, frames[1], frames[2]);
            std::vector<const void *> srcs{buf + p.offset};
            srcs.insert(srcs.end(), g.copies.begin(), g.copies.end());
            BpsStageTask sum{priority, 0, BPS_TASK_SUM, op, 0, p.staging, std::move(srcs), p.length, dtype, 0};
            /* an unreadable copy, or a failed sum: byteps-net reports it as usual */
            if (g.error.empty() && g.count == (int)peers.size() && bps_run_task(sum, 1) == 0) {
                local_reduced_++;
                BpsHeader h = bps_header(BPS_CMD_LOCAL_DONE, node_id_, p.key, p.rnd, p.length, BPS_NO_DTYPE,
                                         (uint32_t)local_rank_, BPS_FLAG_SHM);
                for (int r : peers) send_local(r, &h, &p.desc, BPS_DESCRIPTOR_SIZE); /* LOCAL_BROADCAST */
                BpsStageTask out{priority, 0, BPS_TASK_COPY_OUT, op, 0, buf + p.offset, {p.staging}, p.length, dtype, 0};
                bps_run_task(out, 1);
                owner_direct_++;
                replied = true;
            }
        }
        {
            std::lock_guard<std::mutex> lock(mu_);
            op->direct.store(false);
            if (replied) {
                op->parts_left = 0;
                op->done.store(true); /* delivered by this caller: not a completion for byteps-net */
            } else {
                owner_adopt_in_.push_back(std::make_pair(op, std::move(copies)));
                net_ops_++;
            }
        }
        bool more = false;
        for (int r : peers) {
            local_direct_owned_[(size_t)r].store(false);
            BpsConn *l = local_links_[(size_t)r].get();
            more |= l->pending_input() || l->dead();
        }
        link_locks.clear();
        count_direct(replied, strays || more);
        return true;
    }

    /* The direct owner's wait for the other local ranks' LOCAL_READYs of partition ``p`` on their links
     * (their locks held), added to ``copies``: true once every one is in, false when the window passed or
     * a link broke. Messages for others go to byteps-net in order, as in local_direct_wait. */
    bool owner_direct_wait(const BpsPart &p, const std::vector<int> &peers,
                           std::vector<std::vector<std::string>> *copies, bool *strays) {
        double deadline = bps_now() + BPS_DIRECT_WINDOW_S, spin_until = bps_now() + direct_spin_s_;
        std::vector<struct pollfd> pfds(peers.size());
        std::vector<BpsConn *> links;
        for (int r : peers) links.push_back(local_links_[(size_t)r].get());
        BpsPollingLinks polling(links, direct_spin_s_ > 0); /* until we sleep or return */
        BpsMessage msg;
        for (;;) {
            for (size_t k = 0; k < peers.size(); ++k) {
                int r = peers[k];
                BpsConn *l = local_links_[(size_t)r].get();
                while (copies->size() < peers.size() && l->recv(&msg, &local_link_ident_[(size_t)r]) > 0) {
                    local_link_received_.fetch_add(1);
                    BpsHeader h;
                    if (!local_header(msg, &h) || h.cmd != BPS_CMD_LOCAL_READY || h.key != p.key || h.round != p.rnd) {
                        stray_local(msg, strays);
                        continue;
                    }
                    std::vector<std::string> frames;
                    for (int i = 0; i < 3; ++i) frames.emplace_back((const char *)msg.data(i), msg.size(i));
                    copies->push_back(std::move(frames));
                }
                if (l->dead()) return false;
            }
            if (copies->size() >= peers.size()) return true;
            double now = bps_now(), left = deadline - now;
            if (left <= 0) return false;
            if (now < spin_until) {
                sched_yield();
                continue;
            }
            bool came = false;
            for (size_t k = 0; k < peers.size(); ++k) {
                BpsConn *l = local_links_[(size_t)peers[k]].get();
                if (l->wants_write()) l->flush();
                came |= l->arm_to_sleep(); /* a ring's bytes that came without a bell */
                pfds[k] = pollfd{l->fd(), (short)(POLLIN | (l->poll_for_write() ? POLLOUT : 0)), 0};
            }
            if (came) continue;
            struct timespec ts = {0, (long)(left * 1e9)};
            ppoll(pfds.data(), pfds.size(), &ts, nullptr);
        }
    }

    /* The direct local caller's wait for the owner's LOCAL_DONE (or ERROR) of its partition on link ``l``
     * (its lock held): true once the result is in the tensor (or the op failed), false when the window
     * passed or the link broke. */
    bool local_direct_wait(BpsOp *op, int owner, BpsConn *l, bool *strays) {
        BpsPart &p = op->parts[0];
        double deadline = bps_now() + BPS_DIRECT_WINDOW_S, spin_until = bps_now() + direct_spin_s_;
        BpsMessage msg;
        for (;;) {
            while (l->recv(&msg, &local_link_ident_[(size_t)owner]) > 0) { /* [identity, header, body] */
                local_link_received_.fetch_add(1);
                BpsHeader h;
                if (!local_header(msg, &h) || h.key != p.key || h.round != p.rnd ||
                    (h.cmd != BPS_CMD_LOCAL_DONE && h.cmd != BPS_CMD_ERROR)) {
                    stray_local(msg, strays);
                    continue;
                }
                if (h.cmd == BPS_CMD_ERROR) {
                    set_error(op, BPS_ERR_SERVER, std::string((const char *)msg.data(2), msg.size(2)));
                    return true;
                }
                unsigned char *src;
                uint64_t len;
                std::string err;
                int rc = view_shared(msg.data(2), msg.size(2), &src, &len, &err);
                if (rc != 0 || len != p.length) {
                    if (err.empty())
                        err = "copy_into: dst has " + std::to_string(p.length) + " bytes and src has " +
                              std::to_string(len) + " bytes";
                    set_error(op, BPS_ERR_PROTOCOL, "tensor '" + op->name + "': local result unreadable: " + err);
                    return true;
                }
                bps_result_into(op, op->buf + p.offset, src, p.length, false); /* COPY_OUT */
                return true;
            }
            if (l->dead()) return false; /* byteps-net adopts it; its DEALER carries what follows */
            if (!wait_link(l, deadline, spin_until)) return false;
        }
    }

    /* Calls that completed on the caller's thread (submit_direct; tests check the path ran). */
    uint64_t direct_calls() const { return direct_calls_.load(); }
    /* Direct calls whose reply did not come within the window: byteps-net took them over. */
    uint64_t direct_adopted() const { return direct_adopted_.load(); }

    /* Servers reached over a direct link (tests and logs check the path really ran). */
    int links_up() const {
        int n = 0;
        for (auto &l : links_) n += l && !l->dead();
        return n;
    }

    /* The machine's local reduce (before start()): our ROUTER, a DEALER per other local rank (NULL for
     * ourselves), authenticated by Python; ``open`` when the job has no secret (every peer admitted). */
    void add_local(void *router, std::vector<void *> peers, int local_rank, bool open) {
        router_ = router;
        peers_ = std::move(peers);
        local_rank_ = local_rank;
        local_size_ = (int)peers_.size();
        local_links_.resize(peers_.size());
        local_link_ident_.resize(peers_.size());
        for (size_t r = 0; r < peers_.size(); ++r) local_link_mu_.emplace_back(new std::recursive_mutex());
        local_direct_owned_.resize(peers_.size());
        auth_open_ = open;
        stage_ = new BpsStageThread(nthreads_, wake_fd_);
    }

    /* A direct link to local rank ``r`` (before start(), after add_local()): a connected socket whose
     * one-time token was checked (core/engine.py _open_local_links). ``ident`` is r's DEALER identity
     * toward our ROUTER: its messages on the link are taken as from that identity. This thread owns
     * and closes the fd; the DEALER stays the fallback. ``ring_fd`` >= 0: the pair's shared-memory
     * rings (BPS_RING_REGION bytes; BpsShmLink carries the bytes, the socket only bells), ``low``: we are
     * the lower local rank. The caller keeps ``ring_fd`` (a mapping outlives it). "" or why the ring
     * could not be mapped: the socket is then closed, so that the peer's end of the link dies too and
     * both sides use the DEALER. */
    std::string add_local_link(int r, int fd, const std::string &ident, int ring_fd = -1, bool low = false) {
        if (ring_fd >= 0) {
            void *region = mmap(nullptr, BPS_RING_REGION, PROT_READ | PROT_WRITE, MAP_SHARED, ring_fd, 0);
            if (region == MAP_FAILED) {
                std::string why = std::string("mmap: ") + strerror(errno);
                ::close(fd);
                return why;
            }
            local_links_.at((size_t)r).reset(new BpsShmLink(fd, region, low));
        } else {
            local_links_.at((size_t)r).reset(new BpsLink(fd));
        }
        local_link_ident_.at((size_t)r) = ident;
        return "";
    }
    /* Local ranks whose link runs over shared-memory rings (tests check the path really ran). */
    int local_rings_up() const {
        int n = 0;
        for (auto &l : local_links_) n += l && !l->dead() && strcmp(l->kind(), "shm") == 0;
        return n;
    }

    /* Local ranks reached over a working link, and messages sent / received on local links (tests
     * check the path really ran). */
    int local_links_up() const {
        int n = 0;
        for (auto &l : local_links_) n += l && !l->dead();
        return n;
    }
    uint64_t local_link_sent() const { return local_link_sent_.load(); }
    uint64_t local_link_received() const { return local_link_received_.load(); }
    /* times the send queue's head went past a stalled credit, and the first such tensor's name */
    uint64_t credit_stalls(std::string *first) {
        std::lock_guard<std::mutex> lock(mu_);
        *first = first_stall_;
        return credit_stalls_.load();
    }

    /* A peer that passed Python's handshake on our ROUTER (core/auth.py Gate). */
    void allow_local(const std::string &identity) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            allow_in_.push_back(identity);
        }
        wake();
    }

    /* join(): local ranks (bit n: local rank n) that joined; owners stop waiting for their copies. */
    void set_local_joined(uint64_t mask) {
        joined_mask_.store(mask);
        recheck_.store(true);
        wake();
    }

    /* From now on Python runs the local reduce of this process (join()): LOCAL_READYs nobody here
     * waits for, and those held for ops not started yet, go to Python; submit() refuses local ops. */
    void local_python() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            python_local_ = true;
        }
        wake();
    }

    /* Python owns partition (key, round) (a compressed op, ...): its LOCAL_READYs, held or still to
     * come (``count`` of them), are forwarded to Python. */
    void local_claim(uint64_t key, uint64_t rnd, int count) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            claims_in_.push_back(std::make_pair(std::make_pair(key, rnd), count));
        }
        wake();
    }

    /* Local messages this thread does not own: [identity, header, body] each. */
    void forwarded_local(std::vector<std::vector<std::string>> *out) {
        std::lock_guard<std::mutex> lock(mu_);
        out->swap(forward_local_);
    }

    /* Partitions reduced natively (all, and on the stage thread), and copies handed to owners. */
    uint64_t local_reduced() { return local_reduced_.load(); }
    uint64_t local_reduced_on_thread() { return local_threaded_.load(); }
    uint64_t local_coordinated() { return local_coordinated_.load(); }
    /* Partitions this process owned and reduced on the caller's thread (submit_owner_direct). */
    uint64_t local_owner_direct() { return owner_direct_.load(); }

    void start() {
        std::lock_guard<std::mutex> lock(mu_); /* the full barrier that hands the sockets over */
        if (stage_ != nullptr) stage_->start();
        thread_ = std::thread([this] { run(); });
    }

    void stop() {
        if (!thread_.joinable()) return;
        stopping_ = true;
        wake();
        thread_.join();
        if (stage_ != nullptr) stage_->stop();
    }

    int done_fd() const { return done_fd_; }

    /* Register a tensor's partition table once (per tensor, not per call); returns its id. */
    int64_t add_table(const std::string &name, std::vector<BpsPart> parts) {
        std::lock_guard<std::mutex> lock(mu_);
        bool local = !parts.empty() && parts[0].owner >= 0;
        replay_reroutes(parts); /* a tensor first used after servers were lost: as if it had been there */
        tables_.push_back(BpsTable{name, std::move(parts), local});
        return (int64_t)tables_.size() - 1;
    }

    /* Start a push_pull/broadcast of ``buf`` over a registered table: the per-call path. False (and
     * nothing started) for a local-reduce table once Python runs the local reduce (local_python()). */
    bool submit_table(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority,
                      bool root_self, unsigned char *buf, uint64_t nbytes, bool lazy = false, uint32_t divisor = 1) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (python_local_ && tables_.at((size_t)table).local) return false;
        }
        BpsOp *op = new_op(id, cmd, dtype, root, priority, root_self, buf, nbytes, divisor);
        op->lazy = lazy;
        {
            std::lock_guard<std::mutex> lock(mu_);
            BpsTable &t = tables_.at((size_t)table); /* a deque: entries never move */
            op->name = t.name;
            op->local = t.local;
            /* checked again under the same lock as the inbox: local_python() cannot slip in between */
            if (python_local_ && op->local) {
                delete op;
                return false;
            }
            op->table = table;
            op->seq = t.count++;
            if (holding_) { /* the servers are changing: which partitions it uses is known at commit() */
                op->started = bps_now();
                ops_[op->id] = op;
                net_ops_++;
                held_.push_back(op);
                return true;
            }
            op->parts = t.parts_for(op->seq);
            submit_locked(op);
        }
        wake();
        return true;
    }

    /* Take an op (ownership passes here); it completes through completions(). */
    void submit(BpsOp *op) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            submit_locked(op);
        }
        wake();
    }

    void submit_locked(BpsOp *op) {
        op->started = bps_now();
        op->parts_left = (int)op->parts.size();
        ops_[op->id] = op;
        net_ops_++;
        for (size_t i = 0; i < op->parts.size(); ++i) {
            inbox_.push_back(BpsQueued{op->priority, 0, op, (int)i});
        }
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
        if (!it->second->done.load()) return false;
        it->second->lazy = false; /* its caller takes it: not one for the completion thread */
        return true;
    }

    /* Wait (without the GIL) up to timeout_ms for completed ops; move their ids into ``out``. */
    void completions(std::vector<int64_t> *out, int timeout_ms) {
        std::unique_lock<std::mutex> lock(mu_);
        auto due = [this] { return !deferred_.empty() && bps_now() >= deferred_.front().first + BPS_LAZY_DELIVERY_S; };
        double deadline = bps_now() + timeout_ms / 1000.0;
        while (completed_.empty() && !due() && !stopping_) { /* woken by every completion, lazy ones too */
            double left = deadline - bps_now();
            if (!deferred_.empty()) left = std::min(left, deferred_.front().first + BPS_LAZY_DELIVERY_S - bps_now());
            if (left <= 0) break;
            done_cv_.wait_for(lock, std::chrono::microseconds((int64_t)(left * 1e6) + 1));
        }
        out->assign(completed_.begin(), completed_.end());
        completed_.clear();
        /* lazy ops their callers have not taken: the caller that delivers one first wins (Engine._deliver) */
        while (due() || (stopping_ && !deferred_.empty())) {
            int64_t id = deferred_.front().second;
            deferred_.pop_front();
            auto it = ops_.find(id);
            if (it == ops_.end() || !it->second->lazy) continue; /* its caller took it meanwhile */
            out->push_back(id);
            lazy_late_++;
        }
    }

    /* Lazy ops the completion thread delivered because their caller had not taken them in time. */
    uint64_t lazy_late() {
        std::lock_guard<std::mutex> lock(mu_);
        return lazy_late_;
    }

    /* Op ``id`` has a listener now (a done callback): its completion goes to the completion thread at
     * once, including one that already waits in deferred_. */
    void prompt(int64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = ops_.find(id);
        if (it == ops_.end() || !it->second->lazy) return;
        it->second->lazy = false;
        for (auto d = deferred_.begin(); d != deferred_.end(); ++d) {
            if (d->second != id) continue;
            deferred_.erase(d);
            completed_.push_back(id);
            done_cv_.notify_all();
            break;
        }
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
        if (!it->second->done.load() || it->second->zero_copy.load() > 0 || it->second->tasks.load() > 0) return false;
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

    /* ZeroMQ's I/O thread, or byteps-net once a link wrote it, is done with a zero-copy body. */
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
    static BpsOp *new_op(int64_t id, uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority, bool root_self,
                         unsigned char *buf, uint64_t nbytes, uint32_t divisor) {
        BpsOp *op = new BpsOp();
        op->divisor = cmd == BPS_CMD_PUSHPULL && bps_divides(dtype) ? divisor : 1;
        op->id = id;
        op->cmd = cmd;
        op->dtype = dtype;
        op->root = root;
        op->priority = priority;
        op->root_self = root_self;
        op->buf = buf;
        op->nbytes = nbytes;
        return op;
    }

    /* The direct caller's wait for the reply of (its key, ``rnd``) on link ``l`` (its lock held):
     * true once the reply was taken into the op, false when the window passed. */
    bool direct_wait(BpsOp *op, int server, BpsConn *l, uint64_t rnd, bool *strays) {
        BpsPart &p = op->parts[0];
        double deadline = bps_now() + BPS_DIRECT_WINDOW_S, spin_until = bps_now() + direct_spin_s_;
        BpsMessage msg;
        for (;;) {
            while (l->recv(&msg) > 0) {
                BpsHeader h;
                bool mine = msg.count >= 1 && bps_parse_header(msg.data(0), msg.size(0), &h) && h.key == p.key &&
                            h.round == rnd;
                if (!mine) { /* someone else's: byteps-net handles it, in arrival order */
                    BpsMessage *keep = keep_message(msg);
                    std::lock_guard<std::mutex> lock(mu_);
                    strays_in_.push_back(std::make_pair(server, keep));
                    *strays = true;
                    continue;
                }
                received_[(size_t)server] += msg.size(0) + (msg.count > 1 ? msg.size(1) : 0);
                uint64_t t_reply = bps_span_start(); /* PUSH ends where PULL starts */
                bps_span_to(BPS_TRACE_PUSH, p.trace_t, t_reply, p.key, rnd, p.length, server, op->priority);
                if (h.cmd == BPS_CMD_REPLY) {
                    receive(op, p, server, h, &msg);
                    bps_span(BPS_TRACE_PULL, t_reply, p.key, rnd, p.length, server, op->priority);
                } else if (h.cmd == BPS_CMD_ERROR) {
                    set_error(op, BPS_ERR_SERVER, msg.count > 1 ? std::string((const char *)msg.data(1), msg.size(1)) : "{}");
                } else {
                    set_error(op, BPS_ERR_PROTOCOL,
                              "unexpected command " + std::to_string(h.cmd) + " from server " + std::to_string(server));
                }
                return true;
            }
            if (l->dead()) return false; /* byteps-net adopts it; the scheduler reports the lost server */
            if (!wait_link(l, deadline, spin_until)) return false;
        }
    }

    /* Partitions direct callers handed over (their replies may be next on the link), and messages
     * they read for others. Called before any link is read, and again for a reply nobody expects. */
    void take_direct() {
        std::vector<BpsQueued> adopt, local_adopt;
        std::vector<std::pair<int, BpsMessage *>> strays;
        std::vector<BpsMessage *> local_strays;
        std::vector<std::pair<BpsOp *, std::vector<std::vector<std::string>>>> owner_adopt;
        bool abort;
        {
            std::lock_guard<std::mutex> lock(mu_);
            adopt.swap(adopt_in_);
            strays.swap(strays_in_);
            local_adopt.swap(local_adopt_in_);
            local_strays.swap(local_strays_in_);
            owner_adopt.swap(owner_adopt_in_);
            abort = abort_;
        }
        for (auto &a : owner_adopt) { /* LOCAL_REDUCE here, with the copies its caller took */
            BpsOp *op = a.first;
            if (abort) {
                fail(op, BPS_ERR_ABORT, "");
                continue;
            }
            Ident id(op->parts[0].key, op->parts[0].rnd);
            Group &g = groups_[id];
            g.op = op;
            g.part = 0;
            for (auto &frames : a.second) add_copy(g, frames[1], frames[2]);
            take_early(g, id);
            maybe_reduce(id);
        }
        for (auto &a : local_adopt) { /* its LOCAL_READY is out: wait for the owner's LOCAL_DONE here */
            BpsPart &p = a.op->parts[(size_t)a.part];
            Ident id(p.key, a.seq);
            awaiting_[id] = Await{a.op, a.part, p.owner};
            a.op->owed_local[p.owner]++;
            if (abort) {
                fail(a.op, BPS_ERR_ABORT, "");
                continue;
            }
            auto e = early_done_.find(id);
            if (e != early_done_.end()) { /* it reached the ROUTER while the caller held it */
                std::pair<BpsMessage *, bool> m = e->second;
                early_done_.erase(e);
                on_local(m.first, m.second);
                delete m.first;
            }
        }
        for (BpsMessage *m : local_strays) {
            on_local(m, true);
            delete m;
        }
        for (auto &a : adopt) {
            BpsPart &p = a.op->parts[(size_t)a.part];
            if (dead_[(size_t)p.server].load() && !abort) { /* elastic: its server went while the caller waited */
                a.seq = p.qseq = seq_++;
                if (awaiting_commit()) stranded_.push_back(a);
                else push(a.op, a.part); /* to the replacement, in its round, past the credit (see commit) */
                continue;
            }
            pending_[std::make_pair(p.key, a.seq)] = std::make_pair(a.op, a.part);
            a.op->owed[p.server]++;
            credit_.take(urgency(a.op, a.part), (int64_t)p.length);
            if (abort) fail(a.op, BPS_ERR_ABORT, "");
        }
        for (auto &m : strays) {
            on_message(m.first, m.second);
            delete m.second;
        }
    }

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
        size_t nsocks = 0, wake_at = 0, router_at = 0, links_at = 0, local_at = 0;
        std::vector<bps_zmq_pollitem> items;
        BpsMessage msg;
        double next_check = 0;
        while (!stopping_) {
            /* UCX links: their UCP worker is this thread's except while it sleeps in poll, when a direct
             * caller may take it (submit_direct) */
            std::unique_lock<std::mutex> ucx_lock(ucx_mu_, std::defer_lock);
            if (ucx_) ucx_lock.lock();
            if (nsocks != socks_.size()) { /* at start, and when a server joined (elastic: take_inbox) */
                nsocks = socks_.size();
                wake_at = nsocks, router_at = nsocks + 1, links_at = nsocks + 2;
                local_at = links_at + nsocks;
                items.assign(local_at + local_links_.size(), bps_zmq_pollitem{nullptr, -1, 0, 0});
                for (size_t i = 0; i < nsocks; ++i) items[i] = bps_zmq_pollitem{socks_[i], 0, BPS_ZMQ_POLLIN, 0};
                items[wake_at] = bps_zmq_pollitem{nullptr, wake_fd_, BPS_ZMQ_POLLIN, 0};
                /* the local ROUTER, if any (a NULL socket with fd -1 is never ready) */
                items[router_at] = bps_zmq_pollitem{router_, -1, (short)(router_ ? BPS_ZMQ_POLLIN : 0), 0};
            }
            bool buffered = false;
            for (size_t i = 0; i < nsocks; ++i) { /* a dead link, or one a direct caller holds: not polled */
                BpsConn *l = direct_owned_[i].load() ? nullptr : live_link((int)i);
                short ev = l == nullptr ? 0 : (short)(BPS_ZMQ_POLLIN | (l->poll_for_write() ? BPS_ZMQ_POLLOUT : 0));
                items[links_at + i] = bps_zmq_pollitem{nullptr, l == nullptr ? -1 : l->fd(), ev, 0};
                buffered |= l != nullptr && l->pending_input(); /* whole messages in hand: no sleep */
            }
            for (size_t r = 0; r < local_links_.size(); ++r) {
                BpsConn *l = local_direct_owned_[r].load() ? nullptr : live_local_link((int)r);
                short ev = l == nullptr ? 0 : (short)(BPS_ZMQ_POLLIN | (l->poll_for_write() ? BPS_ZMQ_POLLOUT : 0));
                items[local_at + r] = bps_zmq_pollitem{nullptr, l == nullptr ? -1 : l->fd(), ev, 0};
                buffered |= l != nullptr && l->pending_input();
            }
            if (ucx_lock.owns_lock()) ucx_lock.unlock();
            int rc = bps_zmq.poll(items.data(), (int)items.size(), buffered ? 0 : 100);
            if (ucx_) ucx_lock.lock();
            if (rc < 0 && bps_zmq.errno_() != EINTR) break; /* the context was terminated */
            if (items[wake_at].revents) {
                uint64_t n;
                ssize_t got = read(wake_fd_, &n, sizeof n);
                (void)got;
            }
            take_inbox();
            take_direct();
            take_stage_done();
            if (nsocks != socks_.size()) continue; /* a server joined: poll it too before reading */
            if (router_ != nullptr && items[router_at].revents) {
                for (int k = 0; k < 256; ++k) {
                    int got = bps_recv_message(router_, &msg);
                    if (got <= 0) break;
                    on_local(&msg);
                }
            }
            for (size_t r = 0; r < local_links_.size(); ++r) {
                short ev = items[local_at + r].revents;
                BpsConn *l = live_local_link((int)r);
                if (l == nullptr || (!ev && !l->pending_input())) continue;
                std::unique_lock<std::recursive_mutex> link_lock(*local_link_mu_[r], std::try_to_lock);
                if (!link_lock) continue; /* a direct caller reads it now */
                take_direct();            /* what it handed over comes before what we read next */
                if (ev & BPS_ZMQ_POLLOUT) l->flush();
                for (int k = 0; k < 256 && !l->dead(); ++k) {
                    if (l->recv(&msg, &local_link_ident_[r]) <= 0) break; /* [identity, header, body], as on the ROUTER */
                    local_link_received_.fetch_add(1);
                    on_local(&msg, true);
                }
                /* a link that broke (its peer went): live_local_link() is NULL now, its DEALER carries what follows */
            }
            for (size_t i = 0; i < nsocks; ++i) {
                if (!items[i].revents) continue;
                for (int k = 0; k < 256; ++k) { /* drain, bounded so the others get a turn */
                    int got = bps_recv_message(socks_[i], &msg);
                    if (got <= 0) break;
                    on_message((int)i, &msg);
                }
            }
            for (size_t i = 0; i < nsocks; ++i) {
                short ev = items[links_at + i].revents;
                BpsConn *l = live_link((int)i);
                if (l == nullptr || (!ev && !l->pending_input())) continue;
                std::unique_lock<std::mutex> link_lock(*link_mu_[i], std::try_to_lock);
                if (!link_lock) continue; /* a direct caller reads it now */
                take_direct();            /* what it handed over comes before what we read next */
                if (ev & BPS_ZMQ_POLLOUT) l->flush();
                for (int k = 0; k < 256 && !l->dead(); ++k) {
                    if (l->recv(&msg) <= 0) break;
                    on_message((int)i, &msg);
                }
            }
            for (size_t i = 0; i < nsocks; ++i) { /* links that broke here or under a direct caller */
                BpsConn *l = links_[i].get();
                if (l == nullptr || !l->dead() || reported_[i]) continue;
                reported_[i] = true; /* the server went (or closed it): Python tells the scheduler (elastic) */
                {
                    std::lock_guard<std::mutex> lock(mu_);
                    lost_.push_back((int)i);
                }
                notify_python();
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

    /* Server ``server``'s direct link while it works, else NULL (ZeroMQ then carries its messages:
     * a link breaks only when the server goes, and the scheduler reports that loss to everyone). */
    BpsConn *live_link(int server) {
        BpsConn *l = links_[(size_t)server].get();
        return l != nullptr && !l->dead() ? l : nullptr;
    }

    /* Transport seam: one message to server ``server``. 0, or -1 with errno set. */
    int send_server(int server, BpsFrames &f) {
        BpsConn *l = live_link(server);
        if (l == nullptr) return bps_zmq_send_frames(socks_[(size_t)server], f);
        std::lock_guard<std::mutex> link_lock(*link_mu_[(size_t)server]); /* a direct caller may hold it briefly */
        if (l->send(f) == 0) return 0;
        errno = ECONNRESET;
        return -1;
    }

    void take_inbox() {
        std::vector<BpsQueued> in;
        std::vector<std::unique_ptr<BpsRawSend>> raw;
        std::vector<std::string> allow;
        std::vector<std::pair<std::pair<uint64_t, uint64_t>, int>> claims;
        std::vector<std::pair<void *, int>> joined;
        bool abort, python_local, dead_now, commit_now;
        {
            std::lock_guard<std::mutex> lock(mu_);
            in.swap(inbox_);
            raw.swap(raw_);
            allow.swap(allow_in_);
            claims.swap(claims_in_);
            joined.swap(new_servers_);
            abort = abort_;
            python_local = python_local_;
            dead_now = dead_in_;
            commit_now = commit_in_;
            dead_in_ = commit_in_ = false;
            if (commit_now) {
                alive_net_ = alive_;
                commits_net_ = commits_;
            }
        }
        for (auto &a : allow) allowed_.insert(a);
        for (auto &j : joined) { /* elastic: a server joined; it is polled from the next turn on */
            size_t i = socks_.size();
            if (j.second >= 0) links_[i].reset(new BpsLink(j.second));
            socks_.push_back(j.first);
            nservers_.store((int)socks_.size());
        }
        if (dead_now) strand_dead();
        if (commit_now) { /* results first, then stranded partitions go to their replacements, in their rounds */
            send_results();
            std::vector<BpsQueued> back;
            back.swap(stranded_);
            /* Sent at once, past the credit, in their first order: each had been let through the credit
             * before, so what each worker has in flight becomes again what it had before the loss (a
             * prefix of the order every worker sends in). Queued behind partitions sent after them, they
             * could wait for those while other workers' copies of those wait for them. */
            std::sort(back.begin(), back.end(), [](const BpsQueued &a, const BpsQueued &b) {
                return a.priority != b.priority ? a.priority > b.priority : a.seq < b.seq;
            });
            for (auto &q : back)
                if (!q.op->done.load()) push(q.op, q.part); /* to the replacement, in its round */
        }
        for (auto &m : raw) send_raw_now(m.get());
        for (auto &q : in) {
            if (q.op->local) {
                local_start(q.op, q.part); /* before any message of this turn: it may be for this op */
                continue;
            }
            q.seq = seq_++;
            q.op->parts[(size_t)q.part].qseq = q.seq;
            q.tie = q.op->parts[(size_t)q.part].key;
            queue_.push(q);
        }
        for (auto &c : claims) local_claimed(c.first, c.second);
        if (python_local && !python_local_mode_) { /* join(): what we held goes to Python now */
            python_local_mode_ = true;
            std::map<Ident, std::vector<std::vector<std::string>>> held;
            {
                std::lock_guard<std::mutex> lock(early_mu_);
                held.swap(early_);
            }
            for (auto &kv : held)
                for (auto &frames : kv.second) forward_local(frames);
        }
        if (recheck_.exchange(false)) {
            std::vector<std::pair<uint64_t, uint64_t>> ids;
            for (auto &kv : groups_) ids.push_back(kv.first);
            for (auto &id : ids) maybe_reduce(id);
        }
        if (abort) {
            while (!queue_.empty()) queue_.pop();
            std::vector<BpsOp *> all;
            {
                std::lock_guard<std::mutex> lock(mu_);
                for (auto &kv : ops_) all.push_back(kv.second);
            }
            for (BpsOp *op : all) { /* a direct caller's op fails when it is handed over (take_direct) */
                if (!op->done.load() && !op->direct.load()) fail(op, BPS_ERR_ABORT, "");
            }
            pending_.clear();
            stranded_.clear();
            credit_.clear();
            groups_.clear();
            awaiting_.clear();
            {
                std::lock_guard<std::mutex> lock(early_mu_);
                early_.clear();
            }
            claimed_.clear();
        }
    }

    void send_raw_now(BpsRawSend *m) {
        BpsFrames f;
        f.copy(m->header.data(), m->header.size());
        if (m->zc_data != nullptr)
            f.zero_copy(m->zc_data, m->zc_len, &BpsWorkerCore::zc_free, new BpsZcHint{this, nullptr, m->token});
        else
            f.copy(m->body.data(), m->body.size());
        if (m->server >= 0) {
            send_server(m->server, f);
        } else if (m->server == BPS_TO_ROUTER) {
            bps_zmq_send_frames(router_, f, &m->ident);
        } else {
            int r = -2 - m->server; /* the same path as ours, so that one peer's messages stay in order */
            std::unique_lock<std::recursive_mutex> link_lock(*local_link_mu_[(size_t)r]);
            BpsConn *l = live_local_link(r);
            if (l == nullptr) {
                bps_zmq_send_frames(peers_[(size_t)r], f);
            } else if (l->send(f) == 0) {
                local_link_sent_.fetch_add(1);
            } else if (m->zc_data == nullptr) { /* it broke just now: the DEALER takes a copied body */
                BpsFrames again;
                again.copy(m->header.data(), m->header.size());
                again.copy(m->body.data(), m->body.size());
                bps_zmq_send_frames(peers_[(size_t)r], again);
            }
        }
        /* Python counts its own messages (Engine.bytes_sent); a failed send released the body */
    }

    /* the credit counts bytes in flight at least as urgent: (priority, wire key), one order on every
     * worker (core/pipeline/bps_queue.h says why) */
    static BpsUrgency urgency(const BpsOp *op, int part) {
        return BpsUrgency{op->priority, op->parts[(size_t)part].key};
    }
    bool fits(const BpsQueued &q) const {
        return credit_.fits(BpsUrgency{q.priority, q.tie}, (int64_t)q.op->parts[q.part].length);
    }

    void send_ready() {
        if (queue_.empty()) return;
        bool stalled = false;
        if (!fits(queue_.top())) { /* a credit with no progress for a second: workers disagree on urgency */
            if (!credit_.stalled(BPS_CREDIT_STALL_MS)) return;
            stalled = true;
            if (credit_stalls_.fetch_add(1) == 0) { /* Python logs the first (Engine._note_stall) */
                std::lock_guard<std::mutex> lock(mu_);
                first_stall_ = queue_.top().op->name;
            }
        }
        cork_links(true); /* a burst of pushes leaves in as few writes as the sockets take */
        while (!queue_.empty() && (stalled || fits(queue_.top()))) {
            BpsQueued q = queue_.top();
            queue_.pop();
            BpsOp *op = q.op;
            if (op->done.load()) continue;
            push(op, q.part);
            stalled = false; /* one past the credit per stall */
        }
        cork_links(false);
    }

    void cork_links(bool on) {
        for (size_t i = 0; i < socks_.size(); ++i) {
            BpsConn *l = live_link((int)i);
            if (l == nullptr) continue;
            std::lock_guard<std::mutex> link_lock(*link_mu_[i]);
            l->cork(on);
        }
    }

    /* STAGE (colocated) and PUSH of one partition. */
    void push(BpsOp *op, int index) {
        BpsPart &p = op->parts[index];
        if (dead_[(size_t)p.server].load()) { /* elastic: its server is gone */
            if (awaiting_commit()) { /* its replacement is known at commit() */
                stranded_.push_back(BpsQueued{op->priority, p.qseq, op, index});
                return;
            }
            move_part(p, bps_replacement(alive_net_, p.key));
            if (p.server < 0) { /* cannot happen: the scheduler never removes the last server */
                fail(op, BPS_ERR_PROTOCOL, "tensor '" + op->name + "': no server left to take over a lost one");
                return;
            }
        }
        /* a local owner pushes the machine's sum from its shared region, in the round it took at start; a
         * partition pushed again (its server was lost) keeps its round */
        uint64_t rnd = op->local || p.has_rnd ? p.rnd : next_round(p.key);
        p.rnd = rnd;
        p.has_rnd = true;
        bool empty = op->cmd == BPS_CMD_BROADCAST && !op->root_self;
        uint8_t flags = 0;
        const unsigned char *data = op->local ? p.staging : op->buf + p.offset;
        bps_span(BPS_TRACE_QUEUE, p.trace_t ? p.trace_t : (uint64_t)(op->started * 1e9), p.key, rnd, p.length,
                 p.server, op->priority);
        if (op->local) {
            if (p.colocated) flags = BPS_FLAG_SHM;
        } else if (p.staging != nullptr && !empty) {
            uint64_t t_stage = bps_span_start();
            bps_copy_stream(p.staging, data, p.length); /* the server reads it on another core */
            bps_span(BPS_TRACE_STAGE, t_stage, p.key, rnd, p.length, p.server, op->priority);
            flags = BPS_FLAG_SHM;
        }
        p.trace_t = bps_span_start(); /* PUSH: until the reply arrives (on_message) */
        uint64_t body_len = empty ? 0 : (flags ? BPS_DESCRIPTOR_SIZE : p.length);
        BpsHeader h = bps_header(op->cmd, node_id_, p.key, rnd, flags ? p.length : body_len, op->dtype,
                                 op->root, flags);
        BpsFrames f;
        f.copy(&h, sizeof h);
        if (flags) {
            f.copy(&p.desc, sizeof p.desc);
        } else if (body_len < 65536) {
            f.copy(data, body_len);
        } else { /* zero-copy from the tensor: the transport reads it while it is on the wire */
            op->zero_copy.fetch_add(1);
            f.zero_copy((void *)data, body_len, &BpsWorkerCore::zc_free, new BpsZcHint{this, op, -1});
        }
        int rc = send_server(p.server, f);
        if (rc != 0) {
            fail(op, BPS_ERR_PROTOCOL, std::string("tensor '") + op->name + "': sending to server " +
                                           std::to_string(p.server) + " failed: " + strerror(errno));
            return;
        }
        sent_[p.server] += sizeof h + body_len;
        pending_[std::make_pair(p.key, rnd)] = std::make_pair(op, index);
        op->owed[p.server]++;
        credit_.take(urgency(op, index), (int64_t)p.length);
    }

    /* Elastic (network thread): a server reads as dead from hold() on, but its replacement is known only
     * once byteps-net has taken the commit() that follows; until then its partitions wait (stranded). */
    bool awaiting_commit() const { return commits_net_ < holds_.load(); }

    /* Elastic: partitions a dead server owes replies for wait for commit() (stranded), after any whole
     * messages it sent before it went are taken. */
    void strand_dead() {
        BpsMessage msg;
        for (size_t s = 0; s < socks_.size(); ++s) {
            if (!dead_[s].load()) continue;
            for (int k = 0; k < 4096; ++k) { /* what ZeroMQ already holds from it */
                if (bps_recv_message(socks_[s], &msg) <= 0) break;
                on_message((int)s, &msg);
            }
        }
        for (auto it = pending_.begin(); it != pending_.end();) {
            BpsOp *op = it->second.first;
            int index = it->second.second;
            BpsPart &p = op->parts[(size_t)index];
            if (!dead_[(size_t)p.server].load()) {
                ++it;
                continue;
            }
            release(op, index);
            op->owed[p.server]--;
            stranded_.push_back(BpsQueued{op->priority, p.qseq, op, index});
            it = pending_.erase(it);
        }
    }

    void release(BpsOp *op, int index) {
        credit_.release(urgency(op, index), (int64_t)op->parts[index].length);
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
            take_direct(); /* a partition a direct caller handed over just now? */
            it = pending_.find(std::make_pair(h.key, h.round));
        }
        if (it == pending_.end() || it->second.first->parts[(size_t)it->second.second].server != server) {
            forward(server, m); /* Python's partition, an op that failed already, or a lost server's late reply */
            return;
        }
        BpsOp *op = it->second.first;
        int index = it->second.second;
        pending_.erase(it);
        release(op, index);
        BpsPart &p = op->parts[index];
        uint64_t t_reply = bps_span_start(); /* PUSH ends where PULL starts */
        bps_span_to(BPS_TRACE_PUSH, p.trace_t, t_reply, p.key, h.round, p.length, server, op->priority);
        op->owed[server]--;
        received_[server] += m->size(0) + (m->count > 1 ? m->size(1) : 0);
        if (op->done.load()) return;
        if (op->local) {
            local_pulled(op, index, server, h, m);
            return;
        }
        if (h.cmd == BPS_CMD_REPLY) {
            receive(op, p, server, h, m);
            bps_span(BPS_TRACE_PULL, t_reply, p.key, h.round, p.length, server, op->priority);
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
            if (view_shared(m->data(1), m->size(1), &src, &len, &err) != 0) {
                set_error(op, BPS_ERR_PROTOCOL, err);
                return;
            }
            if (len != expect) {
                set_error(op, BPS_ERR_PROTOCOL, who + " replied " + std::to_string(len) + " bytes for a partition of " +
                                                    std::to_string(expect));
                return;
            }
            retain(p, h.round, op->dtype, src, p.length); /* the sum, not an average */
            /* a lone pushing machine gets its own region back: the sum is what the tensor holds */
            if (op->divisor > 1 || !(p.staging != nullptr && src == p.staging)) bps_result_into(op, dst, src, len, true);
            return;
        }
        size_t got = m->size(1);
        if (got != expect) {
            set_error(op, BPS_ERR_PROTOCOL, who + " replied " + std::to_string(got) + " bytes for a partition of " +
                                                std::to_string(expect));
            return;
        }
        /* the sum, not an average; a broadcast's root: its own data, the result */
        retain(p, h.round, op->dtype, got ? m->data(1) : dst, p.length);
        if (got) bps_result_into(op, dst, m->data(1), got, false);
    }

    /* Elastic servers: the result of each key's latest round, with the server that sent it. If that
     * server is lost, its replacement gets it (RESULT, send_results()): another worker may not have got
     * its reply before the server went, and we will not push that round again. One copy per partition
     * key, kept until the next round's result replaces it (docs/elastic.md says what that costs). */
    void retain(const BpsPart &p, uint64_t round, uint8_t dtype, const void *data, size_t n) {
        if (!retain_) return;
        std::lock_guard<std::mutex> lock(retain_mu_);
        BpsRetained &r = retained_[p.key];
        r.round = round;
        r.server = p.server;
        r.dtype = dtype;
        r.data.assign((const char *)data, n);
    }

    /* At commit(): the results we hold from servers now dead, to their replacements, before any push. */
    void send_results() {
        std::lock_guard<std::mutex> lock(retain_mu_);
        for (auto &kv : retained_) {
            BpsRetained &r = kv.second;
            if (r.server < 0 || !dead_[(size_t)r.server].load()) continue;
            int to = bps_replacement(alive_net_, kv.first);
            if (to < 0) continue;
            BpsHeader h = bps_header(BPS_CMD_RESULT, node_id_, kv.first, r.round, r.data.size(), r.dtype, 0, 0);
            BpsFrames f;
            f.copy(&h, sizeof h);
            f.copy(r.data.data(), r.data.size());
            send_server(to, f);
            sent_[(size_t)to] += sizeof h + r.data.size();
            r.server = to;
            results_sent_.fetch_add(1);
        }
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
        if (op->local) { /* late LOCAL_READYs are then held as early ones; late LOCAL_DONEs go to Python, which drops them */
            for (auto it = groups_.begin(); it != groups_.end();) it = it->second.op == op ? groups_.erase(it) : std::next(it);
            for (auto it = awaiting_.begin(); it != awaiting_.end();)
                it = it->second.op == op ? awaiting_.erase(it) : std::next(it);
        }
        complete(op);
    }

    void complete(BpsOp *op) {
        op->parts_left = 0;
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (!op->done.load()) net_ops_--;
            op->done.store(true);
            /* A caller blocked in wait_op() sees the op done under this same mutex and delivers it
             * itself, so the completion thread is not told about it: the two would only contend for
             * the GIL over one op. A waiter that timed out first has left (waiters == 0). */
            if (op->waiters == 0) {
                if (op->lazy) deferred_.emplace_back(bps_now(), op->id);
                else completed_.push_back(op->id);
            }
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
                if (!op->done.load() && !op->direct.load() && now - op->started > timeout_) late.push_back(op);
            }
        }
        for (BpsOp *op : late) {
            std::set<std::string> names; /* sorted, as core/engine.py's time-out names them */
            for (auto &kv : op->owed)
                if (kv.second > 0) names.insert("server " + std::to_string(kv.first));
            for (auto &kv : op->owed_local)
                if (kv.second > 0) names.insert("local rank " + std::to_string(kv.first));
            if (op->local) { /* an owner names the local ranks whose copies it still waits for */
                for (auto &kv : groups_) {
                    if (kv.second.op != op || kv.second.reducing) continue;
                    for (int r : missing(kv.second)) names.insert("local rank " + std::to_string(r));
                }
            }
            std::string who;
            for (auto &n : names) {
                if (!who.empty()) who += ", ";
                who += n;
            }
            if (who.empty()) { /* never sent: say what it is queued behind */
                bool held = false, stranded = false;
                {
                    std::lock_guard<std::mutex> lock(mu_);
                    for (BpsOp *h : held_) held |= h == op;
                }
                for (auto &q : stranded_) stranded |= q.op == op;
                if (held) who = "a change of the servers (it was submitted during one, which never completed)";
                else if (stranded) who = "a lost server's replacement (the change of the servers never completed)";
                else {
                    std::map<int, std::pair<int, uint64_t>> by_server; /* what holds the credit */
                    std::string first;
                    for (auto &kv : pending_) {
                        const BpsPart &q = kv.second.first->parts[(size_t)kv.second.second];
                        by_server[q.server].first++;
                        by_server[q.server].second += q.length;
                        if (first.size() < 200)
                            first += " '" + kv.second.first->name + "' (" + std::to_string(kv.first.first >> 32) + ", " +
                                     std::to_string(kv.first.first & 0xFFFFFFFF) + ") round " +
                                     std::to_string(kv.first.second) + " to server " + std::to_string(q.server) + ";";
                    }
                    if (!queue_.empty()) {
                        const BpsQueued &t = queue_.top();
                        const BpsPart &q = t.op->parts[(size_t)t.part];
                        first += " next: '" + t.op->name + "' (" + std::to_string(q.key >> 32) + ", " +
                                 std::to_string(q.key & 0xFFFFFFFF) + ") to server " + std::to_string(q.server);
                    }
                    std::string held_by;
                    for (auto &kv : by_server)
                        held_by += (held_by.empty() ? "" : ", ") + std::string("server ") + std::to_string(kv.first) +
                                   ": " + std::to_string(kv.second.first) + " partitions, " +
                                   std::to_string(kv.second.second) + " bytes";
                    who = "its turn to be sent (" + std::to_string(credit_.in_flight()) + " bytes in flight, credit " +
                          std::to_string(credit_.credit()) + ", " + std::to_string(queue_.size()) + " queued; " +
                          (held_by.empty() ? "no replies owed" : "replies owed by " + held_by) + ";" + first + ")";
                }
            }
            char secs[32];
            snprintf(secs, sizeof secs, "%.0f", now - op->started);
            fail(op, BPS_ERR_TIMEOUT, std::string(secs) + "|" + who);
        }
    }


    /* Local reduce (core/local.py) ----------------------------------------------------------
     * One partition, in the order it happens; every step runs on this thread except the sums and
     * big copies, which run on the stage thread and come back through take_stage_done(). */

    typedef std::pair<uint64_t, uint64_t> Ident; /* (wire key, round) */

    struct Group { /* an owner's partition in LOCAL_REDUCE */
        BpsOp *op;
        int part;
        int count = 0;                         /* LOCAL_READYs in (copies or bad descriptors) */
        uint64_t ranks = 0;                    /* bit n: local rank n's copy is in */
        std::vector<const void *> copies;
        std::string error;                     /* the first unreadable copy */
        bool reducing = false;
    };

    struct Await { /* a non-owner's partition waiting for LOCAL_DONE */
        BpsOp *op;
        int part;
        int owner;
    };

    /* Every local rank of the op takes the partition's round now (both paths count rounds here). */
    void local_start(BpsOp *op, int i) {
        BpsPart &p = op->parts[i];
        p.rnd = next_round(p.key);
        Ident id(p.key, p.rnd);
        if (op->done.load()) return;
        if (p.owner == local_rank_) { /* LOCAL_REDUCE: the copies that came before the op are taken now */
            Group &g = groups_[id];
            g.op = op;
            g.part = i;
            take_early(g, id);
            maybe_reduce(id);
            return;
        }
        /* COORDINATE: our copy into our shared region, then LOCAL_READY to the owner */
        op->owed_local[p.owner]++;
        awaiting_[id] = Await{op, i, p.owner};
        stage_or_inline(BPS_TASK_COPY_IN, op, i, p.staging, {op->buf + p.offset});
    }

    /* The copies of partition ``id`` that came before its op (early_), into its group. */
    void take_early(Group &g, const Ident &id) {
        std::vector<std::vector<std::string>> held;
        {
            std::lock_guard<std::mutex> lock(early_mu_);
            auto e = early_.find(id);
            if (e == early_.end()) return;
            held = std::move(e->second);
            early_.erase(e);
        }
        for (auto &frames : held) add_copy(g, frames[1], frames[2]);
    }

    /* Run a copy or sum inline (small) or on the stage thread (>= 256 KB); then after_task(). */
    void stage_or_inline(int kind, BpsOp *op, int i, void *dst, std::vector<const void *> srcs) {
        BpsStageTask t{op->priority, 0, kind, op, i, dst, std::move(srcs), op->parts[i].length, op->dtype, 0};
        if (t.nbytes >= BPS_STAGE_THREAD_MIN_BYTES) {
            op->tasks++;
            if (kind == BPS_TASK_SUM) local_threaded_++;
            stage_->submit(std::move(t));
            return;
        }
        t.rc = bps_run_task(t, 1);
        after_task(t);
    }

    void take_stage_done() {
        if (stage_ == nullptr) return;
        std::vector<BpsStageTask> done;
        stage_->done(&done);
        for (BpsStageTask &t : done) {
            t.op->tasks--;
            after_task(t);
        }
    }

    void after_task(BpsStageTask &t) {
        BpsOp *op = t.op;
        if (op->done.load()) return; /* failed meanwhile (time-out, abort) */
        BpsPart &p = op->parts[t.part];
        if (t.kind == BPS_TASK_COPY_IN) {
            BpsHeader h = bps_header(BPS_CMD_LOCAL_READY, node_id_, p.key, p.rnd, p.length, op->dtype,
                                     (uint32_t)local_rank_, BPS_FLAG_SHM);
            if (send_local(p.owner, &h, &p.desc, sizeof p.desc) != 0) {
                fail(op, BPS_ERR_PROTOCOL, "tensor '" + op->name + "': sending to local rank " +
                                               std::to_string(p.owner) + " failed: " + strerror(errno));
                return;
            }
            local_coordinated_++;
        } else if (t.kind == BPS_TASK_SUM) {
            if (t.rc != 0) {
                groups_.erase(Ident(p.key, p.rnd));
                local_failed(op, t.part, BPS_ERR_PROTOCOL,
                             "tensor '" + op->name + "': local reduce failed: unknown dtype code " +
                                 std::to_string(op->dtype));
                return;
            }
            local_reduced_++;
            if (lone_machine_ && op->cmd == BPS_CMD_PUSHPULL) { /* the machine's sum is the job's */
                groups_.erase(Ident(p.key, p.rnd));
                local_broadcast(op, t.part, &p.desc, "");
                stage_or_inline(BPS_TASK_COPY_OUT, op, t.part, op->buf + p.offset, {p.staging});
                return;
            }
            p.trace_t = bps_span_start(); /* its QUEUE wait starts now */
            /* PUSH of the machine's sum: queued by priority within the credit like any partition */
            op->parts[(size_t)t.part].qseq = seq_;
            queue_.push(BpsQueued{op->priority, seq_++, op, t.part, p.key});
        } else { /* COPY_OUT: the result is in the tensor */
            part_done(op);
        }
    }

    /* A LOCAL_READY's copy: a view of the sender's shared region (its descriptor is checked). */
    void add_copy(Group &g, const std::string &header, const std::string &body) {
        BpsHeader h;
        memcpy(&h, header.data(), sizeof h);
        BpsPart &p = g.op->parts[g.part];
        unsigned char *src;
        uint64_t len;
        std::string err;
        g.count++;
        if (h.arg < 64) g.ranks |= 1ull << h.arg;
        if (view_shared(body.data(), body.size(), &src, &len, &err) != 0) {
            if (g.error.empty()) g.error = err;
        } else if (len != p.length) {
            if (g.error.empty())
                g.error = "local rank " + std::to_string(h.arg) + " sent " + std::to_string(len) +
                          " bytes for a partition of " + std::to_string(p.length);
        } else {
            g.copies.push_back(src);
        }
    }

    int expected_copies() const {
        uint64_t joined = joined_mask_.load() & ~(1ull << local_rank_);
        return local_size_ - 1 - __builtin_popcountll(joined);
    }

    std::vector<int> missing(const Group &g) const {
        std::vector<int> out;
        uint64_t joined = joined_mask_.load();
        for (int r = 0; r < local_size_; ++r)
            if (r != local_rank_ && !(joined >> r & 1) && !(g.ranks >> r & 1)) out.push_back(r);
        return out;
    }

    /* LOCAL_REDUCE once every local rank's copy is in (those in join() send none). */
    void maybe_reduce(const Ident &id) {
        auto it = groups_.find(id);
        if (it == groups_.end()) return;
        Group &g = it->second;
        if (g.reducing || g.count < expected_copies()) return;
        g.reducing = true;
        BpsOp *op = g.op;
        BpsPart &p = op->parts[g.part];
        if (!g.error.empty()) {
            int part = g.part;
            std::string text = "tensor '" + op->name + "': a local rank's shared copy: " + g.error;
            groups_.erase(it);
            local_failed(op, part, BPS_ERR_PROTOCOL, text);
            return;
        }
        std::vector<const void *> srcs{op->buf + p.offset};
        srcs.insert(srcs.end(), g.copies.begin(), g.copies.end());
        stage_or_inline(BPS_TASK_SUM, op, g.part, p.staging, std::move(srcs));
    }

    /* PULL of an owner's partition: the machine's result, then LOCAL_BROADCAST. */
    void local_pulled(BpsOp *op, int i, int server, const BpsHeader &h, BpsMessage *m) {
        BpsPart &p = op->parts[i];
        groups_.erase(Ident(p.key, p.rnd));
        std::string who = "tensor '" + op->name + "': server " + std::to_string(server);
        if (h.cmd == BPS_CMD_ERROR) {
            std::string body = m->count > 1 ? std::string((const char *)m->data(1), m->size(1)) : "{}";
            std::string msg = bps_json_error_field(body);
            set_error(op, BPS_ERR_SERVER, body);
            /* the others get what Python's owner sends: str(TensorMismatchError(...)) */
            local_broadcast(op, i, nullptr, "{\"error\":\"push_pull of tensor '" + bps_json_escape(op->name) +
                                                "' failed: " + (msg.empty() ? "unknown error" : msg) + "\"}");
            part_done(op);
            return;
        }
        std::string err;
        const unsigned char *src = nullptr;
        const void *desc = &p.desc;
        if (h.cmd != BPS_CMD_REPLY) {
            err = "unexpected command " + std::to_string(h.cmd) + " from server " + std::to_string(server);
        } else if (m->count < 2) {
            err = who + " replied without a body";
        } else if (h.flags & BPS_FLAG_COMPRESSED) {
            err = who + " replied compressed to an uncompressed push";
        } else if (h.flags & BPS_FLAG_SHM) { /* the others copy from the server's store directly */
            unsigned char *view;
            uint64_t len;
            if (view_shared(m->data(1), m->size(1), &view, &len, &err) == 0 && len != p.length)
                err = who + " replied " + std::to_string(len) + " bytes for a partition of " + std::to_string(p.length);
            src = view;
            desc = m->data(1);
        } else if (m->size(1) != p.length) {
            err = who + " replied " + std::to_string(m->size(1)) + " bytes for a partition of " +
                  std::to_string(p.length);
        } else { /* over TCP: into our shared region, which the others read */
            memcpy(p.staging, m->data(1), p.length);
            src = p.staging;
        }
        if (!err.empty()) {
            local_failed(op, i, BPS_ERR_PROTOCOL, err);
            return;
        }
        retain(p, h.round, op->dtype, src, p.length);
        local_broadcast(op, i, desc, "");
        stage_or_inline(BPS_TASK_COPY_OUT, op, i, op->buf + p.offset, {src});
    }

    /* A partition of an owner failed: the op fails, and the others are told (ERROR), as in Python. */
    void local_failed(BpsOp *op, int i, int kind, const std::string &text) {
        set_error(op, kind, text);
        local_broadcast(op, i, nullptr, bps_json_error(text));
        part_done(op);
    }

    /* LOCAL_BROADCAST: LOCAL_DONE with the result's descriptor, or ERROR with ``error_body``, to every
     * other local rank (those in join() too, as Python does: they drop it). */
    void local_broadcast(BpsOp *op, int i, const void *desc, const std::string &error_body) {
        BpsPart &p = op->parts[i];
        BpsHeader h = desc ? bps_header(BPS_CMD_LOCAL_DONE, node_id_, p.key, p.rnd, p.length, BPS_NO_DTYPE,
                                        (uint32_t)local_rank_, BPS_FLAG_SHM)
                           : bps_header(BPS_CMD_ERROR, node_id_, p.key, p.rnd, error_body.size(), BPS_NO_DTYPE,
                                        (uint32_t)local_rank_, 0);
        for (int r = 0; r < local_size_; ++r) {
            if (r == local_rank_) continue;
            if (desc)
                send_local(r, &h, desc, BPS_DESCRIPTOR_SIZE);
            else
                send_local(r, &h, error_body.data(), error_body.size());
        }
    }

    /* Local rank ``r``'s direct link while it works, else NULL (its DEALER then). */
    BpsConn *live_local_link(int r) {
        if (r < 0 || (size_t)r >= local_links_.size()) return nullptr;
        BpsConn *l = local_links_[(size_t)r].get();
        return l != nullptr && !l->dead() ? l : nullptr;
    }

    int send_local(int r, const BpsHeader *h, const void *body, size_t n) {
        std::unique_lock<std::recursive_mutex> link_lock(*local_link_mu_[(size_t)r]); /* a direct caller may hold it briefly */
        BpsConn *l = live_local_link(r);
        if (l != nullptr) {
            BpsFrames f;
            f.copy(h, sizeof *h);
            f.copy(body, n);
            if (l->send(f) == 0) {
                local_link_sent_.fetch_add(1);
                return 0;
            }
            /* it broke just now: the DEALER takes this one */
        }
        void *sock = peers_[r];
        int rc = bps_send_copy(sock, h, sizeof *h, true);
        if (rc == 0) rc = bps_send_copy(sock, body, n, false);
        return rc;
    }

    void part_done(BpsOp *op) {
        if (op->done.load()) return;
        if (--op->parts_left <= 0) complete(op);
    }

    /* A message on our local ROUTER, or on a local link (``linked``: authenticated by its token, the
     * identity frame put there by us): [identity, header, body]. */
    void on_local(BpsMessage *m, bool linked = false) {
        BpsHeader h;
        if (m->count != 3 || m->truncated) {
            forward_local(m);
            return;
        }
        std::string ident((const char *)m->data(0), m->size(0));
        if ((!auth_open_ && !linked && allowed_.count(ident) == 0) || !bps_parse_header(m->data(1), m->size(1), &h)) {
            forward_local(m); /* handshakes, strangers, malformed: Python answers, refuses or logs */
            return;
        }
        Ident id(h.key, h.round);
        if (h.cmd == BPS_CMD_LOCAL_READY) {
            std::string header((const char *)m->data(1), m->size(1)), body((const char *)m->data(2), m->size(2));
            auto g = groups_.find(id);
            if (g != groups_.end()) {
                add_copy(g->second, header, body);
                maybe_reduce(id);
                return;
            }
            auto c = claimed_.find(id);
            if (c != claimed_.end() || python_local_mode_) {
                if (c != claimed_.end() && --c->second <= 0) claimed_.erase(c);
                forward_local(m);
                return;
            }
            std::lock_guard<std::mutex> lock(early_mu_);
            early_[id].push_back({ident, header, body}); /* before our op: held until it starts (or its direct owner takes it) */
            return;
        }
        auto a = awaiting_.find(id);
        if ((h.cmd == BPS_CMD_LOCAL_DONE || h.cmd == BPS_CMD_ERROR) && a == awaiting_.end() && held_direct(id)) {
            BpsMessage *keep = new BpsMessage(); /* a direct caller's, come by the ROUTER: kept for its hand-over */
            for (int i = 0; i < m->count; ++i) m->take(i, &keep->frames[i]);
            keep->count = m->count;
            m->count = 0;
            delete early_done_[id].first; /* (none: one reply per partition) */
            early_done_[id] = std::make_pair(keep, linked);
            take_direct();
            return;
        }
        if ((h.cmd != BPS_CMD_LOCAL_DONE && h.cmd != BPS_CMD_ERROR) || a == awaiting_.end()) {
            forward_local(m); /* Python's partition, or an op that failed already */
            return;
        }
        Await w = a->second;
        awaiting_.erase(a);
        BpsOp *op = w.op;
        BpsPart &p = op->parts[w.part];
        op->owed_local[w.owner]--;
        if (h.cmd == BPS_CMD_ERROR) {
            set_error(op, BPS_ERR_SERVER, std::string((const char *)m->data(2), m->size(2)));
            part_done(op);
            return;
        }
        unsigned char *src;
        uint64_t len;
        std::string err;
        if (view_shared(m->data(2), m->size(2), &src, &len, &err) != 0 || len != p.length) {
            if (err.empty())
                err = "copy_into: dst has " + std::to_string(p.length) + " bytes and src has " + std::to_string(len) +
                      " bytes";
            set_error(op, BPS_ERR_PROTOCOL, "tensor '" + op->name + "': local result unreadable: " + err);
            part_done(op);
            return;
        }
        stage_or_inline(BPS_TASK_COPY_OUT, op, w.part, op->buf + p.offset, {src});
    }

    /* A peer's shared memory named by a descriptor (BpsPeerMaps::view), from any thread. */
    int view_shared(const void *body, size_t n, unsigned char **ptr, uint64_t *len, std::string *err) {
        std::lock_guard<std::mutex> lock(maps_mu_);
        return maps_.view(body, n, ptr, len, err);
    }

    /* A direct local caller holds partition ``id`` (waits for it, or has handed it over unseen). */
    bool held_direct(const Ident &id) {
        std::lock_guard<std::mutex> lock(mu_);
        if (local_direct_ids_.count(id)) return true;
        for (auto &a : local_adopt_in_)
            if (Ident(a.op->parts[(size_t)a.part].key, a.seq) == id) return true;
        return false;
    }

    /* Python took partition ``id`` (claim): the copies we hold for it, and ``count`` more, are its. */
    void local_claimed(const Ident &id, int count) {
        std::vector<std::vector<std::string>> held;
        {
            std::lock_guard<std::mutex> lock(early_mu_);
            auto e = early_.find(id);
            if (e != early_.end()) {
                held = std::move(e->second);
                early_.erase(e);
            }
        }
        for (auto &frames : held) {
            forward_local(frames);
            count--;
        }
        if (count > 0) claimed_[id] = count;
    }

    void forward_local(BpsMessage *m) {
        std::vector<std::string> frames;
        for (int i = 0; i < m->count; ++i) frames.emplace_back((const char *)m->data(i), m->size(i));
        forward_local(frames);
    }

    void forward_local(const std::vector<std::string> &frames) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            forward_local_.push_back(frames);
        }
        notify_python();
    }

    uint32_t node_id_;
    BpsCredit credit_;  /* network-thread state: bytes in flight by urgency */
    double timeout_;
    int nthreads_;
    int notify_fd_;
    int wake_fd_, done_fd_;
    std::vector<void *> socks_;
    std::unique_ptr<BpsUcxWorker> ucx_;           /* this thread's UCP worker (UCX links); outlives links_ */
    std::mutex ucx_mu_; /* the UCP worker's user: byteps-net, or while it polls a direct caller (submit_direct) */
    std::vector<std::unique_ptr<BpsConn>> links_; /* per server: its direct link (TCP or UCX), or NULL */
    std::vector<std::unique_ptr<std::mutex>> link_mu_; /* per server: who writes or reads its link now */
    std::deque<std::atomic<bool>> direct_owned_;      /* per server: a direct caller holds its link */
    std::atomic<uint64_t> direct_calls_{0}, direct_adopted_{0};
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
    std::deque<std::pair<double, int64_t>> deferred_; /* (completed at, id) of lazy ops, oldest first */
    uint64_t lazy_late_ = 0;
    std::vector<BpsForward> forward_;
    bool abort_ = false;
    int64_t net_ops_ = 0;                       /* ops byteps-net runs that are not done: a direct call needs 0 */
    std::vector<BpsQueued> adopt_in_;           /* direct partitions handed over (seq: their round) */
    std::vector<std::pair<int, BpsMessage *>> strays_in_; /* messages direct callers read for others */
    std::vector<BpsQueued> local_adopt_in_;     /* direct local partitions handed over (seq: their round) */
    std::vector<BpsMessage *> local_strays_in_; /* local-link messages direct callers read for others */
    std::set<std::pair<uint64_t, uint64_t>> local_direct_ids_; /* (key, round) a direct local caller waits for */
    std::vector<std::string> allow_in_;                   /* identities Python admitted */
    std::vector<std::pair<Ident, int>> claims_in_;        /* partitions Python took */
    std::vector<std::vector<std::string>> forward_local_; /* local messages for Python */
    bool python_local_ = false;                           /* local_python() was called */
    /* elastic servers (hold() / commit()) */
    bool holding_ = false;                                /* ops submitted now wait in held_ */
    std::vector<BpsOp *> held_;
    bool dead_in_ = false, commit_in_ = false;            /* for byteps-net's next turn */
    std::vector<int> alive_;                              /* the membership's servers, in order */
    std::vector<std::pair<std::set<int>, std::vector<int>>> reroutes_; /* each commit(): (dead, alive) */
    bool retain_ = false;                                 /* set_elastic(): keep each key's latest result */
    bool lone_machine_ = false;                           /* set_lone_machine(): no server round trip */
    std::mutex retain_mu_;
    std::unordered_map<uint64_t, BpsRetained> retained_;
    std::atomic<uint64_t> results_sent_{0};
    std::vector<std::pair<void *, int>> new_servers_;     /* (DEALER, link fd) of servers that joined */
    std::vector<int> lost_;                               /* servers whose link broke, for Python */
    std::atomic<int> nservers_{0};
    std::deque<std::atomic<bool>> colocated_;             /* per server: on this machine (shared memory) */
    std::atomic<uint64_t> holds_{0};                      /* hold() calls */
    uint64_t commits_ = 0;                                /* commit() calls */
    std::deque<std::atomic<bool>> dead_;                  /* per server: left the job */

    std::mutex rounds_mu_;
    std::unordered_map<uint64_t, uint64_t> rounds_;

    std::mutex zc_mu_;
    std::vector<int64_t> released_;

    /* network-thread state */
    std::priority_queue<BpsQueued, std::vector<BpsQueued>, BpsByUrgency<BpsQueued>> queue_;
    uint64_t seq_ = 0;
    std::map<std::pair<uint64_t, uint64_t>, std::pair<BpsOp *, int>> pending_;
    BpsPeerMaps maps_;
    uint64_t commits_net_ = 0;              /* commit()s byteps-net has taken (awaiting_commit()) */
    std::vector<int> alive_net_;            /* commit()'s membership */
    std::vector<BpsQueued> stranded_;       /* partitions waiting for a dead server's replacement */
    std::vector<bool> reported_;            /* per server: its broken link was reported */
    bool have_done_ = false;

    /* local reduce: set up by add_local() before start(); then network-thread state */
    void *router_ = nullptr;
    std::vector<void *> peers_;
    int local_rank_ = 0, local_size_ = 1;
    bool auth_open_ = false;
    BpsStageThread *stage_ = nullptr;
    std::set<std::string> allowed_;
    std::map<Ident, Group> groups_;
    std::map<Ident, Await> awaiting_;
    std::map<Ident, std::vector<std::vector<std::string>>> early_; /* LOCAL_READYs before their op */
    std::mutex early_mu_; /* early_: byteps-net, and a direct owner taking its copies (submit_owner_direct) */
    /* partitions a direct owner handed to byteps-net, with the copies it had taken (mu_) */
    std::vector<std::pair<BpsOp *, std::vector<std::vector<std::string>>>> owner_adopt_in_;
    std::atomic<uint64_t> owner_direct_{0};
    double direct_spin_s_ = 0; /* set_direct_spin(), before start() */
    std::map<Ident, int> claimed_;
    bool python_local_mode_ = false;
    std::atomic<uint64_t> joined_mask_{0};
    std::atomic<bool> recheck_{false};
    std::atomic<uint64_t> local_reduced_{0}, local_threaded_{0}, local_coordinated_{0};
    std::vector<std::unique_ptr<BpsConn>> local_links_; /* per local rank: its direct link, or NULL */
    /* per local rank: who writes or reads its link now (recursive: byteps-net sends on a link while it
     * reads it), and whether a direct caller holds it (then byteps-net does not poll it) */
    std::vector<std::unique_ptr<std::recursive_mutex>> local_link_mu_;
    std::deque<std::atomic<bool>> local_direct_owned_;
    /* byteps-net: a LOCAL_DONE / ERROR that reached the ROUTER for a partition a direct caller still held
     * (kept until it is handed over), with whether it came on a link */
    std::map<std::pair<uint64_t, uint64_t>, std::pair<BpsMessage *, bool>> early_done_;
    std::mutex maps_mu_; /* maps_: byteps-net and direct local callers read results through it */
    std::vector<std::string> local_link_ident_;         /* per local rank: its DEALER identity (frame 0) */
    std::atomic<uint64_t> local_link_sent_{0}, local_link_received_{0};
    std::atomic<uint64_t> credit_stalls_{0};
    std::string first_stall_; /* guarded by mu_ */
};

#endif
