/* NCCL all-reduce of a device buffer (bk_dist_sum_dev), cuda suite: exits 77
 * without a GPU. One process (an MPI singleton) or under mpirun -np N with
 * one GPU per rank: every rank's buffer holds rank+1 (floats) and 0.5*(rank+1)
 * (doubles); after the sum each element must be N(N+1)/2 (exact in binary);
 * then a broadcast from the last rank, then a send/receive around the ring (one
 * rank: to itself, in one NCCL group). The NCCL communicator is set up even
 * for one rank, so the NCCL calls (set-up, all-reduce, broadcast, the waits)
 * run on a machine with one GPU. */
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime.h>

#include "bakron/dist.h"

int main(void)
{
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("skipped: no GPU\n");
        return 77;
    }
    bk_dist *d = NULL;
    if (bk_dist_init(60, &d) != BK_OK) {
        printf("skipped: MPI could not start (%s)\n", bk_last_error());
        return 77;
    }
    const int rank = bk_dist_rank(d), size = bk_dist_size(d);
    cudaSetDevice(rank % ndev);
    const size_t n = (size_t)1 << 20;
    float *hf = malloc(n * sizeof *hf), *df = NULL;
    double *hd = malloc(n * sizeof *hd), *dd = NULL;
    int fail = !hf || !hd;
    for (size_t i = 0; !fail && i < n; i++) {
        hf[i] = (float)(rank + 1);
        hd[i] = 0.5 * (rank + 1);
    }
    fail = fail || cudaMalloc((void **)&df, n * sizeof *df) != cudaSuccess ||
           cudaMalloc((void **)&dd, n * sizeof *dd) != cudaSuccess ||
           cudaMemcpy(df, hf, n * sizeof *df, cudaMemcpyHostToDevice) != cudaSuccess ||
           cudaMemcpy(dd, hd, n * sizeof *dd, cudaMemcpyHostToDevice) != cudaSuccess;
    /* the communicator even with one rank (the NCCL calls then run on one GPU) */
    bk_status st = fail ? BK_ERR_DEVICE : bk_dist_dev_init(d);
    if (st == BK_OK)
        st = bk_dist_sum_dev(d, df, n, 0, NULL);
    if (st == BK_OK)
        st = bk_dist_sum_dev(d, dd, n, 1, NULL);
    if (st != BK_OK) {
        printf("FAIL: rank %d: %s\n", rank, bk_last_error());
        fail = 1;
    } else {
        cudaMemcpy(hf, df, n * sizeof *hf, cudaMemcpyDeviceToHost);
        cudaMemcpy(hd, dd, n * sizeof *hd, cudaMemcpyDeviceToHost);
        const double want = size * (size + 1) / 2.0;
        for (size_t i = 0; i < n && !fail; i++)
            if (hf[i] != (float)want || hd[i] != 0.5 * want) {
                printf("FAIL: rank %d: element %zu = %g / %g, expected %g / %g\n", rank, i,
                       (double)hf[i], hd[i], want, 0.5 * want);
                fail = 1;
            }
        if (!fail)
            printf("ok: rank %d of %d: NCCL sum of %zu floats and doubles\n", rank, size, n);
    }
    /* broadcast from the last rank: every rank ends with its bytes (i + 7) */
    if (!fail) {
        const int root = size - 1;
        for (size_t i = 0; i < n; i++)
            hf[i] = rank == root ? (float)(i + 7) : -1.0f;
        st = cudaMemcpy(df, hf, n * sizeof *hf, cudaMemcpyHostToDevice) == cudaSuccess
                 ? bk_dist_bcast_dev(d, df, n * sizeof *df, root, NULL)
                 : BK_ERR_DEVICE;
        if (st != BK_OK) {
            printf("FAIL: rank %d: broadcast: %s\n", rank, bk_last_error());
            fail = 1;
        } else {
            cudaMemcpy(hf, df, n * sizeof *hf, cudaMemcpyDeviceToHost);
            for (size_t i = 0; i < n && !fail; i++)
                if (hf[i] != (float)(i + 7)) {
                    printf("FAIL: rank %d: broadcast element %zu = %g, expected %g\n", rank, i,
                           (double)hf[i], (double)(i + 7));
                    fail = 1;
                }
            if (!fail)
                printf("ok: rank %d of %d: NCCL broadcast of %zu floats from rank %d\n", rank,
                       size, n, root);
        }
    }
    /* send/receive around the ring (one rank: to and from itself), one
     * group per rank: rank r's bytes arrive at rank r+1 exactly */
    if (!fail) {
        const int to = (rank + 1) % size, from = (rank + size - 1) % size;
        float *rf = NULL;
        for (size_t i = 0; i < n; i++)
            hf[i] = (float)((i % 4096) + 4096 * (size_t)rank);
        st = cudaMalloc((void **)&rf, n * sizeof *rf) == cudaSuccess &&
                     cudaMemset(rf, 0, n * sizeof *rf) == cudaSuccess &&
                     cudaMemcpy(df, hf, n * sizeof *hf, cudaMemcpyHostToDevice) == cudaSuccess
                 ? bk_dist_sendrecv_dev(d, df, to, rf, from, n * sizeof *rf, NULL)
                 : BK_ERR_DEVICE;
        if (st != BK_OK) {
            printf("FAIL: rank %d: send/receive: %s\n", rank, bk_last_error());
            fail = 1;
        } else {
            cudaMemcpy(hf, rf, n * sizeof *hf, cudaMemcpyDeviceToHost);
            for (size_t i = 0; i < n && !fail; i++)
                if (hf[i] != (float)((i % 4096) + 4096 * (size_t)from)) {
                    printf("FAIL: rank %d: received element %zu = %g from rank %d\n", rank, i,
                           (double)hf[i], from);
                    fail = 1;
                }
            if (!fail)
                printf("ok: rank %d of %d: NCCL send to rank %d, receive from rank %d\n", rank,
                       size, to, from);
        }
        cudaFree(rf);
    }
    cudaFree(df);
    cudaFree(dd);
    free(hf);
    free(hd);
    bk_dist_finalize(d);
    return fail;
}
