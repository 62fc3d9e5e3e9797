import torch
import torch.nn.functional as F
from torch import nn

import graphamp


class InterpolateThenEinsum(nn.Module):
    """F.interpolate (bilinear: a composite whose decomposition reads the batch size as an int),
    then an einsum over the batch: LookViT's pattern (vit-pytorch)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.interpolate(x, size=(2, 2), mode="bilinear", align_corners=False)
        y = y.flatten(2).transpose(1, 2)
        return torch.einsum("bij,bkj->bik", self.proj(y), y)


def test_sizes_a_decomposition_fixed_are_guarded():
    torch.manual_seed(0)
    model = InterpolateThenEinsum()
    amp = graphamp.convert(model, (torch.randn(2, 8, 4, 4),), dtype=torch.bfloat16)
    for batch in (3, 1, 2, 4):
        x = torch.randn(batch, 8, 4, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(x)
        got = amp(x)
        assert got.dtype == expected.dtype and torch.equal(got, expected), batch
