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
#pragma once

#include <nanguard/version.h>

// Finding the origin
#include <nanguard/census.h>
#include <nanguard/nonfinite_record.h>
#include <nanguard/diagnosis.h>
#include <nanguard/finding.h>
#include <nanguard/float_formats.h>
#include <nanguard/spelling.h>
#include <nanguard/scope.h>
#include <nanguard/tracer.h>
#include <nanguard/observer_pause.h>
#include <nanguard/precision.h>
#include <nanguard/fpe.h>
// Keeping training finite
#include <nanguard/guard.h>
#include <nanguard/run_summary.h>
#include <nanguard/policy.h>
#include <nanguard/sentinel.h>
#include <nanguard/loss_scaler.h>
#include <nanguard/clip.h>
#include <nanguard/safe_ops.h>
#include <nanguard/schedule.h>
#include <nanguard/snapshot.h>
#include <nanguard/training_host.h>
#include <nanguard/bundle.h>
#include <nanguard/distributed.h>
// Guarding the data
#include <nanguard/csv.h>
#include <nanguard/column_stats.h>
#include <nanguard/firewall.h>
#include <nanguard/isolation_forest.h>
// Showing it
#include <nanguard/events.h>
#include <nanguard/report.h>
#include <nanguard/tensorboard.h>
