// Pieces of the status pages: escaping (node names, job ids and log lines are untrusted: they
// come from agents and programs) and the small inline plots. No external assets: the pages must
// work on an air-gapped cluster.
#pragma once

#include <deque>
#include <string>
#include <string_view>

namespace accel::metrics {

// `text` safe inside an element or a quoted attribute: & < > " ' escaped, control characters
// other than tab and newline replaced by U+FFFD.
std::string html_escape(std::string_view text);

// An inline SVG polyline of `values` (oldest first), scaled to the largest; empty values: an
// empty plot. class="rate".
std::string sparkline(const std::deque<float>& values, int width, int height);

// The shared <head> parts: charset, the refresh (0: none), the title (escaped here) and the
// style sheet.
std::string page_head(std::string_view title, int refresh_s);

// "2026-11-28 21:04:05 UTC"
std::string utc_time(long long unix_ms);

}  // namespace accel::metrics
