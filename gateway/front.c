/* front.c - the HTTP front on libmicrohttpd: one daemon per I/O loop, driven
 * by that loop's thread (MHD's epoll fd in the loop's libevent base), reads a
 * request, checks route, key and limits, then suspends the connection while
 * the same thread runs the pipeline, and answers when it resumes it. No
 * request crosses a thread. The front accepts itself, on one listening socket
 * watched by every loop, and places each connection on the loop that holds
 * the fewest (MHD_add_connection), so the loops share the clients evenly. It never touches the store or the upstream:
 * the pipeline does, from the job's context. */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <event2/event.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/addr.h"
#include "common/alog.h"
#include "common/uri.h"
#include "gateway/access.h"
#include "gateway/answer.h"
#include "gateway/hints.h"
#include "gateway/conntrack.h"
#include "gateway/ctx.h"
#include "gateway/front.h"
#include "gateway/gateway.h"
#include "gateway/loop.h"
#include "gateway/pipeline.h"
#include "gateway/tls.h"
#include "gateway/reload.h"
#include "gateway/spans.h"
#include "gateway/jwt.h"
#include "gateway/verify.h"
#include "gateway/ordering.h"
#include "gateway/problem.h"

enum stage { STAGE_NEW, STAGE_BODY, STAGE_SUBMITTED, STAGE_ANSWERED };

/* One daemon and the loop thread that runs it. */
struct shard {
    struct gw_front *f;
    struct gw_loop *loop;
    struct MHD_Daemon *d;
    struct event *io;        /* MHD's epoll fd is readable */
    struct event *tick;      /* MHD's next timeout, or work left over */
    struct event *kick;      /* a connection was resumed */
    struct event *acc;       /* the shared listening socket is readable */
    struct event *acc_retry; /* accept() ran out of descriptors or memory: listen again after a pause */
    atomic_bool quiesced;    /* takes no new connection any more */
    atomic_long open;        /* connections its daemon holds (MHD's STARTED .. CLOSED) */
    atomic_long incoming;    /* handed to this loop by another one, not added yet */
    /* Requests' memory kept for the next ones (its daemon's callbacks only: the loop's thread, or the main thread
     * once the loops stopped): a struct req is above glibc's per-thread cache size, and malloc's slower path
     * showed in every request's profile. A list linked through each one's first bytes, at most REQ_SPARE_MAX. */
    struct req *spare;
    size_t nspare;
};

#if defined(__SANITIZE_ADDRESS__)
#define REQ_SPARE_MAX 0 /* AddressSanitizer sees each request's memory freed */
#else
#define REQ_SPARE_MAX 256
#endif

struct gw_front {
    struct gw_conntrack *conns; /* the request-read and answer-write deadlines */
    const struct conf *conf;    /* the start-time configuration: listen, pool size, limits that need a restart */
    struct shard *shards;
    size_t nshards;
    MHD_socket lsock; /* the listening socket, shared by every daemon */
    bool lsock_closed;
    uint16_t port;
    atomic_long connections;
    atomic_long suspended; /* requests handed to the loop and not answered yet */
    atomic_bool shutting_down;
    struct gw_tls *tls; /* listen.tls: the credentials new handshakes get; NULL: plain HTTP */
};

/* Front-side state of one request; the job is what travels to the loop. */
struct req {
    struct gw_job job;   /* first: a job is its req */
    struct shard *shard; /* its daemon and loop; shard->f the front */
    enum stage stage;
    bool body_too_large;
    bool body_over_budget; /* limits.buffers was reached while the body was read */
    /* A chunked body's framing, which libmicrohttpd 0.9.75 reads leniently (see chunk_framing_ok): the body's bytes
     * follow the header block in its read buffer, from body_base; data_end is the end of the last piece it handed
     * over; chunk_why says why the framing is refused (NULL while it is sound). */
    bool chunked;
    const char *body_base;
    const char *data_end;
    const char *chunk_why;
    struct cm_hdrs in_hdrs; /* as received, in order */
    /* The request target as the URI log callback saw it: where it sits in MHD's read buffer and its strlen then
     * (before MHD cut the query off; a NUL inside makes it short), and what cm_target_parse made of it. */
    const char *target;
    size_t target_len;
    enum cm_target_result target_res;
    bool long_target_parsed; /* target_res TOO_LONG, but the path is sound: job->path is it, for the route only */
    const char *target_why;
    struct gw_jwt_claims *jwt; /* the verified bearer token of a jwt:CLAIM scope, NULL otherwise */
    struct gw_reqparts parts;  /* what the key, scope, fingerprint and ordering guard read (parts_of) */
    bool key_in_body;          /* key_from json: or form: (SPEC 12): the key is read in submit */
    bool trusted_peer;         /* the peer is inside trusted_proxies (SPEC 11): its forwarding headers are believed */
    struct gw_conf *cref;      /* the configuration this request is served under (one reference) */
};

static struct gw_conn *track_of(struct MHD_Connection *c);
static const char *client_ip(struct MHD_Connection *c, char *buf, size_t n);
static size_t header_count(const struct cm_hdrs *h, const char *name);

void gw_mhd_log(void *cls, const char *fmt, va_list ap)
{
    char msg[512], q[600];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = '\0';
    cm_log(CM_WARN, "http", "source=%s msg=%s", cls ? (const char *)cls : "front", cm_log_quote(q, sizeof q, msg));
}

static void *uri_log(void *cls, const char *uri, struct MHD_Connection *c)
{
    struct shard *sh = cls;
    struct req *r = sh->spare;
    if (r) {
        memcpy(&sh->spare, r, sizeof sh->spare);
        sh->nspare--;
        memset(r, 0, sizeof *r);
    } else {
        r = cm_calloc(1, sizeof *r);
    }
    r->shard = sh;
    /* From here to its end the request sees this configuration only, whatever a reload swaps in meanwhile. */
    r->cref = gw_conf_ref(gw_loop_current(sh->loop));
    r->job.conf = r->cref->conf;
    r->job.route_index = CM_ROUTE_NONE;
    cm_request_id_new(r->job.request_id); /* SPEC 11; a trusted proxy's replaces it once the headers are in */
    gw_access_start(&r->job);
    client_ip(c, r->job.client, sizeof r->job.client);
    /* Validated and normalised once, here: what is routed, fingerprinted and forwarded is this form. */
    struct cm_target t;
    r->target = uri;
    r->target_len = uri ? strlen(uri) : 0;
    r->target_why = "no request target";
    r->target_res =
        uri ? cm_target_parse(uri, r->target_len, r->job.conf->max_header_bytes, &t, &r->target_why) : CM_TARGET_BAD;
    /* A target too long is still refused (414), but in the errors: format of the route its path names: it is
     * parsed once more without the bound (MHD's pool bounds it) only to find that route. */
    const char *why2;
    if (r->target_res == CM_TARGET_TOO_LONG && cm_target_parse(uri, r->target_len, SIZE_MAX, &t, &why2) == CM_TARGET_OK)
        r->long_target_parsed = true;
    if (r->target_res == CM_TARGET_OK || r->long_target_parsed) {
        r->job.uri = t.uri;
        r->job.path = t.path;
        r->job.query = t.query;
    } else { /* refused before routing; these only keep the job well-formed */
        r->job.uri = cm_strdup("/");
        r->job.path = cm_strdup("/");
        r->job.query = cm_strdup("");
    }
    cm_hdrs_init(&r->in_hdrs);
    cm_hdrs_init(&r->job.fwd_hdrs);
    cm_hdrs_init(&r->job.probe_hdrs);
    cm_hdrs_init(&r->job.resp_hdrs);
    cm_buf_init(&r->job.body, 0);
    cm_buf_init(&r->job.resp_body, 0);
    r->job.conn = c;
    return r;
}

static void req_free(struct req *r)
{
    if (!r)
        return;
    free(r->job.method);
    free(r->job.uri);
    free(r->job.path);
    free(r->job.query);
    free(r->job.resource);
    cm_hdrs_free(&r->in_hdrs);
    cm_hdrs_free(&r->job.fwd_hdrs);
    cm_hdrs_free(&r->job.probe_hdrs);
    cm_hdrs_free(&r->job.resp_hdrs);
    cm_buf_free(&r->job.body);
    cm_buf_free(&r->job.resp_body);
    gw_pipeline_free(&r->job);
    gw_jwt_claims_free(r->jwt);
    gw_reqparts_free(&r->parts);
    gw_conf_unref(r->cref);
#if REQ_SPARE_MAX > 0
    struct shard *sh = r->shard;
    if (sh->nspare < REQ_SPARE_MAX) {
        memcpy(r, &sh->spare, sizeof sh->spare);
        sh->spare = r;
        sh->nspare++;
        return;
    }
#endif
    free(r);
}

static void completed(void *cls, struct MHD_Connection *c, void **req_cls, enum MHD_RequestTerminationCode toe)
{
    struct req *r = *req_cls;
    *req_cls = NULL;
    struct gw_conn *t = c ? track_of(c) : NULL;
    if (t) /* a keep-alive connection now waits for its next request: the deadline runs again; a cut answer resets */
        gw_conn_request_done(t, toe == MHD_REQUEST_TERMINATED_COMPLETED_OK);
    /* A submitted job is only ever completed after the loop resumed it. */
    if (r && r->stage == STAGE_SUBMITTED && !atomic_load(&r->job.done)) {
        cm_log(CM_ERROR, "bug", "msg=\"request completed while in the pipeline\"");
        return; /* leak rather than free memory the loop still uses */
    }
    /* Resumed, but the client had gone: the answer was never queued. */
    if (r && r->stage == STAGE_SUBMITTED)
        atomic_fetch_sub(&r->shard->f->suspended, 1);
    if (r && r->job.method) /* SPEC 11: one line per request, once its answer was sent or its client went away */
        gw_access_log(&r->job, toe != MHD_REQUEST_TERMINATED_COMPLETED_OK);
    req_free(r);
}

static struct gw_conn *track_of(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

static void conn_notify(void *cls, struct MHD_Connection *c, void **socket_ctx, enum MHD_ConnectionNotificationCode toe)
{
    struct shard *sh = cls;
    struct gw_front *f = sh->f;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        atomic_fetch_add(&sh->open, 1);
        long prev = atomic_fetch_add(&f->connections, 1);
        cm_metric_connections(1);
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        struct gw_conn *t = gw_conntrack_add(f->conns, ci ? ci->connect_fd : -1);
        t->over_limit = prev >= (long)f->conf->max_connections;
        *socket_ctx = t;
    } else {
        atomic_fetch_sub(&sh->open, 1);
        atomic_fetch_sub(&f->connections, 1);
        cm_metric_connections(-1);
        /* MHD notifies CLOSED before it closes the socket: the watchdog never sees a reused fd */
        gw_conntrack_remove(f->conns, *socket_ctx);
        *socket_ctx = NULL;
    }
}

/* ---- the raw header block (libmicrohttpd 0.9.75 parses it in place; see README "Security")
 *
 * The request line and the header lines stay in the connection's read buffer, from the method (the block's
 * start) for MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE bytes; each CR LF (or bare LF) became NULs, each header's
 * colon a NUL. The headers MHD hands over must tile that block exactly, in order: anything MHD rewrote (an
 * obs-fold moves the name into a new allocation, a NUL cuts a value, a line it skipped) leaves a gap or a
 * pointer elsewhere. No byte outside [lo, hi) is ever read. */
struct tile {
    uintptr_t lo, hi; /* the block */
    const char *p;    /* end of the previous item: the version, then each value */
    const char *why;  /* NULL while the block tiles */
    struct req *r;
};

/* p[0..n) lies inside the block. */
static bool in_block(const struct tile *t, const char *p, size_t n)
{
    uintptr_t a = (uintptr_t)p;
    return p && a >= t->lo && a <= t->hi && n <= t->hi - a;
}

/* NUL bytes at p, up to the block's end. */
static size_t nuls_at(const struct tile *t, const char *p)
{
    size_t n = 0;
    while (in_block(t, p + n, 1) && p[n] == '\0')
        n++;
    return n;
}

static enum MHD_Result tile_header(void *cls, enum MHD_ValueKind kind, const char *key, size_t klen, const char *value,
                                   size_t vlen)
{
    struct tile *t = cls;
    cm_hdrs_addn(&t->r->in_hdrs, key, klen, value ? value : "", value ? vlen : 0);
    if (t->why)
        return MHD_YES;
    size_t gap = nuls_at(t, t->p);
    if (gap < 1 || gap > 2 || key != t->p + gap || !in_block(t, key, klen + 1) || key[klen] != '\0') {
        t->why = "a header line libmicrohttpd would rewrite (obs-fold, NUL, or a line it skipped)";
        return MHD_YES;
    }
    const char *s = key + klen + 1; /* after the colon: only the OWS MHD skipped */
    if (!value || (uintptr_t)value < (uintptr_t)s || !in_block(t, value, vlen + 1)) {
        t->why = "a header value outside its line";
        return MHD_YES;
    }
    for (; s < value; s++) {
        if (*s != ' ' && *s != '\t') {
            t->why = "a header value outside its line";
            return MHD_YES;
        }
    }
    t->p = value + vlen;
    return MHD_YES;
}

/* Checks the request line and the header block, and collects the headers (with their exact lengths) into
 * r->in_hdrs. Returns NULL when the block is sound, else a constant reason (fail closed: a libmicrohttpd whose
 * layout differs from 0.9.75 gets every request refused rather than one let through unchecked). */
static const char *raw_block_check(struct req *r, struct MHD_Connection *c, const char *method, const char *version)
{
    struct tile t = {.r = r};
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
    const char *why = NULL;
    if (!ci || !method || ci->header_size == 0) {
        why = "the request head could not be checked";
        goto collect;
    }
    t.lo = (uintptr_t)method;
    t.hi = t.lo + ci->header_size;
    if (t.hi < t.lo) {
        why = "the request head could not be checked";
        goto collect;
    }
    /* method: a token, its NUL (the SP), then only the SPs MHD skipped up to the target */
    size_t mlen = strnlen(method, ci->header_size);
    if (!cm_token_ok(method, mlen)) {
        why = "the method is not a token";
        goto collect;
    }
    const char *s = method + mlen + 1;
    if (!in_block(&t, r->target, r->target_len + 1) || (uintptr_t)r->target < (uintptr_t)s) {
        why = "malformed request line";
        goto collect;
    }
    for (; s < r->target; s++) {
        if (*s != ' ') {
            why = "malformed request line";
            goto collect;
        }
    }
    /* the target's strlen reaches the NUL that was the SP before the version */
    if (!in_block(&t, version, 9) || version != r->target + r->target_len + 1) {
        why = "the request target holds a NUL byte, or the request line has no HTTP version";
        goto collect;
    }
    if (strnlen(version, 9) != 8 || (memcmp(version, "HTTP/1.1", 8) != 0 && memcmp(version, "HTTP/1.0", 8) != 0)) {
        why = "the HTTP version must be HTTP/1.0 or HTTP/1.1";
        goto collect;
    }
    t.p = version + 8;
collect:
    if (why)
        t.why = why;
    MHD_get_connection_values_n(c, MHD_HEADER_KIND, tile_header, &t);
    if (t.why)
        return t.why;
    /* after the last value: its line end and the empty line, nothing else */
    size_t tail = nuls_at(&t, t.p);
    if (tail < 2 || tail > 4 || (uintptr_t)t.p + tail != t.hi)
        return "a header line libmicrohttpd would rewrite (obs-fold, NUL, or a line it skipped)";
    return NULL;
}

/* A case variant of a standard method ("head", "Post"): a distinct method by RFC 9110 9.1, but one that a
 * component folding case would take for the standard one (HEAD read without its body); refused. */
static bool method_case_variant(const char *m)
{
    static const char *const std[] = {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"};
    for (size_t i = 0; i < sizeof std / sizeof std[0]; i++)
        if (strcasecmp(m, std[i]) == 0 && strcmp(m, std[i]) != 0)
            return true;
    return false;
}

/* SPEC 7: a client that stops reading its answer is cut after client_timeout, whatever the answer holds: from
 * now the watchdog counts the time its answer takes to be written (completed() starts the keep-alive wait). */
static void answer_deadline(struct MHD_Connection *c)
{
    struct gw_conn *t = track_of(c);
    if (t)
        gw_conn_answering(t);
}

/* A HEAD answer's Content-Length, as the upstream sent it (or as stored): libmicrohttpd 0.9.75 writes
 * Content-Length from the response's size and refuses one set by hand (MHD_RF_INSANITY_HEADER_CONTENT_LENGTH
 * would send both), and for HEAD it never reads the body (it counts it as sent). So the answer gets that size
 * and a reader that is never called. */
static bool head_content_length(const struct gw_job *job, uint64_t *out)
{
    if (!job->method || strcmp(job->method, "HEAD") != 0 || job->status < 200 || job->status == 204 ||
        job->status == 304)
        return false;
    const char *cl = cm_hdrs_get(&job->resp_hdrs, "Content-Length");
    return cl && cm_parse_digits(cl, strlen(cl), 19, out) && *out < MHD_SIZE_UNKNOWN;
}

static ssize_t no_body_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    return MHD_CONTENT_READER_END_WITH_ERROR; /* HEAD: MHD never asks */
}

/* An answer's body and what it holds of the buffer budget, both given back when MHD is done with the answer (sent,
 * or its connection closed). */
struct counted_body {
    char *data;
    size_t charged;
};

static void counted_body_free(void *cls)
{
    struct counted_body *b = cls;
    cm_buffers_release(b->charged);
    free(b->data);
    free(b);
}

/* Queues the job's answer (status, headers, body) on the connection. */
static enum MHD_Result queue_answer(struct req *r, struct MHD_Connection *c)
{
    struct gw_job *job = &r->job;
    size_t len, charged = cm_buf_charged(&job->resp_body);
    char *body = cm_buf_take(&job->resp_body, &len);
    uint64_t head_len = 0;
    struct MHD_Response *resp;
    struct counted_body *cb = NULL;
    if (head_content_length(job, &head_len)) { /* MHD writes Content-Length from the size; no body is read */
        free(body); /* a HEAD's record has an empty body (a replay decodes it as an empty buffer, not none) */
        body = NULL;
        cm_buffers_release(charged);
        resp = MHD_create_response_from_callback(head_len, 4096, no_body_read, NULL, NULL);
    } else if (body && charged) { /* the answer holds its share of limits.buffers until MHD is done with it */
        cb = cm_malloc(sizeof *cb);
        cb->data = body;
        cb->charged = charged;
        resp = MHD_create_response_from_buffer_with_free_callback_cls(len, body, counted_body_free, cb);
    } else if (body)
        resp = MHD_create_response_from_buffer_with_free_callback(len, body, free);
    else
        resp = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    if (!resp) {
        if (cb)
            counted_body_free(cb);
        else
            free(body);
        return MHD_NO;
    }
    gw_answer_headers(resp, &job->resp_hdrs, job->replayed, job->conf->request_id_header, job->request_id);
    job->bytes_out = body ? len : 0;
    if (atomic_load(&r->shard->f->shutting_down) || job->status == 431 || job->status == 413 || job->status == 400)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    answer_deadline(c);
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)job->status, resp);
    MHD_destroy_response(resp);
    r->stage = STAGE_ANSWERED;
    gw_trace_end(job, gw_loop_ctx(r->shard->loop)->tracer);
    return ret;
}

/* Answers at once, without the pipeline (validation errors, limits). */
static enum MHD_Result reject(struct req *r, struct MHD_Connection *c, int status, const char *name, const char *title,
                              const char *detail, enum cm_outcome outcome)
{
    gw_job_problem(&r->job, status, name, title, detail);
    gw_job_count(&r->job, outcome);
    gw_trace_outcome(&r->job, outcome);
    return queue_answer(r, c);
}

/* SPEC 12: is a key_from key refused (invalid, or absent on a key: required route)? */
static bool key_refused(enum gw_key_res kr, const struct conf_route *route)
{
    return kr == GW_KEY_INVALID || (kr == GW_KEY_ABSENT && route->idem.key == CONF_KEY_REQUIRED);
}

static enum MHD_Result refuse_key(struct req *r, struct MHD_Connection *c, enum gw_key_res kr)
{
    if (kr == GW_KEY_ABSENT)
        return reject(r, c, 400, "idempotency-key-missing", "Idempotency key missing",
                      "this route requires an idempotency key where key_from names it", CM_OUT_REJECTED);
    return reject(r, c, 400, "idempotency-key-invalid", "Idempotency key invalid",
                  "the key must be given once, as 1 to 255 bytes of UTF-8 without control characters (a JSON string) "
                  "or a JSON integer",
                  CM_OUT_REJECTED);
}

/* SPEC 7: limits.buffers would be passed: 503 overloaded with Retry-After, before anything is claimed or forwarded. */
static enum MHD_Result shed_buffers(struct req *r, struct MHD_Connection *c)
{
    cm_metric_shed(CM_SHED_BUFFERS);
    cm_buf_free(&r->job.body);
    gw_job_problem(&r->job, 503, "overloaded", "Overloaded",
                   "the gateway holds as many request bodies and answers as limits.buffers allows; retry later");
    gw_job_retry_after(&r->job, 1000);
    gw_job_count(&r->job, CM_OUT_OVERLOADED);
    gw_trace_outcome(&r->job, CM_OUT_OVERLOADED);
    return queue_answer(r, c);
}

/* Loop thread: the pipeline finished; wake the connection (its daemon runs
 * on this thread: the resumed connection is served at the kick). */
static void job_finish(struct gw_job *job)
{
    struct shard *sh = ((struct req *)job)->shard;
    atomic_store(&job->done, true);
    MHD_resume_connection(job->conn);
    event_active(sh->kick, EV_TIMEOUT, 0);
}

/* An IPv4 address as inet_ntop writes it, without its sprintf (every request formats its client's): false when it
 * does not fit in n. */
static bool ipv4_text(const struct in_addr *a, char *buf, size_t n)
{
    const uint8_t *b = (const uint8_t *)&a->s_addr;
    char t[16];
    size_t o = 0;
    for (int i = 0; i < 4; i++) {
        if (i)
            t[o++] = '.';
        if (b[i] >= 100)
            t[o++] = (char)('0' + b[i] / 100);
        if (b[i] >= 10)
            t[o++] = (char)('0' + b[i] / 10 % 10);
        t[o++] = (char)('0' + b[i] % 10);
    }
    if (o >= n)
        return false;
    memcpy(buf, t, o);
    buf[o] = '\0';
    return true;
}

static const char *client_ip(struct MHD_Connection *c, char *buf, size_t n)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (ci && ci->client_addr && ci->client_addr->sa_family == AF_INET &&
        ipv4_text(&((const struct sockaddr_in *)ci->client_addr)->sin_addr, buf, n))
        return buf;
    snprintf(buf, n, "unknown");
    if (!ci || !ci->client_addr)
        return buf;
    const struct sockaddr *sa = ci->client_addr;
    const void *addr = sa->sa_family == AF_INET6 ? (const void *)&((const struct sockaddr_in6 *)sa)->sin6_addr
                                                 : (const void *)&((const struct sockaddr_in *)sa)->sin_addr;
    if ((sa->sa_family != AF_INET && sa->sa_family != AF_INET6) || !inet_ntop(sa->sa_family, addr, buf, (socklen_t)n))
        snprintf(buf, n, "unknown");
    return buf;
}

/* Host[:port] of an upstream URL. */
static void upstream_host(const char *url, char *out, size_t n)
{
    const char *p = strstr(url, "://");
    p = p ? p + 3 : url;
    const char *at = strchr(p, '@');
    const char *slash = strchr(p, '/');
    if (at && (!slash || at < slash))
        p = at + 1;
    size_t len = slash ? (size_t)(slash - p) : strlen(p);
    snprintf(out, n, "%.*s", (int)len, p);
}

/* Client headers that say where or how the request came in, or what it asks for, which frameworks behind the
 * gateway read (Rack, Django, Symfony, Spring, IIS rewrite, method-override middleware): the gateway either sets
 * them itself (OWNED: the client's are replaced, their '_' spellings dropped) or passes them only from a peer in
 * trusted_proxies (PEER: from any other peer every spelling is dropped). */
enum fwd_kind { FWD_OWNED, FWD_PEER };
static const struct {
    const char *name;
    enum fwd_kind kind;
} fwd_headers[] = {
    {"X-Forwarded-For", FWD_OWNED},
    {"X-Forwarded-Proto", FWD_OWNED},
    {"X-Forwarded-Host", FWD_OWNED},
    {"Forwarded", FWD_OWNED},
    {"Via", FWD_OWNED},
    {"X-Forwarded-Ssl", FWD_PEER},
    {"X-Forwarded-Scheme", FWD_PEER},
    {"X-Forwarded-Port", FWD_PEER},
    {"X-Forwarded-Prefix", FWD_PEER},
    {"X-Forwarded-Server", FWD_PEER},
    {"Front-End-Https", FWD_PEER},
    {"X-Url-Scheme", FWD_PEER},
    {"X-Real-IP", FWD_PEER},
    {"X-Original-URL", FWD_PEER},
    {"X-Rewrite-URL", FWD_PEER},
    {"X-HTTP-Method-Override", FWD_PEER},
    {"X-HTTP-Method", FWD_PEER},
    {"X-Method-Override", FWD_PEER},
};

/* name is std case-insensitively, '_' counting as '-'; with underscore, only when it has at least one '_'. */
static bool spelling_of(const char *name, const char *std, bool underscore)
{
    if ((underscore && !strchr(name, '_')) || strlen(name) != strlen(std))
        return false;
    for (size_t j = 0; name[j]; j++)
        if (tolower((unsigned char)(name[j] == '_' ? '-' : name[j])) != tolower((unsigned char)std[j]))
            return false;
    return true;
}

/* Drops the client's spellings of the table's headers that must not reach the upstream from this peer: every
 * spelling of a PEER header (the peer is not a trusted proxy), and the '_' spellings of an OWNED one (CGI, WSGI and
 * Rack servers read X_Forwarded_Proto as X-Forwarded-Proto, HTTP_X_FORWARDED_PROTO, so it would bypass the
 * replacement; nginx drops every header with an underscore by default). */
static void drop_forwarding_headers(struct cm_hdrs *fh, bool trusted_peer)
{
    for (size_t i = 0; i < fh->n;) {
        bool drop = false;
        for (size_t k = 0; k < sizeof fwd_headers / sizeof fwd_headers[0] && !drop; k++) {
            bool owned = fwd_headers[k].kind == FWD_OWNED;
            drop = (owned || !trusted_peer) && spelling_of(fh->v[i].name, fwd_headers[k].name, owned);
        }
        if (!drop) {
            i++;
            continue;
        }
        char *copy = cm_strdup(fh->v[i].name);
        cm_hdrs_remove(fh, copy); /* this spelling, every occurrence */
        free(copy);
    }
}

/* Sets name in fh to every value of name in in (in order, comma-separated) followed by ours, as one field; ours
 * alone when the list would not fit in 16 KiB. */
static void append_to_list_header(struct cm_hdrs *fh, const struct cm_hdrs *in, const char *name, const char *ours)
{
    struct cm_buf b;
    cm_buf_init(&b, 16 * 1024);
    bool ok = true;
    for (size_t i = 0; i < in->n; i++)
        if (strcasecmp(in->v[i].name, name) == 0)
            ok = ok && cm_buf_appendf(&b, "%s, ", in->v[i].value);
    ok = ok && cm_buf_append(&b, ours, strlen(ours));
    cm_hdrs_remove(fh, name);
    cm_hdrs_add(fh, name, ok ? b.data : ours);
    cm_buf_free(&b);
}

/* A trusted proxy's X-Forwarded-Proto (one field, http or https in any case): the scheme to pass on, or NULL. */
static const char *believed_proto(const struct cm_hdrs *in)
{
    if (header_count(in, "X-Forwarded-Proto") != 1)
        return NULL;
    const char *v = cm_hdrs_get(in, "X-Forwarded-Proto");
    return strcasecmp(v, "https") == 0 ? "https" : strcasecmp(v, "http") == 0 ? "http" : NULL;
}

/* A trusted proxy's X-Forwarded-Host (one field, one host[:port] as the Host rule of SPEC 7), or NULL. */
static const char *believed_host(const struct cm_hdrs *in)
{
    if (header_count(in, "X-Forwarded-Host") != 1)
        return NULL;
    const char *v = cm_hdrs_get(in, "X-Forwarded-Host");
    return cm_host_ok(v, strlen(v)) ? v : NULL;
}

/* The headers sent upstream: hop-by-hop removed, Host set to the upstream's,
 * X-Forwarded-For/-Proto/-Host and Via added, the key header per forward_key. */
static void build_forward_headers(struct req *r, struct MHD_Connection *c)
{
    struct gw_job *job = &r->job;
    struct cm_hdrs *fh = &job->fwd_hdrs;
    char ip[INET6_ADDRSTRLEN + 8];
    client_ip(c, ip, sizeof ip);
    for (size_t i = 0; i < r->in_hdrs.n; i++)
        cm_hdrs_add(fh, r->in_hdrs.v[i].name, r->in_hdrs.v[i].value);
    cm_hdrs_strip_hop_by_hop(fh);
    cm_hdrs_remove(fh, "Content-Length");
    cm_hdrs_remove(fh, "Expect");
    if (job->route && !job->route->idem.forward_key && job->route->idem.header)
        cm_hdrs_remove(fh, job->route->idem.header);
    if (job->route && job->route->idem.forward_token) /* only the gateway sets the fence (pipeline.c) */
        cm_hdrs_remove(fh, job->route->idem.forward_token);

    /* the client's X-Forwarded-Proto/-Host are passed on only from a trusted proxy, and only when valid (SPEC 11);
     * Forwarded never is (the gateway writes no element of its own into it): the upstream trusts these */
    const char *xfp = r->trusted_peer ? believed_proto(&r->in_hdrs) : NULL;
    const char *xfh = r->trusted_peer ? believed_host(&r->in_hdrs) : NULL;
    drop_forwarding_headers(fh, r->trusted_peer);
    cm_hdrs_remove(fh, "X-Forwarded-Host");
    cm_hdrs_remove(fh, "X-Forwarded-Proto");
    cm_hdrs_remove(fh, "Forwarded");
    const char *host = xfh ? xfh : cm_hdrs_get(&r->in_hdrs, "Host");
    if (host)
        cm_hdrs_add(fh, "X-Forwarded-Host", host);
    cm_hdrs_remove(fh, "Host");
    char uh[512];
    upstream_host(job->upstream->url, uh, sizeof uh);
    cm_hdrs_add(fh, "Host", uh);

    append_to_list_header(fh, &r->in_hdrs, "X-Forwarded-For", ip);
    cm_hdrs_add(fh, "X-Forwarded-Proto", xfp ? xfp : r->shard->f->tls ? "https" : "http"); /* one per listener */
    append_to_list_header(fh, &r->in_hdrs, "Via", "1.1 idemgate");                         /* RFC 9110 7.6.3 */
    char tp[UP_TRACEPARENT_LEN + 1];
    if (gw_trace_forward_value(job, tp)) { /* W3C: the upstream's parent is our upstream span */
        cm_hdrs_remove(fh, "traceparent");
        if (!job->trace.incoming) /* no valid incoming traceparent: its tracestate means nothing */
            cm_hdrs_remove(fh, "tracestate");
        cm_hdrs_add(fh, "traceparent", tp);
    }
    cm_hdrs_remove(fh, job->conf->request_id_header); /* SPEC 11: the upstream gets the request's id, one value */
    cm_hdrs_add(fh, job->conf->request_id_header, job->request_id);
}

/* RFC 9110 field names are tokens; values carry no control byte but HTAB.
 * The value of skip (the idempotency key header, when the key is checked) is
 * left to the key parser, which answers idempotency-key-invalid. */
static bool headers_well_formed(const struct cm_hdrs *h, const char *skip)
{
    for (size_t i = 0; i < h->n; i++) {
        if (!cm_token_ok(h->v[i].name, strlen(h->v[i].name)))
            return false;
        if (skip && strcasecmp(h->v[i].name, skip) == 0)
            continue;
        if (!cm_field_value_ok(h->v[i].value, strlen(h->v[i].value)))
            return false;
    }
    return true;
}

/* Request framing that could be read two ways (RFC 9112 6.3) is refused:
 * a Content-Length that is not one number (repeated with other values, or a
 * list), or Content-Length together with Transfer-Encoding. */
static bool framing_ambiguous(const struct cm_hdrs *h)
{
    const char *first = NULL;
    for (size_t i = 0; i < h->n; i++) {
        if (strcasecmp(h->v[i].name, "Content-Length") != 0)
            continue;
        const char *v = h->v[i].value;
        if (!*v || strspn(v, "0123456789") != strlen(v))
            return true;
        if (first && strcmp(first, v) != 0)
            return true;
        first = v;
    }
    return first && cm_hdrs_get(h, "Transfer-Encoding") != NULL;
}

/* A request Transfer-Encoding other than exactly one "chunked" (RFC 9112 6.1: 501 for a coding the server does
 * not understand). libmicrohttpd reads only chunked bodies; with any other coding it waited for the body until
 * client_timeout. */
static bool transfer_coding_unsupported(const struct cm_hdrs *h)
{
    size_t n = 0;
    bool other = false;
    for (size_t i = 0; i < h->n; i++) {
        if (strcasecmp(h->v[i].name, "Transfer-Encoding") != 0)
            continue;
        n++;
        other = other || strcasecmp(h->v[i].value, "chunked") != 0;
    }
    return n > 1 || other;
}

/* The request head as received, request line to the empty line included. */
static size_t header_block_size(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
    return ci ? ci->header_size : 0;
}

/* Per-connection pool (libmicrohttpd 0.9.75): what one record of a header, argument or cookie takes (struct
 * MHD_HTTP_Header, 56 bytes, rounded to 16), the slack over both head limits, and the part of it kept for the
 * answer's own lines (status line, Date, Content-Length, Connection, Idempotent-Replayed). */
#define GW_MHD_RECORD_BYTES 64
#define GW_POOL_SLACK       (8 * 1024)
#define GW_POOL_ANSWER_KEEP (2 * 1024)

/* What the request holds in the pool when its answer's head is built: the head itself, a record per header,
 * argument and cookie, and the copy of the Cookie header MHD parses cookies from. */
static size_t request_pool_bytes(const struct req *r, struct MHD_Connection *c)
{
    int args = MHD_get_connection_values(c, MHD_GET_ARGUMENT_KIND, NULL, NULL);
    int cookies = MHD_get_connection_values(c, MHD_COOKIE_KIND, NULL, NULL);
    size_t n = r->in_hdrs.n + (size_t)(args > 0 ? args : 0) + (size_t)(cookies > 0 ? cookies : 0);
    const char *ck = cm_hdrs_get(&r->in_hdrs, "Cookie");
    return header_block_size(c) + n * GW_MHD_RECORD_BYTES + (ck ? strlen(ck) + 1 : 0);
}

/* How many headers are named name (case-insensitive). */
static size_t header_count(const struct cm_hdrs *h, const char *name)
{
    size_t n = 0;
    for (size_t i = 0; i < h->n; i++)
        n += strcasecmp(h->v[i].name, name) == 0;
    return n;
}

static bool route_needs_jwt(const struct conf_route *route)
{
    for (size_t i = 0; i < route->idem.scope_n; i++)
        if (route->idem.scope[i].kind == CONF_PART_JWT)
            return true;
    return false;
}

/* Verifies the bearer token for the route's jwt:CLAIM scope parts and keeps its claims in r->jwt. Returns NULL, or
 * why the request is refused (401 invalid-credentials; the reason names no token byte). */
static const char *jwt_check(struct req *r, const struct conf_route *route)
{
    const struct gw_jwt *jwt = r->cref->jwt;
    if (!jwt)
        return "the gateway has no key to verify tokens";
    if (header_count(&r->in_hdrs, "Authorization") > 1)
        return "more than one Authorization header";
    enum gw_jwt_result jr =
        gw_jwt_verify(jwt, cm_hdrs_get(&r->in_hdrs, "Authorization"), (int64_t)(cm_wall_ms() / 1000), &r->jwt);
    if (jr != GW_JWT_OK) {
        cm_log(CM_INFO, "jwt_refused", "request_id=%s route=%s reason=%s", r->job.request_id, route->name,
               gw_jwt_result_name(jr));
        switch (jr) {
        case GW_JWT_MISSING:
            return "this route needs a bearer token (Authorization: Bearer <JWT>)";
        case GW_JWT_EXPIRED:
            return "the bearer token has expired (or has no exp)";
        case GW_JWT_NOT_YET:
            return "the bearer token is not valid yet (nbf)";
        case GW_JWT_ISSUER:
            return "the bearer token's issuer is not accepted";
        case GW_JWT_AUDIENCE:
            return "the bearer token's audience is not accepted";
        case GW_JWT_ALG:
            return "the bearer token's algorithm is not accepted";
        case GW_JWT_BAD_SIGNATURE:
            return "the bearer token's signature does not verify";
        default:
            return "the bearer token is malformed";
        }
    }
    for (size_t i = 0; i < route->idem.scope_n; i++) {
        const struct conf_part *part = &route->idem.scope[i];
        if (part->kind == CONF_PART_JWT && !gw_jwt_has_claim(r->jwt, part->header)) {
            cm_log(CM_INFO, "jwt_refused", "request_id=%s route=%s reason=missing_claim claim=%.64s", r->job.request_id,
                   route->name, part->header);
            return "the bearer token lacks a claim this route's scope needs";
        }
    }
    return NULL;
}

/* gw_verify_header_fn over the request's headers: a header sent twice is as good as none. */
static const char *verify_header(void *arg, const char *name)
{
    struct req *r = arg;
    return header_count(&r->in_hdrs, name) == 1 ? cm_hdrs_get(&r->in_hdrs, name) : NULL;
}

/* SPEC 12: on a verify: route the sender's signature of the raw body, before the key is read or anything is claimed,
 * replayed or forwarded. false: refused (counted and logged, reason only: no signature or secret byte). In shadow
 * mode nothing is refused: the request is forwarded as if key: off, the guard not consulted. */
static bool signature_ok(struct req *r)
{
    struct gw_job *job = &r->job;
    const struct gw_verify *v = job->route ? r->cref->verify[job->route - job->conf->routes] : NULL;
    if (!v)
        return true;
    enum gw_verify_result vr =
        gw_verify_check(v, verify_header, r, job->body.data, job->body.len, (int64_t)(cm_wall_ms() / 1000));
    if (vr == GW_VERIFY_OK)
        return true;
    cm_metric_signature_failure(job->route_index);
    cm_log(CM_INFO, "signature_refused", "route=%s reason=%s", job->route->name, gw_verify_result_name(vr));
    if (job->route->idem.mode == CONF_MODE_SHADOW) { /* the key in the body is not read either: nothing claimed */
        job->idempotent = job->shadow = job->ordered = r->key_in_body = false;
        return true;
    }
    return false;
}

/* The request's part reader (gateway/parts.h) over what has been read so far. The body only grows until submit,
 * and nothing asks about it before. */
static struct gw_reqparts *parts_of(struct req *r)
{
    struct gw_reqparts *p = &r->parts;
    p->method = r->job.method;
    p->path = r->job.path;
    p->query = r->job.query;
    p->body = r->job.body.data;
    p->body_len = r->job.body.len;
    p->hdrs = &r->in_hdrs;
    p->jwt = r->jwt;
    return p;
}

/* SPEC 6: does the route's ordering guard cover this request? Sets job->ordered and its resource instance. */
static void order_match(struct req *r, const struct conf_route *route, const char *method)
{
    struct gw_job *job = &r->job;
    char *res;
    if (!route || !route->ordering.enabled || !(route->methods & conf_method_bit(method)))
        return;
    if (route->ordering.resource_json) { /* SPEC 12: every request of the methods; its resource is read in submit */
        job->ordered = true;
        return;
    }
    if (!gw_order_resource(parts_of(r), route->ordering.resource, &res))
        return;
    job->ordered = true;
    job->resource = res; /* in the template's spelling (SPEC 7: policy never depends on how a path is spelled) */
    job->resource_len = strlen(res);
}

/* SPEC 6: is a guarded request's sequence header well formed? false: 400 sequence-invalid (a json: sequence is read
 * from the body in submit). */
static bool order_headers(struct req *r, const struct conf_route *route)
{
    struct gw_job *job = &r->job;
    if (!job->ordered || route->ordering.source != CONF_SEQ_HEADER)
        return true;
    return gw_seq_from_parts(parts_of(r), CONF_SEQ_HEADER, route->ordering.seq_name, &job->seq);
}

/* SPEC 11: from a peer inside trusted_proxies, the request id it sent (one value of 1 to 128 visible ASCII bytes)
 * is the request's, and the client is the rightmost X-Forwarded-For address outside the list (cm_xff_walk, over
 * every X-Forwarded-For field, last first). Any other peer changes nothing: its id was made at the request line
 * and its client is its own address. */
static void believe_trusted_peer(struct req *r, struct MHD_Connection *c)
{
    const struct conf *conf = r->job.conf;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    struct cm_ip peer;
    if (!ci || !cm_ip_from_sockaddr(ci->client_addr, &peer) ||
        !cm_cidr_match(conf->trusted_proxies, conf->trusted_proxies_n, &peer))
        return;
    r->trusted_peer = true;
    if (header_count(&r->in_hdrs, conf->request_id_header) == 1) {
        const char *id = cm_hdrs_get(&r->in_hdrs, conf->request_id_header);
        size_t n = strlen(id);
        if (cm_request_id_ok(id, n))
            memcpy(r->job.request_id, id, n + 1);
    }
    struct cm_ip client = peer;
    for (size_t i = r->in_hdrs.n; i-- > 0;)
        if (strcasecmp(r->in_hdrs.v[i].name, "X-Forwarded-For") == 0 &&
            !cm_xff_walk(r->in_hdrs.v[i].value, strlen(r->in_hdrs.v[i].value), conf->trusted_proxies,
                         conf->trusted_proxies_n, &client))
            break;
    cm_ip_format(&client, r->job.client, sizeof r->job.client);
}

/* First call: headers are in. Returns MHD_YES to go on reading the body, or
 * the result of queueing an early answer (r->stage == STAGE_ANSWERED). */
static enum MHD_Result on_headers(struct req *r, struct MHD_Connection *c, const char *method, const char *version)
{
    const struct conf *conf = r->job.conf;
    struct gw_job *job = &r->job;
    job->method = cm_strdup(method);
    job->done_cb = job_finish;
    const char *block_bad = raw_block_check(r, c, method, version); /* collects r->in_hdrs */
    if (conf->trusted_proxies_n) /* SPEC 11: nothing to do (and no cost) without a trusted proxy */
        believe_trusted_peer(r, c);

    /* The route first (when the target is sound), so that even the refusals below answer in its errors: format
     * (SPEC 9: every gateway problem). */
    const struct conf_route *route =
        r->target_res == CM_TARGET_OK || r->long_target_parsed ? conf_match_route(conf, job->path) : NULL;
    if (route) {
        job->route = route;
        job->route_index = r->cref->route_slot[route - conf->routes]; /* its name's metrics slot */
        job->upstream = &conf->upstreams[route->upstream];
    } else if (conf->has_default_upstream && r->target_res == CM_TARGET_OK) {
        job->route_index = CM_ROUTE_DEFAULT;
        job->upstream = &conf->upstreams[conf->default_upstream];
    } /* else CM_ROUTE_NONE, as set at the request line */
    /* a traceparent sent twice is not one to continue; read only when tracing or the access line (its trace_id)
     * wants it: with both off a request costs nothing here */
    struct up_tracer *tracer = gw_loop_ctx(r->shard->loop)->tracer;
    gw_trace_begin(job, tracer,
                   (tracer || cm_alog_enabled()) && header_count(&r->in_hdrs, "traceparent") == 1
                       ? cm_hdrs_get(&r->in_hdrs, "traceparent")
                       : NULL);

    struct gw_conn *t = track_of(c);
    if (t && t->over_limit)
        return reject(r, c, 503, "too-many-connections", "Too many connections",
                      "the gateway is at its connection limit; retry later", CM_OUT_OVERLOADED);
    if (r->target_res == CM_TARGET_TOO_LONG)
        return reject(r, c, 414, "uri-too-long", "URI too long", r->target_why, CM_OUT_REJECTED);
    /* the second bound keeps room in the pool for any answer head within max_response_header_bytes */
    if (header_block_size(c) > conf->max_header_bytes ||
        request_pool_bytes(r, c) > conf->max_header_bytes + GW_POOL_SLACK - GW_POOL_ANSWER_KEEP)
        return reject(r, c, 431, "request-header-fields-too-large", "Request header fields too large",
                      "the request header block (or its number of header fields) exceeds max_header_bytes",
                      CM_OUT_REJECTED);
    if (block_bad)
        return reject(r, c, 400, "bad-request", "Bad request", block_bad, CM_OUT_REJECTED);
    if (r->target_res != CM_TARGET_OK)
        return reject(r, c, 400, "bad-request", "Bad request", r->target_why, CM_OUT_REJECTED);
    if (method_case_variant(method))
        return reject(r, c, 501, "not-implemented", "Not implemented",
                      "methods are case-sensitive; this one is a case variant of a standard method", CM_OUT_REJECTED);
    if (strcmp(method, "CONNECT") == 0) /* a tunnel, which a reverse proxy does not give (nor does nginx) */
        return reject(r, c, 501, "not-implemented", "Not implemented", "CONNECT is not supported", CM_OUT_REJECTED);

    /* SPEC 7, 9: a request whose scope needs a JWT has its token checked first (401 before any 400) whenever the
     * route's idempotency or ordering rules apply to it, whatever key: says */
    bool keyed = route && route->idem.key != CONF_KEY_OFF && (route->methods & conf_method_bit(method));
    /* mode: shadow forwards everything as key: off would; a request it cannot classify records no decision */
    bool shadow = keyed && route->idem.mode == CONF_MODE_SHADOW;
    order_match(r, route, method);
    if ((keyed || job->ordered) && route_needs_jwt(route)) {
        const char *why = jwt_check(r, route);
        if (why && route->idem.mode == CONF_MODE_SHADOW) {
            keyed = false;
            job->ordered = false; /* no scope to judge it in: forwarded, the guard not consulted */
        } else if (why) {
            gw_job_problem(job, 401, "invalid-credentials", "Invalid credentials", why);
            cm_hdrs_add(&job->resp_hdrs, "WWW-Authenticate", "Bearer error=\"invalid_token\"");
            gw_job_count(job, CM_OUT_REJECTED);
            gw_trace_outcome(job, CM_OUT_REJECTED);
            return queue_answer(r, c);
        }
    }

    size_t hosts = header_count(&r->in_hdrs, "Host"); /* RFC 9112 3.2 */
    if (hosts > 1 || (hosts == 0 && version && strcmp(version, "HTTP/1.1") == 0))
        return reject(r, c, 400, "bad-request", "Bad request", "an HTTP/1.1 request needs exactly one Host header",
                      CM_OUT_REJECTED);
    /* SPEC 7: it is forwarded as X-Forwarded-Host, which the upstream trusts: one host, nothing else */
    const char *host = cm_hdrs_get(&r->in_hdrs, "Host");
    if (host && !cm_host_ok(host, strlen(host)))
        return reject(r, c, 400, "bad-request", "Bad request",
                      "Host must be one host name, IPv4 address or bracketed IPv6 address, with an optional :port",
                      CM_OUT_REJECTED);
    if (!headers_well_formed(&r->in_hdrs, keyed ? route->idem.header : NULL) || framing_ambiguous(&r->in_hdrs))
        return reject(r, c, 400, "bad-request", "Bad request", "malformed header field or ambiguous message framing",
                      CM_OUT_REJECTED);
    /* RFC 9112 6.1: Transfer-Encoding in an HTTP/1.0 message is faulty framing (a 1.0 hop would read the chunks
     * as the next request); the 400 closes the connection. */
    if (version && strcmp(version, "HTTP/1.0") == 0 && cm_hdrs_get(&r->in_hdrs, "Transfer-Encoding") != NULL)
        return reject(r, c, 400, "bad-request", "Bad request", "Transfer-Encoding in an HTTP/1.0 request",
                      CM_OUT_REJECTED);
    if (transfer_coding_unsupported(&r->in_hdrs))
        return reject(r, c, 501, "not-implemented", "Not implemented",
                      "the only transfer coding accepted on a request body is chunked", CM_OUT_REJECTED);
    if (!job->upstream)
        return reject(r, c, 404, "route-not-found", "No route", "no route matches this path", CM_OUT_REJECTED);

    uint64_t max_body = route ? route->idem.max_body : conf->max_body, body_need = 0;
    const char *cl = cm_hdrs_get(&r->in_hdrs, "Content-Length");
    if (cl) { /* framing_ambiguous let only 1*DIGIT through; more than 19 significant digits is over any max_body */
        size_t n = strlen(cl);
        while (n > 1 && *cl == '0')
            cl++, n--;
        uint64_t v;
        if (!cm_parse_digits(cl, n, 19, &v) || v > max_body)
            return reject(r, c, 413, "payload-too-large", "Payload too large", "the request body exceeds max_body",
                          CM_OUT_REJECTED);
        body_need = v;
    }
    if (!cm_buffers_admit(body_need))
        return shed_buffers(r, c);
    cm_buf_init_counted(&job->body, (size_t)max_body);

    /* SPEC 7: two key headers are refused on any request, also one that passes through (a method outside the
     * route's, key: off, the default upstream): which one counts would depend on who reads it. Shadow mode forwards
     * everything. */
    struct gw_reqparts *parts = parts_of(r);
    struct gw_value kv; /* a header's value: nothing to release */
    if (!(route && route->idem.mode == CONF_MODE_SHADOW)) {
        const char *kname = route && route->idem.header ? route->idem.header : "Idempotency-Key";
        if (gw_parts_count(parts, GW_PART_HEADER, kname) > 1)
            return reject(r, c, 400, "idempotency-key-invalid", "Idempotency key invalid",
                          "the request carries more than one idempotency key header", CM_OUT_REJECTED);
    }
    const struct conf_part *key_from = keyed && route->idem.key_from.header ? &route->idem.key_from : NULL;
    if (key_from && conf_part_reads_body(key_from->kind)) {
        r->key_in_body = true; /* read in submit, once the body is in */
    } else if (key_from && key_from->kind == CONF_PART_QPARAM) {
        enum gw_key_res kr = gw_key_from(key_from, parts, job->key, &job->key_len);
        if (!shadow && key_refused(kr, route))
            return refuse_key(r, c, kr);
        job->idempotent = kr == GW_KEY_OK;
        job->shadow = job->idempotent && shadow;
    } else if (keyed && shadow) {
        job->idempotent = job->shadow = gw_parts_count(parts, GW_PART_HEADER, route->idem.header) == 1 &&
                                        gw_parts_value(parts, GW_PART_HEADER, route->idem.header, 0, &kv) &&
                                        gw_key_parse(kv.p, kv.n, job->key, &job->key_len);
    } else if (keyed) {
        if (!gw_parts_value(parts, GW_PART_HEADER, route->idem.header, 0, &kv)) {
            if (route->idem.key == CONF_KEY_REQUIRED)
                return reject(r, c, 400, "idempotency-key-missing", "Idempotency key missing",
                              "this route requires an idempotency key header", CM_OUT_REJECTED);
        } else if (!gw_key_parse(kv.p, kv.n, job->key, &job->key_len)) {
            return reject(r, c, 400, "idempotency-key-invalid", "Idempotency key invalid",
                          "the key must be 1 to 255 visible ASCII characters, bare or as a quoted sf-string",
                          CM_OUT_REJECTED);
        } else {
            job->idempotent = true;
        }
    }
    if (job->idempotent && !job->shadow && route->idem.prefer_wait_max_ms &&
        gw_prefer_wait(&r->in_hdrs, &job->prefer_wait_s)) {
        uint64_t cap = route->idem.prefer_wait_max_ms; /* SPEC 12: min(N, prefer_wait_max), in whole seconds */
        job->prefer_wait = true;
        job->prefer_wait_ms = job->prefer_wait_s * 1000 < cap ? job->prefer_wait_s * 1000 : cap;
        job->prefer_wait_s = job->prefer_wait_ms / 1000;
        job->prefer_wait_ms = job->prefer_wait_s * 1000;
    }
    if (!order_headers(r, route)) {
        if (!shadow)
            return reject(r, c, 400, "sequence-invalid", "Sequence invalid",
                          "the ordering sequence must be one decimal integer from 1 to 9223372036854775807 without "
                          "sign or leading zero",
                          CM_OUT_REJECTED);
        job->ordered = false; /* mode: shadow refuses nothing (SPEC 10): forwarded, the guard not consulted */
    }
    if (cm_hdrs_get(&r->in_hdrs, "Transfer-Encoding")) { /* exactly "chunked" by now */
        r->chunked = true;
        r->body_base = method + header_block_size(c);
    }
    r->stage = STAGE_BODY;
    return MHD_YES;
}

/* ---- chunked framing (SPEC 7): libmicrohttpd 0.9.75 takes a bare LF for CR LF after a chunk size, a chunk
 * extension and a chunk's data (process_request_body: "TODO: Add an option to disallow bare LF";
 * MHD_OPTION_STRICT_FOR_CLIENT does not reach that code), and parses trailers with its header-line code (obs-fold is
 * appended to the field's name; Content-Length is kept as a footer). A server in front of the gateway that reads
 * the framing strictly would see other message boundaries. The body parser leaves the framing in its read buffer,
 * which starts right after the header block and is compacted back to there after each pass, and hands each chunk's
 * data over as a pointer into it: the bytes it consumed before a piece are either what follows the previous piece
 * (same pass) or what starts the buffer (a new pass), and one of them must be exactly the framing. */

/* from[0..n) is a chunk's framing as RFC 9112 7.1 has it: optionally the CR LF ending the previous chunk's data, then
 * (unless n is 0: the same chunk goes on) a chunk-size line: 1*HEXDIG, optionally ";" and an extension of visible
 * ASCII, SP or HTAB, and CR LF. */
static bool chunk_gap_ok(const char *from, size_t n)
{
    size_t i = 0;
    if (n >= 2 && from[0] == '\r' && from[1] == '\n')
        i = 2;
    if (i == n)
        return true;
    size_t hex = 0;
    while (i < n && isxdigit((unsigned char)from[i]))
        i++, hex++;
    if (hex == 0)
        return false;
    if (i < n && from[i] == ';')
        while (i < n && ((from[i] > 0x20 && from[i] < 0x7f) || from[i] == ' ' || from[i] == '\t'))
            i++;
    return n - i == 2 && from[i] == '\r' && from[i + 1] == '\n';
}

#define CHUNK_GAP_MAX 1024 /* a chunk-size line with its extension, at most */

/* The framing libmicrohttpd consumed before the body piece at data is sound (bounded reads inside its read buffer:
 * body_base .. data). */
static bool chunk_framing_ok(const struct req *r, const char *data)
{
    uintptr_t d = (uintptr_t)data, base = (uintptr_t)r->body_base, prev = (uintptr_t)r->data_end;
    if (!r->body_base || d < base)
        return false; /* not the layout this check knows: fail closed */
    if (r->data_end && prev >= base && prev <= d && d - prev <= CHUNK_GAP_MAX && chunk_gap_ok(r->data_end, d - prev))
        return true;
    return d - base <= CHUNK_GAP_MAX && chunk_gap_ok(r->body_base, d - base);
}

/* The trailer section of a chunked body as the header-line parser left it in place: it always starts the read buffer
 * (the body parser moves what is left after the last chunk there, and reads later bytes into it), each line end CR
 * LF made two NULs (a bare LF makes one), then the empty line (two NULs). The trailers must tile it in order; only
 * their pointers and the two bytes after each value are read. */
struct chunk_tail {
    const char *p; /* where the next trailer's name must start */
    bool ok;
};

static enum MHD_Result tail_trailer(void *cls, enum MHD_ValueKind kind, const char *key, size_t klen, const char *value,
                                    size_t vlen)
{
    struct chunk_tail *t = cls;
    if (t->ok && (key != t->p || !value || (uintptr_t)value < (uintptr_t)key))
        t->ok = false;
    if (t->ok) { /* the value's NUL, then the second NUL of its line end (or, after a bare LF, the next line) */
        t->p = value + vlen;
        t->ok = t->p[0] == '\0' && t->p[1] == '\0';
        t->p += 2;
    }
    return t->ok ? MHD_YES : MHD_NO;
}

static bool chunk_trailers_ok(const struct req *r, struct MHD_Connection *c)
{
    if (!r->body_base)
        return false;
    struct chunk_tail t = {.p = r->body_base, .ok = true};
    MHD_get_connection_values_n(c, MHD_FOOTER_KIND, tail_trailer, &t);
    return t.ok && t.p[0] == '\0' && t.p[1] == '\0';
}

/* Trailer fields that would change how the message is framed, routed or read if anybody merged them */
static bool trailer_forbidden(const char *name)
{
    static const char *const names[] = {"Content-Length", "Transfer-Encoding", "Host",         "Trailer",
                                        "Content-Type",   "Content-Encoding",  "Content-Range"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcasecmp(name, names[i]) == 0)
            return true;
    return false;
}

/* Each trailer: a token name not in trailer_forbidden, a sound value, and the two where libmicrohttpd parsed them in
 * place: the value right after the name's NUL (the colon) and its OWS. A folded trailer's name was moved into a new
 * allocation (0.9.75's process_broken_line), so its value is not there. At most 64 bytes after the name are read. */
static enum MHD_Result trailer_check(void *cls, enum MHD_ValueKind kind, const char *key, size_t klen,
                                     const char *value, size_t vlen)
{
    const char **why = cls;
    if (*why)
        return MHD_NO;
    const char *s = key + klen + 1;
    bool adjacent = value && (uintptr_t)value >= (uintptr_t)s && (uintptr_t)value - (uintptr_t)s <= 64;
    for (; adjacent && s < value; s++)
        adjacent = *s == ' ' || *s == '\t';
    if (!adjacent || key[klen] != '\0')
        *why = "a chunked body's trailer is folded (obs-fold)";
    else if (!cm_token_ok(key, klen) || !cm_field_value_ok(value, vlen))
        *why = "a chunked body's trailer is malformed";
    else if (trailer_forbidden(key))
        *why = "a chunked body's trailer names a framing or routing field";
    return *why ? MHD_NO : MHD_YES;
}

/* SPEC 12, on a route with a json: or form: part, for a request its rules apply to: a body declared JSON must be
 * JSON (400 bad-request), a key_from key in the body is read (400 as on_headers), and a json: resource is read (400
 * sequence-invalid). false with *res when refused; mode: shadow refuses nothing (the request then goes unjudged). */
static bool body_parts(struct req *r, struct MHD_Connection *c, struct gw_reqparts *parts, enum MHD_Result *res)
{
    struct gw_job *job = &r->job;
    const struct conf_route *route = job->route;
    bool shadow = route->idem.mode == CONF_MODE_SHADOW;
    if (gw_parts_declares_json(parts) && !gw_parts_body_is_json(parts)) {
        if (shadow) {
            job->idempotent = job->shadow = job->ordered = r->key_in_body = false;
            return true;
        }
        gw_reqparts_free(parts);
        *res = reject(r, c, 400, "bad-request", "Bad request",
                      "the body is not valid JSON (RFC 8259, no duplicate member names) as its Content-Type says",
                      CM_OUT_REJECTED);
        return false;
    }
    if (r->key_in_body) {
        enum gw_key_res kr = gw_key_from(&route->idem.key_from, parts, job->key, &job->key_len);
        if (!shadow && key_refused(kr, route)) {
            gw_reqparts_free(parts);
            *res = refuse_key(r, c, kr);
            return false;
        }
        job->idempotent = kr == GW_KEY_OK;
        job->shadow = job->idempotent && shadow;
    }
    if (job->ordered && route->ordering.resource_json) {
        struct conf_part src = {.kind = CONF_PART_JSON, .header = route->ordering.resource};
        char res_text[GW_KEY_MAX + 1];
        if (gw_key_from(&src, parts, res_text, &job->resource_len) == GW_KEY_OK) {
            job->resource = cm_strndup(res_text, job->resource_len);
        } else if (shadow) {
            job->ordered = false;
        } else {
            gw_reqparts_free(parts);
            *res = reject(r, c, 400, "sequence-invalid", "Sequence invalid",
                          "the body must be JSON with a string (1 to 255 bytes) or an integer at the ordering "
                          "resource's JSON Pointer",
                          CM_OUT_REJECTED);
            return false;
        }
    }
    return true;
}

/* Final call: the body is in; hash it and hand the job to the loop. */
static enum MHD_Result submit(struct req *r, struct MHD_Connection *c)
{
    struct gw_job *job = &r->job;
    if (r->body_too_large)
        return reject(r, c, 413, "payload-too-large", "Payload too large", "the request body exceeds max_body",
                      CM_OUT_REJECTED);
    if (r->chunked && !r->chunk_why)
        MHD_get_connection_values_n(c, MHD_FOOTER_KIND, trailer_check, &r->chunk_why);
    if (r->chunked && !r->chunk_why && !chunk_trailers_ok(r, c))
        r->chunk_why = "a chunked body's trailer section ends a line with a bare LF";
    if (r->chunk_why) /* 400 closes the connection */
        return reject(r, c, 400, "bad-request", "Bad request", r->chunk_why, CM_OUT_REJECTED);
    if (r->body_over_budget)
        return shed_buffers(r, c);
    if (!signature_ok(r)) {
        gw_job_problem(job, 401, "signature-invalid", "Signature invalid",
                       "the delivery's signature does not verify with the route's secrets, or its timestamp is "
                       "outside the tolerance");
        cm_hdrs_add(&job->resp_hdrs, "WWW-Authenticate",
                    gw_verify_challenge(r->cref->verify[job->route - job->conf->routes]));
        gw_job_count(job, CM_OUT_REJECTED);
        gw_trace_outcome(job, CM_OUT_REJECTED);
        return queue_answer(r, c);
    }
    job->bytes_in = job->body.len;
    struct gw_reqparts *parts = parts_of(r); /* the body is in */
    if (job->route && job->route->reads_body && (r->key_in_body || job->idempotent || job->ordered)) {
        enum MHD_Result res;
        if (!body_parts(r, c, parts, &res))
            return res;
    }
    if (job->ordered && job->route->ordering.source == CONF_SEQ_JSON &&
        !gw_seq_from_parts(parts, CONF_SEQ_JSON, job->route->ordering.seq_name, &job->seq)) {
        gw_reqparts_free(parts); /* the body's index does not wait for the answer to be read */
        if (job->route->idem.mode != CONF_MODE_SHADOW)
            return reject(r, c, 400, "sequence-invalid", "Sequence invalid",
                          "the body must be JSON with an integer from 1 to 9223372036854775807 at the ordering "
                          "sequence's JSON Pointer",
                          CM_OUT_REJECTED);
        job->ordered = false; /* mode: shadow refuses nothing (SPEC 10): forwarded, the guard not consulted */
    }
    if (job->idempotent || job->ordered) {
        const struct conf_idem *im = &job->route->idem;
        gw_hash_parts(im->fingerprint, im->fingerprint_n, parts, job->fp);
        gw_hash_parts(im->scope, im->scope_n, parts, job->scope);
        if (job->idempotent && im->on_unknown == CONF_UNKNOWN_PROBE) /* SPEC 9: the look-up asks as this tenant */
            gw_scope_probe_headers(im->scope, im->scope_n, parts, &job->probe_hdrs);
    }
    gw_reqparts_free(parts); /* nothing reads the request's parts past here: the body's index goes now */
    job->loop = r->shard->loop;
    job->ctx = gw_loop_ctx(job->loop);
    /* A replay the cache holds is answered now: no suspend, no hand-over, and no forwarding headers built; when
     * the answer can be shared, from the cache's prepared one (its body and headers, with this request's id). */
    bool share = strcmp(job->method, "HEAD") != 0 && !atomic_load(&r->shard->f->shutting_down);
    bool queued = false;
    switch (gw_pipeline_answer_cached(job, share ? c : NULL, &queued)) {
    case GW_CACHED_QUEUED: {
        answer_deadline(c);
        r->stage = STAGE_ANSWERED;
        gw_trace_end(job, job->ctx->tracer);
        return queued ? MHD_YES : MHD_NO;
    }
    case GW_CACHED_ANSWER:
        return queue_answer(r, c);
    case GW_CACHED_NONE:
    default:
        break;
    }
    build_forward_headers(r, c);
    cm_hdrs_free(&r->in_hdrs);
    struct gw_conn *t = track_of(c);
    if (t)
        gw_conn_waiting(t);
    r->stage = STAGE_SUBMITTED;
    atomic_fetch_add(&r->shard->f->suspended, 1);
    MHD_suspend_connection(c);
    gw_loop_submit(job->loop, gw_pipeline_run, job);
    return MHD_YES;
}

static enum MHD_Result handler(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                               const char *version, const char *upload_data, size_t *upload_data_size, void **req_cls)
{
    struct req *r = *req_cls;
    if (!r) /* no URI callback ran: should not happen */
        return MHD_NO;
    switch (r->stage) {
    case STAGE_NEW: {
        enum MHD_Result ret = on_headers(r, c, method, version);
        if (r->stage == STAGE_ANSWERED || ret != MHD_YES)
            return ret;
        if (*upload_data_size == 0)
            return MHD_YES; /* MHD calls again with the body or the final call */
        /* fall through: some MHD versions deliver data on the first call */
    }
    /* fall through */
    case STAGE_BODY:
        if (*upload_data_size) {
            if (r->chunked && !r->chunk_why && !chunk_framing_ok(r, upload_data))
                r->chunk_why = "chunked framing with a bare LF, or a chunk extension that is not visible ASCII";
            r->data_end = upload_data + *upload_data_size;
            if (!r->body_too_large && !r->body_over_budget &&
                !cm_buf_append(&r->job.body, upload_data, *upload_data_size)) {
                /* over max_body, or (within it) over what limits.buffers has left */
                if (*upload_data_size > r->job.body.max || r->job.body.len > r->job.body.max - *upload_data_size)
                    r->body_too_large = true;
                else
                    r->body_over_budget = true;
                cm_buf_free(&r->job.body);
            }
            *upload_data_size = 0;
            return MHD_YES;
        }
        return submit(r, c);
    case STAGE_SUBMITTED:
        if (!atomic_load(&r->job.done))
            return MHD_YES; /* spurious call; still suspended work */
        atomic_fetch_sub(&r->shard->f->suspended, 1);
        return queue_answer(r, c);
    case STAGE_ANSWERED:
    default:
        if (upload_data_size)
            *upload_data_size = 0; /* discard the rest of a rejected body */
        return MHD_YES;
    }
}

/* Raw request target: MHD must not unescape it (the path is forwarded as is). */
static size_t no_unescape(void *cls, struct MHD_Connection *c, char *s)
{
    return strlen(s);
}

static bool make_addr(const struct conf_addr *a, struct sockaddr_storage *ss, char **err)
{
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    char port[8];
    snprintf(port, sizeof port, "%u", a->port);
    int rc = getaddrinfo(a->host, port, &hints, &res);
    if (rc != 0 || !res) {
        *err = cm_asprintf("cannot resolve listen address %s: %s", a->host, gai_strerror(rc));
        return false;
    }
    memset(ss, 0, sizeof *ss);
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    return true;
}

/* ---- each daemon on its loop thread */

/* Runs the daemon and arms the timer for what it has to do next. */
static void shard_run(struct shard *sh)
{
    if (!sh->d)
        return;
    MHD_run(sh->d);
    MHD_UNSIGNED_LONG_LONG ms = 0;
    if (MHD_get_timeout(sh->d, &ms) == MHD_YES) {
        struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
        evtimer_add(sh->tick, &tv);
    } else {
        evtimer_del(sh->tick);
    }
}

static void shard_cb(evutil_socket_t fd, short what, void *arg)
{
    shard_run(arg);
}

/* A call run on a loop thread while the caller waits (bounded). */
struct sync_call {
    void (*fn)(struct shard *);
    struct shard *sh;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
};

static void sync_call_run(void *arg)
{
    struct sync_call *c = arg;
    c->fn(c->sh);
    pthread_mutex_lock(&c->mu);
    c->done = true;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* Runs fn(sh) on sh's loop thread and waits up to 10 s. Returns false on a
 * timeout (the call is then leaked: it may still run). */
static bool on_loop(struct shard *sh, void (*fn)(struct shard *))
{
    struct sync_call *c = cm_calloc(1, sizeof *c);
    c->fn = fn;
    c->sh = sh;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    gw_loop_submit(sh->loop, sync_call_run, c);
    uint64_t deadline = cm_now_ms() + 10000;
    pthread_mutex_lock(&c->mu);
    while (!c->done && cm_now_ms() < deadline) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
    bool done = c->done;
    pthread_mutex_unlock(&c->mu);
    if (!done) {
        cm_log(CM_ERROR, "front_loop_call_timeout", NULL);
        return false;
    }
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
    return true;
}

/* ---- accepting: every loop watches the one listening socket; a connection goes to the loop holding the fewest */

#define ACCEPT_BATCH    64  /* connections accepted per wake-up before the loop turns to its other events */
#define HANDOFF_SLACK   1   /* a connection stays on the loop that accepted it unless another holds this many fewer */
#define ACCEPT_PAUSE_MS 100 /* after EMFILE, ENFILE, ENOBUFS or ENOMEM */

struct handoff {
    struct shard *sh;
    int fd;
    socklen_t len;
    struct sockaddr_storage sa;
};

static long shard_load(struct shard *sh)
{
    return atomic_load_explicit(&sh->open, memory_order_relaxed) +
           atomic_load_explicit(&sh->incoming, memory_order_relaxed);
}

/* The loop a connection accepted on self goes to: the one holding the fewest, self unless another holds at least
 * HANDOFF_SLACK fewer (a hand-off costs a wake-up of the other loop). */
static struct shard *place_on(struct shard *self)
{
    struct gw_front *f = self->f;
    struct shard *best = self;
    long mine = shard_load(self), least = mine;
    for (size_t i = 0; i < f->nshards; i++) {
        struct shard *o = &f->shards[i];
        if (o == self || atomic_load(&o->quiesced))
            continue;
        long l = shard_load(o);
        if (l < least) {
            least = l;
            best = o;
        }
    }
    return mine - least >= HANDOFF_SLACK ? best : self;
}

/* On sh's loop thread: the daemon takes the connection (MHD closes it when it cannot); with MHD_USE_TURBO it
 * waits in the daemon's ready list, so the daemon runs now. */
static void shard_add(struct shard *sh, int fd, const struct sockaddr_storage *sa, socklen_t len)
{
    if (atomic_load(&sh->quiesced) || !sh->d) {
        close(fd);
        return;
    }
    (void)MHD_add_connection(sh->d, fd, (const struct sockaddr *)sa, len);
}

static void handoff_run(void *arg)
{
    struct handoff *h = arg;
    struct shard *sh = h->sh;
    shard_add(sh, h->fd, &h->sa, h->len);
    atomic_fetch_sub(&sh->incoming, 1);
    free(h);
    shard_run(sh);
}

static void accept_retry_cb(evutil_socket_t fd, short what, void *arg)
{
    struct shard *sh = arg;
    (void)fd;
    (void)what;
    if (!atomic_load(&sh->quiesced) && sh->acc)
        event_add(sh->acc, NULL);
}

static void accept_cb(evutil_socket_t lfd, short what, void *arg)
{
    struct shard *sh = arg;
    (void)what;
    bool added = false;
    for (int i = 0; i < ACCEPT_BATCH && !atomic_load(&sh->quiesced); i++) {
        struct sockaddr_storage sa;
        socklen_t len = sizeof sa;
        int fd = accept4(lfd, (struct sockaddr *)&sa, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            int e = errno;
            if (e == EAGAIN || e == EWOULDBLOCK)
                break;
            if (e == EINTR || e == ECONNABORTED || e == EPROTO || e == EPERM || e == ENETDOWN || e == ENOPROTOOPT ||
                e == EHOSTDOWN || e == ENONET || e == EHOSTUNREACH || e == EOPNOTSUPP || e == ENETUNREACH)
                continue; /* that connection is gone; the next one may be fine */
            /* Out of descriptors or memory (or the socket is gone): listen again later, the backlog waits. */
            cm_log(CM_WARN, "accept_failed", "error=\"%s\" pause_ms=%d", strerror(e), ACCEPT_PAUSE_MS);
            event_del(sh->acc);
            struct timeval tv = {0, ACCEPT_PAUSE_MS * 1000};
            evtimer_add(sh->acc_retry, &tv);
            break;
        }
        struct shard *to = place_on(sh);
        if (to == sh) {
            shard_add(sh, fd, &sa, len);
            added = true;
            continue;
        }
        struct handoff *h = cm_malloc(sizeof *h);
        h->sh = to;
        h->fd = fd;
        h->len = len;
        memcpy(&h->sa, &sa, sizeof sa);
        atomic_fetch_add(&to->incoming, 1);
        gw_loop_submit(to->loop, handoff_run, h);
    }
    if (added)
        shard_run(sh);
}

static void shard_attach(struct shard *sh)
{
    struct event_base *base = gw_loop_base(sh->loop);
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(sh->d, MHD_DAEMON_INFO_EPOLL_FD);
    sh->tick = evtimer_new(base, shard_cb, sh);
    sh->kick = evtimer_new(base, shard_cb, sh);
    sh->acc = event_new(base, sh->f->lsock, EV_READ | EV_PERSIST, accept_cb, sh);
    sh->acc_retry = evtimer_new(base, accept_retry_cb, sh);
    if (di && sh->tick && sh->kick) {
        sh->io = event_new(base, di->epoll_fd, EV_READ | EV_PERSIST, shard_cb, sh);
        if (sh->io)
            event_add(sh->io, NULL);
    }
    if (!sh->io || !sh->tick || !sh->kick || !sh->acc || !sh->acc_retry)
        abort(); /* out of memory */
    event_add(sh->acc, NULL);
    shard_run(sh);
}

/* On sh's loop thread: no new connection any more. Hand-offs to sh already queued close their connection. */
static void shard_quiesce(struct shard *sh)
{
    atomic_store(&sh->quiesced, true);
    if (sh->acc)
        event_del(sh->acc);
    if (sh->acc_retry)
        evtimer_del(sh->acc_retry);
}

static void shard_detach(struct shard *sh)
{
    shard_quiesce(sh);
    if (sh->io)
        event_free(sh->io);
    if (sh->tick)
        event_free(sh->tick);
    if (sh->kick)
        event_free(sh->kick);
    if (sh->acc)
        event_free(sh->acc);
    if (sh->acc_retry)
        event_free(sh->acc_retry);
    sh->io = sh->tick = sh->kick = sh->acc = sh->acc_retry = NULL;
}

static void shard_nop(struct shard *sh)
{
    (void)sh;
}

/* Every loop stops accepting, then each runs what was queued to it before (hand-offs from a loop that accepted
 * just before it stopped): after this no hand-off is left anywhere. False when a loop did not answer. */
static bool front_stop_accepting(struct gw_front *f)
{
    bool all = true;
    for (size_t i = 0; i < f->nshards; i++)
        all = on_loop(&f->shards[i], shard_quiesce) && all;
    for (size_t i = 0; i < f->nshards; i++)
        all = on_loop(&f->shards[i], shard_nop) && all;
    return all;
}

/* The listening socket, made as libmicrohttpd makes its own: SO_REUSEADDR, IPv6 only for an IPv6 address. */
static int listen_socket(const struct sockaddr_storage *ss, uint16_t *port)
{
    int fd = socket(ss->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (ss->ss_family == AF_INET6)
        (void)setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    socklen_t len = ss->ss_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
    if (bind(fd, (const struct sockaddr *)ss, len) != 0 || listen(fd, 4096) != 0) {
        close(fd);
        return -1;
    }
    struct sockaddr_storage b;
    socklen_t blen = sizeof b;
    if (getsockname(fd, (struct sockaddr *)&b, &blen) != 0) {
        close(fd);
        return -1;
    }
    *port =
        ntohs(b.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&b)->sin6_port : ((struct sockaddr_in *)&b)->sin_port);
    return fd;
}

static struct MHD_Daemon *start_daemon(struct shard *sh, size_t mem, unsigned timeout_s)
{
    const struct conf *conf = sh->f->conf;
    unsigned flags = MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG | MHD_USE_TURBO |
                     MHD_USE_NO_LISTEN_SOCKET; /* the front accepts (accept_cb) */
    bool tls = sh->f->tls != NULL;
    return MHD_start_daemon(flags | (tls ? MHD_USE_TLS : 0), 0, NULL, NULL, handler, sh, MHD_OPTION_EXTERNAL_LOGGER,
                            gw_mhd_log, "front", MHD_OPTION_ARRAY, gw_tls_mhd_options(tls), MHD_OPTION_CONNECTION_LIMIT,
                            (unsigned)(conf->max_connections + 64), MHD_OPTION_CONNECTION_TIMEOUT, timeout_s,
                            MHD_OPTION_CONNECTION_MEMORY_LIMIT, mem, MHD_OPTION_URI_LOG_CALLBACK, uri_log, sh,
                            MHD_OPTION_NOTIFY_COMPLETED, completed, sh, MHD_OPTION_NOTIFY_CONNECTION, conn_notify, sh,
                            MHD_OPTION_UNESCAPE_CALLBACK, no_unescape, sh, MHD_OPTION_END);
}

/* Main thread, with no loop running a daemon any more (each detached, or never attached); the socket is closed
 * once, here or at quiesce. */
static void front_free(struct gw_front *f)
{
    for (size_t i = 0; i < f->nshards; i++) {
        if (f->shards[i].d) {
            MHD_stop_daemon(f->shards[i].d);
            gw_tls_unbind(f->shards[i].d);
        }
        f->shards[i].d = NULL;
        for (struct req *r = f->shards[i].spare, *next; r; r = next) {
            memcpy(&next, r, sizeof next);
            free(r);
        }
    }
    gw_tls_destroy(f->tls);
    if (f->lsock != MHD_INVALID_SOCKET && !f->lsock_closed)
        close(f->lsock);
    free(f->shards);
    gw_conntrack_stop(f->conns); /* after the daemons: they told it of every close */
    free(f);
}

struct gw_front *gw_front_start(const struct conf *conf, struct gw_tls_creds *tls, struct gw_loops *loops, char **err)
{
    struct gw_front *f = cm_calloc(1, sizeof *f);
    f->conf = conf;
    f->lsock = MHD_INVALID_SOCKET;
    struct sockaddr_storage ss;
    if (!make_addr(&conf->listen, &ss, err)) {
        free(f);
        return NULL;
    }
    f->conns = gw_conntrack_start(conf->client_timeout_ms, "front", err);
    if (!f->conns) {
        free(f);
        return NULL;
    }
    /* libmicrohttpd 0.9.75 clears the whole per-connection pool on every request, so each connection costs
     * exactly this much resident memory. The answer's head is written into the same pool while it still holds
     * the request's head (the headers MHD handed us point into it) and the records of the request's headers:
     * room for both at their limits, plus slack for those records and MHD's own answer headers. Over
     * max_header_bytes the front answers 431; a request head that overflows the pool gets MHD's own 431. */
    cm_buffers_set_limit(conf->limits_buffers); /* SPEC 7: bodies and answers held at once, process-wide */
    size_t mem = (size_t)conf->max_header_bytes + (size_t)conf->max_response_header_bytes + GW_POOL_SLACK;
    if (mem < 16 * 1024)
        mem = 16 * 1024;
    /* raw_block_check relies on 0.9.75's in-place parse; another version fails closed (every request 400) */
    const char *mhd_version = MHD_get_version();
    if (!mhd_version || strcmp(mhd_version, "0.9.75") != 0)
        cm_log(CM_WARN, "mhd_version_unverified",
               "version=%.32s msg=\"the header block check was verified against libmicrohttpd 0.9.75 only; with "
               "another layout every request is refused with 400\"",
               mhd_version ? mhd_version : "unknown");
    unsigned timeout_s = (unsigned)((conf->client_timeout_ms + 999) / 1000);
    f->tls = tls ? gw_tls_create(tls) : NULL; /* front_free destroys it from here on */
    f->lsock = listen_socket(&ss, &f->port);
    if (f->lsock < 0) {
        f->lsock = MHD_INVALID_SOCKET;
        char addr[320];
        *err = cm_asprintf("cannot listen on %s (address in use or not permitted)",
                           conf_addr_fmt(addr, sizeof addr, conf->listen.host, conf->listen.port));
        front_free(f);
        return NULL;
    }
    f->shards = cm_calloc(loops->n, sizeof *f->shards);
    for (size_t i = 0; i < loops->n; i++) {
        struct shard *sh = &f->shards[i];
        sh->f = f;
        sh->loop = loops->v[i];
        sh->d = start_daemon(sh, mem, timeout_s);
        f->nshards = i + 1;
        if (sh->d && f->tls)
            gw_tls_bind(f->tls, sh->d); /* before attach: no connection comes before it */
        if (!sh->d) {
            *err = cm_asprintf("cannot start the HTTP daemon of loop %zu", i);
            front_free(f);
            return NULL;
        }
    }
    for (size_t i = 0; i < f->nshards; i++) {
        if (!on_loop(&f->shards[i], shard_attach)) {
            *err = cm_asprintf("the I/O loop did not take its HTTP daemon");
            return NULL; /* a loop is stuck: leak rather than race it */
        }
    }
    return f;
}

void gw_front_tls_set(struct gw_front *f, struct gw_tls_creds *tls)
{
    if (f->tls && tls)
        gw_tls_set(f->tls, tls);
}

uint16_t gw_front_port(const struct gw_front *f)
{
    return f->port;
}

long gw_front_suspended(struct gw_front *f)
{
    return atomic_load(&f->suspended);
}

void gw_front_quiesce(struct gw_front *f)
{
    atomic_store(&f->shutting_down, true);
    bool all = front_stop_accepting(f);
    if (all && f->lsock != MHD_INVALID_SOCKET && !f->lsock_closed) {
        close(f->lsock);
        f->lsock_closed = true;
    }
}

void gw_front_stop(struct gw_front *f)
{
    if (!f)
        return;
    (void)front_stop_accepting(f);
    for (size_t i = 0; i < f->nshards; i++)
        (void)on_loop(&f->shards[i], shard_detach);
    front_free(f);
}
