// metrics.jsonl on disk.
#include "metrics.h"

#include "run_dir.h"

#include <sstream>

namespace fusetrain::trainer {

void MetricsLog::open(const std::string& path, int64_t keep_through_step) {
  std::string kept;
  if (keep_through_step > 0 && is_file(path)) {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      // A line cut short by a crash is not valid JSON: dropped with the rest.
      const Record r = Record::parse(line, nullptr, /*allow_exceptions=*/false);
      if (r.is_object() && r.contains("step") && r["step"].is_number_integer() &&
          r["step"].get<int64_t>() <= keep_through_step) {
        kept += line + "\n";
      }
    }
  }
  write_text_atomically(path, kept);
  out_.open(path, std::ios::app);
  if (!out_.is_open()) throw std::runtime_error("cannot append to " + path);
}

void MetricsLog::write(const Record& record) {
  out_ << record.dump() << "\n";
  out_.flush();
}

}  // namespace fusetrain::trainer
