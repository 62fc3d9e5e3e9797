"""The census builder's config rules (benchmarks/census_models.py, census_inputs.py), each on a small
config dict: no transformers model is built here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import census_inputs  # noqa: E402
import census_models as models  # noqa: E402

TINY = models.SHRINKS[0]
FITTED = next(s for s in models.SHRINKS if s.fitted)


def test_a_backbone_keeps_the_layers_it_outputs_and_its_layer_numbers_follow_them() -> None:
    # A ViT backbone outputs stages 3, 6, 9, 12 of 12 layers: shrunk to 2 layers, out_features
    # ['stage12'] would name a stage that does not exist. It keeps the 4 layers before its outputs.
    d = {"model_type": "vit", "num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
         "stage_names": ["stem", *(f"stage{i}" for i in range(1, 13))], "out_indices": [3, 6, 9, 12],
         "out_features": ["stage3", "stage6", "stage9", "stage12"],
         "window_block_indices": [0, 1, 2, 4, 5, 7, 8, 10], "layer_types": [f"t{i}" for i in range(12)]}
    out = models.shrink_config_dict(d, TINY)
    assert out["num_hidden_layers"] == 4
    assert out["layer_types"] == ["t2", "t5", "t8", "t11"]
    assert (out["out_indices"], out["out_features"]) == ([1, 2, 3, 4], ["stage1", "stage2", "stage3", "stage4"])
    assert out["stage_names"] == ["stem", "stage1", "stage2", "stage3", "stage4"]
    assert out["window_block_indices"] == [0, 1, 2]  # old layers 2, 5, 8 of the kept 2, 5, 8, 11
    # Outputs that fit the shrunk layers are left alone.
    fits = {**d, "out_indices": [1, 2], "out_features": ["stage1", "stage2"]}
    assert models.shrink_config_dict(fits, TINY)["out_indices"] == [1, 2]


def test_an_mrope_section_shrinks_with_the_head_and_still_sums_to_half_of_it() -> None:
    d = {"model_type": "qwen2_vl", "hidden_size": 1024, "num_attention_heads": 8, "num_hidden_layers": 4,
         "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24]}}
    out = models.shrink_config_dict(d, TINY)
    head = out["hidden_size"] // out["num_attention_heads"]
    assert sum(out["rope_parameters"]["mrope_section"]) == head // 2
    assert out["rope_parameters"]["mrope_section"] == [4, 6, 6]


def test_sizes_a_default_config_leaves_none_are_filled_and_others_kept() -> None:
    d = {"model_type": "x", "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": None, "head_dim": None, "vocab_size": None}
    assert models._filled(d) == {**d, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 256}
    full = {"model_type": "x", "hidden_size": 512, "num_attention_heads": 8}
    assert models._filled(full) is full


def test_per_layer_overrides_keep_a_layer_of_every_kind_renumbered() -> None:
    # Gemma 4-style: five sliding layers and one full one with its own override. layer_types[:2]
    # would keep two sliding layers and drop the override.
    d = {"model_type": "g", "hidden_size": 512, "num_attention_heads": 8, "num_hidden_layers": 6,
         "layer_types": ["s", "s", "s", "s", "s", "f"], "per_layer_config": {"5": {"hidden_size": 512, "sliding_window": None}}}
    out = models.shrink_config_dict(d, TINY)
    assert sorted(out["layer_types"]) == ["f", "s"]
    full = out["layer_types"].index("f")
    assert out["per_layer_config"] == {str(full): {"hidden_size": out["hidden_size"], "sliding_window": None}}


def test_the_fitted_shrink_makes_a_width_the_patterns_miss_small_with_the_one_it_copies() -> None:
    # RT-DETR: its encoder takes the backbone's last three stage widths, a list the shrink's name
    # patterns miss; the fitted shrink maps each old width to the stage's new one.
    d = {"model_type": "rt_detr", "d_model": 256, "encoder_attention_heads": 8, "encoder_layers": 4,
         "encoder_in_channels": [512, 1024, 2048], "feat_strides": [8, 16, 32], "num_queries": 300,
         "backbone_config": {"model_type": "resnet", "hidden_sizes": [256, 512, 1024, 2048], "depths": [3, 4, 6, 3]}}
    out = models.shrink_config_dict(d, FITTED)
    assert out["encoder_in_channels"] == [512, 1024, 2048]
    models._fit(d, out)
    assert out["encoder_in_channels"] == out["backbone_config"]["hidden_sizes"][1:]
    assert out["feat_strides"] == [8, 16, 32]  # not a width
    assert out["num_queries"] == models.FITTED_QUERIES


def test_the_fitted_shrink_comes_last() -> None:
    # Every model another shrink builds is built as before the fitted one existed.
    assert models.SHRINKS[-1] is FITTED and sum(s.fitted for s in models.SHRINKS) == 1


def test_packed_patches_are_rows_of_one_patch_with_their_grid() -> None:
    torch = pytest.importorskip("torch")
    tower = torch.nn.Sequential(torch.nn.Conv3d(3, 8, kernel_size=(2, 14, 14)))
    assert census_inputs.packed_arg(["hidden_states", "grid_thw"]) == "hidden_states"
    assert census_inputs.packed_arg(["pixel_values"]) is None
    got = census_inputs.packed_patches(tower, None, "hidden_states", "grid_thw", 2, seed=0)
    g = census_inputs.GRID
    assert got["hidden_states"].shape == (2 * g * g, 3 * 2 * 14 * 14)
    assert got["grid_thw"].tolist() == [[1, g, g]] * 2


def test_a_forecaster_sees_its_context_plus_its_largest_lag() -> None:
    class Config:
        context_length, lags_sequence, input_size, prediction_length = 16, [1, 2, 7], 1, 8
        num_time_features, num_dynamic_real_features = 2, 1

    c = Config()
    assert census_inputs.series_input("past_values", c, 2, 0).shape == (2, 23)
    assert census_inputs.series_input("past_observed_mask", c, 2, 0).shape == (2, 23)
    assert census_inputs.series_input("past_time_features", c, 2, 0).shape == (2, 23, 3)
    assert census_inputs.series_input("future_values", c, 2, 0).shape == (2, 8)
    assert census_inputs.series_input("unknown", c, 2, 0) is None


def test_the_builder_id_follows_both_builder_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = models.builder_id()
    copy = tmp_path / "census_inputs.py"
    copy.write_text(Path(census_inputs.__file__).read_text())
    monkeypatch.setattr(census_inputs, "__file__", str(copy))
    assert models.builder_id() == before
    copy.write_text(copy.read_text() + "\n# changed\n")
    assert models.builder_id() != before
