/* The quantization job: stream a checkpoint layer by layer, accumulate each
 * module's Kronecker-factored Hessian from calibration activations, solve,
 * propagate, and write the quantized checkpoint. */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "bakron/bakron.h"
#include "bakron/pipeline.h"
#include "backward_internal.h"
#include "bk_config.h"
#include "outdir.h"
#include "backend_impl.h"
#include "layer_driver.h"
#include "pipeline_internal.h"
#include "resume.h"
#include "st_internal.h"
#include "util.h"

const char *bk_export_name(bk_export_format f)
{
    switch (f) {
    case BK_EXPORT_NATIVE: return "native";
    case BK_EXPORT_DEQUANTIZED: return "dequantized";
    case BK_EXPORT_GPTQ: return "gptq";
    }
    return "?";
}

bk_status bk_export_from_name(const char *name, bk_export_format *out)
{
    for (int f = 0; f <= BK_EXPORT_GPTQ; f++) {
        if (!strcmp(name, bk_export_name((bk_export_format)f))) {
            *out = (bk_export_format)f;
            return BK_OK;
        }
    }
    return bk_error(BK_ERR_INVALID_ARG, "unknown export format '%s' (expected native, dequantized or gptq)",
                    name);
}

bk_gemm_math bk_gemm_math_resolve(const bk_model *m, bk_gemm_math want)
{
    if (want != BK_GEMM_AUTO)
        return want;
    const bk_tensor_info *t = m ? bk_model_find(m, 0, "self_attn.q_proj.weight") : NULL;
    return t && t->dtype == BK_DT_BF16 ? BK_GEMM_BF16 : BK_GEMM_TF32;
}

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
    o->leaf_size = 1;
    o->export_format = BK_EXPORT_NATIVE;
    o->backend = BK_BACKEND_AUTO;
    bk_backend_params_default(&o->backend_params);
}

/* ------------------------------------------------------------------ job state */

typedef struct job {
    const bk_quantize_opts *o;
    bk_model *model;
    const bk_model_config *cfg;
    bk_backend *backend;
    bk_fwd *fwd;
    bk_hess_acc *acc;
    bk_hess_acc *acc_gptq; /* plain E[xx^T] for the GPTQ loss of two-sided modules (shampoo) */
    bk_st_stream *out;
    bk_outdir od; /* the output folder: lock, work folder (od.work), commit */
    int layer_begin, layer_end;
    bk_resume *rs;   /* journal of finished layers (src/resume.c) */
    int first_layer; /* first layer to quantize: layer_begin, or after the kept ones */
    /* calibration */
    int32_t *tokens;
    int64_t S, T, N, batch;
    bk_act_reader *acts;
    /* the stages on one micro-batch: CPU (below) or GPU (cuda/pipeline_cuda.cu) */
    const bk_stage_ops *ops;
    void *ops_ctx;
    int fully;                          /* fully-local Hessian: FP queries/keys in stage 1 */
    const bk_layer_weights *cur_orig;   /* the layer being processed (CPU stages) */
    bk_layer_weights *cur_lw;
    /* buffers (CPU stages) */
    float *h;      /* [N, hidden] residual stream */
    float *o_in;   /* [N, heads*head_dim] */
    float *x;      /* [B*T, max(hidden, ...)] micro-batch scratch */
    float *q_rot, *k_rot, *down;
    float *mlp_in; /* [B*T, hidden] (--no-sequential) */
    float *D;      /* [N, intermediate]: down_proj inputs of all sequences, kept from stage
                      DOWN for stage OUT when they fit (else NULL: recomputed) */
    /* report */
    cJSON *report_modules;
    double t0, t_forward, t_hessian, t_factor, t_solve, t_io;
    int64_t quantized_params;
    bk_gemm_math gemm_math; /* the GPU stages' arithmetic (auto resolved) */
    /* MPI ranks (docs/DISTRIBUTED.md): this rank's sequences [s_lo, s_hi) (all
     * of them in one process); agreed: the failure is known to every rank */
    bk_dist *dist;
    int rank, nranks, agreed;
    int64_t s_lo, s_hi;
    /* stages with their own sums (GPU): the sums and solved weights go
     * through ops->sums / ops->share_weight; dev_coll: as device buffers
     * (NCCL), else through host copies over MPI */
    int dev_stages_ranks, dev_coll;
    const char *coll_desc;
    /* backprop kinds: one accumulator per layer of a leaf of the flow
     * (j->acc points at the one of the layer being quantized) */
    int bp;
    int bp_leaf;                /* leaf size */
    bk_hess_acc **bp_acc;       /* [bp_leaf] */
    struct bp_dev {             /* [bp_leaf]: the GPU flow's device Grams of the leaf
                                   (grams_dev), for the GPU stages */
        const double *G[BK_MOD_COUNT], *gw[BK_MOD_COUNT];
        int64_t N;
        int layer;
    } *bp_dev;
    int bp_leaf_lo;             /* first layer of the current leaf */
    bk_bwd_flow_stats bp_stats;
    double bp_time_counted;     /* flow time already added to t_forward */
    int bp_gpu;                 /* the flow (forward + backward passes) on the GPU
                                   (cuda/backward.cu); the input-side stages are j->ops
                                   (the GPU stages unless --setting bwd_input=cpu) */
    /* output writer: quantized modules are packed and written by a helper
     * thread while the next module is solved (queue of WQ_CAP results) */
    struct {
        pthread_t tid;
        int started, stop, failed;
        pthread_mutex_t mu;
        pthread_cond_t cv;
        struct wjob {
            int layer;
            bk_module mod;     /* BK_MOD_COUNT: the layer is complete (journal it) */
            bk_solve_result r;
            char *entries;     /* the layer's report entries (journal) */
        } q[2]; /* WQ_CAP */
        int head, count;
        bk_status st;
        char msg[1024];
        double busy_s; /* time spent writing (overlapped) */
        long nwrites;  /* module writes attempted (fault injection) */
    } wr;
    /* the layer driver (src/layer_driver.c): the embedding, then every layer
     * with its weights (the next one read on a helper thread meanwhile) */
    bk_layer_driver drv;
} job;

static void emit(job *j, bk_event_kind kind, int layer, const char *module, const char *msg)
{
    if (!j->o->on_event)
        return;
    bk_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = kind;
    ev.layer = layer;
    ev.n_layers = j->layer_end - j->layer_begin;
    ev.module = module;
    ev.elapsed_s = bk_now() - j->t0;
    ev.layers_kept = j->first_layer > j->layer_begin ? j->first_layer - j->layer_begin : 0;
    /* (a resumed run: the layers it does itself) */
    int done = layer - j->first_layer + (kind == BK_EV_LAYER_DONE ? 1 : 0);
    int todo = j->layer_end - j->first_layer;
    ev.eta_s = (done > 0 && todo > done) ? ev.elapsed_s / done * (todo - done) : 0;
    ev.t_forward = j->t_forward;
    ev.t_hessian = j->t_hessian;
    ev.t_factor = j->t_factor;
    ev.t_solve = j->t_solve;
    ev.t_io = j->t_io;
    ev.message = msg;
    j->o->on_event(j->o->user, &ev);
}

static void emit_module(job *j, int layer, bk_module mod, const bk_solve_result *r, double loss_gptq)
{
    if (!j->o->on_event)
        return;
    bk_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = BK_EV_MODULE_DONE;
    ev.layer = layer;
    ev.n_layers = j->layer_end - j->layer_begin;
    ev.module = bk_module_name(mod);
    ev.rows = r->m;
    ev.cols = r->n;
    ev.layers_kept = j->first_layer > j->layer_begin ? j->first_layer - j->layer_begin : 0;
    ev.loss = r->loss_two_sided;
    ev.loss_gptq = loss_gptq;
    ev.damp_a = r->damp_a;
    ev.damp_b = r->damp_b;
    ev.elapsed_s = bk_now() - j->t0;
    ev.t_forward = j->t_forward;
    ev.t_hessian = j->t_hessian;
    ev.t_factor = j->t_factor;
    ev.t_solve = j->t_solve;
    ev.t_io = j->t_io;
    j->o->on_event(j->o->user, &ev);
}

static void job_note(void *user, const char *msg)
{
    emit((job *)user, BK_EV_NOTE, 0, NULL, msg);
}

static int layer_in_range(const job *j, int l)
{
    return l >= j->layer_begin && l < j->layer_end;
}

/* ------------------------------------------------------------- output plan */

static bk_status declare_outputs(job *j)
{
    const bk_st_set *in = bk_model_tensors(j->model);
    char name[512];
    bk_status st;
    for (size_t i = 0; i < bk_st_set_count(in); i++) {
        const bk_tensor_info *t = bk_st_set_tensor(in, i);
        int layer;
        bk_module mod;
        if (bk__parse_linear_name(t->name, &layer, &mod) && layer_in_range(j, layer) &&
            j->o->export_format != BK_EXPORT_DEQUANTIZED) {
            st = bk__declare_quantized(j->out, j->o, j->cfg, t->name, mod);
            if (st != BK_OK)
                return st;
            continue;
        }
        st = bk_st_stream_declare(j->out, t->name, t->dtype, t->ndim, t->shape);
        if (st != BK_OK)
            return st;
    }
    (void)name;
    return BK_OK;
}

/* Copy every tensor that is not a quantized linear weight straight through.
 * In dequantized mode the linear weights of quantized layers are written
 * later, when solved. */
static bk_status write_passthrough(job *j)
{
    const bk_st_set *in = bk_model_tensors(j->model);
    double t = bk_now();
    for (size_t i = 0; i < bk_st_set_count(in); i++) {
        const bk_tensor_info *ti = bk_st_set_tensor(in, i);
        int layer;
        bk_module mod;
        if (bk__parse_linear_name(ti->name, &layer, &mod) && layer_in_range(j, layer))
            continue;
        bk_status st = bk_st_stream_write(j->out, ti->name, ti->data);
        if (st != BK_OK)
            return st;
    }
    j->t_io += bk_now() - t;
    bk_prof_add("io.passthrough", bk_now() - t);
    return BK_OK;
}

/* ------------------------------------------------------------ writer thread */

#define WQ_CAP 2 /* the size of job.wr.q */
_Static_assert(sizeof(((job *)0)->wr.q) / sizeof(((job *)0)->wr.q[0]) == WQ_CAP,
               "writer queue size");

/* bk__write_module, with fault injection for the tests: BK_FAULT_WRITE_MODULE=k
 * makes the k-th module write (1-based) fail as a write error would. */
static bk_status write_module_checked(job *j, int layer, bk_module mod, const bk_solve_result *r)
{
    const char *fault = getenv("BK_FAULT_WRITE_MODULE");
    if (fault && fault[0] && ++j->wr.nwrites == strtol(fault, NULL, 10))
        return bk_error(BK_ERR_WRITE, "model.layers.%d.%s: writing failed (injected fault, "
                        "BK_FAULT_WRITE_MODULE)", layer, bk_module_name(mod));
    bk_status st = bk__write_module(j->out, j->o, j->cfg, j->model, layer, mod, r);
    if (st == BK_OK) /* the codes the forward pass of a resumed run needs */
        st = bk_resume_save_module(j->rs, &j->o->solve.quant, layer, mod, r);
    return st;
}

/* Test hook (tests/test_resume.sh): BK_FAULT_KILL_AT=journal-K kills the
 * process just before / after=journal-K-after the K-th journal line (1-based)
 * is written; module-K before the K-th module write. */
static void resume_kill_point(const char *what, long k)
{
    const char *e = getenv("BK_FAULT_KILL_AT");
    char want[64];
    snprintf(want, sizeof want, "%s-%ld", what, k);
    if (e && !strcmp(e, want))
        raise(SIGKILL);
}

/* The writer's work item: a module, or a layer's end (journal line). */
static bk_status writer_do(job *j, struct wjob *w)
{
    if (w->mod == BK_MOD_COUNT) {
        const long k = bk_resume_layers_done(j->rs) + 1;
        resume_kill_point("journal", k);
        bk_status st = bk_resume_layer_done(j->rs, j->out, w->layer, w->entries);
        resume_kill_point("journal-after", k);
        return st;
    }
    static long nmod;
    resume_kill_point("module", ++nmod);
    return write_module_checked(j, w->layer, w->mod, &w->r);
}

static void *writer_main(void *arg)
{
    job *j = arg;
    pthread_mutex_lock(&j->wr.mu);
    for (;;) {
        while (j->wr.count == 0 && !j->wr.stop)
            pthread_cond_wait(&j->wr.cv, &j->wr.mu);
        if (j->wr.count == 0 && j->wr.stop)
            break;
        struct wjob w = j->wr.q[j->wr.head];
        const int failed = j->wr.failed; /* read under the lock */
        pthread_mutex_unlock(&j->wr.mu);
        bk_status st = BK_OK;
        double t = bk_now();
        if (!failed) /* after a failure the rest is only freed */
            st = writer_do(j, &w);
        const double dt = bk_now() - t;
        bk_prof_add("writer.write (thread)", dt);
        bk_solve_result_free(&w.r);
        free(w.entries);
        pthread_mutex_lock(&j->wr.mu);
        j->wr.busy_s += dt;
        if (st != BK_OK && !j->wr.failed) {
            j->wr.failed = 1;
            j->wr.st = st;
            snprintf(j->wr.msg, sizeof j->wr.msg, "%s", bk_last_error());
        }
        j->wr.head = (j->wr.head + 1) % WQ_CAP;
        j->wr.count--;
        pthread_cond_broadcast(&j->wr.cv);
    }
    pthread_mutex_unlock(&j->wr.mu);
    return NULL;
}

static bk_status writer_error(job *j)
{
    return bk_error(j->wr.st, "%s", j->wr.msg);
}

/* Hand r over to the writer (r is emptied); without a writer thread, write
 * here. Fails with the writer's first error. */
static bk_status writer_put(job *j, int layer, bk_module mod, bk_solve_result *r,
                            char *entries)
{
    if (!j->out) { /* MPI ranks other than 0: rank 0 writes */
        bk_solve_result_free(r);
        free(entries);
        return BK_OK;
    }
    if (!j->wr.started) {
        struct wjob w = {layer, mod, *r, entries};
        bk_status st = writer_do(j, &w);
        bk_solve_result_free(r);
        free(entries);
        return st;
    }
    pthread_mutex_lock(&j->wr.mu);
    while (j->wr.count == WQ_CAP && !j->wr.failed)
        pthread_cond_wait(&j->wr.cv, &j->wr.mu);
    if (j->wr.failed) {
        pthread_mutex_unlock(&j->wr.mu);
        bk_solve_result_free(r);
        free(entries);
        return writer_error(j);
    }
    struct wjob *w = &j->wr.q[(j->wr.head + j->wr.count) % WQ_CAP];
    w->layer = layer;
    w->mod = mod;
    w->r = *r;
    w->entries = entries;
    memset(r, 0, sizeof *r);
    j->wr.count++;
    pthread_cond_broadcast(&j->wr.cv);
    pthread_mutex_unlock(&j->wr.mu);
    return BK_OK;
}

static void writer_start(job *j)
{
    const char *e = getenv("BK_WRITER_THREAD"); /* 0: write on the calling thread */
    if (e && !strcmp(e, "0"))
        return;
    pthread_mutex_init(&j->wr.mu, NULL);
    pthread_cond_init(&j->wr.cv, NULL);
    j->wr.started = pthread_create(&j->wr.tid, NULL, writer_main, j) == 0;
    if (!j->wr.started) {
        pthread_mutex_destroy(&j->wr.mu);
        pthread_cond_destroy(&j->wr.cv);
    }
}

/* Wait for every queued write and end the thread; its first error, if any.
 * abandon: the job failed, queued results are only freed. */
static bk_status writer_finish(job *j, int abandon)
{
    if (!j->wr.started)
        return BK_OK;
    pthread_mutex_lock(&j->wr.mu);
    if (abandon)
        j->wr.failed = 1;
    j->wr.stop = 1;
    pthread_cond_broadcast(&j->wr.cv);
    pthread_mutex_unlock(&j->wr.mu);
    pthread_join(j->wr.tid, NULL);
    pthread_mutex_destroy(&j->wr.mu);
    pthread_cond_destroy(&j->wr.cv);
    j->wr.started = 0;
    if (j->wr.failed && !abandon)
        return writer_error(j);
    return BK_OK;
}

/* Wait until the writer has done everything queued (its first error). */
static bk_status writer_drain(job *j)
{
    if (!j->wr.started)
        return BK_OK;
    pthread_mutex_lock(&j->wr.mu);
    while (j->wr.count > 0 && !j->wr.failed)
        pthread_cond_wait(&j->wr.cv, &j->wr.mu);
    const int failed = j->wr.failed;
    pthread_mutex_unlock(&j->wr.mu);
    return failed ? writer_error(j) : BK_OK;
}

/* Layer l is complete: after its modules, the writer fsyncs the shards and
 * appends the layer's journal line (with its report entries). */
static bk_status journal_layer(job *j, int l)
{
    if (!j->rs)
        return BK_OK;
    cJSON *arr = cJSON_CreateArray();
    const cJSON *e;
    cJSON_ArrayForEach(e, j->report_modules)
    {
        const cJSON *le = cJSON_GetObjectItemCaseSensitive(e, "layer");
        if (cJSON_IsNumber(le) && le->valueint == l)
            cJSON_AddItemToArray(arr, cJSON_Duplicate(e, 1));
    }
    char *text = cJSON_PrintUnformatted(arr);
    cJSON_Delete(arr);
    if (!text)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    bk_solve_result none;
    memset(&none, 0, sizeof none);
    return writer_put(j, l, BK_MOD_COUNT, &none, text);
}

/* ------------------------------------------------------------------ solving */

/* A module's solve, before it is applied (MPI ranks: computed by one rank,
 * applied by all). */
typedef struct solved {
    bk_solve_result r;
    double loss_gptq;
    int alg, two_sided;
} solved;

static bk_status solve_compute(job *j, int layer, bk_module mod, const bk_layer_weights *orig,
                               solved *sv)
{
    const char *A = NULL, *B = NULL;
    const float *fa = NULL, *fb = NULL, *fa_gptq = NULL;
    bk_status st;
    int64_t m, n;
    bk_module_shape(j->cfg, mod, &m, &n);
    char label[256];
    snprintf(label, sizeof label, "model.layers.%d.%s", layer, bk_module_name(mod));

    /* device factors and solve where the stages offer them (GPU stages) */
    const int dev = j->ops->factors_dev && j->ops->solve_dev;
    double t = bk_now();
    st = dev ? j->ops->factors_dev(j->ops_ctx, mod, &fa, &fb, &fa_gptq)
             : j->ops->factors(j->ops_ctx, mod, &fa, &fb, &fa_gptq);
    j->t_hessian += bk_now() - t;
    bk_prof_add("pipe.factors", bk_now() - t);
    if (st != BK_OK)
        return bk_error_prefix(st, label);
    (void)A;
    (void)B;

    bk_solve_opts so = j->o->solve;
    if (j->o->damp_b_attn >= 0.0 && mod <= BK_MOD_V) {
        so.separate_damp_b = 1;
        so.damp_b = j->o->damp_b_attn;
    }
    if (j->o->hessian == BK_HESS_RTN)
        so.algorithm = BK_ALG_RTN;
    else if (!fb)
        so.algorithm = BK_ALG_GPTQ; /* B = I: GPTQ gives the same codes, faster */
    char la[300], lb[300];
    snprintf(la, sizeof la, "%s (input factor A)", label);
    snprintf(lb, sizeof lb, "%s (output factor B)", label);
    bk_solve_problem p = {
        .m = m, .n = n, .dtype = BK_DT_F32,
        .W = orig->w[mod], .A = fa, .B = fb, .LA = NULL, .LB = NULL,
        .label_w = label, .label_a = la, .label_b = lb,
    };
    if (!fa) {
        /* no calibration (rtn): stats are skipped */
        so.compute_stats = 0;
    }
    bk_solve_result r;
    memset(&r, 0, sizeof r);
    double loss_gptq = NAN;
    t = bk_now();
    st = dev ? j->ops->solve_dev(j->ops_ctx, mod, &p, fa_gptq, &so, &r, &loss_gptq)
             : bk_backend_solve(j->backend, &p, &so, &r);
    if (st != BK_OK) {
        bk_solve_result_free(&r);
        return bk_error_prefix(st, label);
    }
    bk_prof_add("pipe.solve", bk_now() - t);

    /* the GPTQ proxy loss tr(E A E^T) with A = E[xx^T] (undamped), for every
     * module (computed by solve_dev on the device) */
    if (fa_gptq && !dev) {
        float *E = bk_alloc((size_t)(m * n), sizeof(float));
        if (!E) {
            bk_solve_result_free(&r);
            return bk_error(BK_ERR_NOMEM, "%s: out of memory", label);
        }
        for (int64_t i = 0; i < m * n; i++)
            E[i] = r.weight[i] - orig->w[mod][i];
        st = bk_proxy_loss_fast(m, n, E, fa_gptq, &loss_gptq);
        free(E);
        if (st != BK_OK) {
            bk_solve_result_free(&r);
            return st;
        }
    }
    sv->r = r;
    sv->loss_gptq = loss_gptq;
    sv->alg = (int)so.algorithm;
    sv->two_sided = fb != NULL;
    return BK_OK;
}

/* Apply a solve: the working copy, the report, the progress event, the
 * output (sv->r is handed over). */
static bk_status solve_apply(job *j, int layer, bk_module mod, bk_layer_weights *lw, solved *sv)
{
    bk_status st = BK_OK;
    int64_t m, n;
    bk_module_shape(j->cfg, mod, &m, &n);
    char label[256];
    snprintf(label, sizeof label, "model.layers.%d.%s", layer, bk_module_name(mod));
    const int dev = j->ops->factors_dev && j->ops->solve_dev;
    bk_solve_result r = sv->r;
    memset(&sv->r, 0, sizeof sv->r);
    const double loss_gptq = sv->loss_gptq;
    j->t_factor += r.time_factor_s;
    j->t_solve += r.time_solve_s + r.time_stats_s;
    double t = bk_now();

    /* the quantized weight replaces the working copy for what follows */
    if (!dev) { /* (the device stages updated their working copy in solve_dev) */
        memcpy(lw->w[mod], r.weight, (size_t)(m * n) * sizeof(float));
        st = j->ops->weight_updated(j->ops_ctx, mod, r.weight);
    }
    if (st != BK_OK) {
        bk_solve_result_free(&r);
        return bk_error_prefix(st, label);
    }

    cJSON *e = cJSON_CreateObject();
    cJSON_AddNumberToObject(e, "layer", layer);
    cJSON_AddStringToObject(e, "module", bk_module_name(mod));
    cJSON_AddNumberToObject(e, "rows", (double)m);
    cJSON_AddNumberToObject(e, "cols", (double)n);
    cJSON_AddStringToObject(e, "algorithm", bk_algorithm_name((bk_algorithm)sv->alg));
    cJSON_AddBoolToObject(e, "two_sided", sv->two_sided);
    if (isfinite(r.loss_two_sided))
        cJSON_AddNumberToObject(e, "loss", r.loss_two_sided);
    else
        cJSON_AddNullToObject(e, "loss");
    if (isfinite(loss_gptq))
        cJSON_AddNumberToObject(e, "loss_gptq", loss_gptq);
    else
        cJSON_AddNullToObject(e, "loss_gptq");
    cJSON_AddNumberToObject(e, "damp_a", r.damp_a);
    cJSON_AddNumberToObject(e, "damp_b", r.damp_b);
    cJSON_AddNumberToObject(e, "damp_retries", r.damp_retries);
    cJSON_AddNumberToObject(e, "dead_columns", (double)r.dead_columns);
    cJSON_AddNumberToObject(e, "clamped", (double)r.clamped);
    cJSON_AddNumberToObject(e, "time_factor_s", r.time_factor_s);
    cJSON_AddNumberToObject(e, "time_solve_s", r.time_solve_s);
    cJSON_AddItemToArray(j->report_modules, e);
    j->quantized_params += m * n;

    emit_module(j, layer, mod, &r, loss_gptq);
    bk_prof_add("pipe.report", bk_now() - t);
    /* packing and writing overlap the next module (writer thread) */
    t = bk_now();
    st = writer_put(j, layer, mod, &r, NULL);
    j->t_io += bk_now() - t;
    bk_prof_add("pipe.writer_put", bk_now() - t);
    if (st != BK_OK)
        return st;
    if (bk__stop_requested())
        return bk_error(BK_ERR_INTERRUPTED, "interrupted at layer %d (%d/%d) %s", layer,
                        layer - j->layer_begin + 1, j->layer_end - j->layer_begin,
                        bk_module_name(mod));
    return BK_OK;
}

static bk_status solve_module(job *j, int layer, bk_module mod, bk_layer_weights *lw,
                              const bk_layer_weights *orig)
{
    solved sv;
    memset(&sv, 0, sizeof sv);
    bk_status st = solve_compute(j, layer, mod, orig, &sv);
    if (st == BK_OK)
        st = solve_apply(j, layer, mod, lw, &sv);
    bk_solve_result_free(&sv.r);
    return st;
}

/* Feed one micro-batch of every module's inputs to the accumulators (the
 * plain E[xx^T] one gets no queries/keys). */
static bk_status add_all_modules(job *j, const bk_layer_weights *orig, const float *attn_in,
                                 const float *o_in, const float *mlp_in, const float *down_in,
                                 int fully, int64_t sb, double *t_hessian)
{
    double t = bk_now();
    bk_status st = BK_OK;
    for (int k = 0; k < 2 && st == BK_OK; k++) {
        bk_hess_acc *a = k ? j->acc_gptq : j->acc;
        if (!a)
            continue;
        st = bk_hess_add_attn(a, orig, attn_in, (fully && !k) ? j->q_rot : NULL,
                              (fully && !k) ? j->k_rot : NULL, sb);
        if (st == BK_OK)
            st = bk_hess_add_o(a, o_in, sb);
        if (st == BK_OK)
            st = bk_hess_add_mlp(a, orig, mlp_in, sb);
        if (st == BK_OK)
            st = bk_hess_add_down(a, down_in, sb);
    }
    *t_hessian += bk_now() - t;
    return st;
}

/* ------------------------------------------------- the CPU stages (bk_stage_ops) */

static bk_status cpu_embed(void *ctx, const int32_t *tokens, int64_t s0, int64_t sb)
{
    job *j = ctx;
    return bk_fwd_embed(j->fwd, j->model, tokens + s0 * j->T, sb,
                        j->h + s0 * j->T * j->cfg->hidden);
}

static bk_status cpu_layer_begin(void *ctx, const bk_layer_weights *orig,
                                 const bk_layer_weights *lw, int hessians)
{
    job *j = ctx;
    j->cur_orig = orig;
    j->cur_lw = (bk_layer_weights *)lw;
    if (hessians) {
        if (j->acc && !j->bp) /* backprop: reset after the layer (its gradients came first) */
            bk_hess_acc_reset(j->acc);
        if (j->acc_gptq)
            bk_hess_acc_reset(j->acc_gptq);
    }
    return BK_OK;
}

static bk_status cpu_run(void *ctx, bk_stage stage, int64_t s0, int64_t sb, double *t_forward,
                         double *t_hessian)
{
    job *j = ctx;
    const bk_layer_weights *orig = j->cur_orig, *lw = j->cur_lw;
    const int64_t T = j->T, hid = j->cfg->hidden, qd = j->cfg->n_heads * j->cfg->head_dim;
    float *hb = j->h + s0 * T * hid;
    float *ob = j->o_in + s0 * T * qd;
    const int fully = j->fully;
    bk_status st = BK_OK;
    double t = bk_now();
    switch (stage) {
    case BK_STAGE_QKV:
        /* q, k, v from attn_in (and, fully-local, the FP queries/keys) */
        st = bk_fwd_attn_in(j->fwd, orig, hb, sb, j->x);
        if (st == BK_OK && fully)
            st = bk_fwd_attention(j->fwd, orig, j->x, sb, ob, j->q_rot, j->k_rot, NULL);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        t = bk_now();
        if (j->acc)
            st = bk_hess_add_attn(j->acc, orig, j->x, fully ? j->q_rot : NULL,
                                  fully ? j->k_rot : NULL, sb);
        if (st == BK_OK && j->acc_gptq)
            st = bk_hess_add_attn(j->acc_gptq, orig, j->x, NULL, NULL, sb);
        *t_hessian += bk_now() - t;
        return st;
    case BK_STAGE_O:
        /* o_proj sees the quantized q/k/v */
        st = bk_fwd_attn_in(j->fwd, lw, hb, sb, j->x);
        if (st == BK_OK)
            st = bk_fwd_attention(j->fwd, lw, j->x, sb, ob, NULL, NULL, NULL);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        t = bk_now();
        if (j->acc)
            st = bk_hess_add_o(j->acc, ob, sb);
        if (st == BK_OK && j->acc_gptq)
            st = bk_hess_add_o(j->acc_gptq, ob, sb);
        *t_hessian += bk_now() - t;
        return st;
    case BK_STAGE_MLP:
        /* residual with the quantized o_proj; gate/up from mlp_in */
        st = bk_fwd_attn_out(j->fwd, lw, ob, sb, hb);
        if (st == BK_OK)
            st = bk_fwd_mlp_in(j->fwd, lw, hb, sb, j->x);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        t = bk_now();
        if (j->acc)
            st = bk_hess_add_mlp(j->acc, orig, j->x, sb);
        if (st == BK_OK && j->acc_gptq)
            st = bk_hess_add_mlp(j->acc_gptq, orig, j->x, sb);
        *t_hessian += bk_now() - t;
        return st;
    case BK_STAGE_DOWN: {
        /* down_proj sees the quantized gate/up */
        float *d = j->D ? j->D + s0 * T * j->cfg->intermediate : j->down;
        st = bk_fwd_mlp_in(j->fwd, lw, hb, sb, j->x);
        if (st == BK_OK)
            st = bk_fwd_mlp_hidden(j->fwd, lw, j->x, sb, d, NULL, NULL);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        t = bk_now();
        if (j->acc)
            st = bk_hess_add_down(j->acc, d, sb);
        if (st == BK_OK && j->acc_gptq)
            st = bk_hess_add_down(j->acc_gptq, d, sb);
        *t_hessian += bk_now() - t;
        return st;
    }
    case BK_STAGE_OUT:
        /* the layer's output with every module quantized (h is unchanged since
         * stage DOWN: its down_proj inputs are kept when they fit) */
        if (j->D) {
            st = bk_fwd_mlp_out(j->fwd, lw, j->D + s0 * T * j->cfg->intermediate, sb, hb);
        } else {
            st = bk_fwd_mlp_in(j->fwd, lw, hb, sb, j->x);
            if (st == BK_OK)
                st = bk_fwd_mlp_hidden(j->fwd, lw, j->x, sb, j->down, NULL, NULL);
            if (st == BK_OK)
                st = bk_fwd_mlp_out(j->fwd, lw, j->down, sb, hb);
        }
        *t_forward += bk_now() - t;
        return st;
    case BK_STAGE_FULL:
        st = bk_fwd_layer(j->fwd, orig, sb, hb, NULL);
        *t_forward += bk_now() - t;
        return st;
    case BK_STAGE_TAPS: {
        /* full-precision inputs for every module: one pass with taps */
        bk_layer_taps taps = {.attn_in = j->x, .o_in = j->o_in, .mlp_in = j->mlp_in,
                              .down_in = j->down, .q_rot = fully ? j->q_rot : NULL,
                              .k_rot = fully ? j->k_rot : NULL};
        st = bk_fwd_layer(j->fwd, orig, sb, hb, &taps);
        *t_forward += bk_now() - t;
        if (st != BK_OK)
            return st;
        return add_all_modules(j, orig, j->x, j->o_in, j->mlp_in, j->down, fully, sb,
                               t_hessian);
    }
    }
    return bk_error(BK_ERR_INTERNAL, "pipeline: unknown stage %d", (int)stage);
}

static bk_status cpu_factors(void *ctx, bk_module mod, const float **A, const float **B,
                             const float **A_plain)
{
    job *j = ctx;
    bk_status st;
    *A = *B = *A_plain = NULL;
    if (j->acc && (st = bk_hess_factors(j->acc, j->cur_orig, mod, A, B)) != BK_OK)
        return st;
    if (j->acc_gptq) {
        const float *dummy = NULL;
        return bk_hess_factors(j->acc_gptq, j->cur_orig, mod, A_plain, &dummy);
    }
    *A_plain = *A;
    return BK_OK;
}

static bk_status cpu_weight_updated(void *ctx, bk_module mod, const float *w)
{
    (void)ctx; /* the driver updated the working copy the CPU stages read */
    (void)mod;
    (void)w;
    return BK_OK;
}

static void cpu_layer_end(void *ctx)
{
    job *j = ctx;
    j->cur_orig = NULL;
    j->cur_lw = NULL;
}

static void cpu_destroy(void *ctx)
{
    (void)ctx; /* the job owns the CPU state */
}

static const char *cpu_describe(void *ctx)
{
    (void)ctx;
    return "";
}

static const bk_stage_ops cpu_stage_ops = {
    "cpu", cpu_embed, cpu_layer_begin, cpu_run, cpu_factors, cpu_weight_updated,
    NULL, NULL, cpu_layer_end, cpu_destroy, cpu_describe, NULL,
    NULL, NULL, /* sums, share_weight: the driver holds the CPU stages' sums (j->acc) */
};

/* dst = a deep copy of src (the working copy starts as the original). */
static bk_status layer_weights_copy(const bk_model_config *c, const bk_layer_weights *src,
                                    bk_layer_weights *dst)
{
    memset(dst, 0, sizeof *dst);
    dst->layer = src->layer;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t o, in;
        bk_module_shape(c, (bk_module)i, &o, &in);
        if (src->w[i]) {
            if (!(dst->w[i] = bk_alloc((size_t)(o * in), sizeof(float))))
                goto nomem;
            memcpy(dst->w[i], src->w[i], (size_t)(o * in) * sizeof(float));
        }
        if (src->b[i]) {
            if (!(dst->b[i] = bk_alloc((size_t)o, sizeof(float))))
                goto nomem;
            memcpy(dst->b[i], src->b[i], (size_t)o * sizeof(float));
        }
    }
    const float *sv[4] = {src->attn_norm, src->mlp_norm, src->q_norm, src->k_norm};
    float **dv[4] = {&dst->attn_norm, &dst->mlp_norm, &dst->q_norm, &dst->k_norm};
    const int64_t len[4] = {c->hidden, c->hidden, c->head_dim, c->head_dim};
    for (int i = 0; i < 4; i++) {
        if (!sv[i])
            continue;
        if (!(*dv[i] = bk_alloc((size_t)len[i], sizeof(float))))
            goto nomem;
        memcpy(*dv[i], sv[i], (size_t)len[i] * sizeof(float));
    }
    return BK_OK;
nomem:
    bk_layer_weights_free(dst);
    return bk_error(BK_ERR_NOMEM, "layer %d: out of memory for the working copy of the weights",
                    src->layer);
}

/* ------------------------------------------------- one layer, token calibration */

/* The micro-batches of this rank's sequences [s_lo, s_hi) (all sequences in
 * one process). */
#define MB_LOOP(j, s0, sb) BK_MB_LOOP((j)->s_lo, (j)->s_hi, (j)->batch, s0, sb)

/* ------------------------------------------- MPI ranks, data parallel
 * (docs/DISTRIBUTED.md). Every rank holds the layer and runs the stages on
 * its share of the sequences (whole micro-batches, the single process's
 * boundaries); the Hessian sums of a stage are combined (ordered: passed
 * from rank to rank, each adding its micro-batches, so the sums are formed in
 * the single process's order; sum: partial sums added in rank order), then
 * known to every rank; the stage's module solves are spread over the ranks
 * and every result is broadcast, so all ranks continue with the same
 * quantized weights. Failures: every collective is preceded by a status
 * exchange (jsync) at a point all ranks reach in the same order; a rank that
 * fails goes on to the next exchange, where every rank learns it. */

/* bk_dist_sync, remembering that the failure is known to every rank. */
static bk_status jsync(job *j, bk_status st)
{
    if (j->nranks <= 1)
        return st;
    st = bk_dist_sync(j->dist, st);
    if (st != BK_OK)
        j->agreed = 1;
    return st;
}

/* This rank's micro-batches: a contiguous share, the single process's
 * boundaries (one process: all sequences). */
static bk_status split_ranks(job *j)
{
    j->s_lo = 0;
    j->s_hi = j->S;
    if (j->nranks <= 1 || j->S <= 0)
        return BK_OK;
    const int64_t nmb = (j->S + j->batch - 1) / j->batch;
    if (nmb < j->nranks)
        return bk_error(BK_ERR_INVALID_ARG,
                        "quantize: %d MPI ranks but only %lld micro-batches of %lld sequences "
                        "(every rank needs one): use fewer ranks or a smaller --batch",
                        j->nranks, (long long)nmb, (long long)j->batch);
    j->s_lo = nmb * j->rank / j->nranks * j->batch;
    j->s_hi = nmb * (j->rank + 1) / j->nranks * j->batch;
    if (j->s_hi > j->S)
        j->s_hi = j->S;
    return BK_OK;
}

/* The backend's own (GPU) stages with several ranks: the ranks agree on the
 * micro-batch (a rank short of device memory may have reduced it: the
 * smallest, so the boundaries are the same on every rank) and on how device
 * buffers are exchanged: NCCL when compiled in and every rank has a GPU of
 * its own (NCCL refuses two ranks on one GPU), else host copies over MPI. */
static bk_status dev_stages_ranks(job *j, int64_t *batch)
{
    if (!j->ops->sums || !j->ops->share_weight)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "quantize: the %s stages cannot run with several MPI ranks: add "
                        "--cpu-stages, or run one rank",
                        j->ops->name);
    bk_status st = bk_dist_min_i64(j->dist, batch);
    if (st != BK_OK)
        return st;
    j->dev_stages_ranks = 1;
    unsigned char mine[17], *all = calloc((size_t)j->nranks, sizeof mine);
    if (!all)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    memset(mine, 0, sizeof mine);
    mine[16] = (unsigned char)bk_backend_device_uuid(j->backend, mine);
    st = bk_dist_allgather(j->dist, mine, sizeof mine, all);
    int shared = 0, unknown = 0;
    for (int r = 0; st == BK_OK && r < j->nranks; r++) {
        unknown |= !all[r * sizeof mine + 16];
        for (int q = 0; q < r; q++)
            shared |= !memcmp(all + r * sizeof mine, all + q * sizeof mine, sizeof mine);
    }
    free(all);
    if (st != BK_OK)
        return st;
    if (!bk_dist_nccl_compiled()) {
        j->coll_desc = "MPI over host copies (built without NCCL)";
    } else if (shared || unknown) {
        j->coll_desc = "MPI over host copies (ranks share a GPU: NCCL needs one GPU per rank)";
    } else {
        j->dev_coll = 1;
        j->coll_desc = j->o->dist_reduce == BK_DIST_ORDERED
                           ? "NCCL broadcasts; the ordered pass over MPI with host copies"
                           : "NCCL all-reduce and broadcasts";
        st = jsync(j, bk_dist_dev_init(j->dist));
    }
    return st;
}

static unsigned stage_modules(bk_stage stage)
{
    switch (stage) {
    case BK_STAGE_QKV: return 1u << BK_MOD_Q | 1u << BK_MOD_K | 1u << BK_MOD_V;
    case BK_STAGE_O: return 1u << BK_MOD_O;
    case BK_STAGE_MLP: return 1u << BK_MOD_GATE | 1u << BK_MOD_UP;
    case BK_STAGE_DOWN: return 1u << BK_MOD_DOWN;
    case BK_STAGE_TAPS: return (1u << BK_MOD_COUNT) - 1;
    default: return 0;
    }
}

typedef struct sum_ctx {
    job *j;
    int op, peer; /* op: 0 receive from peer, 1 send to peer, 2 broadcast from peer, 3 sum */
} sum_ctx;

/* One buffer (host, or a device buffer with dev: NCCL) through the op. */
static bk_status sum_buf(void *user, void *buf, size_t n, int f64, int dev, void *stream)
{
    sum_ctx *c = user;
    const size_t bytes = n * (f64 ? sizeof(double) : sizeof(float));
    if (dev)
        return c->op == 2 ? bk_dist_bcast_dev(c->j->dist, buf, bytes, c->peer, stream)
                          : bk_dist_sum_dev(c->j->dist, buf, n, f64, stream);
    switch (c->op) {
    case 0: return bk_dist_recv(c->j->dist, buf, bytes, c->peer, 11);
    case 1: return bk_dist_send(c->j->dist, buf, bytes, c->peer, 11);
    case 2: return bk_dist_bcast(c->j->dist, buf, bytes, c->peer);
    default: return bk_dist_sum_ordered(c->j->dist, buf, n, f64);
    }
}

static bk_status sum_one(void *user, void *buf, size_t n, int f64)
{
    return sum_buf(user, buf, n, f64, 0, NULL);
}

static bk_status acc_sums(job *j, unsigned mods, int op, int peer)
{
    sum_ctx c = {j, op, peer};
    bk_status st = BK_OK;
    if (j->dev_stages_ranks) {
        /* the stages' own (device) sums: a receive only writes them, a send
         * only reads them; broadcasts and sums on the device with NCCL */
        const int rw = op == 0   ? BK_BUF_WRITE
                       : op == 1 ? BK_BUF_READ
                       : op == 2 ? (j->rank == peer ? BK_BUF_READ : BK_BUF_WRITE)
                                 : BK_BUF_READ | BK_BUF_WRITE;
        return j->ops->sums(j->ops_ctx, mods, j->dev_coll && op >= 2, rw, sum_buf, &c);
    }
    if (j->acc)
        st = bk_hess_acc_sums(j->acc, mods, sum_one, &c);
    if (st == BK_OK && j->acc_gptq)
        st = bk_hess_acc_sums(j->acc_gptq, mods, sum_one, &c);
    return st;
}

/* A Hessian stage over several ranks: agree, (ordered) receive the sums from
 * the rank before, run this rank's micro-batches, pass them on, agree, and
 * make the complete sums known to every rank. */
static bk_status run_stage_ranks(job *j, bk_stage stage)
{
    const unsigned mods = stage_modules(stage);
    const int ordered = j->o->dist_reduce == BK_DIST_ORDERED;
    bk_status st = jsync(j, BK_OK);
    if (st != BK_OK)
        return st;
    int ok = 1; /* ordered: the ranks before succeeded */
    if (ordered && j->rank > 0) {
        st = bk_dist_recv(j->dist, &ok, sizeof ok, j->rank - 1, 10);
        if (st == BK_OK && ok)
            st = acc_sums(j, mods, 0, j->rank - 1);
        if (st != BK_OK)
            return st; /* the communication is broken: every later call fails */
    }
    if (ok) {
        MB_LOOP(j, s0, sb) {
            st = j->ops->run(j->ops_ctx, stage, s0, sb, &j->t_forward, &j->t_hessian);
            if (st != BK_OK)
                break;
        }
    }
    if (ordered && j->rank + 1 < j->nranks) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", bk_last_error());
        int pass = ok && st == BK_OK;
        bk_status cs = bk_dist_send(j->dist, &pass, sizeof pass, j->rank + 1, 10);
        if (cs == BK_OK && pass)
            cs = acc_sums(j, mods, 1, j->rank + 1);
        if (cs != BK_OK)
            return cs;
        if (st != BK_OK)
            bk_error(st, "%s", msg);
    }
    if ((st = jsync(j, st)) != BK_OK)
        return st;
    double t = bk_now();
    st = ordered ? acc_sums(j, mods, 2, j->nranks - 1) : acc_sums(j, mods, 3, 0);
    bk_prof_add("dist.hessian_sums", bk_now() - t);
    return st;
}

/* The owner's result, broadcast to every rank (header, then arrays). */
static bk_status share_solved(job *j, bk_module mod, int owner, solved *sv)
{
    struct {
        int64_t m, n, groups, dead_columns, clamped;
        double damp_a, damp_b, loss_two_sided, loss_one_sided, bound, tf, ts, tst, loss_gptq;
        int32_t damp_retries, alg, two_sided, has_zeros, has_codes, has_scales, has_weight;
    } h;
    memset(&h, 0, sizeof h);
    bk_solve_result *r = &sv->r;
    if (j->rank == owner) {
        h.m = r->m, h.n = r->n, h.groups = r->groups, h.dead_columns = r->dead_columns;
        h.clamped = r->clamped, h.damp_a = r->damp_a, h.damp_b = r->damp_b;
        h.loss_two_sided = r->loss_two_sided, h.loss_one_sided = r->loss_one_sided;
        h.bound = r->bound, h.tf = r->time_factor_s, h.ts = r->time_solve_s;
        h.tst = r->time_stats_s, h.loss_gptq = sv->loss_gptq, h.damp_retries = r->damp_retries;
        h.alg = sv->alg, h.two_sided = sv->two_sided, h.has_zeros = r->zeros != NULL;
        h.has_codes = r->codes != NULL, h.has_scales = r->scales != NULL;
        h.has_weight = r->weight != NULL;
    }
    bk_status st = bk_dist_bcast(j->dist, &h, sizeof h, owner);
    if (st != BK_OK)
        return st;
    if (j->rank != owner) {
        int64_t m, n;
        bk_module_shape(j->cfg, mod, &m, &n);
        if (h.m != m || h.n != n || h.groups < 0 || h.groups > n)
            return bk_error(BK_ERR_INTERNAL, "rank %d: %s: a solve of shape %lldx%lld arrived",
                            j->rank, bk_module_name(mod), (long long)h.m, (long long)h.n);
        memset(sv, 0, sizeof *sv);
        r->m = h.m, r->n = h.n, r->groups = h.groups, r->dead_columns = h.dead_columns;
        r->clamped = h.clamped, r->damp_a = h.damp_a, r->damp_b = h.damp_b;
        r->loss_two_sided = h.loss_two_sided, r->loss_one_sided = h.loss_one_sided;
        r->bound = h.bound, r->time_factor_s = h.tf, r->time_solve_s = h.ts;
        r->time_stats_s = h.tst, sv->loss_gptq = h.loss_gptq, r->damp_retries = h.damp_retries;
        sv->alg = h.alg, sv->two_sided = h.two_sided;
        const size_t mn = (size_t)(h.m * h.n), mg = (size_t)(h.m * h.groups);
        if ((h.has_codes && !(r->codes = bk_alloc(mn, sizeof *r->codes))) ||
            (h.has_scales && !(r->scales = bk_alloc(mg, sizeof *r->scales))) ||
            (h.has_zeros && !(r->zeros = bk_alloc(mg, sizeof *r->zeros))) ||
            (h.has_weight && !(r->weight = bk_alloc(mn, sizeof *r->weight))))
            return bk_error(BK_ERR_NOMEM, "rank %d: out of memory for a solve", j->rank);
    }
    const size_t mn = (size_t)(h.m * h.n), mg = (size_t)(h.m * h.groups);
    if (st == BK_OK && h.has_weight)
        st = bk_dist_bcast(j->dist, r->weight, mn * sizeof *r->weight, owner);
    if (st == BK_OK && h.has_codes)
        st = bk_dist_bcast(j->dist, r->codes, mn * sizeof *r->codes, owner);
    if (st == BK_OK && h.has_scales)
        st = bk_dist_bcast(j->dist, r->scales, mg * sizeof *r->scales, owner);
    if (st == BK_OK && h.has_zeros)
        st = bk_dist_bcast(j->dist, r->zeros, mg * sizeof *r->zeros, owner);
    return st;
}

/* Solve modules m0..m1 of a layer (independent: one stage's sums). One
 * process: in order. Ranks: module m is solved by rank m % ranks, then every
 * result is broadcast and applied on every rank in module order. */
static bk_status solve_group(job *j, int l, int m0, int m1, bk_layer_weights *lw,
                             const bk_layer_weights *orig)
{
    bk_status st = BK_OK;
    if (j->nranks <= 1) {
        for (int m = m0; m <= m1 && st == BK_OK; m++)
            st = solve_module(j, l, (bk_module)m, lw, orig);
        return st;
    }
    solved sv[BK_MOD_COUNT];
    memset(sv, 0, sizeof sv);
    double t = bk_now();
    for (int m = m0; m <= m1 && st == BK_OK; m++)
        if (m % j->nranks == j->rank)
            st = solve_compute(j, l, (bk_module)m, orig, &sv[m]);
    bk_prof_add("dist.solve_own", bk_now() - t);
    st = jsync(j, st);
    t = bk_now();
    bk_status ap = BK_OK; /* a failure applying: known at the next exchange */
    for (int m = m0; m <= m1 && st == BK_OK; m++) {
        const int owner = m % j->nranks;
        st = share_solved(j, (bk_module)m, owner, &sv[m]);
        /* device stages: the owner's solve_dev set its working copy; the
         * quantized weight goes to the others' (NCCL broadcast, or host copies) */
        if (st == BK_OK && j->dev_stages_ranks) {
            sum_ctx c = {j, 2, owner};
            st = j->ops->share_weight(j->ops_ctx, (bk_module)m, j->dev_coll,
                                      j->rank == owner ? BK_BUF_READ : BK_BUF_WRITE, sum_buf,
                                      &c);
        }
        if (st == BK_OK && ap == BK_OK)
            ap = solve_apply(j, l, (bk_module)m, lw, &sv[m]);
    }
    bk_prof_add("dist.solve_share", bk_now() - t);
    for (int m = m0; m <= m1; m++)
        bk_solve_result_free(&sv[m].r);
    if (st != BK_OK)
        return st;
    return jsync(j, ap);
}

/* One stage over every micro-batch (of this rank). */
static bk_status run_stage(job *j, bk_stage stage)
{
    static const char *const fk[] = {"fwd.qkv", "fwd.o", "fwd.mlp", "fwd.down", "fwd.out",
                                     "fwd.full", "fwd.taps"};
    static const char *const hk[] = {"hess.qkv", "hess.o", "hess.mlp", "hess.down", "hess.out",
                                     "hess.full", "hess.taps"};
    const double f0 = j->t_forward, h0 = j->t_hessian;
    if (j->nranks > 1 && stage_modules(stage)) {
        bk_status st = run_stage_ranks(j, stage);
        if (st != BK_OK)
            return st;
    } else {
        MB_LOOP(j, s0, sb) {
            bk_status st = j->ops->run(j->ops_ctx, stage, s0, sb, &j->t_forward, &j->t_hessian);
            if (st != BK_OK)
                return st;
        }
    }

    if ((unsigned)stage < sizeof fk / sizeof fk[0]) {
        bk_prof_add(fk[stage], j->t_forward - f0);
        bk_prof_add(hk[stage], j->t_hessian - h0);
    }
    return BK_OK;
}

/* Layer l with its original weights (orig, from the layer driver): the
 * stages and solves of a quantized layer, or the layer as it is. */
static bk_status layer_tokens(job *j, int l, const bk_layer_weights *origp)
{
    const bk_layer_weights orig = *origp;
    bk_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    int begun = 0;
    bk_status st = BK_OK;
    double t = bk_now();
    /* the host working copy is only needed where the stages or the solves
     * use host weights (the device stages keep their own) */
    const int dev = j->ops->factors_dev && j->ops->solve_dev;
    if (!dev)
        st = layer_weights_copy(j->cfg, &orig, &lw);
    j->t_io += bk_now() - t;
    if (st != BK_OK)
        goto done;
    const int quantize = layer_in_range(j, l);
    if (quantize)
        emit(j, BK_EV_LAYER_BEGIN, l, NULL, NULL);
    t = bk_now();
    st = j->ops->layer_begin(j->ops_ctx, &orig, dev ? &orig : &lw, quantize);
    j->t_io += bk_now() - t;
    bk_prof_add("io.layer_begin", bk_now() - t);
    if (st != BK_OK)
        goto done;
    begun = 1;
    /* backprop kinds: the stages that keep their own input side take the
     * flow's output side (j->acc: this layer's) */
    if (quantize && j->bp && j->ops->bp_grads) {
        bk_bp_side side;
        memset(&side, 0, sizeof side);
        side.layer = l;
        const int k = l - j->bp_leaf_lo;
        if (j->bp_dev && k >= 0 && k < j->bp_leaf && j->bp_dev[k].G[0] &&
            j->bp_dev[k].layer == l) {
            memcpy(side.G, j->bp_dev[k].G, sizeof side.G);
            memcpy(side.gw, j->bp_dev[k].gw, sizeof side.gw);
            side.N = j->bp_dev[k].N;
        } else {
            side.acc = j->acc;
        }
        t = bk_now();
        st = j->ops->bp_grads(j->ops_ctx, &side);
        j->t_hessian += bk_now() - t;
        if (st != BK_OK)
            goto done;
    }

    if (!quantize) {
        st = run_stage(j, BK_STAGE_FULL);
        goto done;
    }
    if (!j->o->sequential) {
        if ((st = run_stage(j, BK_STAGE_TAPS)) != BK_OK)
            goto done;
        st = solve_group(j, l, 0, BK_MOD_COUNT - 1, &lw, &orig);
        goto done;
    }
    /* stage 1: q, k, v from attn_in */
    if ((st = run_stage(j, BK_STAGE_QKV)) != BK_OK)
        goto done;
    if ((st = solve_group(j, l, BK_MOD_Q, BK_MOD_V, &lw, &orig)) != BK_OK)
        goto done;
    /* stage 2: o_proj sees the quantized q/k/v */
    if ((st = run_stage(j, BK_STAGE_O)) != BK_OK ||
        (st = solve_group(j, l, BK_MOD_O, BK_MOD_O, &lw, &orig)) != BK_OK)
        goto done;
    /* stage 3: residual with the quantized o_proj; gate/up from mlp_in */
    if ((st = run_stage(j, BK_STAGE_MLP)) != BK_OK ||
        (st = solve_group(j, l, BK_MOD_GATE, BK_MOD_UP, &lw, &orig)) != BK_OK)
        goto done;
    /* stage 4: down_proj sees the quantized gate/up */
    if ((st = run_stage(j, BK_STAGE_DOWN)) != BK_OK ||
        (st = solve_group(j, l, BK_MOD_DOWN, BK_MOD_DOWN, &lw, &orig)) != BK_OK)
        goto done;
    /* stage 5: the layer's output with every module quantized */
    st = run_stage(j, BK_STAGE_OUT);

done:
    t = bk_now();
    if (begun)
        j->ops->layer_end(j->ops_ctx);
    bk_layer_weights_free(&lw);
    bk_prof_add("io.layer_end", bk_now() - t);
    if (st == BK_OK && layer_in_range(j, l))
        emit(j, BK_EV_LAYER_DONE, l, NULL, NULL);
    return st;
}

/* Resume: the calibration state after finished layer l, rebuilt: the layer's
 * forward pass with the weights its modules were quantized to (saved codes and
 * scales; the original weights with --no-sequential, whose modules all saw
 * full-precision inputs). The same forward functions on the same micro-batches
 * as the run that quantized it, so the same bits. */
static bk_status layer_rebuild(job *j, int l, bk_layer_weights *w)
{
    /* w: the original weights (from the layer driver); then the quantized
     * ones in place */
    bk_status st = BK_OK;
    double t = bk_now();
    if (j->o->sequential)
        st = bk_resume_load_weights(j->rs, &j->o->solve.quant, j->cfg, l, w);
    bk_prof_add("resume.dequantize", bk_now() - t);
    j->t_io += bk_now() - t;
    double t1 = bk_now();
    if (st == BK_OK)
        st = j->ops->layer_begin(j->ops_ctx, w, w, 0);
    bk_prof_add("resume.layer_begin", bk_now() - t1);
    if (st == BK_OK) {
        st = run_stage(j, BK_STAGE_FULL);
        j->ops->layer_end(j->ops_ctx);
    }
    if (st != BK_OK)
        return bk_error_prefix(st, "--resume: rebuilding the calibration state");
    return BK_OK;
}

/* ------------------------------------- backprop kinds: the flow drives the layers */

static void bp_add_flow_time(job *j)
{
    const double t = j->bp_stats.time_forward_s + j->bp_stats.time_backward_s +
                     j->bp_stats.time_head_s;
    j->t_forward += t - j->bp_time_counted;
    j->bp_time_counted = t;
}

static void bp_pass_begin(void *user, const bk_bwd_pass_info *info)
{
    job *j = user;
    char msg[160];
    if (info->leaf)
        snprintf(msg, sizeof msg, "backward pass %d (%s, depth %d): gradients of layers %d-%d",
                 info->index + 1, bk_bwd_flow_name(j->o->bwd_flow), info->depth, info->lo + 1,
                 info->hi);
    else
        snprintf(msg, sizeof msg,
                 "backward pass %d (%s, depth %d): boundary gradient at layer %d (back through "
                 "layers %d-%d)",
                 info->index + 1, bk_bwd_flow_name(j->o->bwd_flow), info->depth, info->lo + 1,
                 info->lo + 1, info->hi);
    if (info->leaf)
        j->bp_leaf_lo = info->lo;
    bp_add_flow_time(j);
    emit(j, BK_EV_BACKWARD, info->lo, NULL, msg);
}

static bk_status bp_grads(void *user, int layer, int64_t s0, int64_t S, const bk_grad_taps *t)
{
    job *j = user;
    (void)s0;
    if (!layer_in_range(j, layer))
        return BK_OK;
    int k = layer - j->bp_leaf_lo;
    if (k < 0 || k >= j->bp_leaf)
        return bk_error(BK_ERR_INTERNAL, "backprop: layer %d outside the leaf at %d", layer,
                        j->bp_leaf_lo);
    double t0 = bk_now();
    bk_status st = BK_OK;
    for (int m = 0; m < BK_MOD_COUNT && st == BK_OK; m++)
        st = bk_hess_add_grad(j->bp_acc[k], layer, (bk_module)m, t->g[m], t->a[m], S);
    j->t_hessian += bk_now() - t0;
    return st;
}

/* A device's flow: a leaf layer's output-gradient Grams over the whole calibration set */
static bk_status bp_grams(void *user, int layer, bk_module mod, const double *G, const double *gw,
                          int64_t S)
{
    job *j = user;
    if (!layer_in_range(j, layer))
        return BK_OK;
    int k = layer - j->bp_leaf_lo;
    if (k < 0 || k >= j->bp_leaf)
        return bk_error(BK_ERR_INTERNAL, "backprop: layer %d outside the leaf at %d", layer,
                        j->bp_leaf_lo);
    double t0 = bk_now();
    bk_status st = bk__hess_add_grad_gram(j->bp_acc[k], layer, mod, G, gw, S);
    j->t_hessian += bk_now() - t0;
    return st;
}

/* The GPU flow with the GPU stages: the leaf layer's device Grams, kept for
 * the stages (bp_grads) until bp_leaf_done returns */
static bk_status bp_grams_dev(void *user, int layer, bk_module mod, const double *G,
                              const double *gw, int64_t S)
{
    job *j = user;
    int k = layer - j->bp_leaf_lo;
    if (k < 0 || k >= j->bp_leaf || !j->bp_dev)
        return bk_error(BK_ERR_INTERNAL, "backprop: layer %d outside the leaf at %d", layer,
                        j->bp_leaf_lo);
    j->bp_dev[k].G[mod] = G;
    j->bp_dev[k].gw[mod] = gw;
    j->bp_dev[k].N = S * j->T;
    j->bp_dev[k].layer = layer;
    return BK_OK;
}

static bk_status bp_leaf_done(void *user, int lo, int hi)
{
    job *j = user;
    bp_add_flow_time(j);
    const double t0 = bk_now();
    bk_status st = BK_OK;
    for (int l = lo; l < hi && l < j->layer_end && st == BK_OK; l++) {
        j->acc = j->bp_acc[l - lo];
        /* the layer, the checks after it (unchanged checkpoint, stop) */
        st = bk_driver_layer(&j->drv, l);
        bk_hess_acc_reset(j->acc);
    }
    j->acc = j->bp_acc[0];
    if (j->bp_dev) /* the flow reuses its Grams for the next leaf */
        memset(j->bp_dev, 0, (size_t)j->bp_leaf * sizeof *j->bp_dev);
    bk_prof_add("bp.leaf_layers (input stages, solves)", bk_now() - t0);
    return st;
}

static bk_status run_backprop(job *j)
{
    bk_bwd_flow_opts fo = {j->o->bwd_flow, j->bp_leaf, j->o->fisher, j->o->seed, j->batch};
    bk_bwd_flow_cb cb = {j, bp_pass_begin, bp_grads, bp_leaf_done, NULL, 0, NULL};
    bk_status st;
    const double t0 = bk_now();
    if (j->bp_gpu) {
        /* the Grams on the device, not the taps on the host; they stay there
         * for stages that take them (the GPU stages), else are downloaded */
        cb.grads = NULL;
        if (j->ops->bp_grads) {
            j->bp_dev = calloc((size_t)j->bp_leaf, sizeof *j->bp_dev);
            if (!j->bp_dev)
                return bk_error(BK_ERR_NOMEM, "quantize: out of memory");
            cb.grams_dev = bp_grams_dev;
        } else {
            cb.grams = bp_grams;
        }
        cb.gram_weighted = j->o->hessian == BK_HESS_BACKPROP_SHAMPOO;
        st = bk_backend_bwd_flow_run(j->backend, j->model, j->tokens, j->S, j->T, &fo,
                                     (int)j->o->bwd_precision, &cb, &j->bp_stats);
    } else {
        st = bk_bwd_flow_run(j->model, j->tokens, j->S, j->T, &fo, &cb, &j->bp_stats);
    }
    bk_prof_add("bp.total (flow and leaf layers)", bk_now() - t0);
    bp_add_flow_time(j);
    return st;
}

/* ------------------------------------------- one layer, dumped activations */

static bk_status layer_acts(job *j, int l, const bk_layer_weights *origp)
{
    const bk_model_config *c = j->cfg;
    const bk_layer_weights orig = *origp;
    bk_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    if (!layer_in_range(j, l))
        return BK_OK;
    emit(j, BK_EV_LAYER_BEGIN, l, NULL, NULL);
    double t = bk_now();
    bk_status st = layer_weights_copy(j->cfg, &orig, &lw);
    bk_act_layer al;
    memset(&al, 0, sizeof al);
    if (st == BK_OK)
        st = bk__act_layer_open(j->acts, l, &al);
    j->t_io += bk_now() - t;
    if (st == BK_OK)
        st = j->ops->layer_begin(j->ops_ctx, &orig, &lw, 1); /* resets the accumulators */
    if (st != BK_OK)
        goto done;
    int fully = j->fully;
    const int64_t T = j->T, hid = c->hidden, qd = c->n_heads * c->head_dim,
                  inter = c->intermediate;
    float *mlp_in = bk_alloc((size_t)(j->batch * T * hid), sizeof(float));
    if (!mlp_in) {
        st = bk_error(BK_ERR_NOMEM, "out of memory for activations");
        goto done;
    }
    MB_LOOP(j, s0, sb) {
        int64_t r0 = s0 * T, nr = sb * T;
        t = bk_now();
        st = bk__act_rows(&al, "attn_in", r0, nr, hid, j->x);
        if (st == BK_OK)
            st = bk__act_rows(&al, "o_in", r0, nr, qd, j->o_in);
        if (st == BK_OK)
            st = bk__act_rows(&al, "mlp_in", r0, nr, hid, mlp_in);
        if (st == BK_OK)
            st = bk__act_rows(&al, "down_in", r0, nr, inter, j->down);
        j->t_io += bk_now() - t;
        if (st != BK_OK)
            break;
        if (fully) {
            /* queries/keys after norm and RoPE, recomputed from attn_in */
            t = bk_now();
            float *scratch = bk_alloc((size_t)(nr * qd), sizeof(float));
            if (!scratch) {
                st = bk_error(BK_ERR_NOMEM, "out of memory for attention");
                break;
            }
            st = bk_fwd_attention(j->fwd, &orig, j->x, sb, scratch, j->q_rot, j->k_rot, NULL);
            free(scratch);
            j->t_forward += bk_now() - t;
            if (st != BK_OK)
                break;
        }
        st = add_all_modules(j, &orig, j->x, j->o_in, mlp_in, j->down, fully, sb,
                             &j->t_hessian);
        if (st != BK_OK)
            break;
    }
    free(mlp_in);
    if (st != BK_OK)
        goto done;
    for (int m = 0; m < BK_MOD_COUNT && st == BK_OK; m++)
        st = solve_module(j, l, (bk_module)m, &lw, &orig);
done:
    j->ops->layer_end(j->ops_ctx);
    bk__act_layer_close(&al);
    bk_layer_weights_free(&lw);
    if (st == BK_OK)
        emit(j, BK_EV_LAYER_DONE, l, NULL, NULL);
    return st;
}

/* ------------------------------------------- the layer driver's bodies */

/* Token calibration: kept layers (--resume) are rebuilt, the others
 * quantized and journaled, or (before the range) run as they are. */
static bk_status quantize_layer(void *user, int l, bk_layer_weights *w)
{
    job *j = user;
    j->t_io += j->drv.t_load_last;
    /* (backprop kinds: the flow's leaves call this; a resumed run redoes the
     * flow, whose passes use the original model only, and rebuilds the kept
     * layers from their saved codes as every kind does) */
    const int kept = layer_in_range(j, l) && l < j->first_layer;
    bk_status st = kept ? layer_rebuild(j, l, w) : layer_tokens(j, l, w);
    if (st == BK_OK && !kept && layer_in_range(j, l))
        st = journal_layer(j, l);
    return st;
}

/* Dumped activations (w: the layer's weights), or rtn without calibration
 * (w NULL: the modules are read one by one). */
static bk_status offline_layer(void *user, int l, bk_layer_weights *w)
{
    job *j = user;
    bk_status st;
    j->t_io += j->drv.t_load_last;
    if (j->acts) {
        st = layer_acts(j, l, w);
    } else {
        st = bk__layer_rtn(j->model, j->backend, j->out, j->o, j->cfg, l, j->report_modules,
                           &j->quantized_params);
        if (st == BK_OK) /* (written on this thread: the journal after them) */
            st = writer_drain(j);
    }
    if (st == BK_OK)
        st = journal_layer(j, l);
    if (st == BK_OK && !j->acts)
        st = writer_drain(j);
    return st;
}

/* ------------------------------------------------------------ metadata files */

static bk_status write_config_and_report(job *j)
{
    const bk_quantize_opts *o = j->o;
    char path[4096];
    char *text = NULL;
    bk_status st;
    st = bk_path_join(path, sizeof path, o->model_dir, "config.json");
    if (st != BK_OK)
        return st;
    st = bk_read_file(path, BK_CONFIG_MAX_BYTES, &text, NULL);
    if (st != BK_OK)
        return st;
    cJSON *cfg = cJSON_Parse(text);
    free(text);
    if (!cfg)
        return bk_error(BK_ERR_CONFIG, "%s: cannot parse", path);

    cJSON *qc = bk__quantization_config(o, j->cfg, j->S, j->T, j->layer_begin, j->layer_end);
    if (!qc) {
        cJSON_Delete(cfg);
        return bk_error(BK_ERR_NOMEM, "out of memory building quantization_config");
    }
    if (o->export_format == BK_EXPORT_DEQUANTIZED) {
        /* an ordinary checkpoint: record provenance under another key */
        cJSON_DeleteItemFromObject(cfg, "quantization_config");
        cJSON_AddItemToObject(cfg, "bakron_dequantized_from", qc);
    } else {
        cJSON_DeleteItemFromObject(cfg, "quantization_config");
        cJSON_AddItemToObject(cfg, "quantization_config", qc);
        if (o->export_format == BK_EXPORT_GPTQ) {
            char *q = cJSON_Print(qc);
            if (q) {
                st = bk_path_join(path, sizeof path, j->od.work, "quantize_config.json");
                if (st == BK_OK)
                    st = bk_write_file_atomic(path, q, strlen(q));
                free(q);
                if (st != BK_OK) {
                    cJSON_Delete(cfg);
                    return st;
                }
            }
        }
    }
    char *out = cJSON_Print(cfg);
    st = bk__write_model_card(j->od.work, cfg);
    cJSON_Delete(cfg);
    if (!out)
        return bk_error(BK_ERR_NOMEM, "out of memory writing config.json");
    if (st != BK_OK) {
        free(out);
        return st;
    }
    st = bk_path_join(path, sizeof path, j->od.work, "config.json");
    if (st == BK_OK)
        st = bk_write_file_atomic(path, out, strlen(out));
    free(out);
    if (st != BK_OK)
        return st;

    /* report.json */
    cJSON *rep = cJSON_CreateObject();
    cJSON_AddStringToObject(rep, "bakron_version", BK_VERSION);
    cJSON_AddStringToObject(rep, "model", o->model_dir);
    cJSON_AddStringToObject(rep, "backend", bk_backend_name(j->backend));
    cJSON_AddStringToObject(rep, "device", bk_backend_device(j->backend));
    if (j->ops && j->ops != &cpu_stage_ops) /* the backend's own stages */
        cJSON_AddStringToObject(rep, "gpu_math", bk_gemm_math_name(j->gemm_math));
    cJSON_AddStringToObject(rep, "stages", j->ops ? j->ops->name : "cpu");
    if (j->ops && j->ops->describe(j->ops_ctx)[0])
        cJSON_AddStringToObject(rep, "stages_detail", j->ops->describe(j->ops_ctx));
    cJSON_AddNumberToObject(rep, "batch", (double)j->batch);
    cJSON_AddNumberToObject(rep, "peak_device_bytes", (double)bk_backend_peak_memory(j->backend));
    cJSON_AddItemToObject(rep, "quantization",
                          bk__quantization_config(o, j->cfg, j->S, j->T, j->layer_begin, j->layer_end));
    cJSON *times = cJSON_AddObjectToObject(rep, "times_s");
    cJSON_AddNumberToObject(times, "total", bk_now() - j->t0);
    cJSON_AddNumberToObject(times, "forward", j->t_forward);
    cJSON_AddNumberToObject(times, "hessian", j->t_hessian);
    cJSON_AddNumberToObject(times, "factor", j->t_factor);
    cJSON_AddNumberToObject(times, "solve", j->t_solve);
    /* packing and writing the quantized modules in the writer thread, overlapped
     * with the solves (not part of total - the stages) */
    cJSON_AddNumberToObject(times, "write_overlapped", j->wr.busy_s);
    cJSON_AddNumberToObject(times, "io", j->t_io);
    cJSON_AddNumberToObject(rep, "quantized_parameters", (double)j->quantized_params);
    if (j->dist) {
        cJSON *mp = cJSON_AddObjectToObject(rep, "mpi");
        cJSON_AddNumberToObject(mp, "ranks", j->nranks);
        cJSON_AddStringToObject(mp, "mode", "data parallel");
        cJSON_AddStringToObject(mp, "reduce",
                                o->dist_reduce == BK_DIST_ORDERED ? "ordered" : "sum");
        if (j->coll_desc)
            cJSON_AddStringToObject(mp, "device_collectives", j->coll_desc);
    }
    if (j->bp) {
        const bk_bwd_flow_stats *bs = &j->bp_stats;
        cJSON *b = cJSON_AddObjectToObject(rep, "backprop");
        cJSON_AddStringToObject(b, "flow", bk_bwd_flow_name(o->bwd_flow));
        cJSON_AddStringToObject(b, "device", j->bp_gpu ? bk_backend_name(j->backend) : "cpu");
        cJSON_AddStringToObject(b, "input_stages", j->ops ? j->ops->name : "cpu");
        static const char *const bwd_prec[] = {"fp32", "fp64", "tf32", "bf16"};
        cJSON_AddStringToObject(b, "precision",
                                !j->bp_gpu ? "fp64" : bwd_prec[(unsigned)o->bwd_precision & 3]);
        cJSON_AddNumberToObject(b, "leaf_size", j->bp_leaf);
        cJSON_AddStringToObject(b, "fisher", bk_fisher_name(o->fisher));
        cJSON_AddNumberToObject(b, "seed", (double)o->seed);
        cJSON_AddNumberToObject(b, "passes", bs->passes);
        cJSON_AddNumberToObject(b, "max_depth", bs->max_depth);
        cJSON_AddNumberToObject(b, "layer_forwards", (double)bs->layer_forwards);
        cJSON_AddNumberToObject(b, "layer_backwards", (double)bs->layer_backwards);
        cJSON_AddNumberToObject(b, "peak_boundary_host_bytes", (double)bs->peak_boundary_bytes);
        /* CPU: the flow's micro-batch buffers in host memory; GPU: its device buffers
         * (micro-batch, LM head), the layer weights aside */
        cJSON_AddNumberToObject(b, j->bp_gpu ? "micro_batch_device_bytes" : "micro_batch_host_bytes",
                                (double)bs->micro_bytes);
        cJSON_AddNumberToObject(b, "peak_boundary_device_bytes", 0);
        cJSON *bt = cJSON_AddObjectToObject(b, "times_s");
        cJSON_AddNumberToObject(bt, "forward", bs->time_forward_s);
        cJSON_AddNumberToObject(bt, "backward", bs->time_backward_s);
        cJSON_AddNumberToObject(bt, "head", bs->time_head_s);
    }
    cJSON_AddItemToObject(rep, "modules", j->report_modules);
    j->report_modules = NULL;
    out = cJSON_Print(rep);
    cJSON_Delete(rep);
    if (!out)
        return bk_error(BK_ERR_NOMEM, "out of memory writing report.json");
    st = bk_path_join(path, sizeof path, j->od.work, "report.json");
    if (st == BK_OK)
        st = bk_write_file_atomic(path, out, strlen(out));
    free(out);
    return st;
}

/* ------------------------------------------------------------------- driver */

static bk_status job_buffers(job *j)
{
    const bk_model_config *c = j->cfg;
    const int64_t T = j->T, B = j->batch;
    const int64_t qd = c->n_heads * c->head_dim, kd = c->n_kv_heads * c->head_dim;
    int64_t xw = c->hidden > qd ? c->hidden : qd;
    if (j->tokens) {
        j->h = bk_alloc((size_t)(j->N * c->hidden), sizeof(float));
        j->o_in = bk_alloc((size_t)(j->N * qd), sizeof(float));
    } else {
        j->o_in = bk_alloc((size_t)(B * T * qd), sizeof(float));
    }
    j->x = bk_alloc((size_t)(B * T * xw), sizeof(float));
    j->q_rot = bk_alloc((size_t)(B * T * qd), sizeof(float));
    j->k_rot = bk_alloc((size_t)(B * T * kd), sizeof(float));
    j->down = bk_alloc((size_t)(B * T * c->intermediate), sizeof(float));
    if (!j->o->sequential)
        j->mlp_in = bk_alloc((size_t)(B * T * c->hidden), sizeof(float));
    if ((j->tokens && !j->h) || !j->o_in || !j->x || !j->q_rot || !j->k_rot || !j->down ||
        (!j->o->sequential && !j->mlp_in))
        return bk_error(BK_ERR_NOMEM, "out of memory for calibration states (%lld tokens)",
                        (long long)j->N);
    /* keep the down_proj inputs between stages DOWN and OUT (saves recomputing
     * gate/up: a third of the forward work) when they take at most a quarter
     * of the physical memory; setting keep_down=0 turns it off */
    const int keep_down = bk_backend_get_params(j->backend)->keep_down;
    const long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
    const double need = (double)j->N * (double)c->intermediate * sizeof(float);
    if (j->tokens && j->o->sequential && keep_down && pages > 0 &&
        psize > 0 && need <= 0.25 * (double)pages * (double)psize)
        j->D = bk_alloc((size_t)(j->N * c->intermediate), sizeof(float)); /* NULL: recompute */
    return BK_OK;
}

static void job_free(job *j)
{
    bk_driver_end(&j->drv);
    free(j->tokens);
    free(j->h);
    free(j->o_in);
    free(j->x);
    free(j->q_rot);
    free(j->k_rot);
    free(j->down);
    free(j->mlp_in);
    free(j->D);
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
    if (j->acc)
        bk_hess_acc_free(j->acc);
    if (j->acc_gptq)
        bk_hess_acc_free(j->acc_gptq);
    if (j->fwd)
        bk_fwd_free(j->fwd);
    if (j->backend)
        bk_backend_destroy(j->backend);
    if (j->model)
        bk_model_close(j->model);
    cJSON_Delete(j->report_modules);
    bk_resume_free(j->rs);
    j->rs = NULL;
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
    /* MPI ranks: rank 0 alone reports and writes */
    bk_quantize_opts ranked;
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
        ranked = *o;
        if (j->rank != 0)
            ranked.on_event = NULL;
        j->o = o = &ranked;
    }

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
    if (j->bp && o->leaf_size < 1) {
        st = bk_error(BK_ERR_INVALID_ARG, "quantize: --leaf-size %d must be >= 1", o->leaf_size);
        goto fail;
    }
    if (j->bp && j->nranks > 1) {
        st = bk_error(BK_ERR_UNSUPPORTED,
                      "quantize: --hessian %s with several MPI ranks is not implemented yet (run "
                      "one process)",
                      bk_hessian_name(o->hessian));
        goto fail;
    }
    if (j->rank == 0) {
        /* the output folder first: refused (unsafe, exists), locked, leftovers cleaned */
        const char *inputs[] = {o->model_dir, o->calib_path ? o->calib_path : "",
                                o->calib_text ? o->calib_text : "",
                                o->activations_dir ? o->activations_dir : "",
                                o->config_path ? o->config_path : "", NULL};
        bk_outdir_spec os = {.out = o->out_dir, .inputs = inputs, .overwrite = o->overwrite,
                             .what = "quantize", .note = job_note, .user = j,
                             .resume = o->resume, .resumable = bk_resume_is_resumable};
        st = bk_outdir_open(&j->od, &os, &adopted);
        if (st != BK_OK)
            goto fail;
        if (o->resume && !adopted)
            emit(j, BK_EV_NOTE, 0, NULL,
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
            job_note(j, note);
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
    j->N = j->S * j->T;
    j->batch = o->batch > 0 ? o->batch : bk_fwd_auto_batch(j->cfg, 0, j->T);
    if (j->S > 0 && j->batch > j->S)
        j->batch = j->S;
    if (j->batch < 1)
        j->batch = 1;
    if ((st = split_ranks(j)) != BK_OK)
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
    j->fully = o->hessian == BK_HESS_FULLYLOCAL_KFAC || o->hessian == BK_HESS_FULLYLOCAL_SHAMPOO;
    j->ops = &cpu_stage_ops;
    j->ops_ctx = j;
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
    const int bp_gpu_stages =
        j->bp && (want_gpu || (j->bp_gpu && !bk_backend_get_params(j->backend)->bwd_input_cpu &&
                               bk_backend_supports(j->backend, BK_OP_STAGES)));
    if (want_gpu && cpu_stages) {
        st = bk_error(BK_ERR_INVALID_ARG,
                      "quantize: --gpu-pipeline and --cpu-stages contradict each other");
        goto fail;
    }
    /* forward + Hessians on the backend's own stages (the GPU's): asked for,
     * or the default of a backend that has them, with token calibration
     * (docs/DEVICE.md); else the CPU stages below */
    const int own_stages = bk_backend_supports(j->backend, BK_OP_STAGES);
    if (j->S > 0 && (j->bp ? bp_gpu_stages : (want_gpu || (!cpu_stages && j->tokens && own_stages)))) {
        if (!j->tokens) {
            st = bk_error(BK_ERR_INVALID_ARG,
                          "quantize: the GPU pipeline (--gpu-pipeline) "
                          "needs token calibration (--calib), not --activations");
            goto fail;
        }
        if (!own_stages) {
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
        const bk_stage_params sp = {
            .model = j->model,
            .kind = o->hessian == BK_HESS_RTN ? BK_HESS_GPTQ : o->hessian,
            .fp64 = o->hessian_fp64,
            .keep_plain = o->hessian == BK_HESS_MLPLOCAL_SHAMPOO ||
                          o->hessian == BK_HESS_FULLYLOCAL_SHAMPOO ||
                          o->hessian == BK_HESS_BACKPROP_SHAMPOO,
            .fully = j->fully,
            .codes_only = o->export_format != BK_EXPORT_DEQUANTIZED,
            .S = j->S,
            .T = j->T,
        };
        int64_t gb = o->batch > 0 ? j->batch : 0;
        st = bk_backend_stages_create(j->backend, &sp, &gb, &j->ops, &j->ops_ctx);
        if (j->nranks > 1) /* every rank learns a rank's failure here */
            st = jsync(j, st);
        if (st != BK_OK)
            goto fail;
        if (j->nranks > 1) {
            st = dev_stages_ranks(j, &gb);
            if (st != BK_OK)
                goto fail;
        }
        if (gb != j->batch) { /* the device's micro-batch: the ranks' shares again */
            j->batch = gb;
            if ((st = split_ranks(j)) != BK_OK)
                goto fail;
        }
    } else if (j->S > 0) {
        st = bk_fwd_create(j->cfg, j->batch, j->T, &j->fwd);
        if (st != BK_OK)
            goto fail;
        bk_hessian_kind hk = o->hessian == BK_HESS_RTN ? BK_HESS_GPTQ : o->hessian;
        if (!j->bp) { /* (backprop: its accumulators below) */
            st = bk_hess_acc_create(j->cfg, hk, o->hessian_fp64, j->T, &j->acc);
            if (st != BK_OK)
                goto fail;
        }
        if (o->hessian == BK_HESS_MLPLOCAL_SHAMPOO || o->hessian == BK_HESS_FULLYLOCAL_SHAMPOO ||
            o->hessian == BK_HESS_BACKPROP_SHAMPOO) {
            st = bk_hess_acc_create(j->cfg, BK_HESS_GPTQ, o->hessian_fp64, j->T, &j->acc_gptq);
            if (st != BK_OK)
                goto fail;
        }
        st = job_buffers(j);
        if (st != BK_OK)
            goto fail;
    }
    /* backprop kinds: one host accumulator per layer of a leaf; the flow's
     * output side enters it, and the input side too with the CPU stages (the
     * GPU stages take the output side from it: bp_grads) */
    if (j->S > 0 && j->bp) {
        j->bp_leaf = o->leaf_size < (int)j->cfg->n_layers ? o->leaf_size : (int)j->cfg->n_layers;
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
            .tokens = j->tokens};
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
        st = declare_outputs(j);
        int reused = 0;
        if (st == BK_OK && j->rs)
            st = bk_st_stream_open_files(j->out, &reused);
        if (st == BK_OK)
            st = write_passthrough(j);
        if (st == BK_OK && j->rs) {
            double t = bk_now();
            st = bk_resume_restore(j->rs, j->out, reused, j->report_modules, &j->quantized_params,
                                   &j->first_layer, job_note, j);
            bk_prof_add("resume.restore (digests)", bk_now() - t);
        }
        if (st != BK_OK)
            goto fail;
        writer_start(j);
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
        snprintf(msg, sizeof msg, "%s: %lld layers, hessian %s, %s, calibration %lld x %lld, backend %s%s%s%s",
                 o->model_dir, (long long)j->cfg->n_layers, bk_hessian_name(o->hessian),
                 bk_algorithm_name(o->solve.algorithm), (long long)j->S, (long long)j->T,
                 bk_backend_device(j->backend), sd[0] ? "; " : "", sd, rk);
        emit(j, BK_EV_START, j->layer_begin, NULL, msg);
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
    j->drv.layer = j->tokens ? quantize_layer : offline_layer;
    j->drv.user = j;
    j->drv.weights = j->tokens || j->acts;
    j->drv.end = j->layer_end;
    j->drv.stop_check = !j->tokens || j->bp; /* (else: after every module's solve) */
    j->drv.stop_first = j->layer_begin;
    j->drv.stop_count = j->layer_end - j->layer_begin;
    if (j->tokens) {
        double t = bk_now();
        st = bk_driver_embed(&j->drv);
        j->t_forward += bk_now() - t;
        if (st == BK_OK)
            st = j->bp ? run_backprop(j) : bk_driver_layers(&j->drv, 0, j->layer_end);
    } else {
        st = bk_driver_layers(&j->drv, j->first_layer, j->layer_end);
    }
    if (st != BK_OK)
        goto fail;

    emit(j, BK_EV_WRITE, j->layer_end - 1, NULL, "writing config.json, report.json, tokenizer files");
    if (j->rank != 0) { /* rank 0 writes; every rank learns how that went */
        if ((st = jsync(j, BK_OK)) != BK_OK || (st = jsync(j, BK_OK)) != BK_OK)
            goto fail;
    } else {
        double t = bk_now();
        st = writer_finish(j, 0);
        if (st == BK_OK)
            st = bk_st_stream_finish(j->out);
        else
            bk_st_stream_abort(j->out);
        j->out = NULL;
        if (st == BK_OK)
            st = write_config_and_report(j);
        if (st == BK_OK)
            st = bk__copy_aux_files(o->model_dir, j->od.work);
        if (st == BK_OK) /* nothing read has changed since it was opened */
            st = bk_st_set_check_unchanged(bk_model_tensors(j->model));
        if (st == BK_OK) /* every rank finished */
            st = jsync(j, st);
        if (st == BK_OK) /* the journal goes before the folder becomes the output */
            st = bk_resume_finish(j->rs);
        if (st == BK_OK)
            st = bk_outdir_commit(&j->od);
        if (j->nranks > 1 && !j->agreed)
            st = jsync(j, st);
        j->t_io += bk_now() - t;
        bk_prof_add("io.finish", bk_now() - t);
        if (st != BK_OK)
            goto fail;
    }
    emit(j, BK_EV_DONE, j->layer_end, NULL, o->out_dir);
    bk_prof_add("total", bk_now() - j->t0);
    bk_prof_print();
    job_free(j);
    bk_outdir_close(&j->od);
    return BK_OK;

fail:
    if (j->nranks > 1 && st == BK_ERR_INTERRUPTED && !strstr(bk_last_error(), "by a signal"))
        bk_error_prefix(st, "stopped by a signal (mpirun and srun stop every rank when one dies)");
    if (j->nranks > 1 && !j->agreed) /* the other ranks learn it at their next exchange */
        st = jsync(j, st);
    /* a runtime failure (interrupted, disk full, out of memory, device) keeps
     * the work folder with its finished layers for --resume */
    if (j->rs && j->out && bk_status_exit_code(st) == 3) {
        char why[1024];
        snprintf(why, sizeof why, "%s", bk_last_error());
        writer_finish(j, 0); /* (queued journal lines too) */
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
        emit(j, BK_EV_NOTE, 0, NULL, msg);
    }
    if (adopted && !j->rs) /* failed before the killed run's state was checked: kept */
        j->od.keep_work = 1;
    writer_finish(j, 1);
    if (j->out)
        bk_st_stream_abort(j->out);
    job_free(j);
    bk_outdir_close(&j->od);
    return st;
}
