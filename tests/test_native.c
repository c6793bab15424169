/* Reading bakron native quantized folders (docs/formats.md): the codes and
 * scales written here by hand must dequantize to values computed directly in
 * the test; malformed layouts are refused with their status. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "test_util.h"

#include "bakron/model.h"
#include "bakron/safetensors.h"

#define HID 8
#define INTER 12
#define NL 2

static const int64_t shp[BK_MOD_COUNT][2] = {{8, 8}, {4, 8}, {4, 8}, {8, 8},
                                             {12, 8}, {12, 8}, {8, 12}};

/* code of module mod, row r, column c (symmetric: -3..3; asymmetric: 0..15) */
static int code_sym(int mod, int64_t r, int64_t c)
{
    return (int)((mod * 5 + r * 3 + c) % 7) - 3;
}
static int code_asym(int mod, int64_t r, int64_t c)
{
    return (int)((mod * 5 + r * 7 + c * 3) % 16);
}
static float scale_of(int mod, int64_t r, int64_t g)
{
    return 0.125f * (float)(1 + (mod + r + 2 * g) % 5);
}
static float zero_of(int mod, int64_t r, int64_t g)
{
    return (float)((mod + r + g) % 9) + 3.0f;
}

typedef struct variant {
    int asym;            /* U8 codes + qzeros */
    int group;           /* group_size, -1 per row */
    int keep_layer1;     /* layer 1 keeps ordinary weights (--layers 0:1) */
    const char *breakage; /* NULL, "scales_shape", "no_scales", "zeros_on_sym", "bad_dtype", "format" */
} variant;

static void write_model(const char *dir, const variant *v)
{
    bk_st_writer *w = NULL;
    assert_int_equal(bk_st_writer_create(&w), BK_OK);
    float *ones = calloc(64 * 64, sizeof(float));
    for (int i = 0; i < 64 * 64; i++)
        ones[i] = 1.0f;
    int64_t emb[2] = {10, HID}, nrm[1] = {HID};
    assert_int_equal(bk_st_writer_add(w, "model.embed_tokens.weight", BK_DT_F32, 2, emb, ones, 1), BK_OK);
    assert_int_equal(bk_st_writer_add(w, "model.norm.weight", BK_DT_F32, 1, nrm, ones, 1), BK_OK);
    char nm[128];
    for (int l = 0; l < NL; l++) {
        snprintf(nm, sizeof nm, "model.layers.%d.input_layernorm.weight", l);
        assert_int_equal(bk_st_writer_add(w, nm, BK_DT_F32, 1, nrm, ones, 1), BK_OK);
        snprintf(nm, sizeof nm, "model.layers.%d.post_attention_layernorm.weight", l);
        assert_int_equal(bk_st_writer_add(w, nm, BK_DT_F32, 1, nrm, ones, 1), BK_OK);
        for (int m = 0; m < BK_MOD_COUNT; m++) {
            int64_t o = shp[m][0], in = shp[m][1];
            const char *mn = bk_module_name((bk_module)m);
            if (l == 1 && v->keep_layer1) {
                float *wt = malloc((size_t)(o * in) * sizeof(float));
                for (int64_t i = 0; i < o * in; i++)
                    wt[i] = 0.25f * (float)(i % 9) - 1.0f;
                snprintf(nm, sizeof nm, "model.layers.%d.%s.weight", l, mn);
                int64_t s2[2] = {o, in};
                assert_int_equal(bk_st_writer_add(w, nm, BK_DT_F32, 2, s2, wt, 1), BK_OK);
                free(wt);
                continue;
            }
            int64_t g = v->group > 0 ? (in + v->group - 1) / v->group : 1;
            uint8_t *codes = malloc((size_t)(o * in));
            /* one spare group so the "scales_shape" breakage can declare [o, g + 1] */
            float *sc = calloc((size_t)(o * (g + 1)), sizeof(float));
            float *zr = calloc((size_t)(o * (g + 1)), sizeof(float));
            for (int64_t r = 0; r < o; r++) {
                for (int64_t c = 0; c < in; c++) {
                    int q = v->asym ? code_asym(m, r, c) : code_sym(m, r, c);
                    codes[r * in + c] = (uint8_t)(int8_t)q;
                }
                for (int64_t k = 0; k < g; k++) {
                    sc[r * g + k] = scale_of(m, r, k);
                    zr[r * g + k] = zero_of(m, r, k);
                }
            }
            int64_t cs[2] = {o, in}, ss[2] = {o, g};
            bk_dtype cdt = v->asym ? BK_DT_U8 : BK_DT_I8;
            if (v->breakage && !strcmp(v->breakage, "bad_dtype") && m == BK_MOD_UP)
                cdt = BK_DT_I16;
            snprintf(nm, sizeof nm, "model.layers.%d.%s.qweight", l, mn);
            if (cdt == BK_DT_I16) {
                int16_t *c16 = malloc((size_t)(o * in) * 2);
                for (int64_t i = 0; i < o * in; i++)
                    c16[i] = (int8_t)codes[i];
                assert_int_equal(bk_st_writer_add(w, nm, cdt, 2, cs, c16, 1), BK_OK);
                free(c16);
            } else {
                assert_int_equal(bk_st_writer_add(w, nm, cdt, 2, cs, codes, 1), BK_OK);
            }
            if (v->breakage && !strcmp(v->breakage, "scales_shape") && m == BK_MOD_DOWN)
                ss[1] = g + 1;
            snprintf(nm, sizeof nm, "model.layers.%d.%s.scales", l, mn);
            if (!(v->breakage && !strcmp(v->breakage, "no_scales") && m == BK_MOD_K))
                assert_int_equal(bk_st_writer_add(w, nm, BK_DT_F32, 2, ss, sc, 1), BK_OK);
            if (v->asym || (v->breakage && !strcmp(v->breakage, "zeros_on_sym") && m == BK_MOD_V)) {
                snprintf(nm, sizeof nm, "model.layers.%d.%s.qzeros", l, mn);
                assert_int_equal(bk_st_writer_add(w, nm, BK_DT_F32, 2, ss, zr, 1), BK_OK);
            }
            free(codes);
            free(sc);
            free(zr);
        }
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(bk_st_writer_save(w, path), BK_OK);
    bk_st_writer_free(w);
    free(ones);
    const char *fmt = v->breakage && !strcmp(v->breakage, "format") ? "gguf" : "native";
    char cfg[1024];
    snprintf(cfg, sizeof cfg,
             "{\"model_type\": \"llama\", \"num_hidden_layers\": %d, \"hidden_size\": %d, "
             "\"intermediate_size\": %d, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, "
             "\"vocab_size\": 10, \"tie_word_embeddings\": true, \"quantization_config\": "
             "{\"quant_method\": \"bakron\", \"format\": \"%s\", \"format_version\": 1, "
             "\"group_size\": %d, %s}}",
             NL, HID, INTER, fmt, v->group,
             /* the alphabets bakron quantize writes these codes under:
              * -3..3 per row is levels 3, grouped it is uniform 3-bit
              * symmetric (-4..3); 0..15 with zero points uniform 4-bit */
             v->asym ? "\"alphabet\": \"uniform\", \"bits\": 4, \"sym\": false"
             : v->group > 0 ? "\"alphabet\": \"uniform\", \"bits\": 3, \"sym\": true"
                            : "\"alphabet\": \"levels\", \"levels\": 3, \"sym\": true");
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(cfg, f);
    fclose(f);
}

static void check_variant(const variant *v)
{
    char dir[] = "/tmp/bk_test_native_XXXXXX";
    assert_non_null(mkdtemp(dir));
    write_model(dir, v);
    bk_model *model = NULL;
    bk_status st = bk_model_open(dir, &model);
    if (st != BK_OK)
        fail_msg("open: %s", bk_last_error());
    assert_int_equal(bk_model_is_quantized(model), 1);
    float buf[12 * 12];
    for (int l = 0; l < NL; l++) {
        for (int m = 0; m < BK_MOD_COUNT; m++) {
            int64_t o = shp[m][0], in = shp[m][1];
            assert_int_equal(bk_model_linear_f32(model, l, (bk_module)m, buf), BK_OK);
            for (int64_t r = 0; r < o; r++) {
                for (int64_t c = 0; c < in; c++) {
                    float want;
                    if (l == 1 && v->keep_layer1) {
                        want = 0.25f * (float)((r * in + c) % 9) - 1.0f;
                    } else {
                        int64_t k = v->group > 0 ? c / v->group : 0;
                        float s = scale_of(m, r, k);
                        want = v->asym ? ((float)code_asym(m, r, c) - zero_of(m, r, k)) * s
                                       : (float)code_sym(m, r, c) * s;
                    }
                    if (buf[r * in + c] != want)
                        fail_msg("layer %d %s [%lld,%lld]: %g, expected %g", l,
                                 bk_module_name((bk_module)m), (long long)r, (long long)c,
                                 (double)buf[r * in + c], (double)want);
                }
            }
        }
    }
    bk_model_close(model);
    tu_rm_model_dir(dir);
}

static void expect_refused(const variant *v, bk_status want, const char *fragment)
{
    char dir[] = "/tmp/bk_test_native_XXXXXX";
    assert_non_null(mkdtemp(dir));
    write_model(dir, v);
    bk_model *model = NULL;
    bk_status st = bk_model_open(dir, &model);
    if (st != want)
        fail_msg("%s: got %s (%s), expected %s", v->breakage, bk_status_name(st), bk_last_error(),
                 bk_status_name(want));
    assert_null(model);
    if (!strstr(bk_last_error(), fragment))
        fail_msg("%s: message '%s' lacks '%s'", v->breakage, bk_last_error(), fragment);
    tu_rm_model_dir(dir);
}

static void test_per_row_symmetric(void **state)
{
    (void)state;
    variant v = {0, -1, 0, NULL};
    check_variant(&v);
}

static void test_grouped_asymmetric(void **state)
{
    (void)state;
    variant v = {1, 4, 0, NULL};
    check_variant(&v);
}

static void test_grouped_uneven_and_partial_layers(void **state)
{
    (void)state;
    variant v = {0, 5, 1, NULL}; /* 8 = 5 + 3, 12 = 5 + 5 + 2 columns */
    check_variant(&v);
}

static void test_malformed(void **state)
{
    (void)state;
    variant a = {0, -1, 0, "scales_shape"};
    expect_refused(&a, BK_ERR_SHAPE, "down_proj.scales");
    variant b = {0, -1, 0, "no_scales"};
    expect_refused(&b, BK_ERR_MISSING_TENSOR, "k_proj");
    variant c = {0, -1, 0, "zeros_on_sym"};
    expect_refused(&c, BK_ERR_UNEXPECTED_TENSOR, "v_proj.qzeros");
    variant d = {0, -1, 0, "bad_dtype"};
    expect_refused(&d, BK_ERR_SHAPE, "up_proj.qweight");
    variant e = {0, -1, 0, "format"};
    expect_refused(&e, BK_ERR_UNSUPPORTED, "native");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_per_row_symmetric),
        cmocka_unit_test(test_grouped_asymmetric),
        cmocka_unit_test(test_grouped_uneven_and_partial_layers),
        cmocka_unit_test(test_malformed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
