/* addr_test.c - IP addresses, CIDR blocks and the X-Forwarded-For walk (common/addr.c): table-driven. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <string.h>

#include "common/addr.h"

static struct cm_cidr block(const char *s)
{
    struct cm_cidr c;
    const char *why = cm_cidr_parse(s, &c);
    cr_assert_null(why, "%s: %s", s, why ? why : "");
    return c;
}

static struct cm_ip ip(const char *s)
{
    struct cm_ip a;
    cr_assert(cm_ip_parse(s, strlen(s), &a), "%s", s);
    return a;
}

Test(cidr, blocks_parse_and_match)
{
    static const struct {
        const char *block, *addr;
        bool in;
    } cases[] = {
        {"10.0.0.0/8", "10.255.1.2", true},
        {"10.0.0.0/8", "11.0.0.1", false},
        {"10.0.0.0/8", "::ffff:10.1.1.1", true}, /* a mapped address is its IPv4 address */
        {"::ffff:10.0.0.0/104", "10.200.0.1", true},
        {"::ffff:10.0.0.0/104", "11.0.0.1", false},
        {"192.168.1.7", "192.168.1.7", true}, /* a bare address is /32 */
        {"192.168.1.7", "192.168.1.8", false},
        {"192.168.1.7/32", "192.168.1.7", true},
        {"172.16.0.0/12", "172.31.255.255", true},
        {"172.16.0.0/12", "172.32.0.0", false},
        {"10.0.0.128/25", "10.0.0.200", true},
        {"10.0.0.128/25", "10.0.0.127", false},
        {"0.0.0.0/0", "203.0.113.9", true},
        {"0.0.0.0/0", "2001:db8::1", false}, /* an IPv4 block never holds an IPv6 address */
        {"::/0", "2001:db8::1", true},
        {"::/0", "203.0.113.9", false}, /* nor an IPv6 block an IPv4 one */
        {"::1", "::1", true},
        {"::1", "::2", false},
        {"::1/128", "::1", true},
        {"fd00::/8", "fdff:1::1", true},
        {"fd00::/8", "fe00::1", false},
        {"2001:db8::/33", "2001:db8:7fff::1", true},
        {"2001:db8::/33", "2001:db8:8000::1", false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct cm_cidr c = block(cases[i].block);
        struct cm_ip a = ip(cases[i].addr);
        cr_expect_eq(cm_cidr_match(&c, 1, &a), cases[i].in, "%s in %s", cases[i].addr, cases[i].block);
    }
    struct cm_cidr two[2] = {block("10.0.0.0/8"), block("fd00::/8")};
    struct cm_ip a = ip("fd12::3");
    cr_expect(cm_cidr_match(two, 2, &a));
    cr_expect(!cm_cidr_match(two, 0, &a), "an empty list holds nothing");
}

Test(cidr, bad_blocks_are_refused_with_a_reason)
{
    static const char *const bad[] = {
        "",
        "10.0.0.0/33",
        "10.0.0.1/8",
        "10.0.0.0/",
        "10.0.0.0/08",
        "10.0.0.0/-1",
        "10.0.0.0/8/8",
        "10.0.0/8",
        "010.0.0.0/8",
        "localhost",
        "10.0.0.0/ 8",
        " 10.0.0.0/8",
        "fe80::/129",
        "fe80::1/64",
        "fe80::%1/64",
        "[::1]/128",
        "::ffff:10.0.0.0/95",
        "1.2.3.4:80",
        "10.0.0.0/1000",
        "1.2.3.256",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct cm_cidr c;
        const char *why = cm_cidr_parse(bad[i], &c);
        cr_expect_not_null(why, "'%s' was accepted", bad[i]);
    }
    struct cm_cidr c;
    cr_expect(strstr(cm_cidr_parse("10.0.0.1/8", &c), "bits set beyond"));
    cr_expect(strstr(cm_cidr_parse("10.0.0.0/33", &c), "at most 32"));
}

Test(cidr, addresses_from_sockets_and_as_text)
{
    struct sockaddr_in6 s6;
    memset(&s6, 0, sizeof s6);
    s6.sin6_family = AF_INET6;
    cr_assert_eq(inet_pton(AF_INET6, "::ffff:127.0.0.1", &s6.sin6_addr), 1);
    struct cm_ip a;
    cr_assert(cm_ip_from_sockaddr((const struct sockaddr *)&s6, &a));
    char t[64];
    cr_expect(a.v4, "a mapped peer is an IPv4 one");
    cr_expect_str_eq(cm_ip_format(&a, t, sizeof t), "127.0.0.1");
    struct cm_cidr lo = block("127.0.0.0/8");
    cr_expect(cm_cidr_match(&lo, 1, &a), "and matches IPv4 blocks");
    struct sockaddr_in s4;
    memset(&s4, 0, sizeof s4);
    s4.sin_family = AF_INET;
    cr_assert_eq(inet_pton(AF_INET, "192.0.2.3", &s4.sin_addr), 1);
    cr_assert(cm_ip_from_sockaddr((const struct sockaddr *)&s4, &a));
    cr_expect_str_eq(cm_ip_format(&a, t, sizeof t), "192.0.2.3");
    a = ip("2001:0db8:0000::0001");
    cr_expect_str_eq(cm_ip_format(&a, t, sizeof t), "2001:db8::1", "RFC 5952 form");
    struct sockaddr un = {.sa_family = AF_UNIX};
    cr_expect(!cm_ip_from_sockaddr(&un, &a));
    cr_expect(!cm_ip_from_sockaddr(NULL, &a));
}

Test(xff, the_walk_finds_the_rightmost_untrusted_address)
{
    struct cm_cidr tp[2] = {block("10.0.0.0/8"), block("fd00::/8")};
    static const struct {
        const char *xff, *client;
        bool goes_on;
    } cases[] = {
        {"203.0.113.7", "203.0.113.7", false},
        {"198.51.100.1, 203.0.113.7, 10.0.0.1", "203.0.113.7", false},
        {"10.0.0.2,10.0.0.1", "10.0.0.2", true},            /* all trusted: the leftmost, and on to the next field */
        {"203.0.113.7, junk, 10.0.0.1", "10.0.0.1", false}, /* malformed: stop at the last good one */
        {"203.0.113.7, 10.0.0.1, junk", "peer", false},     /* the rightmost malformed: nothing taken */
        {"203.0.113.7:4711, 10.0.0.1:80", "203.0.113.7", false},
        {"[2001:db8::5]:443, [fd00::1]", "2001:db8::5", false},
        {"2001:db8::6, fd00::2", "2001:db8::6", false},
        {"::ffff:203.0.113.8, ::ffff:10.0.0.9", "203.0.113.8", false},
        {"203.0.113.7, , 10.0.0.1,", "203.0.113.7", false}, /* empty elements are ignored */
        {"", "peer", true},
        {"unknown", "peer", false},
        {"_hidden, 10.0.0.1", "10.0.0.1", false},
        {"1.2.3.4:99999, 10.0.0.1", "10.0.0.1", false},
        {"[2001:db8::5, 10.0.0.1", "10.0.0.1", false},
        {"2001:db8::5:80x, 10.0.0.1", "10.0.0.1", false},
        {"1.2.3.4 5.6.7.8", "peer", false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct cm_ip c = ip("192.0.2.250"); /* stands for the peer */
        bool on = cm_xff_walk(cases[i].xff, strlen(cases[i].xff), tp, 2, &c);
        char t[64];
        cm_ip_format(&c, t, sizeof t);
        const char *want = strcmp(cases[i].client, "peer") == 0 ? "192.0.2.250" : cases[i].client;
        cr_expect_str_eq(t, want, "'%s'", cases[i].xff);
        cr_expect_eq(on, cases[i].goes_on, "'%s': goes on", cases[i].xff);
    }
}
