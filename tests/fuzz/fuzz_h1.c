/* fuzz_h1.c - libFuzzer target: the built-in client's response parser (upstream/h1.c) on arbitrary upstream bytes,
 * fed in pieces. On every input: it never reports more body bytes than it was given, never accepts a head over its
 * cap, and every header it accepts has a token name and a value that passes cm_field_value_ok. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/common.h"
#include "upstream/h1.h"
#include "upstream/head.h"
#include "upstream/transfer.h"

#define FUZZ_MAX_HEAD 2048
#define FUZZ_MAX_BODY 65536

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    /* byte 0: HEAD or not, and the piece size (1..64) the rest arrives in; byte 1: a close after the last piece */
    bool head = (data[0] & 0x80) != 0;
    size_t piece = (size_t)(data[0] & 0x3f) + 1;
    bool eof = (data[1] & 1) != 0;
    data += 2;
    size -= 2;
    struct h1_parser *p = h1_parser_create(head, FUZZ_MAX_BODY, FUZZ_MAX_HEAD);
    int r = 0;
    size_t fed = 0;
    while (r == 0 && fed < size) {
        size_t n = size - fed < piece ? size - fed : piece;
        r = h1_parser_feed(p, data + fed, n, eof && fed + n == size);
        fed += n;
        if (h1_parser_resp(p)->body.len > fed)
            abort(); /* more body than bytes given */
    }
    if (r == 0 && eof && size == 0)
        r = h1_parser_feed(p, NULL, 0, true);
    if (r == 1) {
        const struct cm_resp *resp = h1_parser_resp(p);
        if (resp->status < 200 || resp->status > 599 || h1_parser_head_bytes(p) > FUZZ_MAX_HEAD)
            abort();
        if (head && resp->body.len != 0)
            abort();
        for (size_t i = 0; i < resp->hdrs.n; i++) {
            const char *name = resp->hdrs.v[i].name, *value = resp->hdrs.v[i].value;
            if (!cm_token_ok(name, strlen(name)) || !cm_field_value_ok(value, strlen(value)))
                abort();
            if (strcasecmp(name, "Idempotent-Replayed") == 0)
                abort();
        }
    }
    h1_parser_destroy(p);
    return 0;
}
