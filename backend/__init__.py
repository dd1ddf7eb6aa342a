"""Backends: the engine a HookedServedModel runs on (`vllm/`), and the executor that runs lowered ops."""
