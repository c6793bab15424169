/* Internal helpers shared by the library and the CLI (not public API). */
#ifndef BK_UTIL_H
#define BK_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/status.h"

/* UTF-8 (src/status.c). The number of bytes of the sequence that lead byte c
 * starts: 1 for ASCII, 2..4, or 0 when c cannot start one (a continuation
 * byte, 0xC0/0xC1, 0xF5..0xFF); for 2..4 the range [*lo, *hi] of the second
 * byte (which excludes overlong forms, surrogates and code points above
 * U+10FFFF), the others being 0x80..0xBF. */
size_t bk_utf8_lead(unsigned char c, unsigned char *lo, unsigned char *hi);
/* Length of the valid UTF-8 sequence at s (n bytes left), 0 if invalid. */
size_t bk_utf8_len(const unsigned char *s, size_t n);
/* Offset of the first invalid UTF-8 sequence in s[0..n), or n if it is valid. */
size_t bk_utf8_invalid_at(const unsigned char *s, size_t n);

/* Monotonic wall clock in seconds. */
double bk_now(void);

/* The host's available memory: MemAvailable of /proc/meminfo, else the
 * free pages, and no more than the process's cgroup memory limits leave
 * (a container's, a batch job's: limit - usage + the file page cache, the
 * least from its group up, v1 or v2); 0 when unknown (also the GPU flow's
 * host budget, cuda/backward.cu). */
uint64_t bk_host_avail_bytes(void);
/* ... from these files (tests): meminfo, the process's cgroup list and the
 * cgroup mount (NULL: no cgroups) */
uint64_t bk__host_avail_bytes_at(const char *meminfo, const char *self_cgroup,
                                 const char *cgroup_root);

/* BK_PROFILE=1: named wall-time accumulators (thread-safe), printed to
 * stderr by bk_prof_print at the end of a quantize run. For finding where
 * time goes; the GPU code synchronizes its stream at each mark only when
 * profiling is on. Keys are string literals. */
int bk_prof_on(void);
void bk_prof_add(const char *key, double seconds);
/* *t = now; adds now - previous *t under key (when on). */
void bk_prof_mark(double *t, const char *key);
void bk_prof_print(void);

/* The 64-bit finalizer of MurmurHash3 (a bijective mix of x's bits). */
static inline uint64_t bk_mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

/* Overflow-checked arithmetic: return 1 on overflow, else store and return 0. */
static inline int bk_mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return __builtin_mul_overflow(a, b, out);
}
static inline int bk_add_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return __builtin_add_overflow(a, b, out);
}

/* malloc of n * size bytes, NULL on overflow or failure. 64-byte aligned;
 * release with free(). */
void *bk_alloc(size_t n, size_t size);
/* Same, zero-filled. */
void *bk_calloc(size_t n, size_t size);

/* "a folder", "a FIFO (named pipe)", "a device", ... for messages. */
#include <sys/types.h>
struct stat;
const char *bk_file_kind(mode_t mode);
/* open(path, O_RDONLY) of a regular file: FIFOs, folders and devices are
 * refused without blocking (the message names what the path is). Returns the
 * descriptor (fstat in *sb when sb), or -1 with the error set (BK_ERR_IO). */
int bk_open_regular(const char *path, struct stat *sb);

/* Read a whole (small) file into a NUL-terminated buffer (caller frees).
 * Refuses files larger than max_bytes. */
bk_status bk_read_file(const char *path, size_t max_bytes, char **buf, size_t *len);
/* bk_read_file, then the text parsed as JSON (all len bytes): *root (the
 * caller deletes it) is NULL when the text is not JSON; the status is only
 * bk_read_file's. */
struct cJSON;
bk_status bk_read_json(const char *path, size_t max_bytes, struct cJSON **root);
/* "a string", "a number", "an array", ... for messages: what the JSON value
 * v is; absent when v is NULL. */
const char *bk_json_kind(const struct cJSON *v, const char *absent);

/* Lexical checks of JSON text that cJSON does not make: the offset of the
 * first raw control character inside a string (*kind 1) or between tokens
 * other than TAB/LF/CR (2), or of a \u0000 escape (3), which cJSON would cut a
 * string at; n when there is none. */
size_t bk_json_problem_at(const unsigned char *s, size_t n, int *kind);
/* The same as an error with status `code` naming `label` (BK_OK when clean). */
bk_status bk_json_check_text(const char *text, size_t len, const char *label, bk_status code);

/* dst = a "/" b (a may be "" or end in '/'). BK_ERR_INVALID_ARG if too long. */
bk_status bk_path_join(char *dst, size_t cap, const char *a, const char *b);
/* 1 if path is an existing directory / regular file. */
int bk_is_dir(const char *path);
int bk_is_file(const char *path);

/* The one size limit for config.json, wherever it is read (the model reader,
 * the output's re-read, inspect, the checks before the work). */
#define BK_CONFIG_MAX_BYTES ((size_t)64 << 20)
/* Does name end with suffix? */
int bk_ends_with(const char *name, const char *suffix);
/* The names in folder dir that keep(name, user) accepts, sorted by strcmp,
 * into *names[*n] (each and the array freed by the caller; out of memory:
 * the list ends where it ran out). -1 (errno set) when the folder cannot be
 * opened, else 0. */
int bk_list_sorted(const char *dir, int (*keep)(const char *name, void *user), void *user,
                   char ***names, size_t *n);

/* mkdir -p. */
bk_status bk_mkdir_p(const char *path);
/* rm -rf (best effort; used to clean temporary output folders). */
void bk_remove_tree(const char *path);

/* Write a whole buffer to path atomically (temp file + fsync + rename). */
bk_status bk_write_file_atomic(const char *path, const void *data, size_t len);

/* Copy a file (used for tokenizer files). */
bk_status bk_copy_file(const char *src, const char *dst);

/* Deterministic PRNG (xoshiro256**), for benchmarks and tests. */
typedef struct bk_rng {
    uint64_t s[4];
} bk_rng;
void bk_rng_seed(bk_rng *r, uint64_t seed);
uint64_t bk_rng_next(bk_rng *r);
/* Uniform in [0, 1). */
double bk_rng_uniform(bk_rng *r);
/* Standard normal. */
double bk_rng_normal(bk_rng *r);

#endif /* BK_UTIL_H */
