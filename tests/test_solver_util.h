/* Helpers shared by the solver tests: random problems and independent
 * (plain-loop) linear algebra. Nothing here calls the code under test. */
#ifndef BK_TEST_SOLVER_UTIL_H
#define BK_TEST_SOLVER_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* splitmix64 + Box-Muller: the tests' own generator. */
typedef struct trng {
    uint64_t s;
    int have;
    double spare;
} trng;

static inline uint64_t trng_next(trng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline double trng_unif(trng *r)
{
    return (double)(trng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

static inline double trng_normal(trng *r)
{
    if (r->have) {
        r->have = 0;
        return r->spare;
    }
    double u, v, s;
    do {
        u = 2.0 * trng_unif(r) - 1.0;
        v = 2.0 * trng_unif(r) - 1.0;
        s = u * u + v * v;
    } while (s >= 1.0 || s == 0.0);
    double f = sqrt(-2.0 * log(s) / s);
    r->spare = v * f;
    r->have = 1;
    return u * f;
}

/* Random SPD [n, n]: X X^T / k + ridge I, X [n, k] with neighbouring rows
 * correlated (x_i = g_i + rho g_{i-1}) and varying row scales. */
static inline double *test_spd(int64_t n, uint64_t seed, double ridge)
{
    trng r = {seed * 7919u + 17u, 0, 0};
    const int64_t k = n + 16;
    double *G = malloc(sizeof(double) * (size_t)(n * k));
    double *X = malloc(sizeof(double) * (size_t)(n * k));
    double *A = malloc(sizeof(double) * (size_t)(n * n));
    for (int64_t t = 0; t < n * k; t++)
        G[t] = trng_normal(&r);
    for (int64_t i = 0; i < n; i++) {
        double sc = 0.5 + trng_unif(&r);
        for (int64_t t = 0; t < k; t++)
            X[i * k + t] = sc * (G[i * k + t] + (i > 0 ? 0.6 * G[(i - 1) * k + t] : 0.0));
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j <= i; j++) {
            double s = 0;
            for (int64_t t = 0; t < k; t++)
                s += X[i * k + t] * X[j * k + t];
            A[i * n + j] = A[j * n + i] = s / (double)k + (i == j ? ridge : 0.0);
        }
    free(G);
    free(X);
    return A;
}

static inline double *test_weights(int64_t m, int64_t n, uint64_t seed, double sigma)
{
    trng r = {seed * 104729u + 3u, 0, 0};
    double *W = malloc(sizeof(double) * (size_t)(m * n));
    for (int64_t t = 0; t < m * n; t++)
        W[t] = sigma * trng_normal(&r);
    return W;
}

/* X + delta * mean(diag X) * I (a fresh copy). */
static inline double *test_damped(const double *X, int64_t n, double delta)
{
    double *D = malloc(sizeof(double) * (size_t)(n * n));
    double mean = 0;
    for (int64_t j = 0; j < n; j++)
        mean += X[j * n + j];
    mean /= (double)n;
    memcpy(D, X, sizeof(double) * (size_t)(n * n));
    for (int64_t j = 0; j < n; j++)
        D[j * n + j] += delta * mean;
    return D;
}

/* In place lower Cholesky (upper part zeroed). Returns 0 on success. */
static inline int test_cholesky(double *X, int64_t n)
{
    for (int64_t j = 0; j < n; j++) {
        double d = X[j * n + j];
        for (int64_t t = 0; t < j; t++)
            d -= X[j * n + t] * X[j * n + t];
        if (!(d > 0))
            return -1;
        d = sqrt(d);
        X[j * n + j] = d;
        for (int64_t i = j + 1; i < n; i++) {
            double s = X[i * n + j];
            for (int64_t t = 0; t < j; t++)
                s -= X[i * n + t] * X[j * n + t];
            X[i * n + j] = s / d;
        }
        for (int64_t t = j + 1; t < n; t++)
            X[j * n + t] = 0;
    }
    return 0;
}

/* Inverse of an SPD matrix by Gauss-Jordan elimination (a fresh copy). */
static inline double *test_inverse(const double *X, int64_t n)
{
    double *a = malloc(sizeof(double) * (size_t)(n * n));
    double *inv = malloc(sizeof(double) * (size_t)(n * n));
    memcpy(a, X, sizeof(double) * (size_t)(n * n));
    for (int64_t i = 0; i < n * n; i++)
        inv[i] = 0;
    for (int64_t i = 0; i < n; i++)
        inv[i * n + i] = 1;
    for (int64_t c = 0; c < n; c++) {
        int64_t piv = c;
        for (int64_t r = c + 1; r < n; r++)
            if (fabs(a[r * n + c]) > fabs(a[piv * n + c]))
                piv = r;
        if (piv != c)
            for (int64_t t = 0; t < n; t++) {
                double x = a[c * n + t];
                a[c * n + t] = a[piv * n + t];
                a[piv * n + t] = x;
                x = inv[c * n + t];
                inv[c * n + t] = inv[piv * n + t];
                inv[piv * n + t] = x;
            }
        double p = a[c * n + c];
        for (int64_t t = 0; t < n; t++) {
            a[c * n + t] /= p;
            inv[c * n + t] /= p;
        }
        for (int64_t r = 0; r < n; r++) {
            if (r == c)
                continue;
            double f = a[r * n + c];
            if (f == 0)
                continue;
            for (int64_t t = 0; t < n; t++) {
                a[r * n + t] -= f * a[c * n + t];
                inv[r * n + t] -= f * inv[c * n + t];
            }
        }
    }
    free(a);
    return inv;
}

/* Diagonal of RevCholesky(X) (lower R with R^T R = X): with J the reversal,
 * J X J = C C^T (C lower Cholesky) gives R = J C^T J, so R_jj = C_{n-1-j}. */
static inline void test_revchol_diag(const double *X, int64_t n, double *out)
{
    double *Y = malloc(sizeof(double) * (size_t)(n * n));
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n; j++)
            Y[i * n + j] = X[(n - 1 - i) * n + (n - 1 - j)];
    test_cholesky(Y, n);
    for (int64_t j = 0; j < n; j++)
        out[j] = Y[(n - 1 - j) * n + (n - 1 - j)];
    free(Y);
}

static inline float *test_to_f32(const double *x, int64_t count)
{
    float *f = malloc(sizeof(float) * (size_t)count);
    for (int64_t t = 0; t < count; t++)
        f[t] = (float)x[t];
    return f;
}

#endif
