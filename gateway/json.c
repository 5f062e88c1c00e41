/* json.c - one iterative validating pass indexing every value, and JSON Pointer look-ups; never copies the body. */
#include "gateway/json.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Not jansson: jansson refuses whole documents that RFC 8259 allows (an integer beyond int64, a real beyond a
 * double, "\u0000"), and a value read from a body must not depend on what else the body holds. */

/* ---- a JSON Pointer's reference tokens, read in place */

struct ptok {
    const char *p; /* raw, "~0" and "~1" undecoded */
    size_t n;
    bool is_index; /* "0" or digits without a leading zero (at most 9): an array index */
    size_t idx;
};

/* An array index token: "0" or digits without a leading zero. */
static bool array_index(const char *t, size_t n, size_t *idx)
{
    if (n == 0 || n > 9 || (n > 1 && t[0] == '0'))
        return false;
    size_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (t[i] < '0' || t[i] > '9')
            return false;
        v = v * 10 + (size_t)(t[i] - '0');
    }
    *idx = v;
    return true;
}

/* ---- strings: validation, and their decoded bytes (UTF-8) for comparing member names */

static int hexval(unsigned char c)
{
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* Four hex digits at p (validated before) as a UTF-16 code unit. */
static uint32_t hex4(const unsigned char *p)
{
    return (uint32_t)(hexval(p[0]) << 12 | hexval(p[1]) << 8 | hexval(p[2]) << 4 | hexval(p[3]));
}

/* Length of the UTF-8 sequence at s (avail bytes), 0 when it is not well-formed (RFC 3629: no overlong form, no
 * surrogate, nothing above U+10FFFF). */
static size_t utf8_len(const unsigned char *s, size_t avail)
{
    unsigned c = s[0];
    size_t n;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        if (c == 0xE0)
            lo = 0xA0;
        else if (c == 0xED)
            hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        if (c == 0xF0)
            lo = 0x90;
        else if (c == 0xF4)
            hi = 0x8F;
    } else {
        return 0;
    }
    if (avail < n || s[1] < lo || s[1] > hi)
        return 0;
    for (size_t i = 2; i < n; i++)
        if (s[i] < 0x80 || s[i] > 0xBF)
            return 0;
    return n;
}

/* The UTF-8 form of code point cp (a lone surrogate in its 3-byte form) into b: its length. */
static unsigned utf8_encode(uint32_t cp, unsigned char b[4])
{
    if (cp < 0x80) {
        b[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        b[0] = (unsigned char)(0xC0 | cp >> 6);
        b[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        b[0] = (unsigned char)(0xE0 | cp >> 12);
        b[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
        b[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    b[0] = (unsigned char)(0xF0 | cp >> 18);
    b[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
    b[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
    b[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* The decoded bytes of a validated string's content: escapes resolved, a surrogate pair as one code point, a lone
 * surrogate as its 3-byte form (so that each content decodes to exactly one byte string). */
struct jstr {
    const unsigned char *p, *e;
    unsigned char buf[4];
    unsigned n, i;
};

/* The next byte, -1 at the end. */
static int jstr_next(struct jstr *d)
{
    if (d->i < d->n)
        return d->buf[d->i++];
    if (d->p >= d->e)
        return -1;
    unsigned c = *d->p++;
    if (c != '\\')
        return (int)c;
    c = *d->p++;
    switch (c) {
    case 'b':
        return '\b';
    case 'f':
        return '\f';
    case 'n':
        return '\n';
    case 'r':
        return '\r';
    case 't':
        return '\t';
    case 'u':
        break;
    default: /* '"', '\\', '/' */
        return (int)c;
    }
    uint32_t cp = hex4(d->p);
    d->p += 4;
    if (cp >= 0xD800 && cp <= 0xDBFF && d->e - d->p >= 6 && d->p[0] == '\\' && d->p[1] == 'u') {
        uint32_t lo = hex4(d->p + 2);
        if (lo >= 0xDC00 && lo <= 0xDFFF) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            d->p += 6;
        }
    }
    d->n = utf8_encode(cp, d->buf);
    d->i = 1;
    return d->buf[0];
}

static struct jstr jstr_of(const unsigned char *p, size_t n)
{
    struct jstr d = {.p = p, .e = p + n};
    return d;
}

/* A member name (its content, undecoded) and the hash of its decoded bytes. */
struct jkey {
    const unsigned char *p;
    size_t n;
    uint64_t hash;
};

static uint64_t jstr_hash(const unsigned char *p, size_t n)
{
    struct jstr d = jstr_of(p, n);
    uint64_t h = 14695981039346656037ull; /* FNV-1a */
    for (int c; (c = jstr_next(&d)) >= 0;)
        h = (h ^ (uint64_t)c) * 1099511628211ull;
    return h;
}

/* Orders member names by hash, then by decoded bytes: equal names end up side by side, whatever the hashes. */
static int jkey_cmp(const void *a, const void *b)
{
    const struct jkey *x = a, *y = b;
    if (x->hash != y->hash)
        return x->hash < y->hash ? -1 : 1;
    struct jstr dx = jstr_of(x->p, x->n), dy = jstr_of(y->p, y->n);
    for (;;) {
        int cx = jstr_next(&dx), cy = jstr_next(&dy);
        if (cx != cy)
            return cx < cy ? -1 : 1;
        if (cx < 0)
            return 0;
    }
}

/* Is the member name (content p, n) the reference token t ("~1" is '/', "~0" is '~')? */
static bool jkey_is_token(const unsigned char *p, size_t n, const struct ptok *t)
{
    struct jstr d = jstr_of(p, n);
    for (size_t i = 0; i < t->n; i++) {
        char ch = t->p[i];
        if (ch == '~' && i + 1 < t->n && (t->p[i + 1] == '0' || t->p[i + 1] == '1'))
            ch = t->p[++i] == '1' ? '/' : '~';
        if (jstr_next(&d) != (unsigned char)ch)
            return false;
    }
    return jstr_next(&d) < 0;
}

/* ---- the document: one pass, no recursion, nesting bounded */

/* One value: its raw text, the token after its subtree (its next sibling), and for an object member its name. */
struct jtok {
    uint32_t start, end;
    uint32_t next;
    uint32_t key, keylen; /* offset and length of the member name's content; keylen 0 and key 0 otherwise */
};

struct gw_json {
    const unsigned char *s;
    struct jtok *toks;
    size_t ntoks;
};

struct jframe {
    bool object;
    size_t tok;      /* the container's token */
    size_t key_base; /* object: its member names are keys[key_base ..] */
};

struct jparse {
    const unsigned char *s;
    size_t len, pos;
    struct jkey *keys; /* the member names of the open objects, innermost last */
    size_t nkeys, capkeys;
    struct jframe *frames;
    size_t depth, capframes;
    struct jtok *toks;
    size_t ntoks, captoks;
    uint32_t key, keylen; /* the name of the member whose value comes next */
};

static void skip_ws(struct jparse *j)
{
    while (j->pos < j->len &&
           (j->s[j->pos] == ' ' || j->s[j->pos] == '\t' || j->s[j->pos] == '\n' || j->s[j->pos] == '\r'))
        j->pos++;
}

/* At '"': the string's content into *p, *n; pos after the closing quote. false when it is not a valid string. */
static bool scan_string(struct jparse *j, const unsigned char **p, size_t *n)
{
    size_t i = j->pos + 1;
    const size_t start = i;
    while (i < j->len) {
        unsigned c = j->s[i];
        if (c == '"') {
            *p = j->s + start;
            *n = i - start;
            j->pos = i + 1;
            return true;
        }
        if (c < 0x20)
            return false;
        if (c == '\\') {
            if (i + 1 >= j->len)
                return false;
            c = j->s[i + 1];
            if (c == 'u') {
                if (j->len - i < 6)
                    return false;
                for (size_t k = 2; k < 6; k++)
                    if (hexval(j->s[i + k]) < 0)
                        return false;
                i += 6;
            } else if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't') {
                i += 2;
            } else {
                return false;
            }
        } else if (c < 0x80) {
            i++;
        } else {
            size_t u = utf8_len(j->s + i, j->len - i);
            if (u == 0)
                return false;
            i += u;
        }
    }
    return false;
}

static size_t scan_digits(const struct jparse *j, size_t i)
{
    while (i < j->len && j->s[i] >= '0' && j->s[i] <= '9')
        i++;
    return i;
}

/* At '-' or a digit: a number (RFC 8259: -? (0 | [1-9] digits) (. digits)? ([eE] [+-]? digits)?, any magnitude);
 * pos after it. false when the grammar is broken. */
static bool scan_number(struct jparse *j)
{
    size_t i = j->pos;
    if (j->s[i] == '-')
        i++;
    if (i >= j->len || j->s[i] < '0' || j->s[i] > '9')
        return false;
    i = j->s[i] == '0' ? i + 1 : scan_digits(j, i);
    if (i < j->len && j->s[i] == '.') {
        size_t k = scan_digits(j, i + 1);
        if (k == i + 1)
            return false;
        i = k;
    }
    if (i < j->len && (j->s[i] == 'e' || j->s[i] == 'E')) {
        i++;
        if (i < j->len && (j->s[i] == '+' || j->s[i] == '-'))
            i++;
        size_t k = scan_digits(j, i);
        if (k == i)
            return false;
        i = k;
    }
    j->pos = i;
    return true;
}

static bool scan_literal(struct jparse *j)
{
    static const char *const lits[] = {"true", "false", "null"};
    for (size_t k = 0; k < 3; k++) {
        size_t n = strlen(lits[k]);
        if (j->len - j->pos >= n && memcmp(j->s + j->pos, lits[k], n) == 0) {
            j->pos += n;
            return true;
        }
    }
    return false;
}

/* In the innermost object, at a member: its name (kept for the duplicate check, and as the name of the value that
 * follows) and the ':'. */
static bool member_name(struct jparse *j)
{
    skip_ws(j);
    const unsigned char *p;
    size_t n;
    if (j->pos >= j->len || j->s[j->pos] != '"' || !scan_string(j, &p, &n))
        return false;
    skip_ws(j);
    if (j->pos >= j->len || j->s[j->pos] != ':')
        return false;
    j->pos++;
    if (j->nkeys == j->capkeys) {
        j->capkeys = j->capkeys ? j->capkeys * 2 : 16;
        j->keys = cm_realloc(j->keys, j->capkeys * sizeof *j->keys);
    }
    j->keys[j->nkeys++] = (struct jkey){p, n, jstr_hash(p, n)};
    j->key = (uint32_t)(p - j->s);
    j->keylen = (uint32_t)n;
    return true;
}

/* The innermost object closes: false when two of its members have the same name. Its names are dropped. */
static bool members_unique(struct jparse *j, size_t base)
{
    size_t n = j->nkeys - base;
    bool ok = true;
    if (n > 1) {
        qsort(j->keys + base, n, sizeof *j->keys, jkey_cmp);
        for (size_t i = base + 1; ok && i < j->nkeys; i++)
            ok = jkey_cmp(&j->keys[i - 1], &j->keys[i]) != 0;
    }
    j->nkeys = base;
    return ok;
}

/* A value starts at pos: its token, named by the pending member name (if any). Every value takes at least one byte,
 * so there are never more tokens than bytes. */
static size_t tok_open(struct jparse *j)
{
    if (j->ntoks == j->captoks) {
        j->captoks = j->captoks ? j->captoks * 2 : 16;
        j->toks = cm_realloc(j->toks, j->captoks * sizeof *j->toks);
    }
    j->toks[j->ntoks] = (struct jtok){.start = (uint32_t)j->pos, .key = j->key, .keylen = j->keylen};
    j->key = j->keylen = 0;
    return j->ntoks++;
}

static void tok_close(struct jparse *j, size_t t)
{
    j->toks[t].end = (uint32_t)j->pos;
    j->toks[t].next = (uint32_t)j->ntoks;
}

/* Validates the whole document (RFC 8259 with duplicate member names refused; a number of any magnitude) and
 * indexes its values. false when the document is not valid. */
static bool json_walk(struct jparse *j)
{
    for (;;) {
        /* a value */
        skip_ws(j);
        if (j->pos >= j->len)
            return false;
        unsigned char c = j->s[j->pos];
        size_t t = tok_open(j);
        if (c == '{' || c == '[') {
            if (j->depth == GW_JSON_MAX_DEPTH)
                return false;
            if (j->depth == j->capframes) {
                j->capframes = j->capframes ? j->capframes * 2 : 16;
                j->frames = cm_realloc(j->frames, j->capframes * sizeof *j->frames);
            }
            j->frames[j->depth++] = (struct jframe){.object = c == '{', .tok = t, .key_base = j->nkeys};
            j->pos++;
            skip_ws(j);
            if (j->pos < j->len && j->s[j->pos] == (c == '{' ? '}' : ']')) {
                j->pos++;
                j->depth--;
                tok_close(j, t);
            } else {
                if (c == '{' && !member_name(j))
                    return false;
                continue;
            }
        } else {
            const unsigned char *p;
            size_t n;
            if (c == '"'                               ? !scan_string(j, &p, &n)
                : (c == '-' || (c >= '0' && c <= '9')) ? !scan_number(j)
                                                       : !scan_literal(j))
                return false;
            tok_close(j, t);
        }
        /* after a value: close what ends here, then the next member or element */
        for (;;) {
            skip_ws(j);
            if (j->depth == 0)
                return j->pos == j->len;
            if (j->pos >= j->len)
                return false;
            struct jframe *f = &j->frames[j->depth - 1];
            c = j->s[j->pos++];
            if (c == ',') {
                if (f->object && !member_name(j))
                    return false;
                break;
            }
            if (c != (f->object ? '}' : ']'))
                return false;
            if (f->object && !members_unique(j, f->key_base))
                return false;
            j->depth--;
            tok_close(j, f->tok);
        }
    }
}

struct gw_json *gw_json_parse(const char *s, size_t len)
{
    if (s == NULL || len == 0 || len >= UINT32_MAX)
        return NULL;
    struct jparse j = {.s = (const unsigned char *)s, .len = len};
    bool ok = json_walk(&j);
    free(j.keys);
    free(j.frames);
    if (!ok) {
        free(j.toks);
        return NULL;
    }
    struct gw_json *doc = cm_malloc(sizeof *doc);
    *doc = (struct gw_json){.s = j.s, .toks = j.toks, .ntoks = j.ntoks};
    return doc;
}

/* The child of container token c that reference token t names, or 0 (never a child: the root is token 0). */
static size_t child(const struct gw_json *j, size_t c, const struct ptok *t)
{
    const struct jtok *ct = &j->toks[c];
    unsigned char kind = j->s[ct->start];
    size_t i = 0;
    for (size_t k = c + 1; k < ct->next; k = j->toks[k].next, i++) {
        if (kind == '{' ? jkey_is_token(j->s + j->toks[k].key, j->toks[k].keylen, t)
                        : kind == '[' && t->is_index && t->idx == i)
            return k;
    }
    return 0;
}

bool gw_json_pointer(const struct gw_json *j, const char *ptr, const char **p, size_t *n)
{
    if (j == NULL || ptr == NULL || (ptr[0] != '\0' && ptr[0] != '/'))
        return false;
    size_t cur = 0;
    for (const char *q = ptr; *q;) {
        const char *b = q + 1, *e = strchr(b, '/');
        struct ptok t = {.p = b, .n = e ? (size_t)(e - b) : strlen(b)};
        t.is_index = array_index(b, t.n, &t.idx);
        if ((cur = child(j, cur, &t)) == 0)
            return false;
        q = b + t.n;
    }
    *p = (const char *)j->s + j->toks[cur].start;
    *n = j->toks[cur].end - j->toks[cur].start;
    return true;
}

/* ---- RFC 8785 (JCS) canonical form */

/* The next code point of a validated string's content [*p, e), -1 at the end: an escape decoded, a surrogate pair
 * joined, a lone surrogate returned as itself (0xD800 .. 0xDFFF), raw UTF-8 decoded. */
static int32_t jcp_next(const unsigned char **pp, const unsigned char *e)
{
    const unsigned char *p = *pp;
    if (p >= e)
        return -1;
    uint32_t c = *p;
    if (c == '\\') {
        unsigned char x = p[1];
        static const char from[] = "bfnrt\"\\/", to[] = "\b\f\n\r\t\"\\/";
        const char *f = x != 'u' ? strchr(from, x) : NULL;
        if (f) {
            *pp = p + 2;
            return (unsigned char)to[f - from];
        }
        c = hex4(p + 2);
        p += 6;
        if (c >= 0xD800 && c <= 0xDBFF && e - p >= 6 && p[0] == '\\' && p[1] == 'u') {
            uint32_t lo = hex4(p + 2);
            if (lo >= 0xDC00 && lo <= 0xDFFF) {
                c = 0x10000 + ((c - 0xD800) << 10) + (lo - 0xDC00);
                p += 6;
            }
        }
        *pp = p;
        return (int32_t)c;
    }
    size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4; /* validated by the parse */
    if (n > 1) {
        c &= n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07;
        for (size_t i = 1; i < n; i++)
            c = c << 6 | (p[i] & 0x3F);
    }
    *pp = p + n;
    return (int32_t)c;
}

/* UTF-16 code units of a string's content, one at a time (JCS sorts member names by them). */
struct u16it {
    const unsigned char *p, *e;
    int32_t low; /* the pending low surrogate of a pair, or -1 */
};

static int32_t u16_next(struct u16it *it)
{
    if (it->low >= 0) {
        int32_t l = it->low;
        it->low = -1;
        return l;
    }
    int32_t c = jcp_next(&it->p, it->e);
    if (c >= 0x10000) {
        it->low = 0xDC00 + ((c - 0x10000) & 0x3FF);
        return 0xD800 + ((c - 0x10000) >> 10);
    }
    return c;
}

struct jcs_member {
    const unsigned char *s; /* the document */
    const struct jtok *t;
};

static int jcs_member_cmp(const void *a, const void *b)
{
    const struct jcs_member *x = a, *y = b;
    struct u16it i = {x->s + x->t->key, x->s + x->t->key + x->t->keylen, -1};
    struct u16it k = {y->s + y->t->key, y->s + y->t->key + y->t->keylen, -1};
    for (;;) {
        int32_t cx = u16_next(&i), cy = u16_next(&k);
        if (cx != cy)
            return cx < cy ? -1 : 1; /* -1, the end, sorts first: a prefix comes before */
        if (cx < 0)
            return 0;
    }
}

struct jcs_out {
    void (*put)(void *arg, const void *p, size_t n);
    void *arg;
};

static void out_utf8(const struct jcs_out *o, uint32_t cp)
{
    unsigned char b[4];
    o->put(o->arg, b, utf8_encode(cp, b));
}

/* A string's content (between its quotes) in JCS form, with its quotes: runs without escapes are copied as they are
 * (the parse let no control byte and no lone surrogate through there). false on an escaped lone surrogate. */
static bool jcs_string(const struct jcs_out *o, const unsigned char *p, size_t n)
{
    const unsigned char *e = p + n;
    o->put(o->arg, "\"", 1);
    while (p < e) {
        const unsigned char *bs = memchr(p, '\\', (size_t)(e - p));
        if (!bs)
            bs = e;
        if (bs > p)
            o->put(o->arg, p, (size_t)(bs - p));
        p = bs;
        if (p == e)
            break;
        int32_t c = jcp_next(&p, e);
        static const char shortform[] = "\b\f\n\r\t", letters[] = "bfnrt";
        const char *sf = c > 0 && c < 0x20 ? memchr(shortform, c, 5) : NULL;
        char esc[8];
        if (c >= 0xD800 && c <= 0xDFFF)
            return false;
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            o->put(o->arg, esc, 2);
        } else if (sf) {
            esc[0] = '\\';
            esc[1] = letters[sf - shortform];
            o->put(o->arg, esc, 2);
        } else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", (unsigned)c);
            o->put(o->arg, esc, 6);
        } else {
            out_utf8(o, (uint32_t)c);
        }
    }
    o->put(o->arg, "\"", 1);
    return true;
}

size_t gw_json_number_es(double v, char out[GW_JSON_NUM_MAX])
{
    if (v == 0 || !isfinite(v)) { /* -0 prints as 0; a caller never passes a non-finite value */
        memcpy(out, "0", 2);
        return 1;
    }
    /* the shortest significand that reads back as v: %.*e rounds correctly, so the first precision that round-trips
     * gives the digits closest to v among the shortest (ECMAScript's choice) */
    char e[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, fabs(v));
        if (strtod(e, NULL) == fabs(v))
            break;
    }
    char digits[20];
    size_t k = 0;
    const char *q = e;
    for (; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9')
            digits[k++] = *q;
    while (k > 1 && digits[k - 1] == '0')
        k--;
    long x = strtol(q + 1, NULL, 10);
    long n = x + 1; /* v = 0.digits * 10^n */
    size_t o = 0;
    if (v < 0)
        out[o++] = '-';
    if ((long)k <= n && n <= 21) { /* digits, then n - k zeros */
        memcpy(out + o, digits, k);
        o += k;
        for (long i = 0; i < n - (long)k; i++)
            out[o++] = '0';
    } else if (0 < n && n <= 21) { /* the point inside the digits */
        memcpy(out + o, digits, (size_t)n);
        o += (size_t)n;
        out[o++] = '.';
        memcpy(out + o, digits + n, k - (size_t)n);
        o += k - (size_t)n;
    } else if (-6 < n && n <= 0) { /* 0.000ddd */
        out[o++] = '0';
        out[o++] = '.';
        for (long i = 0; i < -n; i++)
            out[o++] = '0';
        memcpy(out + o, digits, k);
        o += k;
    } else { /* d[.ddd]e+-(n-1) */
        out[o++] = digits[0];
        if (k > 1) {
            out[o++] = '.';
            memcpy(out + o, digits + 1, k - 1);
            o += k - 1;
        }
        o += (size_t)snprintf(out + o, GW_JSON_NUM_MAX - o, "e%c%ld", n - 1 < 0 ? '-' : '+', labs(n - 1));
    }
    out[o] = '\0';
    return o;
}

/* A number token's text in ECMAScript form. false when it is beyond a double (RFC 8785 needs IEEE 754). */
static bool jcs_number(const struct jcs_out *o, const unsigned char *p, size_t n)
{
    char small[64], *t = n < sizeof small ? small : cm_malloc(n + 1);
    memcpy(t, p, n);
    t[n] = '\0';
    double v = strtod(t, NULL); /* correctly rounded; an underflow is the nearest denormal or 0 */
    if (t != small)
        free(t);
    if (!isfinite(v))
        return false;
    char b[GW_JSON_NUM_MAX];
    o->put(o->arg, b, gw_json_number_es(v, b));
    return true;
}

/* A scalar token in JCS form. */
static bool jcs_scalar(const struct gw_json *j, const struct jcs_out *o, const struct jtok *t)
{
    const unsigned char *p = j->s + t->start;
    size_t n = t->end - t->start;
    if (p[0] == '"')
        return jcs_string(o, p + 1, n - 2);
    if (p[0] == '-' || (p[0] >= '0' && p[0] <= '9'))
        return jcs_number(o, p, n);
    o->put(o->arg, p, n); /* true, false, null */
    return true;
}

/* An open container: its children in output order. */
struct jcs_frame {
    struct jcs_member *kids;
    size_t n, pos;
    bool object;
};

/* Opens container token t on the stack (its children listed, an object's sorted). */
static void jcs_open(const struct gw_json *j, const struct jcs_out *o, size_t t, struct jcs_frame *f)
{
    const struct jtok *ct = &j->toks[t];
    f->object = j->s[ct->start] == '{';
    f->n = f->pos = 0;
    for (size_t k = t + 1; k < ct->next; k = j->toks[k].next)
        f->n++;
    f->kids = f->n ? cm_malloc(f->n * sizeof *f->kids) : NULL;
    size_t i = 0;
    for (size_t k = t + 1; k < ct->next; k = j->toks[k].next)
        f->kids[i++] = (struct jcs_member){j->s, &j->toks[k]};
    if (f->object && f->n > 1)
        qsort(f->kids, f->n, sizeof *f->kids, jcs_member_cmp);
    o->put(o->arg, f->object ? "{" : "[", 1);
}

enum gw_jcs gw_json_canonical(const struct gw_json *j, const char *ptr, void (*put)(void *arg, const void *p, size_t n),
                              void *arg)
{
    const char *vp;
    size_t vn;
    if (!gw_json_pointer(j, ptr, &vp, &vn))
        return GW_JCS_ABSENT;
    const struct jcs_out o = {put, arg};
    size_t root = 0;
    while (j->s + j->toks[root].start != (const unsigned char *)vp) /* the token gw_json_pointer found */
        root++;
    unsigned char c = j->s[j->toks[root].start];
    if (c != '{' && c != '[')
        return jcs_scalar(j, &o, &j->toks[root]) ? GW_JCS_OK : GW_JCS_NOT_IJSON;
    size_t depth = 0, cap = 16;
    struct jcs_frame *st = cm_malloc(cap * sizeof *st);
    jcs_open(j, &o, root, &st[depth++]);
    bool ok = true;
    while (depth > 0 && ok) {
        struct jcs_frame *f = &st[depth - 1];
        if (f->pos == f->n) {
            o.put(o.arg, f->object ? "}" : "]", 1);
            free(f->kids);
            depth--;
            continue;
        }
        const struct jtok *t = f->kids[f->pos].t;
        if (f->pos++ > 0)
            o.put(o.arg, ",", 1);
        if (f->object) {
            ok = jcs_string(&o, j->s + t->key, t->keylen);
            o.put(o.arg, ":", 1);
        }
        c = j->s[t->start];
        if (c == '{' || c == '[') {
            if (depth == cap) {
                cap *= 2;
                st = cm_realloc(st, cap * sizeof *st);
            }
            jcs_open(j, &o, (size_t)(t - j->toks), &st[depth++]);
        } else {
            ok = ok && jcs_scalar(j, &o, t);
        }
    }
    while (depth > 0)
        free(st[--depth].kids);
    free(st);
    return ok ? GW_JCS_OK : GW_JCS_NOT_IJSON;
}

bool gw_json_string_utf8(const char *s, size_t n, char *out, size_t cap, size_t *len)
{
    if (n < 2 || s[0] != '"')
        return false;
    const unsigned char *p = (const unsigned char *)s + 1, *e = (const unsigned char *)s + n - 1;
    size_t o = 0;
    for (int32_t c; (c = jcp_next(&p, e)) >= 0;) {
        if (c >= 0xD800 && c <= 0xDFFF)
            return false;
        unsigned char b[4];
        unsigned k = utf8_encode((uint32_t)c, b);
        if (cap - o < k)
            return false;
        memcpy(out + o, b, k);
        o += k;
    }
    *len = o;
    return true;
}

bool gw_utf8_valid(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        size_t u = p[i] < 0x80 ? 1 : utf8_len(p + i, n - i);
        if (u == 0)
            return false;
        i += u;
    }
    return true;
}

void gw_json_destroy(struct gw_json *j)
{
    if (!j)
        return;
    free(j->toks);
    free(j);
}
