/* authority_test.c - end-to-end tests of "Postgres is the authority" at the borders (SPEC 8): a Redis that missed
 * a purge (paused, or restored from an older snapshot) never answers for Postgres, and a route's identity (key
 * source, scope and fingerprint parts) is not changed under its records by a reload or a restart. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

TestSuite(authority, .init = e2e_setup, .fini = e2e_teardown, .timeout = 120);

#define ADMIN_TOKEN "e2e-authority-admin-token-8c2e"

static const char *const admin_env[] = {"IDEMGATE_ADMIN_TOKEN=" ADMIN_TOKEN, NULL};

/* ---- helpers */

/* A gateway with route "pay" (key required) on the test Postgres and the Redis at redis_url (a literal URL), with
 * a 50 ms Redis timeout. */
static struct e2e_gw *gw_on_redis(const struct e2e_upstream *up, const char *redis_url)
{
    struct e2e_pay_conf c = {.idem = "key: required\n", .redis = redis_url, .redis_timeout = "50ms"};
    return e2e_gw_start_pay(up, &c, admin_env);
}

static void post(const struct e2e_gw *g, const char *key, const char *body, struct e2e_resp *r)
{
    e2e_http_key(g->port, "POST", "/v1/pay/a", key, NULL, body, 0, r);
}

/* DELETE /admin/keys on g's admin listener; returns the status, the body into body (size n). */
static long admin_purge(const struct e2e_gw *g, const char *key, char *body, size_t n)
{
    char path[512];
    const char *const h[] = {"Authorization: Bearer " ADMIN_TOKEN, NULL};
    struct e2e_resp r;
    snprintf(path, sizeof path, "/admin/keys?route=pay&key=%s", key);
    e2e_http(g->admin_port, &(struct e2e_req){.method = "DELETE", .path = path, .headers = h}, &r);
    long st = r.status;
    snprintf(body, n, "%.*s", (int)r.body_len, r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
    return st;
}

/* redis-cli -s sock ARGS...; the output (heap) or NULL. */
static char *rd_cli(const char *sock, const char *a1, const char *a2)
{
    char cli[512];
    const char *argv[] = {e2e_in_path("redis-cli", cli, sizeof cli), "-s", sock, a1, a2, NULL};
    char *out = NULL;
    if (e2e_run(argv, NULL, 5000, &out, NULL) != 0) {
        free(out);
        return NULL;
    }
    return out;
}

/* Waits until the Redis at sock holds a completed answer (a value that is not an in-flight marker "F...") under
 * some idg: key. */
static bool rd_wait_answer(const char *sock, int timeout_ms)
{
    static const char lua[] = "for _, k in ipairs(redis.call('KEYS', 'idg:*')) do"
                              " local v = redis.call('GET', k)"
                              " if v and string.sub(v, 1, 1) ~= 'F' then return 1 end end return 0";
    char cli[512];
    for (uint64_t end = e2e_now_ms() + (uint64_t)timeout_ms;;) {
        const char *argv[] = {e2e_in_path("redis-cli", cli, sizeof cli), "-s", sock, "EVAL", lua, "0", NULL};
        char *out = NULL;
        bool ok = e2e_run(argv, NULL, 5000, &out, NULL) == 0 && out && strncmp(out, "1", 1) == 0;
        free(out);
        if (ok)
            return true;
        if (e2e_now_ms() >= end)
            return false;
        e2e_sleep_ms(20);
    }
}

/* Waits until every loop of g (each has its Redis link) is up again after a fault: as many new redis_up lines as
 * there were before it (before: the count taken then). */
static bool rd_wait_back(const struct e2e_gw *g, size_t before, int timeout_ms)
{
    for (uint64_t end = e2e_now_ms() + (uint64_t)timeout_ms;;) {
        if (e2e_gw_log_count(g, "event=redis_up") >= 2 * before)
            return true;
        if (e2e_now_ms() >= end)
            return false;
        e2e_sleep_ms(20);
    }
}

/* How many I/O loops g runs (each has its own Redis link): "loops=N" of its started line. */
static size_t gw_loops(const struct e2e_gw *g)
{
    char *log = e2e_gw_log(g);
    const char *p = log ? strstr(log, "event=started ") : NULL;
    p = p ? strstr(p, " loops=") : NULL;
    size_t n = p ? (size_t)strtoul(p + 7, NULL, 10) : 1;
    free(log);
    return n ? n : 1;
}

static long pg_rows(const char *key)
{
    char q[256];
    snprintf(q, sizeof q, "SELECT count(*) FROM idemgate_keys WHERE route = 'pay' AND key = '%s'", key);
    return e2e_psql_long(q);
}

/* Key executed at a (body {"v":1}), replayed at b from Postgres, which puts
 * the answer into Redis (at sock). */
static void answer_in_redis(struct e2e_gw *a, struct e2e_gw *b, const char *sock, const char *key)
{
    struct e2e_resp r;
    post(a, key, "{\"v\":1}", &r);
    cr_assert_eq(r.status, 200, "first: %ld (%s)", r.status, r.error);
    e2e_resp_free(&r);
    post(b, key, "{\"v\":1}", &r);
    cr_assert(e2e_resp_is_replay(&r), "the retry at b: %ld", r.status);
    e2e_resp_free(&r);
    cr_assert(rd_wait_answer(sock, 3000), "b's replay did not put the answer into Redis");
}

/* Both Redis faults' scene: a Redis of the test's own (a unix socket, so that it can be paused and restarted),
 * two gateways on it, and a key executed at a (body {"v":1}) and replayed at b from Postgres, which puts the answer
 * into Redis. */
struct scene {
    char sock[512];
    pid_t rpid;
    struct e2e_upstream *up;
    struct e2e_gw *a, *b;
    char key[96];
};

static void scene_start(struct scene *sc, const char *tag)
{
    char url[600];
    sc->rpid = e2e_redis_unix_start(sc->sock, sizeof sc->sock);
    snprintf(url, sizeof url, "unix://%s", sc->sock);
    sc->up = e2e_upstream_start(NULL);
    sc->a = gw_on_redis(sc->up, url);
    sc->b = gw_on_redis(sc->up, url);
    cr_assert(e2e_gw_log_wait(sc->a, "event=redis_up", 5000) && e2e_gw_log_wait(sc->b, "event=redis_up", 5000));
    e2e_mkkey(sc->key, sizeof sc->key, tag);
    answer_in_redis(sc->a, sc->b, sc->sock, sc->key);
}

/* After the purge Redis missed: the corrected request (another body) is a new key, executed once; its retries,
 * at either instance, replay its answer; the old body is 422 (Postgres holds the new record). */
static void expect_postgres_decides(struct e2e_gw *a, struct e2e_gw *b, struct e2e_upstream *up, const char *key)
{
    struct e2e_resp r;
    post(b, key, "{\"v\":2}", &r);
    cr_expect_eq(r.status, 200, "the corrected request after the purge: %ld %.200s", r.status,
                 r.body ? (const char *)r.body : "");
    cr_expect(!e2e_resp_is_replay(&r), "the corrected request after the purge was answered as a replay");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2, "the corrected request was not executed");
    for (int i = 0; i < 4; i++) {
        post(i % 2 ? a : b, key, "{\"v\":2}", &r);
        cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "retry %d of the corrected request (at %s): %ld %.200s", i,
                  i % 2 ? "a" : "b", r.status, r.body ? (const char *)r.body : "");
        e2e_resp_free(&r);
    }
    post(a, key, "{\"v\":1}", &r);
    cr_expect_eq(r.status, 422, "the old body after the new record: %ld", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2, "executed more than once after the purge");
    char q[256];
    snprintf(q, sizeof q,
             "SELECT count(*) FROM idemgate_keys WHERE route = 'pay' AND key = '%s' AND state = "
             "'completed' AND status = 200",
             key);
    cr_expect_eq(e2e_psql_long(q), 1, "Postgres does not hold the corrected request's record");
}

/* ---- Redis never overrides Postgres */

/* Redis paused (SIGSTOP) while a purge is acknowledged: the DEL never reaches it, and when it is back it still
 * holds the purged answer. That answer must not be replayed, nor a claim Postgres grants be turned into a 422. */
Test(authority, a_purge_while_redis_is_paused_is_not_undone_when_it_is_back)
{
    struct scene sc;
    scene_start(&sc, "auth-paused");
    struct e2e_gw *a = sc.a, *b = sc.b;
    const char *key = sc.key;
    pid_t rpid = sc.rpid;

    size_t ups_a = e2e_gw_log_count(a, "event=redis_up");
    cr_assert_eq(kill(rpid, SIGSTOP), 0);
    /* new keys at a until every loop's Redis link is given up (five timeouts in a row): the purge's DEL is then not
     * sent */
    size_t loops = gw_loops(a);
    for (int i = 0; i < 80 && e2e_gw_log_count(a, "event=redis_reset") < loops; i++) {
        char k[96];
        struct e2e_resp r;
        e2e_mkkey(k, sizeof k, "auth-paused-fill");
        post(a, k, "{\"f\":1}", &r);
        e2e_resp_free(&r);
    }
    cr_assert_geq(e2e_gw_log_count(a, "event=redis_reset"), loops, "a never gave its paused Redis up");
    char body[256];
    long st = admin_purge(a, key, body, sizeof body);
    cr_assert_eq(st, 200, "purge: %ld %s", st, body);
    cr_assert(strstr(body, "\"deleted\":1"), "purge: %s", body);
    cr_assert_eq(pg_rows(key), 0);
    cr_assert_eq(kill(rpid, SIGCONT), 0);
    cr_assert(rd_wait_back(a, ups_a, 8000), "a did not reconnect to Redis");
    cr_assert(rd_wait_answer(sc.sock, 100), "Redis no longer holds the purged answer: the fault did not happen");

    expect_postgres_decides(a, b, sc.up, key);
    e2e_gw_stop(a, 5000);
    e2e_gw_stop(b, 5000);
    kill(rpid, SIGTERM);
    waitpid(rpid, NULL, 0);
}

/* Redis restarted from a snapshot (RDB) taken before a purge: it holds the purged answer again. */
Test(authority, a_redis_restored_from_an_older_snapshot_does_not_undo_a_purge)
{
    struct scene sc;
    scene_start(&sc, "auth-snapshot");
    struct e2e_gw *a = sc.a, *b = sc.b;
    const char *key = sc.key, *sock = sc.sock;
    pid_t rpid = sc.rpid;
    char *out = rd_cli(sock, "SAVE", NULL);
    cr_assert(out && strstr(out, "OK"), "SAVE: %s", out ? out : "(failed)");
    free(out);

    char body[256];
    long st = admin_purge(a, key, body, sizeof body);
    cr_assert_eq(st, 200, "purge: %ld %s", st, body);
    cr_assert_eq(pg_rows(key), 0);
    cr_assert(!rd_wait_answer(sock, 100), "the purge did not delete the Redis copy");

    size_t ups_a = e2e_gw_log_count(a, "event=redis_up"), ups_b = e2e_gw_log_count(b, "event=redis_up");
    /* restarted from the snapshot (the server saves nothing on its way down: --save "") */
    kill(rpid, SIGTERM);
    waitpid(rpid, NULL, 0);
    rpid = e2e_redis_unix_start(sc.sock, sizeof sc.sock);
    cr_assert(rd_wait_answer(sock, 100), "the restored Redis does not hold the purged answer: no fault");
    cr_assert(rd_wait_back(a, ups_a, 8000) && rd_wait_back(b, ups_b, 8000),
              "the gateways did not reconnect to the restarted Redis");

    expect_postgres_decides(a, b, sc.up, key);
    e2e_gw_stop(a, 5000);
    e2e_gw_stop(b, 5000);
    kill(rpid, SIGTERM);
    waitpid(rpid, NULL, 0);
}

/* ---- a route's identity: name, key source, scope parts, fingerprint parts */

/* Rewrites g's config with text (its own rendered config, edited) and sends SIGHUP; waits for the outcome's log line
 * (reloaded or reload_refused) and returns true when the reload was refused. */
static bool reload_with(struct e2e_gw *g, const char *text)
{
    size_t refused = e2e_gw_log_count(g, "event=reload_refused"), done = e2e_gw_log_count(g, "event=reloaded ");
    const char *tmp = e2e_write_file("next.yaml", text);
    cr_assert_eq(rename(tmp, g->conf_path), 0);
    cr_assert_eq(kill(g->proc.pid, SIGHUP), 0);
    for (uint64_t end = e2e_now_ms() + 5000; e2e_now_ms() < end; e2e_sleep_ms(20)) {
        if (e2e_gw_log_count(g, "event=reload_refused") > refused)
            return true;
        if (e2e_gw_log_count(g, "event=reloaded ") > done)
            return false;
    }
    cr_assert_fail("no outcome of the reload logged");
    return false;
}

/* g's rendered config with add inserted after the route's "key: required" line (heap). */
static char *conf_plus(const struct e2e_gw *g, const char *add)
{
    const char *at = strstr(g->conf_text, "      key: required\n");
    cr_assert(at, "no key line in the config");
    size_t head = (size_t)(at - g->conf_text) + strlen("      key: required\n");
    char *out = NULL;
    cr_assert(asprintf(&out, "%.*s%s%s", (int)head, g->conf_text, add, g->conf_text + head) > 0);
    return out;
}

/* A SIGHUP that changes a route's scope or fingerprint would change every key's identity: a completed key's retry
 * executed again (another scope hash), a byte-identical retry answered 422 (another fingerprint). Refused. */
Test(authority, a_reload_that_changes_a_routes_identity_is_refused)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf c = {.idem = "key: required\n"};
    struct e2e_gw *g = e2e_gw_start_pay(up, &c, admin_env);
    char key[96];
    e2e_mkkey(key, sizeof key, "auth-reload");
    struct e2e_resp r;
    post(g, key, "{\"r\":1}", &r);
    cr_assert_eq(r.status, 200);
    e2e_resp_free(&r);

    char *scoped = conf_plus(g, "      scope: [header:Authorization]\n");
    cr_expect(reload_with(g, scoped), "a reload adding a scope part was applied");
    cr_expect(e2e_gw_log_contains(g, "event=reload_refused route=pay changed=scope"));
    free(scoped);
    const char *const auth[] = {"Authorization: Bearer tenant-1", NULL};
    e2e_http_key(g->port, "POST", "/v1/pay/a", key, auth, "{\"r\":1}", 0, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "the completed key's retry after the reload: %ld", r.status);
    e2e_resp_free(&r);

    char *fp = conf_plus(g, "      fingerprint: [method, path, query, body, header:X-Tenant]\n");
    cr_expect(reload_with(g, fp), "a reload adding a fingerprint part was applied");
    cr_expect(e2e_gw_log_contains(g, "event=reload_refused route=pay changed=fingerprint"));
    free(fp);
    post(g, key, "{\"r\":1}", &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "a byte-identical retry after the reload: %ld", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "executed again after the reload");

    /* what does not change the identity still reloads */
    char *longer = conf_plus(g, "      lease: 90s\n");
    cr_expect_not(reload_with(g, longer), "a reload changing only the lease was refused");
    free(longer);
}

/* A gateway with route `route` (key required, the extra idempotency lines) in front of up; strict: without
 * --accept-identity-change; wait: until ready (else the caller checks the start). */
static struct e2e_gw *gw_route(const struct e2e_upstream *up, const char *route, const char *extra, bool strict,
                               bool wait)
{
    char idem[256];
    snprintf(idem, sizeof idem, "key: required\n%s", extra);
    struct e2e_pay_conf c = {.idem = idem, .route = route};
    char *tmpl = e2e_conf_pay(&c);
    struct e2e_gw_opts o = {
        .up = up, .env = admin_env, .wait_ready = wait, .no_wait = !wait, .strict_identity = strict};
    struct e2e_gw *g = e2e_gw_start(tmpl, &o);
    free(tmpl);
    return g;
}

/* The same at a restart: the identity recorded in Postgres is compared; a change under records within retention
 * refuses the start (saying how many) unless --accept-identity-change names the route; without records it is
 * recorded quietly. */
Test(authority, a_start_with_a_changed_identity_is_refused_while_the_route_has_records)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char route[32], empty[40], key[96];
    snprintf(route, sizeof route, "idr%08x", (unsigned)(e2e_now_ms() ^ ((uint64_t)getpid() << 16)));
    snprintf(empty, sizeof empty, "%se", route);
    e2e_mkkey(key, sizeof key, "auth-start");
    struct e2e_gw *g = gw_route(up, route, "", true, true);
    struct e2e_resp r;
    post(g, key, "{\"s\":1}", &r);
    cr_assert_eq(r.status, 200);
    e2e_resp_free(&r);
    e2e_gw_stop(g, 5000);

    g = gw_route(up, route, "scope: [header:Authorization]\n", true, false);
    cr_assert(e2e_proc_wait(&g->proc, 15000), "the gateway started with the changed identity");
    cr_expect_eq(e2e_proc_exit_code(&g->proc), 1);
    char want[160];
    snprintf(want, sizeof want, "route %s: its identity changed (scope;", route);
    cr_expect(e2e_gw_log_contains(g, "event=start_refused"), "no start_refused line");
    cr_expect(e2e_gw_log_contains(g, want), "the log does not name the route and the change");
    cr_expect(e2e_gw_log_contains(g, "and 1 of its records are within retention"), "the log does not count");
    cr_expect(e2e_gw_log_contains(g, "--accept-identity-change"), "the log does not name the flag");

    /* accepted: it starts, says so, and the new identity is the recorded one */
    g = gw_route(up, route, "scope: [header:Authorization]\n", false, true);
    cr_expect(e2e_gw_log_contains(g, "event=route_identity_changed"), "the accepted change is not logged");
    cr_expect(e2e_gw_log_contains(g, "records_within_retention=1"));
    e2e_gw_stop(g, 5000);
    g = gw_route(up, route, "scope: [header:Authorization]\n", true, true);
    e2e_gw_stop(g, 5000);

    /* a route without records changes its identity freely */
    g = gw_route(up, empty, "", true, true);
    e2e_gw_stop(g, 5000);
    g = gw_route(up, empty, "scope: [header:Authorization]\n", true, true);
    cr_expect(e2e_gw_log_contains(g, "records_within_retention=0"));
}
