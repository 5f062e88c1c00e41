/* admin.h - the admin listener (SPEC 5): health, readiness, metrics, the status page and the key endpoints. Never on
 * the client listener, never through the pipeline. */
#ifndef IDEMGATE_GW_ADMIN_H
#define IDEMGATE_GW_ADMIN_H

#include <stddef.h>
#include <stdint.h>

#include "conf/conf.h"

struct gw_admin;
struct gw_loop;
struct gw_tls_creds;

/* Starts listening on conf->admin_listen (HTTPS when tls, admin.listen.tls's credentials, is not NULL; borrowed),
 * running store calls on loop. NULL + *err (heap, caller frees) on
 * failure. */
struct gw_admin *gw_admin_start(const struct conf *conf, struct gw_tls_creds *tls, struct gw_loop *loop, char **err);
/* SIGHUP: new handshakes get tls (borrowed). A no-op on a plain listener, on NULL a or tls. */
void gw_admin_tls_set(struct gw_admin *a, struct gw_tls_creds *tls);
uint16_t gw_admin_port(const struct gw_admin *a);
/* Shutting down: /readyz answers 503 "draining" from now on (a load balancer stops sending); NULL is a no-op. */
void gw_admin_draining(struct gw_admin *a);
/* Stops the daemon and frees it; NULL is a no-op. */
void gw_admin_stop(struct gw_admin *a);
/* Admin requests waiting for the store (for graceful shutdown). */
size_t gw_admin_jobs(struct gw_admin *a);

#endif
