/* reload.h - SIGHUP: load and validate the new configuration completely, refuse what needs a restart, then swap
 * it into every I/O loop at a safe point on its own thread (all or nothing). */
#ifndef IDEMGATE_RELOAD_H
#define IDEMGATE_RELOAD_H

#include "gateway/gateway.h"

/* Main thread. Loads file; when it is valid, needs no restart and its JWT keys load, every loop of ls gets it (the
 * requests already accepted finish under the configuration they started with) and the new handle is returned
 * with one reference for the caller, who then drops its reference to cur. Otherwise nothing changes, the reason is
 * logged (event=reload_failed with FILE:LINE: KEY, or event=reload_refused key=...) and NULL is returned. */
struct gw_conf *gw_reload(const char *file, struct gw_conf *cur, struct gw_loops *ls);

/* Logs route_without_scope for every idempotent route without a scope (SPEC 9), at start and at each reload. */
void gw_warn_unscoped(const struct conf *conf);

#endif
