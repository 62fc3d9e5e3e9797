"""graphamp inside Hugging Face Trainer, accelerate and generate(), against each one's own mixed
precision: Trainer(bf16=True), Accelerator(mixed_precision="bf16"), generate() under torch.autocast.
Losses, parameters, evaluation losses, tokens and logits torch.equal."""

from __future__ import annotations

import copy
import logging
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import factories

import graphamp
from graphamp.emit import AmpModule
from graphamp.errors import CaptureError, EagerPathWarning, OptionError
from graphamp.integrations import transformers as hf
from graphamp.integrations.accelerate import GraphampDynamoPlugin

VOCAB, SEQ, STEPS = 64, 8, 10

# Converting with an all-ones attention mask says how eager calls attention for such masks; the
# datasets here hold only those.
pytestmark = pytest.mark.filterwarnings(f"ignore::{EagerPathWarning.__module__}.{EagerPathWarning.__name__}")


def reset_accelerate_state() -> None:
    """accelerate's process-wide state: the first Accelerator's (a Trainer makes one), dynamo plugin
    included, and the gradient state, whose sync flag a run stopped inside gradient accumulation
    leaves False (a later AcceleratedOptimizer.step would then skip every step)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True, scope="module")
def _clean_accelerate_state():
    """Later tests and doctests in this worker (GraphampDynamoPlugin refuses to be ignored by an
    existing state) start clean."""
    yield
    reset_accelerate_state()


def tiny_llama(kv_heads: int = 2, layers: int = 1) -> torch.nn.Module:
    """A LlamaForCausalLM, hidden 32, 4 heads, grouped-query attention for kv_heads < 4 (one layer
    keeps conversion and compilation short; every layer is the same program)."""
    model, _, _ = factories.llama(kv_heads, hidden=32, layers=layers, vocab=VOCAB, seq=SEQ)
    return model


def dataset(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        # "source" is a column the model does not take: Trainer drops it by forward's signature.
        rows.append({"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": ids.clone(), "source": torch.tensor(0)})
    return rows


def training_args(output_dir, **overrides) -> transformers.TrainingArguments:
    kwargs = {
        "output_dir": str(output_dir), "use_cpu": True, "report_to": [], "save_strategy": "no", "logging_steps": 1, "seed": 0,
        "dataloader_num_workers": 0, "bf16": True, "max_steps": STEPS, "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 2, "gradient_accumulation_steps": 2, "max_grad_norm": 0.5, "learning_rate": 1e-2,
        "weight_decay": 0.1, "disable_tqdm": True,
    }
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def train_and_evaluate(model: torch.nn.Module, output_dir) -> tuple[transformers.Trainer, list[float], float]:
    trainer = transformers.Trainer(model=model, args=training_args(output_dir), train_dataset=dataset(4 * STEPS), eval_dataset=dataset(4, seed=2))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == STEPS
    return trainer, losses, trainer.evaluate()["eval_loss"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Trainer's own bf16=True run: the model under accelerate's torch.autocast."""
    transformers.logging.set_verbosity_error()
    initial = tiny_llama()
    model = copy.deepcopy(initial)
    _, losses, eval_loss = train_and_evaluate(model, tmp_path_factory.mktemp("reference"))
    assert not torch.equal(model.lm_head.weight, initial.lm_head.weight)  # it trained
    return initial, model, losses, eval_loss


def assert_same_parameters(ours: torch.nn.Module, want: torch.nn.Module) -> None:
    names = [name for name, _ in ours.named_parameters()]
    assert names == [name for name, _ in want.named_parameters()]
    for (name, p), q in zip(ours.named_parameters(), want.parameters()):
        assert torch.equal(p, q), name


def test_trainer_with_prepared_model_is_bitwise_to_trainer_bf16(reference, tmp_path, caplog):
    initial, want, want_losses, want_eval = reference
    model = copy.deepcopy(initial)
    view = hf.prepare(model)
    with caplog.at_level(logging.INFO, logger="graphamp"):
        trainer, losses, eval_loss = train_and_evaluate(view, tmp_path)
    assert losses == want_losses
    assert eval_loss == want_eval
    assert_same_parameters(model, want)
    # Trainer saw the model: its columns, its loss kwargs, and one converted module, which converted
    # itself again for evaluate()'s eval mode.
    assert {"input_ids", "attention_mask"} <= set(trainer._signature_columns) and "source" not in trainer._signature_columns
    assert trainer.model_accepts_loss_kwargs
    converted = view.__dict__["_graphamp_view"].converted
    assert list(converted) == [(torch.bfloat16, True)]  # the region's (dtype, cache_enabled)
    assert all(isinstance(amp, AmpModule) and not amp.training for amp in converted.values())
    assert "again for eval mode" in caplog.text
    # save_model writes what save_pretrained does, and the weights load back into the model's class.
    trainer.save_model(str(tmp_path / "saved"))
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / "saved"))
    loaded = type(model).from_pretrained(str(tmp_path / "saved"))
    assert_same_parameters(loaded, want)
    # The model itself is not modified: no forward of its own, its class's.
    assert "forward" not in model.__dict__ and "_graphamp_view" not in model.__dict__


def test_trainer_with_dropout_and_label_smoothing_is_bitwise_to_trainer_bf16(tmp_path):
    """A BERT classifier with its dropout on and Trainer's label smoother (which pops the labels and
    picks its loss by the model's class name): conversion inside the first step restores the
    random state, so the graph draws eager's dropout masks."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=3)
    initial = transformers.BertForSequenceClassification(cfg)
    assert cfg.hidden_dropout_prob > 0
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(0, VOCAB, (SEQ,), generator=g), "labels": torch.tensor(i % 3)} for i in range(24)]

    def run(model, out):
        args = training_args(out, max_steps=6, learning_rate=1e-3, label_smoothing_factor=0.1)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows[:4])
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e], trainer.evaluate()["eval_loss"]

    want_model, model = copy.deepcopy(initial), copy.deepcopy(initial)
    want = run(want_model, tmp_path / "reference")
    assert run(hf.prepare(model), tmp_path / "ours") == want
    assert_same_parameters(model, want_model)
    assert not torch.equal(model.classifier.weight, initial.classifier.weight)


def test_trainer_with_compiled_model_is_bitwise_to_trainer_bf16(reference, tmp_path):
    """The backend from Trainer, in place of TrainingArguments(torch_compile_backend="graphamp")."""
    initial, want, want_losses, want_eval = reference
    model = copy.deepcopy(initial)
    view = hf.compile(model, options={"inner": "eager"})
    _, losses, eval_loss = train_and_evaluate(view, tmp_path)
    assert losses == want_losses
    assert eval_loss == want_eval
    assert_same_parameters(model, want)


def test_trainer_refuses_the_backend_name_and_says_so_in_accelerate(tmp_path):
    """What the README documents: accelerate accepts only its own backend names, so the name
    cannot reach torch.compile from TrainingArguments; graphamp.integrations.transformers.compile
    is the way. If accelerate starts accepting it, this fails and the README should change."""
    args = training_args(tmp_path, torch_compile_backend="graphamp")
    with pytest.raises(ValueError, match="GRAPHAMP"):
        transformers.Trainer(model=tiny_llama(), args=args, train_dataset=dataset(4))


def test_trainer_without_mixed_precision_refuses_a_view_without_dtype(tmp_path):
    """fp16=True on CPU: accelerate runs fp32 (no autocast region), which a view would silently
    turn into bf16 mixed precision."""
    args = training_args(tmp_path, bf16=False, fp16=True, max_steps=1, gradient_accumulation_steps=1)
    trainer = transformers.Trainer(model=hf.prepare(tiny_llama()), args=args, train_dataset=dataset(4))
    with pytest.raises(OptionError, match=r"fp16=True on CPU runs fp32"):
        trainer.train()


def accelerate_loop(model: torch.nn.Module, steps: int, plugin_options: dict | None = None) -> list[float]:
    from accelerate import Accelerator

    reset_accelerate_state()  # each run starts afresh
    # The plugin is made after the reset: made before, it would refuse the state it would be ignored by.
    plugin = {} if plugin_options is None else {"dynamo_plugin": GraphampDynamoPlugin(options=plugin_options)}
    accelerator = Accelerator(mixed_precision="bf16", cpu=True, **plugin)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    rows, losses = dataset(2 * steps), []
    for i in range(steps):
        batch = {k: torch.stack([row[k] for row in rows[2 * i : 2 * i + 2]]) for k in ("input_ids", "attention_mask", "labels")}
        loss = prepared(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(prepared.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    reset_accelerate_state()
    return losses


def test_accelerator_with_graphamp_plugin_is_bitwise_to_accelerate_bf16():
    initial = tiny_llama()
    want_model, model = copy.deepcopy(initial), copy.deepcopy(initial)
    want = accelerate_loop(want_model, 4)
    got = accelerate_loop(model, 4, plugin_options={"inner": "eager"})
    assert got == want
    assert_same_parameters(model, want_model)
    assert not torch.equal(model.lm_head.weight, initial.lm_head.weight)


@pytest.fixture
def fresh_accelerate_state():
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def test_graphamp_plugin_passes_backend_and_options_and_refuses_wrong_ones(monkeypatch, fresh_accelerate_state):
    plugin = GraphampDynamoPlugin(options={"inner": "eager"}, mode="default")
    assert plugin.to_kwargs() == {"backend": "graphamp", "options": {"inner": "eager"}}
    assert plugin.to_dict()["backend"] == "graphamp"
    assert GraphampDynamoPlugin(backend="graphamp").to_kwargs() == {"backend": "graphamp"}
    # accelerate's own variables still set what they set; its backend variable is not ours.
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "true")
    assert GraphampDynamoPlugin().to_kwargs() == {"backend": "graphamp", "fullgraph": True}
    with pytest.raises(OptionError, match="Way out: omit backend="):
        GraphampDynamoPlugin(backend="inductor")
    with pytest.raises(OptionError, match="unknown option 'innr'"):
        GraphampDynamoPlugin(options={"innr": "eager"})
    with pytest.raises(OptionError, match="as a dict"):
        GraphampDynamoPlugin(options=["inner"])


def test_graphamp_plugin_refuses_to_be_ignored_by_an_existing_accelerator(fresh_accelerate_state):
    """accelerate keeps the first Accelerator's state, dynamo plugin included: a later Accelerator
    would silently compile nothing."""
    from accelerate import Accelerator

    Accelerator(cpu=True)
    with pytest.raises(OptionError, match="would ignore it and compile nothing"):
        GraphampDynamoPlugin()
    fresh = {"inner": "eager"}
    reset_accelerate_state()
    accelerator = Accelerator(cpu=True, dynamo_plugin=GraphampDynamoPlugin(options=fresh))
    assert accelerator.state.dynamo_plugin.to_kwargs()["backend"] == "graphamp"
    GraphampDynamoPlugin(options=fresh)  # the same plugin again is what the state holds: no error
    with pytest.raises(OptionError, match="compile nothing"):
        GraphampDynamoPlugin(options={"inner": "inductor"})


def test_accelerate_refuses_the_backend_name_documented():
    """accelerate's fixed list, as the README says (the plugin is the way)."""
    from accelerate.utils import TorchDynamoPlugin

    with pytest.raises(ValueError, match="GRAPHAMP"):
        TorchDynamoPlugin(backend="graphamp")


def generate_kwargs() -> dict:
    return {"max_new_tokens": 16, "do_sample": False, "use_cache": True, "output_logits": True, "return_dict_in_generate": True, "pad_token_id": 0}


def assert_same_generation(got, want) -> None:
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits) == 16
    for a, b in zip(got.logits, want.logits):
        assert a.dtype == b.dtype and torch.equal(a, b)


def eager_autocast_generate(model: torch.nn.Module, ids: torch.Tensor):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model.generate(ids, **generate_kwargs())


@pytest.mark.parametrize(
    "kv_heads",
    [
        pytest.param(4, id="mha"),
        # Grouped key/value heads: the backend runs the frame eagerly to observe eager's attention, on
        # a copy of its cache (it once advanced the DynamicCache it was given, and dynamo's guards failed).
        pytest.param(2, id="gqa"),
    ],
)
def test_generate_with_kv_cache_through_the_backend_is_bitwise_to_eager_autocast(kv_heads):
    model = tiny_llama(kv_heads).eval()
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    want = eager_autocast_generate(model, ids)
    got = hf.compile(model, dtype=torch.bfloat16, options={"inner": "eager"}, dynamic=True).generate(ids, **generate_kwargs())
    assert_same_generation(got, want)
    assert "forward" not in model.__dict__


def test_generate_with_kv_cache_on_converted_graphs_names_the_cache_and_the_way_out():
    model = tiny_llama().eval()
    view = hf.prepare(model)
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    with pytest.raises(CaptureError, match=r"key/value cache.*Way out: generate with graphamp.integrations.transformers.compile\(model\)"):
        view.generate(ids, **generate_kwargs())
    assert not view.__dict__["_graphamp_view"].converted  # refused before converting anything


def test_prepared_view_follows_the_autocast_region_or_its_dtype_and_refuses_nesting():
    model = tiny_llama().eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))

    def eager(dtype=torch.bfloat16, **region):
        with torch.autocast("cpu", dtype=dtype, **region):
            return model(input_ids=ids).logits

    view = hf.prepare(model)  # no dtype: each call's enclosing region says, as Trainer's bf16=True does
    with pytest.raises(OptionError, match=r"outside torch.autocast.*TrainingArguments\(bf16=True\)"):
        view(input_ids=ids)
    for region in ({}, {"cache_enabled": False}):
        with torch.autocast("cpu", dtype=torch.bfloat16, **region):
            got = view(input_ids=ids).logits
        assert torch.equal(got, eager(**region))
    assert len(view.__dict__["_graphamp_view"].converted) == 2  # one converted module per region setting
    pinned = hf.prepare(model, dtype=torch.bfloat16)  # a dtype: that precision, in or out of a region
    assert torch.equal(pinned(input_ids=ids).logits, eager())
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(OptionError, match=r"prepare\(model, dtype=torch.float16\)"):
        pinned(input_ids=ids)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), pytest.raises(OptionError, match="cache_enabled"):
        pinned(input_ids=ids)
    with pytest.raises(OptionError, match="outside torch.autocast"):
        hf.compile(model, options={"inner": "eager"})(input_ids=ids)
    with pytest.raises(OptionError, match="already a graphamp view"):
        hf.prepare(view)
    assert hf.source_of(view) is model
    with pytest.raises(OptionError, match="compile"):
        hf.compile(hf.compile(model))
    with pytest.raises(OptionError, match=r"compiled by torch.compile.*_orig_mod"):
        hf.prepare(torch.compile(model, backend="graphamp"))


def test_prepared_view_refuses_a_model_accelerate_has_wrapped():
    """A Trainer run leaves accelerate's autocast forward on the model: converting that would
    capture accelerate's region, so the way out is the model as built."""
    from accelerate.utils import convert_outputs_to_fp32

    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.bfloat16)(model.forward))
    with pytest.raises(OptionError, match="keep_fp32_wrapper=False"):
        hf.prepare(model)


def test_views_look_like_the_model_where_trainer_looks(tmp_path):
    """What Trainer reads by type and name, without running anything: a converted AmpModule's plain
    submodules would get weight decay on GPT-2's LayerNorms (ln_1, ln_2, ln_f: excluded by type
    only) and its class name would hide that the model is a causal LM from label smoothing."""
    import inspect

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=16, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path))
    want_decay = trainer.get_decay_parameter_names(model)
    assert "transformer.h.0.ln_1.weight" not in want_decay
    for view in (hf.prepare(model), hf.compile(model)):
        assert isinstance(view, transformers.GPT2LMHeadModel) and view._get_name() == "GPT2LMHeadModel"
        assert trainer.get_decay_parameter_names(view) == want_decay
        assert [name for name, _ in view.named_parameters()] == [name for name, _ in model.named_parameters()]
        assert all(p is q for p, q in zip(view.parameters(), model.parameters()))
        assert inspect.signature(view.forward) == inspect.signature(model.forward)
        assert view.config is model.config and view.transformer is model.transformer
        view.eval()  # the view's own flag and the shared submodules', as the model's train()/eval() set them
        assert not view.training and not model.transformer.training and model.training


@pytest.mark.parametrize("argument", ["past_key_values", "cache"])
def test_a_key_value_cache_is_refused_before_the_model_runs_on_it(argument):
    # convert ran the model on the example's cache several times (capture, self-check), each run
    # writing another step into it (12 positions became 16), then failed as "a graphamp bug"; a
    # converted module called with a cache converted again for it, writing into it the same way.
    lm = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        cache = lm(input_ids=ids, use_cache=True).past_key_values
    step = {"input_ids": torch.randint(0, VOCAB, (2, 1)), argument: cache}
    with pytest.raises(CaptureError, match=f"the example passes a key/value cache, {argument}= \\(a DynamicCache\\).*use_cache=False"):
        graphamp.convert(lm, (), step, dtype=torch.bfloat16)
    assert cache.get_seq_length() == SEQ
    amp = graphamp.convert(lm, (), {"input_ids": ids}, dtype=torch.bfloat16)
    with pytest.raises(graphamp.InputStructureError, match="These inputs pass a key/value cache"):
        amp(**step)
    assert cache.get_seq_length() == SEQ
