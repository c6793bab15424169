/* st_writer.c — to be implemented (see include/bakron/). */
#include "bakron/status.h"
typedef int bk_st_writer_placeholder;
