"""Helpers the test modules share (a test module never imports another `test_*.py`): what a refusal
looks like, the tiny trees of the batch tests, the LoRA and merge comparisons against diffusers and PEFT, the
keep-format references, the layout round trips run on each family table. The older shared makers live
beside them as tests/families_util.py, tests/gguf_helpers.py and tests/lora_helpers.py."""
