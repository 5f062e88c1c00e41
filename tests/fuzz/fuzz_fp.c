/* fuzz_fp.c - libFuzzer target: gw_hash_parts on arbitrary parts never crashes, is deterministic and
 * ignores header-name case. */
#include <ctype.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/idem.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

struct rd {
    const uint8_t *p;
    size_t left;
};

static uint8_t byte(struct rd *r)
{
    if (!r->left)
        return 0;
    r->left--;
    return *r->p++;
}

/* A NUL-terminated heap string of up to the next byte's value bytes of input (NULs become 'x'). */
static char *str(struct rd *r)
{
    size_t n = byte(r);
    if (n > r->left)
        n = r->left;
    char *s = malloc(n + 1);
    for (size_t i = 0; i < n; i++)
        s[i] = r->p[i] ? (char)r->p[i] : 'x';
    s[n] = '\0';
    r->p += n;
    r->left -= n;
    return s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct rd r = {data, size};
    size_t nparts = byte(&r) % 9;
    struct conf_part parts[8];
    for (size_t i = 0; i < nparts; i++) {
        parts[i].kind = (enum conf_part_kind)(byte(&r) % 5);
        parts[i].header = parts[i].kind == CONF_PART_HEADER ? str(&r) : NULL;
    }
    char *method = str(&r), *path = str(&r), *query = str(&r);
    size_t nh = byte(&r) % 8;
    struct cm_hdrs h, h_case;
    cm_hdrs_init(&h);
    cm_hdrs_init(&h_case);
    for (size_t i = 0; i < nh; i++) {
        char *name = str(&r), *value = str(&r);
        cm_hdrs_add(&h, name, value);
        for (char *c = name; *c; c++) /* same list, names in another case */
            *c = (char)(islower((unsigned char)*c) ? toupper((unsigned char)*c) : tolower((unsigned char)*c));
        cm_hdrs_add(&h_case, name, value);
        free(name);
        free(value);
    }
    /* the rest is the body, binary as is */
    struct gw_reqparts req = {.method = method,
                              .path = path,
                              .query = query,
                              .body = r.left ? r.p : NULL,
                              .body_len = r.left,
                              .hdrs = &h,
                              .jwt = NULL};

    uint8_t a[32], b[32];
    gw_hash_parts(parts, nparts, &req, a);
    gw_hash_parts(parts, nparts, &req, b);
    if (memcmp(a, b, 32) != 0)
        abort();

    /* same content in fresh buffers */
    void *body_copy = r.left ? malloc(r.left) : NULL;
    if (body_copy)
        memcpy(body_copy, r.p, r.left);
    struct gw_reqparts req2 = req;
    req2.body = body_copy;
    req2.hdrs = &h_case;
    gw_hash_parts(parts, nparts, &req2, b);
    if (memcmp(a, b, 32) != 0)
        abort();

    free(body_copy);
    cm_hdrs_free(&h);
    cm_hdrs_free(&h_case);
    free(method);
    free(path);
    free(query);
    for (size_t i = 0; i < nparts; i++)
        free(parts[i].header);
    return 0;
}
