/* hints_test.c - gateway/hints: Prefer: wait read from a request (RFC 7240), Idempotency-Expires written. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "common/common.h"
#include "gateway/hints.h"

struct prefer_case {
    const char *fields[3]; /* Prefer field values, NULL-terminated */
    bool found;
    uint64_t secs;
};

static const struct prefer_case prefer_cases[] = {
    {{"wait=10", NULL}, true, 10},
    {{"WAIT=7", NULL}, true, 7},
    {{"respond-async, wait=5", NULL}, true, 5},
    {{"wait = 3 ; foo=bar", NULL}, true, 3},
    {{"wait=\"4\"", NULL}, true, 4},
    {{"handling=\"a,wait=9\", wait=2", NULL}, true, 2}, /* a comma inside a quoted string splits nothing */
    {{"return=minimal", "wait=6"}, true, 6},            /* a second Prefer field */
    {{"wait=abc, wait=8", NULL}, true, 8},              /* a bad value is skipped */
    {{"wait=0", NULL}, true, 0},
    {{"wait=99999999999999999999999", NULL}, true, GW_PREFER_WAIT_MAX_S},
    {{"wait", NULL}, false, 0},
    {{"wait=", NULL}, false, 0},
    {{"wait=-1", NULL}, false, 0},
    {{"wait=1.5", NULL}, false, 0},
    {{"wait=\"4", NULL}, false, 0},
    {{"waiting=4", NULL}, false, 0},
    {{"x-wait=4", NULL}, false, 0},
    {{"", NULL}, false, 0},
    {{NULL}, false, 0},
};

Test(hints, prefer_wait_table)
{
    for (size_t i = 0; i < sizeof prefer_cases / sizeof prefer_cases[0]; i++) {
        const struct prefer_case *c = &prefer_cases[i];
        struct cm_hdrs h;
        cm_hdrs_init(&h);
        cm_hdrs_add(&h, "Accept", "*/*");
        for (size_t f = 0; f < 3 && c->fields[f]; f++)
            cm_hdrs_add(&h, f ? "prefer" : "Prefer", c->fields[f]);
        uint64_t s = 12345;
        bool got = gw_prefer_wait(&h, &s);
        cr_expect_eq(got, c->found, "case %zu ('%s'): found %d", i, c->fields[0] ? c->fields[0] : "(none)", got);
        if (got && c->found)
            cr_expect_eq(s, c->secs, "case %zu ('%s'): %llu seconds, want %llu", i, c->fields[0], (unsigned long long)s,
                         (unsigned long long)c->secs);
        cm_hdrs_free(&h);
    }
}

Test(hints, imf_fixdate)
{
    char d[CM_IMF_FIXDATE_LEN + 1];
    cr_assert(cm_imf_fixdate(784111777, d)); /* RFC 9110 5.6.7's example */
    cr_expect_str_eq(d, "Sun, 06 Nov 1994 08:49:37 GMT");
    cr_assert(cm_imf_fixdate(0, d));
    cr_expect_str_eq(d, "Thu, 01 Jan 1970 00:00:00 GMT");
    cr_expect_not(cm_imf_fixdate(253402300800ull, d), "year 10000 has no IMF-fixdate");
}

Test(hints, expiry_replaces_the_upstreams_and_rounds_down)
{
    struct cm_resp r;
    cm_resp_init(&r, 0);
    cm_hdrs_add(&r.hdrs, "idempotency-expires", "Thu, 01 Jan 1970 00:00:00 GMT");
    cm_hdrs_add(&r.hdrs, "X-Other", "1");
    gw_expiry_advertise(&r, 784111777999ull - 3600000, 3600000); /* .999 s is dropped */
    size_t n = 0;
    for (size_t i = 0; i < r.hdrs.n; i++)
        n += strcasecmp(r.hdrs.v[i].name, "Idempotency-Expires") == 0;
    cr_expect_eq(n, 1);
    cr_expect_str_eq(cm_hdrs_get(&r.hdrs, "Idempotency-Expires"), "Sun, 06 Nov 1994 08:49:37 GMT");
    cr_expect_str_eq(cm_hdrs_get(&r.hdrs, "X-Other"), "1");
    cm_resp_free(&r);
}
