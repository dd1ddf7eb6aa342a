# The served benchmark (bench/served.py) on a CUDA machine without network, vLLM 0.26.0 staged into the site
# folder .gpu/bin/env.sh names (docs/benchmarks.md says how the bundle is built and staged). Installs this
# checkout and TransformerLens there, then runs the bench on the 8B-shaped config folder (.gpumodel8b, dummy
# bf16 weights), its JSON and the servers' logs under $OUT. Arguments go to bench.served (--modes,
# --concurrency, --rounds, ...).
#   bash scripts/gpu_serve_bench.sh --modes native native_twin seven --concurrency 32 128 256 --rounds 4
set -eu
. .gpu/bin/env.sh
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . > /dev/null
python3 scripts/gpu_wheels.py install > /dev/null
python3 -m bench.served --model .gpumodel8b --dummy --out "$OUT/served.json" --logs "$OUT" "$@"
