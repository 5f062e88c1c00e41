/* ctx.h - what one I/O thread's jobs work with (event base, store, upstream client, replay cache, prober, the
 * configuration in force, the running jobs): assembled in one place (gateway/loop.c) and handed to each job when
 * it starts (job->ctx). Plain data and list bookkeeping; it never calls up into the loop, the front or the
 * pipeline. */
#ifndef IDEMGATE_GW_CTX_H
#define IDEMGATE_GW_CTX_H
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include "conf/conf.h"

struct up_tls;
struct up_origin;

struct event_base;
struct up_client;
struct store;
struct gw_cache;
struct gw_probe;
struct gw_conf;
struct up_tracer;

/* The list of running jobs, through a link the pipeline embeds in its own state (the context never looks past
 * it). */
struct gw_job_link {
    struct gw_job_link *next, *prev;
};

struct gw_ctx {
    struct event_base *base;
    struct up_client *up; /* the upstream client */
    size_t nloops;        /* loops sharing the upstreams' max_connections (1 alone) */
    struct store *store;
    struct gw_cache *cache;     /* the process's replay cache (shared by the loops), NULL when off */
    struct gw_probe *probe;     /* on_unknown: probe look-ups and their sweeper (gateway/probe.c) */
    struct gw_conf *cur;        /* what new requests are served with (loop thread; one reference, swapped on reload) */
    struct up_tracer *tracer;   /* span export (upstream/trace.h), shared by the loops; NULL: no tracing */
    atomic_bool schema_ready;   /* set once the schema exists; idempotent requests get 503 until then */
    atomic_bool closing;        /* after this, new jobs are answered 503 at once (shutdown past the grace) */
    struct gw_job_link *active; /* running jobs (loop thread only) */
    atomic_size_t njobs;        /* their number (any thread) */
};

/* This thread's share of an upstream's max_connections (the bound holds over all loops together). */
size_t gw_ctx_upstream_max(const struct gw_ctx *x, const struct conf_upstream *u);
/* An upstream's origin as the upstream client takes it; tls is where its tls: goes (both borrow from u). */
struct up_origin gw_upstream_origin(const struct conf_upstream *u, struct up_tls *tls);
/* Loop thread: lists a running job / takes it off (removing a link that is not listed is a no-op). */
void gw_ctx_job_add(struct gw_ctx *x, struct gw_job_link *link);
void gw_ctx_job_remove(struct gw_ctx *x, struct gw_job_link *link);
#endif
