/* adminkeys.c - settling an unknown outcome by hand (POST /admin/keys/settle): the answer's JSON body checked and
 * decoded, then the record taken under a token of its own and completed with it; never the HTTP side (admin.c). */
#include "gateway/adminkeys.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "gateway/problem.h"

#define SETTLE_HOLD_MS 10000 /* the take's lease: the completion comes right after it */
#define SETTLE_HEADERS 100   /* at most this many headers in a settled answer */

/* Decodes standard base64 (RFC 4648 4, '=' padding optional, no white space) s[0..n) into out (capped). */
static bool b64_decode(const char *s, size_t n, struct cm_buf *out)
{
    static const char alpha[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    while (n > 0 && s[n - 1] == '=' && n % 4 != 1)
        n--;
    if (n % 4 == 1)
        return false;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n; i++) {
        const char *q = s[i] ? memchr(alpha, s[i], 64) : NULL;
        if (!q)
            return false;
        acc = acc << 6 | (uint32_t)(q - alpha);
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            char ch = (char)(acc >> bits & 0xff);
            if (!cm_buf_append(out, &ch, 1))
                return false;
        }
    }
    return true;
}

/* Headers the gateway writes itself on every answer, or that frame the connection: never part of a stored answer. */
static bool framing_header(const char *name)
{
    static const char *const names[] = {"content-length", "transfer-encoding", "connection",
                                        "keep-alive",     "upgrade",           "te",
                                        "trailer",        "proxy-connection"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcasecmp(name, names[i]) == 0)
            return true;
    return false;
}

const char *gw_settle_parse(const char *body, size_t len, uint64_t max_response, struct cm_resp *out)
{
    cm_resp_init(out, max_response);
    json_error_t jerr;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
    const char *why = NULL;
    if (!root || !json_is_object(root)) {
        why = "the body is not a JSON object";
        goto out;
    }
    const char *k;
    json_t *v;
    json_object_foreach(root, k, v)
    {
        if (strcmp(k, "status") != 0 && strcmp(k, "headers") != 0 && strcmp(k, "body_base64") != 0) {
            why = "unknown member: the body has status, headers and body_base64";
            goto out;
        }
    }
    json_t *st = json_object_get(root, "status");
    if (!json_is_integer(st) || json_integer_value(st) < 100 || json_integer_value(st) > 599) {
        why = "status must be an integer from 100 to 599";
        goto out;
    }
    out->status = (int)json_integer_value(st);
    json_t *hs = json_object_get(root, "headers");
    if (hs && (!json_is_array(hs) || json_array_size(hs) > SETTLE_HEADERS)) {
        why = "headers must be an array of at most 100 [name, value] pairs";
        goto out;
    }
    size_t i;
    json_t *h;
    json_array_foreach(hs, i, h)
    {
        json_t *n = json_array_get(h, 0), *val = json_array_get(h, 1);
        if (!json_is_array(h) || json_array_size(h) != 2 || !json_is_string(n) || !json_is_string(val)) {
            why = "each header must be a [name, value] pair of strings";
            goto out;
        }
        const char *name = json_string_value(n), *value = json_string_value(val);
        size_t nl = json_string_length(n), vl = json_string_length(val);
        if (!cm_token_ok(name, nl) || strlen(name) != nl || !cm_field_value_ok(value, vl) || strlen(value) != vl ||
            nl + vl > 8192) {
            why = "a header name is not a token, or its value holds a control byte (or is over 8 KiB)";
            goto out;
        }
        if (framing_header(name)) {
            why = "a framing header (Content-Length, Transfer-Encoding, Connection...) is never stored";
            goto out;
        }
        cm_hdrs_addn(&out->hdrs, name, nl, value, vl);
    }
    json_t *b = json_object_get(root, "body_base64");
    if (b && !json_is_string(b)) {
        why = "body_base64 must be a string";
        goto out;
    }
    if (b && !b64_decode(json_string_value(b), json_string_length(b), &out->body))
        why = "body_base64 is not base64, or the body is larger than the route's max_response";
out:
    json_decref(root);
    return why;
}

struct settle {
    struct store *st;
    struct store_id id;
    char *route;
    char *key;
    uint64_t token;
    struct cm_resp resp;
    uint64_t retention_ms;
    uint64_t retry_ms;
    gw_settle_cb cb;
    void *arg;
    char *rid_header;                       /* the configuration's request_id_header */
    char request_id[CM_REQUEST_ID_MAX + 1]; /* the record's: the request that claimed it (store_settle_take) */
};

static void settle_end(struct settle *s, int status, char *json)
{
    s->cb(s->arg, status, json);
    cm_resp_free(&s->resp);
    free(s->route);
    free(s->key);
    free(s->rid_header);
    free(s);
}

static char *problem(int status, const char *name, const char *title, const char *detail)
{
    size_t len;
    return gw_problem_json(status, name, title, detail, &len);
}

static void completed(void *arg, bool ok, long rows)
{
    struct settle *s = arg;
    if (!ok)
        settle_end(s, 503,
                   problem(503, "store-unavailable", "Store unavailable",
                           "the record was taken but its answer could not be written: it stays an unknown outcome; "
                           "repeat the request"));
    else if (rows == 0) /* taken over meanwhile: a prober's or another settle's token now */
        settle_end(s, 409, problem(409, "not-settleable", "Not settleable", "the record changed meanwhile"));
    else
        settle_end(s, 200, cm_asprintf("{\"settled\":true,\"state\":\"completed\",\"status\":%d}", s->resp.status));
}

static void taken(void *arg, bool ok, long rows)
{
    struct settle *s = arg;
    if (!ok) {
        settle_end(s, 503, problem(503, "store-unavailable", "Store unavailable", "nothing was done"));
        return;
    }
    if (rows < 0) {
        settle_end(s, 404, problem(404, "not-found", "Not found", "no record with this route, key and scope"));
        return;
    }
    if (rows == 0) {
        settle_end(s, 409,
                   problem(409, "not-settleable", "Not settleable",
                           "the record is not an unknown outcome (completed, or in flight within its lease)"));
        return;
    }
    /* SPEC 11: as an answer the gateway stores, the settled one carries the id of the request that executed, so
     * that every replay of it (from Postgres, Redis or the replay cache) names that request */
    if (s->request_id[0] && cm_request_id_ok(s->request_id, strlen(s->request_id))) {
        cm_hdrs_remove(&s->resp.hdrs, s->rid_header);
        cm_hdrs_add(&s->resp.hdrs, s->rid_header, s->request_id);
    }
    store_complete(s->st, &s->id, s->token, &s->resp, s->retention_ms, s->retry_ms, completed, s);
}

void gw_settle_run(struct store *st, const struct store_id *id, struct cm_resp *resp, uint64_t retention_ms,
                   uint64_t retry_ms, const char *rid_header, gw_settle_cb cb, void *arg)
{
    struct settle *s = cm_calloc(1, sizeof *s);
    s->st = st;
    s->route = cm_strdup(id->route);
    s->key = cm_strndup(id->key, id->key_len);
    s->id = *id;
    s->id.route = s->route;
    s->id.key = s->key;
    s->resp = *resp; /* moved */
    cm_resp_init(resp, 0);
    s->retention_ms = retention_ms;
    s->retry_ms = retry_ms;
    s->cb = cb;
    s->arg = arg;
    s->token = cm_random_token();
    s->rid_header = cm_strdup(rid_header);
    store_settle_take(st, &s->id, s->token, SETTLE_HOLD_MS, s->request_id, sizeof s->request_id, taken, s);
}
