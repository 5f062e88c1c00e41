/* fuzz_conf.c - libFuzzer target: conf_load_string on arbitrary YAML never crashes or leaks. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "conf/conf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* An exact-size copy so that any read past len is an ASan error. */
    char *yaml = malloc(size ? size : 1);
    if (size)
        memcpy(yaml, data, size);
    char *err = NULL;
    struct conf *c = conf_load_string("fuzz.yaml", yaml, size, &err);
    if (c) {
        if (err)
            abort(); /* success leaves no error text */
        if (c->routes_n && !c->routes)
            abort();
        for (size_t i = 0; i < c->routes_n; i++)
            if (c->routes[i].upstream >= c->upstreams_n)
                abort();
        conf_destroy(c);
    } else if (!err || !*err) {
        abort(); /* a failure always explains itself */
    }
    free(err);
    free(yaml);
    return 0;
}
