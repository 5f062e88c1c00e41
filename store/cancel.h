/* cancel.h - cancel requests for server processes the pool gave up on, sent off the event loops. Internal to
 * store/. Never blocks a loop. */
#ifndef IDEMGATE_STORE_CANCEL_H
#define IDEMGATE_STORE_CANCEL_H

#include <stdbool.h>

#include <libpq-fe.h>

/* Asks the server process behind pg (connected) to cancel what it runs: a query the pool stopped waiting for,
 * which the server would otherwise go on with after the pool closed the connection - a COMMIT waiting for a
 * synchronous standby (wait_event SyncRep) keeps its row locks until a standby confirms, however long, and
 * neither statement_timeout nor the closed socket ends that wait; a cancel does (the transaction stays committed
 * locally, the caller already treats its outcome as unknown). The request is sent by one background thread
 * (PQcancel blocks: connect, send, wait for the server to close), so the caller may close pg at once. Returns
 * false when the request was not queued (no cancel object, the bounded queue full, no thread): the server process
 * then ends by itself when its wait does. The caller keeps pg. */
bool store_cancel_send(PGconn *pg);

/* Cancel requests queued or being sent (for tests and the log). */
unsigned store_cancel_pending(void);

#endif
