"""The Triton templates against their torch twins (interpreter, CPU), the twins against loops."""


import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from xmix_lens import kernels
from xmix_lens.kernels.affine_write import affine_write_kernel

from kernel_checks import SENTINEL, assert_matches, gen, random_subset, randn  # noqa: F401 (gen: fixture)

# conftest.py sets TRITON_INTERPRET=1 before anything imports the kernels (no GPU in CI)
if not isinstance(affine_write_kernel, InterpretedFunction):
    raise RuntimeError("xmix_lens.kernels was imported before TRITON_INTERPRET=1 was set (see conftest.py)")


# --- the twins against loops that are obviously right --------------------------------------

def test_affine_write_twin_matches_a_loop(gen):
    T, F, K = 7, 5, 2
    x = randn(T, F, gen=gen)
    rows = torch.tensor([4, 0, 6], dtype=torch.int32)
    scale, scale_idx = randn(2, F, gen=gen), torch.tensor([1, 0, 1], dtype=torch.int32)
    bias, bias_idx = randn(3, F, gen=gen), torch.tensor([2, 2, 0], dtype=torch.int32)
    U, V = randn(F, K, gen=gen), randn(K, F, gen=gen)

    expected = x.clone()
    for i, r in enumerate(rows.tolist()):
        for f in range(F):
            low_rank = sum(sum(x[r, g] * U[g, k] for g in range(F)) * V[k, f] for k in range(K))
            expected[r, f] = x[r, f] * scale[scale_idx[i], f] + bias[bias_idx[i], f] + low_rank

    kernels.affine_write_torch(x, rows, scale, scale_idx, bias, bias_idx, U, V)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)


def test_gather_rows_twin_matches_a_loop(gen):
    x = randn(6, 4, gen=gen, dtype=torch.bfloat16)
    rows, dest = torch.tensor([5, 1], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    out = torch.full((4, 4), SENTINEL)
    expected = out.clone()
    for i in range(2):
        for f in range(4):
            expected[dest[i], f] = float(x[rows[i], f])

    kernels.gather_rows_torch(x, rows, out, dest)
    assert torch.equal(out, expected)


def test_project_read_twin_matches_a_loop(gen):
    F, K = 5, 3
    x = randn(6, F, gen=gen)
    rows, dest = torch.tensor([2, 5, 0], dtype=torch.int32), torch.tensor([3, 0, 1], dtype=torch.int32)
    W, b = randn(F, K, gen=gen), randn(K, gen=gen)
    out = torch.full((5, K), SENTINEL)
    expected = out.clone()
    for i in range(3):
        for k in range(K):
            expected[dest[i], k] = sum(x[rows[i], f] * W[f, k] for f in range(F)) + b[k]

    kernels.project_read_torch(x, rows, W, b, out, dest)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_rms_norm_rows_twin_matches_a_loop(gen):
    F, eps = 5, 1e-5
    x, weight = randn(6, F, gen=gen), randn(F, gen=gen)
    rows = torch.tensor([4, -1, 1], dtype=torch.int32)
    out = torch.full((6, F), SENTINEL)
    expected = out.clone()
    for r in (4, 1):
        rms = (sum(float(x[r, f]) ** 2 for f in range(F)) / F + eps) ** 0.5
        for f in range(F):
            expected[r, f] = float(x[r, f]) / rms * float(weight[f])

    kernels.rms_norm_rows_torch(x, rows, weight, eps, out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_next_token_nll_twin_matches_a_loop(softcap, gen):
    import math
    N, V = 4, 6
    logits, bias = randn(N, V, gen=gen) * 4, randn(V, gen=gen)
    targets = torch.tensor([5, -1, 0, 2])
    nll = torch.full((N,), SENTINEL)
    expected = nll.clone()
    for n in (0, 2, 3):
        z = [float(logits[n, v] + bias[v]) for v in range(V)]
        z = [softcap * math.tanh(x / softcap) for x in z] if softcap else z
        expected[n] = math.log(sum(math.exp(x) for x in z)) - z[targets[n]]

    kernels.next_token_nll_torch(logits, bias, targets, nll, softcap)
    torch.testing.assert_close(nll, expected, rtol=1e-5, atol=1e-5)


# --- the Triton launchers against the twins ---------------------------------------------------
# T, R and F are not multiples of the kernels' blocks (16 or 32 rows, 128 features).

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# K of 1 to 16 takes the one-row-a-program kernel, K = 20 the row blocks with tl.dot
@pytest.mark.parametrize("F, K", [(129, 3), (576, 0), (1000, 1), (300, 16), (200, 20)])
def test_affine_write(dtype, F, K, gen):
    T, R = 150, 77
    x = randn(T, F, gen=gen, dtype=dtype)
    rows = random_subset(T, R, gen)
    scale, bias = randn(3, F, gen=gen), randn(5, F, gen=gen)
    scale_idx = torch.randint(0, 3, (R,), generator=gen, dtype=torch.int32)
    bias_idx = torch.randint(0, 5, (R,), generator=gen, dtype=torch.int32)
    U, V = randn(F, K, gen=gen) / F**0.5, randn(K, F, gen=gen)

    # The interpreter runs programs one after another, so a program that read a row another had
    # already overwritten (the low-rank race) fails here deterministically.
    expected, actual = x.clone(), x.clone()
    kernels.affine_write_torch(expected, rows, scale, scale_idx, bias, bias_idx, U, V)
    kernels.affine_write(actual, rows, scale, scale_idx, bias, bias_idx, U, V)

    untouched = torch.ones(T, dtype=torch.bool)
    untouched[rows.long()] = False
    assert torch.equal(actual[untouched], x[untouched])  # bit for bit
    assert_matches(actual[rows.long()], expected[rows.long()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# K = 0 and 3: the row kernel with the renorm as its epilogue (F = 5000: a row in two tiles);
# K = 20: the row blocks, then the renorm's own launch
@pytest.mark.parametrize("F, K", [(129, 0), (5000, 0), (300, 3), (200, 20)])
def test_affine_write_with_a_renorm(dtype, F, K, gen):
    """A write at a residual site: the rows it wrote (gated rows are not) also get their norm made
    again, from the values it stored; other rows of the norm's output are untouched."""
    T, eps = 40, 1e-6
    x = randn(T, F, gen=gen, dtype=dtype)
    rows = torch.full((T,), -1, dtype=torch.int32)  # control rows: the token's index where on, else -1
    on = random_subset(T, 17, gen).long()
    rows[on] = on.int()
    scale, bias = randn(1, F, gen=gen), randn(1, F, gen=gen)
    idx = torch.zeros(T, dtype=torch.int32)
    U, V = randn(F, K, gen=gen) / F**0.5, randn(K, F, gen=gen)
    weight, poisoned = randn(F, gen=gen, dtype=dtype), torch.full((T, F), SENTINEL, dtype=dtype)

    expected, actual = x.clone(), x.clone()
    expected_out, actual_out = poisoned.clone(), poisoned.clone()
    kernels.affine_write_torch(expected, rows, scale, idx, bias, idx, U, V, kernels.Renorm(weight, eps, expected_out))
    kernels.affine_write(actual, rows, scale, idx, bias, idx, U, V, kernels.Renorm(weight, eps, actual_out))

    off = rows < 0
    assert torch.equal(actual[off], x[off]) and torch.equal(actual_out[off], poisoned[off])
    assert_matches(actual[on], expected[on])
    renormalized = poisoned.clone()  # the norm of what the kernel itself wrote
    kernels.rms_norm_rows_torch(actual, rows, weight, eps, renormalized)
    assert_matches(actual_out[on], renormalized[on], roundings=3)  # see test_rms_norm_rows


def test_affine_write_projects_a_direction_out(gen):
    T, F = 40, 200
    x = randn(T, F, gen=gen)
    d = randn(F, gen=gen)
    d /= d.norm()
    rows = random_subset(T, 33, gen)
    one, zero, idx = torch.ones(1, F), torch.zeros(1, F), torch.zeros(33, dtype=torch.int32)

    kernels.affine_write(x, rows, one, idx, zero, idx, d[:, None].clone(), -d[None, :].clone())
    assert (x[rows.long()] @ d).abs().max() < 1e-4


@pytest.mark.parametrize("x_dtype, out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("F", [129, 1000])
def test_gather_rows(x_dtype, out_dtype, F, gen):
    T, R, capacity = 150, 77, 100
    x = randn(T, F, gen=gen, dtype=x_dtype)
    rows, dest = random_subset(T, R, gen), random_subset(capacity, R, gen)
    poisoned = torch.full((capacity, F), SENTINEL, dtype=out_dtype)

    expected, actual = poisoned.clone(), poisoned.clone()
    kernels.gather_rows_torch(x, rows, expected, dest)
    kernels.gather_rows(x, rows, actual, dest)

    unwritten = torch.ones(capacity, dtype=torch.bool)
    unwritten[dest.long()] = False
    assert torch.equal(actual[unwritten], poisoned[unwritten])
    assert_matches(actual[dest.long()], expected[dest.long()])


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
# K of 1 to 16 takes the one-row-a-program kernel, more the row blocks with tl.dot
@pytest.mark.parametrize("F, K", [(129, 1), (576, 3), (300, 16), (200, 17), (1000, 100)])
def test_project_read(x_dtype, F, K, gen):
    T, R, capacity = 150, 77, 100
    x = randn(T, F, gen=gen, dtype=x_dtype)
    rows, dest = random_subset(T, R, gen), random_subset(capacity, R, gen)
    W, b = randn(F, K, gen=gen) / F**0.5, randn(K, gen=gen)
    poisoned = torch.full((capacity, K), SENTINEL)

    expected, actual = poisoned.clone(), poisoned.clone()
    kernels.project_read_torch(x, rows, W, b, expected, dest)
    kernels.project_read(x, rows, W, b, actual, dest)

    unwritten = torch.ones(capacity, dtype=torch.bool)
    unwritten[dest.long()] = False
    assert torch.equal(actual[unwritten], poisoned[unwritten])
    assert_matches(actual[dest.long()], expected[dest.long()])


def test_no_rows_is_a_no_op(gen):
    x, out = randn(8, 129, gen=gen), torch.full((4, 129), SENTINEL)
    none = torch.zeros(0, dtype=torch.int32)
    before_x, before_out = x.clone(), out.clone()
    kernels.affine_write(x, none, torch.ones(1, 129), none, torch.ones(1, 129), none,
                         torch.ones(129, 2), torch.ones(2, 129))
    kernels.gather_rows(x, none, out, none)
    kernels.project_read(x, none, torch.ones(129, 129), torch.ones(129), out, none)
    assert torch.equal(x, before_x) and torch.equal(out, before_out)


# --- gating: a row of -1 is a token the launch leaves alone ---------------------------------------
# Graph-replayed steps launch every resident op over all of the step's tokens; the host gates
# tokens off by writing -1 into the op's fixed rows buffer. Gated-off tokens must be untouched.

@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_gated_rows_are_skipped_by_every_template(impl, gen):
    T, F, K, capacity = 40, 129, 2, 40
    x = randn(T, F, gen=gen)
    live = random_subset(T, 17, gen)
    rows = torch.full((T,), -1, dtype=torch.int32)
    rows[live.long()] = live  # a gated rows buffer: token t at entry t, or -1
    dest = torch.arange(T, dtype=torch.int32)
    ops = (kernels if impl == "triton" else
           type("twins", (), {n: staticmethod(getattr(kernels, n + "_torch"))
                              for n in ("affine_write", "gather_rows", "project_read")}))
    scale, bias, U, V = randn(1, F, gen=gen), randn(1, F, gen=gen), randn(F, K, gen=gen) / F, randn(K, F, gen=gen)
    zeros = torch.zeros(T, dtype=torch.int32)

    gated, expected = x.clone(), x.clone()
    ops.affine_write(gated, rows, scale, zeros, bias, zeros, U, V)
    kernels.affine_write_torch(expected, live, scale, zeros[:17], bias, zeros[:17], U, V)
    assert_matches(gated, expected)

    W, b = randn(F, K, gen=gen), randn(K, gen=gen)
    for launch, width, args in (("gather_rows", F, ()), ("project_read", K, (W, b))):
        out = torch.full((capacity, width), SENTINEL)
        getattr(ops, launch)(x, rows, *args, out, dest)
        reference = torch.full((capacity, width), SENTINEL)
        getattr(kernels, launch + "_torch")(x, live, *args, reference, live)
        assert_matches(out, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("F", [129, 2500])  # 2500: a row wider than the kernel's tile, in two
def test_rms_norm_rows(dtype, F, gen):
    T, eps = 40, 1e-6
    x, weight = randn(T, F, gen=gen, dtype=dtype), randn(F, gen=gen, dtype=dtype)
    rows = torch.full((T,), -1, dtype=torch.int32)  # control rows: the token's index where on, else -1
    on = random_subset(T, 17, gen).long()
    rows[on] = on.int()
    poisoned = torch.full((T, F), SENTINEL, dtype=dtype)

    expected, actual = poisoned.clone(), poisoned.clone()
    kernels.rms_norm_rows_torch(x, rows, weight, eps, expected)
    kernels.rms_norm_rows(x, rows, weight, eps, actual)

    off = rows < 0
    assert torch.equal(actual[off], poisoned[off])
    # rounded to the weight's dtype, then the product: the first rounding's ulp, times a weight
    # up to the next power of 2, is up to two of the output's
    assert_matches(actual[on], expected[on], roundings=3)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("V", [300, 5000])  # 5000: a vocabulary wider than the kernel's tile, in three
def test_next_token_nll(softcap, V, gen):
    N = 37
    logits = randn(N, V + 3, gen=gen)[:, :V] * 8  # a row stride wider than the row
    logits[3, 7] = 200.0  # a maximum far above the rest: the running sums must rescale, not overflow
    bias = randn(V, gen=gen)
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::5] = -1  # a sequence's last position: no next token, nothing written
    poisoned = torch.full((N,), SENTINEL)

    expected, actual = poisoned.clone(), poisoned.clone()
    kernels.next_token_nll_torch(logits, bias, targets, expected, softcap)
    kernels.next_token_nll(logits, bias, targets, actual, softcap)

    off = targets < 0
    assert torch.equal(actual[off], poisoned[off])
    assert_matches(actual[~off], expected[~off])
