/* notify.h - one Postgres LISTEN connection per process (non-blocking libpq on a loop's event base, reconnected
 * with backoff, pinged so that a dead connection is noticed within a second): the purge channel of the replay
 * cache. Never the claim path. */
#ifndef IDEMGATE_STORE_NOTIFY_H
#define IDEMGATE_STORE_NOTIFY_H

#include <stddef.h>

struct event_base;
struct store_notify;

/* The channel the admin purge and release statements notify (in their own transaction, store/store.c); the
 * payload is "ROUTE\nKEY". */
#define STORE_NOTIFY_CHANNEL "idemgate_cache"
/* The channel the purge epoch's bump notifies (store/store.c, after the purge or release committed); the payload
 * is the new epoch in decimal. */
#define STORE_NOTIFY_EPOCH_CHANNEL "idemgate_epoch"

enum store_notify_event {
    STORE_NOTIFY_UP,      /* LISTEN is in force: from now on no notification is missed */
    STORE_NOTIFY_DOWN,    /* the connection was lost (or stopped answering): notifications may be missed */
    STORE_NOTIFY_LATE,    /* a ping is late: a notification may be late too (none is lost); UP follows when the
                           * listener is sure to have heard everything sent until then, DOWN when it gives up */
    STORE_NOTIFY_MESSAGE, /* a notification: payload[0..len) */
    STORE_NOTIFY_EPOCH,   /* the purge epoch (decimal in payload[0..len)): read once LISTEN is in force (before
                           * UP), and each one notified on STORE_NOTIFY_EPOCH_CHANNEL */
};
/* Called on base's thread. payload is valid during the call only (NULL unless STORE_NOTIFY_MESSAGE). */
typedef void (*store_notify_cb)(void *arg, enum store_notify_event ev, const char *payload, size_t len);

/* Starts connecting to postgres_url (libpq URL or key=value string, as store.postgres) and listening on
 * STORE_NOTIFY_CHANNEL and STORE_NOTIFY_EPOCH_CHANNEL (and reading the epoch, idemgate_epoch); cb reports every change.
 * The connection is reconnected with backoff (100 ms doubling to 2 s) and pinged every 200 ms; a ping unanswered for
 * 500 ms is LATE, for 3 s a lost connection. Returns NULL only when the event base refuses the timer. postgres_url is
 * copied. */
struct store_notify *store_notify_create(struct event_base *base, const char *postgres_url, store_notify_cb cb,
                                         void *arg);
/* Closes the connection and frees everything, without a callback. Call on base's thread (or before the loop
 * runs, or after it stopped). NULL is a no-op. */
void store_notify_destroy(struct store_notify *n);

#endif
