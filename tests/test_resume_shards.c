/* --resume without module files (native export): the weights a resumed run
 * rebuilds from the shards' qweight/scales/qzeros are bit for bit those of the
 * module-file path (a dequantized export, which keeps module files), and both
 * are the dequantization written out here (levels c*s, uniform s*(c - z) in
 * float), for every code of the alphabet, groups, asymmetric zeros. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/bakron.h"
#include "pipeline_internal.h"
#include "resume.h"
#include "st_internal.h"
#include "util.h"

static bk_model_config small_cfg(void)
{
    bk_model_config c;
    memset(&c, 0, sizeof c);
    c.n_layers = 1;
    c.hidden = 64;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.head_dim = 32;
    c.intermediate = 96;
    return c;
}

static int count_module_files(const char *work)
{
    char p[4400];
    snprintf(p, sizeof p, "%s/.resume", work);
    DIR *d = opendir(p);
    int k = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
        k += e->d_name[0] == 'L';
    if (d)
        closedir(d);
    return k;
}

/* A resume state in a new work folder of root, its stream with layer 0's
 * modules declared (native or dequantized), each module saved and journaled;
 * then restored and the weights loaded into w. */
static void run_one(const char *root, const char *tag, const bk_quantize_opts *o,
                    const bk_model_config *cfg, bk_solve_result *res, float **w, int *nfiles)
{
    char work[4200];
    snprintf(work, sizeof work, "%s/%s", root, tag);
    assert_int_equal(bk_mkdir_p(work), BK_OK);
    bk_resume_source src = {.o = o, .backend = "cpu", .stages = "cpu", .gpu_math = "fp32",
                            .S = 1, .T = 1, .batch = 1, .layer_begin = 0, .layer_end = 1};
    bk_resume *r = NULL;
    assert_int_equal(bk_resume_open(work, 0, &src, 1, &r), BK_OK);
    bk_st_stream *s = NULL;
    assert_int_equal(bk_st_stream_begin_resumable(work, "model", 0, &s), BK_OK);
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        char name[200];
        snprintf(name, sizeof name, "model.layers.0.%s.weight", bk_module_name((bk_module)m));
        if (o->export_format == BK_EXPORT_DEQUANTIZED) {
            int64_t out, in;
            bk_module_shape(cfg, (bk_module)m, &out, &in);
            int64_t shp[2] = {out, in};
            assert_int_equal(bk_st_stream_declare(s, name, BK_DT_F32, 2, shp), BK_OK);
        } else {
            assert_int_equal(bk__declare_quantized(s, o, cfg, name, (bk_module)m), BK_OK);
        }
    }
    int reused = 0;
    assert_int_equal(bk_st_stream_open_files(s, &reused), BK_OK);
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        char name[200];
        if (o->export_format == BK_EXPORT_DEQUANTIZED) {
            snprintf(name, sizeof name, "model.layers.0.%s.weight", bk_module_name((bk_module)m));
            assert_int_equal(bk_st_stream_write(s, name, res[m].weight), BK_OK);
        } else {
            assert_int_equal(bk__write_module(s, o, cfg, NULL, 0, (bk_module)m, &res[m]), BK_OK);
        }
        assert_int_equal(bk_resume_save_module(r, &o->solve.quant, 0, (bk_module)m, &res[m]),
                         BK_OK);
    }
    assert_int_equal(bk_resume_layer_done(r, s, 0, "[]"), BK_OK);
    *nfiles = count_module_files(work);
    cJSON *rep = cJSON_CreateArray();
    int64_t params = 0;
    int next = -1;
    assert_int_equal(bk_resume_restore(r, s, 1, rep, &params, &next, NULL, NULL), BK_OK);
    assert_int_equal(next, 1);
    bk_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        w[m] = calloc((size_t)(res[m].m * res[m].n), sizeof(float));
        lw.w[m] = w[m];
    }
    assert_int_equal(bk_resume_load_weights(r, &o->solve.quant, cfg, 0, &lw), BK_OK);
    cJSON_Delete(rep);
    bk_st_stream_keep(s);
    bk_resume_free(r);
}

static void check_kind(const bk_quant_spec *q)
{
    char root[] = "/tmp/bk_resume_shards_XXXXXX";
    assert_non_null(mkdtemp(root));
    const bk_model_config cfg = small_cfg();
    bk_solve_result res[BK_MOD_COUNT];
    uint64_t rng = 12345;
    for (int mi = 0; mi < BK_MOD_COUNT; mi++) {
        bk_solve_result *r = &res[mi];
        memset(r, 0, sizeof *r);
        bk_module_shape(&cfg, (bk_module)mi, &r->m, &r->n);
        const int64_t m = r->m, n = r->n;
        const int64_t gs = q->kind == BK_Q_UNIFORM && q->group > 0 ? q->group : n;
        r->groups = (n + gs - 1) / gs;
        const int lo = q->kind == BK_Q_LEVELS ? -q->levels : 0;
        const int hi = q->kind == BK_Q_LEVELS ? q->levels : (1 << q->bits) - 1;
        r->codes = malloc((size_t)(m * n) * sizeof(int16_t));
        r->scales = malloc((size_t)(m * r->groups) * sizeof(float));
        r->weight = malloc((size_t)(m * n) * sizeof(float));
        if (q->kind == BK_Q_UNIFORM && q->asym)
            r->zeros = malloc((size_t)(m * r->groups) * sizeof(float));
        for (int64_t i = 0; i < m * r->groups; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            r->scales[i] = (float)((rng >> 40) + 1) * 1e-7f;
            if (r->zeros)
                r->zeros[i] = (float)((rng >> 20) % (uint64_t)(hi + 1));
        }
        for (int64_t i = 0; i < m * n; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            /* every code of the alphabet, the ends included */
            int c = i < hi - lo + 1 ? lo + (int)i : lo + (int)((rng >> 33) % (uint64_t)(hi - lo + 1));
            r->codes[i] = (int16_t)c;
            const int64_t gi = (i / n) * r->groups + (i % n) / gs;
            const float z = r->zeros                     ? r->zeros[gi]
                            : q->kind == BK_Q_UNIFORM ? (float)(1 << (q->bits - 1))
                                                      : 0.0f; /* (levels: unused) */
            r->weight[i] = q->kind == BK_Q_LEVELS ? (float)c * r->scales[gi]
                                                  : r->scales[gi] * ((float)c - z);
        }
    }
    bk_quantize_opts o;
    bk_quantize_opts_default(&o);
    o.model_dir = root;
    o.solve.quant = *q;
    o.export_format = BK_EXPORT_NATIVE;
    float *wn[BK_MOD_COUNT], *wf[BK_MOD_COUNT];
    int nn = -1, nf = -1;
    run_one(root, "native", &o, &cfg, res, wn, &nn);
    o.export_format = BK_EXPORT_DEQUANTIZED;
    run_one(root, "dequantized", &o, &cfg, res, wf, &nf);
    assert_int_equal(nn, 0);             /* the shards hold the codes */
    assert_int_equal(nf, BK_MOD_COUNT);  /* a module file each */
    for (int mi = 0; mi < BK_MOD_COUNT; mi++) {
        const size_t nb = (size_t)(res[mi].m * res[mi].n) * sizeof(float);
        assert_memory_equal(wn[mi], wf[mi], nb);
        assert_memory_equal(wn[mi], res[mi].weight, nb);
        free(wn[mi]);
        free(wf[mi]);
        bk_solve_result_free(&res[mi]);
    }
    bk_remove_tree(root);
}

static void test_levels(void **state)
{
    (void)state;
    bk_quant_spec q = {.kind = BK_Q_LEVELS, .levels = 127};
    check_kind(&q);
    q.levels = 3;
    check_kind(&q);
}

static void test_uniform_sym(void **state)
{
    (void)state;
    bk_quant_spec q = {.kind = BK_Q_UNIFORM, .bits = 8};
    check_kind(&q);
    q.bits = 4;
    q.group = 32;
    check_kind(&q);
    q.bits = 2;
    q.group = 48; /* (a last group narrower than the others: 96 = 2 x 48, 64 = 48 + 16) */
    check_kind(&q);
}

static void test_uniform_asym(void **state)
{
    (void)state;
    bk_quant_spec q = {.kind = BK_Q_UNIFORM, .bits = 8, .asym = 1};
    check_kind(&q);
    q.bits = 3;
    q.group = 32;
    check_kind(&q);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_levels),
        cmocka_unit_test(test_uniform_sym),
        cmocka_unit_test(test_uniform_asym),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
