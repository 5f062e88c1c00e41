/* gateway.h - the job: one client request carried from the HTTP front (gateway/front.h) to the pipeline
 * (gateway/pipeline.h) and back through the callback the front sets on it. Plain data: it never calls anything (its
 * error answers are written by gateway/problem.h, the context it works with is gateway/ctx.h). */
#ifndef IDEMGATE_GATEWAY_H
#define IDEMGATE_GATEWAY_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "common/metrics.h"
#include "conf/conf.h"
#include "gateway/idem.h"
#include "upstream/trace.h"

struct gw_loop;
struct gw_ctx;
struct gw_pipe;

/* ---- a job: one client request in the pipeline. Built by the front, run by the pipeline and answered by the
 * front after resume, all on the loop thread whose HTTP daemon accepted the connection. */
struct gw_job {
    /* request (immutable once submitted) */
    const struct conf *conf;
    const struct conf_route *route; /* NULL: default upstream */
    size_t route_index;             /* metrics slot, or CM_ROUTE_DEFAULT */
    const struct conf_upstream *upstream;
    char *method;
    char *uri;               /* raw request target: path[?query] */
    char *path;              /* raw path, no query */
    char *query;             /* raw query without '?', "" when none */
    struct cm_hdrs fwd_hdrs; /* headers to forward (filtered, X-Forwarded-* added) */
    struct cm_buf body;
    bool idempotent;
    bool shadow; /* mode: shadow: claimed and recorded, but the client always gets the upstream's answer */
    char key[GW_KEY_MAX + 1];
    size_t key_len;
    uint8_t scope[32];
    uint8_t fp[32];
    bool cache_asked; /* the front looked the record up in the replay cache (a miss): the claim does not again */
    /* a client's Prefer: wait the route honours (prefer_wait_max; gateway/hints.h): it waits up to prefer_wait_ms
     * for an in-flight first attempt instead of on_in_flight, and says so with Preference-Applied: wait=prefer_wait_s
     */
    bool prefer_wait;
    uint64_t prefer_wait_ms;
    uint64_t prefer_wait_s;
    /* on_unknown: probe on a scoped route: the scope's request parts its look-up carries (gw_scope_probe_headers) */
    struct cm_hdrs probe_hdrs;
    /* ordering guard (SPEC 6; gateway/ordering.h): parsed by the front */
    bool ordered;   /* the route's guard covers this request */
    int64_t seq;    /* its sequence */
    char *resource; /* the resource instance (normalized path, heap, freed by the front) */
    size_t resource_len;

    /* answer (written by the pipeline before done_cb) */
    int status;
    struct cm_hdrs resp_hdrs;
    struct cm_buf resp_body;
    bool replayed;
    /* SPEC 11: this request's id (set by the front before anything is answered or logged), and on a replay or a 409
     * the id of the request that executed the record ("" when not known) */
    char request_id[CM_REQUEST_ID_MAX + 1];
    char orig_request_id[CM_REQUEST_ID_MAX + 1];
    /* SPEC 11: what its access line says (gateway/access.h), filled in as the request goes */
    uint64_t start_ns;       /* the request line came in (monotonic) */
    enum cm_outcome outcome; /* as counted (gw_job_count) */
    uint64_t token;          /* the fencing token it was forwarded under; 0: none */
    int upstream_status;     /* the upstream's answer status; 0: none */
    double upstream_ms;      /* how long the upstream took; < 0: nothing was sent */
    uint64_t bytes_in;       /* request body bytes */
    uint64_t bytes_out;      /* answer body bytes */
    char client[48];         /* the client's address (after trusted_proxies) */

    /* front bookkeeping */
    void *conn; /* struct MHD_Connection * */
    atomic_bool done;
    struct gw_loop *loop; /* the front's: where the job is submitted */
    struct gw_ctx *ctx;   /* what the pipeline works with on that loop's thread (gateway/ctx.h), set by the front */
    /* set by the front before the job is submitted: the pipeline calls it exactly once, on the loop thread, when
     * the answer is ready (it resumes the connection). The pipeline never calls the front otherwise. */
    void (*done_cb)(struct gw_job *job);

    /* tracing (gateway/spans.h): set by the front when the request's head is in; the pipeline adds the steps */
    struct gw_job_trace {
        bool forward;            /* tracing is configured: the upstream gets our traceparent */
        bool on;                 /* sampled: the request's spans are exported */
        uint8_t trace_id[16];    /* the incoming traceparent's, or a new one */
        uint8_t parent_id[8];    /* the incoming traceparent's parent id; zero: none */
        bool incoming;           /* a valid traceparent came in (read with or without tracing): trace_id is its */
        uint8_t span_id[8];      /* the request span's */
        uint8_t up_span_id[8];   /* the upstream span's: the parent the upstream is told */
        uint64_t start_ns;       /* the request span's start */
        uint64_t step_ns;        /* the claim, upstream or complete step in progress started then */
        uint64_t token;          /* the fencing token, once claimed */
        enum cm_outcome outcome; /* the answer's outcome */
        bool outcome_set;
    } trace;
    /* the pipeline's own state (gateway/pipeline.c; NULL until gw_pipeline_run, freed by gw_pipeline_free) */
    struct gw_pipe *pipe;
};

#endif
