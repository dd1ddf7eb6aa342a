# Put on PYTHONPATH by `python -m bench.served --profile`: every Python process a server starts samples
# itself (bench/sampler.py).
from bench.sampler import start_from_env

start_from_env()
