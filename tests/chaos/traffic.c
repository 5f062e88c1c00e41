/* traffic.c - the traffic driver: client threads with their own keys and tenants, retrying like real clients
 * (per-attempt timeout, backoff with jitter, retry on 409/5xx/transport errors, a fresh connection each time). */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "traffic.h"

static void user_ev(struct user *u, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void user_ev(struct user *u, const char *fmt, ...)
{
    if ((size_t)u->ev_len + 8 >= CH_EV_CAP)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(u->ev + u->ev_len, CH_EV_CAP - u->ev_len, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n >= (size_t)(CH_EV_CAP - u->ev_len)) {
        u->ev_len = CH_EV_CAP - 4;
        memcpy(u->ev + u->ev_len, "...", 4);
        u->ev_len = CH_EV_CAP - 1;
    } else {
        u->ev_len = (uint16_t)(u->ev_len + n);
    }
}

size_t ch_build_body(const struct user *u, char *buf, size_t cap)
{
    int n = snprintf(buf, cap, "{\"tenant\":\"tenant-%u\",\"key\":\"%s\",\"seq\":%u,\"mode\":\"%s\",\"pad\":\"",
                     (unsigned)u->worker, u->key, (unsigned)u->seq, ch_mode_name[u->mode]);
    if (n < 0 || (size_t)n >= cap)
        return 0;
    size_t len = (size_t)n;
    for (unsigned i = 0; i < u->pad_len && len + 3 < cap; i++)
        buf[len++] = (char)('a' + (u->seq + i) % 26);
    buf[len++] = '"';
    buf[len++] = '}';
    buf[len] = '\0';
    return len;
}

struct curl_slist *ch_build_headers(const struct user *u, bool first)
{
    char h[256];
    struct curl_slist *l = NULL;
    snprintf(h, sizeof h, "Idempotency-Key: %s", u->key);
    l = curl_slist_append(l, h);
    snprintf(h, sizeof h, "Authorization: Bearer tenant-%u", (unsigned)u->worker);
    l = curl_slist_append(l, h);
    l = curl_slist_append(l, "Content-Type: application/json");
    l = curl_slist_append(l, "Expect:");
    if (u->expect_status != 200) {
        snprintf(h, sizeof h, "X-Test-Status: %u", (unsigned)u->expect_status);
        l = curl_slist_append(l, h);
    }
    if (first) { /* what went wrong that time: a real retry does not ask for it again */
        if (u->delay_ms) {
            snprintf(h, sizeof h, "X-Test-Delay-Ms: %u", (unsigned)u->delay_ms);
            l = curl_slist_append(l, h);
        }
        if (u->mode == M_CLOSE)
            l = curl_slist_append(l, "X-Test-Action: close");
        else if (u->mode == M_RESET)
            l = curl_slist_append(l, "X-Test-Action: reset");
        else if (u->mode == M_503)
            l = curl_slist_append(l, "X-Test-Status: 503");
    }
    return l;
}

static bool is_problem(const struct http_res *r, char *name, size_t n)
{
    static const char pfx[] = "urn:idemgate:problem:";
    name[0] = '\0';
    if (strncasecmp(r->ctype, "application/problem+json", 24) != 0)
        return false;
    const char *p = strstr(r->body, pfx);
    if (p == NULL)
        return true;
    p += sizeof pfx - 1;
    size_t k = strcspn(p, "\"");
    snprintf(name, n, "%.*s", (int)(k < 64 ? k : 64), p);
    return true;
}

/* What one attempt's result means for the client (and for the evidence the checks use). */
enum cls ch_classify(const struct user *u, const struct http_res *r, const char *sent, size_t sent_len, char *tok,
                     size_t tokn)
{
    char prob[72];
    if (r->cc == CURLE_COULDNT_CONNECT) {
        snprintf(tok, tokn, "refused");
        return C_REFUSED;
    }
    if (r->cc == CURLE_OPERATION_TIMEDOUT) {
        snprintf(tok, tokn, "timeout");
        return C_TIMEOUT;
    }
    if (r->cc != CURLE_OK) {
        snprintf(tok, tokn, "xfer%d", (int)r->cc);
        return C_TRANSPORT;
    }
    if (r->exec[0] != '\0') { /* an upstream answer (fresh or stored) */
        bool same = !r->trunc && r->len == sent_len && memcmp(r->body, sent, sent_len) == 0;
        if (!same) {
            snprintf(tok, tokn, "%ld:e%s%s:BODY!", r->status, r->exec, r->replayed ? "R" : "");
            return strstr(r->body, "\"tenant\":\"") != NULL ? C_WRONG_TENANT : C_UNEXPECTED;
        }
        if (r->status == 503) {
            snprintf(tok, tokn, "503rel:e%s%s", r->exec, r->replayed ? "R!" : "");
            return r->replayed ? C_UNEXPECTED : C_RELEASE; /* a release status must never be stored */
        }
        snprintf(tok, tokn, "%ld:e%s%s", r->status, r->exec, r->replayed ? "R" : "");
        return r->status == u->expect_status ? C_ANSWER : C_UNEXPECTED;
    }
    if (is_problem(r, prob, sizeof prob)) {
        snprintf(tok, tokn, "%ld:%s", r->status, prob);
        if (r->status == 409 && strcmp(prob, "idempotency-key-in-use") == 0)
            return C_INUSE;
        if (r->status == 409 && strcmp(prob, "idempotency-outcome-unknown") == 0)
            return C_OUTCOME_UNKNOWN;
        if (r->status == 503 && strcmp(prob, "store-unavailable") == 0)
            return C_STORE_UNAVAIL;
        if (r->status == 502 && strcmp(prob, "upstream-unavailable") == 0)
            return C_UP_UNAVAIL;
        if ((r->status == 504 && strcmp(prob, "upstream-timeout") == 0) ||
            (r->status == 502 && strcmp(prob, "upstream-no-response") == 0) ||
            (r->status == 502 && strcmp(prob, "upstream-response-too-large") == 0) ||
            (r->status == 503 && strcmp(prob, "shutting-down") == 0))
            return C_GW_UNKNOWN;
        if (r->status == 503 || r->status == 429)
            return C_BUSY;
        return C_UNEXPECTED;
    }
    snprintf(tok, tokn, "%ld:?", r->status);
    return r->status >= 500 ? C_BUSY : C_UNEXPECTED;
}

static uint64_t backoff(struct worker *w, unsigned attempt, long retry_after_s)
{
    uint64_t cap = 50ull << (attempt < 6 ? attempt : 6);
    if (cap > 1600)
        cap = 1600;
    uint64_t d = 10 + ch_splitmix64(&w->rng) % cap; /* full jitter */
    if (retry_after_s > 0) {
        uint64_t ra = (uint64_t)retry_after_s * 1000;
        if (ra > 2000)
            ra = 2000;
        uint64_t j = ra / 2 + ch_splitmix64(&w->rng) % (ra / 2 + 1);
        if (j > d)
            d = j;
    }
    return d;
}

static void plan_user(struct worker *w, struct user *u)
{
    uint64_t *rng = &w->rng;
    uint32_t seq = (uint32_t)w->n;
    u->worker = (uint16_t)w->id;
    u->seq = seq;
    u->row = -1;
    u->hasty = (w->id % 3) == 1; /* a third of the clients give up on an attempt after CH_HASTY_MS */
    u->pad_len = (uint16_t)ch_rnd_range(rng, 0, 400);
    /* shared keys: both tenants of a pair use the same key string at the same sequence number (reject route) */
    uint64_t hs = ch.o.seed ^ ((uint64_t)(w->id / 2) << 32) ^ seq;
    bool shared = (ch_splitmix64(&hs) % 100) < 8;
    if (shared) {
        u->shared = true;
        u->route = RT_REJECT;
        snprintf(u->key, sizeof u->key, "s%u-%u-%s", (unsigned)(w->id / 2), (unsigned)seq, ch.tag);
    } else {
        u->route = (uint8_t)(ch_splitmix64(rng) % 2);
        snprintf(u->key, sizeof u->key, "u%u-%u-%s", (unsigned)w->id, (unsigned)seq, ch.tag);
    }
    unsigned p = (unsigned)(ch_splitmix64(rng) % 100);
    enum mode m = M_NORMAL;
    if (p < 8)
        m = M_SLOW_OK;
    else if (p < 14)
        m = M_SLOW_TIMEOUT;
    else if (p < 19)
        m = M_CLOSE;
    else if (p < 24)
        m = M_RESET;
    else if (p < 30)
        m = u->route == RT_RETRY ? M_503 : M_NORMAL; /* a release on the reject route would allow a re-execution */
    else if (p < 33)
        m = M_201;
    else if (p < 36)
        m = M_400;
    u->mode = (uint8_t)m;
    u->expect_status = m == M_201 ? 201 : (m == M_400 ? 400 : 200);
    if (m == M_SLOW_OK) /* longer than the lease (the owner must renew it), shorter than the upstream timeout */
        u->delay_ms = (uint16_t)ch_rnd_range(rng, ch.o.lease_ms + 100, ch.o.up_timeout_ms - 300);
    else if (m == M_SLOW_TIMEOUT)
        u->delay_ms = (uint16_t)(ch.o.up_timeout_ms + 1000);
}

static void run_user(struct worker *w, struct user *u)
{
    char body[1024];
    size_t blen = ch_build_body(u, body, sizeof body);
    uint64_t start = ch_mono_ms();
    uint64_t deadline = start + CH_REQ_BUDGET_MS;
    if (deadline > ch.traffic_end + CH_DRAIN_MS)
        deadline = ch.traffic_end + CH_DRAIN_MS;
    u->t_first = start;
    long per_attempt = u->hasty ? CH_HASTY_MS : CH_PATIENT_MS;
    for (unsigned a = 0; a < CH_MAX_ATTEMPTS && !atomic_load(&ch.abort); a++) {
        uint64_t now = ch_mono_ms();
        if (a > 0 && now >= deadline)
            break;
        int ii = (int)((w->id + a + u->seq) % ch.o.instances);
        struct inst *g = &ch.inst[ii];
        unsigned kills0 = atomic_load(&g->kills);
        struct curl_slist *h = ch_build_headers(u, a == 0);
        struct http_res r;
        uint64_t t_att = ch_mono_ms();
        ch_http_do(w->curl, g->port, "POST", ch_route_path[u->route], h, body, blen, per_attempt, w->rbuf, CH_BODY_CAP,
                   true, &r);
        curl_slist_free_all(h);
        u->attempts++;
        u->t_last = ch_mono_ms();
        bool killed = atomic_load(&g->kills) != kills0;
        if (killed)
            u->n_killed++;
        char tok[96];
        enum cls c = ch_classify(u, &r, body, blen, tok, sizeof tok);
        if (a == 0 && c != C_REFUSED)
            u->first_delivered = true;
        user_ev(u, "%s+%.3f>g%d:%s%s", a ? " " : "", ch_rel_s(t_att), ii, tok, killed ? ":K" : "");
        bool done = false;
        switch (c) {
        case C_ANSWER:
            u->final = FIN_ANSWER;
            u->ans_status = (int)r.status;
            u->ans_replayed = r.replayed;
            snprintf(u->ans_exec, sizeof u->ans_exec, "%s", r.exec);
            u->ans_body = ch_xmalloc(r.len + 1);
            memcpy(u->ans_body, r.body, r.len);
            u->ans_body[r.len] = '\0';
            u->ans_len = r.len;
            done = true;
            break;
        case C_RELEASE:
            u->n_release++;
            break;
        case C_INUSE:
            u->n_inuse++;
            break;
        case C_OUTCOME_UNKNOWN:
            u->n_outcome_unknown++;
            u->final = FIN_UNKNOWN; /* a real client stops here and asks an operator */
            done = true;
            break;
        case C_STORE_UNAVAIL:
            u->n_store_unavail++;
            break;
        case C_UP_UNAVAIL:
            u->n_up_unavail++;
            break;
        case C_GW_UNKNOWN:
            u->n_gw_unknown++;
            break;
        case C_BUSY:
            break;
        case C_REFUSED:
            u->n_refused++;
            break;
        case C_TRANSPORT:
            u->n_transport++;
            break;
        case C_TIMEOUT:
            u->n_timeout++;
            break;
        case C_WRONG_TENANT:
            u->wrong_tenant = true;
            u->final = FIN_UNEXPECTED;
            done = true;
            break;
        case C_UNEXPECTED:
        default:
            u->n_unexpected++;
            u->final = FIN_UNEXPECTED;
            done = true;
            break;
        }
        if (done)
            return;
        uint64_t d = backoff(w, a, r.retry_after);
        if (ch_mono_ms() + d >= deadline)
            break;
        ch_nap(d);
    }
    u->final = FIN_GAVE_UP;
}

void *ch_worker_main(void *arg)
{
    struct worker *w = arg;
    w->curl = curl_easy_init();
    w->rbuf = ch_xmalloc(CH_BODY_CAP);
    if (w->curl == NULL)
        return NULL;
    ch_nap(ch_splitmix64(&w->rng) % 200);
    while (!atomic_load(&ch.abort) && ch_mono_ms() < ch.traffic_end && w->n < w->max) {
        if (w->n == w->cap) {
            w->cap = w->cap ? w->cap * 2 : 256;
            w->users = ch_xrealloc(w->users, w->cap * sizeof *w->users);
        }
        struct user *u = &w->users[w->n];
        memset(u, 0, sizeof *u);
        plan_user(w, u);
        w->n++;
        run_user(w, u);
        ch_nap(ch_rnd_range(&w->rng, 20, 120));
    }
    curl_easy_cleanup(w->curl);
    w->curl = NULL;
    return NULL;
}

/* ---- the ordered writers: sequences applied in order per resource (SPEC 6, 8) */

/* A final answer for a sequence: the writer moves on to the next one. Anything else (no answer, 503, 409 in use,
 * a 502/504 whose retry will say outcome-unknown) is asked again with the same key. */
static bool ord_final(const struct http_res *r)
{
    if (r->cc != CURLE_OK)
        return false;
    if (r->status == 200 || r->status == 422)
        return true;
    if (r->status != 409 || r->body == NULL)
        return false;
    return strstr(r->body, "stale-sequence") != NULL || strstr(r->body, "sequence-gap") != NULL ||
           strstr(r->body, "idempotency-outcome-unknown") != NULL;
}

void *ch_ordered_main(void *arg)
{
    int res = (int)(uintptr_t)arg;
    CURL *c = curl_easy_init();
    char buf[2048];
    uint64_t rng = ch.o.seed ^ (0x6f72646572ull + (uint64_t)res), seq = 1;
    unsigned tries = 0;
    int gi = 0;
    bool unanswered = false;
    while (c != NULL && !atomic_load(&ch.abort) && ch_mono_ms() < ch.traffic_end) {
        /* a gateway that did not answer (paused, killed) is left for the other one */
        gi = unanswered ? (gi + 1) % (int)ch.o.instances : (int)ch_rnd_range(&rng, 0, ch.o.instances - 1);
        char path[96], key[96], kh[128], sh[48], dh[48];
        snprintf(path, sizeof path, "/v1/ord/%s-r%d", ch.tag, res);
        snprintf(key, sizeof key, "o-%s-r%d-s%" PRIu64, ch.tag, res, seq);
        snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
        snprintf(sh, sizeof sh, "X-Sequence: %" PRIu64, seq);
        /* the writers of the other resources hold the gateway's one connection to the ordered upstream for up to
         * half a lease: a request often waits for it, and a gateway paused then must not send it later */
        snprintf(dh, sizeof dh, "X-Test-Delay-Ms: %" PRIu64, ch_rnd_range(&rng, 0, ch.o.lease_ms / 2));
        struct curl_slist *h = curl_slist_append(NULL, kh);
        h = curl_slist_append(h, sh);
        h = curl_slist_append(h, dh);
        struct http_res r;
        /* a client that gives up after a lease and asks the other gateway (a paused one answers nothing) */
        ch_http_do(c, ch.inst[gi].port, "POST", path, h, "{}", 2, ch.o.lease_ms, buf, sizeof buf, true, &r);
        curl_slist_free_all(h);
        unanswered = r.cc != CURLE_OK;
        atomic_fetch_add(&ch.ord_requests, 1);
        if (ord_final(&r) || ++tries >= 50) {
            seq++;
            tries = 0;
            atomic_fetch_add(&ch.ord_done, 1);
        }
        ch_nap(ch_rnd_range(&rng, 5, 60));
    }
    curl_easy_cleanup(c);
    return NULL;
}
