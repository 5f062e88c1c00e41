/* identity.h - a route's identity (SPEC 8): its name, key source, scope parts and fingerprint parts, as one text.
 * A record's key is found again only under the identity it was made with. Never YAML, never I/O. */
#ifndef IDEMGATE_CONF_IDENTITY_H
#define IDEMGATE_CONF_IDENTITY_H

#include <stdbool.h>
#include <stddef.h>

struct conf_route;

/* The route's identity without its name, e.g. "key=header:idempotency-key scope=header:authorization
 * fingerprint=method,path,query,body" (header names lowercased: HTTP compares them so; JWT claim names as
 * written). Names only, never a value. Heap (caller frees); NULL for a route without keys (key: off). */
char *conf_route_identity(const struct conf_route *r);

/* What differs between two identities of conf_route_identity, for a log line: "key", "scope", "fingerprint"
 * joined by ',' into out (size n; "" when equal). */
void conf_identity_diff(const char *a, const char *b, char *out, size_t n);

#endif
