/* model.c — to be implemented (see include/bakron/). */
#include "bakron/status.h"
typedef int bk_model_placeholder;
