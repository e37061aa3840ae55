"""`trainrec.integrations.lightning.TrainrecCallback` with Lightning's real `Trainer` on CPU: automatic
optimization with gradient accumulation, manual optimization with two optimizers, and
`fit(ckpt_path=...)` appending to the same run."""

from __future__ import annotations

import os

import numpy as np
import pytest

L = pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from trainrec.integrations.lightning import TrainrecCallback  # noqa: E402
from trainrec.replay import open_run  # noqa: E402
from trainrec.replay.rows import value_matrix  # noqa: E402

# Lightning's advice for real runs (dataloader workers, logging intervals), and its own use of an API
# torch 2.13 deprecates: not errors here
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\).*:FutureWarning"),
              pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
              pytest.mark.filterwarnings("ignore:.*number of training batches.*"),
              pytest.mark.filterwarnings("ignore:.*GPU available but not used.*")]


class Net(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)
        self.automatic_optimization = not manual
        self.grad_norms: list[dict] = []  # per optimizer step: the gradients it is about to apply

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.body(x)), y)
        if self.automatic_optimization:
            return loss
        opt_body, opt_head = self.optimizers()
        self.manual_backward(loss)
        self.grad_norms.append({n: float(p.grad.norm()) for n, p in self.named_parameters()})
        opt_head.step()  # the head's optimizer steps first: the step still begins before any update
        opt_body.step()
        opt_body.zero_grad()
        opt_head.zero_grad()
        return None

    def on_before_optimizer_step(self, optimizer):
        if self.automatic_optimization:  # (Lightning calls it for manual steps too: taken above)
            self.grad_norms.append({n: float(p.grad.norm()) for n, p in self.named_parameters()})

    def configure_optimizers(self):
        if self.automatic_optimization:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        return torch.optim.AdamW(self.body.parameters(), lr=1e-2), torch.optim.SGD(self.head.parameters(), lr=1e-2)


def _data(samples: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=False)


def _trainer(callbacks, root, steps: int, accumulate: int = 1, checkpoint: bool = False):
    extra = []
    if checkpoint:  # at every epoch's end (a resume mid-epoch would not skip the batches already seen)
        extra.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_epochs=1,
                                                         save_on_train_epoch_end=True, save_top_k=-1, filename="{step}"))
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulate,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=checkpoint, callbacks=[*callbacks, *extra],
                     default_root_dir=str(root))


def _norms(run, kind: str) -> dict:
    out = {}
    for ev, names in run.stats([kind]):
        norm = value_matrix(ev)[:, ev.ops.index("norm")]
        micro = np.frombuffer(ev.micro_steps, "<u2") if ev.micro_steps else np.zeros(len(ev), int)
        for name, m, v in zip(names, micro.tolist(), norm.tolist(), strict=True):
            out[(ev.step, name, m)] = v
    return out


CONFIG = {"wg_distribution": True, "mv_distribution": True, "ops": ["norm", "max"]}


def test_automatic_optimization_with_accumulation_records_what_the_optimizer_applies(tmp_path):
    model = Net()
    cb = TrainrecCallback(CONFIG, output_dir=str(tmp_path / "out"))
    _trainer([cb], tmp_path, steps=3, accumulate=2).fit(model, _data())
    run = open_run(str(tmp_path / "out"))
    red = _norms(run, "grad_reduced")
    assert len(model.grad_norms) == 3 and {k[0] for k in red} == {0, 1, 2}
    for step, grads in enumerate(model.grad_norms):
        for name, norm in grads.items():
            assert red[(step, name, 0)] == pytest.approx(norm, rel=1e-5)
    assert {k[2] for k in _norms(run, "grad_unreduced")} == {0, 1}
    assert {k[0] for k in _norms(run, "exp_avg")} == {0, 1, 2}


def test_manual_optimization_with_two_optimizers(tmp_path):
    model = Net(manual=True)
    cb = TrainrecCallback(CONFIG, output_dir=str(tmp_path / "out"))
    _trainer([cb], tmp_path, steps=6).fit(model, _data())  # global_step counts both optimizers' steps
    run = open_run(str(tmp_path / "out"))
    red = _norms(run, "grad_reduced")
    assert len(model.grad_norms) == 3 and {k[0] for k in red} == {0, 1, 2}
    for step, grads in enumerate(model.grad_norms):
        for name, norm in grads.items():
            assert red[(step, name, 0)] == pytest.approx(norm, rel=1e-5)
    assert {k[1] for k in _norms(run, "exp_avg")} == {"body.0.weight", "body.0.bias"}  # AdamW's only


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # (resuming into it)
def test_fit_from_a_checkpoint_appends_to_the_same_run(tmp_path):
    first = TrainrecCallback(CONFIG, output_dir=str(tmp_path / "out"))
    _trainer([first], tmp_path, steps=4, checkpoint=True).fit(Net(), _data(8))  # 2 steps per epoch
    before = _norms(open_run(str(tmp_path / "out")), "grad_reduced")
    ckpt = tmp_path / "ckpt" / "step=2.ckpt"
    assert ckpt.is_file() and {k[0] for k in before} == {0, 1, 2, 3}
    second, resumed = TrainrecCallback(CONFIG, output_dir=str(tmp_path / "out")), Net()
    _trainer([second], tmp_path, steps=4, checkpoint=True).fit(resumed, _data(8), ckpt_path=str(ckpt))
    assert os.path.dirname(second.log_path) == os.path.dirname(first.log_path)
    run = open_run(str(tmp_path / "out"))
    after = _norms(run, "grad_reduced")
    assert len(run.files(0)) == 2 and sum(run.superseded.values()) > 0
    assert set(after) == set(before)  # steps 0..3 once each
    # steps 0 and 1 are the first launch's, 2 and 3 the resumed launch's own (Lightning does not replay
    # the second epoch's batches as the first launch saw them: its gradients are not those of before)
    assert len(resumed.grad_norms) == 2
    for (step, name, micro), norm in after.items():
        if step < 2:
            assert norm == before[(step, name, micro)]
        else:
            assert norm == pytest.approx(resumed.grad_norms[step - 2][name], rel=1e-5)


def test_with_pytorch_lightning_imported_first_the_callback_is_its_own(tmp_path):
    """The older package: its Trainer takes only its own Callback subclasses."""
    pytest.importorskip("pytorch_lightning")
    import subprocess
    import sys

    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import pytorch_lightning as pl, torch\n"
        "from torch import nn\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from trainrec.integrations.lightning import TrainrecCallback\n"
        "from trainrec.replay import open_run\n"
        "assert 'lightning' not in __import__('sys').modules\n"
        "class Net(pl.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.lin = nn.Linear(4, 1)\n"
        "    def training_step(self, batch, i):\n"
        "        return nn.functional.mse_loss(self.lin(batch[0]), batch[1])\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "x = torch.randn(16, 4)\n"
        f"cb = TrainrecCallback({{'wg_distribution': True, 'ops': ['norm']}}, output_dir={str(tmp_path / 'out')!r})\n"
        "pl.Trainer(accelerator='cpu', devices=1, max_steps=3, logger=False, enable_progress_bar=False,\n"
        "           enable_model_summary=False, enable_checkpointing=False, callbacks=[cb]).fit(\n"
        "    Net(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4))\n"
        f"print(sorted({{ev.step for ev, _ in open_run({str(tmp_path / 'out')!r}).stats(['grad_reduced'])}}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[0, 1, 2]"
