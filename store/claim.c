/* claim.c - the claim path: the atomic Postgres claim beside Redis' SET NX GET, its verdict, and the claims in
 * doubt (an outcome the gateway does not know) released later, fenced by their token. Never an owner's later
 * operation (owner.c). */
#include "store/internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- claim */

/* A claim sends Redis' SET NX GET and the Postgres claim at once, so a new key waits for the slower of the two
 * rather than for both in turn. Postgres decides, except that a completed answer cached in Redis is answered as
 * soon as Redis has it (as before, without waiting for Postgres):
 *  - Postgres took the key (STORE_NEW): answered at once, whatever Redis says or is still to say;
 *  - Redis holds a completed answer, and nothing was answered yet: that answer (replay, or 422 for another
 *    fingerprint); a claim Postgres makes after it is not used, and is released, fenced by its token (below);
 *  - any other verdict of Postgres waits for Redis (bounded by redis_timeout): a completed answer there is answered
 *    instead (Postgres failed, say), and otherwise Redis tells whose marker is there, which the refill of a replay
 *    and the removal of our own marker need.
 * The op lives until both came back; store_destroy frees one still waiting (neither side calls back then). */

static void claim_pg(struct store_i_claim_op *c);

/* Frees c once neither Redis nor Postgres will call back with it. */
static void claim_done(struct store_i_claim_op *c)
{
    if (c->rd_pending || c->pg_pending)
        return;
    store_i_op_unlink(&c->h);
    store_i_op_free(&c->h);
}

/* The one answer of the claim. */
static void claim_answer(struct store_i_claim_op *c, struct store_claim_res *res)
{
    struct store *s = c->h.s;
    /* Our marker must not outlive a claim that did not take the key: it
     * would answer "in flight" for a record that is not ours. */
    if (c->marker_ours && res->verdict != STORE_NEW && res->verdict != STORE_REPLAY)
        store_i_redis_del(s, c->rkey);
    c->answered = true;
    c->cb(c->arg, res);
    cm_resp_free(&res->resp);
}

/* Postgres' verdict when Redis has answered (or was never asked): a replay refills Redis, only over the marker this
 * claim placed or saw (a purge meanwhile removed it). */
static void claim_answer_pg(struct store_i_claim_op *c, struct store_claim_res *res, const char *blob, size_t blob_len)
{
    if (res->verdict == STORE_REPLAY && blob != NULL && (c->marker_ours || c->seen_marker || c->seen_stale)) {
        uint8_t mine[STORE_MARKER_LEN];
        store_i_make_marker(mine, c->fp, c->token);
        /* Redis keeps it a margin less than Postgres does: a key Postgres may give again must not find it there. */
        uint64_t ttl =
            res->expires_in_ms > STORE_REDIS_EXPIRY_MARGIN_MS ? res->expires_in_ms - STORE_REDIS_EXPIRY_MARGIN_MS : 0;
        store_i_redis_cache(c->h.s, c->rkey, c->marker_ours ? mine : c->seen, c->seen_stale ? 0 : STORE_MARKER_LEN,
                            c->fp, blob, blob_len, ttl, c->sent_pg_ms + res->expires_in_ms, c->epoch);
    }
    claim_answer(c, res);
}

/* Postgres settled the claim with res (blob: a replay's stored answer, or NULL). */
static void claim_pg_settled(struct store_i_claim_op *c, struct store_claim_res *res, const char *blob, size_t blob_len)
{
    c->pg_pending = false;
    /* Released once settled: an attempt that may still commit and none that made the key ours (in doubt), or a
     * key Postgres gave after Redis answered (unused: nothing is forwarded under its token). */
    bool in_doubt = c->ndoubt > 0 && res->verdict != STORE_NEW, unused = c->answered && res->verdict == STORE_NEW;
    if (in_doubt || unused)
        store_i_doubt_remember(c->h.s, c->route, c->scope, c->key, c->key_len, c->token, c->doubt_pids, c->ndoubt,
                               c->doubt_sent_ms, unused);
    if (c->answered) {
        cm_resp_free(&res->resp);
        claim_done(c);
        return;
    }
    if (res->verdict == STORE_NEW || !c->rd_pending) {
        claim_answer_pg(c, res, blob, blob_len);
        claim_done(c);
        return;
    }
    /* Redis may still hold the answer, and tells whose marker is there: wait for it (the op owns res's answer). */
    c->held = true;
    c->held_res = *res;
    if (blob != NULL) {
        c->held_blob = cm_malloc(blob_len ? blob_len : 1);
        memcpy(c->held_blob, blob, blob_len);
        c->held_blob_len = blob_len;
    }
}

static void claim_fail(struct store_i_claim_op *c, const char *err)
{
    struct store_claim_res res;
    memset(&res, 0, sizeof res);
    cm_resp_init(&res.resp, 0);
    res.verdict = STORE_UNAVAILABLE;
    res.err = err;
    claim_pg_settled(c, &res, NULL, 0);
}

static void claim_pg_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store_i_claim_op *c = arg;
    struct store *s = c->h.s;
    if (st != STORE_PG_OK) {
        if (st != STORE_PG_UNAVAILABLE && st != STORE_PG_OVERLOAD)
            store_i_log_pg_failure("claim", st, msg);
        int pid = store_pg_cb_backend_pid(s->pg);
        if ((st == STORE_PG_TIMEOUT || st == STORE_PG_TRANSPORT) && pid > 0 && c->ndoubt < STORE_CLAIM_ATTEMPTS) {
            if (c->ndoubt == 0)
                c->doubt_sent_ms = c->sent_ms;
            c->doubt_pids[c->ndoubt++] = pid;
        }
        /* A broken link or a rolled-back statement: run it again. Should the
         * lost attempt have committed, the next one finds the record under
         * our own token and reports it as ours. */
        if ((st == STORE_PG_TRANSPORT || st == STORE_PG_TRANSIENT) && ++c->attempts < STORE_CLAIM_ATTEMPTS) {
            claim_pg(c);
            return;
        }
        claim_fail(c, store_i_pg_err_text(st));
        return;
    }
    const PGresult *read = store_pg_cb_then(s->pg); /* Citus: the read after the upsert */
    if (read && PQntuples(pr) == 0)
        pr = read;
    bool again = PQntuples(pr) == 0;
    if (!again && PQnfields(pr) >= 9) {
        const char *takeable = PQgetvalue(pr, 0, 7);
        again = !PQgetisnull(pr, 0, 7) && PQgetlength(pr, 0, 7) == 1 && takeable[0] != 0;
    }
    if (again) {
        /* The row changed after the statement's snapshot: run it again. */
        if (++c->attempts < STORE_CLAIM_ATTEMPTS) {
            claim_pg(c);
            return;
        }
        cm_log(CM_WARN, "store_error", "op=claim status=contention attempts=%d", c->attempts);
        claim_fail(c, "claim contention");
        return;
    }
    if (PQnfields(pr) < 11) {
        claim_fail(c, "unexpected claim result");
        return;
    }
    struct store_claim_res res;
    memset(&res, 0, sizeof res);
    cm_resp_init(&res.resp, 0);
    if (!PQgetisnull(pr, 0, 10)) /* the id of the request that claimed the record (SPEC 11) */
        snprintf(res.request_id, sizeof res.request_id, "%.*s", PQgetlength(pr, 0, 10), PQgetvalue(pr, 0, 10));
    const char *state = PQgetvalue(pr, 0, 0);
    int state_len = PQgetlength(pr, 0, 0);
#define STATE_IS(lit) (state_len == (int)sizeof(lit) - 1 && memcmp(state, lit, sizeof(lit) - 1) == 0)
    uint64_t token = (uint64_t)store_pg_get_i64(pr, 0, 1);
    if (STATE_IS("new") || (STATE_IS("in_flight") && token == c->token)) {
        res.verdict = STORE_NEW;
        res.token = token;
        /* the claim's created_at (binary timestamptz: microseconds since 2000-01-01), set by every claim */
        res.fence = PQnfields(pr) >= 10 ? (uint64_t)store_pg_get_i64(pr, 0, 9) : 0;
        claim_pg_settled(c, &res, NULL, 0);
        return;
    }
    const uint8_t *fp = (const uint8_t *)PQgetvalue(pr, 0, 2);
    if (PQgetisnull(pr, 0, 2) || PQgetlength(pr, 0, 2) != 32 || memcmp(fp, c->fp, 32) != 0) {
        res.verdict = STORE_MISMATCH;
        claim_pg_settled(c, &res, NULL, 0);
        return;
    }
    if (STATE_IS("completed")) {
        const char *blob = PQgetvalue(pr, 0, 4);
        size_t blob_len = (size_t)PQgetlength(pr, 0, 4);
        cm_resp_free(&res.resp);
        if (PQgetisnull(pr, 0, 4) || !cm_resp_decode(blob, blob_len, &res.resp)) {
            cm_log(CM_ERROR, "store_error", "op=claim status=corrupt_response route=%s", c->route);
            res.verdict = STORE_UNAVAILABLE;
            res.err = "stored response is corrupt";
            claim_pg_settled(c, &res, NULL, 0);
            return;
        }
        res.verdict = STORE_REPLAY;
        res.expires_in_ms = (uint64_t)store_pg_get_i64(pr, 0, 6);
        claim_pg_settled(c, &res, blob, blob_len); /* Redis missed it (flushed, evicted, down): refilled */
        return;
    }
    bool live = !PQgetisnull(pr, 0, 8) && PQgetlength(pr, 0, 8) == 1 && PQgetvalue(pr, 0, 8)[0] != 0;
    if (live) {
        res.verdict = STORE_IN_FLIGHT;
        int64_t rem = store_pg_get_i64(pr, 0, 5);
        res.lease_remaining_ms = rem > 0 ? (uint64_t)rem : 0;
    } else {
        res.verdict = STORE_UNKNOWN;
    }
    if (PQnfields(pr) >= 12 && !PQgetisnull(pr, 0, 11)) { /* the attempt's age, on Postgres's clock */
        int64_t age = store_pg_get_i64(pr, 0, 11);
        res.age_ms = age > 0 ? (uint64_t)age : 0;
    }
#undef STATE_IS
    claim_pg_settled(c, &res, NULL, 0);
}

static void claim_pg(struct store_i_claim_op *c)
{
    struct store *s = c->h.s;
    uint8_t tok[8], lease[8], ret[8];
    uint8_t takeover = c->takeover ? 1 : 0;
    store_i_be64(tok, c->token); /* one token for every attempt of this claim */
    store_i_be64(lease, c->lease_ms);
    store_i_be64(ret, c->retention_ms);
    struct store_pg_param p[9] = {
        {c->route, strlen(c->route), true},
        {c->scope, 32, true},
        {c->key, c->key_len, true},
        {c->fp, 32, true},
        {tok, 8, true},
        {lease, 8, true},
        {ret, 8, true},
        {&takeover, 1, true},
        {c->request_id, strlen(c->request_id), true},
    };
    c->sent_pg_ms = store_clock_ms();
    c->sent_ms = cm_now_ms();
    store_pg_query(s->pg, STORE_S_CLAIM, p, 9, 1, claim_pg_cb, c);
}

/* A completed answer cached in Redis ("G", format above) decides the claim when the purge epoch trusts it: true,
 * with res filled (a replay, or a mismatch for another fingerprint). One it may not trust (read before a purge
 * this process heard of, or while it cannot know: its listener is not current), or of the older forms "C"/"E"
 * (no epoch), is marked seen_stale: Postgres decides, and a replay's refill replaces it. */
static bool claim_from_redis(struct store_i_claim_op *c, const redisReply *r, struct store_claim_res *res)
{
    const uint8_t *v = (const uint8_t *)r->str;
    if (v[0] == 'C' || v[0] == 'E' || v[0] == 'G')
        c->seen_stale = true;
    if (v[0] != 'G' || r->len < STORE_RVAL_HEAD || !store_i_epoch_trusts(c->h.s, store_i_rd_be64(v + 41)))
        return false;
    c->seen_stale = false;
    memset(res, 0, sizeof *res);
    res->from_redis = true;
    /* what is left of the record, less a margin for the clocks of the hosts that wrote and read it */
    uint64_t exp = store_i_rd_be64(v + 33), now = store_clock_ms(); /* both on Postgres's clock (SPEC 8, one clock) */
    res->expires_in_ms = exp > now + STORE_REDIS_EXPIRY_MARGIN_MS ? exp - now - STORE_REDIS_EXPIRY_MARGIN_MS : 0;
    if (memcmp(v + 1, c->fp, 32) != 0) {
        cm_resp_init(&res->resp, 0);
        res->verdict = STORE_MISMATCH;
        return true;
    }
    if (cm_resp_decode(v + STORE_RVAL_HEAD, r->len - STORE_RVAL_HEAD, &res->resp)) {
        res->verdict = STORE_REPLAY;
        return true;
    }
    cm_resp_free(&res->resp);
    return false;
}

static void claim_redis_cb(void *arg, const struct redisReply *reply)
{
    struct store_i_claim_op *c = arg;
    const redisReply *r = reply;
    c->rd_pending = false;
    struct store_claim_res res;
    if (r && r->type == REDIS_REPLY_NIL) {
        c->marker_ours = true; /* the marker is ours */
    } else if (r && r->type == REDIS_REPLY_STRING && r->len >= 33) {
        /* Postgres' own verdict, when it has one, stands: a Redis answer takes only the place of none yet, of a
         * failure, or of the same replay (Redis never overrides Postgres). */
        bool pg_decided = c->held && c->held_res.verdict != STORE_UNAVAILABLE && c->held_res.verdict != STORE_REPLAY;
        if (pg_decided) {
            if (r->str[0] == 'C' || r->str[0] == 'E' || r->str[0] == 'G')
                c->seen_stale = true; /* a replay's refill may replace it (if older) */
        } else if (!c->answered && claim_from_redis(c, r, &res)) {
            if (c->held) { /* Postgres failed: the answer takes its place */
                cm_resp_free(&c->held_res.resp);
                c->held = false;
            }
            claim_answer(c, &res);
            claim_done(c);
            return;
        }
        if (r->str[0] == 'F' && r->len == STORE_MARKER_LEN) {
            /* Somebody's in-flight marker. It never answers 409 by itself:
             * one left by a SET NX that timed out, a claim that failed or a
             * completion that could not be written would refuse a free key
             * for up to a lease. Postgres decides; a refill compares to it. */
            memcpy(c->seen, r->str, STORE_MARKER_LEN);
            c->seen_marker = true;
        }
    }
    /* Error, timeout, a marker, anything unexpected: Postgres decides. */
    if (c->held) {
        c->held = false;
        claim_answer_pg(c, &c->held_res, c->held_blob, c->held_blob_len);
    }
    claim_done(c);
}

void store_claim(struct store *s, const struct store_claim_req *req, store_claim_cb cb, void *arg)
{
    struct store_i_claim_op *c = cm_calloc(1, sizeof *c);
    store_i_op_link(s, &c->h, STORE_OP_CLAIM);
    c->route = cm_strdup(req->id.route);
    c->key = cm_strndup(req->id.key, req->id.key_len);
    c->key_len = req->id.key_len;
    c->route_index = req->route_index;
    memcpy(c->scope, req->id.scope, 32);
    memcpy(c->fp, req->fp, 32);
    c->lease_ms = req->lease_ms ? req->lease_ms : 1;
    c->retention_ms = req->retention_ms;
    c->takeover = req->takeover_unknown;
    snprintf(c->request_id, sizeof c->request_id, "%s", req->request_id ? req->request_id : "");
    c->token = cm_random_token();
    c->epoch = store_i_epoch_known(s);
    c->cb = cb;
    c->arg = arg;
    store_i_redis_key(c->route, c->scope, c->key, c->key_len, c->rkey);
    if (s->rd) {
        /* SET NX GET: places our marker, or returns what is there (Redis >= 7). */
        uint8_t marker[STORE_MARKER_LEN];
        store_i_make_marker(marker, c->fp, c->token);
        char px[24];
        snprintf(px, sizeof px, "%llu", (unsigned long long)c->lease_ms);
        const char *argv[7] = {"SET", c->rkey, (const char *)marker, "NX", "PX", px, "GET"};
        size_t lens[7] = {3, STORE_RKEY_LEN, sizeof marker, 2, 2, strlen(px), 3};
        c->rd_pending = store_rd_command(s->rd, claim_redis_cb, c, 7, argv, lens);
    }
    c->pg_pending = true;
    claim_pg(c);
}

/* ---- claims in doubt */

void store_i_doubt_free(struct store_i_doubt *d)
{
    free(d->route);
    free(d->key);
    free(d);
}

void store_i_doubt_schedule(struct store *s, uint64_t ms)
{
    if (!s->doubt_head || s->doubt_busy)
        return;
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    evtimer_add(s->doubt_timer, &tv);
}

static void doubt_push(struct store *s, struct store_i_doubt *d)
{
    d->next = NULL;
    if (s->doubt_tail)
        s->doubt_tail->next = d;
    else
        s->doubt_head = d;
    s->doubt_tail = d;
}

struct store_i_doubt *store_i_doubt_pop(struct store *s)
{
    struct store_i_doubt *d = s->doubt_head;
    if (d) {
        s->doubt_head = d->next;
        if (!s->doubt_head)
            s->doubt_tail = NULL;
        d->next = NULL;
    }
    return d;
}

/* Remembers (id, token) for release; pids: server processes that may still
 * commit the claim (none: nothing can commit it any more, e.g. a release
 * that could not be written). At STORE_DOUBT_MAX the oldest entry not being worked
 * on is dropped: that claim stays in flight until its lease lapses, then
 * reads as an unknown outcome (idemgate_stuck_processing counts it after 5
 * minutes); the log line says so. unused: a claim Postgres made after Redis
 * had answered its request (claim_pg_settled), logged as claim_unused. */
void store_i_doubt_remember(struct store *s, const char *route, const uint8_t scope[32], const char *key,
                            size_t key_len, uint64_t token, const int *pids, int npids, uint64_t sent_ms, bool unused)
{
    if (s->ndoubt >= STORE_DOUBT_MAX) {
        struct store_i_doubt *old = s->doubt_head;
        if (s->doubt_busy) { /* the head's query is running: drop the one after it */
            old = s->doubt_head->next;
            s->doubt_head->next = old->next;
            if (s->doubt_tail == old)
                s->doubt_tail = s->doubt_head;
        } else {
            (void)store_i_doubt_pop(s);
        }
        cm_log(CM_ERROR, "claim_in_doubt_dropped", "route=%s limit=%d effect=stays_in_flight_then_unknown", old->route,
               STORE_DOUBT_MAX);
        store_i_doubt_free(old);
        s->ndoubt--;
        cm_metric_claims_in_doubt(-1);
    }
    struct store_i_doubt *d = cm_calloc(1, sizeof *d);
    d->route = cm_strdup(route);
    d->key = cm_strndup(key, key_len);
    d->key_len = key_len;
    memcpy(d->scope, scope, 32);
    d->token = token;
    for (int i = 0; i < npids && i < STORE_CLAIM_ATTEMPTS; i++)
        d->pids[d->npids++] = pids[i];
    d->sent_ms = sent_ms;
    doubt_push(s, d);
    s->ndoubt++;
    cm_metric_claims_in_doubt(1);
    if (unused) /* Redis answered the request before Postgres gave us the key */
        cm_log(CM_INFO, "claim_unused", "route=%s processes=%d in_doubt=%zu", route, d->npids, s->ndoubt);
    else
        cm_log(CM_WARN, "claim_in_doubt", "route=%s processes=%d in_doubt=%zu", route, d->npids, s->ndoubt);
    store_i_doubt_schedule(s, s->doubt_backoff_ms);
}

/* Postgres failed: try again later, with backoff. */
static void doubt_retry(struct store *s)
{
    s->doubt_busy = false;
    uint64_t ms = s->doubt_backoff_ms;
    s->doubt_backoff_ms = ms * 2 > STORE_DOUBT_BACKOFF_MAX_MS ? STORE_DOUBT_BACKOFF_MAX_MS : ms * 2;
    store_i_doubt_schedule(s, ms);
}

static void doubt_released_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store *s = arg;
    if (st != STORE_PG_OK) {
        if (st == STORE_PG_SQL_ERROR)
            store_i_log_pg_failure("release_in_doubt", st, msg);
        doubt_retry(s);
        return;
    }
    struct store_i_doubt *d = store_i_doubt_pop(s);
    s->ndoubt--;
    cm_metric_claims_in_doubt(-1);
    cm_log(CM_INFO, "claim_in_doubt_released", "route=%s rows=%ld tries=%d in_doubt=%zu", d->route,
           store_i_cmd_rows(pr), d->tries, s->ndoubt);
    store_i_doubt_free(d);
    s->doubt_busy = false;
    s->doubt_backoff_ms = STORE_DOUBT_BACKOFF_MIN_MS;
    store_i_doubt_schedule(s, 0);
}

static void doubt_release(struct store *s, struct store_i_doubt *d)
{
    uint8_t tok[8];
    store_i_be64(tok, d->token);
    struct store_pg_param p[4] = {
        {d->route, strlen(d->route), true},
        {d->scope, 32, true},
        {d->key, d->key_len, true},
        {tok, 8, true},
    };
    store_pg_query(s->pg, STORE_S_DOUBT_RELEASE, p, 4, 1, doubt_released_cb, s);
}

static void doubt_alive_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store *s = arg;
    struct store_i_doubt *d = s->doubt_head;
    if (st != STORE_PG_OK) {
        if (st == STORE_PG_SQL_ERROR)
            store_i_log_pg_failure("doubt_alive", st, msg);
        doubt_retry(s);
        return;
    }
    if (PQntuples(pr) > 0) {
        /* A process that may still commit it lives (paused, or slow): it
         * was asked to end. The others go first meanwhile. */
        if (d->tries == 1)
            cm_log(CM_WARN, "claim_in_doubt_waiting", "route=%s processes=%d", d->route, PQntuples(pr));
        if (s->doubt_head != s->doubt_tail)
            doubt_push(s, store_i_doubt_pop(s));
        doubt_retry(s);
        return;
    }
    doubt_release(s, d);
}

void store_i_doubt_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct store *s = arg;
    (void)fd;
    (void)what;
    struct store_i_doubt *d = s->doubt_head;
    if (!d || s->doubt_busy)
        return;
    s->doubt_busy = true;
    d->tries++;
    if (d->npids == 0) {
        doubt_release(s, d);
        return;
    }
    char arr[STORE_CLAIM_ATTEMPTS * 12 + 4];
    size_t off = 0;
    arr[off++] = '{';
    for (int i = 0; i < d->npids; i++)
        off += (size_t)snprintf(arr + off, sizeof arr - off, "%s%d", i ? "," : "", d->pids[i]);
    snprintf(arr + off, sizeof arr - off, "}");
    uint8_t since[8];
    uint64_t now = cm_now_ms();
    store_i_be64(since, now > d->sent_ms ? now - d->sent_ms : 0);
    struct store_pg_param p[2] = {{arr, strlen(arr), false}, {since, 8, true}};
    store_pg_query(s->pg, STORE_S_DOUBT_ALIVE, p, 2, 1, doubt_alive_cb, s);
}
