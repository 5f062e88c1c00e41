/* spans.c - a request's trace: continues a valid incoming traceparent or starts a trace, decides the sampling, and
 * hands the request's spans to the exporter (upstream/trace.c); attributes are the route, outcome, token and status,
 * never a key, a scope value, a body or a header. */
#include "gateway/spans.h"

#include <string.h>

void gw_trace_begin(struct gw_job *job, struct up_tracer *t, const char *traceparent)
{
    struct gw_job_trace *tr = &job->trace;
    memset(tr, 0, sizeof *tr);
    struct up_traceparent in;
    tr->incoming = traceparent != NULL && up_traceparent_parse(traceparent, strlen(traceparent), &in);
    if (tr->incoming) { /* the access log's trace_id, traced or not */
        memcpy(tr->trace_id, in.trace_id, sizeof tr->trace_id);
        memcpy(tr->parent_id, in.parent_id, sizeof tr->parent_id);
    }
    if (t == NULL)
        return;
    tr->forward = true;
    tr->on = up_tracer_sampled(t, tr->incoming ? &in : NULL);
    if (!tr->incoming)
        up_trace_new_id(tr->trace_id, sizeof tr->trace_id);
    up_trace_new_id(tr->span_id, sizeof tr->span_id);
    up_trace_new_id(tr->up_span_id, sizeof tr->up_span_id);
    tr->start_ns = up_trace_now_ns();
}

bool gw_trace_forward_value(const struct gw_job *job, char out[UP_TRACEPARENT_LEN + 1])
{
    if (!job->trace.forward)
        return false;
    up_traceparent_format(out, job->trace.trace_id, job->trace.up_span_id, job->trace.on);
    return true;
}

void gw_trace_outcome(struct gw_job *job, enum cm_outcome o)
{
    job->trace.outcome = o;
    job->trace.outcome_set = true;
}

void gw_span_begin(struct gw_job *job)
{
    if (job->trace.on)
        job->trace.step_ns = up_trace_now_ns();
}

/* A span of this request's trace with its route; the caller sets the rest. */
static void span_init(const struct gw_job *job, struct up_span *s, const char *name, enum up_span_kind kind)
{
    memset(s, 0, sizeof *s);
    memcpy(s->trace_id, job->trace.trace_id, sizeof s->trace_id);
    s->name = name;
    s->kind = kind;
    s->end_ns = up_trace_now_ns();
    up_span_set(s, job->route ? job->route->name : job->upstream ? "_default" : "_none", NULL);
}

void gw_span_end(struct gw_job *job, struct up_tracer *t, const char *name, int status, bool error)
{
    if (!job->trace.on || job->trace.step_ns == 0)
        return;
    struct up_span s;
    bool upstream = strcmp(name, "upstream") == 0;
    span_init(job, &s, name, upstream ? UP_SPAN_CLIENT : UP_SPAN_INTERNAL);
    if (upstream)
        memcpy(s.span_id, job->trace.up_span_id, sizeof s.span_id);
    else
        up_trace_new_id(s.span_id, sizeof s.span_id);
    memcpy(s.parent_id, job->trace.span_id, sizeof s.parent_id);
    s.start_ns = job->trace.step_ns;
    s.token = job->trace.token;
    s.status = status;
    s.error = error;
    job->trace.step_ns = 0;
    (void)up_tracer_submit(t, &s); /* a full queue drops it, counted */
}

void gw_trace_end(struct gw_job *job, struct up_tracer *t)
{
    if (!job->trace.on)
        return;
    struct up_span s;
    span_init(job, &s, "request", UP_SPAN_SERVER);
    memcpy(s.span_id, job->trace.span_id, sizeof s.span_id);
    memcpy(s.parent_id, job->trace.parent_id, sizeof s.parent_id);
    s.start_ns = job->trace.start_ns;
    if (job->trace.outcome_set)
        up_span_set(&s, NULL, cm_outcome_name(job->trace.outcome));
    s.token = job->trace.token;
    s.status = job->status;
    s.error = job->status >= 500;
    job->trace.on = false; /* once */
    (void)up_tracer_submit(t, &s);
}
