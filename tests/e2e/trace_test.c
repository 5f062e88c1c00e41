/* trace_test.c - end-to-end checks of tracing (tracing: {otlp, sample}) against an OTLP/HTTP receiver in the test
 * (tests/tools/otlp_sink.h): a request's spans (request, claim, upstream, complete) continue an incoming
 * traceparent, their parents are right, their attributes carry the route, outcome and token and no secret; the
 * upstream gets a traceparent naming the upstream span; an invalid traceparent starts a new trace; sample: 0 exports
 * nothing; a collector that is down or never answers neither slows nor fails a request, and its drops are counted. */
#include <criterion/criterion.h>

#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "harness.h"
#include "tests/tools/otlp_sink.h"

TestSuite(trace, .init = e2e_setup, .fini = e2e_teardown, .timeout = 120);

/* clang-format off */
#define TRACE_CONF(otlp, sample)                                                                                       \
    E2E_CONF_HEAD                                                                                                      \
    "tracing:\n"                                                                                                       \
    "  otlp: " otlp "\n"                                                                                               \
    "  sample: " sample "\n"                                                                                           \
    "upstreams:\n"                                                                                                     \
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")                                                                 \
    "routes:\n"                                                                                                        \
    E2E_CONF_ROUTE("pay", "/v1/pay", "api")                                                                            \
    "      key: required\n"                                                                                            \
    "      scope: [header:X-Tenant, header:Authorization]\n"
/* clang-format on */

#define TENANT   "tenant-secret-7731"
#define JWT      "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJzdWJqZWN0LXNlY3JldCJ9.c2lnbmF0dXJlLXNlY3JldA"
#define PASSWORD "hunter2-secret"
#define CARD     "4111111111111111"

static const char *const in_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
static const char *const in_parent = "00f067aa0ba902b7";

static struct e2e_gw *start_gw(struct e2e_upstream *up, const char *conf, const char *otlp)
{
    const char *vars[] = {"OTLP", otlp, NULL};
    struct e2e_gw_opts o = {.up = up, .vars = vars, .wait_ready = true};
    return e2e_gw_start(conf, &o);
}

/* A sink (black_hole: one that never answers), a test upstream *up and a gateway exporting to the sink at rate
 * sample. */
static struct e2e_gw *start_traced(struct otlp_sink *sink, bool black_hole, const char *conf, struct e2e_upstream **up)
{
    cr_assert(otlp_sink_start(sink, black_hole));
    char otlp[64];
    snprintf(otlp, sizeof otlp, "http://127.0.0.1:%u", sink->port);
    *up = e2e_upstream_start(NULL);
    return start_gw(*up, conf, otlp);
}

/* A keyed POST on the scoped route carrying every secret the spans must not show; traceparent NULL: none. */
static long post_secret(const struct e2e_gw *gw, const char *key, const char *traceparent)
{
    char tp[128];
    snprintf(tp, sizeof tp, "traceparent: %s", traceparent ? traceparent : "");
    const char *extra[] = {"X-Tenant: " TENANT, "Authorization: Bearer " JWT, traceparent ? tp : NULL, NULL};
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay?password=" PASSWORD, key, extra, "{\"card\":\"" CARD "\"}", 5000, &r);
    long st = r.status;
    e2e_resp_free(&r);
    return st;
}

/* The traceparent the upstream got with its last execution (heap), or NULL. */
static char *upstream_traceparent(const struct e2e_upstream *up)
{
    char *h = e2e_upstream_last_headers(up);
    struct e2e_hdr *hs = NULL;
    size_t n = e2e_parse_header_lines(h ? h : "", &hs);
    const char *v = e2e_hdrs_get(hs, n, "traceparent");
    char *out = v ? strdup(v) : NULL;
    cr_expect_eq(e2e_hdrs_count(hs, n, "traceparent"), v ? 1 : 0, "one traceparent upstream");
    e2e_hdrs_free(hs, n);
    free(h);
    return out;
}

/* Every span the sink received, in one JSON array (the caller decrefs). */
static json_t *spans_of(struct otlp_sink *s)
{
    json_t *all = json_array();
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->nbodies; i++) {
        json_error_t e;
        json_t *root = json_loads(s->bodies[i], 0, &e);
        cr_expect_not_null(root, "a body that is not JSON: %s", e.text);
        json_t *rs, *ss, *sp;
        size_t a, b, c;
        json_array_foreach(json_object_get(root, "resourceSpans"), a, rs)
        {
            json_array_foreach(json_object_get(rs, "scopeSpans"), b, ss)
            {
                json_array_foreach(json_object_get(ss, "spans"), c, sp) json_array_append(all, sp);
            }
        }
        json_decref(root);
    }
    pthread_mutex_unlock(&s->mu);
    return all;
}

static const char *str(json_t *o, const char *k)
{
    const char *v = json_string_value(json_object_get(o, k));
    return v ? v : "";
}

/* The span of trace trace named name, or NULL. */
static json_t *span_named(json_t *all, const char *trace, const char *name)
{
    json_t *sp;
    size_t i;
    json_array_foreach(all, i, sp)
    {
        if (strcmp(str(sp, "traceId"), trace) == 0 && strcmp(str(sp, "name"), name) == 0)
            return sp;
    }
    return NULL;
}

/* Polls until the four spans of trace arrived (true) or timeout_ms passes. */
static bool wait_spans(struct otlp_sink *s, const char *trace, int timeout_ms)
{
    uint64_t end = e2e_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        json_t *all = spans_of(s);
        bool ok = span_named(all, trace, "request") && span_named(all, trace, "claim") &&
                  span_named(all, trace, "upstream") && span_named(all, trace, "complete");
        json_decref(all);
        if (ok || e2e_now_ms() > end)
            return ok;
        e2e_sleep_ms(50);
    }
}

static const char *attr(json_t *span, const char *key, const char *type)
{
    json_t *a;
    size_t i;
    json_array_foreach(json_object_get(span, "attributes"), i, a)
    {
        if (strcmp(str(a, "key"), key) == 0)
            return json_string_value(json_object_get(json_object_get(a, "value"), type));
    }
    return NULL;
}

static void expect_no_secret(struct otlp_sink *s, const char *key)
{
    char *all = otlp_sink_all(s);
    static const char *const secrets[] = {TENANT, JWT, "eyJhbGciOiJIUzI1NiJ9", PASSWORD, "password", CARD, NULL};
    for (size_t i = 0; secrets[i]; i++)
        cr_expect(strstr(all, secrets[i]) == NULL, "a span shows '%s'", secrets[i]);
    cr_expect(strstr(all, key) == NULL, "a span shows the key '%s'", key);
    free(all);
}

Test(trace, an_incoming_trace_is_continued_with_parents_and_attributes_and_no_secret)
{
    struct otlp_sink sink;
    struct e2e_upstream *up;
    struct e2e_gw *gw = start_traced(&sink, false, TRACE_CONF("{{OTLP}}", "1.0"), &up);
    char key[96], tp[64];
    e2e_mkkey(key, sizeof key, "trace-in");
    snprintf(tp, sizeof tp, "00-%s-%s-01", in_trace, in_parent);
    cr_assert_eq(post_secret(gw, key, tp), 200);

    /* the upstream is told our upstream span as its parent, in the same trace */
    char *utp = upstream_traceparent(up);
    cr_assert_not_null(utp, "the upstream got no traceparent");
    char want_prefix[40];
    snprintf(want_prefix, sizeof want_prefix, "00-%s-", in_trace);
    cr_expect(strncmp(utp, want_prefix, strlen(want_prefix)) == 0 && strlen(utp) == 55, "upstream got '%s'", utp);
    cr_expect(strcmp(utp + 52, "-01") == 0, "sampled flag kept: '%s'", utp);
    char up_span[17] = "";
    if (strlen(utp) == 55)
        memcpy(up_span, utp + 36, 16);
    cr_expect(strcmp(up_span, in_parent) != 0, "the client's parent id is replaced");

    cr_assert(wait_spans(&sink, in_trace, 5000), "the four spans reached the collector");
    json_t *all = spans_of(&sink);
    json_t *req = span_named(all, in_trace, "request"), *claim = span_named(all, in_trace, "claim"),
           *ups = span_named(all, in_trace, "upstream"), *comp = span_named(all, in_trace, "complete");
    cr_expect_str_eq(str(req, "parentSpanId"), in_parent, "the request span's parent is the incoming one");
    const char *rid = str(req, "spanId");
    cr_expect_eq(strlen(rid), 16);
    cr_expect_str_eq(str(claim, "parentSpanId"), rid);
    cr_expect_str_eq(str(ups, "parentSpanId"), rid);
    cr_expect_str_eq(str(comp, "parentSpanId"), rid);
    cr_expect_str_eq(str(ups, "spanId"), up_span, "the upstream was told the upstream span's id");
    cr_expect_eq(json_integer_value(json_object_get(req, "kind")), 2, "request: a server span");
    cr_expect_eq(json_integer_value(json_object_get(ups, "kind")), 3, "upstream: a client span");
    cr_expect_str_eq(attr(req, "idemgate.route", "stringValue"), "pay");
    cr_expect_str_eq(attr(req, "idemgate.outcome", "stringValue"), "forwarded");
    const char *tok = attr(req, "idemgate.token", "intValue");
    cr_expect(tok != NULL && strtoull(tok, NULL, 10) > 0, "the request span carries the fencing token");
    cr_expect_str_eq(attr(comp, "idemgate.token", "intValue") ? attr(comp, "idemgate.token", "intValue") : "",
                     tok ? tok : "-");
    cr_expect_str_eq(attr(req, "http.response.status_code", "intValue"), "200");
    cr_expect_str_eq(attr(ups, "http.response.status_code", "intValue"), "200");
    cr_expect(strtoull(str(req, "endTimeUnixNano"), NULL, 10) >= strtoull(str(ups, "endTimeUnixNano"), NULL, 10),
              "the request ends after its upstream step");
    cr_expect(sink.paths_ok, "POST /v1/traces with content-type application/json");
    json_decref(all);
    expect_no_secret(&sink, key);
    free(utp);
    e2e_gw_stop(gw, 5000);
    otlp_sink_stop(&sink);
}

Test(trace, an_invalid_traceparent_starts_a_new_trace_and_an_unsampled_one_exports_nothing)
{
    struct otlp_sink sink;
    struct e2e_upstream *up;
    struct e2e_gw *gw = start_traced(&sink, false, TRACE_CONF("{{OTLP}}", "1.0"), &up);
    static const char *const invalid[] = {
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01", /* trace id all zero */
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", /* parent id all zero */
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", /* upper case */
        "garbage",
    };
    for (size_t i = 0; i < sizeof invalid / sizeof invalid[0]; i++) {
        char key[96];
        e2e_mkkey(key, sizeof key, "trace-bad");
        cr_assert_eq(post_secret(gw, key, invalid[i]), 200);
        char *utp = upstream_traceparent(up);
        cr_assert_not_null(utp, "no traceparent upstream after '%s'", invalid[i]);
        cr_expect(strlen(utp) == 55 && strncmp(utp, "00-", 3) == 0, "'%s'", utp);
        char trace[33] = "";
        memcpy(trace, utp + 3, 32);
        cr_expect(strcmp(trace, in_trace) != 0 && strcmp(trace, "00000000000000000000000000000000") != 0,
                  "'%s' started a new trace: %s", invalid[i], trace);
        cr_expect(wait_spans(&sink, trace, 5000), "the new trace's spans were exported");
        json_t *all = spans_of(&sink);
        json_t *req = span_named(all, trace, "request");
        cr_expect(req != NULL && json_object_get(req, "parentSpanId") == NULL, "a new trace's request span is a root");
        json_decref(all);
        free(utp);
    }
    /* a valid, unsampled traceparent: followed (nothing exported), and passed on unsampled */
    char key[96], tp[64];
    e2e_mkkey(key, sizeof key, "trace-off");
    snprintf(tp, sizeof tp, "00-%s-%s-00", "0af7651916cd43dd8448eb211c80319c", in_parent);
    cr_assert_eq(post_secret(gw, key, tp), 200);
    char *utp = upstream_traceparent(up);
    cr_assert_not_null(utp);
    cr_expect(strncmp(utp, "00-0af7651916cd43dd8448eb211c80319c-", 36) == 0 && strcmp(utp + 52, "-00") == 0,
              "unsampled passed on: '%s'", utp);
    free(utp);
    e2e_sleep_ms(1500); /* past the exporter's flush interval */
    json_t *all = spans_of(&sink);
    cr_expect_null(span_named(all, "0af7651916cd43dd8448eb211c80319c", "request"), "an unsampled trace exported");
    json_decref(all);
    expect_no_secret(&sink, key);
    e2e_gw_stop(gw, 5000);
    otlp_sink_stop(&sink);
}

Test(trace, sample_zero_exports_nothing)
{
    struct otlp_sink sink;
    struct e2e_upstream *up;
    struct e2e_gw *gw = start_traced(&sink, false, TRACE_CONF("{{OTLP}}", "0"), &up);
    for (int i = 0; i < 20; i++) {
        char key[96];
        e2e_mkkey(key, sizeof key, "trace-zero");
        cr_assert_eq(post_secret(gw, key, NULL), 200);
    }
    char *utp = upstream_traceparent(up);
    cr_expect(utp != NULL && strlen(utp) == 55 && strcmp(utp + 52, "-00") == 0, "unsampled traceparent upstream: %s",
              utp ? utp : "(none)");
    free(utp);
    e2e_sleep_ms(1500);
    cr_expect_eq(e2e_gw_stop(gw, 5000), 0);
    pthread_mutex_lock(&sink.mu);
    size_t posts = sink.posts;
    pthread_mutex_unlock(&sink.mu);
    cr_expect_eq(posts, 0, "sample: 0 posted %zu batches", posts);
    otlp_sink_stop(&sink);
}

static double dropped(const struct e2e_gw *g)
{
    struct e2e_resp r;
    e2e_get(g->admin_port, "/metrics", &r);
    cr_assert_eq(r.status, 200, "/metrics: %ld", r.status);
    static const char *const none[] = {NULL};
    double v = e2e_metric_value((const char *)r.body, "idemgate_trace_spans_dropped_total", none);
    e2e_resp_free(&r);
    return v;
}

/* N requests through a gateway whose collector is down (nothing listens) or black-holes (accepts, never answers):
 * every one 200 and all within a loose bound; the spans it could not send are counted. */
static void collector_never_slows(bool black_hole)
{
    struct otlp_sink sink;
    char otlp[64];
    if (black_hole) {
        cr_assert(otlp_sink_start(&sink, true));
        snprintf(otlp, sizeof otlp, "http://127.0.0.1:%u", sink.port);
    } else {
        snprintf(otlp, sizeof otlp, "http://127.0.0.1:%u", e2e_free_port());
    }
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start_gw(up, TRACE_CONF("{{OTLP}}", "1.0"), otlp);
    enum { N = 200 };
    uint64_t t0 = e2e_now_ms(), slowest = 0;
    int ok = 0;
    for (int i = 0; i < N; i++) {
        char key[96];
        e2e_mkkey(key, sizeof key, "trace-down");
        uint64_t s = e2e_now_ms();
        ok += post_secret(gw, key, NULL) == 200;
        if (e2e_now_ms() - s > slowest)
            slowest = e2e_now_ms() - s;
    }
    uint64_t took = e2e_now_ms() - t0;
    cr_expect_eq(ok, N, "%d of %d answered 200", ok, N);
    cr_expect_lt(took, 20000, "%d requests took %llu ms", N, (unsigned long long)took);
    cr_expect_lt(slowest, 1500, "the slowest request took %llu ms (a POST to the collector takes up to 2 s)",
                 (unsigned long long)slowest);
    fprintf(stderr, "trace: collector %s: %d requests in %llu ms, slowest %llu ms\n",
            black_hole ? "black hole" : "down", N, (unsigned long long)took, (unsigned long long)slowest);
    uint64_t end = e2e_now_ms() + 6000;
    while (dropped(gw) <= 0 && e2e_now_ms() < end)
        e2e_sleep_ms(100);
    cr_expect_gt(dropped(gw), 0, "spans the collector did not take are counted");
    uint64_t s0 = e2e_now_ms();
    cr_expect_eq(e2e_gw_stop(gw, 10000), 0, "a clean exit");
    cr_expect_lt(e2e_now_ms() - s0, 8000, "the stop waited %llu ms", (unsigned long long)(e2e_now_ms() - s0));
    if (black_hole) {
        cr_expect_gt(sink.posts, 0, "the black hole was posted to");
        otlp_sink_stop(&sink);
    }
}

Test(trace, a_collector_that_is_down_never_slows_or_fails_a_request)
{
    collector_never_slows(false);
}

Test(trace, a_collector_that_never_answers_never_slows_or_fails_a_request)
{
    collector_never_slows(true);
}

/* SPEC 11: the span's outcome has the metric's names: a client's mistake (no key on a key: required route) is
 * rejected. */
Test(trace, a_clients_mistake_is_rejected_in_its_span)
{
    struct otlp_sink sink;
    struct e2e_upstream *up;
    struct e2e_gw *gw = start_traced(&sink, false, TRACE_CONF("{{OTLP}}", "1.0"), &up);
    static const char *const trace = "5cf92f3577b34da6a3ce929d0e0e4737";
    char tp[64];
    snprintf(tp, sizeof tp, "00-%s-%s-01", trace, in_parent);
    cr_assert_eq(post_secret(gw, NULL, tp), 400);
    json_t *all = NULL, *req = NULL;
    for (int i = 0; i < 100 && !req; i++) { /* bounded: 5 s */
        json_decref(all);
        all = spans_of(&sink);
        req = span_named(all, trace, "request");
        if (!req)
            e2e_sleep_ms(50);
    }
    cr_assert_not_null(req, "the refused request's span reached the collector");
    cr_expect_str_eq(attr(req, "idemgate.outcome", "stringValue"), "rejected");
    cr_expect_str_eq(attr(req, "http.response.status_code", "intValue"), "400");
    json_decref(all);
    e2e_gw_stop(gw, 5000);
    otlp_sink_stop(&sink);
}
