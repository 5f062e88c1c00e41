/* tls.c - HTTPS on the listeners through libmicrohttpd's GnuTLS: certificate files read and checked at every load,
 * and a certificate callback that gives each new handshake its listener's current credentials (SIGHUP swaps them;
 * connections already open keep theirs). */
#include "gateway/tls.h"

#include <gnutls/abstract.h>
#include <gnutls/gnutls.h>
#include <gnutls/abstract.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"

#define PEM_MAX   (1024 * 1024) /* a certificate chain or a key file */
#define CHAIN_MAX 16            /* certificates in a chain */
#define BIND_MAX  128           /* daemons with TLS: the front's (one per loop, at most 64) and the admin's */

struct gw_tls_creds {
    atomic_int refs;
    gnutls_pcert_st pcerts[CHAIN_MAX];
    unsigned n;
    gnutls_privkey_t key;
};

struct gw_tls {
    pthread_mutex_t mu;
    struct gw_tls_creds *cur;
    struct gw_tls_creds **all; /* every one ever set (cur among them): freed at destroy */
    size_t all_n;
};

static pthread_mutex_t bind_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    const struct MHD_Daemon *d;
    struct gw_tls *t;
} binds[BIND_MAX];

/* "CONF:LINE: WHICH.tls.KEY: why" (takes why, which names the file). */
static char *file_error(const char *conf_file, size_t line, const char *which, const char *key, char *why)
{
    char *e = conf_file && line ? cm_asprintf("%s:%zu: %s.tls.%s: %s", conf_file, line, which, key, why)
                                : cm_asprintf("%s.tls.%s: %s", which, key, why);
    free(why);
    return e;
}

static void creds_free(struct gw_tls_creds *c)
{
    for (unsigned i = 0; i < c->n; i++)
        gnutls_pcert_deinit(&c->pcerts[i]);
    if (c->key)
        gnutls_privkey_deinit(c->key);
    free(c);
}

/* The pair as GnuTLS's own loader takes it: it refuses a key that is not the certificate's. */
static int pair_check(const gnutls_datum_t *cert, const gnutls_datum_t *key)
{
    gnutls_certificate_credentials_t cred;
    int rc = gnutls_certificate_allocate_credentials(&cred);
    if (rc < 0)
        return rc;
    rc = gnutls_certificate_set_x509_key_mem2(cred, cert, key, GNUTLS_X509_FMT_PEM, NULL, 0);
    gnutls_certificate_free_credentials(cred);
    return rc < 0 ? rc : 0;
}

struct gw_tls_creds *gw_tls_creds_load(const char *conf_file, const struct conf_listen_tls *t, const char *which,
                                       char **err)
{
    if (MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES) {
        *err = cm_asprintf("%s.tls: this libmicrohttpd was built without TLS", which);
        return NULL;
    }
    char *why = NULL, *cert_pem = NULL, *key_pem = NULL;
    size_t cert_len = 0, key_len = 0;
    struct gw_tls_creds *c = NULL;
    if (!(cert_pem = cm_read_file(t->cert, PEM_MAX, &cert_len, &why))) {
        *err = file_error(conf_file, t->cert_line, which, "cert", why);
        goto fail;
    }
    if (!(key_pem = cm_read_file(t->key, PEM_MAX, &key_len, &why))) {
        *err = file_error(conf_file, t->key_line, which, "key", why);
        goto fail;
    }
    gnutls_datum_t cd = {(unsigned char *)cert_pem, (unsigned)cert_len};
    gnutls_datum_t kd = {(unsigned char *)key_pem, (unsigned)key_len};
    c = cm_calloc(1, sizeof *c);
    atomic_init(&c->refs, 1);
    c->n = CHAIN_MAX;
    int rc = gnutls_pcert_list_import_x509_raw(c->pcerts, &c->n, &cd, GNUTLS_X509_FMT_PEM, 0);
    if (rc < 0) {
        c->n = 0;
        *err = file_error(
            conf_file, t->cert_line, which, "cert",
            cm_asprintf("%s: not a PEM certificate chain (at most %d): %s", t->cert, CHAIN_MAX, gnutls_strerror(rc)));
        goto fail;
    }
    if ((rc = gnutls_privkey_init(&c->key)) < 0 ||
        (rc = gnutls_privkey_import_x509_raw(c->key, &kd, GNUTLS_X509_FMT_PEM, NULL, 0)) < 0) {
        *err = file_error(conf_file, t->key_line, which, "key",
                          cm_asprintf("%s: not an unencrypted PEM private key: %s", t->key, gnutls_strerror(rc)));
        goto fail;
    }
    if ((rc = pair_check(&cd, &kd)) < 0) {
        *err = file_error(conf_file, t->key_line, which, "key",
                          cm_asprintf("%s: does not go with %s: %s", t->key, t->cert, gnutls_strerror(rc)));
        goto fail;
    }
    free(cert_pem);
    free(key_pem);
    return c;
fail:
    if (c)
        creds_free(c);
    free(cert_pem);
    free(key_pem);
    return NULL;
}

static struct gw_tls_creds *creds_ref(struct gw_tls_creds *c)
{
    atomic_fetch_add(&c->refs, 1);
    return c;
}

void gw_tls_creds_unref(struct gw_tls_creds *c)
{
    if (c && atomic_fetch_sub(&c->refs, 1) == 1)
        creds_free(c);
}

struct gw_tls *gw_tls_create(struct gw_tls_creds *c)
{
    struct gw_tls *t = cm_calloc(1, sizeof *t);
    pthread_mutex_init(&t->mu, NULL);
    gw_tls_set(t, c);
    return t;
}

void gw_tls_set(struct gw_tls *t, struct gw_tls_creds *c)
{
    pthread_mutex_lock(&t->mu);
    if (t->cur != c) {
        t->all = cm_realloc(t->all, (t->all_n + 1) * sizeof *t->all);
        t->all[t->all_n++] = creds_ref(c);
        t->cur = c;
    }
    pthread_mutex_unlock(&t->mu);
}

void gw_tls_destroy(struct gw_tls *t)
{
    if (!t)
        return;
    for (size_t i = 0; i < t->all_n; i++)
        gw_tls_creds_unref(t->all[i]);
    free(t->all);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

void gw_tls_bind(struct gw_tls *t, const struct MHD_Daemon *d)
{
    pthread_mutex_lock(&bind_mu);
    for (size_t i = 0; i < BIND_MAX; i++) {
        if (!binds[i].d) {
            binds[i].d = d;
            binds[i].t = t;
            break;
        }
    }
    pthread_mutex_unlock(&bind_mu);
}

void gw_tls_unbind(const struct MHD_Daemon *d)
{
    pthread_mutex_lock(&bind_mu);
    for (size_t i = 0; i < BIND_MAX; i++)
        if (binds[i].d == d)
            binds[i].d = NULL, binds[i].t = NULL;
    pthread_mutex_unlock(&bind_mu);
}

/* libmicrohttpd sets the session's pointer to its connection before the handshake. */
static int retrieve(gnutls_session_t s, const gnutls_datum_t *req_ca_rdn, int nreqs,
                    const gnutls_pk_algorithm_t *pk_algos, int pk_algos_length, gnutls_pcert_st **pcert,
                    unsigned int *pcert_length, gnutls_privkey_t *privkey)
{
    (void)req_ca_rdn;
    (void)nreqs;
    (void)pk_algos;
    (void)pk_algos_length;
    struct MHD_Connection *conn = gnutls_session_get_ptr(s);
    const union MHD_ConnectionInfo *ci = conn ? MHD_get_connection_info(conn, MHD_CONNECTION_INFO_DAEMON) : NULL;
    if (!ci || !ci->daemon)
        return -1;
    struct gw_tls *t = NULL;
    pthread_mutex_lock(&bind_mu);
    for (size_t i = 0; i < BIND_MAX && !t; i++)
        if (binds[i].d == ci->daemon)
            t = binds[i].t;
    pthread_mutex_unlock(&bind_mu);
    if (!t)
        return -1;
    pthread_mutex_lock(&t->mu);
    struct gw_tls_creds *c = t->cur; /* alive until gw_tls_destroy */
    pthread_mutex_unlock(&t->mu);
    *pcert = c->pcerts;
    *pcert_length = c->n;
    *privkey = c->key;
    return 0;
}

struct MHD_OptionItem *gw_tls_mhd_options(bool on)
{
    static gnutls_certificate_retrieve_function2 *const cb = retrieve;
    static struct MHD_OptionItem tls[] = {
        {MHD_OPTION_HTTPS_CERT_CALLBACK, 0, NULL},
        {MHD_OPTION_HTTPS_PRIORITIES, 0, (void *)"NORMAL:-VERS-ALL:+VERS-TLS1.3:+VERS-TLS1.2"},
        {MHD_OPTION_END, 0, NULL},
    };
    static struct MHD_OptionItem none[] = {{MHD_OPTION_END, 0, NULL}};
    if (!on)
        return none;
    memcpy(&tls[0].ptr_value, &cb, sizeof cb); /* a function pointer as MHD reads it back */
    return tls;
}

bool gw_tls_upstream_files(const struct conf *c, char **err)
{
    for (size_t i = 0; i < c->upstreams_n; i++) {
        const struct conf_upstream_tls *t = &c->upstreams[i].tls;
        const char *keys[] = {"ca", "cert", "key"}, *paths[] = {t->ca, t->cert, t->key};
        for (size_t k = 0; k < 3; k++) {
            size_t len;
            char *why = NULL, *pem = paths[k] ? cm_read_file(paths[k], PEM_MAX, &len, &why) : NULL;
            free(pem);
            if (why) {
                *err = cm_asprintf("%s: upstreams[%zu].tls.%s: %s", c->file ? c->file : "?", i, keys[k], why);
                free(why);
                return false;
            }
        }
    }
    return true;
}
