/* fuzz_resp.c - libFuzzer target: cm_resp_decode on arbitrary bytes; an accepted blob re-encodes byte-identically. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct cm_resp r;
    bool ok = cm_resp_decode(data, size, &r);
    if (!ok) {
        cm_resp_free(&r);
        return 0;
    }
    if (r.status < 100 || r.status > 999 || r.body.len > size)
        abort();

    struct cm_buf out;
    cm_buf_init(&out, size);
    if (!cm_resp_encode(&r, &out))
        abort();
    if (out.len != size || memcmp(out.data, data, size) != 0)
        abort();

    /* and decoding the encoding gives the same response again */
    struct cm_resp r2;
    if (!cm_resp_decode(out.data, out.len, &r2))
        abort();
    if (r2.status != r.status || r2.hdrs.n != r.hdrs.n || r2.body.len != r.body.len)
        abort();
    for (size_t i = 0; i < r.hdrs.n; i++)
        if (strcmp(r.hdrs.v[i].name, r2.hdrs.v[i].name) != 0 || strcmp(r.hdrs.v[i].value, r2.hdrs.v[i].value) != 0)
            abort();
    if (r.body.len && memcmp(r.body.data, r2.body.data, r.body.len) != 0)
        abort();
    cm_resp_free(&r2);
    cm_buf_free(&out);
    cm_resp_free(&r);
    return 0;
}
