/* cli_keys.c - `idemgate keys list|show|release|purge|settle`: the admin key API (SPEC 5, 11) from the command line,
 * over HTTP with libcurl (--admin URL, the token from IDEMGATE_ADMIN_TOKEN): a table for people, the answer's JSON
 * with --json. It never reads the configuration or the store itself. */
#include "gateway/cli_keys.h"

#include <curl/curl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"

#define CLI_TIMEOUT_MS  30000
#define CLI_ANSWER_MAX  ((size_t)64 << 20)
#define CLI_BODY_MAX    ((size_t)8 << 20) /* a settled answer's body (the default max_response) */
#define CLI_PAGES_MAX   100000            /* --all: pages followed at most */
#define CLI_HEADERS_MAX 100
#define CLI_DEFAULT_URL "http://127.0.0.1:9090"
#define EXIT_ANSWER     1 /* an error answer, or no answer */
#define EXIT_USAGE      2

static void usage(FILE *out)
{
    fprintf(out, "usage: idemgate keys list    --route R [--state in_flight|unknown|completed] [--older-than 10m]\n"
                 "                             [--limit N] [--cursor C] [--all]\n"
                 "       idemgate keys show    --route R --key K\n"
                 "       idemgate keys release --route R --key K\n"
                 "       idemgate keys purge   --route R --key K\n"
                 "       idemgate keys settle  --route R --key K [--scope HEX] --status N [--header 'Name: value']...\n"
                 "                             [--body TEXT | --body-file FILE]\n"
                 "options: --admin URL  the admin listener (default " CLI_DEFAULT_URL ")\n"
                 "         --json       print the API's JSON answer (list --all: one page a line)\n"
                 "environment: IDEMGATE_ADMIN_TOKEN (required)\n"
                 "exit: 0 done, 1 an error answer (its problem on stderr) or no answer, 2 a usage error\n");
}

struct opts {
    const char *cmd;
    const char *admin;
    const char *route, *key, *scope, *state, *older, *limit, *cursor;
    const char *status, *body, *body_file;
    const char *headers[CLI_HEADERS_MAX];
    size_t nheaders;
    bool all, json;
};

static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, "idemgate keys: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n");
    usage(stderr);
    return EXIT_USAGE;
}

/* ---- HTTP */

struct answer {
    long status;
    struct cm_buf body;
    char err[CURL_ERROR_SIZE];
};

static size_t on_data(char *p, size_t size, size_t n, void *arg)
{
    struct answer *a = arg;
    return cm_buf_append(&a->body, p, size * n) ? size * n : 0;
}

/* One request; false (with a->err) when no answer came. */
static bool request(const struct opts *o, const char *method, const char *path, const char *body, struct answer *a)
{
    cm_buf_init(&a->body, CLI_ANSWER_MAX);
    a->status = 0;
    a->err[0] = '\0';
    CURL *c = curl_easy_init();
    if (!c) {
        snprintf(a->err, sizeof a->err, "curl_easy_init failed");
        return false;
    }
    const char *tok = getenv("IDEMGATE_ADMIN_TOKEN");
    char *url = cm_asprintf("%s%s", o->admin, path);
    char *auth = cm_asprintf("Authorization: Bearer %s", tok ? tok : "");
    struct curl_slist *h = curl_slist_append(NULL, auth);
    if (body)
        h = curl_slist_append(h, "Content-Type: application/json");
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)CLI_TIMEOUT_MS);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, 5000L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, a);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, a->err);
    if (body) {
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)strlen(body));
    }
    CURLcode rc = curl_easy_perform(c);
    if (rc == CURLE_OK)
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &a->status);
    else if (!a->err[0])
        snprintf(a->err, sizeof a->err, "%s", curl_easy_strerror(rc));
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    free(auth);
    free(url);
    if (!cm_buf_append(&a->body, "", 1)) /* NUL-terminated */
        a->status = 0;
    else
        a->body.len--;
    return rc == CURLE_OK && a->status != 0;
}

/* The problem's title and detail of an error answer on stderr. */
static int answer_error(const struct answer *a, const char *what)
{
    if (!a->status) {
        fprintf(stderr, "idemgate keys: %s: no answer: %s\n", what, a->err);
        return EXIT_ANSWER;
    }
    json_t *j = json_loadb(a->body.data ? a->body.data : "", a->body.len, 0, NULL);
    const char *title = json_string_value(json_object_get(j, "title"));
    const char *detail = json_string_value(json_object_get(j, "detail"));
    fprintf(stderr, "idemgate keys: %s: %ld %s%s%s\n", what, a->status, title ? title : "error", detail ? ": " : "",
            detail ? detail : "");
    json_decref(j);
    return EXIT_ANSWER;
}

/* Appends "&name=value" (value percent-encoded) to q; nothing when value is NULL. */
static void query_add(struct cm_buf *q, const char *name, const char *value)
{
    if (!value)
        return;
    char *e = curl_easy_escape(NULL, value, 0);
    bool ok = e && cm_buf_appendf(q, "%s%s=%s", q->len ? "&" : "", name, e);
    (void)ok; /* a capped-out query is refused by the server (its answer tells) */
    curl_free(e);
}

/* ---- output for people */

static const char *str_or(json_t *o, const char *name, const char *dflt)
{
    const char *s = json_string_value(json_object_get(o, name));
    return s ? s : dflt;
}

static void table_head(void)
{
    printf("%-40s %-10s %-6s %-24s %-24s %s\n", "KEY", "STATE", "STATUS", "CREATED_AT", "LEASE_UNTIL", "SCOPE");
}

static void table_rows(json_t *records)
{
    size_t i;
    json_t *r;
    json_array_foreach(records, i, r)
    {
        char status[16] = "-";
        if (json_is_integer(json_object_get(r, "status")))
            snprintf(status, sizeof status, "%lld", (long long)json_integer_value(json_object_get(r, "status")));
        printf("%-40s %-10s %-6s %-24s %-24s %s\n", str_or(r, "key", "?"), str_or(r, "state", "?"), status,
               str_or(r, "created_at", "-"), str_or(r, "lease_until", "-"), str_or(r, "scope", "-"));
    }
}

/* Prints a 200's body as it came (--json) or through fn; returns the exit code. */
static int print_answer(const struct opts *o, const struct answer *a, const char *what, void (*fn)(json_t *))
{
    if (a->status != 200)
        return answer_error(a, what);
    if (o->json) {
        printf("%s\n", a->body.data ? a->body.data : "");
        return 0;
    }
    json_t *j = json_loadb(a->body.data ? a->body.data : "", a->body.len, 0, NULL);
    if (!j) {
        fprintf(stderr, "idemgate keys: %s: the answer is not JSON\n", what);
        return EXIT_ANSWER;
    }
    fn(j);
    json_decref(j);
    return 0;
}

static void show_records(json_t *j)
{
    table_head();
    table_rows(j);
}

static void show_count(json_t *j)
{
    const char *k;
    json_t *v;
    json_object_foreach(j, k, v)
    {
        if (json_is_integer(v))
            printf("%s %lld\n", k, (long long)json_integer_value(v));
        else if (json_is_true(v))
            printf("%s\n", k);
    }
}

static void show_settled(json_t *j)
{
    printf("settled: completed with status %lld\n", (long long)json_integer_value(json_object_get(j, "status")));
}

/* ---- commands */

static int cmd_list(const struct opts *o)
{
    char *cursor = o->cursor ? cm_strdup(o->cursor) : NULL;
    int rc = 0;
    for (long page = 0; page < CLI_PAGES_MAX; page++) {
        struct cm_buf q;
        cm_buf_init(&q, 64 * 1024);
        query_add(&q, "route", o->route);
        query_add(&q, "state", o->state);
        query_add(&q, "older_than", o->older);
        query_add(&q, "limit", o->limit);
        query_add(&q, "cursor", cursor);
        char *path = cm_asprintf("/admin/keys?%.*s", (int)q.len, q.data ? q.data : "");
        cm_buf_free(&q);
        struct answer a;
        request(o, "GET", path, NULL, &a);
        free(path);
        free(cursor);
        cursor = NULL;
        json_t *j = NULL;
        if (a.status == 200)
            j = json_loadb(a.body.data ? a.body.data : "", a.body.len, 0, NULL);
        if (!json_is_object(j)) {
            rc = a.status == 200 ? (fprintf(stderr, "idemgate keys: list: the answer is not a page\n"), EXIT_ANSWER)
                                 : answer_error(&a, "list");
            json_decref(j);
            cm_buf_free(&a.body);
            break;
        }
        const char *next = json_string_value(json_object_get(j, "next_cursor"));
        if (o->json) {
            printf("%s\n", a.body.data);
        } else {
            if (page == 0)
                table_head();
            table_rows(json_object_get(j, "records"));
            if (next && !o->all)
                printf("next page: --cursor %s\n", next);
        }
        cursor = next && o->all ? cm_strdup(next) : NULL;
        json_decref(j);
        cm_buf_free(&a.body);
        if (!cursor)
            break;
    }
    free(cursor);
    return rc;
}

/* route and key (and scope when given) as a query. */
static char *key_query(const struct opts *o, const char *path, bool scope)
{
    struct cm_buf q;
    cm_buf_init(&q, 64 * 1024);
    query_add(&q, "route", o->route);
    query_add(&q, "key", o->key);
    if (scope)
        query_add(&q, "scope", o->scope);
    char *p = cm_asprintf("%s?%.*s", path, (int)q.len, q.data ? q.data : "");
    cm_buf_free(&q);
    return p;
}

static int cmd_key(const struct opts *o, const char *method, const char *path, void (*fn)(json_t *))
{
    char *p = key_query(o, path, false);
    struct answer a;
    request(o, method, p, NULL, &a);
    free(p);
    int rc = print_answer(o, &a, o->cmd, fn);
    cm_buf_free(&a.body);
    return rc;
}

static void b64_append(struct cm_buf *b, const unsigned char *p, size_t n)
{
    static const char alpha[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    bool ok = true;
    for (size_t i = 0; i < n && ok; i += 3) {
        size_t k = n - i >= 3 ? 3 : n - i;
        uint32_t v = (uint32_t)p[i] << 16 | (k > 1 ? (uint32_t)p[i + 1] << 8 : 0) | (k > 2 ? p[i + 2] : 0);
        char out[4] = {alpha[v >> 18 & 63], alpha[v >> 12 & 63], k > 1 ? alpha[v >> 6 & 63] : '=',
                       k > 2 ? alpha[v & 63] : '='};
        ok = cm_buf_append(b, out, 4);
    }
}

/* The settled answer's body: --body, or --body-file read whole (at most CLI_BODY_MAX). */
static bool settle_body(const struct opts *o, struct cm_buf *out)
{
    cm_buf_init(out, CLI_BODY_MAX + 1);
    if (o->body)
        return cm_buf_append(out, o->body, strlen(o->body));
    if (!o->body_file)
        return true;
    FILE *f = fopen(o->body_file, "rb");
    if (!f)
        return false;
    char chunk[65536];
    size_t n;
    bool ok = true;
    while (ok && (n = fread(chunk, 1, sizeof chunk, f)) > 0)
        ok = cm_buf_append(out, chunk, n) && out->len <= CLI_BODY_MAX;
    ok = ok && !ferror(f);
    fclose(f);
    return ok;
}

/* The scope of the key's only record (settle without --scope), heap; NULL (and why on stderr) otherwise. */
static char *only_scope(const struct opts *o, int *rc)
{
    char *p = key_query(o, "/admin/keys", false);
    struct answer a;
    request(o, "GET", p, NULL, &a);
    free(p);
    char *scope = NULL;
    if (a.status != 200) {
        *rc = answer_error(&a, "settle");
    } else {
        json_t *j = json_loadb(a.body.data ? a.body.data : "", a.body.len, 0, NULL);
        size_t n = json_array_size(j);
        if (n == 1 && json_string_value(json_object_get(json_array_get(j, 0), "scope")))
            scope = cm_strdup(json_string_value(json_object_get(json_array_get(j, 0), "scope")));
        else
            fprintf(stderr,
                    "idemgate keys: settle: %zu records have this route and key: give --scope (see keys show)\n", n);
        *rc = EXIT_ANSWER;
        json_decref(j);
    }
    cm_buf_free(&a.body);
    return scope;
}

static int cmd_settle(struct opts *o)
{
    char *end = NULL;
    long status = strtol(o->status, &end, 10);
    if (!*o->status || *end || status < 100 || status > 599)
        return usage_error("--status: a number from 100 to 599, not %s", o->status);
    struct cm_buf body;
    if (!settle_body(o, &body)) {
        cm_buf_free(&body);
        fprintf(stderr, "idemgate keys: settle: cannot read the body (--body-file %s: missing, or over 8 MiB)\n",
                o->body_file ? o->body_file : "");
        return EXIT_USAGE;
    }
    json_t *hs = json_array();
    for (size_t i = 0; i < o->nheaders; i++) {
        const char *colon = strchr(o->headers[i], ':');
        if (!colon || colon == o->headers[i]) {
            json_decref(hs);
            cm_buf_free(&body);
            return usage_error("--header: 'Name: value', not %s", o->headers[i]);
        }
        const char *v = colon + 1;
        while (*v == ' ' || *v == '\t')
            v++;
        json_array_append_new(hs, json_pack("[s#s]", o->headers[i], (int)(colon - o->headers[i]), v));
    }
    struct cm_buf b64;
    cm_buf_init(&b64, CLI_BODY_MAX * 2);
    b64_append(&b64, (const unsigned char *)(body.data ? body.data : ""), body.len);
    json_t *doc = json_pack("{s:i,s:o,s:s#}", "status", (int)status, "headers", hs, "body_base64",
                            b64.data ? b64.data : "", (int)b64.len);
    cm_buf_free(&b64);
    cm_buf_free(&body);
    char *text = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    if (!text) {
        fprintf(stderr, "idemgate keys: settle: a header is not UTF-8\n");
        return EXIT_USAGE;
    }
    int rc = 0;
    char *scope = NULL;
    if (!o->scope) {
        scope = only_scope(o, &rc);
        if (!scope) {
            free(text);
            return rc;
        }
        o->scope = scope;
    }
    char *p = key_query(o, "/admin/keys/settle", true);
    struct answer a;
    request(o, "POST", p, text, &a);
    free(p);
    free(text);
    rc = print_answer(o, &a, "settle", show_settled);
    cm_buf_free(&a.body);
    free(scope);
    return rc;
}

/* ---- arguments */

/* The value of option name at argv[*i] ("--name V" or "--name=V"), advancing *i; NULL when argv[*i] is not it, or
 * (*missing) when its value is not there. */
static const char *opt_value(int argc, char **argv, int *i, const char *name, bool *missing)
{
    size_t n = strlen(name);
    if (strncmp(argv[*i], name, n) != 0)
        return NULL;
    if (argv[*i][n] == '=')
        return argv[*i] + n + 1;
    if (argv[*i][n] != '\0')
        return NULL;
    if (*i + 1 >= argc || strncmp(argv[*i + 1], "--", 2) == 0) { /* "--key=--x" for a value that starts so */
        *missing = true;
        return NULL;
    }
    return argv[++*i];
}

int gw_cli_keys_main(int argc, char **argv)
{
    struct opts o = {.admin = CLI_DEFAULT_URL};
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? EXIT_USAGE : 0;
    }
    o.cmd = argv[1];
    static const char *const cmds[] = {"list", "show", "release", "purge", "settle"};
    bool known = false;
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        known = known || strcmp(o.cmd, cmds[i]) == 0;
    if (!known)
        return usage_error("unknown command %s", o.cmd);
    for (int i = 2; i < argc; i++) {
        bool missing = false;
        const char *v;
        const char **slot = NULL;
        static const char *const names[] = {"--admin", "--route",  "--key",    "--scope", "--state",    "--older-than",
                                            "--limit", "--cursor", "--status", "--body",  "--body-file"};
        const char **slots[] = {&o.admin, &o.route,  &o.key,    &o.scope, &o.state,    &o.older,
                                &o.limit, &o.cursor, &o.status, &o.body,  &o.body_file};
        for (size_t k = 0; k < sizeof names / sizeof names[0] && !slot && !missing; k++)
            if ((v = opt_value(argc, argv, &i, names[k], &missing)) != NULL) {
                slot = slots[k];
                *slot = v;
            }
        if (slot)
            continue;
        if (!missing && (v = opt_value(argc, argv, &i, "--header", &missing)) != NULL) {
            if (o.nheaders == CLI_HEADERS_MAX)
                return usage_error("--header: at most %s of them", "100");
            o.headers[o.nheaders++] = v;
        } else if (missing) {
            return usage_error("%s needs a value", argv[i]);
        } else if (strcmp(argv[i], "--json") == 0) {
            o.json = true;
        } else if (strcmp(argv[i], "--all") == 0) {
            o.all = true;
        } else {
            return usage_error("unknown argument %s", argv[i]);
        }
    }
    if (!getenv("IDEMGATE_ADMIN_TOKEN") || !*getenv("IDEMGATE_ADMIN_TOKEN"))
        return usage_error("%s", "IDEMGATE_ADMIN_TOKEN is not set (the admin API's bearer token)");
    if (!o.route || !*o.route)
        return usage_error("%s: --route is required", o.cmd);
    bool is_list = strcmp(o.cmd, "list") == 0, is_settle = strcmp(o.cmd, "settle") == 0;
    if (!is_list && (!o.key || !*o.key))
        return usage_error("%s: --key is required", o.cmd);
    if (is_list && o.key)
        return usage_error("%s", "list: no --key (keys show --route R --key K shows one key)");
    if (!is_list && (o.state || o.older || o.limit || o.cursor || o.all))
        return usage_error("%s: --state, --older-than, --limit, --cursor and --all are list's", o.cmd);
    if (!is_settle && (o.status || o.body || o.body_file || o.nheaders || o.scope))
        return usage_error("%s: --scope, --status, --header, --body and --body-file are settle's", o.cmd);
    if (is_settle && !o.status)
        return usage_error("%s", "settle: --status is required (the answer retries will get)");
    if (o.body && o.body_file)
        return usage_error("%s", "settle: --body or --body-file, not both");
    if (strncmp(o.admin, "http://", 7) != 0 && strncmp(o.admin, "https://", 8) != 0)
        return usage_error("--admin: an http:// or https:// URL, not %s", o.admin);
    size_t al = strlen(o.admin);
    char *admin = cm_strndup(o.admin, al > 0 && o.admin[al - 1] == '/' ? al - 1 : al);
    o.admin = admin;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    int rc;
    if (is_list)
        rc = cmd_list(&o);
    else if (strcmp(o.cmd, "show") == 0)
        rc = cmd_key(&o, "GET", "/admin/keys", show_records);
    else if (strcmp(o.cmd, "release") == 0)
        rc = cmd_key(&o, "POST", "/admin/keys/release", show_count);
    else if (strcmp(o.cmd, "purge") == 0)
        rc = cmd_key(&o, "DELETE", "/admin/keys", show_count);
    else
        rc = cmd_settle(&o);
    curl_global_cleanup();
    free(admin);
    if (fflush(stdout) != 0)
        rc = EXIT_ANSWER;
    return rc;
}
