/* owned_test.c - the process's table of keys in flight (gateway/owned.c): held per (route, scope, key) exactly,
 * recorded once, forgotten on drop, and safe from several threads. */
#include <criterion/criterion.h>

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "gateway/owned.h"

static struct store_id id_of(const char *route, int scope_byte, const char *key)
{
    struct store_id id;
    memset(&id, 0, sizeof id);
    id.route = route;
    memset(id.scope, scope_byte, sizeof id.scope);
    id.key = key;
    id.key_len = strlen(key);
    return id;
}

Test(owned, held_exactly_by_route_scope_and_key)
{
    size_t n0 = gw_owned_count();
    struct store_id a = id_of("pay", 1, "k-1");
    cr_expect(!gw_owned_held(&a));
    cr_expect_eq(gw_owned_take(&a, NULL), GW_OWNED_TAKEN);
    cr_expect(gw_owned_held(&a));
    struct store_id other_route = id_of("book", 1, "k-1"), other_scope = id_of("pay", 2, "k-1"),
                    other_key = id_of("pay", 1, "k-2"), prefix = id_of("pay", 1, "k-"),
                    route_key_shift = id_of("pa", 1, "yk-1");
    cr_expect(!gw_owned_held(&other_route));
    cr_expect(!gw_owned_held(&other_scope), "another tenant's key is not held");
    cr_expect(!gw_owned_held(&other_key));
    cr_expect(!gw_owned_held(&prefix));
    cr_expect(!gw_owned_held(&route_key_shift), "route and key do not run into each other");
    cr_expect_eq(gw_owned_take(&a, NULL), GW_OWNED_BUSY, "recorded once");
    cr_expect_eq(gw_owned_count(), n0 + 1);
    gw_owned_drop(&other_scope); /* not recorded: a no-op */
    cr_expect(gw_owned_held(&a));
    gw_owned_drop(&a);
    cr_expect(!gw_owned_held(&a));
    cr_expect_eq(gw_owned_count(), n0);
}

Test(owned, the_holders_fingerprint_is_compared)
{
    struct store_id a = id_of("pay", 3, "k-fp"), b = id_of("pay", 3, "k-nofp");
    uint8_t fp[32], other[32];
    memset(fp, 0xab, sizeof fp);
    memcpy(other, fp, sizeof other);
    other[31] ^= 1;
    cr_expect_eq(gw_owned_held_fp(&a, fp), GW_HELD_NO);
    cr_expect_eq(gw_owned_take(&a, fp), GW_OWNED_TAKEN);
    cr_expect_eq(gw_owned_held_fp(&a, fp), GW_HELD_SAME);
    cr_expect_eq(gw_owned_held_fp(&a, other), GW_HELD_OTHER, "another request with the held key");
    cr_expect_eq(gw_owned_held_fp(&a, NULL), GW_HELD_SAME, "no fingerprint to compare: held");
    cr_expect_eq(gw_owned_take(&b, NULL), GW_OWNED_TAKEN);
    cr_expect_eq(gw_owned_held_fp(&b, other), GW_HELD_SAME, "recorded without a fingerprint: never another");
    gw_owned_drop(&a);
    gw_owned_drop(&b);
    cr_expect_eq(gw_owned_held_fp(&a, fp), GW_HELD_NO);
}

/* The holder's age (for Retry-After on a key in use): the time since it was recorded, on the monotonic clock. */
Test(owned, a_held_keys_age)
{
    struct store_id a = id_of("pay", 3, "k-age");
    uint64_t age = 12345;
    cr_expect_eq(gw_owned_held_age(&a, NULL, &age), GW_HELD_NO);
    cr_expect_eq(age, 12345, "untouched when not held");
    cr_expect_eq(gw_owned_take(&a, NULL), GW_OWNED_TAKEN);
    struct timespec ts = {0, 120 * 1000 * 1000};
    nanosleep(&ts, NULL);
    cr_expect_eq(gw_owned_held_age(&a, NULL, &age), GW_HELD_SAME);
    cr_expect(age >= 120 && age < 5000, "held for about 120 ms: %llu", (unsigned long long)age);
    gw_owned_drop(&a);
}

static void *churn(void *arg)
{
    int t = *(int *)arg;
    char key[32];
    for (int i = 0; i < 2000; i++) {
        snprintf(key, sizeof key, "t%d-%d", t, i % 50);
        struct store_id id = id_of("pay", t, key);
        if (gw_owned_take(&id, NULL) == GW_OWNED_TAKEN) {
            if (!gw_owned_held(&id))
                return (void *)1;
            gw_owned_drop(&id);
        }
    }
    return NULL;
}

Test(owned, several_threads)
{
    size_t n0 = gw_owned_count();
    pthread_t th[4];
    int ids[4];
    for (int i = 0; i < 4; i++) {
        ids[i] = i + 10;
        cr_assert_eq(pthread_create(&th[i], NULL, churn, &ids[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        void *r = NULL;
        pthread_join(th[i], &r);
        cr_expect_null(r, "thread %d lost its own entry", i);
    }
    cr_expect_eq(gw_owned_count(), n0, "every entry dropped");
}
