/* tls.h - HTTPS on the listeners: certificates read and checked when the configuration loads, and the credentials
 * a listener's new handshakes get, swapped on SIGHUP without touching the connections already open. */
#ifndef IDEMGATE_GATEWAY_TLS_H
#define IDEMGATE_GATEWAY_TLS_H

#include <stdbool.h>
#include <stddef.h>

#include "conf/types.h"

struct MHD_Daemon;
struct MHD_OptionItem;

/* A certificate chain and its private key, parsed (reference-counted, immutable). */
struct gw_tls_creds;

/* Reads and checks the listener's PEM files (which: "listen" or "admin.listen", for errors). NULL with *err
 * (heap, "CONF:LINE: listen.tls.cert: FILE: what is wrong") when a file is missing, unreadable, larger than 1 MiB,
 * not PEM, when the key is not the certificate's, or when this libmicrohttpd has no TLS. The caller owns the
 * result (gw_tls_creds_unref). */
__attribute__((warn_unused_result)) struct gw_tls_creds *
gw_tls_creds_load(const char *conf_file, const struct conf_listen_tls *t, const char *which, char **err);
void gw_tls_creds_unref(struct gw_tls_creds *c); /* NULL is a no-op */

/* Every upstream's tls files (ca, cert, key) can be read (libcurl reads them only when it connects). false with
 * *err (heap, "CONF: upstreams[N].tls.KEY: PATH: cannot open: ...") otherwise. */
__attribute__((warn_unused_result)) bool gw_tls_upstream_files(const struct conf *c, char **err);

/* A listener's TLS: the credentials new handshakes get. */
struct gw_tls;
/* Takes a reference to c. Never NULL. */
struct gw_tls *gw_tls_create(struct gw_tls_creds *c);
/* New handshakes get c from now on (takes a reference); the credentials before stay alive until gw_tls_destroy,
 * since a handshake in progress may still be using them. Any thread. */
void gw_tls_set(struct gw_tls *t, struct gw_tls_creds *c);
/* After every daemon bound to t has stopped. NULL is a no-op. */
void gw_tls_destroy(struct gw_tls *t);
/* Handshakes on daemon d get t's credentials; call before d takes a connection. gw_tls_unbind when d stops. */
void gw_tls_bind(struct gw_tls *t, const struct MHD_Daemon *d);
void gw_tls_unbind(const struct MHD_Daemon *d);
/* The options of MHD_start_daemon (with MHD_OPTION_ARRAY) for a daemon with MHD_USE_TLS: the certificate callback
 * (the credentials of the daemon the handshake's connection belongs to; an unbound daemon's handshakes fail) and
 * TLS 1.2 and 1.3 only. on false: an empty list. Static. */
struct MHD_OptionItem *gw_tls_mhd_options(bool on);

#endif
