"""Record a small CPU training run with trainrec's msprobe-compatible TrainerMon.

    MONITOR_OUTPUT_DIR=demo_output python examples/plain_loop.py --steps 30
    trainrec inspect demo_output

A small transformer language model (embedding, 2 encoder layers, linear head) learns to predict the
next token of random sequences with a repeating pattern; AdamW; gradient accumulation optional. The
monitor is configured by ``examples/monitor_config.json`` (activations of every module, weight
gradients, parameters, Adam state, update/ratio; all six statistics) unless ``--config`` says
otherwise. The log goes to ``$MONITOR_OUTPUT_DIR`` (default ``./monitor_output``), with the reference's
CSV files beside it, written during training (the config's ``format`` is ``csv``).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.nn as nn
from trainrec.recorder import TrainerMon

HERE = os.path.dirname(os.path.abspath(__file__))


class SmallLM(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


def batches(vocab: int, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        x = (start + torch.arange(seq + 1) * 7) % vocab  # a learnable pattern
        yield x[:, :-1], x[:, 1:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--config", default=os.path.join(HERE, "monitor_config.json"), help="monitor config JSON")
    p.add_argument("--grad-acc", type=int, default=1, help="micro batches per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.manual_seed(args.seed)

    model = SmallLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor = TrainerMon(args.config, params_have_main_grad=False)
    monitor.monitor_gnorm_with_ad(model, grad_acc_steps=args.grad_acc, optimizer=optimizer)

    data = batches(512, 8, 32, args.seed)
    t0 = time.perf_counter()
    for step in range(args.steps):
        for _ in range(args.grad_acc):
            x, y = next(data)
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.grad_acc
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item() * args.grad_acc:.4f}")
    monitor.close()
    print(f"{args.steps} steps in {time.perf_counter() - t0:.1f} s; log: {monitor.log_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
