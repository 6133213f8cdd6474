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

#ifdef BPS_HAVE_UCX

#include "core/transport/bps_ucx_api.h"     /* libucp's calls, loaded at run time */
#include "core/transport/bps_ucx_pool.h"    /* reused receive buffers and their registrations */
#include "core/transport/bps_ucx_link.h"    /* BpsUcxLink: one endpoint as a link */
#include "core/transport/bps_ucx_worker.h"  /* BpsUcxWorker: a thread's context, worker and listener */
#include "core/transport/bps_ucx_link_io.h" /* BpsUcxLink's sends and receives */

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
