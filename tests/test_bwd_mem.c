/* The device-memory model of the GPU backward flow and the flow-aware
 * micro-batch (src/bwd_mem.c): pure functions, checked against numbers
 * derived buffer by buffer from cuda/backward.cu and against the measured 1B
 * micro_batch_device_bytes of session 12 (10698 MiB at 4 x 2048, bf16, tied,
 * before this branch made the Gram scratch BF16 and the F32 Gram a panel). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "bakron/status.h"

#include "bakron/backward.h"
#include "bakron/pipeline.h"
#include "bwd_mem.h"
#include "util.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static bk_model_config cfg(int64_t L, int64_t d, int64_t ni, int64_t nh, int64_t nkv, int64_t hd,
                           int tied)
{
    bk_model_config c;
    memset(&c, 0, sizeof c);
    c.n_layers = L;
    c.hidden = d;
    c.intermediate = ni;
    c.n_heads = nh;
    c.n_kv_heads = nkv;
    c.head_dim = hd;
    c.vocab = 128256;
    c.tie_embeddings = tied;
    return c;
}

static const bk_bwd_mem_params BF16_HALVING = {BK_FLOW_HALVING, 1, BK_BWD_BF16, 1, 1, 0, 0, 0};

static void test_8b_buffers(void **state)
{
    (void)state;
    const bk_model_config c = cfg(32, 4096, 14336, 32, 8, 128, 0);
    /* the job's default at 8B: 2 x 2048, halving, leaf 1, bf16 (issue 16: no
     * F32 weight staging in bf16, 14336 x 4096 x 4 = 234881024 bytes less;
     * session 14: the two boundary staging buffers sbuf[0], sbuf[1] are BF16,
     * [2 x 2048 rows, 4096] x 2 bytes each instead of x 4: 2 x 4096 x 4096 x
     * (4 - 2) = 67108864 bytes less) */
    assert_int_equal(bk_bwd_dev_bytes(&c, 2, 2048, 256, &BF16_HALVING, 0),
                     12309954624ull - 234881024ull - 67108864ull);
    assert_int_equal(bk_bwd_dev_bytes(&c, 2, 2048, 256, &BF16_HALVING, 1),
                     14402912320ull - 234881024ull - 67108864ull);
    /* one cached layer in BF16 (matrices) + F32 biases and norms */
    assert_int_equal(bk_bwd_dev_layer_bytes(&c, BK_BWD_BF16), 436207616ull + 4ull * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096) + 4ull * (2 * 4096 + 2 * 128));
    /* the naive flow: no boundary scratch, but all 32 layer inputs kept (16 with
     * halving); an F32 micro-batch row block is 2 x 2048 x 4096 x 4 bytes, the
     * halving flow's two BF16 staging buffers 2 x (2 x 2048 x 4096 x 2) = one */
    bk_bwd_mem_params naive = BF16_HALVING;
    naive.flow = BK_FLOW_NAIVE;
    const uint64_t row = 2ull * 2048 * 4096 * 4;
    assert_int_equal(bk_bwd_dev_bytes(&c, 2, 2048, 256, &naive, 0) -
                         bk_bwd_dev_bytes(&c, 2, 2048, 256, &BF16_HALVING, 0),
                     (32 - 16) * row - row);
    /* fp32: F32 staging, two row blocks (the difference to naive as before) */
    bk_bwd_mem_params h32 = BF16_HALVING, n32 = BF16_HALVING;
    h32.precision = n32.precision = BK_BWD_FP32;
    n32.flow = BK_FLOW_NAIVE;
    assert_int_equal(bk_bwd_dev_bytes(&c, 2, 2048, 256, &n32, 0) -
                         bk_bwd_dev_bytes(&c, 2, 2048, 256, &h32, 0),
                     (32 - 16) * row - 2 * row);
    /* more sequences, more bytes (the flow's ~3.4 GB per sequence at 8B) */
    const uint64_t b2 = bk_bwd_dev_bytes(&c, 2, 2048, 256, &BF16_HALVING, 1),
                   b3 = bk_bwd_dev_bytes(&c, 3, 2048, 256, &BF16_HALVING, 1);
    assert_true(b3 > b2 && b3 - b2 > 3000000000ull && b3 - b2 < 3600000000ull);
}

static void test_1b_measured(void **state)
{
    (void)state;
    const bk_model_config c = cfg(16, 2048, 8192, 32, 8, 64, 1);
    const uint64_t now = bk_bwd_dev_bytes(&c, 4, 2048, 256, &BF16_HALVING, 1);
    /* (session 14: the boundary staging BF16, 2 x [4 x 2048, 2048] x (4 - 2) bytes less) */
    assert_int_equal(now, 10330415168ull - 8192ull * 2048 * 4 - 2ull * 8192 * 2048 * 2);
    /* session 12's allocations: the Gram scratch in double, the whole [8192]^2 F32 Gram,
     * and the unfused attention backward (F32 P, dP; BF16 q, k, v, P, dS; no lse, D),
     * and the F32 weight staging (issue 16 uploads BF16 weights directly), and F32
     * boundary staging (BF16 since session 14) */
    const uint64_t R = 4 * 2048, mo = 8192, TT = 4ull * 2048 * 2048, qd = 2048, kvd = 512;
    const uint64_t then = now + R * mo * (8 - 2) + mo * mo * 4 - mo * 1024 * 4 + 2 * TT * 4 +
                          (R * qd + 2 * R * kvd + 2 * TT) * 2 - 2 * R * 32 * 4 + mo * 2048 * 4 +
                          2 * R * 2048 * (4 - 2);
    const uint64_t measured = 10698ull << 20;
    assert_true(then > measured - (1 << 20) && then < measured + (1 << 20));
}

/* The 8B job's device peak by the model: residual stream and o_proj inputs,
 * the stages' micro-batch, the flow at 2 x 2048 with all logits, the whole
 * BF16 weight cache and the stages' reserve for the leaf layers: within 80 GB;
 * the cache sizes itself to all 32 layers under an 80 GB limit. */
static void test_8b_job_fits_80gb(void **state)
{
    (void)state;
    const bk_model_config c = cfg(32, 4096, 14336, 32, 8, 128, 0);
    const uint64_t stream = 256ull * 2048 * (4096 + 4096) * 4;
    const uint64_t stage_seq = 4ull * (6 * 4096 + 6 * 1024 + 5 * 4096 + 4 * 14336) * 2048;
    const uint64_t reserve = bk_gpu_stage_reserve(&c, 4, 2);
    const uint64_t flow = bk_bwd_dev_bytes(&c, 2, 2048, 256, &BF16_HALVING, 1);
    const uint64_t layer = bk_bwd_dev_layer_bytes(&c, BK_BWD_BF16);
    const uint64_t before = stream + 2 * stage_seq + flow;
    assert_true(before + 32 * layer + reserve <= 80000000000ull);
    assert_int_equal(bk_bwd_cache_layers(&c, BK_BWD_BF16, 80000000000ull - before, reserve), 32);
    /* the automatic micro-batch stays 2 on an 80 GB card */
    assert_int_equal(bk_bwd_fit_batch(&c, 2048, 256, &BF16_HALVING, 2, 80000000000ull - stream,
                                      stage_seq, reserve, 1),
                     2);
    /* --batch 32 does not fit an 80 GB card */
    assert_true(bk_bwd_fit_batch(&c, 2048, 256, &BF16_HALVING, 32, 80000000000ull, stage_seq,
                                 reserve, 1) < 32);
}

static void test_fit_batch(void **state)
{
    (void)state;
    const bk_model_config c = cfg(32, 4096, 14336, 32, 8, 128, 0);
    const uint64_t per = 1000000000ull, res = 7000000000ull;
    const uint64_t lay = bk_bwd_dev_layer_bytes(&c, BK_BWD_BF16);
    const uint64_t need4 = res + lay + 4 * per + bk_bwd_dev_bytes(&c, 4, 2048, 256, &BF16_HALVING, 0);
    const uint64_t need3 = res + lay + 3 * per + bk_bwd_dev_bytes(&c, 3, 2048, 256, &BF16_HALVING, 0);
    assert_int_equal(bk_bwd_fit_batch(&c, 2048, 256, &BF16_HALVING, 4, need4, per, res, 1), 4);
    assert_int_equal(bk_bwd_fit_batch(&c, 2048, 256, &BF16_HALVING, 4, need4 - 1, per, res, 1), 3);
    assert_int_equal(bk_bwd_fit_batch(&c, 2048, 256, &BF16_HALVING, 4, need3, per, res, 1), 3);
    assert_int_equal(bk_bwd_fit_batch(&c, 2048, 256, &BF16_HALVING, 8, need4, per, res, 1), 4);
    assert_int_equal(bk_bwd_fit_batch(&c, 2048, 256, &BF16_HALVING, 4, 1000, per, res, 1), 0);
    /* want is capped at S */
    assert_int_equal(bk_bwd_fit_batch(&c, 2048, 3, &BF16_HALVING, 8, need4, per, res, 1), 3);
}

static void test_cache_layers(void **state)
{
    (void)state;
    const bk_model_config c = cfg(32, 4096, 14336, 32, 8, 128, 0);
    const uint64_t lay = bk_bwd_dev_layer_bytes(&c, BK_BWD_BF16);
    /* no reserve: half of the available memory (the flow's rule before) */
    assert_int_equal(bk_bwd_cache_layers(&c, BK_BWD_BF16, 20 * lay, 0), 10);
    /* the reserve leaves less than half: what is beside it */
    assert_int_equal(bk_bwd_cache_layers(&c, BK_BWD_BF16, 20 * lay, 14 * lay), 6);
    /* at least 1, at most L */
    assert_int_equal(bk_bwd_cache_layers(&c, BK_BWD_BF16, lay, 14 * lay), 1);
    assert_int_equal(bk_bwd_cache_layers(&c, BK_BWD_BF16, 1000 * lay, 0), 32);
    /* F32 cache: matrices in 4 bytes */
    assert_true(bk_bwd_dev_layer_bytes(&c, BK_BWD_FP32) > 2 * lay - 1000000);
}

/* the leaf chosen when none is given: each leaf layer holds its Grams,
 * sum of out^2 doubles = (3 * 4096^2 + 2 * 1024^2 + 2 * 14336^2) * 8 bytes at 8B */
static void test_auto_leaf(void **state)
{
    (void)state;
    const bk_model_config c = cfg(32, 4096, 14336, 32, 8, 128, 0);
    const uint64_t G = (3ull * 4096 * 4096 + 2ull * 1024 * 1024 + 2ull * 14336 * 14336) * 8;
    assert_int_equal(G, 3707764736ull);
    bk_bwd_mem_params p = BF16_HALVING;
    const uint64_t stage = 2ull * 4 * (6 * 4096 + 6 * 1024 + 5 * 4096 + 4 * 14336) * 2048;
    const uint64_t reserve = bk_gpu_stage_reserve(&c, 4, 2);
    const uint64_t fixed = stage + reserve + 32 * bk_bwd_dev_layer_bytes(&c, BK_BWD_BF16);
    const uint64_t need1 = fixed + bk_bwd_dev_bytes(&c, 2, 2048, 256, &p, 0);
    /* leaf s adds s - 1 layers' Grams (the kept inputs stay 16 layers up to s = 16) */
    p.leaf = 0;
    for (int s = 2; s <= 8; s *= 2) {
        const uint64_t need = need1 + (uint64_t)(s - 1) * G;
        /* 7/8 of avail must hold it */
        assert_int_equal(bk_bwd_auto_leaf(&c, 2048, 256, &p, 2, need + need / 7 + 64, stage, reserve), s);
        assert_true(bk_bwd_auto_leaf(&c, 2048, 256, &p, 2, need, stage, reserve) < s);
    }
    assert_int_equal(bk_bwd_auto_leaf(&c, 2048, 256, &p, 2, need1, stage, reserve), 1);
    assert_int_equal(bk_bwd_auto_leaf(&c, 2048, 256, &p, 2, 0, stage, reserve), 1);
    assert_int_equal(bk_bwd_auto_leaf(&c, 2048, 256, &p, 2, 1ull << 50, stage, reserve), 8);
    /* an 80 GB card beside the residual stream and o_proj inputs (17.2 GB): 4 */
    const uint64_t stream = 256ull * 2048 * (4096 + 4096) * 4;
    assert_int_equal(bk_bwd_auto_leaf(&c, 2048, 256, &p, 2, 80000000000ull - stream, stage, reserve), 4);
    /* at most L / 2 layers: a 4-layer model takes 2 however much memory */
    const bk_model_config c4 = cfg(4, 4096, 14336, 32, 8, 128, 0);
    assert_int_equal(bk_bwd_auto_leaf(&c4, 2048, 256, &p, 2, 1ull << 50, stage, reserve), 2);
    /* the largest leaf that fits, any size: the bound of the host check's
     * suggestion; the auto leaf is the largest of 8/4/2 up to it */
    assert_int_equal(bk_bwd_max_leaf(&c, 2048, 256, &p, 2, 1ull << 50, stage, reserve), 32);
    assert_int_equal(bk_bwd_max_leaf(&c, 2048, 256, &p, 2, 0, stage, reserve), 0);
    assert_int_equal(bk_bwd_max_leaf(&c, 2048, 256, &p, 2, need1 + need1 / 7 + 64, stage, reserve), 1);
    const int m80 = bk_bwd_max_leaf(&c, 2048, 256, &p, 2, 80000000000ull - stream, stage, reserve);
    assert_true(m80 >= 4 && m80 < 8);
    for (int s = 1; s <= 16; s++) { /* (beyond 16 the kept inputs grow too) */
        const uint64_t need = need1 + (uint64_t)(s - 1) * G;
        assert_int_equal(bk_bwd_max_leaf(&c, 2048, 256, &p, 2, need + need / 7 + 64, stage, reserve), s);
    }
}

/* The boundary matrices of recursive halving, counted by hand from
 * src/backward_flow.c's node: the root holds X_mid, G_mid, G_L (3); its left
 * child 2 more, and so on down to the leaves' parents; the right children
 * hold one fewer (G_mid freed). (The measured stats of real flows:
 * tests/test_backward.c.) */
static void test_boundary_units(void **state)
{
    (void)state;
    /* L = 32: depth of the splits log2(32 / leaf) */
    assert_int_equal(bk_bwd_boundary_units(32, BK_FLOW_HALVING, 1), 3 + 2 * 4);
    assert_int_equal(bk_bwd_boundary_units(32, BK_FLOW_HALVING, 2), 3 + 2 * 3);
    assert_int_equal(bk_bwd_boundary_units(32, BK_FLOW_HALVING, 4), 3 + 2 * 2);
    assert_int_equal(bk_bwd_boundary_units(32, BK_FLOW_HALVING, 8), 3 + 2 * 1);
    assert_int_equal(bk_bwd_boundary_units(32, BK_FLOW_HALVING, 16), 3);
    assert_int_equal(bk_bwd_boundary_units(32, BK_FLOW_HALVING, 32), 0);
    assert_int_equal(bk_bwd_boundary_units(32, BK_FLOW_HALVING, 99), 0);
    for (int s = 1; s <= 32; s++)
        assert_int_equal(bk_bwd_boundary_units(32, BK_FLOW_NAIVE, s), 0);
    /* odd L: [0, 3) splits at 1: left [0, 1) a leaf, right [1, 3) splits */
    assert_int_equal(bk_bwd_boundary_units(3, BK_FLOW_HALVING, 1), 3 + 2 - 1);
    assert_int_equal(bk_bwd_boundary_units(2, BK_FLOW_HALVING, 1), 3);
    assert_int_equal(bk_bwd_boundary_units(1, BK_FLOW_HALVING, 1), 0);
    /* L = 28 (Qwen 7B-like), leaf 1: [0,28) 3, [0,14) 5, [0,7) 7, [0,3) 9 (its left
     * child [0,1) a leaf), then its right child [1,3) after G_mid's free: 8 + 2 */
    assert_int_equal(bk_bwd_boundary_units(28, BK_FLOW_HALVING, 1), 10);
    /* the paper's bound 2 (log2 l + 1) */
    for (int L = 1; L <= 80; L++)
        for (int s = 1; s <= L; s++) {
            int u = bk_bwd_boundary_units(L, BK_FLOW_HALVING, s);
            int lg = 0;
            while ((1 << lg) < L)
                lg++;
            assert_true(u <= 2 * (lg + 1));
        }
}

/* The 8B job of issue 16: 256 x 2048 tokens, hidden 4096, F32 boundaries
 * (fp32 / tf32; bf16 until session 14), 32 layers: 8 GiB a matrix; at leaf 4
 * seven alive (the host's 60 GB at depth 2 measured on the H200 host). */
static void test_boundary_8b(void **state)
{
    (void)state;
    const int64_t N = 256 * 2048;
    const uint64_t one = (uint64_t)N * 4096 * 4;
    assert_true(one == 8ull << 30);
    assert_true(bk_bwd_boundary_peak_bytes(32, BK_FLOW_HALVING, 1, N, 4096, 4) == 11 * one);
    assert_true(bk_bwd_boundary_peak_bytes(32, BK_FLOW_HALVING, 2, N, 4096, 4) == 9 * one);
    assert_true(bk_bwd_boundary_peak_bytes(32, BK_FLOW_HALVING, 4, N, 4096, 4) == 7 * one);
    assert_true(bk_bwd_boundary_peak_bytes(32, BK_FLOW_HALVING, 8, N, 4096, 4) == 5 * one);
    assert_true(bk_bwd_boundary_peak_bytes(32, BK_FLOW_NAIVE, 4, N, 4096, 4) == 0);
    for (int s = 1; s <= 8; s *= 2)
        printf("  8B boundary peak, leaf %d: %.1f GB\n", s,
               (double)bk_bwd_boundary_peak_bytes(32, BK_FLOW_HALVING, s, N, 4096, 4) / 1e9);
    /* --bwd-precision bf16 since session 14: BF16 boundaries, 524288 x 4096 x 2
     * = 4 GiB (4.29 GB) a matrix: leaf 4, 7 alive = 28 GiB = 30.06 GB (60.1 in
     * F32); leaf 1, 11 = 44 GiB = 47.2 GB; the paper's bound 2 (log2 32 + 1) =
     * 12 matrices would be 51.5 GB (its "about 52 GB in BF16") */
    const uint64_t one16 = (uint64_t)N * 4096 * 2;
    assert_true(one16 == 4ull << 30);
    assert_true(bk_bwd_boundary_peak_bytes(32, BK_FLOW_HALVING, 4, N, 4096, 2) == 30064771072ull);
    assert_true(bk_bwd_boundary_peak_bytes(32, BK_FLOW_HALVING, 1, N, 4096, 2) == 47244640256ull);
    assert_true(bk_bwd_boundary_peak_bytes(32, BK_FLOW_HALVING, 4, N, 4096, 2) * 2 ==
                bk_bwd_boundary_peak_bytes(32, BK_FLOW_HALVING, 4, N, 4096, 4));
    assert_true(12 * one16 == 51539607552ull);
}

/* The decision before the flow: the 8B job fits a 128 GB host (about 120 GB
 * available), not a 64 GB one (about 58 GB): BK_ERR_NOMEM, one line naming
 * the numbers and what to change. */
static void test_host_check_8b(void **state)
{
    (void)state;
    const bk_model_config c = cfg(32, 4096, 14336, 32, 8, 128, 0);
    const uint64_t GB = 1000000000ull;
    bk_bwd_host_plan p;
    /* the layers' host copies: 218 M parameters a layer in F32, 32 layers =
     * 27.9 GB, within half of 120 GB */
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 256, 2048, 4, 1, 1, 0, 120 * GB, &p),
                     BK_OK);
    assert_int_equal(p.units, 7);
    assert_true(p.boundary_bytes == 7 * (8ull << 30));
    assert_true(p.copies_bytes > 27 * GB && p.copies_bytes < 29 * GB);
    assert_true(p.copies_budget == 60 * GB);
    assert_true(p.need == p.boundary_bytes + p.copies_bytes + 15 * GB);
    assert_true(p.layer_bytes == 872621056ull); /* 218103808 x 4 + 51456 x 4 */
    /* bf16 mode (issue 16): BF16 copies of the matrices (F32 biases and norms)
     * halve the copies, 14.0 GB; a BF16 checkpoint's matrices are read from the
     * mapping: only the biases and norms, 51456 floats a layer (6.6 MB) */
    const uint64_t rest = 4ull * ((4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096) +
                                  (2 * 4096 + 2 * 128));
    assert_true(bk_bwd_host_layer_bytes(&c, BK_BWD_HOST_CPU) == 872621056ull);
    assert_true(bk_bwd_host_layer_bytes(&c, BK_BWD_HOST_GPU_F32) == 872621056ull);
    assert_true(bk_bwd_host_layer_bytes(&c, BK_BWD_HOST_GPU_BF16) == 218103808ull * 2 + rest);
    assert_true(bk_bwd_host_layer_bytes(&c, BK_BWD_HOST_GPU_MAPPED) == rest);
    const uint64_t need32 = p.need;
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 256, 2048, 4,
                                       BK_BWD_HOST_GPU_BF16, 1, 0, 120 * GB, &p),
                     BK_OK);
    assert_true(p.copies_bytes == 32 * (218103808ull * 2 + rest));
    assert_true(p.copies_budget == 60 * GB);
    assert_true(need32 - p.need == 32 * 218103808ull * 2);
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 256, 2048, 4,
                                       BK_BWD_HOST_GPU_MAPPED, 1, 0, 120 * GB, &p),
                     BK_OK);
    assert_true(p.copies_bytes == 32 * rest);
    assert_true(p.need == p.boundary_bytes + 32 * rest + 15 * GB);
    /* 64 GB host: 60.1 GB of boundaries still do not fit, but the room for
     * them grows by the 27.9 GB the copies no longer take (97 -> 216 sequences) */
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 256, 2048, 4,
                                       BK_BWD_HOST_GPU_MAPPED, 1, 0, 58 * GB, &p),
                     BK_ERR_NOMEM);
    printf("  %s\n", bk_last_error());
    assert_non_null(strstr(bk_last_error(), "--samples 216 or fewer"));
    /* 64 GB host */
    bk_status st = bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 256, 2048, 4, 1, 1, 0, 58 * GB, &p);
    assert_int_equal(st, BK_ERR_NOMEM);
    assert_int_equal(bk_status_exit_code(st), 3);
    const char *msg = bk_last_error();
    printf("  %s\n", msg);
    assert_null(strchr(msg, '\n'));
    assert_non_null(strstr(msg, "60.1 GB of boundary matrices (7 x [524288 tokens x 4096] F32)"));
    assert_non_null(strstr(msg, "58.0 GB available"));
    assert_non_null(strstr(msg, "--bwd-flow naive"));
    /* room = 58 - 27.9 (copies, within 29) - 7.25 = 22.8 GB: 7 x 2048 x 4096 x 4
     * = 235 MB a sequence -> 97 sequences; leaf 16 (3 matrices, 25.8 GB) does not
     * fit, leaf 32 (none) does */
    assert_non_null(strstr(msg, "--samples 97 or fewer"));
    assert_non_null(strstr(msg, "--leaf-size 32 (no boundary matrices)"));
    /* the GPU flow: no larger leaf than the device holds (32 layers' Grams are
     * 119 GB on the device): leaf 32 suggested only when the device holds it */
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 256, 2048, 4, 1, 1, 4, 58 * GB, &p),
                     BK_ERR_NOMEM);
    printf("  %s\n", bk_last_error());
    assert_null(strstr(strstr(bk_last_error(), ": use "), "--leaf-size"));
    assert_non_null(strstr(bk_last_error(), "--samples 97 or fewer"));
    assert_non_null(strstr(bk_last_error(), "--bwd-flow naive"));
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 256, 2048, 4, 1, 1, 31, 58 * GB, &p),
                     BK_ERR_NOMEM);
    assert_null(strstr(strstr(bk_last_error(), ": use "), "--leaf-size"));
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 256, 2048, 4, 1, 1, 32, 58 * GB, &p),
                     BK_ERR_NOMEM);
    assert_non_null(strstr(bk_last_error(), "--leaf-size 32 (no boundary matrices)"));
    /* the suggestions fit */
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 97, 2048, 4, 1, 1, 0, 58 * GB, &p),
                     BK_OK);
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 98, 2048, 4, 1, 1, 0, 58 * GB, &p),
                     BK_ERR_NOMEM);
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_NAIVE, 4, 256, 2048, 4, 1, 1, 0, 58 * GB, &p),
                     BK_OK);
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 32, 256, 2048, 4, 1, 1, 0, 58 * GB, &p),
                     BK_OK);
    /* unknown available memory: no check */
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 1, 256, 2048, 4, 1, 1, 0, 0, &p), BK_OK);
    /* MPI ranks: --samples is of the whole set */
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 256, 2048, 4, 1, 2, 0, 58 * GB, &p),
                     BK_ERR_NOMEM);
    assert_non_null(strstr(bk_last_error(), "--samples 194 or fewer"));
    /* bf16 mode (session 14): BF16 boundaries, 7 x 4 GiB = 30064771072 bytes.
     * Mapped checkpoint (copies 32 x 205824 = 6586368 bytes: 51456 floats a
     * layer), 58 GB host: need = 30064771072 + 6586368 + 7250000000 (margin
     * 58e9 / 8) = 37321357440 <= 58e9: fits (F32 boundaries did not) */
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 256, 2048, 2,
                                       BK_BWD_HOST_GPU_MAPPED, 1, 0, 58 * GB, &p),
                     BK_OK);
    assert_int_equal(p.elem_bytes, 2);
    assert_true(p.boundary_bytes == 30064771072ull);
    assert_true(p.copies_bytes == 6586368ull);
    assert_true(p.need == 37321357440ull);
    /* BF16 host copies (checkpoint not BF16): 32 x (218103808 x 2 + 205824) =
     * 13965230080; need = 30064771072 + 13965230080 + 7250000000 = 51280001152 */
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 256, 2048, 2,
                                       BK_BWD_HOST_GPU_BF16, 1, 0, 58 * GB, &p),
                     BK_OK);
    assert_true(p.need == 51280001152ull);
    /* 30 GB available, mapped: need 30064771072 + 6586368 + 3750000000 > 30e9;
     * room = 30e9 - 6586368 - 3750000000 = 26243413632, a sequence's share
     * 7 x 2048 x 4096 x 2 = 117440512: 223 sequences (224 x 117440512 =
     * 26306674688 > room); leaf 5..7 still hold 7 matrices, leaf 8 holds 5
     * (5 x 4 GiB = 21474836480 = 21.5 GB <= room) */
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 256, 2048, 2,
                                       BK_BWD_HOST_GPU_MAPPED, 1, 0, 30 * GB, &p),
                     BK_ERR_NOMEM);
    printf("  %s\n", bk_last_error());
    assert_non_null(strstr(bk_last_error(),
                           "30.1 GB of boundary matrices (7 x [524288 tokens x 4096] BF16)"));
    assert_non_null(strstr(bk_last_error(), "--samples 223 or fewer"));
    assert_non_null(strstr(bk_last_error(), "--leaf-size 8 (5 matrices, 21.5 GB)"));
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 223, 2048, 2,
                                       BK_BWD_HOST_GPU_MAPPED, 1, 0, 30 * GB, &p),
                     BK_OK);
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_HALVING, 4, 224, 2048, 2,
                                       BK_BWD_HOST_GPU_MAPPED, 1, 0, 30 * GB, &p),
                     BK_ERR_NOMEM);
    /* the CPU flow: every layer's copy, double boundaries */
    assert_int_equal(bk_bwd_host_check(&c, BK_FLOW_NAIVE, 4, 1, 2048, 8, 0, 1, 0, 20 * GB, &p),
                     BK_ERR_NOMEM);
    assert_non_null(strstr(bk_last_error(), "more memory"));
    assert_true(p.copies_bytes > 27 * GB);
}

/* Session 14: the boundary budget and the wider splits at the 8B shape, with
 * the numbers of the H200 run (report.json at 9e903f3: host_available_bytes_at_plan
 * 133992964096, planned_host_weight_copies_bytes 6586368 (mapped BF16: biases
 * and norms only), boundary_budget 20, root_children 8, planned_boundary_matrices
 * 15, planned and measured peak 64424509440 bytes), derived here by hand:
 *   margin = avail / 8 = 16749120512; twice: 33498241024;
 *   reserve = 32 layers x 436413440 (a layer's BF16 matrices + F32 rest) = 13965230080;
 *   room = 133992964096 - 6586368 - 33498241024 - 13965230080 = 86522906624;
 *   one BF16 matrix = 524288 x 4096 x 2 = 4294967296; 86522906624 / it = 20.1 -> 20.
 * Leaf 4 (8 leaves): the root's 8 children hold 2 x 7 + 1 = 15 matrices
 * (64424509440 bytes) and no split below; 7 children would need 2 x 6 + 1 = 13
 * + a child's halving, which the least-work rule does not prefer. */
static void test_budget_8b(void **state)
{
    (void)state;
    const bk_model_config c = cfg(32, 4096, 14336, 32, 8, 128, 0);
    const int64_t N = 256 * 2048;
    const uint64_t avail = 133992964096ull;
    bk_bwd_host_plan p;
    bk_bwd_host_plan_make(&c, BK_FLOW_HALVING, 4, N, 2, BK_BWD_HOST_GPU_MAPPED, avail, &p);
    assert_true(p.copies_bytes == 6586368ull);
    assert_true(p.margin == 16749120512ull);
    assert_true(bk_bwd_host_layer_bytes(&c, BK_BWD_HOST_GPU_BF16) == 436413440ull);
    const int b = bk_bwd_units_budget(&p, N, 4096, 32ull * 436413440ull);
    assert_int_equal(b, 20);
    assert_int_equal(bk_bwd_split(0, 32, 4, 1, b), 8);
    bk_bwd_host_plan_widen(&p, &c, BK_FLOW_HALVING, 4, N, b);
    assert_int_equal(p.units, 15);
    assert_true(p.boundary_bytes == 64424509440ull);
    assert_int_equal(p.budget, 20);
    assert_true(p.need <= avail);
    /* the kept layer inputs: back through layers 4..31 at the root */
    assert_int_equal(bk_bwd_acts_layers_b(32, BK_FLOW_HALVING, 4, b), 28);
    assert_int_equal(bk_bwd_acts_layers_b(32, BK_FLOW_HALVING, 4, 0), 16);
    /* the schedule: the root and 8 leaves (the H200 printed "pass 1 of 9 ... back
     * through layers 5-32", then "gradients of layers 1-4" .. "29-32") */
    bk_bwd_pass_work w[16];
    assert_int_equal(bk_bwd_flow_schedule(32, 4, BK_FLOW_HALVING, b, w, 16), 9);
    assert_true(!w[0].leaf && w[0].lo == 4 && w[0].hi == 32 && w[0].forwards == 32 &&
                w[0].backwards == 28);
    for (int i = 1; i < 9; i++)
        assert_true(w[i].leaf && w[i].lo == 4 * (i - 1) && w[i].hi == 4 * i && w[i].depth == 1);
    /* a 64 GB host (58 GB available): no room beyond halving's 7 -> halving */
    bk_bwd_host_plan_make(&c, BK_FLOW_HALVING, 4, N, 2, BK_BWD_HOST_GPU_MAPPED, 58000000000ull, &p);
    const int b64 = bk_bwd_units_budget(&p, N, 4096, 32ull * 436413440ull);
    /* 58e9 - 6586368 - 14.5e9 - 13965230080 = 29528183552 -> 6 matrices */
    assert_int_equal(b64, 6);
    assert_int_equal(bk_bwd_split(0, 32, 4, 1, b64), 2);
    /* unknown availability: no budget */
    bk_bwd_host_plan_make(&c, BK_FLOW_HALVING, 4, N, 2, BK_BWD_HOST_GPU_MAPPED, 0, &p);
    assert_int_equal(bk_bwd_units_budget(&p, N, 4096, 0), 0);
}

/* --bwd-precision auto (session 15; the default since session 16): the names,
 * the default, the rule from the forward's GEMM arithmetic and where the flow
 * runs (bk_bwd_precision_resolve), and the host plan's rule
 * (bk_bwd_host_kinds), which refuses an unresolved auto. */
static void test_bwd_precision_auto(void **state)
{
    (void)state;
    static const char *const names[] = {"fp32", "fp64", "tf32", "bf16", "auto"};
    for (int i = 0; i < 5; i++) {
        bk_bwd_precision p = BK_BWD_FP64;
        assert_int_equal(bk_bwd_precision_from_name(names[i], &p), BK_OK);
        assert_int_equal((int)p, i);
        assert_string_equal(bk_bwd_precision_name(p), names[i]);
    }
    bk_bwd_precision p = BK_BWD_FP32;
    assert_int_not_equal(bk_bwd_precision_from_name("fp16", &p), BK_OK);
    bk_clear_error();
    assert_null(bk_bwd_precision_name((bk_bwd_precision)5));
    /* the default since session 16 (docs/hessians.md "Arithmetic"): auto */
    bk_quantize_opts qo;
    bk_quantize_opts_default(&qo);
    assert_int_equal(qo.bwd_precision, BK_BWD_AUTO);
    /* the CUDA backend's flow: bf16 exactly when the forward's GEMMs are bf16 */
    assert_int_equal(bk_bwd_precision_resolve(BK_BWD_AUTO, 1, BK_GEMM_BF16), BK_BWD_BF16);
    assert_int_equal(bk_bwd_precision_resolve(BK_BWD_AUTO, 1, BK_GEMM_TF32), BK_BWD_FP32);
    assert_int_equal(bk_bwd_precision_resolve(BK_BWD_AUTO, 1, BK_GEMM_FP32), BK_BWD_FP32);
    /* (an unresolved forward arithmetic is not BF16: the conservative fp32) */
    assert_int_equal(bk_bwd_precision_resolve(BK_BWD_AUTO, 1, BK_GEMM_AUTO), BK_BWD_FP32);
    /* the CPU's flow (fp64 arithmetic whatever the value): fp32 */
    for (int m = BK_GEMM_FP32; m <= BK_GEMM_AUTO; m++)
        assert_int_equal(bk_bwd_precision_resolve(BK_BWD_AUTO, 0, (bk_gemm_math)m), BK_BWD_FP32);
    /* a value given is kept, whatever the forward */
    for (int w = BK_BWD_FP32; w <= BK_BWD_BF16; w++)
        for (int g = 0; g < 2; g++)
            for (int m = BK_GEMM_FP32; m <= BK_GEMM_AUTO; m++)
                assert_int_equal(bk_bwd_precision_resolve((bk_bwd_precision)w, g, (bk_gemm_math)m),
                                 w);
    /* the host plan: auto never reaches it */
    int es = -1, copies = -1;
    assert_int_equal(bk_bwd_host_kinds(1, BK_BWD_AUTO, 0, &es, &copies), BK_ERR_INTERNAL);
    bk_clear_error();
    assert_int_equal(es, 0);
    assert_int_equal(bk_bwd_host_kinds(0, BK_BWD_AUTO, 0, &es, &copies), BK_ERR_INTERNAL);
    bk_clear_error();
    /* resolved: the GPU's bf16 halves the fp32 boundaries; BF16 copies of the
     * layers, none from a mapped BF16 checkpoint */
    assert_int_equal(bk_bwd_host_kinds(1, BK_BWD_BF16, 0, &es, &copies), BK_OK);
    assert_int_equal(es, 2);
    assert_int_equal(copies, BK_BWD_HOST_GPU_BF16);
    assert_int_equal(bk_bwd_host_kinds(1, BK_BWD_BF16, 1, &es, &copies), BK_OK);
    assert_int_equal(copies, BK_BWD_HOST_GPU_MAPPED);
    assert_int_equal(bk_bwd_host_kinds(1, BK_BWD_FP32, 1, &es, &copies), BK_OK);
    assert_int_equal(es, 4);
    assert_int_equal(copies, BK_BWD_HOST_GPU_F32);
    assert_int_equal(bk_bwd_host_kinds(1, BK_BWD_TF32, 0, &es, &copies), BK_OK);
    assert_int_equal(es, 4);
    assert_int_equal(bk_bwd_host_kinds(1, BK_BWD_FP64, 0, &es, &copies), BK_OK);
    assert_int_equal(es, 8);
    assert_int_equal(copies, BK_BWD_HOST_GPU_F32);
    /* the CPU's flow: doubles and its own copies, whatever the precision */
    assert_int_equal(bk_bwd_host_kinds(0, BK_BWD_BF16, 1, &es, &copies), BK_OK);
    assert_int_equal(es, 8);
    assert_int_equal(copies, BK_BWD_HOST_CPU);
}

/* ---------------------------------------------------- available host memory */

static char g_tmp[256];

static void put(const char *rel, const char *text)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", g_tmp, rel);
    for (char *p = path + strlen(g_tmp) + 1; *p; p++) /* (the folders on the way) */
        if (*p == '/') {
            *p = '\0';
            mkdir(path, 0700);
            *p = '/';
        }
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static uint64_t avail_at(const char *meminfo)
{
    char mi[512], self[512], root[512];
    snprintf(mi, sizeof mi, "%s/%s", g_tmp, meminfo);
    snprintf(self, sizeof self, "%s/self_cgroup", g_tmp);
    snprintf(root, sizeof root, "%s/cg", g_tmp);
    return bk__host_avail_bytes_at(mi, self, root);
}

/* MemAvailable, and the limits of the cgroups a container or a batch job
 * (Slurm) runs in: the host's MemAvailable does not see them, and a plan
 * (the boundary budget, --bwd-boundaries auto; the GPU flow's pinning) past
 * them ends in the OOM killer, not an error */
static void test_host_avail_cgroups(void **state)
{
    (void)state;
    snprintf(g_tmp, sizeof g_tmp, "/tmp/bk_avail_XXXXXX");
    assert_non_null(mkdtemp(g_tmp));
    char cmd[600];
    put("meminfo", "MemTotal:       33554432 kB\nMemFree:  100 kB\n"
                   "MemAvailable:    16777216 kB\nBuffers: 1 kB\n");
    put("meminfo_old", "MemTotal:       33554432 kB\nMemFree:  100 kB\n");
    /* no cgroup list: MemAvailable */
    char mi[512];
    snprintf(mi, sizeof mi, "%s/meminfo", g_tmp);
    assert_true(bk__host_avail_bytes_at(mi, NULL, NULL) == (uint64_t)16777216 * 1024);
    /* no MemAvailable (kernels before 3.14): the free pages, known */
    assert_true(avail_at("meminfo_old") > 0);
    /* cgroup v2 (a Slurm step): the job's limit 8 GB, 3 GB used of which
     * 1.5 GB file page cache (active 0.5, inactive 1); the step's none ("max") */
    put("self_cgroup", "0::/job_7/step_0\n");
    put("cg/job_7/memory.max", "8000000000\n");
    put("cg/job_7/memory.current", "3000000000\n");
    put("cg/job_7/memory.stat",
        "anon 1500000000\nfile 1500000000\nactive_file 500000000\ninactive_file 1000000000\n");
    put("cg/job_7/step_0/memory.max", "max\n");
    put("cg/job_7/step_0/memory.current", "2000000000\n");
    assert_true(avail_at("meminfo") == 6500000000ull);
    /* a tighter limit below: the least room */
    put("cg/job_7/step_0/memory.max", "4000000000\n");
    assert_true(avail_at("meminfo") == 2000000000ull);
    /* a limit above the host's MemAvailable: MemAvailable */
    put("cg/job_7/memory.max", "900000000000\n");
    put("cg/job_7/step_0/memory.max", "max\n");
    assert_true(avail_at("meminfo") == (uint64_t)16777216 * 1024);
    /* the limit reached: 1 byte (not 0, which is "unknown") */
    put("cg/job_7/memory.max", "2500000000\n");
    put("cg/job_7/memory.stat", "inactive_file 0\n");
    assert_true(avail_at("meminfo") == 1);
    /* a container's namespaced view (v2): its path is not under the mount,
     * the mount's root is the container's group */
    put("self_cgroup", "0::/../../other\n");
    put("cg/memory.max", "5000000000\n");
    put("cg/memory.current", "1000000000\n");
    assert_true(avail_at("meminfo") == 4000000000ull);
    /* cgroup v1 (a hybrid host: memory in v1, "0::/" the unified rest); the
     * group's path not under the mount (namespaced), unlimited at its root */
    put("self_cgroup", "4:memory:/process_api/7b07\n3:cpuset:/\n0::/\n");
    put("cg/memory/memory.limit_in_bytes", "9223372036854771712\n");
    put("cg/memory/memory.usage_in_bytes", "2327916544\n");
    assert_true(avail_at("meminfo") == (uint64_t)16777216 * 1024);
    /* v1 with a limit, with "memory" among other controllers */
    put("self_cgroup", "0::/\n4:cpu,memory:/\n");
    put("cg/memory/memory.limit_in_bytes", "3000000000\n");
    put("cg/memory/memory.stat",
        "cache 5\ntotal_active_file 100000000\ntotal_inactive_file 500000000\n");
    assert_true(avail_at("meminfo") == 1272083456ull);
    /* garbage in the files: no limit read, MemAvailable */
    put("cg/memory/memory.limit_in_bytes", "lots\n");
    assert_true(avail_at("meminfo") == (uint64_t)16777216 * 1024);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_8b_buffers),   cmocka_unit_test(test_1b_measured),
        cmocka_unit_test(test_8b_job_fits_80gb), cmocka_unit_test(test_fit_batch),
        cmocka_unit_test(test_cache_layers), cmocka_unit_test(test_auto_leaf),
        cmocka_unit_test(test_boundary_units), cmocka_unit_test(test_boundary_8b),
        cmocka_unit_test(test_host_check_8b), cmocka_unit_test(test_budget_8b),
        cmocka_unit_test(test_bwd_precision_auto), cmocka_unit_test(test_host_avail_cgroups),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
