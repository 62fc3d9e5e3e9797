import pytest
import torch

from graphamp import zoo


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def build_case(name: str, *, train: bool | None = None) -> zoo.Case:
    """A zoo model; transformers models skip cleanly when transformers is missing."""
    if name in zoo.TRANSFORMERS_MODELS:
        pytest.importorskip("transformers")
    case = zoo.build(name)
    if train is not None:
        case.model.train(train)
    return case
