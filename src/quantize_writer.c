/* The quantization job's output: which tensors it writes, the tensors passed
 * through, the writer thread, the journal of finished layers. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quantize_job.h"
#include "st_internal.h"
#include "util.h"

/* ------------------------------------------------------------- output plan */

bk_status bk__q_declare_outputs(job *j)
{
    const bk_st_set *in = bk_model_tensors(j->model);
    char name[512];
    bk_status st;
    for (size_t i = 0; i < bk_st_set_count(in); i++) {
        const bk_tensor_info *t = bk_st_set_tensor(in, i);
        int layer;
        bk_module mod;
        if (bk__parse_linear_name(t->name, &layer, &mod) && bk__q_in_range(j, layer) &&
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
static bk_status passthrough_tensors(job *j)
{
    const bk_st_set *in = bk_model_tensors(j->model);
    for (size_t i = 0; i < bk_st_set_count(in); i++) {
        const bk_tensor_info *ti = bk_st_set_tensor(in, i);
        int layer;
        bk_module mod;
        if (bk__parse_linear_name(ti->name, &layer, &mod) && bk__q_in_range(j, layer))
            continue;
        bk_status st = bk_st_stream_write(j->out, ti->name, ti->data);
        if (st != BK_OK)
            return st;
    }
    return BK_OK;
}

bk_status bk__q_write_passthrough(job *j)
{
    double t = bk_now();
    bk_status st = passthrough_tensors(j);
    j->t_io += bk_now() - t;
    bk_prof_add("io.passthrough", bk_now() - t);
    return st;
}

/* ------------------------------------------------------------ writer thread */

#define WQ_CAP 32 /* the size of job.wr.q */
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
    if (w->layer < 0) { /* (on the writer thread: not in j->t_io, which the caller owns) */
        const double t = bk_now();
        bk_status st = passthrough_tensors(j);
        bk_prof_add("writer.passthrough (thread)", bk_now() - t);
        return st;
    }
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

/* Host memory a queued result holds (its arrays). */
static uint64_t wjob_bytes(const bk_solve_result *r)
{
    const uint64_t mn = (uint64_t)(r->m > 0 ? r->m : 0) * (uint64_t)(r->n > 0 ? r->n : 0);
    const uint64_t mg = (uint64_t)(r->m > 0 ? r->m : 0) * (uint64_t)(r->groups > 0 ? r->groups : 0);
    return (r->codes ? mn * sizeof(int16_t) : 0) + (r->weight ? mn * sizeof(float) : 0) +
           (r->scales ? mg * sizeof(float) : 0) + (r->zeros ? mg * sizeof(float) : 0);
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
        const uint64_t nb = wjob_bytes(&w.r);
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
        j->wr.bytes -= nb < j->wr.bytes ? nb : j->wr.bytes;
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
bk_status bk__q_writer_put(job *j, int layer, bk_module mod, bk_solve_result *r,
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
    const uint64_t nb = wjob_bytes(r);
    pthread_mutex_lock(&j->wr.mu);
    /* wait for room: a free slot, and the bytes bound (an empty queue takes
     * any one result) */
    while (!j->wr.failed && (j->wr.count == WQ_CAP ||
                             (j->wr.count > 0 && j->wr.bytes + nb > j->wr.cap_bytes)))
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
    j->wr.bytes += nb;
    pthread_cond_broadcast(&j->wr.cv);
    pthread_mutex_unlock(&j->wr.mu);
    return BK_OK;
}

bk_status bk__q_writer_put_passthrough(job *j)
{
    if (!j->out)
        return BK_OK;
    if (!j->wr.started)
        return bk__q_write_passthrough(j);
    bk_solve_result none;
    memset(&none, 0, sizeof none);
    return bk__q_writer_put(j, -1, BK_MOD_COUNT, &none, NULL);
}

void bk__q_writer_start(job *j)
{
    const char *e = getenv("BK_WRITER_THREAD"); /* 0: write on the calling thread */
    if (e && !strcmp(e, "0"))
        return;
    /* the queue's bound: a sixteenth of the host memory available now, at most
     * 2 GiB (a Llama-3-8B layer's results, codes + weights, are 1.3 GB), at
     * least 256 MiB; the memory plans made before (the Backprop flow's host
     * budget takes half of what is available) leave room for it */
    const uint64_t avail = bk_host_avail_bytes(), lo = (uint64_t)256 << 20, hi = (uint64_t)2 << 30;
    uint64_t cap = avail ? avail / 16 : lo;
    j->wr.cap_bytes = cap < lo ? lo : cap > hi ? hi : cap;
    j->wr.bytes = 0;
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
bk_status bk__q_writer_finish(job *j, int abandon)
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
bk_status bk__q_writer_drain(job *j)
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
bk_status bk__q_journal_layer(job *j, int l)
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
    return bk__q_writer_put(j, l, BK_MOD_COUNT, &none, text);
}
