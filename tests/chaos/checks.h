/* checks.h - the history checks: at-most-once, same-answer, tenant-isolation, records-settled, liveness and
 * the run itself, from the clients' records, the upstream's counts and the idemgate_keys table. */
#ifndef CHAOS_CHECKS_H
#define CHAOS_CHECKS_H

#include <stdbool.h>

/* Runs every check (after the quiet period) and prints the violations and the figures. Returns false when the
 * data could not be read (upstream counts, Postgres); else the number of checks passed and failed. */
bool ch_run_checks(unsigned *passed_out, unsigned *failed_out);

#endif
