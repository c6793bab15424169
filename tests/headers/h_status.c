/* status.h must compile on its own. */
#include "bakron/status.h"

int main(void)
{
    return 0;
}
