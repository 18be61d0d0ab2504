#!/usr/bin/env bash
# The GPU checks of a round, for a machine lent for minutes: the gpu-marked tests, then the
# GPU benchmarks, each stage under its own time limit, every result written to $OUT as it
# comes. Stages: "a" (tests, ResNet-50 at batch 32 fp32 before/after, kernel profiles), "b"
# (the other gpu_step configurations, the node's hardware profile), "c" (after a change), "d"
# (the tests with tracebacks, the inverse, eigen and Adam-eigenbasis step costs), "e" (the
# Adam-eigenbasis step before and after a change), "f" (the tests, the step before and after,
# profiler traces, the plan against this GPU), "g" (f's step and traces after a change), "h"
# (the preconditioning in CUDA graphs against without; the plan against the GPU at batch 32, 64),
# "i" (h without the plan), "j" (the plan alone), "k" (traces with and without the graph),
# "l" (the tests, the plan, the step costs of every method, EKFAC included), "m" (the tests,
# the step before and after, b32 fp32 and bf16, the transformer), "n" (m without EKFAC),
# "o" (the plan against this GPU, the 1/10 step too), "p" (traces, fp32 against bf16),
# "q" (n's step costs with one process on the GPU), "r" (the gpu tests, then o: the plan with
# the model's own host costs, the stand-in's and host times taken back to back).
# Expects the pydantic wheels in .whl (the image has torch but not pydantic) and the commit
# before the change's kaisa_ray in .old (`git archive <commit> kaisa_ray | tar -x -C .old`).
# The lent machine's copy has no history of its own: COMMIT=<hash> names what the tables
# measured.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
run() {  # run LIMIT NAME COMMAND...: a stage, its output in $OUT/NAME.log
    local limit=$1 name=$2
    shift 2
    echo "== $name ($(date +%T))"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? ($(date +%T))"
    tail -n 25 "$OUT/$name.log"
}
for stage in "$@"; do
    case $stage in
    a)
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        run 150 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_gpu.py -s
        (cd benchmarks && run 240 gpu_step_b32 python3 gpu_step.py --before ../.old \
            --rounds 2 --only "b32 fp32" --json "$OUT/gpu_step_b32.json")
        (cd benchmarks && run 120 gpu_kernels python3 gpu_kernels.py --batch 32 64 \
            --out "$OUT/gpu_kernels.json")
        ;;
    b)
        (cd benchmarks && run 200 gpu_step_rest python3 gpu_step.py --before ../.old \
            --rounds 2 --only "b64 fp32" --json "$OUT/gpu_step_b64.json")
        (cd benchmarks && run 200 gpu_step_bf16 python3 gpu_step.py --before ../.old \
            --rounds 2 --only "bf16" --json "$OUT/gpu_step_bf16.json")
        (cd benchmarks && run 200 gpu_step_lm python3 gpu_step.py --before ../.old \
            --rounds 2 --only "transformer" --json "$OUT/gpu_step_lm.json")
        run 150 measure_node python3 -c "
import yaml
from kaisa_train.models_large import ResNet50
from kaisa_train.planning import hardware_file
from tuner.node import measure
base = yaml.safe_load(hardware_file('a100-80gb-hdr').read_text())
profile = measure(base, name='h100-measured', device='cuda', resnet50=ResNet50)
open('$OUT/h100-measured.yaml', 'w').write(yaml.safe_dump(profile, sort_keys=False, width=100))
"
        ;;
    c)  # after a change: this checkout only (the "before" figures from an earlier "a")
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        run 150 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_gpu.py -s
        (cd benchmarks && run 200 gpu_step_b32 python3 gpu_step.py --rounds 2 \
            --only "b32 fp32" --json "$OUT/gpu_step_b32.json")
        (cd benchmarks && run 150 gpu_step_rest python3 gpu_step.py --rounds 2 \
            --only ": " --skip "b32 fp32" --json "$OUT/gpu_step_rest.json")
        run 120 measure_node python3 -c "
import yaml
from kaisa_train.models_large import ResNet50
from kaisa_train.planning import hardware_file
from tuner.node import measure
base = yaml.safe_load(hardware_file('a100-80gb-hdr').read_text())
profile = measure(base, name='h200-measured-2', device='cuda', resnet50=ResNet50)
open('$OUT/node.yaml', 'w').write(yaml.safe_dump(profile, sort_keys=False, width=100))
"
        (cd benchmarks && run 60 gpu_kernels python3 gpu_kernels.py --batch 32 \
            --out "$OUT/gpu_kernels.json")
        ;;
    d)  # this checkout: the gpu tests with every failure's traceback; the step costs of the
        # JobSpec's inverse and eigen methods and of Adam in K-FAC's eigenbasis
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        run 170 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_gpu.py -rA \
            --tb=long
        (cd benchmarks && run 300 gpu_step_adam python3 gpu_step.py --rounds 2 ${COMMIT:+--commit "$COMMIT"} \
            --only "b32 fp32: SGD" "b32 fp32: K-FAC inverse 10/100" "b32 fp32: K-FAC eigen 10/100" \
            "Adam eigenbasis" "transformer" --skip "highest" --json "$OUT/gpu_step_adam.json")
        ;;
    e)  # the Adam-eigenbasis moments in multi-tensor operations: before (.old) and after
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        run 120 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_gpu.py -rA \
            -k "quiet_step or batched_steps"
        (cd benchmarks && run 300 gpu_step_adam python3 gpu_step.py --before ../.old \
            --rounds 2 ${COMMIT:+--commit "$COMMIT"} --only "b32 fp32: SGD" "Adam eigenbasis" "transformer 10.7M b64 fp32: AdamW" \
            --skip "K-FAC 5/50" --json "$OUT/gpu_step_adam2.json")
        ;;
    f)  # the flat-buffer quiet step: the gpu tests, the step before (.old) and after, where
        # the time goes (profiler traces), the plan against this GPU
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        run 100 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_gpu.py -rA \
            --tb=short
        (cd benchmarks && run 220 gpu_step python3 gpu_step.py --before ../.old --rounds 2 \
            ${COMMIT:+--commit "$COMMIT"} --only "b32 fp32: SGD" "b32 fp32: K-FAC inverse 10/100" \
            "b32 fp32: K-FAC eigen 10/100" "transformer" --skip "highest" "eigenbasis" \
            --json "$OUT/gpu_step.json")
        (cd benchmarks && run 90 gpu_trace python3 gpu_trace.py --only resnet50 \
            ${COMMIT:+--commit "$COMMIT"} --json "$OUT/gpu_trace.json" --traces /tmp/traces)
        tar -czf "$OUT/traces.tgz" -C /tmp traces 2>/dev/null
        (cd benchmarks && run 170 plan_check python3 plan_check.py --gpu --rounds 2 \
            --json "$OUT/plan_check.json")
        ;;
    g)  # after the factor-phase trim: the gpu tests, the step before (.old) and after in 2
        # rounds, bf16, batch 64, and the traces with 5 samples of each kind of step
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        run 100 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_gpu.py -rA \
            --tb=short
        (cd benchmarks && run 250 gpu_step python3 gpu_step.py --before ../.old --rounds 2 \
            ${COMMIT:+--commit "$COMMIT"} --only "b32 fp32: SGD" "b32 fp32: K-FAC inverse 10/100" \
            "b32 fp32: K-FAC eigen 10/100" "b32 bf16" "b64 fp32" "transformer" --skip "highest" \
            "eigenbasis" \
            --json "$OUT/gpu_step.json")
        (cd benchmarks && run 120 gpu_trace python3 gpu_trace.py --only resnet50 --repeats 5 \
            ${COMMIT:+--commit "$COMMIT"} --json "$OUT/gpu_trace.json" --traces /tmp/traces)
        tar -czf "$OUT/traces.tgz" -C /tmp traces 2>/dev/null
        ;;
    h | i)  # the preconditioning in CUDA graphs against without, in one run; (h only) the
        # plan against this GPU at batch 32 and 64, every phase
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        run 100 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_gpu.py -rA \
            --tb=short
        (cd benchmarks && run 220 gpu_step python3 gpu_step.py --rounds 2 \
            ${COMMIT:+--commit "$COMMIT"} --only "b32 fp32: SGD" "b32 fp32: K-FAC inverse 10/100" \
            "b32 fp32: K-FAC eigen 10/100" "b64 fp32" "transformer" --skip "highest" "eigenbasis" \
            --json "$OUT/gpu_step.json")
        [ "$stage" = h ] && (cd benchmarks && run 250 plan_vs_gpu python3 plan_vs_gpu.py \
            --rounds 1 ${COMMIT:+--commit "$COMMIT"} --json "$OUT/plan_vs_gpu.json")
        ;;
    j)  # the plan against this GPU at batch 32 and 64 alone (a profile with the host's step)
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        (cd benchmarks && run 250 plan_vs_gpu python3 plan_vs_gpu.py --rounds 1 \
            ${COMMIT:+--commit "$COMMIT"} --json "$OUT/plan_vs_gpu.json")
        ;;
    l)  # the gpu tests with tracebacks; the plan against this GPU (the one-sample host step,
        # the model's own factor work); the step costs of the methods, EKFAC included
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        run 110 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_gpu.py -rA \
            --tb=short
        (cd benchmarks && run 230 plan_vs_gpu python3 plan_vs_gpu.py --rounds 1 \
            ${COMMIT:+--commit "$COMMIT"} --json "$OUT/plan_vs_gpu.json")
        (cd benchmarks && run 170 gpu_step python3 gpu_step.py --rounds 2 \
            ${COMMIT:+--commit "$COMMIT"} --only "b32 fp32: SGD" "b32 fp32: K-FAC inverse 10/100" \
            "b32 fp32: K-FAC eigen 10/100" "EKFAC" "b32 fp32: K-FAC Adam eigenbasis" \
            --skip "highest" "graphs" --json "$OUT/gpu_step.json")
        ;;
    m)  # the quiet step in fewer operations: the gpu tests; the step before (.old) and after,
        # interleaved, ResNet-50 b32 (fp32 and bf16) and the transformer
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        run 90 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_gpu.py -rA \
            --tb=short
        (cd benchmarks && run 280 gpu_step python3 gpu_step.py --before ../.old --rounds 2 \
            ${COMMIT:+--commit "$COMMIT"} --only "b32 fp32: SGD" "b32 fp32: K-FAC inverse 10/100" \
            "b32 fp32: K-FAC eigen 10/100" "EKFAC" "b32 bf16: SGD" "b32 bf16: K-FAC inverse" \
            "transformer 10.7M b64 fp32: AdamW" --skip "highest" "graphs" "eigenbasis" \
            --json "$OUT/gpu_step.json")
        ;;
    n | q)  # (n) the gpu tests, then the step before (.old) and after, interleaved; (q) the
        # step alone, one process on the GPU: ResNet-50 b32 fp32 and bf16, the transformer
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        [ "$stage" = n ] && run 90 tests python3 -m pytest -q -p no:cacheprovider -m gpu \
            tests/core/test_gpu.py -rA --tb=short
        [ "$stage" = n ] && before=(--before ../.old) || before=()
        (cd benchmarks && run 290 gpu_step python3 gpu_step.py "${before[@]}" --rounds 2 \
            ${COMMIT:+--commit "$COMMIT"} --only "b32 fp32: SGD" "b32 fp32: K-FAC inverse 10/100" \
            "b32 fp32: K-FAC eigen 10/100" "b32 bf16: SGD" "b32 bf16: K-FAC inverse" \
            "transformer 10.7M b64 fp32: AdamW" --skip "highest" "graphs" "eigenbasis" "EKFAC" \
            --json "$OUT/gpu_step.json")
        ;;
    o | r)  # the plan against this GPU: batch 32 and 64 at 10/100, batch 32 at 1/10 (r: the
        # gpu tests first)
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        [ "$stage" = r ] && run 150 tests python3 -m pytest -q -p no:cacheprovider -m gpu \
            tests/core/test_gpu.py -rA --tb=short
        (cd benchmarks && run 320 plan_vs_gpu python3 plan_vs_gpu.py --rounds 1 \
            ${COMMIT:+--commit "$COMMIT"} --json "$OUT/plan_vs_gpu.json")
        ;;
    p)  # where the time goes, fp32 against bf16 autocast: traces of ResNet-50 b32 SGD and inverse
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        (cd benchmarks && run 200 gpu_trace python3 gpu_trace.py --only "b32 SGD" \
            "b32 K-FAC inverse 10/100" "bf16" --repeats 3 ${COMMIT:+--commit "$COMMIT"} \
            --json "$OUT/gpu_trace.json")
        ;;
    k)  # where the graphed step's time goes: traces with and without the graph
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        (cd benchmarks && run 150 gpu_trace python3 gpu_trace.py --only resnet50 --repeats 5 \
            ${COMMIT:+--commit "$COMMIT"} --json "$OUT/gpu_trace.json" --traces /tmp/traces)
        ;;
    esac
done
