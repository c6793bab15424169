/* bakron — status codes and error messages.
 *
 * Every library function that can fail returns a bk_status. On failure it also
 * leaves a one-line, human-readable message (naming the file/tensor and the
 * rule that was broken) in a thread-local buffer, read with bk_last_error().
 * Only the CLI's main() turns a status into an exit code.
 */
#ifndef BAKRON_STATUS_H
#define BAKRON_STATUS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum bk_status {
    BK_OK = 0,

    /* --- usage (exit 1) --- */
    BK_ERR_USAGE = 1,            /* bad command line */

    /* --- bad input (exit 2) --- */
    BK_ERR_INVALID_ARG = 100,    /* a value given to the library is out of its domain */
    BK_ERR_IO,                   /* a file cannot be opened / read / mapped */
    BK_ERR_ST_TOO_SHORT,         /* safetensors rule 1: file shorter than 8 bytes */
    BK_ERR_ST_HEADER_TOO_LARGE,  /* rule 2: header length N > 100,000,000 */
    BK_ERR_ST_HEADER_BOUNDS,     /* rule 3: 8 + N overflows or exceeds the file size */
    BK_ERR_ST_UTF8,              /* rule 4: header is not valid UTF-8 */
    BK_ERR_ST_JSON,              /* rule 5: header is not valid JSON */
    BK_ERR_ST_SCHEMA,            /* rule 5: wrong schema (missing field, bad shape/offset, bad metadata) */
    BK_ERR_ST_DTYPE,             /* rule 5: unknown dtype name */
    BK_ERR_ST_LAYOUT,            /* rule 7: overlap / hole / aliasing / end < begin */
    BK_ERR_ST_OVERFLOW,          /* rule 8: element count or byte size overflows */
    BK_ERR_ST_SUBBYTE,           /* rule 9: element count x bits not a whole number of bytes */
    BK_ERR_ST_SIZE_MISMATCH,     /* rule 10: end - begin != element count x dtype size */
    BK_ERR_ST_FILE_SIZE,         /* rule 11: 8 + N + last end != file size */
    BK_ERR_ST_DUPLICATE,         /* duplicate tensor name */
    BK_ERR_ST_INDEX,             /* model.safetensors.index.json is malformed or inconsistent */
    BK_ERR_ZSTD,                 /* corrupt or truncated .zst stream */
    BK_ERR_CONFIG,               /* config.json malformed / missing field */
    BK_ERR_UNSUPPORTED,          /* unsupported model_type, dtype, feature */
    BK_ERR_MISSING_TENSOR,       /* an expected tensor is absent */
    BK_ERR_UNEXPECTED_TENSOR,    /* a tensor that the architecture does not have */
    BK_ERR_SHAPE,                /* wrong shape */
    BK_ERR_DTYPE,                /* wrong dtype, or arithmetic on an opaque dtype */
    BK_ERR_NONFINITE,            /* NaN or Inf in an input */
    BK_ERR_NOT_PD,               /* factor not positive definite even after damping escalation */
    BK_ERR_CALIB,                /* calibration data invalid (token range, lengths, dumps) */

    /* --- runtime / device (exit 3) --- */
    BK_ERR_NOMEM = 200,          /* host allocation failed */
    BK_ERR_WRITE,                /* cannot write output (disk full, permissions) */
    BK_ERR_DEVICE,               /* CUDA / cuBLAS / cuSOLVER failure */
    BK_ERR_DEVICE_OOM,           /* GPU out of memory */
    BK_ERR_NO_DEVICE,            /* a GPU backend was requested but none is usable */
    BK_ERR_INTERRUPTED,          /* stopped by a signal */
    BK_ERR_INTERNAL,             /* a bug: an invariant did not hold */
    BK_ERR_BUSY,                 /* the output folder is locked by another running job */
    BK_ERR_PEER                  /* another rank of an MPI job failed, died or did not answer */
} bk_status;

/* Short stable identifier of a status, e.g. "ST_LAYOUT". */
const char *bk_status_name(bk_status s);

/* CLI exit code for a status: 0 ok, 1 usage, 2 bad input, 3 runtime/device. */
int bk_status_exit_code(bk_status s);

/* Message of the last failure on this thread ("" when none). */
const char *bk_last_error(void);

/* Record a failure message (printf-style) and return s, so callers can write
 * `return bk_error(BK_ERR_SHAPE, "%s: expected [%d,%d]", name, m, n);` */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 2, 3)))
#endif
bk_status bk_error(bk_status s, const char *fmt, ...);

/* Copy the NUL-terminated text `in` into out (cap bytes, NUL-terminated) as
 * one line of valid UTF-8: control characters become \n, \t, \r or \xNN and
 * each byte of an invalid UTF-8 sequence \xNN; a sequence is never cut in
 * half at the end. Returns the length written. bk_error and bk_error_prefix
 * pass every message through it. */
size_t bk_escape_message(const char *in, char *out, size_t cap);

/* Prefix the current message with "prefix: " (to add context while unwinding);
 * returns s. */
bk_status bk_error_prefix(bk_status s, const char *prefix);

void bk_clear_error(void);

#ifdef __cplusplus
}
#endif
#endif /* BAKRON_STATUS_H */
