/* migrate.c - the blocking start-up work on one libpq connection of its own: the schema and its migration under an
 * advisory lock, Citus distribution, the routes' identities (store_identity_check); never the loop, never the pool. */
#include "store/migrate.h"

#include <stdlib.h>
#include <string.h>

#include <libpq-fe.h>

#include "conf/conf.h"
#include "conf/identity.h"
#include "store/order.h"
#include "store/pg.h"

#define MIGRATE_LOCK_ID "7251983046512"
#define SCHEMA_VERSION  5

static const char schema_v1[] =
    "CREATE TABLE IF NOT EXISTS idemgate_keys ("
    " route text NOT NULL,"
    " scope bytea NOT NULL,"
    " key text NOT NULL,"
    " fingerprint bytea NOT NULL,"
    " state text NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),"
    " token bigint NOT NULL,"
    " lease_until timestamptz NOT NULL,"
    " created_at timestamptz NOT NULL,"
    " completed_at timestamptz,"
    " expires_at timestamptz NOT NULL,"
    " status int,"
    " response bytea,"
    " PRIMARY KEY (route, key, scope));" /* the admin queries (route, key) use its prefix */
    "CREATE INDEX IF NOT EXISTS idemgate_keys_expires_at ON idemgate_keys (expires_at);"
    "CREATE INDEX IF NOT EXISTS idemgate_keys_in_flight ON idemgate_keys (created_at) WHERE state = 'in_flight';"
    "INSERT INTO idemgate_schema_version (version) VALUES (1) ON CONFLICT DO NOTHING;";

/* v2: retention applies to completed records only; the cleaner and the
 * stuck gauge (in flight or unknown) each get a partial index. */
static const char schema_v2[] =
    "CREATE INDEX IF NOT EXISTS idemgate_keys_completed_expires_at ON idemgate_keys (expires_at)"
    " WHERE state = 'completed';"
    "CREATE INDEX IF NOT EXISTS idemgate_keys_unsettled ON idemgate_keys (created_at)"
    " WHERE state IN ('in_flight', 'unknown');"
    "DROP INDEX IF EXISTS idemgate_keys_expires_at;"
    "DROP INDEX IF EXISTS idemgate_keys_in_flight;"
    "INSERT INTO idemgate_schema_version (version) VALUES (2) ON CONFLICT DO NOTHING;";

/* v3: the purge epoch (one row; store.h) and each route's identity as the gateway last started with it
 * (store_identity_check). Plain tables on Citus too (on the coordinator): small, and never joined with the keys. */
static const char schema_v3[] =
    "CREATE TABLE IF NOT EXISTS idemgate_epoch (id int PRIMARY KEY CHECK (id = 1), epoch bigint NOT NULL);"
    "INSERT INTO idemgate_epoch (id, epoch) VALUES (1, 0) ON CONFLICT DO NOTHING;"
    "CREATE TABLE IF NOT EXISTS idemgate_routes (route text PRIMARY KEY, identity text NOT NULL,"
    " updated_at timestamptz NOT NULL DEFAULT now());"
    "INSERT INTO idemgate_schema_version (version) VALUES (3) ON CONFLICT DO NOTHING;";

/* v4: the admin listing of a route's records, newest first (GET /admin/keys without key=), pages through this
 * index. On Citus it is created on every shard (before distribution: create_distributed_table copies it). */
static const char schema_v4[] =
    "CREATE INDEX IF NOT EXISTS idemgate_keys_route_created_at ON idemgate_keys (route, created_at);"
    "INSERT INTO idemgate_schema_version (version) VALUES (4) ON CONFLICT DO NOTHING;";

/* v5: the id of the request that claimed the record (SPEC 11: a replay names the request that executed). Adding a
 * nullable column is a catalog change only; Citus propagates it to the shards of a distributed table. */
static const char schema_v5[] = "ALTER TABLE idemgate_keys ADD COLUMN IF NOT EXISTS request_id text;"
                                "INSERT INTO idemgate_schema_version (version) VALUES (5) ON CONFLICT DO NOTHING;";

/* ---- migration (blocking, at start) */

static char *trimmed(const char *msg)
{
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r' || msg[n - 1] == ' '))
        n--;
    return cm_strndup(msg, n);
}

/* r's success; otherwise *err and r is freed. */
static bool result_ok(PGconn *c, PGresult *r, char **err)
{
    ExecStatusType st = r ? PQresultStatus(r) : PGRES_FATAL_ERROR;
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
        char *m = trimmed(r ? PQresultErrorMessage(r) : PQerrorMessage(c));
        *err = cm_asprintf("postgres migration failed: %s", m);
        free(m);
        PQclear(r);
        return false;
    }
    return true;
}

static bool exec_ok(PGconn *c, const char *sql, PGresult **out, char **err)
{
    PGresult *r = PQexec(c, sql);
    if (!result_ok(c, r, err))
        return false;
    if (out)
        *out = r;
    else
        PQclear(r);
    return true;
}

/* Runs a script of ';'-separated statements (no ';' inside them) as one transaction: as one simple query on plain
 * Postgres; on Citus one statement at a time inside BEGIN .. COMMIT (Citus refuses a query of several commands
 * once a table in it is distributed: it forwards DDL to the shards as prepared statements). */
static bool exec_script(PGconn *c, const char *sql, bool citus, char **err)
{
    if (!citus)
        return exec_ok(c, sql, NULL, err);
    if (!exec_ok(c, "BEGIN", NULL, err))
        return false;
    for (const char *p = sql; *p;) {
        const char *end = strchr(p, ';');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        char *one = cm_strndup(p, n);
        bool ok = n == 0 || exec_ok(c, one, NULL, err);
        free(one);
        if (!ok) {
            PQclear(PQexec(c, "ROLLBACK"));
            return false;
        }
        p += n + (end ? 1 : 0);
    }
    return exec_ok(c, "COMMIT", NULL, err);
}

static void migrate_notice(void *arg, const char *message)
{
    (void)arg;
    store_pg_log_notice(NULL, message);
}

/* A claim acknowledged by a primary whose standby had not received it is
 * gone after a failover: the retry finds no record and executes again. Only a
 * synchronous standby (synchronous_standby_names set, synchronous_commit not
 * off or local) makes a failover keep every acknowledged claim. */
static void failover_check(PGconn *c)
{
    PGresult *r = PQexec(c, "SELECT current_setting('synchronous_standby_names'),"
                            " current_setting('synchronous_commit')");
    if (r && PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1) {
        const char *names = PQgetvalue(r, 0, 0), *commit = PQgetvalue(r, 0, 1);
        bool async = names[0] == '\0' || strcmp(commit, "off") == 0 || strcmp(commit, "local") == 0;
        if (async) {
            char qn[256], qc[64];
            cm_log(CM_WARN, "failover_may_lose_claims",
                   "synchronous_standby_names=%s synchronous_commit=%s detail=\"without a synchronous standby a"
                   " failover can lose acknowledged claims: their retries execute again\"",
                   cm_log_quote(qn, sizeof qn, names), cm_log_quote(qc, sizeof qc, commit));
        } else {
            cm_log(CM_INFO, "failover_synchronous", "synchronous_commit=%s", commit);
        }
    } else {
        char q[256];
        cm_log(CM_WARN, "failover_check_failed", "error=%s",
               cm_log_quote(q, sizeof q, r ? PQresultErrorMessage(r) : PQerrorMessage(c)));
    }
    PQclear(r);
}

/* One text value of sql (a single row), heap, or NULL when it returned no row or failed (then *err is set). */
static char *query_value(PGconn *c, const char *sql, bool *failed, char **err)
{
    PGresult *r = NULL;
    *failed = !exec_ok(c, sql, &r, err);
    if (*failed)
        return NULL;
    char *v = PQntuples(r) > 0 && !PQgetisnull(r, 0, 0) ? cm_strdup(PQgetvalue(r, 0, 0)) : NULL;
    PQclear(r);
    return v;
}

/* The tables and the column Citus distributes each by: the one every statement on the table filters on and that
 * its primary key contains. */
static const char *const dist_tables[][2] = {{"idemgate_keys", "key"}, {"idemgate_order", "resource"}};

/* store.distributed: citus: the extension must be there; each table is distributed by its column (by us, when it
 * is not yet: create_distributed_table moves its rows to the workers), or already was (by us or an operator).
 * none: a table Citus distributes means the other statements are needed: refused with the setting to use. */
static bool distribute(PGconn *c, enum conf_distributed mode, char **err)
{
    bool failed = false;
    char *ext = query_value(c, "SELECT extversion FROM pg_extension WHERE extname = 'citus'", &failed, err);
    if (failed)
        return false;
    if (!ext) {
        if (mode == CONF_DIST_CITUS) {
            *err = cm_strdup("store.distributed is citus but this database has no citus extension (CREATE "
                             "EXTENSION citus, as a superuser, on the coordinator and every worker)");
            return false;
        }
        return true;
    }
    for (size_t i = 0; i < sizeof dist_tables / sizeof dist_tables[0]; i++) {
        char sql[256];
        snprintf(sql, sizeof sql,
                 "SELECT coalesce(column_to_column_name(logicalrelid, partkey), '') FROM pg_dist_partition"
                 " WHERE logicalrelid = '%s'::regclass",
                 dist_tables[i][0]);
        char *col = query_value(c, sql, &failed, err);
        if (failed) {
            free(ext);
            return false;
        }
        if (mode != CONF_DIST_CITUS) {
            if (col) {
                *err = cm_asprintf("%s is a Citus table: set store.distributed: citus (the statements for "
                                   "distributed tables)",
                                   dist_tables[i][0]);
                free(col);
                free(ext);
                return false;
            }
            continue;
        }
        if (col && strcmp(col, dist_tables[i][1]) != 0) {
            *err = cm_asprintf("%s is a Citus table distributed by \"%s\" (or not hash-distributed); idemgate needs it "
                               "distributed by %s",
                               dist_tables[i][0], col, dist_tables[i][1]);
            free(col);
            free(ext);
            return false;
        }
        if (!col) {
            snprintf(sql, sizeof sql, "SELECT create_distributed_table('%s', '%s')", dist_tables[i][0],
                     dist_tables[i][1]);
            if (!exec_ok(c, sql, NULL, err)) {
                free(ext);
                return false;
            }
            cm_log(CM_INFO, "citus_distributed", "table=%s column=%s", dist_tables[i][0], dist_tables[i][1]);
        }
        free(col);
    }
    if (mode == CONF_DIST_CITUS)
        cm_log(CM_INFO, "citus_ready", "citus=%s tables=idemgate_keys(key),idemgate_order(resource)", ext);
    free(ext);
    return true;
}

/* A blocking session for start-up work (application_name app), every statement bounded by timeout_ms. NULL with
 * *err when it cannot be had. */
static PGconn *sync_connect(const char *postgres_url, uint64_t timeout_ms, const char *app, char **err)
{
    char ct[24], stmt_to[64];
    uint64_t secs = (timeout_ms + 999) / 1000;
    snprintf(ct, sizeof ct, "%llu", (unsigned long long)(secs < 2 ? 2 : secs));
    static const char *const kw[] = {"dbname", "connect_timeout", "application_name", NULL};
    const char *vals[] = {postgres_url, ct, app, NULL};
    PGconn *c = PQconnectdbParams(kw, vals, 1);
    if (!c || PQstatus(c) != CONNECTION_OK) {
        char *m = trimmed(c ? PQerrorMessage(c) : "out of memory");
        *err = cm_asprintf("postgres connection failed: %s", m);
        free(m);
        goto fail;
    }
    PQsetNoticeProcessor(c, migrate_notice, NULL);
    snprintf(stmt_to, sizeof stmt_to, "SET statement_timeout = %llu", (unsigned long long)timeout_ms);
    if (!exec_ok(c, stmt_to, NULL, err) || !exec_ok(c, "SET client_min_messages = warning", NULL, err))
        goto fail;
    return c;
fail:
    if (c)
        PQfinish(c);
    return NULL;
}

/* One row's first value of a statement with text parameters, heap (NULL: no row). false with *err on failure. */
static bool query_param(PGconn *c, const char *sql, int n, const char *const *params, char **value, char **err)
{
    *value = NULL;
    PGresult *r = PQexecParams(c, sql, n, NULL, params, NULL, NULL, 0);
    if (!result_ok(c, r, err))
        return false;
    if (PQntuples(r) > 0 && PQnfields(r) > 0 && !PQgetisnull(r, 0, 0))
        *value = cm_strdup(PQgetvalue(r, 0, 0));
    PQclear(r);
    return true;
}

static bool accepted(const char *route, const char *const *accept, size_t naccept)
{
    for (size_t i = 0; i < naccept; i++)
        if (strcmp(accept[i], route) == 0)
            return true;
    return false;
}

/* One route: compared with its recorded identity, recorded when new or changed (and allowed to). */
static bool identity_route(PGconn *c, const char *route, const char *id, bool accept, bool *refused, char **err)
{
    const char *p1[1] = {route};
    char *old = NULL, *count = NULL;
    bool ok = query_param(c, "SELECT identity FROM idemgate_routes WHERE route = $1", 1, p1, &old, err);
    if (!ok || (old && strcmp(old, id) == 0))
        goto out;
    long n = 0;
    if (old) {
        /* the records a retry may now miss: completed ones still replayed, and those not settled */
        ok = query_param(c,
                         "SELECT count(*)::text FROM idemgate_keys WHERE route = $1"
                         " AND (state <> 'completed' OR expires_at > now())",
                         1, p1, &count, err);
        if (!ok)
            goto out;
        n = count ? strtol(count, NULL, 10) : 0;
        char what[64];
        conf_identity_diff(old, id, what, sizeof what);
        if (n > 0 && !accept) {
            *refused = true;
            ok = false;
            *err = cm_asprintf("route %s: its identity changed (%s; was \"%s\", now \"%s\") and %ld of its records "
                               "are within retention: a retry of one of them may now be executed again or answered "
                               "422. Use a new route name for the new identity, or start with "
                               "--accept-identity-change %s",
                               route, what, old, id, n, route);
            goto out;
        }
        char qo[256], qn[256];
        cm_log(n > 0 ? CM_WARN : CM_INFO, "route_identity_changed",
               "route=%s changed=%s records_within_retention=%ld accepted=%s was=%s now=%s", route, what, n,
               n > 0 ? "yes" : "no records", cm_log_quote(qo, sizeof qo, old), cm_log_quote(qn, sizeof qn, id));
    }
    const char *p2[2] = {route, id};
    char *none = NULL;
    ok = query_param(c,
                     "INSERT INTO idemgate_routes (route, identity) VALUES ($1, $2) ON CONFLICT (route)"
                     " DO UPDATE SET identity = EXCLUDED.identity, updated_at = now()",
                     2, p2, &none, err);
    free(none);
out:
    free(old);
    free(count);
    return ok;
}

bool store_identity_check(const char *postgres_url, const struct conf *conf, const char *const *accept, size_t naccept,
                          uint64_t timeout_ms, bool *refused, char **err)
{
    *refused = false;
    PGconn *c = sync_connect(postgres_url, timeout_ms, "idemgate-migrate", err);
    if (!c)
        return false;
    bool ok = true;
    for (size_t i = 0; i < conf->routes_n && ok; i++) {
        char *id = conf_route_identity(&conf->routes[i]);
        if (id)
            ok = identity_route(c, conf->routes[i].name, id, accepted(conf->routes[i].name, accept, naccept), refused,
                                err);
        free(id);
    }
    PQfinish(c);
    return ok;
}

bool store_migrate(const char *postgres_url, enum conf_distributed distributed, uint64_t timeout_ms, char **err)
{
    PGresult *r = NULL;
    PGconn *c = sync_connect(postgres_url, timeout_ms, "idemgate-migrate", err);
    if (!c)
        goto fail;
    /* Serialises concurrent starts: CREATE ... IF NOT EXISTS alone races. */
    if (!exec_ok(c, "SELECT pg_advisory_lock(" MIGRATE_LOCK_ID ")", NULL, err))
        goto fail;
    if (!exec_ok(c,
                 "CREATE TABLE IF NOT EXISTS idemgate_schema_version (version int PRIMARY KEY,"
                 " applied_at timestamptz NOT NULL DEFAULT now())",
                 NULL, err))
        goto fail;
    if (!exec_ok(c, "SELECT coalesce(max(version), 0) FROM idemgate_schema_version", &r, err))
        goto fail;
    char *end = NULL;
    long version = strtol(PQgetvalue(r, 0, 0), &end, 10);
    PQclear(r);
    r = NULL;
    if (version < SCHEMA_VERSION) {
        /* One simple query each: its statements run in one implicit transaction. */
        bool citus = distributed == CONF_DIST_CITUS;
        if ((version < 1 && !exec_script(c, schema_v1, citus, err)) ||
            (version < 2 && !exec_script(c, schema_v2, citus, err)) ||
            (version < 3 && !exec_script(c, schema_v3, citus, err)) ||
            (version < 4 && !exec_script(c, schema_v4, citus, err)) || !exec_script(c, schema_v5, citus, err))
            goto fail;
        cm_log(CM_INFO, "schema_migrated", "from=%ld to=%d", version, SCHEMA_VERSION);
    } else {
        cm_log(CM_INFO, "schema_ok", "version=%ld", version);
    }
    if (!exec_ok(c, store_order_schema, NULL, err)) /* the ordering guard's table (IF NOT EXISTS) */
        goto fail;
    if (!distribute(c, distributed, err)) /* under the lock too */
        goto fail;
    if (!exec_ok(c, "SELECT pg_advisory_unlock(" MIGRATE_LOCK_ID ")", NULL, err))
        goto fail;
    failover_check(c);
    PQfinish(c);
    return true;
fail:
    PQclear(r);
    if (c)
        PQfinish(c); /* ends the session: the advisory lock goes with it */
    return false;
}

struct pg_conn *store_sync_connect(const char *postgres_url, uint64_t timeout_ms, const char *app, char **err)
{
    return sync_connect(postgres_url, timeout_ms, app, err);
}
