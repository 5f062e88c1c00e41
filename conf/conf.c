/* conf.c - loads the YAML configuration (libyaml document API) into struct conf: the top-level key table, the
 * load and its order of checks, the reference walk over the tables, and freeing. Each section's rules live in
 * its own file (fields.c, process.c, upstreams.c, routes.c, idempotency.c, check.c). Never a socket, never the
 * reference's Markdown (reference.c) or the reload's comparison (restart.c). */
#include "conf/internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void conf_destroy(struct conf *c)
{
    if (c == NULL)
        return;
    free(c->file);
    conf_addr_free(&c->listen);
    conf_addr_free(&c->admin_listen);
    free(c->postgres_url);
    free(c->redis_url);
    conf_redis_free(&c->redis);
    for (size_t i = 0; i < c->upstreams_n; i++) {
        free(c->upstreams[i].name);
        free(c->upstreams[i].url);
        free(c->upstreams[i].base_path);
        free(c->upstreams[i].host);
        free(c->upstreams[i].tls.ca);
        free(c->upstreams[i].tls.cert);
        free(c->upstreams[i].tls.key);
        free(c->upstreams[i].tls.server_name);
    }
    free(c->upstreams);
    for (size_t i = 0; i < c->routes_n; i++) {
        free(c->routes[i].name);
        free(c->routes[i].path);
        free(c->routes[i].path_prefix);
        free(c->routes[i].match_key);
        conf_i_idem_free(&c->routes[i].idem);
        conf_i_ordering_free(&c->routes[i].ordering);
        conf_i_verify_free(&c->routes[i].verify);
        free(c->routes[i].errors.tmpl);
        free(c->routes[i].errors.content_type);
    }
    free(c->routes);
    free(c->admin_token);
    free(c->request_id_header);
    free(c->trusted_proxies);
    free(c->access_log);
    free(c->jwt.keys_file);
    free(c->jwt.secret_env);
    free(c->jwt.issuer);
    free(c->jwt.audience);
    free(c->tracing_otlp);
    free(c);
}

/* access_log: stderr | off | a file path (SPEC 11) */
static bool fn_access_log(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *v = conf_i_scalar(x, n, "stderr, off or a file path");
    if (v == NULL)
        return false;
    if (v[0] == '\0')
        return conf_i_fail(x, n, "must be stderr, off or a file path");
    free(*out);
    *out = cm_strdup(v);
    return true;
}

/* trusted_proxies: a list of CIDR blocks or bare addresses (SPEC 11) */
#define TRUSTED_PROXIES_MAX 256
static bool fn_trusted_proxies(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf *c = target;
    if (!conf_i_expect_type(x, n, YAML_SEQUENCE_NODE))
        return false;
    size_t cnt = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    if (cnt > TRUSTED_PROXIES_MAX)
        return conf_i_fail(x, n, "at most %d blocks (a larger network is one shorter prefix)", TRUSTED_PROXIES_MAX);
    struct cm_cidr *v = cnt ? cm_calloc(cnt, sizeof *v) : NULL;
    for (size_t i = 0; i < cnt; i++) {
        yaml_node_t *m = yaml_document_get_node(x->doc, n->data.sequence.items.start[i]);
        size_t old = conf_i_path_push(x, "[%zu]", i);
        const char *s = conf_i_scalar(x, m, "a CIDR block (10.0.0.0/8, fd00::/8) or an address");
        const char *why = s ? cm_cidr_parse(s, &v[i]) : NULL;
        if (s == NULL || why != NULL) {
            char b[80];
            if (why)
                conf_i_fail(x, m, "'%s': %s", conf_i_shown(b, s), why);
            free(v);
            return false;
        }
        conf_i_path_pop(x, old);
    }
    free(c->trusted_proxies);
    c->trusted_proxies = v;
    c->trusted_proxies_n = cnt;
    return true;
}

static const char *const log_formats[] = {"logfmt", "json", NULL};
_Static_assert(sizeof(enum conf_log_format) == sizeof(int), "enum stored through int");

static const struct conf_i_field top_fields[] = {
    CONF_FIELD_FN("listen", struct conf, listen, conf_i_fn_listen, false, .what = "host:port or mapping",
                  .def = "127.0.0.1:8080", .show = conf_i_show_addr, .restart = true,
                  .allowed = "`host:port` or `[v6]:port` (port 0 picks a free port, logged as `event=listening`), or "
                             "`{address: host:port, tls: {cert: FILE, key: FILE}}`",
                  .doc =
                      "Where clients connect. An IPv6 address takes IPv6 clients only. The host is resolved when "
                      "the file is checked, so an address that can never work is a config error. With `tls` the "
                      "listener serves HTTPS only (TLS 1.2 and 1.3): `cert` is the PEM certificate chain (the "
                      "server's first), `key` its PEM private key (unencrypted). Both are read and checked at start, "
                      "by `--check` and on every SIGHUP: new certificate files take effect for new connections, a "
                      "broken one is refused like any bad file (the old certificate stays). Turning TLS on or off "
                      "needs a restart.",
                  .example = "0.0.0.0:8080"),
    CONF_FIELD_BASE("admin", conf_i_fn_admin, false, .what = "mapping", CONF_SUB(conf_i_admin_fields, 0),
                    .doc = "The admin listener (see operations.md)."),
    CONF_FIELD("shutdown_grace", CONF_F_DUR, struct conf, shutdown_grace_ms, 0, CONF_DURATION_MAX, .def = "10s",
               .doc = "On SIGTERM or SIGINT, how long requests in flight may take to finish. Past it their clients "
                      "get 503 `shutting-down` and their records stay in flight, then unknown.",
               .example = "30s"),
    CONF_FIELD("shutdown_delay", CONF_F_DUR, struct conf, shutdown_delay_ms, 0, CONF_DURATION_MAX, .def = "0s",
               .doc = "On SIGTERM or SIGINT, how long the listeners keep accepting and serving new connections while "
                      "`/readyz` already answers 503, so that a load balancer stops sending before the port closes; "
                      "then `shutdown_grace` applies. A second signal ends the delay early.",
               .example = "5s"),
    CONF_FIELD_BASE("store", conf_i_fn_store, false, .what = "mapping", CONF_SUB(conf_i_store_fields, 0),
                    .doc = "Postgres (the authority) and Redis (the optional fast filter)."),
    CONF_FIELD_BASE("upstreams", conf_i_fn_upstreams, true, .what = "list of mappings",
                    CONF_SUB_LIST(conf_i_upstream_fields, offsetof(struct conf, upstreams)),
                    .doc = "The APIs behind the gateway, at least one."),
    CONF_FIELD_BASE("routes", conf_i_fn_routes, false, .what = "list of mappings",
                    CONF_SUB_LIST(conf_i_route_fields, offsetof(struct conf, routes)),
                    .doc = "Which requests get idempotency, and how. Tried in order; the first match wins."),
    CONF_FIELD_BASE("default_upstream", conf_i_fn_default_upstream, false, .what = "upstream name",
                    .allowed = "a name from `upstreams`",
                    .doc = "Where requests no route matches go, proxied plainly (no key checked). Unset: they get 404 "
                           "`route-not-found`. Routes without an `upstream` use it.",
                    .example = "api"),
    CONF_FIELD("max_header_bytes", CONF_F_SIZE, struct conf, max_header_bytes, 1, CONF_MIB, .def = "16KiB",
               .restart = true, .doc = "The largest request head; beyond it 431 (a longer request target: 414).",
               .example = "32KiB"),
    CONF_FIELD("max_response_header_bytes", CONF_F_SIZE, struct conf, max_response_header_bytes, 1, CONF_MIB,
               .def = "16KiB", .restart = true,
               .doc = "The largest upstream answer head (status line and headers); beyond it the answer is invalid: "
                      "502 `upstream-invalid-response`, nothing stored.",
               .example = "32KiB"),
    CONF_FIELD("max_body", CONF_F_SIZE, struct conf, max_body, 1, CONF_SIZE_MAX_BODY, .def = "1MiB",
               .doc = "The largest request body of requests no route matches (routes have their own "
                      "`idempotency.max_body`); beyond it 413.",
               .example = "4MiB"),
    CONF_FIELD("max_response", CONF_F_SIZE, struct conf, max_response, 1, CONF_SIZE_MAX_BODY, .def = "8MiB",
               .doc = "The largest upstream answer relayed for requests outside idempotency; beyond it 502.",
               .example = "16MiB"),
    CONF_FIELD("max_connections", CONF_F_U32, struct conf, max_connections, 1, 100000, .def = "4096", .restart = true,
               .doc = "Client connections at most; beyond it 503 `too-many-connections` and the connection is closed. "
                      "The admin listener takes as many.",
               .example = "10000"),
    CONF_FIELD("client_timeout", CONF_F_DUR, struct conf, client_timeout_ms, 1, CONF_DURATION_MAX, .def = "30s",
               .restart = true,
               .doc = "An idle client connection, one sending its request slower than this, or one whose answer takes "
                      "longer than this to be written (a client that stops reading) is cut; on the admin listener too.",
               .example = "10s"),
    CONF_FIELD("threads", CONF_F_U32, struct conf, threads, 0, 64, .def = "0", .restart = true,
               .doc = "I/O loop threads, each with its own HTTP front, upstream client, Redis connection and share of "
                      "`store.pool`. 0: one per CPU (at most `store.pool`).",
               .example = "4"),
    CONF_FIELD_FN("jwt", struct conf, jwt, conf_i_fn_jwt, false, .what = "mapping",
                  CONF_SUB(conf_i_jwt_fields, offsetof(struct conf, jwt)),
                  .doc = "How bearer tokens are verified for `jwt:CLAIM` scope parts. Needed only when a route uses "
                         "one. A request on such a route without a valid token is 401 `invalid-credentials`."),
    CONF_FIELD_BASE("limits", conf_i_fn_limits, false, .what = "mapping", CONF_SUB(conf_i_limits_fields, 0),
                    .doc = "Bounds on what the whole process holds."),
    CONF_FIELD_BASE("replay_cache", conf_i_fn_replay_cache, false, .what = "mapping or off",
                    CONF_SUB(conf_i_replay_cache_fields, 0), .restart = true,
                    .allowed = "`{max_bytes: SIZE, max_entries: N}` or `off`",
                    .doc = "Completed answers kept in this process's memory and replayed without a store round trip. "
                           "Used only while its Postgres listener (purges reach every instance through it) is "
                           "connected. `off` disables it.",
                    .example = "off"),
    CONF_FIELD_BASE("tracing", conf_i_fn_tracing, false, .what = "mapping", CONF_SUB(conf_i_tracing_fields, 0),
                    .restart = true,
                    .doc = "OpenTelemetry traces: spans `request`, `claim`, `upstream` and `complete` exported over "
                           "OTLP/HTTP (see operations.md). Absent: no tracing."),
    CONF_FIELD_FN(
        "access_log", struct conf, access_log, fn_access_log, false, .what = "stderr, off or a path", .def = "stderr",
        .show = conf_i_show_str, .restart = true, .allowed = "`stderr`, `off` or a file path",
        .doc = "One line per request (`event=access`), written when its answer was sent or its client went "
               "away (operations.md lists its fields). A file is opened for appending and reopened on "
               "SIGUSR1 (after logrotate moved it). Lines are buffered and written by a thread of their own: "
               "a full disk or a slow file never holds a request up; lines that cannot be written are dropped "
               "and counted in `idemgate_log_dropped_total`.",
        .example = "/var/log/idemgate/access.log"),
    CONF_FIELD_ENUM("log_format", struct conf, log_format, log_formats, .def = "logfmt", .restart = true,
                    .doc = "The format of every log line, access or not: `logfmt` (`key=value` pairs) or `json` (one "
                           "object a line, with the same names).",
                    .example = "json"),
    CONF_FIELD_FN("request_id_header", struct conf, request_id_header, conf_i_fn_key_header, false,
                  .what = "header name", .def = "X-Request-Id", .show = conf_i_show_str, .allowed = "an HTTP token",
                  .doc =
                      "Where a request's id travels: kept from a peer in `trusted_proxies` when it is 1 to 128 visible "
                      "ASCII bytes, else a new random 128-bit id (hex). It is sent upstream, set on every answer (a "
                      "replay's stored value is replaced), written in every problem body as `request_id` and in "
                      "every log line about the request.",
                  .example = "X-Correlation-Id"),
    CONF_FIELD_BASE("trusted_proxies", fn_trusted_proxies, false, .what = "list of CIDR blocks",
                    .allowed =
                        "IPv4 or IPv6 blocks (`10.0.0.0/8`, `fd00::/8`) or bare addresses (one host), at most 256",
                    .doc = "The load balancers and proxies in front of the gateway. From a peer inside one of these "
                           "blocks `X-Forwarded-Proto` (`http` or `https`), `X-Forwarded-Host` (one host[:port]) and "
                           "the `request_id_header` value are passed on when valid, the other forwarding headers "
                           "(`X-Forwarded-Port`, `X-Real-IP`, ...) too, and the client address logged is the rightmost "
                           "`X-Forwarded-For` address outside these blocks. From any other peer those headers are the "
                           "gateway's own (operations.md, Behind a load balancer). An IPv4-mapped peer "
                           "(`::ffff:10.1.2.3`) matches the IPv4 blocks. Unset: no peer is trusted.",
                    .example = "[10.0.0.0/8, 192.168.0.0/16]"),
};

/* ---------------------------------------------------------------- the reference (idemgate --print-reference) */

static void key_doc(const struct conf_i_field *f, const char *path, unsigned depth, struct conf_key_doc *k)
{
    static const char *const types[] = {[CONF_F_BOOL] = "boolean",
                                        [CONF_F_U32] = "integer",
                                        [CONF_F_DUR] = "duration",
                                        [CONF_F_SIZE] = "size",
                                        [CONF_F_ENUM] = "one of"};
    memset(k, 0, sizeof *k);
    k->path = path;
    k->key = f->key;
    k->depth = depth;
    k->type = f->type == CONF_F_FUNC ? f->what : types[f->type];
    k->def = f->def;
    k->doc = f->doc;
    k->example = f->example;
    k->required = f->required || f->needed;
    k->restart = f->restart;
    k->block = f->sub != NULL;
    char lo[32], hi[32];
    size_t l = 0;
    switch (f->type) {
    case CONF_F_BOOL:
        snprintf(k->allowed, sizeof k->allowed, "`true`, `false`");
        break;
    case CONF_F_U32:
        snprintf(k->allowed, sizeof k->allowed, "%s to %s", conf_i_fmt_int(lo, f->min), conf_i_fmt_int(hi, f->max));
        break;
    case CONF_F_DUR:
        snprintf(k->allowed, sizeof k->allowed, "%s to %s", conf_i_fmt_dur(lo, f->min), conf_i_fmt_dur(hi, f->max));
        break;
    case CONF_F_SIZE:
        snprintf(k->allowed, sizeof k->allowed, "%s to %s", conf_i_fmt_size(lo, f->min), conf_i_fmt_size(hi, f->max));
        break;
    case CONF_F_ENUM:
        for (size_t i = 0; f->names[i] != NULL && l < sizeof k->allowed; i++) {
            int w = snprintf(k->allowed + l, sizeof k->allowed - l, "%s`%s`", i ? ", " : "", f->names[i]);
            if (w < 0)
                break;
            l += (size_t)w;
        }
        break;
    case CONF_F_FUNC:
        snprintf(k->allowed, sizeof k->allowed, "%s", f->allowed ? f->allowed : "");
        break;
    }
}

static void walk(const struct conf_i_field *fields, size_t n, const char *prefix, unsigned depth, conf_key_fn fn,
                 void *arg)
{
    for (size_t i = 0; i < n; i++) {
        const struct conf_i_field *f = &fields[i];
        char path[CONF_PATH_BUF];
        snprintf(path, sizeof path, "%s%s", prefix, f->key);
        struct conf_key_doc k;
        key_doc(f, path, depth, &k);
        k.list = f->sub_list;
        fn(&k, arg);
        if (f->sub != NULL) {
            char sub[CONF_PATH_BUF + 4];
            snprintf(sub, sizeof sub, "%s%s", path, f->sub_list ? "[]." : ".");
            walk(f->sub, f->nsub, sub, depth + 1, fn, arg);
        }
    }
}

void conf_reference_walk(conf_key_fn fn, void *arg)
{
    walk(top_fields, CONF_NFIELDS(top_fields), "", 0, fn, arg);
}

bool conf_key_value(const struct conf *c, const char *path, char *buf, size_t n)
{
    const struct conf_i_field *fields = top_fields;
    size_t nf = CONF_NFIELDS(top_fields);
    const void *base = c;
    buf[0] = '\0';
    for (const char *p = path; fields != NULL;) {
        size_t len = strcspn(p, ".[");
        size_t i = 0;
        while (i < nf && !(strlen(fields[i].key) == len && strncmp(fields[i].key, p, len) == 0))
            i++;
        if (i == nf)
            return false;
        const struct conf_i_field *f = &fields[i];
        p += len;
        if (*p == '\0') {
            char a[32];
            const void *v = conf_i_at(base, f);
            switch (f->type) {
            case CONF_F_BOOL:
                snprintf(buf, n, "%s", *(const bool *)v ? "true" : "false");
                return true;
            case CONF_F_U32:
                snprintf(buf, n, "%s", conf_i_fmt_int(a, *(const uint32_t *)v));
                return true;
            case CONF_F_DUR:
                snprintf(buf, n, "%s", conf_i_fmt_dur(a, *(const uint64_t *)v));
                return true;
            case CONF_F_SIZE:
                snprintf(buf, n, "%s", conf_i_fmt_size(a, *(const uint64_t *)v));
                return true;
            case CONF_F_ENUM:
                snprintf(buf, n, "%s", f->names[*(const int *)v]);
                return true;
            case CONF_F_FUNC:
                return f->show != NULL && f->show(base, f, buf, n);
            }
            return false;
        }
        if (f->sub == NULL)
            return false;
        base = (const char *)base + f->sub_off;
        if (f->sub_list) {
            base = *(const void *const *)base; /* the first element */
            if (base == NULL || strncmp(p, "[]", 2) != 0)
                return false;
            p += 2;
        }
        if (*p != '.')
            return false;
        p++;
        fields = f->sub;
        nf = f->nsub;
    }
    return false;
}

static void conf_defaults(struct conf *c)
{
    c->listen.host = cm_strdup("127.0.0.1");
    c->listen.port = 8080;
    c->admin_listen.host = cm_strdup("127.0.0.1");
    c->admin_listen.port = 9090;
    c->admin_enabled = true;
    c->shutdown_grace_ms = 10 * CONF_SEC;
    c->pool = 8;
    c->redis_timeout_ms = 50;
    c->max_header_bytes = 16 * CONF_KIB;
    c->max_response_header_bytes = 16 * CONF_KIB;
    c->jwt.leeway_ms = 30 * CONF_SEC;
    c->max_body = CONF_MIB;
    c->max_response = 8 * CONF_MIB;
    c->max_connections = 4096;
    c->client_timeout_ms = 30 * CONF_SEC;
    c->threads = 0;
    c->replay_cache_max_bytes = 2 * CONF_MIB;
    c->replay_cache_max_entries = 4096;
    c->limits_buffers = 512 * CONF_MIB;
    c->tracing_sample = 0.05;
    c->request_id_header = cm_strdup("X-Request-Id");
    c->access_log = cm_strdup("stderr");
}

static char *syntax_error(const char *name, const yaml_parser_t *p, const char *yaml, size_t len)
{
    size_t line;
    if (p->error == YAML_READER_ERROR) {
        line = 1;
        for (size_t i = 0; i < p->problem_offset && i < len; i++)
            if (yaml[i] == '\n')
                line++;
        return cm_asprintf("%s:%zu: YAML syntax error: %s", name, line, p->problem ? p->problem : "unreadable input");
    }
    if (p->error == YAML_MEMORY_ERROR)
        return cm_asprintf("%s:1: YAML syntax error: out of memory", name);
    line = p->problem_mark.line + 1;
    if (p->context != NULL)
        return cm_asprintf("%s:%zu: YAML syntax error: %s (%s at line %zu)", name, line,
                           p->problem ? p->problem : "invalid YAML", p->context, p->context_mark.line + 1);
    return cm_asprintf("%s:%zu: YAML syntax error: %s", name, line, p->problem ? p->problem : "invalid YAML");
}

struct conf *conf_load_string(const char *name, const char *yaml, size_t len, char **err)
{
    yaml_parser_t parser;
    yaml_document_t doc, extra;
    bool have_doc = false;
    struct conf_i_ctx x = {.file = name};
    struct conf *c = cm_calloc(1, sizeof(*c));
    *err = NULL;
    c->file = cm_strdup(name);
    conf_defaults(c);
    x.c = c;
    x.doc = &doc;

    if (!yaml_parser_initialize(&parser)) {
        x.err = cm_asprintf("%s:1: YAML syntax error: cannot initialise the parser", name);
        goto fail_noparser;
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)yaml, len);
    if (!yaml_parser_load(&parser, &doc)) {
        x.err = syntax_error(name, &parser, yaml, len);
        goto fail;
    }
    have_doc = true;
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (root == NULL) {
        x.err = cm_asprintf("%s:1: (root): the configuration is empty", name);
        goto fail;
    }
    if (!yaml_parser_load(&parser, &extra)) {
        x.err = syntax_error(name, &parser, yaml, len);
        goto fail;
    }
    bool second = yaml_document_get_root_node(&extra) != NULL;
    size_t second_line = extra.start_mark.line + 1;
    yaml_document_delete(&extra);
    if (second) {
        x.err = cm_asprintf("%s:%zu: (root): only one YAML document is allowed", name, second_line);
        goto fail;
    }

    if (!conf_i_parse_map(&x, root, top_fields, CONF_NFIELDS(top_fields), c))
        goto fail;
    if (!conf_i_resolve_refs(&x))
        goto fail;
    if (x.jwt_part_line && !c->jwt.enabled) {
        snprintf(x.path, sizeof x.path, "%s", x.jwt_part_path);
        x.plen = strlen(x.path);
        conf_i_fail_line(&x, x.jwt_part_line, "a jwt:CLAIM scope needs a top-level jwt: block (keys or secret_env)");
        goto fail;
    }
    if (!conf_i_check_addresses(&x, root) || !conf_i_check_route_spellings(&x, root) || !conf_i_check_buffers(&x, root))
        goto fail;
    if (!conf_i_apply_env(&x, root))
        goto fail;

    yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
    free(x.refs);
    return c;

fail:
    if (have_doc)
        yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
fail_noparser:
    free(x.refs);
    conf_destroy(c);
    *err = x.err ? x.err : cm_asprintf("%s:1: (root): invalid configuration", name);
    return NULL;
}

struct conf *conf_load(const char *file, char **err)
{
    FILE *f = fopen(file, "rb");
    if (f == NULL) {
        *err = cm_asprintf("%s: cannot open: %s", file, strerror(errno));
        return NULL;
    }
    struct cm_buf b;
    cm_buf_init(&b, CONF_FILE_MAX);
    char chunk[8192];
    size_t n;
    while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0) {
        if (!cm_buf_append(&b, chunk, n)) {
            fclose(f);
            cm_buf_free(&b);
            *err = cm_asprintf("%s: file is larger than %d MiB", file, (int)(CONF_FILE_MAX / CONF_MIB));
            return NULL;
        }
    }
    if (ferror(f)) {
        int e = errno;
        fclose(f);
        cm_buf_free(&b);
        *err = cm_asprintf("%s: cannot read: %s", file, strerror(e));
        return NULL;
    }
    fclose(f);
    struct conf *c = conf_load_string(file, b.data ? b.data : "", b.len, err);
    cm_buf_free(&b);
    return c;
}
