/* types.h - what a loaded configuration is made of (struct conf, its routes, upstreams and sections, their enums);
 * declarations only, never a function: the loader (conf.c) fills them, the others read them. */
#ifndef IDEMGATE_CONF_TYPES_H
#define IDEMGATE_CONF_TYPES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/addr.h"
#include "common/common.h"

/* HTTP method bits for conf_route.methods. */
enum {
    CONF_M_GET = 1 << 0,
    CONF_M_HEAD = 1 << 1,
    CONF_M_POST = 1 << 2,
    CONF_M_PUT = 1 << 3,
    CONF_M_PATCH = 1 << 4,
    CONF_M_DELETE = 1 << 5,
    CONF_M_OPTIONS = 1 << 6,
    CONF_M_TRACE = 1 << 7,
    CONF_M_CONNECT = 1 << 8,
};

/* A listener's TLS (the long form of listen: {address, tls: {cert, key}}): the PEM files as written. gateway/tls.c
 * reads and checks them whenever the configuration loads (start, --check, SIGHUP), so a broken file fails the load. */
struct conf_listen_tls {
    char *cert; /* NULL: plain HTTP */
    char *key;
    size_t cert_line, key_line; /* lines of the keys in the file, for errors */
};

struct conf_addr {
    char *host; /* "127.0.0.1", "::1", "0.0.0.0", "localhost" */
    uint16_t port;
    struct conf_listen_tls tls;
};

/* An https upstream's tls: (libcurl reads the files when it connects; the load checks they are readable). */
struct conf_upstream_tls {
    bool set;          /* a tls: block was given */
    char *ca;          /* CA bundle to verify the upstream with; NULL: the system's */
    char *cert, *key;  /* client certificate and its key (PEM); NULL: none */
    bool verify;       /* verify the upstream's certificate and name, default true */
    char *server_name; /* the name sent as SNI and verified; NULL: the URL's host */
};

/* An upstream, its URL parsed once here into the parts the runtime uses as they are (never parsed again). */
struct conf_upstream {
    char *name;
    char *url;                     /* as written, trailing slash removed (for logs and Host): http://127.0.0.1:9000 */
    bool https;                    /* scheme https (else http) */
    char *host;                    /* host name or IP literal, IPv6 without brackets: "127.0.0.1", "::1", "api.local" */
    uint16_t port;                 /* as written, else 80 (http) or 443 (https) */
    bool host_is_ip;               /* host is an IPv4 or IPv6 literal */
    char *base_path;               /* path part of url without trailing '/', "" when none */
    uint64_t connect_timeout_ms;   /* default 2s */
    uint64_t timeout_ms;           /* default 30s */
    uint32_t max_connections;      /* upstream sockets, default 1024 */
    uint64_t keepalive_timeout_ms; /* an idle pooled connection is reused up to this long, default 60s (nginx's) */
    struct conf_upstream_tls tls;  /* https only */
};

/* Redis, parsed once from store.redis: TCP (redis://[:password@]host:port[/db]) or a unix socket (an absolute
 * path, or unix:///path[?db=N]). */
struct conf_redis {
    char *host;      /* TCP host, IPv6 without brackets; NULL with a unix socket */
    uint16_t port;   /* TCP port */
    char *unix_path; /* the socket's absolute path, or NULL */
    char *password;  /* AUTH password, or NULL */
    uint32_t db;     /* 0: no SELECT */
};

enum conf_key_mode { CONF_KEY_OPTIONAL = 0, CONF_KEY_REQUIRED, CONF_KEY_OFF };
enum conf_in_flight { CONF_IN_FLIGHT_CONFLICT = 0, CONF_IN_FLIGHT_WAIT };
enum conf_on_unknown { CONF_UNKNOWN_REJECT = 0, CONF_UNKNOWN_RETRY, CONF_UNKNOWN_PROBE };
/* store.distributed: the engine the tables live on (none: plain Postgres; citus: distributed by the gateway). */
enum conf_distributed { CONF_DIST_NONE = 0, CONF_DIST_CITUS };
enum conf_part_kind {
    CONF_PART_METHOD,
    CONF_PART_PATH,
    CONF_PART_QUERY,
    CONF_PART_BODY,
    CONF_PART_HEADER,
    CONF_PART_JWT,    /* a claim of the verified bearer JWT (scope only) */
    CONF_PART_JSON,   /* json:/POINTER: the value at an RFC 6901 JSON Pointer into a JSON body */
    CONF_PART_FORM,   /* form:NAME: a field of an application/x-www-form-urlencoded body */
    CONF_PART_QPARAM, /* query:NAME: a parameter of the query */
};

struct conf_part {
    enum conf_part_kind kind;
    /* CONF_PART_HEADER: the header name; CONF_PART_JWT: the claim name; CONF_PART_JSON: the pointer ("" is the
     * whole body); CONF_PART_FORM, CONF_PART_QPARAM: the field's name */
    char *header;
};

/* Does a part of this kind read the request body (parsing it)? */
static inline bool conf_part_reads_body(enum conf_part_kind k)
{
    return k == CONF_PART_JSON || k == CONF_PART_FORM;
}

/* ---- probe and shadow mode (SPEC 9, 10) */

/* A static header of the look-up: the value as written, or read from the environment at load ($NAME). */
struct conf_probe_header {
    char *name;
    char *value;
    bool has_key; /* the value as written holds "{key}": each is replaced by the key (never in a $NAME value) */
};

/* on_unknown: probe: how the gateway asks the upstream whether an unknown outcome executed (SPEC 9). */
struct conf_probe {
    bool enabled; /* a probe: block was given (required with on_unknown: probe, refused otherwise) */
    char *method; /* a token, default GET */
    char *path;   /* origin-form, starts with '/', "{key}" at most once (the key, percent-encoded) */
    int *found;   /* default [200]: this answer becomes the record's stored answer */
    size_t found_n;
    int *absent; /* default [404]: nothing executed, the claim is released */
    size_t absent_n;
    struct conf_probe_header *headers; /* the only headers the look-up carries (with the scope's request parts) */
    size_t headers_n;
    /* default false: the upstream's look-up by key alone is tenant-safe, so the sweeper (which has no request to
     * take the scope's parts from) may probe a scoped route, and a scope part the look-up cannot carry is allowed */
    bool keys_unique_upstream;
    /* default 5s: after a lease lapses, nobody probes before the lapse + the upstream's timeout + grace (SPEC 8: the
     * original attempt may still be running at the upstream) */
    uint64_t grace_ms;
};

/* mode: enforce (default) or shadow: forward everything, count what enforce would have done (SPEC 10). */
enum conf_idem_mode { CONF_MODE_ENFORCE = 0, CONF_MODE_SHADOW };

struct conf_idem {
    enum conf_key_mode key; /* default optional */
    char *header;           /* default "Idempotency-Key" */
    /* key_from (SPEC 12): where the key is read (header:, json:, form: or query:); header NULL when not given, the
     * key is then the header above. key_from: header:NAME also sets header to NAME. */
    struct conf_part key_from;
    struct conf_part *scope; /* default none */
    size_t scope_n;
    struct conf_part *fingerprint; /* default method, path, query, body */
    size_t fingerprint_n;
    uint64_t retention_ms;            /* default 24h */
    uint64_t lease_ms;                /* default 60s */
    enum conf_in_flight on_in_flight; /* default conflict */
    uint64_t wait_ms;                 /* default 10s */
    enum conf_on_unknown on_unknown;  /* default reject */
    int *release_statuses;            /* default none */
    size_t release_statuses_n;
    uint64_t max_body;           /* default 1MiB; applies to every request of the route */
    bool forward_key;            /* default true */
    uint64_t max_response;       /* default 8MiB: largest stored/replayed response */
    struct conf_probe probe;     /* with on_unknown: probe */
    enum conf_idem_mode mode;    /* default enforce */
    char *forward_token;         /* header carrying the claim's fence upstream (SPEC 12); NULL: none (default) */
    bool advertise_expiry;       /* default false: Idempotency-Expires on stored answers (SPEC 12) */
    uint64_t prefer_wait_max_ms; /* default 0: a client's Prefer: wait is not honoured (SPEC 12) */
};

/* How the gateway's own error answers on a route are written (SPEC 9, errors:). */
enum conf_errors_kind { CONF_ERRORS_PROBLEM = 0, CONF_ERRORS_STRIPE, CONF_ERRORS_TEMPLATE };
struct conf_errors {
    enum conf_errors_kind kind; /* default problem (RFC 9457 problem+json) */
    char *tmpl;                 /* CONF_ERRORS_TEMPLATE: the text with {status} {name} {title} {detail} */
    char *content_type;         /* CONF_ERRORS_TEMPLATE: default application/json */
};

/* ---- ordering guard (SPEC 6): a per-resource monotonic sequence */
enum conf_seq_source { CONF_SEQ_HEADER = 0, CONF_SEQ_JSON };
enum conf_on_gap { CONF_GAP_ACCEPT = 0, CONF_GAP_REJECT, CONF_GAP_HOLD };
#define CONF_RESOURCE_MAX 1024 /* bytes of an ordering.resource template */
struct conf_ordering {
    bool enabled;                /* an ordering: block was given */
    char *resource;              /* path template, "/v1/accounts/{id}/address" (trailing '/' removed) */
    bool resource_json;          /* resource is a JSON Pointer into the body (json:/POINTER), not a template */
    enum conf_seq_source source; /* header:NAME or json:/pointer */
    char *seq_name;              /* the header name, or the JSON Pointer ("" is the whole body) */
    enum conf_on_gap on_gap;     /* default accept */
    uint64_t hold_ms;            /* default 2s: bounds the gap hold and the in-flight wait */
};

/* ---- verified deliveries (SPEC 12): the sender's signature, checked on the raw body before anything else */
enum conf_verify_scheme { CONF_VERIFY_STRIPE = 0, CONF_VERIFY_STANDARD, CONF_VERIFY_GITHUB, CONF_VERIFY_HMAC };
enum conf_verify_encoding { CONF_VERIFY_HEX = 0, CONF_VERIFY_BASE64 };
#define CONF_VERIFY_SECRETS_MAX 8 /* secrets_env entries: the current one and those being rotated out */
struct conf_verify {
    bool enabled;                   /* a verify: block was given */
    enum conf_verify_scheme scheme; /* required */
    char **secrets_env;             /* names of the environment variables holding the secrets, 1..8 */
    size_t secrets_env_n;
    uint64_t tolerance_ms;              /* stripe, standard-webhooks: default 5m */
    char *header;                       /* hmac: the signature's header (required) */
    enum conf_verify_encoding encoding; /* hmac: default hex */
    char *prefix;                       /* hmac: text before the signature ("sha256="), or NULL */
    /* for the secret loader's errors ("FILE:LINE: routes[i].verify.secrets_env: ..."): the config file (conf.file,
     * not owned) and the line of the secrets_env entry */
    const char *file;
    size_t secrets_line;
};

struct conf_route {
    char *name;
    char *path;        /* exact path, or NULL */
    char *path_prefix; /* whole-segment prefix, or NULL; exactly one is set */
    char *match_key;   /* path or path_prefix in SPEC 7's match form (cm_path_match_form): what requests meet */
    unsigned methods;  /* CONF_M_* bits idempotency applies to; default POST|PATCH */
    size_t upstream;   /* index into conf.upstreams */
    struct conf_idem idem;
    struct conf_errors errors;
    struct conf_ordering ordering;
    bool reads_body; /* a json: or form: part (key_from, scope, fingerprint, ordering): the body is parsed */
    struct conf_verify verify;
};

/* Top-level jwt: how jwt:CLAIM scope parts verify the bearer token (SPEC 9). */
struct conf_jwt {
    bool enabled;       /* a jwt: block was given */
    char *keys_file;    /* JWKS file (RS256, ES256 keys), or NULL */
    char *secret_env;   /* name of the environment variable holding the HS256 secret, or NULL */
    char *issuer;       /* NULL: iss not checked */
    char *audience;     /* NULL: aud not checked */
    uint64_t leeway_ms; /* default 30s, for exp and nbf */
    /* Where the entries were written, for the key loader's errors ("FILE:LINE: jwt.keys: ..."): the config file
     * (conf.file, not owned; NULL when the struct was not loaded by conf) and the lines of the keys: and secret_env:
     * entries (0: not given). */
    const char *file;
    size_t keys_line;
    size_t secret_env_line;
};

enum conf_log_format { CONF_LOG_LOGFMT, CONF_LOG_JSON };

struct conf {
    char *file;                    /* path the config was read from */
    struct conf_addr listen;       /* default 127.0.0.1:8080 */
    struct conf_addr admin_listen; /* default 127.0.0.1:9090 */
    bool admin_enabled;            /* false when admin.listen is "off" */
    uint64_t shutdown_grace_ms;    /* default 10s */
    uint64_t shutdown_delay_ms;    /* default 0s: listeners close at SIGTERM */

    char *postgres_url;                /* required (after env override) */
    uint32_t pool;                     /* default 8, 1..256 */
    char *redis_url;                   /* as written (for logs; passwords redacted there); NULL: no Redis */
    struct conf_redis redis;           /* redis_url parsed once; valid when redis_url != NULL */
    uint64_t redis_timeout_ms;         /* default 50ms */
    enum conf_distributed distributed; /* store.distributed, default none */

    struct conf_upstream *upstreams;
    size_t upstreams_n;
    struct conf_route *routes;
    size_t routes_n;
    bool has_default_upstream;
    size_t default_upstream; /* index, valid when has_default_upstream */

    /* Front limits (top-level keys; extensions to SPEC section 3). */
    uint64_t max_header_bytes; /* default 16KiB -> 431 */
    /* default 16KiB: an upstream head (status line and header lines) larger than this is an invalid answer (502
     * upstream-invalid-response), as nginx refuses "upstream sent too big header" */
    uint64_t max_response_header_bytes;
    uint64_t max_body;          /* default 1MiB, requests no route matches -> 413 */
    uint64_t max_response;      /* default 8MiB, responses of non-idempotent requests */
    uint32_t max_connections;   /* default 4096; beyond: 503 and close */
    uint64_t client_timeout_ms; /* default 30s: idle/slow client connections */
    uint32_t threads;           /* HTTP front threads, default 0 = number of CPUs */
    char *admin_token;          /* from IDEMGATE_ADMIN_TOKEN only, NULL when unset */
    struct conf_jwt jwt;        /* top-level jwt: (SPEC 9) */
    /* replay_cache: completed records kept in memory (gateway/cache.c); either bound 0 (or replay_cache: off):
     * no cache. Defaults 1MiB and 4096 entries. */
    /* limits.buffers (SPEC 7): bytes of request bodies and answers held in memory at once, default 512MiB, at least
     * the largest max_body plus max_response of a route (or of the top level) */
    uint64_t limits_buffers;
    uint64_t replay_cache_max_bytes;
    uint32_t replay_cache_max_entries;
    char *tracing_otlp;              /* tracing.otlp: the collector's URL; NULL: no tracing */
    double tracing_sample;           /* tracing.sample, 0..1, default 0.05 */
    char *request_id_header;         /* SPEC 11: default X-Request-Id */
    char *access_log;                /* SPEC 11: "stderr" (default), "off" or a file path */
    enum conf_log_format log_format; /* logfmt (default) or json: every log line */
    /* SPEC 11 trusted_proxies: peers whose forwarding headers and request id are believed; none by default */
    struct cm_cidr *trusted_proxies;
    size_t trusted_proxies_n;
};

#endif
