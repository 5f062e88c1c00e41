/* ordering.h - the ordering guard's request side (SPEC 6): resource template
 * matching and sequence parsing (a header, or a JSON Pointer into the body). It never talks to the store (store/order.h
 * does). */
#ifndef IDEMGATE_GW_ORDERING_H
#define IDEMGATE_GW_ORDERING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "conf/conf.h"
#include "gateway/parts.h"

/* Largest sequence: 2^63 - 1. */
#define GW_SEQ_MAX INT64_MAX

/* True when path (normalized, no query) matches the template tmpl as a whole, under SPEC 7's rule (policy never
 * depends on how a path is spelled): the same number of segments, each without its parameters (';' and the rest of
 * the segment); literal segments equal up to ASCII case, the last one also followed by a format suffix ".EXT"; one
 * non-empty segment per {name}; a trailing '/' of path is ignored. On a match *resource (heap, caller frees) is the
 * resource instance: the template's literal segments as the template spells them and each {name}'s segment as
 * sent (parameters removed), so "/V1/Accounts;x/AbC/address.json" is "/v1/accounts/AbC/address". */
bool gw_order_match(const char *tmpl, const char *path, char **resource) CM_MUST_CHECK;

/* gw_order_match on the request's path, read through r. */
bool gw_order_resource(struct gw_reqparts *r, const char *tmpl, char **resource) CM_MUST_CHECK;

/* Parses a sequence header value: 1*DIGIT without sign or leading zero,
 * 1 .. 2^63-1, optional surrounding spaces/tabs. false for anything else. */
bool gw_seq_parse(const char *v, size_t len, int64_t *out) CM_MUST_CHECK;

/* Reads the sequence at the JSON Pointer ptr (RFC 6901, "" is the whole
 * document) of a JSON body: it must be a JSON integer 1 .. 2^63-1 (digits
 * only: not a string, not 1.0 or 1e3). The rest of the body is validated as
 * RFC 8259 JSON text (UTF-8) and nothing more: numbers of any magnitude,
 * "\u0000" and lone surrogate escapes are valid there. false when the body
 * is not such JSON (duplicate member names in any object, or nesting deeper
 * than 2048, refused too), the pointer names nothing, or the value is not
 * such an integer. Read by gateway/json.h; nothing is kept of the body. */
bool gw_seq_from_json(const char *body, size_t len, const char *ptr, int64_t *out) CM_MUST_CHECK;

/* A guarded request's sequence, read through r: from source CONF_SEQ_HEADER, the header name (exactly one field
 * line, its value as gw_seq_parse takes it); from CONF_SEQ_JSON, the body's value at the JSON Pointer name (as
 * gw_seq_from_json). true and *out set, or false (400 sequence-invalid). May read the body, once per r. */
bool gw_seq_from_parts(struct gw_reqparts *r, enum conf_seq_source source, const char *name,
                       int64_t *out) CM_MUST_CHECK;

#endif
