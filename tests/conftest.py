"""Shared test helpers: run the real CLI in-process and get (exit code, stdout, stderr)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _unpadded_headers():
    """Outputs are compared byte for byte with other writers' (and subprocesses') everywhere: on a filesystem
    that shares extents (a developer's btrfs /tmp), ckpt would pad safetensors headers to keep copied blocks
    shareable (`ckpt.io.byte_copy.block_padding`). Off for the whole run, children included; the tests of the
    padding turn it back on."""
    import os

    from ckpt.io.output import NO_PADDING

    os.environ[NO_PADDING] = "1"
    yield


@pytest.fixture
def run_ckpt(capsys):
    from ckpt.cli import main

    def run(*args):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="session")
def ggml_lib():
    """llama.cpp's own quantizers (tests/helpers/ggml_ref.py); the test skips, saying why, where they cannot be built."""
    from helpers import ggml_ref

    try:
        return ggml_ref.library()
    except ggml_ref.Unavailable as e:
        pytest.skip(str(e))


# Modules whose tests start subprocesses, Ray, benches or whole-README walks (seconds each): `slow`, so
# `pytest -m "not slow"` is a developer's inner loop of well under two minutes; CI (`make test`) runs all.
SLOW_MODULES = {"test_scripts", "test_scripts_examples", "test_batch_ray", "test_convert_ray", "test_io_publish", "test_merge_bench",
                "test_bench_gguf", "test_lora_bench", "test_batch_joblist", "test_batch_hardening",
                "test_readme_quickstart", "test_startup", "test_lora_convert_families", "test_batch",
                "test_merge_unet", "test_interrupts", "test_merge_models_bench", "test_gguf_llm_export",
                "test_gguf_llm_mix", "test_gguf_llm_export_fuzz", "test_lora_gguf", "test_gguf_llm_gpt_oss",
                "test_gguf_llm_qwen3next", "test_gguf_llm_readback",
                "test_gguf_llm_glm_minimax", "test_gguf_llm_vlm_text", "test_gguf_llm_deepseek",
                "test_gguf_llm_llama4", "test_gguf_mmproj", "test_gguf_mix_imatrix"}
# Single tests of a few seconds in otherwise quick modules (a 100 MB header, a fresh interpreter, a signal).
SLOW_TESTS = {"test_output_header_over_100mb_is_refused_before_writing",
              "test_mutants_are_refused_in_one_line_or_read_as_gguf_reads_them", "test_a_new_target_is_a_new_module",
              "test_a_new_format_is_a_new_module",
              # tests/test_gguf_dequant_types.py: ggml's IQ1_S/IQ2_S grid set-up on first use (~30 s)
              "test_ckpt_reads_every_block_type_as_llama_cpp_does",
              # tests/test_kquants_cpu_iq3_small.py: builds and initialises ggml's release library (~20 s)
              "test_extreme_rows_byte_identical_to_a_release_build",
              # tests/test_kquants_cpu_iq2_iq1.py: children running ggml's IQ2/IQ1 grid inits (5-10 s each)
              "test_huge_values_byte_identical_or_refused_where_ggml_aborts", "test_iq2_grid_tables_are_the_c_inits",
              "test_every_module_imports_in_a_fresh_interpreter_without_torch", "test_sigterm_to_a_running_convert_leaves_nothing",
              "test_a_set_a_sigkilled_run_published_in_part_is_recognised_cleaned_and_replaced",
              "test_an_llm_tensor_without_values_is_refused_for_block_types",
              "test_llm_rows_too_large_for_a_block_scale_are_counted",
              # tests/test_docs.py: every example of the README and docs/ run on tiny inputs built once (~20 s)
              "test_example_runs_as_written", "test_targets_table_says_which_command_takes_which_target",
              # tests/test_convrot.py: a W4A8 weight of more than 2**22 values, quantized twice (~5 s)
              "test_w4a8_encode_in_comfy_kitchens_row_chunks",
              # tests/serve/test_mlx_lora.py: each runs `mlx_lm fuse` in a subprocess (~10 s)
              "test_keep_format_is_mlx_lm_fuse", "test_to_bf16_is_mlx_lm_fuse_dequantize",
              "test_plain_base_is_mlx_lm_fuse_of_it",
              # tests/test_merge_lora_torch_free_planning.py: two fresh interpreters per case (~3 s)
              "test_copies_start_before_torch_for_folders_devices_and_merge"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if ((item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES)
                or item.originalname in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
