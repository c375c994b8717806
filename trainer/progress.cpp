// Text helpers and the progress bar's text.
#include "progress.h"

#include <cstdarg>
#include <cstdio>

namespace fusetrain::trainer {

std::string format(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  return buf;
}

std::string duration_text(double s) {
  if (s < 60) return format("%.1fs", s);
  const auto total = static_cast<int64_t>(s);
  if (total < 3600) return format("%ldm%02lds", static_cast<long>(total / 60), static_cast<long>(total % 60));
  return format("%ldh%02ldm", static_cast<long>(total / 3600), static_cast<long>(total % 3600 / 60));
}


std::string bar_text(int64_t epoch, int64_t epochs, int64_t done, int64_t total, double loss,
                     double rate, double eta) {
  constexpr int kWidth = 24;
  const int filled = total ? static_cast<int>(kWidth * done / total) : kWidth;
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kWidth, '.');
  return format("epoch %ld/%ld [%s] %ld/%ld  loss %.4f  %.0f samples/s  eta %s",
                static_cast<long>(epoch), static_cast<long>(epochs), bar.c_str(),
                static_cast<long>(done), static_cast<long>(total), loss, rate,
                duration_text(eta).c_str());
}


}  // namespace fusetrain::trainer
