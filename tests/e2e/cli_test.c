/* cli_test.c - end-to-end tests of the idemgate command line: --version, --check on good and bad configurations,
 * missing files, usage and unknown flags (the real binary, run as a child process). */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <dirent.h>

#include "harness.h"

TestSuite(cli, .init = e2e_setup_nostore, .fini = e2e_teardown, .timeout = 60);

#define RUN_MS 10000

/* SPEC section 3's example, every key set; line numbers below refer to this text. */
static const char *const good_lines[] = {
    /* 1 */ "listen: 127.0.0.1:18080",
    /* 2 */ "admin:",
    /* 3 */ "  listen: 127.0.0.1:19090",
    /* 4 */ "shutdown_grace: 10s",
    /* 5 */ "store:",
    /* 6 */ "  postgres: postgresql://idemgate@127.0.0.1:5432/idemgate",
    /* 7 */ "  pool: 8",
    /* 8 */ "  redis: redis://127.0.0.1:6379/0",
    /* 9 */ "  redis_timeout: 50ms",
    /* 10 */ "upstreams:",
    /* 11 */ "  - name: api",
    /* 12 */ "    url: http://127.0.0.1:9000",
    /* 13 */ "    connect_timeout: 2s",
    /* 14 */ "    timeout: 30s",
    /* 15 */ "routes:",
    /* 16 */ "  - name: payments",
    /* 17 */ "    match:",
    /* 18 */ "      path_prefix: /v1/payments",
    /* 19 */ "      methods: [POST, PATCH]",
    /* 20 */ "    upstream: api",
    /* 21 */ "    idempotency:",
    /* 22 */ "      key: required",
    /* 23 */ "      header: Idempotency-Key",
    /* 24 */ "      scope: [header:Authorization]",
    /* 25 */ "      fingerprint: [method, path, query, body]",
    /* 26 */ "      retention: 24h",
    /* 27 */ "      lease: 60s",
    /* 28 */ "      on_in_flight: conflict",
    /* 29 */ "      wait: 10s",
    /* 30 */ "      on_unknown: reject",
    /* 31 */ "      release_statuses: [429, 503]",
    /* 32 */ "      max_body: 1MiB",
    /* 33 */ "      forward_key: true",
    /* 34 */ "default_upstream: api",
};
#define GOOD_N (sizeof good_lines / sizeof good_lines[0])

/* The good config with line `line` (1-based) replaced by `repl` (NULL: unchanged; "" deletes it). */
static char *config_with(size_t line, const char *repl)
{
    size_t cap = 8192, n = 0;
    char *out = malloc(cap);
    cr_assert_not_null(out);
    for (size_t i = 0; i < GOOD_N; i++) {
        const char *l = (repl != NULL && i + 1 == line) ? repl : good_lines[i];
        if (repl != NULL && i + 1 == line && *repl == '\0')
            continue;
        int w = snprintf(out + n, cap - n, "%s\n", l);
        cr_assert(w > 0 && (size_t)w < cap - n);
        n += (size_t)w;
    }
    return out;
}

__attribute__((noinline)) static int idemgate(const char *const *args, const char *const *env, char **out, char **err)
{
    const char *argv[16];
    size_t n = 0;
    argv[n++] = e2e_env("IDEMGATE_BIN");
    for (size_t i = 0; args[i] != NULL && n < 15; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    return e2e_run(argv, env, RUN_MS, out, err);
}

Test(cli, version_prints_the_version_and_exits_0)
{
    char *out, *err;
    static const char *const a[] = {"--version", NULL};
    int code = idemgate(a, NULL, &out, &err);
    cr_expect_eq(code, 0, "--version exit %d; stderr: %s", code, err);
    cr_expect(strstr(out, "idemgate 0.1.0") != NULL, "--version printed: '%s'", out);
    free(out);
    free(err);
}

Test(cli, check_accepts_the_spec_example)
{
    char *text = config_with(0, NULL);
    const char *path = e2e_write_file("good.yaml", text);
    free(text);
    char *out, *err;
    const char *a[] = {"--check", "-c", path, NULL};
    int code = idemgate(a, NULL, &out, &err);
    cr_expect_eq(code, 0, "--check on a valid config: exit %d, stderr: %s", code, err);
    free(out);
    free(err);

    /* long option spelling, and the options in the other order */
    const char *b[] = {"--config", path, "--check", NULL};
    code = idemgate(b, NULL, &out, &err);
    cr_expect_eq(code, 0, "--config FILE --check: exit %d, stderr: %s", code, err);
    free(out);
    free(err);
}

Test(cli, check_accepts_a_minimal_config)
{
    const char *path = e2e_write_file("min.yaml", "store:\n"
                                                  "  postgres: postgresql://idemgate@127.0.0.1:5432/idemgate\n"
                                                  "upstreams:\n"
                                                  "  - name: api\n"
                                                  "    url: http://127.0.0.1:9000\n"
                                                  "default_upstream: api\n");
    char *out, *err;
    const char *a[] = {"--check", "-c", path, NULL};
    int code = idemgate(a, NULL, &out, &err);
    cr_expect_eq(code, 0, "--check on a minimal config: exit %d, stderr: %s", code, err);
    free(out);
    free(err);
}

static const struct bad_case {
    size_t line;      /* line replaced in the good config, and the line the error must name */
    const char *repl; /* its new text */
    const char *key;  /* must appear in the message */
} bad_cases[] = {
    {1, "listen: 127.0.0.1:99999", "listen"},
    /* an address that can never be bound is refused by --check, not found at start (SPEC 2) */
    {1, "listen: 127.0.0.1.5:18080", "listen"},
    {1, "listen: 999.1.1.1:18080", "listen"},
    {1, "listen: nosuchhost.invalid:18080", "listen"},
    {3, "  listen: 999.1.1.1:19090", "admin.listen"},
    {3, "  listen: nosuchhost.invalid:19090", "admin.listen"},
    {4, "shutdown_grace: banana", "shutdown_grace"},
    {4, "bogus_key: 1", "bogus_key"},
    {7, "  pool: 0", "pool"},
    {9, "  redis_timeout: soon", "redis_timeout"},
    {13, "    connect_timeout: -2s", "connect_timeout"},
    {19, "      methods: [POST, FETCH]", "methods"},
    {20, "    upstream: nope", "upstream"},
    {22, "      key: sometimes", "key"},
    {25, "      fingerprint: [method, colour]", "fingerprint"},
    {26, "      retention: 24x", "retention"},
    {28, "      on_in_flight: maybe", "on_in_flight"},
    {30, "      on_unknown: shrug", "on_unknown"},
    {31, "      release_statuses: [429, 7000]", "release_statuses"},
    {32, "      max_body: lots", "max_body"},
    {33, "      forward_key: perhaps", "forward_key"},
    {34, "default_upstream: nope", "default_upstream"},
};

Test(cli, check_rejects_bad_configs_naming_file_line_and_key)
{
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        const struct bad_case *c = &bad_cases[i];
        char name[32];
        snprintf(name, sizeof name, "bad-%zu.yaml", i);
        char *text = config_with(c->line, c->repl);
        const char *path = e2e_write_file(name, text);
        free(text);
        char *out, *err;
        const char *a[] = {"--check", "-c", path, NULL};
        int code = idemgate(a, NULL, &out, &err);
        cr_expect_eq(code, 1, "[%s] --check exit %d (want 1); stderr: %s", c->repl, code, err);
        char where[600];
        snprintf(where, sizeof where, "%s:%zu:", path, c->line);
        cr_expect(strstr(err, where) != NULL, "[%s] stderr must name '%s'; got: %s", c->repl, where, err);
        cr_expect(strstr(err, c->key) != NULL, "[%s] stderr must name the key '%s'; got: %s", c->repl, c->key, err);
        free(out);
        free(err);
    }
}

Test(cli, yaml_syntax_error_names_file_and_line)
{
    char *text = config_with(12, "    url: [unclosed");
    const char *path = e2e_write_file("syntax.yaml", text);
    free(text);
    char *out, *err;
    const char *a[] = {"--check", "-c", path, NULL};
    int code = idemgate(a, NULL, &out, &err);
    cr_expect_eq(code, 1, "exit %d; stderr: %s", code, err);
    char where[600];
    snprintf(where, sizeof where, "%s:", path);
    cr_expect(strstr(err, where) != NULL, "stderr must name the file; got: %s", err);
    /* libyaml reports an unclosed flow sequence on the line where it notices it: 12 or just after */
    bool line_ok = false;
    for (int l = 12; l <= 14 && !line_ok; l++) {
        snprintf(where, sizeof where, "%s:%d:", path, l);
        line_ok = strstr(err, where) != NULL;
    }
    cr_expect(line_ok, "stderr must name the line (12..14); got: %s", err);
    free(out);
    free(err);
}

Test(cli, postgres_url_comes_from_the_environment_when_missing)
{
    char *text = config_with(6, "");
    const char *path = e2e_write_file("nopg.yaml", text);
    free(text);
    char *out, *err;
    const char *a[] = {"--check", "-c", path, NULL};
    int code = idemgate(a, NULL, &out, &err);
    cr_expect_eq(code, 1, "no postgres anywhere: exit %d", code);
    cr_expect(strstr(err, "postgres") != NULL, "the message must name postgres; got: %s", err);
    free(out);
    free(err);

    static const char *const env[] = {"IDEMGATE_POSTGRES_URL=postgresql://idemgate@127.0.0.1:5432/idemgate", NULL};
    code = idemgate(a, env, &out, &err);
    cr_expect_eq(code, 0, "IDEMGATE_POSTGRES_URL set: exit %d; stderr: %s", code, err);
    free(out);
    free(err);
}

Test(cli, missing_config_file_is_a_clear_error)
{
    char *path = e2e_render("{{TMPDIR}}/does-not-exist.yaml", NULL);
    char *out, *err;
    const char *a[] = {"--check", "-c", path, NULL};
    int code = idemgate(a, NULL, &out, &err);
    cr_expect_eq(code, 1, "--check on a missing file: exit %d", code);
    cr_expect(strstr(err, path) != NULL, "the message must name the file; got: %s", err);
    free(out);
    free(err);

    const char *b[] = {"-c", path, NULL};
    code = idemgate(b, NULL, &out, &err);
    cr_expect_eq(code, 1, "-c on a missing file: exit %d", code);
    cr_expect(strstr(err, path) != NULL, "the message must name the file; got: %s", err);
    free(out);
    free(err);
    free(path);
}

Test(cli, no_arguments_prints_usage_and_exits_1)
{
    char *out, *err;
    static const char *const a[] = {NULL};
    int code = idemgate(a, NULL, &out, &err);
    cr_expect_eq(code, 1, "no arguments: exit %d", code);
    cr_expect(strcasestr(err, "usage") != NULL, "usage expected on stderr; got: '%s'", err);
    free(out);
    free(err);
}

Test(cli, unknown_flag_exits_1)
{
    static const char *const cases[][3] = {
        {"--bogus", NULL, NULL}, {"-x", NULL, NULL}, {"-c", NULL, NULL}, /* -c without its file */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out, *err;
        int code = idemgate(cases[i], NULL, &out, &err);
        cr_expect_eq(code, 1, "%s: exit %d", cases[i][0], code);
        cr_expect(strlen(err) > 0, "%s: an explanation expected on stderr", cases[i][0]);
        free(out);
        free(err);
    }
}

/* The same listen address fails the start too, with file, line and key, before anything starts (nothing listens,
 * no Postgres needed). */
Test(cli, start_with_an_unresolvable_listen_address_names_file_line_and_key)
{
    char *text = config_with(1, "listen: 999.1.1.1:18080");
    const char *path = e2e_write_file("badlisten.yaml", text);
    free(text);
    char *out, *err;
    const char *a[] = {"-c", path, NULL};
    int code = idemgate(a, NULL, &out, &err);
    cr_expect_eq(code, 1, "start with listen 999.1.1.1: exit %d; stderr: %s", code, err);
    char where[600];
    snprintf(where, sizeof where, "%s:1: listen: invalid address '999.1.1.1:18080'", path);
    cr_expect(strstr(err, "event=config_invalid") != NULL && strstr(err, where) != NULL,
              "stderr must be config_invalid naming '%s'; got: %s", where, err);
    cr_expect(strstr(err, "start_failed") == NULL, "refused as a config error, not at start: %s", err);
    free(out);
    free(err);
}

/* JWT keys load after the YAML; their errors are still config errors: FILE:LINE: jwt.KEY (SPEC 2), the JWKS file's
 * own name and problem after it. Lines 34.. below: default_upstream, jwt:, then the entry. */
Test(cli, jwt_key_errors_name_file_line_and_key)
{
    char jwks[600];
    snprintf(jwks, sizeof jwks, "%s", e2e_write_file("badjwks.json", "{\"keys\":[{\"kty\":\"RSA\",\"e\":\"AQAB\"}]}"));
    char *missing = e2e_render("{{TMPDIR}}/no-such-jwks.json", NULL);
    char keys_bad[800], keys_missing[800];
    snprintf(keys_bad, sizeof keys_bad, "default_upstream: api\njwt:\n  issuer: x\n  keys: %s", jwks);
    snprintf(keys_missing, sizeof keys_missing, "default_upstream: api\njwt:\n  issuer: x\n  keys: %s", missing);
    static const char *const unset_env[] = {"IDEMGATE_CLI_TEST_JWT=", NULL};
    static const char *const short_env[] = {"IDEMGATE_CLI_TEST_JWT=short", NULL};
    const struct {
        const char *tail;
        const char *const *env;
        const char *key;
        const char *what;
    } cases[] = {
        {"default_upstream: api\njwt:\n  issuer: x\n  secret_env: IDEMGATE_CLI_TEST_JWT", unset_env, "jwt.secret_env",
         "the environment variable IDEMGATE_CLI_TEST_JWT is not set or empty"},
        {"default_upstream: api\njwt:\n  issuer: x\n  secret_env: IDEMGATE_CLI_TEST_JWT", short_env, "jwt.secret_env",
         "the HS256 secret in IDEMGATE_CLI_TEST_JWT must have at least 32 bytes"},
        {keys_missing, NULL, "jwt.keys", "cannot open"},
        {keys_bad, NULL, "jwt.keys", "keys[0]: an RSA key needs base64url n and e"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[32];
        snprintf(name, sizeof name, "jwt-%zu.yaml", i);
        char *text = config_with(34, cases[i].tail);
        const char *path = e2e_write_file(name, text);
        free(text);
        char *out, *err;
        const char *a[] = {"--check", "-c", path, NULL};
        int code = idemgate(a, cases[i].env, &out, &err);
        cr_expect_eq(code, 1, "[%s] --check exit %d (want 1); stderr: %s", cases[i].what, code, err);
        char where[900];
        snprintf(where, sizeof where, "%s:37: %s: ", path, cases[i].key);
        cr_expect(strstr(err, where) != NULL, "[%s] stderr must name '%s'; got: %s", cases[i].what, where, err);
        cr_expect(strstr(err, cases[i].what) != NULL, "[%s] stderr must say it; got: %s", cases[i].what, err);
        free(out);
        free(err);
    }
    free(missing);
}

/* file= in config_ok and config_invalid is quoted like every other value: a path with a space stays one value. */
Test(cli, check_quotes_the_file_name)
{
    char *text = config_with(0, NULL);
    const char *path = e2e_write_file("with space.yaml", text);
    free(text);
    char want[700];
    snprintf(want, sizeof want, "file=\"%s\"", path);
    char *out, *err;
    const char *a[] = {"--check", "-c", path, NULL};
    int code = idemgate(a, NULL, &out, &err);
    cr_expect_eq(code, 0, "exit %d; stderr: %s", code, err);
    cr_expect(strstr(err, "event=config_ok") != NULL && strstr(err, want) != NULL, "want %s in config_ok; got: %s",
              want, err);
    free(out);
    free(err);

    text = config_with(4, "shutdown_grace: banana");
    path = e2e_write_file("bad with space.yaml", text);
    free(text);
    snprintf(want, sizeof want, "file=\"%s\"", path);
    const char *b[] = {"--check", "-c", path, NULL};
    code = idemgate(b, NULL, &out, &err);
    cr_expect_eq(code, 1, "exit %d; stderr: %s", code, err);
    cr_expect(strstr(err, "event=config_invalid") != NULL && strstr(err, want) != NULL,
              "want %s in config_invalid; got: %s", want, err);
    free(out);
    free(err);
}

/* docs/configuration.md is what --print-reference prints (scripts/gen-reference.sh writes it). */
Test(cli, print_reference_equals_docs_configuration_md)
{
    char *path = NULL;
    cr_assert(asprintf(&path, "%s/docs/configuration.md", e2e_env("IDEMGATE_SRC_DIR")) > 0);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s not found", path);
    static char want[1 << 20];
    size_t n = fread(want, 1, sizeof want - 1, f);
    fclose(f);
    want[n] = '\0';
    char *out, *err;
    static const char *const a[] = {"--print-reference", NULL};
    int code = idemgate(a, NULL, &out, &err);
    cr_expect_eq(code, 0, "--print-reference exit %d; stderr: %s", code, err);
    size_t i = 0;
    while (want[i] != '\0' && want[i] == out[i])
        i++;
    cr_expect(want[i] == '\0' && out[i] == '\0',
              "%s differs from --print-reference at byte %zu (run scripts/gen-reference.sh): '%.60s' vs '%.60s'", path,
              i, want + i, out + i);
    cr_expect(strstr(out, "### `routes[].idempotency.lease`") != NULL, "a key's heading");
    free(path);
    free(out);
    free(err);
}

/* SPEC 7: an ordering route without a scope shares one sequence per resource among all its clients: --check warns
 * about it as about an idempotent route without a scope, key: off included. Before, key: off routes were never
 * named. */
Test(cli, check_warns_about_every_route_without_a_scope)
{
    /* clang-format off */
    static const char *const text =
        "store:\n"
        "  postgres: postgresql://idemgate@127.0.0.1:5432/idemgate\n"
        "upstreams:\n"
        "  - name: api\n"
        "    url: http://127.0.0.1:9000\n"
        "default_upstream: api\n"
        "routes:\n"
        "  - name: orderedoff\n"
        "    match: {path_prefix: /v1/accounts}\n"
        "    idempotency: {key: 'off'}\n"
        "    ordering: {resource: '/v1/accounts/{id}', sequence: 'header:X-Sequence'}\n"
        "  - name: orderedscoped\n"
        "    match: {path_prefix: /v1/scoped}\n"
        "    idempotency: {key: 'off', scope: ['header:X-Tenant']}\n"
        "    ordering: {resource: '/v1/scoped/{id}', sequence: 'header:X-Sequence'}\n"
        "  - name: passoff\n"
        "    match: {path_prefix: /v1/pass}\n"
        "    idempotency: {key: 'off'}\n"
        "  - name: keyed\n"
        "    match: {path_prefix: /v1/pay}\n";
    /* clang-format on */
    const char *path = e2e_write_file("unscoped.yaml", text);
    char *out, *err;
    const char *a[] = {"--check", "-c", path, NULL};
    int code = idemgate(a, NULL, &out, &err);
    cr_expect_eq(code, 0, "a warning is no error: exit %d; stderr: %s", code, err);
    cr_expect(strstr(err, "level=warn event=route_without_scope route=orderedoff ") != NULL,
              "the key: off ordering route is named: %s", err);
    cr_expect(strstr(err, "level=warn event=route_without_scope route=keyed ") != NULL, "%s", err);
    cr_expect(strstr(err, "route=orderedscoped") == NULL, "a scoped one is not: %s", err);
    cr_expect(strstr(err, "route=passoff") == NULL, "nor a pass-through route: %s", err);
    free(out);
    free(err);
}

static char *read_source_file(const char *rel)
{
    char *path = NULL;
    cr_assert(asprintf(&path, "%s/%s", e2e_env("IDEMGATE_SRC_DIR"), rel) > 0);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s not found", path);
    size_t cap = 1 << 20;
    char *s = malloc(cap);
    cr_assert_not_null(s);
    size_t n = fread(s, 1, cap - 1, f);
    fclose(f);
    s[n] = '\0';
    free(path);
    return s;
}

/* Every example configuration passes --check and logs config_ok and nothing else (no warning: each example scopes
 * its idempotent routes); the secrets payments.yaml and signed-webhooks.yaml name come from the environment, as
 * there. */
Test(cli, every_example_configuration_passes_check_without_a_warning)
{
    static const char *const env[] = {"IDEMGATE_JWT_SECRET=an-example-secret-of-at-least-32-bytes",
                                      "PAYMENTS_LOOKUP_KEY=lookup-key",
                                      "STRIPE_WHSEC=whsec_example",
                                      "STRIPE_WHSEC_OLD=whsec_example_old",
                                      "SVIX_WHSEC=whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                                      NULL};
    char *dir = NULL;
    cr_assert(asprintf(&dir, "%s/conf/examples", e2e_env("IDEMGATE_SRC_DIR")) > 0);
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "%s missing", dir);
    char *files[32];
    size_t n = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL && n < 31) {
        size_t l = strlen(de->d_name);
        if (l > 5 && strcmp(de->d_name + l - 5, ".yaml") == 0)
            cr_assert(asprintf(&files[n++], "%s/%s", dir, de->d_name) > 0);
    }
    closedir(d);
    cr_assert(asprintf(&files[n++], "%s/conf/idemgate.example.yaml", e2e_env("IDEMGATE_SRC_DIR")) > 0);
    cr_expect_geq(n, 5, "minimal, payments, webhooks, shadow and the full example: %zu files", n);
    for (size_t i = 0; i < n; i++) {
        const char *a[] = {"--check", "-c", files[i], NULL};
        char *out, *err;
        int code = idemgate(a, env, &out, &err);
        cr_expect_eq(code, 0, "%s: --check exit %d; stderr: %s", files[i], code, err);
        cr_expect(strstr(err, "event=config_ok") != NULL, "%s: no config_ok: %s", files[i], err);
        size_t lines = 0;
        for (const char *p = err; *p; p++)
            lines += *p == '\n';
        cr_expect_eq(lines, 1, "%s: --check printed more than config_ok: %s", files[i], err);
        free(out);
        free(err);
        free(files[i]);
    }
    free(dir);
}

/* The README's five-minute configuration is conf/examples/minimal.yaml (checked above), line for line. */
Test(cli, readme_configuration_is_conf_examples_minimal)
{
    char *readme = read_source_file("README.md");
    char *minimal = read_source_file("conf/examples/minimal.yaml");
    size_t checked = 0;
    for (char *line = strtok(minimal, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        if (line[0] == '#')
            continue;
        char want[512];
        snprintf(want, sizeof want, "\n   %s\n", line); /* indented under the README's numbered step */
        cr_expect(strstr(readme, want) != NULL, "README.md lacks the line of minimal.yaml: '%s'", line);
        checked++;
    }
    cr_expect_geq(checked, 10);
    free(readme);
    free(minimal);
}
