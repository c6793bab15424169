/* The quantization job (internal): its state and the pieces the files of
 * bk_quantize share. Who holds what:
 *   src/pipeline.c             the job: checks, calibration, backend, the
 *                              layer driver's setup, output commit (bk_quantize)
 *   src/quantize_writer.c      the output plan and the writer thread (packing
 *                              and writing overlapped with the next solve), the
 *                              journal of finished layers
 *   src/quantize_solve.c       one module's solve, its report entry and event
 *   src/quantize_layers.c      the layer driver's bodies: the stages and solves
 *                              of one layer, the resume rebuild, --activations
 *   src/quantize_ranks.c       MPI ranks, data parallel (Hessian sums, solves
 *                              shared)
 *   src/quantize_backprop.c    the backprop kinds: the backward flow drives the
 *                              layers
 *   src/quantize_report.c      config.json, quantization_config, report.json
 * The layer driver (src/layer_driver.c) and the read-ahead (src/prefetch.c)
 * serve eval and dump-activations too. */
#ifndef BK_QUANTIZE_JOB_H
#define BK_QUANTIZE_JOB_H

#include <pthread.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "bakron/bakron.h"
#include "bakron/pipeline.h"
#include "backend_impl.h"
#include "backward_internal.h"
#include "bwd_mem.h"
#include "layer_driver.h"
#include "outdir.h"
#include "pipeline_internal.h"
#include "resume.h"

typedef struct job {
    const bk_quantize_opts *o;
    bk_model *model;
    const bk_model_config *cfg;
    bk_backend *backend;
    bk_st_stream *out;
    bk_outdir od; /* the output folder: lock, work folder (od.work), commit */
    int layer_begin, layer_end;
    bk_resume *rs;   /* journal of finished layers (src/resume.c) */
    int first_layer; /* first layer to quantize: layer_begin, or after the kept ones */
    /* calibration */
    int32_t *tokens;
    int64_t S, T, N, batch;
    bk_act_reader *acts;
    /* the stages on one micro-batch (bk_backend_stages_create): the
     * backend's own (own_stages: the GPU's, cuda/pipeline_cuda.cu) or the
     * CPU implementation (src/backend_cpu_stages.c); they hold the forward
     * state, the buffers and the Hessian accumulators */
    const bk_stage_ops *ops;
    void *ops_ctx;
    int own_stages;
    int fully;                          /* fully-local Hessian: FP queries/keys in stage 1 */
    /* report */
    cJSON *report_modules;
    double t0, t_forward, t_hessian, t_factor, t_solve, t_io;
    int64_t quantized_params;
    bk_gemm_math gemm_math; /* the GPU stages' arithmetic (auto resolved) */
    int bwd_auto;           /* --bwd-precision auto was given (o->bwd_precision: resolved) */
    /* MPI ranks (docs/DISTRIBUTED.md): this rank's sequences [s_lo, s_hi) (all
     * of them in one process); agreed: the failure is known to every rank */
    bk_dist *dist;
    int rank, nranks, agreed;
    int64_t s_lo, s_hi;
    /* the stages' sums and solved weights go through ops->sums /
     * ops->share_weight; dev_coll: as device buffers (NCCL), else host
     * buffers or host copies over MPI */
    int dev_coll;
    const char *coll_desc;
    char coll_text[320];        /* coll_desc when composed (the GPU stages and backward flow) */
    int64_t *rank_peak;         /* [nranks] every rank's peak resident bytes (report.json) */
    /* backprop kinds: one accumulator per layer of a leaf of the flow
     * (j->acc points at the one of the layer being quantized; the stages get
     * it with bp_grads) */
    int bp;
    int bp_leaf;                /* leaf size */
    int bp_units;               /* the flow's boundary budget (bk_bwd_flow_opts.units:
                                   from the host's memory, bp_host_check; 0 halving) */
    bk_hess_acc **bp_acc;       /* [bp_leaf] */
    bk_hess_acc *acc;
    struct bp_dev {             /* [bp_leaf]: the GPU flow's device Grams of the leaf
                                   (grams_dev), for the GPU stages */
        const double *G[BK_MOD_COUNT], *gw[BK_MOD_COUNT];
        int64_t N;
        int layer;
    } *bp_dev;
    int bp_leaf_lo;             /* first layer of the current leaf */
    bk_bwd_flow_stats bp_stats;
    bk_bwd_host_plan bp_host;   /* the flow's host memory, planned before it starts
                                   (bp_host_check in pipeline.c; report.json) */
    double bp_time_counted;     /* flow time already added to t_forward */
    /* MPI ranks, ordered sums: where this rank is in the current leaf's pass
     * of the output-gradient sums from rank to rank (quantize_ranks.c) */
    int bp_recvd, bp_sent, bp_in_layers;
    bk_status bp_chain_st;      /* a failed receive, returned at the next tap */
    /* progress of the backprop kinds (quantize_backprop.c bk__q_bp_progress):
     * the flow's schedule, the pass running, and the work per kind of unit
     * (BP_U_*: layer forwards, layer backwards, heads, quantized leaf layers'
     * stages, other leaf layers) in all and done, with the time spent on the
     * done units (the leaf layers'; the flow's are in bp_stats) */
    bk_bwd_pass_work *bp_sched;
    int bp_npass, bp_pass;
    int64_t bp_pass_done;
    double bp_total[6], bp_done[6], bp_time[6];
    double bp_bwd_split[2];     /* backward time of finished split / leaf passes */
    double bp_bwd_mark;         /* the flow's backward time when the running pass began */
    int bp_cur_leaf;            /* the running pass is a leaf's */
    double bp_lt0;              /* start of the leaf layer's stages not yet counted */
    int bp_layer_counted;       /* the current leaf layer was counted at its LAYER_DONE */
    int bp_gpu;                 /* the flow (forward + backward passes) on the GPU
                                   (cuda/backward.cu); the input-side stages are j->ops
                                   (the GPU stages unless --setting bwd_input=cpu) */
    /* output writer: quantized modules are packed and written by a helper
     * thread while the next modules are solved and the next stages run (a
     * queue of at most WQ_CAP results holding at most cap_bytes of host
     * memory, one result whatever its size) */
    struct {
        pthread_t tid;
        int started, stop, failed;
        pthread_mutex_t mu;
        pthread_cond_t cv;
        struct wjob {
            int layer;
            bk_module mod;     /* BK_MOD_COUNT: the layer is complete (journal it);
                                  with layer -1: the tensors passed through */
            bk_solve_result r;
            char *entries;     /* the layer's report entries (journal) */
        } q[32]; /* WQ_CAP */
        int head, count;
        uint64_t bytes, cap_bytes; /* host memory held by the queued results, its bound */
        bk_status st;
        char msg[1024];
        double busy_s; /* time spent writing (overlapped) */
        long nwrites;  /* module writes attempted (fault injection) */
    } wr;
    /* the layer driver (src/layer_driver.c): the embedding, then every layer
     * with its weights (the next one read on a helper thread meanwhile) */
    bk_layer_driver drv;
    /* every matrix of the checkpoint is BF16 in the mapping
     * (bk_model_linears_mapped_bf16): the driver may hand layers over as BF16
     * (bk__q_layer_bf16) */
    int mapped_bf16;
} job;

/* The micro-batches of this rank's sequences [s_lo, s_hi) (all sequences in
 * one process). */
#define MB_LOOP(j, s0, sb) BK_MB_LOOP((j)->s_lo, (j)->s_hi, (j)->batch, s0, sb)

static inline int bk__q_in_range(const job *j, int l)
{
    return l >= j->layer_begin && l < j->layer_end;
}

/* src/pipeline.c: progress events (the caller's on_event). */
void bk__q_emit(job *j, bk_event_kind kind, int layer, const char *module, const char *msg);
/* the backprop kinds: the pass fields, eta_s and work_done of an event (and,
 * at a quantized layer's LAYER_DONE, that layer's stages counted as done) */
void bk__q_bp_progress(job *j, bk_event *ev);
void bk__q_emit_module(job *j, int layer, bk_module mod, const bk_solve_result *r,
                       double loss_gptq);
void bk__q_note(void *user, const char *msg);

/* src/quantize_writer.c */
bk_status bk__q_declare_outputs(job *j);
bk_status bk__q_write_passthrough(job *j);
bk_status bk__q_writer_put(job *j, int layer, bk_module mod, bk_solve_result *r, char *entries);
void bk__q_writer_start(job *j);
/* The tensors passed through (bk__q_write_passthrough) as the writer
 * thread's first work item, overlapping the first layer; without a writer
 * thread, written here. Only where nothing else writes the output on the
 * calling thread meanwhile (token calibration) and no journaled layer is
 * being restored (their digests are read before the writer starts). */
bk_status bk__q_writer_put_passthrough(job *j);
bk_status bk__q_writer_finish(job *j, int abandon);
bk_status bk__q_writer_drain(job *j);
bk_status bk__q_journal_layer(job *j, int l);

/* src/quantize_solve.c: a module's solve, before it is applied (MPI ranks:
 * computed by one rank, applied by all). */
typedef struct bk_q_solved {
    bk_solve_result r;
    double loss_gptq;
    int alg, two_sided;
} bk_q_solved;
/* next: the module solved right after mod from the same sums (-1: none);
 * the stages' prepare_next hears of it between mod's factors and its solve. */
bk_status bk__q_solve_compute(job *j, int layer, bk_module mod, int next,
                              const bk_layer_weights *orig, bk_q_solved *sv);
bk_status bk__q_solve_apply(job *j, int layer, bk_module mod, bk_layer_weights *lw,
                            bk_q_solved *sv);
bk_status bk__q_solve_module(job *j, int layer, bk_module mod, int next, bk_layer_weights *lw,
                             const bk_layer_weights *orig);

/* src/quantize_layers.c */
bk_status bk__q_weights_copy(const bk_model_config *c, const bk_layer_weights *src,
                             bk_layer_weights *dst);
bk_status bk__q_layer_body(void *user, int l, bk_layer_weights *w);
/* The layer driver's form of layer l (1: BF16, src/layer_driver.h's bf16). */
int bk__q_layer_bf16(void *user, int l);
bk_status bk__q_offline_body(void *user, int l, bk_layer_weights *w);

/* src/quantize_ranks.c */
/* This rank's micro-batches: a contiguous share, the single process's
 * boundaries (one process: all sequences). */
bk_status bk__q_split_ranks(job *j);
/* The backend's own (GPU) stages with several ranks: the agreed micro-batch
 * (*batch) and how device buffers are exchanged (the CPU stages: host
 * buffers over MPI). */
bk_status bk__q_dev_stages_ranks(job *j, int64_t *batch);
/* The modules whose Hessians stage `stage` accumulates (bit per module). */
unsigned bk__q_stage_modules(bk_stage stage);
bk_status bk__q_sync(job *j, bk_status st);
bk_status bk__q_stage_ranks(job *j, bk_stage stage);
/* Every rank's peak resident set so far (getrusage) into j->rank_peak, for
 * report.json's mpi section; a status exchange first (call it where every
 * rank arrives in the same order). */
bk_status bk__q_rank_peaks(job *j);
/* Backprop kinds over MPI ranks: the output-gradient sums of the leaf
 * [lo, hi) (its layers in range). bk__q_bp_leaf_begin: ordered, receive the
 * sums of the ranks before (at the leaf's pass, before this rank's taps);
 * bk__q_bp_leaf_sums: pass them on, agree, make the sums known to every
 * rank; bk__q_bp_chain_fail: after a failure in the flow, keep the pass from
 * rank to rank going (the others wait on it), then the status exchange
 * tells every rank. */
void bk__q_bp_leaf_begin(job *j, int lo, int hi);
bk_status bk__q_bp_leaf_sums(job *j, int lo, int hi);
void bk__q_bp_chain_fail(job *j, bk_status why);
bk_status bk__q_solve_group(job *j, int l, int m0, int m1, bk_layer_weights *lw,
                            const bk_layer_weights *orig);

/* src/quantize_backprop.c */
bk_status bk__q_run_backprop(job *j);

/* src/quantize_report.c */
bk_status bk__q_write_metadata(job *j);

#endif
