/* safetensors.h must compile on its own. */
#include "bakron/safetensors.h"

int main(void)
{
    return 0;
}
