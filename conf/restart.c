/* restart.c - which keys a reload cannot apply (conf_restart_keys): two loaded configurations compared field by
 * field; never parses YAML, never validates. */
#include "conf/restart.h"

#include <string.h>

#include "conf/types.h"

static bool str_eq(const char *a, const char *b)
{
    return a == b || (a && b && strcmp(a, b) == 0);
}

static bool addr_eq(const struct conf_addr *a, const struct conf_addr *b)
{
    /* the certificate files may change (SIGHUP reloads them), TLS on or off may not: the daemon is built for one */
    return a->port == b->port && str_eq(a->host, b->host) && (a->tls.cert != NULL) == (b->tls.cert != NULL);
}

size_t conf_restart_keys(const struct conf *old, const struct conf *neu, const char **keys, size_t max)
{
    const struct {
        const char *key;
        bool same;
    } t[] = {
        {"listen", addr_eq(&old->listen, &neu->listen)},
        {"admin.listen", old->admin_enabled == neu->admin_enabled &&
                             (!old->admin_enabled || addr_eq(&old->admin_listen, &neu->admin_listen))},
        {"store.postgres", str_eq(old->postgres_url, neu->postgres_url)},
        {"store.pool", old->pool == neu->pool},
        {"store.redis", str_eq(old->redis_url, neu->redis_url)},
        {"store.redis_timeout", old->redis_timeout_ms == neu->redis_timeout_ms},
        {"replay_cache", old->replay_cache_max_bytes == neu->replay_cache_max_bytes &&
                             old->replay_cache_max_entries == neu->replay_cache_max_entries},
        {"store.distributed", old->distributed == neu->distributed},
        {"limits.buffers", old->limits_buffers == neu->limits_buffers},
        {"threads", old->threads == neu->threads},
        {"max_connections", old->max_connections == neu->max_connections},
        {"client_timeout", old->client_timeout_ms == neu->client_timeout_ms},
        {"max_header_bytes", old->max_header_bytes == neu->max_header_bytes},
        {"max_response_header_bytes", old->max_response_header_bytes == neu->max_response_header_bytes},
        {"tracing", str_eq(old->tracing_otlp, neu->tracing_otlp) && old->tracing_sample == neu->tracing_sample},
        {"access_log", str_eq(old->access_log, neu->access_log)},
        {"log_format", old->log_format == neu->log_format},
    };
    size_t n = 0;
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        if (t[i].same)
            continue;
        if (n < max)
            keys[n] = t[i].key;
        n++;
    }
    return n;
}
