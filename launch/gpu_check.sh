#!/usr/bin/env bash
# The GPU measurements of docs/results.md, writing each result as it has it.
# STAGES (default "bench cifar"; one 10-minute call holds one of them):
#   bench  `bench resnet` beside PyTorch's ResNet-18 at 2 x 256 images, then
#          `bench train` (SimCLR and OTCLR steps) at batch 256 in float32 and
#          bfloat16 and at 512 in float32, then `bench ot`.
#   cifar  the batch-256 CIFAR-10 runs of launch/sweeps/cifar10_paper.py,
#          SimCLR and OTCLR x seeds 0, 1, 2, PARALLEL (default 6) at once on
#          the one GPU, evaluated by probe and kNN only (no K-means, views
#          or figures); the runs of a seed share one random-init floor. Then
#          the sweep's table: mean +- std and paired OTCLR - SimCLR.
#
#   bash launch/gpu_check.sh OUT SECONDS CIFAR10_JPEG_TAR_GZ [STAGES]
#
# Wheels in .whl/ (../shared/tools/gpu-wheels.sh flax==0.12.8 optax==0.2.8
# orbax-checkpoint==0.12.8) are installed first. OUT receives env.txt,
# bench.txt, cifar10.log, cifar10_table.txt and cifar10_results.tar.gz.
# TINY=1 shrinks every size, for a check on a CPU; PY names the interpreter;
# SWEEP and BATCH name another sweep file and its batch size, SEEDS its seeds
# (the view factorial: SWEEP=launch/sweeps/cifar10_views.py SEEDS=0, five
# runs; its table goes to the same files).
set -uo pipefail
out=$1 budget=$2 tarball=$3 stages=${4:-bench cifar}
py=${PY:-python3}
if compgen -G '.whl/*.whl' >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 2
  # ott-jax imports its optional flax.nnx module inside suppress(ImportError);
  # on the image's jax, flax 0.12.8's nnx raises AttributeError instead.
  sed -i 's/suppress(ImportError)/suppress(ImportError, AttributeError)/' \
    /tmp/site/ott/__init__.py
  export PYTHONPATH=/tmp/site:$PWD
fi
work=${WORK:-.gpu}
start=$SECONDS
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1
# Several runs share the GPU: each takes memory as it needs it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

left() { echo $((budget - (SECONDS - start))); }
# run SECONDS LOG CMD...: CMD under a limit of at most SECONDS and the time
# left (less 20 s to write the table); its output appended to LOG.
run() {
  local cap=$1 log=$2; shift 2
  local limit=$(( $(left) - 20 < cap ? $(left) - 20 : cap ))
  if (( limit < 10 )); then echo "skipped (no time left): $*" >>"$log"; return 1; fi
  echo "\$ $* (limit ${limit} s, at $((SECONDS - start)) s)" >>"$log"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "rc $rc after $((SECONDS - t0)) s" >>"$log"
  return $rc
}

if [[ ${TINY:-0} == 1 ]]; then
  bench_train=('16 float32') repeats=2 ot_batches=16
  steps=(--config.total_steps=4 --config.log_every_steps=2
    --config.monitor.every_steps=0)
else
  bench_train=('256 float32' '256 bfloat16' '512 float32') repeats=10
  ot_batches=256,512
  steps=()
fi
read -r -a seeds <<<"${SEEDS:-0 1 2}"
{ date -u; nvidia-smi -L 2>&1; lscpu | grep -E 'Model name|^CPU\(s\)'
  echo "vector extensions: $(grep -owE 'avx2|avx512f|amx_tile' /proc/cpuinfo \
    | sort -u | tr '\n' ' ')"
  $py -c 'import jax, flax, optax; print("jax", jax.__version__,
    jax.devices(), "flax", flax.__version__, "optax", optax.__version__)' 2>&1
  $py -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1
  # The BLAS NumPy loaded and its threads: the probe runs there.
  $py -c 'import json, numpy, threadpoolctl; print("numpy", numpy.__version__,
    json.dumps(threadpoolctl.threadpool_info()))' 2>&1
  } >"$out/env.txt"

bench() {
  run "$1" "$out/bench.txt" "${@:2}"
}
if [[ $stages == *bench* ]]; then
  pair=$((2 * ${bench_train[0]% *}))
  bench 60 $py -m otclr_jax.bench resnet --config=configs/cifar10.py \
    --conv_impls=xla --repeats=$repeats --config.batch_size=$pair
  bench 45 $py launch/bench_torch.py --device=${TORCH_DEVICE:-cuda} \
    --batch_size=$pair --steps=$repeats
  # Compiling its three steps alone took 75 s on an H200.
  for bd in "${bench_train[@]}"; do
    bench 200 $py -m otclr_jax.bench train --config=configs/cifar10.py \
      --methods=simclr --repeats=$repeats --config.batch_size=${bd% *} \
      --config.dtype=${bd#* }
  done
  bench 150 $py -m otclr_jax.bench ot --batch_sizes=$ot_batches
fi
[[ $stages == *cifar* ]] || exit 0

# CIFAR-10: the JPEG folder, decoded once into the cache all runs read.
data=$work/data
if [[ ! -d $data/cifar10/train ]]; then
  mkdir -p "$data" && tar xzf "$tarball" -C "$data"
  [[ -d $data/train ]] && mkdir -p "$data/cifar10" && mv "$data"/train "$data"/test "$data/cifar10/"
fi
folder=folder:$data/cifar10
log=$out/cifar10.log
run 120 "$log" $py -c "from otclr_jax import data
data.load_splits('$folder', ['train', 'test'], 32, '$data')"
batch=${BATCH:-256}
sweep_file=${SWEEP:-launch/sweeps/cifar10_paper.py}
sweep_dir=$work/$(basename "$sweep_file" .py)
sweep=(-m launch.sweep --config=$sweep_file --workdir=$sweep_dir
  --config.dataset=$folder
  "--config.eval.datasets=(\"$folder\",)" --config.data_dir=$data
  "--config.eval.evaluators=(\"probe\",\"knn\")"
  --config.eval.figures=False "${steps[@]}")
# One seed's runs at the batch size, by their 0-based index in the sweep's list.
indices_of() {
  $py "${sweep[@]}" --dry_run 2>/dev/null | sed -nE \
    "s/^\[([0-9]+)\/[0-9]+\] seed=$1,batch_size=$batch,.*/\1/p" \
    | while read -r n; do echo $((n - 1)); done
}
indices=()
for seed in "${seeds[@]}"; do indices+=($(indices_of "$seed")); done
if (( ${#indices[@]} == 0 )); then
  echo "no batch-$batch run in the sweep's list" >>"$log"
fi
parallel=${PARALLEL:-6}
# The runs share the host's cores: each gets its share for BLAS (the
# probe's host part, kNN), whose waiting threads would spin.
share=$(( $(nproc) / parallel > 1 ? $(nproc) / parallel : 1 ))
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-$share}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$share}
echo "runs ${indices[*]}, $parallel at once, $share BLAS threads each" >>"$log"
# Seed by seed in the sweep's order, so that a call cut short ends with
# whole seeds.
t0=$SECONDS
for i in "${indices[@]}"; do
  while (( $(jobs -rp | wc -l) >= parallel )); do wait -n; done
  run 600 "$log.$i" $py "${sweep[@]}" --only_index=$i &
done
wait
for i in "${indices[@]}"; do
  [[ -f $log.$i ]] && cat "$log.$i" >>"$log" && rm -f "$log.$i"
done
echo "runs ${indices[*]} in $((SECONDS - t0)) s" >>"$log"
$py "${sweep[@]}" --aggregate_only >"$out/cifar10_table.txt" 2>&1
tar czf "$out/cifar10_results.tar.gz" \
  $(find "$sweep_dir" \( -name checkpoints -o -name encoder \
      -o -name tensorboard -o -name features \) -prune -o -type f \( \
      -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.log' \) \
      -print 2>/dev/null)
echo "done in $((SECONDS - start)) s" >>"$log"
