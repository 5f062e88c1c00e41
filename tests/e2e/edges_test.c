/* edges_test.c - end-to-end tests of the client-facing edges (SPEC 7) on raw sockets: the request target is
 * validated and normalised once before routing, never lets a request go anywhere but the configured upstream,
 * the raw header block is checked for what libmicrohttpd would rewrite, methods are case-sensitive tokens, two
 * key headers are refused, X-Forwarded-* are the gateway's own, HEAD keeps the upstream's Content-Length, a replay
 * carries exactly one Idempotent-Replayed, large answers reach the client whole, and admin query values are
 * decoded strictly. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <ctype.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

TestSuite(edges, .init = e2e_setup, .fini = e2e_teardown, .timeout = 120);

#define RAW_TIMEOUT_MS 5000

/* clang-format off */
/* Upstream "api" (h1: an IP address) and "curlapi" (libcurl: a host name), both the test upstream; an idempotent
 * route with a required key, pass-through routes on each upstream, and everything else to {{DEFAULT}}. */
static const char conf_edges[] =
    E2E_CONF_HEAD
    "upstreams:\n"
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")
    E2E_CONF_UPSTREAM("curlapi", "http://localhost:{{UPSTREAM_PORT}}", "5s")
    "routes:\n"
    E2E_CONF_ROUTE("payments", "/v1/payments", "api")
    "      key: required\n"
    E2E_CONF_ROUTE("pass", "/v1/pass", "api")
    "      key: off\n"
    E2E_CONF_ROUTE("cpass", "/v1/curl", "curlapi")
    "      key: off\n"
    "  - name: headkeyed\n"
    "    match:\n"
    "      path_prefix: /v1/headkeyed\n"
    "      methods: [HEAD, POST]\n"
    "    upstream: api\n"
    "    idempotency:\n"
    "      key: required\n"
    "default_upstream: {{DEFAULT}}\n";
/* clang-format on */

static struct e2e_gw *start_edges(const struct e2e_upstream *up, const char *deflt)
{
    static const char *vars_api[] = {"DEFAULT", "api", NULL};
    static const char *vars_curl[] = {"DEFAULT", "curlapi", NULL};
    const char *const *vars = strcmp(deflt, "api") == 0 ? vars_api : vars_curl;
    static const char *const env[] = {"IDEMGATE_ADMIN_TOKEN=edges-admin", NULL};
    struct e2e_gw_opts o = {.up = up, .vars = vars, .env = env, .wait_ready = true};
    return e2e_gw_start(conf_edges, &o);
}

/* ---- raw requests */

static void raw_n(const struct e2e_gw *gw, const char *req, size_t len, struct e2e_raw *out)
{
    e2e_raw_send(gw->port, req, len, RAW_TIMEOUT_MS, out);
}

static void raw(const struct e2e_gw *gw, const char *req, struct e2e_raw *out)
{
    raw_n(gw, req, strlen(req), out);
}

/* The body of a raw answer (after the blank line), or "". */
static const char *raw_body(const struct e2e_raw *r)
{
    const char *b = r->data ? strstr(r->data, "\r\n\r\n") : NULL;
    return b ? b + 4 : "";
}

/* The answer is a problem of that status and name. */
static void expect_raw_problem(const struct e2e_raw *r, int status, const char *name, const char *what)
{
    char want[128];
    snprintf(want, sizeof want, "\"urn:idemgate:problem:%s\"", name);
    cr_expect_eq(r->status, status, "%s: status %d, want %d (%.300s)", what, r->status, status, r->data ? r->data : "");
    cr_expect(strstr(raw_body(r), want) != NULL, "%s: want problem %s, got %.300s", what, name, r->data ? r->data : "");
}

/* The value of a header of a raw answer (up to its CR LF) into buf; NULL when absent. */
static const char *raw_header(const struct e2e_raw *r, const char *name, char *buf, size_t n)
{
    const char *end = r->data ? strstr(r->data, "\r\n\r\n") : NULL;
    if (!end)
        return NULL;
    const char *v = e2e_raw_header(r->data, (size_t)(end - r->data) + 2, name);
    if (!v)
        return NULL;
    while (*v == ' ')
        v++;
    const char *e = strstr(v, "\r\n");
    size_t l = e ? (size_t)(e - v) : strlen(v);
    snprintf(buf, n, "%.*s", (int)l, v);
    return buf;
}

/* How many times a header appears in a raw answer's head. */
static size_t raw_header_count(const struct e2e_raw *r, const char *name)
{
    const char *end = r->data ? strstr(r->data, "\r\n\r\n") : NULL;
    size_t n = 0, nl = strlen(name);
    for (const char *p = r->data ? strstr(r->data, "\r\n") : NULL; p && p < end; p = strstr(p + 2, "\r\n"))
        n += strncasecmp(p + 2, name, nl) == 0 && p[2 + nl] == ':';
    return n;
}

/* ---- a canary: a listener nobody may connect to */
struct canary {
    int fd;
    uint16_t port;
};

static void canary_open(struct canary *c)
{
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    cr_assert(c->fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert(bind(c->fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    cr_assert(listen(c->fd, 64) == 0);
    socklen_t sl = sizeof sa;
    cr_assert(getsockname(c->fd, (struct sockaddr *)&sa, &sl) == 0);
    c->port = ntohs(sa.sin_port);
}

/* Connections the canary got (waits up to wait_ms for a late one); closes it. */
static int canary_close(struct canary *c, int wait_ms)
{
    int n = 0;
    uint64_t deadline = e2e_now_ms() + (uint64_t)wait_ms;
    for (int i = 0; i < 1000; i++) {
        uint64_t now = e2e_now_ms();
        if (now >= deadline)
            break;
        struct pollfd pf = {.fd = c->fd, .events = POLLIN};
        if (poll(&pf, 1, (int)(deadline - now)) <= 0)
            continue;
        int a = accept(c->fd, NULL, NULL);
        if (a >= 0) {
            n++;
            close(a);
        }
    }
    close(c->fd);
    return n;
}

/* ---- 1. the request target */

Test(edges, target_is_normalised_before_routing_and_forwarding)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    static const char *const paths[] = {"/v1/%70ayments", "/v1/open/../payments", "//v1/payments", "/v1/./payments"};
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        char req[512];
        snprintf(req, sizeof req, "POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}", paths[i]);
        long before = e2e_upstream_count(up, NULL);
        struct e2e_raw r;
        raw(gw, req, &r);
        expect_raw_problem(&r, 400, "idempotency-key-missing", paths[i]);
        free(r.data);
        cr_expect_eq(e2e_upstream_count(up, NULL), before, "%s without a key was forwarded", paths[i]);

        char key[64];
        e2e_mkkey(key, sizeof key, "norm");
        snprintf(req, sizeof req, "POST %s HTTP/1.1\r\nHost: t\r\nIdempotency-Key: %s\r\nContent-Length: 2\r\n\r\n{}",
                 paths[i], key);
        raw(gw, req, &r);
        char uri[256];
        cr_expect_eq(r.status, 200, "%s with a key: %d %.300s", paths[i], r.status, r.data);
        cr_expect_str_eq(raw_header(&r, "X-Echo-Uri", uri, sizeof uri) ? uri : "(none)", "/v1/payments",
                         "%s reached the upstream as %s", paths[i], uri);
        free(r.data);
        cr_expect_eq(e2e_upstream_count(up, key), 1);
    }
}

/* Each shape that names another host is refused or loses its authority: the canary gets no connection. */
static void ssrf_shapes(const char *deflt)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, deflt);
    struct canary can;
    canary_open(&can);
    static const char *const bad[] = {"@127.0.0.1:%u/x", ":%u/x", "x", "*", "@localhost:%u/v1/pass"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char target[128], req[512];
        snprintf(target, sizeof target, bad[i], (unsigned)can.port);
        snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: t\r\n\r\n", target);
        struct e2e_raw r;
        raw(gw, req, &r);
        expect_raw_problem(&r, 400, "bad-request", target);
        free(r.data);
    }
    /* absolute-form: only the path is used, the upstream is the configured one */
    static const char *const absolute[][2] = {{"http://127.0.0.1:%u/x", "/x"},
                                              {"http://127.0.0.1:%u/v1/pass/a?q=1", "/v1/pass/a?q=1"},
                                              {"https://localhost:%u/v1/curl/b", "/v1/curl/b"},
                                              {"HTTP://user:pw@127.0.0.1:%u", "/"}};
    for (size_t i = 0; i < sizeof absolute / sizeof absolute[0]; i++) {
        char target[128], req[512], uri[256];
        snprintf(target, sizeof target, absolute[i][0], (unsigned)can.port);
        snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: t\r\n\r\n", target);
        struct e2e_raw r;
        raw(gw, req, &r);
        cr_expect_eq(r.status, 200, "%s: %d %.300s", target, r.status, r.data);
        cr_expect_str_eq(raw_header(&r, "X-Echo-Uri", uri, sizeof uri) ? uri : "(none)", absolute[i][1],
                         "%s reached the upstream as %s", target, uri);
        free(r.data);
    }
    cr_expect_eq(canary_close(&can, 300), 0, "a request reached the canary (default upstream %s)", deflt);
    e2e_gw_assert_alive(gw, "after the SSRF shapes");
}

Test(edges, ssrf_shapes_never_leave_h1_default_upstream)
{
    ssrf_shapes("api");
}

Test(edges, ssrf_shapes_never_leave_curl_default_upstream)
{
    ssrf_shapes("curlapi");
}

Test(edges, bad_paths_and_queries_are_refused)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    static const char *const bad[] = {
        "/v1/../../x",  "/..",         "/v1/pass/a%2fb", "/v1/pass/a%2Fb",    "/v1/pass/%00",
        "/v1/pass/%zz", "/v1/pass/%4", "/v1/pass/a\\b",  "/v1/pass/\x80x",    "/v1/pass?a\x01",
        "/v1/pass?a#b", "/v1/pass#x",  "/v1/pass/a\x7f", "/v1/pass?\xc3\xa9", "/v1/pass/%2e%2E/%2e%2e/..",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char req[512];
        snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: t\r\n\r\n", bad[i]);
        struct e2e_raw r;
        raw(gw, req, &r);
        expect_raw_problem(&r, 400, "bad-request", bad[i]);
        free(r.data);
    }
    struct e2e_raw r;
    raw(gw, "GET /v1/pass/a b HTTP/1.1\r\nHost: t\r\n\r\n", &r);
    expect_raw_problem(&r, 400, "bad-request", "a space in the path");
    free(r.data);
    cr_expect_eq(e2e_upstream_count(up, NULL), 0, "a refused target was forwarded");

    /* over max_header_bytes (16 KiB): refused as too long */
    size_t n = 17 * 1024;
    char *big = malloc(n + 64);
    memcpy(big, "GET /v1/pass/", 13);
    memset(big + 13, 'a', n);
    size_t len = 13 + n;
    len += (size_t)sprintf(big + len, " HTTP/1.1\r\nHost: t\r\n\r\n");
    raw_n(gw, big, len, &r);
    free(big);
    expect_raw_problem(&r, 414, "uri-too-long", "a 17 KiB target");
    free(r.data);

    /* the query is kept as sent, the path's escapes are upper-cased */
    char uri[256];
    raw(gw, "GET /v1/pass/%3a/x?b=%zz&a=1/../2 HTTP/1.1\r\nHost: t\r\n\r\n", &r);
    cr_expect_eq(r.status, 200, "%.300s", r.data);
    cr_expect_str_eq(raw_header(&r, "X-Echo-Uri", uri, sizeof uri) ? uri : "(none)", "/v1/pass/%3A/x?b=%zz&a=1/../2");
    free(r.data);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1);
}

/* ---- 3. the raw header block */

/* Sends req (len bytes) and expects 400 bad-request with nothing forwarded. */
static void expect_block_refused(const struct e2e_gw *gw, const struct e2e_upstream *up, const char *req, size_t len,
                                 const char *what)
{
    long before = e2e_upstream_count(up, NULL);
    struct e2e_raw r;
    raw_n(gw, req, len, &r);
    expect_raw_problem(&r, 400, "bad-request", what);
    free(r.data);
    cr_expect_eq(e2e_upstream_count(up, NULL), before, "%s: forwarded", what);
}

#define LIT(s) s, sizeof(s) - 1

Test(edges, header_block_rewrites_are_refused)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    expect_block_refused(
        gw, up,
        LIT("POST /v1/pass HTTP/1.1\r\nHost: t\r\nTransfer: chunked\r\n -Encoding\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
        "obs-fold making Transfer-Encoding");
    expect_block_refused(gw, up, LIT("GET /v1/pass HTTP/1.1\r\nHost: t\r\nX-A: foo\r\n\tbar\r\n\r\n"),
                         "obs-fold with HTAB");
    expect_block_refused(gw, up, LIT("GET /v1/pass HTTP/1.1\r\nHost: t\r\nX-A: foo\r\n  \r\n\r\n"),
                         "obs-fold of spaces only");
    expect_block_refused(gw, up, LIT("GET /v1/pass HTTP/1.1\r\nHost: t\r\nX-A: foo\0bar\r\nX-B: 1\r\n\r\n"),
                         "NUL in a value");
    expect_block_refused(gw, up, LIT("GET /v1/pass HTTP/1.1\r\nHost: t\r\nX-A: foo\0\r\n\r\n"),
                         "NUL at the end of the last value");
    expect_block_refused(gw, up, LIT("GET /v1/pass\0/x HTTP/1.1\r\nHost: t\r\n\r\n"), "NUL in the target");
    expect_block_refused(gw, up, LIT("GET /v1/pass HTTP/1.1\r\nHost: t\r\nX-A: foo\rbar\r\n\r\n"),
                         "bare CR in a value");
    expect_block_refused(gw, up, LIT("GET /v1/pass HTTP/1.1\r\nHost: t\r\nX-A: \x01\r\n\r\n"),
                         "control byte in a value");
    expect_block_refused(gw, up, LIT("GET /v1/pass HTTP/1.2\r\nHost: t\r\n\r\n"), "HTTP/1.2");
    expect_block_refused(gw, up, LIT("GET /v1/pass HTTP/1.1\r\nHost: t\r\n\tX: y\r\n\r\n"),
                         "obs-fold of the first header");
    e2e_gw_assert_alive(gw, "after the header block cases");
}

/* Transfer-Encoding in an HTTP/1.0 request: RFC 9112 6.1 says the framing is faulty and the connection must be
 * closed (an HTTP/1.0 hop behind or before us would read the chunks as the next request: TE.0). It was served
 * and the connection kept, so the request written after it was served too. */
Test(edges, transfer_encoding_in_http_1_0_is_refused_and_the_connection_closed)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    long before = e2e_upstream_count(up, NULL);
    struct e2e_raw r;
    raw(gw,
        "POST /v1/pass/te0 HTTP/1.0\r\nHost: t\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
        "1\r\nb\r\n0\r\n\r\n"
        "GET /v1/pass/second HTTP/1.1\r\nHost: t\r\n\r\n",
        &r);
    expect_raw_problem(&r, 400, "bad-request", "HTTP/1.0 with Transfer-Encoding");
    const char *data = r.data ? r.data : "";
    cr_expect_null(strstr(data + 1, "HTTP/1.1 "), "one answer only, the connection closed: %.600s", data);
    free(r.data);
    cr_expect_eq(e2e_upstream_count(up, NULL), before, "nothing forwarded");
}

Test(edges, header_block_odd_but_sound_passes_with_exact_values)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    char req[8192];
    size_t n = (size_t)snprintf(req, sizeof req,
                                "GET /v1/pass/ok HTTP/1.1\nHost: t\nX-Empty:\nX-Tab:\t\tv1\r\nX-Sp:   v 2\n"
                                "X-E2: \r\nX-Mix: a\tb\n");
    for (int i = 0; i < 40; i++)
        n += (size_t)snprintf(req + n, sizeof req - n, "X-H-%d: val-%d%s", i, i, i % 2 ? "\r\n" : "\n");
    n += (size_t)snprintf(req + n, sizeof req - n, "\r\n");
    struct e2e_raw r;
    raw_n(gw, req, n, &r);
    cr_expect_eq(r.status, 200, "%.400s", r.data);
    free(r.data);
    char *h = e2e_upstream_last_headers(up);
    static const char *const want[] = {"X-Empty: \n",   "X-Tab: v1\n",    "X-Sp: v 2\n",     "X-E2: \n",
                                       "X-Mix: a\tb\n", "X-H-0: val-0\n", "X-H-39: val-39\n"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_expect(strstr(h, want[i]) != NULL, "the upstream lacks '%s' in:\n%s", want[i], h);
    free(h);
}

/* ---- 2. methods */

Test(edges, methods_are_case_sensitive_tokens)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    struct e2e_raw r;
    raw(gw, "head /v1/pass HTTP/1.1\r\nHost: t\r\n\r\n", &r);
    expect_raw_problem(&r, 501, "not-implemented", "head");
    free(r.data);
    raw(gw, "Post /v1/payments HTTP/1.1\r\nHost: t\r\nIdempotency-Key: m1\r\nContent-Length: 2\r\n\r\n{}", &r);
    expect_raw_problem(&r, 501, "not-implemented", "Post");
    free(r.data);
    raw(gw, "GE@T /v1/pass HTTP/1.1\r\nHost: t\r\n\r\n", &r);
    expect_raw_problem(&r, 400, "bad-request", "a method that is not a token");
    free(r.data);
    raw_n(gw, LIT("G\x01T /v1/pass HTTP/1.1\r\nHost: t\r\n\r\n"), &r);
    expect_raw_problem(&r, 400, "bad-request", "a control byte in the method");
    free(r.data);
    raw(gw, "GET  /v1/pass/two-spaces HTTP/1.1\r\nHost: t\r\n\r\n", &r);
    cr_expect_eq(r.status, 200, "two spaces after the method: %.300s", r.data);
    free(r.data);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1);
    /* an extension method in upper case is forwarded as any other */
    raw(gw, "PURGE /v1/pass/x HTTP/1.1\r\nHost: t\r\n\r\n", &r);
    cr_expect(r.status != 0 && strstr(raw_body(&r), "urn:idemgate:problem:") == NULL,
              "PURGE is a method like any other: %.300s", r.data);
    free(r.data);
    /* CONNECT asks a proxy for a tunnel, which a reverse proxy does not give (nginx refuses it too); it was
     * forwarded, and against an upstream that said 200 it ended as an unknown outcome */
    long before = e2e_upstream_count(up, NULL);
    raw(gw, "CONNECT /v1/pass/x HTTP/1.1\r\nHost: t\r\n\r\n", &r);
    expect_raw_problem(&r, 501, "not-implemented", "CONNECT");
    free(r.data);
    raw(gw, "CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n", &r);
    cr_expect(r.status == 400 || r.status == 501, "CONNECT in authority-form: %.300s", r.data);
    free(r.data);
    cr_expect_eq(e2e_upstream_count(up, NULL), before, "CONNECT forwarded");
}

/* ---- 4. two key headers */

Test(edges, two_key_headers_are_refused)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    static const char *const reqs[] = {
        "POST /v1/payments HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k1\r\nIdempotency-Key: k1\r\n"
        "Content-Length: 2\r\n\r\n{}",
        "POST /v1/payments HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k1\r\nidempotency-key: k2\r\n"
        "Content-Length: 2\r\n\r\n{}",
        "POST /v1/payments HTTP/1.1\r\nHost: t\r\nIdempotency-Key: \"k1\"\r\nX-A: 1\r\nIDEMPOTENCY-KEY: k1\r\n"
        "Content-Length: 2\r\n\r\n{}",
        /* SPEC 7: any request, also one that passes through (a method outside the route's, a key: off route, the
         * default upstream); these were forwarded with both headers */
        "GET /v1/payments HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k1\r\nIdempotency-Key: k2\r\n\r\n",
        "POST /v1/pass/x HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k1\r\nIdempotency-Key: k2\r\n"
        "Content-Length: 2\r\n\r\n{}",
        "POST /elsewhere HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k1\r\nIdempotency-Key: k1\r\n"
        "Content-Length: 2\r\n\r\n{}",
    };
    for (size_t i = 0; i < sizeof reqs / sizeof reqs[0]; i++) {
        struct e2e_raw r;
        raw(gw, reqs[i], &r);
        expect_raw_problem(&r, 400, "idempotency-key-invalid", reqs[i]);
        free(r.data);
    }
    cr_expect_eq(e2e_upstream_count(up, NULL), 0, "a request with two keys was forwarded");
}

/* ---- 4b. policy never depends on how a path is spelled (SPEC 7) */

#define SPELL_SECRET "e2e-hs256-secret-of-at-least-32-bytes-0123456789"

/* clang-format off */
/* A JWT-scoped route with a required key, an ordered route, and the default upstream for everything else. */
static const char conf_spell[] =
    E2E_CONF_HEAD
    "upstreams:\n"
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")
    "routes:\n"
    E2E_CONF_ROUTE("jwt", "/v1/jwt", "api")
    "      key: required\n"
    "      scope: [jwt:sub]\n"
    E2E_CONF_ROUTE("acct", "/v1/accounts", "api")
    "      key: optional\n"
    "    ordering:\n"
    "      resource: /v1/accounts/{id}/address\n"
    "      sequence: header:X-Sequence\n"
    "default_upstream: api\n"
    "jwt:\n"
    "  secret_env: IDEMGATE_JWT_SECRET\n";
/* clang-format on */

/* "Authorization: Bearer <HS256 token of sub>" and CR LF into out. */
static void spell_bearer(const char *sub, char *out, size_t n)
{
    char payload[256];
    snprintf(payload, sizeof payload, "{\"sub\":\"%s\",\"exp\":%ld}", sub, (long)time(NULL) + 600);
    char *b = e2e_bearer_hs256("{\"alg\":\"HS256\",\"typ\":\"JWT\"}", payload, SPELL_SECRET);
    snprintf(out, n, "%s\r\n", b);
    free(b);
}

/* Spellings of /v1/jwt that a server behind the gateway may read as it (Tomcat and Spring drop ";..." path
 * parameters, many servers fold case, Rails and Spring read ".json" as a format): each meets the jwt route. */
static const char *const jwt_spellings[] = {"/v1/jwt",      "/v1/jwt;",      "/v1/jwt;jsessionid=x", "/V1/JWT",
                                            "/v1/jwt.json", "/V1/Jwt;a=b/x", "/v1;x=1/jwt",          "/v1/JWT.Json",
                                            "/v1/jwt/",     "/v1/jwt%3Bx",   "/V1/JWT%3b/",          "/v1/jwt.json/"};

/* An attacker (a second client, without a token) tries each spelling with the key a victim used; then a retry
 * under each spelling, with a token: the route's policy holds for all of them and the request is executed once.
 * Before: every spelling but the first fell through to default_upstream and was forwarded (and each retry executed
 * again). */
Test(edges, policy_never_depends_on_the_path_spelling)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    static const char *const env[] = {"IDEMGATE_JWT_SECRET=" SPELL_SECRET, NULL};
    struct e2e_gw_opts o = {.up = up, .env = env, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(conf_spell, &o);
    char alice[1024], key[64], req[2048];
    spell_bearer("alice", alice, sizeof alice);
    e2e_mkkey(key, sizeof key, "spell");
    /* the victim */
    snprintf(req, sizeof req,
             "POST /v1/jwt HTTP/1.1\r\nHost: t\r\n%sIdempotency-Key: %s\r\nContent-Length: 2\r\n\r\n{}", alice, key);
    struct e2e_raw r;
    raw(gw, req, &r);
    cr_expect_eq(r.status, 200, "the victim: %.300s", r.data ? r.data : "");
    free(r.data);
    /* the attacker: no token, every spelling, with and without the key */
    for (size_t i = 0; i < sizeof jwt_spellings / sizeof jwt_spellings[0]; i++) {
        for (int k = 0; k < 2; k++) {
            char kh[96] = "";
            if (k)
                snprintf(kh, sizeof kh, "Idempotency-Key: %s\r\n", key);
            snprintf(req, sizeof req, "POST %s HTTP/1.1\r\nHost: t\r\n%sContent-Length: 2\r\n\r\n{}", jwt_spellings[i],
                     kh);
            raw(gw, req, &r);
            expect_raw_problem(&r, 401, "invalid-credentials", req);
            free(r.data);
        }
    }
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "a request without a token was forwarded");
    /* retries with the token under every spelling: replayed, or refused as another request (the path, as forwarded,
     * is in the fingerprint: /V1/JWT is not /v1/jwt to an upstream that is case-sensitive); never executed again */
    for (size_t i = 0; i < sizeof jwt_spellings / sizeof jwt_spellings[0]; i++) {
        snprintf(req, sizeof req, "POST %s HTTP/1.1\r\nHost: t\r\n%sIdempotency-Key: %s\r\nContent-Length: 2\r\n\r\n{}",
                 jwt_spellings[i], alice, key);
        raw(gw, req, &r);
        cr_expect(r.status == 200 || r.status == 422, "retry %s: %.300s", jwt_spellings[i], r.data ? r.data : "");
        free(r.data);
    }
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "a retry under another spelling was executed again");
    /* the path is forwarded as sent */
    snprintf(req, sizeof req,
             "POST /V1/Jwt;a=b/x HTTP/1.1\r\nHost: t\r\n%sIdempotency-Key: %s-2\r\nContent-Length: 2\r\n\r\n{}", alice,
             key);
    raw(gw, req, &r);
    char uri[256];
    cr_expect_eq(r.status, 200, "%.300s", r.data ? r.data : "");
    cr_expect_str_eq(raw_header(&r, "X-Echo-Uri", uri, sizeof uri) ?: "(none)", "/V1/Jwt;a=b/x");
    free(r.data);
    /* the ordering guard: one resource, however the path is spelled (its literal segments are the template's) */
    char acct[64], path[256];
    e2e_mkkey(acct, sizeof acct, "spellacct");
    static const char *const shapes[] = {"/v1/accounts/%s/address", "/V1/ACCOUNTS/%s/Address;x=1",
                                         "/v1/accounts;y/%s;z/address.json"};
    for (size_t i = 0; i < 3; i++) {
        snprintf(path, sizeof path, shapes[i], acct);
        snprintf(req, sizeof req, "PATCH %s HTTP/1.1\r\nHost: t\r\nX-Sequence: %zu\r\nContent-Length: 2\r\n\r\n{}",
                 path, i == 0 ? (size_t)5 : (size_t)3);
        raw(gw, req, &r);
        if (i == 0)
            cr_expect_eq(r.status, 200, "%s: %.300s", path, r.data ? r.data : "");
        else
            expect_raw_problem(&r, 409, "stale-sequence", path);
        free(r.data);
    }
}

/* ---- 5. X-Forwarded-* */

Test(edges, forwarded_headers_are_the_gateways_own)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    struct e2e_raw r;
    raw(gw,
        "GET /v1/pass/xf HTTP/1.1\r\nHost: client.example:8443\r\nX-Forwarded-Proto: https\r\n"
        "X-Forwarded-Host: evil.example\r\nForwarded: for=1.2.3.4;proto=https;host=evil.example\r\n"
        "X-Forwarded-For: 1.2.3.4\r\nx-forwarded-proto: gopher\r\nforwarded: by=x\r\n"
        "X-Forwarded-Host: evil2.example\r\nVia: 1.0 x\r\nvia: 1.1 y\r\n"
        "X_Forwarded_Proto: https\r\nx_forwarded_host: evil3.example\r\nX_Forwarded-For: 6.6.6.6\r\n"
        "FORWARDED_: x\r\n\r\n",
        &r);
    cr_expect_eq(r.status, 200, "%.300s", r.data);
    free(r.data);
    char *text = e2e_upstream_last_headers(up);
    struct e2e_hdr *h = NULL;
    size_t n = e2e_parse_header_lines(text, &h);
    cr_expect_eq(e2e_hdrs_count(h, n, "X-Forwarded-Proto"), 1, "%s", text);
    cr_expect_str_eq(e2e_hdrs_get(h, n, "X-Forwarded-Proto") ?: "", "http");
    cr_expect_eq(e2e_hdrs_count(h, n, "X-Forwarded-Host"), 1, "%s", text);
    cr_expect_str_eq(e2e_hdrs_get(h, n, "X-Forwarded-Host") ?: "", "client.example:8443");
    cr_expect_eq(e2e_hdrs_count(h, n, "Forwarded"), 0, "%s", text);
    cr_expect_eq(e2e_hdrs_count(h, n, "X-Forwarded-For"), 1, "%s", text);
    cr_expect_str_eq(e2e_hdrs_get(h, n, "X-Forwarded-For") ?: "", "1.2.3.4, 127.0.0.1");
    /* underscore spellings, which CGI/WSGI servers read as the same header (HTTP_X_FORWARDED_PROTO), are dropped:
     * they were forwarded and bypassed the replacement */
    for (size_t i = 0; i < n; i++)
        cr_expect(strchr(h[i].name, '_') == NULL || strcmp(h[i].name, "FORWARDED_") == 0, "forwarded: %s: %s",
                  h[i].name, h[i].value);
    /* every Via of the client kept, in order, ours last (the second one used to be lost) */
    cr_expect_eq(e2e_hdrs_count(h, n, "Via"), 1, "%s", text);
    cr_expect_str_eq(e2e_hdrs_get(h, n, "Via") ?: "", "1.0 x, 1.1 y, 1.1 idemgate");
    e2e_hdrs_free(h, n);
    free(text);
}

/* SPEC 7: from a peer not in trusted_proxies (none are configured here) the other forwarding headers, which
 * frameworks read as the scheme, port, prefix, client address, the path or the method, are dropped, in every
 * spelling (case, '_' for '-'); they used to be forwarded as sent. */
Test(edges, untrusted_forwarding_headers_are_dropped)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    static const char *const names[] = {
        "X-Forwarded-Ssl",        "X-Forwarded-Scheme", "X-Forwarded-Port", "X-Forwarded-Prefix", "X-Forwarded-Server",
        "Front-End-Https",        "X-Url-Scheme",       "X-Real-IP",        "X-Original-URL",     "X-Rewrite-URL",
        "X-HTTP-Method-Override", "X-HTTP-Method",      "X-Method-Override"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char under[64], lower[64];
        snprintf(under, sizeof under, "%s", names[i]);
        for (char *p = under; *p; p++)
            *p = *p == '-' ? '_' : *p;
        snprintf(lower, sizeof lower, "%s", names[i]);
        for (char *p = lower; *p; p++)
            *p = (char)tolower((unsigned char)*p);
        char req[512];
        snprintf(req, sizeof req,
                 "GET /v1/pass/fw HTTP/1.1\r\nHost: t\r\n%s: on\r\n%s: /admin\r\n%s: DELETE\r\nX-Kept: 1\r\n\r\n",
                 names[i], under, lower);
        struct e2e_raw r;
        raw(gw, req, &r);
        cr_expect_eq(r.status, 200, "%s: %.300s", names[i], r.data);
        free(r.data);
        char *text = e2e_upstream_last_headers(up);
        struct e2e_hdr *h = NULL;
        size_t n = e2e_parse_header_lines(text, &h);
        cr_expect_eq(e2e_hdrs_count(h, n, names[i]), 0, "%s was forwarded: %s", names[i], text);
        cr_expect_eq(e2e_hdrs_count(h, n, under), 0, "%s was forwarded: %s", under, text);
        cr_expect_eq(e2e_hdrs_count(h, n, "X-Kept"), 1, "an ordinary header was dropped: %s", text);
        e2e_hdrs_free(h, n);
        free(text);
    }
}

/* SPEC 7: Host must be one host name, IPv4 address or bracketed IPv6 address with an optional port; anything
 * else (a list, a path, a space, user info, empty) is 400 and nothing is forwarded. These were forwarded, their
 * Host as X-Forwarded-Host. */
Test(edges, host_must_be_one_host_name)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    static const char *const bad[] = {"Host: good.example, evil.example\r\n",
                                      "Host: evil.example/reset?x=\r\n",
                                      "Host: a b\r\n",
                                      "Host:\r\n",
                                      "Host: \r\n",
                                      "Host: user@good.example\r\n",
                                      "Host: good.example:\r\n",
                                      "Host: good.example:99999\r\n",
                                      "Host: good.example:80x\r\n",
                                      "Host: [::1\r\n",
                                      "Host: [zz::1]:80\r\n",
                                      "Host: ::1\r\n",
                                      "Host: a%41\r\n",
                                      "Host: a\r\nHost: a\r\n",
                                      ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        for (int m = 0; m < 2; m++) { /* a pass-through route and the keyed one */
            char req[512];
            if (m == 0)
                snprintf(req, sizeof req, "GET /v1/pass/host HTTP/1.1\r\n%s\r\n", bad[i]);
            else
                snprintf(req, sizeof req,
                         "POST /v1/payments HTTP/1.1\r\n%sIdempotency-Key: host-%zu\r\nContent-Length: 2\r\n\r\n{}",
                         bad[i], i);
            struct e2e_raw r;
            raw(gw, req, &r);
            expect_raw_problem(&r, 400, "bad-request", req);
            free(r.data);
        }
    }
    cr_expect_eq(e2e_upstream_count(up, NULL), 0, "a request with a bad Host was forwarded");
    static const char *const good[] = {"good.example",       "good.example:8080", "127.0.0.1:80", "[::1]:8080",
                                       "[::ffff:127.0.0.1]", "a_b~c-d.e",         "LOCALHOST"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        char req[512], xfh[256];
        snprintf(req, sizeof req, "GET /v1/pass/host HTTP/1.1\r\nHost: %s\r\n\r\n", good[i]);
        struct e2e_raw r;
        raw(gw, req, &r);
        cr_expect_eq(r.status, 200, "Host: %s: %.300s", good[i], r.data);
        free(r.data);
        char *text = e2e_upstream_last_headers(up);
        struct e2e_hdr *h = NULL;
        size_t n = e2e_parse_header_lines(text, &h);
        snprintf(xfh, sizeof xfh, "%s", e2e_hdrs_get(h, n, "X-Forwarded-Host") ?: "(none)");
        cr_expect_str_eq(xfh, good[i]);
        e2e_hdrs_free(h, n);
        free(text);
    }
    /* HTTP/1.0 may leave Host out */
    struct e2e_raw r;
    raw(gw, "GET /v1/pass/host HTTP/1.0\r\n\r\n", &r);
    cr_expect_eq(r.status, 200, "HTTP/1.0 without Host: %.300s", r.data);
    free(r.data);
}

/* ---- 6. HEAD keeps the upstream's Content-Length */

Test(edges, head_passes_the_upstreams_content_length)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    static const char *const paths[] = {"/v1/pass/h", "/v1/curl/h"}; /* h1 and libcurl */
    for (size_t i = 0; i < 2; i++) {
        static const char *const hdrs[] = {"X-Test-Body-Size: 1234", NULL};
        struct e2e_req rq = {.method = "HEAD", .path = paths[i], .headers = hdrs};
        struct e2e_resp r;
        e2e_http(gw->port, &rq, &r);
        cr_expect_eq(r.status, 200, "%s: %ld %s", paths[i], r.status, r.error);
        cr_expect_str_eq(e2e_resp_header(&r, "Content-Length") ?: "(none)", "1234", "%s", paths[i]);
        cr_expect_eq(e2e_resp_header_count(&r, "Content-Length"), 1, "%s", paths[i]);
        cr_expect_eq(r.body_len, 0);
        e2e_resp_free(&r);
    }
    /* the connection stays usable: a raw HEAD then a GET on one connection */
    struct e2e_raw raw_r;
    raw(gw,
        "HEAD /v1/pass/h HTTP/1.1\r\nHost: t\r\nX-Test-Body-Size: 10\r\n\r\n"
        "GET /v1/pass/g HTTP/1.1\r\nHost: t\r\nX-Test-Body-Size: 3\r\nConnection: close\r\n\r\n",
        &raw_r);
    char cl[32];
    cr_expect_str_eq(raw_header(&raw_r, "Content-Length", cl, sizeof cl) ?: "(none)", "10");
    cr_expect_eq(raw_header_count(&raw_r, "Content-Length"), 1);
    const char *second = strstr(raw_r.data ? raw_r.data : "", "\r\n\r\nHTTP/1.1 200");
    cr_expect_not_null(second, "the GET after the HEAD was answered right after its head: %.600s", raw_r.data);
    free(raw_r.data);
}

/* SPEC 7: a HEAD with a body gets a HEAD answer, framed as such (no body read), through h1 and libcurl, on a
 * pass-through and a keyed route; its body is not forwarded (a server that does not read a HEAD's body, as
 * libevent's does not, would take it for the next request on the connection). It used to wait for the answer's
 * body until the upstream timeout: 504, and an unknown outcome on the keyed route. */
Test(edges, head_with_a_body_is_answered_as_a_head)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    static const char *const paths[] = {"/v1/pass/hb", "/v1/curl/hb", "/v1/headkeyed/hb", "/v1/headkeyed/hb"};
    char key[64];
    e2e_mkkey(key, sizeof key, "headbody");
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        char req[1024], kh[96] = "";
        if (strstr(paths[i], "headkeyed"))
            snprintf(kh, sizeof kh, "Idempotency-Key: %s\r\n", key);
        /* the HEAD, then a GET on the same connection: the GET must get its own answer right after the HEAD's */
        snprintf(req, sizeof req,
                 "HEAD %s HTTP/1.1\r\nHost: t\r\n%sX-Test-Body-Size: 10\r\nContent-Length: 5\r\n\r\nhello"
                 "GET /v1/pass/g HTTP/1.1\r\nHost: t\r\nX-Test-Body-Size: 3\r\nConnection: close\r\n\r\n",
                 paths[i], kh);
        uint64_t t0 = e2e_now_ms();
        struct e2e_raw r;
        raw(gw, req, &r);
        uint64_t took = e2e_now_ms() - t0;
        char cl[32];
        cr_expect_eq(r.status, 200, "HEAD %s with a body: %d after %llu ms: %.300s", paths[i], r.status,
                     (unsigned long long)took, r.data ? r.data : "");
        cr_expect(took < 2500, "HEAD %s with a body answered after %llu ms", paths[i], (unsigned long long)took);
        cr_expect_str_eq(raw_header(&r, "Content-Length", cl, sizeof cl) ?: "(none)", "10", "%s", paths[i]);
        const char *second = strstr(r.data ? r.data : "", "\r\n\r\nHTTP/1.1 200");
        cr_expect_not_null(second, "%s: the GET after the HEAD was not answered right after its head: %.600s", paths[i],
                           r.data ? r.data : "");
        free(r.data);
    }
    cr_expect_eq(e2e_upstream_count(up, key), 1, "the keyed HEAD was executed once, then replayed");
    /* the upstream connections stay sound: more requests on each client get their own answers */
    for (size_t i = 0; i < 2; i++) {
        static const char *const hdrs[] = {"X-Test-Body-Size: 7", NULL};
        struct e2e_req rq = {.method = "GET", .path = paths[i], .headers = hdrs};
        struct e2e_resp rr;
        e2e_http(gw->port, &rq, &rr);
        cr_expect_eq(rr.status, 200, "GET %s after: %ld %s", paths[i], rr.status, rr.error);
        cr_expect_eq(rr.body_len, 7, "GET %s after", paths[i]);
        e2e_resp_free(&rr);
    }
}

/* A replayed HEAD carries the stored Content-Length (the record's body is empty), from the in-process cache
 * and from Postgres alike; it used to be 0 (an empty decoded body was taken for a body of 0 bytes). */
Test(edges, a_replayed_head_keeps_the_stored_content_length)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    char key[64], kh[96];
    e2e_mkkey(key, sizeof key, "headreplay");
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    const char *hdrs[] = {"X-Test-Body-Size: 777", kh, NULL};
    for (int i = 0; i < 3; i++) {
        if (i == 2) { /* a new gateway, its cache empty: the record comes from the store */
            e2e_gw_stop(gw, 5000);
            gw = start_edges(up, "api");
        }
        struct e2e_req rq = {.method = "HEAD", .path = "/v1/headkeyed/x", .headers = hdrs};
        struct e2e_resp r;
        e2e_http(gw->port, &rq, &r);
        cr_expect_eq(r.status, 200, "HEAD %d: %ld %s", i, r.status, r.error);
        cr_expect_str_eq(e2e_resp_header(&r, "Content-Length") ?: "(none)", "777", "HEAD %d", i);
        cr_expect_eq(e2e_resp_header_count(&r, "Content-Length"), 1, "HEAD %d", i);
        cr_expect_str_eq(e2e_resp_header(&r, "Idempotent-Replayed") ?: "(none)", i == 0 ? "(none)" : "true", "HEAD %d",
                         i);
        cr_expect_eq(r.body_len, 0);
        e2e_resp_free(&r);
    }
    cr_expect_eq(e2e_upstream_count(up, key), 1, "the HEAD was executed once");
}

/* ---- 7. exactly one Idempotent-Replayed */

Test(edges, replay_carries_exactly_one_replayed_header)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    char key[64];
    e2e_mkkey(key, sizeof key, "replayed");
    static const char *const extra[] = {"X-Test-Header: Idempotent-Replayed: false", NULL};
    struct e2e_resp first, again;
    e2e_http_key(gw->port, "POST", "/v1/payments", key, extra, "{}", 0, &first);
    cr_expect_eq(first.status, 200, "%ld %s", first.status, first.error);
    cr_expect_eq(e2e_resp_header_count(&first, "Idempotent-Replayed"), 0, "the first answer carries the upstream's");
    e2e_http_key(gw->port, "POST", "/v1/payments", key, extra, "{}", 0, &again);
    cr_expect_eq(again.status, 200);
    cr_expect_eq(e2e_resp_header_count(&again, "Idempotent-Replayed"), 1);
    cr_expect_str_eq(e2e_resp_header(&again, "Idempotent-Replayed") ?: "(none)", "true");
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    e2e_resp_free(&first);
    e2e_resp_free(&again);
}

/* ---- 8. an answer within max_response_header_bytes reaches the client whole */

static void expect_big_head(const struct e2e_resp *r, const char *what)
{
    cr_expect_eq(r->status, 200, "%s: %ld %s", what, r->status, r->error);
    size_t pads = 0;
    for (size_t i = 0; i < r->nhdrs; i++)
        pads += strncasecmp(r->hdrs[i].name, "X-Pad-", 6) == 0;
    cr_expect_geq(pads, 160, "%s: %zu pad headers arrived", what, pads);
    cr_expect_not_null(e2e_resp_header(r, "X-Pad-160"), "%s", what);
    cr_expect_gt(r->body_len, 0, "%s: the body arrived", what);
}

/* With a request head near max_header_bytes too: libmicrohttpd 0.9.75 builds the answer's head in the same
 * per-connection pool that still holds the request's head. */
enum req_head { HEAD_SMALL, HEAD_14K, HEAD_MANY };

static void big_heads(enum req_head kind)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    static char fill[14 * 1024 + 16];
    memcpy(fill, "X-Fill: ", 8);
    memset(fill + 8, 'f', 14 * 1024);
    fill[8 + 14 * 1024] = '\0';
    static char many[200][24];
    const char *hdrs[203] = {"X-Test-Header-Bytes: 15360", kind == HEAD_14K ? fill : NULL};
    for (int i = 0; kind == HEAD_MANY && i < 200; i++) {
        snprintf(many[i], sizeof many[i], "X-N-%d: v%d", i, i);
        hdrs[1 + i] = many[i];
    }
    struct e2e_req rq = {.path = "/v1/pass/big", .headers = hdrs};
    struct e2e_resp r;
    e2e_http(gw->port, &rq, &r);
    expect_big_head(&r, "passthrough");
    e2e_resp_free(&r);

    char key[64], kh[96];
    e2e_mkkey(key, sizeof key, "bighead");
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    const char *keyed[204] = {kh};
    for (size_t i = 0; hdrs[i]; i++)
        keyed[1 + i] = hdrs[i];
    struct e2e_req post = {.method = "POST", .path = "/v1/payments", .headers = keyed, .body = "{}", .body_len = 2};
    e2e_http(gw->port, &post, &r);
    expect_big_head(&r, "first");
    e2e_resp_free(&r);
    e2e_http(gw->port, &post, &r);
    expect_big_head(&r, "replay");
    cr_expect(e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
}

Test(edges, answer_with_15k_of_headers_reaches_the_client)
{
    big_heads(HEAD_SMALL);
}

Test(edges, answer_with_15k_of_headers_after_a_14k_request_head)
{
    big_heads(HEAD_14K);
}

Test(edges, answer_with_15k_of_headers_after_200_request_headers)
{
    big_heads(HEAD_MANY);
}

/* A request head whose records would leave no room for the answer's head is refused with a clear 431, not a
 * closed connection. */
Test(edges, request_head_crowding_the_pool_is_431)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    char *req = malloc(64 * 1024);
    size_t n = (size_t)sprintf(req, "GET /v1/pass/many HTTP/1.1\r\nHost: t\r\n");
    for (int i = 0; i < 400; i++)
        n += (size_t)sprintf(req + n, "X-%d: v\r\n", i);
    n += (size_t)sprintf(req + n, "\r\n");
    struct e2e_raw r;
    raw_n(gw, req, n, &r);
    free(req);
    expect_raw_problem(&r, 431, "request-header-fields-too-large", "400 small headers");
    free(r.data);
    cr_expect_eq(e2e_upstream_count(up, NULL), 0);
}

/* ---- 9. admin query values are decoded strictly */

static long admin(const struct e2e_gw *gw, const char *method, const char *path, struct e2e_resp *r)
{
    static const char *const auth[] = {"Authorization: Bearer edges-admin", NULL};
    struct e2e_req rq = {.method = method, .path = path, .headers = auth};
    e2e_http(gw->admin_port, &rq, r);
    return r->status;
}

Test(edges, admin_query_values_with_nul_or_bad_escapes_do_nothing)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_edges(up, "api");
    char key[64];
    e2e_mkkey(key, sizeof key, "abc");
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/payments", key, NULL, "{}", 0, &r);
    cr_assert_eq(r.status, 200);
    e2e_resp_free(&r);

    static const char *const tails[] = {"%00X", "%zz", "%4", "%"};
    static const char *const ops[][2] = {
        {"DELETE", "/admin/keys"}, {"GET", "/admin/keys"}, {"POST", "/admin/keys/release"}};
    for (size_t o = 0; o < 3; o++) {
        for (size_t i = 0; i < 4; i++) {
            char path[256];
            snprintf(path, sizeof path, "%s?route=payments&key=%s%s", ops[o][1], key, tails[i]);
            admin(gw, ops[o][0], path, &r);
            cr_expect_eq(r.status, 400, "%s %s: %ld %s", ops[o][0], path, r.status, r.body);
            cr_expect(e2e_resp_is_problem(&r, "bad-request"), "%s %s: %s", ops[o][0], path, r.body);
            e2e_resp_free(&r);
            snprintf(path, sizeof path, "%s?route=pay%sments&key=%s", ops[o][1], tails[i], key);
            admin(gw, ops[o][0], path, &r);
            cr_expect_eq(r.status, 400, "%s %s: %ld", ops[o][0], path, r.status);
            e2e_resp_free(&r);
        }
    }
    /* the record is still there: listed, and a retry is a replay */
    char path[256];
    snprintf(path, sizeof path, "/admin/keys?route=payments&key=%s", key);
    cr_expect_eq(admin(gw, "GET", path, &r), 200);
    cr_expect(r.body && strstr((const char *)r.body, "\"completed\"") != NULL, "%s", r.body);
    e2e_resp_free(&r);
    e2e_http_key(gw->port, "POST", "/v1/payments", key, NULL, "{}", 0, &r);
    cr_expect(e2e_resp_is_replay(&r), "the record was purged");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    /* a well-formed escaped key still works: %2D is '-' */
    char esc[128];
    const char *dash = strchr(key, '-');
    snprintf(esc, sizeof esc, "/admin/keys?route=payments&key=%.*s%%2D%s", (int)(dash - key), key, dash + 1);
    cr_expect_eq(admin(gw, "DELETE", esc, &r), 200, "%s: %s", esc, r.body);
    e2e_resp_free(&r);
    e2e_http_key(gw->port, "POST", "/v1/payments", key, NULL, "{}", 0, &r);
    cr_expect_not(e2e_resp_is_replay(&r), "the purge by an escaped key did not purge");
    e2e_resp_free(&r);
}
