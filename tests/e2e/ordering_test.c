/* ordering_test.c - end-to-end tests of the ordering guard (SPEC 6): the real idemgate in front of the real test
 * upstream with the real Postgres and Redis; sequences per resource, stale and gap refusals, the in-flight rule. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

TestSuite(ordering, .init = e2e_setup, .fini = e2e_teardown, .timeout = 120);

/* A guarded route "acct" on /v1/accounts (keys optional, release status 503) and a plain idempotent route "plain"
 * on /v1/plain. ord: the ordering block's extra lines (indented by six), e.g. "      on_gap: reject\n". */
/* More lines of acct's idempotency block (indented by six); each test runs in its own process. */
static const char *acct_idem = "";

static char *conf(const char *sequence, const char *ord, const char *timeout)
{
    char *t = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&t, &n);
    /* clang-format off */
    fprintf(f, E2E_CONF_HEAD "upstreams:\n" E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "%s")
            "routes:\n"
            "  - name: acct\n"
            "    match:\n"
            "      path_prefix: /v1/accounts\n"
            "    upstream: api\n"
            "    idempotency:\n"
            "      key: optional\n"
            "      release_statuses: [503]\n"
            "      lease: 3s\n"
            "%s"
            "    ordering:\n"
            "      resource: /v1/accounts/{id}/address\n"
            "      sequence: %s\n"
            "%s"
            "  - name: plain\n"
            "    match:\n"
            "      path_prefix: /v1/plain\n"
            "    upstream: api\n"
            "    idempotency:\n"
            "      key: optional\n",
            timeout ? timeout : "5s", acct_idem, sequence ? sequence : "header:X-Sequence", ord ? ord : "");
    /* clang-format on */
    fclose(f);
    return t;
}

static struct e2e_gw *start(const struct e2e_upstream *up, const char *sequence, const char *ord, const char *timeout)
{
    char *t = conf(sequence, ord, timeout);
    struct e2e_gw_opts o = {.up = up, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(t, &o);
    free(t);
    return gw;
}

/* A resource path nobody else uses, even across runs on the same database. */
static void resource(char *buf, size_t n, const char *tag)
{
    char k[96];
    e2e_mkkey(k, sizeof k, tag);
    snprintf(buf, n, "/v1/accounts/%s/address", k);
}

/* PATCH path with "X-Sequence: seq" (NULL: none), the key (NULL: none), one more header line (NULL: none). */
static void send_seq(uint16_t port, const char *path, const char *seq, const char *key, const char *extra,
                     struct e2e_resp *r)
{
    char sh[64];
    const char *h[3] = {NULL, NULL, NULL};
    size_t i = 0;
    if (seq) {
        snprintf(sh, sizeof sh, "X-Sequence: %s", seq);
        h[i++] = sh;
    }
    if (extra)
        h[i++] = extra;
    e2e_http_key(port, "PATCH", path, key, h, "{\"street\":\"x\"}", 0, r);
}

/* Expects 409 problem name with "current": current in the body. */
static void expect_current(const struct e2e_resp *r, const char *name, long current, const char *what)
{
    e2e_expect_problem(r, 409, name, what);
    char want[48];
    snprintf(want, sizeof want, "\"current\":%ld", current);
    cr_expect(r->body && strstr((const char *)r->body, want), "%s: body has %s: %s", what, want,
              r->body ? (const char *)r->body : "");
}

static double metric(const struct e2e_gw *gw, const char *name, const char *route_label)
{
    struct e2e_resp r;
    e2e_get(gw->admin_port, "/metrics", &r);
    const char *labels[] = {route_label, NULL};
    double v = e2e_metric_value((const char *)r.body, name, labels);
    e2e_resp_free(&r);
    return v;
}

Test(ordering, swapped_on_the_wire_v10_refused_nothing_forwarded)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, NULL, NULL);
    char p[160], k11[96], k10[96];
    resource(p, sizeof p, "swap");
    e2e_mkkey(k11, sizeof k11, "v11");
    e2e_mkkey(k10, sizeof k10, "v10");
    struct e2e_resp r;
    send_seq(gw->port, p, "11", k11, NULL, &r);
    cr_expect_eq(r.status, 200, "v11: %ld", r.status);
    e2e_resp_free(&r);
    send_seq(gw->port, p, "10", k10, NULL, &r);
    expect_current(&r, "stale-sequence", 11, "v10 after v11");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, k10), 0, "v10 never forwarded");
    cr_expect_eq(e2e_upstream_count(up, k11), 1);
    cr_expect_eq(metric(gw, "idemgate_stale_version_rejections_total", "route=\"acct\""), 1);
    /* the refusal left no record: the same key is checked afresh (and still stale) */
    send_seq(gw->port, p, "10", k10, NULL, &r);
    expect_current(&r, "stale-sequence", 11, "v10 retried");
    e2e_resp_free(&r);
    /* keyless requests are guarded too */
    send_seq(gw->port, p, "11", NULL, NULL, &r);
    expect_current(&r, "stale-sequence", 11, "keyless v11");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1);
}

Test(ordering, concurrent_v11_v12_never_both_in_flight)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, NULL, NULL);
    char p[160], k11[96], k12[96], kx[96];
    resource(p, sizeof p, "conc");
    e2e_mkkey(k11, sizeof k11, "c11");
    e2e_mkkey(k12, sizeof k12, "c12");
    e2e_mkkey(kx, sizeof kx, "cx");
    char kh11[128], kh12[128];
    snprintf(kh11, sizeof kh11, "Idempotency-Key: %s", k11);
    snprintf(kh12, sizeof kh12, "Idempotency-Key: %s", k12);
    const char *h11[] = {kh11, "X-Sequence: 11", "X-Test-Delay-Ms: 900", NULL};
    const char *h12[] = {kh12, "X-Sequence: 12", NULL};
    struct e2e_req r11 = {.method = "PATCH", .path = p, .headers = h11, .body = "{}", .body_len = 2};
    struct e2e_req r12 = {.method = "PATCH", .path = p, .headers = h12, .body = "{}", .body_len = 2};
    struct e2e_async *a11 = e2e_http_async(gw->port, &r11);
    cr_assert_eq(e2e_upstream_wait_count(up, k11, 1, 3000), 1, "v11 reached the upstream");
    uint64_t t0 = e2e_now_ms();
    struct e2e_async *a12 = e2e_http_async(gw->port, &r12);
    e2e_sleep_ms(400);
    cr_expect_eq(e2e_upstream_count(up, k12), 0, "v12 is held while v11 is in flight at the upstream");
    struct e2e_resp x11, x12;
    e2e_http_join(a11, &x11);
    e2e_http_join(a12, &x12);
    cr_expect_eq(x11.status, 200, "v11: %ld", x11.status);
    cr_expect_eq(x12.status, 200, "v12: %ld %s", x12.status, x12.body ? (const char *)x12.body : "");
    cr_expect_geq(e2e_now_ms() - t0, 400);
    e2e_resp_free(&x11);
    e2e_resp_free(&x12);
    cr_expect_eq(e2e_upstream_count(up, k12), 1);
    struct e2e_resp r;
    send_seq(gw->port, p, "12", kx, NULL, &r);
    expect_current(&r, "stale-sequence", 12, "the applied sequence is 12");
    e2e_resp_free(&r);
}

Test(ordering, in_flight_wait_bounded_by_hold)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, "      hold: 300ms\n", NULL);
    char p[160];
    resource(p, sizeof p, "inuse");
    const char *h11[] = {"X-Sequence: 11", "X-Test-Delay-Ms: 1500", NULL};
    struct e2e_req r11 = {.method = "PATCH", .path = p, .headers = h11, .body = "{}", .body_len = 2};
    struct e2e_async *a11 = e2e_http_async(gw->port, &r11);
    cr_assert_eq(e2e_upstream_wait_count(up, NULL, 1, 3000), 1);
    struct e2e_resp r;
    uint64_t t0 = e2e_now_ms();
    send_seq(gw->port, p, "12", NULL, NULL, &r);
    uint64_t took = e2e_now_ms() - t0;
    e2e_expect_problem(&r, 409, "sequence-in-use", "v12 while v11 in flight past hold");
    cr_expect(e2e_resp_header(&r, "Retry-After") != NULL, "Retry-After");
    cr_expect(took >= 250 && took < 1400, "waited about hold: %llu ms", (unsigned long long)took);
    e2e_resp_free(&r);
    e2e_http_join(a11, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1);
}

Test(ordering, gap_accept_forwards_and_counts)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, "      on_gap: accept\n", NULL);
    char p[160];
    resource(p, sizeof p, "gapacc");
    struct e2e_resp r;
    send_seq(gw->port, p, "5", NULL, NULL, &r); /* a fresh resource accepts any first sequence */
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    cr_expect_eq(metric(gw, "idemgate_sequence_gaps_total", "route=\"acct\""), 0);
    send_seq(gw->port, p, "7", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    cr_expect_eq(metric(gw, "idemgate_sequence_gaps_total", "route=\"acct\""), 1);
    cr_expect_eq(e2e_upstream_count(up, NULL), 2);
}

/* SPEC 6: a request arriving while a lower one is in flight waits for it before it can be a gap. v7 arrives while
 * v6 is at the (slow) upstream after v5: it waits, is forwarded as 6 + 1, and is no gap; a real gap (v9 after v7)
 * still counts once. */
Test(ordering, waiting_for_a_lower_one_in_flight_is_not_a_gap)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, NULL, NULL);
    char p[160], k6[96], k7[96];
    resource(p, sizeof p, "inflgap");
    e2e_mkkey(k6, sizeof k6, "i6");
    e2e_mkkey(k7, sizeof k7, "i7");
    struct e2e_resp r;
    send_seq(gw->port, p, "5", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    char kh6[128];
    snprintf(kh6, sizeof kh6, "Idempotency-Key: %s", k6);
    const char *h6[] = {kh6, "X-Sequence: 6", "X-Test-Delay-Ms: 700", NULL};
    struct e2e_req r6 = {.method = "PATCH", .path = p, .headers = h6, .body = "{}", .body_len = 2};
    struct e2e_async *a6 = e2e_http_async(gw->port, &r6);
    cr_assert_eq(e2e_upstream_wait_count(up, k6, 1, 3000), 1, "v6 reached the upstream");
    send_seq(gw->port, p, "7", k7, NULL, &r);
    cr_expect_eq(r.status, 200, "v7 waited for v6, then forwarded: %ld %s", r.status,
                 r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
    e2e_http_join(a6, &r);
    cr_expect_eq(r.status, 200, "v6: %ld", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, k7), 1);
    cr_expect_eq(metric(gw, "idemgate_sequence_gaps_total", "route=\"acct\""), 0, "v7 was no gap: %g",
                 metric(gw, "idemgate_sequence_gaps_total", "route=\"acct\""));
    send_seq(gw->port, p, "9", NULL, NULL, &r); /* a real gap: 9 after 7 */
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    cr_expect_eq(metric(gw, "idemgate_sequence_gaps_total", "route=\"acct\""), 1, "v9 counted once");
}

/* A request that ends as sequence-in-use (a lower one in flight past hold) is no gap either; on reject, a real gap
 * after it still counts once. */
Test(ordering, sequence_in_use_is_not_a_gap)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, "      on_gap: reject\n      hold: 300ms\n", NULL);
    char p[160];
    resource(p, sizeof p, "inusegap");
    struct e2e_resp r;
    send_seq(gw->port, p, "5", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    const char *h6[] = {"X-Sequence: 6", "X-Test-Delay-Ms: 1200", NULL};
    struct e2e_req r6 = {.method = "PATCH", .path = p, .headers = h6, .body = "{}", .body_len = 2};
    struct e2e_async *a6 = e2e_http_async(gw->port, &r6);
    cr_assert_eq(e2e_upstream_wait_count(up, NULL, 2, 3000), 2, "v6 reached the upstream");
    send_seq(gw->port, p, "7", NULL, NULL, &r);
    e2e_expect_problem(&r, 409, "sequence-in-use", "v7 while v6 in flight past hold");
    e2e_resp_free(&r);
    cr_expect_eq(metric(gw, "idemgate_sequence_gaps_total", "route=\"acct\""), 0, "sequence-in-use is no gap: %g",
                 metric(gw, "idemgate_sequence_gaps_total", "route=\"acct\""));
    e2e_http_join(a6, &r);
    cr_expect_eq(r.status, 200, "v6: %ld", r.status);
    e2e_resp_free(&r);
    send_seq(gw->port, p, "8", NULL, NULL, &r);
    expect_current(&r, "sequence-gap", 6, "v8 after v6");
    e2e_resp_free(&r);
    cr_expect_eq(metric(gw, "idemgate_sequence_gaps_total", "route=\"acct\""), 1, "v8 counted once");
    cr_expect_eq(e2e_upstream_count(up, NULL), 2);
}

Test(ordering, gap_reject_then_the_missing_one_then_retry)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, "      on_gap: reject\n", NULL);
    char p[160], k7[96];
    resource(p, sizeof p, "gaprej");
    e2e_mkkey(k7, sizeof k7, "g7");
    struct e2e_resp r;
    send_seq(gw->port, p, "5", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    send_seq(gw->port, p, "7", k7, NULL, &r);
    expect_current(&r, "sequence-gap", 5, "v7 after v5");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, k7), 0);
    send_seq(gw->port, p, "6", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    send_seq(gw->port, p, "7", k7, NULL, &r); /* no record was left: checked afresh */
    cr_expect_eq(r.status, 200, "v7 retried: %ld", r.status);
    cr_expect(!e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, k7), 1);
    cr_expect_eq(metric(gw, "idemgate_sequence_gaps_total", "route=\"acct\""), 1);
}

Test(ordering, gap_hold_released_by_the_missing_one)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, "      on_gap: hold\n      hold: 4s\n", NULL);
    char p[160], k7[96];
    resource(p, sizeof p, "holdok");
    e2e_mkkey(k7, sizeof k7, "h7");
    struct e2e_resp r;
    send_seq(gw->port, p, "5", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    char kh[128];
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", k7);
    const char *h7[] = {kh, "X-Sequence: 7", NULL};
    struct e2e_req r7 = {.method = "PATCH", .path = p, .headers = h7, .body = "{}", .body_len = 2};
    struct e2e_async *a7 = e2e_http_async(gw->port, &r7);
    e2e_sleep_ms(400);
    cr_expect_eq(e2e_upstream_count(up, k7), 0, "v7 held");
    send_seq(gw->port, p, "6", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    e2e_http_join(a7, &r);
    cr_expect_eq(r.status, 200, "v7 forwarded once v6 applied: %ld", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, k7), 1);
    cr_expect_eq(e2e_upstream_count(up, NULL), 3);
    /* v7 was a gap when it came (nothing in flight): counted once, however many polls it waited */
    cr_expect_eq(metric(gw, "idemgate_sequence_gaps_total", "route=\"acct\""), 1);
}

Test(ordering, gap_hold_times_out)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, "      on_gap: hold\n      hold: 500ms\n", NULL);
    char p[160], k7[96];
    resource(p, sizeof p, "holdto");
    e2e_mkkey(k7, sizeof k7, "t7");
    struct e2e_resp r;
    send_seq(gw->port, p, "5", NULL, NULL, &r);
    e2e_resp_free(&r);
    uint64_t t0 = e2e_now_ms();
    send_seq(gw->port, p, "7", k7, NULL, &r);
    uint64_t took = e2e_now_ms() - t0;
    expect_current(&r, "sequence-gap", 5, "v7 never filled");
    cr_expect(took >= 450 && took < 2000, "held about 500 ms: %llu", (unsigned long long)took);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, k7), 0);
    cr_expect_eq(metric(gw, "idemgate_sequence_gaps_total", "route=\"acct\""), 1);
}

Test(ordering, retry_of_applied_v11_is_a_replay_after_v12)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, NULL, NULL);
    char p[160], k11[96], k12[96];
    resource(p, sizeof p, "replay");
    e2e_mkkey(k11, sizeof k11, "r11");
    e2e_mkkey(k12, sizeof k12, "r12");
    struct e2e_resp r;
    send_seq(gw->port, p, "11", k11, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    send_seq(gw->port, p, "12", k12, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    send_seq(gw->port, p, "11", k11, NULL, &r);
    cr_expect_eq(r.status, 200, "the retry of v11 is a replay, never stale: %ld", r.status);
    cr_expect(e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, k11), 1);
}

Test(ordering, released_v11_leaves_applied_and_executes_again)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, NULL, NULL);
    char p[160], k10[96], k11[96];
    resource(p, sizeof p, "release");
    e2e_mkkey(k10, sizeof k10, "l10");
    e2e_mkkey(k11, sizeof k11, "l11");
    struct e2e_resp r;
    send_seq(gw->port, p, "10", k10, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    send_seq(gw->port, p, "11", k11, "X-Test-Status: 503", &r);
    cr_expect_eq(r.status, 503, "release status passed on");
    e2e_resp_free(&r);
    send_seq(gw->port, p, "11", k11, NULL, &r);
    cr_expect_eq(r.status, 200, "v11 again executes: %ld %s", r.status, r.body ? (const char *)r.body : "");
    cr_expect(!e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, k11), 2);
    /* a keyless released request leaves applied too */
    send_seq(gw->port, p, "12", NULL, "X-Test-Status: 503", &r);
    cr_expect_eq(r.status, 503);
    e2e_resp_free(&r);
    send_seq(gw->port, p, "12", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
}

/* A fresh resource (path into p) whose v11 (key into k11) times out at the upstream (1 s timeout): an unknown outcome.
 */
static void v11_times_out(const struct e2e_upstream *up, const struct e2e_gw *gw, char *p, size_t pn, char *k11,
                          size_t kn, const char *tag)
{
    resource(p, pn, tag);
    e2e_mkkey(k11, kn, tag);
    struct e2e_resp r;
    send_seq(gw->port, p, "11", k11, "X-Test-Delay-Ms: 1500", &r);
    e2e_expect_problem(&r, 504, "upstream-timeout", "v11 times out");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, k11), 1);
}

Test(ordering, unknown_outcome_counts_as_applied)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, NULL, "1s");
    char p[160], k11[96], k11b[96], k12[96];
    v11_times_out(up, gw, p, sizeof p, k11, sizeof k11, "unknown");
    e2e_mkkey(k11b, sizeof k11b, "u11b");
    e2e_mkkey(k12, sizeof k12, "u12");
    struct e2e_resp r;
    send_seq(gw->port, p, "11", k11b, NULL, &r);
    expect_current(&r, "stale-sequence", 11, "v11 under another key after an unknown v11");
    e2e_resp_free(&r);
    send_seq(gw->port, p, "12", k12, NULL, &r);
    cr_expect_eq(r.status, 200, "a later, higher sequence is accepted: %ld", r.status);
    e2e_resp_free(&r);
}

Test(ordering, retry_taking_over_an_unknown_outcome_is_not_stale)
{
    acct_idem = "      on_unknown: retry\n";
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, NULL, "1s");
    char p[160], k11[96], kb[96];
    v11_times_out(up, gw, p, sizeof p, k11, sizeof k11, "takeover");
    e2e_mkkey(kb, sizeof kb, "o11b");
    struct e2e_resp r;
    e2e_sleep_ms(3300); /* past the 3 s lease: on_unknown: retry takes the key over */
    send_seq(gw->port, p, "11", k11, NULL, &r);
    cr_expect_eq(r.status, 200, "the same key's retry is forwarded again, not stale: %ld %s", r.status,
                 r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, k11), 2);
    send_seq(gw->port, p, "11", kb, NULL, &r);
    expect_current(&r, "stale-sequence", 11, "v11 under another key");
    e2e_resp_free(&r);
}

Test(ordering, sequence_from_json_body)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, "json:/meta/version", NULL, NULL);
    char p[160];
    resource(p, sizeof p, "json");
    struct e2e_resp r;
    e2e_http_key(gw->port, "PATCH", p, NULL, NULL, "{\"meta\":{\"version\":3},\"street\":\"a\"}", 0, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    e2e_http_key(gw->port, "PATCH", p, NULL, NULL, "{\"meta\":{\"version\":2}}", 0, &r);
    expect_current(&r, "stale-sequence", 3, "json v2 after v3");
    e2e_resp_free(&r);
    static const char *const bad[] = {
        "{\"meta\":{\"version\":\"4\"}}",
        "{\"meta\":{\"version\":4.0}}",
        "{\"meta\":{}}",
        "not json",
        "",
        "{\"meta\":{\"version\":0}}",
        "{\"meta\":{\"version\":-4}}",
        "{\"meta\":{\"version\":9223372036854775808}}",
        "{\"meta\":{\"version\":4},\"meta\":{\"version\":5}}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        e2e_http_key(gw->port, "PATCH", p, NULL, NULL, bad[i][0] ? bad[i] : NULL, 0, &r);
        e2e_expect_problem(&r, 400, "sequence-invalid", bad[i]);
        e2e_resp_free(&r);
    }
    cr_expect_eq(e2e_upstream_count(up, NULL), 1);
}

/* A body that is valid JSON (RFC 8259) with a valid sequence at the pointer is forwarded, whatever else it holds:
 * integers beyond 64 bits, a real that overflows a double, "\u0000" (jansson alone refused the whole document). */
Test(ordering, json_body_valid_beyond_jansson_is_forwarded)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, "json:/seq", NULL, NULL);
    static const char *const bodies[] = {
        "{\"seq\":1,\"account\":18446744073709551615}",
        "{\"seq\":1,\"x\":-9223372036854775809}",
        "{\"seq\":1,\"x\":1e400}",
        "{\"seq\":7,\"x\":\"\\u0000\"}",
    };
    static const char *const again[] = {"{\"seq\":1}", "{\"seq\":1}", "{\"seq\":1}", "{\"seq\":7}"};
    static const long current[] = {1, 1, 1, 7};
    for (size_t i = 0; i < sizeof bodies / sizeof bodies[0]; i++) {
        char p[160], tag[16];
        snprintf(tag, sizeof tag, "big%zu", i);
        resource(p, sizeof p, tag);
        struct e2e_resp r;
        e2e_http_key(gw->port, "PATCH", p, NULL, NULL, bodies[i], 0, &r);
        cr_expect_eq(r.status, 200, "%s: %ld %s", bodies[i], r.status, r.body ? (const char *)r.body : "");
        e2e_resp_free(&r);
        /* the sequence was read exactly: the same one again is stale */
        e2e_http_key(gw->port, "PATCH", p, NULL, NULL, again[i], 0, &r);
        expect_current(&r, "stale-sequence", current[i], bodies[i]);
        e2e_resp_free(&r);
    }
    cr_expect_eq(e2e_upstream_count(up, NULL), 4);
}

Test(ordering, bad_sequences_are_400)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, NULL, NULL);
    char p[160];
    resource(p, sizeof p, "bad");
    static const char *const bad[] = {"0",   "-1",  "+1", "9223372036854775808", "99999999999999999999", "abc", "011",
                                      "1.5", "1 2", ""};
    struct e2e_resp r;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        send_seq(gw->port, p, bad[i], NULL, NULL, &r);
        e2e_expect_problem(&r, 400, "sequence-invalid", bad[i]);
        e2e_resp_free(&r);
    }
    send_seq(gw->port, p, NULL, NULL, NULL, &r);
    e2e_expect_problem(&r, 400, "sequence-invalid", "missing");
    e2e_resp_free(&r);
    send_seq(gw->port, p, "3", NULL, "X-Sequence: 3", &r);
    e2e_expect_problem(&r, 400, "sequence-invalid", "repeated header");
    e2e_resp_free(&r);
    /* key syntax comes first */
    send_seq(gw->port, p, "0", "\"unterminated", NULL, &r);
    e2e_expect_problem(&r, 400, "idempotency-key-invalid", "bad key and bad sequence");
    e2e_resp_free(&r);
    send_seq(gw->port, p, "9223372036854775807", NULL, NULL, &r);
    cr_expect_eq(r.status, 200, "2^63-1 is valid");
    e2e_resp_free(&r);
    /* paths outside the template and methods outside the route's are not guarded */
    send_seq(gw->port, "/v1/accounts/x/address/more", NULL, NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    e2e_http_key(gw->port, "GET", p, NULL, NULL, NULL, 0, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
}

/* SPEC 7: a sequence of 2^63-1 on a resource already at 2^63-1 is stale like any other (the guard's statement
 * computed applied + 1 and Postgres refused the overflow: 503 store-unavailable), and so is a lower one after it. */
Test(ordering, max_sequence_on_a_resource_at_max_is_stale)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, "      on_gap: reject\n", NULL);
    char p[160];
    resource(p, sizeof p, "max");
    struct e2e_resp r;
    send_seq(gw->port, p, "9223372036854775807", NULL, NULL, &r);
    cr_expect_eq(r.status, 200, "first 2^63-1: %ld %s", r.status, r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
    send_seq(gw->port, p, "9223372036854775807", NULL, NULL, &r);
    expect_current(&r, "stale-sequence", 9223372036854775807L, "2^63-1 again");
    e2e_resp_free(&r);
    char k[96];
    e2e_mkkey(k, sizeof k, "max-again");
    send_seq(gw->port, p, "9223372036854775807", k, NULL, &r);
    expect_current(&r, "stale-sequence", 9223372036854775807L, "2^63-1 again, keyed");
    e2e_resp_free(&r);
    send_seq(gw->port, p, "5", NULL, NULL, &r);
    expect_current(&r, "stale-sequence", 9223372036854775807L, "a lower one after it");
    e2e_resp_free(&r);
    cr_expect(!e2e_gw_log_contains(gw, "order_acquire_failed"), "no statement failed");
}

Test(ordering, two_gateways_share_the_guard)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *a = start(up, NULL, NULL, NULL);
    struct e2e_gw *b = start(up, NULL, NULL, NULL);
    char p[160];
    resource(p, sizeof p, "pair");
    struct e2e_resp r;
    send_seq(a->port, p, "11", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    send_seq(b->port, p, "10", NULL, NULL, &r);
    expect_current(&r, "stale-sequence", 11, "v10 on the other gateway");
    e2e_resp_free(&r);
    send_seq(b->port, p, "12", NULL, NULL, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    send_seq(a->port, p, "12", NULL, NULL, &r);
    expect_current(&r, "stale-sequence", 12, "v12 again on the first");
    e2e_resp_free(&r);
}

Test(ordering, metrics_families_from_start)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, NULL, NULL);
    struct e2e_resp r;
    e2e_get(gw->admin_port, "/metrics", &r);
    cr_expect(strstr((const char *)r.body, "# TYPE idemgate_stale_version_rejections_total counter"));
    cr_expect(strstr((const char *)r.body, "# HELP idemgate_sequence_gaps_total"));
    e2e_resp_free(&r);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The guard's added latency on new keys: N sequential new-key requests with and without it (p50s in the log). */
Test(ordering, latency_with_and_without_guard)
{
    enum { N = 200 };
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, NULL, NULL);
    static uint64_t with[N], without[N];
    char p[160], plain[160], key[96], seq[24];
    resource(p, sizeof p, "lat");
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < N; i++) {
            struct e2e_resp r;
            e2e_mkkey(key, sizeof key, "lat");
            snprintf(seq, sizeof seq, "%d", i + 1);
            uint64_t t0 = e2e_now_ms();
            if (pass == 0) {
                send_seq(gw->port, p, seq, key, NULL, &r);
            } else {
                snprintf(plain, sizeof plain, "/v1/plain/%d", i);
                e2e_http_key(gw->port, "PATCH", plain, key, NULL, "{\"street\":\"x\"}", 0, &r);
            }
            (pass == 0 ? with : without)[i] = (uint64_t)(r.seconds * 1e6);
            (void)t0;
            cr_assert_eq(r.status, 200, "pass %d request %d: %ld", pass, i, r.status);
            e2e_resp_free(&r);
        }
    }
    qsort(with, N, sizeof with[0], cmp_u64);
    qsort(without, N, sizeof without[0], cmp_u64);
    fprintf(stderr,
            "ordering_latency n=%d p50_with_guard_us=%llu p50_without_us=%llu p90_with_us=%llu p90_without_us=%llu\n",
            N, (unsigned long long)with[N / 2], (unsigned long long)without[N / 2],
            (unsigned long long)with[N * 9 / 10], (unsigned long long)without[N * 9 / 10]);
}
