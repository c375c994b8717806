// The trainer's datasets, held whole in memory: Fashion-MNIST from its gzip
// IDX files, the user's classification tensors (safetensors or torch.save),
// token streams (a file of ids, or the bytes of a text file), synthetic
// images and tokens; and the sampler that gives each rank its shard of
// every global batch.
#pragma once

#include "config.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fusetrain::trainer {

/// One split, whole: inputs [N, C, H, W] or [N, D] float32 (classification)
/// or [N, T] int64 (token windows); targets [N] int64 (classes) or [N, T]
/// int64 (next tokens). A token stream's training split is a strided view,
/// window i starting at token i (no copy).
struct Split {
  at::Tensor inputs;
  at::Tensor targets;
  /// Each sample's row in its file [N] int64, where a split took a subset
  /// (data.val_fraction); undefined: sample i is row i.
  at::Tensor rows = {};
  int64_t size() const { return inputs.size(0); }
};

struct Dataset {
  Split train;
  Split test;
  /// Classes (images) or vocabulary size (tokens).
  int64_t num_classes = 0;
  /// Where num_classes came from, for the errors of a model whose output
  /// disagrees with it: the config key that set it, the dataset that fixes
  /// it, or the largest label found in a file (with its index).
  std::string num_classes_origin;
  /// What the run's header warns of (e.g. classes without a training sample).
  std::vector<std::string> warnings;
  /// [C, H, W] for images, [T] for token windows.
  std::vector<int64_t> input_shape;
  bool is_tokens = false;
  /// Tokens are bytes (text): validation reports bits per byte.
  bool byte_vocab = false;
  /// A token stream: every step draws random windows (BatchSampler's
  /// random-window mode) and an epoch is samples_per_epoch of them.
  bool random_windows = false;
  int64_t samples_per_epoch = 0;  // 0: train.size()
  /// The token stream `train` views (load_dataset moves it to the device).
  at::Tensor train_stream;
  /// Normalisation applied to the images (x - mean) / std; 0 and 1 if none.
  double mean = 0.0;
  double std = 1.0;
  std::string description;
};

/// Loads the dataset the config names (data.*): the test split moved to
/// `device`, the training split to `train_device` (the host when a
/// BatchLoader feeds the device). Every rank loads the same data; the
/// sampler picks its share. A missing Fashion-MNIST names the Debian package
/// to install.
Dataset load_dataset(const Config& config, const at::Device& device, const at::Device& train_device);
inline Dataset load_dataset(const Config& config, const at::Device& device) {
  return load_dataset(config, device, device);
}

/// Checks that the files the dataset needs exist (before any work starts);
/// a missing Fashion-MNIST names the Debian package that provides it.
void check_data_available(const Config& config);

/// splitmix64: decorrelates nearby seeds (seed, seed + 1; epoch 0, 1, ...).
uint64_t mix_seed(uint64_t x);

/// Training-time image augmentation (data.random_crop_padding,
/// data.random_hflip). Each sample's crop offset and flip are a hash of
/// (seed, epoch, sample index), so they are the same whichever rank, loader
/// path or thread count prepares the batch, and a resumed run sees what an
/// uninterrupted one would.
struct Augmentation {
  int64_t crop_padding = 0;  // pixels of padding a side; the crop offset is in [-p, p]
  bool hflip = false;
  uint64_t seed = 0;
  float pad_value = 0.f;  // a zero pixel after normalisation: (0 - mean) / std
  bool enabled() const { return crop_padding > 0 || hflip; }
};

/// The config's augmentation for `data` (off unless a key turns it on; an
/// error naming the key where the inputs are not images [N, C, H, W]).
Augmentation augmentation_from(const Config& config, const Dataset& data);

/// Applies `aug` in place to a batch of images [B, C, H, W] (float32,
/// contiguous, on the CPU) whose rows are the samples `index` [B] of the
/// training split in `epoch`.
void augment_images_(at::Tensor& images, const at::Tensor& index, int64_t epoch,
                     const Augmentation& aug);

/// Reads one gzip IDX file (magic 0x0801 labels or 0x0803 images) into a
/// uint8 tensor of its shape. Errors name the file and what is wrong.
at::Tensor read_idx_gz(const std::string& path);

/// The data order: every epoch a permutation of the training set drawn from
/// (seed, epoch); step s of an epoch uses the global batch at positions
/// [s * B, (s + 1) * B) of it (a tail smaller than B is dropped). Rank r of
/// W takes the r-th of W equal slices of the global batch and splits it into
/// grad_accum micro-batches. The order depends only on the seed, the epoch
/// and the global batch size, so a resumed run, or one with another world
/// size, sees the same global batches.
class BatchSampler {
 public:
  /// The epoch's permutation is drawn on the CPU and kept on `device`, so a
  /// step's indices are a slice there (no host-to-device copy per step).
  BatchSampler(int64_t num_samples, int64_t global_batch, int world_size, int rank,
               int64_t grad_accum, uint64_t seed, at::Device device = at::kCPU);

  /// Random-window mode, for token streams: step s of epoch e takes
  /// global_batch sample indices drawn uniformly from [0, num_samples) by a
  /// generator seeded from (seed, e, s), so a resumed run or another world
  /// size sees the same windows; an epoch is samples_per_epoch / global_batch
  /// steps.
  static BatchSampler random_windows(int64_t num_samples, int64_t samples_per_epoch,
                                     int64_t global_batch, int world_size, int rank,
                                     int64_t grad_accum, uint64_t seed, at::Device device);

  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  /// Sample indices (on the device) of micro-batch `micro` of step
  /// `step_in_epoch` of `epoch` for this rank.
  at::Tensor indices(int64_t epoch, int64_t step_in_epoch, int64_t micro);

 private:
  int64_t num_samples_;
  int64_t global_batch_;
  int world_size_;
  int rank_;
  int64_t grad_accum_;
  uint64_t seed_;
  int64_t steps_per_epoch_;
  at::Device device_;
  int64_t cached_epoch_ = -1;
  at::Tensor permutation_;
  bool random_windows_ = false;
  int64_t cached_step_ = -1;
};

/// This rank's contiguous part [begin, end) of `n` evaluation samples.
std::pair<int64_t, int64_t> eval_shard(int64_t n, int world_size, int rank);

}  // namespace fusetrain::trainer
