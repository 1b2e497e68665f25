"""Cases for the coverage audit: digits CNN, digits EmbeddingBag (mean, sum), control (small B_simple/B)."""
import torch, numpy as np
import torch.nn.functional as F
from torch import nn
from sklearn.datasets import load_digits

torch.set_num_threads(1)

def data():
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    levels = torch.tensor(d.data, dtype=torch.long)  # 0..16 -> 17 levels
    tokens = torch.arange(64).unsqueeze(0) * 17 + levels  # (N, 64) token ids in [0, 1088)
    return x, tokens, y

class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3); self.fc = nn.Linear(8 * 6 * 6, 10)
    def forward(self, x):
        return self.fc(F.relu(self.conv(x.view(-1, 1, 8, 8))).flatten(1))

class Bag(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.emb = nn.EmbeddingBag(64 * 17, 16, mode=mode); self.fc = nn.Linear(16, 10)
    def forward(self, t):
        return self.fc(torch.tanh(self.emb(t)))

def pretrain(model, inputs, labels, steps, lr, batch=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(0, len(labels), (batch,), generator=g)
        opt.zero_grad(); F.cross_entropy(model(inputs[idx]), labels[idx]).backward(); opt.step()
    for p in model.parameters():
        p.grad = None
    return model

# name -> (builder, uses tokens, pretrain steps, lr)
CASES = {
    "cnn": (lambda: CNN(), False, 5500, 0.1),
    "bag_mean": (lambda: Bag("mean"), True, 3000, 0.5),
    "bag_sum": (lambda: Bag("sum"), True, 1500, 0.05),
    "cnn10k": (lambda: CNN(), False, 10000, 0.1),  # for B=64: the subset (16 of 64) is measured
    "cnn_init": (lambda: CNN(), False, 5, 0.1),   # control: small B_simple/B
}

def build(name):
    builder, tok, steps, lr = CASES[name]
    x, t, y = data()
    inputs = t if tok else x
    torch.manual_seed(0)
    model = builder()
    pretrain(model, inputs, y, steps, lr)
    return model, inputs, y
