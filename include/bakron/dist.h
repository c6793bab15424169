/* bakron — ranks of an MPI job (docs/DISTRIBUTED.md).
 *
 * A quantize job started by mpirun or srun runs as one process per rank.
 * bk_dist is the job's context: rank, size and the few collectives the
 * driver needs. Every wait is polled against a deadline and the stop flag
 * (bk_request_stop), so a rank that dies or hangs ends the job with one
 * error instead of a hang; after such a failure the context is broken and
 * every later call fails at once.
 *
 * Without an MPI launcher in the environment nothing here calls MPI
 * (bk_dist_launched() is 0 and the job runs as one process, as always).
 */
#ifndef BAKRON_DIST_H
#define BAKRON_DIST_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bk_dist bk_dist;

/* 1 if this build has MPI / NCCL. */
int bk_dist_mpi_compiled(void);
int bk_dist_nccl_compiled(void);
/* "Open MPI v4.1.4 ..." / "NCCL 2.x.y" (or "" when not compiled). */
const char *bk_dist_mpi_version(void);
const char *bk_dist_nccl_version(void);

/* Whether the environment says an MPI launcher started this process:
 * OMPI_COMM_WORLD_SIZE (mpirun of Open MPI), PMIX_RANK (srun --mpi=pmix,
 * PMIx launchers), PMI_RANK / PMI_SIZE (srun --mpi=pmi2, MPICH's Hydra).
 * Returns 1 if so, 0 if not; -1 (with the error set, BK_ERR_USAGE) for srun
 * with several tasks but no MPI process-management interface (each task
 * would run alone). */
int bk_dist_launched(void);

/* MPI_Init (threads: funneled) and the job's communicator. timeout_s: the
 * longest wait of any collective (a peer that does not answer in time ends
 * the job). Fails with BK_ERR_UNSUPPORTED in a build without MPI. */
bk_status bk_dist_init(double timeout_s, bk_dist **out);
/* MPI_Finalize, or, when the context is broken (a peer died or hung), exit
 * without it (a finalize could wait forever; the launcher ends the others). */
void bk_dist_finalize(bk_dist *d);
void bk_dist_set_timeout(bk_dist *d, double timeout_s);
int bk_dist_broken(const bk_dist *d);

int bk_dist_rank(const bk_dist *d);
int bk_dist_size(const bk_dist *d);

/* Every rank gives its status; all return the failure of the lowest failing
 * rank (its message prefixed "rank R: " unless R is 0), or BK_OK. A
 * collective: every rank must call it at the same point. */
bk_status bk_dist_sync(bk_dist *d, bk_status st);

/* All ranks must hold the same bytes (e.g. their command lines): BK_ERR_USAGE
 * naming the first rank that differs from rank 0 and `what`. */
bk_status bk_dist_same(bk_dist *d, const void *data, size_t len, const char *what);

/* Broadcast len bytes from root. */
bk_status bk_dist_bcast(bk_dist *d, void *buf, size_t len, int root);
/* Point to point, len bytes (the tag keeps concurrent messages apart). */
bk_status bk_dist_send(bk_dist *d, const void *buf, size_t len, int to, int tag);
bk_status bk_dist_recv(bk_dist *d, void *buf, size_t len, int from, int tag);

/* Sum over the ranks, in rank order ((x0 + x1) + x2) + ..., the same on
 * every rank (rank 0 adds, then broadcasts): deterministic for a given
 * number of ranks. f64: double elements, else float. */
bk_status bk_dist_sum_ordered(bk_dist *d, void *buf, size_t n, int f64);

/* This rank's place among the ranks of its node (MPI_COMM_TYPE_SHARED, found
 * at bk_dist_init): local rank 0..local_size-1. 0 / 1 without a context. */
int bk_dist_local_rank(const bk_dist *d);
int bk_dist_local_size(const bk_dist *d);

/* Every rank gives len bytes; all[r*len ..] receives rank r's (all: size*len). */
bk_status bk_dist_allgather(bk_dist *d, const void *mine, size_t len, void *all);
/* The minimum of *v over the ranks, on every rank. */
bk_status bk_dist_min_i64(bk_dist *d, int64_t *v);

/* NCCL (builds with the CUDA backend and NCCL; BK_ERR_UNSUPPORTED in builds
 * without). One GPU per rank: the caller's current CUDA device, distinct on
 * every rank (NCCL refuses two ranks on one device).
 *
 * bk_dist_dev_init: set up the NCCL communicator (a collective: every rank
 * calls it at the same point; rank 0's ncclUniqueId goes out over MPI). The
 * functions below call it themselves on first use, except with one rank,
 * where they do nothing unless it was called (a communicator of one rank:
 * the NCCL calls run, for tests on one GPU).
 *
 * bk_dist_sum_dev: sum n elements of a DEVICE buffer over the ranks in place
 * (float, or double with f64) with ncclAllReduce on the CUDA stream `stream`
 * (NULL: the default stream). NCCL's reduction order: the same on every rank
 * and from run to run for a given machine, rank count and NCCL version; for
 * two ranks it is x0 + x1 (one addition), for more not the CPU's rank order.
 *
 * bk_dist_bcast_dev: broadcast len bytes of a DEVICE buffer from root
 * (ncclBroadcast), exact.
 *
 * bk_dist_send_dev / bk_dist_recv_dev: len bytes of a DEVICE buffer to rank
 * `to` / from rank `from` (ncclSend / ncclRecv), exact; every send is matched
 * by a receive of the same length on the peer, in the same order.
 * bk_dist_sendrecv_dev: a send and a receive in one NCCL group (with to =
 * from = this rank: a device copy through NCCL, for tests on one GPU).
 *
 * All of them wait for the stream with the deadline and the stop flag; on a
 * failure or time-out the communicator is aborted and the context is broken. */
bk_status bk_dist_dev_init(bk_dist *d);
bk_status bk_dist_sum_dev(bk_dist *d, void *dev, size_t n, int f64, void *stream);
bk_status bk_dist_bcast_dev(bk_dist *d, void *dev, size_t len, int root, void *stream);
bk_status bk_dist_send_dev(bk_dist *d, const void *dev, size_t len, int to, void *stream);
bk_status bk_dist_recv_dev(bk_dist *d, void *dev, size_t len, int from, void *stream);
bk_status bk_dist_sendrecv_dev(bk_dist *d, const void *send, int to, void *recv, int from,
                               size_t len, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* BAKRON_DIST_H */
