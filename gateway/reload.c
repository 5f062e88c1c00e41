/* reload.c - the configuration handle (immutable, reference-counted) and the SIGHUP reload that swaps it. It never
 * reaches into the loops: the caller's swap function does. */
#include "gateway/reload.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/metrics.h"
#include "conf/identity.h"
#include "gateway/jwt.h"
#include "gateway/verify.h"
#include "gateway/tls.h"

#define SWAP_TIMEOUT_MS 10000
#define NAMES_MAX       1024 /* the names listed in event=reloaded */

struct gw_conf *gw_conf_load(const char *file, char **err)
{
    struct conf *conf = conf_load(file, err);
    if (!conf)
        return NULL;
    struct gw_conf *c = cm_calloc(1, sizeof *c);
    c->conf = conf;
    atomic_store(&c->refs, 1);
    if (conf->jwt.enabled && !(c->jwt = gw_jwt_create(&conf->jwt, err)))
        goto fail;
    c->verify = cm_calloc(conf->routes_n + 1, sizeof *c->verify);
    for (size_t i = 0; i < conf->routes_n; i++) {
        char what[64];
        snprintf(what, sizeof what, "routes[%zu].verify.secrets_env", i);
        if (conf->routes[i].verify.enabled && !(c->verify[i] = gw_verify_create(&conf->routes[i].verify, what, err)))
            goto fail;
    }
    if (!gw_tls_upstream_files(conf, err))
        goto fail;
    if (conf->listen.tls.cert && !(c->listen_tls = gw_tls_creds_load(conf->file, &conf->listen.tls, "listen", err)))
        goto fail;
    if (conf->admin_enabled && conf->admin_listen.tls.cert &&
        !(c->admin_tls = gw_tls_creds_load(conf->file, &conf->admin_listen.tls, "admin.listen", err)))
        goto fail;
    return c;
fail:
    gw_conf_unref(c);
    return NULL;
}

void gw_conf_label(struct gw_conf *c)
{
    if (c->route_slot)
        return;
    c->route_slot = cm_calloc(c->conf->routes_n + 1, sizeof *c->route_slot);
    for (size_t i = 0; i < c->conf->routes_n; i++)
        c->route_slot[i] = cm_metrics_route(c->conf->routes[i].name);
}

struct gw_conf *gw_conf_ref(struct gw_conf *c)
{
    atomic_fetch_add(&c->refs, 1);
    return c;
}

void gw_conf_unref(struct gw_conf *c)
{
    if (!c || atomic_fetch_sub(&c->refs, 1) != 1)
        return;
    gw_jwt_destroy(c->jwt);
    for (size_t i = 0; c->verify && i < c->conf->routes_n; i++)
        gw_verify_destroy(c->verify[i]);
    free(c->verify);
    gw_tls_creds_unref(c->listen_tls);
    gw_tls_creds_unref(c->admin_tls);
    free(c->route_slot);
    conf_destroy(c->conf);
    free(c);
}

void gw_warn_unscoped(const struct conf *conf)
{
    for (size_t i = 0; i < conf->routes_n; i++) {
        const struct conf_route *r = &conf->routes[i];
        if (r->idem.scope_n > 0)
            continue;
        if (r->idem.key != CONF_KEY_OFF)
            cm_log(CM_WARN, "route_without_scope",
                   "route=%s msg=\"idempotent route without a scope: all its clients share one key space (set "
                   "idempotency.scope, e.g. [jwt:sub] or [header:Authorization])\"",
                   r->name);
        else if (r->ordering.enabled) /* SPEC 7 */
            cm_log(CM_WARN, "route_without_scope",
                   "route=%s msg=\"ordering route without a scope: all its clients share one sequence per resource "
                   "(set idempotency.scope, e.g. [jwt:sub] or [header:Authorization])\"",
                   r->name);
    }
}

static const struct conf_route *route_named(const struct conf *c, const char *name)
{
    for (size_t i = 0; i < c->routes_n; i++)
        if (strcmp(c->routes[i].name, name) == 0)
            return &c->routes[i];
    return NULL;
}

static const struct conf_upstream *upstream_named(const struct conf *c, const char *name)
{
    for (size_t i = 0; i < c->upstreams_n; i++)
        if (strcmp(c->upstreams[i].name, name) == 0)
            return &c->upstreams[i];
    return NULL;
}

/* Appends name to a comma-separated list (silently stops at the buffer's cap: the list is for the log only). */
static void list_add(struct cm_buf *b, const char *name)
{
    if (!cm_buf_appendf(b, "%s%s", b->len ? "," : "", name))
        return;
}

/* Names in a's routes/upstreams missing from b's. */
static void routes_missing(const struct conf *a, const struct conf *b, struct cm_buf *out)
{
    for (size_t i = 0; i < a->routes_n; i++)
        if (!route_named(b, a->routes[i].name))
            list_add(out, a->routes[i].name);
}

static void upstreams_missing(const struct conf *a, const struct conf *b, struct cm_buf *out)
{
    for (size_t i = 0; i < a->upstreams_n; i++)
        if (!upstream_named(b, a->upstreams[i].name))
            list_add(out, a->upstreams[i].name);
}

/* Logs event=reloaded with what changed: routes and upstreams added or removed (by name), upstreams whose URL
 * changed, routes that now go to another upstream. */
static void log_reloaded(const char *file, const struct conf *old, const struct conf *neu)
{
    struct cm_buf radd, rdel, uadd, udel, umoved, rmoved;
    struct cm_buf *all[] = {&radd, &rdel, &uadd, &udel, &umoved, &rmoved};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        cm_buf_init(all[i], NAMES_MAX);
    routes_missing(neu, old, &radd);
    routes_missing(old, neu, &rdel);
    upstreams_missing(neu, old, &uadd);
    upstreams_missing(old, neu, &udel);
    for (size_t i = 0; i < neu->upstreams_n; i++) {
        const struct conf_upstream *o = upstream_named(old, neu->upstreams[i].name);
        if (o && strcmp(o->url, neu->upstreams[i].url) != 0)
            list_add(&umoved, neu->upstreams[i].name);
    }
    for (size_t i = 0; i < neu->routes_n; i++) {
        const struct conf_route *o = route_named(old, neu->routes[i].name);
        if (o && strcmp(old->upstreams[o->upstream].name, neu->upstreams[neu->routes[i].upstream].name) != 0)
            list_add(&rmoved, neu->routes[i].name);
    }
    char q[6][NAMES_MAX + 8], fq[1024];
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        cm_log_quote(q[i], sizeof q[i], all[i]->len ? all[i]->data : "");
    cm_log(CM_INFO, "reloaded",
           "file=%s routes=%zu upstreams=%zu routes_added=%s routes_removed=%s upstreams_added=%s "
           "upstreams_removed=%s upstreams_changed_url=%s routes_changed_upstream=%s",
           cm_log_quote(fq, sizeof fq, file), neu->routes_n, neu->upstreams_n, q[0], q[1], q[2], q[3], q[4], q[5]);
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        cm_buf_free(all[i]);
}

/* Routes of both configurations whose identity (key source, scope, fingerprint: conf/identity.h) the new one
 * changes: each logged as reload_refused. Returns how many. A record's key is found again only under the identity
 * it was made with: a changed scope would execute a completed key's retry again (or run it beside the one in
 * flight), a changed fingerprint would answer a byte-identical retry 422. */
static size_t identity_changes(const char *file, const struct conf *old, const struct conf *neu)
{
    size_t n = 0;
    for (size_t i = 0; i < neu->routes_n; i++) {
        const struct conf_route *o = route_named(old, neu->routes[i].name);
        char *was = o ? conf_route_identity(o) : NULL, *now = conf_route_identity(&neu->routes[i]);
        if (was && now && strcmp(was, now) != 0) {
            char what[64], fq[1024];
            conf_identity_diff(was, now, what, sizeof what);
            cm_log(CM_WARN, "reload_refused",
                   "route=%s changed=%s msg=\"a route's identity (key source, scope, fingerprint) cannot change under "
                   "its records: use a new route name, or restart\" file=%s",
                   neu->routes[i].name, what, cm_log_quote(fq, sizeof fq, file));
            n++;
        }
        free(was);
        free(now);
    }
    return n;
}

static void log_failed(const char *file, char *err)
{
    char fq[1024], q[2048];
    cm_log(CM_ERROR, "reload_failed", "file=%s error=%s", cm_log_quote(fq, sizeof fq, file),
           cm_log_quote(q, sizeof q, err ? err : "?"));
    free(err);
}

struct gw_conf *gw_reload(const char *file, struct gw_conf *cur, gw_conf_swap_fn swap, void *swap_arg)
{
    char *err = NULL;
    struct gw_conf *c = gw_conf_load(file, &err);
    if (!c) {
        log_failed(file, err);
        return NULL;
    }
    const char *keys[16];
    size_t nk = conf_restart_keys(cur->conf, c->conf, keys, sizeof keys / sizeof keys[0]);
    if (nk > 0) { /* all or nothing: the rest of the file is not applied either */
        char fq[1024];
        for (size_t i = 0; i < nk && i < sizeof keys / sizeof keys[0]; i++)
            cm_log(CM_WARN, "reload_refused", "key=%s msg=\"needs a restart\" file=%s", keys[i],
                   cm_log_quote(fq, sizeof fq, file));
        gw_conf_unref(c);
        return NULL;
    }
    if (identity_changes(file, cur->conf, c->conf) > 0) { /* all or nothing, as above */
        gw_conf_unref(c);
        return NULL;
    }
    gw_conf_label(c); /* only now: a refused file adds no route label */
    gw_warn_unscoped(c->conf);
    if (!swap(swap_arg, c, SWAP_TIMEOUT_MS))
        cm_log(CM_WARN, "reload_slow", "msg=\"an I/O loop has not taken the new configuration yet; it will\"");
    log_reloaded(file, cur->conf, c->conf);
    return c;
}
