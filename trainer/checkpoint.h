// Checkpoint files: an ordered dict of named tensors in torch.save's zip
// format (Python's torch.load reads it as a dict, weights_only=True
// included), written atomically and guarded by a CRC-32 over every entry so
// that a corrupt or truncated file is an error, never a silent bad resume.
#pragma once

#include <ATen/ATen.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fusetrain::trainer {

/// An unreadable, truncated, corrupt or mismatching checkpoint.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Named tensors in a fixed order.
using TensorDict = std::vector<std::pair<std::string, at::Tensor>>;

/// Writes `entries` (copied to the CPU) plus a "meta.checksum" entry to
/// `path`: first to a temporary file in the same directory, flushed to disk,
/// then renamed over `path`, so a crash leaves either the old file or the
/// new one, never a torn one. I/O failures raise std::runtime_error.
void write_checkpoint(const std::string& path, const TensorDict& entries);

/// The same without the checksum entry: a plain dict of tensors that
/// torch.load reads and Module.load_state_dict accepts (exports).
void write_tensor_dict(const std::string& path, const TensorDict& entries);

/// Reads a file written by write_checkpoint and verifies its checksum.
/// Throws CheckpointError naming the path and the problem.
TensorDict read_checkpoint(const std::string& path);

/// The entry called `key`; CheckpointError naming `path` when absent.
const at::Tensor& checkpoint_entry(const TensorDict& dict, const std::string& key,
                                   const std::string& path);
bool has_entry(const TensorDict& dict, const std::string& key);

/// A number stored as a 0-d int64 or float64 tensor (a checkpoint entry).
inline at::Tensor scalar_entry(int64_t v) { return at::scalar_tensor(v, at::kLong); }
inline at::Tensor scalar_entry(double v) { return at::scalar_tensor(v, at::kDouble); }

/// Text stored as a uint8 tensor (so the file stays a dict of tensors), and back.
at::Tensor text_tensor(const std::string& text);
std::string tensor_text(const at::Tensor& t);

}  // namespace fusetrain::trainer
