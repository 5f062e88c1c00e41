/* faults.h - the fault injector: one table of fault kinds (name, injector, what it may excuse), the schedule
 * thread that runs them one at a time, and the fault log (time windows) the checks read. */
#ifndef CHAOS_FAULTS_H
#define CHAOS_FAULTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chaos.h"

/* The kind's name as --faults and the report spell it. */
const char *ch_fault_name(enum fkind k);
/* Kinds that may leave an outcome unknown (a re-execution on the retry route may follow them). */
unsigned ch_fault_mask_disruptive(void);
/* Kinds that may leave a never-executed key unknown for good (the request was sent, it never arrived). */
unsigned ch_fault_mask_excuses_stuck(void);
/* Parses --faults (comma-separated names, or "all") into *mask; false with a message in err otherwise. */
bool ch_faults_parse(const char *list, unsigned *mask, char *err, size_t errn);
/* Drops from ch.o.fault_mask what this run cannot inject (failover without a standby). False, with a message,
 * when --faults asked for such a kind by name. */
bool ch_faults_settle_mask(void);
/* Prepares the SQL faults' undo (the signal handler's psql command) and checks the admin connection; false with
 * a message when the SQL faults are selected and Postgres cannot be reached as superuser. */
bool ch_faults_prepare(void);

/* The schedule thread (pthread start routine): one fault at a time from ch.o.fault_mask until ch.faults_end,
 * watching the gateways until ch.traffic_end; then waits for ch.fault_release. Returns NULL. */
void *ch_fault_main(void *arg);
/* Everything back to normal after the schedule (or on a failure path): paused Postgres continued, SQL faults
 * undone, Postgres and Redis started, the gate open, dead gateways restarted. */
void ch_faults_heal(void);
/* The part of heal that must run on every exit path: SIGCONT what is paused, undo the SQL faults. */
void ch_faults_undo(void);

/* The fault log. window_begin returns the window's index (CH_MAX_WINDOWS when the log is full). */
size_t ch_window_begin(enum fkind k, int inst);
void ch_window_end(size_t i);
/* Windows of the kinds in mask overlapping [a, b]. */
unsigned ch_faults_overlapping(uint64_t a, uint64_t b, unsigned mask);
/* Prints the windows overlapping [from, to] (for the violation reports). */
void ch_print_faults_between(uint64_t from, uint64_t to);

#endif
