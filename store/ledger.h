/* ledger.h - a route's records read in pages for the reconcile command (SPEC 12): blocking, one session of its
 * own (never the loops' pool), keyset paging over the primary key, every statement bounded. Read only. */
#ifndef IDEMGATE_STORE_LEDGER_H
#define IDEMGATE_STORE_LEDGER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

struct store_ledger;

enum store_ledger_state {
    STORE_LEDGER_COMPLETED, /* completed (within retention or not) */
    STORE_LEDGER_UNKNOWN,   /* an unknown outcome: state unknown, or in flight with a lapsed lease */
    STORE_LEDGER_ALL,       /* both (a live in-flight claim is never listed) */
};

struct store_ledger_rec {
    uint8_t scope[32];
    char *key; /* heap, key_len bytes + NUL */
    size_t key_len;
    bool completed;     /* else an unknown outcome */
    int status;         /* the stored answer's status (completed), else 0 */
    int64_t created_ms; /* the claim's time, unix ms */
};

/* Opens a session on postgres_url (statements bounded by timeout_ms). NULL with *err (heap) on failure. */
struct store_ledger *store_ledger_open(const char *postgres_url, uint64_t timeout_ms, char **err);
/* Closes it and frees the cursor; NULL is a no-op. */
void store_ledger_close(struct store_ledger *l);

/* The next page of route's records claimed within the last since_ms, of the states st, in primary-key order after
 * the last record of the previous page (the first call starts at the beginning): at most max records into *out
 * (heap array, caller frees with store_ledger_recs_free), *n of them; *n < max means it was the last page. false
 * with *err (heap) when Postgres failed. */
bool store_ledger_page(struct store_ledger *l, const char *route, uint64_t since_ms, enum store_ledger_state st,
                       size_t max, struct store_ledger_rec **out, size_t *n, char **err) CM_MUST_CHECK;
void store_ledger_recs_free(struct store_ledger_rec *v, size_t n);

#endif
