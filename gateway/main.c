/* main.c - idemgate's entry point: command line, start-up, signals, graceful drain. It never serves a request itself.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "common/alog.h"
#include "common/metrics.h"
#include "common/version.h"
#include "conf/conf.h"
#include "conf/reference.h"
#include "gateway/admin.h"
#include "gateway/cli_keys.h"
#include "gateway/front.h"
#include "gateway/loop.h"
#include "gateway/reconcile.h"
#include "gateway/reload.h"
#include "store/store.h"
#include "upstream/trace.h"

#define MIGRATE_TIMEOUT_MS 5000
#define MIGRATE_RETRY_MS   2000
#define ABORT_WAIT_MS      7000
#define ACCEPT_MAX         64 /* --accept-identity-change names */

static void usage(FILE *out)
{
    fprintf(out, "usage: idemgate -c FILE          run with this configuration (--config FILE)\n"
                 "       idemgate --check -c FILE  validate the configuration, print what is wrong, exit 0/1\n"
                 "       idemgate --version\n"
                 "       idemgate --print-reference  every configuration key as Markdown (docs/configuration.md)\n"
                 "       idemgate reconcile -c FILE --route R [--since 24h] [--state completed|unknown|all]\n"
                 "                [--rate N/s] [--apply] [--json]  a route's records against its probe look-up\n"
                 "       idemgate keys list|show|release|purge|settle [--admin URL] ...  the admin key API\n"
                 "                (idemgate keys --help)\n"
                 "options: --accept-identity-change ROUTE  start although ROUTE's key source, scope or fingerprint\n"
                 "             changed while it has records within retention (repeat it per route)\n"
                 "environment: IDEMGATE_POSTGRES_URL, IDEMGATE_REDIS_URL (empty: no Redis), IDEMGATE_ADMIN_TOKEN,\n"
                 "             IDEMGATE_STORE_DISTRIBUTED (none|citus: store.distributed),\n"
                 "             IDEMGATE_LOG_LEVEL (debug|info|warn|error)\n");
}

/* The routes named by --accept-identity-change. */
struct accept_list {
    const char *names[ACCEPT_MAX];
    size_t n;
};

struct migrator {
    const struct conf *conf;
    const struct accept_list *accept;
    atomic_bool refused; /* a route's identity changed under its records: the process stops (exit 1) */
    struct gw_loops *loops;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
};

/* The schema, then the routes' identities (SPEC 8). true: ready; false with *refused (an identity changed under
 * records; *err says which) or without (Postgres failed: try again later). */
static bool prepare_store(const struct conf *conf, const struct accept_list *accept, bool *refused, char **err)
{
    *refused = false;
    return store_migrate(conf->postgres_url, conf->distributed, MIGRATE_TIMEOUT_MS, err) &&
           store_identity_check(conf->postgres_url, conf, accept->names, accept->n, MIGRATE_TIMEOUT_MS, refused, err);
}

static void log_refused(const char *err)
{
    char q[2048];
    cm_log(CM_ERROR, "start_refused", "reason=route_identity error=%s", cm_log_quote(q, sizeof q, err ? err : "?"));
}

/* Retries the schema migration until it succeeds or the process stops. */
static void *migrate_main(void *arg)
{
    struct migrator *m = arg;
    for (;;) {
        char *err = NULL;
        bool refused = false;
        if (prepare_store(m->conf, m->accept, &refused, &err)) {
            gw_loops_set_schema_ready(m->loops, true);
            cm_log(CM_INFO, "schema_ready", NULL);
            return NULL;
        }
        if (refused) { /* no keyed request was served yet (the schema was not ready): stop */
            log_refused(err);
            free(err);
            atomic_store(&m->refused, true);
            kill(getpid(), SIGTERM);
            return NULL;
        }
        char q[512];
        cm_log(CM_WARN, "schema_unavailable", "error=%s retry_ms=%d", cm_log_quote(q, sizeof q, err ? err : "?"),
               MIGRATE_RETRY_MS);
        free(err);
        pthread_mutex_lock(&m->mu);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += MIGRATE_RETRY_MS / 1000;
        while (!m->stop && pthread_cond_timedwait(&m->cv, &m->mu, &ts) != ETIMEDOUT) {
        }
        bool stop = m->stop;
        pthread_mutex_unlock(&m->mu);
        if (stop)
            return NULL;
    }
}

static void raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
            cm_log(CM_WARN, "rlimit", "msg=\"cannot raise RLIMIT_NOFILE\"");
    }
}

static void set_log_level(void)
{
    const char *lv = getenv("IDEMGATE_LOG_LEVEL");
    if (!lv)
        return;
    if (strcmp(lv, "debug") == 0)
        cm_log_set_level(CM_DEBUG);
    else if (strcmp(lv, "warn") == 0)
        cm_log_set_level(CM_WARN);
    else if (strcmp(lv, "error") == 0)
        cm_log_set_level(CM_ERROR);
}

/* Waits until cond(arg) is false or the deadline passes; true when drained. */
static bool wait_until(bool (*busy)(void *), void *arg, uint64_t deadline_ms)
{
    while (busy(arg)) {
        if (cm_now_ms() >= deadline_ms)
            return false;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return true;
}

struct running {
    struct gw_loops *loops;
    struct gw_front *front;
    struct gw_admin *admin;
};

static bool jobs_busy(void *arg)
{
    struct running *r = arg;
    return gw_front_suspended(r->front) > 0 || gw_loops_jobs(r->loops) > 0 || gw_admin_jobs(r->admin) > 0;
}

/* Runs until SIGTERM/SIGINT; SIGHUP reloads file. gc is the start-time configuration (the caller keeps its
 * reference: the store and the admin listener use it until the end). */
/* gw_reload's swap (gateway/reload.h): the new configuration goes into every loop. */
static bool swap_loops(void *arg, struct gw_conf *c, uint64_t timeout_ms)
{
    return gw_loops_swap(arg, c, timeout_ms);
}

/* SPEC 11 drain: /readyz is already 503; the listeners keep accepting and serving for delay_ms, so that a load
 * balancer stops sending before the port closes. A second SIGTERM or SIGINT ends it early; a SIGHUP is ignored. */
static void drain(uint64_t delay_ms, sigset_t set)
{
    if (delay_ms == 0)
        return;
    cm_log(CM_INFO, "draining", "delay_ms=%llu", (unsigned long long)delay_ms);
    uint64_t end = cm_now_ms() + delay_ms;
    for (uint64_t now = cm_now_ms(); now < end; now = cm_now_ms()) {
        uint64_t left = end - now;
        struct timespec ts = {(time_t)(left / 1000), (long)(left % 1000) * 1000000L};
        int sig = sigtimedwait(&set, NULL, &ts);
        if (sig == SIGTERM || sig == SIGINT) {
            cm_log(CM_INFO, "drain_cut", "signal=%s", sig == SIGINT ? "SIGINT" : "SIGTERM");
            return;
        }
    }
}

static int run(const char *file, struct gw_conf *gc, const struct accept_list *accept)
{
    const struct conf *conf = gc->conf;
    struct gw_conf *cur = gw_conf_ref(gc); /* the configuration in force */
    char *err = NULL;
    char q[512];
    int rc = 1;
    struct gw_loops *loops = NULL;
    struct gw_front *front = NULL;
    struct gw_admin *admin = NULL;
    struct up_tracer *tracer = NULL;
    struct migrator mig = {.conf = conf, .accept = accept};
    atomic_init(&mig.refused, false);
    bool mig_started = false;
    pthread_mutex_init(&mig.mu, NULL);
    pthread_cond_init(&mig.cv, NULL);

    /* Migrate before the pool connects, so its statements prepare at once;
     * when Postgres is not there yet, a thread keeps trying in the background
     * and idempotent requests get 503 until then. */
    char *merr = NULL;
    bool refused = false;
    bool migrated = prepare_store(conf, accept, &refused, &merr);
    if (refused) {
        log_refused(merr);
        free(merr);
        goto out;
    }
    if (!migrated)
        cm_log(CM_WARN, "schema_unavailable", "error=%s retry_ms=%d", cm_log_quote(q, sizeof q, merr ? merr : "?"),
               MIGRATE_RETRY_MS);
    free(merr);

    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    /* One I/O loop per CPU (threads: N sets it): each loop thread runs its
     * own HTTP daemon, curl multi, Redis context and share of the pool. */
    size_t nloops = conf->threads ? conf->threads : (ncpu > 0 ? (size_t)ncpu : 1);
    loops = gw_loops_create(conf, nloops, &err);
    if (!loops) {
        cm_log(CM_ERROR, "start_failed", "error=%s", cm_log_quote(q, sizeof q, err ? err : "?"));
        goto out;
    }
    gw_loops_install(loops, gc);
    if (conf->tracing_otlp != NULL) {
        tracer = up_tracer_create(&(struct up_tracer_opts){.url = conf->tracing_otlp, .sample = conf->tracing_sample});
        gw_loops_set_tracer(loops, tracer); /* NULL (it could not start, logged): no tracing */
    }
    if (!gw_loops_start(loops)) {
        cm_log(CM_ERROR, "start_failed", "error=\"cannot start the I/O thread\"");
        goto out;
    }
    mig.loops = loops;
    if (migrated) {
        gw_loops_set_schema_ready(loops, true);
        cm_log(CM_INFO, "schema_ready", NULL);
    } else {
        if (pthread_create(&mig.thread, NULL, migrate_main, &mig) != 0) {
            cm_log(CM_ERROR, "start_failed", "error=\"cannot start the migration thread\"");
            goto out;
        }
        mig_started = true;
    }

    front = gw_front_start(conf, gc->listen_tls, loops, &err);
    if (!front) {
        cm_log(CM_ERROR, "start_failed", "error=%s", cm_log_quote(q, sizeof q, err ? err : "?"));
        goto out;
    }
    char addr[320];
    cm_log(CM_INFO, "listening", "addr=%s", conf_addr_fmt(addr, sizeof addr, conf->listen.host, gw_front_port(front)));
    if (conf->admin_enabled) {
        admin = gw_admin_start(conf, gc->admin_tls, loops->v[0], &err);
        if (!admin) {
            cm_log(CM_ERROR, "start_failed", "error=%s", cm_log_quote(q, sizeof q, err ? err : "?"));
            goto out;
        }
        cm_log(CM_INFO, "admin_listening", "addr=%s",
               conf_addr_fmt(addr, sizeof addr, conf->admin_listen.host, gw_admin_port(admin)));
    }
    char pg[512], rd[512];
    cm_log(CM_INFO, "started", "version=%s routes=%zu upstreams=%zu postgres=%s redis=%s pool=%u loops=%zu",
           IDEMGATE_VERSION, conf->routes_n, conf->upstreams_n,
           cm_log_quote(pg, sizeof pg, cm_redact_url(q, sizeof q, conf->postgres_url)),
           conf->redis_url ? cm_log_quote(rd, sizeof rd, cm_redact_url(q, sizeof q, conf->redis_url)) : "none",
           conf->pool, loops->n);

    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGUSR1);
    int sig = 0;
    for (;;) {
        if (sigwait(&set, &sig) != 0)
            continue;
        if (sig == SIGUSR1) { /* logrotate moved the access log: a new file at the path */
            cm_alog_reopen();
            continue;
        }
        if (sig != SIGHUP)
            break;
        struct gw_conf *neu = gw_reload(file, cur, swap_loops, loops);
        if (neu) {
            gw_front_tls_set(front, neu->listen_tls); /* new handshakes; open connections keep theirs */
            gw_admin_tls_set(admin, neu->admin_tls);
            gw_conf_unref(cur);
            cur = neu;
        }
    }
    uint64_t grace_ms = cur->conf->shutdown_grace_ms;
    cm_log(CM_INFO, "stopping", "signal=%s grace_ms=%llu jobs=%zu", sig == SIGINT ? "SIGINT" : "SIGTERM",
           (unsigned long long)grace_ms, gw_loops_jobs(loops));

    gw_admin_draining(admin);
    drain(cur->conf->shutdown_delay_ms, set);
    gw_front_quiesce(front);
    struct running r = {loops, front, admin};
    if (!wait_until(jobs_busy, &r, cm_now_ms() + grace_ms)) {
        cm_log(CM_WARN, "grace_expired", "jobs=%zu", gw_loops_jobs(loops));
        gw_loops_abort_all(loops);
        /* Jobs waiting for the store finish within its own timeouts. */
        if (!wait_until(jobs_busy, &r, cm_now_ms() + ABORT_WAIT_MS)) {
            /* Stopping the HTTP daemon with suspended connections is not
             * defined: leave at once; every record is already in Postgres
             * (in flight: unknown after its lease, never released). */
            cm_log(CM_ERROR, "stop_incomplete", "jobs=%zu suspended=%ld", gw_loops_jobs(loops),
                   gw_front_suspended(front));
            _exit(0);
        }
    }
    /* Let resumed connections flush their answers. */
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
    rc = atomic_load(&mig.refused) ? 1 : 0;
out:
    free(err);
    if (mig_started) {
        pthread_mutex_lock(&mig.mu);
        mig.stop = true;
        pthread_cond_signal(&mig.cv);
        pthread_mutex_unlock(&mig.mu);
        pthread_join(mig.thread, NULL);
    }
    gw_admin_stop(admin);
    gw_front_stop(front);
    gw_loops_destroy(loops);
    up_tracer_destroy(tracer); /* after the loops: no job submits a span any more */
    gw_conf_unref(cur);
    pthread_mutex_destroy(&mig.mu);
    pthread_cond_destroy(&mig.cv);
    cm_metrics_reset();
    cm_log(CM_INFO, "stopped", "exit=%d", rc);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "reconcile") == 0)
        return gw_reconcile_main(argc - 1, argv + 1);
    if (argc > 1 && strcmp(argv[1], "keys") == 0)
        return gw_cli_keys_main(argc - 1, argv + 1);
    const char *file = NULL;
    bool check = false;
    struct accept_list accept = {.n = 0};
    for (int i = 1; i < argc; i++) {
        const char *route = NULL;
        if (strcmp(argv[i], "--accept-identity-change") == 0 && i + 1 < argc)
            route = argv[++i];
        else if (strncmp(argv[i], "--accept-identity-change=", 25) == 0)
            route = argv[i] + 25;
        if (route) {
            if (accept.n == ACCEPT_MAX || !*route) {
                fprintf(stderr, "idemgate: --accept-identity-change: a route name, at most %d of them\n", ACCEPT_MAX);
                return 1;
            }
            accept.names[accept.n++] = route;
            continue;
        }
        if (strcmp(argv[i], "--version") == 0 || strcmp(argv[i], "-V") == 0) {
            printf("idemgate %s\n", IDEMGATE_VERSION);
            return 0;
        } else if (strcmp(argv[i], "--print-reference") == 0) {
            char *md = conf_reference_markdown();
            if (md == NULL || fputs(md, stdout) == EOF || fflush(stdout) != 0) {
                fprintf(stderr, "idemgate: cannot write the reference\n");
                free(md);
                return 1;
            }
            free(md);
            return 0;
        } else if (strcmp(argv[i], "--check") == 0) {
            check = true;
        } else if ((strcmp(argv[i], "-c") == 0 || strcmp(argv[i], "--config") == 0) && i + 1 < argc) {
            file = argv[++i];
        } else if (strncmp(argv[i], "--config=", 9) == 0) {
            file = argv[i] + 9;
        } else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "idemgate: unknown or incomplete argument '%s'\n", argv[i]);
            usage(stderr);
            return 1;
        }
    }
    if (!file) {
        usage(stderr);
        return 1;
    }
    set_log_level();
    char *err = NULL;
    /* the JWT keys are part of the configuration: a bad JWKS or a missing secret fails here */
    struct gw_conf *gc = gw_conf_load(file, &err);
    if (!gc) {
        char fq[1024], q[2048];
        cm_log(CM_ERROR, "config_invalid", "file=%s error=%s", cm_log_quote(fq, sizeof fq, file),
               cm_log_quote(q, sizeof q, err ? err : "?"));
        free(err);
        return 1;
    }
    const struct conf *conf = gc->conf;
    cm_log_set_format(conf->log_format == CONF_LOG_JSON ? CM_LOG_JSON : CM_LOG_LOGFMT); /* every line from here */
    /* SPEC 9: an idempotent route without a scope shares one key space between all its clients. */
    gw_warn_unscoped(conf);
    if (check) {
        char fq[1024];
        cm_log(CM_INFO, "config_ok", "file=%s routes=%zu upstreams=%zu", cm_log_quote(fq, sizeof fq, file),
               conf->routes_n, conf->upstreams_n);
        gw_conf_unref(gc);
        return 0;
    }
    raise_nofile();
    signal(SIGPIPE, SIG_IGN);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &set, NULL); /* every thread inherits this; main takes them with sigwait */
    /* SPEC 11: the access log's writer thread starts with the signals blocked too */
    if (!cm_alog_open(conf->access_log, &err)) {
        cm_log(CM_ERROR, "start_failed", "error=%s", err ? err : "?");
        free(err);
        gw_conf_unref(gc);
        return 1;
    }
    gw_conf_label(gc);
    int rc = run(file, gc, &accept);
    cm_alog_close();
    gw_conf_unref(gc);
    return rc;
}
