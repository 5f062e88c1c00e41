/* head.c - the rules both backends apply to an upstream's answer head and to a request's header names and values;
 * pure checks, never I/O, never a backend. */
#include "upstream/head.h"
#include "upstream/transfer.h"

#include <string.h>
#include <strings.h>

static bool up_is_ws(char ch)
{
    return ch == ' ' || ch == '\t';
}

bool up_invalid(struct up_transfer *t, const char *why)
{
    t->invalid = true;
    t->invalid_why = why;
    return false;
}

bool up_status_line(struct up_transfer *t, const char *p, size_t len)
{
    /* a new response head (after 100 Continue, or a retried send): start over */
    cm_hdrs_free(&t->resp.hdrs);
    cm_hdrs_init(&t->resp.hdrs);
    t->hdr_bytes = len + 2;
    t->hdrs_final = false;
    if (t->hdr_bytes > t->max_head)
        return up_invalid(t, "response head over max_response_header_bytes");
    if (!cm_field_value_ok(p, len))
        return up_invalid(t, "control byte in the status line");
    const char *sp = memchr(p, ' ', len);
    t->resp.status = 0;
    if (sp != NULL && (size_t)(sp - p) + 4 <= len) {
        int st = 0;
        for (int i = 1; i <= 3 && sp[i] >= '0' && sp[i] <= '9'; i++)
            st = st * 10 + (sp[i] - '0');
        t->resp.status = st;
    }
    return true;
}

bool up_status_form_ok(const char *p, size_t n)
{
    return n >= 12 && memcmp(p, "HTTP/1.", 7) == 0 && (p[7] == '0' || p[7] == '1') && p[8] == ' ' && p[9] >= '1' &&
           p[9] <= '5' && p[10] >= '0' && p[10] <= '9' && p[11] >= '0' && p[11] <= '9' && (n == 12 || p[12] == ' ');
}

bool up_header_split(const char *p, size_t len, size_t *name_len, const char **value, size_t *value_len)
{
    const char *colon = memchr(p, ':', len);
    if (colon == NULL)
        return false;
    size_t nl = (size_t)(colon - p);
    const char *v = colon + 1;
    size_t vl = len - nl - 1;
    while (vl > 0 && (*v == ' ' || *v == '\t')) {
        v++;
        vl--;
    }
    while (vl > 0 && (v[vl - 1] == ' ' || v[vl - 1] == '\t'))
        vl--;
    *name_len = nl;
    *value = v;
    *value_len = vl;
    return true;
}

bool up_content_length(const char *v, size_t vl, bool *have, uint64_t *length)
{
    uint64_t x;
    if (!cm_parse_digits(v, vl, 19, &x) || (*have && *length != x))
        return false;
    *have = true;
    *length = x;
    return true;
}

bool up_header_line(struct up_transfer *t, const char *p, size_t len)
{
    if (len == 0) {
        if (t->resp.status >= 200)
            t->hdrs_final = true;
        return true;
    }
    if (t->hdrs_final)
        return true; /* a trailer after a chunked body: not part of the stored head */
    t->hdr_bytes += len + 2;
    if (t->hdr_bytes > t->max_head)
        return up_invalid(t, "response head over max_response_header_bytes");
    /* obs-fold (RFC 9112 5.2: a proxy may reject it): the front would have to rewrite the value */
    if (up_is_ws(p[0]))
        return up_invalid(t, "obs-fold line in the response head");
    const char *colon = memchr(p, ':', len);
    if (colon == NULL)
        return up_invalid(t, "response header line without a colon");
    /* no whitespace before the colon either (RFC 9112 5.1): the name must be a token as it stands */
    size_t nlen = (size_t)(colon - p);
    if (!cm_token_ok(p, nlen))
        return up_invalid(t, "response header name is not a token");
    const char *v = colon + 1;
    size_t vlen = len - (size_t)(v - p);
    while (vlen > 0 && up_is_ws(*v)) {
        v++;
        vlen--;
    }
    while (vlen > 0 && up_is_ws(v[vlen - 1]))
        vlen--;
    if (!cm_field_value_ok(v, vlen))
        return up_invalid(t, "control byte in a response header value");
    /* the gateway's own marker: a replay carries exactly one, and it is never the upstream's */
    if (nlen == sizeof UP_REPLAYED_HDR - 1 && strncasecmp(p, UP_REPLAYED_HDR, nlen) == 0)
        return true;
    cm_hdrs_addn(&t->resp.hdrs, p, nlen, v, vlen);
    return true;
}

bool up_token_ok(const char *s, size_t *len)
{
    *len = strlen(s);
    return cm_token_ok(s, *len);
}

bool up_value_ok(const char *s, size_t *len)
{
    *len = strlen(s);
    return cm_field_value_ok(s, *len);
}

/* The length and framing are the backend's (from the body it sends), hop-by-hop headers never travel. One compare
 * for most names (dispatch on the first letter). */
enum up_hdr_kind up_hdr_kind(const char *name)
{
    switch (name[0] | 0x20) {
    case 'a':
        return strcasecmp(name, "Accept") == 0 ? UP_HDR_ACCEPT : UP_HDR_SEND;
    case 'c':
        if (strcasecmp(name, "Content-Length") == 0)
            return UP_HDR_SKIP;
        if (strcasecmp(name, "Content-Type") == 0)
            return UP_HDR_CTYPE;
        break;
    case 'e':
        return strcasecmp(name, "Expect") == 0 ? UP_HDR_SKIP : UP_HDR_SEND;
    default:
        break;
    }
    return cm_is_hop_by_hop(name) ? UP_HDR_SKIP : UP_HDR_SEND;
}
