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
# NOTE: mutmut forks a child per mutant; a child that runs a parallel torch op after the parent
# started torch's OpenMP pool deadlocks (futex wait, no CPU) and is cut at the timeout, which
# counts as detected: one intra-op thread has no pool to inherit (the sampler's report)
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

# The fast, targeted core tests for each file (the ones that exercise it directly).
declare -A TESTS=(
  [lifecycle]="tests/test_lifecycle.py tests/test_request_run.py"
  [stops]="tests/test_stops.py tests/test_step_stops.py"
  [detokenizer]="tests/test_detokenizer.py tests/test_detokenizer_held.py tests/test_detokenizer_eager.py tests/test_detokenizer_cut.py tests/test_logprob_pieces.py tests/test_utf8_tail_auto.py tests/test_step_stops.py"
  [stream]="tests/test_stream.py tests/test_request_run.py tests/test_resources.py tests/test_reader.py tests/test_stop_cut_tokens.py"
  [reader]="tests/test_reader.py tests/test_stream.py"
  [output]="tests/test_step_stops.py tests/test_loop.py tests/test_request_run.py tests/test_step_mutants.py tests/test_step_stops_fallback.py tests/test_reasoning_split.py tests/test_utf8_tail_auto.py tests/test_stop_cut_tokens.py tests/test_output_mutants.py tests/test_k2_entry_timing.py tests/test_output_detok_end.py tests/test_k2_last_byte_oracle.py tests/test_reasoning_grammar.py tests/test_budget_cut_tokens.py
    tests/test_usage_returned_tokens.py::test_l6_returned_tokens_are_those_with_a_byte_in_the_returned_text
    tests/test_usage_returned_tokens.py::test_l6_every_token_of_a_split_character_is_returned
    tests/test_usage_returned_tokens.py::test_l6_s3_held_bytes_count_when_released_not_when_a_stop_drops_them
    tests/test_usage_returned_tokens.py::test_l6_k3_a_character_the_budget_cuts_is_not_returned
    tests/test_usage_returned_tokens.py::test_l6_g2_a_byte_run_the_drain_releases_counts_all_its_tokens"
  [token_ends]="tests/test_token_ends.py tests/test_k2_last_byte_oracle.py tests/test_output_detok_end.py tests/test_k2_entry_timing.py tests/test_stop_cut_tokens.py tests/test_output_mutants.py"
  [request]="tests/test_request_run.py tests/test_loop.py tests/test_lifecycle.py tests/test_request_mutants.py tests/test_step_mutants.py"
  [early_stop]="tests/test_early_stop.py tests/test_early_stop_bounds.py"
  [engine/plan]="tests/test_plan.py tests/test_plan_fields.py tests/test_plan_types.py tests/test_one_budget_name.py"
  [trace]="tests/test_trace_read_line.py tests/test_trace_check.py"
  [engine/lookup]="tests/test_speculative_lookup.py"
  [engine/prediction]="tests/test_prediction_align.py"
  [reasoning]="tests/test_reasoning_split.py tests/test_reasoning_splitter.py tests/test_reasoning_markers.py"
  [engine/sampler]="tests/test_sampler.py tests/test_sampler_edges.py tests/test_sampler_oracle.py
    tests/test_prompt_logprobs.py::test_score_is_the_decode_record_of_the_token_o1"
  # NOTE: the unit tests only: the engine tests (plain decoding as the oracle) run every
  # function of speculative.py and take seconds each, per mutant
  [engine/speculative]="tests/test_speculative_lookup.py tests/test_speculative_units.py
    tests/test_speculative.py::test_prompt_lookup_drafts_what_followed_the_latest_match
    tests/test_speculative.py::test_k_is_the_drafts_worth_their_rows_and_low_acceptance_stops_drafting
    tests/test_speculative.py::test_verify_rows_sample_each_position_after_the_accepted_prefix
    tests/test_speculative.py::test_t3_l7_scheduler_drafts_fit_without_preempting_and_roll_back
    tests/test_speculative_forced.py::test_forced_only_configuration_guesses_nothing
    tests/test_speculative_forced.py::test_o1_acceptance_counts_only_the_guesses_before_forced_rows
    tests/test_speculative_verify_costs.py::test_t4_batch_1_k_is_the_best_measured_tokens_per_second
    tests/test_speculative_verify_costs.py::test_the_smollm2_avx512_staircase_picks_3_where_a_line_overdrafts
    tests/test_speculative_verify_costs.py::test_row_counts_not_measured_are_priced_by_the_fitted_line
    tests/test_speculative_verify_costs.py::test_only_one_sequences_decode_or_verify_forward_is_observed
    tests/test_speculative_verify_costs.py::test_spec_state_uses_the_measured_costs_at_batch_1_only
    tests/test_speculative_cost.py::test_draft_costing_more_than_it_saves_gets_k_0_and_a_cheap_one_drafts
    tests/test_speculative_cost.py::test_property_step_fit_recovers_exact_costs
    tests/test_speculative_cost.py::test_property_choice_is_the_fastest_k
    tests/test_speculative_cost.py::test_a_request_whose_drafts_stop_paying_probes_with_back_off_and_gets_them_back"
  # NOTE: the verify rows' measured costs (which k a batch-1 request drafts): their own tests
  [engine/verify_costs]="tests/test_speculative_verify_costs.py"
  # NOTE: which schemas admit no value (the pure checks; the HTTP ones need SmolLM2 per mutant)
  [engine/grammar_schema]="tests/test_grammar_schema.py
    tests/test_schema_no_value.py::test_p1_a_ref_with_no_finite_value_is_named
    tests/test_schema_no_value.py::test_p1_a_recursive_schema_with_a_way_out_is_served
    tests/test_grammar.py tests/test_tool_schema_errors.py"
  # NOTE: the stored request an adopter runs (P4): its own round-trip and refusal tests
  [durable/request_codec]="tests/test_request_codec.py tests/test_adopt_untrusted.py"
  # NOTE: the KV budget's arithmetic (T3), a draft's share included: the unit tests only
  [engine/kv_budget]="tests/test_draft_memory.py::test_t3_a_draft_is_inside_the_budget_split
    tests/test_draft_memory.py::test_t3_exact_size_and_fraction_with_a_draft
    tests/test_kv_budget.py::test_t3_kv_reserve_is_full_contexts_capped_by_the_budget_less_the_weights
    tests/test_kv_budget.py::test_memory_budget_parses_sizes_and_percentages
    tests/test_kv_budget.py::test_memory_budget_refuses_what_is_not_a_size"
)
# Files a stem mutates (glob patterns, space-separated), where not coda/<stem>.py: the output
# processor is one concept split by size (coda/output.py and its output_* modules: the rules,
# the delta assembly, id stops, the reasoning split, the tool-call tag window), measured under
# one test selection
declare -A MUTATE=(
  [output]="coda/output*.py"
  # NOTE: the stops split by concept the same way (stops.py: the string matcher, the hit and
  # the tie rule; _ids: the token-id sequences; _automaton: the compiled Aho–Corasick sets)
  [stops]="coda/stops*.py"
  # NOTE: and the detokenizer (detokenizer.py: the incremental state; _profile: a tokenizer's
  # byte mode and byte views; _held: the held tail read from them, and what a cut leaves)
  [detokenizer]="coda/detokenizer*.py"
  # NOTE: and the stream (stream.py: the log and its events; _backpressure: the P6 declaration;
  # the terminal record its last event carries is coda/finish.py's Terminal, with the reasons
  # and usage it holds)
  [stream]="coda/stream*.py coda/finish.py"
  # NOTE: and the early-stop policy (early_stop.py: the policy, the controller, the economics,
  # D1-D4; _checks: the D1 validation; _failure: the D5 stream-failure decision)
  [early_stop]="coda/early_stop*.py"
  # NOTE: speculation split by size the same way (speculative.py: the config; _state: a
  # request's drafting; _verify: the rows and acceptance; _costs: the draft model's costs)
  [engine/speculative]="coda/engine/speculative*.py"
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
    # NOTE: one pattern a line (a stem whose code lives in more than one place); read, not
    # expanded, so a glob reaches mutmut as written
    echo "only_mutate="
    read -r -a patterns <<< "${MUTATE[$stem]:-coda/$stem.py}"
    printf '    %s\n' "${patterns[@]}"
    echo "use_git_change_detection=false"
    echo "timeout_multiplier=4"  # NOTE: a looping mutant is cut at 4x its tests' clean time
    echo 'do_not_mutate_patterns=\blog\.(debug|info|warning|error|exception)\('
    echo "pytest_add_cli_args="
    # NOTE: the import-structure test reads the mutated file, which imports mutmut's trampoline
    printf '    %s\n' -p no:cacheprovider -q -x \
      --deselect tests/test_early_stop.py::test_d6_module_only_decides_it_imports_no_engine_server_or_io
    echo "pytest_add_cli_args_test_selection="
    for t in ${TESTS[$stem]}; do [ -e "$ROOT/${t%%::*}" ] && printf '    %s\n' "$t"; done
  } > "$work/setup.cfg"
  echo "== ${MUTATE[$stem]:-coda/$stem.py} (budget ${BUDGET}s):" ${TESTS[$stem]}
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
