/* keys_test.c - end-to-end tests of finding and settling keys (SPEC 11): GET /admin/keys?route=R pages through a
 * route's records (filters, limits, a cursor stable while records are added), POST /admin/keys/settle turns an
 * unknown outcome into a completed record that retries replay; real Postgres, Redis and test upstream. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

TestSuite(keys, .init = e2e_setup, .fini = e2e_teardown, .timeout = 120);

#define ADMIN_TOKEN "e2e-keys-admin-token-7f30"

static const char *const admin_env[] = {"IDEMGATE_ADMIN_TOKEN=" ADMIN_TOKEN, NULL};
static const char *const bearer[] = {"Authorization: Bearer " ADMIN_TOKEN, NULL};

static struct e2e_gw *gw_start_route(const struct e2e_upstream *up, const char *route)
{
    struct e2e_pay_conf c = {.idem = "key: required\nlease: 1s\n", .timeout = "1s", .route = route};
    return e2e_gw_start_pay(up, &c, admin_env);
}

static void admin(const struct e2e_gw *g, const char *method, const char *path, const char *body, struct e2e_resp *r)
{
    static const char *const h[] = {"Authorization: Bearer " ADMIN_TOKEN, "Content-Type: application/json", NULL};
    struct e2e_req rq = {.method = method,
                         .path = path,
                         .headers = body ? h : bearer,
                         .body = body,
                         .body_len = body ? strlen(body) : 0,
                         .timeout_ms = 10000};
    e2e_http(g->admin_port, &rq, r);
}

/* n completed records of route, keys PREFIX-000.., created `secs` seconds ago (several alike: ties on created_at). */
static void insert_records(const char *route, const char *prefix, int n, int secs, const char *state, int lease_s)
{
    char sql[1024];
    snprintf(sql, sizeof sql,
             "INSERT INTO idemgate_keys (route, scope, key, fingerprint, state, token, lease_until, created_at,"
             " expires_at, status) SELECT '%s', decode(md5('%s' || i) || md5('s' || i), 'hex'),"
             " '%s-' || lpad(i::text, 3, '0'), '\\x00', '%s', 1, now() + %d * interval '1 s',"
             " date_trunc('second', now()) - %d * interval '1 s', now() + interval '1 hour', 200"
             " FROM generate_series(1, %d) AS i",
             route, prefix, prefix, state, lease_s, secs, n);
    free(e2e_psql(sql));
}

/* GET path on the admin listener: the parsed JSON object of a 200 (caller decrefs). */
static json_t *page(const struct e2e_gw *g, const char *path)
{
    struct e2e_resp r;
    admin(g, "GET", path, NULL, &r);
    cr_assert_eq(r.status, 200, "GET %s: %ld %s", path, r.status, r.body ? (const char *)r.body : "");
    json_error_t err;
    json_t *j = json_loadb((const char *)r.body, r.body_len, 0, &err);
    cr_assert(json_is_object(j), "an object: %s", r.body);
    cr_assert(json_is_array(json_object_get(j, "records")), "records: %s", r.body);
    json_t *nc = json_object_get(j, "next_cursor");
    cr_assert(json_is_null(nc) || json_is_string(nc), "next_cursor: %s", r.body);
    e2e_resp_free(&r);
    return j;
}

static long status_of(const struct e2e_gw *g, const char *method, const char *path, const char *body)
{
    struct e2e_resp r;
    admin(g, method, path, body, &r);
    long st = r.status;
    if (st >= 400) {
        const char *ct = e2e_resp_header(&r, "Content-Type");
        cr_expect(ct && strncmp(ct, "application/problem+json", 24) == 0, "%s %s: a problem: %s", method, path,
                  r.body ? (const char *)r.body : "");
    }
    e2e_resp_free(&r);
    return st;
}

Test(keys, listing_pages_newest_first_and_is_stable_while_records_are_added)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_route(up, "keyslist");
    free(e2e_psql("DELETE FROM idemgate_keys WHERE route = 'keyslist'"));
    for (int s = 0; s < 6; s++) /* 30 records, five per second: ties broken by key and scope */
        insert_records("keyslist",
                       s == 0   ? "a"
                       : s == 1 ? "b"
                       : s == 2 ? "c"
                       : s == 3 ? "d"
                       : s == 4 ? "e"
                                : "f",
                       5, 100 + 10 * s, "completed", -1);
    char seen[64][32];
    int nseen = 0, pages = 0;
    char path[2048] = "/admin/keys?route=keyslist&limit=7";
    const char *last_created = NULL;
    char last_buf[64] = "";
    for (;;) {
        json_t *j = page(gw, path);
        json_t *recs = json_object_get(j, "records");
        cr_assert(json_array_size(recs) <= 7, "at most limit records");
        size_t i;
        json_t *rec;
        json_array_foreach(recs, i, rec)
        {
            const char *key = json_string_value(json_object_get(rec, "key"));
            const char *created = json_string_value(json_object_get(rec, "created_at"));
            cr_assert(key && created, "key and created_at");
            cr_expect(strncmp(key, "new-", 4) != 0, "a record added after the first page never shows: %s", key);
            for (int k = 0; k < nseen; k++)
                cr_expect(strcmp(seen[k], key) != 0, "key %s listed twice", key);
            cr_assert(nseen < 64);
            snprintf(seen[nseen++], sizeof seen[0], "%s", key);
            if (last_created)
                cr_expect(strcmp(created, last_created) <= 0, "newest first: %s after %s", created, last_created);
            snprintf(last_buf, sizeof last_buf, "%s", created);
            last_created = last_buf;
        }
        pages++;
        /* records added while paging are newer than the cursor: they shift nothing */
        char prefix[16];
        snprintf(prefix, sizeof prefix, "new-%d", pages);
        insert_records("keyslist", prefix, 3, 0, "completed", -1);
        json_t *nc = json_object_get(j, "next_cursor");
        if (json_is_null(nc)) {
            json_decref(j);
            break;
        }
        cr_assert(pages < 10, "the pages end");
        snprintf(path, sizeof path, "/admin/keys?route=keyslist&limit=7&cursor=%s", json_string_value(nc));
        json_decref(j);
    }
    cr_expect_eq(nseen, 30, "every record listed once: %d", nseen);
    cr_expect_eq(pages, 5, "30 records in pages of 7: %d pages", pages);
    cr_expect_str_eq(seen[0], "a-005", "the newest first (ties: the key, descending)");

    /* a full first page now starts with the records added meanwhile */
    json_t *j = page(gw, "/admin/keys?route=keyslist&limit=1000");
    cr_expect_eq(json_array_size(json_object_get(j, "records")), 30 + 3 * 5, "all records");
    cr_expect(json_is_null(json_object_get(j, "next_cursor")), "no next page");
    json_decref(j);
    j = page(gw, "/admin/keys?route=keyslist");
    cr_expect_eq(json_array_size(json_object_get(j, "records")), 45, "default limit 100");
    json_decref(j);
    e2e_gw_stop(gw, 5000);
}

Test(keys, listing_filters_by_state_and_age_and_refuses_bad_parameters)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_route(up, "keysfilter");
    free(e2e_psql("DELETE FROM idemgate_keys WHERE route = 'keysfilter'"));
    insert_records("keysfilter", "done", 4, 5, "completed", -1);
    insert_records("keysfilter", "old", 2, 3600, "completed", -1);
    insert_records("keysfilter", "live", 3, 5, "in_flight", 600);  /* within its lease: in flight */
    insert_records("keysfilter", "lapsed", 2, 5, "in_flight", -1); /* listed as unknown */
    insert_records("keysfilter", "unk", 1, 5, "unknown", 60);
    struct {
        const char *query;
        size_t want;
    } cases[] = {
        {"", 12},
        {"&state=completed", 6},
        {"&state=in_flight", 3},
        {"&state=unknown", 3},
        {"&older_than=30m", 2},
        {"&older_than=1m&state=completed", 2},
        {"&older_than=1m&state=unknown", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char path[256];
        snprintf(path, sizeof path, "/admin/keys?route=keysfilter%s", cases[i].query);
        json_t *j = page(gw, path);
        json_t *recs = json_object_get(j, "records");
        cr_expect_eq(json_array_size(recs), cases[i].want, "%s: %zu records, want %zu", path, json_array_size(recs),
                     cases[i].want);
        size_t k;
        json_t *rec;
        const char *st = strstr(cases[i].query, "state=");
        json_array_foreach(recs, k, rec)
        {
            if (st) /* state= is the query's last parameter */
                cr_expect_str_eq(json_string_value(json_object_get(rec, "state")), st + 6, "%s", path);
        }
        json_decref(j);
    }

    static const char *const bad[] = {
        "/admin/keys?route=keysfilter&limit=0",
        "/admin/keys?route=keysfilter&limit=1001",
        "/admin/keys?route=keysfilter&limit=abc",
        "/admin/keys?route=keysfilter&limit=-1",
        "/admin/keys?route=keysfilter&state=done",
        "/admin/keys?route=keysfilter&older_than=soon",
        "/admin/keys?route=keysfilter&cursor=garbage!",
        "/admin/keys?route=keysfilter&cursor=Z2FyYmFnZQ",                               /* "garbage" */
        "/admin/keys?route=keysfilter&cursor=MjAyNi0wMS0wMSAwMDowMDowMC4wMDAwMDB8YWJ8", /* no key */
        "/admin/keys?route=keysfilter&cursor=",
        "/admin/keys?route=keysfilter&limit=5&limit=6",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_expect_eq(status_of(gw, "GET", bad[i], NULL), 400, "%s", bad[i]);
    cr_expect_eq(status_of(gw, "GET", "/admin/keys?route=keysfilter&limit=1000", NULL), 200, "limit 1000");
    cr_expect_eq(status_of(gw, "GET", "/admin/keys?route=no-such-route", NULL), 404, "an unknown route");
    struct e2e_req rq = {.method = "GET", .path = "/admin/keys?route=keysfilter", .timeout_ms = 5000};
    struct e2e_resp r;
    e2e_http(gw->admin_port, &rq, &r);
    cr_expect_eq(r.status, 401, "the token is needed");
    e2e_resp_free(&r);
    /* with key= the answer stays an array */
    admin(gw, "GET", "/admin/keys?route=keysfilter&key=done-001", NULL, &r);
    cr_expect_eq(r.status, 200);
    cr_expect(r.body && r.body[0] == '[' && strstr((const char *)r.body, "done-001"), "an array: %s", r.body);
    e2e_resp_free(&r);
    e2e_gw_stop(gw, 5000);
}

/* The scope (hex) of route's record key, from the listing of unknown outcomes; "" when not listed. */
static void unknown_scope(const struct e2e_gw *g, const char *route, const char *key, char *out, size_t n)
{
    char path[256];
    snprintf(path, sizeof path, "/admin/keys?route=%s&state=unknown&limit=1000", route);
    json_t *j = page(g, path);
    size_t i;
    json_t *rec;
    out[0] = '\0';
    json_array_foreach(json_object_get(j, "records"), i, rec)
    {
        if (strcmp(json_string_value(json_object_get(rec, "key")), key) == 0)
            snprintf(out, n, "%s", json_string_value(json_object_get(rec, "scope")));
    }
    json_decref(j);
}

static const char *const slow[] = {"X-Test-Delay-Ms: 2500", NULL};

Test(keys, settle_turns_an_unknown_outcome_into_the_answer_retries_replay)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_route(up, "keyssettle");
    char key[64], path[512];
    e2e_mkkey(key, sizeof key, "settle");
    struct e2e_resp r;
    /* the upstream takes 2.5 s, the gateway waits 1 s: 504, an unknown outcome */
    e2e_http_key(gw->port, "POST", "/v1/pay", key, slow, "{\"amount\":42}", 0, &r);
    e2e_expect_problem(&r, 504, "upstream-timeout", "first attempt");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_wait_count(up, key, 1, 3000), 1, "the first attempt reached the upstream");
    /* the timeout is an upstream request without an answer: class none, on its route and upstream */
    e2e_get(gw->admin_port, "/metrics", &r);
    const char *none[] = {"route=\"keyssettle\"", "upstream=\"api\"", "class=\"none\"", NULL};
    const char *series[] = {"route=\"keyssettle\"", "upstream=\"api\"", NULL};
    const char *nolabel[] = {NULL};
    cr_expect_eq(e2e_metric_value((const char *)r.body, "idemgate_upstream_responses_total", none), 1, "class none");
    cr_expect_eq(e2e_metric_value((const char *)r.body, "idemgate_upstream_seconds_count", series), 1);
    cr_expect_gt(e2e_metric_value((const char *)r.body, "process_open_fds", nolabel), 5);
    cr_expect_gt(e2e_metric_value((const char *)r.body, "process_resident_memory_bytes", nolabel), 1 << 20);
    cr_expect_gt(e2e_metric_value((const char *)r.body, "process_start_time_seconds", nolabel), 1.7e9);
    e2e_resp_free(&r);
    char scope[80];
    unknown_scope(gw, "keyssettle", key, scope, sizeof scope);
    cr_assert_eq(strlen(scope), 64, "the unknown outcome is listed with its scope");

    /* bad bodies and parameters: 400, nothing changes */
    static const char *const bad[] = {
        "",
        "[]",
        "{\"status\":99}",
        "{\"status\":600}",
        "{\"status\":\"201\"}",
        "{\"status\":201,\"headers\":[[\"Bad Name\",\"x\"]]}",
        "{\"status\":201,\"headers\":[[\"X-A\",\"a\\u0001b\"]]}",
        "{\"status\":201,\"headers\":[[\"Content-Length\",\"5\"]]}",
        "{\"status\":201,\"headers\":[\"X-A\"]}",
        "{\"status\":201,\"body_base64\":\"!!!!\"}",
        "{\"status\":201,\"extra\":1}",
        "{\"status\":201,\"status\":202}",
    };
    snprintf(path, sizeof path, "/admin/keys/settle?route=keyssettle&key=%s&scope=%s", key, scope);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_expect_eq(status_of(gw, "POST", path, bad[i]), 400, "body %s", bad[i]);
    char nopath[512];
    snprintf(nopath, sizeof nopath, "/admin/keys/settle?route=keyssettle&key=%s", key);
    cr_expect_eq(status_of(gw, "POST", nopath, "{\"status\":201}"), 400, "no scope");
    snprintf(nopath, sizeof nopath, "/admin/keys/settle?route=nosuchroute&key=%s&scope=%s", key, scope);
    cr_expect_eq(status_of(gw, "POST", nopath, "{\"status\":201}"), 404, "an unknown route");
    snprintf(nopath, sizeof nopath, "/admin/keys/settle?route=keyssettle&key=%s-absent&scope=%s", key, scope);
    cr_expect_eq(status_of(gw, "POST", nopath, "{\"status\":201}"), 404, "an absent record");

    /* the retry is still told the outcome is unknown (or in use within the lease) */
    e2e_http_key(gw->port, "POST", "/v1/pay", key, NULL, "{\"amount\":42}", 0, &r);
    cr_expect(r.status == 409 || r.status == 504, "before the settle: %ld", r.status);
    e2e_resp_free(&r);

    /* {"id":"pay_42","ok":true} */
    const char *settle = "{\"status\":201,\"headers\":[[\"Content-Type\",\"application/json\"],[\"X-Settled\",\"by "
                         "hand\"]],\"body_base64\":\"eyJpZCI6InBheV80MiIsIm9rIjp0cnVlfQ==\"}";
    admin(gw, "POST", path, settle, &r);
    cr_expect_eq(r.status, 200, "settle: %ld %s", r.status, r.body ? (const char *)r.body : "");
    cr_expect(r.body && strstr((const char *)r.body, "\"settled\":true"), "%s", r.body);
    e2e_resp_free(&r);
    cr_expect(e2e_gw_log_contains(gw, "event=admin_action action=settle route=\"keyssettle\" key="),
              "the action is logged");
    cr_expect(!e2e_gw_log_contains(gw, scope), "never the scope");

    for (int i = 0; i < 2; i++) { /* the retry, twice: the settled answer, byte for byte */
        e2e_http_key(gw->port, "POST", "/v1/pay", key, NULL, "{\"amount\":42}", 0, &r);
        cr_expect_eq(r.status, 201, "the retry replays the settled answer: %ld %s", r.status, r.body);
        cr_expect(e2e_resp_is_replay(&r), "a replay");
        cr_expect_eq(r.body_len, strlen("{\"id\":\"pay_42\",\"ok\":true}"));
        cr_expect(r.body && strcmp((const char *)r.body, "{\"id\":\"pay_42\",\"ok\":true}") == 0, "body %s", r.body);
        const char *xs = e2e_resp_header(&r, "X-Settled");
        cr_expect(xs && strcmp(xs, "by hand") == 0, "the settled header: %s", xs ? xs : "(none)");
        const char *ct = e2e_resp_header(&r, "Content-Type");
        cr_expect(ct && strcmp(ct, "application/json") == 0, "Content-Type %s", ct ? ct : "(none)");
        e2e_resp_free(&r);
    }
    cr_expect_eq(e2e_upstream_count(up, key), 1, "never executed again");
    /* a completed record is not settled again */
    cr_expect_eq(status_of(gw, "POST", path, settle), 409, "settle of a completed record");
    e2e_gw_stop(gw, 5000);
}

/* idemgate keys ARGS... against g's admin listener (the token in the environment unless no_token): exit code. */
static int cli(const struct e2e_gw *g, bool no_token, char **out, char **err, const char *const *args)
{
    char admin_url[64];
    snprintf(admin_url, sizeof admin_url, "--admin=http://127.0.0.1:%u/", (unsigned)g->admin_port);
    const char *argv[32] = {e2e_env("IDEMGATE_BIN"), "keys"};
    int n = 2;
    for (; args[n - 2] && n < 30; n++)
        argv[n] = args[n - 2];
    if (n > 2 && strcmp(argv[2], "--help") != 0)
        argv[n++] = admin_url;
    argv[n] = NULL;
    static const char *const env[] = {"IDEMGATE_ADMIN_TOKEN=" ADMIN_TOKEN, NULL};
    static const char *const noenv[] = {"IDEMGATE_ADMIN_TOKEN=", NULL};
    return e2e_run(argv, no_token ? noenv : env, 20000, out, err);
}

Test(keys, the_cli_lists_shows_settles_and_purges_with_exit_codes)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_route(up, "keyscli");
    free(e2e_psql("DELETE FROM idemgate_keys WHERE route = 'keyscli'"));
    insert_records("keyscli", "old", 4, 600, "completed", -1);
    char key[64];
    e2e_mkkey(key, sizeof key, "cli");
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay", key, slow, "{\"amount\":7}", 0, &r);
    e2e_expect_problem(&r, 504, "upstream-timeout", "first attempt");
    char rid504[160]; /* the request that executed: every replay's line names it */
    snprintf(rid504, sizeof rid504, "%s", e2e_resp_header(&r, "X-Request-Id") ?: "(none)");
    char *l = e2e_gw_access_line(gw, rid504, 5000);
    cr_expect(l && strstr(l, " status=504 ") && strstr(l, " outcome="), "the 504 unknown outcome is logged: %s",
              l ? l : "(no line)");
    cr_log_info("504: %s", l ? l : "");
    free(l);
    e2e_resp_free(&r);

    char *out = NULL, *err = NULL;
    /* a table for people: the unknown outcome first (newest), then the four others */
    cr_expect_eq(cli(gw, false, &out, &err, (const char *const[]){"list", "--route", "keyscli", NULL}), 0, "list: %s",
                 err);
    cr_expect(strncmp(out, "KEY ", 4) == 0, "a table with a header: %s", out);
    const char *line2 = strchr(out, '\n');
    cr_expect(line2 && strncmp(line2 + 1, key, strlen(key)) == 0 && strstr(line2, "unknown"), "newest first: %s", out);
    cr_expect(strstr(out, "old-004") && strstr(out, "completed"), "%s", out);
    free(out);
    free(err);

    /* --json, paged one record at a time with --all: one page a line, five records in all */
    cr_expect_eq(cli(gw, false, &out, &err,
                     (const char *const[]){"list", "--route", "keyscli", "--limit", "1", "--all", "--json", NULL}),
                 0, "list --all: %s", err);
    size_t records = 0, pages = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n"), pages++) {
        json_t *j = json_loads(line, 0, NULL);
        cr_assert(json_is_object(j), "a page a line: %s", line);
        records += json_array_size(json_object_get(j, "records"));
        json_decref(j);
    }
    cr_expect_eq(records, 5, "every record once: %zu", records);
    cr_expect_eq(pages, 5, "pages of one: %zu", pages);
    free(out);
    free(err);

    cr_expect_eq(cli(gw, false, &out, &err,
                     (const char *const[]){"list", "--route", "keyscli", "--state", "unknown", "--json", NULL}),
                 0);
    json_t *j = json_loads(out, 0, NULL);
    cr_expect_eq(json_array_size(json_object_get(j, "records")), 1, "the unknown outcome alone: %s", out);
    json_decref(j);
    free(out);
    free(err);

    cr_expect_eq(
        cli(gw, false, &out, &err, (const char *const[]){"show", "--route", "keyscli", "--key", key, "--json", NULL}),
        0);
    j = json_loads(out, 0, NULL);
    cr_expect(json_is_array(j) && json_array_size(j) == 1, "show --json: the key's records: %s", out);
    json_decref(j);
    free(out);
    free(err);

    /* settle without --scope: the key's only record */
    cr_expect_eq(cli(gw, false, &out, &err,
                     (const char *const[]){"settle", "--route", "keyscli", "--key", key, "--status", "201", "--header",
                                           "Content-Type: application/json", "--body", "{\"id\":7}", NULL}),
                 0, "settle: %s", err);
    cr_expect(strstr(out, "settled") != NULL, "%s", out);
    free(out);
    free(err);
    /* the retries replay the settled answer (from the store, then from the replay cache); each access line says
     * so and names the request that executed (the 504), not the admin's */
    char want[200];
    snprintf(want, sizeof want, " original_request_id=%s ", rid504);
    for (int i = 0; i < 2; i++) {
        e2e_http_key(gw->port, "POST", "/v1/pay", key, NULL, "{\"amount\":7}", 0, &r);
        cr_expect_eq(r.status, 201, "the retry replays the settled answer: %ld", r.status);
        cr_expect(e2e_resp_is_replay(&r));
        cr_expect(r.body && strcmp((const char *)r.body, "{\"id\":7}") == 0, "%s", r.body);
        const char *rid = e2e_resp_header(&r, "X-Request-Id");
        cr_assert(rid && strcmp(rid, rid504) != 0, "the replay has its own id");
        l = e2e_gw_access_line(gw, rid, 5000);
        cr_expect(l && strstr(l, " status=201 ") && strstr(l, " outcome=replayed ") && strstr(l, " replayed=true") &&
                      strstr(l, want),
                  "replay %d after the settle: %s", i, l ? l : "(no line)");
        cr_log_info("replay %d: %s", i, l ? l : "");
        free(l);
        e2e_resp_free(&r);
    }

    /* error answers: exit 1 with the problem on stderr */
    cr_expect_eq(cli(gw, false, &out, &err,
                     (const char *const[]){"settle", "--route", "keyscli", "--key", key, "--status", "201", NULL}),
                 1, "settle again");
    cr_expect(strstr(err, "409") != NULL, "the 409 is told: %s", err);
    free(out);
    free(err);
    cr_expect_eq(
        cli(gw, false, &out, &err, (const char *const[]){"release", "--route", "keyscli", "--key", "nosuch", NULL}), 1,
        "release of an absent key");
    cr_expect(strstr(err, "404") != NULL, "%s", err);
    free(out);
    free(err);
    cr_expect_eq(cli(gw, false, NULL, &err, (const char *const[]){"list", "--route", "no-such-route", NULL}), 1,
                 "an unknown route");
    free(err);
    cr_expect_eq(
        cli(gw, false, &out, &err, (const char *const[]){"purge", "--route", "keyscli", "--key", key, "--json", NULL}),
        0, "purge: %s", err);
    cr_expect(strstr(out, "\"deleted\":1") != NULL, "%s", out);
    free(out);
    free(err);

    /* usage errors: exit 2, and what is wrong */
    const char *const *usage[] = {
        (const char *const[]){NULL},
        (const char *const[]){"bogus", "--route", "keyscli", NULL},
        (const char *const[]){"list", NULL},
        (const char *const[]){"show", "--route", "keyscli", NULL},
        (const char *const[]){"list", "--route", "keyscli", "--key", "k", NULL},
        (const char *const[]){"settle", "--route", "keyscli", "--key", "k", NULL},
        (const char *const[]){"settle", "--route", "keyscli", "--key", "k", "--status", "99", NULL},
        (const char *const[]){"list", "--route", "keyscli", "--frobnicate", NULL},
        (const char *const[]){"list", "--route", NULL},
    };
    for (size_t i = 0; i < sizeof usage / sizeof usage[0]; i++) {
        cr_expect_eq(cli(gw, false, NULL, &err, usage[i]), 2, "usage error %zu", i);
        cr_expect(strstr(err, "usage:") != NULL, "usage %zu: %s", i, err);
        free(err);
    }
    cr_expect_eq(cli(gw, true, NULL, &err, (const char *const[]){"list", "--route", "keyscli", NULL}), 2, "no token");
    cr_expect(strstr(err, "IDEMGATE_ADMIN_TOKEN") != NULL, "%s", err);
    free(err);
    e2e_gw_stop(gw, 5000);
}
