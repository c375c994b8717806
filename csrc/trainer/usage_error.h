// The trainer's usage error, shared by the CLI and model plugins.
#pragma once

#include <stdexcept>

namespace fusetrain::trainer {

/// A usage, configuration or input error: the CLI reports it and exits with
/// code 2, before any training work. Plugins throw it (or ModelConfig::error)
/// for a configuration they cannot build.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace fusetrain::trainer
