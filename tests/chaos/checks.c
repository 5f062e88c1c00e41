/* checks.c - the history checks: the clients' records, the upstream's execution counts and the idemgate_keys
 * table, compared after the quiet period; one function per check, run from one table. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libpq-fe.h>

#include "checks.h"
#include "faults.h"
#include "reconcile.h"
#include "traffic.h"

#define CH_REPLAY_THREADS 8
#define CH_REPORT_MAX     8 /* detailed reports per check */
#define CH_LOG_LINES_MAX  24
#define CH_LIVENESS_TRIES 6 /* final retries of a never-executed key (503 store-unavailable is retried) */

enum chk { K_RUN, K_AT_MOST_ONCE, K_SAME_ANSWER, K_TENANT, K_SETTLED, K_ORDER, K_PURGE, K_LIVENESS, K_RECONCILE, K__N };

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
    size_t foreign;
    size_t never_executed_unsettled, liveness_retried, liveness_excused, liveness_stuck, liveness_not_retried;
    unsigned replays, replay_fail;
};

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
    struct tally t;
    long order_violations; /* from the upstream (check_order) */
    bool ok[K__N];
    unsigned reported[K__N];
    struct ch_rc rc; /* the closing reconciliation (reconcile.c) */
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
        ch_http_do(c, ch.tu_port, NULL, path, NULL, NULL, 0, 3000, buf, sizeof buf, false, &r);
        uint64_t v = 0;
        if (r.cc == CURLE_OK && r.status == 200 && ch_parse_u64(buf, UINT32_MAX, &v)) {
            *out_n = (long)v;
            return true;
        }
    }
    return false;
}

static bool load_rows(struct ctx *x)
{
    const char *kw[] = {"dbname", "connect_timeout", NULL};
    const char *vals[] = {ch.pg_url_raw, "10", NULL};
    PGconn *pg = PQconnectdbParams(kw, vals, 1);
    if (pg == NULL || PQstatus(pg) != CONNECTION_OK) {
        ch_out("chaos: cannot connect to Postgres: %s\n", pg ? PQerrorMessage(pg) : "?");
        PQfinish(pg);
        return false;
    }
    char like[40];
    snprintf(like, sizeof like, "%%-%s", ch.tag);
    const char *params[] = {like};
    PGresult *res = PQexecParams(pg,
                                 "SELECT route, key, encode(scope, 'hex'), state, token::text,"
                                 " (lease_until > now())::int, coalesce(status, 0),"
                                 " greatest(-1e9, least(1e9, extract(epoch FROM lease_until - now()) * 1000))::int8"
                                 " FROM idemgate_keys WHERE key LIKE $1",
                                 1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        ch_out("chaos: query failed: %s\n", PQerrorMessage(pg));
        PQclear(res);
        PQfinish(pg);
        return false;
    }
    int n = PQntuples(res);
    x->rows = ch_xcalloc((size_t)n + 1, sizeof *x->rows);
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
    for (unsigned i = 0; i < ch.o.instances; i++) {
        FILE *f = fopen(ch.inst[i].log, "r");
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
    ch_iso_at(from, a, sizeof a);
    ch_iso_at(to, b, sizeof b);
    size_t alen = strlen(a), blen = strlen(b);
    char **lines = NULL;
    size_t n = 0, cap = 0, more = 0, upstream_errors = 0;
    for (unsigned i = 0; i < ch.o.instances; i++) {
        FILE *f = fopen(ch.inst[i].log, "r");
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
                lines = ch_xrealloc(lines, cap * sizeof *lines);
            }
            size_t l = strlen(line);
            lines[n] = ch_xmalloc(l + 6);
            snprintf(lines[n], l + 6, "[g%u] %s", i % 10, line);
            n++;
        }
        fclose(f);
    }
    qsort(lines, n, sizeof *lines, cmp_str_from4);
    ch_out("    gateway log %s .. %s (errors, upstream/store errors, restarts; both instances):\n", a, b);
    for (size_t i = 0; i < n; i++) {
        if (i < CH_LOG_LINES_MAX)
            ch_out("      %.400s\n", lines[i]);
        free(lines[i]);
    }
    if (n > CH_LOG_LINES_MAX || more)
        ch_out("      ... %zu more\n", n - (n > CH_LOG_LINES_MAX ? CH_LOG_LINES_MAX : n) + more);
    if (n == 0)
        ch_out("      (none)\n");
    if (upstream_errors)
        ch_out("      (and %zu event=upstream_error lines, mostly other clients' close/reset requests)\n",
               upstream_errors);
    free(lines);
}

static void print_user(const struct ctx *x, const struct user *u, const char *what)
{
    ch_out("  %s: key=%s route=%s tenant=tenant-%u mode=%s delay_ms=%u%s client=%s executions=%ld attempts=%u\n", what,
           u->key, ch_route_name[u->route], (unsigned)u->worker, ch_mode_name[u->mode], (unsigned)u->delay_ms,
           u->shared ? " shared" : "", u->hasty ? "hasty" : "patient", u->count, (unsigned)u->attempts);
    ch_out("    attempts (+seconds>gateway:answer[:e<upstream exec>][R=replayed][:K=gateway killed meanwhile]): %s\n",
           u->ev);
    if (u->final == FIN_ANSWER)
        ch_out("    client kept: status=%d exec=%s replayed=%d\n", u->ans_status, u->ans_exec, u->ans_replayed);
    if (u->row >= 0) {
        const struct row *r = &x->rows[u->row];
        ch_out("    record: state=%s token=%s status=%d lease_left_ms=%ld scope=%.16s...\n", r->state, r->token,
               r->status, r->lease_left_ms, r->scope);
    } else {
        ch_out("    record: none\n");
    }
    if (u->replay_note[0])
        ch_out("    final replay: %s\n", u->replay_note);
    uint64_t to = (u->t_last ? u->t_last : u->t_first) + ch.o.lease_ms + ch.o.up_timeout_ms + 1000;
    ch_print_faults_between(u->t_first > 1000 ? u->t_first - 1000 : 0, to);
    print_gw_log_window(u->t_first > 1000 ? u->t_first - 1000 : 0, to);
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
    char *buf = ch_xmalloc(CH_BODY_CAP);
    for (size_t i = j->idx; c != NULL && i < x->nu && !atomic_load(&ch.abort); i += j->step) {
        struct user *u = x->u[i];
        if (u->row < 0 || strcmp(x->rows[u->row].state, "completed") != 0)
            continue;
        char body[1024];
        size_t blen = ch_build_body(u, body, sizeof body);
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
            int ii = (int)((u->worker + (unsigned)t) % ch.o.instances);
            ch_http_do(c, ch.inst[ii].port, "POST", ch_route_path[u->route], h, body, blen, CH_PATIENT_MS, buf,
                       CH_BODY_CAP, false, &r);
            if (r.cc == CURLE_OK && r.status != 503)
                break;
            ch_nap(200);
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

/* A violation of check k; true when it should be reported in detail (the first CH_REPORT_MAX of each check). */
static bool violation(struct ctx *x, enum chk k)
{
    x->ok[k] = false;
    return x->reported[k]++ < CH_REPORT_MAX;
}

static bool is_fault_mode(const struct user *u)
{
    return u->mode == M_SLOW_TIMEOUT || u->mode == M_CLOSE || u->mode == M_RESET || u->mode == M_503;
}

/* ------------------------------------------------------------------ gathering the history */

static void collect_users(struct ctx *x)
{
    size_t nu = 0;
    for (unsigned w = 0; w < ch.o.workers; w++)
        nu += ch.workers[w].n;
    x->u = ch_xcalloc(nu + 1, sizeof *x->u);
    for (unsigned w = 0; w < ch.o.workers; w++)
        for (size_t i = 0; i < ch.workers[w].n; i++)
            x->u[x->nu++] = &ch.workers[w].users[i];
    qsort(x->u, x->nu, sizeof *x->u, cmp_user);
    x->t.requests = x->nu;
    for (size_t i = 0; i < x->nu; i++) {
        x->t.attempts += x->u[i]->attempts;
        x->t.fin[x->u[i]->final]++;
    }
}

/* The upstream's counts (ground truth), before any replay. */
static bool read_counts(struct ctx *x, CURL *c)
{
    bool ok = upstream_count(c, NULL, &x->total_before);
    for (size_t i = 0; ok && i < x->nu;) {
        size_t j = i;
        while (j < x->nu && strcmp(x->u[j]->key, x->u[i]->key) == 0)
            j++;
        long n = 0;
        if (!upstream_count(c, x->u[i]->key, &n))
            return false;
        for (size_t k = i; k < j; k++)
            x->u[k]->count = n;
        x->t.keys++;
        x->t.executions += n;
        i = j;
    }
    char probe[64];
    snprintf(probe, sizeof probe, "probe-%s", ch.tag);
    if (ok)
        ok = upstream_count(c, probe, &x->probe_count);
    if (ok && x->total_before != x->t.executions + x->probe_count)
        ch_out("chaos: note: upstream total %ld != sum of per-key counts %ld (+probe %ld)\n", x->total_before,
               x->t.executions, x->probe_count);
    return ok;
}

/* Maps each client to its record: unique keys teach each tenant's scope hash, shared keys pick the record with
 * their tenant's scope. Records that contradict that are tenant-isolation violations. */
static void map_rows(struct ctx *x)
{
    for (size_t i = 0; i < x->nu; i++) {
        struct user *u = x->u[i];
        size_t first;
        size_t k = find_rows(x, u->key, ch_route_name[u->route], &first);
        if (u->shared || k == 0)
            continue;
        if (k > 1) {
            x->t.scope_errors++;
            violation(x, K_TENANT);
            ch_out("VIOLATION tenant-isolation: %zu records for the unique key %s\n", k, u->key);
        }
        u->row = (int)first;
        x->rows[first].user = (int)i;
        char *ts = x->tenant_scope[u->worker % CH_MAX_WORKERS];
        if (ts[0] == '\0')
            snprintf(ts, 68, "%s", x->rows[first].scope);
        else if (strcmp(ts, x->rows[first].scope) != 0) {
            x->t.scope_errors++;
            if (violation(x, K_TENANT))
                ch_out("VIOLATION tenant-isolation: key %s of tenant-%u has scope %.16s..., its other keys %.16s...\n",
                       u->key, (unsigned)u->worker, x->rows[first].scope, ts);
        }
    }
    for (unsigned a = 0; a < ch.o.workers; a++)
        for (unsigned b = a + 1; b < ch.o.workers; b++)
            if (x->tenant_scope[a][0] && strcmp(x->tenant_scope[a], x->tenant_scope[b]) == 0) {
                x->t.scope_errors++;
                violation(x, K_TENANT);
                ch_out("VIOLATION tenant-isolation: tenant-%u and tenant-%u share the scope %.16s...\n", a, b,
                       x->tenant_scope[a]);
            }
    for (size_t i = 0; i < x->nu; i++) {
        struct user *u = x->u[i];
        if (!u->shared)
            continue;
        size_t first;
        size_t k = find_rows(x, u->key, ch_route_name[u->route], &first);
        const char *ts = x->tenant_scope[u->worker % CH_MAX_WORKERS];
        for (size_t j = 0; j < k; j++) {
            struct row *r = &x->rows[first + j];
            if (ts[0] && strcmp(r->scope, ts) == 0) {
                u->row = (int)(first + j);
                r->user = (int)i;
            }
        }
        if (k > 2) {
            x->t.scope_errors++;
            violation(x, K_TENANT);
            ch_out("VIOLATION tenant-isolation: %zu records for the shared key %s (2 tenants)\n", k, u->key);
        }
    }
    char probe[64];
    snprintf(probe, sizeof probe, "probe-%s", ch.tag);
    for (size_t i = 0; i < x->nrows; i++)
        if (x->rows[i].user < 0 && strcmp(x->rows[i].key, probe) != 0 &&
            strncmp(x->rows[i].key, CH_PURGE_PREFIX, strlen(CH_PURGE_PREFIX)) != 0)
            x->t.foreign++;
}

/* Final replays of the completed records (nothing may execute), in parallel. */
static void run_replays(struct ctx *x, CURL *c)
{
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
    for (unsigned i = 0; i < nth; i++) {
        pthread_join(th[i], NULL);
        x->t.replays += jobs[i].sent;
        x->t.replay_fail += jobs[i].failed;
    }
    if (nth < CH_REPLAY_THREADS)
        ch_out("chaos: note: only %u replay threads started\n", nth);
    if (!upstream_count(c, NULL, &x->total_after))
        x->total_after = -1;
}

/* ------------------------------------------------------------------ the checks */

static void check_at_most_once(struct ctx *x)
{
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
            long a = 1;
            if (u->route == RT_RETRY) {
                strict = false;
                a += u->n_gw_unknown + u->n_release + (is_fault_mode(u) && u->first_delivered ? 1 : 0) +
                     ch_faults_overlapping(u->t_first, u->t_last, ch_fault_mask_disruptive());
            }
            allowed += a;
        }
        if (count > users) {
            long re = count - users;
            long ok_re = allowed - users;
            if (ok_re > re)
                ok_re = re;
            x->t.allowed_reexec += ok_re;
            if (count > allowed) {
                x->t.forbidden += count - allowed;
                if (violation(x, K_AT_MOST_ONCE)) {
                    ch_out("VIOLATION at-most-once: key %s executed %ld times, allowed %ld (%s)\n", x->u[i]->key, count,
                           allowed,
                           strict ? "reject route: never twice per tenant"
                                  : "retry route: only after a release or an unknown outcome");
                    for (size_t k = i; k < j; k++)
                        print_user(x, x->u[k], "client");
                }
            }
        }
        i = j;
    }
}

static void check_same_answer(struct ctx *x)
{
    for (size_t i = 0; i < x->nu; i++) {
        struct user *u = x->u[i];
        const struct row *r = u->row >= 0 ? &x->rows[u->row] : NULL;
        if (u->n_unexpected) {
            x->t.unexpected++;
            if (violation(x, K_SAME_ANSWER))
                print_user(x, u, "VIOLATION same-answer: unexpected answer");
        }
        if (u->final == FIN_UNKNOWN && u->count == 0)
            x->t.blocked_no_exec++;
        if ((u->final == FIN_UNKNOWN || u->n_gw_unknown > 0) && !is_fault_mode(u) &&
            ch_faults_overlapping(u->t_first, u->t_last, ch_fault_mask_disruptive()) == 0) {
            if (x->t.spurious_unknown++ < 3)
                print_user(x, u, "note: unknown outcome without an injected cause");
        }
        if (u->final == FIN_ANSWER) {
            if (r == NULL) {
                x->t.lost_answers++;
                if (violation(x, K_SAME_ANSWER))
                    print_user(x, u, "VIOLATION same-answer: answered key without a record (lost)");
            } else if (strcmp(r->state, "completed") != 0) {
                x->t.unstored_answers++; /* completion failed: allowed by SPEC section 4, checked against logs below */
            } else if (!u->replay_ok) {
                x->t.lost_answers++;
                if (violation(x, K_SAME_ANSWER))
                    print_user(x, u, "VIOLATION same-answer: the final replay differs from the client's answer");
            }
        } else if (r != NULL && strcmp(r->state, "completed") == 0) {
            x->t.late_answers++;
            if (!u->replay_ok && !u->wrong_tenant) {
                x->t.lost_answers++;
                if (violation(x, K_SAME_ANSWER))
                    print_user(x, u, "VIOLATION same-answer: replay of a completed record is wrong");
            }
        }
    }
    if (x->t.unstored_answers > x->completion_failed_logs) {
        violation(x, K_SAME_ANSWER);
        ch_out("VIOLATION same-answer: %zu answered keys are not completed, but the gateways logged only %u "
               "completion_failed events\n",
               x->t.unstored_answers, x->completion_failed_logs);
        unsigned shown = 0;
        for (size_t i = 0; i < x->nu && shown < CH_REPORT_MAX; i++) {
            struct user *u = x->u[i];
            if (u->final == FIN_ANSWER && u->row >= 0 && strcmp(x->rows[u->row].state, "completed") != 0) {
                print_user(x, u, "unstored answer");
                shown++;
            }
        }
    }
}

static void check_tenant_isolation(struct ctx *x)
{
    /* the scope violations were found while mapping the records (map_rows) */
    for (size_t i = 0; i < x->nu; i++) {
        struct user *u = x->u[i];
        if (u->wrong_tenant) {
            x->t.wrong_tenant++;
            if (violation(x, K_TENANT))
                print_user(x, u, "VIOLATION tenant-isolation: answer with another tenant's body");
        }
    }
}

static void check_records_settled(struct ctx *x)
{
    for (size_t i = 0; i < x->nrows; i++) {
        struct row *r = &x->rows[i];
        if (strcmp(r->state, "completed") == 0)
            x->t.rows_completed++;
        else if (strcmp(r->state, "unknown") == 0)
            x->t.rows_unknown++;
        else
            x->t.rows_in_flight++;
        if (strcmp(r->state, "completed") != 0 && r->lease_live) {
            x->t.stuck++;
            violation(x, K_SETTLED);
            ch_out("VIOLATION records-settled: stuck record key=%s route=%s state=%s lease_left_ms=%ld (after the "
                   "quiet period)\n",
                   r->key, r->route, r->state, r->lease_left_ms);
        } else if (strcmp(r->state, "in_flight") == 0) {
            x->t.orphaned++;
        }
        if (strcmp(r->state, "completed") == 0 && r->status == 503) {
            x->t.stored_release++;
            violation(x, K_SETTLED);
            ch_out("VIOLATION records-settled: a release status was stored key=%s route=%s\n", r->key, r->route);
        }
    }
    if (x->total_after != x->total_before) {
        x->t.replay_executed = (size_t)(x->total_after > x->total_before ? x->total_after - x->total_before : 1);
        violation(x, K_SETTLED);
        ch_out("VIOLATION records-settled: %zu executions happened during the final replays of completed records\n",
               x->t.replay_executed);
    }
    /* an executed key must keep a record unless the client saw it released */
    for (size_t i = 0; i < x->nu; i++) {
        struct user *u = x->u[i];
        bool maybe_released = u->n_release > 0 || u->n_up_unavail > 0 || (u->mode == M_503 && u->first_delivered) ||
                              ch_faults_overlapping(u->t_first, u->t_last, 1u << F_UPSTREAM_DOWN) > 0;
        if (!u->shared && u->count > 0 && u->row < 0 && !maybe_released && u->final != FIN_ANSWER) {
            x->t.lost_records++;
            if (violation(x, K_SETTLED))
                print_user(x, u, "VIOLATION records-settled: executed key without a record, never released");
        }
    }
}

/* One final retry of u as its client would send it (no fault asked for): true when it was answered by an
 * execution or a replay; note says what happened. */
static bool liveness_retry(CURL *c, struct user *u, char *buf, char *note, size_t noten)
{
    char body[1024];
    size_t blen = ch_build_body(u, body, sizeof body);
    struct curl_slist *h = ch_build_headers(u, false);
    struct http_res r;
    char tok[96] = "";
    enum cls k = C_TRANSPORT;
    for (int t = 0; t < CH_LIVENESS_TRIES && !atomic_load(&ch.abort); t++) {
        int ii = (int)((u->worker + (unsigned)t) % ch.o.instances);
        ch_http_do(c, ch.inst[ii].port, "POST", ch_route_path[u->route], h, body, blen, CH_PATIENT_MS, buf, CH_BODY_CAP,
                   true, &r);
        k = ch_classify(u, &r, body, blen, tok, sizeof tok);
        if (k != C_STORE_UNAVAIL && k != C_BUSY && k != C_REFUSED && k != C_TRANSPORT && k != C_TIMEOUT)
            break; /* 409 included: every lease has lapsed, nothing else runs */
        ch_nap(500);
    }
    curl_slist_free_all(h);
    snprintf(note, noten, "final retry after the leases lapsed: %s", tok);
    return k == C_ANSWER;
}

/* Liveness: a key that never executed, whose attempts no gateway kill (or upstream outage: the request may have
 * been sent and lost) overlapped, must not stay blocked once the leases lapsed: its record is completed, or a
 * final retry gets an execution or a replay, never 409. */
static void check_liveness(struct ctx *x)
{
    CURL *c = curl_easy_init();
    char *buf = ch_xmalloc(CH_BODY_CAP);
    unsigned excuse = ch_fault_mask_excuses_stuck();
    uint64_t deadline = ch_mono_ms() + 60000; /* bounded: keys left when it passes are counted, not retried */
    for (size_t i = 0; c != NULL && i < x->nu; i++) {
        struct user *u = x->u[i];
        const struct row *r = u->row >= 0 ? &x->rows[u->row] : NULL;
        if (u->count != 0 || r == NULL || strcmp(r->state, "completed") == 0)
            continue;
        x->t.never_executed_unsettled++;
        uint64_t until = (u->t_last ? u->t_last : u->t_first) + ch.o.lease_ms;
        if (ch_faults_overlapping(u->t_first, until, excuse) > 0) {
            x->t.liveness_excused++;
            continue;
        }
        if (ch_mono_ms() >= deadline) {
            x->t.liveness_not_retried++;
            violation(x, K_LIVENESS);
            continue;
        }
        x->t.liveness_retried++;
        if (!liveness_retry(c, u, buf, u->replay_note, sizeof u->replay_note)) {
            x->t.liveness_stuck++;
            if (violation(x, K_LIVENESS))
                print_user(x, u,
                           "VIOLATION liveness: a key that never executed is stuck (no gateway kill or upstream "
                           "outage overlapped it)");
        }
    }
    free(buf);
    curl_easy_cleanup(c);
}

/* Sequences applied in order per resource (SPEC 6): the upstream counts every write it applied with an
 * X-Sequence below its resource's highest applied one (a lower sequence that overtook a higher one: a lost update). */
static void check_order(struct ctx *x)
{
    CURL *c = curl_easy_init();
    char buf[64];
    uint64_t v = 0;
    bool ok = c != NULL && ch_http_get_ok(c, ch.tu_port, "/_test/order-violations", 3000, buf, sizeof buf) &&
              ch_parse_u64(buf, UINT32_MAX, &v);
    curl_easy_cleanup(c);
    x->order_violations = (long)v;
    if (!ok) {
        violation(x, K_ORDER);
        ch_out("VIOLATION in-order: cannot read the upstream's order violations\n");
    } else if (v > 0) {
        violation(x, K_ORDER);
        ch_out("VIOLATION in-order: %" PRIu64 " writes applied below their resource's highest applied sequence (see "
               "event=order_violation in testupstream.log)\n",
               v);
    } else if (atomic_load(&ch.ord_done) < 10 && ch.o.duration_s >= 30) {
        violation(x, K_ORDER);
        ch_out("VIOLATION in-order: the ordered writers settled only %lu sequences\n", atomic_load(&ch.ord_done));
    }
}

static void check_run(struct ctx *x)
{
    unsigned crashes = 0, restart_fails = 0, external = 0;
    for (unsigned i = 0; i < ch.o.instances; i++) {
        crashes += ch.inst[i].crashes - ch.inst[i].external_stops;
        external += ch.inst[i].external_stops;
        restart_fails += ch.inst[i].restart_fails;
    }
    if (x->t.requests < ch.o.workers || x->t.fin[FIN_ANSWER] == 0 || x->t.executions == 0) {
        violation(x, K_RUN);
        ch_out("VIOLATION run: too little traffic (requests=%zu answered=%zu executions=%ld)\n", x->t.requests,
               x->t.fin[FIN_ANSWER], x->t.executions);
    }
    if (!ch.o.no_faults && ch.o.duration_s >= 30)
        for (unsigned k = 0; k < F__N; k++)
            if ((ch.o.fault_mask & (1u << k)) && ch.faults[k] == 0) {
                violation(x, K_RUN);
                ch_out("VIOLATION run: no %s fault was injected\n", ch_fault_name((enum fkind)k));
            }
    if (crashes || restart_fails || ch.fault_failures) {
        violation(x, K_RUN);
        ch_out("VIOLATION run: gateway crashes=%u restart failures=%u fault command failures=%u\n", crashes,
               restart_fails, ch.fault_failures);
    }
    if (external) {
        violation(x, K_RUN);
        ch_out("VIOLATION run: %u gateway stops by a SIGTERM/SIGINT from outside this checker (not a gateway "
               "defect: something on this machine signals idemgate processes it did not start)\n",
               external);
    }
}

/* The purge rounds (faults.c, Redis paused while a purge is answered) report their violations as they happen. */
static void check_purge(struct ctx *x)
{
    if (ch.purge_violations > 0) {
        x->ok[K_PURGE] = false;
        x->reported[K_PURGE] = ch.purge_violations;
    }
}

/* Every record of the run checked against the upstream's look-up by `idemgate reconcile` (last: the final replays and
 * retries are done). A completed record the upstream never executed is `missing`. */
static void check_reconciled(struct ctx *x)
{
    if (ch.o.reconcile_forget_one && !ch_reconcile_forget_one())
        ch_out("chaos: --reconcile-forget-one: no answered key of route %s to forget\n", ch_route_name[RT_RETRY]);
    size_t problems = ch_reconcile_run(&x->rc);
    if (problems > 0) {
        x->ok[K_RECONCILE] = false;
        x->reported[K_RECONCILE] = (unsigned)problems;
    }
}

struct check {
    const char *name;
    void (*run)(struct ctx *x);
    const char *meaning; /* printed when it fails */
};

/* Run in this order (liveness next to last: its final retries may execute; the reconciliation after them); reported
 * in this order. */
static const struct check checks[K__N] = {
    [K_RUN] = {"run", check_run,
               "the run itself went wrong (too little traffic, a fault kind never injected, a "
               "gateway crash or a failed fault command): the other checks prove less"},
    [K_AT_MOST_ONCE] = {"at-most-once", check_at_most_once,
                        "keys executed more often than the protocol allows (forbidden duplicates)"},
    [K_SAME_ANSWER] = {"same-answer", check_same_answer,
                       "answers the gateways do not stand by: lost records, replays that differ, unexpected answers"},
    [K_TENANT] = {"tenant-isolation", check_tenant_isolation, "one tenant's answer or scope reached another"},
    [K_SETTLED] = {"records-settled", check_records_settled,
                   "records left in a state the protocol does not allow after the quiet period"},
    [K_ORDER] = {"in-order", check_order,
                 "a lower sequence was applied after a higher one of the same resource (the ordering guard let a "
                 "request overtake another in flight)"},
    [K_PURGE] = {"across-purges", check_purge,
                 "after an admin purge answered while Redis was paused, a retry of the new intent did not get its "
                 "first answer (the purged answer or a 422 from Redis, or a second execution)"},
    [K_LIVENESS] = {"liveness", check_liveness,
                    "keys that never executed stay blocked (409) after every lease lapsed: a claim nobody acted on "
                    "was never released"},
    [K_RECONCILE] = {"reconciled", check_reconciled,
                     "idemgate reconcile found records completed here that the upstream's look-up says never executed "
                     "(missing), or could not reconcile a route"},
};

static void print_figures(const struct ctx *x)
{
    const struct tally *t = &x->t;
    unsigned restarts = 0;
    for (unsigned i = 0; i < ch.o.instances; i++)
        restarts += ch.inst[i].restarts;
    ch_out("\nchaos: ---- figures (seed %" PRIu64 ", %u workers, %u instances, %us traffic, lease %ums, upstream "
           "timeout %ums)\n",
           ch.o.seed, ch.o.workers, ch.o.instances, ch.o.duration_s, ch.o.lease_ms, ch.o.up_timeout_ms);
    ch_out("chaos: requests=%zu keys=%zu attempts=%zu final_replays=%u (transport failures %u)\n", t->requests, t->keys,
           t->attempts, t->replays, t->replay_fail);
    ch_out("chaos: client outcomes: answered=%zu outcome_unknown=%zu gave_up=%zu unexpected=%zu\n", t->fin[FIN_ANSWER],
           t->fin[FIN_UNKNOWN], t->fin[FIN_GAVE_UP], t->fin[FIN_UNEXPECTED]);
    char line[512];
    size_t o = 0;
    for (unsigned k = 0; k < F__N && o < sizeof line; k++)
        if (ch.o.fault_mask & (1u << k))
            o += (size_t)snprintf(line + o, sizeof line - o, "%s=%u ", ch_fault_name((enum fkind)k), ch.faults[k]);
    ch_out("chaos: faults: %s(gateway restarts %u, upstream connections reset %u)\n", line, restarts,
           atomic_load(&ch.gate_resets));
    ch_out("chaos: executions=%ld duplicates(forbidden)=%ld allowed_re_executions=%ld\n", t->executions, t->forbidden,
           t->allowed_reexec);
    ch_out("chaos: lost_answers=%zu unstored_answers=%zu (completion_failed logged: %u, lease_lost logged: %u) "
           "late_answers=%zu unexpected_answers=%zu\n",
           t->lost_answers, t->unstored_answers, x->completion_failed_logs, x->lease_lost_logs, t->late_answers,
           t->unexpected);
    ch_out("chaos: wrong_tenant_answers=%zu scope_errors=%zu\n", t->wrong_tenant, t->scope_errors);
    ch_out("chaos: ordered: requests=%lu sequences_settled=%lu applied_out_of_order=%ld\n",
           atomic_load(&ch.ord_requests), atomic_load(&ch.ord_done), x->order_violations);
    ch_out("chaos: records: completed=%zu unknown=%zu in_flight_lapsed=%zu stuck=%zu lost=%zu stored_release=%zu "
           "foreign=%zu; keys blocked as unknown without any execution=%zu; unknown outcomes without an injected "
           "cause=%zu\n",
           t->rows_completed, t->rows_unknown, t->orphaned, t->stuck, t->lost_records, t->stored_release, t->foreign,
           t->blocked_no_exec, t->spurious_unknown);
    ch_out("chaos: purges with Redis paused: rounds=%u inconclusive=%u violations=%u\n", ch.purge_rounds,
           ch.purge_inconclusive, ch.purge_violations);
    ch_out("chaos: liveness: never-executed keys with an unsettled record=%zu (excused by a gateway kill or "
           "upstream outage %zu, retried %zu, stuck %zu, not retried in time %zu)\n",
           t->never_executed_unsettled, t->liveness_excused, t->liveness_retried, t->liveness_stuck,
           t->liveness_not_retried);
    ch_reconcile_print(&x->rc);
}

bool ch_run_checks(unsigned *passed_out, unsigned *failed_out)
{
    struct ctx *x = ch_xcalloc(1, sizeof *x);
    for (unsigned k = 0; k < K__N; k++)
        x->ok[k] = true;
    bool ok = false;
    collect_users(x);
    CURL *c = curl_easy_init();
    if (c == NULL || !read_counts(x, c)) {
        ch_out("chaos: cannot read the upstream's counts\n");
        goto done;
    }
    if (!load_rows(x))
        goto done;
    map_rows(x);
    run_replays(x, c);
    x->completion_failed_logs = count_log_events("completion_failed");
    x->lease_lost_logs = count_log_events("lease_lost");
    for (unsigned k = 0; k < K__N; k++)
        checks[k].run(x);
    print_figures(x);
    unsigned passed = 0, failed = 0;
    for (unsigned k = 0; k < K__N; k++) {
        if (x->ok[k])
            ch_out("chaos: check %-17s PASS\n", checks[k].name);
        else
            ch_out("chaos: check %-17s FAIL: %u violations: %s\n", checks[k].name, x->reported[k], checks[k].meaning);
        if (x->ok[k])
            passed++;
        else
            failed++;
    }
    *passed_out = passed;
    *failed_out = failed;
    ok = true;
done:
    curl_easy_cleanup(c);
    free(x->rows);
    free(x->u);
    free(x);
    return ok;
}
