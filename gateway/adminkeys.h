/* adminkeys.h - settling an unknown outcome by hand (POST /admin/keys/settle, SPEC 11): the body's answer checked,
 * the record taken and completed with it. */
#ifndef IDEMGATE_GW_ADMINKEYS_H
#define IDEMGATE_GW_ADMINKEYS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "store/store.h"

/* Reads body {"status":201,"headers":[["Name","value"],...],"body_base64":"..."} into out (initialised here; the
 * caller frees it with cm_resp_free whatever the result): status 100-599, header names tokens and values field
 * values (no framing header), the decoded body at most max_response bytes. Returns NULL, or what is wrong (a
 * constant) for a 400. */
const char *gw_settle_parse(const char *body, size_t len, uint64_t max_response, struct cm_resp *out);

/* status and a JSON body (heap, the callee takes it): 200 {"settled":true,...}, 404/409/503 problems. */
typedef void (*gw_settle_cb)(void *arg, int status, char *json);
/* Loop thread. Takes the record id names when it is an unknown outcome (store_settle_take: under a token of its
 * own, fencing out any prober or owner) and completes it with resp (moved out: resp is left empty), kept for
 * retention_ms; the completion is retried for retry_ms. The answer's header rid_header is set to the id of the
 * request that claimed the record (as the answer the gateway stores carries it). Calls cb exactly once. */
void gw_settle_run(struct store *st, const struct store_id *id, struct cm_resp *resp, uint64_t retention_ms,
                   uint64_t retry_ms, const char *rid_header, gw_settle_cb cb, void *arg);

#endif
