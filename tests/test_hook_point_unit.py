"""HookPoint bookkeeping against TransformerLens's own HookPoint (no engine): the same calls on a
TL HookPoint and on ours must leave the same hooks (function, permanence, context level, order)
and answer has_hooks the same."""
import itertools

import pytest
import torch
from transformer_lens.hook_points import HookPoint as TLHookPoint

from xmix_lens.hook_points import HookPoint


def f(act, hook):
    return act * 2.0


def g(act, hook):
    return act + 1.0


def hooks_state(hp) -> dict:
    """What a user sees of a hook point: its hooks per direction (function, permanent, level), in order."""
    return {d: [(h.user_hook, h.is_permanent, h.context_level) for h in getattr(hp, f"{d}_hooks")]
            for d in ("fwd", "bwd")}


ADDS = [  # add_hook calls: (function, keyword arguments)
    (f, {}), (g, {"dir": "bwd"}), (f, {"is_permanent": True}), (g, {"level": 1}), (f, {"level": 2, "dir": "bwd"}),
    (g, {"prepend": True, "level": 1}), (f, {"is_permanent": True, "level": 2}),
]
QUERIES = [dict(zip(("dir", "including_permanent", "level"), q))
           for q in itertools.product(("fwd", "bwd", "both"), (True, False), (None, 0, 1, 2))]


def both_with(adds) -> tuple:
    ours, theirs = HookPoint(), TLHookPoint()
    for fn, kwargs in adds:
        ours.add_hook(fn, **kwargs)
        theirs.add_hook(fn, **kwargs)
    return ours, theirs


@pytest.mark.parametrize("n", range(1, len(ADDS) + 1))
def test_add_hook_and_has_hooks_match_transformer_lens(n):
    ours, theirs = both_with(ADDS[:n])
    assert hooks_state(ours) == hooks_state(theirs)
    for query in QUERIES:
        assert ours.has_hooks(**query) == theirs.has_hooks(**query), query


@pytest.mark.parametrize("removal", QUERIES + [{}], ids=str)
def test_remove_hooks_matches_transformer_lens(removal):
    ours, theirs = both_with(ADDS)
    ours.remove_hooks(**removal)
    theirs.remove_hooks(**removal)
    assert hooks_state(ours) == hooks_state(theirs)


def test_unnamed_until_a_model_names_it():
    hp = HookPoint()
    assert hp.name is None and TLHookPoint().name is None
    with pytest.raises(ValueError, match="no name"):
        hp.layer()
    hp.name = "blocks.3.attn.hook_z"
    assert hp.layer() == 3


def test_add_hook_returns_the_handle_it_stores():
    hp = HookPoint()
    handle = hp.add_hook(f, level=4)
    assert hp.fwd_hooks == [handle] and handle.context_level == 4 and handle.hook is f
    assert hp.add_perma_hook(g, dir="bwd").is_permanent


@pytest.mark.parametrize("call", [lambda hp: hp.add_hook(f, dir="both"), lambda hp: hp.has_hooks(dir="up"),
                                  lambda hp: hp.remove_hooks(dir="sideways")])
def test_bad_directions_are_refused_as_in_transformer_lens(call):
    with pytest.raises(ValueError, match="direction"):
        call(HookPoint())
    with pytest.raises(Exception):  # TL: ValueError, or beartype's violation
        call(TLHookPoint())


def test_calling_a_hook_point_runs_its_forward_hooks_like_transformer_lens():
    ours, theirs = both_with([(f, {}), (g, {"prepend": True}), (lambda act, hook: None, {})])
    x = torch.tensor([1.0, -2.0, 3.0])
    assert torch.equal(ours(x), theirs(x))


def test_hook_functions_see_the_hook_point_and_its_ctx():
    seen = []
    hp = HookPoint("blocks.1.hook_resid_post")
    hp.add_hook(lambda act, hook: seen.append((hook.name, hook.layer(), hook.ctx.setdefault("n", len(seen)))))
    hp(torch.zeros(2))
    hp(torch.zeros(2))
    assert seen == [("blocks.1.hook_resid_post", 1, 0), ("blocks.1.hook_resid_post", 1, 0)]
    hp.clear_context()
    assert hp.ctx == {}
