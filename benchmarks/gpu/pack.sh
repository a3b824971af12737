#!/usr/bin/env bash
# Packs what a GPU machine with no network needs to run tfdp's benchmarks.
#
# The device machine (the `device` tool's nvidia-h200) has Python 3.12,
# CUDA 13 and PyTorch but no TensorFlow, reaches no package index, and a
# call carries at most 64 MiB beside the working tree; a warm machine keeps
# files between calls. This script downloads the wheels of the versions
# this machine runs (TensorFlow and Keras, tfdp's and KerasHub's needs the
# image lacks, CUDA 12's runtime library), unpacks them into one folder as
# `pip install --target` would (TensorFlow without tensorflow/include: its
# C++ headers serve only custom-op builds, and the compiled noise kernel
# runs on CPUs only), packs that folder as one xz tarball and splits it into
# parts under .gpu/ (ignored by git). benchmarks/gpu/device.sh takes them
# there, part by part, then installs and runs.
#
#     bash benchmarks/gpu/pack.sh          # .gpu/part00 ... (58 MiB each)
#
# Then one device call a part, in order, each carrying that part:
#     run(carry=[".gpu/part00"], command="bash benchmarks/gpu/device.sh receive")
# and, carrying the last part and the digests:
#     run(carry=[".gpu/partNN", ".gpu/parts.sha256"],
#         command="bash benchmarks/gpu/device.sh receive install bench")
set -euo pipefail
cd "$(dirname "$0")/../.."
PART_MB=${PART_MB:-58}  # 58 MiB: with the working tree (about 5 MiB), under the 64 MiB a call carries
work=.gpu/build
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf "$work" .gpu/part*
mkdir -p "$work/wheels" "$work/site"

# name: the distribution whose installed version here is fetched for there.
here_version() { python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
packages=(tensorflow keras namex optree dm-tree dp-accounting attrs keras-hub kagglehub
          kagglesdk tensorflow-text astunparse gast google-pasta termcolor flatbuffers
          protobuf ml_dtypes wrapt)
specs=()
for name in "${packages[@]}"; do specs+=("$name==$(here_version "$name")"); done
specs+=("nvidia-cuda-runtime-cu12==12.9.79")  # libcudart.so.12: TensorFlow 2.21 is a CUDA 12 build
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$work/wheels" "${specs[@]}"

for wheel in "$work"/wheels/*.whl; do
  python3 -m zipfile -e "$wheel" "$work/site"
done
rm -rf "$work/site/tensorflow/include"
tar -C "$work/site" -cf - . | xz -T2 -6 > "$work/site.tar.xz"
split -b "${PART_MB}m" -d "$work/site.tar.xz" .gpu/part
( cd .gpu && sha256sum part[0-9]* > parts.sha256 )
ls -l .gpu/part*
echo "parts: $(ls .gpu/part[0-9]* | wc -l); send each with benchmarks/gpu/device.sh receive (parts.sha256 travels with the last)"
