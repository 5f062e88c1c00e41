/* identity.c - a route's identity as one text (name aside), and what differs between two of them. Never YAML, never
 * I/O. */
#include "conf/identity.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "conf/conf.h"

#define IDENTITY_MAX 8192 /* a route's parts are few and short; over this the config is not one anybody writes */

static bool part_append(struct cm_buf *b, const struct conf_part *p)
{
    switch (p->kind) {
    case CONF_PART_METHOD:
        return cm_buf_appendf(b, "method");
    case CONF_PART_PATH:
        return cm_buf_appendf(b, "path");
    case CONF_PART_QUERY:
        return cm_buf_appendf(b, "query");
    case CONF_PART_BODY:
        return cm_buf_appendf(b, "body");
    case CONF_PART_JWT:
        return cm_buf_appendf(b, "jwt:%s", p->header);
    case CONF_PART_JSON:
        return cm_buf_appendf(b, "json:%s", p->header);
    case CONF_PART_FORM:
        return cm_buf_appendf(b, "form:%s", p->header);
    case CONF_PART_QPARAM:
        return cm_buf_appendf(b, "query:%s", p->header);
    case CONF_PART_HEADER: {
        if (!cm_buf_appendf(b, "header:"))
            return false;
        for (const char *c = p->header; *c; c++) {
            char lc = (char)tolower((unsigned char)*c);
            if (!cm_buf_append(b, &lc, 1))
                return false;
        }
        return true;
    }
    }
    return false;
}

static bool parts_append(struct cm_buf *b, const char *label, const struct conf_part *parts, size_t n)
{
    if (!cm_buf_appendf(b, " %s=", label))
        return false;
    for (size_t i = 0; i < n; i++)
        if ((i && !cm_buf_append(b, ",", 1)) || !part_append(b, &parts[i]))
            return false;
    return true;
}

char *conf_route_identity(const struct conf_route *r)
{
    if (r->idem.key == CONF_KEY_OFF)
        return NULL;
    struct cm_buf b;
    cm_buf_init(&b, IDENTITY_MAX);
    struct conf_part key = {.kind = CONF_PART_HEADER, .header = r->idem.header ? r->idem.header : "Idempotency-Key"};
    if (r->idem.key_from.header) /* key_from: header:NAME set header to NAME: the same identity as header: NAME */
        key = r->idem.key_from;
    bool ok = cm_buf_appendf(&b, "key=") && part_append(&b, &key) &&
              parts_append(&b, "scope", r->idem.scope, r->idem.scope_n) &&
              parts_append(&b, "fingerprint", r->idem.fingerprint, r->idem.fingerprint_n);
    if (!ok) {
        cm_buf_free(&b);
        return cm_strdup("unrepresentable");
    }
    size_t n;
    char *s = cm_buf_take(&b, &n);
    cm_buf_free(&b);
    return s;
}

/* The value of "label=" in an identity (up to the next space), as [*v, *v + *len). */
static void field(const char *id, const char *label, const char **v, size_t *len)
{
    size_t ll = strlen(label);
    for (const char *p = id; p && *p; p = strchr(p, ' ') ? strchr(p, ' ') + 1 : NULL) {
        if (strncmp(p, label, ll) == 0 && p[ll] == '=') {
            *v = p + ll + 1;
            *len = strcspn(*v, " ");
            return;
        }
    }
    *v = "";
    *len = 0;
}

void conf_identity_diff(const char *a, const char *b, char *out, size_t n)
{
    static const char *const labels[] = {"key", "scope", "fingerprint"};
    size_t used = 0;
    if (n)
        out[0] = '\0';
    for (size_t i = 0; i < sizeof labels / sizeof labels[0]; i++) {
        const char *va, *vb;
        size_t la, lb;
        field(a, labels[i], &va, &la);
        field(b, labels[i], &vb, &lb);
        if (la == lb && memcmp(va, vb, la) == 0)
            continue;
        int w = snprintf(out + used, n - used, "%s%s", used ? "," : "", labels[i]);
        if (w < 0 || (size_t)w >= n - used)
            return;
        used += (size_t)w;
    }
}
