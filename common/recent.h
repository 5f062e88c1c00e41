/* recent.h - each route's recent upstream time (SPEC 11's Retry-After on a key in use): the p90 of the last
 * minutes' upstream durations, kept per route slot (cm_metrics_route: a route's name keeps its slot across
 * reloads). Updated lock-free from any thread (a clock read and one atomic add per observation); never calls
 * another room. */
#ifndef IDEMGATE_RECENT_H
#define IDEMGATE_RECENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Route slots below this have a recent upstream time; others (CM_ROUTE_DEFAULT, CM_ROUTE_NONE) never do. The same
 * bound as the metrics registry's. */
#define CM_RECENT_ROUTES 16384
/* The window: the current minute of the monotonic clock and the two before it (two to three minutes). */
#define CM_RECENT_MINUTES 3

/* Records one upstream duration of route's (ms) at now_ms (the monotonic clock, cm_now_ms). A route's memory
 * (about 1.4 KB) is allocated on its first observation and kept until cm_recent_reset. Any thread. */
void cm_recent_observe(size_t route, uint64_t ms, uint64_t now_ms);
/* The p90 of route's durations in the window at now_ms, into *p90_ms (the upper bound of the bucket holding it:
 * at most a quarter above, never below). False (*p90_ms untouched) when the window holds none. Any thread. */
bool cm_recent_p90_ms(size_t route, uint64_t now_ms, uint64_t *p90_ms);
/* The number of route's durations in the window at now_ms, into *n; false when it has none. */
bool cm_recent_count(size_t route, uint64_t now_ms, uint64_t *n);
/* How long a retry should wait for an attempt of age_ms whose lease has lease_left_ms left (SPEC 11): route's
 * recent p90 less age_ms, at least 1 ms and at most lease_left_ms; lease_left_ms (at least 1) when the route has no
 * recent upstream time. Retry-After rounds it up to whole seconds. */
uint64_t cm_recent_wait_ms(size_t route, uint64_t age_ms, uint64_t lease_left_ms, uint64_t now_ms);
/* Forgets every route's durations and frees their memory: only while no other thread observes or reads (start,
 * tests; cm_metrics_reset calls it, as it gives the slots to new names). */
void cm_recent_reset(void);

#endif
