/* addr.c - IP addresses, CIDR blocks and the X-Forwarded-For walk (common/addr.h). */
#include "common/addr.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

static const uint8_t v4mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};

/* A 16-byte IPv6 address into out, an IPv4-mapped one as its IPv4 address. */
static void from_v6(const uint8_t b[16], struct cm_ip *out)
{
    memset(out, 0, sizeof *out);
    out->v4 = memcmp(b, v4mapped, sizeof v4mapped) == 0;
    if (out->v4)
        memcpy(out->b, b + 12, 4);
    else
        memcpy(out->b, b, 16);
}

bool cm_ip_parse(const char *s, size_t n, struct cm_ip *out)
{
    char buf[INET6_ADDRSTRLEN];
    if (n == 0 || n >= sizeof buf)
        return false;
    memcpy(buf, s, n);
    buf[n] = '\0';
    uint8_t b[16];
    if (inet_pton(AF_INET, buf, b) == 1) {
        memset(out, 0, sizeof *out);
        out->v4 = true;
        memcpy(out->b, b, 4);
        return true;
    }
    if (!memchr(buf, ':', n) || inet_pton(AF_INET6, buf, b) != 1)
        return false;
    from_v6(b, out);
    return true;
}

bool cm_ip_from_sockaddr(const struct sockaddr *sa, struct cm_ip *out)
{
    if (sa == NULL)
        return false;
    if (sa->sa_family == AF_INET) {
        memset(out, 0, sizeof *out);
        out->v4 = true;
        memcpy(out->b, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, 4);
        return true;
    }
    if (sa->sa_family == AF_INET6) {
        from_v6((const uint8_t *)&((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr, out);
        return true;
    }
    return false;
}

const char *cm_ip_format(const struct cm_ip *ip, char *out, size_t n)
{
    if (!inet_ntop(ip->v4 ? AF_INET : AF_INET6, ip->b, out, (socklen_t)n))
        snprintf(out, n, "unknown");
    return out;
}

const char *cm_cidr_parse(const char *s, struct cm_cidr *out)
{
    const char *slash = strchr(s, '/');
    size_t alen = slash ? (size_t)(slash - s) : strlen(s);
    struct cm_ip ip;
    if (!cm_ip_parse(s, alen, &ip))
        return "not an IPv4 or IPv6 address (a CIDR is ADDRESS/BITS, or a bare address)";
    /* a mapped block written in IPv6 counts its bits over 128: its IPv4 block has 96 fewer */
    bool mapped = !ip.v4 ? false : memchr(s, ':', alen) != NULL;
    unsigned max = ip.v4 ? 32 : 128, bits = max;
    if (slash) {
        const char *p = slash + 1;
        size_t dn = strlen(p);
        if (dn == 0 || dn > 3 || (dn > 1 && p[0] == '0'))
            return "the prefix length after '/' must be a plain decimal number";
        bits = 0;
        for (size_t i = 0; i < dn; i++) {
            if (p[i] < '0' || p[i] > '9')
                return "the prefix length after '/' must be a plain decimal number";
            bits = bits * 10 + (unsigned)(p[i] - '0');
        }
        if (mapped) {
            if (bits > 128)
                return "the prefix length of an IPv6 block is at most 128";
            if (bits < 96)
                return "an IPv4-mapped block needs a prefix length of at least 96 (or write the IPv4 block)";
            bits -= 96;
        }
        if (bits > max)
            return ip.v4 ? "the prefix length of an IPv4 block is at most 32"
                         : "the prefix length of an IPv6 block is at most 128";
    }
    size_t nb = ip.v4 ? 4 : 16;
    for (size_t i = 0; i < nb; i++) {
        unsigned keep = bits >= 8 * (i + 1) ? 8 : bits > 8 * i ? bits - 8 * (unsigned)i : 0;
        uint8_t mask = (uint8_t)(keep == 0 ? 0 : 0xff << (8 - keep));
        if (ip.b[i] & (uint8_t)~mask)
            return "the address has bits set beyond the prefix length (write the block's first address, or a bare "
                   "address for one host)";
    }
    out->net = ip;
    out->bits = (uint8_t)bits;
    return NULL;
}

static bool in_block(const struct cm_cidr *c, const struct cm_ip *ip)
{
    if (c->net.v4 != ip->v4)
        return false;
    unsigned full = c->bits / 8, rest = c->bits % 8;
    if (memcmp(c->net.b, ip->b, full) != 0)
        return false;
    if (rest == 0)
        return true;
    uint8_t mask = (uint8_t)(0xff << (8 - rest));
    return (ip->b[full] & mask) == c->net.b[full];
}

bool cm_cidr_match(const struct cm_cidr *v, size_t n, const struct cm_ip *ip)
{
    for (size_t i = 0; i < n; i++)
        if (in_block(&v[i], ip))
            return true;
    return false;
}

/* A port p[0..n): 1 to 5 digits, at most 65535. */
static bool port_ok(const char *p, size_t n)
{
    if (n == 0 || n > 5)
        return false;
    unsigned v = 0;
    for (size_t i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9')
            return false;
        v = v * 10 + (unsigned)(p[i] - '0');
    }
    return v <= 65535;
}

/* One X-Forwarded-For entry e[0..n) (trimmed): an address, "IPv4:port", "[IPv6]" or "[IPv6]:port". */
static bool xff_entry(const char *e, size_t n, struct cm_ip *out)
{
    if (n > 0 && e[0] == '[') {
        const char *close = memchr(e, ']', n);
        if (!close)
            return false;
        size_t after = n - (size_t)(close - e) - 1;
        if (after > 0 && (close[1] != ':' || !port_ok(close + 2, after - 1)))
            return false;
        return memchr(e + 1, ':', (size_t)(close - e - 1)) && cm_ip_parse(e + 1, (size_t)(close - e - 1), out);
    }
    const char *colon = memchr(e, ':', n);
    if (colon && !memchr(colon + 1, ':', n - (size_t)(colon - e) - 1)) { /* one colon: IPv4:port */
        if (!port_ok(colon + 1, n - (size_t)(colon - e) - 1))
            return false;
        return cm_ip_parse(e, (size_t)(colon - e), out) && out->v4 && !memchr(e, ':', (size_t)(colon - e));
    }
    return cm_ip_parse(e, n, out);
}

bool cm_xff_walk(const char *x, size_t n, const struct cm_cidr *v, size_t nv, struct cm_ip *client)
{
    size_t end = n;
    while (end > 0) {
        size_t start = end;
        while (start > 0 && x[start - 1] != ',')
            start--;
        size_t a = start, b = end;
        while (a < b && (x[a] == ' ' || x[a] == '\t'))
            a++;
        while (b > a && (x[b - 1] == ' ' || x[b - 1] == '\t'))
            b--;
        end = start > 0 ? start - 1 : 0;
        if (a == b) { /* an empty element ("a, , b"): RFC 9110 5.6.1 lets a recipient ignore it */
            if (start == 0)
                break;
            continue;
        }
        struct cm_ip ip;
        if (!xff_entry(x + a, b - a, &ip))
            return false; /* malformed: the walk stops at the last good address */
        *client = ip;
        if (!cm_cidr_match(v, nv, &ip))
            return false;
        if (start == 0)
            break;
    }
    return true;
}
