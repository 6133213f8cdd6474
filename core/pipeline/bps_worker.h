/* The worker's native data plane: the network thread byteps-net, which moves every partition through
 * its stage list without the GIL (docs/architecture.md, "Threads, and where the GIL is taken").
 *
 * BpsWorkerCore is the coordinator: byteps-net's loop, submit, advance(), the local reduce's groups,
 * the hand-overs from direct callers. Each part with a seam of its own is a class it owns, in its own
 * header, whose top comment says what it owns and which threads call it (server_links.h,
 * local_peers.h, elastic_router.h, early_copies.h, send_queue.h, stage_thread.h, gpu_copier.h,
 * nccl_stages.h, op_table.h). Its member functions live in one header per part (worker_*.h),
 * included at the end of this one.
 *
 * The data members' order is their order of construction and destruction: servers_ comes before
 * elastic_, which keeps a reference to it, and ops_ before them both.
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
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/kernels/bps_reduce.h"
#include "core/pipeline/bps_queue.h"
#include "core/pipeline/bps_trace.h"
#include "core/transport/bps_link.h"
#include "core/transport/bps_ucx.h"
#include "core/transport/bps_wire.h"
#include "core/transport/bps_zmq.h"
#include "core/pipeline/early_copies.h"
#include "core/pipeline/gpu_copier.h"
#include "core/pipeline/elastic_router.h"
#include "core/pipeline/local_peers.h"
#include "core/pipeline/nccl_stages.h"
#include "core/pipeline/op_table.h"
#include "core/pipeline/send_queue.h"
#include "core/pipeline/server_links.h"
#include "core/pipeline/stage_thread.h"
#include "core/pipeline/worker_types.h"

class BpsWorkerCore {
  public:
    /* the network thread byteps-net: start, submit, its loop and inbox, PULL (worker_loop.h) */
    BpsWorkerCore(uint32_t node_id, int64_t credit, double timeout, int nthreads, int notify_fd);
    ~BpsWorkerCore();
    void start();
    void stop();
    int64_t add_table(const std::string &name, std::vector<BpsPart> parts, const BpsTableCodec *codec = nullptr,
                      int64_t codec_of = -1);
    void submit_table(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority,
                      bool root_self, unsigned char *buf, uint64_t nbytes, bool lazy = false, uint32_t divisor = 1);
    void submit(BpsOp *op);
    void submit_locked(BpsOp *op);
    /* CUDA tensors (BpsGpuCopier, gpu_copier.h): load the runtime once before the first submit_gpu() of
     * an op of device memory, whose partitions are copied off the GPU and back per partition */
    std::string enable_gpu(const std::string &cudart, uint64_t slot_bytes, int slots) {
        return gpu_->load(cudart, slot_bytes, slots, wake_fd_);
    }
    void submit_gpu(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority,
                    bool root_self, uint64_t dev_ptr, int device, uint64_t nbytes, uint64_t ready_event,
                    uint64_t done_event, bool lazy, uint32_t divisor);
    /* The NCCL stages (BpsNcclStages, nccl_stages.h): load NCCL once, with the CUDA runtime, on a machine of
     * several processes whose CUDA push_pulls take them (tables whose partitions have NCCL roots) */
    std::string enable_nccl(const std::string &path) { return nccl_.load(path, wake_fd_); }
    uint64_t nccl_collectives() const { return (uint64_t)nccl_.issued(); }
    uint64_t gpu_peak_slots() const { return gpu_->peak_slots(); }
    uint64_t gpu_copies() const { return gpu_->copies(); }
    uint64_t gpu_grown() const { return gpu_->grown(); }
    /* a call this rank refused on a tensor the others reuse the key of: its rounds, abandoned (``reason``) */
    void submit_abandon(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root, bool root_self,
                        unsigned char *buf, uint64_t nbytes, const std::string &reason);
    uint64_t next_round(uint64_t key);
    void reset_rounds();

    /* server links (BpsServerLinks, server_links.h): set up by Python, counters for byteps.metrics() */
    bool add_server() { return servers_.add(); }
    bool add_server_live(int fd) { /* elastic: byteps-net adopts it at its next turn */
        if (!servers_.add_live(fd)) return false;
        wake();
        return true;
    }
    void set_colocated(int server, bool on) { servers_.set_colocated(server, on); }
    void lost_links(std::vector<int> *out) { servers_.lost(out); }
    std::string add_ucx_link(int server, const std::string &host, int port, const std::string &token,
                             const std::string &ident, double timeout) {
        return servers_.add_ucx_link(server, host, port, token, ident, timeout);
    }
    std::string link_transport(int server) { return servers_.transport(server); }
    int links_up() const { return servers_.up(); }
    void add_link(int server, int fd) { servers_.add_link(server, fd); }
    uint64_t bytes_sent(int server) { return servers_.bytes_sent(server); }
    uint64_t bytes_received(int server) { return servers_.bytes_received(server); }

    /* the send queue (BpsSendQueue, send_queue.h): PUSH, Python's raw sends (worker_send_queue.h) */
    uint64_t credit_stalls(std::string *first);
    void set_credit(int64_t credit) { sendq_.set_credit(credit); } /* any thread: the next partitions see it */
    int64_t credit() const { return sendq_.credit(); }
    void send_raw(BpsRawSend *m);

    /* the op table and completions (BpsOpTable, op_table.h): waits (without the GIL), lazy delivery */
    bool is_done(int64_t id) { return ops_.is_done(id); }
    bool wait_op(int64_t id, int timeout_ms) { return ops_.wait(id, timeout_ms); }
    void completions(std::vector<int64_t> *out, int timeout_ms) { ops_.completions(out, timeout_ms); }
    uint64_t lazy_late() { return ops_.lazy_late(); }
    void prompt(int64_t id) { ops_.prompt(id); }
    BpsOp *op(int64_t id) { return ops_.find(id); } /* a completed op's result; it stays until forget() */
    /* errors, aborts, forgetting ops (worker_completions.h) */
    void fail_all();
    bool forget(int64_t id);
    void forwarded(std::vector<BpsForward> *out);
    static void zc_free(void *, void *hint);

    /* the local reduce: LOCAL_READY / LOCAL_DONE, its groups, the stage thread (worker_local_reduce.h) */
    static bool local_header(BpsMessage &msg, BpsHeader *h);
    void stray_local(BpsMessage &msg, bool *strays);
    void add_local(void *router, int local_rank, int local_size);
    /* local links and admission (BpsLocalPeers, local_peers.h) */
    std::string add_local_link(int r, int fd, const std::string &ident, int ring_fd = -1, bool low = false) {
        return local_.add_link(r, fd, ident, ring_fd, low);
    }
    int local_rings_up() const { return local_.rings_up(); }
    int local_links_up() const { return local_.links_up(); }
    void set_local_joined(uint64_t mask);
    /* join() ended ``ends`` times: LOCAL_READYs carry the parity, so that a peer still in join() tells
     * the copies of our next op (rounds restarted at 0) from a joined rank's partitions */
    void set_join_ends(uint64_t ends) { join_epoch_.store((ends & 1) != 0); }
    uint8_t join_epoch_flag() const { return join_epoch_.load() ? (uint8_t)BPS_FLAG_JOIN_EPOCH : 0; }
    /* join(): this process is in join() (or no longer). It has no ops of its own but owns partitions of
     * its peers' ops: each one whose first copy arrives is asked of Python (owed()), which registers
     * its table and submits it (submit_owed) */
    void set_self_joined(bool on);
    void owed(std::vector<BpsOwed> *out);
    void submit_owed(int64_t id, int64_t table, uint64_t rnd, uint8_t dtype, unsigned char *buf, uint64_t nbytes);
    void forwarded_local(std::vector<std::vector<std::string>> *out);
    /* The job has one worker machine (before start()): its local reduce is the whole sum, so an owner
     * broadcasts it at once instead of a round trip through a server (core/stages.py, "one machine"). */
    void set_lone_machine(bool on) { lone_machine_ = on; }
    uint64_t local_link_sent() const { return local_.sent(); }
    uint64_t local_link_received() const { return local_.received(); }
    /* Partitions reduced natively (all, and on the stage thread), and copies handed to owners. */
    uint64_t local_reduced() { return local_reduced_.load(); }
    uint64_t local_reduced_on_thread() { return local_threaded_.load(); }
    uint64_t local_coordinated() { return local_coordinated_.load(); }
    uint64_t owed_submitted() { return owed_submitted_.load(); } /* partitions reduced for peers in join() */

    /* direct calls: a synchronous call's round trip on the caller's thread (worker_direct.h) */
    bool submit_direct(int64_t id, int64_t table, uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority,
                       bool root_self, unsigned char *buf, uint64_t nbytes, uint32_t divisor = 1);
    void end_direct(BpsOp *op, bool replied, uint64_t rnd, std::vector<BpsQueued> *adopt);
    void count_direct(bool replied, bool more);
    static bool wait_link(BpsConn *l, double deadline, double spin_until);
    BpsOp *begin_direct(int64_t id, int64_t table, uint64_t seq, const BpsPart &part, const std::string &name,
                        uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority, bool root_self, unsigned char *buf,
                        uint64_t nbytes, uint32_t divisor, bool local, bool awaits_done);
    bool submit_local_direct(int64_t id, int64_t table, uint64_t seq, const BpsPart &part, const std::string &name,
                             uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority, unsigned char *buf,
                             uint64_t nbytes, uint32_t divisor);
    bool submit_owner_direct(int64_t id, int64_t table, uint64_t seq, const BpsPart &part, const std::string &name,
                             uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority, unsigned char *buf,
                             uint64_t nbytes, uint32_t divisor);
    bool owner_direct_wait(const BpsPart &p, const std::vector<int> &peers,
                           std::vector<std::vector<std::string>> *copies, bool *strays);
    bool local_direct_wait(BpsOp *op, int owner, BpsConn *l, bool *strays);
    /* How long a direct caller polls for its reply, yielding its core between polls, before it sleeps
     * (BYTEPS_SPIN_US): waking a sleeping thread costs more than a small round trip between awake ends. */
    void set_direct_spin(double seconds) { direct_spin_s_ = seconds > 0 ? seconds : 0; }
    /* Calls that completed on the caller's thread (submit_direct; tests check the path ran). */
    uint64_t direct_calls() const { return direct_calls_.load(); }
    /* Partitions step() moved into stage ``code`` (BPS_STAGE_*) so far (byteps.metrics()). */
    uint64_t entered(int32_t code) const {
        return code > 0 && code <= BPS_STAGE_COUNT ? entered_[code].load(std::memory_order_relaxed) : 0;
    }
    /* Partitions pushed encoded by their table's wire codec (worker_codec.h; byteps.metrics()). */
    uint64_t compressed_pushes() const { return compressed_pushes_.load(std::memory_order_relaxed); }
    /* Replies a link read straight into their partition's bytes (place_reply; byteps.metrics()). */
    uint64_t replies_in_place() const { return replies_in_place_.load(std::memory_order_relaxed); }
    /* Direct calls whose reply did not come within the window: byteps-net took them over. */
    uint64_t direct_adopted() const { return direct_adopted_.load(); }
    /* Partitions this process owned and reduced on the caller's thread (submit_owner_direct). */
    uint64_t local_owner_direct() { return owner_direct_.load(); }

    /* elastic servers: hold / commit, replacements of lost servers, retained results (worker_elastic.h,
     * BpsElasticRouter: elastic_router.h) */
    std::vector<uint64_t> hold(const std::vector<int> &dead);
    void commit(const std::vector<int> &alive, const std::vector<int64_t> &tables, const std::vector<uint64_t> &from,
                std::vector<std::vector<BpsPart>> segs);
    void add_segment(int64_t table, uint64_t from, std::vector<BpsPart> parts);
    /* BYTEPS_ELASTIC=1 (before start()): keep each key's latest result for a lost server's replacement. */
    void set_elastic(bool on) { elastic_.set_retain(on); }
    /* RESULTs sent to lost servers' replacements (tests check the path ran). */
    uint64_t results_sent() const { return elastic_.results_sent(); }

  private:
    /* the local reduce's partitions: (wire key, round), an owner's LOCAL_REDUCE, a non-owner's wait */
    typedef std::pair<uint64_t, uint64_t> Ident; /* (wire key, round) */

    struct Group { /* an owner's partition in LOCAL_REDUCE */
        BpsOp *op;
        int part;
        int count = 0;                         /* LOCAL_READYs in (copies or bad descriptors) */
        uint64_t ranks = 0;                    /* bit n: local rank n's copy is in */
        std::vector<const void *> copies;
        std::string error;                     /* the first unreadable copy */
        std::string abandon;                   /* a local rank refused the call: its reason (FLAG_ABANDON) */
        bool reducing = false;
    };

    struct Await { /* a non-owner's partition waiting for LOCAL_DONE */
        BpsOp *op;
        int part;
        int owner;
    };

    /* the network thread byteps-net: start, submit, its loop and inbox, PULL (worker_loop.h) */
    void wake();
    void run();
    void take_inbox();
    void forward(int server, BpsMessage *m);
    void on_message(int server, BpsMessage *m);
    void receive(BpsOp *op, BpsPart &p, int server, const BpsHeader &h, BpsMessage *m);

    /* PULL without a copy (worker_stages.h): server ``server``'s link reads a reply's sum straight into
     * its partition's bytes; ``placed_`` says, per server, which partition a frame is being read into */
    struct ReplySink : BpsFrameSink {
        BpsWorkerCore *core;
        int server;
        ReplySink(BpsWorkerCore *c, int s) : core(c), server(s) {}
        void *place(BpsMessage &head, int frame, uint64_t len) override {
            return core->place_reply(server, head, frame, len);
        }
    };
    struct Placed {
        uint64_t key = 0, round = 0;
        BpsOp *op = nullptr;
    };

    /* the stages: each partition's list and the one function that moves it on (worker_stages.h) */
    struct BpsReply { /* the server message on_message() is handling: PULL's input */
        int server = -1;
        const BpsHeader *h = nullptr;
        BpsMessage *m = nullptr;
    };
    void plan(BpsOp *op, int i);
    void start(BpsOp *op, int i);
    int32_t step(BpsOp *op, int i);
    void advance(BpsOp *op, int i);
    void gpu_copy(BpsOp *op, int i, bool d2h);
    void take_gpu_done();
    void grant_slots();
    void submit_new(BpsOp *op, int64_t table);
    void queue(BpsOp *op, int i);
    void pull(BpsOp *op, int i);
    void *place_reply(int server, BpsMessage &head, int frame, uint64_t len);
    void check_placed(int server, BpsConn *l);
    void take_reply(BpsOp *op, BpsPart &p, int server, const BpsHeader &h, BpsMessage *m);
    void local_broadcast_result(BpsOp *op, int i);

    /* the send queue (BpsSendQueue, send_queue.h): PUSH, Python's raw sends (worker_send_queue.h) */
    void send_raw_now(BpsRawSend *m);
    void send_ready();
    void push(BpsOp *op, int index);
    void send_push(BpsOp *op, int index);
    void release(BpsOp *op, int index);

    /* completions: the op table, errors, lazy delivery, waits, time-outs (worker_completions.h) */
    static BpsOp *new_op(int64_t id, uint8_t cmd, uint8_t dtype, uint32_t root, int64_t priority, bool root_self,
                         unsigned char *buf, uint64_t nbytes, uint32_t divisor);
    void notify_python();
    void set_error(BpsOp *op, int kind, const std::string &text);
    void fail(BpsOp *op, int kind, const std::string &text);
    void complete(BpsOp *op);
    void flush_completions();
    void check_timeouts(double now);
    void part_done(BpsOp *op);

    /* the local reduce: LOCAL_READY / LOCAL_DONE, its groups, the stage thread (worker_local_reduce.h) */
    void local_reduce(BpsOp *op, int i);
    void coordinate(BpsOp *op, int i);
    void take_early(Group &g, const Ident &id);
    void stage_or_inline(int kind, BpsOp *op, int i, void *dst, std::vector<const void *> srcs);
    void take_stage_done();
    void after_task(BpsStageTask &t);
    void add_copy(Group &g, const std::string &header, const std::string &body);
    void send_ready(BpsOp *op, const BpsPart &p, uint8_t flags, const void *body, size_t n);
    void abandon_local(BpsOp *op, int i);
    int expected_copies() const;
    std::vector<int> missing(const Group &g) const;
    void maybe_reduce(const Ident &id);
    void owner_pulled(BpsOp *op, int i, int server, const BpsHeader &h, BpsMessage *m);
    void local_failed(BpsOp *op, int i, int kind, const std::string &text);
    void local_broadcast(BpsOp *op, int i, const void *desc, const std::string &error_body);
    void on_local(BpsMessage *m);
    int view_shared(const void *body, size_t n, unsigned char **ptr, uint64_t *len, std::string *err);
    void ask_owed(const Ident &id, const BpsHeader &h);
    void self_joined_turn(bool on);
    void forward_local(BpsMessage *m);
    void forward_local(const std::vector<std::string> &frames);

    /* the NCCL stages: the machine's order of collectives, its messages, breaking it (worker_nccl.h) */
    void nccl_enter(BpsOp *op, int i, int32_t stage);
    void nccl_ready(const BpsNcclStages::Entry &e, int from);
    void nccl_issue();
    void on_nccl(const BpsHeader &h, const void *body, size_t n);
    void nccl_send(int r, uint8_t cmd, int32_t stage, uint64_t key, uint64_t seq, const std::string &body);
    void nccl_break(const std::string &why, bool here = true);
    std::string nccl_failure(const BpsOp *op) const;
    std::string nccl_waits(const BpsOp *op) const;

    /* direct calls: a synchronous call's round trip on the caller's thread (worker_direct.h) */
    bool direct_wait(BpsOp *op, int server, BpsConn *l, uint64_t rnd, bool *strays);
    void take_direct();
    bool held_direct(const Ident &id);

    /* elastic servers: a dead server's partitions wait for its replacement (worker_elastic.h) */
    void strand_dead();

    uint32_t node_id_;
    BpsSendQueue sendq_; /* network-thread state: partitions waiting for the credit, bytes in flight */
    BpsReply reply_;     /* network-thread state: the reply on_message() hands to PULL */
    std::atomic<uint64_t> entered_[BPS_STAGE_COUNT + 1] = {}; /* per stage code: partitions step() moved in */
    double timeout_;
    int nthreads_;
    int notify_fd_;
    int wake_fd_;
    /* every op and its completion (own mutex, taken after mu_ where both are: op_table.h); declared
     * before the links, so its ops outlive the zero-copy bodies a link still holds */
    BpsOpTable ops_;
    BpsServerLinks servers_; /* DEALERs, direct links, the UCP worker, per-server state (own mutexes) */
    BpsLocalPeers local_;    /* the local ROUTER, DEALERs and links, admission (own mutexes) */
    BpsElasticRouter elastic_; /* hold / commit, reroutes, stranded partitions, retained results (mu_) */
    std::atomic<uint64_t> direct_calls_{0}, direct_adopted_{0};
    std::atomic<uint64_t> compressed_pushes_{0}; /* pushes byteps-net encoded (send_push) */
    std::atomic<uint64_t> replies_in_place_{0};  /* replies read into their partition (receive) */
    std::thread thread_;
    std::atomic<bool> stopping_{false};

    std::mutex mu_; /* guards the inbox and everything Python touches below, and elastic_'s membership side */
    std::deque<BpsTable> tables_;
    std::vector<BpsQueued> inbox_;
    std::vector<std::unique_ptr<BpsRawSend>> raw_;
    std::vector<BpsForward> forward_;
    bool abort_ = false;
    std::vector<BpsQueued> adopt_in_;           /* direct partitions handed over (seq: their round) */
    std::vector<std::pair<int, BpsMessage *>> strays_in_; /* messages direct callers read for others */
    std::vector<BpsQueued> local_adopt_in_;     /* direct local partitions handed over (seq: their round) */
    std::vector<BpsMessage *> local_strays_in_; /* local-link messages direct callers read for others */
    std::set<std::pair<uint64_t, uint64_t>> local_direct_ids_; /* (key, round) a direct local caller waits for */
    std::vector<std::vector<std::string>> forward_local_; /* local messages for Python */
    bool self_joined_ = false;                            /* set_self_joined() */
    std::vector<BpsOwed> owed_out_;                       /* partitions a joined owner asks Python about */
    bool lone_machine_ = false;                           /* set_lone_machine(): no server round trip */

    std::mutex rounds_mu_;
    std::unordered_map<uint64_t, uint64_t> rounds_;

    /* network-thread state */
    uint64_t seq_ = 0;
    std::map<std::pair<uint64_t, uint64_t>, std::pair<BpsOp *, int>> pending_;
    std::vector<Placed> placed_; /* per server: the partition its link reads a reply into (place_reply) */
    BpsPeerMaps maps_;
    bool have_done_ = false;

    /* local reduce: set up by add_local() before start(); then network-thread state */
    int local_rank_ = 0, local_size_ = 1;
    BpsStageThread *stage_ = nullptr;
    /* COPYD2H / COPYH2D: the staging ring, the byteps streams, byteps-gpu (own mutexes); left allocated
     * if a copy never completed (its thread still waits for it: BpsGpuCopier::stop) */
    BpsGpuCopier *gpu_ = new BpsGpuCopier();
    BpsNcclStages nccl_; /* NCCL_REDUCE / NCCL_BROADCAST: the communicator, the machine's order (byteps-net) */
    std::map<Ident, Group> groups_;
    std::map<Ident, Await> awaiting_;
    BpsEarlyCopies early_; /* LOCAL_READYs before their op (own mutex: a direct owner takes its copies) */
    /* partitions a direct owner handed to byteps-net, with the copies it had taken (mu_) */
    std::vector<std::pair<BpsOp *, std::vector<std::vector<std::string>>>> owner_adopt_in_;
    std::atomic<uint64_t> owner_direct_{0};
    double direct_spin_s_ = 0; /* set_direct_spin(), before start() */
    bool self_joined_net_ = false;  /* byteps-net has taken set_self_joined(true) */
    std::set<Ident> owed_asked_;    /* partitions asked of Python while in join() */
    std::atomic<uint64_t> joined_mask_{0};
    std::atomic<bool> join_epoch_{false}; /* set_join_ends(): an odd number of join()s ended */
    std::atomic<bool> recheck_{false};
    std::atomic<uint64_t> local_reduced_{0}, local_threaded_{0}, local_coordinated_{0}, owed_submitted_{0};
    /* byteps-net: a LOCAL_DONE / ERROR that reached the ROUTER for a partition a direct caller still held
     * (kept until it is handed over), with whether it came on a link */
    std::map<std::pair<uint64_t, uint64_t>, BpsMessage *> early_done_;
    std::mutex maps_mu_; /* maps_: byteps-net and direct local callers read results through it */
    std::string first_stall_; /* the first send queue stall's tensor (guarded by mu_) */
};

/* The member functions, one header per part (each includes this one) */
#include "core/pipeline/worker_stages.h"
#include "core/pipeline/worker_loop.h"
#include "core/pipeline/worker_send_queue.h"
#include "core/pipeline/worker_completions.h"
#include "core/pipeline/worker_local_reduce.h"
#include "core/pipeline/worker_nccl.h"
#include "core/pipeline/worker_direct.h"
#include "core/pipeline/worker_elastic.h"

#endif
