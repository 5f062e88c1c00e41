/* probe.h - on_unknown: probe: asking the route's upstream whether an unknown outcome executed (SPEC 9), for a
 * retry that met one after its lease and for the background sweeper. Loop thread only; it works with the thread's
 * context (gateway/ctx.h) and answers through its callback, never calling the pipeline or the loop. */
#ifndef IDEMGATE_GW_PROBE_H
#define IDEMGATE_GW_PROBE_H

#include <stddef.h>

#include "common/common.h"

struct gw_ctx;
struct gw_probe;
struct store_id;

/* Creates the prober of the thread whose context x is (it reads x at each use), and its sweeper timer when a route has
 * on_unknown: probe (the sweeper looks at unknown outcomes whose lease lapsed every few seconds, a bounded batch at a
 * time). Never NULL; the caller frees it with gw_probe_destroy after the loop's store and upstream client are gone
 * (their callbacks no longer come). */
struct gw_probe *gw_probe_create(struct gw_ctx *x);
/* Frees every look-up still running without calling back; NULL is a no-op. */
void gw_probe_destroy(struct gw_probe *p);

enum gw_probe_result {
    GW_PROBE_FOUND,      /* the upstream's answer is now the record's completed answer: resp holds it */
    GW_PROBE_ABSENT,     /* nothing executed: the record was released, a retry executes */
    GW_PROBE_UNRESOLVED, /* the look-up failed, timed out or answered another status: still unknown */
    GW_PROBE_BUSY,       /* not an unknown outcome past its lease any more (another prober holds it) */
    GW_PROBE_STORE,      /* Postgres failed before anything was asked */
};
const char *gw_probe_result_name(enum gw_probe_result r);

/* resp: the stored answer with GW_PROBE_FOUND (the callee may move its contents out), else empty; valid during the
 * call only. */
typedef void (*gw_probe_cb)(void *arg, enum gw_probe_result r, struct cm_resp *resp);

/* Looks the record up for the route at route_index (which must have on_unknown: probe): takes it over under a new
 * token (one prober at a time), sends probe.method probe.path with probe.headers and scope_hdrs only (the retry's
 * scope parts, gw_scope_probe_headers; a scope header replaces a probe header of its name) to the route's upstream
 * with its timeouts, then completes (without Set-Cookie or Set-Cookie2), releases or gives back the record, fenced
 * by that token. Calls cb exactly once (unless the loop is destroyed first); id and scope_hdrs are copied. */
void gw_probe_run(struct gw_probe *p, size_t route_index, const struct store_id *id, const struct cm_hdrs *scope_hdrs,
                  gw_probe_cb cb, void *arg);

/* The look-up alone (the reconcile command, SPEC 12): the same request as gw_probe_run's without the scope's parts,
 * but the record is neither taken nor settled and nothing is logged or counted as resolved: cb gets FOUND (resp:
 * the look-up's answer), ABSENT or UNRESOLVED, exactly once. */
void gw_probe_ask(struct gw_probe *p, const struct store_id *id, gw_probe_cb cb, void *arg);

#endif
