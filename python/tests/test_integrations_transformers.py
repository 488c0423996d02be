"""nanguard.integrations.transformers.NanGuardCallback on real Hugging Face
Trainers (a tiny BERT built from its config on the CPU: nothing is
downloaded): a healthy run is untouched; a planted NaN (a bad batch, an LR
spike, a log of 0 in the model) is skipped or rolled back, named, and the
run ends finite; `nanguard report` / `inspect` read what it wrote.

transformers and accelerate come from python/requirements-frameworks.txt
(`make setup`); without them, importing the callback fails and says so."""
import json
import logging
import math
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest
import torch

import nanguard
from nanguard.integrations.transformers import NanGuardCallback  # ImportError saying `make setup` installs it

import transformers

CLI = os.environ.get("NANGUARD_CLI", "")
needs_cli = pytest.mark.skipif(not CLI, reason="NANGUARD_CLI is not set (CTest sets it to the built nanguard)")

transformers.logging.set_verbosity_error()
logging.getLogger("accelerate").setLevel(logging.ERROR)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

HIDDEN, SEQ = 32, 8


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=SEQ, num_labels=3)
    return transformers.BertForSequenceClassification(config)


class Embedded(torch.utils.data.Dataset):
    """Samples of inputs_embeds [SEQ, HIDDEN] and a label; ``nan_at``: the
    sample holding a NaN (the bad batch)."""

    def __init__(self, n=64, nan_at=-1):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, SEQ, HIDDEN, generator=g)
        self.y = (self.x[:, 0, 0] > 0).long()
        if nan_at >= 0:
            self.x[nan_at, 2, 5] = float("nan")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"inputs_embeds": self.x[i], "labels": self.y[i]}


class Plant(transformers.TrainerCallback):
    """The test's own callback, planting a bug at one optimizer step: a log
    of 0 in the embeddings' output (a forward hook), or the LR times 1e35."""

    def __init__(self, model, log0_at=-1, lr_spike_at=-1):
        self.log0_at, self.lr_spike_at, self.now = log0_at, lr_spike_at, False
        model.bert.embeddings.register_forward_hook(
            lambda m, a, out: out + torch.log(torch.zeros_like(out[..., :1])) if self.now else None)

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.now = state.global_step == self.log0_at
        if state.global_step == self.lr_spike_at:
            for g in optimizer.param_groups:
                g["lr"] *= 1e35  # the scheduler sets it back at its next step


def train(tmp_path, model, callbacks=(), steps=8, data=None, optimizers=(None, None), **args):
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=steps, per_device_train_batch_size=4,
        learning_rate=1e-3, lr_scheduler_type="constant", save_strategy="no", disable_tqdm=True, seed=0,
        logging_steps=1, dataloader_num_workers=0, **args)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=data or Embedded(),
                                   callbacks=list(callbacks), optimizers=optimizers)
    trainer.train()
    return trainer


def final_loss(model):
    """The loss on the first 16 clean samples after training (eval mode)."""
    d = Embedded()
    model.eval()
    with torch.no_grad():
        return float(model(inputs_embeds=d.x[:16], labels=d.y[:16]).loss)


def finite_params(model):
    return all(torch.isfinite(p).all() for p in model.parameters())


def events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def cli(*args):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=300)


def test_a_healthy_run_is_untouched(tmp_path):
    plain, guarded = tiny_bert(), tiny_bert()
    train(tmp_path, plain)
    cb = NanGuardCallback(policy="rollback", event_log=tmp_path / "events.jsonl")
    train(tmp_path, guarded, [cb])
    for a, b in zip(plain.parameters(), guarded.parameters()):
        assert torch.equal(a, b)
    lines = events(tmp_path / "events.jsonl")
    assert [l["step"] for l in lines] == list(range(1, 9)) and all(l["action"] == "step" for l in lines)
    assert cb.bad_steps == []


def test_a_log_of_zero_in_the_model_is_skipped_and_named(tmp_path):
    model = tiny_bert()
    cb = NanGuardCallback(policy="skip", event_log=tmp_path / "events.jsonl")
    train(tmp_path, model, [Plant(model, log0_at=3), cb])
    assert [r.step for r in cb.bad_steps] == [4]
    f = cb.bad_steps[0].finding
    assert f is not None and f.op == "aten::log" and cb.bad_steps[0].verdict == "reproduced", cb.bad_steps[0]
    assert finite_params(model) and math.isfinite(final_loss(model))
    assert events(tmp_path / "events.jsonl")[3]["findings"][0]["op"] == "aten::log"


def test_a_compiled_model_is_guarded_and_named_without_orig_mod(tmp_path):
    """torch_compile=True: the Trainer runs the compiled model; the bad batch's
    replay runs it eagerly and names the op and module as on the eager model."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_bert()
    cb = NanGuardCallback(policy="skip", event_log=tmp_path / "events.jsonl")
    train(tmp_path, model, [cb], data=Embedded(nan_at=13), torch_compile=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did run compiled
    assert len(cb.bad_steps) == 1 and cb.bad_steps[0].verdict == "reproduced", cb.bad_steps
    f = cb.bad_steps[0].finding
    assert f is not None and f.module.startswith("bert.embeddings") and f.cause == "bad_data", f
    assert finite_params(model) and math.isfinite(final_loss(model))


def test_without_the_callback_the_planted_bug_poisons_the_model(tmp_path):
    """The control of the tests above: the same run without nanguard ends non-finite."""
    model = tiny_bert()
    train(tmp_path, model, [Plant(model, log0_at=3)])
    assert not finite_params(model)


def test_a_bad_batch_is_skipped_with_gradient_accumulation(tmp_path):
    model = tiny_bert()
    cb = NanGuardCallback(policy="skip", event_log=tmp_path / "events.jsonl")
    # 4 steps of 2 micro-batches of 4 samples: one epoch of the 32 samples, one of them bad.
    train(tmp_path, model, [cb], steps=4, data=Embedded(n=32, nan_at=21), gradient_accumulation_steps=2)
    lines = events(tmp_path / "events.jsonl")
    assert len(lines) == 4  # one event per optimizer step, not per micro-batch
    assert [l["action"] for l in lines].count("skip") == 1
    f = cb.bad_steps[0].finding
    assert f is not None and f.role == "input", f  # the NaN came with the batch
    # Named by the forward's keyword, with a remedy for the Trainer's collator.
    assert f.culprit.startswith("inputs_embeds") and f.cause == "bad_data", f
    assert 'Trainer(data_collator=nanguard.data.firewall_collate(' in f.remedy, f.remedy
    assert 'field="inputs_embeds"' in f.remedy and "nanguard scan" not in f.remedy, f.remedy
    assert finite_params(model) and math.isfinite(final_loss(model))


def test_an_lr_spike_is_rolled_back(tmp_path):
    model = tiny_bert()
    cb = NanGuardCallback(policy="rollback", snapshot_every=1, event_log=tmp_path / "events.jsonl")
    trainer = train(tmp_path, model, [Plant(model, lr_spike_at=3), cb], steps=10)
    assert cb.bad_steps and all(r.action == "rollback" for r in cb.bad_steps)
    # step 5 is bad; the snapshot taken at step 4, before its spiked update, is restored
    assert cb.bad_steps[0].step == 5 and cb.bad_steps[0].rollback_to == 4 and len(cb.bad_steps) == 1
    f = cb.bad_steps[0].finding  # the spiked embeddings overflow in the first LayerNorm
    assert f is not None and f.op == "aten::native_layer_norm" and f.role == "producer", f
    assert finite_params(model) and math.isfinite(final_loss(model))
    # The rollback halved the LR, and the scheduler keeps it halved.
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3)


def test_a_rollback_lowers_the_user_s_lr_scheduler_and_the_trainer_s_once_each(tmp_path):
    """The user's lr_scheduler= was replaced by the Trainer's scheduler: a
    rollback left the user's base LR as it was."""
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainers = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    users = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # one the user steps in a callback of their own
    cb = NanGuardCallback(policy="rollback", snapshot_every=1, lr_scheduler=[users, trainers], verbose=False)
    train(tmp_path, model, [Plant(model, lr_spike_at=3), cb], steps=10, optimizers=(opt, trainers))
    assert [r.action for r in cb.bad_steps] == ["rollback"]
    # Halved once each: the Trainer's, named by the user too, is not lowered twice.
    assert users.base_lrs == pytest.approx([0.5e-3]) and trainers.base_lrs == pytest.approx([0.5e-3])


@needs_cli
def test_nanguard_report_and_inspect_read_what_the_callback_wrote(tmp_path):
    log, bundles = tmp_path / "events.jsonl", tmp_path / "bundles"
    model = tiny_bert()
    with pytest.raises(nanguard.NonFiniteError, match="aten::log"):
        train(tmp_path, model, [Plant(model, log0_at=2),
                                NanGuardCallback(policy="abort", event_log=log, bundle_dir=bundles)])
    lines = events(log)
    assert lines[-1]["action"] == "abort" and lines[-1]["bundle"]
    r = cli("report", log, "-o", tmp_path / "report.html")
    assert r.returncode == 0, r.stderr
    assert "aten::log" in (tmp_path / "report.html").read_text()
    r = cli("inspect", lines[-1]["bundle"])
    assert r.returncode == 0, r.stderr
    assert "aten::log" in r.stdout and "transformers" in r.stdout


def test_the_callback_refuses_what_it_cannot_guard():
    with pytest.raises(ValueError, match="loss_scale is the Trainer's"):
        NanGuardCallback(loss_scale=True)
    with pytest.raises(ValueError, match="policy must be one of"):
        NanGuardCallback(policy="retry")
    with pytest.raises(TypeError, match=r"NanGuardCallback: unknown option 'snapshot_evry'; did you mean 'snapshot_every'\?"):
        NanGuardCallback(snapshot_evry=10)


def test_a_loss_computed_outside_the_model_leaves_the_gradients_to_decide(tmp_path):
    """compute_loss_func: the model gets no labels and returns no loss. The
    healthy steps still train, and the bad batch is still skipped and named
    (by its forward)."""
    model = tiny_bert()
    cb = NanGuardCallback(policy="skip", event_log=tmp_path / "events.jsonl")
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=8, per_device_train_batch_size=4,
        learning_rate=1e-3, save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0)
    loss_fn = lambda outputs, labels, num_items_in_batch=None: torch.nn.functional.cross_entropy(outputs.logits, labels)
    transformers.Trainer(model=model, args=targs, train_dataset=Embedded(n=32, nan_at=9), callbacks=[cb],
                         compute_loss_func=loss_fn).train()
    lines = events(tmp_path / "events.jsonl")
    assert [l["action"] for l in lines].count("skip") == 1 and len(lines) == 8
    assert cb.bad_steps[0].finding is not None and cb.bad_steps[0].finding.role == "input"
    assert finite_params(model)


def test_ddp_ranks_skip_the_same_step_and_the_bad_rank_names_the_op(tmp_path):
    """torchrun, 2 processes on the CPU (gloo): the NaN in rank 1's batch
    reaches rank 0 through the gradient all-reduce; both skip that step
    (their parameters stay equal), rank 1's replay names the input, and
    every rank's result is rank 1's (the guard agrees on DDP's group); each rank writes its own event log."""
    script = os.path.join(os.path.dirname(__file__), "ddp_transformers_run.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script,
                        str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert res[0]["world"] == 2
    assert [b["step"] for b in res[0]["bad"]] == [b["step"] for b in res[1]["bad"]] == [4]
    # Every rank's result is rank 1's: its op, its verdict.
    for x in res:
        b = x["bad"][0]
        assert (b["bad_ranks"], b["finding_rank"], b["verdict"], b["role"]) == ([1], 1, "reproduced", "input"), b
        assert (b["action"], b["op"]) == ("skip", "aten::add"), b  # the NaN embedding summed in bert.embeddings
    assert res[0]["finite"] and res[1]["finite"] and res[0]["checksum"] == res[1]["checksum"]
    assert len(events(tmp_path / "events.jsonl")) == len(events(tmp_path / "events.rank1.jsonl")) == 6


def test_bf16_autocast_log_of_zero_is_named(tmp_path):
    """bf16=True (accelerate's autocast on the CPU, no scaler): the replay
    runs the model's forward under the same autocast and names the op."""
    model = tiny_bert()
    cb = NanGuardCallback(policy="skip")
    train(tmp_path, model, [Plant(model, log0_at=2), cb], steps=5, bf16=True)
    assert [r.step for r in cb.bad_steps] == [3] and cb.bad_steps[0].finding.op == "aten::log", cb.bad_steps
    assert cb.scaler_skips == 0 and finite_params(model)


def test_the_event_log_has_the_norm_before_clipping_that_the_trainer_logs(tmp_path):
    """The Trainer clips by max_grad_norm before its callbacks see the
    gradients: the guard clips in its stead, so that the event log's
    grad_norm is the norm before clipping, as the Trainer's own log has it;
    the model trains as the Trainer alone trains it. (0.2: below this
    model's norms, 0.5 to 1.2, so that every step is clipped.)"""
    plain, guarded = tiny_bert(), tiny_bert()
    train(tmp_path, plain, max_grad_norm=0.2)
    cb = NanGuardCallback(event_log=tmp_path / "events.jsonl")
    trainer = train(tmp_path, guarded, [cb], max_grad_norm=0.2)
    logged = {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}
    lines = events(tmp_path / "events.jsonl")
    assert len(logged) == len(lines) == 8
    for line in lines:
        assert line["grad_norm"] == pytest.approx(logged[line["step"]], rel=1e-4)
        assert line["grad_norm"] > 0.4  # not the clipped 0.2
        assert line["clip_coef"] == pytest.approx(0.2 / line["grad_norm"], rel=1e-4)
    assert trainer.args.max_grad_norm == 0.2  # given back
    for a, b in zip(plain.parameters(), guarded.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_trainer_logs_the_guard_s_metrics_and_the_user_sees_each_bad_step(tmp_path):
    import warnings
    model = tiny_bert()
    cb = NanGuardCallback(policy="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train(tmp_path, model, [Plant(model, log0_at=3), cb])
    told = [str(w.message) for w in caught if issubclass(w.category, nanguard.NanGuardWarning)]
    assert len(told) == 2, told
    assert told[0].startswith("nanguard: step 4: ") and "skipped the step" in told[0]
    assert told[1].startswith("nanguard: 8 steps, 1 not taken (1 skipped); last bad step 4 ")
    history = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert [history[s]["nanguard/skipped_steps"] for s in range(1, 9)] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert history[3]["nanguard/last_cause"] == 0
    assert history[8]["nanguard/last_cause"] == nanguard._nanguard.cause_code(cb.bad_steps[0].finding.cause) >= 1
    assert history[8]["nanguard/loss_scale"] == 1.0 and history[8]["nanguard/rollbacks"] == 0
    assert history[8]["nanguard/grad_norm"] == pytest.approx(history[8]["grad_norm"], rel=1e-4)
    # The skipped step's own loss, not the Trainer's NaN filter's stand-in (0 right after a log).
    assert not math.isfinite(history[4]["loss"]) and not math.isfinite(cb.bad_steps[0].loss)
    assert all(math.isfinite(history[s]["loss"]) and history[s]["loss"] > 0 for s in (1, 2, 3, 5, 6, 7, 8))


def test_an_abort_leaves_no_hook_on_the_model_and_closes_the_guard(tmp_path):
    """train() stops on the abort's NonFiniteError, with no on_train_end:
    the callback's forward hook stayed on the model (holding the guard)
    and the guard stayed open. The aborted step is the callback's last and
    a bad one."""
    model = tiny_bert()
    cb = NanGuardCallback(policy="abort", event_log=tmp_path / "events.jsonl", verbose=False)
    with pytest.raises(nanguard.NonFiniteError, match="aten::log"):
        train(tmp_path, model, [Plant(model, log0_at=2), cb])
    assert not model._forward_hooks
    assert cb.guard.summary()["aborted"]
    assert cb.last is cb.bad_steps[-1] and cb.last.action == "abort"
    assert cb.last.step == cb.guard.summary()["steps"]  # the step it stopped at
    with pytest.raises(RuntimeError, match="the guard is closed"):
        cb.guard.begin_step()


@pytest.mark.parametrize("inside_a_step", [False, True])
def test_a_train_after_one_that_stopped_on_an_error_still_clips(tmp_path, inside_a_step):
    """An error stops train() with max_grad_norm handed to the guard (0 in
    the Trainer's arguments); the next train() took that 0 for the
    Trainer's own setting and clipped nothing. Raised inside a step (the
    model's forward), the error leaves the 0 and the forward hook to the
    next train() with the callback (the Trainer has no event for it)."""

    class Failing(transformers.TrainerCallback):
        armed = True

        def __init__(self, model):
            model.bert.embeddings.register_forward_hook(self.fail_in_the_forward)
            self.now = False

        def fail_in_the_forward(self, module, args, out):
            if inside_a_step and self.now:
                raise RuntimeError("a bug in a callback")

        def on_step_begin(self, args, state, control, **kwargs):
            self.now = self.armed and state.global_step == 2

        def on_step_end(self, args, state, control, **kwargs):
            if not inside_a_step and self.armed and state.global_step == 2:
                raise RuntimeError("a bug in a callback")

    model = tiny_bert()
    failing = Failing(model)
    cb = NanGuardCallback(event_log=tmp_path / "events.jsonl")
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=4, per_device_train_batch_size=4,
        learning_rate=1e-3, save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=0.2,
        dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=Embedded(), callbacks=[failing, cb])
    with pytest.raises(RuntimeError, match="a bug in a callback"):
        trainer.train()
    assert trainer.args.max_grad_norm == (0.0 if inside_a_step else 0.2)
    assert len(model._forward_hooks) == int(inside_a_step)  # the callback's
    failing.armed = False
    trainer.train()
    lines = events(tmp_path / "events.jsonl")
    assert len(lines) == 4 and all(l["grad_norm"] > 0.4 for l in lines)  # every step above 0.2
    for line in lines:
        assert line["clip_coef"] == pytest.approx(0.2 / line["grad_norm"], rel=1e-4)
    assert trainer.args.max_grad_norm == 0.2 and not model._forward_hooks


def test_an_error_between_steps_leaves_no_hook_and_gives_max_grad_norm_back(tmp_path):
    """An error the guard did not raise (the user's data collator, mid-run)
    stops train() with no on_train_end: the callback's forward hook stayed
    on the model and TrainingArguments.max_grad_norm read 0, so a Trainer
    built again from those arguments clipped nothing."""
    collated = []

    def collate(samples):
        collated.append(len(samples))
        if len(collated) == 4:
            raise RuntimeError("a bug in the collator")
        return torch.utils.data.default_collate(samples)

    model = tiny_bert()
    cb = NanGuardCallback(event_log=tmp_path / "events.jsonl", verbose=False)
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=6, per_device_train_batch_size=4,
        learning_rate=1e-3, save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=0.5,
        dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=Embedded(), data_collator=collate,
                                   callbacks=[cb])
    with pytest.raises(RuntimeError, match="a bug in the collator"):
        trainer.train()
    assert [l["step"] for l in events(tmp_path / "events.jsonl")] == [1, 2]  # it stopped between steps
    assert not model._forward_hooks
    assert trainer.args.max_grad_norm == 0.5


def test_the_loss_of_an_accumulated_causal_lm_step_is_the_one_the_trainer_logs(tmp_path):
    """With gradient accumulation the Trainer passes a causal LM the window's
    token count (num_items_in_batch): each micro-batch's loss is its share
    of the window's mean, and they add up to the step's loss. Their mean
    logged half of it with two micro-batches."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": i, "labels": i.clone()} for i in ids]
    cb = NanGuardCallback(event_log=tmp_path / "events.jsonl")
    trainer = train(tmp_path, model, [cb], steps=4, data=data, gradient_accumulation_steps=2)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    lines = events(tmp_path / "events.jsonl")
    assert [l["loss"] for l in lines] == pytest.approx(logged, rel=1e-5)
    assert all(l > 3.5 for l in logged)  # about log(64): a half would read 2.1


def test_a_second_train_with_the_callback_is_a_run_of_its_own(tmp_path):
    """The second train() rewrote the event log while bad_steps kept the
    first run's bad step too: the two disagreed. Both describe the latest
    run."""
    cb = NanGuardCallback(policy="skip", event_log=tmp_path / "events.jsonl", verbose=False)
    first = tiny_bert()
    train(tmp_path, first, [Plant(first, log0_at=3), cb], steps=6)
    assert [r.step for r in cb.bad_steps] == [4]
    second = tiny_bert()
    train(tmp_path, second, [Plant(second, log0_at=1), cb], steps=4)
    lines = events(tmp_path / "events.jsonl")
    assert [l["step"] for l in lines] == [1, 2, 3, 4]
    assert [r.step for r in cb.bad_steps] == [l["step"] for l in lines if l["skipped"]] == [2]
    summary = cb.guard.summary()
    assert (summary["steps"], summary["not_taken"], cb.last.step) == (4, 1, 4)


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def test_a_nan_that_reaches_only_the_cache_of_a_forward_only_pass_is_judged():
    """A forward with no backward is judged by what reaches its outputs; the
    DynamicCache a causal LM returns (the keys and values the next forward
    of a generation reads) was no output to torch's pytree, and a NaN born
    into it alone was dropped as absorbed."""
    model = tiny_gpt2()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad(), nanguard.trace(model) as t:
        model.generate(ids, max_new_tokens=3, do_sample=False)
    assert t.findings == []  # healthy: the causal mask's -inf reaches neither the logits nor the cache

    def poison_the_last_layer_s_values(module, args, out):
        cache = next(v for v in out.values() if isinstance(v, transformers.Cache))
        values = cache.layers[-1].values
        values.add_(torch.log(-torch.ones_like(values[..., :1])))  # log(-1): NaN, after the attention read them

    model.transformer.register_forward_hook(poison_the_last_layer_s_values)
    with torch.no_grad(), nanguard.trace(model) as t:
        out = model(ids, use_cache=True)
    assert out.logits.isfinite().all() and not out.past_key_values.layers[-1].values.isfinite().all()
    f = t.findings[0] if t.findings else None
    # Run by a forward hook of model.transformer, after its forward returned
    # (the trace's global hooks close its scope first): named by its line.
    assert f is not None and (f.op, f.role, f.function) == ("aten::log", "producer", "poison_the_last_layer_s_values"), f
