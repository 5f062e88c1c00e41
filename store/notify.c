/* notify.c - the purge listener: LISTEN on one non-blocking libpq connection, pinged, reconnected with backoff. Never
 * the claim path. */
#include "store/notify.h"

#include <event2/event.h>
#include <libpq-fe.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "store/pg.h"

#define PING_EVERY_MS      200
#define PING_DEADLINE_MS   500  /* a ping unanswered this long: late (LATE reported, the connection kept) */
#define PING_GIVEUP_MS     3000 /* unanswered this long: the connection counts as lost */
#define CONNECT_TIMEOUT_MS 3000
#define BACKOFF_FIRST_MS   100
#define BACKOFF_MAX_MS     2000

enum nstate { N_IDLE, N_CONNECTING, N_LISTENING, N_UP };

struct store_notify {
    struct event_base *base;
    char *url;
    store_notify_cb cb;
    void *arg;
    PGconn *pg;
    struct event *io; /* NULL while no socket is watched */
    struct event *timer;
    enum nstate state;
    uint64_t backoff_ms;
    uint64_t ping_sent_ms; /* N_UP: when the ping now out was sent (0: none out) */
    bool ping_result;      /* N_UP: the ping's result came, libpq has not yet ended its command */
    bool late;             /* N_UP: LATE was reported; UP again after a ping sent after the late one's answer */
    bool confirming;       /* late, and the ping out is that one */
};

static void io_cb(evutil_socket_t fd, short what, void *arg);
static void connect_start(struct store_notify *n);

static void arm(struct store_notify *n, uint64_t ms)
{
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    evtimer_add(n->timer, &tv);
}

static void unwatch(struct store_notify *n)
{
    if (n->io) {
        event_free(n->io);
        n->io = NULL;
    }
}

static void watch(struct store_notify *n, short what)
{
    unwatch(n);
    int fd = PQsocket(n->pg);
    if (fd < 0)
        return;
    n->io = event_new(n->base, fd, what | EV_PERSIST, io_cb, n);
    event_add(n->io, NULL);
}

static void ping_reset(struct store_notify *n)
{
    n->ping_sent_ms = 0;
    n->ping_result = n->late = n->confirming = false;
}

/* Drops the connection; reports DOWN when it was up, and reconnects after the backoff. */
static void lost(struct store_notify *n, const char *why)
{
    bool was_up = n->state == N_UP;
    char q[256];
    cm_log_quote(q, sizeof q, why ? why : ""); /* why may be PQerrorMessage: read it before PQfinish frees it */
    unwatch(n);
    if (n->pg) {
        PQfinish(n->pg);
        n->pg = NULL;
    }
    n->state = N_IDLE;
    ping_reset(n);
    cm_log(was_up ? CM_WARN : CM_INFO, "cache_listener_down", "detail=%s retry_ms=%llu", q,
           (unsigned long long)n->backoff_ms);
    if (was_up)
        n->cb(n->arg, STORE_NOTIFY_DOWN, NULL, 0);
    arm(n, n->backoff_ms);
    n->backoff_ms = n->backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : n->backoff_ms * 2;
}

/* Sends what libpq holds; watches for writability while it cannot. false: the connection broke. */
static bool flush(struct store_notify *n)
{
    int r = PQflush(n->pg);
    if (r < 0)
        return false;
    watch(n, r == 1 ? EV_READ | EV_WRITE : EV_READ);
    return true;
}

static void send_cmd(struct store_notify *n, const char *sql)
{
    if (!PQsendQuery(n->pg, sql) || !flush(n))
        lost(n, PQerrorMessage(n->pg));
}

static void send_ping(struct store_notify *n)
{
    n->ping_sent_ms = cm_now_ms();
    send_cmd(n, "SELECT 1");
}

/* The ping out came back. After a late one, another ping is sent: the server process reads it only after it
 * sent every notification pending when it read it (it delivers them while it waits for its next command), so
 * once that one is answered too, every purge committed before it was sent has been heard of. */
static void pong(struct store_notify *n)
{
    n->ping_sent_ms = 0;
    if (!n->late)
        return;
    if (!n->confirming) {
        n->confirming = true;
        send_ping(n);
        return;
    }
    n->late = n->confirming = false;
    cm_log(CM_INFO, "cache_listener_back", "channel=%s", STORE_NOTIFY_CHANNEL);
    n->cb(n->arg, STORE_NOTIFY_UP, NULL, 0);
}

/* Reads what arrived: results (the LISTEN's, the pings') and notifications. */
static void consume(struct store_notify *n)
{
    if (!PQconsumeInput(n->pg)) {
        lost(n, PQerrorMessage(n->pg));
        return;
    }
    bool answered = false; /* the ping's command ended: libpq takes the next one */
    while (!PQisBusy(n->pg)) {
        PGresult *r = PQgetResult(n->pg);
        if (!r) {
            answered = n->state == N_UP && n->ping_result;
            n->ping_result = false;
            break;
        }
        ExecStatusType st = PQresultStatus(r);
        if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
            PQclear(r);
            lost(n, PQerrorMessage(n->pg));
            return;
        }
        /* The LISTENs' results come first; the epoch's read, last, ends the command that makes the listener up. */
        bool epoch_read = n->state == N_LISTENING && st == PGRES_TUPLES_OK;
        if (epoch_read && PQntuples(r) == 1 && PQnfields(r) == 1 && !PQgetisnull(r, 0, 0))
            n->cb(n->arg, STORE_NOTIFY_EPOCH, PQgetvalue(r, 0, 0), (size_t)PQgetlength(r, 0, 0));
        PQclear(r);
        if (n->state == N_LISTENING && !epoch_read)
            continue;
        if (n->state == N_LISTENING) {
            n->state = N_UP;
            n->backoff_ms = BACKOFF_FIRST_MS;
            ping_reset(n);
            cm_log(CM_INFO, "cache_listener_up", "channel=%s", STORE_NOTIFY_CHANNEL);
            n->cb(n->arg, STORE_NOTIFY_UP, NULL, 0);
            evtimer_del(n->timer);
            arm(n, PING_EVERY_MS);
        } else if (n->state == N_UP) {
            n->ping_result = true;
        }
    }
    PGnotify *msg;
    while (n->pg && (msg = PQnotifies(n->pg)) != NULL) {
        if (n->state == N_UP && strcmp(msg->relname, STORE_NOTIFY_CHANNEL) == 0)
            n->cb(n->arg, STORE_NOTIFY_MESSAGE, msg->extra, strlen(msg->extra));
        else if (strcmp(msg->relname, STORE_NOTIFY_EPOCH_CHANNEL) == 0) /* an epoch is committed: never too early */
            n->cb(n->arg, STORE_NOTIFY_EPOCH, msg->extra, strlen(msg->extra));
        PQfreemem(msg);
    }
    if (answered) /* after the notifications that came with it */
        pong(n);
}

static void connect_poll(struct store_notify *n)
{
    unwatch(n); /* PQconnectPoll may change the socket */
    switch (PQconnectPoll(n->pg)) {
    case PGRES_POLLING_READING:
        watch(n, EV_READ);
        return;
    case PGRES_POLLING_WRITING:
        watch(n, EV_WRITE);
        return;
    case PGRES_POLLING_OK:
        if (PQsetnonblocking(n->pg, 1) != 0) {
            lost(n, PQerrorMessage(n->pg));
            return;
        }
        n->state = N_LISTENING;
        /* LISTEN first, then the epoch: a purge committed in between is heard of either way. */
        send_cmd(n, "LISTEN " STORE_NOTIFY_CHANNEL "; LISTEN " STORE_NOTIFY_EPOCH_CHANNEL
                    "; SELECT epoch::text FROM idemgate_epoch WHERE id = 1");
        return;
    case PGRES_POLLING_FAILED:
    default:
        lost(n, PQerrorMessage(n->pg));
        return;
    }
}

static void io_cb(evutil_socket_t fd, short what, void *arg)
{
    struct store_notify *n = arg;
    if (n->state == N_CONNECTING) {
        connect_poll(n);
        return;
    }
    if (what & EV_WRITE) {
        if (!flush(n)) {
            lost(n, PQerrorMessage(n->pg));
            return;
        }
    }
    if (what & EV_READ)
        consume(n);
}

static void timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct store_notify *n = arg;
    uint64_t now = cm_now_ms();
    switch (n->state) {
    case N_IDLE:
        connect_start(n);
        return;
    case N_CONNECTING:
    case N_LISTENING:
        lost(n, "connect timeout");
        return;
    case N_UP:
        if (n->ping_sent_ms) {
            uint64_t waited = now - n->ping_sent_ms;
            if (waited >= PING_GIVEUP_MS) {
                lost(n, "ping unanswered");
                return;
            }
            if (waited >= PING_DEADLINE_MS && !n->late) {
                /* Slow, not gone: a notification on a live session is never dropped, only late. The cache stops
                 * answering (it might not have heard of a purge yet) and keeps its entries. */
                n->late = true;
                cm_log(CM_WARN, "cache_listener_late", "waited_ms=%llu giveup_ms=%d", (unsigned long long)waited,
                       PING_GIVEUP_MS);
                n->cb(n->arg, STORE_NOTIFY_LATE, NULL, 0);
            }
        } else {
            send_ping(n);
            if (n->state != N_UP)
                return;
        }
        arm(n, PING_EVERY_MS);
        return;
    }
}

/* A server ending the session (FATAL on an idle connection) arrives as a notice. */
static void notice_cb(void *arg, const char *message)
{
    (void)arg;
    store_pg_log_notice("listen", message);
}

static void connect_start(struct store_notify *n)
{
    /* dbname last: what the URL says (application_name too) wins. */
    static const char *const kw[] = {"application_name", "dbname", NULL};
    const char *vals[] = {"idemgate-listen", n->url, NULL};
    n->pg = PQconnectStartParams(kw, vals, 1);
    if (!n->pg || PQstatus(n->pg) == CONNECTION_BAD) {
        lost(n, n->pg ? PQerrorMessage(n->pg) : "out of memory");
        return;
    }
    PQsetNoticeProcessor(n->pg, notice_cb, NULL);
    n->state = N_CONNECTING;
    arm(n, CONNECT_TIMEOUT_MS); /* covers the LISTEN's answer too */
    watch(n, EV_WRITE);
}

struct store_notify *store_notify_create(struct event_base *base, const char *postgres_url, store_notify_cb cb,
                                         void *arg)
{
    struct store_notify *n = cm_calloc(1, sizeof *n);
    n->base = base;
    n->url = cm_strdup(postgres_url);
    n->cb = cb;
    n->arg = arg;
    n->backoff_ms = BACKOFF_FIRST_MS;
    n->timer = evtimer_new(base, timer_cb, n);
    if (!n->timer) {
        free(n->url);
        free(n);
        return NULL;
    }
    n->state = N_IDLE;
    arm(n, 0); /* connect from the loop */
    return n;
}

void store_notify_destroy(struct store_notify *n)
{
    if (!n)
        return;
    unwatch(n);
    if (n->timer)
        event_free(n->timer);
    if (n->pg)
        PQfinish(n->pg);
    free(n->url);
    free(n);
}
