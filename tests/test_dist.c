/* The collectives of bakron/dist.h that the GPU ranks use, on the CPU: run by
 * tests/test_mpi.sh under mpirun -np 3 (and as one process). Every rank
 * checks: the all-gather returns every rank's bytes in rank order; the
 * minimum of an int64 (rank r gives 100 - r, rank 1 gives -7) is -7 with
 * several ranks; the local rank and size (one node: equal to rank and size);
 * bk_dist_sum_ordered of floats gives the rank-order sum. Prints "ok: rank R"
 * per rank; exit 1 on a mismatch. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/dist.h"

int main(void)
{
    bk_dist *d = NULL;
    if (bk_dist_init(60, &d) != BK_OK) {
        printf("skipped: MPI could not start (%s)\n", bk_last_error());
        return 77;
    }
    const int rank = bk_dist_rank(d), size = bk_dist_size(d);
    int fail = 0;
    /* all-gather: 5 bytes per rank, (rank, rank*3, 'x', size, 0xAB) */
    unsigned char mine[5] = {(unsigned char)rank, (unsigned char)(rank * 3), 'x',
                             (unsigned char)size, 0xAB};
    unsigned char *all = calloc((size_t)size, sizeof mine);
    if (!all || bk_dist_allgather(d, mine, sizeof mine, all) != BK_OK) {
        printf("FAIL: rank %d: all-gather: %s\n", rank, bk_last_error());
        fail = 1;
    }
    for (int r = 0; !fail && r < size; r++) {
        const unsigned char want[5] = {(unsigned char)r, (unsigned char)(r * 3), 'x',
                                       (unsigned char)size, 0xAB};
        if (memcmp(all + r * sizeof mine, want, sizeof want)) {
            printf("FAIL: rank %d: all-gather: the bytes of rank %d are wrong\n", rank, r);
            fail = 1;
        }
    }
    free(all);
    int64_t v = rank == 1 ? -7 : 100 - rank;
    if (!fail && bk_dist_min_i64(d, &v) != BK_OK) {
        printf("FAIL: rank %d: minimum: %s\n", rank, bk_last_error());
        fail = 1;
    }
    const int64_t want_min = size > 1 ? -7 : 100;
    if (!fail && v != want_min) {
        printf("FAIL: rank %d: minimum %lld, expected %lld\n", rank, (long long)v,
               (long long)want_min);
        fail = 1;
    }
    if (!fail && (bk_dist_local_rank(d) != rank || bk_dist_local_size(d) != size)) {
        printf("FAIL: rank %d: local rank %d of %d on one node, expected %d of %d\n", rank,
               bk_dist_local_rank(d), bk_dist_local_size(d), rank, size);
        fail = 1;
    }
    /* rank-order sum: rank r holds 0.1 * (r + 1) in each of 3 floats */
    float x[3];
    for (int i = 0; i < 3; i++)
        x[i] = 0.1f * (float)(rank + 1);
    if (!fail && bk_dist_sum_ordered(d, x, 3, 0) != BK_OK) {
        printf("FAIL: rank %d: sum: %s\n", rank, bk_last_error());
        fail = 1;
    }
    float want = 0.1f;
    for (int r = 1; r < size; r++)
        want += 0.1f * (float)(r + 1);
    for (int i = 0; !fail && i < 3; i++)
        if (x[i] != want) {
            printf("FAIL: rank %d: sum %.9g, expected %.9g\n", rank, (double)x[i], (double)want);
            fail = 1;
        }
    if (!fail)
        printf("ok: rank %d of %d\n", rank, size);
    bk_dist_finalize(d);
    return fail;
}
