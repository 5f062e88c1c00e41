/* fuzz_hdrs.c - libFuzzer target: cm_hdrs_strip_hop_by_hop removes exactly the hop-by-hop set and what Connection
 * names. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Independent reference: is name one of the comma-separated, OWS-trimmed tokens of list? */
static bool listed(const char *list, const char *name)
{
    size_t nlen = strlen(name);
    const char *p = list;
    for (;;) {
        const char *comma = strchr(p, ',');
        const char *end = comma ? comma : p + strlen(p);
        const char *s = p;
        while (s < end && (*s == ' ' || *s == '\t'))
            s++;
        const char *e = end;
        while (e > s && (e[-1] == ' ' || e[-1] == '\t'))
            e--;
        if ((size_t)(e - s) == nlen && nlen > 0 && strncasecmp(s, name, nlen) == 0)
            return true;
        if (!comma)
            return false;
        p = comma + 1;
    }
}

static const char *const HOP[] = {
    "Connection", "Keep-Alive",        "Proxy-Connection", "Proxy-Authenticate", "Proxy-Authorization", "TE",
    "Trailer",    "Transfer-Encoding", "Upgrade"};

static bool is_hop(const char *name)
{
    for (size_t i = 0; i < sizeof(HOP) / sizeof(HOP[0]); i++)
        if (strcasecmp(name, HOP[i]) == 0)
            return true;
    return false;
}

/* Input: lines "name:value" separated by '\n' or NUL; a line without ':' is a name with an empty value. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct cm_hdrs h;
    cm_hdrs_init(&h);
    const char *p = (const char *)data;
    const char *end = p + size;
    while (p < end && h.n < 256) {
        const char *eol = p;
        while (eol < end && *eol != '\n' && *eol != '\0')
            eol++;
        const char *colon = memchr(p, ':', (size_t)(eol - p));
        /* HTTP field names are 1*tchar: lines with an empty name are skipped. */
        if (colon && colon > p)
            cm_hdrs_addn(&h, p, (size_t)(colon - p), colon + 1, (size_t)(eol - colon - 1));
        else if (!colon && eol > p)
            cm_hdrs_addn(&h, p, (size_t)(eol - p), "", 0);
        p = eol + 1;
    }

    /* Expected survivors, computed independently, in order. */
    bool *keep = calloc(h.n ? h.n : 1, sizeof(bool));
    size_t nkeep = 0;
    for (size_t i = 0; i < h.n; i++) {
        bool drop = is_hop(h.v[i].name);
        for (size_t j = 0; j < h.n && !drop; j++)
            if (strcasecmp(h.v[j].name, "Connection") == 0 && listed(h.v[j].value, h.v[i].name))
                drop = true;
        keep[i] = !drop;
        nkeep += !drop;
    }
    struct cm_hdrs want;
    cm_hdrs_init(&want);
    for (size_t i = 0; i < h.n; i++)
        if (keep[i])
            cm_hdrs_add(&want, h.v[i].name, h.v[i].value);
    struct cm_hdrs orig;
    cm_hdrs_init(&orig);
    for (size_t i = 0; i < h.n; i++)
        cm_hdrs_add(&orig, h.v[i].name, h.v[i].value);

    cm_hdrs_strip_hop_by_hop(&h);

    for (size_t i = 0; i < h.n; i++) {
        if (is_hop(h.v[i].name) || cm_is_hop_by_hop(h.v[i].name))
            abort(); /* a hop-by-hop header survived */
        for (size_t j = 0; j < orig.n; j++)
            if (strcasecmp(orig.v[j].name, "Connection") == 0 && listed(orig.v[j].value, h.v[i].name))
                abort(); /* a header named in Connection survived */
    }
    if (h.n != nkeep)
        abort(); /* something else was removed (or kept) */
    for (size_t i = 0; i < h.n; i++)
        if (strcmp(h.v[i].name, want.v[i].name) != 0 || strcmp(h.v[i].value, want.v[i].value) != 0)
            abort(); /* order or content changed */
    free(keep);
    cm_hdrs_free(&want);
    cm_hdrs_free(&orig);
    cm_hdrs_free(&h);
    return 0;
}
