"""GPU only: generated kernels, compiled for the GPU, equal their torch twins there.

    python3 tests/gpu/generated_gpu.py $OUT/generated_gpu.json

The CPU tests' programs (tests/test_generated_kernels.py; the CPU runs them in Triton's
interpreter) at their test widths and at an 8B model's width (4096): the SAE encoder read
`x @ W_enc` takes the tl.dot path there (split over programs at 32 rows, summed by the last to
arrive), a gate's `x @ u` narrow tiles over row blocks of 4 (1 at 32 rows). x in fp32 and bf16, some rows gated off (-1).
Checked as the CPU tests check (tests/kernel_checks.py: fp32 ~1e-5 relative, bf16 one ulp).
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the programs and the checks

import test_generated_kernels as programs  # noqa: E402
from kernel_checks import assert_matches  # noqa: E402
from xmix_lens.kernels import generate_kernel, run_program, run_program_torch  # noqa: E402
from xmix_lens.kernels.program_kernel import launch_block_rows  # noqa: E402
from xmix_lens.kernels.split_matmul import split_count  # noqa: E402
from xmix_lens.lowered import TokenProgram  # noqa: E402

T, R = 300, 200
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run in Triton's interpreter


def check(make, F: int, dtype: torch.dtype, R: int = R) -> dict:
    gen = torch.Generator().manual_seed(F)
    program = make(F, gen)
    program = TokenProgram(program.ops, [c.to(DEVICE) for c in program.consts], program.output)
    x = torch.randn(T, F, generator=gen).to(dtype).to(DEVICE)
    rows = torch.randperm(T, generator=gen)[:R].to(torch.int32)
    rows[::7] = -1  # gated off
    rows = rows.to(DEVICE)
    kernel, _ = generate_kernel(program, F)
    entry = {"F": F, "dtype": str(dtype), "rows": R, "block_rows": launch_block_rows(kernel.plan, R, x.device),
             "tl_dot": "tl.dot" in kernel.path.read_text(),
             "split_k": split_count(F, R, x.device) if kernel.plan.split else 1}
    if make in programs.WRITES:
        expected, actual = x.clone(), x.clone()
        run_program_torch(expected, rows, program, None)
        run_program(actual, rows, program, None)
    else:
        width = program.ops[program.output].shape[0] if program.ops[program.output].shape else 1
        dest = torch.arange(R, dtype=torch.int32, device=DEVICE)
        expected = torch.zeros(R, width, device=DEVICE)
        actual = torch.zeros(R, width, device=DEVICE)
        run_program_torch(x, rows, program, None, expected, dest)
        run_program(x, rows, program, None, actual, dest)
    entry["max_abs_diff"] = (actual.float() - expected.float()).abs().max().item()
    try:
        assert_matches(actual.cpu(), expected.cpu(), noise=1e-4)
        entry["ok"] = True
    except AssertionError as e:
        entry["ok"], entry["error"] = False, str(e)[:300]
    return entry


def main(out: str) -> bool:
    results = {}
    for make in programs.WRITES + programs.READS:
        sae = make.__name__.startswith("sae")
        if make is programs.patching:  # reads a per-token table: the CPU tests cover it
            continue
        wide = [4096] if DEVICE == "cuda" else []  # the interpreter takes minutes at this width
        for F in ([64, *wide] if sae else [200, *wide]):  # 4096: row blocks of 4, narrow matmuls in tiles
            for dtype in (torch.float32, torch.bfloat16):
                results[f"{make.__name__} F={F} {dtype}"] = check(make, F, dtype)
                if F == 4096:  # a decode step's rows: SAEs split their matmuls of x the most (split_matmul.py),
                    # the others take one row a program (program_kernel.launch_block_rows)
                    results[f"{make.__name__} F={F} {dtype} R=32"] = check(make, F, dtype, R=32)
    results["_device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    Path(out).write_text(json.dumps(results, indent=1))
    failed = [k for k, v in results.items() if isinstance(v, dict) and not v["ok"]]
    print(json.dumps({k: (v["ok"], v["tl_dot"], v["max_abs_diff"]) for k, v in results.items() if isinstance(v, dict)},
                     indent=0))
    print("FAILED", failed if failed else "none")
    return not failed


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1]) else 1)
