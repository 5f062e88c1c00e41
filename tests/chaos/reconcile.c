/* reconcile.c - the closing reconciliation: after the checks, `idemgate reconcile --json` on each idempotent route
 * (pay, book, ord) with a config of the run's store and routes whose look-up asks testupstream directly
 * (/_lookup?idempotency_key=K); the JSON lines are tallied, and a record `missing` (completed here, absent upstream)
 * fails the run. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "gateways.h"
#include "reconcile.h"

#define RC_TIMEOUT_MS 120000 /* one route's run, at 2000 look-ups a second */
#define RC_SHOW_MAX   8      /* missing records printed per route */

/* The string value of "name":"..." in line (no escapes: the run's keys and results have none), or false. */
static bool json_str(const char *line, const char *name, char *out, size_t n)
{
    char pat[48];
    snprintf(pat, sizeof pat, "\"%s\":\"", name);
    const char *p = strstr(line, pat);
    if (p == NULL)
        return false;
    p += strlen(pat);
    size_t len = strcspn(p, "\"\\");
    if (p[len] != '"' || len >= n)
        return false;
    memcpy(out, p, len);
    out[len] = '\0';
    return true;
}

/* The number value of "name":N in line, or 0. */
static size_t json_num(const char *line, const char *name)
{
    char pat[48];
    snprintf(pat, sizeof pat, "\"%s\":", name);
    const char *p = strstr(line, pat);
    return p ? (size_t)strtoull(p + strlen(pat), NULL, 10) : 0;
}

/* One record's line. */
static void tally_line(struct ch_rc_route *t, const char *line)
{
    char key[160], res[32], state[16];
    if (!json_str(line, "key", key, sizeof key) || !json_str(line, "result", res, sizeof res) ||
        !json_str(line, "state", state, sizeof state)) {
        ch_out("chaos: reconcile %s: unreadable line: %.200s", t->route, line);
        t->complete = false;
        return;
    }
    if (strstr(key, ch.tag) == NULL) {
        t->foreign++;
        return;
    }
    t->records++;
    if (key[0] == 's' && strcmp(t->route, ch_route_name[RT_REJECT]) == 0)
        t->shared++;
    if (strcmp(res, "confirmed") == 0) {
        t->confirmed++;
    } else if (strcmp(res, "missing") == 0) {
        if (t->missing++ < RC_SHOW_MAX)
            ch_out("VIOLATION reconciled: route=%s key=%s state=%s status=%zu: completed here, the upstream's "
                   "look-up says it never executed\n",
                   t->route, key, state, json_num(line, "status"));
    } else if (strcmp(res, "resolved-found") == 0) {
        t->found++;
    } else if (strcmp(res, "resolved-absent") == 0) {
        t->absent++;
    } else {
        t->undetermined++;
    }
}

/* Reads the output of one route's run (stdout and stderr in one file: the JSON lines start with '{'). */
static void read_output(struct ch_rc_route *t, const char *path)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        ch_out("chaos: reconcile %s: cannot read %s\n", t->route, path);
        return;
    }
    char line[2048];
    bool summary = false;
    size_t sum_records = 0;
    while (fgets(line, sizeof line, f) != NULL) {
        if (strncmp(line, "{\"summary\":", 11) == 0) {
            summary = strstr(line, "\"complete\":true") != NULL;
            sum_records = json_num(line, "records");
        } else if (strncmp(line, "{\"route\":", 9) == 0) {
            tally_line(t, line);
        } else {
            ch_out("chaos: reconcile %s: %s", t->route, line); /* stderr: what went wrong */
        }
    }
    fclose(f);
    if (!summary || sum_records != t->records + t->foreign)
        t->complete = false;
}

static void out_path(const struct ch_rc_route *t, char *out, size_t n)
{
    snprintf(out, n, "%s/reconcile-%s.jsonl", ch.dir, t->route);
}

/* Starts idemgate reconcile on t's route; its pid, or -1 (t incomplete). */
static pid_t start_route(struct ch_rc_route *t, const char *conf, const char *since)
{
    char out[PATH_MAX];
    out_path(t, out, sizeof out);
    char *argv[] = {ch.idemgate_bin,   (char *)"reconcile", (char *)"-c",      (char *)conf,
                    (char *)"--route", (char *)t->route,    (char *)"--since", (char *)since,
                    (char *)"--rate",  (char *)"2000/s",    (char *)"--json",  NULL};
    static char token[] = "IDEMGATE_ADMIN_TOKEN=" CH_ADMIN_TOKEN; /* the config has the gateways' admin section */
    t->exit_code = -1;
    t->complete = true;
    pid_t p = ch_spawn_env(argv, out, (char *[]){token, NULL});
    if (p <= 0)
        t->complete = false;
    return p;
}

/* Waits for t's run (until the deadline) and reads its output. */
static void finish_route(struct ch_rc_route *t, pid_t p, uint64_t deadline)
{
    uint64_t now = ch_mono_ms();
    int st = 0;
    if (p <= 0)
        return;
    if (!ch_proc_wait(p, now < deadline ? (int)(deadline - now) : 0, &st)) {
        ch_proc_stop(p, SIGKILL, 1000);
        ch_out("chaos: reconcile %s: did not finish within %d ms\n", t->route, RC_TIMEOUT_MS);
        t->complete = false;
    } else if (WIFEXITED(st)) {
        t->exit_code = WEXITSTATUS(st);
    }
    char out[PATH_MAX];
    out_path(t, out, sizeof out);
    read_output(t, out);
    /* exit 1 is "something missing": maybe only another run's record; 2 is a failure */
    if (t->exit_code != 0 && t->exit_code != 1)
        t->complete = false;
}

size_t ch_reconcile_run(struct ch_rc *out)
{
    memset(out, 0, sizeof *out);
    out->r[0].route = ch_route_name[RT_RETRY];
    out->r[1].route = ch_route_name[RT_REJECT];
    out->r[2].route = "ord";
    char conf[PATH_MAX], since[32];
    snprintf(conf, sizeof conf, "%s/reconcile.yaml", ch.dir);
    /* this run's records only (by Postgres's clock, as created_at): a shared database keeps earlier runs' */
    snprintf(since, sizeof since, "%us", (unsigned)((ch_mono_ms() - ch.t0) / 1000 + 30));
    if (!ch_write_reconcile_conf(conf)) {
        ch_out("chaos: reconcile: cannot write %s\n", conf);
        return 1;
    }
    out->ran = true;
    /* the three routes at once: each is bounded by its look-ups' latency (8 at a time), not by the rate */
    uint64_t t0 = ch_mono_ms(), deadline = t0 + RC_TIMEOUT_MS;
    pid_t pids[CH_RC_ROUTES];
    for (int i = 0; i < CH_RC_ROUTES; i++)
        pids[i] = start_route(&out->r[i], conf, since);
    size_t problems = 0;
    for (int i = 0; i < CH_RC_ROUTES; i++) {
        struct ch_rc_route *t = &out->r[i];
        finish_route(t, pids[i], deadline);
        ch_log("event=reconciled route=%s records=%zu missing=%zu exit=%d complete=%d ms=%llu", t->route, t->records,
               t->missing, t->exit_code, t->complete, (unsigned long long)(ch_mono_ms() - t0));
        if (!t->complete)
            ch_out("VIOLATION reconciled: route=%s: idemgate reconcile did not complete (exit %d; see %s/reconcile-%s"
                   ".jsonl)\n",
                   t->route, t->exit_code, ch.dir, t->route);
        problems += t->missing + !t->complete;
    }
    return problems;
}

bool ch_reconcile_forget_one(void)
{
    for (unsigned w = 0; w < ch.o.workers; w++)
        for (size_t i = 0; i < ch.workers[w].n; i++) {
            const struct user *u = &ch.workers[w].users[i];
            if (u->route != RT_RETRY || u->final != FIN_ANSWER || u->ans_status != 200 || u->shared)
                continue;
            CURL *c = curl_easy_init();
            char path[128], buf[64];
            snprintf(path, sizeof path, "/_test/forget?key=%s", u->key);
            struct http_res r;
            ch_http_do(c, ch.tu_port, "POST", path, NULL, "", 0, 3000, buf, sizeof buf, true, &r);
            curl_easy_cleanup(c);
            ch_log("event=reconcile_forget key=%s status=%ld msg=\"--reconcile-forget-one: its record must come out "
                   "missing\"",
                   u->key, r.status);
            return r.cc == CURLE_OK && r.status == 200;
        }
    return false;
}

void ch_reconcile_print(const struct ch_rc *rc)
{
    if (!rc->ran) {
        ch_out("chaos: reconcile: not run\n");
        return;
    }
    for (int i = 0; i < CH_RC_ROUTES; i++) {
        const struct ch_rc_route *t = &rc->r[i];
        ch_out("chaos: reconcile %s: records=%zu confirmed=%zu missing=%zu resolved-found=%zu resolved-absent=%zu "
               "undetermined=%zu (shared-key records=%zu, found by key alone; other runs' records skipped=%zu)%s\n",
               t->route, t->records, t->confirmed, t->missing, t->found, t->absent, t->undetermined, t->shared,
               t->foreign, t->complete ? "" : " INCOMPLETE");
    }
}
