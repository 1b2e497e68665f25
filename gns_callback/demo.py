"""Demo: train a small MLP on scikit-learn's bundled digits (real data, offline) and print B_simple.

    python -m gns_callback demo [--epochs 5] [--batch-size 32] [--method auto]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F


def _digits_loaders(batch_size: int, seed: int):
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - scikit-learn is in the demo/test extras
        raise SystemExit("The demo needs scikit-learn: pip install 'gns_callback[demo]'") from err
    from torch.utils.data import DataLoader, TensorDataset

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=generator)
    train, val = order[:1500], order[1500:]
    return (
        DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True, generator=generator),
        DataLoader(TensorDataset(x[val], y[val]), batch_size=256),
    )


def _lightning():
    """The installed Lightning namespace (``pytorch_lightning``, else ``lightning.pytorch``)."""
    from gns_callback.lightning.compat import MODULES

    return MODULES[0]


def _module(lr: float):
    pl = _lightning()

    class DigitsMLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), prog_bar=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)

    return DigitsMLP()


def main(argv: list[str] | None = None) -> None:
    from gns_callback import GradientNoiseScaleCallback

    from gns_callback.arguments import positive_float_option, positive_int_option

    parser = argparse.ArgumentParser(prog="python -m gns_callback demo", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=positive_int_option, default=5, help="training epochs")
    parser.add_argument("--batch-size", type=positive_int_option, default=32, help="examples per backward pass")
    parser.add_argument("--lr", type=positive_float_option, default=0.05, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--method", default="auto", choices=["auto", "micro_batch", "per_example"],
                        help="how the small-batch norms are measured (README, Methods)")
    parser.add_argument("--accumulate", type=positive_int_option, default=1, help="accumulate_grad_batches")
    parser.add_argument("--seed", type=int, default=0, help="data split, order and initial weights")
    parser.add_argument("--no-probe", action="store_true", help="skip the memory/throughput probe (about 2 s)")
    parser.add_argument("--out", default=None, help="log dir; None: a temporary directory")
    args = parser.parse_args(argv)
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out} is a file: pass a folder for the logs and the report")

    pl = _lightning()
    pl.seed_everything(args.seed, verbose=False)
    train, val = _digits_loaders(args.batch_size, args.seed)
    out = args.out or tempfile.mkdtemp(prefix="gns_demo_")
    gns = GradientNoiseScaleCallback(
        method=args.method, ema_decay=0.95, log_every_n_steps=10, verbose=False, probe=not args.no_probe
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        callbacks=[gns],
        default_root_dir=out,
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    trainer.fit(_module(args.lr), train, val)

    est, run = gns.estimate, gns.run_estimate
    batch = args.batch_size * args.accumulate
    print()
    print(f"Digits MLP, batch size {batch}, {args.epochs} epochs, val_acc = {trainer.callback_metrics['val_acc']:.3f}")
    print(f"  recent       : {est}")
    print(f"  run average  : {run}")
    if run.steps and run.b_simple < float("inf"):
        ratio = run.b_simple / batch
        print(
            f"  B_simple/batch = {ratio:.2f}: one step at batch {batch} is worth ~{1 / (1 + run.b_simple / batch):.2f} "
            f"of a noise-free step (S/S_min = 1 + B_noise/B, McCandlish et al. 2018); batches up to ~B_simple "
            f"cut the number of steps almost proportionally, larger ones mostly add compute."
        )
    if gns.recommendation is not None:
        print()
        print(gns.recommendation.summary_table())
    print(f"  report: {gns.report_file}  (pictures: python -m gns_callback report {gns.report_file})")


if __name__ == "__main__":
    main()
