/* shadow_test.c - end-to-end tests of mode: shadow (SPEC 10): every request is forwarded and answered by the real
 * test upstream, while the gateway counts what enforce would have done from real Postgres/Redis records. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

/* A test killed by its timeout never runs its .fini: every test starts with Postgres up. */
static void shadow_setup(void)
{
    e2e_setup();
    cr_assert_eq(e2e_services("pg-start"), 0, "Postgres could not be (re)started before the test");
}

TestSuite(shadow, .init = shadow_setup, .fini = e2e_teardown, .timeout = 90);

static struct e2e_gw *gw_start_shadow(const struct e2e_upstream *up)
{
    struct e2e_pay_conf c = {.idem = "key: required\nmode: shadow\nlease: 5s\n"};
    return e2e_gw_start_pay(up, &c, NULL);
}

static double metric(const struct e2e_gw *g, const char *name, const char *label)
{
    struct e2e_resp r;
    e2e_get(g->admin_port, "/metrics", &r);
    cr_assert_eq(r.status, 200);
    const char *labels[] = {"route=\"pay\"", label, NULL};
    double v = e2e_metric_value((const char *)r.body, name, labels);
    e2e_resp_free(&r);
    return v;
}

static double decision(const struct e2e_gw *g, const char *d)
{
    char l[64];
    snprintf(l, sizeof l, "decision=\"%s\"", d);
    return metric(g, "idemgate_shadow_decisions_total", l);
}

static double decisions(const struct e2e_gw *g)
{
    static const char *const all[] = {"replay", "mismatch", "in_flight", "stale", "new"};
    double n = 0;
    for (size_t i = 0; i < 5; i++)
        n += decision(g, all[i]);
    return n;
}

/* r is the upstream's own answer (200, never a replay); frees it. */
static void expect_forwarded(struct e2e_resp *r, const char *what)
{
    cr_expect_eq(r->status, 200, "%s: %ld %s", what, r->status, r->body ? (const char *)r->body : "");
    cr_expect(!e2e_resp_is_replay(r), "%s: never a replay in shadow mode", what);
    cr_expect_not_null(e2e_resp_header(r, "X-Upstream-Exec"), "%s: the upstream answered", what);
    e2e_resp_free(r);
}

/* POST /v1/pay with key (NULL: none) and body; expects the upstream's own answer (200, never a replay). */
static void post_forwarded(const struct e2e_gw *gw, const char *key, const char *body, const char *const *extra,
                           const char *what)
{
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay", key, extra, body, 0, &r);
    expect_forwarded(&r, what);
}

Test(shadow, each_decision_is_counted_and_every_request_forwarded)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_shadow(up);
    char key[64], key2[64];
    e2e_mkkey(key, sizeof key, "shadow");
    e2e_mkkey(key2, sizeof key2, "shadow-busy");

    post_forwarded(gw, key, "{\"amount\":1}", NULL, "new");
    cr_expect_eq(decision(gw, "new"), 1);
    post_forwarded(gw, key, "{\"amount\":1}", NULL, "retry, same request");
    cr_expect_eq(decision(gw, "replay"), 1, "enforce would have replayed it");
    post_forwarded(gw, key, "{\"amount\":2}", NULL, "same key, other body");
    cr_expect_eq(decision(gw, "mismatch"), 1, "enforce would have answered 422");
    cr_expect_eq(e2e_upstream_count(up, key), 3, "every request executed");

    /* a retry while the first is in flight */
    static const char *const slow[] = {"X-Test-Delay-Ms: 1500", NULL};
    char kh[128];
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key2);
    const char *h[] = {kh, slow[0], NULL};
    struct e2e_req first = {.method = "POST", .path = "/v1/pay", .headers = h, .body = "{}", .body_len = 2};
    struct e2e_async *fa = e2e_http_async(gw->port, &first);
    cr_assert_eq(e2e_upstream_wait_count(up, key2, 1, 5000), 1, "the first reached the upstream");
    post_forwarded(gw, key2, "{}", NULL, "retry while in flight");
    cr_expect_eq(decision(gw, "in_flight"), 1, "enforce would have answered 409");
    struct e2e_resp r;
    e2e_http_join(fa, &r);
    cr_expect_eq(r.status, 200, "the first: %ld", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key2), 2);

    /* the record is real: the first answer was stored, the later ones never replaced it */
    post_forwarded(gw, key, "{\"amount\":1}", NULL, "retry of the first request again");
    cr_expect_eq(decision(gw, "replay"), 2, "still the first request's record");
    cr_expect_eq(decision(gw, "new"), 2, "key and key2");
    cr_expect_eq(decision(gw, "stale"), 0);

    cr_expect(e2e_gw_log_contains(gw, "event=shadow_decision decision=replay route=pay"), "replay logged");
    cr_expect(e2e_gw_log_contains(gw, "event=shadow_decision decision=mismatch route=pay"), "mismatch logged");
    cr_expect(e2e_gw_log_contains(gw, "event=shadow_decision decision=in_flight route=pay"), "in_flight logged");
    cr_expect(!e2e_gw_log_contains(gw, "decision=new"), "new is not logged");
    cr_expect(!e2e_gw_log_contains_outside_access(gw, key), "no key in the log but in the access lines");
}

Test(shadow, requests_without_a_valid_key_are_forwarded_without_a_decision)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_shadow(up);
    post_forwarded(gw, NULL, "{}", NULL, "no key on a key: required route");
    static const char *const second[] = {"Idempotency-Key: other", NULL};
    post_forwarded(gw, "one", "{}", second, "two key headers");
    post_forwarded(gw, "\"\"", "{}", NULL, "an empty key");
    cr_expect_eq(decisions(gw), 0, "no decision without a key");
    cr_expect_eq(e2e_upstream_count(up, NULL), 3);
}

static void restore_postgres(void)
{
    if (e2e_services("pg-start") != 0)
        fprintf(stderr, "shadow: pg-start failed in .fini\n");
}

Test(shadow, a_store_failure_never_fails_the_request, .fini = restore_postgres)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_shadow(up);
    cr_assert_eq(e2e_services("pg-stop"), 0, "pg-stop failed");
    char key[64];
    e2e_mkkey(key, sizeof key, "shadow-pgdown");
    for (int i = 0; i < 2; i++)
        post_forwarded(gw, key, "{}", NULL, "Postgres down");
    cr_expect_eq(e2e_upstream_count(up, key), 2, "forwarded while the store is down");
    cr_expect(metric(gw, "idemgate_shadow_store_errors_total", NULL) >= 2, "counted");
    cr_expect_eq(decisions(gw), 0, "no decision without the store");
    e2e_gw_assert_alive(gw, "with Postgres down");
}

/* ---- shadow mode on a guarded route (SPEC 6, 10): "stale" from the guard's real row, read without its marker */

/* Route "pay" on /v1/accounts in shadow mode with an ordering guard (X-Sequence). */
static struct e2e_gw *gw_start_shadow_guarded(const struct e2e_upstream *up)
{
    /* clang-format off */
    const char *t = E2E_CONF_HEAD "upstreams:\n" E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")
        "routes:\n"
        "  - name: pay\n"
        "    match:\n"
        "      path_prefix: /v1/accounts\n"
        "    upstream: api\n"
        "    idempotency:\n"
        "      key: optional\n"
        "      mode: shadow\n"
        "      lease: 5s\n"
        "    ordering:\n"
        "      resource: /v1/accounts/{id}/address\n"
        "      sequence: header:X-Sequence\n"
        "      on_gap: reject\n";
    /* clang-format on */
    struct e2e_gw_opts o = {.up = up, .wait_ready = true};
    return e2e_gw_start(t, &o);
}

/* PATCH path with X-Sequence seq (NULL: none) and key (NULL: none); expects the upstream's own answer. */
static void patch_forwarded(const struct e2e_gw *gw, const char *path, const char *seq, const char *key,
                            const char *what)
{
    char sh[64];
    snprintf(sh, sizeof sh, "X-Sequence: %s", seq ? seq : "");
    const char *h[] = {seq ? sh : NULL, NULL};
    struct e2e_resp r;
    e2e_http_key(gw->port, "PATCH", path, key, h, "{\"street\":\"x\"}", 0, &r);
    expect_forwarded(&r, what);
}

Test(shadow, a_stale_request_is_forwarded_and_counted_stale)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_shadow_guarded(up);
    char id[64], path[128], k[5][64];
    e2e_mkkey(id, sizeof id, "shadow-acct");
    snprintf(path, sizeof path, "/v1/accounts/%s/address", id);
    for (int i = 0; i < 5; i++) {
        char tag[32];
        snprintf(tag, sizeof tag, "shadow-seq%d", i);
        e2e_mkkey(k[i], sizeof k[i], tag);
    }

    /* a fresh resource: seq 5 is new, and once it executed it is the applied sequence (shadow advances it) */
    patch_forwarded(gw, path, "5", k[0], "v5");
    cr_expect_eq(decision(gw, "new"), 1);
    /* enforce would answer 409 stale-sequence: shadow forwards it, counts and logs stale */
    patch_forwarded(gw, path, "3", k[1], "v3 after v5");
    cr_expect_eq(decision(gw, "stale"), 1, "seq 3 <= applied 5");
    cr_expect_eq(e2e_upstream_count(up, k[1]), 1, "the stale request executed");
    cr_expect(e2e_gw_log_contains(gw, "event=shadow_decision decision=stale route=pay"), "stale logged");
    /* the same sequence under another key is stale too */
    patch_forwarded(gw, path, "5", k[2], "another v5");
    cr_expect_eq(decision(gw, "stale"), 2, "seq 5 <= applied 5");
    /* enforce keeps no record of a refused request: its retry is judged afresh, stale again (not a replay) */
    patch_forwarded(gw, path, "3", k[1], "v3 retried");
    cr_expect_eq(decision(gw, "stale"), 3, "the retry of the stale request");
    cr_expect_eq(decision(gw, "replay"), 0, "no record was kept for it");
    /* a gap is forwarded as new (enforce's on_gap is not a shadow decision) */
    patch_forwarded(gw, path, "9", k[3], "v9 (a gap)");
    cr_expect_eq(decision(gw, "new"), 2);
    /* the retry of an applied request is a replay, never stale (the idempotency check comes first) */
    patch_forwarded(gw, path, "5", k[0], "v5 retried");
    cr_expect_eq(decision(gw, "replay"), 1);
    cr_expect_eq(decision(gw, "stale"), 3);

    /* keyless: forwarded, no decision; what it executed still advances the sequence (enforce guards it too) */
    double before = decisions(gw);
    patch_forwarded(gw, path, "20", NULL, "keyless v20");
    cr_expect_eq(decisions(gw), before, "no decision without a key");
    patch_forwarded(gw, path, "15", k[4], "v15 after the keyless v20");
    cr_expect_eq(decision(gw, "stale"), 4, "seq 15 <= applied 20");

    /* shadow refuses nothing: a missing sequence is forwarded, without a decision of the guard */
    patch_forwarded(gw, path, NULL, NULL, "no sequence");
    patch_forwarded(gw, path, "007", NULL, "a malformed sequence");
    cr_expect_eq(decision(gw, "stale"), 4);
    cr_expect(!e2e_gw_log_contains_outside_access(gw, id), "no resource instance in the log but in the access lines");
}
