/* h1.h - the built-in HTTP/1.1 client as a backend (http:// origins at an IP literal), and its response parser
 * with no socket behind it for the fuzz target; never libcurl, never the facade. Not for other rooms. */
#ifndef IDEMGATE_UPSTREAM_H1_H
#define IDEMGATE_UPSTREAM_H1_H

#include <stdbool.h>
#include <stddef.h>

#include "common/common.h"

struct up_backend;

extern const struct up_backend up_h1_backend;

/* The h1 response parser with no socket behind it (tests/fuzz/fuzz_h1.c): the answer to a HEAD request when head,
 * its body capped at max_body, its head at max_head (0: UP_DEFAULT_MAX_HEAD). Never NULL; h1_parser_destroy frees
 * it (NULL: no-op). */
struct h1_parser;
struct h1_parser *h1_parser_create(bool head, size_t max_body, size_t max_head);
/* Feeds n bytes, then the peer's close when eof. Returns 1: a complete answer (h1_parser_resp holds it; bytes after
 * it are not parsed), 0: more wanted, -1: refused (malformed, invalid, over a cap). Once non-zero it stays so. */
int h1_parser_feed(struct h1_parser *p, const void *data, size_t n, bool eof);
const struct cm_resp *h1_parser_resp(const struct h1_parser *p);
/* Bytes of the final head counted against max_head (status line and header lines with CR LF). */
size_t h1_parser_head_bytes(const struct h1_parser *p);
void h1_parser_destroy(struct h1_parser *p);

#endif
