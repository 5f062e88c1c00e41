/* upstreams.c - the upstreams: section (names, URLs, timeouts) and the references to an upstream by name from
 * routes and default_upstream, resolved once the whole file is read. Never a route's own rules. */
#include "conf/internal.h"

#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

/* ---- upstreams */

static bool upstream_name_taken(const struct conf *c, const char *s)
{
    for (size_t i = 0; i < c->upstreams_n; i++)
        if (c->upstreams[i].name != NULL && strcmp(c->upstreams[i].name, s) == 0)
            return true;
    return false;
}

static bool fn_upstream_name(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    return conf_i_set_unique_name(x, n, target, "upstream", upstream_name_taken);
}

static bool fn_upstream_url(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_upstream *u = target;
    const char *s = conf_i_scalar(x, n, "an http:// URL");
    if (s == NULL)
        return false;
    size_t skip;
    if (strncasecmp(s, "http://", 7) == 0)
        skip = 7;
    else if (strncasecmp(s, "https://", 8) == 0)
        skip = 8;
    else
        return conf_i_fail(x, n, "must start with http:// or https://");
    const char *a = s + skip;
    for (const char *p = s; *p; p++)
        if ((unsigned char)*p <= 0x20 || *p == 0x7f)
            return conf_i_fail(x, n, "must not contain spaces or control characters");
    if (strpbrk(a, "?#") != NULL)
        return conf_i_fail(x, n, "must not have a query or fragment");
    size_t alen = strcspn(a, "/");
    if (memchr(a, '@', alen) != NULL)
        return conf_i_fail(x, n, "user info (user@host) is not supported");
    const char *host, *port_s;
    size_t hostn, port_n;
    const char *why = conf_i_split_hostport(a, alen, &host, &hostn, &port_s, &port_n);
    if (why != NULL)
        return conf_i_fail(x, n, "invalid URL: %s", why);
    uint16_t port = skip == 8 ? 443 : 80;
    if (port_s != NULL && !conf_i_parse_port(port_s, port_n, false, &port))
        return conf_i_fail(x, n, "invalid URL: port must be between 1 and 65535");
    char hostbuf[256];
    if (hostn >= sizeof hostbuf)
        return conf_i_fail(x, n, "invalid URL: host name too long");
    memcpy(hostbuf, host, hostn);
    hostbuf[hostn] = '\0';
    unsigned char addr[16];
    bool v6 = a[0] == '[';
    bool ip = inet_pton(v6 ? AF_INET6 : AF_INET, hostbuf, addr) == 1;
    if (v6 && !ip)
        return conf_i_fail(x, n, "invalid URL: invalid IPv6 address between [ ]");
    size_t len = strlen(s);
    while (len > skip + alen && s[len - 1] == '/')
        len--;
    free(u->url);
    free(u->base_path);
    free(u->host);
    u->url = cm_strndup(s, len);
    u->base_path = cm_strndup(s + skip + alen, len - skip - alen);
    u->https = skip == 8;
    u->host = cm_strdup(hostbuf);
    u->port = port;
    u->host_is_ip = ip;
    return true;
}

/* ---- an upstream's tls: {ca, cert, key, verify, server_name} */

static bool fn_tls_server_name(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    char **out = target;
    const char *s = conf_i_scalar(x, n, "a host name");
    if (s == NULL)
        return false;
    size_t len = strlen(s);
    if (len == 0 || len > 253 || strspn(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-") != len)
        return conf_i_fail(x, n, "must be a DNS host name (letters, digits, '.', '-')");
    free(*out);
    *out = cm_strdup(s);
    return true;
}

static const struct conf_i_field upstream_tls_fields[] = {
    CONF_FIELD_FN("ca", struct conf_upstream_tls, ca, conf_i_fn_pem_path, false, .what = "path",
                  .doc = "The PEM CA bundle the upstream's certificate is verified with, instead of the system's.",
                  .example = "/etc/idemgate/upstream-ca.pem"),
    CONF_FIELD_FN("cert", struct conf_upstream_tls, cert, conf_i_fn_pem_path, false, .what = "path",
                  .doc = "A PEM client certificate sent to an upstream that asks for one (with `key`).",
                  .example = "/etc/idemgate/client.crt"),
    CONF_FIELD_FN("key", struct conf_upstream_tls, key, conf_i_fn_pem_path, false, .what = "path",
                  .doc = "The client certificate's PEM private key (unencrypted).",
                  .example = "/etc/idemgate/client.key"),
    CONF_FIELD("verify", CONF_F_BOOL, struct conf_upstream_tls, verify, 0, 1, .def = "true",
               .doc = "Verify the upstream's certificate chain and name. `false` only for a test bench: anyone on the "
                      "path can then read and answer the requests.",
               .example = "false"),
    CONF_FIELD_FN("server_name", struct conf_upstream_tls, server_name, fn_tls_server_name, false, .what = "host name",
                  .doc = "The name sent as SNI and verified in the upstream's certificate, while the connection still "
                         "goes to the URL's address (`Host` stays the URL's). Unset: the URL's host.",
                  .example = "api.internal"),
};

static bool fn_upstream_tls(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf_upstream_tls *t = target;
    if (n->type != YAML_MAPPING_NODE)
        return conf_i_fail(x, n, "must be a mapping {ca, cert, key, verify, server_name}");
    t->set = true;
    if (!conf_i_parse_map(x, n, upstream_tls_fields, CONF_NFIELDS(upstream_tls_fields), t))
        return false;
    if ((t->cert == NULL) != (t->key == NULL))
        return conf_i_fail(x, n, "cert and key go together");
    return true;
}

const struct conf_i_field conf_i_upstream_fields[] = {
    CONF_FIELD_FN("name", struct conf_upstream, name, fn_upstream_name, true, .what = "string",
                  .allowed = "1 to 128 of `A-Z a-z 0-9 _ . -`, unique",
                  .doc = "The name routes and `default_upstream` use.", .example = "payments-api"),
    CONF_FIELD_BASE("url", fn_upstream_url, true, .what = "URL",
                    .allowed = "`http://` or `https://`, a host, an optional port and base path; no user info, query "
                               "or fragment",
                    .doc = "Where requests go. Parsed once at load: a request only appends its path and query to the "
                           "base path, so no request can name another host. `http://` to an IP address uses the "
                           "built-in HTTP/1.1 client; `https://` and host names use libcurl.",
                    .example = "https://payments.internal:8443/base"),
    CONF_FIELD("connect_timeout", CONF_F_DUR, struct conf_upstream, connect_timeout_ms, 1, CONF_DURATION_MAX,
               .def = "2s",
               .doc = "How long a new connection to the upstream may take. A request that could not connect was not "
                      "sent: 502 `upstream-unavailable`, its key released.",
               .example = "500ms"),
    CONF_FIELD("timeout", CONF_F_DUR, struct conf_upstream, timeout_ms, 1, CONF_DURATION_MAX, .def = "30s",
               .doc = "How long a whole request may take, waiting for a connection included. A timeout after the "
                      "request was sent is an unknown outcome: 504 `upstream-timeout`, the key's record kept.",
               .example = "10s"),
    CONF_FIELD("max_connections", CONF_F_U32, struct conf_upstream, max_connections, 1, 100000, .def = "1024",
               .doc = "Connections to this upstream at most, over the whole process (each I/O loop holds its share, "
                      "rounded up). Beyond it requests wait in a first-in first-out queue within their `timeout`.",
               .example = "256"),
    CONF_FIELD("keepalive_timeout", CONF_F_DUR, struct conf_upstream, keepalive_timeout_ms, 1, 3600 * CONF_SEC,
               .def = "60s",
               .doc = "An idle upstream connection is reused for at most this long (and, with the built-in client, "
                      "for less than the upstream announces in `Keep-Alive: timeout=N`). Keep it below the "
                      "upstream's own idle timeout when that one is short and not announced.",
               .example = "2s"),
    CONF_FIELD_FN("tls", struct conf_upstream, tls, fn_upstream_tls, false, .what = "mapping",
                  CONF_SUB(upstream_tls_fields, offsetof(struct conf_upstream, tls)),
                  .doc = "TLS to an `https://` upstream (through libcurl): the CA to verify it with, a client "
                         "certificate, verification, the server name. An `http://` upstream with `tls` is an error."),
};

bool conf_i_fn_upstreams(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf *c = target;
    if (!conf_i_expect_type(x, n, YAML_SEQUENCE_NODE))
        return false;
    size_t cnt = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    if (cnt == 0)
        return conf_i_fail(x, n, "must list at least one upstream");
    c->upstreams = cm_calloc(cnt, sizeof(*c->upstreams));
    for (size_t i = 0; i < cnt; i++) {
        yaml_node_t *item = yaml_document_get_node(x->doc, n->data.sequence.items.start[i]);
        struct conf_upstream *u = &c->upstreams[i];
        u->connect_timeout_ms = 2 * CONF_SEC;
        u->timeout_ms = 30 * CONF_SEC;
        u->max_connections = 1024;
        u->keepalive_timeout_ms = 60 * CONF_SEC;
        u->tls.verify = true;
        size_t old = conf_i_path_push(x, "[%zu]", i);
        x->key_line = 0;
        /* counted before parsing so that a half-built entry is freed */
        c->upstreams_n = i + 1;
        if (item == NULL || !conf_i_parse_map(x, item, conf_i_upstream_fields, CONF_NFIELDS(conf_i_upstream_fields), u))
            return false;
        if (u->tls.set && !u->https) {
            yaml_node_t *tn = NULL;
            size_t line = conf_i_find_line(x, item, "tls", &tn);
            conf_i_path_push_key(x, "tls");
            return conf_i_fail_line(x, line, "only an https:// upstream takes tls (url is %s)", u->url);
        }
        conf_i_path_pop(x, old);
    }
    return true;
}

/* ---- references to upstreams */

void conf_i_add_ref(struct conf_i_ctx *x, int node, size_t line, size_t *target, bool *has)
{
    x->refs = cm_realloc(x->refs, (x->refs_n + 1) * sizeof(*x->refs));
    struct conf_i_upref *r = &x->refs[x->refs_n++];
    r->node = node;
    r->line = line;
    r->target = target;
    r->has = has;
    snprintf(r->path, sizeof(r->path), "%s", x->path);
}

static int node_id(struct conf_i_ctx *x, yaml_node_t *n)
{
    return (int)(n - x->doc->nodes.start) + 1;
}

bool conf_i_fn_route_upstream(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    if (conf_i_scalar(x, n, "an upstream name") == NULL)
        return false;
    conf_i_add_ref(x, node_id(x, n), conf_i_node_line(n), target, NULL);
    return true;
}

bool conf_i_fn_default_upstream(struct conf_i_ctx *x, yaml_node_t *n, void *target)
{
    struct conf *c = target;
    if (conf_i_scalar(x, n, "an upstream name") == NULL)
        return false;
    conf_i_add_ref(x, node_id(x, n), conf_i_node_line(n), &c->default_upstream, &c->has_default_upstream);
    return true;
}

/* Two passes: named references first, so that default_upstream is known when
 * the routes without an upstream take it. */
bool conf_i_resolve_refs(struct conf_i_ctx *x)
{
    struct conf *c = x->c;
    for (size_t i = 0; i < 2 * x->refs_n; i++) {
        struct conf_i_upref *r = &x->refs[i % x->refs_n];
        if ((i < x->refs_n) != (r->node != 0))
            continue;
        snprintf(x->path, sizeof(x->path), "%s", r->path);
        x->plen = strlen(x->path);
        if (r->node == 0) {
            if (c->has_default_upstream) {
                *r->target = c->default_upstream;
                continue;
            }
            return conf_i_fail_line(x, r->line, "missing required key (or set default_upstream)");
        }
        const char *name = (const char *)yaml_document_get_node(x->doc, r->node)->data.scalar.value;
        size_t j = 0;
        while (j < c->upstreams_n && strcmp(c->upstreams[j].name, name) != 0)
            j++;
        if (j == c->upstreams_n) {
            char b[80], known[200] = "";
            size_t kl = 0;
            for (size_t k = 0; k < c->upstreams_n; k++) {
                int w = snprintf(known + kl, sizeof(known) - kl, "%s%s", k ? ", " : "", c->upstreams[k].name);
                if (w > 0 && (size_t)w < sizeof(known) - kl)
                    kl += (size_t)w;
            }
            return conf_i_fail_line(x, r->line, "unknown upstream '%s' (defined: %s)", conf_i_shown(b, name),
                                    c->upstreams_n ? known : "none");
        }
        *r->target = j;
        if (r->has != NULL)
            *r->has = true;
    }
    conf_i_path_pop(x, 0);
    return true;
}
