/* problem.c - RFC 9457 problem+json bodies and the JSON string escaper they use. It never sends anything. */
#include "gateway/problem.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "conf/conf.h"
#include "gateway/gateway.h"

/* Length of the valid UTF-8 sequence at p (1..4), or 0 when it is not one
 * (overlong forms, surrogates and code points above U+10FFFF are invalid). */
static size_t utf8_seq_len(const unsigned char *p, size_t n)
{
    unsigned char c = p[0];
    size_t len;
    uint32_t cp;
    if (c >= 0xc2 && c <= 0xdf) {
        len = 2;
        cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        cp = c & 0x07;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xc0) != 0x80)
            return 0;
        cp = (cp << 6) | (p[i] & 0x3f);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
        return 0;
    return len;
}

/* Escapes ", \ and control bytes (as \u00XX); valid UTF-8 passes through,
 * each invalid byte becomes U+FFFD so that the output is always valid JSON. */
bool gw_json_escape(struct cm_buf *out, const char *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)s;
    size_t run = 0; /* start of the pending pass-through bytes */
    size_t i = 0;
    while (i < n) {
        unsigned char c = p[i];
        char esc[8];
        size_t esc_len = 0;
        size_t adv = 1;
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            esc_len = 2;
        } else if (c < 0x20 || c == 0x7f) {
            memcpy(esc, "\\u00", 4);
            esc[4] = hex[c >> 4];
            esc[5] = hex[c & 0xf];
            esc_len = 6;
        } else if (c >= 0x80) {
            adv = utf8_seq_len(p + i, n - i);
            if (adv == 0) {
                memcpy(esc, "\\ufffd", 6);
                esc_len = 6;
                adv = 1;
            }
        }
        if (esc_len > 0) {
            if (!cm_buf_append(out, p + run, i - run) || !cm_buf_append(out, esc, esc_len))
                return false;
            run = i + adv;
        }
        i += adv;
    }
    return cm_buf_append(out, p + run, n - run);
}

static bool put_string(struct cm_buf *b, const char *s)
{
    if (!s)
        s = "";
    return cm_buf_append(b, "\"", 1) && gw_json_escape(b, s, strlen(s)) && cm_buf_append(b, "\"", 1);
}

const char *gw_problem_stripe_type(int status, const char *name)
{
    static const char *const ordering[] = {"stale-sequence", "sequence-gap", "sequence-in-use"};
    if (status == 401)
        return "authentication_error";
    if ((status == 409 || status == 422) && name) {
        if (strncmp(name, "idempotency-", 12) == 0)
            return "idempotency_error";
        for (size_t i = 0; i < sizeof ordering / sizeof ordering[0]; i++)
            if (strcmp(name, ordering[i]) == 0)
                return "idempotency_error";
    }
    if (status >= 400 && status < 500)
        return "invalid_request_error";
    return "api_error";
}

static bool put_extra(struct cm_buf *b, const char *extra)
{
    return !extra || !*extra || (cm_buf_append(b, ",", 1) && cm_buf_append(b, extra, strlen(extra)));
}

static bool render_problem(struct cm_buf *b, const struct gw_problem *p)
{
    const char *name = p->name ? p->name : "";
    return cm_buf_append(b, "{\"type\":\"" GW_PROBLEM_TYPE_PREFIX, strlen("{\"type\":\"" GW_PROBLEM_TYPE_PREFIX)) &&
           gw_json_escape(b, name, strlen(name)) && cm_buf_append(b, "\",\"title\":", 10) && put_string(b, p->title) &&
           cm_buf_appendf(b, ",\"status\":%d,\"detail\":", p->status) && put_string(b, p->detail) &&
           put_extra(b, p->extra) && cm_buf_append(b, "}", 1);
}

static bool render_stripe(struct cm_buf *b, const struct gw_problem *p)
{
    return cm_buf_appendf(b, "{\"error\":{\"type\":\"%s\",\"code\":", gw_problem_stripe_type(p->status, p->name)) &&
           put_string(b, p->name) && cm_buf_append(b, ",\"message\":", 11) && put_string(b, p->detail) &&
           put_extra(b, p->extra) && cm_buf_append(b, "}}", 2);
}

static bool render_template(struct cm_buf *b, const char *t, const struct gw_problem *p)
{
    size_t n = strlen(t), run = 0;
    for (size_t i = 0; i < n; i++) {
        size_t l = 0;
        enum conf_tmpl_var v = t[i] == '{' ? conf_tmpl_var_at(t + i, n - i, &l) : CONF_TMPL_NONE;
        if (v == CONF_TMPL_NONE)
            continue;
        const char *s = v == CONF_TMPL_NAME ? p->name : v == CONF_TMPL_TITLE ? p->title : p->detail;
        bool ok = cm_buf_append(b, t + run, i - run);
        if (v == CONF_TMPL_STATUS)
            ok = ok && cm_buf_appendf(b, "%d", p->status);
        else
            ok = ok && gw_json_escape(b, s ? s : "", s ? strlen(s) : 0);
        if (!ok)
            return false;
        i += l - 1;
        run = i + 1;
    }
    return cm_buf_append(b, t + run, n - run);
}

char *gw_problem_render(const struct conf_errors *e, const struct gw_problem *p, size_t *len, const char **ctype)
{
    struct cm_buf b;
    /* No real cap: the inputs are our own strings and the route's template, and the allocator aborts on OOM. */
    cm_buf_init(&b, SIZE_MAX / 4);
    enum conf_errors_kind kind = e ? e->kind : CONF_ERRORS_PROBLEM;
    bool ok;
    const char *ct = GW_PROBLEM_CONTENT_TYPE;
    if (kind == CONF_ERRORS_STRIPE) {
        ok = render_stripe(&b, p);
        ct = "application/json";
    } else if (kind == CONF_ERRORS_TEMPLATE && e->tmpl) {
        ok = render_template(&b, e->tmpl, p);
        ct = e->content_type ? e->content_type : "application/json";
    } else {
        ok = render_problem(&b, p);
    }
    if (!ok) {
        /* Unreachable with an uncapped buffer; keep the promise of never failing. */
        cm_buf_free(&b);
        char *s = cm_strdup("{\"type\":\"" GW_PROBLEM_TYPE_PREFIX "error\",\"title\":\"Error\",\"status\":500,"
                            "\"detail\":\"\"}");
        if (len)
            *len = strlen(s);
        if (ctype)
            *ctype = GW_PROBLEM_CONTENT_TYPE;
        return s;
    }
    size_t n = 0;
    char *s = cm_buf_take(&b, &n);
    if (len)
        *len = n;
    if (ctype)
        *ctype = ct;
    return s;
}

char *gw_problem_json(int status, const char *name, const char *title, const char *detail, size_t *len)
{
    struct gw_problem p = {status, name, title, detail, NULL};
    return gw_problem_render(NULL, &p, len, NULL);
}

void gw_job_problem_ext(struct gw_job *job, int status, const char *name, const char *title, const char *detail,
                        const char *extra)
{
    /* SPEC 11: every problem body names the request (its id may hold any visible ASCII from a trusted proxy) */
    struct cm_buf ext;
    cm_buf_init(&ext, SIZE_MAX / 4);
    bool ok = (!extra || cm_buf_appendf(&ext, "%s,", extra)) && cm_buf_append(&ext, "\"request_id\":\"", 14) &&
              gw_json_escape(&ext, job->request_id, strlen(job->request_id)) && cm_buf_append(&ext, "\"", 1);
    struct gw_problem p = {status, name, title, detail, ok ? ext.data : extra};
    const char *ctype;
    size_t len;
    char *body = gw_problem_render(job->route ? &job->route->errors : NULL, &p, &len, &ctype);
    cm_buf_free(&ext);
    cm_hdrs_free(&job->resp_hdrs);
    cm_buf_free(&job->resp_body);
    cm_buf_init(&job->resp_body, len + 1);
    if (!cm_buf_append(&job->resp_body, body, len))
        abort(); /* cannot happen: the cap fits */
    free(body);
    cm_hdrs_add(&job->resp_hdrs, "Content-Type", ctype);
    job->status = status;
    /* SPEC 9: Stripe's SDKs retry a 409 unless told not to; a 503 turns to true when it gets a Retry-After */
    if (job->route && job->route->errors.kind == CONF_ERRORS_STRIPE)
        cm_hdrs_add(&job->resp_hdrs, "Stripe-Should-Retry",
                    status == 409 && name && strcmp(name, "idempotency-key-in-use") == 0 ? "true" : "false");
}

void gw_job_retry_after(struct gw_job *job, uint64_t ms)
{
    char v[32];
    uint64_t s = ms / 1000 + (ms % 1000 != 0);
    snprintf(v, sizeof v, "%llu", (unsigned long long)(s ? s : 1));
    cm_hdrs_add(&job->resp_hdrs, "Retry-After", v);
    if (job->status == 503 && cm_hdrs_remove(&job->resp_hdrs, "Stripe-Should-Retry") > 0)
        cm_hdrs_add(&job->resp_hdrs, "Stripe-Should-Retry", "true");
}

void gw_job_problem(struct gw_job *job, int status, const char *name, const char *title, const char *detail)
{
    gw_job_problem_ext(job, status, name, title, detail, NULL);
}
