"""`python -m ckpt.cli ...`: the same as the `ckpt` console script."""

from ckpt.cli.main import main

if __name__ == "__main__":
    main()
