"""`python -m worker ...`: the same as `zeroserve worker ...`."""

from common.cli import worker_main

if __name__ == "__main__":
    worker_main()
