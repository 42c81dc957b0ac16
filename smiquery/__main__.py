"""``python -m smiquery``: the command-line interface."""

from smiquery.cli import main

if __name__ == "__main__":
    main()
