/* addr.h - IP addresses and CIDR blocks (trusted_proxies): parsing, membership, and the X-Forwarded-For walk that
 * finds a request's real client. Pure functions, never I/O. */
#ifndef IDEMGATE_CM_ADDR_H
#define IDEMGATE_CM_ADDR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

struct sockaddr;

/* One address. An IPv4-mapped IPv6 address (::ffff:a.b.c.d) is held as the IPv4 address it maps, so a peer that
 * reaches a dual-stack socket matches the IPv4 blocks. */
struct cm_ip {
    bool v4;       /* b[0..4) is an IPv4 address; else b[0..16) an IPv6 one */
    uint8_t b[16]; /* network order */
};

/* A block: net with its host bits zero, bits 0..32 (v4) or 0..128 (v6). */
struct cm_cidr {
    struct cm_ip net;
    uint8_t bits;
};

/* An address written as an IPv4 dotted quad or an IPv6 address (RFC 4291 text, no zone, no brackets) in s[0..n).
 * false: anything else. */
bool cm_ip_parse(const char *s, size_t n, struct cm_ip *out) CM_MUST_CHECK;

/* The address of an AF_INET or AF_INET6 socket address; false for any other family. */
bool cm_ip_from_sockaddr(const struct sockaddr *sa, struct cm_ip *out) CM_MUST_CHECK;

/* The address as text (dotted quad, or RFC 5952 IPv6) into out (at least 46 bytes); returns out. */
const char *cm_ip_format(const struct cm_ip *ip, char *out, size_t n);

/* A block "ADDR/BITS" or a bare address (/32 or /128) in s. Returns NULL when sound, else a constant reason: not
 * an address, a prefix length out of range or not plain decimal, or host bits set beyond the prefix (10.0.0.1/8:
 * a typo for /32 or for 10.0.0.0/8, refused rather than guessed). An IPv4-mapped block (::ffff:0:0/96 and longer)
 * is the IPv4 block it maps. */
const char *cm_cidr_parse(const char *s, struct cm_cidr *out) CM_MUST_CHECK;

/* Whether ip is inside one of the n blocks (an IPv4 address only in IPv4 blocks, an IPv6 one in IPv6 blocks). */
bool cm_cidr_match(const struct cm_cidr *v, size_t n, const struct cm_ip *ip);

/* One step of the X-Forwarded-For walk over one field value x[0..n), its entries taken right to left: each entry
 * (an address, optionally "IPv4:port", "[IPv6]" or "[IPv6]:port", spaces around it ignored) becomes *client; the
 * walk stops at the first entry outside the blocks v[0..nv) or at a malformed entry (which is not taken, so
 * *client stays the last good one: nginx's real_ip_recursive). Returns true when every entry of x was a trusted
 * address (the walk goes on into the field before this one), false when it stopped. */
bool cm_xff_walk(const char *x, size_t n, const struct cm_cidr *v, size_t nv, struct cm_ip *client);

#endif
