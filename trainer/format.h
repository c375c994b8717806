// {fmt} for the trainer's text. LibTorch ships {fmt}'s headers but none of
// its compiled symbols (libc10 keeps its copy hidden), so the trainer uses it
// header-only. The precompiled header does not include {fmt}, so defining
// FMT_HEADER_ONLY here, after it, is consistent in every translation unit.
#pragma once

#ifndef FMT_HEADER_ONLY
#define FMT_HEADER_ONLY
#endif
#include <fmt/format.h>
