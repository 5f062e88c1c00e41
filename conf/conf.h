/* conf.h - the configuration: parsed once from YAML into an immutable struct,
 * validated completely before anything starts. Never a socket, never a loop. */
#ifndef IDEMGATE_CONF_H
#define IDEMGATE_CONF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

#include "conf/restart.h"
#include "conf/types.h"

/* Bit of a method name (case-sensitive, as HTTP says), 0 when unknown. */
unsigned conf_method_bit(const char *method);
/* Parses a Redis URL into *out (caller frees with conf_redis_free). false: *why says what is wrong (a constant),
 * *out is empty. */
bool conf_redis_parse(const char *url, struct conf_redis *out, const char **why) CM_MUST_CHECK;
void conf_redis_free(struct conf_redis *r);

/* Loads and validates FILE, then applies IDEMGATE_POSTGRES_URL,
 * IDEMGATE_REDIS_URL (empty string: no Redis) and IDEMGATE_ADMIN_TOKEN from
 * the environment. Returns the config, or NULL with *err set to a heap string
 * "FILE:LINE: KEY: what is wrong" (caller frees *err). Errors without a line:
 * "FILE: cannot open: ..." and "FILE: IDEMGATE_..._URL (environment): ...". */
struct conf *conf_load(const char *file, char **err);
/* Same, from a YAML text in memory; name is used in messages. */
struct conf *conf_load_string(const char *name, const char *yaml, size_t len, char **err);
void conf_destroy(struct conf *c); /* NULL is a no-op */

/* Frees what a listener address holds and zeroes it (conf_destroy does it for listen and admin.listen). */
void conf_addr_free(struct conf_addr *a);
/* "host:port" into buf, an IPv6 host in brackets ("[::1]:8080"), truncated to n; returns buf. */
const char *conf_addr_fmt(char *buf, size_t n, const char *host, unsigned port);

/* Parsers shared with tests; return false on malformed or out-of-range input. */
bool conf_parse_duration(const char *s, uint64_t *ms) CM_MUST_CHECK; /* 500ms 30s 5m 24h 7d */
bool conf_parse_size(const char *s, uint64_t *bytes) CM_MUST_CHECK;  /* 512B 64KiB 1MiB 1GiB, bare number = bytes */

/* Placeholders an errors template may use, in the order of enum conf_tmpl_var. */
enum conf_tmpl_var { CONF_TMPL_STATUS, CONF_TMPL_NAME, CONF_TMPL_TITLE, CONF_TMPL_DETAIL, CONF_TMPL_NONE };
/* The placeholder starting at s[0] == '{' (s[0..n)): CONF_TMPL_NONE when s is not exactly one of {status} {name}
 * {title} {detail} (then '{' is a literal). *len gets the length of what reads as a placeholder ('{', optional
 * spaces, a name of letters, digits, '_', '-' or '.', optional spaces, '}'), 0 when s does not start with one (JSON
 * like {"a":1} or {}). One with *len > 0 that is none of the four ({Status}, { name }) makes the template invalid
 * (conf refuses it). */
enum conf_tmpl_var conf_tmpl_var_at(const char *s, size_t n, size_t *len);

/* ---- the reference: every key the parser accepts, with its documentation (from the same tables) */
struct conf_key_doc {
    const char *path;    /* "routes[].idempotency.lease" (valid during the callback) */
    const char *key;     /* "lease" */
    unsigned depth;      /* 0: top level */
    const char *type;    /* "duration", "size", "integer", "boolean", "one of", or the key's own words */
    char allowed[256];   /* "1ms to 36500d", "`enforce`, `shadow`", or the key's own words; "" */
    const char *def;     /* the default as written in YAML; NULL: none */
    const char *doc;     /* Markdown */
    const char *example; /* a value as written in YAML ("90s"); NULL for a mapping without one */
    bool required;
    bool restart; /* a change needs a restart, not a reload */
    bool block;   /* a mapping (or a list of mappings, list) whose keys follow with depth + 1 */
    bool list;
};
typedef void (*conf_key_fn)(const struct conf_key_doc *k, void *arg);
/* Calls fn for every key, in the file's order, a mapping before its own keys. */
void conf_reference_walk(conf_key_fn fn, void *arg);
/* The value of the key at path ("routes[].idempotency.lease": the first route's) in c, written as a default is
 * ("24h", "[200]"); false when the key has no value there or no way to show it. */
bool conf_key_value(const struct conf *c, const char *path, char *buf, size_t n);

/* First route whose path or path_prefix (by whole segments) meets path under SPEC 7's rule (cm_path_meets on both
 * match forms: case, segment parameters and a format suffix on the last segment do not matter), or NULL. */
const struct conf_route *conf_match_route(const struct conf *c, const char *path);

#endif
