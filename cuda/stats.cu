/* CUDA backend — the statistics in double (cuBLAS), as src/solver.c's
 * losses(): E = Wq - W0, F = E A~, loss_one = sum E o F, and with B
 * G = B~ E, loss_two = sum G o F (= tr(E^T B~ E A~)). */
#include "cuda_internal.cuh"

namespace {

__global__ void k_sub(double *a, const double *b, int64_t count)
{
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < count)
        a[idx] -= b[idx];
}

} // namespace

bk_status bk_cuda_losses(bk_cuda_ctx *c, int64_t m, int64_t n, const double *dWq,
                         const double *dW0, const double *dAd, const double *dBd,
                         double *loss_one, double *loss_two)
{
    const int64_t mn = m * n;
    double *E = NULL, *F = NULL, *G = NULL;
    bk_status st = bk_dev_alloc(c, (void **)&E, sizeof(double) * (size_t)mn, "loss: E");
    if (st == BK_OK)
        st = bk_dev_alloc(c, (void **)&F, sizeof(double) * (size_t)mn, "loss: E A");
    if (st == BK_OK && dBd)
        st = bk_dev_alloc(c, (void **)&G, sizeof(double) * (size_t)mn, "loss: B E");
    if (st != BK_OK)
        goto done;
    BK_CUDA_GOTO(cudaMemcpyAsync(E, dWq, sizeof(double) * (size_t)mn, cudaMemcpyDeviceToDevice,
                                 c->stream),
                 st, done);
    k_sub<<<(unsigned)((mn + 255) / 256), 256, 0, c->stream>>>(E, dW0, mn);
    BK_CUDA_GOTO(cudaGetLastError(), st, done);
    st = bk_rm_gemm(c->cublas, 0, 0, m, n, n, 1.0, E, n, dAd, n, 0.0, F, n);
    if (st != BK_OK)
        goto done;
    BK_CUBLAS_GOTO(cublasDdot_64(c->cublas, mn, E, 1, F, 1, loss_one), st, done);
    if (dBd) {
        st = bk_rm_gemm(c->cublas, 0, 0, m, n, m, 1.0, dBd, m, E, n, 0.0, G, n);
        if (st != BK_OK)
            goto done;
        BK_CUBLAS_GOTO(cublasDdot_64(c->cublas, mn, G, 1, F, 1, loss_two), st, done);
    } else {
        *loss_two = *loss_one;
    }
    BK_CUDA_GOTO(cudaStreamSynchronize(c->stream), st, done);
done:
    bk_dev_free(c, G);
    bk_dev_free(c, F);
    bk_dev_free(c, E);
    return st;
}
