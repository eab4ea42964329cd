#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources vendored in llama-cpp-python's sdist,
# once, and cache the binary (the CPU benchmarks' reference engine, issue #20).
#
#   benchmarks/llamacpp_build.sh            # prints the binary's path
#   LLAMACPP_CACHE=/path benchmarks/llamacpp_build.sh
#   LLAMACPP_CACHE=/path-noamx LLAMACPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON \
#     -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
#     -DGGML_AVX512_BF16=ON" benchmarks/llamacpp_build.sh
#       # a build without ggml's AMX backend, which segfaulted on an AMX CPU (session 28,
#       # docs/benchmarks.md); the later arguments override the defaults below
#
# Needs pip (for `pip download` of the sdist), cmake, make and a C/C++ compiler; no
# other downloads (the sdist carries vendor/llama.cpp). The build runs under
# `nice -n 15 make -j2` so that it does not crowd a shared machine; an interrupted
# build resumes where it stopped. A later run finds the cached binary and only prints
# its path.
set -euo pipefail

CACHE="${LLAMACPP_CACHE:-${HOME}/.cache/flowengine/llamacpp}"
BIN="${CACHE}/bin/llama-server"
if [[ -x "${BIN}" ]]; then
    echo "${BIN}"
    exit 0
fi
mkdir -p "${CACHE}/sdist" "${CACHE}/bin"
if ! ls "${CACHE}"/sdist/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    pip download --no-binary :all: --no-deps llama-cpp-python -d "${CACHE}/sdist" >&2
fi
SDIST="$(ls -t "${CACHE}"/sdist/llama_cpp_python-*.tar.gz | head -n 1)"
SRC="${CACHE}/src"
if [[ ! -f "${SRC}/.extracted" ]]; then
    rm -rf "${SRC}"
    mkdir -p "${SRC}"
    tar -xzf "${SDIST}" -C "${SRC}" --strip-components=1
    touch "${SRC}/.extracted"
fi
LLAMA="${SRC}/vendor/llama.cpp"
[[ -f "${LLAMA}/CMakeLists.txt" ]] || { echo "no vendor/llama.cpp in ${SDIST}" >&2; exit 1; }

BUILD="${CACHE}/build"
if [[ ! -f "${BUILD}/CMakeCache.txt" ]]; then
    # GGML_NATIVE: the instructions of this CPU (AVX512, VNNI, BF16 where present), as a
    # user building llama.cpp here would get. No CURL (no downloads at run time), no tests.
    cmake -S "${LLAMA}" -B "${BUILD}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF ${LLAMACPP_CMAKE_ARGS:-} >&2
fi
nice -n 15 make -C "${BUILD}" -j2 llama-server >&2
cp "$(find "${BUILD}" -name llama-server -type f -perm -u+x | head -n 1)" "${BIN}"
echo "${BIN}"
