/* redis.c - hiredis 0.14 async client on libevent: per-command timers (the
 * async API has none), AUTH/SELECT (or PING) on connect, reconnect with backoff from a
 * timer (never from hiredis callbacks), drop the link after repeated timeouts. Never what a reply means (store.c
 * decides). */
#include "store/redis.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <event2/event.h>
#include <hiredis/adapters/libevent.h>
#include <hiredis/async.h>
#include <hiredis/hiredis.h>

#include "common/metrics.h"
#include "conf/conf.h"

#define BACKOFF_MIN_MS         100
#define BACKOFF_MAX_MS         2000
#define MAX_TIMEOUTS_IN_A_ROW  5
#define CONNECT_TIMEOUT_MIN_MS 1000

enum rd_state {
    R_BACKOFF,    /* waiting for the reconnect timer */
    R_CONNECTING, /* TCP connect and AUTH/SELECT in progress */
    R_UP,         /* ready for commands */
};

struct store_rd {
    struct event_base *base;
    char *host; /* NULL: unix_path */
    int port;
    char *unix_path; /* NULL: host and port */
    char *pass;
    long db; /* -1: no SELECT */
    char *url_redacted;
    struct timeval cmd_tv;
    const struct timeval *cmd_timeout;
    uint64_t connect_timeout_ms;
    redisAsyncContext *ac;
    enum rd_state state;
    int setup_pending;
    struct event *timer; /* reconnect backoff, or connect timeout */
    uint64_t backoff_ms;
    unsigned timeouts_in_a_row;
    bool destroying;
    bool reported;
    bool reported_up;
    atomic_bool up;
};

struct rd_cmd {
    struct store_rd *r;
    store_rd_cb cb;
    void *arg;
    struct event *timer; /* storage after the struct, same allocation; NULL for setup commands (the connect timer
                          * covers them) */
    uint64_t start_ms;
    bool done; /* the caller has been answered (timeout) */
    bool setup;
};

static void rd_connect(struct store_rd *r);

/* why: the reason of a transition to down, for its log line. */
static void set_up(struct store_rd *r, bool v, const char *why)
{
    atomic_store(&r->up, v);
    cm_metric_redis_up(v);
    if (!r->reported || v != r->reported_up) {
        char err[256];
        if (v)
            cm_log(CM_INFO, "redis_up", "url=%s", r->url_redacted);
        else
            cm_log(CM_WARN, "redis_down", "url=%s error=%s", r->url_redacted,
                   cm_log_quote(err, sizeof err, why ? why : "?"));
        r->reported_up = v;
        r->reported = true;
    }
}

static void schedule_reconnect(struct store_rd *r, const char *why)
{
    if (r->destroying)
        return;
    uint64_t ms = r->backoff_ms;
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    r->state = R_BACKOFF;
    evtimer_del(r->timer);
    evtimer_add(r->timer, &tv);
    r->backoff_ms = r->backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : r->backoff_ms * 2;
    set_up(r, false, why);
}

/* Frees the live context from outside any hiredis callback; pending commands
 * get reply == NULL. */
static void rd_drop(struct store_rd *r, const char *why)
{
    redisAsyncContext *ac = r->ac;
    cm_log(CM_WARN, "redis_reset", "url=%s reason=%s", r->url_redacted, why);
    r->ac = NULL;
    r->state = R_BACKOFF;
    if (ac)
        redisAsyncFree(ac);
    schedule_reconnect(r, why);
}

static void rd_ready(struct store_rd *r)
{
    evtimer_del(r->timer);
    r->state = R_UP;
    r->timeouts_in_a_row = 0;
    set_up(r, true, NULL);
}

static void cmd_free(struct rd_cmd *cmd)
{
    if (cmd->timer)
        event_del(cmd->timer);
    free(cmd);
}

static void setup_reply(struct store_rd *r, redisAsyncContext *ac, const redisReply *rep)
{
    if (ac != r->ac || r->state != R_CONNECTING)
        return; /* a context we already dropped */
    if (!rep || rep->type == REDIS_REPLY_ERROR) {
        char msg[256];
        cm_log(CM_ERROR, "redis_setup_failed", "url=%s error=%s", r->url_redacted,
               cm_log_quote(msg, sizeof msg, rep && rep->str ? rep->str : "no reply"));
        /* Inside a hiredis callback: let hiredis close it; the disconnect
         * callback schedules the reconnect. */
        redisAsyncDisconnect(ac);
        return;
    }
    if (--r->setup_pending == 0)
        rd_ready(r);
}

static void reply_cb(redisAsyncContext *ac, void *reply, void *privdata)
{
    struct rd_cmd *cmd = privdata;
    struct store_rd *r = cmd->r;
    const redisReply *rep = reply;
    if (r->destroying) {
        cmd_free(cmd);
        return;
    }
    if (cmd->setup) {
        setup_reply(r, ac, rep);
        cmd_free(cmd);
        return;
    }
    if (rep) {
        r->timeouts_in_a_row = 0;
        r->backoff_ms = BACKOFF_MIN_MS;
    }
    if (!cmd->done) {
        cmd->done = true;
        evtimer_del(cmd->timer);
        cm_metric_store_seconds(CM_STORE_REDIS, (double)(cm_now_ms() - cmd->start_ms) / 1000.0);
        bool failed = !rep || rep->type == REDIS_REPLY_ERROR;
        if (failed)
            cm_metric_store_error(CM_STORE_REDIS);
        if (cmd->cb)
            cmd->cb(cmd->arg, failed ? NULL : rep);
    }
    cmd_free(cmd);
}

static void cmd_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct rd_cmd *cmd = arg;
    struct store_rd *r = cmd->r;
    (void)fd;
    (void)what;
    if (cmd->done)
        return;
    /* Answer the caller now; the command stays queued in hiredis until its
     * reply (or the context's end) frees it. */
    cmd->done = true;
    cm_metric_store_seconds(CM_STORE_REDIS, (double)(cm_now_ms() - cmd->start_ms) / 1000.0);
    cm_metric_store_error(CM_STORE_REDIS);
    if (cmd->cb)
        cmd->cb(cmd->arg, NULL);
    /* cmd may be freed from here on (rd_drop frees the context). */
    if (++r->timeouts_in_a_row >= MAX_TIMEOUTS_IN_A_ROW && r->state == R_UP && r->ac)
        rd_drop(r, "timeouts");
}

static void connect_cb(const redisAsyncContext *ac, int status)
{
    struct store_rd *r = ac->data;
    if (r->destroying || ac != r->ac)
        return;
    if (status != REDIS_OK) {
        char msg[256];
        cm_log(CM_DEBUG, "redis_connect_failed", "url=%s error=%s", r->url_redacted,
               cm_log_quote(msg, sizeof msg, ac->errstr ? ac->errstr : "?"));
        /* hiredis frees this context after we return. */
        r->ac = NULL;
        schedule_reconnect(r, ac->errstr ? ac->errstr : "connect failed");
        return;
    }
    if (r->setup_pending == 0)
        rd_ready(r);
}

static void disconnect_cb(const redisAsyncContext *ac, int status)
{
    struct store_rd *r = ac->data;
    if (r->destroying || ac != r->ac)
        return;
    char msg[256];
    cm_log(CM_WARN, "redis_disconnected", "url=%s error=%s", r->url_redacted,
           cm_log_quote(msg, sizeof msg, status == REDIS_OK ? "closed" : (ac->errstr ? ac->errstr : "?")));
    /* hiredis frees this context after we return. */
    r->ac = NULL;
    schedule_reconnect(r, status == REDIS_OK ? "closed" : (ac->errstr ? ac->errstr : "disconnected"));
}

static bool send_setup(struct store_rd *r, int argc, const char **argv)
{
    struct rd_cmd *cmd = cm_calloc(1, sizeof *cmd);
    cmd->r = r;
    cmd->setup = true;
    if (redisAsyncCommandArgv(r->ac, reply_cb, cmd, argc, argv, NULL) != REDIS_OK) {
        cmd_free(cmd);
        return false;
    }
    r->setup_pending++;
    return true;
}

static void rd_connect(struct store_rd *r)
{
    redisAsyncContext *ac =
        r->unix_path != NULL ? redisAsyncConnectUnix(r->unix_path) : redisAsyncConnect(r->host, r->port);
    if (!ac || ac->err) {
        char msg[256];
        cm_log(CM_DEBUG, "redis_connect_failed", "url=%s error=%s", r->url_redacted,
               cm_log_quote(msg, sizeof msg, ac && ac->errstr ? ac->errstr : "out of memory"));
        schedule_reconnect(r, ac && ac->errstr ? ac->errstr : "connect failed");
        if (ac)
            redisAsyncFree(ac);
        return;
    }
    ac->data = r;
    if (redisLibeventAttach(ac, r->base) != REDIS_OK) {
        redisAsyncFree(ac);
        schedule_reconnect(r, "cannot attach to the event loop");
        return;
    }
    redisAsyncSetConnectCallback(ac, connect_cb);
    redisAsyncSetDisconnectCallback(ac, disconnect_cb);
    r->ac = ac;
    r->state = R_CONNECTING;
    r->setup_pending = 0;
    bool ok = true;
    if (r->pass) {
        const char *argv[2] = {"AUTH", r->pass};
        ok = send_setup(r, 2, argv);
    }
    if (ok && r->db > 0) {
        char db[24];
        snprintf(db, sizeof db, "%ld", r->db);
        const char *argv[2] = {"SELECT", db};
        ok = send_setup(r, 2, argv);
    }
    if (ok && r->setup_pending == 0) { /* up only once the server answered: a TCP handshake is not an answer */
        const char *argv[1] = {"PING"};
        ok = send_setup(r, 1, argv);
    }
    if (!ok) {
        rd_drop(r, "setup");
        return;
    }
    uint64_t ms = r->connect_timeout_ms;
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    evtimer_del(r->timer);
    evtimer_add(r->timer, &tv);
}

static void rd_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct store_rd *r = arg;
    (void)fd;
    (void)what;
    if (r->state == R_BACKOFF)
        rd_connect(r);
    else if (r->state == R_CONNECTING)
        rd_drop(r, "connect timeout");
}

struct store_rd *store_rd_create(struct event_base *base, const struct conf_redis *cfg, const char *url,
                                 uint64_t timeout_ms, char **err)
{
    struct store_rd *r = cm_calloc(1, sizeof *r);
    r->base = base;
    if (cfg == NULL || (cfg->host == NULL) == (cfg->unix_path == NULL)) {
        *err = cm_strdup("redis: neither a host nor a unix socket path");
        goto fail;
    }
    r->host = cfg->host != NULL ? cm_strdup(cfg->host) : NULL;
    r->port = cfg->port;
    r->unix_path = cfg->unix_path != NULL ? cm_strdup(cfg->unix_path) : NULL;
    r->pass = cfg->password != NULL ? cm_strdup(cfg->password) : NULL;
    r->db = cfg->db > 0 ? (long)cfg->db : -1;
    char red[512];
    r->url_redacted = cm_strdup(cm_redact_url(red, sizeof red, url));
    if (timeout_ms == 0)
        timeout_ms = 50;
    r->cmd_tv.tv_sec = (time_t)(timeout_ms / 1000);
    r->cmd_tv.tv_usec = (suseconds_t)((timeout_ms % 1000) * 1000);
    r->cmd_timeout = event_base_init_common_timeout(base, &r->cmd_tv);
    if (!r->cmd_timeout)
        r->cmd_timeout = &r->cmd_tv;
    r->connect_timeout_ms = timeout_ms * 4 > CONNECT_TIMEOUT_MIN_MS ? timeout_ms * 4 : CONNECT_TIMEOUT_MIN_MS;
    r->backoff_ms = BACKOFF_MIN_MS;
    r->timer = evtimer_new(base, rd_timer_cb, r);
    if (!r->timer) {
        *err = cm_strdup("cannot create the redis timer");
        goto fail;
    }
    atomic_init(&r->up, false);
    cm_metric_redis_up(false);
    rd_connect(r);
    return r;
fail:
    if (r->timer)
        event_free(r->timer);
    free(r->host);
    free(r->unix_path);
    free(r->pass);
    free(r->url_redacted);
    free(r);
    return NULL;
}

void store_rd_destroy(struct store_rd *r)
{
    if (!r)
        return;
    r->destroying = true;
    evtimer_del(r->timer);
    if (r->ac) {
        redisAsyncContext *ac = r->ac;
        r->ac = NULL;
        redisAsyncFree(ac); /* pending commands come back with NULL: freed, not answered */
    }
    event_free(r->timer);
    free(r->host);
    free(r->unix_path);
    free(r->pass);
    free(r->url_redacted);
    free(r);
}

bool store_rd_command(struct store_rd *r, store_rd_cb cb, void *arg, int argc, const char **argv, const size_t *argvlen)
{
    if (!r || r->state != R_UP || !r->ac || r->destroying)
        return false;
    size_t off_ev = CM_ROUND16(sizeof(struct rd_cmd)); /* the timer's storage follows: one allocation */
    struct rd_cmd *cmd = cm_calloc(1, off_ev + event_get_struct_event_size());
    cmd->r = r;
    cmd->cb = cb;
    cmd->arg = arg;
    cmd->start_ms = cm_now_ms();
    cmd->timer = (struct event *)((char *)cmd + off_ev);
    if (evtimer_assign(cmd->timer, r->base, cmd_timer_cb, cmd) != 0)
        abort();
    if (redisAsyncCommandArgv(r->ac, reply_cb, cmd, argc, argv, argvlen) != REDIS_OK) {
        cmd_free(cmd);
        return false;
    }
    evtimer_add(cmd->timer, r->cmd_timeout);
    return true;
}

bool store_rd_up(const struct store_rd *r)
{
    return r && atomic_load(&((struct store_rd *)r)->up);
}
