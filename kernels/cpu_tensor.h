// The part of ATen the kernel sources use: tensors, their checks and the three allocating operations.
//
// Not <torch/extension.h>: it brings pybind11 and the whole C++ frontend, and parsing it took 32 s per
// source on a 2-core Zen 3 against 7 s for these headers, most of the first start's compile.
// torch::Tensor is at::Tensor: a caller compiled against torch's headers names the same functions.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
