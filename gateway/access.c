/* access.c - a request's access line and the count of its outcome (gateway/access.h). */
#include "gateway/access.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/alog.h"
#include "common/common.h"
#include "gateway/gateway.h"

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void gw_access_start(struct gw_job *job)
{
    job->start_ns = now_ns();
    job->upstream_ms = -1;
    job->outcome = CM_OUT__COUNT; /* not counted yet */
}

void gw_job_count(struct gw_job *job, enum cm_outcome o)
{
    job->outcome = o;
    cm_metric_request(job->route_index, o);
}

/* A value as logfmt has it: bare when it holds nothing but these (and fits in buf), else quoted and cut to buf
 * (cm_log_quote). */
static const char *val(char *buf, size_t n, const char *s)
{
    size_t len = 0;
    for (const char *p = s; *p; p++, len++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '-' ||
              *p == '_' || *p == '.' || *p == ':' || *p == '/' || *p == '~' || *p == '+' || *p == '@' || *p == '%'))
            return cm_log_quote(buf, n, s);
    return len > 0 && len < n ? s : cm_log_quote(buf, n, s);
}

struct line {
    char b[CM_ALOG_LINE_MAX];
    size_t n;
};

static void add(struct line *l, const char *fmt, ...) CM_PRINTF(2, 3);
static void add(struct line *l, const char *fmt, ...)
{
    if (l->n >= sizeof l->b - 1)
        return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(l->b + l->n, sizeof l->b - l->n, fmt, ap);
    va_end(ap);
    if (w < 0 || (size_t)w >= sizeof l->b - l->n) { /* cut at the field boundary: this field is left out */
        l->b[l->n] = '\0';
        l->n = sizeof l->b - 1; /* nothing more fits */
        return;
    }
    l->n += (size_t)w;
}

void gw_access_log(const struct gw_job *job, bool client_gone)
{
    if (!cm_alog_enabled())
        return;
    struct line l = {.n = 0};
    char q1[600], q2[2 * GW_KEY_MAX + 8], q3[2 * CM_REQUEST_ID_MAX + 8];
    const char *route = job->route ? job->route->name : job->route_index == CM_ROUTE_DEFAULT ? "_default" : "_none";
    const char *outcome = job->outcome < CM_OUT__COUNT ? cm_outcome_name(job->outcome) : "none";
    char qm[64], qr[160];
    add(&l, "request_id=%s route=%s method=%s path=%s status=%d outcome=%s", val(q3, sizeof q3, job->request_id),
        val(qr, sizeof qr, route), job->method ? val(qm, sizeof qm, job->method) : "-",
        val(q1, sizeof q1, job->path ? job->path : "/"), job->status, outcome);
    if (job->key_len)
        add(&l, " key=%s", cm_log_quote(q2, sizeof q2, job->key));
    if (job->route && job->route->idem.scope_n > 0 && (job->idempotent || job->ordered)) {
        char hex[9];
        cm_hex(job->scope, 4, hex);
        add(&l, " scope=%s", hex);
    }
    add(&l, " replayed=%s", job->replayed ? "true" : "false");
    if (job->orig_request_id[0])
        add(&l, " original_request_id=%s", val(q3, sizeof q3, job->orig_request_id));
    if (job->token)
        add(&l, " token=%llu", (unsigned long long)job->token);
    if (job->upstream_status)
        add(&l, " upstream_status=%d", job->upstream_status);
    if (job->upstream_ms >= 0)
        add(&l, " upstream_ms=%.1f", job->upstream_ms);
    add(&l, " duration_ms=%.1f bytes_in=%llu bytes_out=%llu client=%s", (double)(now_ns() - job->start_ns) / 1e6,
        (unsigned long long)job->bytes_in, (unsigned long long)job->bytes_out,
        job->client[0] ? val(q1, sizeof q1, job->client) : "unknown");
    if (job->trace.incoming) { /* a valid traceparent came in: its trace id */
        char tid[33];
        cm_hex(job->trace.trace_id, sizeof job->trace.trace_id, tid);
        add(&l, " trace_id=%s", tid);
    }
    if (client_gone)
        add(&l, " client_gone=true");
    cm_alog_line(l.b, l.n);
}
