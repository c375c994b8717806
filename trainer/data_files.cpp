// safetensors (nlohmann-json reads the header), torch.save dicts (LibTorch's
// pickle_load reads the zip) and token streams.
#include "data_files.h"

#include "config.h"  // UsageError

#include <torch/csrc/jit/serialization/pickle.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

namespace fusetrain::trainer {

namespace {

uint64_t little_endian(const char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

at::ScalarType safetensors_dtype(const std::string& name, const std::string& where) {
  static const std::map<std::string, at::ScalarType> kTypes = {
      {"F64", at::kDouble}, {"F32", at::kFloat},  {"F16", at::kHalf},    {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},    {"I16", at::kShort},   {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool},  {"U16", at::kUInt16},  {"U32", at::kUInt32},
      {"U64", at::kUInt64}};
  const auto it = kTypes.find(name);
  if (it == kTypes.end()) throw UsageError(where + " has dtype \"" + name + "\", which fusetrain cannot read");
  return it->second;
}

std::map<std::string, at::Tensor> read_safetensors(const std::vector<char>& bytes,
                                                   const std::string& path, const std::string& key) {
  const std::string file = key + ": " + path;
  if (bytes.size() < 8) {
    throw UsageError(file + " is truncated: " + std::to_string(bytes.size()) +
                     " bytes, where a safetensors file starts with an 8-byte header length");
  }
  const uint64_t header_len = little_endian(bytes.data(), 8);
  if (header_len > bytes.size() - 8) {
    throw UsageError(file + " is not a safetensors file or is truncated: its first 8 bytes announce "
                     "a header of " + std::to_string(header_len) + " bytes, and " +
                     std::to_string(bytes.size() - 8) + " follow");
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(header_len));
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(file + ": the safetensors header (bytes 8 to " + std::to_string(8 + header_len) +
                     ") is not valid JSON: " + e.what());
  }
  if (!header.is_object()) throw UsageError(file + ": the safetensors header is not a JSON object");
  const uint64_t data_begin = 8 + header_len;
  const uint64_t data_size = bytes.size() - data_begin;
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string where = file + ": tensor \"" + name + "\"";
    try {
      const at::ScalarType dtype = safetensors_dtype(entry.at("dtype").get<std::string>(), where);
      const auto shape = entry.at("shape").get<std::vector<int64_t>>();
      const auto offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_size) {
        throw UsageError(where + ": its data_offsets lie outside the " + std::to_string(data_size) +
                         " data bytes of the file (truncated?)");
      }
      at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
      if (offsets[1] - offsets[0] != t.nbytes()) {
        throw UsageError(where + ": shape " + c10::str(t.sizes()) + " of " + c10::toString(dtype) +
                         " needs " + std::to_string(t.nbytes()) + " bytes, its data_offsets give " +
                         std::to_string(offsets[1] - offsets[0]));
      }
      if (t.nbytes() > 0) std::memcpy(t.data_ptr(), bytes.data() + data_begin + offsets[0], t.nbytes());
      out.emplace(name, std::move(t));
    } catch (const nlohmann::json::exception& e) {
      throw UsageError(where + ": malformed header entry (" + e.what() + ")");
    }
  }
  return out;
}

std::map<std::string, at::Tensor> read_torch_save(const std::vector<char>& bytes,
                                                  const std::string& path, const std::string& key) {
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(bytes);
  } catch (const c10::Error& e) {
    throw UsageError(key + ": " + path + " is a zip file but not one torch.save wrote (or it is "
                     "truncated): " + e.what_without_backtrace());
  }
  if (!value.isGenericDict()) {
    throw UsageError(key + ": " + path + " holds a " + value.tagKind() +
                     ", not a dict of tensors (torch.save({\"inputs\": ..., \"labels\": ...}, path))");
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString() || !item.value().isTensor()) continue;
    out.emplace(item.key().toStringRef(), item.value().toTensor().contiguous());
  }
  return out;
}

}  // namespace

std::vector<char> read_file_bytes(const std::string& path, const std::string& key) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) throw UsageError(key + ": cannot open " + path + " (no such file, or unreadable)");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.empty()) throw UsageError(key + ": " + path + " is empty");
  return bytes;
}

std::map<std::string, at::Tensor> read_tensor_file(const std::string& path, const std::string& key) {
  const std::vector<char> bytes = read_file_bytes(path, key);
  const bool zip = bytes.size() >= 4 && std::memcmp(bytes.data(), "PK\x03\x04", 4) == 0;
  return zip ? read_torch_save(bytes, path, key) : read_safetensors(bytes, path, key);
}

at::Tensor read_token_file(const std::string& path, const std::string& dtype, const std::string& key) {
  const std::vector<char> bytes = read_file_bytes(path, key);
  int width = dtype == "uint32" ? 4 : 2;
  size_t offset = 0;
  constexpr size_t kHeaderBytes = 256 * 4;
  const uint64_t magic = bytes.size() >= kHeaderBytes ? little_endian(bytes.data(), 4) : 0;
  if (magic == 20240520 || magic == 20240801) {
    const uint64_t version = little_endian(bytes.data() + 4, 4);
    const uint64_t count = little_endian(bytes.data() + 8, 4);
    const int header_width = magic == 20240520 ? 2 : 4;
    if ((magic == 20240520 && version != 1) || (magic == 20240801 && version != 7)) {
      throw UsageError(key + ": " + path + " has an llm.c header (magic " + std::to_string(magic) +
                       ") of unknown version " + std::to_string(version));
    }
    if (header_width != width) {
      throw UsageError(key + ": " + path + "'s llm.c header says its ids are uint" +
                       std::to_string(8 * header_width) + "; set data.token_dtype=uint" +
                       std::to_string(8 * header_width) + " (it is " + dtype + ")");
    }
    if (bytes.size() - kHeaderBytes != count * static_cast<uint64_t>(width)) {
      throw UsageError(key + ": " + path + " is truncated or padded: its header announces " +
                       std::to_string(count) + " tokens (" + std::to_string(count * width) +
                       " bytes after byte " + std::to_string(kHeaderBytes) + "), the file holds " +
                       std::to_string(bytes.size() - kHeaderBytes));
    }
    offset = kHeaderBytes;
  } else if (bytes.size() % static_cast<size_t>(width) != 0) {
    throw UsageError(key + ": " + path + " holds " + std::to_string(bytes.size()) +
                     " bytes, not a whole number of " + dtype + " ids (data.token_dtype; the last "
                     "id would start at byte " + std::to_string(bytes.size() / width * width) + ")");
  }
  const int64_t n = static_cast<int64_t>((bytes.size() - offset) / static_cast<size_t>(width));
  if (n == 0) throw UsageError(key + ": " + path + " holds no tokens");
  at::Tensor ids = at::empty({n}, at::kLong);
  int64_t* dst = ids.data_ptr<int64_t>();
  const char* src = bytes.data() + offset;
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<int64_t>(little_endian(src + i * width, width));
  return ids;
}

}  // namespace fusetrain::trainer
