/* upstream_test.c - the curl-multi forwarder against the real testupstream binary (and a tiny raw server for
 * malformed-ish heads), once through each client (UP_TEST_HOST): methods, binary bodies, header order, hop-by-hop,
 * keep-alive, failure classification and the no-resend guarantee on a dead reused connection. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <malloc.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>

#ifdef __SANITIZE_ADDRESS__
/* ASan's public allocator interface (sanitizer/allocator_interface.h, not installed with gcc's runtime alone) */
size_t __sanitizer_get_current_allocated_bytes(void);
#endif

#include "common/common.h"
#include "tests/tools/body_pattern.h"
#include "upstream/upstream.h"

/* The host in the URLs: an IP address takes the built-in HTTP/1.1 client (upstream/h1.c); upstream_curl_test
 * builds this file with UP_TEST_HOST "localhost", which takes libcurl: both paths pass the same tests. */
#ifndef UP_TEST_HOST
#define UP_TEST_HOST "127.0.0.1"
#define UP_TEST_H1   1
#else
#define UP_TEST_H1 0
#endif

static pid_t g_pid = -1;
static int g_port;
static struct event_base *g_base;
static struct event *g_tick;
static struct up_client *g_cli;

/* ---- the real test upstream, one per test process */

static void testupstream_path(char *out, size_t n)
{
    const char *env = getenv("IDEMGATE_TEST_UPSTREAM");
    if (env != NULL && *env) {
        snprintf(out, n, "%s", env);
        return;
    }
    /* fallback: <build>/tests/unit/upstream_test -> <build>/tests/tools/testupstream */
    char self[PATH_MAX - 64];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    cr_assert(len > 0, "cannot find the test executable");
    self[len] = '\0';
    char *slash = strrchr(self, '/');
    cr_assert_not_null(slash);
    *slash = '\0';
    int w = snprintf(out, n, "%s/../tools/testupstream", self);
    cr_assert(w > 0 && (size_t)w < n);
}

static void start_testupstream(void)
{
    char path[PATH_MAX];
    testupstream_path(path, sizeof path);
    cr_assert(access(path, X_OK) == 0, "testupstream not found at %s (set IDEMGATE_TEST_UPSTREAM)", path);
    int pfd[2];
    cr_assert(pipe2(pfd, O_CLOEXEC) == 0);
    g_pid = fork();
    cr_assert(g_pid >= 0);
    if (g_pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        dup2(pfd[1], STDOUT_FILENO);
        close_range(3, ~0u, 0); /* no inherited descriptor of the test runner */
        execl(path, path, "--quiet", "--host", "127.0.0.1", "--port", "0", (char *)NULL);
        _exit(127);
    }
    close(pfd[1]);
    char line[256];
    size_t used = 0;
    uint64_t deadline = cm_now_ms() + 10000;
    g_port = 0;
    while (g_port == 0 && cm_now_ms() < deadline && used < sizeof line - 1) {
        struct pollfd p = {.fd = pfd[0], .events = POLLIN};
        if (poll(&p, 1, 100) <= 0)
            continue;
        ssize_t r = read(pfd[0], line + used, sizeof line - 1 - used);
        if (r <= 0)
            break;
        used += (size_t)r;
        line[used] = '\0';
        const char *m = strstr(line, "event=listening port=");
        if (m != NULL && strchr(m, '\n') != NULL)
            g_port = (int)strtol(m + strlen("event=listening port="), NULL, 10);
    }
    close(pfd[0]);
    cr_assert(g_port > 0, "testupstream did not report its port");
}

static void stop_testupstream(void)
{
    if (g_pid > 0) {
        kill(g_pid, SIGTERM);
        int st;
        for (int i = 0; i < 500; i++) {
            if (waitpid(g_pid, &st, WNOHANG) == g_pid) {
                g_pid = -1;
                return;
            }
            usleep(10000);
        }
        kill(g_pid, SIGKILL);
        waitpid(g_pid, &st, 0);
        g_pid = -1;
    }
}

static void on_tick(evutil_socket_t fd, short what, void *arg) {}

static void setup(void)
{
    cm_log_set_level(CM_ERROR);
    start_testupstream();
    g_base = event_base_new();
    cr_assert_not_null(g_base);
    /* a periodic wake-up so that a loop waiting on a condition re-checks its deadline */
    g_tick = event_new(g_base, -1, EV_PERSIST, on_tick, NULL);
    struct timeval tv = {0, 20000};
    event_add(g_tick, &tv);
    g_cli = up_client_create(g_base, 0);
    cr_assert_not_null(g_cli);
}

static void teardown(void)
{
    up_client_destroy(g_cli);
    g_cli = NULL;
    if (g_tick != NULL)
        event_free(g_tick);
    g_tick = NULL;
    if (g_base != NULL)
        event_base_free(g_base);
    g_base = NULL;
    stop_testupstream();
}

TestSuite(upstream, .init = setup, .fini = teardown, .timeout = 60);

/* ---- running transfers */

struct result {
    int calls;
    enum up_result r;
    int status;
    struct cm_hdrs hdrs;
    char *body;
    size_t body_len;
    char err[256];
};

static void result_free(struct result *res)
{
    cm_hdrs_free(&res->hdrs);
    free(res->body);
    memset(res, 0, sizeof *res);
}

static void on_done(void *arg, enum up_result r, struct cm_resp *resp, const char *errmsg, double secs)
{
    struct result *res = arg;
    res->calls++;
    res->r = r;
    res->status = resp->status;
    cm_hdrs_free(&res->hdrs);
    res->hdrs = resp->hdrs; /* moved out, as the callback contract allows */
    cm_hdrs_init(&resp->hdrs);
    free(res->body);
    res->body = cm_buf_take(&resp->body, &res->body_len);
    snprintf(res->err, sizeof res->err, "%s", errmsg ? errmsg : "");
}

/* Runs the loop until *count reaches want or timeout_ms passes; returns the final count. */
static int run_until(const int *count, int want, uint64_t timeout_ms)
{
    uint64_t deadline = cm_now_ms() + timeout_ms;
    while (*count < want && cm_now_ms() < deadline)
        event_base_loop(g_base, EVLOOP_ONCE);
    return *count;
}

static void run_for(uint64_t ms)
{
    uint64_t deadline = cm_now_ms() + ms;
    while (cm_now_ms() < deadline)
        event_base_loop(g_base, EVLOOP_ONCE);
}

struct reqspec {
    const char *method;
    const char *path;
    struct cm_hdrs hdrs;
    const void *body;
    size_t body_len;
    uint64_t timeout_ms;
    size_t max_response;
    bool no_resend;
    int port; /* 0: the test upstream */
    size_t max_header_bytes;
    struct up_origin origin;
    struct up_request req;
};

static void spec_init(struct reqspec *s, const char *method, const char *path)
{
    memset(s, 0, sizeof *s);
    s->method = method;
    s->path = path;
    s->timeout_ms = 10000;
    s->max_response = 8 * 1024 * 1024;
    s->no_resend = true;
    cm_hdrs_init(&s->hdrs);
}

static const struct up_request *spec_req(struct reqspec *s)
{
    s->origin = (struct up_origin){
        .host = UP_TEST_HOST, .port = (uint16_t)(s->port ? s->port : g_port), .ip_literal = UP_TEST_H1};
    s->req = (struct up_request){
        .method = s->method,
        .origin = &s->origin,
        .target = s->path,
        .max_header_bytes = s->max_header_bytes,
        .hdrs = &s->hdrs,
        .body = s->body,
        .body_len = s->body_len,
        .connect_timeout_ms = 2000,
        .timeout_ms = s->timeout_ms,
        .max_response = s->max_response,
        .no_resend = s->no_resend,
    };
    return &s->req;
}

/* Sends one request on cli and waits for its callback (at most 15 s). */
static void do_request(struct up_client *cli, struct reqspec *s, struct result *res)
{
    memset(res, 0, sizeof *res);
    cm_hdrs_init(&res->hdrs);
    struct up_transfer *t = up_send(cli, spec_req(s), on_done, res);
    cr_assert_not_null(t, "up_send failed");
    run_until(&res->calls, 1, 15000);
    cr_assert_eq(res->calls, 1, "callback calls: %d", res->calls);
    cm_hdrs_free(&s->hdrs);
}

static uint64_t upstream_count(const char *key)
{
    struct reqspec s;
    char path[256];
    if (key != NULL)
        snprintf(path, sizeof path, "/_test/count?key=%s", key);
    else
        snprintf(path, sizeof path, "/_test/count");
    spec_init(&s, "GET", path);
    struct result res;
    struct up_client *c = up_client_create(g_base, 0);
    do_request(c, &s, &res);
    up_client_destroy(c);
    cr_assert_eq(res.r, UP_OK, "count: %s (%s)", up_result_name(res.r), res.err);
    cr_assert_eq(res.status, 200, "count: status %d", res.status);
    uint64_t v = strtoull(res.body ? res.body : "x", NULL, 10);
    result_free(&res);
    return v;
}

static char *upstream_last_headers(void)
{
    struct reqspec s;
    spec_init(&s, "GET", "/_test/last-headers");
    struct result res;
    do_request(g_cli, &s, &res);
    cr_assert_eq(res.r, UP_OK, "last-headers: %s (%s)", up_result_name(res.r), res.err);
    char *out = cm_strndup(res.body ? res.body : "", res.body_len);
    result_free(&res);
    return out;
}

static size_t hdr_index(const struct cm_hdrs *h, const char *name, const char *value, size_t from)
{
    for (size_t i = from; i < h->n; i++)
        if (strcasecmp(h->v[i].name, name) == 0 && (value == NULL || strcmp(h->v[i].value, value) == 0))
            return i;
    return (size_t)-1;
}

static char *random_binary(size_t n)
{
    char *p = cm_malloc(n);
    uint32_t x = 2463534242u;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        p[i] = (char)(i % 100 == 7 ? 0 : (x & 0xff));
    }
    return p;
}

/* ---- tests */

Test(upstream, every_method_reaches_the_upstream)
{
    const char *methods[] = {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"};
    for (size_t i = 0; i < sizeof methods / sizeof *methods; i++) {
        struct reqspec s;
        struct result res;
        spec_init(&s, methods[i], "/m/x?y=1&z=%20");
        bool with_body = strcmp(methods[i], "GET") != 0 && strcmp(methods[i], "HEAD") != 0;
        if (with_body) {
            s.body = "{\"a\":1}";
            s.body_len = 7;
            cm_hdrs_add(&s.hdrs, "Content-Type", "application/json");
        }
        do_request(g_cli, &s, &res);
        cr_assert_eq(res.r, UP_OK, "%s: %s (%s)", methods[i], up_result_name(res.r), res.err);
        cr_assert_eq(res.status, 200, "%s: status %d", methods[i], res.status);
        cr_assert_str_eq(cm_hdrs_get(&res.hdrs, "X-Echo-Method"), methods[i]);
        cr_assert_str_eq(cm_hdrs_get(&res.hdrs, "X-Echo-Uri"), "/m/x?y=1&z=%20");
        if (strcmp(methods[i], "HEAD") == 0)
            cr_assert_eq(res.body_len, 0);
        else if (with_body)
            cr_assert(res.body_len == 7 && memcmp(res.body, "{\"a\":1}", 7) == 0, "%s: body not echoed", methods[i]);
        else
            cr_assert(res.body_len > 0 && strstr(res.body, "\"ok\":true") != NULL);
        result_free(&res);
    }
    cr_assert_eq(upstream_count(NULL), 7);
}

Test(upstream, status_and_empty_post_body)
{
    struct reqspec s;
    struct result res;
    spec_init(&s, "POST", "/created");
    cm_hdrs_add(&s.hdrs, "X-Test-Status", "201");
    do_request(g_cli, &s, &res);
    cr_assert_eq(res.r, UP_OK, "%s (%s)", up_result_name(res.r), res.err);
    cr_assert_eq(res.status, 201, "status %d", res.status);
    result_free(&res);
    char *h = upstream_last_headers();
    cr_assert_not_null(strstr(h, "Content-Length: 0\n"), "an empty POST carries Content-Length: 0:\n%s", h);
    free(h);
}

Test(upstream, headers_sent_as_given_without_curl_defaults)
{
    struct reqspec s;
    struct result res;
    spec_init(&s, "POST", "/h");
    cm_hdrs_add(&s.hdrs, "Host", "api.example.test");
    cm_hdrs_add(&s.hdrs, "X-First", "1");
    cm_hdrs_add(&s.hdrs, "X-Empty", "");
    cm_hdrs_add(&s.hdrs, "X-Dup", "a");
    cm_hdrs_add(&s.hdrs, "X-Dup", "b");
    char *big = random_binary(2 * 1024 * 1024); /* over 1 MiB: libcurl would add Expect: 100-continue */
    s.body = big;
    s.body_len = 2 * 1024 * 1024;
    do_request(g_cli, &s, &res);
    cr_assert_eq(res.r, UP_OK, "%s", res.err);
    result_free(&res);
    free(big);
    char *h = upstream_last_headers();
    cr_assert_not_null(strstr(h, "Host: api.example.test\n"), "%s", h);
    const char *a = strstr(h, "X-First: 1\n"), *b = strstr(h, "X-Dup: a\n"), *c = strstr(h, "X-Dup: b\n");
    cr_assert(a && b && c && a < b && b < c, "order kept:\n%s", h);
    cr_assert_not_null(strstr(h, "X-Empty: \n"), "%s", h);
    cr_assert_null(strstr(h, "Expect"), "no Expect:\n%s", h);
    cr_assert_null(strstr(h, "Accept"), "no Accept:\n%s", h);
    cr_assert_null(strstr(h, "Content-Type"), "no Content-Type unless given:\n%s", h);
    cr_assert_null(strstr(h, "User-Agent"), "%s", h);
    free(h);
}

Test(upstream, one_mib_binary_both_ways)
{
    size_t n = 1024 * 1024;
    char *body = random_binary(n);
    struct reqspec s;
    struct result res;
    spec_init(&s, "POST", "/echo");
    cm_hdrs_add(&s.hdrs, "Content-Type", "application/octet-stream");
    s.body = body;
    s.body_len = n;
    do_request(g_cli, &s, &res);
    cr_assert_eq(res.r, UP_OK, "%s", res.err);
    cr_assert_eq(res.body_len, n);
    cr_assert(memcmp(res.body, body, n) == 0, "echoed body differs");
    result_free(&res);
    free(body);

    for (int chunked = 0; chunked < 2; chunked++) {
        spec_init(&s, "GET", "/bin");
        cm_hdrs_add(&s.hdrs, "X-Test-Body-Size", "1048576");
        if (chunked)
            cm_hdrs_add(&s.hdrs, "X-Test-Chunked", "1");
        do_request(g_cli, &s, &res);
        cr_assert_eq(res.r, UP_OK, "%s", res.err);
        cr_assert_eq(res.body_len, n);
        size_t zeros = 0;
        for (size_t i = 0; i < n; i++) {
            cr_assert_eq((uint8_t)res.body[i], test_body_byte(i), "byte %zu differs (chunked=%d)", i, chunked);
            zeros += res.body[i] == 0;
        }
        cr_assert(zeros > 1000);
        cr_assert_null(cm_hdrs_get(&res.hdrs, "Transfer-Encoding"));
        result_free(&res);
    }
}

Test(upstream, repeated_headers_in_order_and_hop_by_hop_stripped)
{
    struct reqspec s;
    struct result res;
    spec_init(&s, "GET", "/hdrs");
    cm_hdrs_add(&s.hdrs, "X-Test-Chunked", "1");
    do_request(g_cli, &s, &res);
    cr_assert_eq(res.r, UP_OK);
    size_t a = hdr_index(&res.hdrs, "Set-Cookie", "a=1", 0);
    size_t b = hdr_index(&res.hdrs, "Set-Cookie", "b=2", 0);
    size_t one = hdr_index(&res.hdrs, "X-Multi", "one", 0);
    size_t two = hdr_index(&res.hdrs, "X-Multi", "two", 0);
    cr_assert(a != (size_t)-1 && b != (size_t)-1 && a < b, "Set-Cookie a=1 then b=2");
    cr_assert(one != (size_t)-1 && two != (size_t)-1 && one < two, "X-Multi one then two");
    cr_assert_eq(hdr_index(&res.hdrs, "Connection", NULL, 0), (size_t)-1);
    cr_assert_eq(hdr_index(&res.hdrs, "Keep-Alive", NULL, 0), (size_t)-1);
    cr_assert_eq(hdr_index(&res.hdrs, "X-Hop", NULL, 0), (size_t)-1, "named in Connection");
    cr_assert_eq(hdr_index(&res.hdrs, "Transfer-Encoding", NULL, 0), (size_t)-1);
    cr_assert_not_null(cm_hdrs_get(&res.hdrs, "X-Upstream-Exec"));
    cr_assert_str_eq(cm_hdrs_get(&res.hdrs, "Content-Type"), "application/json");
    result_free(&res);
}

#if UP_TEST_H1
/* The conn id of a GET whose answer carries Keep-Alive: ka (NULL: the upstream's usual timeout=5). */
static void conn_of(const char *ka, char out[32])
{
    struct reqspec s;
    struct result res;
    spec_init(&s, "GET", "/ka-hint");
    if (ka)
        cm_hdrs_add(&s.hdrs, "X-Test-Keep-Alive", ka);
    do_request(g_cli, &s, &res);
    cr_assert_eq(res.r, UP_OK, "Keep-Alive: %s", ka ? ka : "(usual)");
    const char *id = cm_hdrs_get(&res.hdrs, "X-Conn-Id");
    cr_assert_not_null(id);
    snprintf(out, 32, "%s", id);
    result_free(&res);
}

/* The built-in client believes a server's Keep-Alive: timeout=N (it closes idle connections then), the smallest
 * when it says several, 0 included; anything malformed or hostile is ignored (the configured keepalive applies). */
Test(upstream, the_servers_keep_alive_timeout_bounds_reuse_and_a_bad_one_is_ignored)
{
    static const struct {
        const char *ka;
        unsigned idle_ms;
        bool reused;
    } cases[] = {
        {"timeout=0", 0, false},
        {"max=100, timeout=0", 0, false},
        {"timeout=5, timeout=0", 0, false},
        {"TIMEOUT=0", 0, false},
        {"timeout=0;max=3", 0, false},
        {"timeout=1", 700, false}, /* under 2 s: half of it */
        {"timeout=1", 100, true},
        {"timeout=5, max=100", 300, true},
        {"timeout=5x", 0, true},
        {"timeout=", 0, true},
        {"timeout=-1", 0, true},
        {"timeout=\"0\"", 0, true},
        {"timeout = 0", 0, true},
        {"xtimeout=0", 0, true},
        {"timeout=9999999", 0, true},
        {"timeout=18446744073709551617", 0, true},
        {"timeout=000000000000000000000000000000000000000000000000000000000000000000000000000000000001", 0, true},
        {"max=0", 0, true},
        {",,,=,timeout", 0, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char a[32], b[32];
        conn_of(NULL, a); /* a connection the next one may reuse */
        conn_of(cases[i].ka, a);
        if (cases[i].idle_ms)
            usleep(cases[i].idle_ms * 1000);
        conn_of(NULL, b);
        if (cases[i].reused)
            cr_expect_str_eq(a, b, "Keep-Alive: %s, idle %u ms: not reused", cases[i].ka, cases[i].idle_ms);
        else
            cr_expect_str_neq(a, b, "Keep-Alive: %s, idle %u ms: reused", cases[i].ka, cases[i].idle_ms);
    }
}
#endif

Test(upstream, keep_alive_connection_is_reused)
{
    char first[32] = "";
    for (int i = 0; i < 3; i++) {
        struct reqspec s;
        struct result res;
        spec_init(&s, i == 1 ? "POST" : "GET", "/ka");
        if (i == 1) {
            s.body = "x";
            s.body_len = 1;
        }
        do_request(g_cli, &s, &res);
        cr_assert_eq(res.r, UP_OK);
        const char *id = cm_hdrs_get(&res.hdrs, "X-Conn-Id");
        cr_assert_not_null(id);
        if (i == 0)
            snprintf(first, sizeof first, "%s", id);
        else
            cr_assert_str_eq(id, first, "request %d used another connection", i);
        result_free(&res);
    }
}

Test(upstream, refused_connect_is_connect_failed)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert(bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    socklen_t sl = sizeof sa;
    cr_assert(getsockname(fd, (struct sockaddr *)&sa, &sl) == 0);
    close(fd); /* bound, never listened: the port is closed */
    struct reqspec s;
    struct result res;
    spec_init(&s, "POST", "/nobody-home");
    s.port = ntohs(sa.sin_port);
    do_request(g_cli, &s, &res);
    cr_assert_eq(res.r, UP_CONNECT_FAILED, "got %s (%s)", up_result_name(res.r), res.err);
    result_free(&res);
}

Test(upstream, slow_answer_is_timeout_after_sending)
{
    struct reqspec s;
    struct result res;
    spec_init(&s, "POST", "/slow");
    cm_hdrs_add(&s.hdrs, "X-Test-Delay-Ms", "3000");
    cm_hdrs_add(&s.hdrs, "Idempotency-Key", "slow-1");
    s.timeout_ms = 300;
    uint64_t t0 = cm_now_ms();
    do_request(g_cli, &s, &res);
    cr_assert_eq(res.r, UP_TIMEOUT, "got %s (%s)", up_result_name(res.r), res.err);
    cr_assert(cm_now_ms() - t0 < 2500);
    result_free(&res);
    cr_assert_eq(upstream_count("slow-1"), 1, "the request did reach the upstream");
}

Test(upstream, queued_past_its_timeout_is_connect_failed)
{
    struct up_client *c = up_client_create(g_base, 1);
    cr_assert_not_null(c);
    struct reqspec s1, s2;
    struct result r1 = {0}, r2 = {0};
    cm_hdrs_init(&r1.hdrs);
    cm_hdrs_init(&r2.hdrs);
    spec_init(&s1, "POST", "/hold");
    cm_hdrs_add(&s1.hdrs, "X-Test-Delay-Ms", "1500");
    spec_init(&s2, "POST", "/queued");
    cm_hdrs_add(&s2.hdrs, "Idempotency-Key", "queued-1");
    s2.timeout_ms = 300;
    cr_assert_not_null(up_send(c, spec_req(&s1), on_done, &r1));
    cr_assert_not_null(up_send(c, spec_req(&s2), on_done, &r2));
    cr_assert_eq(up_active(c), 2);
    run_until(&r2.calls, 1, 5000);
    cr_assert_eq(r2.calls, 1);
    cr_assert_eq(r2.r, UP_CONNECT_FAILED, "waiting for a connection slot sent nothing: got %s (%s)",
                 up_result_name(r2.r), r2.err);
    run_until(&r1.calls, 1, 5000);
    cr_assert_eq(r1.r, UP_OK);
    cm_hdrs_free(&s1.hdrs);
    cm_hdrs_free(&s2.hdrs);
    result_free(&r1);
    result_free(&r2);
    up_client_destroy(c);
    cr_assert_eq(upstream_count("queued-1"), 0);
}

Test(upstream, close_or_reset_without_answer_is_no_response)
{
    const char *actions[] = {"close", "reset"};
    for (int i = 0; i < 2; i++) {
        /* a fresh client: the connection is new, so libcurl has no reason to re-send */
        struct up_client *c = up_client_create(g_base, 0);
        char key[32];
        snprintf(key, sizeof key, "drop-%s", actions[i]);
        struct reqspec s;
        struct result res;
        spec_init(&s, "POST", "/drop");
        s.body = "pay";
        s.body_len = 3;
        s.no_resend = false;
        cm_hdrs_add(&s.hdrs, "X-Test-Action", actions[i]);
        cm_hdrs_add(&s.hdrs, "Idempotency-Key", key);
        do_request(c, &s, &res);
        cr_assert_eq(res.r, UP_NO_RESPONSE, "%s: got %s (%s)", actions[i], up_result_name(res.r), res.err);
        result_free(&res);
        up_client_destroy(c);
        cr_assert_eq(upstream_count(key), 1);
    }
}

/* The upstream executes, then the REUSED keep-alive connection dies without a response byte. libcurl re-sends
 * such a request by itself; with no_resend it must not, and the outcome is unknown (UP_NO_RESPONSE). The control
 * (no_resend=false) shows that the test does detect the second execution. */
Test(upstream, dead_reused_connection_is_never_resent)
{
    struct {
        const char *method, *action;
        bool no_resend;
        uint64_t want;
    } cases[] = {
        {"POST", "close", true, 1},  {"POST", "reset", true, 1},  {"DELETE", "close", true, 1},
        {"POST", "close", false, 2}, {"POST", "reset", false, 2}, {"DELETE", "close", false, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        struct up_client *c = up_client_create(g_base, 0);
        struct reqspec s;
        struct result res;
        spec_init(&s, "GET", "/warm-up");
        do_request(c, &s, &res);
        cr_assert_eq(res.r, UP_OK);
        char conn[32];
        snprintf(conn, sizeof conn, "%s", cm_hdrs_get(&res.hdrs, "X-Conn-Id"));
        result_free(&res);

        char key[64];
        snprintf(key, sizeof key, "reused-%zu", i);
        spec_init(&s, cases[i].method, "/pay");
        if (strcmp(cases[i].method, "POST") == 0) {
            s.body = "{\"amount\":100}";
            s.body_len = strlen(s.body);
        }
        s.no_resend = cases[i].no_resend;
        cm_hdrs_add(&s.hdrs, "Idempotency-Key", key);
        cm_hdrs_add(&s.hdrs, "X-Test-Action", cases[i].action);
        do_request(c, &s, &res);
        cr_assert_eq(res.r, UP_NO_RESPONSE, "case %zu: got %s (%s)", i, up_result_name(res.r), res.err);
        result_free(&res);
        uint64_t n = upstream_count(key);
        cr_assert_eq(n, cases[i].want, "case %zu (%s %s no_resend=%d): executed %llu times", i, cases[i].method,
                     cases[i].action, cases[i].no_resend, (unsigned long long)n);

        /* the client is still usable afterwards */
        spec_init(&s, "GET", "/after");
        do_request(c, &s, &res);
        cr_assert_eq(res.r, UP_OK);
        cr_assert_str_neq(cm_hdrs_get(&res.hdrs, "X-Conn-Id"), conn, "the dead connection is not reused");
        result_free(&res);
        up_client_destroy(c);
    }
}

Test(upstream, response_over_cap_is_too_large)
{
    struct reqspec s;
    struct result res;
    spec_init(&s, "GET", "/big");
    cm_hdrs_add(&s.hdrs, "X-Test-Body-Size", "100000");
    s.max_response = 65536;
    do_request(g_cli, &s, &res);
    cr_assert_eq(res.r, UP_TOO_LARGE, "got %s", up_result_name(res.r));
    result_free(&res);
    /* exactly at the cap is fine */
    spec_init(&s, "GET", "/big");
    cm_hdrs_add(&s.hdrs, "X-Test-Body-Size", "65536");
    s.max_response = 65536;
    do_request(g_cli, &s, &res);
    cr_assert_eq(res.r, UP_OK);
    cr_assert_eq(res.body_len, 65536);
    result_free(&res);
}

struct many {
    int done;
    int ok;
    struct cm_hdrs conn_ids;
};

static void on_many(void *arg, enum up_result r, struct cm_resp *resp, const char *errmsg, double secs)
{
    struct many *m = arg;
    m->done++;
    if (r == UP_OK && resp->status == 200) {
        m->ok++;
        const char *id = cm_hdrs_get(&resp->hdrs, "X-Conn-Id");
        if (id != NULL && cm_hdrs_get(&m->conn_ids, id) == NULL)
            cm_hdrs_add(&m->conn_ids, id, "1");
    }
}

Test(upstream, two_hundred_concurrent_transfers)
{
    struct many m = {0};
    cm_hdrs_init(&m.conn_ids);
    struct reqspec s;
    spec_init(&s, "POST", "/concurrent");
    cm_hdrs_add(&s.hdrs, "X-Test-Delay-Ms", "100");
    s.body = "c";
    s.body_len = 1;
    for (int i = 0; i < 200; i++)
        cr_assert_not_null(up_send(g_cli, spec_req(&s), on_many, &m));
    cm_hdrs_free(&s.hdrs);
    cr_assert_eq(up_active(g_cli), 200);
    run_until(&m.done, 200, 5000); /* serially this would take 20 s */
    cr_assert_eq(m.done, 200);
    cr_assert_eq(m.ok, 200);
    cr_assert_eq(up_active(g_cli), 0);
    cr_assert(m.conn_ids.n > 100, "ran in parallel on %zu connections", m.conn_ids.n);
    cm_hdrs_free(&m.conn_ids);
}

#if UP_TEST_H1
/* Bytes malloc has handed out and not taken back, over every arena (ASan's allocator counts its own). */
static size_t heap_in_use(void)
{
#ifdef __SANITIZE_ADDRESS__
    return __sanitizer_get_current_allocated_bytes();
#else
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
#endif
}

/* One wave of n transfers to a 300 ms upstream; *waiting gets the heap in use while all of them wait. */
static void wave(int n, size_t *waiting)
{
    struct many m = {0};
    cm_hdrs_init(&m.conn_ids);
    struct reqspec s;
    spec_init(&s, "GET", "/buffers");
    cm_hdrs_add(&s.hdrs, "X-Test-Delay-Ms", "300");
    for (int i = 0; i < n; i++)
        cr_assert_not_null(up_send(g_cli, spec_req(&s), on_many, &m));
    cm_hdrs_free(&s.hdrs);
    run_for(150); /* every request sent, no answer yet */
    cr_assert_eq(m.done, 0, "answers came before the upstream's delay");
    *waiting = heap_in_use();
    run_until(&m.done, n, 5000);
    cr_assert_eq(m.ok, n);
    cm_hdrs_free(&m.conn_ids);
}

/* A connection holds a receive buffer only while it reads a response: not while it is idle, nor while its request
 * waits for the answer (1000 clients on a slow upstream held 1000 of them, 4 MB). */
Test(upstream, connections_hold_no_receive_buffer_while_idle_or_waiting)
{
    enum { N = 200 };
    size_t w1, w2;
    wave(N, &w1); /* opens the connections */
    size_t idle = heap_in_use();
    wave(N, &w2); /* reuses them */
    size_t after = heap_in_use();
    cr_assert_eq(up_active(g_cli), 0);
    long per_wait = ((long)w2 - (long)w1) / N;
    cr_log_info("heap: waiting %zu, idle %zu, waiting again %zu, idle again %zu", w1, idle, w2, after);
    /* the second wave waits on connections that have read a response before: no more heap than the first */
    cr_expect(w2 < w1 + (size_t)N * 512,
              "waiting on reused connections holds %ld bytes more per connection than "
              "on new ones (a receive buffer is %ld)",
              per_wait, (long)4096);
    cr_expect(idle < w1, "idle connections hold more than waiting ones (%zu against %zu)", idle, w1);
}
#endif

Test(upstream, max_host_connections_bounds_sockets)
{
    struct up_client *c = up_client_create(g_base, 4);
    struct many m = {0};
    cm_hdrs_init(&m.conn_ids);
    struct reqspec s;
    spec_init(&s, "GET", "/bounded");
    cm_hdrs_add(&s.hdrs, "X-Test-Delay-Ms", "50");
    for (int i = 0; i < 40; i++)
        cr_assert_not_null(up_send(c, spec_req(&s), on_many, &m));
    cm_hdrs_free(&s.hdrs);
    run_until(&m.done, 40, 10000);
    cr_assert_eq(m.ok, 40);
    cr_assert(m.conn_ids.n >= 1 && m.conn_ids.n <= 4, "used %zu connections", m.conn_ids.n);
    cm_hdrs_free(&m.conn_ids);
    up_client_destroy(c);
}

Test(upstream, cancel_and_destroy_never_call_back)
{
    struct reqspec s;
    struct result res = {0};
    cm_hdrs_init(&res.hdrs);
    spec_init(&s, "POST", "/cancelled");
    cm_hdrs_add(&s.hdrs, "X-Test-Delay-Ms", "300");
    struct up_transfer *t = up_send(g_cli, spec_req(&s), on_done, &res);
    cr_assert_not_null(t);
    run_for(50);
    up_cancel(g_cli, t);
    cr_assert_eq(up_active(g_cli), 0);
    run_for(500);
    cr_assert_eq(res.calls, 0);

    struct up_client *c = up_client_create(g_base, 0);
    for (int i = 0; i < 5; i++)
        cr_assert_not_null(up_send(c, spec_req(&s), on_done, &res));
    run_for(50);
    up_client_destroy(c);
    run_for(400);
    cr_assert_eq(res.calls, 0);
    cm_hdrs_free(&s.hdrs);

    /* the shared client still works */
    spec_init(&s, "GET", "/alive");
    do_request(g_cli, &s, &res);
    cr_assert_eq(res.r, UP_OK);
    result_free(&res);
}

/* Destroying a client with a transfer waiting for a connection slot never sends that one: the slot freed by
 * stopping the running transfer is not handed on. */
Test(upstream, destroy_sends_nothing_that_waits)
{
    struct up_client *c = up_client_create(g_base, 1);
    struct reqspec s1, s2;
    struct result r1 = {0}, r2 = {0};
    spec_init(&s1, "POST", "/running");
    cm_hdrs_add(&s1.hdrs, "X-Test-Delay-Ms", "300");
    spec_init(&s2, "POST", "/waiting");
    cm_hdrs_add(&s2.hdrs, "Idempotency-Key", "waiting-1");
    cr_assert_not_null(up_send(c, spec_req(&s1), on_done, &r1));
    cr_assert_not_null(up_send(c, spec_req(&s2), on_done, &r2));
    run_for(100);
    up_client_destroy(c);
    run_for(500);
    cr_assert_eq(r1.calls + r2.calls, 0);
    cm_hdrs_free(&s1.hdrs);
    cm_hdrs_free(&s2.hdrs);
    cr_assert_eq(upstream_count("waiting-1"), 0, "the waiting request was sent");
}

/* ---- a raw server for heads testupstream cannot produce (interim 1xx, folded lines) */

static const char *g_canned;
static size_t g_canned_len; /* 0: strlen(g_canned) (a canned answer with a NUL byte sets it) */
static int g_raw_accepts;   /* connections the raw server accepted */

static void raw_write_cb(struct bufferevent *bev, void *arg)
{
    if (evbuffer_get_length(bufferevent_get_output(bev)) == 0)
        bufferevent_free(bev);
}

static void raw_event_cb(struct bufferevent *bev, short what, void *arg)
{
    if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR))
        bufferevent_free(bev);
}

static void raw_read_cb(struct bufferevent *bev, void *arg)
{
    struct evbuffer *in = bufferevent_get_input(bev);
    struct evbuffer_ptr p = evbuffer_search(in, "\r\n\r\n", 4, NULL);
    if (p.pos < 0)
        return;
    evbuffer_drain(in, evbuffer_get_length(in));
    bufferevent_setcb(bev, NULL, raw_write_cb, raw_event_cb, arg);
    bufferevent_write(bev, g_canned, g_canned_len ? g_canned_len : strlen(g_canned));
}

static void raw_accept(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int len, void *arg)
{
    struct bufferevent *bev = bufferevent_socket_new(g_base, fd, BEV_OPT_CLOSE_ON_FREE);
    g_raw_accepts++;
    bufferevent_setcb(bev, raw_read_cb, NULL, raw_event_cb, NULL);
    bufferevent_enable(bev, EV_READ | EV_WRITE);
}

/* A server with accept callback cb on a loopback port of its own (in this process, on g_base). */
static struct evconnlistener *listen_with(evconnlistener_cb cb, void *arg, int *port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct evconnlistener *l = evconnlistener_new_bind(g_base, cb, arg, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE, 16,
                                                       (struct sockaddr *)&sa, sizeof sa);
    cr_assert_not_null(l);
    socklen_t sl = sizeof sa;
    getsockname(evconnlistener_get_fd(l), (struct sockaddr *)&sa, &sl);
    *port = ntohs(sa.sin_port);
    return l;
}

/* The raw server (answers every request with g_canned, then closes). */
static struct evconnlistener *raw_listen(int *port)
{
    g_canned_len = 0;
    return listen_with(raw_accept, NULL, port);
}

Test(upstream, interim_response_is_skipped)
{
    int raw_port;
    struct evconnlistener *l = raw_listen(&raw_port);
    g_canned = "HTTP/1.1 100 Continue\r\nX-Interim: yes\r\n\r\n"
               "HTTP/1.1 202 Accepted\r\nX-A: 1\r\nContent-Length: 2\r\n"
               "Connection: close\r\n\r\nhi";
    struct reqspec s;
    struct result res;
    spec_init(&s, "POST", "/raw");
    s.port = raw_port;
    s.body = "b";
    s.body_len = 1;
    do_request(g_cli, &s, &res);
    cr_assert_eq(res.r, UP_OK, "%s (%s)", up_result_name(res.r), res.err);
    cr_assert_eq(res.status, 202);
    cr_assert_null(cm_hdrs_get(&res.hdrs, "X-Interim"), "the interim head is dropped");
    cr_assert_str_eq(cm_hdrs_get(&res.hdrs, "X-A"), "1");
    cr_assert_null(cm_hdrs_get(&res.hdrs, "Connection"));
    cr_assert(res.body_len == 2 && memcmp(res.body, "hi", 2) == 0);
    result_free(&res);
    evconnlistener_free(l);
}

/* Framings and malformed answers, each from a server that answers and closes: both clients agree on them. */
Test(upstream, framings_and_malformed_answers)
{
    int raw_port;
    struct evconnlistener *l = raw_listen(&raw_port);
    struct {
        const char *method, *canned;
        enum up_result want;
        int status;
        const char *body; /* NULL: not checked */
    } cases[] = {
        {"GET", "HTTP/1.1 200 OK\r\nX-A: 1\r\n\r\nread to the close", UP_OK, 200, "read to the close"},
        {"GET",
         "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\n"
         "X-Trailer: t\r\n\r\n",
         UP_OK, 200, "abcde"},
        {"GET", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n1\r\nz\r\n0\r\n\r\n", UP_OK,
         200, "z"},
        {"GET", "HTTP/1.0 201 Created\nContent-Length: 4\n\nbare", UP_OK, 201, "bare"},
        {"POST", "HTTP/1.1 204 No Content\r\nX-B: 2\r\n\r\n", UP_OK, 204, ""},
        {"HEAD", "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", UP_OK, 200, ""},
        {"GET", "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", UP_NO_RESPONSE, 0, NULL},
        {"GET", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc", UP_ERROR, 0, NULL},
        /* two different lengths: an error (RFC 9112 6.3); libcurl 7.88 would take the last one, curl.c refuses it */
        {"GET", "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", UP_ERROR, 0, NULL},
        {"GET", "SMTP ready\r\n\r\n", UP_ERROR, 0, NULL},
        {"GET", "HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", UP_ERROR, 0, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        g_canned = cases[i].canned;
        struct reqspec s;
        struct result res;
        spec_init(&s, cases[i].method, "/raw");
        s.port = raw_port;
        do_request(g_cli, &s, &res);
        enum up_result got = res.r == UP_NO_RESPONSE && cases[i].want == UP_ERROR ? UP_ERROR : res.r;
        cr_assert_eq(got, cases[i].want, "case %zu: got %s (%s)", i, up_result_name(res.r), res.err);
        if (cases[i].want == UP_OK) {
            cr_assert_eq(res.status, cases[i].status, "case %zu: status %d", i, res.status);
            cr_assert(res.body_len == strlen(cases[i].body) &&
                          memcmp(res.body ? res.body : "", cases[i].body, res.body_len) == 0,
                      "case %zu: body %zu bytes", i, res.body_len);
            cr_assert_null(cm_hdrs_get(&res.hdrs, "X-Trailer"), "case %zu: a trailer is not a header", i);
            cr_assert_null(cm_hdrs_get(&res.hdrs, "Transfer-Encoding"), "case %zu", i);
        }
        result_free(&res);
    }
    evconnlistener_free(l);
}

/* A kept-alive connection the upstream closed while idle is not used again, even when the loop has not seen the
 * close yet: a request that may not be sent twice gets a new connection and its answer. (The raw server answers
 * with a keep-alive head, then closes.) */
Test(upstream, idle_connection_closed_by_the_upstream_is_not_reused)
{
    int raw_port;
    struct evconnlistener *l = raw_listen(&raw_port);
    g_canned = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
    for (int i = 0; i < 3; i++) {
        struct reqspec s;
        struct result res;
        spec_init(&s, i == 0 ? "GET" : "POST", "/raw");
        s.port = raw_port;
        s.body = i == 0 ? NULL : "x";
        s.body_len = i == 0 ? 0 : 1;
        do_request(g_cli, &s, &res);
        cr_assert_eq(res.r, UP_OK, "request %d: got %s (%s)", i, up_result_name(res.r), res.err);
        cr_assert(res.body_len == 2 && memcmp(res.body, "ok", 2) == 0);
        result_free(&res);
        usleep(30000); /* the close reaches this side; the loop does not run */
    }
    evconnlistener_free(l);
}

/* The upstream answers before it has read the whole request (an early 413) and closes: the answer is taken,
 * not lost behind the failed send. */
Test(upstream, early_answer_while_the_body_is_still_sent)
{
    int raw_port;
    struct evconnlistener *l = raw_listen(&raw_port);
    g_canned = "HTTP/1.1 413 Payload Too Large\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbig!";
    size_t n = 8 * 1024 * 1024;
    char *body = cm_malloc(n);
    memset(body, 'b', n);
    struct reqspec s;
    struct result res;
    spec_init(&s, "POST", "/raw");
    s.port = raw_port;
    s.body = body;
    s.body_len = n;
    do_request(g_cli, &s, &res);
    cr_assert_eq(res.r, UP_OK, "got %s (%s)", up_result_name(res.r), res.err);
    cr_assert_eq(res.status, 413);
    cr_assert(res.body_len == 4 && memcmp(res.body, "big!", 4) == 0);
    result_free(&res);
    free(body);
    evconnlistener_free(l);
}

/* A listening socket on a loopback port, not on the loop: the kernel completes handshakes into its queue. */
static int plain_listen(int backlog, int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert(fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(fd, backlog) == 0);
    socklen_t sl = sizeof sa;
    cr_assert(getsockname(fd, (struct sockaddr *)&sa, &sl) == 0);
    *port = ntohs(sa.sin_port);
    return fd;
}

/* Waits at most ms for fd to be readable, then reads what is there (NUL-terminated); returns the byte count. */
static ssize_t read_within(int fd, char *buf, size_t n, int ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, ms) != 1)
        return 0;
    ssize_t r = recv(fd, buf, n - 1, MSG_DONTWAIT);
    buf[r > 0 ? r : 0] = 0;
    return r;
}

/* Starts GET path to the loopback port on the shared client, without running the loop. */
static void start_get(struct reqspec *s, struct result *res, const char *path, int port)
{
    memset(res, 0, sizeof *res);
    cm_hdrs_init(&res->hdrs);
    spec_init(s, "GET", path);
    s->port = port;
    cr_assert_not_null(up_send(g_cli, spec_req(s), on_done, res));
}

/* The server's side of a transfer that reached it on fd: a 200 "ok", then the loop runs until res's callback. */
static void answer_ok(int fd, struct result *res)
{
    const char *answer = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
    cr_assert_eq(send(fd, answer, strlen(answer), MSG_NOSIGNAL), (ssize_t)strlen(answer));
    run_until(&res->calls, 1, 10000);
    cr_assert_eq(res->calls, 1);
    cr_assert_eq(res->r, UP_OK, "got %s (%s)", up_result_name(res->r), res->err);
    cr_assert(res->status == 200 && res->body_len == 2 && memcmp(res->body, "ok", 2) == 0);
    result_free(res);
}

/* A request on a new connection to a local server leaves inside up_send: the handshake completed in connect(),
 * so it does not wait for the loop's next turn (after a burst of new clients that turn comes once all of them
 * are read and connected, and every one of their requests would leave late). The loop does not run until the
 * server has read it. The built-in client only: libcurl starts every transfer from its multi handle's loop. */
#if UP_TEST_H1
Test(upstream, a_new_local_connection_sends_the_request_before_the_loop_turns)
{
    int port;
    int lfd = plain_listen(16, &port);
    struct reqspec s;
    struct result res;
    start_get(&s, &res, "/first-turn", port);
    struct pollfd p = {.fd = lfd, .events = POLLIN};
    cr_assert_eq(poll(&p, 1, 2000), 1, "no connection reached the server");
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    cr_assert(fd >= 0);
    char buf[4096];
    ssize_t n = read_within(fd, buf, sizeof buf, 1000);
    cr_assert(n > 0, "the request was not sent before the loop ran (%zd bytes within 1 s)", n);
    cr_assert(strncmp(buf, "GET /first-turn HTTP/1.1\r\n", 26) == 0, "got: %.60s", buf);
    answer_ok(fd, &res);
    cm_hdrs_free(&s.hdrs);
    close(fd);
    close(lfd);
}
#endif

/* A handshake that does not complete inside connect() (the server's queue is full, so its SYN is dropped and sent
 * again a second later): the request waits for the connection and goes out once it is up. */
Test(upstream, a_handshake_that_completes_later_still_sends_the_request)
{
    int port;
    int lfd = plain_listen(0, &port);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK), .sin_port = htons(port)};
    int fill[4];
    for (int i = 0; i < 4; i++) { /* fill the queue; the later of these stay in SYN_SENT themselves */
        fill[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        cr_assert(fill[i] >= 0);
        (void)connect(fill[i], (struct sockaddr *)&sa, sizeof sa);
    }
    struct reqspec s;
    struct result res;
    start_get(&s, &res, "/late-handshake", port);
    run_for(200);
    cr_assert_eq(res.calls, 0, "ended before the server took the connection: %s (%s)", up_result_name(res.r), res.err);
    for (int i = 0; i < 4; i++)
        close(fill[i]);
    /* Accept until the gateway's request shows up (the queue holds the fillers' connections first). */
    char buf[4096];
    int fd = -1;
    uint64_t deadline = cm_now_ms() + 8000;
    while (fd < 0 && cm_now_ms() < deadline) {
        run_for(20);
        struct pollfd p = {.fd = lfd, .events = POLLIN};
        if (poll(&p, 1, 50) != 1)
            continue;
        int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        cr_assert(c >= 0);
        uint64_t wait_until = cm_now_ms() + 300;
        ssize_t n = 0;
        while (n == 0 && cm_now_ms() < wait_until) {
            run_for(10);
            n = read_within(c, buf, sizeof buf, 10);
        }
        if (n > 0 && strncmp(buf, "GET /late-handshake ", 20) == 0)
            fd = c;
        else
            close(c);
    }
    cr_assert(fd >= 0, "the request never reached the server");
    answer_ok(fd, &res);
    cm_hdrs_free(&s.hdrs);
    close(fd);
    close(lfd);
}

/* A long head: a 20 KiB header line arrives whole (the receive buffer grows) under a 64 KiB cap; a 300 KiB head
 * over a 256 KiB cap is an invalid answer. */
Test(upstream, long_heads)
{
    int raw_port;
    struct evconnlistener *l = raw_listen(&raw_port);
    struct cm_buf b;
    cm_buf_init(&b, 1024 * 1024);
    const int sizes[][2] = {{1, 20 * 1024}, {6, 50 * 1024}}; /* lines x bytes per value */
    for (size_t c = 0; c < 2; c++) {
        cm_buf_reset(&b);
        cr_assert(cm_buf_appendf(&b, "HTTP/1.1 200 OK\r\n"));
        for (int i = 0; i < sizes[c][0]; i++) {
            cr_assert(cm_buf_appendf(&b, "X-Long-%d: ", i));
            for (int j = 0; j < sizes[c][1]; j++)
                cr_assert(cm_buf_append(&b, "v", 1));
            cr_assert(cm_buf_append(&b, "\r\n", 2));
        }
        cr_assert(cm_buf_appendf(&b, "Content-Length: 2\r\n\r\nok"));
        g_canned = b.data;
        struct reqspec s;
        struct result res;
        spec_init(&s, "GET", "/raw");
        s.port = raw_port;
        s.max_header_bytes = c == 0 ? 64 * 1024 : 256 * 1024;
        do_request(g_cli, &s, &res);
        if (c == 0) {
            cr_assert_eq(res.r, UP_OK, "got %s (%s)", up_result_name(res.r), res.err);
            const char *v = cm_hdrs_get(&res.hdrs, "X-Long-0");
            cr_assert(v != NULL && strlen(v) == 20 * 1024);
            cr_assert(res.body_len == 2 && memcmp(res.body, "ok", 2) == 0);
        } else {
            cr_assert_eq(res.r, UP_INVALID_RESPONSE, "got %s (%s)", up_result_name(res.r), res.err);
        }
        result_free(&res);
    }
    run_for(100); /* the raw server sees the closes (a refused head is cut mid-write) and frees its connections */
    cm_buf_free(&b);
    evconnlistener_free(l);
}

/* GET target from origin (not one of reqspec's) on the shared client and wait for its callback (at most 10 s). */
static void get_url(const struct up_origin *origin, const char *target, struct result *res)
{
    struct up_request req = {.method = "GET",
                             .origin = origin,
                             .target = target,
                             .connect_timeout_ms = 2000,
                             .timeout_ms = 5000,
                             .max_response = 1024};
    memset(res, 0, sizeof *res);
    cm_hdrs_init(&res->hdrs);
    cr_assert_not_null(up_send(g_cli, &req, on_done, res));
    run_until(&res->calls, 1, 10000);
    cr_assert_eq(res->calls, 1);
}

/* An IPv6 literal upstream ("http://[::1]:port") through the built-in client. On a machine without an IPv6
 * loopback the same URL must fail as "nothing sent". */
Test(upstream, ipv6_literal_upstream)
{
    struct sockaddr_in6 sa = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    struct evconnlistener *l = evconnlistener_new_bind(
        g_base, raw_accept, NULL, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE, 16, (struct sockaddr *)&sa, sizeof sa);
    socklen_t sl = sizeof sa;
    if (l != NULL)
        getsockname(evconnlistener_get_fd(l), (struct sockaddr *)&sa, &sl);
    g_canned = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nv6";
    struct up_origin o = {.host = "::1", .port = l != NULL ? ntohs(sa.sin6_port) : 1, .ip_literal = true};
    struct result res;
    get_url(&o, "/raw?q=1", &res);
    if (l == NULL) {
        cr_assert_eq(res.r, UP_CONNECT_FAILED, "no IPv6 loopback: got %s (%s)", up_result_name(res.r), res.err);
        result_free(&res);
        return;
    }
    cr_assert_eq(res.r, UP_OK, "got %s (%s)", up_result_name(res.r), res.err);
    cr_assert(res.body_len == 2 && memcmp(res.body, "v6", 2) == 0);
    result_free(&res);
    evconnlistener_free(l);
}

/* A 64-byte authority that is no IP address (it is not the built-in client's, and libcurl cannot resolve it):
 * nothing sent, no crash (the address buffer is bounded). */
Test(upstream, overlong_authority_is_connect_failed)
{
    char host[65] = "";
    memset(host, 'a', 64); /* one DNS label of 64 bytes: over the limit of 63, so no resolver answers it */
    struct up_origin o = {.host = host, .port = 80};
    struct result res;
    get_url(&o, "/x", &res);
    cr_assert_eq(res.r, UP_CONNECT_FAILED, "got %s (%s)", up_result_name(res.r), res.err);
    result_free(&res);
}

/* ---- the target never chooses the host */

static void canary_accept(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int len, void *arg)
{
    (*(int *)arg)++;
    close(fd);
}

/* Targets that a URL parser would read as another authority: up_send refuses those that are not origin-form,
 * and sends the others to the configured origin as its path. The canary (a listener on 127.0.0.1, the host
 * every target names) never gets a connection. Before: a URL glued from base + target sent them to the canary. */
Test(upstream, target_never_chooses_the_host)
{
    int canary_hits = 0, canary_port;
    struct evconnlistener *canary = listen_with(canary_accept, &canary_hits, &canary_port);
    struct {
        const char *fmt;
        bool sent; /* false: up_send refuses it */
    } cases[] = {
        {"@127.0.0.1:%d/x", false},
        {":%d/x", false},
        {"x", false},
        {"//127.0.0.1:%d/x", true},
        {"/x#@127.0.0.1:%d", false},
        {"/x y@127.0.0.1:%d", false},
        {"", false},
        {"?@127.0.0.1:%d/", false},
        {"/a?b=@127.0.0.1:%d/", true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char target[128];
        snprintf(target, sizeof target, cases[i].fmt, canary_port);
        struct reqspec s;
        spec_init(&s, "GET", target);
        cr_assert_eq(up_target_ok(target), cases[i].sent, "case %zu (%s)", i, target);
        struct result res;
        memset(&res, 0, sizeof res);
        cm_hdrs_init(&res.hdrs);
        struct up_transfer *t = up_send(g_cli, spec_req(&s), on_done, &res);
        if (!cases[i].sent) {
            cr_assert_null(t, "case %zu (%s): up_send must refuse it", i, target);
            cm_hdrs_free(&s.hdrs);
            continue;
        }
        cr_assert_not_null(t, "case %zu (%s)", i, target);
        run_until(&res.calls, 1, 10000);
        cm_hdrs_free(&s.hdrs);
        cr_assert_eq(res.calls, 1);
        cr_assert_eq(res.r, UP_OK, "case %zu: %s (%s)", i, up_result_name(res.r), res.err);
        cr_assert_str_eq(cm_hdrs_get(&res.hdrs, "X-Echo-Uri"), target, "case %zu: the target is the path", i);
        result_free(&res);
    }
    run_for(100);
    cr_assert_eq(canary_hits, 0, "the canary got %d connections", canary_hits);
    evconnlistener_free(canary);
}

/* ---- answers are validated where they are parsed (both clients) */

Test(upstream, invalid_heads_are_invalid_responses)
{
    int raw_port;
    struct evconnlistener *l = raw_listen(&raw_port);
    static const char nul_head[] = "HTTP/1.1 200 OK\r\nX-A: a\0b\r\nContent-Length: 2\r\n\r\nok";
    struct {
        const char *canned;
        size_t len; /* 0: strlen */
        enum up_result want;
    } cases[] = {
        {"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 2\r\n\r\nok", 0, UP_INVALID_RESPONSE},
        {nul_head, sizeof nul_head - 1, UP_INVALID_RESPONSE},
        {"HTTP/1.1 200 OK\r\nX-A: a\x01z\r\nContent-Length: 2\r\n\r\nok", 0, UP_INVALID_RESPONSE},
        {"HTTP/1.1 200 OK\r\nX-A: a\x7fz\r\nContent-Length: 2\r\n\r\nok", 0, UP_INVALID_RESPONSE},
        {"HTTP/1.1 200 OK\r\nX A: v\r\nContent-Length: 2\r\n\r\nok", 0, UP_INVALID_RESPONSE},
        {"HTTP/1.1 200 OK\r\nX@: v\r\nContent-Length: 2\r\n\r\nok", 0, UP_INVALID_RESPONSE},
        {"HTTP/1.1 200 OK\r\nX-A : v\r\nContent-Length: 2\r\n\r\nok", 0, UP_INVALID_RESPONSE},
        {"HTTP/1.1 200 OK\r\nX-A: v\r\n folded\r\nContent-Length: 2\r\n\r\nok", 0, UP_INVALID_RESPONSE},
        {"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 2\r\n\r\nok", 0, UP_INVALID_RESPONSE},
        /* the values that are fine: HTAB inside, obs-text, an empty value */
        {"HTTP/1.1 200 OK\r\nX-A: a\tb\xe9\r\nX-E:\r\nContent-Length: 2\r\n\r\nok", 0, UP_OK},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        g_canned = cases[i].canned;
        g_canned_len = cases[i].len;
        struct reqspec s;
        struct result res;
        spec_init(&s, "GET", "/raw");
        s.port = raw_port;
        do_request(g_cli, &s, &res);
        cr_assert_eq(res.r, cases[i].want, "case %zu: got %s (%s)", i, up_result_name(res.r), res.err);
        if (cases[i].want == UP_OK) {
            cr_assert_str_eq(cm_hdrs_get(&res.hdrs, "X-A"), "a\tb\xe9");
            cr_assert_str_eq(cm_hdrs_get(&res.hdrs, "X-E"), "");
        }
        result_free(&res);
    }
    g_canned_len = 0;
    evconnlistener_free(l);
}

/* The head cap counts the status line and every header line with its CR LF: a head of exactly the cap passes whole,
 * one byte more is invalid; the upstream's own Idempotent-Replayed is dropped. */
Test(upstream, head_cap_and_replayed_marker)
{
    int raw_port;
    struct evconnlistener *l = raw_listen(&raw_port);
    const size_t cap = 16 * 1024;
    struct cm_buf b;
    cm_buf_init(&b, 64 * 1024);
    for (int over = 0; over < 2; over++) {
        cm_buf_reset(&b);
        /* 17 + 29 + 20 bytes of fixed lines, then a filler line to reach the cap (+1) */
        cr_assert(cm_buf_appendf(&b, "HTTP/1.1 200 OK\r\nIdempotent-Replayed: true\r\nContent-Length: 2\r\nX-F: "));
        size_t fill = cap - b.len - 2 + (size_t)over;
        for (size_t j = 0; j < fill; j++)
            cr_assert(cm_buf_append(&b, "f", 1));
        cr_assert(cm_buf_appendf(&b, "\r\n\r\nok"));
        g_canned = b.data;
        struct reqspec s;
        struct result res;
        spec_init(&s, "GET", "/raw");
        s.port = raw_port;
        s.max_header_bytes = cap;
        do_request(g_cli, &s, &res);
        if (over) {
            cr_assert_eq(res.r, UP_INVALID_RESPONSE, "got %s (%s)", up_result_name(res.r), res.err);
        } else {
            cr_assert_eq(res.r, UP_OK, "got %s (%s)", up_result_name(res.r), res.err);
            cr_assert_eq(strlen(cm_hdrs_get(&res.hdrs, "X-F")), fill);
            cr_assert_null(cm_hdrs_get(&res.hdrs, "Idempotent-Replayed"), "the upstream's marker is dropped");
            cr_assert(res.body_len == 2 && memcmp(res.body, "ok", 2) == 0);
        }
        result_free(&res);
    }
    run_for(100); /* the raw server sees the closes (a refused head is cut mid-write) and frees its connections */
    cm_buf_free(&b);
    evconnlistener_free(l);
}

/* ---- connection reuse only after a clean, complete answer */

/* A keep-alive server that answers requests in order on each connection: `head` and `HEAD` with a head announcing
 * Content-Length N whose N bytes (a whole smuggled response) follow in a second segment 30 ms later; GET /extra
 * with two bytes too many in the same segment; GET /late with an extra segment 20 ms after its answer; any other
 * request with the real answer. Requests wait while a second segment is pending. */
#define SMUGGLED "HTTP/1.1 200 OK\r\nX-Smuggled: 1\r\nContent-Length: 0\r\n\r\n"
struct smug_conn {
    struct bufferevent *bev;
    struct event *timer;
    const char *later; /* the second segment the timer writes */
};

static void smug_read_cb(struct bufferevent *bev, void *arg);

static void smug_free(struct smug_conn *sc)
{
    event_free(sc->timer);
    bufferevent_free(sc->bev);
    free(sc);
}

static void smug_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct smug_conn *sc = arg;
    bufferevent_write(sc->bev, sc->later, strlen(sc->later));
    sc->later = NULL;
    smug_read_cb(sc->bev, sc); /* requests that waited */
}

static void smug_later(struct smug_conn *sc, const char *bytes, int ms)
{
    sc->later = bytes;
    struct timeval tv = {0, ms * 1000};
    evtimer_add(sc->timer, &tv);
}

static void smug_read_cb(struct bufferevent *bev, void *arg)
{
    struct smug_conn *sc = arg;
    struct evbuffer *in = bufferevent_get_input(bev);
    while (sc->later == NULL) {
        struct evbuffer_ptr p = evbuffer_search(in, "\r\n\r\n", 4, NULL);
        if (p.pos < 0)
            return;
        char line[64] = "";
        evbuffer_copyout(in, line, sizeof line - 1);
        evbuffer_drain(in, (size_t)p.pos + 4);
        if (strncmp(line, "head ", 5) == 0 || strncmp(line, "HEAD ", 5) == 0) {
            char h[96];
            snprintf(h, sizeof h, "HTTP/1.1 200 OK\r\nContent-Length: %zu\r\n\r\n", strlen(SMUGGLED));
            bufferevent_write(bev, h, strlen(h));
            smug_later(sc, SMUGGLED, 30);
        } else if (strncmp(line, "GET /extra ", 11) == 0) {
            const char *a = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokXX";
            bufferevent_write(bev, a, strlen(a));
        } else if (strncmp(line, "GET /late ", 10) == 0) {
            const char *a = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
            bufferevent_write(bev, a, strlen(a));
            smug_later(sc, SMUGGLED, 20);
        } else {
            const char *a = "HTTP/1.1 200 OK\r\nX-Real: 1\r\nContent-Length: 4\r\n\r\nreal";
            bufferevent_write(bev, a, strlen(a));
        }
    }
}

static void smug_event_cb(struct bufferevent *bev, short what, void *arg)
{
    if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR))
        smug_free(arg);
}

static void smug_accept(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int len, void *arg)
{
    (*(int *)arg)++;
    struct smug_conn *sc = cm_calloc(1, sizeof *sc);
    sc->bev = bufferevent_socket_new(g_base, fd, BEV_OPT_CLOSE_ON_FREE);
    sc->timer = evtimer_new(g_base, smug_timer_cb, sc);
    bufferevent_setcb(sc->bev, smug_read_cb, NULL, smug_event_cb, sc);
    bufferevent_enable(sc->bev, EV_READ | EV_WRITE);
}

/* Methods are case-sensitive: `head` is not HEAD, so its answer has a body; the body the upstream sends in a
 * second segment is read as that body, never as the next client's answer on the reused connection. Several rounds,
 * each on a fresh client. Before: `head` was bodiless (strcasecmp), the connection was pooled with the smuggled
 * bytes still to come, and the victim's GET got X-Smuggled. */
Test(upstream, lowercase_head_never_poisons_the_next_answer)
{
    int accepts = 0, port;
    struct evconnlistener *l = listen_with(smug_accept, &accepts, &port);
    for (int round = 0; round < 5; round++) {
        struct up_client *cli = up_client_create(g_base, 0);
        struct reqspec a;
        spec_init(&a, "head", "/attack");
        a.port = port;
        a.no_resend = false;
        struct result att;
        memset(&att, 0, sizeof att);
        cm_hdrs_init(&att.hdrs);
        cr_assert_not_null(up_send(cli, spec_req(&a), on_done, &att));
        run_until(&att.calls, 1, 5000);
        cr_assert_eq(att.calls, 1);
        /* the victim goes right away, within the same loop turn as the attacker's answer */
        struct reqspec v;
        spec_init(&v, "GET", "/victim");
        v.port = port;
        v.no_resend = false;
        struct result vic;
        do_request(cli, &v, &vic);
        cr_assert_eq(vic.r, UP_OK, "round %d: %s (%s)", round, up_result_name(vic.r), vic.err);
        cr_assert_null(cm_hdrs_get(&vic.hdrs, "X-Smuggled"), "round %d: the victim got the smuggled answer", round);
        cr_assert_str_eq(cm_hdrs_get(&vic.hdrs, "X-Real"), "1", "round %d", round);
        cr_assert(vic.body_len == 4 && memcmp(vic.body, "real", 4) == 0, "round %d", round);
        cr_assert_eq(att.r, UP_OK, "round %d: attacker %s (%s)", round, up_result_name(att.r), att.err);
        cr_assert_eq(att.body_len, strlen(SMUGGLED), "round %d: `head` has a body", round);
        result_free(&att);
        result_free(&vic);
        cm_hdrs_free(&a.hdrs);
        up_client_destroy(cli);
    }
    run_for(100); /* the server sees the last close and frees its connection */
    evconnlistener_free(l);
}

/* Bytes beyond the framed end of an answer close the connection: in the same segment (GET /extra), or in a later
 * one while the connection is idle (GET /late). The next request gets a new connection and the real answer.
 * Before: libcurl 7.88 reused an idle connection with bytes waiting (its check before reuse sees only a close). */
Test(upstream, leftover_bytes_close_the_connection)
{
    int accepts = 0, port;
    struct evconnlistener *l = listen_with(smug_accept, &accepts, &port);
    struct up_client *cli = up_client_create(g_base, 0);
    const char *first[] = {"/extra", "/late"};
    for (int i = 0; i < 2; i++) {
        struct reqspec s;
        struct result res;
        spec_init(&s, "GET", first[i]);
        s.port = port;
        s.no_resend = false;
        do_request(cli, &s, &res);
        cr_assert_eq(res.r, UP_OK, "%d: %s (%s)", i, up_result_name(res.r), res.err);
        cr_assert(res.body_len == 2 && memcmp(res.body, "ok", 2) == 0);
        result_free(&res);
        if (i == 1)
            run_for(60); /* the late segment arrives while the connection is idle */
        int before = accepts;
        spec_init(&s, "GET", "/next");
        s.port = port;
        s.no_resend = false;
        do_request(cli, &s, &res);
        cr_assert_eq(res.r, UP_OK, "%d: %s (%s)", i, up_result_name(res.r), res.err);
        cr_assert_null(cm_hdrs_get(&res.hdrs, "X-Smuggled"), "%d: a leftover answer was taken", i);
        cr_assert_str_eq(cm_hdrs_get(&res.hdrs, "X-Real"), "1", "%d", i);
        cr_assert_eq(accepts, before + 1, "%d: the connection with leftover bytes was reused", i);
        result_free(&res);
    }
    up_client_destroy(cli);
    run_for(100); /* the server sees the close and frees its connection */
    evconnlistener_free(l);
}
