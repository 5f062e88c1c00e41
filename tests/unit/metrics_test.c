/* metrics_test.c - the Prometheus registry: concurrent updates, exact rendered values, format, escaping. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/metrics.h"
#include "common/version.h"

/* ---- a small parser of the text format 0.0.4, strict enough to catch format errors */

#define MAX_LABELS 4
struct sample {
    char name[128];
    size_t nlabels;
    char key[MAX_LABELS][32];
    char val[MAX_LABELS][128];
    double value;
};

struct parsed {
    struct sample *s;
    size_t n;
    char types[64][128]; /* family names with a # TYPE line, in order */
    char type_kind[64][16];
    size_t ntypes;
    size_t nhelps;
};

static const char *family_type(const struct parsed *p, const char *family)
{
    for (size_t i = 0; i < p->ntypes; i++)
        if (strcmp(p->types[i], family) == 0)
            return p->type_kind[i];
    return NULL;
}

/* The TYPE line a sample belongs to: itself, or for histograms the name
 * without _bucket/_sum/_count. */
static const char *sample_type(const struct parsed *p, const char *name)
{
    const char *t = family_type(p, name);
    if (t)
        return t;
    static const char *sfx[] = {"_bucket", "_sum", "_count"};
    for (size_t k = 0; k < 3; k++) {
        size_t nl = strlen(name), sl = strlen(sfx[k]);
        if (nl > sl && strcmp(name + nl - sl, sfx[k]) == 0) {
            char fam[128];
            snprintf(fam, sizeof(fam), "%.*s", (int)(nl - sl), name);
            t = family_type(p, fam);
            if (t && strcmp(t, "histogram") == 0)
                return t;
        }
    }
    return NULL;
}

static void parse_text(const char *text, struct parsed *p)
{
    memset(p, 0, sizeof(*p));
    size_t cap = 1024;
    p->s = calloc(cap, sizeof(*p->s));
    const char *line = text;
    while (*line) {
        const char *eol = strchr(line, '\n');
        cr_assert_not_null(eol, "every line ends with a newline");
        if (strncmp(line, "# HELP ", 7) == 0) {
            p->nhelps++;
        } else if (strncmp(line, "# TYPE ", 7) == 0) {
            cr_assert_lt(p->ntypes, 64);
            const char *sp = strchr(line + 7, ' ');
            cr_assert(sp && sp < eol);
            snprintf(p->types[p->ntypes], 128, "%.*s", (int)(sp - (line + 7)), line + 7);
            snprintf(p->type_kind[p->ntypes], 16, "%.*s", (int)(eol - sp - 1), sp + 1);
            cr_assert_null(family_type(p, p->types[p->ntypes]), "duplicate TYPE for %s", p->types[p->ntypes]);
            cr_assert(strcmp(p->type_kind[p->ntypes], "counter") == 0 ||
                      strcmp(p->type_kind[p->ntypes], "gauge") == 0 ||
                      strcmp(p->type_kind[p->ntypes], "histogram") == 0);
            p->ntypes++;
        } else {
            cr_assert_neq(line[0], '#', "unexpected comment line");
            if (p->n == cap) {
                cap *= 2;
                p->s = realloc(p->s, cap * sizeof(*p->s));
            }
            struct sample *s = &p->s[p->n++];
            memset(s, 0, sizeof(*s));
            const char *c = line;
            size_t k = 0;
            while (c < eol && *c != '{' && *c != ' ')
                s->name[k++] = *c++;
            cr_assert_gt(k, 0);
            if (*c == '{') {
                c++;
                while (*c != '}') {
                    cr_assert_lt(s->nlabels, MAX_LABELS);
                    size_t kk = 0;
                    while (*c != '=') {
                        cr_assert(c < eol);
                        s->key[s->nlabels][kk++] = *c++;
                    }
                    c++;
                    cr_assert_eq(*c, '"');
                    c++;
                    size_t vv = 0;
                    while (*c != '"') {
                        cr_assert(c < eol, "unterminated label value");
                        char ch = *c++;
                        if (ch == '\\') {
                            ch = *c++;
                            cr_assert(ch == '\\' || ch == '"' || ch == 'n', "bad escape \\%c", ch);
                            if (ch == 'n')
                                ch = '\n';
                        }
                        cr_assert_lt(vv, 127);
                        s->val[s->nlabels][vv++] = ch;
                    }
                    c++;
                    s->nlabels++;
                    if (*c == ',')
                        c++;
                }
                c++;
            }
            cr_assert_eq(*c, ' ');
            c++;
            char *end = NULL;
            if (strncmp(c, "+Inf", 4) == 0) {
                s->value = INFINITY;
                end = (char *)c + 4;
            } else {
                s->value = strtod(c, &end);
            }
            cr_assert_eq(end, eol, "garbage after value in: %.*s", (int)(eol - line), line);
            cr_assert_not_null(sample_type(p, s->name), "sample %s has no TYPE before it", s->name);
        }
        line = eol + 1;
    }
    cr_assert_eq(p->nhelps, p->ntypes, "one HELP per TYPE");
}

/* Value of the sample NAME with exactly these labels (NULL-terminated k,v list); aborts the test if absent. */
static double get(const struct parsed *p, const char *name, ...)
{
    const char *k[MAX_LABELS], *v[MAX_LABELS];
    size_t nl = 0;
    va_list ap;
    va_start(ap, name);
    for (;;) {
        const char *kk = va_arg(ap, const char *);
        if (!kk)
            break;
        k[nl] = kk;
        v[nl] = va_arg(ap, const char *);
        nl++;
    }
    va_end(ap);
    size_t found = 0;
    double val = 0;
    for (size_t i = 0; i < p->n; i++) {
        const struct sample *s = &p->s[i];
        if (strcmp(s->name, name) != 0 || s->nlabels != nl)
            continue;
        bool all = true;
        for (size_t a = 0; a < nl && all; a++) {
            bool hit = false;
            for (size_t b = 0; b < s->nlabels; b++)
                if (strcmp(s->key[b], k[a]) == 0 && strcmp(s->val[b], v[a]) == 0)
                    hit = true;
            all = hit;
        }
        if (all) {
            found++;
            val = s->value;
        }
    }
    cr_assert_eq(found, 1, "sample %s (%zu labels) found %zu times", name, nl, found);
    return val;
}

static char *render(void)
{
    struct cm_buf b;
    cm_buf_init(&b, 1 << 20);
    cr_assert(cm_metrics_render(&b));
    size_t n;
    char *s = cm_buf_take(&b, &n);
    cr_assert_not_null(s);
    cr_assert_eq(strlen(s), n);
    return s;
}

static const char *const ROUTES[2] = {"payments", "we\"ird\\name\nx"};

static void setup(void)
{
    cm_metrics_init(2, ROUTES);
}

static void teardown(void)
{
    cm_metrics_reset();
}

#define PER_THREAD 100000
#define NTHREADS   4

static void *bump(void *arg)
{
    (void)arg;
    for (int i = 0; i < PER_THREAD; i++) {
        cm_metric_request(0, CM_OUT_FORWARDED);
        cm_metric_request(1, CM_OUT_REPLAYED);
        cm_metric_request(CM_ROUTE_DEFAULT, CM_OUT_MISMATCH);
        cm_metric_request(12345, CM_OUT_IN_FLIGHT); /* out of range -> _none */
        cm_metric_dedup_hit(1);
        cm_metric_parameter_conflict(0);
        cm_metric_in_flight_conflict(CM_ROUTE_NONE);
        cm_metric_completion_failure(0);
        cm_metric_connections(+1);
        cm_metric_upstream(0, "api", 201, 0.002);
        cm_metric_store_seconds(CM_STORE_REDIS, 0.0001);
        if (i % 2 == 0)
            cm_metric_store_error(CM_STORE_POSTGRES);
        cm_metric_connections(i % 4 == 0 ? 0 : -1);
    }
    return NULL;
}

Test(metrics, concurrent_exact, .init = setup, .fini = teardown)
{
    pthread_t th[NTHREADS];
    for (int i = 0; i < NTHREADS; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, bump, NULL), 0);
    for (int i = 0; i < NTHREADS; i++)
        pthread_join(th[i], NULL);

    char *text = render();
    struct parsed p;
    parse_text(text, &p);
    const double N = (double)NTHREADS * PER_THREAD;

    cr_assert_eq(get(&p, "idemgate_requests_total", "route", "payments", "outcome", "forwarded", NULL), N);
    cr_assert_eq(get(&p, "idemgate_requests_total", "route", ROUTES[1], "outcome", "replayed", NULL), N);
    cr_assert_eq(get(&p, "idemgate_requests_total", "route", "_default", "outcome", "mismatch", NULL), N);
    cr_assert_eq(get(&p, "idemgate_requests_total", "route", "_none", "outcome", "in_flight", NULL), N);
    /* every route x outcome is rendered, zeros included */
    cr_assert_eq(get(&p, "idemgate_requests_total", "route", "payments", "outcome", "replayed", NULL), 0);
    cr_assert_eq(get(&p, "idemgate_requests_total", "route", "_none", "outcome", "upstream_error", NULL), 0);
    size_t nreq = 0;
    for (size_t i = 0; i < p.n; i++)
        if (strcmp(p.s[i].name, "idemgate_requests_total") == 0)
            nreq++;
    cr_assert_eq(nreq, 4 * CM_OUT__COUNT);

    cr_assert_eq(get(&p, "idemgate_dedup_hits_total", "route", ROUTES[1], NULL), N);
    cr_assert_eq(get(&p, "idemgate_dedup_hits_total", "route", "payments", NULL), 0);
    cr_assert_eq(get(&p, "idemgate_parameter_conflicts_total", "route", "payments", NULL), N);
    cr_assert_eq(get(&p, "idemgate_in_flight_conflicts_total", "route", "_none", NULL), N);
    cr_assert_eq(get(&p, "idemgate_in_flight_conflicts_total", "route", "_default", NULL), 0);
    cr_assert_eq(get(&p, "idemgate_completion_failures_total", "route", "payments", NULL), N);
    cr_assert_eq(get(&p, "idemgate_store_errors_total", "store", "postgres", NULL), N / 2);
    cr_assert_eq(get(&p, "idemgate_store_errors_total", "store", "redis", NULL), 0);
    /* +1 each time, -1 three times out of four */
    cr_assert_eq(get(&p, "idemgate_connections", NULL), N / 4);

    /* upstream: every observation 0.002 s -> bucket 0.0025 */
#define UP "route", "payments", "upstream", "api"
    cr_assert_eq(get(&p, "idemgate_upstream_seconds_bucket", UP, "le", "0.001", NULL), 0);
    cr_assert_eq(get(&p, "idemgate_upstream_seconds_bucket", UP, "le", "0.0025", NULL), N);
    cr_assert_eq(get(&p, "idemgate_upstream_seconds_bucket", UP, "le", "+Inf", NULL), N);
    cr_assert_eq(get(&p, "idemgate_upstream_seconds_count", UP, NULL), N);
    cr_assert_float_eq(get(&p, "idemgate_upstream_seconds_sum", UP, NULL), N * 0.002, 1e-6);
    cr_assert_eq(get(&p, "idemgate_upstream_responses_total", UP, "class", "2xx", NULL), N);
    cr_assert_eq(get(&p, "idemgate_upstream_responses_total", UP, "class", "none", NULL), 0);
    cr_assert_eq(get(&p, "idemgate_store_seconds_bucket", "store", "redis", "le", "0.001", NULL), N);
    cr_assert_eq(get(&p, "idemgate_store_seconds_count", "store", "redis", NULL), N);
    cr_assert_eq(get(&p, "idemgate_store_seconds_count", "store", "postgres", NULL), 0);
    cr_assert_float_eq(get(&p, "idemgate_store_seconds_sum", "store", "redis", NULL), N * 0.0001, 1e-6);
    cr_assert_eq(get(&p, "idemgate_build_info", "version", IDEMGATE_VERSION, NULL), 1);
    free(p.s);
    free(text);
}

Test(metrics, histogram_buckets_cumulative, .init = setup, .fini = teardown)
{
    /* value -> index of the first bucket that holds it (15 = +Inf only) */
    static const struct {
        double v;
        int bucket;
    } obs[] = {
        {0.0005, 0}, {0.001, 0}, {0.0011, 1}, {0.003, 2}, {0.7, 9},  {1.0, 9}, {2.5, 10},
        {59.9, 14},  {60, 14},   {60.01, 15}, {1e9, 15},  {-1.0, 0}, {NAN, 0}, {0, 0},
    };
    static const char *const le[] = {"0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25",
                                     "0.5",   "1",      "2.5",   "5",    "10",    "30",   "60",  "+Inf"};
    size_t nobs = sizeof(obs) / sizeof(obs[0]);
    double sum = 0;
    for (size_t i = 0; i < nobs; i++) {
        cm_metric_upstream(0, "api", 200, obs[i].v);
        cm_metric_store_seconds(CM_STORE_POSTGRES, obs[i].v);
        double v = obs[i].v > 0 ? obs[i].v : 0;
        sum += v > 1e6 ? 1e6 : v;
    }
    cm_metric_store_seconds((enum cm_store_label)7, 1.0); /* ignored, no crash */

    char *text = render();
    struct parsed p;
    parse_text(text, &p);
    double prev = 0;
    for (int b = 0; b < 16; b++) {
        double want = 0;
        for (size_t i = 0; i < nobs; i++)
            if (obs[i].bucket <= b)
                want++;
        double got = get(&p, "idemgate_upstream_seconds_bucket", UP, "le", le[b], NULL);
        cr_assert_eq(got, want, "le=%s got %f want %f", le[b], got, want);
        cr_assert_geq(got, prev, "cumulative");
        prev = got;
        cr_assert_eq(get(&p, "idemgate_store_seconds_bucket", "store", "postgres", "le", le[b], NULL), want);
        cr_assert_eq(get(&p, "idemgate_store_seconds_bucket", "store", "redis", "le", le[b], NULL), 0);
    }
    cr_assert_eq(get(&p, "idemgate_upstream_seconds_count", UP, NULL), (double)nobs);
    cr_assert_float_eq(get(&p, "idemgate_upstream_seconds_sum", UP, NULL), sum, 1e-3);
    /* buckets render in increasing le order */
    const char *a = strstr(text, "idemgate_upstream_seconds_bucket{route=\"payments\",upstream=\"api\",le=\"0.001\"}");
    const char *z = strstr(text, "idemgate_upstream_seconds_bucket{route=\"payments\",upstream=\"api\",le=\"+Inf\"}");
    cr_assert(a && z && a < z);
    free(p.s);
    free(text);
}

Test(metrics, label_escaping, .init = setup, .fini = teardown)
{
    cm_metric_dedup_hit(1);
    char *text = render();
    /* raw text: backslash, quote and newline escaped exactly */
    cr_assert_not_null(strstr(text, "idemgate_dedup_hits_total{route=\"we\\\"ird\\\\name\\nx\"} 1\n"), "%s", text);
    struct parsed p;
    parse_text(text, &p);
    cr_assert_eq(get(&p, "idemgate_dedup_hits_total", "route", ROUTES[1], NULL), 1);
    free(p.s);
    free(text);
}

Test(metrics, gauges_and_families, .init = setup, .fini = teardown)
{
    cm_metric_postgres_up(true);
    cm_metric_redis_up(false);
    cm_metric_stuck_processing_set(0, 7);
    cm_metric_stuck_processing_set(0, 3); /* a gauge: set, not add */
    cm_metric_stuck_processing_set(CM_ROUTE_DEFAULT, 2);
    cm_metric_connections(5);
    cm_metric_connections(-2);
    char *text = render();
    struct parsed p;
    parse_text(text, &p);
    cr_assert_eq(get(&p, "idemgate_postgres_up", NULL), 1);
    cr_assert_eq(get(&p, "idemgate_redis_up", NULL), 0);
    cr_assert_eq(get(&p, "idemgate_stuck_processing", "route", "payments", NULL), 3);
    cr_assert_eq(get(&p, "idemgate_stuck_processing", "route", "_default", NULL), 2);
    cr_assert_eq(get(&p, "idemgate_connections", NULL), 3);
    static const struct {
        const char *name, *type;
    } fam[] = {
        {"idemgate_requests_total", "counter"},
        {"idemgate_dedup_hits_total", "counter"},
        {"idemgate_parameter_conflicts_total", "counter"},
        {"idemgate_in_flight_conflicts_total", "counter"},
        {"idemgate_completion_failures_total", "counter"},
        {"idemgate_stuck_processing", "gauge"},
        {"idemgate_upstream_seconds", "histogram"},
        {"idemgate_upstream_responses_total", "counter"},
        {"process_cpu_seconds_total", "counter"},
        {"process_resident_memory_bytes", "gauge"},
        {"process_open_fds", "gauge"},
        {"process_max_fds", "gauge"},
        {"process_start_time_seconds", "gauge"},
        {"idemgate_store_seconds", "histogram"},
        {"idemgate_store_errors_total", "counter"},
        {"idemgate_postgres_up", "gauge"},
        {"idemgate_redis_up", "gauge"},
        {"idemgate_connections", "gauge"},
        {"idemgate_build_info", "gauge"},
    };
    for (size_t i = 0; i < sizeof(fam) / sizeof(fam[0]); i++) {
        const char *t = family_type(&p, fam[i].name);
        cr_assert_not_null(t, "no TYPE for %s", fam[i].name);
        cr_assert_str_eq(t, fam[i].type, "%s", fam[i].name);
        char help[160];
        snprintf(help, sizeof(help), "# HELP %s ", fam[i].name);
        cr_assert_not_null(strstr(text, help), "no HELP for %s", fam[i].name);
    }
    free(p.s);
    free(text);
}

Test(metrics, reset_and_reinit, .fini = teardown)
{
    /* usable before init: pseudo-routes only */
    cm_metric_request(0, CM_OUT_FORWARDED);
    cm_metric_request(CM_ROUTE_DEFAULT, CM_OUT_FORWARDED);
    cm_metric_request(1, (enum cm_outcome)999);
    char *text = render();
    struct parsed p;
    parse_text(text, &p);
    cr_assert_eq(get(&p, "idemgate_requests_total", "route", "_none", "outcome", "forwarded", NULL), 1);
    /* a value outside the enum (a bug) is counted as a server-side error, never dropped */
    cr_assert_eq(get(&p, "idemgate_requests_total", "route", "_none", "outcome", "upstream_error", NULL), 1);
    cr_assert_eq(get(&p, "idemgate_requests_total", "route", "_default", "outcome", "forwarded", NULL), 1);
    free(p.s);
    free(text);

    const char *one[] = {"r1"};
    cm_metrics_init(1, one);
    cm_metric_request(0, CM_OUT_FORWARDED);
    text = render();
    parse_text(text, &p);
    cr_assert_eq(get(&p, "idemgate_requests_total", "route", "r1", "outcome", "forwarded", NULL), 1);
    cr_assert_eq(get(&p, "idemgate_requests_total", "route", "_default", "outcome", "forwarded", NULL), 0);
    cr_assert_eq(get(&p, "idemgate_requests_total", "route", "_none", "outcome", "forwarded", NULL), 0);
    free(p.s);
    free(text);
    cr_assert_str_eq(cm_outcome_name(CM_OUT_IN_FLIGHT), "in_flight");
    cr_assert_str_eq(cm_outcome_name((enum cm_outcome) - 1), "upstream_error");
}

Test(metrics, render_respects_cap, .init = setup, .fini = teardown)
{
    struct cm_buf b;
    cm_buf_init(&b, 100);
    cr_assert_not(cm_metrics_render(&b));
    cr_assert_leq(b.len, 100);
    cm_buf_free(&b);
}

Test(metrics, status_json, .init = setup, .fini = teardown)
{
    cm_metric_request(0, CM_OUT_FORWARDED);
    cm_metric_request(0, CM_OUT_FORWARDED);
    cm_metric_request(0, CM_OUT_REPLAYED);
    cm_metric_dedup_hit(0);
    cm_metric_parameter_conflict(0);
    cm_metric_stuck_processing_set(1, 3);
    for (int i = 0; i < 98; i++)
        cm_metric_upstream(0, "api", 200, 0.003); /* the 0.0025..0.005 bucket */
    cm_metric_upstream(1, "api", 200, 0.7);       /* 0.5..1 */
    cm_metric_upstream(CM_ROUTE_DEFAULT, "other", 0, 0.8);
    struct cm_buf b;
    cm_buf_init(&b, 64 * 1024);
    cr_assert(cm_metrics_status_json(&b, "up", "disabled"));
    cr_expect_not_null(strstr(b.data, "{\"routes\":[{\"name\":\""), "%s", b.data);
    cr_expect_not_null(strstr(b.data, "\"requests\":3,\"outcomes\":{\"forwarded\":2,\"replayed\":1,"), "%s", b.data);
    cr_expect_not_null(strstr(b.data, "\"replays\":1,\"in_flight_conflicts\":0,\"parameter_conflicts\":1,"), "%s",
                       b.data);
    cr_expect_not_null(strstr(b.data, "\"stuck\":3}"), "%s", b.data);
    cr_expect_null(strstr(b.data, "\"_default\""), "_default only once it saw a request: %s", b.data);
    cr_expect_not_null(strstr(b.data, "\"store\":{\"postgres\":\"up\",\"redis\":\"disabled\"}"), "%s", b.data);
    cr_expect_not_null(strstr(b.data, "\"upstream\":{\"window_seconds\":300,\"count\":100,"), "%s", b.data);
    const char *p50 = strstr(b.data, "\"p50_seconds\":"), *p99 = strstr(b.data, "\"p99_seconds\":");
    cr_assert(p50 && p99);
    double v50 = strtod(p50 + 14, NULL), v99 = strtod(p99 + 14, NULL);
    cr_expect(v50 > 0.0025 && v50 <= 0.005, "p50 %f in the bucket of 98%% of the samples", v50);
    cr_expect(v99 > 0.5 && v99 <= 1, "p99 %f in the 0.5..1 bucket", v99);
    cm_metric_request(CM_ROUTE_DEFAULT, CM_OUT_FORWARDED);
    cm_buf_reset(&b);
    cr_assert(cm_metrics_status_json(&b, "down", "down"));
    cr_expect_not_null(strstr(b.data, "{\"name\":\"_default\",\"requests\":1,"), "%s", b.data);
    cm_buf_free(&b);
}

/* The outcome whose label is name, or CM_OUT__COUNT. */
static enum cm_outcome outcome_named(const char *name)
{
    for (int o = 0; o < CM_OUT__COUNT; o++)
        if (strcmp(cm_outcome_name((enum cm_outcome)o), name) == 0)
            return (enum cm_outcome)o;
    return CM_OUT__COUNT;
}

/* SPEC 11: the status page counts only the server-side outcomes as errors; a client's mistake is rejected. */
Test(metrics, status_json_errors_are_the_server_side_outcomes, .init = setup, .fini = teardown)
{
    static const char *const client[] = {"forwarded", "replayed", "mismatch", "in_flight", "rejected", "passthrough"};
    static const char *const server[] = {"unknown", "store_unavailable", "upstream_error", "overloaded"};
    for (size_t i = 0; i < sizeof client / sizeof client[0]; i++) {
        enum cm_outcome o = outcome_named(client[i]);
        cr_assert_neq(o, CM_OUT__COUNT, "no outcome %s", client[i]);
        cm_metric_request(0, o);
        cm_metric_request(0, o);
    }
    for (size_t i = 0; i < sizeof server / sizeof server[0]; i++) {
        enum cm_outcome o = outcome_named(server[i]);
        cr_assert_neq(o, CM_OUT__COUNT, "no outcome %s", server[i]);
        cm_metric_request(1, o);
        for (size_t k = 0; k <= i; k++)
            cm_metric_request(0, o); /* 1 + 2 + 3 + 4 */
    }
    struct cm_buf b;
    cm_buf_init(&b, 64 * 1024);
    cr_assert(cm_metrics_status_json(&b, "up", "up"));
    /* per route, after its outcomes: payments 12 client-side and 10 server-side, the other 4 server-side */
    cr_expect_not_null(strstr(b.data, "{\"name\":\"payments\",\"requests\":22,"), "%s", b.data);
    cr_expect_not_null(strstr(b.data, "\"rejected\":2,"), "%s", b.data);
    const char *e1 = strstr(b.data, "},\"errors\":");
    cr_assert_not_null(e1, "no errors count: %s", b.data);
    cr_expect_eq(strtol(e1 + 11, NULL, 10), 10, "payments: %s", b.data);
    const char *e2 = strstr(e1 + 1, "},\"errors\":");
    cr_assert_not_null(e2, "no errors count for the second route: %s", b.data);
    cr_expect_eq(strtol(e2 + 11, NULL, 10), 4, "the second route: %s", b.data);
    cm_buf_free(&b);
}

/* Reload: a route keeps its slot (its counters) by name; new names get new slots, counted and rendered; an old name
 * stays in the registry after its route is gone (a loop may still count under it). */
Test(metrics, route_slots_by_name_across_reloads, .init = setup, .fini = teardown)
{
    cr_assert_eq(cm_metrics_route("payments"), 0);
    cm_metric_request(0, CM_OUT_FORWARDED);
    size_t fresh = cm_metrics_route("refunds");
    cr_assert_eq(fresh, 2);
    cr_assert_eq(cm_metrics_route("refunds"), 2, "the same name keeps its slot");
    cr_assert_eq(cm_metrics_route(ROUTES[1]), 1);
    cm_metric_request(fresh, CM_OUT_REPLAYED);
    cm_metric_request(fresh, CM_OUT_REPLAYED);
    cm_metric_request(cm_metrics_route("payments"), CM_OUT_FORWARDED);
    char *text = render();
    struct parsed p;
    parse_text(text, &p);
    cr_expect_eq(get(&p, "idemgate_requests_total", "route", "payments", "outcome", "forwarded", NULL), 2);
    cr_expect_eq(get(&p, "idemgate_requests_total", "route", "refunds", "outcome", "replayed", NULL), 2);
    cr_expect_eq(get(&p, "idemgate_dedup_hits_total", "route", "refunds", NULL), 0);
    cr_expect_eq(get(&p, "idemgate_requests_total", "route", "_default", "outcome", "forwarded", NULL), 0);
    free(p.s);
    free(text);
}

Test(metrics, unknown_resolved_and_shadow_decisions, .init = setup, .fini = teardown)
{
    /* every family and every label value is there from the start, at 0 */
    char *text = render();
    struct parsed p;
    parse_text(text, &p);
    cr_assert_str_eq(family_type(&p, "idemgate_unknown_resolved_total"), "counter");
    cr_assert_str_eq(family_type(&p, "idemgate_shadow_decisions_total"), "counter");
    cr_assert_str_eq(family_type(&p, "idemgate_shadow_store_errors_total"), "counter");
    cr_assert_str_eq(family_type(&p, "idemgate_signature_failures_total"), "counter");
    cr_assert_eq(get(&p, "idemgate_signature_failures_total", "route", "payments", NULL), 0);
    cr_assert_eq(get(&p, "idemgate_unknown_resolved_total", "route", "payments", "how", "absent", NULL), 0);
    cr_assert_eq(get(&p, "idemgate_shadow_decisions_total", "route", "payments", "decision", "stale", NULL), 0);
    free(p.s);
    free(text);

    cm_metric_unknown_resolved(0, CM_RESOLVED_FOUND);
    cm_metric_unknown_resolved(0, CM_RESOLVED_FOUND);
    cm_metric_unknown_resolved(1, CM_RESOLVED_ABSENT);
    cm_metric_unknown_resolved(0, CM_RESOLVED__COUNT); /* out of range: ignored */
    cm_metric_shadow_decision(0, CM_SHADOW_REPLAY);
    cm_metric_shadow_decision(0, CM_SHADOW_MISMATCH);
    cm_metric_shadow_decision(0, CM_SHADOW_MISMATCH);
    cm_metric_shadow_decision(CM_ROUTE_DEFAULT, CM_SHADOW_NEW);
    cm_metric_shadow_store_error(1);
    cm_metric_signature_failure(1);
    cm_metric_signature_failure(1);
    text = render();
    parse_text(text, &p);
    cr_expect_eq(get(&p, "idemgate_unknown_resolved_total", "route", "payments", "how", "found", NULL), 2);
    cr_expect_eq(get(&p, "idemgate_unknown_resolved_total", "route", "payments", "how", "absent", NULL), 0);
    cr_expect_eq(get(&p, "idemgate_unknown_resolved_total", "route", ROUTES[1], "how", "absent", NULL), 1);
    cr_expect_eq(get(&p, "idemgate_shadow_decisions_total", "route", "payments", "decision", "replay", NULL), 1);
    cr_expect_eq(get(&p, "idemgate_shadow_decisions_total", "route", "payments", "decision", "mismatch", NULL), 2);
    cr_expect_eq(get(&p, "idemgate_shadow_decisions_total", "route", "payments", "decision", "in_flight", NULL), 0);
    cr_expect_eq(get(&p, "idemgate_shadow_decisions_total", "route", "_default", "decision", "new", NULL), 1);
    cr_expect_eq(get(&p, "idemgate_shadow_store_errors_total", "route", ROUTES[1], NULL), 1);
    cr_expect_eq(get(&p, "idemgate_signature_failures_total", "route", ROUTES[1], NULL), 2);
    cr_expect_eq(get(&p, "idemgate_signature_failures_total", "route", "payments", NULL), 0);
    cr_expect_str_eq(cm_shadow_name(CM_SHADOW_IN_FLIGHT), "in_flight");
    free(p.s);
    free(text);
}

/* idemgate_upstream_seconds and _responses_total per route and upstream, the answer's class (none: no answer); the
 * process family read from /proc/self. */
Test(metrics, upstream_series_by_route_and_upstream_and_the_process_family, .init = setup, .fini = teardown)
{
    cm_metric_upstream(0, "api", 201, 0.01);
    cm_metric_upstream(0, "api", 302, 0.01);
    cm_metric_upstream(0, "api", 404, 0.01);
    cm_metric_upstream(0, "api", 503, 0.01);
    cm_metric_upstream(0, "api", 0, 2.0); /* a timeout: no answer */
    cm_metric_upstream(0, "billing", 200, 0.2);
    cm_metric_upstream(1, "api", 200, 0.02);
    cm_metric_upstream(CM_ROUTE_DEFAULT, "legacy", 200, 0.02);
    char *text = render();
    struct parsed p;
    parse_text(text, &p);
    static const char *const cls[] = {"2xx", "3xx", "4xx", "5xx", "none"};
    for (size_t c = 0; c < 5; c++)
        cr_expect_eq(
            get(&p, "idemgate_upstream_responses_total", "route", "payments", "upstream", "api", "class", cls[c], NULL),
            1, "class %s", cls[c]);
    cr_expect_eq(get(&p, "idemgate_upstream_seconds_count", "route", "payments", "upstream", "api", NULL), 5);
    cr_expect_eq(get(&p, "idemgate_upstream_seconds_count", "route", "payments", "upstream", "billing", NULL), 1);
    cr_expect_eq(get(&p, "idemgate_upstream_seconds_count", "route", ROUTES[1], "upstream", "api", NULL), 1);
    cr_expect_eq(get(&p, "idemgate_upstream_seconds_count", "route", "_default", "upstream", "legacy", NULL), 1);
    cr_expect_eq(
        get(&p, "idemgate_upstream_responses_total", "route", "payments", "upstream", "billing", "class", "2xx", NULL),
        1);
    cr_expect(strstr(text, "upstream=\"billing\",le=\"0.25\"} 1") != NULL, "%s", text);
    cr_expect_gt(get(&p, "process_open_fds", NULL), 2);
    cr_expect_geq(get(&p, "process_max_fds", NULL), get(&p, "process_open_fds", NULL));
    cr_expect_gt(get(&p, "process_resident_memory_bytes", NULL), 1 << 20);
    cr_expect_geq(get(&p, "process_cpu_seconds_total", NULL), 0);
    double start = get(&p, "process_start_time_seconds", NULL), now = (double)time(NULL);
    cr_expect(start > now - 3600 && start <= now + 1, "started %f, now %f", start, now);
    free(p.s);
    free(text);
}

static uint64_t fake_now_s;
static uint64_t fake_clock(void)
{
    return fake_now_s;
}

static uint64_t status_count(void)
{
    struct cm_buf b;
    cm_buf_init(&b, 64 * 1024);
    cr_assert(cm_metrics_status_json(&b, "up", "up"));
    const char *c = strstr(b.data, "\"upstream\":{\"window_seconds\":300,\"count\":");
    cr_assert_not_null(c, "%s", b.data);
    uint64_t n = strtoull(c + 41, NULL, 10);
    cm_buf_free(&b);
    return n;
}

/* The status page's upstream figures cover the last five minutes (to the minute), not the process's life; the
 * Prometheus histogram keeps counting. */
Test(metrics, status_latency_is_windowed_to_five_minutes, .init = setup, .fini = teardown)
{
    cm_metrics_set_clock(fake_clock);
    fake_now_s = 1000 * 60;
    for (int i = 0; i < 10; i++)
        cm_metric_upstream(0, "api", 200, 0.003);
    cr_expect_eq(status_count(), 10);
    fake_now_s += 200; /* 3 minutes on */
    cm_metric_upstream(0, "api", 200, 0.7);
    cm_metric_upstream(0, "api", 200, 0.8);
    cr_expect_eq(status_count(), 12);
    fake_now_s += 200; /* 6 minutes after the first ten: gone from the window */
    cr_expect_eq(status_count(), 2);
    fake_now_s += 8 * 60 * 60; /* hours later, and the ring wrapped many times */
    cr_expect_eq(status_count(), 0);
    cm_metric_upstream(0, "api", 200, 0.01);
    cr_expect_eq(status_count(), 1);
    char *text = render();
    cr_expect_not_null(strstr(text, "idemgate_upstream_seconds_count{route=\"payments\",upstream=\"api\"} 13\n"), "%s",
                       text);
    free(text);
    cm_metrics_set_clock(NULL);
}
