/* bakron — the whole-model jobs: quantize a checkpoint layer by layer, and
 * dump calibration activations (docs/activations.md).
 */
#ifndef BAKRON_PIPELINE_H
#define BAKRON_PIPELINE_H

#include <stdint.h>

#include "bakron/backend.h"
#include "bakron/backward.h"
#include "bakron/hessian.h"
#include "bakron/solver.h"
#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum bk_export_format {
    BK_EXPORT_NATIVE = 0,   /* codes + scales (docs/formats.md "bakron native") */
    BK_EXPORT_DEQUANTIZED,  /* ordinary checkpoint, dequantized weights in the original dtype */
    BK_EXPORT_GPTQ          /* GPTQ v1 packed int32 (transformers / vLLM "gptq") */
} bk_export_format;

const char *bk_export_name(bk_export_format f);
bk_status bk_export_from_name(const char *name, bk_export_format *out);

/* Progress events, delivered to the callback as they happen. */
typedef enum bk_event_kind {
    BK_EV_START = 0,   /* job parameters known */
    BK_EV_LAYER_BEGIN,
    BK_EV_MODULE_DONE, /* one linear module quantized */
    BK_EV_LAYER_DONE,
    BK_EV_WRITE,       /* output being written */
    BK_EV_DONE,
    BK_EV_NOTE,        /* something the user should know (message): a stale lock cleared,
                          a killed run's leftover removed, a run resumed */
    BK_EV_BACKWARD,    /* a pass of the backprop flow begins (message: layers, depth) */
    BK_EV_BACKWARD_PROGRESS /* a micro-batch of the running pass is done (pass_seqs_done of
                               pass_seqs); one per micro-batch: a consumer thins them out */
} bk_event_kind;

typedef struct bk_event {
    bk_event_kind kind;
    int layer, n_layers;         /* current layer, total layers to process */
    const char *module;          /* "self_attn.q_proj" (MODULE_DONE) */
    int64_t rows, cols;          /* module shape */
    double loss, loss_gptq;      /* proxy losses of the module (MODULE_DONE) */
    double damp_a, damp_b;
    double elapsed_s, eta_s;
    double t_forward, t_hessian, t_factor, t_solve, t_io; /* cumulative stage times */
    const char *message;         /* free text (START / WRITE / DONE) */
    int layers_kept;             /* --resume: layers the interrupted run finished (not redone;
                                    elapsed_s and eta_s count this run's work only) */
    /* the backprop kinds (every event while the flow runs; 0 otherwise): the
     * pass running or last begun (1-based) of the flow's passes, and the
     * sequences of that pass done (this process's share). eta_s is then the
     * work left (every pass's layer forwards, backwards and head, and the
     * leaf layers' stages, from bk_bwd_flow_schedule) at the unit times
     * measured so far (constants before the first measurement; eta_s < 0:
     * nothing measured yet), not the layer count's extrapolation; work_done:
     * the share of the run's work done, 0..1. */
    int pass, passes;
    int64_t pass_seqs_done, pass_seqs;
    double work_done;
} bk_event;

typedef void (*bk_event_fn)(void *user, const bk_event *ev);

struct bk_dist; /* bakron/dist.h */

/* Arithmetic of the backward passes on a GPU (--bwd-precision; docs/hessians.md). */
typedef enum bk_bwd_precision {
    BK_BWD_FP32 = 0, /* F32 storage, IEEE F32 GEMMs, double reductions */
    BK_BWD_FP64 = 1, /* double throughout (parity with the CPU oracle) */
    BK_BWD_TF32 = 2, /* F32 storage, GEMMs on TF32 tensor cores */
    BK_BWD_BF16 = 3, /* BF16 boundary matrices and weights, GEMMs on BF16 tensor cores (F32
                        accumulation) */
    BK_BWD_AUTO = 4  /* a request only, resolved once per job (bk_bwd_precision_resolve):
                        never reaches the flow, its memory model or run.json; the
                        default of bk_quantize_opts_default since session 16 */
} bk_bwd_precision;

/* "fp32", "fp64", "tf32", "bf16", "auto" (bk_bwd_precision's order); NULL for a
 * value out of range. */
const char *bk_bwd_precision_name(bk_bwd_precision p);
bk_status bk_bwd_precision_from_name(const char *name, bk_bwd_precision *out);

/* --bwd-precision auto, resolved (a pure function; bk_quantize and
 * bk_quantize_check call it once per job): a value other than BK_BWD_AUTO is
 * returned as it is; auto is BK_BWD_BF16 when the backward flow runs on the
 * GPU (gpu_flow) and the forward's GEMMs resolved to BF16 (fwd_math, after
 * bk_gemm_math_resolve: a BF16 checkpoint with --gpu-math auto, or --gpu-math
 * bf16), else BK_BWD_FP32 (the CPU's flow runs in double whatever the value). */
bk_bwd_precision bk_bwd_precision_resolve(bk_bwd_precision want, int gpu_flow,
                                          bk_gemm_math fwd_math);

/* How the ranks of an MPI job combine their Hessian sums (docs/DISTRIBUTED.md). */
typedef enum bk_dist_reduce {
    BK_DIST_ORDERED = 0, /* the sums are passed from rank to rank, each adding its sequences:
                            the single process's summation order, bit-identical output; the
                            stages' forward passes and Hessian adds do not overlap */
    BK_DIST_SUM          /* every rank sums its sequences at once, the partial sums are added
                            in rank order: parallel, differs from one process by rounding */
} bk_dist_reduce;

typedef struct bk_quantize_opts {
    const char *model_dir;
    const char *calib_path;       /* token ids (.safetensors with input_ids), or NULL */
    const char *calib_text;       /* plain text (a file or a folder) tokenized with the model's
                                     tokenizer.json (bk_load_text_tokens), or NULL */
    const char *activations_dir;  /* pre-dumped activations, or NULL */
    const char *out_dir;
    bk_hessian_kind hessian;
    bk_solve_opts solve;          /* algorithm, precision, quantizer, damping */
    int64_t samples;              /* 0 = all sequences */
    int64_t seqlen;               /* 0 = as in the file (text: bk_text_default_seqlen) */
    int layer_begin, layer_end;   /* quantize layers [begin, end); end <= 0 = all */
    int sequential;               /* 1 (default): each module sees the quantized ones before it */
    int hessian_fp64;             /* accumulate Hessians in double */
    int64_t batch;                /* micro-batch (sequences), 0 = automatic */
    bk_export_format export_format;
    uint64_t max_shard_bytes;     /* 0 = 5 GB */
    int overwrite;                /* replace a non-empty OUT_DIR */
    bk_backend_kind backend;
    bk_backend_params backend_params; /* settings of the backend (bk_quantize_opts_default:
                                     bk_backend_params_default) */
    const char *config_path;      /* preset that was applied (recorded in the report) */
    bk_event_fn on_event;
    void *user;
    int gpu_pipeline;             /* 1: insist on the forward pass and Hessians on the GPU
                                     (an error when that is impossible); with the CUDA backend
                                     and --calib they run there anyway unless cpu_stages */
    int cpu_stages;               /* 1: forward pass and Hessians on the CPU even with the CUDA
                                     backend (the solves still run there; the reference) */
    double damp_b_attn;           /* >= 0: relative damping of the q/k/v output factors (the
                                     attention-local B of the fully-local kinds) instead of
                                     solve.damp / solve.damp_b; < 0 (default): not separate */
    bk_gemm_math gemm_math;       /* GPU stages' GEMM arithmetic (bk_quantize_opts_default: auto =
                                     bf16 for BF16 checkpoints, else tf32) */
    /* backprop kinds (bakron/backward.h) */
    bk_fisher_kind fisher;        /* labels: model (default) or empirical */
    uint64_t seed;                /* seed of the sampled labels (default 0) */
    bk_bwd_flow_kind bwd_flow;    /* halving (default) or naive */
    int leaf_size;                /* layers per leaf of the flow (default 0: the GPU flow
                                     beside the GPU stages takes the largest of 8/4/2/1 that
                                     fits in the device memory, bk_bwd_auto_leaf; else 1) */
    int bwd_boundaries;           /* boundary matrices the halving flow may hold at once
                                     (bk_bwd_flow_opts.units): -1 (bk_quantize_opts_default)
                                     auto, from the host's available memory; 0 recursive
                                     halving (the fewest); N: at most N (not fewer than
                                     halving needs). Several MPI ranks: halving. Outside
                                     -1..4096, or N > 0 with BK_FLOW_NAIVE: BK_ERR_USAGE */
    /* MPI ranks (bakron/dist.h); NULL: one process */
    struct bk_dist *dist;
    bk_dist_reduce dist_reduce;
    bk_bwd_precision bwd_precision; /* the backward pass on the GPU (CUDA backend without
                                     cpu_stages): BK_BWD_FP32 F32 storage, IEEE F32 GEMMs,
                                     double reductions; BK_BWD_FP64 double (parity with the
                                     CPU's); BK_BWD_TF32 F32 storage, GEMMs on TF32 tensor
                                     cores; BK_BWD_BF16 BF16 boundaries, GEMMs on BF16 tensor
                                     cores; BK_BWD_AUTO (bk_quantize_opts_default) bf16 when
                                     the flow runs on the GPU and the forward's GEMMs resolve
                                     to BF16, else fp32 (bk_bwd_precision_resolve). The CPU's
                                     flow is always double. */
    int resume;                   /* continue a killed run of the same OUT_DIR from its work
                                     folder (README --resume, docs/formats.md "Work folder") */
} bk_quantize_opts;

void bk_quantize_opts_default(bk_quantize_opts *o);

/* Quantize a model. The output folder is built under a temporary name and
 * renamed into place only when complete; on any failure (or interruption,
 * see bk_request_stop) nothing is left under OUT_DIR (a runtime failure after
 * finished layers keeps the work folder for o->resume). */
bk_status bk_quantize(const bk_quantize_opts *o);

/* ------------------------------------------------ checks before the work */

/* What a quantize job would do, from its options and the model's files alone
 * (nothing is computed): filled by bk_quantize_check, printed by --dry-run. */
typedef struct bk_quantize_plan {
    int model_ok;                   /* the model folder opened and cross-checked */
    bk_model_config cfg;            /* its config (when model_ok) */
    const char *model_dtype;        /* dtype of the linear weights ("BF16", ...) */
    int layers_total;               /* the model's depth */
    int layer_begin, layer_end;     /* layers quantized: [begin, end), numbered from 0 */
    int64_t S, T;                   /* calibration sequences x tokens (0 x 0: none) */
    struct {
        int64_t rows, cols;         /* [out, in] */
        int two_sided;              /* Hessian A ⊗ B with B != I */
    } modules[BK_MOD_COUNT];
    uint64_t input_bytes;           /* tensor bytes of the checkpoint */
    uint64_t output_bytes;          /* estimated size of the output folder */
    uint64_t host_bytes;            /* estimated peak host memory of the job */
    uint64_t free_bytes;            /* free space where the output goes (0: unknown) */
    /* the backprop kinds: where the backward flow is expected to run (the GPU:
     * --backend cuda, or auto with a GPU present, without --cpu-stages) and
     * --bwd-precision as the job will resolve it (never BK_BWD_AUTO);
     * bwd_precision_auto: it came from auto */
    int bwd_gpu;
    bk_bwd_precision bwd_precision;
    int bwd_precision_auto;
} bk_quantize_plan;

/* Called once per failed check; the message is bk_last_error(). */
typedef void (*bk_check_fn)(void *user, bk_status st);

/* Every check bk_quantize makes before its first layer, without stopping at
 * the first failure and without side effects (no lock, no folder created):
 * required options and their conflicts (usage, BK_ERR_USAGE), the model
 * folder, the layer range, the export's shape rules (GPTQ: dimensions
 * divisible by 32 and by the group size), the calibration file or activation
 * folder, config.json as the output will re-read it, the output folder
 * (safe, not an existing non-empty folder without overwrite, writable) and its
 * free space against the estimated output size. Each failure goes to
 * report(user, status); returns BK_OK when none failed, else the status of
 * the first. `plan` (may be NULL) receives what is known. */
bk_status bk_quantize_check(const bk_quantize_opts *o, bk_quantize_plan *plan,
                            bk_check_fn report, void *user);

typedef struct bk_dump_opts {
    const char *model_dir;
    const char *calib_path;
    const char *out_dir;
    int64_t samples, seqlen, batch;
    int zstd;                     /* write layer.NNNN.safetensors.zst */
    int zstd_level;
    bk_dtype dtype;               /* F32 (default), BF16 or F16 */
    int overwrite;
    bk_event_fn on_event;
    void *user;
    bk_backend_kind backend;      /* auto (default: the GPU when present), cpu or cuda: where the
                                     forward pass runs */
    bk_backend_params backend_params; /* settings of the backend (bk_dump_opts_default:
                                     bk_backend_params_default) */
    bk_gemm_math gemm_math;       /* GPU GEMM arithmetic (default fp32: the CPU's values) */
} bk_dump_opts;

void bk_dump_opts_default(bk_dump_opts *o);

/* Full-precision forward over the calibration tokens, writing the inputs of
 * every linear module per layer (docs/activations.md). */
bk_status bk_dump_activations(const bk_dump_opts *o);

/* bakron merge: assemble the outputs of layer-range runs (quantize
 * --activations DIR --layers A:B) into the checkpoint one full run writes,
 * byte for byte (report.json: the parts' modules and times merged). Refused
 * (bad input): ranges that overlap or leave layers out, parts made with
 * different settings, model or calibration, parts made from --calib tokens
 * with the sequential flow (their inputs depend on the layers before). */
typedef struct bk_merge_opts {
    const char *const *parts;     /* the part output folders, any order */
    int n_parts;
    const char *out_dir;
    int overwrite;
    uint64_t max_shard_bytes;     /* 0 = 5 GB (give the parts' --max-shard-size) */
    bk_event_fn on_event;         /* NOTE and DONE events */
    void *user;
} bk_merge_opts;

void bk_merge_opts_default(bk_merge_opts *o);
bk_status bk_merge(const bk_merge_opts *o);

/* Ask a running job to stop at the next module boundary (async-signal-safe);
 * the job then returns BK_ERR_INTERRUPTED and removes its temporary output. */
void bk_request_stop(void);

/* Read calibration token ids: an I32/I64 tensor `input_ids` [sequences,
 * seqlen] in a safetensors file. samples/seqlen > 0 take the first N
 * sequences / T tokens. Checks 0 <= id < vocab. *tokens is malloc'd. */
bk_status bk_load_tokens(const char *path, int64_t vocab, int64_t samples, int64_t seqlen,
                         int32_t **tokens, int64_t *S, int64_t *T);

/* Calibration windows from plain text (a file, or every file under a folder),
 * tokenized with MODEL_DIR/tokenizer.json (bakron/tokenizer.h) as
 * scripts/tokenize.py does: documents sorted by path, each followed by the
 * tokens of "\n\n", concatenated, cut into consecutive windows of seqlen
 * tokens that start with bos_id (< 0: no BOS); the first `samples` windows
 * (0 = all). Checks 0 <= id < vocab. *tokens is malloc'd [S, T = seqlen].
 * No tokenizer.json -> BK_ERR_CALIB naming it. */
/* Window length for text when none is given: 2048, or max_positions when
 * that is smaller (and positive). */
int64_t bk_text_default_seqlen(int64_t max_positions);

bk_status bk_load_text_tokens(const char *model_dir, const char *text_path, int64_t vocab,
                              int64_t bos_id, int64_t samples, int64_t seqlen, int32_t **tokens,
                              int64_t *S, int64_t *T);

#ifdef __cplusplus
}
#endif
#endif /* BAKRON_PIPELINE_H */
