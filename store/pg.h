/* pg.h - a bounded pool of non-blocking libpq connections driven by one
 * libevent base, with prepared statements, a bounded FIFO of waiting queries,
 * per-query timeouts and reconnection with backoff. Internal to store/. Never what a statement means. */
#ifndef IDEMGATE_STORE_PG_H
#define IDEMGATE_STORE_PG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <libpq-fe.h>

#include "common/common.h"

struct event_base;
struct store_pg;

/* A statement prepared once on every connection right after it connects.
 * batch_key 0: it always runs alone (its own implicit transaction). N > 0: it
 * touches the one row named by its first N parameters and may be batched:
 * while every connection is busy, batchable queries wait together, and the
 * next free connection sends up to max_batch of them in one pipeline with one
 * Sync, so they share one implicit transaction (one commit, one round trip).
 * A batch is ordered by those N parameters whatever the statement (every
 * batch locks rows in one order); it commits or rolls back as a whole, the
 * COMMIT included.
 * multi_sql (optional, batchable statements with binary parameters): the same
 * statement for several distinct rows at once, each parameter an array
 * (multi_types) of the queries' values, each result row led by the 1-based
 * position of its query: within a batch, queries of one statement run as one
 * multi-row statement, and each query still gets the result sql would give.
 * then_sql (optional; never in a multi-row form): a companion sent right after sql
 * with the same parameters, before the same Sync: both run in one implicit
 * transaction (on Citus, statements on two tables whose rows live on
 * different workers; it commits them together). The query's result is sql's;
 * store_pg_cb_then gives the companion's. Either failing fails the query.
 * Every statement, multi-row form and companion is prepared and then planned
 * (EXPLAIN EXECUTE with parameters no row has) when a connection opens: one
 * the server cannot plan makes the connection fail (logged with its name). */
struct store_pg_stmt {
    const char *name;
    const char *sql;
    int nparams;
    const Oid *types; /* nparams OIDs */
    unsigned batch_key;
    const char *multi_sql;
    const Oid *multi_types; /* nparams OIDs (array types) */
    const char *then_sql;
};

enum store_pg_status {
    STORE_PG_OK,          /* res is a PGRES_TUPLES_OK / PGRES_COMMAND_OK result */
    STORE_PG_SQL_ERROR,   /* the server refused the statement */
    STORE_PG_TRANSPORT,   /* the connection broke while the query was sent or running */
    STORE_PG_TRANSIENT,   /* the server refused it for now (deadlock, serialization, resources), or another
                           * statement of its batch failed: nothing done, another try may work */
    STORE_PG_TIMEOUT,     /* no answer within the query timeout (the connection is reset) */
    STORE_PG_UNAVAILABLE, /* no connection is up and connecting failed */
    STORE_PG_OVERLOAD,    /* the waiting queue is full */
};
const char *store_pg_status_name(enum store_pg_status st);
/* A libpq notice (a notice processor's message: a server NOTICE, or the FATAL of a server ending the session) as a
 * key=value line, `event=postgres_notice conn=CONN msg=...` (no conn when NULL); libpq's default processor would
 * print it raw on stderr. */
void store_pg_log_notice(const char *conn, const char *message);

/* res is valid only during the callback (the pool frees it); NULL unless
 * st == STORE_PG_OK. errmsg is a short text for logs (never NULL). */
typedef void (*store_pg_cb)(void *arg, enum store_pg_status st, const PGresult *res, const char *errmsg);

struct store_pg_opts {
    const char *conninfo;        /* URL or key=value string (expand_dbname) */
    unsigned size;               /* connections, >= 1 */
    uint64_t queue_timeout_ms;   /* longest wait in the queue before being sent */
    uint64_t run_timeout_ms;     /* from sending to result (keep it above the server's statement_timeout) */
    uint64_t connect_timeout_ms; /* per connection attempt */
    const char *init_sql;        /* run once per connection before preparing (e.g. SET statement_timeout), or NULL */
    size_t max_queue;            /* waiting queries beyond this fail with STORE_PG_OVERLOAD */
    unsigned max_batch;          /* most queries in one batch (0 or 1: none batched; at most 64) */
    const struct store_pg_stmt *stmts;
    size_t nstmts;
};

/* Session settings for a pool whose statements all reach their rows through
 * an index (use in init_sql): plans are made once per connection (generic),
 * maybe while a table is still empty, when the planner would otherwise pick
 * sequential scans and hash joins for multi-row statements and keep them as
 * the table grows. */
#define STORE_PG_INDEX_PLANS_SQL                                                                                       \
    "SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off; SET enable_hashjoin = off;"                   \
    " SET enable_mergejoin = off"

/* A query parameter: data == NULL is SQL NULL; binary selects format 1. */
struct store_pg_param {
    const void *data;
    size_t len;
    bool binary;
};

/* Creates the pool on base and starts its first connection (the others are
 * opened on demand). opts and its statements must outlive the pool; the
 * conninfo is copied. Never fails (connection problems are reported per
 * query and through store_pg_up). */
struct store_pg *store_pg_create(struct event_base *base, const struct store_pg_opts *opts);
/* Closes every connection; queued and running queries are dropped without
 * their callbacks. NULL is a no-op. */
void store_pg_destroy(struct store_pg *p);

/* Runs prepared statement number stmt with these parameters (copied) and
 * calls cb exactly once, always from the event loop (never from inside this
 * call). result_format: 0 text, 1 binary. */
void store_pg_query(struct store_pg *p, size_t stmt, const struct store_pg_param *params, int nparams,
                    int result_format, store_pg_cb cb, void *arg);

/* True when at least one connection is up, or the last attempt succeeded.
 * Thread-safe. */
bool store_pg_up(const struct store_pg *p);

/* True when the server answered within max_age_ms (a result, a new
 * connection) and no connection broke, failed to connect or timed out since.
 * Thread-safe. store_pg_last_ok_ms: when it last answered (cm_now_ms; 0:
 * never). */
bool store_pg_healthy(const struct store_pg *p, uint64_t max_age_ms);
uint64_t store_pg_last_ok_ms(const struct store_pg *p);

/* Inside a store_pg_cb: the server process id of the connection the query
 * was last sent on when its outcome is not known, 0 when it is (it was never
 * sent, or the server ended its transaction: committed or rolled back). A
 * query that failed with STORE_PG_TIMEOUT or STORE_PG_TRANSPORT and a
 * non-zero id may still commit while that server process lives. */
int store_pg_cb_backend_pid(const struct store_pg *p);

/* Inside a store_pg_cb of a statement with then_sql (st == STORE_PG_OK): the
 * companion's result (freed by the pool after the callback); NULL otherwise. */
const PGresult *store_pg_cb_then(const struct store_pg *p);

/* cb (may be NULL) runs on the loop each time a connection becomes ready
 * while none was up before: Postgres answers again. */
void store_pg_on_up(struct store_pg *p, void (*cb)(void *arg), void *arg);

/* Decoders for binary results (big-endian). */
int64_t store_pg_get_i64(const PGresult *res, int row, int col);
int32_t store_pg_get_i32(const PGresult *res, int row, int col);

#endif
