"""Generated per-token kernels (interpreter, CPU) against their torch twin, the twin against loops."""

import inspect
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from xmix_lens.kernels import program_format, program_kernel, program_torch, split_matmul
from xmix_lens.kernels.rms_norm_rows import Renorm, rms_norm_rows_torch
from xmix_lens.lowered import TokenOp, TokenProgram

from kernel_checks import SENTINEL, assert_matches, gen, random_subset, randn  # noqa: F401 (gen: fixture)

# Rows past R and padding lanes compute on zeros (0 / 0, log 0) and are never stored: numpy, which
# runs the interpreter, warns about them all the same.
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|divide by zero) encountered:RuntimeWarning")


class Program:
    """Builds a TokenProgram by hand: each method appends an op and returns its index."""

    def __init__(self):
        self.ops, self.consts = [], []

    def op(self, name, *args, shape):
        self.ops.append(TokenOp(name, args, tuple(shape)))
        return len(self.ops) - 1

    def const(self, tensor, op="const"):
        self.consts.append(tensor.float().contiguous())
        shape = tensor.shape[1:] if op == "table" else tensor.shape
        return self.op(op, len(self.consts) - 1, shape=shape)

    def matmul(self, a, W):
        self.consts.append(W.contiguous())
        return self.op("matmul", a, len(self.consts) - 1, shape=(W.shape[1],))

    def build(self, output=None):
        return TokenProgram(self.ops, self.consts, len(self.ops) - 1 if output is None else output)


# --- the programs: (program, table rows or None), a write unless the result is not (F,) ----------
def steering_gate(F, gen):
    """x + relu(x . d) * v"""
    p = Program()
    x = p.op("x", shape=(F,))
    gate = p.op("relu", p.op("sum", p.op("mul", x, p.const(randn(F, gen=gen)), shape=(F,)), shape=()), shape=())
    p.op("add", x, p.op("mul", gate, p.const(randn(F, gen=gen)), shape=(F,)), shape=(F,))
    return p.build()


def clamp(F, gen, low=-0.5, high=0.75):
    p = Program()
    p.op("clamp", p.op("x", shape=(F,)), low, high, shape=(F,))
    return p.build()


def softmax_dot(F, gen):
    """softmax(x) . q, a scalar read"""
    p = Program()
    attention = p.op("softmax", p.op("x", shape=(F,)), shape=(F,))
    p.op("sum", p.op("mul", attention, p.const(randn(F, gen=gen)), shape=(F,)), shape=())
    return p.build()


def gated_ablation(F, gen, threshold=0.5):
    """where(x . q > threshold, x * 0, x)"""
    p = Program()
    x = p.op("x", shape=(F,))
    score = p.op("sum", p.op("mul", x, p.const(randn(F, gen=gen) / F**0.5), shape=(F,)), shape=())
    p.op("where", p.op("gt", score, threshold, shape=()), p.op("mul", x, 0.0, shape=(F,)), x, shape=(F,))
    return p.build()


def norm_rescale(F, gen):
    """x / |x| * c, c a () const"""
    p = Program()
    x = p.op("x", shape=(F,))
    unit = p.op("div", x, p.op("norm", x, shape=()), shape=(F,))
    p.op("mul", unit, p.const(torch.tensor(3.0)), shape=(F,))
    return p.build()


def patching(F, gen, N=7):
    """x + alpha[t] * (cache[t] - x): per-token tables, a vector one and a scalar one"""
    p = Program()
    x = p.op("x", shape=(F,))
    difference = p.op("sub", p.const(randn(N, F, gen=gen), op="table"), x, shape=(F,))
    p.op("add", x, p.op("mul", p.const(torch.rand(N, generator=gen), op="table"), difference, shape=(F,)), shape=(F,))
    return p.build()


def sae_features(p, F, gen, k, activation, top):
    """relu(x @ W_enc + b_enc), or relu(topk_mask(x @ W_enc + b_enc, top))"""
    pre = p.op("add", p.matmul(p.op("x", shape=(F,)), randn(F, k, gen=gen) / F**0.5), p.const(randn(k, gen=gen) * 0.1),
               shape=(k,))
    if activation == "topk":
        pre = p.op("topk_mask", pre, top, shape=(k,))
    return p.op("relu", pre, shape=(k,))


def sae_clamp(F, gen, k=256, activation="relu", top=8, feature=5, value=4.0):
    """x + (value - f_i) * W_dec[i]: clamps SAE feature i, keeping the reconstruction error"""
    p = Program()
    f = sae_features(p, F, gen, k, activation, top)
    f_i = p.matmul(f, torch.nn.functional.one_hot(torch.tensor([feature]), k).float().T)  # (1,)
    step = p.matmul(p.op("sub", value, f_i, shape=(1,)), randn(1, F, gen=gen))  # a scaled row
    p.op("add", 0, step, shape=(F,))
    return p.build()


def sae_reconstruction(F, gen, k=256, activation="relu", top=8):
    """relu(x @ W_enc + b_enc) @ W_dec + b_dec, read: the decoder's input is staged through scratch"""
    p = Program()
    f = sae_features(p, F, gen, k, activation, top)
    p.op("add", p.matmul(f, randn(k, F, gen=gen) / k**0.5), p.const(randn(F, gen=gen)), shape=(F,))
    return p.build()


def sae_feature_read(F, gen, k=256):
    """the k SAE features, read"""
    p = Program()
    sae_features(p, F, gen, k, "topk", 16)
    return p.build()


def norm_read(F, gen):
    p = Program()
    p.op("norm", p.op("x", shape=(F,)), shape=())
    return p.build()


def matmul_gate(F, gen):
    """x + relu(x @ u) * v, the gate as a one-output matmul (as `act @ u` lowers). u / sqrt(F), as
    the other gates: with a unit-variance u the gate grows as sqrt(F), and at F = 4096 an output
    that cancels to near 0 carries that product's fp32 rounding (~1e-4; any summation order: the
    interpreter and the GPU both missed a 1e-5 tolerance there by as much)"""
    p = Program()
    x = p.op("x", shape=(F,))
    gate = p.op("relu", p.matmul(x, randn(F, 1, gen=gen) / F**0.5), shape=(1,))
    p.op("add", x, p.op("mul", gate, p.const(randn(F, gen=gen)), shape=(F,)), shape=(F,))
    return p.build()


WRITES = [steering_gate, matmul_gate, clamp, gated_ablation, norm_rescale, patching, sae_clamp]
READS = [softmax_dot, norm_read, sae_reconstruction, sae_feature_read]


def run_both(make, F, dtype, gen, T=40, R=27, capacity=50, block_rows=None):
    """The launcher and the twin on one random case; asserts they agree and touch only their rows.
    `block_rows`: the rows a program takes, else the launcher's choice."""
    program = make(F, gen)
    kernel = program_kernel.generate_kernel(program, F)[0]

    def launch(*args):
        kernel(*args, block_rows=block_rows)
    x = randn(T, F, gen=gen, dtype=dtype)
    rows = random_subset(T, R, gen)
    table_index = torch.randint(0, 7, (R,), generator=gen, dtype=torch.int32)
    if program.ops[program.output].shape == (F,) and make not in READS:
        expected, actual = x.clone(), x.clone()
        program_torch.run_program_torch(expected, rows, program, table_index)
        launch(actual, rows, program, table_index)
        untouched = torch.ones(T, dtype=torch.bool)
        untouched[rows.long()] = False
        assert torch.equal(actual[untouched], x[untouched])  # bit for bit
        assert_matches(actual[rows.long()], expected[rows.long()], noise=1e-4)
    else:
        width = math.prod(program.ops[program.output].shape)
        dest = random_subset(capacity, R, gen)
        poisoned = torch.full((capacity, width), SENTINEL)
        expected, actual = poisoned.clone(), poisoned.clone()
        program_torch.run_program_torch(x, rows, program, table_index, expected, dest)
        launch(x, rows, program, table_index, actual, dest)
        unwritten = torch.ones(capacity, dtype=torch.bool)
        unwritten[dest.long()] = False
        assert torch.equal(actual[unwritten], poisoned[unwritten])
        assert_matches(actual[dest.long()], expected[dest.long()], noise=1e-4)


# --- the launcher against the twin ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", WRITES + READS)
def test_launcher_matches_twin(make, dtype, gen):
    F = 64 if make.__name__.startswith("sae") else 200  # SAEs: n = 64, k = 256; else F not a power of two
    run_both(make, F, dtype, gen)


@pytest.mark.parametrize("make", [m for m in WRITES + READS if not m.__name__.startswith("sae")])
def test_fewer_rows_a_program_match_the_twin(make, gen):
    """A launch of few rows on a GPU gives its programs fewer rows each (launch_block_rows): the same
    results at 1 and 2 rows a program; refused for a kernel whose tl.dot needs its 16."""
    kernel = program_kernel.generate_kernel(make(200, gen), 200)[0]
    assert not kernel.plan.dots and kernel.plan.block_rows > 2
    for block_rows in (1, 2):
        run_both(make, 200, torch.float32, gen, block_rows=block_rows)


def test_a_launch_of_few_rows_on_a_gpu_gives_its_programs_fewer(gen, monkeypatch):
    """launch_block_rows: every SM a program where the rows allow it; tl.dot's 16 rows kept; the
    plan's rows on the CPU."""
    monkeypatch.setattr(program_kernel, "sm_count", lambda device: 132)
    gate, sae = (program_kernel.generate_kernel(make(4096, gen), 4096)[0].plan for make in (matmul_gate, sae_feature_read))
    gpu = torch.device("cuda", 0)
    assert gate.block_rows == 4 and sae.block_rows == 16 and sae.dots
    assert [program_kernel.launch_block_rows(gate, R, gpu) for R in (1, 32, 256, 264, 528, 4096)] == [1, 1, 1, 2, 4, 4]
    assert program_kernel.launch_block_rows(sae, 32, gpu) == 16
    assert program_kernel.launch_block_rows(gate, 32, torch.device("cpu")) == 4


def test_launch_row_counts_reach_every_launch_configuration_once(gen, monkeypatch):
    """launch_row_counts: one row count per (rows a program takes, split of the matmuls of x) that
    launches of 1 to 8,192 rows take on a GPU of 132 SMs, each configuration once; one on the CPU."""
    monkeypatch.setattr(program_kernel, "sm_count", lambda device: 132)
    monkeypatch.setattr(split_matmul, "sm_count", lambda device: 132)
    gpu, most = torch.device("cuda", 0), 8192
    for make in (matmul_gate, sae_feature_read):
        program = make(4096, gen)
        kernel_plan = program_kernel.generate_kernel(program, 4096)[0].plan

        def configuration(R):
            return (program_kernel.launch_block_rows(kernel_plan, R, gpu),
                    split_matmul.split_count(kernel_plan.F, R, gpu) if kernel_plan.split else 1)

        counts = program_kernel.launch_row_counts(program, 4096, gpu, most)
        reached = {configuration(R) for R in range(1, most + 1)}
        assert len(reached) > 1 and sorted(map(configuration, counts)) == sorted(reached)
        assert program_kernel.launch_row_counts(program, 4096, torch.device("cpu"), most) == [1]


def test_fewer_rows_for_tl_dot_or_not_a_power_of_two_are_refused(gen):
    x, rows = randn(4, 64, gen=gen), torch.arange(4, dtype=torch.int32)
    program = sae_clamp(64, gen)
    kernel = program_kernel.generate_kernel(program, 64)[0]
    assert kernel.plan.dots
    with pytest.raises(ValueError, match="block_rows=4: this kernel takes 16 rows a program$"):
        kernel(x, rows, program, None, block_rows=4)
    program = steering_gate(64, gen)
    with pytest.raises(ValueError, match="block_rows=3: .* or fewer in a power of two"):
        program_kernel.generate_kernel(program, 64)[0](x, rows, program, None, block_rows=3)


@pytest.mark.parametrize("F, k", [(64, 256), (96, 200)])
@pytest.mark.parametrize("activation", ["relu", "topk"])
def test_sae_clamp_matches_plain_torch(activation, F, k, gen):
    """x + (c - f_i) * W_dec[i], with f = relu(x @ W_enc + b) or relu(top-k of it), as one would write it."""
    top, feature, value = 8, 5, 4.0
    program = sae_clamp(F, gen, k, activation, top, feature, value)
    W_enc, b_enc, W_dec_i = program.consts[0], program.consts[1], program.consts[3][0]
    x = randn(20, F, gen=gen)
    rows = random_subset(20, 13, gen)

    pre = x[rows.long()] @ W_enc + b_enc
    if activation == "topk":
        pre = torch.where(pre >= pre.topk(top, dim=-1).values[:, -1:], pre, 0.0)
    f_i = pre.relu()[:, feature]
    expected = x.clone()
    expected[rows.long()] += (value - f_i)[:, None] * W_dec_i
    program_kernel.run_program(x, rows, program, None)
    assert_matches(x, expected, noise=1e-4)


EVERY_OP = ["neg", "abs", "relu", "gelu", "sigmoid", "tanh", "exp", "log", "logical_not", "pow 2", "pow -3", "pow 0.5",
            "pow -0.5", "pow 1.5", "pow 7", "mean", "max", "min", "sum", "softmax", "topk_mask 3", "ge", "lt", "le",
            "eq", "ne", "logical_and", "logical_or", "clamp low", "clamp high", "unsqueeze"]


def one_op(name, F, gen):
    """One op applied to x, written back when (F,) (log and fractional pows see |x| + 0.5)."""
    p = Program()
    x = p.op("x", shape=(F,))
    name, _, number = name.partition(" ")
    if name in ("log", "pow") and number not in ("2", "-3", "7"):
        x = p.op("add", p.op("abs", x, shape=(F,)), 0.5, shape=(F,))
    if name == "pow":
        p.op("pow", x, float(number), shape=(F,))
    elif name == "topk_mask":
        p.op("topk_mask", x, int(number), shape=(F,))
    elif name == "clamp":
        p.op("clamp", x, -0.3 if number == "low" else None, 0.2 if number == "high" else None, shape=(F,))
    elif name in ("mean", "max", "min", "sum"):
        p.op(name, x, shape=())
    elif name == "unsqueeze":
        p.op("unsqueeze", p.op("max", x, shape=()), shape=(1,))
    elif name in ("logical_and", "logical_or"):
        positive = p.op("gt", x, 0.0, shape=(F,))
        p.op(name, positive, p.const(torch.randint(0, 2, (F,), generator=gen).float()), shape=(F,))
    elif program_format.ARGS[name] == ("value", "value"):  # against the row's maximum, so that one lane ties
        p.op(name, x, p.op("max", x, shape=()), shape=(F,))
    else:
        p.op(name, x, shape=(F,))
    return p.build()


@pytest.mark.parametrize("name", EVERY_OP)
def test_every_op(name, gen):
    run_both(lambda F, gen: one_op(name, F, gen), 96, torch.float32, gen)


# --- the twin against loops ----------------------------------------------------------------------
def test_twin_matches_a_loop(gen):
    """steering_gate and softmax_dot, token by token and feature by feature."""
    T, F = 5, 3
    x = randn(T, F, gen=gen)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32)

    gate = steering_gate(F, gen)
    d, v = gate.consts
    expected = x.clone()
    for r in rows.tolist():
        g = max(sum(x[r, f] * d[f] for f in range(F)), 0.0)
        for f in range(F):
            expected[r, f] = x[r, f] + g * v[f]
    actual = x.clone()
    program_torch.run_program_torch(actual, rows, gate, None)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)

    attend = softmax_dot(F, gen)
    (q,) = attend.consts
    out, dest = torch.full((4, 1), SENTINEL), torch.tensor([1, 3, 0], dtype=torch.int32)
    expected = out.clone()
    for i, r in enumerate(rows.tolist()):
        exps = [math.exp(float(x[r, f])) for f in range(F)]
        expected[dest[i], 0] = sum(e / sum(exps) * float(q[f]) for f, e in enumerate(exps))
    program_torch.run_program_torch(x, rows, attend, None, out, dest)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k, kept", [(1, [3, 0, 3, 0, 0]), (2, [3, 0, 3, 0, 0]), (3, [3, 0, 3, 2, 0]),
                                     (5, [3, 1, 3, 2, -1])])
def test_topk_mask_keeps_ties(k, kept):
    """The k-th largest counts tied values once each; every lane tied with it stays."""
    p = Program()
    p.op("topk_mask", p.op("x", shape=(5,)), k, shape=(5,))
    program = p.build()
    x = torch.tensor([[3.0, 1.0, 3.0, 2.0, -1.0]])
    rows = torch.tensor([0], dtype=torch.int32)
    for run in (program_torch.run_program_torch, program_kernel.run_program):
        out = torch.full((1, 5), SENTINEL)
        run(x, rows, program, None, out, rows)
        assert out[0].tolist() == kept


# --- generation: once per structure ----------------------------------------------------------------
def test_new_constants_and_numbers_reuse_the_kernel(gen):
    F = 97  # no other test uses it: their kernels are cached too
    generations = len(program_kernel._kernels)
    generate = program_kernel.generate_kernel
    first, seconds = generate(sae_clamp(F, gen, k=128, activation="topk", top=4, value=1.0), F)
    again, seconds_again = generate(sae_clamp(F, gen, k=128, activation="topk", top=9, value=-2.0), F)
    assert again is first and seconds_again == 0.0 and len(program_kernel._kernels) == generations + 1
    assert first.seconds > 0 and inspect.getsource(first.fn.fn).startswith("@triton.jit")
    assert isinstance(first.fn, InterpretedFunction)  # conftest set TRITON_INTERPRET=1 before the import
    other, other_seconds = program_kernel.generate_kernel(sae_clamp(F, gen, k=64, activation="topk"), F)
    assert other is not first and other_seconds > 0 and len(program_kernel._kernels) == generations + 2

    # the kernel reads the numbers (k, the clamp value, the bounds) at launch
    for high in (0.25, 1.5):
        program = clamp(F, gen, high=high)
        kernel, _ = program_kernel.generate_kernel(program, F)
        x = randn(20, F, gen=gen)
        rows = random_subset(20, 11, gen)
        expected, actual = x.clone(), x.clone()
        program_torch.run_program_torch(expected, rows, program, None)
        kernel(actual, rows, program, None)
        assert torch.equal(actual, expected)
    assert program_kernel.generate_kernel(clamp(F, gen, high=None), F)[1] > 0  # a missing bound is structure


def test_docstring_example_is_current(gen):
    """program_kernel's module docstring shows the kernel generated for steering_gate with F = 200."""
    kernel, _ = program_kernel.generate_kernel(steering_gate(200, gen), 200)
    code = kernel.source[kernel.source.index("@triton.jit"):].rstrip("\n")
    print(kernel.source)
    assert "\n".join("    " + line if line else "" for line in code.split("\n")) in program_kernel.__doc__


def test_no_rows_is_a_no_op(gen):
    x, out = randn(8, 96, gen=gen), torch.full((4, 1), SENTINEL)
    none = torch.zeros(0, dtype=torch.int32)
    before_x, before_out = x.clone(), out.clone()
    for run in (program_kernel.run_program, program_torch.run_program_torch):
        run(x, none, steering_gate(96, gen), None)
        run(x, none, softmax_dot(96, gen), None, out, none)
    assert torch.equal(x, before_x) and torch.equal(out, before_out)


def test_gated_rows_are_skipped(gen):
    """A row of -1 (a token gated off in a graph-replayed step) is neither written nor read."""
    F, T = 96, 20
    x = randn(T, F, gen=gen)
    live = random_subset(T, 7, gen)
    rows = torch.full((T,), -1, dtype=torch.int32)
    rows[live.long()] = live
    dest = torch.arange(T, dtype=torch.int32)
    write, read = steering_gate(F, gen), softmax_dot(F, gen)
    for run in (program_kernel.run_program, program_torch.run_program_torch):
        gated, expected = x.clone(), x.clone()
        run(gated, rows, write, None)
        program_torch.run_program_torch(expected, live, write, None)
        assert_matches(gated, expected)
        out, reference = torch.full((T, 1), SENTINEL), torch.full((T, 1), SENTINEL)
        run(x, rows, read, None, out, dest)
        program_torch.run_program_torch(x, live, read, None, reference, live)
        assert_matches(out, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [steering_gate, sae_clamp])
def test_a_write_with_a_renorm_normalises_the_rows_it_wrote(make, dtype, gen):
    """A write at a residual site (kernels/rms_norm_rows.py's Renorm): the kernel also makes the
    norm's output again on the rows it wrote, from the values it stored, in the same launch."""
    F, T, eps = (64 if make is sae_clamp else 200), 30, 1e-5
    program = make(F, gen)
    x = randn(T, F, gen=gen, dtype=dtype)
    live = random_subset(T, 11, gen)
    rows = torch.full((T,), -1, dtype=torch.int32)
    rows[live.long()] = live
    weight, poisoned = randn(F, gen=gen, dtype=dtype), torch.full((T, F), SENTINEL, dtype=dtype)
    written = {}
    for run in (program_kernel.run_program, program_torch.run_program_torch):
        y, out = x.clone(), poisoned.clone()
        run(y, rows, program, None, renorm=Renorm(weight, eps, out))
        off = rows < 0
        assert torch.equal(y[off], x[off]) and torch.equal(out[off], poisoned[off])
        renormalized = poisoned.clone()  # the norm of what this launch itself wrote
        rms_norm_rows_torch(y, rows, weight, eps, renormalized)
        assert_matches(out[live.long()], renormalized[live.long()], roundings=3)
        written[run] = y
    assert_matches(written[program_kernel.run_program], written[program_torch.run_program_torch], noise=1e-4)


# --- matmuls of x split over programs, summed by the last to arrive (split_matmul.py) -----------------------------------------------
SPLIT = [lambda F, gen: sae_feature_read(F, gen, k=64), sae_reconstruction, sae_clamp]


@pytest.mark.parametrize("split_k", [2, 4])
@pytest.mark.parametrize("make", SPLIT)
def test_split_matmuls_match_the_twin(make, split_k, gen):
    """A launch that splits its matmuls of x gives the twin's result (gated-off rows included), and
    the same result as the unsplit launch to fp32 rounding."""
    F, T = 600, 40
    program = make(F, gen)
    kernel, _ = program_kernel.generate_kernel(program, F)
    assert kernel.plan.split, "the program has a tl.dot matmul of x"
    x = randn(T, F, gen=gen)
    rows = random_subset(T, 27, gen)
    rows[5] = -1
    live = rows[rows >= 0]
    if make is sae_clamp:  # the write; the others read
        expected, split, unsplit = x.clone(), x.clone(), x.clone()
        program_torch.run_program_torch(expected, live, program, None)
        kernel(split, rows, program, None, split_k=split_k)
        kernel(unsplit, rows, program, None, split_k=1)
    else:
        width = math.prod(program.ops[program.output].shape)
        dest = random_subset(T, 27, gen)
        expected, split, unsplit = (torch.full((T, width), SENTINEL) for _ in range(3))
        program_torch.run_program_torch(x, live, program, None, expected, dest[rows >= 0])
        kernel(x, rows, program, None, split, dest, split_k=split_k)
        kernel(x, rows, program, None, unsplit, dest, split_k=1)
    assert_matches(split, expected)
    torch.testing.assert_close(split, unsplit, rtol=1e-5, atol=1e-5)
    assert not split_matmul.arrival_counters(x.device).any(), "a launch leaves the arrival counters at zero"


def test_split_count_gives_each_sm_two_programs_at_most(monkeypatch):
    monkeypatch.setattr(split_matmul, "sm_count", lambda device: 132)
    gpu = torch.device("cuda", 0)
    assert [split_matmul.split_count(4096, R, gpu) for R in (32, 256, 512, 2048, 4096)] == [16, 16, 8, 2, 1]
    assert split_matmul.split_count(1024, 32, gpu) == 4  # shares of MIN_CHUNK features at least
    assert split_matmul.split_count(4096, 32, torch.device("cpu")) == 1


def test_a_split_launch_of_gated_off_rows_leaves_everything_alone(gen):
    """Every row -1 (an idle step): no program stores a partial, counts in or writes."""
    F, T = 600, 40
    program = sae_clamp(F, gen)
    kernel, _ = program_kernel.generate_kernel(program, F)
    x = randn(T, F, gen=gen)
    y = x.clone()
    kernel(y, torch.full((27,), -1, dtype=torch.int32), program, None, split_k=4)
    assert torch.equal(y, x) and not split_matmul.arrival_counters(x.device).any()


def test_a_launch_of_too_many_row_blocks_to_split_is_refused(gen):
    F = 600
    program = sae_feature_read(F, gen, k=64)
    kernel, _ = program_kernel.generate_kernel(program, F)
    R = (split_matmul.ARRIVAL_COUNTERS + 1) * kernel.plan.block_rows
    x, rows = randn(R, F, gen=gen), torch.arange(R, dtype=torch.int32)
    with pytest.raises(ValueError, match="does not split its matmuls"):
        kernel(x, rows, program, None, torch.zeros(R, 64), rows, split_k=2)


# --- what is refused ---------------------------------------------------------------------------------
def test_malformed_programs_are_refused(gen):
    F, x = 96, randn(4, 96, gen=gen)
    rows = torch.arange(4, dtype=torch.int32)
    p = Program()
    p.op("sum", p.op("x", shape=(F,)), shape=(F,))
    with pytest.raises(ValueError, match=r"op 1 \(sum\): declared shape \(96,\)"):
        program_kernel.run_program(x, rows, p.build(), None)
    p = Program()
    p.op("add", p.op("x", shape=(F,)), p.const(torch.ones(5)), shape=(F,))
    with pytest.raises(ValueError, match="do not broadcast"):
        program_torch.run_program_torch(x, rows, p.build(), None)
    with pytest.raises(ValueError, match="a write's result has shape"):
        program_kernel.run_program(x, rows, softmax_dot(F, gen), None)
    with pytest.raises(ValueError, match="const 0 must be fp32"):
        program = steering_gate(F, gen)
        program.consts[0] = program.consts[0][:50]
        program_kernel.run_program(x, rows, program, None)


def test_limits_are_named(gen):
    wide = Program()
    wide.matmul(wide.op("x", shape=(96,)), torch.zeros(96, program_format.MAX_LANES + 1))
    with pytest.raises(NotImplementedError, match=r"op 1 \(matmul\): a value of 8193 features"):
        program_kernel.generate_kernel(wide.build(), 96)
    many = Program()
    many.op("topk_mask", many.op("x", shape=(200,)), program_format.MAX_TOPK + 1, shape=(200,))
    x, rows = randn(2, 200, gen=gen), torch.arange(2, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=r"op 1 \(topk_mask\): k = 129"):
        program_kernel.run_program(x, rows, many.build(), None, torch.zeros(2, 200), rows)


# --- the real compiler ---------------------------------------------------------------------------
def sm90_job(make, F, write, renorm=False, block_rows=None):
    """What compiling make(F)'s kernel for an sm_90 GPU (H100, H200) with bf16 x takes (at
    `block_rows` rows a program: the plan's by default)."""
    kernel, _ = program_kernel.generate_kernel(make(F, torch.Generator().manual_seed(0)), F)
    plan = kernel.plan
    block_rows = block_rows or plan.block_rows
    pointers = {"x_ptr": "*bf16", "rows_ptr": "*i32", "table_index_ptr": "*i32", "dest_ptr": "*i32", "arrivals_ptr": "*i32",
                "out_ptr": "*bf16" if write else "*fp32", "scratch_ptr": "*fp32", "weight_ptr": "*bf16", "eps": "fp32"}
    signature = {name: pointers.get(name, "*fp32" if name.endswith("_ptr") else "i32") for name in kernel.fn.arg_names}
    for m, (i, _) in enumerate(plan.numbers):
        signature[f"s{m}"] = "i32" if plan.ops[i][0] == "topk_mask" else "fp32"
    constexprs = {"WRITE": write, "BLOCK_ROWS": block_rows, "SCRATCH_WIDTH": plan.scratch_width}
    if plan.writable:
        constexprs["RENORM"] = renorm
    if plan.split:  # as a decode step's launch splits it
        constexprs.update(SPLIT_K=split_matmul.MAX_SPLIT, SPLIT_WIDTH=plan.split_width,
                          SPLIT_CHUNK=split_matmul.split_chunk(F, split_matmul.MAX_SPLIT))
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return str(kernel.path), "program_kernel", signature, constexprs, plan.warps(block_rows)


def affine_write_row_job(F, K, renorm):
    """Compiling affine_write's row kernel as the launcher calls it for bf16 x, with a renorm or not."""
    template = sys.modules["xmix_lens.kernels.affine_write"]  # the package's name is the launcher's
    fn = template.affine_write_row_kernel
    pointers = {"x_ptr": "*bf16", "rows_ptr": "*i32", "scale_idx_ptr": "*i32", "bias_idx_ptr": "*i32",
                "weight_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"}
    signature = {name: pointers.get(name, "*fp32" if name.endswith("_ptr") else "i32") for name in fn.arg_names}
    rank, tile = triton.next_power_of_2(max(K, 1)), min(triton.next_power_of_2(F), template.MAX_ROW_TILE)
    constexprs = {"BLOCK_FEATURES": tile, "BLOCK_RANK": rank, "HAS_LOW_RANK": K > 0, "RENORM": renorm}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return template.__name__, "affine_write_row_kernel", signature, constexprs, template.row_warps(tile)


# Runs in a process of its own: there the generated files import as plain @triton.jit kernels
# (the interpreter, on in this process, also patches triton.language, which compiling needs).
COMPILE = """
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for where, name, signature, constexprs, num_warps in json.load(sys.stdin):
    if where.endswith(".py"):  # a generated file
        spec = importlib.util.spec_from_file_location("generated_kernel", where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    source = ASTSource(fn=getattr(module, name), signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
"""


@pytest.mark.skipif("nvidia" not in triton.backends.backends, reason="Triton without its NVIDIA backend")
def test_kernels_compile_for_a_gpu():
    """The interpreter runs code that Triton's compiler refuses; CI has no GPU, but compiling needs none."""
    jobs = [sm90_job(make, 64 if make.__name__.startswith("sae") else 200, make in WRITES) for make in WRITES + READS]
    for name in ("gelu", "tanh", "pow 1.5", "pow 7", "pow -0.5", "logical_or", "unsqueeze", "min", "clamp high"):
        jobs.append(sm90_job(lambda F, gen: one_op(name, F, gen), 96, False))
    jobs += [sm90_job(make, 200 if make is steering_gate else 64, True, renorm=True) for make in (steering_gate, sae_clamp)]
    jobs += [sm90_job(sae_feature_read, 4096, False), sm90_job(sae_reconstruction, 600, False)]
    jobs += [sm90_job(matmul_gate, 4096, True, renorm=True, block_rows=1), sm90_job(softmax_dot, 4096, False, block_rows=2)]
    jobs += [affine_write_row_job(4096, K, renorm) for K, renorm in ((0, True), (1, True), (1, False))]
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], input=json.dumps(jobs), env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_narrow_matmul_of_a_wide_row_takes_tiles_not_a_loop_per_feature(gen):
    """At an 8B model's width the gate's x @ u (one output, row blocks of 4: no tl.dot) sums
    broadcast products over two 2048-feature tiles; it was 4,096 dependent rank-1 updates."""
    kernel, _ = program_kernel.generate_kernel(matmul_gate(4096, gen), 4096)
    source = kernel.path.read_text()
    assert kernel.plan.block_rows == 4 and program_format.narrow_tile(4096, 1, 4) == 2048
    assert "for f0 in range(0, 4096, 2048):" in source and "tl.sum(in_tile[:, :, None] * w_tile[None, :, :]" in source
    assert "for j in range(4096)" not in source
