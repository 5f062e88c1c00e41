/* ops.c - what the store's operations share: the list of operations in flight (freed by store_destroy), the Redis
 * key, marker and answer helpers, the purge epoch, Postgres's clock as this process reads it, Postgres failure
 * logging. Never sends a statement of its own but the clock's reading. */
#include "store/internal.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

void store_i_op_link(struct store *s, struct store_i_op *o, enum store_i_op_kind kind)
{
    o->s = s;
    o->kind = kind;
    o->prev = NULL;
    o->next = s->ops;
    if (s->ops)
        s->ops->prev = o;
    s->ops = o;
}

void store_i_op_unlink(struct store_i_op *o)
{
    struct store *s = o->s;
    if (o->prev)
        o->prev->next = o->next;
    else
        s->ops = o->next;
    if (o->next)
        o->next->prev = o->prev;
    o->prev = o->next = NULL;
}

void store_i_op_free(struct store_i_op *o)
{
    switch (o->kind) {
    case STORE_OP_CLAIM: {
        struct store_i_claim_op *c = (struct store_i_claim_op *)o;
        free(c->route);
        free(c->key);
        if (c->held)
            cm_resp_free(&c->held_res.resp);
        free(c->held_blob);
        break;
    }
    case STORE_OP_COMPLETE:
    case STORE_OP_RENEW:
    case STORE_OP_RELEASE:
    case STORE_OP_MARK_UNKNOWN:
    case STORE_OP_PROBE_TAKE: {
        struct store_i_owner_op *w = (struct store_i_owner_op *)o;
        if (w->timer)
            event_free(w->timer);
        free(w->route);
        free(w->key);
        free(w->blob);
        break;
    }
    case STORE_OP_ADMIN: {
        struct store_i_admin_op *a = (struct store_i_admin_op *)o;
        free(a->route);
        free(a->key);
        free(a->json);
        break;
    }
    case STORE_OP_PROBE_LIST:
        break;
    }
    free(o);
}

/* ---- helpers */

void store_i_be64(uint8_t out[8], uint64_t v)
{
    for (int i = 7; i >= 0; i--) {
        out[i] = (uint8_t)(v & 0xff);
        v >>= 8;
    }
}

uint64_t store_i_rd_be64(const uint8_t in[8])
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | in[i];
    return v;
}

void store_i_be32(uint8_t out[4], uint32_t v)
{
    out[0] = (uint8_t)(v >> 24);
    out[1] = (uint8_t)(v >> 16);
    out[2] = (uint8_t)(v >> 8);
    out[3] = (uint8_t)v;
}

/* "idg:" + hex(SHA-256(route NUL scope NUL key)): no raw key or scope in Redis. */
void store_i_redis_key(const char *route, const uint8_t scope[32], const char *key, size_t key_len,
                       char out[STORE_RKEY_LEN + 1])
{
    struct cm_sha256 h;
    uint8_t d[32];
    cm_sha256_init(&h);
    cm_sha256_update(&h, route, strlen(route));
    cm_sha256_update(&h, "", 1);
    cm_sha256_update(&h, scope, 32);
    cm_sha256_update(&h, "", 1);
    cm_sha256_update(&h, key, key_len);
    cm_sha256_final(&h, d);
    memcpy(out, "idg:", 4);
    cm_hex(d, 32, out + 4);
    out[STORE_RKEY_LEN] = '\0';
}

const char *store_i_pg_err_text(enum store_pg_status st)
{
    switch (st) {
    case STORE_PG_OK:
        return "ok";
    case STORE_PG_SQL_ERROR:
        return "postgres error";
    case STORE_PG_TRANSPORT:
        return "postgres connection lost";
    case STORE_PG_TRANSIENT:
        return "postgres transient error";
    case STORE_PG_TIMEOUT:
        return "postgres timeout";
    case STORE_PG_UNAVAILABLE:
        return "postgres unavailable";
    case STORE_PG_OVERLOAD:
        return "postgres queue full";
    }
    return "postgres error";
}

void store_i_log_pg_failure(const char *what, enum store_pg_status st, const char *msg)
{
    char q[512];
    cm_log(st == STORE_PG_SQL_ERROR ? CM_ERROR : CM_WARN, "store_error", "op=%s status=%s error=%s", what,
           store_pg_status_name(st), cm_log_quote(q, sizeof q, msg ? msg : ""));
}

long store_i_cmd_rows(const PGresult *res)
{
    const char *t = PQcmdTuples((PGresult *)res);
    if (!t || !*t)
        return PQntuples(res);
    char *end = NULL;
    long v = strtol(t, &end, 10);
    return (end && *end == '\0' && v >= 0) ? v : 0;
}

static void redis_fire(struct store *s, int argc, const char **argv, const size_t *lens)
{
    if (s->rd)
        (void)store_rd_command(s->rd, NULL, NULL, argc, argv, lens);
}

void store_i_redis_del(struct store *s, const char *rkey)
{
    const char *argv[2] = {"DEL", rkey};
    size_t lens[2] = {3, strlen(rkey)};
    redis_fire(s, 2, argv, lens);
}

void store_i_redis_pexpire(struct store *s, const char *rkey, uint64_t ms)
{
    char px[24];
    snprintf(px, sizeof px, "%llu", (unsigned long long)(ms ? ms : 1));
    const char *argv[3] = {"PEXPIRE", rkey, px};
    size_t lens[3] = {7, strlen(rkey), strlen(px)};
    redis_fire(s, 3, argv, lens);
}

/* The in-flight marker a claim places with SET NX: "F" + fingerprint +
 * token. It never answers anything by itself (Postgres decides every
 * verdict but a cached replay); it is what a cache write compares against. */
void store_i_make_marker(uint8_t out[STORE_MARKER_LEN], const uint8_t fp[32], uint64_t token)
{
    out[0] = 'F';
    memcpy(out + 1, fp, 32);
    store_i_be64(out + 33, token);
}

/* Writes the value only while the key still holds what the writer saw:
 * an admin purge that deleted the record and then the Redis key in between
 * (or anybody else who changed it) wins, and the purged answer is not put
 * back. An answer of an older epoch (or of the older forms "C"/"E", which
 * carry none) is replaced too: it may not be used any more, and the answer
 * just read from Postgres is the record's. ARGV[4]: the new value's epoch. */
static const char redis_cas_lua[] =
    "local v = redis.call('GET', KEYS[1]) local put = v == ARGV[1]"
    " if not put and v then local t = string.sub(v, 1, 1)"
    " if t == 'C' or t == 'E' then put = true"
    " elseif t == 'G' and #v >= 49 then local e = 0"
    " for i = 42, 49 do e = e * 256 + string.byte(v, i) end put = e < tonumber(ARGV[4]) end end"
    " if put then return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) else return 0 end";

/* Caches a completed answer, fire-and-forget (format above; the expiry is never later than Postgres' expires_at:
 * taken from before the statement that read it), for ttl_ms, if the key still holds expect (expect_len bytes; 0: no
 * marker) or an answer of an epoch older than epoch. */
void store_i_redis_cache(struct store *s, const char *rkey, const void *expect, size_t expect_len, const uint8_t fp[32],
                         const void *blob, size_t blob_len, uint64_t ttl_ms, uint64_t expiry_wall_ms, uint64_t epoch)
{
    if (!s->rd || ttl_ms == 0 || !store_rd_up(s->rd))
        return;
    size_t vlen = STORE_RVAL_HEAD + blob_len;
    char *val = cm_malloc(vlen);
    val[0] = 'G';
    memcpy(val + 1, fp, 32);
    store_i_be64((uint8_t *)val + 33, expiry_wall_ms);
    store_i_be64((uint8_t *)val + 41, epoch);
    memcpy(val + STORE_RVAL_HEAD, blob, blob_len);
    char px[24], ep[24];
    snprintf(px, sizeof px, "%llu", (unsigned long long)ttl_ms);
    snprintf(ep, sizeof ep, "%llu", (unsigned long long)epoch);
    const char *argv[8] = {"EVAL", redis_cas_lua, "1", rkey, expect_len ? expect : "", val, px, ep};
    size_t lens[8] = {4, sizeof redis_cas_lua - 1, 1, strlen(rkey), expect_len, vlen, strlen(px), strlen(ep)};
    redis_fire(s, 8, argv, lens);
    free(val);
}

/* ---- the purge epoch (store.h) */

struct store_epoch *store_epoch_create(void)
{
    struct store_epoch *e = cm_calloc(1, sizeof *e);
    atomic_init(&e->known, 0);
    atomic_init(&e->current, false);
    return e;
}

void store_epoch_destroy(struct store_epoch *e)
{
    free(e);
}

void store_epoch_heard(struct store_epoch *e, uint64_t epoch)
{
    if (!e)
        return;
    uint64_t cur = atomic_load(&e->known);
    while (cur < epoch && !atomic_compare_exchange_weak(&e->known, &cur, epoch)) {
    }
}

void store_epoch_set_current(struct store_epoch *e, bool current)
{
    if (e)
        atomic_store(&e->current, current);
}

void store_set_epoch(struct store *s, struct store_epoch *e)
{
    s->epoch = e;
}

uint64_t store_i_epoch_known(const struct store *s)
{
    return s->epoch ? atomic_load(&s->epoch->known) : 0;
}

/* An answer of this epoch may answer for Postgres: this process has heard of every purge until now, and none came
 * after the answer was read. */
bool store_i_epoch_trusts(const struct store *s, uint64_t epoch)
{
    return s->epoch && atomic_load(&s->epoch->current) && epoch >= atomic_load(&s->epoch->known);
}

/* ---- Postgres's clock, as this process reads it (SPEC 8, one clock) */

/* Postgres's wall clock less this process's monotonic one (ms), from the latest reading of any loop. */
static _Atomic int64_t pg_clock_offset;
static atomic_bool pg_clock_known;

uint64_t store_clock_ms(void)
{
    if (!atomic_load_explicit(&pg_clock_known, memory_order_acquire))
        return cm_wall_ms();
    return (uint64_t)((int64_t)cm_now_ms() + atomic_load_explicit(&pg_clock_offset, memory_order_relaxed));
}

void store_i_clock_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store *s = arg;
    (void)msg;
    s->clocking = false;
    uint64_t now = cm_now_ms();
    if (st != STORE_PG_OK || PQntuples(pr) != 1 || now - s->clock_sent_ms > STORE_CLOCK_MAX_RTT_MS)
        return; /* read again at the next probe tick */
    int64_t pg_ms = strtoll(PQgetvalue(pr, 0, 0), NULL, 10);
    if (pg_ms <= 0)
        return;
    /* the server read its clock somewhere in the round trip: its middle is off by at most half of it */
    int64_t mid = (int64_t)(s->clock_sent_ms + (now - s->clock_sent_ms) / 2);
    atomic_store_explicit(&pg_clock_offset, pg_ms - mid, memory_order_relaxed);
    atomic_store_explicit(&pg_clock_known, true, memory_order_release);
    s->clock_read_ms = now;
}
