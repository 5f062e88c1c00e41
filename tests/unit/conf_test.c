/* conf_test.c - configuration loading: the example file, defaults, parsers, route matching, env, bad configs. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "conf/conf.h"
#include "conf/reference.h"

/* A minimal valid file (5 lines); cases append from line 6. */
#define BASE                                                                                                           \
    "store:\n"                                                                                                         \
    "  postgres: postgres://u@127.0.0.1/db\n"                                                                          \
    "upstreams:\n"                                                                                                     \
    "  - name: api\n"                                                                                                  \
    "    url: http://127.0.0.1:9000\n"

static void clean_env(void)
{
    unsetenv("IDEMGATE_POSTGRES_URL");
    unsetenv("IDEMGATE_REDIS_URL");
    unsetenv("IDEMGATE_ADMIN_TOKEN");
    unsetenv("IDEMGATE_STORE_DISTRIBUTED");
}

static struct conf *load(const char *yaml, char **err)
{
    *err = NULL;
    return conf_load_string("t.yaml", yaml, strlen(yaml), err);
}

/* Loads text that must be valid; fails the test with the message otherwise. */
static struct conf *load_ok(const char *yaml)
{
    char *err = NULL;
    struct conf *c = load(yaml, &err);
    cr_assert_not_null(c, "unexpected error: %s", err ? err : "(none)");
    cr_assert_null(err);
    return c;
}

static const char *example_path(void)
{
    static char buf[4096];
    const char *env = getenv("IDEMGATE_EXAMPLE_CONF");
    if (env != NULL && access(env, R_OK) == 0)
        return env;
    /* __FILE__ is tests/unit/conf_test.c relative to the build directory,
     * where meson runs the tests. */
    const char *f = __FILE__;
    const char *cut = strstr(f, "tests/unit/conf_test.c");
    if (cut != NULL) {
        snprintf(buf, sizeof(buf), "%.*sconf/idemgate.example.yaml", (int)(cut - f), f);
        if (access(buf, R_OK) == 0)
            return buf;
    }
    static const char *const guesses[] = {"conf/idemgate.example.yaml", "../conf/idemgate.example.yaml"};
    for (size_t i = 0; i < sizeof(guesses) / sizeof(guesses[0]); i++)
        if (access(guesses[i], R_OK) == 0)
            return guesses[i];
    return NULL;
}

TestSuite(conf, .init = clean_env);

Test(conf, example_config_loads)
{
    const char *path = example_path();
    cr_assert_not_null(path, "conf/idemgate.example.yaml not found");
    char *err = NULL;
    struct conf *c = conf_load(path, &err);
    cr_assert_not_null(c, "example failed: %s", err ? err : "");

    cr_expect_str_eq(c->file, path);
    cr_expect_str_eq(c->listen.host, "127.0.0.1");
    cr_expect_eq(c->listen.port, 8080);
    cr_expect(c->admin_enabled);
    cr_expect_str_eq(c->admin_listen.host, "127.0.0.1");
    cr_expect_eq(c->admin_listen.port, 9090);
    cr_expect_eq(c->shutdown_grace_ms, 10000);
    cr_expect_str_eq(c->postgres_url, "postgresql://idemgate@127.0.0.1:5432/idemgate");
    cr_expect_eq(c->pool, 8);
    cr_expect_str_eq(c->redis_url, "redis://127.0.0.1:6379/0");
    cr_expect_eq(c->redis_timeout_ms, 50);

    cr_assert_eq(c->upstreams_n, 1);
    cr_expect_str_eq(c->upstreams[0].name, "api");
    cr_expect_str_eq(c->upstreams[0].url, "http://127.0.0.1:9000");
    cr_expect_str_eq(c->upstreams[0].base_path, "");
    cr_expect_eq(c->upstreams[0].connect_timeout_ms, 2000);
    cr_expect_eq(c->upstreams[0].timeout_ms, 30000);
    cr_expect_eq(c->upstreams[0].max_connections, 1024);
    cr_expect_eq(c->upstreams[0].keepalive_timeout_ms, 60000);

    cr_assert_eq(c->routes_n, 5);
    const struct conf_route *p = &c->routes[0];
    cr_expect_str_eq(p->name, "payments");
    cr_expect_null(p->path);
    cr_expect_str_eq(p->path_prefix, "/v1/payments");
    cr_expect_eq(p->methods, CONF_M_POST | CONF_M_PATCH);
    cr_expect_eq(p->upstream, 0);
    cr_expect_eq(p->idem.key, CONF_KEY_REQUIRED);
    cr_expect_str_eq(p->idem.header, "Idempotency-Key");
    cr_assert_eq(p->idem.scope_n, 1);
    cr_expect_eq(p->idem.scope[0].kind, CONF_PART_HEADER);
    cr_expect_str_eq(p->idem.scope[0].header, "Authorization");
    cr_assert_eq(p->idem.fingerprint_n, 4);
    cr_expect_eq(p->idem.fingerprint[0].kind, CONF_PART_METHOD);
    cr_expect_eq(p->idem.fingerprint[1].kind, CONF_PART_PATH);
    cr_expect_eq(p->idem.fingerprint[2].kind, CONF_PART_QUERY);
    cr_expect_eq(p->idem.fingerprint[3].kind, CONF_PART_BODY);
    cr_expect_eq(p->idem.retention_ms, 24ULL * 3600 * 1000);
    cr_expect_eq(p->idem.lease_ms, 60000);
    cr_expect_eq(p->idem.on_in_flight, CONF_IN_FLIGHT_CONFLICT);
    cr_expect_eq(p->idem.wait_ms, 10000);
    cr_expect_eq(p->idem.on_unknown, CONF_UNKNOWN_REJECT);
    cr_expect_eq(p->idem.release_statuses_n, 0, "the example shows the default, no release status");
    cr_expect_eq(p->idem.max_body, 1024 * 1024);
    cr_expect(p->idem.forward_key);
    cr_expect_eq(p->idem.max_response, 8 * 1024 * 1024);

    const struct conf_route *o = &c->routes[1];
    cr_expect_str_eq(o->name, "orders");
    cr_expect_str_eq(o->path_prefix, "/v1/orders");
    cr_expect_eq(o->methods, CONF_M_POST | CONF_M_PUT | CONF_M_PATCH);
    cr_expect_eq(o->idem.key, CONF_KEY_OPTIONAL);
    cr_expect_eq(o->idem.on_in_flight, CONF_IN_FLIGHT_WAIT);
    cr_expect_eq(o->idem.scope_n, 1, "the example scopes every idempotent route");
    cr_assert_eq(o->idem.scope_n, 1); /* the example scopes every idempotent route */
    cr_expect_eq(o->idem.scope[0].kind, CONF_PART_HEADER);
    cr_expect_str_eq(o->idem.scope[0].header, "Authorization");
    cr_expect_eq(o->idem.mode, CONF_MODE_ENFORCE);
    cr_expect(!o->idem.probe.enabled);
    cr_expect_eq(o->errors.kind, CONF_ERRORS_STRIPE);

    /* the example shows every block: ordering, probe, shadow mode, an errors template */
    const struct conf_route *a = &c->routes[2];
    cr_expect_str_eq(a->name, "addresses");
    cr_expect(a->ordering.enabled);
    cr_expect_str_eq(a->ordering.resource, "/v1/accounts/{id}/address");
    cr_expect_eq(a->ordering.source, CONF_SEQ_HEADER);
    cr_expect_str_eq(a->ordering.seq_name, "X-Sequence");
    const struct conf_route *r = &c->routes[3];
    cr_expect_str_eq(r->name, "refunds");
    cr_expect_eq(r->idem.on_unknown, CONF_UNKNOWN_PROBE);
    cr_expect(r->idem.probe.enabled);
    cr_expect_str_eq(r->idem.probe.path, "/_lookup?idempotency_key={key}");
    const struct conf_route *v = &c->routes[4];
    cr_expect_str_eq(v->name, "invoices");
    cr_expect_eq(v->idem.mode, CONF_MODE_SHADOW);
    cr_expect_eq(v->errors.kind, CONF_ERRORS_TEMPLATE);
    cr_expect_str_eq(v->errors.content_type, "application/json");

    cr_expect(c->has_default_upstream);
    cr_expect_eq(c->default_upstream, 0);
    cr_expect_eq(c->max_header_bytes, 16 * 1024);
    cr_expect_eq(c->max_response_header_bytes, 16 * 1024);
    cr_expect_eq(c->max_body, 1024 * 1024);
    cr_expect_eq(c->max_response, 8 * 1024 * 1024);
    cr_expect_eq(c->replay_cache_max_bytes, 2 * 1024 * 1024);
    cr_expect_eq(c->replay_cache_max_entries, 4096);
    cr_expect_eq(c->max_connections, 4096);
    cr_expect_eq(c->client_timeout_ms, 30000);
    cr_expect_eq(c->threads, 0);
    cr_expect_null(c->admin_token);
    conf_destroy(c);
}

Test(conf, defaults_applied)
{
    struct conf *c = load_ok(BASE "routes:\n"
                                  "  - name: r\n"
                                  "    match: {path: /x}\n"
                                  "    upstream: api\n");
    cr_expect_str_eq(c->listen.host, "127.0.0.1");
    cr_expect_eq(c->listen.port, 8080);
    cr_expect(c->admin_enabled);
    cr_expect_str_eq(c->admin_listen.host, "127.0.0.1");
    cr_expect_eq(c->admin_listen.port, 9090);
    cr_expect_eq(c->shutdown_grace_ms, 10000);
    cr_expect_eq(c->pool, 8);
    cr_expect_null(c->redis_url);
    cr_expect_eq(c->redis_timeout_ms, 50);
    cr_expect_eq(c->upstreams[0].connect_timeout_ms, 2000);
    cr_expect_eq(c->upstreams[0].timeout_ms, 30000);
    cr_expect_eq(c->upstreams[0].max_connections, 1024);
    cr_expect_not(c->has_default_upstream);
    cr_expect_eq(c->max_header_bytes, 16384);
    cr_expect_eq(c->max_body, 1048576);
    cr_expect_eq(c->max_response, 8388608);
    cr_expect_eq(c->max_connections, 4096);
    cr_expect_eq(c->client_timeout_ms, 30000);
    cr_expect_eq(c->threads, 0);

    cr_assert_eq(c->routes_n, 1);
    const struct conf_route *r = &c->routes[0];
    cr_expect_str_eq(r->path, "/x");
    cr_expect_null(r->path_prefix);
    cr_expect_eq(r->methods, CONF_M_POST | CONF_M_PATCH);
    cr_expect_eq(r->idem.key, CONF_KEY_OPTIONAL);
    cr_expect_str_eq(r->idem.header, "Idempotency-Key");
    cr_expect_eq(r->idem.scope_n, 0);
    cr_assert_eq(r->idem.fingerprint_n, 4);
    cr_expect_eq(r->idem.fingerprint[3].kind, CONF_PART_BODY);
    cr_expect_eq(r->idem.retention_ms, 86400000);
    cr_expect_eq(r->idem.lease_ms, 60000);
    cr_expect_eq(r->idem.wait_ms, 10000);
    cr_expect_eq(r->idem.on_in_flight, CONF_IN_FLIGHT_CONFLICT);
    cr_expect_eq(r->idem.on_unknown, CONF_UNKNOWN_REJECT);
    cr_expect_eq(r->idem.release_statuses_n, 0);
    cr_expect_eq(r->idem.max_body, 1048576);
    cr_expect(r->idem.forward_key);
    cr_expect_eq(r->idem.max_response, 8388608);
    conf_destroy(c);
}

Test(conf, every_key_set)
{
    struct conf *c = load_ok("listen: '[::1]:0'\n"
                             "admin:\n"
                             "  listen: 'off'\n"
                             "shutdown_grace: 0s\n"
                             "store:\n"
                             "  postgres: host=/tmp dbname=x\n"
                             "  pool: 256\n"
                             "  redis: /run/redis.sock\n"
                             "  redis_timeout: 5ms\n"
                             "upstreams:\n"
                             "  - name: a.b-c_1\n"
                             "    url: https://Example.com:8443/base/path///\n"
                             "    connect_timeout: 1500ms\n"
                             "    timeout: 2m\n"
                             "    max_connections: 7\n"
                             "    keepalive_timeout: 4s\n"
                             "  - name: b\n"
                             "    url: http://[::1]:9000/\n"
                             "routes:\n"
                             "  - name: r1\n"
                             "    match:\n"
                             "      path_prefix: /v1/things/\n"
                             "      methods: [GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS, TRACE, CONNECT]\n"
                             "  - name: r2\n"
                             "    match: {path_prefix: /}\n"
                             "    upstream: a.b-c_1\n"
                             "    idempotency:\n"
                             "      key: 'off'\n"
                             "      header: X-Request-Id\n"
                             "      scope: [header:X-Tenant, query]\n"
                             "      fingerprint: [body, 'header:Content-Type']\n"
                             "      retention: 7d\n"
                             "      lease: 5m\n"
                             "      on_in_flight: wait\n"
                             "      wait: 3s\n"
                             "      on_unknown: retry\n"
                             "      release_statuses: [429, 500, 502]\n"
                             "      max_body: 512KiB\n"
                             "      forward_key: false\n"
                             "      max_response: 1GiB\n"
                             "default_upstream: b\n"
                             "max_header_bytes: 8192\n"
                             "max_body: 2MiB\n"
                             "max_response: 100B\n"
                             "max_connections: 100000\n"
                             "client_timeout: 1h\n"
                             "limits:\n"
                             "  buffers: 2GiB\n"
                             "threads: 64\n");
    cr_expect_eq(c->limits_buffers, 2ULL << 30);
    cr_expect_str_eq(c->listen.host, "::1");
    cr_expect_eq(c->listen.port, 0);
    cr_expect_not(c->admin_enabled);
    cr_expect_eq(c->shutdown_grace_ms, 0);
    cr_expect_str_eq(c->postgres_url, "host=/tmp dbname=x");
    cr_expect_eq(c->pool, 256);
    cr_expect_str_eq(c->redis_url, "/run/redis.sock");
    cr_expect_str_eq(c->redis.unix_path, "/run/redis.sock");
    cr_expect_null(c->redis.host);
    cr_expect_eq(c->redis_timeout_ms, 5);
    cr_assert_eq(c->upstreams_n, 2);
    cr_expect_str_eq(c->upstreams[0].name, "a.b-c_1");
    cr_expect_str_eq(c->upstreams[0].url, "https://Example.com:8443/base/path");
    cr_expect_str_eq(c->upstreams[0].base_path, "/base/path");
    cr_expect(c->upstreams[0].https);
    cr_expect_str_eq(c->upstreams[0].host, "Example.com");
    cr_expect_eq(c->upstreams[0].port, 8443);
    cr_expect_not(c->upstreams[0].host_is_ip);
    cr_expect_eq(c->upstreams[0].connect_timeout_ms, 1500);
    cr_expect_eq(c->upstreams[0].keepalive_timeout_ms, 4000);
    cr_expect_eq(c->upstreams[1].keepalive_timeout_ms, 60000);
    cr_expect_eq(c->upstreams[0].timeout_ms, 120000);
    cr_expect_eq(c->upstreams[0].max_connections, 7);
    cr_expect_str_eq(c->upstreams[1].url, "http://[::1]:9000");
    cr_expect_str_eq(c->upstreams[1].base_path, "");
    cr_expect_not(c->upstreams[1].https);
    cr_expect_str_eq(c->upstreams[1].host, "::1");
    cr_expect_eq(c->upstreams[1].port, 9000);
    cr_expect(c->upstreams[1].host_is_ip);
    cr_assert_eq(c->routes_n, 2);
    cr_expect_str_eq(c->routes[0].path_prefix, "/v1/things");
    cr_expect_eq(c->routes[0].methods, 0x1ff);
    cr_expect_eq(c->routes[0].upstream, 1, "a route without upstream takes default_upstream");
    const struct conf_route *r = &c->routes[1];
    cr_expect_str_eq(r->path_prefix, "/");
    cr_expect_eq(r->upstream, 0);
    cr_expect_eq(r->idem.key, CONF_KEY_OFF);
    cr_expect_str_eq(r->idem.header, "X-Request-Id");
    cr_assert_eq(r->idem.scope_n, 2);
    cr_expect_eq(r->idem.scope[0].kind, CONF_PART_HEADER);
    cr_expect_str_eq(r->idem.scope[0].header, "X-Tenant");
    cr_expect_eq(r->idem.scope[1].kind, CONF_PART_QUERY);
    cr_expect_null(r->idem.scope[1].header);
    cr_assert_eq(r->idem.fingerprint_n, 2);
    cr_expect_eq(r->idem.fingerprint[0].kind, CONF_PART_BODY);
    cr_expect_str_eq(r->idem.fingerprint[1].header, "Content-Type");
    cr_expect_eq(r->idem.retention_ms, 7ULL * 86400000);
    cr_expect_eq(r->idem.lease_ms, 300000);
    cr_expect_eq(r->idem.on_in_flight, CONF_IN_FLIGHT_WAIT);
    cr_expect_eq(r->idem.wait_ms, 3000);
    cr_expect_eq(r->idem.on_unknown, CONF_UNKNOWN_RETRY);
    cr_assert_eq(r->idem.release_statuses_n, 3);
    cr_expect_eq(r->idem.release_statuses[2], 502);
    cr_expect_eq(r->idem.max_body, 512 * 1024);
    cr_expect_not(r->idem.forward_key);
    cr_expect_eq(r->idem.max_response, 1ULL << 30);
    cr_expect(c->has_default_upstream);
    cr_expect_eq(c->default_upstream, 1);
    cr_expect_eq(c->max_header_bytes, 8192);
    cr_expect_eq(c->max_body, 2 * 1048576);
    cr_expect_eq(c->max_response, 100);
    cr_expect_eq(c->max_connections, 100000);
    cr_expect_eq(c->client_timeout_ms, 3600000);
    cr_expect_eq(c->threads, 64);
    conf_destroy(c);
}

Test(conf, admin_and_listen_forms)
{
    struct conf *c = load_ok(BASE "listen: 0.0.0.0:0\nadmin:\n  listen: localhost:0\n");
    cr_expect_str_eq(c->listen.host, "0.0.0.0");
    cr_expect_eq(c->listen.port, 0);
    cr_expect(c->admin_enabled);
    cr_expect_str_eq(c->admin_listen.host, "localhost");
    cr_expect_eq(c->admin_listen.port, 0);
    conf_destroy(c);

    c = load_ok(BASE "admin:\n  listen: off\n");
    cr_expect_not(c->admin_enabled, "a plain off disables admin");
    conf_destroy(c);

    c = load_ok(BASE "admin: {}\nlisten: '[2001:db8::1]:65535'\n");
    cr_expect(c->admin_enabled);
    cr_expect_str_eq(c->admin_listen.host, "127.0.0.1");
    cr_expect_eq(c->admin_listen.port, 9090);
    cr_expect_str_eq(c->listen.host, "2001:db8::1");
    cr_expect_eq(c->listen.port, 65535);
    conf_destroy(c);
}

struct dur_case {
    const char *in;
    bool ok;
    uint64_t ms;
};

Test(conf, durations)
{
    static const struct dur_case cases[] = {
        {"500ms", true, 500},
        {"0ms", true, 0},
        {"1s", true, 1000},
        {"30s", true, 30000},
        {"5m", true, 300000},
        {"24h", true, 86400000},
        {"7d", true, 604800000},
        {"36500d", true, 36500ULL * 86400000},
        {"36501d", false, 0},
        {"99999999999999999999s", false, 0},
        {"18446744073709551615ms", false, 0},
        {"30", false, 0},
        {"0", false, 0},
        {"", false, 0},
        {"abc", false, 0},
        {"s", false, 0},
        {"-5s", false, 0},
        {"+5s", false, 0},
        {"1.5s", false, 0},
        {"1,5s", false, 0},
        {"5 s", false, 0},
        {" 5s", false, 0},
        {"5sec", false, 0},
        {"5S", false, 0},
        {"5us", false, 0},
        {"1h30m", false, 0},
        {"5w", false, 0},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        uint64_t v = 12345;
        bool ok = conf_parse_duration(cases[i].in, &v);
        cr_expect_eq(ok, cases[i].ok, "duration '%s': got ok=%d", cases[i].in, ok);
        if (cases[i].ok)
            cr_expect_eq(v, cases[i].ms, "duration '%s': got %llu", cases[i].in, (unsigned long long)v);
        else
            cr_expect_eq(v, 12345, "duration '%s': output written on failure", cases[i].in);
    }
    uint64_t v;
    cr_expect_not(conf_parse_duration(NULL, &v));
}

Test(conf, listen_addresses_are_shown_with_ipv6_in_brackets)
{
    char b[64];
    cr_expect_str_eq(conf_addr_fmt(b, sizeof b, "127.0.0.1", 8080), "127.0.0.1:8080");
    cr_expect_str_eq(conf_addr_fmt(b, sizeof b, "localhost", 0), "localhost:0");
    cr_expect_str_eq(conf_addr_fmt(b, sizeof b, "::1", 8080), "[::1]:8080");
    cr_expect_str_eq(conf_addr_fmt(b, sizeof b, "::", 65535), "[::]:65535");
    char small[8];
    cr_expect_str_eq(conf_addr_fmt(small, sizeof small, "::1", 8080), "[::1]:8", "truncated to the buffer");
}

struct size_case {
    const char *in;
    bool ok;
    uint64_t bytes;
};

Test(conf, sizes)
{
    static const struct size_case cases[] = {
        {"0", true, 0},
        {"512", true, 512},
        {"512B", true, 512},
        {"64KiB", true, 65536},
        {"1MiB", true, 1048576},
        {"8MiB", true, 8388608},
        {"1GiB", true, 1073741824},
        {"16GiB", true, 16ULL << 30},
        {"18446744073709551615", true, UINT64_MAX},
        {"18446744073709551616", false, 0},
        {"17179869184GiB", false, 0},
        {"1KB", false, 0},
        {"1MB", false, 0},
        {"1GB", false, 0},
        {"1kb", false, 0},
        {"1K", false, 0},
        {"1TiB", false, 0},
        {"1.5MiB", false, 0},
        {"-1", false, 0},
        {"", false, 0},
        {"MiB", false, 0},
        {"1 MiB", false, 0},
        {"1mib", false, 0},
        {"0x10", false, 0},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        uint64_t v = 777;
        bool ok = conf_parse_size(cases[i].in, &v);
        cr_expect_eq(ok, cases[i].ok, "size '%s': got ok=%d", cases[i].in, ok);
        if (cases[i].ok)
            cr_expect_eq(v, cases[i].bytes, "size '%s': got %llu", cases[i].in, (unsigned long long)v);
        else
            cr_expect_eq(v, 777, "size '%s': output written on failure", cases[i].in);
    }
}

Test(conf, method_bits)
{
    cr_expect_eq(conf_method_bit("GET"), CONF_M_GET);
    cr_expect_eq(conf_method_bit("HEAD"), CONF_M_HEAD);
    cr_expect_eq(conf_method_bit("POST"), CONF_M_POST);
    cr_expect_eq(conf_method_bit("PUT"), CONF_M_PUT);
    cr_expect_eq(conf_method_bit("PATCH"), CONF_M_PATCH);
    cr_expect_eq(conf_method_bit("DELETE"), CONF_M_DELETE);
    cr_expect_eq(conf_method_bit("OPTIONS"), CONF_M_OPTIONS);
    cr_expect_eq(conf_method_bit("TRACE"), CONF_M_TRACE);
    cr_expect_eq(conf_method_bit("CONNECT"), CONF_M_CONNECT);
    cr_expect_eq(conf_method_bit("post"), 0);
    cr_expect_eq(conf_method_bit("POSTX"), 0);
    cr_expect_eq(conf_method_bit(""), 0);
    cr_expect_eq(conf_method_bit(NULL), 0);
}

struct match_case {
    const char *path;
    const char *route; /* NULL: no match */
};

Test(conf, route_matching)
{
    struct conf *c = load_ok(BASE "routes:\n"
                                  "  - name: exact\n"
                                  "    match: {path: /v1/payments/special}\n"
                                  "    upstream: api\n"
                                  "  - name: payments\n"
                                  "    match: {path_prefix: /v1/payments/}\n"
                                  "    upstream: api\n"
                                  "  - name: shadowed\n"
                                  "    match: {path_prefix: /v1/payments/42}\n"
                                  "    upstream: api\n"
                                  "  - name: orders\n"
                                  "    match: {path: /v1/orders}\n"
                                  "    upstream: api\n");
    static const struct match_case cases[] = {
        {"/v1/payments", "payments"},
        {"/v1/payments/", "payments"},
        {"/v1/payments/42", "payments"}, /* first match wins over "shadowed" */
        {"/v1/payments/42/refunds", "payments"},
        {"/v1/payments/special", "exact"},
        {"/v1/payments/special/x", "payments"},
        {"/v1/paymentsx", NULL},
        {"/v1/payment", NULL},
        {"/v1", NULL},
        {"/", NULL},
        {"", NULL},
        {"/v1/orders", "orders"},
        {"/v1/orders/1", NULL},       /* path is exact */
        {"/v1/orders/", "orders"},    /* a trailing '/' is ignored */
        {"/v1/orders%3Bx", "orders"}, /* an encoded ';' starts segment parameters too */
        {"/v1/orders%3bx/", "orders"},
        {"/v1/payments/special/", "exact"},
        {"/v1/orders/x/", NULL},
        /* SPEC 7: case, segment parameters and a format suffix on the last segment do not matter */
        {"/V1/orders", "orders"},
        {"/v1/orders;jsessionid=x", "orders"},
        {"/v1/orders;", "orders"},
        {"/v1/orders.json", "orders"},
        {"/V1/ORDERS.Json", "orders"},
        {"/v1/orders.json/x", NULL},
        {"/v1/orders.json;x", "orders"},
        {"/v1;a=b/orders", "orders"},
        {"/V1/Payments;a/42", "payments"},
        {"/v1/payments.json", "payments"},
        {"/v1/payments.json/1", NULL},
        {"/v1/Payments/Special.xml", "exact"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const struct conf_route *r = conf_match_route(c, cases[i].path);
        if (cases[i].route == NULL)
            cr_expect_null(r, "'%s' matched %s", cases[i].path, r ? r->name : "");
        else {
            cr_expect_not_null(r, "'%s' matched nothing", cases[i].path);
            if (r != NULL)
                cr_expect_str_eq(r->name, cases[i].route, "'%s'", cases[i].path);
        }
    }
    cr_expect_null(conf_match_route(c, NULL));
    cr_expect_null(conf_match_route(NULL, "/v1/payments"));
    conf_destroy(c);

    c = load_ok(BASE "routes:\n"
                     "  - name: a\n"
                     "    match: {path: /a}\n"
                     "    upstream: api\n"
                     "  - name: all\n"
                     "    match: {path_prefix: /}\n"
                     "    upstream: api\n"
                     "  - name: never\n"
                     "    match: {path: /b}\n"
                     "    upstream: api\n");
    cr_expect_str_eq(conf_match_route(c, "/a")->name, "a");
    cr_expect_str_eq(conf_match_route(c, "/a/b")->name, "all");
    cr_expect_str_eq(conf_match_route(c, "/b")->name, "all");
    cr_expect_str_eq(conf_match_route(c, "/")->name, "all");
    conf_destroy(c);

    c = load_ok(BASE "routes: []\n");
    cr_expect_eq(c->routes_n, 0);
    cr_expect_null(conf_match_route(c, "/x"));
    conf_destroy(c);
}

/* Routes that meet only under SPEC 7's spelling rule load when their policies are the same; routes nested as
 * written (most specific first) load whatever their policies. */
Test(conf, routes_meeting_by_spelling_with_one_policy_load)
{
    struct conf *c = load_ok(BASE "routes:\n"
                                  "  - name: a\n"
                                  "    match: {path: /v1/jwt}\n"
                                  "    upstream: api\n"
                                  "  - name: b\n"
                                  "    match: {path: /v1/JWT.json}\n"
                                  "    upstream: api\n"
                                  "  - name: pay\n"
                                  "    match: {path_prefix: /v1/payments}\n"
                                  "    upstream: api\n"
                                  "    idempotency: {key: required}\n"
                                  "  - name: rest\n"
                                  "    match: {path_prefix: /v1}\n"
                                  "    upstream: api\n"
                                  "    idempotency: {key: 'off'}\n");
    cr_expect_eq(c->routes_n, 4);
    conf_destroy(c);
}

Test(conf, env_postgres_overrides_file)
{
    setenv("IDEMGATE_POSTGRES_URL", "postgres://env@127.0.0.1:5433/e", 1);
    struct conf *c = load_ok(BASE);
    cr_expect_str_eq(c->postgres_url, "postgres://env@127.0.0.1:5433/e");
    conf_destroy(c);

    /* with the env set, store.postgres may be absent */
    c = load_ok("upstreams:\n  - name: api\n    url: http://127.0.0.1:9000\n");
    cr_expect_str_eq(c->postgres_url, "postgres://env@127.0.0.1:5433/e");
    conf_destroy(c);

    setenv("IDEMGATE_POSTGRES_URL", "mysql://nope", 1);
    char *err = NULL;
    c = load(BASE, &err);
    cr_expect_null(c);
    cr_assert_not_null(err);
    cr_expect(strstr(err, "t.yaml: IDEMGATE_POSTGRES_URL (environment): must start with postgres://") != NULL, "%s",
              err);
    free(err);
}

Test(conf, env_redis)
{
    const char *yaml = BASE "  # comment\n";
    const char *with_redis = "store:\n"
                             "  postgres: postgres://u@127.0.0.1/db\n"
                             "  redis: redis://:secret@127.0.0.1:6379/2\n"
                             "upstreams:\n"
                             "  - name: api\n"
                             "    url: http://127.0.0.1:9000\n";
    struct conf *c = load_ok(with_redis);
    cr_expect_str_eq(c->redis_url, "redis://:secret@127.0.0.1:6379/2");
    conf_destroy(c);

    setenv("IDEMGATE_REDIS_URL", "", 1);
    c = load_ok(with_redis);
    cr_expect_null(c->redis_url, "an empty IDEMGATE_REDIS_URL disables Redis");
    conf_destroy(c);

    setenv("IDEMGATE_REDIS_URL", "redis://127.0.0.1:6380", 1);
    c = load_ok(yaml);
    cr_expect_str_eq(c->redis_url, "redis://127.0.0.1:6380");
    conf_destroy(c);

    setenv("IDEMGATE_REDIS_URL", "http://127.0.0.1:6380", 1);
    char *err = NULL;
    c = load(yaml, &err);
    cr_expect_null(c);
    cr_assert_not_null(err);
    cr_expect(strstr(err, "t.yaml: IDEMGATE_REDIS_URL (environment): must be redis://") != NULL, "%s", err);
    free(err);
}

Test(conf, env_admin_token)
{
    struct conf *c = load_ok(BASE);
    cr_expect_null(c->admin_token);
    conf_destroy(c);

    setenv("IDEMGATE_ADMIN_TOKEN", "", 1);
    c = load_ok(BASE);
    cr_expect_null(c->admin_token);
    conf_destroy(c);

    setenv("IDEMGATE_ADMIN_TOKEN", "s3cret", 1);
    c = load_ok(BASE);
    cr_expect_str_eq(c->admin_token, "s3cret");
    conf_destroy(c);
}

Test(conf, missing_file)
{
    char *err = NULL;
    struct conf *c = conf_load("/nonexistent/idemgate.yaml", &err);
    cr_expect_null(c);
    cr_assert_not_null(err);
    cr_expect_str_eq(err, "/nonexistent/idemgate.yaml: cannot open: No such file or directory");
    free(err);
}

Test(conf, file_error_names_the_file)
{
    char path[] = "/tmp/conf_test_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    const char *text = BASE "routes:\n  - name: r\n    match: {path: /a}\n    upstream: ghost\n";
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    char *err = NULL;
    struct conf *c = conf_load(path, &err);
    unlink(path);
    cr_expect_null(c);
    cr_assert_not_null(err);
    char want[128];
    snprintf(want, sizeof(want), "%s:9: routes[0].upstream: unknown upstream 'ghost' (defined: api)", path);
    cr_expect_str_eq(err, want);
    free(err);
}

struct bad_case {
    const char *what;
    const char *yaml;
    const char *want; /* substring of the message, file:line: key.path: ... */
};

#define UPS          "upstreams:\n  - name: api\n    url: http://127.0.0.1:9000\n"
#define PG           "store:\n  postgres: postgres://u@127.0.0.1/db\n"
#define ROUTE(extra) "routes:\n  - name: p\n    match: {path: /a}\n    upstream: api\n" extra

static const struct bad_case bad_cases[] = {
    /* SPEC 11 trusted_proxies: each entry a CIDR block or an address, named by its index */
    {"trusted proxy prefix too long", BASE "trusted_proxies: [10.0.0.0/8, 10.0.0.0/33]\n",
     "t.yaml:6: trusted_proxies[1]: '10.0.0.0/33': the prefix length of an IPv4 block is at most 32"},
    {"trusted proxy with host bits", BASE "trusted_proxies:\n  - fd00::/8\n  - 10.0.0.1/8\n",
     "t.yaml:8: trusted_proxies[1]: '10.0.0.1/8': the address has bits set beyond the prefix length"},
    {"trusted proxy IPv6 prefix too long", BASE "trusted_proxies: ['fd00::/129']\n",
     "t.yaml:6: trusted_proxies[0]: 'fd00::/129': the prefix length of an IPv6 block is at most 128"},
    {"trusted proxy by name", BASE "trusted_proxies: [lb.internal]\n",
     "t.yaml:6: trusted_proxies[0]: 'lb.internal': not an IPv4 or IPv6 address"},
    {"trusted proxies not a list", BASE "trusted_proxies: 10.0.0.0/8\n",
     "t.yaml:6: trusted_proxies: expected a list ([a, b] or '- ' items), got the scalar '10.0.0.0/8'"},
    {"unknown top-level key", BASE "listn: 1.2.3.4:80\n", "t.yaml:6: listn: unknown key (expected one of: listen,"},
    {"unknown nested key", PG "  poool: 3\n" UPS,
     "t.yaml:3: store.poool: unknown key (expected one of: postgres, pool"},
    {"unknown idempotency key", BASE ROUTE("    idempotency:\n      lease: 1s\n      leese: 2s\n"),
     "t.yaml:12: routes[0].idempotency.leese: unknown key"},
    {"bad duration", BASE ROUTE("    idempotency:\n      lease: abc\n"),
     "t.yaml:11: routes[0].idempotency.lease: invalid duration 'abc' (use ms, s, m, h, d)"},
    {"duration without unit", BASE "shutdown_grace: 30\n",
     "t.yaml:6: shutdown_grace: invalid duration '30' (a unit is required: ms, s, m, h, d)"},
    {"fractional duration", BASE "client_timeout: 1.5s\n",
     "t.yaml:6: client_timeout: invalid duration '1.5s' (use ms, s, m, h, d)"},
    {"negative duration", PG "  redis_timeout: -50ms\n" UPS,
     "t.yaml:3: store.redis_timeout: invalid duration '-50ms' (use ms, s, m, h, d)"},
    {"zero lease", BASE ROUTE("    idempotency: {lease: 0s}\n"),
     "t.yaml:10: routes[0].idempotency.lease: must be greater than 0"},
    {"duration overflow", BASE ROUTE("    idempotency: {retention: 99999999999d}\n"),
     "t.yaml:10: routes[0].idempotency.retention: invalid duration '99999999999d' (too large, at most 36500d)"},
    {"decimal size unit", BASE "max_body: 1MB\n",
     "t.yaml:6: max_body: invalid size '1MB' (sizes are 1024-based: use B, KiB, MiB, GiB)"},
    {"bad size", BASE ROUTE("    idempotency:\n      max_body: lots\n"),
     "t.yaml:11: routes[0].idempotency.max_body: invalid size 'lots' (use B, KiB, MiB, GiB)"},
    {"zero size", BASE "max_header_bytes: 0\n", "t.yaml:6: max_header_bytes: must be greater than 0"},
    {"replay_cache too large", BASE "replay_cache: {max_bytes: 2GiB}\n",
     "t.yaml:6: replay_cache.max_bytes: must be at most 1GiB (got 2GiB)"},
    {"replay_cache unknown key", BASE "replay_cache: {size: 1MiB}\n", "t.yaml:6: replay_cache.size: unknown key"},
    {"replay_cache not a mapping", BASE "replay_cache: big\n",
     "t.yaml:6: replay_cache: must be a mapping {max_bytes: SIZE, max_entries: N} or off"},
    {"size too large", BASE "max_header_bytes: 2MiB\n", "t.yaml:6: max_header_bytes: must be at most 1MiB (got 2MiB)"},
    {"unknown upstream reference", BASE ROUTE("") "  - name: q\n    match: {path: /b}\n    upstream: nope\n",
     "t.yaml:12: routes[1].upstream: unknown upstream 'nope' (defined: api)"},
    {"route without upstream nor default", BASE "routes:\n  - name: p\n    match: {path: /a}\n",
     "t.yaml:7: routes[0].upstream: missing required key (or set default_upstream)"},
    {"duplicate route name", BASE ROUTE("") "  - name: p\n    match: {path: /b}\n    upstream: api\n",
     "t.yaml:10: routes[1].name: duplicate route name 'p'"},
    {"duplicate upstream name", BASE "  - name: api\n    url: http://127.0.0.1:9001\n",
     "t.yaml:6: upstreams[1].name: duplicate upstream name 'api'"},
    {"both path and path_prefix",
     BASE "routes:\n  - name: p\n    match:\n      path: /a\n      path_prefix: /b\n    upstream: api\n",
     "t.yaml:8: routes[0].match: path and path_prefix are mutually exclusive"},
    {"neither path nor path_prefix",
     BASE "routes:\n  - name: p\n    match:\n      methods: [POST]\n    upstream: api\n",
     "t.yaml:8: routes[0].match: needs exactly one of path or path_prefix"},
    {"path without slash", BASE "routes:\n  - name: p\n    match: {path_prefix: v1}\n    upstream: api\n",
     "t.yaml:8: routes[0].match.path_prefix: must start with '/'"},
    {"lower-case method",
     BASE "routes:\n  - name: p\n    match: {path: /a, methods: [POST, post]}\n    upstream: api\n",
     "t.yaml:8: routes[0].match.methods[1]: invalid method 'post' (methods are case-sensitive: use POST)"},
    {"unknown method",
     BASE "routes:\n  - name: p\n    match:\n      path: /a\n      methods:\n        - FETCH\n    upstream: api\n",
     "t.yaml:11: routes[0].match.methods[0]: unknown method 'FETCH' (use GET, HEAD,"},
    {"methods not a list", BASE "routes:\n  - name: p\n    match: {path: /a, methods: POST}\n    upstream: api\n",
     "t.yaml:8: routes[0].match.methods: expected a list ([a, b] or '- ' items), got the scalar 'POST'"},
    {"bad key mode", BASE ROUTE("    idempotency: {key: always}\n"),
     "t.yaml:10: routes[0].idempotency.key: invalid value 'always' (use optional, required, off)"},
    {"bad on_in_flight", BASE ROUTE("    idempotency:\n      on_in_flight: queue\n"),
     "t.yaml:11: routes[0].idempotency.on_in_flight: invalid value 'queue' (use conflict, wait)"},
    {"bad on_unknown", BASE ROUTE("    idempotency:\n      on_unknown: ignore\n"),
     "t.yaml:11: routes[0].idempotency.on_unknown: invalid value 'ignore' (use reject, retry, probe)"},
    {"bad boolean", BASE ROUTE("    idempotency:\n      forward_key: yes\n"),
     "t.yaml:11: routes[0].idempotency.forward_key: invalid boolean 'yes' (use true or false)"},
    {"bad key header", BASE ROUTE("    idempotency:\n      header: Idempotency Key\n"),
     "t.yaml:11: routes[0].idempotency.header: invalid header name 'Idempotency Key'"},
    {"forward_token is the key header", BASE ROUTE("    idempotency:\n      forward_token: idempotency-key\n"),
     "t.yaml:10: routes[0].idempotency.forward_token: forward_token cannot be the key header"},
    {"forward_token hop-by-hop", BASE ROUTE("    idempotency:\n      forward_token: Connection\n"),
     "t.yaml:10: routes[0].idempotency.forward_token: forward_token cannot be"},
    {"forward_token not a token", BASE ROUTE("    idempotency:\n      forward_token: a b\n"),
     "t.yaml:11: routes[0].idempotency.forward_token: invalid header name 'a b'"},
    {"listen without port", BASE "listen: localhost\n",
     "t.yaml:6: listen: invalid address 'localhost': missing port (use host:port or [v6]:port)"},
    {"listen port out of range", BASE "listen: 127.0.0.1:70000\n",
     "t.yaml:6: listen: invalid address '127.0.0.1:70000': port must be between 0 and 65535"},
    {"listen bare IPv6", BASE "listen: ::1:8080\n",
     "t.yaml:6: listen: invalid address '::1:8080': an IPv6 address must be written in brackets"},
    {"listen IPv4 with five parts", BASE "listen: 127.0.0.1.5:8080\n",
     "t.yaml:6: listen: invalid address '127.0.0.1.5:8080': '127.0.0.1.5' is not an IPv4 address"},
    {"listen IPv4 out of range", BASE "listen: 999.1.1.1:8080\n",
     "t.yaml:6: listen: invalid address '999.1.1.1:8080': '999.1.1.1' is not an IPv4 address"},
    {"listen IPv6 that does not parse", BASE "listen: '[1::2::3]:8080'\n",
     "t.yaml:6: listen: invalid address '[1::2::3]:8080': '1::2::3' is not an IPv6 address"},
    {"listen host that does not resolve", BASE "listen: nosuchhost.invalid:8080\n",
     "t.yaml:6: listen: invalid address 'nosuchhost.invalid:8080': cannot resolve 'nosuchhost.invalid'"},
    {"admin listen IPv4 out of range", BASE "admin:\n  listen: 999.1.1.1:9090\n",
     "t.yaml:7: admin.listen: invalid address '999.1.1.1:9090': '999.1.1.1' is not an IPv4 address"},
    {"admin listen host that does not resolve", BASE "admin: {listen: 'nosuchhost.invalid:9090'}\n",
     "t.yaml:6: admin.listen: invalid address 'nosuchhost.invalid:9090': cannot resolve 'nosuchhost.invalid'"},
    {"admin port out of range", BASE "admin:\n  listen: 127.0.0.1:99999\n",
     "t.yaml:7: admin.listen: invalid address '127.0.0.1:99999': port must be between 0 and 65535"},
    {"admin on the listen address", BASE "listen: 127.0.0.1:8000\nadmin:\n  listen: 127.0.0.1:8000\n",
     "t.yaml:8: admin.listen: same address as listen (127.0.0.1:8000)"},
    {"missing postgres, no store", UPS,
     "t.yaml:1: store.postgres: missing required key (set it here or in IDEMGATE_POSTGRES_URL)"},
    {"missing postgres, store present", "listen: 127.0.0.1:1\nstore:\n  pool: 4\n" UPS,
     "t.yaml:2: store.postgres: missing required key"},
    {"bad postgres scheme", "store:\n  postgres: mysql://u@127.0.0.1/db\n" UPS,
     "t.yaml:2: store.postgres: must start with postgres:// or postgresql://"},
    {"bad redis url", PG "  redis: http://127.0.0.1:6379\n" UPS,
     "t.yaml:3: store.redis: must be redis://[:password@]host:port[/db] or an absolute unix socket path"},
    {"redis without port", PG "  redis: redis://127.0.0.1\n" UPS, "t.yaml:3: store.redis: missing port"},
    {"pool 0", PG "  pool: 0\n" UPS, "t.yaml:3: store.pool: must be between 1 and 256 (got 0)"},
    {"pool not a number", PG "  pool: eight\n" UPS, "t.yaml:3: store.pool: invalid integer 'eight'"},
    {"threads out of range", BASE "threads: 65\n", "t.yaml:6: threads: must be between 0 and 64 (got 65)"},
    {"max_connections 0", BASE "max_connections: 0\n", "t.yaml:6: max_connections: must be between 1 and 100000"},
    {"release status out of range", BASE ROUTE("    idempotency:\n      release_statuses: [503, 600]\n"),
     "t.yaml:11: routes[0].idempotency.release_statuses[1]: must be between 100 and 599 (got 600)"},
    {"release status duplicate", BASE ROUTE("    idempotency:\n      release_statuses: [503, 503]\n"),
     "t.yaml:11: routes[0].idempotency.release_statuses[1]: duplicate status 503"},
    {"header: with empty name", BASE ROUTE("    idempotency:\n      scope: [\"header:\"]\n"),
     "t.yaml:11: routes[0].idempotency.scope[0]: 'header:' needs a header name"},
    {"header: with a bad name", BASE ROUTE("    idempotency:\n      fingerprint: [method, 'header:X Y']\n"),
     "t.yaml:11: routes[0].idempotency.fingerprint[1]: invalid header name 'X Y'"},
    {"unknown fingerprint part",
     BASE ROUTE("    idempotency:\n      fingerprint:\n        - method\n        - bodyy\n"),
     "t.yaml:13: routes[0].idempotency.fingerprint[1]: invalid part 'bodyy' (use method, path, query, body, "
     "json:/POINTER, form:NAME, query:NAME or header:NAME)"},
    /* SPEC 12: key_from and the json:/form:/query: parts */
    {"key_from pointer without '/'", BASE ROUTE("    idempotency:\n      key_from: json:order_no\n"),
     "t.yaml:11: routes[0].idempotency.key_from: invalid JSON Pointer 'order_no' in 'json:order_no': it is empty (the "
     "whole body) or starts with '/'"},
    {"key_from bad ~ escape", BASE ROUTE("    idempotency:\n      key_from: json:/a~2b\n"),
     "t.yaml:11: routes[0].idempotency.key_from: invalid JSON Pointer '/a~2b'"},
    {"key_from trailing ~", BASE ROUTE("    idempotency:\n      key_from: json:/a~\n"),
     "t.yaml:11: routes[0].idempotency.key_from: invalid JSON Pointer '/a~'"},
    {"key_from a whole part", BASE ROUTE("    idempotency:\n      key_from: body\n"),
     "t.yaml:11: routes[0].idempotency.key_from: invalid part 'body' (use json:/POINTER, form:NAME, query:NAME or "
     "header:NAME)"},
    {"key_from jwt", BASE ROUTE("    idempotency:\n      key_from: jwt:sub\n"),
     "t.yaml:11: routes[0].idempotency.key_from: invalid part 'jwt:sub'"},
    {"form: without a name", BASE ROUTE("    idempotency:\n      scope: [\"form:\"]\n"),
     "t.yaml:11: routes[0].idempotency.scope[0]: 'form:' needs a field name"},
    {"fingerprint pointer", BASE ROUTE("    idempotency:\n      fingerprint: [json:data]\n"),
     "t.yaml:11: routes[0].idempotency.fingerprint[0]: invalid JSON Pointer 'data'"},
    {"duplicate json part", BASE ROUTE("    idempotency:\n      fingerprint: [json:/a, json:/a]\n"),
     "t.yaml:11: routes[0].idempotency.fingerprint[1]: duplicate part 'json:/a'"},
    {"ordering resource pointer", BASE ROUTE("    ordering:\n      resource: json:id\n      sequence: json:/v\n"),
     "t.yaml:11: routes[0].ordering.resource: invalid JSON Pointer 'id' in 'json:id'"},
    {"YAML syntax error", BASE "routes:\n  - name: p\n    match: {path: /a\n    upstream: api\n",
     "t.yaml:9: YAML syntax error: "},
    {"YAML tab indentation", BASE "listen:\n\t127.0.0.1:1\n", "t.yaml:7: YAML syntax error: "},
    {"empty upstreams", PG "upstreams: []\n", "t.yaml:3: upstreams: must list at least one upstream"},
    {"missing upstreams", PG, "t.yaml:1: upstreams: missing required key"},
    {"missing upstream url", PG "upstreams:\n  - name: api\n", "t.yaml:4: upstreams[0].url: missing required key"},
    {"bad upstream url scheme", PG "upstreams:\n  - name: api\n    url: ftp://127.0.0.1\n",
     "t.yaml:5: upstreams[0].url: must start with http:// or https://"},
    {"upstream url with query", PG "upstreams:\n  - name: api\n    url: http://127.0.0.1/x?y=1\n",
     "t.yaml:5: upstreams[0].url: must not have a query or fragment"},
    {"upstream url without host", PG "upstreams:\n  - name: api\n    url: http:///x\n",
     "t.yaml:5: upstreams[0].url: invalid URL: missing host"},
    {"upstream url port 0", PG "upstreams:\n  - name: api\n    url: http://127.0.0.1:0\n",
     "t.yaml:5: upstreams[0].url: invalid URL: port must be between 1 and 65535"},
    {"upstream url port 65536", PG "upstreams:\n  - name: api\n    url: http://127.0.0.1:65536/x\n",
     "t.yaml:5: upstreams[0].url: invalid URL: port must be between 1 and 65535"},
    {"upstream url port not a number", PG "upstreams:\n  - name: api\n    url: http://127.0.0.1:+80\n",
     "t.yaml:5: upstreams[0].url: invalid URL: port must be between 1 and 65535"},
    {"upstream url with user info", PG "upstreams:\n  - name: api\n    url: http://u:p@127.0.0.1:9000\n",
     "t.yaml:5: upstreams[0].url: user info (user@host) is not supported"},
    {"upstream url with fragment", PG "upstreams:\n  - name: api\n    url: 'http://127.0.0.1/x#@evil'\n",
     "t.yaml:5: upstreams[0].url: must not have a query or fragment"},
    {"upstream url bad IPv6", PG "upstreams:\n  - name: api\n    url: http://[::g]:80\n",
     "t.yaml:5: upstreams[0].url: invalid URL: invalid IPv6 address between [ ]"},
    {"upstream url IPv6 zone", PG "upstreams:\n  - name: api\n    url: http://[fe80::1%25eth0]:80\n",
     "t.yaml:5: upstreams[0].url: invalid URL: invalid IPv6 address between [ ]"},
    {"redis unix path relative", PG "  redis: unix://run/redis.sock\n" UPS,
     "t.yaml:3: store.redis: a unix socket path must be absolute"},
    {"redis unix bad query", PG "  redis: unix:///run/redis.sock?database=1\n" UPS,
     "t.yaml:3: store.redis: a unix socket takes only ?db=N"},
    {"redis db not a number", PG "  redis: redis://127.0.0.1:6379/x1\n" UPS,
     "t.yaml:3: store.redis: the database must be a number"},
    {"bad upstream name", PG "upstreams:\n  - name: my api\n    url: http://127.0.0.1\n",
     "t.yaml:4: upstreams[0].name: invalid name 'my api'"},
    {"zero upstream timeout", BASE "    timeout: 0ms\n", "t.yaml:6: upstreams[0].timeout: must be greater than 0"},
    {"unknown default_upstream", BASE "default_upstream: web\n",
     "t.yaml:6: default_upstream: unknown upstream 'web' (defined: api)"},
    {"non-scalar where scalar expected", BASE "listen: [a, b]\n", "t.yaml:6: listen: expected host:port, got a list"},
    {"mapping where scalar expected", BASE "shutdown_grace:\n  s: 1\n",
     "t.yaml:7: shutdown_grace: expected a duration, got a mapping"},
    {"missing value", BASE "shutdown_grace:\n", "t.yaml:6: shutdown_grace: missing value (expected a duration)"},
    {"mapping where list expected", BASE "routes: {a: 1}\n", "t.yaml:6: routes: expected a list"},
    {"scalar where mapping expected", BASE "admin: 5\n", "t.yaml:6: admin: expected a mapping, got the scalar '5'"},
    {"store not a mapping", "store: postgres://u:pw@h/db\n" UPS,
     "t.yaml:1: store: expected a mapping, got the scalar 'postgres://u:***@h/db'"},
    {"duplicate key", BASE "listen: 127.0.0.1:1\nlisten: 127.0.0.1:2\n", "t.yaml:7: listen: duplicate key"},
    {"missing route name", BASE "routes:\n  - match: {path: /a}\n    upstream: api\n",
     "t.yaml:7: routes[0].name: missing required key"},
    {"missing match", BASE "routes:\n  - name: p\n    upstream: api\n",
     "t.yaml:7: routes[0].match: missing required key"},
    {"empty route name", BASE "routes:\n  - name: ''\n    match: {path: /a}\n    upstream: api\n",
     "t.yaml:7: routes[0].name: invalid name ''"},
    {"root is a list", "- a\n- b\n", "t.yaml:1: (root): expected a mapping, got a list"},
    {"empty file", "# nothing\n", "t.yaml:1: (root): the configuration is empty"},
    {"two documents", BASE "---\nlisten: 127.0.0.1:1\n", "t.yaml:6: (root): only one YAML document is allowed"},
    /* SPEC 7: limits.buffers holds at least one request of the largest kind */
    {"buffers below a route's body and answer",
     BASE "limits:\n  buffers: 8MiB\n" ROUTE("    idempotency: {max_body: 2MiB, max_response: 8MiB}\n"),
     "t.yaml:7: limits.buffers: 8388608 bytes is less than max_body plus max_response of p (10485760 bytes)"},
    {"buffers below the top level's", BASE "max_response: 600MiB\n",
     "t.yaml:6: limits.buffers: 536870912 bytes is less than max_body plus max_response of the top level"},
    /* SPEC 7: routes that meet only when case, ';' parameters and a format suffix are ignored need one policy */
    {"routes meeting by case",
     BASE "routes:\n  - name: a\n    match: {path: /v1/jwt}\n    upstream: api\n    idempotency: {key: required}\n"
          "  - name: b\n    match: {path_prefix: /V1/JWT}\n    upstream: api\n    idempotency: {key: 'off'}\n",
     "t.yaml:11: routes[1].match: route 'b' and route 'a' meet when case, ';' parameters and a format suffix"},
    {"routes meeting by a format suffix",
     BASE "routes:\n  - name: a\n    match: {path_prefix: /v1/pay}\n    upstream: api\n"
          "  - name: b\n    match: {path: /v1/pay.json}\n    upstream: api\n    idempotency: {key: required}\n",
     "t.yaml:10: routes[1].match: route 'b' and route 'a' meet"},
};

Test(conf, bad_configs)
{
    cr_assert_geq(sizeof(bad_cases) / sizeof(bad_cases[0]), 20);
    for (size_t i = 0; i < sizeof(bad_cases) / sizeof(bad_cases[0]); i++) {
        const struct bad_case *bc = &bad_cases[i];
        char *err = NULL;
        struct conf *c = load(bc->yaml, &err);
        cr_expect_null(c, "[%s] loaded although invalid", bc->what);
        conf_destroy(c);
        if (err == NULL) {
            cr_expect_not_null(err, "[%s] no error message", bc->what);
            continue;
        }
        cr_expect(strstr(err, bc->want) != NULL, "[%s]\n  want: %s\n  got:  %s", bc->what, bc->want, err);
        cr_expect(strncmp(err, "t.yaml:", 7) == 0, "[%s] message must start with file:line: %s", bc->what, err);
        free(err);
    }
}

Test(conf, trusted_proxies_parsed)
{
    struct conf *c = load_ok(BASE);
    cr_expect_eq(c->trusted_proxies_n, 0, "none by default");
    conf_destroy(c);
    c = load_ok(BASE "trusted_proxies: [10.0.0.0/8, 192.0.2.7, '::ffff:172.16.0.0/108', 'fd00::/8', '::1']\n");
    cr_assert_eq(c->trusted_proxies_n, 5);
    static const struct {
        const char *addr;
        bool in;
    } probes[] = {{"10.9.8.7", true},    {"192.0.2.7", true}, {"192.0.2.8", false}, {"172.31.0.1", true},
                  {"172.32.0.1", false}, {"fd12::1", true},   {"::1", true},        {"::2", false}};
    for (size_t i = 0; i < sizeof probes / sizeof probes[0]; i++) {
        struct cm_ip ip;
        cr_assert(cm_ip_parse(probes[i].addr, strlen(probes[i].addr), &ip));
        cr_expect_eq(cm_cidr_match(c->trusted_proxies, c->trusted_proxies_n, &ip), probes[i].in, "%s", probes[i].addr);
    }
    conf_destroy(c);
    c = load_ok(BASE "trusted_proxies: []\n");
    cr_expect_eq(c->trusted_proxies_n, 0);
    conf_destroy(c);
}

Test(conf, destroy_null)
{
    conf_destroy(NULL); /* must not crash */
}

/* Each upstream and Redis URL is parsed once into the fields the runtime uses as they are. */
Test(conf, urls_parsed_into_fields)
{
    static const struct {
        const char *url;
        bool https, ip;
        const char *host, *base;
        unsigned port;
    } ups[] = {
        {"http://127.0.0.1", false, true, "127.0.0.1", "", 80},
        {"HTTPS://api.example:8443/v2/", true, false, "api.example", "/v2", 8443},
        {"https://[2001:db8::1]", true, true, "2001:db8::1", "", 443},
        {"http://localhost:9000/a/b", false, false, "localhost", "/a/b", 9000},
    };
    for (size_t i = 0; i < sizeof ups / sizeof *ups; i++) {
        char *yaml = cm_asprintf("store:\n  postgres: postgres://u@127.0.0.1/db\nupstreams:\n  - name: a\n"
                                 "    url: %s\n",
                                 ups[i].url);
        struct conf *c = load_ok(yaml);
        const struct conf_upstream *u = &c->upstreams[0];
        cr_expect_eq(u->https, ups[i].https, "%s", ups[i].url);
        cr_expect_eq(u->host_is_ip, ups[i].ip, "%s", ups[i].url);
        cr_expect_str_eq(u->host, ups[i].host, "%s", ups[i].url);
        cr_expect_str_eq(u->base_path, ups[i].base, "%s", ups[i].url);
        cr_expect_eq(u->port, ups[i].port, "%s", ups[i].url);
        conf_destroy(c);
        free(yaml);
    }
    static const struct {
        const char *url;
        const char *host, *path, *password;
        unsigned port, db;
    } rds[] = {
        {"redis://127.0.0.1:6379", "127.0.0.1", NULL, NULL, 6379, 0},
        {"redis://:s3cret@[::1]:6380/4", "::1", NULL, "s3cret", 6380, 4},
        {"/run/redis.sock", NULL, "/run/redis.sock", NULL, 0, 0},
        {"unix:///tmp/r.sock?db=3", NULL, "/tmp/r.sock", NULL, 0, 3},
    };
    for (size_t i = 0; i < sizeof rds / sizeof *rds; i++) {
        struct conf_redis r;
        const char *why = NULL;
        cr_assert(conf_redis_parse(rds[i].url, &r, &why), "%s: %s", rds[i].url, why);
        if (rds[i].host)
            cr_expect_str_eq(r.host, rds[i].host, "%s", rds[i].url);
        else
            cr_expect_null(r.host, "%s", rds[i].url);
        if (rds[i].path)
            cr_expect_str_eq(r.unix_path, rds[i].path, "%s", rds[i].url);
        else
            cr_expect_null(r.unix_path, "%s", rds[i].url);
        if (rds[i].password)
            cr_expect_str_eq(r.password, rds[i].password, "%s", rds[i].url);
        else
            cr_expect_null(r.password, "%s", rds[i].url);
        cr_expect_eq(r.port, rds[i].port, "%s", rds[i].url);
        cr_expect_eq(r.db, rds[i].db, "%s", rds[i].url);
        conf_redis_free(&r);
    }
}

/* conf_restart_keys: what a SIGHUP reload must refuse (table: a changed line, the key it names). */
Test(conf, restart_keys_name_what_needs_a_restart)
{
    static const char *const base_head = "store:\n  postgres: postgresql://a@127.0.0.1/db\n";
    static const char *const rest = "upstreams:\n  - name: api\n    url: http://127.0.0.1:9000\n"
                                    "routes:\n  - name: pay\n    match:\n      path_prefix: /v1/pay\n"
                                    "    upstream: api\n";
    static const struct {
        const char *extra; /* top-level lines added to the base */
        const char *key;   /* NULL: reloadable */
    } cases[] = {
        {"listen: 127.0.0.1:8081\n", "listen"},
        {"admin:\n  listen: 127.0.0.1:9091\n", "admin.listen"},
        {"admin:\n  listen: \"off\"\n", "admin.listen"},
        {"threads: 3\n", "threads"},
        {"max_connections: 10\n", "max_connections"},
        {"client_timeout: 5s\n", "client_timeout"},
        {"max_header_bytes: 8KiB\n", "max_header_bytes"},
        {"max_response_header_bytes: 8KiB\n", "max_response_header_bytes"},
        {"shutdown_grace: 3s\n", NULL},
        {"max_body: 2MiB\n", NULL},
    };
    char yaml[1024];
    snprintf(yaml, sizeof yaml, "%s%s", base_head, rest);
    struct conf *a = load_ok(yaml);
    const char *keys[4];
    cr_expect_eq(conf_restart_keys(a, a, keys, 4), 0);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(yaml, sizeof yaml, "%s%s%s", cases[i].extra, base_head, rest);
        struct conf *b = load_ok(yaml);
        size_t n = conf_restart_keys(a, b, keys, 4);
        if (cases[i].key) {
            cr_expect_eq(n, 1, "%s: %zu keys", cases[i].extra, n);
            cr_expect(n >= 1 && strcmp(keys[0], cases[i].key) == 0, "%s: got %s", cases[i].extra, n ? keys[0] : "-");
        } else {
            cr_expect_eq(n, 0, "%s is reloadable", cases[i].extra);
        }
        conf_destroy(b);
    }
    /* the store block: each key named; more keys than room are counted */
    struct conf *s = load_ok("store:\n  postgres: postgresql://b@127.0.0.1/db\n  pool: 3\n"
                             "  redis: redis://127.0.0.1:6379/0\n  redis_timeout: 20ms\n"
                             "listen: 127.0.0.1:8081\n"
                             "upstreams:\n  - name: api\n    url: http://127.0.0.1:9000\n");
    size_t n = conf_restart_keys(a, s, keys, 4);
    cr_expect_eq(n, 5);
    cr_expect_str_eq(keys[0], "listen");
    cr_expect_str_eq(keys[1], "store.postgres");
    cr_expect_str_eq(keys[2], "store.pool");
    cr_expect_str_eq(keys[3], "store.redis");
    conf_destroy(s);
    conf_destroy(a);
}

/* ---- on_unknown: probe and mode: shadow */

Test(conf, probe_and_shadow_parsed)
{
    setenv("IDEMGATE_CONF_TEST_PROBE_KEY", "k-from-env", 1);
    struct conf *c = load_ok(BASE "routes:\n"
                                  "  - name: r\n"
                                  "    match: {path_prefix: /v1/payments}\n"
                                  "    upstream: api\n"
                                  "    idempotency:\n"
                                  "      on_unknown: probe\n"
                                  "      mode: shadow\n"
                                  "      probe:\n"
                                  "        method: HEAD\n"
                                  "        path: /v1/payments?idempotency_key={key}\n"
                                  "        found: [200, 201]\n"
                                  "        absent: [404, 410]\n"
                                  "        headers: {X-Api-Key: $IDEMGATE_CONF_TEST_PROBE_KEY, X-Static: v}\n"
                                  "  - name: d\n"
                                  "    match: {path: /d}\n"
                                  "    upstream: api\n"
                                  "    idempotency: {on_unknown: probe, probe: {path: '/lookup?k={key}'}}\n");
    unsetenv("IDEMGATE_CONF_TEST_PROBE_KEY");
    const struct conf_idem *im = &c->routes[0].idem;
    cr_expect_eq(im->on_unknown, CONF_UNKNOWN_PROBE);
    cr_expect_eq(im->mode, CONF_MODE_SHADOW);
    cr_expect(im->probe.enabled);
    cr_expect_str_eq(im->probe.method, "HEAD");
    cr_expect_str_eq(im->probe.path, "/v1/payments?idempotency_key={key}");
    cr_assert_eq(im->probe.found_n, 2);
    cr_expect_eq(im->probe.found[1], 201);
    cr_assert_eq(im->probe.absent_n, 2);
    cr_expect_eq(im->probe.absent[1], 410);
    cr_assert_eq(im->probe.headers_n, 2);
    cr_expect_str_eq(im->probe.headers[0].name, "X-Api-Key");
    cr_expect_str_eq(im->probe.headers[0].value, "k-from-env", "read from the environment at load");
    cr_expect_str_eq(im->probe.headers[1].value, "v");
    /* the defaults: GET, found [200], absent [404], no headers, enforce */
    const struct conf_idem *d = &c->routes[1].idem;
    cr_expect_str_eq(d->probe.method, "GET");
    cr_assert_eq(d->probe.found_n, 1);
    cr_expect_eq(d->probe.found[0], 200);
    cr_assert_eq(d->probe.absent_n, 1);
    cr_expect_eq(d->probe.absent[0], 404);
    cr_expect_eq(d->probe.headers_n, 0);
    cr_expect_eq(d->mode, CONF_MODE_ENFORCE);
    conf_destroy(c);
}

/* Loads BASE with one route r on /x whose idempotency block is idem (a flow mapping). */
static struct conf *load_idem(const char *idem, char **err)
{
    char yaml[1024];
    snprintf(yaml, sizeof yaml,
             BASE "routes:\n"
                  "  - name: r\n"
                  "    match: {path: /x}\n"
                  "    upstream: api\n"
                  "    idempotency: %s\n",
             idem);
    return load(yaml, err);
}

Test(conf, probe_errors_name_the_line_and_key)
{
    static const struct {
        const char *idem;
        const char *want;
    } cases[] = {
        {"{on_unknown: probe}", "t.yaml:10: routes[0].idempotency.probe: on_unknown: probe needs a probe: block"},
        {"{probe: {path: /x}}", "t.yaml:10: routes[0].idempotency.probe: probe: is used only with on_unknown: probe"},
        {"{on_unknown: probe, probe: {path: '/x?a={key}&b={key}'}}", "({key} at most once)"},
        {"{on_unknown: probe, probe: {path: '/x?a={kee}'}}", "(the only placeholder is {key})"},
        {"{on_unknown: probe, probe: {path: '/x a'}}", "visible ASCII"},
        {"{on_unknown: probe, probe: {path: /x, found: [200], absent: [200]}}", "status 200 is in both"},
        {"{on_unknown: probe, probe: {path: /x, headers: {X-A: \"a\\x01\"}}}", "invalid header value"},
        {"{on_unknown: probe, probe: {path: /x, headers: {X-A: $IDEMGATE_CONF_TEST_UNSET}}}",
         "routes[0].idempotency.probe.headers.X-A: environment variable IDEMGATE_CONF_TEST_UNSET is not set"},
        {"{mode: audit}", "invalid value 'audit' (use enforce, shadow)"},
    };
    unsetenv("IDEMGATE_CONF_TEST_UNSET");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *err = NULL;
        struct conf *c = load_idem(cases[i].idem, &err);
        cr_expect_null(c, "case %zu accepted", i);
        cr_expect(err && strstr(err, cases[i].want) != NULL, "case %zu: want '%s', got '%s'", i, cases[i].want,
                  err ? err : "(none)");
        free(err);
        conf_destroy(c);
    }
}

/* SPEC 9: the look-up must ask about this key (the path or a header carries {key}), the upstream must know the key
 * (forward_key), and on a scoped route it must ask as the same tenant: a scope part the look-up cannot carry
 * (anything but header: and jwt:) is refused unless probe.keys_unique_upstream: true. */
Test(conf, probe_must_ask_about_this_key_as_this_tenant)
{
    static const struct {
        const char *idem;
        const char *want; /* NULL: accepted */
    } cases[] = {
        {"{on_unknown: probe, probe: {path: /lookup}}",
         "t.yaml:10: routes[0].idempotency.probe: the look-up does not carry {key}"},
        {"{on_unknown: probe, probe: {path: /lookup, headers: {X-K: static}}}", "does not carry {key}"},
        {"{on_unknown: probe, forward_key: false, probe: {path: '/lookup?k={key}'}}",
         "t.yaml:10: routes[0].idempotency.forward_key: on_unknown: probe needs forward_key: true"},
        {"{on_unknown: probe, scope: [body], probe: {path: '/lookup?k={key}'}}",
         "t.yaml:10: routes[0].idempotency.scope: the look-up cannot carry scope part 'body'"},
        {"{on_unknown: probe, scope: ['header:X-Tenant', query], probe: {path: '/lookup?k={key}'}}",
         "cannot carry scope part 'query'"},
        {"{on_unknown: probe, scope: [method], probe: {path: '/lookup?k={key}'}}", "cannot carry scope part 'method'"},
        {"{on_unknown: probe, scope: [path], probe: {path: '/lookup?k={key}'}}", "cannot carry scope part 'path'"},
        {"{on_unknown: probe, probe: {path: /lookup, headers: {X-Key: 'k={key}'}}}", NULL},
        {"{on_unknown: probe, scope: ['header:Authorization', 'header:X-Tenant'], probe: {path: '/l?k={key}'}}", NULL},
        {"{on_unknown: probe, scope: [body], probe: {path: '/l?k={key}', keys_unique_upstream: true}}", NULL},
        {"{on_unknown: probe, forward_key: true, probe: {path: '/l?k={key}', keys_unique_upstream: false}}", NULL},
        {"{on_unknown: reject, forward_key: false, scope: [body]}", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *err = NULL;
        struct conf *c = load_idem(cases[i].idem, &err);
        if (cases[i].want) {
            cr_expect_null(c, "case %zu accepted", i);
            cr_expect(err && strstr(err, cases[i].want) != NULL, "case %zu: want '%s', got '%s'", i, cases[i].want,
                      err ? err : "(none)");
        } else {
            cr_expect_not_null(c, "case %zu refused: %s", i, err ? err : "");
        }
        free(err);
        conf_destroy(c);
    }
    /* a jwt: part is carried by the verified Authorization */
    struct conf *c =
        load_ok(BASE "jwt: {secret_env: S}\n"
                     "routes:\n"
                     "  - name: r\n"
                     "    match: {path: /x}\n"
                     "    upstream: api\n"
                     "    idempotency: {on_unknown: probe, scope: ['jwt:sub'], probe: {path: '/l?k={key}', "
                     "headers: {X-Q: 'a {key} b', X-S: s}, keys_unique_upstream: true}}\n");
    const struct conf_probe *pr = &c->routes[0].idem.probe;
    cr_expect(pr->keys_unique_upstream);
    cr_assert_eq(pr->headers_n, 2);
    cr_expect(pr->headers[0].has_key, "{key} in a header value is the key");
    cr_expect(!pr->headers[1].has_key);
    conf_destroy(c);
}

Test(conf, store_distributed_from_file_and_env)
{
    struct conf *c = load_ok(BASE);
    cr_expect_eq(c->distributed, CONF_DIST_NONE, "plain Postgres by default");
    conf_destroy(c);
    const char *citus = "store:\n"
                        "  postgres: postgres://u@127.0.0.1/db\n"
                        "  distributed: citus\n"
                        "upstreams:\n"
                        "  - name: api\n"
                        "    url: http://127.0.0.1:9000\n";
    c = load_ok(citus);
    cr_expect_eq(c->distributed, CONF_DIST_CITUS);
    conf_destroy(c);
    const char *bad = "store:\n"
                      "  postgres: postgres://u@127.0.0.1/db\n"
                      "  distributed: cockroach\n"
                      "upstreams:\n"
                      "  - name: api\n"
                      "    url: http://127.0.0.1:9000\n";
    char *err = NULL;
    c = load(bad, &err);
    cr_expect_null(c);
    cr_assert_not_null(err);
    cr_expect(strstr(err, "t.yaml:3: store.distributed:") != NULL, "%s", err);
    free(err);
    setenv("IDEMGATE_STORE_DISTRIBUTED", "none", 1);
    c = load_ok(citus);
    cr_expect_eq(c->distributed, CONF_DIST_NONE, "the environment wins over the file");
    conf_destroy(c);
    setenv("IDEMGATE_STORE_DISTRIBUTED", "citus", 1);
    c = load_ok(BASE);
    cr_expect_eq(c->distributed, CONF_DIST_CITUS);
    conf_destroy(c);
    setenv("IDEMGATE_STORE_DISTRIBUTED", "yes", 1);
    err = NULL;
    c = load(BASE, &err);
    cr_expect_null(c);
    cr_assert_not_null(err);
    cr_expect(strstr(err, "t.yaml: IDEMGATE_STORE_DISTRIBUTED (environment): must be none or citus") != NULL, "%s",
              err);
    free(err);
    unsetenv("IDEMGATE_STORE_DISTRIBUTED");
}

/* SPEC 9: the only placeholders are {status} {name} {title} {detail}; anything else written like one ({Status},
 * {requestId}, { name }) is a config error naming the line and key, not text sent as is. JSON braces stay text. */
Test(conf, errors_template_placeholders)
{
    static const struct {
        const char *tmpl; /* a YAML single-quoted scalar's content */
        const char *bad;  /* the placeholder the message must name, NULL: valid */
    } cases[] = {
        {"{\"a\":\"{Status}\"}", "{Status}"},
        {"{\"a\":\"{NAME}\"}", "{NAME}"},
        {"{\"id\":\"{requestId}\"}", "{requestId}"},
        {"{\"c\":\"{code1}\"}", "{code1}"},
        {"{\"r\":\"{request-id}\"}", "{request-id}"},
        {"{\"n\":\"{ name }\"}", "{ name }"},
        {"{\"n\":\"{name }\"}", "{name }"},
        {"{\"n\":{ status}}", "{ status}"},
        {"{\"n\":\"{a.b}\"}", "{a.b}"},
        {"{\"n\":{1}}", "{1}"},
        {"{\"n\":\"{foo}\"}", "{foo}"},
        {"{\"a\":1}", NULL},
        {"{ \"a\": 1 }", NULL},
        {"{}", NULL},
        {"{ }", NULL},
        {"[{},{\"a\":{\"b\":{status}}}]", NULL},
        {"{\"e\":{\"s\":{status},\"n\":\"{name}\",\"t\":\"{title}\",\"d\":\"{detail}\"}}", NULL},
        {"{{name}}", NULL},
        {"<e s=\"{status}\">{detail}</e>", NULL},
        {"{", NULL},
        {"}", NULL},
        {"{name", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char yaml[1024];
        snprintf(yaml, sizeof yaml, BASE ROUTE("    errors:\n      template: '%s'\n"), cases[i].tmpl);
        char *err = NULL;
        struct conf *c = load(yaml, &err);
        if (cases[i].bad == NULL) {
            cr_expect_not_null(c, "template %s refused: %s", cases[i].tmpl, err ? err : "(none)");
            if (c != NULL)
                cr_expect_str_eq(c->routes[0].errors.tmpl, cases[i].tmpl);
        } else {
            char want[256];
            snprintf(want, sizeof want, "t.yaml:11: routes[0].errors.template: unknown placeholder '%s'", cases[i].bad);
            cr_expect_null(c, "template %s accepted", cases[i].tmpl);
            cr_expect(err && strstr(err, want) != NULL, "template %s: want '%s', got '%s'", cases[i].tmpl, want,
                      err ? err : "(none)");
        }
        free(err);
        conf_destroy(c);
    }
    /* the renderer's view agrees: a placeholder-like reference is recognised (and is none of the four) */
    size_t len = 0;
    cr_expect_eq(conf_tmpl_var_at("{Status}", 8, &len), CONF_TMPL_NONE);
    cr_expect_eq(len, 8);
    cr_expect_eq(conf_tmpl_var_at("{status}x", 9, &len), CONF_TMPL_STATUS);
    cr_expect_eq(len, 8);
    cr_expect_eq(conf_tmpl_var_at("{\"a\":1}", 7, &len), CONF_TMPL_NONE);
    cr_expect_eq(len, 0);
    cr_expect_eq(conf_tmpl_var_at("{\n  \"a\": 1}", 11, &len), CONF_TMPL_NONE);
    cr_expect_eq(len, 0, "JSON over several lines is text");
    cr_expect_eq(conf_tmpl_var_at("{\tname}", 7, &len), CONF_TMPL_NONE);
    cr_expect_eq(len, 7, "a tab is a space");
    cr_expect_eq(conf_tmpl_var_at("{}", 2, &len), CONF_TMPL_NONE);
    cr_expect_eq(len, 0);
}

/* probe.path has one placeholder, {key}, exactly: {KEY} or { key } is refused like any other brace. */
Test(conf, probe_path_placeholder_is_exactly_key)
{
    static const char *const paths[] = {"/x?k={KEY}", "/x?k={ key }", "/x?k={Key}", "/x/{id}?k={key}"};
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        char yaml[1024];
        snprintf(yaml, sizeof yaml, BASE ROUTE("    idempotency: {on_unknown: probe, probe: {path: '%s'}}\n"),
                 paths[i]);
        char *err = NULL;
        struct conf *c = load(yaml, &err);
        cr_expect_null(c, "probe path %s accepted", paths[i]);
        cr_expect(err && strstr(err, "t.yaml:10: routes[0].idempotency.probe.path: invalid path") != NULL &&
                      strstr(err, "(the only placeholder is {key})") != NULL,
                  "probe path %s: got '%s'", paths[i], err ? err : "(none)");
        free(err);
        conf_destroy(c);
    }
}

/* The JWT keys load after conf (gateway/jwt.c); conf keeps the file and the lines of keys: and secret_env: so that
 * a missing secret or a bad JWKS is reported as FILE:LINE: jwt.KEY like any other config error (SPEC 2). */
Test(conf, jwt_entries_keep_their_file_and_line)
{
    struct conf *c = load_ok(BASE "jwt:\n  issuer: https://auth.example\n  secret_env: S\n  keys: /x/jwks.json\n");
    cr_expect_str_eq(c->jwt.file, "t.yaml");
    cr_expect_eq(c->jwt.secret_env_line, 8);
    cr_expect_eq(c->jwt.keys_line, 9);
    conf_destroy(c);
    c = load_ok(BASE "jwt: {secret_env: S}\n");
    cr_expect_str_eq(c->jwt.file, "t.yaml");
    cr_expect_eq(c->jwt.secret_env_line, 6);
    cr_expect_eq(c->jwt.keys_line, 0, "no keys: entry");
    conf_destroy(c);
}

/* A listen address that resolves (numeric first, then a name) is accepted as written; nothing is bound. */
Test(conf, listen_addresses_resolve)
{
    struct conf *c = load_ok(BASE "listen: localhost:0\nadmin:\n  listen: '[::]:0'\n");
    cr_expect_str_eq(c->listen.host, "localhost");
    cr_expect_str_eq(c->admin_listen.host, "::");
    conf_destroy(c);
    c = load_ok(BASE "listen: 127.1:8080\n");
    cr_expect_str_eq(c->listen.host, "127.1", "the short IPv4 form inet_aton takes");
    conf_destroy(c);
}

/* ---- the reference (docs/configuration.md) and the parser come from one table per mapping */

/* A file of the source tree, found from __FILE__ (tests/unit/conf_test.c relative to where meson runs). */
static const char *source_path(const char *rel, char *buf, size_t n)
{
    const char *f = __FILE__;
    const char *cut = strstr(f, "tests/unit/conf_test.c");
    if (cut != NULL) {
        snprintf(buf, n, "%.*s%s", (int)(cut - f), f, rel);
        if (access(buf, R_OK) == 0)
            return buf;
    }
    snprintf(buf, n, "%s", rel); /* run from the source tree */
    return access(buf, R_OK) == 0 ? buf : NULL;
}

static char *read_all(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    size_t cap = 1 << 20, len = 0;
    char *s = malloc(cap + 1);
    size_t got;
    while (s != NULL && len < cap && (got = fread(s + len, 1, cap - len, f)) > 0)
        len += got;
    fclose(f);
    if (s != NULL)
        s[len] = '\0';
    return s;
}

struct ref_count {
    size_t keys, blocks;
};

static void every_key_documented(const struct conf_key_doc *k, void *arg)
{
    struct ref_count *n = arg;
    n->keys++;
    n->blocks += k->block;
    cr_expect(k->doc != NULL && strlen(k->doc) >= 20, "%s: no doc string (.doc in its field table in conf/)", k->path);
    cr_expect(k->type != NULL && k->type[0] != '\0', "%s: no type (.what for a key parsed by a function)", k->path);
    cr_expect(!k->required || k->def == NULL, "%s: required, yet documents a default '%s'", k->path, k->def);
    cr_expect(k->def == NULL || k->def[0] != '\0', "%s: an empty default text (NULL means none)", k->path);
}

Test(conf, every_key_has_a_doc_string)
{
    struct ref_count n = {0};
    conf_reference_walk(every_key_documented, &n);
    cr_expect_geq(n.keys, 70, "only %zu keys walked", n.keys);
    cr_expect_geq(n.blocks, 11, "only %zu mappings walked", n.blocks);
}

/* Every block present with only what it must hold (A), and the mappings themselves absent (B: a mapping's own
 * default, e.g. errors: problem, is read where it is absent). */
#define REF_B                                                                                                          \
    BASE "routes:\n"                                                                                                   \
         "  - name: r\n"                                                                                               \
         "    match:\n"                                                                                                \
         "      path: /x\n"                                                                                            \
         "    upstream: api\n"
#define REF_A                                                                                                          \
    REF_B "    idempotency: {}\n"                                                                                      \
          "    errors:\n"                                                                                              \
          "      template: '{}'\n"                                                                                     \
          "    ordering:\n"                                                                                            \
          "      resource: /x/{id}\n"                                                                                  \
          "      sequence: header:X-Seq\n"                                                                             \
          "    verify: {scheme: stripe, secrets_env: [IDEMGATE_TEST_UNUSED_SECRET]}\n"                                 \
          "admin: {}\n"                                                                                                \
          "replay_cache: {}\n"                                                                                         \
          "jwt:\n"                                                                                                     \
          "  secret_env: IDEMGATE_TEST_UNUSED_SECRET\n"

struct ref_defaults {
    const struct conf *a, *b;
    size_t checked;
};

static void default_is_what_absence_gives(const struct conf_key_doc *k, void *arg)
{
    struct ref_defaults *d = arg;
    if (k->required)
        return;
    char v[512];
    bool has = conf_key_value(k->block ? d->b : d->a, k->path, v, sizeof v);
    if (k->def != NULL) {
        cr_expect(has, "%s: documents default '%s', but its value cannot be shown (give the field a .show)", k->path,
                  k->def);
        /* the same duration or size written another way ("24h", "1d") is the same default */
        uint64_t x, y;
        bool same = strcmp(v, k->def) == 0 ||
                    (conf_parse_duration(v, &x) && conf_parse_duration(k->def, &y) && x == y) ||
                    (strcmp(k->type, "size") == 0 && conf_parse_size(v, &x) && conf_parse_size(k->def, &y) && x == y);
        cr_expect(!has || same, "%s: documents default '%s', conf_load gives '%s' when it is absent", k->path, k->def,
                  v);
        d->checked++;
    } else {
        cr_expect(!has, "%s: documents no default, conf_load gives '%s' when it is absent", k->path, v);
    }
}

Test(conf, documented_defaults_are_what_conf_load_gives)
{
    struct conf *a = load_ok(REF_A);
    struct conf *b = load_ok(REF_B);
    struct ref_defaults d = {.a = a, .b = b};
    conf_reference_walk(default_is_what_absence_gives, &d);
    cr_expect_geq(d.checked, 40, "only %zu defaults checked", d.checked);
    /* the check sees a wrong default: a value set in the file shows as that value */
    struct conf *c = load_ok(REF_B "    idempotency:\n      lease: 90s\n      scope: [header:Authorization, jwt:sub]\n"
                                   "jwt:\n  secret_env: X\n");
    char v[128];
    cr_expect(conf_key_value(c, "routes[].idempotency.lease", v, sizeof v));
    cr_expect_str_eq(v, "90s");
    cr_expect(conf_key_value(c, "routes[].idempotency.scope", v, sizeof v));
    cr_expect_str_eq(v, "[header:Authorization, jwt:sub]");
    cr_expect(!conf_key_value(c, "routes[].idempotency.nosuchkey", v, sizeof v));
    cr_expect(!conf_key_value(c, "routes.idempotency.lease", v, sizeof v));
    conf_destroy(c);
    conf_destroy(b);
    conf_destroy(a);
}

/* The keys conf_restart_keys can name (restart_keys_name_what_needs_a_restart changes each) are the ones the
 * reference marks "needs a restart" (a mapping's keys count under the mapping's name: replay_cache). */
static const char *const restart_keys[] = {
    "listen",
    "admin.listen",
    "store.postgres",
    "store.pool",
    "store.redis",
    "store.redis_timeout",
    "store.distributed",
    "replay_cache",
    "threads",
    "max_connections",
    "client_timeout",
    "max_header_bytes",
    "max_response_header_bytes",
    "limits.buffers",
    "tracing",
    "access_log",
    "log_format",
};

static void restart_flag_matches(const struct conf_key_doc *k, void *arg)
{
    size_t *flagged = arg;
    bool listed = false;
    for (size_t i = 0; i < sizeof restart_keys / sizeof restart_keys[0]; i++) {
        size_t l = strlen(restart_keys[i]);
        if (strncmp(k->path, restart_keys[i], l) == 0 && (k->path[l] == '\0' || k->path[l] == '.'))
            listed = true;
    }
    cr_expect_eq(k->restart, listed, "%s: the reference says %s, conf_restart_keys %s", k->path,
                 k->restart ? "needs a restart" : "reloads", listed ? "names it" : "does not");
    *flagged += k->restart;
}

Test(conf, reference_marks_the_keys_a_reload_refuses)
{
    size_t flagged = 0;
    conf_reference_walk(restart_flag_matches, &flagged);
    cr_expect_geq(flagged, sizeof restart_keys / sizeof restart_keys[0]);
    /* store.distributed and replay_cache, which the other test does not change, are named too */
    struct conf *a = load_ok(BASE);
    struct conf *b = load_ok("store:\n  postgres: postgres://u@127.0.0.1/db\n  distributed: citus\n"
                             "upstreams:\n  - name: api\n    url: http://127.0.0.1:9000\nreplay_cache: off\n");
    const char *keys[4];
    size_t n = conf_restart_keys(a, b, keys, 4);
    cr_expect_eq(n, 2, "%zu keys", n);
    bool dist = false, cache = false;
    for (size_t i = 0; i < n && i < 4; i++) {
        dist |= strcmp(keys[i], "store.distributed") == 0;
        cache |= strcmp(keys[i], "replay_cache") == 0;
    }
    cr_expect(dist && cache, "store.distributed and replay_cache named");
    conf_destroy(b);
    conf_destroy(a);
}

Test(conf, reference_equals_docs_configuration_md)
{
    char buf[4096];
    const char *path = source_path("docs/configuration.md", buf, sizeof buf);
    cr_assert_not_null(path, "docs/configuration.md not found");
    char *want = read_all(path);
    char *got = conf_reference_markdown();
    cr_assert_not_null(want);
    cr_assert_not_null(got);
    size_t i = 0;
    while (want[i] != '\0' && want[i] == got[i])
        i++;
    size_t line = 1;
    for (size_t j = 0; j < i; j++)
        line += got[j] == '\n';
    cr_expect(want[i] == '\0' && got[i] == '\0',
              "docs/configuration.md differs from idemgate --print-reference at line %zu (run "
              "scripts/gen-reference.sh): file has '%.60s', the tables give '%.60s'",
              line, want + i, got + i);
    free(want);
    free(got);
}

/* ---- every key's documented example loads: the key written with it in the smallest file that holds its mapping */

/* The mapping holding a key (its path's prefix), as a file with "%s" where the key's line goes. A line marked
 * "@name" is left out when the key under test is name (it would be there twice) or excludes it (path_prefix). */
static const struct ex_ctx {
    const char *prefix;
    const char *yaml;
} ex_ctx[] = {
    {"", BASE "%s\n"},
    {"admin.", BASE "admin:\n  %s\n"},
    {"store.", "store:\n  @postgres postgres: postgres://u@127.0.0.1/db\n  %s\n"
               "upstreams:\n  - name: api\n    url: http://127.0.0.1:9000\n"},
    {"upstreams[].", "store:\n  postgres: postgres://u@127.0.0.1/db\nupstreams:\n"
                     "  - %s\n    @name name: api\n    @url url: http://127.0.0.1:9000\n"},
    {"upstreams[].tls.", "store:\n  postgres: postgres://u@127.0.0.1/db\nupstreams:\n  - name: api\n"
                         "    url: https://127.0.0.1:9000\n    tls:\n      @cert cert: /c.pem\n      @key key: /k.pem\n"
                         "      %s\n"},
    {"routes[].", BASE "routes:\n  - %s\n    @name name: r\n    match: {path: /x}\n    @upstream upstream: api\n"},
    {"routes[].match.", BASE "routes:\n  - name: r\n    upstream: api\n    match:\n      @path path: /x\n      %s\n"},
    {"routes[].idempotency.", BASE "routes:\n  - name: r\n    match: {path: /x}\n    upstream: api\n"
                                   "    idempotency:\n      %s\n"},
    {"routes[].idempotency.probe.", BASE "routes:\n  - name: r\n    match: {path: /x}\n    upstream: api\n"
                                         "    idempotency:\n      on_unknown: probe\n      probe:\n"
                                         "        @path path: /l?k={key}\n        %s\n"},
    {"routes[].errors.", BASE "routes:\n  - name: r\n    match: {path: /x}\n    upstream: api\n    errors:\n"
                              "      @template template: '{}'\n      %s\n"},
    {"routes[].ordering.", BASE "routes:\n  - name: r\n    match: {path_prefix: /v1}\n    upstream: api\n"
                                "    ordering:\n      @resource resource: /v1/{id}\n"
                                "      @sequence sequence: header:X-Seq\n      %s\n"},
    {"routes[].verify.", BASE "routes:\n  - name: r\n    match: {path: /x}\n    upstream: api\n    verify:\n"
                              "      @scheme scheme: hmac\n      @secrets_env secrets_env: [S]\n"
                              "      @header header: X-Sig\n      %s\n"},
    {"jwt.", BASE "jwt:\n  @secret_env secret_env: X\n  %s\n"},
    {"replay_cache.", BASE "replay_cache:\n  %s\n"},
    {"limits.", BASE "limits:\n  %s\n"},
    {"tracing.", BASE "tracing:\n  @otlp otlp: http://127.0.0.1:4318\n  %s\n"},
};

/* The context's text for key (its last path part) with "KEY: VALUE" in place: a line "@name ..." is kept (without
 * the marker) unless name is key, or key is one of path/path_prefix and name is path (they exclude each other). */
static bool example_file(const struct ex_ctx *x, const char *key, const char *value, char *out, size_t n)
{
    char line[600];
    snprintf(line, sizeof line, "%s: %s", key, value);
    size_t o = 0;
    for (const char *p = x->yaml; *p && o + 1 < n;) {
        const char *eol = strchr(p, '\n');
        size_t len = eol ? (size_t)(eol - p + 1) : strlen(p);
        char name[64] = "";
        const char *body = p;
        size_t skip_marker = 0;
        for (const char *q = p; q < p + len && (*q == ' ' || *q == '-'); q++)
            if (q[1] == '@') {
                size_t nl = strcspn(q + 2, " ");
                snprintf(name, sizeof name, "%.*s", (int)nl, q + 2);
                skip_marker = nl + 2; /* "@name " */
                body = q + 1;
                break;
            }
        bool drop = name[0] != '\0' &&
                    (strcmp(name, key) == 0 || (strcmp(name, "path") == 0 && strcmp(key, "path_prefix") == 0));
        if (!drop) {
            size_t pre = (size_t)(body - p);
            for (size_t i = 0; i < len && o + 1 < n; i++) {
                if (i >= pre && i < pre + skip_marker)
                    continue;
                if (p[i] == '%' && p[i + 1] == 's') {
                    int w = snprintf(out + o, n - o, "%s", line);
                    if (w < 0 || (size_t)w >= n - o)
                        return false;
                    o += (size_t)w;
                    i++;
                    continue;
                }
                out[o++] = p[i];
            }
        }
        p += len;
    }
    out[o] = '\0';
    return o + 1 < n;
}

struct ex_run {
    size_t checked;
};

static void example_loads(const struct conf_key_doc *k, void *arg)
{
    struct ex_run *r = arg;
    if (k->block && k->example == NULL)
        return; /* a mapping's keys have examples of their own */
    cr_expect(k->example != NULL, "%s: no example (.example in its field table in conf/)", k->path);
    if (k->example == NULL)
        return;
    const struct ex_ctx *x = NULL;
    size_t best = 0;
    for (size_t i = 0; i < sizeof ex_ctx / sizeof ex_ctx[0]; i++) {
        size_t l = strlen(ex_ctx[i].prefix);
        if (strncmp(k->path, ex_ctx[i].prefix, l) == 0 && strchr(k->path + l, '.') == NULL &&
            strstr(k->path + l, "[]") == NULL && (x == NULL || l >= best)) {
            x = &ex_ctx[i];
            best = l;
        }
    }
    cr_assert_not_null(x, "%s: no file to try its example in (add its mapping to ex_ctx)", k->path);
    char yaml[2048];
    cr_assert(example_file(x, k->key, k->example, yaml, sizeof yaml), "%s: the file does not fit", k->path);
    char *err = NULL;
    struct conf *c = conf_load_string("example.yaml", yaml, strlen(yaml), &err);
    cr_expect_not_null(c, "%s: the documented example '%s: %s' does not load: %s\n%s", k->path, k->key, k->example,
                       err ? err : "", yaml);
    conf_destroy(c);
    free(err);
    r->checked++;
}

Test(conf, every_documented_example_loads)
{
    setenv("LOOKUP_API_KEY", "a-look-up-key", 1);
    struct ex_run r = {0};
    conf_reference_walk(example_loads, &r);
    cr_expect_geq(r.checked, 60, "only %zu examples checked", r.checked);
    unsetenv("LOOKUP_API_KEY");
}
