"""`ckpt batch`: one operation over every checkpoint of a folder, resumable and failure-isolated.

`discover` finds the checkpoints, `manifest` remembers what is done, `operations` calls each single
command's Python API, `runner` plans the jobs and runs them (in parallel processes with `--jobs N`) and
summarises, `job_run` is one job as every executor runs it, `worker` is one job's process, `ray_pool` runs
jobs as Ray tasks (`--executor ray`), `joblist` lists them for other schedulers and collects their results
(`--plan-only`, `run-job`, `--collect`). The click commands are `ckpt.cli.batch`. Nothing is imported here, so
that loading the CLI stays cheap.
"""
