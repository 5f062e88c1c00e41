/* proxy_test.c - end-to-end tests of the pass-through proxy: the real idemgate in front of the real test upstream,
 * with the real Postgres and Redis (methods, bodies, headers, limits, errors, routing, shutdown, admin, load). */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"

TestSuite(proxy, .init = e2e_setup, .fini = e2e_teardown, .timeout = 90);

/* clang-format off */
/* One upstream "api" (the test upstream). */
#define CONF_UPSTREAM(url, timeout) "upstreams:\n" E2E_CONF_UPSTREAM("api", url, timeout)

/* A pass-through route on /v1/payments. */
#define CONF_PASS_ROUTE(max_body)                                                                                      \
    "routes:\n"                                                                                                        \
    E2E_CONF_ROUTE("pass", "/v1/payments", "api")                                                                      \
    "      key: off\n"                                                                                                 \
    "      max_body: " max_body "\n"

/* A pass-through route on /v1/payments, default_upstream for the rest, 2 MiB bodies. */
static const char conf_pass[] =
    E2E_CONF_HEAD "max_body: 2MiB\n" CONF_UPSTREAM("{{UPSTREAM_URL}}", "5s") CONF_PASS_ROUTE("2MiB")
    "default_upstream: api\n";

/* The same with one I/O loop, and with two (each loop keeps its own upstream connections). */
static const char conf_one_loop[] =
    E2E_CONF_HEAD "max_body: 2MiB\n" "threads: 1\n" CONF_UPSTREAM("{{UPSTREAM_URL}}", "5s") CONF_PASS_ROUTE("2MiB")
    "default_upstream: api\n";
static const char conf_two_loops[] =
    E2E_CONF_HEAD "max_body: 2MiB\n" "threads: 2\n" CONF_UPSTREAM("{{UPSTREAM_URL}}", "5s") CONF_PASS_ROUTE("2MiB")
    "default_upstream: api\n";

/* Two loops, an upstream with max_connections: 2 (a bound over both loops together). */
static const char conf_two_conns[] = E2E_CONF_HEAD "max_body: 2MiB\n" "threads: 2\n" CONF_UPSTREAM("{{UPSTREAM_URL}}", "5s")
    "    max_connections: 2\n" CONF_PASS_ROUTE("2MiB") "default_upstream: api\n";

/* Two loops, an upstream with max_connections: 16 (each loop's share: 8). */
static const char conf_sixteen_conns[] = E2E_CONF_HEAD "max_body: 2MiB\n" "threads: 2\n"
    CONF_UPSTREAM("{{UPSTREAM_URL}}", "5s") "    max_connections: 16\n" CONF_PASS_ROUTE("2MiB")
    "default_upstream: api\n";

/* Same, without default_upstream. */
static const char conf_nodefault[] = E2E_CONF_HEAD CONF_UPSTREAM("{{UPSTREAM_URL}}", "5s") CONF_PASS_ROUTE("1MiB");

/* Small limits: 1 KiB bodies (route and top level), 4 KiB header blocks. */
static const char conf_limits[] =
    E2E_CONF_HEAD "max_body: 1KiB\n" "max_header_bytes: 4KiB\n" CONF_UPSTREAM("{{UPSTREAM_URL}}", "5s")
    CONF_PASS_ROUTE("1KiB") "default_upstream: api\n";

/* Nobody listens on the upstream's port. */
static const char conf_dead[] =
    E2E_CONF_HEAD CONF_UPSTREAM("http://127.0.0.1:{{DEAD_PORT}}", "5s") CONF_PASS_ROUTE("1MiB")
    "default_upstream: api\n";

/* A 500 ms upstream timeout. */
static const char conf_slow[] = E2E_CONF_HEAD CONF_UPSTREAM("{{UPSTREAM_URL}}", "500ms") CONF_PASS_ROUTE("1MiB");
/* clang-format on */

/* ---- helpers */

/* Bytes with every value, NULs included, in a non-periodic order. */
static unsigned char *binary_blob(size_t n, unsigned seed)
{
    unsigned char *b = malloc(n ? n : 1);
    cr_assert_not_null(b);
    uint64_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        b[i] = (i % 7 == 0) ? 0 : (unsigned char)(x >> 56);
    }
    return b;
}

/* ---- methods, bodies, headers */

Test(proxy, every_method_passes_through)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    static const char *const methods[] = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"};
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
        const char *m = methods[i];
        bool with_body = strcmp(m, "POST") == 0 || strcmp(m, "PUT") == 0 || strcmp(m, "PATCH") == 0;
        char path[64], body[64];
        snprintf(path, sizeof path, "/v1/payments/%s", m);
        snprintf(body, sizeof body, "body-of-%s", m);
        struct e2e_req rq = {.method = m, .path = path, .body = with_body ? body : NULL, .body_len = strlen(body)};
        struct e2e_resp r;
        e2e_http(gw->port, &rq, &r);
        cr_expect_eq(r.status, 200, "%s: status %ld (%s)", m, r.status, r.error);
        const char *em = e2e_resp_header(&r, "X-Echo-Method");
        cr_expect(em != NULL && strcmp(em, m) == 0, "%s: upstream saw method %s", m, em ? em : "(none)");
        const char *eu = e2e_resp_header(&r, "X-Echo-Uri");
        cr_expect(eu != NULL && strcmp(eu, path) == 0, "%s: upstream saw uri %s", m, eu ? eu : "(none)");
        if (with_body)
            cr_expect(r.body_len == strlen(body) && memcmp(r.body, body, r.body_len) == 0,
                      "%s: body not echoed: %.100s", m, (const char *)r.body);
        if (strcmp(m, "HEAD") == 0)
            cr_expect_eq(r.body_len, 0, "HEAD answered a body");
        e2e_resp_free(&r);
    }
    cr_expect_eq(e2e_upstream_count(up, NULL), 7, "each method must reach the upstream exactly once");
}

Test(proxy, binary_bodies_with_nuls_are_byte_exact_both_ways)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);

    /* request body with NULs, echoed back */
    size_t n = 70000;
    unsigned char *blob = binary_blob(n, 1);
    static const char *const h[] = {"Content-Type: application/octet-stream", NULL};
    struct e2e_req rq = {.method = "POST", .path = "/v1/payments/bin", .headers = h, .body = blob, .body_len = n};
    struct e2e_resp r;
    e2e_http(gw->port, &rq, &r);
    cr_expect_eq(r.status, 200, "status %ld (%s)", r.status, r.error);
    cr_expect_eq(r.body_len, n, "echo length %zu, sent %zu", r.body_len, n);
    cr_expect(r.body_len == n && memcmp(r.body, blob, n) == 0, "echoed body differs from the sent one");
    e2e_resp_free(&r);
    free(blob);

    /* response body with NULs, Content-Length framed */
    static const char *const h2[] = {"X-Test-Body-Size: 100003", NULL};
    struct e2e_req rq2 = {.path = "/v1/payments/bin", .headers = h2};
    e2e_http(gw->port, &rq2, &r);
    cr_expect_eq(r.status, 200);
    cr_expect_eq(r.body_len, 100003);
    cr_expect_eq(e2e_upstream_body_mismatch(r.body, r.body_len), r.body_len, "binary response differs at byte %zu",
                 e2e_upstream_body_mismatch(r.body, r.body_len));
    e2e_resp_free(&r);

    /* and chunked from the upstream */
    static const char *const h3[] = {"X-Test-Body-Size: 50001", "X-Test-Chunked: 1", NULL};
    struct e2e_req rq3 = {.path = "/v1/payments/bin", .headers = h3};
    e2e_http(gw->port, &rq3, &r);
    cr_expect_eq(r.status, 200);
    cr_expect_eq(r.body_len, 50001);
    cr_expect_eq(e2e_upstream_body_mismatch(r.body, r.body_len), r.body_len,
                 "chunked binary response differs at byte %zu", e2e_upstream_body_mismatch(r.body, r.body_len));
    e2e_resp_free(&r);
}

Test(proxy, one_mib_bodies_both_ways)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    size_t n = 1024 * 1024;
    unsigned char *blob = binary_blob(n, 7);
    struct e2e_req rq = {.method = "PUT", .path = "/v1/payments/big", .body = blob, .body_len = n};
    struct e2e_resp r;
    e2e_http(gw->port, &rq, &r);
    cr_expect_eq(r.status, 200, "1 MiB upload: status %ld (%s) %.200s", r.status, r.error, (const char *)r.body);
    cr_expect_eq(r.body_len, n);
    cr_expect(r.body_len == n && memcmp(r.body, blob, n) == 0, "1 MiB echo differs");
    e2e_resp_free(&r);
    free(blob);

    static const char *const h[] = {"X-Test-Body-Size: 1048576", NULL};
    struct e2e_req rq2 = {.path = "/v1/payments/big", .headers = h};
    e2e_http(gw->port, &rq2, &r);
    cr_expect_eq(r.status, 200);
    cr_expect_eq(r.body_len, n);
    cr_expect_eq(e2e_upstream_body_mismatch(r.body, r.body_len), r.body_len, "1 MiB download differs at byte %zu",
                 e2e_upstream_body_mismatch(r.body, r.body_len));
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 2);
}

Test(proxy, repeated_response_headers_keep_values_and_order)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    struct e2e_resp r;
    e2e_get(gw->port, "/v1/payments/cookies", &r);
    cr_assert_eq(r.status, 200, "status %ld (%s)", r.status, r.error);
    cr_expect_eq(e2e_resp_header_count(&r, "Set-Cookie"), 2, "Set-Cookie must stay two headers");
    const char *c0 = e2e_resp_header_nth(&r, "Set-Cookie", 0);
    const char *c1 = e2e_resp_header_nth(&r, "Set-Cookie", 1);
    cr_expect(c0 && c1 && strcmp(c0, "a=1") == 0 && strcmp(c1, "b=2") == 0, "Set-Cookie: %s / %s", c0 ? c0 : "-",
              c1 ? c1 : "-");
    cr_expect_eq(e2e_resp_header_count(&r, "X-Multi"), 2, "X-Multi must stay two headers");
    const char *m0 = e2e_resp_header_nth(&r, "X-Multi", 0);
    const char *m1 = e2e_resp_header_nth(&r, "X-Multi", 1);
    cr_expect(m0 && m1 && strcmp(m0, "one") == 0 && strcmp(m1, "two") == 0, "X-Multi: %s / %s", m0 ? m0 : "-",
              m1 ? m1 : "-");
    e2e_resp_free(&r);
}

Test(proxy, hop_by_hop_request_headers_are_not_forwarded)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    static const char *const h[] = {
        "Connection: keep-alive, X-Hop",
        "X-Hop: v",
        "Keep-Alive: timeout=5",
        "TE: trailers",
        "Upgrade: example/1",
        "Proxy-Connection: keep-alive",
        "Proxy-Authorization: Basic Zm9vOmJhcg==",
        "Trailer: X-Foo",
        "X-End-To-End: kept",
        NULL,
    };
    struct e2e_req rq = {.method = "POST", .path = "/v1/payments/hop", .headers = h, .body = "x", .body_len = 1};
    struct e2e_resp r;
    e2e_http(gw->port, &rq, &r);
    cr_assert_eq(r.status, 200, "status %ld (%s)", r.status, r.error);
    e2e_resp_free(&r);
    char *text = e2e_upstream_last_headers(up);
    struct e2e_hdr *hd;
    size_t n = e2e_parse_header_lines(text, &hd);
    static const char *const gone[] = {
        "X-Hop", "Keep-Alive", "TE", "Upgrade", "Proxy-Connection", "Proxy-Authorization", "Trailer"};
    for (size_t i = 0; i < sizeof gone / sizeof gone[0]; i++)
        cr_expect_null(e2e_hdrs_get(hd, n, gone[i]), "%s was forwarded to the upstream:\n%s", gone[i], text);
    for (size_t i = 0; i < n; i++)
        if (strcasecmp(hd[i].name, "Connection") == 0)
            cr_expect(strcasestr(hd[i].value, "x-hop") == NULL, "the client's Connection header was forwarded: %s",
                      hd[i].value);
    const char *kept = e2e_hdrs_get(hd, n, "X-End-To-End");
    cr_expect(kept != NULL && strcmp(kept, "kept") == 0, "an end-to-end header was lost:\n%s", text);
    e2e_hdrs_free(hd, n);
    free(text);
}

Test(proxy, hop_by_hop_response_headers_are_not_returned)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    struct e2e_resp r;
    e2e_get(gw->port, "/v1/payments/hop", &r);
    cr_assert_eq(r.status, 200, "status %ld (%s)", r.status, r.error);
    cr_expect_null(e2e_resp_header(&r, "X-Hop"), "X-Hop (named in the upstream's Connection) reached the client");
    cr_expect_null(e2e_resp_header(&r, "Keep-Alive"), "the upstream's Keep-Alive reached the client");
    for (size_t i = 0; i < r.nhdrs; i++)
        if (strcasecmp(r.hdrs[i].name, "Connection") == 0)
            cr_expect(strcasestr(r.hdrs[i].value, "x-hop") == NULL, "the upstream's Connection reached the client: %s",
                      r.hdrs[i].value);
    cr_expect_not_null(e2e_resp_header(&r, "X-Upstream-Exec"), "end-to-end response headers must pass");
    e2e_resp_free(&r);
}

Test(proxy, forwarding_headers_are_added)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    struct e2e_resp r;
    e2e_get(gw->port, "/v1/payments/fwd", &r);
    cr_assert_eq(r.status, 200, "status %ld (%s)", r.status, r.error);
    e2e_resp_free(&r);
    char *text = e2e_upstream_last_headers(up);
    struct e2e_hdr *hd;
    size_t n = e2e_parse_header_lines(text, &hd);
    const char *xff = e2e_hdrs_get(hd, n, "X-Forwarded-For");
    cr_expect(xff != NULL && strcmp(xff, "127.0.0.1") == 0, "X-Forwarded-For: %s\n%s", xff ? xff : "(none)", text);
    const char *xfp = e2e_hdrs_get(hd, n, "X-Forwarded-Proto");
    cr_expect(xfp != NULL && strcmp(xfp, "http") == 0, "X-Forwarded-Proto: %s", xfp ? xfp : "(none)");
    const char *via = e2e_hdrs_get(hd, n, "Via");
    cr_expect(via != NULL && strstr(via, "idemgate") != NULL, "Via: %s", via ? via : "(none)");
    e2e_hdrs_free(hd, n);
    free(text);

    /* appended to an existing X-Forwarded-For, as one header */
    static const char *const h[] = {"X-Forwarded-For: 10.0.0.1", NULL};
    struct e2e_req rq = {.path = "/v1/payments/fwd", .headers = h};
    e2e_http(gw->port, &rq, &r);
    cr_assert_eq(r.status, 200);
    e2e_resp_free(&r);
    text = e2e_upstream_last_headers(up);
    n = e2e_parse_header_lines(text, &hd);
    cr_expect_eq(e2e_hdrs_count(hd, n, "X-Forwarded-For"), 1, "one X-Forwarded-For expected:\n%s", text);
    xff = e2e_hdrs_get(hd, n, "X-Forwarded-For");
    char squeezed[128] = "";
    size_t k = 0;
    for (size_t i = 0; xff != NULL && xff[i] != '\0' && k + 1 < sizeof squeezed; i++)
        if (xff[i] != ' ')
            squeezed[k++] = xff[i];
    squeezed[k] = '\0';
    cr_expect(strcmp(squeezed, "10.0.0.1,127.0.0.1") == 0, "X-Forwarded-For after append: %s", xff ? xff : "(none)");
    e2e_hdrs_free(hd, n);
    free(text);
}

Test(proxy, upstream_connection_is_reused)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_one_loop, &up, &gw);
    struct e2e_resp a, b;
    e2e_get(gw->port, "/v1/payments/ka1", &a);
    e2e_get(gw->port, "/v1/payments/ka2", &b);
    cr_assert_eq(a.status, 200);
    cr_assert_eq(b.status, 200);
    const char *ca = e2e_resp_header(&a, "X-Conn-Id");
    const char *cb = e2e_resp_header(&b, "X-Conn-Id");
    cr_assert(ca != NULL && cb != NULL, "X-Conn-Id missing");
    cr_expect_str_eq(ca, cb, "two sequential requests used two upstream connections (%s, %s)", ca, cb);
    e2e_resp_free(&a);
    e2e_resp_free(&b);
}

static const char conf_keepalive_1s[] = E2E_CONF_HEAD "threads: 1\n" CONF_UPSTREAM(
    "{{UPSTREAM_URL}}", "5s") "    keepalive_timeout: 1s\n" CONF_PASS_ROUTE("1MiB") "default_upstream: api\n";

/* The X-Conn-Id of GET path (the test upstream numbers its connections). */
static char *conn_id_of(const struct e2e_gw *gw, const char *path)
{
    struct e2e_resp r;
    e2e_get(gw->port, path, &r);
    cr_assert_eq(r.status, 200, "%s: %ld %s", path, r.status, r.error);
    const char *id = e2e_resp_header(&r, "X-Conn-Id");
    cr_assert(id != NULL, "X-Conn-Id missing");
    char *out = strdup(id);
    e2e_resp_free(&r);
    return out;
}

/* An idle upstream connection is reused after a pause (a wave of requests after a quiet second must not open a
 * connection each), up to keepalive_timeout (60 s by default, nginx's) but less than the server announced with
 * Keep-Alive: timeout=N (the test upstream says 5: reused up to 4 s), since it closes then. */
Test(proxy, an_idle_upstream_connection_is_reused_until_the_server_would_close_it, .timeout = 60)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_one_loop, &up, &gw);
    char *a = conn_id_of(gw, "/v1/payments/ka-a");
    e2e_sleep_ms(2600);
    char *b = conn_id_of(gw, "/v1/payments/ka-b");
    cr_expect_str_eq(a, b, "idle 2.6 s: a new connection (%s, then %s)", a, b);
    e2e_sleep_ms(4300);
    char *c = conn_id_of(gw, "/v1/payments/ka-c");
    cr_expect_str_neq(b, c, "idle 4.3 s, past the server's 5 s less 1 s: reused (%s)", c);
    free(a);
    free(b);
    free(c);

    struct e2e_gw *short_ka = e2e_gw_start(conf_keepalive_1s, &(struct e2e_gw_opts){.up = up, .wait_ready = true});
    char *d = conn_id_of(short_ka, "/v1/payments/ka-d");
    char *e = conn_id_of(short_ka, "/v1/payments/ka-e");
    cr_expect_str_eq(d, e, "back to back: reused");
    e2e_sleep_ms(1300);
    char *f = conn_id_of(short_ka, "/v1/payments/ka-f");
    cr_expect_str_neq(e, f, "keepalive_timeout: 1s and idle 1.3 s: reused (%s)", f);
    free(d);
    free(e);
    free(f);
}

/* Established TCP connections to 127.0.0.1:port from this network namespace (/proc/net/tcp, state 01). */
static int established_to(uint16_t port)
{
    FILE *f = fopen("/proc/net/tcp", "r");
    cr_assert(f, "/proc/net/tcp");
    char line[512];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned rport, st;
        if (sscanf(line, " %*d: %*x:%*x %*x:%x %x", &rport, &st) == 2 && rport == port && st == 0x01)
            n++;
    }
    fclose(f);
    return n;
}

/* An idle upstream connection past keepalive_timeout is closed by the gateway's sweep, not left open until the next
 * request: that request (after a pause, the first of a wave) would otherwise pay for closing every stale one
 * before it connects. nginx closes an idle upstream connection on its keepalive timer too. */
Test(proxy, an_idle_upstream_connection_is_closed_when_its_keepalive_ends, .timeout = 30)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = e2e_gw_start(conf_keepalive_1s, &(struct e2e_gw_opts){.up = up, .wait_ready = true});
    char *a = conn_id_of(gw, "/v1/payments/sweep-a");
    cr_expect_eq(established_to(up->port), 1, "one upstream connection, idle after the answer");
    uint64_t t0 = e2e_now_ms();
    while (established_to(up->port) > 0 && e2e_now_ms() - t0 < 4000)
        e2e_sleep_ms(50);
    uint64_t took = e2e_now_ms() - t0;
    cr_expect_eq(established_to(up->port), 0, "keepalive_timeout 1s: still open %llu ms later",
                 (unsigned long long)took);
    cr_expect_geq(took, 800, "closed after %llu ms, before its keepalive_timeout", (unsigned long long)took);
    char *b = conn_id_of(gw, "/v1/payments/sweep-b");
    cr_expect_str_neq(a, b, "a request after the sweep opens a new connection");
    free(a);
    free(b);
}

/* More idle connections than one turn of the sweep closes (64): the rest go in the turns after it, 50 ms apart, so
 * a hundred connections idle since the same moment are all closed soon after their keepalive_timeout. */
Test(proxy, a_hundred_idle_upstream_connections_are_all_closed_by_the_sweep, .timeout = 60)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = e2e_gw_start(conf_keepalive_1s, &(struct e2e_gw_opts){.up = up, .wait_ready = true});
    enum { N = 100 };
    static const char *const hold[] = {"X-Test-Delay-Ms: 400", NULL}; /* all in flight at once: a connection each */
    struct e2e_req rq[N];
    struct e2e_resp out[N];
    char paths[N][48];
    for (int i = 0; i < N; i++) {
        snprintf(paths[i], sizeof paths[i], "/v1/payments/sweep-many-%d", i);
        rq[i] = (struct e2e_req){.path = paths[i], .headers = hold, .timeout_ms = 20000};
    }
    e2e_http_parallel(gw->port, rq, out, N);
    for (int i = 0; i < N; i++) {
        cr_expect_eq(out[i].status, 200, "request %d: %ld %s", i, out[i].status, out[i].error);
        e2e_resp_free(&out[i]);
    }
    int open0 = established_to(up->port);
    cr_assert_gt(open0, 64, "only %d upstream connections idle: not more than one sweep turn", open0);
    uint64_t t0 = e2e_now_ms();
    /* idle for keepalive_timeout (1 s), then at most one sweep period (1 s) and a few turns; the test upstream's
     * own idle close (Keep-Alive: timeout=5) comes later */
    while (established_to(up->port) > 0 && e2e_now_ms() - t0 < 3000)
        e2e_sleep_ms(50);
    cr_expect_eq(established_to(up->port), 0, "of %d idle connections, %d still open %llu ms later", open0,
                 established_to(up->port), (unsigned long long)(e2e_now_ms() - t0));
}

Test(proxy, each_loop_reuses_its_upstream_connections)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_two_loops, &up, &gw);
    char seen[8][32];
    size_t distinct = 0;
    for (int i = 0; i < 8; i++) { /* eight client connections, spread over the two loops */
        struct e2e_resp r;
        char path[64];
        snprintf(path, sizeof path, "/v1/payments/loop%d", i);
        e2e_get(gw->port, path, &r);
        cr_assert_eq(r.status, 200);
        const char *id = e2e_resp_header(&r, "X-Conn-Id");
        cr_assert(id != NULL, "X-Conn-Id missing");
        bool known = false;
        for (size_t j = 0; j < distinct; j++)
            known = known || strcmp(seen[j], id) == 0;
        if (!known)
            snprintf(seen[distinct++], sizeof seen[0], "%s", id);
        e2e_resp_free(&r);
    }
    cr_expect(distinct <= 2, "8 sequential requests on 2 loops used %zu upstream connections", distinct);
}

Test(proxy, query_string_and_path_forwarded_unchanged)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    static const char *const paths[] = {
        "/v1/payments/a%20b?x=1&y=%2F&z=&x=2",
        "/v1/payments?q=%E2%82%AC&empty=&flag",
        "/v1/payments/42/refunds?sort=-created&page%5Bsize%5D=10",
    };
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        struct e2e_resp r;
        e2e_get(gw->port, paths[i], &r);
        cr_expect_eq(r.status, 200, "%s: %ld", paths[i], r.status);
        const char *eu = e2e_resp_header(&r, "X-Echo-Uri");
        cr_expect(eu != NULL && strcmp(eu, paths[i]) == 0, "sent %s, upstream saw %s", paths[i], eu ? eu : "(none)");
        e2e_resp_free(&r);
    }
}

Test(proxy, upstream_status_and_body_pass_as_is)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    static const char *const h[] = {"X-Test-Status: 503", NULL};
    struct e2e_req rq = {.method = "POST", .path = "/v1/payments/s", .headers = h, .body = "payload", .body_len = 7};
    struct e2e_resp r;
    e2e_http(gw->port, &rq, &r);
    cr_expect_eq(r.status, 503, "upstream's 503 must reach the client, got %ld", r.status);
    cr_expect(r.body_len == 7 && memcmp(r.body, "payload", 7) == 0, "body %.100s", (const char *)r.body);
    cr_expect_not_null(e2e_resp_header(&r, "X-Upstream-Exec"), "the upstream's own answer expected");
    e2e_resp_free(&r);

    static const char *const h2[] = {"X-Test-Status: 204", NULL};
    struct e2e_req rq2 = {.method = "DELETE", .path = "/v1/payments/s", .headers = h2};
    e2e_http(gw->port, &rq2, &r);
    cr_expect_eq(r.status, 204);
    cr_expect_eq(r.body_len, 0);
    e2e_resp_free(&r);
}

/* ---- limits */

Test(proxy, body_over_max_body_is_413_and_not_forwarded)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_limits, &up, &gw);
    unsigned char *blob = binary_blob(4096, 3);

    /* on a route (idempotency.max_body) */
    struct e2e_req rq = {.method = "POST", .path = "/v1/payments/big", .body = blob, .body_len = 4096};
    struct e2e_resp r;
    e2e_http(gw->port, &rq, &r);
    e2e_expect_problem(&r, 413, "payload-too-large", "body over the route's max_body");
    e2e_resp_free(&r);

    /* no route: the top-level max_body */
    struct e2e_req rq2 = {.method = "POST", .path = "/elsewhere", .body = blob, .body_len = 4096};
    e2e_http(gw->port, &rq2, &r);
    e2e_expect_problem(&r, 413, "payload-too-large", "body over the top-level max_body");
    e2e_resp_free(&r);

    /* chunked upload without Content-Length */
    char head[] = "POST /v1/payments/chunked HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
                  "Content-Type: application/octet-stream\r\n\r\n";
    size_t total = strlen(head) + 16 + 4096 + 2 + 5;
    char *msg = malloc(total + 1);
    cr_assert_not_null(msg);
    size_t off = 0;
    memcpy(msg, head, strlen(head));
    off += strlen(head);
    off += (size_t)snprintf(msg + off, total + 1 - off, "1000\r\n");
    memcpy(msg + off, blob, 4096);
    off += 4096;
    memcpy(msg + off, "\r\n0\r\n\r\n", 7);
    off += 7;
    struct e2e_raw raw;
    e2e_raw_send(gw->port, msg, off, 5000, &raw);
    cr_expect_eq(raw.status, 413, "chunked upload over max_body: %.200s", raw.data);
    free(raw.data);
    free(msg);

    /* at the limit it passes */
    struct e2e_req rq3 = {.method = "POST", .path = "/v1/payments/ok", .body = blob, .body_len = 1024};
    e2e_http(gw->port, &rq3, &r);
    cr_expect_eq(r.status, 200, "a body of exactly max_body must pass, got %ld", r.status);
    e2e_resp_free(&r);
    free(blob);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "only the body within the limit may reach the upstream");
}

Test(proxy, header_block_over_max_header_bytes_is_431)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_limits, &up, &gw);
    char big[8100];
    memcpy(big, "X-Big: ", 7);
    memset(big + 7, 'a', 8000);
    big[8007] = '\0';
    const char *h[] = {big, NULL};
    struct e2e_req rq = {.method = "POST", .path = "/v1/payments/h", .headers = h, .body = "x", .body_len = 1};
    struct e2e_resp r;
    e2e_http(gw->port, &rq, &r);
    cr_expect_eq(r.status, 431, "8 KB header over a 4 KiB limit: got %ld (%s)", r.status, r.error);
    e2e_resp_free(&r);

    /* several smaller headers that add up over the limit */
    char h1[1500], h2[1500], h3[1500], h4[1500];
    snprintf(h1, sizeof h1, "X-A: %01400d", 0);
    snprintf(h2, sizeof h2, "X-B: %01400d", 0);
    snprintf(h3, sizeof h3, "X-C: %01400d", 0);
    snprintf(h4, sizeof h4, "X-D: %01400d", 0);
    const char *hs[] = {h1, h2, h3, h4, NULL};
    struct e2e_req rq2 = {.path = "/v1/payments/h", .headers = hs};
    e2e_http(gw->port, &rq2, &r);
    cr_expect_eq(r.status, 431, "5.6 KB header block over a 4 KiB limit: got %ld (%s)", r.status, r.error);
    e2e_resp_free(&r);

    /* under the limit it passes */
    big[7 + 1000] = '\0';
    e2e_http(gw->port, &rq, &r);
    cr_expect_eq(r.status, 200, "1 KB header under the limit: got %ld", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "only the request within the limit may reach the upstream");
}

Test(proxy, malformed_request_is_400_and_gateway_survives)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    static const char *const bad[] = {
        "GET /v1/payments/x HTTP/1.1\r\nHost: a\r\nThis is not a header\r\n\r\n",
        "POST /v1/payments/x HTTP/1.1\r\nHost: a\r\nContent-Length: abc\r\n\r\n",
        "GET /v1/payments/x HTTP/1.1\r\nHost: a\r\nX-Bad\x01Name: v\r\n\r\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct e2e_raw raw;
        e2e_raw_send(gw->port, bad[i], strlen(bad[i]), 5000, &raw);
        cr_expect_eq(raw.status, 400, "case %zu: expected 400, got %d: %.200s", i, raw.status, raw.data);
        free(raw.data);
    }
    struct e2e_resp r;
    e2e_get(gw->port, "/v1/payments/after", &r);
    cr_expect_eq(r.status, 200, "the gateway must keep serving after malformed input");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "malformed requests must not reach the upstream");
}

/* RFC 9112 6.3: differing Content-Length values make the framing invalid; a proxy that picks one of them
 * disagrees with some other hop on where the request ends (request smuggling). */
Test(proxy, conflicting_content_lengths_are_400_and_not_forwarded)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    static const char *const bad[] = {
        "POST /v1/payments/x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello..",
        "POST /v1/payments/x HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 7\r\n\r\nhello..",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct e2e_raw raw;
        e2e_raw_send(gw->port, bad[i], strlen(bad[i]), 5000, &raw);
        cr_expect_eq(raw.status, 400, "case %zu: expected 400, got %d: %.300s", i, raw.status, raw.data);
        free(raw.data);
    }
    cr_expect_eq(e2e_upstream_count(up, NULL), 0, "a request with ambiguous framing must not reach the upstream");
}

/* ---- upstream failures */

Test(proxy, closed_upstream_port_is_502_upstream_unavailable)
{
    struct e2e_gw_opts o = {0};
    struct e2e_gw *gw = e2e_gw_start(conf_dead, &o);
    struct e2e_req rq = {.method = "POST", .path = "/v1/payments/x", .body = "{}", .body_len = 2};
    struct e2e_resp r;
    e2e_http(gw->port, &rq, &r);
    e2e_expect_problem(&r, 502, "upstream-unavailable", "POST to a closed upstream port");
    cr_expect(r.seconds < 3.0, "a refused connection must fail fast (%.2fs)", r.seconds);
    e2e_resp_free(&r);
    e2e_get(gw->port, "/other", &r);
    e2e_expect_problem(&r, 502, "upstream-unavailable", "GET to a closed upstream port");
    e2e_resp_free(&r);
}

Test(proxy, slow_upstream_is_504_upstream_timeout)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_slow, &up, &gw);
    static const char *const h[] = {"X-Test-Delay-Ms: 2000", NULL};
    struct e2e_req rq = {.method = "POST", .path = "/v1/payments/slow", .headers = h, .body = "{}", .body_len = 2};
    struct e2e_resp r;
    e2e_http(gw->port, &rq, &r);
    e2e_expect_problem(&r, 504, "upstream-timeout", "upstream slower than its timeout");
    cr_expect(r.seconds >= 0.4 && r.seconds < 1.8, "504 should come after about 500 ms, came after %.2fs", r.seconds);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "the request was sent once");
}

Test(proxy, upstream_close_without_answer_is_502_and_not_retried)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    static const char *const actions[] = {"X-Test-Action: close", "X-Test-Action: reset"};
    for (size_t i = 0; i < 2; i++) {
        /* warm a keep-alive connection so the failing request goes over a reused one (libcurl's silent retry) */
        struct e2e_resp r;
        e2e_get(gw->port, "/v1/payments/warm", &r);
        cr_assert_eq(r.status, 200);
        e2e_resp_free(&r);
        long before = e2e_upstream_count(up, NULL);
        const char *h[] = {actions[i], NULL};
        struct e2e_req rq = {.method = "POST", .path = "/v1/payments/drop", .headers = h, .body = "{}", .body_len = 2};
        e2e_http(gw->port, &rq, &r);
        e2e_expect_problem(&r, 502, "upstream-no-response", actions[i]);
        e2e_resp_free(&r);
        cr_expect_eq(e2e_upstream_count(up, NULL), before + 1, "%s: the POST must be executed exactly once",
                     actions[i]);
    }
}

/* ---- routing */

Test(proxy, no_route_without_default_upstream_is_404)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_nodefault, &up, &gw);
    struct e2e_resp r;
    e2e_get(gw->port, "/nowhere", &r);
    e2e_expect_problem(&r, 404, "route-not-found", "GET on no route");
    e2e_resp_free(&r);
    struct e2e_req rq = {.method = "POST", .path = "/nowhere", .body = "{}", .body_len = 2};
    e2e_http(gw->port, &rq, &r);
    e2e_expect_problem(&r, 404, "route-not-found", "POST on no route");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 0);
}

Test(proxy, default_upstream_serves_unrouted_paths)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    struct e2e_req rq = {.method = "POST", .path = "/other/x?q=1", .body = "abc", .body_len = 3};
    struct e2e_resp r;
    e2e_http(gw->port, &rq, &r);
    cr_expect_eq(r.status, 200, "status %ld (%s)", r.status, r.error);
    const char *eu = e2e_resp_header(&r, "X-Echo-Uri");
    cr_expect(eu != NULL && strcmp(eu, "/other/x?q=1") == 0, "upstream saw %s", eu ? eu : "(none)");
    cr_expect(r.body_len == 3 && memcmp(r.body, "abc", 3) == 0);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1);
}

Test(proxy, path_prefix_matches_whole_segments)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_nodefault, &up, &gw);
    static const struct {
        const char *path;
        long status;
    } cases[] = {
        {"/v1/payments", 200},        {"/v1/payments/42", 200},
        {"/v1/payments/", 200},       {"/v1/payments?x=1", 200},
        {"/v1/paymentsx", 404},       {"/v1/payments-x/1", 404},
        {"/v1/payment", 404},         {"/v1", 404},
        {"/v2/payments", 404},        {"/V1/payments", 200}, /* SPEC 7: case does not decide the route */
        {"/v1/payments.json", 200},   {"/v1/payments;x=1/2", 200},
        {"/v1/payments.json/1", 404},
    };
    long forwarded = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct e2e_resp r;
        e2e_get(gw->port, cases[i].path, &r);
        cr_expect_eq(r.status, cases[i].status, "%s: expected %ld, got %ld", cases[i].path, cases[i].status, r.status);
        if (cases[i].status == 404)
            cr_expect(e2e_resp_is_problem(&r, "route-not-found"), "%s: 404 must be a route-not-found problem",
                      cases[i].path);
        else
            forwarded++;
        e2e_resp_free(&r);
    }
    cr_expect_eq(e2e_upstream_count(up, NULL), forwarded);
}

/* Port 0 in listen and admin.listen: the gateway picks free ports and logs them. */
static uint16_t logged_port_of(const struct e2e_gw *gw, const char *event, const char *host)
{
    char needle[96];
    snprintf(needle, sizeof needle, "event=%s addr=%s:", event, host);
    if (!e2e_gw_log_wait(gw, needle, E2E_READY_TIMEOUT_MS)) {
        e2e_proc_dump_log(&gw->proc, 4000);
        cr_assert_fail("no '%s' line in the gateway log", needle);
    }
    char *log = e2e_gw_log(gw);
    const char *p = strstr(log, needle) + strlen(needle);
    char *end = NULL;
    unsigned long port = strtoul(p, &end, 10);
    bool ok = end != p && port > 0 && port <= 65535;
    free(log);
    cr_assert(ok, "malformed port after '%s'", needle);
    return (uint16_t)port;
}

static uint16_t logged_port(const struct e2e_gw *gw, const char *event)
{
    return logged_port_of(gw, event, "127.0.0.1");
}

/* One GET / over a fresh connection to addr:port (IPv4 or IPv6): its status, 0 when nothing answered within 3 s,
 * -1 when the connection was refused. */
static int raw_get_status(int family, const char *addr, uint16_t port)
{
    struct sockaddr_storage ss = {0};
    socklen_t len;
    if (family == AF_INET6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons(port);
        cr_assert_eq(inet_pton(AF_INET6, addr, &a->sin6_addr), 1, "address %s", addr);
        len = sizeof *a;
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        a->sin_family = AF_INET;
        a->sin_port = htons(port);
        cr_assert_eq(inet_pton(AF_INET, addr, &a->sin_addr), 1, "address %s", addr);
        len = sizeof *a;
    }
    int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert(fd >= 0, "socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&ss, len) != 0) {
        int e = errno;
        close(fd);
        cr_assert_eq(e, ECONNREFUSED, "connect to %s port %u: %s", addr, (unsigned)port, strerror(e));
        return -1;
    }
    static const char req[] = "GET /v6 HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n";
    cr_assert_eq(send(fd, req, sizeof req - 1, MSG_NOSIGNAL), (ssize_t)(sizeof req - 1));
    char buf[512];
    size_t got = 0;
    uint64_t deadline = e2e_now_ms() + 3000;
    while (got < 12 && e2e_now_ms() < deadline) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, 100) <= 0)
            continue;
        ssize_t r = recv(fd, buf + got, sizeof buf - 1 - got, 0);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    buf[got] = '\0';
    if (got < 12 || strncmp(buf, "HTTP/1.1 ", 9) != 0)
        return 0;
    return (int)strtol(buf + 9, NULL, 10);
}

/* listen on the given address, the admin on 127.0.0.1, a free port for each. */
#define CONF_LISTEN_ON(addr)                                                                                           \
    "listen: \"" addr ":0\"\n"                                                                                         \
    "admin:\n"                                                                                                         \
    "  listen: 127.0.0.1:0\n"                                                                                          \
    "store:\n"                                                                                                         \
    "  postgres: \"{{PG_URL}}\"\n"                                                                                     \
    "  redis: \"{{REDIS_URL}}\"\n" CONF_UPSTREAM("{{UPSTREAM_URL}}", "5s") "default_upstream: api\n"

/* An IPv6 listen address: served there; with IPV6_V6ONLY, as libmicrohttpd set it, "[::]" takes no IPv4. */
Test(proxy, ipv6_listen_addresses_serve_ipv6_only)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw_opts o = {.up = up, .no_wait = true};

    struct e2e_gw *lo = e2e_gw_start(CONF_LISTEN_ON("[::1]"), &o);
    uint16_t port = logged_port_of(lo, "listening", "[::1]");
    cr_expect_eq(raw_get_status(AF_INET6, "::1", port), 200, "GET on [::1]:%u", (unsigned)port);
    cr_expect_eq(raw_get_status(AF_INET, "127.0.0.1", port), -1, "127.0.0.1:%u must not be served", (unsigned)port);
    cr_expect_eq(e2e_gw_stop(lo, 5000), 0, "exit code after SIGTERM");

    struct e2e_gw *any = e2e_gw_start(CONF_LISTEN_ON("[::]"), &o);
    port = logged_port_of(any, "listening", "[::]");
    cr_expect_eq(raw_get_status(AF_INET6, "::1", port), 200, "GET on [::1]:%u through [::]", (unsigned)port);
    cr_expect_eq(raw_get_status(AF_INET, "127.0.0.1", port), -1,
                 "[::] is IPv6 only (IPV6_V6ONLY): 127.0.0.1:%u must not be served", (unsigned)port);
    cr_expect_eq(e2e_upstream_count(up, NULL), 2, "two requests reached the upstream");
}

Test(proxy, port_zero_picks_free_ports_and_logs_them)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw_opts o = {.up = up, .no_wait = true};
    struct e2e_gw *gw = e2e_gw_start(CONF_LISTEN_ON("127.0.0.1"), &o);
    uint16_t front = logged_port(gw, "listening");
    uint16_t admin = logged_port(gw, "admin_listening");
    cr_expect_neq(front, admin);
    struct e2e_resp r;
    e2e_get(admin, "/healthz", &r);
    cr_expect_eq(r.status, 200, "GET /healthz on the logged admin port %u: %ld", (unsigned)admin, r.status);
    e2e_resp_free(&r);
    e2e_get(front, "/zero", &r);
    cr_expect_eq(r.status, 200, "GET on the logged front port %u: %ld", (unsigned)front, r.status);
    cr_expect_not_null(e2e_resp_header(&r, "X-Upstream-Exec"));
    e2e_resp_free(&r);
}

/* ---- shutdown */

Test(proxy, sigterm_lets_in_flight_requests_finish_then_exits_0)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    static const char *const h[] = {"X-Test-Delay-Ms: 1000", NULL};
    struct e2e_req rq = {.method = "POST",
                         .path = "/v1/payments/slow",
                         .headers = h,
                         .body = "inflight",
                         .body_len = 8,
                         .timeout_ms = 8000};
    struct e2e_async *a = e2e_http_async(gw->port, &rq);
    e2e_sleep_ms(200);
    uint64_t t0 = e2e_now_ms();
    cr_assert_eq(kill(gw->proc.pid, SIGTERM), 0);
    /* while it drains, /readyz says so (a load balancer stops sending); it said 200 ready */
    bool draining = false;
    for (int i = 0; i < 50 && !draining; i++) {
        struct e2e_resp rz;
        e2e_get(gw->admin_port, "/readyz", &rz);
        draining = rz.status == 503 && rz.body && strstr((const char *)rz.body, "\"status\":\"draining\"");
        e2e_resp_free(&rz);
        if (!draining)
            e2e_sleep_ms(10);
    }
    cr_expect(draining, "/readyz is 503 draining while in-flight requests finish");
    struct e2e_resp r;
    e2e_http_join(a, &r);
    cr_expect_eq(r.status, 200, "the in-flight request must complete: %ld (%s)", r.status, r.error);
    cr_expect(r.body_len == 8 && memcmp(r.body, "inflight", 8) == 0, "in-flight body: %.100s", (const char *)r.body);
    e2e_resp_free(&r);
    bool exited = e2e_proc_wait(&gw->proc, 8000);
    uint64_t took = e2e_now_ms() - t0;
    if (!exited)
        e2e_proc_dump_log(&gw->proc, 4000);
    cr_assert(exited, "idemgate still running 8 s after SIGTERM");
    cr_expect_eq(e2e_proc_exit_code(&gw->proc), 0, "exit code after SIGTERM: %d", e2e_proc_exit_code(&gw->proc));
    cr_expect(took < 6000, "shutdown took %llu ms", (unsigned long long)took);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1);
}

Test(proxy, sigterm_when_idle_exits_0)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    struct e2e_resp r;
    e2e_get(gw->port, "/v1/payments/x", &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    uint64_t t0 = e2e_now_ms();
    int code = e2e_gw_stop(gw, 8000);
    cr_expect_eq(code, 0, "exit code after SIGTERM: %d (killed=%d)", code, (int)gw->proc.killed);
    cr_expect(e2e_now_ms() - t0 < 3000, "an idle gateway should stop promptly (%llu ms)",
              (unsigned long long)(e2e_now_ms() - t0));
}

/* ---- admin */

Test(proxy, admin_health_ready_and_metrics)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    struct e2e_resp r;
    e2e_get(gw->admin_port, "/healthz", &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);

    /* readiness may lag the start by a probe interval: poll it, bounded */
    uint64_t deadline = e2e_now_ms() + 5000;
    for (;;) {
        e2e_get(gw->admin_port, "/readyz", &r);
        if (r.status == 200 || e2e_now_ms() >= deadline)
            break;
        e2e_resp_free(&r);
        e2e_sleep_ms(50);
    }
    cr_expect_eq(r.status, 200, "/readyz with Postgres up (after 5 s): %ld %.200s", r.status, (const char *)r.body);
    const char *ct = e2e_resp_header(&r, "Content-Type");
    cr_expect(ct != NULL && strstr(ct, "json") != NULL, "/readyz Content-Type: %s", ct ? ct : "(none)");
    cr_expect(strstr((const char *)r.body, "\"postgres\"") != NULL, "/readyz: %s", (const char *)r.body);
    cr_expect(strstr((const char *)r.body, "\"redis\"") != NULL, "/readyz: %s", (const char *)r.body);
    e2e_resp_free(&r);

    struct e2e_req rq = {.method = "POST", .path = "/v1/payments/m", .body = "{}", .body_len = 2};
    e2e_http(gw->port, &rq, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    e2e_get(gw->admin_port, "/metrics", &r);
    cr_expect_eq(r.status, 200);
    cr_expect(strstr((const char *)r.body, "idemgate_requests_total") != NULL,
              "/metrics lacks requests_total:\n%.2000s", (const char *)r.body);
    cr_expect(strstr((const char *)r.body, "idemgate_upstream_seconds_bucket") != NULL,
              "/metrics lacks the upstream histogram:\n%.2000s", (const char *)r.body);
    cr_expect(strstr((const char *)r.body, "# TYPE") != NULL, "/metrics is not Prometheus text");
    e2e_resp_free(&r);

    /* admin endpoints are not served on the front port */
    e2e_get(gw->port, "/metrics", &r);
    cr_expect_eq(r.status, 200);
    cr_expect_not_null(e2e_resp_header(&r, "X-Upstream-Exec"),
                       "/metrics on the front must go to the (default) upstream, not to the admin handler");
    e2e_resp_free(&r);
}

/* ---- load */

Test(proxy, hundred_concurrent_requests_run_in_parallel)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_pass, &up, &gw);
    enum { N = 100 };
    static const char *const h[] = {"X-Test-Delay-Ms: 200", NULL};
    struct e2e_req rq[N];
    struct e2e_resp out[N];
    char paths[N][48];
    for (int i = 0; i < N; i++) {
        snprintf(paths[i], sizeof paths[i], "/v1/payments/c/%d", i);
        rq[i] = (struct e2e_req){.method = "POST",
                                 .path = paths[i],
                                 .headers = h,
                                 .body = paths[i],
                                 .body_len = strlen(paths[i]),
                                 .timeout_ms = 10000};
    }
    uint64_t t0 = e2e_now_ms();
    e2e_http_parallel(gw->port, rq, out, N);
    uint64_t took = e2e_now_ms() - t0;
    int ok = 0, reported = 0;
    for (int i = 0; i < N; i++) {
        if (out[i].status == 200 && out[i].body_len == strlen(paths[i]) &&
            memcmp(out[i].body, paths[i], out[i].body_len) == 0)
            ok++;
        else if (reported++ < 5)
            cr_log_error("request %d: status %ld (%s)", i, out[i].status, out[i].error);
        e2e_resp_free(&out[i]);
    }
    cr_expect_eq(ok, N, "%d of %d answered 200 with their own body", ok, N);
    cr_expect(took < 3000, "100 x 200 ms took %llu ms: not parallel", (unsigned long long)took);
    cr_expect_eq(e2e_upstream_count(up, NULL), N);
}

/* The loops share the clients evenly: 12 clients connecting at once through two loops, each holding 8 of the
 * upstream's max_connections: 16, all reach the upstream at once, in one round of 600 ms (the placement is even
 * within one, and counts a connection another test step left open; 8 per loop leaves room for both). When one loop
 * took more than 8 of them (the kernel wakes both on the shared socket and the first to run took what it found),
 * its extra ones waited a whole round for a connection. */
Test(proxy, clients_are_shared_evenly_between_the_loops)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_sixteen_conns, &up, &gw);
    enum { N = 12, DELAY_MS = 600 };
    static const char *const h[] = {"X-Test-Delay-Ms: 600", NULL};
    struct e2e_req rq[N];
    struct e2e_resp out[N];
    for (int round = 0; round < 2; round++) { /* the second after the first's connections closed */
        if (round > 0)
            e2e_sleep_ms(300); /* each loop has seen its connections close */
        for (int i = 0; i < N; i++)
            rq[i] = (struct e2e_req){.method = "GET", .path = "/v1/payments/even", .headers = h, .timeout_ms = 10000};
        uint64_t t0 = e2e_now_ms();
        e2e_http_parallel(gw->port, rq, out, N);
        uint64_t took = e2e_now_ms() - t0;
        int ok = 0;
        for (int i = 0; i < N; i++) {
            if (out[i].status == 200)
                ok++;
            else
                cr_log_error("round %d, request %d: status %ld (%s)", round, i, out[i].status, out[i].error);
            e2e_resp_free(&out[i]);
        }
        cr_expect_eq(ok, N, "round %d: %d of %d answered 200", round, ok, N);
        cr_expect(took < 2 * DELAY_MS - 100,
                  "round %d: 12 x 600 ms over 2 loops x 8 connections took %llu ms: "
                  "some waited for a second round",
                  round, (unsigned long long)took);
    }
    cr_expect_eq(e2e_upstream_count(up, NULL), 2 * N);
}

/* An upstream's max_connections bounds its sockets over all I/O loops together: 12 parallel requests of 300 ms
 * through two loops to an upstream allowing 2 connections use at most 2 of them and take at least 6 rounds. */
Test(proxy, upstream_max_connections_holds_over_all_loops)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_two_conns, &up, &gw);
    enum { N = 12 };
    static const char *const h[] = {"X-Test-Delay-Ms: 300", NULL};
    struct e2e_req rq[N];
    struct e2e_resp out[N];
    for (int i = 0; i < N; i++)
        rq[i] = (struct e2e_req){.method = "GET", .path = "/v1/payments/bounded", .headers = h, .timeout_ms = 10000};
    uint64_t t0 = e2e_now_ms();
    e2e_http_parallel(gw->port, rq, out, N);
    uint64_t took = e2e_now_ms() - t0;
    char ids[N][32];
    size_t nids = 0;
    int ok = 0;
    for (int i = 0; i < N; i++) {
        const char *id = out[i].status == 200 ? e2e_resp_header(&out[i], "X-Conn-Id") : NULL;
        if (id != NULL) {
            ok++;
            size_t j = 0;
            while (j < nids && strcmp(ids[j], id) != 0)
                j++;
            if (j == nids)
                snprintf(ids[nids++], sizeof ids[0], "%s", id);
        } else {
            cr_log_error("request %d: status %ld (%s)", i, out[i].status, out[i].error);
        }
        e2e_resp_free(&out[i]);
    }
    cr_expect_eq(ok, N, "%d of %d answered 200", ok, N);
    cr_expect(nids >= 1 && nids <= 2, "the upstream saw %zu connections (max_connections: 2)", nids);
    cr_expect(took >= 5 * 300, "12 x 300 ms over 2 connections took only %llu ms", (unsigned long long)took);
}
