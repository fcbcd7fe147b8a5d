"""`python -m server`: the same as the `moe-serve` command."""

from server.cli import main

if __name__ == "__main__":
    main()
