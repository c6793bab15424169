/* backward.h must compile on its own. */
#include "bakron/backward.h"

int main(void)
{
    return 0;
}
