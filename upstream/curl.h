/* curl.h - libcurl's multi handle as a backend (https:// and host names); never the built-in client, never the
 * facade. Not for other rooms. */
#ifndef IDEMGATE_UPSTREAM_CURL_H
#define IDEMGATE_UPSTREAM_CURL_H

struct up_backend;

extern const struct up_backend up_curl_backend;

#endif
