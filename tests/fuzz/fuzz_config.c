/* libFuzzer target: config.json text through bk_model_config_parse. An
 * accepted config must satisfy the invariants the rest of bakron relies on
 * (docs/formats.md "config.json"); a rejected one leaves one line. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/model.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    bk_model_config c;
    bk_status st = bk_model_config_parse((const char *)data, size, "fuzz-config.json", &c);
    if (st != BK_OK) {
        fz_check_message();
        return 0;
    }
    if (c.n_layers < 1 || c.hidden < 1 || c.intermediate < 1 || c.vocab < 1 || c.n_heads < 1 ||
        c.n_kv_heads < 1 || c.n_heads % c.n_kv_heads != 0 || c.head_dim < 2 ||
        c.head_dim % 2 != 0 || c.max_positions < 1 || !(c.rms_eps > 0) ||
        !(c.rope_theta > 0))
        abort();
    if (c.bos_token_id >= c.vocab || c.eos_token_id >= c.vocab)
        abort();
    (void)bk_model_config_param_count(&c);
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        int64_t o, i;
        bk_module_shape(&c, (bk_module)m, &o, &i);
        if (o < 1 || i < 1)
            abort();
    }
    return 0;
}
