/* front.h - the HTTP front (libmicrohttpd): accepts connections, reads and checks each request, builds its job
 * (gateway/gateway.h), hands it to its loop's pipeline and sends the answer. The pipeline calls it back only through
 * the callback it sets on the job (job->done_cb); nothing below the front calls the front. */
#ifndef IDEMGATE_GW_FRONT_H
#define IDEMGATE_GW_FRONT_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>

#include "conf/conf.h"

struct gw_front;
struct gw_loops;
struct gw_tls_creds;

/* Starts listening per conf (port 0: any free port), with HTTPS when tls (listen.tls's credentials, borrowed: the
 * front takes its own reference) is not NULL. NULL + *err (heap, caller frees) on failure. */
struct gw_front *gw_front_start(const struct conf *conf, struct gw_tls_creds *tls, struct gw_loops *loops, char **err);
/* SIGHUP: new handshakes get tls (a reloaded configuration's listen.tls; borrowed); open connections keep theirs.
 * A no-op on a plain front or with NULL. */
void gw_front_tls_set(struct gw_front *f, struct gw_tls_creds *tls);
uint16_t gw_front_port(const struct gw_front *f);
/* Requests handed to the loop whose answer has not been queued yet. */
long gw_front_suspended(struct gw_front *f);
/* Stops accepting new connections (existing ones are served). */
void gw_front_quiesce(struct gw_front *f);
/* Stops the daemon; every suspended connection must have been resumed. */
void gw_front_stop(struct gw_front *f);

/* Formats an MHD log message as one key=value line (the front's and the admin listener's daemons). */
void gw_mhd_log(void *cls, const char *fmt, va_list ap);

#endif
