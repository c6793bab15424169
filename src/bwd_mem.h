/* Device-memory model of the GPU backward flow (cuda/backward.cu) and of the
 * GPU stages' reserve (cuda/pipeline_cuda.cu): pure functions, so the
 * micro-batch choice can be checked on the CPU (tests/test_bwd_mem.c).
 * Every buffer the flow allocates with dalloc is counted here; a change of
 * those allocations must change this model (the GPU test cuda_backward
 * compares the model with the flow's micro_batch_device_bytes). */
#ifndef BK_BWD_MEM_H
#define BK_BWD_MEM_H

#include <stdint.h>

#include "bakron/model.h"
#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bk_bwd_mem_params {
    int flow;      /* BK_FLOW_HALVING / BK_FLOW_NAIVE */
    int leaf;      /* --leaf-size */
    int precision; /* BK_BWD_FP32 / _FP64 / _TF32 / _BF16 */
    int grams;     /* the output-gradient Grams are formed on the device (the job's GPU flow) */
    int grams_dev; /* ... and stay there for the GPU stages (one process) */
    int shampoo;   /* token weights of the Grams kept (backprop-shampoo with grams_dev) */
    int units;     /* the flow's boundary budget (bk_bwd_flow_opts.units; 0: halving) */
    int leaf_max;  /* out (the GPU stages, bk_gpu_stages_create): the largest leaf whose
                      Grams the device holds beside the rest (bk_bwd_max_leaf); 0: none */
} bk_bwd_mem_params;

/* Layer inputs a micro-batch keeps (bk__bwd_flow_check's rule): the flow
 * of n_layers L, leaf and boundary budget (bk_bwd_flow_opts.units; _b with
 * budget 0 is recursive halving). */
int64_t bk_bwd_acts_layers(int64_t L, int flow, int leaf);
int64_t bk_bwd_acts_layers_b(int64_t L, int flow, int leaf, int budget);

/* The split tree of the halving flow (src/backward_flow.c, node; docs/hessians.md):
 * a split of [lo, hi) (more than leaf layers) into k >= 2 children at the
 * cuts bk_bwd_cut(lo, hi, k, i) = lo + i (hi - lo) / k, i = 0 .. k. It holds
 * X and G at the k - 1 inner cuts (and the root G_L, the head's gradient);
 * during child j bk_bwd_held(k, j, root) of them are alive. bk_bwd_split
 * picks k: with budget <= 0, 2 (recursive halving, the fewest matrices);
 * else, of the k (at most one child per leaf) whose peak with halving below
 * fits the budget, the one of least work (layer forwards + 2 x backwards)
 * with halving below it; the children widen with what is left, so no tree
 * does more work than halving. The budget counts the split's own matrices
 * and its subtree's (ancestors' not: the caller passes what is left). */
int bk_bwd_cut(int lo, int hi, int k, int i);
int bk_bwd_held(int k, int j, int root);
int bk_bwd_split(int lo, int hi, int leaf, int root, int budget);

/* Device bytes of the flow's buffers for micro-batch B (sequences of T
 * tokens, S sequences), without the weight cache: logits_all 1 when the
 * logits of every vocabulary block are held, 0 for one block. */
uint64_t bk_bwd_dev_bytes(const bk_model_config *c, int64_t B, int64_t T, int64_t S,
                          const bk_bwd_mem_params *p, int logits_all);

/* Device bytes of one layer of the flow's weight cache. */
uint64_t bk_bwd_dev_layer_bytes(const bk_model_config *c, int precision);

/* Device memory the GPU stages keep free next to the calibration states:
 * one layer's F32 weights twice (original + working copy), `squares` F32
 * matrices of the largest factor size and `gib` GiB of margin. */
uint64_t bk_gpu_stage_reserve(const bk_model_config *c, int squares, int gib);

/* Layers the flow's weight cache holds when it sizes itself (slot count 0):
 * half of the available memory and no more than leaves `reserve` (the leaf
 * layers' GPU stages run while the flow holds its memory), between 1 and
 * L. */
int bk_bwd_cache_layers(const bk_model_config *c, int precision, uint64_t avail,
                        uint64_t reserve);

/* The GPU stages' micro-batch when the backprop flow runs beside them: the
 * largest B in [1, want] with stage_per_seq * B + the flow's bytes at B (one
 * logit block) + `cache_min` cached layers + reserve <= avail; 0 when not
 * even B = 1 fits. */
int64_t bk_bwd_fit_batch(const bk_model_config *c, int64_t T, int64_t S,
                         const bk_bwd_mem_params *p, int64_t want, uint64_t avail,
                         uint64_t stage_per_seq, uint64_t reserve, int cache_min);

/* The leaf size when the user gave none (--leaf-size, bk_quantize_opts 0):
 * the largest of 8, 4, 2 (at most L / 2) with which the stages' bytes
 * `stage_bytes`, their `reserve`, the flow at micro-batch B (one logit
 * block) and the weight cache of all L layers fit in 7/8 of `avail` (an
 * eighth for what the model does not count: the stages' accumulators,
 * allocator rounding, cuBLAS workspaces); else 1. A
 * larger leaf means fewer passes (recursive halving: log2(L / s) levels)
 * and s layers' Grams held at once; it does not change the result. */
int bk_bwd_auto_leaf(const bk_model_config *c, int64_t T, int64_t S, const bk_bwd_mem_params *p,
                     int64_t B, uint64_t avail, uint64_t stage_bytes, uint64_t reserve);

/* The largest leaf s in [1, L] (any, not only 8/4/2) that fits as
 * bk_bwd_auto_leaf counts it; 0 when not even 1 does. The bound of the host
 * check's --leaf-size suggestion in the GPU flow. */
int bk_bwd_max_leaf(const bk_model_config *c, int64_t T, int64_t S, const bk_bwd_mem_params *p,
                    int64_t B, uint64_t avail, uint64_t stage_bytes, uint64_t reserve);

/* ------------------------------------------------ host memory of the flows
 *
 * The boundary matrices of recursive halving (src/backward_flow.c, node):
 * a split of [lo, hi) allocates X_mid and G_mid [N, hidden], and the root
 * also G_L (the head's gradient); G_mid is freed after the left child,
 * X_mid and G_L after the right one. bk_bwd_boundary_units walks the same
 * recursion: the most matrices alive at once (0: naive, or leaf >= L).
 * Elements are the flow's boundary type: 8 bytes on the CPU (double); on
 * the GPU 4 at fp32 / tf32 (F32), 8 at fp64, 2 at bf16 (BF16: the GPU flow
 * rounds h and dh to BF16 at every layer boundary in that mode). */
int bk_bwd_boundary_units(int64_t L, int flow, int leaf);
/* ... of the flow with a boundary budget (bk_bwd_flow_opts.units) */
int bk_bwd_boundary_units_b(int64_t L, int flow, int leaf, int budget);

/* units x N x hidden x elem_bytes: the flow's stats.peak_boundary_bytes */
uint64_t bk_bwd_boundary_peak_bytes(int64_t L, int flow, int leaf, int64_t N, int64_t hidden,
                                    int elem_bytes);
uint64_t bk_bwd_boundary_peak_bytes_b(int64_t L, int flow, int leaf, int budget, int64_t N,
                                      int64_t hidden, int elem_bytes);

/* What the flow will hold in host memory, planned before it starts. */
typedef struct bk_bwd_host_plan {
    int units;                /* boundary matrices alive at the peak */
    int budget;               /* the flow's boundary budget (bk_bwd_host_plan_widen; 0: halving) */
    int elem_bytes;
    uint64_t boundary_bytes;  /* their bytes (bk_bwd_boundary_peak_bytes) */
    uint64_t copies_budget;   /* the layers' host copies (F32; BF16 matrices in the GPU
                                 flow's bf16 mode, none when mapped): GPU flow, half of
                                 avail (cuda/backward.cu hbudget); CPU flow, every layer */
    uint64_t layer_bytes;     /* one layer's copy (bk_bwd_host_layer_bytes) */
    int copies_kind;          /* the `gpu` argument: BK_BWD_HOST_* */
    uint64_t copies_bytes;    /* the copies held: min(L, budget / layer) layers */
    uint64_t margin;          /* avail / 8: what the plan does not count (the leaf
                                 layers' accumulators, the stages, allocator rounding) */
    uint64_t need;            /* boundary + copies + margin */
    uint64_t avail;           /* the host's available memory (0: unknown) */
} bk_bwd_host_plan;

/* What the flow keeps of each layer on the host (the `gpu` argument below):
 * the CPU flow's F32 copies of every layer; the GPU flow's F32 copies under
 * its budget (fp32 / tf32 / fp64); its bf16 mode's BF16 copies of the
 * matrices (checkpoint not BF16), or its bf16 mode reading BF16 matrices
 * straight from the mapped checkpoint (only biases and norms copied). */
enum {
    BK_BWD_HOST_CPU = 0,
    BK_BWD_HOST_GPU_F32 = 1,
    BK_BWD_HOST_GPU_BF16 = 2,
    BK_BWD_HOST_GPU_MAPPED = 3
};

/* The host side of the flow for its arithmetic (a pure rule, pipeline.c's
 * host check and boundary budget): *elem_bytes of the boundary matrices (the
 * CPU flow: 8, double; the GPU flow: 8 fp64, 2 bf16 (h and dh rounded to
 * BF16 at every boundary), else 4) and *copies, the BK_BWD_HOST_* kind of
 * the layers' copies (bf16 with a BF16 checkpoint: read from the mapping,
 * mapped_bf16). precision: a resolved bk_bwd_precision; BK_BWD_AUTO (or
 * any other value) is refused with BK_ERR_INTERNAL: --bwd-precision auto is
 * resolved before any plan (bk_bwd_precision_resolve). */
bk_status bk_bwd_host_kinds(int gpu_flow, int precision, int mapped_bf16, int *elem_bytes,
                            int *copies);

/* host bytes one layer's copy takes in that mode (cuda/backward.cu
 * host_layer_bytes: every module's bias counted): F32 / BF16 copy: the
 * matrices in F32 / BF16, biases and norms in F32; mapped: biases and norms */
uint64_t bk_bwd_host_layer_bytes(const bk_model_config *c, int gpu);

/* The plan of a flow over N = S*T tokens; gpu: BK_BWD_HOST_* (non-zero: the
 * GPU flow, its host budget for the copies; zero: the CPU's). */
void bk_bwd_host_plan_make(const bk_model_config *c, int flow, int leaf, int64_t N,
                           int elem_bytes, int gpu, uint64_t avail, bk_bwd_host_plan *p);

/* BK_OK when the plan fits (need <= avail, or avail unknown); else
 * BK_ERR_NOMEM with one line naming the numbers and what to change: the
 * largest --samples that fits (S sequences of T tokens here, `ranks` MPI
 * ranks each holding its share), the smallest larger --leaf-size that fits
 * and is at most leaf_max (0: L, the CPU flow; the GPU flow: the leaf whose
 * Grams the device holds, bk_bwd_max_leaf, or `leaf` when not known: no
 * --leaf-size suggested), --bwd-flow naive (no boundary matrices). */
bk_status bk_bwd_host_check(const bk_model_config *c, int flow, int leaf, int64_t S, int64_t T,
                            int elem_bytes, int gpu, int ranks, int leaf_max, uint64_t avail,
                            bk_bwd_host_plan *out);

/* The boundary budget a flow of N tokens may widen into (bk_bwd_flow_opts.units):
 * the matrices [N, hidden] that fit in what plan p leaves of its avail after
 * the layers' copies, twice its margin and `reserve` bytes (the page cache
 * the job keeps using: the mapped checkpoint); 0 when avail is unknown.
 * Several MPI ranks share a host's memory: the caller passes 0 for them. */
int bk_bwd_units_budget(const bk_bwd_host_plan *p, int64_t N, int64_t hidden, uint64_t reserve);

/* p's boundary matrices, units and need again for the flow with budget */
void bk_bwd_host_plan_widen(bk_bwd_host_plan *p, const bk_model_config *c, int flow, int leaf,
                            int64_t N, int budget);

#ifdef __cplusplus
}
#endif

#endif
