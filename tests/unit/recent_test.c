/* recent_test.c - each route's recent upstream time (common/recent.c): the p90 over the window, its buckets'
 * accuracy, old minutes ageing out, routes apart, concurrent observers, and the Retry-After wait it gives. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdint.h>

#include "common/recent.h"

#define MIN_MS 60000ull
#define T0     (1000 * MIN_MS + 1234) /* an arbitrary monotonic time, inside a minute */

static void reset(void)
{
    cm_recent_reset();
}

TestSuite(recent, .init = reset, .fini = reset);

static uint64_t p90(size_t route, uint64_t now)
{
    uint64_t v = 0;
    cr_assert(cm_recent_p90_ms(route, now, &v), "route %zu has a recent upstream time", route);
    return v;
}

Test(recent, nothing_observed_is_no_estimate)
{
    uint64_t v = 77;
    cr_expect(!cm_recent_p90_ms(0, T0, &v));
    cr_expect(!cm_recent_p90_ms(CM_RECENT_ROUTES - 1, T0, &v));
    cr_expect(!cm_recent_p90_ms(CM_RECENT_ROUTES, T0, &v), "a slot past the table has none");
    cm_recent_observe(CM_RECENT_ROUTES, 100, T0); /* ignored, never out of bounds */
    cm_recent_observe((size_t)-1, 100, T0);
    cr_expect(!cm_recent_p90_ms((size_t)-1, T0, &v));
    cr_expect_eq(v, 77, "untouched without an estimate");
}

/* The p90 of a mix: 90 fast and 10 slow is still fast; 80 fast and 20 slow is slow. Within one bucket's width
 * (an eighth to a quarter of the value, upwards: the estimate errs late, not early). */
Test(recent, p90_over_the_window)
{
    for (int i = 0; i < 91; i++)
        cm_recent_observe(0, 100, T0);
    for (int i = 0; i < 9; i++)
        cm_recent_observe(0, 5000, T0);
    uint64_t v = p90(0, T0);
    cr_expect(v >= 100 && v <= 125, "91 x 100 ms and 9 x 5 s: p90 %llu ms, want about 100", (unsigned long long)v);

    for (int i = 0; i < 80; i++)
        cm_recent_observe(1, 100, T0);
    for (int i = 0; i < 20; i++)
        cm_recent_observe(1, 5000, T0 + 1000);
    v = p90(1, T0 + 2000);
    cr_expect(v >= 5000 && v <= 5000 + 5000 / 4, "80 x 100 ms and 20 x 5 s: p90 %llu ms, want about 5000",
              (unsigned long long)v);
    /* route 0 untouched by route 1 */
    cr_expect(p90(0, T0) <= 125);
}

/* Every value's estimate from a single observation lies in [value, value * 1.25] (exact below 8 ms), across the
 * range up to about an hour; beyond it, the last bucket. */
Test(recent, buckets_are_within_a_quarter)
{
    static const uint64_t vals[] = {0,    1,     3,     7,      8,      9,      15,      100,    999,
                                    1000, 1001,  1500,  2000,   2047,   2048,   4095,    60000,  59999,
                                    3599, 12345, 65537, 600000, 999999, 777777, 3600000, 4000000};
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        cm_recent_reset();
        cm_recent_observe(3, vals[i], T0);
        uint64_t v = p90(3, T0);
        if (vals[i] < 8)
            cr_expect(v >= vals[i] && v <= vals[i] + 1, "%llu ms: %llu", (unsigned long long)vals[i],
                      (unsigned long long)v);
        else
            cr_expect(v >= vals[i] && v <= vals[i] + vals[i] / 4, "%llu ms: estimate %llu", (unsigned long long)vals[i],
                      (unsigned long long)v);
    }
    cm_recent_reset();
    cm_recent_observe(3, UINT64_MAX / 2, T0);
    uint64_t v = p90(3, T0);
    cr_expect(v >= 3600000 && v <= 5000000, "a huge value is clamped to the last bucket: %llu", (unsigned long long)v);
}

/* The window is the current minute and the two before it: an observation counts for between two and three
 * minutes, then ages out; a slot reused for a later minute starts from zero. */
Test(recent, old_minutes_age_out)
{
    cm_recent_observe(0, 3000, T0); /* minute M */
    cr_expect(p90(0, T0 + 2 * MIN_MS) >= 3000, "still counted two minutes on");
    cm_recent_observe(0, 200, T0 + 1 * MIN_MS); /* M + 1 */
    uint64_t v = 0;
    cr_expect(cm_recent_p90_ms(0, T0 + 3 * MIN_MS, &v) && v >= 200 && v <= 250,
              "three minutes on, M is gone and M+1 is the estimate: %llu", (unsigned long long)v);
    cr_expect(!cm_recent_p90_ms(0, T0 + 4 * MIN_MS, &v), "four minutes on, nothing recent");
    /* M + 4 lands in M's slot (a ring of four): M's old count must not come back */
    cm_recent_observe(0, 100, T0 + 4 * MIN_MS);
    v = p90(0, T0 + 4 * MIN_MS);
    cr_expect(v >= 100 && v <= 125, "a reused slot starts from zero: %llu", (unsigned long long)v);
    /* a late observer of an old minute (its clock read before the slot moved on) is dropped, not counted in M+4 */
    cm_recent_observe(0, 9000, T0);
    v = p90(0, T0 + 4 * MIN_MS);
    cr_expect(v <= 125, "an old minute's late observation does not count: %llu", (unsigned long long)v);
    /* a reader whose clock is behind the slots sees only what is in its window */
    cr_expect(!cm_recent_p90_ms(0, T0 - 10 * MIN_MS, &v));
}

/* Many threads observing at once, one minute: every observation counted (one atomic add each). */
#define THREADS 4
#define PER     50000
static void *observer(void *arg)
{
    size_t route = (size_t)(uintptr_t)arg;
    for (int i = 0; i < PER; i++)
        cm_recent_observe(route, i % 10 == 0 ? 4000 : 100, T0 + (uint64_t)(i % 1000));
    return NULL;
}

Test(recent, concurrent_observers)
{
    pthread_t t[THREADS];
    for (size_t i = 0; i < THREADS; i++)
        cr_assert_eq(pthread_create(&t[i], NULL, observer, (void *)(uintptr_t)(i % 2 ? 7 : 9000)), 0);
    for (size_t i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    uint64_t n = 0;
    cr_expect(cm_recent_count(7, T0 + 1000, &n) && n == (uint64_t)PER * THREADS / 2, "route 7 counted %llu",
              (unsigned long long)n);
    cr_expect(cm_recent_count(9000, T0 + 1000, &n) && n == (uint64_t)PER * THREADS / 2, "route 9000 counted %llu",
              (unsigned long long)n);
    /* 10% at 4 s: the p90 sits at the boundary; the 90th percentile's rank falls in the fast bucket */
    uint64_t v = p90(7, T0 + 1000);
    cr_expect(v >= 100 && v <= 125, "p90 %llu", (unsigned long long)v);
}

/* The wait a 409 gives (SPEC 11): recent p90 less the attempt's age, at least 1 ms (Retry-After rounds it up to 1 s
 * at least), at most the lease left; without a recent time, the lease left. */
Test(recent, retry_after_wait)
{
    uint64_t w = cm_recent_wait_ms(0, 200, 59800, T0);
    cr_expect_eq(w, 59800, "no recent upstream time: the lease left (%llu)", (unsigned long long)w);
    for (int i = 0; i < 10; i++)
        cm_recent_observe(0, 1000, T0);
    uint64_t est = p90(0, T0);
    w = cm_recent_wait_ms(0, 200, 59800, T0);
    cr_expect_eq(w, est - 200, "p90 less the age (%llu, p90 %llu)", (unsigned long long)w, (unsigned long long)est);
    cr_expect(w >= 800 && w <= 1000, "about 0.8 s: Retry-After 1 (%llu)", (unsigned long long)w);
    w = cm_recent_wait_ms(0, 5000, 55000, T0);
    cr_expect_eq(w, 1, "an attempt older than the estimate: the least wait (%llu)", (unsigned long long)w);
    w = cm_recent_wait_ms(0, 0, 300, T0);
    cr_expect_eq(w, 300, "never beyond the lease left (%llu)", (unsigned long long)w);
    w = cm_recent_wait_ms(0, 0, 0, T0);
    cr_expect_eq(w, 1, "a lease just lapsed: the least wait (%llu)", (unsigned long long)w);
}
