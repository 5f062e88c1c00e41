/* faults.c - the fault injector: a table of fault kinds and the schedule thread that injects them one at a time
 * (gateway SIGKILL, Postgres crash/pause/commit errors/serializable default/failover, Redis stop and flush,
 * upstream down), each logged as a time window for the checks. */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "faults.h"
#include "gate.h"
#include "gateways.h"

#define CH_PAUSE_MIN_MS    2000
#define CH_PAUSE_MAX_MS    8000
#define CH_COMMIT_ERR_P    0.1 /* share of the keys table's row changes whose commit fails during the window */
#define CH_SQL_TIMEOUT_MS  5000
#define CH_STANDBY_BACK_MS 20000 /* a standby streams and is synchronous again within this after a primary fault */
#define CH_COMMIT_TRIGGER  "chaos_commit_fault"
#define CH_DB_NAME_MAX     64

static char db_name[CH_DB_NAME_MAX + 1]; /* the gateways' database (ALTER DATABASE) */
static char undo_sql[512];
static char undo_url[1200];

/* ------------------------------------------------------------------ the fault log */

size_t ch_window_begin(enum fkind k, int inst)
{
    pthread_mutex_lock(&ch.win_mu);
    size_t i = ch.nwin;
    if (i < CH_MAX_WINDOWS) {
        ch.win[i] = (struct window){.begin = ch_mono_ms(), .end = UINT64_MAX, .kind = k, .inst = inst};
        ch.nwin++;
    }
    pthread_mutex_unlock(&ch.win_mu);
    return i;
}

void ch_window_end(size_t i)
{
    pthread_mutex_lock(&ch.win_mu);
    if (i < ch.nwin)
        ch.win[i].end = ch_mono_ms();
    pthread_mutex_unlock(&ch.win_mu);
}

unsigned ch_faults_overlapping(uint64_t a, uint64_t b, unsigned mask)
{
    unsigned n = 0;
    pthread_mutex_lock(&ch.win_mu);
    for (size_t i = 0; i < ch.nwin; i++)
        if ((mask & (1u << ch.win[i].kind)) && ch.win[i].begin <= b && ch.win[i].end >= a)
            n++;
    pthread_mutex_unlock(&ch.win_mu);
    return n;
}

void ch_print_faults_between(uint64_t from, uint64_t to)
{
    pthread_mutex_lock(&ch.win_mu);
    for (size_t i = 0; i < ch.nwin; i++) {
        const struct window *wd = &ch.win[i];
        if (wd->begin <= to && wd->end >= from) {
            char who[32] = "";
            if (wd->inst >= 0)
                snprintf(who, sizeof who, " instance=%d", wd->inst);
            ch_out("    fault %s%s +%.3f .. +%.3f\n", ch_fault_name(wd->kind), who, ch_rel_s(wd->begin),
                   wd->end == UINT64_MAX ? -1.0 : ch_rel_s(wd->end));
        }
    }
    pthread_mutex_unlock(&ch.win_mu);
}

/* ------------------------------------------------------------------ the old faults: processes and the gate */

static void fault_gw_kill(uint64_t *rng, int which)
{
    int i = which >= 0 ? which : (int)(ch_splitmix64(rng) % ch.o.instances);
    struct inst *g = &ch.inst[i];
    if (g->pid <= 0)
        return;
    ch.faults[F_GW_KILL]++;
    uint64_t t = ch_mono_ms();
    ch_log("fault=gateway_kill phase=begin instance=%d pid=%ld", i, (long)g->pid);
    size_t w = ch_window_begin(F_GW_KILL, i);
    ch_gw_kill(g);
    ch_nap(ch_rnd_range(rng, 200, 1200));
    bool ok = ch_gw_start_retry(g, 5);
    if (ok)
        g->restarts++;
    else
        ch.fault_failures++;
    ch_window_end(w);
    ch_log("fault=gateway_kill phase=end instance=%d ok=%d pid=%ld ms=%" PRIu64, i, ok, (long)g->pid, ch_mono_ms() - t);
}

static bool sql_run(const char *what, const char *sql, char *res, size_t resn);

/* After a fault on the primary: the standby streams and is synchronous again within CH_STANDBY_BACK_MS (its
 * walreceiver retries every 5 s), or every commit of the gateways waits for it. Logged either way (a lost
 * standby is a fault failure: the run's collapse would otherwise read as the gateway's). */
static bool standby_sync_within(uint64_t ms, char *st, size_t stn)
{
    uint64_t t = ch_mono_ms();
    for (;;) {
        st[0] = '\0';
        if (sql_run("standby_state",
                    "SELECT coalesce((SELECT state || '/' || sync_state FROM pg_stat_replication"
                    " ORDER BY sync_state = 'sync' DESC LIMIT 1), 'none')",
                    st, stn) &&
            strcmp(st, "streaming/sync") == 0)
            return true;
        if (atomic_load(&ch.abort) || ch_mono_ms() - t >= ms)
            return false;
        ch_nap(250);
    }
}

static void standby_check(const char *after)
{
    if (!ch.has_standby)
        return;
    uint64_t t = ch_mono_ms();
    char st[64] = "";
    bool ok = standby_sync_within(CH_STANDBY_BACK_MS, st, sizeof st);
    ch_log("event=standby_check after=%s ok=%d state=%s ms=%" PRIu64, after, ok, st[0] ? st : "?", ch_mono_ms() - t);
    if (ok)
        return;
    /* not the gateways' fault: counted, and the standby started again (when it stopped) so the run goes on */
    ch.fault_failures++;
    int rc = ch_services("standby-up", NULL);
    ok = rc == 0 && standby_sync_within(CH_STANDBY_BACK_MS, st, sizeof st);
    ch_log("event=standby_restarted rc=%d ok=%d state=%s", rc, ok, st[0] ? st : "?");
}

static void fault_pg(uint64_t *rng)
{
    ch.faults[F_PG_RESTART]++;
    uint64_t t = ch_mono_ms();
    bool overlap = ch_splitmix64(rng) % 4 == 0;
    int victim = (int)(ch_splitmix64(rng) % ch.o.instances);
    size_t w2 = SIZE_MAX;
    pid_t restarting = -1;
    ch_log("fault=postgres_restart phase=begin mode=immediate kill_gateway=%d", overlap ? victim : -1);
    size_t w = ch_window_begin(F_PG_RESTART, -1);
    atomic_store(&ch.pg_down, true);
    int rc = ch_services("pg-stop", "immediate");
    ch_log("fault=postgres_restart phase=stopped rc=%d", rc);
    ch_nap(ch_rnd_range(rng, 100, 900));
    if (overlap && !atomic_load(&ch.abort)) {
        struct inst *g = &ch.inst[victim];
        if (g->pid > 0) {
            ch.faults[F_GW_KILL]++;
            ch_log("fault=gateway_kill phase=begin instance=%d pid=%ld during=postgres_restart", victim, (long)g->pid);
            w2 = ch_window_begin(F_GW_KILL, victim);
            ch_gw_kill(g);
            ch_nap(ch_rnd_range(rng, 100, 500));
            /* it starts while Postgres is down (its schema check has to wait), and is checked after pg-start */
            restarting = ch_gw_spawn(g);
            ch_nap(ch_rnd_range(rng, 100, 600));
        }
    }
    int rc2 = -1;
    for (int i = 0; i < 3 && rc2 != 0; i++) {
        rc2 = ch_services("pg-start", NULL);
        if (rc2 != 0) {
            ch_log("event=pg_start_failed rc=%d try=%d", rc2, i + 1);
            ch_nap(500);
        }
    }
    if (w2 != SIZE_MAX) {
        struct inst *g = &ch.inst[victim];
        bool ok = restarting > 0 && ch_gw_wait_ready(g, restarting);
        if (!ok)
            ok = ch_gw_start_retry(g, 5);
        if (ok)
            g->restarts++;
        else
            ch.fault_failures++;
        ch_window_end(w2);
        ch_log("fault=gateway_kill phase=end instance=%d ok=%d pid=%ld", victim, ok, (long)g->pid);
    }
    if (rc != 0 || rc2 != 0)
        ch.fault_failures++;
    atomic_store(&ch.pg_down, rc2 != 0);
    ch_window_end(w);
    ch_log("fault=postgres_restart phase=end ok=%d ms=%" PRIu64, rc == 0 && rc2 == 0, ch_mono_ms() - t);
    if (rc2 == 0)
        standby_check("postgres_restart");
}

static void fault_redis_restart(uint64_t *rng)
{
    ch.faults[F_REDIS_RESTART]++;
    uint64_t t = ch_mono_ms();
    ch_log("fault=redis_restart phase=begin");
    size_t w = ch_window_begin(F_REDIS_RESTART, -1);
    atomic_store(&ch.redis_down, true);
    int rc = ch_services("redis-stop", NULL);
    ch_nap(ch_rnd_range(rng, 300, 1500));
    int rc2 = -1;
    for (int i = 0; i < 3 && rc2 != 0; i++)
        rc2 = ch_services("redis-start", NULL);
    atomic_store(&ch.redis_down, rc2 != 0);
    ch_window_end(w);
    if (rc != 0 || rc2 != 0)
        ch.fault_failures++;
    ch_log("fault=redis_restart phase=end ok=%d ms=%" PRIu64, rc == 0 && rc2 == 0, ch_mono_ms() - t);
}

static void fault_redis_flush(void)
{
    ch.faults[F_REDIS_FLUSH]++;
    ch_log("fault=redis_flush phase=begin");
    size_t w = ch_window_begin(F_REDIS_FLUSH, -1);
    int rc = ch_services("redis-flush", NULL);
    ch_window_end(w);
    if (rc != 0)
        ch.fault_failures++;
    ch_log("fault=redis_flush phase=end ok=%d", rc == 0);
}

static void fault_upstream(uint64_t *rng)
{
    ch.faults[F_UPSTREAM_DOWN]++;
    uint64_t t = ch_mono_ms();
    bool overlap = ch_splitmix64(rng) % 5 == 0;
    ch_log("fault=upstream_down phase=begin");
    size_t w = ch_window_begin(F_UPSTREAM_DOWN, -1);
    bool ok = ch_gate_set(false);
    ch_log("fault=upstream_down phase=down ok=%d connections_reset=%u", ok, atomic_load(&ch.gate_resets));
    ch_nap(ch_rnd_range(rng, 300, 1500));
    if (overlap)
        fault_gw_kill(rng, -1);
    bool ok2 = ch_gate_set(true);
    if (!ok || !ok2)
        ch.fault_failures++;
    ch_window_end(w);
    ch_log("fault=upstream_down phase=end ok=%d ms=%" PRIu64, ok && ok2, ch_mono_ms() - t);
}

static void inject_gw_kill(uint64_t *rng)
{
    fault_gw_kill(rng, -1);
}

static void inject_redis_flush(uint64_t *rng)
{
    (void)rng;
    fault_redis_flush();
}

/* ------------------------------------------------------------------ Redis paused while an admin purge is answered */

#define CH_PURGE_BUF 4096

/* POST body with key to instance i on the reject route (a tenant of its own); the answer in r (body in buf). */
static void purge_post(CURL *c, int i, const char *key, const char *body, char *buf, struct http_res *r)
{
    char kh[96];
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    struct curl_slist *h = curl_slist_append(NULL, kh);
    h = curl_slist_append(h, "Authorization: Bearer chaos-purge");
    h = curl_slist_append(h, "Content-Type: application/json");
    h = curl_slist_append(h, "Expect:");
    ch_http_do(c, ch.inst[i].port, "POST", ch_route_path[RT_REJECT], h, body, strlen(body), 5000, buf, CH_PURGE_BUF,
               true, r);
    curl_slist_free_all(h);
}

/* DELETE /admin/keys of key on the reject route at instance i; its status (0: no answer). */
static long purge_admin(CURL *c, int i, const char *key)
{
    char path[160], buf[512];
    snprintf(path, sizeof path, "/admin/keys?route=%s&key=%s", ch_route_name[RT_REJECT], key);
    struct curl_slist *h = curl_slist_append(NULL, "Authorization: Bearer " CH_ADMIN_TOKEN);
    struct http_res r;
    ch_http_do(c, ch.inst[i].admin_port, "DELETE", path, h, NULL, 0, 5000, buf, sizeof buf, true, &r);
    curl_slist_free_all(h);
    return r.cc == CURLE_OK ? r.status : 0;
}

static pid_t redis_pid(void)
{
    char path[PATH_MAX], line[32] = "";
    if (!ch_env_value("REDIS_PIDFILE", path, sizeof path))
        return 0;
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    bool got = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    uint64_t v = 0;
    line[strcspn(line, "\r\n")] = '\0';
    return got && ch_parse_u64(line, INT32_MAX, &v) && v > 1 ? (pid_t)v : 0;
}

static void purge_violation(const char *key, const char *what, const struct http_res *r)
{
    ch.purge_violations++;
    ch_out("VIOLATION purge: key %s: %s (got %ld%s exec=%s: %.120s)\n", key, what, r->status,
           r->replayed ? " replayed" : "", r->exec, r->body ? r->body : "");
    ch_log("event=purge_violation key=%s what=\"%s\" status=%ld", key, what, r->status);
}

/* One round of its own key: intent 1 executed at one instance and replayed at another (which puts the answer into
 * Redis); Redis paused (SIGSTOP) while an instance purges the key through the admin API, continued a moment
 * later; then intent 2 (another body) must execute once, and each of its retries, at every instance, get its
 * first answer (never intent 1's, never 422), and intent 1's body must be 422 (SPEC 8: Redis never overrides
 * Postgres). A step that fails before the purge (no 200, no purge) makes the round inconclusive, not a
 * violation. */
static void fault_redis_pause_purge(uint64_t *rng)
{
    ch.faults[F_REDIS_PAUSE_PURGE]++;
    CURL *c = curl_easy_init();
    char *buf = ch_xcalloc(2, CH_PURGE_BUF), *first = buf + CH_PURGE_BUF;
    char key[48], exec2[24];
    snprintf(key, sizeof key, CH_PURGE_PREFIX "%s-%u", ch.tag, ch.faults[F_REDIS_PAUSE_PURGE]);
    int n = (int)ch.o.instances, a = (int)(ch_splitmix64(rng) % (uint64_t)n), b = (a + 1) % n;
    struct http_res r;
    uint64_t t = ch_mono_ms();
    pid_t rp = redis_pid();
    bool ready = c != NULL && rp > 0;
    if (ready) {
        purge_post(c, a, key, "{\"purge\":1}", buf, &r);
        ready = r.cc == CURLE_OK && r.status == 200 && !r.replayed;
    }
    if (ready) {
        purge_post(c, b, key, "{\"purge\":1}", buf, &r);
        ready = r.cc == CURLE_OK && r.status == 200 && r.replayed;
    }
    if (!ready) {
        ch.purge_inconclusive++;
        ch_log("fault=redis_pause_purge phase=skipped key=%s reason=\"intent 1 not answered and replayed\"", key);
        goto out;
    }
    ch_nap(300); /* the replay's refill */
    ch_log("fault=redis_pause_purge phase=begin key=%s redis_pid=%ld", key, (long)rp);
    size_t w = ch_window_begin(F_REDIS_PAUSE_PURGE, -1);
    ch.paused[0] = rp; /* continue_all continues it on every exit path */
    kill(rp, SIGSTOP);
    ch_nap(ch_rnd_range(rng, 400, 1200)); /* the traffic's timeouts make the gateways give their links up */
    long st = 0;
    int at = (int)(ch_splitmix64(rng) % (uint64_t)n);
    for (int i = 0; i < 5 && st != 200; i++) {
        st = purge_admin(c, at, key);
        if (st != 200)
            ch_nap(300);
    }
    ch_nap(ch_rnd_range(rng, 500, 2500));
    kill(rp, SIGCONT);
    ch.paused[0] = 0;
    ch_window_end(w);
    ch_log("fault=redis_pause_purge phase=end key=%s purge_status=%ld ms=%" PRIu64, key, st, ch_mono_ms() - t);
    if (st != 200) {
        ch.purge_inconclusive++;
        goto out;
    }
    ch.purge_rounds++;
    ch_nap(2500); /* the gateways' Redis links come back (reconnect backoff up to 2 s) */
    purge_post(c, b, key, "{\"purge\":2}", first, &r);
    if (r.cc != CURLE_OK || r.status != 200 || r.replayed) {
        purge_violation(key, "intent 2 after the purge was not executed", &r);
        goto out;
    }
    snprintf(exec2, sizeof exec2, "%s", r.exec);
    for (int i = 0; i < 2 * n; i++) {
        purge_post(c, i % n, key, "{\"purge\":2}", buf, &r);
        if (r.cc != CURLE_OK || r.status != 200 || !r.replayed || strcmp(r.exec, exec2) != 0) {
            purge_violation(key, "a retry of intent 2 did not get its first answer", &r);
            goto out;
        }
    }
    purge_post(c, a, key, "{\"purge\":1}", buf, &r);
    if (r.cc != CURLE_OK || r.status != 422)
        purge_violation(key, "intent 1's body after intent 2's record was not 422", &r);
out:
    free(buf);
    if (c)
        curl_easy_cleanup(c);
}

/* ------------------------------------------------------------------ Postgres paused (SIGSTOP/SIGCONT) */

static pid_t read_ppid(pid_t pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%ld/stat", (long)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    char st = 0;
    long ppid = -1;
    if (p == NULL || sscanf(p + 1, " %c %ld", &st, &ppid) != 2)
        return -1;
    return (pid_t)ppid;
}

/* Stops pid and remembers it for the SIGCONT (remembered first: a signal in between still continues it). */
static bool pause_one(pid_t pid)
{
    for (size_t i = 0; i < CH_MAX_PAUSED; i++)
        if (ch.paused[i] == 0) {
            ch.paused[i] = pid;
            return kill(pid, SIGSTOP) == 0;
        }
    return false;
}

static void continue_all(void)
{
    for (size_t i = 0; i < CH_MAX_PAUSED; i++)
        if (ch.paused[i] > 0) {
            kill(ch.paused[i], SIGCONT);
            ch.paused[i] = 0;
        }
}

/* The primary's postmaster first (so it forks nothing new), then every process it started. Returns how many. */
static size_t pause_cluster(void)
{
    char data[PATH_MAX], path[PATH_MAX + 32], line[64] = "";
    if (!ch_env_value("PG_DATA", data, sizeof data))
        return 0;
    snprintf(path, sizeof path, "%s/postmaster.pid", data);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    bool got = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    line[strcspn(line, "\r\n")] = '\0';
    uint64_t pm = 0;
    if (!got || !ch_parse_u64(line, INT32_MAX, &pm) || pm < 2 || !pause_one((pid_t)pm))
        return 0;
    size_t n = 1;
    DIR *d = opendir("/proc");
    struct dirent *e;
    while (d != NULL && (e = readdir(d)) != NULL) {
        uint64_t pid = 0;
        if (ch_parse_u64(e->d_name, INT32_MAX, &pid) && read_ppid((pid_t)pid) == (pid_t)pm && pause_one((pid_t)pid))
            n++;
    }
    if (d != NULL)
        closedir(d);
    return n;
}

static void fault_pg_pause(uint64_t *rng)
{
    ch.faults[F_PG_PAUSE]++;
    uint64_t ms = ch_rnd_range(rng, CH_PAUSE_MIN_MS, CH_PAUSE_MAX_MS);
    uint64_t t = ch_mono_ms();
    size_t w = ch_window_begin(F_PG_PAUSE, -1);
    size_t n = pause_cluster();
    ch_log("fault=postgres_pause phase=begin processes=%zu ms=%" PRIu64, n, ms);
    if (n == 0)
        ch.fault_failures++;
    else
        ch_nap(ms);
    continue_all();
    ch_window_end(w);
    ch_log("fault=postgres_pause phase=end ok=%d ms=%" PRIu64, n > 0, ch_mono_ms() - t);
    standby_check("postgres_pause");
}

/* ------------------------------------------------------------------ a gateway paused (SIGSTOP/SIGCONT) */

/* A whole gateway stops for 1 to 3 leases (a VM freeze, a stopped container, an overloaded host): its leases lapse
 * while it is away, another gateway may take its keys over, and when it resumes it must not act on what it no
 * longer owns (SPEC 8, a paused owner never acts). */
static void fault_gw_pause(uint64_t *rng)
{
    ch.faults[F_GW_PAUSE]++;
    int i = (int)ch_rnd_range(rng, 0, ch.o.instances - 1);
    pid_t pid = ch.inst[i].pid;
    uint64_t ms = ch_rnd_range(rng, ch.o.lease_ms, 3ull * ch.o.lease_ms);
    uint64_t t = ch_mono_ms();
    size_t w = ch_window_begin(F_GW_PAUSE, i);
    bool ok = pid > 0 && pause_one(pid);
    ch_log("fault=gateway_pause phase=begin instance=%d ms=%" PRIu64 " ok=%d", i, ms, ok);
    if (!ok)
        ch.fault_failures++;
    else
        ch_nap(ms);
    continue_all();
    ch_window_end(w);
    ch_log("fault=gateway_pause phase=end instance=%d ms=%" PRIu64, i, ch_mono_ms() - t);
}

/* ------------------------------------------------------------------ SQL faults (superuser connection) */

/* Runs sql (one or more statements, one implicit transaction) as superuser, bounded; the first value of the
 * result goes to res (may be NULL). False with the error logged. Its commits are local (synchronous_commit=local):
 * statement_timeout does not bound a COMMIT's wait for a synchronous standby, and an injector blocked there
 * injects nothing more (nor undoes what it injected). */
static bool sql_run(const char *what, const char *sql, char *res, size_t resn)
{
    char opt[128];
    snprintf(opt, sizeof opt, "-c statement_timeout=%d -c client_min_messages=warning -c synchronous_commit=local",
             CH_SQL_TIMEOUT_MS);
    const char *kw[] = {"dbname", "connect_timeout", "options", NULL};
    const char *vals[] = {ch.pg_admin_url, "5", opt, NULL};
    PGconn *pg = PQconnectdbParams(kw, vals, 1);
    bool ok = false;
    if (pg != NULL && PQstatus(pg) == CONNECTION_OK) {
        PGresult *r = PQexec(pg, sql);
        ExecStatusType st = PQresultStatus(r);
        ok = st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK;
        if (ok && res != NULL)
            snprintf(res, resn, "%s", PQntuples(r) > 0 ? PQgetvalue(r, 0, 0) : "");
        if (!ok)
            ch_log("event=sql_failed what=%s error=\"%.200s\"", what, PQerrorMessage(pg));
        PQclear(r);
    } else {
        ch_log("event=sql_failed what=%s error=\"%.200s\"", what, pg ? PQerrorMessage(pg) : "out of memory");
    }
    PQfinish(pg);
    return ok;
}

static bool sql_undo(void)
{
    bool ok = true;
    for (int i = 0; i < 3; i++) {
        char sql[640];
        snprintf(sql, sizeof sql, "ALTER DATABASE %s RESET default_transaction_isolation", db_name);
        ok = sql_run("undo_isolation", sql, NULL, 0) &&
             sql_run("undo_trigger",
                     "DROP TRIGGER IF EXISTS " CH_COMMIT_TRIGGER " ON idemgate_keys;"
                     " DROP FUNCTION IF EXISTS " CH_COMMIT_TRIGGER "()",
                     NULL, 0);
        if (ok)
            break;
        ch_nap(300);
    }
    if (ok)
        ch.sql_fault_active = 0;
    return ok;
}

/* The gateways' connections, closed so that they reconnect (and pick up a new database default). */
static long terminate_gateway_backends(void)
{
    char n[32] = "";
    if (!sql_run("terminate",
                 "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                 " WHERE datname = current_database() AND application_name = 'idemgate'",
                 n, sizeof n))
        return -1;
    return strtol(n, NULL, 10);
}

/* A constraint trigger, deferred to COMMIT, that fails a share of the commits touching the keys table. Its
 * function stops failing by itself at a deadline, so a checker that dies before the DROP leaves nothing armed. */
static void fault_pg_commit_err(uint64_t *rng)
{
    ch.faults[F_PG_COMMIT_ERR]++;
    uint64_t ms = ch_rnd_range(rng, 3000, 7000), t = ch_mono_ms();
    time_t until = (time_t)((ch_wall_ms() + ms + 3000) / 1000);
    struct tm tm;
    gmtime_r(&until, &tm);
    char sql[1400];
    snprintf(sql, sizeof sql,
             "CREATE OR REPLACE FUNCTION " CH_COMMIT_TRIGGER "() RETURNS trigger LANGUAGE plpgsql AS $f$ BEGIN"
             " IF clock_timestamp() < TIMESTAMPTZ '%04d-%02d-%02d %02d:%02d:%02d+00' AND random() < %.3f THEN"
             " RAISE EXCEPTION 'chaos: injected commit-time failure'; END IF; RETURN NULL; END $f$;"
             " DROP TRIGGER IF EXISTS " CH_COMMIT_TRIGGER " ON idemgate_keys;"
             " CREATE CONSTRAINT TRIGGER " CH_COMMIT_TRIGGER " AFTER INSERT OR UPDATE OR DELETE ON idemgate_keys"
             " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION " CH_COMMIT_TRIGGER "()",
             tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, CH_COMMIT_ERR_P);
    size_t w = ch_window_begin(F_PG_COMMIT_ERR, -1);
    ch.sql_fault_active = 1;
    bool ok = sql_run("commit_errors", sql, NULL, 0);
    ch_log("fault=commit_errors phase=begin ok=%d share=%.2f ms=%" PRIu64, ok, CH_COMMIT_ERR_P, ms);
    if (ok)
        ch_nap(ms);
    bool ok2 = sql_undo();
    ch_window_end(w);
    if (!ok || !ok2)
        ch.fault_failures++;
    ch_log("fault=commit_errors phase=end ok=%d ms=%" PRIu64, ok && ok2, ch_mono_ms() - t);
}

/* The database's default isolation set to serializable; the gateways' connections are closed at both ends of the
 * window, so that they run under it while it lasts (SPEC 8: the gateway runs at READ COMMITTED regardless). */
static void fault_pg_serializable(uint64_t *rng)
{
    ch.faults[F_PG_SERIALIZABLE]++;
    uint64_t ms = ch_rnd_range(rng, 3000, 7000), t = ch_mono_ms();
    char sql[256];
    snprintf(sql, sizeof sql, "ALTER DATABASE %s SET default_transaction_isolation = 'serializable'", db_name);
    size_t w = ch_window_begin(F_PG_SERIALIZABLE, -1);
    ch.sql_fault_active = 1;
    bool ok = sql_run("serializable", sql, NULL, 0);
    long k = ok ? terminate_gateway_backends() : -1;
    ch_log("fault=serializable_default phase=begin ok=%d connections_closed=%ld ms=%" PRIu64, ok, k, ms);
    if (ok)
        ch_nap(ms);
    bool ok2 = sql_undo();
    long k2 = ok2 ? terminate_gateway_backends() : -1;
    ch_window_end(w);
    if (!ok || !ok2)
        ch.fault_failures++;
    ch_log("fault=serializable_default phase=end ok=%d connections_closed=%ld ms=%" PRIu64, ok && ok2, k2,
           ch_mono_ms() - t);
}

/* ------------------------------------------------------------------ failover (primary crashed, standby promoted) */

static void fault_pg_failover(uint64_t *rng)
{
    ch.faults[F_PG_FAILOVER]++;
    uint64_t t = ch_mono_ms();
    ch_log("fault=failover phase=begin");
    size_t w = ch_window_begin(F_PG_FAILOVER, -1);
    atomic_store(&ch.pg_down, true);
    int rc = ch_services("pg-stop", "immediate");
    ch_log("fault=failover phase=primary_stopped rc=%d", rc);
    ch_nap(ch_rnd_range(rng, 200, 1000));
    int rc2 = ch_services("promote", NULL);
    ch.has_standby = false;
    if (rc2 != 0) { /* the old primary's data is intact: bring it back rather than stay down */
        ch_log("event=promote_failed rc=%d", rc2);
        rc2 = ch_services("pg-start", NULL) == 0 ? 1 : -1;
    }
    atomic_store(&ch.pg_down, rc2 < 0);
    if (rc != 0 || rc2 != 0)
        ch.fault_failures++;
    ch_window_end(w);
    ch_log("fault=failover phase=end ok=%d ms=%" PRIu64, rc == 0 && rc2 == 0, ch_mono_ms() - t);
}

/* A Citus worker restart: the keys whose shards it holds get 503 while it is down (nothing forwarded), the others
 * go on; claims in flight on it fail and are released once it answers again. */
static void fault_citus_worker(uint64_t *rng)
{
    ch.faults[F_CITUS_WORKER]++;
    uint64_t t = ch_mono_ms();
    int n = 1 + (int)(ch_splitmix64(rng) % 2);
    const char *arg = n == 1 ? "1" : "2";
    ch_log("fault=citus_worker_restart phase=begin worker=%d", n);
    size_t w = ch_window_begin(F_CITUS_WORKER, -1);
    atomic_store(&ch.citus_down, n);
    int rc = ch_services("citus-worker-stop", arg);
    ch_nap(ch_rnd_range(rng, 300, 1500));
    int rc2 = -1;
    for (int i = 0; i < 3 && rc2 != 0; i++) {
        rc2 = ch_services("citus-worker-start", arg);
        if (rc2 != 0)
            ch_nap(500);
    }
    atomic_store(&ch.citus_down, rc2 == 0 ? 0 : n);
    ch_window_end(w);
    if (rc != 0 || rc2 != 0)
        ch.fault_failures++;
    ch_log("fault=citus_worker_restart phase=end worker=%d ok=%d ms=%" PRIu64, n, rc == 0 && rc2 == 0,
           ch_mono_ms() - t);
}

/* ------------------------------------------------------------------ the table */

struct fault_kind {
    const char *name;
    void (*inject)(uint64_t *rng);
    bool disruptive;    /* may leave an outcome unknown: evidence for a re-execution on the retry route */
    bool excuses_stuck; /* a request sent into it may never arrive: a never-executed key may stay unknown */
    bool needs_standby;
    bool needs_sql;       /* runs SQL as superuser (a trigger on idemgate_keys: not on Citus, which refuses it) */
    bool needs_citus;     /* only with a Citus cluster */
    unsigned max_per_run; /* 0: no limit */
};

static const struct fault_kind kinds[F__N] = {
    [F_GW_KILL] = {"gateway_kill", inject_gw_kill, true, true, false, false, false, 0},
    [F_PG_RESTART] = {"postgres_restart", fault_pg, true, false, false, false, false, 0},
    [F_REDIS_RESTART] = {"redis_restart", fault_redis_restart, false, false, false, false, false, 0},
    [F_REDIS_FLUSH] = {"redis_flush", inject_redis_flush, false, false, false, false, false, 0},
    [F_UPSTREAM_DOWN] = {"upstream_down", fault_upstream, true, true, false, false, false, 0},
    [F_PG_PAUSE] = {"postgres_pause", fault_pg_pause, true, false, false, false, false, 0},
    [F_PG_COMMIT_ERR] = {"commit_errors", fault_pg_commit_err, true, false, false, true, false, 0},
    [F_PG_SERIALIZABLE] = {"serializable_default", fault_pg_serializable, true, false, false, true, false, 0},
    [F_PG_FAILOVER] = {"failover", fault_pg_failover, true, false, true, false, false, 1},
    [F_CITUS_WORKER] = {"citus_worker_restart", fault_citus_worker, true, false, false, false, true, 0},
    [F_GW_PAUSE] = {"gateway_pause", fault_gw_pause, true, false, false, false, false, 0},
    [F_REDIS_PAUSE_PURGE] = {"redis_pause_purge", fault_redis_pause_purge, false, false, false, false, false, 0},
};

const char *ch_fault_name(enum fkind k)
{
    return k < F__N ? kinds[k].name : "?";
}

unsigned ch_fault_mask_disruptive(void)
{
    unsigned m = 0;
    for (unsigned k = 0; k < F__N; k++)
        m |= kinds[k].disruptive ? 1u << k : 0;
    return m;
}

unsigned ch_fault_mask_excuses_stuck(void)
{
    unsigned m = 0;
    for (unsigned k = 0; k < F__N; k++)
        m |= kinds[k].excuses_stuck ? 1u << k : 0;
    return m;
}

bool ch_faults_parse(const char *list, unsigned *mask, char *err, size_t errn)
{
    unsigned m = 0;
    const char *p = list;
    while (*p != '\0') {
        size_t n = strcspn(p, ",");
        bool found = n == 3 && strncmp(p, "all", 3) == 0;
        if (found)
            m |= (1u << F__N) - 1;
        for (unsigned k = 0; k < F__N && !found; k++)
            if (strlen(kinds[k].name) == n && strncmp(p, kinds[k].name, n) == 0) {
                m |= 1u << k;
                found = true;
            }
        if (!found) {
            size_t o = (size_t)snprintf(err, errn, "unknown fault kind '%.*s' (kinds: all", (int)(n < 40 ? n : 40), p);
            for (unsigned k = 0; k < F__N && o < errn; k++)
                o += (size_t)snprintf(err + o, errn - o, ",%s", kinds[k].name);
            if (o < errn)
                snprintf(err + o, errn - o, ")");
            return false;
        }
        p += n;
        if (*p == ',')
            p++;
    }
    if (m == 0) {
        snprintf(err, errn, "--faults: an empty list");
        return false;
    }
    *mask = m;
    return true;
}

bool ch_faults_settle_mask(void)
{
    for (unsigned k = 0; k < F__N; k++)
        if ((ch.o.fault_mask & (1u << k)) && kinds[k].needs_standby && !ch.has_standby) {
            if (ch.o.faults_given) {
                fprintf(stderr,
                        "chaos: --faults %s needs a standby (scripts/services.sh standby-start; "
                        "tests/chaos/run.sh starts one when the list names it)\n",
                        kinds[k].name);
                return false;
            }
            ch_log("event=fault_skipped kind=%s reason=no_standby", kinds[k].name);
            ch.o.fault_mask &= ~(1u << k);
        }
    for (unsigned k = 0; k < F__N; k++) {
        const char *why = !(ch.o.fault_mask & (1u << k))          ? NULL
                          : kinds[k].needs_citus && !ch.has_citus ? "no_citus"
                          : kinds[k].needs_sql && ch.has_citus    ? "citus"
                                                                  : NULL;
        if (!why)
            continue;
        if (ch.o.faults_given) {
            fprintf(stderr, "chaos: --faults %s cannot run %s a Citus cluster (tests/chaos/run.sh --citus)\n",
                    kinds[k].name, kinds[k].needs_citus ? "without" : "on");
            return false;
        }
        ch_log("event=fault_skipped kind=%s reason=%s", kinds[k].name, why);
        ch.o.fault_mask &= ~(1u << k);
    }
    return true;
}

bool ch_faults_prepare(void)
{
    bool sql = false;
    for (unsigned k = 0; k < F__N; k++)
        sql = sql || ((ch.o.fault_mask & (1u << k)) && kinds[k].needs_sql);
    if (!sql)
        return true;
    char name[CH_DB_NAME_MAX + 1] = "";
    if (!sql_run("prepare", "SELECT quote_ident(current_database())", name, sizeof name) || name[0] == '\0' ||
        strlen(name) >= CH_DB_NAME_MAX) {
        fprintf(stderr, "chaos: the SQL faults need a superuser connection (IDEMGATE_TEST_PG_ADMIN_URL)\n");
        return false;
    }
    snprintf(db_name, sizeof db_name, "%s", name);
    snprintf(undo_url, sizeof undo_url, "%.1100s%sconnect_timeout=3", ch.pg_admin_url,
             strchr(ch.pg_admin_url, '?') ? "&" : "?");
    snprintf(undo_sql, sizeof undo_sql,
             "SET statement_timeout = 3000; ALTER DATABASE %s RESET default_transaction_isolation; DROP TRIGGER IF "
             "EXISTS " CH_COMMIT_TRIGGER " ON idemgate_keys",
             db_name);
    if (ch.psql_bin[0] != '\0') {
        static char a0[] = "-X", a1[] = "-q", a2[] = "-d", a3[] = "-c";
        char *argv[] = {ch.psql_bin, a0, a1, a2, undo_url, a3, undo_sql, NULL};
        memcpy(ch.undo_argv, argv, sizeof argv);
    }
    return true;
}

void ch_faults_undo(void)
{
    continue_all();
    if (ch.sql_fault_active && !sql_undo())
        ch_log("event=sql_undo_failed msg=\"the commit trigger disarms itself at its deadline\"");
}

void ch_faults_heal(void)
{
    ch_faults_undo();
    if (atomic_load(&ch.pg_down) && ch_services("pg-start", NULL) == 0)
        atomic_store(&ch.pg_down, false);
    if (atomic_load(&ch.redis_down) && ch_services("redis-start", NULL) == 0)
        atomic_store(&ch.redis_down, false);
    int worker = atomic_load(&ch.citus_down);
    if (worker > 0) {
        const char *arg = worker == 1 ? "1" : "2";
        if (ch_services("citus-worker-start", arg) == 0)
            atomic_store(&ch.citus_down, 0);
    }
    (void)ch_gate_set(true);
    for (unsigned i = 0; i < ch.o.instances; i++) {
        struct inst *g = &ch.inst[i];
        int st;
        if (g->pid > 0 && ch_proc_wait(g->pid, 0, &st))
            ch_gw_exited(g, st);
        if (g->pid <= 0 && ch_gw_start_retry(g, 5))
            g->restarts++;
    }
}

/* ------------------------------------------------------------------ the schedule */

/* Whether kind k may run now: selected, under its per-run limit, its standby there; a one-shot kind waits for
 * the first third of the traffic window, so that traffic runs on both sides of it. *later: it may, later. */
static bool eligible(unsigned k, uint64_t one_shot_after, bool *later)
{
    const struct fault_kind *f = &kinds[k];
    if (!(ch.o.fault_mask & (1u << k)) || (f->max_per_run != 0 && ch.faults[k] >= f->max_per_run) ||
        (f->needs_standby && !ch.has_standby))
        return false;
    if (f->max_per_run != 0 && ch_mono_ms() < one_shot_after) {
        *later = true;
        return false;
    }
    return true;
}

void *ch_fault_main(void *arg)
{
    (void)arg;
    uint64_t rng = ch.o.seed ^ 0xfa017ull;
    uint64_t start = ch_mono_ms();
    uint64_t one_shot_after = start + (ch.traffic_end > start ? (ch.traffic_end - start) / 3 : 0);
    ch_nap(2000);
    unsigned order[F__N];
    size_t oi = 0, on = 0;
    while (!ch.o.no_faults && !atomic_load(&ch.abort) && ch_mono_ms() + 1500 < ch.faults_end) {
        if (oi == on) { /* a new round: every eligible kind once, shuffled */
            bool later = false;
            on = 0;
            for (unsigned k = 0; k < F__N; k++)
                if (eligible(k, one_shot_after, &later))
                    order[on++] = k;
            if (on == 0 && !later)
                break;
            if (on == 0) {
                ch_nap(200);
                ch_gw_monitor();
                continue;
            }
            for (size_t i = on - 1; i > 0; i--) {
                size_t j = (size_t)(ch_splitmix64(&rng) % (i + 1));
                unsigned t = order[i];
                order[i] = order[j];
                order[j] = t;
            }
            oi = 0;
        }
        while (oi < on && !eligible(order[oi], one_shot_after, &(bool){false}))
            oi++; /* a one-shot kind of this round that already ran */
        if (oi == on)
            continue;
        /* a one-shot kind runs as soon as it may (a round can outlast the rest of a short run) */
        unsigned next = order[oi];
        bool later = false;
        for (unsigned k = 0; k < F__N; k++)
            if (kinds[k].max_per_run != 0 && eligible(k, one_shot_after, &later)) {
                next = k;
                break;
            }
        if (next == order[oi])
            oi++;
        kinds[next].inject(&rng);
        ch_gw_monitor();
        uint64_t gap_end = ch_mono_ms() + ch_rnd_range(&rng, 1200, 3200);
        while (ch_mono_ms() < gap_end && !atomic_load(&ch.abort)) {
            ch_nap(100);
            ch_gw_monitor();
        }
    }
    /* keep watching until the traffic ends, then hand the processes to the main thread */
    while (!atomic_load(&ch.abort) && ch_mono_ms() < ch.traffic_end) {
        ch_nap(100);
        ch_gw_monitor();
    }
    atomic_store(&ch.faults_done, true);
    /* This thread forked some children with PR_SET_PDEATHSIG: it lives until they are stopped. */
    uint64_t bound = ch_mono_ms() + 3600ull * 1000;
    while (!atomic_load(&ch.fault_release) && ch_mono_ms() < bound) {
        struct timespec ts = {0, 20 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return NULL;
}
