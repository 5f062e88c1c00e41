/* check.c - the checks across the whole file once every key is parsed: listen and admin addresses apart,
 * limits.buffers against the largest request, routes that meet only by spelling. Never parses a key. */
#include "conf/internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "common/uri.h"

bool conf_i_check_addresses(struct conf_i_ctx *x, yaml_node_t *root)
{
    struct conf *c = x->c;
    if (c->admin_enabled && c->listen.port != 0 && c->listen.port == c->admin_listen.port &&
        strcmp(c->listen.host, c->admin_listen.host) == 0) {
        yaml_node_t *admin = NULL;
        size_t line = conf_i_find_line(x, root, "admin", &admin);
        size_t l2 = conf_i_find_line(x, admin, "listen", NULL);
        conf_i_path_pop(x, 0);
        conf_i_path_push(x, "admin.listen");
        return conf_i_fail_line(x, l2 ? l2 : (line ? line : conf_i_node_line(root)), "same address as listen (%s:%u)",
                                c->listen.host, c->listen.port);
    }
    return true;
}

/* SPEC 7: limits.buffers holds at least one request of the largest kind, its body and the answer it may store. */
bool conf_i_check_buffers(struct conf_i_ctx *x, yaml_node_t *root)
{
    const struct conf *c = x->c;
    uint64_t need = c->max_body + c->max_response;
    const char *what = "the top level";
    for (size_t i = 0; i < c->routes_n; i++) {
        const struct conf_idem *im = &c->routes[i].idem;
        if (im->max_body + im->max_response > need) {
            need = im->max_body + im->max_response;
            what = c->routes[i].name ? c->routes[i].name : "a route";
        }
    }
    if (c->limits_buffers >= need)
        return true;
    yaml_node_t *limits = NULL, *buffers = NULL, *routes = NULL;
    size_t line = conf_i_find_line(x, root, "limits", &limits);
    size_t bline = conf_i_find_line(x, limits, "buffers", &buffers);
    if (!line) { /* the default is too small: point at what made it so */
        size_t rl = conf_i_find_line(x, root, "routes", &routes), mr = conf_i_find_line(x, root, "max_response", NULL);
        line = mr ? mr : conf_i_find_line(x, root, "max_body", NULL);
        for (size_t i = 0; i < c->routes_n && routes && routes->type == YAML_SEQUENCE_NODE; i++)
            if (c->routes[i].name && strcmp(c->routes[i].name, what) == 0 &&
                routes->data.sequence.items.start + i < routes->data.sequence.items.top)
                line = conf_i_node_line(yaml_document_get_node(x->doc, routes->data.sequence.items.start[i]));
        line = line ? line : rl;
    }
    snprintf(x->path, sizeof x->path, "limits.buffers");
    x->plen = strlen(x->path);
    return conf_i_fail_line(x,
                            bline  ? bline
                            : line ? line
                                   : conf_i_node_line(root),
                            "%" PRIu64 " bytes is less than max_body plus max_response of %s (%" PRIu64
                            " bytes): one such request could never be served",
                            c->limits_buffers, what, need);
}

/* ---- routes that meet only under SPEC 7's spelling rule */

static bool parts_same(const struct conf_part *a, size_t an, const struct conf_part *b, size_t bn)
{
    if (an != bn)
        return false;
    for (size_t i = 0; i < an; i++)
        if (a[i].kind != b[i].kind || (a[i].header == NULL) != (b[i].header == NULL) ||
            (a[i].header && (a[i].kind == CONF_PART_HEADER ? strcasecmp(a[i].header, b[i].header)
                                                           : strcmp(a[i].header, b[i].header)) != 0))
            return false;
    return true;
}

static bool str_same(const char *a, const char *b)
{
    return a == b || (a && b && strcmp(a, b) == 0);
}

/* What a request gets on a route, apart from its name and path: where it goes and the rules that apply. */
static bool route_policy_same(const struct conf_route *a, const struct conf_route *b)
{
    const struct conf_idem *x = &a->idem, *y = &b->idem;
    const struct conf_ordering *o = &a->ordering, *p = &b->ordering;
    return a->upstream == b->upstream && a->methods == b->methods && x->key == y->key && x->mode == y->mode &&
           (x->header == y->header || (x->header && y->header && strcasecmp(x->header, y->header) == 0)) &&
           parts_same(x->scope, x->scope_n, y->scope, y->scope_n) && parts_same(&x->key_from, 1, &y->key_from, 1) &&
           parts_same(x->fingerprint, x->fingerprint_n, y->fingerprint, y->fingerprint_n) &&
           x->retention_ms == y->retention_ms && x->lease_ms == y->lease_ms && x->on_in_flight == y->on_in_flight &&
           x->wait_ms == y->wait_ms && x->on_unknown == y->on_unknown && x->max_body == y->max_body &&
           x->forward_key == y->forward_key && x->max_response == y->max_response &&
           str_same(x->forward_token, y->forward_token) && x->advertise_expiry == y->advertise_expiry &&
           x->prefer_wait_max_ms == y->prefer_wait_max_ms && x->release_statuses_n == y->release_statuses_n &&
           (x->release_statuses_n == 0 ||
            memcmp(x->release_statuses, y->release_statuses, x->release_statuses_n * sizeof(int)) == 0) &&
           x->probe.enabled == y->probe.enabled && str_same(x->probe.path, y->probe.path) &&
           str_same(x->probe.method, y->probe.method) && a->errors.kind == b->errors.kind &&
           str_same(a->errors.tmpl, b->errors.tmpl) && o->enabled == p->enabled && str_same(o->resource, p->resource) &&
           o->resource_json == p->resource_json && o->source == p->source && str_same(o->seq_name, p->seq_name) &&
           o->on_gap == p->on_gap && o->hold_ms == p->hold_ms;
}

/* Route a meets route b's path as written, by the byte-exact rule routes had before SPEC 7's spelling rule. */
static bool route_meets_literally(const struct conf_route *a, const struct conf_route *b)
{
    const char *bp = b->path ? b->path : b->path_prefix;
    if (a->path)
        return strcmp(a->path, bp) == 0;
    size_t n = strlen(a->path_prefix);
    return strcmp(a->path_prefix, "/") == 0 || (strncmp(bp, a->path_prefix, n) == 0 && (bp[n] == '\0' || bp[n] == '/'));
}

/* SPEC 7: two routes that meet only because case, segment parameters or a format suffix do not count (a request
 * path would match both) must have the same policy, else the first one in the list would decide by spelling
 * alone. Routes that nest as written ("/v1" before "/v1/payments") are the usual most-specific-first list. */
bool conf_i_check_route_spellings(struct conf_i_ctx *x, yaml_node_t *root)
{
    const struct conf *c = x->c;
    yaml_node_t *routes = NULL;
    conf_i_find_line(x, root, "routes", &routes);
    for (size_t j = 0; j < c->routes_n; j++) {
        const struct conf_route *b = &c->routes[j];
        for (size_t i = 0; i < j; i++) {
            const struct conf_route *a = &c->routes[i];
            if (!a->match_key || !b->match_key)
                continue;
            bool meet = cm_path_meets(a->match_key, b->match_key, a->path == NULL) ||
                        cm_path_meets(b->match_key, a->match_key, b->path == NULL);
            bool literal = route_meets_literally(a, b) || route_meets_literally(b, a);
            if (!meet || literal || route_policy_same(a, b))
                continue;
            size_t line = 0;
            if (routes && routes->type == YAML_SEQUENCE_NODE &&
                routes->data.sequence.items.start + j < routes->data.sequence.items.top)
                line = conf_i_node_line(yaml_document_get_node(x->doc, routes->data.sequence.items.start[j]));
            snprintf(x->path, sizeof x->path, "routes[%zu].match", j);
            x->plen = strlen(x->path);
            return conf_i_fail_line(
                x, line ? line : conf_i_node_line(root),
                "route '%s' and route '%s' meet when case, ';' parameters and a format suffix (.json) "
                "are ignored, as requests are routed, but their policies differ: give them the same "
                "policy or paths that do not meet",
                b->name ? b->name : "?", a->name ? a->name : "?");
        }
    }
    return true;
}
