/* internal.h - what the files of conf/ share and nothing outside conf/ includes: the parse context (struct ctx),
 * the field table (struct field, FIELD...), the machinery of fields.c, and the tables and handlers one section's
 * file gives another (mostly to the top-level table in conf.c). Never a definition. */
#ifndef IDEMGATE_CONF_INTERNAL_H
#define IDEMGATE_CONF_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <yaml.h>

#include "conf/conf.h"

#define KIB ((uint64_t)1024)
#define MIB (KIB * 1024)
#define GIB (MIB * 1024)

#define SEC  ((uint64_t)1000)
#define MIN  (SEC * 60)
#define HOUR (MIN * 60)
#define DAY  (HOUR * 24)

/* Upper bounds that keep later arithmetic (now + duration, int conversions,
 * Postgres bytea) far from overflow. */
#define DURATION_MAX  (DAY * 36500)
#define SIZE_MAX_BODY GIB
#define CONF_FILE_MAX (4 * MIB)
#define NAME_MAX_LEN  128
#define PATH_BUF      256

/* ---------------------------------------------------------------- context */

/* A reference to an upstream by name, resolved once the whole file is read
 * (routes may come before upstreams). node == 0: the route had no upstream
 * key and takes default_upstream. */
struct upref {
    int node;
    size_t line;
    size_t *target;
    bool *has; /* NULL for routes */
    char path[PATH_BUF];
};

struct ctx {
    const char *file;
    yaml_document_t *doc;
    struct conf *c;
    char *err;
    char path[PATH_BUF];
    size_t plen;
    size_t key_line; /* 1-based line of the key whose value is being parsed */
    struct upref *refs;
    size_t refs_n;
    size_t jwt_part_line; /* first jwt:CLAIM scope part, 0: none */
    char jwt_part_path[PATH_BUF];
};

#define fail(x, node, ...) fail_line((x), node_line(node), __VA_ARGS__)

/* ---------------------------------------------------------------- table-driven mappings */

enum ftype { F_BOOL, F_U32, F_DUR, F_SIZE, F_ENUM, F_FUNC };

typedef bool (*field_fn)(struct ctx *x, yaml_node_t *n, void *target);
struct field;
/* The value of f in base (the struct its table describes) as a default is written in the reference ("[200]",
 * "127.0.0.1:8080"); false: the key has no value (unset). */
typedef bool (*show_fn)(const void *base, const struct field *f, char *buf, size_t n);

/* One key of a mapping. The same entry parses the key and documents it (idemgate --print-reference writes
 * docs/configuration.md from these tables; conf_test checks every entry has a doc and that def is what conf_load
 * gives when the key is absent). A key you add needs .doc, and .def when it has a default. */
struct field {
    const char *key;
    enum ftype type;
    size_t off;
    uint64_t min, max;        /* F_U32, F_DUR (ms), F_SIZE (bytes) */
    const char *const *names; /* F_ENUM: NULL-terminated, index = value */
    field_fn fn;              /* F_FUNC */
    bool required;
    /* the reference */
    const char *doc;         /* what the key does, for a user (Markdown) */
    const char *def;         /* the default as written in YAML; NULL: none (the key is unset) */
    const char *what;        /* F_FUNC: the value's type in words ("string", "list of statuses") */
    const char *allowed;     /* F_FUNC: its allowed values in words, or NULL */
    show_fn show;            /* F_FUNC with a default: its value as def writes it */
    size_t arr_off, n_off;   /* show_parts, show_statuses: the list's pointer and count (LIST_AT) */
    bool restart;            /* a change needs a restart (conf_restart_keys), not a reload */
    bool needed;             /* documented as required, though another source may give it (the environment) */
    const char *example;     /* a value for the key as written in YAML (conf_test loads each in a file) */
    const struct field *sub; /* a mapping's own keys (or a list's element's) */
    size_t nsub;
    size_t sub_off; /* base + sub_off is the struct sub describes (a list: the pointer to its array) */
    bool sub_list;  /* sub describes each element of a list */
};

/* The trailing arguments are designated initialisers of the reference: .doc = "...", .def = "30s", ... */
#define FIELD(k, t, s, m, lo, hi, ...)                                                                                 \
    {                                                                                                                  \
        .key = k, .type = t, .off = offsetof(s, m), .min = lo, .max = hi, __VA_ARGS__                                  \
    }
#define FIELD_ENUM(k, s, m, n, ...)                                                                                    \
    {                                                                                                                  \
        .key = k, .type = F_ENUM, .off = offsetof(s, m), .names = n, __VA_ARGS__                                       \
    }
#define FIELD_FN(k, s, m, f, req, ...)                                                                                 \
    {                                                                                                                  \
        .key = k, .type = F_FUNC, .off = offsetof(s, m), .fn = f, .required = req, __VA_ARGS__                         \
    }
#define FIELD_BASE(k, f, req, ...)                                                                                     \
    {                                                                                                                  \
        .key = k, .type = F_FUNC, .off = 0, .fn = f, .required = req, __VA_ARGS__                                      \
    }
#define NFIELDS(a) (sizeof(a) / sizeof((a)[0]))
/* A mapping's keys: table t describes the struct at base + o; SUB_LIST: the array whose pointer is at base + o. */
#define SUB(t, o)      .sub = t, .nsub = NFIELDS(t), .sub_off = o
#define SUB_LIST(t, o) SUB(t, o), .sub_list = true
/* Where show_parts and show_statuses find a list of struct s: its pointer a and its count n. */
#define LIST_AT(s, a, n) .arr_off = offsetof(s, a), .n_off = offsetof(s, n)
/* Where show_str finds the string of a FIELD_BASE key: member m of struct s. */
#define STR_AT(s, m) .arr_off = offsetof(s, m)

_Static_assert(sizeof(enum conf_key_mode) == sizeof(int), "enum stored through int");
_Static_assert(sizeof(enum conf_in_flight) == sizeof(int), "enum stored through int");
_Static_assert(sizeof(enum conf_on_unknown) == sizeof(int), "enum stored through int");
_Static_assert(sizeof(enum conf_idem_mode) == sizeof(int), "enum stored through int");
_Static_assert(sizeof(enum conf_distributed) == sizeof(int), "enum stored through int");

/* What one file of conf/ gives another. A table's size is written here so that another file's table can take
 * its keys (SUB); the compiler checks it against the definition: a key added to a table adds one here. */

/* fields.c */
size_t node_line(const yaml_node_t *n);
size_t path_push(struct ctx *x, const char *fmt, ...) CM_PRINTF(2, 3);
size_t path_push_key(struct ctx *x, const char *key);
void path_pop(struct ctx *x, size_t old);
bool fail_line(struct ctx *x, size_t line, const char *fmt, ...) CM_PRINTF(3, 4);
const char *shown(char out[80], const char *value);
bool is_null(const yaml_node_t *n);
const char *scalar(struct ctx *x, const yaml_node_t *n, const char *what);
bool expect_type(struct ctx *x, const yaml_node_t *n, yaml_node_type_t t);
bool is_token(const char *s);
/* A JSON Pointer (RFC 6901) of at most 1024 bytes: "" or '/'-separated tokens where '~' is only ~0 or ~1. */
bool json_pointer_ok(const char *p, size_t len);
bool parse_port(const char *s, size_t n, bool allow_zero, uint16_t *port);
const char *split_hostport(const char *s, size_t n, const char **host, size_t *hostn, const char **port_s,
                           size_t *port_n);
const char *fmt_size(char out[32], uint64_t v);
const char *fmt_dur(char out[32], uint64_t v);
const char *fmt_int(char out[32], uint64_t v);
bool set_u32(struct ctx *x, yaml_node_t *n, const struct field *f, uint32_t *out);
bool parse_map(struct ctx *x, yaml_node_t *n, const struct field *fields, size_t nfields, void *base);
const void *at(const void *base, const struct field *f);
bool show_str(const void *base, const struct field *f, char *buf, size_t n);
void show_list(char *buf, size_t n, size_t items, const void *arr,
               void (*item)(const void *arr, size_t i, char *out, size_t on));
const void *list_at(const void *base, const struct field *f, size_t *n);
bool show_statuses(const void *base, const struct field *f, char *buf, size_t n);
bool set_unique_name(struct ctx *x, yaml_node_t *n, char **out, const char *what,
                     bool (*taken)(const struct conf *, const char *));
size_t find_line(struct ctx *x, yaml_node_t *map, const char *key, yaml_node_t **value);
/* An environment variable's name (jwt.secret_env, verify.secrets_env): the heap copy, or NULL (error recorded). */
char *env_name(struct ctx *x, yaml_node_t *n);

/* process.c */
bool show_addr(const void *base, const struct field *f, char *buf, size_t n);
bool fn_listen(struct ctx *x, yaml_node_t *n, void *target);
bool fn_pem_path(struct ctx *x, yaml_node_t *n, void *target);
extern const struct field admin_fields[1];
bool fn_admin(struct ctx *x, yaml_node_t *n, void *target);
extern const struct field store_fields[5];
bool fn_store(struct ctx *x, yaml_node_t *n, void *target);
extern const struct field jwt_fields[5];
bool fn_jwt(struct ctx *x, yaml_node_t *n, void *target);
extern const struct field replay_cache_fields[2];
extern const struct field limits_fields[1];
bool fn_limits(struct ctx *x, yaml_node_t *n, void *target);
bool fn_replay_cache(struct ctx *x, yaml_node_t *n, void *target);
extern const struct field tracing_fields[2];
bool fn_tracing(struct ctx *x, yaml_node_t *n, void *target);
bool apply_env(struct ctx *x, yaml_node_t *root);

/* upstreams.c */
extern const struct field upstream_fields[7];
bool fn_upstreams(struct ctx *x, yaml_node_t *n, void *target);
void add_ref(struct ctx *x, int node, size_t line, size_t *target, bool *has);
bool fn_route_upstream(struct ctx *x, yaml_node_t *n, void *target);
bool fn_default_upstream(struct ctx *x, yaml_node_t *n, void *target);
bool resolve_refs(struct ctx *x);

/* routes.c */
void ordering_free(struct conf_ordering *o);
void verify_free(struct conf_verify *v);
extern const struct field route_fields[7];
bool fn_routes(struct ctx *x, yaml_node_t *n, void *target);

/* idempotency.c */
void idem_free(struct conf_idem *d);
extern const struct field idem_fields[19];
bool fn_idem(struct ctx *x, yaml_node_t *n, void *target);
void idem_defaults(struct conf_idem *d);
/* Whether any part of route r reads the body (conf_route.reads_body): a json: or form: part anywhere. */
bool route_reads_body(const struct conf_route *r);
/* A header name (an HTTP token) into the char * at target (replaced): the key header, forward_token, the top-level
 * request_id_header. */
bool fn_key_header(struct ctx *x, yaml_node_t *n, void *target);

/* check.c */
bool check_addresses(struct ctx *x, yaml_node_t *root);
bool check_buffers(struct ctx *x, yaml_node_t *root);
bool check_route_spellings(struct ctx *x, yaml_node_t *root);

#endif
