#!/usr/bin/env bash
# bench/gpu-pack.sh [DIR] — ready bench/gpu.sh for a GPU machine that has nvidia's driver,
# python3 with numpy and cmake's ctest but none of kvblend's build dependencies (no
# package installs there): builds build-gpu here (Release, CUDA, warnings as errors),
# copies it without object files into DIR (default .gpu, which .git/info/exclude should
# name) with the shared libraries its programs load that are not glibc's, and writes
# DIR/run.sh. There, from the checkout's root: `bash DIR/run.sh` links /work/main to the
# checkout (the build's tests name absolute paths), puts the carried libraries the
# machine lacks on the loader's path, runs gpu.sh with KVB_GPU_PREBUILT=1 into
# /tmp/gpuout, and leaves $OUT/summary.txt and $OUT/gpu.tgz (every log); with KVB_GPU_CMD
# set it runs that command instead of gpu.sh. The build here must have the checkout at
# /work/main.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu}
[ "$(pwd -P)" = /work/main ] || { echo "gpu-pack.sh: the checkout must be /work/main"; exit 1; }
mkdir -p /tmp/kvbpy
[ -e /tmp/kvbpy/python3 ] || ln -s /usr/bin/python3 /tmp/kvbpy/python3
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DKVB_CUDA=ON -DKVB_WERROR=ON \
	-DSYSTEM_PYTHON=/tmp/kvbpy/python3 > /dev/null
cmake --build build-gpu -j"$(nproc)" > /dev/null
rm -rf "$dir/build-gpu" "$dir/lib"
mkdir -p "$dir/build-gpu" "$dir/lib"
tar -C build-gpu --exclude=CMakeFiles --exclude='*.o' --exclude='*.a' --exclude=pyvenv \
	--exclude=evalvenv -cf - . | tar -C "$dir/build-gpu" -xf -
for f in build-gpu/bin/* build-gpu/lib/*.so*; do ldd "$f" 2> /dev/null || true; done |
	awk '/=> \//{ print $3 }' | sort -u | grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux-x86-64|libgcc_s|libstdc\+\+)\.so' |
	grep -v "build-gpu" | xargs -r -I{} cp -L {} "$dir/lib/"
cat > "$dir/run.sh" << 'EOF'
#!/usr/bin/env bash
# Written by bench/gpu-pack.sh: run from the checkout's root on the GPU machine.
set -u
root=$PWD
pack=$(cd "$(dirname "$0")" && pwd)
dest=${OUT:-$root/gpu-out}
work=/tmp/gpuout
mkdir -p /work /tmp/kvbpy /tmp/kvblibs "$work" "$dest"
[ -e /work/main ] || ln -s "$root" /work/main
[ -e build-gpu ] || ln -s "$pack/build-gpu" build-gpu
# the build's SYSTEM_PYTHON; a venv's python is run by its path (a link loses the venv)
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/kvbpy/python3
chmod +x /tmp/kvbpy/python3
for f in "$pack"/lib/*; do
	ldconfig -p | grep -q "^[[:space:]]*$(basename "$f") " || cp "$f" /tmp/kvblibs/
done
echo /tmp/kvblibs > /etc/ld.so.conf.d/zz-kvblend-carried.conf && ldconfig
{ echo "carried libraries used: $(ls /tmp/kvblibs | tr '\n' ' ')"; uname -a
  /tmp/kvbpy/python3 -c 'import numpy; print("numpy", numpy.__version__)'; nproc
  ldd build-gpu/bin/kvblendd | grep -i "not found"; build-gpu/bin/blend_tool probe; } > "$work/env.txt" 2>&1
cd /work/main
# KVB_GPU_CMD: a shorter check instead of all of gpu.sh (a rerun on what is left of a
# lease), run in the same environment with its logs in the same place
if [ -n "${KVB_GPU_CMD:-}" ]; then
	timeout "${GPU_SH_LIMIT:-500}" bash -c "$KVB_GPU_CMD" > "$work/gpu_sh.log" 2>&1
else
	KVB_GPU_PREBUILT=1 timeout "${GPU_SH_LIMIT:-500}" bash bench/gpu.sh "$work" > "$work/gpu_sh.log" 2>&1
fi
echo "gpu.sh rc $?" >> "$work/gpu_sh.log"
cp "$work/summary.txt" "$dest/" 2> /dev/null
tail -c 6000 "$work/gpu_sh.log"
tar -C "$work" -czf "$dest/gpu.tgz" .
EOF
chmod +x "$dir/run.sh"
echo "gpu-pack.sh: $(du -sh "$dir" | cut -f1) in $dir; there: bash $dir/run.sh"
