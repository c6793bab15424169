/* The elementwise kernels of the factor step (cuda/factor.cu), shared with the
 * dev harness (cuda/dev/factor_dev.cu) so that both run the same code.
 * Internal linkage: each including file gets its own instances. */
#pragma once

#include <cstdint>

namespace {

/* X = J (Xd + add I) J on the leading k x k block, J the reversal:
 * X[i][j] = (R)Xd[k-1-i][k-1-j] off the diagonal, (R)(Xd[..][..] + add) on it
 * (the CPU's rounding order), zero in the padding. */
template <typename R>
__global__ void k_fill_rev(R *X, int64_t ld, const double *Xd, int64_t k, int64_t kpad,
                           double add)
{
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= kpad * kpad)
        return;
    const int64_t i = idx / kpad, j = idx % kpad;
    R v = R(0);
    if (i < k && j < k) {
        const double x = Xd[(k - 1 - i) * k + (k - 1 - j)];
        v = i == j ? (R)(x + add) : (R)x;
    }
    X[i * ld + j] = v;
}

/* The row-major lower triangle becomes its anti-transpose (X[i][j] <->
 * X[k-1-j][k-1-i]: R^-1 -> J R^-T J), the upper triangle zero. */
template <typename R> __global__ void k_antitranspose(R *X, int64_t ld, int64_t k)
{
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= k * k)
        return;
    const int64_t i = idx / k, j = idx % k;
    if (j > i) {
        X[i * ld + j] = R(0);
        return;
    }
    const int64_t pi = k - 1 - j, pj = k - 1 - i;
    if (i * ld + j < pi * ld + pj) {
        const R v = X[i * ld + j];
        X[i * ld + j] = X[pi * ld + pj];
        X[pi * ld + pj] = v;
    }
}

template <typename R> __global__ void k_get_diag(const R *X, int64_t ld, int64_t k, R *d)
{
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < k)
        d[j] = X[j * ld + j];
}

/* row-major: below the diagonal X[i][j] /= d[j], above 0, diagonal 1 */
template <typename R> __global__ void k_normalize(R *X, int64_t ld, int64_t k, const R *d)
{
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= k * k)
        return;
    const int64_t i = idx / k, j = idx % k;
    R *x = &X[i * ld + j];
    if (j < i)
        *x = *x / d[j];
    else if (j > i)
        *x = R(0);
    else
        *x = R(1);
}

} // namespace
