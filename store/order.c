/* order.c - the ordering guard's statements: compare-and-take of a resource's
 * in-flight marker (one upsert under the row lock), its fenced settle and renewal. Never the keys table (store.c). */
#include "store/order.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/event.h>
#include <libpq-fe.h>

#include "store/pg.h"

#define OID_BYTEA 17
#define OID_INT8  20
#define OID_INT4  23
#define OID_TEXT  25
#define OID_BOOL  16

#define SETTLE_BACKOFF_MIN_MS 50
#define SETTLE_BACKOFF_MAX_MS 1000

const char store_order_schema[] = "CREATE TABLE IF NOT EXISTS idemgate_order ("
                                  " route text NOT NULL,"
                                  " scope bytea NOT NULL,"
                                  " resource text NOT NULL,"
                                  " applied bigint NOT NULL," /* 0: nothing applied yet (fresh) */
                                  " inflight_seq bigint,"
                                  " inflight_token bigint,"
                                  " inflight_until timestamptz,"
                                  " inflight_key text," /* the key of the marker's request (NULL: keyless) */
                                  " applied_key text,"  /* the key of the request that set applied */
                                  " PRIMARY KEY (route, scope, resource))";

/* Conditions on the existing row o for the request ($4 seq, $5 token). A marker whose lease lapsed (its owner is
 * gone) counts as applied: its request may have been sent. Every lease is set and compared on Postgres's clock
 * (SPEC 8, one clock), never a gateway's wall clock. */
#define NOW_TS "now()"
#define LAPSED "(o.inflight_token IS NOT NULL AND o.inflight_token <> $5 AND o.inflight_until < " NOW_TS ")"
#define BUSY   "(o.inflight_token IS NOT NULL AND o.inflight_token <> $5 AND o.inflight_until >= " NOW_TS ")"
#define EFF    "(CASE WHEN " LAPSED " THEN greatest(o.applied, o.inflight_seq) ELSE o.applied END)"
#define EFFKEY "(CASE WHEN " LAPSED " AND o.inflight_seq > o.applied THEN o.inflight_key ELSE o.applied_key END)"
/* The same key as the request that set applied, with its sequence: a retry of that intent (on_unknown: retry
 * taking over an unknown outcome), never stale. */
#define SAMEKEY "($10::text IS NOT NULL AND $4 = " EFF " AND " EFFKEY " = $10)"
/* $4 - 1, never app + 1: app may be 2^63-1 (bigint overflow is an error); $4 is at least 1 */
#define GAP(app) "(" app " > 0 AND $4 - 1 > " app ")"
#define OK                                                                                                             \
    "(o.inflight_token = $5 OR (NOT " BUSY " AND ($4 > " EFF " OR " SAMEKEY ") AND NOT (" GAP(EFF) " AND $8 <> 0)))"
#define UNTIL "(now() + $6 * interval '1 ms')"
/* seq is stale against row t, whose applied sequence a retry under key (the one that set it) may repeat. */
#define STALE(t, key)                                                                                                  \
    "($4 < " t ".applied OR ($4 = " t ".applied AND NOT coalesce(" t ".applied_key = " key ", false)))"
/* After the decision (g: the row as the upsert left it): a stale request. */
#define G_STALE STALE("g", "$10")
/* A refusal that deletes the key's claim: stale, or not allowed to wait (or a gap on reject). */
#define FINAL_REFUSAL "(" G_STALE " OR NOT $9 OR ($8 = 1 AND (g.inflight_token IS NULL OR g.inflight_token = $5)))"

/* The acquire's upsert (both engines): compare and take in one statement, under the row's lock. */
#define UPSERT_ACQUIRE                                                                                                 \
    " INSERT INTO idemgate_order AS o (route, scope, resource, applied, inflight_seq, inflight_token, inflight_until," \
    " inflight_key)"                                                                                                   \
    " VALUES ($1, $2, $3, 0, $4, $5, " UNTIL ", $10)"                                                                  \
    " ON CONFLICT (route, scope, resource) DO UPDATE SET"                                                              \
    " applied = " EFF ","                                                                                              \
    " applied_key = " EFFKEY ","                                                                                       \
    " inflight_seq = CASE WHEN " OK " THEN $4 WHEN " LAPSED " THEN NULL ELSE o.inflight_seq END,"                      \
    " inflight_until = CASE WHEN " OK " THEN " UNTIL " WHEN " LAPSED " THEN NULL ELSE o.inflight_until END,"           \
    " inflight_key = CASE WHEN " OK " THEN $10 WHEN " LAPSED " THEN NULL ELSE o.inflight_key END,"                     \
    " inflight_token = CASE WHEN " OK " THEN $5 WHEN " LAPSED " THEN NULL ELSE o.inflight_token END"

/* $1 route, $2 scope, $3 resource, $4 seq, $5 token, $6 lease ms, $7 Postgres's clock as this process reads it (ms
 * since the epoch, store_clock_ms: only the Citus variant's wait hint uses it), $8 on_gap (0 accept), $9 may wait,
 * $10 the key whose claim a final refusal deletes (NULL: none). The upsert always updates, so that it works on
 * the newest row version under its lock; its RETURNING shows the state after this request's decision. */
/* clang-format off */
static const char sql_acquire[] =
    "WITH g AS ("
    UPSERT_ACQUIRE
    " RETURNING o.applied, o.inflight_token, o.inflight_until, o.applied_key),"
    " d AS (DELETE FROM idemgate_keys k USING g WHERE $10::text IS NOT NULL AND k.route = $1 AND k.scope = $2"
    " AND k.key = $10 AND k.token = $5 AND k.state = 'in_flight' AND g.inflight_token IS DISTINCT FROM $5"
    " AND " FINAL_REFUSAL
    " RETURNING 1)"
    " SELECT g.applied, coalesce(g.inflight_token = $5, false), g.inflight_token IS NOT NULL,"
    " greatest(0, ceil(extract(epoch FROM g.inflight_until - " NOW_TS ") * 1000))::int8,"
    " (SELECT count(*) FROM d), " G_STALE " FROM g";
/* clang-format on */

/* On Citus (store.distributed: citus) idemgate_order is distributed by resource and idemgate_keys by key: the
 * rows of one acquire live on two shards, and a statement touching both is not routed to one worker. There the
 * acquire is the upsert alone (its RETURNING computes what the CTE's SELECT does, g being the row it left) and,
 * with a key, a companion DELETE sent before the same Sync (store/pg.h then_sql): one transaction, which Citus
 * commits on both workers together. The companion reads the row the upsert left (same transaction, the row still
 * locked by it) through a subquery on its primary key, so it decides exactly as the CTE's d does. Citus refuses a
 * function that is not IMMUTABLE in an INSERT's DO UPDATE SET or RETURNING (now() included): there the acquire's
 * "now" is $7, Postgres's clock as this process reads it (store_clock_ms: its monotonic clock plus the offset to
 * Postgres's clock it measures every 10 s), so gateways whose wall clocks are minutes apart still agree; before the
 * first reading it is the wall clock. NOW_TS and UNTIL are redefined around this statement only. */
#define G_STALE_O STALE("o", "$10")
#undef NOW_TS
#undef UNTIL
#define NOW_TS "to_timestamp($7 / 1000.0)"
#define UNTIL  "to_timestamp(($7 + $6) / 1000.0)" /* timestamptz + interval is not IMMUTABLE */
/* clang-format off */
static const char sql_acquire_citus[] =
    UPSERT_ACQUIRE
    " RETURNING o.applied, coalesce(o.inflight_token = $5, false), o.inflight_token IS NOT NULL,"
    " greatest(0, ceil(extract(epoch FROM o.inflight_until - " NOW_TS ") * 1000))::int8, 0::int8, " G_STALE_O;
static const char sql_acquire_citus_key[] =
    "DELETE FROM idemgate_keys k WHERE k.route = $1 AND k.scope = $2 AND k.key = $10 AND k.token = $5"
    " AND k.state = 'in_flight' AND EXISTS (SELECT 1 FROM idemgate_order g WHERE g.route = $1 AND g.scope = $2"
    " AND g.resource = $3 AND g.inflight_token IS DISTINCT FROM $5"
    " AND " FINAL_REFUSAL ")";
/* clang-format on */
#undef NOW_TS
#undef UNTIL
#define NOW_TS "now()"
#define UNTIL  "(now() + $6 * interval '1 ms')"

/* Completed: applied = max(applied, seq). Unknown outcome: the same, and its key is remembered, so that a retry
 * under that key (on_unknown: retry) is not stale; a completed one is replayed or, past retention, stale. */
#define SQL_SETTLE_APPLIED(key)                                                                                        \
    "UPDATE idemgate_order SET applied = greatest(applied, inflight_seq),"                                             \
    " applied_key = CASE WHEN inflight_seq >= applied THEN " key " ELSE applied_key END,"                              \
    " inflight_seq = NULL, inflight_token = NULL, inflight_until = NULL, inflight_key = NULL"                          \
    " WHERE route = $1 AND scope = $2 AND resource = $3 AND inflight_token = $4"
static const char sql_applied[] = SQL_SETTLE_APPLIED("NULL");
static const char sql_unknown[] = SQL_SETTLE_APPLIED("inflight_key");
static const char sql_released[] = "UPDATE idemgate_order SET inflight_seq = NULL, inflight_token = NULL,"
                                   " inflight_until = NULL, inflight_key = NULL"
                                   " WHERE route = $1 AND scope = $2 AND resource = $3 AND inflight_token = $4";
/* $5 lease ms. */
static const char sql_renew[] = "UPDATE idemgate_order SET inflight_until = now() + $5 * interval '1 ms'"
                                " WHERE route = $1 AND scope = $2 AND resource = $3 AND inflight_token = $4";

/* Shadow mode. $1 route, $2 scope, $3 resource, $4 seq, $5 key (NULL: none): the applied sequence as acquire
 * counts it (EFF, EFFKEY with no marker of ours) and whether seq is stale (G_STALE). No row: fresh. */
#define P_LAPSED "(o.inflight_token IS NOT NULL AND o.inflight_until < now())"
static const char sql_peek[] = "SELECT e.applied, " STALE(
    "e", "$5") " FROM"
               " (SELECT CASE WHEN " P_LAPSED " THEN greatest(o.applied, o.inflight_seq) ELSE o.applied END AS applied,"
               " CASE WHEN " P_LAPSED
               " AND o.inflight_seq > o.applied THEN o.inflight_key ELSE o.applied_key END AS applied_key"
               " FROM idemgate_order o WHERE o.route = $1 AND o.scope = $2 AND o.resource = $3) e";
/* $1 route, $2 scope, $3 resource, $4 seq, $5 key (NULL: completed): SQL_SETTLE_APPLIED without the marker. */
static const char sql_advance[] =
    "INSERT INTO idemgate_order AS o (route, scope, resource, applied, applied_key) VALUES ($1, $2, $3, $4, $5)"
    " ON CONFLICT (route, scope, resource) DO UPDATE SET applied = greatest(o.applied, $4),"
    " applied_key = CASE WHEN $4 >= o.applied THEN $5 ELSE o.applied_key END";

enum { O_ACQUIRE, O_APPLIED, O_UNKNOWN, O_RELEASED, O_RENEW, O_ACQUIRE_KEYLESS, O_PEEK, O_ADVANCE };

static const Oid acquire_types[] = {OID_TEXT, OID_BYTEA, OID_TEXT, OID_INT8, OID_INT8,
                                    OID_INT8, OID_INT8,  OID_INT4, OID_BOOL, OID_TEXT};
static const Oid settle_types[] = {OID_TEXT, OID_BYTEA, OID_TEXT, OID_INT8};
static const Oid renew_types[] = {OID_TEXT, OID_BYTEA, OID_TEXT, OID_INT8, OID_INT8};
static const Oid peek_types[] = {OID_TEXT, OID_BYTEA, OID_TEXT, OID_INT8, OID_TEXT};

/* batch_key 0: each runs alone in its own implicit transaction. */
static const struct store_pg_stmt order_stmts[STORE_ORDER_NSTMTS] = {
    [O_ACQUIRE] = {"idg_order_acquire", sql_acquire, 10, acquire_types, 0, NULL, NULL, NULL},
    [O_APPLIED] = {"idg_order_applied", sql_applied, 4, settle_types, 0, NULL, NULL, NULL},
    [O_UNKNOWN] = {"idg_order_unknown", sql_unknown, 4, settle_types, 0, NULL, NULL, NULL},
    [O_RELEASED] = {"idg_order_released", sql_released, 4, settle_types, 0, NULL, NULL, NULL},
    [O_RENEW] = {"idg_order_renew", sql_renew, 5, renew_types, 0, NULL, NULL, NULL},
    /* plain Postgres: the same statement (its d deletes nothing without a key) */
    [O_ACQUIRE_KEYLESS] = {"idg_order_acquire_keyless", sql_acquire, 10, acquire_types, 0, NULL, NULL, NULL},
    [O_PEEK] = {"idg_order_peek", sql_peek, 5, peek_types, 0, NULL, NULL, NULL},
    [O_ADVANCE] = {"idg_order_advance", sql_advance, 5, peek_types, 0, NULL, NULL, NULL},
};

static const struct store_pg_stmt order_stmts_citus[STORE_ORDER_NSTMTS] = {
    [O_ACQUIRE] = {"idg_order_acquire", sql_acquire_citus, 10, acquire_types, 0, NULL, NULL, sql_acquire_citus_key},
    [O_APPLIED] = {"idg_order_applied", sql_applied, 4, settle_types, 0, NULL, NULL, NULL},
    [O_UNKNOWN] = {"idg_order_unknown", sql_unknown, 4, settle_types, 0, NULL, NULL, NULL},
    [O_RELEASED] = {"idg_order_released", sql_released, 4, settle_types, 0, NULL, NULL, NULL},
    [O_RENEW] = {"idg_order_renew", sql_renew, 5, renew_types, 0, NULL, NULL, NULL},
    [O_ACQUIRE_KEYLESS] = {"idg_order_acquire_keyless", sql_acquire_citus, 10, acquire_types, 0, NULL, NULL, NULL},
    /* single-shard (filtered or keyed by the distribution column, resource); now() is the coordinator's */
    [O_PEEK] = {"idg_order_peek", sql_peek, 5, peek_types, 0, NULL, NULL, NULL},
    [O_ADVANCE] = {"idg_order_advance", sql_advance, 5, peek_types, 0, NULL, NULL, NULL},
};

const struct store_pg_stmt *store_order_stmts(bool citus)
{
    return citus ? order_stmts_citus : order_stmts;
}

/* A pending operation; on the guard's list so that destroy frees it. */
struct oop {
    struct oop *prev, *next;
    struct store_order *o;
    char *route;
    char *resource;
    size_t resource_len;
    uint8_t scope[32];
    uint64_t token;
    int stmt;
    /* acquire */
    int64_t seq;
    store_order_cb acb;
    /* peek */
    store_order_peek_cb pcb;
    /* settle */
    uint64_t deadline_ms;
    uint64_t backoff_ms;
    struct event *timer;
    void (*scb)(void *arg, bool ok);
    void (*rcb)(void *arg, bool ok, long rows); /* renew */
    void *arg;
};

struct store_order {
    struct event_base *base;
    struct store_pg *pg;
    size_t stmt_base;
    uint64_t (*pg_clock_ms)(void); /* Postgres's clock as this process reads it: the Citus acquire's wait hint */
    struct oop *ops;
};

struct store_order *store_order_create(struct event_base *base, struct store_pg *pg, size_t stmt_base,
                                       uint64_t (*pg_clock_ms)(void))
{
    struct store_order *o = cm_calloc(1, sizeof *o);
    o->pg_clock_ms = pg_clock_ms;
    o->base = base;
    o->pg = pg;
    o->stmt_base = stmt_base;
    return o;
}

static void oop_free(struct oop *p)
{
    if (p->prev)
        p->prev->next = p->next;
    else
        p->o->ops = p->next;
    if (p->next)
        p->next->prev = p->prev;
    if (p->timer)
        event_free(p->timer);
    free(p->route);
    free(p->resource);
    free(p);
}

void store_order_destroy(struct store_order *o)
{
    if (!o)
        return;
    while (o->ops)
        oop_free(o->ops);
    free(o);
}

static struct oop *oop_new(struct store_order *o, const struct store_order_id *id, uint64_t token)
{
    struct oop *p = cm_calloc(1, sizeof *p);
    p->o = o;
    p->route = cm_strdup(id->route);
    p->resource = cm_strndup(id->resource, id->resource_len);
    p->resource_len = id->resource_len;
    memcpy(p->scope, id->scope, 32);
    p->token = token;
    p->next = o->ops;
    if (o->ops)
        o->ops->prev = p;
    o->ops = p;
    return p;
}

static int64_t get_i64(const PGresult *r, int col)
{
    return strtoll(PQgetvalue(r, 0, col), NULL, 10);
}

static void acquire_cb(void *arg, enum store_pg_status st, const PGresult *r, const char *msg)
{
    struct oop *p = arg;
    struct store_order_res res = {.verdict = STORE_ORDER_UNAVAILABLE};
    if (st == STORE_PG_OK && PQntuples(r) == 1) {
        res.applied = get_i64(r, 0);
        bool mine = PQgetvalue(r, 0, 1)[0] == 't';
        bool held = PQgetvalue(r, 0, 2)[0] == 't';
        res.lease_left_ms = (uint64_t)get_i64(r, 3);
        const PGresult *del = store_pg_cb_then(p->o->pg); /* Citus: the companion DELETE */
        res.key_deleted = del ? atol(PQcmdTuples((PGresult *)del)) > 0 : get_i64(r, 4) > 0;
        if (mine)
            res.verdict = STORE_ORDER_OK;
        else if (PQgetvalue(r, 0, 5)[0] == 't')
            res.verdict = STORE_ORDER_STALE;
        else if (held)
            res.verdict = STORE_ORDER_IN_USE;
        else
            res.verdict = STORE_ORDER_GAP;
        /* Judged against applied with no other request in flight: a request that waits for (or is refused for) a
         * lower one in flight is no gap yet (SPEC 6, the in-flight rule), nor is a stale one. */
        res.gap = (res.verdict == STORE_ORDER_OK || res.verdict == STORE_ORDER_GAP) && res.applied > 0 &&
                  p->seq - 1 > res.applied; /* seq >= 1; applied may be INT64_MAX */
    } else {
        cm_log(CM_WARN, "order_acquire_failed", "route=%s status=%s detail=\"%s\"", p->route, store_pg_status_name(st),
               msg);
    }
    store_order_cb cb = p->acb;
    void *cbarg = p->arg;
    struct store_order *o = p->o;
    struct store_order_id id = {.route = p->route, .resource = p->resource, .resource_len = p->resource_len};
    memcpy(id.scope, p->scope, 32);
    if (res.verdict == STORE_ORDER_UNAVAILABLE) /* it may have committed: clear a marker it may have taken */
        store_order_settle(o, &id, p->token, STORE_SETTLE_RELEASED, 60000, NULL, NULL);
    oop_free(p);
    cb(cbarg, &res);
}

void store_order_acquire(struct store_order *o, const struct store_order_req *req, store_order_cb cb, void *arg)
{
    struct oop *p = oop_new(o, &req->id, req->token);
    p->seq = req->seq;
    p->acb = cb;
    p->arg = arg;
    char seq[24], tok[24], lease[24], gap[4], pgnow[24];
    snprintf(pgnow, sizeof pgnow, "%llu", (unsigned long long)o->pg_clock_ms());
    snprintf(seq, sizeof seq, "%lld", (long long)req->seq);
    snprintf(tok, sizeof tok, "%lld", (long long)req->token);
    snprintf(lease, sizeof lease, "%llu", (unsigned long long)req->lease_ms);
    snprintf(gap, sizeof gap, "%d", (int)req->on_gap);
    char *key = req->key ? cm_strndup(req->key, req->key_len) : NULL;
    /* clang-format off */
    struct store_pg_param params[10] = {
        {p->route, strlen(p->route), false},
        {p->scope, 32, true},
        {p->resource, p->resource_len, false},
        {seq, strlen(seq), false},
        {tok, strlen(tok), false},
        {lease, strlen(lease), false},
        {pgnow, strlen(pgnow), false},
        {gap, strlen(gap), false},
        {req->may_wait ? "t" : "f", 1, false},
        {key, key ? strlen(key) : 0, false},
    };
    /* clang-format on */
    store_pg_query(o->pg, o->stmt_base + (key ? O_ACQUIRE : O_ACQUIRE_KEYLESS), params, 10, 0, acquire_cb, p);
    free(key); /* the pool copied the parameters */
}

static void settle_send(struct oop *p);

static void settle_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    settle_send(arg);
}

static void settle_cb(void *arg, enum store_pg_status st, const PGresult *r, const char *msg)
{
    struct oop *p = arg;
    bool ok = st == STORE_PG_OK;
    if (!ok && p->stmt != O_RENEW && cm_now_ms() + p->backoff_ms < p->deadline_ms) {
        if (!p->timer)
            p->timer = evtimer_new(p->o->base, settle_timer_cb, p);
        struct timeval tv = {(time_t)(p->backoff_ms / 1000), (suseconds_t)((p->backoff_ms % 1000) * 1000)};
        p->backoff_ms = p->backoff_ms * 2 > SETTLE_BACKOFF_MAX_MS ? SETTLE_BACKOFF_MAX_MS : p->backoff_ms * 2;
        evtimer_add(p->timer, &tv);
        return;
    }
    if (p->stmt == O_RENEW) {
        void (*rcb)(void *, bool, long) = p->rcb;
        void *rarg = p->arg;
        long rows = ok ? atol(PQcmdTuples((PGresult *)r)) : 0;
        oop_free(p);
        if (rcb)
            rcb(rarg, ok, rows);
        return;
    }
    if (!ok)
        cm_log(CM_WARN, "order_settle_failed", "route=%s status=%s effect=marker_lapses_then_counts_as_applied",
               p->route, store_pg_status_name(st));
    void (*cb)(void *, bool) = p->scb;
    void *cbarg = p->arg;
    oop_free(p);
    if (cb)
        cb(cbarg, ok);
}

static void settle_send(struct oop *p)
{
    char tok[24], lease[24];
    snprintf(tok, sizeof tok, "%lld", (long long)p->token);
    snprintf(lease, sizeof lease, "%llu", (unsigned long long)p->deadline_ms);
    struct store_pg_param params[5] = {
        {p->route, strlen(p->route), false}, {p->scope, 32, true},          {p->resource, p->resource_len, false},
        {tok, strlen(tok), false},           {lease, strlen(lease), false},
    };
    store_pg_query(p->o->pg, p->o->stmt_base + (size_t)p->stmt, params, p->stmt == O_RENEW ? 5 : 4, 0, settle_cb, p);
}

void store_order_settle(struct store_order *o, const struct store_order_id *id, uint64_t token,
                        enum store_order_settle how, uint64_t retry_for_ms, void (*cb)(void *arg, bool ok), void *arg)
{
    struct oop *p = oop_new(o, id, token);
    p->stmt = how == STORE_SETTLE_APPLIED ? O_APPLIED : how == STORE_SETTLE_UNKNOWN ? O_UNKNOWN : O_RELEASED;
    p->deadline_ms = cm_now_ms() + retry_for_ms;
    p->backoff_ms = SETTLE_BACKOFF_MIN_MS;
    p->scb = cb;
    p->arg = arg;
    settle_send(p);
}

void store_order_renew(struct store_order *o, const struct store_order_id *id, uint64_t token, uint64_t lease_ms,
                       void (*cb)(void *arg, bool ok, long rows), void *arg)
{
    struct oop *p = oop_new(o, id, token);
    p->stmt = O_RENEW;
    p->deadline_ms = lease_ms; /* sent as $5 */
    p->rcb = cb;
    p->arg = arg;
    settle_send(p);
}

/* ---- shadow mode */

static void peek_cb(void *arg, enum store_pg_status st, const PGresult *r, const char *msg)
{
    struct oop *p = arg;
    struct store_order_peek_res res = {.ok = st == STORE_PG_OK};
    if (res.ok && PQntuples(r) == 1) {
        res.applied = get_i64(r, 0);
        res.stale = PQgetvalue(r, 0, 1)[0] == 't';
    } else if (!res.ok) {
        cm_log(CM_WARN, "order_peek_failed", "route=%s status=%s detail=\"%s\"", p->route, store_pg_status_name(st),
               msg);
    }
    store_order_peek_cb cb = p->pcb;
    void *cbarg = p->arg;
    oop_free(p);
    cb(cbarg, &res);
}

static void advance_cb(void *arg, enum store_pg_status st, const PGresult *r, const char *msg)
{
    struct oop *p = arg;
    bool ok = st == STORE_PG_OK;
    if (!ok)
        cm_log(CM_WARN, "order_advance_failed", "route=%s status=%s detail=\"%s\"", p->route, store_pg_status_name(st),
               msg);
    void (*cb)(void *, bool) = p->scb;
    void *cbarg = p->arg;
    oop_free(p);
    if (cb)
        cb(cbarg, ok);
}

/* Sends stmt with $1 route, $2 scope, $3 resource, $4 seq, $5 key. */
static void shadow_send(struct oop *p, int stmt, int64_t seq, const char *key, size_t key_len, store_pg_cb cb)
{
    char sq[24];
    snprintf(sq, sizeof sq, "%lld", (long long)seq);
    char *k = key ? cm_strndup(key, key_len) : NULL;
    struct store_pg_param params[5] = {
        {p->route, strlen(p->route), false},   {p->scope, 32, true},
        {p->resource, p->resource_len, false}, {sq, strlen(sq), false},
        {k, k ? strlen(k) : 0, false},
    };
    store_pg_query(p->o->pg, p->o->stmt_base + (size_t)stmt, params, 5, 0, cb, p);
    free(k); /* the pool copied the parameters */
}

void store_order_peek(struct store_order *o, const struct store_order_id *id, int64_t seq, const char *key,
                      size_t key_len, store_order_peek_cb cb, void *arg)
{
    struct oop *p = oop_new(o, id, 0);
    p->pcb = cb;
    p->arg = arg;
    shadow_send(p, O_PEEK, seq, key, key_len, peek_cb);
}

void store_order_advance(struct store_order *o, const struct store_order_id *id, int64_t seq, const char *key,
                         size_t key_len, void (*cb)(void *arg, bool ok), void *arg)
{
    struct oop *p = oop_new(o, id, 0);
    p->scb = cb;
    p->arg = arg;
    shadow_send(p, O_ADVANCE, seq, key, key_len, advance_cb);
}
