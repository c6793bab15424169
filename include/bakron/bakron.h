/* bakron — umbrella header. */
#ifndef BAKRON_BAKRON_H
#define BAKRON_BAKRON_H

#include "bakron/backend.h"
#include "bakron/dist.h"
#include "bakron/forward.h"
#include "bakron/hessian.h"
#include "bakron/model.h"
#include "bakron/pipeline.h"
#include "bakron/safetensors.h"
#include "bakron/solver.h"
#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "0.1.0" */
const char *bk_version(void);

#ifdef __cplusplus
}
#endif
#endif /* BAKRON_BAKRON_H */
