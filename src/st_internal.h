/* Internal helpers shared by the safetensors reader and writers (not public API). */
#ifndef BK_ST_INTERNAL_H
#define BK_ST_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/safetensors.h"

/* Largest header the reader accepts (FORMATS.md rule 2). */
#define BK_ST_MAX_HEADER 100000000ull
/* Largest integer accepted in a shape or an offset: 2^53 (exact in a JSON double). */
#define BK_ST_MAX_JSON_INT 9007199254740992.0
/* Largest decompressed image bk_st_open_zst will build (64 GiB). */
#define BK_ST_ZST_MAX_BYTES (64ull << 30)

/* bk_st_open_zst with a smaller bound on the decompressed image (checked
 * against the frame's declared size before anything is allocated); bound_why
 * names where the bound comes from in the error ("the manifest's shapes"). */
bk_status bk_st_open_zst_max(const char *path, uint64_t max_bytes, const char *bound_why,
                             bk_st_file **out);
/* Decompress only the start of a .safetensors.zst file: its header JSON
 * (at most max_header bytes; NUL-terminated copy in *json, to free) and the
 * image size the frame declares (*declared; UINT64_MAX when not recorded). A
 * first frame that declares more than max_image bytes is refused before
 * anything is decoded (BK_ERR_ZSTD, bound_why names the bound's origin). The
 * header is not validated. */
bk_status bk_st_zst_header(const char *path, uint64_t max_header, uint64_t max_image,
                           const char *bound_why, char **json, uint64_t *declared);

/* Element count and byte size of a tensor (rules 8 and 9). Returns BK_OK, or
 * BK_ERR_ST_OVERFLOW / BK_ERR_ST_SUBBYTE without setting a message. */
bk_status bk_st_tensor_size(bk_dtype dt, int ndim, const int64_t *shape, uint64_t *numel,
                            uint64_t *nbytes);

/* Growable byte buffer for building headers and index files. */
typedef struct bk_strbuf {
    char *p;
    size_t len, cap;
    int oom;
} bk_strbuf;
void bk_sb_put(bk_strbuf *b, const void *s, size_t n);
void bk_sb_puts(bk_strbuf *b, const char *s);
void bk_sb_printf(bk_strbuf *b, const char *fmt, ...)
#if defined(__GNUC__) || defined(__clang__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* Append s as a JSON string literal (quotes and escapes by cJSON). */
void bk_sb_json_string(bk_strbuf *b, const char *s);
void bk_sb_free(bk_strbuf *b);

/* 64-bit digest of bytes (not cryptographic: detects torn or changed data;
 * docs/formats.md "Work folder"). Chain calls with the previous value as seed. */
uint64_t bk_digest64(const void *p, size_t n, uint64_t seed);

/* Resumable streams (bakron quantize --resume; docs/formats.md "Work
 * folder"): each shard is built under the fixed name SHARD.partial instead of
 * a random temporary name, so that a later process can find it. */
bk_status bk_st_stream_begin_resumable(const char *dir, const char *basename,
                                       uint64_t max_shard_bytes, bk_st_stream **out);
/* Fix the layout now (after the last declare) and open the shards: an
 * existing SHARD.partial with the planned size and the same header bytes is
 * kept with its contents (*reused = 1 when every shard was), any other is
 * created anew at full size. */
bk_status bk_st_stream_open_files(bk_st_stream *s, int *reused);
/* fsync every shard (what was written so far is on disk). */
bk_status bk_st_stream_sync(bk_st_stream *s);
/* Digest of the names and the bytes, as they are in the files, of every
 * declared tensor whose name starts with prefix (in declaration order). */
bk_status bk_st_stream_digest(bk_st_stream *s, const char *prefix, uint64_t *digest);
/* Read declared tensor `name` back from the files into dst: its dtype must be
 * dt and its size nbytes (else BK_ERR_INVALID_ARG); BK_ERR_IO when the file
 * cannot be read, one line naming the file and the tensor. Safe while other
 * tensors are being written (pread; the layout is fixed). */
bk_status bk_st_stream_read(bk_st_stream *s, const char *name, bk_dtype dt, void *dst,
                            uint64_t nbytes);
/* Count every tensor whose name starts with prefix as written (its bytes are
 * in the reused files already). */
void bk_st_stream_mark_written(bk_st_stream *s, const char *prefix);
/* Close the files and free s, leaving the .partial files in place. */
void bk_st_stream_keep(bk_st_stream *s);

#endif /* BK_ST_INTERNAL_H */
