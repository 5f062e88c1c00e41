/* answer.c - a record's or an upstream's answer headers onto an MHD response (gateway/answer.h); never queues,
 * never looks anything up. */
#include "gateway/answer.h"

#include <microhttpd.h>
#include <strings.h>

#include "common/common.h"

void gw_answer_headers(struct MHD_Response *resp, const struct cm_hdrs *hdrs, bool replayed, const char *rid_name,
                       const char *rid)
{
    for (size_t i = 0; i < hdrs->n; i++) {
        const struct cm_hdr *h = &hdrs->v[i];
        /* the upstream's own Idempotent-Replayed never reaches the client (records stored before it was
         * dropped at parsing may still hold one): a replay carries exactly one, ours */
        if (strcasecmp(h->name, "Content-Length") == 0 || cm_is_hop_by_hop(h->name) ||
            strcasecmp(h->name, "Idempotent-Replayed") == 0 || (rid_name && strcasecmp(h->name, rid_name) == 0))
            continue;
        if (MHD_add_response_header(resp, h->name, h->value) != MHD_YES)
            cm_log(CM_WARN, "response_header_dropped", "name=%.64s", h->name);
    }
    if (replayed)
        MHD_add_response_header(resp, "Idempotent-Replayed", "true");
    if (rid_name && rid && *rid)
        MHD_add_response_header(resp, rid_name, rid);
}
