// Dataset loading (zlib for the gzip IDX files), synthetic data and the
// per-rank batch sampler.
#include "data.h"

#include "run_dir.h"

#include "data_files.h"

#include <ATen/core/DistributionsHelper.h>
#include <ATen/CPUGeneratorImpl.h>

#include <zlib.h>

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

namespace fusetrain::trainer {

namespace {

constexpr int64_t kSyntheticTrain = 10000;
constexpr int64_t kSyntheticTest = 2000;
constexpr const char* kFashionPackage = "dataset-fashion-mnist";



at::Generator generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

Split take_first(const Split& s, int64_t n) {
  if (n <= 0 || n >= s.size()) return s;
  return Split{s.inputs.narrow(0, 0, n), s.targets.narrow(0, 0, n),
               s.rows.defined() ? s.rows.narrow(0, 0, n) : at::Tensor()};
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
  d.num_classes_origin = "Fashion-MNIST's 10 classes";
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
  const int64_t classes = config.get_int("data.num_classes") ? config.get_int("data.num_classes") : 10;
  const uint64_t seed = mix_seed(static_cast<uint64_t>(config.get_int("data.seed")));
  at::Generator gen = generator(seed);
  const at::Tensor templates = at::randn({classes, c, s, s}, gen, at::TensorOptions().dtype(at::kFloat));
  const int64_t n_train = config.get_int("data.train_samples") ? config.get_int("data.train_samples") : kSyntheticTrain;
  const int64_t n_test = config.get_int("data.test_samples") ? config.get_int("data.test_samples") : kSyntheticTest;
  Dataset d;
  d.train = synthetic_image_split(templates, n_train, gen);
  d.test = synthetic_image_split(templates, n_test, gen);
  d.num_classes = classes;
  d.num_classes_origin = config.get_int("data.num_classes")
                             ? "data.num_classes=" + std::to_string(classes)
                             : "the synthetic images' default of 10 (data.num_classes sets it)";
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
  d.num_classes_origin = "the synthetic tokens' 256 byte values";
  d.input_shape = {t};
  d.is_tokens = true;
  d.description = "synthetic token sequences, " + std::to_string(t) + " tokens";
  return d;
}

// ---------------------------------------------------------------- tensors

at::Tensor named(const std::map<std::string, at::Tensor>& tensors, const std::string& name,
                 const std::string& file) {
  const auto it = tensors.find(name);
  if (it != tensors.end()) return it->second;
  std::string have;
  for (const auto& [k, v] : tensors) have += (have.empty() ? "" : ", ") + k;
  throw UsageError(file + " has no tensor \"" + name + "\" (it holds: " +
                   (have.empty() ? "none" : have) + "); data.name=tensors reads \"inputs\" [N, ...] "
                   "and \"labels\" [N]");
}

// One file's inputs and labels, checked and normalised.
Split classification_split(const std::string& path, const std::string& key, const Config& config) {
  const auto tensors = read_tensor_file(path, key);
  const std::string file = key + ": " + path;
  at::Tensor x = named(tensors, "inputs", file);
  at::Tensor y = named(tensors, "labels", file);
  if (x.dim() < 2) {
    throw UsageError(file + ": \"inputs\" has shape " + c10::str(x.sizes()) +
                     "; it must be [N, ...] with at least one feature dimension");
  }
  if (y.dim() != 1 || y.size(0) != x.size(0)) {
    throw UsageError(file + ": \"labels\" has shape " + c10::str(y.sizes()) + "; it must be [" +
                     std::to_string(x.size(0)) + "], one label per input");
  }
  if (x.size(0) == 0) throw UsageError(file + " holds no samples");
  if (!at::isIntegralType(y.scalar_type(), /*includeBool=*/false)) {
    throw UsageError(file + ": \"labels\" are " + c10::toString(y.scalar_type()) +
                     "; class labels must be integers");
  }
  if (x.scalar_type() == at::kByte) {
    x = x.to(at::kFloat).div_(255.0);
  } else if (at::isFloatingType(x.scalar_type())) {
    x = x.to(at::kFloat);
  } else {
    throw UsageError(file + ": \"inputs\" are " + c10::toString(x.scalar_type()) +
                     "; they must be uint8 (scaled to [0, 1]) or floating point");
  }
  x = x.sub_(config.get_float("data.mean")).div_(config.get_float("data.std"));
  // [N, H, W] images are one channel for the built-in convolutional models;
  // a TorchScript module gets the inputs as stored.
  const std::string& model = config.get_string("model.name");
  if (x.dim() == 3 && (model == "cnn" || model == "resnet")) x = x.unsqueeze(1);
  y = y.to(at::kLong);
  const at::Tensor negative = (y < 0).nonzero();
  if (negative.numel() > 0) {
    const int64_t i = negative[0][0].item<int64_t>();
    throw UsageError(file + ": label " + std::to_string(y[i].item<int64_t>()) + " at index " +
                     std::to_string(i) + " is negative");
  }
  const int64_t classes = config.get_int("data.num_classes");
  if (classes > 0) {
    const at::Tensor over = (y >= classes).nonzero();
    if (over.numel() > 0) {
      const int64_t i = over[0][0].item<int64_t>();
      throw UsageError(file + ": label " + std::to_string(y[i].item<int64_t>()) + " at index " +
                       std::to_string(i) + " is out of range for data.num_classes=" +
                       std::to_string(classes) + " (labels are 0 .. num_classes - 1)");
    }
  }
  return Split{x.contiguous(), y};
}

struct LargestLabel {
  int64_t value;
  int64_t index;
  std::string file;
};

LargestLabel largest_label(const at::Tensor& labels, std::string file) {
  const int64_t at = labels.argmax().item<int64_t>();  // the first of the largest
  return {labels[at].item<int64_t>(), at, std::move(file)};
}

Split rows(const Split& s, const at::Tensor& index) {
  return Split{s.inputs.index_select(0, index), s.targets.index_select(0, index),
               s.rows.defined() ? s.rows.index_select(0, index) : index};
}

Dataset tensors_dataset(const Config& config) {
  const std::string& path = config.get_string("data.path");
  const std::string& val_path = config.get_string("data.val_path");
  Split train = classification_split(path, "data.path", config);
  Split val;
  std::string val_file;  // how the errors name the validation labels' file
  if (!val_path.empty()) {
    val = classification_split(val_path, "data.val_path", config);
    val_file = "data.val_path " + val_path;
    if (val.inputs.sizes().slice(1) != train.inputs.sizes().slice(1)) {
      throw UsageError("data.val_path: " + val_path + ": inputs of shape " +
                       c10::str(val.inputs.sizes()) + " do not match the training inputs " +
                       c10::str(train.inputs.sizes()) + " of " + path);
    }
  } else {
    // A seeded random subset, so that a file sorted by class still
    // validates on every class.
    const int64_t n = train.size();
    const int64_t n_val = std::llround(static_cast<double>(n) * config.get_float("data.val_fraction"));
    if (n_val < 1 || n_val >= n) {
      throw UsageError("data.val_fraction=" + std::to_string(config.get_float("data.val_fraction")) +
                       " of the " + std::to_string(n) + " samples of " + path +
                       " leaves no validation or no training sample; set data.val_path");
    }
    at::Generator gen = generator(mix_seed(static_cast<uint64_t>(config.get_int("data.seed")) ^ 0x7661ULL));
    const at::Tensor perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
    val = rows(train, std::get<0>(perm.narrow(0, 0, n_val).sort()));
    train = rows(train, std::get<0>(perm.narrow(0, n_val, n - n_val).sort()));
    val_file = "data.path " + path + " (held out by data.val_fraction)";
  }
  // A sample's row in its file, for the messages.
  auto row_of = [](const Split& split, int64_t i) {
    return split.rows.defined() ? split.rows[i].item<int64_t>() : i;
  };
  int64_t classes = config.get_int("data.num_classes");
  std::string origin = "data.num_classes=" + std::to_string(classes) + " (" +
                       config.origin("data.num_classes") + ")";
  if (classes == 0) {
    // The training labels alone set the class count: a validation label
    // beyond them is a class the model never trains on (or a typo), so it is
    // an error, not a silently larger head.
    const LargestLabel largest = largest_label(train.targets, "data.path " + path);
    classes = 1 + largest.value;
    origin = "inferred from the training labels (data.num_classes=0): "
             "the largest is " + std::to_string(largest.value) + ", at index " +
             std::to_string(row_of(train, largest.index)) + " of " + largest.file;
    const at::Tensor beyond = (val.targets >= classes).nonzero();
    if (beyond.numel() > 0) {
      const int64_t i = beyond[0][0].item<int64_t>();
      throw UsageError(val_file + ": label " + std::to_string(val.targets[i].item<int64_t>()) +
                       " at index " + std::to_string(row_of(val, i)) +
                       " is not among the training labels' classes 0 .. " + std::to_string(classes - 1) +
                       " (data.num_classes=0 infers them from the training labels of data.path " + path +
                       "); fix the label, or set data.num_classes=" +
                       std::to_string(1 + val.targets.max().item<int64_t>()) +
                       " if the training set lacks that class");
    }
  }
  if (classes < 2) {
    throw UsageError("data.path: " + path + ": every label is 0; a classifier needs at least two "
                     "classes (or set data.num_classes)");
  }
  std::vector<std::string> warnings;
  const at::Tensor absent = (at::bincount(train.targets, {}, classes) == 0).nonzero().flatten();
  if (absent.numel() > 0) {
    std::string list;
    for (int64_t i = 0; i < std::min<int64_t>(absent.numel(), 10); ++i) {
      list += (i ? ", " : "") + std::to_string(absent[i].item<int64_t>());
    }
    if (absent.numel() > 10) list += ", ... (" + std::to_string(absent.numel()) + " in all)";
    const int64_t in_val = at::isin(val.targets, absent).sum().item<int64_t>();
    warnings.push_back("data.path " + path + ": class" + (absent.numel() == 1 ? " " : "es ") + list +
                       " of 0 .. " + std::to_string(classes - 1) + " ha" +
                       (absent.numel() == 1 ? "s" : "ve") + " no training sample: the model keeps an "
                       "output it never learns" +
                       (in_val > 0 ? "; " + std::to_string(in_val) + " validation sample" +
                                         (in_val == 1 ? " is" : "s are") + " of " +
                                         (absent.numel() == 1 ? "it" : "them")
                                   : std::string()));
  }
  Dataset d;
  d.train = std::move(train);
  d.test = std::move(val);
  d.num_classes = classes;
  d.num_classes_origin = std::move(origin);
  d.warnings = std::move(warnings);
  d.input_shape = d.train.inputs.sizes().slice(1).vec();
  d.mean = config.get_float("data.mean");
  d.std = config.get_float("data.std");
  d.description = "tensors of " + path + " (" + std::to_string(d.train.size()) + " train / " +
                  std::to_string(d.test.size()) + " validation, inputs " +
                  c10::str(d.train.inputs.sizes().slice(1)) + ", " + std::to_string(classes) +
                  " classes)";
  return d;
}

// ---------------------------------------------------------------- token streams

at::Tensor text_bytes(const std::string& path, const std::string& key) {
  const std::vector<char> bytes = read_file_bytes(path, key);
  at::Tensor all = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(all.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  return all.to(at::kLong);
}

// Inputs and next-token targets of every window of `t` tokens of `stream`,
// window i starting at token i: views, no copy.
Split all_windows(const at::Tensor& stream, int64_t t) {
  const int64_t n = stream.size(0) - 1;
  return Split{stream.narrow(0, 0, n).unfold(0, t, 1), stream.narrow(0, 1, n).unfold(0, t, 1)};
}

void check_ids(const at::Tensor& ids, int64_t vocab, const std::string& what) {
  const at::Tensor bad = ((ids < 0) | (ids >= vocab)).nonzero();
  if (bad.numel() == 0) return;
  const int64_t i = bad[0][0].item<int64_t>();
  throw UsageError(what + ": token id " + std::to_string(ids[i].item<int64_t>()) + " at position " +
                   std::to_string(i) + " is not below model.vocab_size=" + std::to_string(vocab));
}

Dataset stream_dataset(const Config& config) {
  const bool text = config.get_string("data.name") == "text";
  const std::string& path = config.get_string("data.path");
  const std::string& val_path = config.get_string("data.val_path");
  const std::string& dtype = config.get_string("data.token_dtype");
  const auto read = [&](const std::string& p, const std::string& key) {
    return text ? text_bytes(p, key) : read_token_file(p, dtype, key);
  };
  const int64_t seq_len = config.get_int("model.seq_len");
  const int64_t t = config.get_int("data.context") > 0 ? config.get_int("data.context") : seq_len;
  if (t > seq_len) {
    throw config.error("data.context", "is longer than the model's context model.seq_len=" +
                                           std::to_string(seq_len));
  }
  at::Tensor train = read(path, "data.path");
  at::Tensor val;
  if (!val_path.empty()) {
    val = read(val_path, "data.val_path");
  } else {
    // The end of the stream: the windows a model has not seen.
    const int64_t n = train.size(0);
    const int64_t n_val = std::llround(static_cast<double>(n) * config.get_float("data.val_fraction"));
    val = train.narrow(0, n - std::min(n, n_val), std::min(n, n_val));
    train = train.narrow(0, 0, n - val.size(0));
  }
  const std::string unit = text ? " bytes" : " tokens";
  if (train.size(0) < t + 1 + 1) {
    throw UsageError("data.path: " + path + " leaves " + std::to_string(train.size(0)) + unit +
                     " for training, fewer than two windows of data.context=" + std::to_string(t) +
                     " + 1");
  }
  if (val.size(0) < t + 1) {
    throw UsageError((val_path.empty() ? "data.val_fraction: the held-out end of " + path
                                       : "data.val_path: " + val_path) +
                     " holds " + std::to_string(val.size(0)) + unit + ", fewer than one window of " +
                     std::to_string(t) + " + 1");
  }
  int64_t vocab = config.get_int("model.vocab_size");
  if (text) {
    if (vocab != 0 && vocab < 256) {
      throw config.error("model.vocab_size", "text is bytes: the vocabulary is 256");
    }
    vocab = std::max<int64_t>(vocab, 256);
  } else if (vocab > 0) {
    check_ids(train, vocab, "data.path: " + path);
    check_ids(val, vocab, val_path.empty() ? "data.path: " + path : "data.val_path: " + val_path);
  } else {
    vocab = 1 + std::max(train.max().item<int64_t>(), val.max().item<int64_t>());
  }
  // Validation: non-overlapping windows, each scored once.
  const int64_t val_windows = (val.size(0) - 1) / t;
  Dataset d;
  d.train_stream = train;
  d.train = all_windows(train, t);
  d.test = windows_split(val.narrow(0, 0, val_windows * t + 1).unfold(0, t + 1, t).contiguous());
  d.random_windows = true;
  d.samples_per_epoch = (train.size(0) - 1) / t;
  d.num_classes = vocab;
  d.num_classes_origin = text ? "text's byte vocabulary (" + std::to_string(vocab) + ")"
                         : config.get_int("model.vocab_size")
                             ? "model.vocab_size=" + std::to_string(vocab)
                             : "model.vocab_size=0, so the largest token id of the data + 1";
  d.input_shape = {t};
  d.is_tokens = true;
  d.byte_vocab = text;
  d.description = (text ? "bytes of " : "tokens of ") + path + " (" +
                  std::to_string(train.size(0)) + " train / " + std::to_string(val.size(0)) +
                  " validation" + unit + ", windows of " + std::to_string(t) + ")";
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

Augmentation augmentation_from(const Config& config, const Dataset& data) {
  Augmentation aug;
  aug.crop_padding = config.get_int("data.random_crop_padding");
  aug.hflip = config.get_bool("data.random_hflip");
  if (!aug.enabled()) return aug;
  const char* key = aug.crop_padding > 0 ? "data.random_crop_padding" : "data.random_hflip";
  TORCH_CHECK(!data.is_tokens && data.input_shape.size() == 3, key,
              " augments images [N, C, H, W]; this dataset's inputs are ",
              data.is_tokens ? "token windows" : "not images", " (shape [N, ",
              c10::Join(", ", data.input_shape), "]): set it to its default");
  aug.seed = mix_seed(static_cast<uint64_t>(config.get_int("data.seed")) ^ 0x6175676dULL);
  // A zero pixel normalised as the loaders normalise (float32 ops), so the
  // padding equals a padded raw image's zeros bit for bit.
  aug.pad_value = at::zeros({1}, at::kFloat).sub_(data.mean).div_(data.std).item<float>();
  return aug;
}

void augment_images_(at::Tensor& images, const at::Tensor& index, int64_t epoch,
                     const Augmentation& aug) {
  if (!aug.enabled()) return;
  TORCH_CHECK(images.dim() == 4 && images.scalar_type() == at::kFloat && images.is_cpu() &&
                  images.is_contiguous(),
              "augment_images_: expected a contiguous float32 CPU batch [B, C, H, W], got ",
              images.scalar_type(), " ", images.sizes(), " on ", images.device());
  const int64_t b = images.size(0), c = images.size(1), h = images.size(2), w = images.size(3);
  const at::Tensor idx = index.to(at::kLong).contiguous();
  TORCH_CHECK(idx.numel() == b, "augment_images_: ", idx.numel(), " sample indices for ", b,
              " images");
  const int64_t* sample = idx.const_data_ptr<int64_t>();
  const int64_t p = aug.crop_padding;
  float* data = images.data_ptr<float>();
  std::vector<float> src(static_cast<size_t>(c * h * w));
  for (int64_t i = 0; i < b; ++i) {
    const uint64_t r = mix_seed(aug.seed ^ mix_seed(static_cast<uint64_t>(epoch) * 0x100000001b3ULL ^
                                                    static_cast<uint64_t>(sample[i])));
    // Offsets uniform in [-p, p] (the modulo bias of a 64-bit draw is < 2^-50).
    const int64_t dy = p > 0 ? static_cast<int64_t>(r % static_cast<uint64_t>(2 * p + 1)) - p : 0;
    const int64_t dx =
        p > 0 ? static_cast<int64_t>((r >> 20) % static_cast<uint64_t>(2 * p + 1)) - p : 0;
    const bool flip = aug.hflip && ((r >> 63) & 1);
    if (dy == 0 && dx == 0 && !flip) continue;
    float* img = data + i * c * h * w;
    std::copy(img, img + c * h * w, src.begin());
    for (int64_t ch = 0; ch < c; ++ch) {
      const float* in = src.data() + ch * h * w;
      float* out = img + ch * h * w;
      for (int64_t y = 0; y < h; ++y) {
        const int64_t sy = y + dy;
        for (int64_t x = 0; x < w; ++x) {
          // Output (y, x) shows the padded image's (y + p + dy, x + p + dx),
          // mirrored first when flipped.
          const int64_t sx = (flip ? w - 1 - x : x) + dx;
          out[y * w + x] = sy >= 0 && sy < h && sx >= 0 && sx < w ? in[sy * w + sx] : aug.pad_value;
        }
      }
    }
  }
}

void check_data_available(const Config& config) {
  const std::string& name = config.get_string("data.name");
  const std::string& path = config.get_string("data.path");
  if (name == "fashion_mnist") {
    for (const char* f : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                          "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}) {
      const std::string file = path + "/" + f;
      if (!is_file(file)) {
        throw UsageError("data.path: " + file + " does not exist. Fashion-MNIST comes from the "
                         "Debian package " + kFashionPackage + " (apt-get install " +
                         kFashionPackage + "), or set data.path to a directory holding the four "
                         "*-ubyte.gz files");
      }
    }
  } else if (name == "text" || name == "tokens" || name == "tensors") {
    const char* what = name == "text"     ? "the text file"
                       : name == "tokens" ? "the token file"
                                          : "the tensors file";
    if (!is_file(path)) {
      throw UsageError("data.path: " + std::string(what) + " " + path + " does not exist");
    }
    const std::string& val = config.get_string("data.val_path");
    if (!val.empty() && !is_file(val)) {
      throw UsageError("data.val_path: " + std::string(what) + " " + val + " does not exist");
    }
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

Dataset load_dataset(const Config& config, const at::Device& device, const at::Device& train_device) {
  const std::string& name = config.get_string("data.name");
  Dataset d;
  if (name == "fashion_mnist") {
    d = fashion_mnist(config);
  } else if (name == "tensors") {
    d = tensors_dataset(config);
  } else if (name == "synthetic_tokens" ||
             (name == "synthetic" && is_token_model(config.get_string("model.name")))) {
    d = synthetic_tokens(config);
  } else if (name == "synthetic_images" || name == "synthetic") {
    d = synthetic_images(config);
  } else {
    d = stream_dataset(config);
  }
  d.test = take_first(d.test, config.get_int("data.test_samples"));
  if (d.random_windows) {
    // Windows are views of the stream: move the stream, then view it there.
    if (config.get_int("data.train_samples") > 0) {
      d.samples_per_epoch = std::min(d.samples_per_epoch, config.get_int("data.train_samples"));
    }
    const int64_t t = d.train.inputs.size(1);
    const at::Tensor stream = d.train_stream.to(train_device);
    d.train_stream = at::Tensor();
    d.train = all_windows(stream, t);
  } else {
    d.train = take_first(d.train, config.get_int("data.train_samples"));
    d.train = Split{d.train.inputs.to(train_device).contiguous(),
                    d.train.targets.to(train_device).contiguous(), d.train.rows};
  }
  d.test = Split{d.test.inputs.to(device).contiguous(), d.test.targets.to(device).contiguous(),
                 d.test.rows};
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

BatchSampler BatchSampler::random_windows(int64_t num_samples, int64_t samples_per_epoch,
                                          int64_t global_batch, int world_size, int rank,
                                          int64_t grad_accum, uint64_t seed, at::Device device) {
  BatchSampler s(num_samples, global_batch, world_size, rank, grad_accum, seed, device);
  s.steps_per_epoch_ = samples_per_epoch / global_batch;
  s.random_windows_ = true;
  return s;
}

at::Tensor BatchSampler::indices(int64_t epoch, int64_t step_in_epoch, int64_t micro) {
  const int64_t per_rank = global_batch_ / world_size_;
  const int64_t micro_size = per_rank / grad_accum_;
  if (random_windows_) {
    if (step_in_epoch != cached_step_ || epoch != cached_epoch_) {
      const uint64_t s = mix_seed(seed_ ^ mix_seed(static_cast<uint64_t>(epoch))) ^
                         mix_seed(0x5354ULL + static_cast<uint64_t>(step_in_epoch));
      at::Generator gen = generator(mix_seed(s));
      permutation_ = at::randint(num_samples_, {global_batch_}, gen,
                                 at::TensorOptions().dtype(at::kLong)).to(device_);
      cached_epoch_ = epoch;
      cached_step_ = step_in_epoch;
    }
    return permutation_.narrow(0, rank_ * per_rank + micro * micro_size, micro_size);
  }
  if (epoch != cached_epoch_) {
    at::Generator gen = generator(mix_seed(seed_ ^ mix_seed(static_cast<uint64_t>(epoch))));
    permutation_ = at::randperm(num_samples_, gen, at::TensorOptions().dtype(at::kLong)).to(device_);
    cached_epoch_ = epoch;
  }
  const int64_t begin = step_in_epoch * global_batch_ + rank_ * per_rank + micro * micro_size;
  return permutation_.narrow(0, begin, micro_size);
}

std::pair<int64_t, int64_t> eval_shard(int64_t n, int world_size, int rank) {
  return {n * rank / world_size, n * (rank + 1) / world_size};
}

}  // namespace fusetrain::trainer
