#include "bakron/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define BK_ERRBUF 1024
static _Thread_local char errbuf[BK_ERRBUF];

const char *bk_status_name(bk_status s)
{
    switch (s) {
    case BK_OK: return "OK";
    case BK_ERR_USAGE: return "USAGE";
    case BK_ERR_INVALID_ARG: return "INVALID_ARG";
    case BK_ERR_IO: return "IO";
    case BK_ERR_ST_TOO_SHORT: return "ST_TOO_SHORT";
    case BK_ERR_ST_HEADER_TOO_LARGE: return "ST_HEADER_TOO_LARGE";
    case BK_ERR_ST_HEADER_BOUNDS: return "ST_HEADER_BOUNDS";
    case BK_ERR_ST_UTF8: return "ST_UTF8";
    case BK_ERR_ST_JSON: return "ST_JSON";
    case BK_ERR_ST_SCHEMA: return "ST_SCHEMA";
    case BK_ERR_ST_DTYPE: return "ST_DTYPE";
    case BK_ERR_ST_LAYOUT: return "ST_LAYOUT";
    case BK_ERR_ST_OVERFLOW: return "ST_OVERFLOW";
    case BK_ERR_ST_SUBBYTE: return "ST_SUBBYTE";
    case BK_ERR_ST_SIZE_MISMATCH: return "ST_SIZE_MISMATCH";
    case BK_ERR_ST_FILE_SIZE: return "ST_FILE_SIZE";
    case BK_ERR_ST_DUPLICATE: return "ST_DUPLICATE";
    case BK_ERR_ST_INDEX: return "ST_INDEX";
    case BK_ERR_ZSTD: return "ZSTD";
    case BK_ERR_CONFIG: return "CONFIG";
    case BK_ERR_UNSUPPORTED: return "UNSUPPORTED";
    case BK_ERR_MISSING_TENSOR: return "MISSING_TENSOR";
    case BK_ERR_UNEXPECTED_TENSOR: return "UNEXPECTED_TENSOR";
    case BK_ERR_SHAPE: return "SHAPE";
    case BK_ERR_DTYPE: return "DTYPE";
    case BK_ERR_NONFINITE: return "NONFINITE";
    case BK_ERR_NOT_PD: return "NOT_PD";
    case BK_ERR_CALIB: return "CALIB";
    case BK_ERR_NOMEM: return "NOMEM";
    case BK_ERR_WRITE: return "WRITE";
    case BK_ERR_DEVICE: return "DEVICE";
    case BK_ERR_DEVICE_OOM: return "DEVICE_OOM";
    case BK_ERR_NO_DEVICE: return "NO_DEVICE";
    case BK_ERR_INTERRUPTED: return "INTERRUPTED";
    case BK_ERR_INTERNAL: return "INTERNAL";
    case BK_ERR_BUSY: return "BUSY";
    case BK_ERR_PEER: return "PEER";
    }
    return "UNKNOWN";
}

int bk_status_exit_code(bk_status s)
{
    if (s == BK_OK)
        return 0;
    if (s == BK_ERR_USAGE)
        return 1;
    if ((int)s >= 100 && (int)s < 200)
        return 2;
    return 3;
}

const char *bk_last_error(void)
{
    return errbuf;
}

void bk_clear_error(void)
{
    errbuf[0] = '\0';
}

bk_status bk_error(bk_status s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errbuf, sizeof errbuf, fmt, ap);
    va_end(ap);
    /* one line: fold any newline the caller let through */
    for (char *p = errbuf; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
    return s;
}

bk_status bk_error_prefix(bk_status s, const char *prefix)
{
    char tmp[BK_ERRBUF];
    size_t lp = strlen(prefix);
    if (lp > BK_ERRBUF / 2)
        lp = BK_ERRBUF / 2;
    memcpy(tmp, prefix, lp);
    tmp[lp] = ':';
    tmp[lp + 1] = ' ';
    size_t rest = BK_ERRBUF - lp - 3;
    size_t le = strnlen(errbuf, rest);
    memcpy(tmp + lp + 2, errbuf, le);
    tmp[lp + 2 + le] = '\0';
    memcpy(errbuf, tmp, sizeof errbuf);
    return s;
}
