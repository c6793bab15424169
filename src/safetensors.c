/* safetensors.c — to be implemented (see include/bakron/). */
#include "bakron/status.h"
typedef int bk_safetensors_placeholder;
