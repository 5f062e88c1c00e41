/* metrics.h - the process-wide Prometheus registry: lock-free counters,
 * gauges and histograms updated from any thread, rendered by the admin
 * listener. A route's counters are found by its slot (cm_metrics_route), which its name keeps across reloads. Never
 * calls another room. */
#ifndef IDEMGATE_METRICS_H
#define IDEMGATE_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

/* Route index for requests no route matched: default_upstream (label
 * route="_default") or nothing (route="_none"). */
#define CM_ROUTE_DEFAULT ((size_t)-1)
#define CM_ROUTE_NONE    ((size_t)-2)

/* outcome label of idemgate_requests_total (SPEC 11, exactly these; the access line's outcome and the span's
 * idemgate.outcome print the same names). The last four before passthrough are the server-side ones: the only
 * errors (cm_outcome_is_error). */
enum cm_outcome {
    CM_OUT_FORWARDED,         /* a keyed request executed: the upstream's answer (a release status's too) */
    CM_OUT_REPLAYED,          /* a stored answer replayed */
    CM_OUT_MISMATCH,          /* 422 idempotency-key-mismatch */
    CM_OUT_IN_FLIGHT,         /* 409 idempotency-key-in-use, sequence-in-use */
    CM_OUT_REJECTED,          /* the client's mistake, nothing forwarded: 400 (key, sequence, request), 401 (token,
                               * signature), 404 no route, 409 stale-sequence / sequence-gap, 413, 414, 431, 501 */
    CM_OUT_UNKNOWN,           /* sent without a valid answer, the record kept as an unknown outcome (502/504); or a
                               * retry that met one (409 idempotency-outcome-unknown) */
    CM_OUT_STORE_UNAVAILABLE, /* 503 store-unavailable: nothing forwarded */
    CM_OUT_UPSTREAM_ERROR,    /* 502/504 that leaves no unknown record: nothing was sent (key released), or a
                               * passthrough request got no valid answer */
    CM_OUT_OVERLOADED,        /* 503 overloaded, too-many-connections, shutting-down (nothing forwarded) */
    CM_OUT_PASSTHROUGH,       /* answered by the upstream without a key: key: off, no key on key: optional, a method
                               * outside the route's, default_upstream */
    CM_OUT__COUNT
};
/* Its label; a value outside the enum (a bug) is "upstream_error", and cm_metric_request counts it as such. */
const char *cm_outcome_name(enum cm_outcome o);
/* SPEC 11: the status page and the dashboard call only the server-side outcomes errors (unknown, store_unavailable,
 * upstream_error, overloaded); a client's mistake is rejected, never an error. */
bool cm_outcome_is_error(enum cm_outcome o);

enum cm_store_label { CM_STORE_POSTGRES, CM_STORE_REDIS, CM_STORE__COUNT };

/* Sets up the registry for these route names (copied). Call once at start,
 * before any other thread runs; cm_metrics_reset frees it (tests). */
void cm_metrics_init(size_t nroutes, const char *const *route_names);
void cm_metrics_reset(void);
/* The slot of route name name for the cm_metric_* calls: the one it got before (at init or an earlier call), else a
 * new one with zeroed counters. Slots and their names are never freed before cm_metrics_reset, so a thread may
 * count under a slot from an older configuration. Safe from any thread. Returns CM_ROUTE_NONE when the registry
 * is full (16384 names; the counts then go to "_none"). */
size_t cm_metrics_route(const char *name);
/* The number of route slots so far (start and every reload since), and the name of slot i < that number (static:
 * slots are never freed before cm_metrics_reset). Safe from any thread. */
size_t cm_metrics_routes_n(void);
const char *cm_metrics_route_name(size_t i);

void cm_metric_request(size_t route, enum cm_outcome o);
void cm_metric_dedup_hit(size_t route);
void cm_metric_parameter_conflict(size_t route);
void cm_metric_in_flight_conflict(size_t route);
void cm_metric_completion_failure(size_t route);
void cm_metric_stale_rejection(size_t route);                  /* idemgate_stale_version_rejections_total */
void cm_metric_sequence_gap(size_t route);                     /* idemgate_sequence_gaps_total */
void cm_metric_signature_failure(size_t route);                /* idemgate_signature_failures_total */
void cm_metric_stuck_processing_set(size_t route, uint64_t n); /* gauge */
/* One upstream request of route to the upstream named upstream (NULL: "_none"): its duration in seconds, and its
 * answer's status (0 or outside 200-599: no answer, class "none"): idemgate_upstream_seconds{route,upstream},
 * idemgate_upstream_responses_total{route,upstream,class}. Lock-free (an upstream name seen for the first time
 * takes the registry's lock once). */
void cm_metric_upstream(size_t route, const char *upstream, int status, double s);
void cm_metric_store_seconds(enum cm_store_label st, double s);
void cm_metric_store_error(enum cm_store_label st);
void cm_metric_postgres_up(bool up);
void cm_metric_redis_up(bool up);
void cm_metric_connections(int64_t delta); /* idemgate_connections gauge */
/* idemgate_claims_in_doubt gauge: claims whose commit outcome is not known yet, waiting to be released. */
void cm_metric_claims_in_doubt(int64_t delta);
/* The replay cache (gateway/cache.c): idemgate_replay_cache_entries and _bytes gauges (set to the current values),
 * idemgate_replay_cache_hits_total / _misses_total, and idemgate_replay_cache_online (its purge listener is
 * connected, so the cache is in use). */
void cm_metric_replay_cache_set(int64_t entries, int64_t bytes);
void cm_metric_replay_cache_lookup(bool hit);
void cm_metric_replay_cache_online(bool online);
/* idemgate_shed_total{reason}: requests answered 503 overloaded before anything was claimed or forwarded. */
enum cm_shed_reason { CM_SHED_BUFFERS, CM_SHED__COUNT };
void cm_metric_shed(enum cm_shed_reason r);
/* idemgate_trace_spans_dropped_total: spans not exported (the queue was full, or the collector failed). */
void cm_metric_trace_dropped(uint64_t n);

/* ---- unknown outcomes resolved by probing (SPEC 9) and shadow mode (SPEC 10) */

/* how label of idemgate_unknown_resolved_total. */
enum cm_resolved { CM_RESOLVED_FOUND, CM_RESOLVED_ABSENT, CM_RESOLVED__COUNT };
void cm_metric_unknown_resolved(size_t route, enum cm_resolved how);

/* decision label of idemgate_shadow_decisions_total: what enforce mode would have done. */
enum cm_shadow {
    CM_SHADOW_REPLAY,
    CM_SHADOW_MISMATCH,
    CM_SHADOW_IN_FLIGHT,
    CM_SHADOW_STALE,
    CM_SHADOW_NEW,
    CM_SHADOW__COUNT
};
const char *cm_shadow_name(enum cm_shadow d);
void cm_metric_shadow_decision(size_t route, enum cm_shadow d);
/* idemgate_shadow_store_errors_total{route}: shadow records the store could not read or write (the request was
 * forwarded anyway). */
void cm_metric_shadow_store_error(size_t route);

/* Tests: the clock (seconds) the status page's five-minute window is measured with; NULL: the monotonic clock. */
void cm_metrics_set_clock(uint64_t (*now_s)(void));

/* Appends the whole registry in Prometheus text format (0.0.4) to out.
 * Returns false when out's cap was exceeded. */
bool cm_metrics_render(struct cm_buf *out) CM_MUST_CHECK;

/* Appends the status page's JSON to out (SPEC 10: per route requests by outcome, replays, conflicts, stuck records;
 * upstream latency p50/p99 estimated from the histogram of the last five minutes (the current minute and the five
 * before it), window_seconds 300; the store states as given): counts only, never keys, scopes or bodies. Returns
 * false when out's cap was exceeded. */
bool cm_metrics_status_json(struct cm_buf *out, const char *postgres_state, const char *redis_state) CM_MUST_CHECK;

#endif
