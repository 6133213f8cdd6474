/* BpsUcxLink's member functions: sending (whole or split), receiving (eager or rendezvous), errors.
 * A part of the UCX transport (core/transport/bps_ucx.h), which includes it when BPS_HAVE_UCX is set.
 */
#ifndef BPS_UCX_LINK_IO_H
#define BPS_UCX_LINK_IO_H

#include "core/transport/bps_ucx_worker.h"

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

#endif /* BPS_UCX_LINK_IO_H */
