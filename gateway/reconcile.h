/* reconcile.h - the `idemgate reconcile` command (SPEC 12): a route's records against its upstream's look-up. */
#ifndef IDEMGATE_GW_RECONCILE_H
#define IDEMGATE_GW_RECONCILE_H

/* Runs the command; argv[0] is "reconcile". Prints one line per record (a table, or JSON lines with --json) and a
 * summary on stdout; returns the exit code: 0 nothing missing, 1 a completed record is missing upstream, 2 usage,
 * configuration or Postgres error (the reason on stderr). */
int gw_reconcile_main(int argc, char **argv);

#endif
