"""torch.compile and the per-example hooks (gns_callback/per_example/compiled.py), without Lightning.

``backend="aot_eager"`` compiles forward and backward through AOTAutograd as inductor does, with no C++ compiler.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gns_callback.collectors import UnmeasurableSetup, choose_method
from gns_callback.per_example import PerExampleNormTracker
from gns_callback.per_example.compiled import compiled_modules, problem
from tests.helpers import mlp

BACKEND = "aot_eager"


pytestmark = pytest.mark.usefixtures("fresh_compiler")


class Wrapper(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x)


def test_compiled_modules_names_what_torch_compile_wrapped():
    assert compiled_modules(Wrapper(mlp())) == []
    assert compiled_modules(Wrapper(torch.compile(mlp(), backend=BACKEND))) == ["body"]
    assert compiled_modules(torch.compile(mlp(), backend=BACKEND)) == [""]
    in_place = Wrapper(mlp())
    in_place.body.compile(backend=BACKEND)
    assert compiled_modules(in_place) == ["body"]


def test_problem_names_the_module_and_the_way_out():
    assert problem(mlp()) is None
    message = problem(Wrapper(torch.compile(mlp(), backend=BACKEND)))
    assert "torch.compile ('body')" in message and "method='micro_batch'" in message
    assert "torch.compile:" in problem(mlp(), compiled=True)  # what the caller knows and the modules don't show


def test_auto_measures_a_compiled_model_with_micro_batches_and_refuses_it_without():
    model = Wrapper(torch.compile(mlp(), backend=BACKEND))
    choice = choose_method("auto", model, several_micro_batches=True)
    assert choice.method == "micro_batch" and "torch.compile" in choice.note
    with pytest.raises(UnmeasurableSetup, match="torch.compile.*accumulate_grad_batches=2 or more"):
        choose_method("auto", model, several_micro_batches=False)
    with pytest.raises(UnmeasurableSetup, match="method='per_example': the model is compiled with torch.compile"):
        choose_method("per_example", model, several_micro_batches=True)
    with pytest.raises(UnmeasurableSetup, match="the model is compiled with torch.compile:"):
        choose_method("auto", mlp(), several_micro_batches=False, compiled=True)  # compiled whole, by a framework


def test_a_compiled_function_stops_the_tracker_with_the_reason():
    """What no inspection shows: ``torch.compile`` of a function that calls the model. Before, every pass went
    unmeasured with no reason (``pop()`` returned None)."""
    net = mlp()
    x, y = torch.randn(6, 64), torch.randint(10, (6,))
    run = torch.compile(lambda inputs: net(inputs), backend=BACKEND)
    with PerExampleNormTracker(net) as tracker:
        F.cross_entropy(run(x), y).backward()
        with pytest.raises(RuntimeError, match="a training forward ran under torch.compile"):
            tracker.pop()


def test_a_graph_compiled_before_the_hooks_stops_the_tracker_with_the_reason():
    """The graph traced without hooks is reused once they are attached: the forward hooks never run at all, not even
    at trace time. The parameters' gradients still arrive, with no output gradient of their layers."""
    net = mlp()
    x, y = torch.randn(6, 64), torch.randint(10, (6,))
    run = torch.compile(lambda inputs: net(inputs), backend=BACKEND)
    F.cross_entropy(run(x), y).backward()  # traced here, before the tracker exists
    with PerExampleNormTracker(net) as tracker:
        F.cross_entropy(run(x), y).backward()
        with pytest.raises(RuntimeError, match="the per-example hooks saw no forward.*torch.compile"):
            tracker.pop()


def test_an_eager_forward_is_still_measured_beside_compiled_code():
    """Compiled code that doesn't run the tracked layers (here a loss) leaves the tracker measuring."""
    net = mlp()
    x, y = torch.randn(6, 64), torch.randint(10, (6,))
    loss_fn = torch.compile(F.cross_entropy, backend=BACKEND)
    with PerExampleNormTracker(net) as tracker:
        loss_fn(net(x), y).backward()
        norms = tracker.pop()
        F.cross_entropy(net(x), y).backward()
        eager = tracker.pop()
    assert tracker.failure is None
    torch.testing.assert_close(norms, eager)
