/* fuzz_prefer.c - libFuzzer target: gw_prefer_wait reads any Prefer field values without reading past them; a wait
 * it finds is within the cap and was written in the input. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/common.h"
#include "gateway/hints.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 4096)
        return 0;
    /* the input is one or more field values separated by '\n' (a NUL ends a value, as in a parsed header) */
    char *text = malloc(size + 1);
    if (!text)
        return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    struct cm_hdrs h;
    cm_hdrs_init(&h);
    for (char *line = text, *next; line; line = next) {
        next = strchr(line, '\n');
        if (next)
            *next++ = '\0';
        cm_hdrs_add(&h, "Prefer", line);
    }
    uint64_t s = 0;
    if (gw_prefer_wait(&h, &s)) {
        if (s > GW_PREFER_WAIT_MAX_S)
            abort();
        bool named = false; /* a wait found must have been written */
        for (size_t i = 0; i + 4 <= size && !named; i++)
            named = strncasecmp((const char *)data + i, "wait", 4) == 0;
        if (!named)
            abort();
    }
    cm_hdrs_free(&h);
    free(text);
    return 0;
}
