"""TransformerLens hook-function spellings (issue #14): in-place ops, constants made like act, random
draws. Each hook is traced, lowered and run on flattened tokens through the kernels' torch twins
and through the Triton kernels (interpreter), and must equal the same function run eagerly in
torch on the padded act; the end-to-end tests run hooks through a served tiny model and
TransformerLens."""
import pytest
import torch
import torch.nn.functional as F

from compat_tests.compare import PROMPTS, max_diff, real_mask, tolerance  # noqa: F401 (fixture)
from xmix_lens import App
from xmix_lens.backend.executor import TORCH, TRITON, Executor
from xmix_lens.lower import lower
from xmix_lens.lowered import AffineWrite, GeneratedWrite
from xmix_lens.trace import TraceError, Tracer, traced_once_for

B, P, D = 2, 5, 8
SITE = "blocks.0.hook_resid_post"
gen = torch.Generator().manual_seed(14)
v = torch.randn(D, generator=gen)
clean = torch.randn(B, P, D, generator=gen)
late = torch.tensor([False, False, True, True, False])  # a position mask


def lowered_ops(fn, shape, phase="prefill"):
    tracer = Tracer(SITE, shape, torch.float32, phase=phase)
    tracer.call(fn, None)
    tracer.finish()
    return lower(tracer.graph)


def run_ops(ops, act: torch.Tensor, kernels) -> torch.Tensor:
    """The lowered writes on every token of act (flattened to [tokens, features]) with `kernels`."""
    executor = Executor(torch.device("cpu"), act.shape[0] * act.shape[1])
    executor.kernels = kernels
    x = act.reshape(act.shape[0] * act.shape[1], -1).clone()
    token_pos = torch.arange(act.shape[1]).repeat(act.shape[0])
    for op in ops:
        selected = torch.ones_like(token_pos, dtype=torch.bool) if op.positions is None else op.positions[token_pos]
        rows = selected.nonzero().flatten().to(torch.int32)
        executor.run(op, x, rows, rows.clone())  # a row's per-token table index is its flat token index
    return x.reshape(act.shape)


def run_eager(fn, act: torch.Tensor) -> torch.Tensor:
    act = act.clone()
    out = fn(act, None)
    return act if out is None else out


def check_against_eager(fn, act: torch.Tensor, seed: int = 0) -> list:
    """fn lowered, through the twins and the interpreter, equals fn in eager torch; returns the ops.
    Random draws: torch's generator is seeded the same before the trace and before the eager run."""
    torch.manual_seed(seed)
    ops = lowered_ops(fn, tuple(act.shape))
    torch.manual_seed(seed)
    expected = run_eager(fn, act)
    for kernels in (TORCH, TRITON):
        torch.testing.assert_close(run_ops(ops, act, kernels), expected, rtol=1e-5, atol=1e-5)
    return ops


def act_like(*feature_shape, seed=1):
    return torch.randn(B, P, *feature_shape, generator=torch.Generator().manual_seed(seed))


def edits(edit):
    """A hook that edits act in place through a selection and returns None (the selection's in-place
    op returns the selection, which is not act's shape)."""
    def hook(act, hook):
        edit(act)

    return hook


def _ipow(act, hook):
    act **= 2


def _assign_where_mask(act, hook):
    act[act > 0.2] = 0.2


def _assign_where(act, hook):
    act[:] = torch.where(act > 0, act, 0.1 * act)


def _scale_features(act, hook):
    act[..., [1, 3]] *= 3.0


def _intermediate(act, hook):
    y = act * 2.0
    y.tanh_()
    return y


IN_PLACE = {
    "clamp_": lambda act, hook: act.clamp_(-0.5, 0.5),
    "clamp_min_kw": lambda act, hook: act.clamp_(min=-0.3),
    "clamp_min_": lambda act, hook: act.clamp_min_(0.1),
    "clamp_max_": lambda act, hook: act.clamp_max_(0.2),
    "clip_": lambda act, hook: act.clip_(-1.0, 1.0),
    "relu_": lambda act, hook: act.relu_(),
    "F.relu(inplace=True)": lambda act, hook: F.relu(act, inplace=True),
    "mul_": lambda act, hook: act.mul_(v),
    "div_": lambda act, hook: act.div_(2.0),
    "add_ alpha": lambda act, hook: act.add_(v, alpha=0.5),
    "sub_": lambda act, hook: act.sub_(v),
    "masked_fill_ traced mask": lambda act, hook: act.masked_fill_(act > 0.3, 0.0),
    "masked_fill_ position mask": lambda act, hook: act.masked_fill_(late[None, :, None], 1.0),
    "neg_": lambda act, hook: act.neg_(),
    "abs_": lambda act, hook: act.abs_(),
    "exp_": lambda act, hook: act.exp_(),
    "tanh_": lambda act, hook: act.tanh_(),
    "sigmoid_": lambda act, hook: act.sigmoid_(),
    "pow_": lambda act, hook: act.pow_(3),
    "**=": _ipow,
    "sqrt_": lambda act, hook: act.abs_().sqrt_(),
    "zero_": lambda act, hook: act.zero_(),
    "fill_": lambda act, hook: act.fill_(0.5),
    "copy_": lambda act, hook: act.copy_(act * 2.0 + v),
    "act[act > t] = t": _assign_where_mask,
    "act[:] = where": _assign_where,
    "act.where(cond, other)": lambda act, hook: act.where(act > 0, 0.1 * act),
    "act[..., idx] *= s": _scale_features,
    "slice clamp_": edits(lambda act: act[:, -1].clamp_(-0.1, 0.1)),
    "slice zero_": edits(lambda act: act[:, 1:3].zero_()),
    "slice masked_fill_": edits(lambda act: act[:, 2].masked_fill_(act[:, 2] < 0, 0.0)),
    "slice fill_": edits(lambda act: act[:, :, 5].fill_(1.0)),
    "slice copy_": edits(lambda act: act[:, 0].copy_(clean[:, 0])),
    "intermediate tanh_": _intermediate,
}


@pytest.mark.parametrize("idiom", sorted(IN_PLACE))
def test_in_place_spellings_equal_eager_torch(idiom):
    check_against_eager(IN_PLACE[idiom], act_like(D))


HEAD_IN_PLACE = {
    "head mul_": edits(lambda act: act[:, :, 1].mul_(0.0)),
    "head relu_": edits(lambda act: act[:, :, 2].relu_()),
    "heads at a position zero_": edits(lambda act: act[:, -1, 0:2].zero_()),
    # a list index makes a copy in torch: zero_ on it leaves act as it was
    "a copy's zero_": edits(lambda act: act[:, :, [0, 2]].zero_()),
}


@pytest.mark.parametrize("idiom", sorted(HEAD_IN_PLACE))
def test_in_place_spellings_on_heads_equal_eager_torch(idiom):
    check_against_eager(HEAD_IN_PLACE[idiom], act_like(3, 4))


def _mask_like(act, hook):
    keep = torch.ones_like(act)
    keep[:, :, 3] = 0.0
    return act * keep


CONSTANTS = {
    "zeros_like": lambda act, hook: torch.zeros_like(act),
    "ones_like": lambda act, hook: act * torch.ones_like(act) * 2.0,
    "full_like": lambda act, hook: torch.full_like(act, 0.5),
    "empty_like then fill_": lambda act, hook: torch.empty_like(act).fill_(3.0),
    "new_zeros": lambda act, hook: act.new_zeros(act.shape),
    "new_ones": lambda act, hook: act + act.new_ones(act.shape[-1]),
    "new_full": lambda act, hook: act + act.new_full((D,), 2.0),
    "torch.zeros(act.shape, device=act.device)": lambda act, hook: act + torch.zeros(act.shape, device=act.device) + 1,
    "where with zeros_like": lambda act, hook: torch.where(act > 0, act, torch.zeros_like(act)),
    "a mask built like act": _mask_like,
    "v.to(act.device)": lambda act, hook: act + v.to(act.device),
}


@pytest.mark.parametrize("idiom", sorted(CONSTANTS))
def test_constants_made_like_act_equal_eager_torch(idiom):
    check_against_eager(CONSTANTS[idiom], act_like(D))


def test_constant_writes_fold_into_the_template():
    for idiom in ("zeros_like", "full_like", "new_full", "a mask built like act"):
        assert all(isinstance(op, AffineWrite) for op in lowered_ops(CONSTANTS[idiom], (B, P, D))), idiom


RANDOM = {
    "randn_like": lambda act, hook: act + 0.1 * torch.randn_like(act),
    "rand_like dropout mask": lambda act, hook: act * (torch.rand_like(act) > 0.5),
    "torch.randn(act.shape)": lambda act, hook: act + torch.randn(act.shape, device=act.device),
    "a random direction": lambda act, hook: act + torch.randn(act.shape[-1]),
}


@pytest.mark.parametrize("idiom", sorted(RANDOM))
def test_random_draws_equal_eager_torch_from_the_same_seed(idiom):
    check_against_eager(RANDOM[idiom], act_like(D), seed=7)


def test_each_trace_draws_afresh_as_each_transformer_lens_forward_does():
    torch.manual_seed(3)
    first, second = (lowered_ops(RANDOM["randn_like"], (B, P, D))[0] for _ in range(2))
    assert isinstance(first, AffineWrite) and not torch.equal(first.bias, second.bias)


@pytest.mark.parametrize("idiom", sorted(RANDOM))
def test_random_draws_are_refused_for_generated_tokens(idiom):
    with pytest.raises(TraceError, match="the same numbers would repeat at each token"):
        lowered_ops(RANDOM[idiom], (B, 1, D), phase="decode")


@pytest.mark.parametrize("idiom", sorted(RANDOM))
def test_random_draws_are_refused_where_one_trace_serves_every_request(idiom):
    with traced_once_for("app 'noise''s every request"), pytest.raises(TraceError, match="app 'noise''s every"):
        lowered_ops(RANDOM[idiom], (1, 1, D))
    lowered_ops(RANDOM[idiom], (1, 1, D))  # outside the block: a per-call pass draws


def test_in_place_op_on_a_constant_with_a_traced_operand_is_refused():
    def hook(act, hook):
        total = torch.zeros_like(act)
        total += act

    with pytest.raises(TraceError, match="z = z \\+ act"):
        lowered_ops(hook, (B, P, D))


def test_traced_masks_must_have_acts_shape():
    def hook(act, hook):
        act[act[..., 0] > 0] = 0.0

    with pytest.raises(TraceError, match="must have act's shape"):
        lowered_ops(hook, (B, P, D))


def test_gated_in_place_writes_are_generated_kernels():
    assert any(isinstance(op, GeneratedWrite) for op in lowered_ops(IN_PLACE["masked_fill_ traced mask"], (B, P, D)))


# --- end to end: the tiny Llama, served, against TransformerLens --------------------------------
MODEL = "tiny-llama"


def _served_and_tl(served, reference, tolerance):
    return served[MODEL], reference[MODEL], tolerance(MODEL)[1]


def check_write_against_tl(xl, tl, hooks, tol, seed=None):
    """Logits with the hooks agree with TL's at real positions and move away from the unhooked ones.
    seed: torch's generator is seeded so before each run (hooks that draw random numbers)."""
    mask = real_mask(tl, tl.to_tokens(PROMPTS), "right")
    base = xl(PROMPTS)
    if seed is not None:
        torch.manual_seed(seed)
    ours = xl.run_with_hooks(PROMPTS, fwd_hooks=hooks)
    if seed is not None:
        torch.manual_seed(seed)
    theirs = tl.run_with_hooks(PROMPTS, fwd_hooks=hooks)
    assert max_diff(ours, theirs, mask) < tol
    assert max_diff(ours, base, mask) > 50 * tol, "the hook did not move the logits"


def test_in_place_spellings_end_to_end(served, reference, tolerance):
    xl, tl, tol = _served_and_tl(served, reference, tolerance)

    def edit_heads(act, hook):
        act[:, :, 1].mul_(0.0)
        act[:, :, 2].clamp_(-0.05, 0.05)

    def gate_resid(act, hook):
        act.masked_fill_(act > 0.5, 0.5)
        act.add_(act, alpha=0.5)

    check_write_against_tl(xl, tl, [("blocks.0.attn.hook_z", edit_heads), ("blocks.1.hook_resid_pre", gate_resid)],
                           tol)


def test_constants_made_like_act_end_to_end(served, reference, tolerance):
    xl, tl, tol = _served_and_tl(served, reference, tolerance)
    check_write_against_tl(xl, tl, [("blocks.0.hook_mlp_out", lambda act, hook: torch.zeros_like(act)),
                                    ("blocks.1.hook_resid_pre", lambda act, hook: act + act.new_full(
                                        (act.shape[-1],), 0.5))], tol)


def test_random_draws_end_to_end_from_the_same_seed(served, reference, tolerance):
    xl, tl, tol = _served_and_tl(served, reference, tolerance)
    scale = 0.5 * xl.cfg.d_model ** 0.5
    check_write_against_tl(xl, tl, [("blocks.0.hook_resid_post", lambda act, hook: act + scale * torch.randn_like(act))],
                           tol, seed=11)


def test_random_draws_are_refused_in_generate_and_in_installed_apps(served):
    xl = served[MODEL]
    noise = ("blocks.0.hook_resid_post", lambda act, hook: act + torch.randn_like(act))
    with pytest.raises(TraceError, match="would repeat"):
        xl.generate("Hello", max_new_tokens=2, fwd_hooks=[noise])
    with pytest.raises(ValueError, match="would repeat"):
        xl.install(App("noise", fwd_hooks=[noise]))
    assert "noise" not in xl.apps
