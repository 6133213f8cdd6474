/* The UCX transport under the link seam (core/transport/bps_link.h): the same messages as a direct
 * TCP link, carried by UCP Active Messages (docs/ucx.md has the design: one UCP worker per native
 * thread, the token hello, the split form, registration, wake-ups).
 *
 * A message is one Active Message: the user header carries the frame lengths ("BPLK" | n | n x u64),
 * the data is the frames as an IOV; a message with one large frame goes split (BPS_UCX_SPLIT_MAGIC):
 * its small frames in the user header, the body alone and contiguous, so that it can carry a memh.
 * Both sides send with UCP_AM_SEND_FLAG_REPLY, so the receiver routes a message by its reply_ep.
 *
 * libucp is not linked: core/ucx.py finds it and bps_ucx_load() resolves the calls with dlsym.
 * Without UCX headers at build time (no BPS_HAVE_UCX) the same names exist and say so.
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
