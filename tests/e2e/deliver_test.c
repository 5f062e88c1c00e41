/* deliver_test.c - end-to-end: what a route tells its upstream and its clients about a key (SPEC 12): the fence
 * forwarded upstream (forward_token), the key's expiry advertised (advertise_expiry), and a client's Prefer: wait. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tests/e2e/harness.h"

TestSuite(deliver, .init = e2e_setup, .fini = e2e_teardown, .timeout = 120);

/* The value of the fence header name the upstream saw on its last execution: exactly one such header, all digits;
 * 0 (and a failed expectation) otherwise. */
static uint64_t fence_seen(const struct e2e_upstream *up, const char *name, const char *what)
{
    char *text = e2e_upstream_last_headers(up);
    struct e2e_hdr *h = NULL;
    size_t n = e2e_parse_header_lines(text, &h);
    uint64_t v = 0;
    cr_expect_eq(e2e_hdrs_count(h, n, name), 1, "%s: one %s header upstream: %s", what, name, text);
    const char *s = e2e_hdrs_get(h, n, name);
    if (s && *s && strspn(s, "0123456789") == strlen(s) && strlen(s) <= 19)
        v = strtoull(s, NULL, 10);
    else
        cr_expect(false, "%s: %s is not a decimal number: '%s'", what, name, s ? s : "(none)");
    e2e_hdrs_free(h, n);
    free(text);
    return v;
}

static size_t header_seen(const struct e2e_upstream *up, const char *name)
{
    char *text = e2e_upstream_last_headers(up);
    struct e2e_hdr *h = NULL;
    size_t n = e2e_parse_header_lines(text, &h);
    size_t c = e2e_hdrs_count(h, n, name);
    e2e_hdrs_free(h, n);
    free(text);
    return c;
}

#define FORGED "99999999999999999"

Test(deliver, forward_token_sends_the_claims_fence_and_replaces_the_clients)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf c = {.idem = "key: required\nlease: 1s\non_unknown: retry\n"
                                     "forward_token: Idempotency-Fence\n"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &c, NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "fence");
    struct e2e_resp r;
    static const char *const forged_reset[] = {"Idempotency-Fence: " FORGED, "X-Test-Action: reset", NULL};
    e2e_http_key(gw->port, "POST", "/v1/pay/fence", key, forged_reset, "{\"a\":1}", 0, &r);
    e2e_expect_problem(&r, 502, "upstream-no-response", "the first attempt executes, then the upstream resets");
    e2e_resp_free(&r);
    cr_assert_eq(e2e_upstream_count(up, key), 1);
    uint64_t t1 = fence_seen(up, "Idempotency-Fence", "first attempt");
    cr_expect_neq(t1, strtoull(FORGED, NULL, 10), "the client's fence was passed on");

    e2e_sleep_ms(1400); /* past the lease: on_unknown: retry takes the key over under a new claim */
    static const char *const forged[] = {"idempotency-fence: " FORGED, NULL};
    e2e_http_key(gw->port, "POST", "/v1/pay/fence", key, forged, "{\"a\":1}", 0, &r);
    cr_expect_eq(r.status, 200, "the takeover executes: %ld %s", r.status, r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
    cr_assert_eq(e2e_upstream_count(up, key), 2);
    uint64_t t2 = fence_seen(up, "Idempotency-Fence", "the takeover");
    cr_expect_gt(t2, t1, "the takeover's fence %" PRIu64 " is not above the first attempt's %" PRIu64, t2, t1);
    cr_expect_neq(t2, strtoull(FORGED, NULL, 10), "the client's fence was passed on");

    /* a request the route forwards without a claim (GET is not an idempotent method here) carries no fence, and
     * never the client's */
    static const char *const get_forged[] = {"Idempotency-Fence: " FORGED, NULL};
    struct e2e_req rq = {.method = "GET", .path = "/v1/pay/fence", .headers = get_forged};
    e2e_http(gw->port, &rq, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    cr_expect_eq(header_seen(up, "Idempotency-Fence"), 0, "a client's fence header reached the upstream");
}

Test(deliver, without_forward_token_the_fence_header_is_the_clients)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf c = {.idem = "key: required\n"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &c, NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "nofence");
    struct e2e_resp r;
    static const char *const h[] = {"Idempotency-Fence: 7", NULL};
    e2e_http_key(gw->port, "POST", "/v1/pay/nofence", key, h, "{}", 0, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    cr_expect_eq(fence_seen(up, "Idempotency-Fence", "no forward_token"), 7, "an ordinary header is passed on");
}

/* Seconds since the epoch of an IMF-fixdate (RFC 9110 5.6.7), or -1 when it is not one. */
static long long imf_seconds(const char *s)
{
    struct tm tm;
    memset(&tm, 0, sizeof tm);
    const char *end = s ? strptime(s, "%a, %d %b %Y %H:%M:%S GMT", &tm) : NULL;
    if (!end || *end || strlen(s) != 29)
        return -1;
    return (long long)timegm(&tm);
}

Test(deliver, advertise_expiry_is_the_same_on_the_first_answer_and_its_replays)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf c = {.idem = "key: required\nretention: 1h\nadvertise_expiry: true\n"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &c, NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "expires");
    /* the upstream's own Idempotency-Expires is replaced by the gateway's */
    static const char *const own[] = {"X-Test-Header: Idempotency-Expires: Thu, 01 Jan 1970 00:00:00 GMT", NULL};
    struct e2e_resp first;
    long long before = (long long)time(NULL);
    e2e_http_key(gw->port, "POST", "/v1/pay/exp", key, own, "{\"e\":1}", 0, &first);
    long long after = (long long)time(NULL);
    cr_assert_eq(first.status, 200, "%ld %s", first.status, first.body ? (const char *)first.body : "");
    cr_expect_eq(e2e_resp_header_count(&first, "Idempotency-Expires"), 1,
                 "one Idempotency-Expires on the first answer");
    const char *v = e2e_resp_header(&first, "Idempotency-Expires");
    long long exp = imf_seconds(v);
    cr_expect(exp >= before + 3600 - 2 && exp <= after + 3600,
              "Idempotency-Expires '%s' is not about an hour after "
              "the completion (%lld, %lld .. %lld)",
              v ? v : "(none)", exp, before + 3600, after + 3600);
    for (int i = 0; i < 3; i++) { /* from Postgres, then from the replay cache */
        struct e2e_resp rep;
        e2e_http_key(gw->port, "POST", "/v1/pay/exp", key, NULL, "{\"e\":1}", 0, &rep);
        cr_expect(e2e_resp_is_replay(&rep), "retry %d is a replay (%ld)", i, rep.status);
        cr_expect_eq(e2e_resp_header_count(&rep, "Idempotency-Expires"), 1, "retry %d: one Idempotency-Expires", i);
        const char *rv = e2e_resp_header(&rep, "Idempotency-Expires");
        cr_expect(v && rv && strcmp(v, rv) == 0, "retry %d: Idempotency-Expires '%s', the first answer had '%s'", i,
                  rv ? rv : "(none)", v ? v : "(none)");
        e2e_resp_free(&rep);
    }
    e2e_resp_free(&first);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    /* an answer that is not stored (a request the route does not claim) carries none */
    struct e2e_resp r;
    e2e_get(gw->port, "/v1/pay/exp", &r);
    cr_expect_eq(r.status, 200);
    cr_expect_eq(e2e_resp_header_count(&r, "Idempotency-Expires"), 0, "a pass-through answer advertised an expiry");
    e2e_resp_free(&r);
}

Test(deliver, without_advertise_expiry_no_header)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf c = {.idem = "key: required\n"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &c, NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "noexp");
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay/noexp", key, NULL, "{}", 0, &r);
    cr_expect_eq(r.status, 200);
    cr_expect_eq(e2e_resp_header_count(&r, "Idempotency-Expires"), 0);
    e2e_resp_free(&r);
}

/* Starts a request of key with the upstream answering after delay_ms, in the background. */
static struct e2e_async *slow_first(uint16_t port, const char *key, const char *delay_hdr)
{
    static char khdr[160];
    snprintf(khdr, sizeof khdr, "Idempotency-Key: %s", key);
    const char *const h[] = {khdr, delay_hdr, NULL};
    struct e2e_req rq = {.method = "POST", .path = "/v1/pay/slow", .headers = h, .body = "{\"s\":1}", .body_len = 7};
    return e2e_http_async(port, &rq);
}

Test(deliver, prefer_wait_waits_for_the_first_attempt_up_to_the_cap)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf c = {.idem = "key: required\nprefer_wait_max: 3s\n"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &c, NULL);
    char key[96], key2[96];
    e2e_mkkey(key, sizeof key, "prefer");
    e2e_mkkey(key2, sizeof key2, "prefer2");

    /* 1. several preferences, the token in capitals, a parameter: it waits (capped to 3 s) and replays */
    struct e2e_async *a = slow_first(gw->port, key, "X-Test-Delay-Ms: 1500");
    cr_assert_eq(e2e_upstream_wait_count(up, key, 1, 5000), 1, "the first attempt reached the upstream");
    static const char *const pw[] = {"Prefer: respond-async, handling=\"a,b\"", "Prefer: WAIT = 10 ;x=y", NULL};
    struct e2e_resp b, first;
    e2e_http_key(gw->port, "POST", "/v1/pay/slow", key, pw, "{\"s\":1}", 0, &b);
    e2e_http_join(a, &first);
    cr_expect_eq(first.status, 200);
    cr_expect(e2e_resp_is_replay(&b), "the waiting retry replays the first answer: %ld %s", b.status,
              b.body ? (const char *)b.body : "");
    cr_expect(b.body_len == first.body_len && memcmp(b.body, first.body, b.body_len) == 0, "same body");
    const char *pa = e2e_resp_header(&b, "Preference-Applied");
    cr_expect(pa && strcmp(pa, "wait=3") == 0, "Preference-Applied '%s', want wait=3 (the cap)", pa ? pa : "(none)");
    cr_expect(b.seconds >= 0.8 && b.seconds < 3.5, "it waited for the first answer: %.2fs", b.seconds);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    e2e_resp_free(&b);
    e2e_resp_free(&first);

    /* 2. still in flight when the client's shorter wait is over: 409 as on_in_flight: conflict, after it */
    a = slow_first(gw->port, key2, "X-Test-Delay-Ms: 4000");
    cr_assert_eq(e2e_upstream_wait_count(up, key2, 1, 5000), 1);
    static const char *const w1[] = {"Prefer: wait=1", NULL};
    e2e_http_key(gw->port, "POST", "/v1/pay/slow", key2, w1, "{\"s\":1}", 0, &b);
    e2e_expect_problem(&b, 409, "idempotency-key-in-use", "still in flight after the wait");
    pa = e2e_resp_header(&b, "Preference-Applied");
    cr_expect(pa && strcmp(pa, "wait=1") == 0, "Preference-Applied '%s', want wait=1", pa ? pa : "(none)");
    cr_expect(b.seconds >= 0.9 && b.seconds < 2.5, "409 after about 1 s: %.2fs", b.seconds);
    e2e_resp_free(&b);

    /* 3. no preference, or a malformed one: 409 at once, nothing applied */
    static const char *const bad[] = {"Prefer: wait=abc, wait=-1, wait", NULL};
    const char *const *cases[] = {NULL, bad};
    for (size_t i = 0; i < 2; i++) {
        e2e_http_key(gw->port, "POST", "/v1/pay/slow", key2, cases[i], "{\"s\":1}", 0, &b);
        e2e_expect_problem(&b, 409, "idempotency-key-in-use", "no usable preference");
        cr_expect_eq(e2e_resp_header_count(&b, "Preference-Applied"), 0, "case %zu applied a preference", i);
        cr_expect(b.seconds < 0.8, "case %zu answered at once: %.2fs", i, b.seconds);
        e2e_resp_free(&b);
    }
    e2e_http_join(a, &first);
    cr_expect_eq(first.status, 200);
    e2e_resp_free(&first);
    cr_expect_eq(e2e_upstream_count(up, key2), 1);
}

Test(deliver, prefer_wait_is_ignored_without_prefer_wait_max)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf c = {.idem = "key: required\n"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &c, NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "noprefer");
    struct e2e_async *a = slow_first(gw->port, key, "X-Test-Delay-Ms: 1500");
    cr_assert_eq(e2e_upstream_wait_count(up, key, 1, 5000), 1);
    static const char *const pw[] = {"Prefer: wait=10", NULL};
    struct e2e_resp b, first;
    e2e_http_key(gw->port, "POST", "/v1/pay/slow", key, pw, "{\"s\":1}", 0, &b);
    e2e_expect_problem(&b, 409, "idempotency-key-in-use", "Prefer: wait on a route without prefer_wait_max");
    cr_expect_eq(e2e_resp_header_count(&b, "Preference-Applied"), 0);
    e2e_resp_free(&b);
    e2e_http_join(a, &first);
    e2e_resp_free(&first);
}

Test(deliver, prefer_wait_replaces_the_routes_own_wait)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf c = {.idem = "key: required\non_in_flight: wait\nwait: 10s\nprefer_wait_max: 5s\n"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &c, NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "preferwait");
    struct e2e_async *a = slow_first(gw->port, key, "X-Test-Delay-Ms: 4000");
    cr_assert_eq(e2e_upstream_wait_count(up, key, 1, 5000), 1);
    /* the client asks for 1 s: the route's own 10 s wait is not imposed on it */
    static const char *const w1[] = {"Prefer: wait=1", NULL};
    struct e2e_resp b, first;
    e2e_http_key(gw->port, "POST", "/v1/pay/slow", key, w1, "{\"s\":1}", 0, &b);
    e2e_expect_problem(&b, 409, "idempotency-key-in-use", "the client's shorter wait is over");
    cr_expect(b.seconds >= 0.9 && b.seconds < 2.5, "409 after about 1 s: %.2fs", b.seconds);
    const char *pa = e2e_resp_header(&b, "Preference-Applied");
    cr_expect(pa && strcmp(pa, "wait=1") == 0, "Preference-Applied '%s'", pa ? pa : "(none)");
    e2e_resp_free(&b);
    /* without a preference the route's wait applies: it waits for the first answer and replays it */
    e2e_http_key(gw->port, "POST", "/v1/pay/slow", key, NULL, "{\"s\":1}", 0, &b);
    cr_expect(e2e_resp_is_replay(&b), "the route's wait replays: %ld", b.status);
    cr_expect_eq(e2e_resp_header_count(&b, "Preference-Applied"), 0);
    e2e_resp_free(&b);
    e2e_http_join(a, &first);
    e2e_resp_free(&first);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
}
