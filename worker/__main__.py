"""`python -m zeroserve.worker ...`: the same as `zeroserve worker ...`."""

from zeroserve.common.cli import worker_main

if __name__ == "__main__":
    worker_main()
