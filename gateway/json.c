/* json.c - one iterative validating pass indexing every value, and JSON Pointer look-ups; never copies the body. */
#include "gateway/json.h"

#include <stdint.h>
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
    if (cp < 0x80) {
        d->buf[0] = (unsigned char)cp;
        d->n = 1;
    } else if (cp < 0x800) {
        d->buf[0] = (unsigned char)(0xC0 | cp >> 6);
        d->buf[1] = (unsigned char)(0x80 | (cp & 0x3F));
        d->n = 2;
    } else if (cp < 0x10000) {
        d->buf[0] = (unsigned char)(0xE0 | cp >> 12);
        d->buf[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
        d->buf[2] = (unsigned char)(0x80 | (cp & 0x3F));
        d->n = 3;
    } else {
        d->buf[0] = (unsigned char)(0xF0 | cp >> 18);
        d->buf[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
        d->buf[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
        d->buf[3] = (unsigned char)(0x80 | (cp & 0x3F));
        d->n = 4;
    }
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

void gw_json_destroy(struct gw_json *j)
{
    if (!j)
        return;
    free(j->toks);
    free(j);
}
