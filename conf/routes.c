/* routes.c - the routes: section: a route's name, match (path, path_prefix, methods), errors and ordering, and
 * the matching of a request path to a route (conf_match_route). Its idempotency: block is idempotency.c's;
 * never the checks across routes (check.c). */
#include "conf/internal.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/uri.h"

unsigned conf_method_bit(const char *method)
{
    static const struct {
        const char *name;
        unsigned bit;
    } methods[] = {
        {"GET", CONF_M_GET},         {"HEAD", CONF_M_HEAD},   {"POST", CONF_M_POST},
        {"PUT", CONF_M_PUT},         {"PATCH", CONF_M_PATCH}, {"DELETE", CONF_M_DELETE},
        {"OPTIONS", CONF_M_OPTIONS}, {"TRACE", CONF_M_TRACE}, {"CONNECT", CONF_M_CONNECT},
    };
    if (method == NULL)
        return 0;
    for (size_t i = 0; i < sizeof(methods) / sizeof(methods[0]); i++)
        if (strcmp(method, methods[i].name) == 0)
            return methods[i].bit;
    return 0;
}

const struct conf_route *conf_match_route(const struct conf *c, const char *path)
{
    if (c == NULL || path == NULL)
        return NULL;
    size_t n = strlen(path);
    char small[512];
    char *k = n < sizeof small ? small : cm_malloc(n + 1);
    cm_path_match_form(path, n, k);
    const struct conf_route *found = NULL;
    for (size_t i = 0; i < c->routes_n && !found; i++) {
        const struct conf_route *r = &c->routes[i];
        if (r->match_key != NULL && cm_path_meets(r->match_key, k, r->path == NULL))
            found = r;
    }
    if (k != small)
        free(k);
    return found;
}

static const char *const method_names[] = {"GET",    "HEAD",    "POST",  "PUT",     "PATCH",
                                           "DELETE", "OPTIONS", "TRACE", "CONNECT", NULL};

static void method_item(const void *arr, size_t i, char *out, size_t on)
{
    const unsigned char *idx = arr;
    snprintf(out, on, "%s", method_names[idx[i]]);
}

static bool show_methods(const void *base, const struct conf_i_field *f, char *buf, size_t n)
{
    unsigned bits = *(const unsigned *)conf_i_at(base, f);
    unsigned char idx[16];
    size_t k = 0;
    for (unsigned char i = 0; method_names[i] != NULL && k < sizeof idx; i++)
        if (bits & (1u << i))
            idx[k++] = i;
    conf_i_show_list(buf, n, k, idx, method_item);
    return true;
}

static bool show_errors(const void *base, const struct conf_i_field *f, char *buf, size_t n)
{
    const struct conf_errors *e = conf_i_at(base, f);
    snprintf(buf, n, "%s",
             e->kind == CONF_ERRORS_PROBLEM  ? "problem"
             : e->kind == CONF_ERRORS_STRIPE ? "stripe"
                                             : "{template: ...}");
    return true;
}

/* ---- routes */

static bool route_name_taken(const struct conf *c, const char *s)
{
    for (size_t i = 0; i < c->routes_n; i++)
        if (c->routes[i].name != NULL && strcmp(c->routes[i].name, s) == 0)
            return true;
    return false;
}

static bool fn_route_name(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    return conf_i_set_unique_name(x, n, target, "route", route_name_taken);
}

static bool check_path(struct conf_i_ctx *x, yaml_node_t *n, const char *s)
{
    if (s[0] != '/')
        return conf_i_fail(x, n, "must start with '/'");
    for (const char *p = s; *p; p++) {
        if ((unsigned char)*p <= 0x20 || *p == 0x7f)
            return conf_i_fail(x, n, "must not contain spaces or control characters");
        if (*p == '?' || *p == '#')
            return conf_i_fail(x, n, "must not contain a query or fragment ('?' or '#')");
    }
    return true;
}

static bool fn_path(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = conf_i_scalar(x, n, "a path");
    if (s == NULL || !check_path(x, n, s))
        return false;
    free(*out);
    *out = cm_strdup(s);
    return true;
}

static bool fn_path_prefix(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = conf_i_scalar(x, n, "a path prefix");
    if (s == NULL || !check_path(x, n, s))
        return false;
    size_t len = strlen(s);
    while (len > 1 && s[len - 1] == '/')
        len--;
    free(*out);
    *out = cm_strndup(s, len);
    return true;
}

static bool fn_methods(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    unsigned *out = target;
    unsigned bits = 0;
    if (!conf_i_expect_type(x, n, YAML_SEQUENCE_NODE))
        return false;
    if (n->data.sequence.items.top == n->data.sequence.items.start)
        return conf_i_fail(x, n, "must list at least one method (use idempotency.key: off to disable idempotency)");
    for (yaml_node_item_t *it = n->data.sequence.items.start; it < n->data.sequence.items.top; it++) {
        yaml_node_t *m = yaml_document_get_node(x->doc, *it);
        size_t old = conf_i_path_push(x, "[%zu]", (size_t)(it - n->data.sequence.items.start));
        const char *s = conf_i_scalar(x, m, "an HTTP method");
        if (s == NULL)
            return false;
        unsigned bit = conf_method_bit(s);
        if (bit == 0) {
            char b[80], up[16];
            size_t i = 0;
            for (; s[i] && i < sizeof(up) - 1; i++)
                up[i] = (char)toupper((unsigned char)s[i]);
            up[i] = '\0';
            if (s[i] == '\0' && conf_method_bit(up) != 0)
                return conf_i_fail(x, m, "invalid method '%s' (methods are case-sensitive: use %s)", conf_i_shown(b, s),
                                   up);
            return conf_i_fail(x, m,
                               "unknown method '%s' (use GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS, TRACE, CONNECT)",
                               conf_i_shown(b, s));
        }
        bits |= bit;
        conf_i_path_pop(x, old);
    }
    *out = bits;
    return true;
}

static const struct conf_i_field match_fields[] = {
    CONF_FIELD_FN(
        "path", struct conf_route, path, fn_path, false, .what = "path",
        .allowed = "starts with `/`; no space, control byte, `?` or `#`",
        .doc = "The route matches this path (after the gateway normalised it), compared in the match form: "
               "case folded, `;` (or `%3B`) segment parameters dropped, a trailing `/` and a suffix such as "
               "`.json` of the last segment ignored, so no spelling of the path escapes the route (security.md). "
               "Give `path` "
               "or `path_prefix`, not both. Two routes that meet only in the match form must have the "
               "same policy.",
        .example = "/v1/charges"),
    CONF_FIELD_FN("path_prefix", struct conf_route, path_prefix, fn_path_prefix, false, .what = "path",
                  .allowed = "as `path`; a trailing `/` is ignored",
                  .doc = "The route matches this path and every path below it, by whole segments: `/v1/payments` "
                         "matches `/v1/payments` and `/v1/payments/42`, not `/v1/paymentsx` (in the match form, "
                         "as `path`).",
                  .example = "/v1/payments"),
    CONF_FIELD_FN("methods", struct conf_route, methods, fn_methods, false, .what = "list of methods",
                  .def = "[POST, PATCH]", .show = show_methods,
                  .allowed = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS, TRACE, CONNECT (upper case)",
                  .doc = "The methods idempotency applies to on this route. Other methods on its paths are proxied "
                         "without a key check.",
                  .example = "[POST, PUT, PATCH]"),
};

static bool fn_match(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_route *r = target;
    size_t line = x->key_line;
    if (!conf_i_parse_map(x, n, match_fields, CONF_NFIELDS(match_fields), r))
        return false;
    if (r->path != NULL && r->path_prefix != NULL)
        return conf_i_fail_line(x, line, "path and path_prefix are mutually exclusive (use one)");
    if (r->path == NULL && r->path_prefix == NULL)
        return conf_i_fail_line(x, line, "needs exactly one of path or path_prefix");
    const char *p = r->path ? r->path : r->path_prefix;
    free(r->match_key);
    r->match_key = cm_malloc(strlen(p) + 1);
    cm_path_match_form(p, strlen(p), r->match_key);
    return true;
}

/* ---- errors: problem | stripe | {template: '...', content_type: ...} */

#define ERRORS_TEMPLATE_MAX 4096

static const char *const tmpl_names[] = {"status", "name", "title", "detail"};

static bool tmpl_space(char ch)
{
    return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r';
}

static bool tmpl_name_char(char ch)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' || ch == '-' ||
           ch == '.';
}

/* Length of what reads as a placeholder at s: '{', optional spaces, a name of letters, digits, '_', '-' or '.',
 * optional spaces (or tabs, newlines), '}'; 0 when s does not start with one. JSON braces ('{' then '"', '}' or spaces
 * and '"') are no placeholder, so {"a":1}, { "a": 1 } and {} stay text. */
static size_t tmpl_ref_len(const char *s, size_t n)
{
    size_t i = 1;
    if (n < 3 || s[0] != '{')
        return 0;
    while (i < n && tmpl_space(s[i]))
        i++;
    size_t name = i;
    while (i < n && tmpl_name_char(s[i]))
        i++;
    if (i == name)
        return 0;
    while (i < n && tmpl_space(s[i]))
        i++;
    return (i < n && s[i] == '}') ? i + 1 : 0;
}

enum conf_tmpl_var conf_tmpl_var_at(const char *s, size_t n, size_t *len)
{
    size_t l = tmpl_ref_len(s, n);
    *len = l;
    for (size_t v = 0; l && v < CONF_NFIELDS(tmpl_names); v++)
        if (l - 2 == strlen(tmpl_names[v]) && memcmp(s + 1, tmpl_names[v], l - 2) == 0)
            return (enum conf_tmpl_var)v;
    return CONF_TMPL_NONE;
}

static bool fn_errors_template(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_errors *e = target;
    const char *s = conf_i_scalar(x, n, "a template text");
    if (s == NULL)
        return false;
    size_t len = strlen(s);
    if (len > ERRORS_TEMPLATE_MAX)
        return conf_i_fail(x, n, "template too long (at most %d bytes)", ERRORS_TEMPLATE_MAX);
    for (size_t i = 0; i < len; i++) {
        size_t l;
        if (s[i] == '{' && conf_tmpl_var_at(s + i, len - i, &l) == CONF_TMPL_NONE && l > 0)
            return conf_i_fail(x, n, "unknown placeholder '%.*s' (use {status}, {name}, {title}, {detail})",
                               (int)(l > 64 ? 64 : l), s + i);
    }
    free(e->tmpl);
    e->tmpl = cm_strdup(s);
    return true;
}

/* A media type: type "/" subtype, optional parameters; no byte that could end or split a header line. */
static bool fn_errors_content_type(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_errors *e = target;
    const char *s = conf_i_scalar(x, n, "a media type");
    if (s == NULL)
        return false;
    size_t len = strlen(s), t = strcspn(s, "/"), sub = t < len ? strcspn(s + t + 1, ";") : 0;
    char b[80];
    if (t == len || !cm_token_ok(s, t) || !cm_token_ok(s + t + 1, sub) || !cm_field_value_ok(s, len) || len > 256)
        return conf_i_fail(x, n, "invalid media type '%s' (use type/subtype, e.g. application/json)",
                           conf_i_shown(b, s));
    free(e->content_type);
    e->content_type = cm_strdup(s);
    return true;
}

static const struct conf_i_field errors_fields[] = {
    CONF_FIELD_BASE("template", fn_errors_template, true, .what = "string",
                    .allowed = "at most 4096 bytes; placeholders `{status}`, `{name}`, `{title}`, `{detail}` only",
                    .doc = "The body of every gateway error on the route. `{status}` is the number; the others are "
                           "JSON-escaped text without quotes. `{` followed by `\"`, `}` or spaces is literal, so JSON "
                           "needs no escaping; anything else written like a placeholder is a config error.",
                    .example = "'{\"error\":{\"code\":\"{name}\",\"message\":\"{detail}\"}}'"),
    CONF_FIELD_BASE("content_type", fn_errors_content_type, false, .what = "media type", .def = "application/json",
                    .show = conf_i_show_str, CONF_STR_AT(struct conf_errors, content_type),
                    .allowed = "`type/subtype[; params]`", .doc = "The `Content-Type` of the template's answers.",
                    .example = "application/vnd.api+json"),
};

static bool fn_errors(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_errors *e = target;
    if (n->type == YAML_MAPPING_NODE) {
        e->kind = CONF_ERRORS_TEMPLATE;
        if (!conf_i_parse_map(x, n, errors_fields, CONF_NFIELDS(errors_fields), e))
            return false;
        if (e->content_type == NULL)
            e->content_type = cm_strdup("application/json");
        return true;
    }
    const char *s = conf_i_scalar(x, n, "problem, stripe or a mapping with template:");
    if (s == NULL)
        return false;
    char b[80];
    if (strcmp(s, "problem") == 0)
        e->kind = CONF_ERRORS_PROBLEM;
    else if (strcmp(s, "stripe") == 0)
        e->kind = CONF_ERRORS_STRIPE;
    else
        return conf_i_fail(x, n, "invalid value '%s' (use problem, stripe or {template: '...', content_type: ...})",
                           conf_i_shown(b, s));
    return true;
}

/* ---- ordering: {resource: /a/{id}/b, sequence: header:NAME | json:/pointer, on_gap, hold} (SPEC 6) */

static const char *const gap_modes[] = {"accept", "reject", "hold", NULL};

/* A path template: '/' then segments, each a literal (no braces) or exactly one {name}; no empty segment. */
static const char *resource_why(const char *s, size_t len)
{
    if (len == 0 || s[0] != '/')
        return "must start with '/'";
    if (len > CONF_RESOURCE_MAX)
        return "too long";
    size_t i = 1;
    while (i < len) {
        size_t e = i;
        while (e < len && s[e] != '/')
            e++;
        if (e == i)
            return "has an empty segment ('//')";
        if (s[i] == '{') {
            if (e - i < 3 || s[e - 1] != '}')
                return "a {name} must be a whole segment";
            for (size_t k = i + 1; k + 1 < e; k++)
                if (!((s[k] >= 'a' && s[k] <= 'z') || (s[k] >= 'A' && s[k] <= 'Z') || (s[k] >= '0' && s[k] <= '9') ||
                      s[k] == '_'))
                    return "a {name} is letters, digits and '_'";
        } else {
            for (size_t k = i; k < e; k++)
                if (s[k] == '{' || s[k] == '}' || s[k] == '?' || s[k] == '#' || (unsigned char)s[k] <= 0x20 ||
                    (unsigned char)s[k] >= 0x7f)
                    return "a literal segment holds no braces, '?', '#', spaces or control bytes";
        }
        i = e + 1;
    }
    return NULL;
}

static bool fn_ord_resource(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_ordering *o = target;
    const char *s = conf_i_scalar(x, n, "a path template such as /v1/accounts/{id}/address, or json:/POINTER");
    if (s == NULL)
        return false;
    char b[80];
    if (strncmp(s, "json:", 5) == 0) { /* SPEC 12: the resource instance is a body value */
        if (!conf_i_json_pointer_ok(s + 5, strlen(s + 5)))
            return conf_i_fail(
                x, n,
                "invalid JSON Pointer '%s' in '%s': it is empty (the whole body) or starts with '/', writes "
                "'~' only as ~0 ('~') or ~1 ('/'), and has at most 1024 bytes",
                conf_i_shown(b, s + 5), s);
        free(o->resource);
        o->resource = cm_strdup(s + 5);
        o->resource_json = true;
        return true;
    }
    size_t len = strlen(s);
    while (len > 1 && s[len - 1] == '/')
        len--;
    const char *why = resource_why(s, len);
    if (why)
        return conf_i_fail(x, n, "invalid resource template '%s': %s", conf_i_shown(b, s), why);
    free(o->resource);
    o->resource = cm_strndup(s, len);
    o->resource_json = false;
    return true;
}

static bool fn_ord_sequence(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_ordering *o = target;
    const char *s = conf_i_scalar(x, n, "header:NAME or json:/pointer");
    if (s == NULL)
        return false;
    char b[80];
    if (strncmp(s, "header:", 7) == 0 && cm_token_ok(s + 7, strlen(s + 7)) && strlen(s + 7) <= 256) {
        o->source = CONF_SEQ_HEADER;
    } else if (strncmp(s, "json:", 5) == 0 && conf_i_json_pointer_ok(s + 5, strlen(s + 5))) {
        o->source = CONF_SEQ_JSON;
    } else {
        return conf_i_fail(x, n, "invalid sequence '%s' (use header:NAME or json:/pointer, a JSON Pointer)",
                           conf_i_shown(b, s));
    }
    free(o->seq_name);
    o->seq_name = cm_strdup(s + (o->source == CONF_SEQ_HEADER ? 7 : 5));
    return true;
}

static const struct conf_i_field ordering_fields[] = {
    CONF_FIELD_BASE("resource", fn_ord_resource, true, .what = "path template or json:/POINTER",
                    .allowed = "starts with `/`; each segment a literal or one whole `{name}` (letters, digits, `_`); "
                               "or `json:/POINTER`",
                    .doc =
                        "Which requests of the route are guarded and what one resource is: a request whose whole "
                        "normalised path matches (`/v1/accounts/{id}/address`, `{name}` one non-empty segment) is "
                        "guarded, and its path is the resource. Other requests of the route are not guarded. With "
                        "`json:/POINTER` every request of the route's methods is guarded and the resource is the JSON "
                        "string or integer at the pointer of its JSON body (missing or another type: 400 "
                        "`sequence-invalid`).",
                    .example = "/v1/accounts/{id}/address"),
    CONF_FIELD_BASE("sequence", fn_ord_sequence, true, .what = "string",
                    .allowed = "`header:NAME` or `json:/pointer` (an RFC 6901 JSON Pointer into the body)",
                    .doc = "Where the request's sequence is: a decimal integer 1 to 2^63-1 (no sign, no leading zero) "
                           "in one header, or a JSON integer at the pointer of a JSON body. Missing or malformed: 400 "
                           "`sequence-invalid`.",
                    .example = "json:/version"),
    CONF_FIELD_ENUM("on_gap", struct conf_ordering, on_gap, gap_modes, .def = "accept",
                    .doc = "A sequence above the applied one + 1: `accept` forwards it; `reject` answers 409 "
                           "`sequence-gap`; `hold` waits up to `hold` for the missing ones, then forwards or answers "
                           "409 `sequence-gap`.",
                    .example = "hold"),
    CONF_FIELD("hold", CONF_F_DUR, struct conf_ordering, hold_ms, 1, CONF_DURATION_MAX, .def = "2s",
               .doc = "How long a request waits for another request of its resource still in flight (then 409 "
                      "`sequence-in-use`), and for missing sequences with `on_gap: hold`.",
               .example = "5s"),
};
_Static_assert(sizeof(enum conf_on_gap) == sizeof(int), "enum stored through int");

static bool fn_ordering(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_ordering *o = target;
    o->enabled = true;
    o->on_gap = CONF_GAP_ACCEPT;
    o->hold_ms = 2 * CONF_SEC;
    return conf_i_parse_map(x, n, ordering_fields, CONF_NFIELDS(ordering_fields), o);
}

void conf_i_ordering_free(struct conf_ordering *o)
{
    free(o->resource);
    free(o->seq_name);
}

/* ---- verify: the sender's signature (SPEC 12); the secrets are read from the environment by gateway/verify.c */

static const char *const verify_schemes[] = {"stripe", "standard-webhooks", "github", "hmac", NULL};
static const char *const verify_encodings[] = {"hex", "base64", NULL};
_Static_assert(sizeof(enum conf_verify_scheme) == sizeof(int), "enum stored through int");
_Static_assert(sizeof(enum conf_verify_encoding) == sizeof(int), "enum stored through int");

static bool fn_verify_secrets_env(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_verify *v = target;
    if (!conf_i_expect_type(x, n, YAML_SEQUENCE_NODE))
        return false;
    size_t cnt = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    if (cnt == 0 || cnt > CONF_VERIFY_SECRETS_MAX)
        return conf_i_fail(x, n, "must list 1 to %d environment variable names", CONF_VERIFY_SECRETS_MAX);
    v->secrets_env = cm_calloc(cnt, sizeof *v->secrets_env);
    for (size_t i = 0; i < cnt; i++) {
        yaml_node_t *item = yaml_document_get_node(x->doc, n->data.sequence.items.start[i]);
        if (item == NULL || !(v->secrets_env[i] = conf_i_env_name(x, item)))
            return false;
        v->secrets_env_n = i + 1;
    }
    v->secrets_line = x->key_line;
    return true;
}

/* A header name (conf_i_fn_key_header's rule) of at most 256 bytes. */
static bool fn_verify_header(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    if (!conf_i_fn_key_header(x, n, target))
        return false;
    const char *s = *(char **)target;
    char b[80];
    if (strlen(s) > 256)
        return conf_i_fail(x, n, "invalid header name '%s'", conf_i_shown(b, s));
    return true;
}

static bool fn_verify_prefix(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = conf_i_scalar(x, n, "the text before the signature");
    if (s == NULL)
        return false;
    if (strlen(s) > 64 || !cm_field_value_ok(s, strlen(s)))
        return conf_i_fail(x, n, "must be at most 64 bytes without control characters");
    free(*out);
    *out = cm_strdup(s);
    return true;
}

static const struct conf_i_field verify_fields[] = {
    CONF_FIELD_ENUM("scheme", struct conf_verify, scheme, verify_schemes, .required = true,
                    .doc = "How the sender signs: `stripe` (`Stripe-Signature: t=...,v1=HEX`, HMAC-SHA256 of "
                           "`t.body` keyed with the whole `whsec_...` secret), `standard-webhooks` (`webhook-id`, "
                           "`webhook-timestamp`, `webhook-signature: v1,BASE64 ...`, HMAC-SHA256 of "
                           "`id.timestamp.body` keyed with the base64-decoded secret after `whsec_`), `github` "
                           "(`X-Hub-Signature-256: sha256=HEX` of the body), `hmac` (HMAC-SHA256 of the body in the "
                           "header `header`, `encoding` hex or base64, after an optional `prefix`).",
                    .example = "hmac"),
    CONF_FIELD_BASE("secrets_env", fn_verify_secrets_env, true, .what = "list of environment variable names",
                    .allowed = "1 to 8 names (`A-Z a-z 0-9 _`, not starting with a digit)",
                    .doc =
                        "The environment variables holding the signing secrets. A delivery signed with any of them is "
                        "accepted: list the new secret and the old one while the sender rotates. Each is read at "
                        "start, by `--check` and on reload; one unset or empty (or, for `standard-webhooks`, not "
                        "base64 after `whsec_`) is a config error.",
                    .example = "[STRIPE_WHSEC, STRIPE_WHSEC_OLD]"),
    CONF_FIELD("tolerance", CONF_F_DUR, struct conf_verify, tolerance_ms, 1, CONF_DURATION_MAX, .def = "5m",
               .doc = "`stripe` and `standard-webhooks`: a signed timestamp older or newer than the gateway's clock by "
                      "more than this is refused (a captured delivery cannot be replayed later). Not used by `github` "
                      "and `hmac`, which sign no timestamp.",
               .example = "10m"),
    CONF_FIELD_FN("header", struct conf_verify, header, fn_verify_header, false, .what = "header name",
                  .doc = "`hmac` only (required there): the header carrying the signature.", .example = "X-Signature"),
    CONF_FIELD_ENUM("encoding", struct conf_verify, encoding, verify_encodings, .def = "hex",
                    .doc =
                        "`hmac` only: how the signature is written (base64: the standard alphabet, padding optional).",
                    .example = "base64"),
    CONF_FIELD_FN("prefix", struct conf_verify, prefix, fn_verify_prefix, false, .what = "string",
                  .doc = "`hmac` only: text the header value starts with before the signature.", .example = "sha256="),
};

static bool fn_verify(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_verify *v = target;
    size_t line = x->key_line ? x->key_line : conf_i_node_line(n);
    v->tolerance_ms = 5 * CONF_MIN;
    v->encoding = CONF_VERIFY_HEX;
    if (!conf_i_parse_map(x, n, verify_fields, CONF_NFIELDS(verify_fields), v))
        return false;
    bool hmac = v->scheme == CONF_VERIFY_HMAC;
    if (hmac && !v->header)
        return conf_i_fail_line(x, line, "scheme hmac needs header (the header carrying the signature)");
    static const char *const hmac_only[] = {"header", "encoding", "prefix"};
    for (size_t i = 0; !hmac && i < sizeof hmac_only / sizeof hmac_only[0]; i++) {
        size_t at = conf_i_find_line(x, n, hmac_only[i], NULL);
        if (at)
            return conf_i_fail_line(x, at, "%s is for scheme hmac only (%s fixes its header)", hmac_only[i],
                                    verify_schemes[v->scheme]);
    }
    v->file = x->c->file;
    v->enabled = true;
    return true;
}

void conf_i_verify_free(struct conf_verify *v)
{
    for (size_t i = 0; i < v->secrets_env_n; i++)
        free(v->secrets_env[i]);
    free(v->secrets_env);
    free(v->header);
    free(v->prefix);
}

const struct conf_i_field conf_i_route_fields[] = {
    CONF_FIELD_FN("name", struct conf_route, name, fn_route_name, true, .what = "string",
                  .allowed = "1 to 128 of `A-Z a-z 0-9 _ . -`, unique",
                  .doc = "The route's name: in metrics, logs, the admin key API, and part of every key's identity "
                         "(renaming a route starts an empty key space).",
                  .example = "payments"),
    CONF_FIELD_BASE("match", fn_match, true, .what = "mapping", CONF_SUB(match_fields, 0),
                    .doc = "Which requests the route takes. Routes are tried in order; the first match wins."),
    CONF_FIELD_FN("upstream", struct conf_route, upstream, conf_i_fn_route_upstream, false, .what = "upstream name",
                  .allowed = "a name from `upstreams`",
                  .doc = "Where the route's requests go. Required unless `default_upstream` is set (then that one).",
                  .example = "api"),
    CONF_FIELD_FN("idempotency", struct conf_route, idem, conf_i_fn_idem, false, .what = "mapping",
                  CONF_SUB(conf_i_idem_fields, offsetof(struct conf_route, idem)),
                  .doc = "How keys are handled on the route. Without this block every key below has its default "
                         "(`key: optional`: a request with a key is deduplicated)."),
    CONF_FIELD_FN("errors", struct conf_route, errors, fn_errors, false, .what = "problem, stripe or mapping",
                  .def = "problem", .show = show_errors, CONF_SUB(errors_fields, offsetof(struct conf_route, errors)),
                  .allowed = "`problem`, `stripe`, or `{template: '...', content_type: ...}`",
                  .doc = "How the gateway's own error answers on the route are written (upstream answers are never "
                         "touched): `problem` is RFC 9457 `application/problem+json`; `stripe` is "
                         "`{\"error\":{\"type\":...,\"code\":NAME,\"message\":...}}`, which Stripe's SDKs raise "
                         "as an error; a mapping gives your own template. See http.md.",
                  .example = "stripe"),
    CONF_FIELD_FN("ordering", struct conf_route, ordering, fn_ordering, false, .what = "mapping",
                  CONF_SUB(ordering_fields, offsetof(struct conf_route, ordering)),
                  .doc = "The ordering guard: a per-resource increasing sequence kept in Postgres, so that an older "
                         "write never overwrites a newer one (409 `stale-sequence`). Without it the route is not "
                         "guarded."),
    CONF_FIELD_FN("verify", struct conf_route, verify, fn_verify, false, .what = "mapping",
                  CONF_SUB(verify_fields, offsetof(struct conf_route, verify)),
                  .doc = "Verified deliveries (webhooks): every request of the route must carry the sender's valid "
                         "signature of its raw body, checked before its key is read, anything is claimed or "
                         "replayed, or anything is forwarded; otherwise 401 `signature-invalid` "
                         "(`idemgate_signature_failures_total`). A forged delivery can never claim a key."),
};

bool conf_i_fn_routes(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf *c = target;
    if (!conf_i_expect_type(x, n, YAML_SEQUENCE_NODE))
        return false;
    size_t cnt = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    c->routes = cnt ? cm_calloc(cnt, sizeof(*c->routes)) : NULL;
    for (size_t i = 0; i < cnt; i++) {
        yaml_node_t *item = yaml_document_get_node(x->doc, n->data.sequence.items.start[i]);
        struct conf_route *r = &c->routes[i];
        r->methods = CONF_M_POST | CONF_M_PATCH;
        conf_i_idem_defaults(&r->idem);
        c->routes_n = i + 1; /* the names parsed so far are checked for duplicates; this one is still NULL */
        size_t old = conf_i_path_push(x, "[%zu]", i);
        x->key_line = 0;
        size_t refs_before = x->refs_n;
        if (item == NULL || !conf_i_parse_map(x, item, conf_i_route_fields, CONF_NFIELDS(conf_i_route_fields), r))
            return false;
        r->reads_body = conf_i_route_reads_body(r);
        if (x->refs_n == refs_before) {
            conf_i_path_push(x, ".upstream");
            conf_i_add_ref(x, 0, conf_i_node_line(item), &r->upstream, NULL);
        }
        conf_i_path_pop(x, old);
    }
    return true;
}
