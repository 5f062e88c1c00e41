/* common.c - allocator, capped buffers, header lists, response codec, logging, hashing, time. Never a network library,
 * never another room. */
#include "common/common.h"

#include <errno.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

/* ---- memory */

static void oom(size_t n)
{
    char line[128];
    int len = snprintf(line, sizeof line, "level=error event=out_of_memory bytes=%zu\n", n);
    if (len > 0 && write(STDERR_FILENO, line, (size_t)len) < 0) {
        /* nothing more to do */
    }
    abort();
}

void *cm_malloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        oom(n);
    return p;
}

void *cm_calloc(size_t nmemb, size_t size)
{
    void *p = calloc(nmemb ? nmemb : 1, size ? size : 1);
    if (!p)
        oom(nmemb * size);
    return p;
}

void *cm_realloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q)
        oom(n);
    return q;
}

char *cm_strdup(const char *s)
{
    return cm_strndup(s, strlen(s));
}

char *cm_strndup(const char *s, size_t n)
{
    char *p = cm_malloc(n + 1);
    memcpy(p, s, n);
    p[n] = '\0';
    return p;
}

char *cm_asprintf(const char *fmt, ...)
{
    va_list ap;
    char *p = NULL;
    va_start(ap, fmt);
    int n = vasprintf(&p, fmt, ap);
    va_end(ap);
    if (n < 0)
        oom(strlen(fmt));
    return p;
}

/* ---- capped buffer */

void cm_buf_init(struct cm_buf *b, size_t max)
{
    b->data = NULL;
    b->len = 0;
    b->cap = 0;
    b->max = max;
    b->counted = false;
}

void cm_buf_init_counted(struct cm_buf *b, size_t max)
{
    cm_buf_init(b, max);
    b->counted = true;
}

size_t cm_buf_charged(const struct cm_buf *b)
{
    return b->counted ? b->cap : 0;
}

static _Atomic uint64_t g_buffers_used, g_buffers_limit;

void cm_buffers_set_limit(uint64_t limit)
{
    atomic_store(&g_buffers_limit, limit);
}

uint64_t cm_buffers_used(void)
{
    return atomic_load(&g_buffers_used);
}

bool cm_buffers_admit(uint64_t need)
{
    uint64_t limit = atomic_load(&g_buffers_limit), used = atomic_load(&g_buffers_used);
    return limit == 0 || (used < limit && need < limit - used);
}

bool cm_buffers_try_charge(uint64_t n)
{
    uint64_t limit = atomic_load(&g_buffers_limit);
    uint64_t used = atomic_load(&g_buffers_used);
    do {
        if (limit != 0 && (used > limit || n > limit - used))
            return false;
    } while (!atomic_compare_exchange_weak(&g_buffers_used, &used, used + n));
    return true;
}

void cm_buffers_release(uint64_t n)
{
    atomic_fetch_sub(&g_buffers_used, n);
}

bool cm_buf_append(struct cm_buf *b, const void *p, size_t n)
{
    if (n > b->max || b->len > b->max - n)
        return false;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap = cap > ((size_t)-1) / 2 ? b->len + n + 1 : cap * 2;
        if (cap > b->max + 1)
            cap = b->max + 1;
        if (b->counted && !cm_buffers_try_charge(cap - b->cap))
            return false;
        b->data = cm_realloc(b->data, cap);
        b->cap = cap;
    }
    if (n)
        memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = '\0';
    return true;
}

bool cm_buf_appendf(struct cm_buf *b, const char *fmt, ...)
{
    char small[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0)
        return false;
    if ((size_t)n < sizeof small)
        return cm_buf_append(b, small, (size_t)n);
    char *big = cm_malloc((size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    bool ok = cm_buf_append(b, big, (size_t)n);
    free(big);
    return ok;
}

void cm_buf_reset(struct cm_buf *b)
{
    b->len = 0;
    if (b->data)
        b->data[0] = '\0';
}

void cm_buf_free(struct cm_buf *b)
{
    if (b->counted && b->cap)
        cm_buffers_release(b->cap);
    free(b->data);
    b->data = NULL;
    b->len = 0;
    b->cap = 0;
}

char *cm_buf_take(struct cm_buf *b, size_t *len)
{
    char *p = b->data;
    if (len)
        *len = b->len;
    b->data = NULL;
    b->len = 0;
    b->cap = 0;
    return p;
}

/* ---- header lists
 * Each entry's strings are one block "name\0value\0" in the list's chunks: v[i].value points into it. */

/* A header list's strings: chunks from CM_HDR_CHUNK_MIN bytes, each new one twice the last up to
 * CM_HDR_CHUNK_MAX; a string larger than half the cap gets a chunk of its own (behind the newest, which keeps
 * taking the small ones). */
struct cm_hdr_chunk {
    struct cm_hdr_chunk *next;
    size_t used;
    size_t cap;
    char data[];
};
#define CM_HDR_CHUNK_MIN 512
#define CM_HDR_CHUNK_MAX 4096

static char *hdrs_space(struct cm_hdrs *h, size_t n)
{
    struct cm_hdr_chunk *c = h->chunk;
    if (c && c->cap - c->used >= n) {
        char *p = c->data + c->used;
        c->used += n;
        return p;
    }
    size_t cap = c ? (c->cap < CM_HDR_CHUNK_MAX ? c->cap * 2 : CM_HDR_CHUNK_MAX) : CM_HDR_CHUNK_MIN;
    bool own = n > cap / 2;
    if (own)
        cap = n;
    if (cap > SIZE_MAX - sizeof *c)
        oom(SIZE_MAX);
    struct cm_hdr_chunk *nc = cm_malloc(sizeof *nc + cap);
    nc->cap = cap;
    nc->used = n;
    if (own && c) {
        nc->next = c->next; /* behind the newest */
        c->next = nc;
    } else {
        nc->next = c;
        h->chunk = nc;
    }
    return nc->data;
}

void cm_hdrs_init(struct cm_hdrs *h)
{
    h->v = NULL;
    h->n = 0;
    h->cap = 0;
    h->chunk = NULL;
}

void cm_hdrs_free(struct cm_hdrs *h)
{
    struct cm_hdr_chunk *c = h->chunk;
    while (c) {
        struct cm_hdr_chunk *next = c->next;
        free(c);
        c = next;
    }
    free(h->v);
    cm_hdrs_init(h);
}

void cm_hdrs_addn(struct cm_hdrs *h, const char *name, size_t nlen, const char *value, size_t vlen)
{
    if (h->n == h->cap) {
        h->cap = h->cap ? h->cap * 2 : 16;
        h->v = cm_realloc(h->v, h->cap * sizeof *h->v);
    }
    if (nlen > SIZE_MAX - 2 || vlen > SIZE_MAX - 2 - nlen)
        oom(SIZE_MAX);
    char *blk = hdrs_space(h, nlen + vlen + 2);
    memcpy(blk, name, nlen);
    blk[nlen] = '\0';
    memcpy(blk + nlen + 1, value, vlen);
    blk[nlen + 1 + vlen] = '\0';
    h->v[h->n].name = blk;
    h->v[h->n].value = blk + nlen + 1;
    h->n++;
}

void cm_hdrs_add(struct cm_hdrs *h, const char *name, const char *value)
{
    cm_hdrs_addn(h, name, strlen(name), value, strlen(value));
}

const char *cm_hdrs_get(const struct cm_hdrs *h, const char *name)
{
    for (size_t i = 0; i < h->n; i++)
        if (strcasecmp(h->v[i].name, name) == 0)
            return h->v[i].value;
    return NULL;
}

size_t cm_hdrs_remove(struct cm_hdrs *h, const char *name)
{
    size_t o = 0;
    for (size_t i = 0; i < h->n; i++) {
        if (strcasecmp(h->v[i].name, name) != 0)
            h->v[o++] = h->v[i];
    }
    size_t removed = h->n - o;
    h->n = o;
    return removed;
}

static int ascii_lower(int c)
{
    return c >= 'A' && c <= 'Z' ? c + ('a' - 'A') : c;
}

bool cm_is_hop_by_hop(const char *name)
{
    /* Dispatch on the first letter: most names (X-..., Content-..., Date, Set-Cookie) are out after one compare. */
    switch (ascii_lower((unsigned char)name[0])) {
    case 'c':
        return strcasecmp(name, "Connection") == 0;
    case 'k':
        return strcasecmp(name, "Keep-Alive") == 0;
    case 'p':
        return strncasecmp(name, "Proxy-", 6) == 0 &&
               (strcasecmp(name + 6, "Connection") == 0 || strcasecmp(name + 6, "Authenticate") == 0 ||
                strcasecmp(name + 6, "Authorization") == 0);
    case 't':
        return strcasecmp(name, "TE") == 0 || strcasecmp(name, "Trailer") == 0 ||
               strcasecmp(name, "Transfer-Encoding") == 0;
    case 'u':
        return strcasecmp(name, "Upgrade") == 0;
    default:
        return false;
    }
}

/* The items of the Connection header values: OWS-trimmed, empty ones skipped. A few fit on the stack. */
struct conn_toks {
    struct {
        const char *p;
        size_t n;
    } small[8], *v;
    size_t n, cap;
};

static void conn_toks_add(struct conn_toks *t, const char *p, size_t n)
{
    if (t->n == t->cap) {
        size_t cap = t->cap * 2;
        if (t->v == t->small) {
            t->v = cm_malloc(cap * sizeof *t->v);
            memcpy(t->v, t->small, t->n * sizeof *t->v);
        } else {
            t->v = cm_realloc(t->v, cap * sizeof *t->v);
        }
        t->cap = cap;
    }
    t->v[t->n].p = p;
    t->v[t->n].n = n;
    t->n++;
}

static void conn_toks_split(struct conn_toks *t, const char *list)
{
    const char *p = list;
    while (*p) {
        while (*p == ' ' || *p == '\t' || *p == ',')
            p++;
        const char *start = p;
        while (*p && *p != ',')
            p++;
        const char *end = p;
        while (end > start && (end[-1] == ' ' || end[-1] == '\t'))
            end--;
        if (end > start)
            conn_toks_add(t, start, (size_t)(end - start));
    }
}

void cm_hdrs_strip_hop_by_hop(struct cm_hdrs *h)
{
    /* Pass 1: the items of every Connection header (they point into those values). */
    struct conn_toks t;
    t.v = t.small;
    t.n = 0;
    t.cap = sizeof t.small / sizeof t.small[0];
    for (size_t i = 0; i < h->n; i++)
        if ((h->v[i].name[0] | 0x20) == 'c' && strcasecmp(h->v[i].name, "Connection") == 0)
            conn_toks_split(&t, h->v[i].value);
    /* Pass 2: kept entries move to the front in order; dropped ones are swapped behind them. */
    size_t o = 0;
    for (size_t i = 0; i < h->n; i++) {
        const char *name = h->v[i].name;
        bool drop = cm_is_hop_by_hop(name);
        if (!drop && t.n > 0) {
            size_t nlen = strlen(name);
            for (size_t k = 0; k < t.n && !drop; k++)
                drop = t.v[k].n == nlen && strncasecmp(t.v[k].p, name, nlen) == 0;
        }
        if (!drop) {
            struct cm_hdr keep = h->v[i];
            h->v[i] = h->v[o];
            h->v[o++] = keep;
        }
    }
    h->n = o;
    if (t.v != t.small)
        free(t.v);
}

/* ---- response codec: "IGR1" u16 status, u32 nhdrs, (u32 len, bytes) x 2 per header, u64 body len, body */

void cm_resp_init(struct cm_resp *r, size_t max_body)
{
    r->status = 0;
    cm_hdrs_init(&r->hdrs);
    cm_buf_init(&r->body, max_body);
}

void cm_resp_free(struct cm_resp *r)
{
    cm_hdrs_free(&r->hdrs);
    cm_buf_free(&r->body);
}

static bool put_be(struct cm_buf *out, uint64_t v, int bytes)
{
    uint8_t b[8];
    for (int i = 0; i < bytes; i++)
        b[i] = (uint8_t)(v >> (8 * (bytes - 1 - i)));
    return cm_buf_append(out, b, (size_t)bytes);
}

static bool put_str(struct cm_buf *out, const char *s)
{
    size_t n = strlen(s);
    return n <= UINT32_MAX && put_be(out, n, 4) && cm_buf_append(out, s, n);
}

bool cm_resp_encode(const struct cm_resp *r, struct cm_buf *out)
{
    if (r->status < 0 || r->status > 999 || r->hdrs.n > UINT32_MAX)
        return false;
    if (!cm_buf_append(out, "IGR1", 4) || !put_be(out, (uint64_t)r->status, 2) || !put_be(out, r->hdrs.n, 4))
        return false;
    for (size_t i = 0; i < r->hdrs.n; i++)
        if (!put_str(out, r->hdrs.v[i].name) || !put_str(out, r->hdrs.v[i].value))
            return false;
    return put_be(out, r->body.len, 8) && cm_buf_append(out, r->body.data ? r->body.data : "", r->body.len);
}

struct reader {
    const uint8_t *p;
    size_t left;
};

static bool get_be(struct reader *rd, int bytes, uint64_t *v)
{
    if (rd->left < (size_t)bytes)
        return false;
    uint64_t x = 0;
    for (int i = 0; i < bytes; i++)
        x = (x << 8) | rd->p[i];
    rd->p += bytes;
    rd->left -= (size_t)bytes;
    *v = x;
    return true;
}

/* Header names and values must be printable text without CR/LF/NUL. */
static bool get_str(struct reader *rd, const char **s, size_t *n)
{
    uint64_t len;
    if (!get_be(rd, 4, &len) || len > rd->left)
        return false;
    for (size_t i = 0; i < len; i++)
        if (rd->p[i] == '\0' || rd->p[i] == '\r' || rd->p[i] == '\n')
            return false;
    *s = (const char *)rd->p;
    *n = (size_t)len;
    rd->p += len;
    rd->left -= len;
    return true;
}

bool cm_resp_decode(const void *data, size_t len, struct cm_resp *r)
{
    struct reader rd = {data, len};
    uint64_t status, nh, blen;
    cm_resp_init(r, len);
    if (len < 4 || memcmp(data, "IGR1", 4) != 0)
        return false;
    rd.p += 4;
    rd.left -= 4;
    if (!get_be(&rd, 2, &status) || status < 100 || status > 999 || !get_be(&rd, 4, &nh))
        return false;
    if (nh > rd.left / 8) /* every header needs at least 8 bytes */
        return false;
    r->status = (int)status;
    for (uint64_t i = 0; i < nh; i++) {
        const char *name, *value;
        size_t nl, vl;
        if (!get_str(&rd, &name, &nl) || nl == 0 || !get_str(&rd, &value, &vl))
            return false;
        cm_hdrs_addn(&r->hdrs, name, nl, value, vl);
    }
    if (!get_be(&rd, 8, &blen) || blen != rd.left)
        return false;
    return cm_buf_append(&r->body, rd.p, (size_t)blen);
}

/* ---- logging */

static _Atomic int log_min = CM_INFO;

void cm_log_set_level(enum cm_level min)
{
    atomic_store(&log_min, (int)min);
}

static const char *level_name(enum cm_level l)
{
    switch (l) {
    case CM_DEBUG:
        return "debug";
    case CM_INFO:
        return "info";
    case CM_WARN:
        return "warn";
    default:
        return "error";
    }
}

static _Atomic int log_format = CM_LOG_LOGFMT;

void cm_log_set_format(enum cm_log_format f)
{
    atomic_store(&log_format, (int)f);
}

enum cm_log_format cm_log_get_format(void)
{
    return (enum cm_log_format)atomic_load_explicit(&log_format, memory_order_relaxed);
}

size_t cm_log_head(char *out, size_t n, enum cm_level lvl, const char *event)
{
    /* the date and time to the second change once a second: kept per thread (the access log writes a line per
     * request) */
    static _Thread_local time_t last_sec = -1;
    static _Thread_local char last[64];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (ts.tv_sec != last_sec) {
        struct tm tm;
        gmtime_r(&ts.tv_sec, &tm);
        snprintf(last, sizeof last, "%04d-%02d-%02dT%02d:%02d:%02d", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                 tm.tm_hour, tm.tm_min, tm.tm_sec);
        last_sec = ts.tv_sec;
    }
    /* "ts=%s.%03ldZ level=%s event=%s" without printf when it fits (it always does in the buffers callers give) */
    const char *lv = level_name(lvl);
    size_t ll = strlen(last), lvl_len = strlen(lv), el = strlen(event);
    size_t need = 3 + ll + 6 + 7 + lvl_len + 7 + el;
    if (need < n) {
        char *o = out;
        long ms = ts.tv_nsec / 1000000;
        memcpy(o, "ts=", 3), o += 3;
        memcpy(o, last, ll), o += ll;
        *o++ = '.';
        *o++ = (char)('0' + ms / 100);
        *o++ = (char)('0' + ms / 10 % 10);
        *o++ = (char)('0' + ms % 10);
        memcpy(o, "Z level=", 8), o += 8;
        memcpy(o, lv, lvl_len), o += lvl_len;
        memcpy(o, " event=", 7), o += 7;
        memcpy(o, event, el), o += el;
        *o = '\0';
        return (size_t)(o - out);
    }
    int w = snprintf(out, n, "ts=%s.%03ldZ level=%s event=%s", last, ts.tv_nsec / 1000000, lv, event);
    if (w < 0)
        return 0;
    return (size_t)w < n ? (size_t)w : n - 1;
}

void cm_logv(enum cm_level lvl, const char *event, const char *fmt, va_list ap)
{
    if ((int)lvl < atomic_load(&log_min))
        return;
    char line[2048];
    size_t len = cm_log_head(line, sizeof line, lvl, event);
    if (fmt && *fmt && len < sizeof line - 2) {
        line[len++] = ' ';
        int m = vsnprintf(line + len, sizeof line - len, fmt, ap);
        if (m > 0)
            len += (size_t)m < sizeof line - len ? (size_t)m : sizeof line - len - 1;
    }
    /* One line per event: fold any stray newline. */
    for (size_t i = 0; i < len; i++)
        if (line[i] == '\n' || line[i] == '\r')
            line[i] = ' ';
    if (len > sizeof line - 2)
        len = sizeof line - 2;
    char js[4096];
    const char *out = line;
    if (cm_log_get_format() == CM_LOG_JSON && (len = cm_logfmt_to_json(line, len, js, sizeof js)) > 0) {
        out = js;
    } else {
        if (cm_log_get_format() == CM_LOG_JSON) /* cannot happen: twice the line's size is room enough */
            len = strlen(line);
        line[len++] = '\n';
    }
    /* A single write keeps lines from different threads whole. */
    ssize_t w = write(STDERR_FILENO, out, len);
    (void)w;
}

void cm_log(enum cm_level lvl, const char *event, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    cm_logv(lvl, event, fmt, ap);
    va_end(ap);
}

/* ---- logfmt to JSON (log_format: json) */

struct jout {
    char *p;
    size_t n, cap;
    bool ok;
};

static void put(struct jout *o, const char *p, size_t n)
{
    if (!o->ok || n > o->cap - o->n) {
        o->ok = false;
        return;
    }
    memcpy(o->p + o->n, p, n);
    o->n += n;
}

static void put_json_char(struct jout *o, unsigned char c)
{
    static const char hex[] = "0123456789abcdef";
    char e[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
    if (c == '"' || c == '\\') {
        char b[2] = {'\\', (char)c};
        put(o, b, 2);
    } else if (c == '\n') {
        put(o, "\\n", 2);
    } else if (c < 0x20 || c == 0x7f) {
        put(o, e, 6);
    } else {
        put(o, (const char *)&c, 1);
    }
}

static int hexval(char c)
{
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

static bool is_number(const char *v, size_t n)
{
    size_t i = 0, digits = 0, dots = 0;
    if (n > 0 && v[0] == '-')
        i++;
    for (; i < n; i++) {
        if (v[i] == '.')
            dots++;
        else if (v[i] >= '0' && v[i] <= '9')
            digits++;
        else
            return false;
    }
    /* no leading zero (JSON refuses 007) unless it is the only digit before a dot, no dot at an end */
    size_t s0 = (n > 0 && v[0] == '-') ? 1 : 0;
    if (digits == 0 || dots > 1 || v[n - 1] == '.' || v[s0] == '.' || digits > 17)
        return false;
    return !(v[s0] == '0' && n > s0 + 1 && v[s0 + 1] != '.');
}

size_t cm_logfmt_to_json(const char *in, size_t n, char *out, size_t cap)
{
    struct jout o = {out, 0, cap > 2 ? cap - 2 : 0, cap > 2}; /* room for "\n" and the terminator */
    put(&o, "{", 1);
    size_t i = 0;
    bool first = true;
    while (i < n && o.ok) {
        while (i < n && in[i] == ' ')
            i++;
        if (i >= n)
            break;
        size_t k = i;
        while (i < n && in[i] != '=' && in[i] != ' ')
            i++;
        if (!first)
            put(&o, ",", 1);
        first = false;
        put(&o, "\"", 1);
        for (size_t j = k; j < i; j++)
            put_json_char(&o, (unsigned char)in[j]);
        put(&o, "\":", 2);
        if (i >= n || in[i] != '=') { /* a key without a value */
            put(&o, "true", 4);
            continue;
        }
        i++;
        if (i < n && in[i] == '"') { /* quoted, as cm_log_quote writes: \" \\ \n \xNN */
            i++;
            put(&o, "\"", 1);
            while (i < n && in[i] != '"') {
                unsigned char c = (unsigned char)in[i++];
                if (c == '\\' && i < n) {
                    char e = in[i++];
                    if (e == 'n')
                        c = '\n';
                    else if (e == 'x' && i + 1 < n && hexval(in[i]) >= 0 && hexval(in[i + 1]) >= 0) {
                        c = (unsigned char)(hexval(in[i]) * 16 + hexval(in[i + 1]));
                        i += 2;
                    } else
                        c = (unsigned char)e;
                }
                put_json_char(&o, c);
            }
            i += i < n; /* the closing quote */
            put(&o, "\"", 1);
            continue;
        }
        size_t v = i;
        while (i < n && in[i] != ' ')
            i++;
        if (is_number(in + v, i - v) || (i - v == 4 && memcmp(in + v, "true", 4) == 0) ||
            (i - v == 5 && memcmp(in + v, "false", 5) == 0)) {
            put(&o, in + v, i - v);
        } else {
            put(&o, "\"", 1);
            for (size_t j = v; j < i; j++)
                put_json_char(&o, (unsigned char)in[j]);
            put(&o, "\"", 1);
        }
    }
    put(&o, "}", 1);
    if (!o.ok)
        return 0;
    out[o.n++] = '\n';
    out[o.n] = '\0';
    return o.n;
}

const char *cm_log_quote(char *out, size_t n, const char *s)
{
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    if (n < 3) {
        if (n)
            out[0] = '\0';
        return out;
    }
    out[o++] = '"';
    for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
        char esc[5];
        size_t el = 0;
        if (*p == '"' || *p == '\\') {
            esc[el++] = '\\';
            esc[el++] = (char)*p;
        } else if (*p == '\n') {
            esc[el++] = '\\';
            esc[el++] = 'n';
        } else if (*p < 0x20 || *p == 0x7f) {
            esc[el++] = '\\';
            esc[el++] = 'x';
            esc[el++] = hex[*p >> 4];
            esc[el++] = hex[*p & 15];
        } else {
            esc[el++] = (char)*p;
        }
        if (o + el + 2 > n)
            break;
        memcpy(out + o, esc, el);
        o += el;
    }
    out[o++] = '"';
    out[o] = '\0';
    return out;
}

const char *cm_redact_url(char *out, size_t n, const char *url)
{
    if (!n)
        return out;
    snprintf(out, n, "%s", url ? url : "");
    char *scheme = strstr(out, "://");
    if (scheme) {
        char *auth = scheme + 3;
        char *at = strchr(auth, '@');
        char *slash = strchr(auth, '/');
        if (at && (!slash || at < slash)) {
            char *colon = memchr(auth, ':', (size_t)(at - auth));
            if (colon) {
                char rest[1024];
                snprintf(rest, sizeof rest, "%s", at);
                snprintf(colon, n - (size_t)(colon - out), ":***%s", rest);
            }
        }
    }
    /* libpq's other forms: `password = 'a b\' c'` (keyword=value, spaces around '=', a quoted value with
     * backslash escapes), `?password=x&...` (a URL's query), sslpassword; every occurrence. out may have been cut
     * at n: a value cut short is still replaced whole. */
    char *pw = out;
    while ((pw = strstr(pw, "password")) != NULL) {
        char *p = pw + 8;
        while (*p == ' ')
            p++;
        if (*p != '=') {
            pw += 8;
            continue;
        }
        p++;
        while (*p == ' ')
            p++;
        char *end = p;
        if (*end == '\'') {
            for (end++; *end && *end != '\''; end++)
                if (*end == '\\' && end[1])
                    end++;
            if (*end)
                end++;
        } else {
            while (*end && *end != ' ' && *end != '&')
                end++;
        }
        char rest[1024];
        snprintf(rest, sizeof rest, "%s", end);
        size_t at = (size_t)(p - out);
        snprintf(p, n - at, "***%s", rest);
        pw = p + 3 <= out + strlen(out) ? p + 3 : out + strlen(out);
    }
    return out;
}

/* ---- hashing */

/* OpenSSL 3 looks an algorithm up in its provider store (a locked table)
 * at every EVP_DigestInit_ex(ctx, EVP_sha256()): fetch it once instead. */
static EVP_MD *sha256_md;
static pthread_once_t sha256_once = PTHREAD_ONCE_INIT;

static void sha256_fetch(void)
{
    sha256_md = EVP_MD_fetch(NULL, "SHA2-256", NULL);
}

uint64_t cm_fnv1a(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

/* One spare digest context per thread: a hash begun takes it (a second one at the same time gets a new one), a
 * hash finished gives its context back, so the hot path allocates none (two hashes per keyed request). The
 * thread's spare is freed when it exits. */
static pthread_key_t sha256_spare;
static pthread_once_t sha256_spare_once = PTHREAD_ONCE_INIT;

static void sha256_spare_free(void *ctx)
{
    EVP_MD_CTX_free(ctx);
}

static void sha256_spare_make(void)
{
    if (pthread_key_create(&sha256_spare, sha256_spare_free) != 0)
        abort();
}

void cm_sha256_init(struct cm_sha256 *h)
{
    pthread_once(&sha256_once, sha256_fetch);
    pthread_once(&sha256_spare_once, sha256_spare_make);
    EVP_MD_CTX *ctx = pthread_getspecific(sha256_spare);
    if (ctx)
        (void)pthread_setspecific(sha256_spare, NULL);
    else
        ctx = EVP_MD_CTX_new();
    if (!ctx || EVP_DigestInit_ex(ctx, sha256_md ? sha256_md : EVP_sha256(), NULL) != 1)
        oom(sizeof *h);
    h->ctx = ctx;
}

void cm_sha256_update(struct cm_sha256 *h, const void *p, size_t n)
{
    if (n)
        EVP_DigestUpdate(h->ctx, p, n);
}

void cm_sha256_part(struct cm_sha256 *h, const void *p, size_t n)
{
    uint8_t len[8];
    for (int i = 0; i < 8; i++)
        len[i] = (uint8_t)((uint64_t)n >> (56 - 8 * i));
    cm_sha256_update(h, len, sizeof len);
    cm_sha256_update(h, p, n);
}

void cm_sha256_final(struct cm_sha256 *h, uint8_t out[32])
{
    unsigned int olen = 32;
    EVP_DigestFinal_ex(h->ctx, out, &olen);
    if (pthread_getspecific(sha256_spare) == NULL && pthread_setspecific(sha256_spare, h->ctx) == 0)
        h->ctx = NULL; /* the thread's spare now */
    else
        EVP_MD_CTX_free(h->ctx);
    h->ctx = NULL;
}

void cm_sha256(const void *p, size_t n, uint8_t out[32])
{
    struct cm_sha256 h;
    cm_sha256_init(&h);
    cm_sha256_update(&h, p, n);
    cm_sha256_final(&h, out);
}

int cm_hexval(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

int cm_b64val(unsigned char c, bool url)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    if (c == (url ? '-' : '+'))
        return 62;
    if (c == (url ? '_' : '/'))
        return 63;
    return -1;
}

void cm_hex(const uint8_t *in, size_t n, char *out)
{
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = hex[in[i] >> 4];
        out[2 * i + 1] = hex[in[i] & 15];
    }
    out[2 * n] = '\0';
}

bool cm_consttime_eq(const void *a, size_t alen, const void *b, size_t blen)
{
    const volatile uint8_t *x = a, *y = b;
    uint8_t diff = (uint8_t)(alen != blen);
    size_t n = alen < blen ? alen : blen;
    for (size_t i = 0; i < n; i++)
        diff |= x[i] ^ y[i];
    return diff == 0;
}

/* Tokens and request ids are drawn from a per-thread block of CSPRNG output, refilled every RANDOM_BLOCK draws:
 * one RAND_bytes call (and its locks) per block rather than per claim or request (each request draws two; at 64 a
 * block the calls still showed in a request's profile). The process never forks after drawing one, so no two
 * processes share a block. */
#define RANDOM_BLOCK 512
/* 64 random bits from this thread's block of CSPRNG output (refilled with one RAND_bytes call). */
static uint64_t random_u64(void)
{
    static _Thread_local uint64_t block[RANDOM_BLOCK];
    static _Thread_local unsigned left;
    if (left == 0) {
        if (RAND_bytes((unsigned char *)block, sizeof block) != 1)
            abort();
        left = RANDOM_BLOCK;
    }
    uint64_t v = block[--left];
    block[left] = 0; /* drawn once */
    return v;
}

uint64_t cm_random_token(void)
{
    uint64_t v = 0;
    while (v == 0)
        v = random_u64() & INT64_MAX;
    return v;
}

void cm_request_id_new(char out[CM_REQUEST_ID_NEW_LEN + 1])
{
    uint64_t v[2] = {random_u64(), random_u64()};
    cm_hex((const uint8_t *)v, sizeof v, out);
}

bool cm_request_id_ok(const char *s, size_t n)
{
    if (n == 0 || n > CM_REQUEST_ID_MAX)
        return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] <= 0x20 || (unsigned char)s[i] >= 0x7f)
            return false;
    return true;
}

/* ---- time */

/* RFC 9110 tchar, one bit per byte value (every header name of every request is checked with it). */
static const uint32_t tchar_bits[8] = {
    0x00000000u, /* 0x00-0x1f */
    0x03ff6cfau, /* 0x20-0x3f: ! # $ % & ' * + - . 0-9 */
    0xc7fffffeu, /* 0x40-0x5f: A-Z ^ _ */
    0x57ffffffu, /* 0x60-0x7f: ` a-z | ~ */
    0,           0, 0, 0,
};

bool cm_is_tchar(unsigned char ch)
{
    return (tchar_bits[ch >> 5] >> (ch & 31)) & 1u;
}

bool cm_token_ok(const char *s, size_t n)
{
    if (n == 0)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!cm_is_tchar((unsigned char)s[i]))
            return false;
    return true;
}

bool cm_field_value_ok(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if ((ch < 0x20 && ch != '\t') || ch == 0x7f)
            return false;
    }
    return true;
}

bool cm_parse_digits(const char *s, size_t n, size_t max_digits, uint64_t *out)
{
    if (n == 0 || n > max_digits || n > 19)
        return false;
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return false;
        v = v * 10 + (uint64_t)(s[i] - '0');
    }
    *out = v;
    return true;
}

uint64_t cm_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

bool cm_overdue(uint64_t since_ms, uint64_t now_ms, uint64_t limit_ms)
{
    return since_ms && since_ms <= now_ms && now_ms - since_ms > limit_ms;
}

uint64_t cm_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

bool cm_imf_fixdate(uint64_t unix_s, char out[CM_IMF_FIXDATE_LEN + 1])
{
    static const char days[7][4] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
    static const char months[12][4] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                       "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
    struct tm tm;
    time_t t = (time_t)unix_s;
    if ((uint64_t)t != unix_s || gmtime_r(&t, &tm) == NULL || tm.tm_year + 1900 > 9999)
        return false;
    int n = snprintf(out, CM_IMF_FIXDATE_LEN + 1, "%s, %02d %s %04d %02d:%02d:%02d GMT", days[tm.tm_wday], tm.tm_mday,
                     months[tm.tm_mon], tm.tm_year + 1900, tm.tm_hour, tm.tm_min, tm.tm_sec);
    return n == CM_IMF_FIXDATE_LEN;
}

char *cm_read_file(const char *path, size_t max, size_t *len, char **err)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        *err = cm_asprintf("%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = cm_malloc(max + 1);
    size_t n = fread(buf, 1, max + 1, f);
    bool bad = ferror(f);
    fclose(f);
    if (bad || n > max) {
        *err = bad ? cm_asprintf("%s: read error", path) : cm_asprintf("%s: larger than %zu bytes", path, max);
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}
