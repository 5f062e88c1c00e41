/* webhooks_test.c - verified deliveries (SPEC 12) through the real gateway: a Stripe delivery and its redelivery (new
 * Stripe-Signature, new timestamp, same event) execute once and the redelivery gets the stored answer; a forged, a
 * tampered or a stale delivery is 401 signature-invalid, claims nothing and is not forwarded, so the genuine
 * delivery with the same key still executes; the same for Standard Webhooks; a secret's variable missing is a
 * config error at --check. The signers here follow each sender's documented algorithm (Stripe: HMAC-SHA256 of
 * "t.body" keyed with the whole whsec_ secret, hex; Standard Webhooks: HMAC-SHA256 of "id.timestamp.body" keyed with
 * the base64-decoded secret after whsec_, base64). The key is the event's id in the body (key_from: json:/id) and
 * the message's webhook-id (key_from: header:webhook-id): the senders send no Idempotency-Key. */
#include <criterion/criterion.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tests/e2e/harness.h"

TestSuite(webhooks, .init = e2e_setup, .fini = e2e_teardown, .timeout = 90);

#define STRIPE_SECRET     "whsec_e2e_current_0123456789abcdef"
#define STRIPE_SECRET_OLD "whsec_e2e_previous_fedcba9876543210"
/* the Standard Webhooks specification's example secret: base64 of 24 bytes after whsec_ */
#define SW_SECRET "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

/* clang-format off */
static const char *const conf_tmpl =
    E2E_CONF_HEAD
    "upstreams:\n"
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")
    "routes:\n"
    "  - name: stripe\n"
    "    match: {path: /webhooks/stripe}\n"
    "    upstream: api\n"
    "    verify:\n"
    "      scheme: stripe\n"
    "      secrets_env: [E2E_STRIPE_WHSEC, E2E_STRIPE_WHSEC_OLD]\n"
    "      tolerance: 5m\n"
    "    idempotency:\n"
    "      key: required\n"
    "      key_from: json:/id\n"
    "  - name: sw\n"
    "    match: {path: /webhooks/sw}\n"
    "    upstream: api\n"
    "    verify: {scheme: standard-webhooks, secrets_env: [E2E_SW_SECRET]}\n"
    "    idempotency:\n"
    "      key: required\n"
    "      key_from: header:webhook-id\n";
/* clang-format on */

static struct e2e_gw *start(struct e2e_upstream **up)
{
    *up = e2e_upstream_start(NULL);
    static const char *const env[] = {"E2E_STRIPE_WHSEC=" STRIPE_SECRET, "E2E_STRIPE_WHSEC_OLD=" STRIPE_SECRET_OLD,
                                      "E2E_SW_SECRET=" SW_SECRET, NULL};
    struct e2e_gw_opts o = {.up = *up, .env = env, .wait_ready = true};
    return e2e_gw_start(conf_tmpl, &o);
}

/* ---- the senders' signers */

static void hmac256(const void *key, size_t keylen, const char *msg, size_t msglen, unsigned char out[32])
{
    unsigned int n = 0;
    cr_assert_not_null(HMAC(EVP_sha256(), key, (int)keylen, (const unsigned char *)msg, msglen, out, &n));
    cr_assert_eq(n, 32);
}

/* "Stripe-Signature: t=T,v1=HEX" for body at t, signed with secret (the whole whsec_ string is the key). */
static void stripe_header(char *out, size_t n, const char *secret, long t, const char *body)
{
    char msg[4096];
    int m = snprintf(msg, sizeof msg, "%ld.%s", t, body);
    cr_assert(m > 0 && (size_t)m < sizeof msg);
    unsigned char mac[32];
    hmac256(secret, strlen(secret), msg, (size_t)m, mac);
    int w = snprintf(out, n, "Stripe-Signature: t=%ld,v1=", t);
    for (size_t i = 0; i < 32; i++)
        w += snprintf(out + w, n - (size_t)w, "%02x", mac[i]);
    cr_assert((size_t)w < n);
}

/* "webhook-signature: v1,BASE64" for id.t.body, keyed with the base64 after the secret's whsec_. */
static void sw_header(char *out, size_t n, const char *secret, const char *id, long t, const char *body)
{
    const char *b64 = secret + strlen("whsec_");
    unsigned char key[128];
    int kl = EVP_DecodeBlock(key, (const unsigned char *)b64, (int)strlen(b64));
    cr_assert(kl > 0);
    kl -= (int)(strlen(b64) - strcspn(b64, "=")); /* EVP_DecodeBlock counts padding as zero bytes */
    char msg[4096];
    int m = snprintf(msg, sizeof msg, "%s.%ld.%s", id, t, body);
    cr_assert(m > 0 && (size_t)m < sizeof msg);
    unsigned char mac[32];
    hmac256(key, (size_t)kl, msg, (size_t)m, mac);
    unsigned char enc[64];
    EVP_EncodeBlock(enc, mac, 32);
    snprintf(out, n, "webhook-signature: v1,%s", (const char *)enc);
}

static long now_s(void)
{
    return (long)time(NULL);
}

static void post_stripe(const struct e2e_gw *gw, const char *sig, const char *body, struct e2e_resp *r)
{
    const char *h[] = {"Content-Type: application/json", sig, NULL};
    e2e_http_key(gw->port, "POST", "/webhooks/stripe", NULL, h, body, 0, r);
}

static double failures(const struct e2e_gw *gw, const char *route)
{
    struct e2e_resp m;
    e2e_get(gw->admin_port, "/metrics", &m);
    cr_assert_eq(m.status, 200);
    char label[64];
    snprintf(label, sizeof label, "route=\"%s\"", route);
    const char *const labels[] = {label, NULL};
    double v = e2e_metric_value((const char *)m.body, "idemgate_signature_failures_total", labels);
    e2e_resp_free(&m);
    return v;
}

static void event_body(char *out, size_t n, const char *id)
{
    snprintf(out, n,
             "{\"id\":\"%s\",\"object\":\"event\",\"type\":\"payment_intent.succeeded\","
             "\"data\":{\"object\":{\"id\":\"pi_1\",\"amount\":2000}}}",
             id);
}

Test(webhooks, a_stripe_delivery_and_its_redelivery_execute_once)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw = start(&up);
    char id[96], body[512], sig1[256], sig2[256];
    e2e_mkkey(id, sizeof id, "evt");
    event_body(body, sizeof body, id);
    stripe_header(sig1, sizeof sig1, STRIPE_SECRET, now_s() - 20, body);
    struct e2e_resp a, b;
    post_stripe(gw, sig1, body, &a);
    cr_assert_eq(a.status, 200, "first delivery: %ld %s", a.status, (const char *)a.body);
    cr_expect(!e2e_resp_is_replay(&a));
    /* Stripe's redelivery: the same event, a new timestamp, so a new signature */
    stripe_header(sig2, sizeof sig2, STRIPE_SECRET, now_s(), body);
    cr_assert_str_neq(sig1, sig2);
    post_stripe(gw, sig2, body, &b);
    cr_expect_eq(b.status, 200, "redelivery: %ld %s", b.status, (const char *)b.body);
    cr_expect(e2e_resp_is_replay(&b), "the redelivery gets the stored answer");
    cr_expect(a.body_len == b.body_len && memcmp(a.body, b.body, a.body_len) == 0, "the same bytes");
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "executed once");
    e2e_resp_free(&a);
    e2e_resp_free(&b);

    /* rotation: a delivery signed with the previous secret is accepted while it is listed */
    char id2[96], body2[512], sig3[256];
    e2e_mkkey(id2, sizeof id2, "evt");
    event_body(body2, sizeof body2, id2);
    stripe_header(sig3, sizeof sig3, STRIPE_SECRET_OLD, now_s(), body2);
    struct e2e_resp c;
    post_stripe(gw, sig3, body2, &c);
    cr_expect_eq(c.status, 200, "signed with the old secret: %ld %s", c.status, (const char *)c.body);
    cr_expect_eq(e2e_upstream_count(up, NULL), 2, "the second event executed");
    e2e_resp_free(&c);
    cr_expect_eq(failures(gw, "stripe"), 0);
}

Test(webhooks, forged_tampered_and_stale_deliveries_are_401_and_claim_nothing)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw = start(&up);
    char id[96], body[512], other[512];
    e2e_mkkey(id, sizeof id, "evt");
    event_body(body, sizeof body, id);
    snprintf(other, sizeof other, "{\"id\":\"%s\",\"type\":\"payout.paid\"}", id);
    long now = now_s();
    struct {
        const char *what;
        char sig[300];
    } cases[8];
    size_t n = 0;
    cases[n].what = "another secret";
    stripe_header(cases[n++].sig, sizeof cases[0].sig, "whsec_not_the_one", now, body);
    cases[n].what = "a signature of another body";
    stripe_header(cases[n++].sig, sizeof cases[0].sig, STRIPE_SECRET, now, other);
    cases[n].what = "a timestamp older than the tolerance";
    stripe_header(cases[n++].sig, sizeof cases[0].sig, STRIPE_SECRET, now - 400, body);
    cases[n].what = "a timestamp newer than the tolerance";
    stripe_header(cases[n++].sig, sizeof cases[0].sig, STRIPE_SECRET, now + 400, body);
    cases[n].what = "no v1";
    snprintf(cases[n++].sig, sizeof cases[0].sig, "Stripe-Signature: t=%ld,v0=00", now);
    cases[n].what = "no timestamp";
    snprintf(cases[n++].sig, sizeof cases[0].sig, "Stripe-Signature: v1=%064d", 0);
    cases[n].what = "garbage";
    snprintf(cases[n++].sig, sizeof cases[0].sig, "Stripe-Signature: ,,,=%%");
    cases[n].what = "no Stripe-Signature";
    snprintf(cases[n++].sig, sizeof cases[0].sig, "X-Nothing: 1");
    for (size_t i = 0; i < n; i++) {
        struct e2e_resp r;
        post_stripe(gw, cases[i].sig, body, &r);
        e2e_expect_problem(&r, 401, "signature-invalid", cases[i].what);
        const char *ch = e2e_resp_header(&r, "WWW-Authenticate");
        cr_expect(ch && strcmp(ch, "Signature scheme=\"stripe\"") == 0, "%s: WWW-Authenticate %s", cases[i].what,
                  ch ? ch : "(none)");
        e2e_resp_free(&r);
    }
    /* the signature is checked before the key is read from the body: a forged body that is not JSON is 401, not 400 */
    struct e2e_resp nj;
    post_stripe(gw, cases[0].sig, "not json", &nj);
    e2e_expect_problem(&nj, 401, "signature-invalid", "a forged body that is not JSON");
    e2e_resp_free(&nj);
    cr_expect_eq(e2e_upstream_count(up, NULL), 0, "nothing forwarded");
    cr_expect_eq(failures(gw, "stripe"), (double)n + 1, "each counted in idemgate_signature_failures_total");

    /* the forged deliveries claimed nothing: the genuine one with the same key executes */
    char sig[256];
    stripe_header(sig, sizeof sig, STRIPE_SECRET, now_s(), body);
    struct e2e_resp g;
    post_stripe(gw, sig, body, &g);
    cr_expect_eq(g.status, 200, "the genuine delivery: %ld %s", g.status, (const char *)g.body);
    cr_expect(!e2e_resp_is_replay(&g), "it executes: no forged delivery pre-empted its key");
    cr_expect_eq(e2e_upstream_count(up, NULL), 1);
    e2e_resp_free(&g);

    /* and the log names the reason only, never the signature */
    char *log = e2e_gw_log(gw);
    cr_expect(strstr(log, "event=signature_refused") != NULL, "refusals are logged");
    cr_expect(strstr(log, cases[0].sig + strlen("Stripe-Signature: t=")) == NULL, "no signature in the log");
    cr_expect(strstr(log, STRIPE_SECRET) == NULL, "no secret in the log");
    free(log);
}

static void post_sw(const struct e2e_gw *gw, const char *msg_id, long t, const char *sig, const char *body,
                    struct e2e_resp *r)
{
    char idh[160], tsh[64];
    snprintf(idh, sizeof idh, "webhook-id: %s", msg_id);
    snprintf(tsh, sizeof tsh, "webhook-timestamp: %ld", t);
    const char *h[] = {"Content-Type: application/json", idh, tsh, sig, NULL};
    e2e_http_key(gw->port, "POST", "/webhooks/sw", NULL, h, body, 0, r);
}

Test(webhooks, a_standard_webhooks_redelivery_replays_and_a_forgery_claims_nothing)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw = start(&up);
    char msg[96], body[256], sig[256];
    e2e_mkkey(msg, sizeof msg, "msg");
    snprintf(body, sizeof body, "{\"type\":\"invoice.paid\",\"data\":{\"order_no\":\"A-17\"}}");
    long now = now_s();

    /* forged first: another secret, then a stale timestamp; neither claims the message's key */
    struct e2e_resp f;
    sw_header(sig, sizeof sig, "whsec_dGhpcyBpcyBub3QgdGhlIHNlY3JldA==", msg, now, body);
    post_sw(gw, msg, now, sig, body, &f);
    e2e_expect_problem(&f, 401, "signature-invalid", "another secret");
    e2e_resp_free(&f);
    sw_header(sig, sizeof sig, SW_SECRET, msg, now - 301, body);
    post_sw(gw, msg, now - 301, sig, body, &f);
    e2e_expect_problem(&f, 401, "signature-invalid", "301 s old with a 5 m tolerance");
    e2e_resp_free(&f);
    /* a signature of another timestamp than the one sent */
    sw_header(sig, sizeof sig, SW_SECRET, msg, now - 1, body);
    post_sw(gw, msg, now, sig, body, &f);
    e2e_expect_problem(&f, 401, "signature-invalid", "the timestamp header is not the signed one");
    e2e_resp_free(&f);
    cr_expect_eq(e2e_upstream_count(up, NULL), 0, "nothing forwarded");

    struct e2e_resp a, b;
    sw_header(sig, sizeof sig, SW_SECRET, msg, now - 300, body); /* at the tolerance's edge: accepted */
    post_sw(gw, msg, now - 300, sig, body, &a);
    cr_assert_eq(a.status, 200, "first attempt: %ld %s", a.status, (const char *)a.body);
    cr_expect(!e2e_resp_is_replay(&a));
    /* the retry: same webhook-id, a fresh timestamp and signature (and a second, rotated-out v1 listed first) */
    char sig2[256], both[400];
    sw_header(sig2, sizeof sig2, SW_SECRET, msg, now, body);
    snprintf(both, sizeof both, "webhook-signature: v1,bm9wZQ== %s", sig2 + strlen("webhook-signature: "));
    post_sw(gw, msg, now, both, body, &b);
    cr_expect_eq(b.status, 200, "retry: %ld %s", b.status, (const char *)b.body);
    cr_expect(e2e_resp_is_replay(&b), "the retry gets the stored answer");
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "executed once");
    cr_expect_eq(failures(gw, "sw"), 3);
    e2e_resp_free(&a);
    e2e_resp_free(&b);
}

Test(webhooks, a_missing_secret_is_a_config_error_at_check)
{
    static const char *const vars[] = {"LISTEN_PORT",        "18080", "ADMIN_PORT", "18081", "UPSTREAM_URL",
                                       "http://127.0.0.1:9", NULL};
    char *text = e2e_render(conf_tmpl, vars);
    const char *path = e2e_write_file("webhooks.yaml", text);
    free(text);
    const char *argv[] = {e2e_env("IDEMGATE_BIN"), "--check", "-c", path, NULL};
    char *out = NULL, *err = NULL;
    /* E2E_STRIPE_WHSEC_OLD is not set */
    static const char *const env1[] = {"E2E_STRIPE_WHSEC=" STRIPE_SECRET, "E2E_SW_SECRET=" SW_SECRET, NULL};
    int code = e2e_run(argv, env1, 20000, &out, &err);
    cr_expect_eq(code, 1, "--check exit %d: %s", code, err);
    cr_expect(err && strstr(err, "routes[0].verify.secrets_env") && strstr(err, "E2E_STRIPE_WHSEC_OLD") &&
                  strstr(err, "unset or empty"),
              "the error names the key and the variable: %s", err ? err : "");
    cr_expect(err && !strstr(err, STRIPE_SECRET), "and never a secret");
    free(out);
    free(err);
    /* a Standard Webhooks secret that is not base64 after whsec_ */
    static const char *const env2[] = {"E2E_STRIPE_WHSEC=" STRIPE_SECRET, "E2E_STRIPE_WHSEC_OLD=" STRIPE_SECRET_OLD,
                                       "E2E_SW_SECRET=whsec_not*base64!", NULL};
    code = e2e_run(argv, env2, 20000, &out, &err);
    cr_expect_eq(code, 1, "--check exit %d: %s", code, err);
    cr_expect(err && strstr(err, "routes[1].verify.secrets_env") && strstr(err, "E2E_SW_SECRET"), "%s", err ? err : "");
    free(out);
    free(err);
    /* all set: valid */
    static const char *const env3[] = {"E2E_STRIPE_WHSEC=" STRIPE_SECRET, "E2E_STRIPE_WHSEC_OLD=" STRIPE_SECRET_OLD,
                                       "E2E_SW_SECRET=" SW_SECRET, NULL};
    code = e2e_run(argv, env3, 20000, &out, &err);
    cr_expect_eq(code, 0, "--check exit %d: %s", code, err);
    free(out);
    free(err);
}

/* mode: shadow refuses nothing: a forged delivery is forwarded, counted as a signature failure, and claims nothing
 * (no shadow decision is recorded for it, not even when its key is in the body). */
Test(webhooks, shadow_mode_forwards_a_forged_delivery_and_claims_nothing)
{
    /* clang-format off */
    static const char *const tmpl =
        E2E_CONF_HEAD
        "upstreams:\n"
        E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")
        "routes:\n"
        "  - name: stripe\n"
        "    match: {path: /webhooks/stripe}\n"
        "    upstream: api\n"
        "    verify: {scheme: stripe, secrets_env: [E2E_STRIPE_WHSEC]}\n"
        "    idempotency:\n"
        "      key: required\n"
        "      key_from: json:/id\n"
        "      mode: shadow\n";
    /* clang-format on */
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    static const char *const env[] = {"E2E_STRIPE_WHSEC=" STRIPE_SECRET, NULL};
    struct e2e_gw_opts o = {.up = up, .env = env, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(tmpl, &o);
    char id[96], body[512], sig[256];
    e2e_mkkey(id, sizeof id, "evt");
    event_body(body, sizeof body, id);
    for (int i = 0; i < 2; i++) {
        stripe_header(sig, sizeof sig, "whsec_forged", now_s(), body);
        struct e2e_resp r;
        post_stripe(gw, sig, body, &r);
        cr_expect_eq(r.status, 200, "forged #%d in shadow mode: forwarded, %ld", i, r.status);
        e2e_resp_free(&r);
    }
    cr_expect_eq(e2e_upstream_count(up, NULL), 2, "both forwarded");
    cr_expect_eq(failures(gw, "stripe"), 2);
    struct e2e_resp m;
    e2e_get(gw->admin_port, "/metrics", &m);
    const char *const any[] = {"route=\"stripe\"", NULL};
    double decisions = 0;
    static const char *const names[] = {"new", "replay", "mismatch", "in_flight", "stale"};
    for (size_t i = 0; i < 5; i++) {
        char d[64];
        snprintf(d, sizeof d, "decision=\"%s\"", names[i]);
        const char *const labels[] = {any[0], d, NULL};
        double v = e2e_metric_value((const char *)m.body, "idemgate_shadow_decisions_total", labels);
        decisions += v > 0 ? v : 0;
    }
    e2e_resp_free(&m);
    cr_expect_eq(decisions, 0, "a forged delivery records no shadow decision (it claimed nothing)");
}
