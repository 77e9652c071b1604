#!/usr/bin/env bash
# Mutation report for the core (issue 8). A report, not part of CI: it is slow.
#
#   scripts/mutation.sh [FILE_STEM ...]     # default: every core file below
#
# Per core file it prepares a scratch copy under .mutation/<stem>/ (gitignored), writes a
# mutmut config that mutates only that file with the operator set of scripts/mutation_ops.py,
# runs mutmut under `nice` with one worker and a wall-clock budget (MUTATION_BUDGET_S, default
# 600 s per file), and prints killed/survived/total and the score. mutmut runs, per mutant,
# only the tests (of the file's own selection below) that executed the mutated function.
# Survivor names: `cd .mutation/<stem> && python ../../scripts/mutation_ops.py results`;
# a diff: `... mutation_ops.py show <name>`. Scores and equivalent mutants: docs/testing.md.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUDGET="${MUTATION_BUDGET_S:-600}"
export CODA_HYPOTHESIS_EXAMPLES="${CODA_HYPOTHESIS_EXAMPLES:-10}"  # NOTE: 1/10 of CI's samples
unset PYTHONPATH  # NOTE: mutmut puts its mutated copy first; an outer PYTHONPATH would win

# The fast, targeted core tests for each file (the ones that exercise it directly).
declare -A TESTS=(
  [lifecycle]="tests/test_lifecycle.py tests/test_request_run.py"
  [stops]="tests/test_stops.py tests/test_step_stops.py"
  [detokenizer]="tests/test_detokenizer.py tests/test_detokenizer_eager.py tests/test_detokenizer_cut.py tests/test_logprob_pieces.py tests/test_utf8_tail_auto.py tests/test_step_stops.py"
  [stream]="tests/test_stream.py tests/test_request_run.py tests/test_resources.py tests/test_reader.py"
  [reader]="tests/test_reader.py tests/test_stream.py"
  [output]="tests/test_step_stops.py tests/test_loop.py tests/test_request_run.py tests/test_step_mutants.py tests/test_step_stops_fallback.py tests/test_reasoning_split.py tests/test_utf8_tail_auto.py"
  [request]="tests/test_request_run.py tests/test_loop.py tests/test_lifecycle.py tests/test_request_mutants.py tests/test_step_mutants.py"
  [early_stop]="tests/test_early_stop.py tests/test_early_stop_bounds.py"
  [engine/plan]="tests/test_plan.py tests/test_plan_fields.py tests/test_one_budget_name.py"
  [engine/lookup]="tests/test_speculative_lookup.py"
  [reasoning]="tests/test_reasoning_split.py tests/test_reasoning_splitter.py"
)
STEMS=("$@")
[ ${#STEMS[@]} -eq 0 ] && STEMS=(lifecycle stops detokenizer stream reader output request early_stop)

for stem in "${STEMS[@]}"; do
  work="$ROOT/.mutation/$stem"
  mkdir -p "$work"
  # NOTE: a fresh copy every run: mutmut keeps verdicts of unchanged functions even when the
  # tests changed, so a reused mutants/ would report stale survivors
  rm -rf "$work/coda" "$work/tests" "$work/mutants"
  cp -r "$ROOT/coda" "$ROOT/tests" "$work/"
  find "$work" -name __pycache__ -prune -exec rm -rf {} +
  grep -v '^\[tool.mutmut\]' "$ROOT/pyproject.toml" > "$work/pyproject.toml"
  {
    echo "[mutmut]"
    echo "source_paths=coda"
    echo "only_mutate=coda/$stem.py"
    echo "use_git_change_detection=false"
    echo "timeout_multiplier=4"  # NOTE: a looping mutant is cut at 4x its tests' clean time
    echo 'do_not_mutate_patterns=\blog\.(debug|info|warning|error|exception)\('
    echo "pytest_add_cli_args="
    # NOTE: the import-structure test reads the mutated file, which imports mutmut's trampoline
    printf '    %s\n' -p no:cacheprovider -q -x \
      --deselect tests/test_early_stop.py::test_d6_module_only_decides_it_imports_no_engine_server_or_io
    echo "pytest_add_cli_args_test_selection="
    for t in ${TESTS[$stem]}; do [ -e "$ROOT/$t" ] && printf '    %s\n' "$t"; done
  } > "$work/setup.cfg"
  echo "== coda/$stem.py (budget ${BUDGET}s): ${TESTS[$stem]}"
  ( cd "$work" && timeout "$BUDGET" nice -n 15 python "$ROOT/scripts/mutation_ops.py" run \
      --max-children 1 > run.log 2>&1 ) || echo "   (stopped: budget or error, see $work/run.log)"
  ( cd "$work" && python "$ROOT/scripts/mutation_ops.py" export-cicd-stats >/dev/null 2>&1 ) || true
  python - "$work/mutants/mutmut-cicd-stats.json" "$stem" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except OSError:
    print(f"   {sys.argv[2]}: no results"); sys.exit(0)
done = s["killed"] + s["survived"] + s["timeout"] + s["suspicious"] + s["segfault"]
killed = s["killed"] + s["timeout"] + s["segfault"]  # NOTE: a hang or crash is a detection
score = 100.0 * killed / done if done else 0.0
print(f"   {sys.argv[2]}: killed {killed} / {done} run ({s['total']} generated, "
      f"{s['no_tests']} without tests, {s['survived']} survived) -> {score:.1f}%")
PY
done
