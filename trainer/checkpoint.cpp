// Checkpoint writing (torch.save's zip layout through the TorchScript
// pickler, atomic rename) and reading (torch::pickle_load, then a CRC-32
// check of every entry).
#include "checkpoint.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/serialize.h>

#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <iterator>
#include <unistd.h>

namespace fusetrain::trainer {

namespace {

constexpr const char* kChecksumKey = "meta.checksum";

uint32_t crc_bytes(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const Bytef*>(data);
  // zlib's crc32 takes a 32-bit length: feed large tensors in slices.
  while (n > 0) {
    const auto len = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    crc = static_cast<uint32_t>(crc32(crc, p, len));
    p += len;
    n -= len;
  }
  return crc;
}

// Covers names, dtypes, shapes and bytes, in order.
uint32_t checksum(const TensorDict& entries) {
  uint32_t crc = static_cast<uint32_t>(crc32(0L, Z_NULL, 0));
  for (const auto& [key, t] : entries) {
    if (key == kChecksumKey) continue;
    crc = crc_bytes(crc, key.data(), key.size());
    const auto dtype = static_cast<int32_t>(t.scalar_type());
    crc = crc_bytes(crc, &dtype, sizeof(dtype));
    for (int64_t s : t.sizes()) crc = crc_bytes(crc, &s, sizeof(s));
    const at::Tensor c = t.contiguous();
    crc = crc_bytes(crc, c.const_data_ptr(), c.nbytes());
  }
  return crc;
}

void fsync_path(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

// Fault injection for the tests of a crash mid-write:
// FUSETRAIN_FAULT_KILL_IN_CHECKPOINT=N makes this process SIGKILL itself
// while writing its N-th checkpoint, the temporary file half written.
void kill_here_if_asked(FILE* f) {
  static int writes = 0;
  static const int kill_at = [] {
    const char* v = std::getenv("FUSETRAIN_FAULT_KILL_IN_CHECKPOINT");
    return v ? std::atoi(v) : 0;
  }();
  if (kill_at > 0 && ++writes == kill_at) {
    std::fflush(f);
    ::raise(SIGKILL);
  }
}

}  // namespace

at::Tensor text_tensor(const std::string& text) {
  at::Tensor t = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  if (!text.empty()) std::memcpy(t.data_ptr<uint8_t>(), text.data(), text.size());
  return t;
}

std::string tensor_text(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kByte).contiguous().cpu();
  return std::string(reinterpret_cast<const char*>(c.const_data_ptr<uint8_t>()),
                     static_cast<size_t>(c.numel()));
}

namespace {

void write_dict(const std::string& path, const TensorDict& entries, bool with_checksum) {
  TensorDict cpu;
  cpu.reserve(entries.size() + 1);
  for (const auto& [key, t] : entries) {
    // Own, dense CPU copies: the pickler writes whole storages, and a view
    // would drag its base tensor into the file.
    cpu.emplace_back(key, t.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true)
                              .contiguous());
  }
  if (with_checksum) {
    const uint32_t crc = checksum(cpu);
    cpu.emplace_back(kChecksumKey, at::scalar_tensor(static_cast<int64_t>(crc), at::kLong));
  }

  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [key, t] : cpu) dict.insert(key, t);

  // torch::pickle_save's format with aggregates untagged: the type tags
  // would make torch.load's default weights_only=True unpickler refuse it.
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&](const char* buf, size_t n) { pickled.insert(pickled.end(), buf, buf + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(dict));
  pickler.stop();

  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    throw std::runtime_error("cannot write checkpoint " + tmp + ": " + std::strerror(errno));
  }
  bool ok = true;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* buf, size_t n) -> size_t {
      if (n > 0 && std::fwrite(buf, 1, n, f) != n) ok = false;
      return n;
    });
    torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(),
                                       pickler.tensorData(), writer);
    kill_here_if_asked(f);
    writer.writeEndOfFile();
  }
  ok = ok && std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    throw std::runtime_error("writing checkpoint " + tmp + " failed (disk full?)");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot rename " + tmp + " to " + path + ": " + why);
  }
  // The rename itself is durable only once the directory is.
  fsync_path(parent_dir(path), O_RDONLY | O_DIRECTORY);
}

}  // namespace

void write_checkpoint(const std::string& path, const TensorDict& entries) {
  write_dict(path, entries, /*with_checksum=*/true);
}

void write_tensor_dict(const std::string& path, const TensorDict& entries) {
  write_dict(path, entries, /*with_checksum=*/false);
}

TensorDict read_checkpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) throw CheckpointError("cannot open checkpoint " + path);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  if (bytes.empty()) throw CheckpointError("checkpoint " + path + " is empty");
  c10::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    std::string why = e.what();
    why = why.substr(0, why.find('\n'));
    throw CheckpointError("checkpoint " + path + " is corrupt or truncated (" + why + ")");
  }
  if (!value.isGenericDict()) {
    throw CheckpointError("checkpoint " + path + " does not hold a dict of tensors");
  }
  TensorDict out;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString() || !item.value().isTensor()) {
      throw CheckpointError("checkpoint " + path + " holds a non-tensor entry; it was not "
                            "written by fusetrain train");
    }
    out.emplace_back(item.key().toStringRef(), item.value().toTensor());
  }
  if (!has_entry(out, kChecksumKey)) {
    throw CheckpointError("checkpoint " + path + " has no " + kChecksumKey +
                          " entry; it was not written by fusetrain train");
  }
  const int64_t stored = checkpoint_entry(out, kChecksumKey, path).item<int64_t>();
  if (stored != static_cast<int64_t>(checksum(out))) {
    throw CheckpointError("checkpoint " + path + " is corrupt: its contents do not match its "
                          "checksum");
  }
  return out;
}

bool has_entry(const TensorDict& dict, const std::string& key) {
  for (const auto& item : dict) {
    if (item.first == key) return true;
  }
  return false;
}

const at::Tensor& checkpoint_entry(const TensorDict& dict, const std::string& key,
                                   const std::string& path) {
  for (const auto& item : dict) {
    if (item.first == key) return item.second;
  }
  throw CheckpointError("checkpoint " + path + " has no entry \"" + key + "\"");
}

}  // namespace fusetrain::trainer
