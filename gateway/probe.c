/* probe.c - unknown outcomes resolved by asking the upstream (on_unknown: probe): the look-up and the sweeper. It works
 * with the thread's context and never calls the pipeline or the loop. */
#include "gateway/probe.h"

#include <event2/event.h>
#include <stdlib.h>
#include <string.h>

#include "common/metrics.h"
#include "gateway/ctx.h"
#include "gateway/hints.h"
#include "gateway/reload.h"
#include "store/store.h"
#include "upstream/upstream.h"

#define SWEEP_FIRST_MS   1000
#define SWEEP_EVERY_MS   5000 /* SPEC: at least every 10 s */
#define SWEEP_BATCH      16   /* records looked up per sweep and loop, at once */
#define HOLD_EXTRA_MS    5000 /* the take outlives the look-up's own timeouts by this */
#define PROBE_TARGET_MAX (64 * 1024)

struct probe_run {
    struct probe_run *prev, *next;
    struct gw_probe *p;
    struct gw_conf *cref;           /* the configuration in force when the run started (one reference) */
    const struct conf_route *route; /* in cref */
    size_t route_index;
    char *route_name;
    char *key;
    size_t key_len;
    uint8_t scope[32];
    uint64_t token;
    struct cm_hdrs scope_hdrs; /* the retry's scope parts the look-up carries (none for the sweeper) */
    uint64_t hold_ms;          /* the take's lease */
    uint64_t take_sent_ms;     /* the take was handed to the store then (cm_now_ms) */
    uint64_t send_until_ms;    /* SPEC 8: the look-up leaves only before this (the take's lease less a quarter) */
    bool sweep;                /* started by the sweeper (no caller to answer) */
    bool dry;                  /* gw_probe_ask: the look-up only, the record neither taken nor settled */
    struct up_transfer *transfer;
    struct cm_resp resp;
    enum gw_probe_result result;
    gw_probe_cb cb;
    void *arg;
};

struct gw_probe {
    struct gw_ctx *ctx;        /* the thread's context (gateway/ctx.h): base, store, upstream client, configuration */
    struct event *sweep_timer; /* runs always: a reload may add a probe route */
    bool listing;              /* the sweeper's query runs */
    size_t sweeping;           /* look-ups the sweeper started that still run */
    struct probe_run *runs;
};

const char *gw_probe_result_name(enum gw_probe_result r)
{
    switch (r) {
    case GW_PROBE_FOUND:
        return "found";
    case GW_PROBE_ABSENT:
        return "absent";
    case GW_PROBE_UNRESOLVED:
        return "unresolved";
    case GW_PROBE_BUSY:
        return "busy";
    case GW_PROBE_STORE:
        return "store_unavailable";
    }
    return "?";
}

static struct store_id run_id(const struct probe_run *r)
{
    return store_id_of(r->route_name, r->scope, r->key, r->key_len);
}

static void run_free(struct probe_run *r)
{
    struct gw_probe *p = r->p;
    if (r->prev)
        r->prev->next = r->next;
    else
        p->runs = r->next;
    if (r->next)
        r->next->prev = r->prev;
    if (r->sweep && p->sweeping > 0)
        p->sweeping--;
    cm_resp_free(&r->resp);
    cm_hdrs_free(&r->scope_hdrs);
    gw_conf_unref(r->cref);
    free(r->route_name);
    free(r->key);
    free(r);
}

static void run_done(struct probe_run *r, enum gw_probe_result res)
{
    if (res == GW_PROBE_FOUND || res == GW_PROBE_ABSENT) {
        cm_metric_unknown_resolved(r->route_index, res == GW_PROBE_FOUND ? CM_RESOLVED_FOUND : CM_RESOLVED_ABSENT);
        cm_log(CM_INFO, "unknown_resolved", "route=%s how=%s by=%s", r->route_name, gw_probe_result_name(res),
               r->sweep ? "sweeper" : "retry");
    }
    if (r->cb)
        r->cb(r->arg, res, &r->resp);
    run_free(r);
}

static bool status_in(const int *v, size_t n, int status)
{
    for (size_t i = 0; i < n; i++)
        if (v[i] == status)
            return true;
    return false;
}

/* ---- settling the record, fenced by the look-up's token */

/* SPEC 8: how long after a lease's lapse the record may be looked up (the original may still run until then). */
static uint64_t probe_wait_ms(const struct probe_run *r)
{
    const struct conf_upstream *u = &r->cref->conf->upstreams[r->route->upstream];
    return u->timeout_ms + r->route->idem.probe.grace_ms;
}

static void gave_back(void *arg, bool ok, long rows)
{
    struct probe_run *r = arg;
    (void)ok;
    (void)rows; /* not given back: it stays ours until the take's lease lapses, then the next look-up takes it */
    run_done(r, r->result);
}

/* The look-up did not settle it: the record goes back to unknown with a lapsed lease, so the next retry (or sweep)
 * asks again. */
static void give_back(struct probe_run *r, enum gw_probe_result res)
{
    struct store_id id = run_id(r);
    r->result = res;
    cm_resp_free(&r->resp);
    cm_resp_init(&r->resp, 0);
    /* back-dated by the wait: the original attempt is over (the take waited for it), the next look-up may go at once */
    store_mark_unknown(r->p->ctx->store, &id, r->token, -(int64_t)probe_wait_ms(r), r->route->idem.lease_ms, gave_back,
                       r);
}

static void found_stored(void *arg, bool ok, long rows)
{
    struct probe_run *r = arg;
    if (!ok || rows == 0) {
        cm_log(CM_WARN, "probe_unresolved", "route=%s reason=%s", r->route_name,
               ok ? "fenced_out" : "store_unavailable");
        give_back(r, GW_PROBE_UNRESOLVED);
        return;
    }
    run_done(r, GW_PROBE_FOUND);
}

static void absent_released(void *arg, bool ok, long rows)
{
    struct probe_run *r = arg;
    if (!ok || rows == 0) {
        cm_log(CM_WARN, "probe_unresolved", "route=%s reason=%s", r->route_name,
               ok ? "fenced_out" : "store_unavailable");
        run_done(r, GW_PROBE_UNRESOLVED);
        return;
    }
    run_done(r, GW_PROBE_ABSENT);
}

static void looked_up(void *arg, enum up_result ur, struct cm_resp *resp, const char *errmsg, double secs)
{
    struct probe_run *r = arg;
    const struct conf_probe *pc = &r->route->idem.probe;
    struct store *st = r->p->ctx->store;
    struct store_id id = run_id(r);
    r->transfer = NULL;
    cm_metric_upstream(r->route_index, r->cref->conf->upstreams[r->route->upstream].name,
                       ur == UP_OK ? resp->status : 0, secs);
    if (r->dry) { /* what the look-up says, nothing stored */
        bool found = ur == UP_OK && status_in(pc->found, pc->found_n, resp->status);
        bool absent = ur == UP_OK && status_in(pc->absent, pc->absent_n, resp->status);
        if (r->cb)
            r->cb(r->arg, found ? GW_PROBE_FOUND : absent ? GW_PROBE_ABSENT : GW_PROBE_UNRESOLVED, resp);
        r->cb = NULL;
        run_free(r);
        return;
    }
    if (ur == UP_LEASE_LOST) { /* the take lapsed before the look-up could leave: given back, fenced by our token */
        cm_log(CM_WARN, "probe_unresolved", "route=%s reason=lease_lost", r->route_name);
        give_back(r, GW_PROBE_STORE);
        return;
    }
    if (ur == UP_OK && status_in(pc->found, pc->found_n, resp->status)) {
        cm_resp_free(&r->resp);
        r->resp = *resp;
        cm_hdrs_init(&resp->hdrs);
        cm_buf_init(&resp->body, 0);
        /* SPEC 9: the look-up's cookies belong to the gateway's look-up session, never to a client */
        cm_hdrs_remove(&r->resp.hdrs, "Set-Cookie");
        cm_hdrs_remove(&r->resp.hdrs, "Set-Cookie2");
        if (r->route->idem.advertise_expiry) /* a found answer is the record's answer: replays advertise its end */
            gw_expiry_advertise(&r->resp, cm_wall_ms(), r->route->idem.retention_ms);
        store_complete(st, &id, r->token, &r->resp, r->route->idem.retention_ms, r->route->idem.lease_ms, found_stored,
                       r);
        return;
    }
    if (ur == UP_OK && status_in(pc->absent, pc->absent_n, resp->status)) {
        store_release(st, &id, r->token, r->route->idem.lease_ms, absent_released, r);
        return;
    }
    char q[256];
    if (ur == UP_OK)
        cm_log(CM_WARN, "probe_unresolved", "route=%s status=%d", r->route_name, resp->status);
    else
        cm_log(CM_WARN, "probe_unresolved", "route=%s result=%s detail=%s", r->route_name, up_result_name(ur),
               cm_log_quote(q, sizeof q, errmsg ? errmsg : ""));
    give_back(r, GW_PROBE_UNRESOLVED);
}

/* Appends text with each "{key}" replaced by the key: percent-encoded (everything but RFC 3986 unreserved) in the
 * target, as it is in a header value (visible ASCII and spaces, a valid field value). false: over the cap. */
static bool put_with_key(const struct probe_run *r, const char *text, bool encode, struct cm_buf *out)
{
    static const char hex[] = "0123456789ABCDEF";
    for (const char *at; (at = strstr(text, "{key}")) != NULL; text = at + 5) {
        if (!cm_buf_append(out, text, (size_t)(at - text)))
            return false;
        for (size_t i = 0; i < r->key_len; i++) {
            unsigned char ch = (unsigned char)r->key[i];
            bool unreserved = (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') ||
                              ch == '-' || ch == '.' || ch == '_' || ch == '~';
            char enc[3] = {'%', hex[ch >> 4], hex[ch & 15]};
            if (!(unreserved || !encode ? cm_buf_append(out, (const char *)&ch, 1) : cm_buf_append(out, enc, 3)))
                return false;
        }
    }
    return cm_buf_appendf(out, "%s", text);
}

/* The look-up's headers: probe.headers ({key} replaced where written), then the retry's scope parts, which replace
 * a probe header of the same name (the tenant asks as itself). false: a value over the cap. */
static bool build_headers(const struct probe_run *r, struct cm_hdrs *hdrs)
{
    const struct conf_probe *pc = &r->route->idem.probe;
    bool ok = true;
    for (size_t i = 0; i < pc->headers_n && ok; i++) {
        if (cm_hdrs_get(&r->scope_hdrs, pc->headers[i].name))
            continue;
        if (!pc->headers[i].has_key) {
            cm_hdrs_add(hdrs, pc->headers[i].name, pc->headers[i].value);
            continue;
        }
        struct cm_buf v;
        cm_buf_init(&v, PROBE_TARGET_MAX);
        ok = put_with_key(r, pc->headers[i].value, false, &v);
        if (ok)
            cm_hdrs_addn(hdrs, pc->headers[i].name, strlen(pc->headers[i].name), v.data, v.len);
        cm_buf_free(&v);
    }
    for (size_t i = 0; i < r->scope_hdrs.n; i++)
        cm_hdrs_add(hdrs, r->scope_hdrs.v[i].name, r->scope_hdrs.v[i].value);
    return ok;
}

/* Sends the look-up: the route's upstream and timeouts, probe.headers and the retry's scope parts only (never the
 * client's other headers). */
static bool send_lookup(struct probe_run *r)
{
    const struct conf *conf = r->cref->conf;
    const struct conf_upstream *u = &conf->upstreams[r->route->upstream];
    const struct conf_probe *pc = &r->route->idem.probe;
    struct cm_buf target;
    cm_buf_init(&target, PROBE_TARGET_MAX);
    struct cm_hdrs hdrs;
    cm_hdrs_init(&hdrs);
    bool ok = cm_buf_appendf(&target, "%s", u->base_path) && put_with_key(r, pc->path, true, &target) &&
              build_headers(r, &hdrs);
    if (ok) {
        struct up_tls tls;
        struct up_origin origin = gw_upstream_origin(u, &tls);
        bool safe = strcmp(pc->method, "GET") == 0 || strcmp(pc->method, "HEAD") == 0;
        struct up_request req = {
            .method = pc->method,
            .origin = &origin,
            .target = target.data,
            .hdrs = &hdrs,
            .connect_timeout_ms = u->connect_timeout_ms,
            .timeout_ms = u->timeout_ms,
            .max_response = (size_t)r->route->idem.max_response,
            .max_header_bytes = (size_t)conf->max_response_header_bytes,
            .no_resend = !safe,
            .max_connections = gw_ctx_upstream_max(r->p->ctx, u),
            .keepalive_ms = u->keepalive_timeout_ms,
            .send_until_ms = &r->send_until_ms,
        };
        r->transfer = up_send(r->p->ctx->up, &req, looked_up, r);
        ok = r->transfer != NULL;
    }
    cm_hdrs_free(&hdrs);
    cm_buf_free(&target);
    return ok;
}

static void taken(void *arg, bool ok, long rows)
{
    struct probe_run *r = arg;
    if (!ok) {
        run_done(r, GW_PROBE_STORE);
        return;
    }
    if (rows == 0) {
        run_done(r, GW_PROBE_BUSY);
        return;
    }
    r->send_until_ms = r->take_sent_ms + r->hold_ms - r->hold_ms / 4;
    if (!send_lookup(r)) {
        cm_log(CM_WARN, "probe_unresolved", "route=%s reason=not_sent", r->route_name);
        give_back(r, GW_PROBE_UNRESOLVED);
    }
}

/* SPEC 9: the sweeper has no request to take a scope's parts from: it probes a scoped route only when the
 * upstream's look-up by key alone is tenant-safe. */
static bool sweepable(const struct conf_route *route)
{
    return route->idem.scope_n == 0 || route->idem.probe.keys_unique_upstream;
}

/* sweep: started by the sweeper (counted in p->sweeping before anything can call back). */
static void run_start(struct gw_probe *p, size_t route_index, const struct store_id *id,
                      const struct cm_hdrs *scope_hdrs, bool sweep, bool dry, gw_probe_cb cb, void *arg)
{
    /* the configuration in force now (a reload may have added, changed or removed the route's probe: block); by
     * name, since a request's route_index is its metrics slot and after a reload its route is another struct */
    struct gw_conf *gc = p->ctx->cur;
    const struct conf *conf = gc ? gc->conf : NULL;
    const struct conf_route *route = NULL;
    for (size_t i = 0; conf && i < conf->routes_n && !route; i++)
        if (strcmp(conf->routes[i].name, id->route) == 0 && conf->routes[i].idem.on_unknown == CONF_UNKNOWN_PROBE)
            route = &conf->routes[i];
    (void)route_index;
    if (!route || (sweep && !sweepable(route))) { /* a reload since the sweeper listed it */
        cm_log(CM_WARN, "probe_unresolved", "route=%s reason=%s", id->route,
               route ? "scoped_route_not_swept" : "not_a_probe_route");
        if (cb)
            cb(arg, GW_PROBE_UNRESOLVED, NULL);
        return;
    }
    struct probe_run *r = cm_calloc(1, sizeof *r);
    r->p = p;
    r->cref = gw_conf_ref(gc); /* the run finishes under it, whatever a reload swaps in meanwhile */
    r->route = route;
    r->route_index = cm_metrics_route(id->route);
    r->route_name = cm_strdup(id->route);
    r->key = cm_strndup(id->key, id->key_len);
    r->key_len = id->key_len;
    memcpy(r->scope, id->scope, 32);
    r->token = cm_random_token();
    cm_hdrs_init(&r->scope_hdrs);
    for (size_t i = 0; scope_hdrs && i < scope_hdrs->n; i++)
        cm_hdrs_add(&r->scope_hdrs, scope_hdrs->v[i].name, scope_hdrs->v[i].value);
    r->cb = cb;
    r->arg = arg;
    r->sweep = sweep;
    r->dry = dry;
    if (sweep)
        p->sweeping++;
    cm_resp_init(&r->resp, 0);
    r->next = p->runs;
    if (p->runs)
        p->runs->prev = r;
    p->runs = r;
    const struct conf_upstream *u = &conf->upstreams[r->route->upstream];
    r->hold_ms = u->connect_timeout_ms + u->timeout_ms + HOLD_EXTRA_MS;
    r->take_sent_ms = cm_now_ms();
    if (dry) {
        r->send_until_ms = UINT64_MAX; /* nothing taken: no lease bounds the look-up */
        if (!send_lookup(r)) {
            if (r->cb)
                r->cb(r->arg, GW_PROBE_UNRESOLVED, NULL);
            r->cb = NULL;
            run_free(r);
        }
        return;
    }
    store_probe_take(p->ctx->store, id, r->token, r->hold_ms, probe_wait_ms(r), taken, r);
}

void gw_probe_run(struct gw_probe *p, size_t route_index, const struct store_id *id, const struct cm_hdrs *scope_hdrs,
                  gw_probe_cb cb, void *arg)
{
    run_start(p, route_index, id, scope_hdrs, false, false, cb, arg);
}

void gw_probe_ask(struct gw_probe *p, const struct store_id *id, gw_probe_cb cb, void *arg)
{
    run_start(p, 0, id, NULL, false, true, cb, arg);
}

/* ---- the sweeper: unknown outcomes no client retries */

static void sweep_schedule(struct gw_probe *p, uint64_t ms)
{
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    evtimer_add(p->sweep_timer, &tv);
}

static void listed(void *arg, bool ok, const struct store_unknown_rec *recs, size_t n)
{
    struct gw_probe *p = arg;
    p->listing = false;
    for (size_t i = 0; ok && i < n; i++)
        run_start(p, 0, &recs[i].id, NULL, true, false, NULL, NULL); /* a route no longer probing is skipped (logged) */
    sweep_schedule(p, SWEEP_EVERY_MS);
}

/* The names of the current configuration's probe routes the sweeper may probe joined by '\n' (heap), NULL when
 * it has none. */
static char *probe_routes(struct gw_probe *p)
{
    struct gw_conf *gc = p->ctx->cur;
    if (!gc)
        return NULL;
    const struct conf *conf = gc->conf;
    struct cm_buf names;
    cm_buf_init(&names, 64 * 1024);
    bool any = false;
    for (size_t i = 0; i < conf->routes_n; i++) {
        if (conf->routes[i].idem.on_unknown != CONF_UNKNOWN_PROBE || !sweepable(&conf->routes[i]))
            continue;
        if (!cm_buf_appendf(&names, "%s%s", any ? "\n" : "", conf->routes[i].name))
            abort();
        any = true;
    }
    char *v = any ? cm_strndup(names.data, names.len) : NULL;
    cm_buf_free(&names);
    return v;
}

static void sweep_tick(evutil_socket_t fd, short what, void *arg)
{
    struct gw_probe *p = arg;
    (void)fd;
    (void)what;
    /* one batch at a time: a sweep waits for the previous one's look-ups */
    if (p->listing || p->sweeping > 0 || !atomic_load(&p->ctx->schema_ready) || atomic_load(&p->ctx->closing)) {
        sweep_schedule(p, SWEEP_EVERY_MS);
        return;
    }
    char *routes = probe_routes(p); /* read at every sweep: a reload may add or remove probe routes */
    if (!routes) {
        sweep_schedule(p, SWEEP_EVERY_MS);
        return;
    }
    p->listing = true;
    store_probe_list(p->ctx->store, routes, SWEEP_BATCH, listed, p);
    free(routes);
}

struct gw_probe *gw_probe_create(struct gw_ctx *x)
{
    struct gw_probe *p = cm_calloc(1, sizeof *p);
    p->ctx = x;
    p->sweep_timer = evtimer_new(x->base, sweep_tick, p);
    if (!p->sweep_timer)
        abort();
    sweep_schedule(p, SWEEP_FIRST_MS);
    return p;
}

void gw_probe_destroy(struct gw_probe *p)
{
    if (!p)
        return;
    while (p->runs)
        run_free(p->runs);
    if (p->sweep_timer)
        event_free(p->sweep_timer);
    free(p);
}
