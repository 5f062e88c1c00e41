/* upstream_edges_test.c - the upstream-facing edges through the real gateway: a request target never chooses the
 * host, a lowercase `head` never poisons another client's answer on a pooled connection, and invalid upstream
 * answers (control bytes, non-token names, obs-fold, an over-long head) are 502 upstream-invalid-response with the
 * record kept as an unknown outcome; each through the built-in client (127.0.0.1) and libcurl (localhost). */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/e2e/harness.h"

TestSuite(upstream_edges, .init = e2e_setup, .fini = e2e_teardown, .timeout = 180);

/* ---- a raw upstream in a thread of the test: answers by the request's path, one thread per connection */

#define RAW_MAX_CONNS 64
#define SMUGGLED      "HTTP/1.1 200 OK\r\nX-Smuggled: 1\r\nContent-Length: 0\r\n\r\n"
#define REAL          "HTTP/1.1 200 OK\r\nX-Real: 1\r\nContent-Length: 4\r\n\r\nreal"
/* 38 bytes: with "ok" before it, the 40-byte body of the second Content-Length */
#define SMUGGLED_40 "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"

struct raw_up {
    int lfd;
    uint16_t port;
    atomic_bool stop;
    atomic_long requests;
    pthread_t acceptor;
    pthread_t conns[RAW_MAX_CONNS];
    atomic_int nconns;
    /* per accepted connection (its index): requests it served, and whether it ended; the connection that served the
     * latest request */
    atomic_int conn_reqs[RAW_MAX_CONNS];
    atomic_bool conn_closed[RAW_MAX_CONNS];
    atomic_int last_conn;
};

static struct raw_up g_raw;

static void raw_write_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return;
        p += w;
        n -= (size_t)w;
    }
}

/* A head of total bytes (status line + headers with their CR LF, without the blank line), one filler header. */
static char *raw_sized_head(size_t total)
{
    const char *pre = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Fill: ";
    size_t fill = total - strlen(pre) - 2;
    char *h = malloc(total + 16);
    cr_assert_not_null(h);
    memcpy(h, pre, strlen(pre));
    memset(h + strlen(pre), 'f', fill);
    memcpy(h + strlen(pre) + fill, "\r\n\r\nok", 7);
    return h;
}

/* The answer for a request line (method SP path): n bytes at *out (static or heap: *heap). later: a second segment
 * 30 ms after the first. */
static void raw_answer(const char *line, const char **out, size_t *n, bool *heap, const char **later)
{
    static const char nul[] = "HTTP/1.1 200 OK\r\nX-A: a\0b\r\nContent-Length: 2\r\n\r\nok";
    *heap = false;
    *later = NULL;
    const char *path = strchr(line, ' ');
    path = path ? path + 1 : line;
    const char *c = strstr(path, "/case/");
    const char *a = REAL;
    if (strncmp(line, "head ", 5) == 0) {
        static char h[96];
        snprintf(h, sizeof h, "HTTP/1.1 200 OK\r\nContent-Length: %zu\r\n\r\n", strlen(SMUGGLED));
        a = h;
        *later = SMUGGLED;
    } else if (c != NULL) {
        c += 6;
        if (strncmp(c, "cr/", 3) == 0)
            a = "HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 2\r\n\r\nok";
        else if (strncmp(c, "nul/", 4) == 0) {
            *out = nul;
            *n = sizeof nul - 1;
            return;
        } else if (strncmp(c, "ctl/", 4) == 0)
            a = "HTTP/1.1 200 OK\r\nX-A: a\x01z\r\nContent-Length: 2\r\n\r\nok";
        else if (strncmp(c, "space/", 6) == 0)
            a = "HTTP/1.1 200 OK\r\nX A: v\r\nContent-Length: 2\r\n\r\nok";
        else if (strncmp(c, "at/", 3) == 0)
            a = "HTTP/1.1 200 OK\r\nX@: v\r\nContent-Length: 2\r\n\r\nok";
        else if (strncmp(c, "fold/", 5) == 0)
            a = "HTTP/1.1 200 OK\r\nX-A: v\r\n folded\r\nContent-Length: 2\r\n\r\nok";
        else if (strncmp(c, "big/", 4) == 0) {
            *out = raw_sized_head(31 * 1024);
            *n = strlen(*out);
            *heap = true;
            return;
        } else if (strncmp(c, "near/", 5) == 0) {
            *out = raw_sized_head(16 * 1024 - 200);
            *n = strlen(*out);
            *heap = true;
            return;
        } else if (strncmp(c, "replayed/", 9) == 0)
            a = "HTTP/1.1 200 OK\r\nIdempotent-Replayed: true\r\nX-Real: 1\r\nContent-Length: 4\r\n\r\nreal";
        /* framing h1 refuses: two different lengths (the second one's body a whole answer), not digits, a list, a
         * status outside 100-599, a 101 (the connection then stays open) */
        else if (strncmp(c, "dupcl/", 6) == 0)
            a = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nokk";
        else if (strncmp(c, "dupcl40/", 8) == 0)
            a = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\nok" SMUGGLED_40;
        else if (strncmp(c, "badcl/", 6) == 0)
            a = "HTTP/1.1 200 OK\r\nContent-Length: 2x\r\n\r\nok";
        else if (strncmp(c, "cllist/", 7) == 0)
            a = "HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok";
        else if (strncmp(c, "s600/", 5) == 0)
            a = "HTTP/1.1 600 OK\r\nContent-Length: 2\r\n\r\nok";
        else if (strncmp(c, "s101/", 5) == 0)
            a = "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\nTUNNEL";
        else if (strncmp(c, "samecl/", 7) == 0)
            a = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok";
        /* a complete answer with a whole second one right behind it, in the same segment */
        else if (strncmp(c, "s204x/", 6) == 0)
            a = "HTTP/1.1 204 No Content\r\n\r\n" SMUGGLED;
        else if (strncmp(c, "s304x/", 6) == 0)
            a = "HTTP/1.1 304 Not Modified\r\n\r\n" SMUGGLED;
        else if (strncmp(c, "cl0x/", 5) == 0)
            a = "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n" SMUGGLED;
        else if (strncmp(c, "clx/", 4) == 0)
            a = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" SMUGGLED;
        else if (strncmp(c, "chunkx/", 7) == 0)
            a = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n" SMUGGLED;
        else if (strncmp(c, "headx/", 6) == 0) /* asked with HEAD: the body is extra */
            a = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello" SMUGGLED;
        else if (strncmp(c, "s204/", 5) == 0)
            a = "HTTP/1.1 204 No Content\r\n\r\n";
    }
    *out = a;
    *n = strlen(a);
}

/* Serves one connection: requests in order (a body by Content-Length is skipped), until EOF or stop. */
/* arg: the connection's index << 20 | its fd */
static void *raw_conn(void *arg)
{
    int fd = (int)((intptr_t)arg & 0xfffff), ci = (int)((intptr_t)arg >> 20);
    char buf[65536];
    size_t len = 0;
    while (!atomic_load(&g_raw.stop)) {
        char *end = memmem(buf, len, "\r\n\r\n", 4);
        if (end == NULL) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            if (poll(&p, 1, 100) <= 0)
                continue;
            if (len == sizeof buf)
                break;
            ssize_t r = recv(fd, buf + len, sizeof buf - len, 0);
            if (r <= 0)
                break;
            len += (size_t)r;
            continue;
        }
        size_t head = (size_t)(end - buf) + 4;
        size_t body = 0;
        char *cl = memmem(buf, head, "Content-Length:", 15);
        if (cl != NULL)
            body = strtoul(cl + 15, NULL, 10);
        if (head + body > len) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            if (poll(&p, 1, 100) <= 0)
                continue;
            if (len == sizeof buf)
                break;
            ssize_t r = recv(fd, buf + len, sizeof buf - len, 0);
            if (r <= 0)
                break;
            len += (size_t)r;
            continue;
        }
        char line[256];
        size_t ll = strcspn(buf, "\r\n");
        snprintf(line, sizeof line, "%.*s", (int)(ll < sizeof line - 1 ? ll : sizeof line - 1), buf);
        memmove(buf, buf + head + body, len - head - body);
        len -= head + body;
        atomic_fetch_add(&g_raw.requests, 1);
        atomic_fetch_add(&g_raw.conn_reqs[ci], 1);
        atomic_store(&g_raw.last_conn, ci);
        const char *out, *later;
        size_t n;
        bool heap;
        raw_answer(line, &out, &n, &heap, &later);
        raw_write_all(fd, out, n);
        if (heap)
            free((void *)out);
        if (later != NULL) {
            usleep(30000);
            raw_write_all(fd, later, strlen(later));
        }
    }
    close(fd);
    atomic_store(&g_raw.conn_closed[ci], true);
    return NULL;
}

static void *raw_acceptor(void *arg)
{
    while (!atomic_load(&g_raw.stop)) {
        struct pollfd p = {.fd = g_raw.lfd, .events = POLLIN};
        if (poll(&p, 1, 100) <= 0)
            continue;
        int fd = accept4(g_raw.lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            continue;
        int i = atomic_load(&g_raw.nconns);
        if (i >= RAW_MAX_CONNS ||
            pthread_create(&g_raw.conns[i], NULL, raw_conn, (void *)(((intptr_t)i << 20) | fd)) != 0) {
            close(fd);
            continue;
        }
        atomic_store(&g_raw.nconns, i + 1);
    }
    return NULL;
}

static int listen_loopback(uint16_t *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert(bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    cr_assert(listen(fd, 64) == 0);
    socklen_t sl = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    *port = ntohs(sa.sin_port);
    return fd;
}

static void raw_start(void)
{
    memset(&g_raw, 0, sizeof g_raw);
    g_raw.lfd = listen_loopback(&g_raw.port);
    cr_assert(pthread_create(&g_raw.acceptor, NULL, raw_acceptor, NULL) == 0);
}

static void raw_stop(void)
{
    atomic_store(&g_raw.stop, true);
    pthread_join(g_raw.acceptor, NULL);
    for (int i = 0; i < atomic_load(&g_raw.nconns); i++)
        pthread_join(g_raw.conns[i], NULL);
    close(g_raw.lfd);
}

/* Connections accepted so far by a plain listener (non-blocking accepts, each closed at once). */
static int canary_count(int fd, int *seen)
{
    for (;;) {
        int c = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0)
            break;
        close(c);
        (*seen)++;
    }
    return *seen;
}

/* Two upstreams on the raw server: h1 (127.0.0.1, the built-in client) and curl (localhost, libcurl); routes
 * /h1 and /curl, POST idempotent with an optional key; default_upstream DEFAULT. */
#define CONF_EDGES(threads)                                                                                            \
    E2E_CONF_HEAD                                                                                                      \
    "threads: " threads "\n"                                                                                           \
    "upstreams:\n" E2E_CONF_UPSTREAM("h1", "http://127.0.0.1:{{RAW_PORT}}", "5s")                                      \
        E2E_CONF_UPSTREAM("curl", "http://localhost:{{RAW_PORT}}", "5s") "routes:\n" E2E_CONF_ROUTE(                   \
            "h1", "/h1", "h1") "      key: optional\n" E2E_CONF_ROUTE("curl", "/curl",                                 \
                                                                      "curl") "      key: optional\n"                  \
                                                                              "default_upstream: {{DEFAULT}}\n"

static struct e2e_gw *start_edges(const char *tmpl, const char *dflt)
{
    char port[16];
    snprintf(port, sizeof port, "%u", (unsigned)g_raw.port);
    const char *vars[] = {"RAW_PORT", port, "DEFAULT", dflt, NULL};
    struct e2e_gw_opts o = {.vars = vars, .wait_ready = true};
    return e2e_gw_start(tmpl, &o);
}

/* ---- 1. the target never chooses the host */

/* Targets a URL parser reads as another authority (user info, a port, a scheme-relative path, a fragment), sent
 * raw to the gateway with each client behind it: a canary listener on 127.0.0.1 gets no connection; the answer
 * is 400 or the configured upstream's own. Before: the gateway glued upstream URL + target and libcurl connected
 * to the canary (`http://127.0.0.1:P` + `@127.0.0.1:C/x` is user 127.0.0.1, password P, host 127.0.0.1:C). */
Test(upstream_edges, target_never_chooses_the_host)
{
    raw_start();
    uint16_t cport;
    int canary = listen_loopback(&cport);
    fcntl(canary, F_SETFL, O_NONBLOCK);
    int seen = 0;
    const char *fmts[] = {"@127.0.0.1:%u/x", ":%u/x", "x", "//127.0.0.1:%u/x", "/x#@127.0.0.1:%u", "@localhost:%u/x"};
    const char *dflts[] = {"h1", "curl"};
    for (size_t d = 0; d < 2; d++) {
        struct e2e_gw *gw = start_edges(CONF_EDGES("1"), dflts[d]);
        for (size_t i = 0; i < sizeof fmts / sizeof *fmts; i++) {
            char target[128], req[256];
            snprintf(target, sizeof target, fmts[i], (unsigned)cport);
            int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", target);
            int before = seen;
            struct e2e_raw r;
            e2e_raw_send(gw->port, req, (size_t)n, 5000, &r);
            e2e_sleep_ms(20);
            cr_expect_eq(canary_count(canary, &seen) - before, 0,
                         "%s, target %s: the canary got a connection (status %d)", dflts[d], target, r.status);
            bool real = r.data != NULL && strstr(r.data, "X-Real: 1") != NULL;
            cr_expect(r.status == 400 || (r.status == 200 && real), "%s, target %s: status %d", dflts[d], target,
                      r.status);
            free(r.data);
        }
        e2e_gw_stop(gw, 5000);
    }
    close(canary);
    raw_stop();
}

/* ---- 2. a lowercase head never poisons another client's answer */

/* An attacker sends `head` (not HEAD: methods are case-sensitive, so its answer has a body); the upstream sends
 * that body in a second segment 30 ms later, and the body is a whole response with X-Smuggled. Right after the
 * attacker's request, victims' GETs go to the same upstream through the gateway's two I/O loops: none may get the
 * smuggled answer, whichever pooled connection it takes. Before: `head` was bodiless, the connection was pooled
 * with 30 ms of smuggled bytes still to come, and a victim on that loop read them as its answer. */
Test(upstream_edges, lowercase_head_never_poisons_a_victim)
{
    raw_start();
    struct e2e_gw *gw = start_edges(CONF_EDGES("2"), "h1");
    const char *prefixes[] = {"/h1", "/curl"};
    for (size_t p = 0; p < 2; p++) {
        for (int round = 0; round < 6; round++) {
            char areq[128];
            int an = snprintf(areq, sizeof areq, "head %s/smug HTTP/1.1\r\nHost: x\r\n\r\n", prefixes[p]);
            int afd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
            struct sockaddr_in sa = {
                .sin_family = AF_INET, .sin_port = htons(gw->port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
            cr_assert(connect(afd, (struct sockaddr *)&sa, sizeof sa) == 0);
            raw_write_all(afd, areq, (size_t)an);
            e2e_sleep_ms(5);
            char vpath[64];
            snprintf(vpath, sizeof vpath, "%s/victim", prefixes[p]);
            struct e2e_req rq[4];
            struct e2e_resp rs[4];
            for (int i = 0; i < 4; i++)
                rq[i] = (struct e2e_req){.method = "GET", .path = vpath, .timeout_ms = 5000};
            e2e_http_parallel(gw->port, rq, rs, 4);
            for (int i = 0; i < 4; i++) {
                cr_expect_null(e2e_resp_header(&rs[i], "X-Smuggled"), "%s round %d victim %d: the smuggled answer",
                               prefixes[p], round, i);
                cr_expect_eq(rs[i].status, 200, "%s round %d victim %d: status %ld", prefixes[p], round, i,
                             rs[i].status);
                e2e_resp_free(&rs[i]);
            }
            close(afd);
            e2e_sleep_ms(40);
        }
    }
    e2e_gw_assert_alive(gw, "after the head rounds");
    raw_stop();
}

/* ---- 3. invalid answers: 502 upstream-invalid-response, unknown outcome, nothing stored */

/* For each invalid head, through each client: a keyed POST executes once and answers 502
 * upstream-invalid-response, its retry answers 409 (in use, or outcome unknown) without executing again, and a
 * passthrough GET answers the same 502. A head just under 16 KiB passes, is stored, and its replay carries it whole;
 * the upstream's own Idempotent-Replayed is dropped (a replay carries exactly one). Before: bare CR, control bytes,
 * obs-fold and bad names were passed on or joined, and a 31 KiB head was stored (a replay the front cannot send). */
Test(upstream_edges, invalid_answers_are_unknown_outcomes)
{
    raw_start();
    struct e2e_gw *gw = start_edges(CONF_EDGES("1"), "h1");
    const char *cases[] = {"cr", "nul", "ctl", "space", "at", "fold", "big"};
    const char *prefixes[] = {"/h1", "/curl"};
    for (size_t p = 0; p < 2; p++) {
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
            char path[128], key[64], what[160];
            e2e_mkkey(key, sizeof key, cases[i]);
            snprintf(path, sizeof path, "%s/case/%s/x", prefixes[p], cases[i]);
            snprintf(what, sizeof what, "%s %s", prefixes[p], cases[i]);
            long before = atomic_load(&g_raw.requests);
            struct e2e_resp r;
            e2e_http_key(gw->port, "POST", path, key, NULL, "{}", 0, &r);
            e2e_expect_problem(&r, 502, "upstream-invalid-response", what);
            e2e_resp_free(&r);
            e2e_http_key(gw->port, "POST", path, key, NULL, "{}", 0, &r);
            cr_expect(r.status == 409 && (e2e_resp_is_problem(&r, "idempotency-key-in-use") ||
                                          e2e_resp_is_problem(&r, "idempotency-outcome-unknown")),
                      "%s: retry answered %ld, not 409 in-use/outcome-unknown", what, r.status);
            cr_expect(!e2e_resp_is_replay(&r), "%s: a corrupt record was replayed", what);
            e2e_resp_free(&r);
            cr_expect_eq(atomic_load(&g_raw.requests) - before, 1, "%s: executions", what);
            e2e_get(gw->port, path, &r);
            e2e_expect_problem(&r, 502, "upstream-invalid-response", what);
            e2e_resp_free(&r);
        }
        /* a head just under 16 KiB: stored and replayed whole */
        char path[128], key[64];
        e2e_mkkey(key, sizeof key, "near");
        snprintf(path, sizeof path, "%s/case/near/x", prefixes[p]);
        struct e2e_resp r1, r2;
        e2e_http_key(gw->port, "POST", path, key, NULL, "{}", 0, &r1);
        cr_expect_eq(r1.status, 200, "%s near: status %ld", prefixes[p], r1.status);
        e2e_http_key(gw->port, "POST", path, key, NULL, "{}", 0, &r2);
        cr_expect_eq(r2.status, 200, "%s near replay: status %ld", prefixes[p], r2.status);
        cr_expect(e2e_resp_is_replay(&r2), "%s near: not a replay", prefixes[p]);
        const char *f1 = e2e_resp_header(&r1, "X-Fill"), *f2 = e2e_resp_header(&r2, "X-Fill");
        cr_expect(f1 != NULL && f2 != NULL && strlen(f1) > 15000 && strcmp(f1, f2) == 0,
                  "%s near: the long header is not replayed whole", prefixes[p]);
        e2e_resp_free(&r1);
        e2e_resp_free(&r2);
        /* the upstream's own Idempotent-Replayed */
        e2e_mkkey(key, sizeof key, "replayed");
        snprintf(path, sizeof path, "%s/case/replayed/x", prefixes[p]);
        e2e_http_key(gw->port, "POST", path, key, NULL, "{}", 0, &r1);
        cr_expect_eq(r1.status, 200);
        cr_expect_eq(e2e_resp_header_count(&r1, "Idempotent-Replayed"), 0, "%s: the upstream's marker passed",
                     prefixes[p]);
        e2e_http_key(gw->port, "POST", path, key, NULL, "{}", 0, &r2);
        cr_expect(e2e_resp_is_replay(&r2));
        cr_expect_eq(e2e_resp_header_count(&r2, "Idempotent-Replayed"), 1, "%s: a replay carries exactly one",
                     prefixes[p]);
        e2e_resp_free(&r1);
        e2e_resp_free(&r2);
    }
    e2e_gw_assert_alive(gw, "after the invalid answers");
    raw_stop();
}

/* ---- 3b. framing h1 refuses is refused through libcurl too, with the same result */

/* Each answer the built-in client refuses as malformed framing (two different Content-Lengths, the second one's
 * 40-byte body holding a whole answer; "2x"; the list "2, 2"; status 600; an unasked-for 101 with the connection
 * kept open), through h1 and through libcurl: a keyed POST executes once and answers 502 upstream-no-response at
 * once (not after the 5 s timeout), its retry 409 without executing again, a passthrough GET the same 502; two
 * identical Content-Length lines pass. Before: libcurl took the last Content-Length (200, "okk" or the 40 bytes
 * stored), read "2x" and "2, 2" as 2, passed 600 on, and waited for the 101's tunnel to close (504). */
Test(upstream_edges, framing_h1_refuses_is_refused_through_libcurl)
{
    raw_start();
    struct e2e_gw *gw = start_edges(CONF_EDGES("1"), "h1");
    const char *cases[] = {"dupcl", "dupcl40", "badcl", "cllist", "s600", "s101"};
    const char *prefixes[] = {"/h1", "/curl"};
    for (size_t p = 0; p < 2; p++) {
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
            char path[128], key[64], what[160];
            e2e_mkkey(key, sizeof key, cases[i]);
            snprintf(path, sizeof path, "%s/case/%s/x", prefixes[p], cases[i]);
            snprintf(what, sizeof what, "%s %s", prefixes[p], cases[i]);
            long before = atomic_load(&g_raw.requests);
            struct e2e_resp r;
            e2e_http_key(gw->port, "POST", path, key, NULL, "{}", 0, &r);
            e2e_expect_problem(&r, 502, "upstream-no-response", what);
            cr_expect(r.seconds < 3.0, "%s: answered after %.1f s", what, r.seconds);
            e2e_resp_free(&r);
            e2e_http_key(gw->port, "POST", path, key, NULL, "{}", 0, &r);
            cr_expect(r.status == 409 && (e2e_resp_is_problem(&r, "idempotency-key-in-use") ||
                                          e2e_resp_is_problem(&r, "idempotency-outcome-unknown")),
                      "%s: retry answered %ld, not 409 in-use/outcome-unknown", what, r.status);
            cr_expect(!e2e_resp_is_replay(&r), "%s: a malformed answer was stored and replayed", what);
            e2e_resp_free(&r);
            cr_expect_eq(atomic_load(&g_raw.requests) - before, 1, "%s: executions", what);
            e2e_get(gw->port, path, &r);
            e2e_expect_problem(&r, 502, "upstream-no-response", what);
            e2e_resp_free(&r);
        }
        char path[128];
        snprintf(path, sizeof path, "%s/case/samecl/x", prefixes[p]);
        struct e2e_resp r;
        e2e_get(gw->port, path, &r);
        cr_expect(r.status == 200 && r.body_len == 2 && memcmp(r.body, "ok", 2) == 0,
                  "%s samecl: status %ld, %zu bytes", prefixes[p], r.status, r.body_len);
        e2e_resp_free(&r);
    }
    e2e_gw_assert_alive(gw, "after the malformed framing");
    raw_stop();
}

/* ---- 3c. a connection whose answer carried extra bytes is not reused */

/* A complete answer with a whole second answer right behind it in the same segment (after a 204, a 304, a
 * Content-Length: 0, a Content-Length body, a chunked body, and a HEAD answer's body), through h1 and libcurl: the
 * client gets the first answer, the next request goes on a new upstream connection and gets its own answer, never
 * the smuggled one. Control, first and last: a clean answer's connection is reused. Before: libcurl dropped the bytes
 * after a bodiless answer and put the connection back in its cache (the next request reused it). */
Test(upstream_edges, extra_bytes_after_an_answer_close_the_connection)
{
    raw_start();
    struct e2e_gw *gw = start_edges(CONF_EDGES("1"), "h1");
    struct {
        const char *name, *method;
        long status;
        bool extra;
    } cases[] = {
        {"ok", "GET", 200, false},    {"s204x", "GET", 204, true}, {"s304x", "GET", 304, true},
        {"cl0x", "GET", 200, true},   {"clx", "GET", 200, true},   {"chunkx", "GET", 200, true},
        {"headx", "HEAD", 200, true}, {"ok", "GET", 200, false},
    };
    const char *prefixes[] = {"/h1", "/curl"};
    for (size_t p = 0; p < 2; p++) {
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
            char path[128], warm[128], next[128], what[160];
            snprintf(path, sizeof path, "%s/case/%s/x", prefixes[p], cases[i].name);
            snprintf(warm, sizeof warm, "%s/warm", prefixes[p]);
            snprintf(next, sizeof next, "%s/next", prefixes[p]);
            snprintf(what, sizeof what, "%s %s", prefixes[p], cases[i].name);
            struct e2e_resp r;
            e2e_get(gw->port, warm, &r); /* an idle connection to take */
            cr_expect_eq(r.status, 200, "%s: warm-up %ld", what, r.status);
            e2e_resp_free(&r);
            struct e2e_req rq = {.method = cases[i].method, .path = path, .timeout_ms = 5000};
            e2e_http(gw->port, &rq, &r);
            cr_expect_eq(r.status, cases[i].status, "%s: status %ld", what, r.status);
            cr_expect_null(e2e_resp_header(&r, "X-Smuggled"), "%s: the extra answer was passed on", what);
            e2e_resp_free(&r);
            /* the connection that carried this answer, and how many requests it had served then */
            int cc = atomic_load(&g_raw.last_conn), cc_reqs = atomic_load(&g_raw.conn_reqs[cc]);
            e2e_get(gw->port, next, &r);
            cr_expect_eq(r.status, 200, "%s: next %ld", what, r.status);
            cr_expect_null(e2e_resp_header(&r, "X-Smuggled"), "%s: the next request got the extra answer", what);
            cr_expect_str_eq(e2e_resp_header(&r, "X-Real") ? e2e_resp_header(&r, "X-Real") : "", "1", "%s: next", what);
            e2e_resp_free(&r);
            /* Counted per connection, not by new connections: the pool may hold a second idle connection (a warm-up
             * that came before the previous answer's connection was back in the pool opened one). */
            if (cases[i].extra) {
                cr_expect_eq(atomic_load(&g_raw.conn_reqs[cc]), cc_reqs,
                             "%s: the connection whose answer carried extra bytes was used again", what);
                bool closed = false;
                for (uint64_t end = e2e_now_ms() + 2000; !(closed = atomic_load(&g_raw.conn_closed[cc]));) {
                    if (e2e_now_ms() >= end)
                        break;
                    e2e_sleep_ms(10);
                }
                cr_expect(closed, "%s: the connection whose answer carried extra bytes was not closed", what);
            } else {
                e2e_sleep_ms(200);
                cr_expect(!atomic_load(&g_raw.conn_closed[cc]), "%s: a clean answer's connection was closed", what);
            }
        }
    }
    e2e_gw_assert_alive(gw, "after the extra bytes");
    raw_stop();
}

/* ---- 4. Redis on a unix socket, end to end */

/* store.redis: unix:///path?db=2 works: the gateway connects to the socket (/readyz says redis up), a completed
 * answer is cached there (an idg: key in database 2) and a replay comes back. Before: --check accepted a socket
 * path, and the gateway refused it at start ("redis URL must start with redis://"). */
Test(upstream_edges, redis_on_a_unix_socket)
{
    char path[512];
    pid_t rpid = e2e_redis_unix_start(path, sizeof path);
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf pc = {.idem = "key: required\n", .redis = "unix://{{TMPDIR}}/redis.sock?db=2"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &pc, NULL);
    cr_expect(e2e_gw_log_wait(gw, "event=redis_up", 5000), "the gateway never connected to the unix socket");
    char key[64];
    e2e_mkkey(key, sizeof key, "unix");
    struct e2e_resp r1, r2;
    e2e_http_key(gw->port, "POST", "/v1/pay", key, NULL, "{\"a\":1}", 0, &r1);
    cr_expect_eq(r1.status, 200, "first: %ld", r1.status);
    e2e_http_key(gw->port, "POST", "/v1/pay", key, NULL, "{\"a\":1}", 0, &r2);
    cr_expect(e2e_resp_is_replay(&r2), "second: not a replay (%ld)", r2.status);
    e2e_resp_free(&r1);
    e2e_resp_free(&r2);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    char *out = NULL;
    uint64_t deadline = e2e_now_ms() + 5000;
    bool cached = false;
    while (!cached && e2e_now_ms() < deadline) {
        char cli[512];
        const char *argv[] = {
            e2e_in_path("redis-cli", cli, sizeof cli), "-s", path, "-n", "2", "--scan", "--pattern", "idg:*", NULL};
        free(out);
        out = NULL;
        cr_assert_eq(e2e_run(argv, NULL, 5000, &out, NULL), 0);
        cached = out != NULL && strstr(out, "idg:") != NULL;
        if (!cached)
            e2e_sleep_ms(50);
    }
    cr_expect(cached, "no idg: key in database 2 of the unix-socket Redis: %s", out ? out : "");
    free(out);
    e2e_gw_stop(gw, 5000);
    kill(rpid, SIGTERM);
    waitpid(rpid, NULL, 0);
}
