/* admin.c - the admin key API's queries (list, page through a route, purge, release: gateway/admin.c) and their JSON
 * answers, with the purge epoch moved on before a purge or release answers. Never a claim or an owner's operation. */
#include "store/internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- admin */

static void json_str(struct cm_buf *b, const char *p, size_t n)
{
    bool ok = cm_buf_append(b, "\"", 1);
    for (size_t i = 0; i < n && ok; i++) {
        unsigned char ch = (unsigned char)p[i];
        if (ch == '"' || ch == '\\') {
            char e[2] = {'\\', (char)ch};
            ok = cm_buf_append(b, e, 2);
        } else if (ch < 0x20 || ch == 0x7f) {
            ok = cm_buf_appendf(b, "\\u%04x", ch);
        } else {
            ok = cm_buf_append(b, &p[i], 1);
        }
    }
    if (ok)
        ok = cm_buf_append(b, "\"", 1);
    (void)ok; /* a capped-out body is reported by the caller (truncation check) */
}

static char *problem_json(int status, const char *name, const char *title, const char *detail)
{
    struct cm_buf b;
    cm_buf_init(&b, 4096);
    bool ok = cm_buf_appendf(&b, "{\"type\":\"" STORE_PROBLEM_PREFIX "%s\",\"title\":", name);
    json_str(&b, title, strlen(title));
    ok = ok && cm_buf_appendf(&b, ",\"status\":%d,\"detail\":", status);
    json_str(&b, detail, strlen(detail));
    ok = ok && cm_buf_append(&b, "}", 1);
    (void)ok;
    size_t n;
    char *s = cm_buf_take(&b, &n);
    cm_buf_free(&b);
    return s ? s : cm_strdup("{}");
}

static void admin_answer(struct store_i_admin_op *a, int status, char *json)
{
    store_i_op_unlink(&a->h);
    a->cb(a->arg, status, json);
    store_i_op_free(&a->h);
}

static void admin_bumped_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store_i_admin_op *a = arg;
    char *json = a->json;
    a->json = NULL;
    if (st != STORE_PG_OK || PQntuples(pr) != 1) {
        store_i_log_pg_failure("purge_epoch", st, st == STORE_PG_OK ? "no epoch row" : msg);
        free(json);
        admin_answer(a, 503,
                     problem_json(503, "store-unavailable", "Store unavailable",
                                  "the records were deleted, but the purge epoch could not be moved on: repeat the "
                                  "request (until it is, an answer Redis holds may still be replayed)"));
        return;
    }
    store_epoch_heard(a->h.s->epoch, strtoull(PQgetvalue(pr, 0, 0), NULL, 10));
    admin_answer(a, a->status, json);
}

/* The answer; a purge or release that succeeded first moves the purge epoch on (store.h), in a transaction of its
 * own after the deletion committed (a claim that read the record before then knew an older epoch), and this
 * process hears of it before answering. */
static void admin_finish(struct store_i_admin_op *a, int status, char *json)
{
    if (a->bump && status == 200) {
        a->bump = false;
        a->status = status;
        a->json = json;
        struct store_pg_param p[2] = {{a->route, strlen(a->route), true}, {a->key, a->key_len, true}};
        store_pg_query(a->h.s->pg, STORE_S_EPOCH_BUMP, p, 2, 0, admin_bumped_cb, a);
        return;
    }
    admin_answer(a, status, json);
}

static void admin_deleted_cb(void *arg, const struct redisReply *reply)
{
    struct store_i_admin_op *a = arg;
    char *json = a->json;
    a->json = NULL;
    admin_finish(a, a->status, json);
}

/* Removes the Redis markers of the scopes in column col (only rows marked 'd' when only_d), then answers
 * status/json: the answer waits for the DEL (bounded by redis_timeout), so that a retry sent right after it
 * does not find an in-flight marker of a key that is gone. */
static void admin_del_then_finish(struct store_i_admin_op *a, const PGresult *pr, int col, bool only_d, int status,
                                  char *json)
{
    struct store *s = a->h.s;
    int n = PQntuples(pr), k = 0;
    const char **argv = cm_malloc(((size_t)n + 1) * sizeof *argv);
    size_t *lens = cm_malloc(((size_t)n + 1) * sizeof *lens);
    char(*rks)[STORE_RKEY_LEN + 1] = cm_malloc(((size_t)n + 1) * sizeof *rks);
    argv[0] = "DEL";
    lens[0] = 3;
    for (int i = 0; i < n; i++) {
        if (only_d && PQgetvalue(pr, i, 0)[0] != 'd')
            continue;
        if (PQgetisnull(pr, i, col) || PQgetlength(pr, i, col) != 32)
            continue;
        store_i_redis_key(a->route, (const uint8_t *)PQgetvalue(pr, i, col), a->key, a->key_len, rks[k]);
        argv[k + 1] = rks[k];
        lens[k + 1] = strlen(rks[k]);
        k++;
    }
    bool sent = k > 0 && s->rd && store_rd_command(s->rd, admin_deleted_cb, a, k + 1, argv, lens);
    free(argv);
    free(lens);
    free(rks);
    if (sent) {
        a->status = status;
        a->json = json;
        return;
    }
    admin_finish(a, status, json);
}

/* Rows 0..n-1 of a listing (the columns of sql_admin_list) as JSON objects, comma-separated, into b. */
static bool admin_rows_json(struct cm_buf *b, const PGresult *pr, int n)
{
    bool ok = true;
    static const char *const names[] = {"route", "key",        "scope",      "state",
                                        "token", "created_at", "expires_at", "lease_until"};
    for (int i = 0; i < n && ok; i++) {
        ok = cm_buf_append(b, i ? ",{" : "{", i ? 2 : 1);
        for (int col = 0; col < 8 && ok; col++) {
            ok = cm_buf_appendf(b, "%s\"%s\":", col ? "," : "", names[col]);
            json_str(b, PQgetvalue(pr, i, col), (size_t)PQgetlength(pr, i, col));
        }
        if (ok && !PQgetisnull(pr, i, 8)) {
            char *end = NULL;
            long st = strtol(PQgetvalue(pr, i, 8), &end, 10);
            ok = cm_buf_appendf(b, ",\"status\":%ld", st);
        }
        if (ok && !PQgetisnull(pr, i, 9)) {
            ok = cm_buf_append(b, ",\"completed_at\":", 16);
            json_str(b, PQgetvalue(pr, i, 9), (size_t)PQgetlength(pr, i, 9));
        }
        ok = ok && cm_buf_append(b, "}", 1);
    }
    return ok;
}

static char *admin_list_json(const PGresult *pr)
{
    struct cm_buf b;
    cm_buf_init(&b, STORE_ADMIN_JSON_MAX);
    bool ok = cm_buf_append(&b, "[", 1) && admin_rows_json(&b, pr, PQntuples(pr)) && cm_buf_append(&b, "]", 1);
    if (!ok) {
        cm_buf_free(&b);
        return NULL;
    }
    size_t n;
    char *s = cm_buf_take(&b, &n);
    cm_buf_free(&b);
    return s;
}

/* ---- the listing's cursor: base64url (no padding) of "TIME|SCOPEHEX|KEY" (TIME the created_at of the page's last
 * record, "YYYY-MM-DD HH:MM:SS.UUUUUU" UTC), opaque to its users */

static const char b64url[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

static bool cursor_append(struct cm_buf *b, const char *p, size_t n)
{
    bool ok = true;
    for (size_t i = 0; i < n && ok; i += 3) {
        uint32_t v = (uint32_t)(unsigned char)p[i] << 16;
        size_t k = n - i >= 3 ? 3 : n - i;
        if (k > 1)
            v |= (uint32_t)(unsigned char)p[i + 1] << 8;
        if (k > 2)
            v |= (unsigned char)p[i + 2];
        char out[4] = {b64url[v >> 18 & 63], b64url[v >> 12 & 63], b64url[v >> 6 & 63], b64url[v & 63]};
        ok = cm_buf_append(b, out, k + 1);
    }
    return ok;
}

/* Decodes cursor c into out (size n, NUL-terminated); false when it is not base64url or too long. */
static bool cursor_b64_decode(const char *c, char *out, size_t n, size_t *len)
{
    size_t cl = strlen(c), o = 0;
    if (cl % 4 == 1 || cl / 4 * 3 + 3 > n)
        return false;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < cl; i++) {
        const char *q = memchr(b64url, c[i], 64);
        if (!q || !c[i])
            return false;
        acc = acc << 6 | (uint32_t)(q - b64url);
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[o++] = (char)(acc >> bits & 0xff);
        }
    }
    if (acc & ((1u << bits) - 1)) /* the spare bits of the last character are zero in a cursor we made */
        return false;
    out[o] = '\0';
    *len = o;
    return true;
}

/* The parts of a cursor made by the listing: time (26 bytes), scope hex (even, at most 64), key (1 to 1,024
 * visible bytes); false for anything else. */
struct page_cursor {
    char time[32];
    char scope[65];
    char key[1025];
};
static bool cursor_decode(const char *c, struct page_cursor *pc)
{
    char raw[1200];
    size_t n;
    if (!cursor_b64_decode(c, raw, sizeof raw, &n) || strlen(raw) != n)
        return false;
    const char *bar1 = memchr(raw, '|', n), *bar2 = bar1 ? memchr(bar1 + 1, '|', n - (size_t)(bar1 + 1 - raw)) : NULL;
    if (!bar2 || bar1 - raw != 26)
        return false;
    static const char shape[] = "dddd-dd-dd dd:dd:dd.dddddd";
    for (int i = 0; i < 26; i++)
        if (shape[i] == 'd' ? !(raw[i] >= '0' && raw[i] <= '9') : raw[i] != shape[i])
            return false;
    size_t sl = (size_t)(bar2 - bar1 - 1), kl = n - (size_t)(bar2 + 1 - raw);
    if (sl % 2 || sl > 64 || kl < 1 || kl > 1024)
        return false;
    for (size_t i = 0; i < sl; i++)
        if (!strchr("0123456789abcdef", bar1[1 + i]) || !bar1[1 + i])
            return false;
    for (size_t i = 0; i < kl; i++)
        if ((unsigned char)bar2[1 + i] <= 0x20 || bar2[1 + i] == 0x7f)
            return false;
    memcpy(pc->time, raw, 26);
    memcpy(pc->time + 26, "+00", 4);
    memcpy(pc->scope, bar1 + 1, sl);
    pc->scope[sl] = '\0';
    memcpy(pc->key, bar2 + 1, kl);
    pc->key[kl] = '\0';
    return true;
}

/* {"records":[...],"next_cursor":...}: the first limit rows; a next cursor (after the last of them) when the
 * statement found one more. NULL when too large. */
static char *admin_page_json(const PGresult *pr, int limit)
{
    int n = PQntuples(pr);
    bool more = n > limit;
    if (more)
        n = limit;
    struct cm_buf b;
    cm_buf_init(&b, STORE_ADMIN_JSON_MAX);
    bool ok = cm_buf_append(&b, "{\"records\":[", 12) && admin_rows_json(&b, pr, n) &&
              cm_buf_append(&b, "],\"next_cursor\":", 16);
    if (ok && more) {
        char *raw =
            cm_asprintf("%s|%s|%s", PQgetvalue(pr, n - 1, 10), PQgetvalue(pr, n - 1, 2), PQgetvalue(pr, n - 1, 1));
        ok = cm_buf_append(&b, "\"", 1) && cursor_append(&b, raw, strlen(raw)) && cm_buf_append(&b, "\"}", 2);
        free(raw);
    } else {
        ok = ok && cm_buf_append(&b, "null}", 5);
    }
    if (!ok) {
        cm_buf_free(&b);
        return NULL;
    }
    size_t len;
    char *out = cm_buf_take(&b, &len);
    cm_buf_free(&b);
    return out;
}

static void admin_pg_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store_i_admin_op *a = arg;
    struct store *s = a->h.s;
    if (st != STORE_PG_OK) {
        store_i_log_pg_failure("admin", st, msg);
        admin_finish(a, 503, problem_json(503, "store-unavailable", "Store unavailable", store_i_pg_err_text(st)));
        return;
    }
    switch (a->stmt) {
    case STORE_S_ADMIN_LIST: {
        char *json = admin_list_json(pr);
        if (!json) {
            admin_finish(a, 500, problem_json(500, "internal-error", "Internal error", "listing too large"));
            return;
        }
        admin_finish(a, 200, json);
        return;
    }
    case STORE_S_ADMIN_PAGE: {
        char *json = admin_page_json(pr, a->limit);
        if (!json) {
            admin_finish(a, 500, problem_json(500, "internal-error", "Internal error", "listing too large"));
            return;
        }
        admin_finish(a, 200, json);
        return;
    }
    case STORE_S_ADMIN_PURGE: {
        admin_del_then_finish(a, pr, 0, false, 200, cm_asprintf("{\"deleted\":%d}", PQntuples(pr)));
        return;
    }
    case STORE_S_ADMIN_RELEASE: {
        int released = 0, total = 0;
        for (int i = 0; i < PQntuples(pr); i++) {
            if (PQgetvalue(pr, i, 0)[0] == 'd')
                released++;
            else if (PQgetvalue(pr, i, 0)[0] == 't')
                total++; /* 'n': the cache notification's row */
        }
        const PGresult *left = store_pg_cb_then(s->pg); /* Citus: what the delete left */
        if (left)
            total = released + PQntuples(left);
        if (released > 0)
            admin_del_then_finish(a, pr, 1, true, 200, cm_asprintf("{\"released\":%d}", released));
        else if (total == 0)
            admin_finish(a, 404, problem_json(404, "not-found", "Not found", "no record with this route and key"));
        else
            admin_finish(a, 409,
                         problem_json(409, "not-releasable", "Not releasable",
                                      "no record with this route and key is an unknown outcome or a lapsed lease"));
        return;
    }
    default:
        admin_finish(a, 500, problem_json(500, "internal-error", "Internal error", "unexpected admin statement"));
        return;
    }
}

static void admin_run(struct store *s, enum store_i_stmt_id stmt, int result_format, const char *route, const char *key,
                      size_t key_len, store_admin_cb cb, void *arg)
{
    struct store_i_admin_op *a = cm_calloc(1, sizeof *a);
    store_i_op_link(s, &a->h, STORE_OP_ADMIN);
    a->stmt = stmt;
    a->bump = stmt != STORE_S_ADMIN_LIST;
    a->route = cm_strdup(route);
    a->key = cm_strndup(key, key_len);
    a->key_len = key_len;
    a->cb = cb;
    a->arg = arg;
    struct store_pg_param p[2] = {{a->route, strlen(a->route), true}, {a->key, key_len, true}};
    store_pg_query(s->pg, stmt, p, 2, result_format, admin_pg_cb, a);
}

void store_admin_list(struct store *s, const char *route, const char *key, size_t key_len, store_admin_cb cb, void *arg)
{
    admin_run(s, STORE_S_ADMIN_LIST, 0, route, key, key_len, cb, arg);
}

void store_admin_purge(struct store *s, const char *route, const char *key, size_t key_len, store_admin_cb cb,
                       void *arg)
{
    admin_run(s, STORE_S_ADMIN_PURGE, 1, route, key, key_len, cb, arg);
}

void store_admin_release(struct store *s, const char *route, const char *key, size_t key_len, store_admin_cb cb,
                         void *arg)
{
    admin_run(s, STORE_S_ADMIN_RELEASE, 1, route, key, key_len, cb, arg);
}

void store_admin_page(struct store *s, const struct store_page_req *q, store_admin_cb cb, void *arg)
{
    struct page_cursor pc = {"infinity", "", ""};
    if (q->cursor && !cursor_decode(q->cursor, &pc)) {
        cb(arg, 400, problem_json(400, "bad-request", "Bad request", "cursor is not one a listing gave"));
        return;
    }
    struct store_i_admin_op *a = cm_calloc(1, sizeof *a);
    store_i_op_link(s, &a->h, STORE_OP_ADMIN);
    a->stmt = STORE_S_ADMIN_PAGE;
    a->route = cm_strdup(q->route);
    a->limit = (int)q->limit;
    a->cb = cb;
    a->arg = arg;
    char older[24], rows[24];
    snprintf(older, sizeof older, "%llu", (unsigned long long)q->older_than_ms);
    snprintf(rows, sizeof rows, "%d", a->limit + 1);
    const char *state = q->state ? q->state : "";
    struct store_pg_param p[7] = {
        {a->route, strlen(a->route), false}, {state, strlen(state), false},   {older, strlen(older), false},
        {pc.time, strlen(pc.time), false},   {pc.key, strlen(pc.key), false}, {pc.scope, strlen(pc.scope), false},
        {rows, strlen(rows), false},
    };
    store_pg_query(s->pg, STORE_S_ADMIN_PAGE, p, 7, 0, admin_pg_cb, a);
}
