#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool): takes the parts that
# benchmarks/gpu/pack.sh made, installs them, runs the benchmarks.
#
#     bash benchmarks/gpu/device.sh receive                 # each part's call
#     bash benchmarks/gpu/device.sh receive install bench   # the last part's call
#     bash benchmarks/gpu/device.sh bench-no-xla            # a later call, warm machine
#
# receive: moves the carried .gpu/part* (and parts.sha256) out of the
#   working tree into $STORE, so the next call's tree stays small.
# install: checks the parts' digests, unpacks them into $SITE, and links
#   the machine's CUDA 13 libraries under the names TensorFlow 2.21's CUDA 12
#   build opens (libcublas.so.12 -> libcublas.so.13, ...; cuSPARSE 12 and
#   cuDNN 9 keep their names); then a GEMM, a convolution, an XLA function
#   and a Keras fit on the GPU, or it stops with TensorFlow's log.
# bench: the long-fit zoo under XLA (what jit_compile="auto" picks on a GPU;
#   the slowest models last) and the KerasHub LoRA sizes, the two side by
#   side (the device time allows no more; the zoo's tiny steps leave the GPU
#   idle most of the time; memory grows as needed, so the two processes do
#   not each reserve most of it), each table written to $OUT as it grows.
# bench-no-xla: the long-fit zoo with XLA off (as the CPU tables run).
set -uo pipefail
cd "$(dirname "$0")/../.."
STORE=${TFDP_GPU_STORE:-/root/tfdp-gpu}
SITE=${TFDP_GPU_SITE:-/tmp/site}
OUT=${OUT:-/tmp/out}
mkdir -p "$STORE/parts" "$OUT"
# The zoo's models in the order bench runs them; TFDP_GPU_ZOO picks others
# (a later lease runs what an earlier one did not reach).
ZOO_ORDER=${TFDP_GPU_ZOO:-"mlp mlp_2048 tanh_cnn_256 tanh_cnn_2048 text_pooling conv1d_series transformer
           resnet_groupnorm embedding_lstm embedding_bigru"}

environment() {
  # Memory as needed, not TensorFlow's default of reserving most of the GPU:
  # bench runs two processes side by side.
  export TF_FORCE_GPU_ALLOW_GROWTH=true
  export PYTHONPATH="$SITE:$PWD" TFDP_NOISE_KERNEL=graph TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
  export LD_LIBRARY_PATH="$STORE/cuda12:$(cat "$STORE/libdirs" 2>/dev/null)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  local cuda
  cuda=$(dirname "$(dirname "$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)")")
  export XLA_FLAGS="--xla_gpu_cuda_data_dir=$cuda" PATH="$cuda/bin:$PATH"
}

receive() {
  mv -f .gpu/part* "$STORE/parts/" 2>/dev/null
  [ -f .gpu/parts.sha256 ] && mv -f .gpu/parts.sha256 "$STORE/parts/"
  ls "$STORE/parts" | tr '\n' ' '; echo; df -h /tmp | tail -1
}

# The first file named $1 among the machine's CUDA libraries (the toolkit's
# folders first, then Python's wheels under /opt), listed once in $STORE/libs.
find_library() {
  [ -s "$STORE/libs" ] || find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /opt -name 'lib*.so*' \
    \( -type f -o -type l \) 2>/dev/null > "$STORE/libs"
  grep -m1 "/$1\$" "$STORE/libs"
}

link_cuda() {
  rm -rf "$STORE/cuda12"; mkdir -p "$STORE/cuda12"
  ln -sf "$SITE"/nvidia/cuda_runtime/lib/libcudart.so.12 "$STORE/cuda12/"
  local dirs=() want have found
  for pair in libcublas.so.12=libcublas.so.13 libcublasLt.so.12=libcublasLt.so.13 \
              libcufft.so.11=libcufft.so.12 libcusolver.so.11=libcusolver.so.12 \
              libcusparse.so.12=libcusparse.so.12 libcurand.so.10=libcurand.so.10 \
              libnvJitLink.so.12=libnvJitLink.so.13 libcudnn.so.9=libcudnn.so.9; do
    want=${pair%=*}; have=${pair#*=}
    found=$(find_library "$have")
    if [ -z "$found" ]; then echo "missing: $have (for $want)"; continue; fi
    dirs+=("$(dirname "$found")")
    [ "$want" = "$have" ] || ln -sf "$found" "$STORE/cuda12/$want"
    echo "$want -> $found"
  done
  printf '%s\n' "${dirs[@]}" | sort -u | paste -sd: > "$STORE/libdirs"
}

install() {
  ( cd "$STORE/parts" && sha256sum -c --quiet parts.sha256 ) || { echo "parts damaged or missing"; exit 1; }
  rm -rf "$SITE"; mkdir -p "$SITE"
  cat "$STORE"/parts/part[0-9]* | xz -d -T0 | tar -x -C "$SITE" || exit 1
  link_cuda
  environment
  TF_CPP_MIN_LOG_LEVEL=0 python3 - <<'PY' > "$OUT/install_check.log" 2>&1
import sys
import tensorflow as tf, keras
print("tensorflow", tf.__version__, "keras", keras.__version__, "python", sys.version.split()[0])
gpus = tf.config.list_physical_devices("GPU")
print("GPUs:", gpus)
assert gpus, "TensorFlow sees no GPU"
print(tf.config.experimental.get_device_details(gpus[0]))
with tf.device("GPU:0"):
    a = tf.random.normal([512, 512])
    print("gemm", float(tf.reduce_sum(a @ a)))
    x = tf.random.normal([8, 32, 32, 3]); w = tf.random.normal([3, 3, 3, 16])
    print("conv", float(tf.reduce_sum(tf.nn.conv2d(x, w, 1, "SAME"))))
    print("xla", float(tf.function(lambda t: tf.reduce_sum(tf.tanh(t @ t)), jit_compile=True)(a)))
model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(tf.random.normal([256, 20]), tf.zeros([256], tf.int32), epochs=1, verbose=0)
import tfdp
print("tfdp", tfdp.__file__)
PY
  local status=$?
  grep -v "^W0000\|cuda_executor\|^I0000" "$OUT/install_check.log" | tail -20
  [ $status -eq 0 ] || { tail -60 "$OUT/install_check.log"; exit 1; }
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
  nproc >> "$OUT/gpu.txt"; cat "$OUT/gpu.txt"
}

bench() {
  environment
  export PYTHONUNBUFFERED=1
  python3 benchmarks/finetune_throughput.py --only bert_small_lora gpt2_tiny_lora gemma_tiny_lora \
    --rounds 3 --no-memory > "$OUT/finetune_gpu.md" 2>&1 &
  python3 benchmarks/long_fit.py --rounds 2 --jit-compile true --only $ZOO_ORDER 2>&1 \
    | tee "$OUT/long_fit_gpu_xla.md"
  wait; cat "$OUT/finetune_gpu.md"
}

bench_no_xla() {
  environment
  export PYTHONUNBUFFERED=1
  python3 benchmarks/long_fit.py --rounds 2 --only $ZOO_ORDER 2>&1 | tee "$OUT/long_fit_gpu.md"
}

for step in "$@"; do
  case "$step" in
    receive) receive ;;
    install) install ;;
    bench) bench ;;
    bench-no-xla) bench_no_xla ;;
    *) echo "unknown step: $step (receive, install, bench, bench-no-xla)"; exit 2 ;;
  esac
done
