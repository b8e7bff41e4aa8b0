"""The tests `pytest -m "not slow"` leaves out (tests/conftest.py marks them):
the developer loop of docs/contributing.md. A test is slow when it starts
Prometheus, Alertmanager, VictoriaMetrics, Chromium or a process (a simulator,
a sweep, promtool, kustomize), or took 2 s or more in a --durations run of the
rest on the shared 2-core machine (about 1 s on a quiet one). A test may also
carry @pytest.mark.slow itself. tests/test_markers.py checks every name here
still names a test.
"""

# Every test of these modules: each starts a real store, browser or process.
SLOW_MODULES = (
    "test_central_prometheus.py",
    "test_central_router.py",
    "test_central_shards.py",
    "test_deploy_image.py",
    "test_e2e_alerting.py",
    "test_e2e_one_page.py",
    "test_e2e_central_alerts.py",
    "test_e2e_central_live.py",
    "test_e2e_demo_loop.py",
    "test_e2e_engines.py",
    "test_e2e_kv_events_alerts.py",
    "test_kv_events_sizing_sim.py",
    "test_e2e_offload_tier.py",
    "test_e2e_prometheus.py",
    "test_fuzz_atheris.py",
    "test_history_backfill.py",
    "test_history_prometheus.py",
    "test_poll_garbage.py",
    "test_recorded_twins_agree.py",
    "test_statuspage_browser.py",
    "test_store_victoriametrics.py",
    "test_sweep_interrupt.py",
    "test_shuffle.py",
    "test_wheel.py",
)

# module -> its slow test functions (every parametrization of each).
SLOW_TESTS: dict[str, tuple[str, ...]] = {
    "test_app.py": (
        "test_a_scraped_exposition_has_the_next_one_rendered_ahead_by_the_poll_loop",
    ),
    "test_bench_equivalence.py": (
        "test_the_text_plan_reads_what_the_scanner_reads",
    ),
    "test_capture.py": (
        "test_a_simulator_recording_replays_to_the_live_sidecars_timeline",
    ),
    "test_central.py": (
        "test_a_replica_that_vanished_is_down_then_dropped_after_a_window",
        "test_a_store_that_fails_is_one_sentence_and_the_next_refresh_catches_up",
        "test_at_most_max_replicas_are_kept",
        "test_refreshes_read_only_new_steps_and_give_the_history_diagnosis",
        "test_the_http_surface_serves_every_replica",
    ),
    "test_demo.py": (
        "test_phase_status_names_the_phase_now_the_next_and_when",
        "test_within_the_first_minute_the_page_shows_a_finding_and_the_next_phase",
    ),
    "test_deploy_manifests.py": (
        "test_embedded_rules_pass_promtool",
        "test_every_manifest_validates_offline",
        "test_kustomize_builds_each_overlay_into_valid_wired_objects",
        "test_rules_select_the_job_every_scrape_path_sets",
        "test_sidecar_component_adds_kvwatch_to_a_deployment_named_by_the_user",
    ),
    "test_diagnose_sim.py": (
        "test_eviction_pressure",
        "test_eviction_pressure_without_max_num_seqs_names_no_cause_the_exhaustion_explains",
        "test_exhaustion",
        "test_long_requests_that_grow_are_long_requests",
        "test_queueing_is_compute_bound",
        "test_the_demo_shows_eviction_before_reuse_and_long_requests",
    ),
    "test_exposition_grammar.py": (
        "test_every_line_of_a_wanted_family_is_read_or_counted_with_its_line_number",
    ),
    "test_finding_hold.py": (
        "test_over_the_demo_no_finding_restarts_within_the_hold_and_every_one_clears_within_it",
        "test_the_demo_story_is_held_through_each_blink",
        "test_the_demo_story_lapses_for_one_poll_without_the_hold",
    ),
    "test_fuzz_properties.py": (
        "test_a_malformed_line_costs_only_itself",
        "test_any_label_value_round_trips_through_the_export",
        "test_long_lora_adapter_names_are_remembered_within_a_byte_bound",
        "test_model_names_changing_every_poll_keep_findings_events_and_details_bounded",
        "test_new_80_kb_label_values_every_poll_keep_the_parser_cache_bounded_in_bytes",
        "test_no_page_breaks_a_poll_or_any_view",
        "test_one_model_name_per_request_is_capped_counted_and_memory_stays_flat",
        "test_windowed_increases_follow_the_reset_rule_exactly",
        "test_worst_case_pages_finish_and_hold_memory_in_proportion",
    ),
    "test_helm_chart.py": (
        "test_chart_and_kustomize_render_the_same_sidecar_container",
        "test_each_mode_renders_what_it_is_for",
        "test_every_rendered_object_validates",
        "test_the_notes_command_adds_kvwatch_to_a_deployment_named_by_the_user",
    ),
    "test_history_pages.py": (
        "test_the_families_history_does_not_read_change_no_finding",
    ),
    "test_incremental_diagnosis.py": (
        "test_fast_path_gives_the_full_evaluation_at_every_poll_of_every_recording",
        "test_trend_and_block_sums_give_the_written_out_definition",
    ),
    "test_kv_events.py": (
        "test_kvwatch_capture_records_the_stream_beside_the_pages",
    ),
    "test_kv_events_diagnose.py": (
        "test_a_prefix_change_mid_run_is_a_changed_prefix",
        "test_a_rotation_in_full_report_mode_is_eviction_before_reuse_as_in_incremental_mode",
        "test_a_rotation_over_more_prefixes_than_the_cache_holds_is_eviction_before_reuse",
        "test_distinct_prompts_after_a_pause_are_no_shared_prefix_not_a_changed_prefix",
        "test_an_lmcache_tier_publishing_store_only_events_serves_returns_as_its_hits",
        "test_prompts_that_share_nothing_are_no_shared_prefix",
        "test_sglangs_and_tensorrt_llms_layouts_read_as_vllms",
    ),
    "test_lmcache.py": (
        "test_kvwatch_diagnose_prints_the_tier_from_the_config",
    ),
    "test_mixin_dashboards.py": (
        "test_every_panel_has_unit_description_targets_and_runbook_link",
        "test_legends_follow_a_customised_instance_label",
    ),
    "test_mixin_generate.py": (
        "test_check_flag_catches_a_stale_and_a_leftover_file",
        "test_cli_dispatches_to_generate",
        "test_committed_generated_files_are_current",
        "test_config_changes_thresholds_windows_and_for",
        "test_exhaustion_soon_reads_the_eta_signal_and_its_threshold_in_minutes",
        "test_generate_writes_into_the_current_directory_and_says_where",
        "test_generate_writes_the_expected_files",
        "test_output_is_deterministic",
    ),
    "test_mixin_grafana_alerts.py": (
        "test_panel_references_point_at_existing_panels",
        "test_runbook_links_resolve_to_sections",
    ),
    "test_mixin_promql.py": (
        "test_expressions_of_a_customised_config_parse",
    ),
    "test_network_guard.py": (
        "test_a_swallowed_refusal_still_fails_the_test",
    ),
    "test_objectives_promtool.py": (
        "test_a_page_holds_for_its_short_window",
        "test_burn_rate_alerts_fire_when_both_windows_burn_and_not_on_a_spike",
        "test_the_cases_catch_a_pair_that_ignores_its_short_window",
        "test_thresholds_are_factor_times_budget_and_windows_are_configurable",
    ),
    "test_one_story.py": (
        "test_every_real_recording_tells_one_story_per_engine_and_symptom",
        "test_two_loops_of_the_demo_tell_one_story_per_engine_and_symptom",
    ),
    "test_promtool_metrics.py": (
        "test_central_modes_metrics_pass_promtool",
    ),
    "test_reliability_faults.py": (
        "test_background_loop_outlives_a_run_of_faults_and_recovers",
    ),
    "test_reliability_load.py": (
        "test_many_concurrent_scrapers_each_see_one_whole_poll_while_polling",
        "test_slow_scrapers_delay_neither_the_poll_loop_nor_other_scrapers",
    ),
    "test_rules_promtool.py": (
        "test_every_alert_reads_in_twelve_lines_and_links_its_runbook",
        "test_every_recorded_series_an_alert_reads_is_recorded_before_it",
        "test_promtool_unit_tests_of_the_committed_rules",
        "test_promtool_unit_tests_of_the_fleet_alert",
        "test_promtool_unit_tests_of_the_kv_event_stream_alert",
        "test_promtool_unit_tests_with_an_upstream_histogram",
        "test_promtool_unit_tests_with_the_no_reuse_alert_on",
        "test_the_unit_tests_catch_a_threshold_that_never_fires",
        "test_the_unit_tests_catch_swapped_causes",
        "test_upstream_config_rules_pass_promtool_check",
    ),
    "test_security.py": (
        "test_an_empty_auth_token_file_refuses_to_start",
        "test_bad_config_names_every_problem_at_once_and_exits_non_zero",
        "test_every_configuration_error_of_round_two_is_reported_at_once",
        "test_kvwatch_serve_over_tls_with_auth_on_loopback_keeps_secrets_out_of_its_log",
        "test_secrets_never_appear_on_any_poll_outcome",
    ),
    "test_sim_lmcache.py": (
        "test_kvwatch_reads_the_simulated_tier_page",
    ),
    "test_sim_scenarios.py": (
        "test_demo_visits_every_phase_and_loops",
        "test_eviction_pressure_high_usage_low_hits_although_prefixes_repeat",
        "test_exhaustion_preempts_with_usage_near_one_and_waiting_for_capacity",
        "test_healthy_high_hit_ratio_and_no_preemptions",
        "test_prefix_change_drops_hits_per_query_while_usage_stays_moderate",
        "test_queueing_time_to_first_token_is_spent_in_the_queue",
        "test_upstream_delay_app_retrieval_grows_and_dominates",
    ),
    "test_store_hostile.py": (
        "test_an_answer_over_the_byte_cap_is_refused_while_it_is_read",
        "test_central_mode_recovers_when_a_trickling_store_does",
        "test_terminal_escapes_in_the_stores_labels_never_reach_the_terminal",
    ),
    "test_stuck_busy.py": (
        "test_a_stricter_stuck_time_is_read_from_the_thresholds",
    ),
    "test_sweep.py": (
        "test_a_server_with_other_traffic_is_measured_after_a_bounded_wait_with_a_note",
        "test_sweep_against_the_simulator_peak_kv_rises_with_concurrency",
    ),
    "test_sweep_compare.py": (
        "test_compare_command_writes_files_and_exits_1_on_refused_cells",
    ),
    "test_tenant_evictions.py": (
        "test_the_churning_tenant_is_named_the_evictor_with_its_share_from_the_live_stream",
    ),
    "test_vllm_page_plan.py": (
        "test_page_plan_reads_as_the_adapter_reads",
    ),
    "test_window_bound.py": (
        "test_rotating_model_names_keep_the_window_within_its_byte_bound",
    ),
    "test_window_signals.py": (
        "test_lazy_values_are_the_evaluated_ones_read_in_any_order",
    ),
    "test_window_sums.py": (
        "test_running_sums_answer_what_step_by_step_sums_answer",
    ),
}
