/* CUDA backend — internal interfaces shared by the .cu files of cuda/ (not
 * public API).
 *
 * Layout conventions on the device: every matrix is row-major with an
 * explicit leading dimension; the solver workspaces are padded to a multiple
 * of BK_CUDA_PAD in both dimensions and the padding is zero. L_A / L_B are the
 * normalized (unit-diagonal) lower Cholesky factors of the damped inverses,
 * with a zero strict upper triangle.
 */
#ifndef BK_CUDA_INTERNAL_CUH
#define BK_CUDA_INTERNAL_CUH

#include <cstddef>
#include <cstdint>

#include "common.cuh"
#include "backend_impl.h"
#include "bakron/solver.h"

#define BK_CUDA_PAD 128

/* ------------------------------------------------------------ the context */

typedef struct bk_cuda_ctx {
    int device;
    cublasHandle_t cublas;
    cusolverDnHandle_t cusolver;
    cudaStream_t stream;
    cudaEvent_t ev_start, ev_stop; /* the algorithms record these around their core */
    cudaStream_t side;    /* BaKron: a low-priority stream for the overlapped pushes */
    cudaEvent_t ev_main_ready, ev_side_done; /* its ordering with `stream` */
    /* BaKron's variant selectors: bk_cuda_tuning (src/backend_impl.h) */
    int overlap;          /* overlap the far pushes with the solves (default 1) */
    size_t mem_current;   /* bytes held through bk_dev_alloc */
    size_t mem_peak;      /* high-water mark of mem_current (plus library workspaces) */
    size_t mem_limit;     /* 0 = none; else refuse allocations beyond it (setting mem_limit) */
    int tile;             /* BaKron tile size: 32 or 64 (default 64) */
    int factor_fp64;      /* setting factor_fp64=1: factor in fp64 also for fp32 solves */
    int push_group;       /* BaKron lazy pushes: far updates every this many tile
                             anti-diagonals (default 4; 0 = eager) */
    int solve_wc;         /* tile solve: columns per warp, 16 (8 warps per 64-tile) or 8
                             (16 warps) (default 16) */
    int side_band;        /* BaKron: the overlapped push in two launches, the band the
                             next flush needs first; that flush waits for the band
                             only (-1 auto = with the SM partition (default), 0 never,
                             1 always) */
    int far_async;        /* BaKron: the far push loads with cp.async (default 1) */
    int push_split;       /* BaKron: the critical-path pushes split each target tile
                             into this many parts per side, one per CTA: 1 or 2
                             (default 2) */
    int push_mma;         /* BaKron fp32: pushes on tensor cores (3xTF32): 0 none,
                             1 the far pushes (default), 2 every push */
    int solve_chain;      /* BaKron tile solve: 0 the session-14
                             chain, 1 conflict-free factor layouts and the critical slot first
                             (default; k_tile_solve3's V; same codes bit for bit) */
    /* BaKron: the side stream confined to an SM partition (partition.cu) */
    int partition;        /* SMs kept free of it: -1 auto (default), 0 never, N */
    void *green;          /* CUgreenCtx of the partition, or NULL */
    cudaStream_t part_stream; /* the partition's side stream */
    cudaEvent_t part_done;    /* recorded on it (an event of its context) */
    int part_sms, part_actual; /* SMs asked for / given */
    int part_used;        /* the last BaKron run used the partition (reported by bk-cuda-dev) */
    char part_off[96];    /* why the partition is unavailable ("" = not known to be) */
    /* bk_cuda_download's pinned staging (made at the first large download) */
    void *dl_pin[2];
    cudaEvent_t dl_ev[2];
    int dl_threads;       /* host threads copying out of a slot */
    int dl_off;           /* 1: staging unavailable (cudaHostAlloc failed): plain copies */
    /* the solve's statistics (stats.cu, bk_cuda_stats_launch): a low-priority
     * stream of their own and a cuBLAS handle bound to it, made at the first
     * launch; stats_ready orders it after the main stream's work */
    cudaStream_t stats_stream;
    cublasHandle_t stats_blas;
    cudaEvent_t stats_ready;
    /* an output factor factored ahead of its solve (solve.cu, bk_dprefetch):
     * a low-priority stream and cuBLAS / cuSOLVER handles bound to it (made
     * at the first one, with the main handles' settings), pf_ready orders it
     * after the main stream's work; pf_busy: one in flight */
    cudaStream_t pf_stream;
    cublasHandle_t pf_blas;
    cusolverDnHandle_t pf_solver;
    cudaEvent_t pf_ready;
    int pf_busy;
    /* A context that works for another one (the ahead factorization's copy
     * of the context on its own host thread): acct, the context whose
     * memory counters its allocations count against (NULL: its own; they
     * are updated under a process-wide lock); defer, when set, collects
     * bk_dev_free's pointers instead of freeing them (cudaFree waits for the
     * whole device: the owner frees them after the thread is joined). */
    struct bk_cuda_ctx *acct;
    struct bk_dev_defer *defer;
} bk_cuda_ctx;

/* The pointers a deferring context was asked to free (bk_cuda_ctx.defer). */
typedef struct bk_dev_defer {
    void **p;
    int n, cap;
} bk_dev_defer;
/* Free them through c (the owner) and empty the list. */
void bk_dev_defer_flush(bk_cuda_ctx *c, bk_dev_defer *d);

/* partition.cu */
bk_status bk_cuda_partition_side(bk_cuda_ctx *c, int keep, cudaStream_t *stream,
                                 cudaEvent_t *done);
void bk_cuda_partition_release(bk_cuda_ctx *c);
bool bk_cuda_partition_enter(bk_cuda_ctx *c);
void bk_cuda_partition_leave(bk_cuda_ctx *c);

extern "C" {
#include "util.h"
}
/* BK_PROFILE=1 (src/util.h): synchronize the stream and add the time since
 * *t under key; nothing when profiling is off. */
static inline void bk_cuda_pmark(cudaStream_t s, double *t, const char *key)
{
    if (bk_prof_on()) {
        cudaStreamSynchronize(s);
        bk_prof_mark(t, key);
    }
}

/* The default solver variants (bk_cuda_tuning_default); no settings. */
bk_status bk_cuda_ctx_create(int device, bk_cuda_ctx **out);
/* Set the solver variants (unchecked: bk_cuda_tuning_check first). */
void bk_cuda_ctx_tune(bk_cuda_ctx *c, const bk_cuda_tuning *t);
void bk_cuda_ctx_destroy(bk_cuda_ctx *c);

/* Tracked device allocation (zero-filled). Failure: BK_ERR_DEVICE_OOM naming
 * `what` and the size. *p is NULL on failure. */
bk_status bk_dev_alloc(bk_cuda_ctx *c, void **p, size_t bytes, const char *what);
void bk_dev_free(bk_cuda_ctx *c, void *p);
/* The device's free memory (cudaMemGetInfo), capped by what the setting
 * mem_limit leaves (limit - bytes held), so that the memory decisions made
 * from it (residency, kept inputs, the backward flow's cache and logits)
 * see an emulated smaller card. *total: the physical total. */
bk_status bk_dev_mem_free(const bk_cuda_ctx *c, size_t *free_bytes, size_t *total_bytes);
/* Count library workspace (cuSOLVER buffers) towards the peak. */
void bk_dev_note_transient(bk_cuda_ctx *c, size_t bytes);

/* bytes from device src into host (pageable) dst, ordered after the work on
 * c->stream; returns when dst holds them. Large downloads go through two
 * pinned slots: the DMA of one chunk overlaps the host threads copying the
 * previous one out (a pageable cudaMemcpy copies out on one thread, at a
 * fraction of the link's speed). Byte for byte the same as cudaMemcpy. */
/* Host memcpy in np parts (1..64), the parts after the first on their own
 * threads; a part whose thread cannot start is copied by the caller. */
void bk_host_copy_parts(char *dst, const char *src, size_t bytes, int np);
bk_status bk_cuda_download(bk_cuda_ctx *c, void *dst, const void *src, size_t bytes);
/* Its staging released (bk_cuda_ctx_destroy). */
void bk_cuda_download_release(bk_cuda_ctx *c);
/* Its chunk (one pinned slot) and the size from which it stages. */
#define BK_DL_CHUNK ((size_t)32 << 20)
#define BK_DL_MIN ((size_t)4 << 20)

static inline int64_t bk_round_up(int64_t x, int64_t to)
{
    return (x + to - 1) / to * to;
}

/* ------------------------------------------------------------- quantizer */

/* What the kernels need to round one entry (p, q) with the rule of
 * src/quant.h: s = scale[p * groups + q / group], z = zero[...] (uniform),
 * the scales/zeros being the fitted F32 values in the solve's type. */
typedef struct bk_dquant {
    int kind;            /* bk_qkind */
    int qmin, qmax;      /* code range (unused for BK_Q_INTEGER) */
    int64_t group;       /* columns per group (>= 1) */
    int64_t groups;      /* groups per row */
    const void *scale;   /* [m, groups] device, the solve's real type */
    const void *zero;    /* [m, groups] device or NULL */
} bk_dquant;

/* ------------------------------------------------------- the core solvers */

/* One problem on the device, in the solve's real type R (float or double).
 * W: [mpad, ldw] holds W0 on entry; its contents are undefined on return.
 * LA: [npad, ldla]; LB: [mpad, ldlb] or NULL (identity).
 * codes, weight: [m, n] device outputs. counts: device counters (added to). */
typedef struct bk_core_args {
    int64_t m, n;
    int64_t mpad, npad;
    void *W;
    int64_t ldw;
    const void *LA;
    int64_t ldla;
    const void *LB;
    int64_t ldlb;
    bk_dquant q;
    int16_t *codes;
    float *weight;              /* [m, n] device: the value each code stands for (F32) */
    unsigned long long *counts; /* device [3]: clamped, integer overflow, non-finite */
    int gptq_block;
    /* GPTQ with refit_groups: called at each group start with the group's
     * fully updated columns on the device (W + j0, row stride ldw); it must
     * refit group g and upload the new scales/zeros into q.scale / q.zero. */
    bk_status (*refit)(void *ctx, int64_t g, const void *dW, int64_t ldw);
    void *refit_ctx;
} bk_core_args;

/* Run one algorithm; `ms` receives the time of the core measured with CUDA
 * events on the context's stream: each algorithm allocates its workspace
 * first, then records c->ev_start, runs, and records c->ev_stop.
 * BK_ERR_UNSUPPORTED (with the sizes) when an algorithm is refused for the
 * size. */
bk_status bk_cuda_core(bk_cuda_ctx *c, bk_algorithm alg, bk_precision prec,
                       const bk_core_args *a, float *ms);

bk_status bk_cuda_bakron_f32(bk_cuda_ctx *c, const bk_core_args *a);
bk_status bk_cuda_bakron_f64(bk_cuda_ctx *c, const bk_core_args *a);
bk_status bk_cuda_gptq_f32(bk_cuda_ctx *c, const bk_core_args *a);
bk_status bk_cuda_gptq_f64(bk_cuda_ctx *c, const bk_core_args *a);
bk_status bk_cuda_antidiag_f32(bk_cuda_ctx *c, const bk_core_args *a);
bk_status bk_cuda_antidiag_f64(bk_cuda_ctx *c, const bk_core_args *a);
bk_status bk_cuda_naive_f32(bk_cuda_ctx *c, const bk_core_args *a);
bk_status bk_cuda_naive_f64(bk_cuda_ctx *c, const bk_core_args *a);
bk_status bk_cuda_recursive_f32(bk_cuda_ctx *c, const bk_core_args *a);
bk_status bk_cuda_recursive_f64(bk_cuda_ctx *c, const bk_core_args *a);
bk_status bk_cuda_rtn_f32(bk_cuda_ctx *c, const bk_core_args *a);
bk_status bk_cuda_rtn_f64(bk_cuda_ctx *c, const bk_core_args *a);

/* Size limits of the small-size algorithms (m * n). */
#define BK_CUDA_NAIVE_MAX_MN ((int64_t)128 * 128)

/* Row-major GEMM through cuBLAS: C[M,N] = alpha op(A) op(B) + beta C, where
 * op(A) is [M,K] (A stored [M,K] when !ta, [K,M] when ta), op(B) is [K,N]. */
bk_status bk_rm_gemm(cublasHandle_t h, int ta, int tb, int64_t M, int64_t N, int64_t K,
                     double alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
                     double beta, float *C, int64_t ldc);
bk_status bk_rm_gemm(cublasHandle_t h, int ta, int tb, int64_t M, int64_t N, int64_t K,
                     double alpha, const double *A, int64_t lda, const double *B, int64_t ldb,
                     double beta, double *C, int64_t ldc);

/* --------------------------------------------------------------- factors */

/* One side of the Kronecker product on the device (solver.c's `side`). */
typedef struct bk_dside {
    int64_t k, kpad;
    int identity;   /* B absent */
    void *dL;       /* solve type [kpad, kpad]: normalized unit lower factor, zero elsewhere */
    double *dtil;   /* [k, k] the damped factor X~ (statistics), or NULL */
    double *rdiag;  /* host [k]: RevCholesky(X~)_jj = 1 / diag of the unnormalized factor */
    double damp;    /* relative damping used */
    int retries;    /* escalations */
} bk_dside;

void bk_dside_free(bk_cuda_ctx *c, bk_dside *s);

/* From the symmetrized host matrix Xd [k, k] (double, zero diagonals already
 * replaced by 1, `mean` its mean diagonal): damp, factor the inverse on the
 * device, escalate as the CPU does (damp 0 -> 1e-2, else x10, at most
 * max_damp_retries times). The factorization runs in the solve precision,
 * or in fp64 when fp64_factor (then converted). BK_ERR_NOT_PD naming label
 * and the failed step when no damping works. */
bk_status bk_dside_from_matrix(bk_cuda_ctx *c, bk_dside *s, const double *Xd, int64_t k,
                               int64_t kpad, double mean, const char *label,
                               const bk_solve_opts *o, int fp64_factor, int keep_til);

/* The same from a device double matrix dXd [k, k] (symmetric, zero diagonals
 * already replaced by 1, `mean` its mean diagonal). dXd is consumed: it
 * becomes s->dtil (damping added) when keep_til, else it is freed, also on
 * failure. bk_dside_from_matrix uploads its host matrix and calls this. */
bk_status bk_dside_from_dmatrix(bk_cuda_ctx *c, bk_dside *s, double *dXd, int64_t k,
                                int64_t kpad, double mean, const char *label,
                                const bk_solve_opts *o, int fp64_factor, int keep_til);

/* From a precomputed host factor L (validated: lower triangular, positive
 * diagonal; L L^T = X~^-1), normalized on the host as the CPU does; X~ for
 * the statistics by inverting L on the device. */
bk_status bk_dside_from_factor(bk_cuda_ctx *c, bk_dside *s, const double *Lh, int64_t k,
                               int64_t kpad, const char *label, bk_precision prec,
                               int keep_til);

/* ------------------------------------------------------------ statistics */

/* loss_one = tr(E A~ E^T), loss_two = tr(E^T B~ E A~) with E = Wq - W0 (all
 * device double, row-major; Bd NULL = identity). With dAp and loss_plain
 * (else NULL): *loss_plain = tr(E Ap E^T) for the device F32 [n, n] Ap from the
 * same E A~ when A~ - Ap is diagonal (no second GEMM); NAN when it is not (the
 * caller computes it by another call with Ap as dAd). */
bk_status bk_cuda_losses(bk_cuda_ctx *c, int64_t m, int64_t n, const double *dWq,
                         const double *dW0, const double *dAd, const double *dBd,
                         double *loss_one, double *loss_two, const float *dAp,
                         double *loss_plain);

/* The same statistics on c->stats_stream, overlapping what the caller does on
 * c->stream after the launch (the downloads of the codes, the bound): the
 * same kernels, cuBLAS calls and inputs as bk_cuda_losses (the dot products
 * written to device memory instead of returned to the host), so the same
 * values. The buffers (E, E A~, B~ E, sums) are allocated by the launch on
 * the calling thread, before anything runs on the stats stream; the inputs
 * (dWq, dW0, dAd, dBd, dAp) must stay allocated and unchanged until
 * bk_cuda_stats_collect or bk_cuda_stats_drop. One job in flight per
 * context (one stats stream). */
typedef struct bk_stats_job {
    int active;          /* launched, not yet collected or dropped */
    int two, plain;      /* B given; the proxy loss asked for (dAp) */
    double *E, *F, *G;   /* [m, n] device */
    double *d, *part;    /* [n], [LOSS_BLOCKS + 1] (plain) */
    unsigned *doff;      /* A~ - Ap has an off-diagonal entry (plain) */
    double *res;         /* [3] device: loss_one, loss_two, loss_plain */
} bk_stats_job;

/* Launch (j is overwritten). On failure what was launched is waited for and
 * everything released (j inactive). */
bk_status bk_cuda_stats_launch(bk_cuda_ctx *c, bk_stats_job *j, int64_t m, int64_t n,
                               const double *dWq, const double *dW0, const double *dAd,
                               const double *dBd, const float *dAp);
/* Wait for j, read its results as bk_cuda_losses returns them (loss_plain NULL
 * when the launch had no dAp; NAN when A~ - Ap is not diagonal), release it.
 * A CUDA error of the stats stream is returned here (the caller names the
 * module). */
bk_status bk_cuda_stats_collect(bk_cuda_ctx *c, bk_stats_job *j, double *loss_one,
                                double *loss_two, double *loss_plain);
/* The failure/teardown path: wait for j (errors cleared), release it. */
void bk_cuda_stats_drop(bk_cuda_ctx *c, bk_stats_job *j);

/* ------------------------------------------------------------- the solve */

bk_status bk_cuda_solve(bk_cuda_ctx *c, const bk_solve_problem *p, const bk_solve_opts *o,
                        bk_solve_result *r);

/* The input side of one device solve kept for the next solves whose A is the
 * same matrix (q/k/v take the same E[x x^T] of attn_in, gate/up that of
 * mlp_in): the damping, Cholesky factor of the inverse, X~ and dead columns
 * of A are then computed once. The caller names A's content by (src, scale,
 * gen): equal names must mean equal matrices, so it drops the kept side
 * (bk_dshare_drop) whenever what a name stands for may change; the
 * generation (bk_ghess_factor_key: a new one at every change of the Grams)
 * keeps a forgotten drop from reusing a stale side. Reusing the
 * side gives the results that factoring A again gives (the same
 * deterministic steps on the same matrix with the same options). */
typedef struct bk_dshare {
    /* set by the caller for each solve */
    const void *src;  /* the name of this solve's A; NULL: not shareable (drops a kept side) */
    double scale;
    uint64_t gen;     /* the generation of src's content (bk_ghess_factor_key): a kept side
                         of another generation is never used, bk_dshare_drop or not */
    int keep;         /* keep this solve's input side for a later solve of the same A */
    /* the kept side (owned; bk_dshare_drop releases it) */
    int valid;
    const void *k_src;
    double k_scale;
    uint64_t k_gen;
    int64_t n, dead;
    bk_precision prec;
    double damp;
    int max_retries, stats, fp64_factor;
    bk_dside sa;
    int hits;         /* solves that reused a kept side (for tests and notes) */
} bk_dshare;

/* Release a kept input side (the struct stays usable). */
void bk_dshare_drop(bk_cuda_ctx *c, bk_dshare *s);

/* An output factor B factored ahead of its solve: on the context's pf
 * stream, by a host thread of its own (cuSOLVER's factorization and the
 * damping escalation synchronize with the host at every step), while the
 * caller's thread solves another module on the main stream. The same
 * functions on the same B with the same options as solve_dev's own output
 * side (dcheck_finite, prepare_dmatrix, bk_dside_from_dmatrix), only on
 * another stream with handles of the same settings: the same factor bit for
 * bit. */
typedef struct bk_dprefetch bk_dprefetch;
/* Start factoring the device B [m, m] (written by the work enqueued on
 * c->stream so far: an event orders the pf stream after it; B must stay
 * unchanged and allocated until the prefetch is taken or dropped) for a
 * solve with options o (its output side's damping: o->damp_b where
 * o->separate_damp_b). One at a time per context. Failure: nothing
 * started, *out NULL. */
bk_status bk_dprefetch_start(bk_cuda_ctx *c, const float *B, int64_t m, const bk_solve_opts *o,
                             bk_dprefetch **out);
/* Wait for it and release everything it holds (NULL: nothing). */
void bk_dprefetch_drop(bk_cuda_ctx *c, bk_dprefetch *pf);

/* A solve whose factors already live on the device (the GPU pipeline). */
typedef struct bk_dsolve_problem {
    int64_t m, n;
    const float *W;       /* HOST [m, n] row-major F32: the original weights; may be
                             NULL with dW (read back from dW where the solve needs
                             it on the host: dead columns) */
    const float *A;       /* DEVICE [n, n] F32 input factor, symmetric PSD, required */
    const float *B;       /* DEVICE [m, m] F32 output factor, or NULL (identity) */
    const float *A_plain; /* DEVICE [n, n] F32 or NULL: for *loss_gptq only (not checked) */
    const char *label_w, *label_a, *label_b;
    const float *dW;      /* DEVICE copy of W or NULL: the alphabet is then fitted on the
                             device (cuda/qfit.cuh; same rule, sums in another order) */
    int no_host_weight;   /* with dW: r->weight stays NULL (d_weight has it; saves the
                             m*n download when the caller only needs codes and scales) */
    bk_dshare *share;     /* or NULL: the input side shared between solves of one A */
    bk_dprefetch *pre;    /* or NULL: B factored ahead (bk_dprefetch_start on a B of the same
                             contents, the caller's word): the solve takes it over, waits for
                             it and uses its factor when it succeeded with this solve's
                             options, else factors B itself as without it (the same checks,
                             escalation and messages); released in every case */
} bk_dsolve_problem;

/* As bk_cuda_solve on the same problem with A/B given as host F32 arrays: the
 * same validation (finiteness, symmetry, diagonals: run on the device, the
 * same statuses and messages), damping and escalation, dead columns,
 * alphabets, codes, statistics and timings in r; A, B and A_plain are read on
 * the device and never copied to the host (only their diagonals are).
 * d_weight (DEVICE [m, n] F32, may be NULL) additionally receives the
 * dequantized weight (device copy; untouched on failure). *loss_gptq (may be
 * NULL) = tr(E A_plain E^T), E = weight - W (the original W, dead columns
 * included), in double on the device; NAN when A_plain is NULL or on failure;
 * computed also when o->compute_stats is 0 (its time is counted in
 * r->time_stats_s). */
bk_status bk_cuda_solve_dev(bk_cuda_ctx *c, const bk_dsolve_problem *p, const bk_solve_opts *o,
                            bk_solve_result *r, float *d_weight, double *loss_gptq);

#endif /* BK_CUDA_INTERNAL_CUH */
