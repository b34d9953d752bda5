"""Every output `ckpt batch ... -o OUT` plans and writes lies inside OUT, whatever the input tree's names:
Hugging Face cache folders whose repository part is no name of its own (`models--..`, `models--.`,
`models--`), names with separator-like characters, symbolic links leading out of the input tree or out of
OUT's tree, names too long to write. An entry that cannot be placed inside OUT is refused alone, in one line;
the others are converted and compared with torch's own cast."""

from __future__ import annotations

import os
from pathlib import Path

from helpers.batch import assert_fp16_of, no_temp_files, st

from ckpt.batch.operations import make_operation
from ckpt.batch.runner import plan_jobs

HF_NAMES = ["models--..", "models--.", "models--", "models--a\u2215..", "models--..\\..", "models--org--ok"]


def _hf_repo(root: Path, name: str, seed: int, folder: bool) -> dict:
    """A cache repo with one snapshot: a model folder (config.json beside the weights) or a loose file."""
    snap = root / name / "snapshots" / "abc123"
    made = st(snap / "model.safetensors", seed)
    if folder:
        (snap / "config.json").write_text("{}")
    (root / name / "refs").mkdir(parents=True)
    (root / name / "refs" / "main").write_text("abc123")
    return made


def _tree(tmp_path: Path) -> tuple[Path, Path, dict[str, dict]]:
    """The adversarial input tree, OUT inside a parent `q` (so an escape up one level is seen), and what each
    convertible input holds."""
    root, q = tmp_path / "in" / "models", tmp_path / "q"
    made = {}
    for i, name in enumerate(HF_NAMES):
        made[name] = _hf_repo(root, name, i, folder=i % 2 == 0)
    made["dots../x.safetensors"] = st(root / "dots.." / "x.safetensors", 10)
    made["-..-/y.safetensors"] = st(root / "-..-" / "y.safetensors", 11)
    # symbolic links out of the input tree: followed, mirrored under their own names
    elsewhere = tmp_path / "elsewhere"
    made["linked-file.safetensors"] = st(elsewhere / "f.safetensors", 12)
    os.symlink(elsewhere / "f.safetensors", root / "linked-file.safetensors")
    made["linked-dir/z.safetensors"] = st(elsewhere / "d" / "z.safetensors", 13)
    os.symlink(elsewhere / "d", root / "linked-dir")
    # a folder of OUT's tree that is a link leading out of it: what would be mirrored there is refused
    st(root / "sub" / "w.safetensors", 14)
    escape = q / "escape"
    escape.mkdir(parents=True)
    (q / "out").mkdir()
    os.symlink(escape, q / "out" / "sub")
    # names too long once converted (.pt -> .safetensors) or once written under a temp name
    import torch

    torch.save({"w": torch.ones(2, 2)}, root / ("p" * 250 + ".pt"))
    st(root / ("s" * 240 + ".safetensors"), 15)
    return root, q, made


def _inside(p: Path, out: Path) -> bool:
    return out.resolve() in Path(os.path.abspath(p)).resolve().parents


def test_every_planned_and_written_batch_output_is_inside_o(tmp_path, run_ckpt):
    root, q, made = _tree(tmp_path)
    out = q / "out"

    # planned: every job's output, resolved, lies strictly inside OUT; refused entries name why
    op = make_operation("convert", {"to": "fp16"})
    jobs, done, _ = plan_jobs(op, root, out, None, False, None)
    assert all(_inside(j.output, out) for j in jobs), [str(j.output) for j in jobs if not _inside(j.output, out)]
    refused = {o.job.item.rel: o.error for o in done}
    assert set(refused) == {"sub/w.safetensors", "p" * 250 + ".pt", "s" * 240 + ".safetensors"}, refused
    assert "a symbolic link leads out of it" in refused["sub/w.safetensors"]
    assert all("name too long" in e for r, e in refused.items() if r != "sub/w.safetensors")

    # what a dry run says it would write
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "--dry-run")
    assert code == 1 and "3 refused" in stdout, err
    planned = [Path(line.split(" -> ", 1)[1].rsplit(" (", 1)[0]) for line in stdout.splitlines() if " -> " in line]
    assert len(planned) == len(jobs) and all(_inside(p, out) for p in planned), stdout
    assert "models--.." in stdout and "-> " + str(out / "..") not in stdout

    # what a run writes: only inside OUT (q holds OUT and the untouched escape folder, nothing else)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out)
    assert code == 1, err  # the refused entries failed, alone
    failed = [line for line in stdout.splitlines() if line.startswith("  failed")]
    assert len(failed) == 3 and all("Traceback" not in line and "internal error" not in line for line in failed)
    assert sorted(p.name for p in q.iterdir()) == ["escape", "out"] and not any((q / "escape").iterdir())
    written = [p for p in out.rglob("*") if not p.is_symlink()]
    assert all(_inside(p, out) for p in written)
    assert no_temp_files(out, q)
    # `..`, `.`, `` (and a backslash, a separator elsewhere) are no names of their own: the cache folder's name
    # is; U+2215 is no separator, so `a\u2215..` is one name
    mirrored = {"models--..": "models--..", "models--.": "models--.", "models--": "models--",
                "models--a\u2215..": "a\u2215..", "models--..\\..": "models--..\\..", "models--org--ok": "org--ok"}
    for name in HF_NAMES:
        assert_fp16_of(out / mirrored[name] / "model.safetensors", made[name])
    for rel in ("dots../x.safetensors", "-..-/y.safetensors", "linked-file.safetensors", "linked-dir/z.safetensors"):
        assert_fp16_of(out / rel, made[rel])
    assert len(list(out.rglob("*.safetensors"))) == len(HF_NAMES) + 4


def test_refused_names_beside_inputs_are_one_line_each(tmp_path, run_ckpt):
    """Without -o outputs go beside the inputs under the default names, which grow: a name that would be
    too long is that entry's one-line failure, never a traceback of the whole batch."""
    root = tmp_path / "in"
    made = st(root / "ok.safetensors", 1)
    st(root / ("s" * 235 + ".safetensors"), 2)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16")
    assert code == 1 and "Traceback" not in err, err
    assert "1 ok, 0 skipped, 1 failed" in stdout and "name too long" in stdout
    assert_fp16_of(root / "ok-fp16.safetensors", made)
    assert sorted(p.name for p in root.iterdir()) == sorted(["ok.safetensors", "s" * 235 + ".safetensors",
                                                           "ok-fp16.safetensors", ".ckpt-batch.jsonl"])
