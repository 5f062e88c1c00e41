/* trace_test.c - upstream/trace: traceparent parse and format, ids, the OTLP JSON body, and the exporter against a
 * receiver in the test (exported, dropped when full or when the collector is down or never answers, never blocking). */
#include <criterion/criterion.h>
#include <jansson.h>
#include <string.h>

#include "common/common.h"
#include "common/metrics.h"
#include "gateway/spans.h"
#include "tests/tools/otlp_sink.h"
#include "upstream/trace.h"

static const char *const valid_tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

Test(trace, traceparent_valid_is_read)
{
    struct up_traceparent tp;
    cr_assert(up_traceparent_parse(valid_tp, strlen(valid_tp), &tp));
    char hex[33];
    up_trace_hex(hex, tp.trace_id, 16);
    cr_expect_str_eq(hex, "4bf92f3577b34da6a3ce929d0e0e4736");
    up_trace_hex(hex, tp.parent_id, 8);
    cr_expect_str_eq(hex, "00f067aa0ba902b7");
    cr_expect(tp.sampled);
    const char *unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
    cr_assert(up_traceparent_parse(unsampled, strlen(unsampled), &tp));
    cr_expect(!tp.sampled);
    /* a later version may carry more after a '-' */
    const char *v1 = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra";
    cr_expect(up_traceparent_parse(v1, strlen(v1), &tp));
    char out[UP_TRACEPARENT_LEN + 1];
    up_traceparent_format(out, tp.trace_id, tp.parent_id, true);
    cr_expect_str_eq(out, valid_tp);
}

Test(trace, traceparent_invalid_is_refused)
{
    static const char *const bad[] = {
        "",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",   /* short */
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-", /* version 00 is exactly 55 bytes */
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  /* upper case */
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  /* trace id all zero */
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  /* parent id all zero */
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  /* version ff */
        "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  /* separator */
        "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",  /* not hex */
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x", /* later version, no '-' after */
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",  /* flags not hex */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct up_traceparent tp;
        memset(&tp, 0xaa, sizeof tp);
        cr_expect(!up_traceparent_parse(bad[i], strlen(bad[i]), &tp), "accepted '%s'", bad[i]);
        cr_expect_eq(tp.trace_id[0], 0xaa, "'%s' wrote its output", bad[i]);
    }
    struct up_traceparent tp;
    cr_expect(!up_traceparent_parse(NULL, 0, &tp));
}

Test(trace, new_ids_are_random_and_never_zero)
{
    uint8_t a[16], b[16];
    up_trace_new_id(a, 16);
    up_trace_new_id(b, 16);
    cr_expect(memcmp(a, b, 16) != 0);
    for (int i = 0; i < 10000; i++) {
        uint8_t s[8] = {0};
        up_trace_new_id(s, 8);
        uint8_t acc = 0;
        for (int j = 0; j < 8; j++)
            acc |= s[j];
        cr_assert(acc != 0);
    }
}

static struct up_span span_of(const char *name, enum up_span_kind kind, bool root)
{
    struct up_span s;
    memset(&s, 0, sizeof s);
    up_trace_new_id(s.trace_id, 16);
    up_trace_new_id(s.span_id, 8);
    if (!root)
        up_trace_new_id(s.parent_id, 8);
    s.name = name;
    s.kind = kind;
    s.start_ns = up_trace_now_ns();
    s.end_ns = s.start_ns + 1500;
    up_span_set(&s, "payments", "forwarded");
    s.token = 42;
    s.status = 201;
    return s;
}

static const char *attr(json_t *span, const char *key, const char *type)
{
    json_t *a;
    size_t i;
    json_array_foreach(json_object_get(span, "attributes"), i, a)
    {
        if (strcmp(json_string_value(json_object_get(a, "key")), key) == 0)
            return json_string_value(json_object_get(json_object_get(a, "value"), type));
    }
    return NULL;
}

Test(trace, encode_is_otlp_json)
{
    struct up_span sp[2] = {span_of("request", UP_SPAN_SERVER, true), span_of("upstream", UP_SPAN_CLIENT, false)};
    cr_expect_null(up_trace_encode(sp, 0, NULL));
    char *text = up_trace_encode(sp, 2, "svc");
    json_error_t e;
    json_t *root = json_loads(text, 0, &e);
    cr_assert_not_null(root, "not JSON: %s", e.text);
    json_t *rs = json_array_get(json_object_get(root, "resourceSpans"), 0);
    json_t *rattr = json_array_get(json_object_get(json_object_get(rs, "resource"), "attributes"), 0);
    cr_expect_str_eq(json_string_value(json_object_get(rattr, "key")), "service.name");
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(rattr, "value"), "stringValue")), "svc");
    json_t *spans = json_object_get(json_array_get(json_object_get(rs, "scopeSpans"), 0), "spans");
    cr_assert_eq(json_array_size(spans), 2);
    json_t *r = json_array_get(spans, 0), *u = json_array_get(spans, 1);
    char hex[33];
    up_trace_hex(hex, sp[0].trace_id, 16);
    cr_expect_str_eq(json_string_value(json_object_get(r, "traceId")), hex);
    up_trace_hex(hex, sp[0].span_id, 8);
    cr_expect_str_eq(json_string_value(json_object_get(r, "spanId")), hex);
    cr_expect_null(json_object_get(r, "parentSpanId"), "a root span has no parent");
    up_trace_hex(hex, sp[1].parent_id, 8);
    cr_expect_str_eq(json_string_value(json_object_get(u, "parentSpanId")), hex);
    cr_expect_str_eq(json_string_value(json_object_get(r, "name")), "request");
    cr_expect_eq(json_integer_value(json_object_get(r, "kind")), 2);
    cr_expect_eq(json_integer_value(json_object_get(u, "kind")), 3);
    char t[24];
    snprintf(t, sizeof t, "%llu", (unsigned long long)sp[0].start_ns);
    cr_expect_str_eq(json_string_value(json_object_get(r, "startTimeUnixNano")), t, "times are decimal strings");
    cr_expect_str_eq(attr(r, "idemgate.route", "stringValue"), "payments");
    cr_expect_str_eq(attr(r, "idemgate.outcome", "stringValue"), "forwarded");
    cr_expect_str_eq(attr(r, "idemgate.token", "intValue"), "42", "int64 values are strings");
    cr_expect_str_eq(attr(r, "http.response.status_code", "intValue"), "201");
    json_decref(root);
    free(text);
}

Test(trace, sampling_follows_the_parent_else_the_rate)
{
    cr_expect(!up_tracer_sampled(NULL, NULL));
    struct otlp_sink sink;
    cr_assert(otlp_sink_start(&sink, false));
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%u", sink.port);
    struct up_tracer *t = up_tracer_create(&(struct up_tracer_opts){.url = url, .sample = 0.25});
    cr_assert_not_null(t);
    struct up_traceparent on, off;
    cr_assert(up_traceparent_parse(valid_tp, strlen(valid_tp), &on));
    off = on;
    off.sampled = false;
    int yes = 0;
    for (int i = 0; i < 20000; i++) {
        cr_assert(up_tracer_sampled(t, &on));
        cr_assert(!up_tracer_sampled(t, &off));
        yes += up_tracer_sampled(t, NULL);
    }
    cr_expect(yes > 4500 && yes < 5500, "%d of 20000 sampled at 0.25", yes);
    up_tracer_destroy(t);
    otlp_sink_stop(&sink);
}

static uint64_t dropped_metric(void)
{
    struct cm_buf b;
    cm_buf_init(&b, 1 << 20);
    cr_assert(cm_metrics_render(&b));
    const char *p = strstr(b.data, "\nidemgate_trace_spans_dropped_total ");
    cr_assert_not_null(p, "no idemgate_trace_spans_dropped_total");
    uint64_t v = strtoull(p + strlen("\nidemgate_trace_spans_dropped_total "), NULL, 10);
    cm_buf_free(&b);
    return v;
}

Test(trace, spans_reach_the_collector)
{
    cm_metrics_init(0, NULL);
    struct otlp_sink sink;
    cr_assert(otlp_sink_start(&sink, false));
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%u/", sink.port);
    struct up_tracer *t = up_tracer_create(&(struct up_tracer_opts){.url = url, .sample = 1, .flush_ms = 50});
    struct up_span s = span_of("claim", UP_SPAN_INTERNAL, false);
    for (int i = 0; i < 10; i++)
        cr_assert(up_tracer_submit(t, &s));
    for (int i = 0; i < 200 && up_tracer_exported(t) < 10; i++)
        usleep(10000);
    cr_expect_eq(up_tracer_exported(t), 10);
    up_tracer_destroy(t);
    char *all = otlp_sink_all(&sink);
    char hex[33];
    up_trace_hex(hex, s.trace_id, 16);
    cr_expect(strstr(all, hex) != NULL, "the trace id reached the collector: %.200s", all);
    cr_expect(sink.paths_ok, "POST /v1/traces, application/json");
    free(all);
    otlp_sink_stop(&sink);
    cr_expect_eq(dropped_metric(), 0);
}

/* A collector that never answers: submitting stays instant, the full queue drops and counts, destroy is bounded. */
static void never_blocks(bool black_hole)
{
    cm_metrics_init(0, NULL);
    struct otlp_sink sink;
    char url[64];
    if (black_hole) {
        cr_assert(otlp_sink_start(&sink, true));
        snprintf(url, sizeof url, "http://127.0.0.1:%u", sink.port);
    } else {
        snprintf(url, sizeof url, "http://127.0.0.1:1"); /* nothing listens there */
    }
    struct up_tracer *t = up_tracer_create(&(struct up_tracer_opts){.url = url,
                                                                    .sample = 1,
                                                                    .queue_max = 64,
                                                                    .batch_max = 16,
                                                                    .flush_ms = 20,
                                                                    .timeout_ms = 500,
                                                                    .close_wait_ms = 300});
    struct up_span s = span_of("request", UP_SPAN_SERVER, true);
    uint64_t t0 = cm_now_ms();
    size_t accepted = 0;
    for (int i = 0; i < 5000; i++)
        accepted += up_tracer_submit(t, &s);
    uint64_t took = cm_now_ms() - t0;
    cr_expect_lt(took, 500, "5000 submits took %llu ms", (unsigned long long)took);
    cr_expect_lt(accepted, 5000, "a full queue drops");
    t0 = cm_now_ms();
    up_tracer_destroy(t);
    took = cm_now_ms() - t0;
    cr_expect_lt(took, 1500, "destroy took %llu ms", (unsigned long long)took);
    cr_expect_eq(dropped_metric(), 5000, "every span dropped is counted (%zu queued)", accepted);
    if (black_hole) {
        cr_expect_gt(sink.posts, 0, "the black hole was posted to");
        otlp_sink_stop(&sink);
    }
}

Test(trace, a_collector_that_is_down_only_drops_spans)
{
    never_blocks(false);
}

Test(trace, a_collector_that_never_answers_only_drops_spans)
{
    never_blocks(true);
}

/* The gateway's side (gateway/spans.c): the incoming trace id is read with tracing off too (the access log's
 * trace_id), only from a valid traceparent, and nothing is traced without a tracer. */
Test(trace, the_incoming_trace_id_is_read_without_tracing)
{
    struct gw_job job;
    memset(&job, 0, sizeof job);
    gw_trace_begin(&job, NULL, valid_tp);
    cr_expect(job.trace.incoming);
    char hex[33];
    up_trace_hex(hex, job.trace.trace_id, 16);
    cr_expect_str_eq(hex, "4bf92f3577b34da6a3ce929d0e0e4736");
    cr_expect(!job.trace.on && !job.trace.forward, "no tracer: not traced, nothing forwarded");
    char tp[UP_TRACEPARENT_LEN + 1];
    cr_expect(!gw_trace_forward_value(&job, tp));
    gw_trace_begin(&job, NULL, "00-00000000000000000000000000000000-00f067aa0ba902b7-01");
    cr_expect(!job.trace.incoming);
    gw_trace_begin(&job, NULL, NULL);
    cr_expect(!job.trace.incoming);
}
