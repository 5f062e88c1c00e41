/* uri.c - request-target validation and normalisation, and the strict percent-decoder (see uri.h). Never I/O, never
 * another room. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/uri.h"

/* RFC 3986 2.3 */
static bool unreserved(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '.' ||
           c == '_' || c == '~';
}

/* Bytes never accepted raw in a target: control bytes, space, DEL, '#' (a fragment is never sent) and
 * non-ASCII. */
static bool target_byte_bad(unsigned char c)
{
    return c <= 0x20 || c >= 0x7f || c == '#';
}

/* The escape at s[i] ('%'): its value, or -1 when the two hex digits are missing. */
static int escape_at(const char *s, size_t n, size_t i)
{
    if (i + 2 >= n)
        return -1;
    int hi = cm_hexval((unsigned char)s[i + 1]), lo = cm_hexval((unsigned char)s[i + 2]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

bool cm_pct_decode(const char *s, size_t n, bool plus_space, char *out, size_t *out_len)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '%') {
            int v = escape_at(s, n, i);
            if (v <= 0) /* invalid, or %00 */
                return false;
            out[o++] = (char)v;
            i += 2;
        } else if (c == '\0') {
            return false;
        } else {
            out[o++] = plus_space && c == '+' ? ' ' : (char)c;
        }
    }
    out[o] = '\0';
    *out_len = o;
    return true;
}

/* Pass 1: checks the bytes and rewrites the escapes (decode unreserved, upper-case the others) into out. */
static bool path_decode(const char *p, size_t n, char *out, size_t *olen, const char **why)
{
    static const char hex[] = "0123456789ABCDEF";
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        if (target_byte_bad(c) || c == '\\' || c == '?') {
            *why = "the path holds a space, a control byte, DEL, '#', '\\' or a non-ASCII byte";
            return false;
        }
        if (c != '%') {
            out[o++] = (char)c;
            continue;
        }
        int v = escape_at(p, n, i);
        if (v < 0) {
            *why = "the path holds invalid percent-encoding";
            return false;
        }
        if (v == 0 || v == '/') {
            *why = "the path holds %00 or an encoded '/'";
            return false;
        }
        i += 2;
        if (unreserved((unsigned char)v)) {
            out[o++] = (char)v;
        } else {
            out[o++] = '%';
            out[o++] = hex[v >> 4];
            out[o++] = hex[v & 15];
        }
    }
    *olen = o;
    return true;
}

bool cm_path_normalize(const char *p, size_t n, char *out, size_t *out_len, const char **why)
{
    *why = NULL;
    if (n == 0 || p[0] != '/') {
        *why = "the path must start with '/'";
        return false;
    }
    char *dec = cm_malloc(n + 1);
    size_t dn = 0;
    if (!path_decode(p, n, dec, &dn, why)) {
        free(dec);
        return false;
    }
    /* Pass 2 (RFC 3986 5.2.4 on a path without empty segments): out holds "/seg/seg" and never ends in '/'
     * while it is built, so ".." drops what follows the last '/'. */
    size_t o = 0;
    bool trailing = false;
    for (size_t i = 1; i <= dn;) {
        size_t j = i;
        while (j < dn && dec[j] != '/')
            j++;
        const char *seg = dec + i;
        size_t sl = j - i;
        bool last = j >= dn;
        trailing = last && (sl == 0 || (sl == 1 && seg[0] == '.') || (sl == 2 && seg[0] == '.' && seg[1] == '.'));
        if (sl == 2 && seg[0] == '.' && seg[1] == '.') {
            if (o == 0) {
                free(dec);
                *why = "the path escapes the root";
                return false;
            }
            while (o > 0 && out[o - 1] != '/')
                o--;
            o--; /* the '/' before the dropped segment */
        } else if (sl > 0 && !(sl == 1 && seg[0] == '.')) {
            out[o++] = '/';
            memcpy(out + o, seg, sl);
            o += sl;
        }
        i = j + 1;
    }
    free(dec);
    if (o == 0 || trailing)
        out[o++] = '/';
    out[o] = '\0';
    *out_len = o;
    return true;
}

bool cm_query_ok(const char *q, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (target_byte_bad((unsigned char)q[i]))
            return false;
    return true;
}

void cm_target_free(struct cm_target *t)
{
    free(t->uri);
    free(t->path);
    free(t->query);
    memset(t, 0, sizeof *t);
}

/* Length of "http://" or "https://" (any case) at the start of t, else 0. */
static size_t scheme_len(const char *t, size_t n)
{
    if (n >= 7 && strncasecmp(t, "http://", 7) == 0)
        return 7;
    if (n >= 8 && strncasecmp(t, "https://", 8) == 0)
        return 8;
    return 0;
}

enum cm_target_result cm_target_parse(const char *t, size_t n, size_t max, struct cm_target *out, const char **why)
{
    memset(out, 0, sizeof *out);
    if (n > max) {
        *why = "the request target is too long";
        return CM_TARGET_TOO_LONG;
    }
    size_t start = 0, sl = scheme_len(t, n);
    if (sl) { /* absolute-form: the authority is never used */
        start = sl;
        while (start < n && t[start] != '/' && t[start] != '?') {
            if (target_byte_bad((unsigned char)t[start])) {
                *why = "the request target's authority holds a space, a control byte or a non-ASCII byte";
                return CM_TARGET_BAD;
            }
            start++;
        }
    } else if (n == 0 || t[0] != '/') {
        *why = "the request target must start with '/' (origin-form) or http:// (absolute-form)";
        return CM_TARGET_BAD;
    }
    const char *qm = memchr(t + start, '?', n - start);
    size_t pend = qm ? (size_t)(qm - t) : n;
    size_t plen = pend - start;
    char *path = cm_malloc(plen + 2);
    size_t olen = 0;
    if (plen == 0) { /* "http://host" or "http://host?q" */
        path[0] = '/';
        path[1] = '\0';
        olen = 1;
    } else if (!cm_path_normalize(t + start, plen, path, &olen, why)) {
        free(path);
        return CM_TARGET_BAD;
    }
    const char *q = qm ? qm + 1 : "";
    size_t qlen = qm ? n - (pend + 1) : 0;
    if (!cm_query_ok(q, qlen)) {
        free(path);
        *why = "the query holds a space, a control byte, DEL, '#' or a non-ASCII byte";
        return CM_TARGET_BAD;
    }
    out->path = path;
    out->query = cm_strndup(q, qlen);
    out->uri = qm ? cm_asprintf("%s?%s", path, out->query) : cm_strdup(path);
    *why = NULL;
    return CM_TARGET_OK;
}

bool cm_host_ok(const char *h, size_t n)
{
    size_t end = n; /* the host part ends at the port's ':' (after the ']' of an IPv6 literal) */
    if (n > 0 && h[0] == '[') {
        const char *rb = memchr(h, ']', n);
        if (!rb || rb == h + 1 || (size_t)(rb - h) > INET6_ADDRSTRLEN)
            return false;
        char a[INET6_ADDRSTRLEN + 1];
        size_t al = (size_t)(rb - h) - 1;
        memcpy(a, h + 1, al);
        a[al] = '\0';
        struct in6_addr in6;
        if (inet_pton(AF_INET6, a, &in6) != 1)
            return false;
        end = (size_t)(rb - h) + 1;
        if (end < n && h[end] != ':')
            return false;
    } else {
        const char *colon = memchr(h, ':', n);
        end = colon ? (size_t)(colon - h) : n;
        if (end == 0)
            return false;
        for (size_t i = 0; i < end; i++) {
            unsigned char c = (unsigned char)h[i];
            if (!((c | 0x20) >= 'a' && (c | 0x20) <= 'z') && !(c >= '0' && c <= '9') && c != '-' && c != '.' &&
                c != '_' && c != '~')
                return false;
        }
    }
    if (end == n)
        return true;
    uint64_t port; /* after the ':' */
    return cm_parse_digits(h + end + 1, n - end - 1, 5, &port) && port <= 65535;
}

size_t cm_path_match_form(const char *p, size_t n, char *out)
{
    size_t o = 0;
    bool param = false; /* inside a segment's parameters, up to its end */
    for (size_t i = 0; i < n; i++) {
        char c = p[i];
        if (c == '/')
            param = false;
        else if (c == ';' || (c == '%' && i + 2 < n && p[i + 1] == '3' && (p[i + 2] | 0x20) == 'b'))
            param = true; /* %3B too: an upstream may decode it before it drops parameters */
        if (param)
            continue;
        out[o++] = c >= 'A' && c <= 'Z' ? (char)(c + 32) : c;
    }
    if (o > 1 && out[o - 1] == '/')
        o--; /* a trailing '/' is ignored */
    out[o] = '\0';
    return o;
}

bool cm_path_meets(const char *rk, const char *k, bool prefix)
{
    size_t n = strlen(rk);
    if (prefix && n == 1 && rk[0] == '/')
        return true;
    if (strncmp(k, rk, n) != 0)
        return false;
    if (k[n] == '\0' || (prefix && k[n] == '/'))
        return true;
    /* a format suffix on the last segment: rk's last segment is a name, k goes on with '.' and no other segment */
    return n > 0 && rk[n - 1] != '/' && k[n] == '.' && strchr(k + n, '/') == NULL;
}
