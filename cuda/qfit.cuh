/* CUDA backend — fitting an alphabet's scales (and zero points) on the device
 * (cuda/qfit.cu). */
#ifndef BK_QFIT_CUH
#define BK_QFIT_CUH

#include <cstdint>

#include "cuda_internal.cuh"

extern "C" {
#include "quant.h"
}

/* bk_alphabet_fit (src/quant.c) on the device: every (row, group) cell of
 * the device weights dW [m, n] (F32, row stride ldw) is fitted by one thread
 * block with the same rule, grid and double arithmetic (no contracted
 * multiply-adds), so each candidate's error terms are the CPU's; only the
 * order of the sums differs, which can flip a near-tie between two grid
 * points. dead (device [n] bytes, or NULL): columns that count as zero (the
 * solver's dead columns). a must come from bk_alphabet_init; its host scale
 * and zero arrays receive the result. A cell whose scale leaves the F32 range
 * is refitted on the host to produce the CPU's message (BK_ERR_INVALID_ARG
 * naming the row and group). */
bk_status bk_cuda_alphabet_fit(bk_cuda_ctx *c, bk_alphabet *a, const float *dW, int64_t ldw,
                               const unsigned char *dead);

#endif /* BK_QFIT_CUH */
