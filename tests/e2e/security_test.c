/* security_test.c - end-to-end security review (issue 4): no secret or body in any log line and every line is
 * key=value, tenants isolated by scope, the admin token compared exactly, SQL only through parameters, and no raw
 * key or Authorization value in Redis; against the real idemgate, test upstream, Postgres and Redis. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <unistd.h>

#include "harness.h"

TestSuite(security, .init = e2e_setup, .fini = e2e_teardown, .timeout = 120);

/* Routes: "pay" (/v1/pay, key required, scoped by Authorization, 1 KiB bodies, 1 s upstream timeout), "dead"
 * (/v1/dead, an upstream nobody listens on), "pair" (/v1/pair, scoped by Authorization and X-Tenant). */
/* clang-format off */
static const char conf_sec[] =
    E2E_CONF_PORTS
    "client_timeout: 5s\n"
    E2E_CONF_STORE("{{REDIS_URL}}")
    "upstreams:\n"
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "1s")
    E2E_CONF_UPSTREAM("dead", "http://127.0.0.1:{{DEAD_PORT}}", "1s")
    "routes:\n"
    E2E_CONF_ROUTE("pay", "/v1/pay", "api")
    "      key: required\n"
    "      scope: [header:Authorization]\n"
    "      max_body: 1KiB\n"
    E2E_CONF_ROUTE("dead", "/v1/dead", "dead")
    "      key: required\n"
    "      scope: [header:Authorization]\n"
    E2E_CONF_ROUTE("pair", "/v1/pair", "api")
    "      key: required\n"
    "      scope: [header:Authorization, header:X-Tenant]\n";
/* clang-format on */

/* ---- helpers */

static void mkrand(char *buf, size_t n, const char *tag)
{
    unsigned long long r = 0;
    cr_assert(getrandom(&r, sizeof r, 0) == (ssize_t)sizeof r, "getrandom: %s", strerror(errno));
    snprintf(buf, n, "%s-%016llx", tag, r);
}

/* ready: also wait until /readyz answers 200. */
static struct e2e_gw *start_gw(const struct e2e_upstream *up, const char *const *env, bool ready)
{
    struct e2e_gw_opts o = {.up = up, .env = env, .wait_ready = ready};
    return e2e_gw_start(conf_sec, &o);
}

/* POST path with "Idempotency-Key: key" (raw header value; NULL: none), an optional Authorization value, extra
 * header lines (NULL-terminated, may be NULL) and body. */
static void post(uint16_t port, const char *path, const char *key, const char *auth, const char *const *extra,
                 const char *body, long timeout_ms, struct e2e_resp *r)
{
    const char *h[16];
    size_t n = 0;
    char ah[600];
    if (auth != NULL) {
        snprintf(ah, sizeof ah, "Authorization: %s", auth);
        h[n++] = ah;
    }
    for (size_t i = 0; extra != NULL && extra[i] != NULL && n < 15; i++)
        h[n++] = extra[i];
    h[n] = NULL;
    e2e_http_key(port, "POST", path, key, h, body, timeout_ms, r);
}

static const char *exec_id(const struct e2e_resp *r)
{
    const char *v = e2e_resp_header(r, "X-Upstream-Exec");
    return v ? v : "(none)";
}

/* Percent-encodes every byte but [A-Za-z0-9-._~]. */
static void pct(char *out, size_t n, const char *s)
{
    static const char hex[] = "0123456789ABCDEF";
    size_t o = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p && o + 4 < n; p++) {
        if ((*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || strchr("-._~", *p)) {
            out[o++] = (char)*p;
        } else {
            out[o++] = '%';
            out[o++] = hex[*p >> 4];
            out[o++] = hex[*p & 15];
        }
    }
    out[o] = '\0';
}

/* Admin request on /admin/keys (GET) for route and raw key with the given Authorization header (NULL: none). */
static void admin_list(const struct e2e_gw *gw, const char *route, const char *key, const char *authz,
                       struct e2e_resp *r)
{
    char rq_route[512], rq_key[1600], path[2300], ah[1536];
    pct(rq_route, sizeof rq_route, route);
    pct(rq_key, sizeof rq_key, key);
    snprintf(path, sizeof path, "/admin/keys?route=%s&key=%s", rq_route, rq_key);
    const char *h[] = {ah, NULL};
    if (authz != NULL)
        snprintf(ah, sizeof ah, "Authorization: %s", authz);
    struct e2e_req rq = {.path = path, .headers = authz ? h : NULL, .timeout_ms = 5000};
    e2e_http(gw->admin_port, &rq, r);
}

/* The Postgres test URL with a password added (heap). */
static char *pg_url_with_password(const char *pw)
{
    const char *u = e2e_env("IDEMGATE_TEST_PG_URL");
    const char *scheme = strstr(u, "://");
    cr_assert_not_null(scheme, "IDEMGATE_TEST_PG_URL is not a URL: %s", u);
    const char *auth = scheme + 3;
    const char *at = strchr(auth, '@');
    const char *slash = strchr(auth, '/');
    char *out = NULL;
    int w;
    if (at != NULL && (slash == NULL || at < slash)) {
        const char *colon = memchr(auth, ':', (size_t)(at - auth));
        const char *user_end = colon ? colon : at;
        w = asprintf(&out, "%.*s:%s%s", (int)(user_end - u), u, pw, at);
    } else {
        w = asprintf(&out, "%.*sidemgate:%s@%s", (int)(auth - u), u, pw, auth);
    }
    cr_assert(w > 0);
    return out;
}

/* Absolute path of a program found on PATH (heap), or fails the test. */
static char *which(const char *prog)
{
    const char *path = getenv("PATH");
    char *copy = strdup(path && *path ? path : "/usr/local/bin:/usr/bin:/bin");
    cr_assert_not_null(copy);
    char *found = NULL;
    for (char *dir = copy, *next; dir != NULL && found == NULL; dir = next) {
        next = strchr(dir, ':');
        if (next != NULL)
            *next++ = '\0';
        char *cand = NULL;
        cr_assert(asprintf(&cand, "%s/%s", *dir ? dir : ".", prog) > 0);
        if (access(cand, X_OK) == 0)
            found = cand;
        else
            free(cand);
    }
    free(copy);
    cr_assert_not_null(found, "%s is not on PATH", prog);
    return found;
}

/* Copies tmpl to out with every needle replaced by value (truncating at n). */
static void subst(char *out, size_t n, const char *tmpl, const char *needle, const char *value)
{
    size_t o = 0, nl = strlen(needle), vl = strlen(value);
    for (const char *p = tmpl; *p && o + 1 < n;) {
        if (strncmp(p, needle, nl) == 0 && o + vl + 1 < n) {
            memcpy(out + o, value, vl);
            o += vl;
            p += nl;
        } else {
            out[o++] = *p++;
        }
    }
    out[o] = '\0';
}

/* ---- log lines */

static bool key_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
           c == '-';
}

/* True when line (without its newline) is `ts=T level=L event=E( key=value)*`: values unquoted (no space, quote or
 * control byte) or double-quoted with backslash escapes and no raw control byte. *why says what is wrong. */
static bool logline_ok(const char *line, size_t len, const char **why)
{
    static const char *const first[] = {"ts", "level", "event"};
    size_t i = 0;
    for (int k = 0; i < len || k < 3; k++) {
        size_t ks = i;
        while (i < len && key_char(line[i]))
            i++;
        if (i == ks || i >= len || line[i] != '=') {
            *why = "expected key=";
            return false;
        }
        if (k < 3 && (i - ks != strlen(first[k]) || strncmp(line + ks, first[k], i - ks) != 0)) {
            *why = "the line must start with ts=, level=, event=";
            return false;
        }
        i++; /* '=' */
        size_t vs = i;
        if (i < len && line[i] == '"') {
            i++;
            bool closed = false;
            while (i < len) {
                unsigned char c = (unsigned char)line[i];
                if (c < 0x20 || c == 0x7f) {
                    *why = "control byte in a quoted value";
                    return false;
                }
                if (c == '\\') {
                    i += 2;
                    continue;
                }
                if (c == '"') {
                    closed = true;
                    i++;
                    break;
                }
                i++;
            }
            if (!closed || i > len) {
                *why = "unterminated quoted value";
                return false;
            }
        } else {
            while (i < len && line[i] != ' ') {
                unsigned char c = (unsigned char)line[i];
                if (c == '"' || c < 0x20 || c == 0x7f) {
                    *why = "quote or control byte in an unquoted value";
                    return false;
                }
                i++;
            }
        }
        if (k == 1) {
            size_t vl = i - vs;
            bool lv_ok =
                (vl == 5 && strncmp(line + vs, "debug", 5) == 0) || (vl == 4 && strncmp(line + vs, "info", 4) == 0) ||
                (vl == 4 && strncmp(line + vs, "warn", 4) == 0) || (vl == 5 && strncmp(line + vs, "error", 5) == 0);
            if (!lv_ok) {
                *why = "level is not debug|info|warn|error";
                return false;
            }
        }
        if ((k == 0 || k == 2) && i == vs) {
            *why = "empty ts or event";
            return false;
        }
        if (i < len) {
            if (line[i] != ' ' || i + 1 >= len) {
                *why = "pairs must be separated by one space, no trailing space";
                return false;
            }
            i++;
        }
    }
    return true;
}

/* Every line of text is a key=value log line; returns the number of lines checked. */
static size_t expect_log_lines(const char *text, const char *what)
{
    size_t n = 0, bad = 0;
    for (const char *p = text; *p != '\0';) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        const char *why = NULL;
        if (!logline_ok(p, len, &why)) {
            if (bad++ < 5)
                cr_log_error("%s: not a key=value log line (%s): %.*s", what, why, (int)(len < 400 ? len : 400), p);
        }
        n++;
        p = nl ? nl + 1 : p + len;
    }
    cr_expect_eq(bad, 0, "%s: %zu of %zu lines are not `ts=.. level=.. event=.. key=value...`", what, bad, n);
    return n;
}

/* None of the secrets (NULL-terminated) appears in text; names the line that leaks. */
static void expect_no_secrets(const char *text, const char *const *secrets, const char *what)
{
    for (size_t i = 0; secrets[i] != NULL; i++) {
        const char *hit = strstr(text, secrets[i]);
        if (hit == NULL)
            continue;
        const char *ls = hit;
        while (ls > text && ls[-1] != '\n')
            ls--;
        const char *le = strchr(hit, '\n');
        int ll = le ? (int)(le - ls) : (int)strlen(ls);
        cr_expect_fail("%s: the secret %s is in the log: %.*s", what, secrets[i], ll < 500 ? ll : 500, ls);
    }
}

/* ---- no secrets in logs */

Test(security, no_secrets_or_bodies_in_logs_and_every_line_is_key_value)
{
    char body[64], auth_tok[64], auth[96], pw[64], admin_tok[64], wrong_tok[64], rpw[64], key_base[64];
    mkrand(body, sizeof body, "BODY-SECRET");
    mkrand(auth_tok, sizeof auth_tok, "AUTH-SECRET");
    snprintf(auth, sizeof auth, "Bearer %s", auth_tok);
    mkrand(pw, sizeof pw, "PW-SECRET");
    mkrand(admin_tok, sizeof admin_tok, "ADMIN-SECRET");
    mkrand(wrong_tok, sizeof wrong_tok, "WRONGADMIN-SECRET");
    mkrand(rpw, sizeof rpw, "RPW-SECRET");
    mkrand(key_base, sizeof key_base, "logkey");
    const char *const secrets[] = {body, auth_tok, pw, admin_tok, wrong_tok, rpw, NULL};

    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char *pg = pg_url_with_password(pw);
    char env_pg[512], env_admin[128];
    snprintf(env_pg, sizeof env_pg, "IDEMGATE_POSTGRES_URL=%s", pg);
    snprintf(env_admin, sizeof env_admin, "IDEMGATE_ADMIN_TOKEN=%s", admin_tok);
    const char *const env[] = {env_pg, env_admin, "IDEMGATE_LOG_LEVEL=debug", NULL};
    struct e2e_gw *gw = start_gw(up, env, true);

    char k[8][96];
    for (int i = 0; i < 8; i++)
        snprintf(k[i], sizeof k[i], "%s-%d", key_base, i);
    char body2[96];
    snprintf(body2, sizeof body2, "%s-other", body);
    struct e2e_resp r, r2;

    /* executed, replayed */
    post(gw->port, "/v1/pay/s", k[0], auth, NULL, body, 0, &r);
    cr_expect_eq(r.status, 200, "first request: %ld (%s) %.200s", r.status, r.error, (const char *)r.body);
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay/s", k[0], auth, NULL, body, 0, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "retry: %ld, replayed %d", r.status,
              (int)e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    /* 422: same key, other body */
    post(gw->port, "/v1/pay/s", k[0], auth, NULL, body2, 0, &r);
    e2e_expect_problem(&r, 422, "idempotency-key-mismatch", "other body");
    e2e_resp_free(&r);
    /* 409: while the first is in flight */
    {
        char kh[160], ah[160];
        snprintf(kh, sizeof kh, "Idempotency-Key: %s", k[1]);
        snprintf(ah, sizeof ah, "Authorization: %s", auth);
        const char *h[] = {kh, ah, "X-Test-Delay-Ms: 700", NULL};
        struct e2e_req rq = {.method = "POST",
                             .path = "/v1/pay/s",
                             .headers = h,
                             .body = body,
                             .body_len = strlen(body),
                             .timeout_ms = 5000};
        struct e2e_async *a = e2e_http_async(gw->port, &rq);
        cr_assert_geq(e2e_upstream_wait_count(up, k[1], 1, 3000), 1,
                      "the upstream did not see %ld execution(s) of %s within 3 s", 1L, k[1]);
        post(gw->port, "/v1/pay/s", k[1], auth, NULL, body, 0, &r2);
        e2e_expect_problem(&r2, 409, "idempotency-key-in-use", "in flight");
        e2e_resp_free(&r2);
        e2e_http_join(a, &r);
        cr_expect_eq(r.status, 200, "the slow first request: %ld (%s)", r.status, r.error);
        e2e_resp_free(&r);
    }
    /* 502: nobody listens on the upstream */
    post(gw->port, "/v1/dead/s", k[2], auth, NULL, body, 0, &r);
    e2e_expect_problem(&r, 502, "upstream-unavailable", "dead upstream");
    e2e_resp_free(&r);
    /* 502: the upstream closes without answering */
    static const char *const close_h[] = {"X-Test-Action: close", NULL};
    post(gw->port, "/v1/pay/s", k[3], auth, close_h, body, 0, &r);
    e2e_expect_problem(&r, 502, "upstream-no-response", "upstream closed");
    e2e_resp_free(&r);
    /* 504: the upstream is slower than its 1 s timeout */
    static const char *const slow_h[] = {"X-Test-Delay-Ms: 2500", NULL};
    post(gw->port, "/v1/pay/s", k[4], auth, slow_h, body, 5000, &r);
    e2e_expect_problem(&r, 504, "upstream-timeout", "slow upstream");
    e2e_resp_free(&r);
    /* 413: a body over 1 KiB full of the secret */
    {
        char big[2048];
        size_t bl = strlen(body), o = 0;
        while (o + bl + 1 < sizeof big) {
            memcpy(big + o, body, bl);
            o += bl;
            big[o++] = ' ';
        }
        big[o] = '\0';
        post(gw->port, "/v1/pay/s", k[5], auth, NULL, big, 0, &r);
        e2e_expect_problem(&r, 413, "payload-too-large", "big body");
        e2e_resp_free(&r);
    }
    /* 400: invalid key, missing key, and a malformed header next to the Authorization */
    post(gw->port, "/v1/pay/s", "two words", auth, NULL, body, 0, &r);
    e2e_expect_problem(&r, 400, "idempotency-key-invalid", "invalid key");
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay/s", NULL, auth, NULL, body, 0, &r);
    e2e_expect_problem(&r, 400, "idempotency-key-missing", "missing key");
    e2e_resp_free(&r);
    {
        char raw[512];
        int n = snprintf(raw, sizeof raw,
                         "POST /v1/pay/s HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: %s\r\nIdempotency-Key: %s\r\n"
                         "X-Bad\x01Name: %s\r\nContent-Length: %zu\r\n\r\n%s",
                         auth, k[6], body, strlen(body), body);
        struct e2e_raw rr;
        e2e_raw_send(gw->port, raw, (size_t)n, 5000, &rr);
        cr_expect_eq(rr.status, 400, "malformed header: %d %.200s", rr.status, rr.data);
        free(rr.data);
        /* MHD's own errors: a bad Content-Length and a header block over its memory */
        n = snprintf(raw, sizeof raw,
                     "POST /v1/pay/s HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: %s\r\nContent-Length: %s\r\n\r\n",
                     auth, body);
        e2e_raw_send(gw->port, raw, (size_t)n, 5000, &rr);
        cr_expect_eq(rr.status, 400, "Content-Length made of the secret: %d %.200s", rr.status, rr.data);
        free(rr.data);
        size_t cap = 70000;
        char *huge = malloc(cap);
        cr_assert_not_null(huge);
        size_t o =
            (size_t)snprintf(huge, cap, "GET /v1/pay/s HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: %s\r\n", auth);
        while (o + 200 < cap)
            o += (size_t)snprintf(huge + o, cap - o, "X-Fill: %s\r\n", body);
        o += (size_t)snprintf(huge + o, cap - o, "\r\n");
        e2e_raw_send(gw->port, huge, o, 5000, &rr);
        cr_expect(rr.status == 431 || (rr.status == 0 && rr.closed), "64 KiB header block: %d", rr.status);
        free(rr.data);
        free(huge);
    }
    /* quotes, backslashes and percent-encoded newlines in the path, the query and the key: still one line each */
    post(gw->port, "/v1/pay/q\"uo'te\\x?a=\"b\"&c=%0a%0dlevel=error", "\"k\\\"ey\"", auth, NULL, body, 0, &r);
    cr_expect(r.status == 200 || r.status == 400, "odd path and key: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    post(gw->port, "/nowhere\"x\\y%0aevent=fake", k[6], auth, NULL, body, 0, &r);
    /* a raw backslash in a path is refused before routing (SPEC 7) */
    e2e_expect_problem(&r, 400, "bad-request", "unrouted odd path");
    e2e_resp_free(&r);
    /* admin: right token, wrong token */
    admin_list(gw, "pay", k[0], NULL, &r);
    cr_expect_eq(r.status, 401, "admin without a token: %ld", r.status);
    e2e_resp_free(&r);
    {
        char a1[128];
        snprintf(a1, sizeof a1, "Bearer %s", admin_tok);
        admin_list(gw, "pay", k[0], a1, &r);
        cr_expect_eq(r.status, 200, "admin with the token: %ld %.200s", r.status, (const char *)r.body);
        e2e_resp_free(&r);
        snprintf(a1, sizeof a1, "Bearer %s", wrong_tok);
        admin_list(gw, "pay", k[0], a1, &r);
        cr_expect_eq(r.status, 401, "admin with a wrong token: %ld", r.status);
        e2e_resp_free(&r);
    }
    struct e2e_req mq = {.path = "/metrics", .timeout_ms = 5000};
    e2e_http(gw->admin_port, &mq, &r);
    cr_expect_eq(r.status, 200);
    expect_no_secrets((const char *)r.body, secrets, "/metrics");
    e2e_resp_free(&r);

    /* a second instance whose Postgres (and Redis) URLs with passwords point at dead ports: 503 */
    uint16_t dead_pg = e2e_free_port(), dead_redis = e2e_free_port();
    char env_pg2[256], env_redis2[256];
    snprintf(env_pg2, sizeof env_pg2, "IDEMGATE_POSTGRES_URL=postgresql://idemgate:%s@127.0.0.1:%u/idemgate", pw,
             (unsigned)dead_pg);
    snprintf(env_redis2, sizeof env_redis2, "IDEMGATE_REDIS_URL=redis://:%s@127.0.0.1:%u/0", rpw, (unsigned)dead_redis);
    const char *const env2[] = {env_pg2, env_redis2, env_admin, "IDEMGATE_LOG_LEVEL=debug", NULL};
    struct e2e_gw *gw2 = start_gw(up, env2, false);
    e2e_sleep_ms(500);
    post(gw2->port, "/v1/pay/s", k[7], auth, NULL, body, 5000, &r);
    e2e_expect_problem(&r, 503, "store-unavailable", "dead Postgres");
    e2e_resp_free(&r);
    {
        char a1[128];
        snprintf(a1, sizeof a1, "Bearer %s", admin_tok);
        admin_list(gw2, "pay", k[7], a1, &r); /* whatever it answers, nothing may leak */
        e2e_resp_free(&r);
    }
    e2e_sleep_ms(1000); /* reconnect attempts get logged */

    cr_expect_eq(e2e_gw_stop(gw, 10000), 0, "the gateway must exit 0 at SIGTERM");
    cr_expect_eq(e2e_gw_stop(gw2, 10000), 0, "the second gateway must exit 0 at SIGTERM");
    char *log1 = e2e_gw_log(gw);
    char *log2 = e2e_gw_log(gw2);
    expect_no_secrets(log1, secrets, "gateway log");
    expect_no_secrets(log2, secrets, "dead-store gateway log");
    size_t n1 = expect_log_lines(log1, "gateway log");
    size_t n2 = expect_log_lines(log2, "dead-store gateway log");
    cr_expect(n1 >= 5 && n2 >= 3, "too few log lines to judge (%zu, %zu)", n1, n2);
    cr_expect(strstr(log1, "level=debug") != NULL || strstr(log2, "level=debug") != NULL,
              "IDEMGATE_LOG_LEVEL=debug gave no debug line: the logs were not judged at full verbosity");
    free(log1);
    free(log2);

    /* --check: configuration errors next to password URLs (in the file and in the environment); @PW@ stands for
     * the password */
    const char *bin = e2e_env("IDEMGATE_BIN");
    static const struct {
        const char *what;
        const char *yaml;
        bool env_pw; /* IDEMGATE_POSTGRES_URL with the password */
        int exit_code;
    } checks[] = {
        {"out-of-range pool next to a password URL",
         "listen: 127.0.0.1:1\nstore:\n  postgres: \"postgresql://idemgate:@PW@@127.0.0.1:5432/idemgate\"\n"
         "  pool: 0\nupstreams:\n  - name: api\n    url: http://127.0.0.1:2\ndefault_upstream: api\n",
         false, 1},
        {"malformed Postgres URL with a password",
         "listen: 127.0.0.1:1\nstore:\n  postgres: \"postgresql://idemgate:@PW@@127.0.0.1:notaport/idem gate\"\n"
         "upstreams:\n  - name: api\n    url: http://127.0.0.1:2\ndefault_upstream: api\nbogus_key: 1\n",
         false, 1},
        {"malformed Redis URL with a password",
         "listen: 127.0.0.1:1\nstore:\n  postgres: postgresql://idemgate@127.0.0.1:5432/idemgate\n"
         "  redis: \"redis://:@PW@@127.0.0.1:notaport/x\"\nupstreams:\n  - name: api\n    url: http://127.0.0.1:2\n"
         "default_upstream: api\nbogus_key: 1\n",
         false, 1},
        {"unknown key with IDEMGATE_POSTGRES_URL carrying a password",
         "listen: 127.0.0.1:1\nupstreams:\n  - name: api\n    url: http://127.0.0.1:2\ndefault_upstream: api\n"
         "no_such_key: 1\n",
         true, 1},
        {"valid config with IDEMGATE_POSTGRES_URL carrying a password",
         "listen: 127.0.0.1:1\nupstreams:\n  - name: api\n    url: http://127.0.0.1:2\ndefault_upstream: api\n", true,
         0},
    };
    const char *const pw_only[] = {pw, NULL};
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++) {
        char yaml[1024], name[32];
        subst(yaml, sizeof yaml, checks[i].yaml, "@PW@", pw);
        snprintf(name, sizeof name, "check-%zu.yaml", i);
        const char *path = e2e_write_file(name, yaml);
        const char *argv[] = {bin, "--check", "-c", path, NULL};
        char env_chk[256];
        snprintf(env_chk, sizeof env_chk, "IDEMGATE_POSTGRES_URL=postgresql://idemgate:%s@127.0.0.1:5432/idemgate", pw);
        const char *const envc[] = {env_chk, NULL};
        char *out = NULL, *err = NULL;
        int code = e2e_run(argv, checks[i].env_pw ? envc : NULL, 10000, &out, &err);
        cr_log_info("--check %s: exit %d: %s%s", checks[i].what, code, out, err);
        cr_expect_eq(code, checks[i].exit_code, "--check %s: exit %d, expected %d: %s", checks[i].what, code,
                     checks[i].exit_code, err);
        char what[160];
        snprintf(what, sizeof what, "--check (%s) stdout", checks[i].what);
        expect_no_secrets(out, pw_only, what);
        snprintf(what, sizeof what, "--check (%s) stderr", checks[i].what);
        expect_no_secrets(err, pw_only, what);
        expect_log_lines(err, what);
        free(out);
        free(err);
    }
    free(pg);
}

/* ---- tenants */

Test(security, tenant_keys_are_isolated_by_scope)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_gw(up, NULL, true);
    char key[80], ta[80], tb[80], ta_upper[80];
    mkrand(key, sizeof key, "tenant");
    mkrand(ta, sizeof ta, "Bearer tenant-a");
    mkrand(tb, sizeof tb, "Bearer tenant-b");
    snprintf(ta_upper, sizeof ta_upper, "%s", ta);
    for (char *p = ta_upper; *p; p++)
        if (*p >= 'a' && *p <= 'f')
            *p = (char)(*p - 'a' + 'A');
    static const char body[] = "{\"amount\":100}";

    struct e2e_resp a1, b1, a2, b2, u1;
    post(gw->port, "/v1/pay/t", key, ta, NULL, body, 0, &a1);
    post(gw->port, "/v1/pay/t", key, tb, NULL, body, 0, &b1);
    post(gw->port, "/v1/pay/t", key, ta_upper, NULL, body, 0, &u1);
    cr_expect(a1.status == 200 && !e2e_resp_is_replay(&a1), "tenant A: %ld", a1.status);
    cr_expect(b1.status == 200 && !e2e_resp_is_replay(&b1), "tenant B got %ld, replayed %d: another tenant's record",
              b1.status, (int)e2e_resp_is_replay(&b1));
    cr_expect(u1.status == 200 && !e2e_resp_is_replay(&u1), "tenant A in other letter case got %ld, replayed %d",
              u1.status, (int)e2e_resp_is_replay(&u1));
    cr_expect(strcmp(exec_id(&a1), exec_id(&b1)) != 0 && strcmp(exec_id(&a1), exec_id(&u1)) != 0,
              "executions A %s, B %s, A-upper %s must differ", exec_id(&a1), exec_id(&b1), exec_id(&u1));
    post(gw->port, "/v1/pay/t", key, ta, NULL, body, 0, &a2);
    post(gw->port, "/v1/pay/t", key, tb, NULL, body, 0, &b2);
    cr_expect(e2e_resp_is_replay(&a2) && strcmp(exec_id(&a2), exec_id(&a1)) == 0,
              "A's retry must replay A's execution %s, got %s", exec_id(&a1), exec_id(&a2));
    cr_expect(e2e_resp_is_replay(&b2) && strcmp(exec_id(&b2), exec_id(&b1)) == 0,
              "B's retry must replay B's execution %s, got %s", exec_id(&b1), exec_id(&b2));
    e2e_resp_free(&a1);
    e2e_resp_free(&b1);
    e2e_resp_free(&a2);
    e2e_resp_free(&b2);
    e2e_resp_free(&u1);
    cr_expect_eq(e2e_upstream_count(up, key), 3, "three tenants, three executions");

    /* B with the same key while A's request is in flight: B executes, it does not wait on or conflict with A */
    char key2[80];
    mkrand(key2, sizeof key2, "tenant-inflight");
    char kh[128], ah[128];
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key2);
    snprintf(ah, sizeof ah, "Authorization: %s", ta);
    const char *h[] = {kh, ah, "X-Test-Delay-Ms: 700", NULL};
    struct e2e_req rq = {.method = "POST",
                         .path = "/v1/pay/t",
                         .headers = h,
                         .body = body,
                         .body_len = strlen(body),
                         .timeout_ms = 5000};
    struct e2e_async *as = e2e_http_async(gw->port, &rq);
    cr_assert_geq(e2e_upstream_wait_count(up, key2, 1, 3000), 1,
                  "the upstream did not see %ld execution(s) of %s within 3 s", 1L, key2);
    post(gw->port, "/v1/pay/t", key2, tb, NULL, body, 0, &b1);
    cr_expect(b1.status == 200 && !e2e_resp_is_replay(&b1), "tenant B while A is in flight: %ld (%.200s)", b1.status,
              (const char *)b1.body);
    e2e_resp_free(&b1);
    e2e_http_join(as, &a1);
    cr_expect(a1.status == 200 && !e2e_resp_is_replay(&a1), "tenant A in flight: %ld", a1.status);
    e2e_resp_free(&a1);
    cr_expect_eq(e2e_upstream_count(up, key2), 2);

    /* two scope parts: ("ab", "c") and ("a", "bc") must not collide, nor (x, none) and (none, x) */
    char key3[80];
    mkrand(key3, sizeof key3, "tenant-pair");
    static const char *const t_c[] = {"X-Tenant: c", NULL};
    static const char *const t_bc[] = {"X-Tenant: bc", NULL};
    static const char *const t_x[] = {"X-Tenant: x", NULL};
    struct e2e_resp p[4];
    post(gw->port, "/v1/pair/t", key3, "ab", t_c, body, 0, &p[0]);
    post(gw->port, "/v1/pair/t", key3, "a", t_bc, body, 0, &p[1]);
    post(gw->port, "/v1/pair/t", key3, "x", NULL, body, 0, &p[2]);
    post(gw->port, "/v1/pair/t", key3, NULL, t_x, body, 0, &p[3]);
    static const char *const names[] = {"(ab, c)", "(a, bc)", "(x, -)", "(-, x)"};
    for (int i = 0; i < 4; i++) {
        cr_expect(p[i].status == 200 && !e2e_resp_is_replay(&p[i]), "scope %s: %ld, replayed %d: scopes collided",
                  names[i], p[i].status, (int)e2e_resp_is_replay(&p[i]));
        e2e_resp_free(&p[i]);
    }
    cr_expect_eq(e2e_upstream_count(up, key3), 4, "four distinct scopes, four executions");
}

/* ---- admin token */

Test(security, admin_token_is_compared_exactly)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char tok[64];
    mkrand(tok, sizeof tok, "adm");
    char env_admin[128];
    snprintf(env_admin, sizeof env_admin, "IDEMGATE_ADMIN_TOKEN=%s", tok);
    const char *const env[] = {env_admin, NULL};
    struct e2e_gw *gw = start_gw(up, env, true);
    size_t tl = strlen(tok);

    char same_len[64], prefix[64], longer[80], right[96], cases_buf[8][160];
    snprintf(same_len, sizeof same_len, "%s", tok);
    same_len[tl - 1] = same_len[tl - 1] == 'x' ? 'y' : 'x';
    snprintf(prefix, sizeof prefix, "%.*s", (int)(tl - 1), tok);
    snprintf(longer, sizeof longer, "%sx", tok);
    snprintf(right, sizeof right, "Bearer %s", tok);
    snprintf(cases_buf[0], sizeof cases_buf[0], "Bearer %s", same_len);
    snprintf(cases_buf[1], sizeof cases_buf[1], "Bearer %s", prefix);
    snprintf(cases_buf[2], sizeof cases_buf[2], "Bearer %s", longer);
    snprintf(cases_buf[3], sizeof cases_buf[3], "Bearer ");
    snprintf(cases_buf[4], sizeof cases_buf[4], "%s", tok);
    snprintf(cases_buf[5], sizeof cases_buf[5], "Basic %s", tok);
    snprintf(cases_buf[6], sizeof cases_buf[6], "Bearer %s extra", tok);
    snprintf(cases_buf[7], sizeof cases_buf[7], "Bearer%s", tok);
    static const char *const names[] = {"same length, last byte differs",
                                        "prefix",
                                        "longer",
                                        "empty token",
                                        "token without Bearer",
                                        "Basic scheme",
                                        "token with a trailing word",
                                        "Bearer glued to the token"};
    struct e2e_resp r;
    for (size_t i = 0; i < 8; i++) {
        admin_list(gw, "pay", "any-key", cases_buf[i], &r);
        cr_expect_eq(r.status, 401, "admin with %s (Authorization: %s): %ld", names[i], cases_buf[i], r.status);
        e2e_resp_free(&r);
    }
    admin_list(gw, "pay", "any-key", NULL, &r);
    cr_expect_eq(r.status, 401, "admin without Authorization: %ld", r.status);
    e2e_resp_free(&r);
    /* the token in the query string is no credential */
    char path[256];
    snprintf(path, sizeof path, "/admin/keys?route=pay&key=any-key&token=%s&access_token=%s", tok, tok);
    struct e2e_req rq = {.path = path, .timeout_ms = 5000};
    e2e_http(gw->admin_port, &rq, &r);
    cr_expect_eq(r.status, 401, "admin with the token in the query: %ld", r.status);
    e2e_resp_free(&r);
    /* a wrong token on the mutating endpoints */
    struct e2e_req del = {.method = "DELETE",
                          .path = "/admin/keys?route=pay&key=any-key",
                          .headers = (const char *const[]){"Authorization: Bearer wrong", NULL},
                          .timeout_ms = 5000};
    e2e_http(gw->admin_port, &del, &r);
    cr_expect_eq(r.status, 401, "DELETE with a wrong token: %ld", r.status);
    e2e_resp_free(&r);
    struct e2e_req rel = {.method = "POST",
                          .path = "/admin/keys/release?route=pay&key=any-key",
                          .headers = (const char *const[]){"Authorization: Bearer wrong", NULL},
                          .body = "",
                          .body_len = 0,
                          .timeout_ms = 5000};
    e2e_http(gw->admin_port, &rel, &r);
    cr_expect_eq(r.status, 401, "release with a wrong token: %ld", r.status);
    e2e_resp_free(&r);

    admin_list(gw, "pay", "any-key", right, &r);
    cr_expect_eq(r.status, 200, "admin with the right token: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
}

/* ---- SQL */

/* JSON string form of s ("..." with \" and \\ escaped). */
static void json_str(char *out, size_t n, const char *s)
{
    size_t o = 0;
    out[o++] = '"';
    for (; *s && o + 3 < n; s++) {
        if (*s == '"' || *s == '\\')
            out[o++] = '\\';
        out[o++] = *s;
    }
    out[o++] = '"';
    out[o] = '\0';
}

Test(security, sql_stays_in_parameters)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char tok[64];
    mkrand(tok, sizeof tok, "adm");
    char env_admin[128], bearer[96];
    snprintf(env_admin, sizeof env_admin, "IDEMGATE_ADMIN_TOKEN=%s", tok);
    snprintf(bearer, sizeof bearer, "Bearer %s", tok);
    const char *const env[] = {env_admin, NULL};
    struct e2e_gw *gw = start_gw(up, env, true);
    char tag[40];
    mkrand(tag, sizeof tag, "sql");

    /* raw header value -> the key it stands for */
    struct {
        char raw[200];
        char key[200];
    } ks[8];
    snprintf(ks[0].raw, sizeof ks[0].raw, "\"'; DROP TABLE idemgate_keys; -- %s\"", tag);
    snprintf(ks[0].key, sizeof ks[0].key, "'; DROP TABLE idemgate_keys; -- %s", tag);
    snprintf(ks[1].raw, sizeof ks[1].raw, "\"a\\\"b\\\\c %s\"", tag);
    snprintf(ks[1].key, sizeof ks[1].key, "a\"b\\c %s", tag);
    snprintf(ks[2].raw, sizeof ks[2].raw, "x';--%s", tag);
    snprintf(ks[2].key, sizeof ks[2].key, "x';--%s", tag);
    snprintf(ks[3].raw, sizeof ks[3].raw, "a\\b\\%s", tag);
    snprintf(ks[3].key, sizeof ks[3].key, "a\\b\\%s", tag);
    snprintf(ks[4].raw, sizeof ks[4].raw, "k;1;2;%s", tag);
    snprintf(ks[4].key, sizeof ks[4].key, "k;1;2;%s", tag);
    snprintf(ks[5].raw, sizeof ks[5].raw, "\"' OR '1'='1 %s\"", tag);
    snprintf(ks[5].key, sizeof ks[5].key, "' OR '1'='1 %s", tag);
    snprintf(ks[6].raw, sizeof ks[6].raw, "$1%%s%%n{{x}}%s", tag);
    snprintf(ks[6].key, sizeof ks[6].key, "$1%%s%%n{{x}}%s", tag);
    snprintf(ks[7].raw, sizeof ks[7].raw, "\"$$;SELECT pg_sleep(5);$$ %s\"", tag);
    snprintf(ks[7].key, sizeof ks[7].key, "$$;SELECT pg_sleep(5);$$ %s", tag);
    static const char *const auth[] = {"Bearer x'); DELETE FROM idemgate_keys; --", NULL};
    static const char body[] = "{\"note\":\"'); DELETE FROM idemgate_keys; --\"}";

    for (size_t i = 0; i < 8; i++) {
        long before = e2e_upstream_count(up, NULL);
        struct e2e_resp r1, r2;
        post(gw->port, "/v1/pay/sql", ks[i].raw, auth[0], NULL, body, 0, &r1);
        cr_expect(r1.status == 200 && !e2e_resp_is_replay(&r1), "key %s: first request %ld (%s) %.200s", ks[i].raw,
                  r1.status, r1.error, (const char *)r1.body);
        post(gw->port, "/v1/pay/sql", ks[i].raw, auth[0], NULL, body, 0, &r2);
        cr_expect(r2.status == 200 && e2e_resp_is_replay(&r2) && strcmp(exec_id(&r1), exec_id(&r2)) == 0,
                  "key %s: the retry must replay execution %s, got %ld replayed=%d exec %s", ks[i].raw, exec_id(&r1),
                  r2.status, (int)e2e_resp_is_replay(&r2), exec_id(&r2));
        cr_expect(r1.seconds < 2.0 && r2.seconds < 2.0, "key %s: the requests took %.2f s and %.2f s", ks[i].raw,
                  r1.seconds, r2.seconds);
        e2e_resp_free(&r1);
        e2e_resp_free(&r2);
        cr_expect_eq(e2e_upstream_count(up, NULL), before + 1, "key %s: executions", ks[i].raw);

        struct e2e_resp a;
        admin_list(gw, "pay", ks[i].raw, bearer, &a);
        char js[420];
        json_str(js, sizeof js, ks[i].key);
        cr_expect_eq(a.status, 200, "admin list of key %s: %ld %.200s", ks[i].raw, a.status, (const char *)a.body);
        cr_expect(strstr((const char *)a.body, js) != NULL && strstr((const char *)a.body, "completed") != NULL,
                  "admin list of key %s must show %s completed: %.400s", ks[i].raw, js, (const char *)a.body);
        e2e_resp_free(&a);
    }
    /* SQL in the admin route parameter */
    struct e2e_resp a;
    admin_list(gw, "pay'; DROP TABLE idemgate_keys; --", ks[0].raw, bearer, &a);
    cr_expect(a.status == 200 || a.status == 400 || a.status == 404, "admin with SQL as route: %ld %.200s", a.status,
              (const char *)a.body);
    if (a.status == 200)
        cr_expect(strstr((const char *)a.body, "completed") == NULL,
                  "a route that does not exist listed records: %.300s", (const char *)a.body);
    e2e_resp_free(&a);

    /* the table is intact: every key still replays, and a new key executes */
    for (size_t i = 0; i < 8; i++) {
        struct e2e_resp r;
        post(gw->port, "/v1/pay/sql", ks[i].raw, auth[0], NULL, body, 0, &r);
        cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "after the attempts, key %s: %ld replayed=%d", ks[i].raw,
                  r.status, (int)e2e_resp_is_replay(&r));
        e2e_resp_free(&r);
    }
    admin_list(gw, "pay", ks[0].raw, bearer, &a);
    cr_expect_eq(a.status, 200, "admin list after the attempts: %ld", a.status);
    e2e_resp_free(&a);
    char fresh[80];
    mkrand(fresh, sizeof fresh, "sql-after");
    long before = e2e_upstream_count(up, NULL);
    struct e2e_resp r;
    post(gw->port, "/v1/pay/sql", fresh, auth[0], NULL, body, 0, &r);
    cr_expect(r.status == 200 && !e2e_resp_is_replay(&r), "a fresh key after the attempts: %ld", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), before + 1);
}

/* ---- Redis */

Test(security, redis_holds_no_raw_key_or_authorization)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_gw(up, NULL, true);
    char key[80], tok[80], auth[96];
    mkrand(key, sizeof key, "RAWKEY");
    mkrand(tok, sizeof tok, "RAUTH");
    snprintf(auth, sizeof auth, "Bearer %s", tok);
    struct e2e_resp r;
    post(gw->port, "/v1/pay/redis", key, auth, NULL, "{\"r\":1}", 0, &r);
    cr_expect_eq(r.status, 200, "first: %ld (%s)", r.status, r.error);
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay/redis", key, auth, NULL, "{\"r\":1}", 0, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "retry: %ld replayed=%d", r.status,
              (int)e2e_resp_is_replay(&r));
    e2e_resp_free(&r);

    char *cli = which("redis-cli");
    const char *url = e2e_env("IDEMGATE_TEST_REDIS_URL");
    const char *scan[] = {cli, "-u", url, "--scan", NULL};
    char *out = NULL, *err = NULL;
    int code = e2e_run(scan, NULL, 15000, &out, &err);
    cr_assert_eq(code, 0, "redis-cli --scan: exit %d: %s", code, err);
    cr_expect(out[0] != '\0', "Redis holds no key at all after a completed request: is it used?");
    cr_expect(strstr(out, key) == NULL, "a Redis key contains the raw idempotency key %s:\n%.1000s", key, out);
    cr_expect(strstr(out, tok) == NULL, "a Redis key contains the Authorization value:\n%.1000s", out);
    free(out);
    free(err);

    /* nor do the string values hold the Authorization value */
    const char *eval[] = {cli,
                          "-u",
                          url,
                          "EVAL",
                          "local out = {} for _, k in ipairs(redis.call('KEYS', '*')) do "
                          "if redis.call('TYPE', k).ok == 'string' then table.insert(out, redis.call('GET', k)) end "
                          "end return out",
                          "0",
                          NULL};
    code = e2e_run(eval, NULL, 15000, &out, &err);
    cr_assert_eq(code, 0, "redis-cli EVAL: exit %d: %s", code, err);
    cr_expect(strstr(out, tok) == NULL, "a Redis value contains the Authorization value");
    free(out);
    free(err);
    free(cli);
}
