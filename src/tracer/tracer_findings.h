// tracer_findings.h — how the tracer turns a non-finite tensor into a
// finding (tracer_findings.cpp): the op that made it and its role, the chain
// its values belong to, and whether that chain mattered to the step. Both
// paths call these, the eager one as ops end, the deferred one as it
// replays its record.
#pragma once

#include "tracer_state.h"

#include <cstddef>
#include <optional>

namespace nanguard::detail {

/// Records the non-finite `out` of the op at `site`: a finding, or a mark
/// on the chain it continues. `census_then`: the census of `out` as the op
/// left it when the deferred path took it; nullptr to take it now.
/// `output_index`: its index among the op's outputs, or kWrittenArgument.
void on_nonfinite_output(tracer_state& st, const op_site& site, const op_context& ctx, const at::Tensor& out,
                         const tensor_stats* census_then, int output_index);

/// A gradient no op made, non-finite, handed to the node at `site` as its
/// input `input`: the finding of the node that returned it (`sender`,
/// detect_anomaly's check, NaN and Inf), or of the gradient handed to
/// backward() when no node did. `census_then`: as in on_nonfinite_output.
void on_nonfinite_node_input(tracer_state& st, const op_site& site, const ran_node* sender,
                             const at::Tensor& gradient, const tensor_stats* census_then, size_t input);

/// A backward pass starts at the node of the forward op `sequence_nr`: a
/// non-finite loss mattered.
void reach_from_loss(tracer_state& st, int64_t sequence_nr);

/// The chain of `t`, a gradient a leaf receives, mattered.
void reach_from_leaf(tracer_state& st, const taint& t);

/// The traced model returned `out`: the chain of its values, if any, mattered.
void reach_from_output(tracer_state& st, const at::Tensor& out);

/// A leaf received its gradient: every chain recorded so far is judged.
void judge_all(tracer_state& st);

/// True when a chain recorded so far is unjudged or has not reached the
/// loss, a gradient or the outputs: judging or reaching it may change the
/// findings. (A chain both judged and reached is shown for good.)
bool any_open_chain(tracer_state& st);

/// What the tracer knows of a gradient (or of the tensor it views).
std::optional<taint> taint_of(tracer_state& st, const at::Tensor& t);

}  // namespace nanguard::detail
