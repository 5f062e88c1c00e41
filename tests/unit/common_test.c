/* common_test.c - capped buffers, header lists, hop-by-hop filtering, response codec, log quoting. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"

Test(buf, cap_is_enforced)
{
    struct cm_buf b;
    cm_buf_init(&b, 8);
    cr_assert(cm_buf_append(&b, "12345", 5));
    cr_assert(cm_buf_append(&b, "678", 3));
    cr_assert_not(cm_buf_append(&b, "9", 1), "appending past the cap must fail");
    cr_assert_eq(b.len, 8);
    cr_assert_str_eq(b.data, "12345678");
    cr_assert_not(cm_buf_append(&b, "x", (size_t)-1));
    size_t n;
    char *p = cm_buf_take(&b, &n);
    cr_assert_eq(n, 8);
    cr_assert_null(b.data);
    free(p);
    cm_buf_free(&b);
}

Test(buf, appendf_grows_past_small_buffer)
{
    struct cm_buf b;
    cm_buf_init(&b, 4096);
    char big[1000];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    cr_assert(cm_buf_appendf(&b, "%s-%d", big, 42));
    cr_assert_eq(b.len, 999 + 3);
    cr_assert_str_eq(b.data + 999, "-42");
    cm_buf_free(&b);
}

Test(hdrs, get_is_case_insensitive_and_remove_counts)
{
    struct cm_hdrs h;
    cm_hdrs_init(&h);
    cm_hdrs_add(&h, "Set-Cookie", "a=1");
    cm_hdrs_add(&h, "set-cookie", "b=2");
    cm_hdrs_add(&h, "X-A", "1");
    cr_assert_str_eq(cm_hdrs_get(&h, "SET-COOKIE"), "a=1");
    cr_assert_eq(cm_hdrs_remove(&h, "Set-Cookie"), 2);
    cr_assert_eq(h.n, 1);
    cr_assert_null(cm_hdrs_get(&h, "set-cookie"));
    cm_hdrs_free(&h);
}

/* Strings of every size, across the list's chunks (small ones, ones over a chunk, empty ones, embedded NULs in
 * the length form), stay whole and in order through removals until the list is freed (ASan checks the bounds). */
Test(hdrs, strings_stay_whole_across_chunks)
{
    struct cm_hdrs h;
    cm_hdrs_init(&h);
    static char big[20000];
    memset(big, 'v', sizeof big - 1);
    char name[32], want[64];
    for (int i = 0; i < 600; i++) {
        snprintf(name, sizeof name, "X-H%d", i);
        if (i % 97 == 5) {
            size_t n = (size_t)(i * 31) % (sizeof big - 1) + 1;
            cm_hdrs_addn(&h, name, strlen(name), big, n);
        } else if (i % 13 == 0) {
            cm_hdrs_add(&h, name, "");
        } else {
            snprintf(want, sizeof want, "value-%d-%0*d", i, i % 40, 7);
            cm_hdrs_add(&h, name, want);
        }
    }
    cr_assert_eq(cm_hdrs_remove(&h, "X-H7"), 1);
    cr_assert_eq(h.n, 599);
    for (int i = 0, k = 0; i < 600; i++) {
        if (i == 7)
            continue;
        snprintf(name, sizeof name, "X-H%d", i);
        cr_assert_str_eq(h.v[k].name, name);
        if (i % 97 == 5) {
            size_t n = (size_t)(i * 31) % (sizeof big - 1) + 1;
            cr_assert_eq(strlen(h.v[k].value), n, "%s", name);
            cr_assert_eq(memcmp(h.v[k].value, big, n), 0);
        } else if (i % 13 == 0) {
            cr_assert_str_eq(h.v[k].value, "");
        } else {
            snprintf(want, sizeof want, "value-%d-%0*d", i, i % 40, 7);
            cr_assert_str_eq(h.v[k].value, want);
        }
        k++;
    }
    cm_hdrs_add(&h, "Connection", "X-H1, X-H2");
    cm_hdrs_strip_hop_by_hop(&h);
    cr_assert_eq(h.n, 597);
    cr_assert_null(cm_hdrs_get(&h, "X-H1"));
    snprintf(want, sizeof want, "value-%d-%0*d", 599, 599 % 40, 7);
    cr_assert_str_eq(cm_hdrs_get(&h, "X-H599"), want);
    cm_hdrs_free(&h);
    cr_assert_eq(h.n, 0);
    cr_assert_null(h.v);
    cm_hdrs_add(&h, "A", "b"); /* usable again after free */
    cr_assert_str_eq(cm_hdrs_get(&h, "a"), "b");
    cm_hdrs_free(&h);
}

struct hop_case {
    const char *name;
    const char *value;
    bool kept;
};

Test(hdrs, strip_hop_by_hop_and_connection_named)
{
    static const struct hop_case cases[] = {
        {"Connection", "keep-alive, X-Hop,  x-other ", false},
        {"Keep-Alive", "timeout=5", false},
        {"Transfer-Encoding", "chunked", false},
        {"TE", "trailers", false},
        {"Trailer", "X", false},
        {"Upgrade", "h2c", false},
        {"Proxy-Authorization", "Basic x", false},
        {"Proxy-Authenticate", "Basic", false},
        {"Proxy-Connection", "keep-alive", false},
        {"X-Hop", "secret", false},
        {"X-Other", "gone", false},
        {"X-Hopper", "stays", true},
        {"Content-Type", "text/plain", true},
        {"Set-Cookie", "a=1", true},
        {"Set-Cookie", "b=2", true},
    };
    size_t n = sizeof cases / sizeof cases[0];
    struct cm_hdrs h;
    cm_hdrs_init(&h);
    for (size_t i = 0; i < n; i++)
        cm_hdrs_add(&h, cases[i].name, cases[i].value);
    cm_hdrs_strip_hop_by_hop(&h);
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        if (!cases[i].kept)
            continue;
        cr_assert_lt(j, h.n);
        cr_assert_str_eq(h.v[j].name, cases[i].name, "order kept");
        cr_assert_str_eq(h.v[j].value, cases[i].value);
        j++;
    }
    cr_assert_eq(j, h.n, "only the end-to-end headers remain");
    cm_hdrs_free(&h);
}

Test(resp, encode_decode_round_trip_binary)
{
    struct cm_resp r, d;
    cm_resp_init(&r, 1 << 20);
    r.status = 201;
    cm_hdrs_add(&r.hdrs, "Set-Cookie", "a=1");
    cm_hdrs_add(&r.hdrs, "Set-Cookie", "b=2");
    cm_hdrs_add(&r.hdrs, "X-Empty", "");
    const char body[] = {'a', 0, 'b', (char)0xff, 0};
    cr_assert(cm_buf_append(&r.body, body, sizeof body));
    struct cm_buf out;
    cm_buf_init(&out, 1 << 20);
    cr_assert(cm_resp_encode(&r, &out));
    cr_assert(cm_resp_decode(out.data, out.len, &d));
    cr_assert_eq(d.status, 201);
    cr_assert_eq(d.hdrs.n, 3);
    cr_assert_str_eq(d.hdrs.v[1].value, "b=2");
    cr_assert_str_eq(d.hdrs.v[2].value, "");
    cr_assert_eq(d.body.len, sizeof body);
    cr_assert_eq(memcmp(d.body.data, body, sizeof body), 0);
    /* every truncation is rejected, never crashes */
    for (size_t cut = 0; cut < out.len; cut++) {
        struct cm_resp t;
        cr_assert_not(cm_resp_decode(out.data, cut, &t), "truncated at %zu accepted", cut);
        cm_resp_free(&t);
    }
    cm_buf_free(&out);
    cm_resp_free(&r);
    cm_resp_free(&d);
    cr_assert_not(cm_resp_decode("", 0, &d), "empty accepted");
    cm_resp_free(&d);
}

Test(resp, encode_respects_cap)
{
    struct cm_resp r;
    cm_resp_init(&r, 100);
    r.status = 200;
    cr_assert(cm_buf_append(&r.body, "0123456789", 10));
    struct cm_buf out;
    cm_buf_init(&out, 12);
    cr_assert_not(cm_resp_encode(&r, &out));
    cm_buf_free(&out);
    cm_resp_free(&r);
}

Test(log, quote_escapes_and_truncates)
{
    char out[32];
    cr_assert_str_eq(cm_log_quote(out, sizeof out, "a \"b\"\n\x01"), "\"a \\\"b\\\"\\n\\x01\"");
    char small[8];
    cm_log_quote(small, sizeof small, "abcdefghijkl");
    cr_assert_eq(strlen(small), 7);
    cr_assert_eq(small[6], '"');
}

Test(log, redact_url_password)
{
    char out[256];
    cr_assert_str_eq(cm_redact_url(out, sizeof out, "postgresql://user:s3cret@127.0.0.1:5432/db"),
                     "postgresql://user:***@127.0.0.1:5432/db");
    cr_assert_str_eq(cm_redact_url(out, sizeof out, "redis://:pw@127.0.0.1:6379/0"), "redis://:***@127.0.0.1:6379/0");
    cr_assert_str_eq(cm_redact_url(out, sizeof out, "host=x password=abc dbname=y"), "host=x password=*** dbname=y");
    cr_assert_str_eq(cm_redact_url(out, sizeof out, "postgresql://user@h/db"), "postgresql://user@h/db");
}

/* The forms libpq also takes: a quoted value with spaces and escapes, spaces around '=', a URL's query
 * parameter, sslpassword, several of them. Each used to leak (the quoted one from its first space on). */
Test(log, redact_every_password_form)
{
    char out[512];
    cr_expect_str_eq(cm_redact_url(out, sizeof out, "host=x password='a b\\' c' dbname=y"),
                     "host=x password=*** dbname=y");
    cr_expect_str_eq(cm_redact_url(out, sizeof out, "host=x password = s3cret dbname=y"),
                     "host=x password = *** dbname=y");
    cr_expect_str_eq(cm_redact_url(out, sizeof out, "postgresql://h/db?user=u&password=s3cret&sslmode=disable"),
                     "postgresql://h/db?user=u&password=***&sslmode=disable");
    cr_expect_str_eq(cm_redact_url(out, sizeof out, "host=x sslpassword=k1 password=k2"),
                     "host=x sslpassword=*** password=***");
    cr_expect_str_eq(cm_redact_url(out, sizeof out, "host=x password='unterminated"), "host=x password=***");
    char small[16];
    cr_expect_str_eq(cm_redact_url(small, sizeof small, "password=abcdefghijklmnopqrstuvwxyz"), "password=***");
}

Test(hash, sha256_known_vector_and_parts)
{
    uint8_t d[32];
    char hex[65];
    cm_sha256("abc", 3, d);
    cm_hex(d, 32, hex);
    cr_assert_str_eq(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    uint8_t a[32], b[32];
    struct cm_sha256 h;
    cm_sha256_init(&h);
    cm_sha256_part(&h, "ab", 2);
    cm_sha256_part(&h, "c", 1);
    cm_sha256_final(&h, a);
    cm_sha256_init(&h);
    cm_sha256_part(&h, "a", 1);
    cm_sha256_part(&h, "bc", 2);
    cm_sha256_final(&h, b);
    cr_assert_neq(memcmp(a, b, 32), 0, "length prefix separates parts");
}

/* The thread's spare context: reused after a finished hash, and two hashes at once each get their own. */
Test(hash, sha256_contexts_reused_and_interleaved)
{
    static const char abc[] = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
    static const char empty[] = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
    char hex[65];
    uint8_t d[32];
    for (int i = 0; i < 3; i++) {
        cm_sha256("abc", 3, d);
        cm_hex(d, 32, hex);
        cr_assert_str_eq(hex, abc, "round %d", i);
    }
    struct cm_sha256 x, y;
    uint8_t dx[32], dy[32];
    cm_sha256_init(&x);
    cm_sha256_init(&y);
    cm_sha256_update(&x, "a", 1);
    cm_sha256_update(&x, "bc", 2);
    cm_sha256_final(&y, dy);
    cm_sha256_final(&x, dx);
    cm_hex(dx, 32, hex);
    cr_expect_str_eq(hex, abc);
    cm_hex(dy, 32, hex);
    cr_expect_str_eq(hex, empty);
}

Test(misc, consttime_eq_and_token)
{
    cr_assert(cm_consttime_eq("abc", 3, "abc", 3));
    cr_assert_not(cm_consttime_eq("abc", 3, "abd", 3));
    cr_assert_not(cm_consttime_eq("abc", 3, "abcd", 4));
    uint64_t t1 = cm_random_token(), t2 = cm_random_token();
    cr_assert_neq(t1, 0);
    cr_assert_neq(t1, t2);
    cr_assert_leq(t1, (uint64_t)INT64_MAX);
}

#define NTOK 1000 /* several refills of the per-thread block */

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void *draw(void *arg)
{
    uint64_t *out = arg;
    for (int i = 0; i < NTOK; i++)
        out[i] = cm_random_token();
    return NULL;
}

/* Tokens from the buffered blocks: never 0, 63 bits, never the same twice, in one thread or across two. */
Test(misc, tokens_are_distinct_across_refills_and_threads)
{
    static uint64_t v[2 * NTOK];
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, draw, v + NTOK), 0);
    draw(v);
    pthread_join(th, NULL);
    for (int i = 0; i < 2 * NTOK; i++) {
        cr_assert_neq(v[i], 0);
        cr_assert_leq(v[i], (uint64_t)INT64_MAX);
    }
    qsort(v, 2 * NTOK, sizeof v[0], cmp_u64);
    for (int i = 1; i < 2 * NTOK; i++)
        cr_assert_neq(v[i], v[i - 1], "token drawn twice");
}

Test(common, parse_digits)
{
    uint64_t v = 7;
    cr_assert(cm_parse_digits("8080", 4, 5, &v) && v == 8080);
    cr_assert(cm_parse_digits("00080", 5, 5, &v) && v == 80);
    cr_assert(cm_parse_digits("9999999999999999999", 19, 19, &v) && v == 9999999999999999999ull);
    v = 7;
    cr_assert(!cm_parse_digits("000080", 6, 5, &v), "more digits than allowed");
    cr_assert(!cm_parse_digits("", 0, 5, &v), "empty");
    cr_assert(!cm_parse_digits("12a", 3, 5, &v), "not a digit");
    cr_assert(!cm_parse_digits("+12", 3, 5, &v), "a sign");
    cr_assert(!cm_parse_digits(" 12", 3, 5, &v), "a space");
    cr_assert(!cm_parse_digits("12345678901234567890", 20, 20, &v), "over 19 digits");
    cr_assert_eq(v, 7, "a refused input leaves *out alone");
}

Test(common, http_token_and_field_value)
{
    cr_assert(cm_token_ok("X-Request-Id", 12));
    cr_assert(cm_token_ok("!#$%&'*+-.^_`|~09az", 19));
    cr_assert(!cm_token_ok("", 0), "empty");
    cr_assert(!cm_token_ok("X A", 3), "space");
    cr_assert(!cm_token_ok("X:A", 3), "colon");
    cr_assert(!cm_token_ok("X\"A", 3), "quote");
    cr_assert(!cm_token_ok("X\0A", 3), "NUL");
    cr_assert(!cm_token_ok("X\x80", 2), "obs-text");
    cr_assert(!cm_token_ok("(A)", 3), "separator");
    cr_assert(cm_field_value_ok("a b\tc\x80\xff", 7), "SP, HTAB and obs-text are allowed");
    cr_assert(cm_field_value_ok("", 0));
    cr_assert(!cm_field_value_ok("a\rb", 3), "bare CR");
    cr_assert(!cm_field_value_ok("a\nb", 3), "LF");
    cr_assert(!cm_field_value_ok("a\0b", 3), "NUL");
    cr_assert(!cm_field_value_ok("a\x7f", 2), "DEL");
    cr_assert(!cm_field_value_ok("a\x01", 2), "another control byte");
}

/* The front's watchdog reads now, then each connection's start: a loop thread may store a start later than now
 * in between (a keep-alive request just answered). That connection is not overdue: wrapping now - since around
 * closed live connections under load. */
Test(common, overdue)
{
    cr_expect(!cm_overdue(0, 5000, 1000), "no period running");
    cr_expect(!cm_overdue(4000, 5000, 1000), "exactly the limit");
    cr_expect(cm_overdue(3999, 5000, 1000));
    cr_expect(!cm_overdue(5001, 5000, 1000), "a start stored after now was read");
    cr_expect(!cm_overdue(UINT64_MAX, 5000, 1000));
}

/* tchar (RFC 9110 5.6.2) for every byte value, against the grammar written out. */
Test(common, tchar_table_is_rfc9110s)
{
    for (int c = 0; c < 256; c++) {
        bool want = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c != 0 && strchr("!#$%&'*+-.^_`|~", c) != NULL);
        cr_assert_eq(cm_is_tchar((unsigned char)c), want, "byte 0x%02x", c);
    }
}
