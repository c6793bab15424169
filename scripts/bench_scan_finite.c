/* Dev harness (not part of the product): ways to read every tensor of a
 * checkpoint for the finite scan, timed.
 *
 *   cc -O3 -Iinclude scripts/bench_scan_finite.c build-cpu/libbakron.a \
 *      -lzstd -lcjson -lm -lpthread -o /tmp/bench_scan_finite
 *   /tmp/bench_scan_finite MODEL VARIANT THREADS [--touch-after]
 *
 * VARIANT: lib (bk_st_set_check_finite as built), touch (the mapping, 32 MiB
 * chunks), touchbig (256 MiB chunks), willneed (MADV_WILLNEED|SEQUENTIAL on
 * each file, then touch), populate (MADV_POPULATE_READ of each chunk, then
 * touch), pread (pread() 4 MiB pieces into a per-thread buffer).
 * --touch-after: then read one byte per 4 KiB page of every tensor through
 * the mapping on one thread (what the later weight reads pay for pages the
 * scan did not map). Prints seconds. Tensors must start at data offset 0 of
 * their file's tensor area in file order (true for the synthetic files). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "bakron/safetensors.h"
#include "bakron/status.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

typedef struct {
    const unsigned char *p; /* mapping */
    uint64_t off;           /* file offset of p */
    uint64_t n;             /* bytes */
    int fd;
} piece;

static piece *pieces;
static size_t npieces, next_piece;
static int variant;
static volatile uint64_t sink;
static size_t pagesz;

static uint64_t scan_bf16(const unsigned char *p, uint64_t n)
{
    /* the library's block test (src/dtype.c BK_FINITE_SCAN) */
    unsigned any = 0;
    const uint64_t ne = n / 2;
    for (uint64_t b0 = 0; b0 < ne && !any; b0 += 4096) {
        const uint64_t b1 = ne - b0 < 4096 ? ne : b0 + 4096;
        for (uint64_t i = b0; i < b1; i++) {
            uint16_t u;
            memcpy(&u, p + 2 * i, 2);
            any |= (unsigned)((u & 0x7f80u) == 0x7f80u);
        }
    }
    return any;
}

static void *worker(void *arg)
{
    (void)arg;
    const size_t bufn = 4u << 20;
    unsigned char *buf = variant == 5 ? aligned_alloc(4096, bufn) : NULL;
    uint64_t bad = 0;
    for (;;) {
        size_t c = __atomic_fetch_add(&next_piece, 1, __ATOMIC_RELAXED);
        if (c >= npieces)
            break;
        const piece *q = &pieces[c];
        if (variant == 4) {
            uintptr_t a = (uintptr_t)q->p & ~(uintptr_t)(pagesz - 1);
            if (madvise((void *)a, (uintptr_t)q->p + q->n - a, MADV_POPULATE_READ) != 0) {
                perror("madvise POPULATE_READ");
                exit(1);
            }
        }
        if (variant == 5) {
            for (uint64_t o = 0; o < q->n; o += bufn) {
                size_t k = q->n - o < bufn ? (size_t)(q->n - o) : bufn;
                ssize_t r = pread(q->fd, buf, k, (off_t)(q->off + o));
                if (r != (ssize_t)k) {
                    perror("pread");
                    exit(1);
                }
                bad |= scan_bf16(buf, k);
            }
        } else {
            bad |= scan_bf16(q->p, q->n);
        }
    }
    free(buf);
    sink += bad;
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL VARIANT THREADS [--touch-after]\n", argv[0]);
        return 1;
    }
    pagesz = (size_t)sysconf(_SC_PAGESIZE);
    const char *names[] = {"lib", "touch", "touchbig", "willneed", "populate", "pread"};
    variant = -1;
    for (int i = 0; i < 6; i++)
        if (!strcmp(argv[2], names[i]))
            variant = i;
    if (variant < 0)
        return 1;
    int nth = atoi(argv[3]);
    int after = argc > 4 && !strcmp(argv[4], "--touch-after");
    bk_st_set *s;
    if (bk_st_set_open(argv[1], &s) != BK_OK) {
        fprintf(stderr, "%s\n", bk_last_error());
        return 1;
    }
    struct rusage ru0, ru1;
    getrusage(RUSAGE_SELF, &ru0);
    double t0 = now();
    if (variant == 0) {
        if (bk_st_set_check_finite(s) != BK_OK)
            fprintf(stderr, "%s\n", bk_last_error());
    } else {
        const uint64_t chunk = variant == 2 ? 256ull << 20 : 32ull << 20;
        size_t cap = 1 << 16;
        pieces = malloc(cap * sizeof *pieces);
        for (size_t f = 0; f < bk_st_set_file_count(s); f++) {
            const bk_st_file *sf = bk_st_set_file(s, f);
            int fd = open(bk_st_path(sf), O_RDONLY);
            const unsigned char *t0p = bk_st_tensor(sf, 0)->data;
            const uint64_t base_off = 8 + bk_st_header_size(sf); /* tensor 0 at offset 0 */
            if (variant == 3) {
                const bk_tensor_info *tl = bk_st_tensor(sf, bk_st_count(sf) - 1);
                uintptr_t a = (uintptr_t)t0p & ~(uintptr_t)(pagesz - 1);
                uintptr_t e = (uintptr_t)tl->data + tl->nbytes;
                madvise((void *)a, e - a, MADV_SEQUENTIAL);
                madvise((void *)a, e - a, MADV_WILLNEED);
            }
            for (size_t i = 0; i < bk_st_count(sf); i++) {
                const bk_tensor_info *t = bk_st_tensor(sf, i);
                for (uint64_t b = 0; b < t->nbytes; b += chunk) {
                    piece q = {(const unsigned char *)t->data + b,
                               base_off + (uint64_t)((const unsigned char *)t->data - t0p) + b,
                               t->nbytes - b < chunk ? t->nbytes - b : chunk, fd};
                    pieces[npieces++] = q;
                }
            }
        }
        pthread_t tid[64];
        for (int k = 1; k < nth; k++)
            pthread_create(&tid[k], NULL, worker, NULL);
        worker(NULL);
        for (int k = 1; k < nth; k++)
            pthread_join(tid[k], NULL);
    }
    double t1 = now();
    getrusage(RUSAGE_SELF, &ru1);
    double ta = 0;
    if (after) {
        uint64_t x = 0;
        for (size_t i = 0; i < bk_st_set_count(s); i++) {
            const bk_tensor_info *t = bk_st_set_tensor(s, i);
            const volatile unsigned char *p = t->data;
            for (uint64_t o = 0; o < t->nbytes; o += pagesz)
                x += p[o];
        }
        sink += x;
        ta = now() - t1;
    }
    printf("%s threads=%d scan %.3f s (%.2f GB/s, %ld minor %ld major faults)%s", argv[2],
           nth, t1 - t0, bk_st_set_total_bytes(s) / (t1 - t0) / 1e9,
           ru1.ru_minflt - ru0.ru_minflt, ru1.ru_majflt - ru0.ru_majflt, after ? "" : "\n");
    if (after)
        printf(" touch-after %.3f s\n", ta);
    bk_st_set_close(s);
    return 0;
}
