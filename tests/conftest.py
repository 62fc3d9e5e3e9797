import gc
import logging
import os

import pytest
import torch

# Under pytest-xdist each worker is one of two processes on a 2-core machine: one intra-op thread
# each keeps them from oversubscribing the cores (results are the same at any thread count).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from graphamp.testing import zoo


@pytest.fixture(autouse=True, scope="session")
def _no_structured_trace():
    # pytest attaches its log handlers to every non-propagating logger, torch's structured-trace
    # logger included, and torch.export emits its trace whenever that logger has a handler:
    # conversion runs about twice as slow. With no handler and propagation on, torch skips it.
    trace_log = logging.getLogger("torch.__trace")
    handlers, propagate = list(trace_log.handlers), trace_log.propagate
    for handler in handlers:
        trace_log.removeHandler(handler)
    trace_log.propagate = True
    yield
    trace_log.propagate = propagate
    for handler in handlers:
        trace_log.addHandler(handler)


@pytest.fixture(autouse=True, scope="module")
def _freeze_what_a_test_file_leaves():
    # A worker's heap grows test file after test file (imported model code, torch's caches) to over
    # a million objects, and each full collection walks all of them: 10-15% of a worker's time in
    # 21 collections of about 0.5 s over three files. What a finished file leaves alive, once
    # collected, is moved out of the collector's sight (gc.freeze): reference counting still frees
    # it, but a cycle among those objects that becomes garbage later is never collected. Measured on
    # test_grad_zoo, test_train, test_cli and test_convert_models in one process: 165 -> 153 s, the
    # same peak memory (1.0 GB); the whole suite, clean clone: 570 -> 501 s.
    yield
    gc.collect()
    gc.freeze()


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
