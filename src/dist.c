/* Ranks of an MPI job (bakron/dist.h, docs/DISTRIBUTED.md). Every wait is a
 * non-blocking MPI call polled with MPI_Test against a deadline and the stop
 * flag: a dead or hung peer ends the job with one error, never a hang. */
#include "bakron/dist.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bk_config.h"
#include "pipeline_internal.h"
#include "util.h"

#if BK_HAVE_MPI
#include <mpi.h>
#endif
#if BK_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#ifndef NCCL_VERSION
#define NCCL_VERSION(X, Y, Z) ((X) * 10000 + (Y) * 100 + (Z))
#endif
#endif

int bk_dist_mpi_compiled(void)
{
    return BK_HAVE_MPI;
}

int bk_dist_nccl_compiled(void)
{
    return BK_HAVE_NCCL;
}

const char *bk_dist_mpi_version(void)
{
#if BK_HAVE_MPI
    static char v[256];
    if (!v[0]) {
        int len = 0;
        char lib[MPI_MAX_LIBRARY_VERSION_STRING];
        if (MPI_Get_library_version(lib, &len) == MPI_SUCCESS) {
            lib[len < (int)sizeof lib ? len : (int)sizeof lib - 1] = 0;
            char *nl = strpbrk(lib, ",\n"); /* "Open MPI v4.1.4, package: ..." */
            if (nl)
                *nl = 0;
            snprintf(v, sizeof v, "%s", lib);
        } else {
            snprintf(v, sizeof v, "MPI %d.%d", MPI_VERSION, MPI_SUBVERSION);
        }
    }
    return v;
#else
    return "";
#endif
}

const char *bk_dist_nccl_version(void)
{
#if BK_HAVE_NCCL
    static char v[96];
    if (!v[0]) {
        int code = 0; /* the library loaded (may be newer than the headers) */
        if (ncclGetVersion(&code) == ncclSuccess && code > 0)
            snprintf(v, sizeof v, "NCCL %d.%d.%d", code >= 10000 ? code / 10000 : code / 1000,
                     code >= 10000 ? code / 100 % 100 : code / 100 % 10, code % 100);
        else
            snprintf(v, sizeof v, "NCCL %d.%d.%d (headers)", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
    }
    return v;
#else
    return "";
#endif
}

static long env_long(const char *name)
{
    const char *e = getenv(name);
    return e && e[0] ? strtol(e, NULL, 10) : -1;
}

int bk_dist_launched(void)
{
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK") ||
        getenv("PMI_SIZE"))
        return 1;
    long n = env_long("SLURM_STEP_NUM_TASKS");
    if (n > 1) {
        bk_error(BK_ERR_USAGE,
                 "srun started %ld tasks without an MPI process-management interface (each would "
                 "run the whole job alone): use srun --mpi=pmix (or --mpi=pmi2), or mpirun",
                 n);
        return -1;
    }
    return 0;
}

#if BK_HAVE_MPI

struct bk_dist {
    MPI_Comm comm;
    int rank, size;
    int local_rank, local_size; /* among the ranks of this node */
    double timeout_s;
    int broken;
    char mpi_err[MPI_MAX_ERROR_STRING];
#if BK_HAVE_NCCL
    ncclComm_t nccl;
    int have_nccl;
#endif
};

#if BK_HAVE_NCCL
static bk_status nccl_progress(bk_dist *d, const char *what);
#endif

static bk_status broken_error(bk_dist *d)
{
    return bk_error(BK_ERR_PEER, "the MPI job is no longer usable after an earlier failure");
    (void)d;
}

static bk_status mpi_fail(bk_dist *d, int rc, const char *what)
{
    int len = 0;
    char msg[MPI_MAX_ERROR_STRING] = "";
    MPI_Error_string(rc, msg, &len);
    d->broken = 1;
    return bk_error(BK_ERR_PEER, "rank %d: MPI error in %s: %s (a peer rank died?)", d->rank, what,
                    msg);
}

/* Wait for a request: MPI_Test polled, with a deadline and the stop flag. */
static bk_status wait_req(bk_dist *d, MPI_Request *rq, const char *what)
{
    const double t0 = bk_now();
    long ns = 1000;
    for (;;) {
        int flag = 0;
        int rc = MPI_Test(rq, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS)
            return mpi_fail(d, rc, what);
        if (flag)
            return BK_OK;
        if (bk__stop_requested()) {
            d->broken = 1;
            return bk_error(BK_ERR_INTERRUPTED,
                            "rank %d: stopped by a signal while waiting for the other ranks (%s; "
                            "mpirun and srun stop every rank when one dies)",
                            d->rank, what);
        }
        if (bk_now() - t0 > d->timeout_s) {
            d->broken = 1;
            return bk_error(BK_ERR_PEER,
                            "rank %d: no answer from the other ranks within %g s (%s): a rank "
                            "died, hangs or is much slower (--dist-timeout)",
                            d->rank, d->timeout_s, what);
        }
        struct timespec ts = {0, ns};
        nanosleep(&ts, NULL);
        if (ns < 1000000)
            ns *= 2;
    }
}

bk_status bk_dist_init(double timeout_s, bk_dist **out)
{
    *out = NULL;
    int inited = 0, provided = 0;
    MPI_Initialized(&inited);
    if (!inited && MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        return bk_error(BK_ERR_PEER, "MPI_Init failed");
    bk_dist *d = calloc(1, sizeof *d);
    if (!d)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &d->comm);
    if (rc != MPI_SUCCESS) {
        free(d);
        return bk_error(BK_ERR_PEER, "MPI_Comm_dup failed");
    }
    MPI_Comm_set_errhandler(d->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(d->comm, &d->rank);
    MPI_Comm_size(d->comm, &d->size);
    d->timeout_s = timeout_s > 0 ? timeout_s : 1800.0;
    d->local_rank = 0;
    d->local_size = 1;
    if (d->size > 1) { /* the ranks of this node (GPU choice: one per local rank) */
        MPI_Comm node;
        if (MPI_Comm_split_type(d->comm, MPI_COMM_TYPE_SHARED, d->rank, MPI_INFO_NULL, &node) ==
            MPI_SUCCESS) {
            MPI_Comm_rank(node, &d->local_rank);
            MPI_Comm_size(node, &d->local_size);
            MPI_Comm_free(&node);
        }
    }
    *out = d;
    return BK_OK;
}

void bk_dist_finalize(bk_dist *d)
{
    if (!d)
        return;
    int broken = d->broken;
#if BK_HAVE_NCCL
    if (d->have_nccl) {
        if (broken) {
            ncclCommAbort(d->nccl);
        } else {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
            /* non-blocking communicator: finalize, polled with the deadline */
            const ncclResult_t r = ncclCommFinalize(d->nccl);
            if ((r != ncclSuccess && r != ncclInProgress) ||
                nccl_progress(d, "finalize") != BK_OK) {
                broken = 1; /* aborted */
                if (d->have_nccl)
                    ncclCommAbort(d->nccl);
            } else {
                ncclCommDestroy(d->nccl);
            }
#else
            ncclCommDestroy(d->nccl);
#endif
        }
    }
#endif
    if (!broken)
        MPI_Comm_free(&d->comm);
    free(d);
    if (!broken)
        MPI_Finalize();
    /* broken: a finalize could wait for a dead peer; the launcher ends the
     * remaining ranks when this one exits */
}

int bk_dist_broken(const bk_dist *d)
{
    return d && d->broken;
}

void bk_dist_set_timeout(bk_dist *d, double timeout_s)
{
    if (d && timeout_s > 0)
        d->timeout_s = timeout_s;
}

int bk_dist_rank(const bk_dist *d)
{
    return d ? d->rank : 0;
}

int bk_dist_size(const bk_dist *d)
{
    return d ? d->size : 1;
}

int bk_dist_local_rank(const bk_dist *d)
{
    return d ? d->local_rank : 0;
}

int bk_dist_local_size(const bk_dist *d)
{
    return d ? d->local_size : 1;
}

bk_status bk_dist_allgather(bk_dist *d, const void *mine, size_t len, void *all)
{
    if (!d || d->size == 1) {
        memcpy(all, mine, len);
        return BK_OK;
    }
    if (d->broken)
        return broken_error(d);
    if (len > (size_t)1 << 30)
        return bk_error(BK_ERR_INTERNAL, "dist: all-gather of %zu bytes", len);
    MPI_Request rq;
    int rc = MPI_Iallgather(mine, (int)len, MPI_BYTE, all, (int)len, MPI_BYTE, d->comm, &rq);
    return rc == MPI_SUCCESS ? wait_req(d, &rq, "all-gather") : mpi_fail(d, rc, "all-gather");
}

bk_status bk_dist_min_i64(bk_dist *d, int64_t *v)
{
    if (!d || d->size == 1)
        return BK_OK;
    if (d->broken)
        return broken_error(d);
    int64_t mine = *v;
    MPI_Request rq;
    int rc = MPI_Iallreduce(&mine, v, 1, MPI_INT64_T, MPI_MIN, d->comm, &rq);
    return rc == MPI_SUCCESS ? wait_req(d, &rq, "minimum") : mpi_fail(d, rc, "minimum");
}

bk_status bk_dist_sync(bk_dist *d, bk_status st)
{
    if (!d || d->size == 1)
        return st;
    if (d->broken)
        return st != BK_OK ? st : broken_error(d);
    int mine = st != BK_OK ? d->rank : d->size, first = d->size;
    MPI_Request rq;
    int rc = MPI_Iallreduce(&mine, &first, 1, MPI_INT, MPI_MIN, d->comm, &rq);
    if (rc != MPI_SUCCESS)
        return mpi_fail(d, rc, "status exchange");
    /* keep the own message: waiting may overwrite it */
    struct {
        int st;
        char msg[1000];
    } m;
    memset(&m, 0, sizeof m);
    m.st = (int)st;
    snprintf(m.msg, sizeof m.msg, "%s", st != BK_OK ? bk_last_error() : "");
    bk_status w = wait_req(d, &rq, "status exchange");
    if (w != BK_OK)
        return st != BK_OK ? bk_error(st, "%s", m.msg) : w;
    if (first == d->size)
        return BK_OK;
    rc = MPI_Ibcast(&m, (int)sizeof m, MPI_BYTE, first, d->comm, &rq);
    if (rc != MPI_SUCCESS)
        return mpi_fail(d, rc, "error message");
    if ((w = wait_req(d, &rq, "error message")) != BK_OK)
        return w;
    m.msg[sizeof m.msg - 1] = 0;
    if (first == 0)
        return bk_error((bk_status)m.st, "%s", m.msg);
    return bk_error((bk_status)m.st, "rank %d: %s", first, m.msg);
}

bk_status bk_dist_same(bk_dist *d, const void *data, size_t len, const char *what)
{
    if (!d || d->size == 1)
        return BK_OK;
    if (d->broken)
        return broken_error(d);
    /* FNV-1a of the bytes, gathered */
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++)
        h = (h ^ ((const unsigned char *)data)[i]) * 1099511628211ull;
    uint64_t *all = calloc((size_t)d->size, sizeof *all);
    if (!all)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    MPI_Request rq;
    int rc = MPI_Iallgather(&h, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, d->comm, &rq);
    bk_status st = rc == MPI_SUCCESS ? wait_req(d, &rq, what) : mpi_fail(d, rc, what);
    for (int r = 1; st == BK_OK && r < d->size; r++)
        if (all[r] != all[0])
            st = bk_error(BK_ERR_USAGE,
                          "the ranks were started with different %s (rank %d differs from rank "
                          "0): every rank must get the same command line",
                          what, r);
    free(all);
    return st;
}

#define CHUNK ((size_t)1 << 30)

bk_status bk_dist_bcast(bk_dist *d, void *buf, size_t len, int root)
{
    if (!d || d->size == 1)
        return BK_OK;
    if (d->broken)
        return broken_error(d);
    for (size_t off = 0; off < len; off += CHUNK) {
        size_t n = len - off < CHUNK ? len - off : CHUNK;
        MPI_Request rq;
        int rc = MPI_Ibcast((char *)buf + off, (int)n, MPI_BYTE, root, d->comm, &rq);
        if (rc != MPI_SUCCESS)
            return mpi_fail(d, rc, "broadcast");
        bk_status st = wait_req(d, &rq, "broadcast");
        if (st != BK_OK)
            return st;
    }
    return BK_OK;
}

bk_status bk_dist_send(bk_dist *d, const void *buf, size_t len, int to, int tag)
{
    if (d->broken)
        return broken_error(d);
    for (size_t off = 0; off < len || off == 0; off += CHUNK) {
        size_t n = len - off < CHUNK ? len - off : CHUNK;
        MPI_Request rq;
        int rc = MPI_Isend((const char *)buf + off, (int)n, MPI_BYTE, to, tag, d->comm, &rq);
        if (rc != MPI_SUCCESS)
            return mpi_fail(d, rc, "send");
        bk_status st = wait_req(d, &rq, "send");
        if (st != BK_OK)
            return st;
        if (len == 0)
            break;
    }
    return BK_OK;
}

bk_status bk_dist_recv(bk_dist *d, void *buf, size_t len, int from, int tag)
{
    if (d->broken)
        return broken_error(d);
    for (size_t off = 0; off < len || off == 0; off += CHUNK) {
        size_t n = len - off < CHUNK ? len - off : CHUNK;
        MPI_Request rq;
        int rc = MPI_Irecv((char *)buf + off, (int)n, MPI_BYTE, from, tag, d->comm, &rq);
        if (rc != MPI_SUCCESS)
            return mpi_fail(d, rc, "receive");
        bk_status st = wait_req(d, &rq, "receive");
        if (st != BK_OK)
            return st;
        if (len == 0)
            break;
    }
    return BK_OK;
}

bk_status bk_dist_sum_ordered(bk_dist *d, void *buf, size_t n, int f64)
{
    if (!d || d->size == 1 || n == 0)
        return BK_OK;
    const size_t es = f64 ? sizeof(double) : sizeof(float);
    bk_status st = BK_OK;
    if (d->rank == 0) {
        const size_t step = CHUNK / es;
        void *tmp = bk_alloc(n < step ? n : step, es);
        if (!tmp)
            return bk_error(BK_ERR_NOMEM, "out of memory for a reduction buffer");
        for (int r = 1; r < d->size && st == BK_OK; r++)
            for (size_t i0 = 0; i0 < n && st == BK_OK; i0 += step) {
                size_t k = n - i0 < step ? n - i0 : step;
                st = bk_dist_recv(d, tmp, k * es, r, 7);
                if (st != BK_OK)
                    break;
                if (f64) {
                    double *y = (double *)buf + i0;
                    const double *x = tmp;
                    for (size_t i = 0; i < k; i++)
                        y[i] += x[i];
                } else {
                    float *y = (float *)buf + i0;
                    const float *x = tmp;
                    for (size_t i = 0; i < k; i++)
                        y[i] += x[i];
                }
            }
        free(tmp);
    } else {
        const size_t step = CHUNK / es;
        for (size_t i0 = 0; i0 < n && st == BK_OK; i0 += step) {
            size_t k = n - i0 < step ? n - i0 : step;
            st = bk_dist_send(d, (const char *)buf + i0 * es, k * es, 0, 7);
        }
    }
    if (st == BK_OK)
        st = bk_dist_bcast(d, buf, n * es, 0);
    return st;
}

#if BK_HAVE_NCCL
/* The communicator failed, hung or was stopped: abort it, break the context. */
static bk_status nccl_abort(bk_dist *d, ncclResult_t ae, const char *what)
{
    d->broken = 1;
    ncclCommAbort(d->nccl);
    d->have_nccl = 0;
    if (ae != ncclSuccess && ae != ncclInProgress)
        return bk_error(BK_ERR_PEER, "rank %d: NCCL %s failed: %s", d->rank, what,
                        ncclGetErrorString(ae));
    if (bk__stop_requested())
        return bk_error(BK_ERR_INTERRUPTED,
                        "rank %d: stopped by a signal while waiting for the other ranks (NCCL %s)",
                        d->rank, what);
    return bk_error(BK_ERR_PEER,
                    "rank %d: no answer from the other ranks within %g s (NCCL %s): a rank died, "
                    "hangs or is much slower (--dist-timeout)",
                    d->rank, d->timeout_s, what);
}

static void nap(long *ns)
{
    struct timespec ts = {0, *ns};
    nanosleep(&ts, NULL);
    if (*ns < 200000)
        *ns *= 2;
}

/* Non-blocking communicator: wait until the last call is issued (its state
 * leaves ncclInProgress). */
static bk_status nccl_progress(bk_dist *d, const char *what)
{
    const double t0 = bk_now();
    long ns = 1000;
    for (;;) {
        ncclResult_t ae = ncclSuccess;
        ncclCommGetAsyncError(d->nccl, &ae);
        if (ae == ncclSuccess)
            return BK_OK;
        if (ae != ncclInProgress || bk__stop_requested() || bk_now() - t0 > d->timeout_s)
            return nccl_abort(d, ae, what);
        nap(&ns);
    }
}

bk_status bk_dist_dev_init(bk_dist *d)
{
    if (!d || d->have_nccl)
        return BK_OK; /* (one rank: a communicator of one, for the tests) */
    if (d->broken)
        return broken_error(d);
    ncclResult_t nr = ncclSuccess;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    bk_status st = BK_OK;
    if (d->rank == 0 && (nr = ncclGetUniqueId(&id)) != ncclSuccess)
        st = bk_error(BK_ERR_DEVICE, "NCCL: ncclGetUniqueId: %s", ncclGetErrorString(nr));
    st = bk_dist_sync(d, st);
    if (st == BK_OK)
        st = bk_dist_bcast(d, &id, sizeof id, 0);
    if (st != BK_OK)
        return st;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
    /* non-blocking communicator: the set-up and every call are polled with
     * the deadline (a peer that never joins or dies cannot hang this rank) */
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    nr = ncclCommInitRankConfig(&d->nccl, d->size, id, d->rank, &cfg);
    if (nr == ncclSuccess || nr == ncclInProgress) {
        st = nccl_progress(d, "set-up");
        if (st != BK_OK)
            return st;
        nr = ncclSuccess;
    }
#else
    nr = ncclCommInitRank(&d->nccl, d->size, id, d->rank);
#endif
    if (nr != ncclSuccess) {
        d->broken = 1;
        return bk_error(BK_ERR_DEVICE,
                        "rank %d: NCCL: ncclCommInitRank: %s (one GPU per rank: NCCL refuses two "
                        "ranks on one GPU)",
                        d->rank, ncclGetErrorString(nr));
    }
    d->have_nccl = 1;
    return BK_OK;
}

/* Wait for an NCCL operation enqueued on stream s: the deadline, the stop
 * flag and NCCL's asynchronous errors end it (the communicator aborted). */
static bk_status nccl_wait(bk_dist *d, cudaStream_t s, const char *what)
{
    bk_status st = nccl_progress(d, what);
    if (st != BK_OK)
        return st;
    const double t0 = bk_now();
    long ns = 1000;
    for (;;) {
        cudaError_t ce = cudaStreamQuery(s);
        if (ce == cudaSuccess)
            return BK_OK;
        if (ce != cudaErrorNotReady) {
            d->broken = 1;
            return bk_error(BK_ERR_DEVICE, "rank %d: NCCL %s: %s", d->rank, what,
                            cudaGetErrorString(ce));
        }
        ncclResult_t ae = ncclSuccess;
        ncclCommGetAsyncError(d->nccl, &ae);
        if ((ae != ncclSuccess && ae != ncclInProgress) || bk__stop_requested() ||
            bk_now() - t0 > d->timeout_s)
            return nccl_abort(d, ae, what);
        nap(&ns);
    }
}

/* An NCCL call's result (non-blocking communicator: ncclInProgress is fine,
 * the wait follows). */
static bk_status nccl_called(bk_dist *d, ncclResult_t nr, const char *what)
{
    if (nr == ncclSuccess || nr == ncclInProgress)
        return BK_OK;
    d->broken = 1;
    return bk_error(BK_ERR_DEVICE, "rank %d: NCCL: %s: %s", d->rank, what, ncclGetErrorString(nr));
}

bk_status bk_dist_sum_dev(bk_dist *d, void *dev, size_t n, int f64, void *stream)
{
    if (!d || n == 0 || (d->size == 1 && !d->have_nccl))
        return BK_OK;
    bk_status st = bk_dist_dev_init(d);
    if (st != BK_OK)
        return st;
    cudaStream_t s = (cudaStream_t)stream;
    st = nccl_called(d, ncclAllReduce(dev, dev, n, f64 ? ncclDouble : ncclFloat, ncclSum,
                                      d->nccl, s),
                     "ncclAllReduce");
    return st == BK_OK ? nccl_wait(d, s, "all-reduce") : st;
}

bk_status bk_dist_bcast_dev(bk_dist *d, void *dev, size_t len, int root, void *stream)
{
    if (!d || len == 0 || (d->size == 1 && !d->have_nccl))
        return BK_OK;
    bk_status st = bk_dist_dev_init(d);
    if (st != BK_OK)
        return st;
    cudaStream_t s = (cudaStream_t)stream;
    st = nccl_called(d, ncclBroadcast(dev, dev, len, ncclChar, root, d->nccl, s),
                     "ncclBroadcast");
    return st == BK_OK ? nccl_wait(d, s, "broadcast") : st;
}

/* A send (send != NULL) and/or a receive (recv != NULL) in one group. */
static bk_status p2p_dev(bk_dist *d, const void *send, int to, void *recv, int from, size_t len,
                         void *stream)
{
    if (!d || len == 0 || (!send && !recv))
        return BK_OK;
    if ((send && (to < 0 || to >= d->size)) || (recv && (from < 0 || from >= d->size)))
        return bk_error(BK_ERR_INVALID_ARG, "rank %d: NCCL send/receive: no rank %d", d->rank,
                        send && (to < 0 || to >= d->size) ? to : from);
    bk_status st = bk_dist_dev_init(d);
    if (st != BK_OK)
        return st;
    cudaStream_t s = (cudaStream_t)stream;
    ncclResult_t nr = ncclGroupStart();
    if (nr == ncclSuccess && send)
        nr = ncclSend(send, len, ncclChar, to, d->nccl, s);
    if ((nr == ncclSuccess || nr == ncclInProgress) && recv)
        nr = ncclRecv(recv, len, ncclChar, from, d->nccl, s);
    const ncclResult_t ge = ncclGroupEnd(); /* (closes the group whatever happened) */
    st = nccl_called(d, nr, send && recv ? "ncclSend/ncclRecv" : send ? "ncclSend" : "ncclRecv");
    if (st == BK_OK)
        st = nccl_called(d, ge, "ncclGroupEnd");
    return st == BK_OK ? nccl_wait(d, s, send && recv ? "send/receive" : send ? "send" : "receive")
                       : st;
}

bk_status bk_dist_send_dev(bk_dist *d, const void *dev, size_t len, int to, void *stream)
{
    return p2p_dev(d, dev, to, NULL, 0, len, stream);
}

bk_status bk_dist_recv_dev(bk_dist *d, void *dev, size_t len, int from, void *stream)
{
    return p2p_dev(d, NULL, 0, dev, from, len, stream);
}

bk_status bk_dist_sendrecv_dev(bk_dist *d, const void *send, int to, void *recv, int from,
                               size_t len, void *stream)
{
    return p2p_dev(d, send, to, recv, from, len, stream);
}
#endif

#else /* !BK_HAVE_MPI */

int bk_dist_local_rank(const bk_dist *d)
{
    (void)d;
    return 0;
}

int bk_dist_local_size(const bk_dist *d)
{
    (void)d;
    return 1;
}

bk_status bk_dist_allgather(bk_dist *d, const void *mine, size_t len, void *all)
{
    (void)d;
    memcpy(all, mine, len);
    return BK_OK;
}

bk_status bk_dist_min_i64(bk_dist *d, int64_t *v)
{
    (void)d, (void)v;
    return BK_OK;
}


struct bk_dist {
    int unused;
};

bk_status bk_dist_init(double timeout_s, bk_dist **out)
{
    (void)timeout_s;
    *out = NULL;
    return bk_error(BK_ERR_UNSUPPORTED,
                    "started by an MPI launcher, but this bakron was built without MPI (install "
                    "libopenmpi-dev and rebuild; meson option -Dmpi=enabled)");
}

void bk_dist_finalize(bk_dist *d)
{
    (void)d;
}

void bk_dist_set_timeout(bk_dist *d, double timeout_s)
{
    (void)d, (void)timeout_s;
}

int bk_dist_broken(const bk_dist *d)
{
    (void)d;
    return 0;
}

int bk_dist_rank(const bk_dist *d)
{
    (void)d;
    return 0;
}

int bk_dist_size(const bk_dist *d)
{
    (void)d;
    return 1;
}

bk_status bk_dist_sync(bk_dist *d, bk_status st)
{
    (void)d;
    return st;
}

bk_status bk_dist_same(bk_dist *d, const void *data, size_t len, const char *what)
{
    (void)d, (void)data, (void)len, (void)what;
    return BK_OK;
}

bk_status bk_dist_bcast(bk_dist *d, void *buf, size_t len, int root)
{
    (void)d, (void)buf, (void)len, (void)root;
    return BK_OK;
}

bk_status bk_dist_send(bk_dist *d, const void *buf, size_t len, int to, int tag)
{
    (void)d, (void)buf, (void)len, (void)to, (void)tag;
    return bk_error(BK_ERR_INTERNAL, "dist: send without MPI");
}

bk_status bk_dist_recv(bk_dist *d, void *buf, size_t len, int from, int tag)
{
    (void)d, (void)buf, (void)len, (void)from, (void)tag;
    return bk_error(BK_ERR_INTERNAL, "dist: receive without MPI");
}

bk_status bk_dist_sum_ordered(bk_dist *d, void *buf, size_t n, int f64)
{
    (void)d, (void)buf, (void)n, (void)f64;
    return BK_OK;
}

#endif

#if !(BK_HAVE_MPI && BK_HAVE_NCCL)
/* the device collectives need MPI (bootstrap) and NCCL */
#if BK_HAVE_MPI
#define BK_NO_DEV_COLL "this bakron was built without NCCL"
#else
#define BK_NO_DEV_COLL "this bakron was built without MPI and NCCL"
#endif
static bk_status no_nccl(void)
{
    return bk_error(BK_ERR_UNSUPPORTED, BK_NO_DEV_COLL);
}

bk_status bk_dist_dev_init(bk_dist *d)
{
    (void)d;
    return no_nccl();
}

bk_status bk_dist_sum_dev(bk_dist *d, void *dev, size_t n, int f64, void *stream)
{
    (void)d, (void)dev, (void)n, (void)f64, (void)stream;
    return no_nccl();
}

bk_status bk_dist_bcast_dev(bk_dist *d, void *dev, size_t len, int root, void *stream)
{
    (void)d, (void)dev, (void)len, (void)root, (void)stream;
    return no_nccl();
}

bk_status bk_dist_send_dev(bk_dist *d, const void *dev, size_t len, int to, void *stream)
{
    (void)d, (void)dev, (void)len, (void)to, (void)stream;
    return no_nccl();
}

bk_status bk_dist_recv_dev(bk_dist *d, void *dev, size_t len, int from, void *stream)
{
    (void)d, (void)dev, (void)len, (void)from, (void)stream;
    return no_nccl();
}

bk_status bk_dist_sendrecv_dev(bk_dist *d, const void *send, int to, void *recv, int from,
                               size_t len, void *stream)
{
    (void)d, (void)send, (void)to, (void)recv, (void)from, (void)len, (void)stream;
    return no_nccl();
}
#endif
