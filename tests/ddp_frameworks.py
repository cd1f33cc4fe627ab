"""Lightning's DDP strategy and the transformers Trainer (accelerate) over two gloo ranks on
the CPU, each with this project's callback: the integrations must watch the DDP module the
framework wrapped the model in, and push its gradient communication.

``python -m torch.distributed.run --nproc-per-node 2 tests/ddp_frameworks.py transformers URL``
(transformers reads torchrun's environment), or ``python tests/ddp_frameworks.py lightning
URL`` (Lightning starts its second rank itself, re-running this script). ``lightning URL
hang``: rank 1's DataLoader never starts its second epoch (its first read blocks), while rank
0 goes on into that epoch's first all-reduce.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

WIDTH = 256  # gradients of 4 x 256 x 257 floats: plenty to all-reduce, little to compute
HANG = {"now": False}  # lightning ... hang: this rank's next read never returns


class Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if HANG["now"]:
            time.sleep(1e9)
        return {"x": torch.randn(WIDTH), "labels": torch.randn(WIDTH)}


def lightning(url: str, hang: bool = False) -> None:
    import lightning.pytorch as pl

    from exporter.client.lightning import GpuTrainCallback

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch["x"]), batch["labels"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Hang(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            HANG["now"] = hang and trainer.current_epoch == 1 and trainer.global_rank == 1

    # 8 steps an epoch (64 samples, 4 a batch, 2 ranks): the 12 end in the second
    trainer = pl.Trainer(
        max_steps=12, accelerator="cpu", devices=2, strategy="ddp", logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=tempfile.mkdtemp(),
        callbacks=[GpuTrainCallback(run="pl-hang" if hang else "pl-ddp", endpoint=url,
                                    push_interval=0.5), Hang()])
    trainer.fit(Model(), torch.utils.data.DataLoader(Data(), batch_size=4))


def transformers(url: str) -> None:
    import transformers as hf

    from exporter.client.transformers import GpuTrainCallback

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    args = hf.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=12,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        ddp_backend="gloo", remove_unused_columns=False)
    trainer = hf.Trainer(model=Model(), args=args, train_dataset=Data(),
                         callbacks=[GpuTrainCallback(run="hf-ddp", endpoint=url,
                                                     push_interval=0.5)])
    trainer.train()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if sys.argv[1] == "lightning":
        lightning(sys.argv[2], hang=sys.argv[3:] == ["hang"])
    else:
        transformers(sys.argv[2])
