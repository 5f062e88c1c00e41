/* cache_test.c - end-to-end tests of the in-process replay cache: same answer as the store's, tenants apart,
 * purges reaching every instance through Postgres LISTEN/NOTIFY, the listener rule, retention, bounds. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"

TestSuite(cache, .init = e2e_setup, .fini = e2e_teardown, .timeout = 90);

#define ADMIN_TOKEN "e2e-cache-admin-token-5d1c"

static const char *const admin_env[] = {"IDEMGATE_ADMIN_TOKEN=" ADMIN_TOKEN, NULL};

/* A gateway on the shared Postgres; idem: pay's idempotency block; cache: the replay_cache value (NULL: the
 * default); redis: a template (NULL: the test Redis). */
static struct e2e_gw *gw_start(const struct e2e_upstream *up, const char *idem, const char *cache, const char *redis)
{
    struct e2e_pay_conf pc = {.idem = idem, .redis = redis};
    char *base = e2e_conf_pay(&pc);
    size_t n = strlen(base) + 128;
    char *tmpl = malloc(n);
    cr_assert(tmpl);
    snprintf(tmpl, n, "%s%s%s%s", base, cache ? "replay_cache: " : "", cache ? cache : "", cache ? "\n" : "");
    free(base);
    struct e2e_gw_opts o = {.up = up, .env = admin_env, .wait_ready = true};
    struct e2e_gw *g = e2e_gw_start(tmpl, &o);
    free(tmpl);
    return g;
}

static double metric(const struct e2e_gw *g, const char *name)
{
    struct e2e_resp r;
    e2e_get(g->admin_port, "/metrics", &r);
    cr_assert_eq(r.status, 200, "/metrics: %ld", r.status);
    static const char *const none[] = {NULL};
    double v = e2e_metric_value((const char *)r.body, name, none);
    e2e_resp_free(&r);
    return v;
}

/* Polls metric name until it equals want (true) or timeout_ms passes. */
static bool metric_wait(const struct e2e_gw *g, const char *name, double want, int timeout_ms)
{
    uint64_t end = e2e_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        if (metric(g, name) == want)
            return true;
        if (e2e_now_ms() >= end)
            return false;
        e2e_sleep_ms(20);
    }
}

static void wait_online(const struct e2e_gw *g)
{
    cr_assert(metric_wait(g, "idemgate_replay_cache_online", 1, 10000), "the cache's listener never came up");
}

/* A gateway whose pay route is keyed and scoped by Authorization, the default cache, its listener up. */
static struct e2e_gw *scoped_online(const struct e2e_upstream *up)
{
    struct e2e_gw *g = gw_start(up, "key: required\nscope: [header:Authorization]\n", NULL, NULL);
    wait_online(g);
    return g;
}

static void post(const struct e2e_gw *g, const char *key, const char *auth, struct e2e_resp *r)
{
    char h[256];
    snprintf(h, sizeof h, "Authorization: %s", auth ? auth : "Bearer tenant-a");
    const char *const extra[] = {h, NULL};
    e2e_http_key(g->port, "POST", "/v1/pay/c", key, extra, "{\"amount\":42}", 0, r);
}

static void admin_purge(const struct e2e_gw *g, const char *key)
{
    char path[512];
    snprintf(path, sizeof path, "/admin/keys?route=pay&key=%s", key);
    const char *const h[] = {"Authorization: Bearer " ADMIN_TOKEN, NULL};
    struct e2e_req rq = {.method = "DELETE", .path = path, .headers = h};
    struct e2e_resp r;
    e2e_http(g->admin_port, &rq, &r);
    cr_assert_eq(r.status, 200, "purge: %ld %.300s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
}

Test(cache, replay_from_the_cache_is_the_answer_the_store_replays)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\nscope: [header:Authorization]\n", NULL, NULL);
    struct e2e_gw *via_redis = gw_start(up, "key: required\nscope: [header:Authorization]\n", "off", NULL);
    struct e2e_gw *via_pg = gw_start(up, "key: required\nscope: [header:Authorization]\n", "off", "");
    wait_online(gw);
    char key[96];
    e2e_mkkey(key, sizeof key, "same");
    struct e2e_resp first, cached, redis, pg;
    double misses = metric(gw, "idemgate_replay_cache_misses_total");
    post(gw, key, NULL, &first);
    cr_assert_eq(first.status, 200, "first: %ld %s", first.status, first.error);
    cr_assert(!e2e_resp_is_replay(&first));
    cr_expect_eq(metric(gw, "idemgate_replay_cache_misses_total"), misses + 1, "a new key: one look-up, one miss");
    double hits = metric(gw, "idemgate_replay_cache_hits_total");
    cr_assert_eq(metric(gw, "idemgate_replay_cache_entries"), 1, "the completion fills the cache");
    post(gw, key, NULL, &cached);
    cr_assert(e2e_resp_is_replay(&cached), "second request: a replay");
    cr_expect_eq(metric(gw, "idemgate_replay_cache_hits_total"), hits + 1, "answered by the cache");
    cr_expect_eq(e2e_resp_header_count(&cached, "Idempotent-Replayed"), 1);
    /* the first replay built the entry's prepared answer; later ones send that very response */
    struct e2e_resp again;
    post(gw, key, NULL, &again);
    cr_assert(e2e_resp_is_replay(&again), "third request: a replay");
    cr_expect_eq(metric(gw, "idemgate_replay_cache_hits_total"), hits + 2, "answered by the cache again");
    cr_expect_eq(e2e_resp_header_count(&again, "Idempotent-Replayed"), 1);
    e2e_expect_same_answer(&cached, &again, "prepared answer vs the first replay");
    e2e_resp_free(&again);
    post(via_redis, key, NULL, &redis);
    post(via_pg, key, NULL, &pg);
    cr_assert(e2e_resp_is_replay(&redis) && e2e_resp_is_replay(&pg));
    e2e_expect_same_answer(&first, &cached, "cache vs first answer");
    e2e_expect_same_answer(&redis, &cached, "cache vs Redis replay");
    e2e_expect_same_answer(&pg, &cached, "cache vs Postgres replay");
    cr_expect_eq(e2e_upstream_count(up, key), 1, "executed once");
    e2e_resp_free(&first);
    e2e_resp_free(&cached);
    e2e_resp_free(&redis);
    e2e_resp_free(&pg);

    /* another fingerprint with the key: 422 from the cache too */
    struct e2e_resp mm;
    const char *const extra[] = {"Authorization: Bearer tenant-a", NULL};
    e2e_http_key(gw->port, "POST", "/v1/pay/c", key, extra, "{\"amount\":43}", 0, &mm);
    e2e_expect_problem(&mm, 422, "idempotency-key-mismatch", "another body with a cached key");
    e2e_resp_free(&mm);
}

/* The access line of the request whose id is rid (heap), waited for (bounded), or NULL. */
static char *access_line_of(const struct e2e_gw *g, const char *rid)
{
    char needle[80];
    snprintf(needle, sizeof needle, "request_id=%s ", rid ? rid : "?");
    for (int i = 0; i < 100; i++) {
        char *log = e2e_gw_log(g);
        for (char *l = log ? strtok(log, "\n") : NULL; l; l = strtok(NULL, "\n"))
            if (strstr(l, "event=access") && strstr(l, needle)) {
                char *out = strdup(l);
                free(log);
                return out;
            }
        free(log);
        e2e_sleep_ms(50);
    }
    return NULL;
}

Test(cache, every_cached_replay_carries_its_own_request_id_and_access_line)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = scoped_online(up);
    char key[96];
    e2e_mkkey(key, sizeof key, "rids");
    struct e2e_resp first, r[3];
    post(gw, key, NULL, &first);
    cr_assert_eq(first.status, 200, "first: %ld %s", first.status, first.error);
    const char *rid0 = e2e_resp_header(&first, "X-Request-Id");
    cr_assert(rid0, "the first answer has a request id");
    double hits = metric(gw, "idemgate_replay_cache_hits_total");
    for (int i = 0; i < 3; i++) { /* the first replay prepares the entry's answer, the next ones reuse it */
        post(gw, key, NULL, &r[i]);
        cr_assert(e2e_resp_is_replay(&r[i]), "replay %d: %ld", i, r[i].status);
        cr_expect_eq(e2e_resp_header_count(&r[i], "X-Request-Id"), 1, "replay %d: one request id", i);
        cr_expect_eq(e2e_resp_header_count(&r[i], "Idempotent-Replayed"), 1, "replay %d", i);
        e2e_expect_same_answer(&first, &r[i], "a cached replay vs the first answer");
    }
    cr_expect_eq(metric(gw, "idemgate_replay_cache_hits_total"), hits + 3, "all three answered by the cache");
    char orig[80];
    snprintf(orig, sizeof orig, " original_request_id=%s ", rid0);
    for (int i = 0; i < 3; i++) {
        const char *rid = e2e_resp_header(&r[i], "X-Request-Id");
        cr_expect(rid && strcmp(rid, rid0) != 0, "replay %d names its own request: %s", i, rid ? rid : "(none)");
        for (int j = 0; j < i; j++)
            cr_expect(rid && strcmp(rid, e2e_resp_header(&r[j], "X-Request-Id")) != 0, "replays %d and %d: one id", j,
                      i);
        char *l = access_line_of(gw, rid);
        cr_assert(l, "replay %d has an access line", i);
        char bytes[64];
        snprintf(bytes, sizeof bytes, " bytes_out=%zu ", first.body_len);
        cr_expect(strstr(l, " status=200 ") && strstr(l, " replayed=true") && strstr(l, orig) && strstr(l, bytes),
                  "replay %d's access line: %s (want%s,%s)", i, l, orig, bytes);
        free(l);
    }
    for (int i = 0; i < 3; i++)
        e2e_resp_free(&r[i]);
    e2e_resp_free(&first);
}

Test(cache, a_tenant_never_gets_another_tenants_entry)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = scoped_online(up);
    char key[96];
    e2e_mkkey(key, sizeof key, "tenant");
    struct e2e_resp a1, b1, a2, b2;
    post(gw, key, "Bearer tenant-a", &a1);
    cr_assert_eq(a1.status, 200);
    post(gw, key, "Bearer tenant-b", &b1);
    cr_assert_eq(b1.status, 200);
    cr_expect(!e2e_resp_is_replay(&b1), "tenant b's first request with the key is new");
    cr_expect_eq(e2e_upstream_count(up, key), 2, "each tenant executes once");
    post(gw, key, "Bearer tenant-a", &a2);
    post(gw, key, "Bearer tenant-b", &b2);
    cr_expect(e2e_resp_is_replay(&a2) && e2e_resp_is_replay(&b2));
    e2e_expect_same_answer(&a1, &a2, "tenant a");
    e2e_expect_same_answer(&b1, &b2, "tenant b");
    cr_expect_eq(e2e_upstream_count(up, key), 2);
    cr_expect_eq(metric(gw, "idemgate_replay_cache_entries"), 2, "one entry per tenant");
    e2e_resp_free(&a1);
    e2e_resp_free(&b1);
    e2e_resp_free(&a2);
    e2e_resp_free(&b2);
}

Test(cache, a_purge_on_one_instance_reaches_the_other_within_a_second)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *a = gw_start(up, "key: required\n", NULL, NULL);
    struct e2e_gw *b = gw_start(up, "key: required\n", NULL, NULL);
    wait_online(a);
    wait_online(b);
    char key[96];
    e2e_mkkey(key, sizeof key, "purge");
    struct e2e_resp r;
    post(b, key, NULL, &r);
    cr_assert_eq(r.status, 200);
    e2e_resp_free(&r);
    post(b, key, NULL, &r);
    cr_assert(e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    cr_assert_eq(metric(b, "idemgate_replay_cache_entries"), 1);
    admin_purge(a, key);
    uint64_t t0 = e2e_now_ms();
    cr_assert(metric_wait(b, "idemgate_replay_cache_entries", 0, 1000), "instance b still holds the purged entry");
    cr_log_info("b dropped the entry %llu ms after the purge answered", (unsigned long long)(e2e_now_ms() - t0));
    post(b, key, NULL, &r);
    cr_expect_eq(r.status, 200);
    cr_expect(!e2e_resp_is_replay(&r), "after the purge instance b answers as a new key");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2, "executed again after the purge");
}

/* A gateway without Redis (a replay is the cache's or Postgres') whose cache holds one executed key. */
static struct e2e_gw *gw_holding_one(const struct e2e_upstream *up, const char *tag, char *key, size_t key_size)
{
    struct e2e_gw *gw = gw_start(up, "key: required\n", NULL, "");
    wait_online(gw);
    e2e_mkkey(key, key_size, tag);
    struct e2e_resp r;
    post(gw, key, NULL, &r);
    cr_assert_eq(r.status, 200);
    e2e_resp_free(&r);
    cr_assert_eq(metric(gw, "idemgate_replay_cache_entries"), 1);
    return gw;
}

Test(cache, no_stale_replay_after_a_purge_missed_while_the_listener_was_down)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    /* no Redis: its cached answer would survive the SQL purge below, and this test is about the process's cache */
    char key[96];
    struct e2e_gw *gw = gw_holding_one(up, "lost", key, sizeof key);
    struct e2e_resp r;
    /* the listener's connection dies; the purge comes with no notification at all (one sent while nobody
     * listened is lost the same way) */
    free(e2e_psql("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = "
                  "'idemgate-listen'"));
    cr_assert(e2e_gw_log_wait(gw, "event=cache_listener_down", 3000), "the listener did not notice");
    char sql[512];
    snprintf(sql, sizeof sql, "DELETE FROM idemgate_keys WHERE route = 'pay' AND key = '%s'", key);
    free(e2e_psql(sql));
    post(gw, key, NULL, &r);
    cr_expect_eq(r.status, 200);
    cr_expect(!e2e_resp_is_replay(&r), "a purged record replayed from the cache");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2);
    /* it comes back, and fills again (the re-execution above may have filled already, if it completed after) */
    wait_online(gw);
    double before = metric(gw, "idemgate_replay_cache_entries");
    e2e_mkkey(key, sizeof key, "back");
    post(gw, key, NULL, &r);
    e2e_resp_free(&r);
    cr_expect_eq(metric(gw, "idemgate_replay_cache_entries"), before + 1, "used again once the listener is back");
}

/* ---- a listener that is slow, not gone: its server process paused (SIGSTOP) past the ping's deadline */

static int paused_listener;

static void resume_listener(void)
{
    if (paused_listener > 0)
        (void)kill(paused_listener, SIGCONT);
    paused_listener = 0;
}

/* Is port the local port of a TCP socket the process pid holds? (/proc: its fds' socket inodes, then
 * /proc/net/tcp's local address of each.) */
static bool holds_local_port(pid_t pid, long port)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/net/tcp", (int)pid);
    FILE *f = fopen(path, "r");
    cr_assert(f, "%s", path);
    char line[512];
    unsigned long inode = 0;
    while (!inode && fgets(line, sizeof line, f)) {
        unsigned lport;
        unsigned long ino;
        if (sscanf(line, " %*d: %*x:%x %*x:%*x %*x %*x:%*x %*x:%*x %*x %*d %*d %lu", &lport, &ino) == 2 &&
            lport == (unsigned)port)
            inode = ino;
    }
    fclose(f);
    if (!inode)
        return false;
    char want[64];
    snprintf(want, sizeof want, "socket:[%lu]", inode);
    for (int fd = 0; fd < 4096; fd++) {
        char link[64], target[64];
        snprintf(link, sizeof link, "/proc/%d/fd/%d", (int)pid, fd);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n > 0) {
            target[n] = '\0';
            if (strcmp(target, want) == 0)
                return true;
        }
    }
    return false;
}

/* The server process of this gateway's listener (other tests' gateways run beside it), or 0. */
static int listener_pid(const struct e2e_gw *g)
{
    char *rows = e2e_psql("SELECT string_agg(pid || ' ' || client_port, ',') FROM pg_stat_activity"
                          " WHERE application_name = 'idemgate-listen'");
    int pid = 0;
    for (char *tok = strtok(rows, ","); tok && !pid; tok = strtok(NULL, ",")) {
        int p = 0;
        long port = 0;
        if (sscanf(tok, "%d %ld", &p, &port) == 2 && holds_local_port(g->proc.pid, port))
            pid = p;
    }
    free(rows);
    return pid;
}

/* Pauses the server process of this gateway's listener. */
static void pause_listener(const struct e2e_gw *g)
{
    int pid = listener_pid(g);
    cr_assert_gt(pid, 0, "no listener session of this gateway");
    paused_listener = pid;
    cr_assert_eq(kill(paused_listener, SIGSTOP), 0);
}

/* The server ends the listener's session (an administrator, a restart): libpq reports the FATAL message as a
 * notice; it is logged as a key=value line like every other, not printed raw on stderr (it was: "FATAL:
 * terminating connection due to administrator command"), and the listener comes back. */
Test(cache, a_terminated_listener_session_is_logged_as_key_value)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char kept[96];
    struct e2e_gw *gw = gw_holding_one(up, "terminated", kept, sizeof kept);
    int pid = listener_pid(gw);
    cr_assert_gt(pid, 0, "no listener session of this gateway");
    char sql[128];
    snprintf(sql, sizeof sql, "SELECT pg_terminate_backend(%d)", pid);
    free(e2e_psql(sql));
    cr_expect(e2e_gw_log_wait(gw, "event=cache_listener_down", 3000), "the lost session is logged");
    wait_online(gw);
    char *log = e2e_gw_log(gw);
    size_t bad = 0;
    for (char *line = strtok(log, "\n"); line; line = strtok(NULL, "\n")) {
        if (strncmp(line, "ts=", 3) != 0) {
            cr_log_error("not a key=value line: %.300s", line);
            bad++;
        }
    }
    free(log);
    cr_expect_eq(bad, 0, "every line of the log is key=value");
}

/* Paused for 1.5 s: the cache stops answering at the ping's deadline but keeps its entries; the purge committed
 * meanwhile reaches it when the server process runs again, and only after a ping sent after that is it used
 * again: the purged entry is gone, the other one answers without a store read. */
Test(cache, a_slow_listener_keeps_the_entries_and_still_drops_a_purged_one, .fini = resume_listener)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char kept[96], purged[96];
    struct e2e_gw *gw = gw_holding_one(up, "slow-kept", kept, sizeof kept);
    e2e_mkkey(purged, sizeof purged, "slow-purged");
    struct e2e_resp r;
    post(gw, purged, NULL, &r);
    cr_assert_eq(r.status, 200);
    e2e_resp_free(&r);
    cr_assert_eq(metric(gw, "idemgate_replay_cache_entries"), 2);
    pause_listener(gw);
    bool offline = metric_wait(gw, "idemgate_replay_cache_online", 0, 3000);
    double entries_offline = metric(gw, "idemgate_replay_cache_entries");
    admin_purge(gw, purged); /* its notification waits in the paused process */
    double hits = metric(gw, "idemgate_replay_cache_hits_total");
    post(gw, kept, NULL, &r); /* not from the cache while it is not sure to hear of purges */
    bool replay_offline = e2e_resp_is_replay(&r);
    e2e_resp_free(&r);
    double hits_offline = metric(gw, "idemgate_replay_cache_hits_total") - hits;
    e2e_sleep_ms(800);
    resume_listener();
    cr_assert(offline, "the cache still answered after the ping's deadline");
    cr_expect_eq(entries_offline, 2, "a late ping empties nothing");
    cr_expect(replay_offline, "a replay from Postgres meanwhile");
    cr_expect_eq(hits_offline, 0, "the cache answered while its listener was late");
    wait_online(gw);
    cr_expect(e2e_gw_log_wait(gw, "event=cache_listener_late", 1000), "the late ping is logged");
    cr_expect(e2e_gw_log_wait(gw, "event=cache_listener_back", 1000), "its return is logged");
    cr_expect_not(e2e_gw_log_wait(gw, "event=cache_listener_down", 100), "the connection was kept");
    cr_expect_eq(metric(gw, "idemgate_replay_cache_entries"), 1, "the purged entry dropped, the other one kept");
    hits = metric(gw, "idemgate_replay_cache_hits_total");
    post(gw, kept, NULL, &r);
    cr_expect(e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    cr_expect_eq(metric(gw, "idemgate_replay_cache_hits_total"), hits + 1, "the kept entry answers again");
    post(gw, purged, NULL, &r);
    cr_expect_eq(r.status, 200);
    cr_expect(!e2e_resp_is_replay(&r), "the purged record replayed from the cache");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, purged), 2, "the purged key executes again");
    cr_expect_eq(e2e_upstream_count(up, kept), 1);
}

/* Paused past the give-up time: the connection counts as lost, the cache is emptied, a new session listens. */
Test(cache, a_listener_paused_too_long_is_replaced_and_the_cache_emptied, .fini = resume_listener)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char key[96];
    struct e2e_gw *gw = gw_holding_one(up, "slow-gone", key, sizeof key);
    pause_listener(gw);
    bool down = e2e_gw_log_wait(gw, "event=cache_listener_down", 6000);
    resume_listener();
    cr_assert(down, "a listener paused for seconds is not given up");
    wait_online(gw);
    cr_expect_eq(metric(gw, "idemgate_replay_cache_entries"), 0, "notifications may be lost: emptied");
}

Test(cache, retention_ends_the_entry)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\nretention: 1500ms\n", NULL, NULL);
    wait_online(gw);
    char key[96];
    e2e_mkkey(key, sizeof key, "ret");
    struct e2e_resp r;
    post(gw, key, NULL, &r);
    e2e_resp_free(&r);
    post(gw, key, NULL, &r);
    cr_assert(e2e_resp_is_replay(&r), "within retention: a replay");
    e2e_resp_free(&r);
    e2e_sleep_ms(1700);
    post(gw, key, NULL, &r);
    cr_expect(!e2e_resp_is_replay(&r), "after retention the key is new");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2);
}

Test(cache, bounds_hold)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *by_n = gw_start(up, "key: required\n", "{max_bytes: 1MiB, max_entries: 4}", NULL);
    struct e2e_gw *by_b = gw_start(up, "key: required\n", "{max_bytes: 16KiB, max_entries: 1000}", NULL);
    wait_online(by_n);
    wait_online(by_b);
    for (int i = 0; i < 40; i++) {
        char key[96];
        e2e_mkkey(key, sizeof key, "bound");
        struct e2e_resp r;
        post(i % 2 ? by_n : by_b, key, NULL, &r);
        cr_assert_eq(r.status, 200);
        e2e_resp_free(&r);
    }
    double n = metric(by_n, "idemgate_replay_cache_entries");
    cr_expect(n >= 1 && n <= 4, "entries %g, bound 4", n);
    double b = metric(by_b, "idemgate_replay_cache_bytes");
    double bn = metric(by_b, "idemgate_replay_cache_entries");
    cr_expect(b > 0 && b <= 16384, "bytes %g, bound 16384", b);
    cr_expect(bn >= 2 && bn < 20, "entries %g under the byte bound", bn);
}

/* A record completed by a (cache off) is replayed by b from the store (Redis when redis is NULL, else Postgres):
 * that fills b's cache, and the entry ends with the record, retention after its completion (less the 1 s margin
 * for a value read from Redis). */
static void fill_from_store(const char *redis, int retention_ms)
{
    char idem[96];
    snprintf(idem, sizeof idem, "key: required\nretention: %dms\n", retention_ms);
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *a = gw_start(up, idem, "off", redis);
    struct e2e_gw *b = gw_start(up, idem, NULL, redis);
    wait_online(b);
    char key[96];
    e2e_mkkey(key, sizeof key, "fill");
    struct e2e_resp first, r1, r2, r3;
    post(a, key, NULL, &first); /* completed on a: b's cache knows nothing of it */
    cr_assert_eq(first.status, 200);
    /* a retry on a (no cache there): its replay from Postgres is what puts the answer into Redis (a completion
     * writes nothing there) */
    struct e2e_resp r0;
    post(a, key, NULL, &r0);
    cr_assert(e2e_resp_is_replay(&r0), "a replays from the store");
    e2e_resp_free(&r0);
    e2e_sleep_ms(800);
    post(b, key, NULL, &r1);
    cr_assert(e2e_resp_is_replay(&r1), "b replays from the store");
    cr_expect_eq(metric(b, "idemgate_replay_cache_entries"), 1, "a replay read from the store fills the cache");
    double hits = metric(b, "idemgate_replay_cache_hits_total");
    post(b, key, NULL, &r2);
    cr_assert(e2e_resp_is_replay(&r2));
    cr_expect_eq(metric(b, "idemgate_replay_cache_hits_total"), hits + 1, "the next replay comes from the cache");
    e2e_expect_same_answer(&first, &r2, "cache filled from the store vs first answer");
    /* the entry ends with the record (retention after its completion, not after the fill) */
    e2e_sleep_ms(retention_ms - 600);
    post(b, key, NULL, &r3);
    cr_expect(!e2e_resp_is_replay(&r3), "after the record's retention the key is new");
    cr_expect_eq(e2e_upstream_count(up, key), 2);
    e2e_resp_free(&first);
    e2e_resp_free(&r1);
    e2e_resp_free(&r2);
    e2e_resp_free(&r3);
}

Test(cache, a_replay_read_from_postgres_fills_the_cache_until_the_records_expiry)
{
    fill_from_store("", 2000);
}

Test(cache, a_replay_read_from_redis_fills_the_cache_until_the_records_expiry)
{
    fill_from_store(NULL, 3000);
}

/* ---- store.pool is the process's maximum (SPEC 3): the listener is one of its connections */

static struct e2e_gw *gw_start_pool(const struct e2e_upstream *up, int pool)
{
    char *conf = NULL;
    cr_assert(asprintf(&conf,
                       E2E_CONF_PORTS
                       "threads: 2\n"
                       "store:\n"
                       "  postgres: \"{{PG_URL}}\"\n"
                       "  redis: \"{{REDIS_URL}}\"\n"
                       "  pool: %d\n"
                       "upstreams:\n" E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s") "routes:\n" E2E_CONF_ROUTE(
                           "pay", "/v1/pay", "api") "      key: required\n",
                       pool) > 0);
    struct e2e_gw_opts o = {.up = up, .env = admin_env, .wait_ready = true};
    struct e2e_gw *g = e2e_gw_start(conf, &o);
    free(conf);
    return g;
}

/* 16 new keys at once (each 300 ms upstream) while the gateway's sessions are counted in pg_stat_activity. */
static long peak_sessions_under_load(const struct e2e_gw *gw, const char *tag)
{
    enum { N = 16 };
    char keys[N][96], kh[N][160];
    const char *hh[N][3];
    struct e2e_req rq[N];
    struct e2e_async *a[N];
    for (int i = 0; i < N; i++) {
        e2e_mkkey(keys[i], sizeof keys[i], tag);
        snprintf(kh[i], sizeof kh[i], "Idempotency-Key: %.95s", keys[i]);
        hh[i][0] = kh[i];
        hh[i][1] = "X-Test-Delay-Ms: 300";
        hh[i][2] = NULL;
        rq[i] = (struct e2e_req){
            .method = "POST", .path = "/v1/pay/p", .headers = hh[i], .body = "{}", .body_len = 2, .timeout_ms = 10000};
        a[i] = e2e_http_async(gw->port, &rq[i]);
    }
    long peak = 0;
    for (int t = 0; t < 15; t++) {
        long n = e2e_psql_long("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                               " AND application_name LIKE 'idemgate%'");
        peak = n > peak ? n : peak;
        e2e_sleep_ms(30);
    }
    for (int i = 0; i < N; i++) {
        struct e2e_resp r;
        e2e_http_join(a[i], &r);
        cr_expect_eq(r.status, 200, "key %d: %ld", i, r.status);
        e2e_resp_free(&r);
    }
    return peak;
}

Test(cache, the_listener_is_one_of_the_pools_connections)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_pool(up, 2);
    wait_online(gw);
    long peak = peak_sessions_under_load(gw, "pool2");
    cr_expect_leq(peak, 2, "store.pool 2, the listener included: %ld sessions seen", peak);
    cr_expect_eq(e2e_psql_long("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idemgate-listen'"), 1);
}

Test(cache, a_pool_of_one_leaves_the_cache_off)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_pool(up, 1);
    cr_assert(e2e_gw_log_wait(gw, "event=replay_cache_off", 3000), "no word that the cache is off");
    long peak = peak_sessions_under_load(gw, "pool1");
    cr_expect_leq(peak, 1, "store.pool 1: %ld sessions seen", peak);
    char key[96];
    e2e_mkkey(key, sizeof key, "pool1r");
    struct e2e_resp r, r2;
    post(gw, key, NULL, &r);
    post(gw, key, NULL, &r2);
    cr_expect_eq(r2.status, 200);
    cr_expect(e2e_resp_is_replay(&r2), "replays still work, from the store");
    e2e_resp_free(&r);
    e2e_resp_free(&r2);
    cr_expect_eq(metric(gw, "idemgate_replay_cache_entries"), 0);
}

/* Reads from fd until n bytes are in buf or timeout_ms passes; returns the count. */
static size_t read_upto(int fd, unsigned char *buf, size_t n, int timeout_ms)
{
    size_t got = 0;
    uint64_t end = e2e_now_ms() + (uint64_t)timeout_ms;
    while (got < n && e2e_now_ms() < end) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (poll(&pfd, 1, 100) <= 0)
            continue;
        ssize_t r = recv(fd, buf + got, n - got, 0);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    return got;
}

/* The prepared answer is shared by every connection replaying the record and owns the entry's memory: a purge
 * (or an eviction) while a slow client still receives it must leave that client's answer whole (the sanitizer
 * stage would see a use after free), and the next request with the key executes again. */
Test(cache, a_purge_while_a_slow_client_receives_the_shared_answer_leaves_it_whole, .timeout = 120)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\nscope: [header:Authorization]\nmax_response: 16MiB\n",
                                 "{max_bytes: 64MiB, max_entries: 100}", NULL);
    wait_online(gw);
    char key[96];
    e2e_mkkey(key, sizeof key, "slowread");
    enum { BODY = 6 << 20 }; /* more than the kernel buffers of a connection whose reader does not read */
    const char *const big[] = {"Authorization: Bearer tenant-a", "X-Test-Body-Size: 6291456", NULL};
    struct e2e_resp first, warm;
    e2e_http_key(gw->port, "POST", "/v1/pay/c", key, big, "{\"amount\":42}", 30000, &first);
    cr_assert_eq(first.status, 200, "first: %ld %s", first.status, first.error);
    cr_assert_eq(first.body_len, (size_t)BODY);
    e2e_http_key(gw->port, "POST", "/v1/pay/c", key, big, "{\"amount\":42}", 30000, &warm);
    cr_assert(e2e_resp_is_replay(&warm), "the entry is cached and its prepared answer built");
    e2e_resp_free(&warm);

    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    int small = 4096;
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(gw->port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    char rq[512];
    int rl = snprintf(rq, sizeof rq,
                      "POST /v1/pay/c HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: %s\r\nAuthorization: Bearer "
                      "tenant-a\r\nX-Test-Body-Size: 6291456\r\nContent-Length: 13\r\nConnection: close\r\n\r\n"
                      "{\"amount\":42}",
                      key);
    cr_assert_eq(send(fd, rq, (size_t)rl, 0), rl);
    size_t cap = BODY + 64 * 1024;
    unsigned char *buf = malloc(cap);
    cr_assert(buf);
    size_t got = read_upto(fd, buf, 2048, 10000); /* the head and a little: the rest stays in the gateway */
    cr_assert_geq(got, 64, "the answer started");
    cr_assert(strstr((const char *)buf, "Idempotent-Replayed: true") != NULL, "a replay");

    admin_purge(gw, key);
    cr_assert(metric_wait(gw, "idemgate_replay_cache_entries", 0, 5000), "the purge dropped the entry");
    /* and a fill of other keys churns the cache while the answer is still being sent */
    for (int i = 0; i < 3; i++) {
        char k2[96];
        e2e_mkkey(k2, sizeof k2, "churn");
        struct e2e_resp r;
        post(gw, k2, NULL, &r);
        cr_expect_eq(r.status, 200);
        e2e_resp_free(&r);
    }

    got += read_upto(fd, buf + got, cap - got, 60000);
    close(fd);
    const unsigned char *end = memmem(buf, got, "\r\n\r\n", 4);
    cr_assert(end, "a head");
    size_t head = (size_t)(end - buf) + 4;
    cr_assert_eq(got - head, (size_t)BODY, "the whole body arrived after the purge");
    cr_expect_eq(memcmp(buf + head, first.body, BODY), 0, "byte for byte the stored answer");
    free(buf);
    e2e_resp_free(&first);

    struct e2e_resp after;
    e2e_http_key(gw->port, "POST", "/v1/pay/c", key, big, "{\"amount\":42}", 30000, &after);
    cr_expect_eq(after.status, 200);
    cr_expect(!e2e_resp_is_replay(&after), "purged: the key is new again");
    e2e_resp_free(&after);
    cr_expect_eq(e2e_upstream_count(up, key), 2);
    e2e_gw_assert_alive(gw, "after the purge under a shared answer");
}

/* An answer the front closes the connection after (a stored 400) is not shared: it still gets Connection: close,
 * as the first answer did. */
Test(cache, a_replayed_400_still_closes_the_connection)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = scoped_online(up);
    char key[96];
    e2e_mkkey(key, sizeof key, "four-hundred");
    const char *const extra[] = {"Authorization: Bearer tenant-a", "X-Test-Status: 400", NULL};
    struct e2e_resp a, b, c;
    e2e_http_key(gw->port, "POST", "/v1/pay/c", key, extra, "{\"amount\":42}", 0, &a);
    cr_assert_eq(a.status, 400, "first: %ld %s", a.status, a.error);
    e2e_http_key(gw->port, "POST", "/v1/pay/c", key, extra, "{\"amount\":42}", 0, &b);
    e2e_http_key(gw->port, "POST", "/v1/pay/c", key, extra, "{\"amount\":42}", 0, &c);
    cr_assert(e2e_resp_is_replay(&b) && e2e_resp_is_replay(&c), "replays");
    const char *conn = e2e_resp_header(&c, "Connection");
    cr_expect(conn && strcasecmp(conn, "close") == 0, "Connection: %s", conn ? conn : "(none)");
    e2e_expect_same_answer(&b, &c, "both replays");
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    e2e_resp_free(&c);
}
