// Durations and the progress bar's text.
#include "progress.h"

#include "format.h"

namespace fusetrain::trainer {

std::string duration_text(double s) {
  if (s < 60) return fmt::format("{:.1f}s", s);
  const auto total = static_cast<int64_t>(s);
  if (total < 3600) return fmt::format("{}m{:02d}s", total / 60, total % 60);
  return fmt::format("{}h{:02d}m", total / 3600, total % 3600 / 60);
}

std::string bar_text(int64_t epoch, int64_t epochs, int64_t done, int64_t total, double loss,
                     double rate, double eta) {
  constexpr int kWidth = 24;
  const int filled = total ? static_cast<int>(kWidth * done / total) : kWidth;
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kWidth, '.');
  return fmt::format("epoch {}/{} [{}] {}/{}  loss {:.4f}  {:.0f} samples/s  eta {}", epoch, epochs,
                     bar, done, total, loss, rate, duration_text(eta));
}

}  // namespace fusetrain::trainer
