/* hints.c - Prefer: wait read from a request, Idempotency-Expires written on an answer (gateway/hints.h). */
#include "gateway/hints.h"

#include <string.h>
#include <strings.h>

#include "common/common.h"

static bool ows(char c)
{
    return c == ' ' || c == '\t';
}

static bool tchar(char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c != '\0' && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

/* One preference, s[0..n) (a list element, its parameters included): true with *out when it is a well-formed
 * wait preference. */
static bool wait_preference(const char *s, size_t n, uint64_t *out)
{
    size_t i = 0;
    while (i < n && ows(s[i]))
        i++;
    size_t t = i;
    while (i < n && tchar(s[i]))
        i++;
    if (i - t != 4 || strncasecmp(s + t, "wait", 4) != 0)
        return false;
    while (i < n && ows(s[i]))
        i++;
    if (i == n || s[i] != '=')
        return false;
    i++;
    while (i < n && ows(s[i]))
        i++;
    bool quoted = i < n && s[i] == '"';
    i += quoted;
    uint64_t v = 0;
    size_t d = i;
    for (; i < n && s[i] >= '0' && s[i] <= '9'; i++)
        v = v >= GW_PREFER_WAIT_MAX_S ? GW_PREFER_WAIT_MAX_S : v * 10 + (uint64_t)(s[i] - '0');
    if (i == d || (quoted && (i == n || s[i++] != '"')))
        return false;
    while (i < n && ows(s[i]))
        i++;
    if (i < n && s[i] != ';')
        return false; /* anything but parameters after the value */
    *out = v < GW_PREFER_WAIT_MAX_S ? v : GW_PREFER_WAIT_MAX_S;
    return true;
}

bool gw_prefer_wait(const struct cm_hdrs *in, uint64_t *wait_s)
{
    for (size_t h = 0; h < in->n; h++) {
        if (strcasecmp(in->v[h].name, "Prefer") != 0)
            continue;
        const char *s = in->v[h].value;
        size_t start = 0, i = 0;
        bool q = false;
        for (;; i++) { /* list elements end at a comma outside a quoted string (bounded by the value's NUL) */
            char c = s[i];
            if (c == '\\' && q && s[i + 1] != '\0') {
                i++;
                continue;
            }
            if (c == '"')
                q = !q;
            if (c == '\0' || (c == ',' && !q)) {
                if (wait_preference(s + start, i - start, wait_s))
                    return true;
                if (c == '\0')
                    break;
                start = i + 1;
            }
        }
    }
    return false;
}

void gw_expiry_advertise(struct cm_resp *resp, uint64_t now_wall_ms, uint64_t retention_ms)
{
    char date[CM_IMF_FIXDATE_LEN + 1];
    cm_hdrs_remove(&resp->hdrs, GW_EXPIRES_HEADER);
    if (retention_ms > UINT64_MAX - now_wall_ms || !cm_imf_fixdate((now_wall_ms + retention_ms) / 1000, date))
        return;
    cm_hdrs_add(&resp->hdrs, GW_EXPIRES_HEADER, date);
}
