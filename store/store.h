/* store.h - the idempotency authority (Postgres: atomic claim under a unique
 * constraint, fenced by a random token) and its fast filter (Redis: SET NX
 * in-flight marker and completed-response cache). Every call except
 * store_migrate and the *_up readers happens on the I/O thread. Redis may be
 * empty, stale or down: that costs latency, never a second execution. Never the blocking start-up work (migrate.h). */
#ifndef IDEMGATE_STORE_H
#define IDEMGATE_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/common.h"
#include "conf/conf.h"
#include "store/migrate.h" /* store_migrate, store_identity_check */

struct event_base;
struct conf;
struct store;
struct store_order;

/* Creates the store on base: a pool of conf->pool non-blocking Postgres
 * connections (connected lazily, reconnected with backoff), the Redis
 * context when conf->redis_url is set, and a background task that deletes
 * expired records in bounded batches and updates idemgate_stuck_processing.
 * conf must outlive the store. Returns NULL with *err on failure. */
struct store *store_create(struct event_base *base, const struct conf *conf, char **err);
/* Closes everything; pending operations are dropped without callbacks. */
void store_destroy(struct store *s);
/* This store's ordering guard state (store/order.h; never NULL once created). */
struct store_order *store_order_of(struct store *s);

/* ---- the purge epoch: when a Redis answer may be trusted (SPEC 8, "Redis never overrides Postgres")
 *
 * Postgres keeps one counter (idemgate_epoch) that every admin purge and release moves on after it committed, and
 * notifies (STORE_NOTIFY_EPOCH_CHANNEL). A completed answer put into Redis carries the epoch its gateway knew
 * when it sent the claim that read it; a Redis answer is used only while this process knows the epoch for sure
 * (its listener is connected and on time) and the answer's epoch is not older than it. So an answer read before a
 * purge is never used once the purge was heard of, whether Redis missed the purge's DEL (it was unreachable) or
 * was restored from an older snapshot. One per process, shared by its loops; every function is thread-safe. */
struct store_epoch;
/* Creates one (unknown: epoch 0, not current). Aborts on out-of-memory. */
struct store_epoch *store_epoch_create(void);
/* NULL is a no-op. */
void store_epoch_destroy(struct store_epoch *e);
/* An epoch Postgres committed was heard of (a notification, the listener's read at LISTEN, a local purge): the
 * known epoch becomes the larger of the two. */
void store_epoch_heard(struct store_epoch *e, uint64_t epoch);
/* current: every purge committed until now has been heard of (the listener is connected and its pings come back
 * in time); false when it is not (connecting, late, lost). */
void store_epoch_set_current(struct store_epoch *e, bool current);
/* Gives the store the process's epoch (NULL: none, then no Redis answer is ever used). Call before the loop runs. */
void store_set_epoch(struct store *s, struct store_epoch *e);

/* Postgres's wall clock (ms since the epoch) as this process reads it: the monotonic clock plus the offset of the
 * latest reading (every 10 s, SELECT clock_timestamp(), off by at most half its round trip); the local wall clock
 * before the first reading. Expiries that travel between gateways (a Redis entry's) are written and read on it, so
 * that gateways whose clocks disagree agree on them (SPEC 8, one clock). Any thread. */
uint64_t store_clock_ms(void);

/* Thread-safe readers for /readyz and metrics. store_postgres_healthy: this
 * store's pool heard from Postgres within the last second (a health probe
 * pings it every 300 ms when nothing else did) and found no fault since. */
bool store_postgres_up(const struct store *s);
bool store_postgres_healthy(const struct store *s);
bool store_redis_up(const struct store *s); /* false when Redis is not configured */
bool store_redis_enabled(const struct store *s);

/* Identity of a record: route name, SHA-256 of the scope parts, the key
 * (already unquoted and validated: 1..255 visible ASCII bytes). */
struct store_id {
    const char *route;
    uint8_t scope[32];
    const char *key;
    size_t key_len;
};

/* A record's identity from its parts: route and key are borrowed (they must outlive the id), the scope copied. */
static inline struct store_id store_id_of(const char *route, const uint8_t scope[32], const char *key, size_t key_len)
{
    struct store_id id;
    id.route = route;
    memcpy(id.scope, scope, sizeof id.scope);
    id.key = key;
    id.key_len = key_len;
    return id;
}

struct store_claim_req {
    struct store_id id;
    size_t route_index; /* for metrics */
    uint8_t fp[32];     /* request fingerprint */
    uint64_t lease_ms;
    uint64_t retention_ms;
    bool takeover_unknown;  /* on_unknown: retry (take over a lapsed lease, same fingerprint) */
    const char *request_id; /* the request's id (SPEC 11), kept in the record it claims; NULL: none */
};

enum store_verdict {
    STORE_NEW,         /* claimed: this request owns the key under token */
    STORE_REPLAY,      /* completed with the same fingerprint: resp holds the stored answer */
    STORE_MISMATCH,    /* a record with another fingerprint exists: 422 */
    STORE_IN_FLIGHT,   /* in flight, or unknown outcome within its lease: 409 / wait */
    STORE_UNKNOWN,     /* unknown outcome after the lease, on_unknown reject: 409 */
    STORE_UNAVAILABLE, /* Postgres unreachable or failing: 503, nothing forwarded */
};
const char *store_verdict_name(enum store_verdict v);

struct store_claim_res {
    enum store_verdict verdict;
    uint64_t token;              /* STORE_NEW: the fencing token */
    uint64_t fence;              /* STORE_NEW: the claim's time in Postgres (us since 2000): higher for every later
                                  * claim of the key, as a lease lapses only after its claim (forward_token) */
    uint64_t lease_remaining_ms; /* STORE_IN_FLIGHT: time left on the lease */
    uint64_t age_ms;             /* STORE_IN_FLIGHT, STORE_UNKNOWN: the time since the record was claimed, on
                                  * Postgres's clock (now() - created_at), for Retry-After (SPEC 11) */
    struct cm_resp resp;         /* STORE_REPLAY: the stored answer (callee may move it out) */
    bool from_redis;             /* answered by the Redis filter without Postgres */
    uint64_t expires_in_ms;      /* STORE_REPLAY: ms left before the record expires, as Postgres computed it when
                                  * it read the record, or (Redis) from the expiry stored beside the answer less a
                                  * 1 s margin for clock differences; 0: not known (an older Redis value) */
    const char *err;             /* STORE_UNAVAILABLE: constant text for logs */
    /* Postgres's answer: the id of the request that claimed the record ("" when not known: Redis, an older record) */
    char request_id[CM_REQUEST_ID_MAX + 1];
};
/* res is valid only during the callback; the store frees what is left. */
typedef void (*store_claim_cb)(void *arg, struct store_claim_res *res);

/* Looks the key up (Redis' SET NX GET, when enabled, at the same time as the
 * Postgres claim: one INSERT .. ON CONFLICT statement; a completed answer in
 * Redis answers without waiting for Postgres, a key Postgres gave answers
 * without waiting for Redis) and calls cb exactly once. A claim whose
 * commit outcome is not known (its statement timed out or its connection
 * broke: STORE_UNAVAILABLE) is remembered and released, fenced by its
 * token, as soon as no server process can commit it any more. */
void store_claim(struct store *s, const struct store_claim_req *req, store_claim_cb cb, void *arg);

/* Owner operations, fenced by token: they change the record only while it
 * still belongs to this claim. ok=false: Postgres failed; rows=0 with ok:
 * the claim is no longer ours (fenced out). */
typedef void (*store_done_cb)(void *arg, bool ok, long rows);

/* Shutting down past the grace: every settle operation (complete, release, mark unknown) waiting to be tried
 * again ends now as failed (its callback runs with ok = false), and one whose statement fails from now on is not
 * tried again. The record stays as it is (in flight: unknown after its lease, never released). */
void store_settle_stop(struct store *s);

/* Writes the completed answer (state completed, expires after retention)
 * and then the Redis cache. Retries transport failures with backoff for up
 * to retry_for_ms before reporting ok=false. */
void store_complete(struct store *s, const struct store_id *id, uint64_t token, const struct cm_resp *resp,
                    uint64_t retention_ms, uint64_t retry_for_ms, store_done_cb cb, void *arg);
/* Extends the lease to now + lease_ms (state in flight only). */
void store_renew(struct store *s, const struct store_id *id, uint64_t token, uint64_t lease_ms, store_done_cb cb,
                 void *arg);
/* Deletes the record (nothing was executed, or a release status): the next
 * request with the key executes. Also drops the Redis marker. Retries as
 * store_complete for up to retry_for_ms; when it still fails (ok=false) the
 * release is not lost: it joins the claims in doubt and is written as soon
 * as Postgres answers again (idemgate_claims_in_doubt). */
void store_release(struct store *s, const struct store_id *id, uint64_t token, uint64_t retry_for_ms, store_done_cb cb,
                   void *arg);
/* Marks an unknown outcome (timeout or no response after sending): state
 * unknown, lease_until = now + lease_ms (on Postgres's clock; a negative
 * lease_ms back-dates it: the probe gives a record back looked-up-able at
 * once); never released by itself. Retries as store_complete for up to
 * retry_for_ms. */
void store_mark_unknown(struct store *s, const struct store_id *id, uint64_t token, int64_t lease_ms,
                        uint64_t retry_for_ms, store_done_cb cb, void *arg);

/* ---- unknown outcomes resolved by probing (on_unknown: probe, gateway/probe.c) */

/* Takes an unknown outcome whose lease lapsed at least wait_ms ago (SPEC 8: the upstream's timeout + probe.grace)
 * for one look-up: its token becomes token and its lease now +
 * hold_ms; the state stays unknown (a retry meanwhile reads it as in flight: 409 in use). rows=1: ours, fenced by
 * token from here on (store_complete turns it into a completed record, store_release deletes it,
 * store_mark_unknown with lease 0 gives it back); rows=0: it is not an unknown outcome past its lease (another
 * prober holds it, or it was settled meanwhile). ok=false: Postgres failed (not retried). */
void store_probe_take(struct store *s, const struct store_id *id, uint64_t token, uint64_t hold_ms, uint64_t wait_ms,
                      store_done_cb cb, void *arg);

/* An operator's settle (POST /admin/keys/settle): takes an unknown outcome (or a claim in flight whose lease
 * lapsed), whatever its lease, under token for hold_ms; store_complete with that token then writes the answer.
 * rows=1: taken, and the id of the request that claimed the record copied into request_id[0..request_id_n) ("" when
 * it has none; request_id is the caller's and must live until cb); 0: the record is not an unknown outcome; -1: no
 * such record. ok=false: Postgres failed. */
void store_settle_take(struct store *s, const struct store_id *id, uint64_t token, uint64_t hold_ms, char *request_id,
                       size_t request_id_n, store_done_cb cb, void *arg);

/* One record the sweeper may probe: valid during the callback only (the store frees it). */
struct store_unknown_rec {
    struct store_id id;
};
/* ok=false: Postgres failed (recs NULL, n 0). */
typedef void (*store_unknown_cb)(void *arg, bool ok, const struct store_unknown_rec *recs, size_t n);
/* Lists at most max unknown outcomes whose lease lapsed, of the routes named in routes_nl (route names joined by
 * '\n'), those looked at least recently first. Calls cb exactly once (not at all after store_destroy). */
void store_probe_list(struct store *s, const char *routes_nl, size_t max, store_unknown_cb cb, void *arg);

/* Admin operations over every scope of (route, key). cb gets an HTTP status
 * and a JSON body (heap, the callee takes it):
 * list: 200 [{"route","key","scope","state","token","created_at","expires_at",
 *             "lease_until","status"?}...]
 * purge: 200 {"deleted":N}
 * release: 200 {"released":N}; 404 when no record; 409 when records exist
 *          but none is an unknown outcome or a lapsed lease.
 * 503 with a problem JSON when Postgres is unavailable. */
typedef void (*store_admin_cb)(void *arg, int http_status, char *json);
void store_admin_list(struct store *s, const char *route, const char *key, size_t key_len, store_admin_cb cb,
                      void *arg);
void store_admin_purge(struct store *s, const char *route, const char *key, size_t key_len, store_admin_cb cb,
                       void *arg);
void store_admin_release(struct store *s, const char *route, const char *key, size_t key_len, store_admin_cb cb,
                         void *arg);

/* A page of a route's records, newest first (GET /admin/keys without key=): 200 {"records":[...] (as list's),
 * "next_cursor":"..."|null}; 400 (a problem, cb called before this returns) when cursor is not one a page gave;
 * 503 as above. Paging by cursor is stable while records are added. */
struct store_page_req {
    const char *route;
    const char *state; /* "in_flight", "unknown" (as listed: a lapsed claim in flight too), "completed"; NULL: any */
    uint64_t older_than_ms; /* created at least this long ago; 0: any */
    unsigned limit;         /* 1..1000 */
    const char *cursor;     /* NULL: the first page */
};
void store_admin_page(struct store *s, const struct store_page_req *q, store_admin_cb cb, void *arg);

#endif
