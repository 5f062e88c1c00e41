/* loop.h - the I/O loop: one thread running libevent, owning its HTTP daemon's events, the upstream client, its
 * share of the Postgres pool and the Redis context; and the set of loops of a process. It assembles each thread's
 * context (gateway/ctx.h) and never runs a request itself (the pipeline does, from the job's context). */
#ifndef IDEMGATE_GW_LOOP_H
#define IDEMGATE_GW_LOOP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "conf/conf.h"

struct event_base;
struct store;
struct gw_loop;
struct up_tracer;
struct gw_conf;

/* Creates the loop (event base, upstream client, store). NULL + *err (heap, caller frees) on failure. */
struct gw_loop *gw_loop_create(const struct conf *conf, size_t nloops, char **err);
/* Starts the loop thread. Returns false on failure. */
bool gw_loop_start(struct gw_loop *l) CM_MUST_CHECK;
/* Runs fn(arg) on the loop thread soon. Safe from any thread. */
void gw_loop_submit(struct gw_loop *l, void (*fn)(void *), void *arg);
/* Stops the thread (pending submissions are run first, best effort) and frees everything. NULL is a no-op. */
void gw_loop_destroy(struct gw_loop *l);
/* What this loop's jobs work with (gateway/ctx.h); the front hands it to each job (job->ctx). */
struct gw_ctx;
struct gw_ctx *gw_loop_ctx(struct gw_loop *l);
struct event_base *gw_loop_base(struct gw_loop *l);
struct store *gw_loop_store(struct gw_loop *l);
/* The process's replay cache, shared by its loops (gateway/cache.h); NULL when off or for a loop built alone. */
struct gw_cache;
struct gw_cache *gw_loop_cache(struct gw_loop *l);
/* The start-time configuration (this loop's share of the pool): what the store and the loop were built from. */
const struct conf *gw_loop_conf(struct gw_loop *l);
/* Loop thread only: the configuration new requests are served with (no reference is taken). */
struct gw_conf *gw_loop_current(struct gw_loop *l);
/* Set once the schema exists; idempotent requests get 503 until then. */
void gw_loop_set_schema_ready(struct gw_loop *l, bool ready);
bool gw_loop_schema_ready(struct gw_loop *l);
/* True when every loop of the process (this one alone when it has no group) has its schema and heard from
 * Postgres within the last second (store_postgres_healthy). Thread-safe. */
bool gw_loop_postgres_ready(struct gw_loop *l);
/* Jobs running (gw_ctx_job_add to gw_ctx_job_remove; for graceful shutdown). Thread-safe. */
size_t gw_loop_jobs(struct gw_loop *l);

/* A set of loops (one per CPU by default): each serves the connections its HTTP daemon accepted, with its own
 * upstream client, Redis context and pool share. */
struct store_epoch;
struct gw_loops {
    struct gw_loop **v;
    size_t n;
    struct store_epoch *epoch; /* the purge epoch (store.h), heard by the listener, shared by the loops' stores */
};
/* Creates n loops (at most conf->pool). NULL + *err (heap, caller frees) on failure. */
struct gw_loops *gw_loops_create(const struct conf *conf, size_t n, char **err);
/* Before gw_loops_start: every loop serves new requests with c (each takes a reference). */
void gw_loops_install(struct gw_loops *ls, struct gw_conf *c);
bool gw_loops_start(struct gw_loops *ls) CM_MUST_CHECK;
/* Before gw_loops_start: every loop's jobs export their spans through t (not owned; NULL: none). */
void gw_loops_set_tracer(struct gw_loops *ls, struct up_tracer *t);
/* Running loops: each swaps to c on its own thread, between two events (each takes a reference and drops its old
 * one); waits up to timeout_ms for all of them. Returns false when a loop did not swap in time (it still will). */
bool gw_loops_swap(struct gw_loops *ls, struct gw_conf *c, uint64_t timeout_ms) CM_MUST_CHECK;
void gw_loops_destroy(struct gw_loops *ls); /* NULL is a no-op */
size_t gw_loops_jobs(struct gw_loops *ls);
void gw_loops_set_schema_ready(struct gw_loops *ls, bool ready);
/* Submits gw_pipeline_abort_all (gateway/pipeline.h) to every loop. */
void gw_loops_abort_all(struct gw_loops *ls);

#endif
