// nanguard.h — everything nanguard offers, in one include.
//
// nanguard finds where a NaN or Inf is born in LibTorch training and keeps
// training finite. The smallest use, a census of a tensor:
//
//   #include <nanguard/nanguard.h>
//
//   at::Tensor grad = ...;
//   if (nanguard::has_nonfinite(grad))
//     std::cerr << nanguard::census(grad) << "\n";
#pragma once

#include <nanguard/census.h>
#include <nanguard/finding.h>
#include <nanguard/scope.h>
#include <nanguard/tracer.h>
