/* fields.c - the typed-field YAML machinery of conf/: a mapping walked against a table of fields, the scalar
 * parsers (durations, sizes, integers, booleans, enums, host:port), errors with their line and key path, and
 * values as the reference writes them. Knows no section: never names a key of the configuration. */
#include "conf/internal.h"

#include <ctype.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/uri.h"

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
    } units[] = {{"ms", 1}, {"s", CONF_SEC}, {"m", CONF_MIN}, {"h", CONF_HOUR}, {"d", CONF_DAY}};
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
            if (v > CONF_DURATION_MAX / units[i].mult)
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
    } units[] = {{"", 1}, {"B", 1}, {"KiB", CONF_KIB}, {"MiB", CONF_MIB}, {"GiB", CONF_GIB}};
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

size_t conf_i_node_line(const yaml_node_t *n)
{
    return n->start_mark.line + 1;
}

size_t conf_i_path_push(struct conf_i_ctx *x, const char *fmt, ...)
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

size_t conf_i_path_push_key(struct conf_i_ctx *x, const char *key)
{
    return x->plen == 0 ? conf_i_path_push(x, "%s", key) : conf_i_path_push(x, ".%s", key);
}

void conf_i_path_pop(struct conf_i_ctx *x, size_t old)
{
    x->plen = old;
    x->path[old] = '\0';
}

/* Records the first error: "FILE:LINE: PATH: message". Returns false. */
bool conf_i_fail_line(struct conf_i_ctx *x, size_t line, const char *fmt, ...)
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

/* Copies a user value for an error message: passwords of URLs redacted, at
 * most 64 bytes, control bytes and quotes replaced, so a message stays one
 * readable line that is safe to log. */
const char *conf_i_shown(char out[80], const char *value)
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

bool conf_i_is_null(const yaml_node_t *n)
{
    if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return false;
    const char *v = (const char *)n->data.scalar.value;
    return v[0] == '\0' || strcmp(v, "~") == 0 || strcmp(v, "null") == 0 || strcmp(v, "Null") == 0 ||
           strcmp(v, "NULL") == 0;
}

/* The text of a scalar node, or NULL (error recorded) for a mapping, a list,
 * a null or a string holding a NUL byte. what: "a duration", ... */
const char *conf_i_scalar(struct conf_i_ctx *x, const yaml_node_t *n, const char *what)
{
    if (n->type != YAML_SCALAR_NODE) {
        conf_i_fail(x, n, "expected %s, got %s", what, node_kind(n));
        return NULL;
    }
    if (conf_i_is_null(n)) {
        conf_i_fail(x, n, "missing value (expected %s)", what);
        return NULL;
    }
    const char *v = (const char *)n->data.scalar.value;
    if (strlen(v) != n->data.scalar.length) {
        conf_i_fail(x, n, "contains a NUL byte");
        return NULL;
    }
    return v;
}

bool conf_i_expect_type(struct conf_i_ctx *x, const yaml_node_t *n, yaml_node_type_t t)
{
    if (n->type == t)
        return true;
    if (n->type == YAML_SCALAR_NODE && n->data.scalar.length > 0 && !conf_i_is_null(n)) {
        char b[80];
        return conf_i_fail(x, n, "expected %s, got the scalar '%s'",
                           t == YAML_MAPPING_NODE ? "a mapping" : "a list ([a, b] or '- ' items)",
                           conf_i_shown(b, (const char *)n->data.scalar.value));
    }
    return conf_i_fail(x, n, "expected %s, got %s",
                       t == YAML_MAPPING_NODE ? "a mapping" : "a list ([a, b] or '- ' items)",
                       conf_i_is_null(n) ? "nothing" : node_kind(n));
}

/* ---------------------------------------------------------------- value checks */

bool conf_i_json_pointer_ok(const char *p, size_t len)
{
    if (len > 0 && p[0] != '/')
        return false;
    for (size_t i = 0; i < len; i++)
        if (p[i] == '~' && (i + 1 == len || (p[i + 1] != '0' && p[i + 1] != '1')))
            return false;
    return len <= 1024;
}

bool conf_i_is_token(const char *s)
{
    return cm_token_ok(s, strlen(s));
}

static bool is_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > CONF_NAME_MAX_LEN)
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
bool conf_i_parse_port(const char *s, size_t n, bool allow_zero, uint16_t *port)
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
const char *conf_i_split_hostport(const char *s, size_t n, const char **host, size_t *hostn, const char **port_s,
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

const char *conf_i_fmt_size(char out[32], uint64_t v)
{
    if (v >= CONF_GIB && v % CONF_GIB == 0)
        snprintf(out, 32, "%" PRIu64 "GiB", v / CONF_GIB);
    else if (v >= CONF_MIB && v % CONF_MIB == 0)
        snprintf(out, 32, "%" PRIu64 "MiB", v / CONF_MIB);
    else if (v >= CONF_KIB && v % CONF_KIB == 0)
        snprintf(out, 32, "%" PRIu64 "KiB", v / CONF_KIB);
    else
        snprintf(out, 32, "%" PRIu64 "B", v);
    return out;
}

const char *conf_i_fmt_dur(char out[32], uint64_t v)
{
    if (v >= CONF_DAY && v % CONF_DAY == 0)
        snprintf(out, 32, "%" PRIu64 "d", v / CONF_DAY);
    else if (v >= CONF_HOUR && v % CONF_HOUR == 0)
        snprintf(out, 32, "%" PRIu64 "h", v / CONF_HOUR);
    else if (v >= CONF_MIN && v % CONF_MIN == 0)
        snprintf(out, 32, "%" PRIu64 "m", v / CONF_MIN);
    else if (v >= CONF_SEC && v % CONF_SEC == 0)
        snprintf(out, 32, "%" PRIu64 "s", v / CONF_SEC);
    else
        snprintf(out, 32, "%" PRIu64 "ms", v);
    return out;
}

static bool check_range(struct conf_i_ctx *x, const yaml_node_t *n, uint64_t v, const struct conf_i_field *f,
                        const char *(*fmt)(char[32], uint64_t))
{
    char a[32], b[32];
    if (v < f->min) {
        if (f->min == 1)
            return conf_i_fail(x, n, "must be greater than 0");
        return conf_i_fail(x, n, "must be at least %s (got %s)", fmt(a, f->min), fmt(b, v));
    }
    if (v > f->max)
        return conf_i_fail(x, n, "must be at most %s (got %s)", fmt(a, f->max), fmt(b, v));
    return true;
}

const char *conf_i_fmt_int(char out[32], uint64_t v)
{
    snprintf(out, 32, "%" PRIu64, v);
    return out;
}

bool conf_i_set_u32(struct conf_i_ctx *x, yaml_node_t *n, const struct conf_i_field *f, uint32_t *out)
{
    const char *s = conf_i_scalar(x, n, "an integer");
    if (s == NULL)
        return false;
    char b[80], lo[32], hi[32];
    uint64_t v;
    bool overflow;
    const char *digits = s[0] == '-' ? s + 1 : s;
    size_t nd = parse_digits(digits, &v, &overflow);
    if (!overflow && (nd == 0 || digits[nd] != '\0'))
        return conf_i_fail(x, n, "invalid integer '%s'", conf_i_shown(b, s));
    if (overflow || s[0] == '-' || v < f->min || v > f->max)
        return conf_i_fail(x, n, "must be between %s and %s (got %s)", conf_i_fmt_int(lo, f->min),
                           conf_i_fmt_int(hi, f->max), conf_i_shown(b, s));
    *out = (uint32_t)v;
    return true;
}

static bool set_duration(struct conf_i_ctx *x, yaml_node_t *n, const struct conf_i_field *f, uint64_t *out)
{
    const char *s = conf_i_scalar(x, n, "a duration");
    if (s == NULL)
        return false;
    char b[80], m[32];
    uint64_t v = 0;
    switch (duration_parse(s, &v)) {
    case NUM_OK:
        break;
    case NUM_NO_UNIT:
        return conf_i_fail(x, n, "invalid duration '%s' (a unit is required: ms, s, m, h, d)", conf_i_shown(b, s));
    case NUM_RANGE:
        return conf_i_fail(x, n, "invalid duration '%s' (too large, at most %s)", conf_i_shown(b, s),
                           conf_i_fmt_dur(m, CONF_DURATION_MAX));
    default:
        return conf_i_fail(x, n, "invalid duration '%s' (use ms, s, m, h, d)", conf_i_shown(b, s));
    }
    if (!check_range(x, n, v, f, conf_i_fmt_dur))
        return false;
    *out = v;
    return true;
}

static bool set_size(struct conf_i_ctx *x, yaml_node_t *n, const struct conf_i_field *f, uint64_t *out)
{
    const char *s = conf_i_scalar(x, n, "a size");
    if (s == NULL)
        return false;
    char b[80];
    uint64_t v = 0;
    switch (size_parse(s, &v)) {
    case NUM_OK:
        break;
    case NUM_DECIMAL_UNIT:
        return conf_i_fail(x, n, "invalid size '%s' (sizes are 1024-based: use B, KiB, MiB, GiB)", conf_i_shown(b, s));
    case NUM_RANGE:
        return conf_i_fail(x, n, "invalid size '%s' (too large)", conf_i_shown(b, s));
    default:
        return conf_i_fail(x, n, "invalid size '%s' (use B, KiB, MiB, GiB)", conf_i_shown(b, s));
    }
    if (!check_range(x, n, v, f, conf_i_fmt_size))
        return false;
    *out = v;
    return true;
}

static bool set_bool(struct conf_i_ctx *x, yaml_node_t *n, bool *out)
{
    const char *s = conf_i_scalar(x, n, "true or false");
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
    return conf_i_fail(x, n, "invalid boolean '%s' (use true or false)", conf_i_shown(b, s));
}

static bool set_enum(struct conf_i_ctx *x, yaml_node_t *n, const struct conf_i_field *f, int *out)
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
    const char *s = conf_i_scalar(x, n, what);
    if (s == NULL)
        return false;
    for (int i = 0; f->names[i] != NULL; i++) {
        if (strcmp(s, f->names[i]) == 0) {
            *out = i;
            return true;
        }
    }
    char b[80];
    return conf_i_fail(x, n, "invalid value '%s' (use %s)", conf_i_shown(b, s), want);
}

/* Parses a mapping node against a table of fields; base is the struct the
 * offsets refer to. A missing required key is reported at the line of the key
 * that holds this mapping (x->key_line), or of the mapping itself. */
bool conf_i_parse_map(struct conf_i_ctx *x, yaml_node_t *n, const struct conf_i_field *fields, size_t nfields,
                      void *base)
{
    size_t parent_line = x->key_line ? x->key_line : conf_i_node_line(n);
    uint64_t seen = 0;
    if (!conf_i_expect_type(x, n, YAML_MAPPING_NODE))
        return false;
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(x->doc, p->key);
        yaml_node_t *v = yaml_document_get_node(x->doc, p->value);
        if (k == NULL || v == NULL)
            return conf_i_fail(x, n, "malformed mapping");
        if (k->type != YAML_SCALAR_NODE)
            return conf_i_fail(x, k, "a key must be a plain name, got %s", node_kind(k));
        const char *key = (const char *)k->data.scalar.value;
        size_t i = 0;
        while (i < nfields && strcmp(fields[i].key, key) != 0)
            i++;
        char b[80];
        size_t old = conf_i_path_push_key(x, conf_i_shown(b, key));
        if (i == nfields) {
            char known[256] = "";
            size_t kl = 0;
            for (size_t j = 0; j < nfields; j++) {
                int w = snprintf(known + kl, sizeof(known) - kl, "%s%s", j ? ", " : "", fields[j].key);
                if (w > 0 && (size_t)w < sizeof(known) - kl)
                    kl += (size_t)w;
            }
            return conf_i_fail(x, k, "unknown key (expected one of: %s)", known);
        }
        if (seen & ((uint64_t)1 << i))
            return conf_i_fail(x, k, "duplicate key");
        seen |= (uint64_t)1 << i;
        const struct conf_i_field *f = &fields[i];
        void *target = (char *)base + f->off;
        x->key_line = conf_i_node_line(k);
        bool ok = false;
        switch (f->type) {
        case CONF_F_BOOL:
            ok = set_bool(x, v, target);
            break;
        case CONF_F_U32:
            ok = conf_i_set_u32(x, v, f, target);
            break;
        case CONF_F_DUR:
            ok = set_duration(x, v, f, target);
            break;
        case CONF_F_SIZE:
            ok = set_size(x, v, f, target);
            break;
        case CONF_F_ENUM:
            ok = set_enum(x, v, f, target);
            break;
        case CONF_F_FUNC:
            ok = f->fn(x, v, target);
            break;
        }
        x->key_line = 0;
        if (!ok)
            return false;
        conf_i_path_pop(x, old);
    }
    for (size_t i = 0; i < nfields; i++) {
        if (fields[i].required && !(seen & ((uint64_t)1 << i))) {
            conf_i_path_push_key(x, fields[i].key);
            return conf_i_fail_line(x, parent_line, "missing required key");
        }
    }
    return true;
}

/* ---------------------------------------------------------------- values as the reference writes them */

const void *conf_i_at(const void *base, const struct conf_i_field *f)
{
    return (const char *)base + f->off;
}

/* The string at the field's offset, or at CONF_STR_AT's (a key parsed through its whole struct, CONF_FIELD_BASE). */
bool conf_i_show_str(const void *base, const struct conf_i_field *f, char *buf, size_t n)
{
    const char *s = *(char *const *)((const char *)base + (f->arr_off ? f->arr_off : f->off));
    if (s == NULL)
        return false;
    snprintf(buf, n, "%s", s);
    return true;
}

/* "[a, b]" from n items written by item(i) into a bounded buffer. */
void conf_i_show_list(char *buf, size_t n, size_t items, const void *arr,
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

/* A (pointer, count) list at base + f->arr_off and base + f->n_off. */
const void *conf_i_list_at(const void *base, const struct conf_i_field *f, size_t *n)
{
    *n = *(const size_t *)((const char *)base + f->n_off);
    return *(const void *const *)((const char *)base + f->arr_off);
}

static void status_item(const void *arr, size_t i, char *out, size_t on)
{
    snprintf(out, on, "%d", ((const int *)arr)[i]);
}

bool conf_i_show_statuses(const void *base, const struct conf_i_field *f, char *buf, size_t n)
{
    size_t items;
    const void *arr = conf_i_list_at(base, f, &items);
    conf_i_show_list(buf, n, items, arr, status_item);
    return true;
}

/* A name of its list (upstreams, routes): 1 to CONF_NAME_MAX_LEN characters of
 * A-Z a-z 0-9 _ . -, not taken by an earlier entry. */
bool conf_i_set_unique_name(struct conf_i_ctx *x, yaml_node_t *n, char **out, const char *what,
                            bool (*taken)(const struct conf *, const char *))
{
    const char *s = conf_i_scalar(x, n, "a name");
    if (s == NULL)
        return false;
    char b[80];
    if (!is_name(s))
        return conf_i_fail(x, n, "invalid name '%s' (1 to %d characters of A-Z a-z 0-9 _ . -)", conf_i_shown(b, s),
                           CONF_NAME_MAX_LEN);
    if (taken(x->c, s))
        return conf_i_fail(x, n, "duplicate %s name '%s'", what, s);
    free(*out);
    *out = cm_strdup(s);
    return true;
}

/* Line of the first key named key in the mapping map (the top level, "store", "jwt"), or 0. */
size_t conf_i_find_line(struct conf_i_ctx *x, yaml_node_t *map, const char *key, yaml_node_t **value)
{
    if (map == NULL || map->type != YAML_MAPPING_NODE)
        return 0;
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(x->doc, p->key);
        if (k && k->type == YAML_SCALAR_NODE && strcmp((const char *)k->data.scalar.value, key) == 0) {
            if (value)
                *value = yaml_document_get_node(x->doc, p->value);
            return conf_i_node_line(k);
        }
    }
    return 0;
}

char *conf_i_env_name(struct conf_i_ctx *x, yaml_node_t *n)
{
    const char *s = conf_i_scalar(x, n, "an environment variable name");
    if (s == NULL)
        return NULL;
    bool ok = (*s >= 'A' && *s <= 'Z') || (*s >= 'a' && *s <= 'z') || *s == '_';
    for (const char *p = s; ok && *p; p++)
        ok = (*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '_';
    char b[80];
    if (!ok || strlen(s) > 128) {
        conf_i_fail(x, n, "invalid environment variable name '%s' (A-Z a-z 0-9 _, not starting with a digit)",
                    conf_i_shown(b, s));
        return NULL;
    }
    return cm_strdup(s);
}
