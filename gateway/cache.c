/* cache.c - the in-process replay cache: a chained hash on (route, key) whose entries carry the scope hash, the
 * fingerprint, the expiry and the answer as its stored blob; CLOCK eviction over a slot array; one rwlock. It never
 * asks the store or the loop: fills come from the pipeline. */
#include "gateway/cache.h"

#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/metrics.h"
#include "gateway/answer.h"
#include "gateway/ctx.h"
#include "gateway/gateway.h"
#include "store/store.h"

/* Entries at most this many times larger than max_bytes' share are refused: one answer must not flush the rest. */
#define ENTRY_MAX_SHARE 8
/* The blob of the largest answer cached: an entry is at most max_bytes / ENTRY_MAX_SHARE anyway. */
#define BLOB_MAX ((size_t)64 * 1024 * 1024)
/* The share (percent) of max_entries and max_bytes that replayed entries may keep against new fills. */
#define HOT_SHARE 80
/* What a prepared answer (below) adds to an entry, counted from the first fill: its record and its copy of each
 * header. */
#define PREP_BYTES     256
#define PREP_HDR_BYTES 64

struct prep {
    int status;
    struct cm_hdrs hdrs;
    size_t body_len; /* the blob's last body_len bytes */
};

struct entry {
    struct entry *next; /* bucket chain */
    uint64_t hash;
    uint32_t slot;
    atomic_bool ref; /* CLOCK: set by a hit, cleared by the hand */
    atomic_bool hot; /* replayed at least once: protected from the fills of new keys (below) */
    uint64_t expires_ms;
    size_t bytes; /* what it counts against max_bytes */
    uint8_t scope[32];
    uint8_t fp[32];
    char *route; /* points into data */
    char *key;   /* points into data */
    size_t key_len;
    char *blob; /* cm_resp_encode of the answer, points into data */
    size_t blob_len;
    /* The answer decoded once, at the entry's first replay: every connection that replays it gets a response of
     * its own (an MHD response's headers are shared by every connection it is queued on, and each answer carries
     * its request's id) over the blob's tail as its body, nothing copied; each such response holds a reference
     * (refs) until libmicrohttpd is done with it, the cache holds one while the entry is in it, and the last one
     * frees the entry. NULL until built, or for an answer that must not be shared (prep_refused). */
    _Atomic(struct prep *) prep;
    atomic_bool prep_refused;
    atomic_uint refs;
    char data[]; /* route NUL key NUL blob */
};

struct gw_cache {
    pthread_rwlock_t lock;
    uint64_t max_bytes;
    uint32_t max_entries;
    struct entry **buckets;
    size_t nbuckets;      /* a power of two */
    struct entry **slots; /* max_entries: the CLOCK ring */
    uint32_t *free_slots; /* stack of free slot numbers */
    uint32_t nfree;
    uint32_t hand;
    size_t entries;
    size_t bytes;
    /* Entries that were replayed at least once, and their bytes. A flood of new keys (each one fills the cache)
     * evicts only entries never replayed while the hot ones take at most HOT_SHARE of either bound, so that the
     * keys clients do retry stay (segmented LRU's protected part, as in 2Q/SLRU). */
    _Atomic size_t hot_entries;
    _Atomic size_t hot_bytes;
    bool online;                   /* under the write lock; read under either */
    _Atomic uint64_t last_drop_ms; /* cm_now_ms of the last purge or release heard of (0: none) */
    _Atomic uint64_t epoch;        /* moves on (under the write lock) with every invalidation or listener change */
    pthread_mutex_t prep_mu;       /* one builder of an entry's prepared answer at a time (under the read lock) */
};

/* FNV-1a over route NUL key: both a purge (all scopes) and a look-up find the same bucket. */
static uint64_t hash_of(const char *route, const char *key, size_t key_len)
{
    return cm_fnv1a(cm_fnv1a(CM_FNV1A_INIT, route, strlen(route) + 1), key, key_len);
}

static void publish(const struct gw_cache *c)
{
    cm_metric_replay_cache_set((int64_t)c->entries, (int64_t)c->bytes);
}

struct gw_cache *gw_cache_create(uint64_t max_bytes, uint32_t max_entries)
{
    if (max_bytes == 0 || max_entries == 0)
        return NULL;
    struct gw_cache *c = cm_calloc(1, sizeof *c);
    pthread_rwlock_init(&c->lock, NULL);
    pthread_mutex_init(&c->prep_mu, NULL);
    c->max_bytes = max_bytes;
    c->max_entries = max_entries;
    c->nbuckets = 16;
    while (c->nbuckets < max_entries && c->nbuckets < ((size_t)1 << 24))
        c->nbuckets <<= 1;
    c->buckets = cm_calloc(c->nbuckets, sizeof *c->buckets);
    c->slots = cm_calloc(max_entries, sizeof *c->slots);
    c->free_slots = cm_calloc(max_entries, sizeof *c->free_slots);
    for (uint32_t i = 0; i < max_entries; i++)
        c->free_slots[i] = max_entries - 1 - i;
    c->nfree = max_entries;
    cm_metric_replay_cache_online(false);
    publish(c);
    return c;
}

/* Gives one reference to e back: the last one frees it (any thread; MHD calls it when done with a response). */
static void entry_unref(void *cls)
{
    struct entry *e = cls;
    if (atomic_fetch_sub(&e->refs, 1) != 1)
        return;
    struct prep *p = atomic_load(&e->prep);
    if (p) {
        cm_hdrs_free(&p->hdrs);
        free(p);
    }
    free(e);
}

/* Write lock held: unlinks e from its bucket and slot and drops the cache's reference to it. */
static void entry_remove(struct gw_cache *c, struct entry *e)
{
    struct entry **pp = &c->buckets[e->hash & (c->nbuckets - 1)];
    while (*pp && *pp != e)
        pp = &(*pp)->next;
    if (*pp)
        *pp = e->next;
    c->slots[e->slot] = NULL;
    c->free_slots[c->nfree++] = e->slot;
    if (atomic_load(&e->hot)) {
        atomic_fetch_sub(&c->hot_entries, 1);
        atomic_fetch_sub(&c->hot_bytes, e->bytes);
    }
    c->entries--;
    c->bytes -= e->bytes;
    entry_unref(e); /* the cache's reference */
}

/* Read lock held: the entry's prepared answer, built now if it is the first replay; NULL when the answer must
 * not be shared: it carries Connection: close (gateway/front.c adds it to 400, 413 and 431) or cannot be built. */
static struct prep *prepared(struct gw_cache *c, struct entry *e)
{
    struct prep *p = atomic_load(&e->prep);
    if (p || atomic_load(&e->prep_refused))
        return p;
    pthread_mutex_lock(&c->prep_mu);
    p = atomic_load(&e->prep);
    if (!p && !atomic_load(&e->prep_refused)) {
        struct cm_resp r;
        if (cm_resp_decode(e->blob, e->blob_len, &r) && r.status != 400 && r.status != 413 && r.status != 431) {
            p = cm_malloc(sizeof *p);
            p->status = r.status;
            p->hdrs = r.hdrs;
            p->body_len = r.body.len;
            cm_hdrs_init(&r.hdrs);
            atomic_store(&e->prep, p);
        } else {
            atomic_store(&e->prep_refused, true);
        }
        cm_resp_free(&r);
    }
    pthread_mutex_unlock(&c->prep_mu);
    return p;
}

/* Read lock held, e's prepared answer p: queues a response of its own on conn, with the job's request id (*queued_ok:
 * MHD_queue_response's success); the answer's status, size and original request id are noted on the job (its
 * access line). False when no response could be made (nothing queued). */
static bool queue_prepared(struct entry *e, const struct prep *p, struct MHD_Connection *conn, struct gw_job *job,
                           bool *queued_ok)
{
    atomic_fetch_add(&e->refs, 1); /* the response's, given back by entry_unref when MHD is done with it */
    struct MHD_Response *resp = MHD_create_response_from_buffer_with_free_callback_cls(
        p->body_len, p->body_len ? e->blob + e->blob_len - p->body_len : "", entry_unref, e);
    if (!resp) {
        entry_unref(e);
        return false;
    }
    const char *rid_name = job->conf->request_id_header;
    /* as gateway/front.c answers the same record */
    gw_answer_headers(resp, &p->hdrs, true, rid_name, job->request_id);
    *queued_ok = MHD_queue_response(conn, (unsigned)p->status, resp) == MHD_YES;
    MHD_destroy_response(resp);
    job->status = p->status;
    job->replayed = true;
    job->bytes_out = p->body_len;
    const char *orig = cm_hdrs_get(&p->hdrs, rid_name);
    if (orig)
        snprintf(job->orig_request_id, sizeof job->orig_request_id, "%s", orig);
    return true;
}

/* Write lock held. */
static void flush_locked(struct gw_cache *c)
{
    for (uint32_t i = 0; i < c->max_entries; i++)
        if (c->slots[i])
            entry_remove(c, c->slots[i]);
}

void gw_cache_destroy(struct gw_cache *c)
{
    if (!c)
        return;
    flush_locked(c);
    publish(c);
    free(c->buckets);
    free(c->slots);
    free(c->free_slots);
    pthread_mutex_destroy(&c->prep_mu);
    pthread_rwlock_destroy(&c->lock);
    free(c);
}

void gw_cache_set_online(struct gw_cache *c, bool online, bool keep)
{
    if (!c)
        return;
    pthread_rwlock_wrlock(&c->lock);
    if (!online && !keep)
        flush_locked(c);
    c->online = online;
    atomic_fetch_add(&c->epoch, 1);
    publish(c);
    pthread_rwlock_unlock(&c->lock);
    cm_metric_replay_cache_online(online);
}

uint64_t gw_cache_epoch(struct gw_cache *c)
{
    return c ? atomic_load(&c->epoch) : 0;
}

/* Either lock held. */
static struct entry *find(struct gw_cache *c, uint64_t h, const char *route, const uint8_t scope[32], const char *key,
                          size_t key_len)
{
    for (struct entry *e = c->buckets[h & (c->nbuckets - 1)]; e; e = e->next)
        if (e->hash == h && e->key_len == key_len && memcmp(e->key, key, key_len) == 0 &&
            memcmp(e->scope, scope, 32) == 0 && strcmp(e->route, route) == 0)
            return e;
    return NULL;
}

enum gw_cache_verdict gw_cache_get(struct gw_cache *c, const char *route, const uint8_t scope[32], const char *key,
                                   size_t key_len, const uint8_t fp[32], uint64_t now_ms, struct cm_resp *out)
{
    return gw_cache_queue(c, route, scope, key, key_len, fp, now_ms, NULL, NULL, NULL, out);
}

enum gw_cache_verdict gw_cache_queue(struct gw_cache *c, const char *route, const uint8_t scope[32], const char *key,
                                     size_t key_len, const uint8_t fp[32], uint64_t now_ms, struct MHD_Connection *conn,
                                     struct gw_job *job, bool *queued_ok, struct cm_resp *out)
{
    if (!c)
        return GW_CACHE_MISS;
    uint64_t h = hash_of(route, key, key_len);
    enum gw_cache_verdict v = GW_CACHE_MISS;
    pthread_rwlock_rdlock(&c->lock);
    struct entry *e = c->online ? find(c, h, route, scope, key, key_len) : NULL;
    if (e && now_ms < e->expires_ms) {
        struct prep *p = NULL;
        if (memcmp(e->fp, fp, 32) != 0) {
            v = GW_CACHE_MISMATCH;
        } else if (conn && job && (p = prepared(c, e)) != NULL && queue_prepared(e, p, conn, job, queued_ok)) {
            /* under the read lock: the response holds its own reference before an eviction can drop the cache's */
            v = GW_CACHE_QUEUED;
        } else if (cm_resp_decode(e->blob, e->blob_len, out)) {
            v = GW_CACHE_REPLAY;
        } else {
            cm_resp_free(out); /* cannot happen: the blob was encoded here */
        }
        atomic_store_explicit(&e->ref, true, memory_order_relaxed);
        bool cold = false;
        if ((v == GW_CACHE_REPLAY || v == GW_CACHE_QUEUED) && atomic_compare_exchange_strong(&e->hot, &cold, true)) {
            atomic_fetch_add(&c->hot_entries, 1);
            atomic_fetch_add(&c->hot_bytes, e->bytes);
        }
    }
    pthread_rwlock_unlock(&c->lock);
    cm_metric_replay_cache_lookup(v != GW_CACHE_MISS);
    return v;
}

/* Write lock held: whether the hot entries are over their share, so that they compete among themselves. */
static bool hot_over(const struct gw_cache *c)
{
    return atomic_load(&c->hot_entries) * 100 > (size_t)c->max_entries * HOT_SHARE ||
           atomic_load(&c->hot_bytes) * 100 > c->max_bytes * HOT_SHARE;
}

/* Write lock held: frees one slot (CLOCK: an expired entry, or one unreferenced since the hand last passed; a hot
 * entry only while the hot ones are over their share, or with force). Returns false when a turn found none.
 * Bounded: two turns of the ring clear every reference bit. */
static bool evict_one(struct gw_cache *c, uint64_t now_ms, bool force)
{
    bool spare_hot = !force && !hot_over(c);
    for (uint64_t steps = 0; steps < 2ULL * c->max_entries + 1; steps++) {
        struct entry *e = c->slots[c->hand];
        c->hand = (c->hand + 1) % c->max_entries;
        if (!e)
            continue;
        if (e->expires_ms <= now_ms) {
            entry_remove(c, e);
            return true;
        }
        if (spare_hot && atomic_load(&e->hot))
            continue;
        if (!atomic_load_explicit(&e->ref, memory_order_relaxed)) {
            entry_remove(c, e);
            return true;
        }
        atomic_store_explicit(&e->ref, false, memory_order_relaxed);
    }
    return false;
}

static bool put(struct gw_cache *c, const char *route, const uint8_t scope[32], const char *key, size_t key_len,
                const uint8_t fp[32], const struct cm_resp *resp, uint64_t expires_ms, uint64_t epoch, bool hot)
{
    if (!c)
        return false;
    uint64_t now = cm_now_ms();
    if (expires_ms <= now)
        return false;
    size_t route_len = strlen(route);
    struct cm_buf b;
    cm_buf_init(&b, (size_t)(c->max_bytes / ENTRY_MAX_SHARE) < BLOB_MAX ? (size_t)(c->max_bytes / ENTRY_MAX_SHARE)
                                                                        : BLOB_MAX);
    if (!cm_resp_encode(resp, &b)) {
        cm_buf_free(&b);
        return false;
    }
    size_t size = sizeof(struct entry) + route_len + 1 + key_len + 1 + b.len;
    size_t bytes = CM_ROUND16(size + 8); /* what the allocator takes for it (glibc: 8-byte header, 16-aligned) */
    bytes += PREP_BYTES;                 /* and its prepared answer, once replayed */
    for (size_t i = 0; i < resp->hdrs.n; i++)
        bytes += strlen(resp->hdrs.v[i].name) + strlen(resp->hdrs.v[i].value) + 2 + PREP_HDR_BYTES;
    if (bytes > c->max_bytes / ENTRY_MAX_SHARE) {
        cm_buf_free(&b);
        return false;
    }
    struct entry *e = cm_malloc(size);
    memset(e, 0, sizeof *e);
    atomic_init(&e->refs, 1); /* the cache's */
    e->hash = hash_of(route, key, key_len);
    e->expires_ms = expires_ms;
    e->bytes = bytes;
    memcpy(e->scope, scope, 32);
    memcpy(e->fp, fp, 32);
    e->route = e->data;
    memcpy(e->route, route, route_len + 1);
    e->key = e->route + route_len + 1;
    memcpy(e->key, key, key_len);
    e->key[key_len] = '\0';
    e->key_len = key_len;
    e->blob = e->key + key_len + 1;
    e->blob_len = b.len;
    if (b.len)
        memcpy(e->blob, b.data, b.len);
    cm_buf_free(&b);

    bool stored = false;
    pthread_rwlock_wrlock(&c->lock);
    if (c->online && atomic_load(&c->epoch) == epoch) {
        struct entry *old = find(c, e->hash, route, scope, key, key_len);
        if (old)
            entry_remove(c, old);
        while (c->entries > 0 && (c->nfree == 0 || c->bytes + bytes > c->max_bytes))
            if (!evict_one(c, now, false))
                (void)evict_one(c, now, true); /* only hot entries are left: the bounds win */
        if (c->nfree > 0 && c->bytes + bytes <= c->max_bytes) {
            e->slot = c->free_slots[--c->nfree];
            c->slots[e->slot] = e;
            struct entry **head = &c->buckets[e->hash & (c->nbuckets - 1)];
            e->next = *head;
            *head = e;
            c->entries++;
            c->bytes += bytes;
            if (hot) {
                atomic_store(&e->hot, true);
                atomic_fetch_add(&c->hot_entries, 1);
                atomic_fetch_add(&c->hot_bytes, bytes);
            }
            stored = true;
        }
        publish(c);
    }
    pthread_rwlock_unlock(&c->lock);
    if (!stored)
        free(e);
    return stored;
}

bool gw_cache_put(struct gw_cache *c, const char *route, const uint8_t scope[32], const char *key, size_t key_len,
                  const uint8_t fp[32], const struct cm_resp *resp, uint64_t expires_ms, uint64_t epoch)
{
    return put(c, route, scope, key, key_len, fp, resp, expires_ms, epoch, false);
}

bool gw_cache_put_replayed(struct gw_cache *c, const char *route, const uint8_t scope[32], const char *key,
                           size_t key_len, const uint8_t fp[32], const struct cm_resp *resp, uint64_t expires_ms,
                           uint64_t epoch)
{
    return put(c, route, scope, key, key_len, fp, resp, expires_ms, epoch, true);
}

/* Write lock held. */
static void drop_locked(struct gw_cache *c, const char *route, size_t route_len, const char *key, size_t key_len)
{
    char name[256];
    if (route_len >= sizeof name) {
        flush_locked(c); /* no route name is that long; be safe */
        return;
    }
    memcpy(name, route, route_len);
    name[route_len] = '\0';
    uint64_t h = hash_of(name, key, key_len);
    struct entry *e = c->buckets[h & (c->nbuckets - 1)];
    while (e) {
        struct entry *next = e->next;
        if (e->hash == h && e->key_len == key_len && memcmp(e->key, key, key_len) == 0 && strcmp(e->route, name) == 0)
            entry_remove(c, e);
        e = next;
    }
}

void gw_cache_drop(struct gw_cache *c, const char *route, const char *key, size_t key_len)
{
    if (!c)
        return;
    pthread_rwlock_wrlock(&c->lock);
    atomic_store(&c->last_drop_ms, cm_now_ms());
    drop_locked(c, route, strlen(route), key, key_len);
    atomic_fetch_add(&c->epoch, 1);
    publish(c);
    pthread_rwlock_unlock(&c->lock);
}

void gw_cache_notified(struct gw_cache *c, const char *payload, size_t len)
{
    if (!c)
        return;
    const char *nl = memchr(payload, '\n', len);
    pthread_rwlock_wrlock(&c->lock);
    atomic_store(&c->last_drop_ms, cm_now_ms());
    if (nl)
        drop_locked(c, payload, (size_t)(nl - payload), nl + 1, len - (size_t)(nl - payload) - 1);
    else
        flush_locked(c);
    atomic_fetch_add(&c->epoch, 1);
    publish(c);
    pthread_rwlock_unlock(&c->lock);
}

void gw_cache_usage(struct gw_cache *c, size_t *entries, size_t *bytes)
{
    *entries = 0;
    *bytes = 0;
    if (!c)
        return;
    pthread_rwlock_rdlock(&c->lock);
    *entries = c->entries;
    *bytes = c->bytes;
    pthread_rwlock_unlock(&c->lock);
}

/* ---- the pipeline's call sites */

enum gw_cache_verdict gw_cache_claim(struct gw_job *job, struct MHD_Connection *conn, bool *queued_ok,
                                     struct store_claim_res *res)
{
    struct gw_cache *c = job->ctx->cache;
    if (!c || job->shadow)
        return GW_CACHE_MISS;
    struct cm_resp resp;
    enum gw_cache_verdict v = gw_cache_queue(c, job->route->name, job->scope, job->key, job->key_len, job->fp,
                                             cm_now_ms(), conn, job, queued_ok, &resp);
    if (v == GW_CACHE_MISS || v == GW_CACHE_QUEUED)
        return v;
    memset(res, 0, sizeof *res);
    if (v == GW_CACHE_REPLAY) {
        res->verdict = STORE_REPLAY;
        res->resp = resp;
    } else {
        res->verdict = STORE_MISMATCH;
        cm_resp_init(&res->resp, 0);
    }
    return v;
}

uint64_t gw_cache_before_store(struct gw_job *job)
{
    return gw_cache_epoch(job->ctx->cache);
}

void gw_cache_completed(struct gw_job *job, const struct cm_resp *resp, uint64_t started_ms, uint64_t epoch)
{
    struct gw_cache *c = job->ctx->cache;
    if (!c)
        return;
    (void)gw_cache_put(c, job->route->name, job->scope, job->key, job->key_len, job->fp, resp,
                       started_ms + job->route->idem.retention_ms, epoch);
}

bool gw_cache_redis_fill_ok(struct gw_cache *c, uint64_t now_ms)
{
    uint64_t last = c ? atomic_load(&c->last_drop_ms) : 0;
    return c && (last == 0 || now_ms >= last + GW_CACHE_PURGE_GRACE_MS);
}

void gw_cache_replayed(struct gw_job *job, const struct store_claim_res *res, uint64_t started_ms, uint64_t epoch)
{
    struct gw_cache *c = job->ctx->cache;
    if (!c || job->shadow || res->expires_in_ms == 0)
        return;
    /* A purge deletes the Redis copy after its commit (and its notification): until then Redis may still answer
     * with the purged record, also to a claim that began after the notification. */
    if (res->from_redis && !gw_cache_redis_fill_ok(c, cm_now_ms()))
        return;
    (void)gw_cache_put_replayed(c, job->route->name, job->scope, job->key, job->key_len, job->fp, &res->resp,
                                started_ms + res->expires_in_ms, epoch);
}
