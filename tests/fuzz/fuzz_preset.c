/* libFuzzer target: a `quantize --config` preset (configs/) through the CLI's
 * preset reader. Accepted or rejected with one line; never a crash. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[560];
    fz_write("preset.json", data, size, path, sizeof path);
    bk_quantize_opts o;
    bk_status st = cli_preset_check(path, &o);
    if (st != BK_OK) {
        fz_check_message();
        if (bk_status_exit_code(st) == 0)
            abort();
    }
    return 0;
}
