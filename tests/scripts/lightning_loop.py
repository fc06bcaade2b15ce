"""Lightning's Trainer on the GPU with bf16 mixed precision."""
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


data = DataLoader(TensorDataset(torch.randn(256, 128), torch.randint(0, 10, (256,))),
                  batch_size=32)
trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=1,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(Classifier(), data)
