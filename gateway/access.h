/* access.h - a request's access line (SPEC 11) and the count of its outcome: what the front and the pipeline note
 * on the job as it goes, written once when its answer was sent or its client went away. Never sends anything. */
#ifndef IDEMGATE_GW_ACCESS_H
#define IDEMGATE_GW_ACCESS_H

#include <stdbool.h>
#include <stddef.h>

#include "common/metrics.h"

struct gw_job;

/* The job's access fields at its start: the clock, nothing sent upstream yet. */
void gw_access_start(struct gw_job *job);
/* Counts the request's answer under outcome o (idemgate_requests_total) and keeps o for its access line. */
void gw_job_count(struct gw_job *job, enum cm_outcome o);
/* Writes the job's access line (common/alog.h); client_gone: its client left before the answer was sent. Never a
 * body, a query, a credential or a scope value: the path without its query, the key as sent, the scope hash's
 * first 8 hex digits. */
void gw_access_log(const struct gw_job *job, bool client_gone);

#endif
