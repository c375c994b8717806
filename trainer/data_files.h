// Readers for the data files users bring: named tensors (safetensors, or a
// dict saved with torch.save) and token streams (flat uint16/uint32 ids, as
// nanoGPT and llm.c write them). Every error is a UsageError naming the
// config key, the file and what is wrong where (the byte offset, the
// tensor's name), raised before any training work.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

namespace fusetrain::trainer {

/// The bytes of `path`; a UsageError naming `key` when it cannot be read or
/// is empty.
std::vector<char> read_file_bytes(const std::string& path, const std::string& key);

/// The tensors of `path`, by name, on the CPU: a .safetensors file (8-byte
/// little-endian header length, a JSON header, then the raw bytes), or a
/// torch.save'd dict of tensors (its zip format). `key` names the config key
/// in errors ("data.path", "data.val_path").
std::map<std::string, at::Tensor> read_tensor_file(const std::string& path, const std::string& key);

/// The token ids of `path` as int64, from a flat file of `dtype` ("uint16"
/// or "uint32") little-endian ids. An llm.c header (256 int32: magic
/// 20240520 with version 1 for uint16 ids, or magic 20240801 with version 7
/// for uint32, then the token count) is read and checked where present; its
/// id width must agree with `dtype`.
at::Tensor read_token_file(const std::string& path, const std::string& dtype, const std::string& key);

}  // namespace fusetrain::trainer
