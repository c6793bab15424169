/* CUDA backend — internals shared by the GPU forward pass (forward.cu), the
 * GPU Hessians (hessian.cu) and the GPU stage table (pipeline_cuda.cu). The
 * C interface is src/pipeline_gpu.h. */
#ifndef BK_FWD_INTERNAL_CUH
#define BK_FWD_INTERNAL_CUH

#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>

#include "cuda_internal.cuh"
#include "forward_internal.h"
#include "pipeline_gpu.h"

/* One decoder layer's weights on the device (F32), as bk_layer_weights. */
struct bk_glayer {
    int layer;
    float *w[BK_MOD_COUNT]; /* [out, in] */
    __nv_bfloat16 *wb[BK_MOD_COUNT]; /* BF16 copies (BK_GEMM_BF16 only), else NULL */
    float *b[BK_MOD_COUNT]; /* [out] or NULL */
    float *attn_norm, *mlp_norm, *q_norm, *k_norm;
};

struct bk_gfwd {
    bk_cuda_ctx *c;
    cublasHandle_t blas;       /* the forward's and Hessians' GEMMs: on c's stream, in the
                                  backend's GEMM arithmetic (fp32 or TF32 tensor cores) */
    int tf32, bf16;
    __nv_bfloat16 *xb;         /* BF16 staging of GEMM inputs (bf16 only) */
    int64_t xb_elems;
    /* what xb holds: the BF16 rounding of xb_src [xb_n] converted by the last
     * bk_g_linear_mod (NULL: nothing known; cleared by every other writer of
     * xb and at the start of every bk_g_linear_mod) — bk_g_linear_mod_same */
    const float *xb_src;
    int64_t xb_n;
    bk_model_config cfg;
    bk_dims dim;
    float eps;
    float *cos, *sin;          /* [T, hd/2] (src/rope.c tables) */
    /* micro-batch scratch, [max_rows, width] */
    float *q, *k, *v;          /* projections, token-major */
    float *qh, *kh, *vh, *oh;  /* head-major [S, heads, T, hd]: the unfused attention's; NULL
                                  until bk_g_attn_unfused_alloc in fused mode */
    float *o, *x, *tmp, *gate, *up, *down;
    float *scores;             /* score_floats floats: the unfused attention's scores, the LM
                                  head's vocabulary blocks; NULL until first use in fused mode */
    int64_t score_floats;
    /* fused attention (attn_flash.cu): BF16 mode with a supported head_dim;
     * the rotated queries, keys and values as BF16, group-major as qh/kh/vh */
    int attn_fused;
    __nv_bfloat16 *qb, *kb, *vb;
    int32_t *tok;              /* [max_rows] token ids of a micro-batch */
    unsigned long long *flag;  /* [2] device scratch (finiteness checks) */
    /* per operation of the layer (bk_fwd_site, src/forward_internal.h): the
     * first non-finite entry of its output, (flat index << 2) | class (0 +Inf,
     * 1 -Inf, 2 NaN, 3 -NaN), ~0 when none; marked by the kernels that read or
     * write the output, read by bk_gfwd_nf_report */
    unsigned long long *nf;    /* device [BK_FS_COUNT] */
    unsigned long long *nf_host; /* pinned host copy [BK_FS_COUNT] */
    /* embedding table (raw dtype) while embedding */
    void *emb;
    int emb_dt;
    /* final norm + LM head as F32 (NLL / logits) */
    float *head_w, *head_norm;
    float *lse_mx, *lse_tgt;   /* [max_rows] */
    double *lse_se;            /* [max_rows] */
    /* host-to-device weight uploads (bk_gpu_upload_f32): two pinned host slots
     * of up_chunk F32 and two device slots of up_chunk BF16, at first use */
    void *up_pin[2];
    uint16_t *up_dev[2];
    cudaEvent_t up_ev[2];
    int64_t up_chunk, up_min_part;
    int up_threads;
};

/* Mark the first non-finite value of an output (bk_gfwd.nf): flat index i. */
static __device__ __forceinline__ void bk_nf_note(unsigned long long *flag, float v, int64_t i)
{
    if (flag && !isfinite(v)) {
        const unsigned long long cls = (isnan(v) ? 2ull : 0ull) | (signbit(v) ? 1ull : 0ull);
        atomicMin(flag, ((unsigned long long)i << 2) | cls);
    }
}

/* Fused causal attention (attn_flash.cu): out [S*T, nkv*rep*hd] token-major
 * F32 = softmax(scale q kᵀ, causal) v per (sequence, kv group) pair, from
 * BF16 q [S, nkv, T, rep, hd], k and v [S, nkv, T, hd]; BF16 products with
 * F32 accumulation; nf (or NULL) flags the first non-finite output. head_dim
 * 64 and 128 only (bk_attn_flash_supported). bn (keys per block) and mt
 * (16-row m-tiles per warp): 0 = the product's choice; the dev harness times
 * variants (attn_flash.cu lists them). */
int bk_attn_flash_supported(int64_t hd);
bk_status bk_attn_flash(const __nv_bfloat16 *q, const __nv_bfloat16 *k, const __nv_bfloat16 *v,
                        float *out, int64_t S, int64_t nkv, int64_t T, int64_t rep, int64_t hd,
                        float scale, unsigned long long *nf, cudaStream_t stream, int bn = 0,
                        int mt = 0, float *lse = NULL);
/* (lse, or NULL: per row of q's layout, [S, nkv, T, rep], the log2-domain
 * log-sum-exp of the scaled scores, m + log2 l with the row's maximum m of
 * scale·log2(e)·s and its sum l; for bk_attn_flash_bwd. The output is the
 * same with and without it.)
 *
 * Fused causal attention backward (attn_flash_bwd.cu; the backprop flow's
 * bf16 layer backward, cuda/backward.cu attn_back_fused): from the forward's BF16 q, k, v (layouts as
 * above), its F32 output o and the output gradient dout (token-major [S*T,
 * nkv*rep*hd]) and its lse, the F32 gradients dq [S*T, nkv*rep*hd], dk and
 * dv [S*T, nkv*hd] token-major (written, not accumulated), of the scaled
 * softmax attention (scale as the forward's). Scratch: dob (BF16, S*nkv*T*
 * rep*hd: dout group-major) and dsum (F32, S*nkv*T*rep: rowsum(dout ∘ o)).
 * Deterministic (no atomics; dk/dv sum the group's query heads in row
 * order). head_dim 64 and 128 (bk_attn_flash_supported). */
bk_status bk_attn_flash_bwd(const __nv_bfloat16 *q, const __nv_bfloat16 *k,
                            const __nv_bfloat16 *v, const float *o, const float *dout,
                            const float *lse, float *dq, float *dk, float *dv, __nv_bfloat16 *dob,
                            float *dsum, int64_t S, int64_t nkv, int64_t T, int64_t rep,
                            int64_t hd, float scale, cudaStream_t stream);
/* The attention of bk_gfwd_attention after RoPE, from the rotated head-major
 * inputs into d_o (token-major [S*T, qdim]): fused from f->qb/kb/vb (needs
 * f->attn_fused), else the unfused path from f->qh/kh/vh (cuBLAS scores,
 * causal softmax, cuBLAS P V). The dev harness times one against the other. */
bk_status bk_g_attn_core(bk_gfwd *f, int64_t S, float *d_o, int fused, int bn = 0, int mt = 0);
/* The unfused path's buffers f->qh/kh/vh/oh and f->scores: allocated by
 * bk_gfwd_create when the forward runs unfused, else here on the first
 * unfused use (bk_gfwd_attention and bk_g_attn_core call it; a caller that
 * writes qh/kh/vh itself, as the dev harness, calls it first). No-op once
 * they exist; they stay until bk_gfwd_free. */
bk_status bk_g_attn_unfused_alloc(bk_gfwd *f);

/* Grid size for a grid-stride loop over n items with 256 threads. */
static inline unsigned bk_grid(int64_t n)
{
    int64_t b = (n + 255) / 256;
    if (b < 1)
        b = 1;
    if (b > 1048576)
        b = 1048576;
    return (unsigned)b;
}

/* The status of the last launch, naming the kernel. */
static inline bk_status bk_launch_status(const char *what, const char *file, int line)
{
    return bk_cuda_status(cudaGetLastError(), what, file, line);
}
#define BK_LAUNCHED(what) bk_launch_status(what, __FILE__, __LINE__)

/* Y[N, out] = X[N, in] W[out, in]^T (+ b), F32 data; fp32 or TF32
 * arithmetic as the context's handle (f->blas). */
bk_status bk_g_linear(bk_gfwd *f, const float *X, int64_t N, int64_t in, const float *W,
                      int64_t out, const float *b, float *Y);
/* As bk_g_linear with module mod of lw (its weight, and its bias when
 * with_bias): BF16 inputs with fp32 accumulation when the context is bf16
 * (the weight's BF16 copy, X rounded to BF16 on the way), else bk_g_linear. */
bk_status bk_g_linear_mod(bk_gfwd *f, const float *X, int64_t N, int64_t in, const bk_glayer *lw,
                          bk_module mod, int64_t out, int with_bias, float *Y);
/* As bk_g_linear_mod, for a call that directly follows a bk_g_linear_mod (or
 * _same) on the same X, N and in with nothing written to X in between (q, k,
 * v from one attn_in; gate, up from one mlp_in): the BF16 copy of X that call
 * made is used again instead of rounding X once more (the same bits). Where
 * the previous call did not make one, as bk_g_linear_mod. */
bk_status bk_g_linear_mod_same(bk_gfwd *f, const float *X, int64_t N, int64_t in,
                               const bk_glayer *lw, bk_module mod, int64_t out, int with_bias,
                               float *Y);
/* Refresh lw's BF16 copy of module mod from its F32 weight (no-op unless bf16). */
bk_status bk_glayer_sync_bf16(bk_gfwd *f, bk_glayer *lw, bk_module mod);
/* C += X^T X for X [rows, n] row-major (ld n), C [n, n] row-major: its
 * upper triangle in row-major terms (= cuBLAS's column-major lower) is
 * complete; entries below the diagonal may hold partial sums. Through
 * f->blas: SSYRK in fp32 mode, lower-trapezoid GEMM panels in TF32 mode
 * (SSYRK has no tensor-core path; n < 512 always SSYRK), the same panels on BF16 copies of X
 * (in row chunks) with fp32 accumulation in BF16 mode. */
bk_status bk_g_syrk(bk_gfwd *f, int64_t n, int64_t rows, const float *X, float *C);
/* y = w * (x * rsqrt(mean(x^2) + eps)) over rows of n (y may equal x). */
bk_status bk_g_rmsnorm(bk_gfwd *f, const float *x, int64_t rows, int64_t n, const float *w,
                       float *y);
/* The first non-finite entry of d [rows, cols] (row-major): *found = 0 when
 * none, else its row, column and value. */
bk_status bk_g_first_nonfinite(bk_gfwd *f, const float *d, int64_t rows, int64_t cols,
                               int *found, int64_t *row, int64_t *col, float *val);

/* Non-finite activations of the layer forward (as the CPU's per-operation
 * checks, one line naming the first operation; forward_internal.h):
 * bk_gfwd_nf_clear resets the flags (async), bk_gfwd_nf_fetch queues their
 * copy to the host (async: no synchronization of its own), and after the
 * stream has been synchronized bk_gfwd_nf_report returns BK_ERR_NONFINITE
 * naming the layer lw's first flagged operation (its weights are downloaded
 * for the message, on that error path only), or BK_OK. */
bk_status bk_gfwd_nf_clear(bk_gfwd *f);
bk_status bk_gfwd_nf_fetch(bk_gfwd *f);
bk_status bk_gfwd_nf_report(bk_gfwd *f, const bk_glayer *lw);

#endif /* BK_FWD_INTERNAL_CUH */
