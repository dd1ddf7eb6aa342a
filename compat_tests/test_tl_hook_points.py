"""TransformerLens's HookPoint unit tests, run against xmix-lens's HookPoint.

Source: TransformerLensOrg/TransformerLens, tests/unit/test_hook_points.py at commit
237fb22a2d54071a08c4001003f13de0129843fc (the one stored version the code index holds; it is from
TL 4.x, and its HookPoint cases are the 2.x/3.x API plus has_hooks). Each case keeps its TL name.

Changes from the original:
* No model: these are unit tests on a bare `HookPoint()` (no name), as in TL.
* TL patches torch's RemovableHandle with a mock in the add_hook cases, only so that TL's own
  handle bookkeeping runs without a module; the cases here add hooks for real and assert the same
  things (one forward / backward hook, permanence, context level).
* Not applicable (skipped with the reason): test_add_hook_prepend, which replaces TL's LensHandle
  class and HookPoint.register_forward_hook with mocks and asserts on the mocks' ids (TL internals;
  prepend order on a real model is covered by test_tl_hooks.py::test_prepending_hooks), and the
  four enable_reshape / reshape-conversion cases, which test TL 4.x's tensor-conversion layer
  (BaseTensorConversion).
* test_invalid_direction_raises_error: TL expects beartype's call-hint violation (TL type-checks
  its arguments with beartype); here any of that, TypeError or ValueError is accepted: the
  behaviour asserted is that an invalid direction is refused.
* The two "hook still runs" cases call the HookPoint on a tensor, as TL does (a HookPoint is a
  module whose forward runs its hooks).
"""
import pytest
import torch

from xmix_lens import HookPoint

TL_INTERNALS = "tests TransformerLens internals: "


def setup_hook_point_and_hook():
    def hook(activation, hook):
        return activation

    return HookPoint(), hook


def test_add_hook_forward():
    hp, hook = setup_hook_point_and_hook()
    hp.add_hook(hook, dir="fwd")
    assert len(hp.fwd_hooks) == 1


def test_add_hook_backward():
    hp, hook = setup_hook_point_and_hook()
    hp.add_hook(hook, dir="bwd")
    assert len(hp.bwd_hooks) == 1


def test_add_hook_permanent():
    hp, hook = setup_hook_point_and_hook()
    hp.add_hook(hook, dir="fwd", is_permanent=True)
    assert hp.fwd_hooks[0].is_permanent


def test_add_hook_with_level():
    hp, hook = setup_hook_point_and_hook()
    hp.add_hook(hook, dir="fwd", level=5)
    assert hp.fwd_hooks[0].context_level == 5


@pytest.mark.skip(reason=TL_INTERNALS + "mocks TL's LensHandle class and register_forward_hook")
def test_add_hook_prepend():
    pass


@pytest.mark.skip(reason=TL_INTERNALS + "TL 4.x tensor-conversion layer (enable_reshape)")
def test_enable_reshape():
    pass


@pytest.mark.skip(reason=TL_INTERNALS + "TL 4.x tensor-conversion layer (enable_reshape)")
def test_enable_reshape_with_none():
    pass


@pytest.mark.skip(reason=TL_INTERNALS + "TL 4.x tensor-conversion layer (BaseTensorConversion)")
def test_reshape_functionality_integration():
    pass


@pytest.mark.skip(reason=TL_INTERNALS + "TL 4.x tensor-conversion layer (BaseTensorConversion)")
def test_reshape_functionality_hook_returns_none_integration():
    pass


def _invalid_direction_errors():
    errors = [TypeError, ValueError]
    try:
        from beartype.roar import BeartypeCallHintParamViolation
        errors.append(BeartypeCallHintParamViolation)
    except ImportError:
        pass
    return tuple(errors)


class TestHookPointHasHooks:
    """HookPoint.has_hooks(dir, including_permanent, level)."""

    def setup_method(self):
        self.hp = HookPoint()

        def sample_hook(activation, hook):
            return activation

        self.hook = sample_hook

    def test_no_hooks_returns_false(self):
        for kwargs in ({}, {"dir": "fwd"}, {"dir": "bwd"}, {"dir": "both"}):
            assert not self.hp.has_hooks(**kwargs)

    def test_forward_hook_detection(self):
        self.hp.add_hook(self.hook, dir="fwd")
        assert self.hp.has_hooks() and self.hp.has_hooks(dir="fwd") and self.hp.has_hooks(dir="both")
        assert not self.hp.has_hooks(dir="bwd")

    def test_backward_hook_detection(self):
        self.hp.add_hook(self.hook, dir="bwd")
        assert self.hp.has_hooks() and self.hp.has_hooks(dir="bwd") and self.hp.has_hooks(dir="both")
        assert not self.hp.has_hooks(dir="fwd")

    def test_both_direction_hooks(self):
        self.hp.add_hook(self.hook, dir="fwd")
        self.hp.add_hook(self.hook, dir="bwd")
        for d in ("fwd", "bwd", "both"):
            assert self.hp.has_hooks(dir=d)
        assert self.hp.has_hooks()

    def test_permanent_hook_detection(self):
        self.hp.add_hook(self.hook, dir="fwd", is_permanent=True)
        assert self.hp.has_hooks()
        assert self.hp.has_hooks(including_permanent=True)
        assert not self.hp.has_hooks(including_permanent=False)

    def test_non_permanent_hook_detection(self):
        self.hp.add_hook(self.hook, dir="fwd", is_permanent=False)
        assert self.hp.has_hooks()
        assert self.hp.has_hooks(including_permanent=True)
        assert self.hp.has_hooks(including_permanent=False)

    def test_mixed_permanent_hooks(self):
        self.hp.add_hook(self.hook, dir="fwd", is_permanent=True)
        self.hp.add_hook(self.hook, dir="fwd", is_permanent=False)
        assert self.hp.has_hooks(including_permanent=True)
        assert self.hp.has_hooks(including_permanent=False)

    def test_only_permanent_hooks(self):
        self.hp.add_hook(self.hook, dir="fwd", is_permanent=True)
        self.hp.add_hook(self.hook, dir="bwd", is_permanent=True)
        assert self.hp.has_hooks(including_permanent=True)
        assert self.hp.has_hooks(dir="fwd", including_permanent=True)
        assert self.hp.has_hooks(dir="bwd", including_permanent=True)
        assert not self.hp.has_hooks(including_permanent=False)
        assert not self.hp.has_hooks(dir="fwd", including_permanent=False)
        assert not self.hp.has_hooks(dir="bwd", including_permanent=False)

    def test_context_level_filtering(self):
        self.hp.add_hook(self.hook, dir="fwd", level=0)
        self.hp.add_hook(self.hook, dir="fwd", level=1)
        self.hp.add_hook(self.hook, dir="bwd", level=2)
        for level in (0, 1, 2, None):
            assert self.hp.has_hooks(level=level)
        assert not self.hp.has_hooks(level=3)
        assert not self.hp.has_hooks(level=-1)

    def test_context_level_with_direction(self):
        self.hp.add_hook(self.hook, dir="fwd", level=0)
        self.hp.add_hook(self.hook, dir="bwd", level=1)
        assert self.hp.has_hooks(dir="fwd", level=0)
        assert self.hp.has_hooks(dir="bwd", level=1)
        assert not self.hp.has_hooks(dir="fwd", level=1)
        assert not self.hp.has_hooks(dir="bwd", level=0)

    def test_context_level_with_permanent_flags(self):
        self.hp.add_hook(self.hook, dir="fwd", level=0, is_permanent=True)
        self.hp.add_hook(self.hook, dir="fwd", level=1, is_permanent=False)
        assert self.hp.has_hooks(level=0, including_permanent=True)
        assert not self.hp.has_hooks(level=0, including_permanent=False)
        assert self.hp.has_hooks(level=1, including_permanent=True)
        assert self.hp.has_hooks(level=1, including_permanent=False)

    def test_all_parameters_combined(self):
        self.hp.add_hook(self.hook, dir="fwd", level=0, is_permanent=True)
        self.hp.add_hook(self.hook, dir="fwd", level=1, is_permanent=False)
        self.hp.add_hook(self.hook, dir="bwd", level=0, is_permanent=False)
        self.hp.add_hook(self.hook, dir="bwd", level=2, is_permanent=True)
        assert self.hp.has_hooks(dir="fwd", level=0, including_permanent=True)
        assert not self.hp.has_hooks(dir="fwd", level=0, including_permanent=False)
        assert self.hp.has_hooks(dir="fwd", level=1, including_permanent=False)
        assert self.hp.has_hooks(dir="bwd", level=0, including_permanent=False)
        assert not self.hp.has_hooks(dir="bwd", level=1, including_permanent=False)
        assert self.hp.has_hooks(dir="bwd", level=2, including_permanent=True)

    def test_invalid_direction_raises_error(self):
        with pytest.raises(_invalid_direction_errors()):
            self.hp.has_hooks(dir="invalid")

    def test_multiple_hooks_same_criteria(self):
        for _ in range(3):
            self.hp.add_hook(self.hook, dir="fwd", level=0, is_permanent=False)
        assert self.hp.has_hooks(dir="fwd", level=0, including_permanent=False)

    def test_hook_removal_affects_detection(self):
        self.hp.add_hook(self.hook, dir="fwd")
        assert self.hp.has_hooks()
        self.hp.remove_hooks(dir="both")
        assert not self.hp.has_hooks()

    def test_default_parameter_values(self):
        self.hp.add_hook(self.hook, dir="fwd", is_permanent=True, level=0)
        self.hp.add_hook(self.hook, dir="bwd", is_permanent=False, level=1)
        assert self.hp.has_hooks()
        assert self.hp.has_hooks(dir="both", including_permanent=True, level=None)

    def test_edge_case_empty_after_filtering(self):
        self.hp.add_hook(self.hook, dir="fwd", is_permanent=True, level=5)
        assert not self.hp.has_hooks(including_permanent=False)
        assert not self.hp.has_hooks(dir="bwd")
        assert not self.hp.has_hooks(level=0)
        assert not self.hp.has_hooks(dir="bwd", level=5, including_permanent=True)

    def test_functional_hook_execution_still_works(self):
        calls = []

        def record(activation, hook):
            calls.append(hook)
            return activation

        self.hp.add_hook(record, dir="fwd")
        assert self.hp.has_hooks()
        x = torch.tensor([1.0, 2.0, 3.0])
        assert torch.equal(self.hp(x), x)
        assert len(calls) == 1

    def test_hook_point_with_conversions(self):
        self.hp.add_hook(lambda activation, hook: activation * 2, dir="fwd")
        assert self.hp.has_hooks() and self.hp.has_hooks(dir="fwd")
        assert torch.allclose(self.hp(torch.tensor([1.0, 2.0])), torch.tensor([2.0, 4.0]))
