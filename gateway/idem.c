/* idem.c - Idempotency-Key parsing (bare token or RFC 8941 sf-string) and request part hashing. It never reads a
 * request part itself (gateway/parts.c does) and never stores anything. */
#include "gateway/idem.h"
#include "gateway/jwt.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

static bool is_ows(char c)
{
    return c == ' ' || c == '\t';
}

/* RFC 8941 3.3.3: DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) ) DQUOTE, with
 * unescaped = %x20-21 / %x23-5B / %x5D-7E. p/len span from the opening quote
 * to the end of the value (trailing OWS already removed). */
static bool parse_sf_string(const char *p, size_t len, char out[GW_KEY_MAX + 1], size_t *out_len)
{
    size_t o = 0;
    size_t i = 1; /* past the opening quote */
    for (; i < len; i++) {
        unsigned char c = (unsigned char)p[i];
        if (c == '"')
            break;
        if (c == '\\') {
            if (++i >= len)
                return false;
            c = (unsigned char)p[i];
            if (c != '"' && c != '\\')
                return false;
        } else if (c < 0x20 || c > 0x7e) {
            return false;
        }
        if (o >= GW_KEY_MAX)
            return false;
        out[o++] = (char)c;
    }
    /* The closing quote must exist and be the last byte. */
    if (i >= len || i != len - 1 || o == 0)
        return false;
    out[o] = '\0';
    *out_len = o;
    return true;
}

bool gw_key_parse(const char *raw, size_t len, char out[GW_KEY_MAX + 1], size_t *out_len)
{
    if (!raw)
        return false;
    while (len > 0 && is_ows(raw[0])) {
        raw++;
        len--;
    }
    while (len > 0 && is_ows(raw[len - 1]))
        len--;
    if (len == 0)
        return false;
    if (raw[0] == '"')
        return parse_sf_string(raw, len, out, out_len);
    if (len > GW_KEY_MAX)
        return false;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)raw[i];
        if (c < 0x21 || c > 0x7e)
            return false;
        out[i] = (char)c;
    }
    out[len] = '\0';
    *out_len = len;
    return true;
}

bool gw_key_text(const char *p, size_t n, char out[GW_KEY_MAX + 1], size_t *out_len)
{
    if (n == 0 || n > GW_KEY_MAX || !gw_utf8_valid(p, n))
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        /* C0, DEL, and C1 (U+0080 .. U+009F, UTF-8 C2 80 .. C2 9F) */
        if (c < 0x20 || c == 0x7f || (c == 0xC2 && i + 1 < n && (unsigned char)p[i + 1] <= 0x9F))
            return false;
    }
    memcpy(out, p, n);
    out[n] = '\0';
    *out_len = n;
    return true;
}

/* A JSON value as a key: a string's decoded text, an integer's decimal text (-0 is 0). */
static bool key_of_json(const char *p, size_t n, char out[GW_KEY_MAX + 1], size_t *out_len)
{
    char s[GW_KEY_MAX];
    size_t len;
    if (n > 0 && p[0] == '"')
        return gw_json_string_utf8(p, n, s, sizeof s, &len) && gw_key_text(s, len, out, out_len);
    size_t i = n > 0 && p[0] == '-';
    if (i == n)
        return false;
    for (size_t k = i; k < n; k++)
        if (p[k] < '0' || p[k] > '9')
            return false; /* a fraction, an exponent, a string, true, an object ... */
    if (n == 2 && p[0] == '-' && p[1] == '0')
        return gw_key_text("0", 1, out, out_len);
    return gw_key_text(p, n, out, out_len);
}

enum gw_key_res gw_key_from(const struct conf_part *src, struct gw_reqparts *r, char out[GW_KEY_MAX + 1],
                            size_t *out_len)
{
    static const enum gw_part kinds[] = {[CONF_PART_HEADER] = GW_PART_HEADER,
                                         [CONF_PART_JSON] = GW_PART_JSON,
                                         [CONF_PART_FORM] = GW_PART_FORM,
                                         [CONF_PART_QPARAM] = GW_PART_QPARAM};
    enum gw_part kind = kinds[src->kind];
    size_t count = gw_parts_count(r, kind, src->header);
    if (count == 0)
        return GW_KEY_ABSENT;
    struct gw_value v;
    if (count > 1 || !gw_parts_value(r, kind, src->header, 0, &v)) /* which one counts would depend on the reader */
        return GW_KEY_INVALID;
    bool ok = kind == GW_PART_HEADER ? gw_key_parse(v.p, v.n, out, out_len)
              : kind == GW_PART_JSON ? key_of_json(v.p, v.n, out, out_len)
                                     : gw_key_text(v.p, v.n, out, out_len);
    gw_value_release(&v);
    return ok ? GW_KEY_OK : GW_KEY_INVALID;
}

static void put_u64(struct cm_sha256 *h, uint64_t v)
{
    uint8_t b[8];
    for (int i = 7; i >= 0; i--) {
        b[i] = (uint8_t)(v & 0xff);
        v >>= 8;
    }
    cm_sha256_update(h, b, sizeof(b));
}

static void put_value(struct cm_sha256 *h, const struct gw_value *v)
{
    cm_sha256_part(h, v->p ? v->p : "", v->n);
}

/* method, path, query, body: the bytes, length-prefixed. */
static void put_one(struct cm_sha256 *h, struct gw_reqparts *r, enum gw_part kind)
{
    struct gw_value v;
    if (gw_parts_value(r, kind, NULL, 0, &v))
        put_value(h, &v);
    gw_value_release(&v);
}

/* Header names are case-insensitive: hash the configured name in lower case. */
static void put_lower_name(struct cm_sha256 *h, const char *name)
{
    size_t n = name ? strlen(name) : 0;
    char *low = cm_malloc(n + 1);
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        low[i] = (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c;
    }
    cm_sha256_part(h, low, n);
    free(low);
}

/* header, form: and query: parts: the name (a header's lower-cased), then the count of values, then each value
 * length-prefixed in request order; absent (count 0) differs from one empty value. */
static void put_values(struct cm_sha256 *h, enum gw_part kind, const char *name, struct gw_reqparts *r)
{
    if (kind == GW_PART_HEADER)
        put_lower_name(h, name);
    else
        cm_sha256_part(h, name ? name : "", name ? strlen(name) : 0);
    uint64_t count = gw_parts_count(r, kind, name);
    put_u64(h, count);
    for (size_t i = 0; i < count; i++) {
        struct gw_value v;
        if (gw_parts_value(r, kind, name, i, &v))
            put_value(h, &v);
        gw_value_release(&v);
    }
}

static void sha_put(void *arg, const void *p, size_t n)
{
    cm_sha256_update(arg, p, n);
}

/* json: part: the pointer, then 0 (absent), 1 and the SHA-256 of the value's RFC 8785 canonical form, or 2 and the
 * value's text as sent (a value without a canonical form: a lone surrogate, a number beyond a double). */
static void put_json(struct cm_sha256 *h, struct gw_reqparts *r, const char *ptr)
{
    struct cm_sha256 c;
    cm_sha256_init(&c);
    enum gw_jcs res = gw_parts_json_canonical(r, ptr, sha_put, &c);
    uint8_t d[32];
    cm_sha256_final(&c, d);
    cm_sha256_part(h, ptr ? ptr : "", ptr ? strlen(ptr) : 0);
    put_u64(h, res == GW_JCS_ABSENT ? 0 : res == GW_JCS_OK ? 1 : 2);
    if (res == GW_JCS_OK) {
        cm_sha256_update(h, d, sizeof d);
    } else if (res == GW_JCS_NOT_IJSON) {
        struct gw_value v;
        if (gw_parts_value(r, GW_PART_JSON, ptr, 0, &v))
            put_value(h, &v);
        gw_value_release(&v);
    }
}

/* jwt: part: the claim's name, then 0 (absent), 1 and a string's bytes, or 2 and another JSON value's compact JSON:
 * absent differs from "", and "123" from 123 (SPEC 9). */
static void put_claim(struct cm_sha256 *h, struct gw_reqparts *r, const char *name)
{
    struct gw_value v;
    bool has = gw_parts_value(r, GW_PART_JWT, name, 0, &v);
    cm_sha256_part(h, name ? name : "", name ? strlen(name) : 0);
    put_u64(h, has ? (v.json ? 2 : 1) : 0);
    if (has)
        put_value(h, &v);
    gw_value_release(&v);
}

void gw_hash_parts(const struct conf_part *parts, size_t n, struct gw_reqparts *r, uint8_t out[32])
{
    struct cm_sha256 h;
    cm_sha256_init(&h);
    for (size_t i = 0; i < n; i++) {
        uint8_t tag = (uint8_t)('A' + (int)parts[i].kind);
        cm_sha256_update(&h, &tag, 1);
        switch (parts[i].kind) {
        case CONF_PART_METHOD:
            put_one(&h, r, GW_PART_METHOD);
            break;
        case CONF_PART_PATH:
            put_one(&h, r, GW_PART_PATH);
            break;
        case CONF_PART_QUERY:
            put_one(&h, r, GW_PART_QUERY);
            break;
        case CONF_PART_BODY:
            put_one(&h, r, GW_PART_BODY);
            break;
        case CONF_PART_HEADER:
            put_values(&h, GW_PART_HEADER, parts[i].header, r);
            break;
        case CONF_PART_FORM:
            put_values(&h, GW_PART_FORM, parts[i].header, r);
            break;
        case CONF_PART_QPARAM:
            put_values(&h, GW_PART_QPARAM, parts[i].header, r);
            break;
        case CONF_PART_JSON:
            put_json(&h, r, parts[i].header);
            break;
        case CONF_PART_JWT:
            put_claim(&h, r, parts[i].header);
            if (gw_jwt_issuer_scoped(r->jwt)) /* no jwt.issuer: tokens of several issuers are accepted */
                put_claim(&h, r, "iss");
            break;
        }
    }
    cm_sha256_final(&h, out);
}

/* Appends every value of header name to out as it arrived, unless out has it already (two parts naming one
 * header). */
static void copy_header(struct gw_reqparts *r, const char *name, struct cm_hdrs *out)
{
    if (cm_hdrs_get(out, name))
        return;
    struct gw_value v;
    for (size_t i = 0; gw_parts_value(r, GW_PART_HEADER, name, i, &v); i++) {
        cm_hdrs_addn(out, v.name, strlen(v.name), v.p, v.n);
        gw_value_release(&v);
    }
}

void gw_scope_probe_headers(const struct conf_part *parts, size_t n, struct gw_reqparts *r, struct cm_hdrs *out)
{
    for (size_t i = 0; i < n; i++) {
        if (parts[i].kind == CONF_PART_HEADER)
            copy_header(r, parts[i].header, out);
        else if (parts[i].kind == CONF_PART_JWT)
            copy_header(r, "Authorization", out);
    }
}
