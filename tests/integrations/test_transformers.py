"""`trainrec.integrations.transformers.TrainrecCallback` with HF's real `Trainer` on CPU (a 2-layer GPT-2
made from its config, nothing downloaded): gradient accumulation, accelerate's optimizer wrapper, and
`train(resume_from_checkpoint=...)` appending to the same run."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

from trainrec.integrations.transformers import TrainrecCallback  # noqa: E402
from trainrec.replay import open_run  # noqa: E402
from trainrec.replay.rows import value_matrix  # noqa: E402
from trainrec.schema.events import RunResumed  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch):
    """accelerate keeps process-wide singletons (each Trainer makes its own Accelerator)."""
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _trainer(callbacks, output_dir: str, steps: int, grad_acc: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(64):
        ids = torch.randint(0, 64, (16,), generator=g)
        data.append({"input_ids": ids, "labels": ids})
    args = TrainingArguments(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=grad_acc, learning_rate=1e-3, use_cpu=True,
                             report_to=[], save_strategy="steps", save_steps=2, logging_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0, seed=0)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def _stats(run, kind: str) -> dict:
    """{(step, name, micro_step): norm} of ``kind``."""
    out = {}
    for ev, names in run.stats([kind]):
        norm = value_matrix(ev)[:, ev.ops.index("norm")]
        micro = np.frombuffer(ev.micro_steps, "<u2") if ev.micro_steps else np.zeros(len(ev), int)
        for name, m, v in zip(names, micro.tolist(), norm.tolist(), strict=True):
            out[(ev.step, name, m)] = v
    return out


@pytest.mark.parametrize("as_file", [False, True], ids=["config dict", "config path"])
def test_one_line_records_every_step_with_accumulation_and_a_resume_appends(tmp_path, as_file):
    out = tmp_path / "trainrec"
    config = {"wg_distribution": True, "mv_distribution": True, "ops": ["norm", "max"]}
    if as_file:
        (tmp_path / "monitor_config.json").write_text(json.dumps(config))
        config = str(tmp_path / "monitor_config.json")
    first = TrainrecCallback(config, output_dir=str(out))
    trainer = _trainer([first], str(tmp_path / "hf"), steps=4)
    trainer.train()
    assert type(trainer.optimizer).__name__ == "AcceleratedOptimizer"
    run = open_run(str(out))
    before = _stats(run, "grad_reduced")
    assert {k[0] for k in before} == {0, 1, 2, 3}
    assert {k[2] for k in _stats(run, "grad_unreduced")} == {0, 1}  # both micro steps of every step
    assert {k[0] for k in _stats(run, "exp_avg")} == {0, 1, 2, 3}
    assert os.path.isfile(tmp_path / "hf" / "checkpoint-2" / "trainrec-rank0.json")

    # a new process would build everything again: a new Trainer, a new callback, resumed at step 2
    second = TrainrecCallback(config, output_dir=str(out))
    _trainer([second], str(tmp_path / "hf"), steps=4).train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-2"))
    assert os.path.dirname(second.log_path) == os.path.dirname(first.log_path)  # the same rank directory
    run = open_run(str(out))
    assert len(run.files(0)) == 2
    resumed = [ev for ev in run.events(types="rr")]
    assert len(resumed) == 1 and isinstance(resumed[0], RunResumed) and resumed[0].step == 2
    after = _stats(run, "grad_reduced")
    assert set(after) == set(before)  # steps 0..3 once each: the first launch's 2 and 3 are superseded
    assert sum(run.superseded.values()) > 0
    # the resumed launch trained the same steps from the same checkpoint: the same gradients
    for key, norm in before.items():
        assert after[key] == pytest.approx(norm, rel=1e-4, abs=1e-7)

