/* body_pattern.h - the bytes of testupstream's X-Test-Body-Size answers (binary, a NUL every 64 bytes), one
 * definition for the test upstream that sends them and the tests that check them. */
#ifndef IDEMGATE_TESTS_BODY_PATTERN_H
#define IDEMGATE_TESTS_BODY_PATTERN_H

#include <stdint.h>

static inline uint64_t test_splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static inline uint8_t test_body_byte(uint64_t i)
{
    if (i % 64 == 1)
        return 0;
    return (uint8_t)(test_splitmix64(i / 8) >> (8 * (i % 8)));
}

#endif
