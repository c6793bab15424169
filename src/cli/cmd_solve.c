/* bakron solve (stub). */
#include "cli.h"

bk_status bk_cmd_solve(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return bk_error(BK_ERR_UNSUPPORTED, "solve: not implemented yet");
}
