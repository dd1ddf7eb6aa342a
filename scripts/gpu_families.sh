#!/bin/bash
# On the GPU machine, after `. .gpu/bin/env.sh`: tests/gpu/test_families_gpu.py, one process per family
# (an engine gives its GPU memory back only when its process exits). Usage: bash scripts/gpu_families.sh qwen3-8b gemma-2-9b ...
for f in "$@"; do
  mkdir -p $OUT/f_$f
  XMIX_GPU_MODEL=.gpumodel8b XMIX_GPU_FAMILIES=$f XMIX_GPU_OUT=$OUT/f_$f timeout ${PER:-150} python3 -m pytest -q tests/gpu/test_families_gpu.py -o addopts="" > $OUT/f_$f/log.txt 2>&1
  echo "$f rc=$?"; tail -3 $OUT/f_$f/log.txt
done
