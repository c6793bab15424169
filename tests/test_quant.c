/* Alphabets: scale/zero rules against hand-computed values (GPTQ reference
 * conventions), clamping, rounding half to even, MSE search, group
 * boundaries, spec validation. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "quant.h"
#include "test_solver_util.h"

static void fit_u(const double *x, int64_t len, int bits, int asym, int mse, float *s, float *z)
{
    assert_int_equal(bk_q_fit_uniform(x, len, bits, asym, mse, s, z), BK_OK);
}

static void test_uniform_rules(void **state)
{
    (void)state;
    float s, z;
    /* asym, 2 bits: xmin = -1, xmax = 2 -> scale 3/3 = 1, zero = round(1/1) = 1 */
    const double x1[] = {-1.0, 0.5, 2.0};
    fit_u(x1, 3, 2, 1, 0, &s, &z);
    assert_true(s == 1.0f && z == 1.0f);
    /* sym: xmax = max(|-1|, 2) = 2, xmin = -2 -> scale 4/3, zero (3+1)/2 = 2 */
    fit_u(x1, 3, 2, 0, 0, &s, &z);
    assert_true(s == (float)(4.0 / 3.0) && z == 2.0f);
    /* sym with no negative value: the reference keeps xmin = 0 ->
     * scale = 1.5 / 3 = 0.5, zero still 2 */
    const double x2[] = {0.5, 1.5};
    fit_u(x2, 2, 2, 0, 0, &s, &z);
    assert_true(s == 0.5f && z == 2.0f);
    /* all zero: xmin = -1, xmax = 1; 4 bits -> scale 2/15; sym zero 8 */
    const double x3[] = {0.0, 0.0, 0.0};
    fit_u(x3, 3, 4, 0, 0, &s, &z);
    assert_true(s == (float)(2.0 / 15.0) && z == 8.0f);
    /* asym zero = round(1 / fl32(2/15)) = round(7.4999996...) = 7 */
    fit_u(x3, 3, 4, 1, 0, &s, &z);
    assert_true(s == (float)(2.0 / 15.0));
    assert_true(z == 7.0f);
    /* asym zero on an exact tie: xmin = -0.5, xmax = 2.5, 2 bits -> scale 1,
     * zero = round(0.5) = 0 (half to even; half away from zero would give 1) */
    const double x4[] = {-0.5, 2.5, 1.0};
    fit_u(x4, 3, 2, 1, 0, &s, &z);
    assert_true(s == 1.0f && z == 0.0f);
    /* 8 bits asym: xmin = -2.55, xmax = 0 -> scale 0.01, zero 255 */
    const double x5[] = {-2.55, -1.0};
    fit_u(x5, 2, 8, 1, 0, &s, &z);
    assert_true(fabsf(s - 0.01f) <= 1e-8f);
    assert_true(z == 255.0f);
}

static void test_levels_rules(void **state)
{
    (void)state;
    float s;
    const double x[] = {0.3, -0.9, 0.6};
    assert_int_equal(bk_q_fit_levels(x, 3, 3, 0, &s), BK_OK);
    assert_true(s == (float)(0.9 / 3.0));
    const double z[] = {0.0, 0.0};
    assert_int_equal(bk_q_fit_levels(z, 2, 3, 0, &s), BK_OK);
    assert_true(s == (float)(1.0 / 3.0)); /* all-zero row: as if max |x| = 1 */
    assert_int_equal(bk_q_fit_levels(x, 3, 1, 0, &s), BK_OK);
    assert_true(s == 0.9f);
}

static void test_objectives(void **state)
{
    (void)state;
    const double x[] = {0.3, -0.9, 0.6};
    /* levels, squared error. s = 0.25: 1.2 -> 1 (0.25), -3.6 -> -4 -> clamp -3
     * (-0.75), 2.4 -> 2 (0.5) */
    double want = 0.05 * 0.05 + 0.15 * 0.15 + 0.1 * 0.1;
    double got = bk_q_levels_objective(x, 3, 3, 0.25);
    assert_true(fabs(got - want) <= 1e-12 * want);
    /* uniform (GPTQ's norm 2.4), maxq 3, scale 0.5, zero 1: 0.3 -> round(0.6)+1 = 2 (0.5);
     * -0.9 -> round(-1.8)+1 = -1 -> 0 (-0.5); 0.6 -> round(1.2)+1 = 2 (0.5) */
    want = pow(0.2, 2.4) + pow(0.4, 2.4) + pow(0.1, 2.4);
    got = bk_q_uniform_objective(x, 3, 3, 0.5, 1.0);
    assert_true(fabs(got - want) <= 1e-12 * want);
}

static bk_alphabet make_alpha(bk_qkind kind, int levels, int bits, int64_t group, int asym,
                              int64_t m, int64_t n)
{
    bk_quant_spec q = {0};
    q.kind = kind;
    q.levels = levels;
    q.bits = bits;
    q.group = group;
    q.asym = asym;
    bk_alphabet a;
    assert_int_equal(bk_alphabet_init(&a, &q, m, n), BK_OK);
    return a;
}

static void test_apply_and_clamp(void **state)
{
    (void)state;
    bk_q_counts cnt = {0, 0, 0};
    int32_t code;
    /* uniform 2 bits, scale 1, zero 1 */
    bk_alphabet a = make_alpha(BK_Q_UNIFORM, 0, 2, 0, 1, 1, 4);
    a.scale[0] = 1.0f;
    a.zero[0] = 1.0f;
    double v = bk_q_apply_d(&a, 5.0, 0, 0, &code, &cnt); /* 5+1 -> clamp 3 */
    assert_int_equal(code, 3);
    assert_true(v == 2.0);
    v = bk_q_apply_d(&a, -3.0, 0, 1, &code, &cnt); /* -2 -> clamp 0 */
    assert_int_equal(code, 0);
    assert_true(v == -1.0);
    assert_int_equal(cnt.clamped, 2);
    v = bk_q_apply_d(&a, 0.5, 0, 2, &code, &cnt); /* round(0.5) = 0 (half even) */
    assert_int_equal(code, 1);
    assert_true(v == 0.0);
    float vf = bk_q_apply_f(&a, 1.5f, 0, 3, &code, &cnt); /* round(1.5) = 2 */
    assert_int_equal(code, 3);
    assert_true(vf == 2.0f);
    assert_int_equal(cnt.clamped, 2);
    bk_alphabet_free(&a);

    /* levels 3, scale 0.25 */
    a = make_alpha(BK_Q_LEVELS, 3, 0, 0, 0, 1, 3);
    a.scale[0] = 0.25f;
    v = bk_q_apply_d(&a, 2.0, 0, 0, &code, &cnt);
    assert_int_equal(code, 3);
    assert_true(v == 0.75);
    assert_int_equal(cnt.clamped, 3);
    v = bk_q_apply_d(&a, -0.375, 0, 1, &code, &cnt); /* -1.5 -> -2 */
    assert_int_equal(code, -2);
    assert_true(v == -0.5);
    v = bk_q_apply_d(&a, 0.625, 0, 2, &code, &cnt); /* 2.5 -> 2 */
    assert_int_equal(code, 2);
    assert_true(v == 0.5);
    bk_alphabet_free(&a);

    /* integer */
    a = make_alpha(BK_Q_INTEGER, 0, 0, 0, 0, 1, 3);
    v = bk_q_apply_d(&a, 2.5, 0, 0, &code, &cnt);
    assert_int_equal(code, 2);
    assert_true(v == 2.0);
    v = bk_q_apply_d(&a, -3.5, 0, 1, &code, &cnt);
    assert_int_equal(code, -4);
    assert_int_equal(cnt.overflow, 0);
    (void)bk_q_apply_d(&a, 40000.0, 0, 2, &code, &cnt);
    assert_int_equal(cnt.overflow, 1);
    assert_int_equal(cnt.nonfinite, 0);
    (void)bk_q_apply_d(&a, NAN, 0, 2, &code, &cnt);
    assert_int_equal(cnt.nonfinite, 1);
    bk_alphabet_free(&a);
}

static void test_mse_never_worse(void **state)
{
    (void)state;
    trng r = {12345, 0, 0};
    double x[257];
    for (int trial = 0; trial < 40; trial++) {
        const int64_t len = 1 + (int64_t)(trng_unif(&r) * 256);
        for (int64_t j = 0; j < len; j++) {
            x[j] = trng_normal(&r);
            if (trng_unif(&r) < 0.03)
                x[j] *= 8; /* outliers: the search has something to gain */
            if (trial % 5 == 0)
                x[j] = fabs(x[j]);
        }
        float s0, s1, z0, z1;
        assert_int_equal(bk_q_fit_levels(x, len, 3, 0, &s0), BK_OK);
        assert_int_equal(bk_q_fit_levels(x, len, 3, 1, &s1), BK_OK);
        assert_true(bk_q_levels_objective(x, len, 3, s1) <= bk_q_levels_objective(x, len, 3, s0));
        assert_true(s1 <= s0 && s1 >= 0.5f * s0 * (1 - 1e-6f));
        const int bits[] = {2, 3, 4, 8};
        for (int b = 0; b < 4; b++)
            for (int asym = 0; asym < 2; asym++) {
                const int maxq = (1 << bits[b]) - 1;
                fit_u(x, len, bits[b], asym, 0, &s0, &z0);
                fit_u(x, len, bits[b], asym, 1, &s1, &z1);
                assert_true(bk_q_uniform_objective(x, len, maxq, s1, z1) <=
                            bk_q_uniform_objective(x, len, maxq, s0, z0));
                assert_true(s1 <= s0 && s1 >= 0.2f * s0);
                assert_true(z1 >= 0 && z1 <= maxq);
            }
    }
    /* a mild outlier over a uniform spread: shrinking the levels scale to
     * 0.73x lowers the squared error (0.869 -> 0.571, computed apart) */
    double y[64];
    for (int j = 0; j < 63; j++)
        y[j] = -1.0 + 2.0 * j / 62.0;
    y[63] = 1.25;
    float s0, s1;
    assert_int_equal(bk_q_fit_levels(y, 64, 3, 0, &s0), BK_OK);
    assert_int_equal(bk_q_fit_levels(y, 64, 3, 1, &s1), BK_OK);
    assert_true(s1 < 0.8f * s0 && s1 > 0.7f * s0);
    assert_true(fabs(bk_q_levels_objective(y, 64, 3, s0) - 0.868728) < 1e-5);
    assert_true(fabs(bk_q_levels_objective(y, 64, 3, s1) - 0.571122) < 1e-5);
}

static void test_groups(void **state)
{
    (void)state;
    const int64_t m = 2, n = 10;
    bk_alphabet a = make_alpha(BK_Q_UNIFORM, 0, 4, 4, 1, m, n);
    assert_int_equal(a.groups, 3);
    assert_int_equal(a.group, 4);
    double W[20];
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++)
            W[i * n + j] = (double)((j / 4) + 1) * (j % 2 ? 1.0 : -0.5) * (double)(i + 1);
    assert_int_equal(bk_alphabet_fit(&a, W, n), BK_OK);
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < 3; g++) {
            const int64_t len = g < 2 ? 4 : 2;
            float s, z;
            fit_u(W + i * n + g * 4, len, 4, 1, 0, &s, &z);
            assert_true(a.scale[i * 3 + g] == s);
            assert_true(a.zero[i * 3 + g] == z);
        }
    /* the groups differ, so each entry must use its own group's scale */
    assert_true(a.scale[0] != a.scale[1] && a.scale[1] != a.scale[2]);
    const int64_t cols[] = {0, 3, 4, 7, 8, 9};
    for (int c = 0; c < 6; c++) {
        const int64_t j = cols[c], g = j / 4;
        bk_q_counts cnt = {0, 0, 0};
        int32_t code;
        double v = bk_q_apply_d(&a, 0.7, 1, j, &code, &cnt);
        const double s = a.scale[3 + g], z = a.zero[3 + g];
        double q = rint(0.7 / s) + z;
        q = q < 0 ? 0 : (q > 15 ? 15 : q);
        assert_int_equal(code, (int32_t)q);
        assert_true(v == s * (q - z));
        assert_true(bk_q_scale_at(&a, 1, j) == s);
    }
    bk_alphabet_free(&a);
    /* group >= n or 0: one group per row */
    a = make_alpha(BK_Q_UNIFORM, 0, 4, 10, 0, m, n);
    assert_int_equal(a.groups, 1);
    bk_alphabet_free(&a);
    a = make_alpha(BK_Q_UNIFORM, 0, 4, 0, 0, m, n);
    assert_int_equal(a.groups, 1);
    assert_int_equal(a.group, n);
    bk_alphabet_free(&a);
}

static void test_spec_errors(void **state)
{
    (void)state;
    bk_alphabet a;
    bk_quant_spec q = {0};
    q.kind = BK_Q_UNIFORM;
    q.bits = 5;
    assert_int_equal(bk_alphabet_init(&a, &q, 2, 3), BK_ERR_INVALID_ARG);
    q.bits = 4;
    q.group = -2;
    assert_int_equal(bk_alphabet_init(&a, &q, 2, 3), BK_ERR_INVALID_ARG);
    q.group = 0;
    q.refit_groups = 1;
    assert_int_equal(bk_alphabet_init(&a, &q, 2, 3), BK_ERR_INVALID_ARG);
    q.kind = BK_Q_LEVELS;
    q.refit_groups = 0;
    q.levels = 0;
    assert_int_equal(bk_alphabet_init(&a, &q, 2, 3), BK_ERR_INVALID_ARG);
    q.levels = 3;
    assert_int_equal(bk_alphabet_init(&a, &q, 0, 3), BK_ERR_INVALID_ARG);
    q.kind = (bk_qkind)9;
    assert_int_equal(bk_alphabet_init(&a, &q, 2, 3), BK_ERR_INVALID_ARG);
    /* a value range beyond fp32 scales */
    const double big[] = {1e300, -1.0};
    float s, z;
    assert_int_equal(bk_q_fit_levels(big, 2, 3, 0, &s), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_q_fit_uniform(big, 2, 4, 1, 0, &s, &z), BK_ERR_INVALID_ARG);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_uniform_rules),   cmocka_unit_test(test_levels_rules),
        cmocka_unit_test(test_objectives),      cmocka_unit_test(test_apply_and_clamp),
        cmocka_unit_test(test_mse_never_worse), cmocka_unit_test(test_groups),
        cmocka_unit_test(test_spec_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
