/* reload.h - SIGHUP: load and validate the new configuration completely, refuse what needs a restart, then swap
 * it into every I/O loop at a safe point on its own thread (all or nothing). The swap is the caller's function
 * (gateway/main.c passes gw_loops_swap): the reload never reaches into the loops. */
#ifndef IDEMGATE_RELOAD_H
#define IDEMGATE_RELOAD_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "conf/conf.h"

struct gw_jwt;
struct gw_verify;
struct gw_tls_creds;

/* ---- the configuration in force: immutable and reference-counted. Each loop holds the one it serves new requests
 * with; each request takes a reference when the front accepts its head and drops it when the request is freed, so
 * a request finishes under the configuration it started with and the old one goes with its last request. */
struct gw_conf {
    struct conf *conf;         /* owned */
    struct gw_jwt *jwt;        /* the verifier of jwt:CLAIM scopes, NULL without a jwt: block; owned */
    struct gw_verify **verify; /* per route (conf->routes_n): its signature verifier, NULL without verify:; owned */
    size_t *route_slot;        /* metrics slot of each route (cm_metrics_route of its name), conf->routes_n entries */
    struct gw_tls_creds *listen_tls; /* listen.tls's certificate and key, read at load; NULL: plain; owned */
    struct gw_tls_creds *admin_tls;  /* admin.listen.tls's, the same */
    atomic_long refs;
};
/* Loads and validates file completely (conf_load, then its JWT keys and its routes' signing secrets and its listeners'
 * certificates). Returns the handle with one reference, or NULL + *err "FILE:LINE: KEY: ..." or the key loader's
 * message (heap, caller frees). */
struct gw_conf *gw_conf_load(const char *file, char **err);
/* Gives each route its metrics slot (by name; cm_metrics_route). Call once the configuration is going to serve,
 * before any loop has it. */
void gw_conf_label(struct gw_conf *c);
/* Another reference to c (any thread); returns c. */
struct gw_conf *gw_conf_ref(struct gw_conf *c);
/* Drops a reference (any thread); the last one frees the handle and its conf. NULL is a no-op. */
void gw_conf_unref(struct gw_conf *c);

/* Puts c in force in every I/O loop (gw_loops_swap, passed by gateway/main.c: the reload never reaches up into the
 * loops itself), waiting up to timeout_ms; false when one has not taken it yet (it still will). */
typedef bool (*gw_conf_swap_fn)(void *arg, struct gw_conf *c, uint64_t timeout_ms);
/* Main thread. Loads file; when it is valid, needs no restart and its JWT keys load, swap(swap_arg, ...) gives it
 * to every loop (the requests already accepted finish under the configuration they started with) and the new
 * handle is returned with one reference for the caller, who then drops its reference to cur. Otherwise nothing
 * changes, the reason is logged (event=reload_failed with FILE:LINE: KEY, or event=reload_refused key=...) and
 * NULL is returned. */
struct gw_conf *gw_reload(const char *file, struct gw_conf *cur, gw_conf_swap_fn swap, void *swap_arg);

/* Logs route_without_scope for every idempotent or ordering route without a scope (SPEC 7, 9), at start and at each
 * reload. */
void gw_warn_unscoped(const struct conf *conf);

#endif
