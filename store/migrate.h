/* migrate.h - the blocking start-up work before any loop runs: the schema and its migration, the routes' identities;
 * one connection of its own, never the pool, never a loop. store.h includes it. */
#ifndef IDEMGATE_STORE_MIGRATE_H
#define IDEMGATE_STORE_MIGRATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "conf/conf.h"

struct conf;

/* Creates or migrates the schema with a blocking connection, under a
 * Postgres advisory lock (safe when several instances start at once).
 * distributed CONF_DIST_CITUS: the citus extension must be installed, and
 * the tables are distributed (idemgate_keys by key, idemgate_order by
 * resource) unless they already are; CONF_DIST_NONE refuses tables Citus
 * distributes. Returns false with *err (heap, caller frees) on failure. */
bool store_migrate(const char *postgres_url, enum conf_distributed distributed, uint64_t timeout_ms,
                   char **err) CM_MUST_CHECK;

/* A route's identity (conf/identity.h) against the one recorded in Postgres (SPEC 8): each keyed route's is
 * recorded; when one changed and the route has records within retention (completed and not expired, or not
 * settled), the start is refused (false, *refused, *err names the route, what changed and how many records a retry
 * may now miss) unless the route is among accept (naccept names: --accept-identity-change). Call after
 * store_migrate. false without *refused: Postgres failed (*err). *err is heap (caller frees). */
bool store_identity_check(const char *postgres_url, const struct conf *conf, const char *const *accept, size_t naccept,
                          uint64_t timeout_ms, bool *refused, char **err) CM_MUST_CHECK;

/* A blocking session of its own (application_name app), every statement bounded by timeout_ms (statement_timeout),
 * for work outside the loops (start-up, the reconcile command). NULL with *err (heap) when it cannot be had; the
 * caller closes it with PQfinish (libpq's PGconn is struct pg_conn). */
struct pg_conn;
struct pg_conn *store_sync_connect(const char *postgres_url, uint64_t timeout_ms, const char *app, char **err);

#endif
