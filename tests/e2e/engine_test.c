/* engine_test.c - end-to-end tests of the idempotency contract (SPEC sections 1, 4, 5): the real idemgate in front of
 * the real test upstream with the real Postgres and Redis; every test counts the upstream's executions. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "harness.h"

TestSuite(idem, .init = e2e_setup, .fini = e2e_teardown, .timeout = 60);

#define ADMIN_TOKEN "e2e-idem-admin-token-7f3a"

/* ---- configuration */

/* Starts a gateway with e2e_conf_pay (idem: pay's idempotency block; upstream up with a 5 s timeout) and waits
 * until it is ready; env may be NULL. */
static struct e2e_gw *gw_start(const struct e2e_upstream *up, const char *idem, const char *const *env)
{
    struct e2e_pay_conf c = {.idem = idem};
    return e2e_gw_start_pay(up, &c, env);
}

/* ---- helpers */

/* POST path with the key (raw value; NULL: no key header), body (NULL: none) and extra headers. */
static void post(uint16_t port, const char *path, const char *key, const char *body, const char *const *extra,
                 struct e2e_resp *r)
{
    e2e_http_key(port, "POST", path, key, extra, body, 0, r);
}

static void dump_headers(const struct e2e_resp *r, const char *what)
{
    for (size_t i = 0; i < r->nhdrs; i++)
        cr_log_info("%s: %s: %s", what, r->hdrs[i].name, r->hdrs[i].value);
}

/* Admin request with the token (tok NULL: no Authorization header). */
static void admin(const struct e2e_gw *g, const char *method, const char *what, const char *key, const char *tok,
                  struct e2e_resp *r)
{
    char path[512], auth[128];
    snprintf(path, sizeof path, "/admin/%s?route=pay&key=%s", what, key);
    snprintf(auth, sizeof auth, "Authorization: Bearer %s", tok ? tok : "");
    const char *h[] = {auth, NULL};
    bool post_like = strcmp(method, "POST") == 0;
    struct e2e_req rq = {.method = method,
                         .path = path,
                         .headers = tok ? h : NULL,
                         .body = post_like ? "" : NULL,
                         .body_len = 0,
                         .timeout_ms = 5000};
    e2e_http(g->admin_port, &rq, r);
}

/* True when the JSON text has "name": followed by the literal lit (e.g. "\"completed\"" or "200"). */
static bool json_has(const char *json, const char *name, const char *lit)
{
    char q[128];
    snprintf(q, sizeof q, "\"%s\"", name);
    for (const char *p = strstr(json, q); p != NULL; p = strstr(p + 1, q)) {
        const char *v = p + strlen(q);
        while (*v == ' ' || *v == '\n' || *v == '\t' || *v == '\r')
            v++;
        if (*v++ != ':')
            continue;
        while (*v == ' ' || *v == '\n' || *v == '\t' || *v == '\r')
            v++;
        if (strncmp(v, lit, strlen(lit)) == 0)
            return true;
    }
    return false;
}

/* ---- replay */

Test(idem, replay_is_byte_identical_and_marked)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\n", NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "replay");
    static const char *const extra[] = {"Content-Type: application/json", NULL};
    struct e2e_resp a, b;
    post(gw->port, "/v1/pay/charge?x=1", key, "{\"amount\":42}", extra, &a);
    cr_assert_eq(a.status, 200, "first request: %ld (%s) %.300s", a.status, a.error, (const char *)a.body);
    cr_expect_null(e2e_resp_header(&a, "Idempotent-Replayed"), "the first answer must not be marked as a replay");
    cr_expect_not_null(e2e_resp_header(&a, "X-Upstream-Exec"), "the first answer must be the upstream's");
    post(gw->port, "/v1/pay/charge?x=1", key, "{\"amount\":42}", extra, &b);
    cr_expect(e2e_resp_is_replay(&b), "the retry must carry Idempotent-Replayed: true (got %s)",
              e2e_resp_header(&b, "Idempotent-Replayed") ? e2e_resp_header(&b, "Idempotent-Replayed") : "none");
    cr_expect_eq(e2e_resp_header_count(&b, "Idempotent-Replayed"), 1, "one Idempotent-Replayed header");
    e2e_expect_same_answer(&a, &b, "replay");
    cr_expect_eq(e2e_resp_header_count(&b, "Set-Cookie"), 2, "the stored Set-Cookie headers must stay two");
    cr_expect_eq(e2e_upstream_count(up, key), 1, "two requests with one key must execute once");
    cr_expect_eq(e2e_upstream_count(up, NULL), 1);
    /* a third one, still the same */
    struct e2e_resp c;
    post(gw->port, "/v1/pay/charge?x=1", key, "{\"amount\":42}", extra, &c);
    cr_expect(e2e_resp_is_replay(&c));
    e2e_expect_same_answer(&a, &c, "second replay");
    if (a.nhdrs != b.nhdrs) {
        dump_headers(&a, "original");
        dump_headers(&b, "replay");
    }
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    e2e_resp_free(&c);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "three requests with one key must execute once");
}

Test(idem, binary_and_one_mib_responses_replay_byte_identical)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\nmax_body: 1MiB\n", NULL);

    /* a request body with NULs, echoed by the upstream */
    char key[96];
    e2e_mkkey(key, sizeof key, "bin");
    size_t n = 5000;
    unsigned char *blob = malloc(n);
    cr_assert_not_null(blob);
    for (size_t i = 0; i < n; i++)
        blob[i] = (i % 5 == 0) ? 0 : (unsigned char)(i * 131 + 7);
    char kh[160];
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    const char *h[] = {kh, "Content-Type: application/octet-stream", NULL};
    struct e2e_req rq = {.method = "POST", .path = "/v1/pay/bin", .headers = h, .body = blob, .body_len = n};
    struct e2e_resp a, b;
    e2e_http(gw->port, &rq, &a);
    cr_assert_eq(a.status, 200, "binary: %ld (%s)", a.status, a.error);
    cr_expect(a.body_len == n && memcmp(a.body, blob, n) == 0, "the first answer must echo the binary body");
    e2e_http(gw->port, &rq, &b);
    cr_expect(e2e_resp_is_replay(&b), "binary retry must be a replay");
    e2e_expect_same_answer(&a, &b, "binary replay");
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    free(blob);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "binary: one execution");

    /* a 1 MiB binary response */
    char key2[96];
    e2e_mkkey(key2, sizeof key2, "mib");
    static const char *const big[] = {"X-Test-Body-Size: 1048576", NULL};
    post(gw->port, "/v1/pay/big", key2, "{}", big, &a);
    cr_assert_eq(a.status, 200, "1 MiB: %ld (%s) %.200s", a.status, a.error, (const char *)a.body);
    cr_expect_eq(a.body_len, 1048576u);
    cr_expect_eq(e2e_upstream_body_mismatch(a.body, a.body_len), a.body_len, "1 MiB original differs at byte %zu",
                 e2e_upstream_body_mismatch(a.body, a.body_len));
    post(gw->port, "/v1/pay/big", key2, "{}", big, &b);
    cr_expect(e2e_resp_is_replay(&b), "1 MiB retry must be a replay (status %ld)", b.status);
    cr_expect_eq(b.body_len, 1048576u, "1 MiB replay length %zu", b.body_len);
    cr_expect_eq(e2e_upstream_body_mismatch(b.body, b.body_len), b.body_len, "1 MiB replay differs at byte %zu",
                 e2e_upstream_body_mismatch(b.body, b.body_len));
    e2e_expect_same_answer(&a, &b, "1 MiB replay");
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    cr_expect_eq(e2e_upstream_count(up, key2), 1, "1 MiB: one execution");
    cr_expect_eq(e2e_upstream_count(up, NULL), 2);
}

/* ---- concurrency */

Test(idem, fifty_concurrent_duplicates_execute_once)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\non_in_flight: conflict\nlease: 10s\n", NULL);
    enum { N = 50 };
    char key[96], kh[160];
    e2e_mkkey(key, sizeof key, "fifty");
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    const char *h[] = {kh, "X-Test-Delay-Ms: 300", NULL};
    struct e2e_req rq[N];
    struct e2e_resp out[N];
    for (int i = 0; i < N; i++)
        rq[i] = (struct e2e_req){.method = "POST",
                                 .path = "/v1/pay/fifty",
                                 .headers = h,
                                 .body = "same",
                                 .body_len = 4,
                                 .timeout_ms = 10000};
    e2e_http_parallel(gw->port, rq, out, N);
    int originals = 0, conflicts = 0, replays = 0, bad = 0;
    const struct e2e_resp *orig = NULL;
    for (int i = 0; i < N; i++) {
        if (out[i].status == 200 && !e2e_resp_is_replay(&out[i])) {
            originals++;
            orig = &out[i];
        } else if (out[i].status == 200) {
            replays++;
        } else if (out[i].status == 409 && e2e_resp_is_problem(&out[i], "idempotency-key-in-use") &&
                   e2e_resp_header(&out[i], "Retry-After") != NULL) {
            conflicts++;
        } else if (bad++ < 5) {
            cr_log_error("request %d: status %ld (%s) Retry-After %s body %.200s", i, out[i].status, out[i].error,
                         e2e_resp_header(&out[i], "Retry-After") ? e2e_resp_header(&out[i], "Retry-After") : "none",
                         (const char *)out[i].body);
        }
    }
    cr_expect_eq(originals, 1, "exactly one original answer expected, got %d (replays %d, 409 %d)", originals, replays,
                 conflicts);
    cr_expect_eq(bad, 0, "%d answers were neither the original, a replay nor a 409 in-use with Retry-After", bad);
    for (int i = 0; orig != NULL && i < N; i++)
        if (e2e_resp_is_replay(&out[i]))
            e2e_expect_same_answer(orig, &out[i], "concurrent replay");
    for (int i = 0; i < N; i++)
        e2e_resp_free(&out[i]);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "50 concurrent duplicates must execute once");
    cr_expect_eq(e2e_upstream_count(up, NULL), 1);
}

Test(idem, wait_mode_twenty_duplicates_get_the_same_answer)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\non_in_flight: wait\nwait: 5s\nlease: 10s\n", NULL);
    enum { N = 20 };
    char key[96], kh[160];
    e2e_mkkey(key, sizeof key, "wait");
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    const char *h[] = {kh, "X-Test-Delay-Ms: 500", NULL};
    struct e2e_req first = {
        .method = "POST", .path = "/v1/pay/wait", .headers = h, .body = "", .body_len = 0, .timeout_ms = 10000};
    struct e2e_async *fa = e2e_http_async(gw->port, &first);
    /* the first one claims the key; then 20 duplicates arrive while it runs */
    uint64_t deadline = e2e_now_ms() + 3000;
    while (e2e_upstream_count(up, key) == 0 && e2e_now_ms() < deadline)
        e2e_sleep_ms(10);
    cr_assert_eq(e2e_upstream_count(up, key), 1, "the first request did not reach the upstream");
    struct e2e_req rq[N];
    struct e2e_resp out[N];
    for (int i = 0; i < N; i++)
        rq[i] = first;
    e2e_http_parallel(gw->port, rq, out, N);
    struct e2e_resp orig;
    e2e_http_join(fa, &orig);
    cr_assert_eq(orig.status, 200, "first: %ld (%s)", orig.status, orig.error);
    cr_expect(!e2e_resp_is_replay(&orig), "the first answer is not a replay");
    int same = 0;
    for (int i = 0; i < N; i++) {
        cr_expect_eq(out[i].status, 200, "duplicate %d: %ld (%s) %.200s", i, out[i].status, out[i].error,
                     (const char *)out[i].body);
        cr_expect(e2e_resp_is_replay(&out[i]), "duplicate %d must be a replay", i);
        if (out[i].body_len == orig.body_len && memcmp(out[i].body, orig.body, orig.body_len) == 0)
            same++;
        else
            cr_log_error("duplicate %d body: %.200s (original %.200s)", i, (const char *)out[i].body,
                         (const char *)orig.body);
        e2e_resp_free(&out[i]);
    }
    cr_expect_eq(same, N, "%d of 20 duplicates got the original body", same);
    e2e_resp_free(&orig);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "21 requests with one key must execute once");
}

Test(idem, wait_that_expires_answers_409)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\non_in_flight: wait\nwait: 300ms\nlease: 10s\n", NULL);
    char key[96], kh[160];
    e2e_mkkey(key, sizeof key, "waitexp");
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    const char *h[] = {kh, "X-Test-Delay-Ms: 2000", NULL};
    struct e2e_req rq = {
        .method = "POST", .path = "/v1/pay/slow", .headers = h, .body = "x", .body_len = 1, .timeout_ms = 8000};
    struct e2e_async *fa = e2e_http_async(gw->port, &rq);
    uint64_t deadline = e2e_now_ms() + 3000;
    while (e2e_upstream_count(up, key) == 0 && e2e_now_ms() < deadline)
        e2e_sleep_ms(10);
    cr_assert_eq(e2e_upstream_count(up, key), 1, "the first request did not reach the upstream");
    struct e2e_resp r;
    e2e_http(gw->port, &rq, &r);
    e2e_expect_problem(&r, 409, "idempotency-key-in-use", "duplicate after wait: 300ms");
    cr_expect_not_null(e2e_resp_header(&r, "Retry-After"), "409 in-use must carry Retry-After");
    cr_expect(r.seconds >= 0.25 && r.seconds < 1.5, "the 409 must come after about the wait (300 ms), came after %.2fs",
              r.seconds);
    e2e_resp_free(&r);
    struct e2e_resp orig;
    e2e_http_join(fa, &orig);
    cr_expect_eq(orig.status, 200, "first: %ld (%s)", orig.status, orig.error);
    e2e_resp_free(&orig);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
}

/* ---- mismatches */

Test(idem, same_key_other_request_is_422)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\n", NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "mismatch");
    struct e2e_resp r;
    post(gw->port, "/v1/pay/a?x=1", key, "one", NULL, &r);
    cr_assert_eq(r.status, 200, "first: %ld (%s)", r.status, r.error);
    e2e_resp_free(&r);
    static const struct {
        const char *path, *body, *what;
    } cases[] = {
        {"/v1/pay/a?x=1", "two", "other body"},  {"/v1/pay/b?x=1", "one", "other path"},
        {"/v1/pay/a?x=2", "one", "other query"}, {"/v1/pay/a", "one", "no query"},
        {"/v1/pay/a?x=1", "", "empty body"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        post(gw->port, cases[i].path, key, cases[i].body, NULL, &r);
        e2e_expect_problem(&r, 422, "idempotency-key-mismatch", cases[i].what);
        cr_expect(!e2e_resp_is_replay(&r), "%s: a 422 is not a replay", cases[i].what);
        e2e_resp_free(&r);
    }
    /* PATCH (also idempotent by default) with the same path and body: the method is part of the fingerprint */
    e2e_http_key(gw->port, "PATCH", "/v1/pay/a?x=1", key, NULL, "one", 0, &r);
    e2e_expect_problem(&r, 422, "idempotency-key-mismatch", "other method");
    e2e_resp_free(&r);
    /* the original request still replays */
    post(gw->port, "/v1/pay/a?x=1", key, "one", NULL, &r);
    cr_expect_eq(r.status, 200, "status %ld (%s) %.300s", r.status, r.error, (const char *)r.body);
    cr_expect(e2e_resp_is_replay(&r), "the original request must still replay after 422s");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "mismatching retries must not execute");
    cr_expect_eq(e2e_upstream_count(up, NULL), 1);
}

/* ---- keys */

Test(idem, key_required_missing_and_invalid_are_400)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\n", NULL);
    struct e2e_resp r;
    post(gw->port, "/v1/pay/k", NULL, "{}", NULL, &r);
    e2e_expect_problem(&r, 400, "idempotency-key-missing", "no key");
    e2e_resp_free(&r);

    char k256[257], q255[258], qk256[259];
    memset(k256, 'k', 256);
    k256[256] = '\0';
    q255[0] = '"'; /* a quoted key of 255 bytes; made distinct below */
    memset(q255 + 1, 'q', 255);
    q255[256] = '"';
    q255[257] = '\0';
    qk256[0] = '"';
    memcpy(qk256 + 1, k256, 256);
    qk256[257] = '"';
    qk256[258] = '\0';
    static const char *const empty_hdr[] = {"Idempotency-Key;", NULL}; /* curl: a header with an empty value */
    struct {
        const char *key;
        const char *const *extra;
        const char *what;
    } bad[] = {
        {"\"\"", NULL, "empty sf-string"},
        {NULL, empty_hdr, "empty value"},
        {k256, NULL, "256 bytes"},
        {qk256, NULL, "256 bytes quoted"},
        {"a b", NULL, "space in a bare key"},
        {"a\x01z", NULL, "control character"},
        {"\"a\x01z\"", NULL, "control character quoted"},
        {"a\x7fz", NULL, "DEL"},
        {"a\tz", NULL, "tab in a bare key"},
        {"\"a\tz\"", NULL, "tab in a quoted key"},
        {"caf\xc3\xa9", NULL, "non-ASCII"},
        {"\"abc", NULL, "unterminated sf-string"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        post(gw->port, "/v1/pay/k", bad[i].key, "{}", bad[i].extra, &r);
        e2e_expect_problem(&r, 400, "idempotency-key-invalid", bad[i].what);
        e2e_resp_free(&r);
    }
    cr_expect_eq(e2e_upstream_count(up, NULL), 0, "rejected keys must not reach the upstream");

    /* the limits themselves pass: 255 bytes bare and quoted */
    char r255[300];
    char tag[40];
    e2e_mkkey(tag, sizeof tag, "k");
    memset(r255, 'x', 255);
    memcpy(r255, tag, strlen(tag));
    r255[255] = '\0';
    post(gw->port, "/v1/pay/k", r255, "{}", NULL, &r);
    cr_expect_eq(r.status, 200, "a 255-byte key is valid: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    memcpy(q255 + 1, tag, strlen(tag));
    post(gw->port, "/v1/pay/k", q255, "{}", NULL, &r);
    cr_expect_eq(r.status, 200, "a quoted 255-byte key is valid: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 2);

    /* "abc" and abc are the same key */
    char bare[96], quoted[100];
    e2e_mkkey(bare, sizeof bare, "quoted");
    snprintf(quoted, sizeof quoted, "\"%s\"", bare);
    struct e2e_resp a, b;
    post(gw->port, "/v1/pay/q", quoted, "{\"q\":1}", NULL, &a);
    cr_expect_eq(a.status, 200, "quoted key: %ld %.200s", a.status, (const char *)a.body);
    cr_expect(!e2e_resp_is_replay(&a));
    post(gw->port, "/v1/pay/q", bare, "{\"q\":1}", NULL, &b);
    cr_expect_eq(b.status, 200, "bare key: %ld %.200s", b.status, (const char *)b.body);
    cr_expect(e2e_resp_is_replay(&b), "\"K\" then K must replay: they are the same key");
    e2e_expect_same_answer(&a, &b, "quoted/bare");
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    /* and the other way round, with surrounding spaces (OWS) */
    char bare2[96], quoted2[110];
    e2e_mkkey(bare2, sizeof bare2, "quoted2");
    snprintf(quoted2, sizeof quoted2, "\"%s\"  ", bare2);
    post(gw->port, "/v1/pay/q", bare2, "{\"q\":2}", NULL, &a);
    cr_expect_eq(a.status, 200, "status %ld (%s) %.300s", a.status, a.error, (const char *)a.body);
    post(gw->port, "/v1/pay/q", quoted2, "{\"q\":2}", NULL, &b);
    cr_expect(e2e_resp_is_replay(&b), "K then \"K\" must replay");
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    cr_expect_eq(e2e_upstream_count(up, NULL), 4, "each quoted/bare pair must execute once");
}

Test(idem, key_optional_without_key_is_plain_proxying)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: optional\n", NULL);
    struct e2e_resp a, b;
    post(gw->port, "/v1/pay/nokey", NULL, "same", NULL, &a);
    post(gw->port, "/v1/pay/nokey", NULL, "same", NULL, &b);
    cr_expect_eq(a.status, 200, "%ld (%s)", a.status, a.error);
    cr_expect_eq(b.status, 200, "%ld (%s)", b.status, b.error);
    cr_expect(!e2e_resp_is_replay(&a) && !e2e_resp_is_replay(&b), "without a key nothing is replayed");
    const char *ea = e2e_resp_header(&a, "X-Upstream-Exec"), *eb = e2e_resp_header(&b, "X-Upstream-Exec");
    cr_expect(ea && eb && strcmp(ea, eb) != 0, "two executions expected (X-Upstream-Exec %s, %s)", ea ? ea : "-",
              eb ? eb : "-");
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    cr_expect_eq(e2e_upstream_count(up, NULL), 2, "without a key every request is forwarded");
    /* with a key on the same route it is deduplicated */
    char key[96];
    e2e_mkkey(key, sizeof key, "opt");
    post(gw->port, "/v1/pay/nokey", key, "same", NULL, &a);
    post(gw->port, "/v1/pay/nokey", key, "same", NULL, &b);
    cr_expect(!e2e_resp_is_replay(&a) && e2e_resp_is_replay(&b), "key: optional with a key must deduplicate");
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    cr_expect_eq(e2e_upstream_count(up, NULL), 3);
}

Test(idem, other_methods_pass_through_without_dedup)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\n", NULL); /* methods default: POST, PATCH */
    char key[96];
    e2e_mkkey(key, sizeof key, "get");
    struct e2e_resp a, b;
    e2e_http_key(gw->port, "GET", "/v1/pay/get", key, NULL, NULL, 0, &a);
    e2e_http_key(gw->port, "GET", "/v1/pay/get", key, NULL, NULL, 0, &b);
    cr_expect_eq(a.status, 200, "GET with a key: %ld %.200s", a.status, (const char *)a.body);
    cr_expect_eq(b.status, 200, "GET with a key: %ld %.200s", b.status, (const char *)b.body);
    cr_expect(!e2e_resp_is_replay(&a) && !e2e_resp_is_replay(&b), "GET must not be replayed");
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    /* GET without a key on a key: required route passes too (the key only applies to POST/PATCH) */
    e2e_http_key(gw->port, "GET", "/v1/pay/get", NULL, NULL, NULL, 0, &a);
    cr_expect_eq(a.status, 200, "GET without a key: %ld %.200s", a.status, (const char *)a.body);
    e2e_resp_free(&a);
    e2e_http_key(gw->port, "PUT", "/v1/pay/put", key, NULL, "p", 0, &a);
    e2e_http_key(gw->port, "PUT", "/v1/pay/put", key, NULL, "p", 0, &b);
    cr_expect(a.status == 200 && b.status == 200 && !e2e_resp_is_replay(&b), "PUT is not in methods: passes through");
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    cr_expect_eq(e2e_upstream_count(up, key), 4, "GET and PUT with a key: every request executes");
    cr_expect_eq(e2e_upstream_count(up, NULL), 5);
}

/* ---- unknown outcomes */

/* A keep-alive connection to the upstream, so a later drop happens on a reused one (libcurl's silent resend). */
static void warm(const struct e2e_gw *gw)
{
    struct e2e_resp r;
    e2e_get(gw->port, "/v1/pay/warm", &r);
    cr_assert_eq(r.status, 200, "warm-up GET: %ld (%s)", r.status, r.error);
    e2e_resp_free(&r);
}

Test(idem, lost_response_is_unknown_until_released)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    static const char *const env[] = {"IDEMGATE_ADMIN_TOKEN=" ADMIN_TOKEN, NULL};
    struct e2e_gw *gw = gw_start(up, "key: required\nlease: 1s\non_unknown: reject\n", env);
    warm(gw);
    char key[96];
    e2e_mkkey(key, sizeof key, "lost");
    static const char *const drop[] = {"X-Test-Action: close", NULL};
    struct e2e_resp r;
    post(gw->port, "/v1/pay/lost", key, "{\"n\":1}", drop, &r);
    e2e_expect_problem(&r, 502, "upstream-no-response", "upstream closed after executing");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "the dropped request executed once (no silent resend)");

    /* within the lease: in use */
    post(gw->port, "/v1/pay/lost", key, "{\"n\":1}", NULL, &r);
    e2e_expect_problem(&r, 409, "idempotency-key-in-use", "retry of an unknown outcome within the lease");
    cr_expect_not_null(e2e_resp_header(&r, "Retry-After"), "409 in-use must carry Retry-After");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);

    /* after the lease: outcome unknown, and it stays so */
    e2e_sleep_ms(1400);
    for (int i = 0; i < 2; i++) {
        post(gw->port, "/v1/pay/lost", key, "{\"n\":1}", NULL, &r);
        e2e_expect_problem(&r, 409, "idempotency-outcome-unknown", "retry of an unknown outcome after the lease");
        e2e_resp_free(&r);
    }
    cr_expect_eq(e2e_upstream_count(up, key), 1, "an unknown outcome must not be executed again without an operator");

    /* the operator releases it */
    admin(gw, "POST", "keys/release", key, ADMIN_TOKEN, &r);
    cr_expect_eq(r.status, 200, "release: %ld %.300s", r.status, (const char *)r.body);
    cr_expect(json_has((const char *)r.body, "released", "1"), "release answer: %.300s", (const char *)r.body);
    e2e_resp_free(&r);
    struct e2e_resp a, b;
    post(gw->port, "/v1/pay/lost", key, "{\"n\":1}", NULL, &a);
    cr_expect_eq(a.status, 200, "after release the retry executes: %ld %.300s", a.status, (const char *)a.body);
    cr_expect(!e2e_resp_is_replay(&a));
    cr_expect_eq(e2e_upstream_count(up, key), 2, "after release: exactly one more execution");
    post(gw->port, "/v1/pay/lost", key, "{\"n\":1}", NULL, &b);
    cr_expect(e2e_resp_is_replay(&b), "after the released retry completed, retries replay");
    e2e_expect_same_answer(&a, &b, "replay after release");
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    cr_expect_eq(e2e_upstream_count(up, key), 2);
}

Test(idem, on_unknown_retry_executes_again_after_the_lease)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\nlease: 1s\non_unknown: retry\n", NULL);
    warm(gw);
    char key[96];
    e2e_mkkey(key, sizeof key, "retry");
    static const char *const drop[] = {"X-Test-Action: reset", NULL};
    struct e2e_resp r;
    post(gw->port, "/v1/pay/retry", key, "{\"n\":2}", drop, &r);
    e2e_expect_problem(&r, 502, "upstream-no-response", "upstream reset after executing");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    post(gw->port, "/v1/pay/retry", key, "{\"n\":2}", NULL, &r);
    e2e_expect_problem(&r, 409, "idempotency-key-in-use", "retry within the lease");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "no execution within the lease");
    e2e_sleep_ms(1400);
    struct e2e_resp a, b;
    post(gw->port, "/v1/pay/retry", key, "{\"n\":2}", NULL, &a);
    cr_expect_eq(a.status, 200, "retry after the lease (on_unknown: retry): %ld %.300s", a.status,
                 (const char *)a.body);
    cr_expect(!e2e_resp_is_replay(&a));
    cr_expect_eq(e2e_upstream_count(up, key), 2, "on_unknown: retry executes once more");
    post(gw->port, "/v1/pay/retry", key, "{\"n\":2}", NULL, &b);
    cr_expect(e2e_resp_is_replay(&b), "a further retry replays the completed one (status %ld)", b.status);
    e2e_expect_same_answer(&a, &b, "replay after takeover");
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    cr_expect_eq(e2e_upstream_count(up, key), 2);
}

Test(idem, upstream_timeout_keeps_the_record)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf c = {.idem = "key: required\nlease: 10s\n", .timeout = "500ms"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &c, NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "timeout");
    static const char *const slow[] = {"X-Test-Delay-Ms: 2000", NULL};
    struct e2e_resp r;
    post(gw->port, "/v1/pay/slow", key, "{\"t\":1}", slow, &r);
    e2e_expect_problem(&r, 504, "upstream-timeout", "upstream slower than timeout");
    cr_expect(r.seconds >= 0.4 && r.seconds < 1.9, "504 after about 500 ms, came after %.2fs", r.seconds);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    post(gw->port, "/v1/pay/slow", key, "{\"t\":1}", NULL, &r);
    e2e_expect_problem(&r, 409, "idempotency-key-in-use", "retry after a timeout (unknown outcome, within the lease)");
    e2e_resp_free(&r);
    e2e_sleep_ms(1800); /* the upstream has finished the first call by now */
    post(gw->port, "/v1/pay/slow", key, "{\"t\":1}", NULL, &r);
    e2e_expect_problem(&r, 409, "idempotency-key-in-use", "retry after the upstream finished");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "a timeout after sending must not release the key");
}

Test(idem, release_status_releases_the_key)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\nrelease_statuses: [503]\n", NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "release");
    static const char *const busy[] = {"X-Test-Status: 503", NULL};
    struct e2e_resp r;
    post(gw->port, "/v1/pay/rel", key, "{\"r\":1}", busy, &r);
    cr_expect_eq(r.status, 503, "the upstream's 503 reaches the client: %ld", r.status);
    cr_expect_not_null(e2e_resp_header(&r, "X-Upstream-Exec"), "the 503 must be the upstream's own answer");
    cr_expect(!e2e_resp_is_problem(&r, "store-unavailable"));
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    struct e2e_resp a, b;
    post(gw->port, "/v1/pay/rel", key, "{\"r\":1}", NULL, &a);
    cr_expect_eq(a.status, 200, "retry after a release status executes: %ld %.300s", a.status, (const char *)a.body);
    cr_expect(!e2e_resp_is_replay(&a), "the 503 must not have been stored");
    cr_expect_eq(e2e_upstream_count(up, key), 2, "retry after a release status executes again");
    post(gw->port, "/v1/pay/rel", key, "{\"r\":1}", NULL, &b);
    cr_expect(e2e_resp_is_replay(&b));
    e2e_expect_same_answer(&a, &b, "replay after release status");
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    cr_expect_eq(e2e_upstream_count(up, key), 2);

    /* a status not listed (500) is stored and replayed */
    char key2[96];
    e2e_mkkey(key2, sizeof key2, "norelease");
    static const char *const err500[] = {"X-Test-Status: 500", NULL};
    post(gw->port, "/v1/pay/rel", key2, "{\"r\":2}", err500, &a);
    cr_expect_eq(a.status, 500);
    post(gw->port, "/v1/pay/rel", key2, "{\"r\":2}", NULL, &b);
    cr_expect(b.status == 500 && e2e_resp_is_replay(&b), "a 500 not in release_statuses is replayed (got %ld)",
              b.status);
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    cr_expect_eq(e2e_upstream_count(up, key2), 1);
}

Test(idem, connect_failure_releases_the_key)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    /* gateway A: the upstream's URL is a dead port */
    struct e2e_pay_conf c = {.idem = "key: required\nlease: 30s\n", .upstream_url = "http://127.0.0.1:{{DEAD_PORT}}"};
    struct e2e_gw *dead = e2e_gw_start_pay(up, &c, NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "connfail");
    struct e2e_resp r;
    post(dead->port, "/v1/pay/c", key, "{\"c\":1}", NULL, &r);
    e2e_expect_problem(&r, 502, "upstream-unavailable", "dead upstream");
    e2e_resp_free(&r);
    post(dead->port, "/v1/pay/c", key, "{\"c\":1}", NULL, &r);
    e2e_expect_problem(&r, 502, "upstream-unavailable", "dead upstream, retry (the key was released, not in use)");
    e2e_resp_free(&r);
    /* gateway B: same database, same route name, a live upstream */
    struct e2e_gw *live = gw_start(up, "key: required\nlease: 30s\n", NULL);
    post(live->port, "/v1/pay/c", key, "{\"c\":1}", NULL, &r);
    cr_expect_eq(r.status, 200, "after a connect failure the key must be free: %ld %.300s", r.status,
                 (const char *)r.body);
    cr_expect(!e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    /* and gateway A now replays it from the shared store */
    post(dead->port, "/v1/pay/c", key, "{\"c\":1}", NULL, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "the other instance replays the completed record (got %ld)",
              r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
}

Test(idem, record_older_than_retention_is_new)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\nretention: 1s\n", NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "retention");
    struct e2e_resp r;
    post(gw->port, "/v1/pay/ret", key, "{\"e\":1}", NULL, &r);
    cr_expect_eq(r.status, 200, "status %ld (%s) %.300s", r.status, r.error, (const char *)r.body);
    cr_expect(!e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay/ret", key, "{\"e\":1}", NULL, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "within retention: replay");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    e2e_sleep_ms(1500);
    post(gw->port, "/v1/pay/ret", key, "{\"e\":1}", NULL, &r);
    cr_expect_eq(r.status, 200, "status %ld (%s) %.300s", r.status, r.error, (const char *)r.body);
    cr_expect(!e2e_resp_is_replay(&r), "after retention the key is new");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2, "after retention the request executes again");
    /* a request with another fingerprint after retention is new too, not a 422 */
    e2e_sleep_ms(1500);
    post(gw->port, "/v1/pay/ret", key, "{\"e\":2}", NULL, &r);
    cr_expect_eq(r.status, 200, "other body after retention: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 3);
}

/* ---- scope, forwarding */

Test(idem, tenants_are_isolated_by_scope)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\nscope: [header:Authorization]\n", NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "tenant");
    static const char *const ta[] = {"Authorization: Bearer tenant-a", NULL};
    static const char *const tb[] = {"Authorization: Bearer tenant-b", NULL};
    struct e2e_resp a1, b1, a2, b2;
    post(gw->port, "/v1/pay/t", key, "{\"same\":1}", ta, &a1);
    post(gw->port, "/v1/pay/t", key, "{\"same\":1}", tb, &b1);
    cr_expect_eq(a1.status, 200);
    cr_expect_eq(b1.status, 200);
    cr_expect(!e2e_resp_is_replay(&a1) && !e2e_resp_is_replay(&b1), "a tenant must never get another tenant's replay");
    const char *ea = e2e_resp_header(&a1, "X-Upstream-Exec"), *eb = e2e_resp_header(&b1, "X-Upstream-Exec");
    cr_expect(ea && eb && strcmp(ea, eb) != 0, "each tenant executes (X-Upstream-Exec %s / %s)", ea ? ea : "-",
              eb ? eb : "-");
    cr_expect_eq(e2e_upstream_count(up, key), 2, "same key in two tenants: two executions");
    post(gw->port, "/v1/pay/t", key, "{\"same\":1}", tb, &b2);
    post(gw->port, "/v1/pay/t", key, "{\"same\":1}", ta, &a2);
    cr_expect(e2e_resp_is_replay(&a2) && e2e_resp_is_replay(&b2), "each tenant's retry replays");
    e2e_expect_same_answer(&a1, &a2, "tenant A replay");
    e2e_expect_same_answer(&b1, &b2, "tenant B replay");
    const char *ea2 = e2e_resp_header(&a2, "X-Upstream-Exec"), *eb2 = e2e_resp_header(&b2, "X-Upstream-Exec");
    cr_expect(ea && ea2 && strcmp(ea, ea2) == 0, "tenant A got execution %s, replay says %s", ea ? ea : "-",
              ea2 ? ea2 : "-");
    cr_expect(eb && eb2 && strcmp(eb, eb2) == 0, "tenant B got execution %s, replay says %s", eb ? eb : "-",
              eb2 ? eb2 : "-");
    e2e_resp_free(&a1);
    e2e_resp_free(&b1);
    e2e_resp_free(&a2);
    e2e_resp_free(&b2);
    /* no Authorization at all is a third scope */
    struct e2e_resp n1;
    post(gw->port, "/v1/pay/t", key, "{\"same\":1}", NULL, &n1);
    cr_expect(n1.status == 200 && !e2e_resp_is_replay(&n1), "no Authorization is its own scope");
    e2e_resp_free(&n1);
    cr_expect_eq(e2e_upstream_count(up, key), 3);
}

Test(idem, forward_key_false_hides_the_key_from_the_upstream)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\nforward_key: false\n", NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "nofwd");
    struct e2e_resp r;
    post(gw->port, "/v1/pay/f", key, "{\"f\":1}", NULL, &r);
    cr_expect_eq(r.status, 200, "status %ld (%s) %.300s", r.status, r.error, (const char *)r.body);
    e2e_resp_free(&r);
    char *text = e2e_upstream_last_headers(up);
    struct e2e_hdr *hd;
    size_t n = e2e_parse_header_lines(text, &hd);
    cr_expect_null(e2e_hdrs_get(hd, n, "Idempotency-Key"), "forward_key: false, yet the upstream saw the key:\n%s",
                   text);
    e2e_hdrs_free(hd, n);
    free(text);
    post(gw->port, "/v1/pay/f", key, "{\"f\":1}", NULL, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "deduplication still applies");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "one execution");
    cr_expect_eq(e2e_upstream_count(up, key), 0, "the upstream never saw the key");

    /* with the default (forward_key: true) the upstream sees it */
    struct e2e_gw *gw2 = gw_start(up, "key: required\n", NULL);
    char key2[96];
    e2e_mkkey(key2, sizeof key2, "fwd");
    post(gw2->port, "/v1/pay/f", key2, "{\"f\":1}", NULL, &r);
    cr_expect_eq(r.status, 200, "status %ld (%s) %.300s", r.status, r.error, (const char *)r.body);
    e2e_resp_free(&r);
    text = e2e_upstream_last_headers(up);
    n = e2e_parse_header_lines(text, &hd);
    const char *seen = e2e_hdrs_get(hd, n, "Idempotency-Key");
    cr_expect(seen != NULL && strcmp(seen, key2) == 0, "forward_key default: the upstream must see the key:\n%s", text);
    e2e_hdrs_free(hd, n);
    free(text);
    cr_expect_eq(e2e_upstream_count(up, key2), 1);
}

/* ---- admin and metrics */

Test(idem, admin_lists_purges_and_needs_the_token)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    static const char *const env[] = {"IDEMGATE_ADMIN_TOKEN=" ADMIN_TOKEN, NULL};
    struct e2e_gw *gw = gw_start(up, "key: required\n", env);
    char key[96];
    e2e_mkkey(key, sizeof key, "admin");
    struct e2e_resp r;
    post(gw->port, "/v1/pay/adm", key, "secret-body-marker", NULL, &r);
    cr_assert_eq(r.status, 200, "status %ld (%s) %.300s", r.status, r.error, (const char *)r.body);
    e2e_resp_free(&r);

    admin(gw, "GET", "keys", key, ADMIN_TOKEN, &r);
    cr_expect_eq(r.status, 200, "GET /admin/keys: %ld %.300s", r.status, (const char *)r.body);
    const char *j = (const char *)r.body;
    const char *ct = e2e_resp_header(&r, "Content-Type");
    cr_expect(ct != NULL && strstr(ct, "json") != NULL, "Content-Type %s", ct ? ct : "(none)");
    char qkey[128];
    snprintf(qkey, sizeof qkey, "\"%s\"", key);
    cr_expect(j[strspn(j, " \t\r\n")] == '[', "a JSON array expected: %.300s", j);
    cr_expect(json_has(j, "route", "\"pay\""), "route: %.500s", j);
    cr_expect(json_has(j, "key", qkey), "key: %.500s", j);
    cr_expect(json_has(j, "state", "\"completed\""), "state completed: %.500s", j);
    cr_expect(json_has(j, "status", "200"), "status 200: %.500s", j);
    cr_expect(strstr(j, "\"created_at\"") != NULL && strstr(j, "\"expires_at\"") != NULL, "timestamps: %.500s", j);
    cr_expect(strstr(j, "secret-body-marker") == NULL && strstr(j, "\"body\"") == NULL,
              "the listing must not carry the body: %.500s", j);
    e2e_resp_free(&r);

    /* unauthorized */
    admin(gw, "GET", "keys", key, NULL, &r);
    cr_expect_eq(r.status, 401, "no token: %ld", r.status);
    e2e_resp_free(&r);
    admin(gw, "GET", "keys", key, "wrong-token", &r);
    cr_expect_eq(r.status, 401, "wrong token: %ld", r.status);
    e2e_resp_free(&r);
    admin(gw, "DELETE", "keys", key, "wrong-token", &r);
    cr_expect_eq(r.status, 401, "DELETE with a wrong token: %ld", r.status);
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay/adm", key, "secret-body-marker", NULL, &r);
    cr_expect(e2e_resp_is_replay(&r), "an unauthorized DELETE must not purge");
    e2e_resp_free(&r);

    /* purge */
    admin(gw, "DELETE", "keys", key, ADMIN_TOKEN, &r);
    cr_expect_eq(r.status, 200, "DELETE /admin/keys: %ld %.300s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    admin(gw, "GET", "keys", key, ADMIN_TOKEN, &r);
    cr_expect_eq(r.status, 200, "status %ld (%s) %.300s", r.status, r.error, (const char *)r.body);
    cr_expect(strstr((const char *)r.body, qkey) == NULL, "purged, yet listed: %.300s", (const char *)r.body);
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay/adm", key, "secret-body-marker", NULL, &r);
    cr_expect_eq(r.status, 200, "status %ld (%s) %.300s", r.status, r.error, (const char *)r.body);
    cr_expect(!e2e_resp_is_replay(&r), "after a purge the key is new");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2, "after a purge the request executes again");

    /* a gateway without IDEMGATE_ADMIN_TOKEN: 404 even with a token */
    struct e2e_gw *gw2 = gw_start(up, "key: required\n", NULL);
    admin(gw2, "GET", "keys", key, ADMIN_TOKEN, &r);
    cr_expect_eq(r.status, 404, "admin key endpoints without IDEMGATE_ADMIN_TOKEN: %ld", r.status);
    e2e_resp_free(&r);
    admin(gw2, "DELETE", "keys", key, NULL, &r);
    cr_expect_eq(r.status, 404, "DELETE without IDEMGATE_ADMIN_TOKEN: %ld", r.status);
    e2e_resp_free(&r);
    post(gw2->port, "/v1/pay/adm", key, "secret-body-marker", NULL, &r);
    cr_expect(e2e_resp_is_replay(&r), "the record is still there");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2);
}

Test(idem, metrics_count_replays_and_conflicts)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\n", NULL);
    char key[96];
    e2e_mkkey(key, sizeof key, "metrics");
    struct e2e_resp r;
    post(gw->port, "/v1/pay/m", key, "{\"m\":1}", NULL, &r);
    cr_expect_eq(r.status, 200, "status %ld (%s) %.300s", r.status, r.error, (const char *)r.body);
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay/m", key, "{\"m\":1}", NULL, &r);
    cr_expect(e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay/m", key, "{\"m\":2}", NULL, &r);
    e2e_expect_problem(&r, 422, "idempotency-key-mismatch", "other body");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);

    e2e_get(gw->admin_port, "/metrics", &r);
    cr_assert_eq(r.status, 200, "status %ld (%s) %.300s", r.status, r.error, (const char *)r.body);
    const char *m = (const char *)r.body;
    static const char *const route[] = {"route=\"pay\"", NULL};
    static const char *const replayed[] = {"route=\"pay\"", "outcome=\"replayed\"", NULL};
    static const char *const forwarded[] = {"route=\"pay\"", "outcome=\"forwarded\"", NULL};
    cr_expect(e2e_metric_value(m, "idemgate_dedup_hits_total", route) >= 1,
              "dedup_hits_total{route=\"pay\"} >= 1:\n%.3000s", m);
    cr_expect(e2e_metric_value(m, "idemgate_parameter_conflicts_total", route) >= 1,
              "parameter_conflicts_total{route=\"pay\"} >= 1:\n%.3000s", m);
    cr_expect(e2e_metric_value(m, "idemgate_requests_total", replayed) >= 1,
              "requests_total{route=\"pay\",outcome=\"replayed\"} >= 1:\n%.3000s", m);
    cr_expect(e2e_metric_value(m, "idemgate_requests_total", forwarded) >= 1,
              "requests_total{route=\"pay\",outcome=\"forwarded\"} >= 1:\n%.3000s", m);
    e2e_resp_free(&r);
}
