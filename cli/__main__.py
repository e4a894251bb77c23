"""`python -m zeroserve.cli ARGS` is `zeroserve ARGS` (how `serve` starts its children)."""

from zeroserve.cli.main import main

if __name__ == "__main__":
    main(prog_name="zeroserve")
