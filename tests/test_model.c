/* Tests for src/model.c: config.json parsing, the checkpoint cross-check and
 * access to linear weights.
 *
 * Expected values are typed in from the config.json files themselves and from
 * parameter counts computed by hand from the configs (checked against the sum
 * of shapes in the safetensors headers with a separate Python reader). The
 * micro models written here at run time use a hand-rolled safetensors writer
 * (not the library's) and weights given by a closed formula.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bakron/model.h"
#include "bakron/pipeline.h"

static char *data_path(const char *rel)
{
    const char *root = getenv("BK_TEST_DATA");
    assert_non_null(root);
    size_t n = strlen(root) + strlen(rel) + 2;
    char *p = malloc(n);
    assert_non_null(p);
    snprintf(p, n, "%s/%s", root, rel);
    return p;
}

static char *example_path(void)
{
    const char *root = getenv("BK_SOURCE_ROOT");
    assert_non_null(root);
    size_t n = strlen(root) + 64;
    char *p = malloc(n);
    assert_non_null(p);
    snprintf(p, n, "%s/examples/kerneldocs-1.6m", root);
    return p;
}

static bk_status load_cfg_of(const char *dir, bk_model_config *c)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    return bk_model_config_load(path, c);
}

/* ------------------------------------------------ configs of the real models */

typedef struct expect_cfg {
    bk_arch arch;
    const char *model_type;
    int64_t layers, hidden, inter, heads, kv, head_dim, vocab, max_pos;
    double eps;
    bk_rope_type rope;
    double theta, factor, low, high;
    int64_t orig;
    int tie, qkv_bias, o_bias, mlp_bias, qk_norm;
    bk_dtype dtype;
    int64_t bos, eos;
    uint64_t params;
} expect_cfg;

static void check_cfg(const bk_model_config *c, const expect_cfg *e)
{
    assert_int_equal(c->arch, e->arch);
    assert_string_equal(c->model_type, e->model_type);
    assert_int_equal(c->n_layers, e->layers);
    assert_int_equal(c->hidden, e->hidden);
    assert_int_equal(c->intermediate, e->inter);
    assert_int_equal(c->n_heads, e->heads);
    assert_int_equal(c->n_kv_heads, e->kv);
    assert_int_equal(c->head_dim, e->head_dim);
    assert_int_equal(c->vocab, e->vocab);
    assert_int_equal(c->max_positions, e->max_pos);
    assert_true(c->rms_eps == e->eps);
    assert_int_equal(c->rope_type, e->rope);
    assert_true(c->rope_theta == e->theta);
    assert_true(c->rope_factor == e->factor);
    if (e->rope == BK_ROPE_LLAMA3) {
        assert_true(c->rope_low_freq_factor == e->low);
        assert_true(c->rope_high_freq_factor == e->high);
        assert_int_equal(c->rope_original_max_positions, e->orig);
    }
    assert_int_equal(c->tie_embeddings, e->tie);
    assert_int_equal(c->qkv_bias, e->qkv_bias);
    assert_int_equal(c->o_bias, e->o_bias);
    assert_int_equal(c->mlp_bias, e->mlp_bias);
    assert_int_equal(c->qk_norm, e->qk_norm);
    assert_string_equal(c->hidden_act, "silu");
    assert_int_equal(c->dtype, e->dtype);
    assert_int_equal(c->bos_token_id, e->bos);
    assert_int_equal(c->eos_token_id, e->eos);
    assert_true(bk_model_config_param_count(c) == e->params);
}

/* Typed in from tests/data/models/ * /config.json and examples/.../config.json.
 * Parameter counts by hand, e.g. tiny-llama3: embed 256*128 + lm_head 256*128
 * + norm 128 + 2 layers * (2*128 + 128*128 + 2*32*128 + 128*128 + 3*352*128). */
static const expect_cfg E_LLAMA3 = {BK_ARCH_LLAMA, "llama", 2, 128, 352, 8, 2, 16, 256, 4096,
                                    1e-5, BK_ROPE_LLAMA3, 500000.0, 8.0, 1.0, 4.0, 64,
                                    0, 0, 0, 0, 0, BK_DT_F32, 1, 2, 418432};
static const expect_cfg E_QWEN2 = {BK_ARCH_QWEN2, "qwen2", 2, 64, 176, 4, 2, 16, 300, 512,
                                   1e-6, BK_ROPE_DEFAULT, 1000000.0, 1.0, 0, 0, 0,
                                   1, 1, 0, 0, 0, BK_DT_F32, -1, -1, 111936};
static const expect_cfg E_QWEN3 = {BK_ARCH_QWEN3, "qwen3", 3, 96, 160, 6, 2, 32, 320, 512,
                                   1e-6, BK_ROPE_DEFAULT, 1000000.0, 1.0, 0, 0, 0,
                                   0, 0, 0, 0, 1, BK_DT_F32, -1, -1, 348000};
static const expect_cfg E_EXAMPLE = {BK_ARCH_LLAMA, "llama", 4, 192, 512, 6, 2, 32, 256, 1024,
                                     1e-5, BK_ROPE_DEFAULT, 10000.0, 1.0, 0, 0, 0,
                                     1, 0, 0, 0, 0, BK_DT_BF16, 1, 2, 1623744};

typedef struct real_model {
    const char *rel; /* under BK_TEST_DATA, or NULL for the example */
    const expect_cfg *e;
    bk_dtype dtype_override; /* the bf16 copy differs only in dtype */
} real_model;

static const real_model real_models[] = {
    {"models/tiny-llama3", &E_LLAMA3, BK_DT_COUNT},
    {"models/tiny-qwen2", &E_QWEN2, BK_DT_COUNT},
    {"models/tiny-qwen3", &E_QWEN3, BK_DT_COUNT},
    {"models/tiny-qwen3-bf16", &E_QWEN3, BK_DT_BF16},
    {NULL, &E_EXAMPLE, BK_DT_COUNT},
};

static char *real_path(const real_model *r)
{
    return r->rel ? data_path(r->rel) : example_path();
}

static void test_config_real_models(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof real_models / sizeof real_models[0]; i++) {
        char *dir = real_path(&real_models[i]);
        bk_model_config c;
        bk_status st = load_cfg_of(dir, &c);
        if (st != BK_OK)
            fail_msg("%s: %s", dir, bk_last_error());
        expect_cfg e = *real_models[i].e;
        if (real_models[i].dtype_override != BK_DT_COUNT)
            e.dtype = real_models[i].dtype_override;
        check_cfg(&c, &e);
        free(dir);
    }
}

static void test_open_real_models(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof real_models / sizeof real_models[0]; i++) {
        char *dir = real_path(&real_models[i]);
        bk_model *m = NULL;
        bk_status st = bk_model_open(dir, &m);
        if (st != BK_OK)
            fail_msg("%s: %s", dir, bk_last_error());
        const bk_model_config *c = bk_model_get_config(m);
        expect_cfg e = *real_models[i].e;
        if (real_models[i].dtype_override != BK_DT_COUNT)
            e.dtype = real_models[i].dtype_override;
        check_cfg(c, &e);
        assert_int_equal(bk_model_is_quantized(m), 0);
        assert_non_null(bk_model_dir(m));

        /* the checkpoints hold exactly the implied tensors */
        const bk_st_set *set = bk_model_tensors(m);
        uint64_t numel = 0;
        for (size_t k = 0; k < bk_st_set_count(set); k++)
            numel += bk_st_set_tensor(set, k)->numel;
        assert_true(numel == e.params);

        /* bk_model_find */
        const bk_tensor_info *t = bk_model_find(m, 0, "self_attn.k_proj.weight");
        assert_non_null(t);
        assert_string_equal(t->name, "model.layers.0.self_attn.k_proj.weight");
        assert_int_equal(t->shape[0], e.kv * e.head_dim);
        assert_int_equal(t->shape[1], e.hidden);
        t = bk_model_find(m, -1, "norm.weight");
        assert_non_null(t);
        assert_string_equal(t->name, "model.norm.weight");
        t = bk_model_find(m, -1, "embed_tokens.weight");
        assert_non_null(t);
        t = bk_model_find(m, -1, "lm_head.weight");
        if (e.tie)
            assert_null(t);
        else
            assert_non_null(t);
        assert_null(bk_model_find(m, (int)e.layers, "self_attn.q_proj.weight"));
        t = bk_model_find(m, (int)e.layers - 1, "self_attn.q_norm.weight");
        if (e.qk_norm)
            assert_non_null(t);
        else
            assert_null(t);
        t = bk_model_find(m, 0, "self_attn.v_proj.bias");
        if (e.qkv_bias)
            assert_non_null(t);
        else
            assert_null(t);
        bk_model_close(m);
        free(dir);
    }
}

/* ---------------------------------------------------- module helpers */

static void test_modules(void **state)
{
    (void)state;
    static const char *names[BK_MOD_COUNT] = {"self_attn.q_proj", "self_attn.k_proj",
                                              "self_attn.v_proj", "self_attn.o_proj",
                                              "mlp.gate_proj",    "mlp.up_proj",
                                              "mlp.down_proj"};
    for (int i = 0; i < BK_MOD_COUNT; i++)
        assert_string_equal(bk_module_name((bk_module)i), names[i]);
    assert_string_equal(bk_module_name(BK_MOD_COUNT), "?");

    bk_model_config c;
    char *dir = data_path("models/tiny-qwen3");
    assert_int_equal(load_cfg_of(dir, &c), BK_OK);
    free(dir);
    /* hidden 96, 6 heads / 2 kv of head_dim 32, intermediate 160 */
    static const int64_t want[BK_MOD_COUNT][2] = {{192, 96}, {64, 96},  {64, 96}, {96, 192},
                                                  {160, 96}, {160, 96}, {96, 160}};
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t o = -1, in = -1;
        bk_module_shape(&c, (bk_module)i, &o, &in);
        assert_int_equal(o, want[i][0]);
        assert_int_equal(in, want[i][1]);
    }
}

/* ------------------------------------------------- config variants (inline) */

static bk_status parse_str(const char *json, bk_model_config *c)
{
    return bk_model_config_parse(json, strlen(json), "inline.json", c);
}

#define SIZES "\"num_hidden_layers\": 2, \"hidden_size\": 256, \"intermediate_size\": 512, "

static void test_config_variants(void **state)
{
    (void)state;
    bk_model_config c;

    /* transformers 4.x Llama-3.1 style: rope_theta top level, rope_scaling */
    assert_int_equal(parse_str("{\"model_type\": \"llama\", " SIZES
                               "\"num_attention_heads\": 8, \"num_key_value_heads\": 2, "
                               "\"vocab_size\": 128256, \"rope_theta\": 500000.0, "
                               "\"max_position_embeddings\": 131072, \"rope_scaling\": {"
                               "\"factor\": 8.0, \"low_freq_factor\": 1.0, "
                               "\"high_freq_factor\": 4.0, "
                               "\"original_max_position_embeddings\": 8192, "
                               "\"rope_type\": \"llama3\"}, \"eos_token_id\": [128001, 128008, "
                               "128009], \"bos_token_id\": 128000, \"torch_dtype\": "
                               "\"bfloat16\"}",
                               &c),
                     BK_OK);
    assert_int_equal(c.rope_type, BK_ROPE_LLAMA3);
    assert_true(c.rope_theta == 500000.0);
    assert_true(c.rope_factor == 8.0);
    assert_int_equal(c.rope_original_max_positions, 8192);
    assert_int_equal(c.eos_token_id, 128001);
    assert_int_equal(c.bos_token_id, 128000);
    assert_int_equal(c.head_dim, 32);
    assert_int_equal(c.dtype, BK_DT_BF16);
    assert_int_equal(c.max_positions, 131072);

    /* llama3 without original_max_position_embeddings: max_position_embeddings */
    assert_int_equal(parse_str("{\"model_type\": \"llama\", " SIZES
                               "\"num_attention_heads\": 8, \"vocab_size\": 1000, "
                               "\"max_position_embeddings\": 777, \"rope_parameters\": {"
                               "\"rope_type\": \"llama3\", \"factor\": 2, "
                               "\"low_freq_factor\": 1, \"high_freq_factor\": 2}}",
                               &c),
                     BK_OK);
    assert_int_equal(c.rope_original_max_positions, 777);
    assert_true(c.rope_theta == 10000.0);

    /* old 4.x linear scaling with "type"; llama defaults */
    assert_int_equal(parse_str("{\"model_type\": \"llama\", " SIZES
                               "\"num_attention_heads\": 8, \"vocab_size\": 1000, "
                               "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}}",
                               &c),
                     BK_OK);
    assert_int_equal(c.rope_type, BK_ROPE_LINEAR);
    assert_true(c.rope_factor == 2.0);
    assert_true(c.rope_theta == 10000.0);
    assert_int_equal(c.n_kv_heads, 8); /* llama: = num_attention_heads */
    assert_int_equal(c.max_positions, 2048);
    assert_true(c.rms_eps == 1e-6);
    assert_int_equal(c.bos_token_id, 1);
    assert_int_equal(c.eos_token_id, 2);
    assert_int_equal(c.tie_embeddings, 0);
    assert_int_equal(c.dtype, BK_DT_F32);

    /* an empty rope_scaling does not hide rope_parameters (5.x); dtype wins
     * over torch_dtype */
    assert_int_equal(parse_str("{\"model_type\": \"llama\", " SIZES
                               "\"num_attention_heads\": 8, \"vocab_size\": 1000, "
                               "\"rope_scaling\": {}, \"rope_parameters\": {\"rope_type\": "
                               "\"linear\", \"factor\": 4, \"rope_theta\": 1234.5}, "
                               "\"rope_theta\": 99.0, \"dtype\": \"float16\", "
                               "\"torch_dtype\": \"float32\"}",
                               &c),
                     BK_OK);
    assert_int_equal(c.rope_type, BK_ROPE_LINEAR);
    assert_true(c.rope_factor == 4.0);
    assert_true(c.rope_theta == 1234.5);
    assert_int_equal(c.dtype, BK_DT_F16);

    /* llama with attention_bias and mlp_bias; explicit head_dim */
    assert_int_equal(parse_str("{\"model_type\": \"llama\", " SIZES
                               "\"num_attention_heads\": 8, \"vocab_size\": 1000, "
                               "\"attention_bias\": true, \"mlp_bias\": true, \"head_dim\": 64, "
                               "\"rope_scaling\": null, \"pad_token_id\": null}",
                               &c),
                     BK_OK);
    assert_int_equal(c.qkv_bias, 1);
    assert_int_equal(c.o_bias, 1);
    assert_int_equal(c.mlp_bias, 1);
    assert_int_equal(c.head_dim, 64);
    assert_int_equal(c.rope_type, BK_ROPE_DEFAULT);

    /* mistral: num_key_value_heads defaults to 8, no biases whatever the keys */
    assert_int_equal(parse_str("{\"model_type\": \"mistral\", " SIZES
                               "\"num_attention_heads\": 32, \"vocab_size\": 1000, "
                               "\"attention_bias\": true, \"mlp_bias\": true}",
                               &c),
                     BK_OK);
    assert_int_equal(c.arch, BK_ARCH_MISTRAL);
    assert_int_equal(c.n_kv_heads, 8);
    assert_int_equal(c.head_dim, 8);
    assert_int_equal(c.max_positions, 131072);
    assert_int_equal(c.qkv_bias + c.o_bias + c.mlp_bias + c.qk_norm, 0);
    assert_int_equal(c.bos_token_id, 1);

    /* qwen2: q/k/v biases always, o never, even with attention_bias false */
    assert_int_equal(parse_str("{\"model_type\": \"qwen2\", " SIZES
                               "\"num_attention_heads\": 32, \"vocab_size\": 1000, "
                               "\"attention_bias\": false}",
                               &c),
                     BK_OK);
    assert_int_equal(c.qkv_bias, 1);
    assert_int_equal(c.o_bias, 0);
    assert_int_equal(c.n_kv_heads, 32);
    assert_int_equal(c.max_positions, 32768);
    assert_int_equal(c.bos_token_id, -1);

    /* qwen3: head_dim defaults to 128 (not hidden / heads), q/k norms,
     * attention_bias honoured */
    assert_int_equal(parse_str("{\"model_type\": \"qwen3\", " SIZES
                               "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, "
                               "\"vocab_size\": 1000, \"attention_bias\": true, "
                               "\"tie_word_embeddings\": true}",
                               &c),
                     BK_OK);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.qk_norm, 1);
    assert_int_equal(c.qkv_bias, 1);
    assert_int_equal(c.o_bias, 1);
    assert_int_equal(c.tie_embeddings, 1);
    int64_t o, in;
    bk_module_shape(&c, BK_MOD_O, &o, &in);
    assert_int_equal(o, 256);
    assert_int_equal(in, 512);

    /* a bakron native export parses (quantized folders are told apart by
     * bk_model_open) */
    assert_int_equal(parse_str("{\"model_type\": \"llama\", " SIZES
                               "\"num_attention_heads\": 8, \"vocab_size\": 1000, "
                               "\"quantization_config\": {\"quant_method\": \"bakron\"}}",
                               &c),
                     BK_OK);

    /* whole numbers written as floats are accepted, partial_rotary_factor 1 too */
    assert_int_equal(parse_str("{\"model_type\": \"llama\", \"num_hidden_layers\": 2.0, "
                               "\"hidden_size\": 256, \"intermediate_size\": 512, "
                               "\"num_attention_heads\": 8, \"vocab_size\": 1e3, "
                               "\"partial_rotary_factor\": 1.0}",
                               &c),
                     BK_OK);
    assert_int_equal(c.n_layers, 2);
    assert_int_equal(c.vocab, 1000);

    /* a length shorter than the string: only that prefix is parsed */
    const char *txt = "{\"model_type\": \"llama\"} trailing";
    assert_int_equal(bk_model_config_parse(txt, 23, "prefix.json", &c), BK_ERR_CONFIG);
    assert_non_null(strstr(bk_last_error(), "missing required fields"));

    assert_int_equal(bk_model_config_parse(NULL, 0, "x", &c), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_model_config_parse("{}", 2, "x", NULL), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_model_config_load("/nonexistent/config.json", &c), BK_ERR_IO);
}

/* ------------------------------------------------------- bad config corpus */

typedef struct bad_case {
    const char *name;
    bk_status st;
    const char *needle; /* a fragment the message must contain (besides the file) */
} bad_case;

/* Expected codes typed in per file of tests/data/bad/config/. */
static const bad_case bad_configs[] = {
    {"not_json.json", BK_ERR_CONFIG, "not valid JSON"},
    {"empty.json", BK_ERR_CONFIG, "not valid JSON"},
    {"truncated.json", BK_ERR_CONFIG, "not valid JSON"},
    {"top_level_array.json", BK_ERR_CONFIG, "JSON object"},
    {"trailing_garbage.json", BK_ERR_CONFIG, "not valid JSON"},
    {"duplicate_key.json", BK_ERR_CONFIG, "hidden_size"},
    {"missing_fields.json", BK_ERR_CONFIG,
     "num_hidden_layers, intermediate_size, vocab_size"},
    {"missing_model_type.json", BK_ERR_CONFIG, "model_type"},
    {"null_hidden_size.json", BK_ERR_CONFIG, "hidden_size"},
    {"model_type_gpt2.json", BK_ERR_UNSUPPORTED, "llama, mistral, qwen2, qwen3"},
    {"model_type_qwen2_moe.json", BK_ERR_UNSUPPORTED, "qwen2_moe"},
    {"model_type_number.json", BK_ERR_CONFIG, "model_type"},
    {"hidden_size_fraction.json", BK_ERR_CONFIG, "hidden_size must be a whole number"},
    {"hidden_size_string.json", BK_ERR_CONFIG, "hidden_size must be an integer"},
    {"hidden_size_zero.json", BK_ERR_CONFIG, "hidden_size = 0 is out of range"},
    {"layers_negative.json", BK_ERR_CONFIG, "num_hidden_layers"},
    {"vocab_huge.json", BK_ERR_CONFIG, "vocab_size"},
    {"intermediate_2pow60.json", BK_ERR_CONFIG, "intermediate_size"},
    {"heads_not_dividing_hidden.json", BK_ERR_CONFIG, "multiple of num_attention_heads"},
    {"kv_heads_not_dividing.json", BK_ERR_CONFIG, "multiple of num_key_value_heads"},
    {"kv_heads_more_than_heads.json", BK_ERR_CONFIG, "num_key_value_heads"},
    {"qwen2_default_kv_heads.json", BK_ERR_CONFIG, "default"},
    {"head_dim_odd.json", BK_ERR_CONFIG, "even"},
    {"head_dim_zero.json", BK_ERR_CONFIG, "head_dim"},
    {"hidden_act_gelu.json", BK_ERR_UNSUPPORTED, "gelu"},
    {"hidden_act_number.json", BK_ERR_CONFIG, "hidden_act"},
    {"tie_not_bool.json", BK_ERR_CONFIG, "tie_word_embeddings must be true or false"},
    {"attention_bias_string.json", BK_ERR_CONFIG, "attention_bias"},
    {"rms_eps_zero.json", BK_ERR_CONFIG, "rms_norm_eps"},
    {"rms_eps_string.json", BK_ERR_CONFIG, "rms_norm_eps"},
    {"rope_theta_string.json", BK_ERR_CONFIG, "rope_theta"},
    {"rope_theta_negative.json", BK_ERR_CONFIG, "rope_theta"},
    {"rope_theta_underflow.json", BK_ERR_CONFIG, "rope_theta = 1e-50 makes a RoPE frequency non-finite"},
    {"rope_scaling_yarn.json", BK_ERR_UNSUPPORTED, "'yarn'"},
    {"rope_scaling_dynamic.json", BK_ERR_UNSUPPORTED, "'dynamic'"},
    {"rope_parameters_longrope.json", BK_ERR_UNSUPPORTED, "'longrope'"},
    {"rope_scaling_not_object.json", BK_ERR_CONFIG, "rope_scaling must be an object"},
    {"rope_type_number.json", BK_ERR_CONFIG, "rope_scaling.rope_type"},
    {"rope_linear_no_factor.json", BK_ERR_CONFIG, "factor"},
    {"rope_linear_factor_negative.json", BK_ERR_CONFIG, "rope_scaling.factor"},
    {"rope_llama3_missing_keys.json", BK_ERR_CONFIG, "low_freq_factor, high_freq_factor"},
    {"rope_llama3_freq_order.json", BK_ERR_CONFIG, "high_freq_factor"},
    {"rope_llama3_orig_fraction.json", BK_ERR_CONFIG, "original_max_position_embeddings"},
    {"rope_per_layer_type.json", BK_ERR_UNSUPPORTED, "per-layer"},
    {"partial_rotary.json", BK_ERR_UNSUPPORTED, "partial_rotary_factor"},
    {"dtype_int8.json", BK_ERR_UNSUPPORTED, "int8"},
    {"dtype_number.json", BK_ERR_CONFIG, "dtype"},
    {"eos_string.json", BK_ERR_CONFIG, "eos_token_id"},
    {"eos_list_negative.json", BK_ERR_CONFIG, "eos_token_id[1]"},
    {"bos_outside_vocab.json", BK_ERR_CONFIG, "bos_token_id = 100 is outside the vocabulary [0, 100)"},
    {"eos_list_outside_vocab.json", BK_ERR_CONFIG, "eos_token_id[1] = 1000 is outside the vocabulary"},
    {"key_with_nul.json", BK_ERR_CONFIG, "\\u0000"},
    {"raw_nul_in_string.json", BK_ERR_CONFIG, "a NUL byte"},
    {"quantized_awq.json", BK_ERR_UNSUPPORTED, "awq"},
    {"quantization_config_no_method.json", BK_ERR_CONFIG, "quant_method"},
};

/* Every file of the corpus folder has a row in the table (and vice versa). */
static void check_table_covers(const char *dir, const bad_case *cases, size_t n)
{
    DIR *d = opendir(dir);
    if (!d)
        fail_msg("cannot open %s", dir);
    size_t seen = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.' || !strcmp(e->d_name, "README.md"))
            continue;
        int found = 0;
        for (size_t i = 0; i < n && !found; i++)
            found = !strcmp(cases[i].name, e->d_name);
        if (!found)
            fail_msg("%s/%s has no expected status in tests/test_model.c", dir, e->d_name);
        seen++;
    }
    closedir(d);
    assert_int_equal(seen, n);
}

static void test_bad_configs(void **state)
{
    (void)state;
    char *dir = data_path("bad/config");
    size_t n = sizeof bad_configs / sizeof bad_configs[0];
    check_table_covers(dir, bad_configs, n);
    for (size_t i = 0; i < n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, bad_configs[i].name);
        bk_model_config c;
        memset(&c, 0x5a, sizeof c);
        bk_status st = bk_model_config_load(path, &c);
        const char *msg = bk_last_error();
        if (st != bad_configs[i].st)
            fail_msg("%s: got %s, expected %s (%s)", bad_configs[i].name, bk_status_name(st),
                     bk_status_name(bad_configs[i].st), msg);
        if (!strstr(msg, bad_configs[i].name))
            fail_msg("%s: message does not name the file: %s", bad_configs[i].name, msg);
        if (!strstr(msg, bad_configs[i].needle))
            fail_msg("%s: message lacks '%s': %s", bad_configs[i].name, bad_configs[i].needle,
                     msg);
        assert_null(strchr(msg, '\n'));
        assert_int_equal(bk_status_exit_code(st), 2);
    }
    free(dir);
}

/* --------------------------------------------------------- bad model corpus */

static const bad_case bad_models[] = {
    {"missing_up_proj", BK_ERR_MISSING_TENSOR,
     "1 tensor the config implies is missing: model.layers.0.mlp.up_proj.weight"},
    {"missing_attention", BK_ERR_MISSING_TENSOR, "4 tensors the config implies are missing"},
    {"missing_layer", BK_ERR_MISSING_TENSOR,
     "9 tensors the config implies are missing: model.layers.0.input_layernorm.weight, "
     "model.layers.0.post_attention_layernorm.weight, model.layers.0.self_attn.q_proj.weight, "
     "model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight and 4 "
     "more"},
    {"missing_lm_head", BK_ERR_MISSING_TENSOR,
     "missing: lm_head.weight (config.json has tie_word_embeddings=false)"},
    {"shape_k_proj", BK_ERR_SHAPE,
     "tensor model.layers.0.self_attn.k_proj.weight: shape [8, 8], config implies [4, 8] "
     "(from num_key_value_heads=1 x head_dim=4, hidden_size=8)"},
    {"shape_down_transposed", BK_ERR_SHAPE, "shape [16, 8], config implies [8, 16]"},
    {"shape_norm_2d", BK_ERR_SHAPE, "model.norm.weight: shape [8, 1], config implies [8]"},
    {"shape_vocab", BK_ERR_SHAPE, "vocab_size=16"},
    {"dtype_int_norm", BK_ERR_DTYPE, "model.layers.0.input_layernorm.weight: dtype I32"},
    {"dtype_f8_weight", BK_ERR_DTYPE, "dtype F8_E4M3"},
    {"unexpected_linear", BK_ERR_UNEXPECTED_TENSOR, "model.layers.0.mlp.extra_proj.weight"},
    {"unexpected_bias", BK_ERR_UNEXPECTED_TENSOR, "model.layers.0.self_attn.q_proj.bias"},
    {"unexpected_layer", BK_ERR_UNEXPECTED_TENSOR, "num_hidden_layers=1"},
    {"tied_with_lm_head", BK_ERR_UNEXPECTED_TENSOR, "tie_word_embeddings=true"},
    {"unexpected_head", BK_ERR_UNEXPECTED_TENSOR, "score.weight"},
    {"qwen2_without_biases", BK_ERR_MISSING_TENSOR, "self_attn.q_proj.bias"},
    {"qwen3_without_qk_norm", BK_ERR_MISSING_TENSOR, "self_attn.q_norm.weight"},
    {"config_gpt2", BK_ERR_UNSUPPORTED, "gpt2"},
    {"config_rope_yarn", BK_ERR_UNSUPPORTED, "yarn"},
    {"truncated_shard", BK_ERR_ST_FILE_SIZE, "model-00002-of-00002.safetensors"},
};

static void test_bad_models(void **state)
{
    (void)state;
    char *dir = data_path("bad/models");
    size_t n = sizeof bad_models / sizeof bad_models[0];
    check_table_covers(dir, bad_models, n);
    for (size_t i = 0; i < n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, bad_models[i].name);
        bk_model *m = (bk_model *)(uintptr_t)1;
        bk_status st = bk_model_open(path, &m);
        const char *msg = bk_last_error();
        if (st != bad_models[i].st)
            fail_msg("%s: got %s, expected %s (%s)", bad_models[i].name, bk_status_name(st),
                     bk_status_name(bad_models[i].st), msg);
        assert_null(m);
        if (!strstr(msg, bad_models[i].name))
            fail_msg("%s: message does not name the folder: %s", bad_models[i].name, msg);
        if (!strstr(msg, bad_models[i].needle))
            fail_msg("%s: message lacks '%s': %s", bad_models[i].name, bad_models[i].needle,
                     msg);
        assert_int_equal(bk_status_exit_code(st), 2);
    }
    free(dir);
}

/* ------------------------------------------------ micro models at run time */

typedef struct wt {
    char name[96];
    const char *dtype; /* "F32" or "BF16" */
    int ndim;
    int64_t shape[2];
    float *vals; /* numel values */
} wt;

static int cmp_wt(const void *a, const void *b)
{
    return strcmp(((const wt *)a)->name, ((const wt *)b)->name);
}

static size_t wt_numel(const wt *w)
{
    size_t n = 1;
    for (int i = 0; i < w->ndim; i++)
        n *= (size_t)w->shape[i];
    return n;
}

/* Hand-rolled safetensors writer (format: 8-byte LE header length, JSON,
 * data), independent of bakron's writer. Little-endian host assumed. */
static void write_st(const char *path, wt *ws, size_t n)
{
    qsort(ws, n, sizeof *ws, cmp_wt);
    char *hdr = malloc(65536);
    assert_non_null(hdr);
    size_t hl = 0, off = 0;
    hl += (size_t)snprintf(hdr + hl, 65536 - hl, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (size_t i = 0; i < n; i++) {
        size_t sz = wt_numel(&ws[i]) * (strcmp(ws[i].dtype, "F32") ? 2 : 4);
        hl += (size_t)snprintf(hdr + hl, 65536 - hl, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[",
                               ws[i].name, ws[i].dtype);
        for (int d = 0; d < ws[i].ndim; d++)
            hl += (size_t)snprintf(hdr + hl, 65536 - hl, "%s%lld", d ? "," : "",
                                   (long long)ws[i].shape[d]);
        hl += (size_t)snprintf(hdr + hl, 65536 - hl, "],\"data_offsets\":[%zu,%zu]}", off,
                               off + sz);
        off += sz;
    }
    hl += (size_t)snprintf(hdr + hl, 65536 - hl, "}");
    while (hl % 8)
        hdr[hl++] = ' ';
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint64_t n64 = hl;
    assert_int_equal(fwrite(&n64, 8, 1, f), 1);
    assert_int_equal(fwrite(hdr, 1, hl, f), hl);
    for (size_t i = 0; i < n; i++) {
        size_t k = wt_numel(&ws[i]);
        for (size_t j = 0; j < k; j++) {
            if (!strcmp(ws[i].dtype, "F32")) {
                assert_int_equal(fwrite(&ws[i].vals[j], 4, 1, f), 1);
            } else {
                uint32_t u;
                memcpy(&u, &ws[i].vals[j], 4);
                uint16_t h = (uint16_t)(u >> 16); /* values are exact in BF16 */
                assert_int_equal(fwrite(&h, 2, 1, f), 1);
            }
        }
    }
    assert_int_equal(fclose(f), 0);
    free(hdr);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
}

/* Weight value of module `mod`, row r, column c: small integers, exact in
 * BF16, different for every module. */
static float coded(int mod, int64_t r, int64_t c)
{
    return (float)((mod * 7 + r * 3 + c) % 17 - 8);
}

#define MICRO_CONFIG                                                                       \
    "{\"model_type\": \"llama\", \"num_hidden_layers\": 2, \"hidden_size\": 8, "           \
    "\"intermediate_size\": 12, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, " \
    "\"vocab_size\": 10, \"tie_word_embeddings\": true%s}"

static const char *mod_suffix[BK_MOD_COUNT] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};

/* Write a 2-layer micro Llama (hidden 8, 2 heads / 1 kv of head_dim 4,
 * intermediate 12, vocab 10, tied) into dir. quant: linear weights replaced
 * by made-up "codes" tensors and a bakron quantization_config. */
static void write_micro(const char *dir, const char *dtype, int quant, int extra)
{
    static const int64_t shp[BK_MOD_COUNT][2] = {{8, 8},  {4, 8},  {4, 8}, {8, 8},
                                                 {12, 8}, {12, 8}, {8, 12}};
    wt ws[64];
    size_t n = 0;
    memset(ws, 0, sizeof ws);
#define ADD(nm, nd, s0, s1)                                                  \
    do {                                                                     \
        snprintf(ws[n].name, sizeof ws[n].name, "%s", (nm));                 \
        ws[n].dtype = dtype;                                                 \
        ws[n].ndim = (nd);                                                   \
        ws[n].shape[0] = (s0);                                               \
        ws[n].shape[1] = (s1);                                               \
        ws[n].vals = calloc(wt_numel(&ws[n]), sizeof(float));                \
        assert_non_null(ws[n].vals);                                         \
        n++;                                                                 \
    } while (0)
    ADD("model.embed_tokens.weight", 2, 10, 8);
    ADD("model.norm.weight", 1, 8, 0);
    for (int l = 0; l < 2; l++) {
        char nm[96];
        snprintf(nm, sizeof nm, "model.layers.%d.input_layernorm.weight", l);
        ADD(nm, 1, 8, 0);
        snprintf(nm, sizeof nm, "model.layers.%d.post_attention_layernorm.weight", l);
        ADD(nm, 1, 8, 0);
        for (int mdl = 0; mdl < BK_MOD_COUNT; mdl++) {
            snprintf(nm, sizeof nm, "model.layers.%d.%s.%s", l, mod_suffix[mdl],
                     quant ? "codes" : "weight");
            ADD(nm, 2, shp[mdl][0], shp[mdl][1]);
            for (int64_t r = 0; r < shp[mdl][0]; r++)
                for (int64_t c = 0; c < shp[mdl][1]; c++)
                    ws[n - 1].vals[r * shp[mdl][1] + c] = coded(mdl + 10 * l, r, c);
        }
    }
    if (extra)
        ADD("model.layers.0.self_attn.rotary_emb.inv_freq", 1, 2, 0);
#undef ADD
    char path[4096], cfg[1024];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    write_st(path, ws, n);
    for (size_t i = 0; i < n; i++)
        free(ws[i].vals);
    snprintf(cfg, sizeof cfg, MICRO_CONFIG,
             quant ? ", \"quantization_config\": {\"quant_method\": \"bakron\"}" : "");
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_text(path, cfg);
}

static void rm_dir(const char *dir)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
}

static void check_micro_weights(const char *dtype, int extra)
{
    char dir[] = "/tmp/bk_test_model_XXXXXX";
    assert_non_null(mkdtemp(dir));
    write_micro(dir, dtype, 0, extra);
    bk_model *m = NULL;
    bk_status st = bk_model_open(dir, &m);
    if (st != BK_OK)
        fail_msg("%s", bk_last_error());
    const bk_model_config *c = bk_model_get_config(m);
    /* embed 10*8 + norm 8 + 2 * (2*8 + 8*8 + 2*4*8 + 8*8 + 3*12*8) */
    assert_true(bk_model_config_param_count(c) == 80 + 8 + 2 * (16 + 64 + 64 + 64 + 288));
    float buf[96];
    for (int l = 0; l < 2; l++)
        for (int mdl = 0; mdl < BK_MOD_COUNT; mdl++) {
            int64_t o, in;
            bk_module_shape(c, (bk_module)mdl, &o, &in);
            assert_true(o * in <= 96);
            memset(buf, 0, sizeof buf);
            assert_int_equal(bk_model_linear_f32(m, l, (bk_module)mdl, buf), BK_OK);
            for (int64_t r = 0; r < o; r++)
                for (int64_t k = 0; k < in; k++)
                    assert_true(buf[r * in + k] == coded(mdl + 10 * l, r, k));
        }
    assert_int_equal(bk_model_linear_f32(m, 2, BK_MOD_Q, buf), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_model_linear_f32(m, -1, BK_MOD_Q, buf), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_model_linear_f32(m, 0, BK_MOD_COUNT, buf), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_model_linear_f32(m, 0, BK_MOD_Q, NULL), BK_ERR_INVALID_ARG);
    bk_model_close(m);
    rm_dir(dir);
}

static void test_micro_f32(void **state)
{
    (void)state;
    check_micro_weights("F32", 0);
}

static void test_micro_bf16_with_inv_freq(void **state)
{
    (void)state;
    check_micro_weights("BF16", 1);
}

static void test_micro_quantized(void **state)
{
    (void)state;
    char dir[] = "/tmp/bk_test_model_XXXXXX";
    assert_non_null(mkdtemp(dir));
    write_micro(dir, "F32", 1, 0);
    /* a bakron quantization_config without "format": "native" / "format_version": 1
     * is refused at open (the native layout is tested in tests/test_native.c) */
    bk_model *m = NULL;
    bk_status st = bk_model_open(dir, &m);
    assert_int_equal(st, BK_ERR_UNSUPPORTED);
    assert_null(m);
    assert_non_null(strstr(bk_last_error(), "native"));
    rm_dir(dir);
}

static void test_open_errors(void **state)
{
    (void)state;
    bk_model *m = NULL;
    assert_int_equal(bk_model_open("/nonexistent-bakron-dir", &m), BK_ERR_IO);
    assert_null(m);
    assert_int_equal(bk_model_open(NULL, &m), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_model_open("/tmp", NULL), BK_ERR_INVALID_ARG);

    /* a folder with weights but no config.json */
    char dir[] = "/tmp/bk_test_model_XXXXXX";
    assert_non_null(mkdtemp(dir));
    write_micro(dir, "F32", 0, 0);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    assert_int_equal(bk_model_open(dir, &m), BK_ERR_IO);
    assert_non_null(strstr(bk_last_error(), "config.json"));
    assert_null(m);
    rm_dir(dir);

    /* a file instead of a folder */
    char *file = data_path("models/tiny-qwen2/config.json");
    assert_int_equal(bk_model_open(file, &m), BK_ERR_IO);
    free(file);

    bk_model_close(NULL);
    assert_null(bk_model_get_config(NULL));
    assert_null(bk_model_find(NULL, 0, "x"));
}

/* --gpu-math auto: BF16 GEMMs for a BF16 checkpoint, TF32 otherwise; explicit
 * choices pass through; names round-trip. */
static void test_gemm_math_auto(void **state)
{
    (void)state;
    char *d32 = data_path("models/tiny-qwen3"), *d16 = data_path("models/tiny-qwen3-bf16");
    bk_model *a = NULL, *b = NULL;
    assert_int_equal(bk_model_open(d32, &a), BK_OK);
    assert_int_equal(bk_model_open(d16, &b), BK_OK);
    assert_int_equal(bk_gemm_math_resolve(a, BK_GEMM_AUTO), BK_GEMM_TF32);
    assert_int_equal(bk_gemm_math_resolve(b, BK_GEMM_AUTO), BK_GEMM_BF16);
    assert_int_equal(bk_gemm_math_resolve(b, BK_GEMM_FP32), BK_GEMM_FP32);
    assert_int_equal(bk_gemm_math_resolve(a, BK_GEMM_BF16), BK_GEMM_BF16);
    const char *names[] = {"fp32", "tf32", "bf16", "auto"};
    for (int i = 0; i < 4; i++) {
        bk_gemm_math g;
        assert_int_equal(bk_gemm_math_from_name(names[i], &g), BK_OK);
        assert_string_equal(bk_gemm_math_name(g), names[i]);
    }
    bk_gemm_math g;
    assert_int_equal(bk_gemm_math_from_name("fp16", &g), BK_ERR_INVALID_ARG);
    bk_model_close(a);
    bk_model_close(b);
    free(d32);
    free(d16);
}

/* tiny-qwen3-bf16 is tiny-qwen3 rounded to BF16 (by torch, round to nearest
 * even): every weight agrees within half a BF16 ulp, |d| <= 2^-8 |w|. */
static void test_bf16_copy_agrees(void **state)
{
    (void)state;
    char *d32 = data_path("models/tiny-qwen3"), *d16 = data_path("models/tiny-qwen3-bf16");
    bk_model *a = NULL, *b = NULL;
    assert_int_equal(bk_model_open(d32, &a), BK_OK);
    assert_int_equal(bk_model_open(d16, &b), BK_OK);
    const bk_model_config *c = bk_model_get_config(a);
    for (int l = 0; l < c->n_layers; l++)
        for (int mdl = 0; mdl < BK_MOD_COUNT; mdl++) {
            int64_t o, in;
            bk_module_shape(c, (bk_module)mdl, &o, &in);
            size_t n = (size_t)(o * in);
            float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
            assert_non_null(x);
            assert_non_null(y);
            assert_int_equal(bk_model_linear_f32(a, l, (bk_module)mdl, x), BK_OK);
            assert_int_equal(bk_model_linear_f32(b, l, (bk_module)mdl, y), BK_OK);
            size_t nonzero = 0, differ = 0;
            for (size_t i = 0; i < n; i++) {
                assert_true(fabsf(x[i] - y[i]) <= ldexpf(fabsf(x[i]), -8));
                nonzero += x[i] != 0.0f;
                differ += x[i] != y[i];
            }
            assert_true(nonzero > n / 2);
            assert_true(differ > 0); /* really two different files */
            free(x);
            free(y);
        }
    bk_model_close(a);
    bk_model_close(b);
    free(d32);
    free(d16);
}

/* Sliding-window attention: Mistral's window is recorded (and the forward
 * pass refuses longer sequences); Qwen2's per-layer variant is refused. */
static void test_sliding_window(void **state)
{
    (void)state;
    bk_model_config c;
    const char *base = "{\"model_type\": \"%s\", \"num_hidden_layers\": 2, \"hidden_size\": 64, "
                       "\"intermediate_size\": 128, \"num_attention_heads\": 4, "
                       "\"num_key_value_heads\": 2, \"vocab_size\": 100%s}";
    char json[512];
    snprintf(json, sizeof json, base, "mistral", ", \"sliding_window\": 16");
    assert_int_equal(bk_model_config_parse(json, strlen(json), "m.json", &c), BK_OK);
    assert_int_equal(c.sliding_window, 16);
    snprintf(json, sizeof json, base, "mistral", ", \"sliding_window\": null");
    assert_int_equal(bk_model_config_parse(json, strlen(json), "m.json", &c), BK_OK);
    assert_int_equal(c.sliding_window, 0);
    snprintf(json, sizeof json, base, "mistral", ", \"sliding_window\": 0");
    assert_int_equal(bk_model_config_parse(json, strlen(json), "m.json", &c), BK_ERR_CONFIG);
    snprintf(json, sizeof json, base, "qwen2", ", \"use_sliding_window\": false, \"sliding_window\": 16");
    assert_int_equal(bk_model_config_parse(json, strlen(json), "q.json", &c), BK_OK);
    assert_int_equal(c.sliding_window, 0);
    snprintf(json, sizeof json, base, "qwen2", ", \"use_sliding_window\": true, \"sliding_window\": 16");
    assert_int_equal(bk_model_config_parse(json, strlen(json), "q.json", &c), BK_ERR_UNSUPPORTED);
    assert_non_null(strstr(bk_last_error(), "use_sliding_window"));
    snprintf(json, sizeof json, base, "llama", ", \"sliding_window\": 16");
    assert_int_equal(bk_model_config_parse(json, strlen(json), "l.json", &c), BK_OK);
    assert_int_equal(c.sliding_window, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config_real_models),
        cmocka_unit_test(test_open_real_models),
        cmocka_unit_test(test_modules),
        cmocka_unit_test(test_config_variants),
        cmocka_unit_test(test_sliding_window),
        cmocka_unit_test(test_bad_configs),
        cmocka_unit_test(test_bad_models),
        cmocka_unit_test(test_micro_f32),
        cmocka_unit_test(test_micro_bf16_with_inv_freq),
        cmocka_unit_test(test_micro_quantized),
        cmocka_unit_test(test_open_errors),
        cmocka_unit_test(test_bf16_copy_agrees),
        cmocka_unit_test(test_gemm_math_auto),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
