/* main.c - the chaos checker: options, set-up (testupstream, the gate, the gateways), the traffic and fault
 * threads, the quiet period, the checks, and teardown on every path.
 *
 * How it works (see also tests/chaos/run.sh and README "The chaos checker"):
 *
 *   clients (traffic.c) ──► idemgate g0 / g1 ──► gate (gate.c) ──► testupstream
 *                                 │
 *                        Postgres (+ a standby) + Redis (scripts/services.sh)
 *
 * The upstream that the gateways see is the gate: a byte relay in this process. "Upstream down" closes the gate's
 * listener (connections refused) and resets every relayed connection (an upstream crash as the gateways see it),
 * while testupstream itself keeps running and so keeps its per-key execution counts, which are the ground truth
 * of the at-most-once check. The fault schedule (faults.c) runs in one thread, one fault at a time from its
 * table, each logged as a time window. Every client retries like a real one and records what each attempt saw;
 * the checks (checks.c) compare that with the upstream's counts and the idemgate_keys table, after a quiet period
 * longer than the lease.
 *
 * Two routes: "pay" (on_unknown: retry) and "book" (on_unknown: reject), lease 2s, upstream timeout 3s (longer
 * than the lease, so a slow answer needs the owner to renew its lease), release_statuses [503]. Requests ask the
 * upstream (on their first attempt only, as a transient failure would) to be slow (longer than the lease), slower
 * than the timeout, to close or reset after executing, or to answer 503 (pay only); some ask for a 201 or a 400
 * business answer on every attempt. 8% of the keys are shared by the two tenants of a worker pair (book route):
 * each tenant must get its own execution and its own answer. A third of the clients give up on an attempt after
 * 1.2s (shorter than the slow answers), the others wait 9s.
 *
 * The gateways' Postgres URL asks for synchronous_commit=on: the throwaway cluster runs with it off, and an
 * immediate (crash) shutdown then loses recently committed claims - no gateway can keep a promise its authority
 * forgot (--pg-async shows it).
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checks.h"
#include "faults.h"
#include "gate.h"
#include "gateways.h"
#include "traffic.h"

/* The store URLs from the services' env file: the multi-host ones (target_session_attrs=read-write) when the
 * services have a standby, so that the gateways and the checks follow a failover. */
static bool read_services_env(void)
{
    char v[16];
    ch.has_standby = ch_env_value("PG_STANDBY_PORT", v, sizeof v) && v[0] != '\0';
    char workers[64];
    ch.has_citus = ch_env_value("CITUS_WORKER_PORTS", workers, sizeof workers) && workers[0] >= '0' &&
                   workers[0] <= '9'; /* a port number: not empty, not "" */
    /* the gateways it starts inherit it: store.distributed: citus */
    if (ch.has_citus && setenv("IDEMGATE_STORE_DISTRIBUTED", "citus", 1) != 0)
        return false;
    const char *url = ch.has_standby ? "IDEMGATE_TEST_PG_MULTI_URL" : "IDEMGATE_TEST_PG_URL";
    const char *admin = ch.has_standby ? "IDEMGATE_TEST_PG_MULTI_ADMIN_URL" : "IDEMGATE_TEST_PG_ADMIN_URL";
    if (!ch_env_value(url, ch.pg_url_raw, sizeof ch.pg_url_raw) ||
        !ch_env_value("IDEMGATE_TEST_REDIS_URL", ch.redis_url, sizeof ch.redis_url) || ch.pg_url_raw[0] == '\0' ||
        ch.redis_url[0] == '\0') {
        fprintf(stderr, "chaos: %s/env lacks %s or IDEMGATE_TEST_REDIS_URL (or cannot be read)\n", ch.o.services_dir,
                url);
        return false;
    }
    if (!ch_env_value(admin, ch.pg_admin_url, sizeof ch.pg_admin_url))
        ch.pg_admin_url[0] = '\0';
    char bin[PATH_MAX - 8];
    if (ch_env_value("PGBIN", bin, sizeof bin) && bin[0] != '\0')
        snprintf(ch.psql_bin, sizeof ch.psql_bin, "%s/psql", bin);
    if (ch.o.pg_async)
        snprintf(ch.pg_url, sizeof ch.pg_url, "%s", ch.pg_url_raw);
    else
        snprintf(ch.pg_url, sizeof ch.pg_url, "%.900s%soptions=-c%%20synchronous_commit%%3Don", ch.pg_url_raw,
                 strchr(ch.pg_url_raw, '?') ? "&" : "?");
    return true;
}

static void teardown(void)
{
    ch_faults_undo(); /* a paused Postgres or an armed trigger must not outlive a failure path */
    for (unsigned i = 0; i < ch.o.instances; i++) {
        struct inst *g = &ch.inst[i];
        if (g->pid > 0) {
            int st = ch_proc_stop(g->pid, SIGTERM, 8000);
            char d[32];
            ch_describe_status(st, d, sizeof d);
            ch_log("event=gateway_stopped instance=%d %s", g->idx, d);
            g->pid = 0;
        }
    }
    if (ch.tu_pid > 0) {
        ch_proc_stop(ch.tu_pid, SIGTERM, 3000);
        ch.tu_pid = 0;
    }
    if (ch.gate_started) {
        atomic_store(&ch.gate_stop, true);
        pthread_join(ch.gate_thread, NULL);
        ch.gate_started = false;
    }
    if (ch.fault_started) {
        atomic_store(&ch.abort, true);
        atomic_store(&ch.fault_release, true);
        pthread_join(ch.fault_thread, NULL);
        ch.fault_started = false;
        ch_faults_undo();
    }
    /* anything left in the registry (should be nothing) */
    for (size_t i = 0; i < sizeof ch.pids / sizeof ch.pids[0]; i++)
        if (ch.pids[i] > 0) {
            kill(ch.pids[i], SIGKILL);
            (void)waitpid(ch.pids[i], NULL, 0);
            ch.pids[i] = 0;
        }
}

static void rm_rf_dir(const char *dir)
{
    char *argv[] = {(char *)"/bin/rm", (char *)"-rf", (char *)dir, NULL};
    char log[] = "/dev/null";
    pid_t p = ch_spawn(argv, log);
    if (p > 0)
        (void)ch_proc_wait(p, 30000, NULL);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: chaos --build DIR --services-dir DIR [--duration SECONDS] [--workers N] [--instances 1|2]\n"
               "             [--seed S] [--services-sh PATH] [--lease-ms N] [--upstream-timeout-ms N] [--keep]\n"
               "             [--no-faults] [--faults LIST] [--pg-async] [--clock-skew-ms N] [--reconcile-forget-one]\n"
               "  --faults: comma-separated fault kinds, or all (the default; failover only when the services have a\n"
               "            standby): gateway_kill,postgres_restart,redis_restart,redis_flush,upstream_down,\n"
               "            postgres_pause,commit_errors,serializable_default,failover,citus_worker_restart,\n"
               "            gateway_pause,redis_pause_purge\n"
               "            (citus_worker_restart only on a Citus cluster, where the two SQL faults do not run)\n"
               "  --services-dir: a directory started by scripts/services.sh (its env file is read)\n"
               "  --services-sh: scripts/services.sh (default $IDEMGATE_SERVICES_SH)\n"
               "  --keep: keep the run directory (configs, gateway logs) even when every check passes\n"
               "  --pg-async: keep the cluster's synchronous_commit=off (demonstrates lost commits on a crash)\n"
               "  --clock-skew-ms: instance 1's wall clock runs this far ahead (default 120000; 0: none), through\n"
               "                   BUILD/tests/tools/libclockshift.so\n"
               "  --reconcile-forget-one: test-only: the upstream forgets one answered key of route pay before the\n"
               "                          closing reconciliation, which must then fail with missing=1\n");
}

static bool parse_args(int argc, char **argv)
{
    struct opts *o = &ch.o;
    o->duration_s = 60;
    o->workers = 32;
    o->instances = 2;
    o->seed = ch_wall_ms() ^ ((uint64_t)getpid() << 20);
    o->lease_ms = 2000;
    o->up_timeout_ms = 3000;
    o->clock_skew_ms = 120000;
    o->services_sh = getenv("IDEMGATE_SERVICES_SH");
    o->fault_mask = (1u << F__N) - 1;
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
        if (strcmp(a, "--reconcile-forget-one") == 0) {
            o->reconcile_forget_one = true;
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
        else if (strcmp(a, "--duration") == 0 && ch_parse_u64(v, 86400, &n) && n >= 5)
            o->duration_s = (unsigned)n;
        else if (strcmp(a, "--workers") == 0 && ch_parse_u64(v, CH_MAX_WORKERS, &n) && n >= 1)
            o->workers = (unsigned)n;
        else if (strcmp(a, "--instances") == 0 && ch_parse_u64(v, CH_MAX_INST, &n) && n >= 1)
            o->instances = (unsigned)n;
        else if (strcmp(a, "--seed") == 0 && ch_parse_u64(v, UINT64_MAX, &n))
            o->seed = n;
        else if (strcmp(a, "--lease-ms") == 0 && ch_parse_u64(v, 60000, &n) && n >= 500)
            o->lease_ms = (unsigned)n;
        else if (strcmp(a, "--faults") == 0) {
            char err[512];
            if (!ch_faults_parse(v, &o->fault_mask, err, sizeof err)) {
                fprintf(stderr, "chaos: --faults: %s\n", err);
                return false;
            }
            o->faults_given = true;
        } else if (strcmp(a, "--upstream-timeout-ms") == 0 && ch_parse_u64(v, 60000, &n) && n >= 500)
            o->up_timeout_ms = (unsigned)n;
        else if (strcmp(a, "--clock-skew-ms") == 0 && ch_parse_u64(v, 86400000, &n))
            o->clock_skew_ms = (long)n;
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
    char *buf = ch_xmalloc(CH_BODY_CAP);
    char hk[96];
    snprintf(hk, sizeof hk, "Idempotency-Key: probe-%s", ch.tag);
    struct curl_slist *h = curl_slist_append(NULL, hk);
    h = curl_slist_append(h, "Authorization: Bearer probe");
    bool ok = true;
    for (unsigned i = 0; i < ch.o.instances && ok; i++) {
        struct http_res r;
        uint64_t end = ch_mono_ms() + 15000; /* a fresh gateway answers 503 until its pool has connected */
        do {
            ch_http_do(c, ch.inst[i].port, "POST", ch_route_path[RT_RETRY], h, "{}", 2, 5000, buf, CH_BODY_CAP, true,
                       &r);
            if (r.cc == CURLE_OK && r.status == 503 && r.exec[0] == '\0') {
                ch_nap(100);
            } else if (r.cc == CURLE_OK && r.status == 409 && i > 0) {
                /* the key completed on instance 0 a moment ago: a replay is due, yet a Redis in-flight
                 * marker not yet replaced by the cached answer can answer 409 (observed at start-up) */
                ch_log("event=probe_note instance=%u msg=\"409 for a key completed on instance 0\" body=%.160s", i,
                       buf);
                ch_nap(100);
            } else {
                break;
            }
        } while (ch_mono_ms() < end);
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
    pthread_mutex_init(&ch.log_mu, NULL);
    pthread_mutex_init(&ch.win_mu, NULL);
    pthread_mutex_init(&ch.pid_mu, NULL);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!parse_args(argc, argv)) {
        printf("0 passed, 1 failed\n");
        return 2;
    }
    ch.t0 = ch_mono_ms();
    ch.wall0 = ch_wall_ms();
    uint64_t tr = ch.o.seed ^ ch_wall_ms() ^ ((uint64_t)getpid() << 32);
    snprintf(ch.tag, sizeof ch.tag, "%08" PRIx32, (uint32_t)ch_splitmix64(&tr));
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = ch_on_fatal_signal;
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
    snprintf(ch.idemgate_bin, sizeof ch.idemgate_bin, "%s/idemgate", ch.o.build);
    snprintf(ch.upstream_bin, sizeof ch.upstream_bin, "%s/tests/tools/testupstream", ch.o.build);
    snprintf(ch.dir, sizeof ch.dir, "/tmp/idemgate-chaos.XXXXXX");
    if (access(ch.idemgate_bin, X_OK) != 0 || access(ch.upstream_bin, X_OK) != 0) {
        fprintf(stderr, "chaos: %s or %s is missing (build first)\n", ch.idemgate_bin, ch.upstream_bin);
        goto done;
    }
    if (mkdtemp(ch.dir) == NULL) {
        fprintf(stderr, "chaos: mkdtemp: %s\n", strerror(errno));
        ch.dir[0] = '\0';
        goto done;
    }
    chmod(ch.dir, 0755);
    if (!read_services_env() || !ch_faults_settle_mask() || !ch_faults_prepare())
        goto done;
    ch_log("event=start seed=%" PRIu64 " tag=%s workers=%u instances=%u duration_s=%u lease_ms=%u "
           "upstream_timeout_ms=%u dir=%s synchronous_commit=%s standby=%d faults=0x%x",
           ch.o.seed, ch.tag, ch.o.workers, ch.o.instances, ch.o.duration_s, ch.o.lease_ms, ch.o.up_timeout_ms, ch.dir,
           ch.o.pg_async ? "cluster-default" : "on", ch.has_standby, ch.o.fault_mask);
    if (ch_services("status", NULL) != 0) {
        ch_log("event=services_down dir=%s", ch.o.services_dir);
        goto done;
    }

    uint64_t prng = ch.o.seed ^ ch_wall_ms();
    if (!ch_start_testupstream()) {
        ch_log("event=testupstream_failed");
        goto done;
    }
    ch.gate_port = ch_pick_port(&prng);
    atomic_store(&ch.gate_want_up, true);
    if (ch.gate_port == 0 || pthread_create(&ch.gate_thread, NULL, ch_gate_main, NULL) != 0)
        goto done;
    ch.gate_started = true;
    if (!ch_gate_set(true)) {
        ch_log("event=gate_failed port=%u", (unsigned)ch.gate_port);
        goto done;
    }
    for (unsigned i = 0; i < ch.o.instances; i++) {
        struct inst *g = &ch.inst[i];
        g->idx = (int)i;
        bool ok = false;
        for (int t = 0; t < 4 && !ok; t++) {
            g->port = ch_pick_port(&prng);
            g->admin_port = ch_pick_port(&prng);
            ok = g->port && g->admin_port && ch_write_gw_conf(g) && ch_gw_start(g);
        }
        if (!ok) {
            ch_log("event=gateway_failed instance=%u log=%s", i, g->log);
            goto done;
        }
        ch_log("event=gateway_up instance=%u pid=%ld port=%u admin=%u", i, (long)g->pid, (unsigned)g->port,
               (unsigned)g->admin_port);
    }
    ch_log("event=upstream_up testupstream=%u gate=%u", (unsigned)ch.tu_port, (unsigned)ch.gate_port);
    if (!probe())
        goto done;

    /* traffic + faults */
    uint64_t now = ch_mono_ms();
    ch.traffic_end = now + (uint64_t)ch.o.duration_s * 1000;
    ch.faults_end = ch.traffic_end - 2000;
    ch.workers = ch_xcalloc(ch.o.workers, sizeof *ch.workers);
    for (unsigned w = 0; w < ch.o.workers; w++) {
        ch.workers[w].id = (int)w;
        ch.workers[w].rng = ch.o.seed ^ (0x1000193ull * (w + 1));
        ch.workers[w].max = CH_MAX_USERS / ch.o.workers;
    }
    if (pthread_create(&ch.fault_thread, NULL, ch_fault_main, NULL) != 0)
        goto done;
    ch.fault_started = true;
    unsigned started = 0;
    for (unsigned w = 0; w < ch.o.workers; w++) {
        if (pthread_create(&ch.workers[w].thread, NULL, ch_worker_main, &ch.workers[w]) != 0)
            break;
        started++;
    }
    for (unsigned i = 0; i < CH_ORD_RESOURCES; i++)
        if (pthread_create(&ch.ord_threads[i], NULL, ch_ordered_main, (void *)(uintptr_t)i) == 0)
            ch.ord_started = i + 1;
        else
            break;
    ch_log("event=traffic_start workers=%u ordered_writers=%u", started, ch.ord_started);
    uint64_t last_report = ch_mono_ms();
    while (ch_mono_ms() < ch.traffic_end && !atomic_load(&ch.abort)) {
        ch_nap(200);
        if (ch_mono_ms() - last_report >= 10000) {
            size_t n = 0;
            for (unsigned w = 0; w < started; w++)
                n += ch.workers[w].n;
            ch_log("event=progress requests=%zu", n);
            last_report = ch_mono_ms();
        }
    }
    for (unsigned w = 0; w < started; w++)
        pthread_join(ch.workers[w].thread, NULL);
    for (unsigned i = 0; i < ch.ord_started; i++)
        pthread_join(ch.ord_threads[i], NULL);
    ch.o.workers = started;
    ch_log("event=traffic_end");
    uint64_t bound = ch_mono_ms() + 120000;
    while (!atomic_load(&ch.faults_done) && ch_mono_ms() < bound)
        ch_nap(50);
    ch_faults_heal();
    unsigned quiet = ch.o.lease_ms * 2 + ch.o.up_timeout_ms + 1000;
    ch_log("event=quiet_period ms=%u", quiet);
    ch_nap(quiet);
    ch_log("event=checks");
    checked = ch_run_checks(&passed, &failed);

done:
    teardown();
    if (!checked) {
        passed = 0;
        failed = 1;
    }
    rc = failed ? 1 : 0;
    if (ch.dir[0] != '\0') {
        if (rc == 0 && !ch.o.keep)
            rm_rf_dir(ch.dir);
        else
            ch_out("chaos: run directory kept: %s (gateway logs gw*.log, configs, testupstream.log)\n", ch.dir);
    }
    if (ch.workers != NULL) {
        for (unsigned w = 0; w < ch.o.workers; w++) {
            for (size_t i = 0; i < ch.workers[w].n; i++)
                free(ch.workers[w].users[i].ans_body);
            free(ch.workers[w].users);
            free(ch.workers[w].rbuf);
        }
        free(ch.workers);
    }
    curl_global_cleanup();
    printf("%u passed, %u failed\n", passed, failed);
    return rc;
}
