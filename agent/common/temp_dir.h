// Private temporary folders ($TMPDIR, else /tmp) for files no log_dir keeps: the workers' error
// files and progress pages.
#pragma once

#include <string>

namespace accel {

// $TMPDIR when set and non-empty, else "/tmp".
std::string temp_root();
// Creates <temp_root>/<prefix>XXXXXX (mkdtemp: mode 0700) and returns its path; empty on
// failure, with errno saying why.
std::string make_temp_dir(const std::string& prefix);

}  // namespace accel
