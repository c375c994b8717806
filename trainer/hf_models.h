// Hugging Face's GPT-2 and Llama families in C++: the same layouts, names
// and arithmetic as transformers' GPT2LMHeadModel and LlamaForCausalLM, so a
// Hugging Face model folder loads into them and a trained one goes back.
//
// The module tree carries Hugging Face's parameter names
// ("transformer.h.0.attn.c_attn.weight", "model.layers.0.self_attn.q_proj.weight"),
// so the trainer's checkpoints hold them under "model." and the export is a
// rename. Sizes come from config.json (model.pretrained) or, from scratch,
// from the model.* keys, turned into the config.json the export writes.
#pragma once

#include "checkpoint.h"
#include "config.h"
#include "models.h"

#include <nlohmann/json.hpp>

#include <string>

namespace fusetrain::trainer {

/// Whether model.name is a Hugging Face family (gpt2, llama).
bool is_hf_model(const std::string& name);

/// The model's Hugging Face config.json: model.pretrained's, checked against
/// model.name (its model_type) and the data's vocabulary; else one built from
/// the model.* keys for `vocab` tokens. UsageErrors name the file and key.
nlohmann::json hf_config(const Config& config, int64_t vocab);

/// Builds model.name (gpt2 or llama) from `hf` (hf_config), initialised as
/// transformers does, then loads model.pretrained's weights when set and
/// `load_pretrained`.
Model make_hf_model(const Config& config, const nlohmann::json& hf, const DatasetInfo& data,
                    bool load_pretrained = true);

/// The config.json a checkpoint of a gpt2 or llama run keeps, or "".
std::string stored_hf_config(const TensorDict& checkpoint);

/// The config.json of a model from make_hf_model (what the checkpoint keeps
/// as "meta.hf_config"), or nullptr for any other model.
const nlohmann::json* hf_config_of(const ModelImpl& model);

/// `fusetrain export --hf OUT`: the checkpoint's model as a Hugging Face
/// folder (config.json, model.safetensors in float32) that
/// transformers.AutoModelForCausalLM.from_pretrained(OUT) loads. Written to a
/// temporary folder, then renamed into place. Returns a line describing it.
std::string export_hf(const std::string& checkpoint, const std::string& out);

}  // namespace fusetrain::trainer
