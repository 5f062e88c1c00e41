/* util.c - the chaos checker's basics: allocation, clocks, logging, child processes, ports and bounded HTTP. */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "chaos.h"

struct ch_state ch;

const char *const ch_route_name[2] = {"pay", "book"};
const char *const ch_route_path[2] = {"/v1/pay/charge", "/v1/book/order"};
const char *const ch_mode_name[M__N] = {"normal", "slow",      "slow_timeout", "close",
                                        "reset",  "first_503", "created",      "business_400"};

void *ch_xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL) {
        fputs("chaos: out of memory\n", stderr);
        abort();
    }
    return p;
}

void *ch_xcalloc(size_t n, size_t sz)
{
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (p == NULL) {
        fputs("chaos: out of memory\n", stderr);
        abort();
    }
    return p;
}

void *ch_xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (q == NULL) {
        fputs("chaos: out of memory\n", stderr);
        abort();
    }
    return q;
}

uint64_t ch_mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

uint64_t ch_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

uint64_t ch_splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t ch_rnd_range(uint64_t *s, uint64_t lo, uint64_t hi) /* [lo, hi] */
{
    return hi <= lo ? lo : lo + ch_splitmix64(s) % (hi - lo + 1);
}

bool ch_parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    if (s == NULL || *s == '\0' || !isdigit((unsigned char)*s))
        return false;
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v > max)
        return false;
    *out = v;
    return true;
}
/* ------------------------------------------------------------------ logging */

double ch_rel_s(uint64_t ms)
{
    return ms >= ch.t0 ? (double)(ms - ch.t0) / 1000.0 : -(double)(ch.t0 - ms) / 1000.0;
}

void ch_iso_at(uint64_t mono, char *out, size_t n)
{
    uint64_t w = ch.wall0 + (mono >= ch.t0 ? mono - ch.t0 : 0);
    time_t s = (time_t)(w / 1000);
    struct tm tm;
    gmtime_r(&s, &tm);
    snprintf(out, n, "%04d-%02d-%02dT%02d:%02d:%02d.%03uZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
             tm.tm_min, tm.tm_sec, (unsigned)(w % 1000));
}

void ch_log(const char *fmt, ...)
{
    char ts[80];
    uint64_t now = ch_mono_ms();
    ch_iso_at(now, ts, sizeof ts);
    pthread_mutex_lock(&ch.log_mu);
    printf("chaos: +%07.3f %s ", ch_rel_s(now), ts);
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
    fflush(stdout);
    pthread_mutex_unlock(&ch.log_mu);
}

void ch_out(const char *fmt, ...)
{
    pthread_mutex_lock(&ch.log_mu);
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fflush(stdout);
    pthread_mutex_unlock(&ch.log_mu);
}

/* Sleeps ms in slices, returning early when the run aborts. */
void ch_nap(uint64_t ms)
{
    uint64_t end = ch_mono_ms() + ms;
    while (!atomic_load(&ch.abort)) {
        uint64_t now = ch_mono_ms();
        if (now >= end)
            return;
        uint64_t d = end - now > 50 ? 50 : end - now;
        struct timespec ts = {(time_t)(d / 1000), (long)(d % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
}

/* ------------------------------------------------------------------ child processes */

static void pid_register(pid_t p)
{
    pthread_mutex_lock(&ch.pid_mu);
    for (size_t i = 0; i < sizeof ch.pids / sizeof ch.pids[0]; i++)
        if (ch.pids[i] == 0) {
            ch.pids[i] = p;
            break;
        }
    pthread_mutex_unlock(&ch.pid_mu);
}

static void pid_forget(pid_t p)
{
    pthread_mutex_lock(&ch.pid_mu);
    for (size_t i = 0; i < sizeof ch.pids / sizeof ch.pids[0]; i++)
        if (ch.pids[i] == p)
            ch.pids[i] = 0;
    pthread_mutex_unlock(&ch.pid_mu);
}

void ch_on_fatal_signal(int sig)
{
    /* async-signal-safe only: wake what a pause stopped, undo an SQL fault, kill what we started, leave */
    for (size_t i = 0; i < CH_MAX_PAUSED; i++)
        if (ch.paused[i] > 0)
            kill(ch.paused[i], SIGCONT);
    if (ch.sql_fault_active && ch.undo_argv[0] != NULL) {
        pid_t p = fork();
        if (p == 0) {
            execv(ch.undo_argv[0], ch.undo_argv);
            _exit(127);
        }
        for (int i = 0; p > 0 && i < 100; i++) { /* at most 5 s */
            if (waitpid(p, NULL, WNOHANG) == p)
                break;
            struct timespec ts = {0, 50 * 1000000L};
            nanosleep(&ts, NULL);
        }
    }
    for (size_t i = 0; i < sizeof ch.pids / sizeof ch.pids[0]; i++)
        if (ch.pids[i] > 0)
            kill(ch.pids[i], SIGKILL);
    static const char msg[] = "chaos: interrupted: children killed\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
    _exit(128 + sig);
}

/* Forks and execs argv with stdout+stderr appended to log_path. The child dies with the thread that forked it
 * (PR_SET_PDEATHSIG), so an abrupt end of this process never leaves a gateway behind. Returns the pid or -1. */
pid_t ch_spawn(char *const argv[], const char *log_path)
{
    return ch_spawn_env(argv, log_path, NULL);
}

pid_t ch_spawn_env(char *const argv[], const char *log_path, char *const extra_env[])
{
    extern char **environ;
    size_t ne = 0, nx = 0;
    while (environ[ne] != NULL)
        ne++;
    while (extra_env != NULL && extra_env[nx] != NULL)
        nx++;
    char **envp = ch_xcalloc(ne + nx + 1, sizeof *envp);
    memcpy(envp, environ, ne * sizeof *envp);
    if (nx > 0)
        memcpy(envp + ne, extra_env, nx * sizeof *envp);
    pid_t parent = getpid();
    pid_t p = fork();
    if (p < 0) {
        free(envp);
        return -1;
    }
    if (p == 0) {
        (void)prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);
        int in = open("/dev/null", O_RDONLY);
        int lf = open(log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (in < 0 || lf < 0)
            _exit(127);
        dup2(in, 0);
        dup2(lf, 1);
        dup2(lf, 2);
        for (int fd = 3; fd < 1024; fd++)
            close(fd);
        execve(argv[0], argv, envp);
        _exit(127);
    }
    free(envp);
    pid_register(p);
    return p;
}

/* Waits up to timeout_ms for pid; returns true with *status when it exited (and was reaped). */
bool ch_proc_wait(pid_t pid, int timeout_ms, int *status)
{
    uint64_t end = ch_mono_ms() + (uint64_t)timeout_ms;
    for (;;) {
        int st = 0;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid || (r < 0 && errno == ECHILD)) {
            if (status)
                *status = r == pid ? st : 0;
            pid_forget(pid);
            return true;
        }
        if (ch_mono_ms() >= end)
            return false;
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

/* sig, then SIGKILL after grace_ms; always reaps. Returns the wait status. */
int ch_proc_stop(pid_t pid, int sig, int grace_ms)
{
    int st = 0;
    if (pid <= 0)
        return 0;
    kill(pid, sig);
    if (ch_proc_wait(pid, grace_ms, &st))
        return st;
    kill(pid, SIGKILL);
    if (!ch_proc_wait(pid, 5000, &st))
        ch_log("event=reap_failed pid=%ld", (long)pid);
    return st;
}

void ch_describe_status(int st, char *buf, size_t n)
{
    if (WIFEXITED(st))
        snprintf(buf, n, "exit=%d", WEXITSTATUS(st));
    else if (WIFSIGNALED(st))
        snprintf(buf, n, "signal=%d", WTERMSIG(st));
    else
        snprintf(buf, n, "status=%d", st);
}

/* Runs `bash services.sh CMD DIR [ARG]` bounded in time; returns its exit code (-1 on timeout/spawn failure). */
int ch_services(const char *cmd, const char *arg)
{
    char log[PATH_MAX];
    snprintf(log, sizeof log, "%s/services-cmd.log", ch.dir);
    char *argv[] = {
        (char *)"/bin/bash", (char *)ch.o.services_sh, (char *)cmd, (char *)ch.o.services_dir, (char *)arg, NULL};
    pid_t p = ch_spawn(argv, log);
    if (p < 0)
        return -1;
    int st = 0;
    if (!ch_proc_wait(p, CH_CMD_TIMEOUT_MS, &st)) {
        ch_log("event=services_timeout cmd=%s", cmd);
        ch_proc_stop(p, SIGKILL, 1000);
        return -1;
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* ------------------------------------------------------------------ ports */

static bool port_bindable(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return false;
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

/* A free loopback port below the ephemeral range (so no outgoing connection takes it while a gateway restarts). */
uint16_t ch_pick_port(uint64_t *rng)
{
    static uint16_t taken[32];
    static size_t ntaken;
    for (int i = 0; i < 500; i++) {
        uint16_t p = (uint16_t)ch_rnd_range(rng, 20000, 31999);
        bool dup = false;
        for (size_t j = 0; j < ntaken; j++)
            dup = dup || taken[j] == p;
        if (dup || !port_bindable(p))
            continue;
        if (ntaken < sizeof taken / sizeof taken[0])
            taken[ntaken++] = p;
        return p;
    }
    return 0;
}

/* ------------------------------------------------------------------ HTTP (libcurl easy, bounded) */

struct body_sink {
    char *buf;
    size_t len, cap;
    bool trunc;
};

static size_t on_body(char *p, size_t sz, size_t n, void *arg)
{
    struct body_sink *b = arg;
    size_t k = sz * n;
    size_t room = b->cap - 1 - b->len;
    if (k > room) {
        b->trunc = true;
        k = room;
    }
    memcpy(b->buf + b->len, p, k);
    b->len += k;
    b->buf[b->len] = '\0';
    return sz * n;
}

static bool hdr_is(const char *line, size_t n, const char *name, const char **val, size_t *vlen)
{
    size_t nl = strlen(name);
    if (n <= nl || strncasecmp(line, name, nl) != 0 || line[nl] != ':')
        return false;
    const char *v = line + nl + 1;
    const char *e = line + n;
    while (v < e && (*v == ' ' || *v == '\t'))
        v++;
    while (e > v && (e[-1] == '\r' || e[-1] == '\n' || e[-1] == ' '))
        e--;
    *val = v;
    *vlen = (size_t)(e - v);
    return true;
}

static size_t on_header(char *p, size_t sz, size_t n, void *arg)
{
    struct http_res *r = arg;
    size_t k = sz * n;
    const char *v;
    size_t vl;
    if (k >= 5 && strncmp(p, "HTTP/", 5) == 0) { /* a new response (after 1xx): forget the previous headers */
        r->ctype[0] = r->exec[0] = '\0';
        r->replayed = false;
        r->retry_after = 0;
    } else if (hdr_is(p, k, "Content-Type", &v, &vl)) {
        snprintf(r->ctype, sizeof r->ctype, "%.*s", (int)vl, v);
    } else if (hdr_is(p, k, "X-Upstream-Exec", &v, &vl)) {
        snprintf(r->exec, sizeof r->exec, "%.*s", (int)vl, v);
    } else if (hdr_is(p, k, "Idempotent-Replayed", &v, &vl)) {
        r->replayed = vl == 4 && strncasecmp(v, "true", 4) == 0;
    } else if (hdr_is(p, k, "Retry-After", &v, &vl)) {
        char t[16];
        snprintf(t, sizeof t, "%.*s", (int)vl, v);
        uint64_t s = 0;
        r->retry_after = ch_parse_u64(t, 3600, &s) ? (long)s : 0;
    }
    return k;
}

/* One request with fresh connection (so no silent resend by libcurl hides an attempt). method NULL: GET. */
void ch_http_do(CURL *c, uint16_t port, const char *method, const char *path, struct curl_slist *hdrs, const char *body,
                size_t blen, long timeout_ms, char *buf, size_t bufcap, bool fresh, struct http_res *r)
{
    char url[512];
    snprintf(url, sizeof url, "http://127.0.0.1:%u%s", (unsigned)port, path);
    memset(r, 0, sizeof *r);
    struct body_sink sink = {.buf = buf, .cap = bufcap};
    buf[0] = '\0';
    curl_easy_reset(c);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_PROXY, "");
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, timeout_ms < 1000 ? timeout_ms : 1000L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(c, CURLOPT_FRESH_CONNECT, fresh ? 1L : 0L);
    curl_easy_setopt(c, CURLOPT_FORBID_REUSE, fresh ? 1L : 0L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &sink);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, r->err);
    if (hdrs)
        curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdrs);
    if (method != NULL) {
        curl_easy_setopt(c, CURLOPT_POST, 1L);
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)blen);
        if (strcmp(method, "POST") != 0)
            curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    }
    r->cc = curl_easy_perform(c);
    if (r->cc == CURLE_OK)
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
    r->body = buf;
    r->len = sink.len;
    r->trunc = sink.trunc;
}

bool ch_http_get_ok(CURL *c, uint16_t port, const char *path, long timeout_ms, char *buf, size_t cap)
{
    struct http_res r;
    ch_http_do(c, port, NULL, path, NULL, NULL, 0, timeout_ms, buf, cap, false, &r);
    return r.cc == CURLE_OK && r.status == 200;
}

bool ch_env_value(const char *name, char *out, size_t n)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/env", ch.o.services_dir);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return false;
    size_t nl = strlen(name);
    bool found = false;
    char line[2048];
    while (!found && fgets(line, sizeof line, f) != NULL) {
        line[strcspn(line, "\r\n")] = '\0';
        const char *p = line;
        if (strncmp(p, "export ", 7) == 0)
            p += 7;
        if (strncmp(p, name, nl) == 0 && p[nl] == '=') {
            const char *v = p + nl + 1;
            size_t vl = strlen(v);
            if (vl >= 2 && v[0] == '\'' && v[vl - 1] == '\'') { /* services.sh quotes values with ? and & */
                v++;
                vl -= 2;
            }
            snprintf(out, n, "%.*s", (int)vl, v);
            found = true;
        }
    }
    fclose(f);
    return found;
}
