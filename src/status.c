#include "bakron/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "util.h"

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

size_t bk_utf8_lead(unsigned char c, unsigned char *lo, unsigned char *hi)
{
    *lo = 0x80;
    *hi = 0xBF;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        return 2;
    if (c >= 0xE0 && c <= 0xEF) {
        if (c == 0xE0)
            *lo = 0xA0; /* not overlong */
        else if (c == 0xED)
            *hi = 0x9F; /* no surrogates */
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (c == 0xF0)
            *lo = 0x90; /* not overlong */
        else if (c == 0xF4)
            *hi = 0x8F; /* at most U+10FFFF */
        return 4;
    }
    return 0;
}

size_t bk_utf8_len(const unsigned char *s, size_t n)
{
    unsigned char lo, hi;
    const size_t len = bk_utf8_lead(s[0], &lo, &hi);
    if (len <= 1)
        return len;
    if (n < len || s[1] < lo || s[1] > hi)
        return 0;
    for (size_t i = 2; i < len; i++)
        if ((s[i] & 0xC0) != 0x80)
            return 0;
    return len;
}

size_t bk_utf8_invalid_at(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        const size_t l = bk_utf8_len(s + i, n - i);
        if (!l)
            return i;
        i += l;
    }
    return n;
}

size_t bk_escape_message(const char *in, char *out, size_t cap)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *s = (const unsigned char *)in;
    size_t n = strlen(in), o = 0;
    if (cap == 0)
        return 0;
    for (size_t i = 0; i < n;) {
        size_t l = bk_utf8_len(s + i, n - i);
        char esc[5];
        size_t el = 0;
        if (l == 0 || (l == 1 && (s[i] < 0x20 || s[i] == 0x7f))) {
            unsigned c = s[i];
            esc[el++] = '\\';
            if (c == '\n' || c == '\t' || c == '\r') {
                esc[el++] = c == '\n' ? 'n' : c == '\t' ? 't' : 'r';
            } else {
                esc[el++] = 'x';
                esc[el++] = hex[c >> 4];
                esc[el++] = hex[c & 15];
            }
            l = 1;
        } else {
            memcpy(esc, s + i, l);
            el = l;
        }
        if (o + el + 1 > cap)
            break; /* never a sequence cut in half */
        memcpy(out + o, esc, el);
        o += el;
        i += l;
    }
    out[o] = '\0';
    return o;
}

bk_status bk_error(bk_status s, const char *fmt, ...)
{
    char raw[BK_ERRBUF];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof raw, fmt, ap);
    va_end(ap);
    /* one line of valid UTF-8: control characters (a newline the caller let
     * through, text echoed from an input file) and invalid bytes escaped */
    bk_escape_message(raw, errbuf, sizeof errbuf);
    return s;
}

bk_status bk_error_prefix(bk_status s, const char *prefix_raw)
{
    char tmp[BK_ERRBUF], prefix[BK_ERRBUF / 2];
    bk_escape_message(prefix_raw, prefix, sizeof prefix);
    size_t lp = strlen(prefix);
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
