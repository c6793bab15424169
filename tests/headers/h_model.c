/* model.h must compile on its own. */
#include "bakron/model.h"

int main(void)
{
    return 0;
}
