/* store_test.c - the store against a real Postgres and a real Redis: migration, the atomic claim and its
 * verdicts, fencing, leases, retention, concurrency, the Redis filter (flushed, down), Postgres down,
 * admin JSON, the cleaner. Needs IDEMGATE_TEST_PG_URL and IDEMGATE_TEST_REDIS_URL (scripts/services.sh). */
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <event2/event.h>

#include "common/common.h"
#include "common/metrics.h"
#include "conf/conf.h"
#include "store/store.h"

/* ---- environment and external clients (psql, redis-cli: the test does not link libpq or hiredis) */

static const char *need_env(const char *name)
{
    const char *v = getenv(name);
    cr_assert(v && *v, "%s is not set: start the services with scripts/services.sh and source its env file", name);
    return v;
}

static const char *pg_url(void)
{
    return need_env("IDEMGATE_TEST_PG_URL");
}

static const char *redis_url(void)
{
    return need_env("IDEMGATE_TEST_REDIS_URL");
}

/* Runs argv, returns its stdout (heap) and exit status. Bounded by `timeout`. */
static char *run_cmd(const char *const *argv, int *status)
{
    int out[2];
    cr_assert_eq(pipe(out), 0);
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0) {
        dup2(out[1], 1);
        close(out[0]);
        close(out[1]);
        const char *full[32];
        size_t n = 0;
        full[n++] = "timeout";
        full[n++] = "20";
        for (size_t i = 0; argv[i] && n < 31; i++)
            full[n++] = argv[i];
        full[n] = NULL;
        execvp("timeout", (char *const *)full);
        _exit(127);
    }
    close(out[1]);
    struct cm_buf b;
    cm_buf_init(&b, 1 << 20);
    char tmp[4096];
    for (;;) {
        ssize_t r = read(out[0], tmp, sizeof tmp);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        cr_assert(cm_buf_append(&b, tmp, (size_t)r));
    }
    close(out[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    size_t n;
    char *s = cm_buf_take(&b, &n);
    cm_buf_free(&b);
    return s ? s : cm_strdup("");
}

static char *psql(const char *url, const char *sql)
{
    const char *argv[] = {"psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", url, "-c", sql, NULL};
    int st;
    char *out = run_cmd(argv, &st);
    cr_assert_eq(st, 0, "psql failed: %s", sql);
    size_t n = strlen(out);
    while (n > 0 && out[n - 1] == '\n')
        out[--n] = '\0';
    return out;
}

static long psql_long(const char *sql)
{
    char *out = psql(pg_url(), sql);
    char *end = NULL;
    long v = strtol(out, &end, 10);
    cr_assert(end != out, "not a number from %s: %s", sql, out);
    free(out);
    return v;
}

static char *redis_cli(const char *url, const char *a1, const char *a2)
{
    const char *argv[] = {"redis-cli", "-u", url, a1, a2, NULL};
    int st;
    char *out = run_cmd(argv, &st);
    cr_assert_eq(st, 0, "redis-cli %s failed", a1);
    return out;
}

/* Starts psql running sql in the background (one implicit transaction), stdout discarded. */
static pid_t psql_background(const char *sql)
{
    pid_t kid = fork();
    cr_assert_neq(kid, -1);
    if (kid == 0) {
        FILE *devnull = freopen("/dev/null", "w", stdout);
        (void)devnull;
        execlp("timeout", "timeout", "20", "psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", pg_url(), "-c", sql,
               (char *)NULL);
        _exit(127);
    }
    return kid;
}

/* Waits (bounded) until a session other than ours runs a statement containing marker and pg_sleep. */
static void wait_for_session(const char *marker)
{
    char *sql = cm_asprintf("SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid()"
                            " AND query LIKE '%%%s%%' AND wait_event = 'PgSleep'",
                            marker);
    uint64_t end = cm_now_ms() + 15000;
    bool seen = false;
    while (!seen && cm_now_ms() < end) {
        char *out = psql(need_env("IDEMGATE_TEST_PG_URL"), sql);
        seen = strcmp(out, "0") != 0;
        free(out);
        if (!seen)
            usleep(20000);
    }
    free(sql);
    cr_assert(seen, "the background session did not start");
}

static void psql_wait(pid_t kid)
{
    int st = 0;
    cr_assert_eq(waitpid(kid, &st, 0), kid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "background psql failed");
}

/* The Redis URL with database number db (tests that flush use their own database). */
static char *redis_url_db(int db)
{
    const char *u = redis_url();
    const char *slash = strrchr(u + 8, '/');
    size_t n = slash ? (size_t)(slash - u) : strlen(u);
    return cm_asprintf("%.*s/%d", (int)n, u, db);
}

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t len = sizeof a;
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

/* ---- a store on its own event base */

struct env {
    struct event_base *base;
    struct conf conf;
    struct conf_route routes[2];
    struct store *s;
    struct store_epoch *epoch; /* current, as a gateway's listener makes it: Redis answers are used */
};

static void migrate(void)
{
    char *err = NULL;
    bool ok = store_migrate(pg_url(), CONF_DIST_NONE, 10000, &err);
    cr_assert(ok, "migrate: %s", err ? err : "?");
}

static void env_open(struct env *e, const char *pg, const char *redis, uint32_t pool)
{
    memset(e, 0, sizeof *e);
    e->base = event_base_new();
    cr_assert_not_null(e->base);
    e->routes[0].name = "pay";
    e->routes[1].name = "orders";
    e->conf.postgres_url = (char *)pg;
    e->conf.pool = pool;
    e->conf.redis_url = (char *)redis;
    const char *why = NULL;
    cr_assert(redis == NULL || conf_redis_parse(redis, &e->conf.redis, &why), "redis URL: %s", why);
    e->conf.redis_timeout_ms = 200;
    e->conf.routes = e->routes;
    e->conf.routes_n = 2;
    char *err = NULL;
    e->s = store_create(e->base, &e->conf, &err);
    cr_assert_not_null(e->s, "store_create: %s", err ? err : "?");
    e->epoch = store_epoch_create();
    store_epoch_set_current(e->epoch, true);
    store_set_epoch(e->s, e->epoch);
}

static void env_close(struct env *e)
{
    store_destroy(e->s);
    store_epoch_destroy(e->epoch);
    conf_redis_free(&e->conf.redis);
    event_base_free(e->base);
}

/* Drives the loop until *flag or max_ms passed. */
static void pump(struct env *e, const bool *flag, uint64_t max_ms)
{
    uint64_t end = cm_now_ms() + max_ms;
    while ((!flag || !*flag) && cm_now_ms() < end) {
        struct timeval tv = {0, 5000};
        event_base_loopexit(e->base, &tv);
        event_base_dispatch(e->base);
    }
}

static void wait_ms(struct env *e, uint64_t ms)
{
    pump(e, NULL, ms);
}

/* Waits until Redis is connected (or fails the test). */
static void wait_redis(struct env *e)
{
    uint64_t end = cm_now_ms() + 3000;
    while (!store_redis_up(e->s) && cm_now_ms() < end)
        wait_ms(e, 10);
    cr_assert(store_redis_up(e->s), "redis did not come up");
}

static void unique_key(char *out, size_t n, const char *tag)
{
    snprintf(out, n, "%s-%016llx", tag, (unsigned long long)cm_random_token());
}

static void fill(uint8_t out[32], uint8_t v)
{
    memset(out, v, 32);
}

struct cres {
    bool done;
    enum store_verdict v;
    uint64_t token;
    uint64_t lease_ms;
    bool from_redis;
    struct cm_resp resp;
    bool has_resp;
    char err[128];
};

static void claim_cb(void *arg, struct store_claim_res *res)
{
    struct cres *c = arg;
    cr_assert_not(c->done, "claim callback called twice");
    c->done = true;
    c->v = res->verdict;
    c->token = res->token;
    c->lease_ms = res->lease_remaining_ms;
    c->from_redis = res->from_redis;
    snprintf(c->err, sizeof c->err, "%s", res->err ? res->err : "");
    if (res->verdict == STORE_REPLAY) {
        c->resp = res->resp; /* moved out */
        cm_resp_init(&res->resp, 0);
        c->has_resp = true;
    }
}

static void cres_free(struct cres *c)
{
    if (c->has_resp)
        cm_resp_free(&c->resp);
}

struct req {
    const char *route;
    const char *key;
    uint8_t scope[32];
    uint8_t fp[32];
    uint64_t lease_ms;
    uint64_t retention_ms;
    bool takeover;
};

static struct store_claim_req mkreq(const struct req *r)
{
    struct store_claim_req q;
    memset(&q, 0, sizeof q);
    q.id.route = r->route;
    memcpy(q.id.scope, r->scope, 32);
    q.id.key = r->key;
    q.id.key_len = strlen(r->key);
    memcpy(q.fp, r->fp, 32);
    q.lease_ms = r->lease_ms;
    q.retention_ms = r->retention_ms;
    q.takeover_unknown = r->takeover;
    return q;
}

static struct store_id mkid(const struct req *r)
{
    struct store_id id;
    memset(&id, 0, sizeof id);
    id.route = r->route;
    memcpy(id.scope, r->scope, 32);
    id.key = r->key;
    id.key_len = strlen(r->key);
    return id;
}

static struct cres claim(struct env *e, const struct req *r)
{
    struct cres c;
    memset(&c, 0, sizeof c);
    struct store_claim_req q = mkreq(r);
    store_claim(e->s, &q, claim_cb, &c);
    pump(e, &c.done, 10000);
    cr_assert(c.done, "claim did not answer");
    return c;
}

struct dres {
    bool done;
    bool ok;
    long rows;
};

static void done_cb(void *arg, bool ok, long rows)
{
    struct dres *d = arg;
    cr_assert_not(d->done, "done callback called twice");
    d->done = true;
    d->ok = ok;
    d->rows = rows;
}

static void sample_resp(struct cm_resp *r)
{
    cm_resp_init(r, 1 << 20);
    r->status = 201;
    cm_hdrs_add(&r->hdrs, "Content-Type", "application/json");
    cm_hdrs_add(&r->hdrs, "X-Multi", "one");
    cm_hdrs_add(&r->hdrs, "x-multi", "two");
    static const char body[] = "{\"id\":42,\"bin\":\"\x01\x00\xff\"}";
    cr_assert(cm_buf_append(&r->body, body, sizeof body - 1));
}

static void assert_same_resp(const struct cm_resp *a, const struct cm_resp *b)
{
    cr_assert_eq(a->status, b->status);
    cr_assert_eq(a->hdrs.n, b->hdrs.n);
    for (size_t i = 0; i < a->hdrs.n; i++) {
        cr_assert_str_eq(a->hdrs.v[i].name, b->hdrs.v[i].name);
        cr_assert_str_eq(a->hdrs.v[i].value, b->hdrs.v[i].value);
    }
    cr_assert_eq(a->body.len, b->body.len);
    cr_assert_eq(memcmp(a->body.data, b->body.data, a->body.len), 0, "body differs");
}

static struct dres complete(struct env *e, const struct req *r, uint64_t token, const struct cm_resp *resp,
                            uint64_t retry_for_ms)
{
    struct dres d = {0};
    struct store_id id = mkid(r);
    store_complete(e->s, &id, token, resp, r->retention_ms, retry_for_ms, done_cb, &d);
    pump(e, &d.done, 15000);
    cr_assert(d.done, "complete did not answer");
    return d;
}

static struct dres renew(struct env *e, const struct req *r, uint64_t token, uint64_t lease_ms)
{
    struct dres d = {0};
    struct store_id id = mkid(r);
    store_renew(e->s, &id, token, lease_ms, done_cb, &d);
    pump(e, &d.done, 10000);
    cr_assert(d.done);
    return d;
}

static struct dres release(struct env *e, const struct req *r, uint64_t token)
{
    struct dres d = {0};
    struct store_id id = mkid(r);
    store_release(e->s, &id, token, 0, done_cb, &d);
    pump(e, &d.done, 10000);
    cr_assert(d.done);
    return d;
}

static struct dres mark_unknown(struct env *e, const struct req *r, uint64_t token, uint64_t lease_ms)
{
    struct dres d = {0};
    struct store_id id = mkid(r);
    store_mark_unknown(e->s, &id, token, lease_ms, 0, done_cb, &d);
    pump(e, &d.done, 10000);
    cr_assert(d.done);
    return d;
}

struct ares {
    bool done;
    int status;
    char *json;
};

static void admin_cb(void *arg, int status, char *json)
{
    struct ares *a = arg;
    a->done = true;
    a->status = status;
    a->json = json;
}

enum admin_kind { ADMIN_LIST, ADMIN_PURGE, ADMIN_RELEASE };

static struct ares admin(struct env *e, enum admin_kind k, const char *route, const char *key)
{
    struct ares a = {0};
    if (k == ADMIN_LIST)
        store_admin_list(e->s, route, key, strlen(key), admin_cb, &a);
    else if (k == ADMIN_PURGE)
        store_admin_purge(e->s, route, key, strlen(key), admin_cb, &a);
    else
        store_admin_release(e->s, route, key, strlen(key), admin_cb, &a);
    pump(e, &a.done, 10000);
    cr_assert(a.done);
    cr_assert_not_null(a.json);
    return a;
}

static size_t count_substr(const char *hay, const char *needle)
{
    size_t n = 0;
    for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

static struct req basic_req(const char *key)
{
    struct req r;
    memset(&r, 0, sizeof r);
    r.route = "pay";
    r.key = key;
    fill(r.scope, 0x11);
    fill(r.fp, 0xa1);
    r.lease_ms = 30000;
    r.retention_ms = 3600000;
    return r;
}

/* ---- migration */

Test(store, migrate_is_idempotent)
{
    migrate();
    migrate();
    cr_assert_eq(psql_long("SELECT max(version) FROM idemgate_schema_version"), 5);
    cr_assert_eq(psql_long("SELECT count(*) FROM information_schema.columns WHERE table_name = 'idemgate_keys'"
                           " AND table_schema = current_schema() AND column_name = 'request_id'"),
                 1, "v5: the claiming request's id is a column of the records");
    cr_assert_eq(psql_long("SELECT count(*) FROM idemgate_epoch"), 1, "the purge epoch is one row");
    /* primary key (route, key, scope), expires_at (cleaner), in-flight created_at (stuck gauge), (route, created_at)
     * (the admin listing) */
    cr_assert_eq(psql_long("SELECT count(*) FROM pg_indexes WHERE tablename = 'idemgate_keys'"
                           " AND schemaname = current_schema()"),
                 4);
    /* pg_get_indexdef of this one index only: the view's indexdef column would be computed for other rows too,
     * and fails on an index that a test running beside this one drops meanwhile ("cache lookup failed"). */
    cr_assert_eq(psql_long("SELECT count(*) FROM pg_indexes WHERE tablename = 'idemgate_keys'"
                           " AND schemaname = current_schema() AND indexname = 'idemgate_keys_pkey'"
                           " AND pg_get_indexdef(format('%I.%I', current_schema(), 'idemgate_keys_pkey')::regclass)"
                           " LIKE '%(route, key, scope)%'"),
                 1);
}

Test(store, migrate_concurrently_from_three_processes)
{
    /* A fresh schema of our own: three processes create it at the same time. */
    char schema[64];
    snprintf(schema, sizeof schema, "mig_%016llx", (unsigned long long)cm_random_token());
    char *sql = cm_asprintf("CREATE SCHEMA %s", schema);
    free(psql(pg_url(), sql));
    free(sql);
    const char *base = pg_url();
    char *url = cm_asprintf("%s%soptions=-csearch_path%%3D%s", base, strchr(base, '?') ? "&" : "?", schema);
    pid_t kids[3];
    for (int i = 0; i < 3; i++) {
        kids[i] = fork();
        cr_assert_neq(kids[i], -1);
        if (kids[i] == 0) {
            char *err = NULL;
            bool ok = store_migrate(url, CONF_DIST_NONE, 10000, &err);
            if (!ok)
                fprintf(stderr, "child migrate failed: %s\n", err);
            _exit(ok ? 0 : 1);
        }
    }
    for (int i = 0; i < 3; i++) {
        int st = 0;
        cr_assert_eq(waitpid(kids[i], &st, 0), kids[i]);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "migration %d failed", i);
    }
    sql = cm_asprintf("SELECT count(*) FROM pg_tables WHERE schemaname = '%s'", schema);
    cr_assert_eq(psql_long(sql), 5); /* the keys, the schema version, the ordering guard's resources, the purge
                                      * epoch, the routes' identities */
    free(sql);
    sql = cm_asprintf("SELECT count(*) FROM %s.idemgate_schema_version", schema);
    cr_assert_eq(psql_long(sql), 5); /* versions 1 to 5, once each */
    free(sql);
    sql = cm_asprintf("DROP SCHEMA %s CASCADE", schema);
    free(psql(pg_url(), sql));
    free(sql);
    free(url);
}

Test(store, migrate_reports_a_bad_server)
{
    char *url = cm_asprintf("postgresql://idemgate@127.0.0.1:%d/idemgate", free_port());
    char *err = NULL;
    uint64_t t0 = cm_now_ms();
    cr_assert_not(store_migrate(url, CONF_DIST_NONE, 3000, &err));
    cr_assert(cm_now_ms() - t0 < 5000);
    cr_assert_not_null(err);
    cr_assert(strstr(err, "postgres") != NULL, "%s", err);
    free(err);
    free(url);
}

/* ---- the claim and its verdicts */

static void verdicts(const char *redis)
{
    migrate();
    struct env e;
    env_open(&e, pg_url(), redis, 4);
    if (redis)
        wait_redis(&e);
    char key[64];
    unique_key(key, sizeof key, "v");
    struct req r = basic_req(key);

    struct cres c1 = claim(&e, &r);
    cr_assert_eq(c1.v, STORE_NEW, "got %s (%s)", store_verdict_name(c1.v), c1.err);
    cr_assert_neq(c1.token, 0);

    struct cres c2 = claim(&e, &r);
    cr_assert_eq(c2.v, STORE_IN_FLIGHT, "got %s", store_verdict_name(c2.v));
    cr_assert(c2.lease_ms > 0 && c2.lease_ms <= r.lease_ms, "lease %llu", (unsigned long long)c2.lease_ms);
    cr_assert_not(c2.from_redis, "an in-flight marker never answers 409 alone: Postgres is asked");

    struct req other = r;
    fill(other.fp, 0xb2);
    struct cres c3 = claim(&e, &other);
    cr_assert_eq(c3.v, STORE_MISMATCH, "in flight, other fingerprint: %s", store_verdict_name(c3.v));

    struct cm_resp resp;
    sample_resp(&resp);
    struct dres wrong = complete(&e, &r, c1.token ^ 1, &resp, 1000);
    cr_assert(wrong.ok);
    cr_assert_eq(wrong.rows, 0, "a wrong token must be fenced out");
    struct dres d = complete(&e, &r, c1.token, &resp, 1000);
    cr_assert(d.ok);
    cr_assert_eq(d.rows, 1);
    /* the same claim completing again (a retry after a lost commit reply) still matches */
    cr_assert_eq(complete(&e, &r, c1.token, &resp, 1000).rows, 1);

    struct cres c4 = claim(&e, &r);
    cr_assert_eq(c4.v, STORE_REPLAY, "got %s", store_verdict_name(c4.v));
    assert_same_resp(&resp, &c4.resp);
    cr_assert_not(c4.from_redis, "the completion leaves Redis alone: Postgres answers the first replay");
    if (redis) {
        struct cres c4b = claim(&e, &r);
        cr_assert_eq(c4b.v, STORE_REPLAY, "got %s", store_verdict_name(c4b.v));
        cr_assert(c4b.from_redis, "the first replay put the answer into Redis");
        assert_same_resp(&resp, &c4b.resp);
        cres_free(&c4b);
    }
    struct cres c5 = claim(&e, &other);
    cr_assert_eq(c5.v, STORE_MISMATCH, "completed, other fingerprint: %s", store_verdict_name(c5.v));

    /* another scope, another route: independent records */
    struct req scope2 = r;
    fill(scope2.scope, 0x22);
    struct cres c6 = claim(&e, &scope2);
    cr_assert_eq(c6.v, STORE_NEW, "another scope must not see the record");
    struct req route2 = r;
    route2.route = "orders";
    struct cres c7 = claim(&e, &route2);
    cr_assert_eq(c7.v, STORE_NEW, "another route must not see the record");

    cres_free(&c4);
    cm_resp_free(&resp);
    env_close(&e);
}

Test(store, verdicts_postgres_only)
{
    verdicts(NULL);
}

Test(store, verdicts_with_redis)
{
    verdicts(redis_url());
}

Test(store, replay_from_postgres_then_from_redis)
{
    migrate();
    char *url = redis_url_db(3);
    char key[64];
    unique_key(key, sizeof key, "pr");
    struct req r = basic_req(key);
    struct cm_resp resp;
    sample_resp(&resp);
    {
        /* completed without Redis */
        struct env e;
        env_open(&e, pg_url(), NULL, 2);
        struct cres c = claim(&e, &r);
        cr_assert_eq(c.v, STORE_NEW);
        cr_assert(complete(&e, &r, c.token, &resp, 1000).rows == 1);
        env_close(&e);
    }
    struct env e;
    env_open(&e, pg_url(), url, 2);
    wait_redis(&e);
    struct cres a = claim(&e, &r);
    cr_assert_eq(a.v, STORE_REPLAY);
    cr_assert_not(a.from_redis, "Redis never saw this record");
    assert_same_resp(&resp, &a.resp);
    wait_ms(&e, 100); /* the cache write is fire-and-forget */
    struct cres b = claim(&e, &r);
    cr_assert_eq(b.v, STORE_REPLAY);
    cr_assert(b.from_redis, "the replay from Postgres repopulates the cache");
    assert_same_resp(&resp, &b.resp);

    /* keys and scopes never appear raw in Redis */
    char *keys = redis_cli(url, "--scan", NULL);
    cr_assert(strstr(keys, key) == NULL);
    struct cm_sha256 h;
    uint8_t d[32];
    char hex[65];
    cm_sha256_init(&h);
    cm_sha256_update(&h, "pay", 3);
    cm_sha256_update(&h, "", 1);
    cm_sha256_update(&h, r.scope, 32);
    cm_sha256_update(&h, "", 1);
    cm_sha256_update(&h, key, strlen(key));
    cm_sha256_final(&h, d);
    cm_hex(d, 32, hex);
    char *rk = cm_asprintf("idg:%s", hex);
    cr_assert(strstr(keys, rk) != NULL, "expected %s in %s", rk, keys);
    free(rk);
    free(keys);
    cres_free(&a);
    cres_free(&b);
    cm_resp_free(&resp);
    env_close(&e);
    free(url);
}

Test(store, release_then_new_claim)
{
    migrate();
    struct env e;
    env_open(&e, pg_url(), redis_url(), 2);
    wait_redis(&e);
    char key[64];
    unique_key(key, sizeof key, "rel");
    struct req r = basic_req(key);
    struct cres c1 = claim(&e, &r);
    cr_assert_eq(c1.v, STORE_NEW);
    struct dres wrong = release(&e, &r, c1.token + 1);
    cr_assert(wrong.ok);
    cr_assert_eq(wrong.rows, 0);
    cr_assert_eq(claim(&e, &r).v, STORE_IN_FLIGHT);
    struct dres d = release(&e, &r, c1.token);
    cr_assert(d.ok);
    cr_assert_eq(d.rows, 1);
    wait_ms(&e, 50); /* the marker DEL follows the Postgres delete */
    struct cres c2 = claim(&e, &r);
    cr_assert_eq(c2.v, STORE_NEW, "got %s", store_verdict_name(c2.v));
    cr_assert_neq(c2.token, c1.token);
    env_close(&e);
}

Test(store, renew_extends_the_lease)
{
    migrate();
    struct env e;
    env_open(&e, pg_url(), NULL, 2);
    char key[64];
    unique_key(key, sizeof key, "ren");
    struct req r = basic_req(key);
    r.lease_ms = 300;
    struct cres c1 = claim(&e, &r);
    cr_assert_eq(c1.v, STORE_NEW);
    cr_assert_eq(renew(&e, &r, c1.token ^ 2, 5000).rows, 0);
    struct dres d = renew(&e, &r, c1.token, 5000);
    cr_assert(d.ok);
    cr_assert_eq(d.rows, 1);
    wait_ms(&e, 500);
    struct cres c2 = claim(&e, &r);
    cr_assert_eq(c2.v, STORE_IN_FLIGHT, "renewed lease lapsed: %s", store_verdict_name(c2.v));
    cr_assert(c2.lease_ms > 3000);
    env_close(&e);
}

static void unknown_outcome(const char *redis)
{
    migrate();
    struct env e;
    env_open(&e, pg_url(), redis, 2);
    if (redis)
        wait_redis(&e);
    char key[64];
    unique_key(key, sizeof key, "unk");
    struct req r = basic_req(key);
    r.lease_ms = 1000; /* room for a loaded machine between the steps that must happen within it */
    struct cres c1 = claim(&e, &r);
    cr_assert_eq(c1.v, STORE_NEW);
    struct dres m = mark_unknown(&e, &r, c1.token, 1000);
    cr_assert(m.ok);
    cr_assert_eq(m.rows, 1);
    cr_assert_eq(claim(&e, &r).v, STORE_IN_FLIGHT, "unknown within its lease is in flight");
    wait_ms(&e, 1200);
    struct cres rej = claim(&e, &r);
    cr_assert_eq(rej.v, STORE_UNKNOWN, "reject mode: %s", store_verdict_name(rej.v));
    cr_assert_eq(claim(&e, &r).v, STORE_UNKNOWN, "stays unknown");
    /* retry mode with another fingerprint: still a mismatch */
    struct req other = r;
    other.takeover = true;
    fill(other.fp, 0xb2);
    cr_assert_eq(claim(&e, &other).v, STORE_MISMATCH);
    /* retry mode: taken over with a new token */
    struct req retry = r;
    retry.takeover = true;
    retry.lease_ms = 30000;
    struct cres c2 = claim(&e, &retry);
    cr_assert_eq(c2.v, STORE_NEW, "retry mode: %s", store_verdict_name(c2.v));
    cr_assert_neq(c2.token, c1.token);
    cr_assert_eq(claim(&e, &retry).v, STORE_IN_FLIGHT);
    /* the old owner is fenced out */
    struct cm_resp resp;
    sample_resp(&resp);
    cr_assert_eq(complete(&e, &r, c1.token, &resp, 500).rows, 0);
    cr_assert_eq(mark_unknown(&e, &r, c1.token, 100).rows, 0);
    cr_assert_eq(release(&e, &r, c1.token).rows, 0);
    cr_assert_eq(complete(&e, &r, c2.token, &resp, 500).rows, 1);
    struct cres c3 = claim(&e, &r);
    cr_assert_eq(c3.v, STORE_REPLAY);
    cres_free(&c3);
    cm_resp_free(&resp);
    env_close(&e);
}

Test(store, unknown_outcome_postgres_only)
{
    unknown_outcome(NULL);
}

Test(store, unknown_outcome_with_redis)
{
    unknown_outcome(redis_url());
}

Test(store, orphaned_claim_becomes_unknown)
{
    migrate();
    struct env e;
    env_open(&e, pg_url(), redis_url(), 2);
    wait_redis(&e);
    char key[64];
    unique_key(key, sizeof key, "orph");
    struct req r = basic_req(key);
    r.lease_ms = 200;
    cr_assert_eq(claim(&e, &r).v, STORE_NEW);
    wait_ms(&e, 350);
    cr_assert_eq(claim(&e, &r).v, STORE_UNKNOWN);
    env_close(&e);
}

/* Retention applies to completed records only: an unknown outcome (marked, or an orphaned claim whose lease lapsed)
 * past its retention still answers unknown on a reject route; it is never treated as new. */
Test(store, unknown_outcomes_never_expire_into_new)
{
    migrate();
    struct env e;
    env_open(&e, pg_url(), NULL, 2);
    char key[64], key2[64];
    unique_key(key, sizeof key, "unk-ret");
    unique_key(key2, sizeof key2, "orph-ret");
    struct req r = basic_req(key), o = basic_req(key2);
    r.lease_ms = o.lease_ms = 100;
    r.retention_ms = o.retention_ms = 300;
    struct cres c = claim(&e, &r);
    cr_assert_eq(c.v, STORE_NEW);
    cr_assert_eq(mark_unknown(&e, &r, c.token, 100).rows, 1);
    cr_assert_eq(claim(&e, &o).v, STORE_NEW);
    wait_ms(&e, 600);
    struct cres c2 = claim(&e, &r);
    cr_expect_eq(c2.v, STORE_UNKNOWN, "unknown outcome past retention: %s", store_verdict_name(c2.v));
    struct cres c3 = claim(&e, &o);
    cr_expect_eq(c3.v, STORE_UNKNOWN, "orphaned claim past retention: %s", store_verdict_name(c3.v));
    env_close(&e);
}

static void retention(const char *redis)
{
    migrate();
    struct env e;
    env_open(&e, pg_url(), redis, 2);
    if (redis)
        wait_redis(&e);
    char key[64];
    unique_key(key, sizeof key, "ret");
    struct req r = basic_req(key);
    r.lease_ms = 100;
    r.retention_ms = 1000;
    struct cres c1 = claim(&e, &r);
    cr_assert_eq(c1.v, STORE_NEW);
    struct cm_resp resp;
    sample_resp(&resp);
    cr_assert_eq(complete(&e, &r, c1.token, &resp, 500).rows, 1);
    struct cres c2 = claim(&e, &r);
    cr_assert_eq(c2.v, STORE_REPLAY);
    wait_ms(&e, 1200);
    struct cres c3 = claim(&e, &r);
    cr_assert_eq(c3.v, STORE_NEW, "past retention: %s", store_verdict_name(c3.v));
    cr_assert_neq(c3.token, c1.token);
    cres_free(&c2);
    cm_resp_free(&resp);
    env_close(&e);
}

Test(store, retention_expiry_postgres_only)
{
    retention(NULL);
}

Test(store, retention_expiry_with_redis)
{
    retention(redis_url());
}

/* ---- concurrency */

/* Opens every pool connection (they open on demand): n claims of distinct keys at once. */
static void warm_up(struct env *e, int n)
{
    static struct cres res[64];
    static char keys[64][64];
    cr_assert(n <= 64);
    memset(res, 0, sizeof res);
    for (int i = 0; i < n; i++) {
        unique_key(keys[i], sizeof keys[i], "warm");
        struct req r = basic_req(keys[i]);
        struct store_claim_req q = mkreq(&r);
        store_claim(e->s, &q, claim_cb, &res[i]);
    }
    uint64_t end = cm_now_ms() + 10000;
    for (int i = 0; i < n; i++) {
        pump(e, &res[i].done, end > cm_now_ms() ? end - cm_now_ms() : 0);
        cr_assert(res[i].done && res[i].v == STORE_NEW, "warm-up claim %d: %s", i, store_verdict_name(res[i].v));
    }
}

static void concurrent(const char *redis, bool expired_first)
{
    migrate();
    struct env e;
    env_open(&e, pg_url(), redis, 8);
    if (redis)
        wait_redis(&e);
    warm_up(&e, 16);
    char key[64];
    unique_key(key, sizeof key, "conc");
    struct req r = basic_req(key);
    if (expired_first) {
        /* a completed record past retention: 50 claims race for the takeover */
        struct req old = r;
        old.lease_ms = 300;
        old.retention_ms = 300; /* long enough that no cleaner removes it before the completion */
        struct cres c = claim(&e, &old);
        cr_assert_eq(c.v, STORE_NEW);
        struct cm_resp resp;
        sample_resp(&resp);
        old.retention_ms = 50;
        cr_assert_eq(complete(&e, &old, c.token, &resp, 500).rows, 1);
        cm_resp_free(&resp);
        wait_ms(&e, 400);
    }
    enum { N = 50 };
    static struct cres res[N];
    memset(res, 0, sizeof res);
    struct store_claim_req q = mkreq(&r);
    for (int i = 0; i < N; i++)
        store_claim(e.s, &q, claim_cb, &res[i]);
    uint64_t end = cm_now_ms() + 15000;
    for (;;) {
        int done = 0;
        for (int i = 0; i < N; i++)
            done += res[i].done;
        if (done == N || cm_now_ms() > end)
            break;
        wait_ms(&e, 5);
    }
    int n_new = 0, n_in_flight = 0;
    for (int i = 0; i < N; i++) {
        cr_assert(res[i].done, "claim %d did not answer", i);
        if (res[i].v == STORE_NEW)
            n_new++;
        else if (res[i].v == STORE_IN_FLIGHT)
            n_in_flight++;
        else
            cr_assert_fail("claim %d: %s (%s)", i, store_verdict_name(res[i].v), res[i].err);
        cres_free(&res[i]);
    }
    cr_assert_eq(n_new, 1, "exactly one claim wins, got %d", n_new);
    cr_assert_eq(n_in_flight, N - 1);
    env_close(&e);
}

Test(store, fifty_concurrent_claims_postgres_only)
{
    concurrent(NULL, false);
}

Test(store, fifty_concurrent_claims_with_redis)
{
    concurrent(redis_url(), false);
}

Test(store, fifty_concurrent_takeovers_of_an_expired_record)
{
    concurrent(NULL, true);
}

/* READ COMMITTED: the claim's read branch uses the statement snapshot. A row inserted by a transaction that
 * commits while the claim waits on it is invisible to that snapshot (no row at all): the claim must run again and
 * answer from the committed row, never fail or claim. */
Test(store, claim_racing_an_uncommitted_insert, .timeout = 30)
{
    migrate();
    struct env e;
    env_open(&e, pg_url(), NULL, 2);
    warm_up(&e, 2);
    char key[64];
    unique_key(key, sizeof key, "rins");
    struct req r = basic_req(key);
    char *sql = cm_asprintf("INSERT INTO idemgate_keys (route, scope, key, fingerprint, state, token, lease_until,"
                            " created_at, expires_at) VALUES ('pay', '\\x%s', '%s', '\\x%s', 'in_flight', 77,"
                            " now() + interval '1 minute', now(), now() + interval '1 hour'); SELECT pg_sleep(1.5)",
                            "1111111111111111111111111111111111111111111111111111111111111111", key,
                            "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1");
    pid_t kid = psql_background(sql);
    wait_for_session(key);
    uint64_t t0 = cm_now_ms();
    struct cres c = claim(&e, &r);
    uint64_t took = cm_now_ms() - t0;
    cr_assert_eq(c.v, STORE_IN_FLIGHT, "got %s (%s)", store_verdict_name(c.v), c.err);
    cr_assert(took >= 100, "the claim did not wait for the other transaction (%llu ms)", (unsigned long long)took);
    psql_wait(kid);
    free(sql);
    env_close(&e);
}

/* Same, for a takeover: the snapshot shows the expired completed record the other transaction just took over;
 * answering from it would replay an expired answer for a key that is in flight again. */
Test(store, claim_racing_an_uncommitted_takeover, .timeout = 30)
{
    migrate();
    struct env e;
    env_open(&e, pg_url(), NULL, 2);
    warm_up(&e, 2);
    char key[64];
    unique_key(key, sizeof key, "rtake");
    struct req r = basic_req(key);
    r.lease_ms = 300;
    r.retention_ms = 300;
    struct cres c1 = claim(&e, &r);
    cr_assert_eq(c1.v, STORE_NEW);
    struct cm_resp resp;
    sample_resp(&resp);
    r.retention_ms = 50;
    cr_assert_eq(complete(&e, &r, c1.token, &resp, 500).rows, 1);
    wait_ms(&e, 400);
    /* the takeover, as a claim does it (an insert should a cleaner have removed the expired row meanwhile) */
    char *sql = cm_asprintf("INSERT INTO idemgate_keys AS k (route, scope, key, fingerprint, state, token, lease_until,"
                            " created_at, expires_at) VALUES ('pay', '\\x%s', '%s', '\\x%s', 'in_flight', 77,"
                            " now() + interval '1 minute', now(), now() + interval '1 hour')"
                            " ON CONFLICT (route, scope, key) DO UPDATE SET state = 'in_flight', token = 77,"
                            " lease_until = now() + interval '1 minute', created_at = now(),"
                            " expires_at = now() + interval '1 hour', status = NULL, response = NULL,"
                            " completed_at = NULL; SELECT pg_sleep(1.5)",
                            "1111111111111111111111111111111111111111111111111111111111111111", key,
                            "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1");
    pid_t kid = psql_background(sql);
    wait_for_session(key);
    struct cres c2 = claim(&e, &r);
    cr_assert_eq(c2.v, STORE_IN_FLIGHT, "got %s (%s)", store_verdict_name(c2.v), c2.err);
    psql_wait(kid);
    free(sql);
    cres_free(&c2);
    cm_resp_free(&resp);
    env_close(&e);
}

Test(store, two_stores_race_for_one_key)
{
    /* two pools (as two gateway processes would), Redis bypassed, many keys */
    migrate();
    struct env a, b;
    env_open(&a, pg_url(), NULL, 4);
    env_open(&b, pg_url(), NULL, 4);
    enum { K = 40 };
    static char keys[K][64];
    static struct req reqs[K];
    static struct cres ra[K], rb[K];
    memset(ra, 0, sizeof ra);
    memset(rb, 0, sizeof rb);
    for (int i = 0; i < K; i++) {
        unique_key(keys[i], sizeof keys[i], "race");
        reqs[i] = basic_req(keys[i]);
        struct store_claim_req q = mkreq(&reqs[i]);
        store_claim(a.s, &q, claim_cb, &ra[i]);
        store_claim(b.s, &q, claim_cb, &rb[i]);
    }
    uint64_t end = cm_now_ms() + 15000;
    for (;;) {
        int done = 0;
        for (int i = 0; i < K; i++)
            done += ra[i].done + rb[i].done;
        if (done == 2 * K || cm_now_ms() > end)
            break;
        wait_ms(&a, 2);
        wait_ms(&b, 2);
    }
    for (int i = 0; i < K; i++) {
        cr_assert(ra[i].done && rb[i].done);
        int wins = (ra[i].v == STORE_NEW) + (rb[i].v == STORE_NEW);
        cr_assert_eq(wins, 1, "key %d: %s / %s", i, store_verdict_name(ra[i].v), store_verdict_name(rb[i].v));
    }
    env_close(&a);
    env_close(&b);
}

/* ---- Redis markers and cache refills */

/* The store's Redis key of a record: "idg:" + hex(SHA-256(route NUL scope NUL key)). */
static void test_rkey(const struct req *r, char out[69])
{
    struct cm_sha256 h;
    uint8_t d[32];
    cm_sha256_init(&h);
    cm_sha256_update(&h, r->route, strlen(r->route));
    cm_sha256_update(&h, "", 1);
    cm_sha256_update(&h, r->scope, 32);
    cm_sha256_update(&h, "", 1);
    cm_sha256_update(&h, r->key, strlen(r->key));
    cm_sha256_final(&h, d);
    memcpy(out, "idg:", 4);
    cm_hex(d, 32, out + 4);
    out[68] = '\0';
}

/* A marker left behind (a SET NX whose reply timed out, a claim that failed, a completion that could not be
 * written) for a key Postgres does not know: the claim must not be refused with 409 on the marker's word. */
Test(store, a_left_over_marker_never_answers_in_flight_alone)
{
    migrate();
    char *url = redis_url_db(6);
    struct env e;
    env_open(&e, pg_url(), url, 2);
    wait_redis(&e);
    char key[64], rk[69];
    unique_key(key, sizeof key, "marker");
    struct req r = basic_req(key);
    test_rkey(&r, rk);
    char marker[42];
    marker[0] = 'F';
    memset(marker + 1, 0xa1, 32); /* basic_req's fingerprint */
    memset(marker + 33, 0x7f, 8); /* whatever follows, far in the future if read as a lease */
    marker[41] = '\0';
    const char *argv[] = {"redis-cli", "-u", url, "SET", rk, marker, "PX", "60000", NULL};
    int st;
    free(run_cmd(argv, &st));
    cr_assert_eq(st, 0);
    struct cres c = claim(&e, &r);
    cr_expect_eq(c.v, STORE_NEW, "a left-over marker decided: %s", store_verdict_name(c.v));
    cr_expect_not(c.from_redis);
    env_close(&e);
    free(url);
}

/* A replay served by Postgres refills the cache only while the key still holds the marker the claim placed: an
 * admin purge that deleted the record and then the Redis key between the claim's read and the refill must not get
 * the purged answer put back. The purge is simulated: the claim is held on a row lock, the test deletes the key. */
Test(store, a_cache_refill_never_undoes_a_purge, .timeout = 30)
{
    migrate();
    char *url = redis_url_db(7);
    struct env e;
    env_open(&e, pg_url(), url, 2);
    wait_redis(&e);
    char key[64], rk[69];
    unique_key(key, sizeof key, "refill");
    struct req r = basic_req(key);
    test_rkey(&r, rk);
    struct cres c1 = claim(&e, &r);
    cr_assert_eq(c1.v, STORE_NEW);
    struct cm_resp resp;
    sample_resp(&resp);
    cr_assert_eq(complete(&e, &r, c1.token, &resp, 1000).rows, 1);
    wait_ms(&e, 100);
    free(redis_cli(url, "DEL", rk)); /* Redis lost the cached answer */
    char *sql = cm_asprintf("SELECT 1 FROM idemgate_keys WHERE key = '%s' FOR UPDATE; SELECT pg_sleep(1.5)", key);
    pid_t locker = psql_background(sql);
    wait_for_session(key);
    struct cres c2;
    memset(&c2, 0, sizeof c2);
    struct store_claim_req q = mkreq(&r);
    store_claim(e.s, &q, claim_cb, &c2);
    wait_ms(&e, 300); /* its marker is in Redis, its statement waits for the lock */
    char *ex = redis_cli(url, "EXISTS", rk);
    cr_expect(strncmp(ex, "1", 1) == 0, "the claim's marker is in Redis (EXISTS %s)", ex);
    free(ex);
    free(redis_cli(url, "DEL", rk)); /* the purge's DEL */
    pump(&e, &c2.done, 10000);
    cr_assert(c2.done);
    cr_expect_eq(c2.v, STORE_REPLAY, "%s", store_verdict_name(c2.v));
    wait_ms(&e, 300); /* a refill would have landed */
    ex = redis_cli(url, "EXISTS", rk);
    cr_expect(strncmp(ex, "0", 1) == 0, "the refill put the answer back after the purge's DEL (EXISTS %s)", ex);
    free(ex);
    psql_wait(locker);
    free(sql);
    cres_free(&c2);
    cm_resp_free(&resp);
    env_close(&e);
    free(url);
}

/* ---- Redis flushed, Redis down, Postgres down */

Test(store, redis_flushed_never_yields_a_new_claim)
{
    migrate();
    char *url = redis_url_db(5);
    struct env e;
    env_open(&e, pg_url(), url, 2);
    wait_redis(&e);
    char key[64];
    unique_key(key, sizeof key, "flush");
    struct req r = basic_req(key);
    struct cres c1 = claim(&e, &r);
    cr_assert_eq(c1.v, STORE_NEW);
    wait_ms(&e, 100); /* let fire-and-forget cache writes reach Redis first */
    free(redis_cli(url, "FLUSHDB", NULL));
    struct cres c2 = claim(&e, &r);
    cr_assert_eq(c2.v, STORE_IN_FLIGHT, "after a flush: %s", store_verdict_name(c2.v));
    cr_assert_not(c2.from_redis);
    struct cm_resp resp;
    sample_resp(&resp);
    cr_assert_eq(complete(&e, &r, c1.token, &resp, 500).rows, 1);
    wait_ms(&e, 100); /* let fire-and-forget cache writes reach Redis first */
    free(redis_cli(url, "FLUSHDB", NULL));
    struct cres c3 = claim(&e, &r);
    cr_assert_eq(c3.v, STORE_REPLAY, "after a flush: %s", store_verdict_name(c3.v));
    cr_assert_not(c3.from_redis);
    assert_same_resp(&resp, &c3.resp);
    /* a completed record with another fingerprint, Redis flushed: still a mismatch */
    wait_ms(&e, 100); /* let fire-and-forget cache writes reach Redis first */
    free(redis_cli(url, "FLUSHDB", NULL));
    struct req other = r;
    fill(other.fp, 0xb2);
    cr_assert_eq(claim(&e, &other).v, STORE_MISMATCH);
    /* ... and that claim's marker did not stay behind to shadow the record */
    wait_ms(&e, 50);
    struct cres c4 = claim(&e, &r);
    cr_assert_eq(c4.v, STORE_REPLAY, "%s", store_verdict_name(c4.v));
    cres_free(&c3);
    cres_free(&c4);
    cm_resp_free(&resp);
    env_close(&e);
    free(url);
}

Test(store, redis_down_everything_still_correct)
{
    migrate();
    char *url = cm_asprintf("redis://127.0.0.1:%d/0", free_port());
    struct env e;
    env_open(&e, pg_url(), url, 2);
    cr_assert(store_redis_enabled(e.s));
    uint64_t end = cm_now_ms() + 5000;
    while (!store_postgres_up(e.s) && cm_now_ms() < end)
        wait_ms(&e, 10);
    cr_assert(store_postgres_up(e.s));
    cr_assert_not(store_redis_up(e.s));
    char key[64];
    unique_key(key, sizeof key, "rdown");
    struct req r = basic_req(key);
    struct cres c1 = claim(&e, &r);
    cr_assert_eq(c1.v, STORE_NEW);
    cr_assert_eq(claim(&e, &r).v, STORE_IN_FLIGHT);
    struct cm_resp resp;
    sample_resp(&resp);
    cr_assert_eq(complete(&e, &r, c1.token, &resp, 500).rows, 1);
    struct cres c2 = claim(&e, &r);
    cr_assert_eq(c2.v, STORE_REPLAY);
    cr_assert_not(c2.from_redis);
    assert_same_resp(&resp, &c2.resp);
    cr_assert_eq(release(&e, &r, c1.token).rows, 1);
    cr_assert_eq(claim(&e, &r).v, STORE_NEW);
    cres_free(&c2);
    cm_resp_free(&resp);
    env_close(&e);
    free(url);
}

/* A Redis that accepts connections and never answers: the link never comes up (it is up once the server answered
 * its PING, and the connect timeout drops it), so claims go to Postgres at once, without waiting for a Redis
 * timeout. */
Test(store, redis_black_hole_costs_latency_only, .timeout = 60)
{
    migrate();
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(lfd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(lfd, 16), 0); /* never accepted: the kernel completes the handshakes */
    socklen_t len = sizeof a;
    cr_assert_eq(getsockname(lfd, (struct sockaddr *)&a, &len), 0);
    char *url = cm_asprintf("redis://127.0.0.1:%d/0", ntohs(a.sin_port));
    struct env e;
    env_open(&e, pg_url(), url, 2);
    for (uint64_t end = cm_now_ms() + 1500; cm_now_ms() < end;) {
        wait_ms(&e, 10);
        cr_assert_not(store_redis_up(e.s), "a Redis that never answered is not up");
    }
    char key[64];
    unique_key(key, sizeof key, "hole");
    struct req r = basic_req(key);
    uint64_t t0 = cm_now_ms();
    struct cres c1 = claim(&e, &r);
    cr_assert_eq(c1.v, STORE_NEW, "got %s", store_verdict_name(c1.v));
    cr_assert(cm_now_ms() - t0 < 150, "the claim should not wait for a Redis that is down");
    for (int i = 0; i < 8; i++) {
        struct cres c = claim(&e, &r);
        cr_assert_eq(c.v, STORE_IN_FLIGHT, "claim %d: %s", i, store_verdict_name(c.v));
        cr_assert_not(c.from_redis);
    }
    struct cm_resp resp;
    sample_resp(&resp);
    cr_assert_eq(complete(&e, &r, c1.token, &resp, 500).rows, 1);
    struct cres c2 = claim(&e, &r);
    cr_assert_eq(c2.v, STORE_REPLAY);
    cres_free(&c2);
    cm_resp_free(&resp);
    env_close(&e); /* with commands still queued in hiredis: freed without callbacks */
    close(lfd);
    free(url);
}

static pid_t start_redis(int port)
{
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    pid_t kid = fork();
    cr_assert_neq(kid, -1);
    if (kid == 0) {
        FILE *devnull = freopen("/dev/null", "w", stdout);
        (void)devnull;
        execlp("redis-server", "redis-server", "--port", portstr, "--bind", "127.0.0.1", "--save", "", "--appendonly",
               "no", "--dir", "/tmp", (char *)NULL);
        _exit(127);
    }
    char *url = cm_asprintf("redis://127.0.0.1:%d", port);
    uint64_t end = cm_now_ms() + 10000;
    bool up = false;
    while (!up && cm_now_ms() < end) {
        const char *argv[] = {"redis-cli", "-u", url, "PING", NULL};
        int st;
        char *out = run_cmd(argv, &st);
        up = st == 0 && strncmp(out, "PONG", 4) == 0;
        free(out);
        if (!up)
            usleep(50000);
    }
    free(url);
    cr_assert(up, "private redis-server did not start");
    return kid;
}

static void stop_redis(pid_t kid)
{
    kill(kid, SIGKILL);
    int st;
    waitpid(kid, &st, 0);
}

/* An env whose Redis is a private redis-server on *port (stop_redis it, free *url). */
static pid_t env_open_private_redis(struct env *e, char **url, int *port)
{
    migrate();
    *port = free_port();
    pid_t rs = start_redis(*port);
    *url = cm_asprintf("redis://127.0.0.1:%d/0", *port);
    env_open(e, pg_url(), *url, 2);
    wait_redis(e);
    return rs;
}

Test(store, redis_restart_reconnects_and_stays_correct, .timeout = 60)
{
    char *url = NULL;
    int port = 0;
    struct env e;
    pid_t rs = env_open_private_redis(&e, &url, &port);
    char key[64];
    unique_key(key, sizeof key, "rrst");
    struct req r = basic_req(key);
    struct cres c1 = claim(&e, &r);
    cr_assert_eq(c1.v, STORE_NEW);
    struct cres c1b = claim(&e, &r);
    cr_assert_eq(c1b.v, STORE_IN_FLIGHT);
    cr_assert_not(c1b.from_redis, "the marker is there, but Postgres decides");
    stop_redis(rs); /* loses every marker */
    uint64_t end = cm_now_ms() + 3000;
    while (store_redis_up(e.s) && cm_now_ms() < end)
        wait_ms(&e, 10);
    cr_assert_not(store_redis_up(e.s), "the disconnect was not noticed");
    struct cres c2 = claim(&e, &r);
    cr_assert_eq(c2.v, STORE_IN_FLIGHT, "Redis down: %s", store_verdict_name(c2.v));
    rs = start_redis(port); /* empty */
    wait_redis(&e);
    struct cres c3 = claim(&e, &r);
    cr_assert_eq(c3.v, STORE_IN_FLIGHT, "Redis restarted empty: %s", store_verdict_name(c3.v));
    cr_assert_not(c3.from_redis);
    struct cm_resp resp;
    sample_resp(&resp);
    cr_assert_eq(complete(&e, &r, c1.token, &resp, 500).rows, 1);
    /* the restarted Redis lost the claim's marker: the completion does not cache (it writes only over its own
     * marker), the first replay comes from Postgres and refills the cache */
    struct cres c4 = claim(&e, &r);
    cr_assert_eq(c4.v, STORE_REPLAY);
    struct cres c5 = claim(&e, &r);
    cr_assert_eq(c5.v, STORE_REPLAY);
    cr_assert(c5.from_redis, "the cache works again after the reconnect");
    cres_free(&c4);
    cres_free(&c5);
    cm_resp_free(&resp);
    env_close(&e);
    stop_redis(rs);
    free(url);
}

/* calls of one command in a private Redis's INFO commandstats (0 when it never ran) */
static long redis_calls(const char *url, const char *cmd)
{
    char *out = redis_cli(url, "INFO", "commandstats");
    char needle[64];
    snprintf(needle, sizeof needle, "cmdstat_%s:calls=", cmd);
    const char *at = strstr(out, needle);
    long n = at ? strtol(at + strlen(needle), NULL, 10) : 0;
    free(out);
    return n;
}

/* The new-key path writes Redis once (the claim's SET NX GET): the completion leaves Redis alone, since most
 * keys are never retried; a retry's replay from Postgres puts the answer there, and the next one reads it. */
Test(store, a_new_key_writes_redis_once_and_its_first_replay_fills_it, .timeout = 60)
{
    enum { N = 20 };
    char *url = NULL;
    int port = 0;
    struct env e;
    pid_t rs = env_open_private_redis(&e, &url, &port);
    struct cm_resp resp;
    sample_resp(&resp);
    char keys[N][64];
    int news = 0, completed = 0;
    for (int i = 0; i < N; i++) {
        unique_key(keys[i], sizeof keys[i], "once");
        struct req r = basic_req(keys[i]);
        struct cres c = claim(&e, &r);
        news += c.v == STORE_NEW;
        completed += c.v == STORE_NEW && complete(&e, &r, c.token, &resp, 60000).rows == 1;
    }
    wait_ms(&e, 100); /* anything fire-and-forget has landed */
    /* SET counts the SETs a script makes too */
    long sets = redis_calls(url, "set"), evals = redis_calls(url, "eval") + redis_calls(url, "evalsha");
    struct req r = basic_req(keys[0]);
    struct cres a = claim(&e, &r), b = claim(&e, &r);
    env_close(&e);
    stop_redis(rs); /* before any assertion: a failed one ends the test */
    free(url);
    cr_assert_eq(news, N);
    cr_assert_eq(completed, N);
    cr_expect_eq(sets, N, "one SET NX GET per new key, %ld for %d keys", sets, N);
    cr_expect_eq(evals, 0, "no cache write at completion: %ld for %d keys", evals, N);
    cr_assert_eq(a.v, STORE_REPLAY);
    cr_expect_not(a.from_redis, "the first replay comes from Postgres");
    assert_same_resp(&resp, &a.resp);
    cr_assert_eq(b.v, STORE_REPLAY);
    cr_expect(b.from_redis, "the first replay put the answer into Redis");
    assert_same_resp(&resp, &b.resp);
    cres_free(&a);
    cres_free(&b);
    cm_resp_free(&resp);
}

/* A Redis URL conf did not parse (no host, no socket) is an error, not a connection to somewhere. */
Test(store, redis_bad_url_is_an_error)
{
    struct event_base *base = event_base_new();
    struct conf c;
    memset(&c, 0, sizeof c);
    c.postgres_url = (char *)"postgresql://127.0.0.1:1/x";
    c.pool = 1;
    c.redis_url = (char *)"http://127.0.0.1:6379";
    char *err = NULL;
    cr_assert_null(store_create(base, &c, &err));
    cr_assert_not_null(err);
    free(err);
    event_base_free(base);
}

Test(store, postgres_down_fails_fast)
{
    char *url = cm_asprintf("postgresql://idemgate@127.0.0.1:%d/idemgate", free_port());
    struct env e;
    env_open(&e, url, redis_url(), 4);
    char key[64];
    unique_key(key, sizeof key, "pgdown");
    struct req r = basic_req(key);
    uint64_t t0 = cm_now_ms();
    struct cres c1 = claim(&e, &r);
    cr_assert_eq(c1.v, STORE_UNAVAILABLE, "got %s", store_verdict_name(c1.v));
    cr_assert(cm_now_ms() - t0 < 1500, "took %llu ms", (unsigned long long)(cm_now_ms() - t0));
    cr_assert(c1.err[0] != '\0');
    cr_assert_not(store_postgres_up(e.s));
    /* with Redis up, still unavailable (never NEW without Postgres) */
    wait_redis(&e);
    t0 = cm_now_ms();
    struct cres c2 = claim(&e, &r);
    cr_assert_eq(c2.v, STORE_UNAVAILABLE, "got %s", store_verdict_name(c2.v));
    cr_assert(cm_now_ms() - t0 < 1500);
    /* owner operations report failure; complete retries for retry_for_ms first */
    struct cm_resp resp;
    sample_resp(&resp);
    t0 = cm_now_ms();
    struct dres d = complete(&e, &r, 12345, &resp, 400);
    cr_assert_not(d.ok);
    uint64_t took = cm_now_ms() - t0;
    cr_assert(took >= 200 && took < 3000, "complete gave up after %llu ms", (unsigned long long)took);
    cr_assert_not(renew(&e, &r, 12345, 1000).ok);
    cr_assert_not(release(&e, &r, 12345).ok);
    cr_assert_not(mark_unknown(&e, &r, 12345, 1000).ok);
    struct ares a = admin(&e, ADMIN_LIST, "pay", key);
    cr_assert_eq(a.status, 503);
    cr_assert(strstr(a.json, "store-unavailable") != NULL, "%s", a.json);
    free(a.json);
    cm_resp_free(&resp);
    env_close(&e);
    free(url);
}

/* A gauge without labels from the rendered registry (-1 when absent). */
static long gauge(const char *name)
{
    struct cm_buf m;
    cm_buf_init(&m, 1 << 20);
    cr_assert(cm_metrics_render(&m));
    long v = -1;
    char pat[128];
    snprintf(pat, sizeof pat, "\n%s ", name);
    const char *p = m.data ? strstr(m.data, pat) : NULL;
    if (p)
        v = strtol(p + strlen(pat), NULL, 10);
    cm_buf_free(&m);
    return v;
}

Test(store, query_timeout_fails_and_the_pool_recovers, .timeout = 60)
{
    migrate();
    const char *names[] = {"pay"};
    cm_metrics_init(1, names);
    struct env e;
    env_open(&e, pg_url(), NULL, 2);
    char key[64];
    unique_key(key, sizeof key, "lock");
    struct req r = basic_req(key);
    struct cres c1 = claim(&e, &r);
    cr_assert_eq(c1.v, STORE_NEW);
    /* another session holds the row lock for 7 s */
    char *sql = cm_asprintf("SELECT 1 FROM idemgate_keys WHERE key = '%s' FOR UPDATE; SELECT pg_sleep(7)", key);
    pid_t kid = psql_background(sql);
    wait_for_session(key);
    uint64_t t0 = cm_now_ms();
    struct cres c2 = claim(&e, &r);
    uint64_t took = cm_now_ms() - t0;
    cr_assert_eq(c2.v, STORE_UNAVAILABLE, "got %s", store_verdict_name(c2.v));
    cr_assert(took >= 3000 && took < 6500, "took %llu ms", (unsigned long long)took);
    /* the server cancelled it (statement_timeout): its outcome is known, it is not a claim in doubt (whose check
     * would find the pool's own, live server process and wait for it forever) */
    cr_expect_eq(gauge("idemgate_claims_in_doubt"), 0, "a claim the server cancelled is in doubt");
    /* other keys go on meanwhile */
    char key2[64];
    unique_key(key2, sizeof key2, "lock2");
    struct req r2 = basic_req(key2);
    cr_assert_eq(claim(&e, &r2).v, STORE_NEW);
    psql_wait(kid);
    free(sql);
    /* the timed-out claim did not take the key: still the first owner's */
    struct cres c3 = claim(&e, &r);
    cr_assert_eq(c3.v, STORE_IN_FLIGHT, "got %s", store_verdict_name(c3.v));
    env_close(&e);
    cm_metrics_reset();
}

Test(store, killed_connections_are_replaced)
{
    migrate();
    char app[48];
    snprintf(app, sizeof app, "idg_kill_%016llx", (unsigned long long)cm_random_token());
    const char *base = pg_url();
    char *url = cm_asprintf("%s%sapplication_name=%s", base, strchr(base, '?') ? "&" : "?", app);
    struct env e;
    env_open(&e, url, NULL, 3);
    char key[64];
    unique_key(key, sizeof key, "kill");
    struct req r = basic_req(key);
    cr_assert_eq(claim(&e, &r).v, STORE_NEW);
    char *sql = cm_asprintf("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name "
                            "= '%s'",
                            app);
    cr_assert(psql_long(sql) >= 1);
    wait_ms(&e, 400); /* dead idle connections noticed, reconnected after 100 ms */
    cr_assert(store_postgres_up(e.s));
    struct cres c = claim(&e, &r);
    cr_assert_eq(c.v, STORE_IN_FLIGHT, "got %s (%s)", store_verdict_name(c.v), c.err);
    free(sql);
    env_close(&e);
    free(url);
}

/* A claim whose connection dies under it runs again on a fresh one (the claim statement is atomic, and an
 * attempt that committed before the link broke would be recognised by its token). */
Test(store, claim_survives_a_killed_connection, .timeout = 60)
{
    migrate();
    char app[48];
    snprintf(app, sizeof app, "idg_kc_%016llx", (unsigned long long)cm_random_token());
    const char *base = pg_url();
    char *url = cm_asprintf("%s%sapplication_name=%s", base, strchr(base, '?') ? "&" : "?", app);
    struct env e;
    env_open(&e, url, NULL, 2);
    char key[64];
    unique_key(key, sizeof key, "kc");
    struct req r = basic_req(key);
    cr_assert_eq(claim(&e, &r).v, STORE_NEW);
    /* hold the row so that the next claim waits inside Postgres */
    char *sql = cm_asprintf("SELECT 1 FROM idemgate_keys WHERE key = '%s' FOR UPDATE; SELECT pg_sleep(2)", key);
    pid_t kid = psql_background(sql);
    wait_for_session(key);
    struct cres c;
    memset(&c, 0, sizeof c);
    struct store_claim_req q = mkreq(&r);
    store_claim(e.s, &q, claim_cb, &c);
    char *waiting = cm_asprintf("SELECT count(*) FROM pg_stat_activity WHERE application_name = '%s'"
                                " AND wait_event_type = 'Lock'",
                                app);
    uint64_t end = cm_now_ms() + 10000;
    while (psql_long(waiting) == 0 && cm_now_ms() < end)
        wait_ms(&e, 20);
    cr_assert(psql_long(waiting) == 1, "the claim is not waiting on the lock");
    char *kill_sql = cm_asprintf("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                                 " WHERE application_name = '%s'",
                                 app);
    cr_assert(psql_long(kill_sql) >= 1);
    pump(&e, &c.done, 15000);
    cr_assert(c.done);
    cr_assert_eq(c.v, STORE_IN_FLIGHT, "got %s (%s)", store_verdict_name(c.v), c.err);
    psql_wait(kid);
    free(kill_sql);
    free(waiting);
    free(sql);
    env_close(&e);
    free(url);
}

/* ---- admin */

Test(store, admin_list_release_purge)
{
    migrate();
    struct env e;
    env_open(&e, pg_url(), redis_url(), 2);
    wait_redis(&e);
    char key[80];
    unique_key(key, sizeof key, "adm\"q\\b");
    struct req r1 = basic_req(key);
    r1.lease_ms = 1000;
    struct req r2 = r1;
    fill(r2.scope, 0x22);
    r2.lease_ms = 60000;
    struct cres c1 = claim(&e, &r1);
    struct cres c2 = claim(&e, &r2);
    cr_assert_eq(c1.v, STORE_NEW);
    cr_assert_eq(c2.v, STORE_NEW);

    struct ares l = admin(&e, ADMIN_LIST, "pay", key);
    cr_assert_eq(l.status, 200);
    cr_assert_eq(l.json[0], '[');
    cr_assert_eq(count_substr(l.json, "\"state\":\"in_flight\""), 2, "%s", l.json);
    cr_assert(strstr(l.json, "\"scope\":\"1111111111111111111111111111111111111111111111111111111111111111\""));
    cr_assert(strstr(l.json, "\"scope\":\"2222222222222222222222222222222222222222222222222222222222222222\""));
    cr_assert(strstr(l.json, "\"route\":\"pay\""));
    cr_assert(strstr(l.json, "adm\\\"q\\\\b") != NULL, "key JSON-escaped: %s", l.json);
    cr_assert(strstr(l.json, "\"created_at\":\"20") && strstr(l.json, "Z\""), "%s", l.json);
    cr_assert(strstr(l.json, "\"expires_at\":"));
    cr_assert_null(strstr(l.json, "\"status\""), "no status while in flight");
    free(l.json);

    /* both live: nothing to release */
    struct ares rel = admin(&e, ADMIN_RELEASE, "pay", key);
    cr_assert_eq(rel.status, 409, "%d %s", rel.status, rel.json);
    free(rel.json);

    /* complete one; the other lapses */
    struct cm_resp resp;
    sample_resp(&resp);
    cr_assert_eq(complete(&e, &r2, c2.token, &resp, 500).rows, 1);
    wait_ms(&e, 1200);
    cr_assert_eq(claim(&e, &r1).v, STORE_UNKNOWN);
    l = admin(&e, ADMIN_LIST, "pay", key);
    cr_assert(strstr(l.json, "\"status\":201"), "%s", l.json);
    cr_assert_null(strstr(l.json, "\"id\":42"), "no response bodies in listings");
    free(l.json);

    rel = admin(&e, ADMIN_RELEASE, "pay", key);
    cr_assert_eq(rel.status, 200, "%d %s", rel.status, rel.json);
    cr_assert_str_eq(rel.json, "{\"released\":1}");
    free(rel.json);
    cr_assert_eq(claim(&e, &r1).v, STORE_NEW, "released: the next retry executes");
    struct cres stays = claim(&e, &r2);
    cr_assert_eq(stays.v, STORE_REPLAY, "the completed one stays");
    cres_free(&stays);

    struct ares p = admin(&e, ADMIN_PURGE, "pay", key);
    cr_assert_eq(p.status, 200);
    cr_assert_str_eq(p.json, "{\"deleted\":2}");
    free(p.json);
    l = admin(&e, ADMIN_LIST, "pay", key);
    cr_assert_str_eq(l.json, "[]");
    free(l.json);
    wait_ms(&e, 50);
    struct cres after = claim(&e, &r2);
    cr_assert_eq(after.v, STORE_NEW, "purged: not replayed from the Redis cache (%s)", store_verdict_name(after.v));
    cr_assert_eq(claim(&e, &r1).v, STORE_NEW);
    p = admin(&e, ADMIN_PURGE, "pay", key);
    cr_assert_str_eq(p.json, "{\"deleted\":2}");
    free(p.json);

    rel = admin(&e, ADMIN_RELEASE, "pay", key);
    cr_assert_eq(rel.status, 404);
    cr_assert(strstr(rel.json, "\"status\":404"), "%s", rel.json);
    free(rel.json);
    cm_resp_free(&resp);
    env_close(&e);
}

/* ---- background task */

Test(store, cleaner_deletes_expired_and_counts_stuck, .timeout = 30)
{
    migrate();
    char key[64], ukey[64];
    unique_key(key, sizeof key, "clean");
    unique_key(ukey, sizeof ukey, "clean-unk");
    char route[48];
    snprintf(route, sizeof route, "stuck_%016llx", (unsigned long long)cm_random_token());
    const char *names[] = {route};
    cm_metrics_init(1, names);
    {
        struct env e;
        env_open(&e, pg_url(), NULL, 2);
        struct req r = basic_req(key);
        r.lease_ms = 10;
        r.retention_ms = 10;
        struct cres c = claim(&e, &r);
        cr_assert_eq(c.v, STORE_NEW);
        struct cm_resp resp;
        sample_resp(&resp);
        cr_assert_eq(complete(&e, &r, c.token, &resp, 500).rows, 1);
        cm_resp_free(&resp);
        /* an unknown outcome past its retention and lease: the cleaner must keep it */
        struct req u = basic_req(ukey);
        u.route = route;
        u.lease_ms = 10;
        u.retention_ms = 10;
        struct cres cu = claim(&e, &u);
        cr_assert_eq(cu.v, STORE_NEW);
        cr_assert_eq(mark_unknown(&e, &u, cu.token, 10).rows, 1);
        env_close(&e);
    }
    char *sql = cm_asprintf("INSERT INTO idemgate_keys (route, scope, key, fingerprint, state, token, lease_until,"
                            " created_at, expires_at) VALUES ('%s', '\\x00', 'k', '\\x00', 'in_flight', 1,"
                            " now() + interval '1 hour', now() - interval '10 minutes', now() + interval '1 hour')",
                            route);
    free(psql(pg_url(), sql));
    free(sql);
    struct env e;
    memset(&e, 0, sizeof e);
    e.base = event_base_new();
    struct conf_route routes[1];
    memset(routes, 0, sizeof routes);
    routes[0].name = route;
    e.conf.postgres_url = (char *)pg_url();
    e.conf.pool = 2;
    e.conf.routes = routes;
    e.conf.routes_n = 1;
    char *err = NULL;
    e.s = store_create(e.base, &e.conf, &err);
    cr_assert_not_null(e.s);
    sql = cm_asprintf("SELECT count(*) FROM idemgate_keys WHERE key = '%s'", key);
    bool gone = false, counted = false;
    char *want = cm_asprintf("idemgate_stuck_processing{route=\"%s\"} 1\n", route);
    uint64_t end = cm_now_ms() + 5000;
    while (cm_now_ms() < end && !(gone && counted)) {
        wait_ms(&e, 200);
        gone = psql_long(sql) == 0;
        struct cm_buf m;
        cm_buf_init(&m, 1 << 20);
        cr_assert(cm_metrics_render(&m));
        counted = m.data && strstr(m.data, want) != NULL;
        cm_buf_free(&m);
    }
    cr_assert(gone, "the expired record was not deleted");
    cr_assert(counted, "stuck gauge not set");
    free(want);
    free(sql);
    sql = cm_asprintf("SELECT count(*) FROM idemgate_keys WHERE route = '%s' AND key = '%s' AND state = 'unknown'",
                      route, ukey);
    cr_expect_eq(psql_long(sql), 1, "the cleaner deleted an unknown outcome past its retention");
    free(sql);
    sql = cm_asprintf("DELETE FROM idemgate_keys WHERE route = '%s'", route);
    free(psql(pg_url(), sql));
    free(sql);
    env_close(&e);
    cm_metrics_reset();
}
