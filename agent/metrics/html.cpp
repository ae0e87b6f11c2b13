// Escaping, plots and the page head.
#include "agent/metrics/html.h"

#include <algorithm>
#include <cstdio>
#include <ctime>

namespace accel::metrics {

std::string html_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t') {
          out += "\xEF\xBF\xBD";
        } else {
          out += c;
        }
    }
  }
  return out;
}

std::string sparkline(const std::deque<float>& values, int width, int height) {
  std::string svg = "<svg class=\"rate\" width=\"" + std::to_string(width) + "\" height=\"" +
                    std::to_string(height) + "\" viewBox=\"0 0 " + std::to_string(width) + " " +
                    std::to_string(height) + "\">";
  float top = 0;
  for (float v : values) top = std::max(top, v);
  if (values.size() >= 2 && top > 0) {
    svg += "<polyline fill=\"none\" stroke=\"currentColor\" stroke-width=\"1.5\" points=\"";
    for (size_t i = 0; i < values.size(); ++i) {
      char pt[48];
      double x = static_cast<double>(i) * (width - 2) / static_cast<double>(values.size() - 1) + 1;
      double y = (height - 2) - static_cast<double>(values[i]) / top * (height - 4) + 1;
      std::snprintf(pt, sizeof pt, "%s%.1f,%.1f", i ? " " : "", x, y);
      svg += pt;
    }
    svg += "\"/>";
  }
  svg += "</svg>";
  return svg;
}

std::string page_head(std::string_view title, int refresh_s) {
  std::string head = "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">";
  if (refresh_s > 0)
    head += "<meta http-equiv=\"refresh\" content=\"" + std::to_string(refresh_s) + "\">";
  head += "<title>" + html_escape(title) + "</title><style>";
  head +=
      "body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}"
      "table{border-collapse:collapse;margin:.5em 0 1.5em}"
      "th,td{border-bottom:1px solid #ddd;padding:3px 10px;text-align:left;vertical-align:middle}"
      "th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}"
      "tr.straggler{background:#fde2e1}tr.straggler td.mark{color:#b00;font-weight:bold}"
      "tr.stalled{background:#fff3cd}"
      ".state-running,.state-busy{color:#060}.state-failed,.state-lost{color:#b00}"
      ".state-restarting,.state-rendezvous{color:#a60}"
      "svg.rate{color:#36c}pre.summary{background:#f8f8f8;padding:.5em;white-space:pre-wrap}"
      "ul.events{font-family:monospace;font-size:12px}small{color:#666}";
  head += "</style></head><body>\n";
  return head;
}

std::string utc_time(long long unix_ms) {
  std::time_t t = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[40];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

}  // namespace accel::metrics
