/* trace.h - tracing: the W3C traceparent header, span records, and their OTLP/HTTP JSON export from a bounded queue
 * by one thread of its own (a request never waits for the collector). */
#ifndef IDEMGATE_UPSTREAM_TRACE_H
#define IDEMGATE_UPSTREAM_TRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

/* "00-" 32 hex "-" 16 hex "-" 2 hex */
#define UP_TRACEPARENT_LEN 55

/* A trace context as a traceparent carries it. */
struct up_traceparent {
    uint8_t trace_id[16]; /* never all zero when valid */
    uint8_t parent_id[8]; /* never all zero when valid */
    bool sampled;         /* flags bit 0 */
};

/* Reads a traceparent value of n bytes (W3C Trace Context, version 00: exactly 55 bytes, lower-case hex, trace and
 * parent ids not all zero; a version other than 00 or ff is read by its first 55 bytes when the next byte is '-' or
 * there is none, as the recommendation says). Returns false (out untouched) when it is not valid: the caller then
 * starts a new trace. */
bool up_traceparent_parse(const char *s, size_t n, struct up_traceparent *out) CM_MUST_CHECK;

/* Writes "00-TRACE-SPAN-FLAGS" and a NUL into out (UP_TRACEPARENT_LEN + 1 bytes). */
void up_traceparent_format(char out[UP_TRACEPARENT_LEN + 1], const uint8_t trace_id[16], const uint8_t span_id[8],
                           bool sampled);

/* n bytes as 2n lower-case hex digits and a NUL into out (2n + 1 bytes). */
void up_trace_hex(char *out, const uint8_t *b, size_t n);

/* n (at most 32) random bytes from the CSPRNG, not all zero: a new trace or span id. */
void up_trace_new_id(uint8_t *out, size_t n);

enum up_span_kind { UP_SPAN_INTERNAL = 1, UP_SPAN_SERVER = 2, UP_SPAN_CLIENT = 3 };

#define UP_SPAN_ROUTE_MAX   96 /* bytes of the route attribute, NUL included (longer names are cut) */
#define UP_SPAN_OUTCOME_MAX 32

/* One finished span: plain data, copied into the queue. Its attributes are the route's name, the outcome, the
 * fencing token and the HTTP status: never a key, a scope value, a body or a credential (there is no field that
 * could hold one). */
struct up_span {
    uint8_t trace_id[16];
    uint8_t span_id[8];
    uint8_t parent_id[8]; /* all zero: a root span */
    const char *name;     /* static: "request", "claim", "upstream", "complete" */
    enum up_span_kind kind;
    uint64_t start_ns, end_ns; /* Unix epoch nanoseconds */
    char route[UP_SPAN_ROUTE_MAX];
    char outcome[UP_SPAN_OUTCOME_MAX];
    uint64_t token; /* fencing token; 0: none */
    int status;     /* HTTP status; 0: none */
    bool error;     /* status code ERROR */
};

/* The current time as Unix epoch nanoseconds (a span's start and end). */
uint64_t up_trace_now_ns(void);

/* Copies at most UP_SPAN_ROUTE_MAX - 1 bytes of route (NULL: "") into s->route, and likewise outcome. */
void up_span_set(struct up_span *s, const char *route, const char *outcome);

/* The OTLP/HTTP JSON body (ExportTraceServiceRequest: resourceSpans -> scopeSpans -> spans, ids as hex, times and
 * integers as strings) of n spans under the resource service.name service. Returns a malloc'd NUL-terminated text
 * the caller frees, NULL when n is 0. */
char *up_trace_encode(const struct up_span *spans, size_t n, const char *service);

struct up_tracer_opts {
    const char *url;          /* the collector, e.g. http://127.0.0.1:4318; spans go to URL/v1/traces */
    double sample;            /* 0..1: the share of new traces (no valid incoming traceparent) that are sampled */
    size_t queue_max;         /* spans waiting at most (0: 2048); beyond it new spans are dropped and counted */
    size_t batch_max;         /* spans per POST at most (0: 256) */
    uint64_t flush_ms;        /* a partial batch waits at most this long (0: 1000) */
    uint64_t timeout_ms;      /* a whole POST (0: 2000); connecting: at most half of it */
    uint64_t close_wait_ms;   /* at destroy, spans still queued are sent for at most this long (0: 1000) */
    const char *service_name; /* NULL: "idemgate" */
};

struct up_tracer;

/* Starts the exporter thread. Returns NULL (with a log line) when the thread or libcurl cannot be set up; the
 * caller then runs without tracing. The strings of opts are copied. */
struct up_tracer *up_tracer_create(const struct up_tracer_opts *opts);

/* Sends what is queued within close_wait_ms (what remains is dropped and counted), joins the thread, frees t.
 * NULL is a no-op. */
void up_tracer_destroy(struct up_tracer *t);

/* Whether a request's spans are recorded: a valid incoming traceparent's sampled flag when there is one (parent
 * NULL: none), else a draw against sample. false when t is NULL. */
bool up_tracer_sampled(const struct up_tracer *t, const struct up_traceparent *parent);

/* Queues a copy of s for export; never waits for the exporter's POST (the lock is held only to copy). Returns
 * false when the queue is full or t is NULL: the span is dropped (counted in idemgate_trace_spans_dropped_total
 * unless t is NULL). */
bool up_tracer_submit(struct up_tracer *t, const struct up_span *s);

/* Spans the exporter POSTed and the collector acknowledged (2xx) so far (tests, logs). */
uint64_t up_tracer_exported(const struct up_tracer *t);

#endif
