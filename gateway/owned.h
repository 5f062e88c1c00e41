/* owned.h - the keys this process holds in flight (gateway/owned.c): a retry
 * reaching the owner's own process is in flight, whatever the record's lease
 * says. Any thread. It never asks the store. */
#ifndef IDEMGATE_GATEWAY_OWNED_H
#define IDEMGATE_GATEWAY_OWNED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store/order.h"
#include "store/store.h"

enum gw_owned {
    GW_OWNED_TAKEN,      /* recorded: the caller owns it until gw_owned_drop */
    GW_OWNED_BUSY,       /* already recorded by another request (not recorded twice) */
    GW_OWNED_UNRECORDED, /* the table is full: not recorded (Postgres alone decides, as before) */
};

enum gw_held {
    GW_HELD_NO,    /* no request of this process holds it */
    GW_HELD_SAME,  /* held by a request with the same fingerprint (or one recorded without): in flight, 409 / wait */
    GW_HELD_OTHER, /* held by a request with another fingerprint: a 422, as Postgres answers */
};

/* Whether a request of this process holds id's claim (checked before asking Postgres). */
bool gw_owned_held(const struct store_id *id);
/* The same, comparing the holder's fingerprint with fp (32 bytes). */
enum gw_held gw_owned_held_fp(const struct store_id *id, const uint8_t *fp);
/* The same, and when it is held, the time since the holder recorded it (this process's monotonic clock: when
 * Postgres gave it the claim, as its answer arrived) into *age_ms. */
enum gw_held gw_owned_held_age(const struct store_id *id, const uint8_t *fp, uint64_t *age_ms);
/* Records id (copied) and its request's fingerprint fp (32 bytes, copied; NULL: none) as held by the caller, once
 * Postgres gave it the claim. */
enum gw_owned gw_owned_take(const struct store_id *id, const uint8_t *fp);
/* Forgets id; a no-op when it is not recorded. */
void gw_owned_drop(const struct store_id *id);
/* The same for an ordering guard's in-flight marker (SPEC 6, 8): a request of this process holds the resource's
 * marker, whatever its lease in Postgres says, so another request of this process for that resource is in flight
 * without asking Postgres. Taken once the guard gave the marker; dropped when it is settled. */
enum gw_owned gw_owned_marker_take(const struct store_order_id *id);
void gw_owned_marker_drop(const struct store_order_id *id);
bool gw_owned_marker_held(const struct store_order_id *id);
/* Entries recorded (for tests and metrics). */
size_t gw_owned_count(void);

#endif
