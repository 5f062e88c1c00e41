/* harness.h - end-to-end test harness: starts the real idemgate and testupstream
 * binaries, writes their configs, and talks HTTP (libcurl) or raw TCP to them. */
#ifndef IDEMGATE_E2E_HARNESS_H
#define IDEMGATE_E2E_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/*
 * Typical use (each Criterion Test runs in its own forked process, with its own processes and temp dir):
 *
 *   TestSuite(x, .init = e2e_setup, .fini = e2e_teardown, .timeout = 90);
 *   Test(x, y) {
 *       struct e2e_upstream *up = e2e_upstream_start(NULL);
 *       struct e2e_gw_opts o = {.up = up};
 *       struct e2e_gw *gw = e2e_gw_start("listen: 127.0.0.1:{{LISTEN_PORT}}\n...", &o);
 *       static const char *const h[] = {"Idempotency-Key: k1", NULL};
 *       struct e2e_req rq = {.method = "POST", .path = "/v1/payments", .headers = h, .body = "{}", .body_len = 2};
 *       struct e2e_resp r;
 *       e2e_http(gw->port, &rq, &r);
 *       cr_expect_eq(r.status, 200);
 *       e2e_resp_free(&r);
 *       cr_expect_eq(e2e_upstream_count(up, "k1"), 1);
 *   }
 *
 * Failures inside the harness fail the test (cr_assert) with the gateway's log tail on stderr.
 */

/* Every wait in the harness is bounded by one of these. */
#define E2E_READY_TIMEOUT_MS 10000 /* gateway /healthz, upstream port file */
#define E2E_STOP_TIMEOUT_MS  15000 /* SIGTERM -> exit, before SIGKILL */
#define E2E_HTTP_TIMEOUT_MS  10000 /* default per HTTP request */

/* Criterion fixtures: use as TestSuite(x, .init = e2e_setup, .fini = e2e_teardown).
 * e2e_setup fails the test when IDEMGATE_BIN, IDEMGATE_TEST_UPSTREAM,
 * IDEMGATE_TEST_PG_URL or IDEMGATE_TEST_REDIS_URL is missing (never skips).
 * e2e_teardown stops every process the test started (SIGTERM, then SIGKILL
 * after a bound), always reaps them, removes the temp dir (kept when
 * E2E_KEEP=1); under ASan (ASAN_OPTIONS set) a gateway that does not exit 0
 * at SIGTERM makes the test program exit non-zero. */
void e2e_setup(void);
void e2e_teardown(void);
/* Same as e2e_setup without the Postgres/Redis requirement (CLI tests). */
void e2e_setup_nostore(void);

/* A required environment variable; fails the test when missing or empty. */
const char *e2e_env(const char *name);
/* The test's temp dir (created by e2e_setup). */
const char *e2e_tmpdir(void);
/* Writes data to DIR/name; returns the heap path (freed by teardown). */
const char *e2e_write_file(const char *name, const char *data);
/* A free 127.0.0.1 TCP port (bind port 0, getsockname, close). */
uint16_t e2e_free_port(void);

/* ---- child processes */
struct e2e_proc {
    pid_t pid; /* 0 when not started */
    bool exited;
    int wstatus; /* raw waitpid status, valid when exited */
    bool killed; /* we had to SIGKILL it */
    char *log;   /* file receiving its stdout and stderr */
    const char *what;
};
/* Waits up to timeout_ms for the process to exit; true when it has. */
bool e2e_proc_wait(struct e2e_proc *p, int timeout_ms);
/* Sends sig, waits up to grace_ms, then SIGKILLs and reaps. Returns true
 * when it exited by itself within grace_ms. Safe on a stopped process. */
bool e2e_proc_stop(struct e2e_proc *p, int sig, int grace_ms);
/* Exit code (0..255) when it exited normally, -SIGNAL when a signal killed
 * it, -1000 while still running. */
int e2e_proc_exit_code(const struct e2e_proc *p);
/* Whole content of the process's log (heap, NUL-terminated; caller frees). */
char *e2e_proc_log(const struct e2e_proc *p);
/* Prints the last bytes of the log on stderr (for failure messages). */
void e2e_proc_dump_log(const struct e2e_proc *p, size_t tail);

/* Runs argv[0] (with argv, extra env "K=V" entries, NULL-terminated, may be
 * NULL), waits up to timeout_ms, and returns its exit code (as
 * e2e_proc_exit_code; killed at the bound -> the test fails). *out and *err
 * get stdout and stderr (heap, caller frees; may be NULL to ignore). */
int e2e_run(const char *const *argv, const char *const *env, int timeout_ms, char **out, char **err);

/* ---- the test upstream */
struct e2e_upstream {
    struct e2e_proc proc;
    uint16_t port;
    char url[64]; /* http://127.0.0.1:PORT */
};
/* Starts testupstream --port 0 --port-file F [extra args] and waits until it
 * answers /_test/health. Fails the test on any problem. The struct lives
 * until teardown. */
struct e2e_upstream *e2e_upstream_start(const char *const *extra_args);
/* Executions counted by the upstream: key NULL -> all, else per
 * Idempotency-Key value as received. Fails the test when unreachable. */
long e2e_upstream_count(const struct e2e_upstream *u, const char *key);
void e2e_upstream_reset(const struct e2e_upstream *u);
/* Headers of the last execution ("Name: value\n" lines; heap, caller frees). */
char *e2e_upstream_last_headers(const struct e2e_upstream *u);
/* Polls e2e_upstream_count(u, key) every 10 ms until it reaches n or timeout_ms passes; returns the last count. */
long e2e_upstream_wait_count(const struct e2e_upstream *u, const char *key, long n, int timeout_ms);
/* The upstream's binary body (X-Test-Body-Size): byte i is 0 when i % 64 == 1, else byte (i % 8) of
 * splitmix64(i / 8). */
unsigned char e2e_upstream_body_byte(uint64_t i);
/* Index of the first byte of p where that pattern differs, or len when all match. */
size_t e2e_upstream_body_mismatch(const unsigned char *p, size_t len);

/* ---- the gateway */
struct e2e_gw {
    struct e2e_proc proc;
    uint16_t port;       /* front */
    uint16_t admin_port; /* admin */
    char *conf_path;
    char *conf_text;
};
struct e2e_gw_opts {
    /* {{UPSTREAM_URL}} and {{UPSTREAM_PORT}} come from this one. */
    const struct e2e_upstream *up;
    /* Extra placeholders: NULL-terminated name, value pairs. */
    const char *const *vars;
    /* Extra environment "K=V" for the gateway (IDEMGATE_POSTGRES_URL,
     * IDEMGATE_REDIS_URL and IDEMGATE_ADMIN_TOKEN are removed from the
     * inherited environment unless given here). */
    const char *const *env;
    /* Do not wait for /healthz (the test checks start-up itself). */
    bool no_wait;
    /* Also wait (bounded) until GET /readyz answers 200, as e2e_gw_wait_ready: the store is up (ignored with
     * no_wait). */
    bool wait_ready;
    /* Without it the gateway starts with --accept-identity-change for every name in the config: the tests share
     * one database and give route "pay" many identities (SPEC 8). */
    bool strict_identity;
};
/* Renders the template and writes it as the gateway's config, then runs
 * `idemgate -c FILE` with stderr into a log, and waits (bounded) for
 * GET /healthz on admin to answer 200. Placeholders, written {{NAME}}:
 * LISTEN_PORT, ADMIN_PORT, PG_URL, REDIS_URL, UPSTREAM_URL, UPSTREAM_PORT,
 * DEAD_PORT (a port nobody listens on), TMPDIR, plus opts->vars. An unknown
 * placeholder fails the test. Retries with other ports when the log says the
 * address is in use. The struct lives until teardown. opts may be NULL. */
struct e2e_gw *e2e_gw_start(const char *tmpl, const struct e2e_gw_opts *opts);
/* SIGTERM, wait up to grace_ms, then SIGKILL. Returns the exit code as
 * e2e_proc_exit_code. */
int e2e_gw_stop(struct e2e_gw *g, int grace_ms);
/* Gateway log (heap, caller frees) and searches in it. */
char *e2e_gw_log(const struct e2e_gw *g);
bool e2e_gw_log_contains(const struct e2e_gw *g, const char *needle);
/* Occurrences of needle in the gateway's log. */
/* The same, in a line that is not an access line (SPEC 11: an access line carries the key as sent). */
bool e2e_gw_log_contains_outside_access(const struct e2e_gw *g, const char *needle);
size_t e2e_gw_log_count(const struct e2e_gw *g, const char *needle);
/* Polls the log until needle appears (true) or timeout_ms passes (false). */
bool e2e_gw_log_wait(const struct e2e_gw *g, const char *needle, int timeout_ms);
/* Polls the log (logfmt) for the access line of the request request_id: the line (heap, caller frees), or NULL
 * after timeout_ms. */
char *e2e_gw_access_line(const struct e2e_gw *g, const char *request_id, int timeout_ms);
/* Renders a template with the same placeholders (for --check tests); heap. */
char *e2e_render(const char *tmpl, const char *const *vars);
/* Status of GET /readyz on the admin port (0 when the request failed). */
long e2e_gw_readyz(const struct e2e_gw *g);
/* Polls /readyz until it answers want (true) or timeout_ms passes (false). */
bool e2e_gw_readyz_wait(const struct e2e_gw *g, long want, int timeout_ms);
/* Waits until /readyz answers 200 (the harness start waits for /healthz only, and a gateway answers 503
 * store-unavailable until its Postgres pool is up); fails the test with the gateway's log after
 * E2E_READY_TIMEOUT_MS. */
void e2e_gw_wait_ready(const struct e2e_gw *g);
/* Fails the test (with the gateway's log) when the gateway process is gone; what says when. */
void e2e_gw_assert_alive(struct e2e_gw *g, const char *what);
/* Starts a test upstream (no extra arguments) and a gateway from conf in front of it. */
void e2e_start(const char *conf, struct e2e_upstream **up, struct e2e_gw **gw);

/* ---- config templates: pieces of YAML (string literals, with the placeholders above) to concatenate */
/* The listen ports and shutdown_grace. */
#define E2E_CONF_PORTS                                                                                                 \
    "listen: 127.0.0.1:{{LISTEN_PORT}}\n"                                                                              \
    "admin:\n"                                                                                                         \
    "  listen: 127.0.0.1:{{ADMIN_PORT}}\n"                                                                             \
    "shutdown_grace: 5s\n"
/* The store block on the test Postgres and the given Redis URL (a literal). */
#define E2E_CONF_STORE(redis)                                                                                          \
    "store:\n"                                                                                                         \
    "  postgres: \"{{PG_URL}}\"\n"                                                                                     \
    "  redis: \"" redis "\"\n"
/* Ports and store on the test Postgres and Redis. */
#define E2E_CONF_HEAD E2E_CONF_PORTS E2E_CONF_STORE("{{REDIS_URL}}")
/* One entry of the upstreams list (1 s connect timeout). */
#define E2E_CONF_UPSTREAM(name, url, timeout)                                                                          \
    "  - name: " name "\n"                                                                                             \
    "    url: " url "\n"                                                                                               \
    "    connect_timeout: 1s\n"                                                                                        \
    "    timeout: " timeout "\n"
/* One entry of the routes list, up to its "idempotency:" line (the block's lines, indented by six, follow). */
#define E2E_CONF_ROUTE(name, prefix, upstream)                                                                         \
    "  - name: " name "\n"                                                                                             \
    "    match:\n"                                                                                                     \
    "      path_prefix: " prefix "\n"                                                                                  \
    "    upstream: " upstream "\n"                                                                                     \
    "    idempotency:\n"

/* The idempotency tests' config: an idempotent route "pay" on /v1/pay and a pass-through route "pass"
 * (key: off) on /v1/pass, both on one upstream "api", the test Postgres and the given Redis. */
struct e2e_pay_conf {
    const char *idem;          /* the lines of pay's idempotency block, unindented, each ending in \n */
    const char *upstream_url;  /* a template; NULL: "{{UPSTREAM_URL}}" */
    const char *timeout;       /* the upstream's timeout; NULL: "5s" */
    const char *redis;         /* a template; NULL: "{{REDIS_URL}}" */
    const char *redis_timeout; /* store.redis_timeout; NULL: not set */
    const char *route;         /* the route's name; NULL: "pay" */
};
/* The template (heap; caller frees). */
char *e2e_conf_pay(const struct e2e_pay_conf *c);
/* Starts a gateway from e2e_conf_pay(c) in front of up (env as e2e_gw_opts.env, may be NULL) and waits until
 * /readyz answers 200. */
struct e2e_gw *e2e_gw_start_pay(const struct e2e_upstream *up, const struct e2e_pay_conf *c, const char *const *env);

/* ---- HTTP client (libcurl easy, blocking, timeouts always set) */
struct e2e_hdr {
    char *name;
    char *value;
};
struct e2e_req {
    const char *method;         /* default "GET"; "HEAD" sends no body */
    const char *path;           /* "/v1/x?y=1" */
    const char *const *headers; /* NULL-terminated "Name: value" lines */
    const void *body;           /* NULL: no body */
    size_t body_len;
    long timeout_ms; /* default E2E_HTTP_TIMEOUT_MS */
};
struct e2e_resp {
    long status; /* 0 when the transfer failed (see curl_code, error) */
    int curl_code;
    char error[256];
    struct e2e_hdr *hdrs; /* in arrival order, final response only */
    size_t nhdrs;
    unsigned char *body; /* NUL-terminated beyond body_len */
    size_t body_len;
    double seconds; /* total time */
};
void e2e_http(uint16_t port, const struct e2e_req *rq, struct e2e_resp *out);
/* Sends method path with "Idempotency-Key: key" (the raw value; NULL: no such header) first, then the extra
 * header lines (NULL-terminated, may be NULL) and body (a string; NULL: no body); timeout_ms 0: the default. */
void e2e_http_key(uint16_t port, const char *method, const char *path, const char *key, const char *const *extra,
                  const char *body, long timeout_ms, struct e2e_resp *out);
/* GET path with no extra header. */
void e2e_get(uint16_t port, const char *path, struct e2e_resp *out);
void e2e_resp_free(struct e2e_resp *r);
/* First value of a header (case-insensitive), or NULL. */
const char *e2e_resp_header(const struct e2e_resp *r, const char *name);
/* n-th (0-based) value of a header, or NULL. */
const char *e2e_resp_header_nth(const struct e2e_resp *r, const char *name, size_t n);
size_t e2e_resp_header_count(const struct e2e_resp *r, const char *name);
/* True when the response is application/problem+json whose "type" is
 * urn:idemgate:problem:NAME. */
bool e2e_resp_is_problem(const struct e2e_resp *r, const char *name);
/* Expects (cr_expect) that status and that problem; what names the case in the messages. */
void e2e_expect_problem(const struct e2e_resp *r, long status, const char *name, const char *what);
/* True when the response carries Idempotent-Replayed: true. */
bool e2e_resp_is_replay(const struct e2e_resp *r);

/* Runs n requests at once (curl multi) against port; out[i] answers rq[i].
 * Bounded by the largest timeout of the requests. */
void e2e_http_parallel(uint16_t port, const struct e2e_req *rq, struct e2e_resp *out, size_t n);

/* A request running in a background thread (the request is copied). */
struct e2e_async;
struct e2e_async *e2e_http_async(uint16_t port, const struct e2e_req *rq);
/* Waits for it (bounded by its timeout + 5 s) and frees the handle. */
void e2e_http_join(struct e2e_async *a, struct e2e_resp *out);

/* Parses "Name: value\n" lines (as /_test/last-headers answers). */
size_t e2e_parse_header_lines(const char *text, struct e2e_hdr **out);
void e2e_hdrs_free(struct e2e_hdr *h, size_t n);
/* First value of name in a parsed list, or NULL; count of name. */
const char *e2e_hdrs_get(const struct e2e_hdr *h, size_t n, const char *name);
size_t e2e_hdrs_count(const struct e2e_hdr *h, size_t n, const char *name);

/* ---- raw TCP (malformed input) */
struct e2e_raw {
    char *data; /* heap, NUL-terminated beyond len; caller frees */
    size_t len;
    bool closed;    /* the peer closed the connection */
    bool timed_out; /* the bound passed first */
    int status;     /* status code of the first response line, 0 when none */
};
/* Case-insensitive search for a header inside a raw header block ("Name: value\r\n" lines): the bytes after its
 * colon, or NULL when absent. */
const char *e2e_raw_header(const char *blk, size_t blen, const char *name);
/* For a non-blocking socket that poll() found writable: sends what it takes of data[*sent..len) and advances
 * *sent; on a hard error (the peer stopped reading) sets *sent = len, so that the caller goes on to read. */
void e2e_raw_send_some(int fd, const void *data, size_t len, size_t *sent);
/* Connects to 127.0.0.1:port, sends the bytes, then reads until the peer
 * closes, one full response has arrived (headers plus Content-Length body)
 * or timeout_ms passes. Fails the test when it cannot connect. */
void e2e_raw_send(uint16_t port, const void *data, size_t len, int timeout_ms, struct e2e_raw *out);

/* ---- services (scripts/services.sh CMD $IDEMGATE_TEST_SERVICES_DIR), e.g.
 * "pg-stop", "pg-start", "redis-stop", "redis-start", "redis-flush". Returns
 * the script's exit code (bounded by 60 s). */
int e2e_services(const char *cmd);

/* ---- small helpers */
/* A key nobody else uses, even across runs on the same database: "TAG-PID-RANDOM". */
void e2e_mkkey(char *buf, size_t n, const char *tag);
/* Largest value of metric name (Prometheus text) over the samples whose labels contain every given label text
 * (NULL-terminated), or -1 when there is none. A metric without labels matches with labels = {NULL}. */
double e2e_metric_value(const char *text, const char *name, const char *const *labels);

/* "Authorization: Bearer <token>" (heap, caller frees; no CR LF) for a JWT of that header and payload (JSON texts),
 * signed HS256 with secret. */
char *e2e_bearer_hs256(const char *hdr, const char *payload, const char *secret);

/* The environment (e2e_gw_opts.env) of a gateway whose wall clock is shift_ms off through the clockshift shim
 * (tests/tools/clockshift.c, LD_PRELOAD): NULL-terminated, static storage (the next call overwrites it); NULL when
 * shift_ms is 0. */
const char *const *e2e_clock_env(long shift_ms);

/* Monotonic milliseconds. */
uint64_t e2e_now_ms(void);
void e2e_sleep_ms(int ms);

/* ---- pipeline room: SQL through psql (the test superuser's URL, IDEMGATE_TEST_PG_ADMIN_URL) */
/* Runs sql; returns its unaligned, tuples-only output (heap, caller frees; trailing newline removed); fails the
 * test on error (bounded by 20 s). */
char *e2e_psql(const char *sql);
/* The same, for a query answering one integer. */
long e2e_psql_long(const char *sql);

/* ---- services of a test's own (wt-chaos): scripts/services.sh on a directory the test started itself, e.g. a
 * primary with a synchronous standby (standby-start, standby-down, standby-up, promote). */
/* Runs scripts/services.sh CMD DIR [ARG] (bounded by 90 s); its exit code (the script's stderr on failure). */
int e2e_services_in(const char *dir, const char *cmd, const char *arg);
/* NAME's value in DIR/env (quotes removed), heap; NULL when missing. */
char *e2e_services_env(const char *dir, const char *name);
/* A store on a test's own Postgres and Redis (pg, redis: URLs or template variables; pool: a number, as text),
 * one upstream "api" ({{UPSTREAM_URL}}, 5 s) and one route "pay" on /v1/pay: key required, a 2 s lease,
 * on_unknown: reject (it never re-executes). After E2E_CONF_PORTS. */
/* clang-format off */
#define E2E_CONF_OWN_PAY(pg, redis, pool)                                                                              \
    "store:\n"                                                                                                         \
    "  postgres: \"" pg "\"\n"                                                                                          \
    "  pool: " pool "\n"                                                                                               \
    "  redis: \"" redis "\"\n"                                                                                          \
    "upstreams:\n"                                                                                                     \
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")                                                                 \
    "routes:\n"                                                                                                        \
    E2E_CONF_ROUTE("pay", "/v1/pay", "api")                                                                            \
    "      key: required\n"                                                                                            \
    "      lease: 2s\n"                                                                                                \
    "      on_unknown: reject\n"
/* clang-format on */

/* ---- replay cache tests (cache_test, shed_test): shared helpers */
/* Expects rep to repeat orig: status, every header but Date and Idempotent-Replayed with its value in order, and the
 * body byte for byte; what names the comparison in failures. */
void e2e_expect_same_answer(const struct e2e_resp *orig, const struct e2e_resp *rep, const char *what);

/* ---- engine matrix (Citus room) */
/* IDEMGATE_TEST_ENGINE=citus: points the test's Postgres/Redis/services variables at the Citus cluster's
 * (IDEMGATE_TEST_CITUS_*; fails the test when they are missing) and sets IDEMGATE_STORE_DISTRIBUTED=citus for
 * the gateways it starts. Unset or "postgres": nothing changes. Called by the fixtures' setup. */
void e2e_engine_apply(void);
/* True when this run is against the Citus cluster. */
bool e2e_engine_citus(void);

/* name's full path from PATH (e2e_run executes a path, not a name), into out; fails the test when missing. */
const char *e2e_in_path(const char *name, char *out, size_t n);
/* Starts redis-server on a unix socket only (no TCP port) in the test's temp dir, killed with the test process;
 * returns its pid once it answers PING (bounded), the socket path in path. The test stops it. */
pid_t e2e_redis_unix_start(char *path, size_t n);
/* Starts argv[0] (absolute path) as a long-running helper (stdout and stderr into a log in the temp dir);
 * e2e_teardown stops it like the gateways. Fails the test when it cannot fork. */
struct e2e_proc *e2e_proc_start(const char *const *argv, const char *what);

#endif
