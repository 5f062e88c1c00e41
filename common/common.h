/* common.h - allocator, capped buffers, header lists, logging, hashing and
 * time helpers shared by every room. Nothing here includes a network library. It never calls another room. */
#ifndef IDEMGATE_COMMON_H
#define IDEMGATE_COMMON_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define CM_MUST_CHECK   __attribute__((warn_unused_result))
#define CM_PRINTF(a, b) __attribute__((format(printf, a, b)))
/* n rounded up to a multiple of 16 (malloc's alignment): offsets of parts laid out in one allocation. */
#define CM_ROUND16(n) (((size_t)(n) + 15) & ~(size_t)15)

/* ---- memory: these abort the process on out-of-memory, never return NULL */
void *cm_malloc(size_t n);
void *cm_calloc(size_t nmemb, size_t size);
void *cm_realloc(void *p, size_t n);
char *cm_strdup(const char *s);
char *cm_strndup(const char *s, size_t n);
/* printf into a fresh heap string (caller frees). */
char *cm_asprintf(const char *fmt, ...) CM_PRINTF(1, 2);
/* The whole file at path, at most max bytes (heap, NUL-terminated beyond *len; caller frees). NULL + *err (heap,
 * "PATH: cannot open: ...", "PATH: read error", "PATH: larger than MAX bytes") on failure. */
char *cm_read_file(const char *path, size_t max, size_t *len, char **err);

/* ---- capped byte buffer (curl's dynbuf idea): the cap is set at init and
 * going over it is an error, not a realloc. Always NUL-terminated when
 * data != NULL (the terminator is not counted in len nor in max). */
struct cm_buf {
    char *data;
    size_t len;
    size_t cap;
    size_t max;
    bool counted; /* its capacity is charged to the buffer budget (cm_buffers_*) */
};
void cm_buf_init(struct cm_buf *b, size_t max);
/* Same, and the buffer's capacity is charged to the process's buffer budget as it grows: an append that would take
 * the budget over its limit fails like one over max; cm_buf_free gives the charge back. After cm_buf_take the taker
 * owns the charge (cm_buf_charged before the take) and gives it back with cm_buffers_release. Moving the struct
 * moves the charge. */
void cm_buf_init_counted(struct cm_buf *b, size_t max);
/* Bytes of the budget b holds (0 when not counted). */
size_t cm_buf_charged(const struct cm_buf *b);
/* Returns false (buffer unchanged) when len + n would exceed max. */
bool cm_buf_append(struct cm_buf *b, const void *p, size_t n) CM_MUST_CHECK;
bool cm_buf_appendf(struct cm_buf *b, const char *fmt, ...) CM_PRINTF(2, 3) CM_MUST_CHECK;
void cm_buf_reset(struct cm_buf *b);
void cm_buf_free(struct cm_buf *b);
/* Hands the heap data to the caller (may be NULL when empty) and resets b. */
char *cm_buf_take(struct cm_buf *b, size_t *len);

/* ---- the process's buffer budget (SPEC 7 limits.buffers): bytes of request bodies and answers held in memory,
 * charged by counted buffers while a body is read and an answer is read, stored and written. Any thread. */
/* The limit; 0 (the default) is no limit. */
void cm_buffers_set_limit(uint64_t limit);
uint64_t cm_buffers_used(void);
/* Whether a request needing need more bytes may start: used + need stays below the limit (nothing is charged). */
bool cm_buffers_admit(uint64_t need);
/* Charges n bytes unless that would take the budget over its limit (then false, nothing charged). */
bool cm_buffers_try_charge(uint64_t n) CM_MUST_CHECK;
void cm_buffers_release(uint64_t n);

/* ---- ordered header list; names keep the case they arrived with. The strings live in chunks the list owns
 * (a few allocations per list instead of one per header); they stay where they are until cm_hdrs_free. */
struct cm_hdr {
    char *name;
    char *value;
};
struct cm_hdr_chunk;
struct cm_hdrs {
    struct cm_hdr *v;
    size_t n;
    size_t cap;
    struct cm_hdr_chunk *chunk; /* the newest, which takes the next strings; older ones behind it */
};
void cm_hdrs_init(struct cm_hdrs *h);
void cm_hdrs_free(struct cm_hdrs *h);
void cm_hdrs_add(struct cm_hdrs *h, const char *name, const char *value);
void cm_hdrs_addn(struct cm_hdrs *h, const char *name, size_t nlen, const char *value, size_t vlen);
/* First value of a header (case-insensitive name), or NULL. */
const char *cm_hdrs_get(const struct cm_hdrs *h, const char *name);
/* Removes every header whose name matches (case-insensitive); returns count. */
size_t cm_hdrs_remove(struct cm_hdrs *h, const char *name);
/* True for the RFC 9110 7.6.1 hop-by-hop set: Connection, Keep-Alive,
 * Proxy-Connection, Proxy-Authenticate, Proxy-Authorization, TE, Trailer,
 * Transfer-Encoding, Upgrade. */
bool cm_is_hop_by_hop(const char *name);
/* Removes the hop-by-hop set and every header named in any Connection header. */
void cm_hdrs_strip_hop_by_hop(struct cm_hdrs *h);

/* ---- an upstream response, as stored and replayed. */
struct cm_resp {
    int status;
    struct cm_hdrs hdrs;
    struct cm_buf body;
};
void cm_resp_init(struct cm_resp *r, size_t max_body);
void cm_resp_free(struct cm_resp *r);
/* Serialises r into out ("IGR1" framing, length-prefixed, big-endian).
 * Returns false when out's cap is exceeded. */
bool cm_resp_encode(const struct cm_resp *r, struct cm_buf *out) CM_MUST_CHECK;
/* Parses a blob made by cm_resp_encode into r (initialised here; caller frees
 * with cm_resp_free even on failure). Returns false on any malformed input. */
bool cm_resp_decode(const void *data, size_t len, struct cm_resp *r) CM_MUST_CHECK;

/* ---- logging: one line per event on stderr, key=value pairs.
 * cm_log(CM_INFO, "start", "listen=%s routes=%zu", ...) prints
 * ts=2026-11-30T03:24:05.123Z level=info event=start listen=... routes=2 */
enum cm_level { CM_DEBUG, CM_INFO, CM_WARN, CM_ERROR };
void cm_log_set_level(enum cm_level min);
void cm_log(enum cm_level lvl, const char *event, const char *fmt, ...) CM_PRINTF(3, 4);
void cm_logv(enum cm_level lvl, const char *event, const char *fmt, va_list ap);
/* Writes s as a quoted log value ("..." with \" \\ \n escaped, control bytes
 * as \xNN) into out (size n, always terminated, truncated to fit). */
const char *cm_log_quote(char *out, size_t n, const char *s);
/* The format of every log line (log_format): logfmt (the default) or one JSON object a line. */
enum cm_log_format { CM_LOG_LOGFMT, CM_LOG_JSON };
void cm_log_set_format(enum cm_log_format f);
enum cm_log_format cm_log_get_format(void);
/* Writes a line's head "ts=... level=LVL event=EVENT" into out (size n, terminated); returns its length. */
size_t cm_log_head(char *out, size_t n, enum cm_level lvl, const char *event);
/* Rewrites one logfmt line in[0..n) (key=value pairs, values bare or quoted as cm_log_quote writes them, without
 * the '\n') as one JSON object into out (size cap, terminated, ending in '\n'); bare values of digits (an optional
 * '-' and at most one '.') become numbers, true/false booleans, the rest strings. Returns the length written, 0
 * when it does not fit. */
size_t cm_logfmt_to_json(const char *in, size_t n, char *out, size_t cap);
/* Copies a URL with any password replaced by "***" into out. */
const char *cm_redact_url(char *out, size_t n, const char *url);

/* ---- hashing (OpenSSL EVP). */
/* FNV-1a, 64 bits, for in-memory hash tables (not for anything an attacker must not steer): continues h over
 * p[0..n), start from CM_FNV1A_INIT. */
#define CM_FNV1A_INIT 1469598103934665603ULL
uint64_t cm_fnv1a(uint64_t h, const void *p, size_t n);

struct cm_sha256 {
    void *ctx;
};
void cm_sha256_init(struct cm_sha256 *h);
void cm_sha256_update(struct cm_sha256 *h, const void *p, size_t n);
/* Length-prefixed part: 8-byte big-endian length, then the bytes, so that no
 * two different part lists hash alike by concatenation. */
void cm_sha256_part(struct cm_sha256 *h, const void *p, size_t n);
void cm_sha256_final(struct cm_sha256 *h, uint8_t out[32]);
void cm_sha256(const void *p, size_t n, uint8_t out[32]);
/* Lower-case hex of n bytes into out (2n+1 bytes). */
void cm_hex(const uint8_t *in, size_t n, char *out);
/* The value of hex digit c (either case), or -1. */
int cm_hexval(unsigned char c);
/* The value of base64 character c (RFC 4648 4; url: the URL alphabet of 5, '-' and '_'), or -1 ('=' too). */
int cm_b64val(unsigned char c, bool url);
/* Constant-time comparison of two byte strings (length leaks only). */
bool cm_consttime_eq(const void *a, size_t alen, const void *b, size_t blen);
/* 63-bit random token from the OS CSPRNG (never 0). */
uint64_t cm_random_token(void);
/* Request ids (SPEC 11): a new one is 128 random bits (the same CSPRNG blocks) as 32 lower-case hex digits into out
 * (terminated); one taken from a trusted proxy is 1 to CM_REQUEST_ID_MAX visible ASCII bytes (cm_request_id_ok). */
#define CM_REQUEST_ID_MAX     128
#define CM_REQUEST_ID_NEW_LEN 32
void cm_request_id_new(char out[CM_REQUEST_ID_NEW_LEN + 1]);
bool cm_request_id_ok(const char *s, size_t n);

/* ---- HTTP syntax, one rule set for every room (RFC 9110 5.1, 5.5) */
/* tchar: ALPHA / DIGIT / one of !#$%&'*+-.^_`|~ */
bool cm_is_tchar(unsigned char ch);
/* s[0..n) is a token: 1*tchar. */
bool cm_token_ok(const char *s, size_t n);
/* s[0..n) may be a field value: no control byte but HTAB, no DEL (obs-text 0x80-0xff is allowed). */
bool cm_field_value_ok(const char *s, size_t n);

/* ---- time */
uint64_t cm_now_ms(void); /* monotonic */
/* True when a period that began at since_ms (0: none running) has lasted more than limit_ms at now_ms. A since_ms
 * later than now_ms (stored by another thread after now_ms was read) has not. */
bool cm_overdue(uint64_t since_ms, uint64_t now_ms, uint64_t limit_ms);
/* 1 to max_digits (at most 19) ASCII decimal digits, nothing else, into *out. */
bool cm_parse_digits(const char *s, size_t n, size_t max_digits, uint64_t *out);
uint64_t cm_wall_ms(void); /* unix epoch */
/* RFC 9110 5.6.7 IMF-fixdate of unix_s ("Sun, 06 Nov 1994 08:49:37 GMT", C locale names) into out. false (out
 * undefined) for a time gmtime cannot give or past year 9999. */
#define CM_IMF_FIXDATE_LEN 29
bool cm_imf_fixdate(uint64_t unix_s, char out[CM_IMF_FIXDATE_LEN + 1]);

#endif
