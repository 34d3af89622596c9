"""``python -m sparkdl._internal.rank WORKDIR``: a rank started as a fresh interpreter."""

from sparkdl._internal.rank.main import exit_process, main

if __name__ == "__main__":
    exit_process(main())
