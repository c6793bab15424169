/* The quantization job (bk_quantize): checks, calibration, the backend and
 * its stages, the layer driver, the output commit. src/quantize_job.h says
 * which file holds the rest. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bwd_mem.h"
#include "hess_blocks.h"
#include "quantize_job.h"
#include "st_internal.h"
#include "util.h"

void bk_quantize_opts_default(bk_quantize_opts *o)
{
    memset(o, 0, sizeof *o);
    o->hessian = BK_HESS_GPTQ;
    bk_solve_opts_default(&o->solve);
    o->gemm_math = BK_GEMM_AUTO;
    o->damp_b_attn = -1.0;
    o->sequential = 1;
    o->fisher = BK_FISHER_MODEL;
    o->seed = 0;
    o->bwd_flow = BK_FLOW_HALVING;
    o->leaf_size = 0; /* chosen from the device memory (GPU flow), else 1 */
    o->bwd_boundaries = -1; /* from the host's available memory */
    /* bf16 on the GPU with BF16 forward GEMMs, else fp32 (resolved once per
     * job, bk_bwd_precision_resolve; session 16's measurement, docs/hessians.md
     * "Arithmetic") */
    o->bwd_precision = BK_BWD_AUTO;
    o->export_format = BK_EXPORT_NATIVE;
    o->backend = BK_BACKEND_AUTO;
    bk_backend_params_default(&o->backend_params);
}

static const char *const bwd_prec_names[] = {"fp32", "fp64", "tf32", "bf16", "auto"};

const char *bk_bwd_precision_name(bk_bwd_precision p)
{
    return (unsigned)p < 5 ? bwd_prec_names[(unsigned)p] : NULL;
}

bk_status bk_bwd_precision_from_name(const char *name, bk_bwd_precision *out)
{
    for (int i = 0; i < 5; i++)
        if (name && !strcmp(name, bwd_prec_names[i])) {
            *out = (bk_bwd_precision)i;
            return BK_OK;
        }
    return bk_error(BK_ERR_INVALID_ARG,
                    "unknown backward precision '%s' (expected fp32, fp64, tf32, bf16 or auto)",
                    name ? name : "");
}

bk_bwd_precision bk_bwd_precision_resolve(bk_bwd_precision want, int gpu_flow,
                                          bk_gemm_math fwd_math)
{
    if (want != BK_BWD_AUTO)
        return want;
    return gpu_flow && fwd_math == BK_GEMM_BF16 ? BK_BWD_BF16 : BK_BWD_FP32;
}

/* An event with what every event carries: the layer, the progress and the
 * times so far. */
static bk_event event_of(const job *j, bk_event_kind kind, int layer, const char *module)
{
    return (bk_event){
        .kind = kind,
        .layer = layer,
        .n_layers = j->layer_end - j->layer_begin,
        .module = module,
        .elapsed_s = bk_now() - j->t0,
        .layers_kept = j->first_layer > j->layer_begin ? j->first_layer - j->layer_begin : 0,
        .t_forward = j->t_forward,
        .t_hessian = j->t_hessian,
        .t_factor = j->t_factor,
        .t_solve = j->t_solve,
        .t_io = j->t_io,
    };
}

void bk__q_emit(job *j, bk_event_kind kind, int layer, const char *module, const char *msg)
{
    if (!j->o->on_event)
        return;
    bk_event ev = event_of(j, kind, layer, module);
    /* (a resumed run: the layers it does itself) */
    int done = layer - j->first_layer + (kind == BK_EV_LAYER_DONE ? 1 : 0);
    int todo = j->layer_end - j->first_layer;
    ev.eta_s = (done > 0 && todo > done) ? ev.elapsed_s / done * (todo - done) : 0;
    ev.message = msg;
    if (j->bp_sched) /* the backprop kinds: from the flow's work */
        bk__q_bp_progress(j, &ev);
    j->o->on_event(j->o->user, &ev);
}

void bk__q_emit_module(job *j, int layer, bk_module mod, const bk_solve_result *r, double loss_gptq)
{
    if (!j->o->on_event)
        return;
    bk_event ev = event_of(j, BK_EV_MODULE_DONE, layer, bk_module_name(mod));
    ev.rows = r->m;
    ev.cols = r->n;
    ev.loss = r->loss_two_sided;
    ev.loss_gptq = loss_gptq;
    ev.damp_a = r->damp_a;
    ev.damp_b = r->damp_b;
    if (j->bp_sched)
        bk__q_bp_progress(j, &ev);
    j->o->on_event(j->o->user, &ev);
}

void bk__q_note(void *user, const char *msg)
{
    bk__q_emit((job *)user, BK_EV_NOTE, 0, NULL, msg);
}

/* ------------------------------------------------------------------- driver */

static void job_free(job *j)
{
    bk_driver_end(&j->drv);
    free(j->tokens);
    if (j->ops)
        j->ops->destroy(j->ops_ctx);
    bk__act_close(j->acts);
    if (j->bp_acc) {
        for (int k = 0; k < j->bp_leaf; k++)
            bk_hess_acc_free(j->bp_acc[k]);
        free(j->bp_acc);
        j->acc = NULL;
    }
    free(j->bp_dev);
    bk_backend_destroy(j->backend); /* (each of these takes NULL) */
    bk_model_close(j->model);
    cJSON_Delete(j->report_modules);
    free(j->rank_peak);
    j->rank_peak = NULL;
    bk_resume_free(j->rs);
    j->rs = NULL;
}


/* The backprop flow's host memory before it starts (issue 16): the
 * boundary matrices of recursive halving at their peak, the layers' host
 * copies and a margin against the host's available memory (MemAvailable):
 * a clear BK_ERR_NOMEM (exit 3) here, not minutes of passes and then a
 * failed allocation or the kernel's OOM killer. MPI ranks: each rank's
 * share (ranks on one host share its memory: not counted). */
/* the flow's boundary elements and the kind of the layers' host copies, for
 * the resolved --bwd-precision (bk_bwd_host_kinds refuses auto) */
static bk_status bp_host_kinds(const job *j, int *es, int *copies)
{
    return bk_bwd_host_kinds(j->bp_gpu, (int)j->o->bwd_precision,
                             j->bp_gpu && j->o->bwd_precision == BK_BWD_BF16 &&
                                 bk_model_linears_mapped_bf16(j->model),
                             es, copies);
}

static bk_status bp_host_check(job *j, int leaf, int leaf_max)
{
    const bk_quantize_opts *o = j->o;
    const int64_t L = j->cfg->n_layers;
    if (leaf > L)
        leaf = (int)L;
    int es, copies;
    bk_status st = bp_host_kinds(j, &es, &copies);
    if (st != BK_OK)
        return st;
    st = bk_bwd_host_check(j->cfg, (int)o->bwd_flow, leaf, j->s_hi - j->s_lo, j->T, es,
                                     copies, j->nranks, leaf_max, bk_host_avail_bytes(),
                                     &j->bp_host);
    if (j->nranks > 1)
        st = bk__q_sync(j, st);
    return st;
}

/* The boundary budget (bk_bwd_flow_opts.units): what the host's memory
 * leaves beside the layers' copies, two margins and the checkpoint's layers
 * (kept for the page cache) lets the flow split wider, into fewer passes
 * (docs/hessians.md "Wider splits"); --bwd-boundaries N caps it. Whatever
 * the leaf (the copies and margins do not depend on it). 0 (halving) with
 * several ranks (a host's ranks share its memory) and for naive I. */
static int bp_budget(const job *j)
{
    const bk_quantize_opts *o = j->o;
    if (j->nranks > 1 || o->bwd_flow == BK_FLOW_NAIVE || o->bwd_boundaries == 0)
        return 0;
    int es, copies;
    if (bp_host_kinds(j, &es, &copies) != BK_OK) /* (bp_host_check reports it) */
        return 0;
    const int64_t N = (j->s_hi - j->s_lo) * j->T;
    bk_bwd_host_plan p;
    bk_bwd_host_plan_make(j->cfg, (int)o->bwd_flow, 1, N, es, copies, bk_host_avail_bytes(), &p);
    const uint64_t reserve =
        (uint64_t)j->cfg->n_layers * bk_bwd_host_layer_bytes(j->cfg, BK_BWD_HOST_GPU_BF16);
    int b = bk_bwd_units_budget(&p, N, j->cfg->hidden, reserve);
    /* (a budget given: at most it, and no more than the memory allows) */
    if (o->bwd_boundaries > 0 && (!p.avail || o->bwd_boundaries < b))
        b = o->bwd_boundaries;
    return b;
}

bk_status bk_quantize(const bk_quantize_opts *o)
{
    job jb, *j = &jb;
    memset(j, 0, sizeof *j);
    j->o = o;
    j->t0 = bk_now();
    bk__stop_clear();
    bk_status st;
    int adopted = 0;
    /* the job's own copy of the options: MPI ranks other than 0 without the
     * callback, --bwd-precision auto resolved (below) */
    bk_quantize_opts own = *o;
    j->dist = o->dist;
    j->rank = bk_dist_rank(o->dist);
    j->nranks = bk_dist_size(o->dist);
    if (j->nranks > 1) {
        if (o->resume)
            return bk_error(BK_ERR_INVALID_ARG,
                            "quantize: --resume with several MPI ranks is not supported (the "
                            "journal of finished layers is a single process's)");
        if (o->activations_dir || !o->calib_path)
            return bk__quantize_layer_ranks(o);
        if (j->rank != 0) /* (rank 0 alone reports and writes) */
            own.on_event = NULL;
    }
    j->o = o = &own;
    if (!bk_bwd_precision_name(o->bwd_precision))
        return bk_error(BK_ERR_INVALID_ARG, "quantize: bwd_precision %d is not a bk_bwd_precision",
                        (int)o->bwd_precision);

    if (!o->model_dir || !o->out_dir)
        return bk_error(BK_ERR_INVALID_ARG, "quantize: model folder and output folder are required");
    if (!!o->calib_path + !!o->calib_text + !!o->activations_dir > 1)
        return bk_error(BK_ERR_INVALID_ARG, "quantize: give one of calibration tokens, text or activations, not several");
    if (!o->calib_path && !o->calib_text && !o->activations_dir && o->hessian != BK_HESS_RTN)
        return bk_error(BK_ERR_INVALID_ARG,
                        "quantize: --hessian %s needs calibration data (--calib-text, --calib or --activations)",
                        bk_hessian_name(o->hessian));

    j->bp = bk_hessian_is_backprop(o->hessian);
    if (j->bp && !o->calib_path && !o->calib_text) {
        st = bk_error(BK_ERR_INVALID_ARG,
                      "quantize: --hessian %s needs calibration tokens (--calib-text or --calib): the "
                      "backward pass runs the model",
                      bk_hessian_name(o->hessian));
        goto fail;
    }
    if (j->bp && o->leaf_size < 0) {
        st = bk_error(BK_ERR_INVALID_ARG, "quantize: --leaf-size %d must be >= 1", o->leaf_size);
        goto fail;
    }
    if (j->bp && (o->bwd_boundaries < -1 || o->bwd_boundaries > 4096)) {
        st = bk_error(BK_ERR_USAGE,
                      "quantize: --bwd-boundaries %d: expected auto (-1) or an integer in "
                      "[0, 4096]",
                      o->bwd_boundaries);
        goto fail;
    }
    if (j->bp && o->bwd_boundaries > 0 && o->bwd_flow == BK_FLOW_NAIVE) {
        st = bk_error(BK_ERR_USAGE,
                      "quantize: --bwd-boundaries %d and --bwd-flow naive contradict each other "
                      "(the naive flow holds no boundary matrices; the budget is the halving "
                      "flow's)",
                      o->bwd_boundaries);
        goto fail;
    }
    if (o->hessian == BK_HESS_BACKPROP_SHAMPOO && j->rank == 0)
        bk__q_emit(j, BK_EV_NOTE, 0, NULL,
                   "warning: backprop-shampoo is unstable on some models (SmolLM2-135M at 2.81 "
                   "bits: worse than gptq on 7 of 10 calibration draws; docs/hessians.md); "
                   "backprop-kfac is the recommended backprop kind");
    if (j->rank == 0) {
        /* the output folder first: refused (unsafe, exists), locked, leftovers cleaned */
        const char *inputs[] = {o->model_dir, o->calib_path ? o->calib_path : "",
                                o->calib_text ? o->calib_text : "",
                                o->activations_dir ? o->activations_dir : "",
                                o->config_path ? o->config_path : "", NULL};
        bk_outdir_spec os = {.out = o->out_dir, .inputs = inputs, .overwrite = o->overwrite,
                             .what = "quantize", .note = bk__q_note, .user = j,
                             .resume = o->resume, .resumable = bk_resume_is_resumable};
        st = bk_outdir_open(&j->od, &os, &adopted);
        if (st != BK_OK)
            goto fail;
        if (o->resume && !adopted)
            bk__q_emit(j, BK_EV_NOTE, 0, NULL,
                 "--resume: no interrupted run of this output was found; starting from the "
                 "first layer");
    }
    st = bk_model_open(o->model_dir, &j->model);
    if (st != BK_OK)
        goto fail;
    j->cfg = bk_model_get_config(j->model);
    if (bk_model_is_quantized(j->model)) {
        st = bk_error(BK_ERR_UNSUPPORTED, "%s: the model is already quantized", o->model_dir);
        goto fail;
    }
    j->layer_begin = o->layer_begin < 0 ? 0 : o->layer_begin;
    j->layer_end = (o->layer_end <= 0 || o->layer_end > j->cfg->n_layers) ? (int)j->cfg->n_layers
                                                                          : o->layer_end;
    j->first_layer = j->layer_begin;
    if (j->layer_begin >= j->layer_end) {
        st = bk_error(BK_ERR_INVALID_ARG, "quantize: empty layer range %d:%d (model has %lld layers)",
                      o->layer_begin, o->layer_end, (long long)j->cfg->n_layers);
        goto fail;
    }
    st = bk__check_export(o, j->cfg);
    if (st != BK_OK)
        goto fail;
    /* calibration */
    if (o->calib_path) {
        st = bk_load_tokens(o->calib_path, j->cfg->vocab, o->samples, o->seqlen, &j->tokens,
                            &j->S, &j->T);
        if (st != BK_OK)
            goto fail;
        if (j->T > j->cfg->max_positions) {
            st = bk_error(BK_ERR_CALIB, "%s: sequence length %lld exceeds the model's max_position_embeddings %lld",
                          o->calib_path, (long long)j->T, (long long)j->cfg->max_positions);
            goto fail;
        }
    } else if (o->calib_text) {
        int64_t T = o->seqlen > 0 ? o->seqlen : bk_text_default_seqlen(j->cfg->max_positions);
        if (j->cfg->max_positions > 0 && T > j->cfg->max_positions) {
            st = bk_error(BK_ERR_CALIB, "--seqlen %lld exceeds the model's max_position_embeddings %lld",
                          (long long)T, (long long)j->cfg->max_positions);
            goto fail;
        }
        st = bk_load_text_tokens(o->model_dir, o->calib_text, j->cfg->vocab, j->cfg->bos_token_id,
                                 o->samples, T, &j->tokens, &j->S, &j->T);
        if (st != BK_OK)
            goto fail;
    } else if (o->activations_dir) {
        const char *note = NULL;
        st = bk__act_open(o->activations_dir, j->model, o->samples, &j->acts, &j->S, &j->T,
                          &note);
        if (st != BK_OK)
            goto fail;
        if (note)
            bk__q_note(j, note);
    } else {
        j->S = 0;
        j->T = 1;
    }
    /* fail fast: every tensor of the checkpoint must be finite before any work
     * (after the calibration data, whose mistakes are found sooner) */
    {
        const bk_st_set *in = bk_model_tensors(j->model);
        double t = bk_now();
        st = bk_st_set_check_finite(in);
        j->t_io += bk_now() - t;
        bk_prof_add("io.scan_finite", bk_now() - t);
        if (st != BK_OK)
            goto fail;
    }
    /* token calibration: layer 0's weights are read on the layer driver's
     * helper thread while the backend, the stages, the output and the
     * embedding are set up (bk_driver_layers takes them for layer 0, which
     * every token run visits first; the backprop flow drives the layers
     * itself) */
    j->mapped_bf16 = bk_model_linears_mapped_bf16(j->model);
    if (j->tokens && !j->bp) {
        /* the form (bk__q_layer_bf16) guessed before the stages exist: BF16
         * where the GPU stages will likely run the layer (a CUDA build, not
         * the CPU backend or stages, one process, no kept layers); a wrong
         * guess only costs the body a conversion (bk__layer_weights_widen)
         * or the F32 upload of today */
        const int guess = j->mapped_bf16 && bk_cuda_compiled() && o->backend != BK_BACKEND_CPU &&
                          !o->cpu_stages && j->nranks <= 1 && !o->resume;
        bk_prefetch_start(&j->drv.pf, j->model, 0, guess);
    }
    j->N = j->S * j->T;
    j->batch = o->batch > 0 ? o->batch : bk_fwd_auto_batch(j->cfg, 0, j->T);
    if (j->S > 0 && j->batch > j->S)
        j->batch = j->S;
    if (j->batch < 1)
        j->batch = 1;
    if ((st = bk__q_split_ranks(j)) != BK_OK)
        goto fail;

    {
        bk_backend_params bp = o->backend_params;
        /* MPI ranks on a node with several GPUs: rank r of the node takes GPU
         * (device + r) mod count (one GPU per rank when there are enough;
         * srun --gpus-per-task shows each rank its own GPU as device 0) */
        const int ndev =
            j->nranks > 1 && o->backend != BK_BACKEND_CPU ? bk_cuda_device_count() : 0;
        if (ndev > 1)
            bp.device = (bp.device + bk_dist_local_rank(j->dist)) % ndev;
        st = bk_backend_create_params(o->backend, &bp, &j->backend);
    }
    if (st != BK_OK)
        goto fail;
    j->fully = bk__hessian_needs_qk(o->hessian);
    /* auto: BF16 GEMMs for a BF16 checkpoint (its weights are exact in BF16;
     * the activations are rounded as a BF16 framework would), else TF32 */
    j->gemm_math = bk_gemm_math_resolve(j->model, o->gemm_math);
    bk_backend_set_gemm_math(j->backend, j->gemm_math);
    const int want_gpu = o->gpu_pipeline;
    const int cpu_stages = o->cpu_stages;
    /* backprop kinds: the forward + backward passes of the flow on the GPU with
     * the CUDA backend, unless --cpu-stages (the CPU's flow, the reference);
     * the input-side stages then on the GPU stages too, unless the setting
     * bwd_input=cpu */
    j->bp_gpu = j->bp && !cpu_stages && j->tokens &&
                bk_backend_supports(j->backend, BK_OP_BACKWARD);
    /* --bwd-precision auto, once per job, before the memory plans and the
     * flow: everything after this (bp_host_kinds, the device plan bm, the
     * flow, run.json, report.json) reads the resolved value in own */
    j->bwd_auto = own.bwd_precision == BK_BWD_AUTO;
    own.bwd_precision = bk_bwd_precision_resolve(own.bwd_precision, j->bp_gpu, j->gemm_math);
    const int bwd_input_cpu = bk_backend_get_params(j->backend)->bwd_input_cpu;
    if (j->bp_gpu && j->nranks > 1) /* (the GPU stages' own collectives are added below) */
        j->coll_desc = "MPI over host copies (the GPU backward flow's output-gradient Grams)";
    if (j->bp && want_gpu && bwd_input_cpu) {
        st = bk_error(BK_ERR_USAGE,
                      "quantize: --gpu-pipeline with --hessian %s and --setting bwd_input=cpu: "
                      "that setting keeps the input-side stages on the CPU; drop one of them",
                      bk_hessian_name(o->hessian));
        goto fail;
    }
    /* (MPI ranks: the input side's device sums go through the stages' sums,
     * bk__q_stage_ranks; the flow's output-gradient Grams through the host
     * accumulators, bk__q_bp_leaf_sums) */
    const int bp_gpu_stages =
        j->bp && !bwd_input_cpu &&
        (want_gpu || (j->bp_gpu && bk_backend_supports(j->backend, BK_OP_STAGES)));
    if (want_gpu && cpu_stages) {
        st = bk_error(BK_ERR_INVALID_ARG,
                      "quantize: --gpu-pipeline and --cpu-stages contradict each other");
        goto fail;
    }
    /* forward + Hessians on the backend's own stages (the GPU's): asked for,
     * or the default of a backend that has them, with token calibration
     * (docs/DEVICE.md); else the CPU implementation of the stages (also
     * --activations: they take the dumped inputs; rtn without calibration:
     * they hold nothing) */
    const int own_stages = bk_backend_supports(j->backend, BK_OP_STAGES);
    j->own_stages =
        j->S > 0 && (j->bp ? bp_gpu_stages : (want_gpu || (!cpu_stages && j->tokens && own_stages)));
    if (j->own_stages && !j->tokens) {
        st = bk_error(BK_ERR_INVALID_ARG,
                      "quantize: the GPU pipeline (--gpu-pipeline) "
                      "needs token calibration (--calib), not --activations");
        goto fail;
    }
    if (j->own_stages && !own_stages) {
        if (bk_cuda_compiled())
            st = bk_error(BK_ERR_NO_DEVICE,
                          "quantize: the GPU pipeline (--gpu-pipeline) needs "
                          "the CUDA backend (--backend cuda or auto with a GPU; backend is %s)",
                          bk_backend_name(j->backend));
        else
            st = bk_error(BK_ERR_NO_DEVICE,
                          "quantize: the GPU pipeline (--gpu-pipeline) needs a "
                          "build with the CUDA backend");
        goto fail;
    }
    int leaf = o->leaf_size > 0 ? o->leaf_size : 1; /* the backprop flow's */
    /* the largest leaf the host check may suggest: the CPU flow's any (0);
     * the GPU flow's what the device holds (the GPU stages tell, bm.leaf_max;
     * unknown: none larger than the leaf run) */
    int leaf_max = j->bp_gpu ? leaf : 0;
    /* the leaf size known already (--leaf-size, or 1 with MPI ranks): the
     * flow's host memory is checked before the stages are set up (not when
     * the GPU stages hold the flow: they tell which leaves the device holds) */
    if (j->S > 0 && j->bp && (o->leaf_size > 0 || j->nranks > 1) &&
        !(j->bp_gpu && j->own_stages) &&
        (st = bp_host_check(j, o->leaf_size > 0 ? o->leaf_size : 1, leaf_max)) != BK_OK)
        goto fail;
    /* the flow's boundary budget, for the stages' device plan (the layer
     * inputs a wider split keeps) and the flow */
    if (j->S > 0 && j->bp)
        j->bp_units = bp_budget(j);
    {
        /* the backprop flow on the device of the stages: what it will hold
         * there (the GPU stages size their micro-batch from it) */
        /* (no --leaf-size: the stages choose it from the device memory; with
         * several ranks every rank must run the same leaves: 1) */
        bk_bwd_mem_params bm = {
            .flow = (int)o->bwd_flow,
            .leaf = o->leaf_size > 0 ? o->leaf_size : j->nranks > 1 ? 1 : 0,
            .precision = (int)o->bwd_precision,
            .grams = 1,
            .grams_dev = j->nranks <= 1,
            .shampoo = o->hessian == BK_HESS_BACKPROP_SHAMPOO,
            .units = j->bp_units,
        };
        const bk_stage_params sp = {
            .model = j->model,
            .kind = o->hessian == BK_HESS_RTN ? BK_HESS_GPTQ : o->hessian,
            .fp64 = o->hessian_fp64,
            .keep_plain = bk__hessian_keeps_plain(o->hessian),
            .fully = j->fully,
            .codes_only = o->export_format != BK_EXPORT_DEQUANTIZED,
            .S = j->S,
            .T = j->T,
            .rank = j->rank,
            .nranks = j->nranks,
            .sequential = o->sequential,
            .inputs = !j->tokens,
            .cpu = !j->own_stages,
            .bwd = j->bp_gpu && j->own_stages ? &bm : NULL,
        };
        int64_t gb = o->batch > 0 ? j->batch : 0;
        st = bk_backend_stages_create(j->backend, &sp, &gb, &j->ops, &j->ops_ctx);
        if (j->nranks > 1) /* every rank learns a rank's failure here */
            st = bk__q_sync(j, st);
        if (st != BK_OK)
            goto fail;
        if (j->nranks > 1 && j->bp) {
            /* every rank runs the flow with the same arithmetic (auto resolves
             * from the rank's backend: a rank without a GPU would differ) */
            char pr[64];
            snprintf(pr, sizeof pr, "%s on %s", bk_bwd_precision_name(o->bwd_precision),
                     j->bp_gpu ? "gpu" : "cpu");
            st = bk_dist_same(j->dist, pr, strlen(pr),
                              "backward flows (--bwd-precision as resolved, and where it runs)");
            if (st != BK_OK)
                goto fail;
        }
        /* the backend had no stages for this kind or setting: the CPU's run
         * the job (their describe says why: the start line, report.json) */
        if (j->own_stages && bk_cpu_stages_are(j->ops))
            j->own_stages = 0;
        if (j->nranks > 1 && j->own_stages) {
            const int64_t mine = gb;
            st = bk__q_dev_stages_ranks(j, &gb);
            if (st == BK_OK && gb != mine) {
                /* the stages hold this rank's share for its own micro-batch: again
                 * with the agreed (smaller) one */
                j->ops->destroy(j->ops_ctx);
                j->ops = NULL;
                j->ops_ctx = NULL;
                int64_t again = gb;
                st = bk_backend_stages_create(j->backend, &sp, &again, &j->ops, &j->ops_ctx);
                if (st == BK_OK && again != gb)
                    st = bk_error(BK_ERR_DEVICE_OOM,
                                  "quantize: rank %d: out of device memory for the ranks' "
                                  "micro-batch of %lld sequences (use a smaller --batch)",
                                  j->rank, (long long)gb);
                if (st == BK_OK && (!j->ops->sums || !j->ops->share_weight))
                    st = bk_error(BK_ERR_INTERNAL, "quantize: the stages changed");
            }
            st = bk__q_sync(j, st);
            if (st != BK_OK)
                goto fail;
        }
        if (gb != j->batch) { /* the device's micro-batch: the ranks' shares again */
            j->batch = gb;
            if ((st = bk__q_split_ranks(j)) != BK_OK)
                goto fail;
        }
        leaf = bm.leaf > 0 ? bm.leaf : 1;
        if (j->bp_gpu)
            leaf_max = bm.leaf_max > leaf ? bm.leaf_max : leaf;
    }
    /* (again with the leaf the stages chose, and what they hold now) */
    if (j->S > 0 && j->bp && (st = bp_host_check(j, leaf, leaf_max)) != BK_OK)
        goto fail;
    if (j->S > 0 && j->bp)
        bk_bwd_host_plan_widen(&j->bp_host, j->cfg, (int)o->bwd_flow,
                               leaf < (int)j->cfg->n_layers ? leaf : (int)j->cfg->n_layers,
                               (j->s_hi - j->s_lo) * j->T, j->bp_units);
    /* backprop kinds: one host accumulator per layer of a leaf; the flow's
     * output side enters it, the stages get it with bp_grads (the CPU stages
     * add the input side into it, the GPU stages take the output side) */
    if (j->S > 0 && j->bp) {
        j->bp_leaf = leaf < (int)j->cfg->n_layers ? leaf : (int)j->cfg->n_layers;
        j->bp_acc = calloc((size_t)j->bp_leaf, sizeof *j->bp_acc);
        if (!j->bp_acc) {
            st = bk_error(BK_ERR_NOMEM, "quantize: out of memory");
            goto fail;
        }
        for (int k = 0; k < j->bp_leaf; k++) {
            st = bk_hess_acc_create(j->cfg, o->hessian, o->hessian_fp64, j->T, &j->bp_acc[k]);
            if (st != BK_OK) {
                st = bk_error(st, "%s (the Hessians of --leaf-size %d layers are held at "
                              "once: use a smaller --leaf-size)",
                              bk_last_error(), j->bp_leaf);
                goto fail;
            }
        }
        j->acc = j->bp_acc[0];
    }
    j->report_modules = cJSON_CreateArray();
    j->first_layer = j->layer_begin;

    /* the journal of finished layers; a resumed run is checked against the
     * interrupted one's arguments, model and calibration */
    if (j->nranks <= 1) { /* (MPI ranks: no journal, --resume refused) */
        bk_resume_source src = {
            .o = o, .backend = bk_backend_name(j->backend), .stages = j->ops->name,
            .gpu_math = bk_gemm_math_name(j->gemm_math), .S = j->S, .T = j->T,
            .batch = j->batch, .layer_begin = j->layer_begin, .layer_end = j->layer_end,
            .leaf = j->bp_leaf, .tokens = j->tokens};
        st = bk_resume_open(j->od.work, adopted, &src, j->tokens && o->sequential, &j->rs);
        if (st != BK_OK) {
            if (adopted) /* left for a rerun with what it was made with */
                j->od.keep_work = 1;
            goto fail;
        }
    }

    /* output (rank 0) */
    if (j->rank == 0) {
        const uint64_t shard = o->max_shard_bytes ? o->max_shard_bytes : 5000000000ull;
        st = j->rs ? bk_st_stream_begin_resumable(j->od.work, "model", shard, &j->out)
                   : bk_st_stream_begin(j->od.work, "model", shard, &j->out);
        if (st != BK_OK)
            goto fail;
        st = bk__q_declare_outputs(j);
        int reused = 0;
        if (st == BK_OK && j->rs)
            st = bk_st_stream_open_files(j->out, &reused);
        /* token calibration on a fresh journal: the tensors passed through
         * go to the writer thread (below), overlapping the first layer; else
         * here, before the journaled layers' digests are read */
        const int pass_later = j->tokens && bk_resume_layers_done(j->rs) == 0;
        if (st == BK_OK && !pass_later)
            st = bk__q_write_passthrough(j);
        if (st == BK_OK && j->rs) {
            double t = bk_now();
            st = bk_resume_restore(j->rs, j->out, reused, j->report_modules, &j->quantized_params,
                                   &j->first_layer, bk__q_note, j);
            bk_prof_add("resume.restore (digests)", bk_now() - t);
        }
        if (st != BK_OK)
            goto fail;
        bk__q_writer_start(j);
        if (pass_later && (st = bk__q_writer_put_passthrough(j)) != BK_OK)
            goto fail;
    }

    {
        char msg[1024];
        const char *sd = j->ops ? j->ops->describe(j->ops_ctx) : "";
        char rk[256] = "";
        if (j->nranks > 1)
            snprintf(rk, sizeof rk, "; %d MPI ranks, data parallel (%s sums%s%s)", j->nranks,
                     o->dist_reduce == BK_DIST_ORDERED ? "ordered" : "rank-order",
                     j->coll_desc ? "; GPU collectives: " : "",
                     j->coll_desc ? j->coll_desc : "");
        char bw[200] = "";
        if (j->bp) /* the backward's arithmetic as resolved (--bwd-precision auto) */
            snprintf(bw, sizeof bw, "; backward on the %s, --bwd-precision %s%s%s",
                     j->bp_gpu ? "GPU" : "CPU", bk_bwd_precision_name(o->bwd_precision),
                     j->bwd_auto ? " (auto)" : "", j->bp_gpu ? "" : " (the CPU's flow: fp64)");
        snprintf(msg, sizeof msg, "%s: %lld layers, hessian %s, %s, calibration %lld x %lld, backend %s%s%s%s%s",
                 o->model_dir, (long long)j->cfg->n_layers, bk_hessian_name(o->hessian),
                 bk_algorithm_name(o->solve.algorithm), (long long)j->S, (long long)j->T,
                 bk_backend_device(j->backend), sd[0] ? "; " : "", sd, bw, rk);
        bk__q_emit(j, BK_EV_START, j->layer_begin, NULL, msg);
    }

    bk_prof_add("setup", bk_now() - j->t0);
    /* the layer driver: token calibration embeds every sequence and runs
     * every layer up to the last one quantized (the backward flow of the
     * backprop kinds drives the layers itself); dumped activations and rtn
     * without calibration visit the quantized layers alone */
    j->drv.model = j->model;
    j->drv.tokens = j->tokens;
    j->drv.s_lo = j->s_lo;
    j->drv.s_hi = j->s_hi;
    j->drv.batch = j->batch;
    j->drv.embed = j->ops->embed;
    j->drv.fwd = j->ops_ctx;
    j->drv.layer = j->tokens ? bk__q_layer_body : bk__q_offline_body;
    j->drv.user = j;
    j->drv.weights = j->tokens || j->acts;
    j->drv.bf16 = bk__q_layer_bf16;
    j->drv.end = j->layer_end;
    j->drv.stop_check = !j->tokens || j->bp; /* (else: after every module's solve) */
    j->drv.stop_first = j->layer_begin;
    j->drv.stop_count = j->layer_end - j->layer_begin;
    if (j->tokens) {
        double t = bk_now();
        st = bk_driver_embed(&j->drv);
        j->t_forward += bk_now() - t;
        if (st == BK_OK)
            st = j->bp ? bk__q_run_backprop(j) : bk_driver_layers(&j->drv, 0, j->layer_end);
    } else {
        st = bk_driver_layers(&j->drv, j->first_layer, j->layer_end);
    }
    if (st != BK_OK)
        goto fail;

    /* MPI ranks: every rank's peak host memory, for report.json */
    if (j->dist && (st = bk__q_rank_peaks(j)) != BK_OK)
        goto fail;
    bk__q_emit(j, BK_EV_WRITE, j->layer_end - 1, NULL, "writing config.json, report.json, tokenizer files");
    if (j->rank != 0) { /* rank 0 writes; every rank learns how that went */
        if ((st = bk__q_sync(j, BK_OK)) != BK_OK || (st = bk__q_sync(j, BK_OK)) != BK_OK)
            goto fail;
    } else {
        double t = bk_now();
        st = bk__q_writer_finish(j, 0);
        if (st == BK_OK)
            st = bk_st_stream_finish(j->out);
        else
            bk_st_stream_abort(j->out);
        j->out = NULL;
        if (st == BK_OK)
            st = bk__q_write_metadata(j);
        if (st == BK_OK)
            st = bk__copy_aux_files(o->model_dir, j->od.work);
        if (st == BK_OK) /* nothing read has changed since it was opened */
            st = bk_st_set_check_unchanged(bk_model_tensors(j->model));
        if (st == BK_OK) /* every rank finished */
            st = bk__q_sync(j, st);
        if (st == BK_OK) /* the journal goes before the folder becomes the output */
            st = bk_resume_finish(j->rs);
        if (st == BK_OK)
            st = bk_outdir_commit(&j->od);
        if (j->nranks > 1 && !j->agreed)
            st = bk__q_sync(j, st);
        j->t_io += bk_now() - t;
        bk_prof_add("io.finish", bk_now() - t);
        if (st != BK_OK)
            goto fail;
    }
    bk__q_emit(j, BK_EV_DONE, j->layer_end, NULL, o->out_dir);
    bk_prof_add("total", bk_now() - j->t0);
    bk_prof_print();
    job_free(j);
    bk_outdir_close(&j->od);
    return BK_OK;

fail:
    if (j->nranks > 1 && st == BK_ERR_INTERRUPTED && !strstr(bk_last_error(), "by a signal"))
        bk_error_prefix(st, "stopped by a signal (mpirun and srun stop every rank when one dies)");
    if (j->nranks > 1 && !j->agreed) /* the other ranks learn it at their next exchange */
        st = bk__q_sync(j, st);
    /* a runtime failure (interrupted, disk full, out of memory, device) keeps
     * the work folder with its finished layers for --resume */
    if (j->rs && j->out && bk_status_exit_code(st) == 3) {
        char why[1024];
        snprintf(why, sizeof why, "%s", bk_last_error());
        bk__q_writer_finish(j, 0); /* (queued journal lines too) */
        bk_error(st, "%s", why);
    }
    if (j->rs && j->out && bk_status_exit_code(st) == 3 && bk_resume_layers_done(j->rs) > 0) {
        bk_st_stream_keep(j->out);
        j->out = NULL;
        j->od.keep_work = 1;
        char msg[BK_PATH_MAX + 200];
        snprintf(msg, sizeof msg,
                 "kept %.3500s with %d finished layer(s): the same command with --resume continues "
                 "from there",
                 j->od.work, bk_resume_layers_done(j->rs)); /* (msg: work is < 4096) */
        bk__q_emit(j, BK_EV_NOTE, 0, NULL, msg);
    }
    if (adopted && !j->rs) /* failed before the killed run's state was checked: kept */
        j->od.keep_work = 1;
    bk__q_writer_finish(j, 1);
    if (j->out)
        bk_st_stream_abort(j->out);
    job_free(j);
    bk_outdir_close(&j->od);
    return st;
}
