/* The GPU copy stages COPYD2H and COPYH2D of CUDA tensors, per partition (docs/architecture.md,
 * "CUDA tensors").
 *
 * What it owns, and which threads call it:
 *   - the CUDA runtime (cuda_runtime.h), loaded by load() on the first CUDA tensor, which also starts
 *     byteps-gpu;
 *   - per device a non-blocking byteps stream for the copies, one for the NCCL stages' collectives,
 *     and a pool of events;
 *   - the staging ring: ``slots`` page-locked buffers of ``slot_bytes`` (allocated on first use), one
 *     per partition from its first stage to its last, handed out by priority (then arrival). Where
 *     partitions waited BPS_SLOT_STALL_S with no slot coming back (workers holding slots for
 *     partitions the others have not reached), the ring grows by one slot (grown());
 *   - the completion thread byteps-gpu: it waits for each event in issue order (blocking-sync
 *     events: it sleeps) and hands the copy back to byteps-net through ``done`` and its eventfd.
 * byteps-net calls everything except release() (any thread) and the completion thread's loop; one
 * mutex guards the ring, another the thread's queues.
 */
#ifndef BPS_GPU_COPIER_H
#define BPS_GPU_COPIER_H

#include <sys/prctl.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <vector>

#include "core/pipeline/bps_queue.h"
#include "core/pipeline/bps_trace.h"
#include "core/pipeline/cuda_runtime.h"
#include "core/pipeline/worker_types.h"

/* Partitions that waited this long for a staging slot while none came back: the ring grows by one. */
static const double BPS_SLOT_STALL_S = 1.0;

/* One piece of GPU work in flight: which partition, the stage it ends (COPYD2H, COPYH2D, or an NCCL
 * stage: nccl_stages.h), the event that marks its end, when it was issued. */
struct BpsGpuCopy {
    BpsOp *op;
    int part;
    int32_t stage;
    int device;
    bps_cuda_event event;
    uint64_t t_issued;
    std::string error; /* the event's wait failed */
};

class BpsGpuCopier {
  public:
    ~BpsGpuCopier() { stop(); }

    /* Once, before the first CUDA tensor's op is submitted (byteps-net may run): load the runtime at
     * ``path``, size the ring and start byteps-gpu; copies that complete are announced on ``wake_fd``
     * (byteps-net's). "" on success, else why not. */
    std::string load(const std::string &path, uint64_t slot_bytes, int slots, int wake_fd) {
        if (enabled()) return "";
        if (slot_bytes == 0 || slots < 1) return "the GPU staging ring needs at least one slot of at least one byte";
        std::string err = cuda_.load(path);
        if (!err.empty()) return err;
        wake_fd_ = wake_fd;
        slot_bytes_ = slot_bytes;
        {
            std::lock_guard<std::mutex> lock(ring_mu_);
            slots_.assign((size_t)slots, nullptr);
            slot_size_.assign((size_t)slots, 0);
            for (int s = slots - 1; s >= 0; --s) free_.push_back(s);
        }
        {
            std::lock_guard<std::mutex> lock(mu_);
            thread_ = std::thread([this] { run(); });
        }
        enabled_.store(true);
        return "";
    }
    bool enabled() const { return enabled_.load(); }

    /* Stop byteps-gpu once the copies in flight are done, waiting at most ``wait_s``. False: a copy never
     * completed (the GPU, or a producer's event, is stuck) and the thread is left waiting for it,
     * detached: then this object must never be freed (BpsWorkerCore leaks it), nor its memory. */
    bool stop(double wait_s = 5.0) {
        std::unique_lock<std::mutex> lock(mu_);
        if (!thread_.joinable()) return !stuck_;
        stopping_ = true;
        cv_.notify_all();
        if (!exited_cv_.wait_for(lock, std::chrono::microseconds((int64_t)(wait_s * 1e6)), [this] { return exited_; })) {
            thread_.detach();
            stuck_ = true;
            return false;
        }
        lock.unlock();
        thread_.join();
        for (auto &kv : devices_) {
            cuda_.SetDevice(kv.first);
            for (bps_cuda_event e : kv.second.events) cuda_.EventDestroy(e);
            if (kv.second.stream != nullptr) cuda_.StreamDestroy(kv.second.stream);
            if (kv.second.nccl_stream != nullptr) cuda_.StreamDestroy(kv.second.nccl_stream);
        }
        for (unsigned char *s : slots_)
            if (s != nullptr) cuda_.FreeHost(s);
        return true;
    }

    /* byteps-net: a staging slot for partition ``i`` of ``op`` (its host bytes), or false: it waits for
     * one and comes back from granted(). "" in *err unless allocating the slot failed. */
    bool take_slot(BpsOp *op, int i, uint64_t seq, std::string *err) {
        BpsPart &p = op->parts[(size_t)i];
        std::lock_guard<std::mutex> lock(ring_mu_);
        if (free_.empty() || !waiters_.empty()) {
            if (waiters_.empty()) waiting_since_ = bps_now();
            op->tasks++; /* its op stays alive while it waits */
            waiters_.push(BpsQueued{op->priority, seq, op, i});
            return false;
        }
        *err = assign(op, p);
        return err->empty();
    }

    /* byteps-net: partitions that got a slot since the last call (by priority), or failed to. */
    void granted(std::vector<std::pair<BpsQueued, std::string>> *out) {
        std::lock_guard<std::mutex> lock(ring_mu_);
        while (!free_.empty() && !waiters_.empty()) {
            BpsQueued q = waiters_.top();
            waiters_.pop();
            if (q.op->done.load()) { /* failed while it waited: Python may free it once tasks is 0 */
                q.op->tasks--;
                continue;
            }
            q.op->tasks--; /* not done: only byteps-net (this thread) completes it, so it stays */
            std::string err = assign(q.op, q.op->parts[(size_t)q.part]);
            out->emplace_back(q, err);
        }
    }

    /* Any thread: partition ``p``'s slot back to the ring (wake byteps-net if someone waits for one). */
    bool release(BpsPart &p) {
        if (p.slot < 0) return false;
        std::lock_guard<std::mutex> lock(ring_mu_);
        free_.push_back(p.slot);
        p.slot = -1;
        p.host = nullptr;
        in_use_--;
        last_release_ = bps_now();
        return !waiters_.empty();
    }

    /* byteps-net, now and then: partitions waited BPS_SLOT_STALL_S for a slot and none came back: one
     * more slot (true: grant_slots() has one to hand out). */
    bool unstall(double now) {
        std::lock_guard<std::mutex> lock(ring_mu_);
        if (waiters_.empty() || !free_.empty() || now - std::max(last_release_, waiting_since_) < BPS_SLOT_STALL_S)
            return false;
        slots_.push_back(nullptr);
        slot_size_.push_back(0);
        free_.push_back((int)slots_.size() - 1);
        grown_++;
        last_release_ = now;
        return true;
    }

    /* byteps-net: issue partition ``i``'s copy (device -> its slot, or back) on the device's stream;
     * "" or the CUDA error. */
    std::string copy(BpsOp *op, int i, bool d2h) {
        BpsPart &p = op->parts[(size_t)i];
        unsigned char *dev = (unsigned char *)op->dev_ptr + p.offset;
        return issue(op, i, d2h ? BPS_STAGE_COPYD2H : BPS_STAGE_COPYH2D, false, [&](bps_cuda_stream s) {
            return cuda_.check(d2h ? cuda_.MemcpyAsync(p.host, dev, p.length, BPS_CUDA_MEMCPY_D2H, s)
                                   : cuda_.MemcpyAsync(dev, p.host, p.length, BPS_CUDA_MEMCPY_H2D, s),
                               d2h ? "cudaMemcpyAsync (device to host)" : "cudaMemcpyAsync (host to device)");
        });
    }

    /* byteps-net: ``work`` (it queues partition ``i``'s work of stage ``stage`` on the stream it is given:
     * the device's copy stream, or its NCCL stream) after the producer's event on the op's first work,
     * and an event after it, which ends the stage (done()); "" or the error. */
    template <typename Work>
    std::string issue(BpsOp *op, int i, int32_t stage, bool nccl_stream, Work work) {
        Device *d = nullptr;
        std::string err = device(op->device, &d);
        if (!err.empty()) return err;
        bps_cuda_stream s = d->stream;
        if (nccl_stream) {
            if (d->nccl_stream == nullptr) {
                err = cuda_.check(cuda_.StreamCreateWithFlags(&d->nccl_stream, BPS_CUDA_STREAM_NON_BLOCKING),
                                  "cudaStreamCreateWithFlags");
                if (!err.empty()) return err;
            }
            s = d->nccl_stream;
        }
        if (!op->gpu_waited && op->ready_event != 0) {
            err = cuda_.check(cuda_.StreamWaitEvent(s, (bps_cuda_event)op->ready_event, 0),
                              "cudaStreamWaitEvent on the producer's event");
            if (!err.empty()) return err;
        }
        op->gpu_waited = true;
        bps_cuda_event e = nullptr; /* first: work is issued only with the event that tells when it is done */
        err = event(d, &e);
        if (!err.empty()) return err;
        err = work(s);
        if (err.empty()) err = cuda_.check(cuda_.EventRecord(e, s), "cudaEventRecord");
        if (!err.empty()) {
            d->events.push_back(e);
            return err;
        }
        op->tasks++; /* the work reads or writes its memory until its event completes */
        {
            std::lock_guard<std::mutex> lock(mu_);
            queue_.push_back(BpsGpuCopy{op, i, stage, op->device, e, bps_span_start(), ""});
        }
        cv_.notify_one();
        if (!nccl_stream) copies_++;
        return "";
    }

    /* The CUDA runtime (nccl_stages.h sets a device through it before creating a communicator). */
    BpsCudart &runtime() { return cuda_; }

    /* byteps-net: copies whose events completed (their events back in the pool). */
    void done(std::vector<BpsGpuCopy> *out) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            out->swap(done_);
        }
        for (BpsGpuCopy &c : *out) devices_[c.device].events.push_back(c.event);
    }

    /* byteps-net: the op's done event (the caller's, for its stream to wait on) after its copies. */
    std::string record_done(BpsOp *op) {
        if (op->done_event == 0) return "";
        Device *d = nullptr;
        std::string err = device(op->device, &d);
        if (!err.empty()) return err;
        return cuda_.check(cuda_.EventRecord((bps_cuda_event)op->done_event, d->stream), "cudaEventRecord (done event)");
    }

    /* byteps-net: drop ``op``'s partitions that wait for a slot (it failed). */
    void drop_waiters(BpsOp *op) {
        std::lock_guard<std::mutex> lock(ring_mu_);
        std::vector<BpsQueued> keep;
        while (!waiters_.empty()) {
            BpsQueued q = waiters_.top();
            waiters_.pop();
            if (q.op == op) op->tasks--;
            else keep.push_back(q);
        }
        for (BpsQueued &q : keep) waiters_.push(q);
    }

    uint64_t peak_slots() const { return peak_.load(); }
    uint64_t grown() const { return grown_.load(); }
    uint64_t copies() const { return copies_.load(); }
    int slots() const { return (int)slots_.size(); }

  private:
    struct Device {
        bps_cuda_stream stream = nullptr;
        bps_cuda_stream nccl_stream = nullptr; /* the NCCL stages' (created on their first collective) */
        std::vector<bps_cuda_event> events; /* free ones */
    };

    /* (under ring_mu_) a free slot to partition ``p``, allocated on its first use; reallocated larger for
     * a partition longer than it (a later server membership may cut larger partitions: elastic servers) */
    std::string assign(BpsOp *op, BpsPart &p) {
        int s = free_.back();
        if (slots_[(size_t)s] == nullptr || slot_size_[(size_t)s] < p.length) {
            uint64_t size = std::max(slot_bytes_, p.length);
            void *mem = nullptr;
            std::string err = cuda_.check(cuda_.SetDevice(op->device), "cudaSetDevice");
            if (err.empty() && slots_[(size_t)s] != nullptr)
                err = cuda_.check(cuda_.FreeHost(slots_[(size_t)s]), "cudaFreeHost");
            slots_[(size_t)s] = nullptr;
            if (err.empty())
                err = cuda_.check(cuda_.HostAlloc(&mem, size, BPS_CUDA_HOST_ALLOC_PORTABLE), "cudaHostAlloc");
            if (!err.empty()) return "tensor '" + op->name + "': " + err;
            slots_[(size_t)s] = (unsigned char *)mem;
            slot_size_[(size_t)s] = size;
        }
        free_.pop_back();
        p.slot = s;
        p.host = slots_[(size_t)s];
        uint64_t used = (uint64_t)++in_use_;
        if (used > peak_.load()) peak_.store(used);
        return "";
    }

    /* the device's stream, created on first use, with that device current on this thread */
    std::string device(int dev, Device **out) {
        std::string err = cuda_.check(cuda_.SetDevice(dev), "cudaSetDevice");
        if (!err.empty()) return err;
        Device &d = devices_[dev];
        if (d.stream == nullptr) {
            err = cuda_.check(cuda_.StreamCreateWithFlags(&d.stream, BPS_CUDA_STREAM_NON_BLOCKING),
                              "cudaStreamCreateWithFlags");
            if (!err.empty()) return err;
        }
        *out = &d;
        return "";
    }

    /* a free event of device ``d`` (its pool), or a new one */
    std::string event(Device *d, bps_cuda_event *e) {
        if (!d->events.empty()) {
            *e = d->events.back();
            d->events.pop_back();
            return "";
        }
        return cuda_.check(cuda_.EventCreateWithFlags(e, BPS_CUDA_EVENT_FLAGS), "cudaEventCreateWithFlags");
    }

    void run() {
        prctl(PR_SET_NAME, "byteps-gpu", 0, 0, 0);
        int current = -1;
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
            if (queue_.empty()) { /* stopping, nothing in flight */
                exited_ = true;
                exited_cv_.notify_all();
                return;
            }
            BpsGpuCopy c = queue_.front();
            queue_.pop_front();
            lock.unlock();
            if (c.device != current) { /* the event's device current here too (no context made on device 0) */
                cuda_.SetDevice(c.device);
                current = c.device;
            }
            c.error = cuda_.check(cuda_.EventSynchronize(c.event), "cudaEventSynchronize");
            lock.lock();
            done_.push_back(std::move(c));
            bps_signal(wake_fd_);
        }
    }

    std::atomic<bool> enabled_{false};
    int wake_fd_ = -1;
    BpsCudart cuda_;
    uint64_t slot_bytes_ = 0;
    std::map<int, Device> devices_; /* byteps-net's */

    std::mutex ring_mu_; /* the ring: slots, free ones, partitions waiting for one */
    std::vector<unsigned char *> slots_;
    std::vector<uint64_t> slot_size_; /* bytes of each allocated slot */
    std::vector<int> free_;
    std::priority_queue<BpsQueued, std::vector<BpsQueued>, BpsByPriority<BpsQueued>> waiters_;
    int in_use_ = 0;
    double last_release_ = 0, waiting_since_ = 0; /* a slot came back; the first of the waiters began */
    std::atomic<uint64_t> peak_{0}, copies_{0}, grown_{0};

    std::mutex mu_; /* the completion thread's queues */
    std::condition_variable cv_, exited_cv_;
    std::deque<BpsGpuCopy> queue_;
    std::vector<BpsGpuCopy> done_;
    bool stopping_ = false, exited_ = false, stuck_ = false;
    std::thread thread_;
};

#endif
