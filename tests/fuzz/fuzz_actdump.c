/* libFuzzer target: an activation dump (docs/activations.md) of the micro
 * model (tests/fuzz/micro-model, one layer): the input is MANIFEST \0 LAYER-FILE,
 * written as DIR/manifest.json and as both layer.0000.safetensors and
 * layer.0000.safetensors.zst; then the reader's checks (bk__act_open) and, when
 * they pass, the layer file opened and read as quantize does. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/model.h"
#include "fuzz_util.h"
#include "pipeline_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static bk_model *micro;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!micro && bk_model_open(BK_FUZZ_MODEL_DIR, &micro) != BK_OK)
        abort(); /* the micro model must open */
    const uint8_t *nul = memchr(data, 0, size);
    size_t ml = nul ? (size_t)(nul - data) : size;
    const uint8_t *layer = nul ? nul + 1 : (const uint8_t *)"";
    size_t ll = nul ? size - ml - 1 : 0;
    char path[560];
    fz_write("manifest.json", data, ml, path, sizeof path);
    fz_write("layer.0000.safetensors", layer, ll, path, sizeof path);
    fz_write("layer.0000.safetensors.zst", layer, ll, path, sizeof path);
    bk_act_reader *r = NULL;
    int64_t S = 0, T = 0;
    const char *note = NULL;
    bk_status st = bk__act_open(fz_tmpdir(), micro, 0, &r, &S, &T, &note);
    if (st != BK_OK) {
        if (r)
            abort();
        fz_check_message();
        return 0;
    }
    const bk_model_config *c = bk_model_get_config(micro);
    if (S < 1 || T < 1)
        abort();
    bk_act_layer al;
    st = bk__act_layer_open(r, 0, &al);
    if (st == BK_OK) {
        float *buf = malloc((size_t)(T * c->intermediate) * sizeof(float));
        if (!buf)
            abort();
        st = bk__act_rows(&al, "down_in", 0, T, c->intermediate, buf);
        if (st == BK_OK)
            st = bk__act_rows(&al, "attn_in", (S - 1) * T, T, c->hidden, buf);
        free(buf);
        bk__act_layer_close(&al);
    }
    if (st != BK_OK)
        fz_check_message();
    bk__act_close(r);
    return 0;
}
