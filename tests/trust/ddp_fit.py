"""One fit on 2 CPU processes (gloo) with the callback at its defaults (no ``report_path``).

Importable (``strategy="ddp_spawn"`` inside pytest) and a script for ``strategy="ddp"``, which re-executes the
command line in each process: ``python -m tests.trust.ddp_fit <root> <model> <logger 0|1> <callback 0|1> <steps>``
writes ``<root>/result.json`` from rank 0.
"""

from __future__ import annotations

import glob
import json
import sys

import torch
from sklearn.datasets import load_digits

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, mlp, quiet_trainer
from tests.trust.models import (BatchCentred, LayerUsedOutside, LinearOnLearnedTable, LinearTwice, PixelPositions,
                                PixelRelativeBias, seeded_hand_written, seeded_vit, trained_pixel_tokens)

MODELS = {"mlp": mlp, "linear_on_table": LinearOnLearnedTable, "linear_twice": LinearTwice,
          "pixel_tokens": trained_pixel_tokens, "batch_centred": BatchCentred, "vit": seeded_vit,
          "hand_written": seeded_hand_written, "position_table": PixelPositions, "relative_bias": PixelRelativeBias,
          "layer_used_outside": LayerUsedOutside}
BATCH_SIZE = 16  # per rank


class OneThread(Classifier):
    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # each process: tiny model on a shared CPU


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)


def ddp_fit(root: str, strategy: str, model: str, logger: bool, with_callback: bool, steps: int, **callback_kwargs):
    """Each rank draws its own with-replacement stream (seeded by rank); returns the trainer. ``callback_kwargs``:
    beside the defaults (none by default)."""
    x, y = digits()
    loader_args = {"x": x, "y": y, "batch_size": BATCH_SIZE, "num_samples": steps * BATCH_SIZE, "seed": 1}
    callbacks = [GradientNoiseScaleCallback(**callback_kwargs)] if with_callback else []
    trainer = quiet_trainer(strategy=strategy, devices=2, use_distributed_sampler=False, logger=logger,
                            default_root_dir=root, callbacks=callbacks)
    trainer.fit(OneThread(MODELS[model](), loader_args=loader_args))
    return trainer


def reports(root: str) -> list[str]:
    return sorted(glob.glob(f"{root}/**/gns_report.json", recursive=True))


if __name__ == "__main__":
    root, model, logger, with_callback, steps = sys.argv[1:6]
    trainer = ddp_fit(root, "ddp", model, logger == "1", with_callback == "1", int(steps))
    if trainer.is_global_zero:
        callback = next((cb for cb in trainer.callbacks if isinstance(cb, GradientNoiseScaleCallback)), None)
        with open(f"{root}/result.json", "w") as f:
            json.dump({"global_step": trainer.global_step, "reports": reports(root),
                       "report_file": callback.report_file if callback else None}, f)
