// nanguard.h — everything nanguard offers, in one include.
//
// nanguard finds where a NaN or Inf is born in LibTorch training and keeps
// training finite. The smallest use, a census of a tensor:
//
//   #include <nanguard/nanguard.h>
//
//   at::Tensor grad = model->weight.grad();
//   if (nanguard::has_nonfinite(grad))
//     std::cerr << nanguard::census(grad) << "\n";
//
// A guarded training step (see guard.h):
//
//   nanguard::guard g(model, optimizer, nanguard::guard_options().max_norm(1.0));
//   g.step({x, y}, [&](const std::vector<at::Tensor>& b) { return torch::mse_loss(model->forward(b[0]), b[1]); });
//
// The layers, in the order a non-finite value meets them (src/ is laid out
// the same: src/census/, src/tracer/, then a file per concept; src/detail/
// holds what several share):
// - census: one-pass statistics of a tensor, many tensors per launch on a GPU;
// - tracer: op observers that name the op that made a NaN or Inf (a finding);
// - diagnosis: why it was born and what to change (the tracer diagnoses each
//  finding as it makes it: finding.h holds cause.h's record);
// - guard: keeps training finite (sentinel, policies, replay, data firewall);
// - front ends: the CLI (tools/cli) and the Python module (python/), and what
//  a run leaves to read (the event log, the report, TensorBoard).
#pragma once

// Shared by every layer: the version, the language messages spell code in.
#include <nanguard/version.h>
#include <nanguard/spelling.h>
// census: tensor statistics in one pass (census.h), over many tensors with one sync (nonfinite_record.h).
#include <nanguard/float_formats.h>
#include <nanguard/tensor_stats.h>
#include <nanguard/census.h>
#include <nanguard/nonfinite_record.h>
// tracer: the op that made a NaN or Inf (tracer.h, finding.h), its module (scope.h), other observers.
#include <nanguard/scope.h>
#include <nanguard/finding.h>
#include <nanguard/tracer_options.h>
#include <nanguard/tracer.h>
#include <nanguard/observer_pause.h>
#include <nanguard/precision.h>
#include <nanguard/fpe.h>
// diagnosis: the likely cause of a finding (cause.h) and the rules that decide it (diagnosis.h).
#include <nanguard/cause.h>
#include <nanguard/diagnosis.h>
// guard: the checks and recoveries of a training step (guard.h), and of the data it is fed (firewall.h).
#include <nanguard/forecast.h>
#include <nanguard/sentinel.h>
#include <nanguard/step_signature.h>
#include <nanguard/loss_scaler.h>
#include <nanguard/clip.h>
#include <nanguard/safe_ops.h>
#include <nanguard/schedule.h>
#include <nanguard/snapshot.h>
#include <nanguard/policy.h>
#include <nanguard/training_host.h>
#include <nanguard/distributed.h>
#include <nanguard/bundle.h>
#include <nanguard/run_summary.h>
#include <nanguard/fault_injection.h>
#include <nanguard/guard_options.h>
#include <nanguard/guard.h>
#include <nanguard/csv.h>
#include <nanguard/column_stats.h>
#include <nanguard/firewall.h>
#include <nanguard/isolation_forest.h>
// front ends: what a run leaves to read (events.h, report.h, tensorboard.h).
#include <nanguard/events.h>
#include <nanguard/report.h>
#include <nanguard/tensorboard.h>
