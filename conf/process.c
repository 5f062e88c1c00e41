/* process.c - the sections that set the whole process: listen and admin (the listen address look-up), store
 * (postgres, redis, distributed) and its environment overrides, jwt, limits, replay_cache and tracing. Never a route
 * or an upstream, never the field machinery (fields.c). */
#include "conf/internal.h"

#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

bool conf_i_show_addr(const void *base, const struct conf_i_field *f, char *buf, size_t n)
{
    const struct conf_addr *a = conf_i_at(base, f);
    conf_addr_fmt(buf, n, a->host, a->port);
    return true;
}

static bool show_admin_listen(const void *base, const struct conf_i_field *f, char *buf, size_t n)
{
    (void)f;
    const struct conf *c = base;
    if (!c->admin_enabled)
        snprintf(buf, n, "off");
    else
        conf_addr_fmt(buf, n, c->admin_listen.host, c->admin_listen.port);
    return true;
}

#define LISTEN_LOOKUP_MS 5000 /* a listen host name's look-up (DNS) during validation */

/* getaddrinfo as the front and the admin listener call it for their bind (AI_PASSIVE); 0 or an EAI_ code. */
static int listen_gai(const char *host, int flags)
{
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV | flags;
    int rc = getaddrinfo(host, "0", &hints, &res);
    if (rc == 0 && res == NULL)
        rc = EAI_NONAME;
    if (res != NULL)
        freeaddrinfo(res);
    return rc;
}

/* One name look-up on its own thread, so that a resolver that does not answer holds the load (start, SIGHUP) for
 * LISTEN_LOOKUP_MS at most; the last of the caller and the thread to let go frees it. */
struct lookup {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    bool done;
    int rc;
    char host[256];
};

static void lookup_unref(struct lookup *l)
{
    pthread_mutex_lock(&l->mu);
    bool last = --l->refs == 0;
    pthread_mutex_unlock(&l->mu);
    if (!last)
        return;
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

static void *lookup_main(void *arg)
{
    struct lookup *l = arg;
    int rc = listen_gai(l->host, 0);
    pthread_mutex_lock(&l->mu);
    l->rc = rc;
    l->done = true;
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
    lookup_unref(l);
    return NULL;
}

/* Whether host can be a listen address (SPEC 2: an address that can never work is a config error, not a start
 * failure): NULL when it resolves as the listeners will resolve it (nothing is bound), otherwise why not, in buf. A
 * numeric address is parsed without a look-up, and one that does not parse (999.1.1.1, 127.0.0.1.5) never goes to
 * DNS; a name is looked up within LISTEN_LOOKUP_MS. */
static const char *listen_resolves(const char *host, char *buf, size_t n)
{
    char b[80];
    if (listen_gai(host, AI_NUMERICHOST) == 0)
        return NULL;
    if (strchr(host, ':') != NULL) {
        snprintf(buf, n, "'%s' is not an IPv6 address", conf_i_shown(b, host));
        return buf;
    }
    if (host[strspn(host, "0123456789.")] == '\0') {
        snprintf(buf, n, "'%s' is not an IPv4 address", conf_i_shown(b, host));
        return buf;
    }
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
    /* The fuzz target never asks DNS: a resolver that does not answer made a unit take 10 s (a libFuzzer timeout) and
     * the glibc resolver's thread left behind looks like a leak. */
    snprintf(buf, n, "cannot resolve '%s' (no name look-ups when fuzzing)", conf_i_shown(b, host));
    return buf;
#endif
    struct lookup *l = cm_calloc(1, sizeof *l);
    pthread_mutex_init(&l->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&l->cv, &ca);
    pthread_condattr_destroy(&ca);
    snprintf(l->host, sizeof l->host, "%s", host);
    l->refs = 2;
    pthread_t t;
    pthread_attr_t ta;
    pthread_attr_init(&ta);
    pthread_attr_setdetachstate(&ta, PTHREAD_CREATE_DETACHED);
    bool started = pthread_create(&t, &ta, lookup_main, l) == 0;
    pthread_attr_destroy(&ta);
    if (!started) { /* no thread to spare: look it up here, bounded by the resolver's own timeouts */
        l->refs = 1;
        l->rc = listen_gai(host, 0);
        l->done = true;
    }
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += LISTEN_LOOKUP_MS / 1000;
    until.tv_nsec += (long)(LISTEN_LOOKUP_MS % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&l->mu);
    while (!l->done && pthread_cond_timedwait(&l->cv, &l->mu, &until) != ETIMEDOUT) {
    }
    bool done = l->done;
    int rc = l->rc;
    pthread_mutex_unlock(&l->mu);
    lookup_unref(l);
    if (!done)
        snprintf(buf, n, "cannot resolve '%s' (no answer within %ds)", conf_i_shown(b, host), LISTEN_LOOKUP_MS / 1000);
    else if (rc != 0)
        snprintf(buf, n, "cannot resolve '%s' (%s)", conf_i_shown(b, host), gai_strerror(rc));
    return (done && rc == 0) ? NULL : buf;
}

static bool parse_listen(struct conf_i_ctx *x, yaml_node_t *n, struct conf_addr *out)
{
    const char *s = conf_i_scalar(x, n, "host:port");
    if (s == NULL)
        return false;
    const char *host, *port_s;
    size_t hostn, port_n;
    char b[80];
    const char *why = conf_i_split_hostport(s, strlen(s), &host, &hostn, &port_s, &port_n);
    if (why != NULL)
        return conf_i_fail(x, n, "invalid address '%s': %s (use host:port or [v6]:port)", conf_i_shown(b, s), why);
    if (port_s == NULL)
        return conf_i_fail(x, n, "invalid address '%s': missing port (use host:port or [v6]:port)", conf_i_shown(b, s));
    uint16_t port;
    if (!conf_i_parse_port(port_s, port_n, true, &port))
        return conf_i_fail(x, n, "invalid address '%s': port must be between 0 and 65535", conf_i_shown(b, s));
    char *h = cm_strndup(host, hostn), reason[256];
    if (listen_resolves(h, reason, sizeof reason) != NULL) {
        free(h);
        return conf_i_fail(x, n, "invalid address '%s': %s", conf_i_shown(b, s), reason);
    }
    free(out->host);
    out->host = h;
    out->port = port;
    return true;
}

void conf_addr_free(struct conf_addr *a)
{
    free(a->host);
    free(a->tls.cert);
    free(a->tls.key);
    memset(a, 0, sizeof *a);
}

bool conf_i_fn_pem_path(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = conf_i_scalar(x, n, "a PEM file path");
    if (s == NULL)
        return false;
    if (!*s || strlen(s) > 1024 || !cm_field_value_ok(s, strlen(s)))
        return conf_i_fail(x, n, "must be a file path of at most 1024 bytes without control characters");
    free(*out);
    *out = cm_strdup(s);
    return true;
}

static const struct conf_i_field listen_tls_fields[] = {
    CONF_FIELD_FN("cert", struct conf_listen_tls, cert, conf_i_fn_pem_path, true, .what = "path",
                  .doc = "The PEM certificate chain, the server's certificate first."),
    CONF_FIELD_FN("key", struct conf_listen_tls, key, conf_i_fn_pem_path, true, .what = "path",
                  .doc = "The PEM private key of the first certificate (unencrypted)."),
};

static bool fn_listen_tls(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_listen_tls *t = target;
    if (n->type != YAML_MAPPING_NODE)
        return conf_i_fail(x, n, "must be a mapping {cert: FILE, key: FILE}");
    t->cert_line = conf_i_find_line(x, n, "cert", NULL);
    t->key_line = conf_i_find_line(x, n, "key", NULL);
    return conf_i_parse_map(x, n, listen_tls_fields, CONF_NFIELDS(listen_tls_fields), t);
}

static bool fn_listen_address(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    return parse_listen(x, n, target);
}

/* listen's long form: {address: HOST:PORT, tls: {cert: FILE, key: FILE}} */
static const struct conf_i_field listen_long_fields[] = {
    CONF_FIELD_BASE("address", fn_listen_address, true, .what = "host:port", .doc = "Where the listener listens."),
    CONF_FIELD_FN("tls", struct conf_addr, tls, fn_listen_tls, false, .what = "mapping",
                  .doc = "HTTPS on this listener: {cert: FILE, key: FILE}."),
};

/* A listener: HOST:PORT, or the long form. */
static bool parse_listener(struct conf_i_ctx *x, yaml_node_t *n, struct conf_addr *out)
{
    if (n->type != YAML_MAPPING_NODE)
        return parse_listen(x, n, out);
    free(out->tls.cert);
    free(out->tls.key);
    memset(&out->tls, 0, sizeof out->tls);
    return conf_i_parse_map(x, n, listen_long_fields, CONF_NFIELDS(listen_long_fields), out);
}

bool conf_i_fn_listen(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    return parse_listener(x, n, target);
}

static bool fn_admin_listen(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf *c = target;
    if (n->type == YAML_SCALAR_NODE && strcmp((const char *)n->data.scalar.value, "off") == 0) {
        c->admin_enabled = false;
        return true;
    }
    c->admin_enabled = true;
    return parse_listener(x, n, &c->admin_listen);
}

const struct conf_i_field conf_i_admin_fields[] = {
    CONF_FIELD_BASE(
        "listen", fn_admin_listen, false, .what = "host:port, mapping or off", .def = "127.0.0.1:9090",
        .show = show_admin_listen, .restart = true,
        .allowed = "`host:port`, `[v6]:port` (port 0: a free port), `{address: host:port, tls: {cert: FILE, "
                   "key: FILE}}`, or `off`",
        .doc = "Where the admin listener (health, readiness, metrics, the status page, the key API) listens. "
               "`off` disables it. It must differ from `listen`. Keep it on a private address: only the key "
               "API asks for a token. Its `tls` is its own, as `listen`'s (reloaded on SIGHUP too).",
        .example = "off"),
};

bool conf_i_fn_admin(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    return conf_i_parse_map(x, n, conf_i_admin_fields, CONF_NFIELDS(conf_i_admin_fields), target);
}

static bool fn_postgres(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = conf_i_scalar(x, n, "a Postgres URL");
    if (s == NULL)
        return false;
    if (strncmp(s, "postgres://", 11) != 0 && strncmp(s, "postgresql://", 13) != 0 && strchr(s, '=') == NULL)
        return conf_i_fail(x, n, "must start with postgres:// or postgresql:// (or be a key=value connection string)");
    free(*out);
    *out = cm_strdup(s);
    return true;
}

void conf_redis_free(struct conf_redis *r)
{
    free(r->host);
    free(r->unix_path);
    free(r->password);
    memset(r, 0, sizeof *r);
}

/* "?db=N" (or nothing) after a unix socket path. */
static const char *redis_unix_query(const char *q, struct conf_redis *out)
{
    if (q == NULL || q[1] == '\0')
        return NULL;
    uint64_t db;
    if (strncmp(q, "?db=", 4) != 0 || !cm_parse_digits(q + 4, strlen(q + 4), 5, &db) || db > 65535)
        return "a unix socket takes only ?db=N (e.g. unix:///run/redis.sock?db=2)";
    out->db = (uint32_t)db;
    return NULL;
}

/* A unix socket path at p up to its query (NUL or '?'). */
static const char *redis_unix(const char *p, struct conf_redis *out)
{
    size_t n = strcspn(p, "?");
    if (n < 2 || p[0] != '/')
        return "a unix socket path must be absolute: unix:///run/redis.sock";
    if (n >= 108) /* sizeof sockaddr_un.sun_path */
        return "the unix socket path is longer than 107 bytes";
    const char *why = redis_unix_query(p[n] == '?' ? p + n : NULL, out);
    if (why != NULL)
        return why;
    out->unix_path = cm_strndup(p, n);
    return NULL;
}

bool conf_redis_parse(const char *s, struct conf_redis *out, const char **why)
{
    memset(out, 0, sizeof *out);
    *why = NULL;
    if (s[0] == '/')
        *why = redis_unix(s, out);
    else if (strncmp(s, "unix://", 7) == 0)
        *why = redis_unix(s + 7, out);
    else if (strncmp(s, "redis://", 8) != 0)
        *why = "must be redis://[:password@]host:port[/db] or an absolute unix socket path";
    if (*why != NULL || out->unix_path != NULL)
        goto done;
    const char *a = s + 8;
    size_t alen = strcspn(a, "/");
    const char *at = NULL;
    for (size_t i = 0; i < alen; i++)
        if (a[i] == '@')
            at = a + i;
    if (at != NULL) {
        if (a[0] != ':') {
            *why = "user names are not supported: use redis://:password@host:port";
            goto done;
        }
        out->password = cm_strndup(a + 1, (size_t)(at - a - 1));
        alen -= (size_t)(at + 1 - a);
        a = at + 1;
    }
    const char *host, *port_s;
    size_t hostn, port_n;
    *why = conf_i_split_hostport(a, alen, &host, &hostn, &port_s, &port_n);
    if (*why != NULL)
        goto done;
    if (port_s == NULL) {
        *why = "missing port (e.g. redis://127.0.0.1:6379/0)";
        goto done;
    }
    if (!conf_i_parse_port(port_s, port_n, false, &out->port)) {
        *why = "port must be between 1 and 65535";
        goto done;
    }
    out->host = cm_strndup(host, hostn);
    const char *rest = a + alen;
    if (rest[0] == '\0' || strcmp(rest, "/") == 0)
        goto done;
    uint64_t db;
    if (!cm_parse_digits(rest + 1, strlen(rest + 1), 5, &db) || db > 65535)
        *why = "the database must be a number: redis://host:port/0";
    else
        out->db = (uint32_t)db;
done:
    if (*why != NULL)
        conf_redis_free(out);
    return *why == NULL;
}

/* Sets c's Redis from s (NULL or "": none). Returns a problem text, or NULL. */
static const char *set_redis(struct conf *c, const char *s)
{
    struct conf_redis r;
    const char *why = NULL;
    if (s != NULL && s[0] != '\0' && !conf_redis_parse(s, &r, &why))
        return why;
    free(c->redis_url);
    conf_redis_free(&c->redis);
    c->redis_url = NULL;
    if (s != NULL && s[0] != '\0') {
        c->redis_url = cm_strdup(s);
        c->redis = r;
    }
    return NULL;
}

static bool fn_redis(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf *c = target;
    if (conf_i_is_null(n)) /* "redis:" or "redis: ~": no Redis */
        return set_redis(c, NULL) == NULL;
    const char *s = conf_i_scalar(x, n, "a Redis URL");
    if (s == NULL)
        return false;
    const char *why = set_redis(c, s);
    if (why != NULL)
        return conf_i_fail(x, n, "%s", why);
    return true;
}

static const char *const distributed_modes[] = {"none", "citus", NULL};

const struct conf_i_field conf_i_store_fields[] = {
    CONF_FIELD_FN("postgres", struct conf, postgres_url, fn_postgres, false, .what = "string", .restart = true,
                  .needed = true, .allowed = "`postgres://...`, `postgresql://...` or a libpq `key=value` string",
                  .doc = "The Postgres database that is the authority for every key. Required, here or in "
                         "`IDEMGATE_POSTGRES_URL` (which replaces it). The gateway creates or migrates its table "
                         "(`idemgate_keys`) at start. Passwords are never logged.",
                  .example = "postgresql://idemgate@db1:5432,db2:5432/idemgate?target_session_attrs=read-write"),
    CONF_FIELD("pool", CONF_F_U32, struct conf, pool, 1, 256, .def = "8", .restart = true,
               .doc =
                   "Postgres connections of this process at most, shared by the I/O loops. One of them listens for "
                   "purges, for the replay cache and for the answers Redis may give (with `pool: 1` the replay cache "
                   "is off and Postgres answers every replay).",
               .example = "16"),
    CONF_FIELD_BASE("redis", fn_redis, false, .what = "string", .show = conf_i_show_str,
                    CONF_STR_AT(struct conf, redis_url), .restart = true,
                    .allowed = "`redis://[:password@]host:port[/db]`, an absolute unix socket path, or "
                               "`unix:///path[?db=N]`; empty: no Redis",
                    .doc = "The optional fast filter (needs Redis 7.0 or later). Without it every claim asks Postgres "
                           "only. Redis may be flushed, stopped or paused at any time: that costs latency, never a "
                           "second execution. `IDEMGATE_REDIS_URL` replaces it (an empty value: no Redis).",
                    .example = "unix:///run/redis/redis.sock?db=2"),
    CONF_FIELD("redis_timeout", CONF_F_DUR, struct conf, redis_timeout_ms, 1, CONF_DURATION_MAX, .def = "50ms",
               .restart = true,
               .doc = "How long one Redis command may take before the gateway goes on with Postgres alone.",
               .example = "20ms"),
    CONF_FIELD_ENUM("distributed", struct conf, distributed, distributed_modes, .def = "none", .restart = true,
                    .doc = "`none`: plain Postgres. `citus`: the database is a Citus coordinator and the gateway "
                           "distributes its table itself at start (see operations.md, Citus). "
                           "`IDEMGATE_STORE_DISTRIBUTED` replaces it.",
                    .example = "citus"),
};

bool conf_i_fn_store(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    return conf_i_parse_map(x, n, conf_i_store_fields, CONF_NFIELDS(conf_i_store_fields), target);
}

/* ---- jwt: keys, secret_env, issuer, audience, leeway */

static bool fn_jwt_string(struct conf_i_ctx *x, yaml_node_t *n, void *target, const char *what)
{
    char **out = target;
    const char *s = conf_i_scalar(x, n, what);
    if (s == NULL)
        return false;
    if (strlen(s) > 1024 || !cm_field_value_ok(s, strlen(s)))
        return conf_i_fail(x, n, "must be at most 1024 bytes without control characters");
    free(*out);
    *out = cm_strdup(s);
    return true;
}

static bool fn_jwt_keys(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    return fn_jwt_string(x, n, target, "a JWKS file path");
}

static bool fn_jwt_issuer(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    return fn_jwt_string(x, n, target, "an issuer (the iss claim)");
}

static bool fn_jwt_audience(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    return fn_jwt_string(x, n, target, "an audience (a value of the aud claim)");
}

static bool fn_jwt_secret_env(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    char *name = conf_i_env_name(x, n);
    if (name == NULL)
        return false;
    free(*out);
    *out = name;
    return true;
}

const struct conf_i_field conf_i_jwt_fields[] = {
    CONF_FIELD_FN("keys", struct conf_jwt, keys_file, fn_jwt_keys, false, .what = "file path",
                  .allowed = "a JWKS file with RS256 (RSA, 2048 bits or more) and ES256 (P-256) keys",
                  .doc = "The public keys tokens are verified with. Loaded at start, by `--check` and on reload; a "
                         "key that does not load is a config error. Give `keys`, `secret_env` or both.",
                  .example = "/etc/idemgate/jwks.json"),
    CONF_FIELD_FN("secret_env", struct conf_jwt, secret_env, fn_jwt_secret_env, false,
                  .what = "environment variable name",
                  .allowed = "`A-Z a-z 0-9 _`, not starting "
                             "with a digit",
                  .doc = "The environment variable holding an HS256 secret (at least 32 bytes).",
                  .example = "IDEMGATE_JWT_SECRET"),
    CONF_FIELD_FN("issuer", struct conf_jwt, issuer, fn_jwt_issuer, false, .what = "string",
                  .doc = "When set, a token's `iss` must equal it.", .example = "https://auth.example.com"),
    CONF_FIELD_FN("audience", struct conf_jwt, audience, fn_jwt_audience, false, .what = "string",
                  .doc = "When set, a token's `aud` (a string or an array) must name it.", .example = "payments"),
    CONF_FIELD("leeway", CONF_F_DUR, struct conf_jwt, leeway_ms, 0, 3600 * CONF_SEC, .def = "30s",
               .doc = "Clock difference allowed when `exp` and `nbf` are checked.", .example = "1m"),
};

bool conf_i_fn_jwt(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_jwt *j = target;
    size_t line = x->key_line ? x->key_line : conf_i_node_line(n);
    if (!conf_i_parse_map(x, n, conf_i_jwt_fields, CONF_NFIELDS(conf_i_jwt_fields), j))
        return false;
    if (!j->keys_file && !j->secret_env)
        return conf_i_fail_line(x, line, "needs keys (a JWKS file) or secret_env (an HS256 secret), or both");
    /* the keys load later (gateway/jwt.c): their errors name these lines */
    j->file = x->c->file;
    j->keys_line = conf_i_find_line(x, n, "keys", NULL);
    j->secret_env_line = conf_i_find_line(x, n, "secret_env", NULL);
    j->enabled = true;
    return true;
}

const struct conf_i_field conf_i_replay_cache_fields[] = {
    CONF_FIELD("max_bytes", CONF_F_SIZE, struct conf, replay_cache_max_bytes, 0, CONF_GIB, .def = "2MiB",
               .restart = true,
               .doc = "Bytes of answers kept in memory at most (an answer over an eighth of it is not cached). 0 "
                      "disables the cache.",
               .example = "16MiB"),
    CONF_FIELD("max_entries", CONF_F_U32, struct conf, replay_cache_max_entries, 0, 10000000, .def = "4096",
               .restart = true, .doc = "Answers kept in memory at most. 0 disables the cache.", .example = "100000"),
};

const struct conf_i_field conf_i_limits_fields[] = {
    CONF_FIELD("buffers", CONF_F_SIZE, struct conf, limits_buffers, 1, 1024 * CONF_GIB, .def = "512MiB",
               .restart = true, .example = "2GiB",
               .doc = "Bytes of request bodies and answers the process holds in memory at once (counted while a body "
                      "is read and an answer is read, stored or written). A request that would pass it is answered 503 "
                      "`overloaded` with `Retry-After` before anything is claimed or forwarded "
                      "(`idemgate_shed_total{reason=\"buffers\"}`); an answer that arrives while it is full is 502 "
                      "`upstream-response-too-large`. At least the largest `max_body` plus `max_response` of a route "
                      "(or of the top level)."),
};

bool conf_i_fn_limits(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    if (n->type != YAML_MAPPING_NODE)
        return conf_i_fail(x, n, "must be a mapping {buffers: SIZE}");
    return conf_i_parse_map(x, n, conf_i_limits_fields, CONF_NFIELDS(conf_i_limits_fields), target);
}

/* replay_cache: {max_bytes: 2MiB, max_entries: 4096} or replay_cache: off */
bool conf_i_fn_replay_cache(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf *c = target;
    if (n->type == YAML_SCALAR_NODE && strcmp((const char *)n->data.scalar.value, "off") == 0) {
        c->replay_cache_max_bytes = 0;
        c->replay_cache_max_entries = 0;
        return true;
    }
    if (n->type != YAML_MAPPING_NODE)
        return conf_i_fail(x, n, "must be a mapping {max_bytes: SIZE, max_entries: N} or off");
    return conf_i_parse_map(x, n, conf_i_replay_cache_fields, CONF_NFIELDS(conf_i_replay_cache_fields), c);
}

/* ---- tracing: {otlp: URL, sample: P} (SPEC 11); absent: off */

static bool fn_tracing_otlp(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = conf_i_scalar(x, n, "an http:// URL");
    if (s == NULL)
        return false;
    size_t skip = strncasecmp(s, "http://", 7) == 0 ? 7 : strncasecmp(s, "https://", 8) == 0 ? 8 : 0;
    if (skip == 0)
        return conf_i_fail(x, n, "must start with http:// or https://");
    for (const char *p = s; *p; p++)
        if ((unsigned char)*p <= 0x20 || *p == 0x7f)
            return conf_i_fail(x, n, "must not contain spaces or control characters");
    if (strpbrk(s, "?#@") != NULL || s[skip] == '\0' || s[skip] == '/' || strlen(s) > 512)
        return conf_i_fail(x, n,
                           "must be http(s)://HOST[:PORT][/PATH] (at most 512 bytes, no user info, query or fragment)");
    free(*out);
    *out = cm_strdup(s);
    return true;
}

static bool fn_tracing_sample(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    double *out = target;
    const char *s = conf_i_scalar(x, n, "a number from 0 to 1");
    if (s == NULL)
        return false;
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || end == s || *end != '\0' || !(v >= 0 && v <= 1))
        return conf_i_fail(x, n, "must be a number from 0 to 1 (the share of new traces sampled)");
    *out = v;
    return true;
}

static bool show_tracing_sample(const void *base, const struct conf_i_field *f, char *buf, size_t n)
{
    snprintf(buf, n, "%g", *(const double *)(const void *)((const char *)base + f->off));
    return true;
}

const struct conf_i_field conf_i_tracing_fields[] = {
    CONF_FIELD_FN("otlp", struct conf, tracing_otlp, fn_tracing_otlp, true, .what = "URL", .restart = true,
                  .allowed = "`http://` or `https://` and a host, optional port and path",
                  .doc = "The OpenTelemetry collector's OTLP/HTTP endpoint: spans are POSTed as JSON to this URL + "
                         "`/v1/traces`.",
                  .example = "http://127.0.0.1:4318"),
    CONF_FIELD_FN("sample", struct conf, tracing_sample, fn_tracing_sample, false, .what = "number", .def = "0.05",
                  .restart = true, .show = show_tracing_sample, .allowed = "0 to 1",
                  .doc = "The share of requests traced when the request carries no valid `traceparent`; with one, its "
                         "sampled flag decides.",
                  .example = "0.25"),
};

bool conf_i_fn_tracing(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    if (n->type != YAML_MAPPING_NODE)
        return conf_i_fail(x, n, "must be a mapping {otlp: URL, sample: P}");
    return conf_i_parse_map(x, n, conf_i_tracing_fields, CONF_NFIELDS(conf_i_tracing_fields), target);
}

bool conf_i_apply_env(struct conf_i_ctx *x, yaml_node_t *root)
{
    struct conf *c = x->c;
    const char *pg = getenv("IDEMGATE_POSTGRES_URL");
    if (pg != NULL && pg[0] != '\0') {
        if (strncmp(pg, "postgres://", 11) != 0 && strncmp(pg, "postgresql://", 13) != 0 && strchr(pg, '=') == NULL) {
            x->err = cm_asprintf("%s: IDEMGATE_POSTGRES_URL (environment): must start with postgres:// or "
                                 "postgresql:// (or be a key=value connection string)",
                                 x->file);
            return false;
        }
        free(c->postgres_url);
        c->postgres_url = cm_strdup(pg);
    }
    const char *rd = getenv("IDEMGATE_REDIS_URL");
    if (rd != NULL) {
        const char *why = set_redis(c, rd);
        if (why != NULL) {
            x->err = cm_asprintf("%s: IDEMGATE_REDIS_URL (environment): %s", x->file, why);
            return false;
        }
    }
    const char *dist = getenv("IDEMGATE_STORE_DISTRIBUTED");
    if (dist != NULL && dist[0] != '\0') {
        size_t i = 0;
        while (distributed_modes[i] != NULL && strcmp(distributed_modes[i], dist) != 0)
            i++;
        if (distributed_modes[i] == NULL) {
            x->err = cm_asprintf("%s: IDEMGATE_STORE_DISTRIBUTED (environment): must be none or citus", x->file);
            return false;
        }
        c->distributed = (enum conf_distributed)i;
    }
    const char *tok = getenv("IDEMGATE_ADMIN_TOKEN");
    free(c->admin_token);
    c->admin_token = (tok != NULL && tok[0] != '\0') ? cm_strdup(tok) : NULL;

    if (c->postgres_url == NULL) {
        yaml_node_t *store = NULL;
        size_t line = conf_i_find_line(x, root, "store", &store);
        if (line == 0)
            line = conf_i_node_line(root);
        conf_i_path_pop(x, 0);
        conf_i_path_push(x, "store.postgres");
        return conf_i_fail_line(x, line, "missing required key (set it here or in IDEMGATE_POSTGRES_URL)");
    }
    return true;
}
