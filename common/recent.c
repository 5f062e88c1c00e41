/* recent.c - each route's recent upstream time: a ring of per-minute log histograms per route slot, C11 atomics,
 * never a lock.
 *
 * A route's slot holds RING minutes; a minute is a histogram of NBUCKETS counters: durations below 8 ms each have
 * their own bucket, above that four buckets per power of two (an eighth to a quarter of the value wide), up to
 * 2^22 ms (about 70 minutes; longer durations count in the last bucket). An observation is one atomic add to the
 * bucket of its minute. The first observer of a new minute takes the minute's slot over (compare-and-swap to
 * ROTATING), zeroes it and publishes the minute; an observer that meets a slot being zeroed drops its observation,
 * and one whose clock was read before the slot moved on (an older minute) drops it too, or (racing the take-over)
 * counts it in the new minute: a few observations at a minute's edge, never more. Readers merge the window's
 * minutes: a slot being zeroed is left out. */
#include "common/recent.h"

#include <stdatomic.h>
#include <stdlib.h>

#include "common/common.h"

#define MINUTE_MS 60000u
#define RING      (CM_RECENT_MINUTES + 1) /* the window's minutes and the one being reused */
#define MAX_EXP   21                      /* durations up to 2^(MAX_EXP + 1) ms have their own bucket */
#define NBUCKETS  (4 * MAX_EXP)
#define ROTATING  UINT64_MAX /* a slot's stamp while its new minute zeroes it */

struct minute {
    _Atomic uint64_t stamp; /* minute number + 1 of what the counts hold; 0: never used; ROTATING */
    _Atomic uint32_t n[NBUCKETS];
};

struct route_recent {
    struct minute m[RING];
};

/* Allocated on a route's first observation (compare-and-swap: the loser frees its copy), freed by cm_recent_reset
 * only. */
static struct route_recent *_Atomic routes[CM_RECENT_ROUTES];

/* Bucket of a duration: 0..7 for 0..7 ms; then for 2^e <= ms < 2^(e+1), 4 (e - 1) plus the two bits below the top
 * one. Past the table, the last bucket. */
static unsigned bucket_of(uint64_t ms)
{
    if (ms < 8)
        return (unsigned)ms;
    unsigned e = 63u - (unsigned)__builtin_clzll(ms);
    if (e > MAX_EXP)
        return NBUCKETS - 1;
    return 4 * (e - 1) + (unsigned)((ms >> (e - 2)) & 3);
}

/* The upper bound (exclusive) of bucket b's durations. */
static uint64_t bucket_hi(unsigned b)
{
    if (b < 8)
        return b + 1;
    unsigned e = b / 4 + 1, sub = b % 4;
    return (uint64_t)(5 + sub) << (e - 2);
}

static struct route_recent *route_get(size_t route, bool create)
{
    struct route_recent *r = atomic_load_explicit(&routes[route], memory_order_acquire);
    if (r || !create)
        return r;
    struct route_recent *fresh = cm_calloc(1, sizeof *fresh), *none = NULL;
    if (atomic_compare_exchange_strong_explicit(&routes[route], &none, fresh, memory_order_acq_rel,
                                                memory_order_acquire))
        return fresh;
    free(fresh);
    return none; /* another thread's */
}

void cm_recent_observe(size_t route, uint64_t ms, uint64_t now_ms)
{
    if (route >= CM_RECENT_ROUTES)
        return;
    struct route_recent *r = route_get(route, true);
    uint64_t m = now_ms / MINUTE_MS + 1;
    struct minute *s = &r->m[m % RING];
    uint64_t had = atomic_load_explicit(&s->stamp, memory_order_acquire);
    if (had != m) {
        if (had > m) /* ROTATING, or a later minute than this observer's clock said */
            return;
        if (!atomic_compare_exchange_strong_explicit(&s->stamp, &had, ROTATING, memory_order_acq_rel,
                                                     memory_order_acquire))
            return; /* another observer is taking it over */
        for (unsigned b = 0; b < NBUCKETS; b++)
            atomic_store_explicit(&s->n[b], 0, memory_order_relaxed);
        atomic_store_explicit(&s->stamp, m, memory_order_release);
    }
    atomic_fetch_add_explicit(&s->n[bucket_of(ms)], 1, memory_order_relaxed);
}

/* The window's counts merged into n (NBUCKETS); their total. */
static uint64_t merge(size_t route, uint64_t now_ms, uint64_t *n)
{
    for (unsigned b = 0; b < NBUCKETS; b++)
        n[b] = 0;
    struct route_recent *r = route < CM_RECENT_ROUTES ? route_get(route, false) : NULL;
    if (!r)
        return 0;
    uint64_t m = now_ms / MINUTE_MS + 1, total = 0;
    for (unsigned i = 0; i < RING; i++) {
        uint64_t st = atomic_load_explicit(&r->m[i].stamp, memory_order_acquire);
        if (st == 0 || st > m || st + CM_RECENT_MINUTES <= m)
            continue;
        for (unsigned b = 0; b < NBUCKETS; b++) {
            uint64_t c = atomic_load_explicit(&r->m[i].n[b], memory_order_relaxed);
            n[b] += c;
            total += c;
        }
    }
    return total;
}

bool cm_recent_count(size_t route, uint64_t now_ms, uint64_t *n)
{
    uint64_t counts[NBUCKETS];
    *n = merge(route, now_ms, counts);
    return *n > 0;
}

bool cm_recent_p90_ms(size_t route, uint64_t now_ms, uint64_t *p90_ms)
{
    uint64_t counts[NBUCKETS];
    uint64_t total = merge(route, now_ms, counts);
    if (total == 0)
        return false;
    uint64_t rank = (total * 9 + 9) / 10, cum = 0; /* the ceil(0.9 total)-th smallest */
    unsigned b = 0;
    for (; b < NBUCKETS - 1; b++) {
        cum += counts[b];
        if (cum >= rank)
            break;
    }
    *p90_ms = bucket_hi(b);
    return true;
}

uint64_t cm_recent_wait_ms(size_t route, uint64_t age_ms, uint64_t lease_left_ms, uint64_t now_ms)
{
    uint64_t p90, wait = lease_left_ms;
    if (cm_recent_p90_ms(route, now_ms, &p90))
        wait = p90 > age_ms ? p90 - age_ms : 1;
    if (wait > lease_left_ms)
        wait = lease_left_ms;
    return wait ? wait : 1;
}

void cm_recent_reset(void)
{
    for (size_t i = 0; i < CM_RECENT_ROUTES; i++) {
        struct route_recent *r = atomic_exchange(&routes[i], NULL);
        free(r);
    }
}
