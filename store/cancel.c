/* cancel.c - a bounded queue of libpq cancel requests and the one background thread that sends them. Never a loop's
 * connections. */
#include "store/cancel.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "common/common.h"

#define CANCEL_QUEUE_MAX 256 /* requests waiting for the thread; past that they are dropped (logged) */

static pthread_once_t cancel_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t cancel_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cancel_cv = PTHREAD_COND_INITIALIZER;
static PGcancel *cancel_q[CANCEL_QUEUE_MAX];
static unsigned cancel_head, cancel_n;
static bool cancel_thread_ok;
static atomic_uint cancel_busy; /* queued + being sent */

static void *cancel_main(void *arg)
{
    (void)arg;
    for (;;) { /* lives as long as the process: its queue may fill at any time */
        pthread_mutex_lock(&cancel_mu);
        while (cancel_n == 0)
            pthread_cond_wait(&cancel_cv, &cancel_mu);
        PGcancel *k = cancel_q[cancel_head];
        cancel_q[cancel_head] = NULL;
        cancel_head = (cancel_head + 1) % CANCEL_QUEUE_MAX;
        cancel_n--;
        pthread_mutex_unlock(&cancel_mu);
        char err[256] = "";
        if (!PQcancel(k, err, (int)sizeof err)) {
            char q[300];
            err[strcspn(err, "\r\n")] = '\0';
            cm_log(CM_WARN, "postgres_cancel_failed", "error=%s", cm_log_quote(q, sizeof q, err));
        }
        PQfreeCancel(k);
        atomic_fetch_sub(&cancel_busy, 1);
    }
    return NULL;
}

static void cancel_start(void)
{
    pthread_t th;
    pthread_attr_t at;
    if (pthread_attr_init(&at) != 0)
        return;
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    cancel_thread_ok = pthread_create(&th, &at, cancel_main, NULL) == 0;
    pthread_attr_destroy(&at);
    if (!cancel_thread_ok)
        cm_log(CM_ERROR, "postgres_cancel_thread_failed", "effect=abandoned_queries_run_until_they_end");
}

bool store_cancel_send(PGconn *pg)
{
    pthread_once(&cancel_once, cancel_start);
    if (!cancel_thread_ok || !pg)
        return false;
    PGcancel *k = PQgetCancel(pg);
    if (!k)
        return false;
    pthread_mutex_lock(&cancel_mu);
    bool queued = cancel_n < CANCEL_QUEUE_MAX;
    if (queued) {
        cancel_q[(cancel_head + cancel_n) % CANCEL_QUEUE_MAX] = k;
        cancel_n++;
        atomic_fetch_add(&cancel_busy, 1);
        pthread_cond_signal(&cancel_cv);
    }
    pthread_mutex_unlock(&cancel_mu);
    if (!queued) {
        PQfreeCancel(k);
        cm_log(CM_WARN, "postgres_cancel_dropped", "limit=%d", CANCEL_QUEUE_MAX);
    }
    return queued;
}

unsigned store_cancel_pending(void)
{
    return atomic_load(&cancel_busy);
}
