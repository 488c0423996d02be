// The names the examples in the public headers' comments use, declared
// (never defined: the examples are compiled, not linked or run) so that
// scripts/header-examples' output compiles. An example that needs a name
// not here fails the build: add the name, or write the example with one
// of these.
#pragma once

#include <nanguard/nanguard.h>

#include <torch/script.h>
#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

namespace nanguard_header_examples {

// The model, its optimizer and its data.
extern torch::nn::Linear model;
extern torch::jit::Module scripted;  // a TorchScript model
extern torch::nn::ModuleList layers;
struct Block : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x);
};
extern torch::optim::SGD optimizer;
extern nanguard::guard& g;
extern at::Tensor x, y, x0, y0, x1, y1, batch, train_x, logits, target, scores, key_padding, w, b, loss;
extern std::vector<std::pair<at::Tensor, at::Tensor>> batches, my_shard_of_the_batches;
extern std::vector<at::Tensor> loader, params, grads;
extern nanguard::step_fn loss_fn;
extern int64_t step, t;
extern int rank;
extern c10::intrusive_ptr<c10d::ProcessGroup> pg;

// What the training loop knows.
extern nanguard::sentinel sentinel;
extern nanguard::tracer& tracer;
extern nanguard::column_stats stats;
extern nanguard::finding f, finding;
extern nanguard::precision_report report;
extern std::vector<nanguard::step_event> events;
extern std::vector<double> norms, rows;
extern double loss_value, grad_norm, numerator, denominator;
extern bool finite;

// The user's functions.
void warn(int64_t column);
void normalise(std::vector<double>& rows);
void my_kernel(const at::Tensor& x);
at::Tensor my_log_kernel(const at::Tensor& x);
double ratio(double numerator, double denominator);
void skip_step(int64_t first_bad_tensor);
void zero_grad(torch::jit::Module& module);

}  // namespace nanguard_header_examples
