"""Can the tests fail? Each entry breaks one behaviour on purpose (a one-line edit of the product), runs the tests
that claim to check it, and restores the file: every entry must make its tests fail. A mutation that the tests
do not notice is a test that cannot fail.

    python benchmarks/mutation_check.py            # all
    python benchmarks/mutation_check.py --only lock,resize
"""

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MUTATIONS = [
    ("replicas", "the replica check finds no difference", "compress/training/distributed.py",
     "    mismatched = replica_mismatches(env, module, buffers)\n", "    mismatched = []\n",
     ["tests/training/test_distributed.py::test_a_replica_that_drifts_fails_the_stage"]),
    ("ctrl-c", "a stop request is never seen by the training loop", "compress/training/interrupt.py",
     "(not yet agreed with the other ranks).\"\"\"\n    return _requested",
     "(not yet agreed with the other ranks).\"\"\"\n    return False",
     ["tests/training/test_loop.py::test_ctrl_c_writes_a_checkpoint_exits_130_and_resumes_identically"]),
    ("lock", "the run-directory lock takes no flock", "compress/run/rundir.py",
     "                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n", "                pass\n",
     ["tests/run/test_rundir.py::test_a_run_directory_held_by_another_run_is_refused_and_left_alone",
      "tests/run/test_rundir.py::test_two_runs_at_once_one_waits_out"]),
    ("resize", "the centre crop is one pixel off", "compress/deploy/imageio.py",
     "    left, top = (w - rule[\"width\"]) // 2, (h - rule[\"height\"]) // 2",
     "    left, top = (w - rule[\"width\"]) // 2 + 1, (h - rule[\"height\"]) // 2",
     ["tests/deploy/test_imageio.py::test_validation_images_are_resized_by_the_shorter_side_and_centre_cropped"]),
    ("schedule", "the cosine schedule ends one epoch late", "compress/training/schedule.py",
     "            total = max(self.total_steps - warmup, 1)",
     "            total = max(self.total_steps + self.steps_per_epoch - warmup, 1)",
     ["tests/training/test_schedule.py::test_schedule_warms_up_linearly_then_follows_cosine_to_zero"]),
    ("unknown-schedule", "an unknown schedule kind acts constant", "compress/training/schedule.py",
     "        if self.kind not in SCHEDULES:\n", "        if False:\n",
     ["tests/training/test_schedule.py::test_an_unknown_schedule_kind_is_refused_not_treated_as_constant"]),
    ("decide", "a changed config does not rerun a finished stage", "compress/run/state.py",
     "    return recorded.get(\"config_hash\") == base[\"config_hash\"] or bool(",
     "    return True or bool(",
     ["tests/run/test_state.py::test_a_changed_key_the_stage_depends_on_reruns_it_and_names_the_key"]),
    ("resume-world", "a mid-epoch checkpoint of another world size is resumed at its step", "compress/run/state.py",
     "    if point.step and point.world_size not in (None, world):", "    if False:",
     ["tests/run/test_state.py::test_a_mid_epoch_checkpoint_of_another_world_size_redoes_that_epoch"]),
    ("float-layers", "a layer kept float however little it saves", "compress/quant/mixed_precision.py",
     "        kept = trial_ms < current_ms * (1 - margin)\n        figures[\"tried\"].append({\"float\": label,",
     "        kept = trial_ms < current_ms\n        figures[\"tried\"].append({\"float\": label,",
     ["tests/quant/test_mixed_precision.py::test_a_group_must_save_more_than_the_margin_to_stay_float"]),
    ("kd-weight", "the logit loss's weight is dropped from the total", "compress/distill/objective.py",
     "            terms[\"kd\"] = (weights[\"kd\"] * ramp,", "            terms[\"kd\"] = (ramp,",
     ["tests/distill/test_objective.py::test_the_distill_loss_is_the_weighted_sum_of_its_terms"]),
    ("label-smoothing", "label smoothing is ignored", "compress/training/losses.py",
     "batch.y.clamp_min(0), reduction=\"none\", label_smoothing=label_smoothing)",
     "batch.y.clamp_min(0), reduction=\"none\")",
     ["tests/distill/test_objective.py::test_the_distill_loss_is_the_weighted_sum_of_its_terms"]),
    ("one-image-batch", "a last batch of one image is kept", "compress/data/sampling.py",
     "        return batches - 1 if batches > 1 and self.per_rank % self.batch_size == 1 else batches",
     "        return batches",
     ["tests/data/test_sampling.py::test_a_last_batch_of_one_image_is_merged_into_the_one_before"]),
    ("duplicate-keys", "a YAML key given twice is accepted", "compress/run/config.py",
     "    _refuse_duplicate_keys(root, source)\n", "",
     ["tests/run/test_config.py::test_a_config_with_a_key_twice_is_refused_with_both_lines"]),
    ("store-check", "a damaged store chunk is trusted", "compress/distill/store.py",
     "    def _chunk_ok(self, c, digest):\n", "    def _chunk_ok(self, c, digest):\n        return True\n",
     ["tests/distill/test_store.py::test_a_built_store_is_reused_and_a_damaged_chunk_is_found_and_rebuilt"]),
    ("config-view", "a stage may read any config key", "compress/run/config.py",
     "        if any(full == k or full.startswith(k + \".\") for k in excluded) or not (",
     "        if False and (",
     ["tests/run/test_config.py::test_a_stage_sees_only_its_config_keys_and_train",
      "tests/run/test_config.py::test_the_pipeline_hands_each_stage_the_view_so_an_undeclared_read_fails"]),
    ("stop-between-candidates", "a stop request between float-layer candidates is swallowed",
     "compress/quant/mixed_precision.py", "        if stop:\n            stop()\n",
     "        if stop:\n            try:\n                stop()\n            except KeyboardInterrupt:\n"
     "                pass\n",
     ["tests/quant/test_mixed_precision.py::test_a_stop_request_is_honoured_between_candidates"]),
    ("onnxruntime-only", "export times onnxruntime only, though OpenVINO is installed", "compress/deploy/runtimes.py",
     "    return [FIRST] + [name for name, r in RUNTIMES.items() if name != FIRST and r.default and r.available()]",
     "    return [FIRST]",
     ["tests/test_cpus.py::test_export_says_its_timings_are_noisy_beside_a_busy_neighbour_and_shows_every_runtime"]),
    ("resume-optimizer", "a resumed stage drops the optimizer's state", "compress/training/checkpoint.py",
     'optimizer.load_state_dict({"state": state, "param_groups"',
     'optimizer.load_state_dict({"state": {}, "param_groups"',
     ["tests/training/test_loop.py::test_kill_9_in_each_training_stage_then_resume_is_bit_identical"]),
    ("predict-tie", "predict breaks a top-1 tie by numpy's default sort", "compress/deploy/evaluate.py",
     'order = np.argsort(-p, kind="stable")[:top_k]', "order = np.argsort(-p)[:top_k]",
     ["tests/deploy/test_hostile_onnx.py::test_predict_and_eval_break_a_tie_for_top_1_alike"]),
    ("world-sizes", "a stage resumed on another process count records only the last", "compress/run/pipeline.py",
     '        metrics = {**result.metrics, "world_sizes": worlds} if len(worlds) > 1 else result.metrics',
     "        metrics = result.metrics",
     ["tests/training/test_distributed.py::test_a_stage_resumed_on_another_number_of_processes_records_both_counts"]),
]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help="comma-separated mutation names")
    args = p.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m[0] in args.only.split(",")]
    rows = []
    for name, what, rel, old, new, tests in chosen:
        path = os.path.join(ROOT, rel)
        original = open(path, encoding="utf-8").read()
        if original.count(old) != 1:
            raise SystemExit(f"{name}: the text to mutate is not in {rel} exactly once; update this script")
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(original.replace(old, new))
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                                  cwd=ROOT, capture_output=True, text=True)
            seconds = time.perf_counter() - start
        finally:
            with open(path, "w", encoding="utf-8") as f:
                f.write(original)
        failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        caught = proc.returncode != 0
        rows.append((name, what, caught, failed[0] if failed else proc.stdout.strip().splitlines()[-1]))
        print(f"{'caught' if caught else 'MISSED'}  {name}: {what} ({seconds:.0f} s) -> {rows[-1][3][:150]}",
              flush=True)
    missed = [r for r in rows if not r[2]]
    print(f"\n{len(rows) - len(missed)} of {len(rows)} mutations made their tests fail")
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
