/* harness.c - end-to-end test harness: process management for the real gateway and test upstream, config
 * templates, a blocking libcurl client, parallel and background requests, and a raw TCP client. */
#include "harness.h"

#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <curl/curl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/tools/b64url.h"
#include "tests/tools/body_pattern.h"

extern char **environ;

#define E2E_MAX_PROCS     32
#define E2E_MAX_GW        8
#define E2E_MAX_UP        8
#define E2E_MAX_FREES     256
#define E2E_MAX_RESP_BODY (64u * 1024 * 1024)
#define E2E_MAX_HDRS      512
#define E2E_START_TRIES   3

static struct {
    bool ready;
    bool curl_ready;
    bool cleaned;
    pid_t owner; /* the process that ran setup: only it cleans up */
    char *tmpdir;
    struct e2e_proc *procs[E2E_MAX_PROCS];
    size_t nprocs;
    struct e2e_gw *gws[E2E_MAX_GW];
    size_t ngw;
    struct e2e_upstream *ups[E2E_MAX_UP];
    size_t nup;
    void *frees[E2E_MAX_FREES];
    size_t nfrees;
    unsigned seq;
    bool asan_failed;
} st;

/* ---- small helpers */

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL)
        abort();
    return p;
}

static void *xcalloc(size_t a, size_t b)
{
    void *p = calloc(a ? a : 1, b ? b : 1);
    if (p == NULL)
        abort();
    return p;
}

static void *xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (q == NULL)
        abort();
    return q;
}

static char *xstrdup(const char *s)
{
    char *p = strdup(s);
    if (p == NULL)
        abort();
    return p;
}

static char *xasprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *xasprintf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    int n = vasprintf(&s, fmt, ap);
    va_end(ap);
    if (n < 0)
        abort();
    return s;
}

/* Frees p at teardown. */
static void *keep(void *p)
{
    cr_assert(st.nfrees < E2E_MAX_FREES, "harness: too many allocations kept");
    st.frees[st.nfrees++] = p;
    return p;
}

uint64_t e2e_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void e2e_sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        if (len != NULL)
            *len = 0;
        return xcalloc(1, 1);
    }
    size_t cap = 4096, n = 0;
    char *buf = xmalloc(cap + 1);
    for (int guard = 0; guard < 1000000; guard++) {
        if (n == cap) {
            cap *= 2;
            buf = xrealloc(buf, cap + 1);
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        if (r == 0)
            break;
        n += r;
    }
    fclose(f);
    buf[n] = '\0';
    if (len != NULL)
        *len = n;
    return buf;
}

static void write_file(const char *path, const char *data)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot write %s: %s", path, strerror(errno));
    size_t n = strlen(data);
    bool ok = fwrite(data, 1, n, f) == n;
    ok = (fclose(f) == 0) && ok;
    cr_assert(ok, "cannot write %s", path);
}

/* ---- environment and fixtures */

const char *e2e_env(const char *name)
{
    const char *v = getenv(name);
    cr_assert(v != NULL && *v != '\0',
              "environment variable %s is not set: run the end-to-end tests through scripts/test.sh "
              "(or `meson test` after sourcing the services' env file)",
              name);
    return v;
}

const char *e2e_tmpdir(void)
{
    cr_assert_not_null(st.tmpdir, "harness: e2e_setup was not run");
    return st.tmpdir;
}

const char *e2e_write_file(const char *name, const char *data)
{
    char *path = keep(xasprintf("%s/%s", e2e_tmpdir(), name));
    write_file(path, data);
    return path;
}

static void cleanup(void);

static void atexit_cleanup(void)
{
    cleanup();
}

static void setup_common(bool store)
{
    memset(&st, 0, sizeof st);
    st.owner = getpid();
    signal(SIGPIPE, SIG_IGN);
    e2e_engine_apply(); /* IDEMGATE_TEST_ENGINE=citus: the Citus cluster's URLs (the block at the end) */
    /* Fail (never skip) when the environment is incomplete. */
    e2e_env("IDEMGATE_BIN");
    e2e_env("IDEMGATE_TEST_UPSTREAM");
    if (store) {
        e2e_env("IDEMGATE_TEST_PG_URL");
        e2e_env("IDEMGATE_TEST_REDIS_URL");
    }
    char tmpl[] = "/tmp/idemgate-e2e-XXXXXX";
    char *d = mkdtemp(tmpl);
    cr_assert_not_null(d, "mkdtemp: %s", strerror(errno));
    st.tmpdir = xstrdup(d);
    atexit(atexit_cleanup);
    cr_assert(curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK, "curl_global_init failed");
    st.curl_ready = true;
    st.ready = true;
}

void e2e_setup(void)
{
    setup_common(true);
}

void e2e_setup_nostore(void)
{
    setup_common(false);
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    (void)remove(path);
    return 0;
}

static bool asan_build(void)
{
    const char *a = getenv("ASAN_OPTIONS");
    return a != NULL && *a != '\0';
}

/* Stops everything; idempotent. Gateways first (they hold connections to the upstreams). */
static void cleanup(void)
{
    if (!st.ready || st.cleaned || st.owner != getpid())
        return;
    st.cleaned = true;
    for (size_t i = 0; i < st.ngw; i++) {
        struct e2e_gw *g = st.gws[i];
        if (g->proc.pid <= 0 || g->proc.exited)
            continue;
        e2e_proc_stop(&g->proc, SIGTERM, E2E_STOP_TIMEOUT_MS);
        int code = e2e_proc_exit_code(&g->proc);
        if (code != 0) {
            fprintf(stderr, "e2e: gateway %d (%s) did not exit 0 at SIGTERM: exit=%d killed=%d\n", (int)g->proc.pid,
                    g->conf_path, code, (int)g->proc.killed);
            e2e_proc_dump_log(&g->proc, 4000);
            if (asan_build())
                st.asan_failed = true;
        }
    }
    for (size_t i = 0; i < st.nprocs; i++)
        e2e_proc_stop(st.procs[i], SIGTERM, 3000);
    const char *keep_env = getenv("E2E_KEEP");
    if (st.tmpdir != NULL) {
        if (keep_env != NULL && strcmp(keep_env, "1") == 0)
            fprintf(stderr, "e2e: kept %s\n", st.tmpdir);
        else
            (void)nftw(st.tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    }
    if (st.curl_ready)
        curl_global_cleanup();
    st.curl_ready = false;
    for (size_t i = 0; i < st.nfrees; i++)
        free(st.frees[i]);
    st.nfrees = 0;
    free(st.tmpdir);
    st.tmpdir = NULL;
}

void e2e_teardown(void)
{
    cleanup();
    if (st.asan_failed) {
        cr_log_error("a gateway did not exit 0 at SIGTERM under ASan (leak or crash): see its log above");
        fflush(stderr);
        _exit(3); /* assertions in .fini do not fail the test; a non-zero exit fails the run */
    }
}

uint16_t e2e_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert(fd >= 0, "socket: %s", strerror(errno));
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof sa;
    bool ok = bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 && getsockname(fd, (struct sockaddr *)&sa, &sl) == 0;
    int err = errno;
    close(fd);
    cr_assert(ok, "bind port 0: %s", strerror(err));
    return ntohs(sa.sin_port);
}

/* ---- processes */

static void register_proc(struct e2e_proc *p)
{
    cr_assert(st.nprocs < E2E_MAX_PROCS, "harness: too many processes");
    st.procs[st.nprocs++] = p;
}

/* Environment for a child: ours minus the names in drop[] and those set in extra[], plus extra[]. */
static char **build_env(const char *const *drop, const char *const *extra)
{
    size_t n = 0, m = 0;
    while (environ[n] != NULL)
        n++;
    while (extra != NULL && extra[m] != NULL)
        m++;
    char **env = xcalloc(n + m + 1, sizeof *env);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const char *eq = strchr(environ[i], '=');
        size_t nl = eq ? (size_t)(eq - environ[i]) : strlen(environ[i]);
        bool skip = false;
        for (size_t j = 0; !skip && drop != NULL && drop[j] != NULL; j++)
            skip = strlen(drop[j]) == nl && strncmp(drop[j], environ[i], nl) == 0;
        for (size_t j = 0; !skip && j < m; j++)
            skip = strncmp(extra[j], environ[i], nl) == 0 && extra[j][nl] == '=';
        if (!skip)
            env[k++] = environ[i];
    }
    for (size_t j = 0; j < m; j++)
        env[k++] = (char *)extra[j];
    env[k] = NULL;
    return env;
}

/* fork + execve with stdin from /dev/null and stdout/stderr into the given files; the child dies with us
 * (PR_SET_PDEATHSIG), so nothing is left running even when the test process is killed. */
static pid_t spawn(const char *const *argv, char **envp, const char *out_path, const char *err_path)
{
    int in = open("/dev/null", O_RDONLY | O_CLOEXEC);
    int out = open(out_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    int err = strcmp(out_path, err_path) == 0 ? fcntl(out, F_DUPFD_CLOEXEC, 3)
                                              : open(err_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    cr_assert(in >= 0 && out >= 0 && err >= 0, "cannot open child files (%s): %s", out_path, strerror(errno));
    pid_t parent = getpid();
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        (void)prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        signal(SIGPIPE, SIG_DFL);
        if (dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0)
            _exit(127);
        execve(argv[0], (char *const *)argv, envp);
        static const char msg[] = "e2e: execve failed: ";
        (void)!write(2, msg, sizeof msg - 1);
        (void)!write(2, argv[0], strlen(argv[0]));
        (void)!write(2, "\n", 1);
        _exit(127);
    }
    int fork_errno = errno;
    close(in);
    close(out);
    close(err);
    cr_assert(pid > 0, "fork: %s", strerror(fork_errno));
    return pid;
}

static bool reap(struct e2e_proc *p, bool block)
{
    if (p->pid <= 0 || p->exited)
        return true;
    int status = 0;
    pid_t r;
    do {
        r = waitpid(p->pid, &status, block ? 0 : WNOHANG);
    } while (r < 0 && errno == EINTR);
    if (r == p->pid) {
        p->exited = true;
        p->wstatus = status;
        return true;
    }
    if (r < 0 && errno == ECHILD) { /* someone else reaped it: treat as gone */
        p->exited = true;
        p->wstatus = 0x7f00; /* exit 127 */
        return true;
    }
    return false;
}

bool e2e_proc_wait(struct e2e_proc *p, int timeout_ms)
{
    uint64_t deadline = e2e_now_ms() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0);
    for (;;) {
        if (reap(p, false))
            return true;
        if (e2e_now_ms() >= deadline)
            return false;
        e2e_sleep_ms(5);
    }
}

bool e2e_proc_stop(struct e2e_proc *p, int sig, int grace_ms)
{
    if (p->pid <= 0 || reap(p, false))
        return true;
    (void)kill(p->pid, sig);
    if (e2e_proc_wait(p, grace_ms))
        return true;
    fprintf(stderr, "e2e: %s pid %d still running %d ms after signal %d: SIGKILL\n", p->what ? p->what : "child",
            (int)p->pid, grace_ms, sig);
    p->killed = true;
    (void)kill(p->pid, SIGKILL);
    if (!e2e_proc_wait(p, 10000)) {
        fprintf(stderr, "e2e: pid %d survives SIGKILL\n", (int)p->pid);
        return false;
    }
    return false;
}

int e2e_proc_exit_code(const struct e2e_proc *p)
{
    if (!p->exited)
        return -1000;
    if (WIFEXITED(p->wstatus))
        return WEXITSTATUS(p->wstatus);
    if (WIFSIGNALED(p->wstatus))
        return -WTERMSIG(p->wstatus);
    return -999;
}

char *e2e_proc_log(const struct e2e_proc *p)
{
    return p->log ? read_file(p->log, NULL) : xcalloc(1, 1);
}

void e2e_proc_dump_log(const struct e2e_proc *p, size_t tail)
{
    size_t n = 0;
    char *s = p->log ? read_file(p->log, &n) : xcalloc(1, 1);
    size_t from = n > tail ? n - tail : 0;
    fprintf(stderr, "---- %s log (%s, last %zu bytes) ----\n%s\n---- end of log ----\n", p->what ? p->what : "child",
            p->log ? p->log : "-", n - from, s + from);
    free(s);
}

int e2e_run(const char *const *argv, const char *const *env, int timeout_ms, char **out, char **err)
{
    unsigned id = ++st.seq;
    char *op = xasprintf("%s/run-%u.out", e2e_tmpdir(), id);
    char *ep = xasprintf("%s/run-%u.err", e2e_tmpdir(), id);
    static const char *const drop[] = {"IDEMGATE_POSTGRES_URL", "IDEMGATE_REDIS_URL", "IDEMGATE_ADMIN_TOKEN", NULL};
    char **envp = build_env(drop, env);
    struct e2e_proc p = {.what = argv[0]};
    p.pid = spawn(argv, envp, op, ep);
    free(envp);
    bool done = e2e_proc_wait(&p, timeout_ms);
    if (!done)
        e2e_proc_stop(&p, SIGKILL, 0);
    char *o = read_file(op, NULL);
    char *e = read_file(ep, NULL);
    free(op);
    free(ep);
    cr_assert(done, "%s did not exit within %d ms; stderr: %s", argv[0], timeout_ms, e);
    if (out != NULL)
        *out = o;
    else
        free(o);
    if (err != NULL)
        *err = e;
    else
        free(e);
    return e2e_proc_exit_code(&p);
}

/* ---- the test upstream */

struct e2e_upstream *e2e_upstream_start(const char *const *extra_args)
{
    cr_assert(st.nup < E2E_MAX_UP, "harness: too many upstreams");
    struct e2e_upstream *u = xcalloc(1, sizeof *u);
    st.ups[st.nup++] = u;
    keep(u);
    unsigned id = ++st.seq;
    char *port_file = keep(xasprintf("%s/up-%u.port", e2e_tmpdir(), id));
    u->proc.log = keep(xasprintf("%s/up-%u.log", e2e_tmpdir(), id));
    u->proc.what = "testupstream";
    const char *argv[32];
    size_t n = 0;
    argv[n++] = e2e_env("IDEMGATE_TEST_UPSTREAM");
    argv[n++] = "--port";
    argv[n++] = "0";
    argv[n++] = "--port-file";
    argv[n++] = port_file;
    for (size_t i = 0; extra_args != NULL && extra_args[i] != NULL; i++) {
        cr_assert(n < 31, "harness: too many upstream arguments");
        argv[n++] = extra_args[i];
    }
    argv[n] = NULL;
    char **envp = build_env(NULL, NULL);
    u->proc.pid = spawn(argv, envp, u->proc.log, u->proc.log);
    free(envp);
    register_proc(&u->proc);

    uint64_t deadline = e2e_now_ms() + E2E_READY_TIMEOUT_MS;
    for (;;) {
        if (reap(&u->proc, false)) {
            e2e_proc_dump_log(&u->proc, 4000);
            cr_assert_fail("testupstream exited at start-up (exit %d)", e2e_proc_exit_code(&u->proc));
        }
        char *txt = read_file(port_file, NULL);
        char *end = NULL;
        errno = 0;
        unsigned long port = strtoul(txt, &end, 10);
        bool parsed = errno == 0 && end != txt && *end == '\n' && port > 0 && port <= 65535;
        free(txt);
        if (parsed) {
            u->port = (uint16_t)port;
            snprintf(u->url, sizeof u->url, "http://127.0.0.1:%u", (unsigned)u->port);
            struct e2e_resp r;
            struct e2e_req rq = {.path = "/_test/health", .timeout_ms = 1000};
            e2e_http(u->port, &rq, &r);
            long status = r.status;
            e2e_resp_free(&r);
            if (status == 200)
                return u;
        }
        if (e2e_now_ms() >= deadline) {
            e2e_proc_dump_log(&u->proc, 4000);
            cr_assert_fail("testupstream not ready within %d ms", E2E_READY_TIMEOUT_MS);
        }
        e2e_sleep_ms(20);
    }
}

long e2e_upstream_count(const struct e2e_upstream *u, const char *key)
{
    char path[512];
    if (key == NULL) {
        snprintf(path, sizeof path, "/_test/count");
    } else {
        CURL *c = curl_easy_init();
        cr_assert_not_null(c);
        char *esc = curl_easy_escape(c, key, 0);
        cr_assert_not_null(esc);
        snprintf(path, sizeof path, "/_test/count?key=%s", esc);
        curl_free(esc);
        curl_easy_cleanup(c);
    }
    struct e2e_resp r;
    struct e2e_req rq = {.path = path, .timeout_ms = 3000};
    e2e_http(u->port, &rq, &r);
    cr_assert_eq(r.status, 200, "upstream %s: GET %s answered %ld (%s)", u->url, path, r.status, r.error);
    char *end = NULL;
    errno = 0;
    long v = strtol((char *)r.body, &end, 10);
    bool ok = errno == 0 && end != (char *)r.body && v >= 0;
    e2e_resp_free(&r);
    cr_assert(ok, "upstream count: malformed answer");
    return v;
}

void e2e_upstream_reset(const struct e2e_upstream *u)
{
    struct e2e_resp r;
    struct e2e_req rq = {.method = "POST", .path = "/_test/reset", .body = "", .body_len = 0, .timeout_ms = 3000};
    e2e_http(u->port, &rq, &r);
    long status = r.status;
    e2e_resp_free(&r);
    cr_assert_eq(status, 200, "upstream reset answered %ld", status);
}

char *e2e_upstream_last_headers(const struct e2e_upstream *u)
{
    struct e2e_resp r;
    struct e2e_req rq = {.path = "/_test/last-headers", .timeout_ms = 3000};
    e2e_http(u->port, &rq, &r);
    cr_assert_eq(r.status, 200, "upstream last-headers answered %ld", r.status);
    char *s = (char *)r.body;
    r.body = NULL;
    e2e_resp_free(&r);
    return s ? s : xcalloc(1, 1);
}

long e2e_upstream_wait_count(const struct e2e_upstream *u, const char *key, long n, int timeout_ms)
{
    uint64_t deadline = e2e_now_ms() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0);
    long got = 0;
    for (int guard = 0; guard < 100000; guard++) {
        got = e2e_upstream_count(u, key);
        if (got >= n || e2e_now_ms() >= deadline)
            break;
        e2e_sleep_ms(10);
    }
    return got;
}

unsigned char e2e_upstream_body_byte(uint64_t i)
{
    return test_body_byte(i);
}

size_t e2e_upstream_body_mismatch(const unsigned char *p, size_t len)
{
    for (size_t i = 0; i < len; i++)
        if (p[i] != e2e_upstream_body_byte(i))
            return i;
    return len;
}

/* ---- config templates */

struct var {
    const char *name;
    const char *value;
};

static const char *lookup(const struct var *builtin, size_t nb, const char *const *vars, const char *name, size_t nlen)
{
    for (size_t i = 0; vars != NULL && vars[i] != NULL && vars[i + 1] != NULL; i += 2)
        if (strlen(vars[i]) == nlen && strncmp(vars[i], name, nlen) == 0)
            return vars[i + 1];
    for (size_t i = 0; i < nb; i++)
        if (builtin[i].value != NULL && strlen(builtin[i].name) == nlen && strncmp(builtin[i].name, name, nlen) == 0)
            return builtin[i].value;
    return NULL;
}

static char *render(const char *tmpl, const struct var *builtin, size_t nb, const char *const *vars)
{
    size_t cap = strlen(tmpl) * 2 + 256, n = 0;
    char *out = xmalloc(cap);
    const char *p = tmpl;
    while (*p != '\0') {
        const char *open = strstr(p, "{{");
        size_t lit = open ? (size_t)(open - p) : strlen(p);
        const char *val = NULL;
        size_t vlen = 0;
        const char *next = p + lit;
        if (open != NULL) {
            const char *close = strstr(open + 2, "}}");
            cr_assert_not_null(close, "config template: unterminated {{ near \"%.20s\"", open);
            val = lookup(builtin, nb, vars, open + 2, (size_t)(close - open - 2));
            cr_assert_not_null(val, "config template: unknown placeholder {{%.*s}}", (int)(close - open - 2), open + 2);
            vlen = strlen(val);
            next = close + 2;
        }
        while (n + lit + vlen + 1 > cap) {
            cap *= 2;
            out = xrealloc(out, cap);
        }
        memcpy(out + n, p, lit);
        n += lit;
        if (val != NULL) {
            memcpy(out + n, val, vlen);
            n += vlen;
        }
        p = next;
    }
    out[n] = '\0';
    return out;
}

char *e2e_render(const char *tmpl, const char *const *vars)
{
    struct var b[] = {
        {"PG_URL", getenv("IDEMGATE_TEST_PG_URL")},
        {"REDIS_URL", getenv("IDEMGATE_TEST_REDIS_URL")},
        {"TMPDIR", st.tmpdir},
    };
    return render(tmpl, b, sizeof b / sizeof b[0], vars);
}

char *e2e_conf_pay(const struct e2e_pay_conf *c)
{
    cr_assert(c != NULL && c->idem != NULL, "e2e_conf_pay: no idempotency block");
    char block[4096];
    size_t n = 0;
    const char *p = c->idem;
    while (*p != '\0') {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        int w = snprintf(block + n, sizeof block - n, "      %.*s\n", (int)len, p);
        cr_assert(w > 0 && (size_t)w < sizeof block - n, "idempotency block too long");
        n += (size_t)w;
        p = nl ? nl + 1 : p + len;
    }
    block[n] = '\0';
    char *redis_timeout = c->redis_timeout ? xasprintf("  redis_timeout: %s\n", c->redis_timeout) : xstrdup("");
    /* clang-format off */
    char *out = xasprintf(E2E_CONF_PORTS
                          E2E_CONF_STORE("%s")
                          "%s" /* the redis_timeout line */
                          "upstreams:\n"
                          E2E_CONF_UPSTREAM("api", "%s", "%s")
                          "routes:\n"
                          "  - name: %s\n"
                          "    match:\n"
                          "      path_prefix: /v1/pay\n"
                          "    upstream: api\n"
                          "    idempotency:\n"
                          "%s" /* pay's idempotency block */
                          E2E_CONF_ROUTE("pass", "/v1/pass", "api")
                          "      key: off\n",
                          c->redis ? c->redis : "{{REDIS_URL}}", redis_timeout,
                          c->upstream_url ? c->upstream_url : "{{UPSTREAM_URL}}", c->timeout ? c->timeout : "5s",
                          c->route ? c->route : "pay", block);
    /* clang-format on */
    free(redis_timeout);
    return out;
}

/* ---- the gateway */

static bool tcp_connects(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return false;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool ok = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    close(fd);
    return ok;
}

/* One start attempt; returns 1 ready, 0 exited with "address in use" (retry), fails the test otherwise. */
static int gw_try_start(struct e2e_gw *g, const char *tmpl, const struct e2e_gw_opts *o, bool last_try)
{
    unsigned id = ++st.seq;
    /* Pick distinct ports: hold all sockets open while picking. */
    uint16_t ports[3];
    int fds[3];
    for (int i = 0; i < 3; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        cr_assert(fds[i] >= 0);
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t sl = sizeof sa;
        cr_assert(bind(fds[i], (struct sockaddr *)&sa, sizeof sa) == 0 &&
                      getsockname(fds[i], (struct sockaddr *)&sa, &sl) == 0,
                  "bind port 0: %s", strerror(errno));
        ports[i] = ntohs(sa.sin_port);
    }
    for (int i = 0; i < 3; i++)
        close(fds[i]);
    g->port = ports[0];
    g->admin_port = ports[1];
    char lp[8], ap[8], dp[8], upp[8];
    snprintf(lp, sizeof lp, "%u", (unsigned)ports[0]);
    snprintf(ap, sizeof ap, "%u", (unsigned)ports[1]);
    snprintf(dp, sizeof dp, "%u", (unsigned)ports[2]);
    snprintf(upp, sizeof upp, "%u", o->up ? (unsigned)o->up->port : 0u);
    struct var b[] = {
        {"LISTEN_PORT", lp},
        {"ADMIN_PORT", ap},
        {"DEAD_PORT", dp},
        {"PG_URL", getenv("IDEMGATE_TEST_PG_URL")},
        {"REDIS_URL", getenv("IDEMGATE_TEST_REDIS_URL")},
        {"UPSTREAM_URL", o->up ? o->up->url : NULL},
        {"UPSTREAM_PORT", o->up ? upp : NULL},
        {"TMPDIR", st.tmpdir},
    };
    g->conf_text = keep(render(tmpl, b, sizeof b / sizeof b[0], o->vars));
    g->conf_path = keep(xasprintf("%s/gw-%u.yaml", e2e_tmpdir(), id));
    write_file(g->conf_path, g->conf_text);
    g->proc.log = keep(xasprintf("%s/gw-%u.log", e2e_tmpdir(), id));
    g->proc.what = "idemgate";
    g->proc.exited = false;
    g->proc.killed = false;

    /* idemgate -c FILE, and --accept-identity-change NAME per "- name: NAME" line (routes and upstreams alike: an
     * upstream's name is no route's and changes nothing) unless the test wants the check */
    enum { NAMES_MAX = 32 };
    const char *argv[3 + 2 * NAMES_MAX + 1] = {e2e_env("IDEMGATE_BIN"), "-c", g->conf_path};
    size_t na = 3;
    for (const char *p = g->conf_text; !o->strict_identity && p && na + 2 < sizeof argv / sizeof argv[0] - 1;
         p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
        const char *name = p + strspn(p, " ");
        if (strncmp(name, "- name: ", 8) != 0)
            continue;
        name += 8;
        argv[na++] = "--accept-identity-change";
        argv[na++] = keep(xasprintf("%.*s", (int)strcspn(name, " \r\n#"), name));
    }
    argv[na] = NULL;
    static const char *const drop[] = {"IDEMGATE_POSTGRES_URL", "IDEMGATE_REDIS_URL", "IDEMGATE_ADMIN_TOKEN", NULL};
    char **envp = build_env(drop, o->env);
    g->proc.pid = spawn(argv, envp, g->proc.log, g->proc.log);
    free(envp);
    if (o->no_wait)
        return 1;

    uint64_t deadline = e2e_now_ms() + E2E_READY_TIMEOUT_MS;
    for (;;) {
        if (reap(&g->proc, false)) {
            char *log = e2e_proc_log(&g->proc);
            bool in_use = strstr(log, "in use") != NULL || strstr(log, "EADDRINUSE") != NULL;
            free(log);
            if (in_use && !last_try)
                return 0;
            e2e_proc_dump_log(&g->proc, 6000);
            cr_assert_fail("idemgate exited at start-up (exit %d) with config %s:\n%s", e2e_proc_exit_code(&g->proc),
                           g->conf_path, g->conf_text);
        }
        struct e2e_resp r;
        struct e2e_req rq = {.path = "/healthz", .timeout_ms = 1000};
        e2e_http(g->admin_port, &rq, &r);
        long status = r.status;
        e2e_resp_free(&r);
        if (status == 200 && tcp_connects(g->port))
            return 1;
        if (e2e_now_ms() >= deadline) {
            e2e_proc_dump_log(&g->proc, 6000);
            cr_assert_fail("idemgate not ready within %d ms (GET /healthz on admin port %u: last status %ld)",
                           E2E_READY_TIMEOUT_MS, (unsigned)g->admin_port, status);
        }
        e2e_sleep_ms(25);
    }
}

struct e2e_gw *e2e_gw_start(const char *tmpl, const struct e2e_gw_opts *opts)
{
    static const struct e2e_gw_opts none = {0};
    const struct e2e_gw_opts *o = opts ? opts : &none;
    cr_assert(st.ngw < E2E_MAX_GW, "harness: too many gateways");
    struct e2e_gw *g = xcalloc(1, sizeof *g);
    st.gws[st.ngw++] = g;
    keep(g);
    for (int attempt = 1; attempt <= E2E_START_TRIES; attempt++) {
        if (gw_try_start(g, tmpl, o, attempt == E2E_START_TRIES) == 1) {
            if (o->wait_ready && !o->no_wait)
                e2e_gw_wait_ready(g);
            return g;
        }
        fprintf(stderr, "e2e: gateway port taken, retrying with other ports\n");
    }
    cr_assert_fail("not reached");
    return NULL;
}

long e2e_gw_readyz(const struct e2e_gw *g)
{
    struct e2e_resp r;
    struct e2e_req rq = {.path = "/readyz", .timeout_ms = 3000};
    e2e_http(g->admin_port, &rq, &r);
    long s = r.status;
    e2e_resp_free(&r);
    return s;
}

/* Polls /readyz every 20 ms until it answers want (true) or timeout_ms passes (false); *last gets the last status. */
static bool readyz_poll(const struct e2e_gw *g, long want, int timeout_ms, long *last)
{
    uint64_t deadline = e2e_now_ms() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0);
    for (int guard = 0; guard < 100000; guard++) {
        *last = e2e_gw_readyz(g);
        if (*last == want)
            return true;
        if (e2e_now_ms() >= deadline)
            return false;
        e2e_sleep_ms(20);
    }
    return false;
}

bool e2e_gw_readyz_wait(const struct e2e_gw *g, long want, int timeout_ms)
{
    long last = 0;
    return readyz_poll(g, want, timeout_ms, &last);
}

void e2e_gw_wait_ready(const struct e2e_gw *g)
{
    long status = 0;
    bool ready = readyz_poll(g, 200, E2E_READY_TIMEOUT_MS, &status);
    if (!ready)
        e2e_proc_dump_log(&g->proc, 4000);
    cr_assert(ready, "gateway not ready (/readyz %ld) %d ms after start", status, E2E_READY_TIMEOUT_MS);
}

void e2e_gw_assert_alive(struct e2e_gw *g, const char *what)
{
    if (e2e_proc_wait(&g->proc, 0)) {
        e2e_proc_dump_log(&g->proc, 8000);
        cr_assert_fail("%s: the gateway process is gone (exit %d): see its log above", what,
                       e2e_proc_exit_code(&g->proc));
    }
    cr_assert(kill(g->proc.pid, 0) == 0, "%s: the gateway process is gone: %s", what, strerror(errno));
}

struct e2e_gw *e2e_gw_start_pay(const struct e2e_upstream *up, const struct e2e_pay_conf *c, const char *const *env)
{
    char *tmpl = e2e_conf_pay(c);
    struct e2e_gw_opts o = {.up = up, .env = env, .wait_ready = true};
    struct e2e_gw *g = e2e_gw_start(tmpl, &o);
    free(tmpl);
    return g;
}

void e2e_start(const char *conf, struct e2e_upstream **up, struct e2e_gw **gw)
{
    *up = e2e_upstream_start(NULL);
    struct e2e_gw_opts o = {.up = *up};
    *gw = e2e_gw_start(conf, &o);
}

int e2e_gw_stop(struct e2e_gw *g, int grace_ms)
{
    bool was_running = g->proc.pid > 0 && !g->proc.exited;
    e2e_proc_stop(&g->proc, SIGTERM, grace_ms);
    int code = e2e_proc_exit_code(&g->proc);
    if (was_running && asan_build() && code != 0) {
        e2e_proc_dump_log(&g->proc, 6000);
        cr_assert_fail("ASan build: idemgate must exit 0 at SIGTERM, got %d (killed=%d)", code, (int)g->proc.killed);
    }
    return code;
}

char *e2e_gw_log(const struct e2e_gw *g)
{
    return e2e_proc_log(&g->proc);
}

bool e2e_gw_log_contains(const struct e2e_gw *g, const char *needle)
{
    char *s = e2e_gw_log(g);
    bool found = strstr(s, needle) != NULL;
    free(s);
    return found;
}

bool e2e_gw_log_contains_outside_access(const struct e2e_gw *g, const char *needle)
{
    char *log = e2e_gw_log(g);
    bool found = false;
    for (char *line = log; line && *line && !found;) {
        char *nl = strchr(line, '\n');
        if (nl)
            *nl = '\0';
        found = strstr(line, needle) != NULL && strstr(line, "event=access ") == NULL;
        line = nl ? nl + 1 : NULL;
    }
    free(log);
    return found;
}

size_t e2e_gw_log_count(const struct e2e_gw *g, const char *needle)
{
    char *log = e2e_gw_log(g);
    size_t n = 0;
    for (const char *p = log; (p = strstr(p, needle)) != NULL; p += strlen(needle))
        n++;
    free(log);
    return n;
}

bool e2e_gw_log_wait(const struct e2e_gw *g, const char *needle, int timeout_ms)
{
    uint64_t deadline = e2e_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        if (e2e_gw_log_contains(g, needle))
            return true;
        if (e2e_now_ms() >= deadline)
            return false;
        e2e_sleep_ms(20);
    }
}

char *e2e_gw_access_line(const struct e2e_gw *g, const char *request_id, int timeout_ms)
{
    char needle[300];
    snprintf(needle, sizeof needle, "event=access request_id=%s ", request_id);
    uint64_t deadline = e2e_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        char *log = e2e_gw_log(g);
        const char *at = log ? strstr(log, needle) : NULL;
        if (at) {
            while (at > log && at[-1] != '\n')
                at--;
            char *line = strndup(at, strcspn(at, "\n"));
            free(log);
            return line;
        }
        free(log);
        if (e2e_now_ms() >= deadline)
            return NULL;
        e2e_sleep_ms(20);
    }
}

/* ---- HTTP client */

struct xfer {
    struct e2e_resp *out;
    struct curl_slist *hdrs;
    size_t body_cap;
    bool too_big;
    char *url;
};

static size_t on_header(char *buf, size_t size, size_t nitems, void *ud)
{
    struct xfer *x = ud;
    struct e2e_resp *r = x->out;
    size_t len = size * nitems;
    if (len >= 5 && strncmp(buf, "HTTP/", 5) == 0) { /* a new response (after 100 Continue): start over */
        e2e_hdrs_free(r->hdrs, r->nhdrs);
        r->hdrs = NULL;
        r->nhdrs = 0;
        return len;
    }
    const char *colon = memchr(buf, ':', len);
    if (colon == NULL || r->nhdrs >= E2E_MAX_HDRS)
        return len;
    size_t nl = (size_t)(colon - buf);
    const char *v = colon + 1;
    const char *end = buf + len;
    while (v < end && (*v == ' ' || *v == '\t'))
        v++;
    while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' ' || end[-1] == '\t'))
        end--;
    r->hdrs = xrealloc(r->hdrs, (r->nhdrs + 1) * sizeof *r->hdrs);
    r->hdrs[r->nhdrs].name = strndup(buf, nl);
    r->hdrs[r->nhdrs].value = strndup(v, (size_t)(end - v));
    if (r->hdrs[r->nhdrs].name == NULL || r->hdrs[r->nhdrs].value == NULL)
        abort();
    r->nhdrs++;
    return len;
}

static size_t on_body(char *buf, size_t size, size_t nmemb, void *ud)
{
    struct xfer *x = ud;
    struct e2e_resp *r = x->out;
    size_t len = size * nmemb;
    if (r->body_len + len > E2E_MAX_RESP_BODY) {
        x->too_big = true;
        return 0;
    }
    if (r->body_len + len + 1 > x->body_cap) {
        size_t cap = x->body_cap ? x->body_cap : 4096;
        while (cap < r->body_len + len + 1)
            cap *= 2;
        r->body = xrealloc(r->body, cap);
        x->body_cap = cap;
    }
    memcpy(r->body + r->body_len, buf, len);
    r->body_len += len;
    r->body[r->body_len] = '\0';
    return len;
}

static CURL *easy_for(uint16_t port, const struct e2e_req *rq, struct e2e_resp *out, struct xfer *x)
{
    memset(out, 0, sizeof *out);
    memset(x, 0, sizeof *x);
    x->out = out;
    CURL *c = curl_easy_init();
    cr_assert_not_null(c, "curl_easy_init");
    const char *method = rq->method ? rq->method : "GET";
    long timeout = rq->timeout_ms > 0 ? rq->timeout_ms : E2E_HTTP_TIMEOUT_MS;
    x->url = xasprintf("http://127.0.0.1:%u%s", (unsigned)port, rq->path ? rq->path : "/");
    curl_easy_setopt(c, CURLOPT_URL, x->url);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_PATH_AS_IS, 1L);
    curl_easy_setopt(c, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, timeout < 3000 ? timeout : 3000L);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, out->error);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, x);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, x);
    curl_easy_setopt(c, CURLOPT_PRIVATE, x);
    if (strcmp(method, "HEAD") == 0) {
        curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
    } else {
        if (strcmp(method, "GET") != 0 || rq->body != NULL)
            curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
        if (rq->body != NULL) {
            curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)rq->body_len);
            curl_easy_setopt(c, CURLOPT_POSTFIELDS, rq->body_len ? rq->body : "");
        }
    }
    for (size_t i = 0; rq->headers != NULL && rq->headers[i] != NULL; i++) {
        struct curl_slist *n = curl_slist_append(x->hdrs, rq->headers[i]);
        cr_assert_not_null(n);
        x->hdrs = n;
    }
    if (x->hdrs != NULL)
        curl_easy_setopt(c, CURLOPT_HTTPHEADER, x->hdrs);
    return c;
}

static void easy_done(CURL *c, CURLcode rc, struct xfer *x)
{
    struct e2e_resp *out = x->out;
    out->curl_code = (int)rc;
    if (rc == CURLE_OK) {
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &out->status);
    } else {
        out->status = 0;
        if (out->error[0] == '\0')
            snprintf(out->error, sizeof out->error, "%s", curl_easy_strerror(rc));
        if (x->too_big)
            snprintf(out->error, sizeof out->error, "response body over %u bytes", E2E_MAX_RESP_BODY);
    }
    curl_easy_getinfo(c, CURLINFO_TOTAL_TIME, &out->seconds);
    if (out->body == NULL)
        out->body = xcalloc(1, 1);
    curl_slist_free_all(x->hdrs);
    x->hdrs = NULL;
    free(x->url);
    x->url = NULL;
    curl_easy_cleanup(c);
}

void e2e_http(uint16_t port, const struct e2e_req *rq, struct e2e_resp *out)
{
    struct xfer x;
    CURL *c = easy_for(port, rq, out, &x);
    CURLcode rc = curl_easy_perform(c);
    easy_done(c, rc, &x);
}

void e2e_http_key(uint16_t port, const char *method, const char *path, const char *key, const char *const *extra,
                  const char *body, long timeout_ms, struct e2e_resp *out)
{
    const char *h[32];
    size_t n = 0;
    char kh[600];
    if (key != NULL) {
        int w = snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
        cr_assert(w > 0 && (size_t)w < sizeof kh, "e2e_http_key: key too long");
        h[n++] = kh;
    }
    for (size_t i = 0; extra != NULL && extra[i] != NULL; i++) {
        cr_assert(n < 31, "e2e_http_key: too many headers");
        h[n++] = extra[i];
    }
    h[n] = NULL;
    struct e2e_req rq = {.method = method,
                         .path = path,
                         .headers = h,
                         .body = body,
                         .body_len = body ? strlen(body) : 0,
                         .timeout_ms = timeout_ms};
    e2e_http(port, &rq, out);
}

void e2e_get(uint16_t port, const char *path, struct e2e_resp *out)
{
    struct e2e_req rq = {.path = path};
    e2e_http(port, &rq, out);
}

void e2e_resp_free(struct e2e_resp *r)
{
    e2e_hdrs_free(r->hdrs, r->nhdrs);
    free(r->body);
    memset(r, 0, sizeof *r);
}

const char *e2e_resp_header_nth(const struct e2e_resp *r, const char *name, size_t n)
{
    for (size_t i = 0; i < r->nhdrs; i++)
        if (strcasecmp(r->hdrs[i].name, name) == 0 && n-- == 0)
            return r->hdrs[i].value;
    return NULL;
}

const char *e2e_resp_header(const struct e2e_resp *r, const char *name)
{
    return e2e_resp_header_nth(r, name, 0);
}

size_t e2e_resp_header_count(const struct e2e_resp *r, const char *name)
{
    return e2e_hdrs_count(r->hdrs, r->nhdrs, name);
}

bool e2e_resp_is_problem(const struct e2e_resp *r, const char *name)
{
    const char *ct = e2e_resp_header(r, "Content-Type");
    if (ct == NULL || strncasecmp(ct, "application/problem+json", 24) != 0)
        return false;
    if (r->body == NULL)
        return false;
    const char *p = strstr((const char *)r->body, "\"type\"");
    if (p == NULL)
        return false;
    p += 6;
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    if (*p++ != ':')
        return false;
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    char want[256];
    snprintf(want, sizeof want, "\"urn:idemgate:problem:%s\"", name);
    return strncmp(p, want, strlen(want)) == 0;
}

void e2e_expect_problem(const struct e2e_resp *r, long status, const char *name, const char *what)
{
    cr_expect_eq(r->status, status, "%s: expected %ld %s, got %ld (%s) body: %.300s", what, status, name, r->status,
                 r->error, (const char *)r->body);
    const char *ct = e2e_resp_header(r, "Content-Type");
    cr_expect(e2e_resp_is_problem(r, name), "%s: expected problem %s, got Content-Type %s body %.300s", what, name,
              ct ? ct : "(none)", (const char *)r->body);
}

bool e2e_resp_is_replay(const struct e2e_resp *r)
{
    const char *v = e2e_resp_header(r, "Idempotent-Replayed");
    return v != NULL && strcmp(v, "true") == 0;
}

void e2e_http_parallel(uint16_t port, const struct e2e_req *rq, struct e2e_resp *out, size_t n)
{
    CURLM *m = curl_multi_init();
    cr_assert_not_null(m);
    struct xfer *xs = xcalloc(n, sizeof *xs);
    CURL **cs = xcalloc(n, sizeof *cs);
    long max_timeout = 0;
    for (size_t i = 0; i < n; i++) {
        cs[i] = easy_for(port, &rq[i], &out[i], &xs[i]);
        long t = rq[i].timeout_ms > 0 ? rq[i].timeout_ms : E2E_HTTP_TIMEOUT_MS;
        if (t > max_timeout)
            max_timeout = t;
        cr_assert(curl_multi_add_handle(m, cs[i]) == CURLM_OK);
    }
    uint64_t deadline = e2e_now_ms() + (uint64_t)max_timeout + 5000;
    int running = 1;
    size_t finished = 0;
    while (finished < n && e2e_now_ms() < deadline) {
        if (curl_multi_perform(m, &running) != CURLM_OK)
            break;
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(m, &left)) != NULL) {
            if (msg->msg != CURLMSG_DONE)
                continue;
            CURL *c = msg->easy_handle;
            CURLcode rc = msg->data.result;
            struct xfer *x = NULL;
            curl_easy_getinfo(c, CURLINFO_PRIVATE, (char **)&x);
            curl_multi_remove_handle(m, c);
            for (size_t i = 0; i < n; i++)
                if (cs[i] == c)
                    cs[i] = NULL;
            easy_done(c, rc, x);
            finished++;
        }
        if (finished < n)
            (void)curl_multi_poll(m, NULL, 0, 50, NULL);
    }
    for (size_t i = 0; i < n; i++) {
        if (cs[i] == NULL)
            continue;
        curl_multi_remove_handle(m, cs[i]);
        easy_done(cs[i], CURLE_OPERATION_TIMEDOUT, &xs[i]);
    }
    curl_multi_cleanup(m);
    free(xs);
    free(cs);
}

struct e2e_async {
    pthread_t th;
    uint16_t port;
    struct e2e_req rq;
    char *method;
    char *path;
    char **headers;
    void *body;
    struct e2e_resp resp;
};

static void *async_main(void *arg)
{
    struct e2e_async *a = arg;
    struct xfer x;
    CURL *c = easy_for(a->port, &a->rq, &a->resp, &x);
    CURLcode rc = curl_easy_perform(c);
    easy_done(c, rc, &x);
    return NULL;
}

struct e2e_async *e2e_http_async(uint16_t port, const struct e2e_req *rq)
{
    struct e2e_async *a = xcalloc(1, sizeof *a);
    a->port = port;
    a->rq = *rq;
    if (rq->method != NULL)
        a->rq.method = a->method = xstrdup(rq->method);
    if (rq->path != NULL)
        a->rq.path = a->path = xstrdup(rq->path);
    size_t nh = 0;
    while (rq->headers != NULL && rq->headers[nh] != NULL)
        nh++;
    a->headers = xcalloc(nh + 1, sizeof *a->headers);
    for (size_t i = 0; i < nh; i++)
        a->headers[i] = xstrdup(rq->headers[i]);
    a->rq.headers = (const char *const *)a->headers;
    if (rq->body != NULL) {
        a->body = xmalloc(rq->body_len);
        memcpy(a->body, rq->body, rq->body_len);
        a->rq.body = a->body;
    }
    if (a->rq.timeout_ms <= 0)
        a->rq.timeout_ms = E2E_HTTP_TIMEOUT_MS;
    int rc = pthread_create(&a->th, NULL, async_main, a);
    cr_assert_eq(rc, 0, "pthread_create: %s", strerror(rc));
    return a;
}

void e2e_http_join(struct e2e_async *a, struct e2e_resp *out)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long ms = a->rq.timeout_ms + 5000;
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    int rc = pthread_timedjoin_np(a->th, NULL, &ts);
    cr_assert_eq(rc, 0, "background request did not finish within %ld ms", ms);
    *out = a->resp;
    for (size_t i = 0; a->headers[i] != NULL; i++)
        free(a->headers[i]);
    free(a->headers);
    free(a->method);
    free(a->path);
    free(a->body);
    free(a);
}

/* ---- header lists */

size_t e2e_parse_header_lines(const char *text, struct e2e_hdr **out)
{
    size_t n = 0;
    struct e2e_hdr *h = NULL;
    const char *p = text;
    while (p != NULL && *p != '\0') {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        const char *colon = memchr(p, ':', len);
        if (colon != NULL) {
            const char *v = colon + 1;
            const char *end = p + len;
            while (v < end && (*v == ' ' || *v == '\t'))
                v++;
            while (end > v && (end[-1] == '\r' || end[-1] == ' '))
                end--;
            h = xrealloc(h, (n + 1) * sizeof *h);
            h[n].name = strndup(p, (size_t)(colon - p));
            h[n].value = strndup(v, (size_t)(end - v));
            if (h[n].name == NULL || h[n].value == NULL)
                abort();
            n++;
        }
        p = nl ? nl + 1 : NULL;
    }
    *out = h;
    return n;
}

void e2e_hdrs_free(struct e2e_hdr *h, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(h[i].name);
        free(h[i].value);
    }
    free(h);
}

const char *e2e_hdrs_get(const struct e2e_hdr *h, size_t n, const char *name)
{
    for (size_t i = 0; i < n; i++)
        if (strcasecmp(h[i].name, name) == 0)
            return h[i].value;
    return NULL;
}

size_t e2e_hdrs_count(const struct e2e_hdr *h, size_t n, const char *name)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        if (strcasecmp(h[i].name, name) == 0)
            c++;
    return c;
}

/* ---- raw TCP */

const char *e2e_raw_header(const char *blk, size_t blen, const char *name)
{
    size_t nl = strlen(name);
    for (const char *p = blk; p != NULL && p < blk + blen;) {
        const char *eol = memmem(p, (size_t)(blk + blen - p), "\r\n", 2);
        if (eol == NULL)
            break;
        if ((size_t)(eol - p) > nl && strncasecmp(p, name, nl) == 0 && p[nl] == ':')
            return p + nl + 1;
        p = eol + 2;
    }
    return NULL;
}

/* True when buf holds one complete final response (1xx interim responses skipped). */
static bool raw_complete(const char *buf, size_t len, int *status)
{
    size_t off = 0;
    for (int guard = 0; guard < 16; guard++) {
        if (len - off < 12 || strncmp(buf + off, "HTTP/1.", 7) != 0)
            return false;
        const char *end = memmem(buf + off, len - off, "\r\n\r\n", 4);
        if (end == NULL)
            return false;
        int code = (int)strtol(buf + off + 9, NULL, 10);
        size_t hdr_end = (size_t)(end - buf) + 4;
        if (code >= 100 && code < 200) {
            off = hdr_end;
            continue;
        }
        *status = code;
        if (code == 204 || code == 304)
            return true;
        const char *cl = e2e_raw_header(buf + off, hdr_end - off, "Content-Length");
        if (cl != NULL) {
            unsigned long long n = strtoull(cl, NULL, 10);
            return len - hdr_end >= n;
        }
        const char *te = e2e_raw_header(buf + off, hdr_end - off, "Transfer-Encoding");
        if (te != NULL && strstr(te, "chunked") != NULL)
            return len >= hdr_end + 5 && memmem(buf + hdr_end, len - hdr_end, "0\r\n\r\n", 5) != NULL;
        return false; /* read until the peer closes */
    }
    return false;
}

void e2e_raw_send_some(int fd, const void *data, size_t len, size_t *sent)
{
    ssize_t w = send(fd, (const char *)data + *sent, len - *sent, MSG_NOSIGNAL);
    if (w > 0)
        *sent += (size_t)w;
    else if (w < 0 && errno != EAGAIN && errno != EINTR)
        *sent = len; /* the peer stopped reading: go on to read what it said */
}

void e2e_raw_send(uint16_t port, const void *data, size_t len, int timeout_ms, struct e2e_raw *out)
{
    memset(out, 0, sizeof *out);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0, "raw connect to %u: %s", (unsigned)port,
              strerror(errno));
    (void)fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    uint64_t deadline = e2e_now_ms() + (uint64_t)timeout_ms;
    size_t sent = 0, cap = 65536;
    char *buf = xmalloc(cap + 1);
    size_t got = 0;
    bool done = false;
    while (!done) {
        uint64_t now = e2e_now_ms();
        if (now >= deadline) {
            out->timed_out = true;
            break;
        }
        struct pollfd pf = {.fd = fd, .events = POLLIN | (sent < len ? POLLOUT : 0)};
        int pr = poll(&pf, 1, (int)(deadline - now));
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr <= 0)
            continue;
        if ((pf.revents & POLLOUT) && sent < len)
            e2e_raw_send_some(fd, data, len, &sent);
        if (pf.revents & (POLLIN | POLLHUP | POLLERR)) {
            if (got == cap) {
                if (cap >= E2E_MAX_RESP_BODY)
                    break;
                cap *= 2;
                buf = xrealloc(buf, cap + 1);
            }
            ssize_t r = recv(fd, buf + got, cap - got, 0);
            if (r > 0) {
                got += (size_t)r;
                buf[got] = '\0';
                if (raw_complete(buf, got, &out->status))
                    done = true;
            } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
                out->closed = true;
                done = true;
            }
        }
    }
    close(fd);
    buf[got] = '\0';
    out->data = buf;
    out->len = got;
    if (out->status == 0 && got >= 12 && strncmp(buf, "HTTP/1.", 7) == 0)
        out->status = (int)strtol(buf + 9, NULL, 10);
}

/* ---- services */

int e2e_services(const char *cmd)
{
    const char *script = getenv("IDEMGATE_SERVICES_SH");
    char *fallback = NULL;
    if (script == NULL || *script == '\0') {
        fallback = xasprintf("%s/scripts/services.sh", e2e_env("IDEMGATE_SRC_DIR"));
        script = fallback;
    }
    const char *argv[] = {"/bin/bash", script, cmd, e2e_env("IDEMGATE_TEST_SERVICES_DIR"), NULL};
    char *err = NULL;
    int code = e2e_run(argv, NULL, 60000, NULL, &err);
    if (code != 0)
        fprintf(stderr, "e2e: services.sh %s exited %d: %s\n", cmd, code, err);
    free(err);
    free(fallback);
    return code;
}

/* ---- small helpers */

void e2e_mkkey(char *buf, size_t n, const char *tag)
{
    unsigned long long r = 0;
    cr_assert(getrandom(&r, sizeof r, 0) == (ssize_t)sizeof r, "getrandom: %s", strerror(errno));
    snprintf(buf, n, "%s-%d-%016llx", tag, (int)getpid(), r);
}

double e2e_metric_value(const char *text, const char *name, const char *const *labels)
{
    double best = -1;
    size_t nl = strlen(name);
    for (const char *line = text; line != NULL && *line != '\0';) {
        const char *eol = strchr(line, '\n');
        size_t len = eol ? (size_t)(eol - line) : strlen(line);
        if (len > nl && strncmp(line, name, nl) == 0 && (line[nl] == '{' || line[nl] == ' ')) {
            const char *close = line[nl] == '{' ? memchr(line, '}', len) : line + nl;
            bool all = close != NULL;
            for (size_t i = 0; all && labels[i] != NULL; i++) {
                const char *hit = strstr(line, labels[i]);
                all = hit != NULL && hit < close;
            }
            if (all) {
                double v = strtod(close + 1, NULL);
                if (v > best)
                    best = v;
            }
        }
        line = eol ? eol + 1 : NULL;
    }
    return best;
}

/* ---- pipeline room: SQL through psql */

char *e2e_psql(const char *sql)
{
    const char *url = e2e_env("IDEMGATE_TEST_PG_ADMIN_URL");
    const char *const argv[] = {"/usr/bin/psql",   "-X", "-q", "-A", "-t", "-v",
                                "ON_ERROR_STOP=1", "-d", url,  "-c", sql,  NULL};
    char *out = NULL, *err = NULL;
    int rc = e2e_run(argv, NULL, 20000, &out, &err);
    cr_assert_eq(rc, 0, "psql %s: %s", sql, err ? err : "");
    free(err);
    size_t n = strlen(out);
    while (n > 0 && (out[n - 1] == '\n' || out[n - 1] == '\r'))
        out[--n] = '\0';
    return out;
}

long e2e_psql_long(const char *sql)
{
    char *s = e2e_psql(sql);
    char *end = NULL;
    long v = strtol(s, &end, 10);
    cr_assert(end != s, "psql %s: not a number: '%s'", sql, s);
    free(s);
    return v;
}

/* ---- services of a test's own (wt-chaos) */

int e2e_services_in(const char *dir, const char *cmd, const char *arg)
{
    const char *script = getenv("IDEMGATE_SERVICES_SH");
    char *fallback = NULL;
    if (script == NULL || *script == '\0') {
        fallback = xasprintf("%s/scripts/services.sh", e2e_env("IDEMGATE_SRC_DIR"));
        script = fallback;
    }
    const char *argv[] = {"/bin/bash", script, cmd, dir, arg, NULL};
    char *err = NULL;
    int code = e2e_run(argv, NULL, 90000, NULL, &err);
    if (code != 0)
        fprintf(stderr, "e2e: services.sh %s %s exited %d: %s\n", cmd, dir, code, err ? err : "");
    free(err);
    free(fallback);
    return code;
}

char *e2e_services_env(const char *dir, const char *name)
{
    char *path = xasprintf("%s/env", dir);
    FILE *f = fopen(path, "r");
    free(path);
    if (f == NULL)
        return NULL;
    char line[2048], *val = NULL;
    size_t nl = strlen(name);
    while (val == NULL && fgets(line, sizeof line, f) != NULL) {
        line[strcspn(line, "\r\n")] = '\0';
        const char *p = strncmp(line, "export ", 7) == 0 ? line + 7 : line;
        if (strncmp(p, name, nl) != 0 || p[nl] != '=')
            continue;
        p += nl + 1;
        size_t vl = strlen(p);
        if (vl >= 2 && p[0] == '\'' && p[vl - 1] == '\'') {
            p++;
            vl -= 2;
        }
        val = strndup(p, vl);
    }
    fclose(f);
    return val;
}

/* ---- replay cache tests (cache_test, shed_test): shared helpers */

static bool same_answer_skips(const char *name)
{
    return strcasecmp(name, "Date") == 0 || strcasecmp(name, "Idempotent-Replayed") == 0 ||
           strcasecmp(name, "X-Request-Id") == 0; /* each answer carries its own request's id */
}

void e2e_expect_same_answer(const struct e2e_resp *orig, const struct e2e_resp *rep, const char *what)
{
    cr_expect_eq(rep->status, orig->status, "%s: replay status %ld, original %ld", what, rep->status, orig->status);
    size_t i = 0, j = 0;
    for (int guard = 0; guard < 1024; guard++) {
        while (i < orig->nhdrs && same_answer_skips(orig->hdrs[i].name))
            i++;
        while (j < rep->nhdrs && same_answer_skips(rep->hdrs[j].name))
            j++;
        if (i >= orig->nhdrs || j >= rep->nhdrs)
            break;
        cr_expect(strcmp(orig->hdrs[i].name, rep->hdrs[j].name) == 0 &&
                      strcmp(orig->hdrs[i].value, rep->hdrs[j].value) == 0,
                  "%s: header #%zu differs: original \"%s: %s\", replay \"%s: %s\"", what, i, orig->hdrs[i].name,
                  orig->hdrs[i].value, rep->hdrs[j].name, rep->hdrs[j].value);
        i++;
        j++;
    }
    cr_expect(i >= orig->nhdrs && j >= rep->nhdrs, "%s: header lists differ in length (original %zu, replay %zu)", what,
              orig->nhdrs, rep->nhdrs);
    cr_expect_eq(rep->body_len, orig->body_len, "%s: replay body %zu bytes, original %zu", what, rep->body_len,
                 orig->body_len);
    cr_expect(rep->body_len == orig->body_len && memcmp(rep->body, orig->body, rep->body_len) == 0,
              "%s: replay body differs from the original", what);
}

/* ---- engine matrix (Citus room): IDEMGATE_TEST_ENGINE=citus runs a test against the Citus cluster that
 * `scripts/services.sh citus-start` wrote (IDEMGATE_TEST_CITUS_* in its env file, which scripts/test.sh exports
 * next to the plain services' variables): the test's Postgres, Redis and services directory become the
 * cluster's, and every gateway it starts gets IDEMGATE_STORE_DISTRIBUTED=citus (store.distributed: citus). */

bool e2e_engine_citus(void)
{
    const char *e = getenv("IDEMGATE_TEST_ENGINE");
    return e != NULL && strcmp(e, "citus") == 0;
}

void e2e_engine_apply(void)
{
    const char *e = getenv("IDEMGATE_TEST_ENGINE");
    if (e == NULL || *e == '\0' || strcmp(e, "postgres") == 0)
        return;
    cr_assert(strcmp(e, "citus") == 0, "IDEMGATE_TEST_ENGINE=%s: postgres or citus", e);
    static const char *const map[][2] = {
        {"IDEMGATE_TEST_CITUS_PG_URL", "IDEMGATE_TEST_PG_URL"},
        {"IDEMGATE_TEST_CITUS_PG_ADMIN_URL", "IDEMGATE_TEST_PG_ADMIN_URL"},
        {"IDEMGATE_TEST_CITUS_REDIS_URL", "IDEMGATE_TEST_REDIS_URL"},
        {"IDEMGATE_TEST_CITUS_SERVICES_DIR", "IDEMGATE_TEST_SERVICES_DIR"},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        const char *v = e2e_env(map[i][0]); /* fails the test: no cluster, no run (never a silent plain run) */
        cr_assert(setenv(map[i][1], v, 1) == 0, "setenv %s", map[i][1]);
    }
    cr_assert(setenv("IDEMGATE_STORE_DISTRIBUTED", "citus", 1) == 0, "setenv IDEMGATE_STORE_DISTRIBUTED");
}

/* ---- a Redis of the test's own */

/* name's full path from PATH (e2e_run executes a path, not a name), into out. */
const char *e2e_in_path(const char *name, char *out, size_t n)
{
    const char *p = getenv("PATH");
    while (p != NULL && *p) {
        size_t l = strcspn(p, ":");
        snprintf(out, n, "%.*s/%s", (int)l, p, name);
        if (access(out, X_OK) == 0)
            return out;
        p += l + (p[l] == ':');
    }
    cr_assert_fail("%s is not on PATH", name);
    return NULL;
}

/* Starts redis-server on a unix socket only (no TCP port) in the test's temp dir; returns its pid once it answers
 * PING (bounded), the socket path in path. */
pid_t e2e_redis_unix_start(char *path, size_t n)
{
    snprintf(path, n, "%s/redis.sock", e2e_tmpdir());
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, STDOUT_FILENO);
        execlp("redis-server", "redis-server", "--port", "0", "--unixsocket", path, "--unixsocketperm", "700", "--save",
               "", "--appendonly", "no", "--dir", e2e_tmpdir(), (char *)NULL);
        _exit(127);
    }
    uint64_t deadline = e2e_now_ms() + E2E_READY_TIMEOUT_MS;
    for (;;) {
        char *out = NULL;
        char cli[512];
        const char *argv[] = {e2e_in_path("redis-cli", cli, sizeof cli), "-s", path, "PING", NULL};
        if (access(path, F_OK) == 0 && e2e_run(argv, NULL, 5000, &out, NULL) == 0 && out != NULL &&
            strstr(out, "PONG") != NULL) {
            free(out);
            return pid;
        }
        free(out);
        cr_assert(e2e_now_ms() < deadline, "redis-server on %s did not answer PING", path);
        e2e_sleep_ms(50);
    }
}

/* Starts argv (a long-running helper, e.g. haproxy) with its output in the temp dir; teardown stops it. */
struct e2e_proc *e2e_proc_start(const char *const *argv, const char *what)
{
    struct e2e_proc *p = keep(xcalloc(1, sizeof *p));
    unsigned id = ++st.seq;
    p->log = keep(xasprintf("%s/proc-%u.log", e2e_tmpdir(), id));
    p->what = what;
    char **envp = build_env(NULL, NULL);
    p->pid = spawn(argv, envp, p->log, p->log);
    free(envp);
    register_proc(p);
    return p;
}

char *e2e_bearer_hs256(const char *hdr, const char *payload, const char *secret)
{
    char h[512], p[2048], sig[128], msg[2600];
    cr_assert(strlen(hdr) <= 360 && strlen(payload) <= 1500, "token parts too long for e2e_bearer_hs256");
    test_b64url((const unsigned char *)hdr, strlen(hdr), h);
    test_b64url((const unsigned char *)payload, strlen(payload), p);
    snprintf(msg, sizeof msg, "%s.%s", h, p);
    unsigned char mac[EVP_MAX_MD_SIZE];
    unsigned int ml = 0;
    HMAC(EVP_sha256(), secret, (int)strlen(secret), (const unsigned char *)msg, strlen(msg), mac, &ml);
    test_b64url(mac, ml, sig);
    char *out = malloc(3000);
    cr_assert_not_null(out);
    snprintf(out, 3000, "Authorization: Bearer %s.%s", msg, sig);
    return out;
}

/* ---- a gateway with a shifted wall clock */

const char *const *e2e_clock_env(long shift_ms)
{
    static char preload[1024], shift[64], asan[1024];
    static const char *env[4];
    if (shift_ms == 0)
        return NULL;
    snprintf(preload, sizeof preload, "LD_PRELOAD=%s", e2e_env("IDEMGATE_TEST_CLOCKSHIFT"));
    snprintf(shift, sizeof shift, "IDEMGATE_CLOCK_SHIFT_MS=%ld", shift_ms);
    size_t n = 0;
    env[n++] = preload;
    env[n++] = shift;
    const char *ao = getenv("ASAN_OPTIONS");
    if (ao != NULL) { /* the shim comes before the ASan runtime in the library list */
        snprintf(asan, sizeof asan, "ASAN_OPTIONS=%s:verify_asan_link_order=0", ao);
        env[n++] = asan;
    }
    env[n] = NULL;
    return env;
}
