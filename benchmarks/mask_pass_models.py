"""graphamp's compiled training with and without the mask pass (graphamp/passes/recompute_masks.py) on
census models, with their ``nn.Dropout`` modules set to ``p`` (the census builds them with 0).

For each model: the exact conversion in train mode, compiled by inductor twice (with the pass, as
``compile=True`` does, and without it), one forward and backward each from the same seed. It
reports whether each compiled, how many masks the pass rewrote (and the seconds it took), the
compile-and-step times (the second reuses the first's compiled C++ kernels, so compare with
``--without-first``), and the largest difference of the
outputs and parameter gradients between the two, relative to the largest magnitude (inductor draws
dropout from its own generator, seeded from torch's: with the same seed both programs draw alike).

    .venv/bin/python benchmarks/mask_pass_models.py hf/bert hf/gpt2 timm/resnet18 ... [--p 0.1] [--saved]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parent))

import census_models  # noqa: E402

import graphamp  # noqa: E402
from graphamp.backend.inductor import Inductor  # noqa: E402
from graphamp.compiled import CompiledAmpModule  # noqa: E402
from graphamp.passes import recompute_masks as pass_module  # noqa: E402


def _floats(out):
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _step(cm, model, args, kwargs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    outs = _floats(cm(*args, **kwargs))
    sum(o.float().mean() for o in outs).backward()
    return [o.detach() for o in outs], [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def _rel(a, b):
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            if (x is None) != (y is None):
                return float("inf")
            continue
        scale = float(y.float().abs().max()) or 1.0
        worst = max(worst, float((x.float() - y.float()).abs().max()) / scale)
    return worst


def run(name: str, p: float, without_first: bool = False) -> dict:
    built = census_models.build(name)
    model = built.model.train()
    dropouts = 0
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p, dropouts = p, dropouts + 1
    args, kwargs = built.make_inputs(census_models.BATCH)
    row: dict = {"model": name, "dropout_modules": dropouts}
    amp = graphamp.convert(model, args, kwargs, dtype=torch.bfloat16)
    marked: list[int] = []
    spent: list[float] = []
    original = pass_module.recompute_masks
    results = {}
    for with_pass in ((False, True) if without_first else (True, False)):
        init = Inductor.__init__
        patched = contextlib.ExitStack()
        if not with_pass:
            def without(self, patches, init=init):
                init(self, {k: v for k, v in patches.items() if k != "joint_custom_pre_pass"})
            Inductor.__init__ = without
        else:
            def timed(graph):
                start = time.perf_counter()
                marked.append(original(graph))
                spent.append(time.perf_counter() - start)
                return marked[-1]

            pass_module.recompute_masks = timed
        patched.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
        patched.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        try:
            start = time.perf_counter()
            cm = CompiledAmpModule(amp, freezing=False)
            results[with_pass] = _step(cm, model, args, kwargs)
            row["compile_s" if with_pass else "compile_s_without"] = round(time.perf_counter() - start, 1)
        except Exception as e:  # noqa: BLE001 (reported per model)
            row["error" if with_pass else "error_without"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        finally:
            Inductor.__init__ = init
            pass_module.recompute_masks = original
            patched.close()
    row["masks"], row["pass_s"] = sum(marked), round(sum(spent), 3)
    if True in results and False in results:
        (out_a, grads_a), (out_b, grads_b) = results[True], results[False]
        row["outputs_rel"] = _rel(out_a, out_b)
        row["grads_rel"] = _rel(grads_a, grads_b)
        row["finite"] = all(bool(t.isfinite().all()) for t in out_a + [g for g in grads_a if g is not None])
    return row


def saved_bytes(name: str, p: float) -> dict:
    """The bytes the partitioned forward saves for the backward, with and without the pass (AOTAutograd
    with inductor's decompositions and min-cut partition, eager graphs: no inductor compile)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    built = census_models.build(name)
    model = built.model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
    args, kwargs = built.make_inputs(census_models.BATCH)
    amp = graphamp.convert(model, args, kwargs, dtype=torch.bfloat16)
    row: dict = {"model": name}
    for with_pass in (False, True):
        seen: dict = {}

        def partition(joint, inputs, with_pass=with_pass, seen=seen, **kw):
            if with_pass:
                seen["masks"] = seen.get("masks", 0) + pass_module.recompute_masks(joint.graph)
                joint.recompile()
            fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
            outs = next(n for n in fw.graph.nodes if n.op == "output").args[0][kw["num_fwd_outputs"]:]
            for o in outs:
                v = o.meta.get("val")
                if isinstance(v, torch.Tensor):
                    key = "bool" if v.dtype == torch.bool else "uint8" if v.dtype == torch.uint8 else "other"
                    seen[key] = seen.get(key, 0) + v.numel() * v.element_size()
            return fw, bw

        torch._dynamo.reset()
        eager = lambda gm, _: make_boxed_func(gm)  # noqa: E731
        compiled = torch.compile(amp, backend=aot_autograd(fw_compiler=eager, bw_compiler=eager, partition_fn=partition, decompositions=select_decomp_table()))
        torch.manual_seed(0)
        _floats(compiled(*args, **kwargs))
        tag = "with" if with_pass else "without"
        row[f"saved_mib_{tag}"] = round(sum(v for k, v in seen.items() if k != "masks") / 2**20, 3)
        row[f"mask_mib_{tag}"] = round((seen.get("bool", 0) + seen.get("uint8", 0)) / 2**20, 3)
        if with_pass:
            row["masks"] = seen.get("masks", 0)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--saved", action="store_true", help="report the saved bytes with and without the pass instead (no inductor compile)")
    parser.add_argument("--without-first", action="store_true", help="compile without the pass first (compile times: the second compile reuses the first's C++ kernels)")
    ns = parser.parse_args()
    torch.set_num_threads(2)
    rows = []
    for name in ns.models:
        try:
            row = saved_bytes(name, ns.p) if ns.saved else run(name, ns.p, ns.without_first)
        except Exception as e:  # noqa: BLE001 (the model could not be built or converted)
            row = {"model": name, "not_run": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if ns.json:
        ns.json.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
