// JobSpec <-> v1::JobSpec, field by field: the control plane carries the job every launch mode
// runs without a second model of it.
#pragma once

#include "accel/v1/coordinator.pb.h"
#include "agent/common/job_spec.h"

namespace accel::rpc {

v1::JobSpec to_proto(const JobSpec& spec);
JobSpec from_proto(const v1::JobSpec& spec);

}  // namespace accel::rpc
