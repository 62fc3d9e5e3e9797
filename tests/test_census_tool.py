"""benchmarks/census.py's own bookkeeping: merging a re-run into the population's results; the CI
sample's lists; what counts as reported; time-outs explained (hang or slow); resuming at one commit;
the checks beyond convert's self-check, on a tiny model (no census site, no transformers build)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import census  # noqa: E402


def _write(path: Path, head: dict, rows: list[dict]) -> None:
    path.write_text("\n".join(json.dumps(r) for r in [{"header": True, **head}, *rows]) + "\n")


def test_a_rerun_replaces_the_checks_it_made_and_records_itself(tmp_path: Path) -> None:
    ok = {"status": "ok", "attempt": 0}
    out, rerun = tmp_path / "population.jsonl", tmp_path / "rerun.jsonl"
    _write(out, {"date": "d0", "graphamp_commit": "aaa"}, [
        {"model": "hf/a", "status": "done", "eager": ok, "requested": list(census.CHECKS),
         "checks": {"convert_bf16": {"status": "error", "reported": True}, "backend": {"status": "bitwise"}}},
        {"model": "hf/b", "status": "timeout", "timeout_in": "grads_bf16", "eager": ok, "requested": ["convert_bf16", "grads_bf16"],
         "note": "layers only", "params": 10**9, "checks": {"convert_bf16": {"status": "bitwise"}}},
        {"model": "hf/c", "status": "done", "eager": ok, "requested": ["convert_bf16"], "checks": {"convert_bf16": {"status": "bitwise"}}},
    ])
    _write(rerun, {"date": "d1", "graphamp_commit": "bbb"}, [
        {"model": "hf/a", "status": "done", "eager": ok, "requested": ["convert_bf16"], "checks": {"convert_bf16": {"status": "bitwise"}}},
        {"model": "hf/b", "status": "done", "eager": ok, "requested": ["grads_bf16"], "checks": {"grads_bf16": {"status": "bitwise"}},
         "note": "tiny, tied", "params": 10},
        {"model": "hf/c", "status": "timeout", "eager": ok, "requested": ["convert_bf16"], "checks": {}},
    ])
    assert census.merge_results(out, rerun) == 2
    head, rows = census.read_results(out)
    assert head["graphamp_commit"] == "aaa"
    a, b, c = rows["hf/a"], rows["hf/b"], rows["hf/c"]
    assert a["checks"] == {"convert_bf16": {"status": "bitwise"}, "backend": {"status": "bitwise"}}
    assert a["rerun"] == [{"date": "d1", "commit": "bbb", "checks": ["convert_bf16"]}]
    assert b["status"] == "done" and "timeout_in" not in b and b["checks"]["grads_bf16"]["status"] == "bitwise"
    assert (b["note"], b["params"]) == ("tiny, tied", 10)  # the build the re-run's checks ran on
    assert c["checks"] == {"convert_bf16": {"status": "bitwise"}} and "rerun" not in c  # an unfinished re-run changes nothing
    table = census.summarize(rows)["table"]
    assert table["convert_bf16"]["bitwise"] == 3 and table["grads_bf16"]["bitwise"] == 1


def test_every_known_cause_is_a_check_the_ci_sample_runs() -> None:
    import census_sample

    stale = [key for key in census_sample.KNOWN if key[1] not in census_sample.SAMPLE.get(key[0], ())]
    assert not stale, f"KNOWN lists checks the CI sample does not run: {stale}"
    assert len(census_sample.CONVERTING) >= 30, "the CI sample keeps at least 30 models beside one per cause"


# ---------------------------------------------------------------- reported means named


def _differ(names: list[str]) -> dict:
    return {"status": "differ", "first": "['logits']", "max_abs_diff": 0.5, "names": names}


def test_a_difference_counts_as_reported_only_when_a_graphamp_warning_names_it() -> None:
    import warnings

    import graphamp
    from graphamp.errors import EagerPathWarning

    names = census._output_names("['logits']", 0)
    assert names == ["output['logits']", "tensor #0"]

    def blanket() -> dict:
        warnings.warn("dynamo broke the model into several graphs: values may differ from eager autocast's", EagerPathWarning)
        return _differ(names)

    def other_output() -> dict:
        warnings.warn("the converted M differs from eager torch.autocast(cpu, torch.bfloat16) on the example: output['hidden'] differs (1)", graphamp.PolicyDriftWarning)
        return _differ(names)

    def named() -> dict:
        warnings.warn("graphamp.convert's self-check: the converted M differs from eager torch.autocast(cpu, torch.bfloat16) on the example: "
                      "under torch.no_grad, output['logits'] differs (max |diff| 0.5).", graphamp.PolicyDriftWarning)
        return _differ(names)

    def not_graphamps() -> dict:
        warnings.warn("output['logits'] differs", UserWarning)
        return _differ(names)

    for fn in (blanket, other_output, not_graphamps):
        result = census._guarded(fn)
        assert result["status"] == "differ" and result["reported"] is False, fn.__name__
    assert census._guarded(blanket)["warnings"] == ["EagerPathWarning: dynamo broke the model into several graphs: values may differ from eager autocast's"]
    result = census._guarded(named)
    assert result["reported"] is True and result["reported_by"].startswith("PolicyDriftWarning: graphamp.convert's self-check")

    # A gradient is named as graphamp's self-check names it; the single output of a plain module too.
    grads = census.compare_grads({"w": torch_tensor([1.0]), "b": torch_tensor([1.0])}, {"w": torch_tensor([2.0]), "b": torch_tensor([1.0])})
    assert grads["names"] == ["gradient of w"]
    assert census._names("on the example: gradient of w differs (max |diff| 1)", grads["names"]) == "gradient of w"
    assert census._names("on the example: gradient of w2 differs", grads["names"]) is None
    out = census.compare_outputs(torch_tensor([1.0]), torch_tensor([2.0]))
    assert out["names"] == ["output", "tensor #0"]
    assert census._names("the example: output differs (max |diff| 1)", out["names"]) == "output"
    assert census._names("the output of this model may differ", out["names"]) is None


def test_an_error_counts_as_reported_only_when_graphamp_raised_it_typed() -> None:
    import warnings

    import graphamp

    def untyped() -> dict:
        warnings.warn("output differs", graphamp.PolicyDriftWarning)  # a warning does not make an error reported
        raise RuntimeError("mat1 and mat2 must have the same dtype")

    def typed() -> dict:
        raise graphamp.PolicyDriftError("the converted M differs from eager torch.autocast")

    first, second = census._guarded(untyped), census._guarded(typed)
    assert (first["status"], first["type"], first["reported"]) == ("error", "RuntimeError", False)
    assert (second["status"], second["type"], second["reported"]) == ("error", "PolicyDriftError", True)
    # A check of cases stands for its worst case: a silent difference before a reported error.
    combined = census._combine({"a": second, "b": {**_differ([]), "reported": False}, "c": {"status": "skipped", "reason": "no input_ids"}})
    assert (combined["status"], combined["case"], combined["reported"]) == ("differ", "b", False)
    assert combined["ran"] == ["a", "b"] and combined["skipped"] == {"c": "no input_ids"}


def torch_tensor(values: list[float]):
    import torch

    return torch.tensor(values)


# ---------------------------------------------------------------- time-outs explained

_WORKER = """
import faulthandler, signal, sys, time
f = open(sys.argv[1], "a")
faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
f.write(sys.argv[2] + "\\n"); f.flush()
def spin(depth):  # busy, one frame deeper every 0.1 s: two stacks apart differ
    t = time.time()
    while time.time() - t < 0.1:
        pass
    spin(depth + 1)
def loop():  # busy in one frame, on one line (a two-line loop's dump names either line)
    while True: pass
if sys.argv[3] == "spin":
    spin(0)
if sys.argv[3] == "loop":
    loop()
time.sleep(60)
"""


def test_a_timed_out_worker_is_a_hang_when_it_sleeps_busy_in_one_frame_and_slow_when_it_works(tmp_path: Path) -> None:
    found = {}
    for how in ("sleep", "spin"):
        stacks = tmp_path / f"{how}.stacks"
        cmd = [sys.executable, "-c", _WORKER, str(stacks), census.STACK_READY, how]
        found[how] = census.run_limited(cmd, 1.0, tmp_path / f"{how}.log", stacks, sample=1.5)
    sleep, spin = found["sleep"], found["spin"]
    assert sleep["code"] is None and sleep["kind"] == "hang", sleep
    assert sleep["stack_changed"] is False and any("time.sleep" in line or "<module>" in line for line in sleep["stack"]), sleep
    assert spin["code"] is None and spin["kind"] == "slow", spin
    assert spin["stack_changed"] is True and spin["cpu_share"] >= census.BUSY_SHARE and spin["cpu_s"] > 0.5, spin
    assert any("in spin" in line for line in spin["stack"]) and len(spin["stack"]) <= census.STACK_LINES
    # Working in one frame throughout (a long call; a loop that makes no progress reads the same): busy.
    stacks = tmp_path / "loop.stacks"
    loop = census.run_limited([sys.executable, "-c", _WORKER, str(stacks), census.STACK_READY, "loop"], 1.0, tmp_path / "loop.log", stacks, sample=1.5)
    assert loop["code"] is None and loop["kind"] == "busy" and loop["stack_changed"] is False, loop
    assert loop["cpu_share"] >= census.BUSY_SHARE and any("in loop" in line for line in loop["stack"]), loop
    # A worker that finishes in time: its exit code and CPU time, no diagnosis.
    done = census.run_limited([sys.executable, "-c", "pass"], 30, tmp_path / "done.log")
    assert done["code"] == 0 and "kind" not in done


_STOPS_ITSELF = """
import os, signal, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(0.3)
"""


def test_time_a_worker_spends_stopped_is_not_counted_against_its_limit(tmp_path: Path) -> None:
    import signal
    import threading

    pid_file = tmp_path / "pid"

    def resume_later() -> None:
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        while not census.proc_stopped(pid):
            time.sleep(0.05)
        time.sleep(2.5)  # stopped well past the 1.5 s limit
        os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=resume_later)
    thread.start()
    ran = census.run_limited([sys.executable, "-c", _STOPS_ITSELF, str(pid_file)], 1.5, tmp_path / "stopped.log")
    thread.join()
    assert ran["code"] == 0 and "kind" not in ran, ran


def test_time_the_census_spends_stopped_is_not_counted_against_its_limit(tmp_path: Path, monkeypatch) -> None:
    # The census stopped once for 3 s while polling (as `kill -STOP` on the whole run does).
    real_sleep, slept = time.sleep, []

    def sleep_stopped_once(seconds: float) -> None:
        real_sleep(seconds + (3.0 if not slept else 0.0))
        slept.append(seconds)

    monkeypatch.setattr(census, "STOPPED_GAP", 1.0)
    monkeypatch.setattr(census.time, "sleep", sleep_stopped_once)
    ran = census.run_limited([sys.executable, "-c", "import time; time.sleep(3.5)"], 2.0, tmp_path / "gap.log")
    assert slept and ran["code"] == 0 and "kind" not in ran, ran


def test_slow_and_busy_time_outs_are_picked_for_a_rerun() -> None:
    records = {
        "hf/a": {"status": "timeout", "kind": "slow", "seconds": 120},
        "hf/b": {"status": "timeout", "kind": "hang", "seconds": 120},
        "hf/c": {"status": "timeout", "kind": "slow", "seconds": 600},
        "hf/d": {"status": "done"},
        # Written by the older rule ("hang" for the same stack twice), read by the measured fields:
        # full CPU, unchanged stack (hf/align: one emulated-fp16 convolution after another) is busy.
        "hf/e": {"status": "timeout", "kind": "hang", "cpu_share": 0.99, "stack_changed": False, "seconds": 900},
        "hf/f": {"status": "timeout", "kind": "hang", "cpu_share": 0.02, "stack_changed": False, "seconds": 900},
    }
    assert census.slow_timeouts(records, 600) == ["hf/a"]
    assert census.slow_timeouts(records, 2700) == ["hf/a", "hf/c", "hf/e"]
    s = census.summarize({n: {**r, "eager": {"status": "ok"}} for n, r in records.items()})
    assert s["timeouts"] == {"slow": 2, "hang": 2, "busy": 1}


def test_resume_refuses_a_results_file_of_another_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "census.jsonl"
    _write(out, {"date": "d0", "graphamp_commit": "aaa"}, [])
    monkeypatch.setattr(census, "_git_commit", lambda: "bbb")
    monkeypatch.setattr(census.census_models, "population", lambda: [])
    with pytest.raises(SystemExit, match="written at graphamp commit aaa, this is bbb"):
        census.main(["--out", str(out), "--resume"])
    census.main(["--out", str(out), "--resume", "--allow-mixed"])  # nothing to run; the summary
    monkeypatch.setattr(census, "_git_commit", lambda: "aaa")
    census.main(["--out", str(out), "--resume"])
    with pytest.raises(SystemExit, match="exists"):
        census.main(["--out", str(out)])


def test_a_resumed_run_keeps_the_time_limit_its_header_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(census, "_run_models", lambda plan, timeout, *a: seen.append(timeout))
    monkeypatch.setattr(census.census_models, "population", lambda: [])
    monkeypatch.setattr(census, "_git_commit", lambda: "aaa")
    monkeypatch.setattr(census, "header", lambda: {"header": True, "graphamp_commit": "aaa"})
    out = tmp_path / "census.jsonl"
    census.main(["--out", str(out), "--timeout", "900"])
    assert json.loads(out.read_text().splitlines()[0])["timeout"] == 900
    monkeypatch.setattr(census, "check_resumable", lambda *a: None)
    census.main(["--out", str(out), "--resume"])
    census.main(["--out", str(out), "--resume", "--timeout", "60"])
    assert seen == [900, 900, 60]
    assert census.resumed_timeout(None, {"graphamp_commit": "aaa"}) == census.DEFAULT_TIMEOUT


def test_resume_refuses_a_results_file_of_another_machine_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Eager autocast's CPU kernels differ between AVX2 and avx512_bf16 machines: a run resumed on
    # another class would mix two machines in one table.
    here = {"cpu": "AMD EPYC", "cpu_flags": [], "native": {"bf16": False, "fp16": False}}
    monkeypatch.setattr(census, "machine", lambda: here)
    monkeypatch.setattr(census, "header", lambda: pytest.fail("the check reads no header: it would add the census site to sys.path"))
    monkeypatch.setattr(census, "_git_commit", lambda: "aaa")
    monkeypatch.setattr(census.census_models, "population", lambda: [])
    out = tmp_path / "census.jsonl"
    _write(out, {"date": "d0", "graphamp_commit": "aaa", **here, "cpu_flags": ["avx512_bf16"], "native": {"bf16": True, "fp16": False}}, [])
    with pytest.raises(SystemExit, match=r"another machine class .*cpu_flags: \['avx512_bf16'\] there, \[\] here"):
        census.main(["--out", str(out), "--resume"])
    census.main(["--out", str(out), "--resume", "--allow-mixed"])
    _write(out, {"date": "d0", "graphamp_commit": "aaa", **here, "versions": {"torch": "2.12.0"}}, [])
    with pytest.raises(SystemExit, match=r"versions.torch: 2.12.0 there"):
        census.main(["--out", str(out), "--resume"])
    _write(out, {"date": "d0", "graphamp_commit": "aaa", **here, "versions": {"torch": census._version("torch")}}, [])
    census.main(["--out", str(out), "--resume"])


# ---------------------------------------------------------------- the new checks, on a tiny model


def _tiny_built(name: str, attempt: int = 0):
    import torch
    from torch import nn

    class Tiny(nn.Module):
        main_input_name = "input_ids"

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.drop = nn.Dropout(0.25)
            self.proj = nn.Linear(16, 16)
            self.norm = nn.LayerNorm(16)

        def forward(self, input_ids, attention_mask=None):
            h = self.proj(self.drop(self.embed(input_ids)))
            if attention_mask is not None:
                h = h * attention_mask[..., None].to(h.dtype)
            return {"hidden": self.norm(h), "pooled": h.sum(1).softmax(-1)}

    def make(b: int, seed: int = 0, seq: int | None = None):
        g = torch.Generator().manual_seed(1000 * b + census.census_models.SEED_STRIDE * seed)
        return (), {"input_ids": torch.randint(0, 50, (b, seq or 8), generator=g)}

    torch.manual_seed(0)
    return census.census_models.Built(name, Tiny().eval(), make, "Tiny", "tiny", seq_input=True)


def _tiny_population(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(census.census_models, "build", _tiny_built)
    monkeypatch.setattr(census.census_models, "attempts", lambda name: 1)
    # timm, diffusers and the torchvision workaround stay out of the test process.
    monkeypatch.setattr(census.census_models, "enable_census_site", lambda: False)


def test_the_new_checks_run_on_a_tiny_model(monkeypatch: pytest.MonkeyPatch) -> None:
    _tiny_population(monkeypatch)
    data = census.run_model("test/tiny", ("inputs", "dropout", "export", "backend_autocast"))
    checks = data["checks"]
    assert set(checks) == {"inputs", "dropout", "export", "backend_autocast"}  # convert_bf16 ran, unrecorded
    inputs = checks["inputs"]
    assert inputs["status"] == "bitwise" and inputs["ran"] == ["values", "padded_mask", "longer"], inputs
    assert checks["dropout"]["status"] == "bitwise" and checks["dropout"]["dropout"] == {"modules": 1, "p": [0.25], "config": {}}
    assert checks["export"]["status"] == "bitwise" and checks["export"]["ran"] == ["example", "values"], checks["export"]
    assert checks["backend_autocast"]["status"] == "bitwise" and checks["backend_autocast"]["graphs"] >= 1
    assert all("cpu_s" in r for r in checks.values())


def test_a_backend_dynamo_never_called_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _tiny_population(monkeypatch)
    monkeypatch.setattr(census, "_counting_backend", lambda: ("eager", []))  # dynamo's own eager backend
    data = census.run_model("test/tiny", ("backend_autocast",))
    result = data["checks"]["backend_autocast"]
    assert (result["status"], result["type"], result["reported"]) == ("error", "BackendNotCalled", False), result


_NO_FAKE = None


def _dynamo_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model, ending in an op whose fake kernel raises: eager runs it, dynamo cannot trace
    it (its untyped TorchRuntimeError, as transformers' UDOP gives), with or without graphamp."""
    import torch

    global _NO_FAKE
    if _NO_FAKE is None:
        _NO_FAKE = torch.library.custom_op("census_test::no_fake", lambda x: x.clone(), mutates_args=(),
                                           schema="(Tensor x) -> Tensor")

        @_NO_FAKE.register_fake
        def _(x):
            raise RuntimeError("no fake kernel for this input")
    no_fake = _NO_FAKE

    def built(name: str, attempt: int = 0):
        b = _tiny_built(name, attempt)
        forward = b.model.forward
        b.model.forward = lambda *a, **k: {key: no_fake(v) for key, v in forward(*a, **k).items()}
        return b

    _tiny_population(monkeypatch)
    monkeypatch.setattr(census.census_models, "build", built)


def test_a_model_dynamo_itself_cannot_compile_skips_the_backend_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    _dynamo_refuses(monkeypatch)
    data = census.run_model("test/tiny", ("backend", "backend_autocast"))
    for check in ("backend", "backend_autocast"):
        result = data["checks"][check]
        assert result["status"] == "skipped", result
        assert result["reason"].startswith("torch.compile itself fails on this model without graphamp (backend='eager'"), result
        assert "TorchRuntimeError" in result["reason"] and "with graphamp: " in result["reason"], result
    assert "inside torch.autocast" in data["checks"]["backend_autocast"]["reason"]


def test_a_backend_error_plain_dynamo_does_not_share_stays_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _tiny_population(monkeypatch)

    def failing(gm, example_inputs, **kwargs):
        raise RuntimeError("a bug of the backend's")

    monkeypatch.setattr(census, "_counting_backend", lambda: (failing, [1]))
    result = census.run_model("test/tiny", ("backend",))["checks"]["backend"]
    assert (result["status"], result["type"], result["reported"]) == ("error", "RuntimeError", False), result
    assert "a bug of the backend's" in result["message"], result


def test_the_new_checks_see_a_module_that_differs_from_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    import graphamp
    import torch

    _tiny_population(monkeypatch)

    def fp32(self, dtype, *, train):  # "converted" to plain fp32: differs from autocast everywhere
        self.reset(train=train)
        return self.model

    def reseeded(model, *args, **kwargs):  # autocast, but dropout drawn from another seed
        def call(*a, **k):
            torch.manual_seed(1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(*a, **k)
        return call

    monkeypatch.setattr(census.Subject, "convert", fp32)
    monkeypatch.setattr(graphamp, "convert", reseeded)
    checks = census.run_model("test/tiny", ("inputs", "dropout"))["checks"]
    inputs = checks["inputs"]
    assert (inputs["status"], inputs["case"], inputs["reported"]) == ("differ", "values", False), inputs
    assert [inputs["cases"][c]["status"] for c in ("values", "padded_mask", "longer")] == ["differ"] * 3
    assert (checks["dropout"]["status"], checks["dropout"]["reported"]) == ("differ", False), checks["dropout"]


def test_input_features_are_tried_frames_first_where_bins_first_cannot_run() -> None:
    # Whisper takes (batch, bins, frames), UnivNet (batch, frames, bins): the census tries the second
    # layout only for models that take input_features, after the first failed.
    pytest.importorskip("transformers")
    import torch

    models = census.census_models

    def runs(name: str, attempt: int) -> bool:
        built = models.build(name, attempt)
        args, kwargs = built.make_inputs(models.BATCH)
        try:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                built.model(*args, **kwargs)
        except RuntimeError:
            return False
        return True

    assert not runs("hf/univnet", 0)
    assert runs("hf/univnet", 1) and models.build("hf/univnet", 1).make_inputs(2)[1]["input_features"].shape[1:] == (64, 100)
    with pytest.raises(models.NotApplicable):
        models.build("hf/bert", 1)


def test_a_build_over_the_parameter_limit_is_refused_before_it_allocates(monkeypatch: pytest.MonkeyPatch) -> None:
    # BLT's "layers only" build (3.2 B parameters) was OOM-killed at 23 GB: the census counts a
    # build's parameters on the meta device and refuses, with the count, what is over its limit.
    pytest.importorskip("transformers")
    models = census.census_models
    assert models.build("hf/bert", 0).model is not None
    monkeypatch.setattr(models, "MAX_BUILD_PARAMS", 1000)
    with pytest.raises(models.BuildError, match=r"B parameters, over the census's"):
        models.build("hf/bert", 0)


def test_the_tied_shrink_ties_a_size_named_after_its_sibling_either_way() -> None:
    # BLT: encoder_config.hidden_size_global must be global_config.hidden_size; its hashed n-gram
    # vocabulary (half a million rows) needs no such size.
    models = census.census_models
    tied = next(s for s in models.SHRINKS if s.tied)
    d = {
        "model_type": "blt", "encoder_hash_byte_group_vocab": 500002,
        "global_config": {"model_type": "g", "hidden_size": 2048, "num_attention_heads": 16},
        "encoder_config": {"model_type": "e", "hidden_size": 1024, "hidden_size_global": 2048, "num_attention_heads": 16},
    }
    out = models.shrink_config_dict(d, tied)
    assert out["encoder_config"]["hidden_size_global"] == out["global_config"]["hidden_size"] == 64
    assert out["encoder_hash_byte_group_vocab"] == 256
    untied = models.shrink_config_dict(d, models.SHRINKS[0])
    assert (untied["encoder_config"]["hidden_size_global"], untied["encoder_hash_byte_group_vocab"]) == (2048, 500002)


def test_models_eager_could_not_run_under_another_builder_are_retried_and_merged_whole(tmp_path: Path) -> None:
    records = {
        "hf/old": {"status": "done", "eager": {"status": "error", "message": "no generic input"}},  # before the field
        "hf/other": {"status": "done", "builder": "b1", "eager": {"status": "error", "message": "x"}},
        "hf/same": {"status": "done", "builder": "b2", "eager": {"status": "error", "message": "x"}},
        "hf/runs": {"status": "done", "builder": "b1", "eager": {"status": "ok", "attempt": 0}},
    }
    assert census.cannot_run_elsewhere(records, "b2") == ["hf/old", "hf/other"]
    # A second pass merged into the file brings the model's eager status, build and builder.
    out, rerun = tmp_path / "population.jsonl", tmp_path / "rerun.jsonl"
    _write(out, {"date": "d0", "graphamp_commit": "aaa", "builder": "b1"}, [{"model": "hf/old", "requested": list(census.CHECKS), **records["hf/old"], "checks": {}}])
    _write(rerun, {"date": "d1", "graphamp_commit": "aaa", "builder": "b2"}, [
        {"model": "hf/old", "status": "done", "builder": "b2", "eager": {"status": "ok", "attempt": 3}, "note": "tiny, fitted",
         "requested": list(census.CHECKS), "checks": {c: {"status": "bitwise"} for c in census.CHECKS}}])
    assert census.merge_results(out, rerun) == 1
    row = census.read_results(out)[1]["hf/old"]
    assert (row["eager"]["status"], row["builder"], row["note"], row["status"]) == ("ok", "b2", "tiny, fitted", "done")
    assert census.summarize({"hf/old": row})["eager_runs"] == 1


def test_a_rerun_that_timed_out_brings_the_checks_it_finished_and_its_own_time_out(tmp_path: Path) -> None:
    ok = {"status": "ok", "attempt": 0}
    out, rerun = tmp_path / "population.jsonl", tmp_path / "rerun.jsonl"
    _write(out, {"date": "d0", "graphamp_commit": "aaa"}, [
        {"model": "hf/a", "status": "timeout", "timeout_in": "convert_fp16", "kind": "hang", "cpu_share": 0.99, "eager": ok,
         "requested": list(census.CHECKS), "checks": {"convert_bf16": {"status": "bitwise"}}}])
    _write(rerun, {"date": "d1", "graphamp_commit": "aaa"}, [
        {"model": "hf/a", "status": "timeout", "timeout_in": "dropout", "kind": "hang", "cpu_share": 0.52, "stack_changed": False, "eager": ok,
         "requested": ["inputs", "dropout"], "checks": {"inputs": {"status": "bitwise"}}}])
    assert census.merge_results(out, rerun) == 1
    row = census.read_results(out)[1]["hf/a"]
    assert set(row["checks"]) == {"convert_bf16", "inputs"}
    assert (row["status"], row["timeout_in"], row["cpu_share"], census._kind(row)) == ("timeout", "dropout", 0.52, "busy")
    assert row["rerun"] == [{"date": "d1", "commit": "aaa", "checks": ["inputs"]}]
