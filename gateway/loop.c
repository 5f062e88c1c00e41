/* loop.c - the I/O thread: one libevent base driving its HTTP daemon
 * (front.c), upstream transfers, its share of the Postgres pool and Redis;
 * other threads hand it work through a locked queue woken with event_active. It assembles the thread's context
 * (gateway/ctx.h) and never runs a request itself. */
#include <event2/event.h>
#include <event2/thread.h>
/* Under AddressSanitizer malloc is ASan's: glibc's malloc_trim would set up a glibc arena for the thread, and
 * glibc then aborts at thread exit (__malloc_arena_thread_freeres: attached_threads). */
#if defined(__SANITIZE_ADDRESS__)
#define LOOP_NO_TRIM 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOOP_NO_TRIM 1
#endif
#endif
#if defined(__GLIBC__) && !defined(LOOP_NO_TRIM)
#define LOOP_TRIM 1
#include <malloc.h>
#endif
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gateway/cache.h"
#include "gateway/ctx.h"
#include "gateway/loop.h"
#include "gateway/pipeline.h"
#include "gateway/reload.h"
#include "gateway/probe.h"
#include "store/notify.h"
#include "store/store.h"
#include "upstream/upstream.h"

struct work {
    void (*fn)(void *);
    void *arg;
    struct work *next;
};

struct gw_loop {
    struct gw_ctx ctx; /* what its jobs work with (gateway/ctx.h): assembled here, handed to each job */
    const struct conf *conf;
    struct conf *conf_share; /* shallow copy with this loop's share of the pool, or NULL */
    struct event *wake;
    struct event *trim; /* gives freed heap memory back to the system, once a second */
    pthread_t thread;
    bool running;
    pthread_mutex_t mu;
    struct work *head, *tail;
    bool stopping;
    struct gw_loops *group;            /* the loops of this process, or NULL (alone) */
    struct store_notify *cache_listen; /* the process's purge listener, on the first loop only */
};

static void drain(evutil_socket_t fd, short what, void *arg)
{
    struct gw_loop *l = arg;
    pthread_mutex_lock(&l->mu);
    struct work *w = l->head;
    l->head = l->tail = NULL;
    bool stop = l->stopping;
    pthread_mutex_unlock(&l->mu);
    while (w) {
        struct work *next = w->next;
        w->fn(w->arg);
        free(w);
        w = next;
    }
    if (stop)
        event_base_loopbreak(l->ctx.base);
}

/* glibc keeps what a thread frees in that thread's arena; after a burst (a
 * thousand connections, large bodies) the RSS would stay at the burst's
 * peak. malloc_trim returns the free pages of every arena (a few µs when
 * there is little to do). */
static void trim_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)arg;
#ifdef LOOP_TRIM
    malloc_trim(0);
#endif
}

static void *loop_main(void *arg)
{
    struct gw_loop *l = arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    event_base_loop(l->ctx.base, EVLOOP_NO_EXIT_ON_EMPTY);
    return NULL;
}

static void ev_log(int severity, const char *msg)
{
    char q[512];
    cm_log(severity >= EVENT_LOG_ERR ? CM_ERROR : CM_WARN, "libevent", "msg=%s", cm_log_quote(q, sizeof q, msg));
}

struct gw_loop *gw_loop_create(const struct conf *conf, size_t nloops, char **err)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, (void (*)(void))evthread_use_pthreads);
    event_set_log_callback(ev_log);

    struct gw_loop *l = cm_calloc(1, sizeof *l);
    l->conf = conf;
    pthread_mutex_init(&l->mu, NULL);
    l->ctx.base = event_base_new();
    if (!l->ctx.base) {
        *err = cm_strdup("cannot create the event loop");
        goto fail;
    }
    l->wake = event_new(l->ctx.base, -1, EV_PERSIST, drain, l);
    event_add(l->wake, NULL);
    l->trim = event_new(l->ctx.base, -1, EV_PERSIST, trim_cb, l);
    static const struct timeval every_s = {1, 0};
    if (l->trim)
        event_add(l->trim, &every_s);
    l->ctx.nloops = nloops > 0 ? nloops : 1;
    long max_host = 0; /* for requests that bring no bound (the libcurl path): the largest, shared too */
    for (size_t i = 0; i < conf->upstreams_n; i++) {
        long share = (long)gw_ctx_upstream_max(&l->ctx, &conf->upstreams[i]);
        max_host = share > max_host ? share : max_host;
    }
    l->ctx.up = up_client_create(l->ctx.base, max_host);
    if (!l->ctx.up) {
        *err = cm_strdup("cannot create the upstream client");
        goto fail;
    }
    l->ctx.store = store_create(l->ctx.base, conf, err);
    if (!l->ctx.store)
        goto fail;
    l->ctx.probe = gw_probe_create(&l->ctx);
    return l;
fail:
    gw_loop_destroy(l);
    return NULL;
}

bool gw_loop_start(struct gw_loop *l)
{
    if (pthread_create(&l->thread, NULL, loop_main, l) != 0)
        return false;
    l->running = true;
    return true;
}

void gw_loop_submit(struct gw_loop *l, void (*fn)(void *), void *arg)
{
    struct work *w = cm_malloc(sizeof *w);
    w->fn = fn;
    w->arg = arg;
    w->next = NULL;
    pthread_mutex_lock(&l->mu);
    bool was_empty = l->head == NULL;
    if (l->tail)
        l->tail->next = w;
    else
        l->head = w;
    l->tail = w;
    pthread_mutex_unlock(&l->mu);
    if (was_empty)
        event_active(l->wake, EV_READ, 0);
}

void gw_loop_destroy(struct gw_loop *l)
{
    if (!l)
        return;
    if (l->running) {
        pthread_mutex_lock(&l->mu);
        l->stopping = true;
        pthread_mutex_unlock(&l->mu);
        event_active(l->wake, EV_READ, 0);
        pthread_join(l->thread, NULL);
        l->running = false;
    }
    /* Anything still queued after the break runs now, on this thread. */
    drain(-1, 0, l);
    store_notify_destroy(l->cache_listen);
    gw_conf_unref(l->ctx.cur);
    store_destroy(l->ctx.store);
    up_client_destroy(l->ctx.up);
    gw_probe_destroy(l->ctx.probe); /* after the store and upstream client: none of their callbacks comes any more */
    free(l->conf_share);            /* shallow: the strings belong to the real conf */
    if (l->wake)
        event_free(l->wake);
    if (l->trim)
        event_free(l->trim);
    if (l->ctx.base)
        event_base_free(l->ctx.base);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

struct gw_ctx *gw_loop_ctx(struct gw_loop *l)
{
    return &l->ctx;
}

struct gw_cache *gw_loop_cache(struct gw_loop *l)
{
    return l->ctx.cache;
}

struct event_base *gw_loop_base(struct gw_loop *l)
{
    return l->ctx.base;
}

struct store *gw_loop_store(struct gw_loop *l)
{
    return l->ctx.store;
}

const struct conf *gw_loop_conf(struct gw_loop *l)
{
    return l->conf;
}

struct gw_conf *gw_loop_current(struct gw_loop *l)
{
    return l->ctx.cur;
}

void gw_loop_set_schema_ready(struct gw_loop *l, bool ready)
{
    atomic_store(&l->ctx.schema_ready, ready);
}

bool gw_loop_schema_ready(struct gw_loop *l)
{
    return atomic_load(&l->ctx.schema_ready);
}

/* Every loop's pool must have heard from Postgres within the last second:
 * one loop whose idle connections have not noticed a stop yet must not
 * answer for the others. */
bool gw_loop_postgres_ready(struct gw_loop *l)
{
    size_t n = l->group ? l->group->n : 1;
    for (size_t i = 0; i < n; i++) {
        struct gw_loop *x = l->group ? l->group->v[i] : l;
        if (!gw_loop_schema_ready(x) || !store_postgres_healthy(x->ctx.store))
            return false;
    }
    return true;
}

size_t gw_loop_jobs(struct gw_loop *l)
{
    return atomic_load(&l->ctx.njobs);
}

/* ---- several loops: each owns its HTTP daemon, curl multi handle, Redis context
 * and share of the Postgres pool. */

/* The purge listener's reports, on the first loop's thread: they feed the replay cache (may be NULL: off) and the
 * purge epoch that decides whether a Redis answer may be used. */
static void cache_listen_cb(void *arg, enum store_notify_event ev, const char *payload, size_t len)
{
    struct gw_loops *ls = arg;
    struct gw_cache *c = ls->v[0]->ctx.cache;
    switch (ev) {
    case STORE_NOTIFY_UP:
        store_epoch_set_current(ls->epoch, true);
        gw_cache_set_online(c, true, true);
        return;
    case STORE_NOTIFY_LATE:
        store_epoch_set_current(ls->epoch, false);
        gw_cache_set_online(c, false, true); /* a notification may be late, none is lost: unused, kept */
        return;
    case STORE_NOTIFY_DOWN:
        /* a notification may be missed from now on: the cache is emptied, unused */
        store_epoch_set_current(ls->epoch, false);
        gw_cache_set_online(c, false, false);
        return;
    case STORE_NOTIFY_MESSAGE:
        gw_cache_notified(c, payload, len);
        return;
    case STORE_NOTIFY_EPOCH: {
        char num[24];
        if (len == 0 || len >= sizeof num)
            return;
        memcpy(num, payload, len);
        num[len] = '\0';
        char *end = NULL;
        unsigned long long v = strtoull(num, &end, 10);
        if (end && *end == '\0')
            store_epoch_heard(ls->epoch, v);
        return;
    }
    }
}

/* One replay cache for the process (when on), shared by its loops, and one purge listener on the first loop (for
 * the cache, and for the purge epoch whenever Redis is configured). */
static void listen_start(struct gw_loops *ls, const struct conf *conf, bool cache)
{
    struct gw_cache *c = cache ? gw_cache_create(conf->replay_cache_max_bytes, conf->replay_cache_max_entries) : NULL;
    for (size_t i = 0; i < ls->n; i++)
        ls->v[i]->ctx.cache = c;
    ls->v[0]->cache_listen = store_notify_create(ls->v[0]->ctx.base, conf->postgres_url, cache_listen_cb, ls);
    if (!ls->v[0]->cache_listen)
        cm_log(CM_WARN, "cache_listener_failed", "detail=\"the replay cache and the answers in Redis stay unused\"");
}

struct gw_loops *gw_loops_create(const struct conf *conf, size_t n, char **err)
{
    /* store.pool is the process's maximum (SPEC 3): the replay cache's listener takes one of its connections, and
     * a pool of one leaves none for it, so the cache is off there. */
    bool cache = conf->replay_cache_max_bytes > 0 && conf->replay_cache_max_entries > 0;
    bool redis = conf->redis_url && *conf->redis_url;
    if ((cache || redis) && conf->pool < 2) {
        if (cache)
            cm_log(CM_INFO, "replay_cache_off",
                   "reason=\"store.pool is 1: no connection left for its purge listener\"");
        if (redis)
            cm_log(CM_INFO, "redis_answers_off",
                   "reason=\"store.pool is 1: no connection left for the purge listener; Postgres answers every "
                   "replay\"");
        cache = redis = false;
    }
    bool listen = cache || redis;
    uint32_t pool = listen ? conf->pool - 1 : conf->pool;
    if (n < 1)
        n = 1;
    if (n > pool)
        n = pool; /* every loop needs at least one Postgres connection */
    struct gw_loops *ls = cm_calloc(1, sizeof *ls);
    ls->v = cm_calloc(n, sizeof *ls->v);
    ls->epoch = store_epoch_create();
    for (size_t i = 0; i < n; i++) {
        struct conf *share = cm_malloc(sizeof *share);
        *share = *conf;
        share->pool = pool / (uint32_t)n + (i < pool % n ? 1 : 0);
        ls->v[i] = gw_loop_create(share, n, err);
        if (!ls->v[i]) {
            free(share);
            gw_loops_destroy(ls);
            return NULL;
        }
        ls->v[i]->conf_share = share;
        ls->v[i]->group = ls;
        store_set_epoch(ls->v[i]->ctx.store, ls->epoch);
        ls->n++;
    }
    if (listen)
        listen_start(ls, conf, cache);
    return ls;
}

void gw_loops_install(struct gw_loops *ls, struct gw_conf *c)
{
    for (size_t i = 0; i < ls->n; i++) {
        gw_conf_unref(ls->v[i]->ctx.cur);
        ls->v[i]->ctx.cur = gw_conf_ref(c);
    }
}

/* One swap over every loop; freed by whoever drops the last reference (the waiter or the last loop). */
struct swap {
    struct gw_conf *c;
    atomic_size_t pending; /* loops that have not swapped yet */
    atomic_size_t refs;
};

struct swap_item {
    struct gw_loop *l;
    struct swap *sw;
};

static void swap_release(struct swap *sw)
{
    if (atomic_fetch_sub(&sw->refs, 1) == 1) {
        gw_conf_unref(sw->c);
        free(sw);
    }
}

/* Loop thread, between two events: requests already accepted keep their own reference to the old one. */
static void swap_run(void *arg)
{
    struct swap_item *it = arg;
    struct gw_conf *old = it->l->ctx.cur;
    it->l->ctx.cur = gw_conf_ref(it->sw->c);
    gw_conf_unref(old);
    atomic_fetch_sub(&it->sw->pending, 1);
    swap_release(it->sw);
    free(it);
}

bool gw_loops_swap(struct gw_loops *ls, struct gw_conf *c, uint64_t timeout_ms)
{
    struct swap *sw = cm_calloc(1, sizeof *sw);
    sw->c = gw_conf_ref(c);
    atomic_store(&sw->pending, ls->n);
    atomic_store(&sw->refs, ls->n + 1);
    for (size_t i = 0; i < ls->n; i++) {
        struct swap_item *it = cm_malloc(sizeof *it);
        it->l = ls->v[i];
        it->sw = sw;
        gw_loop_submit(ls->v[i], swap_run, it);
    }
    uint64_t deadline = cm_now_ms() + timeout_ms;
    while (atomic_load(&sw->pending) > 0 && cm_now_ms() < deadline) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    bool done = atomic_load(&sw->pending) == 0;
    swap_release(sw);
    return done;
}

bool gw_loops_start(struct gw_loops *ls)
{
    for (size_t i = 0; i < ls->n; i++)
        if (!gw_loop_start(ls->v[i]))
            return false;
    return true;
}

void gw_loops_destroy(struct gw_loops *ls)
{
    if (!ls)
        return;
    struct gw_cache *cache = ls->n ? ls->v[0]->ctx.cache : NULL;
    for (size_t i = 0; i < ls->n; i++)
        gw_loop_destroy(ls->v[i]);
    gw_cache_destroy(cache); /* after every loop: all of them used it */
    store_epoch_destroy(ls->epoch);
    free(ls->v);
    free(ls);
}

size_t gw_loops_jobs(struct gw_loops *ls)
{
    size_t n = 0;
    for (size_t i = 0; i < ls->n; i++)
        n += gw_loop_jobs(ls->v[i]);
    return n;
}

void gw_loops_set_tracer(struct gw_loops *ls, struct up_tracer *t)
{
    for (size_t i = 0; i < ls->n; i++)
        ls->v[i]->ctx.tracer = t;
}

void gw_loops_set_schema_ready(struct gw_loops *ls, bool ready)
{
    for (size_t i = 0; i < ls->n; i++)
        gw_loop_set_schema_ready(ls->v[i], ready);
}

void gw_loops_abort_all(struct gw_loops *ls)
{
    for (size_t i = 0; i < ls->n; i++)
        gw_loop_submit(ls->v[i], gw_pipeline_abort_all, &ls->v[i]->ctx);
}
