/* owner.c - what the owner of a claim does with it afterwards, fenced by its token: complete (with its settling
 * retries), renew, release, mark unknown. Never a claim (claim.c) or an admin's operation (admin.c). */
#include "store/internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- owner operations */

struct store_i_owner_op *store_i_owner_new(struct store *s, enum store_i_op_kind kind, const struct store_id *id,
                                           uint64_t token, store_done_cb cb, void *arg)
{
    struct store_i_owner_op *w = cm_calloc(1, sizeof *w);
    store_i_op_link(s, &w->h, kind);
    w->route = cm_strdup(id->route);
    w->key = cm_strndup(id->key, id->key_len);
    w->key_len = id->key_len;
    memcpy(w->scope, id->scope, 32);
    w->token = token;
    w->cb = cb;
    w->arg = arg;
    store_i_redis_key(w->route, w->scope, w->key, w->key_len, w->rkey);
    return w;
}

void store_i_owner_finish(struct store_i_owner_op *w, bool ok, long rows)
{
    store_i_op_unlink(&w->h);
    if (w->cb)
        w->cb(w->arg, ok, rows);
    store_i_op_free(&w->h);
}

static void settle_timer_cb(evutil_socket_t fd, short what, void *arg);

const char *store_i_owner_op_name(const struct store_i_owner_op *w)
{
    switch (w->h.kind) {
    case STORE_OP_COMPLETE:
        return "complete";
    case STORE_OP_RENEW:
        return "renew";
    case STORE_OP_RELEASE:
        return "release";
    case STORE_OP_MARK_UNKNOWN:
        return "mark_unknown";
    case STORE_OP_PROBE_TAKE:
        return "probe_take";
    default:
        return "?";
    }
}

/* A settle operation (complete, release, mark unknown) retries what another
 * try may fix, with backoff (50 ms doubling to 1 s) until retry_for_ms from
 * its start; when Postgres answers again (store_pg_on_up) the waiting ones go
 * at once, before the lease they keep renewing could lapse. */
static void settle_init(struct store_i_owner_op *w, uint64_t retry_for_ms)
{
    w->backoff_ms = STORE_COMPLETE_BACKOFF_MIN_MS;
    w->deadline_ms = cm_now_ms() + retry_for_ms;
    w->timer = evtimer_new(w->h.s->base, settle_timer_cb, w);
    if (!w->timer)
        abort();
}

/* Returns true when another try was scheduled. */
static bool settle_retry_later(struct store_i_owner_op *w, enum store_pg_status st)
{
    uint64_t now = cm_now_ms();
    if (st == STORE_PG_SQL_ERROR || now + w->backoff_ms >= w->deadline_ms || w->h.s->settle_stop)
        return false;
    cm_log(CM_DEBUG, "store_settle_retry", "op=%s attempt=%d status=%s backoff_ms=%llu", store_i_owner_op_name(w),
           w->attempts, store_pg_status_name(st), (unsigned long long)w->backoff_ms);
    struct timeval tv = {(time_t)(w->backoff_ms / 1000), (suseconds_t)((w->backoff_ms % 1000) * 1000)};
    w->backoff_ms =
        w->backoff_ms * 2 > STORE_COMPLETE_BACKOFF_MAX_MS ? STORE_COMPLETE_BACKOFF_MAX_MS : w->backoff_ms * 2;
    evtimer_add(w->timer, &tv);
    return true;
}

/* Postgres answers again: every settle operation waiting for its next try
 * is sent now, ahead of any claim that arrives after this (a retry on an
 * on_unknown: retry route must not take over a lease that lapsed while
 * Postgres was away from an owner that holds the answer). */
static void settle_send_now(struct store_i_owner_op *w)
{
    settle_timer_cb(-1, 0, w);
}

/* Runs fn on every settle operation waiting for its next try (its timer stopped first). */
static void settle_each_waiting(struct store *s, void (*fn)(struct store_i_owner_op *))
{
    struct store_i_op *next;
    for (struct store_i_op *o = s->ops; o; o = next) {
        next = o->next;
        if (o->kind != STORE_OP_COMPLETE && o->kind != STORE_OP_RELEASE && o->kind != STORE_OP_MARK_UNKNOWN)
            continue;
        struct store_i_owner_op *w = (struct store_i_owner_op *)o;
        if (w->timer && evtimer_pending(w->timer, NULL)) {
            evtimer_del(w->timer);
            fn(w);
        }
    }
}

void store_i_settle_kick(struct store *s)
{
    settle_each_waiting(s, settle_send_now);
}

static void settle_give_up(struct store_i_owner_op *w)
{
    cm_log(CM_ERROR, "store_error", "op=%s attempts=%d status=given_up_at_shutdown", store_i_owner_op_name(w),
           w->attempts);
    store_i_owner_finish(w, false, 0);
}

void store_settle_stop(struct store *s)
{
    s->settle_stop = true;
    settle_each_waiting(s, settle_give_up);
}

static void complete_pg_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store_i_owner_op *w = arg;
    if (st == STORE_PG_OK) {
        long rows = PQntuples(pr);
        if (w->attempts > 1)
            cm_log(CM_INFO, "store_complete_retried", "attempts=%d rows=%ld", w->attempts, rows);
        /* Nothing is written to Redis here: most keys are never retried, and a retry that finds the in-flight
         * marker (or nothing) asks Postgres, whose replay puts the answer into Redis over that marker (claim_pg_cb).
         * The marker this claim placed stays until its lease runs out; it never answers anything by itself. */
        store_i_owner_finish(w, true, rows);
        return;
    }
    if (settle_retry_later(w, st))
        return;
    store_i_log_pg_failure("complete", st, msg);
    store_i_owner_finish(w, false, 0);
}

static void complete_send(struct store_i_owner_op *w)
{
    struct store *s = w->h.s;
    uint8_t tok[8], status[4], ret[8];
    store_i_be64(tok, w->token);
    store_i_be32(status, (uint32_t)w->status);
    store_i_be64(ret, w->arg_ms);
    struct store_pg_param p[7] = {
        {w->route, strlen(w->route), true},
        {w->scope, 32, true},
        {w->key, w->key_len, true},
        {tok, 8, true},
        {status, 4, true},
        {w->blob, w->blob_len, true},
        {ret, 8, true},
    };
    w->attempts++;
    store_pg_query(s->pg, STORE_S_COMPLETE, p, 7, 1, complete_pg_cb, w);
}

static void owner_pg_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg);

static void settle_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct store_i_owner_op *w = arg;
    (void)fd;
    (void)what;
    if (w->h.kind == STORE_OP_RELEASE || w->h.kind == STORE_OP_MARK_UNKNOWN) {
        w->attempts++;
        store_i_owner_send(w, w->h.kind == STORE_OP_RELEASE ? STORE_S_RELEASE : STORE_S_MARK_UNKNOWN, owner_pg_cb);
        return;
    }
    if (w->encode_failed) {
        cm_log(CM_ERROR, "store_error", "op=complete status=encode_failed");
        store_i_owner_finish(w, false, 0);
        return;
    }
    complete_send(w);
}

void store_complete(struct store *s, const struct store_id *id, uint64_t token, const struct cm_resp *resp,
                    uint64_t retention_ms, uint64_t retry_for_ms, store_done_cb cb, void *arg)
{
    struct store_i_owner_op *w = store_i_owner_new(s, STORE_OP_COMPLETE, id, token, cb, arg);
    w->arg_ms = retention_ms;
    w->status = resp->status;
    settle_init(w, retry_for_ms);
    struct cm_buf b;
    cm_buf_init(&b, STORE_RESP_BLOB_MAX);
    if (!cm_resp_encode(resp, &b)) {
        cm_buf_free(&b);
        w->encode_failed = true;
        static const struct timeval zero = {0, 0};
        evtimer_add(w->timer, &zero);
        return;
    }
    w->blob = cm_buf_take(&b, &w->blob_len);
    cm_buf_free(&b);
    complete_send(w);
}

static void released_cb(void *arg, const struct redisReply *reply)
{
    struct store_i_owner_op *w = arg;
    store_i_owner_finish(w, true, w->rows);
}

static void owner_pg_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store_i_owner_op *w = arg;
    struct store *s = w->h.s;
    if (w->h.kind == STORE_OP_RENEW && st == STORE_PG_TRANSIENT && ++w->attempts < STORE_OWNER_ATTEMPTS) {
        /* rolled back (a deadlock, or another statement of its batch failed): nothing was done */
        store_i_owner_send(w, STORE_S_RENEW, owner_pg_cb);
        return;
    }
    if (st != STORE_PG_OK && w->h.kind != STORE_OP_RENEW && settle_retry_later(w, st))
        return;
    if (st != STORE_PG_OK) {
        store_i_log_pg_failure(store_i_owner_op_name(w), st, msg);
        if (w->h.kind == STORE_OP_RELEASE && st != STORE_PG_SQL_ERROR) {
            /* Nothing was executed under this claim (or the upstream asked
             * for a release): the release is not given up, it waits in the
             * list of claims in doubt, so the key never reads as an unknown
             * outcome while this process runs. */
            store_i_doubt_remember(s, w->route, w->scope, w->key, w->key_len, w->token, NULL, 0, 0, false);
        }
        store_i_owner_finish(w, false, 0);
        return;
    }
    long rows = store_i_cmd_rows(pr);
    if (w->h.kind == STORE_OP_RELEASE && rows > 0) {
        /* The answer waits for the marker's removal (bounded by redis_timeout): until it lands, a retry on
         * another loop or instance would find the in-flight marker and get 409 for a key that is free. */
        const char *argv[2] = {"DEL", w->rkey};
        size_t lens[2] = {3, strlen(w->rkey)};
        w->rows = rows;
        if (s->rd && store_rd_command(s->rd, released_cb, w, 2, argv, lens))
            return;
    }
    store_i_owner_finish(w, true, rows);
}

void store_i_owner_send(struct store_i_owner_op *w, enum store_i_stmt_id stmt, store_pg_cb cb)
{
    struct store *s = w->h.s;
    uint8_t tok[8], ms[8], ms2[8];
    store_i_be64(tok, w->token);
    store_i_be64(ms, w->arg_ms);
    store_i_be64(ms2, w->arg2_ms);
    struct store_pg_param p[6] = {
        {w->route, strlen(w->route), true},
        {w->scope, 32, true},
        {w->key, w->key_len, true},
        {tok, 8, true},
        {ms, 8, true},
        {ms2, 8, true},
    };
    store_pg_query(s->pg, stmt, p, s->all_stmts[stmt].nparams, 1, cb, w);
}

void store_renew(struct store *s, const struct store_id *id, uint64_t token, uint64_t lease_ms, store_done_cb cb,
                 void *arg)
{
    struct store_i_owner_op *w = store_i_owner_new(s, STORE_OP_RENEW, id, token, cb, arg);
    w->arg_ms = lease_ms;
    /* Keep the marker (what the completion's cache write compares against)
     * alive as long as the lease. */
    store_i_redis_pexpire(s, w->rkey, lease_ms);
    store_i_owner_send(w, STORE_S_RENEW, owner_pg_cb);
}

void store_release(struct store *s, const struct store_id *id, uint64_t token, uint64_t retry_for_ms, store_done_cb cb,
                   void *arg)
{
    struct store_i_owner_op *w = store_i_owner_new(s, STORE_OP_RELEASE, id, token, cb, arg);
    settle_init(w, retry_for_ms);
    w->attempts = 1;
    store_i_owner_send(w, STORE_S_RELEASE, owner_pg_cb);
}

void store_mark_unknown(struct store *s, const struct store_id *id, uint64_t token, int64_t lease_ms,
                        uint64_t retry_for_ms, store_done_cb cb, void *arg)
{
    struct store_i_owner_op *w = store_i_owner_new(s, STORE_OP_MARK_UNKNOWN, id, token, cb, arg);
    w->arg_ms = (uint64_t)lease_ms; /* sent as an int8: a negative one stays negative */
    settle_init(w, retry_for_ms);
    w->attempts = 1;
    store_i_redis_pexpire(s, w->rkey, lease_ms > 0 ? (uint64_t)lease_ms : 0);
    store_i_owner_send(w, STORE_S_MARK_UNKNOWN, owner_pg_cb);
}
