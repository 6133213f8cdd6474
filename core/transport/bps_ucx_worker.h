/* A native thread's UCP context and worker (BpsUcxWorker): endpoints, the listener, registrations, progress.
 * A part of the UCX transport (core/transport/bps_ucx.h), which includes it when BPS_HAVE_UCX is set.
 */
#ifndef BPS_UCX_WORKER_H
#define BPS_UCX_WORKER_H

#include "core/transport/bps_ucx_link.h"

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

#endif /* BPS_UCX_WORKER_H */
