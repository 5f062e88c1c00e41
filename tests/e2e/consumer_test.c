/* consumer_test.c - end-to-end tests of an at-least-once message consumer behind the gateway (SPEC 12): business keys
 * from the body, form and query (key_from), fingerprints of JSON parts (RFC 8785), and the ordering guard on body
 * values; the real idemgate, test upstream, Postgres and Redis. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

TestSuite(consumer, .init = e2e_setup, .fini = e2e_teardown, .timeout = 120);

#define ADMIN_TOKEN "e2e-consumer-admin-token-41c9"

/* A message-push endpoint (/v1/messages): the key is the body's order_no, the intent its aggregate, version and
 * data (never the delivery metadata), ordered per aggregate_id by aggregate_version with gaps held; a form route
 * and a query route. */
static const char CONF[] = E2E_CONF_HEAD "upstreams:\n" E2E_CONF_UPSTREAM(
    "api", "{{UPSTREAM_URL}}", "5s") "routes:\n"
                                     "  - name: msg\n"
                                     "    match:\n"
                                     "      path_prefix: /v1/messages\n"
                                     "    upstream: api\n"
                                     "    idempotency:\n"
                                     "      key: required\n"
                                     "      key_from: json:/order_no\n"
                                     "      fingerprint: [json:/aggregate_id, json:/aggregate_version, json:/data]\n"
                                     "      lease: 5s\n"
                                     "    ordering:\n"
                                     "      resource: json:/aggregate_id\n"
                                     "      sequence: json:/aggregate_version\n"
                                     "      on_gap: hold\n"
                                     "      hold: 4s\n"
                                     "  - name: form\n"
                                     "    match:\n"
                                     "      path_prefix: /v1/form\n"
                                     "    upstream: api\n"
                                     "    idempotency:\n"
                                     "      key: required\n"
                                     "      key_from: form:event_id\n"
                                     "      fingerprint: [form:amount]\n"
                                     "  - name: q\n"
                                     "    match:\n"
                                     "      path_prefix: /v1/q\n"
                                     "    upstream: api\n"
                                     "    idempotency:\n"
                                     "      key: optional\n"
                                     "      key_from: query:msg\n"
                                     "      fingerprint: [query:amount]\n";

static struct e2e_gw *start(const struct e2e_upstream *up)
{
    static const char *const env[] = {"IDEMGATE_ADMIN_TOKEN=" ADMIN_TOKEN, NULL};
    struct e2e_gw_opts o = {.up = up, .env = env, .wait_ready = true};
    return e2e_gw_start(CONF, &o);
}

/* A message as a broker would deliver it: attempt and sent_at are delivery metadata. */
static char *message(const char *order, const char *agg, long version, const char *data, int attempt)
{
    char *s = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&s, &n);
    fprintf(f,
            "{\"order_no\":\"%s\",\"aggregate_id\":\"%s\",\"aggregate_version\":%ld,\"data\":%s,"
            "\"delivery\":{\"attempt\":%d,\"sent_at\":\"2026-12-03T10:00:%02dZ\"}}",
            order, agg, version, data, attempt, attempt % 60);
    fclose(f);
    return s;
}

static void push(uint16_t port, const char *body, const char *extra, struct e2e_resp *r)
{
    const char *h[] = {"Content-Type: application/json", extra, NULL};
    e2e_http(port,
             &(struct e2e_req){
                 .method = "POST", .path = "/v1/messages", .headers = h, .body = body, .body_len = strlen(body)},
             r);
}

/* GET /admin/keys?route=ROUTE&key=KEY (KEY as written in the query) finds a completed record. */
static void expect_admin_completed(const struct e2e_gw *gw, const char *route, const char *key)
{
    char path[512];
    snprintf(path, sizeof path, "/admin/keys?route=%s&key=%s", route, key);
    const char *const h[] = {"Authorization: Bearer " ADMIN_TOKEN, NULL};
    struct e2e_resp r;
    e2e_http(gw->admin_port, &(struct e2e_req){.path = path, .headers = h}, &r);
    cr_expect_eq(r.status, 200, "%s: %ld %s", path, r.status, r.body ? (const char *)r.body : "");
    cr_expect(r.body && strstr((const char *)r.body, "completed"), "completed: %s", r.body ? (char *)r.body : "");
    e2e_resp_free(&r);
}

Test(consumer, a_dead_letter_replay_of_an_old_message_is_a_replay)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up);
    char order[96], agg[96];
    e2e_mkkey(order, sizeof order, "ord");
    e2e_mkkey(agg, sizeof agg, "agg");
    char *first = message(order, agg, 1, "{\"amount\":1000,\"currency\":\"EUR\"}", 1);
    struct e2e_resp r;
    push(gw->port, first, NULL, &r);
    cr_expect_eq(r.status, 200, "first delivery: %ld %s", r.status, r.body ? (const char *)r.body : "");
    cr_expect(!e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    /* replayed from the dead-letter queue hours later: other delivery metadata, members in another order, other
     * whitespace and escapes, the same intent */
    char dlq[1024];
    snprintf(dlq, sizeof dlq,
             "{ \"delivery\": {\"sent_at\": \"2026-12-03T14:31:07Z\", \"attempt\": 9, \"dead_lettered\": true},\n"
             "  \"data\": {\"currency\": \"\\u0045UR\", \"amount\": 1000.0},\n"
             "  \"aggregate_version\": 1, \"aggregate_id\": \"%s\", \"order_no\": \"%s\" }",
             agg, order);
    push(gw->port, dlq, NULL, &r);
    cr_expect_eq(r.status, 200, "dead-letter replay: %ld %s", r.status, r.body ? (const char *)r.body : "");
    cr_expect(e2e_resp_is_replay(&r), "the dead-letter replay is answered from the record");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "executed once");
    /* the same order number with other data is another intent: 422, nothing executed */
    char *other = message(order, agg, 1, "{\"amount\":2000,\"currency\":\"EUR\"}", 2);
    push(gw->port, other, NULL, &r);
    e2e_expect_problem(&r, 422, "idempotency-key-mismatch", "same order_no, other data");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "still executed once");
    /* the admin API finds the record by the same key text */
    expect_admin_completed(gw, "msg", order);
    free(first);
    free(other);
}

Test(consumer, a_concurrent_compensation_never_executes_twice)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up);
    char order[96], agg[96];
    e2e_mkkey(order, sizeof order, "ord");
    e2e_mkkey(agg, sizeof agg, "agg");
    char *orig = message(order, agg, 1, "{\"refund\":5}", 1);
    char *comp = message(order, agg, 1, "{\"refund\":5}", 3); /* the compensation task's own delivery */
    const char *h1[] = {"Content-Type: application/json", "X-Test-Delay-Ms: 800", NULL};
    const char *h2[] = {"Content-Type: application/json", NULL};
    struct e2e_async *a = e2e_http_async(
        gw->port, &(struct e2e_req){
                      .method = "POST", .path = "/v1/messages", .headers = h1, .body = orig, .body_len = strlen(orig)});
    cr_assert_eq(e2e_upstream_wait_count(up, NULL, 1, 3000), 1, "the original is at the upstream");
    struct e2e_resp r2, r1;
    e2e_http(gw->port,
             &(struct e2e_req){
                 .method = "POST", .path = "/v1/messages", .headers = h2, .body = comp, .body_len = strlen(comp)},
             &r2);
    e2e_http_join(a, &r1);
    cr_expect_eq(r1.status, 200, "original: %ld", r1.status);
    cr_expect(r2.status == 409 || (r2.status == 200 && e2e_resp_is_replay(&r2)),
              "the compensation is 409 or a replay: %ld %s", r2.status, r2.body ? (const char *)r2.body : "");
    if (r2.status == 409)
        e2e_expect_problem(&r2, 409, "idempotency-key-in-use", "compensation while in flight");
    e2e_resp_free(&r1);
    e2e_resp_free(&r2);
    e2e_sleep_ms(200);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "executed once");
    free(orig);
    free(comp);
}

Test(consumer, a_stale_version_is_refused_and_a_gap_is_held_then_applied_in_order)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up);
    char agg[96], o[4][96];
    e2e_mkkey(agg, sizeof agg, "agg");
    for (int i = 0; i < 4; i++)
        e2e_mkkey(o[i], sizeof o[i], "ord");
    struct e2e_resp r;
    char *m12 = message(o[0], agg, 12, "{\"v\":12}", 1);
    push(gw->port, m12, NULL, &r);
    cr_expect_eq(r.status, 200, "v12: %ld %s", r.status, r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
    /* version 11 after 12: stale, never forwarded */
    char *m11 = message(o[1], agg, 11, "{\"v\":11}", 1);
    push(gw->port, m11, NULL, &r);
    e2e_expect_problem(&r, 409, "stale-sequence", "v11 after v12");
    cr_expect(r.body && strstr((const char *)r.body, "\"current\":12"), "current 12: %s",
              r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "v11 not forwarded");
    /* 14 before 13: held; 13 comes, is applied, then 14 */
    char *m14 = message(o[3], agg, 14, "{\"v\":14}", 1);
    const char *h[] = {"Content-Type: application/json", NULL};
    struct e2e_async *a = e2e_http_async(gw->port, &(struct e2e_req){.method = "POST",
                                                                     .path = "/v1/messages",
                                                                     .headers = h,
                                                                     .body = m14,
                                                                     .body_len = strlen(m14),
                                                                     .timeout_ms = 10000});
    e2e_sleep_ms(500);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "v14 is held while 13 is missing");
    char *m13 = message(o[2], agg, 13, "{\"v\":13}", 1);
    push(gw->port, m13, NULL, &r);
    cr_expect_eq(r.status, 200, "v13: %ld %s", r.status, r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
    struct e2e_resp r14;
    e2e_http_join(a, &r14);
    cr_expect_eq(r14.status, 200, "v14 after v13: %ld %s", r14.status, r14.body ? (const char *)r14.body : "");
    cr_expect_eq(e2e_upstream_count(up, NULL), 3, "12, 13, 14 executed");
    char *last = e2e_upstream_last_headers(up);
    cr_expect(last != NULL, "last execution's headers");
    free(last);
    e2e_resp_free(&r14);
    /* a retry of 12 (the same order) is still a replay, not stale (SPEC 6: the idempotency check comes first) */
    push(gw->port, m12, NULL, &r);
    cr_expect_eq(r.status, 200, "v12 again: %ld", r.status);
    cr_expect(e2e_resp_is_replay(&r), "v12 again is a replay");
    e2e_resp_free(&r);
    free(m11);
    free(m12);
    free(m13);
    free(m14);
}

/* The story's numbers: 11 applied, 13 arrives before 12: held; 12 comes and is applied, then 13 (the upstream's
 * last execution is 13's). */
Test(consumer, thirteen_before_twelve_is_held_then_applied_in_order)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up);
    char agg[96], o[3][96];
    e2e_mkkey(agg, sizeof agg, "agg");
    for (int i = 0; i < 3; i++)
        e2e_mkkey(o[i], sizeof o[i], "ord");
    char *m11 = message(o[0], agg, 11, "{\"v\":11}", 1), *m12 = message(o[1], agg, 12, "{\"v\":12}", 1),
         *m13 = message(o[2], agg, 13, "{\"v\":13}", 1);
    struct e2e_resp r;
    push(gw->port, m11, "X-Version: 11", &r);
    cr_expect_eq(r.status, 200, "v11: %ld", r.status);
    e2e_resp_free(&r);
    const char *h[] = {"Content-Type: application/json", "X-Version: 13", NULL};
    struct e2e_async *a = e2e_http_async(gw->port, &(struct e2e_req){.method = "POST",
                                                                     .path = "/v1/messages",
                                                                     .headers = h,
                                                                     .body = m13,
                                                                     .body_len = strlen(m13),
                                                                     .timeout_ms = 10000});
    e2e_sleep_ms(500);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "v13 is held while 12 is missing");
    push(gw->port, m12, "X-Version: 12", &r);
    cr_expect_eq(r.status, 200, "v12: %ld", r.status);
    e2e_resp_free(&r);
    struct e2e_resp r13;
    e2e_http_join(a, &r13);
    cr_expect_eq(r13.status, 200, "v13 after v12: %ld %s", r13.status, r13.body ? (const char *)r13.body : "");
    e2e_resp_free(&r13);
    cr_expect_eq(e2e_upstream_count(up, NULL), 3, "11, 12, 13 executed");
    char *last = e2e_upstream_last_headers(up);
    cr_expect(last && strstr(last, "X-Version: 13"), "13 executed last: %s", last ? last : "");
    free(last);
    free(m11);
    free(m12);
    free(m13);
}

Test(consumer, bodies_and_keys_that_are_refused_execute_nothing)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up);
    char agg[96];
    e2e_mkkey(agg, sizeof agg, "agg");
    struct e2e_resp r;
    push(gw->port, "{\"order_no\":\"x\",", NULL, &r);
    e2e_expect_problem(&r, 400, "bad-request", "truncated JSON");
    e2e_resp_free(&r);
    push(gw->port, "{\"order_no\":\"x\",\"order_no\":\"y\"}", NULL, &r);
    e2e_expect_problem(&r, 400, "bad-request", "duplicate member");
    e2e_resp_free(&r);
    char b[512];
    snprintf(b, sizeof b, "{\"order_no\":{\"id\":7},\"aggregate_id\":\"%s\",\"aggregate_version\":1}", agg);
    push(gw->port, b, NULL, &r);
    e2e_expect_problem(&r, 400, "idempotency-key-invalid", "key an object");
    e2e_resp_free(&r);
    snprintf(b, sizeof b, "{\"order_no\":1.5,\"aggregate_id\":\"%s\",\"aggregate_version\":1}", agg);
    push(gw->port, b, NULL, &r);
    e2e_expect_problem(&r, 400, "idempotency-key-invalid", "key a fraction");
    e2e_resp_free(&r);
    snprintf(b, sizeof b, "{\"aggregate_id\":\"%s\",\"aggregate_version\":1}", agg);
    push(gw->port, b, NULL, &r);
    e2e_expect_problem(&r, 400, "idempotency-key-missing", "no order_no");
    e2e_resp_free(&r);
    /* the Idempotency-Key header is not the key on this route */
    push(gw->port, b, "Idempotency-Key: delivery-1", &r);
    e2e_expect_problem(&r, 400, "idempotency-key-missing", "a key header does not stand in for order_no");
    e2e_resp_free(&r);
    snprintf(b, sizeof b, "{\"order_no\":\"o\",\"aggregate_version\":1}");
    push(gw->port, b, NULL, &r);
    e2e_expect_problem(&r, 400, "sequence-invalid", "no aggregate_id");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 0, "nothing executed");
    /* an integer key is its decimal text */
    long n = (long)(e2e_now_ms() % 1000000000);
    snprintf(b, sizeof b, "{\"order_no\":%ld,\"aggregate_id\":\"%s\",\"aggregate_version\":1,\"data\":1}", n, agg);
    push(gw->port, b, NULL, &r);
    cr_expect_eq(r.status, 200, "integer key: %ld %s", r.status, r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
    snprintf(b, sizeof b, "{\"order_no\":%ld,\"aggregate_id\":\"%s\",\"aggregate_version\":1,\"data\":1.0}", n, agg);
    push(gw->port, b, NULL, &r);
    cr_expect(e2e_resp_is_replay(&r), "the same integer key, 1.0 for 1: a replay (%ld)", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "executed once");
}

Test(consumer, form_and_query_keys)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up);
    char ev[96], body[256];
    e2e_mkkey(ev, sizeof ev, "evt");
    snprintf(body, sizeof body, "type=charge&event_id=%s&amount=10&attempt=1", ev);
    const char *fh[] = {"Content-Type: application/x-www-form-urlencoded", NULL};
    struct e2e_resp r;
    e2e_http(
        gw->port,
        &(struct e2e_req){.method = "POST", .path = "/v1/form", .headers = fh, .body = body, .body_len = strlen(body)},
        &r);
    cr_expect_eq(r.status, 200, "form: %ld %s", r.status, r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
    snprintf(body, sizeof body, "attempt=2&amount=10&event_id=%s&type=charge", ev);
    e2e_http(
        gw->port,
        &(struct e2e_req){.method = "POST", .path = "/v1/form", .headers = fh, .body = body, .body_len = strlen(body)},
        &r);
    cr_expect(e2e_resp_is_replay(&r), "form redelivery: %ld", r.status);
    e2e_resp_free(&r);
    snprintf(body, sizeof body, "event_id=%s&amount=11", ev);
    e2e_http(
        gw->port,
        &(struct e2e_req){.method = "POST", .path = "/v1/form", .headers = fh, .body = body, .body_len = strlen(body)},
        &r);
    e2e_expect_problem(&r, 422, "idempotency-key-mismatch", "form: other amount");
    e2e_resp_free(&r);
    e2e_http(gw->port,
             &(struct e2e_req){.method = "POST", .path = "/v1/form", .headers = fh, .body = "amount=1", .body_len = 8},
             &r);
    e2e_expect_problem(&r, 400, "idempotency-key-missing", "form without event_id");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "form: executed once");

    char path[256];
    snprintf(path, sizeof path, "/v1/q?amount=3&msg=%s%%20%%C3%%A9", ev); /* the key: "<ev> é" */
    e2e_http(gw->port, &(struct e2e_req){.method = "POST", .path = path, .body = "", .body_len = 0}, &r);
    cr_expect_eq(r.status, 200, "query: %ld %s", r.status, r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
    snprintf(path, sizeof path, "/v1/q?msg=%s+%%c3%%a9&amount=3&attempt=2", ev);
    e2e_http(gw->port, &(struct e2e_req){.method = "POST", .path = path, .body = "", .body_len = 0}, &r);
    cr_expect(e2e_resp_is_replay(&r), "query redelivery: %ld %s", r.status, r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
    snprintf(path, sizeof path, "/v1/q?msg=a%%0Ab");
    e2e_http(gw->port, &(struct e2e_req){.method = "POST", .path = path, .body = "", .body_len = 0}, &r);
    e2e_expect_problem(&r, 400, "idempotency-key-invalid", "a control character in the key");
    e2e_resp_free(&r);
    e2e_http(gw->port, &(struct e2e_req){.method = "POST", .path = "/v1/q?amount=1", .body = "", .body_len = 0}, &r);
    cr_expect_eq(r.status, 200, "key: optional, no msg: proxied plainly");
    cr_expect(!e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 3, "query: executed once, plus the unkeyed one");
    /* the admin API takes the same text (percent-encoded) */
    char akey[160];
    snprintf(akey, sizeof akey, "%s%%20%%C3%%A9", ev);
    expect_admin_completed(gw, "q", akey);
}
