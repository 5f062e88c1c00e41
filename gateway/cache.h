/* cache.h - the in-process replay cache: completed records (immutable until retention or purge) kept in memory,
 * bounded in entries and bytes, shared by the loops of a process (a rwlock), usable only while the purge listener
 * (store/notify.c) is connected. It never asks the loop or the store: the pipeline passes the job, whose context
 * holds the cache. */
#ifndef IDEMGATE_GW_CACHE_H
#define IDEMGATE_GW_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

struct gw_cache;

/* Creates an empty cache holding at most max_entries entries and max_bytes bytes (entry, names, headers and body
 * counted). It starts offline (unused until gw_cache_set_online(c, true, ...)). Returns NULL when either bound is 0
 * (the cache is off); every function below accepts NULL as "off". */
struct gw_cache *gw_cache_create(uint64_t max_bytes, uint32_t max_entries);
/* Frees every entry and the cache. NULL is a no-op. */
void gw_cache_destroy(struct gw_cache *c);

/* The purge listener's state. Offline, the cache answers nothing and takes no fill. Going offline with keep false
 * (the listener lost its connection, or is not connected yet) empties it: a notification may have been missed
 * meanwhile; with keep true (the listener is late: notifications are delayed, none is lost, and they still drop
 * entries) the entries stay for when it is online again. Either way the epoch moves on, so that a fill begun
 * before the change is refused. Any thread. */
void gw_cache_set_online(struct gw_cache *c, bool online, bool keep);
/* The epoch to hand to gw_cache_put: take it before the completion is sent. */
uint64_t gw_cache_epoch(struct gw_cache *c);

enum gw_cache_verdict {
    GW_CACHE_MISS,     /* no usable entry (or the cache is off or offline): ask the store */
    GW_CACHE_REPLAY,   /* same fingerprint: *out holds a copy of the stored answer (caller frees it) */
    GW_CACHE_MISMATCH, /* another fingerprint: 422 */
    GW_CACHE_QUEUED,   /* gw_cache_queue only: the stored answer was queued on the connection */
};
/* Looks (route, scope, key) up at now_ms (cm_now_ms). On GW_CACHE_REPLAY *out is initialised with a deep copy
 * owned by the caller; otherwise *out is untouched. Counts a hit or a miss. Any thread. */
enum gw_cache_verdict gw_cache_get(struct gw_cache *c, const char *route, const uint8_t scope[32], const char *key,
                                   size_t key_len, const uint8_t fp[32], uint64_t now_ms, struct cm_resp *out);
/* The same look-up for job, a request the front can answer at once (not HEAD, not shutting down): a replay is
 * queued on conn from the entry's prepared answer (decoded once; each connection gets a response of its own over
 * the entry's body, nothing copied, with Idempotent-Replayed: true and the job's request id), *queued_ok is
 * MHD_queue_response's success, and the job's status, replayed, bytes_out and orig_request_id are set as a replay
 * sets them. An answer that carries Connection: close (status 400, 413, 431) is not shared: GW_CACHE_REPLAY with a
 * copy in *out, as gw_cache_get (which is this look-up with conn and job NULL). */
struct MHD_Connection;
struct gw_job;
enum gw_cache_verdict gw_cache_queue(struct gw_cache *c, const char *route, const uint8_t scope[32], const char *key,
                                     size_t key_len, const uint8_t fp[32], uint64_t now_ms, struct MHD_Connection *conn,
                                     struct gw_job *job, bool *queued_ok, struct cm_resp *out);
/* Stores a copy of a committed completed record's answer, replayable until expires_ms (cm_now_ms clock; never
 * later than the record's own expiry). Refused (false, nothing stored) when the cache is off or offline, when the
 * epoch moved since epoch was taken (a purge notification, a local purge or a listener change came in between),
 * or when the entry alone is over an eighth of max_bytes. Evicts (CLOCK, expired entries first) to stay within the
 * bounds. The caller keeps resp. */
bool gw_cache_put(struct gw_cache *c, const char *route, const uint8_t scope[32], const char *key, size_t key_len,
                  const uint8_t fp[32], const struct cm_resp *resp, uint64_t expires_ms, uint64_t epoch);
/* The same for an answer that was just replayed (read from the authority): the entry starts hot (below). */
bool gw_cache_put_replayed(struct gw_cache *c, const char *route, const uint8_t scope[32], const char *key,
                           size_t key_len, const uint8_t fp[32], const struct cm_resp *resp, uint64_t expires_ms,
                           uint64_t epoch);
/* Drops every entry of (route, key), all scopes (an admin purge or release), and moves the epoch on. */
void gw_cache_drop(struct gw_cache *c, const char *route, const char *key, size_t key_len);
/* A notification from the purge channel: payload "ROUTE\nKEY" drops that record's entries; anything else (an
 * unknown form) empties the cache. */
void gw_cache_notified(struct gw_cache *c, const char *payload, size_t len);
/* How long after a purge or release (local or notified) an answer Redis replayed is not cached: the purge deletes
 * the Redis copy only after its commit, so for a moment Redis still holds what Postgres no longer does. */
#define GW_CACHE_PURGE_GRACE_MS 2000
/* False within GW_CACHE_PURGE_GRACE_MS of the last purge or release heard of (or when c is NULL). */
bool gw_cache_redis_fill_ok(struct gw_cache *c, uint64_t now_ms);
/* Current entries and bytes (for tests; the metrics carry the same). */
void gw_cache_usage(struct gw_cache *c, size_t *entries, size_t *bytes);

/* ---- the pipeline's call sites (loop thread): the cache is the job's context's (job->ctx->cache) */
struct gw_job;
struct store_claim_res;
/* Before the store's claim: looks the job's record up (not for shadow routes). GW_CACHE_REPLAY / _MISMATCH: *res is
 * filled as the store would fill it (STORE_REPLAY with resp owned by res, or STORE_MISMATCH); the caller answers
 * from it and frees res->resp with cm_resp_free. GW_CACHE_MISS: ask the store (res untouched). With conn (the
 * front, a request it can answer at once) the look-up is gw_cache_queue's: GW_CACHE_QUEUED means the prepared
 * answer was queued on conn (*queued_ok as there) and res is untouched. */
enum gw_cache_verdict gw_cache_claim(struct gw_job *job, struct MHD_Connection *conn, bool *queued_ok,
                                     struct store_claim_res *res);
/* Just before store_complete and store_claim: the epoch a fill will be checked against (the caller keeps it). */
uint64_t gw_cache_before_store(struct gw_job *job);
/* A claim answered STORE_REPLAY (from Postgres, or from Redis with the expiry written beside the answer): keeps a
 * copy of res->resp until started_ms (when the pipeline took the job) + res->expires_in_ms, never later than the
 * record's expiry (what was left was computed at the read, which came after the request started). Nothing when the
 * expiry is not known (0). Call before res->resp is moved out. */
void gw_cache_replayed(struct gw_job *job, const struct store_claim_res *res, uint64_t started_ms, uint64_t epoch);
/* After the completion committed (ok with one row): keeps resp (copied) until started_ms + retention, which is
 * never later than the record's own expiry. epoch: what gw_cache_before_store gave before the completion. */
void gw_cache_completed(struct gw_job *job, const struct cm_resp *resp, uint64_t started_ms, uint64_t epoch);

#endif
