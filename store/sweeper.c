/* sweeper.c - the queries of the unknown-outcome sweeper and of a retry's probe (gateway/probe.c): take a record
 * to look it up, list the records to look up; an operator's settle takes one the same way. Never the look-up itself
 * (gateway/probe.c). */
#include "store/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- unknown outcomes resolved by probing (gateway/probe.c) */

static void probe_take_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store_i_owner_op *w = arg;
    if (st != STORE_PG_OK) {
        if (st != STORE_PG_UNAVAILABLE && st != STORE_PG_OVERLOAD)
            store_i_log_pg_failure(store_i_owner_op_name(w), st, msg);
        store_i_owner_finish(w, false, 0);
        return;
    }
    store_i_owner_finish(w, true, store_i_cmd_rows(pr));
}

void store_probe_take(struct store *s, const struct store_id *id, uint64_t token, uint64_t hold_ms, uint64_t wait_ms,
                      store_done_cb cb, void *arg)
{
    struct store_i_owner_op *w = store_i_owner_new(s, STORE_OP_PROBE_TAKE, id, token, cb, arg);
    w->arg_ms = hold_ms ? hold_ms : 1;
    w->arg2_ms = wait_ms;
    store_i_owner_send(w, STORE_S_PROBE_TAKE, probe_take_cb);
}

static void settle_take_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store_i_owner_op *w = arg;
    if (st != STORE_PG_OK) {
        store_i_log_pg_failure("settle_take", st, msg);
        store_i_owner_finish(w, false, 0);
        return;
    }
    const PGresult *state = store_pg_cb_then(w->h.s->pg);
    long rows = store_i_cmd_rows(pr);
    bool has = state && PQntuples(state) > 0;
    if (rows > 0 && has && PQnfields(state) >= 2 && !PQgetisnull(state, 0, 1) && w->rid_out_n > 0)
        snprintf(w->rid_out, w->rid_out_n, "%.*s", PQgetlength(state, 0, 1), PQgetvalue(state, 0, 1));
    store_i_owner_finish(w, true, rows > 0 ? 1 : has ? 0 : -1);
}

void store_settle_take(struct store *s, const struct store_id *id, uint64_t token, uint64_t hold_ms, char *request_id,
                       size_t request_id_n, store_done_cb cb, void *arg)
{
    struct store_i_owner_op *w = store_i_owner_new(s, STORE_OP_PROBE_TAKE, id, token, cb, arg);
    w->arg_ms = hold_ms ? hold_ms : 1;
    if (request_id_n > 0)
        request_id[0] = '\0';
    w->rid_out = request_id;
    w->rid_out_n = request_id_n;
    store_i_owner_send(w, STORE_S_SETTLE_TAKE, settle_take_cb);
}

struct probe_list_op {
    struct store_i_op h;
    store_unknown_cb cb;
    void *arg;
};

static void probe_list_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct probe_list_op *o = arg;
    store_i_op_unlink(&o->h);
    if (st != STORE_PG_OK) {
        if (st != STORE_PG_UNAVAILABLE && st != STORE_PG_OVERLOAD)
            store_i_log_pg_failure("probe_list", st, msg);
        o->cb(o->arg, false, NULL, 0);
        store_i_op_free(&o->h);
        return;
    }
    int n = PQntuples(pr);
    struct store_unknown_rec *v = n > 0 ? cm_calloc((size_t)n, sizeof *v) : NULL;
    size_t got = 0;
    for (int i = 0; i < n && PQnfields(pr) >= 3; i++) {
        size_t klen = (size_t)PQgetlength(pr, i, 2);
        if (PQgetlength(pr, i, 1) != 32 || klen == 0 || klen > 255)
            continue;
        struct store_unknown_rec *r = &v[got++];
        r->id.route = cm_strndup(PQgetvalue(pr, i, 0), (size_t)PQgetlength(pr, i, 0));
        memcpy(r->id.scope, PQgetvalue(pr, i, 1), 32);
        r->id.key = cm_strndup(PQgetvalue(pr, i, 2), klen);
        r->id.key_len = klen;
    }
    o->cb(o->arg, true, v, got);
    for (size_t i = 0; i < got; i++) {
        free((char *)v[i].id.route);
        free((char *)v[i].id.key);
    }
    free(v);
    store_i_op_free(&o->h);
}

void store_probe_list(struct store *s, const char *routes_nl, size_t max, store_unknown_cb cb, void *arg)
{
    struct probe_list_op *o = cm_calloc(1, sizeof *o);
    store_i_op_link(s, &o->h, STORE_OP_PROBE_LIST);
    o->cb = cb;
    o->arg = arg;
    uint8_t lim[8];
    store_i_be64(lim, (uint64_t)max);
    struct store_pg_param p[2] = {
        {routes_nl, strlen(routes_nl), true},
        {lim, 8, true},
    };
    store_pg_query(s->pg, STORE_S_PROBE_LIST, p, 2, 1, probe_list_cb, o);
}

/* ---- end of probe */
