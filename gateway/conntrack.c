/* conntrack.c - the connection watchdog: cuts connections that read a request or write an answer for too long. It only
 * shuts sockets down: never reads or writes a byte of them. */
#include "gateway/conntrack.h"

#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

#include "common/common.h"

struct gw_conntrack {
    pthread_mutex_t mu; /* guards conns */
    struct gw_conn *conns;
    pthread_t thread;
    atomic_bool stop;
    uint64_t timeout_ms;
    const char *what;
};

/* Cuts c (under ct->mu). A shutdown makes libmicrohttpd read the end of the stream and close the connection itself;
 * one writing an answer is disconnected too (Linux: connect(AF_UNSPEC) resets it and drops its queues), because
 * libmicrohttpd notices a shutdown only at its next send, when a slow reader has made room. */
static void cut(struct gw_conn *c)
{
    shutdown(c->fd, SHUT_RDWR);
    if (atomic_load(&c->answering)) {
        struct sockaddr sa = {.sa_family = AF_UNSPEC};
        (void)connect(c->fd, &sa, sizeof sa);
    }
    c->shut = true;
}

static void *watchdog_main(void *arg)
{
    struct gw_conntrack *ct = arg;
    while (!atomic_load(&ct->stop)) {
        struct timespec ts = {0, 200 * 1000 * 1000};
        nanosleep(&ts, NULL);
        uint64_t now = cm_now_ms();
        size_t n = 0;
        pthread_mutex_lock(&ct->mu);
        for (struct gw_conn *c = ct->conns; c; c = c->next) {
            if (!c->shut && c->fd >= 0 && cm_overdue(atomic_load(&c->since), now, ct->timeout_ms)) {
                cut(c);
                n++;
            }
        }
        pthread_mutex_unlock(&ct->mu);
        if (n)
            cm_log(CM_INFO, "client_timeout", "listener=%s connections=%zu timeout_ms=%llu", ct->what, n,
                   (unsigned long long)ct->timeout_ms);
    }
    return NULL;
}

struct gw_conntrack *gw_conntrack_start(uint64_t timeout_ms, const char *what, char **err)
{
    struct gw_conntrack *ct = cm_calloc(1, sizeof *ct);
    pthread_mutex_init(&ct->mu, NULL);
    ct->timeout_ms = timeout_ms;
    ct->what = what;
    if (pthread_create(&ct->thread, NULL, watchdog_main, ct) != 0) {
        *err = cm_asprintf("cannot start the %s watchdog thread", what);
        pthread_mutex_destroy(&ct->mu);
        free(ct);
        return NULL;
    }
    return ct;
}

void gw_conntrack_stop(struct gw_conntrack *ct)
{
    if (!ct)
        return;
    atomic_store(&ct->stop, true);
    pthread_join(ct->thread, NULL);
    while (ct->conns) {
        struct gw_conn *c = ct->conns;
        ct->conns = c->next;
        free(c);
    }
    pthread_mutex_destroy(&ct->mu);
    free(ct);
}

struct gw_conn *gw_conntrack_add(struct gw_conntrack *ct, int fd)
{
    struct gw_conn *c = cm_calloc(1, sizeof *c);
    c->fd = fd;
    atomic_store(&c->since, cm_now_ms());
    pthread_mutex_lock(&ct->mu);
    c->next = ct->conns;
    if (ct->conns)
        ct->conns->prev = c;
    ct->conns = c;
    pthread_mutex_unlock(&ct->mu);
    return c;
}

void gw_conntrack_remove(struct gw_conntrack *ct, struct gw_conn *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&ct->mu);
    if (c->prev)
        c->prev->next = c->next;
    else
        ct->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    pthread_mutex_unlock(&ct->mu);
    free(c);
}

void gw_conn_reading(struct gw_conn *c)
{
    atomic_store(&c->answering, false);
    atomic_store(&c->since, cm_now_ms());
}

void gw_conn_waiting(struct gw_conn *c)
{
    atomic_store(&c->since, 0);
}

void gw_conn_answering(struct gw_conn *c)
{
    atomic_store(&c->answering, true);
    atomic_store(&c->since, cm_now_ms());
}

void gw_conn_request_done(struct gw_conn *c, bool ok)
{
    if (!ok && atomic_load(&c->answering) && c->fd >= 0) {
        struct linger lg = {.l_onoff = 1, .l_linger = 0};
        (void)setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    }
    gw_conn_reading(c);
}
