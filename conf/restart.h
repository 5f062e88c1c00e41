/* restart.h - which keys a reload cannot apply (they need a restart): old and new configuration compared; never
 * loads or validates YAML. conf.h includes it. */
#ifndef IDEMGATE_CONF_RESTART_H
#define IDEMGATE_CONF_RESTART_H

#include <stddef.h>

struct conf;

/* The keys whose change from old to neu a running gateway cannot apply (new sockets, pools, threads, or the
 * front's per-connection memory): "listen", "admin.listen", "store.postgres", "store.pool", "store.redis",
 * "store.redis_timeout", "store.distributed", "replay_cache", "threads", "max_connections", "client_timeout",
 * "max_header_bytes", "max_response_header_bytes". Up to max of them (constants) go into keys; returns how many differ
 * (may exceed max). */
size_t conf_restart_keys(const struct conf *old, const struct conf *neu, const char **keys, size_t max);

#endif
