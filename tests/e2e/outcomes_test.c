/* outcomes_test.c - SPEC 11's outcome classes end to end: one request of each class against the real gateway, test
 * upstream, Postgres and Redis; each moves exactly its own idemgate_requests_total{route,outcome}, its access line
 * names the same outcome, and the status page's error count (status.json) moves only for the server-side classes
 * (unknown, store_unavailable, upstream_error, overloaded): a client's mistake is rejected, never an error. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <jansson.h>

#include "harness.h"

TestSuite(outcomes, .init = e2e_setup, .fini = e2e_teardown, .timeout = 180);

#define SW_SECRET  "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
#define JWT_SECRET "outcomes-test-hs256-secret-of-32-bytes-or-more"

/* clang-format off */
static const char *const conf_all =
    E2E_CONF_HEAD
    "jwt:\n"
    "  secret_env: E2E_OUT_JWT\n"
    "upstreams:\n"
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "1s")
    E2E_CONF_UPSTREAM("dead", "http://127.0.0.1:{{DEAD_PORT}}", "1s")
    "routes:\n"
    E2E_CONF_ROUTE("pay", "/v1/pay", "api")
    "      key: required\n"
    "      lease: 30s\n"
    "      max_body: 1KiB\n"
    "      release_statuses: [503]\n"
    E2E_CONF_ROUTE("acct", "/v1/accounts", "api")
    "      key: optional\n"
    "    ordering:\n"
    "      resource: /v1/accounts/{id}/address\n"
    "      sequence: header:X-Sequence\n"
    "      on_gap: reject\n"
    E2E_CONF_ROUTE("pass", "/v1/pass", "api")
    "      key: off\n"
    E2E_CONF_ROUTE("dead", "/v1/dead", "dead")
    "      key: required\n"
    E2E_CONF_ROUTE("tok", "/v1/tok", "api")
    "      key: required\n"
    "      scope: [jwt:sub]\n"
    "  - name: hook\n"
    "    match: {path: /webhooks/sw}\n"
    "    upstream: api\n"
    "    verify: {scheme: standard-webhooks, secrets_env: [E2E_OUT_SW]}\n"
    "    idempotency:\n"
    "      key: required\n"
    "      key_from: header:webhook-id\n";

/* No Postgres to talk to, and room for one client connection only. */
static const char *const conf_down =
    E2E_CONF_PORTS
    "max_connections: 1\n"
    "store:\n"
    "  postgres: \"postgresql://idemgate@127.0.0.1:{{DEAD_PORT}}/idemgate?connect_timeout=1\"\n"
    "upstreams:\n"
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")
    "routes:\n"
    E2E_CONF_ROUTE("pay", "/v1/pay", "api")
    "      key: required\n";
/* clang-format on */

/* SPEC 11's outcomes; the last four are the server-side ones, the only errors. */
static const char *const outcomes[] = {"forwarded",   "replayed", "mismatch",          "in_flight",      "rejected",
                                       "passthrough", "unknown",  "store_unavailable", "upstream_error", "overloaded"};
#define N_OUTCOMES (sizeof outcomes / sizeof outcomes[0])

static bool server_side(const char *o)
{
    return strcmp(o, "unknown") == 0 || strcmp(o, "store_unavailable") == 0 || strcmp(o, "upstream_error") == 0 ||
           strcmp(o, "overloaded") == 0;
}

/* A route's counts: idemgate_requests_total by outcome, and the status page's errors. */
struct counts {
    double out[N_OUTCOMES];
    long errors;
};

static void counts_of(const struct e2e_gw *gw, const char *route, struct counts *c)
{
    struct e2e_resp m, s;
    e2e_get(gw->admin_port, "/metrics", &m);
    cr_assert_eq(m.status, 200, "/metrics: %ld", m.status);
    char rl[96], ol[96];
    snprintf(rl, sizeof rl, "route=\"%s\"", route);
    for (size_t i = 0; i < N_OUTCOMES; i++) {
        snprintf(ol, sizeof ol, "outcome=\"%s\"", outcomes[i]);
        const char *labels[] = {rl, ol, NULL};
        c->out[i] = e2e_metric_value((const char *)m.body, "idemgate_requests_total", labels);
    }
    e2e_resp_free(&m);
    e2e_get(gw->admin_port, "/status.json", &s);
    cr_assert_eq(s.status, 200, "/status.json: %ld", s.status);
    json_error_t je;
    json_t *j = json_loads((const char *)s.body, 0, &je);
    cr_assert_not_null(j, "status.json: %s: %.500s", je.text, (const char *)s.body);
    c->errors = 0; /* a route shows up once it saw a request */
    size_t i;
    json_t *r;
    json_array_foreach(json_object_get(j, "routes"), i, r)
    {
        const char *name = json_string_value(json_object_get(r, "name"));
        if (!name || strcmp(name, route) != 0)
            continue;
        json_t *e = json_object_get(r, "errors");
        cr_expect(json_is_integer(e), "status.json has no errors count for route %s: %.800s", route,
                  (const char *)s.body);
        c->errors = json_is_integer(e) ? (long)json_integer_value(e) : -1000;
    }
    json_decref(j);
    e2e_resp_free(&s);
}

/* The access line holding needle in log (a bounded copy into out), or false. */
static bool access_line(const char *log, const char *needle, char *out, size_t n)
{
    for (const char *p = strstr(log, needle); p; p = strstr(p + 1, needle)) {
        const char *l = p;
        while (l > log && l[-1] != '\n')
            l--;
        const char *eol = strchr(p, '\n');
        size_t len = eol ? (size_t)(eol - l) : strlen(l);
        snprintf(out, n, "%.*s", (int)(len < n ? len : n - 1), l);
        if (strstr(out, "event=access"))
            return true;
    }
    return false;
}

/* The access line of the answer r (by its request id) names the outcome. */
static void expect_access_outcome(const struct e2e_gw *gw, const struct e2e_resp *r, const char *outcome,
                                  const char *what)
{
    const char *rid = e2e_resp_header(r, "X-Request-Id");
    cr_assert(rid, "%s: no X-Request-Id", what);
    char needle[200], want[64], line[2048];
    snprintf(needle, sizeof needle, "request_id=%s ", rid);
    snprintf(want, sizeof want, " outcome=%s ", outcome);
    bool found = false;
    for (int i = 0; i < 200 && !found; i++) { /* bounded: 10 s (a loaded machine) */
        char *log = e2e_gw_log(gw);
        found = access_line(log, needle, line, sizeof line);
        free(log);
        if (!found)
            e2e_sleep_ms(50);
    }
    if (!found)
        e2e_proc_dump_log(&gw->proc, 4000);
    cr_assert(found, "%s: no access line for %s", what, rid);
    cr_expect(strstr(line, want), "%s: the access line names outcome=%s: %s", what, outcome, line);
}

/* Between before and after, route's outcome moved by one and no other outcome moved; the status page's error count
 * moved by one for a server-side outcome, else not at all. */
static void expect_moved(const struct counts *before, const struct counts *after, const char *outcome, const char *what)
{
    for (size_t i = 0; i < N_OUTCOMES; i++) {
        double d = after->out[i] - before->out[i];
        cr_expect_eq(d, strcmp(outcomes[i], outcome) == 0 ? 1.0 : 0.0, "%s: outcome=\"%s\" moved by %g (want %s)", what,
                     outcomes[i], d, outcome);
    }
    long de = after->errors - before->errors;
    cr_expect_eq(de, server_side(outcome) ? 1 : 0, "%s (%s): the status page's errors moved by %ld", what, outcome, de);
}

/* One request: its status, then its class on route. */
static void one(const struct e2e_gw *gw, const char *route, const char *outcome, long status, const char *method,
                const char *path, const char *key, const char *const *extra, const char *body, const char *what)
{
    struct counts b, a;
    counts_of(gw, route, &b);
    struct e2e_resp r;
    e2e_http_key(gw->port, method, path, key, extra, body, 0, &r);
    cr_expect_eq(r.status, status, "%s: status %ld (%s) %.300s", what, r.status, r.error,
                 r.body ? (const char *)r.body : "");
    counts_of(gw, route, &a);
    expect_moved(&b, &a, outcome, what);
    expect_access_outcome(gw, &r, outcome, what);
    e2e_resp_free(&r);
}

Test(outcomes, each_class_moves_its_label_and_only_server_side_ones_are_errors)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    static const char *const env[] = {"E2E_OUT_SW=" SW_SECRET, "E2E_OUT_JWT=" JWT_SECRET, NULL};
    struct e2e_gw_opts o = {.up = up, .env = env, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(conf_all, &o);
    char key[64], k2[64], id[64], path[160];
    e2e_mkkey(key, sizeof key, "out");

    /* the idempotent life cycle */
    one(gw, "pay", "forwarded", 200, "POST", "/v1/pay/x", key, NULL, "{\"a\":1}", "a new key");
    one(gw, "pay", "replayed", 200, "POST", "/v1/pay/x", key, NULL, "{\"a\":1}", "its retry");
    one(gw, "pay", "mismatch", 422, "POST", "/v1/pay/x", key, NULL, "{\"a\":2}", "the key with another body");
    /* a release status answered by the upstream: forwarded */
    const char *const rel[] = {"X-Test-Status: 503", NULL};
    e2e_mkkey(k2, sizeof k2, "out-rel");
    one(gw, "pay", "forwarded", 503, "POST", "/v1/pay/x", k2, rel, "{}", "a release status");

    /* the client's mistakes: rejected, never errors */
    one(gw, "pay", "rejected", 400, "POST", "/v1/pay/x", NULL, NULL, "{}", "key missing");
    const char *const badkey[] = {"Idempotency-Key: a\x01", NULL};
    one(gw, "pay", "rejected", 400, "POST", "/v1/pay/x", NULL, badkey, "{}", "key invalid");
    char big[2048];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    e2e_mkkey(k2, sizeof k2, "out-big");
    one(gw, "pay", "rejected", 413, "POST", "/v1/pay/x", k2, NULL, big, "a body over max_body");
    one(gw, "_none", "rejected", 404, "POST", "/nowhere", NULL, NULL, "{}", "no route");
    e2e_mkkey(k2, sizeof k2, "out-tok");
    one(gw, "tok", "rejected", 401, "POST", "/v1/tok/x", k2, NULL, "{}", "no bearer token on a jwt: scope");
    const char *const unsigned_hook[] = {"webhook-id: msg_out", "webhook-timestamp: 1700000000",
                                         "webhook-signature: v1,bm90IGEgc2lnbmF0dXJl", NULL};
    one(gw, "hook", "rejected", 401, "POST", "/webhooks/sw", NULL, unsigned_hook, "{}", "a bad signature");

    /* the ordering guard: a stale or gapped sequence, or a malformed one, is the client's mistake */
    e2e_mkkey(id, sizeof id, "acct");
    snprintf(path, sizeof path, "/v1/accounts/%s/address", id);
    const char *const s5[] = {"X-Sequence: 5", NULL}, *const s3[] = {"X-Sequence: 3", NULL},
                      *const s9[] = {"X-Sequence: 9", NULL}, *const sbad[] = {"X-Sequence: 05", NULL};
    one(gw, "acct", "passthrough", 200, "PATCH", path, NULL, s5, "{}", "sequence 5 without a key");
    one(gw, "acct", "rejected", 409, "PATCH", path, NULL, s3, "{}", "stale sequence 3");
    e2e_mkkey(k2, sizeof k2, "out-stale");
    one(gw, "acct", "rejected", 409, "PATCH", path, k2, s3, "{}", "stale sequence 3 with a key");
    one(gw, "acct", "rejected", 409, "PATCH", path, NULL, s9, "{}", "sequence 9 after 5: a gap");
    one(gw, "acct", "rejected", 400, "PATCH", path, NULL, sbad, "{}", "sequence invalid");

    /* no idempotency applies: passthrough */
    one(gw, "pass", "passthrough", 200, "POST", "/v1/pass/x", NULL, NULL, "{}", "key: off");
    one(gw, "pay", "passthrough", 200, "GET", "/v1/pay/x", NULL, NULL, NULL, "a method outside the route's");

    /* server-side: errors */
    const char *const slow[] = {"X-Test-Delay-Ms: 3000", NULL};
    e2e_mkkey(k2, sizeof k2, "out-504");
    one(gw, "pay", "unknown", 504, "POST", "/v1/pay/x", k2, slow, "{}", "a timeout after sending");
    /* its retry within the lease finds the claim in flight */
    one(gw, "pay", "in_flight", 409, "POST", "/v1/pay/x", k2, NULL, "{}", "the unknown outcome's retry");
    one(gw, "pass", "upstream_error", 504, "POST", "/v1/pass/x", NULL, slow, "{}", "a passthrough timeout");
    e2e_mkkey(k2, sizeof k2, "out-dead");
    one(gw, "dead", "upstream_error", 502, "POST", "/v1/dead/x", k2, NULL, "{}", "the upstream unreachable");
    e2e_gw_stop(gw, 5000);
}

Test(outcomes, store_down_and_connection_limit_are_server_side)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw_opts o = {.up = up};
    struct e2e_gw *gw = e2e_gw_start(conf_down, &o);
    char key[64];
    e2e_mkkey(key, sizeof key, "out-down");
    one(gw, "pay", "store_unavailable", 503, "POST", "/v1/pay/x", key, NULL, "{}", "Postgres unreachable");
    e2e_sleep_ms(300); /* the last client connection is closed and no longer counted (max_connections: 1) */
    one(gw, "pay", "rejected", 400, "POST", "/v1/pay/x", NULL, NULL, "{}", "key missing while Postgres is down");

    /* a second client connection while one is held: 503 too-many-connections */
    e2e_sleep_ms(300);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(gw->port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    e2e_sleep_ms(300); /* accepted and counted */
    e2e_mkkey(key, sizeof key, "out-conns");
    one(gw, "pay", "overloaded", 503, "POST", "/v1/pay/x", key, NULL, "{}", "over max_connections");
    close(fd);
    e2e_gw_stop(gw, 5000);
}
