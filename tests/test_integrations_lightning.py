"""graphamp.integrations.lightning: GraphampPrecision against Lightning's own mixed precision, bitwise."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

pl = pytest.importorskip("pytorch_lightning")

from lightning_fabric import Fabric
from lightning_fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from pytorch_lightning.plugins.precision import MixedPrecision

from graphamp import Config
from graphamp.emit import AmpModule
from graphamp.errors import OptionError, PolicyDriftWarning
from graphamp.integrations.lightning import GraphampFabricPrecision, GraphampPrecision

VOCAB, WIDTH = 50, 32


class Universal(pl.LightningModule):
    """Token embedding, one TransformerEncoderLayer applied twice (its weights feed two low-precision
    ops each, where autocast's cache_enabled shows), a head tied to the embedding; AdamW; dropout on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layer = nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.1, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.emb.weight
        self.losses: list[torch.Tensor] = []
        self.val_losses: list[torch.Tensor] = []
        self.eager_forwards = 0  # training-mode calls of the Python forward
        self.seen: list[int] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.eager_forwards += self.training  # Python runs only where the forward runs eagerly
        return self.head(self.layer(self.layer(self.emb(ids))))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, target = batch
        return nn.functional.cross_entropy(self(ids).reshape(-1, VOCAB), target.reshape(-1))

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.losses.append(loss.detach().clone())
        self.seen.append(self.eager_forwards)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple, batch_idx: int) -> None:
        self.val_losses.append(self._loss(batch).clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Wrapped(pl.LightningModule):
    """training_step calls a submodule directly; the LightningModule has no forward of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, VOCAB))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        ids, target = batch
        loss = nn.functional.cross_entropy(self.model(ids).reshape(-1, VOCAB), target.reshape(-1))
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CachedMixedPrecision(MixedPrecision):
    """Lightning's recipe with autocast's cache on: what the plugin must not be."""

    def autocast_context_manager(self) -> torch.autocast:
        return torch.autocast(self.device, dtype=torch.bfloat16 if self.precision == "bf16-mixed" else torch.half)


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (18, 12), generator=g)  # 4 batches of 4, then one of 2 (another shape)
    target = torch.randint(0, VOCAB, (18, 12), generator=g)
    data = torch.utils.data.TensorDataset(ids, target)
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))


def _fit(model: pl.LightningModule, *, validate: bool = False, **trainer_kwargs) -> pl.LightningModule:
    pl.seed_everything(0, verbose=False)
    trainer_kwargs.setdefault("gradient_clip_val", 1.0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=1 if validate else 0, val_check_interval=3 if validate else None, num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(model, _loader(), _loader() if validate else None)
    return model


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice (workers, log batch size), fp16 emulation
        yield


def test_bf16_mixed_bitwise_to_lightning() -> None:
    ref = _fit(Universal(), validate=True, precision="bf16-mixed")
    plugin = GraphampPrecision("bf16-mixed")
    # Without grad, eval nn.MultiheadAttention takes its fused kernel in eager, which graphamp's
    # graph does not follow: the plugin says so and runs those calls as Lightning does.
    with pytest.warns(PolicyDriftWarning, match="run in eager autocast"):
        got = _fit(Universal(), validate=True, plugins=[plugin])
    assert len(got.losses) == 5 and all(torch.equal(a, b) for a, b in zip(got.losses, ref.losses, strict=True))
    assert len(got.val_losses) == 1 and all(torch.equal(a, b) for a, b in zip(got.val_losses, ref.val_losses, strict=True))
    assert _same_params(got, ref)
    # The graph ran: the training forward ran eagerly only while the first step converted it.
    assert isinstance(plugin.converted[True], AmpModule)
    assert ref.seen == [1, 2, 3, 4, 5] and len(set(got.seen)) == 1
    assert "forward" not in vars(got)  # the model is left as it was


def test_16_mixed_with_grad_scaler_bitwise_to_lightning() -> None:
    # Trainer(precision="16-mixed") on CPU falls back to bf16; Lightning's plugin given directly runs fp16.
    reference = MixedPrecision("16-mixed", "cpu")
    ref = _fit(Universal(), plugins=[reference])
    plugin = GraphampPrecision("16-mixed", self_check="off")  # the comparison with Lightning is the check (time)
    got = _fit(Universal(), plugins=[plugin])
    assert isinstance(plugin.scaler, torch.amp.GradScaler) and plugin.scaler.get_scale() == reference.scaler.get_scale()
    assert all(torch.equal(a, b) for a, b in zip(got.losses, ref.losses, strict=True))
    assert _same_params(got, ref)


def test_a_submodule_named_by_module() -> None:
    ref = _fit(Wrapped(), precision="bf16-mixed")
    plugin = GraphampPrecision("bf16-mixed", module="model")
    got = _fit(Wrapped(), plugins=[plugin])
    assert all(torch.equal(a, b) for a, b in zip(got.losses, ref.losses, strict=True))
    assert _same_params(got, ref)
    assert list(plugin.converted) == [True] and "forward" not in vars(got.model)


def test_a_forward_training_step_never_calls_is_refused() -> None:
    with pytest.raises(OptionError, match=r"training_step did not call it.*module=.*'model'"):
        _fit(Wrapped(), plugins=[GraphampPrecision("bf16-mixed")])
    with pytest.raises(OptionError, match=r"no such submodule.*children: 'model'"):
        _fit(Wrapped(), plugins=[GraphampPrecision("bf16-mixed", module="encoder")])


@pytest.mark.parametrize("precision", ["32-true", "32", 32, "64-true", "bf16-true", "16-true", "bf16", "transformer-engine", "fp8"])
def test_precisions_graphamp_does_not_convert_are_refused(precision: object) -> None:
    with pytest.raises(OptionError, match="Way out"):
        GraphampPrecision(precision)


def test_wrong_combinations_are_refused_with_the_way_out() -> None:
    with pytest.raises(OptionError, match="bf16 needs no loss scaling"):
        GraphampPrecision("bf16-mixed", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(OptionError, match="autocast policies"):
        GraphampPrecision("bf16-mixed", device="mps")
    with pytest.raises(OptionError, match="graphamp.Config"):
        GraphampPrecision("bf16-mixed", config={"cache_enabled": False})
    with pytest.raises(OptionError, match="self_check"):
        GraphampPrecision("bf16-mixed", self_check="maybe")
    # Lightning itself refuses a precision flag beside a precision plugin.
    with pytest.raises(ValueError, match="Choose one"):
        pl.Trainer(accelerator="cpu", precision="bf16-mixed", plugins=[GraphampPrecision("bf16-mixed")])


def test_config_is_kept_and_runs_uncached() -> None:
    plugin = GraphampPrecision("16-mixed", config=Config(fp32_modules=("head",)))
    assert plugin.config.cache_enabled is False and plugin.config.fp32_modules == ("head",)
    assert plugin.dtype is torch.float16 and isinstance(plugin.scaler, torch.amp.GradScaler)


class CausalLM(pl.LightningModule):
    """A tiny Hugging Face GPT-2 from a config (random weights, dropout on): the model returns a
    ModelOutput, training_step shifts the labels and computes the loss under Lightning's autocast."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=WIDTH, n_layer=1, n_head=2, use_cache=False)
        self.model = transformers.GPT2LMHeadModel(cfg)
        self.losses: list[torch.Tensor] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        ids, _ = batch
        logits = self(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_transformers_model_bitwise_to_lightning() -> None:
    ref = _fit(CausalLM(), precision="bf16-mixed")
    plugin = GraphampPrecision("bf16-mixed", self_check="off")  # the comparison with Lightning is the check (time)
    got = _fit(CausalLM(), plugins=[plugin])
    assert len(got.losses) == 5 and all(torch.equal(a, b) for a, b in zip(got.losses, ref.losses, strict=True))
    assert _same_params(got, ref)
    assert isinstance(plugin.converted[True], AmpModule)


class Manual(Wrapped):
    """Manual optimization: manual_backward (scaled for 16-mixed) and the optimizer stepped by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple, batch_idx: int) -> None:
        opt = self.optimizers()
        ids, target = batch
        loss = nn.functional.cross_entropy(self.model(ids).reshape(-1, VOCAB), target.reshape(-1))
        self.losses.append(loss.detach().clone())
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0)
        opt.step()


def test_manual_optimization_with_a_grad_scaler_bitwise_to_lightning() -> None:
    ref = _fit(Manual(), plugins=[MixedPrecision("16-mixed", "cpu")], gradient_clip_val=None)
    got = _fit(Manual(), plugins=[GraphampPrecision("16-mixed", module="model")], gradient_clip_val=None)
    assert len(got.losses) == 5 and all(torch.equal(a, b) for a, b in zip(got.losses, ref.losses, strict=True))
    assert _same_params(got, ref)


def test_a_wrapped_model_is_refused() -> None:
    # Multi-device strategies hand the plugin their wrapper (DistributedDataParallel, ...).
    with pytest.raises(OptionError, match="single device.*Way out"):
        GraphampPrecision("bf16-mixed").connect(nn.Linear(2, 2), [], [])


class TwoWays(Wrapped):
    """A forward called two ways: odd steps pass a keyword (another input structure)."""

    def forward(self, ids: torch.Tensor, *, twice: bool = False) -> torch.Tensor:
        h = self.model[1](self.model[0](ids))
        if twice:
            h = self.model[1](h)
        return self.model[3](self.model[2](h))

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        ids, target = batch
        logits = self(ids, twice=True) if batch_idx % 2 else self(ids)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
        self.losses.append(loss.detach().clone())
        return loss


def test_a_forward_called_two_ways_gets_a_graph_each(caplog: pytest.LogCaptureFixture) -> None:
    ref = _fit(TwoWays(), precision="bf16-mixed")
    plugin = GraphampPrecision("bf16-mixed")
    with caplog.at_level(logging.INFO, logger="graphamp"):
        got = _fit(TwoWays(), plugins=[plugin])
    assert all(torch.equal(a, b) for a, b in zip(got.losses, ref.losses, strict=True))
    assert _same_params(got, ref)
    # One converted module, which converted itself once more for the keyword's input structure.
    assert list(plugin.converted) == [True] and caplog.text.count("(another input structure)") == 1
    # Lightning's recipe is autocast without its weight-cast cache; with the cache the run differs.
    cached = _fit(TwoWays(), plugins=[CachedMixedPrecision("bf16-mixed", "cpu")])
    assert not _same_params(cached, ref)


class Shared(nn.Module):
    """Universal as a plain module, for Fabric: one encoder layer applied twice, a tied head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layer = nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.1, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.layer(self.emb(ids))))


def _fabric_run(**fabric_kwargs) -> tuple[nn.Module, list[torch.Tensor], object]:
    pl.seed_everything(0, verbose=False)
    fabric = Fabric(accelerator="cpu", devices=1, **fabric_kwargs)
    module = Shared()
    model, opt = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-3))
    losses = []
    for ids, target in _loader():
        logits = model(ids)  # Fabric casts the output back to fp32; the loss runs outside autocast
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)  # fp16: a first step may overflow
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return module, losses, fabric.strategy.precision


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fabric_bitwise_to_its_own_mixed_precision(precision: str) -> None:
    # Fabric(precision="16-mixed") on CPU falls back to bf16; its plugin given directly runs fp16.
    ref, ref_losses, _ = _fabric_run(plugins=[FabricMixedPrecision(precision, "cpu")])
    got, losses, plugin = _fabric_run(plugins=[GraphampFabricPrecision(precision)])
    assert len(losses) == 5 and all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert _same_params(got, ref)
    assert isinstance(plugin.converted[True], AmpModule) and "forward" not in vars(got)
    assert (plugin.scaler is not None) == (precision == "16-mixed")


def test_fabric_refuses_an_uncached_config() -> None:
    with pytest.raises(OptionError, match="weight-cast cache"):
        GraphampFabricPrecision("bf16-mixed", config=Config(cache_enabled=False))
    with pytest.raises(OptionError, match=r"Fabric\(precision='32-true'\)"):
        GraphampFabricPrecision("32-true")
