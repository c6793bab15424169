/* The fp32 accuracy of the two ways of computing the Cholesky factor of the
 * inverse of a damped Gram matrix (docs/solver.md step 4), against fp64:
 *   old: potrf -> potri -> potrf (the paper's / GPTQ's recipe, bakron until
 *        commit 749a817),
 *   new: potrf of the reversed matrix -> trtri -> anti-transpose (bakron since).
 * The matrix is A = XᵀX/N + damp·mean(diag)·I from random activations X [N, n]
 * with nbig "massive activation" columns scaled by big and a shared component.
 * Prints the relative Frobenius error of the normalized off-diagonal entries
 * and the largest relative error of the diagonal, for both.
 *
 *   gcc -O2 scripts/factor_accuracy.c -o /tmp/factor_accuracy -llapacke -lopenblas -lm
 *   /tmp/factor_accuracy n N big nbig damp      e.g. 576 4096 3000 2 0.5
 */
#include <lapacke.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double randn(void)
{
    const double u = (rand() + 1.0) / (RAND_MAX + 2.0), v = (rand() + 1.0) / (RAND_MAX + 2.0);
    return sqrt(-2 * log(u)) * cos(6.283185307179586 * v);
}

/* In place on the row-major full matrix X (lower = column-major upper);
 * 0 on success, else the failed step. */
static int factor_old(float *X, int n)
{
    if (LAPACKE_spotrf(LAPACK_COL_MAJOR, 'U', n, X, n))
        return 1;
    if (LAPACKE_spotri(LAPACK_COL_MAJOR, 'U', n, X, n))
        return 2;
    if (LAPACKE_spotrf(LAPACK_COL_MAJOR, 'U', n, X, n))
        return 3;
    return 0;
}

static int factor_new(float *X, int n)
{
    const size_t nn = (size_t)n * n;
    for (size_t t = 0; t < nn / 2; t++) {
        const float v = X[t];
        X[t] = X[nn - 1 - t];
        X[nn - 1 - t] = v;
    }
    if (LAPACKE_spotrf(LAPACK_COL_MAJOR, 'U', n, X, n))
        return 1;
    if (LAPACKE_strtri(LAPACK_COL_MAJOR, 'U', 'N', n, X, n))
        return 2;
    for (int i = 0; i < n; i++)
        for (int j = 0; j <= i; j++) {
            const size_t a = (size_t)i * n + j, b = (size_t)(n - 1 - j) * n + (n - 1 - i);
            if (a < b) {
                const float v = X[a];
                X[a] = X[b];
                X[b] = v;
            }
        }
    return 0;
}

static int factor_ref(double *X, int n)
{
    if (LAPACKE_dpotrf(LAPACK_COL_MAJOR, 'U', n, X, n))
        return 1;
    if (LAPACKE_dpotri(LAPACK_COL_MAJOR, 'U', n, X, n))
        return 2;
    if (LAPACKE_dpotrf(LAPACK_COL_MAJOR, 'U', n, X, n))
        return 3;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: %s n N big nbig damp\n", argv[0]);
        return 2;
    }
    const int n = atoi(argv[1]), N = atoi(argv[2]), nbig = atoi(argv[4]);
    const double big = atof(argv[3]), damp = atof(argv[5]);
    const size_t nn = (size_t)n * n;
    srand(1);
    double *X = malloc(sizeof(double) * (size_t)N * n), *A = calloc(nn, sizeof(double));
    double *R = malloc(sizeof(double) * nn);
    float *O = malloc(sizeof(float) * nn), *W = malloc(sizeof(float) * nn);
    if (!X || !A || !R || !O || !W)
        return 1;
    for (int r = 0; r < N; r++) {
        const double shared = randn();
        for (int j = 0; j < n; j++) {
            const double s = j < nbig ? big : 1.0;
            X[(size_t)r * n + j] = randn() * s * (1 + 0.5 * sin(j)) + 0.8 * shared * s;
        }
    }
    for (int r = 0; r < N; r++)
        for (int i = 0; i < n; i++) {
            const double xi = X[(size_t)r * n + i];
            for (int j = 0; j <= i; j++)
                A[(size_t)i * n + j] += xi * X[(size_t)r * n + j];
        }
    double mean = 0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j <= i; j++) {
            A[(size_t)i * n + j] /= N;
            A[(size_t)j * n + i] = A[(size_t)i * n + j];
        }
    for (int i = 0; i < n; i++)
        mean += A[(size_t)i * n + i];
    mean /= n;
    for (int i = 0; i < n; i++)
        A[(size_t)i * n + i] += damp * mean;
    memcpy(R, A, sizeof(double) * nn);
    for (size_t t = 0; t < nn; t++)
        O[t] = W[t] = (float)A[t];
    const int ro = factor_old(O, n), rw = factor_new(W, n), rr = factor_ref(R, n);
    if (ro || rw || rr) {
        printf("failed steps: old %d new %d fp64 %d\n", ro, rw, rr);
        return 1;
    }
    double eo = 0, ew = 0, norm = 0, eod = 0, ewd = 0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j <= i; j++) {
            const size_t a = (size_t)i * n + j, d = (size_t)j * n + j;
            if (i == j) {
                eod = fmax(eod, fabs(O[a] - R[a]) / R[a]);
                ewd = fmax(ewd, fabs(W[a] - R[a]) / R[a]);
            } else {
                const double r = R[a] / R[d];
                const double o = (double)O[a] / O[d], w = (double)W[a] / W[d];
                eo += (o - r) * (o - r);
                ew += (w - r) * (w - r);
                norm += r * r;
            }
        }
    printf("n %d N %d big %g nbig %d damp %g: off-diagonal relative Frobenius error old %.3e "
           "new %.3e; diagonal max relative error old %.3e new %.3e\n",
           n, N, big, nbig, damp, sqrt(eo / norm), sqrt(ew / norm), eod, ewd);
    free(X);
    free(A);
    free(R);
    free(O);
    free(W);
    return 0;
}
