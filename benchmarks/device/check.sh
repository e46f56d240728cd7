# The GPU checks in one call of a lent machine (15 minutes of device time in all, starts included), with .gpu/
# carried (python -m benchmarks.device.prepare makes it). Logs and results land in $OUT.
#   TESTS_S: seconds for the tests (default 170)   BENCH_S: seconds for benchmarks.gpu (default 320)   SCALE, ROUNDS: its size (0.15, 3)
#   CONTENDERS, WORKLOADS: benchmarks.gpu's (default: MiniLM, the fp32 target, the library's two output paths and the
#   file path without the device copy ahead: whether the copy ahead costs anything is part of MiniLM's open gap;
#   ~16 s a run on an H200, so 3 rounds fit; ResNet-50, peers and bf16 ran in earlier sessions, see BENCHMARKS.md)
#   OOM_S, OOM_EXAMPLES: benchmarks.oom's limit (150 s) and size (12,000 passages: 3,000 ran in 25 s on an H200, a 0.8-s job)
export PYTHONPATH=$PWD/.gpu:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
python3 benchmarks/device/restore_model.py
T0=$(date +%s)
timeout "${TESTS_S:-170}" python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_path.py tests/test_copyback.py tests/test_oom.py \
    tests/test_device_memory_release.py \
    "tests/test_engine_distributed.py::test_a_two_rank_job_runs_with_and_without_torch_distributed_set_timeout" \
    2>&1 | tee "$OUT/tests.log" | tail -30
echo "tests took $(( $(date +%s) - T0 )) s"; T0=$(date +%s)
timeout "${BENCH_S:-320}" python3 -m benchmarks.gpu --rounds "${ROUNDS:-3}" --scale "${SCALE:-0.15}" \
    --contenders "${CONTENDERS:-hand_pinned,tbp,tbp_no_prefetch,tbp_records}" \
    --workloads "${WORKLOADS:-minilm}" --precisions "${PRECISIONS:-fp32}" \
    > "$OUT/gpu.log" 2>&1
echo "benchmarks.gpu: exit $?, $(( $(date +%s) - T0 )) s"; T0=$(date +%s)
cp "$(ls -td bench_results/gpu-2* | head -1)/results.json" "$OUT/gpu.json"
python3 -m benchmarks.gpu --render "$OUT/gpu.json" | tail -25
timeout "${OOM_S:-150}" python3 -m benchmarks.oom --device cuda --model minilm --gpu-memory-mib 1024 --rounds 1 \
    --examples "${OOM_EXAMPLES:-12000}" \
    > "$OUT/oom.log" 2>&1
echo "benchmarks.oom: exit $?, $(( $(date +%s) - T0 )) s"; tail -20 "$OUT/oom.log"
