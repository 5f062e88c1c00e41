/* chaos.c - the chaos checker: gateways, a test upstream behind a kill switch, retrying clients and a fault
 * schedule (gateway SIGKILL, Postgres crash, Redis stop/flush, upstream down), then checks at-most-once execution,
 * identical replays, tenant isolation and settled records against the upstream's counts and Postgres itself. */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>
#include <libpq-fe.h>

/*
 * How it works (see also tests/chaos/run.sh):
 *
 *   clients (W threads) ──► idemgate g0 / g1 ──► gate (kill switch, a thread here) ──► testupstream
 *                                 │
 *                        Postgres + Redis (scripts/services.sh)
 *
 * The upstream that the gateways see is the gate: a byte relay in this process. "Upstream down" closes the gate's
 * listener (connections refused) and resets every relayed connection (an upstream crash as the gateways see it),
 * while testupstream itself keeps running and so keeps its per-key execution counts, which are the ground truth
 * of the at-most-once check. Gateways are SIGKILLed and restarted on the same ports; Postgres is crashed with
 * `services.sh pg-stop immediate` and started again; Redis is stopped/started and flushed. The fault schedule runs
 * in one thread, one fault at a time (sometimes a gateway kill inside a Postgres or upstream outage), each logged
 * with its time. Every client retries like a real one and records what each attempt saw; the checks compare that
 * with the upstream's counts and with the idemgate_keys table, after a quiet period longer than the lease.
 *
 * Two routes: "pay" (on_unknown: retry) and "book" (on_unknown: reject), lease 2s, upstream timeout 3s (longer
 * than the lease, so a slow answer needs the owner to renew its lease), release_statuses [503]. Requests ask the
 * upstream (on their first attempt only, as a transient failure would) to be slow (longer than the lease), slower
 * than the timeout, to close or reset after executing, or to answer 503 (pay only); some ask for a 201 or a 400
 * business answer on every attempt. 8% of the keys are shared by the two tenants of a worker pair (book route):
 * each tenant must get its own execution and its own answer. A third of the clients give up on an attempt after
 * 1.2s (shorter than the slow answers), the others wait 9s.
 *
 * Checks (each prints its violations with the key, the client's attempts, the faults around them and the
 * gateways' notable log lines):
 *   run               traffic happened, every fault kind was injected, no gateway died on its own
 *   at-most-once      book: at most one execution per tenant and key, ever. pay: a key executes again only after
 *                     evidence that the protocol allows it: the gateway answered an unknown outcome (504,
 *                     502 upstream-no-response), the upstream answered 503 (released), the first attempt asked for
 *                     a timeout/close/reset/503, or a gateway kill, Postgres crash or upstream outage overlapped the
 *                     request (an orphaned or unrenewable claim becomes unknown after its lease). Never Redis.
 *   same-answer       a key whose client got a 2xx/4xx from an execution replays the same status, body and
 *                     X-Upstream-Exec with Idempotent-Replayed: true; its record exists; answers whose record is not
 *                     completed (SPEC 4: completion failed) are at most the completion_failed events logged
 *   tenant-isolation  every upstream answer carries the body of the client that got it; scope hashes are one per
 *                     tenant and differ between tenants
 *   records-settled   after the quiet period no record is in flight with a live lease, no release status is
 *                     stored, no executed key lost its record without a release, replays execute nothing
 *
 * The gateways' Postgres URL asks for synchronous_commit=on: the throwaway cluster runs with it off, and an
 * immediate (crash) shutdown then loses recently committed claims - no gateway can keep a promise its authority
 * forgot (--pg-async shows it).
 */

#define CH_MAX_WORKERS    256
#define CH_MAX_INST       2
#define CH_MAX_USERS      400000 /* requests kept for the checks, over all workers */
#define CH_BODY_CAP       (64 * 1024)
#define CH_EV_CAP         360
#define CH_MAX_ATTEMPTS   16
#define CH_REQ_BUDGET_MS  20000 /* one request, all its attempts */
#define CH_DRAIN_MS       12000 /* after the traffic window, requests in progress finish within this */
#define CH_PATIENT_MS     9000  /* per-attempt timeout of patient clients (> upstream timeout + one lease) */
#define CH_HASTY_MS       1200  /* per-attempt timeout of hasty clients (shorter than slow answers) */
#define CH_GW_READY_MS    15000
#define CH_CMD_TIMEOUT_MS 45000
#define CH_MAX_WINDOWS    4096
#define CH_GATE_MAX       2048
#define CH_GATE_BUF       16384
#define CH_REPLAY_THREADS 8
#define CH_REPORT_MAX     8 /* detailed reports per check */
#define CH_LOG_LINES_MAX  24

/* ------------------------------------------------------------------ basics */

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL) {
        fputs("chaos: out of memory\n", stderr);
        abort();
    }
    return p;
}

static void *xcalloc(size_t n, size_t sz)
{
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (p == NULL) {
        fputs("chaos: out of memory\n", stderr);
        abort();
    }
    return p;
}

static void *xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (q == NULL) {
        fputs("chaos: out of memory\n", stderr);
        abort();
    }
    return q;
}

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static uint64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rnd_range(uint64_t *s, uint64_t lo, uint64_t hi) /* [lo, hi] */
{
    return hi <= lo ? lo : lo + splitmix64(s) % (hi - lo + 1);
}

static bool parse_u64(const char *s, uint64_t max, uint64_t *out)
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

/* ------------------------------------------------------------------ run state */

enum fkind { F_GW_KILL, F_PG_RESTART, F_REDIS_RESTART, F_REDIS_FLUSH, F_UPSTREAM_DOWN, F__N };
static const char *const fkind_name[F__N] = {"gateway_kill", "postgres_restart", "redis_restart", "redis_flush",
                                             "upstream_down"};

struct window { /* a disruptive fault, for the "could this have made an outcome unknown" question */
    uint64_t begin, end;
    enum fkind kind;
    int inst;
};

struct inst {
    int idx;
    uint16_t port, admin_port;
    char conf[PATH_MAX];
    char log[PATH_MAX];
    pid_t pid;         /* 0 when down */
    atomic_uint kills; /* incremented just before each SIGKILL */
    unsigned restarts;
    unsigned crashes;        /* exits we did not cause */
    unsigned external_stops; /* of those: a SIGTERM/SIGINT from outside this checker (logged event=stopping) */
    unsigned restart_fails;
};

enum route { RT_RETRY, RT_REJECT };
static const char *const route_name[] = {"pay", "book"};
static const char *const route_path[] = {"/v1/pay/charge", "/v1/book/order"};

enum mode { M_NORMAL, M_SLOW_OK, M_SLOW_TIMEOUT, M_CLOSE, M_RESET, M_503, M_201, M_400, M__N };
static const char *const mode_name[M__N] = {"normal", "slow",      "slow_timeout", "close",
                                            "reset",  "first_503", "created",      "business_400"};

enum final { FIN_NONE, FIN_ANSWER, FIN_UNKNOWN, FIN_GAVE_UP, FIN_UNEXPECTED };

struct user { /* one client request (a key, as one tenant uses it) */
    char key[40];
    uint16_t worker;
    uint8_t route, mode;
    bool shared;
    bool hasty;
    uint16_t expect_status;
    uint16_t pad_len;
    uint16_t delay_ms;
    uint32_t seq;
    uint8_t attempts;
    uint8_t n_gw_unknown; /* gateway said unknown: 504, 502 no-response/too-large, 503 shutting-down */
    uint8_t n_release;    /* upstream 503 (release status) */
    uint8_t n_inuse, n_outcome_unknown, n_store_unavail, n_up_unavail;
    uint8_t n_refused, n_transport, n_timeout, n_unexpected, n_killed;
    bool first_delivered; /* the first attempt (the one with the fault headers) reached a gateway */
    bool wrong_tenant;
    uint8_t final;
    uint64_t t_first, t_last;
    int ans_status;
    bool ans_replayed;
    char ans_exec[24];
    char *ans_body;
    size_t ans_len;
    char ev[CH_EV_CAP];
    uint16_t ev_len;
    /* filled by the checks */
    long count;       /* executions of the key (all users of a shared key) */
    int row;          /* index in rows, -1 none */
    bool replay_done; /* a replay was sent */
    bool replay_ok;
    char replay_note[160];
};

struct worker {
    int id;
    uint64_t rng;
    pthread_t thread;
    CURL *curl;
    struct user *users;
    size_t n, cap, max;
    char *rbuf; /* response body buffer */
};

struct row {
    char route[16];
    char key[48];
    char scope[68];
    char state[16];
    char token[24];
    bool lease_live;
    int status;
    long lease_left_ms;
    int user; /* first user mapped to it, -1 none */
};

struct opts {
    const char *build;
    const char *services_dir;
    const char *services_sh;
    unsigned duration_s;
    unsigned workers;
    unsigned instances;
    uint64_t seed;
    unsigned lease_ms;
    unsigned up_timeout_ms;
    bool keep;
    bool pg_async; /* leave synchronous_commit as the cluster has it (shows lost commits) */
    bool no_faults;
};

static struct {
    struct opts o;
    char dir[256];
    char tag[16];
    char pg_url[1024];     /* for the gateways (synchronous_commit=on) */
    char pg_url_raw[1024]; /* as services.sh wrote it */
    char redis_url[512];
    char idemgate_bin[PATH_MAX];
    char upstream_bin[PATH_MAX];
    uint64_t t0, wall0;
    uint64_t traffic_end, faults_end;
    pthread_mutex_t log_mu;
    pthread_mutex_t win_mu;

    struct inst inst[CH_MAX_INST];
    pid_t tu_pid;
    uint16_t tu_port;
    uint16_t gate_port;
    pthread_t gate_thread;
    bool gate_started;
    atomic_bool gate_want_up, gate_is_up, gate_stop;
    atomic_uint gate_resets;
    atomic_uint gate_accepted;

    pthread_t fault_thread;
    bool fault_started;
    atomic_bool faults_done, fault_release;
    atomic_bool pg_down, redis_down;
    unsigned faults[F__N];
    unsigned fault_failures;
    struct window win[CH_MAX_WINDOWS];
    size_t nwin;

    struct worker *workers;
    atomic_bool abort;

    /* registry of child pids for the signal handler */
    pthread_mutex_t pid_mu;
    volatile pid_t pids[64];
} R;

/* ------------------------------------------------------------------ logging */

static double rel_s(uint64_t ms)
{
    return ms >= R.t0 ? (double)(ms - R.t0) / 1000.0 : -(double)(R.t0 - ms) / 1000.0;
}

static void iso_at(uint64_t mono, char *out, size_t n)
{
    uint64_t w = R.wall0 + (mono >= R.t0 ? mono - R.t0 : 0);
    time_t s = (time_t)(w / 1000);
    struct tm tm;
    gmtime_r(&s, &tm);
    snprintf(out, n, "%04d-%02d-%02dT%02d:%02d:%02d.%03uZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
             tm.tm_min, tm.tm_sec, (unsigned)(w % 1000));
}

static void ch_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void ch_log(const char *fmt, ...)
{
    char ts[80];
    uint64_t now = mono_ms();
    iso_at(now, ts, sizeof ts);
    pthread_mutex_lock(&R.log_mu);
    printf("chaos: +%07.3f %s ", rel_s(now), ts);
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
    fflush(stdout);
    pthread_mutex_unlock(&R.log_mu);
}

static void out(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void out(const char *fmt, ...)
{
    pthread_mutex_lock(&R.log_mu);
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fflush(stdout);
    pthread_mutex_unlock(&R.log_mu);
}

/* Sleeps ms in slices, returning early when the run aborts. */
static void nap(uint64_t ms)
{
    uint64_t end = mono_ms() + ms;
    while (!atomic_load(&R.abort)) {
        uint64_t now = mono_ms();
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
    pthread_mutex_lock(&R.pid_mu);
    for (size_t i = 0; i < sizeof R.pids / sizeof R.pids[0]; i++)
        if (R.pids[i] == 0) {
            R.pids[i] = p;
            break;
        }
    pthread_mutex_unlock(&R.pid_mu);
}

static void pid_forget(pid_t p)
{
    pthread_mutex_lock(&R.pid_mu);
    for (size_t i = 0; i < sizeof R.pids / sizeof R.pids[0]; i++)
        if (R.pids[i] == p)
            R.pids[i] = 0;
    pthread_mutex_unlock(&R.pid_mu);
}

static void on_fatal_signal(int sig)
{
    /* async-signal-safe only: kill what we started, by pid, and leave */
    for (size_t i = 0; i < sizeof R.pids / sizeof R.pids[0]; i++)
        if (R.pids[i] > 0)
            kill(R.pids[i], SIGKILL);
    static const char msg[] = "chaos: interrupted: children killed\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
    _exit(128 + sig);
}

/* Forks and execs argv with stdout+stderr appended to log_path. The child dies with the thread that forked it
 * (PR_SET_PDEATHSIG), so an abrupt end of this process never leaves a gateway behind. Returns the pid or -1. */
static pid_t spawn(char *const argv[], const char *log_path)
{
    pid_t parent = getpid();
    pid_t p = fork();
    if (p < 0)
        return -1;
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
        execv(argv[0], argv);
        _exit(127);
    }
    pid_register(p);
    return p;
}

/* Waits up to timeout_ms for pid; returns true with *status when it exited (and was reaped). */
static bool proc_wait(pid_t pid, int timeout_ms, int *status)
{
    uint64_t end = mono_ms() + (uint64_t)timeout_ms;
    for (;;) {
        int st = 0;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid || (r < 0 && errno == ECHILD)) {
            if (status)
                *status = r == pid ? st : 0;
            pid_forget(pid);
            return true;
        }
        if (mono_ms() >= end)
            return false;
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

/* sig, then SIGKILL after grace_ms; always reaps. Returns the wait status. */
static int proc_stop(pid_t pid, int sig, int grace_ms)
{
    int st = 0;
    if (pid <= 0)
        return 0;
    kill(pid, sig);
    if (proc_wait(pid, grace_ms, &st))
        return st;
    kill(pid, SIGKILL);
    if (!proc_wait(pid, 5000, &st))
        ch_log("event=reap_failed pid=%ld", (long)pid);
    return st;
}

static void describe_status(int st, char *buf, size_t n)
{
    if (WIFEXITED(st))
        snprintf(buf, n, "exit=%d", WEXITSTATUS(st));
    else if (WIFSIGNALED(st))
        snprintf(buf, n, "signal=%d", WTERMSIG(st));
    else
        snprintf(buf, n, "status=%d", st);
}

/* Runs `bash services.sh CMD DIR [ARG]` bounded in time; returns its exit code (-1 on timeout/spawn failure). */
static int services(const char *cmd, const char *arg)
{
    char log[PATH_MAX];
    snprintf(log, sizeof log, "%s/services-cmd.log", R.dir);
    char *argv[] = {
        (char *)"/bin/bash", (char *)R.o.services_sh, (char *)cmd, (char *)R.o.services_dir, (char *)arg, NULL};
    pid_t p = spawn(argv, log);
    if (p < 0)
        return -1;
    int st = 0;
    if (!proc_wait(p, CH_CMD_TIMEOUT_MS, &st)) {
        ch_log("event=services_timeout cmd=%s", cmd);
        proc_stop(p, SIGKILL, 1000);
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
static uint16_t pick_port(uint64_t *rng)
{
    static uint16_t taken[32];
    static size_t ntaken;
    for (int i = 0; i < 500; i++) {
        uint16_t p = (uint16_t)rnd_range(rng, 20000, 31999);
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

struct http_res {
    CURLcode cc;
    long status;
    char ctype[96];
    char exec[24];
    bool replayed;
    long retry_after;
    char *body; /* points into the caller's buffer */
    size_t len;
    bool trunc;
    char err[CURL_ERROR_SIZE];
};

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
        r->retry_after = parse_u64(t, 3600, &s) ? (long)s : 0;
    }
    return k;
}

/* One request with fresh connection (so no silent resend by libcurl hides an attempt). method NULL: GET. */
static void http_do(CURL *c, uint16_t port, const char *method, const char *path, struct curl_slist *hdrs,
                    const char *body, size_t blen, long timeout_ms, char *buf, size_t bufcap, bool fresh,
                    struct http_res *r)
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

static bool http_get_ok(CURL *c, uint16_t port, const char *path, long timeout_ms, char *buf, size_t cap)
{
    struct http_res r;
    http_do(c, port, NULL, path, NULL, NULL, 0, timeout_ms, buf, cap, false, &r);
    return r.cc == CURLE_OK && r.status == 200;
}

/* ------------------------------------------------------------------ the gate (upstream kill switch) */

struct gconn {
    int a, b; /* a: gateway side, b: testupstream side */
    char ab[CH_GATE_BUF], ba[CH_GATE_BUF];
    size_t ab_off, ab_len, ba_off, ba_len;
    bool a_eof, b_eof, a_shut, b_shut;
};

static int gate_listen(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 1024) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static void close_rst(int fd)
{
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    (void)setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(fd);
}

static void gconn_free(struct gconn *c, bool rst)
{
    if (rst) {
        close_rst(c->a);
        close_rst(c->b);
    } else {
        close(c->a);
        close(c->b);
    }
    free(c);
}

static int gate_connect_upstream(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct timeval tv = {1, 0};
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(R.tu_port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
}

/* Moves bytes src -> dst through buf. Returns -1 on a hard error (reset), else 0. */
static int gate_pump(int src, int dst, char *buf, size_t *off, size_t *len, bool *src_eof)
{
    for (int guard = 0; guard < 64; guard++) {
        if (*len == 0 && !*src_eof) {
            ssize_t n = read(src, buf, CH_GATE_BUF);
            if (n > 0) {
                *off = 0;
                *len = (size_t)n;
            } else if (n == 0) {
                *src_eof = true;
            } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
                return 0;
            } else {
                return -1;
            }
        }
        if (*len == 0)
            return 0;
        ssize_t w = send(dst, buf + *off, *len, MSG_NOSIGNAL);
        if (w > 0) {
            *off += (size_t)w;
            *len -= (size_t)w;
        } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            return 0;
        } else {
            return -1;
        }
    }
    return 0;
}

/* Returns false when the connection is finished (freed). */
static bool gate_service(struct gconn *c)
{
    if (gate_pump(c->a, c->b, c->ab, &c->ab_off, &c->ab_len, &c->a_eof) < 0 ||
        gate_pump(c->b, c->a, c->ba, &c->ba_off, &c->ba_len, &c->b_eof) < 0) {
        /* a reset on one side becomes a reset on the other: the gateway sees what a crashed upstream does */
        gconn_free(c, true);
        return false;
    }
    if (c->a_eof && c->ab_len == 0 && !c->b_shut) {
        shutdown(c->b, SHUT_WR);
        c->b_shut = true;
    }
    if (c->b_eof && c->ba_len == 0 && !c->a_shut) {
        shutdown(c->a, SHUT_WR);
        c->a_shut = true;
    }
    if (c->a_eof && c->b_eof && c->ab_len == 0 && c->ba_len == 0) {
        gconn_free(c, false);
        return false;
    }
    return true;
}

static void *gate_main(void *arg)
{
    struct gconn **conns = xcalloc(CH_GATE_MAX, sizeof *conns);
    struct pollfd *pfd = xcalloc(1 + 2 * CH_GATE_MAX, sizeof *pfd);
    size_t n = 0;
    int lfd = -1;
    uint64_t last_bind_fail = 0;
    while (!atomic_load(&R.gate_stop)) {
        bool want = atomic_load(&R.gate_want_up);
        if (want && lfd < 0 && mono_ms() - last_bind_fail > 100) {
            lfd = gate_listen(R.gate_port);
            if (lfd < 0) {
                last_bind_fail = mono_ms();
                ch_log("event=gate_bind_failed port=%u errno=%d", (unsigned)R.gate_port, errno);
            }
        }
        if (!want && lfd >= 0) {
            close(lfd);
            lfd = -1;
            for (size_t i = 0; i < n; i++)
                gconn_free(conns[i], true);
            atomic_fetch_add(&R.gate_resets, (unsigned)n);
            n = 0;
        }
        atomic_store(&R.gate_is_up, lfd >= 0);
        size_t k = 0;
        pfd[k++] = (struct pollfd){.fd = lfd, .events = lfd >= 0 ? POLLIN : 0};
        for (size_t i = 0; i < n; i++) {
            struct gconn *c = conns[i];
            short ea = 0, eb = 0;
            if (c->ab_len == 0 && !c->a_eof)
                ea |= POLLIN;
            if (c->ba_len > 0)
                ea |= POLLOUT;
            if (c->ba_len == 0 && !c->b_eof)
                eb |= POLLIN;
            if (c->ab_len > 0)
                eb |= POLLOUT;
            pfd[k++] = (struct pollfd){.fd = c->a, .events = ea};
            pfd[k++] = (struct pollfd){.fd = c->b, .events = eb};
        }
        int rc = poll(pfd, (nfds_t)k, 20);
        if (rc < 0 && errno != EINTR)
            break;
        if (rc <= 0)
            continue;
        /* service existing connections first (their pollfd slots match the array as it was) */
        size_t keep = 0;
        for (size_t i = 0; i < n; i++) {
            struct gconn *c = conns[i];
            bool busy = pfd[1 + 2 * i].revents != 0 || pfd[2 + 2 * i].revents != 0;
            if (!busy || gate_service(c))
                conns[keep++] = c;
        }
        n = keep;
        if (lfd >= 0 && (pfd[0].revents & POLLIN)) {
            for (int j = 0; j < 64; j++) {
                int a = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (a < 0)
                    break;
                atomic_fetch_add(&R.gate_accepted, 1);
                int b = n < CH_GATE_MAX ? gate_connect_upstream() : -1;
                if (b < 0) {
                    close_rst(a);
                    continue;
                }
                int one = 1;
                (void)setsockopt(a, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                struct gconn *c = xcalloc(1, sizeof *c);
                c->a = a;
                c->b = b;
                conns[n++] = c;
            }
        }
    }
    if (lfd >= 0)
        close(lfd);
    for (size_t i = 0; i < n; i++)
        gconn_free(conns[i], true);
    atomic_store(&R.gate_is_up, false);
    free(conns);
    free(pfd);
    return NULL;
}

static bool gate_set(bool up)
{
    atomic_store(&R.gate_want_up, up);
    uint64_t end = mono_ms() + 3000;
    while (mono_ms() < end) {
        if (atomic_load(&R.gate_is_up) == up)
            return true;
        struct timespec ts = {0, 5 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return false;
}

/* ------------------------------------------------------------------ processes: testupstream and gateways */

static bool start_testupstream(void)
{
    char pf[PATH_MAX], log[PATH_MAX];
    snprintf(pf, sizeof pf, "%s/upstream.port", R.dir);
    snprintf(log, sizeof log, "%s/testupstream.log", R.dir);
    char *argv[] = {R.upstream_bin, (char *)"--port", (char *)"0", (char *)"--port-file", pf, (char *)"--quiet", NULL};
    R.tu_pid = spawn(argv, log);
    if (R.tu_pid < 0)
        return false;
    uint64_t end = mono_ms() + 10000;
    while (mono_ms() < end) {
        FILE *f = fopen(pf, "r");
        if (f != NULL) {
            char line[32] = "";
            bool got = fgets(line, sizeof line, f) != NULL;
            fclose(f);
            line[strcspn(line, "\r\n")] = '\0';
            uint64_t p = 0;
            if (got && parse_u64(line, 65535, &p) && p > 0) {
                R.tu_port = (uint16_t)p;
                return true;
            }
        }
        if (proc_wait(R.tu_pid, 0, NULL)) {
            R.tu_pid = 0;
            return false;
        }
        nap(20);
    }
    return false;
}

static bool write_gw_conf(struct inst *g)
{
    snprintf(g->conf, sizeof g->conf, "%s/gw%d.yaml", R.dir, g->idx);
    FILE *f = fopen(g->conf, "w");
    if (f == NULL)
        return false;
    fprintf(f,
            "# written by tests/chaos/chaos.c\n"
            "listen: 127.0.0.1:%u\n"
            "admin:\n"
            "  listen: 127.0.0.1:%u\n"
            "shutdown_grace: 3s\n"
            "store:\n"
            "  postgres: \"%s\"\n"
            "  pool: 8\n"
            "  redis: \"%s\"\n"
            "  redis_timeout: 50ms\n"
            "upstreams:\n"
            "  - name: api\n"
            "    url: http://127.0.0.1:%u\n"
            "    connect_timeout: 500ms\n"
            "    timeout: %ums\n"
            "routes:\n",
            (unsigned)g->port, (unsigned)g->admin_port, R.pg_url, R.redis_url, (unsigned)R.gate_port,
            R.o.up_timeout_ms);
    for (int rt = 0; rt < 2; rt++)
        fprintf(f,
                "  - name: %s\n"
                "    match:\n"
                "      path_prefix: /v1/%s\n"
                "      methods: [POST]\n"
                "    upstream: api\n"
                "    idempotency:\n"
                "      key: required\n"
                "      scope: [header:Authorization]\n"
                "      fingerprint: [method, path, query, body]\n"
                "      retention: 24h\n"
                "      lease: %ums\n"
                "      on_in_flight: conflict\n"
                "      on_unknown: %s\n"
                "      release_statuses: [503]\n"
                "      max_body: 64KiB\n"
                "      forward_key: true\n",
                route_name[rt], route_name[rt], R.o.lease_ms, rt == RT_RETRY ? "retry" : "reject");
    return fclose(f) == 0;
}

/* Starts instance g on its ports without waiting. Returns the pid or -1. */
static pid_t gw_spawn(struct inst *g)
{
    snprintf(g->log, sizeof g->log, "%s/gw%d.log", R.dir, g->idx);
    FILE *lf = fopen(g->log, "a");
    if (lf != NULL) {
        char ts[80];
        iso_at(mono_ms(), ts, sizeof ts);
        fprintf(lf, "ts=%s chaos=start instance=%d\n", ts, g->idx);
        fclose(lf);
    }
    char *argv[] = {R.idemgate_bin, (char *)"-c", g->conf, NULL};
    return spawn(argv, g->log);
}

/* Waits for /healthz of the process p started for g; on success g->pid = p, else p is stopped. */
static bool gw_wait_ready(struct inst *g, pid_t p)
{
    CURL *c = curl_easy_init();
    char buf[512];
    char path[] = "/healthz";
    uint64_t end = mono_ms() + CH_GW_READY_MS;
    bool ok = false;
    while (c != NULL && !ok && mono_ms() < end && !atomic_load(&R.abort)) {
        int st;
        if (proc_wait(p, 0, &st)) {
            char d[32];
            describe_status(st, d, sizeof d);
            ch_log("event=gateway_start_failed instance=%d %s log=%s", g->idx, d, g->log);
            curl_easy_cleanup(c);
            return false;
        }
        ok = http_get_ok(c, g->admin_port, path, 300, buf, sizeof buf);
        if (!ok)
            nap(30);
    }
    curl_easy_cleanup(c);
    if (!ok) {
        ch_log("event=gateway_not_ready instance=%d log=%s", g->idx, g->log);
        proc_stop(p, SIGKILL, 1000);
        return false;
    }
    g->pid = p;
    return true;
}

/* Starts instance g and waits for /healthz. Returns false (process stopped) on failure. */
static bool gw_start(struct inst *g)
{
    pid_t p = gw_spawn(g);
    return p > 0 && gw_wait_ready(g, p);
}

static bool gw_start_retry(struct inst *g, int tries)
{
    for (int i = 0; i < tries && !atomic_load(&R.abort); i++) {
        if (gw_start(g))
            return true;
        nap(300);
    }
    g->restart_fails++;
    return false;
}

static void gw_kill(struct inst *g)
{
    if (g->pid <= 0)
        return;
    atomic_fetch_add(&g->kills, 1);
    kill(g->pid, SIGKILL);
    if (!proc_wait(g->pid, 5000, NULL))
        ch_log("event=gateway_reap_failed instance=%d", g->idx);
    g->pid = 0;
}

/* ------------------------------------------------------------------ fault schedule */

static size_t window_begin(enum fkind k, int inst)
{
    pthread_mutex_lock(&R.win_mu);
    size_t i = R.nwin;
    if (i < CH_MAX_WINDOWS) {
        R.win[i] = (struct window){.begin = mono_ms(), .end = UINT64_MAX, .kind = k, .inst = inst};
        R.nwin++;
    }
    pthread_mutex_unlock(&R.win_mu);
    return i;
}

static void window_end(size_t i)
{
    pthread_mutex_lock(&R.win_mu);
    if (i < R.nwin)
        R.win[i].end = mono_ms();
    pthread_mutex_unlock(&R.win_mu);
}

/* True when the gateway's log, since our last start of it, says it was told to stop (event=stopping). */
static bool gw_log_says_stopping(const struct inst *g)
{
    FILE *f = fopen(g->log, "r");
    if (f == NULL)
        return false;
    bool stopping = false;
    char line[1024];
    while (fgets(line, sizeof line, f) != NULL) {
        if (strstr(line, "chaos=start") != NULL)
            stopping = false;
        else if (strstr(line, "event=stopping ") != NULL)
            stopping = true;
    }
    fclose(f);
    return stopping;
}

/* Records an exit we did not cause (st from waitpid): a crash, or a stop by a signal from outside. */
static void gw_exited(struct inst *g, int st)
{
    char d[32];
    describe_status(st, d, sizeof d);
    atomic_fetch_add(&g->kills, 1);
    uint64_t now = mono_ms();
    /* the gateway may have been draining for its shutdown grace (3s) before it exited */
    size_t w = window_begin(F_GW_KILL, g->idx);
    pthread_mutex_lock(&R.win_mu);
    if (w < R.nwin)
        R.win[w].begin = now > 4000 ? now - 4000 : 0;
    pthread_mutex_unlock(&R.win_mu);
    window_end(w);
    g->crashes++;
    g->pid = 0;
    if (gw_log_says_stopping(g)) {
        g->external_stops++;
        ch_log("event=gateway_stopped_from_outside instance=%d %s log=%s msg=\"a SIGTERM/SIGINT this checker did not "
               "send (another process kills idemgate processes?)\"",
               g->idx, d, g->log);
    } else {
        ch_log("event=gateway_crashed instance=%d %s log=%s", g->idx, d, g->log);
    }
}

/* A gateway that exited without us killing it: record it, restart it. */
static void gw_monitor(void)
{
    for (unsigned i = 0; i < R.o.instances; i++) {
        struct inst *g = &R.inst[i];
        int st;
        if (g->pid > 0 && proc_wait(g->pid, 0, &st)) {
            gw_exited(g, st);
            if (gw_start_retry(g, 5))
                g->restarts++;
        }
    }
}

static void fault_gw_kill(uint64_t *rng, int which)
{
    int i = which >= 0 ? which : (int)(splitmix64(rng) % R.o.instances);
    struct inst *g = &R.inst[i];
    if (g->pid <= 0)
        return;
    R.faults[F_GW_KILL]++;
    uint64_t t = mono_ms();
    ch_log("fault=gateway_kill phase=begin instance=%d pid=%ld", i, (long)g->pid);
    size_t w = window_begin(F_GW_KILL, i);
    gw_kill(g);
    nap(rnd_range(rng, 200, 1200));
    bool ok = gw_start_retry(g, 5);
    if (ok)
        g->restarts++;
    else
        R.fault_failures++;
    window_end(w);
    ch_log("fault=gateway_kill phase=end instance=%d ok=%d pid=%ld ms=%" PRIu64, i, ok, (long)g->pid, mono_ms() - t);
}

static void fault_pg(uint64_t *rng)
{
    R.faults[F_PG_RESTART]++;
    uint64_t t = mono_ms();
    bool overlap = splitmix64(rng) % 4 == 0;
    int victim = (int)(splitmix64(rng) % R.o.instances);
    size_t w2 = SIZE_MAX;
    pid_t restarting = -1;
    ch_log("fault=postgres_restart phase=begin mode=immediate kill_gateway=%d", overlap ? victim : -1);
    size_t w = window_begin(F_PG_RESTART, -1);
    atomic_store(&R.pg_down, true);
    int rc = services("pg-stop", "immediate");
    ch_log("fault=postgres_restart phase=stopped rc=%d", rc);
    nap(rnd_range(rng, 100, 900));
    if (overlap && !atomic_load(&R.abort)) {
        struct inst *g = &R.inst[victim];
        if (g->pid > 0) {
            R.faults[F_GW_KILL]++;
            ch_log("fault=gateway_kill phase=begin instance=%d pid=%ld during=postgres_restart", victim, (long)g->pid);
            w2 = window_begin(F_GW_KILL, victim);
            gw_kill(g);
            nap(rnd_range(rng, 100, 500));
            /* it starts while Postgres is down (its schema check has to wait), and is checked after pg-start */
            restarting = gw_spawn(g);
            nap(rnd_range(rng, 100, 600));
        }
    }
    int rc2 = -1;
    for (int i = 0; i < 3 && rc2 != 0; i++) {
        rc2 = services("pg-start", NULL);
        if (rc2 != 0) {
            ch_log("event=pg_start_failed rc=%d try=%d", rc2, i + 1);
            nap(500);
        }
    }
    if (w2 != SIZE_MAX) {
        struct inst *g = &R.inst[victim];
        bool ok = restarting > 0 && gw_wait_ready(g, restarting);
        if (!ok)
            ok = gw_start_retry(g, 5);
        if (ok)
            g->restarts++;
        else
            R.fault_failures++;
        window_end(w2);
        ch_log("fault=gateway_kill phase=end instance=%d ok=%d pid=%ld", victim, ok, (long)g->pid);
    }
    if (rc != 0 || rc2 != 0)
        R.fault_failures++;
    atomic_store(&R.pg_down, rc2 != 0);
    window_end(w);
    ch_log("fault=postgres_restart phase=end ok=%d ms=%" PRIu64, rc == 0 && rc2 == 0, mono_ms() - t);
}

static void fault_redis_restart(uint64_t *rng)
{
    R.faults[F_REDIS_RESTART]++;
    uint64_t t = mono_ms();
    ch_log("fault=redis_restart phase=begin");
    size_t w = window_begin(F_REDIS_RESTART, -1);
    atomic_store(&R.redis_down, true);
    int rc = services("redis-stop", NULL);
    nap(rnd_range(rng, 300, 1500));
    int rc2 = -1;
    for (int i = 0; i < 3 && rc2 != 0; i++)
        rc2 = services("redis-start", NULL);
    atomic_store(&R.redis_down, rc2 != 0);
    window_end(w);
    if (rc != 0 || rc2 != 0)
        R.fault_failures++;
    ch_log("fault=redis_restart phase=end ok=%d ms=%" PRIu64, rc == 0 && rc2 == 0, mono_ms() - t);
}

static void fault_redis_flush(void)
{
    R.faults[F_REDIS_FLUSH]++;
    ch_log("fault=redis_flush phase=begin");
    size_t w = window_begin(F_REDIS_FLUSH, -1);
    int rc = services("redis-flush", NULL);
    window_end(w);
    if (rc != 0)
        R.fault_failures++;
    ch_log("fault=redis_flush phase=end ok=%d", rc == 0);
}

static void fault_upstream(uint64_t *rng)
{
    R.faults[F_UPSTREAM_DOWN]++;
    uint64_t t = mono_ms();
    bool overlap = splitmix64(rng) % 5 == 0;
    ch_log("fault=upstream_down phase=begin");
    size_t w = window_begin(F_UPSTREAM_DOWN, -1);
    bool ok = gate_set(false);
    ch_log("fault=upstream_down phase=down ok=%d connections_reset=%u", ok, atomic_load(&R.gate_resets));
    nap(rnd_range(rng, 300, 1500));
    if (overlap)
        fault_gw_kill(rng, -1);
    bool ok2 = gate_set(true);
    if (!ok || !ok2)
        R.fault_failures++;
    window_end(w);
    ch_log("fault=upstream_down phase=end ok=%d ms=%" PRIu64, ok && ok2, mono_ms() - t);
}

static void *fault_main(void *arg)
{
    uint64_t rng = R.o.seed ^ 0xfa017ull;
    nap(2000);
    unsigned order[F__N];
    size_t oi = F__N;
    while (!R.o.no_faults && !atomic_load(&R.abort) && mono_ms() + 1500 < R.faults_end) {
        if (oi == F__N) {
            for (unsigned i = 0; i < F__N; i++)
                order[i] = i;
            for (unsigned i = F__N - 1; i > 0; i--) {
                unsigned j = (unsigned)(splitmix64(&rng) % (i + 1));
                unsigned t = order[i];
                order[i] = order[j];
                order[j] = t;
            }
            oi = 0;
        }
        switch ((enum fkind)order[oi++]) {
        case F_GW_KILL:
            fault_gw_kill(&rng, -1);
            break;
        case F_PG_RESTART:
            fault_pg(&rng);
            break;
        case F_REDIS_RESTART:
            fault_redis_restart(&rng);
            break;
        case F_REDIS_FLUSH:
            fault_redis_flush();
            break;
        case F_UPSTREAM_DOWN:
            fault_upstream(&rng);
            break;
        default:
            break;
        }
        gw_monitor();
        uint64_t gap_end = mono_ms() + rnd_range(&rng, 1200, 3200);
        while (mono_ms() < gap_end && !atomic_load(&R.abort)) {
            nap(100);
            gw_monitor();
        }
    }
    /* keep watching until the traffic ends, then hand the processes to the main thread */
    while (!atomic_load(&R.abort) && mono_ms() < R.traffic_end) {
        nap(100);
        gw_monitor();
    }
    atomic_store(&R.faults_done, true);
    /* This thread forked some children with PR_SET_PDEATHSIG: it lives until they are stopped. */
    uint64_t bound = mono_ms() + 3600ull * 1000;
    while (!atomic_load(&R.fault_release) && mono_ms() < bound) {
        struct timespec ts = {0, 20 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* ------------------------------------------------------------------ clients */

static void user_ev(struct user *u, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void user_ev(struct user *u, const char *fmt, ...)
{
    if ((size_t)u->ev_len + 8 >= CH_EV_CAP)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(u->ev + u->ev_len, CH_EV_CAP - u->ev_len, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n >= (size_t)(CH_EV_CAP - u->ev_len)) {
        u->ev_len = CH_EV_CAP - 4;
        memcpy(u->ev + u->ev_len, "...", 4);
        u->ev_len = CH_EV_CAP - 1;
    } else {
        u->ev_len = (uint16_t)(u->ev_len + n);
    }
}

static size_t build_body(const struct user *u, char *buf, size_t cap)
{
    int n = snprintf(buf, cap, "{\"tenant\":\"tenant-%u\",\"key\":\"%s\",\"seq\":%u,\"mode\":\"%s\",\"pad\":\"",
                     (unsigned)u->worker, u->key, (unsigned)u->seq, mode_name[u->mode]);
    if (n < 0 || (size_t)n >= cap)
        return 0;
    size_t len = (size_t)n;
    for (unsigned i = 0; i < u->pad_len && len + 3 < cap; i++)
        buf[len++] = (char)('a' + (u->seq + i) % 26);
    buf[len++] = '"';
    buf[len++] = '}';
    buf[len] = '\0';
    return len;
}

static struct curl_slist *build_headers(const struct user *u, bool first)
{
    char h[256];
    struct curl_slist *l = NULL;
    snprintf(h, sizeof h, "Idempotency-Key: %s", u->key);
    l = curl_slist_append(l, h);
    snprintf(h, sizeof h, "Authorization: Bearer tenant-%u", (unsigned)u->worker);
    l = curl_slist_append(l, h);
    l = curl_slist_append(l, "Content-Type: application/json");
    l = curl_slist_append(l, "Expect:");
    if (u->expect_status != 200) {
        snprintf(h, sizeof h, "X-Test-Status: %u", (unsigned)u->expect_status);
        l = curl_slist_append(l, h);
    }
    if (first) { /* what went wrong that time: a real retry does not ask for it again */
        if (u->delay_ms) {
            snprintf(h, sizeof h, "X-Test-Delay-Ms: %u", (unsigned)u->delay_ms);
            l = curl_slist_append(l, h);
        }
        if (u->mode == M_CLOSE)
            l = curl_slist_append(l, "X-Test-Action: close");
        else if (u->mode == M_RESET)
            l = curl_slist_append(l, "X-Test-Action: reset");
        else if (u->mode == M_503)
            l = curl_slist_append(l, "X-Test-Status: 503");
    }
    return l;
}

static bool is_problem(const struct http_res *r, char *name, size_t n)
{
    static const char pfx[] = "urn:idemgate:problem:";
    name[0] = '\0';
    if (strncasecmp(r->ctype, "application/problem+json", 24) != 0)
        return false;
    const char *p = strstr(r->body, pfx);
    if (p == NULL)
        return true;
    p += sizeof pfx - 1;
    size_t k = strcspn(p, "\"");
    snprintf(name, n, "%.*s", (int)(k < 64 ? k : 64), p);
    return true;
}

enum cls {
    C_ANSWER,
    C_RELEASE,
    C_INUSE,
    C_OUTCOME_UNKNOWN,
    C_STORE_UNAVAIL,
    C_UP_UNAVAIL,
    C_GW_UNKNOWN,
    C_BUSY,
    C_REFUSED,
    C_TRANSPORT,
    C_TIMEOUT,
    C_WRONG_TENANT,
    C_UNEXPECTED,
};

/* What one attempt's result means for the client (and for the evidence the checks use). */
static enum cls classify(const struct user *u, const struct http_res *r, const char *sent, size_t sent_len, char *tok,
                         size_t tokn)
{
    char prob[72];
    if (r->cc == CURLE_COULDNT_CONNECT) {
        snprintf(tok, tokn, "refused");
        return C_REFUSED;
    }
    if (r->cc == CURLE_OPERATION_TIMEDOUT) {
        snprintf(tok, tokn, "timeout");
        return C_TIMEOUT;
    }
    if (r->cc != CURLE_OK) {
        snprintf(tok, tokn, "xfer%d", (int)r->cc);
        return C_TRANSPORT;
    }
    if (r->exec[0] != '\0') { /* an upstream answer (fresh or stored) */
        bool same = !r->trunc && r->len == sent_len && memcmp(r->body, sent, sent_len) == 0;
        if (!same) {
            snprintf(tok, tokn, "%ld:e%s%s:BODY!", r->status, r->exec, r->replayed ? "R" : "");
            return strstr(r->body, "\"tenant\":\"") != NULL ? C_WRONG_TENANT : C_UNEXPECTED;
        }
        if (r->status == 503) {
            snprintf(tok, tokn, "503rel:e%s%s", r->exec, r->replayed ? "R!" : "");
            return r->replayed ? C_UNEXPECTED : C_RELEASE; /* a release status must never be stored */
        }
        snprintf(tok, tokn, "%ld:e%s%s", r->status, r->exec, r->replayed ? "R" : "");
        return r->status == u->expect_status ? C_ANSWER : C_UNEXPECTED;
    }
    if (is_problem(r, prob, sizeof prob)) {
        snprintf(tok, tokn, "%ld:%s", r->status, prob);
        if (r->status == 409 && strcmp(prob, "idempotency-key-in-use") == 0)
            return C_INUSE;
        if (r->status == 409 && strcmp(prob, "idempotency-outcome-unknown") == 0)
            return C_OUTCOME_UNKNOWN;
        if (r->status == 503 && strcmp(prob, "store-unavailable") == 0)
            return C_STORE_UNAVAIL;
        if (r->status == 502 && strcmp(prob, "upstream-unavailable") == 0)
            return C_UP_UNAVAIL;
        if ((r->status == 504 && strcmp(prob, "upstream-timeout") == 0) ||
            (r->status == 502 && strcmp(prob, "upstream-no-response") == 0) ||
            (r->status == 502 && strcmp(prob, "upstream-response-too-large") == 0) ||
            (r->status == 503 && strcmp(prob, "shutting-down") == 0))
            return C_GW_UNKNOWN;
        if (r->status == 503 || r->status == 429)
            return C_BUSY;
        return C_UNEXPECTED;
    }
    snprintf(tok, tokn, "%ld:?", r->status);
    return r->status >= 500 ? C_BUSY : C_UNEXPECTED;
}

static uint64_t backoff(struct worker *w, unsigned attempt, long retry_after_s)
{
    uint64_t cap = 50ull << (attempt < 6 ? attempt : 6);
    if (cap > 1600)
        cap = 1600;
    uint64_t d = 10 + splitmix64(&w->rng) % cap; /* full jitter */
    if (retry_after_s > 0) {
        uint64_t ra = (uint64_t)retry_after_s * 1000;
        if (ra > 2000)
            ra = 2000;
        uint64_t j = ra / 2 + splitmix64(&w->rng) % (ra / 2 + 1);
        if (j > d)
            d = j;
    }
    return d;
}

static void plan_user(struct worker *w, struct user *u)
{
    uint64_t *rng = &w->rng;
    uint32_t seq = (uint32_t)w->n;
    u->worker = (uint16_t)w->id;
    u->seq = seq;
    u->row = -1;
    u->hasty = (w->id % 3) == 1; /* a third of the clients give up on an attempt after CH_HASTY_MS */
    u->pad_len = (uint16_t)rnd_range(rng, 0, 400);
    /* shared keys: both tenants of a pair use the same key string at the same sequence number (reject route) */
    uint64_t hs = R.o.seed ^ ((uint64_t)(w->id / 2) << 32) ^ seq;
    bool shared = (splitmix64(&hs) % 100) < 8;
    if (shared) {
        u->shared = true;
        u->route = RT_REJECT;
        snprintf(u->key, sizeof u->key, "s%u-%u-%s", (unsigned)(w->id / 2), (unsigned)seq, R.tag);
    } else {
        u->route = (uint8_t)(splitmix64(rng) % 2);
        snprintf(u->key, sizeof u->key, "u%u-%u-%s", (unsigned)w->id, (unsigned)seq, R.tag);
    }
    unsigned p = (unsigned)(splitmix64(rng) % 100);
    enum mode m = M_NORMAL;
    if (p < 8)
        m = M_SLOW_OK;
    else if (p < 14)
        m = M_SLOW_TIMEOUT;
    else if (p < 19)
        m = M_CLOSE;
    else if (p < 24)
        m = M_RESET;
    else if (p < 30)
        m = u->route == RT_RETRY ? M_503 : M_NORMAL; /* a release on the reject route would allow a re-execution */
    else if (p < 33)
        m = M_201;
    else if (p < 36)
        m = M_400;
    u->mode = (uint8_t)m;
    u->expect_status = m == M_201 ? 201 : (m == M_400 ? 400 : 200);
    if (m == M_SLOW_OK) /* longer than the lease (the owner must renew it), shorter than the upstream timeout */
        u->delay_ms = (uint16_t)rnd_range(rng, R.o.lease_ms + 100, R.o.up_timeout_ms - 300);
    else if (m == M_SLOW_TIMEOUT)
        u->delay_ms = (uint16_t)(R.o.up_timeout_ms + 1000);
}

static void run_user(struct worker *w, struct user *u)
{
    char body[1024];
    size_t blen = build_body(u, body, sizeof body);
    uint64_t start = mono_ms();
    uint64_t deadline = start + CH_REQ_BUDGET_MS;
    if (deadline > R.traffic_end + CH_DRAIN_MS)
        deadline = R.traffic_end + CH_DRAIN_MS;
    u->t_first = start;
    long per_attempt = u->hasty ? CH_HASTY_MS : CH_PATIENT_MS;
    for (unsigned a = 0; a < CH_MAX_ATTEMPTS && !atomic_load(&R.abort); a++) {
        uint64_t now = mono_ms();
        if (a > 0 && now >= deadline)
            break;
        int ii = (int)((w->id + a + u->seq) % R.o.instances);
        struct inst *g = &R.inst[ii];
        unsigned kills0 = atomic_load(&g->kills);
        struct curl_slist *h = build_headers(u, a == 0);
        struct http_res r;
        uint64_t t_att = mono_ms();
        http_do(w->curl, g->port, "POST", route_path[u->route], h, body, blen, per_attempt, w->rbuf, CH_BODY_CAP, true,
                &r);
        curl_slist_free_all(h);
        u->attempts++;
        u->t_last = mono_ms();
        bool killed = atomic_load(&g->kills) != kills0;
        if (killed)
            u->n_killed++;
        char tok[96];
        enum cls c = classify(u, &r, body, blen, tok, sizeof tok);
        if (a == 0 && c != C_REFUSED)
            u->first_delivered = true;
        user_ev(u, "%s+%.3f>g%d:%s%s", a ? " " : "", rel_s(t_att), ii, tok, killed ? ":K" : "");
        bool done = false;
        switch (c) {
        case C_ANSWER:
            u->final = FIN_ANSWER;
            u->ans_status = (int)r.status;
            u->ans_replayed = r.replayed;
            snprintf(u->ans_exec, sizeof u->ans_exec, "%s", r.exec);
            u->ans_body = xmalloc(r.len + 1);
            memcpy(u->ans_body, r.body, r.len);
            u->ans_body[r.len] = '\0';
            u->ans_len = r.len;
            done = true;
            break;
        case C_RELEASE:
            u->n_release++;
            break;
        case C_INUSE:
            u->n_inuse++;
            break;
        case C_OUTCOME_UNKNOWN:
            u->n_outcome_unknown++;
            u->final = FIN_UNKNOWN; /* a real client stops here and asks an operator */
            done = true;
            break;
        case C_STORE_UNAVAIL:
            u->n_store_unavail++;
            break;
        case C_UP_UNAVAIL:
            u->n_up_unavail++;
            break;
        case C_GW_UNKNOWN:
            u->n_gw_unknown++;
            break;
        case C_BUSY:
            break;
        case C_REFUSED:
            u->n_refused++;
            break;
        case C_TRANSPORT:
            u->n_transport++;
            break;
        case C_TIMEOUT:
            u->n_timeout++;
            break;
        case C_WRONG_TENANT:
            u->wrong_tenant = true;
            u->final = FIN_UNEXPECTED;
            done = true;
            break;
        case C_UNEXPECTED:
        default:
            u->n_unexpected++;
            u->final = FIN_UNEXPECTED;
            done = true;
            break;
        }
        if (done)
            return;
        uint64_t d = backoff(w, a, r.retry_after);
        if (mono_ms() + d >= deadline)
            break;
        nap(d);
    }
    u->final = FIN_GAVE_UP;
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    w->curl = curl_easy_init();
    w->rbuf = xmalloc(CH_BODY_CAP);
    if (w->curl == NULL)
        return NULL;
    nap(splitmix64(&w->rng) % 200);
    while (!atomic_load(&R.abort) && mono_ms() < R.traffic_end && w->n < w->max) {
        if (w->n == w->cap) {
            w->cap = w->cap ? w->cap * 2 : 256;
            w->users = xrealloc(w->users, w->cap * sizeof *w->users);
        }
        struct user *u = &w->users[w->n];
        memset(u, 0, sizeof *u);
        plan_user(w, u);
        w->n++;
        run_user(w, u);
        nap(rnd_range(&w->rng, 20, 120));
    }
    curl_easy_cleanup(w->curl);
    w->curl = NULL;
    return NULL;
}

/* ------------------------------------------------------------------ checks */

struct ctx {
    struct user **u; /* all users, sorted by key */
    size_t nu;
    struct row *rows;
    size_t nrows;
    char tenant_scope[CH_MAX_WORKERS][68];
    unsigned completion_failed_logs;
    unsigned lease_lost_logs;
    long total_before, total_after;
    long probe_count;
};

static int cmp_user(const void *a, const void *b)
{
    const struct user *x = *(const struct user *const *)a, *y = *(const struct user *const *)b;
    int c = strcmp(x->key, y->key);
    return c ? c : (int)x->worker - (int)y->worker;
}

static int cmp_row(const void *a, const void *b)
{
    const struct row *x = a, *y = b;
    int c = strcmp(x->key, y->key);
    return c ? c : strcmp(x->route, y->route);
}

static bool upstream_count(CURL *c, const char *key, long *out_n)
{
    char path[128], buf[64];
    if (key != NULL)
        snprintf(path, sizeof path, "/_test/count?key=%s", key);
    else
        snprintf(path, sizeof path, "/_test/count");
    for (int i = 0; i < 3; i++) {
        struct http_res r;
        http_do(c, R.tu_port, NULL, path, NULL, NULL, 0, 3000, buf, sizeof buf, false, &r);
        uint64_t v = 0;
        if (r.cc == CURLE_OK && r.status == 200 && parse_u64(buf, UINT32_MAX, &v)) {
            *out_n = (long)v;
            return true;
        }
    }
    return false;
}

static bool load_rows(struct ctx *x)
{
    const char *kw[] = {"dbname", "connect_timeout", NULL};
    const char *vals[] = {R.pg_url_raw, "10", NULL};
    PGconn *pg = PQconnectdbParams(kw, vals, 1);
    if (pg == NULL || PQstatus(pg) != CONNECTION_OK) {
        out("chaos: cannot connect to Postgres: %s\n", pg ? PQerrorMessage(pg) : "?");
        PQfinish(pg);
        return false;
    }
    char like[40];
    snprintf(like, sizeof like, "%%-%s", R.tag);
    const char *params[] = {like};
    PGresult *res = PQexecParams(pg,
                                 "SELECT route, key, encode(scope, 'hex'), state, token::text,"
                                 " (lease_until > now())::int, coalesce(status, 0),"
                                 " greatest(-1e9, least(1e9, extract(epoch FROM lease_until - now()) * 1000))::int8"
                                 " FROM idemgate_keys WHERE key LIKE $1",
                                 1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        out("chaos: query failed: %s\n", PQerrorMessage(pg));
        PQclear(res);
        PQfinish(pg);
        return false;
    }
    int n = PQntuples(res);
    x->rows = xcalloc((size_t)n + 1, sizeof *x->rows);
    x->nrows = (size_t)n;
    for (int i = 0; i < n; i++) {
        struct row *r = &x->rows[i];
        snprintf(r->route, sizeof r->route, "%s", PQgetvalue(res, i, 0));
        snprintf(r->key, sizeof r->key, "%s", PQgetvalue(res, i, 1));
        snprintf(r->scope, sizeof r->scope, "%s", PQgetvalue(res, i, 2));
        snprintf(r->state, sizeof r->state, "%s", PQgetvalue(res, i, 3));
        snprintf(r->token, sizeof r->token, "%s", PQgetvalue(res, i, 4));
        r->lease_live = strcmp(PQgetvalue(res, i, 5), "1") == 0;
        r->status = (int)strtol(PQgetvalue(res, i, 6), NULL, 10);
        r->lease_left_ms = strtol(PQgetvalue(res, i, 7), NULL, 10);
        r->user = -1;
    }
    PQclear(res);
    PQfinish(pg);
    qsort(x->rows, x->nrows, sizeof *x->rows, cmp_row);
    return true;
}

/* Rows with this key and route: first index and count (sorted rows). */
static size_t find_rows(const struct ctx *x, const char *key, const char *route, size_t *first)
{
    size_t lo = 0, hi = x->nrows;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(x->rows[mid].key, key);
        if (c == 0)
            c = strcmp(x->rows[mid].route, route);
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    size_t k = 0;
    while (lo + k < x->nrows && strcmp(x->rows[lo + k].key, key) == 0 && strcmp(x->rows[lo + k].route, route) == 0)
        k++;
    *first = lo;
    return k;
}

static unsigned count_log_events(const char *event)
{
    unsigned n = 0;
    char needle[96];
    snprintf(needle, sizeof needle, "event=%s ", event);
    char needle_end[96];
    snprintf(needle_end, sizeof needle_end, "event=%s\n", event);
    for (unsigned i = 0; i < R.o.instances; i++) {
        FILE *f = fopen(R.inst[i].log, "r");
        if (f == NULL)
            continue;
        char line[4096];
        while (fgets(line, sizeof line, f) != NULL)
            if (strstr(line, needle) != NULL || strstr(line, needle_end) != NULL)
                n++;
        fclose(f);
    }
    return n;
}

static bool log_line_relevant(const char *line)
{
    static const char *const keep[] = {
        "level=error",       "event=upstream_error", "event=completion_failed",
        "event=lease_lost",  "event=store_error",    "event=postgres_down",
        "event=postgres_up", "event=schema_ready",   "event=started",
        "event=stopping",    "chaos=start",          "event=bug",
    };
    for (size_t i = 0; i < sizeof keep / sizeof keep[0]; i++)
        if (strstr(line, keep[i]) != NULL)
            return true;
    return false;
}

static int cmp_str_from4(const void *a, const void *b)
{
    /* "[gN] ts=..." lines: order by the timestamp, then by instance */
    const char *x = *(const char *const *)a, *y = *(const char *const *)b;
    int c = strcmp(x + 5, y + 5);
    return c ? c : strcmp(x, y);
}

/* Prints the gateways' notable log lines (errors, upstream errors, store errors, restarts) between two times,
 * both instances merged in time order. */
static void print_gw_log_window(uint64_t from, uint64_t to)
{
    char a[80], b[80];
    iso_at(from, a, sizeof a);
    iso_at(to, b, sizeof b);
    size_t alen = strlen(a), blen = strlen(b);
    char **lines = NULL;
    size_t n = 0, cap = 0, more = 0, upstream_errors = 0;
    for (unsigned i = 0; i < R.o.instances; i++) {
        FILE *f = fopen(R.inst[i].log, "r");
        if (f == NULL)
            continue;
        char line[1024];
        while (fgets(line, sizeof line, f) != NULL) {
            if (strncmp(line, "ts=", 3) != 0 || strncmp(line + 3, a, alen) < 0 || strncmp(line + 3, b, blen) > 0 ||
                !log_line_relevant(line))
                continue;
            line[strcspn(line, "\n")] = '\0';
            if (strstr(line, "event=upstream_error") != NULL && strstr(line, "level=error") == NULL) {
                upstream_errors++; /* the close/reset requests of other clients: counted, not listed */
                continue;
            }
            if (n == 200) {
                more++;
                continue;
            }
            if (n == cap) {
                cap = cap ? cap * 2 : 32;
                lines = xrealloc(lines, cap * sizeof *lines);
            }
            size_t l = strlen(line);
            lines[n] = xmalloc(l + 6);
            snprintf(lines[n], l + 6, "[g%u] %s", i % 10, line);
            n++;
        }
        fclose(f);
    }
    qsort(lines, n, sizeof *lines, cmp_str_from4);
    out("    gateway log %s .. %s (errors, upstream/store errors, restarts; both instances):\n", a, b);
    for (size_t i = 0; i < n; i++) {
        if (i < CH_LOG_LINES_MAX)
            out("      %.400s\n", lines[i]);
        free(lines[i]);
    }
    if (n > CH_LOG_LINES_MAX || more)
        out("      ... %zu more\n", n - (n > CH_LOG_LINES_MAX ? CH_LOG_LINES_MAX : n) + more);
    if (n == 0)
        out("      (none)\n");
    if (upstream_errors)
        out("      (and %zu event=upstream_error lines, mostly other clients' close/reset requests)\n",
            upstream_errors);
    free(lines);
}

static void print_faults_between(uint64_t from, uint64_t to)
{
    pthread_mutex_lock(&R.win_mu);
    for (size_t i = 0; i < R.nwin; i++) {
        const struct window *wd = &R.win[i];
        if (wd->begin <= to && wd->end >= from) {
            char who[32] = "";
            if (wd->inst >= 0)
                snprintf(who, sizeof who, " instance=%d", wd->inst);
            out("    fault %s%s +%.3f .. +%.3f\n", fkind_name[wd->kind], who, rel_s(wd->begin),
                wd->end == UINT64_MAX ? -1.0 : rel_s(wd->end));
        }
    }
    pthread_mutex_unlock(&R.win_mu);
}

static void print_user(const struct ctx *x, const struct user *u, const char *what)
{
    out("  %s: key=%s route=%s tenant=tenant-%u mode=%s delay_ms=%u%s client=%s executions=%ld attempts=%u\n", what,
        u->key, route_name[u->route], (unsigned)u->worker, mode_name[u->mode], (unsigned)u->delay_ms,
        u->shared ? " shared" : "", u->hasty ? "hasty" : "patient", u->count, (unsigned)u->attempts);
    out("    attempts (+seconds>gateway:answer[:e<upstream exec>][R=replayed][:K=gateway killed meanwhile]): %s\n",
        u->ev);
    if (u->final == FIN_ANSWER)
        out("    client kept: status=%d exec=%s replayed=%d\n", u->ans_status, u->ans_exec, u->ans_replayed);
    if (u->row >= 0) {
        const struct row *r = &x->rows[u->row];
        out("    record: state=%s token=%s status=%d lease_left_ms=%ld scope=%.16s...\n", r->state, r->token, r->status,
            r->lease_left_ms, r->scope);
    } else {
        out("    record: none\n");
    }
    if (u->replay_note[0])
        out("    final replay: %s\n", u->replay_note);
    uint64_t to = (u->t_last ? u->t_last : u->t_first) + R.o.lease_ms + R.o.up_timeout_ms + 1000;
    print_faults_between(u->t_first > 1000 ? u->t_first - 1000 : 0, to);
    print_gw_log_window(u->t_first > 1000 ? u->t_first - 1000 : 0, to);
}

/* Number of faults of the kind (F__N: any that may make an outcome unknown, i.e. gateway kill, Postgres crash,
 * upstream down; never Redis) overlapping [a, b]. */
static unsigned faults_overlapping(uint64_t a, uint64_t b, enum fkind kind)
{
    unsigned n = 0;
    pthread_mutex_lock(&R.win_mu);
    for (size_t i = 0; i < R.nwin; i++) {
        enum fkind k = R.win[i].kind;
        bool disruptive = k == F_GW_KILL || k == F_PG_RESTART || k == F_UPSTREAM_DOWN;
        if ((kind == F__N ? disruptive : k == kind) && R.win[i].begin <= b && R.win[i].end >= a)
            n++;
    }
    pthread_mutex_unlock(&R.win_mu);
    return n;
}

struct replay_job {
    struct ctx *x;
    unsigned idx, step;
    unsigned sent, mismatched, not_replayed, wrong_tenant, failed;
};

static void *replay_main(void *arg)
{
    struct replay_job *j = arg;
    struct ctx *x = j->x;
    CURL *c = curl_easy_init();
    char *buf = xmalloc(CH_BODY_CAP);
    for (size_t i = j->idx; c != NULL && i < x->nu && !atomic_load(&R.abort); i += j->step) {
        struct user *u = x->u[i];
        if (u->row < 0 || strcmp(x->rows[u->row].state, "completed") != 0)
            continue;
        char body[1024];
        size_t blen = build_body(u, body, sizeof body);
        struct curl_slist *h = NULL;
        char hd[256];
        snprintf(hd, sizeof hd, "Idempotency-Key: %s", u->key);
        h = curl_slist_append(h, hd);
        snprintf(hd, sizeof hd, "Authorization: Bearer tenant-%u", (unsigned)u->worker);
        h = curl_slist_append(h, hd);
        h = curl_slist_append(h, "Content-Type: application/json");
        h = curl_slist_append(h, "Expect:");
        struct http_res r;
        memset(&r, 0, sizeof r);
        for (int t = 0; t < 4; t++) {
            int ii = (int)((u->worker + (unsigned)t) % R.o.instances);
            http_do(c, R.inst[ii].port, "POST", route_path[u->route], h, body, blen, CH_PATIENT_MS, buf, CH_BODY_CAP,
                    false, &r);
            if (r.cc == CURLE_OK && r.status != 503)
                break;
            nap(200);
        }
        curl_slist_free_all(h);
        j->sent++;
        u->replay_done = true;
        if (r.cc != CURLE_OK) {
            snprintf(u->replay_note, sizeof u->replay_note, "transport error %d (%.100s)", (int)r.cc, r.err);
            j->failed++;
            continue;
        }
        bool body_same_sent = !r.trunc && r.len == blen && memcmp(r.body, body, blen) == 0;
        snprintf(u->replay_note, sizeof u->replay_note, "status=%ld exec=%s replayed=%d body=%s", r.status,
                 r.exec[0] ? r.exec : "-", r.replayed, body_same_sent ? "own" : "OTHER");
        if (!body_same_sent && strstr(r.body, "\"tenant\":\"") != NULL) {
            u->wrong_tenant = true;
            j->wrong_tenant++;
        }
        if (!r.replayed)
            j->not_replayed++;
        if (u->final == FIN_ANSWER) {
            bool same = r.status == u->ans_status && strcmp(r.exec, u->ans_exec) == 0 && r.len == u->ans_len &&
                        memcmp(r.body, u->ans_body, r.len) == 0 && r.replayed;
            u->replay_ok = same;
            if (!same)
                j->mismatched++;
        } else {
            u->replay_ok = r.replayed && body_same_sent && r.exec[0] != '\0';
            if (!u->replay_ok)
                j->mismatched++;
        }
    }
    free(buf);
    curl_easy_cleanup(c);
    return NULL;
}

struct tally {
    size_t requests, attempts, keys;
    long executions;
    long forbidden, allowed_reexec;
    size_t lost_answers, unstored_answers, wrong_tenant, stuck, lost_records, stored_release, unexpected;
    size_t scope_errors, replay_executed;
    size_t fin[5];
    size_t blocked_no_exec, orphaned;
    size_t rows_completed, rows_unknown, rows_in_flight;
    size_t late_answers;
    size_t spurious_unknown;
};

static const char *check_names[] = {"run", "at-most-once", "same-answer", "tenant-isolation", "records-settled"};

/* Runs every check and prints the figures; false when the data could not be read. */
static bool run_checks(unsigned *passed_out, unsigned *failed_out)
{
    struct ctx *x = xcalloc(1, sizeof *x);
    struct tally t;
    memset(&t, 0, sizeof t);
    bool check_ok[5] = {true, true, true, true, true};
    unsigned reported[5] = {0};

    size_t nu = 0;
    for (unsigned w = 0; w < R.o.workers; w++)
        nu += R.workers[w].n;
    x->u = xcalloc(nu + 1, sizeof *x->u);
    for (unsigned w = 0; w < R.o.workers; w++)
        for (size_t i = 0; i < R.workers[w].n; i++)
            x->u[x->nu++] = &R.workers[w].users[i];
    qsort(x->u, x->nu, sizeof *x->u, cmp_user);
    t.requests = x->nu;

    /* 1. the upstream's counts (ground truth), before any replay */
    CURL *c = curl_easy_init();
    bool counts_ok = c != NULL && upstream_count(c, NULL, &x->total_before);
    for (size_t i = 0; counts_ok && i < x->nu;) {
        size_t j = i;
        while (j < x->nu && strcmp(x->u[j]->key, x->u[i]->key) == 0)
            j++;
        long n = 0;
        if (!upstream_count(c, x->u[i]->key, &n)) {
            counts_ok = false;
            break;
        }
        for (size_t k = i; k < j; k++)
            x->u[k]->count = n;
        t.keys++;
        t.executions += n;
        i = j;
    }
    char probe[64];
    snprintf(probe, sizeof probe, "probe-%s", R.tag);
    if (counts_ok)
        counts_ok = upstream_count(c, probe, &x->probe_count);
    if (!counts_ok) {
        out("chaos: cannot read the upstream's counts\n");
        curl_easy_cleanup(c);
        return false;
    }
    if (x->total_before != t.executions + x->probe_count)
        out("chaos: note: upstream total %ld != sum of per-key counts %ld (+probe %ld)\n", x->total_before,
            t.executions, x->probe_count);

    /* 2. the records, straight from Postgres */
    if (!load_rows(x)) {
        curl_easy_cleanup(c);
        return false;
    }
    for (size_t i = 0; i < x->nrows; i++) {
        struct row *r = &x->rows[i];
        if (strcmp(r->state, "completed") == 0)
            t.rows_completed++;
        else if (strcmp(r->state, "unknown") == 0)
            t.rows_unknown++;
        else
            t.rows_in_flight++;
        if (strcmp(r->state, "completed") != 0 && r->lease_live) {
            t.stuck++;
            check_ok[4] = false;
            out("VIOLATION records-settled: stuck record key=%s route=%s state=%s lease_left_ms=%ld (after the "
                "quiet period)\n",
                r->key, r->route, r->state, r->lease_left_ms);
        } else if (strcmp(r->state, "in_flight") == 0) {
            t.orphaned++;
        }
        if (strcmp(r->state, "completed") == 0 && r->status == 503) {
            t.stored_release++;
            check_ok[4] = false;
            out("VIOLATION records-settled: a release status was stored key=%s route=%s\n", r->key, r->route);
        }
    }
    /* tenant scopes, learned from unique keys (one tenant each) */
    for (size_t i = 0; i < x->nu; i++) {
        struct user *u = x->u[i];
        size_t first;
        size_t k = find_rows(x, u->key, route_name[u->route], &first);
        if (u->shared || k == 0)
            continue;
        if (k > 1) {
            t.scope_errors++;
            check_ok[3] = false;
            out("VIOLATION tenant-isolation: %zu records for the unique key %s\n", k, u->key);
        }
        u->row = (int)first;
        x->rows[first].user = (int)i;
        char *ts = x->tenant_scope[u->worker % CH_MAX_WORKERS];
        if (ts[0] == '\0')
            snprintf(ts, 68, "%s", x->rows[first].scope);
        else if (strcmp(ts, x->rows[first].scope) != 0) {
            t.scope_errors++;
            check_ok[3] = false;
            if (reported[3]++ < CH_REPORT_MAX)
                out("VIOLATION tenant-isolation: key %s of tenant-%u has scope %.16s..., its other keys %.16s...\n",
                    u->key, (unsigned)u->worker, x->rows[first].scope, ts);
        }
    }
    for (unsigned a = 0; a < R.o.workers; a++)
        for (unsigned b = a + 1; b < R.o.workers; b++)
            if (x->tenant_scope[a][0] && strcmp(x->tenant_scope[a], x->tenant_scope[b]) == 0) {
                t.scope_errors++;
                check_ok[3] = false;
                out("VIOLATION tenant-isolation: tenant-%u and tenant-%u share the scope %.16s...\n", a, b,
                    x->tenant_scope[a]);
            }
    /* shared keys: each tenant's record is the one with its scope */
    for (size_t i = 0; i < x->nu; i++) {
        struct user *u = x->u[i];
        if (!u->shared)
            continue;
        size_t first;
        size_t k = find_rows(x, u->key, route_name[u->route], &first);
        const char *ts = x->tenant_scope[u->worker % CH_MAX_WORKERS];
        for (size_t j = 0; j < k; j++) {
            struct row *r = &x->rows[first + j];
            if (ts[0] && strcmp(r->scope, ts) == 0) {
                u->row = (int)(first + j);
                r->user = (int)i;
            }
        }
        if (k > 2) {
            t.scope_errors++;
            check_ok[3] = false;
            out("VIOLATION tenant-isolation: %zu records for the shared key %s (2 tenants)\n", k, u->key);
        }
    }

    /* 3. final replays (completed records only: nothing may execute) */
    struct replay_job jobs[CH_REPLAY_THREADS];
    pthread_t th[CH_REPLAY_THREADS];
    unsigned nth = 0;
    for (unsigned i = 0; i < CH_REPLAY_THREADS; i++) {
        jobs[i] = (struct replay_job){.x = x, .idx = i, .step = CH_REPLAY_THREADS};
        if (pthread_create(&th[i], NULL, replay_main, &jobs[i]) == 0)
            nth++;
        else
            break;
    }
    unsigned replays = 0, replay_fail = 0;
    for (unsigned i = 0; i < nth; i++) {
        pthread_join(th[i], NULL);
        replays += jobs[i].sent;
        replay_fail += jobs[i].failed;
    }
    if (nth < CH_REPLAY_THREADS)
        out("chaos: note: only %u replay threads started\n", nth);
    if (!upstream_count(c, NULL, &x->total_after))
        x->total_after = -1;
    curl_easy_cleanup(c);
    if (x->total_after != x->total_before) {
        t.replay_executed = (size_t)(x->total_after > x->total_before ? x->total_after - x->total_before : 1);
        check_ok[4] = false;
        out("VIOLATION records-settled: %zu executions happened during the final replays of completed records\n",
            t.replay_executed);
    }

    x->completion_failed_logs = count_log_events("completion_failed");
    x->lease_lost_logs = count_log_events("lease_lost");

    /* 4. per key and per client */
    for (size_t i = 0; i < x->nu;) {
        size_t j = i;
        while (j < x->nu && strcmp(x->u[j]->key, x->u[i]->key) == 0)
            j++;
        long users = (long)(j - i);
        long count = x->u[i]->count;
        long allowed = 0;
        bool strict = true;
        for (size_t k = i; k < j; k++) {
            struct user *u = x->u[k];
            t.attempts += u->attempts;
            t.fin[u->final]++;
            long a = 1;
            if (u->route == RT_RETRY) {
                strict = false;
                bool fault_mode =
                    u->mode == M_SLOW_TIMEOUT || u->mode == M_CLOSE || u->mode == M_RESET || u->mode == M_503;
                a += u->n_gw_unknown + u->n_release + (fault_mode && u->first_delivered ? 1 : 0) +
                     faults_overlapping(u->t_first, u->t_last, F__N);
            }
            allowed += a;
        }
        if (count > users) {
            long re = count - users;
            long ok_re = allowed - users;
            if (ok_re > re)
                ok_re = re;
            t.allowed_reexec += ok_re;
            if (count > allowed) {
                t.forbidden += count - allowed;
                check_ok[1] = false;
                if (reported[1]++ < CH_REPORT_MAX) {
                    out("VIOLATION at-most-once: key %s executed %ld times, allowed %ld (%s)\n", x->u[i]->key, count,
                        allowed,
                        strict ? "reject route: never twice per tenant"
                               : "retry route: only after a release or an unknown outcome");
                    for (size_t k = i; k < j; k++)
                        print_user(x, x->u[k], "client");
                }
            }
        }
        for (size_t k = i; k < j; k++) {
            struct user *u = x->u[k];
            const struct row *r = u->row >= 0 ? &x->rows[u->row] : NULL;
            if (u->wrong_tenant) {
                t.wrong_tenant++;
                check_ok[3] = false;
                if (reported[3]++ < CH_REPORT_MAX)
                    print_user(x, u, "VIOLATION tenant-isolation: answer with another tenant's body");
            }
            if (u->n_unexpected) {
                t.unexpected++;
                check_ok[2] = false;
                if (reported[2]++ < CH_REPORT_MAX)
                    print_user(x, u, "VIOLATION same-answer: unexpected answer");
            }
            if (u->final == FIN_UNKNOWN && count == 0)
                t.blocked_no_exec++;
            bool fault_mode = u->mode == M_SLOW_TIMEOUT || u->mode == M_CLOSE || u->mode == M_RESET || u->mode == M_503;
            if ((u->final == FIN_UNKNOWN || u->n_gw_unknown > 0) && !fault_mode &&
                faults_overlapping(u->t_first, u->t_last, F__N) == 0) {
                if (t.spurious_unknown++ < 3)
                    print_user(x, u, "note: unknown outcome without an injected cause");
            }
            if (u->final == FIN_ANSWER) {
                if (r == NULL) {
                    t.lost_answers++;
                    check_ok[2] = false;
                    if (reported[2]++ < CH_REPORT_MAX)
                        print_user(x, u, "VIOLATION same-answer: answered key without a record (lost)");
                } else if (strcmp(r->state, "completed") != 0) {
                    t.unstored_answers++; /* completion failed: allowed by SPEC section 4, checked against logs below */
                } else if (!u->replay_ok) {
                    t.lost_answers++;
                    check_ok[2] = false;
                    if (reported[2]++ < CH_REPORT_MAX)
                        print_user(x, u, "VIOLATION same-answer: the final replay differs from the client's answer");
                }
            } else if (r != NULL && strcmp(r->state, "completed") == 0) {
                t.late_answers++;
                if (!u->replay_ok && !u->wrong_tenant) {
                    t.lost_answers++;
                    check_ok[2] = false;
                    if (reported[2]++ < CH_REPORT_MAX)
                        print_user(x, u, "VIOLATION same-answer: replay of a completed record is wrong");
                }
            }
            /* an executed key must keep a record unless the client saw it released */
            bool maybe_released = u->n_release > 0 || u->n_up_unavail > 0 || (u->mode == M_503 && u->first_delivered) ||
                                  faults_overlapping(u->t_first, u->t_last, F_UPSTREAM_DOWN) > 0;
            if (!u->shared && count > 0 && r == NULL && !maybe_released && u->final != FIN_ANSWER) {
                t.lost_records++;
                check_ok[4] = false;
                if (reported[4]++ < CH_REPORT_MAX)
                    print_user(x, u, "VIOLATION records-settled: executed key without a record, never released");
            }
        }
        i = j;
    }
    if (t.unstored_answers > x->completion_failed_logs) {
        check_ok[2] = false;
        out("VIOLATION same-answer: %zu answered keys are not completed, but the gateways logged only %u "
            "completion_failed events\n",
            t.unstored_answers, x->completion_failed_logs);
        unsigned shown = 0;
        for (size_t i = 0; i < x->nu && shown < CH_REPORT_MAX; i++) {
            struct user *u = x->u[i];
            if (u->final == FIN_ANSWER && u->row >= 0 && strcmp(x->rows[u->row].state, "completed") != 0) {
                print_user(x, u, "unstored answer");
                shown++;
            }
        }
    }
    /* records nobody asked for */
    size_t foreign = 0;
    for (size_t i = 0; i < x->nrows; i++)
        if (x->rows[i].user < 0 && strcmp(x->rows[i].key, probe) != 0)
            foreign++;

    /* the run itself: traffic, faults, gateways */
    unsigned crashes = 0, restart_fails = 0, restarts = 0, external = 0;
    for (unsigned i = 0; i < R.o.instances; i++) {
        crashes += R.inst[i].crashes - R.inst[i].external_stops;
        external += R.inst[i].external_stops;
        restart_fails += R.inst[i].restart_fails;
        restarts += R.inst[i].restarts;
    }
    if (t.requests < R.o.workers || t.fin[FIN_ANSWER] == 0 || t.executions == 0) {
        check_ok[0] = false;
        out("VIOLATION run: too little traffic (requests=%zu answered=%zu executions=%ld)\n", t.requests,
            t.fin[FIN_ANSWER], t.executions);
    }
    if (!R.o.no_faults && R.o.duration_s >= 30)
        for (unsigned k = 0; k < F__N; k++)
            if (R.faults[k] == 0) {
                check_ok[0] = false;
                out("VIOLATION run: no %s fault was injected\n", fkind_name[k]);
            }
    if (crashes || restart_fails || R.fault_failures) {
        check_ok[0] = false;
        out("VIOLATION run: gateway crashes=%u restart failures=%u fault command failures=%u\n", crashes, restart_fails,
            R.fault_failures);
    }
    if (external) {
        check_ok[0] = false;
        out("VIOLATION run: %u gateway stops by a SIGTERM/SIGINT from outside this checker (not a gateway defect: "
            "something on this machine signals idemgate processes it did not start)\n",
            external);
    }

    /* report */
    out("\nchaos: ---- figures (seed %" PRIu64 ", %u workers, %u instances, %us traffic, lease %ums, upstream "
        "timeout %ums)\n",
        R.o.seed, R.o.workers, R.o.instances, R.o.duration_s, R.o.lease_ms, R.o.up_timeout_ms);
    out("chaos: requests=%zu keys=%zu attempts=%zu final_replays=%u (transport failures %u)\n", t.requests, t.keys,
        t.attempts, replays, replay_fail);
    out("chaos: client outcomes: answered=%zu outcome_unknown=%zu gave_up=%zu unexpected=%zu\n", t.fin[FIN_ANSWER],
        t.fin[FIN_UNKNOWN], t.fin[FIN_GAVE_UP], t.fin[FIN_UNEXPECTED]);
    out("chaos: faults: gateway_kill=%u postgres_restart=%u redis_restart=%u redis_flush=%u upstream_down=%u "
        "(gateway restarts %u, upstream connections reset %u)\n",
        R.faults[F_GW_KILL], R.faults[F_PG_RESTART], R.faults[F_REDIS_RESTART], R.faults[F_REDIS_FLUSH],
        R.faults[F_UPSTREAM_DOWN], restarts, atomic_load(&R.gate_resets));
    out("chaos: executions=%ld duplicates(forbidden)=%ld allowed_re_executions=%ld\n", t.executions, t.forbidden,
        t.allowed_reexec);
    out("chaos: lost_answers=%zu unstored_answers=%zu (completion_failed logged: %u, lease_lost logged: %u) "
        "late_answers=%zu unexpected_answers=%zu\n",
        t.lost_answers, t.unstored_answers, x->completion_failed_logs, x->lease_lost_logs, t.late_answers,
        t.unexpected);
    out("chaos: wrong_tenant_answers=%zu scope_errors=%zu\n", t.wrong_tenant, t.scope_errors);
    out("chaos: records: completed=%zu unknown=%zu in_flight_lapsed=%zu stuck=%zu lost=%zu stored_release=%zu "
        "foreign=%zu; keys blocked as unknown without any execution=%zu; unknown outcomes without an injected "
        "cause=%zu\n",
        t.rows_completed, t.rows_unknown, t.orphaned, t.stuck, t.lost_records, t.stored_release, foreign,
        t.blocked_no_exec, t.spurious_unknown);
    unsigned passed = 0, failed = 0;
    for (unsigned k = 0; k < 5; k++) {
        out("chaos: check %-17s %s\n", check_names[k], check_ok[k] ? "PASS" : "FAIL");
        if (check_ok[k])
            passed++;
        else
            failed++;
    }
    free(x->rows);
    free(x->u);
    free(x);
    *passed_out = passed;
    *failed_out = failed;
    return true;
}

/* ------------------------------------------------------------------ setup and teardown */

static bool read_services_env(void)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/env", R.o.services_dir);
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        fprintf(stderr, "chaos: cannot read %s: %s\n", path, strerror(errno));
        return false;
    }
    char line[2048];
    while (fgets(line, sizeof line, f) != NULL) {
        line[strcspn(line, "\r\n")] = '\0';
        const char *p = line;
        if (strncmp(p, "export ", 7) == 0)
            p += 7;
        if (strncmp(p, "IDEMGATE_TEST_PG_URL=", 21) == 0)
            snprintf(R.pg_url_raw, sizeof R.pg_url_raw, "%s", p + 21);
        else if (strncmp(p, "IDEMGATE_TEST_REDIS_URL=", 24) == 0)
            snprintf(R.redis_url, sizeof R.redis_url, "%s", p + 24);
    }
    fclose(f);
    if (R.pg_url_raw[0] == '\0' || R.redis_url[0] == '\0') {
        fprintf(stderr, "chaos: %s lacks IDEMGATE_TEST_PG_URL or IDEMGATE_TEST_REDIS_URL\n", path);
        return false;
    }
    if (R.o.pg_async)
        snprintf(R.pg_url, sizeof R.pg_url, "%s", R.pg_url_raw);
    else
        snprintf(R.pg_url, sizeof R.pg_url, "%.900s%soptions=-c%%20synchronous_commit%%3Don", R.pg_url_raw,
                 strchr(R.pg_url_raw, '?') ? "&" : "?");
    return true;
}

static void teardown(void)
{
    for (unsigned i = 0; i < R.o.instances; i++) {
        struct inst *g = &R.inst[i];
        if (g->pid > 0) {
            int st = proc_stop(g->pid, SIGTERM, 8000);
            char d[32];
            describe_status(st, d, sizeof d);
            ch_log("event=gateway_stopped instance=%d %s", g->idx, d);
            g->pid = 0;
        }
    }
    if (R.tu_pid > 0) {
        proc_stop(R.tu_pid, SIGTERM, 3000);
        R.tu_pid = 0;
    }
    if (R.gate_started) {
        atomic_store(&R.gate_stop, true);
        pthread_join(R.gate_thread, NULL);
        R.gate_started = false;
    }
    if (R.fault_started) {
        atomic_store(&R.abort, true);
        atomic_store(&R.fault_release, true);
        pthread_join(R.fault_thread, NULL);
        R.fault_started = false;
    }
    /* anything left in the registry (should be nothing) */
    for (size_t i = 0; i < sizeof R.pids / sizeof R.pids[0]; i++)
        if (R.pids[i] > 0) {
            kill(R.pids[i], SIGKILL);
            (void)waitpid(R.pids[i], NULL, 0);
            R.pids[i] = 0;
        }
}

/* Services back to normal after the schedule (a fault may have been cut short). */
static void heal(void)
{
    if (atomic_load(&R.pg_down) && services("pg-start", NULL) == 0)
        atomic_store(&R.pg_down, false);
    if (atomic_load(&R.redis_down) && services("redis-start", NULL) == 0)
        atomic_store(&R.redis_down, false);
    (void)gate_set(true);
    for (unsigned i = 0; i < R.o.instances; i++) {
        struct inst *g = &R.inst[i];
        int st;
        if (g->pid > 0 && proc_wait(g->pid, 0, &st))
            gw_exited(g, st);
        if (g->pid <= 0 && gw_start_retry(g, 5))
            g->restarts++;
    }
}

static void rm_rf_dir(const char *dir)
{
    char *argv[] = {(char *)"/bin/rm", (char *)"-rf", (char *)dir, NULL};
    char log[] = "/dev/null";
    pid_t p = spawn(argv, log);
    if (p > 0)
        (void)proc_wait(p, 30000, NULL);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: chaos --build DIR --services-dir DIR [--duration SECONDS] [--workers N] [--instances 1|2]\n"
               "             [--seed S] [--services-sh PATH] [--lease-ms N] [--upstream-timeout-ms N] [--keep]\n"
               "             [--no-faults] [--pg-async]\n"
               "  --services-dir: a directory started by scripts/services.sh (its env file is read)\n"
               "  --services-sh: scripts/services.sh (default $IDEMGATE_SERVICES_SH)\n"
               "  --keep: keep the run directory (configs, gateway logs) even when every check passes\n"
               "  --pg-async: keep the cluster's synchronous_commit=off (demonstrates lost commits on a crash)\n");
}

static bool parse_args(int argc, char **argv)
{
    struct opts *o = &R.o;
    o->duration_s = 60;
    o->workers = 32;
    o->instances = 2;
    o->seed = wall_ms() ^ ((uint64_t)getpid() << 20);
    o->lease_ms = 2000;
    o->up_timeout_ms = 3000;
    o->services_sh = getenv("IDEMGATE_SERVICES_SH");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t n = 0;
        if (strcmp(a, "--keep") == 0) {
            o->keep = true;
            continue;
        }
        if (strcmp(a, "--pg-async") == 0) {
            o->pg_async = true;
            continue;
        }
        if (strcmp(a, "--no-faults") == 0) {
            o->no_faults = true;
            continue;
        }
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            exit(0);
        }
        if (v == NULL) {
            fprintf(stderr, "chaos: %s needs a value\n", a);
            return false;
        }
        i++;
        if (strcmp(a, "--build") == 0)
            o->build = v;
        else if (strcmp(a, "--services-dir") == 0)
            o->services_dir = v;
        else if (strcmp(a, "--services-sh") == 0)
            o->services_sh = v;
        else if (strcmp(a, "--duration") == 0 && parse_u64(v, 86400, &n) && n >= 5)
            o->duration_s = (unsigned)n;
        else if (strcmp(a, "--workers") == 0 && parse_u64(v, CH_MAX_WORKERS, &n) && n >= 1)
            o->workers = (unsigned)n;
        else if (strcmp(a, "--instances") == 0 && parse_u64(v, CH_MAX_INST, &n) && n >= 1)
            o->instances = (unsigned)n;
        else if (strcmp(a, "--seed") == 0 && parse_u64(v, UINT64_MAX, &n))
            o->seed = n;
        else if (strcmp(a, "--lease-ms") == 0 && parse_u64(v, 60000, &n) && n >= 500)
            o->lease_ms = (unsigned)n;
        else if (strcmp(a, "--upstream-timeout-ms") == 0 && parse_u64(v, 60000, &n) && n >= 500)
            o->up_timeout_ms = (unsigned)n;
        else {
            fprintf(stderr, "chaos: bad option or value: %s %s\n", a, v);
            return false;
        }
    }
    if (o->build == NULL || o->services_dir == NULL || o->services_sh == NULL) {
        usage(stderr);
        fprintf(stderr, "chaos: --build, --services-dir and --services-sh (or IDEMGATE_SERVICES_SH) are required\n");
        return false;
    }
    if (o->up_timeout_ms < o->lease_ms + 600) {
        fprintf(stderr, "chaos: --upstream-timeout-ms must exceed --lease-ms by 600 (slow requests outlive the "
                        "lease but not the timeout)\n");
        return false;
    }
    return true;
}

static void raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max > 65536 ? 65536 : rl.rlim_max;
        (void)setrlimit(RLIMIT_NOFILE, &rl);
    }
}

/* One request through the whole chain before the traffic starts. */
static bool probe(void)
{
    CURL *c = curl_easy_init();
    char *buf = xmalloc(CH_BODY_CAP);
    char hk[96];
    snprintf(hk, sizeof hk, "Idempotency-Key: probe-%s", R.tag);
    struct curl_slist *h = curl_slist_append(NULL, hk);
    h = curl_slist_append(h, "Authorization: Bearer probe");
    bool ok = true;
    for (unsigned i = 0; i < R.o.instances && ok; i++) {
        struct http_res r;
        uint64_t end = mono_ms() + 15000; /* a fresh gateway answers 503 until its pool has connected */
        do {
            http_do(c, R.inst[i].port, "POST", route_path[RT_RETRY], h, "{}", 2, 5000, buf, CH_BODY_CAP, true, &r);
            if (r.cc == CURLE_OK && r.status == 503 && r.exec[0] == '\0') {
                nap(100);
            } else if (r.cc == CURLE_OK && r.status == 409 && i > 0) {
                /* the key completed on instance 0 a moment ago: a replay is due, yet a Redis in-flight
                 * marker not yet replaced by the cached answer can answer 409 (observed at start-up) */
                ch_log("event=probe_note instance=%u msg=\"409 for a key completed on instance 0\" body=%.160s", i,
                       buf);
                nap(100);
            } else {
                break;
            }
        } while (mono_ms() < end);
        ok = r.cc == CURLE_OK && r.status == 200 && r.exec[0] != '\0' && (i == 0 || r.replayed);
        if (!ok)
            ch_log("event=probe_failed instance=%u curl=%d status=%ld exec=%s replayed=%d body=%.200s", i, (int)r.cc,
                   r.status, r.exec, r.replayed, buf);
    }
    curl_slist_free_all(h);
    free(buf);
    curl_easy_cleanup(c);
    return ok;
}

int main(int argc, char **argv)
{
    pthread_mutex_init(&R.log_mu, NULL);
    pthread_mutex_init(&R.win_mu, NULL);
    pthread_mutex_init(&R.pid_mu, NULL);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!parse_args(argc, argv)) {
        printf("0 passed, 1 failed\n");
        return 2;
    }
    R.t0 = mono_ms();
    R.wall0 = wall_ms();
    uint64_t tr = R.o.seed ^ wall_ms() ^ ((uint64_t)getpid() << 32);
    snprintf(R.tag, sizeof R.tag, "%08" PRIx32, (uint32_t)splitmix64(&tr));
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_fatal_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    raise_nofile();
    unsetenv("IDEMGATE_POSTGRES_URL");
    unsetenv("IDEMGATE_REDIS_URL");
    unsetenv("IDEMGATE_ADMIN_TOKEN");
    setenv("SERVICES_WAIT_S", "20", 1);
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        printf("0 passed, 1 failed\n");
        return 1;
    }
    int rc = 1;
    bool checked = false;
    unsigned passed = 0, failed = 1;
    snprintf(R.idemgate_bin, sizeof R.idemgate_bin, "%s/idemgate", R.o.build);
    snprintf(R.upstream_bin, sizeof R.upstream_bin, "%s/tests/tools/testupstream", R.o.build);
    snprintf(R.dir, sizeof R.dir, "/tmp/idemgate-chaos.XXXXXX");
    if (access(R.idemgate_bin, X_OK) != 0 || access(R.upstream_bin, X_OK) != 0) {
        fprintf(stderr, "chaos: %s or %s is missing (build first)\n", R.idemgate_bin, R.upstream_bin);
        goto done;
    }
    if (mkdtemp(R.dir) == NULL) {
        fprintf(stderr, "chaos: mkdtemp: %s\n", strerror(errno));
        R.dir[0] = '\0';
        goto done;
    }
    chmod(R.dir, 0755);
    if (!read_services_env())
        goto done;
    ch_log("event=start seed=%" PRIu64 " tag=%s workers=%u instances=%u duration_s=%u lease_ms=%u "
           "upstream_timeout_ms=%u dir=%s synchronous_commit=%s",
           R.o.seed, R.tag, R.o.workers, R.o.instances, R.o.duration_s, R.o.lease_ms, R.o.up_timeout_ms, R.dir,
           R.o.pg_async ? "cluster-default" : "on");
    if (services("status", NULL) != 0) {
        ch_log("event=services_down dir=%s", R.o.services_dir);
        goto done;
    }

    uint64_t prng = R.o.seed ^ wall_ms();
    if (!start_testupstream()) {
        ch_log("event=testupstream_failed");
        goto done;
    }
    R.gate_port = pick_port(&prng);
    atomic_store(&R.gate_want_up, true);
    if (R.gate_port == 0 || pthread_create(&R.gate_thread, NULL, gate_main, NULL) != 0)
        goto done;
    R.gate_started = true;
    if (!gate_set(true)) {
        ch_log("event=gate_failed port=%u", (unsigned)R.gate_port);
        goto done;
    }
    for (unsigned i = 0; i < R.o.instances; i++) {
        struct inst *g = &R.inst[i];
        g->idx = (int)i;
        bool ok = false;
        for (int t = 0; t < 4 && !ok; t++) {
            g->port = pick_port(&prng);
            g->admin_port = pick_port(&prng);
            ok = g->port && g->admin_port && write_gw_conf(g) && gw_start(g);
        }
        if (!ok) {
            ch_log("event=gateway_failed instance=%u log=%s", i, g->log);
            goto done;
        }
        ch_log("event=gateway_up instance=%u pid=%ld port=%u admin=%u", i, (long)g->pid, (unsigned)g->port,
               (unsigned)g->admin_port);
    }
    ch_log("event=upstream_up testupstream=%u gate=%u", (unsigned)R.tu_port, (unsigned)R.gate_port);
    if (!probe())
        goto done;

    /* traffic + faults */
    uint64_t now = mono_ms();
    R.traffic_end = now + (uint64_t)R.o.duration_s * 1000;
    R.faults_end = R.traffic_end - 2000;
    R.workers = xcalloc(R.o.workers, sizeof *R.workers);
    for (unsigned w = 0; w < R.o.workers; w++) {
        R.workers[w].id = (int)w;
        R.workers[w].rng = R.o.seed ^ (0x1000193ull * (w + 1));
        R.workers[w].max = CH_MAX_USERS / R.o.workers;
    }
    if (pthread_create(&R.fault_thread, NULL, fault_main, NULL) != 0)
        goto done;
    R.fault_started = true;
    unsigned started = 0;
    for (unsigned w = 0; w < R.o.workers; w++) {
        if (pthread_create(&R.workers[w].thread, NULL, worker_main, &R.workers[w]) != 0)
            break;
        started++;
    }
    ch_log("event=traffic_start workers=%u", started);
    uint64_t last_report = mono_ms();
    while (mono_ms() < R.traffic_end && !atomic_load(&R.abort)) {
        nap(200);
        if (mono_ms() - last_report >= 10000) {
            size_t n = 0;
            for (unsigned w = 0; w < started; w++)
                n += R.workers[w].n;
            ch_log("event=progress requests=%zu", n);
            last_report = mono_ms();
        }
    }
    for (unsigned w = 0; w < started; w++)
        pthread_join(R.workers[w].thread, NULL);
    R.o.workers = started;
    ch_log("event=traffic_end");
    uint64_t bound = mono_ms() + 120000;
    while (!atomic_load(&R.faults_done) && mono_ms() < bound)
        nap(50);
    heal();
    unsigned quiet = R.o.lease_ms * 2 + R.o.up_timeout_ms + 1000;
    ch_log("event=quiet_period ms=%u", quiet);
    nap(quiet);
    ch_log("event=checks");
    checked = run_checks(&passed, &failed);

done:
    teardown();
    if (!checked) {
        passed = 0;
        failed = 1;
    }
    rc = failed ? 1 : 0;
    if (R.dir[0] != '\0') {
        if (rc == 0 && !R.o.keep)
            rm_rf_dir(R.dir);
        else
            out("chaos: run directory kept: %s (gateway logs gw*.log, configs, testupstream.log)\n", R.dir);
    }
    if (R.workers != NULL) {
        for (unsigned w = 0; w < R.o.workers; w++) {
            for (size_t i = 0; i < R.workers[w].n; i++)
                free(R.workers[w].users[i].ans_body);
            free(R.workers[w].users);
            free(R.workers[w].rbuf);
        }
        free(R.workers);
    }
    curl_global_cleanup();
    printf("%u passed, %u failed\n", passed, failed);
    return rc;
}
