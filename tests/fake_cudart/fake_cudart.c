/* A CUDA runtime that runs on the CPU, built as a real shared library (tests only): the native copy
 * stages (core/pipeline/gpu_copier.h) dlopen it as they dlopen libcudart, through BYTEPS_CUDART.
 *
 * It models what the copy stages depend on, so that a mistake fails here as it would on a GPU:
 *   - the current device is per host thread (cudaSetDevice); streams, events and device memory belong
 *     to a device, and work queued on a stream of another device than the caller's fails
 *     (cudaErrorInvalidResourceHandle), as does recording an event on another device's stream;
 *   - device memory is host memory from cudaMalloc tagged with its device: a copy whose device side
 *     is not device memory, or whose host side is, fails (cudaErrorInvalidValue); async copies into or
 *     out of memory that is not page-locked (cudaHostAlloc) are counted (CUDA makes them synchronous);
 *   - every stream is a FIFO of work run by its own "device" thread, each copy taking the configured
 *     delay: work really is asynchronous, and a copy whose stream did not wait (cudaStreamWaitEvent)
 *     for the producer's event reads the memory before the producer's late kernel wrote it;
 *   - an event completes when its stream reaches the point where it was recorded; waits on an event
 *     never recorded do nothing (as in CUDA); cudaEventSynchronize blocks the caller; a sync on an
 *     event made without cudaEventBlockingSync is counted (CUDA would spin);
 *   - page-locked memory is counted: bytes now, peak bytes, allocations.
 * Test-only entries (fake_*): a producer's late kernel, the copy delay, a failing copy, the call log
 * (every call and every completed piece of work, with a timestamp) and the counters.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
};
enum { H2D = 1, D2H = 2 };
enum { EVENT_BLOCKING_SYNC = 0x01 };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; /* everything below */
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER; /* an event completed */

/* ---------------------------------------------------------------- the log */
static char *log_buf;
static size_t log_len, log_cap;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* (under mu) one line: "<ns> <text>" */
static void logf_locked(const char *fmt, ...) {
    char line[512];
    int n = snprintf(line, sizeof line, "%llu ", (unsigned long long)now_ns());
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    if (log_len + (size_t)n > log_cap) {
        log_cap = (log_cap + (size_t)n) * 2;
        log_buf = realloc(log_buf, log_cap);
    }
    memcpy(log_buf + log_len, line, (size_t)n);
    log_len += (size_t)n;
}

/* ---------------------------------------------------------------- devices and memory */
static int ndevices(void) {
    const char *v = getenv("FAKE_CUDA_DEVICES");
    return v ? atoi(v) : 2;
}

static __thread int current = 0;

struct alloc {
    char *p;
    size_t n;
    int device; /* -1: page-locked host memory */
    struct alloc *next;
};
static struct alloc *allocs;
static long long pinned_now, pinned_peak, pinned_allocs, pageable_copies, spinning_syncs, wrong_device;

/* (under mu) the allocation [p, p + n) lies in, or NULL */
static struct alloc *find(const void *p, size_t n) {
    for (struct alloc *a = allocs; a; a = a->next)
        if ((const char *)p >= a->p && (const char *)p + n <= a->p + a->n) return a;
    return NULL;
}

static void add_alloc(char *p, size_t n, int device) {
    struct alloc *a = calloc(1, sizeof *a);
    a->p = p, a->n = n, a->device = device, a->next = allocs;
    allocs = a;
}

static struct alloc *take_alloc(void *p) {
    for (struct alloc **a = &allocs; *a; a = &(*a)->next)
        if ((*a)->p == p) {
            struct alloc *got = *a;
            *a = got->next;
            return got;
        }
    return NULL;
}

/* ---------------------------------------------------------------- streams and events */
struct event {
    int device;
    unsigned flags;
    uint64_t recorded, completed; /* records so far, and how many of them the stream reached */
};

enum { W_COPY, W_KERNEL, W_RECORD, W_WAIT, W_STOP };
struct work {
    int kind;
    void *dst;
    const void *src;
    size_t n;
    int copy_kind;
    int delay_us;
    char *owned; /* a kernel's data, freed when it ran */
    struct event *event;
    uint64_t seq;
    struct work *next;
};

struct stream {
    int device;
    int id;
    struct work *head, *tail;
    pthread_cond_t more;
    pthread_t thread;
};
static int next_stream_id = 1;
static struct stream *legacy[64]; /* stream 0 of each device */
static int copy_delay_us = 0;
static long long fail_at = -1, memcpy_calls; /* the memcpy call that fails, and with which error */
static int fail_code = cudaErrorIllegalAddress;

static void *device_thread(void *arg) {
    struct stream *s = arg;
    char name[16];
    snprintf(name, sizeof name, "fake-dev%d-s%d", s->device, s->id);
    pthread_setname_np(pthread_self(), name);
    pthread_mutex_lock(&mu);
    for (;;) {
        while (!s->head) pthread_cond_wait(&s->more, &mu);
        struct work *w = s->head;
        if (w->kind == W_STOP) break;
        if (w->kind == W_WAIT) { /* the stream stalls until the event's record is reached */
            while (w->event->completed < w->seq) pthread_cond_wait(&changed, &mu);
            logf_locked("done wait stream=%d event=%p", s->id, (void *)w->event);
        } else if (w->kind == W_RECORD) {
            if (w->event->completed < w->seq) w->event->completed = w->seq;
            logf_locked("done record stream=%d event=%p", s->id, (void *)w->event);
            pthread_cond_broadcast(&changed);
        } else { /* a copy or a kernel: takes its time, outside the lock */
            pthread_mutex_unlock(&mu);
            if (w->delay_us > 0) usleep((useconds_t)w->delay_us);
            memcpy(w->dst, w->owned ? w->owned : w->src, w->n);
            pthread_mutex_lock(&mu);
            if (w->kind == W_COPY)
                logf_locked("done memcpy kind=%d dst=%p src=%p n=%zu stream=%d", w->copy_kind, w->dst, w->src, w->n,
                            s->id);
            else
                logf_locked("done kernel dst=%p n=%zu stream=%d", w->dst, w->n, s->id);
            free(w->owned);
        }
        s->head = w->next;
        if (!s->head) s->tail = NULL;
        free(w);
    }
    pthread_mutex_unlock(&mu);
    return NULL;
}

static struct stream *new_stream(int device) {
    struct stream *s = calloc(1, sizeof *s);
    s->device = device;
    s->id = next_stream_id++;
    pthread_cond_init(&s->more, NULL);
    pthread_create(&s->thread, NULL, device_thread, s);
    return s;
}

/* (under mu) the stream a handle names: NULL is the device's stream 0 */
static struct stream *stream_of(void *handle, int device) {
    if (handle) return handle;
    if (device < 0 || device >= 64) return NULL;
    if (!legacy[device]) legacy[device] = new_stream(device);
    return legacy[device];
}

static void enqueue(struct stream *s, struct work *w) {
    if (s->tail) s->tail->next = w;
    else s->head = w;
    s->tail = w;
    pthread_cond_signal(&s->more);
}

/* ---------------------------------------------------------------- the runtime API */
int cudaGetDeviceCount(int *n) {
    *n = ndevices();
    return cudaSuccess;
}

int cudaSetDevice(int device) {
    if (device < 0 || device >= ndevices()) return cudaErrorInvalidDevice;
    current = device;
    return cudaSuccess;
}

int cudaGetDevice(int *device) {
    *device = current;
    return cudaSuccess;
}

int cudaMalloc(void **p, size_t n) {
    char *mem = calloc(1, n ? n : 1);
    if (!mem) return cudaErrorMemoryAllocation;
    pthread_mutex_lock(&mu);
    add_alloc(mem, n, current);
    logf_locked("call cudaMalloc ptr=%p n=%zu device=%d", (void *)mem, n, current);
    pthread_mutex_unlock(&mu);
    *p = mem;
    return cudaSuccess;
}

int cudaFree(void *p) {
    pthread_mutex_lock(&mu);
    struct alloc *a = take_alloc(p);
    pthread_mutex_unlock(&mu);
    if (!a || a->device < 0) return cudaErrorInvalidValue;
    free(a->p);
    free(a);
    return cudaSuccess;
}

int cudaHostAlloc(void **p, size_t n, unsigned flags) {
    char *mem = calloc(1, n ? n : 1);
    if (!mem) return cudaErrorMemoryAllocation;
    pthread_mutex_lock(&mu);
    add_alloc(mem, n, -1);
    pinned_now += (long long)n;
    pinned_allocs++;
    if (pinned_now > pinned_peak) pinned_peak = pinned_now;
    logf_locked("call cudaHostAlloc ptr=%p n=%zu flags=%u", (void *)mem, n, flags);
    pthread_mutex_unlock(&mu);
    *p = mem;
    return cudaSuccess;
}

int cudaFreeHost(void *p) {
    pthread_mutex_lock(&mu);
    struct alloc *a = take_alloc(p);
    if (a && a->device < 0) pinned_now -= (long long)a->n;
    pthread_mutex_unlock(&mu);
    if (!a || a->device >= 0) return cudaErrorInvalidValue;
    free(a->p);
    free(a);
    return cudaSuccess;
}

int cudaStreamCreateWithFlags(void **stream, unsigned flags) {
    pthread_mutex_lock(&mu);
    struct stream *s = new_stream(current);
    logf_locked("call cudaStreamCreateWithFlags stream=%d device=%d flags=%u", s->id, current, flags);
    pthread_mutex_unlock(&mu);
    *stream = s;
    return cudaSuccess;
}

int cudaStreamDestroy(void *handle) {
    struct stream *s = handle;
    if (!s) return cudaErrorInvalidResourceHandle;
    struct work *w = calloc(1, sizeof *w);
    w->kind = W_STOP;
    pthread_mutex_lock(&mu);
    enqueue(s, w);
    pthread_mutex_unlock(&mu);
    pthread_join(s->thread, NULL); /* CUDA lets queued work finish too */
    free(w);
    free(s);
    return cudaSuccess;
}

int cudaEventCreateWithFlags(void **event, unsigned flags) {
    struct event *e = calloc(1, sizeof *e);
    e->device = current;
    e->flags = flags;
    pthread_mutex_lock(&mu);
    logf_locked("call cudaEventCreateWithFlags event=%p device=%d flags=%u", (void *)e, current, flags);
    pthread_mutex_unlock(&mu);
    *event = e;
    return cudaSuccess;
}

int cudaEventCreate(void **event) { return cudaEventCreateWithFlags(event, 0); }

int cudaEventDestroy(void *event) {
    free(event);
    return cudaSuccess;
}

int cudaEventRecord(void *event, void *stream) {
    struct event *e = event;
    pthread_mutex_lock(&mu);
    struct stream *s = stream_of(stream, current);
    int rc = cudaSuccess;
    if (!e || !s || s->device != current || e->device != s->device) {
        rc = cudaErrorInvalidResourceHandle;
        wrong_device++;
    } else {
        struct work *w = calloc(1, sizeof *w);
        w->kind = W_RECORD, w->event = e, w->seq = ++e->recorded;
        enqueue(s, w);
    }
    logf_locked("call cudaEventRecord event=%p stream=%d rc=%d", event, s ? s->id : -1, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

int cudaEventQuery(void *event) {
    struct event *e = event;
    pthread_mutex_lock(&mu);
    int rc = e->completed >= e->recorded ? cudaSuccess : cudaErrorNotReady;
    pthread_mutex_unlock(&mu);
    return rc;
}

int cudaEventSynchronize(void *event) {
    struct event *e = event;
    pthread_mutex_lock(&mu);
    if (!(e->flags & EVENT_BLOCKING_SYNC)) spinning_syncs++;
    uint64_t want = e->recorded;
    while (e->completed < want) pthread_cond_wait(&changed, &mu);
    logf_locked("call cudaEventSynchronize event=%p", event);
    pthread_mutex_unlock(&mu);
    return cudaSuccess;
}

int cudaStreamWaitEvent(void *stream, void *event, unsigned flags) {
    struct event *e = event;
    pthread_mutex_lock(&mu);
    struct stream *s = stream_of(stream, current);
    int rc = cudaSuccess;
    if (!s || !e || s->device != current) {
        rc = cudaErrorInvalidResourceHandle;
        wrong_device++;
    } else if (e->recorded > 0) { /* an event never recorded: nothing to wait for */
        struct work *w = calloc(1, sizeof *w);
        w->kind = W_WAIT, w->event = e, w->seq = e->recorded;
        enqueue(s, w);
    }
    logf_locked("call cudaStreamWaitEvent stream=%d event=%p flags=%u rc=%d", s ? s->id : -1, event, flags, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

int cudaStreamSynchronize(void *stream) {
    void *e = NULL;
    cudaEventCreateWithFlags(&e, EVENT_BLOCKING_SYNC);
    int rc = cudaEventRecord(e, stream);
    if (rc == cudaSuccess) rc = cudaEventSynchronize(e);
    cudaEventDestroy(e);
    return rc;
}

int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
    pthread_mutex_lock(&mu);
    struct stream *s = stream_of(stream, current);
    const void *dev = kind == D2H ? src : dst, *host = kind == D2H ? dst : src;
    struct alloc *d = find(dev, n), *h = find(host, n);
    int rc = cudaSuccess;
    long long call = memcpy_calls++;
    if (!s || s->device != current) {
        rc = cudaErrorInvalidResourceHandle;
        wrong_device++;
    } else if ((kind != D2H && kind != H2D) || !d || d->device != s->device || (h && h->device >= 0)) {
        rc = cudaErrorInvalidValue; /* not this device's memory, or a "host" side that is device memory */
    } else if (call == fail_at) {
        rc = fail_code;
    } else {
        if (!h) pageable_copies++;
        struct work *w = calloc(1, sizeof *w);
        w->kind = W_COPY, w->dst = dst, w->src = src, w->n = n, w->copy_kind = kind, w->delay_us = copy_delay_us;
        enqueue(s, w);
    }
    logf_locked("call cudaMemcpyAsync kind=%d dst=%p src=%p n=%zu stream=%d rc=%d", kind, dst, src, n,
                s ? s->id : -1, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

const char *cudaGetErrorString(int rc) {
    switch (rc) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return "invalid argument";
        case cudaErrorMemoryAllocation: return "out of memory";
        case cudaErrorInvalidDevice: return "invalid device ordinal";
        case cudaErrorInvalidResourceHandle: return "invalid resource handle";
        case cudaErrorNotReady: return "device not ready";
        case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
        default: return "unknown error";
    }
}

/* ---------------------------------------------------------------- test-only entries */

/* The producer's kernel: after ``delay_us`` on ``stream``, ``n`` bytes (copied from ``src`` now) into
 * device memory at ``dst``. */
int fake_kernel_write(void *stream, void *dst, const void *src, size_t n, int delay_us) {
    pthread_mutex_lock(&mu);
    struct stream *s = stream_of(stream, current);
    struct alloc *d = find(dst, n);
    int rc = cudaSuccess;
    if (!s || s->device != current) rc = cudaErrorInvalidResourceHandle;
    else if (!d || d->device != s->device) rc = cudaErrorInvalidValue;
    else {
        struct work *w = calloc(1, sizeof *w);
        w->kind = W_KERNEL, w->dst = dst, w->n = n, w->delay_us = delay_us;
        w->owned = malloc(n ? n : 1);
        memcpy(w->owned, src, n);
        enqueue(s, w);
    }
    logf_locked("call kernel dst=%p n=%zu stream=%d delay_us=%d rc=%d", dst, n, s ? s->id : -1, delay_us, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

/* Every copy queued from now on takes ``us`` microseconds. */
void fake_set_copy_delay_us(int us) {
    pthread_mutex_lock(&mu);
    copy_delay_us = us;
    pthread_mutex_unlock(&mu);
}

/* The ``nth`` cudaMemcpyAsync from now (0: the next one) fails with ``code``. */
void fake_fail_memcpy(long long nth, int code) {
    pthread_mutex_lock(&mu);
    fail_at = memcpy_calls + nth;
    fail_code = code;
    pthread_mutex_unlock(&mu);
}

/* The log so far into ``out`` (up to ``cap`` bytes); returns its whole length. */
size_t fake_log(char *out, size_t cap) {
    pthread_mutex_lock(&mu);
    size_t n = log_len < cap ? log_len : cap;
    if (out && n) memcpy(out, log_buf, n);
    size_t total = log_len;
    pthread_mutex_unlock(&mu);
    return total;
}

/* Counters: page-locked bytes now, peak, allocations; async copies of pageable memory; event waits
 * that CUDA would spin (no cudaEventBlockingSync); calls on another device's stream. */
void fake_stats(long long *out) {
    pthread_mutex_lock(&mu);
    out[0] = pinned_now, out[1] = pinned_peak, out[2] = pinned_allocs, out[3] = pageable_copies;
    out[4] = spinning_syncs, out[5] = wrong_device;
    pthread_mutex_unlock(&mu);
}
