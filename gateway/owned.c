/* owned.c - the keys this process holds in flight, shared by its loops (one mutex); it never asks
 * the store: this process's memory only.
 *
 * SPEC 8: a lease lapses only when its owner is gone. When Postgres is down
 * or paused for longer than a lease, the owner cannot renew, and on its
 * return the record's lease has run out although the owner is alive and its
 * request is still upstream. A retry that reaches the same process must not
 * take that key over (on_unknown: retry) or be told its outcome is unknown:
 * the process knows the key is in flight, and says so without asking
 * Postgres. A retry at another instance still races the owner's renewal (the
 * README says so). */
#include "gateway/owned.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"

#define OWNED_BUCKETS 4096u  /* a power of two */
#define OWNED_MAX     262144 /* bound on entries; above it a key is not recorded (the old behaviour) */

struct owned {
    struct owned *next;
    uint64_t hash;
    bool marker; /* an ordering guard's marker (route, scope, resource), not a key's claim */
    uint8_t scope[32];
    uint8_t fp[32]; /* the holder's request fingerprint */
    bool has_fp;
    uint64_t taken_ms; /* when it was recorded (cm_now_ms): the holder's attempt's age for Retry-After */
    size_t route_len, key_len;
    char bytes[]; /* route, then key */
};

static pthread_mutex_t owned_mu = PTHREAD_MUTEX_INITIALIZER;
static struct owned *owned_tab[OWNED_BUCKETS];
static size_t owned_n;

static uint64_t id_hash(const struct store_id *id, size_t route_len, bool marker)
{
    uint64_t h = cm_fnv1a(CM_FNV1A_INIT, id->route, route_len + 1); /* the NUL separates route from scope */
    h = cm_fnv1a(h, id->scope, sizeof id->scope);
    h = cm_fnv1a(h, &marker, 1);
    return cm_fnv1a(h, id->key, id->key_len);
}

static bool same(const struct owned *o, uint64_t h, const struct store_id *id, size_t route_len, bool marker)
{
    return o->hash == h && o->marker == marker && o->route_len == route_len && o->key_len == id->key_len &&
           memcmp(o->scope, id->scope, sizeof o->scope) == 0 && memcmp(o->bytes, id->route, route_len) == 0 &&
           memcmp(o->bytes + route_len, id->key, id->key_len) == 0;
}

/* The link that holds id's entry, or the bucket's terminating NULL when it is not recorded. Under owned_mu. */
static struct owned **find(const struct store_id *id, size_t rl, uint64_t h, bool marker)
{
    struct owned **pp = &owned_tab[h & (OWNED_BUCKETS - 1)];
    while (*pp && !same(*pp, h, id, rl, marker))
        pp = &(*pp)->next;
    return pp;
}

static enum gw_owned take(const struct store_id *id, const uint8_t *fp, bool marker)
{
    size_t rl = strlen(id->route);
    uint64_t h = id_hash(id, rl, marker);
    enum gw_owned r = GW_OWNED_TAKEN;
    uint64_t now = cm_now_ms();
    pthread_mutex_lock(&owned_mu);
    struct owned **pp = find(id, rl, h, marker);
    if (*pp) {
        r = GW_OWNED_BUSY;
    } else if (owned_n >= OWNED_MAX) {
        r = GW_OWNED_UNRECORDED;
    } else {
        struct owned *o = cm_malloc(sizeof *o + rl + id->key_len);
        o->next = NULL;
        o->hash = h;
        o->marker = marker;
        memcpy(o->scope, id->scope, sizeof o->scope);
        o->has_fp = fp != NULL;
        o->taken_ms = now;
        if (fp != NULL)
            memcpy(o->fp, fp, sizeof o->fp);
        o->route_len = rl;
        o->key_len = id->key_len;
        memcpy(o->bytes, id->route, rl);
        memcpy(o->bytes + rl, id->key, id->key_len);
        *pp = o;
        owned_n++;
    }
    pthread_mutex_unlock(&owned_mu);
    return r;
}

enum gw_owned gw_owned_take(const struct store_id *id, const uint8_t *fp)
{
    return take(id, fp, false);
}

static void drop(const struct store_id *id, bool marker)
{
    size_t rl = strlen(id->route);
    uint64_t h = id_hash(id, rl, marker);
    pthread_mutex_lock(&owned_mu);
    struct owned **pp = find(id, rl, h, marker);
    if (*pp) {
        struct owned *o = *pp;
        *pp = o->next;
        free(o);
        owned_n--;
    }
    pthread_mutex_unlock(&owned_mu);
}

void gw_owned_drop(const struct store_id *id)
{
    drop(id, false);
}

static enum gw_held held(const struct store_id *id, const uint8_t *fp, bool marker, uint64_t *age_ms)
{
    size_t rl = strlen(id->route);
    uint64_t h = id_hash(id, rl, marker);
    uint64_t taken = 0;
    pthread_mutex_lock(&owned_mu);
    const struct owned *o = *find(id, rl, h, marker);
    enum gw_held r = o == NULL                                                         ? GW_HELD_NO
                     : fp != NULL && o->has_fp && memcmp(o->fp, fp, sizeof o->fp) != 0 ? GW_HELD_OTHER
                                                                                       : GW_HELD_SAME;
    if (o)
        taken = o->taken_ms;
    pthread_mutex_unlock(&owned_mu);
    if (age_ms && r != GW_HELD_NO) {
        uint64_t now = cm_now_ms();
        *age_ms = now > taken ? now - taken : 0;
    }
    return r;
}

enum gw_held gw_owned_held_fp(const struct store_id *id, const uint8_t *fp)
{
    return held(id, fp, false, NULL);
}

enum gw_held gw_owned_held_age(const struct store_id *id, const uint8_t *fp, uint64_t *age_ms)
{
    return held(id, fp, false, age_ms);
}

bool gw_owned_held(const struct store_id *id)
{
    return held(id, NULL, false, NULL) != GW_HELD_NO;
}

/* A marker is recorded as a store_id whose key is the resource: the marker flag keeps it apart from a key. */
static struct store_id marker_id(const struct store_order_id *id)
{
    return store_id_of(id->route, id->scope, id->resource, id->resource_len);
}

enum gw_owned gw_owned_marker_take(const struct store_order_id *id)
{
    struct store_id k = marker_id(id);
    return take(&k, NULL, true);
}

void gw_owned_marker_drop(const struct store_order_id *id)
{
    struct store_id k = marker_id(id);
    drop(&k, true);
}

bool gw_owned_marker_held(const struct store_order_id *id)
{
    struct store_id k = marker_id(id);
    return held(&k, NULL, true, NULL) != GW_HELD_NO;
}

size_t gw_owned_count(void)
{
    pthread_mutex_lock(&owned_mu);
    size_t n = owned_n;
    pthread_mutex_unlock(&owned_mu);
    return n;
}
