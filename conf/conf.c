/* conf.c - loads the YAML configuration (libyaml document API) into struct conf and validates every key. Never a
 * socket, never the reference (reference.c) or the reload's comparison (restart.c). */
#include "conf/conf.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

#include <yaml.h>

#include "common/uri.h"

#define KIB ((uint64_t)1024)
#define MIB (KIB * 1024)
#define GIB (MIB * 1024)

#define SEC  ((uint64_t)1000)
#define MIN  (SEC * 60)
#define HOUR (MIN * 60)
#define DAY  (HOUR * 24)

/* Upper bounds that keep later arithmetic (now + duration, int conversions,
 * Postgres bytea) far from overflow. */
#define DURATION_MAX  (DAY * 36500)
#define SIZE_MAX_BODY GIB
#define CONF_FILE_MAX (4 * MIB)
#define NAME_MAX_LEN  128
#define PATH_BUF      256

/* ---------------------------------------------------------------- parsers */

enum num_err { NUM_OK, NUM_BAD, NUM_NO_UNIT, NUM_RANGE, NUM_DECIMAL_UNIT };

/* Leading decimal digits of s into *v (cm_parse_digits, the one decimal parser); returns the number of digits,
 * or 0 (with *overflow set when there were more than 19). */
static size_t parse_digits(const char *s, uint64_t *v, bool *overflow)
{
    size_t n = strspn(s, "0123456789");
    *v = 0;
    *overflow = false;
    if (n == 0 || !cm_parse_digits(s, n < 19 ? n : 19, 19, v))
        return 0;
    /* a 20th digit may still fit in 64 bits (18446744073709551615); more never do */
    unsigned d = n == 20 ? (unsigned)(s[19] - '0') : 0;
    if (n > 20 || (n == 20 && *v > (UINT64_MAX - d) / 10)) {
        *overflow = true;
        return 0;
    }
    if (n == 20)
        *v = *v * 10 + d;
    return n;
}

static enum num_err duration_parse(const char *s, uint64_t *ms)
{
    static const struct {
        const char *unit;
        uint64_t mult;
    } units[] = {{"ms", 1}, {"s", SEC}, {"m", MIN}, {"h", HOUR}, {"d", DAY}};
    uint64_t v;
    bool overflow;
    size_t n = parse_digits(s, &v, &overflow);
    if (overflow)
        return NUM_RANGE;
    if (n == 0)
        return NUM_BAD;
    if (s[n] == '\0')
        return NUM_NO_UNIT;
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
        if (strcmp(s + n, units[i].unit) == 0) {
            if (v > DURATION_MAX / units[i].mult)
                return NUM_RANGE;
            *ms = v * units[i].mult;
            return NUM_OK;
        }
    }
    return NUM_BAD;
}

static enum num_err size_parse(const char *s, uint64_t *bytes)
{
    static const struct {
        const char *unit;
        uint64_t mult;
    } units[] = {{"", 1}, {"B", 1}, {"KiB", KIB}, {"MiB", MIB}, {"GiB", GIB}};
    static const char *const decimal[] = {"KB", "MB", "GB", "kB", "K", "M", "G", "k", "Kb", "Mb", "Gb"};
    uint64_t v;
    bool overflow;
    size_t n = parse_digits(s, &v, &overflow);
    if (overflow)
        return NUM_RANGE;
    if (n == 0)
        return NUM_BAD;
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
        if (strcmp(s + n, units[i].unit) == 0) {
            if (v > UINT64_MAX / units[i].mult)
                return NUM_RANGE;
            *bytes = v * units[i].mult;
            return NUM_OK;
        }
    }
    for (size_t i = 0; i < sizeof(decimal) / sizeof(decimal[0]); i++)
        if (strcmp(s + n, decimal[i]) == 0)
            return NUM_DECIMAL_UNIT;
    return NUM_BAD;
}

const char *conf_addr_fmt(char *buf, size_t n, const char *host, unsigned port)
{
    bool v6 = strchr(host, ':') != NULL;
    snprintf(buf, n, v6 ? "[%s]:%u" : "%s:%u", host, port);
    return buf;
}

bool conf_parse_duration(const char *s, uint64_t *ms)
{
    uint64_t v = 0;
    if (s == NULL || duration_parse(s, &v) != NUM_OK)
        return false;
    *ms = v;
    return true;
}

bool conf_parse_size(const char *s, uint64_t *bytes)
{
    uint64_t v = 0;
    if (s == NULL || size_parse(s, &v) != NUM_OK)
        return false;
    *bytes = v;
    return true;
}

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

/* ---------------------------------------------------------------- freeing */

static void parts_free(struct conf_part *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(p[i].header);
    free(p);
}

static void ordering_free(struct conf_ordering *o);
static void probe_free(struct conf_probe *p);

static void idem_free(struct conf_idem *d)
{
    free(d->header);
    free(d->forward_token);
    parts_free(d->scope, d->scope_n);
    parts_free(d->fingerprint, d->fingerprint_n);
    free(d->release_statuses);
    probe_free(&d->probe);
}

void conf_destroy(struct conf *c)
{
    if (c == NULL)
        return;
    free(c->file);
    free(c->listen.host);
    free(c->admin_listen.host);
    free(c->postgres_url);
    free(c->redis_url);
    conf_redis_free(&c->redis);
    for (size_t i = 0; i < c->upstreams_n; i++) {
        free(c->upstreams[i].name);
        free(c->upstreams[i].url);
        free(c->upstreams[i].base_path);
        free(c->upstreams[i].host);
    }
    free(c->upstreams);
    for (size_t i = 0; i < c->routes_n; i++) {
        free(c->routes[i].name);
        free(c->routes[i].path);
        free(c->routes[i].path_prefix);
        free(c->routes[i].match_key);
        idem_free(&c->routes[i].idem);
        ordering_free(&c->routes[i].ordering);
        free(c->routes[i].errors.tmpl);
        free(c->routes[i].errors.content_type);
    }
    free(c->routes);
    free(c->admin_token);
    free(c->jwt.keys_file);
    free(c->jwt.secret_env);
    free(c->jwt.issuer);
    free(c->jwt.audience);
    free(c);
}

/* ---------------------------------------------------------------- context */

/* A reference to an upstream by name, resolved once the whole file is read
 * (routes may come before upstreams). node == 0: the route had no upstream
 * key and takes default_upstream. */
struct upref {
    int node;
    size_t line;
    size_t *target;
    bool *has; /* NULL for routes */
    char path[PATH_BUF];
};

struct ctx {
    const char *file;
    yaml_document_t *doc;
    struct conf *c;
    char *err;
    char path[PATH_BUF];
    size_t plen;
    size_t key_line; /* 1-based line of the key whose value is being parsed */
    struct upref *refs;
    size_t refs_n;
    size_t jwt_part_line; /* first jwt:CLAIM scope part, 0: none */
    char jwt_part_path[PATH_BUF];
};

static size_t node_line(const yaml_node_t *n)
{
    return n->start_mark.line + 1;
}

static size_t path_push(struct ctx *x, const char *fmt, ...) CM_PRINTF(2, 3);
static size_t path_push(struct ctx *x, const char *fmt, ...)
{
    size_t old = x->plen;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(x->path + x->plen, sizeof(x->path) - x->plen, fmt, ap);
    va_end(ap);
    if (n > 0)
        x->plen += (size_t)n;
    if (x->plen >= sizeof(x->path))
        x->plen = sizeof(x->path) - 1;
    return old;
}

static size_t path_push_key(struct ctx *x, const char *key)
{
    return x->plen == 0 ? path_push(x, "%s", key) : path_push(x, ".%s", key);
}

static void path_pop(struct ctx *x, size_t old)
{
    x->plen = old;
    x->path[old] = '\0';
}

/* Records the first error: "FILE:LINE: PATH: message". Returns false. */
static bool fail_line(struct ctx *x, size_t line, const char *fmt, ...) CM_PRINTF(3, 4);
static bool fail_line(struct ctx *x, size_t line, const char *fmt, ...)
{
    if (x->err != NULL)
        return false;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    x->err = cm_asprintf("%s:%zu: %s: %s", x->file, line, x->plen ? x->path : "(root)", msg);
    return false;
}

#define fail(x, node, ...) fail_line((x), node_line(node), __VA_ARGS__)

/* Copies a user value for an error message: passwords of URLs redacted, at
 * most 64 bytes, control bytes and quotes replaced, so a message stays one
 * readable line that is safe to log. */
static const char *shown(char out[80], const char *value)
{
    char red[256];
    const char *s = cm_redact_url(red, sizeof(red), value);
    size_t i = 0;
    for (; s[i] != '\0' && i < 64; i++) {
        unsigned char ch = (unsigned char)s[i];
        out[i] = (ch < 0x20 || ch == 0x7f || ch == '\'') ? '?' : (char)ch;
    }
    if (s[i] != '\0') {
        memcpy(out + i, "...", 3);
        i += 3;
    }
    out[i] = '\0';
    return out;
}

static const char *node_kind(const yaml_node_t *n)
{
    switch (n->type) {
    case YAML_MAPPING_NODE:
        return "a mapping";
    case YAML_SEQUENCE_NODE:
        return "a list";
    case YAML_SCALAR_NODE:
        return "a scalar";
    default:
        return "nothing";
    }
}

static bool is_null(const yaml_node_t *n)
{
    if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return false;
    const char *v = (const char *)n->data.scalar.value;
    return v[0] == '\0' || strcmp(v, "~") == 0 || strcmp(v, "null") == 0 || strcmp(v, "Null") == 0 ||
           strcmp(v, "NULL") == 0;
}

/* The text of a scalar node, or NULL (error recorded) for a mapping, a list,
 * a null or a string holding a NUL byte. what: "a duration", ... */
static const char *scalar(struct ctx *x, const yaml_node_t *n, const char *what)
{
    if (n->type != YAML_SCALAR_NODE) {
        fail(x, n, "expected %s, got %s", what, node_kind(n));
        return NULL;
    }
    if (is_null(n)) {
        fail(x, n, "missing value (expected %s)", what);
        return NULL;
    }
    const char *v = (const char *)n->data.scalar.value;
    if (strlen(v) != n->data.scalar.length) {
        fail(x, n, "contains a NUL byte");
        return NULL;
    }
    return v;
}

static bool expect_type(struct ctx *x, const yaml_node_t *n, yaml_node_type_t t)
{
    if (n->type == t)
        return true;
    if (n->type == YAML_SCALAR_NODE && n->data.scalar.length > 0 && !is_null(n)) {
        char b[80];
        return fail(x, n, "expected %s, got the scalar '%s'",
                    t == YAML_MAPPING_NODE ? "a mapping" : "a list ([a, b] or '- ' items)",
                    shown(b, (const char *)n->data.scalar.value));
    }
    return fail(x, n, "expected %s, got %s", t == YAML_MAPPING_NODE ? "a mapping" : "a list ([a, b] or '- ' items)",
                is_null(n) ? "nothing" : node_kind(n));
}

/* ---------------------------------------------------------------- value checks */

static bool is_token(const char *s)
{
    return cm_token_ok(s, strlen(s));
}

static bool is_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > NAME_MAX_LEN)
        return false;
    for (; *s; s++)
        if (!isalnum((unsigned char)*s) && *s != '_' && *s != '.' && *s != '-')
            return false;
    return true;
}

static bool is_hostname(const char *s, size_t n)
{
    if (n == 0 || n > 253)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)s[i]) && s[i] != '.' && s[i] != '-' && s[i] != '_')
            return false;
    return true;
}

static bool is_ipv6ish(const char *s, size_t n)
{
    if (n == 0 || n > 64)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!isxdigit((unsigned char)s[i]) && s[i] != ':' && s[i] != '.' && s[i] != '%')
            return false;
    return memchr(s, ':', n) != NULL;
}

/* A port: 1..65535 (0 too when allow_zero). */
static bool parse_port(const char *s, size_t n, bool allow_zero, uint16_t *port)
{
    uint64_t v;
    if (!cm_parse_digits(s, n, 5, &v) || v > 65535 || (v == 0 && !allow_zero))
        return false;
    *port = (uint16_t)v;
    return true;
}

/* host[:port] or [v6][:port] at s (length n). On success sets host and hostn
 * (brackets stripped), port_s and port_n (port_s NULL when no port). Returns a
 * problem text, or NULL when well formed. */
static const char *split_hostport(const char *s, size_t n, const char **host, size_t *hostn, const char **port_s,
                                  size_t *port_n)
{
    const char *rest;
    *port_s = NULL;
    *port_n = 0;
    if (n > 0 && s[0] == '[') {
        const char *close = memchr(s, ']', n);
        if (close == NULL)
            return "missing ']' after the IPv6 address";
        *host = s + 1;
        *hostn = (size_t)(close - s - 1);
        if (!is_ipv6ish(*host, *hostn))
            return "invalid IPv6 address between [ ]";
        rest = close + 1;
    } else {
        const char *colon = memchr(s, ':', n);
        *host = s;
        *hostn = colon ? (size_t)(colon - s) : n;
        if (colon && memchr(colon + 1, ':', n - (size_t)(colon + 1 - s)) != NULL)
            return "an IPv6 address must be written in brackets: [::1]:8080";
        if (*hostn == 0)
            return "missing host";
        if (!is_hostname(*host, *hostn))
            return "invalid host name";
        rest = s + *hostn;
    }
    size_t left = n - (size_t)(rest - s);
    if (left == 0)
        return NULL;
    if (rest[0] != ':')
        return "unexpected text after the host";
    *port_s = rest + 1;
    *port_n = left - 1;
    return NULL;
}

/* ---------------------------------------------------------------- table-driven mappings */

enum ftype { F_BOOL, F_U32, F_DUR, F_SIZE, F_ENUM, F_FUNC };

typedef bool (*field_fn)(struct ctx *x, yaml_node_t *n, void *target);
struct field;
/* The value of f in base (the struct its table describes) as a default is written in the reference ("[200]",
 * "127.0.0.1:8080"); false: the key has no value (unset). */
typedef bool (*show_fn)(const void *base, const struct field *f, char *buf, size_t n);

/* One key of a mapping. The same entry parses the key and documents it (idemgate --print-reference writes
 * docs/configuration.md from these tables; conf_test checks every entry has a doc and that def is what conf_load
 * gives when the key is absent). A key you add needs .doc, and .def when it has a default. */
struct field {
    const char *key;
    enum ftype type;
    size_t off;
    uint64_t min, max;        /* F_U32, F_DUR (ms), F_SIZE (bytes) */
    const char *const *names; /* F_ENUM: NULL-terminated, index = value */
    field_fn fn;              /* F_FUNC */
    bool required;
    /* the reference */
    const char *doc;         /* what the key does, for a user (Markdown) */
    const char *def;         /* the default as written in YAML; NULL: none (the key is unset) */
    const char *what;        /* F_FUNC: the value's type in words ("string", "list of statuses") */
    const char *allowed;     /* F_FUNC: its allowed values in words, or NULL */
    show_fn show;            /* F_FUNC with a default: its value as def writes it */
    size_t arr_off, n_off;   /* show_parts, show_statuses: the list's pointer and count (LIST_AT) */
    bool restart;            /* a change needs a restart (conf_restart_keys), not a reload */
    bool needed;             /* documented as required, though another source may give it (the environment) */
    const char *example;     /* a value for the key as written in YAML (conf_test loads each in a file) */
    const struct field *sub; /* a mapping's own keys (or a list's element's) */
    size_t nsub;
    size_t sub_off; /* base + sub_off is the struct sub describes (a list: the pointer to its array) */
    bool sub_list;  /* sub describes each element of a list */
};

static const char *fmt_size(char out[32], uint64_t v)
{
    if (v >= GIB && v % GIB == 0)
        snprintf(out, 32, "%" PRIu64 "GiB", v / GIB);
    else if (v >= MIB && v % MIB == 0)
        snprintf(out, 32, "%" PRIu64 "MiB", v / MIB);
    else if (v >= KIB && v % KIB == 0)
        snprintf(out, 32, "%" PRIu64 "KiB", v / KIB);
    else
        snprintf(out, 32, "%" PRIu64 "B", v);
    return out;
}

static const char *fmt_dur(char out[32], uint64_t v)
{
    if (v >= DAY && v % DAY == 0)
        snprintf(out, 32, "%" PRIu64 "d", v / DAY);
    else if (v >= HOUR && v % HOUR == 0)
        snprintf(out, 32, "%" PRIu64 "h", v / HOUR);
    else if (v >= MIN && v % MIN == 0)
        snprintf(out, 32, "%" PRIu64 "m", v / MIN);
    else if (v >= SEC && v % SEC == 0)
        snprintf(out, 32, "%" PRIu64 "s", v / SEC);
    else
        snprintf(out, 32, "%" PRIu64 "ms", v);
    return out;
}

static bool check_range(struct ctx *x, const yaml_node_t *n, uint64_t v, const struct field *f,
                        const char *(*fmt)(char[32], uint64_t))
{
    char a[32], b[32];
    if (v < f->min) {
        if (f->min == 1)
            return fail(x, n, "must be greater than 0");
        return fail(x, n, "must be at least %s (got %s)", fmt(a, f->min), fmt(b, v));
    }
    if (v > f->max)
        return fail(x, n, "must be at most %s (got %s)", fmt(a, f->max), fmt(b, v));
    return true;
}

static const char *fmt_int(char out[32], uint64_t v)
{
    snprintf(out, 32, "%" PRIu64, v);
    return out;
}

static bool set_u32(struct ctx *x, yaml_node_t *n, const struct field *f, uint32_t *out)
{
    const char *s = scalar(x, n, "an integer");
    if (s == NULL)
        return false;
    char b[80], lo[32], hi[32];
    uint64_t v;
    bool overflow;
    const char *digits = s[0] == '-' ? s + 1 : s;
    size_t nd = parse_digits(digits, &v, &overflow);
    if (!overflow && (nd == 0 || digits[nd] != '\0'))
        return fail(x, n, "invalid integer '%s'", shown(b, s));
    if (overflow || s[0] == '-' || v < f->min || v > f->max)
        return fail(x, n, "must be between %s and %s (got %s)", fmt_int(lo, f->min), fmt_int(hi, f->max), shown(b, s));
    *out = (uint32_t)v;
    return true;
}

static bool set_duration(struct ctx *x, yaml_node_t *n, const struct field *f, uint64_t *out)
{
    const char *s = scalar(x, n, "a duration");
    if (s == NULL)
        return false;
    char b[80], m[32];
    uint64_t v = 0;
    switch (duration_parse(s, &v)) {
    case NUM_OK:
        break;
    case NUM_NO_UNIT:
        return fail(x, n, "invalid duration '%s' (a unit is required: ms, s, m, h, d)", shown(b, s));
    case NUM_RANGE:
        return fail(x, n, "invalid duration '%s' (too large, at most %s)", shown(b, s), fmt_dur(m, DURATION_MAX));
    default:
        return fail(x, n, "invalid duration '%s' (use ms, s, m, h, d)", shown(b, s));
    }
    if (!check_range(x, n, v, f, fmt_dur))
        return false;
    *out = v;
    return true;
}

static bool set_size(struct ctx *x, yaml_node_t *n, const struct field *f, uint64_t *out)
{
    const char *s = scalar(x, n, "a size");
    if (s == NULL)
        return false;
    char b[80];
    uint64_t v = 0;
    switch (size_parse(s, &v)) {
    case NUM_OK:
        break;
    case NUM_DECIMAL_UNIT:
        return fail(x, n, "invalid size '%s' (sizes are 1024-based: use B, KiB, MiB, GiB)", shown(b, s));
    case NUM_RANGE:
        return fail(x, n, "invalid size '%s' (too large)", shown(b, s));
    default:
        return fail(x, n, "invalid size '%s' (use B, KiB, MiB, GiB)", shown(b, s));
    }
    if (!check_range(x, n, v, f, fmt_size))
        return false;
    *out = v;
    return true;
}

static bool set_bool(struct ctx *x, yaml_node_t *n, bool *out)
{
    const char *s = scalar(x, n, "true or false");
    if (s == NULL)
        return false;
    if (strcmp(s, "true") == 0 || strcmp(s, "True") == 0 || strcmp(s, "TRUE") == 0) {
        *out = true;
        return true;
    }
    if (strcmp(s, "false") == 0 || strcmp(s, "False") == 0 || strcmp(s, "FALSE") == 0) {
        *out = false;
        return true;
    }
    char b[80];
    return fail(x, n, "invalid boolean '%s' (use true or false)", shown(b, s));
}

static bool set_enum(struct ctx *x, yaml_node_t *n, const struct field *f, int *out)
{
    char want[128] = "";
    size_t wl = 0;
    for (size_t i = 0; f->names[i] != NULL; i++) {
        int k = snprintf(want + wl, sizeof(want) - wl, "%s%s", i ? ", " : "", f->names[i]);
        if (k > 0 && (size_t)k < sizeof(want) - wl)
            wl += (size_t)k;
    }
    char what[160];
    snprintf(what, sizeof(what), "one of %s", want);
    const char *s = scalar(x, n, what);
    if (s == NULL)
        return false;
    for (int i = 0; f->names[i] != NULL; i++) {
        if (strcmp(s, f->names[i]) == 0) {
            *out = i;
            return true;
        }
    }
    char b[80];
    return fail(x, n, "invalid value '%s' (use %s)", shown(b, s), want);
}

/* Parses a mapping node against a table of fields; base is the struct the
 * offsets refer to. A missing required key is reported at the line of the key
 * that holds this mapping (x->key_line), or of the mapping itself. */
static bool parse_map(struct ctx *x, yaml_node_t *n, const struct field *fields, size_t nfields, void *base)
{
    size_t parent_line = x->key_line ? x->key_line : node_line(n);
    uint64_t seen = 0;
    if (!expect_type(x, n, YAML_MAPPING_NODE))
        return false;
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(x->doc, p->key);
        yaml_node_t *v = yaml_document_get_node(x->doc, p->value);
        if (k == NULL || v == NULL)
            return fail(x, n, "malformed mapping");
        if (k->type != YAML_SCALAR_NODE)
            return fail(x, k, "a key must be a plain name, got %s", node_kind(k));
        const char *key = (const char *)k->data.scalar.value;
        size_t i = 0;
        while (i < nfields && strcmp(fields[i].key, key) != 0)
            i++;
        char b[80];
        size_t old = path_push_key(x, shown(b, key));
        if (i == nfields) {
            char known[256] = "";
            size_t kl = 0;
            for (size_t j = 0; j < nfields; j++) {
                int w = snprintf(known + kl, sizeof(known) - kl, "%s%s", j ? ", " : "", fields[j].key);
                if (w > 0 && (size_t)w < sizeof(known) - kl)
                    kl += (size_t)w;
            }
            return fail(x, k, "unknown key (expected one of: %s)", known);
        }
        if (seen & ((uint64_t)1 << i))
            return fail(x, k, "duplicate key");
        seen |= (uint64_t)1 << i;
        const struct field *f = &fields[i];
        void *target = (char *)base + f->off;
        x->key_line = node_line(k);
        bool ok = false;
        switch (f->type) {
        case F_BOOL:
            ok = set_bool(x, v, target);
            break;
        case F_U32:
            ok = set_u32(x, v, f, target);
            break;
        case F_DUR:
            ok = set_duration(x, v, f, target);
            break;
        case F_SIZE:
            ok = set_size(x, v, f, target);
            break;
        case F_ENUM:
            ok = set_enum(x, v, f, target);
            break;
        case F_FUNC:
            ok = f->fn(x, v, target);
            break;
        }
        x->key_line = 0;
        if (!ok)
            return false;
        path_pop(x, old);
    }
    for (size_t i = 0; i < nfields; i++) {
        if (fields[i].required && !(seen & ((uint64_t)1 << i))) {
            path_push_key(x, fields[i].key);
            return fail_line(x, parent_line, "missing required key");
        }
    }
    return true;
}

/* The trailing arguments are designated initialisers of the reference: .doc = "...", .def = "30s", ... */
#define FIELD(k, t, s, m, lo, hi, ...)                                                                                 \
    {                                                                                                                  \
        .key = k, .type = t, .off = offsetof(s, m), .min = lo, .max = hi, __VA_ARGS__                                  \
    }
#define FIELD_ENUM(k, s, m, n, ...)                                                                                    \
    {                                                                                                                  \
        .key = k, .type = F_ENUM, .off = offsetof(s, m), .names = n, __VA_ARGS__                                       \
    }
#define FIELD_FN(k, s, m, f, req, ...)                                                                                 \
    {                                                                                                                  \
        .key = k, .type = F_FUNC, .off = offsetof(s, m), .fn = f, .required = req, __VA_ARGS__                         \
    }
#define FIELD_BASE(k, f, req, ...)                                                                                     \
    {                                                                                                                  \
        .key = k, .type = F_FUNC, .off = 0, .fn = f, .required = req, __VA_ARGS__                                      \
    }
#define NFIELDS(a) (sizeof(a) / sizeof((a)[0]))
/* A mapping's keys: table t describes the struct at base + o; SUB_LIST: the array whose pointer is at base + o. */
#define SUB(t, o)      .sub = t, .nsub = NFIELDS(t), .sub_off = o
#define SUB_LIST(t, o) SUB(t, o), .sub_list = true
/* Where show_parts and show_statuses find a list of struct s: its pointer a and its count n. */
#define LIST_AT(s, a, n) .arr_off = offsetof(s, a), .n_off = offsetof(s, n)
/* Where show_str finds the string of a FIELD_BASE key: member m of struct s. */
#define STR_AT(s, m) .arr_off = offsetof(s, m)

_Static_assert(sizeof(enum conf_key_mode) == sizeof(int), "enum stored through int");
_Static_assert(sizeof(enum conf_in_flight) == sizeof(int), "enum stored through int");
_Static_assert(sizeof(enum conf_on_unknown) == sizeof(int), "enum stored through int");
_Static_assert(sizeof(enum conf_idem_mode) == sizeof(int), "enum stored through int");
_Static_assert(sizeof(enum conf_distributed) == sizeof(int), "enum stored through int");

/* ---------------------------------------------------------------- values as the reference writes them */

static const void *at(const void *base, const struct field *f)
{
    return (const char *)base + f->off;
}

/* The string at the field's offset, or at STR_AT's (a key parsed through its whole struct, FIELD_BASE). */
static bool show_str(const void *base, const struct field *f, char *buf, size_t n)
{
    const char *s = *(char *const *)((const char *)base + (f->arr_off ? f->arr_off : f->off));
    if (s == NULL)
        return false;
    snprintf(buf, n, "%s", s);
    return true;
}

static bool show_addr(const void *base, const struct field *f, char *buf, size_t n)
{
    const struct conf_addr *a = at(base, f);
    conf_addr_fmt(buf, n, a->host, a->port);
    return true;
}

static bool show_admin_listen(const void *base, const struct field *f, char *buf, size_t n)
{
    (void)f;
    const struct conf *c = base;
    if (!c->admin_enabled)
        snprintf(buf, n, "off");
    else
        conf_addr_fmt(buf, n, c->admin_listen.host, c->admin_listen.port);
    return true;
}

/* "[a, b]" from n items written by item(i) into a bounded buffer. */
static void show_list(char *buf, size_t n, size_t items, const void *arr,
                      void (*item)(const void *arr, size_t i, char *out, size_t on))
{
    size_t l = 0;
    buf[0] = '\0';
    for (size_t i = 0; i <= items && l + 1 < n; i++) {
        char one[160] = "]";
        if (i < items)
            item(arr, i, one, sizeof one);
        int w = snprintf(buf + l, n - l, "%s%s", i == 0 ? "[" : (i < items ? ", " : ""), one);
        if (w < 0)
            break;
        l += (size_t)w;
    }
}

static const char *const method_names[] = {"GET",    "HEAD",    "POST",  "PUT",     "PATCH",
                                           "DELETE", "OPTIONS", "TRACE", "CONNECT", NULL};

static void method_item(const void *arr, size_t i, char *out, size_t on)
{
    const unsigned char *idx = arr;
    snprintf(out, on, "%s", method_names[idx[i]]);
}

static bool show_methods(const void *base, const struct field *f, char *buf, size_t n)
{
    unsigned bits = *(const unsigned *)at(base, f);
    unsigned char idx[16];
    size_t k = 0;
    for (unsigned char i = 0; method_names[i] != NULL && k < sizeof idx; i++)
        if (bits & (1u << i))
            idx[k++] = i;
    show_list(buf, n, k, idx, method_item);
    return true;
}

static void part_item(const void *arr, size_t i, char *out, size_t on)
{
    static const char *const kinds[] = {"method", "path", "query", "body", "header:", "jwt:"};
    const struct conf_part *p = &((const struct conf_part *)arr)[i];
    snprintf(out, on, "%s%s", kinds[p->kind], p->header ? p->header : "");
}

/* A (pointer, count) list at base + f->arr_off and base + f->n_off. */
static const void *list_at(const void *base, const struct field *f, size_t *n)
{
    *n = *(const size_t *)((const char *)base + f->n_off);
    return *(const void *const *)((const char *)base + f->arr_off);
}

static bool show_parts(const void *base, const struct field *f, char *buf, size_t n)
{
    size_t items;
    const void *arr = list_at(base, f, &items);
    show_list(buf, n, items, arr, part_item);
    return true;
}

static void status_item(const void *arr, size_t i, char *out, size_t on)
{
    snprintf(out, on, "%d", ((const int *)arr)[i]);
}

static bool show_statuses(const void *base, const struct field *f, char *buf, size_t n)
{
    size_t items;
    const void *arr = list_at(base, f, &items);
    show_list(buf, n, items, arr, status_item);
    return true;
}

static bool show_errors(const void *base, const struct field *f, char *buf, size_t n)
{
    const struct conf_errors *e = at(base, f);
    snprintf(buf, n, "%s",
             e->kind == CONF_ERRORS_PROBLEM  ? "problem"
             : e->kind == CONF_ERRORS_STRIPE ? "stripe"
                                             : "{template: ...}");
    return true;
}

/* ---------------------------------------------------------------- field handlers */

#define LISTEN_LOOKUP_MS 5000 /* a listen host name's look-up (DNS) during validation */

/* getaddrinfo as the front and the admin listener call it for their bind (AI_PASSIVE); 0 or an EAI_ code. */
static int listen_gai(const char *host, int flags)
{
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV | flags;
    int rc = getaddrinfo(host, "0", &hints, &res);
    if (rc == 0 && res == NULL)
        rc = EAI_NONAME;
    if (res != NULL)
        freeaddrinfo(res);
    return rc;
}

/* One name look-up on its own thread, so that a resolver that does not answer holds the load (start, SIGHUP) for
 * LISTEN_LOOKUP_MS at most; the last of the caller and the thread to let go frees it. */
struct lookup {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    bool done;
    int rc;
    char host[256];
};

static void lookup_unref(struct lookup *l)
{
    pthread_mutex_lock(&l->mu);
    bool last = --l->refs == 0;
    pthread_mutex_unlock(&l->mu);
    if (!last)
        return;
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

static void *lookup_main(void *arg)
{
    struct lookup *l = arg;
    int rc = listen_gai(l->host, 0);
    pthread_mutex_lock(&l->mu);
    l->rc = rc;
    l->done = true;
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
    lookup_unref(l);
    return NULL;
}

/* Whether host can be a listen address (SPEC 2: an address that can never work is a config error, not a start
 * failure): NULL when it resolves as the listeners will resolve it (nothing is bound), otherwise why not, in buf. A
 * numeric address is parsed without a look-up, and one that does not parse (999.1.1.1, 127.0.0.1.5) never goes to
 * DNS; a name is looked up within LISTEN_LOOKUP_MS. */
static const char *listen_resolves(const char *host, char *buf, size_t n)
{
    char b[80];
    if (listen_gai(host, AI_NUMERICHOST) == 0)
        return NULL;
    if (strchr(host, ':') != NULL) {
        snprintf(buf, n, "'%s' is not an IPv6 address", shown(b, host));
        return buf;
    }
    if (host[strspn(host, "0123456789.")] == '\0') {
        snprintf(buf, n, "'%s' is not an IPv4 address", shown(b, host));
        return buf;
    }
    struct lookup *l = cm_calloc(1, sizeof *l);
    pthread_mutex_init(&l->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&l->cv, &ca);
    pthread_condattr_destroy(&ca);
    snprintf(l->host, sizeof l->host, "%s", host);
    l->refs = 2;
    pthread_t t;
    pthread_attr_t ta;
    pthread_attr_init(&ta);
    pthread_attr_setdetachstate(&ta, PTHREAD_CREATE_DETACHED);
    bool started = pthread_create(&t, &ta, lookup_main, l) == 0;
    pthread_attr_destroy(&ta);
    if (!started) { /* no thread to spare: look it up here, bounded by the resolver's own timeouts */
        l->refs = 1;
        l->rc = listen_gai(host, 0);
        l->done = true;
    }
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += LISTEN_LOOKUP_MS / 1000;
    until.tv_nsec += (long)(LISTEN_LOOKUP_MS % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&l->mu);
    while (!l->done && pthread_cond_timedwait(&l->cv, &l->mu, &until) != ETIMEDOUT) {
    }
    bool done = l->done;
    int rc = l->rc;
    pthread_mutex_unlock(&l->mu);
    lookup_unref(l);
    if (!done)
        snprintf(buf, n, "cannot resolve '%s' (no answer within %ds)", shown(b, host), LISTEN_LOOKUP_MS / 1000);
    else if (rc != 0)
        snprintf(buf, n, "cannot resolve '%s' (%s)", shown(b, host), gai_strerror(rc));
    return (done && rc == 0) ? NULL : buf;
}

static bool parse_listen(struct ctx *x, yaml_node_t *n, struct conf_addr *out)
{
    const char *s = scalar(x, n, "host:port");
    if (s == NULL)
        return false;
    const char *host, *port_s;
    size_t hostn, port_n;
    char b[80];
    const char *why = split_hostport(s, strlen(s), &host, &hostn, &port_s, &port_n);
    if (why != NULL)
        return fail(x, n, "invalid address '%s': %s (use host:port or [v6]:port)", shown(b, s), why);
    if (port_s == NULL)
        return fail(x, n, "invalid address '%s': missing port (use host:port or [v6]:port)", shown(b, s));
    uint16_t port;
    if (!parse_port(port_s, port_n, true, &port))
        return fail(x, n, "invalid address '%s': port must be between 0 and 65535", shown(b, s));
    char *h = cm_strndup(host, hostn), reason[256];
    if (listen_resolves(h, reason, sizeof reason) != NULL) {
        free(h);
        return fail(x, n, "invalid address '%s': %s", shown(b, s), reason);
    }
    free(out->host);
    out->host = h;
    out->port = port;
    return true;
}

static bool fn_listen(struct ctx *x, yaml_node_t *n, void *target)
{
    return parse_listen(x, n, target);
}

static bool fn_admin_listen(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf *c = target;
    if (n->type == YAML_SCALAR_NODE && strcmp((const char *)n->data.scalar.value, "off") == 0) {
        c->admin_enabled = false;
        return true;
    }
    c->admin_enabled = true;
    return parse_listen(x, n, &c->admin_listen);
}

static const struct field admin_fields[] = {
    FIELD_BASE("listen", fn_admin_listen, false, .what = "host:port or off", .def = "127.0.0.1:9090",
               .show = show_admin_listen, .restart = true,
               .allowed = "`host:port`, `[v6]:port` (port 0: a free port), or `off`",
               .doc = "Where the admin listener (health, readiness, metrics, the status page, the key API) listens. "
                      "`off` disables it. It must differ from `listen`. Keep it on a private address: only the key "
                      "API asks for a token.",
               .example = "off"),
};

static bool fn_admin(struct ctx *x, yaml_node_t *n, void *target)
{
    return parse_map(x, n, admin_fields, NFIELDS(admin_fields), target);
}

static bool fn_postgres(struct ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = scalar(x, n, "a Postgres URL");
    if (s == NULL)
        return false;
    if (strncmp(s, "postgres://", 11) != 0 && strncmp(s, "postgresql://", 13) != 0 && strchr(s, '=') == NULL)
        return fail(x, n, "must start with postgres:// or postgresql:// (or be a key=value connection string)");
    free(*out);
    *out = cm_strdup(s);
    return true;
}

void conf_redis_free(struct conf_redis *r)
{
    free(r->host);
    free(r->unix_path);
    free(r->password);
    memset(r, 0, sizeof *r);
}

/* "?db=N" (or nothing) after a unix socket path. */
static const char *redis_unix_query(const char *q, struct conf_redis *out)
{
    if (q == NULL || q[1] == '\0')
        return NULL;
    uint64_t db;
    if (strncmp(q, "?db=", 4) != 0 || !cm_parse_digits(q + 4, strlen(q + 4), 5, &db) || db > 65535)
        return "a unix socket takes only ?db=N (e.g. unix:///run/redis.sock?db=2)";
    out->db = (uint32_t)db;
    return NULL;
}

/* A unix socket path at p up to its query (NUL or '?'). */
static const char *redis_unix(const char *p, struct conf_redis *out)
{
    size_t n = strcspn(p, "?");
    if (n < 2 || p[0] != '/')
        return "a unix socket path must be absolute: unix:///run/redis.sock";
    if (n >= 108) /* sizeof sockaddr_un.sun_path */
        return "the unix socket path is longer than 107 bytes";
    const char *why = redis_unix_query(p[n] == '?' ? p + n : NULL, out);
    if (why != NULL)
        return why;
    out->unix_path = cm_strndup(p, n);
    return NULL;
}

bool conf_redis_parse(const char *s, struct conf_redis *out, const char **why)
{
    memset(out, 0, sizeof *out);
    *why = NULL;
    if (s[0] == '/')
        *why = redis_unix(s, out);
    else if (strncmp(s, "unix://", 7) == 0)
        *why = redis_unix(s + 7, out);
    else if (strncmp(s, "redis://", 8) != 0)
        *why = "must be redis://[:password@]host:port[/db] or an absolute unix socket path";
    if (*why != NULL || out->unix_path != NULL)
        goto done;
    const char *a = s + 8;
    size_t alen = strcspn(a, "/");
    const char *at = NULL;
    for (size_t i = 0; i < alen; i++)
        if (a[i] == '@')
            at = a + i;
    if (at != NULL) {
        if (a[0] != ':') {
            *why = "user names are not supported: use redis://:password@host:port";
            goto done;
        }
        out->password = cm_strndup(a + 1, (size_t)(at - a - 1));
        alen -= (size_t)(at + 1 - a);
        a = at + 1;
    }
    const char *host, *port_s;
    size_t hostn, port_n;
    *why = split_hostport(a, alen, &host, &hostn, &port_s, &port_n);
    if (*why != NULL)
        goto done;
    if (port_s == NULL) {
        *why = "missing port (e.g. redis://127.0.0.1:6379/0)";
        goto done;
    }
    if (!parse_port(port_s, port_n, false, &out->port)) {
        *why = "port must be between 1 and 65535";
        goto done;
    }
    out->host = cm_strndup(host, hostn);
    const char *rest = a + alen;
    if (rest[0] == '\0' || strcmp(rest, "/") == 0)
        goto done;
    uint64_t db;
    if (!cm_parse_digits(rest + 1, strlen(rest + 1), 5, &db) || db > 65535)
        *why = "the database must be a number: redis://host:port/0";
    else
        out->db = (uint32_t)db;
done:
    if (*why != NULL)
        conf_redis_free(out);
    return *why == NULL;
}

/* Sets c's Redis from s (NULL or "": none). Returns a problem text, or NULL. */
static const char *set_redis(struct conf *c, const char *s)
{
    struct conf_redis r;
    const char *why = NULL;
    if (s != NULL && s[0] != '\0' && !conf_redis_parse(s, &r, &why))
        return why;
    free(c->redis_url);
    conf_redis_free(&c->redis);
    c->redis_url = NULL;
    if (s != NULL && s[0] != '\0') {
        c->redis_url = cm_strdup(s);
        c->redis = r;
    }
    return NULL;
}

static bool fn_redis(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf *c = target;
    if (is_null(n)) /* "redis:" or "redis: ~": no Redis */
        return set_redis(c, NULL) == NULL;
    const char *s = scalar(x, n, "a Redis URL");
    if (s == NULL)
        return false;
    const char *why = set_redis(c, s);
    if (why != NULL)
        return fail(x, n, "%s", why);
    return true;
}

static const char *const distributed_modes[] = {"none", "citus", NULL};

static const struct field store_fields[] = {
    FIELD_FN("postgres", struct conf, postgres_url, fn_postgres, false, .what = "string", .restart = true,
             .needed = true, .allowed = "`postgres://...`, `postgresql://...` or a libpq `key=value` string",
             .doc = "The Postgres database that is the authority for every key. Required, here or in "
                    "`IDEMGATE_POSTGRES_URL` (which replaces it). The gateway creates or migrates its table "
                    "(`idemgate_keys`) at start. Passwords are never logged.",
             .example = "postgresql://idemgate@db1:5432,db2:5432/idemgate?target_session_attrs=read-write"),
    FIELD("pool", F_U32, struct conf, pool, 1, 256, .def = "8", .restart = true,
          .doc = "Postgres connections of this process at most, shared by the I/O loops. One of them listens for "
                 "purges, for the replay cache and for the answers Redis may give (with `pool: 1` the replay cache "
                 "is off and Postgres answers every replay).",
          .example = "16"),
    FIELD_BASE("redis", fn_redis, false, .what = "string", .show = show_str, STR_AT(struct conf, redis_url),
               .restart = true,
               .allowed = "`redis://[:password@]host:port[/db]`, an absolute unix socket path, or "
                          "`unix:///path[?db=N]`; empty: no Redis",
               .doc = "The optional fast filter (needs Redis 7.0 or later). Without it every claim asks Postgres "
                      "only. Redis may be flushed, stopped or paused at any time: that costs latency, never a "
                      "second execution. `IDEMGATE_REDIS_URL` replaces it (an empty value: no Redis).",
               .example = "unix:///run/redis/redis.sock?db=2"),
    FIELD("redis_timeout", F_DUR, struct conf, redis_timeout_ms, 1, DURATION_MAX, .def = "50ms", .restart = true,
          .doc = "How long one Redis command may take before the gateway goes on with Postgres alone.",
          .example = "20ms"),
    FIELD_ENUM("distributed", struct conf, distributed, distributed_modes, .def = "none", .restart = true,
               .doc = "`none`: plain Postgres. `citus`: the database is a Citus coordinator and the gateway "
                      "distributes its table itself at start (see operations.md, Citus). "
                      "`IDEMGATE_STORE_DISTRIBUTED` replaces it.",
               .example = "citus"),
};

static bool fn_store(struct ctx *x, yaml_node_t *n, void *target)
{
    return parse_map(x, n, store_fields, NFIELDS(store_fields), target);
}

/* ---- upstreams */

/* A name of its list (upstreams, routes): 1 to NAME_MAX_LEN characters of
 * A-Z a-z 0-9 _ . -, not taken by an earlier entry. */
static bool set_unique_name(struct ctx *x, yaml_node_t *n, char **out, const char *what,
                            bool (*taken)(const struct conf *, const char *))
{
    const char *s = scalar(x, n, "a name");
    if (s == NULL)
        return false;
    char b[80];
    if (!is_name(s))
        return fail(x, n, "invalid name '%s' (1 to %d characters of A-Z a-z 0-9 _ . -)", shown(b, s), NAME_MAX_LEN);
    if (taken(x->c, s))
        return fail(x, n, "duplicate %s name '%s'", what, s);
    free(*out);
    *out = cm_strdup(s);
    return true;
}

static bool upstream_name_taken(const struct conf *c, const char *s)
{
    for (size_t i = 0; i < c->upstreams_n; i++)
        if (c->upstreams[i].name != NULL && strcmp(c->upstreams[i].name, s) == 0)
            return true;
    return false;
}

static bool fn_upstream_name(struct ctx *x, yaml_node_t *n, void *target)
{
    return set_unique_name(x, n, target, "upstream", upstream_name_taken);
}

static bool fn_upstream_url(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_upstream *u = target;
    const char *s = scalar(x, n, "an http:// URL");
    if (s == NULL)
        return false;
    size_t skip;
    if (strncasecmp(s, "http://", 7) == 0)
        skip = 7;
    else if (strncasecmp(s, "https://", 8) == 0)
        skip = 8;
    else
        return fail(x, n, "must start with http:// or https://");
    const char *a = s + skip;
    for (const char *p = s; *p; p++)
        if ((unsigned char)*p <= 0x20 || *p == 0x7f)
            return fail(x, n, "must not contain spaces or control characters");
    if (strpbrk(a, "?#") != NULL)
        return fail(x, n, "must not have a query or fragment");
    size_t alen = strcspn(a, "/");
    if (memchr(a, '@', alen) != NULL)
        return fail(x, n, "user info (user@host) is not supported");
    const char *host, *port_s;
    size_t hostn, port_n;
    const char *why = split_hostport(a, alen, &host, &hostn, &port_s, &port_n);
    if (why != NULL)
        return fail(x, n, "invalid URL: %s", why);
    uint16_t port = skip == 8 ? 443 : 80;
    if (port_s != NULL && !parse_port(port_s, port_n, false, &port))
        return fail(x, n, "invalid URL: port must be between 1 and 65535");
    char hostbuf[256];
    if (hostn >= sizeof hostbuf)
        return fail(x, n, "invalid URL: host name too long");
    memcpy(hostbuf, host, hostn);
    hostbuf[hostn] = '\0';
    unsigned char addr[16];
    bool v6 = a[0] == '[';
    bool ip = inet_pton(v6 ? AF_INET6 : AF_INET, hostbuf, addr) == 1;
    if (v6 && !ip)
        return fail(x, n, "invalid URL: invalid IPv6 address between [ ]");
    size_t len = strlen(s);
    while (len > skip + alen && s[len - 1] == '/')
        len--;
    free(u->url);
    free(u->base_path);
    free(u->host);
    u->url = cm_strndup(s, len);
    u->base_path = cm_strndup(s + skip + alen, len - skip - alen);
    u->https = skip == 8;
    u->host = cm_strdup(hostbuf);
    u->port = port;
    u->host_is_ip = ip;
    return true;
}

static const struct field upstream_fields[] = {
    FIELD_FN("name", struct conf_upstream, name, fn_upstream_name, true, .what = "string",
             .allowed = "1 to 128 of `A-Z a-z 0-9 _ . -`, unique", .doc = "The name routes and `default_upstream` use.",
             .example = "payments-api"),
    FIELD_BASE("url", fn_upstream_url, true, .what = "URL",
               .allowed = "`http://` or `https://`, a host, an optional port and base path; no user info, query "
                          "or fragment",
               .doc = "Where requests go. Parsed once at load: a request only appends its path and query to the "
                      "base path, so no request can name another host. `http://` to an IP address uses the "
                      "built-in HTTP/1.1 client; `https://` and host names use libcurl.",
               .example = "https://payments.internal:8443/base"),
    FIELD("connect_timeout", F_DUR, struct conf_upstream, connect_timeout_ms, 1, DURATION_MAX, .def = "2s",
          .doc = "How long a new connection to the upstream may take. A request that could not connect was not "
                 "sent: 502 `upstream-unavailable`, its key released.",
          .example = "500ms"),
    FIELD("timeout", F_DUR, struct conf_upstream, timeout_ms, 1, DURATION_MAX, .def = "30s",
          .doc = "How long a whole request may take, waiting for a connection included. A timeout after the "
                 "request was sent is an unknown outcome: 504 `upstream-timeout`, the key's record kept.",
          .example = "10s"),
    FIELD("max_connections", F_U32, struct conf_upstream, max_connections, 1, 100000, .def = "1024",
          .doc = "Connections to this upstream at most, over the whole process (each I/O loop holds its share, "
                 "rounded up). Beyond it requests wait in a first-in first-out queue within their `timeout`.",
          .example = "256"),
    FIELD("keepalive_timeout", F_DUR, struct conf_upstream, keepalive_timeout_ms, 1, 3600 * SEC, .def = "60s",
          .doc = "An idle upstream connection is reused for at most this long (and, with the built-in client, "
                 "for less than the upstream announces in `Keep-Alive: timeout=N`). Keep it below the "
                 "upstream's own idle timeout when that one is short and not announced.",
          .example = "2s"),
};

static bool fn_upstreams(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf *c = target;
    if (!expect_type(x, n, YAML_SEQUENCE_NODE))
        return false;
    size_t cnt = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    if (cnt == 0)
        return fail(x, n, "must list at least one upstream");
    c->upstreams = cm_calloc(cnt, sizeof(*c->upstreams));
    for (size_t i = 0; i < cnt; i++) {
        yaml_node_t *item = yaml_document_get_node(x->doc, n->data.sequence.items.start[i]);
        struct conf_upstream *u = &c->upstreams[i];
        u->connect_timeout_ms = 2 * SEC;
        u->timeout_ms = 30 * SEC;
        u->max_connections = 1024;
        u->keepalive_timeout_ms = 60 * SEC;
        size_t old = path_push(x, "[%zu]", i);
        x->key_line = 0;
        /* counted before parsing so that a half-built entry is freed */
        c->upstreams_n = i + 1;
        if (item == NULL || !parse_map(x, item, upstream_fields, NFIELDS(upstream_fields), u))
            return false;
        path_pop(x, old);
    }
    return true;
}

/* ---- references to upstreams */

static void add_ref(struct ctx *x, int node, size_t line, size_t *target, bool *has)
{
    x->refs = cm_realloc(x->refs, (x->refs_n + 1) * sizeof(*x->refs));
    struct upref *r = &x->refs[x->refs_n++];
    r->node = node;
    r->line = line;
    r->target = target;
    r->has = has;
    snprintf(r->path, sizeof(r->path), "%s", x->path);
}

static int node_id(struct ctx *x, yaml_node_t *n)
{
    return (int)(n - x->doc->nodes.start) + 1;
}

static bool fn_route_upstream(struct ctx *x, yaml_node_t *n, void *target)
{
    if (scalar(x, n, "an upstream name") == NULL)
        return false;
    add_ref(x, node_id(x, n), node_line(n), target, NULL);
    return true;
}

static bool fn_default_upstream(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf *c = target;
    if (scalar(x, n, "an upstream name") == NULL)
        return false;
    add_ref(x, node_id(x, n), node_line(n), &c->default_upstream, &c->has_default_upstream);
    return true;
}

/* Two passes: named references first, so that default_upstream is known when
 * the routes without an upstream take it. */
static bool resolve_refs(struct ctx *x)
{
    struct conf *c = x->c;
    for (size_t i = 0; i < 2 * x->refs_n; i++) {
        struct upref *r = &x->refs[i % x->refs_n];
        if ((i < x->refs_n) != (r->node != 0))
            continue;
        snprintf(x->path, sizeof(x->path), "%s", r->path);
        x->plen = strlen(x->path);
        if (r->node == 0) {
            if (c->has_default_upstream) {
                *r->target = c->default_upstream;
                continue;
            }
            return fail_line(x, r->line, "missing required key (or set default_upstream)");
        }
        const char *name = (const char *)yaml_document_get_node(x->doc, r->node)->data.scalar.value;
        size_t j = 0;
        while (j < c->upstreams_n && strcmp(c->upstreams[j].name, name) != 0)
            j++;
        if (j == c->upstreams_n) {
            char b[80], known[200] = "";
            size_t kl = 0;
            for (size_t k = 0; k < c->upstreams_n; k++) {
                int w = snprintf(known + kl, sizeof(known) - kl, "%s%s", k ? ", " : "", c->upstreams[k].name);
                if (w > 0 && (size_t)w < sizeof(known) - kl)
                    kl += (size_t)w;
            }
            return fail_line(x, r->line, "unknown upstream '%s' (defined: %s)", shown(b, name),
                             c->upstreams_n ? known : "none");
        }
        *r->target = j;
        if (r->has != NULL)
            *r->has = true;
    }
    path_pop(x, 0);
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

static bool fn_route_name(struct ctx *x, yaml_node_t *n, void *target)
{
    return set_unique_name(x, n, target, "route", route_name_taken);
}

static bool check_path(struct ctx *x, yaml_node_t *n, const char *s)
{
    if (s[0] != '/')
        return fail(x, n, "must start with '/'");
    for (const char *p = s; *p; p++) {
        if ((unsigned char)*p <= 0x20 || *p == 0x7f)
            return fail(x, n, "must not contain spaces or control characters");
        if (*p == '?' || *p == '#')
            return fail(x, n, "must not contain a query or fragment ('?' or '#')");
    }
    return true;
}

static bool fn_path(struct ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = scalar(x, n, "a path");
    if (s == NULL || !check_path(x, n, s))
        return false;
    free(*out);
    *out = cm_strdup(s);
    return true;
}

static bool fn_path_prefix(struct ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = scalar(x, n, "a path prefix");
    if (s == NULL || !check_path(x, n, s))
        return false;
    size_t len = strlen(s);
    while (len > 1 && s[len - 1] == '/')
        len--;
    free(*out);
    *out = cm_strndup(s, len);
    return true;
}

static bool fn_methods(struct ctx *x, yaml_node_t *n, void *target)
{
    unsigned *out = target;
    unsigned bits = 0;
    if (!expect_type(x, n, YAML_SEQUENCE_NODE))
        return false;
    if (n->data.sequence.items.top == n->data.sequence.items.start)
        return fail(x, n, "must list at least one method (use idempotency.key: off to disable idempotency)");
    for (yaml_node_item_t *it = n->data.sequence.items.start; it < n->data.sequence.items.top; it++) {
        yaml_node_t *m = yaml_document_get_node(x->doc, *it);
        size_t old = path_push(x, "[%zu]", (size_t)(it - n->data.sequence.items.start));
        const char *s = scalar(x, m, "an HTTP method");
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
                return fail(x, m, "invalid method '%s' (methods are case-sensitive: use %s)", shown(b, s), up);
            return fail(x, m, "unknown method '%s' (use GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS, TRACE, CONNECT)",
                        shown(b, s));
        }
        bits |= bit;
        path_pop(x, old);
    }
    *out = bits;
    return true;
}

static const struct field match_fields[] = {
    FIELD_FN("path", struct conf_route, path, fn_path, false, .what = "path",
             .allowed = "starts with `/`; no space, control byte, `?` or `#`",
             .doc = "The route matches this path (after the gateway normalised it), compared in the match form: "
                    "case folded, `;` (or `%3B`) segment parameters dropped, a trailing `/` and a suffix such as "
                    "`.json` of the last segment ignored, so no spelling of the path escapes the route (security.md). "
                    "Give `path` "
                    "or `path_prefix`, not both. Two routes that meet only in the match form must have the "
                    "same policy.",
             .example = "/v1/charges"),
    FIELD_FN("path_prefix", struct conf_route, path_prefix, fn_path_prefix, false, .what = "path",
             .allowed = "as `path`; a trailing `/` is ignored",
             .doc = "The route matches this path and every path below it, by whole segments: `/v1/payments` "
                    "matches `/v1/payments` and `/v1/payments/42`, not `/v1/paymentsx` (in the match form, "
                    "as `path`).",
             .example = "/v1/payments"),
    FIELD_FN("methods", struct conf_route, methods, fn_methods, false, .what = "list of methods",
             .def = "[POST, PATCH]", .show = show_methods,
             .allowed = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS, TRACE, CONNECT (upper case)",
             .doc = "The methods idempotency applies to on this route. Other methods on its paths are proxied "
                    "without a key check.",
             .example = "[POST, PUT, PATCH]"),
};

static bool fn_match(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_route *r = target;
    size_t line = x->key_line;
    if (!parse_map(x, n, match_fields, NFIELDS(match_fields), r))
        return false;
    if (r->path != NULL && r->path_prefix != NULL)
        return fail_line(x, line, "path and path_prefix are mutually exclusive (use one)");
    if (r->path == NULL && r->path_prefix == NULL)
        return fail_line(x, line, "needs exactly one of path or path_prefix");
    const char *p = r->path ? r->path : r->path_prefix;
    free(r->match_key);
    r->match_key = cm_malloc(strlen(p) + 1);
    cm_path_match_form(p, strlen(p), r->match_key);
    return true;
}

/* ---- idempotency */

static bool parse_parts(struct ctx *x, yaml_node_t *n, struct conf_part **out, size_t *out_n, bool allow_jwt)
{
    if (!expect_type(x, n, YAML_SEQUENCE_NODE))
        return false;
    size_t cnt = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    struct conf_part *parts = cnt ? cm_calloc(cnt, sizeof(*parts)) : NULL;
    size_t got = 0;
    for (size_t i = 0; i < cnt; i++) {
        yaml_node_t *m = yaml_document_get_node(x->doc, n->data.sequence.items.start[i]);
        size_t old = path_push(x, "[%zu]", i);
        const char *s = scalar(x, m,
                               allow_jwt ? "method, path, query, body, header:NAME or jwt:CLAIM"
                                         : "method, path, query, body or header:NAME");
        if (s == NULL)
            goto fail;
        struct conf_part p = {0};
        char b[80];
        if (strcmp(s, "method") == 0) {
            p.kind = CONF_PART_METHOD;
        } else if (strcmp(s, "path") == 0) {
            p.kind = CONF_PART_PATH;
        } else if (strcmp(s, "query") == 0) {
            p.kind = CONF_PART_QUERY;
        } else if (strcmp(s, "body") == 0) {
            p.kind = CONF_PART_BODY;
        } else if (strncmp(s, "header:", 7) == 0) {
            if (s[7] == '\0') {
                fail(x, m, "'header:' needs a header name (e.g. header:Authorization)");
                goto fail;
            }
            if (!is_token(s + 7)) {
                fail(x, m, "invalid header name '%s'", shown(b, s + 7));
                goto fail;
            }
            p.kind = CONF_PART_HEADER;
        } else if (allow_jwt && strncmp(s, "jwt:", 4) == 0) {
            if (s[4] == '\0' || strlen(s + 4) > 128 || !cm_field_value_ok(s + 4, strlen(s + 4))) {
                fail(x, m, "'jwt:' needs a claim name (e.g. jwt:sub)");
                goto fail;
            }
            p.kind = CONF_PART_JWT;
            if (x->jwt_part_line == 0) {
                x->jwt_part_line = node_line(m);
                snprintf(x->jwt_part_path, sizeof x->jwt_part_path, "%s", x->path);
            }
        } else {
            fail(x, m, "invalid part '%s' (use method, path, query, body%s or header:NAME)", shown(b, s),
                 allow_jwt ? ", jwt:CLAIM" : "");
            goto fail;
        }
        size_t off = p.kind == CONF_PART_JWT ? 4 : 7;
        for (size_t j = 0; j < got; j++) {
            if (parts[j].kind == p.kind && ((p.kind != CONF_PART_HEADER && p.kind != CONF_PART_JWT) ||
                                            (p.kind == CONF_PART_HEADER ? strcasecmp(parts[j].header, s + off)
                                                                        : strcmp(parts[j].header, s + off)) == 0)) {
                fail(x, m, "duplicate part '%s'", shown(b, s));
                goto fail;
            }
        }
        if (p.kind == CONF_PART_HEADER || p.kind == CONF_PART_JWT)
            p.header = cm_strdup(s + off);
        parts[got++] = p;
        path_pop(x, old);
    }
    parts_free(*out, *out_n);
    *out = parts;
    *out_n = got;
    return true;
fail:
    parts_free(parts, got);
    return false;
}

static bool fn_scope(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_idem *d = target;
    return parse_parts(x, n, &d->scope, &d->scope_n, true);
}

static bool fn_fingerprint(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_idem *d = target;
    return parse_parts(x, n, &d->fingerprint, &d->fingerprint_n, false);
}

static bool fn_key_header(struct ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = scalar(x, n, "a header name");
    if (s == NULL)
        return false;
    char b[80];
    if (!is_token(s))
        return fail(x, n, "invalid header name '%s'", shown(b, s));
    free(*out);
    *out = cm_strdup(s);
    return true;
}

/* A list of distinct HTTP status codes (100..599) into *out (replaced). */
static bool parse_statuses(struct ctx *x, yaml_node_t *n, int **out, size_t *out_n)
{
    if (!expect_type(x, n, YAML_SEQUENCE_NODE))
        return false;
    size_t cnt = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    int *st = cnt ? cm_calloc(cnt, sizeof(*st)) : NULL;
    static const struct field status_field = {.key = "", .type = F_U32, .min = 100, .max = 599};
    for (size_t i = 0; i < cnt; i++) {
        yaml_node_t *m = yaml_document_get_node(x->doc, n->data.sequence.items.start[i]);
        size_t old = path_push(x, "[%zu]", i);
        uint32_t v;
        if (!set_u32(x, m, &status_field, &v))
            goto fail;
        for (size_t j = 0; j < i; j++) {
            if (st[j] == (int)v) {
                fail(x, m, "duplicate status %u", v);
                goto fail;
            }
        }
        st[i] = (int)v;
        path_pop(x, old);
    }
    free(*out);
    *out = st;
    *out_n = cnt;
    return true;
fail:
    free(st);
    return false;
}

static bool fn_release_statuses(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_idem *d = target;
    return parse_statuses(x, n, &d->release_statuses, &d->release_statuses_n);
}

/* ---- probe: (on_unknown: probe) */

static bool fn_probe_method(struct ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = scalar(x, n, "a method");
    if (s == NULL)
        return false;
    char b[80];
    if (!is_token(s) || strlen(s) > 32)
        return fail(x, n, "invalid method '%s' (a token, e.g. GET)", shown(b, s));
    free(*out);
    *out = cm_strdup(s);
    return true;
}

/* Origin-form, visible ASCII without '#' or a space (the upstream clients refuse anything else), at most one
 * "{key}", no other placeholder (a typo like {id} would be sent literally). */
static bool fn_probe_path(struct ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = scalar(x, n, "a path");
    if (s == NULL)
        return false;
    char b[80];
    if (s[0] != '/')
        return fail(x, n, "invalid path '%s' (must start with '/')", shown(b, s));
    if (strlen(s) > 4096)
        return fail(x, n, "path too long (at most 4096 bytes)");
    int keys = 0;
    for (const char *p = s; *p; p++) {
        unsigned char ch = (unsigned char)*p;
        if (ch <= 0x20 || ch >= 0x7f || ch == '#')
            return fail(x, n, "invalid path '%s' (visible ASCII without '#' or spaces)", shown(b, s));
        if (ch == '{') {
            if (strncmp(p, "{key}", 5) != 0)
                return fail(x, n, "invalid path '%s' (the only placeholder is {key})", shown(b, s));
            if (++keys > 1)
                return fail(x, n, "invalid path '%s' ({key} at most once)", shown(b, s));
            p += 4;
        } else if (ch == '}') {
            return fail(x, n, "invalid path '%s' (the only placeholder is {key})", shown(b, s));
        }
    }
    free(*out);
    *out = cm_strdup(s);
    return true;
}

static bool fn_probe_found(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_probe *p = target;
    return parse_statuses(x, n, &p->found, &p->found_n);
}

static bool fn_probe_absent(struct ctx *x, yaml_node_t *n, void *target)
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
static bool fn_probe_headers(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_probe *p = target;
    if (!expect_type(x, n, YAML_MAPPING_NODE))
        return false;
    size_t cnt = (size_t)(n->data.mapping.pairs.top - n->data.mapping.pairs.start);
    struct conf_probe_header *h = cnt ? cm_calloc(cnt, sizeof(*h)) : NULL;
    size_t got = 0;
    for (yaml_node_pair_t *pr = n->data.mapping.pairs.start; pr < n->data.mapping.pairs.top; pr++) {
        yaml_node_t *k = yaml_document_get_node(x->doc, pr->key);
        yaml_node_t *v = yaml_document_get_node(x->doc, pr->value);
        char b[80];
        if (k == NULL || v == NULL || k->type != YAML_SCALAR_NODE) {
            fail(x, n, "malformed mapping");
            goto fail;
        }
        const char *name = (const char *)k->data.scalar.value;
        size_t old = path_push_key(x, shown(b, name));
        if (!is_token(name)) {
            fail(x, k, "invalid header name '%s'", shown(b, name));
            goto fail;
        }
        for (size_t j = 0; j < got; j++) {
            if (strcasecmp(h[j].name, name) == 0) {
                fail(x, k, "duplicate header");
                goto fail;
            }
        }
        const char *val = scalar(x, v, "a header value");
        if (val == NULL)
            goto fail;
        const char *env_val = NULL;
        if (val[0] == '$') {
            if (!is_token(val + 1)) {
                fail(x, v, "invalid environment variable name '%s'", shown(b, val + 1));
                goto fail;
            }
            const char *env = getenv(val + 1);
            if (env == NULL) {
                fail(x, v, "environment variable %s is not set", shown(b, val + 1));
                goto fail;
            }
            val = env_val = env;
        }
        if (strlen(val) > 8192 || !cm_field_value_ok(val, strlen(val))) {
            fail(x, v, "invalid header value (control bytes or over 8 KiB)");
            goto fail;
        }
        h[got].has_key = val != env_val && strstr(val, "{key}") != NULL;
        h[got].name = cm_strdup(name);
        h[got].value = cm_strdup(val);
        got++;
        path_pop(x, old);
    }
    probe_headers_free(p->headers, p->headers_n);
    p->headers = h;
    p->headers_n = got;
    return true;
fail:
    probe_headers_free(h, got);
    return false;
}

static const struct field probe_fields[] = {
    FIELD_FN("method", struct conf_probe, method, fn_probe_method, false, .what = "method", .def = "GET",
             .show = show_str, .allowed = "an HTTP token of at most 32 bytes",
             .doc = "The method of the look-up request.", .example = "HEAD"),
    FIELD_FN("path", struct conf_probe, path, fn_probe_path, true, .what = "path",
             .allowed = "starts with `/`, visible ASCII without `#`; `{key}` at most once, no other placeholder; "
                        "the path or a `headers` value must carry `{key}`",
             .doc = "The look-up's path and query, after the upstream URL's base path. `{key}` is replaced by the "
                    "key, everything but RFC 3986 unreserved characters percent-encoded. On a scoped route the "
                    "look-up asks as the retry's tenant (see `keys_unique_upstream`).",
             .example = "/v1/payments?idempotency_key={key}"),
    FIELD_BASE("found", fn_probe_found, false, .what = "list of statuses", .def = "[200]", .show = show_statuses,
               LIST_AT(struct conf_probe, found, found_n),
               .allowed = "distinct statuses 100 to 599, none also in `absent`",
               .doc = "Answers that mean the request executed: this answer (status, headers, body) becomes the "
                      "key's stored answer and is replayed.",
               .example = "[200, 201]"),
    FIELD_BASE("absent", fn_probe_absent, false, .what = "list of statuses", .def = "[404]", .show = show_statuses,
               LIST_AT(struct conf_probe, absent, absent_n), .allowed = "distinct statuses 100 to 599",
               .doc = "Answers that mean nothing executed: the record is deleted and the retry that asked is "
                      "forwarded. Any other answer leaves the outcome unknown (409 "
                      "`idempotency-outcome-unknown`) until the next retry or sweep asks again.",
               .example = "[404, 410]"),
    FIELD_BASE("headers", fn_probe_headers, false, .what = "mapping of header: value",
               .allowed = "names are tokens; a value `$NAME` is read from the environment at load (unset: an error); "
                          "`{key}` in a value as written is the key",
               .doc = "The headers the look-up carries (besides `Host`), with, on a scoped route, the retry's own "
                      "scope parts: the values of its `header:` parts and its verified `Authorization` for `jwt:` "
                      "parts (replacing an entry of the same name). Never the client's other headers or its key "
                      "header.",
               .example = "{X-Api-Key: $LOOKUP_API_KEY}"),
    FIELD("keys_unique_upstream", F_BOOL, struct conf_probe, keys_unique_upstream, 0, 0, .def = "false",
          .doc = "The upstream's look-up by key alone is tenant-safe (keys are unique across tenants). Needed on a "
                 "scoped route for the background sweeper to probe it (it has no request to take the scope's parts "
                 "from) and for a scope part a look-up cannot carry (`method`, `path`, `query`, `body`: refused "
                 "otherwise).",
          .example = "true"),
    FIELD("grace", F_DUR, struct conf_probe, grace_ms, 0, DURATION_MAX, .def = "5s",
          .doc = "After a claim's lease lapses, its original request may still be running at the upstream, and a "
                 "look-up then would say `absent` for work that is about to commit. Neither a retry nor the "
                 "sweeper looks up a record before its lapse plus the upstream's `timeout` plus `grace`; until "
                 "then a retry gets 409 `idempotency-key-in-use` with `Retry-After`.",
          .example = "10s"),
};

static bool fn_probe(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_probe *p = target;
    if (!parse_map(x, n, probe_fields, NFIELDS(probe_fields), p))
        return false;
    for (size_t i = 0; i < p->found_n; i++) {
        for (size_t j = 0; j < p->absent_n; j++) {
            if (p->found[i] == p->absent[j]) {
                path_push(x, ".absent");
                return fail(x, n, "status %d is in both found and absent", p->found[i]);
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

static const char *part_name(enum conf_part_kind k)
{
    static const char *const names[] = {"method", "path", "query", "body", "header:", "jwt:"};
    return (unsigned)k < NFIELDS(names) ? names[k] : "?";
}

/* SPEC 9: the look-up asks the upstream about this key (the path or a header carries {key}; the upstream knows the
 * key only when it is forwarded) and, on a scoped route, as this tenant: it carries the scope's header: parts and
 * the verified Authorization of jwt: parts, nothing else, so another part is refused unless the upstream's look-up
 * by key alone is tenant-safe (keys_unique_upstream). */
static bool probe_asks_this_intent(struct ctx *x, const struct conf_idem *d, size_t line)
{
    if (!d->forward_key) {
        path_push(x, ".forward_key");
        return fail_line(x, line,
                         "on_unknown: probe needs forward_key: true (the upstream would never know the key the "
                         "look-up asks about)");
    }
    bool carried = strstr(d->probe.path, "{key}") != NULL;
    for (size_t i = 0; i < d->probe.headers_n; i++)
        carried = carried || d->probe.headers[i].has_key;
    if (!carried) {
        path_push(x, ".probe");
        return fail_line(x, line,
                         "the look-up does not carry {key} (put {key} in probe.path or in a probe.headers value): "
                         "every key would ask the same question");
    }
    for (size_t i = 0; i < d->scope_n && !d->probe.keys_unique_upstream; i++) {
        if (d->scope[i].kind == CONF_PART_HEADER || d->scope[i].kind == CONF_PART_JWT)
            continue;
        path_push(x, ".scope");
        return fail_line(x, line,
                         "the look-up cannot carry scope part '%s' (it carries header: and jwt: parts only), so it "
                         "could find another tenant's request; set probe.keys_unique_upstream: true if the "
                         "upstream's look-up by key alone is tenant-safe",
                         part_name(d->scope[i].kind));
    }
    return true;
}

static const struct field idem_fields[] = {
    FIELD_ENUM("key", struct conf_idem, key, key_modes, .def = "optional",
               .doc = "`required`: a request without a key is 400 `idempotency-key-missing`. `optional`: a request "
                      "without a key is proxied plainly, one with a key is deduplicated. `off`: no idempotency on "
                      "this route.",
               .example = "required"),
    FIELD_FN("header", struct conf_idem, header, fn_key_header, false, .what = "header name", .def = "Idempotency-Key",
             .show = show_str, .allowed = "an HTTP token",
             .doc = "The request header that carries the key. A key is 1 to 255 bytes of visible ASCII (or an "
                    "RFC 8941 quoted string of them); two such headers are 400 `idempotency-key-invalid`.",
             .example = "X-Request-Id"),
    FIELD_BASE("scope", fn_scope, false, .what = "list of request parts", .def = "[]", .show = show_parts,
               LIST_AT(struct conf_idem, scope, scope_n),
               .allowed = "`method`, `path`, `query`, `body`, `header:NAME`, `jwt:CLAIM`",
               .doc = "The parts whose hash separates key spaces, so one tenant is never replayed another "
                      "tenant's answer (e.g. `[header:Authorization]`, or `[jwt:sub]` with a top-level `jwt:` "
                      "block, which survives a token refresh). Only the hash is stored. `--check` warns about an "
                      "idempotent or ordering route without a scope.",
               .example = "[header:Authorization]"),
    FIELD_BASE("fingerprint", fn_fingerprint, false, .what = "list of request parts",
               .def = "[method, path, query, body]", .show = show_parts,
               LIST_AT(struct conf_idem, fingerprint, fingerprint_n),
               .allowed = "`method`, `path`, `query`, `body`, `header:NAME`",
               .doc = "The parts a retry must repeat byte for byte to be replayed; a request with the same key "
                      "and another fingerprint is 422 `idempotency-key-mismatch`.",
               .example = "[method, path, body, header:Content-Type]"),
    FIELD("retention", F_DUR, struct conf_idem, retention_ms, 1, DURATION_MAX, .def = "24h",
          .doc = "How long a completed answer is replayed. Afterwards the key is new again. Unknown outcomes do "
                 "not expire.",
          .example = "7d"),
    FIELD("lease", F_DUR, struct conf_idem, lease_ms, 1, DURATION_MAX, .def = "60s",
          .doc = "How long a claim in flight is honoured without its owner renewing it (the owner renews it "
                 "every third of it while the request runs). Only a dead owner's lease lapses.",
          .example = "2m"),
    FIELD_ENUM("on_in_flight", struct conf_idem, on_in_flight, in_flight_modes, .def = "conflict",
               .doc = "A retry while the first request still runs: `conflict` answers 409 "
                      "`idempotency-key-in-use` with `Retry-After`; `wait` waits up to `wait` for the first "
                      "answer and replays it.",
               .example = "wait"),
    FIELD("wait", F_DUR, struct conf_idem, wait_ms, 1, DURATION_MAX, .def = "10s",
          .doc = "With `on_in_flight: wait`, how long a retry waits for the first request's answer before 409.",
          .example = "30s"),
    FIELD_ENUM("on_unknown", struct conf_idem, on_unknown, unknown_modes, .def = "reject",
               .doc = "A retry of a request whose outcome is unknown (sent, no answer), once its lease lapsed: "
                      "`reject` answers 409 `idempotency-outcome-unknown` until an operator releases the key; "
                      "`retry` forwards it again (it may execute twice); `probe` asks the upstream (`probe:`).",
               .example = "retry"),
    FIELD_BASE("release_statuses", fn_release_statuses, false, .what = "list of statuses", .def = "[]",
               .show = show_statuses, LIST_AT(struct conf_idem, release_statuses, release_statuses_n),
               .allowed = "distinct statuses 100 to 599",
               .doc = "Upstream answers that mean nothing was done (say `[429, 503]`, if your API guarantees "
                      "it): the answer is passed on, the key released, and the next retry executes.",
               .example = "[429, 503]"),
    FIELD("max_body", F_SIZE, struct conf_idem, max_body, 1, SIZE_MAX_BODY, .def = "1MiB",
          .doc = "The largest request body on this route (every method); beyond it 413 `payload-too-large`.",
          .example = "10MiB"),
    FIELD("forward_key", F_BOOL, struct conf_idem, forward_key, 0, 0, .def = "true",
          .doc = "Whether the key header is passed on to the upstream. `false` is refused with `on_unknown: "
                 "probe` (the upstream would never know the key it is asked about).",
          .example = "false"),
    FIELD("max_response", F_SIZE, struct conf_idem, max_response, 1, SIZE_MAX_BODY, .def = "8MiB",
          .doc = "The largest upstream answer stored and replayed. A larger one executed but cannot be stored: "
                 "502 `upstream-response-too-large`, an unknown outcome.",
          .example = "1MiB"),
    FIELD_FN("probe", struct conf_idem, probe, fn_probe, false, .what = "mapping",
             SUB(probe_fields, offsetof(struct conf_idem, probe)),
             .doc = "How the gateway asks the upstream whether a request with an unknown outcome executed. "
                    "Required with `on_unknown: probe`, refused otherwise."),
    FIELD_FN("forward_token", struct conf_idem, forward_token, fn_key_header, false, .what = "header name",
             .show = show_str, .allowed = "an HTTP token, not the key header",
             .doc = "Every forwarded attempt carries its claim's fence in this request header: a decimal number "
                    "that is higher for every later claim of the same key (a takeover after a lapsed lease), so an "
                    "upstream can refuse a write from a stale owner. A client's own header of that name is "
                    "never passed on.",
             .example = "Idempotency-Fence"),
    FIELD("advertise_expiry", F_BOOL, struct conf_idem, advertise_expiry, 0, 0, .def = "false",
          .doc = "Answers that are stored (the first answer and every replay of it) carry `Idempotency-Expires: "
                 "<IMF-fixdate>`, when the key stops being replayed: the completion plus `retention`, rounded "
                 "down to the second. The header is stored with the answer, so every replay repeats it.",
          .example = "true"),
    FIELD("prefer_wait_max", F_DUR, struct conf_idem, prefer_wait_max_ms, 0, DURATION_MAX, .def = "0s",
          .doc = "A client's `Prefer: wait=N` (RFC 7240) on a retry that finds the first request in flight waits "
                 "up to the smaller of N seconds and this for its answer, then replays it (or 409 as "
                 "`on_in_flight: conflict`), with `Preference-Applied: wait=M`; it replaces `on_in_flight` and "
                 "`wait` for that request. `0s`: `Prefer` is ignored.",
          .example = "10s"),
    FIELD_ENUM("mode", struct conf_idem, mode, idem_modes, .def = "enforce",
               .doc = "`enforce`: deduplicate. `shadow`: forward every request and pass every answer on "
                      "unchanged, while counting what enforce would have done "
                      "(`idemgate_shadow_decisions_total`); see operations.md, Shadow roll-out.",
               .example = "shadow"),
};

static bool fn_idem(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_idem *d = target;
    size_t line = x->key_line ? x->key_line : node_line(n);
    if (!parse_map(x, n, idem_fields, NFIELDS(idem_fields), target))
        return false;
    if (d->forward_token &&
        (strcasecmp(d->forward_token, d->header) == 0 || cm_is_hop_by_hop(d->forward_token) ||
         strcasecmp(d->forward_token, "Host") == 0 || strcasecmp(d->forward_token, "Content-Length") == 0)) {
        path_push(x, ".forward_token");
        return fail_line(x, line,
                         "forward_token cannot be the key header, Host, Content-Length or a hop-by-hop "
                         "header");
    }
    if (d->on_unknown == CONF_UNKNOWN_PROBE && !d->probe.enabled) {
        path_push(x, ".probe");
        return fail_line(x, line, "on_unknown: probe needs a probe: block (method, path, found, absent)");
    }
    if (d->on_unknown != CONF_UNKNOWN_PROBE && d->probe.enabled) {
        path_push(x, ".probe");
        return fail_line(x, line, "probe: is used only with on_unknown: probe");
    }
    return d->on_unknown != CONF_UNKNOWN_PROBE || probe_asks_this_intent(x, d, line);
}

static void idem_defaults(struct conf_idem *d)
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
    d->retention_ms = 24 * HOUR;
    d->lease_ms = 60 * SEC;
    d->on_in_flight = CONF_IN_FLIGHT_CONFLICT;
    d->wait_ms = 10 * SEC;
    d->on_unknown = CONF_UNKNOWN_REJECT;
    d->release_statuses = NULL;
    d->release_statuses_n = 0;
    d->max_body = MIB;
    d->forward_key = true;
    d->max_response = 8 * MIB;
    d->forward_token = NULL;
    d->advertise_expiry = false;
    d->prefer_wait_max_ms = 0;
    probe_defaults(&d->probe);
    d->mode = CONF_MODE_ENFORCE;
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
    for (size_t v = 0; l && v < NFIELDS(tmpl_names); v++)
        if (l - 2 == strlen(tmpl_names[v]) && memcmp(s + 1, tmpl_names[v], l - 2) == 0)
            return (enum conf_tmpl_var)v;
    return CONF_TMPL_NONE;
}

static bool fn_errors_template(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_errors *e = target;
    const char *s = scalar(x, n, "a template text");
    if (s == NULL)
        return false;
    size_t len = strlen(s);
    if (len > ERRORS_TEMPLATE_MAX)
        return fail(x, n, "template too long (at most %d bytes)", ERRORS_TEMPLATE_MAX);
    for (size_t i = 0; i < len; i++) {
        size_t l;
        if (s[i] == '{' && conf_tmpl_var_at(s + i, len - i, &l) == CONF_TMPL_NONE && l > 0)
            return fail(x, n, "unknown placeholder '%.*s' (use {status}, {name}, {title}, {detail})",
                        (int)(l > 64 ? 64 : l), s + i);
    }
    free(e->tmpl);
    e->tmpl = cm_strdup(s);
    return true;
}

/* A media type: type "/" subtype, optional parameters; no byte that could end or split a header line. */
static bool fn_errors_content_type(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_errors *e = target;
    const char *s = scalar(x, n, "a media type");
    if (s == NULL)
        return false;
    size_t len = strlen(s), t = strcspn(s, "/"), sub = t < len ? strcspn(s + t + 1, ";") : 0;
    char b[80];
    if (t == len || !cm_token_ok(s, t) || !cm_token_ok(s + t + 1, sub) || !cm_field_value_ok(s, len) || len > 256)
        return fail(x, n, "invalid media type '%s' (use type/subtype, e.g. application/json)", shown(b, s));
    free(e->content_type);
    e->content_type = cm_strdup(s);
    return true;
}

static const struct field errors_fields[] = {
    FIELD_BASE("template", fn_errors_template, true, .what = "string",
               .allowed = "at most 4096 bytes; placeholders `{status}`, `{name}`, `{title}`, `{detail}` only",
               .doc = "The body of every gateway error on the route. `{status}` is the number; the others are "
                      "JSON-escaped text without quotes. `{` followed by `\"`, `}` or spaces is literal, so JSON "
                      "needs no escaping; anything else written like a placeholder is a config error.",
               .example = "'{\"error\":{\"code\":\"{name}\",\"message\":\"{detail}\"}}'"),
    FIELD_BASE("content_type", fn_errors_content_type, false, .what = "media type", .def = "application/json",
               .show = show_str, STR_AT(struct conf_errors, content_type), .allowed = "`type/subtype[; params]`",
               .doc = "The `Content-Type` of the template's answers.", .example = "application/vnd.api+json"),
};

static bool fn_errors(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_errors *e = target;
    if (n->type == YAML_MAPPING_NODE) {
        e->kind = CONF_ERRORS_TEMPLATE;
        if (!parse_map(x, n, errors_fields, NFIELDS(errors_fields), e))
            return false;
        if (e->content_type == NULL)
            e->content_type = cm_strdup("application/json");
        return true;
    }
    const char *s = scalar(x, n, "problem, stripe or a mapping with template:");
    if (s == NULL)
        return false;
    char b[80];
    if (strcmp(s, "problem") == 0)
        e->kind = CONF_ERRORS_PROBLEM;
    else if (strcmp(s, "stripe") == 0)
        e->kind = CONF_ERRORS_STRIPE;
    else
        return fail(x, n, "invalid value '%s' (use problem, stripe or {template: '...', content_type: ...})",
                    shown(b, s));
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

static bool fn_ord_resource(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_ordering *o = target;
    const char *s = scalar(x, n, "a path template such as /v1/accounts/{id}/address");
    if (s == NULL)
        return false;
    size_t len = strlen(s);
    while (len > 1 && s[len - 1] == '/')
        len--;
    const char *why = resource_why(s, len);
    char b[80];
    if (why)
        return fail(x, n, "invalid resource template '%s': %s", shown(b, s), why);
    free(o->resource);
    o->resource = cm_strndup(s, len);
    return true;
}

/* A JSON Pointer (RFC 6901): "" or '/'-separated tokens where '~' is only ~0 or ~1. */
static bool pointer_ok(const char *p, size_t len)
{
    if (len > 0 && p[0] != '/')
        return false;
    for (size_t i = 0; i < len; i++)
        if (p[i] == '~' && (i + 1 == len || (p[i + 1] != '0' && p[i + 1] != '1')))
            return false;
    return len <= 1024;
}

static bool fn_ord_sequence(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_ordering *o = target;
    const char *s = scalar(x, n, "header:NAME or json:/pointer");
    if (s == NULL)
        return false;
    char b[80];
    if (strncmp(s, "header:", 7) == 0 && cm_token_ok(s + 7, strlen(s + 7)) && strlen(s + 7) <= 256) {
        o->source = CONF_SEQ_HEADER;
    } else if (strncmp(s, "json:", 5) == 0 && pointer_ok(s + 5, strlen(s + 5))) {
        o->source = CONF_SEQ_JSON;
    } else {
        return fail(x, n, "invalid sequence '%s' (use header:NAME or json:/pointer, a JSON Pointer)", shown(b, s));
    }
    free(o->seq_name);
    o->seq_name = cm_strdup(s + (o->source == CONF_SEQ_HEADER ? 7 : 5));
    return true;
}

static const struct field ordering_fields[] = {
    FIELD_BASE("resource", fn_ord_resource, true, .what = "path template",
               .allowed = "starts with `/`; each segment a literal or one whole `{name}` (letters, digits, `_`)",
               .doc = "Which requests of the route are guarded and what one resource is: a request whose whole "
                      "normalised path matches (`/v1/accounts/{id}/address`, `{name}` one non-empty segment) is "
                      "guarded, and its path is the resource. Other requests of the route are not guarded.",
               .example = "/v1/accounts/{id}/address"),
    FIELD_BASE("sequence", fn_ord_sequence, true, .what = "string",
               .allowed = "`header:NAME` or `json:/pointer` (an RFC 6901 JSON Pointer into the body)",
               .doc = "Where the request's sequence is: a decimal integer 1 to 2^63-1 (no sign, no leading zero) "
                      "in one header, or a JSON integer at the pointer of a JSON body. Missing or malformed: 400 "
                      "`sequence-invalid`.",
               .example = "json:/version"),
    FIELD_ENUM("on_gap", struct conf_ordering, on_gap, gap_modes, .def = "accept",
               .doc = "A sequence above the applied one + 1: `accept` forwards it; `reject` answers 409 "
                      "`sequence-gap`; `hold` waits up to `hold` for the missing ones, then forwards or answers "
                      "409 `sequence-gap`.",
               .example = "hold"),
    FIELD("hold", F_DUR, struct conf_ordering, hold_ms, 1, DURATION_MAX, .def = "2s",
          .doc = "How long a request waits for another request of its resource still in flight (then 409 "
                 "`sequence-in-use`), and for missing sequences with `on_gap: hold`.",
          .example = "5s"),
};
_Static_assert(sizeof(enum conf_on_gap) == sizeof(int), "enum stored through int");

static bool fn_ordering(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_ordering *o = target;
    o->enabled = true;
    o->on_gap = CONF_GAP_ACCEPT;
    o->hold_ms = 2 * SEC;
    return parse_map(x, n, ordering_fields, NFIELDS(ordering_fields), o);
}

static void ordering_free(struct conf_ordering *o)
{
    free(o->resource);
    free(o->seq_name);
}

static const struct field route_fields[] = {
    FIELD_FN("name", struct conf_route, name, fn_route_name, true, .what = "string",
             .allowed = "1 to 128 of `A-Z a-z 0-9 _ . -`, unique",
             .doc = "The route's name: in metrics, logs, the admin key API, and part of every key's identity "
                    "(renaming a route starts an empty key space).",
             .example = "payments"),
    FIELD_BASE("match", fn_match, true, .what = "mapping", SUB(match_fields, 0),
               .doc = "Which requests the route takes. Routes are tried in order; the first match wins."),
    FIELD_FN("upstream", struct conf_route, upstream, fn_route_upstream, false, .what = "upstream name",
             .allowed = "a name from `upstreams`",
             .doc = "Where the route's requests go. Required unless `default_upstream` is set (then that one).",
             .example = "api"),
    FIELD_FN("idempotency", struct conf_route, idem, fn_idem, false, .what = "mapping",
             SUB(idem_fields, offsetof(struct conf_route, idem)),
             .doc = "How keys are handled on the route. Without this block every key below has its default "
                    "(`key: optional`: a request with a key is deduplicated)."),
    FIELD_FN("errors", struct conf_route, errors, fn_errors, false, .what = "problem, stripe or mapping",
             .def = "problem", .show = show_errors, SUB(errors_fields, offsetof(struct conf_route, errors)),
             .allowed = "`problem`, `stripe`, or `{template: '...', content_type: ...}`",
             .doc = "How the gateway's own error answers on the route are written (upstream answers are never "
                    "touched): `problem` is RFC 9457 `application/problem+json`; `stripe` is "
                    "`{\"error\":{\"type\":...,\"code\":NAME,\"message\":...}}`, which Stripe's SDKs raise "
                    "as an error; a mapping gives your own template. See http.md.",
             .example = "stripe"),
    FIELD_FN("ordering", struct conf_route, ordering, fn_ordering, false, .what = "mapping",
             SUB(ordering_fields, offsetof(struct conf_route, ordering)),
             .doc = "The ordering guard: a per-resource increasing sequence kept in Postgres, so that an older "
                    "write never overwrites a newer one (409 `stale-sequence`). Without it the route is not "
                    "guarded."),
};

static bool fn_routes(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf *c = target;
    if (!expect_type(x, n, YAML_SEQUENCE_NODE))
        return false;
    size_t cnt = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    c->routes = cnt ? cm_calloc(cnt, sizeof(*c->routes)) : NULL;
    for (size_t i = 0; i < cnt; i++) {
        yaml_node_t *item = yaml_document_get_node(x->doc, n->data.sequence.items.start[i]);
        struct conf_route *r = &c->routes[i];
        r->methods = CONF_M_POST | CONF_M_PATCH;
        idem_defaults(&r->idem);
        c->routes_n = i + 1; /* the names parsed so far are checked for duplicates; this one is still NULL */
        size_t old = path_push(x, "[%zu]", i);
        x->key_line = 0;
        size_t refs_before = x->refs_n;
        if (item == NULL || !parse_map(x, item, route_fields, NFIELDS(route_fields), r))
            return false;
        if (x->refs_n == refs_before) {
            path_push(x, ".upstream");
            add_ref(x, 0, node_line(item), &r->upstream, NULL);
        }
        path_pop(x, old);
    }
    return true;
}

/* ---- top level */

/* Line of the first key named key in the mapping map (the top level, "store", "jwt"), or 0. */
static size_t find_line(struct ctx *x, yaml_node_t *map, const char *key, yaml_node_t **value)
{
    if (map == NULL || map->type != YAML_MAPPING_NODE)
        return 0;
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(x->doc, p->key);
        if (k && k->type == YAML_SCALAR_NODE && strcmp((const char *)k->data.scalar.value, key) == 0) {
            if (value)
                *value = yaml_document_get_node(x->doc, p->value);
            return node_line(k);
        }
    }
    return 0;
}

/* ---- jwt: keys, secret_env, issuer, audience, leeway */

static bool fn_jwt_string(struct ctx *x, yaml_node_t *n, void *target, const char *what)
{
    char **out = target;
    const char *s = scalar(x, n, what);
    if (s == NULL)
        return false;
    if (strlen(s) > 1024 || !cm_field_value_ok(s, strlen(s)))
        return fail(x, n, "must be at most 1024 bytes without control characters");
    free(*out);
    *out = cm_strdup(s);
    return true;
}

static bool fn_jwt_keys(struct ctx *x, yaml_node_t *n, void *target)
{
    return fn_jwt_string(x, n, target, "a JWKS file path");
}

static bool fn_jwt_issuer(struct ctx *x, yaml_node_t *n, void *target)
{
    return fn_jwt_string(x, n, target, "an issuer (the iss claim)");
}

static bool fn_jwt_audience(struct ctx *x, yaml_node_t *n, void *target)
{
    return fn_jwt_string(x, n, target, "an audience (a value of the aud claim)");
}

static bool fn_jwt_secret_env(struct ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = scalar(x, n, "an environment variable name");
    if (s == NULL)
        return false;
    bool ok = (*s >= 'A' && *s <= 'Z') || (*s >= 'a' && *s <= 'z') || *s == '_';
    for (const char *p = s; ok && *p; p++)
        ok = (*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '_';
    char b[80];
    if (!ok || strlen(s) > 128)
        return fail(x, n, "invalid environment variable name '%s' (A-Z a-z 0-9 _, not starting with a digit)",
                    shown(b, s));
    free(*out);
    *out = cm_strdup(s);
    return true;
}

static const struct field jwt_fields[] = {
    FIELD_FN("keys", struct conf_jwt, keys_file, fn_jwt_keys, false, .what = "file path",
             .allowed = "a JWKS file with RS256 (RSA, 2048 bits or more) and ES256 (P-256) keys",
             .doc = "The public keys tokens are verified with. Loaded at start, by `--check` and on reload; a "
                    "key that does not load is a config error. Give `keys`, `secret_env` or both.",
             .example = "/etc/idemgate/jwks.json"),
    FIELD_FN("secret_env", struct conf_jwt, secret_env, fn_jwt_secret_env, false, .what = "environment variable name",
             .allowed = "`A-Z a-z 0-9 _`, not starting "
                        "with a digit",
             .doc = "The environment variable holding an HS256 secret (at least 32 bytes).",
             .example = "IDEMGATE_JWT_SECRET"),
    FIELD_FN("issuer", struct conf_jwt, issuer, fn_jwt_issuer, false, .what = "string",
             .doc = "When set, a token's `iss` must equal it.", .example = "https://auth.example.com"),
    FIELD_FN("audience", struct conf_jwt, audience, fn_jwt_audience, false, .what = "string",
             .doc = "When set, a token's `aud` (a string or an array) must name it.", .example = "payments"),
    FIELD("leeway", F_DUR, struct conf_jwt, leeway_ms, 0, 3600 * SEC, .def = "30s",
          .doc = "Clock difference allowed when `exp` and `nbf` are checked.", .example = "1m"),
};

static bool fn_jwt(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf_jwt *j = target;
    size_t line = x->key_line ? x->key_line : node_line(n);
    if (!parse_map(x, n, jwt_fields, NFIELDS(jwt_fields), j))
        return false;
    if (!j->keys_file && !j->secret_env)
        return fail_line(x, line, "needs keys (a JWKS file) or secret_env (an HS256 secret), or both");
    /* the keys load later (gateway/jwt.c): their errors name these lines */
    j->file = x->c->file;
    j->keys_line = find_line(x, n, "keys", NULL);
    j->secret_env_line = find_line(x, n, "secret_env", NULL);
    j->enabled = true;
    return true;
}

static const struct field replay_cache_fields[] = {
    FIELD("max_bytes", F_SIZE, struct conf, replay_cache_max_bytes, 0, GIB, .def = "2MiB", .restart = true,
          .doc = "Bytes of answers kept in memory at most (an answer over an eighth of it is not cached). 0 "
                 "disables the cache.",
          .example = "16MiB"),
    FIELD("max_entries", F_U32, struct conf, replay_cache_max_entries, 0, 10000000, .def = "4096", .restart = true,
          .doc = "Answers kept in memory at most. 0 disables the cache.", .example = "100000"),
};

static const struct field limits_fields[] = {
    FIELD("buffers", F_SIZE, struct conf, limits_buffers, 1, 1024 * GIB, .def = "512MiB", .restart = true,
          .example = "2GiB",
          .doc = "Bytes of request bodies and answers the process holds in memory at once (counted while a body "
                 "is read and an answer is read, stored or written). A request that would pass it is answered 503 "
                 "`overloaded` with `Retry-After` before anything is claimed or forwarded "
                 "(`idemgate_shed_total{reason=\"buffers\"}`); an answer that arrives while it is full is 502 "
                 "`upstream-response-too-large`. At least the largest `max_body` plus `max_response` of a route "
                 "(or of the top level)."),
};

static bool fn_limits(struct ctx *x, yaml_node_t *n, void *target)
{
    if (n->type != YAML_MAPPING_NODE)
        return fail(x, n, "must be a mapping {buffers: SIZE}");
    return parse_map(x, n, limits_fields, NFIELDS(limits_fields), target);
}

/* replay_cache: {max_bytes: 2MiB, max_entries: 4096} or replay_cache: off */
static bool fn_replay_cache(struct ctx *x, yaml_node_t *n, void *target)
{
    struct conf *c = target;
    if (n->type == YAML_SCALAR_NODE && strcmp((const char *)n->data.scalar.value, "off") == 0) {
        c->replay_cache_max_bytes = 0;
        c->replay_cache_max_entries = 0;
        return true;
    }
    if (n->type != YAML_MAPPING_NODE)
        return fail(x, n, "must be a mapping {max_bytes: SIZE, max_entries: N} or off");
    return parse_map(x, n, replay_cache_fields, NFIELDS(replay_cache_fields), c);
}

static const struct field top_fields[] = {
    FIELD_FN("listen", struct conf, listen, fn_listen, false, .what = "host:port", .def = "127.0.0.1:8080",
             .show = show_addr, .restart = true,
             .allowed = "`host:port` or `[v6]:port`; port 0 picks a free port (logged as `event=listening`)",
             .doc = "Where clients connect. An IPv6 address takes IPv6 clients only. The host is resolved when "
                    "the file is checked, so an address that can never work is a config error.",
             .example = "0.0.0.0:8080"),
    FIELD_BASE("admin", fn_admin, false, .what = "mapping", SUB(admin_fields, 0),
               .doc = "The admin listener (see operations.md)."),
    FIELD("shutdown_grace", F_DUR, struct conf, shutdown_grace_ms, 0, DURATION_MAX, .def = "10s",
          .doc = "On SIGTERM or SIGINT, how long requests in flight may take to finish. Past it their clients "
                 "get 503 `shutting-down` and their records stay in flight, then unknown.",
          .example = "30s"),
    FIELD_BASE("store", fn_store, false, .what = "mapping", SUB(store_fields, 0),
               .doc = "Postgres (the authority) and Redis (the optional fast filter)."),
    FIELD_BASE("upstreams", fn_upstreams, true, .what = "list of mappings",
               SUB_LIST(upstream_fields, offsetof(struct conf, upstreams)),
               .doc = "The APIs behind the gateway, at least one."),
    FIELD_BASE("routes", fn_routes, false, .what = "list of mappings",
               SUB_LIST(route_fields, offsetof(struct conf, routes)),
               .doc = "Which requests get idempotency, and how. Tried in order; the first match wins."),
    FIELD_BASE("default_upstream", fn_default_upstream, false, .what = "upstream name",
               .allowed = "a name from `upstreams`",
               .doc = "Where requests no route matches go, proxied plainly (no key checked). Unset: they get 404 "
                      "`route-not-found`. Routes without an `upstream` use it.",
               .example = "api"),
    FIELD("max_header_bytes", F_SIZE, struct conf, max_header_bytes, 1, MIB, .def = "16KiB", .restart = true,
          .doc = "The largest request head; beyond it 431 (a longer request target: 414).", .example = "32KiB"),
    FIELD("max_response_header_bytes", F_SIZE, struct conf, max_response_header_bytes, 1, MIB, .def = "16KiB",
          .restart = true,
          .doc = "The largest upstream answer head (status line and headers); beyond it the answer is invalid: "
                 "502 `upstream-invalid-response`, nothing stored.",
          .example = "32KiB"),
    FIELD("max_body", F_SIZE, struct conf, max_body, 1, SIZE_MAX_BODY, .def = "1MiB",
          .doc = "The largest request body of requests no route matches (routes have their own "
                 "`idempotency.max_body`); beyond it 413.",
          .example = "4MiB"),
    FIELD("max_response", F_SIZE, struct conf, max_response, 1, SIZE_MAX_BODY, .def = "8MiB",
          .doc = "The largest upstream answer relayed for requests outside idempotency; beyond it 502.",
          .example = "16MiB"),
    FIELD("max_connections", F_U32, struct conf, max_connections, 1, 100000, .def = "4096", .restart = true,
          .doc = "Client connections at most; beyond it 503 `too-many-connections` and the connection is closed. "
                 "The admin listener takes as many.",
          .example = "10000"),
    FIELD("client_timeout", F_DUR, struct conf, client_timeout_ms, 1, DURATION_MAX, .def = "30s", .restart = true,
          .doc = "An idle client connection, one sending its request slower than this, or one whose answer takes "
                 "longer than this to be written (a client that stops reading) is cut; on the admin listener too.",
          .example = "10s"),
    FIELD("threads", F_U32, struct conf, threads, 0, 64, .def = "0", .restart = true,
          .doc = "I/O loop threads, each with its own HTTP front, upstream client, Redis connection and share of "
                 "`store.pool`. 0: one per CPU (at most `store.pool`).",
          .example = "4"),
    FIELD_FN("jwt", struct conf, jwt, fn_jwt, false, .what = "mapping", SUB(jwt_fields, offsetof(struct conf, jwt)),
             .doc = "How bearer tokens are verified for `jwt:CLAIM` scope parts. Needed only when a route uses "
                    "one. A request on such a route without a valid token is 401 `invalid-credentials`."),
    FIELD_BASE("limits", fn_limits, false, .what = "mapping", SUB(limits_fields, 0),
               .doc = "Bounds on what the whole process holds."),
    FIELD_BASE("replay_cache", fn_replay_cache, false, .what = "mapping or off", SUB(replay_cache_fields, 0),
               .restart = true, .allowed = "`{max_bytes: SIZE, max_entries: N}` or `off`",
               .doc = "Completed answers kept in this process's memory and replayed without a store round trip. "
                      "Used only while its Postgres listener (purges reach every instance through it) is "
                      "connected. `off` disables it.",
               .example = "off"),
};

/* ---------------------------------------------------------------- the reference (idemgate --print-reference) */

static void key_doc(const struct field *f, const char *path, unsigned depth, struct conf_key_doc *k)
{
    static const char *const types[] = {
        [F_BOOL] = "boolean", [F_U32] = "integer", [F_DUR] = "duration", [F_SIZE] = "size", [F_ENUM] = "one of"};
    memset(k, 0, sizeof *k);
    k->path = path;
    k->key = f->key;
    k->depth = depth;
    k->type = f->type == F_FUNC ? f->what : types[f->type];
    k->def = f->def;
    k->doc = f->doc;
    k->example = f->example;
    k->required = f->required || f->needed;
    k->restart = f->restart;
    k->block = f->sub != NULL;
    char lo[32], hi[32];
    size_t l = 0;
    switch (f->type) {
    case F_BOOL:
        snprintf(k->allowed, sizeof k->allowed, "`true`, `false`");
        break;
    case F_U32:
        snprintf(k->allowed, sizeof k->allowed, "%s to %s", fmt_int(lo, f->min), fmt_int(hi, f->max));
        break;
    case F_DUR:
        snprintf(k->allowed, sizeof k->allowed, "%s to %s", fmt_dur(lo, f->min), fmt_dur(hi, f->max));
        break;
    case F_SIZE:
        snprintf(k->allowed, sizeof k->allowed, "%s to %s", fmt_size(lo, f->min), fmt_size(hi, f->max));
        break;
    case F_ENUM:
        for (size_t i = 0; f->names[i] != NULL && l < sizeof k->allowed; i++) {
            int w = snprintf(k->allowed + l, sizeof k->allowed - l, "%s`%s`", i ? ", " : "", f->names[i]);
            if (w < 0)
                break;
            l += (size_t)w;
        }
        break;
    case F_FUNC:
        snprintf(k->allowed, sizeof k->allowed, "%s", f->allowed ? f->allowed : "");
        break;
    }
}

static void walk(const struct field *fields, size_t n, const char *prefix, unsigned depth, conf_key_fn fn, void *arg)
{
    for (size_t i = 0; i < n; i++) {
        const struct field *f = &fields[i];
        char path[PATH_BUF];
        snprintf(path, sizeof path, "%s%s", prefix, f->key);
        struct conf_key_doc k;
        key_doc(f, path, depth, &k);
        k.list = f->sub_list;
        fn(&k, arg);
        if (f->sub != NULL) {
            char sub[PATH_BUF + 4];
            snprintf(sub, sizeof sub, "%s%s", path, f->sub_list ? "[]." : ".");
            walk(f->sub, f->nsub, sub, depth + 1, fn, arg);
        }
    }
}

void conf_reference_walk(conf_key_fn fn, void *arg)
{
    walk(top_fields, NFIELDS(top_fields), "", 0, fn, arg);
}

bool conf_key_value(const struct conf *c, const char *path, char *buf, size_t n)
{
    const struct field *fields = top_fields;
    size_t nf = NFIELDS(top_fields);
    const void *base = c;
    buf[0] = '\0';
    for (const char *p = path; fields != NULL;) {
        size_t len = strcspn(p, ".[");
        size_t i = 0;
        while (i < nf && !(strlen(fields[i].key) == len && strncmp(fields[i].key, p, len) == 0))
            i++;
        if (i == nf)
            return false;
        const struct field *f = &fields[i];
        p += len;
        if (*p == '\0') {
            char a[32];
            const void *v = at(base, f);
            switch (f->type) {
            case F_BOOL:
                snprintf(buf, n, "%s", *(const bool *)v ? "true" : "false");
                return true;
            case F_U32:
                snprintf(buf, n, "%s", fmt_int(a, *(const uint32_t *)v));
                return true;
            case F_DUR:
                snprintf(buf, n, "%s", fmt_dur(a, *(const uint64_t *)v));
                return true;
            case F_SIZE:
                snprintf(buf, n, "%s", fmt_size(a, *(const uint64_t *)v));
                return true;
            case F_ENUM:
                snprintf(buf, n, "%s", f->names[*(const int *)v]);
                return true;
            case F_FUNC:
                return f->show != NULL && f->show(base, f, buf, n);
            }
            return false;
        }
        if (f->sub == NULL)
            return false;
        base = (const char *)base + f->sub_off;
        if (f->sub_list) {
            base = *(const void *const *)base; /* the first element */
            if (base == NULL || strncmp(p, "[]", 2) != 0)
                return false;
            p += 2;
        }
        if (*p != '.')
            return false;
        p++;
        fields = f->sub;
        nf = f->nsub;
    }
    return false;
}

static void conf_defaults(struct conf *c)
{
    c->listen.host = cm_strdup("127.0.0.1");
    c->listen.port = 8080;
    c->admin_listen.host = cm_strdup("127.0.0.1");
    c->admin_listen.port = 9090;
    c->admin_enabled = true;
    c->shutdown_grace_ms = 10 * SEC;
    c->pool = 8;
    c->redis_timeout_ms = 50;
    c->max_header_bytes = 16 * KIB;
    c->max_response_header_bytes = 16 * KIB;
    c->jwt.leeway_ms = 30 * SEC;
    c->max_body = MIB;
    c->max_response = 8 * MIB;
    c->max_connections = 4096;
    c->client_timeout_ms = 30 * SEC;
    c->threads = 0;
    c->replay_cache_max_bytes = 2 * MIB;
    c->replay_cache_max_entries = 4096;
    c->limits_buffers = 512 * MIB;
}

static bool apply_env(struct ctx *x, yaml_node_t *root)
{
    struct conf *c = x->c;
    const char *pg = getenv("IDEMGATE_POSTGRES_URL");
    if (pg != NULL && pg[0] != '\0') {
        if (strncmp(pg, "postgres://", 11) != 0 && strncmp(pg, "postgresql://", 13) != 0 && strchr(pg, '=') == NULL) {
            x->err = cm_asprintf("%s: IDEMGATE_POSTGRES_URL (environment): must start with postgres:// or "
                                 "postgresql:// (or be a key=value connection string)",
                                 x->file);
            return false;
        }
        free(c->postgres_url);
        c->postgres_url = cm_strdup(pg);
    }
    const char *rd = getenv("IDEMGATE_REDIS_URL");
    if (rd != NULL) {
        const char *why = set_redis(c, rd);
        if (why != NULL) {
            x->err = cm_asprintf("%s: IDEMGATE_REDIS_URL (environment): %s", x->file, why);
            return false;
        }
    }
    const char *dist = getenv("IDEMGATE_STORE_DISTRIBUTED");
    if (dist != NULL && dist[0] != '\0') {
        size_t i = 0;
        while (distributed_modes[i] != NULL && strcmp(distributed_modes[i], dist) != 0)
            i++;
        if (distributed_modes[i] == NULL) {
            x->err = cm_asprintf("%s: IDEMGATE_STORE_DISTRIBUTED (environment): must be none or citus", x->file);
            return false;
        }
        c->distributed = (enum conf_distributed)i;
    }
    const char *tok = getenv("IDEMGATE_ADMIN_TOKEN");
    free(c->admin_token);
    c->admin_token = (tok != NULL && tok[0] != '\0') ? cm_strdup(tok) : NULL;

    if (c->postgres_url == NULL) {
        yaml_node_t *store = NULL;
        size_t line = find_line(x, root, "store", &store);
        if (line == 0)
            line = node_line(root);
        path_pop(x, 0);
        path_push(x, "store.postgres");
        return fail_line(x, line, "missing required key (set it here or in IDEMGATE_POSTGRES_URL)");
    }
    return true;
}

static bool check_addresses(struct ctx *x, yaml_node_t *root)
{
    struct conf *c = x->c;
    if (c->admin_enabled && c->listen.port != 0 && c->listen.port == c->admin_listen.port &&
        strcmp(c->listen.host, c->admin_listen.host) == 0) {
        yaml_node_t *admin = NULL;
        size_t line = find_line(x, root, "admin", &admin);
        size_t l2 = find_line(x, admin, "listen", NULL);
        path_pop(x, 0);
        path_push(x, "admin.listen");
        return fail_line(x, l2 ? l2 : (line ? line : node_line(root)), "same address as listen (%s:%u)", c->listen.host,
                         c->listen.port);
    }
    return true;
}

/* SPEC 7: limits.buffers holds at least one request of the largest kind, its body and the answer it may store. */
static bool check_buffers(struct ctx *x, yaml_node_t *root)
{
    const struct conf *c = x->c;
    uint64_t need = c->max_body + c->max_response;
    const char *what = "the top level";
    for (size_t i = 0; i < c->routes_n; i++) {
        const struct conf_idem *im = &c->routes[i].idem;
        if (im->max_body + im->max_response > need) {
            need = im->max_body + im->max_response;
            what = c->routes[i].name ? c->routes[i].name : "a route";
        }
    }
    if (c->limits_buffers >= need)
        return true;
    yaml_node_t *limits = NULL, *buffers = NULL, *routes = NULL;
    size_t line = find_line(x, root, "limits", &limits);
    size_t bline = find_line(x, limits, "buffers", &buffers);
    if (!line) { /* the default is too small: point at what made it so */
        size_t rl = find_line(x, root, "routes", &routes), mr = find_line(x, root, "max_response", NULL);
        line = mr ? mr : find_line(x, root, "max_body", NULL);
        for (size_t i = 0; i < c->routes_n && routes && routes->type == YAML_SEQUENCE_NODE; i++)
            if (c->routes[i].name && strcmp(c->routes[i].name, what) == 0 &&
                routes->data.sequence.items.start + i < routes->data.sequence.items.top)
                line = node_line(yaml_document_get_node(x->doc, routes->data.sequence.items.start[i]));
        line = line ? line : rl;
    }
    snprintf(x->path, sizeof x->path, "limits.buffers");
    x->plen = strlen(x->path);
    return fail_line(x,
                     bline  ? bline
                     : line ? line
                            : node_line(root),
                     "%" PRIu64 " bytes is less than max_body plus max_response of %s (%" PRIu64
                     " bytes): one such request could never be served",
                     c->limits_buffers, what, need);
}

/* ---- routes that meet only under SPEC 7's spelling rule */

static bool parts_same(const struct conf_part *a, size_t an, const struct conf_part *b, size_t bn)
{
    if (an != bn)
        return false;
    for (size_t i = 0; i < an; i++)
        if (a[i].kind != b[i].kind || (a[i].header == NULL) != (b[i].header == NULL) ||
            (a[i].header && strcasecmp(a[i].header, b[i].header) != 0))
            return false;
    return true;
}

static bool str_same(const char *a, const char *b)
{
    return a == b || (a && b && strcmp(a, b) == 0);
}

/* What a request gets on a route, apart from its name and path: where it goes and the rules that apply. */
static bool route_policy_same(const struct conf_route *a, const struct conf_route *b)
{
    const struct conf_idem *x = &a->idem, *y = &b->idem;
    const struct conf_ordering *o = &a->ordering, *p = &b->ordering;
    return a->upstream == b->upstream && a->methods == b->methods && x->key == y->key && x->mode == y->mode &&
           (x->header == y->header || (x->header && y->header && strcasecmp(x->header, y->header) == 0)) &&
           parts_same(x->scope, x->scope_n, y->scope, y->scope_n) &&
           parts_same(x->fingerprint, x->fingerprint_n, y->fingerprint, y->fingerprint_n) &&
           x->retention_ms == y->retention_ms && x->lease_ms == y->lease_ms && x->on_in_flight == y->on_in_flight &&
           x->wait_ms == y->wait_ms && x->on_unknown == y->on_unknown && x->max_body == y->max_body &&
           x->forward_key == y->forward_key && x->max_response == y->max_response &&
           str_same(x->forward_token, y->forward_token) && x->advertise_expiry == y->advertise_expiry &&
           x->prefer_wait_max_ms == y->prefer_wait_max_ms && x->release_statuses_n == y->release_statuses_n &&
           (x->release_statuses_n == 0 ||
            memcmp(x->release_statuses, y->release_statuses, x->release_statuses_n * sizeof(int)) == 0) &&
           x->probe.enabled == y->probe.enabled && str_same(x->probe.path, y->probe.path) &&
           str_same(x->probe.method, y->probe.method) && a->errors.kind == b->errors.kind &&
           str_same(a->errors.tmpl, b->errors.tmpl) && o->enabled == p->enabled && str_same(o->resource, p->resource) &&
           o->source == p->source && str_same(o->seq_name, p->seq_name) && o->on_gap == p->on_gap &&
           o->hold_ms == p->hold_ms;
}

/* Route a meets route b's path as written, by the byte-exact rule routes had before SPEC 7's spelling rule. */
static bool route_meets_literally(const struct conf_route *a, const struct conf_route *b)
{
    const char *bp = b->path ? b->path : b->path_prefix;
    if (a->path)
        return strcmp(a->path, bp) == 0;
    size_t n = strlen(a->path_prefix);
    return strcmp(a->path_prefix, "/") == 0 || (strncmp(bp, a->path_prefix, n) == 0 && (bp[n] == '\0' || bp[n] == '/'));
}

/* SPEC 7: two routes that meet only because case, segment parameters or a format suffix do not count (a request
 * path would match both) must have the same policy, else the first one in the list would decide by spelling
 * alone. Routes that nest as written ("/v1" before "/v1/payments") are the usual most-specific-first list. */
static bool check_route_spellings(struct ctx *x, yaml_node_t *root)
{
    const struct conf *c = x->c;
    yaml_node_t *routes = NULL;
    find_line(x, root, "routes", &routes);
    for (size_t j = 0; j < c->routes_n; j++) {
        const struct conf_route *b = &c->routes[j];
        for (size_t i = 0; i < j; i++) {
            const struct conf_route *a = &c->routes[i];
            if (!a->match_key || !b->match_key)
                continue;
            bool meet = cm_path_meets(a->match_key, b->match_key, a->path == NULL) ||
                        cm_path_meets(b->match_key, a->match_key, b->path == NULL);
            bool literal = route_meets_literally(a, b) || route_meets_literally(b, a);
            if (!meet || literal || route_policy_same(a, b))
                continue;
            size_t line = 0;
            if (routes && routes->type == YAML_SEQUENCE_NODE &&
                routes->data.sequence.items.start + j < routes->data.sequence.items.top)
                line = node_line(yaml_document_get_node(x->doc, routes->data.sequence.items.start[j]));
            snprintf(x->path, sizeof x->path, "routes[%zu].match", j);
            x->plen = strlen(x->path);
            return fail_line(x, line ? line : node_line(root),
                             "route '%s' and route '%s' meet when case, ';' parameters and a format suffix (.json) "
                             "are ignored, as requests are routed, but their policies differ: give them the same "
                             "policy or paths that do not meet",
                             b->name ? b->name : "?", a->name ? a->name : "?");
        }
    }
    return true;
}

static char *syntax_error(const char *name, const yaml_parser_t *p, const char *yaml, size_t len)
{
    size_t line;
    if (p->error == YAML_READER_ERROR) {
        line = 1;
        for (size_t i = 0; i < p->problem_offset && i < len; i++)
            if (yaml[i] == '\n')
                line++;
        return cm_asprintf("%s:%zu: YAML syntax error: %s", name, line, p->problem ? p->problem : "unreadable input");
    }
    if (p->error == YAML_MEMORY_ERROR)
        return cm_asprintf("%s:1: YAML syntax error: out of memory", name);
    line = p->problem_mark.line + 1;
    if (p->context != NULL)
        return cm_asprintf("%s:%zu: YAML syntax error: %s (%s at line %zu)", name, line,
                           p->problem ? p->problem : "invalid YAML", p->context, p->context_mark.line + 1);
    return cm_asprintf("%s:%zu: YAML syntax error: %s", name, line, p->problem ? p->problem : "invalid YAML");
}

struct conf *conf_load_string(const char *name, const char *yaml, size_t len, char **err)
{
    yaml_parser_t parser;
    yaml_document_t doc, extra;
    bool have_doc = false;
    struct ctx x = {.file = name};
    struct conf *c = cm_calloc(1, sizeof(*c));
    *err = NULL;
    c->file = cm_strdup(name);
    conf_defaults(c);
    x.c = c;
    x.doc = &doc;

    if (!yaml_parser_initialize(&parser)) {
        x.err = cm_asprintf("%s:1: YAML syntax error: cannot initialise the parser", name);
        goto fail_noparser;
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)yaml, len);
    if (!yaml_parser_load(&parser, &doc)) {
        x.err = syntax_error(name, &parser, yaml, len);
        goto fail;
    }
    have_doc = true;
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (root == NULL) {
        x.err = cm_asprintf("%s:1: (root): the configuration is empty", name);
        goto fail;
    }
    if (!yaml_parser_load(&parser, &extra)) {
        x.err = syntax_error(name, &parser, yaml, len);
        goto fail;
    }
    bool second = yaml_document_get_root_node(&extra) != NULL;
    size_t second_line = extra.start_mark.line + 1;
    yaml_document_delete(&extra);
    if (second) {
        x.err = cm_asprintf("%s:%zu: (root): only one YAML document is allowed", name, second_line);
        goto fail;
    }

    if (!parse_map(&x, root, top_fields, NFIELDS(top_fields), c))
        goto fail;
    if (!resolve_refs(&x))
        goto fail;
    if (x.jwt_part_line && !c->jwt.enabled) {
        snprintf(x.path, sizeof x.path, "%s", x.jwt_part_path);
        x.plen = strlen(x.path);
        fail_line(&x, x.jwt_part_line, "a jwt:CLAIM scope needs a top-level jwt: block (keys or secret_env)");
        goto fail;
    }
    if (!check_addresses(&x, root) || !check_route_spellings(&x, root) || !check_buffers(&x, root))
        goto fail;
    if (!apply_env(&x, root))
        goto fail;

    yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
    free(x.refs);
    return c;

fail:
    if (have_doc)
        yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
fail_noparser:
    free(x.refs);
    conf_destroy(c);
    *err = x.err ? x.err : cm_asprintf("%s:1: (root): invalid configuration", name);
    return NULL;
}

struct conf *conf_load(const char *file, char **err)
{
    FILE *f = fopen(file, "rb");
    if (f == NULL) {
        *err = cm_asprintf("%s: cannot open: %s", file, strerror(errno));
        return NULL;
    }
    struct cm_buf b;
    cm_buf_init(&b, CONF_FILE_MAX);
    char chunk[8192];
    size_t n;
    while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0) {
        if (!cm_buf_append(&b, chunk, n)) {
            fclose(f);
            cm_buf_free(&b);
            *err = cm_asprintf("%s: file is larger than %d MiB", file, (int)(CONF_FILE_MAX / MIB));
            return NULL;
        }
    }
    if (ferror(f)) {
        int e = errno;
        fclose(f);
        cm_buf_free(&b);
        *err = cm_asprintf("%s: cannot read: %s", file, strerror(e));
        return NULL;
    }
    fclose(f);
    struct conf *c = conf_load_string(file, b.data ? b.data : "", b.len, err);
    cm_buf_free(&b);
    return c;
}
