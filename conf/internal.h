/* internal.h - what the files of conf/ share and nothing outside conf/ includes: the parse context (struct conf_i_ctx),
 * the field table (struct conf_i_field, CONF_FIELD...), the machinery of fields.c, and the tables and handlers one
 * section's file gives another (mostly to the top-level table in conf.c). Never a definition. */
#ifndef IDEMGATE_CONF_INTERNAL_H
#define IDEMGATE_CONF_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <yaml.h>

#include "conf/conf.h"

#define CONF_KIB ((uint64_t)1024)
#define CONF_MIB (CONF_KIB * 1024)
#define CONF_GIB (CONF_MIB * 1024)

#define CONF_SEC  ((uint64_t)1000)
#define CONF_MIN  (CONF_SEC * 60)
#define CONF_HOUR (CONF_MIN * 60)
#define CONF_DAY  (CONF_HOUR * 24)

/* Upper bounds that keep later arithmetic (now + duration, int conversions,
 * Postgres bytea) far from overflow. */
#define CONF_DURATION_MAX  (CONF_DAY * 36500)
#define CONF_SIZE_MAX_BODY CONF_GIB
#define CONF_FILE_MAX      (4 * CONF_MIB)
#define CONF_NAME_MAX_LEN  128
#define CONF_PATH_BUF      256

/* ---------------------------------------------------------------- context */

/* A reference to an upstream by name, resolved once the whole file is read
 * (routes may come before upstreams). node == 0: the route had no upstream
 * key and takes default_upstream. */
struct conf_i_upref {
    int node;
    size_t line;
    size_t *target;
    bool *has; /* NULL for routes */
    char path[CONF_PATH_BUF];
};

struct conf_i_ctx {
    const char *file;
    yaml_document_t *doc;
    struct conf *c;
    char *err;
    char path[CONF_PATH_BUF];
    size_t plen;
    size_t key_line; /* 1-based line of the key whose value is being parsed */
    struct conf_i_upref *refs;
    size_t refs_n;
    size_t jwt_part_line; /* first jwt:CLAIM scope part, 0: none */
    char jwt_part_path[CONF_PATH_BUF];
};

#define conf_i_fail(x, node, ...) conf_i_fail_line((x), conf_i_node_line(node), __VA_ARGS__)

/* ---------------------------------------------------------------- table-driven mappings */

enum conf_i_ftype { CONF_F_BOOL, CONF_F_U32, CONF_F_DUR, CONF_F_SIZE, CONF_F_ENUM, CONF_F_FUNC };

typedef bool (*conf_i_field_fn)(struct conf_i_ctx *x, yaml_node_t *n, void *target);
struct conf_i_field;
/* The value of f in base (the struct its table describes) as a default is written in the reference ("[200]",
 * "127.0.0.1:8080"); false: the key has no value (unset). */
typedef bool (*conf_i_show_fn)(const void *base, const struct conf_i_field *f, char *buf, size_t n);

/* One key of a mapping. The same entry parses the key and documents it (idemgate --print-reference writes
 * docs/configuration.md from these tables; conf_test checks every entry has a doc and that def is what conf_load
 * gives when the key is absent). A key you add needs .doc, and .def when it has a default. */
struct conf_i_field {
    const char *key;
    enum conf_i_ftype type;
    size_t off;
    uint64_t min, max;        /* CONF_F_U32, CONF_F_DUR (ms), CONF_F_SIZE (bytes) */
    const char *const *names; /* CONF_F_ENUM: NULL-terminated, index = value */
    conf_i_field_fn fn;       /* CONF_F_FUNC */
    bool required;
    /* the reference */
    const char *doc;                /* what the key does, for a user (Markdown) */
    const char *def;                /* the default as written in YAML; NULL: none (the key is unset) */
    const char *what;               /* CONF_F_FUNC: the value's type in words ("string", "list of statuses") */
    const char *allowed;            /* CONF_F_FUNC: its allowed values in words, or NULL */
    conf_i_show_fn show;            /* CONF_F_FUNC with a default: its value as def writes it */
    size_t arr_off, n_off;          /* show_parts, conf_i_show_statuses: the list's pointer and count (CONF_LIST_AT) */
    bool restart;                   /* a change needs a restart (conf_restart_keys), not a reload */
    bool needed;                    /* documented as required, though another source may give it (the environment) */
    const char *example;            /* a value for the key as written in YAML (conf_test loads each in a file) */
    const struct conf_i_field *sub; /* a mapping's own keys (or a list's element's) */
    size_t nsub;
    size_t sub_off; /* base + sub_off is the struct sub describes (a list: the pointer to its array) */
    bool sub_list;  /* sub describes each element of a list */
};

/* The trailing arguments are designated initialisers of the reference: .doc = "...", .def = "30s", ... */
#define CONF_FIELD(k, t, s, m, lo, hi, ...)                                                                            \
    {                                                                                                                  \
        .key = k, .type = t, .off = offsetof(s, m), .min = lo, .max = hi, __VA_ARGS__                                  \
    }
#define CONF_FIELD_ENUM(k, s, m, n, ...)                                                                               \
    {                                                                                                                  \
        .key = k, .type = CONF_F_ENUM, .off = offsetof(s, m), .names = n, __VA_ARGS__                                  \
    }
#define CONF_FIELD_FN(k, s, m, f, req, ...)                                                                            \
    {                                                                                                                  \
        .key = k, .type = CONF_F_FUNC, .off = offsetof(s, m), .fn = f, .required = req, __VA_ARGS__                    \
    }
#define CONF_FIELD_BASE(k, f, req, ...)                                                                                \
    {                                                                                                                  \
        .key = k, .type = CONF_F_FUNC, .off = 0, .fn = f, .required = req, __VA_ARGS__                                 \
    }
#define CONF_NFIELDS(a) (sizeof(a) / sizeof((a)[0]))
/* A mapping's keys: table t describes the struct at base + o; CONF_SUB_LIST: the array whose pointer is at base + o. */
#define CONF_SUB(t, o)      .sub = t, .nsub = CONF_NFIELDS(t), .sub_off = o
#define CONF_SUB_LIST(t, o) CONF_SUB(t, o), .sub_list = true
/* Where show_parts and conf_i_show_statuses find a list of struct s: its pointer a and its count n. */
#define CONF_LIST_AT(s, a, n) .arr_off = offsetof(s, a), .n_off = offsetof(s, n)
/* Where conf_i_show_str finds the string of a CONF_FIELD_BASE key: member m of struct s. */
#define CONF_STR_AT(s, m) .arr_off = offsetof(s, m)

_Static_assert(sizeof(enum conf_key_mode) == sizeof(int), "enum stored through int");
_Static_assert(sizeof(enum conf_in_flight) == sizeof(int), "enum stored through int");
_Static_assert(sizeof(enum conf_on_unknown) == sizeof(int), "enum stored through int");
_Static_assert(sizeof(enum conf_idem_mode) == sizeof(int), "enum stored through int");
_Static_assert(sizeof(enum conf_distributed) == sizeof(int), "enum stored through int");

/* What one file of conf/ gives another. A table's size is written here so that another file's table can take
 * its keys (SUB); the compiler checks it against the definition: a key added to a table adds one here. */

/* fields.c */
size_t conf_i_node_line(const yaml_node_t *n);
size_t conf_i_path_push(struct conf_i_ctx *x, const char *fmt, ...) CM_PRINTF(2, 3);
size_t conf_i_path_push_key(struct conf_i_ctx *x, const char *key);
void conf_i_path_pop(struct conf_i_ctx *x, size_t old);
bool conf_i_fail_line(struct conf_i_ctx *x, size_t line, const char *fmt, ...) CM_PRINTF(3, 4);
const char *conf_i_shown(char out[80], const char *value);
bool conf_i_is_null(const yaml_node_t *n);
const char *conf_i_scalar(struct conf_i_ctx *x, const yaml_node_t *n, const char *what);
bool conf_i_expect_type(struct conf_i_ctx *x, const yaml_node_t *n, yaml_node_type_t t);
bool conf_i_is_token(const char *s);
/* A JSON Pointer (RFC 6901) of at most 1024 bytes: "" or '/'-separated tokens where '~' is only ~0 or ~1. */
bool conf_i_json_pointer_ok(const char *p, size_t len);
bool conf_i_parse_port(const char *s, size_t n, bool allow_zero, uint16_t *port);
const char *conf_i_split_hostport(const char *s, size_t n, const char **host, size_t *hostn, const char **port_s,
                                  size_t *port_n);
const char *conf_i_fmt_size(char out[32], uint64_t v);
const char *conf_i_fmt_dur(char out[32], uint64_t v);
const char *conf_i_fmt_int(char out[32], uint64_t v);
bool conf_i_set_u32(struct conf_i_ctx *x, yaml_node_t *n, const struct conf_i_field *f, uint32_t *out);
bool conf_i_parse_map(struct conf_i_ctx *x, yaml_node_t *n, const struct conf_i_field *fields, size_t nfields,
                      void *base);
const void *conf_i_at(const void *base, const struct conf_i_field *f);
bool conf_i_show_str(const void *base, const struct conf_i_field *f, char *buf, size_t n);
void conf_i_show_list(char *buf, size_t n, size_t items, const void *arr,
                      void (*item)(const void *arr, size_t i, char *out, size_t on));
const void *conf_i_list_at(const void *base, const struct conf_i_field *f, size_t *n);
bool conf_i_show_statuses(const void *base, const struct conf_i_field *f, char *buf, size_t n);
bool conf_i_set_unique_name(struct conf_i_ctx *x, yaml_node_t *n, char **out, const char *what,
                            bool (*taken)(const struct conf *, const char *));
size_t conf_i_find_line(struct conf_i_ctx *x, yaml_node_t *map, const char *key, yaml_node_t **value);
/* An environment variable's name (jwt.secret_env, verify.secrets_env): the heap copy, or NULL (error recorded). */
char *conf_i_env_name(struct conf_i_ctx *x, yaml_node_t *n);

/* process.c */
bool conf_i_show_addr(const void *base, const struct conf_i_field *f, char *buf, size_t n);
bool conf_i_fn_listen(struct conf_i_ctx *x, yaml_node_t *n, void *target);
bool conf_i_fn_pem_path(struct conf_i_ctx *x, yaml_node_t *n, void *target);
extern const struct conf_i_field conf_i_admin_fields[1];
bool conf_i_fn_admin(struct conf_i_ctx *x, yaml_node_t *n, void *target);
extern const struct conf_i_field conf_i_store_fields[5];
bool conf_i_fn_store(struct conf_i_ctx *x, yaml_node_t *n, void *target);
extern const struct conf_i_field conf_i_jwt_fields[5];
bool conf_i_fn_jwt(struct conf_i_ctx *x, yaml_node_t *n, void *target);
extern const struct conf_i_field conf_i_replay_cache_fields[2];
extern const struct conf_i_field conf_i_limits_fields[1];
bool conf_i_fn_limits(struct conf_i_ctx *x, yaml_node_t *n, void *target);
bool conf_i_fn_replay_cache(struct conf_i_ctx *x, yaml_node_t *n, void *target);
extern const struct conf_i_field conf_i_tracing_fields[2];
bool conf_i_fn_tracing(struct conf_i_ctx *x, yaml_node_t *n, void *target);
bool conf_i_apply_env(struct conf_i_ctx *x, yaml_node_t *root);

/* upstreams.c */
extern const struct conf_i_field conf_i_upstream_fields[7];
bool conf_i_fn_upstreams(struct conf_i_ctx *x, yaml_node_t *n, void *target);
void conf_i_add_ref(struct conf_i_ctx *x, int node, size_t line, size_t *target, bool *has);
bool conf_i_fn_route_upstream(struct conf_i_ctx *x, yaml_node_t *n, void *target);
bool conf_i_fn_default_upstream(struct conf_i_ctx *x, yaml_node_t *n, void *target);
bool conf_i_resolve_refs(struct conf_i_ctx *x);

/* routes.c */
void conf_i_ordering_free(struct conf_ordering *o);
void conf_i_verify_free(struct conf_verify *v);
extern const struct conf_i_field conf_i_route_fields[7];
bool conf_i_fn_routes(struct conf_i_ctx *x, yaml_node_t *n, void *target);

/* idempotency.c */
void conf_i_idem_free(struct conf_idem *d);
extern const struct conf_i_field conf_i_idem_fields[19];
bool conf_i_fn_idem(struct conf_i_ctx *x, yaml_node_t *n, void *target);
void conf_i_idem_defaults(struct conf_idem *d);
/* Whether any part of route r reads the body (conf_route.reads_body): a json: or form: part anywhere. */
bool conf_i_route_reads_body(const struct conf_route *r);
/* A header name (an HTTP token) into the char * at target (replaced): the key header, forward_token, the top-level
 * request_id_header. */
bool conf_i_fn_key_header(struct conf_i_ctx *x, yaml_node_t *n, void *target);

/* check.c */
bool conf_i_check_addresses(struct conf_i_ctx *x, yaml_node_t *root);
bool conf_i_check_buffers(struct conf_i_ctx *x, yaml_node_t *root);
bool conf_i_check_route_spellings(struct conf_i_ctx *x, yaml_node_t *root);

#endif
