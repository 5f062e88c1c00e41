/* clockshift.c - an LD_PRELOAD shim that moves a process's wall clock (tests: gateways whose clocks disagree).
 *
 * IDEMGATE_CLOCK_SHIFT_MS=N (signed milliseconds) is added to every CLOCK_REALTIME reading the process makes
 * through clock_gettime, gettimeofday and time; CLOCK_MONOTONIC and the others are left as they are (a shifted
 * wall clock, not a faster one: what an NTP-less host or a stepped clock looks like). Unset or malformed: 0. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

static int64_t shift_ns(void)
{
    static int cached;
    static int64_t ns;
    if (!cached) {
        const char *v = getenv("IDEMGATE_CLOCK_SHIFT_MS");
        char *end = NULL;
        long long ms = v ? strtoll(v, &end, 10) : 0;
        ns = (v && end && *end == '\0' && ms > -86400000LL * 365 && ms < 86400000LL * 365) ? ms * 1000000LL : 0;
        cached = 1;
    }
    return ns;
}

static clock_gettime_fn real_clock_gettime(void)
{
    static clock_gettime_fn fn;
    if (!fn)
        fn = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
    return fn;
}

static void add_ns(struct timespec *ts, int64_t d)
{
    int64_t t = (int64_t)ts->tv_nsec + d % 1000000000LL;
    time_t s = ts->tv_sec + (time_t)(d / 1000000000LL);
    if (t < 0) {
        t += 1000000000LL;
        s--;
    } else if (t >= 1000000000LL) {
        t -= 1000000000LL;
        s++;
    }
    ts->tv_sec = s;
    ts->tv_nsec = (long)t;
}

/* The wrappers are the shim's whole API: exported, with the libc prototypes. */
int clock_gettime(clockid_t id, struct timespec *ts)
{
    clock_gettime_fn fn = real_clock_gettime();
    if (!fn) {
        errno = ENOSYS;
        return -1;
    }
    int rc = fn(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE))
        add_ns(ts, shift_ns());
    return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz)
{
    (void)tz;
    struct timespec ts;
    int rc = clock_gettime(CLOCK_REALTIME, &ts);
    if (rc == 0) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = (suseconds_t)(ts.tv_nsec / 1000);
    }
    return rc;
}

time_t time(time_t *out)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return (time_t)-1;
    if (out)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
