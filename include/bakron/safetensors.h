/* bakron — safetensors reading (validated, mmap'd), writing, dtype conversion.
 *
 * Format facts and the validation rules: docs/formats.md.
 */
#ifndef BAKRON_SAFETENSORS_H
#define BAKRON_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ dtypes */

typedef enum bk_dtype {
    BK_DT_BOOL = 0,
    BK_DT_U8,
    BK_DT_I8,
    BK_DT_I16,
    BK_DT_U16,
    BK_DT_F16,
    BK_DT_BF16,
    BK_DT_I32,
    BK_DT_U32,
    BK_DT_F32,
    BK_DT_F64,
    BK_DT_I64,
    BK_DT_U64,
    BK_DT_C64,
    BK_DT_F8_E5M2,
    BK_DT_F8_E4M3,
    BK_DT_F8_E8M0,
    BK_DT_F8_E4M3FNUZ,
    BK_DT_F8_E5M2FNUZ,
    BK_DT_F4,
    BK_DT_F6_E2M3,
    BK_DT_F6_E3M2,
    BK_DT_COUNT
} bk_dtype;

/* The safetensors name ("BF16"), or "?" for an invalid value. */
const char *bk_dtype_name(bk_dtype dt);
/* Parse a case-sensitive safetensors dtype name. BK_ERR_ST_DTYPE if unknown. */
bk_status bk_dtype_from_name(const char *name, bk_dtype *out);
/* Bits per element (1..64; BOOL = 8, F4 = 4, F6_* = 6). */
unsigned bk_dtype_bits(bk_dtype dt);
/* 1 if values of this dtype can be converted to/from floating point by
 * bk_convert (BOOL, integers, F16, BF16, F32, F64); 0 for opaque dtypes
 * (C64, F8_*, F6_*, F4), which are only ever passed through as bytes. */
int bk_dtype_is_numeric(bk_dtype dt);

/* Convert n elements between numeric dtypes. Narrowing float conversions
 * round to nearest even; float -> integer is refused (BK_ERR_DTYPE), as is
 * any opaque dtype. src and dst must not overlap. */
bk_status bk_convert(const void *src, bk_dtype src_dt, void *dst, bk_dtype dst_dt, size_t n);

/* Scalar helpers (round-to-nearest-even on narrowing; NaN stays NaN). */
float bk_bf16_to_f32(uint16_t h);
uint16_t bk_f32_to_bf16(float f);
float bk_f16_to_f32(uint16_t h);
uint16_t bk_f32_to_f16(float f);
/* n F32 values to BF16 exactly as the GPU rounds them (__float2bfloat16_rn,
 * PTX cvt.rn.bf16.f32): round to nearest even, subnormals kept, overflow to
 * Inf, every NaN to the canonical 0x7fff (bk_f32_to_bf16 keeps a NaN's sign
 * and payload instead). cuda/backward.cu's bf16 mode converts its host
 * weight copies with this, so the device holds the bits its F32 upload and
 * k_to_bf16_rn gave. */
void bk_f32_to_bf16_rn_dev(const float *src, uint16_t *dst, size_t n);

/* ----------------------------------------------------------------- tensors */

#define BK_MAX_DIMS 8

/* A tensor inside a mapped file. All pointers stay valid until the owning
 * file/set is closed. Data are little-endian and not necessarily aligned. */
typedef struct bk_tensor_info {
    const char *name;
    bk_dtype dtype;
    int ndim;                      /* 0 for a scalar */
    int64_t shape[BK_MAX_DIMS];
    uint64_t numel;                /* product of shape (1 for a scalar) */
    uint64_t nbytes;
    const void *data;              /* into the read-only mapping */
    const char *file;              /* path of the file holding it */
} bk_tensor_info;

/* Copy a numeric tensor into a float / double buffer of numel elements.
 * Opaque dtypes -> BK_ERR_DTYPE naming the tensor. */
bk_status bk_tensor_to_f32(const bk_tensor_info *t, float *dst);
/* BK_ERR_NONFINITE naming the tensor and the first element that is NaN or
 * Inf (floating-point dtypes F16/BF16/F32/F64; others pass). Reads the bits
 * in place: no conversion, no allocation. */
bk_status bk_tensor_check_finite(const bk_tensor_info *t);
bk_status bk_tensor_to_f64(const bk_tensor_info *t, double *dst);

/* ------------------------------------------------------ one .safetensors file */

typedef struct bk_st_file bk_st_file;

/* mmap a file read-only and validate it completely (docs/formats.md rules
 * 1-11 and duplicate names). On failure *out is NULL and the message names
 * the file, the tensor where relevant, and the rule. */
bk_status bk_st_open(const char *path, bk_st_file **out);
/* Validate an in-memory image (used by the fuzzer and for decompressed .zst
 * files). The buffer must outlive the handle unless copy != 0. `label` names
 * the source in error messages. */
bk_status bk_st_open_memory(const void *buf, size_t len, int copy, const char *label,
                            bk_st_file **out);
/* A streamed, zstd-compressed safetensors file (.safetensors.zst): the whole
 * safetensors image compressed as one zstd frame sequence. */
bk_status bk_st_open_zst(const char *path, bk_st_file **out);
/* Dispatch on the extension: .zst -> bk_st_open_zst, else bk_st_open. */
bk_status bk_st_open_any(const char *path, bk_st_file **out);
void bk_st_close(bk_st_file *f);

const char *bk_st_path(const bk_st_file *f);
size_t bk_st_count(const bk_st_file *f);
/* Tensors in file order (ascending data offset). */
const bk_tensor_info *bk_st_tensor(const bk_st_file *f, size_t i);
/* NULL when absent. */
const bk_tensor_info *bk_st_find(const bk_st_file *f, const char *name);
size_t bk_st_meta_count(const bk_st_file *f);
void bk_st_meta_get(const bk_st_file *f, size_t i, const char **key, const char **value);
/* NULL when absent. */
const char *bk_st_meta_find(const bk_st_file *f, const char *key);
/* Size in bytes of the header JSON (N). */
uint64_t bk_st_header_size(const bk_st_file *f);
/* A mapped file must not change while it is read: its size and mtime (ns) are
 * recorded at open. BK_ERR_IO naming the file when they differ now, or when
 * part of the file vanished under the mapping (a read of a lost page is not
 * fatal: it reads zeros, and this check reports it). BK_OK for in-memory
 * images (.zst files are checked when decompressed). */
bk_status bk_st_check_unchanged(const bk_st_file *f);

/* ------------------------------------------- a checkpoint (one or more files) */

typedef struct bk_st_set bk_st_set;

/* Open a checkpoint from
 *   - a folder: model.safetensors.index.json if present, else model.safetensors,
 *     else the single *.safetensors in it;
 *   - a .safetensors file;
 *   - a *.index.json file: every mapped file must exist and validate, every
 *     tensor must be in the file the map names, no tensor may appear twice,
 *     and no shard may hold a tensor the map does not list.                    */
bk_status bk_st_set_open(const char *path, bk_st_set **out);
void bk_st_set_close(bk_st_set *s);

size_t bk_st_set_count(const bk_st_set *s);
/* Tensors sorted by name. */
const bk_tensor_info *bk_st_set_tensor(const bk_st_set *s, size_t i);
const bk_tensor_info *bk_st_set_find(const bk_st_set *s, const char *name);
size_t bk_st_set_file_count(const bk_st_set *s);
const bk_st_file *bk_st_set_file(const bk_st_set *s, size_t i);
/* Sum of tensor bytes. */
uint64_t bk_st_set_total_bytes(const bk_st_set *s);
/* bk_tensor_check_finite on every tensor, in chunks on up to 16 threads; the
 * error is the one the tensors scanned in order would give (the first tensor
 * by name with a NaN/Inf, its first such element). */
bk_status bk_st_set_check_finite(const bk_st_set *s);
/* bk_st_check_unchanged on every file of the set. */
bk_status bk_st_set_check_unchanged(const bk_st_set *s);

/* ------------------------------------------------------------------ writing */

/* In-memory writer: collect tensors, then save. Data are copied when
 * copy != 0, otherwise referenced (caller keeps them alive until save). */
typedef struct bk_st_writer bk_st_writer;

bk_status bk_st_writer_create(bk_st_writer **out);
bk_status bk_st_writer_add(bk_st_writer *w, const char *name, bk_dtype dt, int ndim,
                           const int64_t *shape, const void *data, int copy);
bk_status bk_st_writer_set_meta(bk_st_writer *w, const char *key, const char *value);
/* One file. Header padded with spaces to a multiple of 8; __metadata__ always
 * holds "format": "pt"; written to PATH.tmp.XXXXXX in the same folder,
 * fsync'd, then renamed (never a partial file under the final name). */
bk_status bk_st_writer_save(bk_st_writer *w, const char *path);
/* zstd-compressed (streamed) variant; level as zstd (0 = default). */
bk_status bk_st_writer_save_zst(bk_st_writer *w, const char *path, int level);
/* Sharded: DIR/BASENAME-0000i-of-0000n.safetensors + DIR/BASENAME.safetensors.index.json
 * ({"metadata": {"total_size": B}, "weight_map": {...}}), each shard at most
 * max_shard_bytes of tensor data (a tensor larger than that gets its own
 * shard). If everything fits in one shard, writes DIR/BASENAME.safetensors
 * and no index. */
bk_status bk_st_writer_save_sharded(bk_st_writer *w, const char *dir, const char *basename,
                                    uint64_t max_shard_bytes);
void bk_st_writer_free(bk_st_writer *w);

/* Streaming writer for outputs too large to hold in memory: declare every
 * tensor (in output order), then write each tensor's bytes once, in any order;
 * finish writes the index and renames each shard into place. abort removes
 * the temporary files. The shard layout is the same as save_sharded. */
typedef struct bk_st_stream bk_st_stream;

bk_status bk_st_stream_begin(const char *dir, const char *basename, uint64_t max_shard_bytes,
                             bk_st_stream **out);
bk_status bk_st_stream_declare(bk_st_stream *s, const char *name, bk_dtype dt, int ndim,
                               const int64_t *shape);
bk_status bk_st_stream_set_meta(bk_st_stream *s, const char *key, const char *value);
bk_status bk_st_stream_write(bk_st_stream *s, const char *name, const void *data);
bk_status bk_st_stream_finish(bk_st_stream *s); /* frees s */
void bk_st_stream_abort(bk_st_stream *s);       /* frees s */

#ifdef __cplusplus
}
#endif
#endif /* BAKRON_SAFETENSORS_H */
