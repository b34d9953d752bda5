"""The rules of every path a command writes (docs/commands.md "Output paths"): `--report FILE` is never an input,
the output, a file inside the output, a file ckpt did not write or a non-regular file, and it is checked
before any work; a report that cannot be written after the output was published is exit 3, not 2;
`-o EXISTING_FOLDER` means one thing for every command, and --overwrite deletes only what ckpt wrote or
rewrites; the batch manifest is only ever a manifest."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from huggingface_hub import save_torch_state_dict


def one_file(tmp_path: Path, name: str = "m.safetensors") -> Path:
    src = tmp_path / name
    save_file({f"t{i}": torch.randn(8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)}, src)
    return src


def folder_model(tmp_path: Path) -> Path:
    src = tmp_path / "model"
    src.mkdir()
    save_torch_state_dict({f"l{i}": torch.randn(16, 16) for i in range(4)}, src, max_shard_size=3000)
    (src / "config.json").write_text("{}")
    return src


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(result, *words) -> str:
    code, out, err = result
    assert code == 2, (code, out, err)
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for w in words:
        assert w in err, err
    return err


# ------------------------------------------------------------------------------------------ --report


def test_report_naming_the_input_is_refused_and_the_input_kept(tmp_path, run_ckpt):
    src = one_file(tmp_path)
    before = tree(tmp_path)
    refused(run_ckpt("convert", src, "--to", "fp16", "-o", tmp_path / "out.safetensors", "--report", src),
            "--report", "refusing to replace it")
    assert tree(tmp_path) == before  # no output, input unchanged


def test_report_inside_an_input_folder_is_refused(tmp_path, run_ckpt):
    src = folder_model(tmp_path)
    before = tree(tmp_path)
    refused(run_ckpt("inspect", src, "--report", src / "report.json"), "inside the input folder")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("how", ["explicit", "derived"])
def test_report_naming_the_output_is_refused(tmp_path, run_ckpt, how):
    src = one_file(tmp_path)
    before = tree(tmp_path)
    if how == "explicit":  # -o out.pt --report out.pt
        err = refused(run_ckpt("convert", src, "--to", "fp16", "-o", tmp_path / "out.pt", "--report",
                               tmp_path / "out.pt"), "is the output")
    else:  # the default output name, known only once the command plans
        err = refused(run_ckpt("convert", src, "--to", "fp16", "--report", tmp_path / "m-fp16.safetensors"),
                      "would replace the --report file")
    assert err
    assert tree(tmp_path) == before


def test_report_inside_a_folder_output_is_refused_but_beside_a_file_output_is_fine(tmp_path, run_ckpt):
    src = folder_model(tmp_path)
    out = tmp_path / "out"
    assert run_ckpt("convert", src, "--to", "bf16", "-o", out, "-q")[0] == 0
    before = tree(out)
    refused(run_ckpt("convert", src, "--to", "fp16", "-o", out, "--overwrite", "--report", out / "r.json"),
            "would replace the --report file")
    assert tree(out) == before
    single = one_file(tmp_path)
    (tmp_path / "files").mkdir()
    code, _, err = run_ckpt("convert", single, "--to", "fp16", "-o", tmp_path / "files", "-q",
                            "--report", tmp_path / "files" / "r.json")
    assert code == 0, err
    assert json.loads((tmp_path / "files" / "r.json").read_text())["status"] == "ok"
    assert (tmp_path / "files" / "m-fp16.safetensors").is_file()


def test_report_replaces_a_previous_report_but_no_other_file(tmp_path, run_ckpt):
    src = one_file(tmp_path)
    rep = tmp_path / "r.json"
    assert run_ckpt("inspect", src, "--report", rep)[0] == 0
    first = rep.read_text()
    assert run_ckpt("convert", src, "--to", "fp16", "-q", "--report", rep)[0] == 0
    assert rep.read_text() != first and json.loads(rep.read_text())["command"] == "convert"
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}\n')
    refused(run_ckpt("inspect", src, "--report", notes), "is not a ckpt report", "refusing to replace it")
    assert notes.read_text() == '{"mine": 1}\n'


def test_report_naming_a_link_a_fifo_or_a_device_is_refused(tmp_path, run_ckpt):
    src = one_file(tmp_path)
    prior = tmp_path / "prior.json"
    assert run_ckpt("inspect", src, "--report", prior)[0] == 0
    link = tmp_path / "link.json"
    link.symlink_to(prior)
    refused(run_ckpt("inspect", src, "--report", link), "symbolic link")
    assert link.is_symlink()
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    refused(run_ckpt("inspect", src, "--report", fifo), "not a regular file")  # and no hang
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    dev = tmp_path / "null"
    try:
        os.mknod(dev, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except (PermissionError, OSError):
        return  # not root (or no CAP_MKNOD): the FIFO above covers the rule
    refused(run_ckpt("inspect", src, "--report", dev), "not a regular file")
    assert stat.S_ISCHR(os.lstat(dev).st_mode)


def test_report_that_fails_after_the_output_was_written_is_exit_3(tmp_path, run_ckpt, monkeypatch):
    import ckpt.cli.report as cli_report

    src = one_file(tmp_path)
    real = os.replace

    def full_disk(a, b):
        if str(b).endswith("r.json"):
            raise OSError(28, "No space left on device")
        return real(a, b)

    monkeypatch.setattr(cli_report.os, "replace", full_disk)
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "-q", "--report", tmp_path / "r.json")
    out_file = tmp_path / "m-fp16.safetensors"
    assert code == 3 and err.count("\n") == 1, (code, err)
    assert "No space left on device" in err and f"the command itself succeeded and wrote {out_file}" in err
    assert torch.equal(load_file(out_file)["t0"], load_file(src)["t0"].half())  # the output stays
    assert not (tmp_path / "r.json").exists()
    assert [p.name for p in tmp_path.iterdir() if "ckpt-tmp" in p.name] == []


def test_report_in_an_unwritable_folder_is_refused_up_front(tmp_path, run_ckpt, monkeypatch):
    """chmod 555 as a normal user; as root (which permissions do not stop, and whose Python another
    user cannot run here) the folder is made to look unwritable to os.access, the check ckpt makes."""
    import ckpt.io.side_files as side_files

    src = one_file(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(side_files.os, "access",
                            lambda p, mode, **kw: False if Path(p) == locked else real(p, mode, **kw))
    else:
        locked.chmod(0o555)
    refused(run_ckpt("convert", src, "--to", "fp16", "-o", tmp_path / "elsewhere.safetensors",
                     "--report", locked / "r.json"), "--report", "permission denied")
    assert not (tmp_path / "elsewhere.safetensors").exists() and list(locked.iterdir()) == []


# ------------------------------------------------------------------------------ -o EXISTING_FOLDER


@pytest.mark.parametrize("overwrite", [False, True])
def test_existing_foreign_folder_receives_the_output_inside_it(tmp_path, run_ckpt, overwrite):
    """`mkdir of; echo keep > of/precious.txt; ckpt convert FOLDER -o of --overwrite`: precious.txt stays,
    the output lands in of/ under its default name, as it does for a file input."""
    src = folder_model(tmp_path)
    of = tmp_path / "of"
    of.mkdir()
    (of / "precious.txt").write_text("keep")
    code, _, err = run_ckpt("convert", src, "--to", "bf16", "-o", of, "-q", *(["--overwrite"] if overwrite else []))
    assert code == 0, err
    assert (of / "precious.txt").read_text() == "keep"
    assert (of / "model-bf16" / "config.json").is_file() and (of / "model-bf16" / "model.safetensors.index.json").is_file()
    single = one_file(tmp_path)
    assert run_ckpt("convert", single, "--to", "bf16", "-o", of, "-q")[0] == 0
    assert sorted(p.name for p in of.iterdir()) == ["m-bf16.safetensors", "model-bf16", "precious.txt"]


def test_models_folder_holding_one_ckpt_file_among_others_is_written_into(tmp_path, run_ckpt):
    """One file ckpt once wrote there does not make a folder of other models a previous output."""
    src = folder_model(tmp_path)
    models = tmp_path / "models"
    models.mkdir()
    one_file(models, "theirs.safetensors")
    assert run_ckpt("convert", models / "theirs.safetensors", "--to", "fp16", "-o", models, "-q")[0] == 0
    assert (models / "theirs-fp16.safetensors").is_file()  # ckpt's, beside someone else's
    code, _, err = run_ckpt("convert", src, "--to", "bf16", "-o", models, "-q")
    assert code == 0, err
    assert sorted(p.name for p in models.iterdir()) == ["model-bf16", "theirs-fp16.safetensors", "theirs.safetensors"]


def test_overwrite_of_a_previous_output_refuses_files_ckpt_did_not_write(tmp_path, run_ckpt):
    src = folder_model(tmp_path)
    out = tmp_path / "out"
    assert run_ckpt("convert", src, "--to", "bf16", "-o", out, "-q")[0] == 0
    (out / "my-notes.txt").write_text("keep")
    before = tree(out)
    refused(run_ckpt("convert", src, "--to", "fp16", "-o", out, "--overwrite", "-q"),
            "1 file ckpt did not write", "my-notes.txt", "refusing to delete it")
    assert tree(out) == before
    refused(run_ckpt("convert", src, "--to", "fp16", "-o", out, "--overwrite", "--dry-run"), "my-notes.txt")
    (out / "my-notes.txt").unlink()
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", out, "--overwrite", "-q")
    assert code == 0, err
    assert load_file(out / "model-00001-of-00002.safetensors")["l0"].dtype == torch.float16


def test_overwrite_of_a_previous_torch_output_by_its_file_names(tmp_path, run_ckpt):
    """A torch zip carries no ckpt mark: the folder is recognised by the files the new output rewrites."""
    src = folder_model(tmp_path)
    out = tmp_path / "out"
    assert run_ckpt("convert", src, "--to", "bf16", "--format", "torch", "-o", out, "-q")[0] == 0
    names = sorted(p.name for p in out.iterdir())
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "--format", "torch", "-o", out, "--overwrite", "-q")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == names
    shard = next(p for p in out.iterdir() if p.suffix == ".bin")
    assert next(iter(torch.load(shard).values())).dtype == torch.float16


# ----------------------------------------------------------------------------------- batch manifest


def test_batch_manifest_that_is_not_ours_is_refused(tmp_path, run_ckpt):
    root = tmp_path / "in"
    root.mkdir()
    one_file(root)
    out = tmp_path / "out"
    out.mkdir()
    (out / "ckpt-batch.jsonl").write_text("my own notes\n")
    refused(run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q"),
            "ckpt-batch.jsonl", "not a ckpt batch manifest")
    assert (out / "ckpt-batch.jsonl").read_text() == "my own notes\n"
    assert sorted(p.name for p in out.iterdir()) == ["ckpt-batch.jsonl"]
    (out / "ckpt-batch.jsonl").unlink()
    os.mkfifo(out / "ckpt-batch.jsonl")
    refused(run_ckpt("batch", "convert", root, "--to", "fp16", "-o", out, "-q"), "not a regular file")


def test_default_names_of_two_readme_examples_in_a_row_do_not_collide(tmp_path, run_ckpt):
    """merge-lora and merge-lora --to bf16 (and convert to a folder in each --format) get their own names."""
    base = tmp_path / "base.safetensors"
    save_file({"lin.weight": torch.randn(6, 4)}, base)
    lora = tmp_path / "style.safetensors"
    save_file({"base_model.model.lin.lora_A.weight": torch.randn(2, 4),
               "base_model.model.lin.lora_B.weight": torch.randn(6, 2)}, lora)
    assert run_ckpt("merge-lora", base, lora, "-q")[0] == 0
    code, _, err = run_ckpt("merge-lora", base, lora, "--to", "bf16", "-q")
    assert code == 0, err
    plain, bf16 = load_file(tmp_path / "base-merged.safetensors"), load_file(tmp_path / "base-merged-bf16.safetensors")
    assert torch.equal(plain["lin.weight"].bfloat16(), bf16["lin.weight"])
    src = folder_model(tmp_path)
    assert run_ckpt("convert", src, "--to", "fp16", "-q")[0] == 0
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "--format", "torch", "-q")
    assert code == 0, err
    assert (tmp_path / "model-fp16").is_dir() and (tmp_path / "model-fp16-torch").is_dir()


def test_run_job_writes_its_result_only_where_plan_only_put_it(tmp_path, run_ckpt):
    """A hand-edited SPEC cannot make `batch run-job` replace another file with its result."""
    root = tmp_path / "in"
    root.mkdir()
    one_file(root)
    code, stdout, err = run_ckpt("batch", "convert", root, "--to", "fp16", "-o", tmp_path / "out", "--plan-only",
                                 "--json")
    assert code == 0, err
    argv = json.loads(stdout.splitlines()[0])["argv"]
    spec = json.loads(argv[argv.index("run-job") + 1])
    victim = tmp_path / "victim.json"
    victim.write_text('{"mine": 1}')
    for path, words in [(victim, "not a file of a .ckpt-batch-results folder"),
                        (tmp_path / "out" / ".ckpt-batch-results" / "x.json", None)]:
        if words is None:  # in the right folder but someone else's file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text('{"mine": 1}')
            words = "is not a ckpt batch job result"
        bad = {**spec, "report": {**spec["report"], "path": str(path)}}
        refused(run_ckpt("batch", "run-job", json.dumps(bad)), words)
        assert path.read_text() == '{"mine": 1}'
        assert not Path(spec["out"]).exists()
    refused(run_ckpt("batch", "run-job", json.dumps({**spec, "report": {"path": 3}})), "report is not the one")
    code, _, err = run_ckpt("batch", "run-job", json.dumps(spec))  # the real one
    assert code == 0, err
    assert json.loads(Path(spec["report"]["path"]).read_text())["result"]
