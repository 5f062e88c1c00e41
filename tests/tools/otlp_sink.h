/* otlp_sink.h - a small OTLP/HTTP receiver for the tests: a thread on 127.0.0.1 that takes POST /v1/traces and keeps
 * the JSON bodies (or, black-holing, reads them and never answers). Header-only: static functions. */
#ifndef IDEMGATE_TEST_OTLP_SINK_H
#define IDEMGATE_TEST_OTLP_SINK_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#define OTLP_SINK_BODIES   256
#define OTLP_SINK_BODY_MAX (4 * 1024 * 1024)
#define OTLP_SINK_CONNS    64

struct otlp_sink {
    int lfd;
    unsigned short port;
    bool black_hole; /* read requests, never answer */
    pthread_t thread;
    pthread_mutex_t mu;
    volatile bool stop;
    char *bodies[OTLP_SINK_BODIES];
    size_t nbodies;
    size_t posts;  /* requests read (answered or not) */
    char paths_ok; /* every request was POST /v1/traces with content-type application/json */
    int held[OTLP_SINK_CONNS];
    size_t nheld;
};

/* Reads one request from fd within ~2 s; returns its body (malloc'd) or NULL. */
static char *otlp_sink_read(struct otlp_sink *s, int fd, bool *ok)
{
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap + 1);
    size_t head_end = 0, clen = 0;
    *ok = false;
    for (int rounds = 0; rounds < 200; rounds++) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 10) <= 0) {
            if (s->stop)
                break;
            continue;
        }
        if (len == cap) {
            if (cap >= OTLP_SINK_BODY_MAX)
                break;
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
        ssize_t r = read(fd, buf + len, cap - len);
        if (r <= 0)
            break;
        len += (size_t)r;
        buf[len] = '\0';
        if (head_end == 0) {
            char *e = strstr(buf, "\r\n\r\n");
            if (e == NULL)
                continue;
            head_end = (size_t)(e - buf) + 4;
            char *cl = strcasestr(buf, "\r\ncontent-length:");
            clen = cl && cl < e ? strtoul(cl + 17, NULL, 10) : 0;
            char *ct = strcasestr(buf, "\r\ncontent-type: application/json");
            *ok = strncmp(buf, "POST /v1/traces HTTP/1.1\r\n", 26) == 0 && ct != NULL && ct < e;
        }
        if (head_end && len >= head_end + clen) {
            char *body = strndup(buf + head_end, clen);
            free(buf);
            return body;
        }
    }
    free(buf);
    return NULL;
}

static void *otlp_sink_main(void *arg)
{
    struct otlp_sink *s = arg;
    while (!s->stop) {
        struct pollfd p = {.fd = s->lfd, .events = POLLIN};
        if (poll(&p, 1, 20) <= 0)
            continue;
        int fd = accept(s->lfd, NULL, NULL);
        if (fd < 0)
            continue;
        /* one request per connection is enough: the exporter reuses its connection, so keep serving it */
        for (;;) {
            bool ok;
            char *body = otlp_sink_read(s, fd, &ok);
            if (body == NULL)
                break;
            pthread_mutex_lock(&s->mu);
            s->posts++;
            if (!ok)
                s->paths_ok = 0;
            if (!s->black_hole && s->nbodies < OTLP_SINK_BODIES)
                s->bodies[s->nbodies++] = body;
            else
                free(body);
            pthread_mutex_unlock(&s->mu);
            if (s->black_hole)
                break;
            static const char ans[] =
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
            if (write(fd, ans, sizeof ans - 1) < 0)
                break;
        }
        if (s->black_hole && s->nheld < OTLP_SINK_CONNS)
            s->held[s->nheld++] = fd; /* never answered, closed at stop */
        else
            close(fd);
    }
    return NULL;
}

/* Starts a sink on 127.0.0.1 (a free port); false when it cannot listen. */
static bool otlp_sink_start(struct otlp_sink *s, bool black_hole)
{
    memset(s, 0, sizeof *s);
    s->black_hole = black_hole;
    s->paths_ok = 1;
    pthread_mutex_init(&s->mu, NULL);
    s->lfd = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(s->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (s->lfd < 0 || bind(s->lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(s->lfd, 64) != 0 ||
        getsockname(s->lfd, (struct sockaddr *)&a, &al) != 0)
        return false;
    s->port = ntohs(a.sin_port);
    return pthread_create(&s->thread, NULL, otlp_sink_main, s) == 0;
}

static void otlp_sink_stop(struct otlp_sink *s)
{
    s->stop = true;
    pthread_join(s->thread, NULL);
    close(s->lfd);
    for (size_t i = 0; i < s->nheld; i++)
        close(s->held[i]);
    for (size_t i = 0; i < s->nbodies; i++)
        free(s->bodies[i]);
    pthread_mutex_destroy(&s->mu);
}

/* The bodies received so far, joined with '\n' (malloc'd). */
static char *otlp_sink_all(struct otlp_sink *s)
{
    pthread_mutex_lock(&s->mu);
    size_t n = 1;
    for (size_t i = 0; i < s->nbodies; i++)
        n += strlen(s->bodies[i]) + 1;
    char *out = malloc(n), *p = out;
    for (size_t i = 0; i < s->nbodies; i++) {
        size_t l = strlen(s->bodies[i]);
        memcpy(p, s->bodies[i], l);
        p[l] = '\n';
        p += l + 1;
    }
    *p = '\0';
    pthread_mutex_unlock(&s->mu);
    return out;
}

#endif
