/* pg.c - non-blocking libpq connection pool on a libevent base: connect with
 * PQconnectPoll, prepare statements once per connection, run queries in
 * pipeline mode (one query, or a batch of batchable ones sharing one implicit
 * transaction and one commit), bounded FIFO, per-query timeouts, reconnect
 * with backoff. Never what a statement means (its callers' SQL). */
#include "store/pg.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <event2/event.h>

#include "common/metrics.h"
#include "store/cancel.h"

#define BACKOFF_MIN_MS 100
#define BACKOFF_MAX_MS 2000
#define PG_MAX_BATCH   64
#define PG_HOLD_MS     5 /* the longest a batchable query waits for a busy connection rather than an idle one */
/* Waiting queries that take another connection at once; fewer wait for a busy one (PG_HOLD_MS). 32 halves the
 * commits per new key against 8 (0.45 -> 0.21 at 64 clients, 0.23 -> 0.16 at 1000, fsync on) and keeps the
 * latency: every connection still works when a burst queues more (1000 would hold a 1000-client burst behind one
 * connection: p99 x3 measured). */
#define PG_SPREAD_MIN       32
#define PG_MAX_REQUEUE      3 /* then a rolled-back query gets STORE_PG_TRANSIENT */
#define PG_MULTI_MAX_PARAMS 16
#define PG_MULTI_MAX_BYTES  (64u << 20) /* one array parameter of a multi-row statement */
/* Every connection runs its transactions at READ COMMITTED whatever the
 * database's or role's default is: the claim's read-back and the batches'
 * rerun rules assume it. */
#define PG_SESSION_SQL "SET default_transaction_isolation = 'read committed'"

enum conn_state {
    C_DOWN,       /* no connection, none scheduled (opened on demand) */
    C_BACKOFF,    /* waiting for the reconnect timer */
    C_CONNECTING, /* PQconnectPoll in progress */
    C_PREPARING,  /* connected, preparing the statements */
    C_READY,      /* idle */
    C_BUSY,       /* running a query */
};

enum q_where { Q_NEW, Q_QUEUED, Q_RUNNING, Q_DEFERRED };

struct pg_query {
    struct pg_query *prev, *next;
    struct store_pg *pool;
    enum q_where where;
    struct pg_conn *conn;
    size_t stmt;
    int nparams;
    char **values;
    int *lengths;
    int *formats;
    int result_format;
    store_pg_cb cb;
    void *arg;
    struct event *timer;
    uint64_t start_ms;
    enum store_pg_status deferred_st;
    const char *deferred_msg;
    bool no_multi;     /* its multi-row statement failed once: run it alone */
    bool alone;        /* the COMMIT of its batch failed: run it in a transaction of its own */
    unsigned requeues; /* times put back after its batch rolled back */
    int backend_pid;   /* of the connection it was last sent on (0: never sent) */
};

struct pg_conn {
    struct store_pg *pool;
    unsigned idx;
    enum conn_state state;
    PGconn *pg;
    struct event *io; /* raw storage, assigned with the connection's current socket */
    bool io_assigned;
    int io_fd;
    short io_what;
    struct event *timer; /* connect timeout or reconnect backoff */
    uint64_t backoff_ms;
    size_t prep_next;
    bool flushing;
    PGresult *res; /* first result of the setup command in progress */
    /* The batch in flight (C_BUSY): queries in the order sent, the first
     * result of each, and how many have ended (a NULL from PQgetResult). */
    struct pg_query **batch;
    unsigned nbatch;
    /* The statements sent for it: statement i covers batch[sfirst[i]] and
     * the sn[i] - 1 queries after it (sn > 1: the multi-row form). */
    unsigned *sfirst, *sn;
    PGresult **bres;    /* first result of each statement */
    PGresult *sync_res; /* an error after the last statement: the implicit COMMIT failed at Sync */
    unsigned nsent;
    unsigned nread;
    uint64_t busy_since_ms; /* when the batch was sent */
};

struct qlist {
    struct pg_query *head, *tail;
    size_t n;
};

struct store_pg {
    struct event_base *base;
    struct store_pg_opts opts;
    char *conninfo;
    char *init_sql;           /* PG_SESSION_SQL, then opts.init_sql */
    char **multi_names;       /* per statement: name of its multi-row form, or NULL */
    char **then_names;        /* per statement: name of its companion (then_sql), or NULL */
    struct setup_step *steps; /* what a new connection prepares, then plan-checks */
    size_t nsteps;
    struct pg_conn *conns;
    unsigned n_up;              /* READY or BUSY */
    unsigned n_connecting;      /* CONNECTING or PREPARING */
    bool attempted;             /* at least one connection attempt finished */
    bool last_failed;           /* the last connection attempt failed */
    uint64_t last_fail_ms;      /* when (cm_now_ms) */
    uint64_t tried_ms;          /* the last connection attempt started then (cm_now_ms) */
    struct event *wake;         /* another pool of the process connected: try every connection now (pg_wake_cb) */
    struct store_pg *next_pool; /* in the process's list of pools (pools_lock) */
    bool reported;              /* a state was logged */
    bool reported_up;           /* the state logged last */
    atomic_bool up;
    atomic_uint_least64_t ok_ms; /* the server last answered then (a result, a new connection) */
    atomic_bool failing;         /* a connection broke, failed to connect or timed out after that */
    int cb_pid;                  /* backend_pid of the query being called back */
    const PGresult *cb_then;     /* the companion's result of the query being called back */
    void (*on_up)(void *arg);
    void *on_up_arg;
    struct qlist queue;
    struct qlist deferred;
    struct event *hold;             /* dispatch again once the held queries have waited PG_HOLD_MS */
    struct timeval qtv, rtv;        /* queue and run timeouts */
    const struct timeval *qtimeout; /* libevent common timeouts (or &qtv, &rtv) */
    const struct timeval *rtimeout;
};

const char *store_pg_status_name(enum store_pg_status st)
{
    switch (st) {
    case STORE_PG_OK:
        return "ok";
    case STORE_PG_SQL_ERROR:
        return "sql_error";
    case STORE_PG_TRANSPORT:
        return "transport";
    case STORE_PG_TRANSIENT:
        return "transient";
    case STORE_PG_TIMEOUT:
        return "timeout";
    case STORE_PG_UNAVAILABLE:
        return "unavailable";
    case STORE_PG_OVERLOAD:
        return "overload";
    }
    return "?";
}

int64_t store_pg_get_i64(const PGresult *res, int row, int col)
{
    if (PQgetisnull(res, row, col) || PQgetlength(res, row, col) != 8)
        return 0;
    const unsigned char *p = (const unsigned char *)PQgetvalue(res, row, col);
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return (int64_t)v;
}

int32_t store_pg_get_i32(const PGresult *res, int row, int col)
{
    if (PQgetisnull(res, row, col) || PQgetlength(res, row, col) != 4)
        return 0;
    const unsigned char *p = (const unsigned char *)PQgetvalue(res, row, col);
    uint32_t v = ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
    return (int32_t)v;
}

/* ---- query lists */

static void ql_push_tail(struct qlist *l, struct pg_query *q)
{
    q->next = NULL;
    q->prev = l->tail;
    if (l->tail)
        l->tail->next = q;
    else
        l->head = q;
    l->tail = q;
    l->n++;
}

static void ql_push_head(struct qlist *l, struct pg_query *q)
{
    q->prev = NULL;
    q->next = l->head;
    if (l->head)
        l->head->prev = q;
    else
        l->tail = q;
    l->head = q;
    l->n++;
}

static void ql_remove(struct qlist *l, struct pg_query *q)
{
    if (q->prev)
        q->prev->next = q->next;
    else
        l->head = q->next;
    if (q->next)
        q->next->prev = q->prev;
    else
        l->tail = q->prev;
    q->prev = q->next = NULL;
    l->n--;
}

/* q, its timer's storage, its parameter arrays and their bytes are one allocation (store_pg_query). */
static void q_free(struct pg_query *q)
{
    event_del(q->timer);
    free(q);
}

/* Calls the callback and frees q; q must be detached from every list. */
static void q_finish(struct pg_query *q, enum store_pg_status st, const PGresult *res, const char *msg)
{
    double secs = (double)(cm_now_ms() - q->start_ms) / 1000.0;
    cm_metric_store_seconds(CM_STORE_POSTGRES, secs);
    if (st != STORE_PG_OK)
        cm_metric_store_error(CM_STORE_POSTGRES);
    evtimer_del(q->timer);
    struct store_pg *p = q->pool;
    int saved = p->cb_pid;
    p->cb_pid = q->backend_pid;
    q->cb(q->arg, st, st == STORE_PG_OK ? res : NULL, msg ? msg : store_pg_status_name(st));
    p->cb_pid = saved;
    q_free(q);
}

/* Fails q from the event loop (next iteration), never from the caller's stack. */
static void q_defer_fail(struct store_pg *p, struct pg_query *q, enum store_pg_status st, const char *msg)
{
    static const struct timeval zero = {0, 0};
    q->where = Q_DEFERRED;
    q->conn = NULL;
    q->deferred_st = st;
    q->deferred_msg = msg;
    ql_push_tail(&p->deferred, q);
    evtimer_add(q->timer, &zero);
}

/* ---- up/down bookkeeping */

/* When a pool of this process last connected (cm_now_ms, 0: never). Each I/O loop has its own pool, and each pool
 * retries a lost server after its own backoff (up to BACKOFF_MAX_MS): without this, a loop whose pool was still
 * waiting answered "postgres unavailable" for up to 2 s after another loop's had reconnected. A pool that is down
 * and gets a query looks here (pg_kick). */
static atomic_uint_least64_t pg_connected_ms;
/* Every pool of the process, so that the first to connect after an outage wakes the others (their settle operations,
 * waiting for Postgres, then go before their leases can lapse). A pool's wake event is activated under this lock,
 * from any thread (the gateway's event bases are thread-aware). */
static pthread_mutex_t pools_lock = PTHREAD_MUTEX_INITIALIZER;
static struct store_pg *pools;

/* Without traffic a lost server is tried after the backoff; with traffic no later than this after the last try. */
#define PG_DEMAND_TRY_MS 250

static void mark_ok(struct store_pg *p)
{
    atomic_store(&p->ok_ms, cm_now_ms());
    atomic_store(&p->failing, false);
}

static void mark_failing(struct store_pg *p)
{
    atomic_store(&p->failing, true);
}

/* why: the last connection error, for the log line of a transition to down. */
static void update_up(struct store_pg *p, const char *why)
{
    bool v = p->n_up > 0 || (p->attempted && !p->last_failed);
    atomic_store(&p->up, v);
    cm_metric_postgres_up(v);
    if (!p->attempted)
        return;
    if (!p->reported || v != p->reported_up) {
        char url[512], err[256];
        cm_redact_url(url, sizeof url, p->conninfo);
        if (v)
            cm_log(CM_INFO, "postgres_up", "url=%s", url);
        else
            cm_log(CM_WARN, "postgres_down", "url=%s error=%s", url, cm_log_quote(err, sizeof err, why ? why : "?"));
        p->reported_up = v;
        p->reported = true;
    }
}

static void set_state(struct pg_conn *c, enum conn_state s)
{
    struct store_pg *p = c->pool;
    bool was_up = c->state == C_READY || c->state == C_BUSY;
    bool was_conn = c->state == C_CONNECTING || c->state == C_PREPARING;
    bool is_up = s == C_READY || s == C_BUSY;
    bool is_conn = s == C_CONNECTING || s == C_PREPARING;
    p->n_up = p->n_up - (was_up ? 1u : 0u) + (is_up ? 1u : 0u);
    p->n_connecting = p->n_connecting - (was_conn ? 1u : 0u) + (is_conn ? 1u : 0u);
    c->state = s;
}

/* Every waiting query fails fast: no connection is up and connecting failed. */
static void fail_queue(struct store_pg *p, const char *msg)
{
    struct pg_query *q;
    while ((q = p->queue.head) != NULL) {
        ql_remove(&p->queue, q);
        q_defer_fail(p, q, STORE_PG_UNAVAILABLE, msg);
    }
}

/* ---- connections */

static void conn_io_cb(evutil_socket_t fd, short what, void *arg);
static void conn_timer_cb(evutil_socket_t fd, short what, void *arg);
static void conn_start(struct pg_conn *c);
static void pg_wake_others(const struct store_pg *p);
static void dispatch(struct store_pg *p);

static void conn_watch(struct pg_conn *c, short what)
{
    int fd = c->pg ? PQsocket(c->pg) : -1;
    if (c->io_assigned && c->io_fd == fd && c->io_what == what)
        return;
    if (c->io_assigned) {
        event_del(c->io);
        c->io_assigned = false;
    }
    if (fd < 0 || what == 0)
        return;
    event_assign(c->io, c->pool->base, fd, (short)(what | EV_PERSIST), conn_io_cb, c);
    event_add(c->io, NULL);
    c->io_assigned = true;
    c->io_fd = fd;
    c->io_what = what;
}

static void conn_close(struct pg_conn *c)
{
    if (c->io_assigned) {
        event_del(c->io);
        c->io_assigned = false;
    }
    evtimer_del(c->timer);
    if (c->res) {
        PQclear(c->res);
        c->res = NULL;
    }
    for (unsigned i = 0; i < c->nsent; i++) {
        if (c->bres[i]) {
            PQclear(c->bres[i]);
            c->bres[i] = NULL;
        }
    }
    PQclear(c->sync_res);
    c->sync_res = NULL;
    if (c->pg) {
        PQfinish(c->pg);
        c->pg = NULL;
    }
    c->flushing = false;
    c->prep_next = 0;
    set_state(c, C_DOWN);
}

/* The wait is between half the backoff and all of it (jitter): the pools of a process, and the processes behind one
 * server, do not all come back at the same instant after an outage. */
static void conn_backoff(struct pg_conn *c)
{
    uint64_t half = c->backoff_ms / 2, ms = half + cm_random_token() % (half + 1);
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    set_state(c, C_BACKOFF);
    evtimer_add(c->timer, &tv);
    c->backoff_ms = c->backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : c->backoff_ms * 2;
}

static void conn_connect_failed(struct pg_conn *c, const char *why_in)
{
    struct store_pg *p = c->pool;
    char msg[256], why[256];
    /* why_in may point into the PGconn that conn_close frees */
    snprintf(why, sizeof why, "%s", why_in ? why_in : "?");
    cm_log(CM_DEBUG, "postgres_connect_failed", "conn=%u error=%s", c->idx, cm_log_quote(msg, sizeof msg, why));
    mark_failing(p);
    conn_close(c);
    conn_backoff(c);
    p->attempted = true;
    p->last_failed = true;
    p->last_fail_ms = cm_now_ms();
    if (p->n_up == 0)
        fail_queue(p, "postgres unavailable");
    update_up(p, why);
}

/* Detaches the batch in flight from c and fails every query of it from the
 * event loop. */
static void batch_fail(struct pg_conn *c, enum store_pg_status st, const char *msg)
{
    struct store_pg *p = c->pool;
    for (unsigned i = 0; i < c->nsent; i++) {
        if (c->bres[i]) {
            PQclear(c->bres[i]);
            c->bres[i] = NULL;
        }
    }
    PQclear(c->sync_res);
    c->sync_res = NULL;
    for (unsigned i = 0; i < c->nbatch; i++) {
        struct pg_query *q = c->batch[i];
        c->batch[i] = NULL;
        q_defer_fail(p, q, st, msg);
    }
    c->nbatch = c->nsent = c->nread = 0;
}

/* A connection that was up broke: its running queries fail with a transport
 * error (committed or not: the caller cannot know). */
static void conn_dead(struct pg_conn *c, const char *why_in)
{
    struct store_pg *p = c->pool;
    char msg[256], why[256];
    snprintf(why, sizeof why, "%s", why_in ? why_in : "?");
    cm_log(CM_WARN, "postgres_connection_lost", "conn=%u error=%s", c->idx, cm_log_quote(msg, sizeof msg, why));
    mark_failing(p);
    batch_fail(c, STORE_PG_TRANSPORT, "postgres connection lost");
    conn_close(c);
    conn_backoff(c);
    update_up(p, why);
}

void store_pg_log_notice(const char *conn, const char *message)
{
    char line[512];
    size_t n = strlen(message);
    while (n > 0 && (message[n - 1] == '\n' || message[n - 1] == '\r' || message[n - 1] == ' '))
        n--;
    char *copy = cm_strndup(message, n);
    if (conn)
        cm_log(CM_INFO, "postgres_notice", "conn=%s msg=%s", conn, cm_log_quote(line, sizeof line, copy));
    else
        cm_log(CM_INFO, "postgres_notice", "msg=%s", cm_log_quote(line, sizeof line, copy));
    free(copy);
}

static void notice_cb(void *arg, const char *message)
{
    const struct pg_conn *c = arg;
    char conn[16];
    snprintf(conn, sizeof conn, "%u", c->idx);
    store_pg_log_notice(conn, message);
}

static bool conn_flush(struct pg_conn *c)
{
    int r = PQflush(c->pg);
    if (r < 0) {
        conn_dead(c, PQerrorMessage(c->pg));
        return false;
    }
    c->flushing = r == 1;
    conn_watch(c, c->flushing ? (EV_READ | EV_WRITE) : EV_READ);
    return true;
}

/* The setup of a new connection, one step after the other: the init SQL, a PQsendPrepare of every statement, of
 * every multi-row form and of every companion (then_sql), then an EXPLAIN EXECUTE of each of them with
 * parameters no row can have: a statement the server accepts but cannot plan (Citus plans a distributed statement
 * only when it runs) fails the setup here, with its name in the log, and not at its first use. */
struct setup_step {
    const char *name; /* the prepared statement's name (for logs and EXPLAIN EXECUTE) */
    const char *sql;  /* PREPARE: the statement; plan check: the EXPLAIN EXECUTE text (heap) */
    int nparams;
    const Oid *types;
    bool check;
};

/* A literal of type oid that names no row: keys and routes are never empty, tokens never 0 with an empty key. */
static const char *dry_literal(Oid oid)
{
    switch (oid) {
    case 16: /* bool */
        return "false";
    case 17: /* bytea */
        return "'\\x'::bytea";
    case 20: /* int8 */
    case 23: /* int4 */
        return "0";
    case 1184: /* timestamptz */
        return "'-infinity'";
    case 1000: /* bool[] */
    case 1001: /* bytea[] */
    case 1007: /* int4[] */
    case 1009: /* text[] */
    case 1016: /* int8[] */
        return "'{}'";
    default: /* text */
        return "''";
    }
}

static char *plan_check_sql(const char *name, int nparams, const Oid *types)
{
    struct cm_buf b;
    cm_buf_init(&b, 4096);
    bool ok = cm_buf_appendf(&b, "EXPLAIN (COSTS OFF) EXECUTE %s", name);
    for (int i = 0; ok && i < nparams; i++)
        ok = cm_buf_appendf(&b, "%s%s", i ? ", " : "(", dry_literal(types ? types[i] : 25));
    ok = ok && (nparams == 0 || cm_buf_append(&b, ")", 1));
    if (!ok)
        abort();
    size_t n;
    char *out = cm_buf_take(&b, &n);
    cm_buf_free(&b);
    return out;
}

static void setup_add(struct store_pg *p, const char *name, const char *sql, int nparams, const Oid *types)
{
    p->steps[p->nsteps++] = (struct setup_step){name, sql, nparams, types, false};
}

static void setup_plan(struct store_pg *p)
{
    p->steps = cm_calloc(3 * p->opts.nstmts * 2 + 1, sizeof *p->steps);
    for (size_t i = 0; i < p->opts.nstmts; i++) {
        const struct store_pg_stmt *st = &p->opts.stmts[i];
        setup_add(p, st->name, st->sql, st->nparams, st->types);
        if (p->multi_names[i])
            setup_add(p, p->multi_names[i], st->multi_sql, st->nparams, st->multi_types);
        if (p->then_names[i])
            setup_add(p, p->then_names[i], st->then_sql, st->nparams, st->types);
    }
    size_t nprep = p->nsteps;
    for (size_t i = 0; i < nprep; i++) {
        struct setup_step *ps = &p->steps[i];
        p->steps[p->nsteps++] = (struct setup_step){ps->name, plan_check_sql(ps->name, ps->nparams, ps->types),
                                                    ps->nparams, ps->types, true};
    }
}

static size_t setup_steps(const struct store_pg *p)
{
    return (p->opts.init_sql ? 1 : 0) + p->nsteps;
}

static const struct setup_step *setup_step_at(const struct pg_conn *c)
{
    const struct store_pg *p = c->pool;
    if (p->opts.init_sql && c->prep_next == 0)
        return NULL;
    return &p->steps[c->prep_next - (p->opts.init_sql ? 1 : 0)];
}

static const char *setup_step_name(const struct pg_conn *c)
{
    const struct setup_step *st = setup_step_at(c);
    if (!st)
        return "init";
    return st->check ? "plan" : "prepare";
}

static void conn_prepare_next(struct pg_conn *c)
{
    const struct store_pg *p = c->pool;
    const struct setup_step *st = setup_step_at(c);
    int sent;
    if (!st)
        sent = PQsendQuery(c->pg, p->opts.init_sql);
    else if (st->check)
        sent = PQsendQuery(c->pg, st->sql);
    else
        sent = PQsendPrepare(c->pg, st->name, st->sql, st->nparams, st->types);
    if (!sent) {
        conn_connect_failed(c, PQerrorMessage(c->pg));
        return;
    }
    c->flushing = true;
    int r = PQflush(c->pg);
    if (r < 0) {
        conn_connect_failed(c, PQerrorMessage(c->pg));
        return;
    }
    c->flushing = r == 1;
    conn_watch(c, c->flushing ? (EV_READ | EV_WRITE) : EV_READ);
}

static void conn_ready(struct pg_conn *c)
{
    struct store_pg *p = c->pool;
    /* From now on every query goes through the pipeline: a Sync after each
     * batch ends its implicit transaction. */
    if (!PQenterPipelineMode(c->pg)) {
        conn_connect_failed(c, PQerrorMessage(c->pg));
        return;
    }
    evtimer_del(c->timer);
    bool was_down = p->n_up == 0;
    mark_ok(p);
    atomic_store(&pg_connected_ms, cm_now_ms());
    if (was_down)
        pg_wake_others(p);
    set_state(c, C_READY);
    c->backoff_ms = BACKOFF_MIN_MS;
    p->attempted = true;
    p->last_failed = false;
    conn_watch(c, EV_READ);
    update_up(p, NULL);
    dispatch(p);
    if (was_down && p->on_up)
        p->on_up(p->on_up_arg);
}

static void conn_connected(struct pg_conn *c)
{
    if (PQsetnonblocking(c->pg, 1) != 0) {
        conn_connect_failed(c, PQerrorMessage(c->pg));
        return;
    }
    set_state(c, C_PREPARING);
    c->prep_next = 0;
    if (setup_steps(c->pool) == 0) {
        conn_ready(c);
        return;
    }
    conn_prepare_next(c);
}

static void conn_poll(struct pg_conn *c)
{
    /* PQconnectPoll may close the socket and open another (next address),
     * possibly under the same number: unregister it while it is still open,
     * register the current one afresh after the step. */
    if (c->io_assigned) {
        event_del(c->io);
        c->io_assigned = false;
    }
    switch (PQconnectPoll(c->pg)) {
    case PGRES_POLLING_READING:
        conn_watch(c, EV_READ);
        return;
    case PGRES_POLLING_WRITING:
        conn_watch(c, EV_WRITE);
        return;
    case PGRES_POLLING_OK:
        conn_connected(c);
        return;
    case PGRES_POLLING_FAILED:
    default:
        conn_connect_failed(c, PQerrorMessage(c->pg));
        return;
    }
}

static void conn_start(struct pg_conn *c)
{
    struct store_pg *p = c->pool;
    p->tried_ms = cm_now_ms();
    /* dbname last: what the URL says (application_name too) wins. */
    static const char *const kw[] = {"application_name", "dbname", NULL};
    const char *vals[] = {"idemgate", p->conninfo, NULL};
    conn_close(c);
    c->pg = PQconnectStartParams(kw, vals, 1);
    set_state(c, C_CONNECTING);
    if (!c->pg) {
        conn_connect_failed(c, "out of memory");
        return;
    }
    if (PQstatus(c->pg) == CONNECTION_BAD) {
        conn_connect_failed(c, PQerrorMessage(c->pg));
        return;
    }
    PQsetNoticeProcessor(c->pg, notice_cb, c);
    uint64_t ms = p->opts.connect_timeout_ms;
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    evtimer_add(c->timer, &tv);
    /* As if PQconnectPoll had returned PGRES_POLLING_WRITING. */
    conn_watch(c, EV_WRITE);
}

static enum store_pg_status classify(const PGresult *res, const char **msg)
{
    if (!res) {
        *msg = "no result";
        return STORE_PG_TRANSPORT;
    }
    ExecStatusType es = PQresultStatus(res);
    if (es == PGRES_TUPLES_OK || es == PGRES_COMMAND_OK)
        return STORE_PG_OK;
    *msg = PQresultErrorMessage(res);
    const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
    if (state && strcmp(state, "57014") == 0) /* statement_timeout */
        return STORE_PG_TIMEOUT;
    /* connection exceptions, shutdown */
    if (!state || strncmp(state, "08", 2) == 0 || strncmp(state, "57P", 3) == 0)
        return STORE_PG_TRANSPORT;
    /* rollbacks (serialization, deadlock), insufficient resources: the
     * statement did nothing and another try may work */
    if (strncmp(state, "40", 2) == 0 || strncmp(state, "53", 2) == 0)
        return STORE_PG_TRANSIENT;
    return STORE_PG_SQL_ERROR;
}

static void setup_done(struct pg_conn *c)
{
    struct store_pg *p = c->pool;
    PGresult *res = c->res;
    c->res = NULL;
    bool ok = res && (PQresultStatus(res) == PGRES_COMMAND_OK || PQresultStatus(res) == PGRES_TUPLES_OK);
    if (!ok) {
        char msg[512];
        const struct setup_step *step = setup_step_at(c);
        cm_log(CM_ERROR, "postgres_prepare_failed", "conn=%u stmt=%s step=%s error=%s", c->idx,
               step ? step->name : "init", setup_step_name(c),
               cm_log_quote(msg, sizeof msg, res ? PQresultErrorMessage(res) : PQerrorMessage(c->pg)));
        if (res)
            PQclear(res);
        char why[160];
        snprintf(why, sizeof why, "%s of statement %s failed (see postgres_prepare_failed)", setup_step_name(c),
                 step ? step->name : "init");
        conn_connect_failed(c, why);
        return;
    }
    PQclear(res);
    if (++c->prep_next < setup_steps(p))
        conn_prepare_next(c);
    else
        conn_ready(c);
}

/* The rows of a multi-row statement's result whose first column (the
 * 1-based position in the group) is pos, without that column: the result the
 * single form would have given. NULL when out of memory. */
static PGresult *split_rows(const PGresult *res, long pos)
{
    int nf = PQnfields(res);
    if (nf < 1)
        return NULL;
    PGresult *out = PQmakeEmptyPGresult(NULL, PGRES_TUPLES_OK);
    if (!out)
        return NULL;
    PGresAttDesc attrs[64];
    int na = nf - 1 < 64 ? nf - 1 : 64;
    for (int i = 0; i < na; i++) {
        attrs[i] = (PGresAttDesc){.name = PQfname(res, i + 1),
                                  .tableid = PQftable(res, i + 1),
                                  .columnid = PQftablecol(res, i + 1),
                                  .format = PQfformat(res, i + 1),
                                  .typid = PQftype(res, i + 1),
                                  .typlen = PQfsize(res, i + 1),
                                  .atttypmod = PQfmod(res, i + 1)};
    }
    if (!PQsetResultAttrs(out, na, attrs))
        goto fail;
    for (int r = 0; r < PQntuples(res); r++) {
        long n = PQfformat(res, 0) == 1 ? (long)store_pg_get_i64(res, r, 0) : strtol(PQgetvalue(res, r, 0), NULL, 10);
        if (n != pos)
            continue;
        int row = PQntuples(out);
        for (int f = 0; f < na; f++) {
            bool null = PQgetisnull(res, r, f + 1);
            if (!PQsetvalue(out, row, f, null ? NULL : PQgetvalue(res, r, f + 1),
                            null ? -1 : PQgetlength(res, r, f + 1)))
                goto fail;
        }
    }
    return out;
fail:
    PQclear(out);
    return NULL;
}

/* The Sync of the batch arrived: its transaction has ended. If every
 * statement succeeded it committed and each query gets its result. If one
 * failed the whole transaction rolled back: a single statement that failed
 * gets its error; every other query did nothing and goes back to the head of
 * the queue (after a failed multi-row statement, to run alone), up to
 * PG_MAX_REQUEUE times, then gets a transient failure. */
static void batch_done(struct pg_conn *c)
{
    struct store_pg *p = c->pool;
    unsigned n = c->nbatch, ns = c->nsent;
    struct pg_query *qs[PG_MAX_BATCH];
    PGresult *rs[2 * PG_MAX_BATCH];
    unsigned sfirst[2 * PG_MAX_BATCH], sn[2 * PG_MAX_BATCH];
    for (unsigned i = 0; i < n; i++) {
        qs[i] = c->batch[i];
        c->batch[i] = NULL;
    }
    for (unsigned i = 0; i < ns; i++) {
        rs[i] = c->bres[i];
        sfirst[i] = c->sfirst[i];
        sn[i] = c->sn[i];
        c->bres[i] = NULL;
    }
    PGresult *sync_res = c->sync_res;
    c->sync_res = NULL;
    if (PQstatus(c->pg) != CONNECTION_BAD)
        mark_ok(p); /* the server answered the whole batch */
    c->nbatch = c->nsent = c->nread = 0;
    const char *fail_msg = NULL;
    enum store_pg_status fail_st = STORE_PG_OK;
    unsigned failed = ns; /* the failed statement */
    for (unsigned i = 0; i < ns && failed == ns; i++) {
        const char *msg = NULL;
        enum store_pg_status st = classify(rs[i], &msg);
        if (st != STORE_PG_OK) {
            failed = i;
            fail_st = st;
            fail_msg = msg;
        }
    }
    /* Every statement succeeded but the COMMIT failed (a deferred constraint,
     * a serialization failure at commit): the whole transaction rolled back.
     * Alone, the query gets that error; in a batch nobody knows whose row
     * caused it, so every query runs again in a transaction of its own. */
    bool commit_failed = failed == ns && sync_res;
    char commit_msg[256] = "";
    if (commit_failed) {
        const char *msg = NULL;
        fail_st = classify(sync_res, &msg);
        snprintf(commit_msg, sizeof commit_msg, "postgres commit failed: %s", msg ? msg : "?");
        fail_msg = commit_msg;
        if (fail_st == STORE_PG_OK)
            fail_st = STORE_PG_SQL_ERROR;
        cm_log(CM_WARN, "postgres_commit_failed", "conn=%u batch=%u status=%s", c->idx, n,
               store_pg_status_name(fail_st));
        failed = 0;
    }
    char lost[256] = "";
    if (PQstatus(c->pg) == CONNECTION_BAD) {
        snprintf(lost, sizeof lost, "%s", PQerrorMessage(c->pg));
        fail_st = STORE_PG_TRANSPORT;
        fail_msg = "postgres connection lost";
        failed = 0;
    }
    /* The Sync arrived on a live connection: the transaction's outcome is
     * known (committed, or rolled back: a server-side statement_timeout
     * included), so no query of it is in doubt. */
    bool known = !lost[0] && PQstatus(c->pg) != CONNECTION_BAD;
    unsigned nback = 0; /* the queries to run again, in qs[0..nback) (a prefix already handled) */
    for (unsigned i = 0; i < ns; i++) {
        /* A companion (sn 0) is the statement before's: its failure is that query's own. */
        bool has_then = i + 1 < ns && sn[i + 1] == 0;
        bool own_fail = i == failed || (has_then && failed == i + 1);
        for (unsigned j = 0; j < sn[i]; j++) {
            struct pg_query *q = qs[sfirst[i] + j];
            q->where = Q_NEW;
            q->conn = NULL;
            if (known)
                q->backend_pid = 0;
            if (commit_failed && n > 1 && fail_st != STORE_PG_TRANSPORT) {
                if (++q->requeues > PG_MAX_REQUEUE) {
                    q_finish(q, STORE_PG_TRANSIENT, NULL, "postgres batch rolled back at commit");
                } else {
                    q->alone = true;
                    qs[nback++] = q;
                }
            } else if (commit_failed) {
                q_finish(q, fail_st, NULL, fail_msg);
            } else if (failed == ns && sn[i] == 1) {
                p->cb_then = has_then ? rs[i + 1] : NULL;
                q_finish(q, STORE_PG_OK, rs[i], NULL);
                p->cb_then = NULL;
            } else if (failed == ns) {
                PGresult *mine = split_rows(rs[i], (long)j + 1);
                if (mine)
                    q_finish(q, STORE_PG_OK, mine, NULL);
                else
                    q_finish(q, STORE_PG_TRANSIENT, NULL, "out of memory splitting a batch result");
                PQclear(mine);
            } else if (fail_st == STORE_PG_TRANSPORT || (own_fail && sn[i] == 1)) {
                q_finish(q, fail_st, NULL, fail_msg);
            } else if (++q->requeues > PG_MAX_REQUEUE) {
                q_finish(q, STORE_PG_TRANSIENT, NULL, "postgres batch rolled back (another statement in it failed)");
            } else {
                q->no_multi = q->no_multi || i == failed;
                qs[nback++] = q;
            }
        }
        if (rs[i])
            PQclear(rs[i]);
    }
    PQclear(sync_res);
    for (unsigned i = nback; i-- > 0;) {
        qs[i]->where = Q_QUEUED;
        qs[i]->backend_pid = 0; /* it was rolled back: nothing of it can commit any more */
        ql_push_head(&p->queue, qs[i]);
        evtimer_add(qs[i]->timer, p->qtimeout);
    }
    if (lost[0] || PQstatus(c->pg) == CONNECTION_BAD) {
        conn_dead(c, lost[0] ? lost : "postgres connection lost");
    } else {
        set_state(c, C_READY);
        conn_watch(c, EV_READ);
    }
    dispatch(p);
}

/* A failure while connecting or preparing retries the connection; one on a
 * connection that was up fails its batch. */
static void conn_fail(struct pg_conn *c, bool setup)
{
    if (setup)
        conn_connect_failed(c, PQerrorMessage(c->pg));
    else
        conn_dead(c, PQerrorMessage(c->pg));
}

static void conn_io_busy(struct pg_conn *c, short what)
{
    bool setup = c->state == C_PREPARING;
    if ((what & EV_READ) && !PQconsumeInput(c->pg)) {
        conn_fail(c, setup);
        return;
    }
    if (c->flushing) {
        int r = PQflush(c->pg);
        if (r < 0) {
            conn_fail(c, setup);
            return;
        }
        c->flushing = r == 1;
        conn_watch(c, c->flushing ? (EV_READ | EV_WRITE) : EV_READ);
    }
    /* Bounded: a batch yields a result and a NULL per statement (two per query at most), then the Sync. */
    for (int guard = 0; guard < 6 * PG_MAX_BATCH + 16 && !PQisBusy(c->pg); guard++) {
        PGresult *r = PQgetResult(c->pg);
        if (setup) {
            if (!r) {
                setup_done(c);
                return;
            }
            if (!c->res || (PQresultStatus(c->res) == PGRES_COMMAND_OK && PQresultStatus(r) != PGRES_COMMAND_OK)) {
                if (c->res)
                    PQclear(c->res);
                c->res = r; /* the first result, or the first error of a multi-statement init */
            } else {
                PQclear(r);
            }
            continue;
        }
        if (!r) { /* the end of one statement's results */
            if (c->nread < c->nsent)
                c->nread++;
            continue;
        }
        if (PQresultStatus(r) == PGRES_PIPELINE_SYNC) {
            PQclear(r);
            batch_done(c);
            return;
        }
        if (c->nread < c->nsent && !c->bres[c->nread])
            c->bres[c->nread] = r;
        else if (c->nread >= c->nsent && !c->sync_res && PQresultStatus(r) != PGRES_COMMAND_OK &&
                 PQresultStatus(r) != PGRES_TUPLES_OK)
            c->sync_res = r; /* after every statement, before the Sync: the COMMIT failed */
        else
            PQclear(r);
    }
    if (PQstatus(c->pg) == CONNECTION_BAD)
        conn_fail(c, setup);
}

static void conn_io_cb(evutil_socket_t fd, short what, void *arg)
{
    struct pg_conn *c = arg;
    (void)fd;
    switch (c->state) {
    case C_CONNECTING:
        conn_poll(c);
        return;
    case C_PREPARING:
    case C_BUSY:
        conn_io_busy(c, what);
        return;
    case C_READY:
        /* Idle: notices, or the server closing the connection (restart). */
        if (!PQconsumeInput(c->pg)) {
            conn_dead(c, PQerrorMessage(c->pg));
            return;
        }
        for (int guard = 0; guard < 100 && !PQisBusy(c->pg); guard++) {
            PGresult *r = PQgetResult(c->pg);
            if (!r)
                break;
            PQclear(r);
        }
        if (PQstatus(c->pg) == CONNECTION_BAD)
            conn_dead(c, PQerrorMessage(c->pg));
        return;
    case C_DOWN:
    case C_BACKOFF:
        conn_watch(c, 0);
        return;
    }
}

/* Every connection of p waiting out its backoff tries now. */
static void pg_try_all(struct store_pg *p)
{
    for (unsigned i = 0; i < p->opts.size; i++) {
        struct pg_conn *c = &p->conns[i];
        if (c->state != C_BACKOFF)
            continue;
        evtimer_del(c->timer);
        c->backoff_ms = BACKOFF_MIN_MS;
        conn_start(c);
    }
}

static void pg_wake_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    struct store_pg *p = arg;
    if (p->n_up == 0)
        pg_try_all(p);
}

static void pg_wake_others(const struct store_pg *p)
{
    pthread_mutex_lock(&pools_lock);
    for (struct store_pg *o = pools; o; o = o->next_pool)
        if (o != p)
            event_active(o->wake, EV_TIMEOUT, 1);
    pthread_mutex_unlock(&pools_lock);
}

/* A query came to pool p while none of its connections is up and its last attempt failed. When another pool of the
 * process has connected since (the server is back), every connection of p tries now and the query waits in the
 * queue for them: true. Else false: the query fails at once, as long as the server is down; and when p last tried
 * PG_DEMAND_TRY_MS ago or more, one connection tries now (traffic shortens the backoff, never waits for it). */
static bool pg_kick(struct store_pg *p)
{
    if (atomic_load(&pg_connected_ms) > p->last_fail_ms) {
        pg_try_all(p);
        if (p->n_connecting > 0 || p->n_up > 0)
            return true;
    }
    if (p->n_connecting == 0 && cm_now_ms() - p->tried_ms >= PG_DEMAND_TRY_MS) {
        for (unsigned i = 0; i < p->opts.size; i++) {
            struct pg_conn *c = &p->conns[i];
            if (c->state == C_BACKOFF) {
                evtimer_del(c->timer);
                conn_start(c);
                break;
            }
        }
    }
    return false;
}

static void conn_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct pg_conn *c = arg;
    (void)fd;
    (void)what;
    if (c->state == C_BACKOFF) {
        conn_start(c);
        return;
    }
    if (c->state == C_CONNECTING || c->state == C_PREPARING)
        conn_connect_failed(c, "connect timeout");
}

/* Orders a batch by the rows the statements touch (their first batch_key
 * parameters), whatever the statement: every batch locks rows in one order
 * (by statement first, [claim K1, complete K2] against [claim K2, complete
 * K1] locked in opposite orders and could deadlock). The sort is stable, so
 * queries on the same row keep their order; neighbours of one statement on
 * distinct rows go as one multi-row statement, which locks them in that
 * order too. */
static int q_row_cmp(const struct store_pg *p, const struct pg_query *a, const struct pg_query *b)
{
    unsigned ka = p->opts.stmts[a->stmt].batch_key, kb = p->opts.stmts[b->stmt].batch_key;
    unsigned k = ka < kb ? ka : kb;
    for (unsigned i = 0; i < k && (int)i < a->nparams && (int)i < b->nparams; i++) {
        size_t la = a->values[i] ? (size_t)a->lengths[i] : 0, lb = b->values[i] ? (size_t)b->lengths[i] : 0;
        int r = memcmp(a->values[i] ? a->values[i] : "", b->values[i] ? b->values[i] : "", la < lb ? la : lb);
        if (r != 0)
            return r;
        if (la != lb)
            return la < lb ? -1 : 1;
    }
    return 0;
}

/* May q go into its statement's multi-row form? */
static bool multi_ok(const struct store_pg *p, const struct pg_query *q)
{
    if (q->no_multi || !p->multi_names[q->stmt] || p->then_names[q->stmt])
        return false;
    for (int i = 0; i < q->nparams; i++) {
        if (q->formats[i] != 1)
            return false;
    }
    return true;
}

static void put_be32(char *b, uint32_t v)
{
    b[0] = (char)(v >> 24);
    b[1] = (char)(v >> 16);
    b[2] = (char)(v >> 8);
    b[3] = (char)v;
}

/* Bytes of parameter i of qs[0..n) as one binary array, or 0 when too large. */
static size_t multi_param_len(struct pg_query **qs, unsigned n, int i)
{
    size_t len = 20;
    for (unsigned j = 0; j < n; j++)
        len += 4 + (qs[j]->values[i] ? (size_t)qs[j]->lengths[i] : 0);
    return len <= PG_MULTI_MAX_BYTES ? len : 0;
}

/* Sends the multi-row form for qs[0..n) (same statement, distinct rows):
 * each parameter a one-dimensional binary array of the queries' values. */
static bool send_multi(struct pg_conn *c, struct pg_query **qs, unsigned n)
{
    const struct store_pg *p = c->pool;
    const struct store_pg_stmt *st = &p->opts.stmts[qs[0]->stmt];
    char *vals[PG_MULTI_MAX_PARAMS];
    int lens[PG_MULTI_MAX_PARAMS], fmts[PG_MULTI_MAX_PARAMS];
    int np = st->nparams;
    for (int i = 0; i < np; i++) {
        size_t len = multi_param_len(qs, n, i);
        char *b = cm_malloc(len);
        bool has_null = false;
        for (unsigned j = 0; j < n; j++)
            has_null = has_null || !qs[j]->values[i];
        put_be32(b, 1); /* dimensions */
        put_be32(b + 4, has_null ? 1 : 0);
        put_be32(b + 8, (uint32_t)st->types[i]);
        put_be32(b + 12, n);
        put_be32(b + 16, 1); /* lower bound */
        size_t off = 20;
        for (unsigned j = 0; j < n; j++) {
            if (!qs[j]->values[i]) {
                put_be32(b + off, UINT32_MAX); /* -1: NULL */
                off += 4;
                continue;
            }
            put_be32(b + off, (uint32_t)qs[j]->lengths[i]);
            memcpy(b + off + 4, qs[j]->values[i], (size_t)qs[j]->lengths[i]);
            off += 4 + (size_t)qs[j]->lengths[i];
        }
        vals[i] = b;
        lens[i] = (int)len;
        fmts[i] = 1;
    }
    bool ok = PQsendQueryPrepared(c->pg, p->multi_names[qs[0]->stmt], np, (const char *const *)vals, lens, fmts,
                                  qs[0]->result_format) == 1;
    for (int i = 0; i < np; i++)
        free(vals[i]);
    return ok;
}

/* How many of qs[0..n) go into one multi-row statement with qs[0] (1: alone). */
static unsigned multi_run(const struct store_pg *p, struct pg_query **qs, unsigned n)
{
    if (!multi_ok(p, qs[0]))
        return 1;
    unsigned k = 1;
    while (k < n && qs[k]->stmt == qs[0]->stmt && qs[k]->result_format == qs[0]->result_format && multi_ok(p, qs[k]) &&
           q_row_cmp(p, qs[k - 1], qs[k]) != 0)
        k++;
    for (int i = 0; k > 1 && i < qs[0]->nparams; i++) {
        while (k > 1 && multi_param_len(qs, k, i) == 0)
            k--;
    }
    return k;
}

static void conn_send_batch(struct pg_conn *c, struct pg_query **qs, unsigned n)
{
    struct store_pg *p = c->pool;
    for (unsigned i = 1; i < n; i++) { /* insertion sort: stable, n <= max_batch */
        struct pg_query *q = qs[i];
        unsigned j = i;
        for (; j > 0 && q_row_cmp(p, qs[j - 1], q) > 0; j--)
            qs[j] = qs[j - 1];
        qs[j] = q;
    }
    bool sent = true;
    unsigned ns = 0;
    for (unsigned i = 0; i < n && sent;) {
        unsigned k = multi_run(p, qs + i, n - i);
        if (k > 1) {
            sent = send_multi(c, qs + i, k);
        } else {
            const struct store_pg_stmt *st = &p->opts.stmts[qs[i]->stmt];
            sent = PQsendQueryPrepared(c->pg, st->name, qs[i]->nparams, (const char *const *)qs[i]->values,
                                       qs[i]->lengths, qs[i]->formats, qs[i]->result_format) == 1;
        }
        c->sfirst[ns] = i;
        c->sn[ns] = k;
        c->bres[ns] = NULL;
        ns++;
        const char *then = p->then_names[qs[i]->stmt];
        if (sent && then) { /* the companion: same parameters, same Sync (one transaction) */
            sent = PQsendQueryPrepared(c->pg, then, qs[i]->nparams, (const char *const *)qs[i]->values, qs[i]->lengths,
                                       qs[i]->formats, qs[i]->result_format) == 1;
            c->sfirst[ns] = i;
            c->sn[ns] = 0; /* no query of its own: its result goes with the statement before */
            c->bres[ns] = NULL;
            ns++;
        }
        i += k;
    }
    if (sent)
        sent = PQpipelineSync(c->pg) == 1;
    if (!sent) {
        /* The connection is broken and no Sync went out: nothing of the batch
         * committed. Put the queries back, first in line. */
        for (unsigned i = n; i-- > 0;) {
            qs[i]->where = Q_QUEUED;
            ql_push_head(&p->queue, qs[i]);
        }
        conn_dead(c, PQerrorMessage(c->pg));
        return;
    }
    int pid = PQbackendPID(c->pg);
    for (unsigned i = 0; i < n; i++) {
        c->batch[i] = qs[i];
        qs[i]->where = Q_RUNNING;
        qs[i]->conn = c;
        qs[i]->backend_pid = pid;
        evtimer_add(qs[i]->timer, p->rtimeout);
    }
    c->nbatch = n;
    c->nsent = ns;
    c->nread = 0;
    c->busy_since_ms = cm_now_ms();
    set_state(c, C_BUSY);
    c->flushing = true;
    (void)conn_flush(c);
}

/* Takes the next batch from the head of the queue: one query that is not
 * batchable, or up to want batchable ones. */
static unsigned take_batch(struct store_pg *p, struct pg_query **qs, size_t want)
{
    unsigned n = 0;
    while (p->queue.head && n < want) {
        struct pg_query *q = p->queue.head;
        bool batchable = p->opts.stmts[q->stmt].batch_key > 0 && !q->alone;
        if (n > 0 && !batchable)
            break;
        ql_remove(&p->queue, q);
        qs[n++] = q;
        if (!batchable)
            break;
    }
    return n;
}

/* Should the waiting queries rather wait for a connection busy with a batch
 * that was sent less than PG_HOLD_MS ago (and go together when it is back)
 * than take an idle one? Only while few wait: under load every connection
 * works. One round trip and one commit for many queries is what keeps
 * Postgres' CPU per request low when it is the bottleneck. */
static bool hold_back(const struct store_pg *p, uint64_t now)
{
    if (p->opts.max_batch <= 1 || !p->queue.head || p->queue.n >= PG_SPREAD_MIN ||
        p->opts.stmts[p->queue.head->stmt].batch_key == 0)
        return false;
    for (unsigned i = 0; i < p->opts.size; i++) {
        const struct pg_conn *c = &p->conns[i];
        if (c->state == C_BUSY && c->nbatch > 0 && now - c->busy_since_ms < PG_HOLD_MS)
            return true;
    }
    return false;
}

static void dispatch(struct store_pg *p)
{
    static const struct timeval hold_tv = {0, PG_HOLD_MS * 1000};
    unsigned size = p->opts.size;
    uint64_t now = cm_now_ms();
    if (hold_back(p, now)) { /* neither an idle connection nor a new one yet */
        if (!evtimer_pending(p->hold, NULL))
            evtimer_add(p->hold, &hold_tv);
        return;
    }
    for (unsigned i = 0; i < size && p->queue.head; i++) {
        struct pg_conn *c = &p->conns[i];
        if (c->state != C_READY)
            continue;
        /* Few waiting: one batch. Many: shared between the idle connections. */
        unsigned ready = 0;
        for (unsigned j = i; j < size; j++)
            ready += p->conns[j].state == C_READY;
        size_t want = p->queue.n < PG_SPREAD_MIN ? p->queue.n : (p->queue.n + ready - 1) / ready;
        if (want > p->opts.max_batch)
            want = p->opts.max_batch;
        struct pg_query *qs[PG_MAX_BATCH];
        unsigned n = take_batch(p, qs, want);
        conn_send_batch(c, qs, n);
    }
    if (!p->queue.head)
        return;
    /* Open more connections on demand, one per waiting query beyond those connecting. */
    size_t need = p->queue.n > p->n_connecting ? p->queue.n - p->n_connecting : 0;
    for (unsigned i = 0; i < size && need > 0 && p->queue.head; i++) {
        if (p->conns[i].state == C_DOWN) {
            conn_start(&p->conns[i]);
            need--;
        }
    }
}

static void hold_cb(evutil_socket_t fd, short what, void *arg)
{
    dispatch(arg);
}

static void query_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct pg_query *q = arg;
    struct store_pg *p = q->pool;
    (void)fd;
    (void)what;
    switch (q->where) {
    case Q_DEFERRED:
        ql_remove(&p->deferred, q);
        q->where = Q_NEW;
        q_finish(q, q->deferred_st, NULL, q->deferred_msg);
        return;
    case Q_QUEUED:
        ql_remove(&p->queue, q);
        q->where = Q_NEW;
        q_finish(q, STORE_PG_TIMEOUT, NULL, "postgres query timeout (waiting for a connection)");
        return;
    case Q_RUNNING: {
        /* The server may still be working on it: drop the connection (the
         * whole batch with it) and open a new one. The server process is
         * asked to cancel first: one waiting for a synchronous standby at
         * COMMIT would otherwise keep its locks and its connection slot until
         * a standby confirms (each timeout one more such process). */
        struct pg_conn *c = q->conn;
        bool cancelled = store_cancel_send(c->pg);
        cm_log(CM_WARN, "postgres_query_timeout", "conn=%u stmt=%s batch=%u cancel_sent=%d", c->idx,
               p->opts.stmts[q->stmt].name, c->nbatch, cancelled);
        mark_failing(p);
        batch_fail(c, STORE_PG_TIMEOUT, "postgres query timeout");
        conn_close(c);
        conn_start(c);
        dispatch(p);
        return;
    }
    case Q_NEW:
        return;
    }
}

struct store_pg *store_pg_create(struct event_base *base, const struct store_pg_opts *opts)
{
    struct store_pg *p = cm_calloc(1, sizeof *p);
    p->base = base;
    p->opts = *opts;
    if (p->opts.size == 0)
        p->opts.size = 1;
    p->conninfo = cm_strdup(opts->conninfo);
    p->init_sql =
        cm_asprintf("%s%s%s", PG_SESSION_SQL, opts->init_sql ? "; " : "", opts->init_sql ? opts->init_sql : "");
    p->opts.init_sql = p->init_sql;
    atomic_init(&p->up, false);
    atomic_init(&p->ok_ms, 0);
    atomic_init(&p->failing, true);
    p->qtv.tv_sec = (time_t)(opts->queue_timeout_ms / 1000);
    p->qtv.tv_usec = (suseconds_t)((opts->queue_timeout_ms % 1000) * 1000);
    p->rtv.tv_sec = (time_t)(opts->run_timeout_ms / 1000);
    p->rtv.tv_usec = (suseconds_t)((opts->run_timeout_ms % 1000) * 1000);
    /* Every query shares these timeouts: libevent keeps them in O(1) queues. */
    p->qtimeout = event_base_init_common_timeout(base, &p->qtv);
    if (!p->qtimeout)
        p->qtimeout = &p->qtv;
    p->rtimeout = event_base_init_common_timeout(base, &p->rtv);
    if (!p->rtimeout)
        p->rtimeout = &p->rtv;
    if (p->opts.max_batch == 0)
        p->opts.max_batch = 1;
    if (p->opts.max_batch > PG_MAX_BATCH)
        p->opts.max_batch = PG_MAX_BATCH;
    p->multi_names = cm_calloc(p->opts.nstmts ? p->opts.nstmts : 1, sizeof *p->multi_names);
    for (size_t i = 0; i < p->opts.nstmts; i++) {
        const struct store_pg_stmt *st = &p->opts.stmts[i];
        if (st->multi_sql && st->batch_key > 0 && st->nparams <= PG_MULTI_MAX_PARAMS && p->opts.max_batch > 1) {
            size_t len = strlen(st->name) + 3;
            p->multi_names[i] = cm_malloc(len);
            snprintf(p->multi_names[i], len, "%s_m", st->name);
        }
    }
    p->then_names = cm_calloc(p->opts.nstmts ? p->opts.nstmts : 1, sizeof *p->then_names);
    for (size_t i = 0; i < p->opts.nstmts; i++) {
        const struct store_pg_stmt *st = &p->opts.stmts[i];
        if (st->then_sql) {
            size_t len = strlen(st->name) + 3;
            p->then_names[i] = cm_malloc(len);
            snprintf(p->then_names[i], len, "%s_t", st->name);
        }
    }
    setup_plan(p);
    p->hold = evtimer_new(base, hold_cb, p);
    if (!p->hold)
        abort();
    p->conns = cm_calloc(p->opts.size, sizeof *p->conns);
    for (unsigned i = 0; i < p->opts.size; i++) {
        struct pg_conn *c = &p->conns[i];
        c->pool = p;
        c->idx = i;
        c->state = C_DOWN;
        c->io = cm_calloc(1, event_get_struct_event_size());
        c->batch = cm_calloc(p->opts.max_batch, sizeof *c->batch);
        /* statements: one per query, two for a query with a companion */
        c->bres = cm_calloc(2 * p->opts.max_batch, sizeof *c->bres);
        c->sfirst = cm_calloc(2 * p->opts.max_batch, sizeof *c->sfirst);
        c->sn = cm_calloc(2 * p->opts.max_batch, sizeof *c->sn);
        c->timer = evtimer_new(base, conn_timer_cb, c);
        if (!c->timer)
            abort();
        c->backoff_ms = BACKOFF_MIN_MS;
    }
    p->wake = event_new(base, -1, 0, pg_wake_cb, p);
    if (!p->wake)
        abort();
    pthread_mutex_lock(&pools_lock);
    p->next_pool = pools;
    pools = p;
    pthread_mutex_unlock(&pools_lock);
    cm_metric_postgres_up(false);
    conn_start(&p->conns[0]);
    return p;
}

void store_pg_destroy(struct store_pg *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&pools_lock);
    for (struct store_pg **pp = &pools; *pp; pp = &(*pp)->next_pool)
        if (*pp == p) {
            *pp = p->next_pool;
            break;
        }
    pthread_mutex_unlock(&pools_lock);
    event_free(p->wake);
    for (unsigned i = 0; i < p->opts.size; i++) {
        struct pg_conn *c = &p->conns[i];
        for (unsigned j = 0; j < c->nbatch; j++) {
            q_free(c->batch[j]);
            c->batch[j] = NULL;
        }
        c->nbatch = 0;
        conn_close(c);
        event_free(c->timer);
        free(c->io);
        free(c->batch);
        free(c->bres);
        free(c->sfirst);
        free(c->sn);
    }
    struct pg_query *q;
    while ((q = p->queue.head) != NULL) {
        ql_remove(&p->queue, q);
        q_free(q);
    }
    while ((q = p->deferred.head) != NULL) {
        ql_remove(&p->deferred, q);
        q_free(q);
    }
    for (size_t i = 0; i < p->opts.nstmts; i++) {
        free(p->multi_names[i]);
        free(p->then_names[i]);
    }
    free(p->multi_names);
    free(p->then_names);
    for (size_t i = 0; i < p->nsteps; i++) {
        if (p->steps[i].check)
            free((char *)p->steps[i].sql);
    }
    free(p->steps);
    event_free(p->hold);
    free(p->conns);
    free(p->conninfo);
    free(p->init_sql);
    free(p);
}

void store_pg_query(struct store_pg *p, size_t stmt, const struct store_pg_param *params, int nparams,
                    int result_format, store_pg_cb cb, void *arg)
{
    /* One allocation: the query, its timer's storage, the three parameter arrays, then each value's bytes with a
     * NUL (the text format's terminator). */
    size_t np = nparams > 0 ? (size_t)nparams : 0;
    size_t off_ev = CM_ROUND16(sizeof(struct pg_query));
    size_t off_vals = off_ev + CM_ROUND16(event_get_struct_event_size());
    size_t off_ints = off_vals + np * sizeof(char *);
    size_t off_bytes = off_ints + 2 * np * sizeof(int);
    size_t total = off_bytes;
    for (size_t i = 0; i < np; i++) {
        if (params[i].data && params[i].len > SIZE_MAX / 2 - total)
            abort(); /* no parameter comes near: they are bounded by the request's limits */
        total += params[i].data ? params[i].len + 1 : 0;
    }
    char *blk = cm_calloc(1, total);
    struct pg_query *q = (struct pg_query *)blk;
    q->pool = p;
    q->stmt = stmt;
    q->nparams = nparams;
    q->result_format = result_format;
    q->cb = cb;
    q->arg = arg;
    q->start_ms = cm_now_ms();
    q->timer = (struct event *)(blk + off_ev);
    if (evtimer_assign(q->timer, p->base, query_timer_cb, q) != 0)
        abort();
    if (np > 0) {
        q->values = (char **)(blk + off_vals);
        q->lengths = (int *)(blk + off_ints);
        q->formats = q->lengths + np;
        char *bytes = blk + off_bytes;
        for (size_t i = 0; i < np; i++) {
            q->formats[i] = params[i].binary ? 1 : 0;
            if (!params[i].data)
                continue;
            q->values[i] = bytes;
            memcpy(bytes, params[i].data, params[i].len);
            bytes[params[i].len] = '\0';
            bytes += params[i].len + 1;
            q->lengths[i] = (int)params[i].len;
        }
    }
    if (stmt >= p->opts.nstmts) {
        q_defer_fail(p, q, STORE_PG_SQL_ERROR, "no such statement");
        return;
    }
    if (p->n_up == 0 && p->last_failed && !pg_kick(p)) {
        q_defer_fail(p, q, STORE_PG_UNAVAILABLE, "postgres unavailable");
        return;
    }
    if (p->queue.n >= p->opts.max_queue) {
        q_defer_fail(p, q, STORE_PG_OVERLOAD, "postgres queue full");
        return;
    }
    q->where = Q_QUEUED;
    ql_push_tail(&p->queue, q);
    evtimer_add(q->timer, p->qtimeout);
    dispatch(p);
}

bool store_pg_healthy(const struct store_pg *p, uint64_t max_age_ms)
{
    struct store_pg *m = (struct store_pg *)p;
    if (!p || atomic_load(&m->failing))
        return false;
    uint64_t ok = atomic_load(&m->ok_ms);
    return ok > 0 && cm_now_ms() - ok <= max_age_ms;
}

uint64_t store_pg_last_ok_ms(const struct store_pg *p)
{
    return p ? atomic_load(&((struct store_pg *)p)->ok_ms) : 0;
}

const PGresult *store_pg_cb_then(const struct store_pg *p)
{
    return p ? p->cb_then : NULL;
}

int store_pg_cb_backend_pid(const struct store_pg *p)
{
    return p ? p->cb_pid : 0;
}

void store_pg_on_up(struct store_pg *p, void (*cb)(void *arg), void *arg)
{
    p->on_up = cb;
    p->on_up_arg = arg;
}

bool store_pg_up(const struct store_pg *p)
{
    return p && atomic_load(&((struct store_pg *)p)->up);
}
