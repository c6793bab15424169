/* The quantization job over MPI ranks, data parallel (docs/DISTRIBUTED.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "quantize_job.h"
#include "util.h"
#include "backward_internal.h"

/* ------------------------------------------- MPI ranks, data parallel
 * (docs/DISTRIBUTED.md). Every rank holds the layer and runs the stages on
 * its share of the sequences (whole micro-batches, the single process's
 * boundaries); the Hessian sums of a stage are combined (ordered: passed
 * from rank to rank, each adding its micro-batches, so the sums are formed in
 * the single process's order; sum: partial sums added in rank order), then
 * known to every rank; the stage's module solves are spread over the ranks
 * and every result is broadcast, so all ranks continue with the same
 * quantized weights. Failures: every collective is preceded by a status
 * exchange (bk__q_sync) at a point all ranks reach in the same order; a rank that
 * fails goes on to the next exchange, where every rank learns it. */

/* bk_dist_sync, remembering that the failure is known to every rank. */
bk_status bk__q_sync(job *j, bk_status st)
{
    if (j->nranks <= 1)
        return st;
    st = bk_dist_sync(j->dist, st);
    if (st != BK_OK)
        j->agreed = 1;
    return st;
}

bk_status bk__q_rank_peaks(job *j)
{
    int64_t mine = -1;
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        mine = (int64_t)ru.ru_maxrss * 1024; /* (KiB on Linux) */
    free(j->rank_peak);
    j->rank_peak = calloc((size_t)j->nranks, sizeof *j->rank_peak);
    bk_status st = bk__q_sync(j, j->rank_peak ? BK_OK
                                              : bk_error(BK_ERR_NOMEM, "quantize: out of memory"));
    if (st == BK_OK)
        st = bk_dist_allgather(j->dist, &mine, sizeof mine, j->rank_peak);
    return st;
}

bk_status bk__q_split_ranks(job *j)
{
    if (!bk_rank_share(j->S, j->batch, j->rank, j->nranks, &j->s_lo, &j->s_hi))
        return bk_error(BK_ERR_INVALID_ARG,
                        "quantize: %d MPI ranks but only %lld micro-batches of %lld sequences "
                        "(every rank needs one): use fewer ranks or a smaller --batch",
                        j->nranks, (long long)((j->S + j->batch - 1) / j->batch),
                        (long long)j->batch);
    return BK_OK;
}

/* The ranks agree on the micro-batch (a rank short of device memory may have
 * reduced it: the smallest, so the boundaries are the same on every rank) and
 * on how device buffers are exchanged: NCCL when compiled in and every rank
 * has a GPU of its own (NCCL refuses two ranks on one GPU), else host copies
 * over MPI. */
bk_status bk__q_dev_stages_ranks(job *j, int64_t *batch)
{
    if (!j->ops->sums || !j->ops->share_weight)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "quantize: the %s stages cannot run with several MPI ranks: add "
                        "--cpu-stages, or run one rank",
                        j->ops->name);
    bk_status st = bk_dist_min_i64(j->dist, batch);
    if (st != BK_OK)
        return st;
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
                           ? "NCCL send/receive (the ordered pass) and broadcasts"
                           : "NCCL all-reduce and broadcasts";
        st = bk__q_sync(j, bk_dist_dev_init(j->dist));
    }
    if (j->bp_gpu && j->coll_desc != j->coll_text) { /* the flow's Grams: host accumulators */
        snprintf(j->coll_text, sizeof j->coll_text,
                 "%s; the backward flow's output-gradient Grams: MPI over host copies",
                 j->coll_desc);
        j->coll_desc = j->coll_text;
    }
    return st;
}

unsigned bk__q_stage_modules(bk_stage stage)
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
        switch (c->op) {
        case 0: return bk_dist_recv_dev(c->j->dist, buf, bytes, c->peer, stream);
        case 1: return bk_dist_send_dev(c->j->dist, buf, bytes, c->peer, stream);
        case 2: return bk_dist_bcast_dev(c->j->dist, buf, bytes, c->peer, stream);
        default: return bk_dist_sum_dev(c->j->dist, buf, n, f64, stream);
        }
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

/* The stages' sums: a receive only writes them, a send only reads them (what
 * a device's host copies carry); with NCCL (a GPU per rank) every exchange on
 * the device buffers (the ordered pass: ncclSend / ncclRecv), the counts and
 * scalars over MPI; host buffers (the CPU stages) over MPI as they are */
static bk_status acc_sums(job *j, unsigned mods, int op, int peer)
{
    sum_ctx c = {j, op, peer};
    if (!j->ops->sums)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "quantize: the %s stages cannot run with several MPI ranks",
                        j->ops->name);
    const int rw = op == 0   ? BK_BUF_WRITE
                   : op == 1 ? BK_BUF_READ
                   : op == 2 ? (j->rank == peer ? BK_BUF_READ : BK_BUF_WRITE)
                             : BK_BUF_READ | BK_BUF_WRITE;
    return j->ops->sums(j->ops_ctx, mods, j->dev_coll, rw, sum_buf, &c);
}

/* ------------------------------------- backprop kinds: output-gradient sums
 * The flow delivers every leaf layer's output gradients (each rank its share
 * of the sequences, whole micro-batches); their sums are combined once per
 * leaf, before the leaf's layers are quantized (whose input-side stages then
 * go through bk__q_stage_ranks). Ordered: rank r receives the sums of ranks
 * < r when the leaf's pass begins, adds its micro-batches on top, and passes
 * them on in bk__q_bp_leaf_sums, so they are formed in the single process's
 * order. */
static bk_status bp_grad_sums(job *j, int lo, int hi, int op, int peer)
{
    sum_ctx c = {j, op, peer};
    bk_status st = BK_OK;
    for (int l = lo; l < hi && st == BK_OK; l++)
        if (bk__q_in_range(j, l))
            st = bk__hess_bp_grad_sums(j->bp_acc[l - lo], l, sum_one, &c);
    return st;
}

void bk__q_bp_leaf_begin(job *j, int lo, int hi)
{
    j->bp_chain_st = BK_OK;
    if (j->nranks <= 1 || j->o->dist_reduce != BK_DIST_ORDERED || j->rank == 0 || j->bp_recvd)
        return;
    int h[3] = {0, 0, 0}; /* ok, the leaf */
    bk_status st = bk_dist_recv(j->dist, h, sizeof h, j->rank - 1, 12);
    if (st == BK_OK && h[0] && (h[1] != lo || h[2] != hi))
        st = bk_error(BK_ERR_INTERNAL, "rank %d: the sums of layers %d-%d arrived at the leaf "
                      "%d-%d", j->rank, h[1] + 1, h[2], lo + 1, hi);
    if (st == BK_OK && h[0])
        st = bp_grad_sums(j, lo, hi, 0, j->rank - 1);
    j->bp_recvd = 1;
    if (st == BK_OK && !h[0]) /* the rank before failed: the status exchange says how */
        st = bk_error(BK_ERR_INTERNAL, "rank %d: a rank before it failed", j->rank);
    j->bp_chain_st = st;
}

bk_status bk__q_bp_leaf_sums(job *j, int lo, int hi)
{
    if (j->nranks <= 1)
        return BK_OK;
    const int ordered = j->o->dist_reduce == BK_DIST_ORDERED;
    bk_status st = BK_OK;
    if (ordered && j->rank + 1 < j->nranks) {
        int h[3] = {1, lo, hi};
        st = bk_dist_send(j->dist, h, sizeof h, j->rank + 1, 12);
        if (st == BK_OK)
            st = bp_grad_sums(j, lo, hi, 1, j->rank + 1);
    }
    j->bp_sent = 1;
    if (st != BK_OK)
        return st; /* the communication is broken: every later call fails */
    if ((st = bk__q_sync(j, BK_OK)) != BK_OK)
        return st;
    const double t = bk_now();
    st = ordered ? bp_grad_sums(j, lo, hi, 2, j->nranks - 1) : bp_grad_sums(j, lo, hi, 3, 0);
    bk_prof_add("dist.gradient_sums", bk_now() - t);
    j->bp_recvd = j->bp_sent = 0; /* the next leaf's */
    return st;
}

void bk__q_bp_chain_fail(job *j, bk_status why)
{
    if (j->nranks <= 1 || j->o->dist_reduce != BK_DIST_ORDERED || j->agreed || j->bp_in_layers)
        return;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", bk_last_error());
    bk_status st = BK_OK;
    if (j->rank > 0 && !j->bp_recvd) { /* the rank before sends this leaf's sums anyway */
        int h[3] = {0, 0, 0};
        st = bk_dist_recv(j->dist, h, sizeof h, j->rank - 1, 12);
        if (st == BK_OK && h[0] && h[1] >= 0 && h[2] - h[1] <= j->bp_leaf)
            st = bp_grad_sums(j, h[1], h[2], 0, j->rank - 1); /* (discarded) */
        j->bp_recvd = 1;
    }
    if (st == BK_OK && j->rank + 1 < j->nranks && !j->bp_sent) {
        int h[3] = {0, 0, 0};
        bk_dist_send(j->dist, h, sizeof h, j->rank + 1, 12);
        j->bp_sent = 1;
    }
    bk_error(why, "%s", msg);
}

/* A Hessian stage over several ranks: agree, (ordered) receive the sums from
 * the rank before, run this rank's micro-batches, pass them on, agree, and
 * make the complete sums known to every rank. */
bk_status bk__q_stage_ranks(job *j, bk_stage stage)
{
    const unsigned mods = bk__q_stage_modules(stage);
    const int ordered = j->o->dist_reduce == BK_DIST_ORDERED;
    bk_status st = bk__q_sync(j, BK_OK);
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
    if ((st = bk__q_sync(j, st)) != BK_OK)
        return st;
    double t = bk_now();
    st = ordered ? acc_sums(j, mods, 2, j->nranks - 1) : acc_sums(j, mods, 3, 0);
    bk_prof_add("dist.hessian_sums", bk_now() - t);
    return st;
}

/* The owner's result, broadcast to every rank (header, then arrays). */
static bk_status share_solved(job *j, bk_module mod, int owner, bk_q_solved *sv)
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
 * process: in order, each module's solve told the next one (prepare_next).
 * Ranks: module m is solved by rank m % ranks, then every result is
 * broadcast and applied on every rank in module order (no prepare_next: a
 * rank's next module is another stage's). */
bk_status bk__q_solve_group(job *j, int l, int m0, int m1, bk_layer_weights *lw,
                             const bk_layer_weights *orig)
{
    bk_status st = BK_OK;
    if (j->nranks <= 1) {
        for (int m = m0; m <= m1 && st == BK_OK; m++)
            st = bk__q_solve_module(j, l, (bk_module)m, m < m1 ? m + 1 : -1, lw, orig);
        return st;
    }
    bk_q_solved sv[BK_MOD_COUNT];
    memset(sv, 0, sizeof sv);
    double t = bk_now();
    for (int m = m0; m <= m1 && st == BK_OK; m++)
        if (m % j->nranks == j->rank)
            st = bk__q_solve_compute(j, l, (bk_module)m, -1, orig, &sv[m]);
    bk_prof_add("dist.solve_own", bk_now() - t);
    st = bk__q_sync(j, st);
    t = bk_now();
    bk_status ap = BK_OK; /* a failure applying: known at the next exchange */
    for (int m = m0; m <= m1 && st == BK_OK; m++) {
        const int owner = m % j->nranks;
        st = share_solved(j, (bk_module)m, owner, &sv[m]);
        /* device stages: the owner's solve_dev set its working copy; the
         * quantized weight goes to the others' (NCCL broadcast, or host copies) */
        if (st == BK_OK && j->ops->share_weight) {
            sum_ctx c = {j, 2, owner};
            st = j->ops->share_weight(j->ops_ctx, (bk_module)m, j->dev_coll,
                                      j->rank == owner ? BK_BUF_READ : BK_BUF_WRITE, sum_buf,
                                      &c);
        }
        if (st == BK_OK && ap == BK_OK)
            ap = bk__q_solve_apply(j, l, (bk_module)m, lw, &sv[m]);
    }
    bk_prof_add("dist.solve_share", bk_now() - t);
    for (int m = m0; m <= m1; m++)
        bk_solve_result_free(&sv[m].r);
    if (st != BK_OK)
        return st;
    return bk__q_sync(j, ap);
}
