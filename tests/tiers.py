"""Which tests the PR tier (`bash scripts/test.sh`, CI) leaves to the full tier (`bash scripts/test.sh --full`), and
why that is safe: each entry says what in the PR tier still proves what the test proves, or what the test alone
covers and so waits for the full run (run before resolving an issue that touches recovery).

The PR tier keeps every fast test and, of the multi-process ones, those that prove the guarantees: an external
SIGKILL at a random moment compared bitwise with a fault-free run on each engine (the built-in Lightning job:
test_recovery_e2e.py::test_a_rank_killed_from_outside_at_a_random_moment_ends_equal; a user's Lightning script:
test_user_script.py::test_killed_at_start_up_at_a_boundary_and_mid_step_ends_equal; the NeMo engine:
test_nemo_user_script.py::test_killed_at_a_random_moment_ends_equal_and_survivors_keep_their_pids), the checkpoint
fallback, a hang found by the watchdog, an integrity repair, a whole node lost, and the bad-input messages.

conftest.py marks each test named here `full`; a name that matches no test of a collected module is an error, so an
entry cannot outlive the test it names. Keys: "file.py" (every test of the module) or "file.py::test_name" (with
or without a parametrization).
"""

from __future__ import annotations

FULL_ONLY: dict[str, str] = {
    # ------------------------------------------------------------------------------- the built-in Lightning job
    "test_recovery_e2e.py::test_kill_every_rank_in_turn_recovers_p2p_from_a_replica":
        "p2p from a replica after a kill: the random external kill of the same module (any rank, step and "
        "moment); every rank killed in turn with the spare refilled each time: test_long_run (full)",
    "test_recovery_e2e.py::test_a_rank_lost_in_its_instances_all_gather_rolls_its_partner_forward":
        "the roll-forward path alone (target gather)",
    "test_recovery_e2e.py::test_a_transfer_that_fails_its_checksum_falls_back_to_checkpoint":
        "the fallback itself: test_both_replicas_lost...; the checksum's detection: test_recovery_units",
    "test_recovery_e2e.py::test_a_hung_rank_is_found_by_the_watchdog_and_replaced":
        "the collective timeout as the backstop of the watchdog, which the PR tier runs on four hangs",
    "test_recovery_e2e.py::test_single_instance_falls_back_to_checkpoint_with_a_cold_replacement":
        "the fallback: test_both_replicas_lost...; a cold replacement: test_multi_node's node loss",
    "test_recovery_e2e.py::test_a_spare_that_cannot_start_in_time_is_replaced_by_a_fresh_process":
        "a spare that hangs before it is ready (a 20 s wait); that every process gets launcher.start_timeout_s and "
        "a rank's session waits that long: test_settings",
    "test_recovery_e2e.py::test_the_restart_budget_counts_failures_in_a_row_not_the_runs_recoveries":
        "the budget's arithmetic over five kills",
    "test_integrity_engines.py::test_two_copies_that_differ_roll_back_to_the_last_verified_checkpoint_or_the_start":
        "the rollback on both engines (three launches each); on the Lightning engine the PR tier rolls back in "
        "test_integrity; on the NeMo engine the repair's re-entry (test_three_copies_outvote...[nemo]) is the same "
        "path with the boundary's own state",
    "test_integrity_engines.py::test_three_copies_outvote_a_flipped_bit_with_the_default_settings[lightning]":
        "the same repair on a user's Lightning script: test_integrity (PR tier)",
    "test_integrity_engines.py::test_a_nan_is_attributed_and_trained_again_and_one_that_comes_back_is_skipped_or_stops_the_job":
        "the NaN guard on both engines (three launches each); on the Lightning engine the PR tier runs it in "
        "test_integrity; on the NeMo engine its step is trained again the way the PR tier's repair is",
    "test_integrity_engines.py::test_a_restore_damaged_after_its_checksum_is_caught_and_rolled_back_twice_stops":
        "the restore verification on both engines (three launches each); on the Lightning engine the PR tier runs "
        "it in test_integrity; on the NeMo engine every re-entered fit verifies its restore in the PR tier's kills",
    "test_store_keys.py::test_a_long_job_ends_with_as_many_store_keys_as_a_short_one[nemo-2000]":
        "2,000 NeMo steps (~4 min); the Lightning engine's 300 steps run in the PR tier, and the NeMo engine's data "
        "record, which wrote a key per rank per step, is checked equal in every NeMo test's summary",
    "test_long_run.py": "480 steps and 16 kills: leaks over many recoveries",
    "test_data_e2e.py": "the mmap loader under kills: the built-in job's default loader, killed in the PR tier too",
    "test_getting_started.py": "the docs' snippet run as shown (two launches)",
    "test_fault_kinds.py::test_segfault_abort_sigterm_oom_and_exit0_each_recovered_p2p_and_end_equal":
        "each way to die; a SIGKILL, a SIGSEGV and a SIGTERM in the PR tier's user-script test",
    "test_fault_kinds.py::test_a_slow_rank_is_reported_as_a_straggler_and_not_replaced":
        "stragglers: the watch's unit test in test_watchdog",
    "test_cli.py::test_same_seed_same_state_whatever_the_replication": "N=1, 2, 4 give one state (three launches)",
    "test_integrity.py::test_a_nan_is_attributed_rerun_or_named_by_its_samples":
        "the NaN policies end to end; the guard's decisions: test_the_nan_guard_attributes_and_decides",
    "test_integrity.py::test_a_restore_damaged_after_its_checksum_is_caught_before_the_first_step":
        "a damaged restore; the vote that catches it runs in the PR tier's integrity repair",
    "test_shrink.py::test_shrink_then_grow_trains_the_same_samples_and_grows_back_deterministically":
        "shrink and grow (80 steps); the shrink plan: test_shrink_keeps_whole_instances...",
    "test_shrink.py::test_a_shrunk_world_grows_back_before_it_ends": "shrink's end of training",
    "test_shrink.py::test_a_fault_while_shrunk_grows_back_at_once_and_falls_back_when_no_replica_is_left":
        "a fault while shrunk",
    "test_script_runner.py::test_a_forked_process_runs_a_command_as_python_would":
        "every job of the PR tier runs its ranks forked from the template; this compares each detail with python",
    # ------------------------------------------------------------------------------ a user's own Lightning script
    "test_user_script.py::test_training_collectives_on_a_second_plane_recovered_equal":
        "a second device plane under a kill",
    "test_user_script.py::test_validation_and_bf16_mixed_recovered_equal": "validation and bf16-mixed under a kill",
    "test_user_script.py::test_datamodule_dict_batches_accumulation_recovered_equal":
        "a datamodule, dict batches and accumulation under kills",
    "test_user_script.py::test_bad_input_gets_one_clear_message_and_leaves_nothing_running":
        "twelve launches of bad input; checkpointless-run's and -train's messages: test_cli, test_recipe_script, "
        "test_multi_node",
    "test_user_script.py::test_no_rank_or_spare_outlives_the_launcher": "the launcher SIGKILLed mid-run",
    "test_user_script.py::test_an_unchanged_ddp_script_gets_the_launchers_store_and_a_whole_restart":
        "tier 1 for an unchanged torchrun script (a whole restart)",
    "test_user_script.py::test_a_second_death_during_the_recovery_is_recovered_too": "a death during a recovery",
    "test_user_script.py::test_a_slow_rank_is_reported_as_a_straggler_and_not_replaced":
        "stragglers in a user's script; the watch: test_watchdog",
    "test_user_script.py::test_a_slow_step_within_the_adapted_deadline_is_not_a_hang":
        "the adapted deadline; its arithmetic: test_watchdog's default-deadline test",
    # ---------------------------------------------------------------------------------------------- multi-node
    "test_multi_node.py::test_losing_the_node_that_started_the_job_with_the_store_on_its_own":
        "node 0 lost with the store elsewhere; a node lost: test_a_whole_node_lost...",
    "test_multi_node.py::test_rank_kills_and_a_hang_refill_the_spares_across_nodes": "spares refilled across nodes",
    "test_multi_node.py::test_a_lost_store_stops_every_node_with_the_story": "the store lost",
    # ------------------------------------------------------------------------------------------- the NeMo engine
    "test_nemo_recovery.py": "the built-in NeMo job (kill + hang, roll-forward, both replicas); the engine's kill at "
                             "a random moment: test_nemo_user_script",
    "test_nemo_long_run.py": "95 steps, many recoveries: what each failed fit leaves",
    "test_nemo_user_script.py::test_model_parallel_kill_recovers_p2p_and_ends_equal": "TP=2 and PP=2 under a kill",
    "test_nemo_user_script.py::test_a_strategy_and_callback_that_do_not_pair_stop_before_training[no-callback]":
        "the strategy's own refusal of a trainer without its callback (nemo/strategy.py setup); the PR tier runs "
        "the callback's refusal of a plain strategy, through the same launch and 'failed before training' path",
    "test_nemo_user_script.py::test_one_and_two_optimizer_instances_end_with_the_same_state": "N=1 against N=2",
    "test_recipe_script.py::test_a_recipe_runs_a_users_nemo_script_with_its_layout_and_recovers_a_kill":
        "a recipe's layout given to a NeMo script under a kill; the layout itself: "
        "test_the_nemo_strategy_takes_the_recipes_layout_and_refuses_another",
    "test_export.py::test_export_loads_in_transformers_and_gives_megatrons_logits":
        "a NeMo run with a checkpoint every step, exported and loaded in transformers",
    "test_bench.py::test_quick_bench_runs_every_system_and_writes_every_figure":
        "checkpointless-bench --quick with every peer (7 minutes)",
}
