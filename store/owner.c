/* owner.c - what the owner of a claim does with it afterwards, fenced by its token: complete (with its settling
 * retries), renew, release, mark unknown. Never a claim (claim.c) or an admin's operation (admin.c). */
#include "store/internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- owner operations */

struct owner_op *owner_new(struct store *s, enum op_kind kind, const struct store_id *id, uint64_t token,
                           store_done_cb cb, void *arg)
{
    struct owner_op *w = cm_calloc(1, sizeof *w);
    op_link(s, &w->h, kind);
    w->route = cm_strdup(id->route);
    w->key = cm_strndup(id->key, id->key_len);
    w->key_len = id->key_len;
    memcpy(w->scope, id->scope, 32);
    w->token = token;
    w->cb = cb;
    w->arg = arg;
    redis_key(w->route, w->scope, w->key, w->key_len, w->rkey);
    return w;
}

void owner_finish(struct owner_op *w, bool ok, long rows)
{
    op_unlink(&w->h);
    if (w->cb)
        w->cb(w->arg, ok, rows);
    op_free(&w->h);
}

static void settle_timer_cb(evutil_socket_t fd, short what, void *arg);

const char *owner_op_name(const struct owner_op *w)
{
    switch (w->h.kind) {
    case OP_COMPLETE:
        return "complete";
    case OP_RENEW:
        return "renew";
    case OP_RELEASE:
        return "release";
    case OP_MARK_UNKNOWN:
        return "mark_unknown";
    case OP_PROBE_TAKE:
        return "probe_take";
    default:
        return "?";
    }
}

/* A settle operation (complete, release, mark unknown) retries what another
 * try may fix, with backoff (50 ms doubling to 1 s) until retry_for_ms from
 * its start; when Postgres answers again (store_pg_on_up) the waiting ones go
 * at once, before the lease they keep renewing could lapse. */
static void settle_init(struct owner_op *w, uint64_t retry_for_ms)
{
    w->backoff_ms = COMPLETE_BACKOFF_MIN_MS;
    w->deadline_ms = cm_now_ms() + retry_for_ms;
    w->timer = evtimer_new(w->h.s->base, settle_timer_cb, w);
    if (!w->timer)
        abort();
}

/* Returns true when another try was scheduled. */
static bool settle_retry_later(struct owner_op *w, enum store_pg_status st)
{
    uint64_t now = cm_now_ms();
    if (st == STORE_PG_SQL_ERROR || now + w->backoff_ms >= w->deadline_ms || w->h.s->settle_stop)
        return false;
    cm_log(CM_DEBUG, "store_settle_retry", "op=%s attempt=%d status=%s backoff_ms=%llu", owner_op_name(w), w->attempts,
           store_pg_status_name(st), (unsigned long long)w->backoff_ms);
    struct timeval tv = {(time_t)(w->backoff_ms / 1000), (suseconds_t)((w->backoff_ms % 1000) * 1000)};
    w->backoff_ms = w->backoff_ms * 2 > COMPLETE_BACKOFF_MAX_MS ? COMPLETE_BACKOFF_MAX_MS : w->backoff_ms * 2;
    evtimer_add(w->timer, &tv);
    return true;
}

/* Postgres answers again: every settle operation waiting for its next try
 * is sent now, ahead of any claim that arrives after this (a retry on an
 * on_unknown: retry route must not take over a lease that lapsed while
 * Postgres was away from an owner that holds the answer). */
static void settle_send_now(struct owner_op *w)
{
    settle_timer_cb(-1, 0, w);
}

/* Runs fn on every settle operation waiting for its next try (its timer stopped first). */
static void settle_each_waiting(struct store *s, void (*fn)(struct owner_op *))
{
    struct op *next;
    for (struct op *o = s->ops; o; o = next) {
        next = o->next;
        if (o->kind != OP_COMPLETE && o->kind != OP_RELEASE && o->kind != OP_MARK_UNKNOWN)
            continue;
        struct owner_op *w = (struct owner_op *)o;
        if (w->timer && evtimer_pending(w->timer, NULL)) {
            evtimer_del(w->timer);
            fn(w);
        }
    }
}

void settle_kick(struct store *s)
{
    settle_each_waiting(s, settle_send_now);
}

static void settle_give_up(struct owner_op *w)
{
    cm_log(CM_ERROR, "store_error", "op=%s attempts=%d status=given_up_at_shutdown", owner_op_name(w), w->attempts);
    owner_finish(w, false, 0);
}

void store_settle_stop(struct store *s)
{
    s->settle_stop = true;
    settle_each_waiting(s, settle_give_up);
}

static void complete_pg_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct owner_op *w = arg;
    if (st == STORE_PG_OK) {
        long rows = PQntuples(pr);
        if (w->attempts > 1)
            cm_log(CM_INFO, "store_complete_retried", "attempts=%d rows=%ld", w->attempts, rows);
        /* Nothing is written to Redis here: most keys are never retried, and a retry that finds the in-flight
         * marker (or nothing) asks Postgres, whose replay puts the answer into Redis over that marker (claim_pg_cb).
         * The marker this claim placed stays until its lease runs out; it never answers anything by itself. */
        owner_finish(w, true, rows);
        return;
    }
    if (settle_retry_later(w, st))
        return;
    log_pg_failure("complete", st, msg);
    owner_finish(w, false, 0);
}

static void complete_send(struct owner_op *w)
{
    struct store *s = w->h.s;
    uint8_t tok[8], status[4], ret[8];
    be64(tok, w->token);
    be32(status, (uint32_t)w->status);
    be64(ret, w->arg_ms);
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
    store_pg_query(s->pg, S_COMPLETE, p, 7, 1, complete_pg_cb, w);
}

static void owner_pg_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg);

static void settle_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct owner_op *w = arg;
    (void)fd;
    (void)what;
    if (w->h.kind == OP_RELEASE || w->h.kind == OP_MARK_UNKNOWN) {
        w->attempts++;
        owner_send(w, w->h.kind == OP_RELEASE ? S_RELEASE : S_MARK_UNKNOWN, owner_pg_cb);
        return;
    }
    if (w->encode_failed) {
        cm_log(CM_ERROR, "store_error", "op=complete status=encode_failed");
        owner_finish(w, false, 0);
        return;
    }
    complete_send(w);
}

void store_complete(struct store *s, const struct store_id *id, uint64_t token, const struct cm_resp *resp,
                    uint64_t retention_ms, uint64_t retry_for_ms, store_done_cb cb, void *arg)
{
    struct owner_op *w = owner_new(s, OP_COMPLETE, id, token, cb, arg);
    w->arg_ms = retention_ms;
    w->status = resp->status;
    settle_init(w, retry_for_ms);
    struct cm_buf b;
    cm_buf_init(&b, RESP_BLOB_MAX);
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
    struct owner_op *w = arg;
    owner_finish(w, true, w->rows);
}

static void owner_pg_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct owner_op *w = arg;
    struct store *s = w->h.s;
    if (w->h.kind == OP_RENEW && st == STORE_PG_TRANSIENT && ++w->attempts < OWNER_ATTEMPTS) {
        /* rolled back (a deadlock, or another statement of its batch failed): nothing was done */
        owner_send(w, S_RENEW, owner_pg_cb);
        return;
    }
    if (st != STORE_PG_OK && w->h.kind != OP_RENEW && settle_retry_later(w, st))
        return;
    if (st != STORE_PG_OK) {
        log_pg_failure(owner_op_name(w), st, msg);
        if (w->h.kind == OP_RELEASE && st != STORE_PG_SQL_ERROR) {
            /* Nothing was executed under this claim (or the upstream asked
             * for a release): the release is not given up, it waits in the
             * list of claims in doubt, so the key never reads as an unknown
             * outcome while this process runs. */
            doubt_remember(s, w->route, w->scope, w->key, w->key_len, w->token, NULL, 0, 0, false);
        }
        owner_finish(w, false, 0);
        return;
    }
    long rows = cmd_rows(pr);
    if (w->h.kind == OP_RELEASE && rows > 0) {
        /* The answer waits for the marker's removal (bounded by redis_timeout): until it lands, a retry on
         * another loop or instance would find the in-flight marker and get 409 for a key that is free. */
        const char *argv[2] = {"DEL", w->rkey};
        size_t lens[2] = {3, strlen(w->rkey)};
        w->rows = rows;
        if (s->rd && store_rd_command(s->rd, released_cb, w, 2, argv, lens))
            return;
    }
    owner_finish(w, true, rows);
}

void owner_send(struct owner_op *w, enum stmt_id stmt, store_pg_cb cb)
{
    struct store *s = w->h.s;
    uint8_t tok[8], ms[8], ms2[8];
    be64(tok, w->token);
    be64(ms, w->arg_ms);
    be64(ms2, w->arg2_ms);
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
    struct owner_op *w = owner_new(s, OP_RENEW, id, token, cb, arg);
    w->arg_ms = lease_ms;
    /* Keep the marker (what the completion's cache write compares against)
     * alive as long as the lease. */
    redis_pexpire(s, w->rkey, lease_ms);
    owner_send(w, S_RENEW, owner_pg_cb);
}

void store_release(struct store *s, const struct store_id *id, uint64_t token, uint64_t retry_for_ms, store_done_cb cb,
                   void *arg)
{
    struct owner_op *w = owner_new(s, OP_RELEASE, id, token, cb, arg);
    settle_init(w, retry_for_ms);
    w->attempts = 1;
    owner_send(w, S_RELEASE, owner_pg_cb);
}

void store_mark_unknown(struct store *s, const struct store_id *id, uint64_t token, int64_t lease_ms,
                        uint64_t retry_for_ms, store_done_cb cb, void *arg)
{
    struct owner_op *w = owner_new(s, OP_MARK_UNKNOWN, id, token, cb, arg);
    w->arg_ms = (uint64_t)lease_ms; /* sent as an int8: a negative one stays negative */
    settle_init(w, retry_for_ms);
    w->attempts = 1;
    redis_pexpire(s, w->rkey, lease_ms > 0 ? (uint64_t)lease_ms : 0);
    owner_send(w, S_MARK_UNKNOWN, owner_pg_cb);
}
