"""``python -m sparkdl.rank WORKDIR``: a rank started as a fresh interpreter."""

from sparkdl.rank.main import exit_process, main

if __name__ == "__main__":
    exit_process(main())
