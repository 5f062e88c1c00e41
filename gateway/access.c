/* access.c - a request's access line and the count of its outcome (gateway/access.h). */
#include "gateway/access.h"

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
    /* one bit per byte value: a-z A-Z 0-9 - _ . : / ~ + @ % */
    static const uint32_t bare[8] = {0, 0x07ffe820u, 0x87ffffffu, 0x47fffffeu, 0, 0, 0, 0};
    size_t len = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++, len++)
        if (!(bare[*p >> 5] >> (*p & 31) & 1))
            return cm_log_quote(buf, n, s);
    return len > 0 && len < n ? s : cm_log_quote(buf, n, s);
}

/* The line is built in place, field group by field group (no printf: one line per request). A group that does not
 * fit (with the terminating NUL) is left out whole, and nothing after it is written. */
struct line {
    char b[CM_ALOG_LINE_MAX];
    size_t n;
    size_t mark; /* where the current group began */
    bool over;   /* the current group did not fit */
    bool full;   /* a group was left out: nothing more is written */
};

static void group(struct line *l)
{
    l->mark = l->n;
    l->over = false;
}

static void put(struct line *l, const char *s, size_t n)
{
    if (l->full || l->over || n >= sizeof l->b - l->n) {
        l->over = true;
        return;
    }
    memcpy(l->b + l->n, s, n);
    l->n += n;
}

static void puts_(struct line *l, const char *s)
{
    put(l, s, strlen(s));
}

static void put_u64(struct line *l, uint64_t v)
{
    char d[24];
    size_t i = sizeof d;
    do
        d[--i] = (char)('0' + v % 10);
    while ((v /= 10) != 0);
    put(l, d + i, sizeof d - i);
}

static void put_int(struct line *l, int v)
{
    if (v < 0) {
        put(l, "-", 1);
        put_u64(l, (uint64_t)0 - (uint64_t)(int64_t)v);
    } else {
        put_u64(l, (uint64_t)v);
    }
}

/* x as printf's "%.1f" writes it: the exact binary value rounded to tenths, ties to even. x * 10 in long double
 * is exact (a 53-bit significand times 10 fits in 64 bits). */
static void put_tenths(struct line *l, double x)
{
    if (!(x >= 0 && x < 1e15)) {
        char d[64];
        int w = snprintf(d, sizeof d, "%.1f", x);
        put(l, d, w > 0 && (size_t)w < sizeof d ? (size_t)w : 0);
        return;
    }
    long double t = (long double)x * 10.0L;
    uint64_t v = (uint64_t)t;
    long double f = t - (long double)v;
    if (f > 0.5L || (f == 0.5L && (v & 1)))
        v++;
    put_u64(l, v / 10);
    char frac[2] = {'.', (char)('0' + v % 10)};
    put(l, frac, 2);
}

static void end(struct line *l)
{
    if (l->over && !l->full) { /* cut at the group's boundary: this group is left out */
        l->n = l->mark;
        l->full = true;
    }
}

void gw_access_log(const struct gw_job *job, bool client_gone)
{
    if (!cm_alog_enabled())
        return;
    struct line l;
    l.n = 0;
    l.full = false;
    char q1[600], q2[2 * GW_KEY_MAX + 8], q3[2 * CM_REQUEST_ID_MAX + 8];
    const char *route = job->route ? job->route->name : job->route_index == CM_ROUTE_DEFAULT ? "_default" : "_none";
    const char *outcome = job->outcome < CM_OUT__COUNT ? cm_outcome_name(job->outcome) : "none";
    char qm[64], qr[160];
    group(&l);
    puts_(&l, "request_id=");
    puts_(&l, val(q3, sizeof q3, job->request_id));
    puts_(&l, " route=");
    puts_(&l, val(qr, sizeof qr, route));
    puts_(&l, " method=");
    puts_(&l, job->method ? val(qm, sizeof qm, job->method) : "-");
    puts_(&l, " path=");
    puts_(&l, val(q1, sizeof q1, job->path ? job->path : "/"));
    puts_(&l, " status=");
    put_int(&l, job->status);
    puts_(&l, " outcome=");
    puts_(&l, outcome);
    end(&l);
    if (job->key_len) {
        group(&l);
        puts_(&l, " key=");
        puts_(&l, cm_log_quote(q2, sizeof q2, job->key));
        end(&l);
    }
    if (job->route && job->route->idem.scope_n > 0 && (job->idempotent || job->ordered)) {
        char hex[9];
        cm_hex(job->scope, 4, hex);
        group(&l);
        puts_(&l, " scope=");
        put(&l, hex, 8);
        end(&l);
    }
    group(&l);
    puts_(&l, job->replayed ? " replayed=true" : " replayed=false");
    end(&l);
    if (job->orig_request_id[0]) {
        group(&l);
        puts_(&l, " original_request_id=");
        puts_(&l, val(q3, sizeof q3, job->orig_request_id));
        end(&l);
    }
    if (job->token) {
        group(&l);
        puts_(&l, " token=");
        put_u64(&l, job->token);
        end(&l);
    }
    if (job->upstream_status) {
        group(&l);
        puts_(&l, " upstream_status=");
        put_int(&l, job->upstream_status);
        end(&l);
    }
    if (job->upstream_ms >= 0) {
        group(&l);
        puts_(&l, " upstream_ms=");
        put_tenths(&l, job->upstream_ms);
        end(&l);
    }
    group(&l);
    puts_(&l, " duration_ms=");
    put_tenths(&l, (double)(now_ns() - job->start_ns) / 1e6);
    puts_(&l, " bytes_in=");
    put_u64(&l, job->bytes_in);
    puts_(&l, " bytes_out=");
    put_u64(&l, job->bytes_out);
    puts_(&l, " client=");
    puts_(&l, job->client[0] ? val(q1, sizeof q1, job->client) : "unknown");
    end(&l);
    if (job->trace.incoming) { /* a valid traceparent came in: its trace id */
        char tid[33];
        cm_hex(job->trace.trace_id, sizeof job->trace.trace_id, tid);
        group(&l);
        puts_(&l, " trace_id=");
        put(&l, tid, 32);
        end(&l);
    }
    if (client_gone) {
        group(&l);
        puts_(&l, " client_gone=true");
        end(&l);
    }
    cm_alog_line(l.b, l.n);
}
