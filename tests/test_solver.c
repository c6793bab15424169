/* The CPU solvers against the paper's definitions:
 *  - Theorem 3.2: naive, antidiag, recursive and bakron give identical codes
 *    in fp64 (many shapes, seeds, both quantizer families, several bakron
 *    tunings down to the paper's one-anti-diagonal leaves);
 *  - B = I: bakron and gptq give identical codes;
 *  - an independent brute force: Algorithm 1 on vec(W) with the explicit
 *    mn x mn Hessian A~ (x) B~ (plain-loop inverse and Cholesky) gives the
 *    same codes as every algorithm;
 *  - Corollary 3.4: loss <= bound (integer alphabet), the loss and the bound
 *    checked against brute-force formulas;
 *  - damping escalation, dead columns, precomputed factors, bad inputs.
 * The 256 x 256 cases live in test_solver_big.c (suite slow). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/solver.h"
#include "solver_impl.h"
#include "test_solver_util.h"

/* ------------------------------------------------------------------ setup */

typedef struct prob {
    int64_t m, n;
    double *W, *A, *B; /* B may be NULL */
} prob;

static prob make_prob(int64_t m, int64_t n, uint64_t seed, int with_b, double sigma)
{
    prob p = {m, n, NULL, NULL, NULL};
    p.W = test_weights(m, n, seed, sigma);
    p.A = test_spd(n, seed + 1000, 1e-3);
    if (with_b)
        p.B = test_spd(m, seed + 2000, 1e-3);
    return p;
}

static void free_prob(prob *p)
{
    free(p->W);
    free(p->A);
    free(p->B);
}

static bk_quant_spec q_levels(int mse)
{
    bk_quant_spec q = {0};
    q.kind = BK_Q_LEVELS;
    q.levels = 3;
    q.mse = mse;
    return q;
}

static bk_quant_spec q_uniform(int bits, int64_t group, int asym, int mse)
{
    bk_quant_spec q = {0};
    q.kind = BK_Q_UNIFORM;
    q.bits = bits;
    q.group = group;
    q.asym = asym;
    q.mse = mse;
    return q;
}

static bk_quant_spec q_integer(void)
{
    bk_quant_spec q = {0};
    q.kind = BK_Q_INTEGER;
    return q;
}

static bk_solve_problem problem_of(const prob *p)
{
    bk_solve_problem pr;
    memset(&pr, 0, sizeof pr);
    pr.m = p->m;
    pr.n = p->n;
    pr.dtype = BK_DT_F64;
    pr.W = p->W;
    pr.A = p->A;
    pr.B = p->B;
    return pr;
}

static bk_solve_result run(const prob *p, bk_algorithm alg, bk_precision prec,
                           bk_quant_spec q, int block)
{
    bk_solve_opts o;
    bk_solve_opts_default(&o);
    o.algorithm = alg;
    o.precision = prec;
    o.quant = q;
    if (block > 0)
        o.gptq_block = block;
    bk_solve_problem pr = problem_of(p);
    bk_solve_result r;
    bk_status st = bk_solve(&pr, &o, &r);
    if (st != BK_OK)
        fail_msg("solve %s [%lld x %lld]: %s", bk_algorithm_name(alg), (long long)p->m,
                 (long long)p->n, bk_last_error());
    return r;
}

static int64_t code_diff(const bk_solve_result *a, const bk_solve_result *b)
{
    int64_t d = 0;
    for (int64_t t = 0; t < a->m * a->n; t++)
        d += a->codes[t] != b->codes[t];
    return d;
}

static const int64_t shapes[][2] = {{1, 1},   {1, 17},  {19, 1},  {2, 2},  {7, 13},
                                    {13, 7},  {37, 101}, {64, 48}, {100, 37}, {3, 200},
                                    {128, 5}, {31, 31}};
#define NSHAPES (sizeof shapes / sizeof shapes[0])

/* ------------------------------------------------------------ Theorem 3.2 */

static void check_equivalence(bk_quant_spec q, int with_b, double sigma)
{
    const bk_algorithm algs[] = {BK_ALG_ANTIDIAG, BK_ALG_RECURSIVE, BK_ALG_BAKRON};
    for (size_t s = 0; s < NSHAPES; s++)
        for (uint64_t seed = 1; seed <= 3; seed++) {
            prob p = make_prob(shapes[s][0], shapes[s][1], seed, with_b, sigma);
            bk_solve_result ref = run(&p, BK_ALG_NAIVE, BK_PREC_FP64, q, 0);
            for (size_t a = 0; a < 3; a++) {
                bk_solve_result r = run(&p, algs[a], BK_PREC_FP64, q, 0);
                int64_t d = code_diff(&ref, &r);
                if (d)
                    fail_msg("%s vs naive [%lld x %lld] seed %llu: %lld codes differ",
                             bk_algorithm_name(algs[a]), (long long)p.m, (long long)p.n,
                             (unsigned long long)seed, (long long)d);
                bk_solve_result_free(&r);
            }
            bk_solve_result_free(&ref);
            free_prob(&p);
        }
}

/* Step 4 of docs/solver.md on its own: bk_factor_inverse returns the unit
 * lower L and the diagonal d with (L D)(L D)ᵀ = X⁻¹ (checked as
 * (L D)(L D)ᵀ X = I, the definition, not the algorithm), a zero upper
 * triangle, and step 1 for a matrix that is not positive definite. */
static void test_factor_inverse(void **state)
{
    (void)state;
    const int64_t sizes[] = {1, 2, 5, 37, 64};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        const int64_t n = sizes[si];
        double *X = test_spd(n, 77 + (uint64_t)n, 1e-2);
        double *Ld = malloc(sizeof(double) * (size_t)(n * n));
        float *Lf = malloc(sizeof(float) * (size_t)(n * n));
        double *dd = malloc(sizeof(double) * (size_t)n), *df = malloc(sizeof(double) * (size_t)n);
        for (int64_t t = 0; t < n * n; t++) {
            Ld[t] = X[t];
            Lf[t] = (float)X[t];
        }
        assert_int_equal(bk_factor_inverse_d(Ld, n, dd), 0);
        assert_int_equal(bk_factor_inverse_f(Lf, n, df), 0);
        for (int prec = 0; prec < 2; prec++) {
            /* U = L D; check max |U Uᵀ X - I| */
            double worst = 0.0;
            for (int64_t i = 0; i < n; i++) {
                for (int64_t j = 0; j < n; j++) {
                    const double lij = prec ? (double)Lf[i * n + j] : Ld[i * n + j];
                    if (j > i)
                        assert_true(lij == 0.0);
                    if (j == i)
                        assert_true(lij == 1.0);
                }
                assert_true((prec ? df : dd)[i] > 0.0);
            }
            for (int64_t i = 0; i < n; i++)
                for (int64_t j = 0; j < n; j++) {
                    double acc = 0.0; /* (U Uᵀ X)[i, j] = sum_k (U Uᵀ)[i, k] X[k, j] */
                    for (int64_t k = 0; k < n; k++) {
                        double uu = 0.0;
                        for (int64_t t = 0; t <= (i < k ? i : k); t++) {
                            const double ui = (prec ? (double)Lf[i * n + t] : Ld[i * n + t]) *
                                              (prec ? df : dd)[t];
                            const double uk = (prec ? (double)Lf[k * n + t] : Ld[k * n + t]) *
                                              (prec ? df : dd)[t];
                            uu += ui * uk;
                        }
                        acc += uu * X[k * n + j];
                    }
                    worst = fmax(worst, fabs(acc - (i == j ? 1.0 : 0.0)));
                }
            if (worst > (prec ? 2e-2 : 1e-9))
                fail_msg("n = %lld, %s: max |L Lᵀ X - I| = %g", (long long)n,
                         prec ? "fp32" : "fp64", worst);
        }
        /* not positive definite: a negative eigenvalue */
        for (int64_t t = 0; t < n * n; t++)
            Ld[t] = -X[t];
        assert_int_equal(bk_factor_inverse_d(Ld, n, dd), 1);
        free(X);
        free(Ld);
        free(Lf);
        free(dd);
        free(df);
    }
}

static void test_thm32_levels(void **state)
{
    (void)state;
    check_equivalence(q_levels(1), 1, 0.1);
}

static void test_thm32_uniform_groups(void **state)
{
    (void)state;
    check_equivalence(q_uniform(4, 16, 1, 0), 1, 0.1);
    check_equivalence(q_uniform(3, 0, 0, 1), 1, 0.1);
}

static void test_thm32_identity_b(void **state)
{
    (void)state;
    check_equivalence(q_levels(1), 0, 0.1);
}

/* The bakron recursion with other tunings, down to the paper's leaves of a
 * single anti-diagonal and row blocks of one row. */
static void test_thm32_bakron_tunings(void **state)
{
    (void)state;
    const bk_bakron_tuning saved = bk_bakron_tune;
    const bk_bakron_tuning tunings[] = {
        {1, 1, 1, 1, 1}, {1, 1, 256, 1, 0}, {2, 3, 7, 2, 3}, {5, 16, 64, 8, 16},
        {64, 16, 256, 4, 64}, {8, 16, 256, 4, 0}};
    for (size_t t = 0; t < sizeof tunings / sizeof tunings[0]; t++) {
        for (size_t s = 0; s < NSHAPES; s++) {
            for (int with_b = 0; with_b < 2; with_b++) {
                prob p = make_prob(shapes[s][0], shapes[s][1], 7 + s, with_b, 0.1);
                bk_bakron_tune = saved;
                bk_solve_result ref = run(&p, BK_ALG_NAIVE, BK_PREC_FP64, q_levels(1), 0);
                bk_bakron_tune = tunings[t];
                bk_solve_result r = run(&p, BK_ALG_BAKRON, BK_PREC_FP64, q_levels(1), 0);
                bk_bakron_tune = saved;
                int64_t d = code_diff(&ref, &r);
                if (d)
                    fail_msg("bakron tuning %zu [%lld x %lld] B=%d: %lld codes differ", t,
                             (long long)p.m, (long long)p.n, with_b, (long long)d);
                bk_solve_result_free(&r);
                bk_solve_result_free(&ref);
                free_prob(&p);
            }
        }
    }
}

/* B = I: bakron is GPTQ on every row. */
static void test_gptq_equals_bakron_identity(void **state)
{
    (void)state;
    const bk_quant_spec qs[] = {q_levels(1), q_uniform(4, 8, 1, 1), q_uniform(2, 0, 0, 0)};
    const int blocks[] = {128, 5, 1};
    for (size_t s = 0; s < NSHAPES; s++)
        for (size_t qi = 0; qi < 3; qi++) {
            prob p = make_prob(shapes[s][0], shapes[s][1], 40 + s, 0, 0.1);
            bk_solve_result ref = run(&p, BK_ALG_BAKRON, BK_PREC_FP64, qs[qi], 0);
            for (size_t b = 0; b < 3; b++) {
                bk_solve_result r = run(&p, BK_ALG_GPTQ, BK_PREC_FP64, qs[qi], blocks[b]);
                int64_t d = code_diff(&ref, &r);
                if (d)
                    fail_msg("gptq(block %d) vs bakron [%lld x %lld] q%zu: %lld codes differ",
                             blocks[b], (long long)p.m, (long long)p.n, qi, (long long)d);
                bk_solve_result_free(&r);
            }
            bk_solve_result_free(&ref);
            free_prob(&p);
        }
}

/* ------------------------------------------------------------ brute force */

/* The test's own rounding rules (scales from the original W, no MSE). */
typedef struct tq {
    int kind; /* 0 integer, 1 levels 3, 2 uniform 3-bit asym */
    double *s, *z;
} tq;

static tq tq_fit(int kind, const double *W, int64_t m, int64_t n)
{
    tq q = {kind, calloc((size_t)m, sizeof(double)), calloc((size_t)m, sizeof(double))};
    for (int64_t i = 0; i < m; i++) {
        double amax = 0, xmin = 0, xmax = 0;
        for (int64_t j = 0; j < n; j++) {
            amax = fmax(amax, fabs(W[i * n + j]));
            xmin = fmin(xmin, W[i * n + j]);
            xmax = fmax(xmax, W[i * n + j]);
        }
        if (kind == 1) {
            q.s[i] = (double)(float)(amax / 3.0);
        } else if (kind == 2) {
            q.s[i] = (double)(float)((xmax - xmin) / 7.0);
            q.z[i] = rint(-xmin / q.s[i]);
        }
    }
    return q;
}

static double tq_round(const tq *q, int64_t i, double x, int *code)
{
    if (q->kind == 0) {
        *code = (int)rint(x);
        return rint(x);
    }
    if (q->kind == 1) {
        double c = fmax(-3.0, fmin(3.0, rint(x / q->s[i])));
        *code = (int)c;
        return c * q->s[i];
    }
    double c = fmax(0.0, fmin(7.0, rint(x / q->s[i]) + q->z[i]));
    *code = (int)c;
    return q->s[i] * (c - q->z[i]);
}

static bk_quant_spec tq_spec(int kind)
{
    return kind == 0 ? q_integer() : kind == 1 ? q_levels(0) : q_uniform(3, 0, 1, 0);
}

/* Algorithm 1 on w = vec(W) (column-major) with H = A~ (x) B~:
 * H[(j,i), (j',i')] = A~[j, j'] B~[i, i']. */
static int *brute_force_codes(const prob *p, const tq *q)
{
    const int64_t m = p->m, n = p->n, N = m * n;
    double *At = test_damped(p->A, n, 0.5);
    double *Bt = NULL;
    if (p->B) {
        Bt = test_damped(p->B, m, 0.5);
    } else {
        Bt = calloc((size_t)(m * m), sizeof(double));
        for (int64_t i = 0; i < m; i++)
            Bt[i * m + i] = 1;
    }
    double *H = malloc(sizeof(double) * (size_t)(N * N));
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j2 = 0; j2 < n; j2++)
                for (int64_t i2 = 0; i2 < m; i2++)
                    H[(j * m + i) * N + (j2 * m + i2)] = At[j * n + j2] * Bt[i * m + i2];
    double *L = test_inverse(H, N);
    assert_int_equal(test_cholesky(L, N), 0);
    for (int64_t c = 0; c < N; c++) {
        const double d = L[c * N + c];
        for (int64_t r = c; r < N; r++)
            L[r * N + c] /= d;
    }
    double *w = malloc(sizeof(double) * (size_t)N);
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < m; i++)
            w[j * m + i] = p->W[i * n + j];
    int *codes = malloc(sizeof(int) * (size_t)N); /* row-major [m, n] */
    for (int64_t t = 0; t < N; t++) {
        const int64_t i = t % m, j = t / m;
        int code;
        const double v = tq_round(q, i, w[t], &code);
        codes[i * n + j] = code;
        const double d = v - w[t];
        for (int64_t u = t; u < N; u++)
            w[u] += d * L[u * N + t];
    }
    free(At);
    free(Bt);
    free(H);
    free(L);
    free(w);
    return codes;
}

static void test_brute_force(void **state)
{
    (void)state;
    const int64_t tiny[][2] = {{1, 1}, {1, 4}, {4, 1}, {2, 3}, {3, 2}, {4, 4}, {5, 3}, {3, 6}, {6, 7}};
    const bk_algorithm algs[] = {BK_ALG_NAIVE, BK_ALG_ANTIDIAG, BK_ALG_RECURSIVE, BK_ALG_BAKRON,
                                 BK_ALG_GPTQ};
    for (size_t s = 0; s < sizeof tiny / sizeof tiny[0]; s++)
        for (int kind = 0; kind < 3; kind++)
            for (int with_b = 0; with_b < 2; with_b++)
                for (uint64_t seed = 1; seed <= 2; seed++) {
                    prob p = make_prob(tiny[s][0], tiny[s][1], 100 * seed + s, with_b,
                                       kind == 0 ? 3.0 : 0.1);
                    tq q = tq_fit(kind, p.W, p.m, p.n);
                    int *want = brute_force_codes(&p, &q);
                    for (size_t a = 0; a < sizeof algs / sizeof algs[0]; a++) {
                        if (algs[a] == BK_ALG_GPTQ && with_b)
                            continue; /* GPTQ is the B = I case */
                        bk_solve_result r = run(&p, algs[a], BK_PREC_FP64, tq_spec(kind), 2);
                        for (int64_t t = 0; t < p.m * p.n; t++)
                            if (r.codes[t] != want[t])
                                fail_msg("%s [%lld x %lld] kind %d B=%d seed %llu: code %lld is "
                                         "%d, brute force %d",
                                         bk_algorithm_name(algs[a]), (long long)p.m,
                                         (long long)p.n, kind, with_b, (unsigned long long)seed,
                                         (long long)t, r.codes[t], want[t]);
                        bk_solve_result_free(&r);
                    }
                    free(want);
                    free(q.s);
                    free(q.z);
                    free_prob(&p);
                }
}

/* --------------------------------------------------------- Corollary 3.4 */

/* vec(E)^T (A~ (x) B~) vec(E) by the explicit Kronecker sum. */
static double brute_loss(const double *E, const double *At, const double *Bt, int64_t m, int64_t n)
{
    double s = 0;
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j2 = 0; j2 < n; j2++)
                for (int64_t i2 = 0; i2 < m; i2++)
                    s += E[i * n + j] * At[j * n + j2] * (Bt ? Bt[i * m + i2] : (i == i2)) *
                         E[i2 * n + j2];
    return s;
}

static void test_cor34_bound(void **state)
{
    (void)state;
    const bk_algorithm algs[] = {BK_ALG_NAIVE, BK_ALG_ANTIDIAG, BK_ALG_RECURSIVE, BK_ALG_BAKRON};
    for (size_t s = 0; s < NSHAPES; s++)
        for (int with_b = 0; with_b < 2; with_b++)
            for (uint64_t seed = 1; seed <= 2; seed++) {
                prob p = make_prob(shapes[s][0], shapes[s][1], 300 + seed, with_b, 3.0);
                const int64_t m = p.m, n = p.n;
                double *At = test_damped(p.A, n, 0.5);
                double *Bt = with_b ? test_damped(p.B, m, 0.5) : NULL;
                double *ra = malloc(sizeof(double) * (size_t)n);
                double *rb = malloc(sizeof(double) * (size_t)m);
                test_revchol_diag(At, n, ra);
                if (Bt)
                    test_revchol_diag(Bt, m, rb);
                else
                    for (int64_t i = 0; i < m; i++)
                        rb[i] = 1;
                double bound = 0;
                for (int64_t i = 0; i < m; i++)
                    for (int64_t j = 0; j < n; j++)
                        bound += 0.25 * rb[i] * rb[i] * ra[j] * ra[j];
                for (size_t a = 0; a < 4; a++) {
                    bk_solve_result r = run(&p, algs[a], BK_PREC_FP64, q_integer(), 0);
                    assert_int_equal(r.clamped, 0);
                    assert_true(fabs(r.bound - bound) <= 1e-9 * bound);
                    if (!(r.loss_two_sided <= r.bound))
                        fail_msg("%s [%lld x %lld]: loss %g > bound %g", bk_algorithm_name(algs[a]),
                                 (long long)m, (long long)n, r.loss_two_sided, r.bound);
                    assert_true(r.loss_two_sided > 0);
                    if (m * n <= 64 * 48) {
                        double *E = malloc(sizeof(double) * (size_t)(m * n));
                        for (int64_t t = 0; t < m * n; t++)
                            E[t] = (double)r.weight[t] - p.W[t];
                        if (m * n <= 600) {
                            double two = brute_loss(E, At, Bt, m, n);
                            double one = brute_loss(E, At, NULL, m, n);
                            assert_true(fabs(r.loss_two_sided - two) <= 1e-9 * two);
                            assert_true(fabs(r.loss_one_sided - one) <= 1e-9 * one);
                        }
                        free(E);
                    }
                    bk_solve_result_free(&r);
                }
                /* GPTQ: its own (one-sided) problem's bound */
                bk_solve_result g = run(&p, BK_ALG_GPTQ, BK_PREC_FP64, q_integer(), 0);
                assert_true(g.loss_one_sided <= g.bound);
                bk_solve_result_free(&g);
                free(At);
                free(Bt);
                free(ra);
                free(rb);
                free_prob(&p);
            }
}

static void test_proxy_loss(void **state)
{
    (void)state;
    const int64_t m = 5, n = 4;
    double *E = test_weights(m, n, 5, 1.0);
    double *A = test_spd(n, 6, 0.1);
    double *B = test_spd(m, 7, 0.1);
    float *Ef = test_to_f32(E, m * n), *Af = test_to_f32(A, n * n), *Bf = test_to_f32(B, m * m);
    for (int64_t t = 0; t < m * n; t++)
        E[t] = Ef[t];
    for (int64_t t = 0; t < n * n; t++)
        A[t] = Af[t];
    for (int64_t t = 0; t < m * m; t++)
        B[t] = Bf[t];
    double got, want = brute_loss(E, A, B, m, n);
    assert_int_equal(bk_proxy_loss(m, n, Ef, Af, Bf, &got), BK_OK);
    assert_true(fabs(got - want) <= 1e-10 * fabs(want));
    want = brute_loss(E, A, NULL, m, n);
    assert_int_equal(bk_proxy_loss(m, n, Ef, Af, NULL, &got), BK_OK);
    assert_true(fabs(got - want) <= 1e-10 * fabs(want));
    assert_int_equal(bk_proxy_loss(0, n, Ef, Af, NULL, &got), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_proxy_loss(m, n, NULL, Af, NULL, &got), BK_ERR_INVALID_ARG);
    free(E);
    free(A);
    free(B);
    free(Ef);
    free(Af);
    free(Bf);
}

/* -------------------------------------------------- GPTQ refit at groups */

/* Independent Algorithm 1 over all rows with a refit at every group start
 * from the current (updated) weights. */
static void test_gptq_refit(void **state)
{
    (void)state;
    const int64_t m = 6, n = 23, g = 4;
    prob p = make_prob(m, n, 77, 0, 0.1);
    double *At = test_damped(p.A, n, 0.5);
    double *L = test_inverse(At, n);
    assert_int_equal(test_cholesky(L, n), 0);
    for (int64_t c = 0; c < n; c++) {
        const double d = L[c * n + c];
        for (int64_t r = c; r < n; r++)
            L[r * n + c] /= d;
    }
    double *w = malloc(sizeof(double) * (size_t)(m * n));
    memcpy(w, p.W, sizeof(double) * (size_t)(m * n));
    int *want = malloc(sizeof(int) * (size_t)(m * n));
    float *ws = malloc(sizeof(float) * (size_t)(m * 6));
    float *wz = malloc(sizeof(float) * (size_t)(m * 6));
    double slice[8];
    for (int64_t j = 0; j < n; j++) {
        if (j % g == 0) {
            const int64_t len = n - j < g ? n - j : g;
            for (int64_t i = 0; i < m; i++) {
                for (int64_t t = 0; t < len; t++)
                    slice[t] = w[i * n + j + t];
                assert_int_equal(
                    bk_q_fit_uniform(slice, len, 3, 1, 1, &ws[i * 6 + j / g], &wz[i * 6 + j / g]),
                    BK_OK);
            }
        }
        for (int64_t i = 0; i < m; i++) {
            const double s = ws[i * 6 + j / g], z = wz[i * 6 + j / g];
            double c = fmax(0.0, fmin(7.0, rint(w[i * n + j] / s) + z));
            want[i * n + j] = (int)c;
            const double d = s * (c - z) - w[i * n + j];
            for (int64_t q = j; q < n; q++)
                w[i * n + q] += d * L[q * n + j];
        }
    }
    bk_quant_spec q = q_uniform(3, g, 1, 1);
    q.refit_groups = 1;
    const int blocks[] = {128, 3, 4, 1};
    for (int b = 0; b < 4; b++) {
        bk_solve_result r = run(&p, BK_ALG_GPTQ, BK_PREC_FP64, q, blocks[b]);
        assert_int_equal(r.groups, 6);
        for (int64_t t = 0; t < m * n; t++)
            if (r.codes[t] != want[t])
                fail_msg("gptq refit block %d: code %lld is %d, want %d", blocks[b], (long long)t,
                         r.codes[t], want[t]);
        for (int64_t t = 0; t < m * 6; t++) {
            assert_true(r.scales[t] == ws[t]);
            assert_true(r.zeros[t] == wz[t]);
        }
        bk_solve_result_free(&r);
    }
    /* refit is GPTQ-only */
    bk_solve_opts o;
    bk_solve_opts_default(&o);
    o.quant = q;
    bk_solve_problem pr = problem_of(&p);
    bk_solve_result r;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_INVALID_ARG);
    free(At);
    free(L);
    free(w);
    free(want);
    free(ws);
    free(wz);
    free_prob(&p);
}

/* ------------------------------------------------- precision and dtypes */

static void test_fp32_agreement(void **state)
{
    (void)state;
    prob p = make_prob(64, 48, 9, 1, 0.1);
    bk_solve_result ref = run(&p, BK_ALG_NAIVE, BK_PREC_FP64, q_levels(1), 0);
    const bk_algorithm algs[] = {BK_ALG_NAIVE, BK_ALG_ANTIDIAG, BK_ALG_RECURSIVE, BK_ALG_BAKRON};
    for (int a = 0; a < 4; a++) {
        bk_solve_result r = run(&p, algs[a], BK_PREC_FP32, q_levels(1), 0);
        assert_true(code_diff(&ref, &r) <= (64 * 48) / 100);
        assert_true(fabs(r.loss_two_sided - ref.loss_two_sided) <= 0.05 * ref.loss_two_sided);
        bk_solve_result_free(&r);
    }
    bk_solve_result_free(&ref);
    free_prob(&p);
}

/* F32 inputs give the same result as the same values passed as F64. */
static void test_f32_inputs(void **state)
{
    (void)state;
    prob p = make_prob(17, 29, 11, 1, 0.1);
    float *Wf = test_to_f32(p.W, 17 * 29), *Af = test_to_f32(p.A, 29 * 29),
          *Bf = test_to_f32(p.B, 17 * 17);
    for (int64_t t = 0; t < 17 * 29; t++)
        p.W[t] = Wf[t];
    for (int64_t t = 0; t < 29 * 29; t++)
        p.A[t] = Af[t];
    for (int64_t t = 0; t < 17 * 17; t++)
        p.B[t] = Bf[t];
    bk_solve_result a = run(&p, BK_ALG_BAKRON, BK_PREC_FP64, q_levels(1), 0);
    bk_solve_opts o;
    bk_solve_opts_default(&o);
    o.precision = BK_PREC_FP64;
    bk_solve_problem pr = problem_of(&p);
    pr.dtype = BK_DT_F32;
    pr.W = Wf;
    pr.A = Af;
    pr.B = Bf;
    bk_solve_result b;
    assert_int_equal(bk_solve(&pr, &o, &b), BK_OK);
    assert_int_equal(code_diff(&a, &b), 0);
    assert_true(a.loss_two_sided == b.loss_two_sided);
    bk_solve_result_free(&a);
    bk_solve_result_free(&b);
    pr.dtype = BK_DT_F16;
    assert_int_equal(bk_solve(&pr, &o, &b), BK_ERR_DTYPE);
    free(Wf);
    free(Af);
    free(Bf);
    free_prob(&p);
}

/* ---------------------------------------------------- precomputed factors */

static double *test_factor_of(const double *X, int64_t n)
{
    double *At = test_damped(X, n, 0.5);
    double *L = test_inverse(At, n);
    assert_int_equal(test_cholesky(L, n), 0);
    free(At);
    return L;
}

static void test_precomputed_factors(void **state)
{
    (void)state;
    prob p = make_prob(23, 31, 21, 1, 0.1);
    bk_solve_result a = run(&p, BK_ALG_BAKRON, BK_PREC_FP64, q_levels(1), 0);
    double *LA = test_factor_of(p.A, 31), *LB = test_factor_of(p.B, 23);
    bk_solve_opts o;
    bk_solve_opts_default(&o);
    o.precision = BK_PREC_FP64;
    bk_solve_problem pr = problem_of(&p);
    pr.A = NULL;
    pr.B = NULL;
    pr.LA = LA;
    pr.LB = LB;
    bk_solve_result b;
    assert_int_equal(bk_solve(&pr, &o, &b), BK_OK);
    assert_int_equal(code_diff(&a, &b), 0);
    assert_true(b.damp_a == 0 && b.damp_b == 0);
    assert_true(fabs(a.loss_two_sided - b.loss_two_sided) <= 1e-9 * a.loss_two_sided);
    assert_true(fabs(a.loss_one_sided - b.loss_one_sided) <= 1e-9 * a.loss_one_sided);
    assert_true(fabs(a.bound - b.bound) <= 1e-9 * a.bound);
    bk_solve_result_free(&b);
    /* not lower triangular / non-positive diagonal */
    LA[1] = 0.5;
    assert_int_equal(bk_solve(&pr, &o, &b), BK_ERR_INVALID_ARG);
    assert_non_null(strstr(bk_last_error(), "LA"));
    LA[1] = 0;
    LA[0] = -LA[0];
    assert_int_equal(bk_solve(&pr, &o, &b), BK_ERR_INVALID_ARG);
    LA[0] = -LA[0];
    /* both A and LA */
    pr.A = p.A;
    assert_int_equal(bk_solve(&pr, &o, &b), BK_ERR_INVALID_ARG);
    assert_null(b.codes);
    bk_solve_result_free(&a);
    free(LA);
    free(LB);
    free_prob(&p);
}

/* --------------------------------------------------- damping, dead, errors */

static bk_status solve3(const double *W, int64_t m, int64_t n, const double *A, const double *B,
                        double damp, int retries, bk_solve_result *r)
{
    bk_solve_opts o;
    bk_solve_opts_default(&o);
    o.precision = BK_PREC_FP64;
    o.damp = damp;
    o.max_damp_retries = retries;
    bk_solve_problem pr;
    memset(&pr, 0, sizeof pr);
    pr.m = m;
    pr.n = n;
    pr.dtype = BK_DT_F64;
    pr.W = W;
    pr.A = A;
    pr.B = B;
    pr.label_w = "layer.w";
    return bk_solve(&pr, &o, r);
}

static void test_damping_escalation(void **state)
{
    (void)state;
    const double W[6] = {0.1, -0.2, 0.3, 0.05, 0.4, -0.1};
    const double A[9] = {1, 2, 3, 2, 4, 6, 3, 6, 9}; /* rank 1: Cholesky fails without damping */
    bk_solve_result r;
    assert_int_equal(solve3(W, 2, 3, A, NULL, 0.0, 5, &r), BK_OK);
    assert_true(r.damp_a == 1e-2);
    assert_int_equal(r.damp_retries, 1);
    assert_true(r.damp_b == 0);
    bk_solve_result_free(&r);
    assert_int_equal(solve3(W, 2, 3, A, NULL, 0.5, 5, &r), BK_OK);
    assert_true(r.damp_a == 0.5);
    assert_int_equal(r.damp_retries, 0);
    bk_solve_result_free(&r);
    assert_int_equal(solve3(W, 2, 3, A, NULL, 0.0, 0, &r), BK_ERR_NOT_PD);
    assert_non_null(strstr(bk_last_error(), "A: not positive definite"));
    assert_null(r.codes);
    /* indefinite: needs relative damping > 9 (1 + 10 delta > 10 - ...) */
    const double I2[4] = {1, 10, 10, 1};
    const double W2[4] = {0.1, 0.2, 0.3, 0.4};
    assert_int_equal(solve3(W2, 2, 2, I2, NULL, 0.5, 1, &r), BK_ERR_NOT_PD);
    assert_non_null(strstr(bk_last_error(), "damping 5"));
    assert_int_equal(solve3(W2, 2, 2, I2, NULL, 0.5, 2, &r), BK_OK);
    assert_true(r.damp_a == 50);
    assert_int_equal(r.damp_retries, 2);
    bk_solve_result_free(&r);
    /* a negative diagonal is not PSD */
    const double N2[4] = {1, 0, 0, -1};
    assert_int_equal(solve3(W2, 2, 2, N2, NULL, 0.5, 5, &r), BK_ERR_NOT_PD);
    /* B escalates on its own */
    const double A2[4] = {2, 0, 0, 2}, B1[4] = {1, 1, 1, 1};
    assert_int_equal(solve3(W2, 2, 2, A2, B1, 0.0, 5, &r), BK_OK);
    assert_true(r.damp_a == 0 && r.damp_b == 1e-2);
    assert_int_equal(r.damp_retries, 1);
    bk_solve_result_free(&r);
    assert_int_equal(solve3(W2, 2, 2, A2, B1, 0.0, 0, &r), BK_ERR_NOT_PD);
    assert_non_null(strstr(bk_last_error(), "B: not positive definite"));
}

static void test_dead_columns(void **state)
{
    (void)state;
    const int64_t m = 9, n = 12;
    prob p = make_prob(m, n, 55, 1, 0.1);
    for (int64_t t = 0; t < n; t++) {
        p.A[3 * n + t] = p.A[t * n + 3] = 0;
        p.A[8 * n + t] = p.A[t * n + 8] = 0;
    }
    for (int64_t t = 0; t < m; t++)
        p.B[2 * m + t] = p.B[t * m + 2] = 0; /* an output without weight */
    const bk_algorithm algs[] = {BK_ALG_BAKRON, BK_ALG_NAIVE, BK_ALG_GPTQ};
    for (int a = 0; a < 3; a++) {
        bk_solve_result r = run(&p, algs[a], BK_PREC_FP64, q_levels(1), 0);
        assert_int_equal(r.dead_columns, 2);
        for (int64_t i = 0; i < m; i++) {
            assert_int_equal(r.codes[i * n + 3], 0);
            assert_true(r.weight[i * n + 8] == 0.0f);
        }
        bk_solve_result_free(&r);
    }
    /* integer alphabet: still within the bound of the problem solved */
    bk_solve_result r = run(&p, BK_ALG_BAKRON, BK_PREC_FP64, q_integer(), 0);
    assert_true(r.loss_two_sided <= r.bound);
    bk_solve_result_free(&r);
    free_prob(&p);
}

static void test_bad_inputs(void **state)
{
    (void)state;
    prob p = make_prob(4, 5, 3, 1, 0.1);
    bk_solve_opts o;
    bk_solve_opts_default(&o);
    bk_solve_problem pr = problem_of(&p);
    pr.label_w = "mlp.up";
    pr.label_a = "mlp.up:A";
    pr.label_b = "mlp.up:B";
    bk_solve_result r;
    p.W[1 * 5 + 2] = NAN;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_NONFINITE);
    assert_non_null(strstr(bk_last_error(), "mlp.up"));
    assert_non_null(strstr(bk_last_error(), "[1, 2]"));
    assert_null(r.codes);
    p.W[1 * 5 + 2] = 0.1;
    p.A[7] = INFINITY;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_NONFINITE);
    assert_non_null(strstr(bk_last_error(), "mlp.up:A"));
    p.A[7] = p.A[2 * 5 + 1];
    p.B[0] = NAN;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_NONFINITE);
    assert_non_null(strstr(bk_last_error(), "mlp.up:B"));
    p.B[0] = 1;
    /* asymmetric B */
    double keep = p.B[1];
    p.B[1] += 1.0;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_INVALID_ARG);
    assert_non_null(strstr(bk_last_error(), "symmetric"));
    p.B[1] = keep;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_OK);
    bk_solve_result_free(&r);
    /* empty */
    pr.m = 0;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_INVALID_ARG);
    pr.m = 4;
    pr.n = 0;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_INVALID_ARG);
    pr.n = -3;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_INVALID_ARG);
    pr.n = 5;
    /* missing A, bad options */
    pr.A = NULL;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_INVALID_ARG);
    pr.A = p.A;
    o.quant.levels = 0;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_INVALID_ARG);
    o.quant = q_uniform(5, 0, 0, 0);
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_INVALID_ARG);
    o.quant = q_levels(1);
    o.damp = -1;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_INVALID_ARG);
    o.damp = NAN;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_INVALID_ARG);
    o.damp = 0.5;
    o.algorithm = BK_ALG_COUNT;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_INVALID_ARG);
    o.algorithm = BK_ALG_BAKRON;
    o.gptq_block = 0;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_solve(NULL, &o, &r), BK_ERR_INVALID_ARG);
    /* integer codes that do not fit int16 */
    o.gptq_block = 128;
    o.quant = q_integer();
    p.W[0] = 1e6;
    assert_int_equal(bk_solve(&pr, &o, &r), BK_ERR_INVALID_ARG);
    assert_non_null(strstr(bk_last_error(), "int16"));
    free_prob(&p);
}

static void test_rtn_and_names(void **state)
{
    (void)state;
    prob p = make_prob(5, 9, 8, 1, 0.1);
    bk_solve_result r = run(&p, BK_ALG_RTN, BK_PREC_FP64, q_levels(0), 0);
    for (int64_t i = 0; i < 5; i++) {
        double amax = 0;
        for (int64_t j = 0; j < 9; j++)
            amax = fmax(amax, fabs(p.W[i * 9 + j]));
        const double s = (float)(amax / 3);
        assert_true(r.scales[i] == (float)s);
        for (int64_t j = 0; j < 9; j++)
            assert_int_equal(r.codes[i * 9 + j], (int)fmax(-3, fmin(3, rint(p.W[i * 9 + j] / s))));
    }
    assert_true(isnan(r.bound));
    assert_true(r.loss_two_sided > 0);
    assert_null(r.zeros);
    bk_solve_result_free(&r);
    for (int a = 0; a < BK_ALG_COUNT; a++) {
        bk_algorithm back;
        assert_int_equal(bk_algorithm_from_name(bk_algorithm_name((bk_algorithm)a), &back), BK_OK);
        assert_int_equal((int)back, a);
    }
    bk_algorithm x;
    assert_int_equal(bk_algorithm_from_name("fast", &x), BK_ERR_INVALID_ARG);
    assert_string_equal(bk_algorithm_name(BK_ALG_COUNT), "?");
    /* stats off: NaN */
    bk_solve_opts o;
    bk_solve_opts_default(&o);
    o.compute_stats = 0;
    bk_solve_problem pr = problem_of(&p);
    assert_int_equal(bk_solve(&pr, &o, &r), BK_OK);
    assert_true(isnan(r.loss_two_sided) && isnan(r.bound));
    bk_solve_result_free(&r);
    free_prob(&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_factor_inverse),
        cmocka_unit_test(test_thm32_levels),
        cmocka_unit_test(test_thm32_uniform_groups),
        cmocka_unit_test(test_thm32_identity_b),
        cmocka_unit_test(test_thm32_bakron_tunings),
        cmocka_unit_test(test_gptq_equals_bakron_identity),
        cmocka_unit_test(test_brute_force),
        cmocka_unit_test(test_cor34_bound),
        cmocka_unit_test(test_proxy_loss),
        cmocka_unit_test(test_gptq_refit),
        cmocka_unit_test(test_fp32_agreement),
        cmocka_unit_test(test_f32_inputs),
        cmocka_unit_test(test_precomputed_factors),
        cmocka_unit_test(test_damping_escalation),
        cmocka_unit_test(test_dead_columns),
        cmocka_unit_test(test_bad_inputs),
        cmocka_unit_test(test_rtn_and_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
