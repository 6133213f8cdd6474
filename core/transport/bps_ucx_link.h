/* One UCP endpoint as a link (BpsUcxLink): its declaration and the Active Message forms it sends.
 * Its member functions are in bps_ucx_link_io.h, after BpsUcxWorker (bps_ucx_worker.h), which they use.
 * A part of the UCX transport (core/transport/bps_ucx.h), which includes it when BPS_HAVE_UCX is set.
 */
#ifndef BPS_UCX_LINK_H
#define BPS_UCX_LINK_H

#include "core/transport/bps_ucx_pool.h"

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

#endif /* BPS_UCX_LINK_H */
