/* The NCCL stages of CUDA tensors on a machine of several GPU processes (BYTEPS_LOCAL_STRATEGY=topology;
 * docs/architecture.md, "NCCL stages"): NCCL_REDUCE onto the root's GPU, NCCL_BROADCAST from there.
 *
 * What it owns, and which threads call it:
 *   - NCCL (nccl_runtime.h), loaded on the first CUDA tensor, and the machine's communicator. Local
 *     rank 0 sends its unique id (NCCL_ID); each process creates its rank on the thread byteps-nccl,
 *     since ncclCommInitRank blocks until all L have called it;
 *   - the order of the collectives: NCCL needs one order on every rank, so local rank 0 decides it
 *     from the NCCL_READYs and sends it (NCCL_ORDER); every process issues strictly in that order,
 *     each as soon as its partition is in that stage here (next()), so the processes may submit in
 *     any order;
 *   - broken: once a collective cannot be issued anywhere, the communicator is aborted and every NCCL
 *     op here and on the others (NCCL_ABORT) fails with the reason.
 * Everything runs on byteps-net except the init thread, which shares only its Init record (it may
 * outlive this object); byteps-gpu waits for the collectives' events, like the copies'.
 */
#ifndef BPS_NCCL_STAGES_H
#define BPS_NCCL_STAGES_H

#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "core/pipeline/cuda_runtime.h"
#include "core/pipeline/nccl_runtime.h"
#include "core/pipeline/worker_types.h"

/* A process other than the coordinator times out an NCCL op this much later than BYTEPS_TIMEOUT. */
static const double BPS_NCCL_GRACE_S = 2.0;

class BpsNcclStages {
  public:
    /* (stage, wire key, op number of its table): one collective of the machine */
    typedef std::tuple<int32_t, uint64_t, uint64_t> Entry;

    ~BpsNcclStages() { stop(); }

    /* Before byteps-net's wake fd closes (and at destruction): the communicator is aborted, not destroyed
     * (ncclCommDestroy waits for collectives in flight, which the other processes, stopping too, may
     * never join); an init thread still waiting aborts what it gets and wakes nobody. */
    void stop() {
        std::lock_guard<std::mutex> lock(init_->mu);
        if (init_->abandoned) return;
        init_->abandoned = true;
        if (init_->done.load() && init_->comm != nullptr && !aborted_) nccl_.CommAbort(init_->comm);
        aborted_ = true;
    }

    /* Before byteps-net starts: this process is local rank ``rank`` of a machine of ``size`` (a peer's
     * NCCL message may come before our first CUDA tensor). */
    void set_machine(int rank, int size) {
        rank_ = rank;
        size_ = size;
    }
    /* Once, with the first CUDA tensor: load NCCL at ``path``; the communicator's set-up will be
     * announced on ``wake_fd`` (byteps-net's). "" or why not. */
    std::string load(const std::string &path, int wake_fd) {
        if (nccl_.loaded()) return "";
        std::string err = nccl_.load(path);
        if (!err.empty()) return err;
        wake_fd_ = wake_fd;
        return "";
    }
    bool enabled() const { return nccl_.loaded(); }
    int rank() const { return rank_; }
    int size() const { return size_; }
    bool coordinator() const { return rank_ == 0; }
    const std::string &broken() const { return broken_; }

    /* byteps-net: the first NCCL op here, on CUDA device ``device``: the communicator's set-up starts
     * (the coordinator makes the id: ``send_id`` gets it for the others). "" or why not. */
    std::string begin(int device, BpsCudart &cuda, std::string *send_id) {
        if (begun_) {
            if (device != device_)
                return "this process's NCCL communicator is on CUDA device " + std::to_string(device_) +
                       ", not " + std::to_string(device) + " (one GPU per process on the NCCL stages)";
            return "";
        }
        begun_ = true;
        device_ = device;
        cuda_ = &cuda;
        if (coordinator()) {
            std::string err = cuda.check(cuda.SetDevice(device), "cudaSetDevice");
            if (err.empty()) err = nccl_.check(nccl_.GetUniqueId(&id_), "ncclGetUniqueId");
            if (!err.empty()) return err;
            have_id_ = true;
            send_id->assign(id_.internal, sizeof id_.internal);
        }
        if (have_id_) start_init();
        return "";
    }

    /* byteps-net: the coordinator's NCCL_ID came (maybe before our first NCCL op). */
    void take_id(const void *data, size_t n) {
        if (have_id_ || n != sizeof id_.internal) return;
        memcpy(id_.internal, data, n);
        have_id_ = true;
        if (begun_) start_init();
    }

    /* byteps-net: the communicator exists (collectives may be issued) */
    bool ready() const { return init_->done.load() && init_->error.empty(); }
    /* byteps-net: why creating the communicator failed ("" if it did not, or is not done) */
    std::string init_failure() const { return init_->done.load() ? init_->error : std::string(); }
    /* what a partition that cannot move waits for, for a time-out's message ("" if not the communicator) */
    std::string waiting_for() const {
        if (!begun_) return "";
        if (!have_id_) return "local rank 0's NCCL id (it has not reached its first CUDA push_pull)";
        if (!init_->done.load())
            return "the NCCL communicator of this machine's " + std::to_string(size_) +
                   " processes (a local rank has not reached its first CUDA push_pull)";
        return "";
    }

    /* The coordinator: local rank ``from`` has collective ``e`` ready (a reduce: the partition is in its
     * NCCL_REDUCE; a broadcast: the root has its result). True: every rank needed is, order it now. */
    bool ready_from(const Entry &e, int from) {
        if (std::get<0>(e) == BPS_STAGE_NCCL_BROADCAST) return true; /* only its root says so */
        uint64_t &bits = ready_[e];
        bits |= 1ull << from;
        if (bits != (size_ >= 64 ? ~0ull : (1ull << size_) - 1)) return false;
        ready_.erase(e);
        return true;
    }
    /* local ranks the coordinator still waits for to order ``e`` (for a time-out's message) */
    std::vector<int> missing(const Entry &e) const {
        std::vector<int> out;
        auto it = ready_.find(e);
        for (int r = 0; r < size_; ++r)
            if (it == ready_.end() || !(it->second & (1ull << r))) out.push_back(r);
        return out;
    }

    /* Every process: collective ``e`` is next in the machine's order (the coordinator's NCCL_ORDER). */
    void ordered(const Entry &e) { order_.push_back(e); }
    /* Partition ``i`` of ``op`` is in stage ``e``'s stage here: it is issued when its turn comes. */
    void arrived(const Entry &e, BpsOp *op, int i) { here_[e] = std::make_pair(op, i); }
    /* The next collective to issue, if its turn came and its partition is here: (op, part), else NULL op. */
    std::pair<BpsOp *, int> next() {
        if (order_.empty()) return std::make_pair(nullptr, -1);
        auto it = here_.find(order_.front());
        if (it == here_.end()) return std::make_pair(nullptr, -1);
        auto got = it->second;
        here_.erase(it);
        order_.pop_front();
        return got;
    }
    /* whether ``e``'s partition is here, not issued yet */
    bool is_here(const Entry &e) const { return here_.count(e) != 0; }
    /* whether our turn of ``e`` came (for a time-out's message: waiting for the order or for a peer) */
    bool was_ordered(const Entry &e) const {
        for (auto &o : order_)
            if (o == e) return true;
        return false;
    }
    int issued() const { return (int)issued_.load(); }

    /* byteps-net: issue ``stage`` (NCCL_REDUCE or NCCL_BROADCAST) of the ``length`` bytes at ``dev`` of
     * dtype ``dtype`` onto local rank ``root`` on stream ``s``, in place; "" or the error. */
    std::string collective(int32_t stage, unsigned char *dev, uint64_t length, uint8_t dtype, int root,
                           bps_cuda_stream s) {
        int type = bps_nccl_dtype(dtype);
        int size = bps_itemsize(dtype);
        if (type < 0 || size <= 0) return "NCCL has no type for dtype code " + std::to_string(dtype);
        size_t count = (size_t)(length / (uint64_t)size);
        issued_.fetch_add(1);
        if (stage == BPS_STAGE_NCCL_REDUCE)
            return nccl_.check(nccl_.Reduce(dev, dev, count, type, BPS_NCCL_SUM, root, init_->comm, s), "ncclReduce");
        return nccl_.check(nccl_.Broadcast(dev, dev, count, type, root, init_->comm, s), "ncclBroadcast");
    }

    /* byteps-net: the machine's order cannot go on (``why``): abort the communicator (a collective
     * in flight returns), forget what waits. True the first time. */
    bool set_broken(const std::string &why) {
        if (!broken_.empty()) return false;
        broken_ = why;
        if (init_->done.load() && init_->comm != nullptr && !aborted_) nccl_.CommAbort(init_->comm);
        aborted_ = true;
        order_.clear();
        here_.clear();
        ready_.clear();
        return true;
    }
    /* byteps-net: the partitions that wait here for their turn (to fail them once broken) */
    std::vector<std::pair<BpsOp *, int>> waiting() const {
        std::vector<std::pair<BpsOp *, int>> out;
        for (auto &kv : here_) out.push_back(kv.second);
        return out;
    }

  private:
    /* What the init thread hands over: written under ``mu``, then ``done`` */
    struct Init {
        std::mutex mu;
        std::atomic<bool> done{false};
        bool abandoned = false; /* stop(): nobody waits any more */
        bps_nccl_comm comm = nullptr;
        std::string error;
    };

    void start_init() {
        std::shared_ptr<Init> st = init_;
        BpsNccl nccl = nccl_; /* copies of the function pointers: the thread may outlive this object */
        BpsCudart cuda = *cuda_;
        BpsNcclId id = id_;
        int device = device_, size = size_, rank = rank_, wake_fd = wake_fd_;
        std::thread([st, nccl, cuda, id, device, size, rank, wake_fd] {
            prctl(PR_SET_NAME, "byteps-nccl", 0, 0, 0);
            std::string err = cuda.check(cuda.SetDevice(device), "cudaSetDevice");
            bps_nccl_comm comm = nullptr;
            if (err.empty()) err = nccl.check(nccl.CommInitRank(&comm, size, id, rank), "ncclCommInitRank");
            std::lock_guard<std::mutex> lock(st->mu);
            st->comm = comm;
            st->error = err;
            st->done.store(true);
            if (st->abandoned) {
                if (comm != nullptr) nccl.CommAbort(comm);
                return;
            }
            bps_signal(wake_fd);
        }).detach();
    }

    BpsNccl nccl_;
    BpsCudart *cuda_ = nullptr;
    int rank_ = 0, size_ = 1, wake_fd_ = -1;
    int device_ = -1;
    bool begun_ = false, have_id_ = false;
    BpsNcclId id_{};
    std::shared_ptr<Init> init_ = std::make_shared<Init>();
    bool aborted_ = false; /* the communicator was aborted (set_broken, stop) */
    std::string broken_;
    std::map<Entry, uint64_t> ready_;               /* the coordinator: local ranks ready, per collective */
    std::deque<Entry> order_;                       /* the machine's order, from our next turn on */
    std::map<Entry, std::pair<BpsOp *, int>> here_; /* partitions here in their NCCL stage, not issued */
    std::atomic<uint64_t> issued_{0};
};

#endif
