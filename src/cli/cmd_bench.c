/* bakron bench (stub). */
#include "cli.h"

bk_status bk_cmd_bench(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return bk_error(BK_ERR_UNSUPPORTED, "bench: not implemented yet");
}
