#!/usr/bin/env bash
# One check of the learner on a GPU machine without network: the inner step against a plain
# torch loop at gpt-125m (fp32 and bf16), then a short real `diloco run` of a 125M job in bf16
# with two learners sharing the GPU. Everything it writes goes to $OUT (logs, JSON results).
#
# The machine has python3 with torch, aiohttp, safetensors, rich, prometheus-client, pyyaml and
# numpy; pydantic and its dependencies, and isal (the checksums' CRC-32), come as wheels in .whl/
# (pip download ... -d .whl).
#
# Usage (from the repository root):
#   OUT=/some/empty/dir hack/gpu-check.sh          # on the GPU machine, 5-7 minutes
#   OUT=/tmp/gc DEVICE=cpu hack/gpu-check.sh       # a dry run here: tiny model, CPU, a minute
#   MODE=overhead OUT=... hack/gpu-check.sh        # fp16, micro-batches with A/A controls, and the
#                                                  # learner in a real job (4-5 minutes on a GPU)
#   MODE=presets OUT=... hack/gpu-check.sh         # the learner's step at gpt-350m and gpt-1b in
#                                                  # bf16: step time, TFLOP/s, peak memory (2 min)
#   MODE=injob OUT=... hack/gpu-check.sh           # the learner inside a real job against the plain
#                                                  # loop at gpt-125m and gpt-mini in bf16, under
#                                                  # sync.mergeWait overlap and nextPush (5-6 min);
#                                                  # ONLY=GLOB runs the cases it matches
#                                                  # (e.g. ONLY='gpt-125m-h40-nextPush'), EXTRA
#                                                  # adds arguments to each (EXTRA='--outer-steps
#                                                  # 24'; then LIMIT=300 seconds a case), PLAIN
#                                                  # the plain blocks' steps (default 40);
#                                                  # CALLS=1 also runs bench.studies.learner_calls on
#                                                  # each case (the training thread call by call)
#   MODE=pull OUT=... hack/gpu-check.sh            # pulled updates applied on the GPU: the
#                                                  # rebuild against the host's bit for bit, what
#                                                  # each part of the link's work slows in the
#                                                  # steps (bench.studies.link_interference), then
#                                                  # injob's gpt-125m cases under
#                                                  # DILOCO_PULL_APPLY=device and host (5 min)
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
echo "== gpu-check: device $DEVICE, results in $OUT, $(date -u +%FT%TZ), rev $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"

SITE=/tmp/gpu-check-site
if compgen -G ".whl/*.whl" >/dev/null; then
    # Without pip (or if it refuses), unpack them: a wheel is a zip of the importable tree.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl \
        || { echo "!! pip install of .whl/ failed: unpacking the wheels instead"
             "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
                 "$SITE" .whl/*.whl; }
fi
export PYTHONPATH="$SITE:$ROOT/trainer:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - <<'EOF' | tee "$OUT/env.txt"
import platform, torch, pydantic
print("python", platform.python_version(), "torch", torch.__version__, "pydantic", pydantic.VERSION)
print("cuda", torch.cuda.is_available(), torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", "bf16", torch.cuda.is_bf16_supported())
EOF

if [[ "${MODE:-full}" == presets ]]; then
    # The larger presets' step on one GPU (one learner, ddp of one rank): the figures docs/learner.md
    # gives per rank, measured with activations, beside the plain loop. gpt-1b's activations at
    # 4 x 1024 want activation checkpointing to leave room for the fp32 copies and AdamW.
    if [[ "$DEVICE" == cuda ]]; then
        CASES=("gpt-350m --batch-size 8 --seq-len 1024" "gpt-1b --batch-size 4 --seq-len 1024 --checkpointing")
        STEPS=(--steps 6 --rounds 1 --warmup 2)
    else
        CASES=("gpt-tiny --batch-size 4 --seq-len 64")
        STEPS=(--steps 2 --rounds 1 --warmup 1)
    fi
    for case in "${CASES[@]}"; do
        read -r -a words <<<"$case"
        echo "== bench.learner_step ${words[0]} bf16 on $DEVICE"
        timeout 75 "$PY" -m bench.learner_step --device "$DEVICE" --preset "${words[@]}" \
            --precision bf16 "${STEPS[@]}" --json "$OUT/bench-${words[0]}-bf16.json" \
            || echo "!! bench ${words[0]} failed or timed out (exit $?)"
    done
    echo "== gpu-check (presets) done $(date -u +%FT%TZ)"
    exit 0
fi

if [[ "${MODE:-full}" == pull ]]; then
    if [[ "$DEVICE" == cuda ]]; then
        echo "== learner/device_copies on cuda: updates rebuilt on the GPU against the host's"
        "$PY" - <<'PYEOF' || echo "!! rebuild check failed"
import time, torch
from diloco_trainer.core import compress, payloads
from diloco_trainer.core.published import apply_updates, check_updates, weights_checksum
from diloco_trainer.learner.device_copies import DeviceStager
gen = torch.Generator().manual_seed(0)
# A gpt-125m fragment's shapes, odd tails included, and a chain of two pulled updates.
shapes = {f"h{i}.{k}": s for i in range(6) for k, s in {"ln.w": (768,), "qkv.w": (2304, 768), "fc.w": (3072, 768), "odd": (1001,)}.items()}
held = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
ups = [(v, compress.encode_tensors({n: 1e-3 * torch.randn(s, generator=gen) for n, s in shapes.items()}, "int8", on=None)) for v in (1, 2)]
tensors, _ = payloads.decode_body_unlocked(payloads.encode_update_chain(ups, {}))
chain = payloads.split_update_chain(tensors, 0, 2)
want = apply_updates(held, chain, "int8")
stager = DeviceStager("cuda")
on_device = stager.stage(held)
check_updates({n: t.shape for n, t in held.items()}, chain, "int8")
for attempt in range(3):
    t0 = time.perf_counter()
    there, host = stager.rebuild(on_device, chain, "int8")
    took = time.perf_counter() - t0
    assert all(torch.equal(host[n], want[n]) and torch.equal(there[n].cpu(), want[n]) for n in shapes)
    assert all(host[n].is_pinned() and there[n].is_cuda for n in shapes)
assert weights_checksum(host) == weights_checksum(want)
t0 = time.perf_counter(); apply_updates(held, chain, "int8"); on_host = time.perf_counter() - t0
print(f"rebuild on cuda: bit for bit the host's over {sum(t.numel() for t in held.values()):,} values; {took:.3f}s (on the host: {on_host:.3f}s, then the staging)")
PYEOF
        echo "== bench.studies.link_interference gpt-125m bf16"
        timeout 150 "$PY" -m bench.studies.link_interference --device cuda --preset gpt-125m \
            --precision bf16 --batch-size 16 --seq-len 1024 --steps 12 --rounds 2 \
            --json "$OUT/link-interference.json" 2>&1 || echo "!! link_interference failed (exit $?)"
        [[ -n "${SKIP_JOBS:-}" ]] && { echo "== gpu-check (pull) done $(date -u +%FT%TZ)"; exit 0; }
        # The new default under both merge-wait rules; the baseline under nextPush alone.
        WANT_device=${ONLY:-'gpt-125m-h40-[no]*'} WANT_host=${ONLY:-'gpt-125m-h40-nextPush'}
    else
        timeout 120 "$PY" -m bench.studies.link_interference --steps 4 --rounds 1 \
            --json "$OUT/link-interference.json" || echo "!! link_interference failed (exit $?)"
        WANT_device=${ONLY:-'*'} WANT_host=${ONLY:-'*-nextPush'}
    fi
    for pull in device host; do
        want=WANT_$pull
        DILOCO_PULL_APPLY=$pull MODE=injob ONLY="${!want}" OUT="$OUT/pull-$pull" bash "$0"
    done
    echo "== gpu-check (pull) done $(date -u +%FT%TZ)"
    exit 0
fi

if [[ "${MODE:-full}" == injob ]]; then
    # The done-when figure of the learner in a job (bench/learner_overlap.py): one island, K = M,
    # the job's defaults (overlapMode auto) under both merge-wait rules; results and learner logs
    # in one archive, so that what comes back stays a few files.
    WORK_OUT="$OUT/injob"
    mkdir -p "$WORK_OUT"
    if [[ "$DEVICE" == cuda && -z "${SKIP_CHECKS:-}" ]]; then  # SKIP_CHECKS=1: the jobs alone
        echo "== learner/device_copies on cuda: the copies against plain ones"
        "$PY" - <<'PYEOF' || echo "!! device_copies check failed"
import torch
from diloco_trainer.learner.device_copies import DeviceStager, adopt, to_host
x = {"a": torch.randn(4096, 1024, device="cuda"), "b": torch.randint(-128, 127, (999,), dtype=torch.int8, device="cuda")}
host, ready = to_host(x)
ready()
assert all(host[k].is_pinned() and torch.equal(host[k], x[k].cpu()) for k in x)
stager = DeviceStager("cuda")
staged = adopt(stager.stage({"w": host["a"], "v": torch.arange(7.0)}))
assert torch.equal(staged["w"], x["a"]) and staged["w"].dtype == torch.float32 and staged["v"].is_cuda
print("device_copies: ok")
PYEOF
        echo "== learner/push_encoding on cuda: batched int8 against per tensor, and its time on the calling thread"
        "$PY" - <<'PYEOF' || echo "!! push_encoding check failed"
import time, torch
from diloco_trainer.core import compress
from diloco_trainer.learner.push_encoding import encode_for_wire
from diloco_trainer.learner.device_copies import snapshot, to_host
from diloco_trainer.learner.mixing import pseudo_gradient
# A gpt-125m fragment's shapes: 6 blocks of 12 tensors, about 42M values.
shapes = {f"h{i}.{k}": s for i in range(6) for k, s in {"ln1.w": (768,), "ln1.b": (768,), "qkv.w": (2304, 768), "qkv.b": (2304,), "proj.w": (768, 768), "proj.b": (768,), "ln2.w": (768,), "ln2.b": (768,), "fc.w": (3072, 768), "fc.b": (3072,), "out.w": (768, 3072), "out.b": (768,)}.items()}
base = {n: torch.randn(s, device="cuda") for n, s in shapes.items()}
params = {n: (t + 1e-3 * torch.randn_like(t)) for n, t in base.items()}
def per_tensor(delta, fb):
    sent = {n: fb.compensate(n, d) for n, d in delta.items()}
    enc = compress.encode_tensors(sent, "int8", on=None)
    dec = compress.decode_tensors(enc, "int8", {n: t.shape for n, t in sent.items()})
    for n, t in sent.items():
        fb.record(n, t, dec[n])
    return to_host(enc)  # the old path's copies: without blocking
def batched(delta, fb):
    enc, ready = encode_for_wire(delta, "int8", fb)
    return enc, ready
ours, theirs = compress.ErrorFeedback(), compress.ErrorFeedback()
for push in range(3):
    delta = pseudo_gradient(base, snapshot(params))
    ref, wait = per_tensor(delta, theirs)
    wait()
    enc, ready = batched(delta, ours)
    ready()
    assert enc.keys() == ref.keys() and all(torch.equal(enc[k], ref[k]) for k in ref), push
    assert all(torch.equal(ours.residuals[n].cpu(), theirs.residuals[n].cpu()) for n in shapes), push
    for t in params.values():
        t.add_(1e-4)
print("push_encoding: bit-identical on cuda over 3 pushes with error feedback")
def calling_thread(fn):
    x = torch.randn(8192, 8192, device="cuda")
    times = []
    for _ in range(5):
        for _ in range(20):
            x = x @ x.T * 1e-4  # a queue of work ahead, as training steps leave it
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return sorted(times)[2]
fb1, fb2 = compress.ErrorFeedback(), compress.ErrorFeedback()
old = calling_thread(lambda: per_tensor({n: base[n] - params[n].detach().to(torch.float32, copy=True) for n in shapes}, fb1))
new = calling_thread(lambda: batched(pseudo_gradient(base, snapshot(params)), fb2))
print(f"push on the calling thread, median of 5 behind a busy queue: per tensor {old:.4f}s, batched {new:.4f}s")
PYEOF
    fi
    if [[ "$DEVICE" == cuda ]]; then
        CASES=("gpt-125m-h40 --preset gpt-125m --batch-size 16 --seq-len 1024 --inner-steps 40 --outer-steps 8"
               "gpt-125m-h100 --preset gpt-125m --batch-size 16 --seq-len 1024 --inner-steps 100 --outer-steps 4"
               "gpt-mini-h40 --preset gpt-mini --batch-size 32 --seq-len 256 --inner-steps 40 --outer-steps 8"
               "gpt-mini-h200 --preset gpt-mini --batch-size 32 --seq-len 256 --inner-steps 200 --outer-steps 8"
               "gpt-125m-h40-compiled --preset gpt-125m --batch-size 16 --seq-len 1024 --inner-steps 40 --outer-steps 8 --compile")
        LIMIT=${LIMIT:-150}
    else
        CASES=("gpt-tiny-h40 --preset gpt-tiny --batch-size 8 --seq-len 64 --inner-steps 40 --outer-steps 4")
        LIMIT=120
    fi
    for case in "${CASES[@]}"; do
        read -r -a words <<<"$case"
        for wait in overlap nextPush; do
            [[ "${words[0]}" == *h100 && "$wait" == nextPush ]] && continue  # H = 100: the default rule only
            # Compiled: is a step that launches less moved less by the work beside it? nextPush only.
            [[ "${words[0]}" == *compiled && "$wait" == overlap ]] && continue
            name="${words[0]}-$wait"
            [[ -n "${ONLY:-}" && "$name" != $ONLY ]] && continue  # ONLY=GLOB: just those cases
            echo "== bench.learner_overlap $name bf16 on $DEVICE"
            # EXTRA: more arguments, after the case's own (e.g. EXTRA='--outer-steps 24': a
            # longer job, whose start-up weighs less in its figure).
            # shellcheck disable=SC2086
            timeout "$LIMIT" "$PY" -m bench.learner_overlap --device "$DEVICE" --precision bf16 \
                "${words[@]:1}" ${EXTRA:-} --merge-wait "$wait" --plain-steps "${PLAIN:-40}" \
                --json "$WORK_OUT/$name.json" --logs "$WORK_OUT/logs-$name" \
                || echo "!! learner_overlap $name failed or timed out (exit $?)"
            if [[ -n "${CALLS:-}" ]]; then  # CALLS=1: the same job's training thread call by call
                echo "== bench.studies.learner_calls $name bf16 on $DEVICE"
                # shellcheck disable=SC2086
                timeout "$LIMIT" "$PY" -m bench.studies.learner_calls --device "$DEVICE" --precision bf16 \
                    "${words[@]:1}" ${EXTRA:-} --merge-wait "$wait" \
                    --json "$WORK_OUT/calls-$name.json" \
                    || echo "!! learner_calls $name failed or timed out (exit $?)"
            fi
            tar -czf "$OUT/injob.tgz" -C "$OUT" injob  # after each case: a cut-off run keeps some
        done
    done
    rm -rf "$WORK_OUT"
    echo "== gpu-check (injob) done $(date -u +%FT%TZ)"
    exit 0
fi

if [[ "${MODE:-full}" == overhead ]]; then
    # The learner's overhead in the cases the full check left open: fp16 and micro-batches with
    # more steps per side, each beside an A/A control (the plain loop against itself: the noise
    # floor of the ratio), then the learner inside a real one-island job, pushes and pulls
    # overlapped, against the plain loop (bench/learner_overlap.py).
    if [[ "$DEVICE" == cuda ]]; then
        PRESET=gpt-125m BENCH_ARGS=(--seq-len 1024 --steps 12 --rounds 6 --warmup 3)
        OVERLAP=(--preset gpt-125m --precision bf16 --batch-size 16 --seq-len 1024
                 --inner-steps 40 --outer-steps 8 --plain-steps 40)
    else
        PRESET=gpt-tiny BENCH_ARGS=(--seq-len 64 --steps 3 --rounds 2 --warmup 1)
        OVERLAP=(--preset gpt-tiny --batch-size 8 --seq-len 64 --inner-steps 40 --outer-steps 4)
    fi
    for case in "bf16-control --precision bf16 --batch-size 16 --control" \
                "bf16 --precision bf16 --batch-size 16" \
                "fp16 --precision fp16 --batch-size 16" \
                "bf16-micro4-control --precision bf16 --batch-size 8 --micro-batches 4 --control" \
                "bf16-micro4 --precision bf16 --batch-size 8 --micro-batches 4"; do
        read -r -a words <<<"$case"
        [[ "$DEVICE" != cuda && "${words[2]}" == fp16 ]] && continue  # fp16 is CUDA-only
        echo "== bench.learner_step $PRESET ${words[0]} on $DEVICE"
        timeout 120 "$PY" -m bench.learner_step --device "$DEVICE" --preset "$PRESET" \
            "${BENCH_ARGS[@]}" "${words[@]:1}" --json "$OUT/bench-$PRESET-${words[0]}.json" \
            || echo "!! bench ${words[0]} failed or timed out (exit $?)"
    done
    echo "== bench.learner_overlap on $DEVICE"
    timeout 240 "$PY" -m bench.learner_overlap --device "$DEVICE" "${OVERLAP[@]}" \
        --json "$OUT/overlap.json" || echo "!! learner_overlap failed or timed out (exit $?)"
    echo "== gpu-check (overhead) done $(date -u +%FT%TZ)"
    exit 0
fi

if [[ "$DEVICE" == cuda ]]; then
    PRESET=gpt-125m BENCH_ARGS=(--batch-size 16 --seq-len 1024 --steps 8 --rounds 2 --warmup 3)
    RUN_PRESET=gpt-125m RUN_BATCH=8 RUN_SEQ=512 RUN_MICRO=2 RUN_H=20 RUN_OUTER=4
    BENCH_TIMEOUT=120 RUN_TIMEOUT=200
else
    PRESET=gpt-tiny BENCH_ARGS=(--batch-size 4 --seq-len 64 --steps 3 --rounds 2 --warmup 1)
    RUN_PRESET=gpt-tiny RUN_BATCH=4 RUN_SEQ=64 RUN_MICRO=2 RUN_H=8 RUN_OUTER=2
    BENCH_TIMEOUT=120 RUN_TIMEOUT=180
fi

bench() {  # bench NAME TIMEOUT ARGS...: one bench.learner_step run, its JSON in $OUT
    local name=$1 limit=$2
    shift 2
    echo "== bench.learner_step $PRESET $name on $DEVICE"
    timeout "$limit" "$PY" -m bench.learner_step --device "$DEVICE" --preset "$PRESET" \
        "${BENCH_ARGS[@]}" "$@" --json "$OUT/bench-$PRESET-$name.json" \
        || echo "!! bench $name failed or timed out (exit $?)"
}

# 1. The learner's inner step against a plain torch loop: fp32, bf16, bf16 with activation
#    checkpointing (memory).
bench fp32 "$BENCH_TIMEOUT" --precision fp32
bench bf16 "$BENCH_TIMEOUT" --precision bf16
bench bf16-ckpt "$BENCH_TIMEOUT" --precision bf16 --checkpointing
# The small model too (launch overhead dominates a step there, so the learner's extra Python
# shows most): named gpt-mini in its JSON.
[[ "$DEVICE" == cuda ]] && PRESET=gpt-mini bench fp32 60 --precision fp32 --batch-size 32 \
    --seq-len 256 --steps 30

# 2. A short real job: the syncer on the CPU, two islands of one learner each on $DEVICE.
WORK=/tmp/gpu-check-run
rm -rf "$WORK"
mkdir -p "$WORK"
cat >"$OUT/job.yaml" <<EOF
model: {preset: $RUN_PRESET, seed: 0}
data: {evalTokens: 2048}
islands: {count: 2}
inner:
  steps: $RUN_H
  batchSize: $RUN_BATCH
  microBatches: $RUN_MICRO
  seqLen: $RUN_SEQ
  precision: bf16
  lr: 0.0006
  warmupSteps: 10
sync: {quorum: 2, fragments: 2, compression: int8}
stopAfter: {outerSteps: $RUN_OUTER}
syncer:
  evalEveryOuterSteps: 2
  checkpoint: {everyOuterSteps: 100}
EOF
echo "== diloco run: $RUN_PRESET bf16, 2 islands on $DEVICE, H=$RUN_H, $RUN_OUTER outer steps"
start=$(date +%s)
DILOCO_DEVICE=$DEVICE timeout "$RUN_TIMEOUT" "$PY" -m diloco_trainer.cli run "$OUT/job.yaml" \
    --workdir "$WORK" --summary "$OUT/run-summary.json" --quiet
code=$?
echo "== diloco run exited $code after $(( $(date +%s) - start ))s"
mkdir -p "$OUT/run-logs"
cp "$WORK"/logs/*.log "$OUT/run-logs/" 2>/dev/null
grep -h "tokens/s\|peak GPU memory\|exiting\|Error\|error" "$WORK"/logs/island-*.log 2>/dev/null | tail -20

"$PY" - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("bench-*.json")):
    r = json.loads(path.read_text())
    print(f"{path.name}: plain {r['plain']['tokens_per_s']:.0f} tok/s "
          f"{r['plain']['peak_memory_gib']:.2f} GiB, learner {r['learner']['tokens_per_s']:.0f} "
          f"tok/s {r['learner']['peak_memory_gib']:.2f} GiB, ratio {r['ratio_learner_to_plain']:.3f}, "
          f"{r['learner']['model_tflops']:.1f} TFLOP/s")
summary = out / "run-summary.json"
if summary.exists():
    s = json.loads(summary.read_text())
    wall = s["wall_seconds"] or 1
    print(f"run: finished {s['finished']}, outer steps {s['outer_steps']}, tokens {s['tokens']}, "
          f"eval loss {s['initial_eval_loss']} -> {s['final_eval_loss']}, {wall:.0f}s wall, "
          f"{s['tokens'] / wall:.0f} tokens/s merged (start-up included)")
else:
    print("run: no summary")
EOF
# 3. Last, after the summary, as it may not finish in time: bf16 with torch.compile (both sides
#    compile; its table is printed above the done line).
[[ "$DEVICE" == cuda ]] && bench bf16-compile 150 --precision bf16 --compile
echo "== gpu-check done $(date -u +%FT%TZ)"
