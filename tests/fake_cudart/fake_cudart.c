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
 *
 * It is NCCL too (the NCCL stages dlopen it through BYTEPS_NCCL), across the processes of one machine:
 *   - ncclGetUniqueId names a POSIX shared-memory segment that it creates; ncclCommInitRank maps it and
 *     blocks until every rank has called it, as NCCL does;
 *   - ncclReduce / ncclBroadcast (sum) are work on the caller's stream: when the stream reaches one, its
 *     rank waits in the segment for every rank's collective of the same number (each rank numbers its
 *     calls on a communicator in issue order), checks that they are the same call (kind, count, dtype,
 *     root: a mismatch aborts the process, saying what differs, where NCCL would hang or corrupt), then
 *     each computes its part. A rank that issues in another order than the others therefore deadlocks
 *     as on a GPU, until the 60 s cap, which aborts the process naming the collective;
 *   - device memory checks as for copies, and a collective on a stream of another device than the
 *     communicator's fails (ncclUnhandledCudaError);
 *   - ncclCommAbort ends this rank's waiting collectives at once (they complete without data); the
 *     other ranks' go on waiting, as with NCCL.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
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

enum { W_COPY, W_KERNEL, W_RECORD, W_WAIT, W_STOP, W_NCCL };
struct fake_comm;
struct work {
    int kind;
    struct fake_comm *comm; /* W_NCCL: the communicator, its call (reduce or broadcast), dtype, root */
    int nccl_call, dtype, root;
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
static void run_collective(struct work *w);

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
        } else if (w->kind == W_NCCL) { /* waits for the other ranks, outside the lock */
            pthread_mutex_unlock(&mu);
            run_collective(w);
            pthread_mutex_lock(&mu);
            logf_locked("done nccl call=%d dst=%p n=%zu root=%d seq=%llu stream=%d", w->nccl_call, w->dst, w->n,
                        w->root, (unsigned long long)w->seq, s->id);
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

/* ---------------------------------------------------------------- NCCL, across processes */
enum { ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInvalidArgument = 4 };
enum { CALL_REDUCE = 1, CALL_BROADCAST = 2 };
#define FAKE_NCCL_RANKS 8
#define FAKE_NCCL_AREA ((size_t)64 << 20) /* bytes per rank and collective (sparse until written) */
#define FAKE_NCCL_WAIT_S 60

typedef struct { char internal[128]; } ncclUniqueId;

struct shared_comm { /* the segment's first page; then FAKE_NCCL_RANKS areas of FAKE_NCCL_AREA bytes */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int nranks, joined;
    uint64_t cur;       /* the collective in progress (every rank's number of it) */
    int arrived, departed;
    int call, dtype, root; /* the first arrival's, which the others must equal */
    size_t n;
};

struct fake_comm {
    struct shared_comm *sh;
    int rank, nranks, device;
    uint64_t issued;
    int aborted; /* ncclCommAbort (under sh->mu) */
};

static size_t segment_bytes(void) { return 4096 + FAKE_NCCL_RANKS * FAKE_NCCL_AREA; }
static char *area(struct shared_comm *sh, int rank) { return (char *)sh + 4096 + (size_t)rank * FAKE_NCCL_AREA; }

static int nccl_itemsize(int t) {
    switch (t) {
        case 0: case 1: return 1;
        case 6: case 9: return 2;
        case 2: case 3: case 7: return 4;
        case 4: case 5: case 8: return 8;
        default: return -1;
    }
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, f;
    if (exp == 0) {
        if (man == 0) f = sign;
        else { /* subnormal */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            f = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) f = sign | 0x7f800000u | (man << 13);
    else f = sign | ((exp - 15 + 127) << 23) | (man << 13);
    float out;
    memcpy(&out, &f, 4);
    return out;
}

static uint16_t float_to_half(float v) { /* round to nearest even; no NaN payloads */
    uint32_t f;
    memcpy(&f, &v, 4);
    uint32_t sign = (f >> 16) & 0x8000;
    int exp = (int)((f >> 23) & 0xff) - 127 + 15;
    uint32_t man = f & 0x7fffff;
    if (((f >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        int shift = 14 - exp;
        uint32_t half = man >> shift, rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)exp << 10) | (man >> 13), rest = man & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;
    return (uint16_t)half;
}

/* dst = sum over ranks of their areas (n elements of NCCL type t) */
static void sum_areas(struct shared_comm *sh, void *dst, size_t n, int t) {
    for (size_t i = 0; i < n; i++) {
        double acc = 0;
        long long iacc = 0;
        for (int r = 0; r < sh->nranks; r++) {
            const char *a = area(sh, r);
            switch (t) {
                case 0: iacc += ((const int8_t *)a)[i]; break;
                case 1: iacc += ((const uint8_t *)a)[i]; break;
                case 2: iacc += ((const int32_t *)a)[i]; break;
                case 3: iacc += ((const uint32_t *)a)[i]; break;
                case 4: case 5: iacc += ((const int64_t *)a)[i]; break;
                case 6: acc += half_to_float(((const uint16_t *)a)[i]); break;
                case 7: acc += ((const float *)a)[i]; break;
                case 8: acc += ((const double *)a)[i]; break;
                case 9: {
                    uint32_t f = (uint32_t)((const uint16_t *)a)[i] << 16;
                    float v;
                    memcpy(&v, &f, 4);
                    acc += v;
                    break;
                }
            }
        }
        switch (t) {
            case 0: ((int8_t *)dst)[i] = (int8_t)iacc; break;
            case 1: ((uint8_t *)dst)[i] = (uint8_t)iacc; break;
            case 2: ((int32_t *)dst)[i] = (int32_t)iacc; break;
            case 3: ((uint32_t *)dst)[i] = (uint32_t)iacc; break;
            case 4: case 5: ((int64_t *)dst)[i] = (int64_t)iacc; break;
            case 6: ((uint16_t *)dst)[i] = float_to_half((float)acc); break;
            case 7: ((float *)dst)[i] = (float)acc; break;
            case 8: ((double *)dst)[i] = acc; break;
            case 9: {
                float v = (float)acc;
                uint32_t f;
                memcpy(&f, &v, 4);
                f += 0x7fff + ((f >> 16) & 1); /* round to nearest even */
                ((uint16_t *)dst)[i] = (uint16_t)(f >> 16);
                break;
            }
        }
    }
}

static int wait_shared(struct shared_comm *sh, struct timespec *deadline) {
    return pthread_cond_timedwait(&sh->cv, &sh->mu, deadline);
}

static void deadline_in(struct timespec *ts, int seconds) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += seconds;
}

/* A stream reached collective ``w``: every rank's same-numbered one, then this rank's part of it. */
static void run_collective(struct work *w) {
    struct fake_comm *c = w->comm;
    struct shared_comm *sh = c->sh;
    size_t bytes = w->n * (size_t)nccl_itemsize(w->dtype);
    struct timespec deadline;
    deadline_in(&deadline, FAKE_NCCL_WAIT_S);
    pthread_mutex_lock(&sh->mu);
    while (sh->cur != w->seq && !c->aborted)
        if (wait_shared(sh, &deadline) != 0) goto stuck;
    if (c->aborted) goto out;
    if (sh->arrived == 0) {
        sh->call = w->nccl_call, sh->dtype = w->dtype, sh->root = w->root, sh->n = w->n;
    } else if (sh->call != w->nccl_call || sh->dtype != w->dtype || sh->root != w->root || sh->n != w->n) {
        fprintf(stderr, "fake NCCL: collective %llu differs between ranks: rank %d issued call %d dtype %d root %d "
                        "count %zu, another rank call %d dtype %d root %d count %zu\n",
                (unsigned long long)w->seq, c->rank, w->nccl_call, w->dtype, w->root, w->n, sh->call, sh->dtype,
                sh->root, sh->n);
        abort();
    }
    if (w->nccl_call == CALL_REDUCE || c->rank == w->root) memcpy(area(sh, c->rank), w->src, bytes);
    sh->arrived++;
    pthread_cond_broadcast(&sh->cv);
    while (sh->arrived < sh->nranks && !c->aborted)
        if (wait_shared(sh, &deadline) != 0) goto stuck;
    if (c->aborted) goto out;
    if (w->nccl_call == CALL_REDUCE && c->rank == w->root) sum_areas(sh, w->dst, w->n, w->dtype);
    if (w->nccl_call == CALL_BROADCAST && c->rank != w->root) memcpy(w->dst, area(sh, w->root), bytes);
    if (++sh->departed == sh->nranks) {
        sh->arrived = sh->departed = 0;
        sh->cur++;
        pthread_cond_broadcast(&sh->cv);
    }
out:
    pthread_mutex_unlock(&sh->mu);
    return;
stuck:
    fprintf(stderr, "fake NCCL: rank %d waited %d s for collective %llu (call %d): %d of %d ranks arrived\n", c->rank,
            FAKE_NCCL_WAIT_S, (unsigned long long)w->seq, w->nccl_call, sh->arrived, sh->nranks);
    abort();
}

static int id_counter;

int ncclGetUniqueId(ncclUniqueId *id) {
    memset(id, 0, sizeof *id);
    pthread_mutex_lock(&mu);
    snprintf(id->internal, sizeof id->internal, "/bps-fake-nccl-%d-%d", (int)getpid(), ++id_counter);
    pthread_mutex_unlock(&mu);
    int fd = shm_open(id->internal, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return ncclSystemError;
    if (ftruncate(fd, (off_t)segment_bytes()) != 0) {
        close(fd);
        return ncclSystemError;
    }
    struct shared_comm *sh = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (sh == MAP_FAILED) return ncclSystemError;
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutex_init(&sh->mu, &ma);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
    pthread_cond_init(&sh->cv, &ca);
    munmap(sh, 4096);
    return ncclSuccess;
}

int ncclCommInitRank(struct fake_comm **comm, int nranks, ncclUniqueId id, int rank) {
    if (nranks < 1 || nranks > FAKE_NCCL_RANKS || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    int fd = shm_open(id.internal, O_RDWR, 0600);
    if (fd < 0) return ncclSystemError;
    struct shared_comm *sh = mmap(NULL, segment_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (sh == MAP_FAILED) return ncclSystemError;
    struct timespec deadline;
    deadline_in(&deadline, FAKE_NCCL_WAIT_S);
    pthread_mutex_lock(&sh->mu);
    if (sh->joined == 0) sh->nranks = nranks;
    int rc = sh->nranks == nranks ? ncclSuccess : ncclInvalidArgument;
    if (rc == ncclSuccess && ++sh->joined == nranks) {
        shm_unlink(id.internal); /* every rank has it mapped: the name is no longer needed */
        pthread_cond_broadcast(&sh->cv);
    }
    while (rc == ncclSuccess && sh->joined < nranks)
        if (wait_shared(sh, &deadline) != 0) rc = ncclSystemError;
    pthread_mutex_unlock(&sh->mu);
    struct fake_comm *c = calloc(1, sizeof *c);
    c->sh = sh, c->rank = rank, c->nranks = nranks, c->device = current;
    pthread_mutex_lock(&mu);
    logf_locked("call ncclCommInitRank rank=%d nranks=%d device=%d rc=%d", rank, nranks, current, rc);
    pthread_mutex_unlock(&mu);
    if (rc != ncclSuccess) {
        free(c);
        return rc;
    }
    *comm = c;
    return ncclSuccess;
}

int ncclCommAbort(struct fake_comm *c) {
    if (!c) return ncclInvalidArgument;
    pthread_mutex_lock(&c->sh->mu);
    c->aborted = 1;
    pthread_cond_broadcast(&c->sh->cv);
    pthread_mutex_unlock(&c->sh->mu);
    pthread_mutex_lock(&mu);
    logf_locked("call ncclCommAbort rank=%d", c->rank);
    pthread_mutex_unlock(&mu);
    return ncclSuccess;
}

int ncclGetVersion(int *version) {
    *version = 22105; /* 2.21.5 */
    return ncclSuccess;
}

int ncclCommDestroy(struct fake_comm *c) { return ncclCommAbort(c); }

static int collective(int call, const void *send, void *recv, size_t n, int t, int root, struct fake_comm *c,
                      void *stream) {
    pthread_mutex_lock(&mu);
    struct stream *s = stream_of(stream, current);
    size_t bytes = n * (size_t)(nccl_itemsize(t) > 0 ? nccl_itemsize(t) : 1);
    struct alloc *a = find(send, bytes), *b = find(recv, bytes);
    int rc = ncclSuccess;
    if (!c || nccl_itemsize(t) < 0 || root < 0 || root >= c->nranks || bytes > FAKE_NCCL_AREA) rc = ncclInvalidArgument;
    else if (!s || s->device != current || s->device != c->device) rc = ncclUnhandledCudaError;
    else if (!a || a->device != s->device || !b || b->device != s->device) rc = ncclInvalidArgument;
    uint64_t seq = rc == ncclSuccess ? c->issued++ : 0;
    if (rc == ncclSuccess) {
        struct work *w = calloc(1, sizeof *w);
        w->kind = W_NCCL, w->comm = c, w->nccl_call = call, w->dtype = t, w->root = root, w->n = n;
        w->src = send, w->dst = recv, w->seq = seq;
        enqueue(s, w);
    }
    logf_locked("call nccl call=%d rank=%d seq=%llu dst=%p n=%zu dtype=%d root=%d stream=%d rc=%d", call,
                c ? c->rank : -1, (unsigned long long)seq, recv, n, t, root, s ? s->id : -1, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

int ncclReduce(const void *send, void *recv, size_t n, int t, int op, int root, struct fake_comm *c, void *stream) {
    if (op != 0) return ncclInvalidArgument; /* sum only */
    return collective(CALL_REDUCE, send, recv, n, t, root, c, stream);
}

int ncclBroadcast(const void *send, void *recv, size_t n, int t, int root, struct fake_comm *c, void *stream) {
    return collective(CALL_BROADCAST, send, recv, n, t, root, c, stream);
}

const char *ncclGetErrorString(int rc) {
    switch (rc) {
        case ncclSuccess: return "no error";
        case ncclUnhandledCudaError: return "unhandled cuda error";
        case ncclSystemError: return "unhandled system error";
        case ncclInvalidArgument: return "invalid argument";
        default: return "unknown NCCL error";
    }
}
