/* The alphabet fit on the device (bk_cuda_alphabet_fit, cuda/qfit.cu)
 * against the CPU's bk_alphabet_fit (src/quant.c) on the same F32 weights.
 * Suite cuda; exit 77 = skipped without a GPU.
 *
 *   - levels 3 and 7 with and without the MSE search, uniform 2/3/4-bit
 *     symmetric and asymmetric, per row and per group of 64 / 128 (with a
 *     ragged last group): every scale and zero point identical to the CPU's
 *     except where two grid points tie to the last bits (the sums run in
 *     another order): at least 99.9% of cells identical and, where they
 *     differ, the CPU objectives of both choices equal to 1e-12 relative;
 *   - rows of zeros, a row with no negative value, dead columns (as zeros);
 *   - +-FLT_MAX in a row (scales near the top of F32) as the CPU;
 *   - nothing leaks (tracked device memory back to its start value).
 */
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

extern "C" { /* cmocka 1.1 declares its functions without C linkage in C++ */
#include <cmocka.h>
}

#include "cuda/qfit.cuh"

static bk_cuda_ctx *g_c;

static uint64_t g_s = 12345;
static double unif(void)
{
    uint64_t z = (g_s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

static double normal(void)
{
    double u = unif(), v = unif();
    if (u < 1e-300)
        u = 1e-300;
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
}

/* W [m, n]: heavy-tailed rows, a zero row, a row without negatives, and
 * optionally dead columns (zeroed, as the solver does). */
static float *make_w(int64_t m, int64_t n, const unsigned char *dead)
{
    float *w = static_cast<float *>(malloc(sizeof(float) * (size_t)(m * n)));
    assert_non_null(w);
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double v = normal() * (0.02 + 0.01 * (double)(i % 7));
            if (unif() < 0.01)
                v *= 8.0; /* outliers */
            if (i == 1)
                v = 0.0;
            if (i == 2)
                v = std::fabs(v);
            w[i * n + j] = dead && dead[j] ? 0.0f : (float)v;
        }
    return w;
}

static double cell_obj(const bk_alphabet *a, const double *x, int64_t len, float s, float z)
{
    if (a->spec.kind == BK_Q_LEVELS)
        return bk_q_levels_objective(x, len, a->spec.levels, (double)s);
    return bk_q_uniform_objective(x, len, (1 << a->spec.bits) - 1, (double)s, (double)z);
}

/* extreme: +-FLT_MAX in rows 0 and 3 */
static void compare(const bk_quant_spec *spec, int64_t m, int64_t n, int with_dead,
                    int extreme = 0)
{
    unsigned char *dead = NULL, *ddead = NULL;
    if (with_dead) {
        dead = static_cast<unsigned char *>(calloc((size_t)n, 1));
        assert_non_null(dead);
        dead[3] = dead[n / 2] = dead[n - 1] = 1;
    }
    float *w = make_w(m, n, dead);
    if (extreme) {
        w[0 * n + 5] = FLT_MAX;
        w[0 * n + 9] = -FLT_MAX;
        w[3 * n + 1] = FLT_MAX;
    }
    double *wd = static_cast<double *>(malloc(sizeof(double) * (size_t)(m * n)));
    assert_non_null(wd);
    for (int64_t t = 0; t < m * n; t++)
        wd[t] = (double)w[t];
    const size_t mem0 = g_c->mem_current;
    float *dw = NULL;
    assert_int_equal(bk_dev_alloc(g_c, (void **)&dw, sizeof(float) * (size_t)(m * n), "W"), BK_OK);
    assert_int_equal(cudaMemcpy(dw, w, sizeof(float) * (size_t)(m * n), cudaMemcpyHostToDevice),
                     cudaSuccess);
    if (dead) {
        assert_int_equal(bk_dev_alloc(g_c, (void **)&ddead, (size_t)n, "dead"), BK_OK);
        assert_int_equal(cudaMemcpy(ddead, dead, (size_t)n, cudaMemcpyHostToDevice), cudaSuccess);
    }
    bk_alphabet ac, ag;
    assert_int_equal(bk_alphabet_init(&ac, spec, m, n), BK_OK);
    assert_int_equal(bk_alphabet_init(&ag, spec, m, n), BK_OK);
    assert_int_equal(bk_alphabet_fit(&ac, wd, n), BK_OK);
    bk_status st = bk_cuda_alphabet_fit(g_c, &ag, dw, n, ddead);
    if (st != BK_OK)
        fail_msg("device fit: %s", bk_last_error());
    const int64_t cells = m * ac.groups;
    int64_t same = 0;
    for (int64_t c = 0; c < cells; c++) {
        const int eq = ac.scale[c] == ag.scale[c] &&
                       (spec->kind != BK_Q_UNIFORM || ac.zero[c] == ag.zero[c]);
        if (eq) {
            same++;
            continue;
        }
        /* a near-tie: both choices must be equally good for the CPU objective */
        const int64_t i = c / ac.groups, g = c % ac.groups, j0 = g * ac.group;
        const int64_t len = n - j0 < ac.group ? n - j0 : ac.group;
        const double *x = wd + i * n + j0;
        const double ec = cell_obj(&ac, x, len, ac.scale[c], ac.zero ? ac.zero[c] : 0.0f);
        const double eg = cell_obj(&ac, x, len, ag.scale[c], ag.zero ? ag.zero[c] : 0.0f);
        if (!(std::fabs(ec - eg) <= 1e-12 * std::fabs(ec)))
            fail_msg("cell (%lld, %lld): CPU scale %.9g (objective %.17g), device %.9g "
                     "(objective %.17g): not a tie",
                     (long long)i, (long long)g, ac.scale[c], ec, ag.scale[c], eg);
    }
    printf("kind %d levels %d bits %d asym %d mse %d group %lld, %lldx%lld%s: %lld/%lld cells "
           "identical\n",
           (int)spec->kind, spec->levels, spec->bits, spec->asym, spec->mse,
           (long long)spec->group, (long long)m, (long long)n, with_dead ? " (dead columns)" : "",
           (long long)same, (long long)cells);
    assert_true((double)same >= 0.999 * (double)cells);
    bk_alphabet_free(&ac);
    bk_alphabet_free(&ag);
    bk_dev_free(g_c, dw);
    bk_dev_free(g_c, ddead);
    assert_int_equal(g_c->mem_current, mem0);
    free(w);
    free(wd);
    free(dead);
}

static void test_levels(void **state)
{
    (void)state;
    for (int mse = 0; mse <= 1; mse++)
        for (int L = 3; L <= 7; L += 4) {
            bk_quant_spec s;
            memset(&s, 0, sizeof s);
            s.kind = BK_Q_LEVELS;
            s.levels = L;
            s.mse = mse;
            compare(&s, 300, 1000, 0);
        }
    bk_quant_spec s;
    memset(&s, 0, sizeof s);
    s.kind = BK_Q_LEVELS;
    s.levels = 3;
    s.mse = 1;
    compare(&s, 64, 4100, 1);
}

static void test_uniform(void **state)
{
    (void)state;
    const int bits[] = {2, 3, 4};
    const int64_t groups[] = {0, 64, 128};
    for (int b = 0; b < 3; b++)
        for (int asym = 0; asym <= 1; asym++)
            for (int g = 0; g < 3; g++) {
                bk_quant_spec s;
                memset(&s, 0, sizeof s);
                s.kind = BK_Q_UNIFORM;
                s.bits = bits[b];
                s.asym = asym;
                s.group = groups[g];
                s.mse = 1;
                compare(&s, 200, 1000, g == 1);
            }
    bk_quant_spec s;
    memset(&s, 0, sizeof s);
    s.kind = BK_Q_UNIFORM;
    s.bits = 4;
    s.group = 128;
    s.mse = 0;
    compare(&s, 100, 1000, 0);
}

/* Extreme values: +-FLT_MAX in a row (the widest F32 range: every scale still
 * fits F32, so no error) give the CPU's scales. */
static void test_extremes(void **state)
{
    (void)state;
    g_s = 777;
    bk_quant_spec s;
    memset(&s, 0, sizeof s);
    s.kind = BK_Q_UNIFORM;
    s.bits = 2;
    s.asym = 1;
    s.mse = 1;
    compare(&s, 8, 300, 0, 1);
    memset(&s, 0, sizeof s);
    s.kind = BK_Q_LEVELS;
    s.levels = 3;
    s.mse = 1;
    compare(&s, 8, 300, 0, 1);
}

int main(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        cudaGetLastError();
        fprintf(stderr, "no CUDA device: skipped\n");
        return 77;
    }
    if (bk_cuda_ctx_create(0, &g_c) != BK_OK) {
        fprintf(stderr, "cannot create the CUDA context: %s\n", bk_last_error());
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_levels),
        cmocka_unit_test(test_uniform),
        cmocka_unit_test(test_extremes),
    };
    const int rc = cmocka_run_group_tests_name("cuda_qfit", tests, NULL, NULL);
    bk_cuda_ctx_destroy(g_c);
    return rc;
}
