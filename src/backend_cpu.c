/* The CPU backend: the exact reference (BLAS/LAPACK). */
#include <stdio.h>
#include <stdlib.h>

#include <cblas.h>

#include "backend_impl.h"
#include "bakron/solver.h"

static bk_status cpu_solve(void *ctx, const bk_solve_problem *p, const bk_solve_opts *o,
                           bk_solve_result *r)
{
    (void)ctx;
    return bk_solve(p, o, r);
}

static void cpu_destroy(void *ctx)
{
    (void)ctx;
}

static const bk_backend_ops cpu_ops = {
    .name = "cpu",
    .solve = cpu_solve,
    .peak_memory = NULL,
    .reset_peak_memory = NULL,
    .destroy = cpu_destroy,
};

bk_status bk_cpu_backend_init(bk_backend *b)
{
    b->ops = &cpu_ops;
    b->ctx = NULL;
    snprintf(b->device, sizeof b->device, "CPU (OpenBLAS %s, %d threads)",
             openblas_get_config(), openblas_get_num_threads());
    return BK_OK;
}
