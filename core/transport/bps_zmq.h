/* libzmq for the native threads, called through the library pyzmq already loaded.
 *
 * Nothing is compiled against zmq.h: core/_transport.pyx finds pyzmq's libzmq in /proc/self/maps,
 * and bps_zmq_load() takes the functions from that same shared object, so Python (pyzmq) and the
 * native threads (core/pipeline/bps_worker.h, summation/native/bps_server.h) speak to the same sockets. A socket is used
 * by one thread at a time only: Python sets it up and authenticates it, then hands it to a native
 * thread, which owns it from then on (ZeroMQ allows moving a socket between threads with a full
 * memory barrier; the hand-over goes through a mutex).
 *
 * The declarations mirror libzmq 4.x's ABI: zmq_msg_t is 64 opaque bytes, zmq_pollitem_t is
 * {socket, fd, events, revents} on POSIX.
 */
#ifndef BPS_ZMQ_H
#define BPS_ZMQ_H

#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
#include <string.h>

struct bps_zmq_msg {
    void *p[8];
};

struct bps_zmq_pollitem {
    void *socket;
    int fd;
    short events;
    short revents;
};

enum {
    BPS_ZMQ_DONTWAIT = 1,
    BPS_ZMQ_SNDMORE = 2,
    BPS_ZMQ_POLLIN = 1,
    BPS_ZMQ_POLLOUT = 2,
};

typedef void(bps_zmq_free_fn)(void *data, void *hint);

struct BpsZmq {
    int (*msg_init)(bps_zmq_msg *);
    int (*msg_init_size)(bps_zmq_msg *, size_t);
    int (*msg_init_data)(bps_zmq_msg *, void *, size_t, bps_zmq_free_fn *, void *);
    int (*msg_recv)(bps_zmq_msg *, void *, int);
    int (*msg_send)(bps_zmq_msg *, void *, int);
    int (*msg_close)(bps_zmq_msg *);
    int (*msg_move)(bps_zmq_msg *, bps_zmq_msg *);
    void *(*msg_data)(bps_zmq_msg *);
    size_t (*msg_size)(const bps_zmq_msg *);
    int (*msg_more)(const bps_zmq_msg *);
    int (*send)(void *, const void *, size_t, int);
    int (*poll)(bps_zmq_pollitem *, int, long);
    int (*errno_)(void);
};

static BpsZmq bps_zmq;
static int bps_zmq_loaded = 0;

/* Bind the functions of the libzmq at ``path`` (already loaded by pyzmq). 0 on success, else -1. */
static inline int bps_zmq_load(const char *path) {
    if (bps_zmq_loaded) return 0;
    void *lib = dlopen(path, RTLD_NOW);
    if (lib == NULL) return -1;
#define BPS_BIND(field, name)                                        \
    *(void **)(&bps_zmq.field) = dlsym(lib, name);                   \
    if (bps_zmq.field == NULL) return -1;
    BPS_BIND(msg_init, "zmq_msg_init")
    BPS_BIND(msg_init_size, "zmq_msg_init_size")
    BPS_BIND(msg_init_data, "zmq_msg_init_data")
    BPS_BIND(msg_recv, "zmq_msg_recv")
    BPS_BIND(msg_send, "zmq_msg_send")
    BPS_BIND(msg_close, "zmq_msg_close")
    BPS_BIND(msg_move, "zmq_msg_move")
    BPS_BIND(msg_data, "zmq_msg_data")
    BPS_BIND(msg_size, "zmq_msg_size")
    BPS_BIND(msg_more, "zmq_msg_more")
    BPS_BIND(send, "zmq_send")
    BPS_BIND(poll, "zmq_poll")
    BPS_BIND(errno_, "zmq_errno")
#undef BPS_BIND
    bps_zmq_loaded = 1;
    return 0;
}

/* One received multipart message; frames are ZeroMQ's own buffers (no copy). */
struct BpsMessage {
    static const int MAX_FRAMES = 8;
    bps_zmq_msg frames[MAX_FRAMES];
    int count = 0;
    bool truncated = false;  /* more frames than MAX_FRAMES arrived: the rest were dropped */

    BpsMessage() {}
    BpsMessage(const BpsMessage &) = delete;
    BpsMessage &operator=(const BpsMessage &) = delete;
    ~BpsMessage() { clear(); }

    void clear() {
        for (int i = 0; i < count; ++i) bps_zmq.msg_close(&frames[i]);
        count = 0;
        truncated = false;
    }
    const unsigned char *data(int i) { return (const unsigned char *)bps_zmq.msg_data(&frames[i]); }
    unsigned char *mutable_data(int i) { return (unsigned char *)bps_zmq.msg_data(&frames[i]); }
    size_t size(int i) const { return bps_zmq.msg_size(&frames[i]); }
    /* Move frame i out into ``out`` (initialised here); the frame stays valid in ``out``. */
    void take(int i, bps_zmq_msg *out) {
        bps_zmq.msg_init(out);
        bps_zmq.msg_move(out, &frames[i]);
    }
    /* Every frame moved into a new message (kept for later); this one is left empty. */
    BpsMessage *moved() {
        BpsMessage *out = new BpsMessage();
        for (int i = 0; i < count; ++i) take(i, &out->frames[i]);
        out->count = count;
        out->truncated = truncated;
        count = 0;
        return out;
    }
};

/* Receive one whole message without blocking. 1: got one; 0: none queued; -1: error (errno set). */
static inline int bps_recv_message(void *sock, BpsMessage *m) {
    m->clear();
    int flags = BPS_ZMQ_DONTWAIT;
    for (;;) {
        bps_zmq_msg tmp;
        bps_zmq.msg_init(&tmp);
        int rc = bps_zmq.msg_recv(&tmp, sock, flags);
        if (rc < 0) {
            int err = bps_zmq.errno_();
            bps_zmq.msg_close(&tmp);
            if (err == EINTR) continue;
            if (err == EAGAIN && m->count == 0) return 0;
            errno = err;
            return -1;
        }
        int more = bps_zmq.msg_more(&tmp);
        if (m->count < BpsMessage::MAX_FRAMES) {
            bps_zmq.msg_init(&m->frames[m->count]);
            bps_zmq.msg_move(&m->frames[m->count], &tmp);
            m->count++;
        } else {
            m->truncated = true;
        }
        bps_zmq.msg_close(&tmp);
        if (!more) return 1;
        flags = 0; /* the rest of a multipart message is already here */
    }
}

/* Send one frame copied into ZeroMQ. Blocks only at the high-water mark. 0 or -1 (errno set). */
static inline int bps_send_copy(void *sock, const void *data, size_t n, bool more) {
    for (;;) {
        int rc = bps_zmq.send(sock, data, n, more ? BPS_ZMQ_SNDMORE : 0);
        if (rc >= 0) return 0;
        int err = bps_zmq.errno_();
        if (err == EINTR) continue;
        errno = err;
        return -1;
    }
}

/* Send a frame without copying: ZeroMQ reads ``data`` until it calls ``ffn(data, hint)`` (on its I/O
 * thread); the caller keeps the memory alive until then. 0 or -1 (errno set). */
static inline int bps_send_zero_copy(void *sock, void *data, size_t n, bool more, bps_zmq_free_fn *ffn,
                                     void *hint) {
    bps_zmq_msg msg;
    if (bps_zmq.msg_init_data(&msg, data, n, ffn, hint) != 0) return -1;
    for (;;) {
        int rc = bps_zmq.msg_send(&msg, sock, more ? BPS_ZMQ_SNDMORE : 0);
        if (rc >= 0) return 0;
        int err = bps_zmq.errno_();
        if (err == EINTR) continue;
        bps_zmq.msg_close(&msg); /* runs ffn: the send never happened */
        errno = err;
        return -1;
    }
}

#endif
