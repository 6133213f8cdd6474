"""A training script written for Horovod, running on byteps by changing one import line.

Everything below is the horovod.torch idiom (pytorch_mnist.py style): hvd.init, DistributedSampler
with hvd.size()/hvd.rank(), lr scaled by hvd.size(), broadcast_parameters, broadcast_optimizer_state,
DistributedOptimizer(named_parameters=..., compression=..., backward_passes_per_step=..., op=...),
the synchronize()/skip_synchronize() gradient-clipping idiom, and hvd.allreduce of a metric.

    bpslaunch --local --workers 2 --servers 2 -- python examples/train_horovod_style.py
    torchrun --standalone --nproc_per_node=2 examples/train_horovod_style.py

The data is synthetic (a 10-class problem from a fixed random teacher), so nothing is downloaded.
At the end every worker checks that its parameters are bit-identical to rank 0's; the script exits
with status 1 otherwise.
"""
import argparse

import torch
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import byteps.torch as hvd  # was: import horovod.torch as hvd


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def synthetic_dataset(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    teacher = torch.randn(20, 10, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False)
    parser.add_argument("--batches-per-allreduce", type=int, default=1)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed + hvd.rank())  # different inits on purpose: broadcast_parameters fixes them
    torch.set_num_threads(1)

    train_dataset = synthetic_dataset(2048)
    train_sampler = DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size * args.batches_per_allreduce,
                              sampler=train_sampler)

    model = Net()
    lr_scaler = args.batches_per_allreduce * hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, backward_passes_per_step=args.batches_per_allreduce,
                                         op=hvd.Average)

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        total, correct, loss_sum = 0, 0, 0.0
        for data, target in train_loader:
            optimizer.zero_grad()
            for i in range(0, len(data), args.batch_size):
                data_batch, target_batch = data[i:i + args.batch_size], target[i:i + args.batch_size]
                output = model(data_batch)
                loss = F.nll_loss(output, target_batch)
                loss.div_(args.batches_per_allreduce)
                loss.backward()
                loss_sum += loss.item() * args.batches_per_allreduce * len(data_batch)
                correct += (output.argmax(dim=1) == target_batch).sum().item()
                total += len(data_batch)
            if args.clip > 0:
                optimizer.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
        train_loss = metric_average(loss_sum / total, "avg_loss")
        train_acc = metric_average(correct / total, "avg_accuracy")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {train_loss:.4f}  accuracy {100 * train_acc:.1f}%  ({hvd.size()} workers)",
                  flush=True)

    # every worker must hold rank 0's parameters, bit for bit
    differ = 0
    for name, p in model.state_dict().items():
        ref = hvd.broadcast(p, root_rank=0, name=f"check.{name}")
        differ += int(not torch.equal(ref, p))
    differ = int(hvd.allreduce(torch.tensor(differ), op=hvd.Sum, name="check.differ").item())
    if hvd.rank() == 0:
        print("final parameters identical on all workers" if differ == 0 else
              f"FAILED: {differ} parameter tensors differ across workers", flush=True)
    hvd.shutdown()
    raise SystemExit(0 if differ == 0 else 1)


if __name__ == "__main__":
    main()
