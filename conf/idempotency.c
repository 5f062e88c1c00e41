/* idempotency.c - a route's idempotency: block: key, header, scope and fingerprint parts, statuses, sizes,
 * modes, and its probe: (on_unknown: probe) with the rules that tie them. Never a route's match or path. */
#include "conf/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static void parts_free(struct conf_part *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(p[i].header);
    free(p);
}

static void probe_free(struct conf_probe *p);

void conf_i_idem_free(struct conf_idem *d)
{
    free(d->header);
    free(d->forward_token);
    parts_free(d->scope, d->scope_n);
    parts_free(d->fingerprint, d->fingerprint_n);
    free(d->key_from.header);
    free(d->release_statuses);
    probe_free(&d->probe);
}

/* A part's kind as written (with the ':' of a named one). */
static const char *part_name(enum conf_part_kind k)
{
    static const char *const names[] = {
        "method", "path", "query", "body", "header:", "jwt:", "json:", "form:", "query:"};
    return (unsigned)k < CONF_NFIELDS(names) ? names[k] : "?";
}

static void part_item(const void *arr, size_t i, char *out, size_t on)
{
    const struct conf_part *p = &((const struct conf_part *)arr)[i];
    snprintf(out, on, "%s%s", part_name(p->kind), p->header ? p->header : "");
}

static bool show_parts(const void *base, const struct conf_i_field *f, char *buf, size_t n)
{
    size_t items;
    const void *arr = conf_i_list_at(base, f, &items);
    conf_i_show_list(buf, n, items, arr, part_item);
    return true;
}

/* ---- idempotency */

/* Which request parts a list (or key_from) takes. */
enum {
    PART_WHOLE = 1,  /* method, path, query, body */
    PART_JWT = 2,    /* jwt:CLAIM */
    PART_SOURCE = 4, /* json:/POINTER, form:NAME, query:NAME (SPEC 12) */
};

/* One part, s as written, into *p (its name not yet copied: s + *off). false: the error is reported at m. */
static bool parse_part(struct conf_i_ctx *x, yaml_node_t *m, const char *s, unsigned allow, struct conf_part *p,
                       size_t *off)
{
    static const struct {
        const char *prefix;
        enum conf_part_kind kind;
    } named[] = {{"header:", CONF_PART_HEADER},
                 {"jwt:", CONF_PART_JWT},
                 {"json:", CONF_PART_JSON},
                 {"form:", CONF_PART_FORM},
                 {"query:", CONF_PART_QPARAM}};
    static const char *const whole[] = {"method", "path", "query", "body"};
    char b[80];
    *p = (struct conf_part){0};
    *off = 0;
    for (size_t i = 0; (allow & PART_WHOLE) && i < CONF_NFIELDS(whole); i++)
        if (strcmp(s, whole[i]) == 0) {
            p->kind = (enum conf_part_kind)(CONF_PART_METHOD + (int)i);
            return true;
        }
    for (size_t i = 0; i < CONF_NFIELDS(named); i++) {
        size_t pl = strlen(named[i].prefix);
        if (strncmp(s, named[i].prefix, pl) != 0)
            continue;
        enum conf_part_kind k = named[i].kind;
        const char *v = s + pl;
        if ((k == CONF_PART_JWT && !(allow & PART_JWT)) ||
            ((k == CONF_PART_JSON || k == CONF_PART_FORM || k == CONF_PART_QPARAM) && !(allow & PART_SOURCE)))
            break;
        p->kind = k;
        *off = pl;
        if (k == CONF_PART_HEADER && v[0] == '\0')
            return conf_i_fail(x, m, "'header:' needs a header name (e.g. header:Authorization)");
        if (k == CONF_PART_HEADER && !conf_i_is_token(v))
            return conf_i_fail(x, m, "invalid header name '%s'", conf_i_shown(b, v));
        if (k == CONF_PART_JWT && (v[0] == '\0' || strlen(v) > 128 || !cm_field_value_ok(v, strlen(v))))
            return conf_i_fail(x, m, "'jwt:' needs a claim name (e.g. jwt:sub)");
        if (k == CONF_PART_JSON && !conf_i_json_pointer_ok(v, strlen(v)))
            return conf_i_fail(
                x, m,
                "invalid JSON Pointer '%s' in '%s': it is empty (the whole body) or starts with '/', writes "
                "'~' only as ~0 ('~') or ~1 ('/'), and has at most 1024 bytes",
                conf_i_shown(b, v), s);
        if ((k == CONF_PART_FORM || k == CONF_PART_QPARAM) &&
            (v[0] == '\0' || strlen(v) > 256 || !cm_field_value_ok(v, strlen(v))))
            return conf_i_fail(x, m, "'%s' needs a field name of 1 to 256 visible bytes (e.g. %sevent_id)",
                               named[i].prefix, named[i].prefix);
        return true;
    }
    return conf_i_fail(x, m, "invalid part '%s' (use %s%s%s)", conf_i_shown(b, s),
                       allow & PART_WHOLE ? "method, path, query, body, " : "", allow & PART_JWT ? "jwt:CLAIM, " : "",
                       allow & PART_SOURCE ? "json:/POINTER, form:NAME, query:NAME or header:NAME" : "header:NAME");
}

/* Two parts of one list that name the same thing: header names are case-insensitive, the others are not. */
static bool part_same(const struct conf_part *a, enum conf_part_kind kind, const char *name)
{
    if (a->kind != kind)
        return false;
    if (!a->header || !name)
        return true;
    return (kind == CONF_PART_HEADER ? strcasecmp(a->header, name) : strcmp(a->header, name)) == 0;
}

static bool parse_parts(struct conf_i_ctx *x, yaml_node_t *n, struct conf_part **out, size_t *out_n, unsigned allow)
{
    if (!conf_i_expect_type(x, n, YAML_SEQUENCE_NODE))
        return false;
    size_t cnt = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    struct conf_part *parts = cnt ? cm_calloc(cnt, sizeof(*parts)) : NULL;
    size_t got = 0;
    for (size_t i = 0; i < cnt; i++) {
        yaml_node_t *m = yaml_document_get_node(x->doc, n->data.sequence.items.start[i]);
        size_t old = conf_i_path_push(x, "[%zu]", i);
        const char *s =
            conf_i_scalar(x, m,
                          allow & PART_JWT ? "method, path, query, body, header:NAME, jwt:CLAIM, json:/POINTER, "
                                             "form:NAME or query:NAME"
                                           : "method, path, query, body, header:NAME, json:/POINTER, form:NAME "
                                             "or query:NAME");
        struct conf_part p;
        size_t off;
        if (s == NULL || !parse_part(x, m, s, allow, &p, &off))
            goto fail;
        if (p.kind == CONF_PART_JWT && x->jwt_part_line == 0) {
            x->jwt_part_line = conf_i_node_line(m);
            snprintf(x->jwt_part_path, sizeof x->jwt_part_path, "%s", x->path);
        }
        char b[80];
        for (size_t j = 0; j < got; j++) {
            if (part_same(&parts[j], p.kind, off ? s + off : NULL)) {
                conf_i_fail(x, m, "duplicate part '%s'", conf_i_shown(b, s));
                goto fail;
            }
        }
        if (off)
            p.header = cm_strdup(s + off);
        parts[got++] = p;
        conf_i_path_pop(x, old);
    }
    parts_free(*out, *out_n);
    *out = parts;
    *out_n = got;
    return true;
fail:
    parts_free(parts, got);
    return false;
}

static bool fn_scope(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_idem *d = target;
    return parse_parts(x, n, &d->scope, &d->scope_n, PART_WHOLE | PART_JWT | PART_SOURCE);
}

static bool fn_fingerprint(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_idem *d = target;
    return parse_parts(x, n, &d->fingerprint, &d->fingerprint_n, PART_WHOLE | PART_SOURCE);
}

/* key_from: header:NAME (then the key header is NAME), json:/POINTER, form:NAME or query:NAME (SPEC 12). */
static bool fn_key_from(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_idem *d = target;
    const char *s = conf_i_scalar(x, n, "json:/POINTER, form:NAME, query:NAME or header:NAME");
    struct conf_part p;
    size_t off;
    if (s == NULL || !parse_part(x, n, s, PART_SOURCE, &p, &off))
        return false;
    free(d->key_from.header);
    p.header = cm_strdup(s + off);
    d->key_from = p;
    if (p.kind == CONF_PART_HEADER) {
        free(d->header);
        d->header = cm_strdup(p.header);
    }
    return true;
}

/* Whether any part of the route reads the body (conf_route.reads_body). */
bool conf_i_route_reads_body(const struct conf_route *r)
{
    const struct conf_idem *d = &r->idem;
    bool reads = (d->key_from.header && conf_part_reads_body(d->key_from.kind)) ||
                 (r->ordering.enabled && (r->ordering.resource_json || r->ordering.source == CONF_SEQ_JSON));
    for (size_t i = 0; i < d->scope_n; i++)
        reads = reads || conf_part_reads_body(d->scope[i].kind);
    for (size_t i = 0; i < d->fingerprint_n; i++)
        reads = reads || conf_part_reads_body(d->fingerprint[i].kind);
    return reads;
}

bool conf_i_fn_key_header(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = conf_i_scalar(x, n, "a header name");
    if (s == NULL)
        return false;
    char b[80];
    if (!conf_i_is_token(s))
        return conf_i_fail(x, n, "invalid header name '%s'", conf_i_shown(b, s));
    free(*out);
    *out = cm_strdup(s);
    return true;
}

/* A list of distinct HTTP status codes (100..599) into *out (replaced). */
static bool parse_statuses(struct conf_i_ctx *x, yaml_node_t *n, int **out, size_t *out_n)
{
    if (!conf_i_expect_type(x, n, YAML_SEQUENCE_NODE))
        return false;
    size_t cnt = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    int *st = cnt ? cm_calloc(cnt, sizeof(*st)) : NULL;
    static const struct conf_i_field status_field = {.key = "", .type = CONF_F_U32, .min = 100, .max = 599};
    for (size_t i = 0; i < cnt; i++) {
        yaml_node_t *m = yaml_document_get_node(x->doc, n->data.sequence.items.start[i]);
        size_t old = conf_i_path_push(x, "[%zu]", i);
        uint32_t v;
        if (!conf_i_set_u32(x, m, &status_field, &v))
            goto fail;
        for (size_t j = 0; j < i; j++) {
            if (st[j] == (int)v) {
                conf_i_fail(x, m, "duplicate status %u", v);
                goto fail;
            }
        }
        st[i] = (int)v;
        conf_i_path_pop(x, old);
    }
    free(*out);
    *out = st;
    *out_n = cnt;
    return true;
fail:
    free(st);
    return false;
}

static bool fn_release_statuses(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_idem *d = target;
    return parse_statuses(x, n, &d->release_statuses, &d->release_statuses_n);
}

/* ---- probe: (on_unknown: probe) */

static bool fn_probe_method(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = conf_i_scalar(x, n, "a method");
    if (s == NULL)
        return false;
    char b[80];
    if (!conf_i_is_token(s) || strlen(s) > 32)
        return conf_i_fail(x, n, "invalid method '%s' (a token, e.g. GET)", conf_i_shown(b, s));
    free(*out);
    *out = cm_strdup(s);
    return true;
}

/* Origin-form, visible ASCII without '#' or a space (the upstream clients refuse anything else), at most one
 * "{key}", no other placeholder (a typo like {id} would be sent literally). */
static bool fn_probe_path(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = conf_i_scalar(x, n, "a path");
    if (s == NULL)
        return false;
    char b[80];
    if (s[0] != '/')
        return conf_i_fail(x, n, "invalid path '%s' (must start with '/')", conf_i_shown(b, s));
    if (strlen(s) > 4096)
        return conf_i_fail(x, n, "path too long (at most 4096 bytes)");
    int keys = 0;
    for (const char *p = s; *p; p++) {
        unsigned char ch = (unsigned char)*p;
        if (ch <= 0x20 || ch >= 0x7f || ch == '#')
            return conf_i_fail(x, n, "invalid path '%s' (visible ASCII without '#' or spaces)", conf_i_shown(b, s));
        if (ch == '{') {
            if (strncmp(p, "{key}", 5) != 0)
                return conf_i_fail(x, n, "invalid path '%s' (the only placeholder is {key})", conf_i_shown(b, s));
            if (++keys > 1)
                return conf_i_fail(x, n, "invalid path '%s' ({key} at most once)", conf_i_shown(b, s));
            p += 4;
        } else if (ch == '}') {
            return conf_i_fail(x, n, "invalid path '%s' (the only placeholder is {key})", conf_i_shown(b, s));
        }
    }
    free(*out);
    *out = cm_strdup(s);
    return true;
}

static bool fn_probe_found(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_probe *p = target;
    return parse_statuses(x, n, &p->found, &p->found_n);
}

static bool fn_probe_absent(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_probe *p = target;
    return parse_statuses(x, n, &p->absent, &p->absent_n);
}

static void probe_headers_free(struct conf_probe_header *h, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(h[i].name);
        free(h[i].value);
    }
    free(h);
}

/* {Name: value, ...}: names are tokens; a value "$NAME" is read from the environment now (unset: an error); every
 * value must be a valid field value (no CR, LF, NUL or other control bytes but HTAB). */
static bool fn_probe_headers(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_probe *p = target;
    if (!conf_i_expect_type(x, n, YAML_MAPPING_NODE))
        return false;
    size_t cnt = (size_t)(n->data.mapping.pairs.top - n->data.mapping.pairs.start);
    struct conf_probe_header *h = cnt ? cm_calloc(cnt, sizeof(*h)) : NULL;
    size_t got = 0;
    for (yaml_node_pair_t *pr = n->data.mapping.pairs.start; pr < n->data.mapping.pairs.top; pr++) {
        yaml_node_t *k = yaml_document_get_node(x->doc, pr->key);
        yaml_node_t *v = yaml_document_get_node(x->doc, pr->value);
        char b[80];
        if (k == NULL || v == NULL || k->type != YAML_SCALAR_NODE) {
            conf_i_fail(x, n, "malformed mapping");
            goto fail;
        }
        const char *name = (const char *)k->data.scalar.value;
        size_t old = conf_i_path_push_key(x, conf_i_shown(b, name));
        if (!conf_i_is_token(name)) {
            conf_i_fail(x, k, "invalid header name '%s'", conf_i_shown(b, name));
            goto fail;
        }
        for (size_t j = 0; j < got; j++) {
            if (strcasecmp(h[j].name, name) == 0) {
                conf_i_fail(x, k, "duplicate header");
                goto fail;
            }
        }
        const char *val = conf_i_scalar(x, v, "a header value");
        if (val == NULL)
            goto fail;
        const char *env_val = NULL;
        if (val[0] == '$') {
            if (!conf_i_is_token(val + 1)) {
                conf_i_fail(x, v, "invalid environment variable name '%s'", conf_i_shown(b, val + 1));
                goto fail;
            }
            const char *env = getenv(val + 1);
            if (env == NULL) {
                conf_i_fail(x, v, "environment variable %s is not set", conf_i_shown(b, val + 1));
                goto fail;
            }
            val = env_val = env;
        }
        if (strlen(val) > 8192 || !cm_field_value_ok(val, strlen(val))) {
            conf_i_fail(x, v, "invalid header value (control bytes or over 8 KiB)");
            goto fail;
        }
        h[got].has_key = val != env_val && strstr(val, "{key}") != NULL;
        h[got].name = cm_strdup(name);
        h[got].value = cm_strdup(val);
        got++;
        conf_i_path_pop(x, old);
    }
    probe_headers_free(p->headers, p->headers_n);
    p->headers = h;
    p->headers_n = got;
    return true;
fail:
    probe_headers_free(h, got);
    return false;
}

static const struct conf_i_field probe_fields[] = {
    CONF_FIELD_FN("method", struct conf_probe, method, fn_probe_method, false, .what = "method", .def = "GET",
                  .show = conf_i_show_str, .allowed = "an HTTP token of at most 32 bytes",
                  .doc = "The method of the look-up request.", .example = "HEAD"),
    CONF_FIELD_FN("path", struct conf_probe, path, fn_probe_path, true, .what = "path",
                  .allowed = "starts with `/`, visible ASCII without `#`; `{key}` at most once, no other placeholder; "
                             "the path or a `headers` value must carry `{key}`",
                  .doc = "The look-up's path and query, after the upstream URL's base path. `{key}` is replaced by the "
                         "key, everything but RFC 3986 unreserved characters percent-encoded. On a scoped route the "
                         "look-up asks as the retry's tenant (see `keys_unique_upstream`).",
                  .example = "/v1/payments?idempotency_key={key}"),
    CONF_FIELD_BASE("found", fn_probe_found, false, .what = "list of statuses", .def = "[200]",
                    .show = conf_i_show_statuses, CONF_LIST_AT(struct conf_probe, found, found_n),
                    .allowed = "distinct statuses 100 to 599, none also in `absent`",
                    .doc = "Answers that mean the request executed: this answer (status, headers, body) becomes the "
                           "key's stored answer and is replayed.",
                    .example = "[200, 201]"),
    CONF_FIELD_BASE("absent", fn_probe_absent, false, .what = "list of statuses", .def = "[404]",
                    .show = conf_i_show_statuses, CONF_LIST_AT(struct conf_probe, absent, absent_n),
                    .allowed = "distinct statuses 100 to 599",
                    .doc = "Answers that mean nothing executed: the record is deleted and the retry that asked is "
                           "forwarded. Any other answer leaves the outcome unknown (409 "
                           "`idempotency-outcome-unknown`) until the next retry or sweep asks again.",
                    .example = "[404, 410]"),
    CONF_FIELD_BASE("headers", fn_probe_headers, false, .what = "mapping of header: value",
                    .allowed =
                        "names are tokens; a value `$NAME` is read from the environment at load (unset: an error); "
                        "`{key}` in a value as written is the key",
                    .doc = "The headers the look-up carries (besides `Host`), with, on a scoped route, the retry's own "
                           "scope parts: the values of its `header:` parts and its verified `Authorization` for `jwt:` "
                           "parts (replacing an entry of the same name). Never the client's other headers or its key "
                           "header.",
                    .example = "{X-Api-Key: $LOOKUP_API_KEY}"),
    CONF_FIELD("keys_unique_upstream", CONF_F_BOOL, struct conf_probe, keys_unique_upstream, 0, 0, .def = "false",
               .doc =
                   "The upstream's look-up by key alone is tenant-safe (keys are unique across tenants). Needed on a "
                   "scoped route for the background sweeper to probe it (it has no request to take the scope's parts "
                   "from) and for a scope part a look-up cannot carry (`method`, `path`, `query`, `body`: refused "
                   "otherwise).",
               .example = "true"),
    CONF_FIELD("grace", CONF_F_DUR, struct conf_probe, grace_ms, 0, CONF_DURATION_MAX, .def = "5s",
               .doc = "After a claim's lease lapses, its original request may still be running at the upstream, and a "
                      "look-up then would say `absent` for work that is about to commit. Neither a retry nor the "
                      "sweeper looks up a record before its lapse plus the upstream's `timeout` plus `grace`; until "
                      "then a retry gets 409 `idempotency-key-in-use` with `Retry-After`.",
               .example = "10s"),
};

static bool fn_probe(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_probe *p = target;
    if (!conf_i_parse_map(x, n, probe_fields, CONF_NFIELDS(probe_fields), p))
        return false;
    for (size_t i = 0; i < p->found_n; i++) {
        for (size_t j = 0; j < p->absent_n; j++) {
            if (p->found[i] == p->absent[j]) {
                conf_i_path_push(x, ".absent");
                return conf_i_fail(x, n, "status %d is in both found and absent", p->found[i]);
            }
        }
    }
    p->enabled = true;
    return true;
}

static void probe_defaults(struct conf_probe *p)
{
    memset(p, 0, sizeof *p);
    p->method = cm_strdup("GET");
    p->found = cm_calloc(1, sizeof(int));
    p->found[0] = 200;
    p->found_n = 1;
    p->absent = cm_calloc(1, sizeof(int));
    p->absent[0] = 404;
    p->absent_n = 1;
    p->grace_ms = 5000;
}

static void probe_free(struct conf_probe *p)
{
    free(p->method);
    free(p->path);
    free(p->found);
    free(p->absent);
    probe_headers_free(p->headers, p->headers_n);
}

static const char *const idem_modes[] = {"enforce", "shadow", NULL};

/* ---- end of probe: */

static const char *const key_modes[] = {"optional", "required", "off", NULL};
static const char *const in_flight_modes[] = {"conflict", "wait", NULL};
static const char *const unknown_modes[] = {"reject", "retry", "probe", NULL};

/* SPEC 9: the look-up asks the upstream about this key (the path or a header carries {key}; the upstream knows the
 * key only when it is forwarded) and, on a scoped route, as this tenant: it carries the scope's header: parts and
 * the verified Authorization of jwt: parts, nothing else, so another part is refused unless the upstream's look-up
 * by key alone is tenant-safe (keys_unique_upstream). */
static bool probe_asks_this_intent(struct conf_i_ctx *x, const struct conf_idem *d, size_t line)
{
    if (!d->forward_key) {
        conf_i_path_push(x, ".forward_key");
        return conf_i_fail_line(x, line,
                                "on_unknown: probe needs forward_key: true (the upstream would never know the key the "
                                "look-up asks about)");
    }
    bool carried = strstr(d->probe.path, "{key}") != NULL;
    for (size_t i = 0; i < d->probe.headers_n; i++)
        carried = carried || d->probe.headers[i].has_key;
    if (!carried) {
        conf_i_path_push(x, ".probe");
        return conf_i_fail_line(
            x, line,
            "the look-up does not carry {key} (put {key} in probe.path or in a probe.headers value): "
            "every key would ask the same question");
    }
    for (size_t i = 0; i < d->scope_n && !d->probe.keys_unique_upstream; i++) {
        if (d->scope[i].kind == CONF_PART_HEADER || d->scope[i].kind == CONF_PART_JWT)
            continue;
        conf_i_path_push(x, ".scope");
        return conf_i_fail_line(
            x, line,
            "the look-up cannot carry scope part '%s' (it carries header: and jwt: parts only), so it "
            "could find another tenant's request; set probe.keys_unique_upstream: true if the "
            "upstream's look-up by key alone is tenant-safe",
            part_name(d->scope[i].kind));
    }
    return true;
}

const struct conf_i_field conf_i_idem_fields[] = {
    CONF_FIELD_ENUM("key", struct conf_idem, key, key_modes, .def = "optional",
                    .doc =
                        "`required`: a request without a key is 400 `idempotency-key-missing`. `optional`: a request "
                        "without a key is proxied plainly, one with a key is deduplicated. `off`: no idempotency on "
                        "this route.",
                    .example = "required"),
    CONF_FIELD_FN("header", struct conf_idem, header, conf_i_fn_key_header, false, .what = "header name",
                  .def = "Idempotency-Key", .show = conf_i_show_str, .allowed = "an HTTP token",
                  .doc = "The request header that carries the key. A key is 1 to 255 bytes of visible ASCII (or an "
                         "RFC 8941 quoted string of them); two such headers are 400 `idempotency-key-invalid`.",
                  .example = "X-Request-Id"),
    CONF_FIELD_BASE("key_from", fn_key_from, false, .what = "request part",
                    .allowed = "`json:/POINTER`, `form:NAME`, `query:NAME`, `header:NAME`",
                    .doc =
                        "Where the key is read instead of the key header: the JSON string or integer at a JSON Pointer "
                        "into a JSON body, a field of an `application/x-www-form-urlencoded` body, a query parameter, "
                        "or a header (`header:NAME` is `header: NAME`). A string key is 1 to 255 bytes of UTF-8 "
                        "without control characters; an integer (no fraction, no exponent) is its decimal text; "
                        "another JSON value is 400 `idempotency-key-invalid`. The key header is then not read for the "
                        "key. `/admin/keys?key=` takes the same text.",
                    .example = "json:/order_no"),
    CONF_FIELD_BASE("scope", fn_scope, false, .what = "list of request parts", .def = "[]", .show = show_parts,
                    CONF_LIST_AT(struct conf_idem, scope, scope_n),
                    .allowed = "`method`, `path`, `query`, `body`, `header:NAME`, `jwt:CLAIM`, `json:/POINTER`, "
                               "`form:NAME`, `query:NAME`",
                    .doc = "The parts whose hash separates key spaces, so one tenant is never replayed another "
                           "tenant's answer (e.g. `[header:Authorization]`, or `[jwt:sub]` with a top-level `jwt:` "
                           "block, which survives a token refresh). Only the hash is stored. `--check` warns about an "
                           "idempotent or ordering route without a scope.",
                    .example = "[header:Authorization]"),
    CONF_FIELD_BASE(
        "fingerprint", fn_fingerprint, false, .what = "list of request parts", .def = "[method, path, query, body]",
        .show = show_parts, CONF_LIST_AT(struct conf_idem, fingerprint, fingerprint_n),
        .allowed = "`method`, `path`, `query`, `body`, `header:NAME`, `json:/POINTER`, `form:NAME`, "
                   "`query:NAME`",
        .doc = "The parts a retry must repeat byte for byte to be replayed; a request with the same key "
               "and another fingerprint is 422 `idempotency-key-mismatch`. A `json:/POINTER` part is the "
               "RFC 8785 canonical form of the value there (absent is a value of its own), so member order, "
               "whitespace and escapes do not count, nor do members elsewhere in the body.",
        .example = "[method, path, body, header:Content-Type]"),
    CONF_FIELD("retention", CONF_F_DUR, struct conf_idem, retention_ms, 1, CONF_DURATION_MAX, .def = "24h",
               .doc = "How long a completed answer is replayed. Afterwards the key is new again. Unknown outcomes do "
                      "not expire.",
               .example = "7d"),
    CONF_FIELD("lease", CONF_F_DUR, struct conf_idem, lease_ms, 1, CONF_DURATION_MAX, .def = "60s",
               .doc = "How long a claim in flight is honoured without its owner renewing it (the owner renews it "
                      "every third of it while the request runs). Only a dead owner's lease lapses.",
               .example = "2m"),
    CONF_FIELD_ENUM("on_in_flight", struct conf_idem, on_in_flight, in_flight_modes, .def = "conflict",
                    .doc = "A retry while the first request still runs: `conflict` answers 409 "
                           "`idempotency-key-in-use` with `Retry-After`; `wait` waits up to `wait` for the first "
                           "answer and replays it.",
                    .example = "wait"),
    CONF_FIELD("wait", CONF_F_DUR, struct conf_idem, wait_ms, 1, CONF_DURATION_MAX, .def = "10s",
               .doc = "With `on_in_flight: wait`, how long a retry waits for the first request's answer before 409.",
               .example = "30s"),
    CONF_FIELD_ENUM("on_unknown", struct conf_idem, on_unknown, unknown_modes, .def = "reject",
                    .doc = "A retry of a request whose outcome is unknown (sent, no answer), once its lease lapsed: "
                           "`reject` answers 409 `idempotency-outcome-unknown` until an operator releases the key; "
                           "`retry` forwards it again (it may execute twice); `probe` asks the upstream (`probe:`).",
                    .example = "retry"),
    CONF_FIELD_BASE("release_statuses", fn_release_statuses, false, .what = "list of statuses", .def = "[]",
                    .show = conf_i_show_statuses, CONF_LIST_AT(struct conf_idem, release_statuses, release_statuses_n),
                    .allowed = "distinct statuses 100 to 599",
                    .doc = "Upstream answers that mean nothing was done (say `[429, 503]`, if your API guarantees "
                           "it): the answer is passed on, the key released, and the next retry executes.",
                    .example = "[429, 503]"),
    CONF_FIELD("max_body", CONF_F_SIZE, struct conf_idem, max_body, 1, CONF_SIZE_MAX_BODY, .def = "1MiB",
               .doc = "The largest request body on this route (every method); beyond it 413 `payload-too-large`.",
               .example = "10MiB"),
    CONF_FIELD("forward_key", CONF_F_BOOL, struct conf_idem, forward_key, 0, 0, .def = "true",
               .doc = "Whether the key header is passed on to the upstream. `false` is refused with `on_unknown: "
                      "probe` (the upstream would never know the key it is asked about).",
               .example = "false"),
    CONF_FIELD("max_response", CONF_F_SIZE, struct conf_idem, max_response, 1, CONF_SIZE_MAX_BODY, .def = "8MiB",
               .doc = "The largest upstream answer stored and replayed. A larger one executed but cannot be stored: "
                      "502 `upstream-response-too-large`, an unknown outcome.",
               .example = "1MiB"),
    CONF_FIELD_FN("probe", struct conf_idem, probe, fn_probe, false, .what = "mapping",
                  CONF_SUB(probe_fields, offsetof(struct conf_idem, probe)),
                  .doc = "How the gateway asks the upstream whether a request with an unknown outcome executed. "
                         "Required with `on_unknown: probe`, refused otherwise."),
    CONF_FIELD_FN("forward_token", struct conf_idem, forward_token, conf_i_fn_key_header, false, .what = "header name",
                  .show = conf_i_show_str, .allowed = "an HTTP token, not the key header",
                  .doc =
                      "Every forwarded attempt carries its claim's fence in this request header: a decimal number "
                      "that is higher for every later claim of the same key (a takeover after a lapsed lease), so an "
                      "upstream can refuse a write from a stale owner. A client's own header of that name is "
                      "never passed on.",
                  .example = "Idempotency-Fence"),
    CONF_FIELD("advertise_expiry", CONF_F_BOOL, struct conf_idem, advertise_expiry, 0, 0, .def = "false",
               .doc = "Answers that are stored (the first answer and every replay of it) carry `Idempotency-Expires: "
                      "<IMF-fixdate>`, when the key stops being replayed: the completion plus `retention`, rounded "
                      "down to the second. The header is stored with the answer, so every replay repeats it.",
               .example = "true"),
    CONF_FIELD("prefer_wait_max", CONF_F_DUR, struct conf_idem, prefer_wait_max_ms, 0, CONF_DURATION_MAX, .def = "0s",
               .doc = "A client's `Prefer: wait=N` (RFC 7240) on a retry that finds the first request in flight waits "
                      "up to the smaller of N seconds and this for its answer, then replays it (or 409 as "
                      "`on_in_flight: conflict`), with `Preference-Applied: wait=M`; it replaces `on_in_flight` and "
                      "`wait` for that request. `0s`: `Prefer` is ignored.",
               .example = "10s"),
    CONF_FIELD_ENUM("mode", struct conf_idem, mode, idem_modes, .def = "enforce",
                    .doc = "`enforce`: deduplicate. `shadow`: forward every request and pass every answer on "
                           "unchanged, while counting what enforce would have done "
                           "(`idemgate_shadow_decisions_total`); see operations.md, Shadow roll-out.",
                    .example = "shadow"),
};

bool conf_i_fn_idem(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_idem *d = target;
    size_t line = x->key_line ? x->key_line : conf_i_node_line(n);
    if (!conf_i_parse_map(x, n, conf_i_idem_fields, CONF_NFIELDS(conf_i_idem_fields), target))
        return false;
    if (d->forward_token &&
        (strcasecmp(d->forward_token, d->header) == 0 || cm_is_hop_by_hop(d->forward_token) ||
         strcasecmp(d->forward_token, "Host") == 0 || strcasecmp(d->forward_token, "Content-Length") == 0)) {
        conf_i_path_push(x, ".forward_token");
        return conf_i_fail_line(x, line,
                                "forward_token cannot be the key header, Host, Content-Length or a hop-by-hop "
                                "header");
    }
    if (d->on_unknown == CONF_UNKNOWN_PROBE && !d->probe.enabled) {
        conf_i_path_push(x, ".probe");
        return conf_i_fail_line(x, line, "on_unknown: probe needs a probe: block (method, path, found, absent)");
    }
    if (d->on_unknown != CONF_UNKNOWN_PROBE && d->probe.enabled) {
        conf_i_path_push(x, ".probe");
        return conf_i_fail_line(x, line, "probe: is used only with on_unknown: probe");
    }
    return d->on_unknown != CONF_UNKNOWN_PROBE || probe_asks_this_intent(x, d, line);
}

void conf_i_idem_defaults(struct conf_idem *d)
{
    static const enum conf_part_kind fp[] = {CONF_PART_METHOD, CONF_PART_PATH, CONF_PART_QUERY, CONF_PART_BODY};
    d->key = CONF_KEY_OPTIONAL;
    d->header = cm_strdup("Idempotency-Key");
    d->scope = NULL;
    d->scope_n = 0;
    d->fingerprint = cm_calloc(4, sizeof(*d->fingerprint));
    for (size_t i = 0; i < 4; i++)
        d->fingerprint[i].kind = fp[i];
    d->fingerprint_n = 4;
    d->retention_ms = 24 * CONF_HOUR;
    d->lease_ms = 60 * CONF_SEC;
    d->on_in_flight = CONF_IN_FLIGHT_CONFLICT;
    d->wait_ms = 10 * CONF_SEC;
    d->on_unknown = CONF_UNKNOWN_REJECT;
    d->release_statuses = NULL;
    d->release_statuses_n = 0;
    d->max_body = CONF_MIB;
    d->forward_key = true;
    d->max_response = 8 * CONF_MIB;
    d->forward_token = NULL;
    d->advertise_expiry = false;
    d->prefer_wait_max_ms = 0;
    probe_defaults(&d->probe);
    d->mode = CONF_MODE_ENFORCE;
}
