/* store.c - the idempotency authority on the loop: its statements (the SQL of every operation, one table for the
 * pool), the store's life cycle (the pool, Redis, the timers), the health probe and the verdict names. The
 * operations live in claim.c, owner.c, sweeper.c, admin.c and cleaner.c; never the blocking start-up work (schema
 * migration, route identities: migrate.c). */
#include "store/internal.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* ---- SQL */

#define TS(col) "to_char(" col " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"
/* Retention applies to completed records only: an unknown outcome (or an
 * orphaned claim) never expires into "new"; it stays until an operator
 * releases or purges it, or (on_unknown: retry) a retry takes it over. */
#define TAKEABLE(p)                                                                                                    \
    "(" p "state = 'completed' AND " p "expires_at < now() AND " p "lease_until < now()) OR ($8 AND " p                \
    "state IN ('in_flight', 'unknown') AND " p "lease_until < now() AND " p "fingerprint = $4)"

static const Oid claim_types[] = {STORE_OID_TEXT, STORE_OID_BYTEA, STORE_OID_TEXT, STORE_OID_BYTEA, STORE_OID_INT8,
                                  STORE_OID_INT8, STORE_OID_INT8,  STORE_OID_BOOL, STORE_OID_TEXT};
static const Oid claim_multi_types[] = {STORE_OID_TEXT_ARRAY,  STORE_OID_BYTEA_ARRAY, STORE_OID_TEXT_ARRAY,
                                        STORE_OID_BYTEA_ARRAY, STORE_OID_INT8_ARRAY,  STORE_OID_INT8_ARRAY,
                                        STORE_OID_INT8_ARRAY,  STORE_OID_BOOL_ARRAY,  STORE_OID_TEXT_ARRAY};
static const Oid complete_types[] = {STORE_OID_TEXT, STORE_OID_BYTEA, STORE_OID_TEXT, STORE_OID_INT8,
                                     STORE_OID_INT4, STORE_OID_BYTEA, STORE_OID_INT8};
static const Oid complete_multi_types[] = {STORE_OID_TEXT_ARRAY, STORE_OID_BYTEA_ARRAY, STORE_OID_TEXT_ARRAY,
                                           STORE_OID_INT8_ARRAY, STORE_OID_INT4_ARRAY,  STORE_OID_BYTEA_ARRAY,
                                           STORE_OID_INT8_ARRAY};
static const Oid fenced_types[] = {STORE_OID_TEXT, STORE_OID_BYTEA, STORE_OID_TEXT, STORE_OID_INT8, STORE_OID_INT8};
static const Oid release_types[] = {STORE_OID_TEXT, STORE_OID_BYTEA, STORE_OID_TEXT, STORE_OID_INT8};
static const Oid admin_types[] = {STORE_OID_TEXT, STORE_OID_TEXT};

/* The last column of every claim's result: the record's age in ms on Postgres's clock (SPEC 8: one clock), for
 * Retry-After on a key in use (SPEC 11); 0 on a row the claim inserted. p: the table's alias and a dot, or "". */
#define AGE_MS(p) "greatest(0, floor(extract(epoch FROM now() - " p "created_at) * 1000))::int8"
/* The claim: one statement. The upsert takes the key when it is new, past
 * retention, or (takeover) a lapsed claim with the same fingerprint; else the
 * second branch reads the existing record. Under READ COMMITTED that read
 * uses the statement's snapshot: it may miss a row committed concurrently
 * (no row) or show a version the upsert would have taken (takeable): the
 * caller runs the statement again then. */
/* clang-format off */
static const char sql_claim[] =
    "WITH ins AS ("
    " INSERT INTO idemgate_keys AS k (route, scope, key, fingerprint, state, token, lease_until, created_at,"
    " expires_at, request_id)"
    " VALUES ($1, $2, $3, $4, 'in_flight', $5, now() + $6 * interval '1 ms', now(), now() + $7 * interval '1 ms',"
    " $9)"
    " ON CONFLICT (route, scope, key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, state = 'in_flight',"
    " token = EXCLUDED.token, lease_until = EXCLUDED.lease_until, created_at = EXCLUDED.created_at,"
    " completed_at = NULL, expires_at = EXCLUDED.expires_at, status = NULL, response = NULL,"
    " request_id = EXCLUDED.request_id"
    " WHERE " TAKEABLE("k.")
    " RETURNING k.token, k.created_at)"
    " SELECT 'new'::text, token, NULL::bytea, NULL::int4, NULL::bytea, 0::int8, 0::int8, false, true, created_at,"
    " NULL::text, 0::int8"
    " FROM ins"
    " UNION ALL"
    " SELECT state, token, fingerprint, status, response,"
    " greatest(0, ceil(extract(epoch FROM lease_until - now()) * 1000))::int8,"
    " greatest(0, floor(extract(epoch FROM expires_at - now()) * 1000))::int8,"
    " " TAKEABLE("") ","
    " lease_until >= now(), created_at, request_id, " AGE_MS("")
    " FROM idemgate_keys WHERE route = $1 AND scope = $2 AND key = $3 AND NOT EXISTS (SELECT 1 FROM ins)";
/* clang-format on */

/* The claim for several keys at once (distinct rows; store/pg.h batches):
 * the same parameters as arrays, one result row per key, first column its
 * 1-based position. The takeover flag is per key: the conflict filter reads
 * it back from u. */
/* clang-format off */
static const char sql_claim_multi[] =
    "WITH u AS (SELECT * FROM unnest($1::text[], $2::bytea[], $3::text[], $4::bytea[], $5::int8[], $6::int8[],"
    " $7::int8[], $8::bool[], $9::text[]) WITH ORDINALITY AS u(route, scope, key, fp, token, lease_ms, ret_ms,"
    " takeover, rid, n)),"
    " ins AS ("
    " INSERT INTO idemgate_keys AS k (route, scope, key, fingerprint, state, token, lease_until, created_at,"
    " expires_at, request_id)"
    " SELECT route, scope, key, fp, 'in_flight', token, now() + lease_ms * interval '1 ms', now(),"
    " now() + ret_ms * interval '1 ms', rid FROM u"
    " ON CONFLICT (route, scope, key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, state = 'in_flight',"
    " token = EXCLUDED.token, lease_until = EXCLUDED.lease_until, created_at = EXCLUDED.created_at,"
    " completed_at = NULL, expires_at = EXCLUDED.expires_at, status = NULL, response = NULL,"
    " request_id = EXCLUDED.request_id"
    " WHERE (k.state = 'completed' AND k.expires_at < now() AND k.lease_until < now()) OR ((SELECT u.takeover FROM u WHERE u.route = k.route"
    " AND u.scope = k.scope AND u.key = k.key) AND k.state IN ('in_flight', 'unknown') AND k.lease_until < now()"
    " AND k.fingerprint = EXCLUDED.fingerprint)"
    " RETURNING k.route, k.scope, k.key, k.token, k.created_at)"
    " SELECT u.n, 'new'::text, ins.token, NULL::bytea, NULL::int4, NULL::bytea, 0::int8, 0::int8, false, true,"
    " ins.created_at, NULL::text, 0::int8 FROM u JOIN ins ON ins.route = u.route AND ins.scope = u.scope AND ins.key = u.key"
    " UNION ALL"
    " SELECT u.n, t.state, t.token, t.fingerprint, t.status, t.response,"
    " greatest(0, ceil(extract(epoch FROM t.lease_until - now()) * 1000))::int8,"
    " greatest(0, floor(extract(epoch FROM t.expires_at - now()) * 1000))::int8,"
    " (t.state = 'completed' AND t.expires_at < now() AND t.lease_until < now()) OR (u.takeover AND t.state IN ('in_flight', 'unknown')"
    " AND t.lease_until < now() AND t.fingerprint = u.fp),"
    " t.lease_until >= now(), t.created_at, t.request_id, " AGE_MS("t.")
    " FROM u JOIN idemgate_keys t ON t.route = u.route AND t.scope = u.scope AND t.key = u.key"
    " WHERE NOT EXISTS (SELECT 1 FROM ins WHERE ins.route = u.route AND ins.scope = u.scope AND ins.key = u.key)";
/* clang-format on */

/* On Citus (store.distributed: citus; idemgate_keys distributed by key) a
 * statement with a data-modifying CTE is planned recursively (a subplan per
 * part, each a trip to the worker), and a function in ON CONFLICT .. WHERE
 * must be IMMUTABLE. There the claim is two statements on the key's shard,
 * sent before one Sync (store/pg.h then_sql: one transaction): the upsert,
 * whose filter compares with EXCLUDED.created_at (now(), evaluated once by
 * the coordinator) instead of calling now(), returning the "new" row; then
 * the read of the record, which the upsert has locked when it did not take
 * it (ON CONFLICT locks the row it does not update), so it is the version
 * the upsert decided on. The callback uses the upsert's row when there is
 * one, else the read's. Not batched into multi-row forms there: Citus does
 * not route an unnest over keys of several shards; several claims still
 * share one pipeline and one commit (pg.h batches). */
#define TAKEABLE_AT(p, t)                                                                                              \
    "(" p "state = 'completed' AND " p "expires_at < " t " AND " p "lease_until < " t ") OR ($8 AND " p                \
    "state IN ('in_flight', 'unknown') AND " p "lease_until < " t " AND " p "fingerprint = $4)"
/* clang-format off */
static const char sql_claim_citus[] =
    "INSERT INTO idemgate_keys AS k (route, scope, key, fingerprint, state, token, lease_until, created_at,"
    " expires_at, request_id)"
    " VALUES ($1, $2, $3, $4, 'in_flight', $5, now() + $6 * interval '1 ms', now(), now() + $7 * interval '1 ms',"
    " $9)"
    " ON CONFLICT (route, key, scope) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, state = 'in_flight',"
    " token = EXCLUDED.token, lease_until = EXCLUDED.lease_until, created_at = EXCLUDED.created_at,"
    " completed_at = NULL, expires_at = EXCLUDED.expires_at, status = NULL, response = NULL,"
    " request_id = EXCLUDED.request_id"
    " WHERE " TAKEABLE_AT("k.", "EXCLUDED.created_at")
    " RETURNING 'new'::text, k.token, NULL::bytea, NULL::int4, NULL::bytea, 0::int8, 0::int8, false, true,"
    " k.created_at, NULL::text, 0::int8";
static const char sql_claim_citus_read[] =
    "SELECT state, token, fingerprint, status, response,"
    " greatest(0, ceil(extract(epoch FROM lease_until - now()) * 1000))::int8,"
    " greatest(0, floor(extract(epoch FROM expires_at - now()) * 1000))::int8,"
    " " TAKEABLE("") ","
    " lease_until >= now(), created_at, request_id, " AGE_MS("")
    " FROM idemgate_keys WHERE route = $1 AND scope = $2 AND key = $3";
/* clang-format on */

/* Fenced by the claim's token alone: a token names one claim, so a retry of
 * a completion whose first attempt committed (lost reply) matches again. */
static const char sql_complete[] =
    "UPDATE idemgate_keys SET state = 'completed', status = $5, response = $6, completed_at = now(),"
    " lease_until = now(), expires_at = now() + $7 * interval '1 ms'"
    " WHERE route = $1 AND scope = $2 AND key = $3 AND token = $4 RETURNING fingerprint";

static const char sql_complete_multi[] =
    "UPDATE idemgate_keys AS k SET state = 'completed', status = u.status, response = u.response,"
    " completed_at = now(), lease_until = now(), expires_at = now() + u.ret_ms * interval '1 ms'"
    " FROM unnest($1::text[], $2::bytea[], $3::text[], $4::int8[], $5::int4[], $6::bytea[], $7::int8[])"
    " WITH ORDINALITY AS u(route, scope, key, token, status, response, ret_ms, n)"
    " WHERE k.route = u.route AND k.scope = u.scope AND k.key = u.key AND k.token = u.token"
    " RETURNING u.n, k.fingerprint";

static const char sql_renew[] = "UPDATE idemgate_keys SET lease_until = now() + $5 * interval '1 ms'"
                                " WHERE route = $1 AND scope = $2 AND key = $3 AND token = $4 AND state = 'in_flight'";

static const char sql_release[] =
    "DELETE FROM idemgate_keys WHERE route = $1 AND scope = $2 AND key = $3 AND token = $4";

/* $5 (int8) may be negative: the probe's give-back back-dates the lease, so that the record may be looked up again at
 * once (the wait for the original attempt is over by then). */
static const char sql_mark_unknown[] =
    "UPDATE idemgate_keys SET state = 'unknown', lease_until = now() + $5 * interval '1 ms'"
    " WHERE route = $1 AND scope = $2 AND key = $3 AND token = $4 AND state IN ('in_flight', 'unknown')";

/* A claim in flight whose lease lapsed is listed as what a retry is told it is: an unknown outcome (SPEC 4). */
/* clang-format off */
static const char sql_admin_list[] =
    "SELECT route, key, encode(scope, 'hex'),"
    " CASE WHEN state = 'in_flight' AND lease_until < now() THEN 'unknown' ELSE state END, token::text,"
    " " TS("created_at") ", " TS("expires_at") ", " TS("lease_until") ", status, " TS("completed_at")
    " FROM idemgate_keys WHERE route = $1 AND key = $2"
    " ORDER BY created_at, scope LIMIT 1000";
/* clang-format on */

/* The state a listing shows: a claim in flight whose lease lapsed is an unknown outcome (SPEC 4). */
#define SHOWN_STATE "CASE WHEN state = 'in_flight' AND lease_until < now() THEN 'unknown' ELSE state END"

/* A route's records, newest first (GET /admin/keys without key=): keyset paging on (created_at, key, scope) below
 * the cursor ($4, $5, decode($6, 'hex'); the first page starts below 'infinity'), through the (route, created_at)
 * index, never an offset: records added meanwhile are newer than any cursor and never shift a page. $2: the state
 * as shown ('' any), $3: older than this many ms, $7: rows (one more than the page: is there a next one). The last
 * column is the row's cursor time (microseconds, UTC). On Citus every shard answers its newest $7 and the
 * coordinator merges them. */
/* clang-format off */
static const char sql_admin_page[] =
    "SELECT route, key, encode(scope, 'hex'), " SHOWN_STATE ", token::text,"
    " " TS("created_at") ", " TS("expires_at") ", " TS("lease_until") ", status, " TS("completed_at") ","
    " to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US')"
    " FROM idemgate_keys WHERE route = $1 AND created_at <= $4 AND (created_at, key, scope) < ($4, $5, decode($6, 'hex'))"
    " AND created_at <= now() - $3 * interval '1 ms' AND ($2 = '' OR " SHOWN_STATE " = $2)"
    " ORDER BY created_at DESC, key DESC, scope DESC LIMIT $7";
/* clang-format on */
static const Oid admin_page_types[] = {STORE_OID_TEXT, STORE_OID_TEXT, STORE_OID_INT8, STORE_OID_TIMESTAMPTZ,
                                       STORE_OID_TEXT, STORE_OID_TEXT, STORE_OID_INT8};

/* An operator's settle (POST /admin/keys/settle) takes an unknown outcome (or a claim in flight whose lease lapsed)
 * under a token of its own, as the probe's take does, but whatever its lease: the operator confirmed the business
 * fact. The completion that follows (STORE_S_COMPLETE) is fenced by that token, and a prober or owner holding the old
 * one is fenced out. The companion reads the record's state (no row: absent; 404 or 409) and the id of the request
 * that claimed it (the settled answer carries it, as an answer the gateway stored does). */
static const char sql_settle_take[] = "UPDATE idemgate_keys SET token = $4, lease_until = now() + $5 * interval '1 ms'"
                                      " WHERE route = $1 AND scope = $2 AND key = $3"
                                      " AND (state = 'unknown' OR (state = 'in_flight' AND lease_until < now()))";
static const char sql_settle_state[] =
    "SELECT state, request_id FROM idemgate_keys WHERE route = $1 AND scope = $2 AND key = $3";

/* The replay caches of every gateway (gateway/cache.c) hear of a purge or a release through a notification sent
 * in the statement's own transaction (store/notify.h): delivered when, and only when, it commits. The payload is
 * "ROUTE\nKEY" (route names never hold a newline); one too long for NOTIFY is sent empty, which empties the
 * caches. */
#define SQL_NOTIFY_CACHE                                                                                               \
    "SELECT pg_notify('" STORE_NOTIFY_CHANNEL "', CASE WHEN octet_length($1) + octet_length($2) < 7000"                \
    " THEN $1 || E'\\n' || $2 ELSE '' END)"

static const char sql_admin_purge[] =
    "WITH d AS (DELETE FROM idemgate_keys WHERE route = $1 AND key = $2 RETURNING scope)"
    " SELECT d.scope FROM d, (" SQL_NOTIFY_CACHE ") AS n";

static const char sql_admin_release[] =
    "WITH d AS (DELETE FROM idemgate_keys WHERE route = $1 AND key = $2"
    " AND (state = 'unknown' OR (state = 'in_flight' AND lease_until < now())) RETURNING scope)"
    " SELECT 'd'::text, scope FROM d"
    " UNION ALL SELECT 't'::text, NULL::bytea FROM idemgate_keys WHERE route = $1 AND key = $2"
    " UNION ALL SELECT 'n'::text, NULL::bytea FROM (" SQL_NOTIFY_CACHE ") AS n";

/* Citus: the CTE's parts as two statements of one transaction on the key's
 * shard; the second counts what is left after the delete (the callback adds
 * the deleted ones back for the 404/409 decision). */
static const char sql_admin_release_citus[] =
    "DELETE FROM idemgate_keys WHERE route = $1 AND key = $2"
    " AND (state = 'unknown' OR (state = 'in_flight' AND lease_until < now())) RETURNING 'd'::text, scope";
static const char sql_admin_release_citus_left[] =
    "SELECT 't'::text, NULL::bytea FROM idemgate_keys WHERE route = $1 AND key = $2";

/* The purge epoch moves on after an admin purge or release committed (store.h), and every gateway hears of it. */
static const char sql_epoch_bump[] =
    "WITH e AS (UPDATE idemgate_epoch SET epoch = epoch + 1 WHERE id = 1 RETURNING epoch)"
    " SELECT e.epoch::text FROM e, (SELECT pg_notify('" STORE_NOTIFY_EPOCH_CHANNEL "', epoch::text) FROM e) AS n";

/* Citus routes the purge (and runs the release) on the worker that holds the key's shard, and a notification sent
 * there reaches no gateway: they listen on the coordinator. There the bump, on the coordinator's own table, tells
 * the replay caches too ($1 route, $2 key), before the answer. (Plain Postgres: unused; the deletion notified.) */
static const char sql_epoch_bump_citus[] =
    "WITH e AS (UPDATE idemgate_epoch SET epoch = epoch + 1 WHERE id = 1 RETURNING epoch)"
    " SELECT e.epoch::text FROM e, (SELECT pg_notify('" STORE_NOTIFY_EPOCH_CHANNEL "', epoch::text) FROM e) AS n,"
    " (" SQL_NOTIFY_CACHE ") AS c";

/* A TID scan over at most 1000 rows found through the expires_at index. */
static const char sql_clean[] = "DELETE FROM idemgate_keys WHERE ctid = ANY (ARRAY(SELECT ctid FROM idemgate_keys"
                                " WHERE expires_at < now() AND lease_until < now() AND state = 'completed' LIMIT 1000))"
                                " AND expires_at < now() AND lease_until < now() AND state = 'completed'";

/* Citus routes no ctid-filtered modification: at most 1000 expired records, found through the partial
 * expires_at index (the SELECT runs on every shard with the LIMIT pushed down, the coordinator keeps 1000),
 * deleted by primary key on the shards that hold them. Not on plain Postgres: its planner may join the other way
 * round there (every expired row against the sample), where the TID scan above reads only the sample. */
static const char sql_clean_citus[] =
    "DELETE FROM idemgate_keys WHERE (route, key, scope) IN (SELECT route, key, scope FROM idemgate_keys"
    " WHERE expires_at < now() AND lease_until < now() AND state = 'completed' LIMIT 1000)"
    " AND expires_at < now() AND lease_until < now() AND state = 'completed'";

static const char sql_stuck[] = "SELECT route, count(*)::int8 FROM idemgate_keys"
                                " WHERE state IN ('in_flight', 'unknown') AND created_at < now() - interval '5 minutes'"
                                " GROUP BY route";

/* Claims in doubt: is a server process that may still commit one of them
 * alive? It is asked to end (a process paused mid-claim would otherwise
 * commit it whenever it resumes; only our own role's may be signalled,
 * another's is waited for); the claim is released only once every
 * such process is gone, so that the release cannot run before the claim's
 * own commit. $2: how long ago (ms, by the gateway's monotonic clock) the
 * doubtful attempt was sent, so that the comparison is made on Postgres's
 * own clock (SPEC 8, one clock): a process started after the attempt reuses
 * the number (a second of slack, for the statement's own travel; a reused
 * number only makes the release wait). */
static const char sql_doubt_alive[] =
    "SELECT pid, CASE WHEN usename = current_user THEN pg_terminate_backend(pid) END FROM pg_stat_activity"
    " WHERE pid = ANY ($1::int4[]) AND pid <> pg_backend_pid()"
    " AND backend_start < now() - $2 * interval '1 ms' + interval '1 s'";
static const Oid doubt_alive_types[] = {STORE_OID_INT4_ARRAY, STORE_OID_INT8};

/* The release of a claim in doubt: only while it is in flight under its
 * token (nothing was ever forwarded under it). */
static const char sql_doubt_release[] = "DELETE FROM idemgate_keys WHERE route = $1 AND scope = $2 AND key = $3"
                                        " AND token = $4 AND state = 'in_flight'";

/* A look-up (on_unknown: probe) takes an unknown outcome whose lease lapsed under its own new token, for as long
 * as the look-up may take: one prober at a time per record, and whatever it writes next (completion, release,
 * giving the record back) is fenced by that token. The state stays: a retry meanwhile is in flight. A claim in
 * flight whose lease lapsed is an unknown outcome too (its owner is gone: a crash, or a completion it could not
 * write; SPEC 4), so it is taken the same way; its old owner's writes are fenced off by the new token. */
/* $6: how long after the lapse (the upstream's timeout + probe.grace): the original attempt may still be running
 * at the upstream until then, and a look-up would not see its work yet (SPEC 8). */
static const char sql_probe_take[] =
    "UPDATE idemgate_keys SET token = $4, lease_until = now() + $5 * interval '1 ms'"
    " WHERE route = $1 AND scope = $2 AND key = $3 AND state IN ('in_flight', 'unknown')"
    " AND lease_until < now() - $6 * interval '1 ms'";
static const Oid probe_take_types[] = {STORE_OID_TEXT, STORE_OID_BYTEA, STORE_OID_TEXT,
                                       STORE_OID_INT8, STORE_OID_INT8,  STORE_OID_INT8};

/* The sweeper's batch: unknown outcomes (and claims in flight) whose lease lapsed, of the probe routes ($1: their
 * names joined by '\n'; route names never hold one), those looked at least recently first (a failed look-up gives
 * its record back with lease_until = now()). */
static const char sql_probe_list[] =
    "SELECT route, scope, key FROM idemgate_keys WHERE state IN ('in_flight', 'unknown') AND lease_until < now()"
    " AND route = ANY (string_to_array($1, E'\\n')) ORDER BY lease_until LIMIT $2";
static const Oid probe_list_types[] = {STORE_OID_TEXT, STORE_OID_INT8};

static const struct store_pg_stmt stmts[STORE_S__COUNT] = {
    [STORE_S_CLAIM] = {"idg_claim", sql_claim, 9, claim_types, 3, sql_claim_multi, claim_multi_types, NULL},
    [STORE_S_COMPLETE] = {"idg_complete", sql_complete, 7, complete_types, 3, sql_complete_multi, complete_multi_types,
                          NULL},
    [STORE_S_RENEW] = {"idg_renew", sql_renew, 5, fenced_types, 3, NULL, NULL, NULL},
    [STORE_S_RELEASE] = {"idg_release", sql_release, 4, release_types, 3, NULL, NULL, NULL},
    [STORE_S_MARK_UNKNOWN] = {"idg_mark_unknown", sql_mark_unknown, 5, fenced_types, 3, NULL, NULL, NULL},
    [STORE_S_ADMIN_LIST] = {"idg_admin_list", sql_admin_list, 2, admin_types, 0, NULL, NULL, NULL},
    [STORE_S_ADMIN_PURGE] = {"idg_admin_purge", sql_admin_purge, 2, admin_types, 0, NULL, NULL, NULL},
    [STORE_S_ADMIN_RELEASE] = {"idg_admin_release", sql_admin_release, 2, admin_types, 0, NULL, NULL, NULL},
    [STORE_S_CLEAN] = {"idg_clean", sql_clean, 0, NULL, 0, NULL, NULL, NULL},
    [STORE_S_STUCK] = {"idg_stuck", sql_stuck, 0, NULL, 0, NULL, NULL, NULL},
    [STORE_S_DOUBT_ALIVE] = {"idg_doubt_alive", sql_doubt_alive, 2, doubt_alive_types, 0, NULL, NULL, NULL},
    [STORE_S_DOUBT_RELEASE] = {"idg_doubt_release", sql_doubt_release, 4, release_types, 3, NULL, NULL, NULL},
    [STORE_S_PING] = {"idg_ping", "SELECT 1", 0, NULL, 0, NULL, NULL, NULL},
    [STORE_S_CLOCK] = {"idg_clock", "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8", 0, NULL, 0, NULL,
                       NULL, NULL},
    [STORE_S_PROBE_TAKE] = {"idg_probe_take", sql_probe_take, 6, probe_take_types, 3, NULL, NULL, NULL},
    [STORE_S_PROBE_LIST] = {"idg_probe_list", sql_probe_list, 2, probe_list_types, 0, NULL, NULL, NULL},
    [STORE_S_EPOCH_BUMP] = {"idg_epoch_bump", sql_epoch_bump, 2, admin_types, 0, NULL, NULL, NULL},
    [STORE_S_ADMIN_PAGE] = {"idg_admin_page", sql_admin_page, 7, admin_page_types, 0, NULL, NULL, NULL},
    [STORE_S_SETTLE_TAKE] = {"idg_settle_take", sql_settle_take, 5, fenced_types, 0, NULL, NULL, sql_settle_state},
};

const char *store_verdict_name(enum store_verdict v)
{
    switch (v) {
    case STORE_NEW:
        return "new";
    case STORE_REPLAY:
        return "replay";
    case STORE_MISMATCH:
        return "mismatch";
    case STORE_IN_FLIGHT:
        return "in_flight";
    case STORE_UNKNOWN:
        return "unknown";
    case STORE_UNAVAILABLE:
        return "unavailable";
    }
    return "?";
}

/* ---- health probe: Postgres answered within STORE_HEALTHY_WITHIN_MS */

static void probe_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store *s = arg;
    (void)st; /* the pool records answers and failures itself */
    (void)pr;
    (void)msg;
    s->probing = false;
}

/* Every STORE_PROBE_EVERY_MS: a cheap SELECT 1 when nothing else showed that the
 * server answers (a busy pool proves it with every result); and Postgres's
 * clock every STORE_CLOCK_EVERY_MS. */
static void probe_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct store *s = arg;
    (void)fd;
    (void)what;
    if (!s->clocking && (s->clock_read_ms == 0 || cm_now_ms() - s->clock_read_ms >= STORE_CLOCK_EVERY_MS)) {
        s->clocking = true;
        s->clock_sent_ms = cm_now_ms();
        store_pg_query(s->pg, STORE_S_CLOCK, NULL, 0, 0, store_i_clock_cb, s);
    }
    if (s->probing || cm_now_ms() - store_pg_last_ok_ms(s->pg) < STORE_PROBE_IDLE_MS)
        return;
    s->probing = true;
    store_pg_query(s->pg, STORE_S_PING, NULL, 0, 1, probe_cb, s);
}

bool store_postgres_healthy(const struct store *s)
{
    return s && store_pg_healthy(s->pg, STORE_HEALTHY_WITHIN_MS);
}

/* ---- life cycle */

/* Postgres answers again: what waited for it goes now. */
static void store_pg_back(void *arg)
{
    struct store *s = arg;
    store_i_settle_kick(s);
    s->doubt_backoff_ms = STORE_DOUBT_BACKOFF_MIN_MS;
    if (s->doubt_head && !s->doubt_busy)
        store_i_doubt_schedule(s, 0);
}

struct store *store_create(struct event_base *base, const struct conf *conf, char **err)
{
    if (!conf->postgres_url || !*conf->postgres_url) {
        *err = cm_strdup("store: no postgres URL");
        return NULL;
    }
    struct store *s = cm_calloc(1, sizeof *s);
    s->base = base;
    s->conf = conf;
    if (conf->redis_url && *conf->redis_url) {
        s->rd = store_rd_create(base, &conf->redis, conf->redis_url, conf->redis_timeout_ms, err);
        if (!s->rd) {
            free(s);
            return NULL;
        }
    }
    s->pg_opts.conninfo = conf->postgres_url;
    s->pg_opts.size = conf->pool ? conf->pool : 1;
    s->pg_opts.queue_timeout_ms = STORE_QUEUE_TIMEOUT_MS;
    s->pg_opts.run_timeout_ms = STORE_RUN_TIMEOUT_MS;
    bool citus = conf->distributed == CONF_DIST_CITUS;
    /* Every statement finds its rows through an index (primary key, expires_at, the in-flight index). On Citus
     * the coordinator plans each execution with its parameters (custom plans): it routes a statement to the
     * shard its key names only with the key's value in hand (a generic plan of these statements cannot be
     * distributed); the worker plans the shard's statement itself. */
    s->pg_opts.init_sql = citus ? "SET statement_timeout = " STORE_STATEMENT_TIMEOUT_MS
                                  "; SET plan_cache_mode = force_custom_plan"
                                : "SET statement_timeout = " STORE_STATEMENT_TIMEOUT_MS "; " STORE_PG_INDEX_PLANS_SQL;
    s->pg_opts.connect_timeout_ms = STORE_CONNECT_TIMEOUT_MS;
    s->pg_opts.max_queue = STORE_MAX_QUEUE;
    s->pg_opts.max_batch = STORE_MAX_BATCH;
    memcpy(s->all_stmts, stmts, sizeof stmts);
    if (citus) {
        struct store_pg_stmt *a = s->all_stmts;
        a[STORE_S_CLAIM].sql = sql_claim_citus;
        a[STORE_S_CLAIM].then_sql = sql_claim_citus_read;
        a[STORE_S_CLAIM].multi_sql = NULL;
        a[STORE_S_COMPLETE].multi_sql = NULL;
        a[STORE_S_ADMIN_RELEASE].sql = sql_admin_release_citus;
        a[STORE_S_ADMIN_RELEASE].then_sql = sql_admin_release_citus_left;
        a[STORE_S_CLEAN].sql = sql_clean_citus;
        a[STORE_S_EPOCH_BUMP].sql = sql_epoch_bump_citus;
    }
    memcpy(s->all_stmts + STORE_S__COUNT, store_order_stmts(citus), STORE_ORDER_NSTMTS * sizeof(struct store_pg_stmt));
    s->pg_opts.stmts = s->all_stmts;
    s->pg_opts.nstmts = STORE_S__COUNT + STORE_ORDER_NSTMTS;
    s->pg = store_pg_create(base, &s->pg_opts);
    s->order = store_order_create(base, s->pg, STORE_S__COUNT, store_clock_ms);
    store_pg_on_up(s->pg, store_pg_back, s);
    s->clean_timer = evtimer_new(base, store_i_clean_timer_cb, s);
    s->doubt_timer = evtimer_new(base, store_i_doubt_timer_cb, s);
    s->probe_timer = event_new(base, -1, EV_PERSIST, probe_timer_cb, s);
    if (!s->clean_timer || !s->doubt_timer || !s->probe_timer)
        abort();
    static const struct timeval probe_tv = {0, STORE_PROBE_EVERY_MS * 1000};
    event_add(s->probe_timer, &probe_tv);
    s->doubt_backoff_ms = STORE_DOUBT_BACKOFF_MIN_MS;
    store_i_clean_schedule(s, STORE_CLEAN_FIRST_MS);
    return s;
}

void store_destroy(struct store *s)
{
    if (!s)
        return;
    event_free(s->clean_timer);
    event_free(s->doubt_timer);
    event_free(s->probe_timer);
    /* Both drop their pending callbacks; then the operations that waited on them go. */
    store_pg_destroy(s->pg);
    store_rd_destroy(s->rd);
    store_order_destroy(s->order);
    if (s->ndoubt > 0)
        cm_log(CM_WARN, "claims_in_doubt_left", "n=%zu effect=stay_in_flight_then_unknown", s->ndoubt);
    struct store_i_doubt *d;
    while ((d = store_i_doubt_pop(s)) != NULL) {
        store_i_doubt_free(d);
        cm_metric_claims_in_doubt(-1);
    }
    struct store_i_op *o;
    while ((o = s->ops) != NULL) {
        store_i_op_unlink(o);
        store_i_op_free(o);
    }
    free(s);
}

struct store_order *store_order_of(struct store *s)
{
    return s->order;
}

bool store_postgres_up(const struct store *s)
{
    return s && store_pg_up(s->pg);
}

bool store_redis_up(const struct store *s)
{
    return s && s->rd && store_rd_up(s->rd);
}

bool store_redis_enabled(const struct store *s)
{
    return s && s->rd != NULL;
}
