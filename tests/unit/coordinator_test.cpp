// CoordinatorCore unit tests (FakeClock, no gRPC): filled in below.
#include <gtest/gtest.h>

#include "agent/coordinator/coordinator_core.h"
