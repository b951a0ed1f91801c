#!/usr/bin/env bash
# One GPU round: environment + install, the core test suite on CUDA, compute-sanitizer
# memcheck on three small calls, bench_attention.py and bench_generate.py. Each step's output goes to
# $OUT/<step>.log (tee'd), a failing step never stops the next, and every step runs under a timeout cut from
# one overall budget, so the whole round ends by itself inside a 10-minute limit.
#
#   bash benchmarks/gpu_round.sh                    # = tests,sanitize,attention (attention gets what is left)
#   bash benchmarks/gpu_round.sh generate           # ~5-8 min: bench_generate.py, in a second call
#   bash benchmarks/gpu_round.sh attention          # bench_attention.py alone (~3-5 min), if the first call cut it
#   bash benchmarks/gpu_round.sh all                # all four in order, later steps cut or skipped by budget
#
# The env step (nvidia-smi, versions, install) always runs first. Variables:
#   ROUND_BUDGET_S (default 570)  seconds for the whole round
#   PYTEST_ARGS                   extra pytest arguments (default: none)
#   TESTS_MAX_S (default 270)     seconds for the tests step (the whole suite once took 321 s: give a tests-only round more)
#   BENCH_ATTENTION_ARGS, BENCH_GENERATE_ARGS   extra benchmark arguments (e.g. --quick)
#   FLASHCORE_GIT_COMMIT          the commit to record in the JSON when the copy there has no .git
# At most 8 files are collected from $OUT; past that, PNGs and the junit XML are packed into one tar.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
OUT="${OUT:-$REPO/benchmarks/results}"
mkdir -p "$OUT"
export REPO OUT PYTHONUNBUFFERED=1
BUDGET=${ROUND_BUDGET_S:-570}
START=$SECONDS
STEPS="${1:-tests,sanitize,attention}"
[[ "$STEPS" == all ]] && STEPS="tests,sanitize,attention,generate"
declare -A STATUS
ORDER=()

remaining() { echo $((BUDGET - (SECONDS - START))); }

# run_step NAME MAX_SECONDS MIN_SECONDS COMMAND...: runs COMMAND under min(MAX, what is left), or skips it when
# less than MIN_SECONDS are left.
run_step() {
    local name=$1 max=$2 min=$3
    shift 3
    local left limit started rc
    left=$(remaining)
    limit=$((left - 5 < max ? left - 5 : max))
    ORDER+=("$name")
    if ((limit < min)); then
        STATUS[$name]="skipped: ${left}s left of the round budget, needs >= ${min}s"
        echo "=== $name: ${STATUS[$name]}" | tee -a "$OUT/$name.log"
        return
    fi
    echo "=== $name (timeout ${limit}s, $(date -u +%H:%M:%S)) ===" | tee -a "$OUT/$name.log"
    started=$SECONDS
    STEP_LIMIT=$limit timeout -k 10 "$limit" bash -c "$*" 2>&1 | tee -a "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    STATUS[$name]="rc=$rc in $((SECONDS - started))s$( ((rc == 124 || rc == 137)) && echo ' (TIMED OUT)')"
    echo "=== $name: ${STATUS[$name]}" | tee -a "$OUT/$name.log"
}

step_env() {
    nvidia-smi
    python3 - <<'EOF'
import sys, torch, triton
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__)
try:
    import transformers
    print("transformers", transformers.__version__)
except ImportError as error:
    print("transformers missing:", error)
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print("gpu", props.name, "sms", props.multi_processor_count, "mem_gb", round(props.total_memory / 1e9, 1),
          "l2_mb", round(getattr(props, "L2_cache_size", 0) / 1e6, 1))
else:
    print("NO CUDA DEVICE VISIBLE TO TORCH")
EOF
    echo "git commit: ${FLASHCORE_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo "unknown (no .git here; pass FLASHCORE_GIT_COMMIT=<sha>)")}"
    command -v compute-sanitizer || find /usr/local/cuda*/bin -name compute-sanitizer 2>/dev/null || echo "no compute-sanitizer found"
    install_flashcore
}

# flashcore.integrations lives in integrations/ (setuptools package-dir), so plain PYTHONPATH is not enough.
# An editable install maps it; it is checked from the repo root, where ./flashcore shadows any installed copy.
install_flashcore() {
    if python3 -m pip install --no-deps --no-build-isolation --no-index -q -e "$REPO"; then
        echo "installed: pip install -e (editable, offline)"
    else
        echo "pip install -e failed; falling back to a .pth import hook"
        install_flashcore_finder
    fi
    if ! python3 -c "import flashcore.integrations"; then
        echo "flashcore.integrations still not importable; trying the .pth import hook"
        install_flashcore_finder
    fi
    python3 -c "import flashcore, flashcore.integrations as i; print('flashcore', flashcore.__file__, '| integrations', i.__file__)"
}

# A meta-path finder, loaded from a .pth file at interpreter start, that maps flashcore and flashcore.integrations
# to the checkout (what setuptools' editable finder does).
install_flashcore_finder() {
    local site
    site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    cat >"$site/_flashcore_checkout_finder.py" <<EOF
import sys
from importlib.machinery import PathFinder

MAPPING = {"flashcore": "$REPO/flashcore", "flashcore.integrations": "$REPO/integrations"}


class _Finder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        # PathFinder names the spec fullname and looks for its last component in the given folder.
        if fullname in MAPPING:
            return PathFinder.find_spec(fullname, [MAPPING[fullname].rsplit("/", 1)[0]])
        return None


sys.meta_path.append(_Finder)
EOF
    echo "import _flashcore_checkout_finder" >"$site/_flashcore_checkout_finder.pth"
    echo "wrote $site/_flashcore_checkout_finder.pth"
}

step_tests() {
    # -m "not slow": the real-model tests are the long ones; bf16 runs only here (tests/conftest.py).
    # shellcheck disable=SC2086
    FLASHCORE_TEST_DEVICE=cuda python3 -m pytest tests -q -x -m "not slow" -p no:cacheprovider -rfEs \
        --junitxml="$OUT/tests_junit.xml" ${PYTEST_ARGS:-}
}

step_sanitize() {
    local sanitizer rc
    sanitizer=$(command -v compute-sanitizer || find /usr/local/cuda*/bin -name compute-sanitizer 2>/dev/null | head -1)
    # Plain first: checks the outputs and fills Triton's on-disk cache, so the memcheck run loads the compiled
    # kernels instead of compiling them under instrumentation.
    python3 benchmarks/sanitize_calls.py
    rc=$?
    if [[ -z "$sanitizer" ]]; then
        echo "compute-sanitizer not found"
        return 3
    fi
    # No caching allocator: every tensor is its own allocation, so an out-of-bounds access past a tensor is
    # caught instead of landing in a neighbour inside the same pooled block. API-error reports are off: torch
    # probes the driver with calls that fail by design; memcheck's job here is the kernels' memory accesses.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool memcheck --target-processes all \
        --report-api-errors no --error-exitcode 99 python3 benchmarks/sanitize_calls.py
    local memcheck_rc=$?
    echo "sanitize_calls plain rc=$rc, under memcheck rc=$memcheck_rc (99 = memcheck found errors)"
    return $((rc != 0 ? rc : memcheck_rc))
}

step_attention() {
    # shellcheck disable=SC2086
    python3 benchmarks/bench_attention.py --out "$OUT" --time-budget-s $((STEP_LIMIT - 45)) ${BENCH_ATTENTION_ARGS:-}
}

step_generate() {
    # A row (one path at one batch size) can take ~2 min when it compiles; stop starting rows well before.
    # shellcheck disable=SC2086
    python3 benchmarks/bench_generate.py --out "$OUT" --time-budget-s $((STEP_LIMIT - 150)) ${BENCH_GENERATE_ARGS:-}
}

export -f step_env install_flashcore install_flashcore_finder step_tests step_sanitize step_attention step_generate

run_step env 120 10 step_env
IFS=',' read -ra REQUESTED <<<"$STEPS"
for step in "${REQUESTED[@]}"; do
    case "$step" in
    env) ;;
    tests) run_step tests "${TESTS_MAX_S:-270}" 60 step_tests ;;
    sanitize) run_step sanitize 200 60 step_sanitize ;;
    attention) run_step attention 400 120 step_attention ;;
    generate) run_step generate 560 240 step_generate ;;
    *) echo "unknown step '$step' (known: tests, sanitize, attention, generate, all)" ;;
    esac
done

# At most 8 files are collected: keep logs and JSON as files, pack the rest if needed.
mapfile -t FILES < <(find "$OUT" -maxdepth 1 -type f | sort)
if ((${#FILES[@]} > 8)); then
    shopt -s nullglob
    EXTRAS=("$OUT"/*.png "$OUT"/*.xml "$OUT"/*.tmp)
    if ((${#EXTRAS[@]})) && tar -cf "$OUT/extras.tar" -C "$OUT" "${EXTRAS[@]##*/}"; then
        rm -f -- "${EXTRAS[@]}"
        echo "packed ${EXTRAS[*]##*/} into $OUT/extras.tar (at most 8 files are collected)"
    fi
fi

echo
echo "================ gpu_round summary ($((SECONDS - START))s of ${BUDGET}s) ================"
for name in "${ORDER[@]}"; do
    echo "$name: ${STATUS[$name]}"
done
[[ -f "$OUT/tests.log" ]] && echo "tests: $(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -1)"
[[ -f "$OUT/sanitize.log" ]] && grep -E "ERROR SUMMARY|sanitize_calls:" "$OUT/sanitize.log"
for bench in attention generate; do
    if [[ -f "$OUT/$bench.log" ]]; then
        echo "---- $bench tables ----"
        sed -n '/^== /,$p' "$OUT/$bench.log" | cut -c1-400 | head -90
    fi
done
ls -la "$OUT"
