/* order.h - the ordering guard's Postgres side (SPEC 6): per (route, scope,
 * resource) the highest applied sequence and one in-flight marker, fenced by
 * a token and leased like a key's claim. Loop thread only, like store.h. Never the keys table (store.h). */
#ifndef IDEMGATE_STORE_ORDER_H
#define IDEMGATE_STORE_ORDER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

struct store_pg;
struct store_pg_stmt;
struct event_base;

/* ---- for store.c */

/* Statements the pool prepares (appended to store.c's own). */
#define STORE_ORDER_NSTMTS 8
/* STORE_ORDER_NSTMTS of them, static; citus: the forms for tables distributed by Citus (store.distributed). */
const struct store_pg_stmt *store_order_stmts(bool citus);
/* The table, created idempotently at every migration (under its lock). */
extern const char store_order_schema[];
struct store_order;
/* stmt_base: the pool's index of store_order_stmts[0]. Never fails. */
/* pg_clock_ms: Postgres's clock as this process reads it (ms since the epoch), given by the caller (store.c's
 * store_clock_ms) so that this module never calls up into the store. */
struct store_order *store_order_create(struct event_base *base, struct store_pg *pg, size_t stmt_base,
                                       uint64_t (*pg_clock_ms)(void));
/* Drops pending operations without callbacks; NULL is a no-op. */
void store_order_destroy(struct store_order *o);

/* ---- for the pipeline */

struct store_order_id {
    const char *route;
    uint8_t scope[32];
    const char *resource; /* the normalized path of the instance */
    size_t resource_len;
};

enum store_order_gap { STORE_GAP_ACCEPT = 0, STORE_GAP_REJECT, STORE_GAP_HOLD };

struct store_order_req {
    struct store_order_id id;
    int64_t seq;
    uint64_t token;    /* the key claim's token, or a fresh random one (keyless) */
    uint64_t lease_ms; /* the in-flight marker's lease */
    enum store_order_gap on_gap;
    bool may_wait; /* still within hold: an in-flight or (hold) gap refusal is not final */
    /* The key claim (NULL: keyless) a final refusal deletes in the same transaction (plain Postgres: the same
     * statement; Citus: a second one before the same Sync), fenced by token. */
    const char *key;
    size_t key_len;
};

enum store_order_verdict {
    STORE_ORDER_OK,          /* the marker is ours: forward */
    STORE_ORDER_STALE,       /* seq <= applied (final) */
    STORE_ORDER_IN_USE,      /* another request holds the resource */
    STORE_ORDER_GAP,         /* seq > applied + 1, refused (on_gap reject or hold) */
    STORE_ORDER_UNAVAILABLE, /* Postgres failed; a marker that may have been taken is released later */
};

struct store_order_res {
    enum store_order_verdict verdict;
    int64_t applied; /* the applied sequence (0: fresh resource) */
    /* Judged a gap: seq > applied + 1 on a resource that is not fresh, with no other request in flight
     * (STORE_ORDER_OK on accept, or STORE_ORDER_GAP); never with STORE_ORDER_IN_USE or STORE_ORDER_STALE. */
    bool gap;
    bool key_deleted;       /* a final refusal deleted the key claim */
    uint64_t lease_left_ms; /* STORE_ORDER_IN_USE: the holder's lease left */
};
typedef void (*store_order_cb)(void *arg, const struct store_order_res *res);

/* Compares and takes the resource's in-flight marker in one statement (the
 * row lock of an upsert: no read-then-write). A final refusal (stale; gap on
 * reject; anything once may_wait is false) deletes req->key's claim in that
 * statement. cb runs exactly once, on the loop. */
void store_order_acquire(struct store_order *o, const struct store_order_req *req, store_order_cb cb, void *arg);

enum store_order_settle {
    STORE_SETTLE_APPLIED,  /* completed: applied = max(applied, seq) */
    STORE_SETTLE_UNKNOWN,  /* an unknown outcome: applied too, and a retry under the same key is not stale */
    STORE_SETTLE_RELEASED, /* nothing executed: applied stays */
};
/* Clears the marker fenced by token (retried with backoff for up to
 * retry_for_ms; a marker never cleared lapses after its lease and then
 * counts as applied). cb (may be NULL) gets ok=false when it gave up. */
void store_order_settle(struct store_order *o, const struct store_order_id *id, uint64_t token,
                        enum store_order_settle how, uint64_t retry_for_ms, void (*cb)(void *arg, bool ok), void *arg);
/* Extends the marker's lease to Postgres's now + lease_ms, fenced by token (one try). cb (may be NULL) runs once on
 * the loop: ok=false when Postgres failed; rows 0: the marker is no longer token's (its lease is lost). */
void store_order_renew(struct store_order *o, const struct store_order_id *id, uint64_t token, uint64_t lease_ms,
                       void (*cb)(void *arg, bool ok, long rows), void *arg);

/* ---- for mode: shadow (SPEC 10): the row read and advanced without the marker; nothing is ever refused */

struct store_order_peek_res {
    bool ok;         /* false: Postgres failed (nothing else is set) */
    bool stale;      /* acquire would answer STORE_ORDER_STALE for this sequence and key */
    int64_t applied; /* the applied sequence (a lapsed marker's counted; 0: fresh resource) */
};
typedef void (*store_order_peek_cb)(void *arg, const struct store_order_peek_res *res);
/* Reads the resource's row (one SELECT, no lock, no marker): is seq stale as store_order_acquire would judge it
 * (seq <= applied, unless key, NULL or key_len bytes, is the key that set applied with that very sequence)? cb runs
 * exactly once, on the loop; id and key are copied. */
void store_order_peek(struct store_order *o, const struct store_order_id *id, int64_t seq, const char *key,
                      size_t key_len, store_order_peek_cb cb, void *arg);
/* applied = max(applied, seq) without the marker (a fresh resource gets its row), as a settle would after a
 * request with that sequence executed; key (NULL: a completed request) is remembered like an unknown outcome's
 * settle does. One try (a failure is logged); cb (may be NULL) runs once on the loop, ok=false when it failed;
 * id and key are copied. */
void store_order_advance(struct store_order *o, const struct store_order_id *id, int64_t seq, const char *key,
                         size_t key_len, void (*cb)(void *arg, bool ok), void *arg);

#endif
