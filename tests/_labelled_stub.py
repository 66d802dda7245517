"""A class-conditional stand-in for a model, cheap and exact enough to check guidance formulas against: shared by
the tests of classifier-free guidance and of autoguidance."""

import torch
from torch import nn

NUM_CLASSES = 10


class LabelledStub(nn.Module):
    """A class-conditional "model" of element-wise ops (so a doubled batch gives bit-identical rows) whose every
    output channel depends on x, t and y; it records the batches it is called with."""

    def __init__(self, in_channels: int = 4, learn_sigma: bool = True):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = 2 * in_channels if learn_sigma else in_channels
        self.calls: list[tuple[int, torch.Tensor]] = []

    def forward(self, x, t, y):
        self.calls.append((x.shape[0], y.clone()))
        channel = torch.arange(self.out_channels, dtype=x.dtype).view(1, -1, 1, 1)
        x = x.repeat(1, self.out_channels // x.shape[1], 1, 1)  # (B, C_out, H, W)
        return (channel + 1) * x + 0.3 * y.view(-1, 1, 1, 1) * (channel - 2) + 0.01 * t.view(-1, 1, 1, 1)


def stub_inputs(batch: int = 5):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, 3, 3, generator=generator)
    t = torch.linspace(0.1, 0.9, batch)
    y = torch.randint(0, NUM_CLASSES, (batch,), generator=generator)
    return x, t, y
