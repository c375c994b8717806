// fusetrain's C++ API in one include.
#pragma once

#include <fusetrain/amp/float32_module.h>
#include <fusetrain/amp/float8_linear.h>
#include <fusetrain/amp/grad_scaler.h>
#include <fusetrain/amp/policy.h>
#include <fusetrain/dist/comm_hooks.h>
#include <fusetrain/dist/ddp.h>
#include <fusetrain/dist/process_group.h>
#include <fusetrain/dist/shared_memory.h>
#include <fusetrain/dist/zero.h>
#include <fusetrain/graph/fused_steps.h>
#include <fusetrain/nn/batch_norm.h>
#include <fusetrain/nn/cross_entropy.h>
#include <fusetrain/nn/linear_cross_entropy.h>
#include <fusetrain/ops/amp.h>
#include <fusetrain/ops/batch_norm.h>
#include <fusetrain/ops/cpu/cpu_features.h>
#include <fusetrain/ops/fp8.h>
#include <fusetrain/ops/linear_cross_entropy.h>
#include <fusetrain/ops/optim.h>
#include <fusetrain/optim/fused.h>
#include <fusetrain/optim/zero.h>
#include <fusetrain/trainer/model.h>
#include <fusetrain/version.h>
