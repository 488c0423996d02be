// Precompiled header: the LibTorch headers every nanguard source needs.
// Only heavy, stable third-party headers belong here.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>
