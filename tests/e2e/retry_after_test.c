/* retry_after_test.c - end-to-end tests of Retry-After on 409 idempotency-key-in-use (SPEC 11): the route's recent
 * upstream time (p90) less the first attempt's age, at least 1 s, at most the remaining lease; the remaining lease
 * when the route has no recent upstream time. The real idemgate in front of the real test upstream (its
 * X-Test-Delay-Ms), real Postgres and Redis; a second gateway whose wall clock is ten minutes off. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

TestSuite(retry_after, .init = e2e_setup, .fini = e2e_teardown, .timeout = 120);

#define PATH      "/v1/pay/ra"
#define BODY      "{\"ra\":1}"
#define SLOW_2S   "X-Test-Delay-Ms: 2000"
#define LEASE_60S "key: required\nlease: 60s\n"

/* Starts POST PATH with key and the delay header on port in the background, and waits (bounded) until the upstream
 * counted it: the attempt is then in flight there. */
static struct e2e_async *in_flight(uint16_t port, const struct e2e_upstream *up, const char *key, const char *delay)
{
    static char kh[160];
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    static const char *h[3];
    h[0] = kh;
    h[1] = delay;
    h[2] = NULL;
    struct e2e_req rq = {
        .method = "POST", .path = PATH, .headers = h, .body = BODY, .body_len = strlen(BODY), .timeout_ms = 15000};
    struct e2e_async *a = e2e_http_async(port, &rq);
    cr_assert_eq(e2e_upstream_wait_count(up, key, 1, 5000), 1, "the first attempt did not reach the upstream in 5 s");
    return a;
}

/* One POST of key (with the delay header, or none) on port, answered. */
static void post(uint16_t port, const char *key, const char *delay, struct e2e_resp *r)
{
    const char *const h[] = {delay, NULL};
    e2e_http_key(port, "POST", PATH, key, delay ? h : NULL, BODY, 15000, r);
}

static void join_ok(struct e2e_async *a, const char *what)
{
    struct e2e_resp r;
    e2e_http_join(a, &r);
    cr_expect_eq(r.status, 200, "%s: %ld (%s)", what, r.status, r.error);
    e2e_resp_free(&r);
}

/* A retry of the in-flight key on port: 409 idempotency-key-in-use; its Retry-After in whole seconds (-1: none or
 * not a number). */
static long retry_after_of_conflict(uint16_t port, const char *key, const char *what)
{
    struct e2e_resp r;
    post(port, key, NULL, &r);
    e2e_expect_problem(&r, 409, "idempotency-key-in-use", what);
    const char *v = e2e_resp_header(&r, "Retry-After");
    char *end = NULL;
    long s = v ? strtol(v, &end, 10) : -1;
    if (!v || end == v || *end != '\0')
        s = -1;
    e2e_resp_free(&r);
    return s;
}

/* One gateway: the retry meets the attempt this process holds (never asking Postgres). Without a recent upstream
 * time the estimate is the whole remaining lease; after one 2 s answer of the route, a retry 1 s into a 2 s attempt
 * is told 1 s (2 at most: the estimate's bucket), not the lease's 60. */
Test(retry_after, here_the_recent_upstream_time_less_the_attempts_age)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf c = {.idem = LEASE_60S};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &c, NULL);
    char k0[96], k1[96];
    e2e_mkkey(k0, sizeof k0, "ra-here0");
    e2e_mkkey(k1, sizeof k1, "ra-here1");

    struct e2e_async *a = in_flight(gw->port, up, k0, SLOW_2S);
    long ra = retry_after_of_conflict(gw->port, k0, "no history: a retry of the attempt in flight");
    cr_expect(ra >= 55 && ra <= 60, "no recent upstream time: Retry-After is the remaining lease (60 s): %ld", ra);
    join_ok(a, "the first attempt"); /* the route's first upstream time: about 2 s */

    a = in_flight(gw->port, up, k1, SLOW_2S);
    e2e_sleep_ms(1000);
    ra = retry_after_of_conflict(gw->port, k1, "a retry 1 s into a 2 s attempt");
    cr_expect(ra >= 1 && ra <= 2, "Retry-After 1 s into a 2 s attempt (route p90 about 2 s): %ld, want 1 or 2", ra);
    join_ok(a, "the second attempt");
    cr_expect_eq(e2e_upstream_count(up, k1), 1, "executed once");
}

/* Two gateways on one Postgres, the second one's wall clock ten minutes behind: its retry meets the attempt only in
 * Postgres, whose own clock gives the attempt's age and the remaining lease. No recent upstream time at the second
 * gateway: the remaining lease; after one 2 s answer there: 1 s (2 at most). A gateway comparing its wall clock
 * with the record's created_at would see an attempt from ten minutes in the future and answer the lease. */
Test(retry_after, at_another_gateway_the_age_is_postgres_s)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf c = {.idem = LEASE_60S};
    struct e2e_gw *ga = e2e_gw_start_pay(up, &c, NULL);
    struct e2e_gw *gb = e2e_gw_start_pay(up, &c, e2e_clock_env(-600000));
    char k0[96], kw[96], k1[96];
    e2e_mkkey(k0, sizeof k0, "ra-pg0");
    e2e_mkkey(kw, sizeof kw, "ra-pgw");
    e2e_mkkey(k1, sizeof k1, "ra-pg1");

    struct e2e_async *a = in_flight(ga->port, up, k0, SLOW_2S);
    long ra = retry_after_of_conflict(gb->port, k0, "no history at B: a retry of A's attempt");
    cr_expect(ra >= 55 && ra <= 60, "no recent upstream time at B: Retry-After is the remaining lease (60 s): %ld", ra);
    join_ok(a, "A's first attempt");

    struct e2e_resp w;
    post(gb->port, kw, SLOW_2S, &w); /* B's route learns an upstream time of about 2 s */
    cr_expect_eq(w.status, 200, "B's own request: %ld (%s)", w.status, w.error);
    e2e_resp_free(&w);

    a = in_flight(ga->port, up, k1, SLOW_2S);
    e2e_sleep_ms(1000);
    ra = retry_after_of_conflict(gb->port, k1, "a retry at B 1 s into A's 2 s attempt");
    cr_expect(ra >= 1 && ra <= 2, "Retry-After at B 1 s into A's 2 s attempt (B's p90 about 2 s): %ld, want 1 or 2",
              ra);
    join_ok(a, "A's second attempt");
    cr_expect_eq(e2e_upstream_count(up, k1), 1, "executed once");
}

/* The estimate never goes past the lease: a route whose upstream takes 4 s under a 2 s lease (renewed by its
 * owner) tells a retry at once 1 or 2 s, at the owner's gateway and at another one, both of which know 4 s. */
Test(retry_after, never_beyond_the_remaining_lease)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf c = {.idem = "key: required\nlease: 2s\n", .timeout = "10s"};
    struct e2e_gw *ga = e2e_gw_start_pay(up, &c, NULL);
    struct e2e_gw *gb = e2e_gw_start_pay(up, &c, NULL);
    char ka[96], kb[96], k1[96];
    e2e_mkkey(ka, sizeof ka, "ra-leasea");
    e2e_mkkey(kb, sizeof kb, "ra-leaseb");
    e2e_mkkey(k1, sizeof k1, "ra-lease1");
    const char *slow4 = "X-Test-Delay-Ms: 4000";
    struct e2e_async *wa = in_flight(ga->port, up, ka, slow4), *wb = in_flight(gb->port, up, kb, slow4);
    join_ok(wa, "A's warm-up"); /* both routes learn an upstream time of about 4 s */
    join_ok(wb, "B's warm-up");

    struct e2e_async *a = in_flight(ga->port, up, k1, slow4);
    long here = retry_after_of_conflict(ga->port, k1, "a retry at the owner's gateway");
    long there = retry_after_of_conflict(gb->port, k1, "a retry at the other gateway");
    cr_expect(here >= 1 && here <= 2, "at the owner's gateway (p90 4 s, lease 2 s): %ld, want 1 or 2", here);
    cr_expect(there >= 1 && there <= 2, "at the other gateway (p90 4 s, lease 2 s): %ld, want 1 or 2", there);
    join_ok(a, "the attempt");
    cr_expect_eq(e2e_upstream_count(up, k1), 1, "executed once");
}
