/* The summation kernels' thread pool: helpers that sleep (never spin) between calls, unlike
 * OpenMP's, whose idle threads spin after every parallel region and took the core the network
 * thread needed on a small host. A call that finds the pool busy (another thread is summing) runs on
 * its own thread rather than queueing: then the cores are busy anyway.
 *
 * One pool per shared object that includes this header (each is `static`); helpers are started on
 * first use, named "byteps-sum", and are not inherited by a fork()ed child. */
#ifndef BPS_POOL_H_
#define BPS_POOL_H_

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>

#define BPS_MAX_THREADS 64

typedef void (*bps_job_fn)(void *arg, int t, int nt);

typedef struct {
  pthread_mutex_t busy;   /* held by the one caller whose job the helpers run */
  pthread_mutex_t mu;     /* guards the fields below */
  pthread_cond_t wake;    /* helpers wait here for a new generation */
  pthread_cond_t done;    /* the caller waits here for remaining == 0 */
  int started;            /* helper threads running (thread t = 1 .. started) */
  unsigned long gen;      /* bumped for every job */
  bps_job_fn fn;
  void *arg;
  int nt;                 /* threads of the current job, caller included */
  int remaining;          /* helpers still to finish the current job */
  int atfork;             /* pthread_atfork registered */
} bps_pool_t;

static bps_pool_t bps_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                              PTHREAD_COND_INITIALIZER, 0, 0, NULL, NULL, 0, 0, 0};

typedef struct {
  int t;
  unsigned long gen0;
} bps_helper_arg;

static void bps_pool_after_fork_child(void) {
  /* only the forking thread exists in the child: no helper, nothing held */
  pthread_mutex_init(&bps_pool.busy, NULL);
  pthread_mutex_init(&bps_pool.mu, NULL);
  pthread_cond_init(&bps_pool.wake, NULL);
  pthread_cond_init(&bps_pool.done, NULL);
  bps_pool.started = 0;
  bps_pool.remaining = 0;
}

static void *bps_pool_main(void *p) {
  bps_helper_arg a = *(bps_helper_arg *)p;
  free(p);
#if defined(__linux__) && defined(_GNU_SOURCE)
  pthread_setname_np(pthread_self(), "byteps-sum");
#endif
  unsigned long seen = a.gen0;
  pthread_mutex_lock(&bps_pool.mu);
  for (;;) {
    while (bps_pool.gen == seen) pthread_cond_wait(&bps_pool.wake, &bps_pool.mu);
    seen = bps_pool.gen;
    if (a.t >= bps_pool.nt) continue;  /* a job for fewer threads than are started */
    bps_job_fn fn = bps_pool.fn;
    void *arg = bps_pool.arg;
    int nt = bps_pool.nt;
    pthread_mutex_unlock(&bps_pool.mu);
    fn(arg, a.t, nt);
    pthread_mutex_lock(&bps_pool.mu);
    if (--bps_pool.remaining == 0) pthread_cond_signal(&bps_pool.done);
  }
  return NULL;
}

/* Start helpers until `want` run (or creation fails); returns how many run. Caller holds busy. */
static int bps_pool_grow(int want) {
  if (!bps_pool.atfork) {
    pthread_atfork(NULL, NULL, bps_pool_after_fork_child);
    bps_pool.atfork = 1;
  }
  while (bps_pool.started < want) {
    bps_helper_arg *a = (bps_helper_arg *)malloc(sizeof(bps_helper_arg));
    if (a == NULL) break;
    a->t = bps_pool.started + 1;
    a->gen0 = bps_pool.gen; /* stable: only a caller holding busy bumps it */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024); /* the kernels use a few KB (BPS_BLOCK_ELEMS floats) */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* helpers inherit a full mask: signals go to other threads */
    pthread_t th;
    int rc = pthread_create(&th, &attr, bps_pool_main, a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
      free(a);
      break;
    }
    bps_pool.started++;
  }
  return bps_pool.started;
}

/* Run fn(arg, t, nt) for t = 0 .. nt-1, t = 0 on the calling thread; returns when all are done.
 * If another thread is using the pool, runs fn(arg, 0, 1) (the whole range) on this thread. */
static void bps_parallel(bps_job_fn fn, void *arg, int nt) {
  if (nt > BPS_MAX_THREADS) nt = BPS_MAX_THREADS;
  if (nt <= 1 || pthread_mutex_trylock(&bps_pool.busy) != 0) {
    fn(arg, 0, 1);
    return;
  }
  int have = bps_pool_grow(nt - 1) + 1;
  if (nt > have) nt = have;
  if (nt <= 1) {
    pthread_mutex_unlock(&bps_pool.busy);
    fn(arg, 0, 1);
    return;
  }
  pthread_mutex_lock(&bps_pool.mu);
  bps_pool.fn = fn;
  bps_pool.arg = arg;
  bps_pool.nt = nt;
  bps_pool.remaining = nt - 1;
  bps_pool.gen++;
  pthread_cond_broadcast(&bps_pool.wake);
  pthread_mutex_unlock(&bps_pool.mu);
  fn(arg, 0, nt);
  pthread_mutex_lock(&bps_pool.mu);
  while (bps_pool.remaining > 0) pthread_cond_wait(&bps_pool.done, &bps_pool.mu);
  pthread_mutex_unlock(&bps_pool.mu);
  pthread_mutex_unlock(&bps_pool.busy);
}

#endif /* BPS_POOL_H_ */
