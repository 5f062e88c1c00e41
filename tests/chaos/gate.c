/* gate.c - the upstream kill switch: relays the gateways' upstream connections to testupstream; closing it refuses
 * new connections and resets the relayed ones (an upstream crash as the gateways see it). */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "chaos.h"
#include "gate.h"

#define CH_GATE_MAX 2048
#define CH_GATE_BUF 16384

struct gconn {
    int a, b; /* a: gateway side, b: testupstream side */
    char ab[CH_GATE_BUF], ba[CH_GATE_BUF];
    size_t ab_off, ab_len, ba_off, ba_len;
    bool a_eof, b_eof, a_shut, b_shut;
};

static int gate_listen(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 1024) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static void close_rst(int fd)
{
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    (void)setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(fd);
}

static void gconn_free(struct gconn *c, bool rst)
{
    if (rst) {
        close_rst(c->a);
        close_rst(c->b);
    } else {
        close(c->a);
        close(c->b);
    }
    free(c);
}

static int gate_connect_upstream(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct timeval tv = {1, 0};
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(ch.tu_port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
}

/* Moves bytes src -> dst through buf. Returns -1 on a hard error (reset), else 0. */
static int gate_pump(int src, int dst, char *buf, size_t *off, size_t *len, bool *src_eof)
{
    for (int guard = 0; guard < 64; guard++) {
        if (*len == 0 && !*src_eof) {
            ssize_t n = read(src, buf, CH_GATE_BUF);
            if (n > 0) {
                *off = 0;
                *len = (size_t)n;
            } else if (n == 0) {
                *src_eof = true;
            } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
                return 0;
            } else {
                return -1;
            }
        }
        if (*len == 0)
            return 0;
        ssize_t w = send(dst, buf + *off, *len, MSG_NOSIGNAL);
        if (w > 0) {
            *off += (size_t)w;
            *len -= (size_t)w;
        } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            return 0;
        } else {
            return -1;
        }
    }
    return 0;
}

/* Returns false when the connection is finished (freed). */
static bool gate_service(struct gconn *c)
{
    if (gate_pump(c->a, c->b, c->ab, &c->ab_off, &c->ab_len, &c->a_eof) < 0 ||
        gate_pump(c->b, c->a, c->ba, &c->ba_off, &c->ba_len, &c->b_eof) < 0) {
        /* a reset on one side becomes a reset on the other: the gateway sees what a crashed upstream does */
        gconn_free(c, true);
        return false;
    }
    if (c->a_eof && c->ab_len == 0 && !c->b_shut) {
        shutdown(c->b, SHUT_WR);
        c->b_shut = true;
    }
    if (c->b_eof && c->ba_len == 0 && !c->a_shut) {
        shutdown(c->a, SHUT_WR);
        c->a_shut = true;
    }
    if (c->a_eof && c->b_eof && c->ab_len == 0 && c->ba_len == 0) {
        gconn_free(c, false);
        return false;
    }
    return true;
}

void *ch_gate_main(void *arg)
{
    struct gconn **conns = ch_xcalloc(CH_GATE_MAX, sizeof *conns);
    struct pollfd *pfd = ch_xcalloc(1 + 2 * CH_GATE_MAX, sizeof *pfd);
    size_t n = 0;
    int lfd = -1;
    uint64_t last_bind_fail = 0;
    while (!atomic_load(&ch.gate_stop)) {
        bool want = atomic_load(&ch.gate_want_up);
        if (want && lfd < 0 && ch_mono_ms() - last_bind_fail > 100) {
            lfd = gate_listen(ch.gate_port);
            if (lfd < 0) {
                last_bind_fail = ch_mono_ms();
                ch_log("event=gate_bind_failed port=%u errno=%d", (unsigned)ch.gate_port, errno);
            }
        }
        if (!want && lfd >= 0) {
            close(lfd);
            lfd = -1;
            for (size_t i = 0; i < n; i++)
                gconn_free(conns[i], true);
            atomic_fetch_add(&ch.gate_resets, (unsigned)n);
            n = 0;
        }
        atomic_store(&ch.gate_is_up, lfd >= 0);
        size_t k = 0;
        pfd[k++] = (struct pollfd){.fd = lfd, .events = lfd >= 0 ? POLLIN : 0};
        for (size_t i = 0; i < n; i++) {
            struct gconn *c = conns[i];
            short ea = 0, eb = 0;
            if (c->ab_len == 0 && !c->a_eof)
                ea |= POLLIN;
            if (c->ba_len > 0)
                ea |= POLLOUT;
            if (c->ba_len == 0 && !c->b_eof)
                eb |= POLLIN;
            if (c->ab_len > 0)
                eb |= POLLOUT;
            pfd[k++] = (struct pollfd){.fd = c->a, .events = ea};
            pfd[k++] = (struct pollfd){.fd = c->b, .events = eb};
        }
        int rc = poll(pfd, (nfds_t)k, 20);
        if (rc < 0 && errno != EINTR)
            break;
        if (rc <= 0)
            continue;
        /* service existing connections first (their pollfd slots match the array as it was) */
        size_t keep = 0;
        for (size_t i = 0; i < n; i++) {
            struct gconn *c = conns[i];
            bool busy = pfd[1 + 2 * i].revents != 0 || pfd[2 + 2 * i].revents != 0;
            if (!busy || gate_service(c))
                conns[keep++] = c;
        }
        n = keep;
        if (lfd >= 0 && (pfd[0].revents & POLLIN)) {
            for (int j = 0; j < 64; j++) {
                int a = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (a < 0)
                    break;
                atomic_fetch_add(&ch.gate_accepted, 1);
                int b = n < CH_GATE_MAX ? gate_connect_upstream() : -1;
                if (b < 0) {
                    close_rst(a);
                    continue;
                }
                int one = 1;
                (void)setsockopt(a, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                struct gconn *c = ch_xcalloc(1, sizeof *c);
                c->a = a;
                c->b = b;
                conns[n++] = c;
            }
        }
    }
    if (lfd >= 0)
        close(lfd);
    for (size_t i = 0; i < n; i++)
        gconn_free(conns[i], true);
    atomic_store(&ch.gate_is_up, false);
    free(conns);
    free(pfd);
    return NULL;
}

bool ch_gate_set(bool up)
{
    atomic_store(&ch.gate_want_up, up);
    uint64_t end = ch_mono_ms() + 3000;
    while (ch_mono_ms() < end) {
        if (atomic_load(&ch.gate_is_up) == up)
            return true;
        struct timespec ts = {0, 5 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return false;
}
