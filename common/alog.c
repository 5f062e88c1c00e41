/* alog.c - the access log's sink: a bounded ring filled by any thread, written out in batches by its own thread
 * (common/alog.h). */
#include "common/alog.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define RING_BYTES     (1024 * 1024) /* what may wait for the writer: about 4,000 lines */
#define BATCH_BYTES    (256 * 1024)  /* one write at most */
#define FLUSH_AT       (256 * 1024)  /* the writer is woken at once past this (a wake-up costs the request thread) */
#define FLUSH_EVERY_MS 100           /* else it writes what waits this often */
#define CLOSE_WAIT_MS  2000

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    bool started;
    bool stopping;
    bool reopen;
    char *ring;
    size_t head; /* next byte to write out */
    size_t len;  /* bytes waiting */
    int fd;
    bool is_stderr;
    bool pieces; /* stderr is not a regular file (a pipe, a socket, a tty): writes of at most PIPE_BUF */
    char *path;
} sink = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .fd = -1};

static atomic_bool enabled;
static _Atomic uint64_t dropped;
bool cm_alog_enabled(void)
{
    return atomic_load_explicit(&enabled, memory_order_relaxed);
}

uint64_t cm_alog_dropped(void)
{
    return atomic_load(&dropped);
}

static size_t count_lines(const char *p, size_t n)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        c += p[i] == '\n';
    return c;
}

void cm_alog_write(const char *line, size_t n)
{
    if (!cm_alog_enabled() || n == 0)
        return;
    bool wake = false, ok = false;
    pthread_mutex_lock(&sink.mu);
    if (sink.ring && !sink.stopping && n <= RING_BYTES - sink.len) {
        size_t tail = (sink.head + sink.len) % RING_BYTES;
        size_t first = n < RING_BYTES - tail ? n : RING_BYTES - tail;
        memcpy(sink.ring + tail, line, first);
        memcpy(sink.ring, line + first, n - first);
        wake = sink.len < FLUSH_AT && sink.len + n >= FLUSH_AT;
        sink.len += n;
        ok = true;
    }
    pthread_mutex_unlock(&sink.mu);
    if (!ok)
        atomic_fetch_add(&dropped, count_lines(line, n) ? count_lines(line, n) : 1);
    else if (wake)
        pthread_cond_signal(&sink.cv);
}

void cm_alog_reopen(void)
{
    pthread_mutex_lock(&sink.mu);
    sink.reopen = true;
    pthread_mutex_unlock(&sink.mu);
    pthread_cond_signal(&sink.cv);
}

static int open_file(const char *path)
{
    return open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
}

/* Writes p[0..n) (whole lines); what cannot be written is dropped and counted. On a stderr that is a pipe (or any
 * other file than a regular one) shared with the other log lines, each write is at most PIPE_BUF bytes ending at a
 * line's end, so that no line is interleaved with another writer's; a write to a regular file is never interleaved
 * with another write to it, so there the batch goes whole. */
static void write_out(int fd, bool piece_by_line, const char *p, size_t n)
{
    while (n > 0) {
        size_t w = n;
        if (piece_by_line && w > PIPE_BUF) {
            w = PIPE_BUF;
            while (w > 0 && p[w - 1] != '\n')
                w--;
            if (w == 0) /* one line longer than PIPE_BUF (cannot happen: lines are at most CM_ALOG_LINE_MAX) */
                w = n;
        }
        ssize_t r = write(fd, p, w);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            atomic_fetch_add(&dropped, count_lines(p, n));
            return;
        }
        p += r;
        n -= (size_t)r;
    }
}

static void *writer_main(void *arg)
{
    (void)arg;
    char *batch = cm_malloc(BATCH_BYTES);
    pthread_mutex_lock(&sink.mu);
    for (;;) {
        if (sink.len < FLUSH_AT && !sink.reopen && !sink.stopping) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += FLUSH_EVERY_MS * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&sink.cv, &sink.mu, &ts);
        }
        if (sink.reopen) {
            sink.reopen = false;
            if (!sink.is_stderr && sink.path) {
                pthread_mutex_unlock(&sink.mu);
                int fd = open_file(sink.path);
                pthread_mutex_lock(&sink.mu);
                if (fd >= 0) {
                    close(sink.fd);
                    sink.fd = fd;
                } else {
                    cm_log(CM_ERROR, "access_log_reopen_failed", "error=\"%s\"", strerror(errno));
                }
            }
        }
        if (sink.len == 0 && sink.stopping)
            break;
        size_t n = sink.len < BATCH_BYTES ? sink.len : BATCH_BYTES, head = sink.head;
        int fd = sink.fd;
        bool pieces = sink.pieces;
        if (n == 0)
            continue;
        /* Copied without the lock (the threads writing lines wait for it): [head, head + n) stays the writer's until
         * head moves, for lines are only ever added after head + len. */
        pthread_mutex_unlock(&sink.mu);
        size_t first = n < RING_BYTES - head ? n : RING_BYTES - head;
        memcpy(batch, sink.ring + head, first);
        memcpy(batch + first, sink.ring, n - first);
        /* whole lines only: the ring never holds a part of one, but a batch may end inside one */
        while (n > 0 && batch[n - 1] != '\n')
            n--;
        pthread_mutex_lock(&sink.mu);
        sink.head = (head + n) % RING_BYTES;
        sink.len -= n;
        if (n == 0)
            continue;
        pthread_mutex_unlock(&sink.mu);
        write_out(fd, pieces, batch, n);
        pthread_mutex_lock(&sink.mu);
    }
    pthread_mutex_unlock(&sink.mu);
    free(batch);
    return NULL;
}

bool cm_alog_open(const char *dest, char **err)
{
    if (!dest || strcmp(dest, "off") == 0)
        return true;
    int fd = STDERR_FILENO;
    bool is_stderr = strcmp(dest, "stderr") == 0;
    if (!is_stderr && (fd = open_file(dest)) < 0) {
        *err = cm_asprintf("access_log: cannot open %s: %s", dest, strerror(errno));
        return false;
    }
    pthread_mutex_lock(&sink.mu);
    sink.ring = cm_malloc(RING_BYTES);
    sink.head = sink.len = 0;
    sink.fd = fd;
    sink.is_stderr = is_stderr;
    struct stat st;
    sink.pieces = is_stderr && !(fstat(fd, &st) == 0 && S_ISREG(st.st_mode));
    sink.path = is_stderr ? NULL : cm_strdup(dest);
    sink.stopping = false;
    pthread_mutex_unlock(&sink.mu);
    if (pthread_create(&sink.thread, NULL, writer_main, NULL) != 0) {
        *err = cm_strdup("access_log: cannot start its writer thread");
        if (!is_stderr)
            close(fd);
        free(sink.ring);
        free(sink.path);
        sink.ring = NULL;
        sink.path = NULL;
        return false;
    }
    sink.started = true;
    atomic_store(&enabled, true);
    return true;
}

void cm_alog_close(void)
{
    if (!sink.started)
        return;
    atomic_store(&enabled, false);
    pthread_mutex_lock(&sink.mu);
    sink.stopping = true;
    pthread_mutex_unlock(&sink.mu);
    pthread_cond_signal(&sink.cv);
    /* bounded: a writer stuck on a dead disk is left behind (the process is ending) */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += CLOSE_WAIT_MS / 1000;
    if (pthread_timedjoin_np(sink.thread, NULL, &ts) != 0)
        return;
    sink.started = false;
    if (!sink.is_stderr && sink.fd >= 0)
        close(sink.fd);
    sink.fd = -1;
    free(sink.ring);
    free(sink.path);
    sink.ring = NULL;
    sink.path = NULL;
}

void cm_alog_line(const char *fields, size_t n)
{
    if (!cm_alog_enabled())
        return;
    char line[CM_ALOG_LINE_MAX + 128], js[2 * CM_ALOG_LINE_MAX];
    size_t len = cm_log_head(line, sizeof line, CM_INFO, "access");
    if (n > sizeof line - len - 2)
        n = sizeof line - len - 2;
    line[len++] = ' ';
    memcpy(line + len, fields, n);
    len += n;
    if (cm_log_get_format() == CM_LOG_JSON) {
        size_t j = cm_logfmt_to_json(line, len, js, sizeof js);
        if (j == 0) {
            atomic_fetch_add(&dropped, 1);
            return;
        }
        cm_alog_write(js, j);
        return;
    }
    line[len++] = '\n';
    cm_alog_write(line, len);
}
