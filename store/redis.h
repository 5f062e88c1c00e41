/* redis.h - one hiredis (0.14) async connection on a libevent base, with a
 * timeout per command, AUTH/SELECT from the URL and reconnection with
 * backoff. Internal to store/: callers see hiredis replies only here. Never what a reply means. */
#ifndef IDEMGATE_STORE_REDIS_H
#define IDEMGATE_STORE_REDIS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

struct event_base;
struct redisReply;
struct conf_redis;
struct store_rd;

/* reply is NULL on any failure (error reply, timeout, disconnect); it is
 * valid only during the callback. */
typedef void (*store_rd_cb)(void *arg, const struct redisReply *reply);

/* Starts connecting to cfg (TCP host:port, or a unix socket; parsed by conf, copied here); url is the URL as
 * written, for logs (passwords redacted). Returns NULL with *err (heap, caller frees) when cfg names neither a host
 * nor a socket; connection problems are not errors (it reconnects). */
struct store_rd *store_rd_create(struct event_base *base, const struct conf_redis *cfg, const char *url,
                                 uint64_t timeout_ms, char **err);
/* Closes the connection; pending commands are dropped without their
 * callbacks. Must not be called from inside a store_rd callback. NULL is a no-op. */
void store_rd_destroy(struct store_rd *r);

/* Sends a command (arguments are copied). Returns false, without calling
 * cb, when the connection is not ready; otherwise cb (may be NULL) is called
 * exactly once from the event loop, after the reply or the timeout. */
bool store_rd_command(struct store_rd *r, store_rd_cb cb, void *arg, int argc, const char **argv,
                      const size_t *argvlen);

/* Connected and ready. Thread-safe. */
bool store_rd_up(const struct store_rd *r);

#endif
