"""Backends: the vLLM serving engine (`vllm/`) and the TransformerLens reference (`reference.py`)."""
