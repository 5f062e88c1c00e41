/* gateways.h - the processes the checker runs: testupstream and the idemgate instances (start, SIGKILL,
 * restart, crash detection). */
#ifndef CHAOS_GATEWAYS_H
#define CHAOS_GATEWAYS_H

#include <stdbool.h>
#include <sys/types.h>

#include "chaos.h"

/* Starts testupstream on a free port (ch.tu_port, ch.tu_pid); false when it did not come up within 10 s. */
bool ch_start_testupstream(void);
/* Writes g's config (g->conf) for its ports and the run's store URLs; false when the file cannot be written. */
bool ch_write_gw_conf(struct inst *g);
/* Writes the config `idemgate reconcile` reads at path: the same store and route names, the upstreams straight at
 * testupstream, each route with a look-up by key (probe: /_lookup?idempotency_key={key}). */
bool ch_write_reconcile_conf(const char *path);
/* Starts instance g without waiting; the pid or -1. */
pid_t ch_gw_spawn(struct inst *g);
/* Waits for /healthz of p started for g: true with g->pid = p, else p is stopped and false. */
bool ch_gw_wait_ready(struct inst *g, pid_t p);
/* Spawn and wait; false (process stopped) on failure. */
bool ch_gw_start(struct inst *g);
/* Up to tries starts; false counts a restart failure. */
bool ch_gw_start_retry(struct inst *g, int tries);
/* SIGKILL and reap (g->kills counts it first, so clients can tell). */
void ch_gw_kill(struct inst *g);
/* Records an exit we did not cause (st from waitpid): a crash, or a stop by a signal from outside, with a
 * gateway_kill fault window covering its shutdown grace. */
void ch_gw_exited(struct inst *g, int st);
/* A gateway that exited without us killing it: record it, restart it. */
void ch_gw_monitor(void);

#endif
