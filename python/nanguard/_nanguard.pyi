"""
nanguard's C++ core (census, tracer, scope, sentinel, loss scaler)
"""
# The stub of the _nanguard extension (python/src/*_bindings.cpp): made with
# pybind11-stubgen 3.0.0 (`python -m pybind11_stubgen nanguard._nanguard`),
# then its few loose types narrowed by hand. The python_typing test runs
# mypy's stubtest on it against the built extension: a binding added or
# renamed without its line here fails it.
from __future__ import annotations
import collections.abc
import torch
import torch.distributed.distributed_c10d
import typing
class GuardAbort(RuntimeError):
    pass
class TensorStats:
    """
    One-pass statistics of a tensor (census).
    """
    @staticmethod
    def from_dict(fields: dict[str, float]) -> TensorStats:
        """
        The TensorStats whose to_dict() is `fields` (counts may come as floats).
        """
    def __init__(self, fields: dict[str, float]) -> None:
        """
        The TensorStats whose to_dict() is `fields`, as from_dict (what unpickling calls).
        """
    def __reduce__(self) -> tuple[typing.Any, ...]:
        ...
    def __repr__(self) -> str:
        ...
    def __str__(self) -> str:
        ...
    def all_finite(self) -> bool:
        """
        True when every element is finite.
        """
    def to_dict(self) -> dict[str, float]:
        """
        Every field as a dict.
        """
    @property
    def absmax(self) -> float:
        ...
    @property
    def bf16_overflow(self) -> int:
        ...
    @property
    def finite(self) -> int:
        ...
    @property
    def first_nonfinite_index(self) -> int:
        ...
    @property
    def first_nonfinite_value(self) -> float:
        ...
    @property
    def fp16_overflow(self) -> int:
        ...
    @property
    def fp16_underflow(self) -> int:
        ...
    @property
    def l2_norm(self) -> float:
        ...
    @property
    def max(self) -> float:
        ...
    @property
    def mean(self) -> float:
        ...
    @property
    def min(self) -> float:
        ...
    @property
    def nan(self) -> int:
        ...
    @property
    def neg_inf(self) -> int:
        ...
    @property
    def nonfinite(self) -> int:
        """
        NaN and Inf elements.
        """
    @property
    def numel(self) -> int:
        ...
    @property
    def pos_inf(self) -> int:
        ...
    @property
    def std(self) -> float:
        ...
    @property
    def subnormal(self) -> int:
        ...
    @property
    def zeros(self) -> int:
        ...
class RecordVerdict:
    """
    What check_many found over a list of tensors (nonfinite_record).
    """
    def __repr__(self) -> str:
        ...
    def all_finite(self) -> bool:
        """
        True when every element is finite.
        """
    @property
    def first_index(self) -> int:
        ...
    @property
    def first_tensor(self) -> int:
        ...
    @property
    def first_value(self) -> float:
        ...
    @property
    def nan(self) -> int:
        ...
    @property
    def neg_inf(self) -> int:
        ...
    @property
    def nonfinite(self) -> int:
        """
        NaN and Inf elements.
        """
    @property
    def pos_inf(self) -> int:
        ...
    @property
    def tensors(self) -> int:
        ...
class Tracer:
    """
    nanguard::tracer: observes every ATen op of this thread.
    """
    def __init__(self, max_findings: typing.SupportsInt, capture_backtrace: bool, allow: collections.abc.Sequence[tuple[str, str, bool, bool, bool]], measure_cost: bool = False, inside_kernels: bool = False, record_sources: bool = False) -> None:
        ...
    def active(self) -> bool:
        ...
    def awaits_judgement(self) -> bool:
        """
        False when judge_by_outputs would change nothing (a healthy pass): the outputs need not be collected.
        """
    def clear(self) -> None:
        ...
    def close(self) -> None:
        """
        Stops observing and frees the tracer.
        """
    def cost(self) -> dict[str, typing.Any]:
        """
        What the tracer cost so far (zeros unless made with measure_cost).
        """
    def findings_json(self) -> list[str]:
        ...
    def found(self) -> bool:
        ...
    def judge_by_outputs(self, outputs: collections.abc.Sequence[torch.Tensor]) -> None:
        """
        The traced model returned these tensors: judges every chain by whether it reaches them.
        """
    def keep_known_across_steps(self, tensors: collections.abc.Sequence[torch.Tensor]) -> None:
        """
        What the tracer knows of these tensors (an optimizer's state) outlasts the step.
        """
    def name_parameters(self, named_parameters: collections.abc.Sequence[tuple[str, torch.Tensor]]) -> None:
        """
        Names parameters (and through them modules) from (name, tensor) pairs.
        """
    def name_tensor(self, arg0: torch.Tensor, arg1: str) -> None:
        ...
    def pause(self) -> None:
        ...
    def resume(self) -> None:
        ...
    def set_step(self, arg0: typing.SupportsInt) -> None:
        ...
    @property
    def closed(self) -> bool:
        ...
class GradReport:
    """
    What one pass over the gradients found.
    """
    def finite(self) -> bool:
        ...
    @property
    def first_nonfinite_name(self) -> str:
        ...
    @property
    def nonfinite(self) -> int:
        ...
    @property
    def nonfinite_counts(self) -> list[int]:
        ...
    @property
    def norms(self) -> list[float]:
        ...
    @property
    def total_norm(self) -> float:
        ...
class Sentinel:
    """
    nanguard::sentinel: fused check of loss and gradients.
    """
    def __init__(self, named_parameters: collections.abc.Sequence[tuple[str, torch.Tensor]], window: typing.SupportsInt = 50, threshold: typing.SupportsFloat = 8.0, min_samples: typing.SupportsInt = 10) -> None:
        ...
    def apply_factor_(self, factor: typing.SupportsFloat) -> None:
        ...
    def check_loss(self, loss: torch.Tensor) -> tuple[bool, float]:
        """
        (finite, value) of a one-element loss.
        """
    def inspect_grads(self, inv_scale: typing.SupportsFloat = 1.0) -> GradReport:
        ...
    def observe(self, arg0: typing.SupportsFloat, arg1: typing.SupportsFloat) -> list[tuple[str, float, float]]:
        """
        Spikes of loss and grad norm as (series, value, z).
        """
    def reset_spikes(self) -> None:
        ...
    @property
    def names(self) -> list[str]:
        ...
class WarmupCosine:
    """
    nanguard::warmup_cosine: linear warmup, then cosine annealing.
    """
    def __init__(self, base_lr: typing.SupportsFloat, warmup_steps: typing.SupportsInt = 0, total_steps: typing.SupportsInt = 1000, min_lr: typing.SupportsFloat = 0.0) -> None:
        ...
    def lr(self, step: typing.SupportsInt) -> float:
        """
        The learning rate at 0-based `step`.
        """
class LossScaler:
    """
    nanguard::loss_scaler (GradScaler semantics).
    """
    def __init__(self, enabled: bool = True, init_scale: typing.SupportsFloat = 65536.0, growth_factor: typing.SupportsFloat = 2.0, backoff_factor: typing.SupportsFloat = 0.5, growth_interval: typing.SupportsInt = 2000, hysteresis: typing.SupportsInt = 1, min_scale: typing.SupportsFloat = 1.0, max_scale: typing.SupportsFloat = 16777216.0) -> None:
        ...
    def get_scale(self) -> float:
        ...
    def inv_scale(self) -> float:
        ...
    def scale(self, arg0: torch.Tensor) -> torch.Tensor:
        ...
    def set_scale(self, arg0: typing.SupportsFloat) -> None:
        ...
    def update(self, found_nonfinite: bool) -> bool:
        ...
    @property
    def enabled(self) -> bool:
        ...
class StepEvent:
    """
    nanguard::step_event: what one guarded step did (nanguard.StepResult).
    """
    def __init__(self, line: str) -> None:
        """
        The event of an event log's line (its to_json(); what unpickling calls).
        """
    def __reduce__(self) -> tuple[typing.Any, ...]:
        ...
    def to_json(self) -> str:
        """
        The event log's line (JSON).
        """
    @property
    def action(self) -> str:
        ...
    @property
    def auto_fix(self) -> str:
        """
        auto_fix: the verified op rewrite kept in force for the rest of the run ("": none).
        """
    @property
    def bundle(self) -> str:
        ...
    @property
    def clip_coef(self) -> float:
        ...
    @property
    def findings_json(self) -> list[str]:
        """
        Each finding of the replay as its JSON (nanguard::to_json).
        """
    @property
    def grad_norm(self) -> float:
        ...
    @property
    def loss(self) -> float:
        ...
    @property
    def lr(self) -> float:
        ...
    @property
    def forecast(self) -> str | None:
        """
        Where the loss or grad norm leaves its dtype's range at its trend (forecast.h), None when healthy.
        """
    @property
    def nonfinite_params(self) -> list[tuple[str, int]]:
        """
        [(name, NaN/Inf count)]
        """
    @property
    def nonfinite_ranks(self) -> list[int]:
        ...
    @property
    def note(self) -> str:
        ...
    @property
    def rank(self) -> int:
        ...
    @property
    def reason(self) -> str:
        ...
    @property
    def remedy(self) -> str:
        ...
    @property
    def rollback_to(self) -> int:
        ...
    @property
    def scale(self) -> float:
        ...
    @property
    def skipped(self) -> bool:
        ...
    @property
    def spikes(self) -> list[tuple[str, float, float]]:
        """
        [(series, value, z)]
        """
    @property
    def step(self) -> int:
        ...
    @property
    def top_norms(self) -> list[tuple[str, float]]:
        """
        [(name, norm)], largest first
        """
    @property
    def verdict(self) -> str:
        """
        The replay's verdict ("": no replay).
        """
    @property
    def fault(self) -> str:
        """
        Hardware or software: data, model, compiler, transient, persistent ("": not told).
        """
    @property
    def signature(self) -> str:
        """
        The step's fingerprint, 16 hex digits ("": not measured).
        """
class EventLog:
    """
    nanguard::event_log: the guard's JSONL event log.
    """
    def __init__(self, path: str, truncate: bool = False) -> None:
        ...
    def write(self, event_json: str) -> None:
        """
        Writes one step event, given as the JSON of a nanguard::step_event (checked as the reader checks it), and flushes the line.
        """
    @property
    def path(self) -> str:
        ...
class IsolationForest:
    """
    Isolation forest on a [rows, features] tensor (scikit-learn's scores).
    """
    def __init__(self, n_estimators: typing.SupportsInt = 100, max_samples: typing.SupportsInt = 256, contamination: typing.SupportsFloat = 0.0, seed: typing.SupportsInt = 0) -> None:
        ...
    def decision_function(self, x: torch.Tensor) -> torch.Tensor:
        """
        score_samples(x) - offset: negative for outliers.
        """
    def fit(self, x: torch.Tensor) -> IsolationForest:
        """
        Grows the trees on finite x [rows, features]; returns self.
        """
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """
        -1 for outliers, +1 for inliers (int64).
        """
    def score_samples(self, x: torch.Tensor) -> torch.Tensor:
        """
        Per-row score (float64); lower is more abnormal.
        """
    @property
    def features(self) -> int:
        ...
    @property
    def fitted(self) -> bool:
        ...
    @property
    def offset(self) -> float:
        ...
class FirewallReport:
    """
    What the firewall found in a batch and did.
    """
    def __str__(self) -> str:
        ...
    def clean(self) -> bool:
        """
        True when nothing was found.
        """
    @property
    def changed_rows(self) -> list[int]:
        ...
    @property
    def clipped(self) -> int:
        ...
    @property
    def columns(self) -> list[dict[str, int]]:
        """
        Per feature: nan, pos_inf, neg_inf, outliers, repaired, clipped.
        """
    @property
    def dropped_rows(self) -> list[int]:
        ...
    @property
    def nonfinite(self) -> int:
        ...
    @property
    def outliers(self) -> int:
        ...
    @property
    def repaired(self) -> int:
        ...
    @property
    def rows_in(self) -> int:
        ...
    @property
    def rows_out(self) -> int:
        ...
class Firewall:
    """
    nanguard::firewall: validate, repair or drop the rows of [batch, features] tensors.
    """
    def __init__(self, nonfinite: str = 'raise', outliers: str = 'ignore', rule: str = 'quantile_range', low_quantile: typing.SupportsFloat = 0.001, high_quantile: typing.SupportsFloat = 0.999, sigmas: typing.SupportsFloat = 3.0, robust_z: typing.SupportsFloat = 5.0, nan_value: typing.SupportsFloat = 0.0, label_columns: collections.abc.Sequence[typing.SupportsInt] = [], column_names: collections.abc.Sequence[str] = []) -> None:
        ...
    def apply(self, batch: torch.Tensor) -> tuple[torch.Tensor, FirewallReport]:
        """
        (cleaned batch, FirewallReport); raises ValueError under a 'raise' policy.
        """
    def fit(self, data: torch.Tensor) -> Firewall:
        """
        Fits medians and outlier bounds on data [rows, features]; returns self.
        """
    @property
    def fitted(self) -> bool:
        ...
    @property
    def lower_bounds(self) -> torch.Tensor:
        ...
    @property
    def upper_bounds(self) -> torch.Tensor:
        ...
class GuardOption:
    """
    One option of nanguard.Guard (GUARD_OPTION_TABLE).
    """
    def __repr__(self) -> str:
        ...
    @property
    def default(self) -> typing.Any:
        """
        Its default.
        """
    @property
    def doc(self) -> str:
        """
        What it does (Guard's docstring).
        """
    @property
    def field(self) -> str:
        """
        The GuardOptions property it sets ("": the Python Guard uses it itself).
        """
    @property
    def name(self) -> str:
        """
        The keyword of nanguard.Guard.
        """
    @property
    def type(self) -> str:
        """
        Its annotation in Guard's signature.
        """
class GuardOptions:
    """
    nanguard::guard_options (see nanguard.Guard).
    """
    auto_fix: bool
    bundle_dir: str
    distributed: Distributed | None
    event_log: str
    front_end: str
    policy: str
    replay: bool
    replay_spikes: bool
    scaler: LossScaler | None
    schedule: WarmupCosine | None
    trace_every_step: bool
    verbose: bool
    verify_remedies: bool
    def __init__(self, **fields: typing.Any) -> None:
        """
        GuardOptions(**fields): guard_options() with each keyword's property set.
        """
    @property
    def audit_every(self) -> int:
        ...
    @audit_every.setter
    def audit_every(self, arg1: typing.SupportsInt) -> None:
        ...
    @property
    def bundle_tags(self) -> list[tuple[str, str]]:
        ...
    @bundle_tags.setter
    def bundle_tags(self, arg1: collections.abc.Sequence[tuple[str, str]]) -> None:
        ...
    @property
    def clip_value(self) -> float:
        ...
    @clip_value.setter
    def clip_value(self, arg1: typing.SupportsFloat) -> None:
        ...
    @property
    def log_top_norms(self) -> int:
        ...
    @log_top_norms.setter
    def log_top_norms(self, arg1: typing.SupportsInt) -> None:
        ...
    @property
    def max_bad_fraction(self) -> float:
        ...
    @max_bad_fraction.setter
    def max_bad_fraction(self, arg1: typing.SupportsFloat) -> None:
        ...
    @property
    def max_bad_steps(self) -> int:
        ...
    @max_bad_steps.setter
    def max_bad_steps(self, arg1: typing.SupportsInt) -> None:
        ...
    @property
    def max_norm(self) -> float:
        ...
    @max_norm.setter
    def max_norm(self, arg1: typing.SupportsFloat) -> None:
        ...
    @property
    def rollback_lr_factor(self) -> float:
        ...
    @rollback_lr_factor.setter
    def rollback_lr_factor(self, arg1: typing.SupportsFloat) -> None:
        ...
    @property
    def snapshot_every(self) -> int:
        ...
    @snapshot_every.setter
    def snapshot_every(self, arg1: typing.SupportsInt) -> None:
        ...
    @property
    def snapshot_keep(self) -> int:
        ...
    @snapshot_keep.setter
    def snapshot_keep(self, arg1: typing.SupportsInt) -> None:
        ...
    @property
    def snapshot_memory_mb(self) -> float:
        ...
    @snapshot_memory_mb.setter
    def snapshot_memory_mb(self, arg1: typing.SupportsFloat) -> None:
        ...
    @property
    def spike_rollback_z(self) -> float:
        ...
    @spike_rollback_z.setter
    def spike_rollback_z(self, arg1: typing.SupportsFloat) -> None:
        ...
    @property
    def spike_threshold(self) -> float:
        ...
    @spike_threshold.setter
    def spike_threshold(self, arg1: typing.SupportsFloat) -> None:
        ...
    @property
    def spike_window(self) -> int:
        ...
    @spike_window.setter
    def spike_window(self, arg1: typing.SupportsInt) -> None:
        ...
class TrainingHost:
    """
    nanguard::training_host: subclass it to drive the guard from Python.
    """
    def __init__(self) -> None:
        ...
class GuardCore:
    """
    nanguard::guard over a Python training host.
    """
    def __init__(self, host: TrainingHost, options: GuardOptions) -> None:
        ...
    def begin_step(self, number: typing.SupportsInt | None = None) -> None:
        """
        Begins a step a framework runs, numbered `number` (its step counter; None: one above the last).
        """
    def cancel_step(self) -> None:
        ...
    def check(self, loss: torch.Tensor, replay: collections.abc.Callable[[collections.abc.Sequence[torch.Tensor]], torch.Tensor], batch: collections.abc.Sequence[torch.Tensor], names: collections.abc.Sequence[str]) -> StepEvent:
        """
        Checks a step a framework ran (the batch's tensors named by `names` in findings); returns its StepEvent.
        """
    def last_event(self) -> StepEvent:
        """
        The last step's StepEvent (after an abort: its bundle).
        """
    def summary(self) -> dict[str, typing.Any]:
        """
        What the run did so far (nanguard::run_summary), its line as "text".
        """
    def inject(self, spec: str) -> None:
        """
        Plants the fault `spec` (nanguard::fault_spec_from_string's text) in the guard's steps.
        """
    def set_sample_indices(self, tensor: torch.Tensor, indices: collections.abc.Sequence[typing.SupportsInt]) -> None:
        """
        The dataset index of each row of batch tensor `tensor` in the next step (Finding.dataset_index).
        """
    def step_accumulated(self, micro_batches: collections.abc.Sequence[collections.abc.Sequence[torch.Tensor]], forward: collections.abc.Callable[[typing.SupportsInt, collections.abc.Sequence[torch.Tensor]], torch.Tensor], names: collections.abc.Sequence[str]) -> StepEvent:
        """
        One guarded step over the micro-batches (their tensors, named by `names` in findings); forward(i) is the loss of the i-th. Returns its StepEvent.
        """
    @property
    def last_warning(self) -> str:
        """
        The last step's warning line ("" when the optimizer took it).
        """
    @property
    def lr_factor(self) -> float:
        ...
    @property
    def rollbacks(self) -> int:
        ...
    @property
    def scaler(self) -> LossScaler:
        ...
    @property
    def sentinel(self) -> Sentinel:
        ...
    @property
    def skipped(self) -> int:
        ...
    @property
    def steps(self) -> int:
        ...
class Distributed:
    """
    nanguard::distributed over a torch.distributed process group: the guard averages the gradients and every rank takes the same decision each step.
    """
    def __init__(self, process_group: torch.distributed.distributed_c10d.ProcessGroup, average_gradients: bool = True, backward: str = 'none') -> None:
        """
        backward: the collective the model's own backward reduces the gradients with: "none" (the guard averages them), "all_reduce" (DistributedDataParallel) or "reduce_scatter" (FSDP2)
        """
    @property
    def backward(self) -> str:
        ...
    @property
    def rank(self) -> int:
        ...
    @property
    def world_size(self) -> int:
        ...
def census(tensor: torch.Tensor) -> TensorStats:
    """
    One vectorised pass: NaN/Inf/zero/subnormal counts, min/max/mean/std, norms, headroom.
    """
def census_many(tensors: collections.abc.Sequence[torch.Tensor]) -> list[TensorStats]:
    """
    The census of each tensor; on CUDA many per kernel launch and one host sync for all.
    """
def check_many(tensors: collections.abc.Sequence[torch.Tensor]) -> RecordVerdict:
    """
    Whether any tensor holds a NaN or Inf, and the first that does; on CUDA one host sync for all.
    """
def clip_coefficient(total_norm: typing.SupportsFloat, max_norm: typing.SupportsFloat) -> float:
    ...
def current_scope() -> str:
    """
    The dotted path of the innermost open scope on this thread.
    """
def diagnose_finding(finding_json: str, losses: collections.abc.Sequence[typing.SupportsFloat], grad_norms: collections.abc.Sequence[typing.SupportsFloat], lr: typing.SupportsFloat, loss_scale: typing.SupportsFloat, data: collections.abc.Sequence[str]) -> str:
    """
    The finding (JSON) diagnosed again with the steps before it (nanguard::diagnose).
    """
def finding_to_string(arg0: str) -> str:
    ...
def finding_to_text(arg0: str) -> str:
    ...
def remedy_check_to_string(remedy: str, applied: str, result: str, loss: typing.SupportsFloat, detail: str) -> str:
    """
    One remedy check as a line (nanguard::to_string(remedy_check)): "verified finite: ...".
    """
def read_csv(path: str, delimiter: str = ",") -> tuple[list[str], torch.Tensor]:
    """
    (columns, [rows, columns] float64 tensor) of a numeric CSV file.
    """
def has_nonfinite(tensor: torch.Tensor) -> bool:
    """
    True when the tensor holds a NaN or an Inf.
    """
def mark_written(tensor: torch.Tensor) -> None:
    """
    Tells tracers the tensor changed outside a recorded op (bumps its version).
    """
def merge_census(parts: collections.abc.Sequence[TensorStats]) -> TensorStats:
    """
    The census of a tensor made of parts (shards) from the census of each; each part's first_nonfinite_index must index the whole tensor.
    """
def observers_paused() -> bool:
    """
    True while this thread's observers are paused.
    """
def pause_observers() -> None:
    """
    Pauses every nanguard observer on this thread until resume_observers() (torch.compile's compile).
    """
def cause_code(name: str) -> int:
    """
    1 + the position of cause `name` in nanguard::cause (unclassified: 1): the number the framework callbacks log as nanguard/last_cause. A ValueError for another name.
    """
def policy_from_string(name: str) -> str:
    """
    `name` when it names a policy; else a ValueError listing the policies.
    """
def resume_observers() -> None:
    """
    Ends the latest pause_observers() on this thread.
    """
def set_library_paths(directories: collections.abc.Sequence[str]) -> None:
    """
    Frames from files under these directories are not the user's code: a finding's source line is the innermost frame outside them (nanguard::set_library_paths).
    """
def scope_depth() -> int:
    """
    Scopes opened by scope_push and not yet closed (this thread).
    """
def scope_pop() -> None:
    """
    Closes the innermost scope opened by scope_push.
    """
def scope_push(name: str) -> None:
    """
    Opens a nanguard::scope named `name` inside the current one (this thread).
    """
def tensorboard_scalars(event_json: str) -> list[tuple[str, float]]:
    """
    [(tag, value)] of one step event (JSON) under nanguard's TensorBoard tags.
    """
def tensorboard_text(event_json: str) -> str:
    """
    The Markdown of a step event's findings, remedy and note ("" for a healthy step).
    """
def verdict_of(parts: collections.abc.Sequence[tuple[typing.SupportsInt, typing.SupportsInt, typing.SupportsInt, typing.SupportsInt, typing.SupportsFloat]]) -> RecordVerdict:
    """
    A RecordVerdict from (nan, pos_inf, neg_inf, first_index, first_value) of each tensor, in order (check_many of DTensors).
    """
ACTIONS: tuple[str, ...] = ('step', 'skip', 'backoff', 'rollback', 'abort', 'data')
GUARD_OPTION_TABLE: tuple[GuardOption, ...]
POLICIES: tuple[str, ...] = ('skip', 'backoff', 'rollback', 'abort')
VERDICTS: tuple[str, ...] = ('', 'reproduced', 'not reproduced', 'replay failed', 'compiled only')
__version__: str = '0.1.0'
