"""The Lightning helper tunes what Lightning runs: Lightning 2.6's fit loop calls no train(),
so an eval-mode submodule (a frozen pretrained backbone, a BatchNorm left in eval) trains in
eval mode; the trials run it so too (tune(keep_modes=True)), and the modes are as they were
afterwards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")


class Classifier(L.LightningModule):  # type: ignore[misc, name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 4
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        from torch.utils.data import DataLoader, TensorDataset

        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,),
                                                                            generator=g))
        return DataLoader(data, batch_size=self.batch_size)


def test_lightning_callback_runs_the_modes_lightning_trains_in() -> None:
    from tilefit.tuning.integrations.lightning import tilefit_batch_size_finder

    torch.manual_seed(0)
    module = Classifier()
    module.net.eval()  # a pretrained backbone, as from_pretrained returns it
    seen: list[bool] = []
    module.net[1].register_forward_pre_hook(lambda mod, args: seen.append(mod.training))
    finder = tilefit_batch_size_finder(max_batch=8)
    trainer = L.Trainer(max_steps=1, callbacks=[finder], logger=False, accelerator="cpu",
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module)
    assert finder.result is not None and finder.result.trials
    # Lightning's own step (the last call) ran the submodule in the eval mode the user left;
    # tune's trials (every call before it) ran it the same way
    assert len(seen) > 1 and seen[-1] is False and not any(seen)
    assert not module.net.training and module.training
