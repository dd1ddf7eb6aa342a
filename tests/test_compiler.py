"""Trace -> IR -> lower, without an engine: lowered ops run by the site runtime on flattened
tokens must equal the hook function run eagerly in torch on the padded activation."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xmix_lens.backend.vllm.runtime import SiteRuntime, StepTokens
from xmix_lens.ir import evaluate
from xmix_lens.lower import lower
from xmix_lens.lowered import AffineWrite, Read
from xmix_lens import topk_mask
from xmix_lens.trace import TraceError, Tracer

B, P, F = 3, 5, 16
SITE = "blocks.0.hook_resid_post"


def run_lowered(fns, act: torch.Tensor):
    """Trace fns at one site, lower, run the ops over every token of act; (new act, reads, graph)."""
    tracer = Tracer(SITE, tuple(act.shape), act.dtype)
    for fn in fns:
        tracer.call(fn, None)
    kept = tracer.finish()
    ops = lower(tracer.graph)
    runtime = SiteRuntime("llama", [SITE], {SITE}, torch.device("cpu"), max_tokens=B * P)
    p = runtime.open_pass([torch.arange(P)] * B, [0] * B, (P, {SITE: ops}))
    runtime.set_step(StepTokens(torch.zeros(B * P, dtype=torch.long), torch.arange(B).repeat_interleave(P),
                                torch.zeros(B * P, dtype=torch.bool), torch.arange(P).repeat(B)))
    x = act.reshape(B * P, -1).clone()
    runtime.run_site(x, 0)
    values = runtime.finish_passes([p.pass_id], [])[0].values  # the reads, put into the pass as it closes
    reads = [values[("prefill", SITE, k)] for k in range(len(kept))]
    return x.reshape(act.shape), reads, tracer.graph, ops


def run_eager(fns, act: torch.Tensor):
    act = act.clone()
    for fn in fns:
        out = fn(act, None)
        act = act if out is None else out
    return act


gen = torch.Generator().manual_seed(0)
v, d = torch.randn(F, generator=gen), torch.randn(F, generator=gen)
d = d / d.norm()
clean = torch.randn(B, P, F, generator=gen)
M = torch.randn(F, 3, generator=gen)
W_ENC = torch.randn(F, 12, generator=gen) / F ** 0.5

IDIOMS = {
    "steer": lambda act, hook: act + 3.0 * v,
    "steer_in_place": lambda act, hook: act.__iadd__(v),
    "scale": lambda act, hook: act * 0.5,
    "zero_last": lambda act, hook: act.__setitem__((slice(None), -1), 0.0),
    "steer_last": lambda act, hook: act.__setitem__((slice(None), -1), act[:, -1] + v),
    "patch_position": lambda act, hook: act.__setitem__((slice(None), 2), clean[:, 2]),
    "patch_everywhere": lambda act, hook: clean - act + act,
    "remove_direction": lambda act, hook: act - (act @ d)[..., None] * d,
    "remove_direction_sum": lambda act, hook: act - (act * d).sum(-1, keepdim=True) * d,
    "clamp_coefficient": lambda act, hook: act + (2.0 - act @ d).unsqueeze(-1) * d,
    "low_rank": lambda act, hook: act + (act @ M) @ M.T * 0.1,
    "neg_then_shift": lambda act, hook: -act + 1.0,
    "rsub": lambda act, hook: 1.0 - act,
}


@pytest.mark.parametrize("idiom", sorted(IDIOMS))
def test_write_idioms_equal_eager_torch(idiom):
    act = torch.randn(B, P, F, generator=torch.Generator().manual_seed(1))
    out, _, graph, ops = run_lowered([IDIOMS[idiom]], act)
    assert torch.allclose(out, run_eager([IDIOMS[idiom]], act), atol=1e-5)
    assert torch.allclose(out, evaluate(graph, act)[graph.output], atol=1e-5)
    assert all(isinstance(op, AffineWrite) for op in ops)  # parametric: no generated code


def test_reads_see_the_version_they_were_taken_at():
    kept = {}

    def hook(act, hook):
        kept["before"] = act.clone()
        act[:, 0] = act[:, 0] * 2.0
        kept["first"] = act[:, 0]
        kept["score"] = act @ d
        return act + v

    act = torch.randn(B, P, F, generator=torch.Generator().manual_seed(2))
    out, reads, graph, ops = run_lowered([hook], act)
    expected = act.clone()
    expected[:, 0] *= 2.0
    values = dict(zip(["before", "first", "score"], reads))
    assert torch.allclose(values["before"], act)
    assert torch.allclose(values["first"], expected[:, 0], atol=1e-6)
    assert torch.allclose(values["score"], expected @ d, atol=1e-5)
    assert torch.allclose(out, expected + v, atol=1e-6)
    assert [type(op).__name__ for op in ops] == ["Read", "AffineWrite", "Read", "Read", "AffineWrite"]


def test_hooks_chain_on_one_point():
    fns = [IDIOMS["steer"], IDIOMS["remove_direction"], IDIOMS["zero_last"]]
    act = torch.randn(B, P, F, generator=torch.Generator().manual_seed(3))
    out, _, _, _ = run_lowered(fns, act)
    assert torch.allclose(out, run_eager(fns, act), atol=1e-5)


def test_graph_prints_like_fx():
    _, _, graph, _ = run_lowered([IDIOMS["remove_direction"]], torch.zeros(B, P, F))
    text = str(graph)
    assert text.startswith(f"graph({SITE}: act[{B}, {P}, {F}]):")
    assert "matmul" in text and "write" in text


GENERATED = {
    "square": lambda act, hook: act * act,
    "relu_gate": lambda act, hook: act + torch.relu(act @ d)[..., None] * v,
    "where_clamp": lambda act, hook: torch.where((act @ d)[..., None] > 0.2, act.clamp(-0.5, 0.5), act),
    "softmax_mix": lambda act, hook: act + act.softmax(-1) * 3.0,
    "norm_rescale": lambda act, hook: act / act.norm(dim=-1, keepdim=True) * 2.0,
    "max_gate_last": lambda act, hook: act.__setitem__((slice(None), -1), act[:, -1] * (act[:, -1].amax(-1) > 1.0)[..., None]),
    "sigmoid_tanh_exp": lambda act, hook: torch.sigmoid(act) + torch.tanh(act) - torch.exp(-act.abs()),
    "pow_div": lambda act, hook: act ** 2 / (1.0 + act.abs()),
    "logical": lambda act, hook: act * torch.logical_and(act > -0.5, act < 0.5),
    "topk_sae_clamp": lambda act, hook: act + (
        2.0 - topk_mask(torch.relu(act @ W_ENC + 0.1), 3)[..., 1:2]) * W_ENC.T[1],
}


@pytest.mark.parametrize("idiom", sorted(GENERATED))
def test_generated_programs_equal_eager_torch(idiom):
    act = torch.randn(B, P, F, generator=torch.Generator().manual_seed(4))
    out, _, graph, ops = run_lowered([GENERATED[idiom]], act)
    assert torch.allclose(out, run_eager([GENERATED[idiom]], act), atol=1e-5)
    assert any(type(op).__name__ == "GeneratedWrite" for op in ops)


def test_generated_reads():
    kept = {}

    def hook(act, hook):
        kept["relu"] = torch.relu(act @ M)
        kept["max"] = act[:, 1].amax(-1)

    act = torch.randn(B, P, F, generator=torch.Generator().manual_seed(5))
    _, reads, _, _ = run_lowered([hook], act)
    assert torch.allclose(reads[0], torch.relu(act @ M), atol=1e-5)
    assert torch.allclose(reads[1], act[:, 1].amax(-1), atol=1e-6)


def test_a_projection_in_a_program_is_one_matmul_a_low_rank_term_two():
    """`relu(act @ W + b)` takes one matmul by W (not `(x @ W) @ I`, which made the SAE read stage
    a second matmul through scratch); a low-rank term inside a nonlinearity keeps its two."""
    kept = {}
    b = torch.randn(12, generator=torch.Generator().manual_seed(8))

    def hook(act, hook):
        kept["features"] = torch.relu(act @ W_ENC + b)
        kept["projected_out"] = torch.relu(act - (act @ d)[..., None] * d)

    act = torch.randn(B, P, F, generator=torch.Generator().manual_seed(9))
    _, reads, _, ops = run_lowered([hook], act)
    assert torch.allclose(reads[0], torch.relu(act @ W_ENC + b), atol=1e-5)
    assert torch.allclose(reads[1], torch.relu(act - (act @ d)[..., None] * d), atol=1e-5)
    features, projected_out = ([program.consts[o.args[1]] for o in program.ops if o.op == "matmul"]
                               for program in (op.program for op in ops))
    assert len(features) == 1 and torch.equal(features[0], W_ENC)
    assert [tuple(W.shape) for W in projected_out] == [(F, 1), (1, F)]


H, DH = 4, 8


def run_heads(fn, seed=6):
    act = torch.randn(B, P, H, DH, generator=torch.Generator().manual_seed(seed))
    out, reads, _, ops = run_lowered([fn], act)
    return out, reads, ops, act


HEAD_IDIOMS = {
    "zero_head": lambda act, hook: act.__setitem__((slice(None), slice(None), 2), 0.0),
    "zero_heads_last_pos": lambda act, hook: act.__setitem__((slice(None), -1, [0, 3]), 0.0),
    "scale_head": lambda act, hook: act.__setitem__((slice(None), slice(None), 1), act[:, :, 1] * 3.0),
    "steer_per_head": lambda act, hook: act + torch.arange(H * DH, dtype=torch.float32).reshape(H, DH) * 0.01,
    "head_mask": lambda act, hook: act * torch.tensor([1.0, 0.0, 1.0, 0.5])[:, None],
    "rearrange_einsum": lambda act, hook: act + torch.einsum(
        "bphd,hdk->bpk", act, torch.ones(H, DH, H * DH) * 0.01).reshape(B, P, H, DH),
    "position_slice": lambda act, hook: act.__setitem__((slice(None), slice(1, 4)), act[:, 1:4] * 0.5),
    "position_mask": lambda act, hook: act.__setitem__((slice(None), torch.tensor([1, 0, 1, 0, 0], dtype=torch.bool)), 0.0),
    "head_swap_permute": lambda act, hook: act.transpose(-1, -2).transpose(-1, -2) * 2.0,
}


@pytest.mark.parametrize("idiom", sorted(HEAD_IDIOMS))
def test_head_and_position_selectors(idiom):
    out, _, ops, act = run_heads(HEAD_IDIOMS[idiom])
    assert torch.allclose(out, run_eager([HEAD_IDIOMS[idiom]], act), atol=1e-5)
    assert all(isinstance(op, AffineWrite) for op in ops)


def test_head_reads_keep_their_shape():
    kept = {}

    def hook(act, hook):
        kept["head"] = act[:, :, 2]
        kept["flat"] = act.flatten(-2, -1)
        kept["slice"] = act[:, 1:3, [0, 1]]

    _, reads, _, act = run_heads(hook)
    assert torch.allclose(reads[0], act[:, :, 2])
    assert torch.allclose(reads[1], act.flatten(-2, -1))
    assert torch.equal(reads[2], act[:, 1:3, [0, 1]])


@pytest.mark.parametrize("bad, message", [
    (lambda act, hook: act + torch.ones(F + 1), "do not broadcast"),
    (lambda act, hook: act.sum(1), "last feature dim"),
    (lambda act, hook: act.mean(dim=1), "mix tokens"),
    (lambda act, hook: act.__setitem__((slice(None), 1), act[:, 2]), "across positions"),
    (lambda act, hook: act.cumsum(-1), "`cumsum` is not in the hook IR"),
    (lambda act, hook: act[0], "batch dim"),
    (lambda act, hook: act[:, -1], "returned"),
    (lambda act, hook: act[:, act[0, 0] > 0], "data-dependent"),
    (lambda act, hook: act.reshape(-1, F), "token dims"),
])
def test_unsupported_forms_raise_trace_errors(bad, message):
    with pytest.raises(TraceError, match=message):
        run_lowered([bad], torch.zeros(B, P, F))


# --- property: random compositions of supported ops equal eager torch --------------------------
UNARY = [
    lambda x: x + v, lambda x: x - 0.5, lambda x: x * 1.5, lambda x: -x, lambda x: x * v,
    lambda x: x - (x @ d)[..., None] * d, lambda x: 2.0 - x, lambda x: x + (x @ M) @ M.T * 0.05,
]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(UNARY) - 1), min_size=1, max_size=5), st.integers(-P, P - 1),
       st.booleans(), st.integers(0, 2**16))
def test_random_compositions_equal_eager(chain, position, at_position, seed):
    def hook(act, hook):
        x = act[:, position] if at_position else act
        for i in chain:
            x = UNARY[i](x)
        if at_position:
            act[:, position] = x
            return None
        return x

    act = torch.randn(B, P, F, generator=torch.Generator().manual_seed(seed))
    out, _, _, _ = run_lowered([hook], act)
    assert torch.allclose(out, run_eager([hook], act), atol=1e-4, rtol=1e-4)


def test_read_lowering_uses_the_projection_template():
    _, _, _, ops = run_lowered([lambda act, hook: hook_store.update(s=act @ M)], torch.zeros(B, P, F))
    (read,) = ops
    assert isinstance(read, Read) and read.W is not None and read.W.shape == (F, 3)


hook_store: dict = {}


def test_a_runtime_made_under_a_default_device_opens_passes_on_its_host_tables():
    """vLLM builds the model, and so its site runtime, under a default-device context (the GPU
    there): the runtime's host table of the open passes' positions made without an explicit device
    landed on the GPU, and the first hooked call failed. Made under the meta device, where any such
    table fails, it opens a pass and routes its tokens as one made outside it."""
    with torch.device("meta"):
        runtime = SiteRuntime("llama", [SITE], {SITE}, torch.device("cpu"), max_tokens=B * P)
    tracer = Tracer(SITE, (B, P, F), torch.float32)
    tracer.call(IDIOMS["steer"], None)
    tracer.finish()
    p = runtime.open_pass([torch.arange(P)] * B, [0] * B, (P, {SITE: lower(tracer.graph)}))
    assert runtime.places.device.type == "cpu" and runtime.places[1:].tolist() == list(range(P)) * B
    runtime.finish_passes([p.pass_id], [])
