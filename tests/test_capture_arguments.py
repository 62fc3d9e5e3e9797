import torch
from torch import nn

from graphamp.capture.values import capture_by_values


class DictInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, data: dict, scale: torch.Tensor, *, shift: torch.Tensor) -> torch.Tensor:
        return self.lin(data["x"]) * scale + data["y"].sum() + shift


def test_the_capture_on_values_takes_the_models_own_arguments():
    # One argument is a dict of tensors: the graph is called as the model is (e3nn's gate_points
    # networks take a dict), not with the dict's tensors as separate arguments.
    torch.manual_seed(0)
    model = DictInput()
    data, scale, shift = {"x": torch.randn(2, 3), "y": torch.randn(5)}, torch.randn(4), torch.randn(4)
    gm = capture_by_values(model, (data, scale), {"shift": shift}, device_type="cpu", dtype=torch.bfloat16, grads=False)
    assert torch.equal(gm(data, scale, shift=shift), model(data, scale, shift=shift))
