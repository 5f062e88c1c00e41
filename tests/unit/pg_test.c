/* pg_test.c - the Postgres pool's batches against a real Postgres: batchable queries that wait together share one
 * transaction (one commit), run in row order (as one multi-row statement when the statement has that form, each
 * query still getting its own rows), and roll back as a whole when one of them fails: that one gets its error, the
 * others run again. Needs IDEMGATE_TEST_PG_URL (scripts/services.sh). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <event2/event.h>
#include <libpq-fe.h>

#include "common/common.h"
#include "store/pg.h"

#define OID_INT4       23
#define OID_INT4_ARRAY 1007

/* One table per test (the tests run in parallel): t_<pid>_<name>. */
static char table[64];

static PGconn *admin_conn(void)
{
    const char *url = getenv("IDEMGATE_TEST_PG_URL");
    cr_assert(url && *url, "IDEMGATE_TEST_PG_URL is not set: start the services with scripts/services.sh");
    PGconn *c = PQconnectdb(url);
    cr_assert_eq(PQstatus(c), CONNECTION_OK, "connect: %s", PQerrorMessage(c));
    PGresult *r = PQexec(c, "SET client_min_messages = warning");
    PQclear(r);
    return c;
}

static void exec_ok(PGconn *c, const char *sql)
{
    PGresult *r = PQexec(c, sql);
    ExecStatusType st = PQresultStatus(r);
    cr_assert(st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK, "%s: %s", sql, PQresultErrorMessage(r));
    PQclear(r);
}

static char *query_text(PGconn *c, const char *sql)
{
    PGresult *r = PQexec(c, sql);
    cr_assert_eq(PQresultStatus(r), PGRES_TUPLES_OK, "%s: %s", sql, PQresultErrorMessage(r));
    struct cm_buf b;
    cm_buf_init(&b, 1 << 16);
    for (int i = 0; i < PQntuples(r); i++) {
        if (i > 0)
            cr_assert(cm_buf_append(&b, ",", 1));
        cr_assert(cm_buf_append(&b, PQgetvalue(r, i, 0), strlen(PQgetvalue(r, i, 0))));
    }
    PQclear(r);
    size_t n;
    char *s = cm_buf_take(&b, &n);
    cm_buf_free(&b);
    return s ? s : cm_strdup("");
}

/* ---- the pool under test */

enum { S_INSERT, S_SLEEP, S_LONE, S_ISO, S_TOUCH, S_SLOW_A, S_SLOW_B, S__N };
static char sql_insert[160], sql_insert_multi[320], sql_lone[160], sql_touch[160], sql_slow[160];
static const Oid int4_type[] = {OID_INT4};
static const Oid int4_array_type[] = {OID_INT4_ARRAY};
static struct store_pg_stmt stmts[S__N];

struct result {
    int done;
    enum store_pg_status st;
    int rows;
    int32_t k; /* the inserted key its result row names */
};

struct fixture {
    struct event_base *base;
    struct store_pg *pool;
    struct store_pg_opts opts;
    PGconn *admin;
    int pending;
};

static void query_cb(void *arg, enum store_pg_status st, const PGresult *res, const char *msg)
{
    struct result *r = arg;
    (void)msg;
    r->done++;
    r->st = st;
    if (res && PQresultStatus(res) == PGRES_TUPLES_OK) {
        r->rows = PQntuples(res);
        if (r->rows > 0 && PQnfields(res) >= 2)
            r->k = store_pg_get_i32(res, 0, 1);
    }
}

static void setup_pool(struct fixture *f, const char *name, unsigned max_batch)
{
    memset(f, 0, sizeof *f);
    snprintf(table, sizeof table, "t_%ld_%s", (long)getpid(), name);
    f->admin = admin_conn();
    char sql[1024];
    /* a statement-level trigger counts the INSERT statements that ran */
    snprintf(sql, sizeof sql,
             "DROP TABLE IF EXISTS %s; CREATE TABLE %s (id bigserial, k int PRIMARY KEY CHECK (k > 0));"
             "DROP TABLE IF EXISTS %s_n; CREATE TABLE %s_n (n int);"
             "CREATE OR REPLACE FUNCTION %s_f() RETURNS trigger LANGUAGE plpgsql AS"
             " $$BEGIN INSERT INTO %s_n VALUES (1); RETURN NULL; END$$;"
             "CREATE TRIGGER %s_t AFTER INSERT ON %s FOR EACH STATEMENT EXECUTE FUNCTION %s_f()",
             table, table, table, table, table, table, table, table, table);
    exec_ok(f->admin, sql);
    snprintf(sql_insert, sizeof sql_insert, "INSERT INTO %s (k) VALUES ($1) RETURNING id, k", table);
    snprintf(sql_insert_multi, sizeof sql_insert_multi,
             "WITH u AS (SELECT * FROM unnest($1::int4[]) WITH ORDINALITY AS u(k, n)),"
             " ins AS (INSERT INTO %s (k) SELECT k FROM u RETURNING id, k)"
             " SELECT u.n, ins.id, ins.k FROM u JOIN ins ON ins.k = u.k",
             table);
    snprintf(sql_lone, sizeof sql_lone, "INSERT INTO %s (k) VALUES ($1)", table);
    stmts[S_INSERT] =
        (struct store_pg_stmt){"t_insert", sql_insert, 1, int4_type, 1, sql_insert_multi, int4_array_type, NULL};
    stmts[S_SLEEP] = (struct store_pg_stmt){"t_sleep", "SELECT pg_sleep(0.3)", 0, NULL, 0, NULL, NULL, NULL};
    stmts[S_LONE] = (struct store_pg_stmt){"t_lone", sql_lone, 1, int4_type, 0, NULL, NULL, NULL};
    snprintf(sql_touch, sizeof sql_touch, "UPDATE %s SET id = id WHERE k = $1", table);
    stmts[S_TOUCH] = (struct store_pg_stmt){"t_touch", sql_touch, 1, int4_type, 1, NULL, NULL, NULL};
    /* two statement kinds that wait 0.2 s before locking their row */
    snprintf(sql_slow, sizeof sql_slow, "UPDATE %s SET id = id WHERE k = $1 AND pg_sleep(0.2) IS NOT NULL", table);
    stmts[S_SLOW_A] = (struct store_pg_stmt){"t_slow_a", sql_slow, 1, int4_type, 1, NULL, NULL, NULL};
    stmts[S_SLOW_B] = (struct store_pg_stmt){"t_slow_b", sql_slow, 1, int4_type, 1, NULL, NULL, NULL};
    stmts[S_ISO] = (struct store_pg_stmt){
        "t_iso", "SELECT current_setting('transaction_isolation'), current_setting('default_transaction_isolation')",
        0,       NULL,
        0,       NULL,
        NULL,    NULL};
    f->base = event_base_new();
    cr_assert(f->base);
    f->opts = (struct store_pg_opts){
        .conninfo = getenv("IDEMGATE_TEST_PG_URL"),
        .size = 1,
        .queue_timeout_ms = 10000,
        .run_timeout_ms = 10000,
        .connect_timeout_ms = 5000,
        .max_queue = 1000,
        .max_batch = max_batch,
        .stmts = stmts,
        .nstmts = S__N,
    };
    f->pool = store_pg_create(f->base, &f->opts);
}

static void teardown_pool(struct fixture *f)
{
    store_pg_destroy(f->pool);
    event_base_free(f->base);
    char sql[320];
    snprintf(sql, sizeof sql, "DROP TABLE IF EXISTS %s; DROP TABLE IF EXISTS %s_n; DROP FUNCTION IF EXISTS %s_f()",
             table, table, table);
    exec_ok(f->admin, sql);
    PQfinish(f->admin);
}

static void run_until(struct fixture *f, const struct result *rs, size_t n)
{
    uint64_t deadline = cm_now_ms() + 15000;
    for (;;) {
        size_t done = 0;
        for (size_t i = 0; i < n; i++)
            done += rs[i].done > 0;
        if (done == n)
            break;
        cr_assert(cm_now_ms() < deadline, "queries did not finish in 15 s (%zu of %zu)", done, n);
        event_base_loop(f->base, EVLOOP_ONCE);
    }
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(rs[i].done, 1, "query %zu called back %d times", i, rs[i].done);
}

static void wait_up(struct fixture *f)
{
    uint64_t deadline = cm_now_ms() + 15000;
    while (!store_pg_up(f->pool)) {
        cr_assert(cm_now_ms() < deadline, "postgres pool never came up");
        event_base_loop(f->base, EVLOOP_ONCE);
    }
}

static void insert(struct fixture *f, size_t stmt, int32_t k, struct result *r)
{
    uint8_t v[4] = {(uint8_t)((uint32_t)k >> 24), (uint8_t)((uint32_t)k >> 16), (uint8_t)((uint32_t)k >> 8),
                    (uint8_t)k};
    struct store_pg_param p = {v, sizeof v, true};
    store_pg_query(f->pool, stmt, &p, 1, 1, query_cb, r);
}

/* Occupies the only connection, so that what follows waits in the queue together. */
static void occupy(struct fixture *f, struct result *r)
{
    store_pg_query(f->pool, S_SLEEP, NULL, 0, 0, query_cb, r);
}

Test(pg_batch, waiting_queries_share_one_transaction_in_row_order)
{
    struct fixture f;
    setup_pool(&f, "order", 16);
    wait_up(&f);
    struct result rs[7] = {0};
    occupy(&f, &rs[0]);
    const int32_t keys[6] = {50, 30, 90, 10, 70, 20};
    for (int i = 0; i < 6; i++)
        insert(&f, S_INSERT, keys[i], &rs[i + 1]);
    run_until(&f, rs, 7);
    for (int i = 0; i < 7; i++)
        cr_expect_eq(rs[i].st, STORE_PG_OK, "query %d: %s", i, store_pg_status_name(rs[i].st));
    for (int i = 0; i < 6; i++) { /* each its own row back, from the one multi-row statement */
        cr_expect_eq(rs[i + 1].rows, 1, "insert of %d: %d rows", keys[i], rs[i + 1].rows);
        cr_expect_eq(rs[i + 1].k, keys[i], "insert of %d got the row of %d", keys[i], rs[i + 1].k);
    }
    char sql[256];
    snprintf(sql, sizeof sql, "SELECT count(DISTINCT xmin::text)::text FROM %s", table);
    char *s = query_text(f.admin, sql);
    cr_expect_str_eq(s, "1", "six waiting inserts committed in %s transactions, not one", s);
    free(s);
    snprintf(sql, sizeof sql, "SELECT k::text FROM %s ORDER BY id", table);
    s = query_text(f.admin, sql);
    cr_expect_str_eq(s, "10,20,30,50,70,90", "the batch ran in row order: %s", s);
    free(s);
    snprintf(sql, sizeof sql, "SELECT count(*)::text FROM %s_n", table);
    s = query_text(f.admin, sql);
    cr_expect_str_eq(s, "1", "six waiting inserts ran as %s statements, not one multi-row statement", s);
    free(s);
    teardown_pool(&f);
}

Test(pg_batch, one_failure_fails_only_its_own_query)
{
    struct fixture f;
    setup_pool(&f, "fail", 16);
    wait_up(&f);
    struct result rs[5] = {0};
    occupy(&f, &rs[0]);
    insert(&f, S_INSERT, 5, &rs[1]);
    insert(&f, S_INSERT, 6, &rs[2]);
    insert(&f, S_INSERT, -1, &rs[3]); /* violates the CHECK: the multi-row insert fails, then it alone */
    insert(&f, S_INSERT, 7, &rs[4]);
    run_until(&f, rs, 5);
    cr_expect_eq(rs[0].st, STORE_PG_OK);
    cr_expect_eq(rs[3].st, STORE_PG_SQL_ERROR, "the failing insert: %s", store_pg_status_name(rs[3].st));
    cr_expect_eq(rs[1].st, STORE_PG_OK, "run again after the rollback: %s", store_pg_status_name(rs[1].st));
    cr_expect_eq(rs[2].st, STORE_PG_OK, "run again after the rollback: %s", store_pg_status_name(rs[2].st));
    cr_expect_eq(rs[4].st, STORE_PG_OK, "run again after the rollback: %s", store_pg_status_name(rs[4].st));
    cr_expect_eq(rs[4].k, 7, "the insert of 7 got the row of %d", rs[4].k);
    char sql[160];
    snprintf(sql, sizeof sql, "SELECT string_agg(k::text, ',' ORDER BY k) FROM %s", table);
    char *s = query_text(f.admin, sql);
    cr_expect_str_eq(s, "5,6,7", "rows: %s", s);
    free(s);
    /* each row once: the rolled-back attempts left nothing behind */
    snprintf(sql, sizeof sql, "SELECT count(*)::text FROM %s", table);
    s = query_text(f.admin, sql);
    cr_expect_str_eq(s, "3", "%s rows", s);
    free(s);
    teardown_pool(&f);
}

Test(pg_batch, statements_that_are_not_batchable_run_alone)
{
    struct fixture f;
    setup_pool(&f, "lone", 16);
    wait_up(&f);
    struct result rs[5] = {0};
    occupy(&f, &rs[0]);
    insert(&f, S_INSERT, 1, &rs[1]);
    insert(&f, S_LONE, 2, &rs[2]);
    insert(&f, S_INSERT, 3, &rs[3]);
    insert(&f, S_INSERT, 4, &rs[4]);
    run_until(&f, rs, 5);
    for (int i = 0; i < 5; i++)
        cr_expect_eq(rs[i].st, STORE_PG_OK, "query %d: %s", i, store_pg_status_name(rs[i].st));
    char sql[256];
    snprintf(sql, sizeof sql, "SELECT string_agg(k::text, '+' ORDER BY k) FROM %s GROUP BY xmin::text ORDER BY min(id)",
             table);
    char *s = query_text(f.admin, sql);
    cr_expect_str_eq(s, "1,2,3+4", "transactions (rows joined by +): %s", s);
    free(s);
    teardown_pool(&f);
}

Test(pg_batch, without_batching_each_query_commits_alone)
{
    struct fixture f;
    setup_pool(&f, "nobatch", 1);
    wait_up(&f);
    struct result rs[4] = {0};
    occupy(&f, &rs[0]);
    for (int i = 0; i < 3; i++)
        insert(&f, S_INSERT, i + 1, &rs[i + 1]);
    run_until(&f, rs, 4);
    char sql[128];
    snprintf(sql, sizeof sql, "SELECT count(DISTINCT xmin::text)::text FROM %s", table);
    char *s = query_text(f.admin, sql);
    cr_expect_str_eq(s, "3", "max_batch 1: %s transactions for three inserts", s);
    free(s);
    teardown_pool(&f);
}

/* While few queries wait, the pool holds them up to 5 ms for a busy connection (to batch them); behind a query
 * that takes longer, they must go to another connection (opened on demand) instead of waiting for it. */
Test(pg_batch, held_queries_never_wait_behind_a_long_query)
{
    struct fixture f;
    setup_pool(&f, "hold", 16);
    f.opts.size = 2; /* the pool reads its options at creation: make a second one with two connections */
    store_pg_destroy(f.pool);
    f.pool = store_pg_create(f.base, &f.opts);
    wait_up(&f);
    struct result rs[4] = {0};
    uint64_t t0 = cm_now_ms();
    occupy(&f, &rs[0]); /* 300 ms on the first connection */
    insert(&f, S_INSERT, 1, &rs[1]);
    insert(&f, S_INSERT, 2, &rs[2]);
    insert(&f, S_INSERT, 3, &rs[3]);
    run_until(&f, rs + 1, 3);
    uint64_t inserts_ms = cm_now_ms() - t0;
    cr_expect_eq(rs[0].done, 0, "the inserts waited behind the 300 ms query (done after %llu ms)",
                 (unsigned long long)inserts_ms);
    run_until(&f, rs, 1);
    for (int i = 0; i < 4; i++)
        cr_expect_eq(rs[i].st, STORE_PG_OK, "query %d: %s", i, store_pg_status_name(rs[i].st));
    char sql[160];
    snprintf(sql, sizeof sql, "SELECT count(DISTINCT xmin::text)::text FROM %s", table);
    char *s = query_text(f.admin, sql);
    cr_expect_str_eq(s, "1", "the three held inserts went together: %s transactions", s);
    free(s);
    teardown_pool(&f);
}

/* The multi-row completion's shape on an empty, never analysed table: with the pool's session settings the plan
 * made now (and kept by the connection while the table grows) reaches rows through the primary key. */
Test(pg_batch, index_plans_on_an_empty_table)
{
    struct fixture f;
    setup_pool(&f, "plan", 1);
    char sql[1024];
    snprintf(sql, sizeof sql,
             "DROP TABLE IF EXISTS %s_k; CREATE TABLE %s_k (route text, scope bytea, key text, token int8,"
             " status int, PRIMARY KEY (route, key, scope))",
             table, table);
    exec_ok(f.admin, sql);
    const char *explain =
        "EXPLAIN UPDATE %s_k AS k SET status = u.status FROM unnest($1::text[], $2::bytea[],"
        " $3::text[], $4::int8[], $5::int4[]) WITH ORDINALITY AS u(route, scope, key, token, status, n)"
        " WHERE k.route = u.route AND k.scope = u.scope AND k.key = u.key AND k.token = u.token";
    char q[1024];
    snprintf(q, sizeof q, explain, table);
    snprintf(sql, sizeof sql, "PREPARE plan_default (text[], bytea[], text[], int8[], int4[]) AS %s",
             strstr(q, "UPDATE"));
    exec_ok(f.admin, "SET plan_cache_mode = force_generic_plan");
    exec_ok(f.admin, sql);
    char *plain = query_text(f.admin, "EXPLAIN EXECUTE plan_default ('{}', '{}', '{}', '{}', '{}')");
    cr_expect(strstr(plain, "Seq Scan") != NULL,
              "without the settings the generic plan scans the whole table (so this test can tell): %s", plain);
    free(plain);
    exec_ok(f.admin, "DEALLOCATE plan_default");
    exec_ok(f.admin, STORE_PG_INDEX_PLANS_SQL);
    exec_ok(f.admin, sql);
    char *pinned = query_text(f.admin, "EXPLAIN EXECUTE plan_default ('{}', '{}', '{}', '{}', '{}')");
    cr_expect(strstr(pinned, "Index Scan") != NULL && strstr(pinned, "Seq Scan") == NULL,
              "with STORE_PG_INDEX_PLANS_SQL the plan uses the primary key: %s", pinned);
    free(pinned);
    snprintf(sql, sizeof sql, "DROP TABLE IF EXISTS %s_k", table);
    exec_ok(f.admin, sql);
    teardown_pool(&f);
}

/* A DEFERRABLE INITIALLY DEFERRED constraint trigger that raises for k = 13: the error comes at the implicit
 * COMMIT (at Sync), after every statement succeeded. The transaction rolled back: no query of it may get OK. */
static void add_commit_trigger(struct fixture *f)
{
    char sql[1024];
    snprintf(sql, sizeof sql,
             "CREATE OR REPLACE FUNCTION %s_d() RETURNS trigger LANGUAGE plpgsql AS"
             " $$BEGIN IF NEW.k = 13 THEN RAISE EXCEPTION 'k 13 refused at commit'; END IF; RETURN NULL; END$$;"
             "CREATE CONSTRAINT TRIGGER %s_dt AFTER INSERT ON %s DEFERRABLE INITIALLY DEFERRED"
             " FOR EACH ROW EXECUTE FUNCTION %s_d()",
             table, table, table, table);
    exec_ok(f->admin, sql);
}

static void drop_commit_trigger(struct fixture *f)
{
    char sql[256];
    snprintf(sql, sizeof sql, "DROP TRIGGER IF EXISTS %s_dt ON %s; DROP FUNCTION IF EXISTS %s_d()", table, table,
             table);
    exec_ok(f->admin, sql);
}

Test(pg_batch, a_failed_commit_alone_is_an_error)
{
    struct fixture f;
    setup_pool(&f, "commit1", 16);
    add_commit_trigger(&f);
    wait_up(&f);
    struct result rs[2] = {0};
    insert(&f, S_INSERT, 13, &rs[0]);
    run_until(&f, rs, 1);
    cr_expect_neq(rs[0].st, STORE_PG_OK, "the COMMIT failed: the query must not get OK");
    insert(&f, S_INSERT, 14, &rs[1]);
    run_until(&f, rs + 1, 1);
    cr_expect_eq(rs[1].st, STORE_PG_OK, "the connection works after the failed commit: %s",
                 store_pg_status_name(rs[1].st));
    char sql[160];
    snprintf(sql, sizeof sql, "SELECT coalesce(string_agg(k::text, ',' ORDER BY k), '') FROM %s", table);
    char *s = query_text(f.admin, sql);
    cr_expect_str_eq(s, "14", "rows: %s", s);
    free(s);
    drop_commit_trigger(&f);
    teardown_pool(&f);
}

Test(pg_batch, a_failed_commit_fails_or_reruns_every_query_of_the_batch)
{
    struct fixture f;
    setup_pool(&f, "commitn", 16);
    add_commit_trigger(&f);
    wait_up(&f);
    struct result rs[5] = {0};
    occupy(&f, &rs[0]);
    insert(&f, S_INSERT, 5, &rs[1]);
    insert(&f, S_INSERT, 13, &rs[2]);
    insert(&f, S_LONE, 6, &rs[3]);
    insert(&f, S_INSERT, 7, &rs[4]);
    run_until(&f, rs, 5);
    cr_expect_eq(rs[0].st, STORE_PG_OK);
    cr_expect_neq(rs[2].st, STORE_PG_OK, "the insert whose commit fails must not get OK");
    char sql[160];
    snprintf(sql, sizeof sql, "SELECT coalesce(string_agg(k::text, ',' ORDER BY k), '') FROM %s", table);
    char *s = query_text(f.admin, sql);
    /* every query that got OK has its row; the one that did not has none */
    char want[64] = "";
    const int32_t ks[4] = {5, 6, 7, 13};
    const int idx[4] = {1, 3, 4, 2};
    for (int i = 0; i < 4; i++) {
        if (rs[idx[i]].st == STORE_PG_OK) {
            size_t l = strlen(want);
            snprintf(want + l, sizeof want - l, "%s%d", l ? "," : "", ks[i]);
        }
    }
    cr_expect_str_eq(s, want, "rows %s, but the queries told OK: %s", s, want);
    cr_expect_eq(rs[1].st, STORE_PG_OK, "5 is innocent: run again, it succeeds (%s)", store_pg_status_name(rs[1].st));
    cr_expect_eq(rs[4].st, STORE_PG_OK, "7 is innocent: run again, it succeeds (%s)", store_pg_status_name(rs[4].st));
    free(s);
    drop_commit_trigger(&f);
    teardown_pool(&f);
}

struct iso_result {
    int done;
    enum store_pg_status st;
    char iso[64];
};

static void iso_cb(void *arg, enum store_pg_status st, const PGresult *res, const char *msg)
{
    struct iso_result *r = arg;
    (void)msg;
    r->done++;
    r->st = st;
    if (res && PQntuples(res) == 1)
        snprintf(r->iso, sizeof r->iso, "%s/%s", PQgetvalue(res, 0, 0), PQgetvalue(res, 0, 1));
}

/* A database (here: a session option) whose default isolation is serializable: the pool's transactions still run
 * at READ COMMITTED. */
Test(pg_batch, transactions_run_at_read_committed_whatever_the_default)
{
    struct fixture f;
    setup_pool(&f, "iso", 16);
    store_pg_destroy(f.pool);
    char url[512];
    const char *base = getenv("IDEMGATE_TEST_PG_URL");
    snprintf(url, sizeof url, "%s%soptions=-c%%20default_transaction_isolation%%3Dserializable", base,
             strchr(base, '?') ? "&" : "?");
    f.opts.conninfo = url;
    f.pool = store_pg_create(f.base, &f.opts);
    wait_up(&f);
    struct iso_result r = {0};
    store_pg_query(f.pool, S_ISO, NULL, 0, 0, iso_cb, &r);
    uint64_t deadline = cm_now_ms() + 15000;
    while (!r.done) {
        cr_assert(cm_now_ms() < deadline, "no answer in 15 s");
        event_base_loop(f.base, EVLOOP_ONCE);
    }
    cr_expect_eq(r.st, STORE_PG_OK, "%s", store_pg_status_name(r.st));
    cr_expect_str_eq(r.iso, "read committed/read committed", "isolation: %s", r.iso);
    /* and the connection's server default really was serializable (so that this test can tell) */
    PGconn *c = PQconnectdb(url);
    cr_assert_eq(PQstatus(c), CONNECTION_OK, "%s", PQerrorMessage(c));
    char *s = query_text(c, "SELECT current_setting('transaction_isolation')");
    cr_expect_str_eq(s, "serializable", "without the pool's setting: %s", s);
    free(s);
    PQfinish(c);
    teardown_pool(&f);
}

/* Rows are locked in one order by every batch whatever the statements: by key first. [insert 20, touch 10] and
 * [insert 10, touch 20] (two kinds, as [claim K1, complete K2] against [claim K2, complete K1]) must both run key 10
 * first; sorted by statement first they lock in opposite orders and can deadlock. */
Test(pg_batch, a_batch_locks_rows_by_key_whatever_the_statement)
{
    struct fixture f;
    setup_pool(&f, "lockorder", 16);
    char sql[1024];
    snprintf(sql, sizeof sql,
             "DROP TABLE IF EXISTS %s_l; CREATE TABLE %s_l (id bigserial, what text, k int);"
             "CREATE OR REPLACE FUNCTION %s_lf() RETURNS trigger LANGUAGE plpgsql AS"
             " $$BEGIN INSERT INTO %s_l (what, k) VALUES (lower(TG_OP), NEW.k); RETURN NULL; END$$;"
             "CREATE TRIGGER %s_lt AFTER INSERT OR UPDATE ON %s FOR EACH ROW EXECUTE FUNCTION %s_lf();"
             "INSERT INTO %s (k) VALUES (10), (20), (30), (40)",
             table, table, table, table, table, table, table, table);
    exec_ok(f.admin, sql);
    snprintf(sql, sizeof sql, "TRUNCATE %s_l", table);
    exec_ok(f.admin, sql);
    wait_up(&f);
    struct result rs[6] = {0};
    occupy(&f, &rs[0]);
    insert(&f, S_INSERT, 50, &rs[1]);
    insert(&f, S_TOUCH, 10, &rs[2]);
    run_until(&f, rs, 3);
    occupy(&f, &rs[3]);
    insert(&f, S_TOUCH, 40, &rs[4]);
    insert(&f, S_INSERT, 5, &rs[5]);
    run_until(&f, rs + 3, 3);
    for (int i = 0; i < 6; i++)
        cr_expect_eq(rs[i].st, STORE_PG_OK, "query %d: %s", i, store_pg_status_name(rs[i].st));
    snprintf(sql, sizeof sql, "SELECT string_agg(what || k, ',' ORDER BY id) FROM %s_l", table);
    char *s = query_text(f.admin, sql);
    cr_expect_str_eq(s, "update10,insert50,insert5,update40", "row order of the two batches: %s", s);
    free(s);
    snprintf(sql, sizeof sql, "DROP TABLE IF EXISTS %s_l CASCADE; DROP FUNCTION IF EXISTS %s_lf() CASCADE", table,
             table);
    exec_ok(f.admin, sql);
    teardown_pool(&f);
}

/* store.postgres may name several hosts (libpq multi-host, target_session_attrs=read-write, as for a failover
 * pair): the pool's non-blocking connect goes on to the next host when one refuses (PQconnectPoll changes the
 * socket) and its queries run. */
Test(pg_batch, a_multi_host_url_connects_to_the_host_that_answers)
{
    struct fixture f;
    setup_pool(&f, "multi", 16);
    store_pg_destroy(f.pool);
    const char *base = getenv("IDEMGATE_TEST_PG_URL");
    const char *at = strchr(base, '@');
    cr_assert(at && strncmp(base, "postgresql://", 13) == 0, "unexpected test URL %s", base);
    char url[512];
    snprintf(url, sizeof url, "%.*s127.0.0.1:1,%s%starget_session_attrs=read-write", (int)(at + 1 - base), base, at + 1,
             strchr(base, '?') ? "&" : "?");
    f.opts.conninfo = url;
    f.pool = store_pg_create(f.base, &f.opts);
    wait_up(&f);
    struct result rs[1] = {0};
    insert(&f, S_INSERT, 3, &rs[0]);
    run_until(&f, rs, 1);
    cr_expect_eq(rs[0].st, STORE_PG_OK, "%s", store_pg_status_name(rs[0].st));
    cr_expect_eq(rs[0].k, 3);
    teardown_pool(&f);
}

static long deadlocks(PGconn *c)
{
    exec_ok(c, "SELECT pg_stat_clear_snapshot()");
    char *s = query_text(c, "SELECT deadlocks::text FROM pg_stat_database WHERE datname = current_database()");
    long v = strtol(s, NULL, 10);
    free(s);
    return v;
}

/* The deadlock itself: two pools at once, [A 10, B 20] against [B 10, A 20] (A and B two statement kinds, each
 * locking its row 0.2 s after it starts). Ordered by statement first the second batch locks 20 then 10 while the
 * first holds 10 and wants 20: Postgres detects a deadlock (pg_stat_database.deadlocks) and rolls one back. By key,
 * both lock 10 first: one waits, no deadlock. */
Test(pg_batch, opposite_batches_do_not_deadlock, .timeout = 60)
{
    struct fixture f;
    setup_pool(&f, "deadlock", 16);
    char sql[256];
    snprintf(sql, sizeof sql, "INSERT INTO %s (k) VALUES (10), (20)", table);
    exec_ok(f.admin, sql);
    struct store_pg *other = store_pg_create(f.base, &f.opts);
    wait_up(&f);
    uint64_t deadline = cm_now_ms() + 15000;
    while (!store_pg_up(other)) {
        cr_assert(cm_now_ms() < deadline, "the second pool never came up");
        event_base_loop(f.base, EVLOOP_ONCE);
    }
    long before = deadlocks(f.admin);
    for (int round = 0; round < 2; round++) {
        struct result rs[6] = {0};
        occupy(&f, &rs[0]);
        store_pg_query(other, S_SLEEP, NULL, 0, 0, query_cb, &rs[3]);
        insert(&f, S_SLOW_A, 10, &rs[1]);
        insert(&f, S_SLOW_B, 20, &rs[2]);
        struct store_pg *keep = f.pool;
        f.pool = other;
        insert(&f, S_SLOW_A, 20, &rs[4]);
        insert(&f, S_SLOW_B, 10, &rs[5]);
        f.pool = keep;
        run_until(&f, rs, 6);
        for (int i = 0; i < 6; i++)
            cr_expect_eq(rs[i].st, STORE_PG_OK, "round %d query %d: %s", round, i, store_pg_status_name(rs[i].st));
    }
    /* the statistics reach pg_stat_database within a second or so */
    long after = before;
    for (int i = 0; i < 20 && after == before; i++) {
        usleep(100000);
        after = deadlocks(f.admin);
    }
    cr_expect_eq(after, before, "%ld deadlocks between the two batches", after - before);
    store_pg_destroy(other);
    teardown_pool(&f);
}

/* ---- setup plan checks and companions (then_sql) */

/* Replaces the fixture's pool by one with these statements (the fixture's table stays). */
static void repool(struct fixture *f, const struct store_pg_stmt *list, size_t n, unsigned max_batch)
{
    store_pg_destroy(f->pool);
    f->opts.stmts = list;
    f->opts.nstmts = n;
    f->opts.max_batch = max_batch;
    f->pool = store_pg_create(f->base, &f->opts);
}

/* A statement Postgres prepares but cannot plan with a value (1 / 0 folds while planning): the connection fails
 * at its setup, so the pool is not up and queries fail at once, rather than the statement at its first use. */
Test(pg_setup, a_statement_that_cannot_be_planned_keeps_the_pool_down)
{
    struct fixture f;
    setup_pool(&f, "unplannable", 1);
    static const struct store_pg_stmt bad[] = {
        {"t_good", "SELECT 1, 2", 0, NULL, 0, NULL, NULL, NULL},
        {"t_unplannable", "SELECT 1 / $1", 1, int4_type, 0, NULL, NULL, NULL},
    };
    repool(&f, bad, 2, 1);
    struct result r = {0};
    store_pg_query(f.pool, 0, NULL, 0, 0, query_cb, &r);
    run_until(&f, &r, 1);
    cr_expect_eq(r.st, STORE_PG_UNAVAILABLE, "a query while a statement cannot be planned: %s",
                 store_pg_status_name(r.st));
    cr_expect_not(store_pg_up(f.pool), "the pool is not up");
    cr_expect_not(store_pg_healthy(f.pool, 1000), "nor healthy (/readyz)");
    teardown_pool(&f);
}

static struct store_pg *then_pool;

struct then_result {
    struct result r;
    int then_rows;
    char then_count[16];
};

static void then_cb(void *arg, enum store_pg_status st, const PGresult *res, const char *msg)
{
    struct then_result *t = arg;
    query_cb(&t->r, st, res, msg);
    const PGresult *c = store_pg_cb_then(then_pool);
    t->then_rows = c ? PQntuples(c) : -1;
    if (c && PQntuples(c) == 1)
        snprintf(t->then_count, sizeof t->then_count, "%d", store_pg_get_i32(c, 0, 1));
}

/* A companion runs after its statement before the same Sync: it sees the statement's row (one transaction),
 * its result reaches the callback, and its failure rolls the statement back and fails the query. */
Test(pg_setup, a_companion_runs_in_its_statements_transaction)
{
    struct fixture f;
    setup_pool(&f, "then", 4);
    static char ins[160], then[320];
    snprintf(ins, sizeof ins, "INSERT INTO %s (k) VALUES ($1) RETURNING id, k", table);
    /* k = 7: a division by zero at run time (random() is not folded while planning) */
    snprintf(
        then, sizeof then,
        "SELECT CASE WHEN $1 = 7 THEN 1 / (random() * 0)::int ELSE 1 END, (SELECT count(*) FROM %s WHERE k = $1)::int4",
        table);
    static struct store_pg_stmt two[2];
    two[0] = (struct store_pg_stmt){"t_ins_then", ins, 1, int4_type, 1, NULL, NULL, then};
    two[1] = (struct store_pg_stmt){"t_sleep2", "SELECT pg_sleep(0.3)", 0, NULL, 0, NULL, NULL, NULL};
    repool(&f, two, 2, 4);
    then_pool = f.pool;
    wait_up(&f);
    struct then_result t[4] = {0};
    struct result busy = {0};
    store_pg_query(f.pool, 1, NULL, 0, 0, query_cb, &busy); /* the rest wait and go as one batch */
    {
        uint8_t v5[4] = {0, 0, 0, 5};
        struct store_pg_param p5 = {v5, sizeof v5, true};
        store_pg_query(f.pool, 0, &p5, 1, 1, then_cb, &t[0]);
    }
    run_until(&f, &t[0].r, 1);
    run_until(&f, &busy, 1);
    cr_expect_eq(t[0].r.st, STORE_PG_OK, "%s", store_pg_status_name(t[0].r.st));
    cr_expect_eq(t[0].r.k, 5, "the statement's own row is the result");
    cr_expect_eq(t[0].then_rows, 1, "the companion's result reaches the callback");
    cr_expect_str_eq(t[0].then_count, "1", "the companion sees the statement's row: same transaction");
    /* a failing companion: its statement rolls back, the query fails */
    int32_t k7 = 7;
    uint8_t v[4] = {0, 0, 0, (uint8_t)k7};
    struct store_pg_param p = {v, sizeof v, true};
    store_pg_query(f.pool, 0, &p, 1, 1, then_cb, &t[1]);
    run_until(&f, &t[1].r, 1);
    cr_expect_eq(t[1].r.st, STORE_PG_SQL_ERROR, "%s", store_pg_status_name(t[1].r.st));
    char sql[160];
    snprintf(sql, sizeof sql, "SELECT count(*)::text FROM %s WHERE k = 7", table);
    char *s = query_text(f.admin, sql);
    cr_expect_str_eq(s, "0", "the statement rolled back with its companion");
    free(s);
    teardown_pool(&f);
}
