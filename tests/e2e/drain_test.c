/* drain_test.c - end-to-end checks of the drain delay (shutdown_delay): after SIGTERM /readyz is 503 at once while
 * the front keeps accepting and serving new connections for the delay, then refuses them, and the process exits 0. */
#include <criterion/criterion.h>

#include <curl/curl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "harness.h"

TestSuite(drain, .init = e2e_setup, .fini = e2e_teardown, .timeout = 90);

/* clang-format off */
#define DRAIN_CONF(delay)                                                                                              \
    E2E_CONF_PORTS                                                                                                     \
    "shutdown_delay: " delay "\n"                                                                                      \
    E2E_CONF_STORE("{{REDIS_URL}}")                                                                                    \
    "upstreams:\n"                                                                                                     \
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")                                                                 \
    "routes:\n"                                                                                                        \
    E2E_CONF_ROUTE("pay", "/v1/pay", "api")                                                                            \
    "      key: required\n"
/* clang-format on */

/* A keyed POST on a new connection (the harness opens one per request); its status, 0 when it could not connect. */
static long post_new_connection(const struct e2e_gw *gw, const char *tag, int *curl_code)
{
    char key[96];
    e2e_mkkey(key, sizeof key, tag);
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay", key, NULL, "{}", 1500, &r);
    long st = r.status;
    *curl_code = r.curl_code;
    e2e_resp_free(&r);
    return st;
}

Test(drain, sigterm_keeps_serving_for_the_delay_with_readyz_503_then_refuses_and_exits_0)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw_opts o = {.up = up, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(DRAIN_CONF("3s"), &o);
    uint64_t t0 = e2e_now_ms();
    cr_assert_eq(kill(gw->proc.pid, SIGTERM), 0);
    cr_expect(e2e_gw_readyz_wait(gw, 503, 500), "/readyz turns 503 at once after SIGTERM (last %ld)",
              e2e_gw_readyz(gw));
    cr_expect(e2e_gw_log_wait(gw, "event=draining", 1000), "the drain is logged");

    /* during the delay: new connections are accepted and served, /readyz stays 503 */
    int served = 0, code = 0;
    while (e2e_now_ms() - t0 < 2200) {
        long st = post_new_connection(gw, "drain-in", &code);
        cr_expect_eq(st, 200, "a new connection %llu ms after SIGTERM (delay 3 s): %ld (curl %d)",
                     (unsigned long long)(e2e_now_ms() - t0), st, code);
        served += st == 200;
        cr_expect_eq(e2e_gw_readyz(gw), 503, "/readyz during the delay");
        e2e_sleep_ms(200);
    }
    cr_expect_geq(served, 3, "several requests served during the delay: %d", served);
    cr_expect_eq(e2e_upstream_count(up, NULL), served, "each one executed once");

    /* after it: connections are refused, and the process exits 0 */
    while (e2e_now_ms() - t0 < 3600)
        e2e_sleep_ms(50);
    long st = post_new_connection(gw, "drain-after", &code);
    cr_expect(st == 0 && code == CURLE_COULDNT_CONNECT, "a new connection after the delay is refused: %ld (curl %d)",
              st, code);
    cr_assert(e2e_proc_wait(&gw->proc, 8000), "idemgate still running after the delay");
    cr_expect_eq(e2e_proc_exit_code(&gw->proc), 0, "exit code %d", e2e_proc_exit_code(&gw->proc));
    cr_expect_eq(e2e_upstream_count(up, NULL), served, "nothing more executed");
}

/* With the default (0s) the front closes at SIGTERM, as before: the drain delay never holds a plain stop. */
Test(drain, without_a_delay_sigterm_closes_the_front_at_once)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw_opts o = {.up = up, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(DRAIN_CONF("0s"), &o);
    uint64_t t0 = e2e_now_ms();
    cr_assert_eq(kill(gw->proc.pid, SIGTERM), 0);
    cr_assert(e2e_proc_wait(&gw->proc, 5000), "idemgate still running after SIGTERM");
    cr_expect_eq(e2e_proc_exit_code(&gw->proc), 0, "exit code %d", e2e_proc_exit_code(&gw->proc));
    cr_expect(e2e_now_ms() - t0 < 2000, "exits promptly: %llu ms", (unsigned long long)(e2e_now_ms() - t0));
    cr_expect(!e2e_gw_log_contains(gw, "event=draining"), "no drain without a delay");
}
