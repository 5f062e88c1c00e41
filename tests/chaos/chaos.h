/* chaos.h - the chaos checker's shared run state, records and small helpers (util.c); each room's API is in its
 * own header: gate.h (upstream kill switch), gateways.h (processes), faults.h (injector), traffic.h (clients),
 * checks.h (history checks), reconcile.h (the closing reconciliation). */
#ifndef CHAOS_CHAOS_H
#define CHAOS_CHAOS_H

#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <curl/curl.h>

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
#define CH_MAX_PAUSED     256                      /* Postgres processes one pause may stop */
#define CH_ADMIN_TOKEN    "chaos-admin-token-3f9a" /* the gateways' IDEMGATE_ADMIN_TOKEN (the purge rounds) */
#define CH_PURGE_PREFIX   "purge-"                 /* the purge rounds' keys (not the clients') */

/* Fault kinds; their names, injectors and properties are the table in faults.c. */
enum fkind {
    F_GW_KILL,
    F_PG_RESTART,
    F_REDIS_RESTART,
    F_REDIS_FLUSH,
    F_UPSTREAM_DOWN,
    F_PG_PAUSE,
    F_PG_COMMIT_ERR,
    F_PG_SERIALIZABLE,
    F_PG_FAILOVER,
    F_CITUS_WORKER,      /* a Citus worker stopped (fast) and started again: only with a Citus cluster */
    F_GW_PAUSE,          /* a whole gateway SIGSTOPped for 1 to 3 leases, then SIGCONTed */
    F_REDIS_PAUSE_PURGE, /* Redis SIGSTOPped while an admin purge is acknowledged (a round of its own keys) */
    F__N
};

#define CH_ORD_RESOURCES 4 /* resources of the ordered writers, one thread each */

struct window { /* a fault's time span, for the "could this have made an outcome unknown" question */
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
extern const char *const ch_route_name[2];
extern const char *const ch_route_path[2];

enum mode { M_NORMAL, M_SLOW_OK, M_SLOW_TIMEOUT, M_CLOSE, M_RESET, M_503, M_201, M_400, M__N };
extern const char *const ch_mode_name[M__N];

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
    unsigned fault_mask;       /* 1 << enum fkind: the kinds to inject (--faults) */
    bool faults_given;         /* --faults was given (a kind it names that cannot run is an error) */
    bool reconcile_forget_one; /* test-only: one answered key forgotten upstream before the reconciliation */
    long clock_skew_ms;        /* instance 1's wall clock is this far off (tests/tools/clockshift.c; 0: none) */
};

struct ch_state {
    struct opts o;
    char dir[256];
    char tag[16];
    char pg_url[1024];       /* for the gateways (synchronous_commit=on) */
    char pg_url_raw[1024];   /* as services.sh wrote it (the multi-host URL when the run has a standby) */
    char pg_admin_url[1024]; /* superuser, for the SQL faults (multi-host, read-write, with a standby) */
    char psql_bin[PATH_MAX]; /* for the signal handler's undo of the SQL faults */
    bool has_standby;
    bool has_citus; /* the services are a Citus cluster (CITUS_WORKER_PORTS in their env file) */
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
    atomic_int citus_down; /* the Citus worker that is stopped (1 or 2), 0: none */
    unsigned faults[F__N];
    unsigned fault_failures;
    /* F_REDIS_PAUSE_PURGE's rounds: each checks its key's intents across the purge (faults.c) */
    unsigned purge_rounds, purge_inconclusive, purge_violations;
    struct window win[CH_MAX_WINDOWS];
    size_t nwin;

    struct worker *workers;
    atomic_bool abort;
    /* the ordered writers (traffic.c, one per resource): requests sent, sequences moved past (answered or given
     * up) */
    pthread_t ord_threads[CH_ORD_RESOURCES];
    unsigned ord_started;
    atomic_ulong ord_requests, ord_done;

    /* registry of child pids for the signal handler */
    pthread_mutex_t pid_mu;
    volatile pid_t pids[64];
    /* Postgres processes stopped by a pause: the signal handler and teardown SIGCONT them */
    volatile pid_t paused[CH_MAX_PAUSED];
    /* an SQL fault is installed: the signal handler runs the undo command (argv prepared in advance) */
    volatile sig_atomic_t sql_fault_active;
    char *undo_argv[12];
};

/* The one run: options, processes, the fault log, the clients' records (the signal handler needs it global). */
extern struct ch_state ch;

/* ---- util.c: basics (allocation aborts on out-of-memory) */
void *ch_xmalloc(size_t n);
void *ch_xcalloc(size_t n, size_t sz);
void *ch_xrealloc(void *p, size_t n);
uint64_t ch_mono_ms(void);
uint64_t ch_wall_ms(void);
uint64_t ch_splitmix64(uint64_t *s);
/* A number in [lo, hi]. */
uint64_t ch_rnd_range(uint64_t *s, uint64_t lo, uint64_t hi);
/* Decimal digits only, at most max; false (out untouched) otherwise. */
bool ch_parse_u64(const char *s, uint64_t max, uint64_t *out);

/* ---- util.c: logging (stdout, one line per event, serialised) */
double ch_rel_s(uint64_t mono_ms);
void ch_iso_at(uint64_t mono, char *out, size_t n);
void ch_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void ch_out(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Sleeps ms in slices, returning early when the run aborts. */
void ch_nap(uint64_t ms);

/* ---- util.c: child processes (registered, killed by the signal handler) */
void ch_on_fatal_signal(int sig);
/* Forks and execs argv with stdout+stderr appended to log_path; the child dies with the forking thread
 * (PR_SET_PDEATHSIG). Returns the pid or -1. */
pid_t ch_spawn(char *const argv[], const char *log_path);
/* The same with extra "K=V" entries (NULL-terminated, may be NULL) added to the environment (built before the
 * fork: the child only calls execve). */
pid_t ch_spawn_env(char *const argv[], const char *log_path, char *const extra_env[]);
/* Waits up to timeout_ms for pid; true with *status (may be NULL) when it exited and was reaped. */
bool ch_proc_wait(pid_t pid, int timeout_ms, int *status);
/* sig, then SIGKILL after grace_ms; always reaps. Returns the wait status. */
int ch_proc_stop(pid_t pid, int sig, int grace_ms);
void ch_describe_status(int st, char *buf, size_t n);
/* `bash services.sh CMD DIR [ARG]`, bounded; its exit code, -1 on timeout or spawn failure. */
int ch_services(const char *cmd, const char *arg);
/* The value of NAME in the services' env file (re-read on every call: a failover rewrites it); false when
 * the file or the name is missing. */
bool ch_env_value(const char *name, char *out, size_t n);
/* A free loopback port below the ephemeral range, never one handed out before; 0 when none was found. */
uint16_t ch_pick_port(uint64_t *rng);

/* ---- util.c: HTTP (libcurl easy, bounded) */
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
/* One request (a fresh connection when fresh, so no silent resend by libcurl hides an attempt); method NULL: GET.
 * The body goes to buf (bufcap, truncated beyond: r->trunc). */
void ch_http_do(CURL *c, uint16_t port, const char *method, const char *path, struct curl_slist *hdrs, const char *body,
                size_t blen, long timeout_ms, char *buf, size_t bufcap, bool fresh, struct http_res *r);
bool ch_http_get_ok(CURL *c, uint16_t port, const char *path, long timeout_ms, char *buf, size_t cap);

/* ---- traffic.c: an ordered writer (pthread start routine; arg: the resource's index, cast from uintptr_t): one
 * resource of the route "ord" written with sequences 1, 2, 3... through a random gateway (the same sequence and key
 * again until a final answer), until ch.traffic_end. The upstream counts sequences applied below a resource's
 * highest. */
void *ch_ordered_main(void *arg);

#endif
