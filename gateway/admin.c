/* admin.c - the admin listener: health, readiness, Prometheus metrics and the
 * key endpoints (inspect, list, purge, release, settle) behind a bearer token. It never runs a request through the
 * pipeline: the key endpoints ask the store and the cache directly. */
#include <microhttpd.h>
#include <stdatomic.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "common/metrics.h"
#include "common/uri.h"
#include "gateway/admin.h"
#include "gateway/adminkeys.h"
#include "gateway/conntrack.h"
#include "gateway/idem.h"
#include "gateway/front.h"
#include "gateway/loop.h"
#include "gateway/cache.h"
#include "gateway/problem.h"
#include "gateway/reload.h"
#include "gateway/status.h"
#include "gateway/tls.h"
#include "store/store.h"

struct gw_admin {
    const struct conf *conf;
    struct gw_loop *loop;
    struct MHD_Daemon *d;
    uint16_t port;
    atomic_size_t jobs;
    struct gw_tls *tls;         /* admin.listen.tls; NULL: plain HTTP */
    atomic_bool draining;       /* SIGTERM: /readyz is 503 while in-flight requests finish */
    struct gw_conntrack *conns; /* the request-read and answer-write deadlines, as the front's */
};

#define PAGE_DEFAULT    100
#define PAGE_MAX        1000
#define SETTLE_BODY_MAX ((size_t)12 << 20) /* base64 of an 8 MiB answer, and its headers */

enum admin_op { OP_LIST, OP_PURGE, OP_RELEASE, OP_PAGE, OP_SETTLE };
static const char *const op_names[] = {"list", "purge", "release", "list", "settle"};

/* One admin request, from the URI log callback to its completion. */
struct admin_job {
    char *query;    /* the raw query as received (no '?'), "" when none */
    bool submitted; /* handed to the loop; the handler runs again once the store answered */
    struct gw_admin *a;
    struct MHD_Connection *conn;
    enum admin_op op;
    char *route;
    char key[GW_KEY_MAX + 1];
    size_t key_len;
    /* OP_PAGE */
    char state[16]; /* "" any */
    uint64_t older_than_ms;
    unsigned limit;
    char *cursor;
    /* OP_SETTLE: the body as it arrives, then the scope */
    bool reading;
    bool too_large;
    struct cm_buf body;
    uint8_t scope[32];
    int status;
    char *json;
    atomic_bool done;
};

static struct gw_conn *conn_of(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

static void conn_notify(void *cls, struct MHD_Connection *c, void **socket_ctx, enum MHD_ConnectionNotificationCode toe)
{
    struct gw_admin *a = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        *socket_ctx = gw_conntrack_add(a->conns, ci ? ci->connect_fd : -1);
    } else { /* before MHD closes the socket: the watchdog never sees a reused fd */
        gw_conntrack_remove(a->conns, *socket_ctx);
        *socket_ctx = NULL;
    }
}

static enum MHD_Result answer(struct MHD_Connection *c, unsigned status, const char *ctype, char *body, size_t len)
{
    struct gw_conn *t = conn_of(c);
    if (t) /* a client that does not read its answer is cut after client_timeout */
        gw_conn_answering(t);
    struct MHD_Response *r = MHD_create_response_from_buffer_with_free_callback(len, body, free);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (status == 401)
        MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer realm=\"idemgate-admin\"");
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result problem(struct MHD_Connection *c, unsigned status, const char *name, const char *title,
                               const char *detail)
{
    size_t len;
    char *json = gw_problem_json((int)status, name, title, detail, &len);
    return answer(c, status, GW_PROBLEM_CONTENT_TYPE, json, len);
}

static enum MHD_Result text(struct MHD_Connection *c, unsigned status, const char *ctype, const char *s)
{
    return answer(c, status, ctype, cm_strdup(s), strlen(s));
}

/* Loop thread: the store answered. */
static void admin_done(void *arg, int status, char *json)
{
    struct admin_job *j = arg;
    if (j->op == OP_PURGE || j->op == OP_RELEASE) /* whatever the answer: its commit may not have been seen */
        gw_cache_drop(gw_loop_cache(j->a->loop), j->route, j->key, j->key_len);
    char qr[256], qk[GW_KEY_MAX * 4 + 8]; /* every admin action: which, on what, its answer (never a scope) */
    cm_log(j->op == OP_LIST || j->op == OP_PAGE ? CM_DEBUG : CM_INFO, "admin_action",
           "action=%s route=%s%s%s status=%d", op_names[j->op], cm_log_quote(qr, sizeof qr, j->route),
           j->op == OP_PAGE ? "" : " key=", j->op == OP_PAGE ? "" : cm_log_quote(qk, sizeof qk, j->key), status);
    j->status = status;
    j->json = json;
    atomic_store(&j->done, true);
    MHD_resume_connection(j->conn);
}

static void admin_run(void *arg)
{
    struct admin_job *j = arg;
    struct store *st = gw_loop_store(j->a->loop);
    if (!gw_loop_schema_ready(j->a->loop)) {
        size_t len; /* a problem, as every other admin error (SPEC 9) */
        admin_done(j, 503,
                   gw_problem_json(503, "store-unavailable", "Store unavailable",
                                   "the idempotency store is not ready yet; nothing was done", &len));
        return;
    }
    const struct conf_route *route = NULL;
    const struct conf *cur = gw_loop_current(j->a->loop)->conf;
    for (size_t i = 0; i < cur->routes_n && !route; i++)
        if (strcmp(cur->routes[i].name, j->route) == 0)
            route = &cur->routes[i];
    if (!route && (j->op == OP_PAGE || j->op == OP_SETTLE)) {
        size_t len;
        admin_done(j, 404, gw_problem_json(404, "not-found", "Not found", "no route of this name", &len));
        return;
    }
    switch (j->op) {
    case OP_LIST:
        store_admin_list(st, j->route, j->key, j->key_len, admin_done, j);
        break;
    case OP_PAGE: {
        struct store_page_req q = {j->route, j->state[0] ? j->state : NULL, j->older_than_ms, j->limit, j->cursor};
        store_admin_page(st, &q, admin_done, j);
        break;
    }
    case OP_SETTLE: {
        struct cm_resp resp;
        const char *why =
            gw_settle_parse(j->body.data ? j->body.data : "", j->body.len, route->idem.max_response, &resp);
        if (why) {
            cm_resp_free(&resp);
            size_t len;
            admin_done(j, 400, gw_problem_json(400, "bad-request", "Bad request", why, &len));
            return;
        }
        struct store_id id = {.route = j->route, .key = j->key, .key_len = j->key_len};
        memcpy(id.scope, j->scope, 32);
        gw_settle_run(st, &id, &resp, route->idem.retention_ms, route->idem.lease_ms, cur->request_id_header,
                      admin_done, j);
        cm_resp_free(&resp);
        break;
    }
    case OP_PURGE:
        store_admin_purge(st, j->route, j->key, j->key_len, admin_done, j);
        break;
    default:
        store_admin_release(st, j->route, j->key, j->key_len, admin_done, j);
        break;
    }
}

static bool authorized(const struct gw_admin *a, struct MHD_Connection *c)
{
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncasecmp(h, "Bearer ", 7) != 0)
        return false;
    h += 7;
    while (*h == ' ')
        h++;
    return cm_consttime_eq(h, strlen(h), a->conf->admin_token, strlen(a->conf->admin_token));
}

/* SPEC 12: /admin/keys?key= takes the key as the route reads it: a key_from key from a body or the query is its text
 * (gw_key_text), a header's key is parsed as the header is (gw_key_parse). A route this configuration does not
 * know (removed by a reload) takes either. */
static bool admin_key(const struct conf *conf, const char *route, const char *key, char out[GW_KEY_MAX + 1],
                      size_t *len)
{
    for (size_t i = 0; i < conf->routes_n; i++) {
        const struct conf_route *r = &conf->routes[i];
        if (strcmp(r->name, route) != 0)
            continue;
        if (r->idem.key_from.header && r->idem.key_from.kind != CONF_PART_HEADER)
            return gw_key_text(key, strlen(key), out, len);
        return gw_key_parse(key, strlen(key), out, len);
    }
    return gw_key_parse(key, strlen(key), out, len) || gw_key_text(key, strlen(key), out, len);
}

/* The value of query parameter name, decoded (heap, caller frees), in *out (NULL when absent). Returns false
 * when any parameter of the query is not valid percent-encoding or decodes to a NUL, or name appears twice:
 * libmicrohttpd's own lookup decodes leniently and stops at a NUL ("abc%00X" would be "abc"). */
static bool query_value(const char *q, const char *name, char **out)
{
    *out = NULL;
    size_t qn = strlen(q);
    char *buf = cm_malloc(qn + 1);
    bool ok = true;
    for (const char *p = q; ok && *p;) {
        const char *amp = strchr(p, '&');
        size_t plen = amp ? (size_t)(amp - p) : strlen(p);
        const char *eq = memchr(p, '=', plen);
        size_t klen = eq ? (size_t)(eq - p) : plen;
        size_t dl;
        ok = cm_pct_decode(p, klen, true, buf, &dl);
        if (ok && eq) {
            bool mine = strcmp(buf, name) == 0;
            ok = cm_pct_decode(eq + 1, plen - klen - 1, true, buf, &dl);
            if (ok && mine) {
                ok = *out == NULL;
                if (ok)
                    *out = cm_strndup(buf, dl);
            }
        }
        p = amp ? amp + 1 : p + plen;
    }
    free(buf);
    if (!ok) {
        free(*out);
        *out = NULL;
    }
    return ok;
}

/* Hands j to the loop and suspends its connection until the store answered. */
static enum MHD_Result submit(struct gw_admin *a, struct MHD_Connection *c, struct admin_job *j)
{
    j->submitted = true;
    atomic_fetch_add(&a->jobs, 1);
    struct gw_conn *t = conn_of(c);
    if (t) /* the store has it: no deadline (the store's own timeouts bound it) */
        gw_conn_waiting(t);
    MHD_suspend_connection(c);
    gw_loop_submit(a->loop, admin_run, j);
    return MHD_YES;
}

/* The listing's parameters (state, older_than, limit, cursor) into j; NULL or what is wrong. */
static const char *page_params(struct admin_job *j)
{
    char *state = NULL, *older = NULL, *limit = NULL;
    const char *why = NULL;
    if (!query_value(j->query, "state", &state) || !query_value(j->query, "older_than", &older) ||
        !query_value(j->query, "limit", &limit) || !query_value(j->query, "cursor", &j->cursor)) {
        why = "a query parameter is repeated, holds a NUL, or is not valid percent-encoding";
        goto out;
    }
    if (state && strcmp(state, "in_flight") != 0 && strcmp(state, "unknown") != 0 && strcmp(state, "completed") != 0)
        why = "state is one of in_flight, unknown, completed";
    else if (older && !conf_parse_duration(older, &j->older_than_ms))
        why = "older_than is a duration (30s, 5m, 24h)";
    else if (j->cursor && !*j->cursor)
        why = "cursor is empty";
    if (why)
        goto out;
    snprintf(j->state, sizeof j->state, "%s", state ? state : "");
    j->limit = PAGE_DEFAULT;
    if (limit) {
        char *end = NULL;
        unsigned long n = limit[0] >= '0' && limit[0] <= '9' && strlen(limit) <= 4 ? strtoul(limit, &end, 10) : 0;
        if (!end || *end || n < 1 || n > PAGE_MAX)
            why = "limit is a number from 1 to 1000";
        j->limit = (unsigned)n;
    }
out:
    free(state);
    free(older);
    free(limit);
    return why;
}

/* 64 hex digits into out. */
static bool scope_hex(const char *s, uint8_t out[32])
{
    if (strlen(s) != 64)
        return false;
    for (int i = 0; i < 32; i++) {
        unsigned v = 0;
        for (int k = 0; k < 2; k++) {
            char ch = s[2 * i + k];
            int d = ch >= '0' && ch <= '9'   ? ch - '0'
                    : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
                    : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10
                                             : -1;
            if (d < 0)
                return false;
            v = v << 4 | (unsigned)d;
        }
        out[i] = (uint8_t)v;
    }
    return true;
}

static enum MHD_Result keys_endpoint(struct gw_admin *a, struct MHD_Connection *c, const char *url, const char *method,
                                     struct admin_job *j)
{
    if (!a->conf->admin_token)
        return problem(c, 404, "not-found", "Not found",
                       "admin key endpoints are disabled: IDEMGATE_ADMIN_TOKEN is unset");
    if (!authorized(a, c))
        return problem(c, 401, "unauthorized", "Unauthorized", "a valid bearer token is required");
    enum admin_op op;
    bool keys = strcmp(url, "/admin/keys") == 0, release = strcmp(url, "/admin/keys/release") == 0,
         settle = strcmp(url, "/admin/keys/settle") == 0;
    if (keys && strcmp(method, "GET") == 0)
        op = OP_LIST;
    else if (keys && strcmp(method, "DELETE") == 0)
        op = OP_PURGE;
    else if (release && strcmp(method, "POST") == 0)
        op = OP_RELEASE;
    else if (settle && strcmp(method, "POST") == 0)
        op = OP_SETTLE;
    else if (keys || release || settle)
        return problem(c, 405, "method-not-allowed", "Method not allowed", "see the admin API in the README");
    else
        return problem(c, 404, "not-found", "Not found", "no such admin endpoint");
    char *route = NULL, *key = NULL, *scope = NULL;
    if (!query_value(j->query, "route", &route) || !query_value(j->query, "key", &key) ||
        !query_value(j->query, "scope", &scope)) {
        free(route);
        free(key);
        return problem(c, 400, "bad-request", "Bad request",
                       "a query parameter is repeated, holds a NUL, or is not valid percent-encoding");
    }
    j->route = route;
    if (op == OP_LIST && !key && route && *route) { /* a page of the route's records */
        free(scope);
        const char *why = page_params(j);
        if (why)
            return problem(c, 400, "bad-request", "Bad request", why);
        j->a = a;
        j->conn = c;
        j->op = OP_PAGE;
        return submit(a, c, j);
    }
    bool scope_ok = op != OP_SETTLE || (scope && scope_hex(scope, j->scope));
    free(scope);
    if (!route || !*route || !key || !scope_ok) {
        free(key);
        return problem(c, 400, "bad-request", "Bad request",
                       op == OP_SETTLE ? "route, key and scope (64 hex digits, as listed) query parameters are required"
                                       : "route and key query parameters are required");
    }
    bool key_ok = admin_key(a->conf, route, key, j->key, &j->key_len);
    free(key);
    if (!key_ok)
        return problem(c, 400, "idempotency-key-invalid", "Idempotency key invalid", "the key is not a valid key");
    j->a = a;
    j->conn = c;
    j->op = op;
    if (op == OP_SETTLE) { /* the body comes next (handler) */
        j->reading = true;
        cm_buf_init(&j->body, SETTLE_BODY_MAX);
        return MHD_YES;
    }
    return submit(a, c, j);
}

/* The status page's data: the metrics registry's counts and the store states /readyz reports. */
static enum MHD_Result status_json(struct gw_admin *a, struct MHD_Connection *c)
{
    struct store *st = gw_loop_store(a->loop);
    bool pg = gw_loop_postgres_ready(a->loop); /* what /readyz says */
    const char *redis = !store_redis_enabled(st) ? "disabled" : store_redis_up(st) ? "up" : "down";
    struct cm_buf out;
    cm_buf_init(&out, 4 * 1024 * 1024);
    if (!cm_metrics_status_json(&out, pg ? "up" : "down", redis)) {
        cm_buf_free(&out);
        return problem(c, 500, "internal-error", "Internal error", "status too large");
    }
    size_t len;
    char *body = cm_buf_take(&out, &len);
    return answer(c, 200, "application/json", body ? body : cm_strdup(""), len);
}

static enum MHD_Result handler(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                               const char *version, const char *upload_data, size_t *upload_data_size, void **req_cls)
{
    struct gw_admin *a = cls;
    struct admin_job *j = *req_cls;
    if (!j) /* no URI callback ran: should not happen */
        return MHD_NO;
    if (j->submitted) { /* resumed: the store answered */
        if (*upload_data_size) {
            *upload_data_size = 0;
            return MHD_YES;
        }
        if (!atomic_load(&j->done))
            return MHD_YES;
        char *json = j->json;
        j->json = NULL;
        if (!json)
            json = cm_strdup("{}");
        bool is_problem = j->status >= 400 && strstr(json, "\"type\"") != NULL;
        return answer(c, (unsigned)j->status, is_problem ? GW_PROBLEM_CONTENT_TYPE : "application/json", json,
                      strlen(json));
    }
    if (j->reading) { /* a settle's body */
        if (*upload_data_size) {
            if (!j->too_large && !cm_buf_append(&j->body, upload_data, *upload_data_size))
                j->too_large = true;
            *upload_data_size = 0;
            return MHD_YES;
        }
        j->reading = false;
        if (j->too_large)
            return problem(c, 413, "payload-too-large", "Payload too large", "a settle's body is at most 12 MiB");
        return submit(a, c, j);
    }
    if (strncmp(url, "/admin/", 7) == 0)
        return keys_endpoint(a, c, url, method, j);
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        return problem(c, 405, "method-not-allowed", "Method not allowed", "only GET is supported here");
    if (strcmp(url, "/healthz") == 0)
        return text(c, 200, "application/json", "{\"status\":\"ok\"}\n");
    if (strcmp(url, "/readyz") == 0) {
        struct store *st = gw_loop_store(a->loop);
        bool pg = gw_loop_postgres_ready(a->loop);
        bool draining = atomic_load(&a->draining);
        const char *redis = !store_redis_enabled(st) ? "disabled" : store_redis_up(st) ? "up" : "down";
        char *body = cm_asprintf("{\"status\":\"%s\",\"postgres\":\"%s\",\"redis\":\"%s\"}\n",
                                 draining ? "draining"
                                 : pg     ? "ready"
                                          : "unready",
                                 pg ? "up" : "down", redis);
        return answer(c, pg && !draining ? 200 : 503, "application/json", body, strlen(body));
    }
    if (strcmp(url, "/") == 0) {
        size_t len;
        const char *html = gw_status_page(&len);
        char *body = cm_malloc(len + 1);
        memcpy(body, html, len + 1);
        return answer(c, 200, "text/html; charset=utf-8", body, len);
    }
    if (strcmp(url, "/status.json") == 0)
        return status_json(a, c);
    if (strcmp(url, "/metrics") == 0) {
        struct store *st = gw_loop_store(a->loop);
        cm_metric_postgres_up(store_postgres_up(st));
        cm_metric_redis_up(store_redis_up(st));
        struct cm_buf out;
        cm_buf_init(&out, 16 * 1024 * 1024);
        if (!cm_metrics_render(&out)) {
            cm_buf_free(&out);
            return problem(c, 500, "internal-error", "Internal error", "metrics too large");
        }
        size_t len;
        char *body = cm_buf_take(&out, &len);
        return answer(c, 200, "text/plain; version=0.0.4; charset=utf-8", body ? body : cm_strdup(""), len);
    }
    return problem(c, 404, "not-found", "Not found", "no such admin endpoint");
}

static void completed(void *cls, struct MHD_Connection *c, void **req_cls, enum MHD_RequestTerminationCode toe)
{
    struct gw_admin *a = cls;
    struct admin_job *j = *req_cls;
    *req_cls = NULL;
    struct gw_conn *t = c ? conn_of(c) : NULL;
    if (t) /* the next request on a keep-alive connection is read from now */
        gw_conn_request_done(t, toe == MHD_REQUEST_TERMINATED_COMPLETED_OK);
    if (!j)
        return;
    if (j->submitted)
        atomic_fetch_sub(&a->jobs, 1);
    free(j->query);
    free(j->route);
    free(j->cursor);
    cm_buf_free(&j->body);
    free(j->json);
    free(j);
}

/* Every request gets its job here, with the raw query (before libmicrohttpd splits and decodes it). */
static void *admin_uri_log(void *cls, const char *uri, struct MHD_Connection *c)
{
    struct admin_job *j = cm_calloc(1, sizeof *j);
    const char *q = uri ? strchr(uri, '?') : NULL;
    j->query = cm_strdup(q ? q + 1 : "");
    return j;
}

struct gw_admin *gw_admin_start(const struct conf *conf, struct gw_tls_creds *tls, struct gw_loop *loop, char **err)
{
    struct gw_admin *a = cm_calloc(1, sizeof *a);
    a->conf = conf;
    a->loop = loop;
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    char port[8];
    snprintf(port, sizeof port, "%u", conf->admin_listen.port);
    int rc = getaddrinfo(conf->admin_listen.host, port, &hints, &res);
    if (rc != 0 || !res) {
        *err = cm_asprintf("cannot resolve admin listen address %s", conf->admin_listen.host);
        free(a);
        return NULL;
    }
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    memcpy(&ss, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    /* SPEC 7: /healthz, /readyz and /metrics answer while 1,000 connections trickle bytes at it, as the front does:
     * as many connections as the front takes, each held to client_timeout by the same watchdog */
    a->conns = gw_conntrack_start(conf->client_timeout_ms, "admin", err);
    if (!a->conns) {
        free(a);
        return NULL;
    }
    unsigned timeout_s = (unsigned)((conf->client_timeout_ms + 999) / 1000);
    a->tls = tls ? gw_tls_create(tls) : NULL;
    a->d = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG |
            (ss.ss_family == AF_INET6 ? MHD_USE_IPv6 : 0) | (tls ? MHD_USE_TLS : 0),
        0, NULL, NULL, handler, a, MHD_OPTION_EXTERNAL_LOGGER, gw_mhd_log, "admin", MHD_OPTION_ARRAY,
        gw_tls_mhd_options(tls != NULL), MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss, MHD_OPTION_CONNECTION_LIMIT,
        (unsigned)conf->max_connections, MHD_OPTION_CONNECTION_TIMEOUT, timeout_s, MHD_OPTION_NOTIFY_COMPLETED,
        completed, a, MHD_OPTION_NOTIFY_CONNECTION, conn_notify, a, MHD_OPTION_URI_LOG_CALLBACK, admin_uri_log, a,
        MHD_OPTION_END);
    if (!a->d) {
        gw_conntrack_stop(a->conns);
        gw_tls_destroy(a->tls);
        char addr[320];
        *err = cm_asprintf("cannot listen on admin address %s",
                           conf_addr_fmt(addr, sizeof addr, conf->admin_listen.host, conf->admin_listen.port));
        free(a);
        return NULL;
    }
    if (a->tls) /* a handshake in the moment before fails: no client waits for a listener that just started */
        gw_tls_bind(a->tls, a->d);
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(a->d, MHD_DAEMON_INFO_BIND_PORT);
    a->port = di ? di->port : conf->admin_listen.port;
    return a;
}

void gw_admin_tls_set(struct gw_admin *a, struct gw_tls_creds *tls)
{
    if (a && a->tls && tls)
        gw_tls_set(a->tls, tls);
}

uint16_t gw_admin_port(const struct gw_admin *a)
{
    return a->port;
}

size_t gw_admin_jobs(struct gw_admin *a)
{
    return a ? atomic_load(&a->jobs) : 0;
}

void gw_admin_draining(struct gw_admin *a)
{
    if (a)
        atomic_store(&a->draining, true);
}

void gw_admin_stop(struct gw_admin *a)
{
    if (!a)
        return;
    MHD_stop_daemon(a->d);
    gw_tls_unbind(a->d);
    gw_tls_destroy(a->tls);
    gw_conntrack_stop(a->conns); /* after the daemon: it told it of every close */
    free(a);
}
