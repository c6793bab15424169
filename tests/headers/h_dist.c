/* dist.h must compile on its own. */
#include "bakron/dist.h"

int main(void)
{
    return 0;
}
