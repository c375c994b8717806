// The trainer's run configuration: a fixed schema of dotted keys
// ("optimizer.lr", "model.name", ...) with types, defaults and accepted
// values, read from a YAML file and overridden from the command line. Every
// value is checked when it is set, so a typo fails before any work starts,
// naming the key, where it came from and what would have been accepted.
#pragma once

#include <fusetrain/trainer/usage_error.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace fusetrain::trainer {


enum class KeyType { kInt, kFloat, kBool, kString, kIntList };

/// One configuration key of the schema.
struct KeySpec {
  std::string key;      // "section.name"
  KeyType type;
  std::string default_value;
  std::vector<std::string> choices;  // accepted strings (kString); empty: any
  double min = -1e300;               // bounds for numbers and list elements
  double max = 1e300;
  std::string help;
};

/// Every key the trainer knows, in the order the resolved config lists them.
const std::vector<KeySpec>& config_schema();

/// Whether `key` names a file or directory (model.path, data.path,
/// data.val_path, output.run_dir): relative to the config file that sets it,
/// to the working directory when --set or a flag does.
bool is_path_key(const std::string& key);

class Config {
 public:
  /// All keys at their defaults.
  Config();

  /// Reads a YAML file of sections ("model:", "optimizer:", ...) holding keys.
  /// Unknown keys and bad values raise UsageError naming file:line. A
  /// relative path (is_path_key) is relative to the file's directory, as in
  /// most tools' configs: configs/gpt_text.yaml reads ../data/kjv.txt from
  /// any working directory.
  static Config from_file(const std::string& path);
  /// The same from YAML text (e.g. the copy stored in a checkpoint); relative
  /// paths are taken relative to `base_dir` when it is not empty, else kept
  /// as written (relative to the working directory).
  static Config from_yaml(const std::string& text, const std::string& origin,
                          const std::string& base_dir = "");

  /// Sets `key` from its text form; `origin` ("--set", "--epochs", a file
  /// position) goes into the error message. Lists: "16,32" or "[16, 32]".
  void set(const std::string& key, const std::string& value, const std::string& origin);
  /// Parses a `--set` argument "key=value".
  void apply_override(const std::string& assignment);

  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  const std::string& get_string(const std::string& key) const;
  std::vector<int64_t> get_int_list(const std::string& key) const;

  /// Where the key's value came from ("default", "configs/x.yaml:12", "--set").
  const std::string& origin(const std::string& key) const;

  /// A model.* key and its value as the model reads it: the schema's type,
  /// or, for a key the schema lacks (a plugin's own), what YAML would read
  /// (true/false, an integer, a number, a list of integers, else a string).
  struct ModelKey {
    std::string name;  // without "model."
    std::variant<bool, int64_t, double, std::string, std::vector<int64_t>> value;
    std::string origin;
  };
  /// Every model.* key, the schema's first.
  std::vector<ModelKey> model_keys() const;
  /// model.* keys the schema does not know are kept for a plugin (which
  /// reads them through ModelConfig); without model.library they are the
  /// usual unknown-key error, raised here (check_before_start calls it).
  void check_model_keys() const;

  /// The resolved configuration as YAML (every key, schema order).
  std::string to_yaml() const;

  /// The config file's name without directory and extension ("" if none).
  const std::string& name() const { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }

  /// A UsageError for a value that is well-formed but unusable in context
  /// (e.g. a batch size the world size does not divide), naming the key.
  [[nodiscard]] UsageError error(const std::string& key, const std::string& message) const;

 private:
  const KeySpec& spec(const std::string& key) const;

  std::map<std::string, std::string> values_;
  std::map<std::string, std::string> origins_;
  std::map<std::string, std::string> plugin_keys_;  // model.* keys outside the schema
  std::string name_;
};

/// Text listing the schema (key, default, accepted values, help) for --help.
std::string describe_schema();

/// The schema as JSON, for tools and the documentation's config reference:
/// {"keys": [{"key", "section", "type", "default", "choices", "min", "max",
/// "help"}, ...]} in schema order. "type" is one of int, float, bool,
/// string, int_list; "default" is typed (a number, a boolean, a string or a
/// list); "min"/"max" are null where unbounded.
std::string schema_json();

}  // namespace fusetrain::trainer
