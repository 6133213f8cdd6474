/* The worker core's records: an op and its partitions, a tensor's partition table, what waits in the
 * send queue, and what goes to and comes from Python; the limits every part of the core shares. */
#ifndef BPS_WORKER_TYPES_H
#define BPS_WORKER_TYPES_H

#include <stdio.h>
#include <string.h>
#include <time.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/kernels/bps_reduce.h"
#include "core/pipeline/bps_stages.h"
#include "core/pipeline/worker_codec.h"
#include "core/transport/bps_wire.h"

enum BpsErrorKind {
    BPS_OK = 0,
    BPS_ERR_SERVER = 1,    /* the server answered ERROR: detail is its JSON body */
    BPS_ERR_PROTOCOL = 2,  /* a reply that does not fit the partition */
    BPS_ERR_TIMEOUT = 3,   /* BYTEPS_TIMEOUT */
    BPS_ERR_ABORT = 4,     /* the engine failed (peer lost, ...): Python's failure stands */
    BPS_ERR_CUDA = 5,      /* a CUDA call of the copy stages failed: detail names the tensor and the call */
};

/* Partitions at least this large are summed / copied on the stage thread, smaller ones inline (the
 * hand-off costs more than the work): core/_worker_core.pyx STAGE_THREAD_MIN_BYTES. */
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
    int32_t nccl_root = -1; /* the NCCL stages (nccl_stages.h): the local rank whose GPU gets the machine's
                             * sum and pushes it; -1: none */
    bool colocated = false; /* local reduce: the owner pushes a descriptor of ``staging`` */
    bool compress = false;  /* its push is encoded by its table's codec (worker_codec.h): a server on another
                             * machine, and the codec applies to its size (WireCompressor.applies) */
    uint64_t rnd = 0;       /* its round: taken when the op starts (local reduce) or at its first push */
    bool has_rnd = false;   /* rnd is set: a push to a lost server's replacement keeps it (elastic servers) */
    uint64_t trace_t = 0;   /* timeline: when its current stage began (0: not traced) */
    uint64_t qseq = 0;      /* its place in the send queue: a lost server's partitions go back in it */
    /* its stages on this process, in order (bps_stage_list(), set when its op starts: worker_stages.h),
     * and the one it is in (-1: not started); only advance() moves it on */
    BpsStageList stages;
    int32_t at = -1;
    /* LOCAL_BROADCAST's input, set by the event that ends the stage before it: where the machine's
     * result is, and (owner) the descriptor its LOCAL_DONE names (read within that event) */
    const unsigned char *result = nullptr;
    const void *result_desc = nullptr;
    /* a CUDA tensor's partition: its page-locked staging slot (gpu_copier.h), its host bytes from its
     * first stage to its last; -1 / NULL: none held */
    int32_t slot = -1;
    unsigned char *host = nullptr;
    /* non-empty: this round is abandoned (FLAG_ABANDON), and why: this rank refused the call (its op's
     * ``abandons``), or, for an owner, a local rank that did (its LOCAL_READY); its push carries the text */
    std::string abandon;

    int32_t stage() const { return at >= 0 && at < stages.n ? stages.stage[at] : 0; }
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
    std::atomic<int> zero_copy{0}; /* bodies a link still reads from the tensor */
    std::atomic<bool> done{false};
    std::atomic<bool> direct{false}; /* its caller runs it (submit_direct): byteps-net leaves it alone */
    int waiters = 0;        /* callers blocked in wait_op(): the first to wake delivers the op */
    bool lazy = false;      /* (BpsOpTable's mutex) its completion waits for its caller (BPS_LAZY_DELIVERY_S) */
    int64_t table = -1;     /* the table it was submitted on, and its sequence number there: which */
    uint64_t seq = 0;       /* membership's partitions it uses (elastic servers, BpsTable::parts_for) */
    bool adds_nothing = false; /* a joined owner's sum of its local peers' copies (join()): its own buffer,
                                * zeros, is not added and gets no result */
    BpsTableCodec *codec = nullptr; /* its table's wire codec (the table outlives it), or NULL */
    uint32_t divisor = 1;   /* an averaged float push_pull: each partition's sum is divided by this on its
                             * way into the tensor (bps_result_into), so the average costs no pass of its own */
    /* a CUDA tensor (submit_gpu): its device memory, device ordinal, the producer's ready event (its
     * first copy waits for it) and the caller's done event (recorded after its last copy), as CUDA
     * handles; its partitions' host bytes are staging slots (BpsPart::host), ``buf`` is NULL */
    bool gpu = false;
    uint64_t dev_ptr = 0;
    int device = 0;
    uint64_t ready_event = 0, done_event = 0;
    bool gpu_waited = false; /* byteps-net: its copies' stream waits for the ready event already */
    bool nccl = false;       /* its partitions take the NCCL stages (its table's nccl_root are set) */
    /* submit_abandon(): this rank refused the call; its partitions push this reason instead of data, in the
     * rounds the call would have had, so the others' rounds fail at once and later rounds stay in step */
    std::string abandons;
};

/* Where partition ``p`` of ``op`` is in host memory: the tensor's bytes, or (a CUDA tensor) its slot. */
static inline unsigned char *bps_host_bytes(const BpsOp *op, const BpsPart &p) {
    return op->gpu ? p.host : op->buf + p.offset;
}

/* A partition's sum into the tensor at ``dst``: copied, or divided by the op's divisor on the way (an
 * average). ``stream``: a copy of 1 MB or more uses non-temporal stores (bps_copy_streamed). A sum
 * already at ``dst`` (a link read it there: place_reply) is only divided. */
static inline void bps_result_into(const BpsOp *op, void *dst, const void *src, size_t nbytes, bool stream,
                                   int nthreads = 1) {
    if (dst == src && op->divisor <= 1) return;
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
    bool nccl = false;      /* partitions have NCCL roots: the NCCL stages (CUDA tensors) */
    std::shared_ptr<BpsTableCodec> codec; /* the wire codec of its compressed partitions, or NULL */
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

/* Elastic servers: a key's latest result and the server it came from (BpsElasticRouter::retain). */
struct BpsRetained {
    uint64_t round = 0;
    int server = -1;
    uint8_t dtype = 0;
    std::string data;
};

/* Servers a worker can have over a job's life (elastic servers join and leave). */
static const int BPS_MAX_SERVERS = 256;

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


/* Python's answer to a local peer's handshake, on our local ROUTER to the peer ``ident``. */
struct BpsRawSend {
    std::string ident;
    std::string header;
    std::string body;
};

/* A message this thread does not own, for Python: the server it came from and its frames. */
struct BpsForward {
    int server;
    std::vector<std::string> frames;
};

/* A partition a process in join() owns and a local peer sent its copy of: (wire key, round, dtype,
 * bytes), for Python to register (BpsWorkerCore::owed). */
struct BpsOwed {
    uint64_t key, rnd;
    uint8_t dtype;
    uint64_t length;
};

#endif
