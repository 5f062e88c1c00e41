/* ctx.c - the per-thread context's bookkeeping (gateway/ctx.h): the upstream share and the running-job list;
 * never creates or frees what the context points to (gateway/loop.c does). */
#include "gateway/ctx.h"

#include "upstream/types.h"

size_t gw_ctx_upstream_max(const struct gw_ctx *x, const struct conf_upstream *u)
{
    size_t n = x->nloops > 0 ? x->nloops : 1;
    return (u->max_connections + n - 1) / n;
}

void gw_ctx_job_add(struct gw_ctx *x, struct gw_job_link *job)
{
    job->prev = NULL;
    job->next = x->active;
    if (x->active)
        x->active->prev = job;
    x->active = job;
    atomic_fetch_add(&x->njobs, 1);
}

void gw_ctx_job_remove(struct gw_ctx *x, struct gw_job_link *job)
{
    if (job->prev)
        job->prev->next = job->next;
    else if (x->active == job)
        x->active = job->next;
    else
        return; /* not listed */
    if (job->next)
        job->next->prev = job->prev;
    job->next = job->prev = NULL;
    atomic_fetch_sub(&x->njobs, 1);
}

struct up_origin gw_upstream_origin(const struct conf_upstream *u, struct up_tls *tls)
{
    *tls = (struct up_tls){.ca = u->tls.ca,
                           .cert = u->tls.cert,
                           .key = u->tls.key,
                           .verify = u->tls.verify,
                           .server_name = u->tls.server_name};
    return (struct up_origin){.tls = u->tls.set ? tls : NULL,
                              .https = u->https,
                              .host = u->host,
                              .port = u->port,
                              .ip_literal = u->host_is_ip};
}
