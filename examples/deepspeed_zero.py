"""Record a DeepSpeed ZeRO run (stage 1, 2 or 3) with trainrec's TrainerMon, on CPU.

    MONITOR_OUTPUT_DIR=ds_output python examples/deepspeed_zero.py --stage 2 --ranks 2 --steps 10
    trainrec inspect ds_output

Starts ``--ranks`` processes itself (torch.distributed over gloo, DeepSpeed's CPU accelerator), so
it needs no launcher; under ``deepspeed``/``torchrun`` the part in :func:`train` is what goes into a
training script. The lines that matter, as the reference documents them for DeepSpeed::

    TrainerMon.set_wrapped_optimizer(engine.optimizer)
    monitor.monitor_gnorm_with_ad(engine.module, grad_acc_steps=..., optimizer=engine.optimizer.optimizer)

Each rank writes its own log. Weight gradients before reduction are each rank's own; reduced
gradients and Adam state are the rank's pieces of DeepSpeed's flat partitions (under ZeRO 3 the
parameters too). The model is ``plain_loop.py``'s small transformer, with two param groups (decay
for weights, none for biases and norms), as HF's Trainer makes them.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.multiprocessing as mp
import torch.nn as nn
from plain_loop import HERE, SmallLM, batches


def train(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import deepspeed
    from trainrec.recorder import TrainerMon

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(args.seed)
    model = SmallLM()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=3e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": args.grad_acc,
        "zero_optimization": {"stage": args.stage}})
    monitor = TrainerMon(args.config, params_have_main_grad=False)
    # DeepSpeed's own optimizer, named as the reference does for mixed precision: with fp16, its overflow
    # flag tells every rank alike which steps DeepSpeed skipped, the run's first included (README; without
    # this line the monitor finds it as what holds engine.optimizer.optimizer)
    TrainerMon.set_wrapped_optimizer(engine.optimizer)
    monitor.monitor_gnorm_with_ad(engine.module, grad_acc_steps=args.grad_acc, optimizer=engine.optimizer.optimizer)
    data = batches(512, 8, 32, seed=args.seed + rank)
    for step in range(args.steps):
        for _ in range(args.grad_acc):
            x, y = next(data)
            loss = nn.functional.cross_entropy(engine(x).flatten(0, 1), y.flatten())
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    monitor.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3), help="ZeRO stage (default 2)")
    p.add_argument("--ranks", type=int, default=2, help="processes (default 2)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--grad-acc", type=int, default=1, help="micro batches per optimizer step")
    p.add_argument("--config", default=os.path.join(HERE, "monitor_config.json"), help="monitor config JSON")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(train, args=(args.ranks, port, args), nprocs=args.ranks, start_method="spawn")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
