/* spec_audit15_test.c - end-to-end checks of SPEC sections 1-5 that no other test made: the environment overriding
 * the file, SIGINT with the default grace, a bad file at start, keys isolated by route, the admin API over every
 * scope, problem members, first-match routing, and a key reused with another request while it is in flight. */
#include <criterion/criterion.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "harness.h"

TestSuite(audit15, .init = e2e_setup, .fini = e2e_teardown, .timeout = 90);

#define ADMIN_TOKEN "audit15-admin"

static const char *const admin_env[] = {"IDEMGATE_ADMIN_TOKEN=" ADMIN_TOKEN, NULL};

/* POST body to path with key (NULL: none) and one extra header line (NULL: none). */
static void post(uint16_t port, const char *path, const char *key, const char *body, const char *hdr,
                 struct e2e_resp *r)
{
    const char *extra[] = {hdr, NULL};
    e2e_http_key(port, "POST", path, key, hdr ? extra : NULL, body, 0, r);
}

/* METHOD /admin/WHAT?route=ROUTE&key=KEY with the bearer token tok (NULL: no Authorization). */
static void admin(const struct e2e_gw *g, const char *method, const char *what, const char *route, const char *key,
                  const char *tok, struct e2e_resp *r)
{
    char path[512], auth[128];
    snprintf(path, sizeof path, "/admin/%s?route=%s&key=%s", what, route, key);
    snprintf(auth, sizeof auth, "Authorization: Bearer %s", tok ? tok : "");
    const char *h[] = {auth, NULL};
    struct e2e_req rq = {.method = method,
                         .path = path,
                         .headers = tok ? h : NULL,
                         .body = strcmp(method, "POST") == 0 ? "" : NULL,
                         .body_len = 0,
                         .timeout_ms = 5000};
    e2e_http(g->admin_port, &rq, r);
}

/* Occurrences of needle in text. */
static size_t count_of(const char *text, const char *needle)
{
    size_t n = 0;
    for (const char *p = strstr(text, needle); p != NULL; p = strstr(p + 1, needle))
        n++;
    return n;
}

/* Expects the problem (status, type) and the RFC 9457 members SPEC 4 names: title and detail as strings, status
 * as the number of the answer's status. */
static void expect_full_problem(const struct e2e_resp *r, long status, const char *name, const char *what)
{
    e2e_expect_problem(r, status, name, what);
    const char *b = (const char *)r->body;
    char st[32];
    snprintf(st, sizeof st, "\"status\":%ld", status);
    cr_expect(strstr(b, st) != NULL, "%s: the body must carry %s: %.300s", what, st, b);
    cr_expect(strstr(b, "\"title\":\"") != NULL, "%s: title (a string): %.300s", what, b);
    cr_expect(strstr(b, "\"detail\":\"") != NULL, "%s: detail (a string): %.300s", what, b);
}

/* POSTs a new key n times to /v1/pay: executed once, then replayed, each answer within a second. */
static void once_then_replays(const struct e2e_gw *gw, const struct e2e_upstream *up, const char *tag, int n)
{
    char key[96];
    e2e_mkkey(key, sizeof key, tag);
    for (int i = 0; i < n; i++) {
        struct e2e_resp r;
        post(gw->port, "/v1/pay", key, "x", NULL, &r);
        cr_expect_eq(r.status, 200, "%s attempt %d: %ld %.200s", tag, i, r.status, (const char *)r.body);
        cr_expect_eq(e2e_resp_is_replay(&r), i > 0, "%s attempt %d replayed: %d", tag, i, (int)e2e_resp_is_replay(&r));
        cr_expect(r.seconds < 1.0, "%s attempt %d took %.3f s", tag, i, r.seconds);
        e2e_resp_free(&r);
    }
    cr_expect_eq(e2e_upstream_count(up, key), 1, "%s executed once", tag);
}

/* ---- SPEC 4: a key reused with another request is 422, also while its first request is in flight */

Test(audit15, a_key_reused_with_another_body_while_in_flight_is_422)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf pc = {.idem = "key: required\nlease: 10s\n"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &pc, NULL);
    char key[96], kh[128];
    e2e_mkkey(key, sizeof key, "inflight-mismatch");
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    static const char *const slow[] = {"X-Test-Delay-Ms: 1500", NULL};
    const char *h[] = {kh, slow[0], NULL};
    struct e2e_req first = {.method = "POST", .path = "/v1/pay/m", .headers = h, .body = "amount=1", .body_len = 8};
    struct e2e_async *a = e2e_http_async(gw->port, &first);
    cr_assert_eq(e2e_upstream_wait_count(up, key, 1, 3000), 1, "the first request reached the upstream");

    struct e2e_resp r;
    post(gw->port, "/v1/pay/m", key, "amount=2", NULL, &r);
    expect_full_problem(&r, 422, "idempotency-key-mismatch", "another body while the first is in flight");
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay/other", key, "amount=1", NULL, &r);
    expect_full_problem(&r, 422, "idempotency-key-mismatch", "another path while the first is in flight");
    e2e_resp_free(&r);
    /* the same request is still a conflict */
    post(gw->port, "/v1/pay/m", key, "amount=1", NULL, &r);
    expect_full_problem(&r, 409, "idempotency-key-in-use", "the same request while the first is in flight");
    cr_expect_not_null(e2e_resp_header(&r, "Retry-After"), "409 in-use carries Retry-After");
    e2e_resp_free(&r);

    e2e_http_join(a, &r);
    cr_expect_eq(r.status, 200, "the first request: %ld (%s)", r.status, r.error);
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay/m", key, "amount=2", NULL, &r);
    expect_full_problem(&r, 422, "idempotency-key-mismatch", "another body after the first completed");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "executed once");
}

/* ---- SPEC 2: the environment overrides the file */

Test(audit15, environment_overrides_store_postgres_and_redis)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char pg_env[600];
    snprintf(pg_env, sizeof pg_env, "IDEMGATE_POSTGRES_URL=%s", e2e_env("IDEMGATE_TEST_PG_URL"));
    /* the file names a Postgres and a Redis nobody listens on; the environment wins, and an empty
     * IDEMGATE_REDIS_URL means no Redis */
    const char *env[] = {pg_env, "IDEMGATE_REDIS_URL=", NULL};
    struct e2e_gw_opts o = {.up = up, .env = env};
    static const char conf[] =
        E2E_CONF_PORTS "store:\n"
                       "  postgres: \"postgresql://idemgate@127.0.0.1:{{DEAD_PORT}}/idemgate\"\n"
                       "  redis: \"redis://127.0.0.1:{{DEAD_PORT}}/0\"\n"
                       "upstreams:\n" E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s") "routes:\n" E2E_CONF_ROUTE(
                           "pay", "/v1/pay", "api") "      key: required\n";
    struct e2e_gw *gw = e2e_gw_start(conf, &o);
    e2e_gw_wait_ready(gw);
    struct e2e_resp r;
    e2e_get(gw->admin_port, "/readyz", &r);
    cr_expect_eq(r.status, 200, "/readyz: %ld %.200s", r.status, (const char *)r.body);
    cr_expect(strstr((const char *)r.body, "\"postgres\":\"up\"") != NULL, "postgres: %.200s", (const char *)r.body);
    cr_expect(strstr((const char *)r.body, "\"redis\":\"disabled\"") != NULL, "redis: %.200s", (const char *)r.body);
    e2e_resp_free(&r);
    once_then_replays(gw, up, "envpg", 2);
    cr_expect(!e2e_gw_log_contains(gw, "event=redis_up"), "no Redis connection with IDEMGATE_REDIS_URL empty");

    /* IDEMGATE_REDIS_URL set replaces the file's Redis too */
    char rd_env[300];
    snprintf(rd_env, sizeof rd_env, "IDEMGATE_REDIS_URL=%s", e2e_env("IDEMGATE_TEST_REDIS_URL"));
    const char *env2[] = {pg_env, rd_env, NULL};
    struct e2e_gw_opts o2 = {.up = up, .env = env2};
    struct e2e_gw *gw2 = e2e_gw_start(conf, &o2);
    e2e_gw_wait_ready(gw2);
    bool redis_up = false;
    for (uint64_t end = e2e_now_ms() + 5000; !redis_up && e2e_now_ms() < end; e2e_sleep_ms(50)) {
        e2e_get(gw2->admin_port, "/readyz", &r);
        redis_up = strstr((const char *)r.body, "\"redis\":\"up\"") != NULL;
        e2e_resp_free(&r);
    }
    cr_expect(redis_up, "IDEMGATE_REDIS_URL overrides store.redis");
}

/* ---- SPEC 2: SIGINT with the default shutdown_grace (10 s) lets an in-flight request finish and complete its
 * record, then exits 0 */

Test(audit15, sigint_finishes_in_flight_records_within_the_default_grace)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    static const char conf[] =
        "listen: 127.0.0.1:{{LISTEN_PORT}}\n"
        "admin:\n"
        "  listen: 127.0.0.1:{{ADMIN_PORT}}\n" E2E_CONF_STORE("{{REDIS_URL}}") "upstreams:\n" E2E_CONF_UPSTREAM(
            "api", "{{UPSTREAM_URL}}", "10s") "routes:\n" E2E_CONF_ROUTE("pay", "/v1/pay",
                                                                         "api") "      key: required\n";
    struct e2e_gw_opts o = {.up = up, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(conf, &o);
    char key[96], kh[128];
    e2e_mkkey(key, sizeof key, "sigint");
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    const char *h[] = {kh, "X-Test-Delay-Ms: 3000", NULL};
    struct e2e_req rq = {
        .method = "POST", .path = "/v1/pay", .headers = h, .body = "late", .body_len = 4, .timeout_ms = 9000};
    struct e2e_async *a = e2e_http_async(gw->port, &rq);
    cr_assert_eq(e2e_upstream_wait_count(up, key, 1, 3000), 1, "the request reached the upstream");
    cr_assert_eq(kill(gw->proc.pid, SIGINT), 0);
    struct e2e_resp r;
    /* it stops accepting: a new request is refused (connection refused, or 503) while the first one finishes */
    e2e_sleep_ms(300);
    struct e2e_req late = {.method = "GET", .path = "/v1/pay", .timeout_ms = 2000};
    e2e_http(gw->port, &late, &r);
    cr_expect(r.status == 0 || r.status == 503, "a new request after SIGINT: %ld", r.status);
    e2e_resp_free(&r);
    e2e_http_join(a, &r);
    cr_expect_eq(r.status, 200, "the in-flight request finishes (3 s < the default 10 s grace): %ld (%s) %.200s",
                 r.status, r.error, (const char *)r.body);
    e2e_resp_free(&r);
    cr_assert(e2e_proc_wait(&gw->proc, 8000), "idemgate still running after SIGINT");
    cr_expect_eq(e2e_proc_exit_code(&gw->proc), 0, "exit code after SIGINT: %d", e2e_proc_exit_code(&gw->proc));

    /* its record was completed: another gateway replays it */
    struct e2e_gw_opts o2 = {.up = up, .wait_ready = true};
    struct e2e_gw *gw2 = e2e_gw_start(conf, &o2);
    post(gw2->port, "/v1/pay", key, "late", NULL, &r);
    cr_expect_eq(r.status, 200, "retry: %ld %.200s", r.status, (const char *)r.body);
    cr_expect(e2e_resp_is_replay(&r), "the record was completed before the exit");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
}

/* ---- SPEC 2: a configuration error at start (not --check) names the file, the line and the key, exits 1 */

Test(audit15, a_bad_file_at_start_names_file_line_and_key_and_exits_1)
{
    /* a valid file but for one key (the ports are never bound: the file is refused first) */
    char *text = e2e_render(
        "listen: 127.0.0.1:9\n" E2E_CONF_STORE("{{REDIS_URL}}") "upstreams:\n" E2E_CONF_UPSTREAM(
            "api", "http://127.0.0.1:9", "5s") "routes:\n" E2E_CONF_ROUTE("pay", "/v1/pay", "api") "      lease: 60x\n",
        NULL);
    const char *path = e2e_write_file("bad.yaml", text);
    /* the line of "lease:" */
    int line = 1;
    for (const char *p = text; *p && strncmp(p, "      lease:", 12) != 0; p++)
        line += *p == '\n';
    free(text);
    const char *argv[] = {e2e_env("IDEMGATE_BIN"), "-c", path, NULL};
    char *out, *err;
    int code = e2e_run(argv, NULL, 10000, &out, &err);
    cr_expect_eq(code, 1, "exit %d; stderr: %s", code, err);
    char where[600];
    snprintf(where, sizeof where, "%s:%d:", path, line);
    cr_expect(strstr(err, where) != NULL, "stderr names '%s': %s", where, err);
    cr_expect(strstr(err, "lease") != NULL, "stderr names the key: %s", err);
    cr_expect(strstr(err, "event=listening") == NULL, "nothing listens: %s", err);
    free(out);
    free(err);
}

/* ---- SPEC 1: keys are isolated by route; the admin API works per route */

static const char two_routes[] =
    E2E_CONF_HEAD "upstreams:\n" E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s") "routes:\n" E2E_CONF_ROUTE(
        "a", "/v1/a", "api") "      key: required\n"
                             "      scope: [header:Authorization]\n" E2E_CONF_ROUTE(
                                 "b", "/v1/b", "api") "      key: required\n"
                                                      "      scope: [header:Authorization]\n";

Test(audit15, the_same_key_on_two_routes_is_two_keys)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw_opts o = {.up = up, .env = admin_env, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(two_routes, &o);
    char key[96];
    e2e_mkkey(key, sizeof key, "routes");
    struct e2e_resp r;
    post(gw->port, "/v1/a", key, "same", NULL, &r);
    cr_expect_eq(r.status, 200);
    cr_expect(!e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    post(gw->port, "/v1/b", key, "same", NULL, &r);
    cr_expect_eq(r.status, 200, "route b: %ld %.200s", r.status, (const char *)r.body);
    cr_expect(!e2e_resp_is_replay(&r), "route b never replays route a's answer");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2, "each route executed once");

    /* a purge on route a leaves route b's record */
    admin(gw, "DELETE", "keys", "a", key, ADMIN_TOKEN, &r);
    cr_expect_eq(r.status, 200, "DELETE route a: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    admin(gw, "GET", "keys", "b", key, ADMIN_TOKEN, &r);
    cr_expect_eq(count_of((const char *)r.body, "\"route\":\"b\""), 1, "route b's record stays: %.300s",
                 (const char *)r.body);
    e2e_resp_free(&r);
    post(gw->port, "/v1/b", key, "same", NULL, &r);
    cr_expect(e2e_resp_is_replay(&r), "route b still replays");
    e2e_resp_free(&r);
    post(gw->port, "/v1/a", key, "same", NULL, &r);
    cr_expect(!e2e_resp_is_replay(&r), "route a executes again after its purge");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 3);
}

/* ---- SPEC 5: /admin/keys lists and purges the key in every scope; release needs the token */

Test(audit15, admin_keys_cover_every_scope_and_release_needs_the_token)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw_opts o = {.up = up, .env = admin_env, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(two_routes, &o);
    char key[96];
    e2e_mkkey(key, sizeof key, "scopes");
    struct e2e_resp r;
    post(gw->port, "/v1/a", key, "x", "Authorization: Bearer tenant-1", &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    post(gw->port, "/v1/a", key, "x", "Authorization: Bearer tenant-2", &r);
    cr_expect_eq(r.status, 200);
    cr_expect(!e2e_resp_is_replay(&r), "another tenant is another scope");
    e2e_resp_free(&r);

    admin(gw, "GET", "keys", "a", key, ADMIN_TOKEN, &r);
    cr_expect_eq(r.status, 200);
    cr_expect_eq(count_of((const char *)r.body, "\"state\":\"completed\""), 2, "both scopes listed: %.600s",
                 (const char *)r.body);
    cr_expect(strstr((const char *)r.body, "tenant-") == NULL, "no scope value in the listing");
    e2e_resp_free(&r);

    /* release: 401 without the token or with another one, nothing released */
    char ukey[96];
    e2e_mkkey(ukey, sizeof ukey, "release");
    post(gw->port, "/v1/a", ukey, "x", "X-Test-Action: close", &r);
    expect_full_problem(&r, 502, "upstream-no-response", "upstream closed after the request");
    e2e_resp_free(&r);
    admin(gw, "POST", "keys/release", "a", ukey, NULL, &r);
    expect_full_problem(&r, 401, "unauthorized", "release without a token");
    e2e_resp_free(&r);
    admin(gw, "POST", "keys/release", "a", ukey, "not-" ADMIN_TOKEN, &r);
    cr_expect_eq(r.status, 401, "release with another token: %ld", r.status);
    e2e_resp_free(&r);
    post(gw->port, "/v1/a", ukey, "x", NULL, &r);
    expect_full_problem(&r, 409, "idempotency-key-in-use", "an unknown outcome within its lease");
    cr_expect_not_null(e2e_resp_header(&r, "Retry-After"));
    e2e_resp_free(&r);
    admin(gw, "POST", "keys/release", "a", ukey, ADMIN_TOKEN, &r);
    cr_expect_eq(r.status, 200, "release: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    post(gw->port, "/v1/a", ukey, "x", NULL, &r);
    cr_expect_eq(r.status, 200, "after the release the retry executes: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, ukey), 2);

    /* DELETE purges every scope */
    admin(gw, "DELETE", "keys", "a", key, ADMIN_TOKEN, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    admin(gw, "GET", "keys", "a", key, ADMIN_TOKEN, &r);
    cr_expect_eq(count_of((const char *)r.body, "\"route\""), 0, "purged: %.300s", (const char *)r.body);
    e2e_resp_free(&r);
    post(gw->port, "/v1/a", key, "x", "Authorization: Bearer tenant-2", &r);
    cr_expect(!e2e_resp_is_replay(&r), "tenant-2's record was purged too");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 3);
}

/* ---- SPEC 3: routes, first match wins; path matches exactly; the defaults of a route without idempotency */

Test(audit15, first_matching_route_wins_and_path_is_exact)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw_opts o = {.up = up, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(
        E2E_CONF_HEAD "upstreams:\n" E2E_CONF_UPSTREAM(
            "api", "{{UPSTREAM_URL}}", "5s") "routes:\n"
                                             "  - name: exact\n"
                                             "    match:\n"
                                             "      path: /v1/things/special\n"
                                             "    upstream: api\n"
                                             "    idempotency:\n"
                                             "      key: off\n" E2E_CONF_ROUTE("things", "/v1/things",
                                                                               "api") "      key: required\n"
                                                                                      "  - name: plain\n"
                                                                                      "    match:\n"
                                                                                      "      path_prefix: /v1/plain\n"
                                                                                      "    upstream: api\n",
        &o);
    struct e2e_resp r;
    post(gw->port, "/v1/things/special", NULL, "x", NULL, &r);
    cr_expect_eq(r.status, 200, "the exact route comes first (key: off): %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    static const char *const later[] = {"/v1/things/special/1", "/v1/things/specialx", "/v1/things"};
    for (size_t i = 0; i < sizeof later / sizeof later[0]; i++) {
        post(gw->port, later[i], NULL, "x", NULL, &r);
        expect_full_problem(&r, 400, "idempotency-key-missing", later[i]);
        e2e_resp_free(&r);
    }
    post(gw->port, "/v2/none", NULL, "x", NULL, &r);
    expect_full_problem(&r, 404, "route-not-found", "no route and no default_upstream");
    e2e_resp_free(&r);

    /* a route without an idempotency block: key optional on POST and PATCH, other methods pass through */
    char key[96];
    e2e_mkkey(key, sizeof key, "plain");
    for (int i = 0; i < 2; i++) {
        post(gw->port, "/v1/plain", key, "x", NULL, &r);
        cr_expect_eq(e2e_resp_is_replay(&r), i == 1, "POST attempt %d", i);
        e2e_resp_free(&r);
    }
    char pkey[96];
    e2e_mkkey(pkey, sizeof pkey, "plain-put");
    for (int i = 0; i < 2; i++) {
        e2e_http_key(gw->port, "PUT", "/v1/plain", pkey, NULL, "x", 0, &r);
        cr_expect_eq(r.status, 200);
        cr_expect(!e2e_resp_is_replay(&r), "PUT is not idempotent by default (attempt %d)", i);
        e2e_resp_free(&r);
    }
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    cr_expect_eq(e2e_upstream_count(up, pkey), 2);
}

/* ---- SPEC 4: problem members on the table's answers */

Test(audit15, problems_carry_type_title_status_and_detail)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf pc = {.idem = "key: required\nmax_body: 16B\n", .timeout = "1s"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &pc, NULL);
    struct e2e_resp r;
    post(gw->port, "/v1/pay", NULL, "x", NULL, &r);
    expect_full_problem(&r, 400, "idempotency-key-missing", "no key");
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay", "\"\"", "x", NULL, &r);
    expect_full_problem(&r, 400, "idempotency-key-invalid", "\"\"");
    e2e_resp_free(&r);
    char key[96];
    e2e_mkkey(key, sizeof key, "big");
    post(gw->port, "/v1/pay", key, "0123456789abcdefg", NULL, &r);
    expect_full_problem(&r, 413, "payload-too-large", "17 bytes over max_body 16B");
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay", key, "0123456789abcdef", NULL, &r);
    cr_expect_eq(r.status, 200, "16 bytes is max_body: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay", key, "0123456789abcdeX", NULL, &r);
    expect_full_problem(&r, 422, "idempotency-key-mismatch", "another body");
    e2e_resp_free(&r);
    char tkey[96];
    e2e_mkkey(tkey, sizeof tkey, "timeout");
    post(gw->port, "/v1/pay", tkey, "x", "X-Test-Delay-Ms: 2000", &r);
    expect_full_problem(&r, 504, "upstream-timeout", "upstream slower than its timeout");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 2);
}

/* ---- SPEC 5 (and 9: the admin listener always answers problem+json): the key endpoints before the schema is
 * there (Postgres unreachable since the start) */

Test(audit15, admin_keys_without_a_store_answer_a_problem)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw_opts o = {.up = up, .env = admin_env};
    struct e2e_gw *gw = e2e_gw_start(
        E2E_CONF_PORTS "store:\n"
                       "  postgres: \"postgresql://idemgate@127.0.0.1:{{DEAD_PORT}}/idemgate\"\n"
                       "upstreams:\n" E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s") "routes:\n" E2E_CONF_ROUTE(
                           "pay", "/v1/pay", "api") "      key: required\n",
        &o);
    struct e2e_resp r;
    e2e_get(gw->admin_port, "/readyz", &r);
    cr_expect_eq(r.status, 503, "/readyz without Postgres: %ld", r.status);
    cr_expect(strstr((const char *)r.body, "\"postgres\":\"down\"") != NULL, "%.200s", (const char *)r.body);
    e2e_resp_free(&r);
    static const char *const methods[][2] = {{"GET", "keys"}, {"DELETE", "keys"}, {"POST", "keys/release"}};
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
        admin(gw, methods[i][0], methods[i][1], "pay", "k-1", ADMIN_TOKEN, &r);
        expect_full_problem(&r, 503, "store-unavailable", methods[i][0]);
        e2e_resp_free(&r);
    }
    post(gw->port, "/v1/pay", "k-1", "x", NULL, &r);
    expect_full_problem(&r, 503, "store-unavailable", "a keyed request without Postgres");
    cr_expect_not_null(e2e_resp_header(&r, "Retry-After"), "503 store-unavailable carries Retry-After");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 0, "nothing forwarded");
}

/* ---- SPEC 2: past shutdown_grace the gateway still exits 0, promptly, and the request it gave up on was sent, so
 * its key is not released (SPEC 1: an unknown outcome) */

Test(audit15, sigterm_past_the_grace_exits_0_and_keeps_the_key)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    static const char conf[] = "listen: 127.0.0.1:{{LISTEN_PORT}}\n"
                               "admin:\n"
                               "  listen: 127.0.0.1:{{ADMIN_PORT}}\n"
                               "shutdown_grace: 1s\n" E2E_CONF_STORE("{{REDIS_URL}}") "upstreams:\n" E2E_CONF_UPSTREAM(
                                   "api", "{{UPSTREAM_URL}}",
                                   "10s") "routes:\n" E2E_CONF_ROUTE("pay", "/v1/pay", "api") "      key: required\n"
                                                                                              "      lease: 2s\n";
    struct e2e_gw_opts o = {.up = up, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(conf, &o);
    char key[96], kh[128];
    e2e_mkkey(key, sizeof key, "grace");
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    const char *h[] = {kh, "X-Test-Delay-Ms: 5000", NULL};
    struct e2e_req rq = {
        .method = "POST", .path = "/v1/pay", .headers = h, .body = "x", .body_len = 1, .timeout_ms = 9000};
    struct e2e_async *a = e2e_http_async(gw->port, &rq);
    cr_assert_eq(e2e_upstream_wait_count(up, key, 1, 3000), 1, "the request reached the upstream");
    uint64_t t0 = e2e_now_ms();
    cr_assert_eq(kill(gw->proc.pid, SIGTERM), 0);
    struct e2e_resp r;
    e2e_http_join(a, &r);
    cr_expect(r.status == 503 || r.status == 0, "past the grace: 503 or a closed connection, got %ld", r.status);
    e2e_resp_free(&r);
    cr_assert(e2e_proc_wait(&gw->proc, 8000), "idemgate still running after SIGTERM");
    uint64_t took = e2e_now_ms() - t0;
    cr_expect_eq(e2e_proc_exit_code(&gw->proc), 0, "exit code past the grace: %d", e2e_proc_exit_code(&gw->proc));
    cr_expect(took < 4000, "the 1 s grace bounds the shutdown: %llu ms", (unsigned long long)took);

    /* after the lease the record is an unknown outcome (reject): no second execution */
    e2e_sleep_ms(2200);
    struct e2e_gw_opts o2 = {.up = up, .wait_ready = true};
    struct e2e_gw *gw2 = e2e_gw_start(conf, &o2);
    post(gw2->port, "/v1/pay", key, "x", NULL, &r);
    cr_expect_eq(r.status, 409, "the retry: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "never executed twice");
}

/* ---- SPEC 4: hop-by-hop headers are never stored: a replay (from this process and from Postgres) has none */

static void expect_no_hop_by_hop(const struct e2e_resp *r, const char *what)
{
    static const char *const gone[] = {"X-Hop", "Keep-Alive", "Transfer-Encoding", "Upgrade", "Trailer"};
    for (size_t i = 0; i < sizeof gone / sizeof gone[0]; i++)
        cr_expect_null(e2e_resp_header(r, gone[i]), "%s: %s was returned", what, gone[i]);
    for (size_t i = 0; i < e2e_resp_header_count(r, "Connection"); i++)
        cr_expect(strcasestr(e2e_resp_header_nth(r, "Connection", i), "x-hop") == NULL, "%s: Connection: %s", what,
                  e2e_resp_header_nth(r, "Connection", i));
    cr_expect_eq(e2e_resp_header_count(r, "Set-Cookie"), 2, "%s: both Set-Cookie kept", what);
}

Test(audit15, replays_carry_no_hop_by_hop_header)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf pc = {.idem = "key: required\n"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &pc, NULL);
    static const char *const variants[] = {NULL, "X-Test-Chunked: 1"};
    char keys[2][96];
    struct e2e_resp r;
    for (size_t v = 0; v < 2; v++) {
        e2e_mkkey(keys[v], sizeof keys[v], "hop");
        for (int i = 0; i < 2; i++) {
            post(gw->port, "/v1/pay", keys[v], "hop-body", variants[v], &r);
            cr_expect_eq(r.status, 200);
            cr_expect_eq(e2e_resp_is_replay(&r), i == 1, "variant %zu attempt %d", v, i);
            cr_expect(r.body_len == 8 && memcmp(r.body, "hop-body", 8) == 0, "body %.100s", (const char *)r.body);
            expect_no_hop_by_hop(&r, i == 0 ? "the first answer" : "a replay from this process");
            e2e_resp_free(&r);
        }
    }
    /* another gateway without Redis: the replay is read from Postgres */
    char pg_env[600];
    snprintf(pg_env, sizeof pg_env, "IDEMGATE_POSTGRES_URL=%s", e2e_env("IDEMGATE_TEST_PG_URL"));
    const char *env[] = {pg_env, "IDEMGATE_REDIS_URL=", NULL};
    struct e2e_gw *gw2 = e2e_gw_start_pay(up, &pc, env);
    for (size_t v = 0; v < 2; v++) {
        post(gw2->port, "/v1/pay", keys[v], "hop-body", variants[v], &r);
        cr_expect(e2e_resp_is_replay(&r), "variant %zu replayed from Postgres", v);
        cr_expect(r.body_len == 8 && memcmp(r.body, "hop-body", 8) == 0, "body %.100s", (const char *)r.body);
        expect_no_hop_by_hop(&r, "a replay from Postgres");
        e2e_resp_free(&r);
        cr_expect_eq(e2e_upstream_count(up, keys[v]), 1);
    }
}

/* ---- SPEC 3: idempotency.header names the key header; fingerprint may name a header and leave the body out;
 * methods lists the idempotent methods */

Test(audit15, key_header_fingerprint_header_and_methods_are_configurable)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw_opts o = {.up = up, .wait_ready = true};
    struct e2e_gw *gw =
        e2e_gw_start(E2E_CONF_HEAD "upstreams:\n" E2E_CONF_UPSTREAM(
                         "api", "{{UPSTREAM_URL}}", "5s") "routes:\n"
                                                          "  - name: put\n"
                                                          "    match:\n"
                                                          "      path_prefix: /v1/put\n"
                                                          "      methods: [PUT]\n"
                                                          "    upstream: api\n"
                                                          "    idempotency:\n"
                                                          "      key: required\n"
                                                          "      header: X-Request-Key\n"
                                                          "      fingerprint: [method, path, header:X-Amount]\n",
                     &o);
    char key[96], kh[128];
    e2e_mkkey(key, sizeof key, "custom");
    snprintf(kh, sizeof kh, "X-Request-Key: %s", key);
    struct e2e_resp r;
    /* POST is not in methods: passes through without a key */
    post(gw->port, "/v1/put", NULL, "x", NULL, &r);
    cr_expect_eq(r.status, 200, "POST on a PUT route: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    /* an Idempotency-Key is not the key header here */
    e2e_http_key(gw->port, "PUT", "/v1/put", key, NULL, "x", 0, &r);
    expect_full_problem(&r, 400, "idempotency-key-missing", "Idempotency-Key on a route keyed by X-Request-Key");
    e2e_resp_free(&r);
    const char *h1[] = {kh, "X-Amount: 10", NULL};
    e2e_http_key(gw->port, "PUT", "/v1/put", NULL, h1, "first body", 0, &r);
    cr_expect_eq(r.status, 200);
    cr_expect(!e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    long n = e2e_upstream_count(up, NULL);
    /* the body is not fingerprinted: another body is the same request */
    e2e_http_key(gw->port, "PUT", "/v1/put", NULL, h1, "another body", 0, &r);
    cr_expect(e2e_resp_is_replay(&r), "the body is not in the fingerprint: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    /* the header is */
    const char *h2[] = {kh, "X-Amount: 11", NULL};
    e2e_http_key(gw->port, "PUT", "/v1/put", NULL, h2, "first body", 0, &r);
    expect_full_problem(&r, 422, "idempotency-key-mismatch", "another X-Amount");
    e2e_resp_free(&r);
    const char *h3[] = {kh, NULL};
    e2e_http_key(gw->port, "PUT", "/v1/put", NULL, h3, "first body", 0, &r);
    expect_full_problem(&r, 422, "idempotency-key-mismatch", "no X-Amount");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), n, "nothing more executed");
    /* the key header is forwarded (forward_key defaults to true) */
    char *last = e2e_upstream_last_headers(up);
    cr_expect(strstr(last, kh) != NULL, "X-Request-Key forwarded:\n%s", last);
    free(last);
}

/* ---- SPEC 2: the schema is created at start, safely when several instances start at once (a fresh database) */

static char fresh_db[64];

static void drop_fresh_db(void)
{
    if (fresh_db[0] != '\0') {
        char sql[160];
        snprintf(sql, sizeof sql, "DROP DATABASE IF EXISTS %s WITH (FORCE)", fresh_db);
        free(e2e_psql(sql));
    }
    e2e_teardown();
}

Test(audit15, three_instances_starting_at_once_create_one_schema, .fini = drop_fresh_db)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    snprintf(fresh_db, sizeof fresh_db, "audit15_%ld_%u", (long)getpid(), (unsigned)(e2e_now_ms() % 100000));
    char sql[160];
    snprintf(sql, sizeof sql, "CREATE DATABASE %s OWNER idemgate", fresh_db);
    free(e2e_psql(sql));
    const char *pg = e2e_env("IDEMGATE_TEST_PG_URL");
    const char *slash = strrchr(pg, '/');
    cr_assert(slash != NULL && slash > pg + 13, "IDEMGATE_TEST_PG_URL: %s", pg);
    char pg_env[700];
    snprintf(pg_env, sizeof pg_env, "IDEMGATE_POSTGRES_URL=%.*s/%s", (int)(slash - pg), pg, fresh_db);
    const char *env[] = {pg_env, "IDEMGATE_REDIS_URL=", NULL};
    static const char conf[] = E2E_CONF_HEAD "upstreams:\n" E2E_CONF_UPSTREAM(
        "api", "{{UPSTREAM_URL}}", "5s") "routes:\n" E2E_CONF_ROUTE("pay", "/v1/pay", "api") "      key: required\n";
    struct e2e_gw_opts o = {.up = up, .env = env, .no_wait = true};
    struct e2e_gw *gw[3];
    for (int i = 0; i < 3; i++)
        gw[i] = e2e_gw_start(conf, &o);
    for (int i = 0; i < 3; i++) {
        cr_assert(e2e_gw_readyz_wait(gw[i], 200, 15000), "instance %d never ready", i);
        cr_expect(!e2e_gw_log_contains(gw[i], "level=error"), "instance %d logged an error", i);
    }
    char key[96];
    e2e_mkkey(key, sizeof key, "fresh");
    struct e2e_resp r;
    for (int i = 0; i < 3; i++) {
        post(gw[i]->port, "/v1/pay", key, "x", NULL, &r);
        cr_expect_eq(r.status, 200, "instance %d: %ld %.200s", i, r.status, (const char *)r.body);
        cr_expect_eq(e2e_resp_is_replay(&r), i > 0, "instance %d replayed: %d", i, (int)e2e_resp_is_replay(&r));
        e2e_resp_free(&r);
    }
    cr_expect_eq(e2e_upstream_count(up, key), 1, "one execution over the three instances");
    for (int i = 0; i < 3; i++)
        cr_expect_eq(e2e_gw_stop(gw[i], 8000), 0);
}

/* ---- SPEC 4: the answer is stored before the client gets it: the moment the first answer arrives, a retry at
 * another instance is a replay (never 409) and the record is listed completed */

Test(audit15, the_answer_is_stored_before_the_client_gets_it)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf pc = {.idem = "key: required\n"};
    struct e2e_gw *a = e2e_gw_start_pay(up, &pc, admin_env);
    struct e2e_gw *b = e2e_gw_start_pay(up, &pc, admin_env);
    int bad = 0;
    for (int i = 0; i < 30; i++) {
        char key[96];
        e2e_mkkey(key, sizeof key, "stored");
        struct e2e_resp r;
        post(a->port, "/v1/pay", key, "x", NULL, &r);
        cr_assert_eq(r.status, 200, "first %d: %ld %.200s", i, r.status, (const char *)r.body);
        e2e_resp_free(&r);
        post(b->port, "/v1/pay", key, "x", NULL, &r);
        if (r.status != 200 || !e2e_resp_is_replay(&r)) {
            cr_log_error("key %d: the retry at the other instance got %ld %.200s", i, r.status, (const char *)r.body);
            bad++;
        }
        e2e_resp_free(&r);
        if (i % 10 == 0) {
            admin(a, "GET", "keys", "pay", key, ADMIN_TOKEN, &r);
            cr_expect(strstr((const char *)r.body, "\"state\":\"completed\"") != NULL, "listed completed: %.300s",
                      (const char *)r.body);
            e2e_resp_free(&r);
        }
        cr_expect_eq(e2e_upstream_count(up, key), 1);
    }
    cr_expect_eq(bad, 0, "%d retries right after the answer were not replays", bad);
}

/* ---- SPEC 4: on_unknown: retry forwards again after the lease with the same key under a new fencing token */

/* The "token" string of the first record in an /admin/keys listing (copied into out; "" when none). */
static void listed_token(const struct e2e_gw *g, const char *key, char *out, size_t n)
{
    struct e2e_resp r;
    admin(g, "GET", "keys", "pay", key, ADMIN_TOKEN, &r);
    out[0] = '\0';
    const char *t = r.body ? strstr((const char *)r.body, "\"token\":\"") : NULL;
    if (t != NULL) {
        t += 9;
        size_t len = strcspn(t, "\"");
        snprintf(out, n, "%.*s", (int)len, t);
    }
    e2e_resp_free(&r);
}

Test(audit15, a_retried_unknown_outcome_gets_a_new_fencing_token)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf pc = {.idem = "key: required\nlease: 1s\non_unknown: retry\n"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &pc, admin_env);
    char key[96], t1[64], t2[64];
    e2e_mkkey(key, sizeof key, "fence");
    struct e2e_resp r;
    post(gw->port, "/v1/pay", key, "x", "X-Test-Action: close", &r);
    expect_full_problem(&r, 502, "upstream-no-response", "closed after the request");
    e2e_resp_free(&r);
    listed_token(gw, key, t1, sizeof t1);
    cr_expect(t1[0] != '\0', "the unknown record is listed with its token");
    e2e_sleep_ms(1300);
    post(gw->port, "/v1/pay", key, "x", NULL, &r);
    cr_expect_eq(r.status, 200, "after the lease: %ld %.200s", r.status, (const char *)r.body);
    cr_expect(!e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2, "forwarded again with the same key");
    listed_token(gw, key, t2, sizeof t2);
    cr_expect(t2[0] != '\0' && strcmp(t1, t2) != 0, "a new fencing token: %s then %s", t1, t2);
    post(gw->port, "/v1/pay", key, "x", NULL, &r);
    cr_expect(e2e_resp_is_replay(&r), "the retried attempt's answer is stored");
    e2e_resp_free(&r);
}

/* ---- SPEC 5: /readyz's redis state (and idemgate_redis_up) tells the truth about a Redis that accepts connections
 * but never answers (a paused server: the kernel completes the handshake); requests do not wait for it */

Test(audit15, a_redis_that_never_answers_is_down_and_costs_nothing)
{
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert(ls >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    cr_assert_eq(bind(ls, (struct sockaddr *)&sa, sizeof sa), 0);
    cr_assert_eq(listen(ls, 64), 0); /* never accepted, never answered */
    cr_assert_eq(getsockname(ls, (struct sockaddr *)&sa, &sl), 0);
    char port[16];
    snprintf(port, sizeof port, "%u", (unsigned)ntohs(sa.sin_port));
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const char *vars[] = {"MUTE_PORT", port, NULL};
    struct e2e_gw_opts o = {.up = up, .vars = vars, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(
        E2E_CONF_PORTS E2E_CONF_STORE(
            "redis://127.0.0.1:{{MUTE_PORT}}/0") "  redis_timeout: 50ms\n"
                                                 "upstreams:\n" E2E_CONF_UPSTREAM(
                                                     "api", "{{UPSTREAM_URL}}",
                                                     "5s") "routes:\n" E2E_CONF_ROUTE("pay", "/v1/pay",
                                                                                      "api") "      key: required\n",
        &o);
    struct e2e_resp r;
    bool seen_up = false;
    for (uint64_t end = e2e_now_ms() + 1500; e2e_now_ms() < end; e2e_sleep_ms(50)) {
        e2e_get(gw->admin_port, "/readyz", &r);
        seen_up = seen_up || strstr((const char *)r.body, "\"redis\":\"up\"") != NULL;
        cr_expect_eq(r.status, 200, "Postgres answers: ready (%ld)", r.status);
        e2e_resp_free(&r);
    }
    cr_expect(!seen_up, "a Redis that never answered a command was reported up");
    e2e_get(gw->admin_port, "/metrics", &r);
    cr_expect_eq(e2e_metric_value((const char *)r.body, "idemgate_redis_up", (const char *const[]){NULL}), 0.0,
                 "idemgate_redis_up");
    e2e_resp_free(&r);
    once_then_replays(gw, up, "mute", 3);
    close(ls);
}
