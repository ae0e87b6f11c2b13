// libaccel's public API in one include.
#pragma once

#include "accel/accelerator.h"
#include "accel/data.h"
#include "accel/error.h"
#include "accel/gradient_state.h"
#include "accel/logging.h"
#include "accel/mixed_precision.h"
#include "accel/model_io.h"
#include "accel/prepared_model.h"
#include "accel/schedulers.h"
#include "accel/seed.h"
#include "accel/state.h"
