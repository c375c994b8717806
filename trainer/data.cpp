// Dataset loading (zlib for the gzip IDX files), synthetic data and the
// per-rank batch sampler.
#include "data.h"

#include <ATen/core/DistributionsHelper.h>
#include <ATen/CPUGeneratorImpl.h>

#include <zlib.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <sys/stat.h>

namespace fusetrain::trainer {

namespace {

constexpr int64_t kSyntheticTrain = 10000;
constexpr int64_t kSyntheticTest = 2000;
constexpr const char* kFashionPackage = "dataset-fashion-mnist";

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}


at::Generator generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

Split take_first(const Split& s, int64_t n) {
  if (n <= 0 || n >= s.size()) return s;
  return Split{s.inputs.narrow(0, 0, n), s.targets.narrow(0, 0, n)};
}

Split fashion_split(const at::Tensor& images, const at::Tensor& labels, const std::string& what,
                    double mean, double std) {
  if (images.dim() != 3 || labels.dim() != 1 || images.size(0) != labels.size(0)) {
    throw UsageError("data.path: " + what + ": the images (shape " + c10::str(images.sizes()) +
                     ") and labels (shape " + c10::str(labels.sizes()) + ") do not match");
  }
  at::Tensor x = images.to(at::kFloat).div_(255.0).sub_(mean).div_(std).unsqueeze(1);
  return Split{x.contiguous(), labels.to(at::kLong)};
}

Dataset fashion_mnist(const Config& config) {
  const std::string dir = config.get_string("data.path");
  check_data_available(config);
  const at::Tensor train_images = read_idx_gz(dir + "/train-images-idx3-ubyte.gz");
  // Statistics of the whole training set, whatever subset is used, so that
  // a subset run normalises as the full run does.
  const at::Tensor scaled = train_images.to(at::kDouble).div_(255.0);
  const double mean = scaled.mean().item<double>();
  const double std = scaled.std().item<double>();
  Dataset d;
  d.train = fashion_split(train_images, read_idx_gz(dir + "/train-labels-idx1-ubyte.gz"),
                          dir + "/train-*", mean, std);
  d.test = fashion_split(read_idx_gz(dir + "/t10k-images-idx3-ubyte.gz"),
                         read_idx_gz(dir + "/t10k-labels-idx1-ubyte.gz"), dir + "/t10k-*", mean, std);
  d.num_classes = 10;
  d.input_shape = {1, 28, 28};
  d.mean = mean;
  d.std = std;
  d.description = "Fashion-MNIST (" + dir + ")";
  return d;
}

Split synthetic_image_split(const at::Tensor& templates, int64_t n, at::Generator gen) {
  const int64_t classes = templates.size(0);
  at::Tensor y = at::randint(classes, {n}, gen, at::TensorOptions().dtype(at::kLong));
  at::Tensor noise = at::randn({n, templates.size(1), templates.size(2), templates.size(3)}, gen,
                               at::TensorOptions().dtype(at::kFloat));
  // Class templates buried in noise: learnable, not trivial.
  return Split{noise.add_(templates.index_select(0, y), 0.3), y};
}

Dataset synthetic_images(const Config& config) {
  const int64_t c = config.get_int("data.channels");
  const int64_t s = config.get_int("data.image_size");
  const int64_t classes = config.get_int("data.num_classes");
  const uint64_t seed = mix_seed(static_cast<uint64_t>(config.get_int("data.seed")));
  at::Generator gen = generator(seed);
  const at::Tensor templates = at::randn({classes, c, s, s}, gen, at::TensorOptions().dtype(at::kFloat));
  const int64_t n_train = config.get_int("data.train_samples") ? config.get_int("data.train_samples") : kSyntheticTrain;
  const int64_t n_test = config.get_int("data.test_samples") ? config.get_int("data.test_samples") : kSyntheticTest;
  Dataset d;
  d.train = synthetic_image_split(templates, n_train, gen);
  d.test = synthetic_image_split(templates, n_test, gen);
  d.num_classes = classes;
  d.input_shape = {c, s, s};
  d.description = "synthetic images " + std::to_string(c) + "x" + std::to_string(s) + "x" +
                  std::to_string(s) + ", " + std::to_string(classes) + " classes";
  return d;
}

Split windows_split(const at::Tensor& sequences) {
  const int64_t t = sequences.size(1) - 1;
  return Split{sequences.narrow(1, 0, t).contiguous(), sequences.narrow(1, 1, t).contiguous()};
}

Split synthetic_token_split(int64_t n, int64_t t, at::Generator gen) {
  // Arithmetic sequences mod 256 with a random start and stride: the next
  // token follows from the previous two, so the loss can fall to zero.
  const auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor start = at::randint(256, {n, 1}, gen, opts);
  at::Tensor stride = at::randint(1, 16, {n, 1}, gen, opts);
  at::Tensor pos = at::arange(t + 1, opts).unsqueeze(0);
  return windows_split(start.add(stride * pos).remainder_(256));
}

Dataset synthetic_tokens(const Config& config) {
  const int64_t t = config.get_int("model.seq_len");
  at::Generator gen = generator(mix_seed(static_cast<uint64_t>(config.get_int("data.seed"))));
  const int64_t n_train = config.get_int("data.train_samples") ? config.get_int("data.train_samples") : kSyntheticTrain;
  const int64_t n_test = config.get_int("data.test_samples") ? config.get_int("data.test_samples") : kSyntheticTest;
  Dataset d;
  d.train = synthetic_token_split(n_train, t, gen);
  d.test = synthetic_token_split(n_test, t, gen);
  d.num_classes = 256;
  d.input_shape = {t};
  d.is_tokens = true;
  d.description = "synthetic token sequences, " + std::to_string(t) + " tokens";
  return d;
}

Dataset text_file(const Config& config) {
  const std::string path = config.get_string("data.path");
  check_data_available(config);
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) throw UsageError("data.path: cannot read the text file " + path);
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string bytes = buf.str();
  const int64_t t = config.get_int("model.seq_len");
  const int64_t windows = bytes.size() > 1 ? static_cast<int64_t>(bytes.size() - 1) / t : 0;
  if (windows < 2) {
    throw UsageError("data.path: " + path + " holds " + std::to_string(bytes.size()) +
                     " bytes, fewer than two windows of model.seq_len=" + std::to_string(t) +
                     " + 1 tokens");
  }
  at::Tensor all = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(all.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  all = all.to(at::kLong);
  // Window i covers bytes [i * t, i * t + t]: inputs and targets shifted by one.
  at::Tensor seqs = all.narrow(0, 0, windows * t + 1).unfold(0, t + 1, t).contiguous();
  const int64_t n_test = std::max<int64_t>(1, windows / 10);
  Dataset d;
  d.train = windows_split(seqs.narrow(0, 0, windows - n_test));
  d.test = windows_split(seqs.narrow(0, windows - n_test, n_test));
  d.num_classes = 256;
  d.input_shape = {t};
  d.is_tokens = true;
  d.description = "bytes of " + path + " (" + std::to_string(bytes.size()) + " bytes)";
  return d;
}

uint32_t big_endian(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

}  // namespace

uint64_t mix_seed(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

void check_data_available(const Config& config) {
  const std::string& name = config.get_string("data.name");
  const std::string& path = config.get_string("data.path");
  if (name == "fashion_mnist") {
    for (const char* f : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                          "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}) {
      const std::string file = path + "/" + f;
      if (!file_exists(file)) {
        throw UsageError("data.path: " + file + " does not exist. Fashion-MNIST comes from the "
                         "Debian package " + kFashionPackage + " (apt-get install " +
                         kFashionPackage + "), or set data.path to a directory holding the four "
                         "*-ubyte.gz files");
      }
    }
  } else if (name == "text" && !file_exists(path)) {
    throw UsageError("data.path: the text file " + path + " does not exist (data.name=text "
                     "trains on the bytes of a text file)");
  }
}

at::Tensor read_idx_gz(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) throw UsageError("data.path: cannot open " + path);
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> chunk(1 << 20);
  int n = 0;
  while ((n = gzread(f, chunk.data(), static_cast<unsigned>(chunk.size()))) > 0) {
    bytes.insert(bytes.end(), chunk.begin(), chunk.begin() + n);
  }
  int errnum = 0;
  const char* msg = gzerror(f, &errnum);
  const std::string zerr = msg ? msg : "";
  gzclose(f);
  if (n < 0 || (errnum != Z_OK && errnum != Z_STREAM_END)) {
    throw UsageError("data.path: " + path + " is not a readable gzip file: " + zerr);
  }
  // IDX: 0x00 0x00, type 0x08 (unsigned byte), number of dimensions, then
  // each dimension as a big-endian uint32, then the data.
  if (bytes.size() < 4 || bytes[0] != 0 || bytes[1] != 0 || bytes[2] != 0x08 || bytes[3] == 0) {
    throw UsageError("data.path: " + path + " is not an IDX file of unsigned bytes");
  }
  const size_t ndim = bytes[3];
  if (bytes.size() < 4 + 4 * ndim) throw UsageError("data.path: " + path + " is truncated");
  std::vector<int64_t> shape;
  size_t numel = 1;
  for (size_t i = 0; i < ndim; ++i) {
    shape.push_back(big_endian(bytes.data() + 4 + 4 * i));
    numel *= static_cast<size_t>(shape.back());
  }
  const size_t offset = 4 + 4 * ndim;
  if (bytes.size() != offset + numel) {
    throw UsageError("data.path: " + path + " holds " + std::to_string(bytes.size() - offset) +
                     " data bytes but its header announces " + std::to_string(numel));
  }
  at::Tensor out = at::empty(shape, at::kByte);
  std::memcpy(out.data_ptr<uint8_t>(), bytes.data() + offset, numel);
  return out;
}

Dataset load_dataset(const Config& config, const at::Device& device) {
  const std::string& name = config.get_string("data.name");
  Dataset d;
  if (name == "fashion_mnist") {
    d = fashion_mnist(config);
  } else if (name == "synthetic_images") {
    d = synthetic_images(config);
  } else if (name == "synthetic_tokens") {
    d = synthetic_tokens(config);
  } else {
    d = text_file(config);
  }
  d.train = take_first(d.train, config.get_int("data.train_samples"));
  d.test = take_first(d.test, config.get_int("data.test_samples"));
  d.train = Split{d.train.inputs.to(device).contiguous(), d.train.targets.to(device).contiguous()};
  d.test = Split{d.test.inputs.to(device).contiguous(), d.test.targets.to(device).contiguous()};
  return d;
}

BatchSampler::BatchSampler(int64_t num_samples, int64_t global_batch, int world_size, int rank,
                           int64_t grad_accum, uint64_t seed, at::Device device)
    : num_samples_(num_samples),
      global_batch_(global_batch),
      world_size_(world_size),
      rank_(rank),
      grad_accum_(grad_accum),
      seed_(seed),
      steps_per_epoch_(num_samples / global_batch),
      device_(device) {}

at::Tensor BatchSampler::indices(int64_t epoch, int64_t step_in_epoch, int64_t micro) {
  if (epoch != cached_epoch_) {
    at::Generator gen = generator(mix_seed(seed_ ^ mix_seed(static_cast<uint64_t>(epoch))));
    permutation_ = at::randperm(num_samples_, gen, at::TensorOptions().dtype(at::kLong)).to(device_);
    cached_epoch_ = epoch;
  }
  const int64_t per_rank = global_batch_ / world_size_;
  const int64_t micro_size = per_rank / grad_accum_;
  const int64_t begin = step_in_epoch * global_batch_ + rank_ * per_rank + micro * micro_size;
  return permutation_.narrow(0, begin, micro_size);
}

std::pair<int64_t, int64_t> eval_shard(int64_t n, int world_size, int rank) {
  return {n * rank / world_size, n * (rank + 1) / world_size};
}

}  // namespace fusetrain::trainer
