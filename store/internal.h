/* internal.h - what the files of store/ share and nothing outside store/ includes: the store's struct, its
 * operations' structs, the statement ids and the limits they work within, and what one file gives another. Never a
 * definition. */
#ifndef IDEMGATE_STORE_INTERNAL_H
#define IDEMGATE_STORE_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <event2/event.h>
#include <hiredis/hiredis.h>
#include <libpq-fe.h>

#include "common/metrics.h"
#include "conf/conf.h"
#include "store/notify.h"
#include "store/order.h"
#include "store/pg.h"
#include "store/redis.h"
#include "store/store.h"

/* The server aborts a statement after STORE_STATEMENT_TIMEOUT_MS, before the
 * client gives up on it (STORE_RUN_TIMEOUT_MS): a claim the client abandoned does
 * not commit later behind its back (short of a network stall). */
#define STORE_QUEUE_TIMEOUT_MS        5000
#define STORE_STATEMENT_TIMEOUT_MS    "4000"
#define STORE_RUN_TIMEOUT_MS          5000
#define STORE_CONNECT_TIMEOUT_MS      5000
#define STORE_MAX_QUEUE               65536
#define STORE_MAX_BATCH               16 /* queries sharing one transaction while the pool is busy (store/pg.h) */
#define STORE_CLAIM_ATTEMPTS          5
#define STORE_OWNER_ATTEMPTS          3    /* renew: tries after a rollback */
#define STORE_DOUBT_MAX               1024 /* claims in doubt remembered per store (loop) */
#define STORE_DOUBT_BACKOFF_MIN_MS    100
#define STORE_DOUBT_BACKOFF_MAX_MS    2000
#define STORE_PROBE_EVERY_MS          300   /* the health probe's period */
#define STORE_CLOCK_EVERY_MS          10000 /* Postgres's clock is read this often (store_clock_ms) */
#define STORE_CLOCK_MAX_RTT_MS        500   /* a reading whose round trip took longer is not used */
#define STORE_PROBE_IDLE_MS           250   /* pings only when Postgres has not answered anything for this long */
#define STORE_HEALTHY_WITHIN_MS       1000  /* /readyz: the last answer is at most this old */
#define STORE_COMPLETE_BACKOFF_MIN_MS 50
#define STORE_COMPLETE_BACKOFF_MAX_MS 1000
#define STORE_CLEAN_FIRST_MS          1000
#define STORE_CLEAN_EVERY_MS          10000
#define STORE_CLEAN_BATCH             1000
#define STORE_CLEAN_MAX_BATCHES       10
#define STORE_STUCK_EVERY_CITUS       6 /* cleaner passes per stuck count on Citus (one a minute) */
#define STORE_ADMIN_MAX_ROWS          1000
#define STORE_ADMIN_JSON_MAX          (4u << 20)
#define STORE_RESP_BLOB_MAX           ((size_t)1 << 30)
#define STORE_RKEY_LEN                (4 + 64)
#define STORE_MARKER_LEN              41 /* "F" + fingerprint + token */

#define STORE_OID_BOOL        16
#define STORE_OID_BYTEA       17
#define STORE_OID_INT8        20
#define STORE_OID_INT4        23
#define STORE_OID_TEXT        25
#define STORE_OID_TIMESTAMPTZ 1184
#define STORE_OID_BOOL_ARRAY  1000
#define STORE_OID_BYTEA_ARRAY 1001
#define STORE_OID_INT4_ARRAY  1007
#define STORE_OID_TEXT_ARRAY  1009
#define STORE_OID_INT8_ARRAY  1016

#define STORE_PROBLEM_PREFIX "urn:idemgate:problem:"

enum store_i_stmt_id {
    STORE_S_CLAIM,
    STORE_S_COMPLETE,
    STORE_S_RENEW,
    STORE_S_RELEASE,
    STORE_S_MARK_UNKNOWN,
    STORE_S_ADMIN_LIST,
    STORE_S_ADMIN_PURGE,
    STORE_S_ADMIN_RELEASE,
    STORE_S_CLEAN,
    STORE_S_STUCK,
    STORE_S_DOUBT_ALIVE,
    STORE_S_DOUBT_RELEASE,
    STORE_S_PING,
    STORE_S_CLOCK,
    STORE_S_PROBE_TAKE,
    STORE_S_PROBE_LIST,
    STORE_S_EPOCH_BUMP,
    STORE_S_ADMIN_PAGE,
    STORE_S_SETTLE_TAKE,
    STORE_S__COUNT
};

/* ---- the store */

enum store_i_op_kind {
    STORE_OP_CLAIM,
    STORE_OP_COMPLETE,
    STORE_OP_RENEW,
    STORE_OP_RELEASE,
    STORE_OP_MARK_UNKNOWN,
    STORE_OP_ADMIN,
    STORE_OP_PROBE_TAKE,
    STORE_OP_PROBE_LIST
};

/* Every pending operation is on the store's list so that store_destroy can
 * free it without calling back. */
struct store_i_op {
    struct store_i_op *prev, *next;
    struct store *s;
    enum store_i_op_kind kind;
};

struct store {
    struct event_base *base;
    const struct conf *conf;
    struct store_pg_opts pg_opts;
    struct store_pg *pg;
    struct store_rd *rd;
    struct event *clean_timer;
    bool cleaning;
    int clean_batches;
    uint64_t clean_passes;
    uint64_t cleaned;
    struct store_i_op *ops;
    /* Claims in doubt (FIFO, at most STORE_DOUBT_MAX): released one at a time by doubt_timer. */
    struct store_i_doubt *doubt_head, *doubt_tail;
    size_t ndoubt;
    struct event *doubt_timer;
    uint64_t doubt_backoff_ms;
    bool doubt_busy; /* a query for doubt_head runs */
    struct event *probe_timer;
    bool probing;           /* a ping runs */
    bool clocking;          /* a reading of Postgres's clock runs */
    uint64_t clock_sent_ms; /* it was sent then (cm_now_ms) */
    uint64_t clock_read_ms; /* the last usable reading came then (0: none yet) */
    /* the ordering guard (store/order.c): its statements follow ours in the pool's table */
    struct store_pg_stmt all_stmts[STORE_S__COUNT + STORE_ORDER_NSTMTS];
    struct store_order *order;
    bool settle_stop;          /* shutting down past the grace: a settle operation that fails is not tried again */
    struct store_epoch *epoch; /* the process's purge epoch (NULL: none; no Redis answer is used) */
};

struct store_epoch {
    _Atomic uint64_t known; /* the largest epoch heard of */
    atomic_bool current;    /* every purge committed until now has been heard of */
};

/* A claim whose commit outcome the gateway does not know (its statement
 * timed out or its connection broke, and no later attempt settled it):
 * nothing was forwarded under its token, so it is released, fenced by the
 * token, once the server processes that may still commit it are gone. */
struct store_i_doubt {
    struct store_i_doubt *next;
    char *route;
    char *key;
    size_t key_len;
    uint8_t scope[32];
    uint64_t token;
    int pids[STORE_CLAIM_ATTEMPTS]; /* server processes of the doubtful attempts */
    int npids;
    uint64_t sent_ms; /* when the first doubtful attempt was sent (cm_now_ms) */
    int tries;
};

struct store_i_claim_op {
    struct store_i_op h;
    char *route;
    char *key;
    size_t key_len;
    size_t route_index;
    uint8_t scope[32];
    uint8_t fp[32];
    uint64_t lease_ms;
    uint64_t retention_ms;
    bool takeover;
    char request_id[CM_REQUEST_ID_MAX + 1]; /* the claiming request's (SPEC 11), kept in the record */
    uint64_t token;
    int attempts;
    bool marker_ours;               /* our SET NX placed the in-flight marker */
    uint8_t seen[STORE_MARKER_LEN]; /* the marker SET NX GET found instead (a cache refill compares against it) */
    bool seen_marker;
    bool seen_stale; /* SET NX GET found an answer that may not be used (older than a purge, or unverifiable) */
    uint64_t epoch;  /* the purge epoch known when the claim was sent: what a refill carries */
    uint64_t
        sent_pg_ms;   /* the last attempt was sent then, on Postgres's clock (store_clock_ms): a Redis entry's expiry */
    uint64_t sent_ms; /* the same, cm_now_ms */
    int doubt_pids[STORE_CLAIM_ATTEMPTS]; /* attempts that may have committed (timeout, connection lost) */
    int ndoubt;
    uint64_t doubt_sent_ms; /* cm_now_ms */
    char rkey[STORE_RKEY_LEN + 1];
    store_claim_cb cb;
    void *arg;
    /* Redis' SET NX GET and the Postgres claim run at once: the op lives until both came back. */
    bool rd_pending; /* the SET NX GET has not answered yet (its timer bounds it) */
    bool pg_pending; /* the claim (with its re-runs) has not settled yet */
    bool answered;   /* cb ran */
    /* Postgres' verdict, held while Redis (which may hold the answer, and tells whose marker is there) is pending */
    bool held;
    struct store_claim_res held_res;
    char *held_blob; /* a replay's stored answer, for the Redis refill */
    size_t held_blob_len;
};

struct store_i_owner_op {
    struct store_i_op h;
    char *route;
    char *key;
    size_t key_len;
    uint8_t scope[32];
    uint64_t token;
    uint64_t arg_ms;  /* lease (renew, mark_unknown: an int8, may be negative) or retention (complete) */
    uint64_t arg2_ms; /* probe_take: the wait after the lapse */
    char rkey[STORE_RKEY_LEN + 1];
    store_done_cb cb;
    void *arg;
    /* complete */
    char *blob;
    size_t blob_len;
    int status;
    uint64_t deadline_ms;
    uint64_t backoff_ms;
    int attempts;
    bool encode_failed;
    struct event *timer;
    long rows; /* release: rows Postgres reported, while the marker's removal runs */
    /* settle_take: where the record's request id goes (the caller's buffer) */
    char *rid_out;
    size_t rid_out_n;
};

struct store_i_admin_op {
    struct store_i_op h;
    enum store_i_stmt_id stmt;
    char *route;
    char *key;
    size_t key_len;
    store_admin_cb cb;
    void *arg;
    int status; /* the answer, while the Redis markers are being removed */
    char *json;
    bool bump; /* a purge or release: the purge epoch moves on before the answer */
    int limit; /* page: the records asked for */
};

/* A replay answered by Redis may be kept by the gateway's replay cache until the record's expiry written beside
 * it, less this (the wall clocks of the gateway that wrote it, of Postgres and of the reader may differ). */
#define STORE_REDIS_EXPIRY_MARGIN_MS 1000

/* A completed answer in Redis: "G" + fingerprint + the record's expiry (wall ms) + the purge epoch (both 8 bytes,
 * big-endian) + cm_resp_encode blob. */
#define STORE_RVAL_HEAD 49

/* What one file of store/ gives another. */

/* ops.c */
void store_i_op_link(struct store *s, struct store_i_op *o, enum store_i_op_kind kind);
void store_i_op_unlink(struct store_i_op *o);
void store_i_op_free(struct store_i_op *o);
void store_i_be64(uint8_t out[8], uint64_t v);
uint64_t store_i_rd_be64(const uint8_t in[8]);
void store_i_be32(uint8_t out[4], uint32_t v);
void store_i_redis_key(const char *route, const uint8_t scope[32], const char *key, size_t key_len,
                       char out[STORE_RKEY_LEN + 1]);
const char *store_i_pg_err_text(enum store_pg_status st);
void store_i_log_pg_failure(const char *what, enum store_pg_status st, const char *msg);
long store_i_cmd_rows(const PGresult *res);
void store_i_redis_del(struct store *s, const char *rkey);
void store_i_redis_pexpire(struct store *s, const char *rkey, uint64_t ms);
void store_i_make_marker(uint8_t out[STORE_MARKER_LEN], const uint8_t fp[32], uint64_t token);
void store_i_redis_cache(struct store *s, const char *rkey, const void *expect, size_t expect_len, const uint8_t fp[32],
                         const void *blob, size_t blob_len, uint64_t ttl_ms, uint64_t expiry_wall_ms, uint64_t epoch);
uint64_t store_i_epoch_known(const struct store *s);
bool store_i_epoch_trusts(const struct store *s, uint64_t epoch);
void store_i_clock_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg);

/* claim.c */
void store_i_doubt_remember(struct store *s, const char *route, const uint8_t scope[32], const char *key,
                            size_t key_len, uint64_t token, const int *pids, int npids, uint64_t sent_ms, bool unused);
void store_i_doubt_free(struct store_i_doubt *d);
void store_i_doubt_schedule(struct store *s, uint64_t ms);
struct store_i_doubt *store_i_doubt_pop(struct store *s);
void store_i_doubt_timer_cb(evutil_socket_t fd, short what, void *arg);

/* owner.c */
struct store_i_owner_op *store_i_owner_new(struct store *s, enum store_i_op_kind kind, const struct store_id *id,
                                           uint64_t token, store_done_cb cb, void *arg);
void store_i_owner_finish(struct store_i_owner_op *w, bool ok, long rows);
void store_i_owner_send(struct store_i_owner_op *w, enum store_i_stmt_id stmt, store_pg_cb cb);
const char *store_i_owner_op_name(const struct store_i_owner_op *w);
void store_i_settle_kick(struct store *s);

/* cleaner.c */
void store_i_clean_schedule(struct store *s, uint64_t ms);
void store_i_clean_timer_cb(evutil_socket_t fd, short what, void *arg);

#endif
