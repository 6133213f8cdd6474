/* The UCX transport under the link seam (core/transport/bps_link.h): the same messages as a direct TCP link,
 * carried by UCP Active Messages, so that on a machine with an RDMA NIC they go over verbs (RC/DC)
 * and here over UCX's tcp and shared-memory transports (docs/ucx.md).
 *
 * One BpsUcxWorker (a ucp_context and a ucp_worker) per native thread: byteps-net on a worker,
 * byteps-serve on a server. A server listens (ucp_listener on a TCP port, which Python hands out in
 * its LINK answer with the one-time token); a worker connects one endpoint per server and presents
 * the token as its first message, exactly as on a TCP link: the server's link_hello() admits the
 * endpoint or answers "refused" and closes it. Nothing but that hello is read from an endpoint
 * before it is admitted.
 *
 * A message is one Active Message: the user header carries the frame lengths (the TCP link's prefix,
 * "BPLK" | n | n x u64), the data is the frames as an IOV (zero-copy frames are read in place until
 * the send completes; then their free function runs, on the owning thread, inside progress). A
 * message with one large frame (a partition's body) goes "split" instead (BPS_UCX_SPLIT_MAGIC): its
 * small frames inside the user header, the body alone and contiguous as the data. Both sides send
 * with UCP_AM_SEND_FLAG_REPLY, so the receiver knows the endpoint a message came on (reply_ep) and
 * routes it to that link. Received frames are ZeroMQ messages (zmq_msg_init_size) as on a TCP link:
 * an eager message is copied out of UCX's buffer; a rendezvous one (large: over 1 MB here, where
 * byteps sets UCX_RNDV_THRESH without an RDMA device, UCX's choice over verbs) is received with
 * ucp_am_recv_data_nbx straight into its frames. The server sums from there (its first push is held
 * as it arrived, later ones are added into the store): one copy fewer than "receive, then copy into
 * the store" and the same as the TCP link.
 *
 * Registration (what a NIC needs before it reads or writes memory): a large body is received into a
 * buffer reused across steps (BpsUcxRecvPool) that the worker registers with ucp_mem_map the first
 * time and whose handle it passes with every later receive into it, and with a reply sent from it
 * (ucp_request_param_t.memh, contiguous data only: hence the split form). The tensors workers send
 * from, and a server's stores, are left to UCX's registration cache (rcache), which also registers
 * once and finds the registration on later steps: a tensor's memory is torch's to free and reuse,
 * and only UCX's memory hooks see that happen, so a registration made by hand could outlive it.
 *
 * Wake-ups: the thread's poll includes ucp_worker_get_efd(); before it sleeps, pending_input()
 * progresses the worker and arms it (ucp_worker_arm); UCS_ERR_BUSY means events came meanwhile:
 * do not sleep. A peer that dies is reported by the endpoint's error handler (peer failure mode):
 * the link is dead, as a TCP link whose socket closed.
 *
 * libucp is not linked: Python finds it (the libucx wheel, or a system UCX built with verbs when
 * RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true: core/ucx.py) and bps_ucx_load() resolves the calls with
 * dlsym. Without UCX headers at build time (no BPS_HAVE_UCX) the same names exist and say so.
 */
#ifndef BPS_UCX_H
#define BPS_UCX_H

#include <string>
#include <vector>

#include "core/transport/bps_link.h"
#include "core/transport/bps_wire.h"

static const unsigned BPS_UCX_AM_ID = 0x4250; /* "BP": our one Active Message handler */
static const uint64_t BPS_UCX_HELLO_MAX = 64 << 10; /* the most an endpoint may send before its token */
/* A message of one large frame (>= BpsUcxRecvPool::MIN_BYTES) and small others travels "split": the
 * small frames (a header, a descriptor) in the Active Message's user header, the large one alone as
 * its data, so that it is contiguous: a receive straight into a registered pooled buffer, a send
 * from one, can then pass the registration (ucp_request_param_t.memh, which takes contiguous data
 * only). Its user header: "BPSP" | n | index of the large frame | 0 | n x u64 lengths | the small
 * frames' bytes. */
static const uint32_t BPS_UCX_SPLIT_MAGIC = 0x50535042u; /* "BPSP" */
static const size_t BPS_UCX_HEADER_MAX = 1024;          /* the most header bytes byteps puts there */

#ifdef BPS_HAVE_UCX

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netdb.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>

#include <ucp/api/ucp.h>

/* libucp's calls, resolved at run time from the library Python chose. */
struct BpsUcxApi {
#define BPS_UCX_FN(name) decltype(&::name) name = nullptr
    BPS_UCX_FN(ucp_config_read);
    BPS_UCX_FN(ucp_config_release);
    BPS_UCX_FN(ucp_init_version);
    BPS_UCX_FN(ucp_cleanup);
    BPS_UCX_FN(ucp_get_version_string);
    BPS_UCX_FN(ucp_worker_create);
    BPS_UCX_FN(ucp_worker_destroy);
    BPS_UCX_FN(ucp_worker_progress);
    BPS_UCX_FN(ucp_worker_get_efd);
    BPS_UCX_FN(ucp_worker_arm);
    BPS_UCX_FN(ucp_worker_set_am_recv_handler);
    BPS_UCX_FN(ucp_listener_create);
    BPS_UCX_FN(ucp_listener_destroy);
    BPS_UCX_FN(ucp_listener_query);
    BPS_UCX_FN(ucp_ep_create);
    BPS_UCX_FN(ucp_ep_close_nbx);
    BPS_UCX_FN(ucp_ep_query);
    BPS_UCX_FN(ucp_am_send_nbx);
    BPS_UCX_FN(ucp_am_recv_data_nbx);
    BPS_UCX_FN(ucp_request_check_status);
    BPS_UCX_FN(ucp_request_free);
    BPS_UCX_FN(ucs_status_string);
    BPS_UCX_FN(ucp_mem_map);
    BPS_UCX_FN(ucp_mem_unmap);
    BPS_UCX_FN(ucp_worker_query);
    BPS_UCX_FN(ucp_get_version);
#undef BPS_UCX_FN
    bool loaded = false;
    bool memh_param = false; /* ucp_request_param_t.memh is honoured: UCX 1.14 or later */
    std::string why = "UCX was not loaded (byteps.core.ucx.load())";
};
static BpsUcxApi bps_ucx;

/* Resolve libucp's calls from ``path`` (already loaded by Python, or loadable); 0, or -1 (bps_ucx.why). */
static inline int bps_ucx_load(const char *path) {
    if (bps_ucx.loaded) return 0;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
        const char *e = dlerror();
        bps_ucx.why = std::string("cannot load ") + path + ": " + (e ? e : "?");
        return -1;
    }
#define BPS_UCX_SYM(name)                                                      \
    bps_ucx.name = (decltype(bps_ucx.name))dlsym(h, #name);                    \
    if (bps_ucx.name == nullptr) {                                             \
        bps_ucx.why = std::string(path) + " lacks " #name " (UCX too old?)";   \
        return -1;                                                             \
    }
    BPS_UCX_SYM(ucp_config_read)
    BPS_UCX_SYM(ucp_config_release)
    BPS_UCX_SYM(ucp_init_version)
    BPS_UCX_SYM(ucp_cleanup)
    BPS_UCX_SYM(ucp_get_version_string)
    BPS_UCX_SYM(ucp_worker_create)
    BPS_UCX_SYM(ucp_worker_destroy)
    BPS_UCX_SYM(ucp_worker_progress)
    BPS_UCX_SYM(ucp_worker_get_efd)
    BPS_UCX_SYM(ucp_worker_arm)
    BPS_UCX_SYM(ucp_worker_set_am_recv_handler)
    BPS_UCX_SYM(ucp_listener_create)
    BPS_UCX_SYM(ucp_listener_destroy)
    BPS_UCX_SYM(ucp_listener_query)
    BPS_UCX_SYM(ucp_ep_create)
    BPS_UCX_SYM(ucp_ep_close_nbx)
    BPS_UCX_SYM(ucp_ep_query)
    BPS_UCX_SYM(ucp_am_send_nbx)
    BPS_UCX_SYM(ucp_am_recv_data_nbx)
    BPS_UCX_SYM(ucp_request_check_status)
    BPS_UCX_SYM(ucp_request_free)
    BPS_UCX_SYM(ucs_status_string) /* libucs: dlsym searches libucp's dependencies too */
    BPS_UCX_SYM(ucp_mem_map)
    BPS_UCX_SYM(ucp_mem_unmap)
    BPS_UCX_SYM(ucp_worker_query)
    BPS_UCX_SYM(ucp_get_version)
#undef BPS_UCX_SYM
    unsigned major = 0, minor = 0, release = 0;
    bps_ucx.ucp_get_version(&major, &minor, &release);
    bps_ucx.memh_param = major > 1 || (major == 1 && minor >= 14);
    bps_ucx.loaded = true;
    bps_ucx.why.clear();
    return 0;
}

static inline std::string bps_ucx_error(ucs_status_t s) { return bps_ucx.ucs_status_string(s); }

/* Buffers that large received frames (>= 64 KB) land in, reused across steps: the same partition
 * size comes back every step, so the same addresses do. That is what makes registration pay on an
 * RDMA NIC: each receiving UCP worker registers a buffer (ucp_mem_map) the first time it receives
 * into it and passes that handle to every later receive into it (BpsUcxWorker::pool_memh); a fresh
 * allocation per message would be registered (and page-faulted) every time. Process-wide, any
 * thread may give a buffer back (the frame's free function: a sum thread, Python); at most 1 GiB is
 * kept idle. A buffer's generation changes when it is freed, so that a registration of a freed
 * buffer is never used for a new one that malloc put at the same address. */
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

class BpsUcxWorker;

/* One UCP endpoint to a peer, as a link (BpsConn): owned by the native thread of its BpsUcxWorker. */
class BpsUcxLink : public BpsConn {
  public:
    BpsUcxLink(BpsUcxWorker *w) : w_(w) {}
    ~BpsUcxLink() override;

    int fd() const override;
    bool dead() const override { return dead_; }
    bool wants_write() const override { return false; } /* UCX queues what it cannot send yet */
    bool pending_input() override;
    bool arm_to_sleep() override;
    const std::string &error() const override { return error_; }
    int send(BpsFrames &m) override;
    int flush() override;
    int recv(BpsMessage *m, const std::string *prefix = nullptr) override;
    const char *kind() const override { return "ucx"; }

    /* The transports this endpoint uses ("tcp/lo, posix/memory"), as UCX reports them. */
    std::string transports() const {
#if UCP_API_VERSION < UCP_VERSION(1, 14) /* built against older headers (Debian's 1.13): no such query */
        return "?";
#else
        ucp_ep_attr_t attr;
        memset(&attr, 0, sizeof attr);
        ucp_transport_entry_t entries[8];
        memset(entries, 0, sizeof entries); /* a UCX older than 1.14 ignores the field: names stay NULL */
        attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
        attr.transports.entries = entries;
        attr.transports.num_entries = 8;
        attr.transports.entry_size = sizeof(ucp_transport_entry_t);
        if (ep_ == nullptr || bps_ucx.ucp_ep_query(ep_, &attr) != UCS_OK) return "?";
        std::string out;
        for (unsigned i = 0; i < attr.transports.num_entries && i < 8; ++i) {
            if (entries[i].transport_name == nullptr || entries[i].device_name == nullptr) continue;
            std::string one = std::string(entries[i].transport_name) + "/" + entries[i].device_name;
            if (out.find(one) != std::string::npos) continue;
            out += (out.empty() ? "" : ", ") + one;
        }
        return out.empty() ? "?" : out;
#endif
    }

  private:
    friend class BpsUcxWorker;

    /* a whole message waits to be taken by recv() */
    bool ready() const { return !dead_ && !inq_.empty() && inq_.front()->ready; }

    /* A message being received: ready once every frame holds its bytes. Owned by the link, or by
     * the rendezvous receive still in flight when the link went (``orphan``). */
    struct Incoming {
        BpsMessage msg;
        ucp_dt_iov_t iov[BPS_LINK_MAX_FRAMES];
        bool ready = false;
        bool orphan = false;
    };
    /* A message being sent: its header, IOV and copied frames live until UCX completes it (UCX may
     * read them after ucp_am_send_nbx returned, when the send was queued). */
    struct Outgoing {
        uint64_t head[1 + BPS_LINK_MAX_FRAMES];
        std::string own; /* the copied frames, back to back */
        ucp_dt_iov_t iov[BPS_LINK_MAX_FRAMES];
        BpsOutFrame zc[BPS_LINK_MAX_FRAMES];
        int nzc = 0;
        void release() {
            for (int i = 0; i < nzc; ++i) zc[i].ffn((void *)zc[i].data, zc[i].hint);
            nzc = 0;
        }
    };

    /* ``arg`` is the worker: an endpoint being closed is no longer in its map, so a late error
     * never reaches a link that is gone. */
    static void on_error(void *arg, ucp_ep_h ep, ucs_status_t status);
    static void on_sent(void *request, ucs_status_t, void *user_data) {
        Outgoing *o = (Outgoing *)user_data;
        o->release();
        delete o;
        bps_ucx.ucp_request_free(request);
    }
    static void on_received(void *request, ucs_status_t status, size_t, void *user_data) {
        Incoming *in = (Incoming *)user_data;
        if (in->orphan) {
            delete in;
        } else {
            in->ready = true;
            if (status != UCS_OK) in->msg.clear(); /* the endpoint failed: its error handler says so */
        }
        bps_ucx.ucp_request_free(request);
    }

    void die(const std::string &why) {
        if (dead_) return;
        dead_ = true;
        error_ = why;
    }

    /* An Active Message for this link (on the thread, inside progress); a split one (BPS_UCX_SPLIT_MAGIC). */
    ucs_status_t on_message(const void *header, size_t hlen, void *data, size_t length,
                            const ucp_am_recv_param_t *param);
    ucs_status_t on_split(const void *header, size_t hlen, void *data, size_t length,
                          const ucp_am_recv_param_t *param);
    int send_split(BpsFrames &m, int big, size_t hlen);
    int sent(void *st, Outgoing *o);
    void receiving(void *st, Incoming *in);

    BpsUcxWorker *w_;
    ucp_ep_h ep_ = nullptr;
    bool accepted_ = false; /* a server's endpoint from its listener: unadmitted while ident is empty */
    bool dead_ = false;
    std::string error_;
    std::deque<Incoming *> inq_;
};

/* A native thread's UCP context and worker; its listener on a server. */
class BpsUcxWorker {
  public:
    /* NULL with ``why`` set when UCX is not loaded or does not start. */
    static BpsUcxWorker *create(std::string *why) {
        if (!bps_ucx.loaded) {
            *why = bps_ucx.why;
            return nullptr;
        }
        BpsUcxWorker *w = new BpsUcxWorker();
        if (!w->init(why)) {
            delete w;
            return nullptr;
        }
        return w;
    }

    ~BpsUcxWorker() {
        if (listener_ != nullptr) bps_ucx.ucp_listener_destroy(listener_);
        for (BpsUcxLink *l : accepted_) delete l;
        accepted_.clear();
        if (worker_ != nullptr) {
            drain_closing(1.0);
            bps_ucx.ucp_worker_destroy(worker_);
        }
        for (auto &kv : regs_) bps_ucx.ucp_mem_unmap(context_, kv.second.memh);
        for (auto &kv : regions_)
            if (kv.second.memh != nullptr) bps_ucx.ucp_mem_unmap(context_, kv.second.memh);
        if (context_ != nullptr) bps_ucx.ucp_cleanup(context_);
    }

    int efd() const { return efd_; }
    ucp_worker_h worker() const { return worker_; }

    /* The registration of pooled buffer ``p`` (capacity ``cap``, generation ``gen``) with this worker's
     * context: made by ucp_mem_map the first time, reused on every later step; NULL where it cannot be
     * passed (UCX older than 1.14) or failed (UCX then registers through its own cache). */
    ucp_mem_h pool_memh(void *p, size_t cap, uint64_t gen) {
        if (!bps_ucx.memh_param || gen == 0) return nullptr;
        auto it = regs_.find(p);
        if (it != regs_.end()) {
            if (it->second.gen == gen && it->second.cap == cap) {
                bps_ucx_memh_used++;
                return it->second.memh;
            }
            bps_ucx.ucp_mem_unmap(context_, it->second.memh); /* freed and reallocated meanwhile */
            regs_.erase(it);
        }
        ucp_mem_h memh = map(p, cap);
        if (memh == nullptr) return nullptr;
        regs_[p] = Registration{gen, cap, memh};
        bps_ucx_memh_used++;
        return memh;
    }

    /* The registration covering ``len`` bytes from ``p``: a region its owner registered (a server's
     * store arena), or a pooled buffer this worker registered that has not been freed since (a reply
     * from the buffer a push arrived in); else NULL: UCX registers the memory through its cache (a
     * worker's tensor). */
    ucp_mem_h send_memh(const void *p, size_t len) {
        uintptr_t a = (uintptr_t)p;
        auto r = regions_.upper_bound(a);
        if (r != regions_.begin()) {
            --r;
            if (a + len <= r->first + r->second.cap) {
                if (r->second.memh == nullptr) r->second.memh = map((void *)r->first, r->second.cap);
                if (r->second.memh == nullptr) return nullptr;
                bps_ucx_memh_used++;
                return r->second.memh;
            }
        }
        auto it = regs_.find(const_cast<void *>(p));
        if (it == regs_.end() || len > it->second.cap) return nullptr;
        if (BpsUcxRecvPool::get().generation(p) != it->second.gen) return nullptr;
        bps_ucx_memh_used++;
        return it->second.memh;
    }

    /* Memory its owner keeps for many steps and sends from (a server's store arena), until
     * unregister_region(base); on this worker's thread. Registered (ucp_mem_map) when it is first sent
     * from, not now: on a NIC registering pins the pages, and a store a key never uses must not take
     * memory. */
    void register_region(void *base, size_t len) {
        if (bps_ucx.memh_param) regions_[(uintptr_t)base] = Registration{0, len, nullptr};
    }

    void unregister_region(void *base) {
        auto it = regions_.find((uintptr_t)base);
        if (it == regions_.end()) return;
        if (it->second.memh != nullptr) bps_ucx.ucp_mem_unmap(context_, it->second.memh);
        regions_.erase(it);
    }

    /* The largest user header an Active Message of this worker may carry (UCX's, capped by byteps). */
    size_t max_am_header() const { return max_am_header_; }

    void progress() {
        while (bps_ucx.ucp_worker_progress(worker_) != 0) {
        }
        reap_closing();
    }

    /* Before the thread sleeps: progress, then arm the wake-up fd. True when it must not sleep: a
     * message of any of this worker's endpoints is ready (progress may have completed one for a
     * link the caller already asked about; the armed fd will not report it), or events came while
     * arming. */
    bool prepare_sleep() {
        progress();
        for (auto &kv : eps_)
            if (kv.second->ready()) return true;
        return bps_ucx.ucp_worker_arm(worker_) == UCS_ERR_BUSY;
    }

    /* Listen for workers' endpoints on ``host`` (a random port); the port, or -1 with ``why``. */
    int listen(const std::string &host, std::string *why) {
        struct sockaddr_storage ss;
        socklen_t len;
        if (!resolve(host, 0, &ss, &len, why)) return -1;
        ucp_listener_params_t p;
        memset(&p, 0, sizeof p);
        p.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
        p.sockaddr.addr = (const struct sockaddr *)&ss;
        p.sockaddr.addrlen = len;
        p.conn_handler.cb = on_conn_request;
        p.conn_handler.arg = this;
        ucs_status_t s = bps_ucx.ucp_listener_create(worker_, &p, &listener_);
        if (s != UCS_OK) {
            *why = "ucp_listener_create on " + host + ": " + bps_ucx_error(s);
            return -1;
        }
        ucp_listener_attr_t attr;
        attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
        if (bps_ucx.ucp_listener_query(listener_, &attr) != UCS_OK) {
            *why = "ucp_listener_query failed";
            return -1;
        }
        const struct sockaddr *sa = (const struct sockaddr *)&attr.sockaddr;
        return ntohs(sa->sa_family == AF_INET6 ? ((const struct sockaddr_in6 *)sa)->sin6_port
                                               : ((const struct sockaddr_in *)sa)->sin_port);
    }

    /* Endpoints the listener accepted since the last call (the server adopts them, unadmitted). */
    std::vector<BpsUcxLink *> take_accepted() {
        std::vector<BpsUcxLink *> out;
        out.swap(accepted_);
        return out;
    }

    /* A worker's endpoint to a server's listener, its token presented: the link once the server
     * admitted it, else NULL with ``why`` (refused, unreachable, no answer within ``timeout``). */
    BpsUcxLink *connect(const std::string &host, int port, const std::string &hello_header, const std::string &hello,
                        double timeout, std::string *why) {
        struct sockaddr_storage ss;
        socklen_t len;
        if (!resolve(host, port, &ss, &len, why)) return nullptr;
        BpsUcxLink *l = new BpsUcxLink(this);
        ucp_ep_params_t p;
        memset(&p, 0, sizeof p);
        p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                       UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
        p.sockaddr.addr = (const struct sockaddr *)&ss;
        p.sockaddr.addrlen = len;
        p.err_mode = err_mode_;
        p.err_handler.cb = BpsUcxLink::on_error;
        p.err_handler.arg = this;
        ucs_status_t s = bps_ucx.ucp_ep_create(worker_, &p, &l->ep_);
        if (s != UCS_OK) {
            *why = "ucp_ep_create to " + host + ":" + std::to_string(port) + ": " + bps_ucx_error(s);
            l->ep_ = nullptr;
            delete l;
            return nullptr;
        }
        eps_[l->ep_] = l;
        BpsFrames f;
        f.copy(hello_header.data(), hello_header.size());
        f.copy(hello.data(), hello.size());
        BpsMessage answer;
        int got = 0;
        double deadline = now() + timeout;
        if (l->send(f) == 0) {
            while ((got = l->recv(&answer)) == 0 && now() < deadline) {
                if (!prepare_sleep()) {
                    struct pollfd pfd = {efd_, POLLIN, 0};
                    poll(&pfd, 1, 10);
                }
            }
        }
        const BpsHeader *h = got > 0 && answer.count >= 1 && answer.size(0) == sizeof(BpsHeader)
                                 ? (const BpsHeader *)answer.data(0) : nullptr;
        if (h != nullptr && h->arg == 1) return l;
        *why = h != nullptr ? "the server refused the endpoint's token (answer: command " + std::to_string(h->cmd) +
                                  ", arg " + std::to_string(h->arg) + ")"
               : got < 0   ? "the endpoint failed during its handshake (" + l->error() + ")"
                           : "no answer to the endpoint's token within " + std::to_string(timeout) + " s";
        delete l;
        return nullptr;
    }

  private:
    friend class BpsUcxLink;

    bool init(std::string *why) {
        /* Peer failure detection (the endpoint's error handler) rules out UCX's shared-memory
         * transports, which cannot detect a dead peer; tcp and verbs (rc, dc) have it. A colocated
         * server is reached through byteps' own shared memory anyway (BYTEPS_ENABLE_IPC), so the
         * default keeps it; BYTEPS_UCX_PEER_ERRORS=0 lets UCX use sm too (a dead peer is then
         * reported by the scheduler alone). */
        const char *pe = getenv("BYTEPS_UCX_PEER_ERRORS");
        err_mode_ = pe != nullptr && strcmp(pe, "0") == 0 ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
        ucp_config_t *config = nullptr;
        ucs_status_t s = bps_ucx.ucp_config_read(nullptr, nullptr, &config); /* UCX_* environment */
        if (s != UCS_OK) {
            *why = "ucp_config_read: " + bps_ucx_error(s);
            return false;
        }
        ucp_params_t cp;
        memset(&cp, 0, sizeof cp);
        cp.field_mask = UCP_PARAM_FIELD_FEATURES;
        cp.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
        s = bps_ucx.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &cp, config, &context_);
        bps_ucx.ucp_config_release(config);
        if (s != UCS_OK) {
            *why = "ucp_init: " + bps_ucx_error(s);
            context_ = nullptr;
            return false;
        }
        ucp_worker_params_t wp;
        memset(&wp, 0, sizeof wp);
        wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
        /* created on Python's thread, then used by the native thread alone: serialized, never concurrent */
        wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
        s = bps_ucx.ucp_worker_create(context_, &wp, &worker_);
        if (s != UCS_OK) {
            *why = "ucp_worker_create: " + bps_ucx_error(s);
            worker_ = nullptr;
            return false;
        }
        ucp_worker_attr_t wa;
        memset(&wa, 0, sizeof wa);
        wa.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
        if (bps_ucx.ucp_worker_query(worker_, &wa) == UCS_OK)
            max_am_header_ = std::min<size_t>(wa.max_am_header, BPS_UCX_HEADER_MAX);
        s = bps_ucx.ucp_worker_get_efd(worker_, &efd_);
        if (s != UCS_OK) {
            *why = "ucp_worker_get_efd: " + bps_ucx_error(s);
            return false;
        }
        ucp_am_handler_param_t hp;
        memset(&hp, 0, sizeof hp);
        hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                        UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
        hp.id = BPS_UCX_AM_ID;
        hp.flags = UCP_AM_FLAG_WHOLE_MSG;
        hp.cb = on_am;
        hp.arg = this;
        s = bps_ucx.ucp_worker_set_am_recv_handler(worker_, &hp);
        if (s != UCS_OK) {
            *why = "ucp_worker_set_am_recv_handler: " + bps_ucx_error(s);
            return false;
        }
        return true;
    }

    static double now() {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
    }

    static bool resolve(const std::string &host, int port, struct sockaddr_storage *ss, socklen_t *len,
                        std::string *why) {
        struct addrinfo hints, *res = nullptr;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = AI_PASSIVE;
        int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
        if (rc != 0 || res == nullptr) {
            *why = "cannot resolve " + host + ": " + gai_strerror(rc);
            return false;
        }
        memcpy(ss, res->ai_addr, res->ai_addrlen);
        *len = res->ai_addrlen;
        freeaddrinfo(res);
        return true;
    }

    /* A worker connects: an endpoint for it, unadmitted until its first message presents a token. */
    static void on_conn_request(ucp_conn_request_h req, void *arg) {
        BpsUcxWorker *w = (BpsUcxWorker *)arg;
        BpsUcxLink *l = new BpsUcxLink(w);
        ucp_ep_params_t p;
        memset(&p, 0, sizeof p);
        p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                       UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        p.conn_request = req;
        p.err_mode = w->err_mode_;
        p.err_handler.cb = BpsUcxLink::on_error;
        p.err_handler.arg = w;
        if (bps_ucx.ucp_ep_create(w->worker_, &p, &l->ep_) != UCS_OK) {
            l->ep_ = nullptr;
            delete l;
            return;
        }
        l->accepted_ = true;
        w->eps_[l->ep_] = l;
        w->accepted_.push_back(l);
    }

    static ucs_status_t on_am(void *arg, const void *header, size_t hlen, void *data, size_t length,
                              const ucp_am_recv_param_t *param) {
        BpsUcxWorker *w = (BpsUcxWorker *)arg;
        if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK; /* not ours: dropped */
        auto it = w->eps_.find(param->reply_ep);
        if (it == w->eps_.end()) return UCS_OK; /* an endpoint being closed */
        return it->second->on_message(header, hlen, data, length, param);
    }

    /* Close an endpoint (its link is going): flush to a live peer (a refusal's answer gets there),
     * force on a dead one; the request is reaped by progress. */
    void close(ucp_ep_h ep, bool force) {
        eps_.erase(ep);
        ucp_request_param_t p;
        memset(&p, 0, sizeof p);
        p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
        void *req = bps_ucx.ucp_ep_close_nbx(ep, &p);
        if (req != nullptr && UCS_PTR_IS_PTR(req)) closing_.push_back(req);
    }

    void reap_closing() {
        for (size_t i = 0; i < closing_.size();) {
            if (bps_ucx.ucp_request_check_status(closing_[i]) != UCS_INPROGRESS) {
                bps_ucx.ucp_request_free(closing_[i]);
                closing_.erase(closing_.begin() + (long)i);
            } else {
                ++i;
            }
        }
    }

    void drain_closing(double seconds) {
        double deadline = now() + seconds;
        while (!closing_.empty() && now() < deadline) {
            bps_ucx.ucp_worker_progress(worker_);
            reap_closing();
        }
    }

    ucp_context_h context_ = nullptr;
    ucp_worker_h worker_ = nullptr;
    ucp_listener_h listener_ = nullptr;
    int efd_ = -1;
    ucp_err_handling_mode_t err_mode_ = UCP_ERR_HANDLING_MODE_PEER;
    size_t max_am_header_ = 0; /* 0: small frames are not carried in the header (legacy form only) */
    struct Registration {
        uint64_t gen;
        size_t cap;
        ucp_mem_h memh;
    };
    /* ucp_mem_map of ``len`` bytes at ``p`` with this worker's context; NULL if UCX refused (its cache
     * registers the memory then). */
    ucp_mem_h map(void *p, size_t len) {
        ucp_mem_map_params_t mp;
        memset(&mp, 0, sizeof mp);
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        mp.address = p;
        mp.length = len;
        ucp_mem_h memh = nullptr;
        if (bps_ucx.ucp_mem_map(context_, &mp, &memh) != UCS_OK) return nullptr;
        bps_ucx_mem_mapped++;
        return memh;
    }

    std::unordered_map<void *, Registration> regs_; /* pooled buffers registered with this context */
    std::map<uintptr_t, Registration> regions_;     /* owners' long-lived memory, by base address */
    std::unordered_map<ucp_ep_h, BpsUcxLink *> eps_;
    std::vector<BpsUcxLink *> accepted_;
    std::vector<void *> closing_;
};

inline BpsUcxLink::~BpsUcxLink() {
    for (Incoming *in : inq_) {
        if (in->ready) delete in;
        else in->orphan = true; /* its rendezvous receive completes (cancelled) when the endpoint closes */
    }
    inq_.clear();
    if (ep_ != nullptr) {
        w_->close(ep_, dead_);
        w_->drain_closing(dead_ ? 0.1 : 0.5); /* pending sends complete (their frames released) now */
    }
}

inline void BpsUcxLink::on_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    BpsUcxWorker *w = (BpsUcxWorker *)arg;
    auto it = w->eps_.find(ep);
    if (it != w->eps_.end()) it->second->die("UCX endpoint: " + bps_ucx_error(status));
}

inline int BpsUcxLink::fd() const { return w_->efd(); }

inline bool BpsUcxLink::pending_input() { return !dead_ && w_->prepare_sleep(); }

/* Other endpoints' messages may wait in their links meanwhile: they are byteps-net's, not a reason
 * for this link's direct caller to stay awake. */
inline bool BpsUcxLink::arm_to_sleep() {
    if (dead_) return true;
    w_->progress();
    if (ready()) return true;
    return bps_ucx.ucp_worker_arm(w_->worker()) == UCS_ERR_BUSY;
}

inline int BpsUcxLink::flush() {
    w_->progress();
    return dead_ ? -1 : 0;
}

inline int BpsUcxLink::send(BpsFrames &m) {
    if (dead_) {
        m.release_from(0);
        return -1;
    }
    int big = -1; /* the split form (BPS_UCX_SPLIT_MAGIC): one large frame, the others in the header */
    for (int i = 0; i < m.n; ++i)
        if (m.f[i].len >= BpsUcxRecvPool::MIN_BYTES && (big < 0 || m.f[i].len > m.f[big].len)) big = i;
    if (big >= 0) {
        size_t hlen = 16 + 8 * (size_t)m.n;
        for (int i = 0; i < m.n; ++i) hlen += i == big ? 0 : m.f[i].len;
        if (hlen <= w_->max_am_header()) return send_split(m, big, hlen);
    }
    Outgoing *o = new Outgoing();
    uint32_t head[2] = {BPS_LINK_MAGIC, (uint32_t)m.n};
    memcpy(&o->head[0], head, sizeof head);
    size_t copied = 0;
    for (int i = 0; i < m.n; ++i) copied += m.f[i].ffn == nullptr ? m.f[i].len : 0;
    o->own.resize(copied); /* one allocation: the pointers into it stay valid */
    int niov = 0;
    copied = 0;
    for (int i = 0; i < m.n; ++i) {
        o->head[1 + i] = (uint64_t)m.f[i].len;
        void *data = (void *)m.f[i].data;
        if (m.f[i].ffn != nullptr) {
            o->zc[o->nzc++] = m.f[i]; /* read in place until the send completes */
        } else if (m.f[i].len > 0) {
            data = &o->own[copied];
            memcpy(data, m.f[i].data, m.f[i].len);
            copied += m.f[i].len;
        }
        if (m.f[i].len > 0) o->iov[niov++] = ucp_dt_iov_t{data, m.f[i].len};
    }
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE |
                     UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY; /* the receiver learns which endpoint it came on */
    p.cb.send = on_sent;
    p.user_data = o;
    p.datatype = ucp_dt_make_iov();
    return sent(bps_ucx.ucp_am_send_nbx(ep_, BPS_UCX_AM_ID, o->head, sizeof(uint64_t) * (1 + m.n), o->iov,
                                        (size_t)niov, &p), o);
}

/* What ucp_am_send_nbx returned for ``o``: done already (no callback comes), failed, or in flight
 * (on_sent releases the frames). */
inline int BpsUcxLink::sent(void *st, Outgoing *o) {
    if (st == nullptr || UCS_PTR_IS_ERR(st)) {
        o->release();
        delete o;
    }
    if (st != nullptr && UCS_PTR_IS_ERR(st)) {
        die("ucp_am_send_nbx: " + bps_ucx_error(UCS_PTR_STATUS(st)));
        return -1;
    }
    return 0;
}

/* The split form: the small frames copied into the header (their zero-copy owners released at once),
 * the large frame sent alone and contiguous, in place if it is zero-copy, with its registration when
 * it is a pooled buffer this worker registered. */
inline int BpsUcxLink::send_split(BpsFrames &m, int big, size_t hlen) {
    Outgoing *o = new Outgoing();
    BpsOutFrame &body = m.f[big];
    o->own.resize(hlen + (body.ffn == nullptr ? body.len : 0)); /* one allocation: pointers stay valid */
    char *h = &o->own[0];
    uint32_t h4[4] = {BPS_UCX_SPLIT_MAGIC, (uint32_t)m.n, (uint32_t)big, 0};
    memcpy(h, h4, sizeof h4);
    char *q = h + 16 + 8 * (size_t)m.n;
    for (int i = 0; i < m.n; ++i) {
        uint64_t len = m.f[i].len;
        memcpy(h + 16 + 8 * (size_t)i, &len, 8);
        if (i == big) continue;
        if (len > 0) memcpy(q, m.f[i].data, len);
        q += len;
        if (m.f[i].ffn != nullptr) m.f[i].ffn((void *)m.f[i].data, m.f[i].hint);
    }
    const void *data = body.data;
    ucp_mem_h memh = nullptr;
    if (body.ffn != nullptr) {
        o->zc[o->nzc++] = body; /* read in place until the send completes */
        memh = w_->send_memh(data, body.len);
    } else {
        memcpy(h + hlen, data, body.len);
        data = h + hlen;
    }
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    p.cb.send = on_sent;
    p.user_data = o;
    if (memh != nullptr) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        p.memh = memh;
    }
    return sent(bps_ucx.ucp_am_send_nbx(ep_, BPS_UCX_AM_ID, h, hlen, data, body.len, &p), o);
}

/* A split message: its small frames from the header, its large frame from ``data`` (eager) or fetched
 * straight into a pooled buffer with that buffer's registration (rendezvous). */
inline ucs_status_t BpsUcxLink::on_split(const void *header, size_t hlen, void *data, size_t length,
                                         const ucp_am_recv_param_t *param) {
    uint32_t h4[4] = {0, 0, 0, 0};
    memcpy(h4, header, sizeof h4);
    uint32_t n = h4[1], big = h4[2];
    uint64_t lens[BPS_LINK_MAX_FRAMES];
    bool ok = n >= 1 && n <= (uint32_t)BPS_LINK_MAX_FRAMES && big < n && h4[3] == 0 && hlen >= 16 + 8 * (size_t)n;
    uint64_t small = 0;
    if (ok) {
        memcpy(lens, (const char *)header + 16, 8 * (size_t)n);
        for (uint32_t i = 0; i < n && ok; ++i) {
            ok = lens[i] <= (i == big ? BPS_LINK_MAX_FRAME : (uint64_t)BPS_UCX_HEADER_MAX);
            if (i != big) small += lens[i];
        }
        ok = ok && hlen == 16 + 8 * (size_t)n + small && lens[big] == length;
    }
    if (!ok) {
        die("malformed UCX message (split header or lengths)");
        return UCS_OK;
    }
    if (accepted_ && ident.empty() && length + small > BPS_UCX_HELLO_MAX) { /* nothing large before the token */
        die("a message of " + std::to_string(length + small) + " bytes before the endpoint presented its token");
        return UCS_OK;
    }
    Incoming *in = new Incoming();
    bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    const char *q = (const char *)header + 16 + 8 * (size_t)n;
    size_t cap = 0;
    uint64_t gen = 0;
    for (uint32_t i = 0; i < n; ++i) {
        if (i == big) {
            bool pooled = rndv && lens[i] >= BpsUcxRecvPool::MIN_BYTES &&
                          BpsUcxRecvPool::get().frame(&in->msg.frames[i], lens[i], &cap, &gen) == 0;
            if (!pooled) bps_zmq.msg_init_size(&in->msg.frames[i], (size_t)lens[i]);
        } else {
            bps_zmq.msg_init_size(&in->msg.frames[i], (size_t)lens[i]);
            if (lens[i] > 0) memcpy(in->msg.mutable_data((int)i), q, lens[i]);
            q += lens[i];
        }
        in->msg.count = (int)i + 1;
    }
    inq_.push_back(in);
    void *dst = in->msg.mutable_data((int)big);
    if (!rndv) {
        if (length > 0) memcpy(dst, data, length);
        in->ready = true;
        return UCS_OK;
    }
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = on_received;
    p.user_data = in;
    ucp_mem_h memh = cap != 0 ? w_->pool_memh(dst, cap, gen) : nullptr;
    if (memh != nullptr) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        p.memh = memh;
    }
    receiving(bps_ucx.ucp_am_recv_data_nbx(w_->worker_, data, dst, (size_t)length, &p), in);
    return UCS_OK;
}

/* What ucp_am_recv_data_nbx returned for ``in``: done already, failed, or in flight (on_received). */
inline void BpsUcxLink::receiving(void *st, Incoming *in) {
    if (st == nullptr) {
        in->ready = true;
    } else if (UCS_PTR_IS_ERR(st)) {
        in->ready = true;
        in->msg.clear();
        die("ucp_am_recv_data_nbx: " + bps_ucx_error(UCS_PTR_STATUS(st)));
    }
}

inline ucs_status_t BpsUcxLink::on_message(const void *header, size_t hlen, void *data, size_t length,
                                           const ucp_am_recv_param_t *param) {
    if (hlen >= 16) {
        uint32_t magic;
        memcpy(&magic, header, 4);
        if (magic == BPS_UCX_SPLIT_MAGIC) return on_split(header, hlen, data, length, param);
    }
    uint32_t head[2] = {0, 0};
    if (hlen >= 8) memcpy(head, header, 8);
    uint64_t lens[BPS_LINK_MAX_FRAMES];
    uint64_t total = 0;
    bool ok = hlen >= 8 && head[0] == BPS_LINK_MAGIC && head[1] >= 1 && head[1] <= (uint32_t)BPS_LINK_MAX_FRAMES &&
              hlen == 8 * (1 + (size_t)head[1]);
    if (ok) {
        memcpy(lens, (const char *)header + 8, 8 * (size_t)head[1]);
        for (uint32_t i = 0; i < head[1]; ++i) {
            ok = ok && lens[i] <= BPS_LINK_MAX_FRAME;
            total += lens[i];
        }
        ok = ok && total == length;
    }
    if (!ok) {
        die("malformed UCX message (header or lengths)");
        return UCS_OK;
    }
    if (accepted_ && ident.empty() && total > BPS_UCX_HELLO_MAX) { /* nothing large before the token */
        die("a message of " + std::to_string(total) + " bytes before the endpoint presented its token");
        return UCS_OK; /* a rendezvous not received is dropped (UCX completes the sender's request) */
    }
    Incoming *in = new Incoming();
    int n = (int)head[1], niov = 0;
    bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    for (int i = 0; i < n; ++i) {
        bool pooled = rndv && lens[i] >= BpsUcxRecvPool::MIN_BYTES &&
                      BpsUcxRecvPool::get().frame(&in->msg.frames[i], lens[i]) == 0;
        if (!pooled) bps_zmq.msg_init_size(&in->msg.frames[i], (size_t)lens[i]);
        in->msg.count = i + 1;
        if (lens[i] > 0) in->iov[niov++] = ucp_dt_iov_t{in->msg.mutable_data(i), (size_t)lens[i]};
    }
    inq_.push_back(in);
    if (!rndv) { /* eager: the bytes are here, copy them out */
        const char *src = (const char *)data;
        for (int i = 0; i < niov; ++i) {
            memcpy(in->iov[i].buffer, src, in->iov[i].length);
            src += in->iov[i].length;
        }
        in->ready = true;
        return UCS_OK;
    }
    /* rendezvous: UCX fetches the bytes straight into the frames */
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    p.cb.recv_am = on_received;
    p.user_data = in;
    p.datatype = ucp_dt_make_iov();
    receiving(bps_ucx.ucp_am_recv_data_nbx(w_->worker_, data, in->iov, (size_t)niov, &p), in);
    return UCS_OK;
}

inline int BpsUcxLink::recv(BpsMessage *m, const std::string *prefix) {
    if (inq_.empty() || !inq_.front()->ready) w_->progress();
    while (!inq_.empty() && inq_.front()->ready) {
        Incoming *in = inq_.front();
        inq_.pop_front();
        int base = prefix != nullptr ? 1 : 0;
        if (in->msg.count == 0 || in->msg.count + base > BPS_LINK_MAX_FRAMES) { /* failed, or no room */
            if (in->msg.count != 0) die("a UCX message of too many frames");
            delete in;
            continue;
        }
        m->clear();
        if (prefix != nullptr) {
            bps_zmq.msg_init_size(&m->frames[0], prefix->size());
            memcpy(m->mutable_data(0), prefix->data(), prefix->size());
        }
        for (int i = 0; i < in->msg.count; ++i) in->msg.take(i, &m->frames[base + i]);
        m->count = base + in->msg.count;
        in->msg.count = 0;
        delete in;
        return 1;
    }
    return dead_ ? -1 : 0;
}

/* What the log says about UCX: its version. */
static inline std::string bps_ucx_version() { return bps_ucx.loaded ? bps_ucx.ucp_get_version_string() : ""; }

/* This process's explicit registrations: pooled buffers mapped (ucp_mem_map), and transfers that passed
 * a registration instead of leaving it to UCX's cache (tests check that a buffer is mapped once). */
static inline uint64_t bps_ucx_buffers_mapped() { return bps_ucx_mem_mapped.load(); }
static inline uint64_t bps_ucx_registered_transfers() { return bps_ucx_memh_used.load(); }

#else /* built without UCX headers: the same names, and they say so */

static inline int bps_ucx_load(const char *) { return -1; }
static inline std::string bps_ucx_version() { return ""; }
static inline uint64_t bps_ucx_buffers_mapped() { return 0; }
static inline uint64_t bps_ucx_registered_transfers() { return 0; }
static const char *const BPS_UCX_MISSING = "byteps was built without UCX headers (pip install libucx-cu12, rebuild)";

class BpsUcxLink : public BpsConn {
  public:
    int fd() const override { return -1; }
    bool dead() const override { return true; }
    bool wants_write() const override { return false; }
    bool pending_input() override { return false; }
    const std::string &error() const override { return error_; }
    int send(BpsFrames &m) override {
        m.release_from(0);
        return -1;
    }
    int flush() override { return -1; }
    int recv(BpsMessage *, const std::string * = nullptr) override { return -1; }
    const char *kind() const override { return "ucx"; }
    std::string transports() const { return ""; }

  private:
    std::string error_ = BPS_UCX_MISSING;
};

class BpsUcxWorker {
  public:
    static BpsUcxWorker *create(std::string *why) {
        *why = BPS_UCX_MISSING;
        return nullptr;
    }
    int efd() const { return -1; }
    void progress() {}
    bool prepare_sleep() { return false; }
    int listen(const std::string &, std::string *why) {
        *why = BPS_UCX_MISSING;
        return -1;
    }
    std::vector<BpsUcxLink *> take_accepted() { return {}; }
    void register_region(void *, size_t) {}
    void unregister_region(void *) {}
    BpsUcxLink *connect(const std::string &, int, const std::string &, const std::string &, double, std::string *why) {
        *why = BPS_UCX_MISSING;
        return nullptr;
    }
};

#endif /* BPS_HAVE_UCX */

/* Whether this build can use UCX at all (headers found at build time). */
static inline bool bps_ucx_built() {
#ifdef BPS_HAVE_UCX
    return true;
#else
    return false;
#endif
}

static inline std::string bps_ucx_why() {
#ifdef BPS_HAVE_UCX
    return bps_ucx.why;
#else
    return BPS_UCX_MISSING;
#endif
}

#endif
