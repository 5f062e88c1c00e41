/* jwt_scope_test.c - scopes that survive token refresh (SPEC 9, jwt:CLAIM): the real gateway verifies HS256 bearer
 * tokens signed here; a refreshed token of the same subject replays, two subjects are isolated, and every refused
 * token is 401 invalid-credentials with nothing forwarded (before any 400). */
#include <criterion/criterion.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tests/e2e/harness.h"
#include "tests/tools/b64url.h"

TestSuite(jwt, .init = e2e_setup, .fini = e2e_teardown, .timeout = 60);

#define SECRET "e2e-hs256-secret-of-at-least-32-bytes-0123456789"

/* clang-format off */
static const char *const conf_tmpl =
    E2E_CONF_HEAD
    "upstreams:\n"
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")
    "routes:\n"
    E2E_CONF_ROUTE("pay", "/v1/pay", "api")
    "      key: required\n"
    "      scope: [jwt:sub]\n"
    "jwt:\n"
    "  secret_env: IDEMGATE_JWT_SECRET\n"
    "  issuer: https://auth.test\n"
    "  audience: payments\n";
/* clang-format on */

/* "Authorization: Bearer <HS256 token>" for a header and payload, signed with secret. */
static char *bearer(const char *hdr, const char *payload, const char *secret)
{
    return e2e_bearer_hs256(hdr, payload, secret);
}

static char *token_for(const char *sub, long exp_in_s, const char *extra)
{
    char payload[1200];
    long now = (long)time(NULL);
    snprintf(payload, sizeof payload,
             "{\"sub\":\"%s\",\"iss\":\"https://auth.test\",\"aud\":\"payments\",\"iat\":%ld,\"exp\":%ld%s}", sub, now,
             now + exp_in_s, extra ? extra : "");
    return bearer("{\"alg\":\"HS256\",\"typ\":\"JWT\"}", payload, SECRET);
}

static struct e2e_gw *start_conf(struct e2e_upstream **up, const char *tmpl)
{
    *up = e2e_upstream_start(NULL);
    const char *env[] = {"IDEMGATE_JWT_SECRET=" SECRET, NULL};
    struct e2e_gw_opts o = {.up = *up, .env = env, .wait_ready = true};
    return e2e_gw_start(tmpl, &o);
}

static struct e2e_gw *start(struct e2e_upstream **up)
{
    return start_conf(up, conf_tmpl);
}

static void post(const struct e2e_gw *gw, const char *key, const char *authz, const char *body, struct e2e_resp *r)
{
    const char *h[] = {authz, NULL};
    e2e_http_key(gw->port, "POST", "/v1/pay/c", key, authz ? h : NULL, body, 0, r);
}

Test(jwt, a_refreshed_token_is_the_same_scope_and_subjects_are_isolated)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw = start(&up);
    char key[96];
    e2e_mkkey(key, sizeof key, "jwt");
    char *alice1 = token_for("alice", 600, NULL);
    char *alice2 = token_for("alice", 900, ",\"jti\":\"refreshed\"");
    char *bob = token_for("bob", 600, NULL);
    cr_assert_str_neq(alice1, alice2);
    struct e2e_resp a, b, c;
    post(gw, key, alice1, "{\"amount\":1}", &a);
    cr_assert_eq(a.status, 200, "first: %ld %s", a.status, (const char *)a.body);
    cr_expect(!e2e_resp_is_replay(&a));
    post(gw, key, alice2, "{\"amount\":1}", &b);
    cr_expect_eq(b.status, 200);
    cr_expect(e2e_resp_is_replay(&b), "a refreshed token of the same subject replays");
    cr_expect_eq(a.body_len, b.body_len);
    cr_expect(a.body_len == b.body_len && memcmp(a.body, b.body, a.body_len) == 0, "same bytes");
    cr_expect_eq(e2e_upstream_count(up, key), 1, "one execution for alice");
    post(gw, key, bob, "{\"amount\":1}", &c);
    cr_expect_eq(c.status, 200);
    cr_expect(!e2e_resp_is_replay(&c), "another subject is another scope: it executes");
    cr_expect_eq(e2e_upstream_count(up, key), 2, "bob executed once more");
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    e2e_resp_free(&c);
    free(alice1);
    free(alice2);
    free(bob);
}

Test(jwt, refused_tokens_are_401_and_nothing_is_forwarded)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw = start(&up);
    long now = (long)time(NULL);
    char pl[600];
    struct {
        const char *what;
        char *authz;
    } cases[12];
    size_t n = 0;
    cases[n++] = (typeof(cases[0])){"expired", token_for("alice", -120, NULL)};
    snprintf(pl, sizeof pl, ",\"nbf\":%ld", now + 300);
    cases[n++] = (typeof(cases[0])){"not yet valid", token_for("alice", 600, pl)};
    snprintf(pl, sizeof pl, "{\"sub\":\"alice\",\"iss\":\"https://evil.test\",\"aud\":\"payments\",\"exp\":%ld}",
             now + 600);
    cases[n++] = (typeof(cases[0])){"wrong issuer", bearer("{\"alg\":\"HS256\"}", pl, SECRET)};
    snprintf(pl, sizeof pl, "{\"sub\":\"alice\",\"iss\":\"https://auth.test\",\"aud\":\"ledger\",\"exp\":%ld}",
             now + 600);
    cases[n++] = (typeof(cases[0])){"wrong audience", bearer("{\"alg\":\"HS256\"}", pl, SECRET)};
    snprintf(pl, sizeof pl, "{\"sub\":\"alice\",\"iss\":\"https://auth.test\",\"aud\":\"payments\",\"exp\":%ld}",
             now + 600);
    cases[n++] = (typeof(cases[0])){"bad signature",
                                    bearer("{\"alg\":\"HS256\"}", pl, "another-secret-of-at-least-32-bytes-xxxxxxx")};
    char h[64], p[1024], *none = malloc(1200);
    test_b64url((const unsigned char *)"{\"alg\":\"none\"}", 14, h);
    test_b64url((const unsigned char *)pl, strlen(pl), p);
    snprintf(none, 1200, "Authorization: Bearer %s.%s.", h, p);
    cases[n++] = (typeof(cases[0])){"alg none", none};
    cases[n++] = (typeof(cases[0])){"malformed", strdup("Authorization: Bearer not.a.jwt")};
    cases[n++] = (typeof(cases[0])){"not bearer", strdup("Authorization: Basic YWxpY2U6cHc=")};
    snprintf(pl, sizeof pl, "{\"iss\":\"https://auth.test\",\"aud\":\"payments\",\"exp\":%ld}", now + 600);
    cases[n++] = (typeof(cases[0])){"no sub claim", bearer("{\"alg\":\"HS256\"}", pl, SECRET)};
    cases[n++] = (typeof(cases[0])){"missing", NULL};
    for (size_t i = 0; i < n; i++) {
        char key[96];
        e2e_mkkey(key, sizeof key, "jwtbad");
        struct e2e_resp r;
        post(gw, key, cases[i].authz, "{}", &r);
        cr_expect_eq(r.status, 401, "%s: %ld %s", cases[i].what, r.status, (const char *)r.body);
        cr_expect(e2e_resp_is_problem(&r, "invalid-credentials"), "%s: %s", cases[i].what, (const char *)r.body);
        cr_expect_not_null(e2e_resp_header(&r, "WWW-Authenticate"), "%s", cases[i].what);
        e2e_resp_free(&r);
        /* 401 before any 400: no key at all still gets 401 with a bad token */
        post(gw, NULL, cases[i].authz, "{}", &r);
        cr_expect_eq(r.status, 401, "%s without a key: %ld", cases[i].what, r.status);
        e2e_resp_free(&r);
        free(cases[i].authz);
    }
    cr_expect_eq(e2e_upstream_count(up, NULL), 0, "nothing was forwarded");
    /* a valid token without a key is the route's 400 */
    char *ok = token_for("alice", 600, NULL);
    struct e2e_resp r;
    post(gw, NULL, ok, "{}", &r);
    cr_expect(e2e_resp_is_problem(&r, "idempotency-key-missing"), "%ld %s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    free(ok);
    char *log = e2e_gw_log(gw);
    cr_expect_null(strstr(log, "Bearer "), "a token reached the log");
    free(log);
}

/* SPEC 9: on a jwt: scope, the look-up carries the retry's verified Authorization: alice's lost request is never
 * settled by bob's execution of the same key (the test upstream's look-up answers as the Authorization's tenant).
 * Before, the look-up asked by key alone, found bob's, and alice got 200 Idempotent-Replayed with it. */
/* clang-format off */
static const char *const conf_probe_tmpl =
    E2E_CONF_HEAD
    "upstreams:\n"
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "1s")
    "routes:\n"
    E2E_CONF_ROUTE("payjwtprobe", "/v1/pay", "api")
    "      key: required\n"
    "      scope: [jwt:sub]\n"
    "      lease: 1s\n"
    "      on_unknown: probe\n"
    "      probe: {path: '/_lookup?idempotency_key={key}', grace: 0s}\n"
    "jwt:\n"
    "  secret_env: IDEMGATE_JWT_SECRET\n"
    "  issuer: https://auth.test\n"
    "  audience: payments\n";
/* clang-format on */

Test(jwt, a_probe_asks_with_the_retrys_own_token)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw = start_conf(&up, conf_probe_tmpl);
    char key[96];
    e2e_mkkey(key, sizeof key, "jwtprobe");
    char *alice = token_for("alice", 600, NULL);
    char *bob = token_for("bob", 600, NULL);
    const char *lost[] = {alice, "X-Test-Action: lost", NULL};
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay/c", key, lost, "{\"amount\":1}", 0, &r);
    e2e_expect_problem(&r, 502, "upstream-no-response", "alice: sent, never executed");
    e2e_resp_free(&r);
    post(gw, key, bob, "{\"amount\":1}", &r);
    cr_expect_eq(r.status, 200, "bob's own request executes");
    e2e_resp_free(&r);
    e2e_sleep_ms(2300); /* the lease (1 s), then the upstream timeout (1 s, grace 0s): the look-up may go */
    post(gw, key, alice, "{\"amount\":1}", &r);
    cr_expect_eq(r.status, 200, "alice's retry: %ld %s", r.status, (const char *)r.body);
    cr_expect(!e2e_resp_is_replay(&r), "never bob's answer: %s", (const char *)r.body);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2, "alice's executed now");
    char *h = e2e_upstream_last_headers(up);
    cr_expect(strstr(h, alice + strlen("Authorization: ")) != NULL, "alice's token reached the upstream");
    free(h);
    free(alice);
    free(bob);
}

/* SPEC 7: a request whose scope needs a JWT has its token checked whenever the route's idempotency or ordering rules
 * apply, whatever key: says. Before, key: off skipped the check and hashed every request's jwt:sub as absent: one
 * sequence for everyone, so a request without a token set 2^63-1 and every tenant's writes to that resource were
 * stale for good. */
/* clang-format off */
static const char *const conf_order_tmpl =
    E2E_CONF_HEAD
    "upstreams:\n"
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")
    "routes:\n"
    E2E_CONF_ROUTE("acctjwt", "/v1/accounts", "api")
    "      key: 'off'\n"
    "      scope: [jwt:sub]\n"
    "    ordering:\n"
    "      resource: /v1/accounts/{id}/address\n"
    "      sequence: header:X-Sequence\n"
    "jwt:\n"
    "  secret_env: IDEMGATE_JWT_SECRET\n"
    "  issuer: https://auth.test\n"
    "  audience: payments\n";
/* clang-format on */

static void patch_seq(const struct e2e_gw *gw, const char *path, const char *authz, const char *seq, struct e2e_resp *r)
{
    char sh[64];
    snprintf(sh, sizeof sh, "X-Sequence: %s", seq);
    const char *h[] = {sh, authz, NULL};
    e2e_http_key(gw->port, "PATCH", path, NULL, h, "{\"street\":\"x\"}", 0, r);
}

Test(jwt, key_off_ordering_checks_the_token_and_keeps_tenants_apart)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw = start_conf(&up, conf_order_tmpl);
    char k[96], path[160];
    e2e_mkkey(k, sizeof k, "acct");
    snprintf(path, sizeof path, "/v1/accounts/%s/address", k);
    char *alice = token_for("alice", 600, NULL);
    char *bob = token_for("bob", 600, NULL);
    struct e2e_resp r;
    patch_seq(gw, path, NULL, "9223372036854775807", &r);
    cr_expect_eq(r.status, 401, "no token on a jwt-scoped ordering route: %ld %s", r.status, (const char *)r.body);
    cr_expect(e2e_resp_is_problem(&r, "invalid-credentials"), "%s", (const char *)r.body);
    e2e_resp_free(&r);
    patch_seq(gw, path, "Authorization: Bearer not.a.jwt", "9223372036854775807", &r);
    cr_expect_eq(r.status, 401, "a bad token: %ld", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 0, "nothing forwarded");
    patch_seq(gw, path, alice, "5", &r);
    cr_expect_eq(r.status, 200, "alice: %ld %s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    patch_seq(gw, path, bob, "1", &r);
    cr_expect_eq(r.status, 200, "bob has his own sequence: %ld %s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    patch_seq(gw, path, alice, "3", &r);
    cr_expect_eq(r.status, 409, "alice's own stale write: %ld", r.status);
    e2e_resp_free(&r);
    /* outside the guard (another method, another path) the token is not needed */
    e2e_http_key(gw->port, "GET", path, NULL, NULL, NULL, 0, &r);
    cr_expect_eq(r.status, 200, "a GET is not guarded: %ld", r.status);
    e2e_resp_free(&r);
    free(alice);
    free(bob);
}

/* SPEC 9: a claim is scoped with its JSON type: the tenant whose sub is the number 123 is not the tenant whose sub
 * is the string "123", and never gets its answer replayed. Before, both hashed as the bytes 123: one scope. */
Test(jwt, a_numeric_sub_is_another_tenant_than_its_string)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw = start(&up);
    char key[96], pl[600];
    e2e_mkkey(key, sizeof key, "jwttype");
    long now = (long)time(NULL);
    snprintf(pl, sizeof pl, "{\"sub\":123,\"iss\":\"https://auth.test\",\"aud\":\"payments\",\"exp\":%ld}", now + 600);
    char *number = bearer("{\"alg\":\"HS256\"}", pl, SECRET);
    char *string = token_for("123", 600, NULL);
    struct e2e_resp r;
    post(gw, key, string, "{\"amount\":1}", &r);
    cr_expect_eq(r.status, 200);
    cr_expect(!e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    post(gw, key, number, "{\"amount\":1}", &r);
    cr_expect_eq(r.status, 200, "%ld %s", r.status, (const char *)r.body);
    cr_expect(!e2e_resp_is_replay(&r), "sub 123 is not sub \"123\": it executes, never the other's replay");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2);
    free(number);
    free(string);
}
