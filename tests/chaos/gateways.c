/* gateways.c - the processes the checker runs: testupstream and the idemgate instances. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

#include "faults.h"
#include "gateways.h"

bool ch_start_testupstream(void)
{
    char pf[PATH_MAX], log[PATH_MAX];
    snprintf(pf, sizeof pf, "%s/upstream.port", ch.dir);
    snprintf(log, sizeof log, "%s/testupstream.log", ch.dir);
    char *argv[] = {ch.upstream_bin, (char *)"--port", (char *)"0", (char *)"--port-file", pf, (char *)"--quiet", NULL};
    ch.tu_pid = ch_spawn(argv, log);
    if (ch.tu_pid < 0)
        return false;
    uint64_t end = ch_mono_ms() + 10000;
    while (ch_mono_ms() < end) {
        FILE *f = fopen(pf, "r");
        if (f != NULL) {
            char line[32] = "";
            bool got = fgets(line, sizeof line, f) != NULL;
            fclose(f);
            line[strcspn(line, "\r\n")] = '\0';
            uint64_t p = 0;
            if (got && ch_parse_u64(line, 65535, &p) && p > 0) {
                ch.tu_port = (uint16_t)p;
                return true;
            }
        }
        if (ch_proc_wait(ch.tu_pid, 0, NULL)) {
            ch.tu_pid = 0;
            return false;
        }
        ch_nap(20);
    }
    return false;
}

/* A config for the run's store and routes: a gateway's (upstreams through the gate at up_port), or with reconcile
 * the one `idemgate reconcile` reads (upstreams straight at testupstream, every route on_unknown: probe with a look-up
 * by key; no ordering guard, which the look-up does not need). */
static bool write_conf(const char *path, const struct inst *g, uint16_t up_port, bool reconcile)
{
    FILE *f = fopen(path, "w");
    if (f == NULL)
        return false;
    static const char probe[] = "probe\n"
                                "      probe:\n"
                                "        path: /_lookup?idempotency_key={key}\n"
                                "        keys_unique_upstream: true\n"
                                "        grace: 0s\n";
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
            "  - name: ordapi\n"
            "    url: http://127.0.0.1:%u\n"
            "    connect_timeout: 500ms\n"
            "    timeout: %ums\n"
            "    max_connections: 1\n"
            "routes:\n",
            (unsigned)g->port, (unsigned)g->admin_port, ch.pg_url, ch.redis_url, (unsigned)up_port, ch.o.up_timeout_ms,
            (unsigned)up_port, ch.o.up_timeout_ms);
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
                "      release_statuses: [503]\n"
                "      max_body: 64KiB\n"
                "      forward_key: true\n"
                "      on_unknown: %s",
                ch_route_name[rt], ch_route_name[rt], ch.o.lease_ms,
                reconcile        ? probe
                : rt == RT_RETRY ? "retry\n"
                                 : "reject\n");
    /* the ordering guard's route (traffic.c's ordered writers; checked: sequences applied in order), on an upstream
     * of its own (the same gate) with one connection: its requests often wait for it */
    fprintf(f,
            "  - name: ord\n"
            "    match:\n"
            "      path_prefix: /v1/ord\n"
            "      methods: [POST]\n"
            "    upstream: ordapi\n"
            "    idempotency:\n"
            "      key: required\n"
            "      lease: %ums\n"
            "      on_unknown: %s",
            ch.o.lease_ms, reconcile ? probe : "reject\n");
    if (!reconcile)
        fprintf(f, "    ordering:\n"
                   "      resource: /v1/ord/{id}\n"
                   "      sequence: header:X-Sequence\n"
                   "      on_gap: accept\n"
                   "      hold: 1s\n");
    return fclose(f) == 0;
}

bool ch_write_gw_conf(struct inst *g)
{
    snprintf(g->conf, sizeof g->conf, "%s/gw%d.yaml", ch.dir, g->idx);
    return write_conf(g->conf, g, ch.gate_port, false);
}

bool ch_write_reconcile_conf(const char *path)
{
    return write_conf(path, &ch.inst[0], ch.tu_port, true);
}

/* Starts instance g on its ports without waiting. Returns the pid or -1. */
pid_t ch_gw_spawn(struct inst *g)
{
    snprintf(g->log, sizeof g->log, "%s/gw%d.log", ch.dir, g->idx);
    FILE *lf = fopen(g->log, "a");
    if (lf != NULL) {
        char ts[80];
        ch_iso_at(ch_mono_ms(), ts, sizeof ts);
        fprintf(lf, "ts=%s chaos=start instance=%d\n", ts, g->idx);
        fclose(lf);
    }
    char *argv[] = {ch.idemgate_bin, (char *)"-c", g->conf, NULL};
    static char token[] = "IDEMGATE_ADMIN_TOKEN=" CH_ADMIN_TOKEN; /* the purge rounds use the admin API */
    if (g->idx != 1 || ch.o.clock_skew_ms == 0)
        return ch_spawn_env(argv, g->log, (char *[]){token, NULL});
    /* gateways whose clocks are minutes apart (SPEC 8, one clock): instance 1's wall clock is moved */
    static char preload[PATH_MAX + 16], shift[64];
    snprintf(preload, sizeof preload, "LD_PRELOAD=%s/tests/tools/libclockshift.so", ch.o.build);
    snprintf(shift, sizeof shift, "IDEMGATE_CLOCK_SHIFT_MS=%ld", ch.o.clock_skew_ms);
    char *env[] = {preload, shift, token, NULL};
    return ch_spawn_env(argv, g->log, env);
}

/* Waits for /healthz of the process p started for g; on success g->pid = p, else p is stopped. */
bool ch_gw_wait_ready(struct inst *g, pid_t p)
{
    CURL *c = curl_easy_init();
    char buf[512];
    char path[] = "/healthz";
    uint64_t end = ch_mono_ms() + CH_GW_READY_MS;
    bool ok = false;
    while (c != NULL && !ok && ch_mono_ms() < end && !atomic_load(&ch.abort)) {
        int st;
        if (ch_proc_wait(p, 0, &st)) {
            char d[32];
            ch_describe_status(st, d, sizeof d);
            ch_log("event=gateway_start_failed instance=%d %s log=%s", g->idx, d, g->log);
            curl_easy_cleanup(c);
            return false;
        }
        ok = ch_http_get_ok(c, g->admin_port, path, 300, buf, sizeof buf);
        if (!ok)
            ch_nap(30);
    }
    curl_easy_cleanup(c);
    if (!ok) {
        ch_log("event=gateway_not_ready instance=%d log=%s", g->idx, g->log);
        ch_proc_stop(p, SIGKILL, 1000);
        return false;
    }
    g->pid = p;
    return true;
}

/* Starts instance g and waits for /healthz. Returns false (process stopped) on failure. */
bool ch_gw_start(struct inst *g)
{
    pid_t p = ch_gw_spawn(g);
    return p > 0 && ch_gw_wait_ready(g, p);
}

bool ch_gw_start_retry(struct inst *g, int tries)
{
    for (int i = 0; i < tries && !atomic_load(&ch.abort); i++) {
        if (ch_gw_start(g))
            return true;
        ch_nap(300);
    }
    g->restart_fails++;
    return false;
}

void ch_gw_kill(struct inst *g)
{
    if (g->pid <= 0)
        return;
    atomic_fetch_add(&g->kills, 1);
    kill(g->pid, SIGKILL);
    if (!ch_proc_wait(g->pid, 5000, NULL))
        ch_log("event=gateway_reap_failed instance=%d", g->idx);
    g->pid = 0;
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
void ch_gw_exited(struct inst *g, int st)
{
    char d[32];
    ch_describe_status(st, d, sizeof d);
    atomic_fetch_add(&g->kills, 1);
    uint64_t now = ch_mono_ms();
    /* the gateway may have been draining for its shutdown grace (3s) before it exited */
    size_t w = ch_window_begin(F_GW_KILL, g->idx);
    pthread_mutex_lock(&ch.win_mu);
    if (w < ch.nwin)
        ch.win[w].begin = now > 4000 ? now - 4000 : 0;
    pthread_mutex_unlock(&ch.win_mu);
    ch_window_end(w);
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
void ch_gw_monitor(void)
{
    for (unsigned i = 0; i < ch.o.instances; i++) {
        struct inst *g = &ch.inst[i];
        int st;
        if (g->pid > 0 && ch_proc_wait(g->pid, 0, &st)) {
            ch_gw_exited(g, st);
            if (ch_gw_start_retry(g, 5))
                g->restarts++;
        }
    }
}
