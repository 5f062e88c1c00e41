/* store.c - the idempotency authority on the loop (one atomic Postgres claim statement, token-fenced owner
 * operations, the probe queries, expiry cleaner, admin queries) and its Redis fast filter (in-flight marker,
 * completed cache); never the blocking start-up work (schema migration, route identities: migrate.c). */
#include "store/store.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <event2/event.h>
#include <hiredis/hiredis.h>
#include <libpq-fe.h>

#include "common/metrics.h"
#include "conf/conf.h"
#include "store/notify.h"
#include "store/order.h"
#include "store/pg.h"
#include "store/redis.h"

/* The server aborts a statement after STATEMENT_TIMEOUT_MS, before the
 * client gives up on it (RUN_TIMEOUT_MS): a claim the client abandoned does
 * not commit later behind its back (short of a network stall). */
#define QUEUE_TIMEOUT_MS        5000
#define STATEMENT_TIMEOUT_MS    "4000"
#define RUN_TIMEOUT_MS          5000
#define CONNECT_TIMEOUT_MS      5000
#define MAX_QUEUE               65536
#define MAX_BATCH               16 /* queries sharing one transaction while the pool is busy (store/pg.h) */
#define CLAIM_ATTEMPTS          5
#define OWNER_ATTEMPTS          3    /* renew: tries after a rollback */
#define DOUBT_MAX               1024 /* claims in doubt remembered per store (loop) */
#define DOUBT_BACKOFF_MIN_MS    100
#define DOUBT_BACKOFF_MAX_MS    2000
#define PROBE_EVERY_MS          300   /* the health probe's period */
#define CLOCK_EVERY_MS          10000 /* Postgres's clock is read this often (store_clock_ms) */
#define CLOCK_MAX_RTT_MS        500   /* a reading whose round trip took longer is not used */
#define PROBE_IDLE_MS           250   /* pings only when Postgres has not answered anything for this long */
#define HEALTHY_WITHIN_MS       1000  /* /readyz: the last answer is at most this old */
#define COMPLETE_BACKOFF_MIN_MS 50
#define COMPLETE_BACKOFF_MAX_MS 1000
#define CLEAN_FIRST_MS          1000
#define CLEAN_EVERY_MS          10000
#define CLEAN_BATCH             1000
#define CLEAN_MAX_BATCHES       10
#define STUCK_EVERY_CITUS       6 /* cleaner passes per stuck count on Citus (one a minute) */
#define ADMIN_MAX_ROWS          1000
#define ADMIN_JSON_MAX          (4u << 20)
#define RESP_BLOB_MAX           ((size_t)1 << 30)
#define RKEY_LEN                (4 + 64)
#define MARKER_LEN              41 /* "F" + fingerprint + token */

#define OID_BOOL        16
#define OID_BYTEA       17
#define OID_INT8        20
#define OID_INT4        23
#define OID_TEXT        25
#define OID_BOOL_ARRAY  1000
#define OID_BYTEA_ARRAY 1001
#define OID_INT4_ARRAY  1007
#define OID_TEXT_ARRAY  1009
#define OID_INT8_ARRAY  1016

#define PROBLEM_PREFIX "urn:idemgate:problem:"

/* ---- SQL */

#define TS(col) "to_char(" col " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"
/* Retention applies to completed records only: an unknown outcome (or an
 * orphaned claim) never expires into "new"; it stays until an operator
 * releases or purges it, or (on_unknown: retry) a retry takes it over. */
#define TAKEABLE(p)                                                                                                    \
    "(" p "state = 'completed' AND " p "expires_at < now() AND " p "lease_until < now()) OR ($8 AND " p                \
    "state IN ('in_flight', 'unknown') AND " p "lease_until < now() AND " p "fingerprint = $4)"

enum stmt_id {
    S_CLAIM,
    S_COMPLETE,
    S_RENEW,
    S_RELEASE,
    S_MARK_UNKNOWN,
    S_ADMIN_LIST,
    S_ADMIN_PURGE,
    S_ADMIN_RELEASE,
    S_CLEAN,
    S_STUCK,
    S_DOUBT_ALIVE,
    S_DOUBT_RELEASE,
    S_PING,
    S_CLOCK,
    S_PROBE_TAKE,
    S_PROBE_LIST,
    S_EPOCH_BUMP,
    S__COUNT
};

static const Oid claim_types[] = {OID_TEXT, OID_BYTEA, OID_TEXT, OID_BYTEA, OID_INT8, OID_INT8, OID_INT8, OID_BOOL};
static const Oid claim_multi_types[] = {OID_TEXT_ARRAY, OID_BYTEA_ARRAY, OID_TEXT_ARRAY, OID_BYTEA_ARRAY,
                                        OID_INT8_ARRAY, OID_INT8_ARRAY,  OID_INT8_ARRAY, OID_BOOL_ARRAY};
static const Oid complete_types[] = {OID_TEXT, OID_BYTEA, OID_TEXT, OID_INT8, OID_INT4, OID_BYTEA, OID_INT8};
static const Oid complete_multi_types[] = {OID_TEXT_ARRAY, OID_BYTEA_ARRAY, OID_TEXT_ARRAY, OID_INT8_ARRAY,
                                           OID_INT4_ARRAY, OID_BYTEA_ARRAY, OID_INT8_ARRAY};
static const Oid fenced_types[] = {OID_TEXT, OID_BYTEA, OID_TEXT, OID_INT8, OID_INT8};
static const Oid release_types[] = {OID_TEXT, OID_BYTEA, OID_TEXT, OID_INT8};
static const Oid admin_types[] = {OID_TEXT, OID_TEXT};

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
    " expires_at)"
    " VALUES ($1, $2, $3, $4, 'in_flight', $5, now() + $6 * interval '1 ms', now(), now() + $7 * interval '1 ms')"
    " ON CONFLICT (route, scope, key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, state = 'in_flight',"
    " token = EXCLUDED.token, lease_until = EXCLUDED.lease_until, created_at = EXCLUDED.created_at,"
    " completed_at = NULL, expires_at = EXCLUDED.expires_at, status = NULL, response = NULL"
    " WHERE " TAKEABLE("k.")
    " RETURNING k.token, k.created_at)"
    " SELECT 'new'::text, token, NULL::bytea, NULL::int4, NULL::bytea, 0::int8, 0::int8, false, true, created_at"
    " FROM ins"
    " UNION ALL"
    " SELECT state, token, fingerprint, status, response,"
    " greatest(0, ceil(extract(epoch FROM lease_until - now()) * 1000))::int8,"
    " greatest(0, floor(extract(epoch FROM expires_at - now()) * 1000))::int8,"
    " " TAKEABLE("") ","
    " lease_until >= now(), created_at"
    " FROM idemgate_keys WHERE route = $1 AND scope = $2 AND key = $3 AND NOT EXISTS (SELECT 1 FROM ins)";
/* clang-format on */

/* The claim for several keys at once (distinct rows; store/pg.h batches):
 * the same parameters as arrays, one result row per key, first column its
 * 1-based position. The takeover flag is per key: the conflict filter reads
 * it back from u. */
/* clang-format off */
static const char sql_claim_multi[] =
    "WITH u AS (SELECT * FROM unnest($1::text[], $2::bytea[], $3::text[], $4::bytea[], $5::int8[], $6::int8[],"
    " $7::int8[], $8::bool[]) WITH ORDINALITY AS u(route, scope, key, fp, token, lease_ms, ret_ms, takeover, n)),"
    " ins AS ("
    " INSERT INTO idemgate_keys AS k (route, scope, key, fingerprint, state, token, lease_until, created_at,"
    " expires_at)"
    " SELECT route, scope, key, fp, 'in_flight', token, now() + lease_ms * interval '1 ms', now(),"
    " now() + ret_ms * interval '1 ms' FROM u"
    " ON CONFLICT (route, scope, key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, state = 'in_flight',"
    " token = EXCLUDED.token, lease_until = EXCLUDED.lease_until, created_at = EXCLUDED.created_at,"
    " completed_at = NULL, expires_at = EXCLUDED.expires_at, status = NULL, response = NULL"
    " WHERE (k.state = 'completed' AND k.expires_at < now() AND k.lease_until < now()) OR ((SELECT u.takeover FROM u WHERE u.route = k.route"
    " AND u.scope = k.scope AND u.key = k.key) AND k.state IN ('in_flight', 'unknown') AND k.lease_until < now()"
    " AND k.fingerprint = EXCLUDED.fingerprint)"
    " RETURNING k.route, k.scope, k.key, k.token, k.created_at)"
    " SELECT u.n, 'new'::text, ins.token, NULL::bytea, NULL::int4, NULL::bytea, 0::int8, 0::int8, false, true,"
    " ins.created_at FROM u JOIN ins ON ins.route = u.route AND ins.scope = u.scope AND ins.key = u.key"
    " UNION ALL"
    " SELECT u.n, t.state, t.token, t.fingerprint, t.status, t.response,"
    " greatest(0, ceil(extract(epoch FROM t.lease_until - now()) * 1000))::int8,"
    " greatest(0, floor(extract(epoch FROM t.expires_at - now()) * 1000))::int8,"
    " (t.state = 'completed' AND t.expires_at < now() AND t.lease_until < now()) OR (u.takeover AND t.state IN ('in_flight', 'unknown')"
    " AND t.lease_until < now() AND t.fingerprint = u.fp),"
    " t.lease_until >= now(), t.created_at"
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
    " expires_at)"
    " VALUES ($1, $2, $3, $4, 'in_flight', $5, now() + $6 * interval '1 ms', now(), now() + $7 * interval '1 ms')"
    " ON CONFLICT (route, key, scope) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, state = 'in_flight',"
    " token = EXCLUDED.token, lease_until = EXCLUDED.lease_until, created_at = EXCLUDED.created_at,"
    " completed_at = NULL, expires_at = EXCLUDED.expires_at, status = NULL, response = NULL"
    " WHERE " TAKEABLE_AT("k.", "EXCLUDED.created_at")
    " RETURNING 'new'::text, k.token, NULL::bytea, NULL::int4, NULL::bytea, 0::int8, 0::int8, false, true,"
    " k.created_at";
static const char sql_claim_citus_read[] =
    "SELECT state, token, fingerprint, status, response,"
    " greatest(0, ceil(extract(epoch FROM lease_until - now()) * 1000))::int8,"
    " greatest(0, floor(extract(epoch FROM expires_at - now()) * 1000))::int8,"
    " " TAKEABLE("") ","
    " lease_until >= now(), created_at"
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
static const Oid doubt_alive_types[] = {OID_INT4_ARRAY, OID_INT8};

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
static const Oid probe_take_types[] = {OID_TEXT, OID_BYTEA, OID_TEXT, OID_INT8, OID_INT8, OID_INT8};

/* The sweeper's batch: unknown outcomes (and claims in flight) whose lease lapsed, of the probe routes ($1: their
 * names joined by '\n'; route names never hold one), those looked at least recently first (a failed look-up gives
 * its record back with lease_until = now()). */
static const char sql_probe_list[] =
    "SELECT route, scope, key FROM idemgate_keys WHERE state IN ('in_flight', 'unknown') AND lease_until < now()"
    " AND route = ANY (string_to_array($1, E'\\n')) ORDER BY lease_until LIMIT $2";
static const Oid probe_list_types[] = {OID_TEXT, OID_INT8};

static const struct store_pg_stmt stmts[S__COUNT] = {
    [S_CLAIM] = {"idg_claim", sql_claim, 8, claim_types, 3, sql_claim_multi, claim_multi_types, NULL},
    [S_COMPLETE] = {"idg_complete", sql_complete, 7, complete_types, 3, sql_complete_multi, complete_multi_types, NULL},
    [S_RENEW] = {"idg_renew", sql_renew, 5, fenced_types, 3, NULL, NULL, NULL},
    [S_RELEASE] = {"idg_release", sql_release, 4, release_types, 3, NULL, NULL, NULL},
    [S_MARK_UNKNOWN] = {"idg_mark_unknown", sql_mark_unknown, 5, fenced_types, 3, NULL, NULL, NULL},
    [S_ADMIN_LIST] = {"idg_admin_list", sql_admin_list, 2, admin_types, 0, NULL, NULL, NULL},
    [S_ADMIN_PURGE] = {"idg_admin_purge", sql_admin_purge, 2, admin_types, 0, NULL, NULL, NULL},
    [S_ADMIN_RELEASE] = {"idg_admin_release", sql_admin_release, 2, admin_types, 0, NULL, NULL, NULL},
    [S_CLEAN] = {"idg_clean", sql_clean, 0, NULL, 0, NULL, NULL, NULL},
    [S_STUCK] = {"idg_stuck", sql_stuck, 0, NULL, 0, NULL, NULL, NULL},
    [S_DOUBT_ALIVE] = {"idg_doubt_alive", sql_doubt_alive, 2, doubt_alive_types, 0, NULL, NULL, NULL},
    [S_DOUBT_RELEASE] = {"idg_doubt_release", sql_doubt_release, 4, release_types, 3, NULL, NULL, NULL},
    [S_PING] = {"idg_ping", "SELECT 1", 0, NULL, 0, NULL, NULL, NULL},
    [S_CLOCK] = {"idg_clock", "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8", 0, NULL, 0, NULL, NULL,
                 NULL},
    [S_PROBE_TAKE] = {"idg_probe_take", sql_probe_take, 6, probe_take_types, 3, NULL, NULL, NULL},
    [S_PROBE_LIST] = {"idg_probe_list", sql_probe_list, 2, probe_list_types, 0, NULL, NULL, NULL},
    [S_EPOCH_BUMP] = {"idg_epoch_bump", sql_epoch_bump, 2, admin_types, 0, NULL, NULL, NULL},
};

/* ---- the store */

enum op_kind { OP_CLAIM, OP_COMPLETE, OP_RENEW, OP_RELEASE, OP_MARK_UNKNOWN, OP_ADMIN, OP_PROBE_TAKE, OP_PROBE_LIST };

/* Every pending operation is on the store's list so that store_destroy can
 * free it without calling back. */
struct op {
    struct op *prev, *next;
    struct store *s;
    enum op_kind kind;
};

struct store {
    struct event_base *base;
    const struct conf *conf;
    struct store_pg_opts pg_opts;
    struct store_pg *pg;
    struct store_rd *rd;
    struct event *clean_timer;
    bool cleaning;
    int clean_batches;
    uint64_t clean_passes;
    uint64_t cleaned;
    struct op *ops;
    /* Claims in doubt (FIFO, at most DOUBT_MAX): released one at a time by doubt_timer. */
    struct doubt *doubt_head, *doubt_tail;
    size_t ndoubt;
    struct event *doubt_timer;
    uint64_t doubt_backoff_ms;
    bool doubt_busy; /* a query for doubt_head runs */
    struct event *probe_timer;
    bool probing;           /* a ping runs */
    bool clocking;          /* a reading of Postgres's clock runs */
    uint64_t clock_sent_ms; /* it was sent then (cm_now_ms) */
    uint64_t clock_read_ms; /* the last usable reading came then (0: none yet) */
    /* the ordering guard (store/order.c): its statements follow ours in the pool's table */
    struct store_pg_stmt all_stmts[S__COUNT + STORE_ORDER_NSTMTS];
    struct store_order *order;
    bool settle_stop;          /* shutting down past the grace: a settle operation that fails is not tried again */
    struct store_epoch *epoch; /* the process's purge epoch (NULL: none; no Redis answer is used) */
};

struct store_epoch {
    _Atomic uint64_t known; /* the largest epoch heard of */
    atomic_bool current;    /* every purge committed until now has been heard of */
};

/* A claim whose commit outcome the gateway does not know (its statement
 * timed out or its connection broke, and no later attempt settled it):
 * nothing was forwarded under its token, so it is released, fenced by the
 * token, once the server processes that may still commit it are gone. */
struct doubt {
    struct doubt *next;
    char *route;
    char *key;
    size_t key_len;
    uint8_t scope[32];
    uint64_t token;
    int pids[CLAIM_ATTEMPTS]; /* server processes of the doubtful attempts */
    int npids;
    uint64_t sent_ms; /* when the first doubtful attempt was sent (cm_now_ms) */
    int tries;
};

struct claim_op {
    struct op h;
    char *route;
    char *key;
    size_t key_len;
    size_t route_index;
    uint8_t scope[32];
    uint8_t fp[32];
    uint64_t lease_ms;
    uint64_t retention_ms;
    bool takeover;
    uint64_t token;
    int attempts;
    bool marker_ours;         /* our SET NX placed the in-flight marker */
    uint8_t seen[MARKER_LEN]; /* the marker SET NX GET found instead (a cache refill compares against it) */
    bool seen_marker;
    bool seen_stale; /* SET NX GET found an answer that may not be used (older than a purge, or unverifiable) */
    uint64_t epoch;  /* the purge epoch known when the claim was sent: what a refill carries */
    uint64_t
        sent_pg_ms;   /* the last attempt was sent then, on Postgres's clock (store_clock_ms): a Redis entry's expiry */
    uint64_t sent_ms; /* the same, cm_now_ms */
    int doubt_pids[CLAIM_ATTEMPTS]; /* attempts that may have committed (timeout, connection lost) */
    int ndoubt;
    uint64_t doubt_sent_ms; /* cm_now_ms */
    char rkey[RKEY_LEN + 1];
    store_claim_cb cb;
    void *arg;
    /* Redis' SET NX GET and the Postgres claim run at once: the op lives until both came back. */
    bool rd_pending; /* the SET NX GET has not answered yet (its timer bounds it) */
    bool pg_pending; /* the claim (with its re-runs) has not settled yet */
    bool answered;   /* cb ran */
    /* Postgres' verdict, held while Redis (which may hold the answer, and tells whose marker is there) is pending */
    bool held;
    struct store_claim_res held_res;
    char *held_blob; /* a replay's stored answer, for the Redis refill */
    size_t held_blob_len;
};

struct owner_op {
    struct op h;
    char *route;
    char *key;
    size_t key_len;
    uint8_t scope[32];
    uint64_t token;
    uint64_t arg_ms;  /* lease (renew, mark_unknown: an int8, may be negative) or retention (complete) */
    uint64_t arg2_ms; /* probe_take: the wait after the lapse */
    char rkey[RKEY_LEN + 1];
    store_done_cb cb;
    void *arg;
    /* complete */
    char *blob;
    size_t blob_len;
    int status;
    uint64_t deadline_ms;
    uint64_t backoff_ms;
    int attempts;
    bool encode_failed;
    struct event *timer;
    long rows; /* release: rows Postgres reported, while the marker's removal runs */
};

struct admin_op {
    struct op h;
    enum stmt_id stmt;
    char *route;
    char *key;
    size_t key_len;
    store_admin_cb cb;
    void *arg;
    int status; /* the answer, while the Redis markers are being removed */
    char *json;
    bool bump; /* a purge or release: the purge epoch moves on before the answer */
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

static void op_link(struct store *s, struct op *o, enum op_kind kind)
{
    o->s = s;
    o->kind = kind;
    o->prev = NULL;
    o->next = s->ops;
    if (s->ops)
        s->ops->prev = o;
    s->ops = o;
}

static void op_unlink(struct op *o)
{
    struct store *s = o->s;
    if (o->prev)
        o->prev->next = o->next;
    else
        s->ops = o->next;
    if (o->next)
        o->next->prev = o->prev;
    o->prev = o->next = NULL;
}

static void op_free(struct op *o)
{
    switch (o->kind) {
    case OP_CLAIM: {
        struct claim_op *c = (struct claim_op *)o;
        free(c->route);
        free(c->key);
        if (c->held)
            cm_resp_free(&c->held_res.resp);
        free(c->held_blob);
        break;
    }
    case OP_COMPLETE:
    case OP_RENEW:
    case OP_RELEASE:
    case OP_MARK_UNKNOWN:
    case OP_PROBE_TAKE: {
        struct owner_op *w = (struct owner_op *)o;
        if (w->timer)
            event_free(w->timer);
        free(w->route);
        free(w->key);
        free(w->blob);
        break;
    }
    case OP_ADMIN: {
        struct admin_op *a = (struct admin_op *)o;
        free(a->route);
        free(a->key);
        free(a->json);
        break;
    }
    case OP_PROBE_LIST:
        break;
    }
    free(o);
}

/* ---- helpers */

static void be64(uint8_t out[8], uint64_t v)
{
    for (int i = 7; i >= 0; i--) {
        out[i] = (uint8_t)(v & 0xff);
        v >>= 8;
    }
}

static uint64_t rd_be64(const uint8_t in[8])
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | in[i];
    return v;
}

/* A replay answered by Redis may be kept by the gateway's replay cache until the record's expiry written beside
 * it, less this (the wall clocks of the gateway that wrote it, of Postgres and of the reader may differ). */
#define REDIS_EXPIRY_MARGIN_MS 1000

static void be32(uint8_t out[4], uint32_t v)
{
    out[0] = (uint8_t)(v >> 24);
    out[1] = (uint8_t)(v >> 16);
    out[2] = (uint8_t)(v >> 8);
    out[3] = (uint8_t)v;
}

/* "idg:" + hex(SHA-256(route NUL scope NUL key)): no raw key or scope in Redis. */
static void redis_key(const char *route, const uint8_t scope[32], const char *key, size_t key_len,
                      char out[RKEY_LEN + 1])
{
    struct cm_sha256 h;
    uint8_t d[32];
    cm_sha256_init(&h);
    cm_sha256_update(&h, route, strlen(route));
    cm_sha256_update(&h, "", 1);
    cm_sha256_update(&h, scope, 32);
    cm_sha256_update(&h, "", 1);
    cm_sha256_update(&h, key, key_len);
    cm_sha256_final(&h, d);
    memcpy(out, "idg:", 4);
    cm_hex(d, 32, out + 4);
    out[RKEY_LEN] = '\0';
}

static const char *pg_err_text(enum store_pg_status st)
{
    switch (st) {
    case STORE_PG_OK:
        return "ok";
    case STORE_PG_SQL_ERROR:
        return "postgres error";
    case STORE_PG_TRANSPORT:
        return "postgres connection lost";
    case STORE_PG_TRANSIENT:
        return "postgres transient error";
    case STORE_PG_TIMEOUT:
        return "postgres timeout";
    case STORE_PG_UNAVAILABLE:
        return "postgres unavailable";
    case STORE_PG_OVERLOAD:
        return "postgres queue full";
    }
    return "postgres error";
}

static void log_pg_failure(const char *what, enum store_pg_status st, const char *msg)
{
    char q[512];
    cm_log(st == STORE_PG_SQL_ERROR ? CM_ERROR : CM_WARN, "store_error", "op=%s status=%s error=%s", what,
           store_pg_status_name(st), cm_log_quote(q, sizeof q, msg ? msg : ""));
}

static long cmd_rows(const PGresult *res)
{
    const char *t = PQcmdTuples((PGresult *)res);
    if (!t || !*t)
        return PQntuples(res);
    char *end = NULL;
    long v = strtol(t, &end, 10);
    return (end && *end == '\0' && v >= 0) ? v : 0;
}

static void redis_fire(struct store *s, int argc, const char **argv, const size_t *lens)
{
    if (s->rd)
        (void)store_rd_command(s->rd, NULL, NULL, argc, argv, lens);
}

static void redis_del(struct store *s, const char *rkey)
{
    const char *argv[2] = {"DEL", rkey};
    size_t lens[2] = {3, strlen(rkey)};
    redis_fire(s, 2, argv, lens);
}

static void redis_pexpire(struct store *s, const char *rkey, uint64_t ms)
{
    char px[24];
    snprintf(px, sizeof px, "%llu", (unsigned long long)(ms ? ms : 1));
    const char *argv[3] = {"PEXPIRE", rkey, px};
    size_t lens[3] = {7, strlen(rkey), strlen(px)};
    redis_fire(s, 3, argv, lens);
}

/* The in-flight marker a claim places with SET NX: "F" + fingerprint +
 * token. It never answers anything by itself (Postgres decides every
 * verdict but a cached replay); it is what a cache write compares against. */
static void make_marker(uint8_t out[MARKER_LEN], const uint8_t fp[32], uint64_t token)
{
    out[0] = 'F';
    memcpy(out + 1, fp, 32);
    be64(out + 33, token);
}

/* A completed answer in Redis: "G" + fingerprint + the record's expiry (wall ms) + the purge epoch (both 8 bytes,
 * big-endian) + cm_resp_encode blob. */
#define RVAL_HEAD 49

/* Writes the value only while the key still holds what the writer saw:
 * an admin purge that deleted the record and then the Redis key in between
 * (or anybody else who changed it) wins, and the purged answer is not put
 * back. An answer of an older epoch (or of the older forms "C"/"E", which
 * carry none) is replaced too: it may not be used any more, and the answer
 * just read from Postgres is the record's. ARGV[4]: the new value's epoch. */
static const char redis_cas_lua[] =
    "local v = redis.call('GET', KEYS[1]) local put = v == ARGV[1]"
    " if not put and v then local t = string.sub(v, 1, 1)"
    " if t == 'C' or t == 'E' then put = true"
    " elseif t == 'G' and #v >= 49 then local e = 0"
    " for i = 42, 49 do e = e * 256 + string.byte(v, i) end put = e < tonumber(ARGV[4]) end end"
    " if put then return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) else return 0 end";

/* Caches a completed answer, fire-and-forget (format above; the expiry is never later than Postgres' expires_at:
 * taken from before the statement that read it), for ttl_ms, if the key still holds expect (expect_len bytes; 0: no
 * marker) or an answer of an epoch older than epoch. */
static void redis_cache(struct store *s, const char *rkey, const void *expect, size_t expect_len, const uint8_t fp[32],
                        const void *blob, size_t blob_len, uint64_t ttl_ms, uint64_t expiry_wall_ms, uint64_t epoch)
{
    if (!s->rd || ttl_ms == 0 || !store_rd_up(s->rd))
        return;
    size_t vlen = RVAL_HEAD + blob_len;
    char *val = cm_malloc(vlen);
    val[0] = 'G';
    memcpy(val + 1, fp, 32);
    be64((uint8_t *)val + 33, expiry_wall_ms);
    be64((uint8_t *)val + 41, epoch);
    memcpy(val + RVAL_HEAD, blob, blob_len);
    char px[24], ep[24];
    snprintf(px, sizeof px, "%llu", (unsigned long long)ttl_ms);
    snprintf(ep, sizeof ep, "%llu", (unsigned long long)epoch);
    const char *argv[8] = {"EVAL", redis_cas_lua, "1", rkey, expect_len ? expect : "", val, px, ep};
    size_t lens[8] = {4, sizeof redis_cas_lua - 1, 1, strlen(rkey), expect_len, vlen, strlen(px), strlen(ep)};
    redis_fire(s, 8, argv, lens);
    free(val);
}

/* ---- the purge epoch (store.h) */

struct store_epoch *store_epoch_create(void)
{
    struct store_epoch *e = cm_calloc(1, sizeof *e);
    atomic_init(&e->known, 0);
    atomic_init(&e->current, false);
    return e;
}

void store_epoch_destroy(struct store_epoch *e)
{
    free(e);
}

void store_epoch_heard(struct store_epoch *e, uint64_t epoch)
{
    if (!e)
        return;
    uint64_t cur = atomic_load(&e->known);
    while (cur < epoch && !atomic_compare_exchange_weak(&e->known, &cur, epoch)) {
    }
}

void store_epoch_set_current(struct store_epoch *e, bool current)
{
    if (e)
        atomic_store(&e->current, current);
}

void store_set_epoch(struct store *s, struct store_epoch *e)
{
    s->epoch = e;
}

static uint64_t epoch_known(const struct store *s)
{
    return s->epoch ? atomic_load(&s->epoch->known) : 0;
}

/* An answer of this epoch may answer for Postgres: this process has heard of every purge until now, and none came
 * after the answer was read. */
static bool epoch_trusts(const struct store *s, uint64_t epoch)
{
    return s->epoch && atomic_load(&s->epoch->current) && epoch >= atomic_load(&s->epoch->known);
}

/* ---- claim */

/* A claim sends Redis' SET NX GET and the Postgres claim at once, so a new key waits for the slower of the two
 * rather than for both in turn. Postgres decides, except that a completed answer cached in Redis is answered as
 * soon as Redis has it (as before, without waiting for Postgres):
 *  - Postgres took the key (STORE_NEW): answered at once, whatever Redis says or is still to say;
 *  - Redis holds a completed answer, and nothing was answered yet: that answer (replay, or 422 for another
 *    fingerprint); a claim Postgres makes after it is not used, and is released, fenced by its token (below);
 *  - any other verdict of Postgres waits for Redis (bounded by redis_timeout): a completed answer there is answered
 *    instead (Postgres failed, say), and otherwise Redis tells whose marker is there, which the refill of a replay
 *    and the removal of our own marker need.
 * The op lives until both came back; store_destroy frees one still waiting (neither side calls back then). */

static void claim_pg(struct claim_op *c);
static void doubt_remember(struct store *s, const char *route, const uint8_t scope[32], const char *key, size_t key_len,
                           uint64_t token, const int *pids, int npids, uint64_t sent_ms, bool unused);

/* Frees c once neither Redis nor Postgres will call back with it. */
static void claim_done(struct claim_op *c)
{
    if (c->rd_pending || c->pg_pending)
        return;
    op_unlink(&c->h);
    op_free(&c->h);
}

/* The one answer of the claim. */
static void claim_answer(struct claim_op *c, struct store_claim_res *res)
{
    struct store *s = c->h.s;
    /* Our marker must not outlive a claim that did not take the key: it
     * would answer "in flight" for a record that is not ours. */
    if (c->marker_ours && res->verdict != STORE_NEW && res->verdict != STORE_REPLAY)
        redis_del(s, c->rkey);
    c->answered = true;
    c->cb(c->arg, res);
    cm_resp_free(&res->resp);
}

/* Postgres' verdict when Redis has answered (or was never asked): a replay refills Redis, only over the marker this
 * claim placed or saw (a purge meanwhile removed it). */
static void claim_answer_pg(struct claim_op *c, struct store_claim_res *res, const char *blob, size_t blob_len)
{
    if (res->verdict == STORE_REPLAY && blob != NULL && (c->marker_ours || c->seen_marker || c->seen_stale)) {
        uint8_t mine[MARKER_LEN];
        make_marker(mine, c->fp, c->token);
        /* Redis keeps it a margin less than Postgres does: a key Postgres may give again must not find it there. */
        uint64_t ttl = res->expires_in_ms > REDIS_EXPIRY_MARGIN_MS ? res->expires_in_ms - REDIS_EXPIRY_MARGIN_MS : 0;
        redis_cache(c->h.s, c->rkey, c->marker_ours ? mine : c->seen, c->seen_stale ? 0 : MARKER_LEN, c->fp, blob,
                    blob_len, ttl, c->sent_pg_ms + res->expires_in_ms, c->epoch);
    }
    claim_answer(c, res);
}

/* Postgres settled the claim with res (blob: a replay's stored answer, or NULL). */
static void claim_pg_settled(struct claim_op *c, struct store_claim_res *res, const char *blob, size_t blob_len)
{
    c->pg_pending = false;
    /* Released once settled: an attempt that may still commit and none that made the key ours (in doubt), or a
     * key Postgres gave after Redis answered (unused: nothing is forwarded under its token). */
    bool in_doubt = c->ndoubt > 0 && res->verdict != STORE_NEW, unused = c->answered && res->verdict == STORE_NEW;
    if (in_doubt || unused)
        doubt_remember(c->h.s, c->route, c->scope, c->key, c->key_len, c->token, c->doubt_pids, c->ndoubt,
                       c->doubt_sent_ms, unused);
    if (c->answered) {
        cm_resp_free(&res->resp);
        claim_done(c);
        return;
    }
    if (res->verdict == STORE_NEW || !c->rd_pending) {
        claim_answer_pg(c, res, blob, blob_len);
        claim_done(c);
        return;
    }
    /* Redis may still hold the answer, and tells whose marker is there: wait for it (the op owns res's answer). */
    c->held = true;
    c->held_res = *res;
    if (blob != NULL) {
        c->held_blob = cm_malloc(blob_len ? blob_len : 1);
        memcpy(c->held_blob, blob, blob_len);
        c->held_blob_len = blob_len;
    }
}

static void claim_fail(struct claim_op *c, const char *err)
{
    struct store_claim_res res;
    memset(&res, 0, sizeof res);
    cm_resp_init(&res.resp, 0);
    res.verdict = STORE_UNAVAILABLE;
    res.err = err;
    claim_pg_settled(c, &res, NULL, 0);
}

static void claim_pg_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct claim_op *c = arg;
    struct store *s = c->h.s;
    if (st != STORE_PG_OK) {
        if (st != STORE_PG_UNAVAILABLE && st != STORE_PG_OVERLOAD)
            log_pg_failure("claim", st, msg);
        int pid = store_pg_cb_backend_pid(s->pg);
        if ((st == STORE_PG_TIMEOUT || st == STORE_PG_TRANSPORT) && pid > 0 && c->ndoubt < CLAIM_ATTEMPTS) {
            if (c->ndoubt == 0)
                c->doubt_sent_ms = c->sent_ms;
            c->doubt_pids[c->ndoubt++] = pid;
        }
        /* A broken link or a rolled-back statement: run it again. Should the
         * lost attempt have committed, the next one finds the record under
         * our own token and reports it as ours. */
        if ((st == STORE_PG_TRANSPORT || st == STORE_PG_TRANSIENT) && ++c->attempts < CLAIM_ATTEMPTS) {
            claim_pg(c);
            return;
        }
        claim_fail(c, pg_err_text(st));
        return;
    }
    const PGresult *read = store_pg_cb_then(s->pg); /* Citus: the read after the upsert */
    if (read && PQntuples(pr) == 0)
        pr = read;
    bool again = PQntuples(pr) == 0;
    if (!again && PQnfields(pr) >= 9) {
        const char *takeable = PQgetvalue(pr, 0, 7);
        again = !PQgetisnull(pr, 0, 7) && PQgetlength(pr, 0, 7) == 1 && takeable[0] != 0;
    }
    if (again) {
        /* The row changed after the statement's snapshot: run it again. */
        if (++c->attempts < CLAIM_ATTEMPTS) {
            claim_pg(c);
            return;
        }
        cm_log(CM_WARN, "store_error", "op=claim status=contention attempts=%d", c->attempts);
        claim_fail(c, "claim contention");
        return;
    }
    if (PQnfields(pr) < 9) {
        claim_fail(c, "unexpected claim result");
        return;
    }
    struct store_claim_res res;
    memset(&res, 0, sizeof res);
    cm_resp_init(&res.resp, 0);
    const char *state = PQgetvalue(pr, 0, 0);
    int state_len = PQgetlength(pr, 0, 0);
#define STATE_IS(lit) (state_len == (int)sizeof(lit) - 1 && memcmp(state, lit, sizeof(lit) - 1) == 0)
    uint64_t token = (uint64_t)store_pg_get_i64(pr, 0, 1);
    if (STATE_IS("new") || (STATE_IS("in_flight") && token == c->token)) {
        res.verdict = STORE_NEW;
        res.token = token;
        /* the claim's created_at (binary timestamptz: microseconds since 2000-01-01), set by every claim */
        res.fence = PQnfields(pr) >= 10 ? (uint64_t)store_pg_get_i64(pr, 0, 9) : 0;
        claim_pg_settled(c, &res, NULL, 0);
        return;
    }
    const uint8_t *fp = (const uint8_t *)PQgetvalue(pr, 0, 2);
    if (PQgetisnull(pr, 0, 2) || PQgetlength(pr, 0, 2) != 32 || memcmp(fp, c->fp, 32) != 0) {
        res.verdict = STORE_MISMATCH;
        claim_pg_settled(c, &res, NULL, 0);
        return;
    }
    if (STATE_IS("completed")) {
        const char *blob = PQgetvalue(pr, 0, 4);
        size_t blob_len = (size_t)PQgetlength(pr, 0, 4);
        cm_resp_free(&res.resp);
        if (PQgetisnull(pr, 0, 4) || !cm_resp_decode(blob, blob_len, &res.resp)) {
            cm_log(CM_ERROR, "store_error", "op=claim status=corrupt_response route=%s", c->route);
            res.verdict = STORE_UNAVAILABLE;
            res.err = "stored response is corrupt";
            claim_pg_settled(c, &res, NULL, 0);
            return;
        }
        res.verdict = STORE_REPLAY;
        res.expires_in_ms = (uint64_t)store_pg_get_i64(pr, 0, 6);
        claim_pg_settled(c, &res, blob, blob_len); /* Redis missed it (flushed, evicted, down): refilled */
        return;
    }
    bool live = !PQgetisnull(pr, 0, 8) && PQgetlength(pr, 0, 8) == 1 && PQgetvalue(pr, 0, 8)[0] != 0;
    if (live) {
        res.verdict = STORE_IN_FLIGHT;
        int64_t rem = store_pg_get_i64(pr, 0, 5);
        res.lease_remaining_ms = rem > 0 ? (uint64_t)rem : 0;
    } else {
        res.verdict = STORE_UNKNOWN;
    }
#undef STATE_IS
    claim_pg_settled(c, &res, NULL, 0);
}

static void claim_pg(struct claim_op *c)
{
    struct store *s = c->h.s;
    uint8_t tok[8], lease[8], ret[8];
    uint8_t takeover = c->takeover ? 1 : 0;
    be64(tok, c->token); /* one token for every attempt of this claim */
    be64(lease, c->lease_ms);
    be64(ret, c->retention_ms);
    struct store_pg_param p[8] = {
        {c->route, strlen(c->route), true},
        {c->scope, 32, true},
        {c->key, c->key_len, true},
        {c->fp, 32, true},
        {tok, 8, true},
        {lease, 8, true},
        {ret, 8, true},
        {&takeover, 1, true},
    };
    c->sent_pg_ms = store_clock_ms();
    c->sent_ms = cm_now_ms();
    store_pg_query(s->pg, S_CLAIM, p, 8, 1, claim_pg_cb, c);
}

/* A completed answer cached in Redis ("G", format above) decides the claim when the purge epoch trusts it: true,
 * with res filled (a replay, or a mismatch for another fingerprint). One it may not trust (read before a purge
 * this process heard of, or while it cannot know: its listener is not current), or of the older forms "C"/"E"
 * (no epoch), is marked seen_stale: Postgres decides, and a replay's refill replaces it. */
static bool claim_from_redis(struct claim_op *c, const redisReply *r, struct store_claim_res *res)
{
    const uint8_t *v = (const uint8_t *)r->str;
    if (v[0] == 'C' || v[0] == 'E' || v[0] == 'G')
        c->seen_stale = true;
    if (v[0] != 'G' || r->len < RVAL_HEAD || !epoch_trusts(c->h.s, rd_be64(v + 41)))
        return false;
    c->seen_stale = false;
    memset(res, 0, sizeof *res);
    res->from_redis = true;
    /* what is left of the record, less a margin for the clocks of the hosts that wrote and read it */
    uint64_t exp = rd_be64(v + 33), now = store_clock_ms(); /* both on Postgres's clock (SPEC 8, one clock) */
    res->expires_in_ms = exp > now + REDIS_EXPIRY_MARGIN_MS ? exp - now - REDIS_EXPIRY_MARGIN_MS : 0;
    if (memcmp(v + 1, c->fp, 32) != 0) {
        cm_resp_init(&res->resp, 0);
        res->verdict = STORE_MISMATCH;
        return true;
    }
    if (cm_resp_decode(v + RVAL_HEAD, r->len - RVAL_HEAD, &res->resp)) {
        res->verdict = STORE_REPLAY;
        return true;
    }
    cm_resp_free(&res->resp);
    return false;
}

static void claim_redis_cb(void *arg, const struct redisReply *reply)
{
    struct claim_op *c = arg;
    const redisReply *r = reply;
    c->rd_pending = false;
    struct store_claim_res res;
    if (r && r->type == REDIS_REPLY_NIL) {
        c->marker_ours = true; /* the marker is ours */
    } else if (r && r->type == REDIS_REPLY_STRING && r->len >= 33) {
        /* Postgres' own verdict, when it has one, stands: a Redis answer takes only the place of none yet, of a
         * failure, or of the same replay (Redis never overrides Postgres). */
        bool pg_decided = c->held && c->held_res.verdict != STORE_UNAVAILABLE && c->held_res.verdict != STORE_REPLAY;
        if (pg_decided) {
            if (r->str[0] == 'C' || r->str[0] == 'E' || r->str[0] == 'G')
                c->seen_stale = true; /* a replay's refill may replace it (if older) */
        } else if (!c->answered && claim_from_redis(c, r, &res)) {
            if (c->held) { /* Postgres failed: the answer takes its place */
                cm_resp_free(&c->held_res.resp);
                c->held = false;
            }
            claim_answer(c, &res);
            claim_done(c);
            return;
        }
        if (r->str[0] == 'F' && r->len == MARKER_LEN) {
            /* Somebody's in-flight marker. It never answers 409 by itself:
             * one left by a SET NX that timed out, a claim that failed or a
             * completion that could not be written would refuse a free key
             * for up to a lease. Postgres decides; a refill compares to it. */
            memcpy(c->seen, r->str, MARKER_LEN);
            c->seen_marker = true;
        }
    }
    /* Error, timeout, a marker, anything unexpected: Postgres decides. */
    if (c->held) {
        c->held = false;
        claim_answer_pg(c, &c->held_res, c->held_blob, c->held_blob_len);
    }
    claim_done(c);
}

void store_claim(struct store *s, const struct store_claim_req *req, store_claim_cb cb, void *arg)
{
    struct claim_op *c = cm_calloc(1, sizeof *c);
    op_link(s, &c->h, OP_CLAIM);
    c->route = cm_strdup(req->id.route);
    c->key = cm_strndup(req->id.key, req->id.key_len);
    c->key_len = req->id.key_len;
    c->route_index = req->route_index;
    memcpy(c->scope, req->id.scope, 32);
    memcpy(c->fp, req->fp, 32);
    c->lease_ms = req->lease_ms ? req->lease_ms : 1;
    c->retention_ms = req->retention_ms;
    c->takeover = req->takeover_unknown;
    c->token = cm_random_token();
    c->epoch = epoch_known(s);
    c->cb = cb;
    c->arg = arg;
    redis_key(c->route, c->scope, c->key, c->key_len, c->rkey);
    if (s->rd) {
        /* SET NX GET: places our marker, or returns what is there (Redis >= 7). */
        uint8_t marker[MARKER_LEN];
        make_marker(marker, c->fp, c->token);
        char px[24];
        snprintf(px, sizeof px, "%llu", (unsigned long long)c->lease_ms);
        const char *argv[7] = {"SET", c->rkey, (const char *)marker, "NX", "PX", px, "GET"};
        size_t lens[7] = {3, RKEY_LEN, sizeof marker, 2, 2, strlen(px), 3};
        c->rd_pending = store_rd_command(s->rd, claim_redis_cb, c, 7, argv, lens);
    }
    c->pg_pending = true;
    claim_pg(c);
}

/* ---- claims in doubt */

static void doubt_free(struct doubt *d)
{
    free(d->route);
    free(d->key);
    free(d);
}

static void doubt_schedule(struct store *s, uint64_t ms)
{
    if (!s->doubt_head || s->doubt_busy)
        return;
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    evtimer_add(s->doubt_timer, &tv);
}

static void doubt_push(struct store *s, struct doubt *d)
{
    d->next = NULL;
    if (s->doubt_tail)
        s->doubt_tail->next = d;
    else
        s->doubt_head = d;
    s->doubt_tail = d;
}

static struct doubt *doubt_pop(struct store *s)
{
    struct doubt *d = s->doubt_head;
    if (d) {
        s->doubt_head = d->next;
        if (!s->doubt_head)
            s->doubt_tail = NULL;
        d->next = NULL;
    }
    return d;
}

/* Remembers (id, token) for release; pids: server processes that may still
 * commit the claim (none: nothing can commit it any more, e.g. a release
 * that could not be written). At DOUBT_MAX the oldest entry not being worked
 * on is dropped: that claim stays in flight until its lease lapses, then
 * reads as an unknown outcome (idemgate_stuck_processing counts it after 5
 * minutes); the log line says so. unused: a claim Postgres made after Redis
 * had answered its request (claim_pg_settled), logged as claim_unused. */
static void doubt_remember(struct store *s, const char *route, const uint8_t scope[32], const char *key, size_t key_len,
                           uint64_t token, const int *pids, int npids, uint64_t sent_ms, bool unused)
{
    if (s->ndoubt >= DOUBT_MAX) {
        struct doubt *old = s->doubt_head;
        if (s->doubt_busy) { /* the head's query is running: drop the one after it */
            old = s->doubt_head->next;
            s->doubt_head->next = old->next;
            if (s->doubt_tail == old)
                s->doubt_tail = s->doubt_head;
        } else {
            (void)doubt_pop(s);
        }
        cm_log(CM_ERROR, "claim_in_doubt_dropped", "route=%s limit=%d effect=stays_in_flight_then_unknown", old->route,
               DOUBT_MAX);
        doubt_free(old);
        s->ndoubt--;
        cm_metric_claims_in_doubt(-1);
    }
    struct doubt *d = cm_calloc(1, sizeof *d);
    d->route = cm_strdup(route);
    d->key = cm_strndup(key, key_len);
    d->key_len = key_len;
    memcpy(d->scope, scope, 32);
    d->token = token;
    for (int i = 0; i < npids && i < CLAIM_ATTEMPTS; i++)
        d->pids[d->npids++] = pids[i];
    d->sent_ms = sent_ms;
    doubt_push(s, d);
    s->ndoubt++;
    cm_metric_claims_in_doubt(1);
    if (unused) /* Redis answered the request before Postgres gave us the key */
        cm_log(CM_INFO, "claim_unused", "route=%s processes=%d in_doubt=%zu", route, d->npids, s->ndoubt);
    else
        cm_log(CM_WARN, "claim_in_doubt", "route=%s processes=%d in_doubt=%zu", route, d->npids, s->ndoubt);
    doubt_schedule(s, s->doubt_backoff_ms);
}

/* Postgres failed: try again later, with backoff. */
static void doubt_retry(struct store *s)
{
    s->doubt_busy = false;
    uint64_t ms = s->doubt_backoff_ms;
    s->doubt_backoff_ms = ms * 2 > DOUBT_BACKOFF_MAX_MS ? DOUBT_BACKOFF_MAX_MS : ms * 2;
    doubt_schedule(s, ms);
}

static void doubt_released_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store *s = arg;
    if (st != STORE_PG_OK) {
        if (st == STORE_PG_SQL_ERROR)
            log_pg_failure("release_in_doubt", st, msg);
        doubt_retry(s);
        return;
    }
    struct doubt *d = doubt_pop(s);
    s->ndoubt--;
    cm_metric_claims_in_doubt(-1);
    cm_log(CM_INFO, "claim_in_doubt_released", "route=%s rows=%ld tries=%d in_doubt=%zu", d->route, cmd_rows(pr),
           d->tries, s->ndoubt);
    doubt_free(d);
    s->doubt_busy = false;
    s->doubt_backoff_ms = DOUBT_BACKOFF_MIN_MS;
    doubt_schedule(s, 0);
}

static void doubt_release(struct store *s, struct doubt *d)
{
    uint8_t tok[8];
    be64(tok, d->token);
    struct store_pg_param p[4] = {
        {d->route, strlen(d->route), true},
        {d->scope, 32, true},
        {d->key, d->key_len, true},
        {tok, 8, true},
    };
    store_pg_query(s->pg, S_DOUBT_RELEASE, p, 4, 1, doubt_released_cb, s);
}

static void doubt_alive_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store *s = arg;
    struct doubt *d = s->doubt_head;
    if (st != STORE_PG_OK) {
        if (st == STORE_PG_SQL_ERROR)
            log_pg_failure("doubt_alive", st, msg);
        doubt_retry(s);
        return;
    }
    if (PQntuples(pr) > 0) {
        /* A process that may still commit it lives (paused, or slow): it
         * was asked to end. The others go first meanwhile. */
        if (d->tries == 1)
            cm_log(CM_WARN, "claim_in_doubt_waiting", "route=%s processes=%d", d->route, PQntuples(pr));
        if (s->doubt_head != s->doubt_tail)
            doubt_push(s, doubt_pop(s));
        doubt_retry(s);
        return;
    }
    doubt_release(s, d);
}

static void doubt_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct store *s = arg;
    (void)fd;
    (void)what;
    struct doubt *d = s->doubt_head;
    if (!d || s->doubt_busy)
        return;
    s->doubt_busy = true;
    d->tries++;
    if (d->npids == 0) {
        doubt_release(s, d);
        return;
    }
    char arr[CLAIM_ATTEMPTS * 12 + 4];
    size_t off = 0;
    arr[off++] = '{';
    for (int i = 0; i < d->npids; i++)
        off += (size_t)snprintf(arr + off, sizeof arr - off, "%s%d", i ? "," : "", d->pids[i]);
    snprintf(arr + off, sizeof arr - off, "}");
    uint8_t since[8];
    uint64_t now = cm_now_ms();
    be64(since, now > d->sent_ms ? now - d->sent_ms : 0);
    struct store_pg_param p[2] = {{arr, strlen(arr), false}, {since, 8, true}};
    store_pg_query(s->pg, S_DOUBT_ALIVE, p, 2, 1, doubt_alive_cb, s);
}

/* ---- owner operations */

static struct owner_op *owner_new(struct store *s, enum op_kind kind, const struct store_id *id, uint64_t token,
                                  store_done_cb cb, void *arg)
{
    struct owner_op *w = cm_calloc(1, sizeof *w);
    op_link(s, &w->h, kind);
    w->route = cm_strdup(id->route);
    w->key = cm_strndup(id->key, id->key_len);
    w->key_len = id->key_len;
    memcpy(w->scope, id->scope, 32);
    w->token = token;
    w->cb = cb;
    w->arg = arg;
    redis_key(w->route, w->scope, w->key, w->key_len, w->rkey);
    return w;
}

static void owner_finish(struct owner_op *w, bool ok, long rows)
{
    op_unlink(&w->h);
    if (w->cb)
        w->cb(w->arg, ok, rows);
    op_free(&w->h);
}

static void owner_send(struct owner_op *w, enum stmt_id stmt, store_pg_cb cb);

static void settle_timer_cb(evutil_socket_t fd, short what, void *arg);

static const char *owner_op_name(const struct owner_op *w)
{
    switch (w->h.kind) {
    case OP_COMPLETE:
        return "complete";
    case OP_RENEW:
        return "renew";
    case OP_RELEASE:
        return "release";
    case OP_MARK_UNKNOWN:
        return "mark_unknown";
    case OP_PROBE_TAKE:
        return "probe_take";
    default:
        return "?";
    }
}

/* A settle operation (complete, release, mark unknown) retries what another
 * try may fix, with backoff (50 ms doubling to 1 s) until retry_for_ms from
 * its start; when Postgres answers again (store_pg_on_up) the waiting ones go
 * at once, before the lease they keep renewing could lapse. */
static void settle_init(struct owner_op *w, uint64_t retry_for_ms)
{
    w->backoff_ms = COMPLETE_BACKOFF_MIN_MS;
    w->deadline_ms = cm_now_ms() + retry_for_ms;
    w->timer = evtimer_new(w->h.s->base, settle_timer_cb, w);
    if (!w->timer)
        abort();
}

/* Returns true when another try was scheduled. */
static bool settle_retry_later(struct owner_op *w, enum store_pg_status st)
{
    uint64_t now = cm_now_ms();
    if (st == STORE_PG_SQL_ERROR || now + w->backoff_ms >= w->deadline_ms || w->h.s->settle_stop)
        return false;
    cm_log(CM_DEBUG, "store_settle_retry", "op=%s attempt=%d status=%s backoff_ms=%llu", owner_op_name(w), w->attempts,
           store_pg_status_name(st), (unsigned long long)w->backoff_ms);
    struct timeval tv = {(time_t)(w->backoff_ms / 1000), (suseconds_t)((w->backoff_ms % 1000) * 1000)};
    w->backoff_ms = w->backoff_ms * 2 > COMPLETE_BACKOFF_MAX_MS ? COMPLETE_BACKOFF_MAX_MS : w->backoff_ms * 2;
    evtimer_add(w->timer, &tv);
    return true;
}

/* Postgres answers again: every settle operation waiting for its next try
 * is sent now, ahead of any claim that arrives after this (a retry on an
 * on_unknown: retry route must not take over a lease that lapsed while
 * Postgres was away from an owner that holds the answer). */
static void settle_send_now(struct owner_op *w)
{
    settle_timer_cb(-1, 0, w);
}

/* Runs fn on every settle operation waiting for its next try (its timer stopped first). */
static void settle_each_waiting(struct store *s, void (*fn)(struct owner_op *))
{
    struct op *next;
    for (struct op *o = s->ops; o; o = next) {
        next = o->next;
        if (o->kind != OP_COMPLETE && o->kind != OP_RELEASE && o->kind != OP_MARK_UNKNOWN)
            continue;
        struct owner_op *w = (struct owner_op *)o;
        if (w->timer && evtimer_pending(w->timer, NULL)) {
            evtimer_del(w->timer);
            fn(w);
        }
    }
}

static void settle_kick(struct store *s)
{
    settle_each_waiting(s, settle_send_now);
}

static void settle_give_up(struct owner_op *w)
{
    cm_log(CM_ERROR, "store_error", "op=%s attempts=%d status=given_up_at_shutdown", owner_op_name(w), w->attempts);
    owner_finish(w, false, 0);
}

void store_settle_stop(struct store *s)
{
    s->settle_stop = true;
    settle_each_waiting(s, settle_give_up);
}

static void complete_pg_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct owner_op *w = arg;
    if (st == STORE_PG_OK) {
        long rows = PQntuples(pr);
        if (w->attempts > 1)
            cm_log(CM_INFO, "store_complete_retried", "attempts=%d rows=%ld", w->attempts, rows);
        /* Nothing is written to Redis here: most keys are never retried, and a retry that finds the in-flight
         * marker (or nothing) asks Postgres, whose replay puts the answer into Redis over that marker (claim_pg_cb).
         * The marker this claim placed stays until its lease runs out; it never answers anything by itself. */
        owner_finish(w, true, rows);
        return;
    }
    if (settle_retry_later(w, st))
        return;
    log_pg_failure("complete", st, msg);
    owner_finish(w, false, 0);
}

static void complete_send(struct owner_op *w)
{
    struct store *s = w->h.s;
    uint8_t tok[8], status[4], ret[8];
    be64(tok, w->token);
    be32(status, (uint32_t)w->status);
    be64(ret, w->arg_ms);
    struct store_pg_param p[7] = {
        {w->route, strlen(w->route), true},
        {w->scope, 32, true},
        {w->key, w->key_len, true},
        {tok, 8, true},
        {status, 4, true},
        {w->blob, w->blob_len, true},
        {ret, 8, true},
    };
    w->attempts++;
    store_pg_query(s->pg, S_COMPLETE, p, 7, 1, complete_pg_cb, w);
}

static void owner_pg_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg);

static void settle_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct owner_op *w = arg;
    (void)fd;
    (void)what;
    if (w->h.kind == OP_RELEASE || w->h.kind == OP_MARK_UNKNOWN) {
        w->attempts++;
        owner_send(w, w->h.kind == OP_RELEASE ? S_RELEASE : S_MARK_UNKNOWN, owner_pg_cb);
        return;
    }
    if (w->encode_failed) {
        cm_log(CM_ERROR, "store_error", "op=complete status=encode_failed");
        owner_finish(w, false, 0);
        return;
    }
    complete_send(w);
}

void store_complete(struct store *s, const struct store_id *id, uint64_t token, const struct cm_resp *resp,
                    uint64_t retention_ms, uint64_t retry_for_ms, store_done_cb cb, void *arg)
{
    struct owner_op *w = owner_new(s, OP_COMPLETE, id, token, cb, arg);
    w->arg_ms = retention_ms;
    w->status = resp->status;
    settle_init(w, retry_for_ms);
    struct cm_buf b;
    cm_buf_init(&b, RESP_BLOB_MAX);
    if (!cm_resp_encode(resp, &b)) {
        cm_buf_free(&b);
        w->encode_failed = true;
        static const struct timeval zero = {0, 0};
        evtimer_add(w->timer, &zero);
        return;
    }
    w->blob = cm_buf_take(&b, &w->blob_len);
    cm_buf_free(&b);
    complete_send(w);
}

static void released_cb(void *arg, const struct redisReply *reply)
{
    struct owner_op *w = arg;
    owner_finish(w, true, w->rows);
}

static void owner_pg_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct owner_op *w = arg;
    struct store *s = w->h.s;
    if (w->h.kind == OP_RENEW && st == STORE_PG_TRANSIENT && ++w->attempts < OWNER_ATTEMPTS) {
        /* rolled back (a deadlock, or another statement of its batch failed): nothing was done */
        owner_send(w, S_RENEW, owner_pg_cb);
        return;
    }
    if (st != STORE_PG_OK && w->h.kind != OP_RENEW && settle_retry_later(w, st))
        return;
    if (st != STORE_PG_OK) {
        log_pg_failure(owner_op_name(w), st, msg);
        if (w->h.kind == OP_RELEASE && st != STORE_PG_SQL_ERROR) {
            /* Nothing was executed under this claim (or the upstream asked
             * for a release): the release is not given up, it waits in the
             * list of claims in doubt, so the key never reads as an unknown
             * outcome while this process runs. */
            doubt_remember(s, w->route, w->scope, w->key, w->key_len, w->token, NULL, 0, 0, false);
        }
        owner_finish(w, false, 0);
        return;
    }
    long rows = cmd_rows(pr);
    if (w->h.kind == OP_RELEASE && rows > 0) {
        /* The answer waits for the marker's removal (bounded by redis_timeout): until it lands, a retry on
         * another loop or instance would find the in-flight marker and get 409 for a key that is free. */
        const char *argv[2] = {"DEL", w->rkey};
        size_t lens[2] = {3, strlen(w->rkey)};
        w->rows = rows;
        if (s->rd && store_rd_command(s->rd, released_cb, w, 2, argv, lens))
            return;
    }
    owner_finish(w, true, rows);
}

static void owner_send(struct owner_op *w, enum stmt_id stmt, store_pg_cb cb)
{
    struct store *s = w->h.s;
    uint8_t tok[8], ms[8], ms2[8];
    be64(tok, w->token);
    be64(ms, w->arg_ms);
    be64(ms2, w->arg2_ms);
    struct store_pg_param p[6] = {
        {w->route, strlen(w->route), true},
        {w->scope, 32, true},
        {w->key, w->key_len, true},
        {tok, 8, true},
        {ms, 8, true},
        {ms2, 8, true},
    };
    store_pg_query(s->pg, stmt, p, stmts[stmt].nparams, 1, cb, w);
}

void store_renew(struct store *s, const struct store_id *id, uint64_t token, uint64_t lease_ms, store_done_cb cb,
                 void *arg)
{
    struct owner_op *w = owner_new(s, OP_RENEW, id, token, cb, arg);
    w->arg_ms = lease_ms;
    /* Keep the marker (what the completion's cache write compares against)
     * alive as long as the lease. */
    redis_pexpire(s, w->rkey, lease_ms);
    owner_send(w, S_RENEW, owner_pg_cb);
}

void store_release(struct store *s, const struct store_id *id, uint64_t token, uint64_t retry_for_ms, store_done_cb cb,
                   void *arg)
{
    struct owner_op *w = owner_new(s, OP_RELEASE, id, token, cb, arg);
    settle_init(w, retry_for_ms);
    w->attempts = 1;
    owner_send(w, S_RELEASE, owner_pg_cb);
}

void store_mark_unknown(struct store *s, const struct store_id *id, uint64_t token, int64_t lease_ms,
                        uint64_t retry_for_ms, store_done_cb cb, void *arg)
{
    struct owner_op *w = owner_new(s, OP_MARK_UNKNOWN, id, token, cb, arg);
    w->arg_ms = (uint64_t)lease_ms; /* sent as an int8: a negative one stays negative */
    settle_init(w, retry_for_ms);
    w->attempts = 1;
    redis_pexpire(s, w->rkey, lease_ms > 0 ? (uint64_t)lease_ms : 0);
    owner_send(w, S_MARK_UNKNOWN, owner_pg_cb);
}

/* ---- unknown outcomes resolved by probing (gateway/probe.c) */

static void probe_take_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct owner_op *w = arg;
    if (st != STORE_PG_OK) {
        if (st != STORE_PG_UNAVAILABLE && st != STORE_PG_OVERLOAD)
            log_pg_failure(owner_op_name(w), st, msg);
        owner_finish(w, false, 0);
        return;
    }
    owner_finish(w, true, cmd_rows(pr));
}

void store_probe_take(struct store *s, const struct store_id *id, uint64_t token, uint64_t hold_ms, uint64_t wait_ms,
                      store_done_cb cb, void *arg)
{
    struct owner_op *w = owner_new(s, OP_PROBE_TAKE, id, token, cb, arg);
    w->arg_ms = hold_ms ? hold_ms : 1;
    w->arg2_ms = wait_ms;
    owner_send(w, S_PROBE_TAKE, probe_take_cb);
}

struct probe_list_op {
    struct op h;
    store_unknown_cb cb;
    void *arg;
};

static void probe_list_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct probe_list_op *o = arg;
    op_unlink(&o->h);
    if (st != STORE_PG_OK) {
        if (st != STORE_PG_UNAVAILABLE && st != STORE_PG_OVERLOAD)
            log_pg_failure("probe_list", st, msg);
        o->cb(o->arg, false, NULL, 0);
        op_free(&o->h);
        return;
    }
    int n = PQntuples(pr);
    struct store_unknown_rec *v = n > 0 ? cm_calloc((size_t)n, sizeof *v) : NULL;
    size_t got = 0;
    for (int i = 0; i < n && PQnfields(pr) >= 3; i++) {
        size_t klen = (size_t)PQgetlength(pr, i, 2);
        if (PQgetlength(pr, i, 1) != 32 || klen == 0 || klen > 255)
            continue;
        struct store_unknown_rec *r = &v[got++];
        r->id.route = cm_strndup(PQgetvalue(pr, i, 0), (size_t)PQgetlength(pr, i, 0));
        memcpy(r->id.scope, PQgetvalue(pr, i, 1), 32);
        r->id.key = cm_strndup(PQgetvalue(pr, i, 2), klen);
        r->id.key_len = klen;
    }
    o->cb(o->arg, true, v, got);
    for (size_t i = 0; i < got; i++) {
        free((char *)v[i].id.route);
        free((char *)v[i].id.key);
    }
    free(v);
    op_free(&o->h);
}

void store_probe_list(struct store *s, const char *routes_nl, size_t max, store_unknown_cb cb, void *arg)
{
    struct probe_list_op *o = cm_calloc(1, sizeof *o);
    op_link(s, &o->h, OP_PROBE_LIST);
    o->cb = cb;
    o->arg = arg;
    uint8_t lim[8];
    be64(lim, (uint64_t)max);
    struct store_pg_param p[2] = {
        {routes_nl, strlen(routes_nl), true},
        {lim, 8, true},
    };
    store_pg_query(s->pg, S_PROBE_LIST, p, 2, 1, probe_list_cb, o);
}

/* ---- end of probe */

/* ---- admin */

static void json_str(struct cm_buf *b, const char *p, size_t n)
{
    bool ok = cm_buf_append(b, "\"", 1);
    for (size_t i = 0; i < n && ok; i++) {
        unsigned char ch = (unsigned char)p[i];
        if (ch == '"' || ch == '\\') {
            char e[2] = {'\\', (char)ch};
            ok = cm_buf_append(b, e, 2);
        } else if (ch < 0x20 || ch == 0x7f) {
            ok = cm_buf_appendf(b, "\\u%04x", ch);
        } else {
            ok = cm_buf_append(b, &p[i], 1);
        }
    }
    if (ok)
        ok = cm_buf_append(b, "\"", 1);
    (void)ok; /* a capped-out body is reported by the caller (truncation check) */
}

static char *problem_json(int status, const char *name, const char *title, const char *detail)
{
    struct cm_buf b;
    cm_buf_init(&b, 4096);
    bool ok = cm_buf_appendf(&b, "{\"type\":\"" PROBLEM_PREFIX "%s\",\"title\":", name);
    json_str(&b, title, strlen(title));
    ok = ok && cm_buf_appendf(&b, ",\"status\":%d,\"detail\":", status);
    json_str(&b, detail, strlen(detail));
    ok = ok && cm_buf_append(&b, "}", 1);
    (void)ok;
    size_t n;
    char *s = cm_buf_take(&b, &n);
    cm_buf_free(&b);
    return s ? s : cm_strdup("{}");
}

static void admin_answer(struct admin_op *a, int status, char *json)
{
    op_unlink(&a->h);
    a->cb(a->arg, status, json);
    op_free(&a->h);
}

static void admin_bumped_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct admin_op *a = arg;
    char *json = a->json;
    a->json = NULL;
    if (st != STORE_PG_OK || PQntuples(pr) != 1) {
        log_pg_failure("purge_epoch", st, st == STORE_PG_OK ? "no epoch row" : msg);
        free(json);
        admin_answer(a, 503,
                     problem_json(503, "store-unavailable", "Store unavailable",
                                  "the records were deleted, but the purge epoch could not be moved on: repeat the "
                                  "request (until it is, an answer Redis holds may still be replayed)"));
        return;
    }
    store_epoch_heard(a->h.s->epoch, strtoull(PQgetvalue(pr, 0, 0), NULL, 10));
    admin_answer(a, a->status, json);
}

/* The answer; a purge or release that succeeded first moves the purge epoch on (store.h), in a transaction of its
 * own after the deletion committed (a claim that read the record before then knew an older epoch), and this
 * process hears of it before answering. */
static void admin_finish(struct admin_op *a, int status, char *json)
{
    if (a->bump && status == 200) {
        a->bump = false;
        a->status = status;
        a->json = json;
        struct store_pg_param p[2] = {{a->route, strlen(a->route), true}, {a->key, a->key_len, true}};
        store_pg_query(a->h.s->pg, S_EPOCH_BUMP, p, 2, 0, admin_bumped_cb, a);
        return;
    }
    admin_answer(a, status, json);
}

static void admin_deleted_cb(void *arg, const struct redisReply *reply)
{
    struct admin_op *a = arg;
    char *json = a->json;
    a->json = NULL;
    admin_finish(a, a->status, json);
}

/* Removes the Redis markers of the scopes in column col (only rows marked 'd' when only_d), then answers
 * status/json: the answer waits for the DEL (bounded by redis_timeout), so that a retry sent right after it
 * does not find an in-flight marker of a key that is gone. */
static void admin_del_then_finish(struct admin_op *a, const PGresult *pr, int col, bool only_d, int status, char *json)
{
    struct store *s = a->h.s;
    int n = PQntuples(pr), k = 0;
    const char **argv = cm_malloc(((size_t)n + 1) * sizeof *argv);
    size_t *lens = cm_malloc(((size_t)n + 1) * sizeof *lens);
    char(*rks)[RKEY_LEN + 1] = cm_malloc(((size_t)n + 1) * sizeof *rks);
    argv[0] = "DEL";
    lens[0] = 3;
    for (int i = 0; i < n; i++) {
        if (only_d && PQgetvalue(pr, i, 0)[0] != 'd')
            continue;
        if (PQgetisnull(pr, i, col) || PQgetlength(pr, i, col) != 32)
            continue;
        redis_key(a->route, (const uint8_t *)PQgetvalue(pr, i, col), a->key, a->key_len, rks[k]);
        argv[k + 1] = rks[k];
        lens[k + 1] = strlen(rks[k]);
        k++;
    }
    bool sent = k > 0 && s->rd && store_rd_command(s->rd, admin_deleted_cb, a, k + 1, argv, lens);
    free(argv);
    free(lens);
    free(rks);
    if (sent) {
        a->status = status;
        a->json = json;
        return;
    }
    admin_finish(a, status, json);
}

static char *admin_list_json(const PGresult *pr)
{
    struct cm_buf b;
    cm_buf_init(&b, ADMIN_JSON_MAX);
    bool ok = cm_buf_append(&b, "[", 1);
    static const char *const names[] = {"route", "key",        "scope",      "state",
                                        "token", "created_at", "expires_at", "lease_until"};
    for (int i = 0; i < PQntuples(pr) && ok; i++) {
        ok = cm_buf_append(&b, i ? ",{" : "{", i ? 2 : 1);
        for (int col = 0; col < 8 && ok; col++) {
            ok = cm_buf_appendf(&b, "%s\"%s\":", col ? "," : "", names[col]);
            json_str(&b, PQgetvalue(pr, i, col), (size_t)PQgetlength(pr, i, col));
        }
        if (ok && !PQgetisnull(pr, i, 8)) {
            char *end = NULL;
            long st = strtol(PQgetvalue(pr, i, 8), &end, 10);
            ok = cm_buf_appendf(&b, ",\"status\":%ld", st);
        }
        if (ok && !PQgetisnull(pr, i, 9)) {
            ok = cm_buf_append(&b, ",\"completed_at\":", 16);
            json_str(&b, PQgetvalue(pr, i, 9), (size_t)PQgetlength(pr, i, 9));
        }
        ok = ok && cm_buf_append(&b, "}", 1);
    }
    ok = ok && cm_buf_append(&b, "]", 1);
    if (!ok) {
        cm_buf_free(&b);
        return NULL;
    }
    size_t n;
    char *s = cm_buf_take(&b, &n);
    cm_buf_free(&b);
    return s;
}

static void admin_pg_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct admin_op *a = arg;
    struct store *s = a->h.s;
    if (st != STORE_PG_OK) {
        log_pg_failure("admin", st, msg);
        admin_finish(a, 503, problem_json(503, "store-unavailable", "Store unavailable", pg_err_text(st)));
        return;
    }
    switch (a->stmt) {
    case S_ADMIN_LIST: {
        char *json = admin_list_json(pr);
        if (!json) {
            admin_finish(a, 500, problem_json(500, "internal-error", "Internal error", "listing too large"));
            return;
        }
        admin_finish(a, 200, json);
        return;
    }
    case S_ADMIN_PURGE: {
        admin_del_then_finish(a, pr, 0, false, 200, cm_asprintf("{\"deleted\":%d}", PQntuples(pr)));
        return;
    }
    case S_ADMIN_RELEASE: {
        int released = 0, total = 0;
        for (int i = 0; i < PQntuples(pr); i++) {
            if (PQgetvalue(pr, i, 0)[0] == 'd')
                released++;
            else if (PQgetvalue(pr, i, 0)[0] == 't')
                total++; /* 'n': the cache notification's row */
        }
        const PGresult *left = store_pg_cb_then(s->pg); /* Citus: what the delete left */
        if (left)
            total = released + PQntuples(left);
        if (released > 0)
            admin_del_then_finish(a, pr, 1, true, 200, cm_asprintf("{\"released\":%d}", released));
        else if (total == 0)
            admin_finish(a, 404, problem_json(404, "not-found", "Not found", "no record with this route and key"));
        else
            admin_finish(a, 409,
                         problem_json(409, "not-releasable", "Not releasable",
                                      "no record with this route and key is an unknown outcome or a lapsed lease"));
        return;
    }
    default:
        admin_finish(a, 500, problem_json(500, "internal-error", "Internal error", "unexpected admin statement"));
        return;
    }
}

static void admin_run(struct store *s, enum stmt_id stmt, int result_format, const char *route, const char *key,
                      size_t key_len, store_admin_cb cb, void *arg)
{
    struct admin_op *a = cm_calloc(1, sizeof *a);
    op_link(s, &a->h, OP_ADMIN);
    a->stmt = stmt;
    a->bump = stmt != S_ADMIN_LIST;
    a->route = cm_strdup(route);
    a->key = cm_strndup(key, key_len);
    a->key_len = key_len;
    a->cb = cb;
    a->arg = arg;
    struct store_pg_param p[2] = {{a->route, strlen(a->route), true}, {a->key, key_len, true}};
    store_pg_query(s->pg, stmt, p, 2, result_format, admin_pg_cb, a);
}

void store_admin_list(struct store *s, const char *route, const char *key, size_t key_len, store_admin_cb cb, void *arg)
{
    admin_run(s, S_ADMIN_LIST, 0, route, key, key_len, cb, arg);
}

void store_admin_purge(struct store *s, const char *route, const char *key, size_t key_len, store_admin_cb cb,
                       void *arg)
{
    admin_run(s, S_ADMIN_PURGE, 1, route, key, key_len, cb, arg);
}

void store_admin_release(struct store *s, const char *route, const char *key, size_t key_len, store_admin_cb cb,
                         void *arg)
{
    admin_run(s, S_ADMIN_RELEASE, 1, route, key, key_len, cb, arg);
}

/* ---- background: expired records and stuck gauge */

static void clean_schedule(struct store *s, uint64_t ms)
{
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    evtimer_add(s->clean_timer, &tv);
}

static void stuck_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store *s = arg;
    if (st == STORE_PG_OK) {
        /* every route this process has a slot for (the start-time configuration and every reload's), by name: a
         * route a reload added is counted too */
        size_t nslots = cm_metrics_routes_n();
        for (size_t i = 0; i < nslots; i++) {
            uint64_t n = 0;
            const char *name = cm_metrics_route_name(i);
            for (int r = 0; r < PQntuples(pr); r++) {
                if ((size_t)PQgetlength(pr, r, 0) == strlen(name) &&
                    memcmp(PQgetvalue(pr, r, 0), name, strlen(name)) == 0) {
                    int64_t v = store_pg_get_i64(pr, r, 1);
                    n = v > 0 ? (uint64_t)v : 0;
                }
            }
            cm_metric_stuck_processing_set(i, n);
        }
    } else if (st == STORE_PG_SQL_ERROR) {
        log_pg_failure("stuck", st, msg);
    }
    s->cleaning = false;
    clean_schedule(s, CLEAN_EVERY_MS);
}

static void clean_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store *s = arg;
    if (st == STORE_PG_OK) {
        long n = cmd_rows(pr);
        s->cleaned += (uint64_t)n;
        if (n > 0)
            cm_log(CM_DEBUG, "store_cleaned", "rows=%ld", n);
        if (n >= CLEAN_BATCH && ++s->clean_batches < CLEAN_MAX_BATCHES) {
            store_pg_query(s->pg, S_CLEAN, NULL, 0, 1, clean_cb, s);
            return;
        }
    } else if (st == STORE_PG_SQL_ERROR) {
        log_pg_failure("clean", st, msg);
    }
    /* Citus runs the count on every shard: there it is refreshed every STUCK_EVERY_CITUS passes. */
    if (s->conf->distributed == CONF_DIST_CITUS && s->clean_passes++ % STUCK_EVERY_CITUS != 0) {
        s->cleaning = false;
        clean_schedule(s, CLEAN_EVERY_MS);
        return;
    }
    store_pg_query(s->pg, S_STUCK, NULL, 0, 1, stuck_cb, s);
}

static void clean_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct store *s = arg;
    (void)fd;
    (void)what;
    if (s->cleaning)
        return;
    s->cleaning = true;
    s->clean_batches = 0;
    store_pg_query(s->pg, S_CLEAN, NULL, 0, 1, clean_cb, s);
}

/* ---- health probe: Postgres answered within HEALTHY_WITHIN_MS */

static void probe_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store *s = arg;
    (void)st; /* the pool records answers and failures itself */
    (void)pr;
    (void)msg;
    s->probing = false;
}

/* ---- Postgres's clock, as this process reads it (SPEC 8, one clock) */

/* Postgres's wall clock less this process's monotonic one (ms), from the latest reading of any loop. */
static _Atomic int64_t pg_clock_offset;
static atomic_bool pg_clock_known;

uint64_t store_clock_ms(void)
{
    if (!atomic_load_explicit(&pg_clock_known, memory_order_acquire))
        return cm_wall_ms();
    return (uint64_t)((int64_t)cm_now_ms() + atomic_load_explicit(&pg_clock_offset, memory_order_relaxed));
}

static void clock_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store *s = arg;
    (void)msg;
    s->clocking = false;
    uint64_t now = cm_now_ms();
    if (st != STORE_PG_OK || PQntuples(pr) != 1 || now - s->clock_sent_ms > CLOCK_MAX_RTT_MS)
        return; /* read again at the next probe tick */
    int64_t pg_ms = strtoll(PQgetvalue(pr, 0, 0), NULL, 10);
    if (pg_ms <= 0)
        return;
    /* the server read its clock somewhere in the round trip: its middle is off by at most half of it */
    int64_t mid = (int64_t)(s->clock_sent_ms + (now - s->clock_sent_ms) / 2);
    atomic_store_explicit(&pg_clock_offset, pg_ms - mid, memory_order_relaxed);
    atomic_store_explicit(&pg_clock_known, true, memory_order_release);
    s->clock_read_ms = now;
}

/* Every PROBE_EVERY_MS: a cheap SELECT 1 when nothing else showed that the
 * server answers (a busy pool proves it with every result); and Postgres's
 * clock every CLOCK_EVERY_MS. */
static void probe_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct store *s = arg;
    (void)fd;
    (void)what;
    if (!s->clocking && (s->clock_read_ms == 0 || cm_now_ms() - s->clock_read_ms >= CLOCK_EVERY_MS)) {
        s->clocking = true;
        s->clock_sent_ms = cm_now_ms();
        store_pg_query(s->pg, S_CLOCK, NULL, 0, 0, clock_cb, s);
    }
    if (s->probing || cm_now_ms() - store_pg_last_ok_ms(s->pg) < PROBE_IDLE_MS)
        return;
    s->probing = true;
    store_pg_query(s->pg, S_PING, NULL, 0, 1, probe_cb, s);
}

bool store_postgres_healthy(const struct store *s)
{
    return s && store_pg_healthy(s->pg, HEALTHY_WITHIN_MS);
}

/* ---- life cycle */

/* Postgres answers again: what waited for it goes now. */
static void store_pg_back(void *arg)
{
    struct store *s = arg;
    settle_kick(s);
    s->doubt_backoff_ms = DOUBT_BACKOFF_MIN_MS;
    if (s->doubt_head && !s->doubt_busy)
        doubt_schedule(s, 0);
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
    s->pg_opts.queue_timeout_ms = QUEUE_TIMEOUT_MS;
    s->pg_opts.run_timeout_ms = RUN_TIMEOUT_MS;
    bool citus = conf->distributed == CONF_DIST_CITUS;
    /* Every statement finds its rows through an index (primary key, expires_at, the in-flight index). On Citus
     * the coordinator plans each execution with its parameters (custom plans): it routes a statement to the
     * shard its key names only with the key's value in hand (a generic plan of these statements cannot be
     * distributed); the worker plans the shard's statement itself. */
    s->pg_opts.init_sql = citus ? "SET statement_timeout = " STATEMENT_TIMEOUT_MS
                                  "; SET plan_cache_mode = force_custom_plan"
                                : "SET statement_timeout = " STATEMENT_TIMEOUT_MS "; " STORE_PG_INDEX_PLANS_SQL;
    s->pg_opts.connect_timeout_ms = CONNECT_TIMEOUT_MS;
    s->pg_opts.max_queue = MAX_QUEUE;
    s->pg_opts.max_batch = MAX_BATCH;
    memcpy(s->all_stmts, stmts, sizeof stmts);
    if (citus) {
        struct store_pg_stmt *a = s->all_stmts;
        a[S_CLAIM].sql = sql_claim_citus;
        a[S_CLAIM].then_sql = sql_claim_citus_read;
        a[S_CLAIM].multi_sql = NULL;
        a[S_COMPLETE].multi_sql = NULL;
        a[S_ADMIN_RELEASE].sql = sql_admin_release_citus;
        a[S_ADMIN_RELEASE].then_sql = sql_admin_release_citus_left;
        a[S_CLEAN].sql = sql_clean_citus;
        a[S_EPOCH_BUMP].sql = sql_epoch_bump_citus;
    }
    memcpy(s->all_stmts + S__COUNT, store_order_stmts(citus), STORE_ORDER_NSTMTS * sizeof(struct store_pg_stmt));
    s->pg_opts.stmts = s->all_stmts;
    s->pg_opts.nstmts = S__COUNT + STORE_ORDER_NSTMTS;
    s->pg = store_pg_create(base, &s->pg_opts);
    s->order = store_order_create(base, s->pg, S__COUNT, store_clock_ms);
    store_pg_on_up(s->pg, store_pg_back, s);
    s->clean_timer = evtimer_new(base, clean_timer_cb, s);
    s->doubt_timer = evtimer_new(base, doubt_timer_cb, s);
    s->probe_timer = event_new(base, -1, EV_PERSIST, probe_timer_cb, s);
    if (!s->clean_timer || !s->doubt_timer || !s->probe_timer)
        abort();
    static const struct timeval probe_tv = {0, PROBE_EVERY_MS * 1000};
    event_add(s->probe_timer, &probe_tv);
    s->doubt_backoff_ms = DOUBT_BACKOFF_MIN_MS;
    clean_schedule(s, CLEAN_FIRST_MS);
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
    struct doubt *d;
    while ((d = doubt_pop(s)) != NULL) {
        doubt_free(d);
        cm_metric_claims_in_doubt(-1);
    }
    struct op *o;
    while ((o = s->ops) != NULL) {
        op_unlink(o);
        op_free(o);
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
