/* cleaner.c - the background cleaner: expired records deleted in batches, and the stuck-processing gauge. Never
 * a record that has not expired. */
#include "store/internal.h"

#include <string.h>

/* ---- background: expired records and stuck gauge */

void store_i_clean_schedule(struct store *s, uint64_t ms)
{
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    evtimer_add(s->clean_timer, &tv);
}

static void stuck_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store *s = arg;
    if (st == STORE_PG_OK) {
        /* every route this process has a slot for (the start-time configuration and every reload's), by name: a
         * route a reload added is counted too */
        size_t nslots = cm_metrics_routes_n();
        for (size_t i = 0; i < nslots; i++) {
            uint64_t n = 0;
            const char *name = cm_metrics_route_name(i);
            for (int r = 0; r < PQntuples(pr); r++) {
                if ((size_t)PQgetlength(pr, r, 0) == strlen(name) &&
                    memcmp(PQgetvalue(pr, r, 0), name, strlen(name)) == 0) {
                    int64_t v = store_pg_get_i64(pr, r, 1);
                    n = v > 0 ? (uint64_t)v : 0;
                }
            }
            cm_metric_stuck_processing_set(i, n);
        }
    } else if (st == STORE_PG_SQL_ERROR) {
        store_i_log_pg_failure("stuck", st, msg);
    }
    s->cleaning = false;
    store_i_clean_schedule(s, STORE_CLEAN_EVERY_MS);
}

static void clean_cb(void *arg, enum store_pg_status st, const PGresult *pr, const char *msg)
{
    struct store *s = arg;
    if (st == STORE_PG_OK) {
        long n = store_i_cmd_rows(pr);
        s->cleaned += (uint64_t)n;
        if (n > 0)
            cm_log(CM_DEBUG, "store_cleaned", "rows=%ld", n);
        if (n >= STORE_CLEAN_BATCH && ++s->clean_batches < STORE_CLEAN_MAX_BATCHES) {
            store_pg_query(s->pg, STORE_S_CLEAN, NULL, 0, 1, clean_cb, s);
            return;
        }
    } else if (st == STORE_PG_SQL_ERROR) {
        store_i_log_pg_failure("clean", st, msg);
    }
    /* Citus runs the count on every shard: there it is refreshed every STORE_STUCK_EVERY_CITUS passes. */
    if (s->conf->distributed == CONF_DIST_CITUS && s->clean_passes++ % STORE_STUCK_EVERY_CITUS != 0) {
        s->cleaning = false;
        store_i_clean_schedule(s, STORE_CLEAN_EVERY_MS);
        return;
    }
    store_pg_query(s->pg, STORE_S_STUCK, NULL, 0, 1, stuck_cb, s);
}

void store_i_clean_timer_cb(evutil_socket_t fd, short what, void *arg)
{
    struct store *s = arg;
    (void)fd;
    (void)what;
    if (s->cleaning)
        return;
    s->cleaning = true;
    s->clean_batches = 0;
    store_pg_query(s->pg, STORE_S_CLEAN, NULL, 0, 1, clean_cb, s);
}
