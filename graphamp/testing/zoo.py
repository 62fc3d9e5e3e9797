"""Built-in models, built from small configs with random weights (no download).

Each entry builds a :class:`Case`: the model, example inputs, and a way to make inputs of other
batch and sequence sizes. The tests, ``graphamp convert-demo`` and ``graphamp bench`` use them.
``transformers`` models need the ``test`` extra (``pip install graphamp[test]``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Case", "MODELS", "build", "TRANSFORMERS_MODELS"]


@dataclass
class Case:
    name: str
    model: nn.Module
    # make_inputs(batch, seq) -> (args, kwargs); seq is ignored by models without a sequence dim.
    make_inputs: Callable[[int, int], tuple[tuple, dict[str, Any]]]
    batch: int = 2
    seq: int = 8

    @property
    def inputs(self) -> tuple[tuple, dict[str, Any]]:
        return self.make_inputs(self.batch, self.seq)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _require_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "this built-in model needs transformers; install it with pip install 'graphamp[test]'"
        ) from e
    transformers.logging.set_verbosity_error()
    return transformers


class MLP(nn.Module):
    def __init__(self, d: int = 256, hidden: int = 1024, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(d if i == 0 else hidden, hidden), nn.GELU()]
        layers.append(nn.Linear(hidden, d))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Checkerboard(nn.Module):
    """The AMP tutorial's conv net: 1x1 Conv2d + BatchNorm + ReLU over grid coordinates."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(2, width, 1), nn.BatchNorm2d(width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Conv2d(width, width, 1), nn.BatchNorm2d(width), nn.ReLU()]
        layers.append(nn.Conv2d(width, 1, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, grid: torch.Tensor) -> torch.Tensor:
        return self.net(grid)


class ManySmallOps(nn.Module):
    """Many small linears and elementwise ops: dispatch-bound, where per-call overhead shows."""

    def __init__(self, d: int = 64, blocks: int = 12) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, norm in zip(self.blocks, self.norms):
            h = lin(norm(x))
            x = x + torch.tanh(h) * torch.sigmoid(h)
        return x.softmax(-1)


class LSTMModel(nn.Module):
    def __init__(self, vocab: int = 100, d: int = 32, hidden: int = 48, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        self.lstm = nn.LSTM(d, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.proj(self.embed(tokens)))
        return self.head(out[:, -1])


class MHAModel(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, weights = self.attn(x, x, x, key_padding_mask=mask)
        return self.out(y), weights


def _tensor_inputs(shape_fn: Callable[[int, int], tuple[int, ...]], seed: int) -> Callable:
    def make(b: int, s: int) -> tuple[tuple, dict]:
        return (torch.randn(*shape_fn(b, s), generator=_gen(seed + 1000 * b + s)),), {}

    return make


def mlp(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    return Case("mlp", MLP(), _tensor_inputs(lambda b, s: (b, 256), seed), batch=64)


def checkerboard(seed: int = 0) -> Case:
    torch.manual_seed(seed)

    def make(b: int, s: int) -> tuple[tuple, dict]:
        lin = torch.linspace(-1, 1, s)
        grid = torch.stack(torch.meshgrid(lin, lin, indexing="ij")).expand(b, 2, s, s).contiguous()
        return (grid,), {}

    return Case("checkerboard", Checkerboard(), make, batch=8, seq=32)


def many_small_ops(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    return Case("many_small_ops", ManySmallOps(), _tensor_inputs(lambda b, s: (b, s, 64), seed), batch=8, seq=16)


def transformer_encoder(seed: int = 0, *, d_model: int = 64, layers: int = 2, heads: int = 4) -> Case:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=2 * d_model if d_model < 256 else 4 * d_model, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
    return Case("transformer_encoder", model, _tensor_inputs(lambda b, s: (b, s, d_model), seed))


def lstm(seed: int = 0) -> Case:
    torch.manual_seed(seed)

    def make(b: int, s: int) -> tuple[tuple, dict]:
        return (torch.randint(0, 100, (b, s), generator=_gen(seed + b * 1000 + s)),), {}

    return Case("lstm", LSTMModel(), make)


def mha(seed: int = 0) -> Case:
    torch.manual_seed(seed)

    def make(b: int, s: int) -> tuple[tuple, dict]:
        g = _gen(seed + b * 1000 + s)
        mask = torch.zeros(b, s, dtype=torch.bool)
        mask[:, -1] = True
        return (torch.randn(b, s, 32, generator=g), mask), {}

    return Case("mha", MHAModel(), make)


def _token_inputs(vocab: int, seed: int, mask: bool = True) -> Callable:
    def make(b: int, s: int) -> tuple[tuple, dict]:
        g = _gen(seed + b * 1000 + s)
        kwargs = {"input_ids": torch.randint(0, vocab, (b, s), generator=g)}
        if mask:
            m = torch.ones(b, s, dtype=torch.long)
            m[0, -1] = 0
            kwargs["attention_mask"] = m
        return (), kwargs

    return make


def bert(seed: int = 0, *, layers: int = 2, hidden: int = 64, heads: int = 4, classify: bool = False, dropout: float = 0.0) -> Case:
    tf = _require_transformers()
    torch.manual_seed(seed)
    cfg = tf.BertConfig(
        vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=hidden * 4 if hidden >= 256 else 128, max_position_embeddings=256,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, num_labels=3,
    )
    model = tf.BertForSequenceClassification(cfg) if classify else tf.BertModel(cfg)
    return Case("bert", model, _token_inputs(1000, seed))


def bert_base(seed: int = 0) -> Case:
    """BERT-base size (12 layers, hidden 768), for conversion-time measurements."""
    case = bert(seed, layers=12, hidden=768, heads=12)
    case.name = "bert_base"
    return case


def gpt2(seed: int = 0, *, layers: int = 2, hidden: int = 64, heads: int = 4) -> Case:
    tf = _require_transformers()
    torch.manual_seed(seed)
    cfg = tf.GPT2Config(
        vocab_size=1000, n_positions=256, n_embd=hidden, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )
    return Case("gpt2", tf.GPT2LMHeadModel(cfg), _token_inputs(1000, seed, mask=False))


def vit(seed: int = 0, *, layers: int = 2, hidden: int = 64, heads: int = 4, image: int = 32) -> Case:
    tf = _require_transformers()
    torch.manual_seed(seed)
    cfg = tf.ViTConfig(
        image_size=image, patch_size=8, num_channels=3, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=2 * hidden if hidden < 256 else 4 * hidden,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )

    def make(b: int, s: int) -> tuple[tuple, dict]:
        return (), {"pixel_values": torch.randn(b, 3, image, image, generator=_gen(seed + b))}

    return Case("vit", tf.ViTModel(cfg), make)


def resnet(seed: int = 0) -> Case:
    tf = _require_transformers()
    torch.manual_seed(seed)
    cfg = tf.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")

    def make(b: int, s: int) -> tuple[tuple, dict]:
        return (), {"pixel_values": torch.randn(b, 3, s * 4, s * 4, generator=_gen(seed + b * 1000 + s))}

    return Case("resnet", tf.ResNetModel(cfg), make)


MODELS: dict[str, Callable[..., Case]] = {
    "mlp": mlp,
    "checkerboard": checkerboard,
    "many_small_ops": many_small_ops,
    "transformer_encoder": transformer_encoder,
    "lstm": lstm,
    "mha": mha,
    "bert": bert,
    "gpt2": gpt2,
    "vit": vit,
    "resnet": resnet,
    "bert_base": bert_base,
}
TRANSFORMERS_MODELS = ("bert", "gpt2", "vit", "resnet", "bert_base")


def build(name: str, seed: int = 0) -> Case:
    """Build the built-in model ``name``, or ``module:factory`` returning a Case or (model, args[, kwargs])."""
    if name in MODELS:
        return MODELS[name](seed)
    if ":" in name:
        return _from_factory(name)
    raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(MODELS)}, or module:factory")


def _from_factory(spec: str) -> Case:
    import importlib
    import os
    import sys

    module_name, _, attr = spec.partition(":")
    # The graphamp console script's sys.path starts at its own bin/ directory, not at the working
    # directory as under python -m: look there too, so a project's module:factory loads as documented.
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
                raise  # the module exists; something it imports does not
            raise ValueError(
                f"model {spec!r}: no module {module_name!r} in the working directory or on sys.path. "
                "Way out: run from the directory that holds it, or add that directory to PYTHONPATH."
            ) from e
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise ValueError(f"model {spec!r}: module {module_name!r} has no callable {attr!r}")
        made = factory()
    finally:
        if added:
            sys.path.remove(cwd)
    if isinstance(made, Case):
        return made
    if not (isinstance(made, (tuple, list)) and len(made) in (2, 3) and isinstance(made[0], nn.Module)):
        raise TypeError(f"model {spec!r}: the factory must return a zoo.Case or (model, args[, kwargs]), got {type(made).__name__}")
    model, args, *rest = made
    kwargs = rest[0] if rest else {}
    return Case(spec, model, lambda b, s: (args, kwargs))
