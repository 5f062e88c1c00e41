/* spans.h - a request's trace: the incoming traceparent read, the sampling decided, the traceparent the upstream
 * gets, and its spans (request, claim, upstream, complete) handed to the exporter (upstream/trace.h). */
#ifndef IDEMGATE_GW_SPANS_H
#define IDEMGATE_GW_SPANS_H

#include "gateway/gateway.h"

struct up_tracer;

/* The front, once the head is in. traceparent is the request's header value or NULL: a valid one sets
 * job->trace.incoming and its trace id (also with t NULL, for the logs); t NULL (no tracing) leaves the job untraced;
 * otherwise a valid one is continued (its trace id, its parent, its sampled flag), anything else starts a new trace
 * sampled at the configured rate. */
void gw_trace_begin(struct gw_job *job, struct up_tracer *t, const char *traceparent);

/* The traceparent the upstream gets (the upstream span as its parent) into out; false when tracing is off. */
bool gw_trace_forward_value(const struct gw_job *job, char out[UP_TRACEPARENT_LEN + 1]);

/* The answer's outcome, for the request span. */
void gw_trace_outcome(struct gw_job *job, enum cm_outcome o);

/* A step (claim, upstream, complete) starts now. */
void gw_span_begin(struct gw_job *job);

/* The step begun last ends now: a child span of the request named name ("claim", "upstream" (a client span, the
 * id the upstream was told), "complete"); status is the upstream's HTTP status or 0. */
void gw_span_end(struct gw_job *job, struct up_tracer *t, const char *name, int status, bool error);

/* The answer is queued: the request span (a server span) with the route, the outcome, the token and status. */
void gw_trace_end(struct gw_job *job, struct up_tracer *t);

#endif
