/* dtype.c — safetensors dtype names and sizes, element conversion.
 *
 * Conversions:
 *   - same dtype: byte copy;
 *   - integer (incl. BOOL) -> integer: exact, refused per element when out of range;
 *   - integer or float -> float: correctly rounded to nearest even (integers wider than
 *     53 bits go through a round-to-odd double first so that the second rounding to
 *     F16/BF16 is still correct);
 *   - float -> integer and anything opaque: refused with BK_ERR_DTYPE.
 * Data may be unaligned: every element is loaded and stored through memcpy.
 */
#include "bakron/safetensors.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "util.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "bakron reads safetensors data in place and needs a little-endian host"
#endif

static const struct {
    const char *name;
    unsigned bits;
    int numeric;
} dtype_table[BK_DT_COUNT] = {
    [BK_DT_BOOL] = {"BOOL", 8, 1},
    [BK_DT_U8] = {"U8", 8, 1},
    [BK_DT_I8] = {"I8", 8, 1},
    [BK_DT_I16] = {"I16", 16, 1},
    [BK_DT_U16] = {"U16", 16, 1},
    [BK_DT_F16] = {"F16", 16, 1},
    [BK_DT_BF16] = {"BF16", 16, 1},
    [BK_DT_I32] = {"I32", 32, 1},
    [BK_DT_U32] = {"U32", 32, 1},
    [BK_DT_F32] = {"F32", 32, 1},
    [BK_DT_F64] = {"F64", 64, 1},
    [BK_DT_I64] = {"I64", 64, 1},
    [BK_DT_U64] = {"U64", 64, 1},
    [BK_DT_C64] = {"C64", 64, 0},
    [BK_DT_F8_E5M2] = {"F8_E5M2", 8, 0},
    [BK_DT_F8_E4M3] = {"F8_E4M3", 8, 0},
    [BK_DT_F8_E8M0] = {"F8_E8M0", 8, 0},
    [BK_DT_F8_E4M3FNUZ] = {"F8_E4M3FNUZ", 8, 0},
    [BK_DT_F8_E5M2FNUZ] = {"F8_E5M2FNUZ", 8, 0},
    [BK_DT_F4] = {"F4", 4, 0},
    [BK_DT_F6_E2M3] = {"F6_E2M3", 6, 0},
    [BK_DT_F6_E3M2] = {"F6_E3M2", 6, 0},
};

static int dt_valid(bk_dtype dt)
{
    return (int)dt >= 0 && dt < BK_DT_COUNT;
}

const char *bk_dtype_name(bk_dtype dt)
{
    return dt_valid(dt) ? dtype_table[dt].name : "?";
}

bk_status bk_dtype_from_name(const char *name, bk_dtype *out)
{
    if (name) {
        for (int i = 0; i < BK_DT_COUNT; i++) {
            if (!strcmp(name, dtype_table[i].name)) {
                *out = (bk_dtype)i;
                return BK_OK;
            }
        }
    }
    return bk_error(BK_ERR_ST_DTYPE, "unknown dtype '%s' (expected one of BOOL, U8, I8, I16, U16, "
                    "F16, BF16, I32, U32, F32, F64, I64, U64, C64, F8_E5M2, F8_E4M3, F8_E8M0, "
                    "F8_E4M3FNUZ, F8_E5M2FNUZ, F4, F6_E2M3, F6_E3M2)",
                    name ? name : "(null)");
}

unsigned bk_dtype_bits(bk_dtype dt)
{
    return dt_valid(dt) ? dtype_table[dt].bits : 0;
}

int bk_dtype_is_numeric(bk_dtype dt)
{
    return dt_valid(dt) && dtype_table[dt].numeric;
}

static int is_float(bk_dtype dt)
{
    return dt == BK_DT_F16 || dt == BK_DT_BF16 || dt == BK_DT_F32 || dt == BK_DT_F64;
}

static int is_signed_int(bk_dtype dt)
{
    return dt == BK_DT_I8 || dt == BK_DT_I16 || dt == BK_DT_I32 || dt == BK_DT_I64;
}

/* ------------------------------------------------------- 16-bit floats */

float bk_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t bk_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep sign and top payload, force quiet */
        return (uint16_t)((u >> 16) | 0x0040u);
    /* round to nearest even on the 16 dropped bits; a carry into the exponent is the
     * correct next binade (and 0x7f7fffff.. rounds up to infinity, as it must) */
    uint32_t bias = 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)((u + bias) >> 16);
}

void bk_f32_to_bf16_rn_dev(const float *src, uint16_t *dst, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &src[i], sizeof u);
        if ((u & 0x7fffffffu) > 0x7f800000u)
            dst[i] = 0x7fffu;
        else
            dst[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

float bk_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    uint32_t u;
    if (e == 0x1f) {
        u = sign | 0x7f800000u | (m << 13); /* inf, or NaN with its payload */
    } else if (e == 0) {
        /* zero or subnormal: m * 2^-24, exact in float */
        float f = (float)m * 0x1p-24f;
        return sign ? -f : f;
    } else {
        u = sign | ((e - 15u + 127u) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round a double to a binary format with `ebits` exponent bits and `mbits` stored
 * mantissa bits (IEEE-style: bias 2^(ebits-1)-1, subnormals, inf/NaN at the top
 * exponent), nearest even. Returns the bit pattern. */
static uint16_t round_small(double x, int ebits, int mbits)
{
    const uint32_t sign = signbit(x) ? 1u << (ebits + mbits) : 0u;
    const uint32_t expmask = ((1u << ebits) - 1u) << mbits;
    if (isnan(x))
        return (uint16_t)(sign | expmask | (1u << (mbits - 1)));
    double ax = fabs(x);
    if (isinf(ax))
        return (uint16_t)(sign | expmask);
    if (ax == 0.0)
        return (uint16_t)sign;
    const int bias = (1 << (ebits - 1)) - 1;
    const int emin = 1 - bias, emax = bias;
    int e2;
    (void)frexp(ax, &e2);
    int E = e2 - 1; /* ax in [2^E, 2^(E+1)) */
    if (E < emin)
        E = emin;
    if (E > emax + 1)
        return (uint16_t)(sign | expmask);
    /* ax / 2^(E - mbits) is exact (power-of-two scaling inside the double range);
     * nearbyint rounds to nearest even in the default rounding mode */
    double r = nearbyint(ldexp(ax, mbits - E));
    uint32_t q = (uint32_t)r; /* in [0, 2^(mbits+1)] */
    if (q == (1u << (mbits + 1))) {
        E++;
        q = 1u << mbits;
    }
    if (q < (1u << mbits)) /* subnormal (only possible at E == emin), or rounded to 0 */
        return (uint16_t)(sign | q);
    if (E > emax)
        return (uint16_t)(sign | expmask);
    return (uint16_t)(sign | ((uint32_t)(E + bias) << mbits) | (q - (1u << mbits)));
}

uint16_t bk_f32_to_f16(float f)
{
    if (isnan(f)) {
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        return (uint16_t)(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x1ffu));
    }
    return round_small((double)f, 5, 10);
}

static uint16_t f64_to_bf16(double d)
{
    if (isnan(d)) {
        uint64_t u;
        memcpy(&u, &d, sizeof u);
        return (uint16_t)(((u >> 48) & 0x8000u) | 0x7fc0u | ((u >> 45) & 0x3fu));
    }
    return round_small(d, 8, 7);
}

static uint16_t f64_to_f16(double d)
{
    if (isnan(d)) {
        uint64_t u;
        memcpy(&u, &d, sizeof u);
        return (uint16_t)(((u >> 48) & 0x8000u) | 0x7e00u | ((u >> 42) & 0x1ffu));
    }
    return round_small(d, 5, 10);
}

/* ------------------------------------------------------------ loading */

/* Unaligned little-endian element access. */
#define BK_LDST(T, SUF)                                                                       \
    static inline T ld_##SUF(const void *p, size_t i)                                         \
    {                                                                                         \
        T v;                                                                                  \
        memcpy(&v, (const char *)p + i * sizeof(T), sizeof(T));                               \
        return v;                                                                             \
    }                                                                                         \
    static inline void st_##SUF(void *p, size_t i, T v)                                       \
    {                                                                                         \
        memcpy((char *)p + i * sizeof(T), &v, sizeof(T));                                     \
    }
BK_LDST(uint8_t, u8)
BK_LDST(int8_t, i8)
BK_LDST(uint16_t, u16)
BK_LDST(int16_t, i16)
BK_LDST(uint32_t, u32)
BK_LDST(int32_t, i32)
BK_LDST(uint64_t, u64)
BK_LDST(int64_t, i64)
BK_LDST(float, f32)
BK_LDST(double, f64)

/* Integer element i as (negative flag, magnitude-or-value). Signed values are
 * returned in *s, unsigned in *u; *neg tells which one to use. */
static void load_int(const void *p, bk_dtype dt, size_t i, int *neg, int64_t *s, uint64_t *u)
{
    int64_t sv = 0;
    uint64_t uv = 0;
    switch (dt) {
    case BK_DT_BOOL: uv = ld_u8(p, i) != 0; break;
    case BK_DT_U8: uv = ld_u8(p, i); break;
    case BK_DT_U16: uv = ld_u16(p, i); break;
    case BK_DT_U32: uv = ld_u32(p, i); break;
    case BK_DT_U64: uv = ld_u64(p, i); break;
    case BK_DT_I8: sv = ld_i8(p, i); break;
    case BK_DT_I16: sv = ld_i16(p, i); break;
    case BK_DT_I32: sv = ld_i32(p, i); break;
    case BK_DT_I64: sv = ld_i64(p, i); break;
    default: break;
    }
    if (is_signed_int(dt)) {
        *neg = sv < 0;
        *s = sv;
        *u = sv < 0 ? 0 : (uint64_t)sv;
    } else {
        *neg = 0;
        *s = uv > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)uv;
        *u = uv;
    }
}

/* A uint64 magnitude as a double rounded to odd when it needs more than 53 bits,
 * so that a later rounding to a format of <= 51 bits is still correctly rounded. */
static double u64_to_double_odd(uint64_t m)
{
    if (m < (1ull << 53))
        return (double)m;
    int k = 64 - __builtin_clzll(m) - 53;
    uint64_t lo = m & ((1ull << k) - 1);
    m >>= k;
    if (lo)
        m |= 1;
    return ldexp((double)m, k);
}

static bk_status convert_int_to_int(const void *src, bk_dtype sdt, void *dst, bk_dtype ddt,
                                    size_t n)
{
    int64_t lo;
    uint64_t hi;
    switch (ddt) {
    case BK_DT_BOOL: lo = 0; hi = 1; break;
    case BK_DT_U8: lo = 0; hi = UINT8_MAX; break;
    case BK_DT_U16: lo = 0; hi = UINT16_MAX; break;
    case BK_DT_U32: lo = 0; hi = UINT32_MAX; break;
    case BK_DT_U64: lo = 0; hi = UINT64_MAX; break;
    case BK_DT_I8: lo = INT8_MIN; hi = INT8_MAX; break;
    case BK_DT_I16: lo = INT16_MIN; hi = INT16_MAX; break;
    case BK_DT_I32: lo = INT32_MIN; hi = INT32_MAX; break;
    case BK_DT_I64: lo = INT64_MIN; hi = INT64_MAX; break;
    default: return bk_error(BK_ERR_INTERNAL, "convert: %s is not an integer dtype",
                             bk_dtype_name(ddt));
    }
    for (size_t i = 0; i < n; i++) {
        int neg;
        int64_t s;
        uint64_t u;
        load_int(src, sdt, i, &neg, &s, &u);
        if (neg ? s < lo : u > hi) {
            if (neg)
                return bk_error(BK_ERR_DTYPE,
                                "convert %s -> %s: element %zu out of range (got %lld)",
                                bk_dtype_name(sdt), bk_dtype_name(ddt), i, (long long)s);
            return bk_error(BK_ERR_DTYPE, "convert %s -> %s: element %zu out of range (got %llu)",
                            bk_dtype_name(sdt), bk_dtype_name(ddt), i, (unsigned long long)u);
        }
        switch (ddt) {
        case BK_DT_BOOL:
        case BK_DT_U8: st_u8(dst, i, (uint8_t)u); break;
        case BK_DT_U16: st_u16(dst, i, (uint16_t)u); break;
        case BK_DT_U32: st_u32(dst, i, (uint32_t)u); break;
        case BK_DT_U64: st_u64(dst, i, u); break;
        case BK_DT_I8: st_i8(dst, i, (int8_t)s); break;
        case BK_DT_I16: st_i16(dst, i, (int16_t)s); break;
        case BK_DT_I32: st_i32(dst, i, (int32_t)s); break;
        case BK_DT_I64: st_i64(dst, i, s); break;
        default: break;
        }
    }
    return BK_OK;
}

static void store_float_from_int(void *dst, bk_dtype ddt, size_t i, int neg, int64_t s,
                                 uint64_t u)
{
    switch (ddt) {
    case BK_DT_F64: st_f64(dst, i, neg ? (double)s : (double)u); break;
    case BK_DT_F32: st_f32(dst, i, neg ? (float)s : (float)u); break;
    default: {
        uint64_t mag = neg ? (uint64_t)0 - (uint64_t)s : u;
        double d = u64_to_double_odd(mag);
        if (neg)
            d = -d;
        st_u16(dst, i, ddt == BK_DT_BF16 ? f64_to_bf16(d) : f64_to_f16(d));
        break;
    }
    }
}

static double load_float(const void *src, bk_dtype sdt, size_t i)
{
    switch (sdt) {
    case BK_DT_F16: return bk_f16_to_f32(ld_u16(src, i));
    case BK_DT_BF16: return bk_bf16_to_f32(ld_u16(src, i));
    case BK_DT_F32: return ld_f32(src, i);
    default: return ld_f64(src, i);
    }
}

bk_status bk_convert(const void *src, bk_dtype src_dt, void *dst, bk_dtype dst_dt, size_t n)
{
    if (!dt_valid(src_dt) || !dt_valid(dst_dt))
        return bk_error(BK_ERR_INVALID_ARG, "convert: invalid dtype value (%d -> %d)",
                        (int)src_dt, (int)dst_dt);
    if (!bk_dtype_is_numeric(src_dt) || !bk_dtype_is_numeric(dst_dt))
        return bk_error(BK_ERR_DTYPE,
                        "convert %s -> %s: %s is an opaque dtype (only passed through as bytes)",
                        bk_dtype_name(src_dt), bk_dtype_name(dst_dt),
                        bk_dtype_is_numeric(src_dt) ? bk_dtype_name(dst_dt)
                                                    : bk_dtype_name(src_dt));
    if (is_float(src_dt) && !is_float(dst_dt))
        return bk_error(BK_ERR_DTYPE, "convert %s -> %s: float to integer conversion is refused",
                        bk_dtype_name(src_dt), bk_dtype_name(dst_dt));
    if (n == 0)
        return BK_OK;
    if (!src || !dst)
        return bk_error(BK_ERR_INVALID_ARG, "convert: NULL buffer for %zu elements", n);
    size_t esz = bk_dtype_bits(src_dt) / 8;
    size_t bytes;
    if (__builtin_mul_overflow(n, esz, &bytes) ||
        __builtin_mul_overflow(n, (size_t)(bk_dtype_bits(dst_dt) / 8), &bytes))
        return bk_error(BK_ERR_INVALID_ARG, "convert: %zu elements overflow the address space", n);
    if (src_dt == dst_dt) {
        memmove(dst, src, n * esz);
        return BK_OK;
    }
    if (!is_float(src_dt) && !is_float(dst_dt))
        return convert_int_to_int(src, src_dt, dst, dst_dt, n);

    if (!is_float(src_dt)) {
        for (size_t i = 0; i < n; i++) {
            int neg;
            int64_t s;
            uint64_t u;
            load_int(src, src_dt, i, &neg, &s, &u);
            store_float_from_int(dst, dst_dt, i, neg, s, u);
        }
        return BK_OK;
    }

    /* float -> float; the common cases get their own loops */
    if (src_dt == BK_DT_BF16 && dst_dt == BK_DT_F32) {
        for (size_t i = 0; i < n; i++)
            st_f32(dst, i, bk_bf16_to_f32(ld_u16(src, i)));
        return BK_OK;
    }
    if (src_dt == BK_DT_F16 && dst_dt == BK_DT_F32) {
        for (size_t i = 0; i < n; i++)
            st_f32(dst, i, bk_f16_to_f32(ld_u16(src, i)));
        return BK_OK;
    }
    if (src_dt == BK_DT_F32 && dst_dt == BK_DT_BF16) {
        for (size_t i = 0; i < n; i++)
            st_u16(dst, i, bk_f32_to_bf16(ld_f32(src, i)));
        return BK_OK;
    }
    if (src_dt == BK_DT_F32 && dst_dt == BK_DT_F16) {
        for (size_t i = 0; i < n; i++)
            st_u16(dst, i, bk_f32_to_f16(ld_f32(src, i)));
        return BK_OK;
    }
    for (size_t i = 0; i < n; i++) {
        double d = load_float(src, src_dt, i); /* exact */
        switch (dst_dt) {
        case BK_DT_F64: st_f64(dst, i, d); break;
        case BK_DT_F32: st_f32(dst, i, (float)d); break;
        case BK_DT_BF16: st_u16(dst, i, f64_to_bf16(d)); break;
        default: st_u16(dst, i, f64_to_f16(d)); break;
        }
    }
    return BK_OK;
}

/* ------------------------------------------------------------ tensors */

static bk_status tensor_to(const bk_tensor_info *t, void *dst, bk_dtype dt)
{
    if (!t)
        return bk_error(BK_ERR_INVALID_ARG, "tensor conversion: NULL tensor");
    if (!bk_dtype_is_numeric(t->dtype))
        return bk_error(BK_ERR_DTYPE,
                        "%s: tensor '%s': dtype %s is opaque and cannot be converted to %s "
                        "(it is only passed through as bytes)",
                        t->file ? t->file : "?", t->name ? t->name : "?",
                        bk_dtype_name(t->dtype), bk_dtype_name(dt));
    if (t->numel > SIZE_MAX)
        return bk_error(BK_ERR_INVALID_ARG, "%s: tensor '%s': too many elements (%llu)",
                        t->file ? t->file : "?", t->name ? t->name : "?",
                        (unsigned long long)t->numel);
    bk_status st = bk_convert(t->data, t->dtype, dst, dt, (size_t)t->numel);
    if (st != BK_OK) {
        char pre[600];
        snprintf(pre, sizeof pre, "%s: tensor '%s'", t->file ? t->file : "?",
                 t->name ? t->name : "?");
        return bk_error_prefix(st, pre);
    }
    return BK_OK;
}

bk_status bk_tensor_to_f32(const bk_tensor_info *t, float *dst)
{
    return tensor_to(t, dst, BK_DT_F32);
}

bk_status bk_tensor_to_f64(const bk_tensor_info *t, double *dst)
{
    return tensor_to(t, dst, BK_DT_F64);
}

/* Blocks of BK_FINITE_BLOCK elements are tested with a branch-free OR (the
 * compiler can vectorize it); only a block with a hit is searched. */
#define BK_FINITE_BLOCK 4096
#define BK_FINITE_SCAN(T, SZ, MASK)                                                          \
    for (uint64_t b0 = begin; b0 < end && bad == UINT64_MAX; b0 += BK_FINITE_BLOCK) {       \
        const uint64_t b1 = end - b0 < BK_FINITE_BLOCK ? end : b0 + BK_FINITE_BLOCK;         \
        unsigned any = 0;                                                                    \
        for (uint64_t i = b0; i < b1; i++) {                                                 \
            T u;                                                                             \
            memcpy(&u, p + (SZ) * i, (SZ));                                                  \
            any |= (unsigned)((u & (MASK)) == (MASK));                                       \
        }                                                                                    \
        for (uint64_t i = b0; any && i < b1; i++) {                                          \
            T u;                                                                             \
            memcpy(&u, p + (SZ) * i, (SZ));                                                  \
            if ((u & (MASK)) == (MASK)) {                                                    \
                bad = i;                                                                     \
                break;                                                                       \
            }                                                                                \
        }                                                                                    \
    }

/* The first NaN/Inf element of t in [begin, end), UINT64_MAX if none. */
static uint64_t finite_scan(const bk_tensor_info *t, uint64_t begin, uint64_t end)
{
    const unsigned char *p = t->data;
    uint64_t bad = UINT64_MAX;
    switch (t->dtype) {
    case BK_DT_BF16:
        BK_FINITE_SCAN(uint16_t, 2, (uint16_t)0x7f80u)
        break;
    case BK_DT_F16:
        BK_FINITE_SCAN(uint16_t, 2, (uint16_t)0x7c00u)
        break;
    case BK_DT_F32:
        BK_FINITE_SCAN(uint32_t, 4, 0x7f800000u)
        break;
    case BK_DT_F64:
        BK_FINITE_SCAN(uint64_t, 8, 0x7ff0000000000000ull)
        break;
    default:
        break;
    }
    return bad;
}

static bk_status nonfinite_error(const bk_tensor_info *t, uint64_t bad)
{
    return bk_error(BK_ERR_NONFINITE, "%s: tensor %s: element %llu is NaN or Inf (weights must be finite)",
                    t->file ? t->file : "?", t->name, (unsigned long long)bad);
}

bk_status bk_tensor_check_finite(const bk_tensor_info *t)
{
    const uint64_t bad = finite_scan(t, 0, t->numel);
    return bad == UINT64_MAX ? BK_OK : nonfinite_error(t, bad);
}

/* The whole set, scanned by several threads in chunks; the error is the one
 * the sequential scan would give (first tensor in order, first element). */
#define BK_FINITE_CHUNK ((uint64_t)1 << 24)
typedef struct {
    const bk_st_set *set;
    size_t nchunks;
    uint32_t *tensor;       /* per chunk: tensor index */
    uint64_t *begin, *bad;  /* per chunk: first element, first bad one */
    size_t next;            /* next chunk to take (atomic) */
} finite_job;

static void *finite_worker(void *arg)
{
    finite_job *fj = arg;
    for (;;) {
        const size_t c = __atomic_fetch_add(&fj->next, 1, __ATOMIC_RELAXED);
        if (c >= fj->nchunks)
            break;
        const bk_tensor_info *t = bk_st_set_tensor(fj->set, fj->tensor[c]);
        const uint64_t b = fj->begin[c];
        const uint64_t e = t->numel - b < BK_FINITE_CHUNK ? t->numel : b + BK_FINITE_CHUNK;
        fj->bad[c] = finite_scan(t, b, e);
    }
    return NULL;
}

bk_status bk_st_set_check_finite(const bk_st_set *set)
{
    const size_t n = bk_st_set_count(set);
    size_t nchunks = 0;
    for (size_t i = 0; i < n; i++) {
        const uint64_t numel = bk_st_set_tensor(set, i)->numel;
        nchunks += numel == 0 ? 0 : (size_t)((numel + BK_FINITE_CHUNK - 1) / BK_FINITE_CHUNK);
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int nthreads = ncpu < 1 ? 1 : ncpu > 16 ? 16 : (int)ncpu;
    if ((size_t)nthreads > nchunks)
        nthreads = (int)nchunks;
    finite_job fj = {set, nchunks, NULL, NULL, NULL, 0};
    if (nthreads > 1) {
        fj.tensor = malloc(nchunks * sizeof *fj.tensor);
        fj.begin = malloc(nchunks * sizeof *fj.begin);
        fj.bad = malloc(nchunks * sizeof *fj.bad);
    }
    if (nthreads <= 1 || !fj.tensor || !fj.begin || !fj.bad) {
        /* sequential */
        free(fj.tensor);
        free(fj.begin);
        free(fj.bad);
        for (size_t i = 0; i < n; i++) {
            bk_status st = bk_tensor_check_finite(bk_st_set_tensor(set, i));
            if (st != BK_OK)
                return st;
        }
        return BK_OK;
    }
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        for (uint64_t b = 0; b < bk_st_set_tensor(set, i)->numel; b += BK_FINITE_CHUNK) {
            fj.tensor[c] = (uint32_t)i;
            fj.begin[c] = b;
            fj.bad[c] = UINT64_MAX;
            c++;
        }
    pthread_t tid[16];
    int started = 0;
    for (int k = 1; k < nthreads; k++)
        if (pthread_create(&tid[started], NULL, finite_worker, &fj) == 0)
            started++;
    finite_worker(&fj); /* the calling thread works too */
    for (int k = 0; k < started; k++)
        pthread_join(tid[k], NULL);
    bk_status st = BK_OK;
    for (c = 0; c < nchunks; c++) /* chunks are in tensor, then element order */
        if (fj.bad[c] != UINT64_MAX) {
            st = nonfinite_error(bk_st_set_tensor(set, fj.tensor[c]), fj.bad[c]);
            break;
        }
    free(fj.tensor);
    free(fj.begin);
    free(fj.bad);
    return st;
}
