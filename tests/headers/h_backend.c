/* backend.h must compile on its own. */
#include "bakron/backend.h"

int main(void)
{
    return 0;
}
