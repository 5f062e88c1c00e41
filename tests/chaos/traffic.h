/* traffic.h - the traffic driver: W client threads, each sending requests with its own keys and tenant and
 * retrying like a real client, recording what every attempt saw (struct user) for the checks. */
#ifndef CHAOS_TRAFFIC_H
#define CHAOS_TRAFFIC_H

#include <stdbool.h>
#include <stddef.h>

#include "chaos.h"

/* What one attempt's answer means for the client (and for the evidence the checks use). */
enum cls {
    C_ANSWER,
    C_RELEASE,
    C_INUSE,
    C_OUTCOME_UNKNOWN,
    C_STORE_UNAVAIL,
    C_UP_UNAVAIL,
    C_GW_UNKNOWN,
    C_BUSY,
    C_REFUSED,
    C_TRANSPORT,
    C_TIMEOUT,
    C_WRONG_TENANT,
    C_UNEXPECTED,
};

/* A client thread (pthread start routine; arg is its struct worker): plans and runs requests until
 * ch.traffic_end. Returns NULL. */
void *ch_worker_main(void *arg);
/* The request body of u (its tenant, key and padding) into buf; its length, 0 when cap is too small. */
size_t ch_build_body(const struct user *u, char *buf, size_t cap);
/* The request headers of u: key, tenant, expected status and, on the first attempt, the fault it asks the
 * upstream for. The caller frees the list. */
struct curl_slist *ch_build_headers(const struct user *u, bool first);
/* Classifies r (the answer to the body sent) for u; tok gets a short token for the attempt log. */
enum cls ch_classify(const struct user *u, const struct http_res *r, const char *sent, size_t sent_len, char *tok,
                     size_t tokn);

#endif
