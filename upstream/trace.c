/* trace.c - W3C traceparent, span records and their OTLP/HTTP JSON export (jansson, libcurl) from a bounded queue by
 * one exporter thread: a request only copies its span into the queue; a slow or dead collector only drops spans. */
#include "upstream/trace.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <curl/curl.h>
#include <jansson.h>
#include <openssl/rand.h>

#include "common/metrics.h"

/* ---- traceparent */

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1; /* upper case is invalid in traceparent */
}

/* n bytes from 2n lower-case hex digits; false on any other character. */
static bool unhex(const char *s, uint8_t *out, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int hi = hexval(s[2 * i]), lo = hexval(s[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return false;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return true;
}

static bool all_zero(const uint8_t *b, size_t n)
{
    uint8_t acc = 0;
    for (size_t i = 0; i < n; i++)
        acc |= b[i];
    return acc == 0;
}

bool up_traceparent_parse(const char *s, size_t n, struct up_traceparent *out)
{
    uint8_t ver, flags;
    struct up_traceparent tp;
    if (s == NULL || n < UP_TRACEPARENT_LEN || !unhex(s, &ver, 1) || ver == 0xff)
        return false;
    /* version 00 is exactly 55 bytes; a later version may append fields after a '-' */
    if (ver == 0 ? n != UP_TRACEPARENT_LEN : (n > UP_TRACEPARENT_LEN && s[UP_TRACEPARENT_LEN] != '-'))
        return false;
    if (s[2] != '-' || s[35] != '-' || s[52] != '-' || !unhex(s + 3, tp.trace_id, 16) ||
        !unhex(s + 36, tp.parent_id, 8) || !unhex(s + 53, &flags, 1))
        return false;
    if (all_zero(tp.trace_id, 16) || all_zero(tp.parent_id, 8))
        return false;
    tp.sampled = (flags & 1) != 0;
    *out = tp;
    return true;
}

void up_trace_hex(char *out, const uint8_t *b, size_t n)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 15];
    }
    out[2 * n] = '\0';
}

void up_traceparent_format(char out[UP_TRACEPARENT_LEN + 1], const uint8_t trace_id[16], const uint8_t span_id[8],
                           bool sampled)
{
    memcpy(out, "00-", 3);
    up_trace_hex(out + 3, trace_id, 16);
    out[35] = '-';
    up_trace_hex(out + 36, span_id, 8);
    out[52] = '-';
    out[53] = '0';
    out[54] = sampled ? '1' : '0';
    out[55] = '\0';
}

/* Ids come from a per-thread block of CSPRNG output (one RAND_bytes call per block, not per id). */
#define ID_BLOCK 512
void up_trace_new_id(uint8_t *out, size_t n)
{
    static _Thread_local uint8_t block[ID_BLOCK];
    static _Thread_local size_t left;
    if (n > 32)
        n = 32;
    do {
        if (left < n) {
            if (RAND_bytes(block, sizeof block) != 1)
                abort();
            left = sizeof block;
        }
        left -= n;
        memcpy(out, block + left, n);
        memset(block + left, 0, n); /* drawn once */
    } while (all_zero(out, n));
}

uint64_t up_trace_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void copy_cut(char *dst, size_t cap, const char *src)
{
    size_t n = src ? strnlen(src, cap - 1) : 0;
    if (n)
        memcpy(dst, src, n);
    dst[n] = '\0';
}

void up_span_set(struct up_span *s, const char *route, const char *outcome)
{
    if (route != NULL)
        copy_cut(s->route, sizeof s->route, route);
    if (outcome != NULL)
        copy_cut(s->outcome, sizeof s->outcome, outcome);
}

/* ---- OTLP/HTTP JSON */

static json_t *attr_str(const char *key, const char *v)
{
    return json_pack("{s:s, s:{s:s}}", "key", key, "value", "stringValue", v);
}

/* OTLP JSON writes 64-bit integers as strings (the protobuf JSON mapping). */
static json_t *attr_int(const char *key, uint64_t v)
{
    char b[24];
    snprintf(b, sizeof b, "%" PRIu64, v);
    return json_pack("{s:s, s:{s:s}}", "key", key, "value", "intValue", b);
}

static json_t *span_json(const struct up_span *s)
{
    char tid[33], sid[17], pid[17], t0[24], t1[24];
    up_trace_hex(tid, s->trace_id, 16);
    up_trace_hex(sid, s->span_id, 8);
    snprintf(t0, sizeof t0, "%" PRIu64, s->start_ns);
    snprintf(t1, sizeof t1, "%" PRIu64, s->end_ns >= s->start_ns ? s->end_ns : s->start_ns);
    json_t *attrs = json_array();
    if (s->route[0])
        json_array_append_new(attrs, attr_str("idemgate.route", s->route));
    if (s->outcome[0])
        json_array_append_new(attrs, attr_str("idemgate.outcome", s->outcome));
    if (s->token)
        json_array_append_new(attrs, attr_int("idemgate.token", s->token));
    if (s->status)
        json_array_append_new(attrs, attr_int("http.response.status_code", (uint64_t)s->status));
    json_t *j = json_pack("{s:s, s:s, s:s, s:i, s:s, s:s, s:o, s:{s:i}}", "traceId", tid, "spanId", sid, "name",
                          s->name ? s->name : "span", "kind", (int)s->kind, "startTimeUnixNano", t0, "endTimeUnixNano",
                          t1, "attributes", attrs, "status", "code", s->error ? 2 : 0);
    if (j != NULL && !all_zero(s->parent_id, 8)) {
        up_trace_hex(pid, s->parent_id, 8);
        json_object_set_new(j, "parentSpanId", json_string(pid));
    }
    return j;
}

char *up_trace_encode(const struct up_span *spans, size_t n, const char *service)
{
    if (n == 0)
        return NULL;
    json_t *arr = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(arr, span_json(&spans[i]));
    json_t *root = json_pack("{s:[{s:{s:[o]}, s:[{s:{s:s}, s:o}]}]}", "resourceSpans", "resource", "attributes",
                             attr_str("service.name", service ? service : "idemgate"), "scopeSpans", "scope", "name",
                             "idemgate", "spans", arr);
    if (root == NULL)
        abort(); /* json_pack fails only on a format error or out of memory */
    char *text = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (text == NULL)
        abort();
    return text;
}

/* ---- the exporter */

struct up_tracer {
    char *endpoint; /* URL/v1/traces */
    char *service;
    double sample;
    size_t batch_max;
    uint64_t flush_ms, timeout_ms, close_wait_ms;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct up_span *ring; /* queue_max slots */
    size_t cap, head, len;
    bool stop;
    pthread_t thread;
    _Atomic uint64_t exported;
};

static size_t discard_body(char *p, size_t size, size_t nmemb, void *arg)
{
    (void)p;
    (void)arg;
    return size * nmemb;
}

/* POSTs one batch within timeout_ms; returns whether the collector answered 2xx. */
static bool post(struct up_tracer *t, CURL *h, const char *body, uint64_t timeout_ms)
{
    if (timeout_ms == 0)
        return false;
    struct curl_slist *hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_setopt(h, CURLOPT_URL, t->endpoint);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdrs);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)(timeout_ms / 2 ? timeout_ms / 2 : 1));
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, discard_body);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 0L);
    CURLcode rc = curl_easy_perform(h);
    long code = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, NULL);
    curl_slist_free_all(hdrs);
    if (rc != CURLE_OK || code < 200 || code > 299) {
        cm_log(CM_DEBUG, "trace_export_failed", "error=\"%s\" status=%ld", curl_easy_strerror(rc), code);
        return false;
    }
    return true;
}

static void export_batch(struct up_tracer *t, CURL *h, const struct up_span *b, size_t n, uint64_t timeout_ms)
{
    char *body = up_trace_encode(b, n, t->service);
    bool ok = h != NULL && post(t, h, body, timeout_ms);
    free(body);
    if (ok)
        atomic_fetch_add_explicit(&t->exported, n, memory_order_relaxed);
    else
        cm_metric_trace_dropped(n);
}

static void deadline_in(struct timespec *ts, uint64_t ms)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += (time_t)(ms / 1000);
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static void *exporter_main(void *arg)
{
    struct up_tracer *t = arg;
    CURL *h = curl_easy_init();
    struct up_span *batch = cm_calloc(t->batch_max, sizeof *batch);
    uint64_t close_until = 0;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        if (!t->stop && t->len < t->batch_max) {
            struct timespec until;
            deadline_in(&until, t->flush_ms);
            int rc = 0;
            while (!t->stop && t->len < t->batch_max && rc != ETIMEDOUT)
                rc = pthread_cond_timedwait(&t->cv, &t->mu, &until);
        }
        if (t->stop && close_until == 0)
            close_until = cm_now_ms() + t->close_wait_ms;
        size_t n = t->len < t->batch_max ? t->len : t->batch_max;
        for (size_t i = 0; i < n; i++)
            batch[i] = t->ring[(t->head + i) % t->cap];
        t->head = (t->head + n) % t->cap;
        t->len -= n;
        bool stop = t->stop;
        pthread_mutex_unlock(&t->mu);
        if (n > 0) {
            uint64_t timeout = t->timeout_ms;
            if (stop) {
                uint64_t now = cm_now_ms();
                timeout = now >= close_until ? 0 : close_until - now < timeout ? close_until - now : timeout;
            }
            export_batch(t, h, batch, n, timeout);
        }
        pthread_mutex_lock(&t->mu);
        if (t->stop && t->len == 0)
            break;
    }
    pthread_mutex_unlock(&t->mu);
    free(batch);
    if (h != NULL)
        curl_easy_cleanup(h);
    return NULL;
}

/* What create set up, once the thread is gone (or was never started). */
static void tracer_free(struct up_tracer *t)
{
    pthread_cond_destroy(&t->cv);
    pthread_mutex_destroy(&t->mu);
    free(t->ring);
    free(t->service);
    free(t->endpoint);
    free(t);
    curl_global_cleanup();
}

struct up_tracer *up_tracer_create(const struct up_tracer_opts *o)
{
    if (o == NULL || o->url == NULL)
        return NULL;
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        cm_log(CM_ERROR, "trace_start_failed", "error=\"curl_global_init failed\"");
        return NULL;
    }
    struct up_tracer *t = cm_calloc(1, sizeof *t);
    size_t ul = strlen(o->url);
    while (ul > 0 && o->url[ul - 1] == '/')
        ul--;
    t->endpoint = cm_asprintf("%.*s/v1/traces", (int)ul, o->url);
    t->service = cm_strdup(o->service_name ? o->service_name : "idemgate");
    t->sample = o->sample < 0 ? 0 : o->sample > 1 ? 1 : o->sample;
    t->cap = o->queue_max ? o->queue_max : 2048;
    t->batch_max = o->batch_max ? o->batch_max : 256;
    if (t->batch_max > t->cap)
        t->batch_max = t->cap;
    t->flush_ms = o->flush_ms ? o->flush_ms : 1000;
    t->timeout_ms = o->timeout_ms ? o->timeout_ms : 2000;
    t->close_wait_ms = o->close_wait_ms ? o->close_wait_ms : 1000;
    t->ring = cm_calloc(t->cap, sizeof *t->ring);
    pthread_mutex_init(&t->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&t->cv, &ca);
    pthread_condattr_destroy(&ca);
    int rc = pthread_create(&t->thread, NULL, exporter_main, t);
    if (rc != 0) {
        cm_log(CM_ERROR, "trace_start_failed", "error=\"%s\"", strerror(rc));
        goto fail;
    }
    return t;
fail:
    tracer_free(t);
    return NULL;
}

void up_tracer_destroy(struct up_tracer *t)
{
    if (t == NULL)
        return;
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->thread, NULL);
    tracer_free(t);
}

bool up_tracer_sampled(const struct up_tracer *t, const struct up_traceparent *parent)
{
    if (t == NULL)
        return false;
    if (parent != NULL)
        return parent->sampled;
    if (t->sample >= 1)
        return true;
    if (t->sample <= 0)
        return false;
    uint8_t r[8];
    up_trace_new_id(r, sizeof r);
    uint64_t v = 0;
    for (size_t i = 0; i < 7; i++)
        v = v << 8 | r[i];
    return (double)(v >> 3) / (double)(UINT64_C(1) << 53) < t->sample;
}

bool up_tracer_submit(struct up_tracer *t, const struct up_span *s)
{
    if (t == NULL)
        return false;
    pthread_mutex_lock(&t->mu);
    bool ok = !t->stop && t->len < t->cap;
    if (ok) {
        t->ring[(t->head + t->len) % t->cap] = *s;
        t->len++;
        if (t->len == t->batch_max)
            pthread_cond_signal(&t->cv);
    }
    pthread_mutex_unlock(&t->mu);
    if (!ok)
        cm_metric_trace_dropped(1);
    return ok;
}

uint64_t up_tracer_exported(const struct up_tracer *t)
{
    return t ? atomic_load_explicit(&t->exported, memory_order_relaxed) : 0;
}
