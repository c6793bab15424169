/* SHA-256 (FIPS 180-4), for the identity digests of models and calibration
 * data (activation dumps, docs/activations.md). */
#ifndef BK_SHA256_H
#define BK_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct bk_sha256 {
    uint32_t h[8];
    uint64_t len;          /* bytes hashed so far */
    unsigned char buf[64];
    size_t nbuf;
} bk_sha256;

void bk_sha256_init(bk_sha256 *s);
void bk_sha256_update(bk_sha256 *s, const void *data, size_t n);
/* Finish and write the digest as 64 lowercase hex digits and a NUL. */
void bk_sha256_hex(bk_sha256 *s, char hex[65]);
/* Convenience: digest of one buffer. */
void bk_sha256_buf_hex(const void *data, size_t n, char hex[65]);

#endif
