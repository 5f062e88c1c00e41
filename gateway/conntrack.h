/* conntrack.h - client connections held to a deadline (slowloris, slow readers): a watchdog thread cuts every
 * connection that has been reading its request, or writing its answer, for longer than a timeout, because
 * libmicrohttpd's own connection timeout is an idle timeout that every byte resets. Used by the front and the admin
 * listener alike. It never reads or writes a connection. */
#ifndef IDEMGATE_GW_CONNTRACK_H
#define IDEMGATE_GW_CONNTRACK_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

/* One connection, from its start to its close. */
struct gw_conn {
    struct gw_conn *prev, *next;
    int fd;
    bool over_limit;        /* the owner's: accepted beyond its connection limit */
    bool shut;              /* the watchdog cut it */
    _Atomic uint64_t since; /* ms; 0: no deadline (its request is in the pipeline) */
    atomic_bool answering;  /* its answer is being written: a cut drops what the kernel still holds of it */
};

struct gw_conntrack;

/* Starts the watchdog (what names it in the log: "front", "admin"). Returns NULL with *err (heap) when the thread
 * cannot be started. */
struct gw_conntrack *gw_conntrack_start(uint64_t timeout_ms, const char *what, char **err);
/* Stops the watchdog and frees the tracker; the connections still tracked are freed too. NULL is a no-op. */
void gw_conntrack_stop(struct gw_conntrack *ct);

/* A new connection on fd, reading its request from now (heap, owned by the tracker until gw_conntrack_remove). */
struct gw_conn *gw_conntrack_add(struct gw_conntrack *ct, int fd);
/* The connection is closing (before its socket is: the watchdog never sees a reused descriptor); frees c. */
void gw_conntrack_remove(struct gw_conntrack *ct, struct gw_conn *c);

/* Its request (or the next one on a keep-alive connection) is read from now: the deadline runs. */
void gw_conn_reading(struct gw_conn *c);
/* Its request is in the pipeline: no deadline. */
void gw_conn_waiting(struct gw_conn *c);
/* Its answer is written from now: the deadline runs, and a cut resets the connection. */
void gw_conn_answering(struct gw_conn *c);
/* The request ended with code ok (false: cut, timed out or failed) and libmicrohttpd closes the socket next when
 * it was not: an answer being written is then dropped with a reset rather than delivered from the kernel. */
void gw_conn_request_done(struct gw_conn *c, bool ok);

#endif
