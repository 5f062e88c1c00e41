/* cache_test.c - the replay cache (gateway/cache.c): answers, scopes, invalidation, the listener rule, bounds. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <string.h>

#include "common/common.h"
#include "gateway/cache.h"

static const uint8_t SCOPE_A[32] = {1};
static const uint8_t SCOPE_B[32] = {2};
static const uint8_t FP1[32] = {7};
static const uint8_t FP2[32] = {8};

static void make_resp(struct cm_resp *r, const char *body)
{
    cm_resp_init(r, 1 << 20);
    r->status = 201;
    cm_hdrs_add(&r->hdrs, "Content-Type", "application/json");
    cm_hdrs_add(&r->hdrs, "X-Order", "b");
    cm_hdrs_add(&r->hdrs, "x-order", "a");
    cr_assert(cm_buf_append(&r->body, body, strlen(body)));
}

static void expect_same(const struct cm_resp *a, const struct cm_resp *b)
{
    cr_expect_eq(a->status, b->status);
    cr_assert_eq(a->hdrs.n, b->hdrs.n);
    for (size_t i = 0; i < a->hdrs.n; i++) {
        cr_expect_str_eq(a->hdrs.v[i].name, b->hdrs.v[i].name);
        cr_expect_str_eq(a->hdrs.v[i].value, b->hdrs.v[i].value);
    }
    cr_assert_eq(a->body.len, b->body.len);
    cr_expect(memcmp(a->body.data, b->body.data, a->body.len) == 0);
}

static struct gw_cache *online_cache(uint64_t bytes, uint32_t entries)
{
    struct gw_cache *c = gw_cache_create(bytes, entries);
    cr_assert(c);
    gw_cache_set_online(c, true, true);
    return c;
}

static bool put(struct gw_cache *c, const char *route, const uint8_t *scope, const char *key, const uint8_t *fp,
                const struct cm_resp *r, uint64_t ttl_ms)
{
    return gw_cache_put(c, route, scope, key, strlen(key), fp, r, cm_now_ms() + ttl_ms, gw_cache_epoch(c));
}

static enum gw_cache_verdict get(struct gw_cache *c, const char *route, const uint8_t *scope, const char *key,
                                 const uint8_t *fp, struct cm_resp *out)
{
    return gw_cache_get(c, route, scope, key, strlen(key), fp, cm_now_ms(), out);
}

Test(cache, off_when_a_bound_is_zero)
{
    cr_expect_null(gw_cache_create(0, 10));
    cr_expect_null(gw_cache_create(1024, 0));
    struct cm_resp r, out;
    make_resp(&r, "x");
    cr_expect(!gw_cache_put(NULL, "pay", SCOPE_A, "k", 1, FP1, &r, cm_now_ms() + 1000, 0));
    cr_expect_eq(gw_cache_get(NULL, "pay", SCOPE_A, "k", 1, FP1, cm_now_ms(), &out), GW_CACHE_MISS);
    cm_resp_free(&r);
}

Test(cache, replays_the_stored_answer_and_refuses_another_fingerprint)
{
    struct gw_cache *c = online_cache(1 << 20, 100);
    struct cm_resp r, out;
    make_resp(&r, "{\"ok\":true}");
    cr_assert(put(c, "pay", SCOPE_A, "k1", FP1, &r, 60000));
    cr_assert_eq(get(c, "pay", SCOPE_A, "k1", FP1, &out), GW_CACHE_REPLAY);
    expect_same(&r, &out);
    cm_resp_free(&out);
    cr_expect_eq(get(c, "pay", SCOPE_A, "k1", FP2, &out), GW_CACHE_MISMATCH);
    cr_expect_eq(get(c, "other", SCOPE_A, "k1", FP1, &out), GW_CACHE_MISS, "another route is another record");
    cr_expect_eq(get(c, "pay", SCOPE_A, "k2", FP1, &out), GW_CACHE_MISS);
    cm_resp_free(&r);
    gw_cache_destroy(c);
}

Test(cache, tenants_never_share_an_entry)
{
    struct gw_cache *c = online_cache(1 << 20, 100);
    struct cm_resp ra, rb, out;
    make_resp(&ra, "tenant-a");
    make_resp(&rb, "tenant-b");
    cr_assert(put(c, "pay", SCOPE_A, "k", FP1, &ra, 60000));
    cr_expect_eq(get(c, "pay", SCOPE_B, "k", FP1, &out), GW_CACHE_MISS, "scope B must not see scope A's entry");
    cr_assert(put(c, "pay", SCOPE_B, "k", FP1, &rb, 60000));
    cr_assert_eq(get(c, "pay", SCOPE_A, "k", FP1, &out), GW_CACHE_REPLAY);
    expect_same(&ra, &out);
    cm_resp_free(&out);
    cr_assert_eq(get(c, "pay", SCOPE_B, "k", FP1, &out), GW_CACHE_REPLAY);
    expect_same(&rb, &out);
    cm_resp_free(&out);
    cm_resp_free(&ra);
    cm_resp_free(&rb);
    gw_cache_destroy(c);
}

Test(cache, purge_drops_every_scope_of_the_key_and_nothing_else)
{
    struct gw_cache *c = online_cache(1 << 20, 100);
    struct cm_resp r, out;
    make_resp(&r, "x");
    cr_assert(put(c, "pay", SCOPE_A, "k", FP1, &r, 60000));
    cr_assert(put(c, "pay", SCOPE_B, "k", FP1, &r, 60000));
    cr_assert(put(c, "pay", SCOPE_A, "k2", FP1, &r, 60000));
    cr_assert(put(c, "pay2", SCOPE_A, "k", FP1, &r, 60000));
    gw_cache_drop(c, "pay", "k", 1);
    cr_expect_eq(get(c, "pay", SCOPE_A, "k", FP1, &out), GW_CACHE_MISS);
    cr_expect_eq(get(c, "pay", SCOPE_B, "k", FP1, &out), GW_CACHE_MISS);
    cr_expect_eq(get(c, "pay", SCOPE_A, "k2", FP1, &out), GW_CACHE_REPLAY);
    cm_resp_free(&out);
    cr_expect_eq(get(c, "pay2", SCOPE_A, "k", FP1, &out), GW_CACHE_REPLAY);
    cm_resp_free(&out);
    /* the notification's form */
    gw_cache_notified(c, "pay\nk2", 6);
    cr_expect_eq(get(c, "pay", SCOPE_A, "k2", FP1, &out), GW_CACHE_MISS);
    cr_expect_eq(get(c, "pay2", SCOPE_A, "k", FP1, &out), GW_CACHE_REPLAY);
    cm_resp_free(&out);
    /* a payload of no known form empties the cache */
    gw_cache_notified(c, "", 0);
    cr_expect_eq(get(c, "pay2", SCOPE_A, "k", FP1, &out), GW_CACHE_MISS);
    size_t n, b;
    gw_cache_usage(c, &n, &b);
    cr_expect_eq(n, 0);
    cr_expect_eq(b, 0);
    cm_resp_free(&r);
    gw_cache_destroy(c);
}

Test(cache, unused_and_emptied_while_the_listener_is_down)
{
    struct gw_cache *c = gw_cache_create(1 << 20, 100);
    struct cm_resp r, out;
    make_resp(&r, "x");
    cr_expect(!put(c, "pay", SCOPE_A, "k", FP1, &r, 60000), "offline at start: no fill");
    gw_cache_set_online(c, true, true);
    cr_assert(put(c, "pay", SCOPE_A, "k", FP1, &r, 60000));
    gw_cache_set_online(c, false, false);
    cr_expect_eq(get(c, "pay", SCOPE_A, "k", FP1, &out), GW_CACHE_MISS);
    gw_cache_set_online(c, true, true);
    cr_expect_eq(get(c, "pay", SCOPE_A, "k", FP1, &out), GW_CACHE_MISS, "an entry from before the outage is gone");
    cm_resp_free(&r);
    gw_cache_destroy(c);
}

/* A late listener: unused meanwhile, its entries kept (a purge heard meanwhile still drops one), a fill begun
 * before or during it refused. */
Test(cache, unused_but_kept_while_the_listener_is_late)
{
    struct gw_cache *c = online_cache(1 << 20, 100);
    struct cm_resp r, out;
    make_resp(&r, "x");
    cr_assert(put(c, "pay", SCOPE_A, "kept", FP1, &r, 60000));
    cr_assert(put(c, "pay", SCOPE_A, "purged", FP1, &r, 60000));
    uint64_t before = gw_cache_epoch(c);
    gw_cache_set_online(c, false, true);
    cr_expect_eq(get(c, "pay", SCOPE_A, "kept", FP1, &out), GW_CACHE_MISS, "a late listener's cache answers");
    cr_expect(!put(c, "pay", SCOPE_A, "new", FP1, &r, 60000), "a fill while late");
    uint64_t during = gw_cache_epoch(c);
    gw_cache_notified(c, "pay\npurged", 10);
    size_t n = 0, b = 0;
    gw_cache_usage(c, &n, &b);
    cr_expect_eq(n, 1, "kept, less the purged one: %zu", n);
    gw_cache_set_online(c, true, true);
    cr_expect(!gw_cache_put(c, "pay", SCOPE_A, "k2", 2, FP1, &r, cm_now_ms() + 60000, before), "begun before");
    cr_expect(!gw_cache_put(c, "pay", SCOPE_A, "k3", 2, FP1, &r, cm_now_ms() + 60000, during), "begun while late");
    cr_expect_eq(get(c, "pay", SCOPE_A, "kept", FP1, &out), GW_CACHE_REPLAY, "kept for when it is back");
    cm_resp_free(&out);
    cr_expect_eq(get(c, "pay", SCOPE_A, "purged", FP1, &out), GW_CACHE_MISS, "the purge heard while late");
    cm_resp_free(&r);
    gw_cache_destroy(c);
}

Test(cache, a_fill_that_raced_an_invalidation_is_refused)
{
    struct gw_cache *c = online_cache(1 << 20, 100);
    struct cm_resp r, out;
    make_resp(&r, "x");
    uint64_t e = gw_cache_epoch(c);
    gw_cache_notified(c, "pay\nother", 9); /* any purge between the completion's send and its fill */
    cr_expect(!gw_cache_put(c, "pay", SCOPE_A, "k", 1, FP1, &r, cm_now_ms() + 60000, e));
    e = gw_cache_epoch(c);
    gw_cache_set_online(c, false, false);
    gw_cache_set_online(c, true, true); /* a reconnect in between */
    cr_expect(!gw_cache_put(c, "pay", SCOPE_A, "k", 1, FP1, &r, cm_now_ms() + 60000, e));
    cr_expect_eq(get(c, "pay", SCOPE_A, "k", FP1, &out), GW_CACHE_MISS);
    cm_resp_free(&r);
    gw_cache_destroy(c);
}

Test(cache, an_entry_ends_at_its_expiry)
{
    struct gw_cache *c = online_cache(1 << 20, 100);
    struct cm_resp r, out;
    make_resp(&r, "x");
    uint64_t now = cm_now_ms();
    cr_assert(gw_cache_put(c, "pay", SCOPE_A, "k", 1, FP1, &r, now + 50, gw_cache_epoch(c)));
    cr_expect_eq(gw_cache_get(c, "pay", SCOPE_A, "k", 1, FP1, now + 49, &out), GW_CACHE_REPLAY);
    cm_resp_free(&out);
    cr_expect_eq(gw_cache_get(c, "pay", SCOPE_A, "k", 1, FP1, now + 50, &out), GW_CACHE_MISS);
    cr_expect_eq(gw_cache_get(c, "pay", SCOPE_A, "k", 1, FP2, now + 51, &out), GW_CACHE_MISS,
                 "an expired record is new, not a mismatch");
    cr_expect(!gw_cache_put(c, "pay", SCOPE_A, "k", 1, FP1, &r, now, gw_cache_epoch(c)), "already expired");
    cm_resp_free(&r);
    gw_cache_destroy(c);
}

Test(cache, bounds_hold_and_clock_keeps_a_hot_entry)
{
    struct gw_cache *c = online_cache(1 << 20, 8);
    struct cm_resp r, out;
    make_resp(&r, "0123456789");
    char key[32];
    cr_assert(put(c, "pay", SCOPE_A, "hot", FP1, &r, 60000));
    for (int i = 0; i < 100; i++) {
        cr_assert_eq(get(c, "pay", SCOPE_A, "hot", FP1, &out), GW_CACHE_REPLAY, "hot entry evicted at %d", i);
        cm_resp_free(&out);
        snprintf(key, sizeof key, "k%d", i);
        cr_assert(put(c, "pay", SCOPE_A, key, FP1, &r, 60000));
        size_t n, b;
        gw_cache_usage(c, &n, &b);
        cr_assert_leq(n, 8);
    }
    gw_cache_destroy(c);

    /* the byte bound: each entry is some hundred bytes (its prepared answer's share counted too) */
    c = online_cache(8192, 1000);
    size_t max_n = 0;
    for (int i = 0; i < 200; i++) {
        snprintf(key, sizeof key, "b%d", i);
        cr_assert(put(c, "pay", SCOPE_A, key, FP1, &r, 60000));
        size_t n, b;
        gw_cache_usage(c, &n, &b);
        cr_assert_leq(b, 8192);
        if (n > max_n)
            max_n = n;
    }
    cr_expect_gt(max_n, 3, "the cache holds several entries (%zu)", max_n);
    cr_expect_lt(max_n, 1000, "bytes, not entries, bounded it");
    /* one entry over an eighth of max_bytes is refused rather than flush the rest */
    struct cm_resp big;
    cm_resp_init(&big, 1 << 20);
    big.status = 200;
    char blob[1024];
    memset(blob, 'z', sizeof blob);
    cr_assert(cm_buf_append(&big.body, blob, sizeof blob));
    cr_expect(!put(c, "pay", SCOPE_A, "big", FP1, &big, 60000));
    cm_resp_free(&big);
    cm_resp_free(&r);
    gw_cache_destroy(c);
}

Test(cache, a_flood_of_new_keys_keeps_the_replayed_ones)
{
    struct gw_cache *c = online_cache(1 << 20, 10);
    struct cm_resp r, out;
    make_resp(&r, "x");
    char key[32];
    for (int i = 0; i < 5; i++) {
        snprintf(key, sizeof key, "hot%d", i);
        cr_assert(put(c, "pay", SCOPE_A, key, FP1, &r, 60000));
        cr_assert_eq(get(c, "pay", SCOPE_A, key, FP1, &out), GW_CACHE_REPLAY);
        cm_resp_free(&out);
    }
    for (int i = 0; i < 1000; i++) { /* new keys, each filled once and never replayed */
        snprintf(key, sizeof key, "new%d", i);
        cr_assert(put(c, "pay", SCOPE_A, key, FP1, &r, 60000));
    }
    for (int i = 0; i < 5; i++) {
        snprintf(key, sizeof key, "hot%d", i);
        cr_expect_eq(get(c, "pay", SCOPE_A, key, FP1, &out), GW_CACHE_REPLAY, "replayed entry %d evicted", i);
        cm_resp_free(&out);
    }
    /* hot entries beyond their share (80% of 10) compete among themselves: the bound still holds */
    for (int i = 0; i < 40; i++) {
        snprintf(key, sizeof key, "h2-%d", i);
        cr_assert(put(c, "pay", SCOPE_A, key, FP1, &r, 60000));
        cr_assert_eq(get(c, "pay", SCOPE_A, key, FP1, &out), GW_CACHE_REPLAY);
        cm_resp_free(&out);
        size_t n, b;
        gw_cache_usage(c, &n, &b);
        cr_assert_leq(n, 10);
    }
    cm_resp_free(&r);
    gw_cache_destroy(c);
}

Test(cache, no_redis_fill_just_after_a_purge)
{
    struct gw_cache *c = online_cache(1 << 20, 10);
    cr_expect(gw_cache_redis_fill_ok(c, cm_now_ms()), "no purge heard of yet");
    gw_cache_notified(c, "pay\nk", 5);
    uint64_t now = cm_now_ms();
    cr_expect(!gw_cache_redis_fill_ok(c, now), "Redis may still hold the purged copy");
    cr_expect(gw_cache_redis_fill_ok(c, now + GW_CACHE_PURGE_GRACE_MS + 1));
    gw_cache_drop(c, "pay", "k", 1);
    cr_expect(!gw_cache_redis_fill_ok(c, cm_now_ms()), "a local purge counts too");
    cr_expect(!gw_cache_redis_fill_ok(NULL, cm_now_ms()));
    gw_cache_destroy(c);
}
