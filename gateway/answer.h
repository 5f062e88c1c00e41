/* answer.h - how a record or an upstream answer becomes the client's answer headers (the stored headers in order,
 * the replay marker): one room the front and the replay cache both use. Holds no state; never sends anything. */
#ifndef IDEMGATE_GW_ANSWER_H
#define IDEMGATE_GW_ANSWER_H
#include <stdbool.h>

struct MHD_Response;
struct cm_hdrs;
/* Adds an answer's headers to an MHD response as the front sends every answer: the stored or upstream headers in
 * order, without Content-Length (MHD writes it), hop-by-hop ones and any Idempotent-Replayed, then ours when
 * replayed, then the request id (SPEC 11) as rid_name: rid, replacing any stored value of rid_name (rid_name NULL:
 * headers kept as they are). A header MHD refuses is logged and left out. */
void gw_answer_headers(struct MHD_Response *resp, const struct cm_hdrs *h, bool replayed, const char *rid_name,
                       const char *rid);
#endif
