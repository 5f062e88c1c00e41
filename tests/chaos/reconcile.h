/* reconcile.h - the closing reconciliation: `idemgate reconcile --json` on each idempotent route of the run. */
#ifndef CHAOS_RECONCILE_H
#define CHAOS_RECONCILE_H

#include <stdbool.h>
#include <stddef.h>

#define CH_RC_ROUTES 3 /* pay, book, ord */

struct ch_rc_route {
    const char *route;
    size_t records, confirmed, missing, found, absent, undetermined;
    size_t foreign; /* records of another run (key without this run's tag): not this run's, not counted */
    size_t shared;  /* this run's records of keys two tenants share (book): found means one of the two executed */
    int exit_code;  /* of idemgate reconcile; -1: did not finish */
    bool complete;  /* its summary line was read and says complete, and it counts as many records as we read */
};

struct ch_rc {
    struct ch_rc_route r[CH_RC_ROUTES];
    bool ran;
};

/* Test-only (--reconcile-forget-one): makes the test upstream forget one answered key of route pay
 * (POST /_test/forget), so that its record must come out missing. False when no such key was found. */
bool ch_reconcile_forget_one(void);
/* Runs the reconciliation of every route into out, printing each missing record (at most a few) and any route
 * that could not be reconciled. Returns the number of problems: missing records plus incomplete routes. */
size_t ch_reconcile_run(struct ch_rc *out);
/* The tallies line(s) of the report. */
void ch_reconcile_print(const struct ch_rc *rc);

#endif
