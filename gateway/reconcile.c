/* reconcile.c - `idemgate reconcile`: a route's records checked against its upstream's look-up (SPEC 12). It reads
 * the records from Postgres in keyset pages (store/ledger.h), asks the route's probe about each at most --rate a
 * second (gateway/probe.h: the look-up alone, or with --apply the sweeper's take and fenced settle), and reports. It
 * never forwards an intent. */
#include "gateway/reconcile.h"

#include <event2/event.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "conf/conf.h"
#include "gateway/ctx.h"
#include "gateway/probe.h"
#include "gateway/reload.h"
#include "store/ledger.h"
#include "store/migrate.h"
#include "store/store.h"
#include "upstream/upstream.h"

#define RC_PAGE          200  /* records read per page */
#define RC_PARALLEL      8    /* look-ups in flight at once */
#define RC_RATE_DEFAULT  10.0 /* look-ups a second */
#define RC_RATE_MAX      10000.0
#define RC_DB_TIMEOUT_MS 10000 /* each page's statement */
#define RC_SINCE_DEFAULT (24ull * 3600 * 1000)

enum rc_result { RC_CONFIRMED, RC_MISSING, RC_FOUND, RC_ABSENT, RC_UNDETERMINED, RC__COUNT };
static const char *const rc_names[RC__COUNT] = {"confirmed", "missing", "resolved-found", "resolved-absent",
                                                "undetermined"};

struct rc_opts {
    const char *file;
    const char *route;
    uint64_t since_ms;
    enum store_ledger_state state;
    double rate;
    bool apply;
    bool json;
};

struct rc {
    struct rc_opts o;
    struct gw_ctx ctx;
    struct gw_conf *gc;
    struct store_ledger *ledger;
    struct store_ledger_rec *page;
    size_t page_n, next;
    bool last_page;
    size_t running;
    struct event *tick;
    uint64_t started_ms;
    size_t counts[RC__COUNT];
    size_t applied, records;
    bool failed; /* Postgres failed while reading: exit 2 */
};

struct rc_item {
    struct rc *rc;
    struct store_ledger_rec rec; /* the key is the item's */
};

static void usage(FILE *out)
{
    fprintf(out, "usage: idemgate reconcile -c FILE --route R [--since 24h] [--state completed|unknown|all]\n"
                 "                          [--rate N/s] [--apply] [--json]\n"
                 "  asks route R's probe look-up about each of its records claimed within --since and reports each as\n"
                 "  confirmed, missing, resolved-found, resolved-absent or undetermined; --apply settles the unknown\n"
                 "  outcomes the look-up decides. Exit 0: nothing missing; 1: some record is missing upstream;\n"
                 "  2: usage, configuration or Postgres error.\n");
}

/* ---- output */

static void put_json_string(FILE *f, const char *s, size_t n)
{
    fputc('"', f);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20 || c == 0x7f)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

static void fmt_time(int64_t ms, char out[32])
{
    time_t t = (time_t)(ms / 1000);
    struct tm tm;
    if (!gmtime_r(&t, &tm) || strftime(out, 32, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0)
        snprintf(out, 32, "-");
}

static void report(struct rc *rc, const struct store_ledger_rec *rec, enum rc_result res, bool applied)
{
    char when[32], scope[17];
    fmt_time(rec->created_ms, when);
    for (int i = 0; i < 8; i++) /* a prefix of the scope's hash: tells tenants apart, never a scope value */
        snprintf(scope + 2 * i, 3, "%02x", rec->scope[i]);
    const char *state = rec->completed ? "completed" : "unknown";
    if (rc->o.json) {
        fputs("{\"route\":", stdout);
        put_json_string(stdout, rc->o.route, strlen(rc->o.route));
        fputs(",\"key\":", stdout);
        put_json_string(stdout, rec->key, rec->key_len);
        printf(",\"scope\":\"%s\",\"state\":\"%s\",\"status\":%d,\"created_at\":\"%s\",\"result\":\"%s\","
               "\"applied\":%s}\n",
               scope, state, rec->status, when, rc_names[res], applied ? "true" : "false");
    } else {
        printf("%-16s %-9s %3d %-20s %-16s %s", rc_names[res], state, rec->status, when, scope,
               applied ? "applied " : "");
        for (size_t i = 0; i < rec->key_len; i++) { /* control bytes escaped: a key never moves the terminal */
            unsigned char c = (unsigned char)rec->key[i];
            if (c < 0x20 || c == 0x7f)
                printf("\\x%02x", c);
            else
                putchar(c);
        }
        putchar('\n');
    }
    fflush(stdout);
}

static void summary(struct rc *rc)
{
    double secs = (double)(cm_now_ms() - rc->started_ms) / 1000.0;
    if (rc->o.json) {
        printf("{\"summary\":{\"route\":");
        put_json_string(stdout, rc->o.route, strlen(rc->o.route));
        printf(",\"records\":%zu", rc->records);
        for (int i = 0; i < RC__COUNT; i++)
            printf(",\"%s\":%zu", rc_names[i], rc->counts[i]);
        printf(",\"applied\":%zu,\"seconds\":%.3f,\"complete\":%s}}\n", rc->applied, secs,
               rc->failed ? "false" : "true");
    } else {
        printf("summary: route=%s records=%zu", rc->o.route, rc->records);
        for (int i = 0; i < RC__COUNT; i++)
            printf(" %s=%zu", rc_names[i], rc->counts[i]);
        printf(" applied=%zu seconds=%.3f%s\n", rc->applied, secs, rc->failed ? " incomplete" : "");
    }
    fflush(stdout);
}

/* ---- the look-ups */

static void item_done(struct rc_item *it, enum rc_result res, bool applied)
{
    struct rc *rc = it->rc;
    rc->counts[res]++;
    rc->applied += applied;
    report(rc, &it->rec, res, applied);
    free(it->rec.key);
    free(it);
    rc->running--;
}

/* The look-up alone: a completed record is confirmed or missing; an unknown one would be settled (not applied). */
static void asked(void *arg, enum gw_probe_result r, struct cm_resp *resp)
{
    struct rc_item *it = arg;
    (void)resp;
    bool done = it->rec.completed;
    if (r == GW_PROBE_FOUND)
        item_done(it, done ? RC_CONFIRMED : RC_FOUND, false);
    else if (r == GW_PROBE_ABSENT)
        item_done(it, done ? RC_MISSING : RC_ABSENT, false);
    else
        item_done(it, RC_UNDETERMINED, false);
}

/* --apply on an unknown outcome: the sweeper's take, look-up and fenced settle (gw_probe_run). */
static void applied(void *arg, enum gw_probe_result r, struct cm_resp *resp)
{
    struct rc_item *it = arg;
    (void)resp;
    if (r == GW_PROBE_FOUND)
        item_done(it, RC_FOUND, true);
    else if (r == GW_PROBE_ABSENT)
        item_done(it, RC_ABSENT, true);
    else
        item_done(it, RC_UNDETERMINED, false); /* busy (its original may still run), unresolved, or Postgres */
}

/* The next record, reading the next page when this one is used up. false: none left (or Postgres failed). */
static bool next_record(struct rc *rc, struct store_ledger_rec *out)
{
    if (rc->next == rc->page_n) {
        store_ledger_recs_free(rc->page, rc->page_n);
        rc->page = NULL;
        rc->page_n = rc->next = 0;
        if (rc->last_page || rc->failed)
            return false;
        char *err = NULL;
        if (!store_ledger_page(rc->ledger, rc->o.route, rc->o.since_ms, rc->o.state, RC_PAGE, &rc->page, &rc->page_n,
                               &err)) {
            fprintf(stderr, "idemgate reconcile: %s\n", err ? err : "reading the records failed");
            free(err);
            rc->failed = true;
            return false;
        }
        rc->last_page = rc->page_n < RC_PAGE;
        if (rc->page_n == 0)
            return false;
    }
    *out = rc->page[rc->next];
    rc->page[rc->next].key = NULL; /* the item takes it */
    rc->next++;
    return true;
}

/* One look-up per tick (1/rate s apart), at most RC_PARALLEL at once; the loop ends once all are answered. */
static void tick(evutil_socket_t fd, short what, void *arg)
{
    struct rc *rc = arg;
    (void)fd;
    (void)what;
    if (rc->running >= RC_PARALLEL)
        return;
    struct store_ledger_rec rec;
    if (!next_record(rc, &rec)) {
        if (rc->running == 0)
            event_base_loopbreak(rc->ctx.base);
        return;
    }
    struct rc_item *it = cm_calloc(1, sizeof *it);
    it->rc = rc;
    it->rec = rec;
    rc->records++;
    rc->running++;
    struct store_id id = store_id_of(rc->o.route, rec.scope, it->rec.key, it->rec.key_len);
    if (rc->o.apply && !rec.completed)
        gw_probe_run(rc->ctx.probe, 0, &id, NULL, applied, it);
    else
        gw_probe_ask(rc->ctx.probe, &id, asked, it);
}

/* ---- the command line */

static bool parse_rate(const char *s, double *out)
{
    char *end = NULL;
    double v = strtod(s, &end);
    if (end == s || (*end && strcmp(end, "/s") != 0) || !(v > 0) || v > RC_RATE_MAX)
        return false;
    *out = v;
    return true;
}

static bool parse_args(int argc, char **argv, struct rc_opts *o)
{
    o->since_ms = RC_SINCE_DEFAULT;
    o->state = STORE_LEDGER_ALL;
    o->rate = RC_RATE_DEFAULT;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if ((strcmp(a, "-c") == 0 || strcmp(a, "--config") == 0) && v) {
            o->file = v, i++;
        } else if (strcmp(a, "--route") == 0 && v) {
            o->route = v, i++;
        } else if (strcmp(a, "--since") == 0 && v) {
            if (!conf_parse_duration(v, &o->since_ms)) {
                fprintf(stderr, "idemgate reconcile: --since: not a duration '%s' (e.g. 24h, 30m)\n", v);
                return false;
            }
            i++;
        } else if (strcmp(a, "--state") == 0 && v) {
            if (strcmp(v, "completed") == 0)
                o->state = STORE_LEDGER_COMPLETED;
            else if (strcmp(v, "unknown") == 0)
                o->state = STORE_LEDGER_UNKNOWN;
            else if (strcmp(v, "all") == 0)
                o->state = STORE_LEDGER_ALL;
            else {
                fprintf(stderr, "idemgate reconcile: --state: use completed, unknown or all\n");
                return false;
            }
            i++;
        } else if (strcmp(a, "--rate") == 0 && v) {
            if (!parse_rate(v, &o->rate)) {
                fprintf(stderr, "idemgate reconcile: --rate: a number of look-ups a second, N or N/s, above 0 and at "
                                "most 10000\n");
                return false;
            }
            i++;
        } else if (strcmp(a, "--apply") == 0) {
            o->apply = true;
        } else if (strcmp(a, "--json") == 0) {
            o->json = true;
        } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            exit(0);
        } else {
            fprintf(stderr, "idemgate reconcile: unknown or incomplete argument '%s'\n", a);
            return false;
        }
    }
    if (!o->file || !o->route) {
        fprintf(stderr, "idemgate reconcile: -c FILE and --route R are required\n");
        return false;
    }
    return true;
}

/* The route, when the look-up can ask about its records: it has a probe, and (as for the sweeper, SPEC 9) no scope
 * the look-up cannot carry. NULL with the reason on stderr. */
static const struct conf_route *probe_route(const struct conf *conf, const char *name)
{
    for (size_t i = 0; i < conf->routes_n; i++) {
        const struct conf_route *r = &conf->routes[i];
        if (strcmp(r->name, name) != 0)
            continue;
        if (r->idem.on_unknown != CONF_UNKNOWN_PROBE || !r->idem.probe.enabled) {
            fprintf(stderr,
                    "idemgate reconcile: route '%s' has no probe: (on_unknown: probe with a probe: block), so "
                    "there is no look-up to ask\n",
                    name);
            return NULL;
        }
        if (r->idem.scope_n > 0 && !r->idem.probe.keys_unique_upstream) {
            fprintf(stderr,
                    "idemgate reconcile: route '%s' has a scope and its look-up is not tenant-safe by key alone "
                    "(probe.keys_unique_upstream: false): a record's look-up could find another tenant's request\n",
                    name);
            return NULL;
        }
        return r;
    }
    fprintf(stderr, "idemgate reconcile: no route named '%s' in the configuration\n", name);
    return NULL;
}

int gw_reconcile_main(int argc, char **argv)
{
    struct rc rc;
    memset(&rc, 0, sizeof rc);
    int exit_code = 2;
    char *err = NULL;
    if (!getenv("IDEMGATE_LOG_LEVEL"))
        cm_log_set_level(CM_WARN); /* the report is on stdout; stderr has only what went wrong */
    if (!parse_args(argc, argv, &rc.o)) {
        usage(stderr);
        return 2;
    }
    rc.gc = gw_conf_load(rc.o.file, &err);
    if (!rc.gc) {
        fprintf(stderr, "idemgate reconcile: %s\n", err ? err : "invalid configuration");
        goto done;
    }
    const struct conf *conf = rc.gc->conf;
    if (!probe_route(conf, rc.o.route))
        goto done;
    gw_conf_label(rc.gc);
    rc.ledger = store_ledger_open(conf->postgres_url, RC_DB_TIMEOUT_MS, &err);
    if (!rc.ledger) {
        fprintf(stderr, "idemgate reconcile: %s\n", err ? err : "postgres connection failed");
        goto done;
    }
    rc.ctx.base = event_base_new();
    rc.ctx.nloops = 1;
    rc.ctx.cur = rc.gc; /* the prober reads the configuration here; schema_ready stays false: its sweeper never runs */
    rc.ctx.up = rc.ctx.base ? up_client_create(rc.ctx.base, RC_PARALLEL) : NULL;
    rc.ctx.store = rc.ctx.up ? store_create(rc.ctx.base, conf, &err) : NULL;
    if (!rc.ctx.store) {
        fprintf(stderr, "idemgate reconcile: %s\n", err ? err : "cannot start the event loop");
        goto done;
    }
    rc.ctx.probe = gw_probe_create(&rc.ctx);
    rc.tick = event_new(rc.ctx.base, -1, EV_PERSIST, tick, &rc);
    uint64_t us = (uint64_t)(1e6 / rc.o.rate);
    struct timeval every = {(time_t)(us / 1000000), (suseconds_t)(us % 1000000)};
    if (!rc.tick || event_add(rc.tick, &every) != 0) {
        fprintf(stderr, "idemgate reconcile: cannot start the event loop\n");
        goto done;
    }
    if (!rc.o.json)
        printf("%-16s %-9s %3s %-20s %-16s %s\n", "result", "state", "st", "created_at", "scope", "key");
    rc.started_ms = cm_now_ms();
    tick(-1, 0, &rc); /* the first one at once */
    event_base_dispatch(rc.ctx.base);
    summary(&rc);
    exit_code = rc.failed ? 2 : rc.counts[RC_MISSING] > 0 ? 1 : 0;
done:
    free(err);
    if (rc.tick)
        event_free(rc.tick);
    store_destroy(rc.ctx.store);
    up_client_destroy(rc.ctx.up);
    gw_probe_destroy(rc.ctx.probe);
    if (rc.ctx.base)
        event_base_free(rc.ctx.base);
    store_ledger_recs_free(rc.page, rc.page_n);
    store_ledger_close(rc.ledger);
    gw_conf_unref(rc.gc);
    return exit_code;
}
