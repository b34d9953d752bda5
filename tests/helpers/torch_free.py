"""A ckpt command in a fresh interpreter whose prefetch thread imports nothing (`ckpt.lazy.prefetch`): whether the run
itself imported torch. Used by the planning checks (tests/test_merge_lora_torch_free_planning.py) and the writes
without torch (tests/test_convert_without_torch.py)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import ckpt.lazy as lazy

lazy._import_quietly = lambda name: None  # nothing imported beside the run: any use of torch imports it here
from ckpt.cli import main
try:
    main(sys.argv[1:])
    code = 0
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def run_fresh(*argv) -> tuple[dict, str]:
    """({"code": exit code, "torch": whether torch was imported}, stderr) of `ckpt ARGV`."""
    p = subprocess.run([sys.executable, "-c", PROBE, *map(str, argv)], capture_output=True, text=True, timeout=300)
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr
