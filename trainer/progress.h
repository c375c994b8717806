// What rank 0 shows while training: durations and a progress bar that
// redraws itself on a terminal (plain lines otherwise). Text is formatted
// with {fmt} (format.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <iostream>
#include <string>

namespace fusetrain::trainer {


/// "12.3s", "4m05s", "2h03m".
std::string duration_text(double seconds);

/// The bar's text: epoch, a 24-character bar, samples/s and the time left.
std::string bar_text(int64_t epoch, int64_t epochs, int64_t done, int64_t total, double loss,
                     double rate, double eta);

/// Rank 0's display: a self-updating bar on a terminal, plain lines otherwise.
class Progress {
 public:
  static constexpr double kRefreshSeconds = 0.1;
  explicit Progress(bool bar) : bar_(bar) {}
  bool is_bar() const { return bar_; }

  void bar(const std::string& text, bool force) {
    if (!bar_) return;
    const auto now = std::chrono::steady_clock::now();
    if (!force && std::chrono::duration<double>(now - last_).count() < kRefreshSeconds) return;
    last_ = now;
    std::cout << "\r\033[K" << text << std::flush;
    shown_ = true;
  }

  /// A permanent line (the bar, if shown, is erased first and redrawn later).
  void line(const std::string& text) {
    if (shown_) std::cout << "\r\033[K";
    shown_ = false;
    std::cout << text << "\n" << std::flush;
  }

 private:
  bool bar_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace fusetrain::trainer
