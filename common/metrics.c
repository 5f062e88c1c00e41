/* metrics.c - the process-wide Prometheus registry: relaxed C11 atomics, rendered as text format 0.0.4. Never a lock,
 * never another room. */
#include "common/metrics.h"

#include "common/alog.h"
#include "common/recent.h"
#include "common/version.h"

#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

/* Upper bounds (seconds) of the finite histogram buckets; +Inf is implied. */
static const double bucket_le[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
static const char *const bucket_le_text[] = {"0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25",
                                             "0.5",   "1",      "2.5",   "5",    "10",    "30",   "60"};
#define NBUCKETS_FINITE (sizeof(bucket_le) / sizeof(bucket_le[0]))
#define NBUCKETS        (NBUCKETS_FINITE + 1)

struct hist {
    /* Per-bucket counts, not cumulative: one atomic add per observation.
     * _count is derived from them when rendering, so +Inf == _count always. */
    _Atomic uint64_t bucket[NBUCKETS];
    _Atomic uint64_t sum_us;
};

/* One route's upstream requests to one upstream: idemgate_upstream_seconds{route,upstream} and
 * idemgate_upstream_responses_total{route,upstream,class}. */
#define ROUTE_UPSTREAMS 4 /* upstreams one route's series keep apart (a reload may move it); more share the last */
#define UPSTREAM_NAMES  256
enum { CLASS_2XX, CLASS_3XX, CLASS_4XX, CLASS_5XX, CLASS_NONE, CLASS__COUNT };
static const char *const class_names[CLASS__COUNT] = {"2xx", "3xx", "4xx", "5xx", "none"};
struct up_series {
    _Atomic size_t up; /* upstream name index + 1; 0: unused */
    struct hist h;
    _Atomic uint64_t cls[CLASS__COUNT];
};

struct route_ctr {
    _Atomic uint64_t requests[CM_OUT__COUNT];
    _Atomic uint64_t dedup_hits;
    _Atomic uint64_t parameter_conflicts;
    _Atomic uint64_t in_flight_conflicts;
    _Atomic uint64_t completion_failures;
    _Atomic uint64_t stuck_processing;
    _Atomic uint64_t stale_rejections; /* ordering guard: 409 stale-sequence */
    _Atomic uint64_t sequence_gaps;    /* ordering guard: seq > applied + 1 */
    _Atomic uint64_t unknown_resolved[CM_RESOLVED__COUNT];
    _Atomic uint64_t shadow_decisions[CM_SHADOW__COUNT];
    _Atomic uint64_t shadow_store_errors;
    _Atomic uint64_t signature_failures; /* verify: 401 signature-invalid (or, in shadow mode, forwarded) */
    struct up_series ups[ROUTE_UPSTREAMS];
};

/* Route names get a slot each, in the order they were first seen (the routes at start, then the new names of each
 * reload), and keep it until cm_metrics_reset: a renamed or removed route keeps its counters, and a loop still
 * counting under an old configuration never reads freed memory. Slots live in fixed chunks that are never moved,
 * so readers need no lock: they load nroutes (acquire) and only touch slots below it. "_default" and "_none" have
 * their own slots. */
#define ROUTE_CHUNK  64
#define ROUTE_CHUNKS 256 /* at most 16384 route names over the life of the process */

struct route_slot {
    char *name;
    struct route_ctr c;
};

struct registry {
    _Atomic size_t nroutes;
    struct route_slot *_Atomic chunk[ROUTE_CHUNKS];
    pthread_mutex_t mu; /* one writer at a time */
};

static struct route_ctr fallback_rc[2]; /* "_default", "_none" */
static struct registry reg = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* Every route's upstream durations for the status page, by minute: the page shows the last five minutes, not the
 * process's life. A slot is taken over by the first observation of a new minute (its compare-and-swap wins), which
 * zeroes it: an observation racing that zeroing may be lost, never counted twice. */
#define WIN_SLOTS   8
#define WIN_MINUTES 5 /* the window: this many whole minutes before the current one, and the current one */
struct win_slot {
    _Atomic uint64_t minute; /* minute number + 1 of what the slot holds; 0: nothing */
    struct hist h;
};
static struct win_slot win[WIN_SLOTS];
static uint64_t win_clock_default(void)
{
    return cm_now_ms() / 1000;
}
static uint64_t (*win_clock)(void) = win_clock_default;
/* Upstream names get an index each (as routes a slot), never freed before cm_metrics_reset; readers load n_up
 * (acquire) and read names below it. Inserts under reg.mu. */
static char *up_names[UPSTREAM_NAMES];
static _Atomic size_t n_up;
static uint64_t start_wall_s; /* process_start_time_seconds, read once */
static struct hist store_hist[CM_STORE__COUNT];
static _Atomic uint64_t store_errors[CM_STORE__COUNT];
static _Atomic int postgres_up;
static _Atomic int redis_up;
static _Atomic int64_t connections;
static _Atomic int64_t claims_in_doubt;
static _Atomic uint64_t trace_dropped;
static _Atomic int64_t cache_entries;
static _Atomic int64_t cache_bytes;
static _Atomic uint64_t cache_hits;
static _Atomic uint64_t cache_misses;
static _Atomic int cache_online;
static _Atomic uint64_t shed[CM_SHED__COUNT];
static const char *const shed_names[CM_SHED__COUNT] = {[CM_SHED_BUFFERS] = "buffers"};

static const char *const outcome_names[CM_OUT__COUNT] = {
    [CM_OUT_FORWARDED] = "forwarded",
    [CM_OUT_REPLAYED] = "replayed",
    [CM_OUT_MISMATCH] = "mismatch",
    [CM_OUT_IN_FLIGHT] = "in_flight",
    [CM_OUT_REJECTED] = "rejected",
    [CM_OUT_UNKNOWN] = "unknown",
    [CM_OUT_STORE_UNAVAILABLE] = "store_unavailable",
    [CM_OUT_UPSTREAM_ERROR] = "upstream_error",
    [CM_OUT_OVERLOADED] = "overloaded",
    [CM_OUT_PASSTHROUGH] = "passthrough",
};

static const char *const store_names[CM_STORE__COUNT] = {
    [CM_STORE_POSTGRES] = "postgres",
    [CM_STORE_REDIS] = "redis",
};

const char *cm_outcome_name(enum cm_outcome o)
{
    if ((unsigned)o >= CM_OUT__COUNT)
        o = CM_OUT_UPSTREAM_ERROR;
    return outcome_names[o];
}

bool cm_outcome_is_error(enum cm_outcome o)
{
    return o == CM_OUT_UNKNOWN || o == CM_OUT_STORE_UNAVAILABLE || o == CM_OUT_UPSTREAM_ERROR ||
           o == CM_OUT_OVERLOADED || (unsigned)o >= CM_OUT__COUNT;
}

static void ctr_add(_Atomic uint64_t *c, uint64_t n)
{
    atomic_fetch_add_explicit(c, n, memory_order_relaxed);
}

static uint64_t ctr_get(_Atomic uint64_t *c)
{
    return atomic_load_explicit(c, memory_order_relaxed);
}

static void zero_hist(struct hist *h)
{
    for (size_t i = 0; i < NBUCKETS; i++)
        atomic_store_explicit(&h->bucket[i], 0, memory_order_relaxed);
    atomic_store_explicit(&h->sum_us, 0, memory_order_relaxed);
}

static void zero_route(struct route_ctr *r)
{
    for (size_t i = 0; i < CM_OUT__COUNT; i++)
        atomic_store_explicit(&r->requests[i], 0, memory_order_relaxed);
    atomic_store_explicit(&r->dedup_hits, 0, memory_order_relaxed);
    atomic_store_explicit(&r->parameter_conflicts, 0, memory_order_relaxed);
    atomic_store_explicit(&r->in_flight_conflicts, 0, memory_order_relaxed);
    atomic_store_explicit(&r->completion_failures, 0, memory_order_relaxed);
    atomic_store_explicit(&r->stuck_processing, 0, memory_order_relaxed);
    atomic_store_explicit(&r->stale_rejections, 0, memory_order_relaxed);
    atomic_store_explicit(&r->sequence_gaps, 0, memory_order_relaxed);
    for (size_t i = 0; i < CM_RESOLVED__COUNT; i++)
        atomic_store_explicit(&r->unknown_resolved[i], 0, memory_order_relaxed);
    for (size_t i = 0; i < CM_SHADOW__COUNT; i++)
        atomic_store_explicit(&r->shadow_decisions[i], 0, memory_order_relaxed);
    atomic_store_explicit(&r->shadow_store_errors, 0, memory_order_relaxed);
    atomic_store_explicit(&r->signature_failures, 0, memory_order_relaxed);
    for (size_t k = 0; k < ROUTE_UPSTREAMS; k++) {
        atomic_store_explicit(&r->ups[k].up, 0, memory_order_relaxed);
        zero_hist(&r->ups[k].h);
        for (size_t c = 0; c < CLASS__COUNT; c++)
            atomic_store_explicit(&r->ups[k].cls[c], 0, memory_order_relaxed);
    }
}

static void zero_globals(void)
{
    zero_route(&fallback_rc[0]);
    zero_route(&fallback_rc[1]);
    for (size_t i = 0; i < WIN_SLOTS; i++) {
        atomic_store_explicit(&win[i].minute, 0, memory_order_relaxed);
        zero_hist(&win[i].h);
    }
    for (size_t i = 0; i < CM_STORE__COUNT; i++) {
        zero_hist(&store_hist[i]);
        atomic_store_explicit(&store_errors[i], 0, memory_order_relaxed);
    }
    atomic_store_explicit(&postgres_up, 0, memory_order_relaxed);
    atomic_store_explicit(&redis_up, 0, memory_order_relaxed);
    atomic_store_explicit(&connections, 0, memory_order_relaxed);
    atomic_store_explicit(&claims_in_doubt, 0, memory_order_relaxed);
    atomic_store_explicit(&trace_dropped, 0, memory_order_relaxed);
    atomic_store_explicit(&cache_entries, 0, memory_order_relaxed);
    atomic_store_explicit(&cache_bytes, 0, memory_order_relaxed);
    atomic_store_explicit(&cache_hits, 0, memory_order_relaxed);
    atomic_store_explicit(&cache_misses, 0, memory_order_relaxed);
    atomic_store_explicit(&cache_online, 0, memory_order_relaxed);
    for (size_t i = 0; i < CM_SHED__COUNT; i++)
        atomic_store_explicit(&shed[i], 0, memory_order_relaxed);
}

void cm_metrics_reset(void)
{
    size_t n = atomic_load(&reg.nroutes);
    for (size_t i = 0; i < n; i++)
        free(reg.chunk[i / ROUTE_CHUNK][i % ROUTE_CHUNK].name);
    for (size_t k = 0; k < ROUTE_CHUNKS; k++) {
        free(reg.chunk[k]);
        atomic_store(&reg.chunk[k], NULL);
    }
    atomic_store(&reg.nroutes, 0);
    size_t nu = atomic_load(&n_up);
    for (size_t i = 0; i < nu; i++) {
        free(up_names[i]);
        up_names[i] = NULL;
    }
    atomic_store(&n_up, 0);
    zero_globals();
    cm_recent_reset(); /* its route slots are these: new names may take them now */
}

/* Appends a slot for name; the caller holds reg.mu. Returns its index, or CM_ROUTE_NONE when the registry is full. */
static size_t slot_append(const char *name)
{
    size_t n = atomic_load(&reg.nroutes);
    if (n >= (size_t)ROUTE_CHUNK * ROUTE_CHUNKS)
        return CM_ROUTE_NONE;
    if (!reg.chunk[n / ROUTE_CHUNK])
        atomic_store(&reg.chunk[n / ROUTE_CHUNK], cm_calloc(ROUTE_CHUNK, sizeof(struct route_slot)));
    struct route_slot *sl = &reg.chunk[n / ROUTE_CHUNK][n % ROUTE_CHUNK];
    sl->name = cm_strdup(name ? name : "");
    zero_route(&sl->c);
    atomic_store_explicit(&reg.nroutes, n + 1, memory_order_release);
    return n;
}

static struct route_slot *slot_at(size_t i)
{
    return &reg.chunk[i / ROUTE_CHUNK][i % ROUTE_CHUNK];
}

void cm_metrics_init(size_t nroutes, const char *const *route_names)
{
    cm_metrics_reset();
    pthread_mutex_lock(&reg.mu);
    for (size_t i = 0; i < nroutes; i++)
        (void)slot_append(route_names ? route_names[i] : "");
    pthread_mutex_unlock(&reg.mu);
}

size_t cm_metrics_route(const char *name)
{
    pthread_mutex_lock(&reg.mu);
    size_t n = atomic_load(&reg.nroutes);
    size_t found = CM_ROUTE_NONE;
    for (size_t i = 0; i < n && found == CM_ROUTE_NONE; i++)
        if (strcmp(slot_at(i)->name, name) == 0)
            found = i;
    if (found == CM_ROUTE_NONE)
        found = slot_append(name);
    pthread_mutex_unlock(&reg.mu);
    return found;
}

size_t cm_metrics_routes_n(void)
{
    return atomic_load_explicit(&reg.nroutes, memory_order_acquire);
}

const char *cm_metrics_route_name(size_t i)
{
    return slot_at(i)->name;
}

/* Any index that is neither a route slot nor CM_ROUTE_DEFAULT counts as "_none". */
static struct route_ctr *route_of(size_t route)
{
    if (route < atomic_load_explicit(&reg.nroutes, memory_order_acquire))
        return &slot_at(route)->c;
    return &fallback_rc[route == CM_ROUTE_DEFAULT ? 0 : 1];
}

/* Rendering walks slots 0..n-1 of a snapshot n, then "_default" (n) and "_none" (n + 1). */
static struct route_ctr *rc_at(size_t n, size_t i)
{
    return i < n ? &slot_at(i)->c : &fallback_rc[i == n ? 0 : 1];
}

static const char *route_name(size_t n, size_t i)
{
    if (i < n)
        return slot_at(i)->name;
    return i == n ? "_default" : "_none";
}

void cm_metric_request(size_t route, enum cm_outcome o)
{
    if ((unsigned)o >= CM_OUT__COUNT)
        o = CM_OUT_UPSTREAM_ERROR;
    ctr_add(&route_of(route)->requests[o], 1);
}

void cm_metric_dedup_hit(size_t route)
{
    ctr_add(&route_of(route)->dedup_hits, 1);
}

void cm_metric_parameter_conflict(size_t route)
{
    ctr_add(&route_of(route)->parameter_conflicts, 1);
}

void cm_metric_in_flight_conflict(size_t route)
{
    ctr_add(&route_of(route)->in_flight_conflicts, 1);
}

void cm_metric_stale_rejection(size_t route)
{
    ctr_add(&route_of(route)->stale_rejections, 1);
}

void cm_metric_sequence_gap(size_t route)
{
    ctr_add(&route_of(route)->sequence_gaps, 1);
}

void cm_metric_signature_failure(size_t route)
{
    ctr_add(&route_of(route)->signature_failures, 1);
}

void cm_metric_completion_failure(size_t route)
{
    ctr_add(&route_of(route)->completion_failures, 1);
}

void cm_metric_stuck_processing_set(size_t route, uint64_t n)
{
    atomic_store_explicit(&route_of(route)->stuck_processing, n, memory_order_relaxed);
}

static void hist_observe(struct hist *h, double s)
{
    if (!(s > 0)) /* negative, zero or NaN */
        s = 0;
    size_t b = 0;
    while (b < NBUCKETS_FINITE && s > bucket_le[b])
        b++;
    ctr_add(&h->bucket[b], 1);
    /* Cap one observation at ~10^6 s so the microsecond sum cannot wrap in practice. */
    double us = s < 1e6 ? s * 1e6 : 1e12;
    ctr_add(&h->sum_us, (uint64_t)llround(us));
}

/* The index of upstream name name (a new one when unseen; the last one when the table is full). */
static size_t upstream_index(const char *name)
{
    size_t n = atomic_load_explicit(&n_up, memory_order_acquire);
    for (size_t i = 0; i < n; i++)
        if (strcmp(up_names[i], name) == 0)
            return i;
    pthread_mutex_lock(&reg.mu);
    n = atomic_load(&n_up);
    size_t found = UPSTREAM_NAMES;
    for (size_t i = 0; i < n && found == UPSTREAM_NAMES; i++)
        if (strcmp(up_names[i], name) == 0)
            found = i;
    if (found == UPSTREAM_NAMES && n < UPSTREAM_NAMES) {
        up_names[n] = cm_strdup(name);
        atomic_store_explicit(&n_up, n + 1, memory_order_release);
        found = n;
    }
    pthread_mutex_unlock(&reg.mu);
    return found < UPSTREAM_NAMES ? found : UPSTREAM_NAMES - 1;
}

/* The route's series for upstream index u: the one it has, else a free one taken (CAS), else the last. */
static struct up_series *series_of(struct route_ctr *rc, size_t u)
{
    for (size_t k = 0; k < ROUTE_UPSTREAMS; k++) {
        size_t v = atomic_load_explicit(&rc->ups[k].up, memory_order_acquire);
        if (v == u + 1)
            return &rc->ups[k];
        if (v == 0) {
            size_t zero = 0;
            if (atomic_compare_exchange_strong(&rc->ups[k].up, &zero, u + 1) || zero == u + 1)
                return &rc->ups[k];
        }
    }
    return &rc->ups[ROUTE_UPSTREAMS - 1];
}

void cm_metrics_set_clock(uint64_t (*now_s)(void))
{
    win_clock = now_s ? now_s : win_clock_default;
}

static void win_observe(double s)
{
    uint64_t m = win_clock() / 60 + 1;
    struct win_slot *w = &win[m % WIN_SLOTS];
    uint64_t had = atomic_load_explicit(&w->minute, memory_order_acquire);
    if (had != m && had < m && atomic_compare_exchange_strong(&w->minute, &had, m))
        zero_hist(&w->h);
    if (atomic_load_explicit(&w->minute, memory_order_acquire) == m)
        hist_observe(&w->h, s);
}

/* The window's durations merged into out. */
static void win_merge(struct hist *out)
{
    zero_hist(out);
    uint64_t m = win_clock() / 60 + 1;
    for (size_t i = 0; i < WIN_SLOTS; i++) {
        uint64_t sm = atomic_load_explicit(&win[i].minute, memory_order_acquire);
        if (sm == 0 || sm > m || sm + WIN_MINUTES < m)
            continue;
        for (size_t b = 0; b < NBUCKETS; b++)
            ctr_add(&out->bucket[b], ctr_get(&win[i].h.bucket[b]));
        ctr_add(&out->sum_us, ctr_get(&win[i].h.sum_us));
    }
}

void cm_metric_upstream(size_t route, const char *upstream, int status, double s)
{
    win_observe(s);
    struct up_series *se = series_of(route_of(route), upstream_index(upstream ? upstream : "_none"));
    hist_observe(&se->h, s);
    ctr_add(&se->cls[status >= 200 && status <= 599 ? status / 100 - 2 : CLASS_NONE], 1);
}

void cm_metric_store_seconds(enum cm_store_label st, double s)
{
    if ((unsigned)st >= CM_STORE__COUNT)
        return;
    hist_observe(&store_hist[st], s);
}

void cm_metric_store_error(enum cm_store_label st)
{
    if ((unsigned)st >= CM_STORE__COUNT)
        return;
    ctr_add(&store_errors[st], 1);
}

void cm_metric_postgres_up(bool up)
{
    atomic_store_explicit(&postgres_up, up ? 1 : 0, memory_order_relaxed);
}

void cm_metric_redis_up(bool up)
{
    atomic_store_explicit(&redis_up, up ? 1 : 0, memory_order_relaxed);
}

void cm_metric_connections(int64_t delta)
{
    atomic_fetch_add_explicit(&connections, delta, memory_order_relaxed);
}

static const char *const resolved_names[CM_RESOLVED__COUNT] = {
    [CM_RESOLVED_FOUND] = "found",
    [CM_RESOLVED_ABSENT] = "absent",
};

static const char *const shadow_names[CM_SHADOW__COUNT] = {
    [CM_SHADOW_REPLAY] = "replay", [CM_SHADOW_MISMATCH] = "mismatch", [CM_SHADOW_IN_FLIGHT] = "in_flight",
    [CM_SHADOW_STALE] = "stale",   [CM_SHADOW_NEW] = "new",
};

const char *cm_shadow_name(enum cm_shadow d)
{
    return (unsigned)d < CM_SHADOW__COUNT ? shadow_names[d] : "new";
}

void cm_metric_unknown_resolved(size_t route, enum cm_resolved how)
{
    if ((unsigned)how < CM_RESOLVED__COUNT)
        ctr_add(&route_of(route)->unknown_resolved[how], 1);
}

void cm_metric_shadow_decision(size_t route, enum cm_shadow d)
{
    if ((unsigned)d < CM_SHADOW__COUNT)
        ctr_add(&route_of(route)->shadow_decisions[d], 1);
}

void cm_metric_shadow_store_error(size_t route)
{
    ctr_add(&route_of(route)->shadow_store_errors, 1);
}

void cm_metric_replay_cache_set(int64_t entries, int64_t bytes)
{
    atomic_store_explicit(&cache_entries, entries, memory_order_relaxed);
    atomic_store_explicit(&cache_bytes, bytes, memory_order_relaxed);
}

void cm_metric_replay_cache_lookup(bool hit)
{
    atomic_fetch_add_explicit(hit ? &cache_hits : &cache_misses, 1, memory_order_relaxed);
}

void cm_metric_replay_cache_online(bool online)
{
    atomic_store_explicit(&cache_online, online ? 1 : 0, memory_order_relaxed);
}

void cm_metric_shed(enum cm_shed_reason r)
{
    if ((unsigned)r < CM_SHED__COUNT)
        atomic_fetch_add_explicit(&shed[r], 1, memory_order_relaxed);
}

void cm_metric_trace_dropped(uint64_t n)
{
    atomic_fetch_add_explicit(&trace_dropped, n, memory_order_relaxed);
}

void cm_metric_claims_in_doubt(int64_t delta)
{
    atomic_fetch_add_explicit(&claims_in_doubt, delta, memory_order_relaxed);
}

/* ---- rendering */

/* Label value escaping of the text format: backslash, double quote, newline. */
static bool put_label_value(struct cm_buf *out, const char *s)
{
    const char *run = s;
    for (const char *p = s; *p; p++) {
        const char *esc = NULL;
        if (*p == '\\')
            esc = "\\\\";
        else if (*p == '"')
            esc = "\\\"";
        else if (*p == '\n')
            esc = "\\n";
        if (!esc)
            continue;
        if (!cm_buf_append(out, run, (size_t)(p - run)) || !cm_buf_append(out, esc, 2))
            return false;
        run = p + 1;
    }
    return cm_buf_append(out, run, strlen(run));
}

static bool put_family(struct cm_buf *out, const char *name, const char *type, const char *help)
{
    return cm_buf_appendf(out, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* name{label="value"} n */
static bool put_labelled(struct cm_buf *out, const char *name, const char *label, const char *value, uint64_t n)
{
    return cm_buf_appendf(out, "%s{%s=\"", name, label) && put_label_value(out, value) &&
           cm_buf_appendf(out, "\"} %llu\n", (unsigned long long)n);
}

static bool put_route_family(struct cm_buf *out, const char *name, const char *help, size_t field_off, bool gauge)
{
    if (!put_family(out, name, gauge ? "gauge" : "counter", help))
        return false;
    size_t nr = atomic_load_explicit(&reg.nroutes, memory_order_acquire);
    for (size_t i = 0; i < nr + 2; i++) {
        _Atomic uint64_t *c = (_Atomic uint64_t *)((char *)rc_at(nr, i) + field_off);
        if (!put_labelled(out, name, "route", route_name(nr, i), ctr_get(c)))
            return false;
    }
    return true;
}

/* name{route="R",label="v"} n for every route and every value of one per-route array of counters. */
static bool put_route_label_family(struct cm_buf *out, const char *name, const char *help, size_t field_off,
                                   const char *label, const char *const *values, size_t nvalues)
{
    if (!put_family(out, name, "counter", help))
        return false;
    size_t nr = atomic_load_explicit(&reg.nroutes, memory_order_acquire);
    for (size_t i = 0; i < nr + 2; i++) {
        _Atomic uint64_t *c = (_Atomic uint64_t *)((char *)rc_at(nr, i) + field_off);
        for (size_t v = 0; v < nvalues; v++)
            if (!cm_buf_appendf(out, "%s{route=\"", name) || !put_label_value(out, route_name(nr, i)) ||
                !cm_buf_appendf(out, "\",%s=\"%s\"} %llu\n", label, values[v], (unsigned long long)ctr_get(&c[v])))
                return false;
    }
    return true;
}

/* Renders one histogram series with labels lab (lab_len bytes, already escaped: `a="x",b="y"`). */
static bool put_hist_labels(struct cm_buf *out, const char *name, const char *lab, size_t lab_len, struct hist *h)
{
    uint64_t cum = 0;
    for (size_t b = 0; b < NBUCKETS; b++) {
        cum += ctr_get(&h->bucket[b]);
        if (!cm_buf_appendf(out, "%s_bucket{%.*s,le=\"%s\"} %llu\n", name, (int)lab_len, lab,
                            b < NBUCKETS_FINITE ? bucket_le_text[b] : "+Inf", (unsigned long long)cum))
            return false;
    }
    uint64_t us = ctr_get(&h->sum_us);
    return cm_buf_appendf(out, "%s_sum{%.*s} %llu.%06llu\n%s_count{%.*s} %llu\n", name, (int)lab_len, lab,
                          (unsigned long long)(us / 1000000), (unsigned long long)(us % 1000000), name, (int)lab_len,
                          lab, (unsigned long long)cum);
}

/* Renders one histogram series; label may be NULL (no labels). */
static bool put_hist(struct cm_buf *out, const char *name, const char *label, const char *value, struct hist *h)
{
    uint64_t cum = 0;
    for (size_t b = 0; b < NBUCKETS; b++) {
        cum += ctr_get(&h->bucket[b]);
        const char *le = b < NBUCKETS_FINITE ? bucket_le_text[b] : "+Inf";
        if (!cm_buf_appendf(out, "%s_bucket{", name))
            return false;
        if (label &&
            (!cm_buf_appendf(out, "%s=\"", label) || !put_label_value(out, value) || !cm_buf_append(out, "\",", 2)))
            return false;
        if (!cm_buf_appendf(out, "le=\"%s\"} %llu\n", le, (unsigned long long)cum))
            return false;
    }
    uint64_t us = ctr_get(&h->sum_us);
    const char *sfx[2] = {"_sum", "_count"};
    for (size_t k = 0; k < 2; k++) {
        if (!cm_buf_appendf(out, "%s%s", name, sfx[k]))
            return false;
        if (label &&
            (!cm_buf_appendf(out, "{%s=\"", label) || !put_label_value(out, value) || !cm_buf_append(out, "\"}", 2)))
            return false;
        bool ok = k == 0 ? cm_buf_appendf(out, " %llu.%06llu\n", (unsigned long long)(us / 1000000),
                                          (unsigned long long)(us % 1000000))
                         : cm_buf_appendf(out, " %llu\n", (unsigned long long)cum);
        if (!ok)
            return false;
    }
    return true;
}

/* idemgate_upstream_seconds{route,upstream} and idemgate_upstream_responses_total{route,upstream,class}: the series
 * each route has used. */
static bool put_upstream_families(struct cm_buf *out)
{
    size_t nr = atomic_load_explicit(&reg.nroutes, memory_order_acquire);
    size_t nu = atomic_load_explicit(&n_up, memory_order_acquire);
    if (!put_family(out, "idemgate_upstream_seconds", "histogram",
                    "Upstream request duration in seconds, by route and upstream."))
        return false;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && !put_family(out, "idemgate_upstream_responses_total", "counter",
                                     "Upstream requests by route, upstream and answer class (none: no answer)."))
            return false;
        for (size_t i = 0; i < nr + 2; i++) {
            for (size_t k = 0; k < ROUTE_UPSTREAMS; k++) {
                struct up_series *se = &rc_at(nr, i)->ups[k];
                size_t v = atomic_load_explicit(&se->up, memory_order_acquire);
                if (v == 0 || v > nu)
                    continue;
                struct cm_buf lab; /* route="R",upstream="U" */
                cm_buf_init(&lab, 4096);
                bool ok = cm_buf_append(&lab, "route=\"", 7) && put_label_value(&lab, route_name(nr, i)) &&
                          cm_buf_append(&lab, "\",upstream=\"", 12) && put_label_value(&lab, up_names[v - 1]) &&
                          cm_buf_append(&lab, "\"", 1);
                if (ok && pass == 0)
                    ok = put_hist_labels(out, "idemgate_upstream_seconds", lab.data, lab.len, &se->h);
                for (size_t c = 0; ok && pass == 1 && c < CLASS__COUNT; c++)
                    ok =
                        cm_buf_appendf(out, "idemgate_upstream_responses_total{%.*s,class=\"%s\"} %llu\n", (int)lab.len,
                                       lab.data, class_names[c], (unsigned long long)ctr_get(&se->cls[c]));
                cm_buf_free(&lab);
                if (!ok)
                    return false;
            }
        }
    }
    return true;
}

/* The standard process family (Prometheus' client conventions), read from /proc/self at scrape time; a value that
 * cannot be read is left out. */
static bool put_process_family(struct cm_buf *out)
{
    long tick = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
    FILE *f = fopen("/proc/self/stat", "r");
    char buf[1024];
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* the command name may hold spaces: fields counted after its ')' */
    unsigned long long utime = 0, stime = 0, start = 0, rss = 0;
    bool stat_ok = false;
    if (p && tick > 0 && page > 0) {
        /* fields 3.. : state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime(14) stime(15)
         * cutime cstime priority nice threads itrealvalue starttime(22) vsize rss(24) */
        stat_ok =
            sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d %*d %llu %*u %llu",
                   &utime, &stime, &start, &rss) == 4;
    }
    if (stat_ok) {
        if (!put_family(out, "process_cpu_seconds_total", "counter",
                        "Total user and system CPU time spent in seconds.") ||
            !cm_buf_appendf(out, "process_cpu_seconds_total %.2f\n", (double)(utime + stime) / (double)tick) ||
            !put_family(out, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.") ||
            !cm_buf_appendf(out, "process_resident_memory_bytes %llu\n", rss * (unsigned long long)page))
            return false;
    }
    size_t fds = 0;
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        for (struct dirent *e = readdir(d); e; e = readdir(d))
            fds += e->d_name[0] != '.';
        closedir(d);
        if (!put_family(out, "process_open_fds", "gauge", "Number of open file descriptors.") ||
            !cm_buf_appendf(out, "process_open_fds %zu\n", fds > 0 ? fds - 1 : 0)) /* less the directory's own */
            return false;
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 &&
        (!put_family(out, "process_max_fds", "gauge", "Maximum number of open file descriptors.") ||
         !cm_buf_appendf(out, "process_max_fds %llu\n", (unsigned long long)rl.rlim_cur)))
        return false;
    if (!start_wall_s && stat_ok) { /* boot time + start ticks: once, it never changes */
        FILE *sf = fopen("/proc/stat", "r");
        char line[256];
        unsigned long long btime = 0;
        while (sf && fgets(line, sizeof line, sf))
            if (sscanf(line, "btime %llu", &btime) == 1)
                break;
        if (sf)
            fclose(sf);
        if (btime)
            start_wall_s = btime + start / (unsigned long long)tick;
    }
    return !start_wall_s ||
           (put_family(out, "process_start_time_seconds", "gauge",
                       "Start time of the process since unix epoch in seconds.") &&
            cm_buf_appendf(out, "process_start_time_seconds %llu\n", (unsigned long long)start_wall_s));
}

static bool put_gauge(struct cm_buf *out, const char *name, const char *help, long long v)
{
    return put_family(out, name, "gauge", help) && cm_buf_appendf(out, "%s %lld\n", name, v);
}

bool cm_metrics_render(struct cm_buf *out)
{
    const char *n = "idemgate_requests_total";
    if (!put_family(out, n, "counter", "Requests answered, by route and outcome."))
        return false;
    size_t nr = atomic_load_explicit(&reg.nroutes, memory_order_acquire);
    for (size_t i = 0; i < nr + 2; i++) {
        for (size_t o = 0; o < CM_OUT__COUNT; o++) {
            if (!cm_buf_appendf(out, "%s{route=\"", n) || !put_label_value(out, route_name(nr, i)) ||
                !cm_buf_appendf(out, "\",outcome=\"%s\"} %llu\n", outcome_names[o],
                                (unsigned long long)ctr_get(&rc_at(nr, i)->requests[o])))
                return false;
        }
    }
    if (!put_route_family(out, "idemgate_dedup_hits_total", "Retries answered with a stored response.",
                          offsetof(struct route_ctr, dedup_hits), false) ||
        !put_route_family(out, "idemgate_parameter_conflicts_total",
                          "Keys reused with a different request fingerprint (422).",
                          offsetof(struct route_ctr, parameter_conflicts), false) ||
        !put_route_family(out, "idemgate_in_flight_conflicts_total", "Retries that found their key in flight.",
                          offsetof(struct route_ctr, in_flight_conflicts), false) ||
        !put_route_family(out, "idemgate_completion_failures_total", "Responses whose completion could not be stored.",
                          offsetof(struct route_ctr, completion_failures), false) ||
        !put_route_family(out, "idemgate_stuck_processing", "Records in flight for over 5 minutes.",
                          offsetof(struct route_ctr, stuck_processing), true) ||
        !put_route_family(out, "idemgate_stale_version_rejections_total",
                          "Requests the ordering guard refused as stale (409 stale-sequence).",
                          offsetof(struct route_ctr, stale_rejections), false) ||
        !put_route_family(out, "idemgate_sequence_gaps_total",
                          "Requests whose sequence skipped past applied + 1 (ordering guard).",
                          offsetof(struct route_ctr, sequence_gaps), false) ||
        !put_route_family(out, "idemgate_signature_failures_total",
                          "Deliveries whose signature did not verify (401 signature-invalid; nothing claimed).",
                          offsetof(struct route_ctr, signature_failures), false))
        return false;
    if (!put_route_label_family(
            out, "idemgate_unknown_resolved_total", "Unknown outcomes resolved by asking the upstream (probe).",
            offsetof(struct route_ctr, unknown_resolved), "how", resolved_names, CM_RESOLVED__COUNT) ||
        !put_route_label_family(out, "idemgate_shadow_decisions_total",
                                "Shadow mode: what enforce mode would have done (the request was forwarded).",
                                offsetof(struct route_ctr, shadow_decisions), "decision", shadow_names,
                                CM_SHADOW__COUNT) ||
        !put_route_family(out, "idemgate_shadow_store_errors_total",
                          "Shadow mode: records the store could not read or write (the request was forwarded).",
                          offsetof(struct route_ctr, shadow_store_errors), false))
        return false;

    if (!put_upstream_families(out))
        return false;
    if (!put_family(out, "idemgate_store_seconds", "histogram", "Store operation duration in seconds."))
        return false;
    for (size_t s = 0; s < CM_STORE__COUNT; s++)
        if (!put_hist(out, "idemgate_store_seconds", "store", store_names[s], &store_hist[s]))
            return false;
    if (!put_family(out, "idemgate_store_errors_total", "counter", "Store operations that failed."))
        return false;
    for (size_t s = 0; s < CM_STORE__COUNT; s++)
        if (!put_labelled(out, "idemgate_store_errors_total", "store", store_names[s], ctr_get(&store_errors[s])))
            return false;

    if (!put_gauge(out, "idemgate_postgres_up", "1 when Postgres answers.",
                   atomic_load_explicit(&postgres_up, memory_order_relaxed)) ||
        !put_gauge(out, "idemgate_redis_up", "1 when Redis answers.",
                   atomic_load_explicit(&redis_up, memory_order_relaxed)) ||
        !put_gauge(out, "idemgate_connections", "Open client connections.",
                   (long long)atomic_load_explicit(&connections, memory_order_relaxed)) ||
        !put_gauge(out, "idemgate_claims_in_doubt",
                   "Claims whose commit outcome is not known yet (nothing was forwarded), waiting to be released.",
                   (long long)atomic_load_explicit(&claims_in_doubt, memory_order_relaxed)) ||
        !put_gauge(out, "idemgate_replay_cache_entries", "Completed records held by the in-process replay cache.",
                   (long long)atomic_load_explicit(&cache_entries, memory_order_relaxed)) ||
        !put_gauge(out, "idemgate_replay_cache_bytes", "Bytes held by the in-process replay cache.",
                   (long long)atomic_load_explicit(&cache_bytes, memory_order_relaxed)) ||
        !put_gauge(out, "idemgate_replay_cache_online",
                   "1 while the replay cache's purge listener is connected (the cache is used only then).",
                   atomic_load_explicit(&cache_online, memory_order_relaxed)) ||
        !put_family(out, "idemgate_replay_cache_hits_total", "counter",
                    "Look-ups answered by the replay cache (a replay or a 422).") ||
        !cm_buf_appendf(out, "idemgate_replay_cache_hits_total %llu\n", (unsigned long long)ctr_get(&cache_hits)) ||
        !put_family(out, "idemgate_replay_cache_misses_total", "counter",
                    "Look-ups the replay cache could not answer (asked the store).") ||
        !cm_buf_appendf(out, "idemgate_replay_cache_misses_total %llu\n", (unsigned long long)ctr_get(&cache_misses)))
        return false;
    if (!put_family(out, "idemgate_shed_total", "counter",
                    "Requests answered 503 overloaded before anything was claimed or forwarded, by reason "
                    "(buffers: limits.buffers was reached)."))
        return false;
    for (size_t i = 0; i < CM_SHED__COUNT; i++)
        if (!put_labelled(out, "idemgate_shed_total", "reason", shed_names[i], ctr_get(&shed[i])))
            return false;
    if (!put_family(out, "idemgate_trace_spans_dropped_total", "counter",
                    "Spans not exported: the queue was full or the collector did not take them.") ||
        !cm_buf_appendf(out, "idemgate_trace_spans_dropped_total %llu\n",
                        (unsigned long long)atomic_load_explicit(&trace_dropped, memory_order_relaxed)))
        return false;
    if (!put_gauge(out, "idemgate_buffers_bytes", "Bytes of request bodies and answers held (limits.buffers).",
                   (long long)cm_buffers_used()))
        return false;
    if (!put_family(out, "idemgate_log_dropped_total", "counter",
                    "Access log lines dropped: the writer could not keep up, or the file could not be written.") ||
        !cm_buf_appendf(out, "idemgate_log_dropped_total %llu\n", (unsigned long long)cm_alog_dropped()))
        return false;
    return put_process_family(out) && put_family(out, "idemgate_build_info", "gauge", "Build information.") &&
           put_labelled(out, "idemgate_build_info", "version", IDEMGATE_VERSION, 1);
}

/* ---- the status page's JSON */

/* The q-quantile (0..1) of a histogram, interpolated linearly inside its bucket as Prometheus'
 * histogram_quantile does; 0 without observations; the largest finite bound when it falls in +Inf. */
static double hist_quantile(struct hist *h, double q)
{
    uint64_t counts[NBUCKETS], total = 0;
    for (size_t b = 0; b < NBUCKETS; b++)
        total += counts[b] = ctr_get(&h->bucket[b]);
    if (total == 0)
        return 0;
    double rank = q * (double)total, cum = 0;
    for (size_t b = 0; b < NBUCKETS; b++) {
        if (cum + (double)counts[b] >= rank && counts[b] > 0) {
            if (b == NBUCKETS_FINITE)
                return bucket_le[NBUCKETS_FINITE - 1];
            double lo = b ? bucket_le[b - 1] : 0, hi = bucket_le[b];
            return lo + (hi - lo) * (rank - cum) / (double)counts[b];
        }
        cum += (double)counts[b];
    }
    return bucket_le[NBUCKETS_FINITE - 1];
}

bool cm_metrics_status_json(struct cm_buf *out, const char *postgres_state, const char *redis_state)
{
    if (!cm_buf_append(out, "{\"routes\":[", 11))
        return false;
    size_t nr = atomic_load_explicit(&reg.nroutes, memory_order_acquire);
    for (size_t i = 0; i < nr + 2; i++) {
        struct route_ctr *rc = rc_at(nr, i);
        uint64_t total = 0;
        for (size_t o = 0; o < CM_OUT__COUNT; o++)
            total += ctr_get(&rc->requests[o]);
        if (i >= nr && total == 0)
            continue; /* _default and _none only once they saw a request */
        if ((i && out->data[out->len - 1] != '[' && !cm_buf_append(out, ",", 1)) ||
            !cm_buf_append(out, "{\"name\":\"", 9) || !put_label_value(out, route_name(nr, i)) ||
            !cm_buf_appendf(out, "\",\"requests\":%llu,\"outcomes\":{", (unsigned long long)total))
            return false;
        uint64_t errors = 0; /* SPEC 11: the server-side outcomes only */
        for (size_t o = 0; o < CM_OUT__COUNT; o++) {
            uint64_t v = ctr_get(&rc->requests[o]);
            if (cm_outcome_is_error((enum cm_outcome)o))
                errors += v;
            if (!cm_buf_appendf(out, "%s\"%s\":%llu", o ? "," : "", outcome_names[o], (unsigned long long)v))
                return false;
        }
        if (!cm_buf_appendf(
                out,
                "},\"errors\":%llu,\"replays\":%llu,\"in_flight_conflicts\":%llu,\"parameter_conflicts\":%llu,"
                "\"completion_failures\":%llu,\"stuck\":%llu}",
                (unsigned long long)errors, (unsigned long long)ctr_get(&rc->dedup_hits),
                (unsigned long long)ctr_get(&rc->in_flight_conflicts),
                (unsigned long long)ctr_get(&rc->parameter_conflicts),
                (unsigned long long)ctr_get(&rc->completion_failures),
                (unsigned long long)ctr_get(&rc->stuck_processing)))
            return false;
    }
    struct hist upstream_hist; /* the last five minutes */
    win_merge(&upstream_hist);
    uint64_t n = 0;
    for (size_t b = 0; b < NBUCKETS; b++)
        n += ctr_get(&upstream_hist.bucket[b]);
    return cm_buf_appendf(out,
                          "],\"upstream\":{\"window_seconds\":%d,\"count\":%llu,\"sum_seconds\":%.6f,"
                          "\"p50_seconds\":%.6f,\"p99_seconds\":%.6f},\"store\":{\"postgres\":\"%s\","
                          "\"redis\":\"%s\"},\"connections\":%lld}\n",
                          WIN_MINUTES * 60, (unsigned long long)n, (double)ctr_get(&upstream_hist.sum_us) / 1e6,
                          hist_quantile(&upstream_hist, 0.5), hist_quantile(&upstream_hist, 0.99), postgres_state,
                          redis_state, (long long)atomic_load_explicit(&connections, memory_order_relaxed));
}
