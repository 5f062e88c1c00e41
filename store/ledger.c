/* ledger.c - a route's records in keyset pages for the reconcile command (store/ledger.h). */
#include "store/ledger.h"

#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/migrate.h"

#define LEDGER_PAGE_MAX 1000

struct store_ledger {
    PGconn *c;
    bool started; /* a page was read: the cursor below holds its last record */
    uint8_t scope[32];
    char *key;
    size_t key_len;
};

/* Both forms work on plain Postgres and on Citus (a multi-shard read, merged in order by the coordinator). The row
 * comparison is the keyset cursor; $4 false: the first page. */
/* clang-format off */
static const char sql_page[] =
    "SELECT scope, key, state = 'completed', coalesce(status, 0)::int4,"
    " (extract(epoch FROM created_at) * 1000)::int8"
    " FROM idemgate_keys"
    " WHERE route = $1 AND created_at >= now() - $2::int8 * interval '1 ms'"
    " AND (NOT $4::bool OR (scope, key) > ($5::bytea, $6::text))"
    " AND CASE $3::int4 WHEN 0 THEN state = 'completed'"
    " WHEN 1 THEN state = 'unknown' OR (state = 'in_flight' AND lease_until < now())"
    " ELSE state = 'completed' OR state = 'unknown' OR (state = 'in_flight' AND lease_until < now()) END"
    " ORDER BY scope, key LIMIT $7::int8";
/* clang-format on */

struct store_ledger *store_ledger_open(const char *postgres_url, uint64_t timeout_ms, char **err)
{
    PGconn *c = store_sync_connect(postgres_url, timeout_ms, "idemgate-reconcile", err);
    if (!c)
        return NULL;
    struct store_ledger *l = cm_calloc(1, sizeof *l);
    l->c = c;
    return l;
}

void store_ledger_close(struct store_ledger *l)
{
    if (!l)
        return;
    PQfinish(l->c);
    free(l->key);
    free(l);
}

void store_ledger_recs_free(struct store_ledger_rec *v, size_t n)
{
    for (size_t i = 0; v && i < n; i++)
        free(v[i].key);
    free(v);
}

bool store_ledger_page(struct store_ledger *l, const char *route, uint64_t since_ms, enum store_ledger_state st,
                       size_t max, struct store_ledger_rec **out, size_t *n, char **err)
{
    *out = NULL;
    *n = 0;
    if (max == 0 || max > LEDGER_PAGE_MAX)
        max = LEDGER_PAGE_MAX;
    char since[24], state[8], limit[24];
    snprintf(since, sizeof since, "%llu", (unsigned long long)since_ms);
    snprintf(state, sizeof state, "%d", (int)st);
    snprintf(limit, sizeof limit, "%zu", max);
    const char *vals[7] = {route, since, state, l->started ? "t" : "f", (const char *)l->scope, l->key ? l->key : "",
                           limit};
    int lens[7] = {0, 0, 0, 0, 32, (int)l->key_len, 0};
    int fmts[7] = {0, 0, 0, 0, 1, 1, 0}; /* the cursor goes back as it came: binary scope, the key's bytes */
    PGresult *r = PQexecParams(l->c, sql_page, 7, NULL, vals, lens, fmts, 1);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        *err = cm_asprintf("reading the records failed: %s", PQerrorMessage(l->c));
        PQclear(r);
        return false;
    }
    int rows = PQntuples(r);
    struct store_ledger_rec *v = rows ? cm_calloc((size_t)rows, sizeof *v) : NULL;
    for (int i = 0; i < rows; i++) {
        if (PQgetlength(r, i, 0) != 32 || PQgetlength(r, i, 2) != 1 || PQgetlength(r, i, 3) != 4 ||
            PQgetlength(r, i, 4) != 8) {
            *err = cm_strdup("reading the records failed: unexpected row");
            store_ledger_recs_free(v, (size_t)i);
            PQclear(r);
            return false;
        }
        memcpy(v[i].scope, PQgetvalue(r, i, 0), 32);
        v[i].key_len = (size_t)PQgetlength(r, i, 1);
        v[i].key = cm_strndup(PQgetvalue(r, i, 1), v[i].key_len);
        v[i].completed = PQgetvalue(r, i, 2)[0] != 0;
        const unsigned char *s = (const unsigned char *)PQgetvalue(r, i, 3);
        v[i].status = (int)((uint32_t)s[0] << 24 | (uint32_t)s[1] << 16 | (uint32_t)s[2] << 8 | s[3]);
        const unsigned char *t = (const unsigned char *)PQgetvalue(r, i, 4);
        uint64_t ms = 0;
        for (int b = 0; b < 8; b++)
            ms = ms << 8 | t[b];
        v[i].created_ms = (int64_t)ms;
    }
    if (rows > 0) {
        l->started = true;
        memcpy(l->scope, v[rows - 1].scope, 32);
        free(l->key);
        l->key = cm_strndup(v[rows - 1].key, v[rows - 1].key_len);
        l->key_len = v[rows - 1].key_len;
    }
    PQclear(r);
    *out = v;
    *n = (size_t)rows;
    return true;
}
