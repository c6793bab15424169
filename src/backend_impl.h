/* The backend interface (internal): one table of operations plus a context.
 *
 * Every operation whose implementation differs between the CPU and a device
 * is an entry here. The CPU backend (src/backend_cpu.c) is the oracle; a
 * device backend (cuda/backend_cuda.cu) fills the entries it accelerates and
 * leaves the others NULL: the driver then runs the CPU implementation of
 * that operation (bk_backend_supports, and the bk_backend_* dispatchers of
 * src/backend.c, which fall back by themselves where they can). A backend
 * that spans several devices is one more table with its own context.
 * docs/DEVELOPING.md "Architecture" maps who owns what.
 */
#ifndef BK_BACKEND_IMPL_H
#define BK_BACKEND_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/backend.h"
#include "bakron/backward.h"
#include "bakron/forward.h"
#include "bakron/hessian.h"
#include "bakron/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------- the layer driver's stages */

/* The per-layer sequence of a token-calibrated quantize job (src/quantize_layers.c
 * runs it; docs/DEVICE.md "Pipeline on the GPU"). */
typedef enum bk_stage {
    BK_STAGE_QKV = 0, /* x = attn_in(orig); fully-local: FP queries/keys; add_attn */
    BK_STAGE_O,       /* attention with the quantized q/k/v -> o_in (kept); add_o */
    BK_STAGE_MLP,     /* h += o_proj(o_in); x = mlp_in; add_mlp (original gate/up) */
    BK_STAGE_DOWN,    /* down_in = mlp_hidden(mlp_in(h)); add_down */
    BK_STAGE_OUT,     /* h += down_proj(mlp_hidden(mlp_in(h))) */
    BK_STAGE_FULL,    /* the whole layer with the original weights, no Hessians */
    BK_STAGE_TAPS     /* the whole layer with the original weights; every add */
} bk_stage;

/* A buffer of the stages' state handed to a collective (MPI ranks,
 * src/pipeline.c): n elements (double with f64, else float) at buf; a host
 * array (dev 0, stream NULL) or a device array used on the CUDA stream
 * `stream` (dev 1). */
typedef bk_status (*bk_stage_buf_fn)(void *user, void *buf, size_t n, int f64, int dev,
                                     void *stream);
/* What a collective does with a buffer (what a host copy must carry): fn
 * reads it (a send), writes it (a receive), or both. */
enum { BK_BUF_READ = 1, BK_BUF_WRITE = 2 };

/* What the stages of one quantize job do on one micro-batch: the residual
 * stream of all sequences, one layer's weights (original + working copy) and
 * one layer's Hessian accumulators held by the backend. */
/* Backprop kinds: the output side of one layer for stages that keep their
 * own input side (bk_stage_ops.bp_grads): either the flow's host
 * accumulator, or the GPU flow's device Grams of the layer. */
typedef struct bk_bp_side {
    int layer;
    bk_hess_acc *acc;               /* host (B and Shampoo's token weights from it; stages
                                       on the host add the layer's input side into it), or
                                       NULL */
    const double *G[BK_MOD_COUNT];  /* acc NULL: device [out, out] double, row-major upper
                                       triangle: Σ g gᵀ, or Σ |a_fp|² g gᵀ (Shampoo) */
    const double *gw[BK_MOD_COUNT]; /* acc NULL, Shampoo: device |g_t|² [N] in order */
    int64_t N;                      /* acc NULL: the tokens summed in G */
} bk_bp_side;

typedef struct bk_stage_ops {
    const char *name; /* the backend's name */
    /* Embed sequences [s0, s0+sb) (tokens: the whole [S, T] array). */
    bk_status (*embed)(void *ctx, const int32_t *tokens, int64_t s0, int64_t sb);
    /* A layer starts: orig = full-precision weights, lw = the working copy
     * (equal to orig now). hessians = 1: reset the accumulators. */
    bk_status (*layer_begin)(void *ctx, const bk_layer_weights *orig, const bk_layer_weights *lw,
                             int hessians);
    /* One stage on sequences [s0, s0+sb); adds the time spent to *t_forward
     * and *t_hessian. */
    bk_status (*run)(void *ctx, bk_stage stage, int64_t s0, int64_t sb, double *t_forward,
                     double *t_hessian);
    /* Host factors of module mod (valid until the next call): A, B (NULL =
     * identity) and A_plain = E[x x^T] (the GPTQ proxy loss; may equal A).
     * rtn: all NULL. */
    bk_status (*factors)(void *ctx, bk_module mod, const float **A, const float **B,
                         const float **A_plain);
    /* The quantized weight w [out, in] replaces lw's module mod. */
    bk_status (*weight_updated)(void *ctx, bk_module mod, const float *w);
    /* Optional (NULL: factors + bk_backend_solve on host arrays): the factors
     * as DEVICE arrays (same contract as factors otherwise), and the solve of
     * module mod with them: p->W is the host original weight, p->A / p->B the
     * device factors from factors_dev, A_plain the device E[x x^T] or NULL.
     * Fills r as bk_backend_solve does and *loss_gptq = tr(E A_plain E^T)
     * (NAN without A_plain); the device working copy gets the quantized
     * weight (weight_updated is not called). */
    bk_status (*factors_dev)(void *ctx, bk_module mod, const float **A, const float **B,
                             const float **A_plain);
    bk_status (*solve_dev)(void *ctx, bk_module mod, const bk_solve_problem *p,
                           const float *A_plain, const bk_solve_opts *o, bk_solve_result *r,
                           double *loss_gptq);
    /* The layer is done (its weights are released by the caller). */
    void (*layer_end)(void *ctx);
    void (*destroy)(void *ctx);
    /* One line for the log and report.json ("" for the CPU stages, unless
     * they run a job another backend has no stages for: why). */
    const char *(*describe)(void *ctx);
    /* Backprop kinds (required for them): the output side of the layer just
     * begun (its B, and Shampoo's token weights |g_t|² for the input side);
     * called after layer_begin, before the layer's stages; what it points to
     * stays valid until layer_end. The CPU stages add the input side into
     * side->acc and form the factors from it. */
    bk_status (*bp_grads)(void *ctx, const bk_bp_side *side);
    /* MPI ranks (data parallel, src/quantize_ranks.c). sums: required for
     * several ranks (stages without it refuse them). share_weight: required
     * with solve_dev (NULL otherwise: the solved weight reaches every rank's
     * working copy through weight_updated).
     * sums: hand fn the running Hessian sums of modules `modules` (bit m =
     * bk_module m), one buffer at a time, as bk_hess_acc_sums does, counts
     * and scalars last (a host double array, written back). dev 1: the
     * device buffers go to fn as they are; dev 0: through host copies (in
     * pieces of at most 256 MiB; rw says which way to copy); host buffers go
     * to fn as they are (dev 0, stream NULL).
     * share_weight: module mod's quantized weight in the working copy (set by
     * solve_dev on the rank that solved it) to fn (a broadcast); with
     * BK_BUF_WRITE in rw the copies derived from it are refreshed after. */
    bk_status (*sums)(void *ctx, unsigned modules, int dev, int rw, bk_stage_buf_fn fn,
                      void *user);
    bk_status (*share_weight)(void *ctx, bk_module mod, int dev, int rw, bk_stage_buf_fn fn,
                              void *user);
    /* --activations (optional: stages created with inputs = 1 have it): the
     * four module inputs of sequences [s0, s0+sb) of the layer begun from
     * host arrays in[0..3] [sb*T, width] (attn_in, o_in, mlp_in, down_in)
     * into the accumulators; fully-local: the FP queries/keys recomputed from
     * attn_in with the original weights. Adds the time spent to *t_forward
     * and *t_hessian. */
    bk_status (*add_inputs)(void *ctx, int64_t s0, int64_t sb, const float *const in[4],
                            double *t_forward, double *t_hessian);
    /* 1: bp_grads takes the output side from a host accumulator only
     * (side->acc; the GPU flow then hands its Grams to the host), 0: device
     * Grams too. */
    int bp_host_grads;
    /* Optional (NULL: nothing to do): module `next` is solved right after
     * the module being solved now, from the same stage's sums (q -> k -> v,
     * gate -> up). The driver calls it between the current module's factors
     * and its solve, with the options next's solve will get (o: its output
     * side's damping, precision, escalation, statistics). The stages may
     * start on next's factors meanwhile (the CUDA stages factor next's
     * output factor B on a stream and host thread of their own while the
     * current module is solved) and use that work in next's solve, which
     * must give the same results bit for bit as without the call. Advisory:
     * it cannot fail; whatever goes wrong ahead is redone, and reported, by
     * next's own factors and solve as without it. The CPU stages: nothing. */
    void (*prepare_next)(void *ctx, bk_module next, const bk_solve_opts *o);
} bk_stage_ops;

/* What a backend's stages are created for. */
typedef struct bk_stage_params {
    const bk_model *model;
    bk_hessian_kind kind; /* rtn: gptq (the factors are not used) */
    int fp64;             /* Hessians in double */
    int keep_plain;       /* also E[x x^T] of mlp_in for the Shampoo kinds (A_plain of gate/up) */
    int fully;            /* fully-local: FP queries/keys in stage QKV */
    int codes_only;       /* the export needs codes and scales only (solve_dev leaves r->weight
                             NULL) */
    int64_t S, T;         /* calibration sequences and tokens per sequence */
    int rank, nranks;     /* MPI ranks (0, 0 or 1: one process): the stages hold the states
                             (residual stream, o_proj and down_proj inputs) of this rank's
                             sequences only, bk_rank_share with the micro-batch they return;
                             the run and embed calls then cover those sequences only */
    int sequential;       /* 0: --no-sequential (stage TAPS only) */
    int inputs;           /* 1: the module inputs come from the caller (--activations:
                             add_inputs; no embedding, no residual stream); S may be 0 (rtn
                             without calibration: the stages hold nothing) */
    int cpu;              /* 1: the CPU implementation even where the backend has its own
                             (--cpu-stages, --activations, the backprop input side with the
                             setting bwd_input=cpu) */
    struct bk_bwd_mem_params *bwd; /* backprop kinds with the backend's flow: what the
                             flow will hold on the same device beside the stages (src/bwd_mem.h;
                             the GPU stages size their micro-batch and what they keep from it;
                             leaf 0: they choose it, bk_bwd_auto_leaf, and set it here);
                             NULL: no flow */
} bk_stage_params;

/* ------------------------------------ the layer forward (eval, dump-activations) */

/* What a layer forward is created for. */
typedef struct bk_layer_fwd_params {
    const bk_model *model;
    int64_t S, T;     /* sequences (the residual stream of all of them is held) and tokens */
    int64_t batch;    /* sequences per micro-batch; 0: the backend's automatic rule */
    int taps;         /* layer_taps is called (dump-activations), else layer_run */
    const char *what; /* the command, for messages ("eval", "dump-activations") */
} bk_layer_fwd_params;

/* The forward pass of whole layers with the original weights over the
 * residual stream of S sequences held by the backend (src/layer_driver.c runs
 * it): the inputs of the linear modules handed out (dump-activations), or
 * the final norm + LM head after the last layer (eval). */
typedef struct bk_layer_fwd_ops {
    /* Embed sequences [s0, s0+sb) (tokens: the whole [S, T] array). */
    bk_status (*embed)(void *ctx, const int32_t *tokens, int64_t s0, int64_t sb);
    /* The embedding is done (a device may release its table). */
    void (*embed_end)(void *ctx);
    bk_status (*layer_begin)(void *ctx, const bk_layer_weights *lw);
    /* The layer on sequences [s0, s0+sb) in place. */
    bk_status (*layer_run)(void *ctx, int64_t s0, int64_t sb);
    /* The same, taps[0..3]: host arrays [sb*T, width] for attn_in, o_in,
     * mlp_in and down_in (created with taps = 1). */
    bk_status (*layer_taps)(void *ctx, int64_t s0, int64_t sb, float *const taps[4]);
    /* The layer is done (a device finishes its work on it). */
    bk_status (*layer_end)(void *ctx);
    /* Final norm + LM head on sequences [s0, s0+sb) after the last layer:
     * the summed NLL of the next-token predictions (tokens: the whole [S, T]
     * array) added to *nll_sum and *count, as bk_fwd_nll; or the logits
     * [sb*T, vocab] into the host array logits, as bk_fwd_logits. */
    bk_status (*nll)(void *ctx, const int32_t *tokens, int64_t s0, int64_t sb, double *nll_sum,
                     int64_t *count);
    bk_status (*logits)(void *ctx, int64_t s0, int64_t sb, float *logits);
    void (*destroy)(void *ctx);
    /* The device line of the dump's manifest ("cpu" on the CPU). */
    const char *(*device)(void *ctx);
    int uses_gemm_math; /* the backend's GEMM arithmetic applies (the manifest says which) */
} bk_layer_fwd_ops;

/* ------------------------------------------------------- the backend table */

/* The operations, for bk_backend_supports. */
typedef enum bk_backend_op {
    BK_OP_SOLVE = 0,    /* solve one module from host factors */
    BK_OP_LAYER_FWD,    /* layer forward: taps (dump-activations), head (eval) */
    BK_OP_STAGES,       /* the quantize stages: forward, Hessians, factors, solves */
    BK_OP_BACKWARD      /* the backward flow of the Backprop Hessians */
} bk_backend_op;

typedef struct bk_backend_ops {
    const char *name;
    /* Required. */
    bk_status (*solve)(void *ctx, const bk_solve_problem *p, const bk_solve_opts *o,
                       bk_solve_result *r);
    /* Optional (NULL: 0). */
    size_t (*peak_memory)(void *ctx);
    /* Optional: restart the high-water mark at the current usage. */
    void (*reset_peak_memory)(void *ctx);
    /* The layer forward (eval, dump-activations). *batch: the micro-batch
     * used (p->batch, or the backend's automatic rule when 0). */
    bk_status (*layer_fwd_create)(bk_backend *b, const bk_layer_fwd_params *p, int64_t *batch,
                                  const bk_layer_fwd_ops **ops, void **ctx);
    /* The quantize stages. *batch: the micro-batch asked for (0 = automatic),
     * reduced when the memory is short; the value used is returned.
     * NULL: the CPU's (bk_cpu_stages_create). BK_ERR_UNSUPPORTED (one line
     * naming what is missing, "cuda has no stages for ..."), before anything
     * is allocated: no implementation for this job's kind or settings; the
     * dispatcher then runs the CPU's (supports_op per job). */
    bk_status (*stages_create)(bk_backend *b, const bk_stage_params *p, int64_t *batch,
                               const bk_stage_ops **ops, void **ctx);
    /* The backward flow of the Backprop Hessians, as bk_bwd_flow_run
     * (src/backward_flow.c, the CPU's). precision: a bk_bwd_precision
     * (bakron/pipeline.h), the arithmetic on a device. A device may hand
     * each leaf layer's output-gradient Grams to cb->grams (when set)
     * instead of the taps to cb->grads. */
    bk_status (*bwd_flow_run)(bk_backend *b, const bk_model *m, const int32_t *tokens, int64_t S,
                              int64_t T, const bk_bwd_flow_opts *o, int precision,
                              const bk_bwd_flow_cb *cb, bk_bwd_flow_stats *stats);
    /* Required. */
    void (*destroy)(void *ctx);
} bk_backend_ops;

/* Sequences per micro-batch: budget / per_seq bytes, within [1, S]. */
int64_t bk_batch_within(double budget, double per_seq, int64_t S);
/* MPI ranks, data parallel: rank's share [*lo, *hi) of S sequences, whole
 * micro-batches of `batch` (the single process's boundaries), contiguous,
 * in rank order. Returns 0 (and [0, S)) when there are fewer micro-batches
 * than ranks; 1 otherwise (one rank: [0, S)). */
int bk_rank_share(int64_t S, int64_t batch, int rank, int nranks, int64_t *lo, int64_t *hi);
/* The micro-batch of a layer forward: p->batch within [1, S], or `automatic`
 * (the backend's rule) when p->batch is 0. */
int64_t bk_layer_fwd_batch(const bk_layer_fwd_params *p, int64_t automatic);

/* Whether backend b has an implementation of op other than the CPU's (else
 * the driver runs the CPU one; 0 for every op of the CPU backend but solve). */
int bk_backend_supports(const bk_backend *b, bk_backend_op op);

/* Dispatchers (layer_fwd_create and stages_create fall back to the CPU
 * implementation, also for b == NULL; stages_create also when p->cpu asks
 * for it, and when the backend's stages_create returns BK_ERR_UNSUPPORTED:
 * it has no stages for that Hessian kind or setting; the CPU stages then
 * run the job and their describe says so, "stages on the CPU (<the
 * backend's message>)", for the log line and report.json). bk_backend_solve is public (bakron/backend.h), and so are
 * bk_backend_model_nll and bk_backend_model_logits, which run the layer
 * driver over layer_fwd_create (src/eval.c). */
bk_status bk_backend_layer_fwd_create(bk_backend *b, const bk_layer_fwd_params *p,
                                      int64_t *batch, const bk_layer_fwd_ops **ops, void **ctx);
bk_status bk_backend_stages_create(bk_backend *b, const bk_stage_params *p, int64_t *batch,
                                   const bk_stage_ops **ops, void **ctx);
/* NULL entry or b NULL: the CPU's flow (bk_bwd_flow_run; cb->grads, precision
 * ignored). */
bk_status bk_backend_bwd_flow_run(bk_backend *b, const bk_model *m, const int32_t *tokens,
                                  int64_t S, int64_t T, const bk_bwd_flow_opts *o, int precision,
                                  const bk_bwd_flow_cb *cb, bk_bwd_flow_stats *stats);

/* The CPU implementation of the layer forward (src/backend_cpu.c; also the
 * fallback of other backends). Automatic batch: bk_fwd_auto_batch. */
bk_status bk_cpu_layer_fwd_create(bk_backend *b, const bk_layer_fwd_params *p, int64_t *batch,
                                  const bk_layer_fwd_ops **ops, void **ctx);
/* The CPU implementation of the quantize stages (src/backend_cpu_stages.c;
 * also the fallback of other backends, and what p->cpu asks for): the
 * forward pass (bk_fwd) and the Hessian accumulators (bk_hess_acc) on host
 * buffers. Automatic batch: bk_fwd_auto_batch. b may be NULL (its settings:
 * keep_down). */
bk_status bk_cpu_stages_create(bk_backend *b, const bk_stage_params *p, int64_t *batch,
                               const bk_stage_ops **ops, void **ctx);
/* The CPU stages ctx (from bk_cpu_stages_create) describe themselves as
 * `note` (the dispatcher's fallback; copied, cut at 511 bytes). */
void bk_cpu_stages_note(void *ctx, const char *note);
/* 1: ops are the CPU stages' (the dispatcher fell back, or was asked to). */
int bk_cpu_stages_are(const bk_stage_ops *ops);

struct bk_backend {
    const bk_backend_ops *ops;
    void *ctx;
    bk_backend_kind kind;
    bk_gemm_math gemm_math; /* forward/Hessian GEMMs of the GPU pipeline and eval */
    bk_backend_params params; /* the settings it was created with */
    char device[256];
};

/* Fill b (ops, ctx, device); b->params is set. */
bk_status bk_cpu_backend_init(bk_backend *b);

/* Variant selectors of the CUDA BaKron solver. Their defaults are settled by
 * the measurements in cuda/dev/NOTES.md; only the dev harness (bk-cuda-dev)
 * and the GPU parity test change them (bk_cuda_backend_tune), the product
 * never does. */
typedef struct bk_cuda_tuning {
    int tile;       /* tile size: 32 or 64 (64) */
    int solve_wc;   /* tile solve: columns per warp, 8 (16 warps per 64-tile) or 16 (16) */
    int overlap;    /* far pushes on a second, low-priority stream: 0 or 1 (1) */
    int side_band;  /* the overlapped push in two launches, the next flush's band first:
                       -1 auto = with the SM partition, 0 or 1 (-1) */
    int far_async;  /* the overlapped pushes load with cp.async: 0 or 1 (1) */
    int push_split; /* critical-path pushes in 2 x 2 parts per target tile (2) or whole (1) */
    int push_group; /* far pushes every this many tile anti-diagonals, 0..64 (4; 0 = eager) */
    int partition;  /* SMs kept free of the side stream: -1 auto, 0 none, 1..4096 (-1) */
    int push_mma;   /* fp32 pushes on tensor cores (3xTF32 mma.sync, fp32 accumulation): 0 none,
                       1 the far pushes (side stream and non-overlapped flush), 2 every push
                       (critical path too); fp64 never (1) */
    int solve_chain; /* tile solve step chain (solve_wc 16 and 8): 0 the
                        session-14 layout and schedule, 1 conflict-free shared layouts of the
                        factors and the next step's active slot updated and rounded first
                        (session 19); the codes are the same bit for bit (1) */
} bk_cuda_tuning;

void bk_cuda_tuning_default(bk_cuda_tuning *t);
/* Check t (BK_ERR_INVALID_ARG naming the field and its accepted values). */
bk_status bk_cuda_tuning_check(const bk_cuda_tuning *t);

/* Implemented in cuda/ in builds with the CUDA backend. b->params is set. */
bk_status bk_cuda_backend_init(bk_backend *b);
/* Replace the solver variants of a CUDA backend (dev harness and tests only);
 * BK_ERR_INVALID_ARG for another backend or a bad value. */
bk_status bk_cuda_backend_tune(bk_backend *b, const bk_cuda_tuning *t);
int bk_cuda_count_devices(void);
/* The 16-byte UUID of CUDA device `device` (distinct for every physical GPU):
 * 1, or 0 when it cannot be read. */
int bk_cuda_device_uuid(int device, unsigned char uuid[16]);
/* The UUID of backend b's device: 1 for a CUDA backend, else 0 (CPU). */
int bk_backend_device_uuid(const bk_backend *b, unsigned char uuid[16]);
#ifdef __cplusplus
}
#endif

#endif /* BK_BACKEND_IMPL_H */
