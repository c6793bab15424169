/* dtype names, sizes and conversions.
 *
 * Expected values are built independently of src/dtype.c:
 *   - F16/BF16 decoding from the IEEE definition with ldexp;
 *   - F32 -> BF16 narrowing by choosing, among the two neighbouring BF16 values,
 *     the one nearest in exact double arithmetic (ties to the even pattern);
 *   - F32 -> F16 narrowing by binary search in a sorted table of every finite F16
 *     value (decoded with ldexp), nearest wins, ties to the even pattern;
 *   - integer conversions from the mathematical value of small inputs.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/safetensors.h"

/* ------------------------------------------------------- references */

static double ref_decode(uint16_t h, int ebits, int mbits)
{
    int sign = (h >> (ebits + mbits)) & 1;
    int e = (h >> mbits) & ((1 << ebits) - 1);
    int m = h & ((1 << mbits) - 1);
    int bias = (1 << (ebits - 1)) - 1;
    double v;
    if (e == (1 << ebits) - 1)
        v = m ? NAN : INFINITY;
    else if (e == 0)
        v = ldexp((double)m, 1 - bias - mbits);
    else
        v = ldexp((double)(m + (1 << mbits)), e - bias - mbits);
    return sign ? -v : v;
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Nearest of two candidate patterns lo < hi (in magnitude, same sign) to x. */
static uint16_t pick_nearest(double ax, uint16_t lo, double vlo, uint16_t hi, double vhi)
{
    double dlo = ax - vlo, dhi = vhi - ax; /* exact: all values are short doubles */
    if (dlo < dhi)
        return lo;
    if (dhi < dlo)
        return hi;
    return (lo & 1) ? hi : lo;
}

static uint16_t ref_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    if (isnan(f))
        return 0xffff; /* marker: any NaN accepted */
    double ax = fabs((double)f);
    if (isinf(f))
        return sign | 0x7f80;
    /* truncation toward zero and the next pattern up */
    uint16_t lo = (uint16_t)((u & 0x7fffffffu) >> 16);
    uint16_t hi = (uint16_t)(lo + 1);
    double vlo = ref_decode(lo, 8, 7);
    double vhi = hi == 0x7f80 ? ldexp(1.0, 128) : ref_decode(hi, 8, 7); /* inf: 2^128 */
    uint16_t r = pick_nearest(ax, lo, vlo, hi, vhi);
    return sign | r;
}

static double f16_table[0x7c00]; /* all finite non-negative f16, sorted by pattern = value */

static void build_f16_table(void)
{
    for (uint32_t h = 0; h < 0x7c00; h++)
        f16_table[h] = ref_decode((uint16_t)h, 5, 10);
}

static uint16_t ref_f32_to_f16(float f)
{
    if (isnan(f))
        return 0xffff;
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    double ax = fabs((double)f);
    if (isinf(f))
        return sign | 0x7c00;
    /* largest pattern with value <= ax */
    uint32_t lo = 0, hi = 0x7c00; /* invariant: table[lo] <= ax, answer in [lo, hi) */
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (f16_table[mid] <= ax)
            lo = mid;
        else
            hi = mid;
    }
    if (f16_table[lo] == ax)
        return sign | (uint16_t)lo;
    double vhi = lo + 1 < 0x7c00 ? f16_table[lo + 1] : 65536.0; /* next step above 65504 */
    uint16_t r = pick_nearest(ax, (uint16_t)lo, f16_table[lo], (uint16_t)(lo + 1), vhi);
    return sign | r;
}

/* ---------------------------------------------------------- tests */

static void test_names_and_bits(void **state)
{
    (void)state;
    static const struct {
        const char *name;
        unsigned bits;
        int numeric;
    } want[BK_DT_COUNT] = {
        {"BOOL", 8, 1},        {"U8", 8, 1},          {"I8", 8, 1},       {"I16", 16, 1},
        {"U16", 16, 1},        {"F16", 16, 1},        {"BF16", 16, 1},    {"I32", 32, 1},
        {"U32", 32, 1},        {"F32", 32, 1},        {"F64", 64, 1},     {"I64", 64, 1},
        {"U64", 64, 1},        {"C64", 64, 0},        {"F8_E5M2", 8, 0},  {"F8_E4M3", 8, 0},
        {"F8_E8M0", 8, 0},     {"F8_E4M3FNUZ", 8, 0}, {"F8_E5M2FNUZ", 8, 0}, {"F4", 4, 0},
        {"F6_E2M3", 6, 0},     {"F6_E3M2", 6, 0},
    };
    for (int i = 0; i < BK_DT_COUNT; i++) {
        assert_string_equal(bk_dtype_name((bk_dtype)i), want[i].name);
        assert_int_equal(bk_dtype_bits((bk_dtype)i), want[i].bits);
        assert_int_equal(bk_dtype_is_numeric((bk_dtype)i), want[i].numeric);
        bk_dtype dt;
        assert_int_equal(bk_dtype_from_name(want[i].name, &dt), BK_OK);
        assert_int_equal(dt, i);
    }
    bk_dtype dt;
    assert_int_equal(bk_dtype_from_name("f32", &dt), BK_ERR_ST_DTYPE);
    assert_int_equal(bk_dtype_from_name("float32", &dt), BK_ERR_ST_DTYPE);
    assert_int_equal(bk_dtype_from_name("", &dt), BK_ERR_ST_DTYPE);
    assert_non_null(strstr(bk_last_error(), "unknown dtype"));
    assert_string_equal(bk_dtype_name(BK_DT_COUNT), "?");
    assert_string_equal(bk_dtype_name((bk_dtype)-1), "?");
    assert_int_equal(bk_dtype_bits(BK_DT_COUNT), 0);
    assert_int_equal(bk_dtype_is_numeric(BK_DT_COUNT), 0);
}

static void test_widening_exhaustive(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 0x10000; h++) {
        double want = ref_decode((uint16_t)h, 8, 7);
        float got = bk_bf16_to_f32((uint16_t)h);
        if (isnan(want)) {
            assert_true(isnan(got));
        } else {
            assert_true((double)got == want);
            assert_int_equal(signbit(got) != 0, (h & 0x8000) != 0);
            /* and back: exact values narrow to themselves */
            assert_int_equal(bk_f32_to_bf16(got), h);
        }
        want = ref_decode((uint16_t)h, 5, 10);
        got = bk_f16_to_f32((uint16_t)h);
        if (isnan(want)) {
            assert_true(isnan(got));
            assert_true(isnan(bk_f16_to_f32(bk_f32_to_f16(got))));
        } else {
            assert_true((double)got == want);
            assert_int_equal(signbit(got) != 0, (h & 0x8000) != 0);
            assert_int_equal(bk_f32_to_f16(got), h);
        }
    }
}

static void check_narrow(float f)
{
    uint16_t want = ref_f32_to_bf16(f), got = bk_f32_to_bf16(f);
    if (want == 0xffff) {
        assert_true(isnan(bk_bf16_to_f32(got)));
        assert_int_equal(got & 0x8000, (f32_bits(f) >> 16) & 0x8000);
    } else if (got != want) {
        fail_msg("bf16(%a) [0x%08x]: got 0x%04x, expected 0x%04x", (double)f, f32_bits(f), got,
                 want);
    }
    want = ref_f32_to_f16(f);
    got = bk_f32_to_f16(f);
    if (want == 0xffff) {
        assert_true(isnan(bk_f16_to_f32(got)));
        assert_int_equal(got & 0x8000, (f32_bits(f) >> 16) & 0x8000);
    } else if (got != want) {
        fail_msg("f16(%a) [0x%08x]: got 0x%04x, expected 0x%04x", (double)f, f32_bits(f), got,
                 want);
    }
}

static void test_narrowing_edges(void **state)
{
    (void)state;
    build_f16_table();
    static const uint32_t edges[] = {
        0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000,
        0x7f800001, /* signalling NaN whose payload vanishes when truncated */
        0x7fffffff, 0x00000001, 0x80000001, 0x007fffff, 0x00800000, 0x00008000,
        0x00018000, /* bf16 subnormal ties */
        0x3f808000, /* 1 + 2^-8: bf16 tie, rounds down to even 0x3f80 */
        0x3f818000, /* tie, rounds up to even 0x3f82 */
        0x3f808001, 0x3f807fff, 0x7f7f8000, /* tie at the top: rounds to inf */
        0x7f7f7fff, 0x7f7fffff, 0xff7f8000,
        0x3f801000, /* 1 + 2^-10: f16 tie, rounds down */
        0x3f803000, /* 1 + 3*2^-10: f16 tie, rounds up */
        0x477fe000, /* 65504 = max f16 */
        0x477fefff, 0x477ff000, /* 65520: f16 tie to inf */
        0x33800000, /* 2^-24: smallest f16 subnormal */
        0x33000000, /* 2^-25: half of it, tie to 0 */
        0x33000001, /* just above: rounds up to 2^-24 */
        0x33c00000, /* 1.5 * 2^-24: tie between 1 and 2 ulps -> 2 */
        0x38800000, /* 2^-14: smallest f16 normal */
        0x387fc000, /* just below: f16 subnormal boundary */
        0x387fe000, /* tie between largest subnormal and smallest normal */
        0xc7800000, /* -65536 */
    };
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; i++)
        check_narrow(bits_f32(edges[i]));
    /* spot values written out by hand */
    assert_int_equal(bk_f32_to_bf16(bits_f32(0x3f808000)), 0x3f80);
    assert_int_equal(bk_f32_to_bf16(bits_f32(0x3f818000)), 0x3f82);
    assert_int_equal(bk_f32_to_bf16(bits_f32(0x7f7f8000)), 0x7f80);
    assert_int_equal(bk_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(bk_f32_to_f16(65520.0f), 0x7c00);
    assert_int_equal(bk_f32_to_f16(65519.0f), 0x7bff);
    assert_int_equal(bk_f32_to_f16(bits_f32(0x33000000)), 0x0000);
    assert_int_equal(bk_f32_to_f16(bits_f32(0x33c00000)), 0x0002);
    assert_true(isnan(bk_bf16_to_f32(bk_f32_to_bf16(bits_f32(0x7f800001)))));
}

/* bk_f32_to_bf16_rn_dev (the GPU backward's host BF16 copies, issue 16)
 * against a reference written independently: the two BF16 neighbours of x
 * compared in double, ties to the even one, every NaN to 0x7fff (CUDA's
 * __float2bfloat16_rn / cvt.rn.bf16.f32). Edge cases (NaN payloads and
 * signs, Inf, ties up and down, subnormals, the overflow tie) and a stride
 * through every bit pattern. */
static uint16_t ref_bf16_rn_dev(uint32_t u)
{
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fff;
    const uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u; /* (hi: next magnitude) */
    if (lo == u)
        return (uint16_t)(lo >> 16);
    const double x = fabs((double)bits_f32(u)), a = fabs((double)bits_f32(lo));
    /* hi past the largest finite: the rounding's threshold is halfway to 2^128 */
    const double b = (hi & 0x7f800000u) == 0x7f800000u ? ldexp(1.0, 128) : fabs((double)bits_f32(hi));
    if (x - a < b - x)
        return (uint16_t)(lo >> 16);
    if (x - a > b - x)
        return (uint16_t)(hi >> 16);
    return (uint16_t)(((lo >> 16) & 1u) ? hi >> 16 : lo >> 16);
}

static void test_bf16_rn_dev(void **state)
{
    (void)state;
    static const uint32_t edges[] = {
        0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000,
        0x7f800001, 0xff800001, 0x7fffffff, 0xffffffff, 0x7fa00000, /* NaNs */
        0x00000001, 0x80000001, 0x007fffff, 0x807fffff, 0x00008000, 0x00018000,
        0x00008001, 0x00007fff, 0x007f8000, 0x007fc000, /* subnormals, their ties */
        0x00800000, 0x3f808000, 0x3f818000, 0xbf808000, 0xbf818000, 0x3f808001,
        0x3f807fff, 0x7f7f8000, 0xff7f8000, 0x7f7f7fff, 0x7f7fffff, 0x7f7f0000,
        0x3f800000, 0x40490fdb,
    };
    const size_t ne = sizeof edges / sizeof edges[0];
    float in[64];
    uint16_t out[64];
    for (size_t i = 0; i < ne; i++)
        in[i] = bits_f32(edges[i]);
    bk_f32_to_bf16_rn_dev(in, out, ne);
    for (size_t i = 0; i < ne; i++) {
        if (out[i] != ref_bf16_rn_dev(edges[i]))
            fail_msg("0x%08x: 0x%04x, reference 0x%04x", edges[i], out[i],
                     ref_bf16_rn_dev(edges[i]));
        /* finite and Inf: bk_f32_to_bf16's bits too (they differ on NaN only) */
        if ((edges[i] & 0x7fffffffu) <= 0x7f800000u)
            assert_int_equal(out[i], bk_f32_to_bf16(in[i]));
    }
    /* by hand: ties to even, overflow tie to Inf, canonical NaN, subnormal tie */
    assert_int_equal(out[22], 0x3f80);
    assert_int_equal(out[23], 0x3f82);
    assert_int_equal(out[24], 0xbf80);
    assert_int_equal(out[28], 0x7f80);
    assert_int_equal(out[29], 0xff80);
    assert_int_equal(out[6], 0x7fff);
    assert_int_equal(out[7], 0x7fff);
    assert_int_equal(out[15], 0x0000); /* 0x00008000: tie to even 0 */
    assert_int_equal(out[16], 0x0002); /* 0x00018000: tie to even 2 */
    /* a stride through all 2^32 patterns (odd, so every low-16 residue
     * class is visited), in blocks */
    static float blk[4096];
    static uint16_t ob[4096];
    uint64_t bad = 0, n = 0;
    for (uint64_t u = 0; u < (1ull << 32);) {
        size_t k = 0;
        uint32_t first = (uint32_t)u;
        for (; k < 4096 && u < (1ull << 32); k++, u += 1021)
            blk[k] = bits_f32((uint32_t)u);
        bk_f32_to_bf16_rn_dev(blk, ob, k);
        for (size_t i = 0; i < k; i++, n++)
            if (ob[i] != ref_bf16_rn_dev((uint32_t)(first + i * 1021u)))
                bad++;
    }
    printf("  bf16 rn (device rounding): %llu patterns, %llu differ from the reference\n",
           (unsigned long long)n, (unsigned long long)bad);
    assert_true(bad == 0);
}

/* The GPU backward's BF16 boundary matrices (--bwd-precision bf16, session
 * 14): cuda/backward.cu rounds h and dh at every layer boundary in place
 * (k_round_bf16: x -> widen(rn(x))), a store narrows that F32 value again
 * (k_to_bf16_rn) and a load widens the stored bits (k_bf16_to_f32). Halving
 * equals naive bit for bit only if store-then-load gives back the rounded
 * F32 value exactly: rn(widen(rn(x))) == rn(x) for every x (NaN: the
 * canonical 0x7fff both times), and widen(rn(widen(b))) == widen(b) for
 * every BF16 pattern b that is not a NaN. The device's rounding is
 * __float2bfloat16_rn, whose bits bk_f32_to_bf16_rn_dev reproduces
 * (test_bf16_rn_dev). */
static void test_bf16_boundary_roundtrip(void **state)
{
    (void)state;
    static float blk[4096], rt[4096];
    static uint16_t b1[4096], b2[4096];
    /* every BF16 pattern: stored (narrowed) and loaded (widened) unchanged */
    for (uint32_t b0 = 0; b0 < 0x10000u; b0 += 4096) {
        for (uint32_t i = 0; i < 4096; i++)
            blk[i] = bk_bf16_to_f32((uint16_t)(b0 + i));
        bk_f32_to_bf16_rn_dev(blk, b1, 4096);
        for (uint32_t i = 0; i < 4096; i++) {
            const uint32_t b = b0 + i;
            if ((b & 0x7fffu) > 0x7f80u) { /* NaN: canonical */
                assert_int_equal(b1[i], 0x7fff);
                continue;
            }
            if (b1[i] != b)
                fail_msg("BF16 0x%04x: stored as 0x%04x", b, b1[i]);
            const float back = bk_bf16_to_f32(b1[i]);
            if (memcmp(&back, &blk[i], sizeof back) != 0)
                fail_msg("BF16 0x%04x: loaded back as 0x%08x", b, f32_bits(back));
        }
    }
    /* a stride through the F32 patterns: round, store, load, round again */
    uint64_t n = 0;
    for (uint64_t u = 0; u < (1ull << 32);) {
        size_t k = 0;
        for (; k < 4096 && u < (1ull << 32); k++, u += 65521)
            blk[k] = bits_f32((uint32_t)u);
        bk_f32_to_bf16_rn_dev(blk, b1, k); /* the boundary rounding */
        for (size_t i = 0; i < k; i++)
            rt[i] = bk_bf16_to_f32(b1[i]); /* h / dh after k_round_bf16 */
        bk_f32_to_bf16_rn_dev(rt, b2, k);  /* the store */
        for (size_t i = 0; i < k; i++, n++) {
            if (b2[i] != b1[i])
                fail_msg("F32 0x%08x: rounded to 0x%04x, stored as 0x%04x", f32_bits(blk[i]),
                         b1[i], b2[i]);
            const float back = bk_bf16_to_f32(b2[i]); /* the load */
            if (memcmp(&back, &rt[i], sizeof back) != 0)
                fail_msg("F32 0x%08x: loaded back differently", f32_bits(blk[i]));
        }
    }
    printf("  bf16 boundary store/load: 65536 BF16 patterns, %llu F32 patterns: same bits\n",
           (unsigned long long)n);
}

static void test_narrowing_random(void **state)
{
    (void)state;
    build_f16_table();
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < 400000; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        uint32_t u = (uint32_t)(s >> 16);
        if (i & 1) /* concentrate half the samples near the f16 range and on ties */
            u = (u & 0x8fffffffu) | 0x30000000u;
        if ((i % 7) == 0)
            u = (u & ~0x1fffu) | 0x1000u; /* f16 tie pattern in the dropped bits */
        if ((i % 11) == 0)
            u = (u & ~0xffffu) | 0x8000u; /* bf16 tie pattern */
        check_narrow(bits_f32(u));
    }
}

static void test_convert_float_paths(void **state)
{
    (void)state;
    /* F64 -> BF16 must round once: 1 + 2^-8 + 2^-40 lies above the tie, so 1 + 2^-7
     * (0x3f81); going through F32 first would drop 2^-40 and round the tie to 1.0 */
    double d = 1.0 + ldexp(1.0, -8) + ldexp(1.0, -40);
    uint16_t h;
    assert_int_equal(bk_convert(&d, BK_DT_F64, &h, BK_DT_BF16, 1), BK_OK);
    assert_int_equal(h, 0x3f81);
    /* F64 -> F16 likewise: 1 + 2^-11 + 2^-40 -> 1 + 2^-10 (0x3c01) */
    d = 1.0 + ldexp(1.0, -11) + ldexp(1.0, -40);
    assert_int_equal(bk_convert(&d, BK_DT_F64, &h, BK_DT_F16, 1), BK_OK);
    assert_int_equal(h, 0x3c01);
    /* F64 -> F32 nearest even: 1 + 2^-24 is a tie -> 1.0; 1 + 3*2^-24 -> 1 + 2^-22 */
    double dd[2] = {1.0 + ldexp(1.0, -24), 1.0 + 3 * ldexp(1.0, -24)};
    float ff[2];
    assert_int_equal(bk_convert(dd, BK_DT_F64, ff, BK_DT_F32, 2), BK_OK);
    assert_true(ff[0] == 1.0f);
    assert_true((double)ff[1] == 1.0 + ldexp(1.0, -22));
    /* BF16 -> F16: 2^-20 = 16 * 2^-24 is an F16 subnormal, exactly 0x0010 */
    uint16_t b = 0x3580; /* 2^-20 in bf16 */
    assert_int_equal(bk_convert(&b, BK_DT_BF16, &h, BK_DT_F16, 1), BK_OK);
    assert_int_equal(h, 0x0010);
    /* F16 -> BF16: 1 + 2^-10 -> 1.0 (BF16 keeps 7 bits; 2^-10 is below half an ulp) */
    uint16_t f16 = 0x3c01;
    assert_int_equal(bk_convert(&f16, BK_DT_F16, &h, BK_DT_BF16, 1), BK_OK);
    assert_int_equal(h, 0x3f80);
    /* NaN and infinities survive every float path */
    float src[3] = {NAN, INFINITY, -INFINITY};
    double out64[3];
    uint16_t o16[3];
    assert_int_equal(bk_convert(src, BK_DT_F32, out64, BK_DT_F64, 3), BK_OK);
    assert_true(isnan(out64[0]) && isinf(out64[1]) && out64[2] < 0);
    assert_int_equal(bk_convert(out64, BK_DT_F64, o16, BK_DT_BF16, 3), BK_OK);
    assert_true((o16[0] & 0x7f80) == 0x7f80 && (o16[0] & 0x7f));
    assert_int_equal(o16[1], 0x7f80);
    assert_int_equal(o16[2], 0xff80);
    assert_int_equal(bk_convert(out64, BK_DT_F64, o16, BK_DT_F16, 3), BK_OK);
    assert_true((o16[0] & 0x7c00) == 0x7c00 && (o16[0] & 0x3ff));
    assert_int_equal(o16[1], 0x7c00);
    assert_int_equal(o16[2], 0xfc00);
}

/* Bytes of value v (small, representable everywhere) in dtype dt. */
static void put_value(bk_dtype dt, void *p, double v)
{
    switch (dt) {
    case BK_DT_BOOL: *(uint8_t *)p = v != 0; break;
    case BK_DT_U8: *(uint8_t *)p = (uint8_t)v; break;
    case BK_DT_I8: *(int8_t *)p = (int8_t)v; break;
    case BK_DT_U16: *(uint16_t *)p = (uint16_t)v; break;
    case BK_DT_I16: *(int16_t *)p = (int16_t)v; break;
    case BK_DT_U32: *(uint32_t *)p = (uint32_t)v; break;
    case BK_DT_I32: *(int32_t *)p = (int32_t)v; break;
    case BK_DT_U64: *(uint64_t *)p = (uint64_t)v; break;
    case BK_DT_I64: *(int64_t *)p = (int64_t)v; break;
    case BK_DT_F32: *(float *)p = (float)v; break;
    case BK_DT_F64: *(double *)p = v; break;
    case BK_DT_F16: {
        /* small integers and halves: build the pattern from the definition */
        uint16_t h = 0;
        if (v != 0) {
            double a = fabs(v);
            int e;
            double m = frexp(a, &e); /* a = m 2^e, m in [0.5,1) */
            h = (uint16_t)(((e - 1 + 15) << 10) | (uint16_t)((m * 2 - 1) * 1024));
            if (v < 0)
                h |= 0x8000;
        }
        memcpy(p, &h, 2);
        break;
    }
    case BK_DT_BF16: {
        uint16_t h = 0;
        if (v != 0) {
            double a = fabs(v);
            int e;
            double m = frexp(a, &e);
            h = (uint16_t)(((e - 1 + 127) << 7) | (uint16_t)((m * 2 - 1) * 128));
            if (v < 0)
                h |= 0x8000;
        }
        memcpy(p, &h, 2);
        break;
    }
    default: break;
    }
}

static int is_float_dt(bk_dtype d)
{
    return d == BK_DT_F16 || d == BK_DT_BF16 || d == BK_DT_F32 || d == BK_DT_F64;
}

static int is_signed_dt(bk_dtype d)
{
    return is_float_dt(d) || d == BK_DT_I8 || d == BK_DT_I16 || d == BK_DT_I32 || d == BK_DT_I64;
}

static void test_convert_matrix(void **state)
{
    (void)state;
    static const bk_dtype numeric[] = {BK_DT_BOOL, BK_DT_U8,  BK_DT_I8,  BK_DT_I16, BK_DT_U16,
                                       BK_DT_F16,  BK_DT_BF16, BK_DT_I32, BK_DT_U32, BK_DT_F32,
                                       BK_DT_F64,  BK_DT_I64, BK_DT_U64};
    const double vals[] = {0, 1, 2, 3, 7, 100, 127, -1, -2, -100, 0.5, -0.25};
    const int nv = sizeof vals / sizeof vals[0];
    unsigned char src[16 * 8], dst[16 * 8], want[16 * 8];
    for (size_t a = 0; a < sizeof numeric / sizeof numeric[0]; a++) {
        for (size_t b = 0; b < sizeof numeric / sizeof numeric[0]; b++) {
            bk_dtype s = numeric[a], d = numeric[b];
            size_t ss = bk_dtype_bits(s) / 8, ds = bk_dtype_bits(d) / 8;
            /* the values both dtypes can hold exactly */
            double use[16];
            int n = 0;
            for (int i = 0; i < nv; i++) {
                double v = vals[i];
                if (v != floor(v) && (!is_float_dt(s) || !is_float_dt(d)))
                    continue;
                if (v < 0 && (!is_signed_dt(s) || !is_signed_dt(d)))
                    continue;
                if ((s == BK_DT_BOOL || d == BK_DT_BOOL) && v > 1)
                    continue;
                use[n++] = v;
            }
            for (int i = 0; i < n; i++) {
                put_value(s, src + i * ss, use[i]);
                put_value(d, want + i * ds, use[i]);
            }
            memset(dst, 0xa5, sizeof dst);
            bk_status st = bk_convert(src, s, dst, d, (size_t)n);
            if (is_float_dt(s) && !is_float_dt(d)) {
                assert_int_equal(st, BK_ERR_DTYPE);
                assert_non_null(strstr(bk_last_error(), "float to integer"));
                continue;
            }
            if (st != BK_OK)
                fail_msg("%s -> %s: %s", bk_dtype_name(s), bk_dtype_name(d), bk_last_error());
            if (memcmp(dst, want, (size_t)n * ds) != 0)
                fail_msg("%s -> %s: wrong values", bk_dtype_name(s), bk_dtype_name(d));
            /* unaligned buffers give the same result */
            unsigned char us[16 * 8 + 1], ud[16 * 8 + 1];
            memcpy(us + 1, src, (size_t)n * ss);
            assert_int_equal(bk_convert(us + 1, s, ud + 1, d, (size_t)n), BK_OK);
            assert_memory_equal(ud + 1, want, (size_t)n * ds);
        }
    }
}

static void test_convert_int_ranges(void **state)
{
    (void)state;
    int32_t big = 300;
    uint8_t u8;
    assert_int_equal(bk_convert(&big, BK_DT_I32, &u8, BK_DT_U8, 1), BK_ERR_DTYPE);
    assert_non_null(strstr(bk_last_error(), "out of range"));
    int8_t neg = -1;
    uint64_t u64;
    assert_int_equal(bk_convert(&neg, BK_DT_I8, &u64, BK_DT_U64, 1), BK_ERR_DTYPE);
    uint64_t huge = UINT64_MAX;
    int64_t i64;
    assert_int_equal(bk_convert(&huge, BK_DT_U64, &i64, BK_DT_I64, 1), BK_ERR_DTYPE);
    int64_t mn = INT64_MIN;
    assert_int_equal(bk_convert(&mn, BK_DT_I64, &i64, BK_DT_I64, 1), BK_OK);
    assert_true(i64 == INT64_MIN);
    int16_t two = 2;
    uint8_t bl;
    assert_int_equal(bk_convert(&two, BK_DT_I16, &bl, BK_DT_BOOL, 1), BK_ERR_DTYPE);
    /* BOOL source: any non-zero byte is true */
    uint8_t bsrc[3] = {0, 1, 0x80};
    float bf[3];
    assert_int_equal(bk_convert(bsrc, BK_DT_BOOL, bf, BK_DT_F32, 3), BK_OK);
    assert_true(bf[0] == 0 && bf[1] == 1 && bf[2] == 1);
    /* wide integers to floats, correctly rounded:
     * 2^60 + 2^52 + 1 -> BF16 is 2^60 + 2^53 (0x5d81), not the tie-to-even 2^60 */
    uint64_t w = (1ull << 60) + (1ull << 52) + 1;
    uint16_t h;
    assert_int_equal(bk_convert(&w, BK_DT_U64, &h, BK_DT_BF16, 1), BK_OK);
    assert_int_equal(h, 0x5d81);
    int64_t wn = -(int64_t)w;
    assert_int_equal(bk_convert(&wn, BK_DT_I64, &h, BK_DT_BF16, 1), BK_OK);
    assert_int_equal(h, 0xdd81);
    /* 2^24 + 1 -> F32 is a tie -> 2^24; 2^24 + 3 -> 2^24 + 4 */
    int64_t iv[2] = {(1 << 24) + 1, (1 << 24) + 3};
    float fv[2];
    assert_int_equal(bk_convert(iv, BK_DT_I64, fv, BK_DT_F32, 2), BK_OK);
    assert_true(fv[0] == 16777216.0f && fv[1] == 16777220.0f);
    /* integers beyond the F16 range become infinity */
    int32_t i32 = 70000;
    assert_int_equal(bk_convert(&i32, BK_DT_I32, &h, BK_DT_F16, 1), BK_OK);
    assert_int_equal(h, 0x7c00);
    u64 = UINT64_MAX;
    double dv;
    assert_int_equal(bk_convert(&u64, BK_DT_U64, &dv, BK_DT_F64, 1), BK_OK);
    assert_true(dv == 18446744073709551616.0);
}

static void test_convert_refusals(void **state)
{
    (void)state;
    unsigned char a[16] = {0}, b[16];
    assert_int_equal(bk_convert(a, BK_DT_F8_E4M3, b, BK_DT_F32, 1), BK_ERR_DTYPE);
    assert_non_null(strstr(bk_last_error(), "F8_E4M3"));
    assert_int_equal(bk_convert(a, BK_DT_F32, b, BK_DT_C64, 1), BK_ERR_DTYPE);
    assert_int_equal(bk_convert(a, BK_DT_F4, b, BK_DT_F4, 1), BK_ERR_DTYPE);
    assert_int_equal(bk_convert(a, BK_DT_F32, b, BK_DT_I32, 1), BK_ERR_DTYPE);
    assert_int_equal(bk_convert(a, BK_DT_F16, b, BK_DT_U8, 1), BK_ERR_DTYPE);
    assert_int_equal(bk_convert(a, (bk_dtype)99, b, BK_DT_F32, 1), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_convert(NULL, BK_DT_F32, b, BK_DT_F64, 1), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_convert(NULL, BK_DT_F32, NULL, BK_DT_F64, 0), BK_OK);
    assert_int_equal(bk_convert(a, BK_DT_F32, b, BK_DT_F64, SIZE_MAX / 2), BK_ERR_INVALID_ARG);
}

static void test_tensor_to(void **state)
{
    (void)state;
    uint16_t bf[3] = {0x3f80, 0xc000, 0x7f80};
    bk_tensor_info t;
    memset(&t, 0, sizeof t);
    t.name = "w";
    t.file = "x.safetensors";
    t.dtype = BK_DT_BF16;
    t.ndim = 1;
    t.shape[0] = 3;
    t.numel = 3;
    t.nbytes = 6;
    t.data = bf;
    float f[3];
    double d[3];
    assert_int_equal(bk_tensor_to_f32(&t, f), BK_OK);
    assert_true(f[0] == 1.0f && f[1] == -2.0f && isinf(f[2]));
    assert_int_equal(bk_tensor_to_f64(&t, d), BK_OK);
    assert_true(d[0] == 1.0 && d[1] == -2.0 && isinf(d[2]));
    unsigned char f8[3] = {1, 2, 3};
    t.dtype = BK_DT_F8_E5M2;
    t.nbytes = 3;
    t.data = f8;
    assert_int_equal(bk_tensor_to_f32(&t, f), BK_ERR_DTYPE);
    assert_non_null(strstr(bk_last_error(), "x.safetensors"));
    assert_non_null(strstr(bk_last_error(), "'w'"));
    assert_non_null(strstr(bk_last_error(), "F8_E5M2"));
    assert_int_equal(bk_tensor_to_f64(&t, d), BK_ERR_DTYPE);
    assert_int_equal(bk_tensor_to_f32(NULL, f), BK_ERR_INVALID_ARG);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names_and_bits),
        cmocka_unit_test(test_widening_exhaustive),
        cmocka_unit_test(test_narrowing_edges),
        cmocka_unit_test(test_narrowing_random),
        cmocka_unit_test(test_bf16_rn_dev),
        cmocka_unit_test(test_bf16_boundary_roundtrip),
        cmocka_unit_test(test_convert_float_paths),
        cmocka_unit_test(test_convert_matrix),
        cmocka_unit_test(test_convert_int_ranges),
        cmocka_unit_test(test_convert_refusals),
        cmocka_unit_test(test_tensor_to),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
