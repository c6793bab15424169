/* bakron inspect (stub). */
#include "cli.h"

bk_status bk_cmd_inspect(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return bk_error(BK_ERR_UNSUPPORTED, "inspect: not implemented yet");
}
