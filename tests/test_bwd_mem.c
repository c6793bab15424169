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

#include <string.h>

#include "bakron/backward.h"
#include "bakron/pipeline.h"
#include "bwd_mem.h"

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

static const bk_bwd_mem_params BF16_HALVING = {BK_FLOW_HALVING, 1, BK_BWD_BF16, 1, 1, 0};

static void test_8b_buffers(void **state)
{
    (void)state;
    const bk_model_config c = cfg(32, 4096, 14336, 32, 8, 128, 0);
    /* the job's default at 8B: 2 x 2048, halving, leaf 1, bf16 */
    assert_int_equal(bk_bwd_dev_bytes(&c, 2, 2048, 256, &BF16_HALVING, 0), 12309954624ull);
    assert_int_equal(bk_bwd_dev_bytes(&c, 2, 2048, 256, &BF16_HALVING, 1), 14402912320ull);
    /* one cached layer in BF16 (matrices) + F32 biases and norms */
    assert_int_equal(bk_bwd_dev_layer_bytes(&c, BK_BWD_BF16), 436207616ull + 4ull * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096) + 4ull * (2 * 4096 + 2 * 128));
    /* the naive flow: no boundary scratch, but all 32 layer inputs kept (16 with halving) */
    bk_bwd_mem_params naive = BF16_HALVING;
    naive.flow = BK_FLOW_NAIVE;
    const uint64_t row = 2ull * 2048 * 4096 * 4;
    assert_int_equal(bk_bwd_dev_bytes(&c, 2, 2048, 256, &naive, 0) -
                         bk_bwd_dev_bytes(&c, 2, 2048, 256, &BF16_HALVING, 0),
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
    assert_int_equal(now, 10330415168ull);
    /* session 12's allocations: the Gram scratch in double, the whole [8192]^2 F32 Gram,
     * and the unfused attention backward (F32 P, dP; BF16 q, k, v, P, dS; no lse, D) */
    const uint64_t R = 4 * 2048, mo = 8192, TT = 4ull * 2048 * 2048, qd = 2048, kvd = 512;
    const uint64_t then = now + R * mo * (8 - 2) + mo * mo * 4 - mo * 1024 * 4 + 2 * TT * 4 +
                          (R * qd + 2 * R * kvd + 2 * TT) * 2 - 2 * R * 32 * 4;
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
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_8b_buffers),   cmocka_unit_test(test_1b_measured),
        cmocka_unit_test(test_8b_job_fits_80gb), cmocka_unit_test(test_fit_batch),
        cmocka_unit_test(test_cache_layers), cmocka_unit_test(test_auto_leaf),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
